"""Sampling is exact: speculative decoding samples from the target's own distribution."""

import itertools
import math

import pytest
import torch

import blockdraft.decode as decode_mod
from blockdraft.batcher import generate_steps
from blockdraft.bench.stats import chi2_goodness_of_fit
from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.models import load_target
from blockdraft.proposers import DFlashProposer, Proposer
from blockdraft.sampling import SamplingParams, kept_tokens, position_uniforms, sample_tokens, target_probs
from blockdraft.sequences import Request

from .conftest import save_tiny_hf

V, L = 6, 3  # vocabulary and continuation length: 216 outcomes, enumerated exactly
PROMPT = [1, 4, 2, 0]
N_SAMPLES = 3000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = save_tiny_hf(
        "llama",
        path,
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.no_grad():  # sharpen the distributions so they are far from uniform
        hf.lm_head.weight.mul_(25)
    hf.save_pretrained(str(path))
    target = load_target(path)
    torch.manual_seed(5)
    cfg = DraftConfig.for_target(target.config, num_layers=1, block_size=4, mask_token_id=5)
    return hf, target, DFlashDrafter(cfg).eval()


def exact_distribution(hf, params: SamplingParams) -> dict[tuple, float]:
    one = lambda x: torch.tensor([x])  # noqa: E731
    dist = {}
    for seq in itertools.product(range(V), repeat=L):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1 :]
        probs = target_probs(
            logits, one(params.temperature).expand(L), one(params.top_p).expand(L), one(params.top_k).expand(L)
        )
        dist[seq] = math.prod(float(probs[i, t]) for i, t in enumerate(seq))
    return dist


def sample_counts(target, proposer, params: SamplingParams, n=N_SAMPLES, batch=500, grammar=None) -> dict[tuple, int]:
    """How often each continuation comes out of n seeded runs (`grammar`: each request's, if any)."""
    counts: dict[tuple, int] = {}
    for start in range(0, n, batch):
        reqs = [
            Request(
                PROMPT,
                max_new_tokens=L,
                grammar=grammar,
                sampling=SamplingParams(params.temperature, params.top_p, params.top_k, seed=start + i),
            )
            for i in range(batch)
        ]
        states = []
        for _ in generate_steps(target, proposer, reqs, 4, states):
            pass
        for s in states:
            counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
    return counts


def chi_square(dist, counts, n=N_SAMPLES):
    """Pearson statistic with cells of expected count < 5 pooled, and its 0.1% critical value."""
    return chi2_goodness_of_fit(dist, counts, n)


CASES = [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.8)]


