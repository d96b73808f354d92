"""A branch off a training run's checkpoint, to see what a change would do to it before the run
takes it: --steps more steps of the run's own samples, anchors and order, held-out decode tau (the
run's evaluation: its prompts, new tokens and block) at the branch's start and end. The change:
`--decay`: the learning rate falls linearly from the run's to 0 over the steps (where a
warmup-stable-decay run would stand if it decayed now); `--lr X`: the run's schedule at peak rate X;
`--draft-vocab N`: the run's draft
vocabulary widened to N tokens (`blockdraft train --resume --draft-vocab N`); neither: the run as it
is (the control of an A/B). The run is untouched: the branch trains in --out, reads the run's
feature cache and stores what it computes there under its own writer name (the run reads those
later). Appends a record to --results (JSON lines), with the mean training loss of the branch's logged
steps: branches from one step train on the same batches, so their losses compare directly.

    B=".venv/bin/python benchmarks/branch.py --run runs/wide16 --results data/train-logs/branches.jsonl"
    $B --decay --steps 400 --out runs/wide16-decay
    $B --steps 600 --out runs/wide16-same && $B --steps 600 --draft-vocab 16384 --out runs/wide16-vocab
    $B --steps 500 --lr 6e-4 --out runs/wide16-lr

Pause the run meanwhile (two torch jobs on two cores thrash).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from blockdraft.train.config import TrainConfig
from blockdraft.train.features import FeatureCache
from blockdraft.train.trainer import Trainer


def seconds_per_step(records: list[dict]) -> float | None:
    """A run's wall seconds a training step between its first and last logged steps (metrics.jsonl
    records; evaluations excluded where none falls between them)."""
    if len(records) < 2 or records[-1]["step"] == records[0]["step"]:
        return None
    spent = records[-1]["elapsed"] - records[0]["elapsed"]
    return round(spent / (records[-1]["step"] - records[0]["step"]), 3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a run folder with a checkpoint (runs/NAME)")
    ap.add_argument("--steps", type=int, default=400, help="the branch's length, in steps")
    ap.add_argument("--decay", action="store_true", help="the learning rate falls linearly to 0 over the steps")
    ap.add_argument("--lr", type=float, help="the branch's peak learning rate (the run's schedule at this rate)")
    ap.add_argument("--draft-vocab", type=int, help="widen the run's draft vocabulary to this many tokens")
    ap.add_argument("--out", required=True, help="the branch's own run folder (replaced)")
    ap.add_argument("--results", help="append the branch's record here (JSON lines)")
    args = ap.parse_args(argv)
    run, out = Path(args.run), Path(args.out)
    if not (run / "checkpoint" / "state.json").is_file():
        raise SystemExit(f"branch: {run} holds no checkpoint")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(run / "checkpoint", out / "checkpoint")
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    cfg = TrainConfig(**dict(state["config"], out=str(out), eval_every=0, save_every=10**9))
    if args.draft_vocab:
        cfg.draft_vocab = args.draft_vocab
    cache, cfg.feature_cache = cfg.feature_cache, None  # (the trainer would open it as the run's writer)
    trainer = Trainer(cfg, resume=True)
    cfg.feature_cache = cache
    if args.lr:  # (after the checkpoint's settings are checked: the rate is the branch's change)
        cfg.lr = args.lr
    if cache:  # the run's cache, written under the branch's own name
        trainer.features = FeatureCache(
            cfg.feature_cache,
            trainer.target,
            trainer.drafter.config.target_layer_ids,
            writer="branch",
            dtype=cfg.feature_dtype,
            reserve=int(cfg.feature_cache_reserve * 2**30),
        )
    start, lr = trainer.step, cfg.lr
    t0 = time.perf_counter()
    before = trainer.evaluate_tau()
    print(f"branch: {run} at step {start}: held-out tau {before:.3f}", file=sys.stderr)
    if args.decay:  # the schedule's decay starts at this step and ends after --steps (lr_at: the last decay_frac)
        cfg.max_steps = start + args.steps
        cfg.decay_frac = (args.steps + 0.5) / cfg.max_steps
    trainer.run(until=start + args.steps)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    after = records[-1]["tau"] if "tau" in records[-1] else trainer.evaluate_tau()  # (a decay's last step evaluates)
    record = {
        "run": str(run),
        "from_step": start,
        "steps": args.steps,
        "decay": args.decay,
        "draft_vocab": trainer.drafter.draft_vocab.numel() if cfg.draft_vocab else 0,
        "added_rows": "kept rows' mean" if args.draft_vocab else None,  # (`checkpoints.widen_draft_vocab`)
        "lr": lr,
        "tau_before": round(before, 4),
        "tau_after": round(after, 4),
        "eval": {"prompts": cfg.eval_prompts, "max_new_tokens": cfg.eval_max_new_tokens, "block": cfg.block_size},
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "seconds_per_step": seconds_per_step(records),
        "mean_loss": round(sum(r["loss"] for r in records) / len(records), 4),
        "command": " ".join(["benchmarks/branch.py", *sys.argv[1:]]),
    }
    print(json.dumps(record))
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
    trainer.close()


if __name__ == "__main__":
    main()
