"""The training A/B tables of docs/training.md from data/train-logs/experiments.jsonl: sampled vs
greedy answers, a Markov head vs plain DFlash, the training context, the epoch curve, hard vs
soft labels, float16 vs int8 cached features, and the same steps on more answers or on more epochs
(one row per finished run).

    .venv/bin/python benchmarks/training_ab_table.py data/train-logs/experiments.jsonl --doc docs/training.md \
        --plot docs/epoch_curve.png

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

KINDS = {
    "sampling": "answers",
    "markov": "drafter",
    "context": "sequences",
    "epochs": "arch, epochs",
    "labels": "labels, data",
    "features": "features as read, data",
    "spread": "answers x epochs, data",
}


def _f(x, digits=3):
    return "" if x is None else f"{x:.{digits}f}"


def describe(r: dict) -> str:
    kind = r.get("kind")
    if kind == "sampling":
        t = r.get("temperature")
        return (
            "(shipped, untouched)"
            if r["run"].endswith("/start")
            else ("greedy" if not t else f"T {t}")
            + (f", {r['train_samples']} answers to {r['prompts']} prompts" if "prompts" in r else "")
        )
    if kind == "markov":
        return f"Markov head rank {r['markov_rank']}" if r.get("markov_rank") else "plain DFlash"
    if kind == "context":
        return (
            f"cut at {r['max_seq_len']} tokens, {r['train_samples']} answers, {r['budget_minutes']:g} CPU "
            f"minutes, τ decode at {r['config']['eval_max_new_tokens']} tokens"
        )
    if kind == "labels":
        labels = (
            "hard (the answer's tokens)"
            if not r["distill"]
            else f"soft {r['distill']:g} ({'top ' + str(r['teacher_topk']) if r.get('teacher_topk') else 'whole'}"
            " distribution)"
        )
        answers = "greedy" if not r.get("temperature") else f"T {r['temperature']}"
        return (
            f"{labels}; {r['arch']} from scratch, {r['epochs']} epoch of {r['train_samples']} {answers} answers "
            f"({Path(r['source']).name} from {r['offset']})"
        )
    if kind == "features":
        answers = "greedy" if not r.get("temperature") else f"T {r['temperature']}"
        return (
            f"{r['feature_dtype']} cache; {r['arch']} from scratch, hard labels, {r['epochs']} epoch of "
            f"{r['train_samples']} {answers} answers ({Path(r['source']).name} from {r['offset']})"
        )
    if kind == "spread":
        answers = "greedy" if not r.get("temperature") else f"T {r['temperature']}"
        layers = f", target layers {r['target_layer_ids']}" if r.get("target_layer_ids") else ""
        for key in ("num_layers", "num_anchors"):  # --settings of the run, where given
            if r.get(key):
                layers = f", {key.removeprefix('num_')} {r[key]}{layers}"
        return (
            f"{r['arch']} from scratch, {r['train_samples']} {answers} answers x {r['epochs']:g} epoch(s), hard "
            f"labels{layers} ({Path(r['source']).name} from {r['offset']})"
        )
    return f"{r['arch']}, {r['epochs']} epoch(s) of {r['samples']} samples"


def _rows(results: Path) -> list[dict]:
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def table(results: Path) -> str:
    rows = _rows(results)
    out = []
    for kind, label in KINDS.items():
        mine = [r for r in rows if r.get("kind") == kind]
        if not mine:
            continue
        out += [
            f"**{kind}**",
            "",
            f"| run | {label} | steps | minutes | τ decode | τ teacher-forced | acc@1 | acc@2 | acc@3 | CPU, threads |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            acc = (r.get("val_acc") or []) + [None] * 3
            cells = [
                r["run"],
                describe(r),
                r.get("steps", ""),
                _f(r.get("minutes"), 1),
                _f(r.get("tau")),
                _f(r.get("tau_blocks")),
                _f(acc[0]),
                _f(acc[1]),
                _f(acc[2]),
                f"{r.get('cpu', 'not recorded')}, {r.get('threads', '')}",
            ]
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def plot_epochs(results: Path, out: Path) -> None:
    """The epoch curve: decode τ and teacher-forced acc@3 against epochs, one line per drafter kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds: dict[str, list[dict]] = {}
    for r in _rows(results):
        if r.get("kind") == "epochs":
            kinds.setdefault(r["arch"], []).append(r)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for arch, rs in sorted(kinds.items()):
        rs.sort(key=lambda r: r["epochs"])
        epochs = [r["epochs"] for r in rs]
        (line,) = left.plot(epochs, [r["tau"] for r in rs], "o-", label=arch)
        right.plot(epochs, [(r.get("val_acc") or [None] * 3)[2] for r in rs], "s-", color=line.get_color(), label=arch)
    samples = {r["samples"] for rs in kinds.values() for r in rs}
    left.set_title(f"τ in the decode loop ({', '.join(map(str, sorted(samples)))} samples)", fontsize=10)
    right.set_title("teacher-forced accuracy, draft position 3", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("epochs")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    sys.exit(
        doctable.main(
            __doc__,
            "training-ab",
            lambda a: table(a.results),
            plot=lambda a, out: plot_epochs(a.results, out),
            results=(None, "data/train-logs/experiments.jsonl"),
        )
    )
