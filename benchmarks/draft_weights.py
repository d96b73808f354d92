"""Float (the target's dtype) vs int8 drafter weights, side by side (docs/cli.md, `--draft-weights`).

Two engines on the same target, one with float drafters and one with int8 copies
(`draft_head.quantize_drafter`); every prompt runs each method on both, in alternating
order, greedy. Prints per method and dataset: tau, the drafter's ms per step, the verify ms
per step, tokens/s (median over prompts) and the int8 / fp32 ratio of tokens/s (median
of the per-prompt ratios), and whether both gave the same tokens.

    python benchmarks/draft_weights.py [--dataset humaneval,mtbench] [--max-samples 8]
        [--max-new-tokens 256] [--methods dflash@3,dflash,eagle3@4] [--out FILE.json] [--doc FILE.md]

`--doc` also writes the table between the file's `<!-- draft-weights -->` markers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from blockdraft import Engine
from blockdraft.bench.runner import load_prompts, machine_info

from doctable import DATASET_LABELS as LABELS  # noqa: E402 (the script folder is on sys.path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="humaneval,mtbench")
    ap.add_argument("--max-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--methods", default="dflash@3,dflash,eagle3@4")
    ap.add_argument("--out", help="write the per-prompt records here (JSON)")
    ap.add_argument("--doc", type=Path, help="also write the table between this Markdown file's markers")
    args = ap.parse_args()
    engines = {"float": Engine.load(draft_weights="float"), "int8": Engine.load(draft_weights="int8")}
    methods = args.methods.split(",")
    for engine in engines.values():  # warm-up: kernels chosen and weights packed on first use
        for m in ["ar", *methods]:
            engine.generate("Hello", chat=True, method=m, max_new_tokens=8)
    print(f"machine: {machine_info(engines['float'])['processor']}, {torch.get_num_threads()} threads")
    records = []
    for name in args.dataset.split(","):
        prompts = load_prompts(name, None, args.max_samples, True)
        for i, rec in enumerate(prompts):
            ids = engines["float"].encode(rec["turns"][0], chat=True)
            for m in methods:
                order = ["float", "int8"] if i % 2 == 0 else ["int8", "float"]
                outs = {w: engines[w].generate(ids, method=m, max_new_tokens=args.max_new_tokens) for w in order}
                steps = {w: max(1, o.steps) for w, o in outs.items()}
                records.append(
                    {
                        "dataset": name,
                        "prompt": rec["id"],
                        "method": m,
                        "same_tokens": outs["float"].token_ids == outs["int8"].token_ids,
                        **{
                            f"{w}_{k}": v
                            for w, o in outs.items()
                            for k, v in (
                                ("tau", o.tau),
                                ("tok_s", o.tokens_per_second),
                                ("draft_ms", 1e3 * o.draft_seconds / steps[w]),
                                ("verify_ms", 1e3 * o.verify_seconds / steps[w]),
                            )
                        },
                    }
                )
                print(
                    f"{name} {rec['id']} {m}: tau {outs['float'].tau:.2f} / {outs['int8'].tau:.2f}, "
                    f"tok/s {outs['float'].tokens_per_second:.1f} / {outs['int8'].tokens_per_second:.1f}",
                    flush=True,
                )
    folder = getattr(engines["float"].drafter_for("dflash"), "folder", None)
    fl = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(engines["float"].weights, "float")
    lines = [
        f"{machine_info(engines['float'])['processor']}, {torch.get_num_threads()} threads, target "
        f"{engines['float'].weights}, drafter {folder.name if folder else '(unsaved)'} in {fl} and in int8, "
        f"{args.max_samples} prompts a set, {args.max_new_tokens} new tokens, greedy:",
        "",
        f"| dataset | method | τ {fl} | τ int8 | draft ms/step {fl} | int8 | verify ms/step | tok/s {fl} | "
        f"tok/s int8 | int8 / {fl} (median per prompt) | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.dataset.split(","):
        for m in methods:
            rs = [r for r in records if r["dataset"] == name and r["method"] == m]
            med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731, B023 (used in this iteration only)
            mean = lambda key: statistics.mean(r[key] for r in rs)  # noqa: E731, B023 (used in this iteration only)
            ratio = statistics.median(r["int8_tok_s"] / r["float_tok_s"] for r in rs)
            lines.append(
                f"| {LABELS.get(name, name)} | `{m}` | {mean('float_tau'):.2f} | {mean('int8_tau'):.2f} | "
                f"{med('float_draft_ms'):.1f} | {med('int8_draft_ms'):.1f} | {med('float_verify_ms'):.1f} | "
                f"{med('float_tok_s'):.2f} | {med('int8_tok_s'):.2f} | {ratio:.3f} | "
                f"{sum(r['same_tokens'] for r in rs)}/{len(rs)} |"
            )
    text = "\n".join(lines)
    print("\n" + text)
    if args.doc:
        from doctable import write_between

        write_between(args.doc, "draft-weights", text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "machine": machine_info(engines["float"]),
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "records": records,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
