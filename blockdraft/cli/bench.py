"""`blockdraft bench`: methods side by side."""

from __future__ import annotations

import sys

from .common import add_model_args, load_engine, window
from .generate import add_grammar_args


def cmd_bench(args) -> int:
    from ..bench.runner import bench_command

    from .generate import grammar_from

    methods = args.methods.split(",")
    grammar = grammar_from(args)
    engine = load_engine(args, methods)
    reports = bench_command(
        engine,
        dataset=args.dataset,
        prompts_file=args.prompts,
        methods=methods,
        max_samples=args.max_samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        out=args.out,
        first_turn_only=args.first_turn_only,
        repeats=args.repeats,
        check_distribution=args.check_distribution,
        gguf=args.gguf,
        llamacpp_draft=(args.llamacpp_draft_type, args.llamacpp_full_vocab),
        window=window(args),
        grammar=grammar,
    )
    for dataset, report in reports.items():
        print(f"== {dataset} ({report['num_prompts']} prompts)")
        for name, r in report["methods"].items():
            tau = f"tau {r['tau']:.2f}" if r["tau"] else "tau  -  "
            speed = f", {r['speedup_vs_ar']:.2f}x vs ar" if r.get("speedup_vs_ar") else ""
            bound = f" (bound {r['speedup_bound']:.2f}x)" if r.get("speedup_bound") else ""
            print(f"{name:14s} {tau}  {r['tokens_per_second']:6.1f} tok/s{speed}{bound}")
        for name, checks in (report.get("distribution_check") or {}).items():
            ok = all(c["same_distribution"] for c in checks)
            print(f"{name}: T>0 token distribution {'matches' if ok else 'DIFFERS from'} ar")
    if args.out:
        print(f"wrote {args.out}/report.md", file=sys.stderr)
    return 0


def register(sub, methods) -> None:
    b = sub.add_parser("bench", help="compare methods side by side (tau, tokens/s, speedup)")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="humaneval | mtbench | gsm8k | sharegpt-valid (comma-separated for several)")
    src.add_argument("--prompts", help='JSON lines {"turns": [...]}')
    b.add_argument(
        "--methods",
        default="ar,dflash",
        help="comma-separated, each NAME or NAME@B (block size): " + methods.help_text(include_peers=True),
    )
    b.add_argument("--repeats", type=int, default=1, help="runs of every prompt per method (medians, spread)")
    b.add_argument(
        "--check-distribution",
        type=int,
        default=0,
        metavar="N",
        help="with N > 0: compare the first tokens of N seeded samples per method with ar's (T=1 "
        "unless --temperature is set)",
    )
    add_grammar_args(b)
    b.add_argument("--max-samples", type=int)
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--first-turn-only", action="store_true")
    b.add_argument("--out", help="folder for results.json, report.md and plots")
    b.add_argument(
        "--llamacpp-draft-type",
        choices=["F16", "BF16", "Q8_0", "F32"],
        default="F16",
        help="llamacpp-dflash: the drafter GGUF's weight type (default F16)",
    )
    b.add_argument(
        "--llamacpp-full-vocab",
        action="store_true",
        help="llamacpp-dflash: leave the drafter's draft vocabulary out (llama.cpp scores the whole "
        "vocabulary with the target's head)",
    )
    b.add_argument(
        "--gguf",
        help="GGUF file for the llamacpp peers (default: the default target's F32 file, "
        "written once; see `blockdraft export gguf`)",
    )
    add_model_args(b)
    b.set_defaults(func=cmd_bench)
