"""Drafters behind one small interface, as in vLLM's proposers.

The decode loop never knows which drafter runs: it tells the proposer about
committed tokens (`observe`) and asks for `n` draft tokens per sequence
(`propose`). Autoregressive decoding is the proposer that drafts nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from .costs import DraftGate, StepCosts, best_depth, best_width, clock
from .draft import DFlashDrafter
from .errors import BlockdraftError
from .models.transformer import Transformer
from .tree import Calibration, DraftTree, build_tree


class Proposer:
    """Base class: proposes nothing (plain autoregressive decoding)."""

    name = "ar"
    capture_layers: tuple[int, ...] = ()  # target layers whose features `observe` needs
    max_block_size: int | None = None  # largest block the drafter supports (None: any)
    can_permute = True  # `permute` is implemented (rows may be reordered between steps)
    default_block_size: int | None = None  # block used when none is asked for (None: the largest)
    drafts_trees = False  # `propose_tree` instead of `propose` (see `blockdraft.tree`)
    costs: StepCosts | None = None  # the decode loop's measured step costs (set by the loop)

    def reset(self, batch: int, max_len: int) -> None:
        """Start a new batch of `batch` sequences of at most `max_len` positions."""

    def observe(self, tokens: torch.Tensor, features: torch.Tensor | None, positions: torch.Tensor,
                rows: slice = slice(None), valid: torch.Tensor | None = None) -> None:
        """Tokens [B, T] of batch rows `rows` just processed by the target at positions
        [B, T], with their captured features. Entries at or past a row's committed length
        (`valid` [B]; None: every entry is committed) are junk; a later call rewrites those
        positions."""

    def propose(self, last_tokens: torch.Tensor, positions: torch.Tensor, n: int,
                rows: slice = slice(None)) -> torch.Tensor:
        """Draft tokens [B, n] for positions p+1..p+n of batch rows `rows`, given each row's
        last committed token and its position p ([B] each)."""
        return last_tokens.new_zeros(last_tokens.shape[0], 0)

    def propose_tree(self, last_tokens: torch.Tensor, positions: torch.Tensor, nodes: int,
                     rows: slice = slice(None)) -> DraftTree:
        """A tree of at most `nodes` draft tokens per row below each row's last committed token
        (proposers with `drafts_trees`)."""
        raise NotImplementedError

    def verified(self, accepted: torch.Tensor, on_path: torch.Tensor | None, live: torch.Tensor) -> None:
        """After the verify of the last proposal: `accepted` [B] drafts per row, `on_path` [B, T]
        the accepted tree nodes (None for a chain), `live` [B] the rows that were decoding."""

    def expected_tokens(self, block: int) -> float | None:
        """Tokens per row a step verifying `block` tokens is expected to emit, if this proposer
        estimates it from its draft probabilities (else None: the caller measures)."""
        return None

    def permute(self, order: torch.Tensor) -> None:
        """Reorder the batch rows: row i becomes old row order[i] (no state here)."""


class DFlashProposer(Proposer):
    """Drafts a whole block in one drafter forward from the target's context features.

    Three ways to use that block (methods `dflash`, `dflash-cut`, `dflash-tree`):
    - the chain of each position's most probable token (default);
    - `cut=True`: the same chain, cut where verifying more tokens stops paying: the length
      with the most expected tokens per second given the (calibrated) draft probabilities
      and the loop's measured step costs (`costs.best_width`); the pass drafts only as many
      positions as pay on average (`costs.best_depth`, from the running mean of the calibrated
      estimates and the measured seconds of passes of each depth; every `PROBE_EVERY`-th
      step drafts the whole block to keep the deeper positions' estimates current); and
      while the drafts do not pay for the drafter pass itself, the next steps skip it
      (`costs.DraftGate`);
    - `top_k > 1`: a tree of the `top_k` best tokens per position, grown best first up to the
      step's node budget (`tree.build_tree`), verified in one target forward.

    `draft_window` W bounds the drafter's context to the last W committed tokens (a ring
    cache): draft time and drafter memory stay flat on long contexts. "auto" (default): the
    longest context the drafter was trained on, when recorded (blockdraft-trained drafters),
    else the whole context; 0 or None: the whole context."""

    name = "dflash"
    can_permute = False
    MAX_TREE_NODES = 64
    PROBE_EVERY = 16  # cut chain: one step in this many drafts the whole block
    SCORE_SMOOTHING = 0.1  # cut chain: weight of a step in the running mean of the estimates

    def __init__(self, drafter: DFlashDrafter, target: Transformer, *, cut: bool = False, top_k: int = 1,
                 tree_nodes: int = 16, draft_window: int | str | None = "auto"):
        drafter.check_target(target.config)
        if draft_window == "auto":
            draft_window = drafter.config.train_context
        if draft_window is not None and (not isinstance(draft_window, int) or draft_window < 0):
            raise BlockdraftError(f"the draft window must be a number of tokens >= 0, got {draft_window!r}")
        self.draft_window = draft_window or None  # the drafter sees the last W committed tokens (None: all)
        self.drafter, self.target = drafter, target
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.max_block_size = drafter.config.block_size
        self.mask_token_id = drafter.config.mask_token_id
        self.cut, self.top_k = cut, top_k
        if top_k > 1:
            if drafter.markov_head is not None:
                raise BlockdraftError("this drafter has a Markov head: each draft depends on the token drafted "
                                      "before it, so it drafts chains (dflash, dflash-cut), not trees")
            if target.attention_chunk:
                raise BlockdraftError(
                    "tree verification needs float32 target weights: with quantized weights a token "
                    "verified in a tree is not bit-identical to the same token decoded alone")
            if target.recurrent:
                raise BlockdraftError(
                    "tree verification needs a target without recurrent layers: linear attention keeps one "
                    "state per sequence, not one per tree branch (use a chain method: dflash, dflash-cut)")
            self.name, self.drafts_trees = "dflash-tree", True
            self.max_block_size = self.MAX_TREE_NODES + 1  # a block counts the root and the nodes
            self.default_block_size = tree_nodes + 1
        elif cut:
            self.name = "dflash-cut"
        self.gate = DraftGate() if cut and top_k == 1 else None
        self.calibration = Calibration(drafter.config.block_size - 1, target.device)
        self.last: DraftTree | None = None  # the last proposal, for calibration
        self.mean_scores: torch.Tensor | None = None  # acceptance estimates of the last draft
        # cut chain: running mean of the estimates per position (None: not drafted there yet)
        self.score_mean: list[float | None] = [None] * (drafter.config.block_size - 1)
        self.drafts = 0  # cut chain: drafter passes so far (for the probe schedule)
        self.cache = None
        self._pending: list[tuple] = []  # (features, positions, rows, valid) not yet in the cache

    def reset(self, batch, max_len):
        cache = self.cache
        if (cache is None or cache.batch != batch or cache.window != self.draft_window
                or (self.draft_window is None and cache.max_len < max_len)):
            self.cache = self.drafter.new_cache(batch, max_len, self.draft_window)
        self.cache.clear()
        self._pending = []
        self.last = None
        if self.gate is not None:
            self.gate.reset()

    def observe(self, tokens, features, positions, rows=slice(None), valid=None):
        self._pending.append((features, positions, rows, valid))  # projected lazily, in propose

    def _block_hidden(self, last_tokens, positions, n, rows):
        """The drafter's final hidden states [B, n, H] for positions p+1..p+n."""
        for features, ctx_positions, ctx_rows, valid in self._pending:
            self.drafter.write_context(self.cache, features, ctx_positions, ctx_rows, valid)
        self._pending = []
        if n == 0:
            return None
        offsets = torch.arange(n + 1, device=positions.device)
        block_positions = positions[:, None] + offsets
        block = torch.full_like(block_positions, self.mask_token_id)
        block[:, 0] = last_tokens
        hidden = self.drafter(self.target.embed(block), block_positions, cache=self.cache, rows=rows)
        return hidden[:, 1:]

    def propose(self, last_tokens, positions, n, rows=slice(None)):
        if self.gate is not None and n > 0 and self.gate.skip():
            n = 0
        costs, batch = self.costs or StepCosts(), last_tokens.shape[0]
        if self.cut and n > 0:
            n = self._depth(n, costs, batch)
        t0 = clock(positions.device) if self.gate is not None and n > 0 else None
        hidden = self._block_hidden(last_tokens, positions, n, rows)
        if hidden is None:  # speculation switched off for this step: the context is still kept
            return last_tokens.new_zeros(last_tokens.shape[0], 0)
        if not self.cut:
            return self.drafter.draft_tokens(hidden, self.target.lm_head.weight, last_tokens)
        tokens, probs = self.drafter.draft_candidates(hidden, self.target.lm_head.weight, 1, last_tokens)
        tokens, probs = tokens[..., 0], probs[..., 0]
        scores = self.calibration.apply(probs[..., None])[..., 0].cumprod(1)
        self.mean_scores = scores.mean(0)
        for k, score in enumerate(self.mean_scores.tolist()):
            old = self.score_mean[k]
            self.score_mean[k] = score if old is None else old + self.SCORE_SMOOTHING * (score - old)
        keep = best_width(scores, costs, batch)
        costs.record_draft(batch, n, clock(positions.device) - t0)
        self.gate.update(costs.draft_pays(batch, 1.0 + float(scores[:, :keep].sum(1).mean()), keep + 1, n))
        self.last = DraftTree.chain(last_tokens, tokens[:, :keep], probs[:, :keep])
        return tokens[:, :keep]

    def _depth(self, n: int, costs: StepCosts, batch: int) -> int:
        """Cut chain: how many of the step's n positions to draft (`costs.best_depth`); the
        whole block on every PROBE_EVERY-th pass and until every position has an estimate."""
        self.drafts += 1
        means = self.score_mean[:n]
        if (self.drafts - 1) % self.PROBE_EVERY == 0 or None in means:
            return n
        return best_depth(means, costs, batch)

    def propose_tree(self, last_tokens, positions, nodes, rows=slice(None)):
        depth = min(nodes, self.drafter.config.block_size - 1)
        hidden = self._block_hidden(last_tokens, positions, depth, rows)
        if hidden is None:
            self.last = DraftTree.chain(last_tokens, last_tokens.new_zeros(last_tokens.shape[0], 0))
            return self.last
        tokens, probs = self.drafter.draft_candidates(hidden, self.target.lm_head.weight, self.top_k)
        tree = build_tree(last_tokens, tokens, probs, nodes, self.calibration.apply(probs))
        self.mean_scores = tree.scores[:, 1:].mean(0)
        self.last = tree
        return tree

    def verified(self, accepted, on_path, live):
        if self.last is None:
            return
        if on_path is None:  # a chain: the first `accepted` drafts and the root
            on_path = torch.arange(self.last.size, device=accepted.device) <= accepted[:, None]
        self.calibration.update(self.last, on_path, live)
        self.last = None

    def expected_tokens(self, block):
        if self.cut:
            means = self.score_mean[: block - 1]
            return None if None in means else 1.0 + sum(means)
        if self.mean_scores is None or not self.drafts_trees:
            return None
        return 1.0 + float(self.mean_scores[: block - 1].sum())


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

    def propose(self, last_tokens, positions, n, rows=slice(None)):
        d = self.drafter
        b = last_tokens.shape[0]
        index = torch.arange(b, device=last_tokens.device)[:, None]
        tokens, fused, cache_k, cache_v, done = (self.tokens[rows], self.fused[rows], self.k[rows], self.v[rows],
                                                 self.done[rows])
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
            return drafts
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
        return drafts
