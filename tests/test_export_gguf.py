"""`blockdraft export gguf-drafter`: the GGUF llama.cpp's DFlash loads, read back tensor by tensor."""

import pytest
import torch

from blockdraft.bench.llama_server import spec_type
from blockdraft.cli import main
from blockdraft.draft import DFlashDrafter, DraftConfig
from blockdraft.engine import shipped_drafter
from blockdraft.errors import BlockdraftError
from blockdraft.export_gguf import check_runnable, gguf_name, read_gguf_drafter
from blockdraft.models.default import gguf_path


@pytest.fixture(scope="module")
def shipped():
    return DFlashDrafter.load(shipped_drafter("dflash"))


@pytest.fixture(scope="module")
def f32_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "drafter.F32.gguf"
    assert main(["export", "gguf-drafter", "--out", str(out), "--type", "F32"]) == 0
    return (out, *read_gguf_drafter(out))


def test_every_drafter_weight_is_in_the_gguf_under_llama_cpps_name(shipped, f32_export):
    _, meta, tensors = f32_export
    state = {k: v for k, v in shipped.state_dict().items() if k != "draft_vocab"}
    assert set(tensors) == {gguf_name(k) for k in state} | {"d2t", "output.weight"}
    for name, value in state.items():
        assert torch.equal(tensors[gguf_name(name)], value.float()), name


def test_the_metadata_is_what_llama_cpps_dflash_loader_reads(shipped, f32_export):
    import gguf

    path, meta, tensors = f32_export
    cfg = shipped.config
    assert meta["general.architecture"] == "dflash"
    assert meta["dflash.block_size"] == cfg.block_size
    assert meta["dflash.target_layers"] == [i + 1 for i in cfg.target_layer_ids]  # llama.cpp counts layer inputs
    assert meta["dflash.block_count"] == cfg.num_hidden_layers
    assert meta["dflash.embedding_length"] == cfg.hidden_size
    assert (meta["dflash.attention.head_count"], meta["dflash.attention.head_count_kv"]) == (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )
    assert meta["dflash.rope.freq_base"] == cfg.rope_theta
    assert meta["tokenizer.ggml.mask_token_id"] == cfg.mask_token_id
    # the tokenizer is the target's own, token for token (llama.cpp checks that the two match)
    target = gguf.GGUFReader(str(gguf_path()))
    drafter = gguf.GGUFReader(str(path))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.model"):
        assert drafter.fields[key].contents() == target.fields[key].contents()


def test_the_draft_vocabulary_goes_as_d2t_and_the_target_heads_rows(shipped, f32_export, smol):
    _, _, tensors = f32_export
    assert torch.equal(tensors["d2t"], shipped.draft_vocab)
    head = smol.lm_head.weight  # tied: the target's embedding, our exact de-quantization of its GGUF
    assert torch.equal(tensors["output.weight"], head.detach().float()[shipped.draft_vocab])


@pytest.mark.parametrize("kind", ["F16", "Q8_0"])
def test_f16_and_q8_0_weights_round_to_their_format(shipped, tmp_path, kind):
    """F16: exactly the half-precision rounding; Q8_0: within half a quantization step of
    each 32-value block (its scale is the block's max |w| / 127, stored in fp16, whose rounding
    moves the largest value by up to 127 * 2^-11 steps)."""
    out = tmp_path / f"d.{kind}.gguf"
    assert main(["export", "gguf-drafter", "--out", str(out), "--type", kind]) == 0
    _, tensors = read_gguf_drafter(out)
    for name, value in shipped.state_dict().items():
        if name == "draft_vocab":
            continue
        got, want = tensors[gguf_name(name)], value.float()
        if want.dim() == 1:
            assert torch.equal(got, want), name  # norms stay F32
        elif kind == "F16":
            assert torch.equal(got, want.half().float()), name
        else:
            blocks = want.reshape(-1, 32)
            step = blocks.abs().amax(-1, keepdim=True) / 127
            err = (got.reshape(-1, 32) - blocks).abs()
            assert bool((err <= step * (0.5 + 127 * 2**-11) + 1e-7).all()), name


def test_what_llama_cpp_cannot_run_is_a_clear_error(shipped, tmp_path, capsys):
    cfg = DraftConfig.from_dict({**shipped.config.to_dict()})
    cfg.target_layer_ids = [1, 14, 29]  # the target's last layer: llama.cpp would need layer 30's input
    with pytest.raises(BlockdraftError, match="has no next layer"):
        check_runnable(cfg, 30)
    cfg.target_layer_ids = [1, 14, 28]
    check_runnable(cfg, 30)
    assert (
        main(
            [
                "export",
                "gguf-drafter",
                "--out",
                str(tmp_path / "x.gguf"),
                "--target-gguf",
                str(tmp_path / "missing.gguf"),
            ]
        )
        != 0
    )
    assert "target GGUF not found" in capsys.readouterr().err
    eagle = shipped_drafter("eagle3")
    assert main(["export", "gguf-drafter", str(eagle), "--out", str(tmp_path / "e.gguf"), "--default-target"]) != 0
    assert "not a DFlash drafter" in capsys.readouterr().err


def test_a_markov_head_goes_as_llama_cpps_dspark_tensors(shipped, f32_export, tmp_path):
    """A drafter with a Markov head: markov_w1 / markov_w2 under llama.cpp's names,
    `dflash.sample_from_anchor` false (the anchor slot drafts nothing), and with --full-vocab the
    draft-vocabulary rows of W2 spread over the whole vocabulary with zeros elsewhere (what
    llama.cpp's scatter would give)."""
    cfg = DraftConfig.from_dict({**shipped.config.to_dict(), "markov_rank": 32})
    torch.manual_seed(3)
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(
        {**shipped.state_dict(), **{k: v for k, v in drafter.state_dict().items() if k.startswith("markov_head.")}}
    )
    drafter.markov_head.markov_w2.weight.data.normal_()
    drafter.save(tmp_path / "markov")
    out = tmp_path / "m.gguf"
    assert (
        main(
            ["export", "gguf-drafter", str(tmp_path / "markov"), "--out", str(out), "--type", "F32", "--default-target"]
        )
        == 0
    )
    meta, tensors = read_gguf_drafter(out)
    assert spec_type(out) == "draft-dspark"
    assert spec_type(f32_export[0]) == ("draft-dspark" if shipped.config.markov_rank else "draft-dflash")
    assert meta["dflash.sample_from_anchor"] is False and meta["dflash.has_confidence_head"] is False
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    assert torch.equal(tensors["markov_w1.weight"], w1) and torch.equal(tensors["markov_w2.weight"], w2)
    assert torch.equal(tensors["d2t"], drafter.draft_vocab)
    full = tmp_path / "full.gguf"
    assert (
        main(
            [
                "export",
                "gguf-drafter",
                str(tmp_path / "markov"),
                "--out",
                str(full),
                "--type",
                "F32",
                "--default-target",
                "--full-vocab",
            ]
        )
        == 0
    )
    _, tensors = read_gguf_drafter(full)
    spread = tensors["markov_w2.weight"]
    assert spread.shape == (cfg.vocab_size, 32) and "d2t" not in tensors
    assert torch.equal(spread[drafter.draft_vocab], w2)
    outside = torch.ones(cfg.vocab_size, dtype=torch.bool)
    outside[drafter.draft_vocab] = False
    assert not spread[outside].any()
