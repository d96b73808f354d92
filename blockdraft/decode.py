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
    """What one step of the loop did. `new_ids[b]` are row b's newly emitted tokens."""

    new_ids: list[list[int]]
    finished: list[bool]
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
                   block_size: int = 16, states: list[SequenceState] | None = None) -> Iterator[Step]:
    """Run the loop for a batch of requests, yielding one `Step` per target forward.

    `block_size` is the verified block length: the last committed token plus
    block_size - 1 drafts (1 for autoregressive decoding). Final outputs accumulate in
    `states` (pass a list to read them).
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
    device, batch = target.device, len(requests)
    params = [r.sampling for r in requests]
    capture = proposer.capture_layers
    target.ensure_caches(batch, max_len)
    proposer.reset(batch, max_len)

    # Prefill: all prompts right-padded into one forward; each row's first token
    # comes from the logits at its last prompt position.
    t0 = time.perf_counter()
    lengths = torch.tensor([len(r.prompt_ids) for r in requests], device=device)
    width = int(lengths.max())
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    for b, r in enumerate(requests):
        tokens[b, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
    positions = torch.arange(width, device=device).expand(batch, -1)
    hidden, features = target(tokens, positions, capture)
    last = hidden[torch.arange(batch, device=device), lengths - 1]
    first = sample_tokens(target.logits(last)[:, None], lengths[:, None], params)[:, 0]
    proposer.observe(tokens, features, positions)
    new_ids = [_emit(r, s, [int(first[b])]) for b, (r, s) in enumerate(zip(requests, states))]
    committed = lengths.clone()  # tokens whose keys/values are in the target cache
    pending = first.clone()  # each row's last emitted token, not yet in the cache
    yield Step(new_ids, [s.finished for s in states], total_seconds=time.perf_counter() - t0,
               verify_seconds=time.perf_counter() - t0, prefill=True)

    n = block_size - 1
    offsets = torch.arange(block_size, device=device)
    while not all(s.finished for s in states):
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
        new_ids = []
        for b, (req, state) in enumerate(zip(requests, states)):
            if state.finished:
                new_ids.append([])
                continue
            a = accepted_list[b]
            state.acceptance_lengths.append(a + 1)
            new_ids.append(_emit(req, state, drafts_list[b][:a] + [target_list[b][a]]))
        # Finished rows stay frozen: they are recomputed at the same positions, harmlessly.
        active = torch.tensor([not s.finished for s in states], device=device)
        bonus = target_ids.gather(1, accepted[:, None])[:, 0]
        committed = torch.where(active, committed + accepted + 1, committed)
        pending = torch.where(active, bonus, pending)
        t3 = time.perf_counter()
        yield Step(new_ids, [s.finished for s in states], draft_seconds=t1 - t0,
                   verify_seconds=t2 - t1, total_seconds=t3 - t0)

