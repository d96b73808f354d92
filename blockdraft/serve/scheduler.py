"""The server's scheduler: one thread drives a `DecodeLoop` with continuous batching.

Requests wait in a bounded queue; between two verify steps the scheduler drops
cancelled requests, prefills waiting ones into free slots, runs one step over the
running batch and hands every request its newly accepted tokens at once. The
speculation policy picks each step's block size from the running batch size.
"""

from __future__ import annotations

import collections
import itertools
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..costs import PositionAcceptance, StepCosts
from ..decode import DecodeLoop, SequenceState, default_sort_every, resolve_block
from ..engine import Engine
from ..errors import BlockdraftError


class QueueFull(BlockdraftError):
    """The waiting queue is at its bound: the caller should answer 429."""


class ShuttingDown(BlockdraftError):
    """The server no longer takes requests."""


@dataclass
class Handle:
    """One request's life in the scheduler. `on_event(handle)` is called from the
    scheduler thread whenever tokens were accepted or the request ended."""

    id: int
    row: object  # engine.Row: the Request, its stop strings and its text stream
    on_event: Callable[["Handle"], None]
    state: SequenceState = field(default_factory=SequenceState)
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    cancelled: bool = False
    error: str | None = None
    error_status: int = 500

    @property
    def done(self) -> bool:
        return self.state.finished or self.cancelled or self.error is not None


class SpeculationPolicy:
    """Chooses the block size of each step from the running batch size.

    It keeps the measured seconds of a step per (batch size, block size) and the
    per-position acceptance rates of the drafter, and picks the block size with the
    most expected tokens per second: batch * E[tokens per row | B] / t(batch, B), where
    E[tokens | B] = 1 + sum_k prod_{j<=k} p_j. The first batch size seen tries every
    block size once. A new batch size first runs without speculation; the other block
    sizes' costs are then estimated from their cost relative to no speculation at the
    nearest batch size where both were measured, and a block is only run (and so
    measured) there when its estimate makes it the best. A small fraction of steps
    re-measures a neighbour of the best. A proposer that estimates its own expected tokens
    from its draft probabilities (trees, cut chains: `Proposer.expected_tokens`) is asked
    instead of the per-position rates; for a tree the block size is its node budget plus one.
    """

    def __init__(self, max_block: int, adaptive: bool = True, explore: float = 0.05, seed: int = 0,
                 estimate: Callable[[int], float | None] | None = None):
        self.max_block = max_block
        self.adaptive = adaptive and max_block > 1
        self.choices = (sorted({1, *[b for b in (2, 4, 8, 16, 32, 64) if b < max_block], max_block})
                        if max_block > 1 else [1])
        self.explore = explore
        self.rng = random.Random(seed)
        self.costs = StepCosts()  # EMA of whole-step seconds (drafting included) per (batch, block)
        self.estimate = estimate
        self.acceptance = PositionAcceptance(max_block)

    @property
    def cost(self) -> dict[tuple[int, int], float]:
        return self.costs.seconds

    def expected_tokens(self, block: int) -> float:
        estimated = self.estimate(block) if self.estimate is not None and block > 1 else None
        if estimated is not None:
            return estimated
        return self.acceptance.expected_tokens(block)

    def choose(self, batch: int) -> int:
        if not self.adaptive:
            return self.max_block
        costs = {b: self.estimated_cost(batch, b) for b in self.choices}
        untried = [b for b, c in costs.items() if c is None]
        if untried:
            if (batch, 1) not in self.cost and any(k > 1 and (b, 1) in self.cost for b, k in self.cost):
                return 1  # a new batch size: measure the base cost, estimate the rest from it
            return untried[-1]  # longest first: that is the default behaviour
        best = max(self.choices, key=lambda b: self.expected_tokens(b) / costs[b])
        if self.rng.random() < self.explore:
            i = self.choices.index(best) + self.rng.choice((-1, 1))
            return self.choices[min(max(i, 0), len(self.choices) - 1)]
        return best

    def estimated_cost(self, batch: int, block: int) -> float | None:
        """Seconds of a (batch, block) step: measured, else the block's cost relative to no
        speculation at the nearest batch size where both were measured, times this batch
        size's measured cost without speculation; None when neither is known."""
        if (batch, block) in self.cost:
            return self.cost[(batch, block)]
        base = self.cost.get((batch, 1))
        known = [b for (b, k) in self.cost if k == block and (b, 1) in self.cost]
        if base is None or not known:
            return None
        near = min(known, key=lambda b: (abs(b - batch), b))
        return base * self.cost[(near, block)] / self.cost[(near, 1)]

    def record(self, batch: int, block: int, seconds: float, outcomes: list[tuple[int, int]]):
        self.costs.record(batch, block, seconds)
        for accepted, drafted in outcomes:
            self.acceptance.record(accepted, drafted)


