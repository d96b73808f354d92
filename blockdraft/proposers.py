"""Drafters behind one small interface, as in vLLM's proposers.

The decode loop never knows which drafter runs: it tells the proposer about
committed tokens (`observe`) and asks for `n` draft tokens per sequence
(`propose`). Autoregressive decoding is the proposer that drafts nothing. A proposer
only drafts: how many tokens to draft and verify is the loop's speculation policy's
choice (`blockdraft.policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import numpy as np
import torch

from .draft import DFlashDrafter
from .errors import BlockdraftError
from .models.transformer import Transformer


@dataclass
class Draft:
    """What a proposer returns. tokens [B, n]: draft tokens for positions p+1..p+n (a chain);
    a tree proposer's tokens [B, n, k] are the k best candidates per position, best first.
    probs (same shape): the drafter's probability of each, when asked for and known (else None)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    # a tree proposer whose candidates depend on the token before them (a Markov head):
    # children(row, d, token) -> the k best tokens of position d + 1 below `token` at position d,
    # and their probabilities; tokens / probs then hold those along the greedy chain
    children: Callable | None = None


class Proposer:
    """Base class: proposes nothing (plain autoregressive decoding)."""

    name = "ar"
    capture_layers: tuple[int, ...] = ()  # target layers whose features `observe` needs
    max_block_size: int | None = None  # largest block the drafter supports (None: any)
    max_depth: int | None = None  # block positions one pass can draft (None: max_block_size - 1)
    can_permute = True  # `permute` is implemented (rows may be reordered between steps)
    default_block_size: int | None = None  # block used when none is asked for (None: the largest)
    drafts_trees = False  # `propose` returns candidates [B, n, k] (a tree is built from them)

    def reset(self, batch: int, max_len: int) -> None:
        """Start a new batch of `batch` sequences of at most `max_len` positions."""

    def observe(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor | None,
        positions: torch.Tensor,
        rows: slice = slice(None),
        valid: torch.Tensor | None = None,
    ) -> None:
        """Tokens [B, T] of batch rows `rows` just processed by the target at positions
        [B, T], with their captured features. Entries at or past a row's committed length
        (`valid` [B]; None: every entry is committed) are junk; a later call rewrites those
        positions."""

    def observe_logits(self, logits: torch.Tensor, positions: torch.Tensor, rows: slice = slice(None)) -> None:
        """The target's logits [B, T, V] of batch rows `rows`, computed at positions [B, T] (each
        predicts the token after its position): the prefill's last position and every verified
        one. Entries past a row's committed length are junk, as in `observe`."""

    def propose(
        self, last_tokens: torch.Tensor, positions: torch.Tensor, n: int, rows: slice = slice(None), probs: bool = False
    ) -> Draft:
        """Draft tokens for positions p+1..p+n of batch rows `rows`, given each row's last
        committed token and its position p ([B] each); with `probs`, their probabilities
        where the drafter has them. n may be 0 (a step without drafts): a proposer that keeps
        context still takes in what it observed."""
        return Draft(last_tokens.new_zeros(last_tokens.shape[0], 0))

    def permute(self, order: torch.Tensor) -> None:
        """Reorder the batch rows: row i becomes old row order[i] (no state here)."""

    def release(self, row: int, key) -> None:
        """Row `row`, which served request `key`, has ended and its slot is free (a later
        prefill reuses it); a proposer that keeps something per sequence takes it now."""


def check_window(window) -> None:
    """A draft window is a number of tokens >= 0, None (0 and None: the whole context) or "auto"."""
    if not (
        window is None or window == "auto" or (isinstance(window, int) and not isinstance(window, bool) and window >= 0)
    ):
        raise BlockdraftError(f"the draft window must be a number of tokens >= 0, got {window!r}")


