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
        if self.top_k < 0:
            raise BlockdraftError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
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


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor) -> torch.Tensor:
    """Distribution the target samples from: temperature, then top-k, then top-p (HF's order).

    logits [N, V]; per-row temperature (> 0), top_p, top_k (0 = off) as [N] tensors. Returns float64 [N, V].
    """
    logits = logits.double() / temperature.double()[:, None]
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()):
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        drop = before >= top_p.double()[:, None]
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(logits: torch.Tensor, positions: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The target's token at every position. logits [B, T, V] predict the tokens at
    `positions` [B, T]; row b uses params[b] (greedy rows take the argmax)."""
    tokens = logits.argmax(-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    b, t, v = len(rows), logits.shape[1], logits.shape[2]
    sel = torch.tensor(rows, device=logits.device)

    def per_row(values, dtype):
        return torch.tensor(values, dtype=dtype).repeat_interleave(t)

    probs = target_probs(
        logits[sel].reshape(b * t, v).cpu(),
        per_row([params[r].temperature for r in rows], torch.float64),
        per_row([params[r].top_p for r in rows], torch.float64),
        per_row([params[r].top_k for r in rows], torch.long),
    )
    u = position_uniforms([params[r].seed for r in rows], positions[sel]).reshape(b * t, 1)
    cdf = probs.cumsum(-1)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=v - 1)
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
