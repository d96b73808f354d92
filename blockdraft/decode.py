"""The speculative decoding loop: prefill, then draft -> verify -> accept, step by step.

One loop serves every method: `ar` is the proposer that drafts nothing, so a step
verifies a block of one token. Each row of the batch is an independent sequence
with its own length, acceptance and stopping point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .errors import BlockdraftError
from .models.transformer import Transformer
from .proposers import Proposer
from .sampling import SamplingParams, acceptance, sample_tokens


@dataclass
class Request:
    """One sequence to continue: prompt token ids and how to generate."""

    prompt_ids: list[int]
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    # Called with the row's generated ids after each step; returns how many of them to
    # keep if a stop condition (e.g. a stop string) is met, else None.
    stop_check: Callable[[list[int]], int | None] | None = None


@dataclass
class SequenceState:
    output_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Step:
    """What one step of the loop did: newly emitted tokens per request index."""

    new_ids: dict[int, list[int]]
    finished: dict[int, bool]
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    prefill: bool = False


def _emit(req: Request, state: SequenceState, tokens: list[int]) -> list[int]:
    """Append tokens to a row, cutting at a stop token, a stop condition or the length limit."""
    room = req.max_new_tokens - len(state.output_ids)
    kept = []
    for tok in tokens[:room]:
        kept.append(tok)
        if tok in req.stop_token_ids:
            state.finish_reason = "stop"
            break
    state.output_ids.extend(kept)
    if req.stop_check is not None and not state.finished:
        keep = req.stop_check(state.output_ids)
        if keep is not None:
            cut = len(state.output_ids) - keep
            del state.output_ids[keep:]
            kept = kept[: max(0, len(kept) - cut)]
            state.finish_reason = "stop"
    if not state.finished and len(state.output_ids) >= req.max_new_tokens:
        state.finish_reason = "length"
    return kept


def check_requests(target: Transformer, requests: list[Request], block_size: int) -> int:
    """Validate the batch; return the cache length it needs."""
    if not requests:
        raise BlockdraftError("no prompts given")
    context = target.config.max_position_embeddings
    for req in requests:
        if not req.prompt_ids:
            raise BlockdraftError("empty prompt: give at least one token")
        if req.max_new_tokens < 1:
            raise BlockdraftError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if len(req.prompt_ids) + req.max_new_tokens > context:
            raise BlockdraftError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                f"exceeds the model's context of {context} tokens")
        vocab = target.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise BlockdraftError(f"prompt token ids must lie in [0, {vocab})")
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    # verify may run a full block past the last kept token
    return longest + block_size


@torch.inference_mode()
def generate_steps(target: Transformer, proposer: Proposer, requests: list[Request],
                   block_size: int = 16, states: list[SequenceState] | None = None,
                   batch_size: int | None = None) -> Iterator[Step]:
    """Run the loop over requests, yielding one `Step` per target forward.

    `block_size` is the verified block length: the last committed token plus
    block_size - 1 drafts (1 for autoregressive decoding). The batch has `batch_size`
    slots (default: one per request); when a sequence finishes and requests are still
    waiting, the next one is prefilled into its slot (continuous batching). Final
    outputs accumulate in `states` (pass a list to read them), indexed like `requests`.
    """
    if proposer.max_block_size is None:
        block_size = 1
    elif not 2 <= block_size <= proposer.max_block_size:
        raise BlockdraftError(f"block size {block_size} must be between 2 and the drafter's "
                              f"trained block size {proposer.max_block_size}")
    max_len = check_requests(target, requests, block_size)
    if states is None:
        states = []
    states[:] = [SequenceState() for _ in requests]
    device = target.device
    batch = min(batch_size or len(requests), len(requests))
    capture = proposer.capture_layers
    target.ensure_caches(batch, max_len)
    proposer.reset(batch, max_len)
    slot_req = list(range(batch))  # which request each slot serves
    waiting = batch  # index of the next request to start
    params = [requests[i].sampling for i in slot_req]
    committed = torch.zeros(batch, dtype=torch.long, device=device)  # tokens in the target cache
    pending = torch.zeros(batch, dtype=torch.long, device=device)  # last emitted token, not yet cached

    def prefill(first_slot: int, count: int) -> dict[int, list[int]]:
        """Prefill requests of slots first_slot..+count in one right-padded forward; each
        first token comes from the logits at the request's last prompt position."""
        rows = slice(first_slot, first_slot + count)
        reqs = [requests[i] for i in slot_req[rows]]
        lengths = torch.tensor([len(r.prompt_ids) for r in reqs], device=device)
        width = int(lengths.max())
        tokens = torch.zeros(count, width, dtype=torch.long, device=device)
        for b, r in enumerate(reqs):
            tokens[b, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
        positions = torch.arange(width, device=device).expand(count, -1)
        hidden, features = target(tokens, positions, capture, rows=rows)
        last = hidden[torch.arange(count, device=device), lengths - 1]
        first = sample_tokens(target.logits(last)[:, None], lengths[:, None], params[rows])[:, 0]
        proposer.observe(tokens, features, positions, rows=rows)
        committed[rows], pending[rows] = lengths, first
        return {i: _emit(requests[i], states[i], [int(t)]) for i, t in zip(slot_req[rows], first.tolist())}

    t0 = time.perf_counter()
    new_ids = prefill(0, batch)
    elapsed = time.perf_counter() - t0
    yield Step(new_ids, {i: states[i].finished for i in new_ids}, verify_seconds=elapsed,
               total_seconds=elapsed, prefill=True)

    n = block_size - 1
    offsets = torch.arange(block_size, device=device)
    while not all(states[i].finished for i in slot_req) or waiting < len(requests):
        t0 = time.perf_counter()
        drafts = proposer.propose(pending, committed, n)
        t1 = time.perf_counter()
        block = torch.cat([pending[:, None], drafts], dim=1)
        positions = committed[:, None] + offsets
        hidden, features = target(block, positions, capture)
        target_ids = sample_tokens(target.logits(hidden), positions + 1, params)
        accepted = acceptance(drafts, target_ids)
        t2 = time.perf_counter()
        proposer.observe(block, features, positions)

        accepted_list, target_list, drafts_list = accepted.tolist(), target_ids.tolist(), drafts.tolist()
        new_ids = {}
        for b, i in enumerate(slot_req):
            if states[i].finished:
                continue
            a = accepted_list[b]
            states[i].acceptance_lengths.append(a + 1)
            new_ids[i] = _emit(requests[i], states[i], drafts_list[b][:a] + [target_list[b][a]])
        # Finished rows stay frozen: they are recomputed at the same positions, harmlessly.
        active = torch.tensor([not states[i].finished for i in slot_req], device=device)
        bonus = target_ids.gather(1, accepted[:, None])[:, 0]
        committed.copy_(torch.where(active, committed + accepted + 1, committed))
        pending.copy_(torch.where(active, bonus, pending))
        for b in range(batch):  # continuous batching: a free slot takes the next request
            if states[slot_req[b]].finished and waiting < len(requests):
                slot_req[b], params[b] = waiting, requests[waiting].sampling
                waiting += 1
                new_ids.update(prefill(b, 1))
        t3 = time.perf_counter()
        yield Step(new_ids, {i: states[i].finished for i in new_ids}, draft_seconds=t1 - t0,
                   verify_seconds=t2 - t1, total_seconds=t3 - t0)
