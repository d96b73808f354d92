"""Drafters behind one small interface, as in vLLM's proposers.

The decode loop never knows which drafter runs: it tells the proposer about
committed tokens (`observe`) and asks for `n` draft tokens per sequence
(`propose`). Autoregressive decoding is the proposer that drafts nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from .draft import DFlashDrafter
from .models.transformer import Transformer


class Proposer:
    """Base class: proposes nothing (plain autoregressive decoding)."""

    name = "ar"
    capture_layers: tuple[int, ...] = ()  # target layers whose features `observe` needs
    max_block_size: int | None = None  # largest block the drafter supports (None: any)
    default_block_size: int | None = None  # block used when none is asked for (None: the largest)

    def reset(self, batch: int, max_len: int) -> None:
        """Start a new batch of `batch` sequences of at most `max_len` positions."""

    def observe(self, tokens: torch.Tensor, features: torch.Tensor | None, positions: torch.Tensor,
                rows: slice = slice(None)) -> None:
        """Tokens [B, T] of batch rows `rows` just processed by the target at positions
        [B, T], with their captured features. Entries past a row's committed length are
        junk; a later call rewrites those positions."""

    def propose(self, last_tokens: torch.Tensor, positions: torch.Tensor, n: int,
                rows: slice = slice(None)) -> torch.Tensor:
        """Draft tokens [B, n] for positions p+1..p+n of batch rows `rows`, given each row's
        last committed token and its position p ([B] each)."""
        return last_tokens.new_zeros(last_tokens.shape[0], 0)


class DFlashProposer(Proposer):
    """Drafts a whole block in one drafter forward from the target's context features."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, target: Transformer):
        drafter.check_target(target.config)
        self.drafter, self.target = drafter, target
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.max_block_size = drafter.config.block_size
        self.mask_token_id = drafter.config.mask_token_id
        self.cache = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor, slice]] = []

    def reset(self, batch, max_len):
        if self.cache is None or self.cache.batch != batch or self.cache.max_len < max_len:
            self.cache = self.drafter.new_cache(batch, max_len)
        self._pending = []

    def observe(self, tokens, features, positions, rows=slice(None)):
        self._pending.append((features, positions, rows))  # projected lazily, in propose

    def propose(self, last_tokens, positions, n, rows=slice(None)):
        for features, ctx_positions, ctx_rows in self._pending:
            self.drafter.write_context(self.cache, features, ctx_positions, ctx_rows)
        self._pending = []
        if n == 0:  # speculation switched off for this step: the context is still kept
            return last_tokens.new_zeros(last_tokens.shape[0], 0)
        offsets = torch.arange(n + 1, device=positions.device)
        block_positions = positions[:, None] + offsets
        block = torch.full_like(block_positions, self.mask_token_id)
        block[:, 0] = last_tokens
        hidden = self.drafter(self.target.embed(block), block_positions, cache=self.cache, rows=rows)
        return self.drafter.draft_tokens(hidden[:, 1:], self.target.lm_head.weight)


class LookupProposer(Proposer):
    """Prompt-lookup (n-gram) drafting: find the latest earlier occurrence of the sequence's
    last n tokens (n = max_ngram down to min_ngram) and propose the tokens that followed it."""

    name = "lookup"

    def __init__(self, max_block_size: int = 16, max_ngram: int = 3, min_ngram: int = 1, default_block_size: int = 4):
        self.max_block_size, self.default_block_size = max_block_size, default_block_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history = None  # [B, max_len] token ids by position (past a row's length: junk)

    def reset(self, batch, max_len):
        self.history = np.zeros((batch, max_len + 1), dtype=np.int64)

    def observe(self, tokens, features, positions, rows=slice(None)):
        hist = self.history[rows]
        index = positions.cpu().numpy()
        hist[np.arange(index.shape[0])[:, None], index] = tokens.cpu().numpy()

    def propose(self, last_tokens, positions, n, rows=slice(None)):
        out = last_tokens.new_zeros(last_tokens.shape[0], n)
        if n == 0:
            return out
        hist = self.history[rows]
        for b, (p, last) in enumerate(zip(positions.tolist(), last_tokens.tolist())):
            seq = hist[b, : p + 1].copy()
            seq[p] = last
            draft = lookup_continuation(seq, n, self.max_ngram, self.min_ngram)
            if draft:
                out[b, : len(draft)] = torch.tensor(draft)
        return out


def lookup_continuation(seq, n: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `n` tokens that followed the latest earlier match of seq's final k-gram (largest k
    first); [] if none matches."""
    length = len(seq)
    for k in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = seq[length - k:]
        # windows starting at i in [0, length - k - 1): an occurrence that ends before the tail
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], k)
        hits = np.nonzero((windows == tail).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + k
            return seq[start: start + n].tolist()
    return []
