"""Quantized target weights (`--dtype q4_1`): the GGUF file's own integers, torch's int4/int8
CPU kernels, and speculative decoding that stays lossless with respect to those weights."""

import math

import pytest
import torch
import torch.nn.functional as F

from blockdraft.batcher import generate_steps
from blockdraft.models import load_target, quant
from blockdraft.models.default import default_target_dir, gguf_path
from blockdraft.models.layers import attend_chunked, chunked_attention_is_exact, chunked_mask
from blockdraft.proposers import DFlashProposer, LookupProposer, Proposer
from blockdraft.sampling import SamplingParams, target_probs
from blockdraft.sequences import Request

from .conftest import save_tiny_hf

pytestmark = pytest.mark.skipif(not quant.int4_available(), reason="torch has no int4 CPU kernels")


@pytest.fixture(scope="module")
def q4():
    model = load_target(default_target_dir())
    quant.quantize_target(model, gguf_path())
    return model


def test_gguf_integers_are_the_weights_we_run_in_fp32(smol):
    """The file's Q4_1 / Q8_0 values, de-quantized, are exactly our fp32 weights (q and k rows
    un-permuted from llama.cpp's rope layout)."""
    tensors = quant.gguf_tensors(gguf_path())
    cfg = smol.config
    for i in (0, 29):
        layer = smol.model.layers[i]
        qkv = layer.self_attn.qkv_proj.weight.detach()
        gate_up = layer.mlp.gate_up_proj.weight.detach()
        expected = {
            "attn_q": (cfg.num_attention_heads, qkv[:576]),
            "attn_k": (cfg.num_key_value_heads, qkv[576:768]),
            "attn_v": (None, qkv[768:]),
            "attn_output": (None, layer.self_attn.o_proj.weight.detach()),
            "ffn_gate": (None, gate_up[:1536]),
            "ffn_up": (None, gate_up[1536:]),
            "ffn_down": (None, layer.mlp.down_proj.weight.detach()),
        }
        for name, (heads, weight) in expected.items():
            t = tensors[f"blk.{i}.{name}.weight"]
            cols, rows = (int(x) for x in t.shape)
            q, d, m = quant.q4_1_blocks(t.data, rows, cols)
            assert int(q.max()) <= 15
            if heads:
                order = quant.unpermute_rows(heads, rows)
                q, d, m = q[order], d[order], m[order]
            deq = (q.float().view(rows, -1, 32) * d[..., None] + m[..., None]).view(rows, cols)
            assert torch.equal(deq, weight), f"blk.{i}.{name}"
    t = tensors["token_embd.weight"]
    q8, d8 = quant.q8_0_blocks(t.data, 49152, 576)
    assert torch.equal(quant.Q8Embedding(q8, d8).dequantized(), smol.model.embed_tokens.weight.detach())


def test_int4_linear_is_the_q4_1_product_and_row_independent():
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.1
    q, d, m = quant.quantize_q4_1(w)
    lin = quant.Int4Linear(q, d, m)
    in_use = quant.Int4Linear.weight_in_use(q, d, m)
    exact = (q.float().view(96, -1, 32) * d[..., None] + m[..., None]).view(96, 128)
    assert (exact - w).abs().max() <= d.max() / 2 + 1e-3  # Q4_1 rounding: half a step (plus fp16 scales)
    x = torch.randn(16, 128)
    y = lin(x)
    ref = x.bfloat16().float() @ in_use.T
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()  # bf16 output rounding
    for rows in (1, 3, 8, 15):  # a row's result does not depend on the other rows of the call
        assert torch.equal(lin(x[:rows]), y[:rows])


def test_chunked_attention_is_bit_identical_alone_and_in_a_block():
    """For SmolLM2's head shape, a query verified in a block of 16 gets bit for bit what it gets
    decoded alone, with any number of masked slots after its own; and it is SDPA up to rounding."""
    assert chunked_attention_is_exact(9, 3, 64, 64)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 16, 64), torch.randn(1, 3, 192, 64), torch.randn(1, 3, 192, 64)
    mask = (torch.arange(192)[None] <= torch.arange(150, 166)[:, None])[None, None]
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (attend_chunked(q, k, v, chunked_mask(mask, 3), 64) - sdpa).abs().max() < 1e-5


