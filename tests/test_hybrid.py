"""Qwen3.5 targets (linear attention + gated full attention) compute what HF transformers
computes, and decode losslessly: plain, prompt-lookup and DFlash speculative decoding emit HF's
own greedy tokens, with the linear layers' states rolled back exactly after rejected drafts.

A tiny random Qwen3.5 (layers: linear, linear, full, linear) in fp32 is the target, initialised
with large weights so that its choices depend on the context (a linear layer's state that is a
token off changes them) and with a sharpened output head so that they are far from ties.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft.batcher import generate_steps
from blockdraft.decode import DecodeLoop
from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.errors import BlockdraftError
from blockdraft.models import exact, load_target, native, native_step, quant
from blockdraft.proposers import DFlashProposer, DFlashTreeProposer, LookupProposer, Proposer
from blockdraft.sequences import Request

from .test_decode import RiggedProposer, run_sorting
from .test_exact import prompts24, split_sum
from .test_exact import run as run_rows

VOCAB = 256
N_NEW = 20
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
PROMPT_LENS = (3, 70, 11, 24)  # 70: the prefill runs the chunked form over two chunks
# logits reach ~20 here: fp32 noise is ~2e-4 (HF's own cached decode and full forward differ by that)
TOL = dict(atol=1e-3, rtol=1e-4)


def text_config(**overrides):
    from transformers import Qwen3_5TextConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=LAYER_TYPES,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        initializer_range=0.2,
    )
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def randomize(model):
    """Non-trivial norms (a norm read without its 1 + w offset would show) and a sharp head."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.lm_head.weight.mul_(3)
    return model


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM

    path = tmp_path_factory.mktemp("qwen3_5")
    torch.manual_seed(0)
    hf = randomize(Qwen3_5ForCausalLM(text_config()))
    hf.save_pretrained(str(path))
    return hf, load_target(path)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_greedy(hybrid, prompts):
    hf, _ = hybrid
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False)[0, len(p) :].tolist() for p in prompts
        ]


@pytest.fixture(scope="module")
def drafter(hybrid):
    torch.manual_seed(4)
    cfg = DraftConfig.for_target(
        hybrid[1].config, num_layers=1, block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2]
    )  # a linear and an attention layer's output
    return DFlashDrafter(cfg).eval()


def run(target, proposer, prompts, block_size, max_new=None, batch_size=None):
    states = []
    reqs = [Request(p, max_new_tokens=m) for p, m in zip(prompts, max_new or [N_NEW] * len(prompts), strict=False)]
    steps = list(generate_steps(target, proposer, reqs, block_size, states, batch_size=batch_size))
    return states, steps


def test_config_reads_the_hybrid_layout_and_fits_a_drafter(hybrid):
    cfg = hybrid[1].config
    assert cfg.layer_types == LAYER_TYPES and cfg.rotary_dim == 8  # 32 * HF's default partial factor 0.25
    drafter_cfg = DraftConfig.for_target(cfg, mask_token_id=1)
    DFlashDrafter(drafter_cfg).check_target(cfg)
    assert drafter_cfg.num_target_layers == 4 and drafter_cfg.hidden_size == 64 and drafter_cfg.vocab_size == VOCAB


