"""Sampling parameters, token sampling, and the lossless acceptance rule.

Every sampled token is drawn by inverse-CDF from ONE uniform number that depends
only on the request's seed and the token's absolute position. Two consequences:
a given seed reproduces its output exactly, and speculative decoding emits the
very same tokens as plain autoregressive decoding with that seed, because the
target samples every position itself and a draft token is kept only when it
equals the target's own sample (rejection sampling with a one-hot proposal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .errors import BlockdraftError


# Below this temperature the scores logits / T overflow float32 (|logit| ~ 30), and the
# distribution is one-hot at the argmax anyway: such a temperature samples as greedy.
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # a top-k beyond the vocabulary keeps every token


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise BlockdraftError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BlockdraftError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise BlockdraftError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k}")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.seed is None:
            self.seed = int.from_bytes(os.urandom(8), "little") >> 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def position_uniforms(seeds: list[int], positions: torch.Tensor) -> torch.Tensor:
    """U[0,1) as float64 [B, T], a pure function of (seed of row b, position)."""
    s = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF for seed in seeds], dtype=np.uint64))
    p = positions.cpu().numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        bits = _splitmix64(s[:, None] ^ _splitmix64(p))
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53)


CANDIDATES = 256  # tokens ranked first for top-p; more only for rows whose nucleus is wider


def kept_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    candidates: int = CANDIDATES,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens each row can sample and their probabilities: temperature, then top-k, then
    top-p (HF's order). logits [N, V]; per-row temperature (> 0), top_p, top_k (0 = off) as [N]
    tensors. Returns (ids [N, C], float64 probs [N, C]): row n samples token ids[n, c] with
    probability probs[n, c], each row ascending by token id (padding, at the end, has
    probability 0); ids is None when C is the whole vocabulary in order (no row truncates).
    Scores (logits / temperature) are float32 as the target's logits, probabilities float64.

    Top-p never sorts the whole vocabulary: only the `candidates` most likely tokens are ranked,
    and the count doubles for the rows whose top-p mass lies beyond them. Every token outside the
    ranked set has at least the whole ranked set's mass above it, so once that mass reaches top_p
    the nucleus is exactly the one a full sort gives."""
    dev = logits.device  # the work stays where the logits are (one [N, V] copy to the host costs more)
    temperature, top_p, top_k = temperature.to(dev), top_p.to(dev), top_k.to(dev)
    x = logits.float() / temperature.float()[:, None]
    n, vocab = x.shape
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    nucleus = top_p < 1
    width = torch.full((n,), vocab, device=dev)  # tokens left after top-k
    if bool((k < vocab).any()):  # top-k as HF does it: drop what is below the k-th value (ties stay)
        kth = x.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
        width = (x > float("-inf")).sum(-1)
    elif not bool(nucleus.any()):
        return None, torch.softmax(x, dim=-1).double()
    top = x.max(-1, keepdim=True).values
    lse = top.double() + (x - top).exp_().sum(-1, keepdim=True).double().log()
    # rows without top-p rank all their tokens, top-p rows start from `candidates`
    count = torch.where(nucleus, width.clamp(max=candidates), width)
    rows = torch.arange(n, device=dev)
    ids = probs = None
    while len(rows):
        c = min(vocab, int(count[rows].max()))
        vals, got = x[rows].topk(c, dim=-1)  # descending
        p = torch.exp(vals.double() - lse[rows])
        before = p.cumsum(-1) - p  # mass strictly above each token
        drop = (before >= top_p[rows].double()[:, None]) & nucleus[rows, None]
        drop[:, 0] = False
        unresolved = nucleus[rows] & (width[rows] > c) & (before[:, -1] + p[:, -1] < top_p[rows].double())
        if c < vocab and bool(unresolved.any()):
            done = ~unresolved
            count[rows[unresolved]] = 2 * c
        else:
            done = torch.ones(len(rows), dtype=torch.bool, device=dev)
        p = p.masked_fill(drop, 0.0)[done]
        got = got[done]
        if ids is None:
            ids = torch.zeros(n, c, dtype=got.dtype, device=dev)
            probs = torch.zeros(n, c, dtype=torch.float64, device=dev)
        elif c > ids.shape[1]:  # widen: the earlier rows' padding has probability 0
            ids = torch.cat([ids, torch.zeros(n, c - ids.shape[1], dtype=ids.dtype, device=dev)], 1)
            probs = torch.cat([probs, torch.zeros(n, c - probs.shape[1], dtype=torch.float64, device=dev)], 1)
        got, order = got.sort(dim=-1)
        probs[rows[done], :c] = p.gather(-1, order) / p.sum(-1, keepdim=True)
        ids[rows[done], :c] = got
        rows = rows[~done]
    return ids, probs


def target_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """`kept_tokens` as a dense float64 [N, V] table (zeros outside each row's kept set)."""
    ids, probs = kept_tokens(logits, temperature, top_p, top_k)
    if ids is None:
        return probs
    return torch.zeros(logits.shape, dtype=torch.float64, device=ids.device).scatter_add_(-1, ids, probs)


def sample_tokens(logits: torch.Tensor, positions: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The target's token at every position. logits [B, T, V] predict the tokens at
    `positions` [B, T]; row b uses params[b] (greedy rows take the argmax)."""
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if len(rows) < len(params):
        from .models.native import argmax

        tokens = argmax(logits)
        if not rows:
            return tokens
    else:
        tokens = torch.empty(logits.shape[:2], dtype=torch.long, device=logits.device)
    b, t, v = len(rows), logits.shape[1], logits.shape[2]
    sel = torch.tensor(rows, device=logits.device)

    def per_row(values, dtype):
        return torch.tensor(values, dtype=dtype).repeat_interleave(t)

    ids, probs = kept_tokens(
        logits[sel].reshape(b * t, v),
        per_row([params[r].temperature for r in rows], torch.float64),
        per_row([params[r].top_p for r in rows], torch.float64),
        per_row([params[r].top_k for r in rows], torch.long),
    )
    u = position_uniforms([params[r].seed for r in rows], positions[sel]).reshape(b * t, 1).to(logits.device)
    # inverse CDF in token-id order; tokens outside the kept set add nothing to the CDF
    cdf = probs.cumsum(-1)
    # u <= 1 - 2**-53, so u * total < total in float64 and the first CDF entry above it is a kept token
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)
    if ids is not None:
        picked = ids.gather(-1, picked)
    tokens[sel] = picked.view(b, t).to(tokens.device)
    return tokens


def acceptance(drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Number of leading draft tokens equal to the target's own tokens, per row.

    drafts [B, n] proposed for positions p+1..p+n; target_tokens [B, n+1] the target's
    tokens at p+1..p+n+1. Row b then emits drafts[b, :a] and target_tokens[b, a] (the bonus).
    """
    if drafts.shape[1] == 0:
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    return (drafts == target_tokens[:, :-1]).long().cumprod(dim=1).sum(dim=1)
