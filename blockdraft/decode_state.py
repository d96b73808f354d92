"""What a batch of sequences being decoded owns (`DecodeState`): the target's KV cache, the
proposer's state, each row's committed length and pending token, and the cache layouts a verify
uses (chains: slot = position; trees: nodes in slots after the committed length)."""

from __future__ import annotations

import torch

from .models.transformer import Transformer
from .proposers import Proposer
from .tree import DraftTree


class DecodeState:
    """What a batch of sequences being decoded owns: the target's KV cache, the proposer
    (which keeps its drafter's cache), and every row's committed length and pending token
    (emitted, not yet in the cache). Rollback after a verify happens in `commit` and
    nowhere else: for attention caches with slot = position it is the committed length
    itself (slots past it are never attended and get overwritten); recurrent layers copy
    their state at the committed length (`target.commit`)."""

    def __init__(self, target: Transformer, proposer: Proposer, batch: int, max_len: int):
        self.target, self.proposer = target, proposer
        self.cache = target.new_cache(batch, max_len)
        proposer.reset(batch, max_len)
        device = target.device
        self.committed = torch.zeros(batch, dtype=torch.long, device=device)  # tokens in the target cache
        self.pending = torch.zeros(batch, dtype=torch.long, device=device)  # last emitted token, not yet cached

    def chain_layout(self, positions: torch.Tensor, group_rows: int = 0):
        """Cache slots, attention mask [B, 1, T, S] and attention groups for verifying chains of
        tokens at `positions` [B, T]: a token's slot is its position, and it sees every slot up
        to its own (the committed context and the block's earlier tokens; stale slots past a
        row's length are never seen). With `group_rows`, attention runs per range of that many
        rows, each over the slots its longest row needs (None: one range)."""
        ends = positions[:, -1].tolist()  # the last position of each row (one host sync)
        keys = torch.arange(max(ends) + 1, device=positions.device).expand(positions.shape[0], -1)
        return positions, self.target.attention_mask(positions, keys), self._groups(ends, group_rows)

    def tree_layout(self, tree: DraftTree, committed: torch.Tensor, group_rows: int = 0):
        """Positions, slots, mask and groups for verifying a tree below rows of `committed` [B]
        lengths: node i at position committed + depth(i) in slot committed + i; it sees the
        committed context and its own ancestors (siblings and cousins share positions but not
        slots)."""
        b, t = tree.tokens.shape
        positions = committed[:, None] + tree.depths
        slots = committed[:, None] + torch.arange(t, device=committed.device)
        ends = slots[:, -1].tolist()
        used = max(ends) + 1
        keys = torch.arange(used, device=committed.device)
        mask = (keys < committed[:, None])[:, None, :].expand(b, t, used).clone()
        mask.scatter_(2, slots[:, None, :].expand(b, t, t), tree.visible())
        window = self.target.config.sliding_window
        if window is not None:  # key positions: a slot's position, a node's depth-based one
            key_pos = keys.expand(b, -1).clone().scatter_(1, slots, positions)
            mask &= key_pos[:, None, :] > positions[:, :, None] - window
        return positions, slots, mask[:, None], self._groups(ends, group_rows)

    @staticmethod
    def _groups(ends: list[int], group_rows: int):
        b = len(ends)
        if not group_rows or b <= group_rows:
            return None
        return [(slice(i, min(i + group_rows, b)), max(ends[i : i + group_rows]) + 1) for i in range(0, b, group_rows)]

    def compact(self, rows: slice, path: torch.Tensor):
        """Move the keys/values of each row's accepted tree path (node indices [B, P], root
        first) to consecutive slots after its committed length, the layout a chain leaves."""
        committed = self.committed[rows]
        p = path.shape[1]
        src = committed[:, None] + path
        dst = committed[:, None] + torch.arange(p, device=path.device)
        for buf in (self.cache.k, self.cache.v):
            view = buf[:, rows]  # [L, B, KV, S, D], a view
            layers, b, kv, _, d = view.shape
            moved = view.gather(3, src[None, :, None, :, None].expand(layers, b, kv, p, d))
            view.scatter_(3, dst[None, :, None, :, None].expand(layers, b, kv, p, d), moved)

    def permute(self, order: torch.Tensor):
        """Reorder the rows (row i becomes old row order[i]), caches included."""
        self.committed, self.pending = self.committed[order], self.pending[order]
        self.cache.permute(order)
        self.proposer.permute(order)

    def start(self, rows: slice, lengths: torch.Tensor, first: torch.Tensor):
        """Rows `rows` were just prefilled with prompts of `lengths` and emitted `first`."""
        self.committed[rows], self.pending[rows] = lengths, first
        self.target.commit(self.cache, rows, self.committed[rows])

    def commit(self, rows: slice, accepted: torch.Tensor, bonus: torch.Tensor, active: torch.Tensor):
        """After a verify of [pending, drafts...]: active rows keep the pending token and their
        `accepted` drafts (their slots become committed) and emit `bonus` as the new pending
        token; inactive rows (finished, free) stay as they were."""
        committed, pending = self.committed[rows], self.pending[rows]
        committed.copy_(torch.where(active, committed + accepted + 1, committed))
        pending.copy_(torch.where(active, bonus, pending))
        self.target.commit(self.cache, rows, committed)
