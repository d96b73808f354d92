"""`blockdraft export drafter`: the authors' published format, nothing more, and what it changes."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from blockdraft.cli import main
from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.engine import Engine, shipped_drafter
from blockdraft.errors import BlockdraftError
from blockdraft.export import export_drafter, target_embedding_and_head

from .conftest import drafter_with_markov_rank

FIXTURE = Path(__file__).parent / "fixtures" / "dflash-drafter-config.example.json"
LAYER = (
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


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The shipped drafter as a plain DFlash drafter (its Markov head, if any, left out: the
    published format has none; a Markov head exports in DSpark's layout, tested below)."""
    return drafter_with_markov_rank(shipped_drafter("dflash"), 0, tmp_path_factory.mktemp("plain") / "plain")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The shipped drafter exported in the published format (`--drop-markov-head`: its Markov head,
    if any, left out, which makes it `plain` in the published format)."""
    out = tmp_path_factory.mktemp("export") / "smollm2-dflash"
    assert main(["export", "drafter", "--drop-markov-head", "--out", str(out)]) == 0
    return out


def test_the_export_has_exactly_the_published_keys_and_weight_names(plain, exported):
    config = json.loads((exported / "config.json").read_text())
    assert set(config) == set(json.loads(FIXTURE.read_text()))  # no `blockdraft` section
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert config["dtype"] == "bfloat16"
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    layers = config["num_hidden_layers"]
    assert names == {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        *(f"layers.{i}.{w}.weight" for i in range(layers) for w in LAYER),
    }
    # the source did carry the extension the export drops, and the weights are plain's, in bf16
    assert "draft_vocab" in DFlashDrafter.load(shipped_drafter("dflash")).state_dict()
    source = DFlashDrafter.load(plain).state_dict()
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(n), source[n].bfloat16()) for n in names)


def test_the_exported_drafter_is_lossless_and_keeps_its_acceptance(plain, exported):
    """Scoring the whole vocabulary instead of the draft vocabulary changes no output token
    (verification decides) and, measured here, not the acceptance either."""
    engine = Engine.load(draft=plain)
    prompts = ["Write a Python function that reverses a string.", "Name three primary colors.", "def fibonacci(n):"]
    ar = engine.generate(prompts, chat=True, method="ar", max_new_tokens=48)
    original = engine.generate(prompts, chat=True, method="dflash", max_new_tokens=48)
    engine.drafter = DFlashDrafter.load(exported, dtype=engine.target.dtype)  # the engine's dtype (auto)
    assert getattr(engine.drafter, "draft_vocab", None) is None  # the full vocabulary
    ours = engine.generate(prompts, chat=True, method="dflash", max_new_tokens=48)
    for a, o, x in zip(ar, original, ours, strict=False):
        assert x.token_ids == a.token_ids == o.token_ids
    tau = [
        sum(sum(g.acceptance_lengths) for g in gens) / sum(len(g.acceptance_lengths) for g in gens)
        for gens in (original, ours)
    ]
    assert tau[0] > 1.0 and tau[1] >= 0.9 * tau[0], tau


def test_what_the_format_cannot_carry_is_a_clear_error(tmp_path):
    from blockdraft.engine import SHIPPED_DRAFTS
    from blockdraft.models.config import TargetConfig
    from blockdraft.models.default import DEFAULT_TARGET_NAME

    target = TargetConfig.from_dict(
        dict(
            model_type="llama",
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    cfg = DraftConfig.for_target(target, num_layers=2, mask_token_id=5)
    cfg.extra["blockdraft"] = {"context_mode": "input"}  # the ablation: context in the first layer only
    DFlashDrafter(cfg).save(tmp_path / "ablation")
    with pytest.raises(BlockdraftError, match="context_mode='input'"):
        export_drafter(tmp_path / "ablation", tmp_path / "out")
    with pytest.raises(BlockdraftError, match="not a DFlash drafter"):
        export_drafter(SHIPPED_DRAFTS[DEFAULT_TARGET_NAME, "eagle3"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_markov_head_drafter_exports_in_dspark_layout(tmp_path, capsys):
    """DSpark's names and keys (DeepSpec's config: Qwen3DSparkModel, top-level mask token and
    target layers, markov_rank, a vanilla head), sample_from_anchor false, W2's draft-vocabulary
    rows spread over the whole vocabulary."""
    drafter_with_markov_rank(shipped_drafter("dflash"), 32, tmp_path / "markov", seed=4, scale=1.0)
    drafter = DFlashDrafter.load(tmp_path / "markov")
    cfg = drafter.config
    assert (
        main(["export", "drafter", str(tmp_path / "markov"), "--out", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    )
    assert "DSpark's layout (Qwen3DSparkModel, a Markov head), float32" in capsys.readouterr().err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert (config["mask_token_id"], config["target_layer_ids"]) == (cfg.mask_token_id, cfg.target_layer_ids)
    assert (config["markov_rank"], config["markov_head_type"], config["sample_from_anchor"]) == (32, "vanilla", False)
    assert config["num_anchors"] == 32  # DeepSpec's loader asserts it
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        w1, w2 = f.get_tensor("markov_head.markov_w1.weight"), f.get_tensor("markov_head.markov_w2.weight")
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= names and "draft_vocab" not in names
    assert torch.equal(w1, drafter.markov_head.markov_w1.weight)
    assert w2.shape == (cfg.vocab_size, 32) and torch.equal(
        w2[drafter.draft_vocab], drafter.markov_head.markov_w2.weight
    )
    assert int((w2 != 0).any(-1).sum()) == drafter.draft_vocab.numel()
    # the target's embedding and LM head (tied here), which DeepSpec's loader otherwise fills at random
    from blockdraft.models.default import default_target_dir

    target = load_file(str(default_target_dir() / "model.safetensors"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), target["model.embed_tokens.weight"])
        assert torch.equal(f.get_tensor("lm_head.weight"), target["model.embed_tokens.weight"])
    with pytest.raises(BlockdraftError, match="carries the target's embedding and LM head"):
        export_drafter(tmp_path / "markov", tmp_path / "no-target")
    small = {
        "embed_tokens.weight": torch.zeros(10, cfg.hidden_size),
        "lm_head.weight": torch.zeros(10, cfg.hidden_size),
    }
    with pytest.raises(BlockdraftError, match="not the target it was made for"):
        export_drafter(tmp_path / "markov", tmp_path / "wrong-target", target=small)


def test_a_dspark_layout_folder_loads_back_and_drafts_as_the_source_did(tmp_path):
    """What `export drafter` writes for a Markov-head drafter (DSpark's layout) is a drafter folder
    blockdraft reads: the exported shipped drafter, fp32, gives the source's logits at every
    draft-vocabulary id (the rest of the vocabulary, which the source never scored, aside) and
    decodes losslessly; DSpark folders whose anchor slot drafts (its default) or with a
    confidence head are clear errors."""
    from blockdraft.models.default import default_target_dir
    from blockdraft.models import load_target

    source_dir = shipped_drafter("dflash")
    source = DFlashDrafter.load(source_dir)
    if not source.config.markov_rank:
        source_dir = drafter_with_markov_rank(source_dir, 32, tmp_path / "markov")
        source = DFlashDrafter.load(source_dir)
    export_drafter(
        source_dir, tmp_path / "dspark", torch.float32, target=target_embedding_and_head(default_target_dir())
    )
    back = DFlashDrafter.load(tmp_path / "dspark")
    assert back.config.markov_rank == source.config.markov_rank and getattr(back, "draft_vocab", None) is None
    assert (back.config.mask_token_id, back.config.target_layer_ids) == (
        source.config.mask_token_id,
        source.config.target_layer_ids,
    )
    target = load_target(default_target_dir())
    torch.manual_seed(0)
    cfg = source.config
    ctx_len, block = 12, cfg.block_size
    features = torch.randn(1, ctx_len, cfg.hidden_size * len(cfg.target_layer_ids))
    tokens = torch.randint(0, cfg.vocab_size, (1, block))
    noise = target.embed(tokens)
    positions = torch.arange(ctx_len + block).unsqueeze(0)
    with torch.no_grad():
        hs = source(noise, positions[:, ctx_len:], features, positions[:, :ctx_len])
        hb = back(noise, positions[:, ctx_len:], features, positions[:, :ctx_len])
        torch.testing.assert_close(hb, hs)
        # each block position's logits given the token the source drafted before it (the anchor before
        # the first): equal at every draft-vocabulary id, the Markov correction included
        head = target.lm_head.weight
        chain, _ = source.markov_chain(hs[:, 1:], head, tokens[:, 0])
        previous = torch.cat([tokens[:, :1], chain[:, :-1]], 1)
        base_source, base_back = source.draft_logits(hs[:, 1:], head), back.draft_logits(hb[:, 1:], head)
        for k in range(block - 1):
            torch.testing.assert_close(
                back._corrected(base_back[:, k], previous[:, k])[:, source.draft_vocab],
                source._corrected(base_source[:, k], previous[:, k]),
            )
    engine = Engine.load(draft=tmp_path / "dspark")
    prompts = ["Write a Python function that reverses a string.", "Name three primary colors."]
    ar = engine.generate(prompts, chat=True, method="ar", max_new_tokens=32)
    ours = engine.generate(prompts, chat=True, method="dflash", max_new_tokens=32)
    assert [g.token_ids for g in ours] == [g.token_ids for g in ar]

    config = json.loads((tmp_path / "dspark" / "config.json").read_text())
    # DeepSpec's own configs keep the mask token and target layers at the top level only
    (tmp_path / "dspark" / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "dflash_config"})
    )
    cfg_back = DFlashDrafter.load(tmp_path / "dspark").config
    assert (cfg_back.mask_token_id, cfg_back.target_layer_ids) == (cfg.mask_token_id, cfg.target_layer_ids)
    (tmp_path / "dspark" / "config.json").write_text(json.dumps({**config, "enable_confidence_head": True}))
    with pytest.raises(BlockdraftError, match="confidence head"):
        DFlashDrafter.load(tmp_path / "dspark")
    # the block layout: DSpark's default (the key left out) is every slot drafting
    for written, layout in [(True, True), (None, True), (False, False)]:
        raw = {k: v for k, v in config.items() if k != "sample_from_anchor"}
        if written is not None:
            raw["sample_from_anchor"] = written
        (tmp_path / "dspark" / "config.json").write_text(json.dumps(raw))
        assert DFlashDrafter.load(tmp_path / "dspark").config.sample_from_anchor is layout
