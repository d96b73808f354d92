"""Two `--draft-weights` choices side by side (docs/cli.md): by default float (the target's
dtype) against int8 copies (`draft_head.quantize_drafter`); `--pair int8,bf16 --dtype float32`
sets an fp32 target's int8 drafters against bf16 ones through the native pass.

Two engines on the same target, one per choice; every prompt runs each method on both, in
alternating order, greedy. Prints per method and dataset: tau, the drafter's ms per step, the
verify ms per step, tokens/s (median over prompts) and the second / first ratio of tokens/s
(median of the per-prompt ratios), and whether both gave the same tokens.

    python benchmarks/draft_weights.py [--dataset humaneval,mtbench] [--max-samples 8]
        [--max-new-tokens 256] [--methods dflash@3,dflash,eagle3@4] [--dtype auto] [--pair float,int8]
        [--out FILE.json] [--doc FILE.md [--marker draft-weights]]

`--doc` also writes the table between the file's `<!-- MARKER -->` markers.
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
    ap.add_argument("--marker", default="draft-weights")
    ap.add_argument("--dtype", default="auto", help="the target's (as `--dtype`)")
    ap.add_argument("--pair", default="float,int8", help="two --draft-weights choices, the first the reference")
    args = ap.parse_args()
    a, b = args.pair.split(",")
    engines = {w: Engine.load(dtype=args.dtype, draft_weights=w) for w in (a, b)}
    methods = args.methods.split(",")
    for engine in engines.values():  # warm-up: kernels chosen and weights packed on first use
        for m in ["ar", *methods]:
            engine.generate("Hello", chat=True, method=m, max_new_tokens=8)
    print(f"machine: {machine_info(engines[a])['processor']}, {torch.get_num_threads()} threads")
    records = []
    for name in args.dataset.split(","):
        prompts = load_prompts(name, None, args.max_samples, True)
        for i, rec in enumerate(prompts):
            ids = engines[a].encode(rec["turns"][0], chat=True)
            for m in methods:
                order = [a, b] if i % 2 == 0 else [b, a]
                outs = {w: engines[w].generate(ids, method=m, max_new_tokens=args.max_new_tokens) for w in order}
                steps = {w: max(1, o.steps) for w, o in outs.items()}
                records.append(
                    {
                        "dataset": name,
                        "prompt": rec["id"],
                        "method": m,
                        "same_tokens": outs[a].token_ids == outs[b].token_ids,
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
                    f"{name} {rec['id']} {m}: tau {outs[a].tau:.2f} / {outs[b].tau:.2f}, "
                    f"tok/s {outs[a].tokens_per_second:.1f} / {outs[b].tokens_per_second:.1f}",
                    flush=True,
                )
    folder = getattr(engines[a].drafter_for("dflash"), "folder", None)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    la, lb = (short.get(engines[a].weights, "float") if w == "float" else w for w in (a, b))
    lines = [
        f"{machine_info(engines[a])['processor']}, {torch.get_num_threads()} threads, target "
        f"{engines[a].weights}, drafter {folder.name if folder else '(unsaved)'} in {la} and in {lb}, "
        f"{args.max_samples} prompts a set, {args.max_new_tokens} new tokens, greedy:",
        "",
        f"| dataset | method | τ {la} | τ {lb} | draft ms/step {la} | {lb} | verify ms/step | tok/s {la} | "
        f"tok/s {lb} | {lb} / {la} (median per prompt) | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.dataset.split(","):
        for m in methods:
            rs = [r for r in records if r["dataset"] == name and r["method"] == m]
            med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731, B023 (used in this iteration only)
            mean = lambda key: statistics.mean(r[key] for r in rs)  # noqa: E731, B023 (used in this iteration only)
            ratio = statistics.median(r[f"{b}_tok_s"] / r[f"{a}_tok_s"] for r in rs)
            lines.append(
                f"| {LABELS.get(name, name)} | `{m}` | {mean(f'{a}_tau'):.2f} | {mean(f'{b}_tau'):.2f} | "
                f"{med(f'{a}_draft_ms'):.1f} | {med(f'{b}_draft_ms'):.1f} | {med(f'{a}_verify_ms'):.1f} | "
                f"{med(f'{a}_tok_s'):.2f} | {med(f'{b}_tok_s'):.2f} | {ratio:.3f} | "
                f"{sum(r['same_tokens'] for r in rs)}/{len(rs)} |"
            )
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "machine": machine_info(engines[a]),
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "records": records,
                },
                f,
                indent=1,
            )
    if args.doc:
        from doctable import write_between

        write_between(args.doc, args.marker, text)


if __name__ == "__main__":
    main()
