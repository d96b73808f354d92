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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import experiment_runs as R  # noqa: E402
from experiment_ablations import (  # noqa: E402
    cmd_blocks,
    cmd_context,
    cmd_epochs,
    cmd_features,
    cmd_labels,
    cmd_markov,
    cmd_sampling,
    cmd_spread,
)
from experiment_recipe import cmd_recipe, cmd_scaling, cmd_served  # noqa: E402
from experiment_table import cmd_table  # noqa: E402


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
        p.add_argument("--data", default=R.DATA)
        p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the final τ")
        p.add_argument("--eval-max-new-tokens", type=int, default=96)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--results", default=str(R.RESULTS), help="JSON lines of finished runs (appended)")
        p.add_argument("--runs-dir", default=str(R.RUNS), help="checkpoints and metrics of the runs")
    r = sub.choices["recipe"]
    r.add_argument("--minutes", type=float, default=10, help="CPU wall time per run")
    r.add_argument("--runs", nargs="*", choices=list(R.RECIPE), help="default: all")
    sub.choices["table"].add_argument("--plot", help="write the data-scaling curve to this PNG")
    v = sub.choices["served"]
    v.add_argument("--runs", nargs="+", choices=list(R.RECIPE), required=True)
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
    e.add_argument("--arch", choices=sorted(R.EPOCH_RECIPES), default="dflash")
    e.add_argument("--samples", type=int, default=2000, help="the first N training samples (the same for every arch)")
    e.add_argument("--epochs", type=int, nargs="+", default=[1, 2, 4, 6, 10], help="where the curve is measured")
    e.add_argument("--max-epochs", type=int, default=10, help="the main run's length (its own decay is the last point)")
    e.add_argument("--warmup-steps", type=int, default=25)
    e.add_argument("--feature-cache", default=None, help="default: runs/feature-cache-ARCH")
    e.add_argument("--dtype", default="float32", help="the target's dtype (bfloat16 only where the CPU has it)")
    for name in ("labels", "features", "spread"):
        lb = sub.choices[name]
        lb.add_argument("--arch", choices=sorted(R.EPOCH_RECIPES), default="dspark")
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
    R.set_paths(args.results, args.runs_dir)
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
