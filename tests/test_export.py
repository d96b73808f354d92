"""`blockdraft export drafter`: the authors' published format, nothing more, and what it changes."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from blockdraft.cli import main
from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.engine import Engine, shipped_drafter
from blockdraft.errors import BlockdraftError
from blockdraft.export import export_drafter

FIXTURE = Path(__file__).parent / "fixtures" / "dflash-drafter-config.example.json"
LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
         "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
         "post_attention_layernorm")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The shipped drafter as a plain DFlash drafter (its Markov head, if any, left out: the
    published format has none; a Markov head exports in DSpark's layout, tests/test_export_gguf.py)."""
    shipped = DFlashDrafter.load(shipped_drafter("dflash"))
    drafter = DFlashDrafter(DraftConfig.from_dict({**shipped.config.to_dict(), "markov_rank": 0}))
    drafter.load_state_dict({k: v for k, v in shipped.state_dict().items() if not k.startswith("markov_head.")})
    out = tmp_path_factory.mktemp("plain") / "plain"
    drafter.save(out)
    return out


@pytest.fixture(scope="module")
def exported(plain, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "smollm2-dflash"
    assert main(["export", "drafter", str(plain), "--out", str(out)]) == 0
    return out


def test_the_export_has_exactly_the_published_keys_and_weight_names(exported):
    config = json.loads((exported / "config.json").read_text())
    assert set(config) == set(json.loads(FIXTURE.read_text()))  # no `blockdraft` section
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert config["dtype"] == "bfloat16"
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    layers = config["num_hidden_layers"]
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight",
                     *(f"layers.{i}.{w}.weight" for i in range(layers) for w in LAYER)}
    # the source did carry the extension the export drops
    assert "draft_vocab" in DFlashDrafter.load(shipped_drafter("dflash")).state_dict()


def test_the_exported_drafter_is_lossless_and_keeps_its_acceptance(plain, exported):
    """Scoring the whole vocabulary instead of the draft vocabulary changes no output token
    (verification decides) and, measured here, not the acceptance either."""
    engine = Engine.load(draft=plain)
    prompts = ["Write a Python function that reverses a string.", "Name three primary colors.",
               "def fibonacci(n):"]
    ar = engine.generate(prompts, chat=True, method="ar", max_new_tokens=48)
    original = engine.generate(prompts, chat=True, method="dflash", max_new_tokens=48)
    engine.drafter = DFlashDrafter.load(exported)
    assert getattr(engine.drafter, "draft_vocab", None) is None  # the full vocabulary
    ours = engine.generate(prompts, chat=True, method="dflash", max_new_tokens=48)
    for a, o, x in zip(ar, original, ours):
        assert x.token_ids == a.token_ids == o.token_ids
    tau = [sum(sum(g.acceptance_lengths) for g in gens) / sum(len(g.acceptance_lengths) for g in gens)
           for gens in (original, ours)]
    assert tau[0] > 1.0 and tau[1] >= 0.9 * tau[0], tau


def test_what_the_format_cannot_carry_is_a_clear_error(tmp_path):
    from blockdraft.engine import SHIPPED_DRAFTS
    from blockdraft.models.config import TargetConfig
    from blockdraft.models.default import DEFAULT_TARGET_NAME

    target = TargetConfig.from_dict(dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2))
    cfg = DraftConfig.for_target(target, num_layers=2, mask_token_id=5)
    cfg.extra["blockdraft"] = {"context_mode": "input"}  # the ablation: context in the first layer only
    DFlashDrafter(cfg).save(tmp_path / "ablation")
    with pytest.raises(BlockdraftError, match="context_mode='input'"):
        export_drafter(tmp_path / "ablation", tmp_path / "out")
    with pytest.raises(BlockdraftError, match="not a DFlash drafter"):
        export_drafter(SHIPPED_DRAFTS[DEFAULT_TARGET_NAME, "eagle3"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_markov_head_drafter_exports_in_dspark_layout(tmp_path):
    """DSpark's names and keys (DeepSpec's config: Qwen3DSparkModel, top-level mask token and
    target layers, markov_rank, a vanilla head), sample_from_anchor false, W2's draft-vocabulary
    rows spread over the whole vocabulary."""
    shipped = DFlashDrafter.load(shipped_drafter("dflash"))
    cfg = DraftConfig.from_dict({**shipped.config.to_dict(), "markov_rank": 32})
    torch.manual_seed(4)
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict({**shipped.state_dict(), **{k: v.normal_() for k, v in drafter.state_dict().items()
                                                          if k.startswith("markov_head.")}})
    drafter.save(tmp_path / "markov")
    export_drafter(tmp_path / "markov", tmp_path / "out", torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert (config["mask_token_id"], config["target_layer_ids"]) == (cfg.mask_token_id, cfg.target_layer_ids)
    assert (config["markov_rank"], config["markov_head_type"], config["sample_from_anchor"]) == (32, "vanilla", False)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        w1, w2 = f.get_tensor("markov_head.markov_w1.weight"), f.get_tensor("markov_head.markov_w2.weight")
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= names and "draft_vocab" not in names
    assert torch.equal(w1, drafter.markov_head.markov_w1.weight)
    assert w2.shape == (cfg.vocab_size, 32) and torch.equal(w2[drafter.draft_vocab], drafter.markov_head.markov_w2.weight)
    assert int((w2 != 0).any(-1).sum()) == drafter.draft_vocab.numel()
