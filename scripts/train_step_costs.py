"""Where a training step's time goes, and what the feature cache saves (the README's figures).

For each architecture (the scaling runs' settings on the default data): the target's forward
alone, then --steps steps that compute and store the features in a fresh cache, then the same
steps reading them back; prints the medians (the first step of each pass is left out).

    .venv/bin/python scripts/train_step_costs.py [--arch dflash eagle3] [--steps 6]
"""

import argparse
import statistics
import sys
import tempfile
import time

import torch

from blockdraft.train.trainer import TrainConfig, Trainer

SETTINGS = {
    "dflash": dict(block_size=8, num_layers=3, num_anchors=32, init="target-last-fc"),
    "eagle3": dict(arch="eagle3", block_size=8, num_anchors=32, init="target-last"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--data", default="data/regen/smollm2-135m-instruct")
    args = ap.parse_args()
    for arch in args.arch:
        with tempfile.TemporaryDirectory() as tmp:
            tr = Trainer(TrainConfig(data=args.data, out=f"{tmp}/run", max_steps=100, batch_size=4, lr=1e-3,
                                     draft_vocab=8192, max_seq_len=512, eval_every=10**9, save_every=10**9,
                                     feature_cache=f"{tmp}/cache", **SETTINGS[arch]))
            layers = tuple(tr.drafter.config.target_layer_ids)

            def timed(run):
                out = []
                for s in range(args.steps):
                    t = time.perf_counter()
                    run(s)
                    out.append(time.perf_counter() - t)
                return statistics.median(out[1:])

            def target_only(s):
                batch = tr.batch_at(s)
                with torch.no_grad():
                    n, w = batch.tokens.shape
                    tr.target(batch.tokens, torch.arange(w).expand(n, -1), capture=layers, features_only=True)

            def step(s):
                tr.step = s
                tr.train_step()

            forward = timed(target_only)
            storing = timed(step)
            reading = timed(step)
            print(f"{arch}: target forward {forward:.2f} s of a {storing:.2f} s step ({forward / storing:.0%}) that "
                  f"also stores the features; reading them back: {reading:.2f} s ({storing / reading:.1f}x)",
                  file=sys.stderr)
            tr.features.close()


if __name__ == "__main__":
    main()
