"""Training experiments behind the README's recipe table and data-scaling curve.

    # recipe: short runs at EQUAL CPU TIME, one setting changed per run from the base recipe
    .venv/bin/python benchmarks/experiments.py recipe --minutes 10
    # data scaling: the chosen recipe on the first N training samples, same number of epochs
    .venv/bin/python benchmarks/experiments.py scaling --sizes 1000 2500 5000 10000 20000 --epochs 2
    .venv/bin/python benchmarks/experiments.py scaling --arch eagle3 ...   # the same curve for the baseline
    # the same curve at 1 epoch from one pass: each size is a WSD decay branch off the full run
    .venv/bin/python benchmarks/experiments.py scaling --wsd-branches --sizes 1000 2500 5000 10000 20000
    # trained blocks compared as served at a small block (CPU): the same steps for every run
    .venv/bin/python benchmarks/experiments.py served --runs block-8-anchors-32 block-4-anchors-64 --steps 370 --block 3
    # which answers to regenerate next: greedy vs sampled answers to the SAME prompts, each branch
    # warm-started from the shipped drafter, equal steps, evaluated on the same held-out greedy answers
    .venv/bin/python benchmarks/experiments.py sampling --sources greedy=data/regen/smollm2-135m-instruct \
        t07=data/regen/smollm2-135m-instruct-t07 t10=data/regen/smollm2-135m-instruct-t10
    # a Markov head (DSpark) against plain DFlash: both from the shipped drafter, equal steps, same data
    .venv/bin/python benchmarks/experiments.py markov --rank 256 --steps 400
    # training context at equal CPU time: sequences cut at 512 vs kept to 1024 tokens, from the shipped drafter
    .venv/bin/python benchmarks/experiments.py context --data data/regen/smollm2-135m-instruct-sampled --minutes 15 \
        --eval-max-new-tokens 256
    # the epoch curve: one 10-epoch WSD run on 2,000 samples, decay branches at 1, 2, 4, 6 epochs
    # (resumes from data/train-logs/positions/epochs-ARCH, which is committed)
    .venv/bin/python benchmarks/experiments.py epochs --arch dflash
    .venv/bin/python benchmarks/experiments.py epochs --arch eagle3
    # hard labels against the target's distribution (soft labels) at equal steps, from scratch
    .venv/bin/python benchmarks/experiments.py labels --data data/regen/smollm2-135m-instruct-a1 --offset 6842 \
        --samples 2000 --dtype bfloat16 --feature-cache runs/feature-cache
    # the same steps on new answers or on repeated ones: 1,000 answers x 4 epochs against 4,000 x 1
    .venv/bin/python benchmarks/experiments.py spread --arch dspark --data data/regen/smollm2-135m-instruct-a1 \
        --offset 4166 --samples 1000 --epochs 4 --dtype bfloat16 --feature-cache runs/feature-cache \
        --target-layer-ids 1 14 27
    # the README's tables (and the curve) from data/train-logs/experiments.jsonl
    .venv/bin/python benchmarks/experiments.py table --plot docs/data_scaling.png

Equal compute: each recipe run first times a few steps of its own configuration, then gets
as many steps as fit in --minutes (a run with soft labels or more layers gets fewer steps).
Every run ends with the held-out τ measured in the real decode loop (greedy, the same
--eval-prompts held-out prompts for every run) and the teacher-forced acceptance on the
first 128 held-out answers (`Trainer.evaluate_blocks`: the same τ over ~8K blocks, plus
per-position cross-entropy and accuracy; `experiments.py blocks` adds it to runs recorded
without it). Runs are resumable (checkpoints under
runs/experiments/), results are appended to data/train-logs/experiments.jsonl (committed),
and a finished run is skipped when the script is rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from blockdraft.machine import cpu_name
from blockdraft.train.answers import prompt_of
from blockdraft.train.data import ShardWriter, iter_samples
from blockdraft.train.features import TEACHER_TOPK
from blockdraft.train.config import TrainConfig
from blockdraft.train.samples import adopt_position
from blockdraft.train.trainer import Trainer

DATA = "data/regen/smollm2-135m-instruct"
RESULTS = Path("data/train-logs/experiments.jsonl")
RUNS = Path("runs/experiments")
BLOCK_SAMPLES = 128  # held-out answers for the teacher-forced acceptance (Trainer.evaluate_blocks)
# The base recipe: the shipped drafter's settings.
BASE = dict(
    block_size=16,
    num_layers=3,
    num_anchors=64,
    batch_size=4,
    lr=1e-3,
    draft_vocab=8192,
    init="target-last-fc",
    max_seq_len=512,
)
# One change per run (name -> overrides of BASE).
RECIPE = {
    "base": {},
    "lr-3e-4": {"lr": 3e-4},
    "lr-2e-3": {"lr": 2e-3},
    "wsd": {"schedule": "wsd"},
    "layers-1": {"num_layers": 1},
    "layers-2": {"num_layers": 2},
    "soft-labels": {"distill": 1.0},
    "soft-half": {"distill": 0.5},
    "anchors-16": {"num_anchors": 16},
    "anchors-32": {"num_anchors": 32},
    "anchors-128": {"num_anchors": 128},
    "block-8": {"block_size": 8},
    "block-8-anchors-32": {"block_size": 8, "num_anchors": 32},  # the two best single changes, together
    "no-clip": {"grad_clip": 0.0},
    # for serving at a small block on CPU (`served`): the same block tokens, the loss on fewer positions
    "block-4-anchors-64": {"block_size": 4, "num_anchors": 64},
}


def records(path: Path | None = None) -> list[dict]:
    """The recorded runs (one JSON object per line of the results file); [] when there is none."""
    path = Path(path or RESULTS)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done_runs() -> set[str]:
    return {r["run"] for r in records()}


def set_paths(results: str, runs: str):
    global RESULTS, RUNS
    RESULTS, RUNS = Path(results), Path(runs)


def seconds_per_step(cfg: TrainConfig, steps: int = 6) -> float:
    """Median time of a few steps of this configuration (after two warm-up steps)."""
    probe = dataclasses.replace(cfg, out=str(Path(cfg.out) / "probe"), max_steps=1000, eval_every=10**9)
    trainer = Trainer(probe)
    times = []
    for _i in range(steps + 2):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


# Settings that change what a step costs; runs that differ only elsewhere (learning rate,
# schedule, clipping) share one timing and so get exactly the same number of steps.
COST_KEYS = ("block_size", "num_layers", "num_anchors", "batch_size", "draft_vocab", "max_seq_len", "distill", "arch")


def run(name: str, cfg: TrainConfig, extra: dict, trainer: Trainer | None = None):
    """Train to cfg.max_steps (resuming), evaluate held-out τ at the end, append the result."""
    trainer = trainer or Trainer(cfg, resume=True)
    trainer.run()
    records = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines() if line]
    last = records[-1]
    blocks = trainer.evaluate_blocks(BLOCK_SAMPLES)
    result = {
        "run": name,
        "steps": last["step"],
        "tokens_seen": last["tokens_seen"],
        "minutes": round(last["elapsed"] / 60, 2),
        "loss": last["loss"],
        "tau": last.get("tau"),
        "train_samples": len(trainer.samples),
        "eval_prompts": cfg.eval_prompts,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"},
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        **blocks,
        **extra,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"{name}: tau {result['tau']}, {result['steps']} steps, {result['minutes']} min", file=sys.stderr)


def common(args) -> dict:
    return dict(
        data=args.data,
        eval_every=10**9,
        eval_prompts=args.eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens,
        save_every=25,
        log_every=5,
        seed=args.seed,
    )


def plan_recipe(args, names: list[str]) -> dict[str, int]:
    """Steps per run at equal CPU time. Every run not yet started is timed first, back to back,
    so that all probes see the same machine state; the plan is saved (beside the results) and reused."""
    path = RESULTS.parent / "recipe-plan.json"  # committed with the results: the same steps on any rerun
    plan = json.loads(path.read_text()) if path.is_file() else {}
    timed = {}  # cost key -> seconds per step
    for name in names:
        if name in plan or f"recipe/{name}" in done_runs():
            continue
        settings = {**BASE, **RECIPE[name]}
        key = json.dumps([settings.get(k) for k in COST_KEYS])
        if key not in timed:
            cfg = TrainConfig(out=str(RUNS / f"recipe-{name}"), **common(args), **settings)
            timed[key] = seconds_per_step(cfg)
        per_step = timed[key]
        plan[name] = {
            "steps": max(10, int(args.minutes * 60 / per_step)),
            "seconds_per_step": round(per_step, 3),
            "minutes": args.minutes,
        }
        print(f"recipe/{name}: {per_step:.2f} s/step -> {plan[name]['steps']} steps", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan, indent=1))
    return plan


def cmd_recipe(args):
    names = [n for n in (args.runs or list(RECIPE)) if f"recipe/{n}" not in done_runs()]
    plan = plan_recipe(args, names)
    for name in names:
        out = str(RUNS / f"recipe-{name}")
        cfg = TrainConfig(out=out, **common(args), **{**BASE, **RECIPE[name]})
        cfg.max_steps = plan[name]["steps"]
        print(f"recipe/{name}: {cfg.max_steps} steps", file=sys.stderr)
        run(
            f"recipe/{name}",
            cfg,
            {
                "kind": "recipe",
                "change": RECIPE[name],
                "budget_minutes": plan[name]["minutes"],
                "seconds_per_step": plan[name]["seconds_per_step"],
            },
        )


def cmd_scaling(args):
    settings = dict(BASE)
    if args.arch == "eagle3":
        settings.update(arch="eagle3", block_size=8, init="target-last")
    settings.update(json.loads(args.settings) if args.settings else {})
    if args.wsd_branches:
        return scaling_branches(args, settings)
    for n in args.sizes:
        key = f"scaling/{args.arch}/{n}"
        if key in done_runs():
            continue
        steps = max(10, round(args.epochs * n / settings["batch_size"]))
        cfg = TrainConfig(
            out=str(RUNS / f"scaling-{args.arch}-{n}"), max_steps=steps, limit_samples=n, **common(args), **settings
        )
        run(key, cfg, {"kind": "scaling", "arch": args.arch, "samples": n, "epochs": args.epochs})


def scaling_branches(args, settings: dict):
    """The data-scaling curve from ONE pass over the training set (1 epoch), warmup-stable-decay.
    The size-N point is the run that trains on the first N samples of the pass: it shares the
    main run's steps up to where its own decay starts (same fixed warmup, same constant
    learning rate, same batches), so it branches off a copy of the main run's checkpoint there
    and decays over its last `decay_frac` of N / batch_size steps, on its own samples N-20%..N.
    Each point is thus exactly a separate 1-epoch WSD run on N distinct samples; the largest
    point is the main run itself. Cost: one pass plus the decays (~1.2x the largest run alone)."""
    settings = {**settings, "schedule": "wsd", "warmup_steps": args.warmup_steps}
    main_out = RUNS / f"scaling-{args.arch}-wsd-main"
    main = None
    batch = settings["batch_size"]
    for n in sorted(args.sizes):
        if main is None:  # the schedule's length is one pass over the samples, known once they are loaded
            main = Trainer(TrainConfig(out=str(main_out), max_steps=1, **common(args), **settings), resume=True)
            main.cfg.max_steps = math.ceil(len(main.samples) / batch)
        total = len(main.samples)
        n = min(n, total)
        key = f"scaling-wsd/{args.arch}/{n}"
        if key in done_runs():
            continue
        extra = {"kind": "scaling", "arch": args.arch, "samples": n, "epochs": 1, "schedule": "wsd-branch"}
        if n == total:
            run(key, main.cfg, extra)
            break
        steps = math.ceil(n / batch)
        start = steps - max(1, int(settings.get("decay_frac", 0.2) * steps))
        out = RUNS / f"scaling-{args.arch}-wsd-{n}"
        if not (out / "checkpoint").is_dir():
            if main.step > start:
                raise SystemExit(
                    f"{key}: the main run is at step {main.step}, past this branch's start {start}; "
                    "drop this size or retrain the main run"
                )
            main.run(until=start)
            out.mkdir(parents=True, exist_ok=True)
            shutil.copytree(main_out / "checkpoint", out / "checkpoint")
            shutil.copy(main_out / "metrics.jsonl", out / "metrics.jsonl")
        run(key, dataclasses.replace(main.cfg, out=str(out), max_steps=steps), extra)


def cmd_served(args):
    """Recipe runs compared as SERVED at a small block (a CPU verifies 3 tokens for about the
    price of one, 4+ for 1.5 steps): each run trains --steps steps (the same number for all:
    equal compute where their block tokens per sequence are equal; the seconds per step are
    recorded), then is evaluated at --block, teacher-forced on the same held-out blocks for
    every run (--anchors per answer) and in the decode loop, and teacher-forced at its own block."""
    for name in args.runs:
        key = f"served/{name}/b{args.block}"
        if key in done_runs():
            continue
        settings = {**BASE, **RECIPE[name]}
        if settings["block_size"] < args.block:
            raise SystemExit(f"{name} trains at block {settings['block_size']}, below the served block {args.block}")
        cfg = TrainConfig(out=str(RUNS / f"served-{name}"), **common(args), **settings)
        cfg.max_steps = args.steps
        trainer = Trainer(cfg, resume=True)
        trainer.run()
        last = json.loads((Path(cfg.out) / "metrics.jsonl").read_text().splitlines()[-1])
        served = trainer.evaluate_blocks(BLOCK_SAMPLES, block_size=args.block, num_anchors=args.anchors)
        own = trainer.evaluate_blocks(BLOCK_SAMPLES)
        result = {
            "run": key,
            "kind": "served",
            "change": RECIPE[name],
            "served_block": args.block,
            "steps": last["step"],
            "seconds_per_step": round(last["elapsed"] / max(1, last["step"]), 3),
            "tau_served": trainer.evaluate_tau(block_size=args.block),
            "tau_blocks_served": served["tau_blocks"],
            "val_acc_served": served["val_acc"],
            "blocks_served": served["blocks"],
            **own,
            "threads": torch.get_num_threads(),
            "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"},
        }
        with open(RESULTS, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(
            f"{key}: served tau {result['tau_served']:.3f} (teacher-forced {served['tau_blocks']:.3f})", file=sys.stderr
        )


# The shipped DFlash drafter's recipe (its card): the warm start of the sampling A/B.
SHIPPED = dict(
    block_size=4,
    num_layers=3,
    num_anchors=64,
    batch_size=4,
    lr=3e-4,
    draft_vocab=8192,
    schedule="wsd",
    warmup_steps=25,
    max_seq_len=512,
    init_from="blockdraft/shipped/smollm2-135m-instruct-dflash",
)


def from_shipped(args) -> dict:
    """The settings of a branch that continues the shipped drafter (`sampling`, `markov`, `context`):
    its recipe, measured only at the end on the held-out prompts, checkpointed every 25 steps."""
    return {
        **SHIPPED,
        "dtype": args.dtype,
        "eval_every": 10**9,
        "eval_prompts": args.eval_prompts,
        "eval_max_new_tokens": args.eval_max_new_tokens,
        "save_every": 25,
        "log_every": 5,
        "seed": args.seed,
    }


def write_folder(folder: Path, samples: list[dict]):
    """An experiment's own data folder holding `samples`, written once (kept as it is if it exists)."""
    if not folder.is_dir():
        folder.mkdir(parents=True)
        writer = ShardWriter(folder)
        for s in samples:
            writer.write(s)
        writer.close()


