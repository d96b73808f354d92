"""`experiments.py recipe | scaling | served`: one change per run at equal CPU time, the data-scaling
curve, trained blocks served at a small block."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import torch

from blockdraft.train.config import TrainConfig
from blockdraft.train.trainer import Trainer
import experiment_runs as R  # noqa: E402


def plan_recipe(args, names: list[str]) -> dict[str, int]:
    """Steps per run at equal CPU time. Every run not yet started is timed first, back to back,
    so that all probes see the same machine state; the plan is saved (beside the results) and reused."""
    path = R.RESULTS.parent / "recipe-plan.json"  # committed with the results: the same steps on any rerun
    plan = json.loads(path.read_text()) if path.is_file() else {}
    timed = {}  # cost key -> seconds per step
    for name in names:
        if name in plan or f"recipe/{name}" in R.done_runs():
            continue
        settings = {**R.BASE, **R.RECIPE[name]}
        key = json.dumps([settings.get(k) for k in R.COST_KEYS])
        if key not in timed:
            cfg = TrainConfig(out=str(R.RUNS / f"recipe-{name}"), **R.common(args), **settings)
            timed[key] = R.seconds_per_step(cfg)
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
    names = [n for n in (args.runs or list(R.RECIPE)) if f"recipe/{n}" not in R.done_runs()]
    plan = plan_recipe(args, names)
    for name in names:
        out = str(R.RUNS / f"recipe-{name}")
        cfg = TrainConfig(out=out, **R.common(args), **{**R.BASE, **R.RECIPE[name]})
        cfg.max_steps = plan[name]["steps"]
        print(f"recipe/{name}: {cfg.max_steps} steps", file=sys.stderr)
        R.run(
            f"recipe/{name}",
            cfg,
            {
                "kind": "recipe",
                "change": R.RECIPE[name],
                "budget_minutes": plan[name]["minutes"],
                "seconds_per_step": plan[name]["seconds_per_step"],
            },
        )


def cmd_scaling(args):
    settings = dict(R.BASE)
    if args.arch == "eagle3":
        settings.update(arch="eagle3", block_size=8, init="target-last")
    settings.update(json.loads(args.settings) if args.settings else {})
    if args.wsd_branches:
        return scaling_branches(args, settings)
    for n in args.sizes:
        key = f"scaling/{args.arch}/{n}"
        if key in R.done_runs():
            continue
        steps = max(10, round(args.epochs * n / settings["batch_size"]))
        cfg = TrainConfig(
            out=str(R.RUNS / f"scaling-{args.arch}-{n}"), max_steps=steps, limit_samples=n, **R.common(args), **settings
        )
        R.run(key, cfg, {"kind": "scaling", "arch": args.arch, "samples": n, "epochs": args.epochs})


def scaling_branches(args, settings: dict):
    """The data-scaling curve from ONE pass over the training set (1 epoch), warmup-stable-decay.
    The size-N point is the run that trains on the first N samples of the pass: it shares the
    main run's steps up to where its own decay starts (same fixed warmup, same constant
    learning rate, same batches), so it branches off a copy of the main run's checkpoint there
    and decays over its last `decay_frac` of N / batch_size steps, on its own samples N-20%..N.
    Each point is thus exactly a separate 1-epoch WSD run on N distinct samples; the largest
    point is the main run itself. Cost: one pass plus the decays (~1.2x the largest run alone)."""
    settings = {**settings, "schedule": "wsd", "warmup_steps": args.warmup_steps}
    main_out = R.RUNS / f"scaling-{args.arch}-wsd-main"
    main = None
    batch = settings["batch_size"]
    for n in sorted(args.sizes):
        if main is None:  # the schedule's length is one pass over the samples, known once they are loaded
            main = Trainer(TrainConfig(out=str(main_out), max_steps=1, **R.common(args), **settings), resume=True)
            main.cfg.max_steps = math.ceil(len(main.samples) / batch)
        total = len(main.samples)
        n = min(n, total)
        key = f"scaling-wsd/{args.arch}/{n}"
        if key in R.done_runs():
            continue
        extra = {"kind": "scaling", "arch": args.arch, "samples": n, "epochs": 1, "schedule": "wsd-branch"}
        if n == total:
            R.run(key, main.cfg, extra)
            break
        steps = math.ceil(n / batch)
        start = steps - max(1, int(settings.get("decay_frac", 0.2) * steps))
        out = R.RUNS / f"scaling-{args.arch}-wsd-{n}"
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
        R.run(key, dataclasses.replace(main.cfg, out=str(out), max_steps=steps), extra)


def cmd_served(args):
    """Recipe runs compared as SERVED at a small block (a CPU verifies 3 tokens for about the
    price of one, 4+ for 1.5 steps): each run trains --steps steps (the same number for all:
    equal compute where their block tokens per sequence are equal; the seconds per step are
    recorded), then is evaluated at --block, teacher-forced on the same held-out blocks for
    every run (--anchors per answer) and in the decode loop, and teacher-forced at its own block."""
    for name in args.runs:
        key = f"served/{name}/b{args.block}"
        if key in R.done_runs():
            continue
        settings = {**R.BASE, **R.RECIPE[name]}
        if settings["block_size"] < args.block:
            raise SystemExit(f"{name} trains at block {settings['block_size']}, below the served block {args.block}")
        cfg = TrainConfig(out=str(R.RUNS / f"served-{name}"), **R.common(args), **settings)
        cfg.max_steps = args.steps
        trainer = Trainer(cfg, resume=True)
        trainer.run()
        last = json.loads((Path(cfg.out) / "metrics.jsonl").read_text().splitlines()[-1])
        served = trainer.evaluate_blocks(R.BLOCK_SAMPLES, block_size=args.block, num_anchors=args.anchors)
        own = trainer.evaluate_blocks(R.BLOCK_SAMPLES)
        result = {
            "run": key,
            "kind": "served",
            "change": R.RECIPE[name],
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
        with open(R.RESULTS, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(
            f"{key}: served tau {result['tau_served']:.3f} (teacher-forced {served['tau_blocks']:.3f})", file=sys.stderr
        )
