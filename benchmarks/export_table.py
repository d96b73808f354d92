"""docs/scaling-out.md's export table: τ of the same drafter before and after `export drafter`.

    .venv/bin/python benchmarks/export_table.py bench-results/export-roundtrip/{shipped,exported,exported-no-head} \
        --doc docs/scaling-out.md

Each folder is one `blockdraft bench --methods dflash` run (its */results.json per dataset); the
row is named by the folder. With --doc the table replaces what stands between the
`<!-- export-table -->` markers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402

LABELS = doctable.DATASET_LABELS


def table(args) -> str:
    runs = {
        folder.name: {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.glob("*/results.json"))}
        for folder in args.folders
    }
    if not all(runs.values()):
        sys.exit(f"no */results.json in {[n for n, r in runs.items() if not r]}")
    sets = list(next(iter(runs.values())))
    first = next(iter(next(iter(runs.values())).values()))
    lines = ["| run | " + " | ".join(f"{LABELS.get(s, s)} τ" for s in sets) + " |", "|---|" + "---|" * len(sets)]
    for name, reps in runs.items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{reps[s]['methods']['dflash']['tau']:.2f}" if s in reps else "-" for s in sets)
            + " |"
        )
    m = first["machine"]
    lines += [
        "",
        f"{first['num_prompts']} prompts a set, {first['max_new_tokens']} new tokens, "
        f"T={first['temperature']}; "
        f"{m['processor']}, {m['threads']} threads, drafters {m['draft_weights']}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(doctable.main(__doc__, "export-table", table, folders=("+", "bench --out folders")))
