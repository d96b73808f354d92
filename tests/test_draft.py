"""The drafter: published checkpoint format, and one forward for training and decoding."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.draft_config import build_target_layer_ids
from blockdraft.errors import BlockdraftError
from blockdraft.models.config import TargetConfig

FIXTURE = Path(__file__).parent / "fixtures" / "dflash-drafter-config.example.json"

PUBLISHED_WEIGHTS = {
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    *(
        f"layers.{i}.{name}.weight"
        for i in range(2)
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ),
}


def tiny_target():
    return TargetConfig.from_dict(
        dict(
            model_type="llama",
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    )


def tiny_drafter(seed=0, block_size=8):
    torch.manual_seed(seed)
    cfg = DraftConfig.for_target(tiny_target(), num_layers=2, block_size=block_size, mask_token_id=5)
    model = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def test_target_layer_ids_follow_the_published_formula():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert build_target_layer_ids(30, 1) == [15]


def _draft_hidden(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, 9, 128, generator=g)
    block = torch.randn(1, 8, 64, generator=g)
    cache = model.new_cache(1, 32)
    return model(block, torch.arange(9, 17)[None], ctx, torch.arange(9)[None], cache=cache)


def test_save_load_round_trip_gives_identical_draft_logits(tmp_path):
    model = tiny_drafter()
    model.save(tmp_path / "d")
    loaded = DFlashDrafter.load(tmp_path / "d")
    with torch.no_grad():
        assert torch.equal(_draft_hidden(model), _draft_hidden(loaded))
    assert set(load_file(str(tmp_path / "d" / "model.safetensors"))) == PUBLISHED_WEIGHTS
    # saving over an existing checkpoint replaces it atomically and leaves nothing behind
    tiny_drafter(seed=3).save(tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


@pytest.mark.parametrize("markov, anchor", [(0, False), (8, False), (8, True)])
def test_a_drafter_folder_says_what_it_is_and_loads_back(tmp_path, markov, anchor):
    """A plain DFlash drafter is labelled DFlash (the authors' class loads all of it); one with a
    Markov head is labelled DSpark (DeepSpec's class, top-level keys, its block layout), so the
    authors' DFlash class never takes it and silently drops the head. Both load back equal."""
    torch.manual_seed(1)
    cfg = DraftConfig.for_target(
        tiny_target(), num_layers=1, block_size=4, mask_token_id=5, markov_rank=markov, sample_from_anchor=anchor
    )
    DFlashDrafter(cfg).save(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    if markov:
        assert raw["architectures"] == ["Qwen3DSparkModel"]
        assert (raw["mask_token_id"], raw["target_layer_ids"], raw["num_anchors"]) == (5, cfg.target_layer_ids, 32)
        assert raw["sample_from_anchor"] is anchor and raw["markov_rank"] == markov
    else:
        assert raw["architectures"] == ["DFlashDraftModel"] and "markov_rank" not in raw
    assert DFlashDrafter.load(tmp_path / "d").config == cfg


def test_config_has_exactly_the_published_keys(tmp_path):
    tiny_drafter().save(tmp_path / "d")
    ours = json.loads((tmp_path / "d" / "config.json").read_text())
    reference = json.loads(FIXTURE.read_text())
    assert set(ours) == set(reference)
    assert ours["architectures"] == ["DFlashDraftModel"] and ours["model_type"] == "qwen3"
    assert ours["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 5]}
    assert ours["num_target_layers"] == 8 and ours["block_size"] == 8


def test_a_checkpoint_written_by_others_loads(tmp_path):
    """The authors' config (no target_layer_ids: the formula applies) with weights named their way."""
    reference = json.loads(FIXTURE.read_text())
    cfg = DraftConfig.from_dict(reference)
    assert cfg.target_layer_ids == build_target_layer_ids(30, 5)
    assert cfg.mask_token_id == 4 and cfg.block_size == 16 and cfg.rope_theta == 100000
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(reference))
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DFlashDrafter(cfg).state_dict().items()}
    save_file({k: torch.randn(s) * 0.02 for k, s in shapes.items()}, str(folder / "model.safetensors"))
    model = DFlashDrafter.load(folder)
    assert model.config.hidden_size == 576 and len(model.layers) == 5
    model.check_target(
        TargetConfig.from_dict(
            dict(
                model_type="llama",
                vocab_size=49152,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
            )
        )
    )


def test_training_forward_with_a_mask_equals_the_cached_decode_forward():
    """Two blocks of one sequence in one masked forward == each block decoded with the cache."""
    model = tiny_drafter()
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 20, 128, generator=g)
    blocks = torch.randn(1, 16, 64, generator=g)
    anchors = [6, 13]
    positions = torch.tensor([[a + k for a in anchors for k in range(8)]])
    keys_ctx = torch.arange(20)
    mask = torch.zeros(1, 1, 16, 36, dtype=torch.bool)
    for i, a in enumerate(anchors):
        rows = slice(8 * i, 8 * i + 8)
        mask[0, 0, rows, :20] = keys_ctx < a  # context strictly before the anchor
        mask[0, 0, rows, 20 + 8 * i : 28 + 8 * i] = True  # its own block, never the other
    with torch.no_grad():
        train = model(blocks, positions, ctx, keys_ctx[None], mask=mask)
        for i, a in enumerate(anchors):
            cache = model.new_cache(1, 40)
            dec = model(
                blocks[:, 8 * i : 8 * i + 8],
                torch.arange(a, a + 8)[None],
                ctx[:, :a],
                torch.arange(a)[None],
                cache=cache,
            )
            torch.testing.assert_close(train[:, 8 * i : 8 * i + 8], dec, atol=1e-5, rtol=1e-5)


def test_incremental_context_cache_equals_full_context():
    model = tiny_drafter()
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 12, 128, generator=g)
    block = torch.randn(1, 8, 64, generator=g)
    with torch.no_grad():
        full = model(block, torch.arange(12, 20)[None], ctx, torch.arange(12)[None], cache=model.new_cache(1, 32))
        cache = model.new_cache(1, 32)
        model(block, torch.arange(7, 15)[None], ctx[:, :7], torch.arange(7)[None], cache=cache)
        # the next call brings features for positions 7..14 of which only 7..11 are committed
        junk = torch.cat([ctx[:, 7:], torch.randn(1, 3, 128)], dim=1)
        inc = model(block, torch.arange(12, 20)[None], junk, torch.arange(7, 15)[None], cache=cache)
    torch.testing.assert_close(full, inc, atol=1e-5, rtol=1e-5)


