"""The fused bf16 step (`models.native_step`) against the eager forward: for every Llama-family
variant (biases, q/k norms, a sliding window), a prefill, a verified block and a token tree give
hidden states, captured features and cached keys/values as close to the fp32 eager forward as the
eager bf16 forward's are; and it is row-independent (the speculation tests in `test_exact.py`)."""

import pytest
import torch

from blockdraft.models import exact, load_target, native, native_step

from .conftest import save_tiny_hf

pytestmark = pytest.mark.skipif(not native.available(), reason="the native step needs a CPU with AVX512-BF16")

VARIANTS = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}),
    "qwen3-qk-norm-head-16": ("qwen3", {}),
    "mistral-window": ("mistral", {"sliding_window": 6}),
    "llama-head-32": ("llama", {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1}),
}


def forwards(model, ids, capture):
    """Prefill 10 tokens, verify a block of 5, then a 4-node tree after them: (hidden, features)
    of each, and the cache."""
    cache = model.new_cache(1, 32)
    out = [model(ids[:, :10], torch.arange(10)[None], cache, capture=capture)]
    out.append(model(ids[:, 10:15], torch.arange(10, 15)[None], cache, capture=capture))
    # the tree below 15 tokens: node 0 at position 15, nodes 1 and 2 its children, node 3 a child of 2
    positions = torch.tensor([[15, 16, 16, 17]])
    slots = torch.tensor([[15, 16, 17, 18]])
    mask = torch.zeros(1, 1, 4, 19, dtype=torch.bool)
    mask[..., :15] = True
    for node, seen in enumerate(([15], [15, 16], [15, 17], [15, 17, 18])):
        mask[0, 0, node, seen] = True
    window = model.config.sliding_window
    if window:
        mask[0, 0, :, :] &= (torch.arange(19)[None] > positions[0, :, None] - window) | (torch.arange(19) >= 15)
    out.append(model(ids[:, 15:19], positions, cache, slots=slots, mask=mask, capture=capture))
    return out, cache


@pytest.mark.parametrize("shape", [(13, 70), (960, 576), (4, 32), (7, 33), (33, 1)])
def test_the_packed_product_is_row_independent_and_right(shape):
    """The fused step's products read weights packed by `native.pack` (panels of 32 outputs, pairs of
    inputs, zero-padded): for any shape a row's product is the same alone, among up to 70 rows and at
    any place among them (the check `exact` runs), with and without bias, and it is the product:
    within bf16 rounding of the fp32 one (odd shapes exercise the padded panels and the odd input)."""
    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    packed = native.pack(w)
    for bias in (None, b):
        product = lambda x, w, b: native.linear_packed(x, packed, b, n)  # noqa: E731
        assert exact._row_independent(product, w, bias)
        x = torch.randn(70, k, generator=gen).bfloat16()
        ref = x.float() @ w.float().T + (0 if bias is None else bias.float())
        torch.testing.assert_close(product(x, w, bias).float(), ref, rtol=2e-2, atol=2e-2)