def sampling_data(sources: dict[str, str], out: Path) -> dict[str, dict]:
    """One folder per source holding its training answers to the prompts that EVERY source
    answers (so the branches differ only in the answers), plus the first source's held-out
    answers (the same evaluation set for all). Written once; returns per-source counts."""
    train = {name: [s for s in iter_samples(folder) if s["split"] == "train"] for name, folder in sources.items()}
    common = set.intersection(*({prompt_of(s["id"]) for s in rows} for rows in train.values()))
    first = next(iter(sources.values()))
    valid = [s for s in iter_samples(first) if s["split"] == "valid"]
    info = {}
    for name, rows in train.items():
        folder = out / name
        kept = [s for s in rows if prompt_of(s["id"]) in common]
        write_folder(folder, kept + valid)
        info[name] = {
            "folder": str(folder),
            "source": sources[name],
            "prompts": len(common),
            "train_samples": len(kept),
            "valid_samples": len(valid),
            "answer_tokens": sum(len(s["answer_ids"]) for s in kept),
            "temperature": kept[0].get("temperature", 0.0) if kept else None,
        }
    return info


def cmd_sampling(args):
    """Greedy vs sampled answers at equal training compute. Every branch starts from the shipped
    drafter (which has seen the greedy answers of every training prompt) and trains --steps steps
    on its source's answers to the same prompts; all are then measured on the greedy source's
    held-out answers (teacher-forced τ) and held-out prompts (decode loop), as is the untouched
    shipped drafter ("start"). The question it answers: with greedy answers for every prompt,
    does a further pass gain more from new sampled answers (and at which temperature) than
    from the greedy ones again?"""
    sources = dict(item.split("=", 1) for item in args.sources)
    info = sampling_data(sources, RUNS / "sampling-data")
    for name, row in info.items():
        print(
            f"{name}: {row['train_samples']} answers to {row['prompts']} prompts, {row['answer_tokens']} answer tokens",
            file=sys.stderr,
        )
    settings = from_shipped(args)
    first = next(iter(info))
    if "sampling/start" not in done_runs():
        cfg = TrainConfig(data=info[first]["folder"], out=str(RUNS / "sampling-start"), max_steps=0, **settings)
        trainer = Trainer(cfg)
        result = {
            "run": "sampling/start",
            "kind": "sampling",
            "source": "(shipped, no further step)",
            "steps": 0,
            "tau": trainer.evaluate_tau(),
            **trainer.evaluate_blocks(BLOCK_SAMPLES),
            "eval_prompts": cfg.eval_prompts,
            "threads": torch.get_num_threads(),
        }
        with open(RESULTS, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"start: tau {result['tau']:.3f}, teacher-forced {result['tau_blocks']:.3f}", file=sys.stderr)
    for name, row in info.items():
        key = f"sampling/{name}"
        if key in done_runs():
            continue
        cfg = TrainConfig(data=row["folder"], out=str(RUNS / f"sampling-{name}"), max_steps=args.steps, **settings)
        run(key, cfg, {"kind": "sampling", **row})


