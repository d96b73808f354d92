"""Sustained regeneration speed: answer tokens per second of `answer_prompts` at several batch sizes.

Each batch size runs the real continuously batched loop (greedy, the default prompt mix, answers up
to --max-new-tokens) for --seconds; the rate is taken over the second half of the run, when the
batch is full of rows at mixed stages, so the first fill does not flatter it. Nothing is written.

    .venv/bin/python scripts/regen_throughput.py --batches 16 64 128 256 --seconds 120
"""

import argparse
import json
import platform

import torch

from blockdraft import Engine
from blockdraft.bench.runner import cpu_name
from blockdraft.train.data import answer_prompts, training_prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--mix", help="prompt sources, e.g. sharegpt=3,sharegpt-code=2 (default: the regenerate default)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    engine = Engine.load(use_draft=False)
    rows = []
    for batch in args.batches:
        prompts = training_prompts(engine.tokenizer, args.mix, args.max_prompt_tokens)
        stats = answer_prompts(engine, prompts, max_new_tokens=args.max_new_tokens, batch_size=batch,
                               max_prompt_tokens=args.max_prompt_tokens, seconds=args.seconds)
        row = {"batch": batch, "sustained_tok_s": round(stats.rate_between(0.5, 1.0), 1),
               "overall_tok_s": round(stats.tokens_per_second, 1), "samples_finished": stats.written,
               "steps": stats.steps, "seconds": round(stats.seconds, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "python": platform.python_version()},
              "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens, "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print("| batch | sustained tok/s | overall tok/s | samples finished |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['sustained_tok_s']} | {r['overall_tok_s']} | {r['samples_finished']} |")


if __name__ == "__main__":
    main()
