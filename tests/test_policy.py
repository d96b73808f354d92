"""The one speculation policy: its choices from rigged costs and acceptance (no timing)."""

import pytest
import torch

from blockdraft.policy import SpeculationPolicy
from blockdraft.proposers import Draft, LookupProposer


def verify(policy, batch, width, seconds, accepted):
    """One verify of `width` tokens per row, rows accepting `accepted` drafts each."""
    policy.verified(batch, width, seconds, torch.tensor(accepted), None, [True] * len(accepted), accepted)


def test_fixed_drafts_and_verifies_the_whole_block():
    policy = SpeculationPolicy(LookupProposer(max_block_size=8), 8)
    assert policy.plan(1) == 7 and not policy.wants_probs
    tokens = torch.arange(14).view(2, 7)
    assert torch.equal(policy.select(Draft(tokens), torch.zeros(2, dtype=torch.long), 2), tokens)


def test_adaptive_drafts_deep_where_verify_is_cheap_and_stops_where_drafts_do_not_pay():
    """A drafter without probabilities (prompt lookup): measured acceptance per position, every
    position accepted half of the time. Batch 1: verifying 8 tokens costs what 1 does, so the
    whole block pays. Batch 16: every verified token costs a step, so a draft never pays for
    itself; after such a step the next one skips the drafter pass."""
    policy = SpeculationPolicy(LookupProposer(max_block_size=8), 8, adaptive=True)
    for _ in range(40):
        verify(policy, 1, 8, 0.05, [0, 1, 2, 7])
    for w in range(1, 9):
        policy.costs.record(1, w, 0.05)
        policy.costs.record(16, w, 0.05 * w)
        policy.costs.record_draft(1, w - 1 or 1, 0.001)
        policy.costs.record_draft(16, w - 1 or 1, 0.001)
    assert 1.5 < policy.expected_tokens(8) < 3.5 and policy.expected_tokens(1) == 1.0
    assert policy.plan(1) == 7  # the first pass probes the whole block
    assert policy.plan(1) == 7  # and so does the best depth here
    depth = policy.plan(16)
    assert 1 <= depth < 7  # as deep as pays: the verify cost grows with every token
    policy.select(Draft(torch.zeros(16, depth, dtype=torch.long)), torch.zeros(16, dtype=torch.long), 16)
    verify(policy, 16, depth + 1, 0.05 * (depth + 1), [0] * 16)
    assert policy.plan(16) == 0  # that draft did not pay (acceptance seen above): the next step skips the pass
    assert policy.plan(16) > 0  # (backing off one step at first)


def test_probes_look_a_few_positions_past_the_best_depth():
    """The first pass drafts the whole block; after it every PROBE_EVERY-th pass drafts PROBE_AHEAD
    positions past the depth that pays, not the whole block (for a block-16 drafter a whole-block
    probe verified 16 tokens, 2 plain steps on the 2-core AMD EPYC, for positions an accepted
    chain hardly ever reaches), and the passes between them draft that depth."""
    policy = SpeculationPolicy(LookupProposer(max_block_size=16), 16, adaptive=True)
    every, ahead = SpeculationPolicy.PROBE_EVERY, SpeculationPolicy.PROBE_AHEAD
    for w in range(1, 17):
        policy.costs.record(1, w, 0.01 * (1 + 0.25 * (w - 1)))
        policy.costs.record_draft(1, w - 1 or 1, 0.001)
    for _ in range(40):
        verify(policy, 1, 16, 0.05, [0, 1, 2, 3])  # chains die within the first four positions
    depths = [policy.plan(1) for _ in range(2 * every + 1)]
    best = depths[1]
    assert depths[0] == 15 and 1 <= best and best + ahead < 15
    assert depths[every] == depths[2 * every] == best + ahead
    assert all(d == best for i, d in enumerate(depths) if i % every)


def test_adaptive_cuts_each_chain_by_its_calibrated_probabilities():
    """A drafter with probabilities: verifying costs a step per token beyond the first (rigged),
    so a row keeps only the drafts whose cumulative probability pays for them."""
    policy = SpeculationPolicy(LookupProposer(max_block_size=5), 5, adaptive=True)
    for w in range(1, 6):
        policy.costs.record(2, w, 0.01 * (1 + 0.5 * (w - 1)))
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    probs = torch.tensor([[0.99, 0.99, 0.99, 0.99], [0.99, 0.05, 0.05, 0.05]])
    chosen = policy.select(Draft(tokens, probs), torch.zeros(2, dtype=torch.long), 2)
    # one width for the batch: the one with the most expected tokens per second over both rows
    gains = {n: 2 + float(torch.cumprod(probs, 1)[:, :n].sum()) for n in range(5)}
    best = max(gains, key=lambda n: (gains[n] / (0.01 * (1 + 0.5 * n)), -n))
    assert chosen.shape == (2, best) and torch.equal(chosen, tokens[:, :best])
    assert policy.expected_tokens(5) > 1.0  # the running estimates took the probabilities in


