"""What exact speculation costs: one target forward + logits verifying W = 1 / 4 / 8 / 16 tokens
after a 300-token context, per dtype, with and without exact mode (`blockdraft.models.exact`),
medians over interleaved rounds. docs/exactness.md shows the table.

    python benchmarks/exact_cost.py measure --out bench-results/exact-cost-NAME [--rounds 3]
    python benchmarks/exact_cost.py table bench-results/exact-cost-NAME --doc docs/exactness.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402

WIDTHS = (1, 4, 8, 16)
CONFIGS = (("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True))


def measure(args) -> None:
    from blockdraft import Engine
    from blockdraft.bench.runner import cpu_name
    from blockdraft.precision import bf16_speedup, cpu_flags

    engines = {(dt, ex): Engine.load(dtype=getattr(torch, dt), exact=ex, use_draft=False) for dt, ex in CONFIGS}
    context = 300
    times: dict[str, list[float]] = {}
    caches = {}
    with torch.inference_mode():
        for key, e in engines.items():
            caches[key] = e.target.new_cache(1, context + 32)
            e.target(torch.zeros(1, context, dtype=torch.long), torch.arange(context)[None], caches[key])
            if not e.target.attention_chunk:  # the fastest kernels measure and pack on first use
                e.target.warm_up(16)
        for _ in range(args.rounds):  # interleaved, so that drift hits every configuration alike
            for (dt, ex), e in engines.items():
                for w in WIDTHS:
                    toks = torch.randint(0, e.target.config.vocab_size, (1, w))
                    pos = torch.arange(context, context + w)[None]
                    for i in range(args.repeats + 1):
                        t = time.perf_counter()
                        h, _ = e.target(toks, pos, caches[(dt, ex)])
                        e.target.logits(h).argmax(-1)
                        if i:
                            times.setdefault(f"{dt} {'exact' if ex else 'fastest'} {w}", []).append(
                                time.perf_counter() - t)
    bandwidth = read_bandwidth()
    floor = {dt: round(weight_bytes(e.target) / bandwidth * 1e3, 3) for (dt, ex), e in engines.items() if ex}
    out = {"machine": {"processor": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "flags": cpu_flags(), "bf16_speedup": bf16_speedup(),
                       "read_gb_per_s": round(bandwidth / 1e9, 1)},
           "floor_ms": floor,
           "kernels": {f"{dt} {'exact' if ex else 'fastest'}":
                       (getattr(e.target, "exactness", None) or {}).get("kernels", {})
                       for (dt, ex), e in engines.items()},
           "context": context, "command": " ".join(sys.argv),
           "median_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()},
           "exactness": {f"{dt} {'exact' if ex else 'fastest'}": e.precision()["exact"]
                         for (dt, ex), e in engines.items()}}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1))
    print(table_of(out))


def read_bandwidth(gib: float = 1.0, runs: int = 5) -> float:
    """Bytes per second this machine reads, summing a 1 GiB tensor on every thread (median)."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def weight_bytes(model) -> int:
    """Bytes of the weights a plain step reads once (each tensor once: a tied LM head is the embedding)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def table_of(res: dict) -> str:
    m = res["machine"]
    ms = res["median_ms"]
    lines = [f"{m['processor']}, {m['threads']} threads, torch {m['torch']}, CPU flags: "
             f"{', '.join(m['flags']) or 'no amx_bf16 / avx512_bf16'} (a 16-row bf16 product at "
             f"{m['bf16_speedup']:.2f}x fp32's speed); target forward + logits after {res['context']} tokens, ms "
             "(median), and in plain steps of the same configuration", "",
             "| configuration | bit-exact | " + " | ".join(f"W = {w}" for w in WIDTHS) + " |",
             "|---|---|" + "---|" * len(WIDTHS)]
    for name, exact in res["exactness"].items():
        one = ms[f"{name} 1"]
        cells = [f"{ms[f'{name} {w}']:.1f}" + ("" if w == 1 else f" ({ms[f'{name} {w}'] / one:.2f})")
                 for w in WIDTHS]
        lines.append(f"| {name} | {'yes' if exact else 'no'} | " + " | ".join(cells) + " |")
    if res.get("floor_ms"):
        lines += ["", f"Reading the weights once at the measured {m['read_gb_per_s']} GB/s (summing 1 GiB): "
                  + ", ".join(f"{ms_:.1f} ms in {dt} (a plain exact step is {ms[f'{dt} exact 1'] / ms_:.1f}x that)"
                              for dt, ms_ in res["floor_ms"].items())
                  + ". Exact kernels: " + "; ".join(f"{k}: " + ", ".join(f"{n} {c}" for n, c in v.items())
                                                   for k, v in res["kernels"].items() if v) + "."]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "table":
        return doctable.main(__doc__, "exact-cost", lambda a: table_of(json.loads((a.results / "results.json")
                                                                                  .read_text())),
                             argv=argv[1:], results=(None, "a results folder of `exact_cost.py measure`"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["measure"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    measure(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
