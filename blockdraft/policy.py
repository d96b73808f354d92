"""How much to speculate at each step: one policy, owned by the decode loop.

Proposers only draft (`proposers.Draft`: a chain of tokens, or for tree proposers the k best
tokens of each block position, with the drafter's probability of each when asked). The
policy decides everything else, for generate, the benchmark and the server alike, from one
table of measured step costs (`costs.StepCosts`: verify seconds per batch size and verified
width, drafter-pass seconds per batch size and depth):

- **fixed** (the default of generate and the benchmark): every step drafts block - 1
  positions and verifies them all (a tree: its block - 1 best nodes).
- **adaptive** (method `dflash-cut`; the server unless `--speculation fixed`): each step drafts
  only as deep as pays on average (`costs.best_depth`, from the expected acceptance per
  position); the first pass drafts the whole block and every `PROBE_EVERY`-th step
  `PROBE_AHEAD` positions past that depth, verified whole, to keep the estimates just beyond it
  current (a position never verified is never calibrated; one far past it is hardly ever
  reached by an accepted chain, and verifying it for nothing cost a block-16 drafter's probes
  twice a step here, see `plan`); where the drafter gives
  probabilities, each other step's chain is then cut (a tree pruned) where verifying more
  stops paying (`costs.best_width` on the calibrated probabilities, per row); and while the
  tokens a step is expected to commit (from the measured acceptance, `GATE_AFTER` steps seen)
  do not pay for the drafter pass itself, the next steps skip it (`costs.DraftGate`). For a
  chain the expected acceptance of draft position k is the product of the measured
  conditional rates up to k (`costs.PositionAcceptance`, the benchmark's definition), so every
  chain drafter, prompt lookup and the EAGLE baseline included, adapts the same way; for a
  tree the running mean of its calibrated estimates (`tree.Calibration`).

Output never depends on the policy: it only chooses how many tokens are verified.
"""

from __future__ import annotations

import torch

from .costs import DraftGate, PositionAcceptance, StepCosts, best_depth, best_width
from .tree import Calibration, DraftTree, build_tree