def test_a_step_cost_is_the_median_of_its_measurements_and_grows_with_the_width():
    """One slow step (a page fault, another process) does not move a width's cost; a wider
    verify is never estimated cheaper than a narrower one: where noise put a width above a wider
    one, both get their medians' mean weighted by their measurements (a width seen a few times
    does not price the width seen at every step); between measured widths the line."""
    from blockdraft.costs import StepCosts, non_decreasing

    costs = StepCosts()
    for seconds in (0.010, 0.011, 0.050, 0.010, 0.012, 0.011):
        costs.record(1, 4, seconds)
    for seconds in (0.014, 0.014, 0.014):
        costs.record(1, 2, seconds)  # noise made width 2 look dearer than width 4
    costs.record(1, 8, 0.020)
    assert costs.estimate(1, 4) == costs.estimate(1, 2) == pytest.approx((3 * 0.014 + 6 * 0.011) / 9)
    assert costs.estimate(1, 6) == pytest.approx((costs.estimate(1, 4) + 0.020) / 2)  # halfway between 4 and 8
    fitted = non_decreasing([1, 2, 3, 4], [1.0, 3.0, 2.0, 0.5], [1, 1, 1, 4])  # 2 and 3 pool, then with 4
    assert fitted[0] == (1, 1.0) and [w for w, _ in fitted] == [1, 2, 3, 4]
    assert [s for _, s in fitted[1:]] == pytest.approx([(3.0 + 2.0 + 4 * 0.5) / 6] * 3)
    assert non_decreasing([1, 2], [1.0, 2.0], [5, 1]) == [(1, 1.0), (2, 2.0)]


def test_a_chains_expected_tokens_are_what_its_steps_committed():
    """Drafts 1 and 2 accepted together or not at all, the confident chains (probabilities 0.9)
    whole, the others (0.3) never: a step commits 2 tokens on average. The policy's figure for a
    chain (its depth choice and gate read it) is that, from the measured conditional rates; the
    calibrated probabilities multiplied along the chain said 1.92 (for a DFlash drafter on
    HumanEval: 2.0 where 2.35 were committed)."""
    policy = SpeculationPolicy(LookupProposer(max_block_size=3), 3, adaptive=True)
    probs = torch.tensor([[0.9, 0.9], [0.3, 0.3]] * 5)
    accepted = [2, 0] * 5
    for _ in range(50):
        policy.plan(10)
        policy.select(Draft(torch.zeros(10, 2, dtype=torch.long), probs), torch.zeros(10, dtype=torch.long), 10)
        verify(policy, 10, 3, 0.01, accepted)
    assert abs(policy.expected_tokens(3) - 2.0) < 0.02
    calibrated = 1 + sum(s for s in policy.score_mean)
    assert abs(calibrated - 1.92) < 0.02


def test_the_gate_waits_for_measured_acceptance_unless_every_draft_was_cut():
    """The first steps of a request say little about a drafter: a verified draft that did not
    pay closes the gate only after `GATE_AFTER` rows' acceptance was seen; a pass whose drafts
    were all cut was paid for nothing and closes it at once."""
    policy = SpeculationPolicy(LookupProposer(max_block_size=4), 4, adaptive=True)
    for w in range(1, 5):
        policy.costs.record(1, w, 0.01 * w)  # every verified token costs a step: no draft pays
    policy.costs.record_draft(1, 3, 0.001)
    for step in range(policy.GATE_AFTER):
        assert policy.plan(1) > 0, step
        policy.select(Draft(torch.zeros(1, 3, dtype=torch.long)), torch.zeros(1, dtype=torch.long), 1)
        verify(policy, 1, 4, 0.04, [0])
    assert policy.plan(1) == 0  # now seen: the gate skips the next pass

    cut = SpeculationPolicy(LookupProposer(max_block_size=4), 4, adaptive=True)
    cut.costs.record(1, 1, 0.01)
    cut.costs.record_draft(1, 3, 0.005)
    assert cut.plan(1) == 3
    cut.select(Draft(torch.zeros(1, 3, dtype=torch.long)), torch.zeros(1, dtype=torch.long), 1)
    cut.depth = 3
    verify(cut, 1, 1, 0.01, [0])  # all three drafts cut: one token for a pass and a step
    assert cut.plan(1) == 0
