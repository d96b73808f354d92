"""What a verify step costs, measured while decoding, and how many draft tokens pay for it.

A target forward over w tokens costs c(w) decode steps: on a CPU the weights stream once
whatever w is, so c grows slowly (about 1.1 at w = 2, 1.6-1.9 at w = 8-16 on the 2-core
CPU, `python benchmarks/cpu_peers.py`), then the arithmetic takes over. `StepCosts` keeps the
measured seconds per (batch size, width); an unmeasured width is estimated from a prior
curve scaled to the measured ones. `best_width` picks how many of a step's draft tokens to
verify: the prefix of best-first draft nodes (a chain's tokens, a tree's nodes) with the
most expected tokens per second. The decode loop's one speculation policy
(`blockdraft.policy`: generate, bench and serve) decides from this one table. It also keeps
the drafter pass's seconds per draft depth, so that the policy drafts only as deep as pays
(`best_depth`) and `DraftGate` can stop paying for drafts that do not pay.
"""

from __future__ import annotations

import math
import time

import torch


def clock(device: torch.device) -> float:
    """Wall time after the device has finished its queued work (accurate timing on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def prior_cost(width: int) -> float:
    """Cost of verifying `width` tokens in decode steps before any measurement: 1 at width 1,
    +0.25 per doubling (close to the 2-core CPU's fp32 figures up to 16 tokens)."""
    return 1.0 + 0.25 * math.log2(max(width, 1))


class StepCosts:
    """Seconds of a verify step per (batch size, verified width): the median of the last
    `window` measurements (a step that met a page fault or another process does not move it,
    an exponential average it did: on a 2-core CPU one width's mean drifted 30 % above its
    neighbours' and the policy cut chains to avoid it), made non-decreasing in the width
    (`non_decreasing`: widths out of order pooled, weighted by their measurements);
    between measured widths the straight line between them, past them the prior curve scaled
    to the nearest one, and for a batch size not measured the nearest batch size's scale."""

    def __init__(self, window: int = 15):
        self.window = window
        self.samples: dict[tuple[int, int], list[float]] = {}
        self.seconds: dict[tuple[int, int], float] = {}  # the median per (batch size, width)
        self.draft: dict[tuple[int, int], float] = {}  # the same for a drafter pass per (batch size, depth)
        self.draft_samples: dict[tuple[int, int], list[float]] = {}

    def _keep(self, samples: dict, table: dict, key, seconds: float):
        kept = samples.setdefault(key, [])
        kept.append(seconds)
        del kept[: -self.window]
        ordered = sorted(kept)
        table[key] = ordered[len(ordered) // 2]

    def record(self, batch: int, width: int, seconds: float):
        self._keep(self.samples, self.seconds, (batch, width), seconds)

    def record_draft(self, batch: int, depth: int, seconds: float):
        self._keep(self.draft_samples, self.draft, (batch, depth), seconds)

    def draft_estimate(self, batch: int, depth: int) -> float | None:
        """Seconds of a drafter pass of `depth` positions: measured, else the nearest deeper
        measured depth's (a pass costs no less for more positions), else the deepest one
        measured; None when no pass of this batch size has been measured."""
        depths = sorted(d for b, d in self.draft if b == batch)
        if not depths:
            return None
        deeper = [d for d in depths if d >= depth]
        return self.draft[(batch, deeper[0] if deeper else depths[-1])]

    def draft_pays(self, batch: int, expected: float, width: int, depth: int) -> bool | None:
        """Whether a step that drafted `depth` positions, expecting `expected` tokens per row
        from verifying `width` tokens, beats plain decoding in tokens per second, its drafter
        pass included: expected / (draft + c(width)) >= 1 / c(1). None until a drafter pass
        and a verify step of this batch size have been measured."""
        draft = self.draft_estimate(batch, depth)
        if draft is None or not any(b == batch for b, _ in self.seconds):
            return None
        plain, verify = self.estimates(batch, [1, width])
        return expected * plain >= draft + verify

    def measured(self, batch: int, width: int) -> float | None:
        return self.seconds.get((batch, width))

    def estimate(self, batch: int, width: int) -> float:
        """Seconds (or, before any measurement at all, decode steps) of a (batch, width) step."""
        return self.estimates(batch, [width])[0]

    def estimates(self, batch: int, widths) -> list[float]:
        """`estimate` for several widths (see the class)."""
        measured = sorted((w, s) for (b, w), s in self.seconds.items() if b == batch)
        if not measured:
            batches = {b for b, _ in self.seconds}
            scale = 1.0
            if batches:
                near = min(batches, key=lambda b: (abs(b - batch), b))
                ratios = sorted(s / prior_cost(w) for (b, w), s in self.seconds.items() if b == near)
                scale = ratios[len(ratios) // 2]  # (comparable within one batch size)
            return [scale * prior_cost(w) for w in widths]
        weights = [len(self.samples.get((batch, w), ())) or 1 for w, _ in measured]
        known = non_decreasing([w for w, _ in measured], [s for _, s in measured], weights)
        return [self._between(known, w) for w in widths]

    @staticmethod
    def _between(known: list[tuple[int, float]], width: int) -> float:
        """Seconds at `width` from the measured (width, seconds) pairs, in increasing width."""
        (w0, s0), (w1, s1) = known[0], known[-1]
        if width <= w0:
            return s0 * prior_cost(width) / prior_cost(w0)
        if width >= w1:
            return s1 * prior_cost(width) / prior_cost(w1)
        for (a, sa), (b, sb) in zip(known, known[1:], strict=False):
            if a <= width <= b:
                return sa + (sb - sa) * (width - a) / (b - a)
        raise AssertionError("unreachable")


def non_decreasing(widths: list[int], seconds: list[float], weights: list[int]) -> list[tuple[int, float]]:
    """The non-decreasing fit of seconds over increasing widths closest to them in weighted least
    squares (pool adjacent violators): where a width measured dearer than a wider one, the two get
    the mean of their measurements, weighted by how many each has. (A running maximum instead let
    a width measured a few times in a noisy moment, 10 % above the width measured at every step,
    price every wider verify; the policy then cut chains to save a cost that was not there.)"""
    pools: list[list] = []  # [weighted seconds, weight, widths]
    for w, s, n in zip(widths, seconds, weights, strict=True):
        pools.append([s * n, n, [w]])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, n_last, ws = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += n_last
            pools[-1][2] += ws
    return [(w, total / n) for total, n, ws in pools for w in ws]


class PositionAcceptance:
    """Per draft position k = 1, 2, ...: how many steps drafted position k with drafts 1..k-1
    all accepted (`reached`), and how many of those accepted it. The one definition of the
    per-position acceptance rate P(draft k accepted | drafts 1..k-1 accepted): the benchmark
    reports it, the speculation policy's expected tokens per step are made of it where the
    drafter gives no probabilities."""

    def __init__(self, positions: int):
        self.reached = [0] * positions
        self.accepted = [0] * positions

    def record(self, accepted: int, drafted: int):
        """One step that drafted `drafted` tokens of which the first `accepted` were accepted."""
        for k in range(1, min(drafted, accepted + 1, len(self.reached)) + 1):
            self.reached[k - 1] += 1
            self.accepted[k - 1] += k <= accepted

    def rates(self, prior: tuple[float, float] = (0.0, 0.0)) -> list[float]:
        """Rate per position, (accepted + a) / (reached + a + b) with the prior (a, b) (e.g. (1, 1):
        an unseen position counts as 1/2); 0.0 where a position was never reached without one."""
        a, b = prior
        return [
            (acc + a) / (n + a + b) if n + a + b else 0.0 for acc, n in zip(self.accepted, self.reached, strict=False)
        ]

    def expected_tokens(self, block: int, prior: tuple[float, float] = (1.0, 1.0)) -> float:
        """E[tokens a step commits at `block`] = 1 + sum_k prod_{j<=k} p_j (the bonus token included)."""
        total, alive = 1.0, 1.0
        for p in self.rates(prior)[: block - 1]:
            alive *= p
            total += alive
        return total


# A shorter draft is chosen over a longer one only where it is expected to be this much faster:
# measured costs are noisy (a few per cent between runs on a 2-core CPU), and where verifying more
# tokens costs almost nothing (bf16 with a fused step) a cut made on noise only loses accepted tokens.
NEAR_BEST = 0.03


def _deepest_near_best(options: list[int], rates: list[float], gains) -> int:
    """The deepest option whose rate is within `NEAR_BEST` of the best one's, among options
    that gain something over the one before them (`gains` indexed by option)."""
    best = max(rates)
    near = [
        n
        for n, rate in zip(options, rates, strict=True)
        if rate >= (1 - NEAR_BEST) * best and (n == options[0] or gains[n] > gains[n - 1])
    ]
    return max(near)


def best_width(scores: torch.Tensor, costs: StepCosts, batch: int, widths=None) -> int:
    """How many draft nodes to verify: scores [B, N] are the nodes' estimated acceptance
    probabilities in best-first order (non-increasing per row, every prefix a valid draft).
    Verifying the first n nodes yields sum_rows(1 + sum_{i<n} scores) tokens in expectation
    (the bonus token plus each node's chance to be on the accepted path) and costs
    costs.estimate(batch, n + 1); returns the n (0..N) with the most tokens per second,
    among `widths` - 1 if given."""
    n_max = scores.shape[1]
    gains = torch.cat([scores.new_zeros(1), scores.double().sum(0).cumsum(0)]) + scores.shape[0]
    candidates = range(n_max + 1) if widths is None else sorted({w - 1 for w in widths if 1 <= w <= n_max + 1})
    gains = gains.tolist()
    cost = dict(zip(candidates, costs.estimates(batch, [n + 1 for n in candidates]), strict=False))
    return _deepest_near_best(list(candidates), [gains[n] / cost[n] for n in candidates], gains)


def best_depth(mean_scores: list[float], costs: StepCosts, batch: int) -> int:
    """How many positions a one-pass drafter should draft: mean_scores[k] is the mean
    estimated chance that drafts 1..k+1 are all accepted. Drafting (and verifying) d
    positions yields 1 + sum(mean_scores[:d]) tokens per row in expectation and costs
    costs.draft_estimate(batch, d) + costs.estimate(batch, d + 1); returns the d
    (1..len(mean_scores)) with the most tokens per second, the shallowest on a tie. On
    the 2-core CPU a drafter pass over 3 positions costs about 70% of one over 8: a
    drafter whose later positions rarely pay drafts only the first ones."""
    depths = range(1, len(mean_scores) + 1)
    verify = costs.estimates(batch, [d + 1 for d in depths])
    gains = [1.0 + sum(mean_scores[:d]) for d in depths]
    rates = [
        gain / ((costs.draft_estimate(batch, d) or 0.0) + v) for d, gain, v in zip(depths, gains, verify, strict=False)
    ]
    return _deepest_near_best(list(depths), rates, [0.0] + gains)


class DraftGate:
    """Stops paying for a drafter that is not helping. After a step whose draft did not pay
    (`StepCosts.draft_pays`: its expected tokens per second, the drafter pass included, below
    plain decoding's), the next 1, then 2, 4, ... up to `max_skip` steps decode without a
    drafter pass; a draft that pays drafts again at every step. Output is unaffected
    (skipping only verifies fewer tokens); with a drafter that is rarely confident the loop
    then runs at close to plain decoding's speed instead of paying a pass per token."""

    def __init__(self, max_skip: int = 16):
        self.max_skip = max_skip
        self.backoff = 0  # steps skipped after the last draft that did not pay
        self.left = 0  # steps still to skip
        self.skipped = 0  # steps skipped so far (for reports and tests)

    def skip(self) -> bool:
        """Whether this step skips the drafter pass (counts it down)."""
        if self.left <= 0:
            return False
        self.left -= 1
        self.skipped += 1
        return True

    def update(self, pays: bool | None):
        if pays is False:
            self.backoff = min(max(1, 2 * self.backoff), self.max_skip)
            self.left = self.backoff
        elif pays:
            self.backoff = self.left = 0

    def reset(self):
        self.backoff = self.left = 0
