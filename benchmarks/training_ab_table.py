"""The training A/B tables of docs/training.md from data/train-logs/experiments.jsonl: sampled vs
greedy answers, a Markov head vs plain DFlash, and the epoch curve (one row per finished run).

    .venv/bin/python benchmarks/training_ab_table.py data/train-logs/experiments.jsonl --doc docs/training.md

τ decode: the decode loop, greedy, on the data's first held-out prompts (`eval_prompts`, 96 new
tokens); τ teacher-forced: the held-out greedy answers' blocks (thousands, the same for every
row of a table); acc@k: teacher-forced accuracy of draft position k.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402

KINDS = {"sampling": "answers", "markov": "drafter", "epochs": "arch, epochs"}


def _f(x, digits=3):
    return "" if x is None else f"{x:.{digits}f}"


def describe(r: dict) -> str:
    kind = r.get("kind")
    if kind == "sampling":
        t = r.get("temperature")
        return "(shipped, untouched)" if r["run"].endswith("/start") else ("greedy" if not t else f"T {t}") + (
            f", {r['train_samples']} answers to {r['prompts']} prompts" if "prompts" in r else "")
    if kind == "markov":
        return f"Markov head rank {r['markov_rank']}" if r.get("markov_rank") else "plain DFlash"
    return f"{r['arch']}, {r['epochs']} epoch(s) of {r['samples']} samples"


def table(results: Path) -> str:
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    out = []
    for kind, label in KINDS.items():
        mine = [r for r in rows if r.get("kind") == kind]
        if not mine:
            continue
        out += [f"**{kind}**", "", f"| run | {label} | steps | minutes | τ decode | τ teacher-forced | acc@1 | acc@2 | "
                "acc@3 | CPU, threads |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            acc = (r.get("val_acc") or []) + [None] * 3
            cells = [r["run"], describe(r), r.get("steps", ""), _f(r.get("minutes"), 1), _f(r.get("tau")),
                     _f(r.get("tau_blocks")), _f(acc[0]), _f(acc[1]), _f(acc[2]),
                     f"{r.get('cpu', 'not recorded')}, {r.get('threads', '')}"]
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()


if __name__ == "__main__":
    sys.exit(doctable.main(__doc__, "training-ab", lambda a: table(a.results),
                           results=(None, "data/train-logs/experiments.jsonl")))
