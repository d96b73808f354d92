"""Write the llama.cpp DFlash table of docs/llamacpp.md from `blockdraft bench` results.

    .venv/bin/python benchmarks/llamacpp_table.py bench-results/llamacpp-xeon-{f16,q8_0,q8_0-full-vocab,q4_1-q8_0} \
        --costs bench-results/llamacpp-xeon-steps/costs.json --doc docs/llamacpp.md

Each folder is one `blockdraft bench` run holding `llamacpp-server` and `llamacpp-dflash@B`
methods; the table gives, per run and method, tau, tokens/s, the speedup over llama-server's
own plain decoding in the same run, the decode time per verify step and the tau at which a
step pays for itself (its time over one plain token's). --costs adds the step's parts
(`benchmarks/llamacpp_step_costs.py`: llama-bench's batch costs, the drafter pass). With --doc the table replaces what
stands between the `<!-- llamacpp-table -->` markers of that file; without it, it is printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402


def rows(folder: Path) -> list[str]:
    rep = json.loads((folder / "results.json").read_text())
    ls = rep.get("llama_server") or {}
    label = f"{ls.get('draft_type', '?')}, {ls.get('draft_vocab', '?')} vocabulary"
    out = []
    for name, r in rep["methods"].items():
        if r.get("speedup_vs_llamacpp_server") is None:
            continue
        step = 1000 * r["decode_seconds_per_step"]
        be = r.get("break_even_tau")
        out.append(
            f"| {folder.name} | {label if name != 'llamacpp-server' else '-'} | {name} | "
            f"{r['tau']:.2f} | {r['tokens_per_second']:.1f} | {r['speedup_vs_llamacpp_server']:.2f} | "
            f"{step:.1f} | {'-' if be is None else f'{be:.2f}'} |"
        )
    m = rep["machine"]
    return (
        out,
        f"{rep['dataset']}, {rep['num_prompts']} prompts, {rep['max_new_tokens']} new tokens, "
        f"T={rep['temperature']}; {m['processor']}, {m['threads']} threads; target {rep.get('gguf', '?')}",
    )


def table(folders: list[Path]) -> str:
    lines = [
        "| run | drafter GGUF | method | tau | tok/s | vs llamacpp-server | decode ms / step (plain: / token) "
        "| break-even tau |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for f in folders:
        r, note = rows(f)
        lines += r
        notes.append(f"- {f.name}: {note}")
    return "\n".join(lines + [""] + notes)


def costs_table(path: Path) -> str:
    c = json.loads(path.read_text())
    ms = c["llama_bench"]["ms"]
    plain = ms.get("tg")
    lines = [
        f"Step parts ({path}; {c['machine']['cpu']}, {c['machine']['threads']} threads, target {c['target']}, "
        f"llama-bench; drafter passes over {c['prompts']} {c['dataset']} prompts, {c['max_new_tokens']} tokens, "
        f"n_max {c['draft_max']}):",
        "",
        "| target batch | 1 (plain step, tg) | "
        + " | ".join(k for k in ("pp1", "pp2", "pp3", "pp4", "pp5") if k in ms)
        + " |",
        "|---|---|" + "---|" * sum(k in ms for k in ("pp1", "pp2", "pp3", "pp4", "pp5")),
        f"| ms | {plain:.1f} | "
        + " | ".join(f"{ms[k]:.1f}" for k in ("pp1", "pp2", "pp3", "pp4", "pp5") if k in ms)
        + " |",
        "",
        "| drafter GGUF | MiB | draft ms / step | break-even tau at n_max 2 / 3 (draft + verify over tg) |",
        "|---|---|---|---|",
    ]
    for d in c["drafters"]:
        dm = d["draft_ms_per_step"]
        be = " / ".join(f"{(dm + ms[k]) / plain:.2f}" if k in ms and dm is not None else "-" for k in ("pp3", "pp4"))
        cut = (
            f", first {d['layers']} of {d['of_layers']} layers (an untrained cut: cost only)"
            if d.get("layers", d.get("of_layers")) != d.get("of_layers")
            else ""
        )
        lines.append(
            f"| {d['weight_type']}, {d['vocab']} vocabulary{cut} | {d['bytes'] / 2**20:.1f} | "
            f"{'-' if dm is None else f'{dm:.1f}'} | {be} |"
        )
    return "\n".join(lines)


def _make(args) -> str:
    text = table(args.folders)
    return text + ("\n\n" + costs_table(args.costs[0]) if args.costs else "")


if __name__ == "__main__":
    sys.exit(
        doctable.main(
            __doc__,
            "llamacpp-table",
            _make,
            folders=("+", "bench --out folders"),
            **{"--costs": (1, "benchmarks/llamacpp_step_costs.py's output")},
        )
    )
