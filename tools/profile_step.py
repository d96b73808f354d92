"""Where one decode step of the target goes, per op (profiles quoted in docs/history/measured-engine.md).

Runs `--method ar` (or another method) on one chat prompt under torch's profiler and prints,
per step: wall time, the time inside ops, op calls, and the ops sorted by self time.
The gap between wall time and op time is Python and dispatch overhead.

    python tools/profile_step.py [--method ar] [--tokens 64] [--rows 15] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from blockdraft import Engine

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="ar")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=15, help="ops to list")
    ap.add_argument("--dtype", default=None, help="weights: float32 (default) or a quantized format")
    args = ap.parse_args()
    engine = Engine.load(use_draft=args.method == "dflash", dtype=args.dtype)
    ids = engine.encode(PROMPT, chat=True)
    engine.generate(ids, method=args.method, max_new_tokens=8)  # warm-up
    plain = engine.generate(ids, method=args.method, max_new_tokens=args.tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        out = engine.generate(ids, method=args.method, max_new_tokens=args.tokens)
        wall = time.perf_counter() - t0
    steps = max(1, out.steps)
    events = [e for e in prof.key_averages() if e.key != "ProfilerStep*"]
    top = [e for e in events if not e.key.startswith("aten::") or e.self_cpu_time_total > 0]
    op_time = sum(e.self_cpu_time_total for e in events) / 1e3  # ms
    calls = sum(e.count for e in events)
    print(
        f"{torch.get_num_threads()} threads, {out.num_output_tokens} tokens in {steps} steps "
        f"(+ prefill); unprofiled run: {plain.tokens_per_second:.1f} tok/s"
    )
    print(
        f"per step: wall {wall / steps * 1e3:.2f} ms (profiled), inside ops {op_time / steps:.2f} ms, "
        f"{calls / steps:.0f} op calls"
    )
    print("| op | calls/step | ms/step | share of op time |\n|---|---|---|---|")
    for e in sorted(top, key=lambda e: -e.self_cpu_time_total)[: args.rows]:
        ms = e.self_cpu_time_total / 1e3 / steps
        print(f"| {e.key} | {e.count / steps:.1f} | {ms:.3f} | {100 * ms * steps / op_time:.1f}% |")


if __name__ == "__main__":
    main()
