"""Tree verification and confidence-cut chains are lossless.

Oracles: our own greedy decoding and HF transformers' `generate` (greedy), exact output
distributions at T > 0 (chi-square), and a plain walk down the tree for acceptance.
"""

import random

import pytest
import torch

import blockdraft.tree as tree_mod
from blockdraft import methods
from blockdraft.batcher import generate_steps
from blockdraft.costs import DraftGate, StepCosts, best_depth, best_width, prior_cost
from blockdraft.decode import DecodeState
from blockdraft.errors import BlockdraftError
from blockdraft.proposers import DFlashProposer, DFlashTreeProposer, Draft, Proposer
from blockdraft.sampling import SamplingParams
from blockdraft.sequences import Request
from blockdraft.tree import DraftTree, build_tree

from .test_decode import assert_same_or_tie, hf_greedy  # noqa: F401
from .test_sampling import CASES, PROMPT, L, chi_square, exact_distribution, tiny  # noqa: F401

N_NEW = 24
VOCAB = 49152


def walk(tree: DraftTree, row: int, target_tokens) -> list[int]:
    """The accepted path by hand: from the root, step into the child holding the target's token."""
    parents, tokens = tree.parents[row].tolist(), tree.tokens[row].tolist()
    path = [0]
    while True:
        want = target_tokens[row][path[-1]]
        children = [i for i, p in enumerate(parents) if p == path[-1] and tokens[i] == want]
        assert len(children) <= 1
        if not children:
            return path
        path.append(children[0])


def test_trees_grow_best_first_and_accept_what_a_walk_accepts():
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for trial in range(40):
        b, n, k, nodes = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 40)
        probs = torch.rand(b, n, k, generator=gen).sort(-1, descending=True).values
        if trial % 5 == 0:
            probs[:] = 0.25  # ties everywhere
        tokens = torch.stack([torch.randperm(8, generator=gen)[:k] for _ in range(b * n)]).view(b, n, k)
        tree = build_tree(torch.arange(b) + 100, tokens, probs, nodes)
        possible = n if k == 1 else sum(k**d for d in range(1, n + 1))
        assert tree.size == 1 + min(nodes, possible)
        for row in range(b):
            par, dep, tok, score = (x[row].tolist() for x in (tree.parents, tree.depths, tree.tokens, tree.scores))
            assert par[0] == -1 and dep[0] == 0 and tok[0] == 100 + row
            for i in range(1, tree.size):
                assert par[i] < i and dep[i] == dep[par[i]] + 1
                assert tok[i] in tokens[row, dep[i] - 1].tolist()
                expect = score[par[i]] * float(probs[row, dep[i] - 1, tokens[row, dep[i] - 1].tolist().index(tok[i])])
                assert abs(score[i] - expect) < 1e-6
                assert score[i] <= score[i - 1] + 1e-9  # best first: never increasing
            siblings = {}
            for i in range(1, tree.size):
                assert (par[i], tok[i]) not in siblings  # children of a node hold distinct tokens
                siblings[(par[i], tok[i])] = i
        vis = tree.visible()
        for row in range(b):
            for i in range(tree.size):
                anc, j = {i}, i
                while tree.parents[row, j] >= 0:
                    j = int(tree.parents[row, j])
                    anc.add(j)
                assert {j for j in range(tree.size) if vis[row, i, j]} == anc
        for _ in range(5):  # target tokens that often follow some branch
            target = torch.where(
                torch.rand(b, tree.size, generator=gen) < 0.7,
                tokens[:, :, 0].repeat(1, tree.size)[:, : tree.size].clone(),
                torch.randint(0, 8, (b, tree.size), generator=gen),
            )
            target = target.scatter(1, torch.zeros(b, 1, dtype=torch.long), tokens[:, 0, rng.randrange(k), None])
            path, accepted, on_path = tree.accept(target)
            for row in range(b):
                want = walk(tree, row, target.tolist())
                assert accepted[row] == len(want) - 1
                assert path[row, : len(want)].tolist() == want
                assert set(torch.nonzero(on_path[row]).flatten().tolist()) == set(want)


