"""Training experiments behind the README's recipe table and data-scaling curve.

    # recipe: short runs at EQUAL CPU TIME, one setting changed per run from the base recipe
    .venv/bin/python scripts/experiments.py recipe --minutes 12
    # data scaling: the chosen recipe on the first N training samples, same number of epochs
    .venv/bin/python scripts/experiments.py scaling --sizes 1000 2500 5000 10000 20000 --epochs 2
    .venv/bin/python scripts/experiments.py scaling --arch eagle3 ...   # the same curve for the baseline

Equal compute: each recipe run first times a few steps of its own configuration, then gets
as many steps as fit in --minutes (a run with soft labels or more layers gets fewer steps).
Every run ends with the held-out τ measured in the real decode loop (greedy, the same
--eval-prompts held-out prompts for every run). Runs are resumable (checkpoints under
runs/experiments/), results are appended to data/train-logs/experiments.jsonl (committed),
and a finished run is skipped when the script is rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from blockdraft.train.trainer import TrainConfig, Trainer

DATA = "data/regen/smollm2-135m-instruct"
RESULTS = Path("data/train-logs/experiments.jsonl")
RUNS = Path("runs/experiments")
# The base recipe: the shipped drafter's settings.
BASE = dict(block_size=16, num_layers=3, num_anchors=64, batch_size=4, lr=1e-3, draft_vocab=8192,
            init="target-last-fc", max_seq_len=512)
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
    "anchors-32": {"num_anchors": 32},
    "anchors-128": {"num_anchors": 128},
    "block-8": {"block_size": 8},
    "no-clip": {"grad_clip": 0.0},
}


def done_runs() -> set[str]:
    if not RESULTS.is_file():
        return set()
    return {json.loads(line)["run"] for line in RESULTS.read_text().splitlines() if line.strip()}


def set_paths(results: str, runs: str):
    global RESULTS, RUNS
    RESULTS, RUNS = Path(results), Path(runs)


def seconds_per_step(cfg: TrainConfig, steps: int = 4) -> float:
    """Time a few steps of this configuration (after one warm-up step)."""
    probe = dataclasses.replace(cfg, out=str(Path(cfg.out) / "probe"), max_steps=1000, eval_every=10**9)
    trainer = Trainer(probe)
    trainer.train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return (time.perf_counter() - t0) / steps


def run(name: str, cfg: TrainConfig, extra: dict):
    """Train to cfg.max_steps (resuming), evaluate held-out τ at the end, append the result."""
    trainer = Trainer(cfg, resume=True)
    trainer.run()
    records = [json.loads(l) for l in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines() if l]
    last = records[-1]
    result = {"run": name, **extra, "steps": last["step"], "tokens_seen": last["tokens_seen"],
              "minutes": round(last["elapsed"] / 60, 2), "loss": last["loss"], "tau": last.get("tau"),
              "train_samples": len(trainer.samples), "eval_prompts": cfg.eval_prompts,
              "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"},
              "threads": torch.get_num_threads()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"{name}: tau {result['tau']}, {result['steps']} steps, {result['minutes']} min", file=sys.stderr)


def common(args) -> dict:
    return dict(data=args.data, eval_every=10**9, eval_prompts=args.eval_prompts,
                eval_max_new_tokens=args.eval_max_new_tokens, save_every=25, log_every=5, seed=args.seed)


def cmd_recipe(args):
    names = args.runs or list(RECIPE)
    for name in names:
        key = f"recipe/{name}"
        if key in done_runs():
            continue
        out = str(RUNS / f"recipe-{name}")
        settings = {**BASE, **RECIPE[name]}
        cfg = TrainConfig(out=out, **common(args), **settings)
        state = Path(out) / "checkpoint" / "state.json"
        if state.is_file():  # resuming: keep the step count the run was planned with
            cfg.max_steps = json.loads(state.read_text())["config"]["max_steps"]
            per_step = None
        else:
            per_step = seconds_per_step(cfg)
            cfg.max_steps = max(10, int(args.minutes * 60 / per_step))
        print(f"{key}: {cfg.max_steps} steps" + (f" ({per_step:.2f} s/step)" if per_step else ""), file=sys.stderr)
        run(key, cfg, {"kind": "recipe", "change": RECIPE[name], "budget_minutes": args.minutes,
                       "seconds_per_step": per_step})


def cmd_scaling(args):
    settings = dict(BASE)
    if args.arch == "eagle3":
        settings.update(arch="eagle3", block_size=8, init="target-last")
    settings.update(json.loads(args.settings) if args.settings else {})
    for n in args.sizes:
        key = f"scaling/{args.arch}/{n}"
        if key in done_runs():
            continue
        steps = max(10, round(args.epochs * n / settings["batch_size"]))
        cfg = TrainConfig(out=str(RUNS / f"scaling-{args.arch}-{n}"), max_steps=steps, limit_samples=n,
                          **common(args), **settings)
        run(key, cfg, {"kind": "scaling", "arch": args.arch, "samples": n, "epochs": args.epochs})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("recipe", "scaling"):
        p = sub.add_parser(name)
        p.add_argument("--data", default=DATA)
        p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the final τ")
        p.add_argument("--eval-max-new-tokens", type=int, default=96)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--results", default=str(RESULTS), help="JSON lines of finished runs (appended)")
        p.add_argument("--runs-dir", default=str(RUNS), help="checkpoints and metrics of the runs")
    r = sub.choices["recipe"]
    r.add_argument("--minutes", type=float, default=12, help="CPU wall time per run")
    r.add_argument("--runs", nargs="*", choices=list(RECIPE), help="default: all")
    s = sub.choices["scaling"]
    s.add_argument("--sizes", type=int, nargs="+", default=[1000, 2500, 5000, 10000, 20000])
    s.add_argument("--epochs", type=float, default=2)
    s.add_argument("--arch", choices=["dflash", "eagle3"], default="dflash")
    s.add_argument("--settings", help='JSON overrides of the base recipe (the chosen one), e.g. {"lr": 2e-3}')
    args = ap.parse_args()
    set_paths(args.results, args.runs_dir)
    {"recipe": cmd_recipe, "scaling": cmd_scaling}[args.cmd](args)


if __name__ == "__main__":
    main()
