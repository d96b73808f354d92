"""Matrix products through the kernel measured fastest (models.packed): same numbers as
F.linear with every kernel, independent of the batch around a row, tied weights and
state-dict keys kept, repacked when weights change."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.models.packed import (
    PackedLinear,
    WeightPacks,
    available_kernels,
    kernel_choices,
    pack_linears,
    packing_available,
    unpack_linears,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no packed kernel")


@pytest.mark.parametrize("kernel", [None, "plain", "mkl", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_for_every_row_count(bias, kernel):
    if kernel is not None and kernel not in available_kernels():
        pytest.skip(f"no {kernel} kernel in this torch build")
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear.wrap(lin, sizes=(1, 3, 8, 16), min_rows=1, kernel=kernel)
    with torch.inference_mode():
        for rows in range(1, 21):
            x = torch.randn(1, rows, 96)
            torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), atol=2e-5, rtol=1e-5)
    assert set(packed.packs.buckets) == {1, 3, 8, 16}  # 17..20 rows took the ordinary path
    chosen = {k for (o, i, b, size), k in kernel_choices().items() if (o, i, b) == (200, 96, bias)}
    assert kernel is not None or chosen <= set(available_kernels()) and chosen  # measured, then kept


@pytest.mark.parametrize("kernel", ["plain", "mkl", "onednn"])
def test_a_rows_result_does_not_depend_on_the_other_rows(kernel):
    if kernel not in available_kernels():
        pytest.skip(f"no {kernel} kernel in this torch build")
    torch.manual_seed(1)
    w = torch.randn(300, 64)
    packs = WeightPacks(sizes=(8,), min_rows=1, kernel=kernel)
    x = torch.randn(8, 64)
    with torch.inference_mode():
        together = packs.linear(x, w)
        for i in range(8):  # alone (padded with zeros) and beside other random rows
            assert torch.equal(packs.linear(x[i : i + 1], w)[0], together[i])
            other = torch.randn(8, 64)
            other[3] = x[i]
            assert torch.equal(packs.linear(other[:5], w)[3], together[i])


def test_repacks_when_the_weight_changes_in_place():
    torch.manual_seed(2)
    lin = nn.Linear(32, 40, bias=False)
    packed = PackedLinear.wrap(lin, sizes=(8,), min_rows=1, kernel=available_kernels()[-1])
    x = torch.randn(6, 32)
    with torch.no_grad():
        packed(x)
        lin.weight.mul_(2)
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight), atol=2e-5, rtol=1e-5)


def test_autograd_inputs_take_the_ordinary_path():
    lin = nn.Linear(16, 8)
    packed = PackedLinear.wrap(lin, sizes=(8,), min_rows=1)
    x = torch.randn(4, 16, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and not packed.packs.packed_weights


def test_timing_a_small_weight_cycles_a_bounded_number_of_copies(monkeypatch):
    """A kernel is timed over copies of the weight that outgrow the caches, but never more than
    MEASURE_COPIES of them: a 16 x 16 weight would otherwise take 65,536 copies and as many packed
    ones, which the allocator kept (3.2 GB) after they were freed."""
    from blockdraft.models import packed

    made = []
    randn_like = torch.randn_like
    monkeypatch.setattr(torch, "randn_like", lambda t, **kw: made.append(t.shape) or randn_like(t, **kw))
    assert packed._measure(torch.randn(16, 16), None, 8) in available_kernels()
    assert len(made) == packed.MEASURE_COPIES - 1
    made.clear()
    packed._measure(torch.randn(1024, 1024), None, 8)  # 4 MiB: 16 copies fill MEASURE_BYTES
    assert len(made) == packed.MEASURE_BYTES // (1024 * 1024 * 4) - 1


def test_pack_linears_keeps_ties_and_state_dict_keys_and_unpacks():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tiny()
    keys = list(model.state_dict())
    x = torch.randn(5, 16)
    with torch.inference_mode():
        ref = model.head(model.proj(x))
    assert pack_linears(model, sizes=(8,)) == 2
    assert isinstance(model.proj, PackedLinear) and model.head.weight is model.embed.weight
    assert list(model.state_dict()) == keys
    with torch.inference_mode():
        torch.testing.assert_close(model.head(model.proj(x)), ref, atol=2e-5, rtol=1e-5)
    assert unpack_linears(model) == 2
    assert type(model.proj) is nn.Linear and model.head.weight is model.embed.weight


def test_verify_logits_of_the_default_target_match_the_unpacked_model(smol_dir):
    from blockdraft.models import load_target

    plain = load_target(smol_dir)
    packed = load_target(smol_dir)
    assert pack_linears(packed) > 0
    torch.manual_seed(3)
    ids = torch.randint(0, 49152, (1, 40))
    out = []
    for model in (plain, packed):
        cache = model.new_cache(1, 64)
        with torch.inference_mode():
            model(ids[:, :32], torch.arange(32)[None], cache)
            h, _ = model(ids[:, 32:], torch.arange(32, 40)[None], cache)  # an 8-token verify: packed path
            out.append(model.logits(h))
    torch.testing.assert_close(out[1], out[0], atol=1e-3, rtol=1e-4)
    assert torch.equal(out[1].argmax(-1), out[0].argmax(-1))


def test_warm_up_measures_every_bucket_a_server_will_use(tmp_path):
    """`Transformer.warm_up` (the scheduler calls it before serving): every packed product has
    its kernel chosen for each row bucket up to the rows asked for, so no first step at a new
    width pays for measuring and packing (the speculation policy would keep that cost)."""
    from blockdraft.models import load_target
    from blockdraft.models.packed import DEFAULT_SIZES, PackedLinear, pack_linears

    from .conftest import save_tiny_hf

    save_tiny_hf("llama", tmp_path)
    model = load_target(tmp_path)
    pack_linears(model)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert linears and not any(m.packs.buckets for m in linears)
    model.warm_up(4)
    assert all(sorted(m.packs.buckets) == [s for s in DEFAULT_SIZES if s <= 4] for m in linears)
