"""Token trees from one DFlash pass, verified in one target forward.

One drafter pass gives a distribution at every block position. The chain keeps each
position's argmax; a tree also keeps the runners-up. `build_tree` grows, per row, the
`nodes` most probable paths: a node at depth d holds one of the top-k tokens of block
position d, its estimated probability of being accepted is the product of its path's
(calibrated) draft probabilities, and nodes are added best first, so every prefix of
the node list is itself a tree (a parent always comes before its children) and the
scores never increase along the list. Children of a node hold distinct tokens. With a
Markov head a position's candidates depend on the token before it: each node's children
are then the top-k of the next position given that node's token (`children`).

Verification (`DecodeLoop`): node i sits at position committed + depth(i) in cache slot
committed + i and sees the committed context and its own ancestors (`visible`). The
target's token after each node is sampled as usual (greedy: argmax; otherwise with the
uniform number of that position and the row's seed), and `accept` walks from the root
into the child equal to the target's token, as long as there is one. The tokens emitted
along that path are exactly the target's own samples given the path, so the output is
the one plain decoding gives (lossless by construction, at any temperature). The
accepted path's keys/values are then moved to consecutive slots (`compact_path`).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Trees of draft tokens for a batch, all with the same number of nodes T.

    tokens [B, T]: node 0 is the row's pending token (the root), the others are drafts;
    parents [B, T]: parent node index (-1 for the root), always smaller than the node's;
    depths [B, T]: distance from the root; scores [B, T]: estimated probability that the
    node is accepted (1 for the root); probs [B, T]: the node's own draft probability."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def chain(cls, last_tokens: torch.Tensor, drafts: torch.Tensor, probs: torch.Tensor | None = None) -> DraftTree:
        """A chain as a tree: the root, then drafts [B, n] one below the other."""
        b, n = drafts.shape
        idx = torch.arange(n + 1, device=drafts.device).expand(b, -1)
        probs = torch.ones(b, n, device=drafts.device) if probs is None else probs.float()
        probs = torch.cat([torch.ones(b, 1, device=drafts.device), probs], dim=1)
        return cls(torch.cat([last_tokens[:, None], drafts], dim=1), idx - 1, idx, probs.cumprod(1), probs)

    def prefix(self, size: int) -> DraftTree:
        """The first `size` nodes (the root included): a tree too, since parents come first."""
        return DraftTree(*(getattr(self, f)[:, :size] for f in ("tokens", "parents", "depths", "scores", "probs")))

    def visible(self) -> torch.Tensor:
        """[B, T, T] bool: node i sees node j iff j is i or one of its ancestors (computed once)."""
        return self._visible

    @functools.cached_property
    def _visible(self) -> torch.Tensor:
        b, t = self.parents.shape
        eye = torch.eye(t, dtype=torch.bool, device=self.parents.device).expand(b, t, t)
        up = torch.zeros(b, t, t + 1, dtype=torch.bool, device=self.parents.device)
        up.scatter_(2, (self.parents % (t + 1))[:, :, None], True)  # root's parent -> a dump column
        seen = eye | up[:, :, :t]
        reach = 1
        while reach < t:  # pointer doubling: after k rounds, ancestors up to 2^k levels up
            seen = seen | (torch.bmm(seen.float(), seen.float()) > 0)
            reach *= 2
        return seen

    def accept(self, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """target_tokens [B, T]: the target's token after each node. Returns (path [B, P] node
        indices root first, padded by repeating the last node; accepted [B] drafts on the
        path; on_path [B, T] bool)."""
        b, t = self.tokens.shape
        parent_token = target_tokens.gather(1, self.parents.clamp(min=0))
        agrees = self.tokens == parent_token
        agrees[:, 0] = True
        # a node is on the path when it and all its ancestors agree with the target
        on_path = ~(self.visible() & ~agrees[:, None, :]).any(-1)
        accepted = on_path.long().sum(1) - 1
        width = int(accepted.max()) + 1
        depth = torch.where(on_path, self.depths, width)  # off-path nodes go to a dump column
        path = torch.zeros(b, width + 1, dtype=torch.long, device=self.tokens.device)
        path.scatter_(1, depth, torch.arange(t, device=self.tokens.device).expand(b, -1))
        path = path[:, :width]
        last = path.gather(1, accepted[:, None])
        cols = torch.arange(width, device=path.device)
        return torch.where(cols <= accepted[:, None], path, last), accepted, on_path


def build_tree(
    last_tokens: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_probs: torch.Tensor,
    nodes: int,
    calibration: Calibration | None = None,
    children=None,
) -> DraftTree:
    """Grow each row's tree best first from per-position candidates.

    cand_tokens / cand_probs [B, n, k]: for block positions 1..n, k distinct candidate tokens
    sorted by draft probability (descending) and those probabilities. Nodes are ordered by their
    acceptance estimates, `calibration.apply` of the probabilities (without one: the
    probabilities themselves). Every row gets min(nodes, what the candidates allow) nodes.

    Where a position's candidates depend on the token before it (a Markov head), `children(row,
    d, token)` gives the k candidates of position d + 1 (0-based d) below a node holding `token`
    at position d, with their probabilities; cand_* then serve for position 1 only."""
    b, n, k = cand_tokens.shape
    estimates = cand_probs if calibration is None else calibration.apply(cand_probs)
    possible = sum(k**d for d in range(1, n + 1)) if k > 1 else n
    count = min(nodes, possible)
    probs_list, est_list, tokens_list = cand_probs.tolist(), estimates.tolist(), cand_tokens.tolist()
    out_tok = [[0] * (count + 1) for _ in range(b)]
    out_par = [[-1] + [0] * count for _ in range(b)]
    out_dep = [[0] * (count + 1) for _ in range(b)]
    out_score = [[1.0] + [0.0] * count for _ in range(b)]
    out_prob = [[1.0] + [0.0] * count for _ in range(b)]
    for row in range(b):
        p, raw, tok = est_list[row], probs_list[row], tokens_list[row]
        below = {0: (tok[0], raw[0], p[0])}  # with `children`: each node's candidates one position deeper
        # (-score, tie-break, depth index, rank, parent node, parent's score)
        heap = [(-p[0][0], 0, 0, 0, 0, 1.0)]
        tie = 0
        for node in range(1, count + 1):
            neg, _, d, r, parent, parent_score = heapq.heappop(heap)
            c_tok, c_raw, c_est = below[parent] if children is not None else (tok[d], raw[d], p[d])
            out_tok[row][node], out_par[row][node] = c_tok[r], parent
            out_dep[row][node], out_score[row][node], out_prob[row][node] = d + 1, -neg, c_raw[r]
            if d + 1 < n:  # first child: the best candidate one position deeper
                if children is not None:
                    t_next, p_next = children(row, d + 1, c_tok[r])
                    e_next = (
                        p_next
                        if calibration is None
                        else calibration.apply(torch.tensor(p_next)[None, None], first=d + 1)[0, 0].tolist()
                    )
                    below[node] = (t_next, p_next, e_next)
                first = below[node][2][0] if children is not None else p[d + 1][0]
                tie += 1
                heapq.heappush(heap, (neg * first, tie, d + 1, 0, node, -neg))
            if r + 1 < k:  # next sibling: the parent's next candidate at this position
                tie += 1
                heapq.heappush(heap, (-parent_score * c_est[r + 1], tie, d, r + 1, parent, parent_score))
    device = cand_tokens.device

    def t(values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=device)

    tokens = t(out_tok)
    tokens[:, 0] = last_tokens
    return DraftTree(tokens, t(out_par), t(out_dep), t(out_score, torch.float32), t(out_prob, torch.float32))


class Calibration:
    """Draft probabilities against what the target accepted, per block position d: among the
    nodes at d whose parent was accepted, accepted / sum of their draft probabilities
    (with one pseudo-count each). A node's calibrated acceptance estimate is
    min(1, factor_d * p). Counters stay on the device."""

    def __init__(self, positions: int, device=None):
        self.accepted = torch.zeros(positions, dtype=torch.float64, device=device)
        self.predicted = torch.zeros(positions, dtype=torch.float64, device=device)

    def factors(self) -> torch.Tensor:
        return (self.accepted + 1) / (self.predicted + 1)

    def apply(self, probs: torch.Tensor, first: int = 0) -> torch.Tensor:
        """probs [B, n, k] for block positions first + 1..first + n -> calibrated acceptance
        estimates."""
        n = probs.shape[1]
        factors = self.factors()[first : first + n, None].to(probs.device)
        return (probs.double() * factors).clamp(max=1.0).to(probs.dtype)

    def update(self, tree: DraftTree, on_path: torch.Tensor, rows: torch.Tensor | None = None):
        """After a verify: `on_path` [B, T] from `DraftTree.accept`; `rows` [B] bool selects the
        rows that count (live sequences)."""
        parent_on = on_path.gather(1, tree.parents.clamp(min=0))
        parent_on[:, 0] = False
        if rows is not None:
            parent_on &= rows[:, None]
        weight = parent_on.double()
        where = (tree.depths - 1).clamp(min=0, max=self.accepted.shape[0] - 1).flatten()
        self.accepted.index_add_(0, where, (weight * on_path.double()).flatten())
        self.predicted.index_add_(0, where, (weight * tree.probs.double()).flatten())
