"""The server's scheduler: one thread drives a `DecodeLoop` with continuous batching.

Requests wait in a bounded queue; between two verify steps the scheduler drops
cancelled requests, prefills waiting ones into free slots, runs one step over the
running batch and hands every request its newly accepted tokens at once. The
loop's speculation policy (`blockdraft.policy`, adaptive unless `--speculation fixed`)
sizes each step from the measured costs at the running batch size.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from collections.abc import Callable

import torch

from ..batcher import Batcher
from ..decode import DecodeLoop, default_sort_every
from ..engine import Engine
from ..errors import BlockdraftError
from ..sequences import SequenceState
from ..spec import SpecConfig


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
    on_event: Callable[[Handle], None]
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


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        method: str | SpecConfig = "dflash",
        max_batch: int = 8,
        max_queue: int = 64,
        max_model_len: int = 2048,
        block_size: int | None = None,
        adaptive: bool = True,
        metrics=None,
    ):
        """`method`: a method string, sized by `block_size` and `adaptive`, or a whole `SpecConfig`
        (its block and mode as given); a block above the drafter's trained size is lowered to it."""
        if not isinstance(method, SpecConfig):
            method = SpecConfig(method, block_size, adaptive=adaptive or None)
        self.engine, self.method = engine, method.method
        spec = replace(method, clamp=True).build(engine)
        self.proposer, block = spec.proposer, spec.block
        self.max_model_len = max_model_len
        self.loop = DecodeLoop(
            engine.target,
            self.proposer,
            block,
            max_batch,
            max_model_len + block,
            sort_every=default_sort_every(self.proposer, max_batch),
            adaptive=spec.adaptive,
        )
        self.batcher = Batcher(self.loop)  # queue -> admit -> step -> deliver; this class adds threads and bounds
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
            raise BlockdraftError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_new_tokens}) "
                f"exceeds the server's context of {self.max_model_len} tokens"
            )
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
                    self.batcher.cancel(h.id)
                    del self.running[h.id]
                    self._finish(h)
                admit = []
                while self.waiting and len(admit) < self.batcher.room:
                    h = self.waiting.popleft()
                    if h.cancelled:
                        self._finish(h)
                    else:
                        admit.append(h)
                        self.running[h.id] = h  # (`running` is read by other threads: shutdown, metrics)
            for h in admit:
                self.batcher.submit(h.id, h.row.request, h.state)
            try:
                self._advance()
            except Exception as exc:  # a bug must not hang every client: fail the batch, keep serving
                with self.cond:
                    failed = list(self.running.values())
                    self.running.clear()
                for h in failed:
                    h.error = f"internal error: {type(exc).__name__}: {exc}"
                    self.batcher.cancel(h.id)
                    self._finish(h)

    @torch.inference_mode()  # (grad mode is per thread: the loop's own, as in `generate_steps`)
    def _advance(self):
        admitted = self.batcher.admit()
        for key, why in admitted.rejected.items():  # checked before any slot changed: only these fail
            with self.cond:
                h = self.running.pop(key)
            h.error, h.error_status = why, 400
            self._finish(h)
        self._deliver(admitted)
        if not self.running:
            return
        step = self.batcher.decode()
        if self.metrics is not None:
            outcomes = [self.running[k].state.accepted_per_step[-1] for k in step.new_ids if k in self.running]
            self.metrics.observe_step(step.batch, step.block_size, outcomes)
        self._deliver(step)

    def _deliver(self, step):
        """Hand each request of a step its news: new tokens, its end (released by the batcher), or
        its own failure (its sampling: the batch went on)."""
        now = time.perf_counter()
        done = dict(step.done)
        for key in {**step.new_ids, **step.failed, **done}:
            h = self.running.get(key)
            if h is None:
                continue
            if h.first_token_at is None and h.state.output_ids:
                h.first_token_at = now
            if h.state.error:
                h.error, h.error_status = f"this request failed: {h.state.error}", 400
            if key in done:
                with self.cond:
                    del self.running[key]
                self._finish(h)
            else:
                h.on_event(h)

    def _finish(self, h: Handle):
        h.finished_at = time.perf_counter()
        h.on_event(h)
