"""The llama.cpp peer: the F32 GGUF holds exactly our fp32 weights, and llama.cpp on it agrees
with us (that part runs where llama-cpp-python is installed: `pip install '.[peers]'`)."""

import gguf
import numpy as np
import pytest
import torch

from blockdraft.bench import peers
from blockdraft.errors import BlockdraftError
from blockdraft.models.default import gguf_path
from blockdraft.models.gguf import default_f32_gguf


@pytest.fixture(scope="module")
def f32_file():
    return default_f32_gguf()


def test_f32_gguf_is_our_fp32_weights(f32_file, smol):
    src, out = gguf.GGUFReader(str(gguf_path())), gguf.GGUFReader(str(f32_file))
    # same metadata (tokenizer, template, hyper-parameters), file type F32
    for name, field in src.fields.items():
        if name not in ("general.file_type", "GGUF.kv_count") and not name.startswith("tokenizer.ggml.merges"):
            assert out.fields[name].contents() == field.contents(), name
    assert out.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    tensors = {t.name: t for t in out.tensors}
    assert len(tensors) == len(src.tensors) and all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in out.tensors)
    # every tensor is the de-quantization of the original...
    for t in src.tensors[:12]:
        np.testing.assert_array_equal(
            np.asarray(tensors[t.name].data), gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        )
    # ...and equal to the weights blockdraft runs (tensors llama.cpp stores unpermuted)
    layer = smol.model.layers[7]
    ours = {
        "token_embd.weight": smol.model.embed_tokens.weight,
        "blk.7.attn_v.weight": layer.self_attn.qkv_proj.weight[-192:],
        "blk.7.attn_output.weight": layer.self_attn.o_proj.weight,
        "blk.7.ffn_down.weight": layer.mlp.down_proj.weight,
        "blk.7.ffn_up.weight": layer.mlp.gate_up_proj.weight[1536:],
        "blk.7.attn_norm.weight": layer.input_layernorm.weight,
    }
    for name, weight in ours.items():
        assert torch.equal(torch.from_numpy(np.array(tensors[name].data)), weight.detach()), name


def test_missing_llamacpp_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(peers, "llamacpp_available", lambda: False)
    with pytest.raises(BlockdraftError, match=r"pip install '\.\[peers\]'"):
        peers.Peers(engine=None).check(["ar", "llamacpp-lookup"])
    peers.Peers(engine=None).check(["ar", "hf"])  # other peers do not need it


def test_the_q4_1_peer_runs_only_the_default_targets_file():
    from types import SimpleNamespace

    with pytest.raises(BlockdraftError, match="llamacpp-q4_1 runs the default target's own Q4_1 file"):
        peers.q4_1_gguf(SimpleNamespace(default_target=False))
    assert peers.q4_1_gguf(SimpleNamespace(default_target=True)).name.endswith("Q4_1.gguf")


def test_an_unbuilt_llama_server_is_one_clear_error_before_anything_runs(monkeypatch, tmp_path, capsys):
    from blockdraft.bench import llama_server
    from blockdraft.cli import main

    monkeypatch.setenv("BLOCKDRAFT_LLAMA_SERVER", str(tmp_path / "nowhere" / "llama-server"))
    assert llama_server.find_llama_server() is None
    with pytest.raises(BlockdraftError, match="make llama-server"):
        peers.Peers(engine=None).check(["ar", "llamacpp-dflash"])
    (tmp_path / "p.jsonl").write_text('{"turns": ["hi"]}\n')
    assert main(["bench", "--prompts", str(tmp_path / "p.jsonl"), "--methods", "ar,llamacpp-server"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("make llama-server" in line for line in err) and not any("Traceback" in line for line in err)


def test_a_llama_server_killed_by_an_illegal_instruction_names_the_amx_rebuild(tmp_path):
    from blockdraft.bench.llama_server import LlamaServer

    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nkill -ILL $$\n")
    fake.chmod(0o755)
    with pytest.raises(BlockdraftError, match="without AMX.*rm -rf build/llama.cpp"):
        LlamaServer(tmp_path / "target.gguf", binary=fake, start_timeout=30)


needs_llamacpp = pytest.mark.skipif(not peers.llamacpp_available(), reason="llama-cpp-python not installed")


@needs_llamacpp
def test_llamacpp_logits_match_ours(f32_file, smol, chat_ids):
    from llama_cpp import Llama

    # an F32 KV cache (llama.cpp's default is F16) so that only the kernels differ
    llm = Llama(
        model_path=str(f32_file),
        n_ctx=512,
        n_threads=torch.get_num_threads(),
        logits_all=True,
        type_k=0,
        type_v=0,
        verbose=False,
    )
    ids = chat_ids[0]
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with torch.inference_mode():
        hidden, _ = smol(torch.tensor([ids]), torch.arange(len(ids))[None])
        ours = smol.logits(hidden)[0]
    assert (theirs - ours).abs().max().item() < 1e-3 * ours.abs().max().item()
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


@needs_llamacpp
def test_llamacpp_peer_greedy_equals_ar(tmp_path):
    import json
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Write a Python function that reverses a string."]}) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "blockdraft",
            "bench",
            "--prompts",
            str(prompts),
            "--methods",
            "ar,llamacpp,llamacpp-lookup@4,llamacpp-q4_1",
            "--max-new-tokens",
            "48",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "o" / "results.json").read_text())
    methods = report["methods"]
    # the two files of one run are named, and so is the llama.cpp build that ran them
    assert report["gguf"].endswith("(F32)") and report["gguf_q4_1"].endswith("(Q4_1)")
    assert "AVX" in report["llamacpp_build"].upper()
    assert methods["llamacpp-q4_1"]["tokens_per_second"] > 0
    assert methods["llamacpp"]["tokens_per_second"] > 0 and methods["llamacpp"]["speedup_vs_ar"] > 0
    ar = methods["ar"]["prompts"][0]["token_ids"]
    assert len(ar[0]) == 48
    for name in ("llamacpp", "llamacpp-lookup@4"):
        assert methods[name]["prompts"][0]["token_ids"] == ar, name
