"""Greedy speculative decoding emits exactly the target's own greedy output.

The oracle is HF transformers' `generate` on the same weights. The only excuse
for a divergence is a genuine fp32 tie: at the first differing position, the
gap between the target's top-2 logits must be below 1e-4 (checked with HF).
"""

import pytest
import torch

from blockdraft.batcher import Batcher, generate_steps
from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.errors import BlockdraftError
from blockdraft.proposers import DFlashProposer, DFlashTreeProposer, Draft, Proposer
from blockdraft.sequences import Request

from .conftest import computed_once

N_NEW = 24
TIE_GAP = 1e-4


@pytest.fixture(scope="session")
def hf_greedy(hf_smol, chat_ids, tmp_path_factory):
    """HF's own greedy continuation of each prompt (stopping at <|im_end|> like ours)."""

    def generate():
        refs = []
        for ids in chat_ids:
            with torch.no_grad():
                out = hf_smol.generate(
                    torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=2, pad_token_id=2
                )
            refs.append(out[0, len(ids) :].tolist())
        return refs

    return computed_once(tmp_path_factory, "hf_greedy", generate)


class RiggedProposer(DFlashProposer):
    """Runs the real drafter (so the context-feature path is exercised), then replaces its
    tokens: the true continuation for the first `right` drafts of every block (None: all of
    them, a perfect drafter; 0: always wrong), a wrong token after."""

    def __init__(self, drafter, target, truths, prompt_lens, right=None, vocab=49152):
        super().__init__(drafter, target)
        self.truths, self.prompt_lens, self.right, self.vocab = truths, prompt_lens, right, vocab

    def propose(self, last_tokens, positions, n, rows=slice(None), probs=False):
        drafts = super().propose(last_tokens, positions, n, rows).tokens
        for b in range(drafts.shape[0]):
            for k in range(n):
                i = int(positions[b]) + 1 + k - self.prompt_lens[b]
                truth = self.truths[b][i] if i < len(self.truths[b]) else 0
                drafts[b, k] = truth if self.right is None or k < self.right else (truth + 1) % self.vocab
        return Draft(drafts)


def run(target, proposer, prompts, block_size, max_new=N_NEW):
    states = []
    reqs = [Request(p, max_new_tokens=max_new, stop_token_ids=(2,)) for p in prompts]
    for _ in generate_steps(target, proposer, reqs, block_size, states):
        pass
    return states


def assert_same_or_tie(hf_model, prompt, ours, ref, label):
    """Token-for-token equality, or a divergence at a genuine fp32 tie (reported)."""
    if ours == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < TIE_GAP, (
        f"{label}: diverges from HF greedy at token {i} (ours {ours[i : i + 3]}, "
        f"HF {ref[i : i + 3]}), top-2 logit gap {gap:.2e} is no tie"
    )
    print(f"{label}: fp32 tie at token {i} (gap {gap:.1e}) excused")


@pytest.fixture(scope="session")
def ours_greedy(smol, chat_ids):
    """Our own greedy continuations (the prepacked target): the truth the rigged drafters copy."""
    return [s.output_ids for s in run(smol, Proposer(), chat_ids, 1)]


@pytest.mark.parametrize("packed", [True, False], ids=["prepacked", "plain"])
def test_ar_equals_hf_greedy(packed, smol, smol_dir, hf_smol, chat_ids, hf_greedy):
    from blockdraft.models import load_target

    target = smol if packed else load_target(smol_dir)  # the plain path: every product through F.linear
    for k, (ids, ref) in enumerate(zip(chat_ids, hf_greedy, strict=False)):
        out = run(target, Proposer(), [ids], 1)[0]
        assert_same_or_tie(hf_smol, ids, out.output_ids, ref, f"ar prompt {k}")
        assert all(a == 1 for a in out.acceptance_lengths)


