"""Cross-engine oracle: llama.cpp's own DFlash running our drafter (exported to GGUF).

Runs where llama-server is built (`make llama-server`); skipped with the reason elsewhere.
On the F32 target (exactly our fp32 weights) llama-server's plain greedy output is ours, its
greedy DFlash output is its plain output token for token, and every verify step accepts as
many tokens as our decode loop's step with the same drafter. (Seeded sampling is not compared:
llama-server's speculative path draws its random numbers in another order than its plain path,
so one seed gives different, equally distributed, samples.)
"""

import pytest

from blockdraft.bench.llama_server import BUILD_HINT, LlamaServer, drafter_gguf, find_llama_server

pytestmark = pytest.mark.skipif(find_llama_server() is None, reason=BUILD_HINT)

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain in two sentences why the sky is blue.",
           "What is 17 * 23? Show your steps."]
NEW = 64


@pytest.fixture(scope="module")
def engine():
    from blockdraft import Engine

    return Engine.load(draft_weights="float")  # fp32 drafter, as the F32 GGUF drafter


@pytest.fixture(scope="module")
def servers(engine):
    from blockdraft.models.gguf import default_f32_gguf

    target = default_f32_gguf()
    drafter = drafter_gguf(engine.drafter_for("dflash").folder, target, "F32")
    block = engine.drafter_for("dflash").config.block_size
    with LlamaServer(target, threads=1) as plain, \
            LlamaServer(target, drafter=drafter, draft_max=block - 1, threads=1) as dflash:
        yield plain, dflash


def test_llama_server_plain_greedy_equals_ours(engine, servers):
    plain, _ = servers
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        ours = engine.generate(ids, method="ar", max_new_tokens=NEW)
        got, _, _, _ = plain.complete(ids, max_new_tokens=NEW)
        assert got[: len(ours.token_ids)] == ours.token_ids


def test_llama_cpp_dflash_with_our_drafter_is_lossless_and_accepts_what_our_loop_accepts(engine, servers):
    plain, dflash = servers
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

