"""Measure the engine's basic costs on the default target (numbers quoted in the README).

1. Tokens/s of our autoregressive path (`--method ar`) vs HF transformers' greedy
   `generate` on the same weights, interleaved prompt by prompt, medians over prompts.
2. The cost of one target forward that verifies B = 1, 2, 3, 4, 8, 16 tokens (logits at every
   position), relative to one plain decode step (B = 1), with each matrix-product kernel
   forced (plain F.linear, MKL's packed sgemm, oneDNN) and with the default, the fastest
   kernel measured per weight shape and row count (`blockdraft.models.packed`).

    python benchmarks/engine_costs.py [--max-new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from blockdraft import Engine
from blockdraft.models.packed import available_kernels, kernel_choices, pack_linears, unpack_linears

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain how a bicycle works.",
    "Give me a recipe for pancakes.",
    "What are the main causes of inflation?",
    "Write a short story about a robot learning to paint.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    engine = Engine.load(use_draft=False)
    hf = AutoModelForCausalLM.from_pretrained(engine.target_name, dtype=torch.float32).eval()
    n = args.max_new_tokens
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )

    ours_tps, hf_tps = [], []
    engine.generate("warm up", max_new_tokens=4, method="ar")
    hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=2)
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            ids = engine.encode(prompt, chat=True)
            out = engine.generate(ids, method="ar", max_new_tokens=n)
            ours_tps.append(out.tokens_per_second)
            t = time.perf_counter()
            with torch.inference_mode():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
            dt = time.perf_counter() - t
            hf_new = ref.shape[1] - len(ids)
            hf_tps.append(hf_new / dt)
            assert ref[0, len(ids) :].tolist() == out.token_ids, "ar output differs from HF greedy"
    o, h = statistics.median(ours_tps), statistics.median(hf_tps)
    print(f"tokens/s, median over {len(ours_tps)} generations of up to {n} tokens:")
    print(f"  blockdraft ar : {o:6.2f}")
    print(f"  HF generate   : {h:6.2f}")
    print(f"  ratio         : {o / h:6.2f}x")

    target = engine.target
    prompt = engine.encode(PROMPTS[0] * 4, chat=True)
    cache = target.new_cache(1, len(prompt) + 64)
    blocks = (1, 2, 3, 4, 8, 16)
    kernels = {"plain": "plain", **{k: k for k in available_kernels() if k != "plain"}, "auto": None}
    times = {}
    with torch.inference_mode():
        target(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
        for _ in range(3):  # interleave block sizes and kernels so drift hits all alike
            for name, kernel in kernels.items():
                unpack_linears(target)
                pack_linears(target, kernel=kernel)
                for b in blocks:
                    toks = torch.randint(0, 49152, (1, b))
                    pos = torch.arange(len(prompt), len(prompt) + b)[None]
                    for i in range(8):
                        t = time.perf_counter()
                        h, _ = target(toks, pos, cache)
                        target.logits(h).argmax(-1)
                        if i:  # the first run of a kernel packs (and "auto" measures) its weights
                            times.setdefault((name, b), []).append(time.perf_counter() - t)
    base = statistics.median(times[("plain", 1)])
    print(
        f"verify cost (prompt {len(prompt)} tokens), median of {len(times[('plain', 1)])}, relative to one "
        f"decode step with plain F.linear ({base * 1e3:.1f} ms); auto = the default, the fastest kernel "
        "measured per weight shape and row count:"
    )
    print("  B  | " + " | ".join(f"{name:>7}" for name in kernels))
    for b in blocks:
        print(f"  {b:2d} | " + " | ".join(f"{statistics.median(times[(name, b)]) / base:6.2f}x" for name in kernels))
    print(
        "kernels chosen by auto (out, in, bias, rows): "
        + ", ".join(f"{o}x{i}@{r}: {k}" for (o, i, _, r), k in sorted(kernel_choices().items()))
    )


if __name__ == "__main__":
    main()
