"""Tables and a plot from training runs' metrics.jsonl (ablations, learning curves).

    python tools/training_report.py runs/ablation-recipe runs/ablation-context-input ...
    python tools/training_report.py --curve docs/learning_curve.png runs/smol-main runs/eagle3-main

For each run: steps, sequences and tokens seen, wall time, the mean loss and
per-position accuracy over the last 20% of logged steps, and every τ measured
during training (real decode loop on held-out prompts). With --curve, plots τ
against training tokens for every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def load(run: Path) -> dict:
    """A run folder (metrics.jsonl, checkpoint/state.json) or a kept log NAME.metrics.jsonl
    (with NAME.state.json beside it)."""
    if run.is_file():
        metrics, state_file = run, run.with_name(run.name.replace(".metrics.jsonl", ".state.json"))
        run = run.with_name(run.name.replace(".metrics.jsonl", ""))
    else:
        metrics, state_file = run / "metrics.jsonl", run / "checkpoint" / "state.json"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    config = json.loads(state_file.read_text())["config"] if state_file.is_file() else {}
    tail = records[-max(1, len(records) // 5) :]
    tokens, curve = 0, []
    log_every = config.get("log_every", 1)
    for r in records:  # exact when logged; older runs: records every log_every steps, scaled
        tokens = r["tokens_seen"] if "tokens_seen" in r else tokens + r["tokens"] * log_every
        if "tau" in r:
            curve.append((r["step"], tokens, r["tau"]))
    acc = [statistics.mean(r["acc"][k] for r in tail) for k in range(len(tail[0]["acc"]))]
    return {
        "name": run.name,
        "config": config,
        "steps": records[-1]["step"],
        "sequences": records[-1]["step"] * config.get("batch_size", 0),
        "approx_tokens": tokens,
        "minutes": records[-1]["elapsed"] / 60,
        "loss": statistics.mean(r["loss"] for r in tail),
        "acc": acc,
        "curve": curve,
    }


def table(runs: list[dict]) -> str:
    lines = [
        "| run | steps | minutes | loss (last 20%) | acc@1 | acc@2 | acc@4 | τ (held-out, last eval) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        acc = r["acc"] + [float("nan")] * 4
        tau = f"{r['curve'][-1][2]:.3f}" if r["curve"] else "-"
        lines.append(
            f"| {r['name']} | {r['steps']} | {r['minutes']:.0f} | {r['loss']:.3f} | {acc[0]:.3f} | "
            f"{acc[1]:.3f} | {acc[3]:.3f} | {tau} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--curve", help="write a PNG of tau vs training tokens here")
    args = ap.parse_args(argv)
    runs = [load(Path(r)) for r in args.runs]
    print(table(runs))
    for r in runs:
        if r["curve"]:
            print(f"{r['name']}: " + ", ".join(f"step {s} ({t / 1e3:.0f}K tokens) τ {x:.3f}" for s, t, x in r["curve"]))
    if args.curve:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            if r["curve"]:
                ax.plot([t for _, t, _ in r["curve"]], [x for _, _, x in r["curve"]], marker="o", label=r["name"])
        ax.set_xlabel("training tokens (sequence tokens through the target)")
        ax.set_ylabel("τ on held-out prompts")
        ax.set_title("Learning curve")
        ax.legend()
        fig.tight_layout()
        Path(args.curve).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.curve, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