class DFlashProposer(Proposer):
    """Drafts a whole block in one drafter forward from the target's context features: each
    position's most probable token.

    `draft_window` W bounds the drafter's context to the last W committed tokens (a ring
    cache): draft time and drafter memory stay flat on long contexts. "auto" (default): the
    longest context the drafter was trained on, when recorded (blockdraft-trained drafters),
    else the whole context; 0 or None: the whole context."""

    name = "dflash"
    can_permute = False

    def __init__(self, drafter: DFlashDrafter, target: Transformer, *, draft_window: int | str | None = "auto"):
        drafter.check_target(target.config)
        check_window(draft_window)
        if draft_window == "auto":
            draft_window = drafter.config.train_context
        self.draft_window = draft_window or None  # the drafter sees the last W committed tokens (None: all)
        self.drafter, self.target = drafter, target
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.first_slot = drafter.config.first_draft_slot  # 1: DFlash's layout, 0: DSpark's (every slot drafts)
        self.max_block_size = drafter.config.max_drafts + 1  # the verified block: the last token and the drafts
        self.mask_token_id = drafter.config.mask_token_id
        self.cache = None
        self._pending: list[tuple] = []  # (features, positions, rows, valid) not yet in the cache

    def reset(self, batch, max_len):
        cache = self.cache
        if (
            cache is None
            or cache.batch != batch
            or cache.window != self.draft_window
            or (self.draft_window is None and cache.max_len < max_len)
        ):
            self.cache = self.drafter.new_cache(batch, max_len, self.draft_window)
        self.cache.clear()
        self._pending = []

    def observe(self, tokens, features, positions, rows=slice(None), valid=None):
        self._pending.append((features, positions, rows, valid))  # projected lazily, in propose

    def block_hidden(self, last_tokens, positions, n, rows):
        """The drafter's final hidden states [B, n, H] that draft positions p+1..p+n (None for n = 0:
        the observed context is taken in all the same): a block of the anchor and n masks read
        from slot 1 (DFlash's layout), or of the anchor and n - 1 masks read from slot 0 (DSpark's)."""
        dtype = self.drafter.fc.weight.dtype  # a bf16 drafter beside an fp32 target reads its tensors in bf16
        for features, ctx_positions, ctx_rows, valid in self._pending:
            self.drafter.write_context(self.cache, features.to(dtype), ctx_positions, ctx_rows, valid)
        self._pending = []
        if n == 0:
            return None
        offsets = torch.arange(n + self.first_slot, device=positions.device)
        block_positions = positions[:, None] + offsets
        block = torch.full_like(block_positions, self.mask_token_id)
        block[:, 0] = last_tokens
        hidden = self.drafter(self.target.embed(block).to(dtype), block_positions, cache=self.cache, rows=rows)
        return hidden[:, self.first_slot :]

    def propose(self, last_tokens, positions, n, rows=slice(None), probs=False):
        hidden = self.block_hidden(last_tokens, positions, n, rows)
        self._hidden = hidden  # for `best_allowed` (structured output)
        if hidden is None:
            return Draft(last_tokens.new_zeros(last_tokens.shape[0], 0))
        head = self.target.lm_head.weight
        if not probs:
            return Draft(self.drafter.draft_tokens(hidden, head, last_tokens))
        tokens, p = self.drafter.draft_candidates(hidden, head, 1, last_tokens)
        return Draft(tokens[..., 0], p[..., 0])

    def best_allowed(self, row: int, i: int, previous: int, mask: torch.Tensor) -> int | None:
        """The drafter's most probable token among those `mask` allows at draft position i of `row`
        in the last proposal, given the token before it (a Markov head's correction); None if its
        vocabulary holds none of them."""
        return self.drafter.best_allowed(self._hidden[row, i], self.target.lm_head.weight, previous, mask)


class DFlashTreeProposer(DFlashProposer):
    """The same drafter pass, read as a tree: the `top_k` most probable tokens of every block
    position with their probabilities; the loop's policy grows the tree best first from them
    (`tree.build_tree`) and verifies it in one target forward. With a Markov head each node's
    children are the top_k of the next position corrected by that node's own token."""

    name = "dflash-tree"
    drafts_trees = True
    MAX_TREE_NODES = 64

    def __init__(
        self,
        drafter: DFlashDrafter,
        target: Transformer,
        *,
        top_k: int = 32,
        tree_nodes: int = 16,
        draft_window: int | str | None = "auto",
    ):
        if target.recurrent:
            raise BlockdraftError(
                "tree verification needs a target without recurrent layers: linear attention keeps one "
                "state per sequence, not one per tree branch (use a chain method: dflash, dflash-cut)"
            )
        if top_k < 2:
            raise BlockdraftError(f"a tree needs at least 2 candidates per position, got top_k={top_k}")
        super().__init__(drafter, target, draft_window=draft_window)
        self.top_k = top_k
        self.max_depth = drafter.config.max_drafts
        self.max_block_size = self.MAX_TREE_NODES + 1  # a block counts the root and the nodes
        self.default_block_size = tree_nodes + 1

    def propose(self, last_tokens, positions, n, rows=slice(None), probs=True):
        hidden = self.block_hidden(last_tokens, positions, n, rows)
        if hidden is None:
            empty = last_tokens.new_zeros(last_tokens.shape[0], 0, self.top_k)
            return Draft(empty, empty.float())
        if self.drafter.markov_head is not None:  # each branch's candidates given its own last token
            return Draft(*self.drafter.markov_candidates(hidden, self.target.lm_head.weight, self.top_k, last_tokens))
        tokens, p = self.drafter.draft_candidates(hidden, self.target.lm_head.weight, self.top_k)
        return Draft(tokens, p)


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

    def permute(self, order):
        self.history = self.history[order.cpu().numpy()]

    def observe(self, tokens, features, positions, rows=slice(None), valid=None):
        hist = self.history[rows]
        index = positions.cpu().numpy()
        hist[np.arange(index.shape[0])[:, None], index] = tokens.cpu().numpy()

    def propose(self, last_tokens, positions, n, rows=slice(None), probs=False):
        out = last_tokens.new_zeros(last_tokens.shape[0], n)
        if n == 0:
            return Draft(out)
        hist = self.history[rows]
        for b, (p, last) in enumerate(zip(positions.tolist(), last_tokens.tolist(), strict=False)):
            seq = hist[b, : p + 1].copy()
            seq[p] = last
            draft = lookup_continuation(seq, n, self.max_ngram, self.min_ngram)
            if draft:
                out[b, : len(draft)] = torch.tensor(draft)
        return Draft(out)