def test_a_chain_is_a_tree_and_calibration_counts_acceptance():
    chain = DraftTree.chain(
        torch.tensor([7, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]])
    )
    path, accepted, on_path = chain.accept(torch.tensor([[1, 2, 0, 0], [0, 0, 0, 0]]))
    assert accepted.tolist() == [2, 0] and path[0].tolist() == [0, 1, 2]
    cal = tree_mod.Calibration(3)
    cal.update(chain, on_path, torch.tensor([True, True]))
    # position 1: both rows reached it (0.5 + 0.9 predicted, 1 accepted); 2: row 0 only; 3: row 0
    assert cal.accepted.tolist() == [1, 1, 0] and torch.allclose(
        cal.predicted, torch.tensor([1.4, 0.5, 0.5], dtype=torch.float64)
    )


def test_best_width_trades_expected_tokens_against_measured_cost():
    scores = torch.tensor([[0.9, 0.8, 0.5, 0.1, 0.05, 0.01, 0.0]])
    flat = StepCosts()
    for w in range(1, 9):
        flat.record(1, w, 0.03)  # verifying is free: take everything
    assert best_width(scores, flat, 1) == 6  # all but the node with no chance at all
    steep = StepCosts()
    for w in range(1, 9):
        steep.record(1, w, 0.03 * w)  # every token costs a full step: speculation never pays
    assert best_width(scores, steep, 1) == 0
    prior = StepCosts()  # nothing measured: the prior curve, then scaled by a measurement
    rates = {n: (1 + float(scores[0, :n].sum())) / prior_cost(n + 1) for n in range(7)}  # (node 7 adds nothing)
    assert best_width(scores, prior, 1) == max(n for n, r in rates.items() if r >= 0.97 * max(rates.values())) == 4
    assert max(rates, key=rates.get) == 3  # the fastest by 1 %: within the noise, the deeper draft is kept
    prior.record(4, 16, 2.0)
    assert abs(prior.estimate(4, 2) / prior.estimate(4, 1) - prior_cost(2)) < 1e-9
    assert best_width(scores, prior, 4, widths=(1, 4)) in (0, 3)


def test_the_cut_drafts_only_as_deep_as_pays():
    costs = StepCosts()
    for w, ms in {1: 30, 2: 32, 3: 34, 4: 45, 8: 50}.items():  # the CPU's cliff at 4 rows
        costs.record(1, w, ms / 1000)
    costs.record_draft(1, 7, 0.009)
    means = [0.6, 0.35, 0.2, 0.1, 0.05, 0.02, 0.01]  # P(drafts 1..k+1 all accepted)
    rate = {d: (1 + sum(means[:d])) / (0.009 + costs.estimate(1, d + 1)) for d in range(1, 8)}
    assert best_depth(means, costs, 1) == max(rate, key=rate.get) == 2  # only the verify cliff counts so far
    costs.record_draft(1, 2, 0.006)  # a shallow pass measured cheaper: depth 2 gains more
    assert best_depth(means, costs, 1) == 2 and costs.draft_estimate(1, 1) == 0.006
    assert costs.draft_estimate(1, 5) == 0.009 and costs.draft_estimate(2, 5) is None
    assert best_depth([0.95] * 7, costs, 1) == 7  # a confident drafter: the whole block pays
    flat = StepCosts()
    for w in range(1, 9):
        flat.record(1, w, 0.03)
    flat.record_draft(1, 7, 0.0)
    assert best_depth([0.5, 0.0, 0.0], flat, 1) == 1  # positions that never pay are not drafted


def test_the_draft_gate_backs_off_while_drafts_do_not_pay():
    costs = StepCosts()
    assert costs.draft_pays(1, 3.0, 4, 7) is None  # nothing measured yet: no opinion
    costs.record(1, 1, 0.030)
    costs.record(1, 4, 0.040)
    costs.record_draft(1, 7, 0.010)
    assert costs.draft_pays(1, 1.6, 4, 7) is False  # 1.6 / 50 ms < 1 / 30 ms
    assert costs.draft_pays(1, 1.7, 4, 7) is True  # 1.7 / 50 ms > 1 / 30 ms
    assert costs.draft_pays(1, 1.3, 1, 7) is False  # nothing verified: the pass alone was paid for
    assert costs.draft_pays(1, 1.7, 4, 3) is True  # an unmeasured shallower pass: the deeper one's cost
    assert costs.draft_pays(2, 3.0, 4, 7) is None  # another batch size: not measured
    gate = DraftGate(max_skip=8)
    pattern = []
    for pays in [None, False, False, False, False, False, True, False]:
        gate.update(pays)
        skipped = 0
        while gate.skip():
            skipped += 1
        pattern.append(skipped)
    assert pattern == [0, 1, 2, 4, 8, 8, 0, 1] and gate.skipped == 24


