"""Prometheus metrics of the server (one registry per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..costs import PositionAcceptance

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, scheduler_ref=lambda: None, max_block: int = 16, precision: dict | None = None):
        r = self.registry = CollectorRegistry()
        p = "blockdraft_"
        if precision is not None:  # what the target runs in and why (`Engine.precision`), as an info gauge
            info = Gauge(
                p + "target_precision_info",
                "The target's dtype, why it was chosen, whether speculation is bit-exact, its step and draft pass",
                ["dtype", "exact", "reason", "step", "draft"],
                registry=r,
            )
            info.labels(
                precision["dtype"],
                str(precision["exact"]).lower(),
                precision["dtype_reason"],
                precision.get("step", "eager"),
                precision.get("draft") or "none",
            ).set(1)
        self.requests = Counter(p + "requests", "Finished HTTP generation requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Submission to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "Mean seconds per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "request_latency_seconds", "Submission to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a batch slot", registry=r)
        self.batch_size = Gauge(p + "running_batch_size", "Requests in the running batch", registry=r)
        self.block_size = Gauge(p + "speculation_block_size", "Block size of the last verify step", registry=r)
        self.steps = Counter(p + "verify_steps", "Verify steps run", registry=r)
        self.acceptance = Histogram(
            p + "acceptance_length",
            "Tokens committed per row per verify step",
            buckets=tuple(range(1, max_block + 1)),
            registry=r,
        )
        self.drafted = Counter(
            p + "spec_drafted_tokens", "Draft tokens verified, by position in the block", ["position"], registry=r
        )
        self.accepted = Counter(
            p + "spec_accepted_tokens", "Draft tokens accepted, by position in the block", ["position"], registry=r
        )
        self.position_rate = Gauge(
            p + "spec_position_acceptance_rate",
            "P(draft k accepted | drafts 1..k-1 accepted), as the benchmark reports it",
            ["position"],
            registry=r,
        )
        self._scheduler = scheduler_ref
        self._positions = PositionAcceptance(max_block)

    def observe_step(self, batch: int, block: int, outcomes: list[tuple[int, int]]):
        """Called by the scheduler thread after every verify step."""
        self.steps.inc()
        self.block_size.set(block)
        for accepted, drafted in outcomes:
            self.acceptance.observe(accepted + 1)
            self._positions.record(accepted, drafted)
            for k in range(1, drafted + 1):
                self.drafted.labels(str(k)).inc()
                if k <= accepted:
                    self.accepted.labels(str(k)).inc()
        for k, (rate, reached) in enumerate(
            zip(self._positions.rates(), self._positions.reached, strict=False), start=1
        ):
            if reached:
                self.position_rate.labels(str(k)).set(rate)

    def observe_request(self, endpoint: str, status: int, handle=None):
        self.requests.labels(endpoint, str(status)).inc()
        if handle is None:
            return
        n = len(handle.state.output_ids)
        self.prompt_tokens.inc(len(handle.row.request.prompt_ids))
        self.generation_tokens.inc(n)
        if handle.first_token_at is not None:
            self.ttft.observe(handle.first_token_at - handle.submitted)
            if handle.finished_at is not None:
                self.e2e.observe(handle.finished_at - handle.submitted)
                if n > 1:
                    self.tpot.observe((handle.finished_at - handle.first_token_at) / (n - 1))

    def render(self) -> bytes:
        sched = self._scheduler()
        if sched is not None:
            self.queue_depth.set(sched.queue_depth)
            self.batch_size.set(sched.batch_size)
        return generate_latest(self.registry)
