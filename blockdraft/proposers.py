"""Drafters behind one small interface, as in vLLM's proposers.

The decode loop never knows which drafter runs: it tells the proposer about
committed tokens (`observe`) and asks for `n` draft tokens per sequence
(`propose`). Autoregressive decoding is the proposer that drafts nothing.
"""

from __future__ import annotations

import torch

from .draft import DFlashDrafter
from .models.transformer import Transformer


class Proposer:
    """Base class: proposes nothing (plain autoregressive decoding)."""

    name = "ar"
    capture_layers: tuple[int, ...] = ()  # target layers whose features `observe` needs
    max_block_size: int | None = None  # largest block the drafter supports (None: any)

    def reset(self, batch: int, max_len: int) -> None:
        """Start a new batch of `batch` sequences of at most `max_len` positions."""

    def observe(self, tokens: torch.Tensor, features: torch.Tensor | None, positions: torch.Tensor,
                rows: slice = slice(None)) -> None:
        """Tokens [B, T] of batch rows `rows` just processed by the target at positions
        [B, T], with their captured features. Entries past a row's committed length are
        junk; a later call rewrites those positions."""

    def propose(self, last_tokens: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        """Draft tokens [B, n] for positions p+1..p+n, given each row's last committed
        token and its position p ([B] each)."""
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

    def propose(self, last_tokens, positions, n):
        for features, ctx_positions, rows in self._pending:
            self.drafter.write_context(self.cache, features, ctx_positions, rows)
        self._pending = []
        offsets = torch.arange(n + 1, device=positions.device)
        block_positions = positions[:, None] + offsets
        block = torch.full_like(block_positions, self.mask_token_id)
        block[:, 0] = last_tokens
        hidden = self.drafter(self.target.embed(block), block_positions, cache=self.cache)
        return self.target.logits(hidden[:, 1:]).argmax(-1)
