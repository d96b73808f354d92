"""Ship trained drafters for the default target: fp16 weights + a model card.

    python tools/ship_drafter.py RUN_DIR [--samples 20] [--max-new-tokens 256] [--bench DIR]
    python tools/ship_drafter.py --eagle RUN_DIR [--bench DIR]       # the EAGLE-3-style baseline only
    python tools/ship_drafter.py RUN_DIR --eagle EAGLE_RUN_DIR ...     # both

Copies RUN_DIR/drafter into blockdraft/shipped/smollm2-135m-instruct-dflash/ (fp16; with --eagle,
EAGLE_RUN_DIR/drafter into .../smollm2-135m-instruct-eagle3/), measures τ with `blockdraft bench`
on HumanEval, MT-Bench first turns and GSM8K (greedy, the drafter's block size), and writes each
model card README.md from the run's own records (data sources and samples, epochs, schedule,
CPU hours, the data-scaling curve of its architecture). With --bench DIR, τ is read from an
existing bench run (DIR/DATASET/results.json, methods `dflash*` or `eagle3*`) instead.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

from blockdraft.machine import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from experiment_runs import records  # noqa: E402  (benchmarks/experiment_runs.py)

DEST = Path(__file__).resolve().parent.parent / "blockdraft" / "shipped" / "smollm2-135m-instruct-dflash"
EAGLE_DEST = DEST.parent / "smollm2-135m-instruct-eagle3"
TRAIN_LOGS = DEST.parents[2] / "data" / "train-logs"
SCALING_LOG = TRAIN_LOGS / "experiments.jsonl"
DATASETS = {"humaneval": "HumanEval", "mtbench": "MT-Bench (first turns)", "gsm8k": "GSM8K"}
# What each architecture's card says it is, and where it goes.
KINDS = {
    "dflash": dict(
        dest=DEST,
        title="DFlash drafter",
        method="dflash",
        use="loaded by default by `blockdraft generate`, `bench` and `serve` for the default target",
    ),
    "eagle3": dict(
        dest=EAGLE_DEST,
        title="EAGLE-3-style baseline drafter",
        method="eagle3",
        use="the baseline that `blockdraft bench --methods eagle3` compares DFlash with; loaded "
        "when method eagle3 is asked for",
    ),
}


def data_summary(cfg: dict) -> tuple[collections.Counter, int, int, int, int]:
    """Samples per prompt source (the id's prefix), the training / held-out counts, and how
    many answers were sampled (a temperature recorded) rather than greedy, of what a run's
    settings train on; and how many its --skip-trained-by left out."""
    from blockdraft.train.samples import trained_ids, training_samples

    train, valid, _, skipped = training_samples(
        cfg["data"],
        cfg.get("max_seq_len", 512),
        cfg.get("folder_samples"),
        None,
        trained_ids(cfg.get("skip_trained_by")),
    )
    samples = [t[2] for t in train + valid]
    sources = collections.Counter(s["id"].split("/", 1)[0] for s in samples)
    return sources, len(train), len(valid), sum(bool(s.get("temperature")) for s in samples), skipped


def scaling_table(path: str, arch: str = "dflash") -> str:
    """The data-scaling curve of this recipe (one record per size, the newest of each), as a markdown table."""
    rows = {}
    for rec in records(path):
        if rec.get("kind") == "scaling" and rec.get("arch") == arch:
            rows[rec["samples"]] = rec
    if not rows:
        return ""
    body = "".join(
        f"| {n:,} | {r['epochs']} | {r['steps']:,} | {r.get('tau_blocks', float('nan')):.3f} | "
        f"{r['tau']:.3f} | {r['val_acc'][0]:.3f} |\n"
        for n, r in sorted(rows.items())
    )
    cfg = rows[max(rows)].get("config", {})
    recipe = ", ".join(
        f"{name} {cfg[key]}"
        for name, key in (("block", "block_size"), ("anchors", "num_anchors"), ("lr", "lr"), ("schedule", "schedule"))
        if key in cfg
    )
    return (
        f"\n## Data-scaling curve ({arch} on the first N samples, one epoch, from scratch; {recipe}; "
        "`benchmarks/experiments.py scaling`)\n\n"
        "| distinct samples | epochs | steps | τ teacher-forced (held-out answers) | τ decode loop "
        "(held-out prompts) | accuracy at draft position 1 |\n|---|---|---|---|---|---|\n" + body
    )


ANCESTRY_ROWS = ("| data |", "| training |", "| training time |", "| warm start |")


def run_id(state: dict) -> str:
    """What tells one trained drafter from another on a card: its run's settings and progress."""
    key = json.dumps([state["config"], state["step"], state.get("tokens_seen")], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def card_mark(state: dict) -> str:
    return f"<!-- blockdraft run {run_id(state)} -->"


def ancestry(init_from: str | None, state: dict | None = None) -> str:
    """The card rows saying what a warm start started from: the data, training and time rows of
    the model card in the --init-from folder (its own warm start row too, so a chain of warm
    starts stays on the card), read before a ship overwrites that folder; '' for a cold start.
    When that card is already this run's own (`state`: shipped once, now shipped again), its
    warm start row is kept as it is."""
    if not init_from:
        return ""
    card = Path(init_from) / "README.md"
    lines = card.read_text().splitlines() if card.is_file() else []
    if state is not None and card_mark(state) in lines:
        return "".join(line + "\n" for line in lines if line.startswith("| warm start |"))
    rows = [line for line in lines if line.startswith(ANCESTRY_ROWS)]
    cells = "; ".join(row.strip("| ").replace(" | ", ": ", 1).replace(" |", "") for row in rows)
    return f"| warm start | from `{init_from}`" + (f", itself trained so: {cells}" if cells else "") + " |\n"


def block_of(method: str, cfg: dict) -> int:
    """The block size a bench method name ran at (`dflash@4` -> 4, `dflash` -> the trained one)."""
    return int(method.split("@")[1]) if "@" in method else cfg["block_size"]


def measured_taus(args, run: Path, dest: Path, method: str) -> tuple[dict, dict, int]:
    """τ per dataset and bench method (`dflash`, `dflash@4`, ...), and the prompts per dataset:
    read from --bench, or measured on the shipped copy at its trained block (output under RUN/)."""
    taus, samples, max_new = {}, {}, args.max_new_tokens
    for dataset in DATASETS:
        if args.bench:
            path = Path(args.bench) / dataset / "results.json"
            if not path.is_file():
                continue
            report = json.loads(path.read_text())
        else:
            out = run / f"bench-{dataset}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "blockdraft",
                    "bench",
                    "--dataset",
                    dataset,
                    "--first-turn-only",
                    "--methods",
                    method,
                    "--max-samples",
                    str(args.samples),
                    "--max-new-tokens",
                    str(args.max_new_tokens),
                    "--draft" if method == "dflash" else "--eagle",
                    str(dest),
                    "--out",
                    str(out),
                ],
                check=True,
            )
            report = json.loads((out / "results.json").read_text())
        taus[dataset] = {name: m["tau"] for name, m in report["methods"].items() if name.split("@")[0] == method}
        samples[dataset] = report["num_prompts"]
        max_new = report["max_new_tokens"]
    if not taus or not any(taus.values()):
        raise SystemExit(f"no {method} results to put in the card (--bench {args.bench})")
    return taus, samples, max_new


