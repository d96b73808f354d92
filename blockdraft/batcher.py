"""Continuous batching: one batcher over a `DecodeLoop` for every caller (queue -> admit ->
step -> deliver finished `(key, state)` pairs), and `generate_steps`, the offline loop over a
list of requests."""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch

from .costs import clock
from .decode import DecodeLoop, resolve_block
from .errors import BlockdraftError
from .models.transformer import Transformer
from .proposers import Proposer
from .sequences import Request, SequenceState, Step, check_requests


class Batcher:
    """Continuous batching over one `DecodeLoop`: queue -> admit -> step -> deliver.

    Requests are `submit`ted under caller-chosen keys and wait in arrival order; `admit`
    prefills as many as there are free slots (together), `decode` runs one loop step over the
    running rows, and both release the rows that finished and hand them back in `Step.done` as
    (key, SequenceState) pairs; `step` is both. `generate_steps`, the server's scheduler (which
    adds only its threads, queue bound and HTTP) and regeneration all drive their loop through
    this class."""

    def __init__(self, loop: DecodeLoop):
        self.loop = loop
        self.waiting: collections.deque[tuple] = collections.deque()  # (key, Request, SequenceState)

    def submit(self, key, request: Request, state: SequenceState | None = None) -> SequenceState:
        state = SequenceState() if state is None else state
        self.waiting.append((key, request, state))
        return state

    def cancel(self, key) -> SequenceState | None:
        """Drop `key`, waiting or running; returns its state (None if unknown)."""
        for item in self.waiting:
            if item[0] == key:
                self.waiting.remove(item)
                return item[2]
        return self.loop.release(key)

    @property
    def room(self) -> int:
        """Requests that would be admitted now beyond those waiting (free slots not yet spoken for)."""
        return max(0, len(self.loop.free_slots) - len(self.waiting))

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.loop.active > 0

    def admit(self) -> Step:
        """Prefill waiting requests into the free slots. A batch the loop refuses (a prompt that
        does not fit, checked before any slot changes) comes back in `Step.rejected`."""
        items = [self.waiting.popleft() for _ in range(min(len(self.waiting), len(self.loop.free_slots)))]
        if not items:
            return Step({}, {})
        t0 = clock(self.loop.target.device)
        try:
            new_ids = self.loop.admit(items)
        except BlockdraftError as exc:
            return Step({}, {}, rejected={key: str(exc) for key, _, _ in items})
        elapsed = clock(self.loop.target.device) - t0
        finished = {key: state.finished for key, _, state in items}
        return Step(
            new_ids,
            finished,
            prefill_seconds=elapsed,
            total_seconds=elapsed,
            prefill=True,
            done=self._release(k for k, f in finished.items() if f),
        )

    def decode(self) -> Step:
        """One draft -> verify -> accept step over the running rows (none: an empty Step)."""
        if not self.loop.active:
            return Step({}, {})
        step = self.loop.step()
        step.done = self._release(k for k, f in step.finished.items() if f)
        return step

    def step(self) -> Step:
        """`admit`, then `decode`, as one Step (a row admitted here may emit from both)."""
        first, step = self.admit(), self.decode()
        for key, ids in first.new_ids.items():
            step.new_ids[key] = ids + step.new_ids.get(key, [])
        step.finished = {**first.finished, **step.finished}
        step.done, step.rejected = first.done + step.done, first.rejected
        step.prefill_seconds += first.prefill_seconds
        step.total_seconds += first.total_seconds
        step.prefill = first.prefill
        return step

    def _release(self, keys) -> list[tuple]:
        return [(key, self.loop.release(key)) for key in list(keys)]


@torch.inference_mode()
def generate_steps(
    target: Transformer,
    proposer: Proposer,
    requests: list[Request],
    block_size: int = 16,
    states: list[SequenceState] | None = None,
    batch_size: int | None = None,
    shared_prefix: list[int] | None = None,
    adaptive: bool = False,
) -> Iterator[Step]:
    """Run the loop over requests, yielding one `Step` per target forward (the first one also
    prefills the first batch).

    `block_size` is the verified block length: the last committed token plus
    block_size - 1 drafts (1 for autoregressive decoding). The batch has `batch_size`
    slots (default: one per request); when a sequence finishes and requests are still
    waiting, the next one is prefilled into its slot (continuous batching). Final
    outputs accumulate in `states` (pass a list to read them), indexed like `requests`.
    `shared_prefix`: token ids many prompts start with, prefilled once (`DecodeLoop.share_prefix`).
    `adaptive`: the speculation policy sizes each step by measured speed (`blockdraft.policy`).
    """
    block_size = resolve_block(proposer, block_size)
    max_len = check_requests(target, requests, block_size)
    if states is None:
        states = []
    states[:] = [SequenceState() for _ in requests]
    batch = min(batch_size or len(requests), len(requests))
    batcher = Batcher(DecodeLoop(target, proposer, block_size, batch, max_len, adaptive=adaptive))
    if shared_prefix:
        batcher.loop.share_prefix(shared_prefix)
    for i, (req, state) in enumerate(zip(requests, states, strict=False)):
        batcher.submit(i, req, state)
    while batcher.busy:
        yield batcher.step()
