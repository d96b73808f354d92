"""How much of the target's answers a drafter's draft vocabulary covers, and what the most frequent
N tokens of the training answers would cover. A token outside the draft vocabulary is never
drafted, so a chain never survives it: coverage bounds every draft position's acceptance.

Counts the answer tokens of the training split of every --data folder, and measures coverage on
the held-out split of the first one (the greedy answers the held-out tau is measured on).

    .venv/bin/python benchmarks/vocab_coverage.py --draft runs/wide16/position/drafter \
        --data 'data/regen/smollm2-135m-instruct*' [--sizes 8192 16384 32768]
"""

from __future__ import annotations

import argparse
import glob

import torch

from blockdraft.draft import DFlashDrafter
from blockdraft.train.data import iter_samples


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="a DFlash drafter folder with a draft vocabulary")
    ap.add_argument("--data", required=True, help="answer folders (a glob; the first holds the held-out split)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 12288, 16384, 24576, 32768])
    args = ap.parse_args(argv)
    drafter = DFlashDrafter.load(args.draft)
    vocab = drafter.config.vocab_size
    if getattr(drafter, "draft_vocab", None) is None:
        raise SystemExit(f"vocab_coverage: {args.draft} scores the whole vocabulary")
    folders = sorted(glob.glob(args.data))
    if not folders:
        raise SystemExit(f"vocab_coverage: no folder matches {args.data}")
    train = torch.zeros(vocab, dtype=torch.float64)
    held = torch.zeros(vocab, dtype=torch.float64)
    for i, folder in enumerate(folders):
        for s in iter_samples(folder):
            counts = torch.bincount(torch.as_tensor(s["answer_ids"], dtype=torch.long), minlength=vocab).double()
            if s["split"] != "valid":
                train += counts
            elif i == 0:
                held += counts
    mine = torch.zeros(vocab, dtype=torch.bool)
    mine[drafter.draft_vocab] = True
    cover = lambda counts, keep: float(counts[keep].sum() / counts.sum())  # noqa: E731
    print(
        f"{args.draft}: {int(mine.sum())} tokens; answer tokens covered: held-out {cover(held, mine):.4f}, "
        f"training {cover(train, mine):.4f} ({len(folders)} folders, {int(train.sum()):,} training answer tokens)"
    )
    order = torch.argsort(-train, stable=True)
    for n in args.sizes:
        top = torch.zeros(vocab, dtype=torch.bool)
        top[order[:n]] = True
        print(
            f"the {n} most frequent training answer tokens: held-out {cover(held, top):.4f}, "
            f"training {cover(train, top):.4f}"
        )


if __name__ == "__main__":
    main()