def cmd_markov(args):
    """DFlash against the same drafter with a DSpark-style Markov head, at equal steps on the same
    data in the same order: both start from the shipped drafter (the head starts fresh), both
    are measured on the same held-out answers (teacher-forced τ) and prompts (decode loop)."""
    settings = {**from_shipped(args), "data": args.data}
    for name, rank in (("dflash", 0), (f"dspark-r{args.rank}", args.rank)):
        key = f"markov/{name}"
        if key in done_runs():
            continue
        cfg = TrainConfig(out=str(RUNS / f"markov-{name}"), max_steps=args.steps, markov_rank=rank, **settings)
        run(key, cfg, {"kind": "markov", "markov_rank": rank, "data": args.data})


def cmd_context(args):
    """Training context at equal CPU time: the shipped drafter trained further on the same answers
    (the sampled ones, up to 512 tokens) with every sequence cut at --short tokens, or kept up to
    --long. Each branch is timed first and gets the steps that fit in --minutes; both are measured
    on the same held-out prompts in the decode loop (--eval-max-new-tokens, the benchmark's 256 by
    default). Their teacher-forced rows are not comparable: each is over the held-out answers cut
    at its own length."""
    settings = {**from_shipped(args), "data": args.data}
    for length in (args.short, args.long):
        key = f"context/{length}"
        if key in done_runs():
            continue
        cfg = TrainConfig(out=str(RUNS / f"context-{length}"), **{**settings, "max_seq_len": length})
        per_step = seconds_per_step(cfg)
        cfg.max_steps = max(10, int(args.minutes * 60 / per_step))
        print(f"{key}: {per_step:.2f} s/step -> {cfg.max_steps} steps", file=sys.stderr)
        run(
            key,
            cfg,
            {
                "kind": "context",
                "max_seq_len": length,
                "data": args.data,
                "budget_minutes": args.minutes,
                "seconds_per_step": round(per_step, 3),
            },
        )


