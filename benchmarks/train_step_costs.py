"""Where a training step's time goes, what the feature cache saves, and what a bf16 target
buys on a CPU that multiplies bf16 natively (the README's figures).

For each architecture and target dtype (the scaling runs' settings on the default data): the
target's forward alone, then --steps steps that compute and store the features in a fresh
cache, then the same steps reading them back; prints the medians (the first step of each pass
is left out). With --tau-samples N, also the shipped drafter's teacher-forced acceptance on N
held-out answers under each dtype: whether a drafter trained on one dtype's features serves
on the other's.

    .venv/bin/python benchmarks/train_step_costs.py [--arch dflash eagle3] [--steps 6]
        [--dtype float32 bfloat16] [--tau-samples 64]

With --run DIR instead: the median of --steps steps of that run's own configuration (its
checkpoint's), from its last position, on samples of its first steps (so that they read its
feature cache), without changing the run.
"""

import argparse
import statistics
import sys
import tempfile
import time

import torch

from blockdraft.engine import shipped_drafter
from blockdraft.train.config import TrainConfig
from blockdraft.train.trainer import Trainer

SETTINGS = {
    "dflash": dict(block_size=8, num_layers=3, num_anchors=32, init="target-last-fc", markov_rank=256),
    "eagle3": dict(arch="eagle3", block_size=8, num_anchors=32, init="target-last"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--data", default="data/regen/smollm2-135m-instruct")
    ap.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="the target's dtype (bfloat16: the drafter under autocast, as `train --dtype`)",
    )
    ap.add_argument(
        "--tau-samples",
        type=int,
        default=0,
        help=">0: the shipped drafter's teacher-forced tau on this many held-out answers, per dtype",
    )
    ap.add_argument("--run", help="a run folder (runs/NAME): time its own steps instead")
    args = ap.parse_args()
    if args.run:
        return measure_run(args)
    for arch in args.arch:
        for dtype in args.dtype:
            measure(args, arch, dtype)


def measure(args, arch: str, dtype: str):
    shipped = shipped_drafter(arch)
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(
            TrainConfig(
                data=args.data,
                out=f"{tmp}/run",
                max_steps=100,
                batch_size=4,
                lr=1e-3,
                draft_vocab=8192,
                max_seq_len=512,
                eval_every=10**9,
                save_every=10**9,
                feature_cache=f"{tmp}/cache",
                dtype=dtype,
                **SETTINGS[arch],
                init_from=str(shipped) if shipped else None,
            )
        )
        layers = tuple(tr.drafter.config.target_layer_ids)
        if args.tau_samples > 0 and shipped:  # before any step changes the drafter
            cache, tr.features = tr.features, None  # the live target's features, in this dtype
            blocks = tr.evaluate_blocks(num_samples=args.tau_samples)
            tr.features = cache
            print(
                f"{arch} ({dtype} target): shipped drafter's teacher-forced tau {blocks['tau_blocks']:.4f} "
                f"over {blocks['blocks']} held-out blocks",
                file=sys.stderr,
            )

        def timed(run):
            out = []
            for s in range(args.steps):
                t = time.perf_counter()
                run(s)
                out.append(time.perf_counter() - t)
            return statistics.median(out[1:])

        def target_only(s):
            batch = tr.batch_at(s)
            with torch.no_grad(), tr.autocast:
                n, w = batch.tokens.shape
                tr.target_forward(batch.tokens, torch.arange(w).expand(n, -1), layers, full=False)

        def step(s):
            tr.step = s
            tr.train_step()

        forward = timed(target_only)
        storing = timed(step)
        reading = timed(step)
        print(
            f"{arch} ({dtype} target): target forward {forward:.2f} s of a {storing:.2f} s step "
            f"({forward / storing:.0%}) that also stores the features; reading them back: {reading:.2f} s "
            f"({storing / reading:.1f}x)",
            file=sys.stderr,
        )
        tr.features.close()


def measure_run(args):
    import json
    from pathlib import Path

    run = Path(args.run)
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(state["config"], out=f"{tmp}/run", eval_every=10**9, save_every=10**9)
        cfg["init_from"] = str(run / "position" / "drafter")
        tr = Trainer(TrainConfig(**cfg))
        times = []
        for s in range(100, 101 + args.steps):
            t = time.perf_counter()
            tr.step = s
            float(tr.train_step()["loss"])
            times.append(time.perf_counter() - t)
        print(
            f"{run}: a step of its configuration (block {cfg['block_size']}, {cfg['num_anchors']} anchors, "
            f"batch {cfg['batch_size']}, {state['target_dtype']} target) reading its feature cache: "
            f"{statistics.median(times[1:]):.2f} s (median of {args.steps})",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
