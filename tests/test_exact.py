"""Exact speculation in every dtype (`models.exact`): a token verified in a block gets bit for bit
the logits of the plain one-token step, so every method's output equals `ar`'s in bf16 and fp16
too, greedy and seeded sampling, alone and in batches; a width-dependent kernel is caught."""

import pytest
import torch
import torch.nn.functional as F

from blockdraft.batcher import generate_steps
from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.draft_native import use_native_draft
from blockdraft.models import exact, load_target, native
from blockdraft.proposers import DFlashProposer, DFlashTreeProposer, LookupProposer, Proposer
from blockdraft.sampling import SamplingParams
from blockdraft.sequences import Request

from .conftest import PROMPTS, save_tiny_hf

LOW = (torch.bfloat16, torch.float16)


def split_sum(x, w, b=None):
    """A width-dependent product (the bug class): one row as `F.linear`; several rows as two
    half-width products rounded to the dtype and added (another summation order)."""
    if x.shape[0] == 1:
        return F.linear(x, w, b)
    k = x.shape[1] // 2
    out = F.linear(x[:, :k], w[:, :k]) + F.linear(x[:, k:], w[:, k:])
    return out if b is None else out + b


@pytest.mark.parametrize("dtype", (torch.float32,) + LOW)
def test_the_check_refuses_a_width_dependent_product_and_passes_the_kernel_it_picks(dtype):
    w = torch.randn(96, 64).to(dtype)
    assert not exact._row_independent(split_sum, w, None)
    kernel = exact.exact_kernel(w)
    assert kernel is not None
    assert exact._row_independent(exact._kernels(w)[kernel], w, None)
    # and the layer runs it: a row's product is the same alone, among 70 rows, and past the call limit
    layer = exact.ExactLinear.wrap(torch.nn.Linear(64, 96, bias=False).to(dtype), kernel)
    x = torch.randn(70, 64).to(dtype)
    with torch.inference_mode():
        together = layer(x)
        assert all(torch.equal(layer(x[i : i + 1]), together[i : i + 1]) for i in (0, 33, 65, 69))


@pytest.mark.skipif(not native.supported(), reason="no AVX512-BF16 (or no compiler / ninja) here")
@pytest.mark.parametrize("shape", [(96, 64), (7, 40), (13, 576)], ids=["tiles", "tails", "odd-rows"])
def test_the_native_bf16_product_is_row_independent_and_right(shape):
    """blockdraft's own kernel: a row's product is the same alone, among up to 70 rows and at any
    place among them (the check `exact` runs), with and without bias, and it is the product:
    within bf16 rounding of the fp32 one (odd shapes exercise the partial tiles and steps)."""
    assert native.available()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(*shape, generator=gen).bfloat16()
    b = torch.randn(shape[0], generator=gen).bfloat16()
    for bias in (None, b):
        assert exact._row_independent(native.linear, w, bias)
        x = torch.randn(70, shape[1], generator=gen).bfloat16()
        ref = x.float() @ w.float().T + (0 if bias is None else bias.float())
        torch.testing.assert_close(native.linear(x, w, bias).float(), ref, rtol=2e-2, atol=2e-2)
    assert not exact._row_independent(
        lambda x, w, b: native.linear(x, w, b) if x.shape[0] == 1 else split_sum(x, w, b), w, None
    )