# The epoch curve's recipes, from scratch (block 4: what a CPU verifies; the shipped settings).
EPOCH_RECIPES = {
    "dflash": dict(
        block_size=4,
        num_layers=3,
        num_anchors=64,
        batch_size=4,
        lr=1e-3,
        draft_vocab=8192,
        init="target-last-fc",
        max_seq_len=512,
    ),
    "eagle3": dict(
        arch="eagle3",
        block_size=4,
        num_anchors=64,
        batch_size=4,
        lr=1e-3,
        draft_vocab=8192,
        init="target-last",
        max_seq_len=512,
    ),
}
EPOCH_RECIPES["dspark"] = {**EPOCH_RECIPES["dflash"], "markov_rank": 256}


def cmd_epochs(args):
    """The epoch curve: ONE warmup-stable-decay run over --max-epochs epochs of the first
    --samples training samples, and at each of --epochs a branch that decays from the main run
    (its last `decay_frac` of e epochs) and is measured, so that the e-epoch point is exactly a
    separate e-epoch WSD run. The main run's position (weights and step, no optimizer state)
    is written to data/train-logs/positions/epochs-ARCH at every checkpoint: commit it, and on
    another machine the same command continues from it (AdamW's moments rebuilt). The target's
    features are kept in --feature-cache from the first epoch on."""
    settings = {
        **EPOCH_RECIPES[args.arch],
        "schedule": "wsd",
        "warmup_steps": args.warmup_steps,
        "limit_samples": args.samples,
        "dtype": args.dtype,
        # one cache per arch: each kind captures its own target layers
        "feature_cache": args.feature_cache or f"runs/feature-cache-{args.arch}",
    }
    main_out = RUNS / f"epochs-{args.arch}-main"
    position = RESULTS.parent / "positions" / f"epochs-{args.arch}"  # committed (weights, no optimizer state)
    if (position / "state.json").is_file() and adopt_position(position, main_out):
        print(f"epochs: continuing from the committed position {position}", file=sys.stderr)
    cfg = TrainConfig(out=str(main_out), max_steps=1, **common(args), **settings)
    main = Trainer(cfg, resume=True, position_dir=position)
    per_epoch = math.ceil(len(main.samples) / cfg.batch_size)
    main.cfg.max_steps = per_epoch * args.max_epochs
    for e in sorted(args.epochs):
        key = f"epochs/{args.arch}/{e}"
        if key in done_runs():
            continue
        extra = {
            "kind": "epochs",
            "arch": args.arch,
            "epochs": e,
            "samples": len(main.samples),
            "steps_per_epoch": per_epoch,
        }
        steps = per_epoch * e
        if e == args.max_epochs:
            run(key, main.cfg, extra, trainer=main)
            continue
        start = steps - max(1, int(cfg.decay_frac * steps))
        out = RUNS / f"epochs-{args.arch}-{e}"
        if not (out / "checkpoint").is_dir():
            if main.step > start:
                raise SystemExit(f"{key}: the main run is at step {main.step}, past this branch's start {start}")
            main.run(until=start)
            out.mkdir(parents=True, exist_ok=True)
            shutil.copytree(main_out / "checkpoint", out / "checkpoint")
            if (main_out / "metrics.jsonl").is_file():
                shutil.copy(main_out / "metrics.jsonl", out / "metrics.jsonl")
        run(key, dataclasses.replace(main.cfg, out=str(out), max_steps=steps), extra)


