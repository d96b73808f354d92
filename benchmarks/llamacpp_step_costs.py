"""Where a llama.cpp DFlash step goes on this CPU: target verify by batch size, drafter pass.

    .venv/bin/python benchmarks/llamacpp_step_costs.py --out bench-results/llamacpp-xeon-steps/costs.json

1. `llama-bench` (built by `make llama-server`) on the target GGUF: one plain decode step
   (tg) and a batch of 1..5 tokens (pp1..pp5), i.e. what verifying n_max + 1 tokens costs.
2. `llama-server` with our drafter at verbosity 5: its speculative statistics line gives the
   time spent drafting and the number of drafts, per drafter GGUF variant (weight type, draft
   or full vocabulary), over the same prompts, greedy.
   `--layers 1,2` adds Q8_0 drafters cut to their first 1, 2 layers (untrained cuts, for the cost of
   a shallower drafter only: their drafts are not meant to be accepted).
The step of llamacpp-dflash@B costs about draft + verify(B); it pays where tau exceeds that
over one plain step. `benchmarks/llamacpp_table.py --costs FILE` renders the result.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from blockdraft import Engine
from blockdraft.bench.llama_server import LlamaServer, drafter_gguf, find_llama_server
from blockdraft.bench.runner import load_prompts
from blockdraft.machine import cpu_name
from blockdraft.draft import DFlashDrafter
from blockdraft.models.gguf import default_f32_gguf

STATS = re.compile(
    r"#calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+).*?#mean acc len = ([\d.]+).*dur\(b,g,a\) = "
    r"([\d.]+), ([\d.]+), ([\d.]+) ms"
)


def llama_bench(binary: Path, model: Path, threads: int, repeats: int) -> dict:
    cmd = [
        str(binary),
        "-m",
        str(model),
        "-p",
        "1,2,3,4,5",
        "-n",
        "32",
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "jsonl",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0:
        print(f"llama-bench exited with {out.returncode} on {model.name} after {len(rows)} results", file=sys.stderr)
    result = {"model": model.name, "returncode": out.returncode, "ms": {}}
    for r in rows:
        key = f"pp{r['n_prompt']}" if r["n_prompt"] else "tg"
        result["ms"][key] = 1000 * (r["n_prompt"] or 1) / r["avg_ts"]
    return result


def first_layers(folder: Path, layers: int, out: Path) -> Path:
    """Drafter `folder` cut to its first `layers` layers (the rest of its weights kept), saved to `out`."""
    from blockdraft.draft import DFlashDrafter, DraftConfig

    drafter = DFlashDrafter.load(folder)
    raw = drafter.config.to_dict()
    cut = DFlashDrafter(
        DraftConfig.from_dict(
            {
                **raw,
                "num_hidden_layers": layers,
                "max_window_layers": layers,
                "layer_types": raw["layer_types"][:layers],
            }
        )
    )
    cut.load_state_dict(
        {k: v for k, v in drafter.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
    )
    cut.save(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument(
        "--draft", type=Path, help="DFlash drafter folder (default: the one shipped for the default target)"
    )
    ap.add_argument("--layers", default="", help="also time Q8_0 cuts of the drafter to these layer counts, e.g. 1,2")
    args = ap.parse_args(argv)
    server = find_llama_server()
    if server is None:
        print("llama-server is not built: make llama-server", file=sys.stderr)
        return 1
    target = default_f32_gguf()
    engine = Engine.load(use_draft=False)
    folder = args.draft or engine.drafter_for("dflash").folder
    bench = llama_bench(server.with_name("llama-bench"), target, args.threads, args.repeats)
    records = load_prompts(args.dataset, None, args.prompts, True)
    prompts = [engine.encode_chat([{"role": "user", "content": r["turns"][0]}]) for r in records]
    drafters = []
    total = DFlashDrafter.load(folder).config.num_hidden_layers
    cuts = [int(n) for n in args.layers.split(",") if n]
    if any(not 0 < n < total for n in cuts):
        ap.error(f"--layers: counts between 1 and {total - 1} (the drafter has {total})")
    variants = [
        ("F16", False, total),
        ("Q8_0", False, total),
        ("F16", True, total),
        ("Q8_0", True, total),
        *(("Q8_0", False, n) for n in cuts),
    ]
    scratch = Path(tempfile.mkdtemp(prefix="step-costs-"))
    for kind, full, layers in variants:
        source = folder if layers == total else first_layers(folder, layers, scratch / f"first-{layers}")
        gguf = drafter_gguf(source, target, kind, full)
        with LlamaServer(
            target, drafter=gguf, draft_max=args.draft_max, threads=args.threads, extra_args=("-lv", "5")
        ) as srv:
            srv.complete(prompts[0], max_new_tokens=8)  # warm-up
            for ids in prompts:
                srv.complete(ids, max_new_tokens=args.max_new_tokens)
            time.sleep(1.0)
            # the statistics are running totals, printed after each request: the last minus the warm-up's
            stats = [m for line in srv.log for m in [STATS.search(line)] if m]
        first, last = stats[0], stats[-1]
        calls = int(last.group(2)) - int(first.group(2))
        draft_ms = float(last.group(6)) - float(first.group(6))
        drafters.append(
            {
                "weight_type": kind,
                "vocab": "full" if full else "drafter's",
                "layers": layers,
                "of_layers": total,
                "drafts": calls,
                "draft_ms_per_step": draft_ms / calls if calls else None,
                "bytes": gguf.stat().st_size,
            }
        )
        print(json.dumps(drafters[-1]), flush=True)
    result = {
        "machine": {"cpu": cpu_name(), "threads": args.threads},
        "date": time.strftime("%Y-%m-%d"),
        "target": target.name,
        "drafter": str(folder),
        "draft_max": args.draft_max,
        "dataset": args.dataset,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "llama_bench": bench,
        "drafters": drafters,
    }
    shutil.rmtree(scratch, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(bench), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