def test_tree_methods_parse_and_refuse_what_they_cannot_do(smol):
    spec, block = methods.parse("dflash-tree@32")
    assert spec.name == "dflash-tree" and block == 33
    assert methods.parse("dflash-cut")[1] is None and methods.parse("dflash@8")[1] == 8
    with pytest.raises(BlockdraftError):
        methods.parse("dflash-tree@0")

    from blockdraft.draft import DFlashDrafter, DraftConfig

    drafter = DFlashDrafter(DraftConfig.for_target(smol.config, num_layers=1, block_size=4, mask_token_id=0))
    with pytest.raises(BlockdraftError, match="at least 2 candidates"):
        DFlashTreeProposer(drafter, smol, top_k=1)
    # (trees under exact attention, bf16, fp16 and q4_1 targets: tests/test_exact.py)


class RiggedTree(DFlashTreeProposer):
    """Runs the real drafter (the context-feature path is exercised), then replaces its candidates:
    the true continuation at rank `rank` of k (None: absent), with probabilities `probs`."""

    def __init__(self, drafter, target, truths, prompt_lens, rank, probs=(0.9, 0.06, 0.04)):
        super().__init__(drafter, target, top_k=len(probs))
        self.truths, self.prompt_lens, self.rank, self.probs = truths, prompt_lens, rank, probs

    def propose(self, last_tokens, positions, depth, rows=slice(None), probs=True):
        self.block_hidden(last_tokens, positions, depth, rows)
        b, k = last_tokens.shape[0], len(self.probs)
        cands = torch.zeros(b, depth, k, dtype=torch.long)
        for row in range(b):
            for d in range(depth):
                i = int(positions[row]) + 1 + d - self.prompt_lens[row]
                truth = self.truths[row][i] if i < len(self.truths[row]) else 0
                wrong = [(truth + 1 + j) % VOCAB for j in range(k)]
                if self.rank is not None:
                    wrong.insert(self.rank, truth)
                cands[row, d] = torch.tensor(wrong[:k])
        return Draft(cands, torch.tensor(self.probs).expand(b, depth, k))


def run(target, proposer, prompts, block, max_new=N_NEW, stop=(2,), adaptive=False, steps=None):
    states = []
    reqs = [Request(p, max_new_tokens=max_new, stop_token_ids=stop) for p in prompts]
    for step in generate_steps(target, proposer, reqs, block, states, adaptive=adaptive):
        if steps is not None:
            steps.append(step)
    return states


@pytest.fixture(scope="module")
def greedy4(smol, chat_ids):
    """Four prompts of very different lengths and our own greedy answers to them."""
    prompts = [chat_ids[i] for i in GREEDY4]
    return prompts, [s.output_ids for s in run(smol, Proposer(), prompts, 1)]


GREEDY4 = (4, 9, 0, 5)


