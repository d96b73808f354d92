"""What every training experiment of `experiments.py` shares: the base recipe, the results log
(data/train-logs/experiments.jsonl), resumable runs timed to equal CPU, their data folders."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from blockdraft.machine import cpu_name
from blockdraft.train.data import ShardWriter
from blockdraft.train.config import TrainConfig
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


# Settings that change what a step costs; runs that differ only elsewhere (learning rate,
# schedule, clipping) share one timing and so get exactly the same number of steps.
COST_KEYS = ("block_size", "num_layers", "num_anchors", "batch_size", "draft_vocab", "max_seq_len", "distill", "arch")


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
