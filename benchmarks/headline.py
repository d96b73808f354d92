"""The README's headline table from one `blockdraft bench` run over several datasets.

    .venv/bin/python benchmarks/headline.py bench-results/cpu-xeon-eq --doc README.md

Per method: tau and the speedup over `ar` on each dataset of the run (its subfolders'
results.json), the machine and the command's settings under the table. With --doc the table
replaces what stands between the `<!-- headline -->` markers; without it, it is printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402


def table(run: Path) -> str:
    reps = {p.parent.name: json.loads(p.read_text()) for p in sorted(run.glob("*/results.json"))}
    if not reps:
        sys.exit(f"{run}: no */results.json")
    names = list(reps)
    methods = list(next(iter(reps.values()))["methods"])
    head = "| method | " + " | ".join(f"{n} τ | {n} speedup" for n in names) + " |"
    lines = [head, "|---|" + "---|---|" * len(names)]
    for m in methods:
        cells = []
        for n in names:
            r = reps[n]["methods"].get(m, {})
            tau, sp = r.get("tau"), r.get("speedup_vs_ar")
            cells += ["-" if tau is None else f"{tau:.2f}", "-" if sp is None else f"{sp:.2f}×"]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    rep = next(iter(reps.values()))
    mach = rep["machine"]
    ar = ", ".join(f"{reps[n]['methods']['ar']['tokens_per_second']:.1f}" for n in names if "ar" in reps[n]["methods"])
    lines += [
        "",
        f"{run}: {rep['num_prompts']} prompts per dataset, {rep['max_new_tokens']} new tokens, "
        f"T={rep['temperature']}, first turns {'only' if rep['first_turn_only'] else 'and later'}; "
        f"{mach['processor']}, {mach['threads']} threads, weights {mach.get('weights', mach['dtype'])}, "
        f"drafters {mach.get('draft_weights', 'float')}" + (f"; `ar` {ar} tok/s." if ar else " (no `ar` run)."),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(doctable.main(__doc__, "headline", lambda a: table(a.run), run=(None, "a bench --out folder")))
