"""The wide-block A/B table of docs/training.md from the runs' metrics logs: held-out decode τ at block
16 at each evaluation, and the teacher-forced accuracy of draft positions 1, 4, 8 and 15 over the last
100 steps' logged records (`tools/wide_block_job.sh` writes the logs).

    .venv/bin/python benchmarks/wide_block_table.py data/train-logs/ab16-*.metrics.jsonl --doc docs/training.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402

POSITIONS = (1, 4, 8, 15)


def table(logs: list[Path]) -> str:
    rows = []
    steps = set()
    for log in logs:
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        taus = {r["step"]: r["tau"] for r in records if "tau" in r}
        steps |= set(taus)
        last = records[-1]
        tail = [r for r in records if "acc" in r and r["step"] > last["step"] - 100]
        rows.append((log.name.removesuffix(".metrics.jsonl"), taus, last, tail))
    steps = sorted(steps)
    head = ["run"] + [f"τ @ {s}" for s in steps] + ["steps"] + [f"acc@{k}" for k in POSITIONS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, taus, last, tail in rows:
        acc = [sum(r["acc"][i] for r in tail) / len(tail) for i in range(len(tail[0]["acc"]))] if tail else []
        cells = [name] + [f"{taus[s]:.3f}" if s in taus else "" for s in steps] + [str(last["step"])]
        cells += [f"{acc[k - 1]:.3f}" if len(acc) >= k else "" for k in POSITIONS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(
        doctable.main(__doc__, "wide-block", lambda a: table(a.logs), logs=("+", "metrics logs of the A/B's runs"))
    )
