"""Load test of `blockdraft serve` on loopback: throughput and latency per method and concurrency.

    .venv/bin/python benchmarks/load_test.py                       # dflash adaptive vs fixed vs ar
    .venv/bin/python benchmarks/load_test.py --concurrency 1,4 --requests 8 --max-tokens 64
    .venv/bin/python benchmarks/load_test.py --table-from bench-results/load-test/load_test.json \
        --doc docs/history/measured-benchmarks.md

For each server configuration a fresh server process is started on 127.0.0.1 and
the same MT-Bench first-turn prompts are sent by `c` concurrent streaming clients
(bounded: `--requests` per level). Reports output tokens/s over the level's wall
time, median / p90 request latency, median time to first token and the mean time
per output token; writes JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402

from blockdraft.machine import cpu_name  # noqa: E402
from blockdraft.datasets import mtbench  # noqa: E402
from blockdraft.serve.client import ServerProcess, stream_chat  # noqa: E402

CONFIGS = {
    "dflash-adaptive": ["--method", "dflash", "--speculation", "adaptive"],
    "dflash-fixed": ["--method", "dflash", "--speculation", "fixed"],
    "ar": ["--method", "ar"],
}


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    results, lock, jobs = [], threading.Lock(), list(enumerate(prompts))

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                _i, prompt = jobs.pop(0)
            r = stream_chat(url, [{"role": "user", "content": prompt}], max_tokens=max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200 and r["done"]]
    tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    tpot = [
        (r["latency"] - r["ttft"]) / (r["usage"]["completion_tokens"] - 1)
        for r in ok
        if "ttft" in r and r["usage"]["completion_tokens"] > 1
    ]
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "completed": len(ok),
        "output_tokens": tokens,
        "wall_seconds": wall,
        "output_tokens_per_second": tokens / wall,
        "latency_p50": statistics.median(r["latency"] for r in ok),
        "latency_p90": percentile([r["latency"] for r in ok], 0.9),
        "ttft_p50": statistics.median(r["ttft"] for r in ok if "ttft" in r),
        "tpot_mean": statistics.mean(tpot) if tpot else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated from {', '.join(CONFIGS)}")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(8, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--draft", help="drafter folder (default: the shipped one)")
    p.add_argument("--out", default="bench-results/load-test", help="folder for load_test.json and .md")
    p.add_argument("--table-from", type=Path, help="no run: the table of this load_test.json")
    p.add_argument("--doc", type=Path, help="also write the table between the file's <!-- load-test --> markers")
    args = p.parse_args(argv)
    if args.table_from is not None:
        text = table(json.loads(args.table_from.read_text()))
        if args.doc is not None:
            doctable.write_between(args.doc, "load-test", text)
        print(text)
        return 0

    questions = [q["turns"][0] for q in mtbench()]
    levels = [int(c) for c in args.concurrency.split(",")]
    report = {
        "machine": {"platform": platform.platform(), "processor": cpu_name(), "python": sys.version.split()[0]},
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
        "results": {},
    }
    for name in args.configs.split(","):
        extra = CONFIGS[name] + (["--draft", args.draft] if args.draft and name != "ar" else [])
        with ServerProcess(
            *extra, "--max-batch", str(args.max_batch), "--max-queue", "256", "--max-tokens", str(args.max_tokens)
        ) as server:
            stream_chat(server.url, [{"role": "user", "content": "Hello!"}], max_tokens=8)  # warm-up
            rows = []
            for c in levels:
                n = args.requests or max(8, 2 * c)
                prompts = [questions[i % len(questions)] for i in range(n)]
                row = run_level(server.url, prompts, c, args.max_tokens)
                rows.append(row)
                print(
                    f"{name:16s} c={c:3d}: {row['output_tokens_per_second']:7.1f} tok/s, latency p50 "
                    f"{row['latency_p50']:.2f} s p90 {row['latency_p90']:.2f} s, ttft p50 {row['ttft_p50']:.2f} s",
                    file=sys.stderr,
                )
            report["results"][name] = rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_test.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(report)
    (out / "load_test.md").write_text(text + "\n")
    if args.doc is not None:
        doctable.write_between(args.doc, "load-test", text)
    print(text)
    return 0


def table(report: dict) -> str:
    """The Markdown table of a load_test.json, with ratios to `ar` at the same concurrency."""
    ar = {r["concurrency"]: r["output_tokens_per_second"] for r in report["results"].get("ar", [])}
    lines = [
        f"{report['machine']['processor']}, {report['max_tokens']} new tokens, --max-batch {report['max_batch']}:",
        "",
        "| server | concurrency | output tok/s | vs ar | latency p50 (s) | latency p90 (s) | "
        "TTFT p50 (s) | TPOT (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in report["results"].items():
        for r in rows:
            tpot = f"{1000 * r['tpot_mean']:.0f}" if r["tpot_mean"] else "-"
            base = ar.get(r["concurrency"])
            ratio = f"{r['output_tokens_per_second'] / base:.2f}×" if base else "-"
            lines.append(
                f"| {name} | {r['concurrency']} | {r['output_tokens_per_second']:.1f} | {ratio} | "
                f"{r['latency_p50']:.2f} | {r['latency_p90']:.2f} | {r['ttft_p50']:.2f} | {tpot} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
