"""Copy a training feature cache's records into another cache folder, stored as --dtype (int8:
half the disk of float16), with the soft labels' top tokens as they are. Keys already in the
destination are skipped, so it resumes; the source is left as it is (delete it afterwards to
reclaim its disk). For the default target, in its training precision:

    .venv/bin/python tools/convert_feature_cache.py runs/feature-cache runs/feature-cache-int8 --dtype int8

`--data FOLDER[,FOLDER]` copies only the samples of those answer folders (training sequences as the
trainer cuts them, `--max-seq-len`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from blockdraft.models.default import default_target_dir  # noqa: E402
from blockdraft.models.loading import load_target  # noqa: E402
from blockdraft.train.data import data_folders, iter_samples  # noqa: E402
from blockdraft.train.features import FeatureCache, sequence_key  # noqa: E402


def convert(src: FeatureCache, dst: FeatureCache, keys=None) -> int:
    """Copy `keys` (default: all of src's) into dst in dst's dtype; returns how many were copied."""
    wanted = list(src.index if keys is None else keys)
    todo = [k for k in wanted if k in src.index and k not in dst.index]
    for key in tqdm(todo, desc="features", unit="sample"):
        rows = src.index[key][2]
        features, _ = src.get([key], rows, "cpu")
        dst.put([key], features, [rows])
    # (on their own: a writer stores a sample's top tokens just after its features)
    for key in [k for k in wanted if k in src._teacher.index and k not in dst._teacher.index]:
        _, _, rows, (start, k) = src._teacher.index[key]
        ids, logp, _ = src.get_teacher([key], start + rows, "cpu")
        dst.put_teacher(key, ids[0, start:, :k], logp[0, start:, :k], start)
    return len(todo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--dtype", choices=["float16", "int8"], default="int8")
    ap.add_argument("--data", help="only the samples of these answer folders (comma-separated)")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--target-dtype", default="bfloat16", help="the precision the cache was made in")
    args = ap.parse_args()
    meta = json.loads((Path(args.src) / "meta.json").read_text())
    target = load_target(default_target_dir(), dtype=getattr(torch, args.target_dtype))
    src = FeatureCache(args.src, target, meta["layers"], readonly=True)
    dst = FeatureCache(args.dst, target, meta["layers"], writer="convert", dtype=args.dtype)
    keys = None
    if args.data:
        keys = [
            sequence_key((s["prompt_ids"] + s["answer_ids"])[: args.max_seq_len])
            for folder in data_folders(args.data)
            for s in iter_samples(folder)
        ]
    print(f"copied {convert(src, dst, keys)} samples to {args.dst} ({args.dtype})", file=sys.stderr)
    src.close()
    dst.close()


if __name__ == "__main__":
    main()
