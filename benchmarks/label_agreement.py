"""How far an answer folder's tokens are from the target's own most likely tokens, and how much of
the target's distribution its top k tokens hold: what hard labels lose and soft labels (`train
--distill`, the top TEACHER_TOPK tokens kept in the feature cache) keep.

    .venv/bin/python benchmarks/label_agreement.py data/regen/smollm2-135m-instruct-a1 \\
        data/regen/smollm2-135m-instruct-synth --samples 40 --dtype bfloat16

Per folder, over the answer positions of its first --samples samples (one forward over each whole
sequence): the share whose token is not the target's argmax, the target's mean top probability,
the mean probability of the answer's own token, the entropy (nats), and the mass of the top 4 ... 64.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from blockdraft.models.default import default_target_dir
from blockdraft.models.loading import load_target
from blockdraft.train.data import iter_samples


def agreement(target, samples, ks=(4, 8, 16, 32, 64)) -> dict:
    n = wrong = 0
    top = own = entropy = 0.0
    mass = dict.fromkeys(ks, 0.0)
    for s in samples:
        ids, start = s["prompt_ids"] + s["answer_ids"], len(s["prompt_ids"])
        with torch.no_grad():
            final, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None])
            probs = target.logits(final[0, start - 1 : len(ids) - 1]).float().softmax(-1)
        y = torch.tensor(s["answer_ids"])
        n += len(y)
        wrong += int((probs.argmax(-1) != y).sum())
        top += float(probs.max(-1).values.sum())
        own += float(probs.gather(1, y[:, None]).sum())
        entropy += float(-(probs * probs.clamp_min(1e-12).log()).sum())
        cum = probs.topk(max(ks), -1).values.cumsum(-1)
        for k in ks:
            mass[k] += float(cum[:, k - 1].sum())
    return {
        "positions": n,
        "not_argmax": round(wrong / n, 4),
        "top_prob": round(top / n, 4),
        "own_prob": round(own / n, 4),
        "entropy": round(entropy / n, 3),
        "top_k_mass": {k: round(v / n, 4) for k, v in mass.items()},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--samples", type=int, default=40, help="the first N samples of each folder")
    ap.add_argument("--dtype", default="float32", help="the target's dtype (bfloat16 only where the CPU has it)")
    args = ap.parse_args()
    target = load_target(default_target_dir(), dtype=getattr(torch, args.dtype))
    for folder in args.folders:
        samples = list(itertools.islice(iter_samples(folder), args.samples))
        row = {
            "folder": folder,
            "temperature": samples[0].get("temperature", 0.0),
            "answers_dtype": samples[0].get("dtype", "float32"),
            **agreement(target, samples),
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