def run_metrics(run: Path) -> list[dict]:
    """The run's metrics by step: its folder's metrics.jsonl merged with the committed log
    data/train-logs/NAME.metrics.jsonl, where a run resumed on a new machine keeps its earlier steps."""
    by_step = {}
    for path in (TRAIN_LOGS / f"{run.name}.metrics.jsonl", run / "metrics.jsonl"):
        if path.is_file():
            by_step.update((m["step"], m) for m in (json.loads(line) for line in path.read_text().splitlines() if line))
    if not by_step:
        raise SystemExit(
            f"no metrics for {run}: neither {run / 'metrics.jsonl'} nor {TRAIN_LOGS / run.name}.metrics.jsonl"
        )
    return [by_step[k] for k in sorted(by_step)]


def ship(args, run: Path, arch: str):
    from blockdraft.draft import DFlashDrafter
    from blockdraft.eagle import EagleDrafter

    kind = KINDS[arch]
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    cfg = state["config"]
    if cfg.get("arch", "dflash") != arch:
        raise SystemExit(f"{run} trained a {cfg.get('arch', 'dflash')} drafter, not {arch}")
    metrics = run_metrics(run)
    parent = ancestry(cfg.get("init_from"), state)  # before the copy below may overwrite that folder
    drafter = (DFlashDrafter if arch == "dflash" else EagleDrafter).load(run / "drafter")
    drafter.save(kind["dest"], dtype=torch.float16)

    taus, samples, max_new = measured_taus(args, run, kind["dest"], kind["method"])
    curve = [(m["step"], m.get("tokens_seen"), m["tau"]) for m in metrics if "tau" in m]
    wall = max(m["elapsed"] for m in metrics)
    n_params = sum(p.numel() for p in drafter.parameters())
    names = list(next(iter(taus.values())))
    tau_table = "\n".join(
        [
            "| dataset | prompts | " + " | ".join(f"τ at block {block_of(n, cfg)}" for n in names) + " |",
            "|---|---|" + "---|" * len(names),
            *[
                f"| {DATASETS[d]} | first {samples[d]} | " + " | ".join(f"{taus[d][n]:.2f}" for n in names) + " |"
                for d in taus
            ],
        ]
    )
    sources, train, valid, sampled, skipped = data_summary(cfg)
    folders_note = (
        f", leaving out the {skipped:,} samples that `{cfg['skip_trained_by']}` trained on" if skipped else ""
    )
    answers = (
        "greedily"
        if not sampled
        else f"greedily ({train + valid - sampled:,}) and sampled ({sampled:,}, temperatures as each sample records)"
    )
    folders = ", ".join(f"`{f}`" for f in cfg["data"].split(","))
    presented = state["step"] * cfg["batch_size"]  # sequences trained on (a WSD branch: its first ones)
    distinct = min(train, cfg.get("limit_samples") or train, presented)
    epochs = presented / distinct
    vocab = f"{cfg['draft_vocab']} (most frequent answer tokens)" if cfg.get("draft_vocab") else "full"
    warmup = f"{cfg['warmup_steps']} steps" if cfg.get("warmup_steps") else f"{cfg['warmup_frac']:.0%}"
    threads = state.get("threads") or next(
        (r.get("threads") for r in records(args.scaling) if r.get("config", {}).get("out") == str(run)), None
    )
    threads = f"{threads} threads, " if threads else ""
    # Runs saved before the resolved dtype was recorded: the one asked for (auto meant fp32 on CPU).
    dtype = state.get("target_dtype") or {"auto": "float32"}.get(cfg.get("dtype", "auto"), cfg.get("dtype"))
    precision = "fp32" if dtype == "float32" else f"{dtype} target, fp32 drafter under autocast"
    init = "the warm start below" if cfg.get("init_from") else cfg.get("init", "random")
    if arch == "dflash":
        shape = (
            f"{cfg['num_layers']} Qwen3-style layer(s), {n_params / 1e6:.1f}M parameters, block size "
            f"{cfg['block_size']} (drafted in one pass), target layers {drafter.config.target_layer_ids}, "
            f"mask token {cfg['mask_token_id']}"
        )
        fmt = "Published z-lab format (`config.json` + `model.safetensors`, fp16, no embedding / LM head)."
        if cfg.get("markov_rank"):
            head = sum(p.numel() for p in drafter.markov_head.parameters())
            shape += (
                f", a rank-{cfg['markov_rank']} Markov head ({head / 1e6:.1f}M of the parameters: each "
                "position's logits corrected by the token before it, DSpark's vanilla head)"
            )
            fmt = (
                "Labelled as DSpark's (`Qwen3DSparkModel`, with DeepSpec's top-level keys and the Markov-head "
                "keys `markov_rank`, `markov_head_type`, `sample_from_anchor`, `num_anchors`), so that an engine "
                "runs all of it or refuses it; `blockdraft export drafter` writes DeepSpec's layout, `blockdraft "
                "export gguf-drafter` llama.cpp's draft-dspark GGUF."
            )
    else:
        shape = (
            f"1 decoder layer, {n_params / 1e6:.1f}M parameters, chains of up to {cfg['block_size'] - 1} "
            f"tokens (one pass per token), target layers {drafter.config.target_layer_ids} fused by `fc`"
        )
        fmt = "blockdraft's own format (`config.json` + `model.safetensors`, fp16, no embedding / LM head)."
    flag = f" --markov-rank {cfg['markov_rank']}" if cfg.get("markov_rank") else ""
    title = "DSpark-style drafter (DFlash with a Markov head)" if cfg.get("markov_rank") else kind["title"]
    card = (
        f"""# {title} for SmolLM2-135M-Instruct

Trained by `blockdraft train{"" if arch == "dflash" else " --arch eagle3"}{flag}` \
(the open recipe in this repository) on
this project's CPU machine; {kind["use"]}. {fmt}

| | |
|---|---|
| drafter | {shape}, draft vocabulary {vocab}, initialised from {init} |
| data | answers regenerated {answers} by SmolLM2-135M-Instruct ({folders}, benchmark prompts \
excluded{folders_note}): {train:,} training samples ({valid:,} held out); sources \
{", ".join(f"{k} {v:,}" for k, v in sources.most_common())} |
| training | {state["step"]:,} steps x {cfg["batch_size"]} sequences (max {cfg["max_seq_len"]} tokens; \
{state.get("tokens_seen", 0) / 1e6:.2f}M tokens seen) = {epochs:.2f} epochs over {distinct:,} distinct samples, \
{cfg["num_anchors"]} random anchors per sequence, loss decay gamma {cfg["gamma"] or "default"}, AdamW lr {cfg["lr"]}, \
warmup {warmup}, {cfg.get("schedule", "cosine")} schedule |
| training time | {wall / 3600:.1f} hours of wall time (pauses for other jobs included) on {cpu_name()} \
({threads}{precision}, torch {torch.__version__}) |
{parent}
## Measured acceptance length τ (greedy, up to {max_new} new tokens)

{tau_table}

Reproduce: `blockdraft bench --dataset {",".join(taus)} --first-turn-only --methods {",".join(names)} --max-samples \
{next(iter(samples.values()))} --max-new-tokens {max_new}`.

## τ on held-out prompts during training (real decode loop, {cfg["eval_max_new_tokens"]} new tokens)

| step | tokens seen | τ |
|---|---|---|
"""
        + "".join(f"| {s} | {(n or 0) / 1e3:.0f}K | {t:.3f} |\n" for s, n, t in curve)
        + scaling_table(args.scaling, arch)
        + f"\n{card_mark(state)}\n"
    )
    (kind["dest"] / "README.md").write_text(card)
    print(card)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", nargs="?", help="the DFlash drafter's run folder (checkpoint/, drafter/, metrics.jsonl)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--bench", help="read tau from this bench output folder instead of measuring")
    ap.add_argument("--eagle", help="ship the EAGLE-3-style baseline trained in this run folder")
    ap.add_argument(
        "--scaling",
        default=str(SCALING_LOG),
        help="experiment log whose data-scaling records (benchmarks/experiments.py scaling) go in the card",
    )
    args = ap.parse_args()
    if not args.run and not args.eagle:
        ap.error("name a DFlash run folder, --eagle RUN, or both")
    if args.eagle:
        ship(args, Path(args.eagle), "eagle3")
    if args.run:
        ship(args, Path(args.run), "dflash")


if __name__ == "__main__":
    main()