@pytest.mark.parametrize("params", CASES, ids=["T1", "T0.7-topk3", "T1.3-topp0.8"])
def test_dflash_samples_follow_the_target_distribution(tiny, params):
    hf, target, drafter = tiny
    dist = exact_distribution(hf, params)
    assert max(dist.values()) < 0.6  # the test needs a distribution with real spread
    proposer = DFlashProposer(drafter, target)
    stat, critical = chi_square(dist, sample_counts(target, proposer, params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target's distribution"


def test_a_markov_head_drafter_samples_follow_the_target_distribution(tiny):
    """Drafts of a Markov-head chain (each on the token drafted before it): exact all the same."""
    hf, target, _ = tiny
    torch.manual_seed(6)
    cfg = DraftConfig.for_target(target.config, num_layers=1, block_size=4, mask_token_id=5, markov_rank=4)
    drafter = DFlashDrafter(cfg).eval()
    drafter.reset_parameters(1.0)  # a head strong enough to decide drafts
    params = SamplingParams(1.0)
    dist = exact_distribution(hf, params)
    stat, critical = chi_square(dist, sample_counts(target, DFlashProposer(drafter, target), params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target's distribution"


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="no int8 CPU kernel")
def test_an_int8_drafter_samples_follow_the_target_distribution(tiny):
    """Draft probabilities from int8 weights are other probabilities, used consistently: the
    samples still follow the target's distribution."""
    import copy

    from blockdraft.draft_head import quantize_drafter

    hf, target, drafter = tiny
    params = SamplingParams(1.0)
    q8 = copy.deepcopy(drafter)
    assert quantize_drafter(q8) > 0
    dist = exact_distribution(hf, params)
    stat, critical = chi_square(dist, sample_counts(target, DFlashProposer(q8, target), params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target's distribution"


def test_the_test_rejects_common_wrong_acceptance_rules(tiny, monkeypatch):
    hf, target, drafter = tiny
    params = CASES[0]
    dist = exact_distribution(hf, params)
    right = decode_mod.acceptance
    wrong_rules = {
        "accept every draft": lambda d, t: torch.full((d.shape[0],), d.shape[1], dtype=torch.long),
        "accept one unverified draft": lambda d, t: (right(d, t) + 1).clamp(max=d.shape[1]),
    }
    for name, rule in wrong_rules.items():
        monkeypatch.setattr(decode_mod, "acceptance", rule)
        stat, critical = chi_square(dist, sample_counts(target, DFlashProposer(drafter, target), params))
        assert stat > critical, f"the chi-square test fails to catch the wrong rule '{name}'"


def test_a_seed_gives_the_same_tokens_with_and_without_speculation(tiny):
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
        for name, proposer in [("ar", Proposer()), ("dflash", DFlashProposer(drafter, target))]:
            states = []
            for _ in generate_steps(target, proposer, reqs, 4, states):
                pass
            outs[name] = [s.output_ids for s in states]
        assert outs["ar"] == outs["dflash"]
        assert len({tuple(o) for o in outs["ar"]}) > 10  # different seeds really differ


def test_target_probs_match_hf_logits_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.5, 7, 1.0), (1.5, 0, 0.6), (0.8, 10, 0.9)]:
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        ours = target_probs(logits, torch.full((4,), t), torch.full((4,), p), torch.full((4,), k))
        torch.testing.assert_close(ours.float(), torch.softmax(ref, -1), atol=1e-6, rtol=1e-5)


def full_sort_probs(logits, t, p, k):
    """Oracle: temperature, top-k by threshold, top-p over the fully sorted vocabulary."""
    x = logits.double() / t
    if k:
        x = x.masked_fill(x < x.topk(k, dim=-1).values[:, -1:], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= p
    drop[:, 0] = False
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("candidates", [4, 64, 256])
def test_top_p_ranks_few_tokens_and_keeps_the_full_sort_nucleus(candidates):
    torch.manual_seed(1)
    vocab = 3000
    # rows from peaked to nearly flat, so some nuclei need far more than `candidates` tokens
    logits = torch.randn(8, vocab) * torch.tensor([8.0, 4, 2, 1, 0.5, 0.2, 0.05, 3])[:, None]
    for t, p, k in [(1.0, 0.9, 0), (0.8, 0.95, 0), (1.3, 0.5, 0), (1.0, 0.99, 40), (0.7, 1.0, 7), (1.0, 0.3, 2000)]:
        row = lambda x: torch.full((8,), x, dtype=torch.float64)  # noqa: E731
        ids, probs = kept_tokens(logits, row(t), row(p), torch.full((8,), k), candidates=candidates)
        for r in range(8):  # the kept tokens ascend by id; padding (at the end) has probability 0
            kept = ids[r][probs[r] > 0]
            assert bool((kept.diff() > 0).all())
        dense = torch.zeros(8, vocab, dtype=torch.float64).scatter_add_(-1, ids, probs)
        ref = full_sort_probs(logits, t, p, k)
        assert torch.equal(dense > 0, ref > 0), (t, p, k)  # the very same kept set
        torch.testing.assert_close(dense, ref, rtol=1e-5, atol=1e-9)
        if k == 0 and p >= 0.9:  # the near-flat row's nucleus lies far beyond the first ranking
            assert int((ref[6] > 0).sum()) > 4 * candidates


def test_sample_tokens_draw_by_inverse_cdf_in_token_order():
    torch.manual_seed(2)
    vocab, b, t = 500, 3, 5
    logits = torch.randn(b, t, vocab) * 2
    positions = torch.arange(t).repeat(b, 1) + 10
    params = [SamplingParams(0.9, top_p=0.8, seed=1), SamplingParams(1.2, seed=2), SamplingParams(0.6, top_k=5, seed=3)]
    got = sample_tokens(logits, positions, params)
    for r, sp in enumerate(params):
        ref = full_sort_probs(logits[r], sp.temperature, sp.top_p, sp.top_k)
        cdf = ref.cumsum(-1)
        u = position_uniforms([sp.seed], positions[r : r + 1])[0]
        want = [int(torch.searchsorted(cdf[i], u[i] * cdf[i, -1], right=True)) for i in range(t)]
        assert got[r].tolist() == want
        assert all(ref[i, tok] > 0 for i, tok in enumerate(want))


def test_sampled_smollm2_is_reproducible_and_identical_across_methods(smol, chat_ids, random_drafter):
    reqs = [
        Request(
            chat_ids[i], max_new_tokens=16, sampling=SamplingParams(1.0, top_p=0.95, seed=7 + i), stop_token_ids=(2,)
        )
        for i in (0, 2)
    ]
    runs = []
    for proposer in (Proposer(), DFlashProposer(random_drafter, smol), DFlashProposer(random_drafter, smol)):
        states = []
        for _ in generate_steps(smol, proposer, reqs, 16 if proposer.max_block_size else 1, states):
            pass
        runs.append([s.output_ids for s in states])
    assert runs[0] == runs[1] == runs[2]


def test_a_temperature_that_would_overflow_the_scores_samples_as_greedy_and_top_k_is_bounded():
    from blockdraft.errors import BlockdraftError
    from blockdraft.sampling import MAX_TOP_K, MIN_TEMPERATURE, SamplingParams

    logits = torch.tensor([[30.0, 29.0, -5.0]])
    assert not torch.isfinite(logits / 1e-38).all()  # why the floor: scores leave float32
    for t in (1e-38, 1e-300, MIN_TEMPERATURE / 2):
        assert SamplingParams(t, seed=1).greedy
    assert not SamplingParams(MIN_TEMPERATURE, seed=1).greedy
    SamplingParams(1.0, top_k=MAX_TOP_K, seed=1)
    with pytest.raises(BlockdraftError, match="top_k"):
        SamplingParams(1.0, top_k=2**64, seed=1)