def error(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_fused_step_is_as_close_to_fp32_as_the_eager_bf16_forward(tmp_path, variant):
    model_type, overrides = VARIANTS[variant]
    save_tiny_hf(model_type, tmp_path, **overrides)
    ref_model = load_target(tmp_path, dtype=torch.float32)
    eager = load_target(tmp_path, dtype=torch.bfloat16)
    fused = load_target(tmp_path, dtype=torch.bfloat16)
    assert exact.make_exact(fused)["step"] == "native"
    ids = torch.randint(0, ref_model.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(1))
    capture = (0, 2)
    with torch.inference_mode():
        ref, ref_cache = forwards(ref_model, ids, capture)
        bf, bf_cache = forwards(eager, ids, capture)
        got, got_cache = forwards(fused, ids, capture)
    for (rh, rf), (bh, bfe), (gh, gf) in zip(ref, bf, got, strict=True):
        assert gh.dtype == torch.bfloat16 and gh.shape == rh.shape and gf.shape == rf.shape
        for g, b, r in ((gh, bh, rh), (gf, bfe, rf)):
            assert error(g, r) <= max(2 * error(b, r), 4e-3), (error(g, r), error(b, r))
    used = 19
    for g, b, r in ((got_cache.k, bf_cache.k, ref_cache.k), (got_cache.v, bf_cache.v, ref_cache.v)):
        g, b, r = (t[..., :used, :] for t in (g, b, r))
        assert error(g, r) <= max(2 * error(b, r), 4e-3)


def test_the_fused_step_features_only_stops_at_the_deepest_captured_layer(tmp_path):
    save_tiny_hf("llama", tmp_path)
    model = load_target(tmp_path, dtype=torch.bfloat16)
    exact.make_exact(model)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        hidden, full = model(ids, torch.arange(6).expand(2, -1), model.new_cache(2, 8), capture=(1,))
        none, features = model(
            ids, torch.arange(6).expand(2, -1), model.new_cache(2, 8), capture=(1,), features_only=True
        )
    assert none is None and hidden.shape == (2, 6, 64) and torch.equal(features, full)


def test_the_step_is_off_where_it_does_not_apply(tmp_path, monkeypatch):
    save_tiny_hf("llama", tmp_path)
    assert native_step.unsupported(load_target(tmp_path, dtype=torch.float32)) == "bf16 on a CPU only"
    monkeypatch.setenv(native_step.ENV, "0")
    model = load_target(tmp_path, dtype=torch.bfloat16)
    assert exact.make_exact(model)["step"] == f"eager: {native_step.ENV}=0" and model.native_step is None


def test_a_bf16_drafter_scores_its_head_rows_through_the_native_kernel():
    """A bf16 drafter on this CPU scores its head rows through the native kernel (`pack_drafter`
    gives it `NativeHead`): the float head's logits, for the whole vocabulary and a draft vocabulary."""
    from blockdraft.draft import DFlashDrafter, DraftConfig
    from blockdraft.draft_head import FloatHead, NativeHead, pack_drafter
    from blockdraft.models.config import TargetConfig

    cfg = TargetConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    drafter = DFlashDrafter(DraftConfig.for_target(cfg, num_layers=1, block_size=4, mask_token_id=1)).bfloat16()
    pack_drafter(drafter)
    assert type(drafter.head) is NativeHead

    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(300, 64, generator=gen).bfloat16(), torch.randn(5, 64, generator=gen).bfloat16()
    vocab = torch.tensor([3, 1, 299, 42])
    with torch.inference_mode():
        for v in (None, vocab):
            got, ref = NativeHead().logits(x, w, v), FloatHead().logits(x.float(), w.float(), v)
            assert got.shape == ref.shape
            torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_native_argmax_is_torchs(dtype):
    """Greedy decoding's argmax (`native.argmax`): torch's answer on every row, the first of tied
    maxima included (bf16 logits tie often), a row holding a NaN included, any vocabulary size."""
    gen = torch.Generator().manual_seed(9)
    for n in (1, 15, 16, 17, 49152):
        x = (torch.randn(6, n, generator=gen) * 3).round().to(dtype)  # coarse values: many ties
        x[1] = 0.0
        if n > 2:
            x[2, n // 2] = float("nan")
            x[3, -1] = x[3].max() + 1
        assert torch.equal(native.argmax(x), x.argmax(-1))
        assert torch.equal(native.argmax(x.view(2, 3, n)), x.view(2, 3, n).argmax(-1))


def test_the_native_top_tokens_are_torchs():
    """Soft labels' top tokens (`native.top_logprobs`, bf16 logits): for every row the k largest
    logits in descending order, equal ones by increasing id, the k-th value torch's, their
    log-probabilities torch's log_softmax to fp32 rounding; rows with a NaN or an infinity and
    batched shapes as torch gives them; k above the vocabulary size clipped."""
    gen = torch.Generator().manual_seed(4)
    for n, k in ((5, 8), (17, 4), (300, 32), (49152, 32)):
        x = (torch.randn(7, n, generator=gen) * 4).bfloat16()
        x[1] = (x[1] * 0.5).round()  # coarse values: ties at the boundary
        x[2] = 0.0
        if n > 2:
            x[3, n // 2] = float("nan")
            x[4, 0] = float("inf")
        ids, logp = native.top_logprobs(x, k)
        ref_logp, ref_ids = x.float().log_softmax(-1).topk(min(k, n), dim=-1)
        assert ids.shape == ref_ids.shape == logp.shape and logp.dtype == torch.float32
        fine = torch.isfinite(x.float()).all(-1)
        assert int(fine.sum()) == (5 if n > 2 else 7)
        values = x.float().gather(1, ids)[fine]
        assert torch.equal(values, x.float().gather(1, ref_ids)[fine])  # the same values
        assert (values[:, :-1] >= values[:, 1:]).all()
        same = values[:, :-1] == values[:, 1:]
        assert (ids[fine][:, :-1][same] < ids[fine][:, 1:][same]).all()  # ties by increasing id
        torch.testing.assert_close(logp[fine], ref_logp[fine], rtol=0, atol=2e-6)
        # torch's own answer where a row is not finite
        assert torch.equal(ids[~fine], ref_ids[~fine])
        torch.testing.assert_close(logp[~fine], ref_logp[~fine], rtol=0, atol=0, equal_nan=True)
    three = x.view(7, 1, -1).expand(7, 2, -1)
    assert torch.equal(native.top_logprobs(three, 5)[0], native.top_logprobs(x, 5)[0][:, None].expand(7, 2, 5))
