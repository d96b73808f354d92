"""Markdown report and PNG plots of `blockdraft bench` results."""

from __future__ import annotations

from pathlib import Path


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def markdown(reports: dict) -> str:
    lines = []
    for name, rep in reports.items():
        m0 = rep["machine"]
        lines += [
            f"### {name}: {rep['num_prompts']} prompts, {rep['max_new_tokens']} new tokens, "
            f"T={rep['temperature']}, {rep['repeats']} repeat(s)",
            "",
            f"Machine: {m0['processor']}, {m0['threads']} threads, {m0['device']}, weights "
            f"{m0.get('weights', m0['dtype'])}, drafters {m0.get('draft_weights', 'float')}, torch {m0['torch']}"
            + (f", GGUF for llamacpp: {rep['gguf']}" if rep.get("gguf") else "")
            + ".",
            "",
            "| method | block | tau | tok/s | speedup vs ar (min-max over repeats) | "
            "bound tau*t_step/(t_draft+t_verify)"
            " | draft ms/step | verify ms/step | prefill / draft / verify / other (s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for method, r in rep["methods"].items():
            spread = r.get("speedup_vs_ar_repeats") or []
            spread_txt = f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else ""
            sps = r.get("seconds_per_step")
            split = (
                f"{r['prefill_seconds']:.1f} / {r['draft_seconds']:.1f} / {r['verify_seconds']:.1f} / "
                f"{r['other_seconds']:.1f}"
                if r.get("other_seconds") is not None
                else "-"
            )
            lines.append(
                f"| {method} | {r['block_size']} | {_fmt(r['tau'])} | {r['tokens_per_second']:.1f} | "
                f"{_fmt(r.get('speedup_vs_ar'))}{spread_txt} | {_fmt(r.get('speedup_bound'))} | "
                f"{_fmt(sps and 1000 * sps['draft'], '.1f')} | {_fmt(sps and 1000 * sps['verify'], '.1f')} | {split} |"
            )
        lines.append("")
        lines += repetition_lines(rep["methods"])
        server = {m: r for m, r in rep["methods"].items() if r.get("speedup_vs_llamacpp_server") is not None}
        if server:
            ls = rep.get("llama_server") or {}
            lines += [
                f"llama-server ({ls.get('version', '')}; drafter GGUF {ls.get('draft_type', '?')}, "
                f"{ls.get('draft_vocab', '?')} vocabulary), against its own plain decoding:",
                "",
                "| method | tau | tok/s | speedup vs llamacpp-server | decode ms per step (plain: per token) "
                "| break-even tau |",
                "|---|---|---|---|---|---|",
            ]
            for m, r in server.items():
                lines.append(
                    f"| {m} | {_fmt(r['tau'])} | {r['tokens_per_second']:.1f} | "
                    f"{r['speedup_vs_llamacpp_server']:.2f} | {1000 * r['decode_seconds_per_step']:.1f} | "
                    f"{_fmt(r.get('break_even_tau'))} |"
                )
            lines.append("")
        rates = {m: r["per_position_acceptance"] for m, r in rep["methods"].items() if r.get("per_position_acceptance")}
        if rates:
            width = max(len(v) for v in rates.values())
            lines += [
                "Per-position acceptance rate (P(draft k accepted | drafts before it accepted)):",
                "",
                "| method | " + " | ".join(f"k={k}" for k in range(1, width + 1)) + " |",
                "|---|" + "---|" * width,
            ]
            for m, v in rates.items():
                lines.append(f"| {m} | " + " | ".join(f"{x:.2f}" for x in v) + " |" + " |" * (width - len(v)))
            lines.append("")
        for m, checks in (rep.get("distribution_check") or {}).items():
            verdict = "same as ar" if all(c["same_distribution"] for c in checks) else "DIFFERENT from ar"
            detail = ", ".join(
                f"pos {c['position']}: chi2 {c['chi2']:.1f} < {c['critical_0.001']:.1f}"
                if c["same_distribution"]
                else f"pos {c['position']}: chi2 {c['chi2']:.1f} >= {c['critical_0.001']:.1f}"
                for c in checks
            )
            lines.append(f"T={rep['temperature'] or 1.0} token distribution of {m}: {verdict} ({detail}).")
        lines.append("")
    return "\n".join(lines)


def repetition_lines(methods: dict) -> list[str]:
    """How much of the output repeats itself, and each drafting method's τ outside the repeats
    (`bench/repetition.py`); nothing for results made before the benchmark measured it."""
    reps = {m: r["repetition"] for m, r in methods.items() if r.get("repetition")}
    if not reps:
        return []
    shares = {m: x["repeated_share"] for m, x in reps.items()}
    first = next(iter(shares))
    share = (
        f"{100 * shares[first]:.0f}% of {first}'s output tokens"
        if len(set(shares.values())) == 1
        else ", ".join(f"{m} {100 * v:.0f}%" for m, v in shares.items()) + " of the output tokens"
    )
    outside = [
        f"{m} {x['tau_outside_repeats']:.2f} ({100 * x['steps_outside_repeats_share']:.0f}% of its steps)"
        for m, x in reps.items()
        if x.get("tau_outside_repeats") is not None and methods[m]["block_size"] > 1
    ]
    n = next(iter(reps.values()))["ngram"]
    text = f"Repetition: {share} end a run of {n} tokens that occurred earlier in the same answer."
    if outside:
        text += " τ on the verify steps that commit no repeated token: " + ", ".join(outside) + "."
    return [text, ""]


def plots(reports: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name, rep in reports.items():  # acceptance histogram per method
        spec = {m: r for m, r in rep["methods"].items() if r.get("per_position_acceptance")}
        if not spec:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(spec)
        for i, (m, r) in enumerate(spec.items()):
            hist = r["acceptance_histogram"][1:]
            ax.bar([k + 1 + i * width for k in range(len(hist))], hist, width=width, label=f"{m} (tau {r['tau']:.2f})")
        ax.set_xlabel("tokens committed per verify step")
        ax.set_ylabel("fraction of steps")
        ax.set_title(f"Acceptance length, {name}")
        ax.legend()
        fig.tight_layout()
        path = out / f"acceptance_{Path(name).stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path.name)
    fig, ax = plt.subplots(figsize=(6, 4))  # speedup vs block size
    drawn = False
    for name, rep in reports.items():
        for kind in ("dflash", "lookup"):
            pts = sorted(
                (r["block_size"], r["speedup_vs_ar"])
                for m, r in rep["methods"].items()
                if m.split("@")[0] == kind and r.get("speedup_vs_ar")
            )
            if len(pts) > 1:
                ax.plot(*zip(*pts, strict=False), marker="o", label=f"{kind}, {name}")
                drawn = True
    if drawn:
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("block size")
        ax.set_ylabel("speedup vs ar")
        ax.set_title("Speedup vs block size")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "speedup_vs_block.png", dpi=100)
        made.append("speedup_vs_block.png")
    plt.close(fig)
    made += tree_budget_plot(reports, out, plt)
    methods = sorted(
        {m for rep in reports.values() for m, r in rep["methods"].items() if r.get("per_position_acceptance")}
    )
    if methods and len(reports) > 1:  # tau per dataset
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(methods)
        names = list(reports)
        for i, m in enumerate(methods):
            taus = [reports[n]["methods"].get(m, {}).get("tau") or 0 for n in names]
            ax.bar([j + i * width for j in range(len(names))], taus, width=width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
        ax.set_ylabel("tau (tokens per verify step)")
        ax.set_title("tau per dataset")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "tau_per_dataset.png", dpi=100)
        plt.close(fig)
        made.append("tau_per_dataset.png")
    return made


def tree_budget_plot(reports: dict, out: Path, plt) -> list[str]:
    """tau and speedup of `dflash-tree@N` against the node budget N, per dataset, with the
    chains (`dflash[@B]`, `dflash-cut`) of the same run as horizontal lines."""
    series = {
        name: sorted(
            (r["block_size"] - 1, r["tau"], r.get("speedup_vs_ar"))
            for m, r in rep["methods"].items()
            if m.split("@")[0] == "dflash-tree"
        )
        for name, rep in reports.items()
    }
    if not any(len(pts) > 1 for pts in series.values()):
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (name, pts), color in zip(series.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False):
        if len(pts) < 2:
            continue
        budgets = [p[0] for p in pts]
        for ax, i in zip(axes, (1, 2), strict=False):
            ax.plot(budgets, [p[i] or 0 for p in pts], marker="o", color=color, label=f"tree, {name}")
            chains = [
                (m, r) for m, r in reports[name]["methods"].items() if m.split("@")[0] in ("dflash", "dflash-cut")
            ]
            for (m, r), style in zip(chains, ("--", ":", "-.", (0, (1, 4))), strict=False):
                value = r["tau"] if i == 1 else r.get("speedup_vs_ar")
                if value:
                    ax.axhline(value, color=color, ls=style, lw=1, label=f"{m}, {name}")
    axes[0].set_ylabel("tau (tokens per verify step)")
    axes[1].set_ylabel("speedup vs ar")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("draft tokens verified per step (tree nodes)")
        ax.legend(fontsize=7)
    fig.suptitle("DFlash trees vs node budget")
    fig.tight_layout()
    fig.savefig(out / "tree_budget.png", dpi=100)
    plt.close(fig)
    return ["tree_budget.png"]


def write_report(reports: dict, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    images = plots(reports, out)
    text = "# blockdraft bench\n\n" + markdown(reports) + "\n" + "\n".join(f"![{i}]({i})" for i in images) + "\n"
    (out / "report.md").write_text(text)