# ---- a tiny target, every dtype: near ties are everywhere, so any inexactness shows -----------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-exact")
    save_tiny_hf(
        "llama",
        path,
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return path


def tiny(path, dtype, step="native"):
    """The tiny target in exact mode and a random drafter; `step`: "native" keeps the fused step and
    draft pass where this machine runs them (bf16 with AVX512-BF16), "eager" turns them off."""
    target = load_target(path, dtype=dtype)
    summary = exact.make_exact(target)
    assert summary["exact"] and summary["attention_chunk"] == exact.ATTENTION_CHUNK
    assert (summary["step"] == "native") == (dtype == torch.bfloat16 and native.available())
    if step == "eager":
        target.native_step = None
    torch.manual_seed(3)
    cfg = DraftConfig.for_target(target.config, num_layers=1, block_size=8, mask_token_id=63)
    drafter = DFlashDrafter(cfg).to(dtype).eval()
    if step == "native":  # the drafter's pass too (`draft_native`), where the target's step is fused
        assert (use_native_draft(drafter) == "native") == (summary["step"] == "native")
    return target, drafter


def prompts24():
    """24 prompts of 1 to 70 tokens; some repeat themselves, so prompt lookup drafts get accepted."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(24):
        n = 1 + (i * 37) % 70
        ids = torch.randint(0, 60, (n,), generator=gen).tolist()
        out.append(ids if i % 3 else (ids[: max(1, n // 3)] * 4)[:n])
    return out


def run(target, proposer, prompts, block, *, temperature=0.0, batch_size=None, adaptive=False, max_new=24, first=0):
    """Output ids of each prompt; with a temperature prompt i samples with seed 100 + first + i."""
    reqs = [
        Request(
            p,
            max_new_tokens=max_new,
            stop_token_ids=(),
            sampling=SamplingParams(temperature, seed=100 + first + i) if temperature else SamplingParams(),
        )
        for i, p in enumerate(prompts)
    ]
    states = []
    list(generate_steps(target, proposer, reqs, block, states, batch_size=batch_size, adaptive=adaptive))
    return [s.output_ids for s in states]


STEPS = [(torch.bfloat16, "native"), (torch.bfloat16, "eager"), (torch.float16, "eager")]


@pytest.mark.parametrize("dtype,step", STEPS, ids=["bf16-native", "bf16-eager", "fp16"])
@pytest.mark.parametrize("temperature", (0.0, 1.0))
def test_every_method_gives_plain_decodings_tokens_in_low_precision(tiny_path, dtype, step, temperature):
    if step == "native" and not native.available():
        pytest.skip("the native step needs a CPU with AVX512-BF16")
    target, drafter = tiny(tiny_path, dtype, step)
    prompts = prompts24()
    with torch.inference_mode():
        ar = [
            run(target, Proposer(), [p], 1, temperature=temperature, first=i)[0]  # one row a step
            for i, p in enumerate(prompts)
        ]
        assert run(target, Proposer(), prompts, 1, temperature=temperature) == ar  # 24 rows a step
        for block in (4, 8):
            assert run(target, DFlashProposer(drafter, target), prompts, block, temperature=temperature) == ar
        assert (
            run(target, DFlashProposer(drafter, target), prompts, 8, temperature=temperature, adaptive=True) == ar
        )  # dflash-cut's policy: the verified width changes step to step
        assert run(target, LookupProposer(), prompts, 4, temperature=temperature, batch_size=5) == ar
        tree = DFlashTreeProposer(drafter, target, top_k=3, tree_nodes=10)  # nodes in other slots than positions
        assert run(target, tree, prompts, tree.default_block_size, temperature=temperature) == ar


def test_a_width_dependent_product_changes_speculative_output(tiny_path, monkeypatch):
    """The comparison above catches the bug it is for: with one product made width-dependent
    (the mutant `split_sum`), speculative output leaves plain decoding's on the same prompts."""
    target, drafter = tiny(tiny_path, torch.bfloat16, "eager")
    layer = target.model.layers[1].mlp.down_proj
    with torch.inference_mode():
        layer(torch.zeros(1, layer.in_features, dtype=torch.bfloat16))  # the product keeps its kernel now
    monkeypatch.setattr(layer.product, "_fn", split_sum)
    prompts = prompts24()
    with torch.inference_mode():
        ar = [run(target, Proposer(), [p], 1)[0] for p in prompts]
        spec = run(target, DFlashProposer(drafter, target), prompts, 8)
    assert spec != ar


@pytest.mark.skipif(not native.available(), reason="the native step needs a CPU with AVX512-BF16")
def test_a_width_dependent_step_is_refused_and_changes_speculative_output(tiny_path, monkeypatch):
    """The fused step's load-time check and the comparison above catch a step that computes blocks
    otherwise than single tokens (the mutant: the fused step for one token, the eager forward, with
    its other roundings, for blocks)."""
    from blockdraft.models import native_step

    target, drafter = tiny(tiny_path, torch.bfloat16)
    step = target.native_step
    eager = type(target).forward

    def mutant(tokens, positions, cache, slots=None, mask=None, rows=slice(None), capture=(), features_only=False):
        if tokens.shape[1] == 1:
            return step(tokens, positions, cache, slots, mask, rows, capture, features_only)
        target.native_step = None
        try:
            return eager(
                target,
                tokens,
                positions,
                cache,
                slots=slots,
                mask=mask,
                rows=rows,
                capture=capture,
                features_only=features_only,
            )
        finally:
            target.native_step = mutant

    with torch.inference_mode():
        assert native_step.row_independent(target, step)
        assert not native_step.row_independent(target, mutant)
        target.native_step = mutant
        prompts = prompts24()
        ar = [run(target, Proposer(), [p], 1)[0] for p in prompts]
        assert run(target, DFlashProposer(drafter, target), prompts, 8) != ar


# ---- the default target, as a user runs it --------------------------------------------------


@pytest.fixture(scope="module")
def bf16_engine():
    from blockdraft import Engine

    return Engine.load(dtype=torch.bfloat16)


def test_bf16_engine_is_exact_and_says_so(bf16_engine):
    info = bf16_engine.precision()
    assert info["dtype"] == "bfloat16" and info["exact"] and info["dtype_reason"].startswith("chosen")
    assert bf16_engine.target.attention_chunk == exact.ATTENTION_CHUNK
    assert info["step"] == "native" if native.available() else info["step"].startswith("eager")


def test_default_target_in_bf16_speculates_exactly(bf16_engine):
    """The shipped DFlash drafter gives `ar`'s bf16 tokens on chat prompts of different lengths,
    in one batch (before exactness: 7 of 12 prompts equal within 48 tokens on a 2-core AMD EPYC)."""
    prompts = PROMPTS[:8]
    ar = [g.token_ids for g in bf16_engine.generate(prompts, chat=True, method="ar", max_new_tokens=12)]
    assert [g.token_ids for g in bf16_engine.generate(prompts, chat=True, method="dflash", max_new_tokens=12)] == ar


@pytest.mark.slow
def test_default_target_in_bf16_speculates_exactly_with_every_method(bf16_engine):
    """The shipped drafters (chains, cut chains and trees) and prompt lookup give `ar`'s bf16
    tokens on 24 chat prompts of different lengths, all in one batch."""
    e = bf16_engine
    prompts = (
        PROMPTS + [p + " Answer briefly." for p in PROMPTS] + ["Why?", "Name a colour.", "2+2=", "Continue: 1, 2, 3,"]
    )
    assert len(prompts) == 24
    ar = [g.token_ids for g in e.generate(prompts, chat=True, method="ar", max_new_tokens=12)]
    for method in ("dflash", "dflash-cut", "dflash-tree@8", "eagle3@4", "lookup"):
        assert [g.token_ids for g in e.generate(prompts, chat=True, method=method, max_new_tokens=12)] == ar, method


# ---- dtype auto: measured, and said -----------------------------------------------------------


def test_auto_picks_bf16_only_where_this_cpu_multiplies_it_faster(monkeypatch):
    from blockdraft import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "bf16_speedup", lambda: 2.4)
    choice = precision.auto_dtype(cpu)
    assert choice.dtype == torch.bfloat16 and "2.40x as fast as fp32" in choice.reason
    assert precision.explain(torch.bfloat16, cpu) == "chosen"
    monkeypatch.setattr(precision, "bf16_speedup", lambda: 0.4)
    choice = precision.auto_dtype(cpu)
    assert choice.dtype == torch.float32 and "0.40x" in choice.reason and "under the 1.2x" in choice.reason
    assert "note: " in precision.explain(torch.bfloat16, cpu)  # allowed, with what was measured
    assert precision.auto_dtype(torch.device("cuda")).dtype == torch.bfloat16