def labels_data(source: str, offset: int, samples: int, out: Path) -> dict:
    """Training samples [offset, offset + samples) of `source`'s training split (shards are only
    ever appended, so the same slice on any checkout) and its whole held-out split, in one folder."""
    rows = list(iter_samples(source))
    train = [s for s in rows if s["split"] == "train"][offset : offset + samples]
    valid = [s for s in rows if s["split"] == "valid"]
    if len(train) < samples:
        raise SystemExit(f"labels: {source} has {len(train)} training samples from {offset}, not {samples}")
    write_folder(out, train + valid)
    return {
        "folder": str(out),
        "source": source,
        "offset": offset,
        "train_samples": len(train),
        "valid_samples": len(valid),
        "answer_tokens": sum(len(s["answer_ids"]) for s in train),
        "temperature": train[0].get("temperature", 0.0),
    }


def slice_run(args, kind: str, key: str, out: str, overrides: dict, extra: dict, samples: int, epochs: float):
    """One run of the epoch curve's recipe from scratch on training samples [--offset, --offset +
    samples) of --data (`labels_data`) for `epochs` epochs, measured on --data's held-out prompts and
    answers (the same for every slice of one folder)."""
    if key in done_runs():
        return  # (before the slice: labels_data reads the whole source folder and writes the slice)
    name = f"{Path(args.data).name}-{args.offset}-{samples}"
    info = labels_data(args.data, args.offset, samples, RUNS / f"labels-data-{name}")
    steps = math.ceil(epochs * math.ceil(samples / EPOCH_RECIPES[args.arch]["batch_size"]))
    settings = {
        **EPOCH_RECIPES[args.arch],
        "schedule": "wsd",
        "warmup_steps": args.warmup_steps,
        "dtype": args.dtype,
        "feature_cache": args.feature_cache,
        **overrides,
    }
    cfg = TrainConfig(out=str(RUNS / out), max_steps=steps, **{**common(args), "data": info["folder"]}, **settings)
    run(key, cfg, {"kind": kind, "arch": args.arch, "epochs": epochs, **extra, **info})