@pytest.mark.parametrize(
    "rank,probs,nodes",
    [
        (0, (0.9, 0.06, 0.04), 16),  # perfect: the whole depth is accepted each step
        (None, (0.9, 0.06, 0.04), 16),  # always wrong
        (1, (0.6, 0.3, 0.1), 24),  # the right token always second
        (2, (1 / 3, 1 / 3, 1 / 3), 12),  # ties inside the top-k, the right one third
    ],
    ids=["perfect", "wrong", "second", "ties"],
)
def test_tree_greedy_equals_our_and_hf_greedy(smol, hf_smol, hf_greedy, random_drafter, greedy4, rank, probs, nodes):
    prompts, truths = greedy4
    proposer = RiggedTree(random_drafter, smol, truths, [len(p) for p in prompts], rank, probs)
    states = run(smol, proposer, prompts, nodes + 1)
    for k, (p, out, truth, ref) in enumerate(
        zip(prompts, states, truths, [hf_greedy[i] for i in GREEDY4], strict=False)
    ):
        assert out.output_ids == truth, f"row {k}"
        assert_same_or_tie(hf_smol, p, out.output_ids, ref, f"tree {rank} row {k}")
        steps = out.acceptance_lengths[:-1]  # the last step is cut by the answer's end
        if rank is None:
            assert set(out.acceptance_lengths) == {1}
        elif rank == 0:
            assert all(a == min(nodes, 15) + 1 for a in steps), steps
        elif rank == 2:  # 12 nodes of equal-probability ties: the first two levels, all of them
            assert all(a == 3 for a in steps), steps
        else:  # second-best twice (0.3 * 0.3) is among the 24 most probable paths
            assert all(a >= 3 for a in steps), steps


def test_real_drafter_tree_is_exact_and_the_drafter_sees_the_accepted_path(smol, hf_smol, random_drafter, greedy4):
    prompts, truths = greedy4
    proposer = DFlashTreeProposer(random_drafter, smol, top_k=4)
    states = run(smol, proposer, prompts, 33)
    for k, (p, out, truth) in enumerate(zip(prompts, states, truths, strict=False)):
        assert_same_or_tie(hf_smol, p, out.output_ids, truth, f"random tree row {k}")
    # accepted paths that leave the first branch (the right token always second)
    proposer = RiggedTree(random_drafter, smol, truths, [len(p) for p in prompts], 1, (0.6, 0.3, 0.1))
    states = run(smol, proposer, prompts, 25)
    assert [s.output_ids for s in states] == truths
    # the drafter's context cache holds the features of exactly the committed tokens: recompute
    # them from one uncached forward over prompt + answer and compare (after writing the last
    # step's features, which the next proposal would have written)
    with torch.inference_mode():
        proposer.propose(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), 0)
    for row, (p, out) in enumerate(zip(prompts, states, strict=False)):
        seq = torch.tensor([p + out.output_ids[:-1]])  # the last emitted token is never verified
        with torch.inference_mode():
            _, feats = smol(seq, torch.arange(seq.shape[1])[None], capture=proposer.capture_layers)
            fresh = random_drafter.new_cache(1, seq.shape[1] + 1)
            random_drafter.write_context(fresh, feats, torch.arange(seq.shape[1])[None])
        n = seq.shape[1]
        for name in ("k", "v"):
            got = getattr(proposer.cache, name)[:, row : row + 1, ..., :n, :]
            want = getattr(fresh, name)[..., :n, :]
            assert torch.allclose(got, want, atol=2e-4), (row, name, float((got - want).abs().max()))


def test_stop_token_inside_an_accepted_tree_path(smol, random_drafter, greedy4):
    prompts, truths = greedy4
    p, truth = prompts[2], truths[2]
    stop = truth[7]
    proposer = RiggedTree(random_drafter, smol, [truth], [len(p)], 0)
    out = run(smol, proposer, [p], 17, stop=(stop,))[0]
    assert out.output_ids == truth[: truth.index(stop) + 1] and out.finish_reason == "stop"


def test_after_compaction_no_stale_slot_is_attended(smol, random_drafter, greedy4, monkeypatch):
    """Every cache slot past a row's committed length is filled with huge values after each
    step: the tree nodes that were not accepted and everything beyond. Attending to any of them
    would change the answer."""
    prompts, truths = greedy4
    commit = DecodeState.commit

    def poisoned_commit(self, rows, accepted, bonus, active):
        commit(self, rows, accepted, bonus, active)
        committed = self.committed[rows]
        slots = torch.arange(self.cache.slots)
        stale = (slots[None, :] >= committed[:, None])[None, :, None, :, None]  # [1, B, 1, S, 1]
        for buf in (self.cache.k, self.cache.v):
            view = buf[:, rows]
            view.copy_(torch.where(stale, torch.full_like(view, 1e4), view))

    monkeypatch.setattr(DecodeState, "commit", poisoned_commit)
    proposer = RiggedTree(random_drafter, smol, truths, [len(p) for p in prompts], 1, (0.6, 0.3, 0.1))
    states = run(smol, proposer, prompts, 25)
    assert [s.output_ids for s in states] == truths
    assert max(max(s.acceptance_lengths) for s in states) >= 3  # paths off the first branch were moved