@pytest.mark.slow
def test_dflash_random_drafter_equals_hf_greedy(smol, hf_smol, chat_ids, hf_greedy, random_drafter):
    for k, (ids, ref) in enumerate(zip(chat_ids, hf_greedy, strict=False)):
        out = run(smol, DFlashProposer(random_drafter, smol), [ids], 16)[0]
        assert_same_or_tie(hf_smol, ids, out.output_ids, ref, f"dflash prompt {k}")
        a = out.acceptance_lengths  # one token from the prefill, then a[i] per step (the last may be cut)
        assert 1 + sum(a[:-1]) < len(out.output_ids) <= 1 + sum(a)


def test_perfect_drafter_accepts_whole_blocks_and_stays_exact(
    smol, hf_smol, chat_ids, hf_greedy, ours_greedy, random_drafter
):
    lens = [len(p) for p in chat_ids]
    proposer = RiggedProposer(random_drafter, smol, ours_greedy, lens)
    states = run(smol, proposer, chat_ids, 16)  # all ten prompts in one batch
    for k, (ids, out, ours, ref) in enumerate(zip(chat_ids, states, ours_greedy, hf_greedy, strict=False)):
        assert out.output_ids == ours, f"perfect prompt {k}: differs from our own greedy output"
        assert_same_or_tie(hf_smol, ids, out.output_ids, ref, f"perfect prompt {k}")
        # the prefill gives the first token, then every step accepts its whole block of 16
        # (the last step only what was left: an end-of-sequence token or the length limit)
        assert all(a == 16 for a in out.acceptance_lengths[:-1]), out.acceptance_lengths
        assert len(out.acceptance_lengths) == -(-(len(ours) - 1) // 16)


def test_always_wrong_drafter_accepts_nothing_and_stays_exact(
    smol, hf_smol, chat_ids, hf_greedy, ours_greedy, random_drafter
):
    lens = [len(p) for p in chat_ids]
    proposer = RiggedProposer(random_drafter, smol, ours_greedy, lens, right=0)
    states = run(smol, proposer, chat_ids, 8)  # and a run-time block size below the trained 16
    for k, (ids, out, ours, ref) in enumerate(zip(chat_ids, states, ours_greedy, hf_greedy, strict=False)):
        assert out.output_ids == ours, f"wrong prompt {k}: differs from our own greedy output"
        assert_same_or_tie(hf_smol, ids, out.output_ids, ref, f"wrong prompt {k}")
        assert set(out.acceptance_lengths) == {1}


@pytest.mark.slow
def test_batch_of_four_equals_each_prompt_alone(smol, chat_ids, random_drafter, hf_smol):
    prompts = [chat_ids[i] for i in (4, 9, 0, 5)]  # very different lengths
    assert len({len(p) for p in prompts}) == 4
    alone = [run(smol, DFlashProposer(random_drafter, smol), [p], 16)[0].output_ids for p in prompts]
    together = run(smol, DFlashProposer(random_drafter, smol), prompts, 16)
    for k, (p, a, t) in enumerate(zip(prompts, alone, together, strict=False)):
        assert_same_or_tie(hf_smol, p, t.output_ids, a, f"batch row {k}")


def test_output_tokens_equal_to_the_mask_id_are_kept(smol, hf_smol, chat_ids, hf_greedy, random_drafter):
    # Make the mask token a token the target really emits in its answer.
    k = 0
    mask_id = hf_greedy[k][3]
    cfg = DraftConfig(**{**random_drafter.config.__dict__, "mask_token_id": mask_id})
    drafter = DFlashDrafter(cfg).eval()
    drafter.load_state_dict(random_drafter.state_dict())
    out = run(smol, DFlashProposer(drafter, smol), [chat_ids[k]], 16)[0]
    assert mask_id in out.output_ids
    assert_same_or_tie(hf_smol, chat_ids[k], out.output_ids, hf_greedy[k], "mask-id token")


def test_max_new_tokens_and_stop_tokens_are_honoured(smol, chat_ids, hf_greedy, random_drafter):
    lens = [len(chat_ids[0])]
    perfect = RiggedProposer(random_drafter, smol, [hf_greedy[0]], lens)
    out = run(smol, perfect, [chat_ids[0]], 16, max_new=5)[0]
    assert out.output_ids == hf_greedy[0][:5] and out.finish_reason == "length"
    # stop at the first occurrence of a token in the middle of a fully accepted block
    stop = hf_greedy[0][7]
    states = []
    req = Request(chat_ids[0], max_new_tokens=N_NEW, stop_token_ids=(stop,))
    perfect = RiggedProposer(random_drafter, smol, [hf_greedy[0]], lens)
    list(generate_steps(smol, perfect, [req], 16, states))
    assert states[0].output_ids == hf_greedy[0][: hf_greedy[0].index(stop) + 1]
    assert states[0].finish_reason == "stop"


def test_continuous_batching_refills_slots_and_equals_each_prompt_alone(smol, chat_ids, random_drafter, hf_smol):
    """Seven requests through three slots: finished sequences hand their slot to waiting ones."""
    reqs = [Request(chat_ids[i], max_new_tokens=4 + 3 * i, stop_token_ids=(2,)) for i in range(7)]
    for proposer, block in ((Proposer(), 1), (DFlashProposer(random_drafter, smol), 8)):
        states = []
        steps = list(generate_steps(smol, proposer, reqs, block, states, batch_size=3))
        assert max(step.batch for step in steps) == 3  # three slots, refilled
        emitted = {}
        for step in steps:
            for i, ids in step.new_ids.items():
                emitted.setdefault(i, []).extend(ids)
        for i, req in enumerate(reqs):
            alone = []
            list(generate_steps(smol, Proposer(), [req], 1, alone))
            assert emitted[i] == states[i].output_ids  # streamed tokens == final tokens
            assert_same_or_tie(
                hf_smol, req.prompt_ids, states[i].output_ids, alone[0].output_ids, f"{proposer.name} request {i}"
            )


def run_sorting(loop, reqs, must_sort=True):
    """Requests through a decode loop (continuous batching); asserts that the rows really were
    reordered (unless not `must_sort`) and returns the requests' states."""
    batcher = Batcher(loop)
    states = [batcher.submit(i, req) for i, req in enumerate(reqs)]
    sorted_once = False
    with torch.inference_mode():
        while batcher.busy:
            batcher.admit()
            before = list(loop.keys)
            batcher.decode()
            sorted_once |= loop.keys != before
    assert sorted_once or not must_sort
    return states


def test_rows_sorted_by_length_with_grouped_attention_change_no_output(smol, chat_ids, hf_smol):
    """Rows reordered every other step (caches and bookkeeping moved along) and attention split
    into groups of two rows, each reading only the slots its longest row needs: every request
    still gets its own greedy answer, for plain decoding and for prompt lookup."""
    from blockdraft.decode import DecodeLoop
    from blockdraft.proposers import LookupProposer

    reqs = [Request(chat_ids[i], max_new_tokens=3 + 4 * i, stop_token_ids=(2,)) for i in range(7)]
    for proposer, block in ((Proposer(), 1), (LookupProposer(), 4)):
        states = run_sorting(DecodeLoop(smol, proposer, block, 4, 200, sort_every=2, group_rows=2), reqs)
        for i, req in enumerate(reqs):
            alone = run(smol, Proposer(), [req.prompt_ids], 1, max_new=req.max_new_tokens)[0]
            assert_same_or_tie(
                hf_smol, req.prompt_ids, states[i].output_ids, alone.output_ids, f"{proposer.name} request {i}"
            )


def test_a_bounded_draft_window_stays_exact_and_changes_nothing_when_wider_than_the_context(
    smol, hf_smol, chat_ids, ours_greedy, tokenizer
):
    """The shipped drafter (real acceptance) with --draft-window: a window wider than every
    sequence accepts exactly what the unbounded drafter accepts; a narrow one (the ring wraps
    many times, slots reused by continuous batching) still emits the target's own tokens."""
    from blockdraft.engine import shipped_drafter

    drafter = DFlashDrafter.load(shipped_drafter("dflash"))
    prompts = [chat_ids[i] for i in (4, 9, 0, 5)]
    truths = [ours_greedy[i] for i in (4, 9, 0, 5)]
    assert DFlashProposer(drafter, smol).draft_window == 512  # default: the context it was trained on
    with pytest.raises(BlockdraftError, match="draft window"):
        DFlashProposer(drafter, smol, draft_window=-1)
    from blockdraft.engine import Engine
    from blockdraft.spec import SpecConfig

    engine = Engine(smol, tokenizer, drafter)  # the window travels in the SpecConfig, checked when it is made
    assert SpecConfig("dflash-cut", window=5).build(engine).proposer.draft_window == 5
    assert SpecConfig("dflash-tree").build(engine).proposer.draft_window == 512
    for bad in (-1, "all", 2.5, True):
        with pytest.raises(BlockdraftError, match="draft window"):
            SpecConfig("dflash", window=bad)
    block = drafter.config.block_size  # the block it was trained for
    unbounded = run(smol, DFlashProposer(drafter, smol, draft_window=0), prompts, block)
    wide = run(smol, DFlashProposer(drafter, smol, draft_window=4096), prompts, block)
    assert [s.acceptance_lengths for s in wide] == [s.acceptance_lengths for s in unbounded]
    states = []
    reqs = [Request(p, max_new_tokens=N_NEW, stop_token_ids=(2,)) for p in prompts]
    for _ in generate_steps(smol, DFlashProposer(drafter, smol, draft_window=5), reqs, block, states, batch_size=2):
        pass
    for out, truth in zip(states, truths, strict=False):
        assert out.output_ids == truth
    assert any(a > 1 for s in unbounded for a in s.acceptance_lengths)  # drafts were accepted


def test_a_shared_prompt_prefix_is_prefilled_once_and_changes_no_output(
    smol, hf_smol, chat_ids, hf_greedy, tokenizer, monkeypatch
):
    """`share_prefix` (the chat template's common start, prefilled once): prompts that start
    with it run only their own tokens through the target, yet plain decoding gives HF's greedy
    answers and the shipped drafter (fed the cached prefix's features) accepts what it does
    without the shared prefix."""
    from blockdraft.decode import DecodeLoop
    from blockdraft.engine import shipped_drafter
    from blockdraft.train.data import template_prefix_ids

    prefix = template_prefix_ids(tokenizer)
    assert len(prefix) > 10 and all(ids[: len(prefix)] == prefix for ids in chat_ids)
    starts = []
    forward = type(smol).forward

    def spy(self, tokens, positions, *args, **kwargs):
        starts.append(positions[:, 0].tolist())
        return forward(self, tokens, positions, *args, **kwargs)

    monkeypatch.setattr(type(smol), "forward", spy)
    idx = [0, 3, 5, 8]
    reqs = [Request(chat_ids[i], max_new_tokens=N_NEW, stop_token_ids=(2,)) for i in idx]
    drafter = DFlashDrafter.load(shipped_drafter("dflash"))
    accepted = {}
    for proposer, block in ((Proposer(), 1), (DFlashProposer(drafter, smol), drafter.config.block_size)):
        for shared in (True, False):
            loop = DecodeLoop(smol, proposer, block, 2, 200)
            assert loop.share_prefix(prefix if shared else []) == shared
            starts.clear()
            states = run_sorting(loop, reqs, must_sort=False)
            # the first two prompts were prefilled together from the end of the shared prefix
            # (from 0 without it); no forward ran the prefix again
            assert starts[0] == [len(prefix) if shared else 0] * 2
            assert not shared or all(min(s) > 0 for s in starts)
            for i, state in zip(idx, states, strict=False):
                assert_same_or_tie(hf_smol, chat_ids[i], state.output_ids, hf_greedy[i], f"{proposer.name} {i}")
            accepted[proposer.name, shared] = [s.acceptance_lengths for s in states]
    assert accepted["dflash", True] == accepted["dflash", False]
    # the drafter is fed the same context features for the prefix either way
    from blockdraft.sequences import SequenceState

    proposer, snaps, seen = DFlashProposer(drafter, smol), [], []
    observe = proposer.observe
    proposer.observe = lambda tokens, features, *a, **k: (seen.append(features), observe(tokens, features, *a, **k))
    for shared in (True, False):
        loop = DecodeLoop(smol, proposer, drafter.config.block_size, 2, 200)
        loop.share_prefix(prefix if shared else [])
        seen.clear()
        with torch.inference_mode():
            loop.admit([(k, reqs[k], SequenceState()) for k in range(2)])
        (features,) = seen  # what the proposer is given at the prefill
        snaps.append(features[:, : len(prefix)].clone())
    scale = snaps[1].abs().amax(-1, keepdim=True)  # a token's features span 1e-1..1e4: compare per token
    assert scale.amin() > 0.1 and ((snaps[0] - snaps[1]).abs() / scale).amax() < 1e-5


def test_a_markov_head_drafts_a_chain_on_the_token_before_and_decoding_stays_exact(smol, chat_ids, ours_greedy):
    """A DFlash drafter with a (DSpark-style) Markov head: each draft position's logits are the
    backbone's plus W2 W1[the token drafted before it] (the last committed token before the
    first), greedy left to right; the decode loop's output stays the target's own greedy text."""
    from blockdraft.models.default import DEFAULT_MASK_TOKEN_ID

    torch.manual_seed(7)
    cfg = DraftConfig.for_target(
        smol.config, num_layers=1, block_size=8, mask_token_id=DEFAULT_MASK_TOKEN_ID, markov_rank=16
    )
    drafter = DFlashDrafter(cfg).eval()
    drafter.reset_parameters()
    with torch.no_grad():  # a strong head, so that the chain's tokens depend on it
        drafter.markov_head.markov_w1.weight.mul_(40)
        drafter.markov_head.markov_w2.weight.mul_(40)
    hidden = torch.randn(3, 7, smol.config.hidden_size)
    previous = torch.tensor([5, 900, 17])
    head = smol.lm_head.weight
    tokens = drafter.draft_tokens(hidden, head, previous)
    base = torch.nn.functional.linear(hidden, head)
    prev = previous
    for k in range(7):  # the chain by hand
        want = (base[:, k] + drafter.markov_head(prev)).argmax(-1)
        assert torch.equal(tokens[:, k], want)
        prev = want
    assert not torch.equal(tokens, base.argmax(-1))  # the head changed drafts
    (got, probs) = drafter.draft_candidates(hidden, head, 1, previous)
    assert torch.equal(got[..., 0], tokens) and bool((probs > 0).all() and (probs <= 1).all())
    with pytest.raises(BlockdraftError, match="markov_candidates"):
        drafter.draft_candidates(hidden, head, 2, previous)
    # a tree's candidates: position 1's given the token before the block (the chain's), and below
    # any node the next position's top k corrected by that node's own token
    cand, cand_p, children = drafter.markov_candidates(hidden, head, 4, previous)
    assert torch.equal(cand[..., 0], tokens) and torch.equal(cand_p[..., 0], probs[..., 0])
    other = int(cand[1, 0, 1])  # the runner-up at position 1 of row 1
    dist = torch.softmax(base[1, 1] + drafter.markov_head(torch.tensor([other]))[0], -1).topk(4)
    got_t, got_p = children(1, 1, other)
    assert got_t == dist.indices.tolist() and got_p == pytest.approx(dist.values.tolist(), rel=1e-5)
    assert got_t != cand[1, 1].tolist()  # not the chain's candidates: its parent differs
    states = run(smol, DFlashProposer(drafter, smol), chat_ids[:4], 8)
    for _ids, out, ours in zip(chat_ids, states, ours_greedy, strict=False):
        assert out.output_ids == ours
    states = run(smol, DFlashTreeProposer(drafter, smol, top_k=4), chat_ids[:4], 9)
    for _ids, out, ours in zip(chat_ids, states, ours_greedy, strict=False):
        assert out.output_ids == ours
