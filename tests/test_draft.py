"""The drafter: published checkpoint format, and one forward for training and decoding."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockdraft.draft import DFlashDrafter, DraftConfig, build_target_layer_ids
from blockdraft.errors import BlockdraftError
from blockdraft.models.config import TargetConfig

FIXTURE = Path(__file__).parent / "fixtures" / "dflash-drafter-config.example.json"

PUBLISHED_WEIGHTS = {
    "fc.weight", "hidden_norm.weight", "norm.weight",
    *(f"layers.{i}.{name}.weight" for i in range(2) for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "input_layernorm", "post_attention_layernorm")),
}


def tiny_target():
    return TargetConfig.from_dict(dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=256))


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
    model.check_target(TargetConfig.from_dict(dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3)))


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
        mask[0, 0, rows, 20 + 8 * i: 28 + 8 * i] = True  # its own block, never the other
    with torch.no_grad():
        train = model(blocks, positions, ctx, keys_ctx[None], mask=mask)
        for i, a in enumerate(anchors):
            cache = model.new_cache(1, 40)
            dec = model(blocks[:, 8 * i: 8 * i + 8], torch.arange(a, a + 8)[None], ctx[:, :a],
                        torch.arange(a)[None], cache=cache)
            torch.testing.assert_close(train[:, 8 * i: 8 * i + 8], dec, atol=1e-5, rtol=1e-5)


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