def test_q4_1_target_stays_close_to_fp32(q4, smol, chat_ids):
    summary = q4.quantization
    assert summary["linears"] == 120 and summary["source"] == "gguf" and summary["exact_attention"]
    assert summary["max_linear_error"] < 0.05 and summary["max_head_error"] < 0.02
    agree = total = 0
    with torch.inference_mode():
        for ids in chat_ids[:4]:
            x, pos = torch.tensor([ids]), torch.arange(len(ids))[None]
            a = smol.logits(smol(x, pos)[0])[0].argmax(-1)
            b = q4.logits(q4(x, pos)[0])[0].argmax(-1)
            agree += int((a == b).sum())
            total += len(ids)
    assert agree / total > 0.9


def _run(target, proposer, prompts, block, max_new=24, batch_size=None):
    states = []
    reqs = [Request(p, max_new_tokens=max_new, stop_token_ids=(2,)) for p in prompts]
    list(generate_steps(target, proposer, reqs, block, states, batch_size=batch_size))
    return [s.output_ids for s in states]


def test_q4_1_speculation_is_lossless(q4, chat_ids, random_drafter):
    """Greedy DFlash and prompt lookup give the quantized target's own greedy tokens, alone, in
    a batch and through continuous batching."""
    prompts = chat_ids[:6]
    ar = [_run(q4, Proposer(), [p], 1)[0] for p in prompts]
    assert len({tuple(a) for a in ar}) == len(ar)
    assert _run(q4, DFlashProposer(random_drafter, q4), prompts, 16) == ar
    assert _run(q4, LookupProposer(), prompts, 4) == ar
    assert _run(q4, DFlashProposer(random_drafter, q4), prompts, 8, batch_size=2) == ar


def test_engine_q4_1_runs_the_file_and_reports_it():
    from blockdraft import Engine

    engine = Engine.load(dtype="q4_1", use_draft=False)
    assert engine.weights == "q4_1" and engine.target.dtype == torch.float32
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.target.modules())
    out = engine.generate("Name a colour.", chat=True, method="lookup", max_new_tokens=12)
    assert out.token_ids == engine.generate("Name a colour.", chat=True, method="ar", max_new_tokens=12).token_ids


# ---- the exact-distribution test, on a tiny quantized model --------------------------------

V, L = 6, 3
PROMPT = [1, 4, 2, 0]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    from blockdraft.draft import DFlashDrafter, DraftConfig

    path = tmp_path_factory.mktemp("tinyq")
    hf = save_tiny_hf(
        "llama",
        path,
        vocab_size=V,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.no_grad():
        hf.lm_head.weight.mul_(25)
    hf.save_pretrained(str(path))
    target = load_target(path)
    summary = quant.quantize_target(target)  # fp32 weights quantized with the Q4_1 rule
    assert summary["source"] == "fp32" and summary["linears"] == 12
    torch.manual_seed(5)
    cfg = DraftConfig.for_target(target.config, num_layers=1, block_size=4, mask_token_id=5)
    return target, DFlashDrafter(cfg).eval()


def test_q4_1_sampling_follows_the_quantized_target(tiny_q4):
    import itertools

    from blockdraft.bench.stats import chi2_goodness_of_fit

    target, drafter = tiny_q4
    one = lambda x: torch.tensor([x])  # noqa: E731
    dist = {}
    with torch.inference_mode():
        for seq in itertools.product(range(V), repeat=L):
            ids = PROMPT + list(seq[:-1])
            hidden, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None])
            probs = target_probs(
                target.logits(hidden)[0, len(PROMPT) - 1 :], one(1.0).expand(L), one(1.0).expand(L), one(0).expand(L)
            )
            dist[seq] = math.prod(float(probs[i, t]) for i, t in enumerate(seq))
    assert max(dist.values()) < 0.6
    counts = {}
    for start in range(0, 3000, 500):
        reqs = [Request(PROMPT, max_new_tokens=L, sampling=SamplingParams(1.0, seed=start + i)) for i in range(500)]
        states = []
        list(generate_steps(target, DFlashProposer(drafter, target), reqs, 4, states))
        for s in states:
            counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
    stat, critical = chi2_goodness_of_fit(dist, counts, 3000)
    assert stat < critical


