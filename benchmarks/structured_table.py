"""docs/structured.md's table: the same prompts benched with and without a JSON schema, one run each.

    .venv/bin/python benchmarks/structured_table.py bench-results/structured-schema-NAME \\
        bench-results/structured-free-NAME --doc docs/structured.md

Per method: tau and tokens/s (medians over the repeats) under the schema and without it, the
speedup over `ar` under the schema, and the share of the decode time the grammar took (masks,
draft constraints, matcher moves), with the machine and the settings under the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402


def table(schema_run: Path, free_run: Path) -> str:
    schema, free = (json.loads((run / "results.json").read_text()) for run in (schema_run, free_run))
    if "grammar" not in schema or "grammar" in free:
        sys.exit("give the run with a grammar first, then the run without one")
    lines = [
        "| method | τ with schema | τ free | tok/s with schema | tok/s free | speedup with schema "
        "| grammar's share of decode |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in schema["methods"].items():
        f = free["methods"].get(name, {})
        share = r["grammar_seconds"] / r["decode_seconds"] if r.get("decode_seconds") else 0.0
        lines.append(
            f"| `{name}` | {r['tau']:.2f} | {f.get('tau', 0):.2f} | {r['tokens_per_second_median']:.1f} "
            f"| {f.get('tokens_per_second_median', 0):.1f} | {r['speedup_vs_ar']:.2f}× | {share:.1%} |"
        )
    mach = schema["machine"]
    lines += [
        "",
        f"{schema_run} and {free_run}: {schema['num_prompts']} prompts, up to {schema['max_new_tokens']} "
        f"new tokens, greedy, {schema['repeats']} repeats (medians); {mach['processor']}, "
        f"{mach['threads']} threads, target in {mach.get('weights', mach['dtype'])}; grammar "
        f"{schema['grammar']['kind']}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(
        doctable.main(
            __doc__,
            "structured",
            lambda a: table(a.schema_run, a.free_run),
            schema_run=(None, "a bench --out folder run with --json-schema"),
            free_run=(None, "the same bench without it"),
        )
    )