def test_confidence_cut_chain_is_exact(smol, hf_smol, random_drafter, greedy4, monkeypatch):
    from blockdraft.costs import StepCosts

    prompts, truths = greedy4
    record_draft = StepCosts.record_draft
    # rigged costs, not the machine's: a drafter pass is measured at 10 s, so drafts never pay for it
    monkeypatch.setattr(StepCosts, "record_draft", lambda self, b, d, s: record_draft(self, b, d, 10.0))
    steps = []
    states = run(smol, DFlashProposer(random_drafter, smol), prompts, 16, adaptive=True, steps=steps)
    for k, (p, out, truth) in enumerate(zip(prompts, states, truths, strict=False)):
        assert_same_or_tie(hf_smol, p, out.output_ids, truth, f"cut row {k}")
    # a random drafter's confidence is low: the cut verifies short chains (the whole chain on probes
    # only), and (rigged) its drafts do not pay for the drafter pass, so the gate skips the pass on many steps
    passes = [s.drafted for s in steps]
    verified = [n for s in states for _, n in s.accepted_per_step]
    assert 0 < sum(n == 15 for n in verified) < sum(n < 15 for n in verified)
    assert passes.count(0) > 0
    assert sum(n == 0 for s in states for _, n in s.accepted_per_step) >= passes.count(0)
    # the pass drafts the whole block on probes only, shallower (as deep as pays) in between
    depths = set(passes) - {0}
    assert 15 in depths and min(depths) < 15


def tree_counts(target, proposer, params, nodes, n=3000, batch=500):
    counts = {}
    for start in range(0, n, batch):
        reqs = [
            Request(
                PROMPT,
                max_new_tokens=L,
                sampling=SamplingParams(params.temperature, params.top_p, params.top_k, seed=start + i),
            )
            for i in range(batch)
        ]
        states = []
        for _ in generate_steps(target, proposer, reqs, nodes + 1, states):
            pass
        for s in states:
            counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
    return counts


@pytest.mark.parametrize("params", CASES[:2], ids=["T1", "T0.7-topk3"])
def test_tree_samples_follow_the_target_distribution(tiny, params):  # noqa: F811
    hf, target, drafter = tiny
    dist = exact_distribution(hf, params)
    proposer = DFlashTreeProposer(drafter, target, top_k=3)
    stat, critical = chi_square(dist, tree_counts(target, proposer, params, 6))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target's distribution"


def test_the_test_rejects_descending_into_the_most_probable_child(tiny, monkeypatch):  # noqa: F811
    """A wrong rule: when the target's sample is among a node's children, descend into the
    child the drafter found most probable (and emit its token) instead of the sampled one."""
    hf, target, drafter = tiny
    params = CASES[0]
    dist = exact_distribution(hf, params)
    right = DraftTree.accept

    def most_probable_child(self, target_tokens):
        t = self.tokens.clone()
        b, n = t.shape
        rigged = target_tokens.clone()
        for row in range(b):
            for i in range(n):
                kids = [j for j in range(n) if int(self.parents[row, j]) == i]
                if kids and int(target_tokens[row, i]) in [int(t[row, j]) for j in kids]:
                    rigged[row, i] = t[row, max(kids, key=lambda j: float(self.probs[row, j]))]
        return right(self, rigged)

    monkeypatch.setattr(DraftTree, "accept", most_probable_child)
    stat, critical = chi_square(dist, tree_counts(target, DFlashTreeProposer(drafter, target, top_k=3), params, 6))
    assert stat > critical, "the chi-square test fails to catch descending into the most probable child"


