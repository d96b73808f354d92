"""Cross-engine oracle: llama.cpp's own DFlash running our drafter (exported to GGUF).

Runs where llama-server is built (`make llama-server`); skipped with the reason elsewhere.
On the F32 target (exactly our fp32 weights) llama-server's plain greedy output is ours, its
greedy DFlash output is its plain output token for token, and every verify step accepts as
many tokens as our decode loop's step with the same drafter. Both drafter layouts are checked:
the shipped drafter and the same drafter with its Markov head toggled (removed where it has one,
a seeded random one added where it has none), so that llama.cpp's DSpark graph (the Markov head's
greedy chain, run for a GGUF that holds `markov_w1`) and its plain DFlash path are both compared
with ours whichever is shipped. (Seeded sampling is not compared: llama-server's speculative
path draws its random numbers in another order than its plain path, so one seed gives
different, equally distributed, samples.)
"""

import json

import pytest
import torch

from blockdraft.bench.llama_server import BUILD_HINT, LlamaServer, drafter_gguf, find_llama_server
from blockdraft.draft import DFlashDrafter

from .conftest import drafter_with_markov_rank

pytestmark = pytest.mark.skipif(find_llama_server() is None, reason=BUILD_HINT)

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 * 23? Show your steps.",
]
NEW = 64


@pytest.fixture(scope="module")
def target_gguf():
    from blockdraft.models.gguf import default_f32_gguf

    return default_f32_gguf()


@pytest.fixture(scope="module")
def plain(target_gguf):
    with LlamaServer(target_gguf, threads=1) as server:
        yield server


@pytest.fixture(scope="module", params=["shipped", "markov-head-toggled"])
def pair(request, tmp_path_factory, target_gguf):
    """(our engine with the fp32 drafter, llama-server running the same drafter as an F32 GGUF)."""
    from blockdraft import Engine
    from blockdraft.engine import shipped_drafter

    folder = shipped_drafter("dflash")
    if request.param != "shipped":
        # the shipped drafter's Markov head removed, or a rank-32 one added
        rank = 0 if DFlashDrafter.load(folder).config.markov_rank else 32
        folder = drafter_with_markov_rank(folder, rank, tmp_path_factory.mktemp("drafter") / "toggled")
    # fp32 target and drafter, as the F32 GGUF files (`auto` may pick bf16 on this CPU)
    engine = Engine.load(draft=folder, draft_weights="float", dtype=torch.float32)
    block = engine.drafter_for("dflash").config.block_size
    drafter = drafter_gguf(folder, target_gguf, "F32")
    with LlamaServer(target_gguf, drafter=drafter, draft_max=block - 1, threads=1) as server:
        markov = bool(engine.drafter_for("dflash").config.markov_rank)
        assert server.cmd[server.cmd.index("--spec-type") + 1] == ("draft-dspark" if markov else "draft-dflash")
        yield engine, server


def test_llama_server_plain_greedy_equals_ours(plain):
    from blockdraft import Engine

    engine = Engine.load(use_draft=False, dtype=torch.float32)
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        ours = engine.generate(ids, method="ar", max_new_tokens=NEW)
        got, _, _, _ = plain.complete(ids, max_new_tokens=NEW)
        assert got[: len(ours.token_ids)] == ours.token_ids


def test_llama_cpp_dflash_with_our_drafter_is_lossless_and_accepts_what_our_loop_accepts(pair, plain):
    engine, dflash = pair
    block = engine.drafter_for("dflash").config.block_size
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        reference, _, _, _ = plain.complete(ids, max_new_tokens=NEW)
        got, lengths, timings, _ = dflash.complete(ids, max_new_tokens=NEW)
        assert got == reference
        ours = engine.generate(ids, method="dflash", block_size=block, max_new_tokens=NEW)
        assert ours.token_ids == got[: len(ours.token_ids)]
        assert sum(a - 1 for a in lengths) == timings["draft_n_accepted"]
        # step for step; llama.cpp's last step may be cut by n_predict where ours is cut too
        n = min(len(lengths), len(ours.acceptance_lengths)) - 1
        assert n > 5 and lengths[:n] == ours.acceptance_lengths[:n]


def test_the_bench_runs_llama_server_on_each_file_and_names_the_files_and_the_build(tmp_path):
    """One bench run holds llama.cpp's plain decoding of the F32 file and of the original Q4_1 file
    (`llamacpp-server`, `llamacpp-server-q4_1`) beside ours, each server on its own file, and the
    report names both files and the CPU features of the llama.cpp build that ran."""
    from blockdraft import Engine
    from blockdraft.bench.peers import Peers
    from blockdraft.bench.runner import bench_command

    engine = Engine.load(use_draft=False, dtype=torch.float32)
    (tmp_path / "p.jsonl").write_text(json.dumps({"turns": [PROMPTS[0]]}) + "\n")
    reports = bench_command(
        engine,
        dataset=None,
        prompts_file=str(tmp_path / "p.jsonl"),
        max_samples=None,
        methods=["ar", "llamacpp-server", "llamacpp-server-q4_1"],
        max_new_tokens=8,
        temperature=0.0,
        out=str(tmp_path / "out"),
    )
    report = next(iter(reports.values()))
    assert report["gguf"].endswith("F32.gguf (F32)") and report["gguf_q4_1"].endswith("Q4_1.gguf (Q4_1)")
    assert "AVX" in report["llama_server"]["build"]
    assert set(report["methods"]) == {"ar", "llamacpp-server", "llamacpp-server-q4_1"}
    peers = Peers(engine)
    try:
        for kind in ("llamacpp-server", "llamacpp-server-q4_1"):
            peers.generate(kind, 1, engine.encode(PROMPTS[0], chat=True), max_new_tokens=2, temperature=0.0, seed=0)
        files = sorted(runner.path.name for runner in peers._servers.values())
        assert files == ["SmolLM2-135M-Instruct.F32.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"]
    finally:
        peers.close()