def test_logits_through_the_cache_with_rollbacks_match_hf(hybrid):
    """Two rows share a cache: row 0 is fed a sequence in pieces and keeps them all; row 1 is fed
    blocks of the same sequence whose tail is junk, and keeps only the tokens before the junk
    (none, some, all). Every kept position's logits and captured features are HF's."""
    hf, ours = hybrid
    seq = torch.randint(1, VOCAB, (160,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(seq[None, :100], output_hidden_states=True)
    ref, hidden = out.logits[0], out.hidden_states
    cache = ours.new_cache(2, 192)
    lengths = torch.zeros(2, dtype=torch.long)
    got = [{}, {}]
    # (tokens per forward, tokens row 1 keeps); the first is a prefill, kept whole
    for t, keep in ((5, 5), (1, 1), (7, 3), (6, 0), (4, 4), (30, 17), (16, 2), (1, 0), (12, 12)):
        positions = lengths[:, None] + torch.arange(t)
        tokens = seq[positions]
        tokens[1, keep:] = (tokens[1, keep:] + 7) % VOCAB
        with torch.no_grad():
            h, f = ours(tokens, positions, cache, capture=(1, 2))
        kept = torch.tensor([t, keep])
        for b in range(2):
            for j in range(int(kept[b])):
                got[b][int(positions[b, j])] = (ours.logits(h[b, j]), f[b, j])
        lengths += kept
        ours.commit(cache, slice(None), lengths)
    assert lengths.tolist() == [82, 44]
    # row 1 starts a new sequence (position 0) in its used row while row 0 goes on: from empty states
    positions = torch.stack([lengths[0] + torch.arange(8), torch.arange(8)])
    with torch.no_grad():
        h, _ = ours(seq[positions], positions, cache)
    ours.commit(cache, slice(None), positions[:, -1] + 1)
    torch.testing.assert_close(ours.logits(h), ref[positions], **TOL)
    for b in range(2):
        n = int(lengths[b])
        assert sorted(got[b]) == list(range(n))
        logits = torch.stack([got[b][p][0] for p in range(n)])
        feats = torch.stack([got[b][p][1] for p in range(n)])
        torch.testing.assert_close(logits, ref[:n], **TOL)
        torch.testing.assert_close(feats[:, :64], hidden[2][0, :n], **TOL)
        torch.testing.assert_close(feats[:, 64:], hidden[3][0, :n], **TOL)
    with torch.no_grad():  # and without a cache, all at once (training and scoring)
        h, f = ours(seq[None, :100], torch.arange(100)[None], capture=(1,))
    torch.testing.assert_close(ours.logits(h)[0], ref, **TOL)
    torch.testing.assert_close(f[0], hidden[2][0], **TOL)


def test_bfloat16_weights_are_as_close_to_float32_as_hf_bfloat16(hybrid, tmp_path):
    """bf16 (the CPU allows it for a model this small): our logits through the cache (a prefill,
    then tokens one at a time) are no further from the fp32 reference than HF's own bf16
    forward is."""
    import copy

    hf, _ = hybrid
    hf.save_pretrained(str(tmp_path))
    ours = load_target(tmp_path, dtype=torch.bfloat16)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    seq = torch.randint(1, VOCAB, (1, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(seq).logits[0]
        theirs = hf16(seq).logits[0].float()
        cache = ours.new_cache(1, 64)
        h, _ = ours(seq[:, :40], torch.arange(40)[None], cache)
        ours.commit(cache, slice(None), torch.tensor([40]))
        rows = [ours.logits(h[0]).float()]
        for p in range(40, 48):
            h, _ = ours(seq[:, p : p + 1], torch.tensor([[p]]), cache)
            ours.commit(cache, slice(None), torch.tensor([p + 1]))
            rows.append(ours.logits(h[0]).float())
    mine = torch.cat(rows)
    assert mine.dtype == torch.float32 and h.dtype == torch.bfloat16
    err, hf_err = (mine - ref).abs().max(), (theirs - ref).abs().max()
    assert err <= 2 * hf_err, (float(err), float(hf_err))


def test_greedy_ar_equals_hf_generate_for_a_batch_of_different_lengths(hybrid, prompts, hf_greedy):
    states, _ = run(hybrid[1], Proposer(), prompts, 1)
    for p, out, ref in zip(prompts, states, hf_greedy, strict=False):
        assert out.output_ids == ref, f"prompt of {len(p)} tokens"
        assert set(out.acceptance_lengths) == {1}


@pytest.mark.parametrize("right, block", [(None, 8), (2, 8), (0, 5)], ids=["perfect", "right-2", "wrong"])
def test_dflash_rigged_drafts_accept_as_expected_and_stay_exact(hybrid, prompts, hf_greedy, drafter, right, block):
    target = hybrid[1]
    proposer = RiggedProposer(drafter, target, hf_greedy, [len(p) for p in prompts], right, vocab=VOCAB)
    states, _ = run(target, proposer, prompts, block)
    accepted = block if right is None else right + 1
    for p, out, ref in zip(prompts, states, hf_greedy, strict=False):
        assert out.output_ids == ref, f"prompt of {len(p)} tokens"
        # the prefill gives the first token, then every step accepts `accepted` tokens (the last
        # step may be cut by the length limit)
        assert all(a == accepted for a in out.acceptance_lengths[:-1]), out.acceptance_lengths
        assert len(out.acceptance_lengths) == -(-(N_NEW - 1) // accepted)


def test_prompt_lookup_stays_exact_and_accepts_drafts(hybrid, prompts, hf_greedy):
    """Prompts that start with the greedy answers to all prompts: the model's habitual n-grams
    are there to look up, so some drafts are accepted and some rejected."""
    hf, target = hybrid
    context = [t for ref in hf_greedy for t in ref]
    lookup_prompts = [context + p for p in prompts]
    with torch.no_grad():
        refs = [
            hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in lookup_prompts
        ]
    states, _ = run(target, LookupProposer(), lookup_prompts, 4)
    for out, ref in zip(states, refs, strict=False):
        assert out.output_ids == ref
    lengths = {a for s in states for a in s.acceptance_lengths}
    assert 1 in lengths and max(lengths) > 1


def test_continuous_batching_reuses_slots_and_stays_exact(hybrid, prompts, hf_greedy, drafter):
    """Six requests through two slots: a slot's next prompt starts from empty states."""
    target = hybrid[1]
    reqs, refs = prompts + prompts[:2], hf_greedy + hf_greedy[:2]
    max_new = [5, 17, 9, 20, 12, 3]
    for proposer, block in ((Proposer(), 1), (LookupProposer(), 4), (DFlashProposer(drafter, target), 6)):
        states, steps = run(target, proposer, reqs, block, max_new=max_new, batch_size=2)
        assert max(step.batch for step in steps) == 2
        for out, ref, m in zip(states, refs, max_new, strict=False):
            assert out.output_ids == ref[:m], proposer.name


def test_rows_sorted_by_length_move_their_states_along(hybrid, prompts, hf_greedy):
    """Rows reordered every other step (`HybridCache.permute`), attention in groups of rows."""
    target = hybrid[1]
    loop = DecodeLoop(target, LookupProposer(), 4, 3, 128, sort_every=2, group_rows=2)
    max_new = [20, 6, 14, 9]
    states = run_sorting(loop, [Request(p, max_new_tokens=m) for p, m in zip(prompts, max_new, strict=False)])
    for out, ref, m in zip(states, hf_greedy, max_new, strict=False):
        assert out.output_ids == ref[:m]


def test_a_vision_language_folder_loads_its_language_model(tmp_path, prompts):
    """A `Qwen3_5ForConditionalGeneration` folder (model_type qwen3_5, nested text_config, weights
    under model.language_model., a vision tower and an MTP head to ignore, tied output head)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=64,
        patch_size=2,
        num_position_embeddings=16,
    )
    config = Qwen3_5Config(
        text_config=text_config(tie_word_embeddings=True).to_dict(), vision_config=vision, tie_word_embeddings=True
    )
    torch.manual_seed(2)
    hf = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and "text_config" in raw
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("model.language_model.") for k in weights) and "lm_head.weight" not in weights
    assert any(k.startswith("model.visual.") for k in weights)
    weights["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_target(tmp_path)
    assert ours.config.model_type == "qwen3_5_text" and ours.config.tie_word_embeddings
    ids = prompts[1]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
        h, _ = ours(torch.tensor([ids]), torch.arange(len(ids))[None])
    torch.testing.assert_close(ours.logits(h)[0], ref, **TOL)


@pytest.fixture(scope="module")
def near_ties(tmp_path_factory):
    """A tiny random Qwen3.5 with its head as initialised: near ties everywhere, so that any
    difference between a token verified in a block and decoded alone changes a token."""
    from transformers import Qwen3_5ForCausalLM

    path = tmp_path_factory.mktemp("qwen3_5-ties")
    random_norms(lambda: Qwen3_5ForCausalLM(text_config(vocab_size=64)), seed=5).save_pretrained(str(path))
    return path


def random_norms(make, seed: int):
    """The HF model `make()` builds under `seed`, its norms' weights moved off their initial
    values, in evaluation mode."""
    torch.manual_seed(seed)
    model = make().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


# the step each low-precision run takes: bf16 through the fused native step (where this CPU runs it)
# and through the eager layers; fp16 only eagerly (the native step is bf16's)
STEPS = {
    "bf16-native": (torch.bfloat16, "native"),
    "bf16-eager": (torch.bfloat16, f"eager: {native_step.ENV}=0"),
    "fp16": (torch.float16, "eager: bf16 on a CPU only"),
}
needs_native = pytest.mark.skipif(not native.supported(), reason="no AVX512-BF16 (or no compiler) here")


def low_precision(path, dtype, step, monkeypatch):
    if step.startswith(f"eager: {native_step.ENV}"):
        monkeypatch.setenv(native_step.ENV, "0")
    target = load_target(path, dtype=dtype)
    summary = exact.make_exact(target)
    assert summary["exact"] and summary["attention_chunk"] == exact.ATTENTION_CHUNK
    assert summary["step"] == step
    torch.manual_seed(4)
    cfg = DraftConfig.for_target(target.config, num_layers=1, block_size=8, mask_token_id=63, target_layer_ids=[1, 2])
    return target, DFlashDrafter(cfg).to(dtype).eval()


@pytest.mark.parametrize("variant", [pytest.param(v, marks=needs_native) if v == "bf16-native" else v for v in STEPS])
@pytest.mark.parametrize("temperature", (0.0, 1.0))
def test_every_method_gives_plain_decodings_tokens_in_low_precision(near_ties, variant, temperature, monkeypatch):
    """Exact mode on a hybrid target: its products through one row-independent kernel, the
    full-attention layers' attention chunked, the linear layers' recurrence token by token after
    the prefill; or all of it in the fused native step. DFlash chains (blocks 4 and 8, the adaptive
    policy's widths) and prompt lookup give `ar`'s tokens on 24 prompts of 1 to 70 tokens, greedy
    and seeded sampling, one row and 24 rows a step."""
    target, drafter = low_precision(near_ties, *STEPS[variant], monkeypatch)
    prompts = prompts24()
    with torch.inference_mode():
        ar = [run_rows(target, Proposer(), [p], 1, temperature=temperature, first=i)[0] for i, p in enumerate(prompts)]
        assert run_rows(target, Proposer(), prompts, 1, temperature=temperature) == ar
        for block in (4, 8):
            assert run_rows(target, DFlashProposer(drafter, target), prompts, block, temperature=temperature) == ar
        adaptive = run_rows(target, DFlashProposer(drafter, target), prompts, 8, temperature=temperature, adaptive=True)
        assert adaptive == ar
        assert run_rows(target, LookupProposer(), prompts, 4, temperature=temperature, batch_size=5) == ar


def rounded_in_blocks(steps):
    """A mutant of the gated delta rule `steps` (eager: `delta_rule_steps`): run token by token, but
    within a block of several tokens the state rounded to bf16 after each."""

    def mutant(q, k, v, g, beta, state):
        if q.shape[1] == 1:
            return steps(q, k, v, g, beta, state)
        outs, states = [], []
        for i in range(q.shape[1]):
            out, after = steps(
                q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], g[:, i : i + 1], beta[:, i : i + 1], state
            )
            state = after[:, 0].bfloat16().float()
            outs.append(out)
            states.append(after)
        return torch.cat(outs, 1), torch.cat(states, 1)

    return mutant


@pytest.mark.parametrize("mutant", ["product", "recurrence"])
def test_a_width_dependent_hybrid_layer_changes_speculative_output(near_ties, monkeypatch, mutant):
    """The comparison above catches the bugs it is for: a linear layer's input product made
    width-dependent (`split_sum`), or its recurrence run another way for a block than for one token
    (the state rounded to bf16 after each token of a block), and speculative output leaves plain
    decoding's on the same prompts."""
    from blockdraft.models import qwen3_5

    target, drafter = low_precision(near_ties, *STEPS["bf16-eager"], monkeypatch)
    if mutant == "product":
        layer = target.model.layers[0].linear_attn.in_proj
        with torch.inference_mode():
            layer(torch.zeros(1, layer.in_features, dtype=torch.bfloat16))  # the product keeps its kernel now
        monkeypatch.setattr(layer.product, "_fn", split_sum)
    else:
        monkeypatch.setattr(qwen3_5, "delta_rule_steps", rounded_in_blocks(qwen3_5.delta_rule_steps))
    prompts = prompts24()
    with torch.inference_mode():
        ar = [run_rows(target, Proposer(), [p], 1)[0] for p in prompts]
        assert run_rows(target, DFlashProposer(drafter, target), prompts, 8) != ar


@needs_native
def test_a_width_dependent_native_hybrid_step_is_caught(near_ties, monkeypatch):
    """The same for the fused step: one that sends verify blocks through the eager layers (other
    roundings) and single tokens through the native kernel fails the check at load, which keeps
    the eager step; put in place past that check, it changes speculative output on the 24 prompts."""
    call = native_step.NativeHybridStep.__call__

    def mutant(self, tokens, positions, cache, slots=None, mask=None, rows=slice(None), capture=(), only=False):
        if tokens.shape[1] == 1 or bool((positions[:, 0] == 0).all()):
            return call(self, tokens, positions, cache, slots, mask, rows, capture, only)
        model, model.native_step = self.model, None
        try:
            return model(
                tokens, positions, cache, slots=slots, mask=mask, rows=rows, capture=capture, features_only=only
            )
        finally:
            model.native_step = self

    monkeypatch.setattr(native_step.NativeHybridStep, "__call__", mutant)
    target, drafter = low_precision(near_ties, torch.bfloat16, "eager: its check on random tokens failed", monkeypatch)
    target.native_step = native_step.NativeHybridStep(target)
    prompts = prompts24()
    with torch.inference_mode():
        ar = [run_rows(target, Proposer(), [p], 1)[0] for p in prompts]
        assert run_rows(target, DFlashProposer(drafter, target), prompts, 8) != ar


@needs_native
def test_the_native_hybrid_steps_replay_keeps_the_states_of_the_accepted_tokens(near_ties):
    """After a verify block of 6 tokens of which a row keeps 0, 2 or 6 (two rows of different
    lengths), the committed linear-attention states (replayed from the block's trace) and conv
    inputs equal bit for bit those after decoding the kept tokens one at a time, and so does the
    next step's output."""
    target = load_target(near_ties, dtype=torch.bfloat16)
    assert exact.make_exact(target)["step"] == "native"
    seq = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(9))
    starts = (11, 17)

    def prefilled():
        cache = target.new_cache(2, 64)
        for b, n in enumerate(starts):  # hybrid rows prefill one at a time
            target(seq[b : b + 1, :n], torch.arange(n)[None], cache, rows=slice(b, b + 1))
            target.commit(cache, slice(b, b + 1), torch.tensor([n]))
        return cache

    def next_step(cache, lengths):
        positions = torch.tensor(lengths)[:, None]
        return target(seq.gather(1, positions), positions, cache)[0]

    with torch.inference_mode():
        for keep in ((0, 2), (2, 6), (6, 0)):
            block = prefilled()
            positions = torch.tensor(starts)[:, None] + torch.arange(6)
            target(seq.gather(1, positions), positions, block)
            target.commit(block, slice(None), torch.tensor(starts) + torch.tensor(keep))
            alone = prefilled()
            for i in range(max(keep)):
                rows = [b for b in range(2) if i < keep[b]]
                for b in rows:
                    p = torch.tensor([[starts[b] + i]])
                    target(seq[b : b + 1, starts[b] + i][:, None], p, alone, rows=slice(b, b + 1))
                    target.commit(alone, slice(b, b + 1), p[0] + 1)
            assert torch.equal(block.state, alone.state) and torch.equal(block.conv, alone.conv), keep
            lengths = [s + k for s, k in zip(starts, keep, strict=True)]
            assert torch.equal(next_step(block, lengths), next_step(alone, lengths)), keep


@needs_native
def test_the_native_hybrid_step_is_as_close_to_fp32_as_the_eager_bf16_layers(monkeypatch, tmp_path):
    """Through a cache shared by two rows (a prefill, single tokens, blocks; each kept whole): the
    fused step's logits and captured features are as close to the fp32 model's as the eager bf16
    layers' are, and it keeps the same conv inputs and states for `commit`."""
    from transformers import Qwen3_5ForCausalLM

    hf = random_norms(lambda: Qwen3_5ForCausalLM(text_config(initializer_range=0.05)), seed=7)
    path = str(tmp_path / "q35")
    hf.save_pretrained(path)
    seq = torch.randint(1, VOCAB, (2, 100), generator=torch.Generator().manual_seed(1))

    def run(model):
        cache, n, out = model.new_cache(2, 128), torch.zeros(2, dtype=torch.long), []
        for t in (40, 1, 5, 1, 16, 3):
            positions = n[:, None] + torch.arange(t)
            with torch.inference_mode():
                h, f = model(seq.gather(1, positions), positions, cache, capture=(1, 2))
                out += [model.logits(h).float(), f.float()]
            n += t
            model.commit(cache, slice(None), n)
        return out + [cache.state.clone(), cache.conv.float()]

    ref = run(load_target(path, dtype=torch.float32))
    fused = load_target(path, dtype=torch.bfloat16)
    assert exact.make_exact(fused)["step"] == "native"
    monkeypatch.setenv(native_step.ENV, "0")
    eager = load_target(path, dtype=torch.bfloat16)
    assert exact.make_exact(eager)["step"].startswith("eager")
    for got, theirs, r in zip(run(fused), run(eager), ref, strict=True):
        error = ((got - r).norm() / r.norm()).item()
        assert error <= max(1.5 * ((theirs - r).norm() / r.norm()).item(), 4e-3), error


def test_unsupported_uses_are_clear_errors(hybrid, drafter, tmp_path):
    target = hybrid[1]
    with pytest.raises(BlockdraftError, match="tree verification needs a target without recurrent layers"):
        DFlashTreeProposer(drafter, target, top_k=4)
    if quant.int4_available():
        with pytest.raises(BlockdraftError, match="quantized weights are not supported"):
            quant.quantize_target(target)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe", "text_config": {}}')
    with pytest.raises(BlockdraftError, match="unsupported architecture 'qwen3_5_moe' .mixture-of-experts"):
        load_target(tmp_path)
    from blockdraft.train.init import init_from_target

    with pytest.raises(BlockdraftError, match="use --init random"):
        init_from_target(drafter, target, "target-last", None)