def slice_runs(args, kind: str, variants: list[tuple[str, dict, dict]]):
    """One run per variant (name, TrainConfig overrides, recorded fields) of the epoch curve's recipe
    from scratch on the same slice of --data (--samples from --offset), at equal steps (--epochs),
    each measured on the same held-out prompts and answers (`slice_run`)."""
    name = f"{Path(args.data).name}-{args.offset}-{args.samples}"
    for variant, overrides, extra in variants:
        slice_run(
            args,
            kind,
            f"{kind}/{args.arch}/{name}/{variant}",
            f"{kind}-{args.arch}-{name}-{variant}",
            overrides,
            extra,
            args.samples,
            args.epochs,
        )


def cmd_spread(args):
    """The same steps spent on more answers or on more epochs: for each E of --epochs, --samples
    answers for E epochs against E x --samples answers (from the same --offset of --data) for one,
    from scratch, measured on the same held-out prompts and answers. Whether a drafter kind learns
    more from new data than from repeated data at equal compute (the epoch curve repeats 2,000).
    --also adds runs of any size and length (e.g. the baseline given the other kind's minutes);
    --settings overrides the recipe for every run, named by --variant."""
    overrides = {"target_layer_ids": args.target_layer_ids} if args.target_layer_ids else {}
    overrides.update(json.loads(args.settings) if args.settings else {})
    extra = dict(overrides)
    suffix = f"-{args.variant}" if args.variant else ""
    runs = [(n, e) for e in args.epochs for n, e in ((args.samples, e), (args.samples * e, 1))]
    for spec in args.also:  # e.g. 4000x2.5: the baseline given the minutes of the other kind's steps
        samples, epochs = spec.split("x")
        runs.append((int(samples), float(epochs)))
    for samples, epochs in runs:
        name = f"{Path(args.data).name}-{args.offset}/{samples}x{epochs:g}{suffix}"
        slice_run(
            args,
            "spread",
            f"spread/{args.arch}/{name}",
            f"spread-{args.arch}-{name.replace('/', '-')}",
            overrides,
            extra,
            samples,
            epochs,
        )


