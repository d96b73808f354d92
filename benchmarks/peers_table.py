"""Our engine beside llama.cpp in one `blockdraft bench` run (docs/llamacpp.md, "Side by side"): tokens/s
of every method, against `ar` and against llama.cpp's plain decoding of each file, with the machine,
the dtype that ran (and why), the two GGUF files and the llama.cpp build named under the table.

    .venv/bin/python benchmarks/peers_table.py bench-results/NAME --doc docs/llamacpp.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402


def table(run: Path) -> str:
    rep = json.loads((run / "results.json").read_text())
    rep = next(iter(rep.values())) if "methods" not in rep else rep
    methods = rep["methods"]
    # llama.cpp's plain decoding of each file: through llama-cpp-python, else through llama-server
    f32, q4 = (
        next((methods[k]["tokens_per_second"] for k in keys if k in methods), None)
        for keys in (("llamacpp", "llamacpp-server"), ("llamacpp-q4_1", "llamacpp-server-q4_1"))
    )
    lines = ["| method | τ | tokens/s | vs ar | vs llama.cpp F32 | vs llama.cpp Q4_1 |", "|---|---|---|---|---|---|"]
    for name, r in methods.items():
        tps = r["tokens_per_second"]
        cells = [
            name,
            f"{r['tau']:.2f}" if r.get("tau") else "",
            f"{tps:.1f}",
            f"{r['speedup_vs_ar']:.2f}x",
            f"{tps / f32:.2f}x" if f32 else "",
            f"{tps / q4:.2f}x" if q4 else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    m = rep["machine"]
    lines += [
        "",
        f"{rep['dataset']}, {rep['num_prompts']} prompts, {rep['max_new_tokens']} new tokens, greedy; "
        f"{m['processor']}, {m['threads']} threads, torch {m['torch']}, {m['weights']} "
        f"({m.get('dtype_reason', 'chosen')}; exact: {m.get('exact')}; step: {m.get('step', 'eager')}); "
        f"llama.cpp on {rep.get('gguf')} and "
        f"{rep.get('gguf_q4_1')}, build: "
        f"{rep.get('llamacpp_build') or (rep.get('llama_server') or {}).get('build', 'not recorded')}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(doctable.main(__doc__, "side-by-side", lambda a: table(a.run), run=(None, "a bench results folder")))