def test_the_speedup_is_measured_once_per_machine(monkeypatch, tmp_path):
    from blockdraft import precision

    monkeypatch.setenv("BLOCKDRAFT_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(
        precision,
        "product_seconds",
        lambda dtype, **_: calls.append(dtype) or (0.004 if dtype == torch.float32 else 0.001),
    )
    assert precision.bf16_speedup() == 4.0 and precision.bf16_speedup() == 4.0
    assert calls == [torch.float32, torch.bfloat16]


def test_a_tree_node_meets_its_keys_as_it_would_decoded_alone():
    """Gathered attention (`attend_gathered`): each node of a token tree, whose ancestors sit in
    other cache slots than their positions, gets bit for bit the attention output of the same
    token decoded alone (context then ancestors in consecutive slots). The plain chunked attention
    over the tree's scattered slots does not (a sum in another order), which is why trees gather."""
    from blockdraft.models.layers import attend_chunked, attend_gathered, chunked_mask, gathered_keys

    heads, kv, d, chunk = 9, 3, 64, exact.ATTENTION_CHUNK
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]  # ancestors before descendants, as trees are laid out
    t = len(parents)

    def path(i):
        return path(parents[i]) + [i] if i >= 0 else []

    gen = torch.Generator().manual_seed(0)
    gathered_wrong = scattered_wrong = 0
    for context in (5, 60, 130, 200):
        slots = -(-(context + t) // chunk) * chunk
        q = torch.randn(1, heads, t, d, generator=gen)
        k, v = (torch.randn(1, kv, slots, d, generator=gen) for _ in range(2))
        visible = torch.zeros(1, t, slots, dtype=torch.bool)
        visible[:, :, :context] = True
        for i in range(t):
            visible[0, i, [context + a for a in path(i)]] = True
        order, additive = gathered_keys(visible, torch.tensor([context]), chunk, heads // kv)
        gathered = attend_gathered(q, k, v, order, additive, chunk)
        scattered = attend_chunked(q, k, v, chunked_mask(visible[:, None], heads // kv), chunk)
        for i in range(t):
            idx = list(range(context)) + [context + a for a in path(i)]
            n = -(-len(idx) // chunk) * chunk
            ka, va = (torch.zeros(1, kv, n, d) for _ in range(2))
            ka[:, :, : len(idx)], va[:, :, : len(idx)] = k[:, :, idx], v[:, :, idx]
            seen = torch.zeros(1, 1, 1, n, dtype=torch.bool)
            seen[..., : len(idx)] = True
            alone = attend_chunked(q[:, :, i : i + 1], ka, va, chunked_mask(seen, heads // kv), chunk)
            gathered_wrong += not torch.equal(alone, gathered[:, :, i : i + 1])
            scattered_wrong += not torch.equal(alone, scattered[:, :, i : i + 1])
    assert gathered_wrong == 0
    assert scattered_wrong > 0


def test_each_checkout_builds_the_native_kernels_in_its_own_folder(tmp_path):
    """The build folder's tag changes with the sources' folder as with their bytes: torch's build
    files name the sources by path, and two checkouts sharing one folder rebuilt it for each other
    (a clean clone's test run, then the background training's restart, each waited a minute, and a
    process stopped while it held the build lock left the other waiting)."""
    from blockdraft.models import native

    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        for src in [*native.SOURCES, native.HEADER]:
            (folder / src.name).write_bytes(src.read_bytes())
    files = lambda folder: [folder / p.name for p in [*native.SOURCES, native.HEADER]]  # noqa: E731
    assert native.build_tag(files(a)) != native.build_tag(files(b))
    assert native.build_tag(files(a)) == native.build_tag(files(a))
    (a / native.HEADER.name).write_text("// changed\n")
    assert native.build_tag(files(a)) != native.build_tag([*files(a)[:-1], b / native.HEADER.name])
