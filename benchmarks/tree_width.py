"""τ of DFlash trees against the number of candidates per block position (the README's width figures).

For each dataset, the first `--prompts` first turns, greedy, `--max-new-tokens` each; a tree of
`--nodes` draft nodes built from the top-k candidates per position, for each k. Prints the mean
tokens per verify step (τ). τ does not depend on timing, so this can run beside other work.

    python benchmarks/tree_width.py [--widths 4,8,16,32] [--nodes 32] [--prompts 4] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse

from blockdraft import Engine
from blockdraft.bench.runner import load_prompts
from blockdraft.proposers import DFlashTreeProposer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", default="humaneval,mtbench")
    ap.add_argument("--widths", default="4,8,16,32")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    engine = Engine.load()
    print("| dataset | " + " | ".join(f"top-{k}" for k in args.widths.split(",")) + " |")
    for dataset in args.datasets.split(","):
        records = load_prompts(dataset, None, args.prompts, first_turn_only=True)
        taus = []
        for k in (int(w) for w in args.widths.split(",")):
            lengths = []
            for rec in records:
                proposer = DFlashTreeProposer(engine.drafter_for("dflash"), engine.target, top_k=k)
                out = engine.generate(rec["turns"][0], chat=True, proposer=proposer, block_size=args.nodes + 1,
                                      max_new_tokens=args.max_new_tokens)
                lengths += out.acceptance_lengths
            taus.append(sum(lengths) / len(lengths))
        print(f"| {dataset} | " + " | ".join(f"{t:.2f}" for t in taus) + " |", flush=True)


if __name__ == "__main__":
    main()
