"""What the decoding loop is asked and what it writes back, per sequence.

A `Request` is one prompt and how to continue it; a `SequenceState` is what came out of it
(tokens, per-step acceptance, finish reason, log-probabilities); a `Step` reports one round of
the loop over all rows. `emit` is the one place tokens are appended to a row (stop tokens, stop
conditions, the length limit) and `check_requests` the one place a batch is validated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from .errors import BlockdraftError
from .models.transformer import Transformer
from .sampling import SamplingParams


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
    # Record the target's log-probabilities of the generated tokens, with this many most likely
    # alternatives per token (None: none are computed; see `SequenceState.logprobs`).
    logprobs: int | None = None
    # A compiled grammar (`grammar.Grammar`) every generated token must keep satisfiable (None: none)
    grammar: object | None = None


@dataclass
class SequenceState:
    output_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error"
    accepted_per_step: list[tuple[int, int]] = field(default_factory=list)  # (drafts accepted, drafted)
    error: str | None = None  # why this row alone was stopped (finish_reason "error")
    # With `Request.logprobs`: per output token, (its log-probability, [(token id, log-probability)
    # of the most likely tokens, most likely first]) under the target's raw logits (temperature 1,
    # before top-p / top-k), aligned with `output_ids`.
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

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
    prefill_seconds: float = 0.0
    grammar_seconds: float = 0.0  # structured output: masks, draft constraints, matcher moves
    total_seconds: float = 0.0
    prefill: bool = False
    batch: int = 0  # occupied slots this step
    block_size: int = 0  # tokens verified per row: the pending one and the drafts (tree nodes)
    drafted: int = 0  # block positions the drafter pass filled (0: no pass)
    failed: dict[int, str] = field(default_factory=dict)  # request index -> why it alone was stopped
    done: list[tuple] = field(default_factory=list)  # (key, SequenceState) of the rows released (`Batcher`)
    rejected: dict = field(default_factory=dict)  # key -> why the loop refused to admit it (`Batcher`)


def emit(req: Request, state: SequenceState, tokens: list[int]) -> list[int]:
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


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[list[tuple]]:
    """Log-probabilities of `tokens` [N, T] under `logits` [N, T, V] (log-softmax in float32), and
    row n's `tops[n]` most likely tokens at each position: per row, per position,
    (log-probability, [(token id, log-probability), ...] most likely first)."""
    scores = torch.log_softmax(logits.float(), dim=-1)
    chosen = scores.gather(-1, tokens[..., None])[..., 0].tolist()
    k = max(tops)
    if k:
        values, ids = scores.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    return [
        [
            (chosen[n][t], list(zip(ids[n][t][:k_n], values[n][t][:k_n], strict=False)) if k_n else [])
            for t in range(len(chosen[n]))
        ]
        for n, k_n in enumerate(tops)
    ]


def keep_logprobs(state: SequenceState, scores: list[tuple], before: int):
    """Append the scores of the tokens `emit` kept (the row had `before` output ids)."""
    state.logprobs.extend(scores[: max(0, len(state.output_ids) - before)])
    del state.logprobs[len(state.output_ids) :]


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
                f"exceeds the model's context of {context} tokens"
            )
        vocab = target.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise BlockdraftError(f"prompt token ids must lie in [0, {vocab})")
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    # verify may run a full block past the last kept token
    return longest + block_size
