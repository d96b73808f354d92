"""The table of regenerated training data (docs/training.md): samples per folder and source.

    .venv/bin/python benchmarks/data_table.py data/regen/* --doc docs/training.md

Per folder: how its answers were made (greedy or the sampling settings, the target's
precision), then samples per prompt source, held-out ones, distinct prompts, and the share of
answers cut by the answer cap. With --doc the table replaces what stands between the
`<!-- data-table -->` markers; without it, it is printed.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402

from blockdraft.train.answers import prompt_of  # noqa: E402
from blockdraft.train.data import iter_samples  # noqa: E402


def describe(folder: Path) -> tuple[str, Counter, int, int, int, int]:
    sources, kinds = Counter(), Counter()
    valid = cut = 0
    prompts = set()
    n = 0
    for s in iter_samples(folder):
        n += 1
        sources[s.get("source") or s["id"].split("/")[0]] += 1
        valid += s["split"] == "valid"
        cut += s["finish_reason"] == "length"
        prompts.add(prompt_of(s["id"]))
        t = s.get("temperature", 0.0)
        how = (
            "greedy"
            if not t
            else f"T {t}"
            + (f", top-p {s['top_p']}" if "top_p" in s else "")
            + (f", top-k {s['top_k']}" if "top_k" in s else "")
        )
        kinds[f"{how}, {s.get('dtype', 'float32')}"] += 1
    return ", ".join(k for k, _ in kinds.most_common()), sources, n, valid, len(prompts), cut


def table(folders: list[Path]) -> str:
    rows = [(f, *describe(f)) for f in folders if f.is_dir()]
    names = sorted({s for r in rows for s in r[2]})
    lines = [
        "| folder | answers | " + " | ".join(names) + " | samples | held out | distinct prompts | cut at the cap |",
        "|---|---|" + "---|" * len(names) + "---|---|---|---|",
    ]
    total = Counter()
    for f, how, sources, n, valid, prompts, cut in rows:
        total.update(sources)
        lines.append(
            f"| {f.name} | {how} | "
            + " | ".join(f"{sources[s]:,}" for s in names)
            + f" | {n:,} | {valid:,} | {prompts:,} | {cut / max(1, n):.0%} |"
        )
    lines.append("| all | | " + " | ".join(f"{total[s]:,}" for s in names) + f" | {sum(total.values()):,} | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(doctable.main(__doc__, "data-table", lambda a: table(a.folders), folders=("+", "data folders")))
