"""Does a run fit the samples it has trained on better than others? Teacher-forced acceptance of one
position (a checkpoint or committed position: a folder with state.json and drafter/) on four pools of
its own data: held-out answers, samples of its last --recent steps, of its first --recent steps, and
samples it has not reached yet in its first epoch. Seen samples fit no better
than unseen ones: the drafter is not memorising, and more epochs act as more optimisation on data
it generalises from; seen ones fit much better: it is, and held-out acceptance is what to watch.

    .venv/bin/python benchmarks/fit_check.py --position data/train-logs/positions/wide16 [--samples 96]

Prints per pool τ_blocks (1 + the mean correct prefix of a greedy block at random anchors) and the
first positions' accuracy (`Trainer.evaluate_blocks`). Pause a training run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from blockdraft.train.config import TrainConfig
from blockdraft.train.trainer import Trainer


def pools(trainer: Trainer, step: int, recent: int, n: int) -> dict[str, list]:
    """n samples spread over each pool (the run's epoch-0 order; steps of batch_size samples)."""
    order, per = trainer.epoch_order(0), trainer.cfg.batch_size
    total = len(order) // per  # the first epoch's steps

    def spread(first: int, last: int) -> list:
        idx = order[first * per : last * per]
        return [trainer.samples[i] for i in idx[:: max(1, len(idx) // n)][:n]]

    if step >= total:
        raise SystemExit(f"fit_check: step {step} is past the first epoch ({total} steps): every sample is seen")
    return {
        "held-out": trainer.valid[:n],
        f"seen at steps {max(0, step - recent):,}-{step:,}": spread(max(0, step - recent), step),
        f"seen at steps 0-{min(step, recent):,}": spread(0, min(step, recent)),
        f"not yet seen (steps {step:,}-{total:,})": spread(step, total),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--position", required=True, help="a folder with state.json and drafter/")
    ap.add_argument("--samples", type=int, default=96, help="samples in each pool")
    ap.add_argument("--recent", type=int, default=2400, help="the last steps whose samples count as recently seen")
    args = ap.parse_args(argv)
    pos = Path(args.position)
    state = json.loads((pos / "state.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(state["config"], out=f"{tmp}/run", eval_every=10**9, save_every=10**9, feature_cache=None)
        cfg["init_from"] = str(pos / "drafter")
        trainer = Trainer(TrainConfig(**cfg))
        print(f"fit_check: {pos} at step {state['step']:,}, block {cfg['block_size']}", file=sys.stderr)
        for name, pool in pools(trainer, state["step"], args.recent, args.samples).items():
            trainer.valid = pool
            r = trainer.evaluate_blocks(num_samples=len(pool))
            acc = " / ".join(f"{a:.2f}" for a in r["val_acc"][:4])
            print(f"{name}: {len(pool)} samples, tau_blocks {r['tau_blocks']:.3f}, accuracy at positions 1-4 {acc}")


if __name__ == "__main__":
    main()