class SpeculationPolicy:
    PROBE_EVERY = 16  # adaptive: one step in this many drafts past the best depth, verified whole
    PROBE_AHEAD = 4  # adaptive: how many positions past the best depth a probe drafts
    SMOOTHING = 0.1  # adaptive: weight of a step in the running mean of the calibrated estimates
    GATE_AFTER = 8  # adaptive: drafted steps seen before the gate may skip drafter passes

    def __init__(self, proposer, block: int, adaptive: bool = False, device=None):
        self.block = block  # the largest verified block: the pending token and block - 1 drafts (nodes)
        self.trees = proposer.drafts_trees
        deepest = proposer.max_depth or block - 1  # block positions one drafter pass can fill
        self.depth_max = max(0, min(block - 1, deepest))
        self.adaptive = adaptive and self.depth_max > 0
        self.costs = StepCosts()
        self.calibration = Calibration(max(1, self.depth_max), device)
        self.acceptance = PositionAcceptance(max(1, self.depth_max))
        self.score_mean: list[float | None] = [None] * self.depth_max  # running mean of P(drafts 1..k accepted)
        self.gate = DraftGate() if self.adaptive else None
        self.passes = 0  # adaptive drafter passes so far (the probe schedule)
        self.last: DraftTree | None = None  # the last proposal with probabilities (for calibration)
        self.depth = 0  # positions the last pass drafted
        self.expected = 0.0  # tokens per row the last tree was expected to commit (the gate's figure for trees)
        self.probing = False  # this step drafts and verifies the whole block (the probe schedule)

    @property
    def wants_probs(self) -> bool:
        """Whether proposals should carry probabilities: trees are built from them, and the
        adaptive policy cuts chains by them."""
        return self.trees or self.adaptive

    def reset(self):
        """A new batch: per-step state goes, what was learned (costs, calibration) stays."""
        self.last = None
        if self.gate is not None:
            self.gate.reset()

    # ---- before the drafter pass -------------------------------------------------------

    def alive(self) -> list[float | None]:
        """Expected P(drafts 1..k all accepted), k = 1..depth_max (None: not known yet): for a
        tree the running mean of its calibrated estimates, for a chain the product of the
        measured conditional rates (what a whole chain commits, acceptances that go together
        included; a running mean of calibrated chain estimates put HumanEval's tokens per step
        at 2.0 where 2.35 were committed)."""
        if self.trees:
            return list(self.score_mean)
        out, alive = [], 1.0
        for rate in self.acceptance.rates((1.0, 1.0))[: self.depth_max]:
            alive *= rate
            out.append(alive)
        return out

    def plan(self, batch: int) -> int:
        """How many block positions the proposer drafts this step (0: no drafter pass)."""
        self.probing = False
        if not self.adaptive:
            return self.depth_max
        if self.gate.skip():
            return 0
        self.passes += 1
        alive = self.alive()
        if self.passes == 1 or None in alive:
            self.probing = True
            return self.depth_max
        best = best_depth(alive, self.costs, batch)
        if (self.passes - 1) % self.PROBE_EVERY == 0:
            # not the whole block: with a position's conditional acceptance ~0.6 a chain reaches
            # position 8 of 15 in 2 % of rows, so a whole-block probe measured little past the best
            # depth for a verify of 16 tokens (2 plain steps on a 2-core AVX512-BF16 CPU)
            self.probing = True
            return min(self.depth_max, best + self.PROBE_AHEAD)
        return best

    # ---- after it ---------------------------------------------------------------------

    def select(self, draft, pending: torch.Tensor, batch: int):
        """What to verify from a proposal: draft tokens [B, n] (a chain) or a `DraftTree`."""
        tokens, probs = draft.tokens, draft.probs
        self.depth, self.last = tokens.shape[1], None
        if self.trees:
            if self.depth == 0:
                return DraftTree.chain(pending, tokens[..., 0])
            tree = build_tree(pending, tokens, probs, self.block - 1, self.calibration, children=draft.children)
            if self.adaptive and not self.probing:
                tree = tree.prefix(best_width(tree.scores[:, 1:], self.costs, batch) + 1)
            self.expected = 1.0 + float(tree.scores[:, 1:].sum(1).mean())
            self.last = tree
            return tree
        keep = self.depth
        if probs is not None and keep:
            scores = self.calibration.apply(probs[..., None])[..., 0].cumprod(1)
            for k, score in enumerate(scores.mean(0).tolist()):
                old = self.score_mean[k]
                self.score_mean[k] = score if old is None else old + self.SMOOTHING * (score - old)
            if self.adaptive and not self.probing:
                keep = best_width(scores, self.costs, batch)
            self.last = DraftTree.chain(pending, tokens[:, :keep], probs[:, :keep])
        return tokens[:, :keep]

    def drafted(self, batch: int, seconds: float):
        """The drafter pass of this step took `seconds` (measured only where it is used)."""
        if self.adaptive and self.depth:
            self.costs.record_draft(batch, self.depth, seconds)

    def verified(
        self,
        batch: int,
        width: int,
        seconds: float,
        accepted: torch.Tensor,
        on_path,
        live: list[bool],
        accepted_list: list[int],
    ):
        """After the verify of `width` tokens per row: `accepted` [B] drafts per row (also as a
        list), `on_path` [B, T] the accepted tree nodes (None for a chain), `live` the rows that
        were decoding."""
        self.costs.record(batch, width, seconds)
        drafted = width - 1
        if self.last is not None:
            if on_path is None:  # a chain: the first `accepted` drafts and the root
                on_path = torch.arange(self.last.size, device=accepted.device) <= accepted[:, None]
            self.calibration.update(self.last, on_path, torch.tensor(live, device=accepted.device))
            self.last = None
        if drafted and self.adaptive and not self.trees:  # (only the adaptive choices read them)
            for a, is_live in zip(accepted_list, live, strict=False):
                if is_live:
                    self.acceptance.record(a, drafted)
        # (a pass whose drafts were all cut was paid for nothing: no acceptance needed to judge it)
        seen = self.trees or width == 1 or self.acceptance.reached[0] >= self.GATE_AFTER
        if self.gate is not None and self.depth and seen:
            expected = self.expected if self.trees else self.expected_tokens(width)
            self.gate.update(self.costs.draft_pays(batch, expected, width, self.depth))

    def expected_tokens(self, block: int) -> float:
        """Tokens per row a step verifying `block` tokens is expected to commit (the bonus token
        included), from the expected acceptance per position."""
        return 1.0 + sum(a for a in self.alive()[: block - 1] if a is not None)