def test_a_seed_gives_the_same_tokens_with_trees_cuts_and_without(tiny):  # noqa: F811
    _, target, drafter = tiny
    for params in CASES:
        reqs = [
            Request(
                PROMPT,
                max_new_tokens=12,
                sampling=SamplingParams(params.temperature, params.top_p, params.top_k, seed=s),
            )
            for s in range(40)
        ]
        outs = {}
        for name, proposer, block in [
            ("ar", Proposer(), 1),
            ("tree", DFlashTreeProposer(drafter, target, top_k=3), 9),
            ("cut", DFlashProposer(drafter, target), 4),
        ]:
            states = []
            for _ in generate_steps(target, proposer, reqs, block, states, adaptive=name == "cut"):
                pass
            outs[name] = [s.output_ids for s in states]
        assert outs["ar"] == outs["tree"] == outs["cut"]


def test_children_that_depend_on_the_parent_token_grow_the_tree_best_first():
    """A Markov head's tree: the candidates below a node come from `children(row, d, token)`,
    so two nodes at the same position have different children, and the order stays best first
    by path probability (11 -> 30 at 0.35 * 0.9 comes before 10 -> 20 at 0.6 * 0.5)."""
    asked = []

    def children(row, d, token):
        asked.append((row, d, token))
        return {10: ([20, 21], [0.5, 0.4]), 11: ([30, 31], [0.9, 0.1]), 12: ([40, 41], [0.7, 0.3])}[token]

    tokens = torch.tensor([[[10, 11, 12], [0, 0, 0]]])  # position 2's row is not read: children give it
    probs = torch.tensor([[[0.6, 0.35, 0.05], [0.0, 0.0, 0.0]]])
    tree = build_tree(torch.tensor([7]), tokens, probs, 4, children=children)
    assert tree.tokens.tolist() == [[7, 10, 11, 30, 20]]
    assert tree.parents.tolist() == [[-1, 0, 0, 2, 1]] and tree.depths.tolist() == [[0, 1, 1, 2, 2]]
    assert tree.scores[0].tolist() == pytest.approx([1.0, 0.6, 0.35, 0.35 * 0.9, 0.6 * 0.5])
    assert tree.probs[0].tolist() == pytest.approx([1.0, 0.6, 0.35, 0.9, 0.5])
    assert sorted(asked) == [(0, 1, 10), (0, 1, 11)]  # only nodes in the tree are expanded
    # a calibration factor for position 2 scales its estimates (the order), not its probabilities:
    # at 0.1, 12 (0.05) comes before 11 -> 30 (0.35 * 0.09)
    calibration = tree_mod.Calibration(2)
    calibration.predicted[1] = 9.0  # factors (0 + 1) / (0 + 1) and (0 + 1) / (9 + 1)
    assert calibration.factors().tolist() == pytest.approx([1.0, 0.1])
    tree = build_tree(torch.tensor([7]), tokens, probs, 4, calibration, children=children)
    assert tree.tokens.tolist() == [[7, 10, 11, 12, 30]]
    assert tree.scores[0].tolist() == pytest.approx([1.0, 0.6, 0.35, 0.05, 0.35 * 0.09])
    assert tree.probs[0].tolist() == pytest.approx([1.0, 0.6, 0.35, 0.05, 0.9])


def test_a_markov_head_tree_gives_the_targets_tokens_with_any_seed(tiny):  # noqa: F811
    """dflash-tree with a Markov-head drafter (each node's children corrected by its own token):
    the same tokens as plain decoding, greedy and seeded at T > 0."""
    _, target, plain = tiny
    torch.manual_seed(11)
    cfg = plain.config.__class__.from_dict({**plain.config.to_dict(), "markov_rank": 8})
    drafter = type(plain)(cfg).eval()
    drafter.reset_parameters()
    with torch.no_grad():  # a strong head, so that the children depend on their parent's token
        drafter.markov_head.markov_w1.weight.mul_(30)
        drafter.markov_head.markov_w2.weight.mul_(30)
    for params in CASES:
        reqs = [
            Request(
                PROMPT,
                max_new_tokens=12,
                sampling=SamplingParams(params.temperature, params.top_p, params.top_k, seed=s),
            )
            for s in range(24)
        ]
        outs = {}
        for name, proposer, block in [("ar", Proposer(), 1), ("tree", DFlashTreeProposer(drafter, target, top_k=3), 9)]:
            states = []
            for _ in generate_steps(target, proposer, reqs, block, states):
                pass
            outs[name] = [s.output_ids for s in states]
        assert outs["ar"] == outs["tree"]