class Scheduler:
    def __init__(self, engine: Engine, *, method: str = "dflash", max_batch: int = 8, max_queue: int = 64,
                 max_model_len: int = 2048, block_size: int | None = None, adaptive: bool = True,
                 metrics=None):
        self.engine, self.method = engine, method
        self.proposer = engine.proposer(method)
        block = resolve_block(self.proposer, block_size, clamp=True)
        self.max_model_len = max_model_len
        self.loop = DecodeLoop(engine.target, self.proposer, block, max_batch, max_model_len + block,
                               sort_every=default_sort_every(self.proposer, max_batch))
        self.policy = SpeculationPolicy(self.loop.block_size, adaptive=adaptive,
                                        estimate=self.proposer.expected_tokens)
        engine.target.warm_up(max_batch * self.loop.block_size)  # one-off costs out of the policy's timings
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = metrics
        self.waiting: collections.deque[Handle] = collections.deque()
        self.running: dict[int, Handle] = {}
        self.cond = threading.Condition()
        self.accepting = True
        self.stopping = False
        self.stopped = threading.Event()  # set when the loop has returned
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None  # the thread that steps the loop, once started
        self.last_block = self.loop.block_size

    # ---- public, any thread ----------------------------------------------------------

    def start(self):
        """Step the loop on a thread of its own (for an app that runs in the main thread)."""
        self.thread = threading.Thread(target=self._run, name="blockdraft-scheduler", daemon=True)
        self.thread.start()

    def run(self):
        """Step the loop on the calling thread until `shutdown`. `blockdraft serve` calls this from
        the main thread and runs the HTTP server on another: torch's decode steps measured
        slower on a second thread (benchmarks/scheduler_thread.py)."""
        self.thread = threading.current_thread()
        self._run()

    @property
    def alive(self) -> bool:
        """True while some thread steps the loop."""
        return self.thread is not None and self.thread.is_alive() and not self.stopped.is_set()

    def submit(self, row, on_event: Callable[[Handle], None]) -> Handle:
        req = row.request
        if len(req.prompt_ids) + req.max_new_tokens > self.max_model_len:
            raise BlockdraftError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_new_tokens}) "
                                  f"exceeds the server's context of {self.max_model_len} tokens")
        with self.cond:
            if not self.accepting:
                raise ShuttingDown("the server is shutting down")
            # requests waiting for a batch slot that is free now are not queued: they join at the next step
            free = max(0, self.max_batch - len(self.running))
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull(f"the waiting queue is full ({self.max_queue} requests); retry later")
            handle = Handle(next(self.ids), row, on_event)
            self.waiting.append(handle)
            self.cond.notify()
        return handle

    def cancel(self, handle: Handle):
        """Stop a request (e.g. its client went away); its slot is freed before the next step."""
        with self.cond:
            if not handle.done:
                handle.cancelled = True
                self.cond.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def batch_size(self) -> int:
        return len(self.running)

    def shutdown(self, grace: float = 30.0):
        """Stop accepting; let running and queued requests finish for up to `grace`
        seconds, then cancel what is left and stop the thread."""
        with self.cond:
            self.accepting = False
            self.cond.notify()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with self.cond:
                if not self.waiting and not self.running:
                    break
            time.sleep(0.05)
        with self.cond:
            for h in list(self.waiting) + list(self.running.values()):
                h.cancelled = True
            self.stopping = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.stopped.wait(timeout=10)  # (the thread may be the main one, which lives on: no join)

    # ---- the scheduler thread --------------------------------------------------------

    def _run(self):
        while True:
            with self.cond:
                while not self.stopping and not self.waiting and not self.running:
                    self.cond.wait()
                if self.stopping:
                    for h in list(self.waiting) + list(self.running.values()):
                        self._finish(h)
                    self.waiting.clear()
                    self.running.clear()
                    self.stopped.set()
                    return
                for h in [h for h in self.running.values() if h.cancelled]:
                    self.loop.release(h.id)
                    del self.running[h.id]
                    self._finish(h)
                while self.waiting and self.waiting[0].cancelled:
                    self._finish(self.waiting.popleft())
                admit = []
                while self.waiting and len(admit) < len(self.loop.free_slots):
                    h = self.waiting.popleft()
                    if h.cancelled:
                        self._finish(h)
                    else:
                        admit.append(h)
            try:
                self._advance(admit)
            except Exception as exc:  # a bug must not hang every client: fail the batch, keep serving
                with self.cond:
                    failed = admit + list(self.running.values())
                    self.running.clear()
                for h in failed:
                    h.error = f"internal error: {type(exc).__name__}: {exc}"
                    self.loop.release(h.id)
                    self._finish(h)

    @torch.inference_mode()  # (grad mode is per thread: the loop's own, as in `generate_steps`)
    def _advance(self, admit: list[Handle]):
        if admit:
            try:
                new = self.loop.admit([(h.id, h.row.request, h.state) for h in admit])
            except BlockdraftError as exc:  # checked before any slot changes: only these fail
                for h in admit:
                    h.error, h.error_status = str(exc), 400
                    self._finish(h)
                new = {}
            else:
                with self.cond:  # `running` is read by other threads (shutdown, metrics)
                    for h in admit:
                        self.running[h.id] = h
            self._deliver(new)
        if not self.running:
            return
        batch = len(self.running)
        block = self.policy.choose(batch)
        self.last_block = block
        step = self.loop.step(block)
        outcomes = [self.running[k].state.accepted_per_step[-1] for k in step.new_ids if k in self.running]
        self.policy.record(batch, block, step.total_seconds, outcomes)
        if self.metrics is not None:
            self.metrics.observe_step(batch, block, outcomes)
        self._deliver({**step.new_ids, **{k: [] for k in step.failed}})

    def _deliver(self, new_ids: dict):
        now = time.perf_counter()
        for key in new_ids:
            h = self.running.get(key)
            if h is None:
                continue
            if h.first_token_at is None and h.state.output_ids:
                h.first_token_at = now
            if h.state.error:  # this request alone failed (its sampling): the batch went on
                h.error, h.error_status = f"this request failed: {h.state.error}", 400
            if h.state.finished:
                self.loop.release(key)
                with self.cond:
                    del self.running[key]
                self._finish(h)
            else:
                h.on_event(h)

    def _finish(self, h: Handle):
        h.finished_at = time.perf_counter()
        h.on_event(h)
