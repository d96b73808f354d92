"""`experiments.py table`: the recipe and data-scaling tables (and the curve) from the results log."""

from __future__ import annotations

import sys


import experiment_runs as R  # noqa: E402


def cmd_table(args):
    """The recipe table (markdown) and, with --plot, the data-scaling curve, from the results file."""
    rows = R.records()
    recipe = [r for r in rows if r.get("kind") == "recipe"]
    if recipe:
        print("| run | change | steps | s/step | τ decode | τ teacher-forced | acc@1 | acc@2 | acc@4 | CE@1 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in recipe:
            change = ", ".join(f"{k} {v}" for k, v in r["change"].items()) or "(base)"
            acc, ce = r.get("val_acc") or [None] * 4, r.get("val_ce") or [None]
            cells = [
                r["run"].split("/", 1)[1],
                change,
                r["steps"],
                r.get("seconds_per_step"),
                _num(r["tau"], 3),
                _num(r.get("tau_blocks"), 3),
                _num(acc[0], 3),
                _num(acc[1], 3),
                _num(acc[3], 3),
                _num(ce[0], 2),
            ]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    served = [r for r in rows if r.get("kind") == "served"]
    if served:
        print(
            "\n| run | trained block | anchors | steps | s/step | served block | τ decode | τ teacher-forced | "
            "acc@1 | acc@2 | τ teacher-forced, trained block |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in served:
            acc = r["val_acc_served"] + [None]
            cells = [
                r["run"].split("/")[1],
                r["config"]["block_size"],
                r["config"]["num_anchors"],
                r["steps"],
                r["seconds_per_step"],
                r["served_block"],
                _num(r["tau_served"], 3),
                _num(r["tau_blocks_served"], 3),
                _num(acc[0], 3),
                _num(acc[1], 3),
                _num(r["tau_blocks"], 3),
            ]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    scaling = [r for r in rows if r.get("kind") == "scaling"]
    if scaling:
        print("\n| arch | schedule | distinct samples | epochs | steps | τ decode | τ teacher-forced | acc@1 |")
        print("|---|---|---|---|---|---|---|---|")
        for r in sorted(scaling, key=lambda r: (r["arch"], r.get("schedule", ""), r["samples"])):
            print(
                f"| {r['arch']} | {r.get('schedule', 'separate')} | {r['samples']} | {r['epochs']} | {r['steps']} | "
                f"{_num(r['tau'], 3)} | {_num(r.get('tau_blocks'), 3)} | "
                f"{_num((r.get('val_acc') or [None])[0], 3)} |"
            )
    if args.plot and scaling:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        groups = {}
        for r in scaling:
            groups.setdefault(f"{r['arch']} ({r.get('schedule', 'separate')}, {r['epochs']} epoch)", []).append(r)
        for label, rs in sorted(groups.items()):
            rs.sort(key=lambda r: r["samples"])
            (line,) = ax.plot(
                [r["samples"] for r in rs],
                [r.get("tau_blocks") or r["tau"] for r in rs],
                "o-",
                label=f"{label}: teacher-forced",
            )
            ax.plot(
                [r["samples"] for r in rs],
                [r["tau"] for r in rs],
                "s--",
                color=line.get_color(),
                label=f"{label}: decode loop",
            )
        ax.set_xscale("log")
        ax.set_xlabel("distinct training samples")
        ax.set_ylabel("τ on held-out prompts")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}", file=sys.stderr)


def _num(x, digits):
    return "" if x is None else f"{x:.{digits}f}"