def cmd_labels(args):
    """Hard labels (the answer's own tokens) against soft labels (the target's distribution at
    each block position, `--distill`) at equal steps (`slice_runs`). On sampled answers a hard
    label is often not the target's most likely token (17% of a1's at T 0.7:
    benchmarks/label_agreement.py), which is what greedy verification accepts; a soft label is the
    distribution the token was drawn from (its top TEACHER_TOPK tokens)."""
    slice_runs(
        args,
        "labels",
        [(f"distill-{d:g}", {"distill": d}, {"distill": d, "teacher_topk": TEACHER_TOPK}) for d in args.distill],
    )


def cmd_features(args):
    """The target's features as the trainer reads them from a float16 cache against an int8 one
    (`--feature-dtype int8`: half the disk), at equal steps with hard labels (`slice_runs`). Each
    --caches DTYPE=FOLDER must already hold the slice's features in that dtype
    (tools/convert_feature_cache.py copies a float16 cache's records into an int8 one)."""
    variants = []
    for spec in args.caches:
        dtype, folder = spec.split("=", 1)
        variants.append((dtype, {"feature_cache": folder, "feature_dtype": dtype}, {"feature_dtype": dtype}))
    slice_runs(args, "features", variants)


def cmd_blocks(args):
    """Add the teacher-forced acceptance to finished runs recorded without it (from their saved drafters)."""
    lines = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for rec in lines:
        drafter = Path(rec["config"]["out"]) / "drafter"
        if "tau_blocks" in rec or not drafter.is_dir():
            continue
        trainer = Trainer(TrainConfig(**{k: v for k, v in rec["config"].items() if k in fields}))
        trainer._init_from_folder(drafter)
        rec.update(trainer.evaluate_blocks(BLOCK_SAMPLES))
        print(f"{rec['run']}: tau_blocks {rec['tau_blocks']}", file=sys.stderr)
        RESULTS.write_text("".join(json.dumps(r) + "\n" for r in lines))


