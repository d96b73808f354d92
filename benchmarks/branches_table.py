"""The branches tried off a training run (`benchmarks/branch.py` records) as one table.

    .venv/bin/python benchmarks/branches_table.py data/train-logs/branches.jsonl --doc docs/wide-blocks.md

Per branch, in the file's order: the step it left the run at, its length, what it changed (the
learning rate decayed to 0, another peak rate, a wider draft vocabulary and how its added rows
started; nothing: a control), held-out tau before and after, the mean training loss of its steps
(branches from one step see the same batches) and its wall seconds a step. With --doc the table
replaces what stands between the `<!-- branches -->` markers; without it, it is printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402


def change(r: dict, base: dict) -> str:
    """What a branch changed against its run (`base`: the settings most of the file's branches share)."""
    parts = []
    if r.get("decay"):
        parts.append(f"learning rate {r['lr']:g} -> 0")
    elif r["lr"] != base["lr"]:
        parts.append(f"learning rate {r['lr']:g} (the run's {base['lr']:g})")
    if r["draft_vocab"] != base["draft_vocab"]:
        parts.append(f"draft vocabulary {r['draft_vocab']:,}, added rows at {r.get('added_rows') or '?'}")
    return "; ".join(parts) or "none (the control)"


def table(results: Path) -> str:
    if not results.is_file():
        sys.exit(f"{results}: no such file")
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    if not records:
        sys.exit(f"{results}: no branch records")
    common = lambda key: max((r[key] for r in records), key=[r[key] for r in records].count)  # noqa: E731
    base = {"lr": common("lr"), "draft_vocab": common("draft_vocab")}
    lines = [
        "| run | from step | steps | change | τ before | τ after | mean loss | s a step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        loss = f"{r['mean_loss']:.3f}" if r.get("mean_loss") is not None else "-"
        secs = f"{r['seconds_per_step']:.2f}" if r.get("seconds_per_step") is not None else "-"
        lines.append(
            f"| {Path(r['run']).name} | {r['from_step']:,} | {r['steps']} | {change(r, base)} | "
            f"{r['tau_before']:.3f} | {r['tau_after']:.3f} | {loss} | {secs} |"
        )
    e = records[-1]["eval"]
    lines.append(
        f"\nHeld-out decode τ at block {e['block']} ({e['prompts']} prompts, {e['max_new_tokens']} new tokens); "
        "the mean training loss is over a branch's logged steps, the same batches for branches from one step "
        "(over more tokens with a wider draft vocabulary)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(
        doctable.main(__doc__, "branches", lambda a: table(a.results), results=(None, "branch.py's --results file"))
    )
