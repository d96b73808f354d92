"""Our plain decoding against llama.cpp on the same weights, fp32 and 4-bit, side by side.

For each prompt, interleaved: blockdraft `ar` on fp32 weights, llama.cpp on the F32 GGUF
(the same fp32 weights), blockdraft `ar` with `--dtype q4_1` (the GGUF's 4-bit integers),
llama.cpp on the original Q4_1 file. Greedy, chat template, timing includes prefill,
threads = torch's. Then the cost of verifying B tokens relative to one decode step, for both
weight formats. Needs llama-cpp-python (`pip install '.[peers]'`) for the llama.cpp rows.

    python benchmarks/cpu_peers.py [--max-new-tokens 128] [--prompts 8] [--repeats 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blockdraft import Engine
from blockdraft.bench.peers import LlamaCppRunner, llamacpp_available
from blockdraft.bench.runner import load_prompts
from blockdraft.machine import cpu_name
from blockdraft.models.default import gguf_path
from blockdraft.models.gguf import default_f32_gguf


def verify_costs(engine, sizes=(1, 2, 4, 8, 16), repeats=15) -> dict[int, float]:
    """Median seconds of one cached target forward over B new tokens (logits at every position)
    after a 200-token context, relative to B = 1."""
    target = engine.target
    ctx = 200
    times = {}
    with torch.inference_mode():
        cache = target.new_cache(1, ctx + 32)
        tokens = torch.randint(100, 20000, (1, ctx + 16))
        target(tokens[:, :ctx], torch.arange(ctx)[None], cache)
        for b in sizes:
            runs = []
            for _ in range(repeats):
                pos = torch.arange(ctx, ctx + b)[None]
                t0 = time.perf_counter()
                hidden, _ = target(tokens[:, ctx : ctx + b], pos, cache)
                target.logits(hidden)
                runs.append(time.perf_counter() - t0)
            times[b] = statistics.median(runs)
    return {b: times[b] / times[1] for b in sizes} | {"step_ms": times[1] * 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8, help="first N of HumanEval and of MT-Bench (first turns)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()

    fp32 = Engine.load(use_draft=False)
    q4 = Engine.load(use_draft=False, dtype="q4_1")
    runs = {"ar fp32": (fp32, None), "ar q4_1": (q4, None)}
    if llamacpp_available():
        runs["llama.cpp F32"] = (fp32, LlamaCppRunner(fp32, default_f32_gguf()))
        runs["llama.cpp Q4_1"] = (q4, LlamaCppRunner(q4, gguf_path()))
    records = load_prompts("humaneval", None, args.prompts, True) + load_prompts("mtbench", None, args.prompts, True)

    def generate(engine, peer, ids, n):
        if peer is None:
            return engine.generate(ids, method="ar", max_new_tokens=n)
        return peer.generate(ids, max_new_tokens=n, temperature=0.0, seed=0)

    for _name, (engine, peer) in runs.items():  # warm-up
        generate(engine, peer, engine.encode("Hello", chat=True), 4)
    tps = {name: [] for name in runs}
    same = {name: 0 for name in runs}
    for _ in range(args.repeats):
        for rec in records:
            ids = fp32.encode_chat([{"role": "user", "content": rec["turns"][0]}])
            outs = {}
            for name, (engine, peer) in runs.items():
                out = generate(engine, peer, ids, args.max_new_tokens)
                tps[name].append(out.tokens_per_second)
                outs[name] = out.token_ids
            same["llama.cpp F32"] += outs.get("llama.cpp F32") == outs["ar fp32"]
            same["llama.cpp Q4_1"] += outs.get("llama.cpp Q4_1") == outs["ar q4_1"]
    n = len(records) * args.repeats
    medians = {name: statistics.median(v) for name, v in tps.items()}
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {len(records)} prompts "
        f"(HumanEval + MT-Bench first turns) x {args.repeats}, {args.max_new_tokens} new tokens, greedy"
    )
    print("| | tokens/s (median) | vs llama.cpp on the same weights |\n|---|---|---|")
    for name, value in medians.items():
        peer = {"ar fp32": "llama.cpp F32", "ar q4_1": "llama.cpp Q4_1"}.get(name)
        ratio = f"{value / medians[peer]:.2f}x" if peer in medians else ""
        print(f"| {name} | {value:.1f} | {ratio} |")
    if "llama.cpp F32" in runs:
        print(
            f"llama.cpp's greedy tokens equal ours on {same['llama.cpp F32']}/{n} prompts (F32) and "
            f"{same['llama.cpp Q4_1']}/{n} (Q4_1); llama.cpp keeps its KV cache in F16 by default"
        )
    costs = {"fp32": verify_costs(fp32), "q4_1": verify_costs(q4)}
    print(
        "\nverify cost of B tokens, in decode steps (context 200):\n| weights | step ms | "
        + " | ".join(f"B={b}" for b in (1, 2, 4, 8, 16))
        + " |\n|---|---|"
        + "---|" * 5
    )
    for name, c in costs.items():
        print(f"| {name} | {c['step_ms']:.1f} | " + " | ".join(f"{c[b]:.2f}" for b in (1, 2, 4, 8, 16)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tokens_per_second": tps,
                    "medians": medians,
                    "verify_costs": costs,
                    "machine": cpu_name(),
                    "threads": torch.get_num_threads(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