def test_a_drafter_for_another_target_is_a_clear_error():
    model = tiny_drafter()
    other = tiny_target()
    other.hidden_size, other.vocab_size = 80, 100
    with pytest.raises(BlockdraftError, match="hidden size 64 != target's 80.*vocab size 97 != target's 100"):
        model.check_target(other)


def test_not_a_drafter_folder_is_a_clear_error(tmp_path):
    with pytest.raises(BlockdraftError, match="no config.json"):
        DFlashDrafter.load(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(BlockdraftError, match="not a DFlash drafter"):
        DFlashDrafter.load(tmp_path)


def test_sliding_window_layers_round_trip_in_the_reference_fields(tmp_path):
    """A config written with the reference's fields for sliding-window drafter layers
    (`layer_types` with "sliding_attention", `sliding_window`) loads, saves back the same
    fields, and bad combinations are clear errors."""
    reference = json.loads(FIXTURE.read_text())
    n = reference["num_hidden_layers"]
    reference.update(
        layer_types=["sliding_attention"] * (n - 1) + ["full_attention"], sliding_window=2048, use_sliding_window=True
    )
    cfg = DraftConfig.from_dict(reference)
    assert [cfg.window(i) for i in range(n)] == [2048] * (n - 1) + [None]
    out = cfg.to_dict()
    for key in ("layer_types", "sliding_window", "use_sliding_window"):
        assert out[key] == reference[key], key
    assert DraftConfig.from_dict(json.loads(FIXTURE.read_text())).window(0) is None  # all full: unchanged
    model = tiny_drafter()
    cfg2 = DraftConfig.for_target(
        tiny_target(), num_layers=2, block_size=8, mask_token_id=5, sliding_window=3, full_layers=[1]
    )
    assert cfg2.layer_types == ["sliding_attention", "full_attention"]
    sliding = DFlashDrafter(cfg2).eval()
    sliding.load_state_dict(model.state_dict())
    sliding.save(tmp_path / "s")
    loaded = DFlashDrafter.load(tmp_path / "s")
    assert loaded.config.layer_types == cfg2.layer_types and loaded.config.sliding_window == 3
    with pytest.raises(BlockdraftError, match="sliding_window"):
        DraftConfig.from_dict({**reference, "sliding_window": None})
    with pytest.raises(BlockdraftError, match="layer_types"):
        DraftConfig.from_dict({**reference, "layer_types": ["sliding_attention"]})
    with pytest.raises(BlockdraftError, match="full-layers"):
        DraftConfig.for_target(tiny_target(), num_layers=2, mask_token_id=5, sliding_window=3, full_layers=[2])


def test_a_sliding_window_sees_only_the_recent_context():
    """Decoding (cached) equals the masked training forward with the window; a window wider
    than the context changes nothing; a narrow one changes the output; and the result equals a
    brute-force run in which the far context is simply absent (one query, one sliding layer)."""
    base = tiny_drafter()
    ctx_len, bs = 20, 8

    def with_window(window, full_layers=()):
        cfg = DraftConfig.for_target(
            tiny_target(),
            num_layers=2,
            block_size=bs,
            mask_token_id=5,
            sliding_window=window,
            full_layers=list(full_layers),
        )
        d = DFlashDrafter(cfg).eval()
        d.load_state_dict(base.state_dict())
        return d

    torch.manual_seed(1)
    context = torch.randn(1, ctx_len, 2 * 64)
    noise = torch.randn(1, bs, 64)
    positions = torch.arange(ctx_len, ctx_len + bs)[None]

    def cached(d):
        cache = d.new_cache(1, ctx_len + bs)
        d.write_context(cache, context, torch.arange(ctx_len)[None])
        return d(noise, positions, cache=cache)

    def trained(d):
        mask = torch.ones(1, 1, bs, ctx_len + bs, dtype=torch.bool)
        return d(noise, positions, context, torch.arange(ctx_len)[None], mask)

    with torch.no_grad():
        full = cached(base)
        wide = with_window(ctx_len + bs)
        assert torch.allclose(cached(wide), full, atol=1e-6)
        narrow = with_window(5)
        out = cached(narrow)
        assert not torch.allclose(out, full, atol=1e-3)
        torch.testing.assert_close(out, trained(narrow), atol=2e-5, rtol=1e-4)
        # brute force, one query at position 20: with window 5 it sees context positions 16..19
        # only, which is a full-attention drafter whose mask hides the rest
        mask = torch.ones(1, 1, 1, ctx_len + 1, dtype=torch.bool)
        one = narrow(noise[:, :1], positions[:, :1], context, torch.arange(ctx_len)[None], mask)
        mask[..., : ctx_len - 4] = False
        ref = base(noise[:, :1], positions[:, :1], context, torch.arange(ctx_len)[None], mask)
        torch.testing.assert_close(one, ref, atol=2e-5, rtol=1e-4)
        assert not torch.allclose(
            one,
            base(
                noise[:, :1],
                positions[:, :1],
                context,
                torch.arange(ctx_len)[None],
                torch.ones(1, 1, 1, ctx_len + 1, dtype=torch.bool),
            ),
            atol=1e-3,
        )


def test_a_bounded_draft_context_equals_hiding_all_but_the_last_w_tokens():
    """A ring cache of W slots (`new_cache(..., window=W)`), fed as the decode loop feeds it (a
    padded prefill longer than W, then verify blocks whose rejected tail is junk), gives every
    block exactly the unbounded drafter's output with the context before anchor - W masked
    out; two rows at different lengths."""
    model = tiny_drafter()
    w, bs, n = 6, 8, 48
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(2, n, 128, generator=g)  # committed context features by position
    noise = torch.randn(2, bs, 64, generator=g)
    cache = model.new_cache(2, 64, window=w)
    lengths = torch.tensor([13, 9])  # a prefill padded to 13 columns: row 1's last 4 are junk
    width = int(lengths.max())
    pre = truth[:, :width].clone()
    pre[1, 9:] = torch.randn(4, 128, generator=g)
    advances = [[1, 4, 2, 7, 3, 1, 5], [3, 1, 6, 2, 2, 4, 1]]
    checked = 0
    with torch.no_grad():
        model.write_context(cache, pre, torch.arange(width).expand(2, -1), valid=lengths)
        anchors = lengths.clone()
        for step in range(len(advances[0])):
            positions = anchors[:, None] + torch.arange(bs)
            out = model(noise, positions, cache=cache)
            for b in range(2):
                a = int(anchors[b])
                mask = torch.ones(1, 1, bs, a + bs, dtype=torch.bool)
                mask[..., : max(0, a - w)] = False
                ref = model(noise[b : b + 1], positions[b : b + 1], truth[b : b + 1, :a], torch.arange(a)[None], mask)
                torch.testing.assert_close(out[b : b + 1], ref, atol=2e-5, rtol=1e-4)
                checked += 1
            # verify a block: features at anchor .. anchor+bs-1, the tail past the accepted ones junk
            feats = truth[torch.arange(2)[:, None], positions.clamp(max=n - 1)].clone()
            new = anchors + torch.tensor([advances[0][step], advances[1][step]])
            feats[positions >= new[:, None]] = torch.randn(int((positions >= new[:, None]).sum()), 128, generator=g)
            model.write_context(cache, feats, positions, valid=new)
            anchors = new
    assert checked == 14 and int(anchors.min()) > 3 * w  # the ring wrapped several times


def test_a_bounded_cache_without_committed_lengths_takes_every_entry_as_committed():
    model = tiny_drafter()
    ctx = torch.randn(1, 9, 128, generator=torch.Generator().manual_seed(2))
    caches = [model.new_cache(1, 32, window=4) for _ in range(2)]
    with torch.no_grad():
        model.write_context(caches[0], ctx, torch.arange(9)[None])
        model.write_context(caches[1], ctx, torch.arange(9)[None], valid=torch.tensor([9]))
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].pos, caches[1].pos)
    assert sorted(caches[0].pos[0, :4].tolist()) == [5, 6, 7, 8]
