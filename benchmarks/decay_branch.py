"""Where a warmup-stable-decay run would stand if it decayed now: a branch off its checkpoint whose
learning rate falls linearly from the run's to 0 over --steps steps (the run's own samples, anchors
and order from its step on), with held-out decode tau (the run's evaluation: its prompts, new
tokens and block) before and after. The run is untouched: the branch trains in --out, reads the
run's feature cache and stores what it computes there under its own writer name (the run reads
those later). Appends a record to --results (JSON lines).

    .venv/bin/python benchmarks/decay_branch.py --run runs/wide16 --steps 400 --out runs/wide16-decay \
        --results data/train-logs/decay-branches.jsonl

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a run folder with a checkpoint (runs/NAME)")
    ap.add_argument("--steps", type=int, default=400, help="the branch's decay, in steps")
    ap.add_argument("--out", required=True, help="the branch's own run folder (replaced)")
    ap.add_argument("--results", help="append the branch's record here (JSON lines)")
    args = ap.parse_args(argv)
    run, out = Path(args.run), Path(args.out)
    if not (run / "checkpoint" / "state.json").is_file():
        raise SystemExit(f"decay_branch: {run} holds no checkpoint")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(run / "checkpoint", out / "checkpoint")
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    cfg = TrainConfig(**dict(state["config"], out=str(out), eval_every=0, save_every=10**9))
    cache, cfg.feature_cache = cfg.feature_cache, None  # (the trainer would open it as the run's writer)
    trainer = Trainer(cfg, resume=True)
    cfg.feature_cache = cache
    if cache:  # the run's cache, written under the branch's own name
        trainer.features = FeatureCache(
            cfg.feature_cache,
            trainer.target,
            trainer.drafter.config.target_layer_ids,
            writer="decay-branch",
            dtype=cfg.feature_dtype,
            reserve=int(cfg.feature_cache_reserve * 2**30),
        )
    start, lr = trainer.step, cfg.lr
    t0 = time.perf_counter()
    before = trainer.evaluate_tau()
    print(f"decay_branch: {run} at step {start}: held-out tau {before:.3f}", file=sys.stderr)
    # the schedule's decay starts at this step and ends after --steps (lr_at: the last decay_frac of max_steps)
    cfg.max_steps = start + args.steps
    cfg.decay_frac = (args.steps + 0.5) / cfg.max_steps
    trainer.run()  # evaluates at its last step (metrics.jsonl)
    after = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]["tau"]
    record = {
        "run": str(run),
        "from_step": start,
        "decay_steps": args.steps,
        "lr": lr,
        "tau_before": round(before, 4),
        "tau_after": round(after, 4),
        "eval": {"prompts": cfg.eval_prompts, "max_new_tokens": cfg.eval_max_new_tokens, "block": cfg.block_size},
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "command": " ".join(["benchmarks/decay_branch.py", *sys.argv[1:]]),
    }
    print(json.dumps(record))
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
    trainer.close()


if __name__ == "__main__":
    main()