def lookup_continuation(seq, n: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `n` tokens that followed the latest earlier match of seq's final k-gram (largest k
    first); [] if none matches."""
    length = len(seq)
    for k in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = seq[length - k :]
        # windows starting at i in [0, length - k - 1): an occurrence that ends before the tail
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], k)
        hits = np.nonzero((windows == tail).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + k
            return seq[start : start + n].tolist()
    return []


class EagleProposer(Proposer):
    """Drafts a chain token by token with an EAGLE-3-style drafter (one layer, fed back its
    own hidden state). Slot s of the drafter's cache holds the keys/values of input
    (fused target feature at s, token s+1); draft slots follow the last committed one and
    are overwritten once those positions are committed."""

    name = "eagle3"
    can_permute = False

    def __init__(self, drafter, target: Transformer):
        drafter.check_target(target.config)
        self.drafter, self.target = drafter, target
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.max_block_size = drafter.config.block_size
        self.batch = 0

    def reset(self, batch, max_len):
        d, dev, dt = self.drafter, self.target.device, self.target.dtype
        if self.batch != batch or self.k.shape[2] < max_len + 1:
            shape = (batch, d.kv_heads, max_len + 1, d.head_dim)
            self.k, self.v = torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)
            self.fused = torch.zeros(batch, max_len + 1, d.config.hidden_size, dtype=dt, device=dev)
            self.tokens = torch.zeros(batch, max_len + 1, dtype=torch.long, device=dev)
            self.batch = batch
        self.done = torch.zeros(batch, dtype=torch.long, device=dev)  # slots [0, done) are in the cache

    def observe(self, tokens, features, positions, rows=slice(None), valid=None):
        index = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.tokens[rows][index, positions] = tokens
        self.fused[rows][index, positions] = self.drafter.fc(features)
        done = self.done[rows]
        done.copy_(torch.minimum(done, positions[:, 0]))  # a prefill restarts the row at 0

    def propose(self, last_tokens, positions, n, rows=slice(None), probs=False):
        d = self.drafter
        b = last_tokens.shape[0]
        index = torch.arange(b, device=last_tokens.device)[:, None]
        tokens, fused, cache_k, cache_v, done = (
            self.tokens[rows],
            self.fused[rows],
            self.k[rows],
            self.v[rows],
            self.done[rows],
        )
        tokens[index[:, 0], positions] = last_tokens
        # committed slots not yet in the cache: done .. p-1 (each needs token s+1 <= p)
        width = int((positions - done).max())
        if width > 0:
            slots = torch.minimum(done[:, None] + torch.arange(width, device=done.device), positions[:, None] - 1)
            _, k, v = d.qkv(self.target.embed(tokens[index, slots + 1]), fused[index, slots], slots)
            cache_k.transpose(1, 2)[index, slots] = k.transpose(1, 2)
            cache_v.transpose(1, 2)[index, slots] = v.transpose(1, 2)
            done.copy_(positions)
        drafts = last_tokens.new_zeros(b, n)
        if n == 0:
            return Draft(drafts)
        slot = positions - 1
        hidden = fused[index[:, 0], slot][:, None]
        token = last_tokens[:, None]
        for j in range(n):
            pos = (slot + j)[:, None]
            q, k, v = d.qkv(self.target.embed(token), hidden, pos)
            if j > 0:  # a draft slot (slot p-1, the first query, is already a committed one)
                cache_k.transpose(1, 2)[index, pos] = k.transpose(1, 2)
                cache_v.transpose(1, 2)[index, pos] = v.transpose(1, 2)
            used = int(pos.max()) + 1
            mask = (torch.arange(used, device=pos.device) <= pos)[:, None, None, :]
            hidden = d.finish(hidden, q, cache_k[:, :, :used], cache_v[:, :, :used], mask)
            token = d.draft_tokens(d.norm(hidden), self.target.lm_head.weight)
            drafts[:, j] = token[:, 0]
        return Draft(drafts)