def cmd_table(args):
    """The recipe table (markdown) and, with --plot, the data-scaling curve, from the results file."""
    rows = records()
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in (
        "recipe",
        "scaling",
        "served",
        "sampling",
        "markov",
        "context",
        "epochs",
        "labels",
        "features",
        "spread",
        "blocks",
        "table",
    ):
        p = sub.add_parser(name)
        p.add_argument("--data", default=DATA)
        p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the final τ")
        p.add_argument("--eval-max-new-tokens", type=int, default=96)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--results", default=str(RESULTS), help="JSON lines of finished runs (appended)")
        p.add_argument("--runs-dir", default=str(RUNS), help="checkpoints and metrics of the runs")
    r = sub.choices["recipe"]
    r.add_argument("--minutes", type=float, default=10, help="CPU wall time per run")
    r.add_argument("--runs", nargs="*", choices=list(RECIPE), help="default: all")
    sub.choices["table"].add_argument("--plot", help="write the data-scaling curve to this PNG")
    v = sub.choices["served"]
    v.add_argument("--runs", nargs="+", choices=list(RECIPE), required=True)
    v.add_argument("--steps", type=int, default=370, help="training steps of every run")
    v.add_argument("--block", type=int, default=3, help="the served block (anchor + drafts)")
    v.add_argument("--anchors", type=int, default=32, help="held-out blocks per answer for the teacher-forced τ")
    s = sub.choices["scaling"]
    s.add_argument("--sizes", type=int, nargs="+", default=[1000, 2500, 5000, 10000, 20000])
    s.add_argument("--epochs", type=float, default=2)
    s.add_argument("--arch", choices=["dflash", "eagle3"], default="dflash")
    s.add_argument(
        "--wsd-branches", action="store_true", help="one 1-epoch WSD pass; each size decays off it (--epochs ignored)"
    )
    s.add_argument("--warmup-steps", type=int, default=25, help="--wsd-branches: fixed warmup shared by all sizes")
    s.add_argument("--settings", help='JSON overrides of the base recipe (the chosen one), e.g. {"lr": 2e-3}')
    a = sub.choices["sampling"]
    a.add_argument(
        "--sources",
        nargs="+",
        required=True,
        help="NAME=FOLDER of regenerated answers; the first one's held-out answers are the evaluation set",
    )
    a.add_argument("--steps", type=int, default=150, help="training steps of every branch")
    a.add_argument("--dtype", default="float32", help="the target's dtype (bfloat16 only where the CPU has it)")
    m = sub.choices["markov"]
    m.add_argument("--rank", type=int, default=256, help="the Markov head's rank (DSpark's: 256)")
    m.add_argument("--steps", type=int, default=400, help="training steps of each branch")
    m.add_argument("--dtype", default="float32", help="the target's dtype (bfloat16 only where the CPU has it)")
    c = sub.choices["context"]
    c.add_argument("--short", type=int, default=512, help="the shorter branch's sequence cap (the shipped one)")
    c.add_argument("--long", type=int, default=1024, help="the longer branch's sequence cap")
    c.add_argument("--minutes", type=float, default=15, help="CPU wall time of each branch's training")
    c.add_argument("--dtype", default="float32", help="the target's dtype (bfloat16 only where the CPU has it)")
    e = sub.choices["epochs"]
    e.add_argument("--arch", choices=sorted(EPOCH_RECIPES), default="dflash")
    e.add_argument("--samples", type=int, default=2000, help="the first N training samples (the same for every arch)")
    e.add_argument("--epochs", type=int, nargs="+", default=[1, 2, 4, 6, 10], help="where the curve is measured")
    e.add_argument("--max-epochs", type=int, default=10, help="the main run's length (its own decay is the last point)")
    e.add_argument("--warmup-steps", type=int, default=25)
    e.add_argument("--feature-cache", default=None, help="default: runs/feature-cache-ARCH")
    e.add_argument("--dtype", default="float32", help="the target's dtype (bfloat16 only where the CPU has it)")
    for name in ("labels", "features", "spread"):
        lb = sub.choices[name]
        lb.add_argument("--arch", choices=sorted(EPOCH_RECIPES), default="dspark")
        lb.add_argument("--offset", type=int, default=0, help="the first training sample of --data used")
        lb.add_argument("--samples", type=int, default=2000, help="training samples from --offset")
        if name == "spread":
            lb.add_argument(
                "--epochs",
                type=int,
                nargs="*",
                default=[4],
                help="for each E: --samples answers for E epochs against E x --samples for one",
            )
        else:
            lb.add_argument("--epochs", type=int, default=1)
        lb.add_argument("--warmup-steps", type=int, default=25)
        lb.add_argument("--feature-cache", default=None, help="features (and the target's top tokens) kept across runs")
        lb.add_argument("--dtype", default="float32", help="the target's dtype (bfloat16 only where the CPU has it)")
    sub.choices["spread"].add_argument("--settings", help='JSON overrides of the recipe, e.g. {"num_layers": 1}')
    sub.choices["spread"].add_argument("--variant", help="a name for --settings, added to the runs' names")
    sub.choices["spread"].add_argument(
        "--also",
        nargs="+",
        default=[],
        metavar="SAMPLESxEPOCHS",
        help="more runs from the same offset, e.g. 4000x2.5 (epochs may be fractional)",
    )
    sub.choices["spread"].add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        help="the target layers the drafter reads (default: its kind's; e.g. the feature cache's)",
    )
    sub.choices["labels"].add_argument(
        "--distill",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="one run per weight of the soft labels (0: hard labels only)",
    )
    sub.choices["features"].add_argument(
        "--caches",
        nargs="+",
        required=True,
        metavar="DTYPE=FOLDER",
        help="one run per feature cache, e.g. float16=runs/feature-cache int8=runs/feature-cache-int8",
    )
    args = ap.parse_args()
    set_paths(args.results, args.runs_dir)
    {
        "recipe": cmd_recipe,
        "scaling": cmd_scaling,
        "served": cmd_served,
        "sampling": cmd_sampling,
        "markov": cmd_markov,
        "context": cmd_context,
        "epochs": cmd_epochs,
        "labels": cmd_labels,
        "features": cmd_features,
        "spread": cmd_spread,
        "blocks": cmd_blocks,
        "table": cmd_table,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