# ---- int8 drafters (`Engine.load(draft_weights="int8")`, the default on CPU) ----------------


def test_int8_rows_are_the_weights_in_use():
    torch.manual_seed(0)
    w = torch.randn(200, 96) * torch.rand(200, 1) * 3
    w[7] = 0.0  # an all-zero row keeps a usable scale
    q, scale = quant.quantize_rows_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and int(q.abs().max()) <= 127
    used = q.float() * scale.float()[:, None]
    assert torch.all((w - used).abs() <= scale.float()[:, None] / 2 + 1e-6)
    assert torch.equal(used[7], torch.zeros(96))
    bias = torch.randn(200)
    lin = quant.Int8Linear.from_float(w, bias)
    assert torch.equal(lin.dequantized(), used)
    x = torch.randn(2, 5, 96)
    y = lin(x)
    ref = x.bfloat16().float() @ used.T + bias  # the kernel multiplies bf16-rounded inputs
    assert y.shape == (2, 5, 200) and torch.allclose(y, ref, rtol=2e-2, atol=2e-2)
    assert torch.allclose(lin(x[:1, :1]), y[:1, :1], rtol=1e-2, atol=1e-2)  # a row alone: the same product


def test_draft_weights_resolve_and_refuse_clearly():
    from blockdraft.engine import resolve_draft_weights
    from blockdraft.errors import BlockdraftError

    from blockdraft.models import native

    cpu = torch.device("cpu")
    # an fp32 target's drafters: bf16 through the native pass where it runs, else int8
    assert resolve_draft_weights("auto", cpu, torch.float32) == ("bf16" if native.available() else "int8")
    assert resolve_draft_weights("auto", cpu, torch.bfloat16) == "float"
    assert resolve_draft_weights("auto", torch.device("cuda"), torch.float32) == "float"
    assert resolve_draft_weights("float", cpu, torch.float32) == "float"
    assert resolve_draft_weights("bf16", cpu, torch.bfloat16) == "float"  # the target's dtype already
    with pytest.raises(BlockdraftError, match="CPU"):
        resolve_draft_weights("int8", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(BlockdraftError, match="AVX512-BF16"):
        resolve_draft_weights("bf16", torch.device("cuda"), torch.float32)
    with pytest.raises(BlockdraftError, match="one of"):
        resolve_draft_weights("int4", cpu, torch.float32)


@pytest.fixture(scope="module")
def shipped_pair():
    """The shipped DFlash and EAGLE-3-style drafters, fp32 and int8 (real drafts: acceptance
    well above a random drafter's, so a broken int8 product would show in tau)."""
    import copy

    from blockdraft.draft import DFlashDrafter
    from blockdraft.eagle import EagleDrafter
    from blockdraft.engine import shipped_drafter
    from blockdraft.draft_head import pack_drafter, quantize_drafter

    pairs = {}
    for kind, cls in (("dflash", DFlashDrafter), ("eagle3", EagleDrafter)):
        folder = shipped_drafter(kind)
        if folder is None:
            pytest.skip(f"no shipped {kind} drafter")
        fp32 = cls.load(folder).eval()
        q8 = copy.deepcopy(fp32)
        assert quantize_drafter(q8) > 0 and not any(isinstance(m, torch.nn.Linear) for m in q8.modules())
        pack_drafter(fp32)
        pairs[kind] = fp32, q8
    return pairs


def test_int8_drafters_are_lossless_and_keep_their_acceptance(smol, chat_ids, shipped_pair):
    """Greedy output with int8 drafters is the target's own (alone and in a batch), and the
    drafts stay nearly as good: at most 10% more verify steps than the fp32 drafters need."""
    from blockdraft.proposers import EagleProposer

    prompts = chat_ids[:2]  # code and arithmetic
    ar = [_run(smol, Proposer(), [p], 1, max_new=32)[0] for p in prompts]
    tokens = sum(len(a) for a in ar)

    def steps_and_outputs(proposer, block, batch_size=1):
        states = []
        reqs = [Request(p, max_new_tokens=32, stop_token_ids=(2,)) for p in prompts]
        steps = sum(1 for _ in generate_steps(smol, proposer, reqs, block, states, batch_size=batch_size))
        return steps, [s.output_ids for s in states]

    for kind, make, block in (("dflash", DFlashProposer, 3), ("eagle3", EagleProposer, 4)):
        fp32, q8 = shipped_pair[kind]
        steps32, out32 = steps_and_outputs(make(fp32, smol), block)
        steps8, out8 = steps_and_outputs(make(q8, smol), block)
        assert out32 == ar and out8 == ar, kind
        assert steps8 <= 1.1 * steps32, (kind, steps8, steps32)
        assert steps32 < 0.9 * tokens, (kind, steps32, tokens)  # the drafts do get accepted
    q8 = shipped_pair["dflash"][1]  # its whole trained block, two rows
    assert steps_and_outputs(DFlashProposer(q8, smol), q8.config.block_size, batch_size=2)[1] == ar


def test_bf16_drafters_beside_an_fp32_target_are_lossless_and_keep_their_acceptance(smol, chat_ids, shipped_pair):
    """`draft_weights="bf16"` (what "auto" picks for an fp32 target where the native kernels run):
    the DFlash drafter in bf16, its pass native, reading the fp32 target's features, embeddings
    and LM-head rows cast to bf16. Greedy output is the target's own (a chain, adaptive widths, a
    tree, two rows at the whole block) and the drafts stay as good as the fp32 drafter's (at most
    10% more verify steps); another kind (EAGLE-3) gets what "auto" gives it without bf16."""
    from blockdraft import drafters
    from blockdraft.engine import shipped_drafter
    from blockdraft.models import native
    from blockdraft.proposers import DFlashTreeProposer

    if not native.available():
        pytest.skip("the native kernels do not run here")
    bf = drafters.load_drafter("dflash", shipped_drafter("dflash"), smol, draft_weights="bf16", packed=True)
    assert bf.fc.weight.dtype == torch.bfloat16 and bf.draft_pass == "native" and bf.head.name == "native"
    eagle = drafters.load_drafter("eagle3", shipped_drafter("eagle3"), smol, draft_weights="bf16", packed=True)
    assert eagle.head.name == quant.without_bf16(smol.device, smol.dtype)
    prompts = chat_ids[:2]
    ar = [_run(smol, Proposer(), [p], 1, max_new=32)[0] for p in prompts]

    def steps_and_outputs(proposer, block, batch_size=1, adaptive=False):
        states = []
        reqs = [Request(p, max_new_tokens=32, stop_token_ids=(2,)) for p in prompts]
        steps = generate_steps(smol, proposer, reqs, block, states, batch_size=batch_size, adaptive=adaptive)
        return sum(1 for _ in steps), [s.output_ids for s in states]

    fp32 = shipped_pair["dflash"][0]
    steps32, out32 = steps_and_outputs(DFlashProposer(fp32, smol), 3)
    steps16, out16 = steps_and_outputs(DFlashProposer(bf, smol), 3)
    assert out32 == ar and out16 == ar
    assert steps16 <= 1.1 * steps32 and steps32 < 0.9 * sum(len(a) for a in ar), (steps16, steps32)
    block = bf.config.block_size
    assert steps_and_outputs(DFlashProposer(bf, smol), block, batch_size=2)[1] == ar
    assert steps_and_outputs(DFlashProposer(bf, smol), block, adaptive=True)[1] == ar
    assert steps_and_outputs(DFlashTreeProposer(bf, smol, top_k=4, tree_nodes=8), 9)[1] == ar


def test_an_int8_drafter_cannot_be_saved(tmp_path, random_drafter):
    import copy

    from blockdraft.errors import BlockdraftError

    q8 = copy.deepcopy(random_drafter)
    from blockdraft.draft_head import quantize_drafter

    quantize_drafter(q8)
    with pytest.raises(BlockdraftError, match="int8"):
        q8.save(tmp_path / "d")
    random_drafter.save(tmp_path / "fp32")  # the fp32 one it was made from still can
