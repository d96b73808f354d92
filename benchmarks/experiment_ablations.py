"""`experiments.py sampling | markov | context | epochs | labels | features | spread | blocks`: the
equal-compute A/Bs of the training recipe (docs/history/training-ab.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import torch

from blockdraft.train.answers import prompt_of
from blockdraft.train.data import iter_samples
from blockdraft.train.features import TEACHER_TOPK
from blockdraft.train.config import TrainConfig
from blockdraft.train.samples import adopt_position
from blockdraft.train.trainer import Trainer
import experiment_runs as R  # noqa: E402


def sampling_data(sources: dict[str, str], out: Path) -> dict[str, dict]:
    """One folder per source holding its training answers to the prompts that EVERY source
    answers (so the branches differ only in the answers), plus the first source's held-out
    answers (the same evaluation set for all). Written once; returns per-source counts."""
    train = {name: [s for s in iter_samples(folder) if s["split"] == "train"] for name, folder in sources.items()}
    common = set.intersection(*({prompt_of(s["id"]) for s in rows} for rows in train.values()))
    first = next(iter(sources.values()))
    valid = [s for s in iter_samples(first) if s["split"] == "valid"]
    info = {}
    for name, rows in train.items():
        folder = out / name
        kept = [s for s in rows if prompt_of(s["id"]) in common]
        R.write_folder(folder, kept + valid)
        info[name] = {
            "folder": str(folder),
            "source": sources[name],
            "prompts": len(common),
            "train_samples": len(kept),
            "valid_samples": len(valid),
            "answer_tokens": sum(len(s["answer_ids"]) for s in kept),
            "temperature": kept[0].get("temperature", 0.0) if kept else None,
        }
    return info


def cmd_sampling(args):
    """Greedy vs sampled answers at equal training compute. Every branch starts from the shipped
    drafter (which has seen the greedy answers of every training prompt) and trains --steps steps
    on its source's answers to the same prompts; all are then measured on the greedy source's
    held-out answers (teacher-forced τ) and held-out prompts (decode loop), as is the untouched
    shipped drafter ("start"). The question it answers: with greedy answers for every prompt,
    does a further pass gain more from new sampled answers (and at which temperature) than
    from the greedy ones again?"""
    sources = dict(item.split("=", 1) for item in args.sources)
    info = sampling_data(sources, R.RUNS / "sampling-data")
    for name, row in info.items():
        print(
            f"{name}: {row['train_samples']} answers to {row['prompts']} prompts, {row['answer_tokens']} answer tokens",
            file=sys.stderr,
        )
    settings = R.from_shipped(args)
    first = next(iter(info))
    if "sampling/start" not in R.done_runs():
        cfg = TrainConfig(data=info[first]["folder"], out=str(R.RUNS / "sampling-start"), max_steps=0, **settings)
        trainer = Trainer(cfg)
        result = {
            "run": "sampling/start",
            "kind": "sampling",
            "source": "(shipped, no further step)",
            "steps": 0,
            "tau": trainer.evaluate_tau(),
            **trainer.evaluate_blocks(R.BLOCK_SAMPLES),
            "eval_prompts": cfg.eval_prompts,
            "threads": torch.get_num_threads(),
        }
        with open(R.RESULTS, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"start: tau {result['tau']:.3f}, teacher-forced {result['tau_blocks']:.3f}", file=sys.stderr)
    for name, row in info.items():
        key = f"sampling/{name}"
        if key in R.done_runs():
            continue
        cfg = TrainConfig(data=row["folder"], out=str(R.RUNS / f"sampling-{name}"), max_steps=args.steps, **settings)
        R.run(key, cfg, {"kind": "sampling", **row})


def cmd_markov(args):
    """DFlash against the same drafter with a DSpark-style Markov head, at equal steps on the same
    data in the same order: both start from the shipped drafter (the head starts fresh), both
    are measured on the same held-out answers (teacher-forced τ) and prompts (decode loop)."""
    settings = {**R.from_shipped(args), "data": args.data}
    for name, rank in (("dflash", 0), (f"dspark-r{args.rank}", args.rank)):
        key = f"markov/{name}"
        if key in R.done_runs():
            continue
        cfg = TrainConfig(out=str(R.RUNS / f"markov-{name}"), max_steps=args.steps, markov_rank=rank, **settings)
        R.run(key, cfg, {"kind": "markov", "markov_rank": rank, "data": args.data})


def cmd_context(args):
    """Training context at equal CPU time: the shipped drafter trained further on the same answers
    (the sampled ones, up to 512 tokens) with every sequence cut at --short tokens, or kept up to
    --long. Each branch is timed first and gets the steps that fit in --minutes; both are measured
    on the same held-out prompts in the decode loop (--eval-max-new-tokens, the benchmark's 256 by
    default). Their teacher-forced rows are not comparable: each is over the held-out answers cut
    at its own length."""
    settings = {**R.from_shipped(args), "data": args.data}
    for length in (args.short, args.long):
        key = f"context/{length}"
        if key in R.done_runs():
            continue
        cfg = TrainConfig(out=str(R.RUNS / f"context-{length}"), **{**settings, "max_seq_len": length})
        per_step = R.seconds_per_step(cfg)
        cfg.max_steps = max(10, int(args.minutes * 60 / per_step))
        print(f"{key}: {per_step:.2f} s/step -> {cfg.max_steps} steps", file=sys.stderr)
        R.run(
            key,
            cfg,
            {
                "kind": "context",
                "max_seq_len": length,
                "data": args.data,
                "budget_minutes": args.minutes,
                "seconds_per_step": round(per_step, 3),
            },
        )


def cmd_epochs(args):
    """The epoch curve: ONE warmup-stable-decay run over --max-epochs epochs of the first
    --samples training samples, and at each of --epochs a branch that decays from the main run
    (its last `decay_frac` of e epochs) and is measured, so that the e-epoch point is exactly a
    separate e-epoch WSD run. The main run's position (weights and step, no optimizer state)
    is written to data/train-logs/positions/epochs-ARCH at every checkpoint: commit it, and on
    another machine the same command continues from it (AdamW's moments rebuilt). The target's
    features are kept in --feature-cache from the first epoch on."""
    settings = {
        **R.EPOCH_RECIPES[args.arch],
        "schedule": "wsd",
        "warmup_steps": args.warmup_steps,
        "limit_samples": args.samples,
        "dtype": args.dtype,
        # one cache per arch: each kind captures its own target layers
        "feature_cache": args.feature_cache or f"runs/feature-cache-{args.arch}",
    }
    main_out = R.RUNS / f"epochs-{args.arch}-main"
    position = R.RESULTS.parent / "positions" / f"epochs-{args.arch}"  # committed (weights, no optimizer state)
    if (position / "state.json").is_file() and adopt_position(position, main_out):
        print(f"epochs: continuing from the committed position {position}", file=sys.stderr)
    cfg = TrainConfig(out=str(main_out), max_steps=1, **R.common(args), **settings)
    main = Trainer(cfg, resume=True, position_dir=position)
    per_epoch = math.ceil(len(main.samples) / cfg.batch_size)
    main.cfg.max_steps = per_epoch * args.max_epochs
    for e in sorted(args.epochs):
        key = f"epochs/{args.arch}/{e}"
        if key in R.done_runs():
            continue
        extra = {
            "kind": "epochs",
            "arch": args.arch,
            "epochs": e,
            "samples": len(main.samples),
            "steps_per_epoch": per_epoch,
        }
        steps = per_epoch * e
        if e == args.max_epochs:
            R.run(key, main.cfg, extra, trainer=main)
            continue
        start = steps - max(1, int(cfg.decay_frac * steps))
        out = R.RUNS / f"epochs-{args.arch}-{e}"
        if not (out / "checkpoint").is_dir():
            if main.step > start:
                raise SystemExit(f"{key}: the main run is at step {main.step}, past this branch's start {start}")
            main.run(until=start)
            out.mkdir(parents=True, exist_ok=True)
            shutil.copytree(main_out / "checkpoint", out / "checkpoint")
            if (main_out / "metrics.jsonl").is_file():
                shutil.copy(main_out / "metrics.jsonl", out / "metrics.jsonl")
        R.run(key, dataclasses.replace(main.cfg, out=str(out), max_steps=steps), extra)


def labels_data(source: str, offset: int, samples: int, out: Path) -> dict:
    """Training samples [offset, offset + samples) of `source`'s training split (shards are only
    ever appended, so the same slice on any checkout) and its whole held-out split, in one folder."""
    rows = list(iter_samples(source))
    train = [s for s in rows if s["split"] == "train"][offset : offset + samples]
    valid = [s for s in rows if s["split"] == "valid"]
    if len(train) < samples:
        raise SystemExit(f"labels: {source} has {len(train)} training samples from {offset}, not {samples}")
    R.write_folder(out, train + valid)
    return {
        "folder": str(out),
        "source": source,
        "offset": offset,
        "train_samples": len(train),
        "valid_samples": len(valid),
        "answer_tokens": sum(len(s["answer_ids"]) for s in train),
        "temperature": train[0].get("temperature", 0.0),
    }


def slice_run(args, kind: str, key: str, out: str, overrides: dict, extra: dict, samples: int, epochs: float):
    """One run of the epoch curve's recipe from scratch on training samples [--offset, --offset +
    samples) of --data (`labels_data`) for `epochs` epochs, measured on --data's held-out prompts and
    answers (the same for every slice of one folder)."""
    if key in R.done_runs():
        return  # (before the slice: labels_data reads the whole source folder and writes the slice)
    name = f"{Path(args.data).name}-{args.offset}-{samples}"
    info = labels_data(args.data, args.offset, samples, R.RUNS / f"labels-data-{name}")
    steps = math.ceil(epochs * math.ceil(samples / R.EPOCH_RECIPES[args.arch]["batch_size"]))
    settings = {
        **R.EPOCH_RECIPES[args.arch],
        "schedule": "wsd",
        "warmup_steps": args.warmup_steps,
        "dtype": args.dtype,
        "feature_cache": args.feature_cache,
        **overrides,
    }
    cfg = TrainConfig(out=str(R.RUNS / out), max_steps=steps, **{**R.common(args), "data": info["folder"]}, **settings)
    R.run(key, cfg, {"kind": kind, "arch": args.arch, "epochs": epochs, **extra, **info})


def slice_runs(args, kind: str, variants: list[tuple[str, dict, dict]]):
    """One run per variant (name, TrainConfig overrides, recorded fields) of the epoch curve's recipe
    from scratch on the same slice of --data (--samples from --offset), at equal steps (--epochs),
    each measured on the same held-out prompts and answers (`slice_run`)."""
    name = f"{Path(args.data).name}-{args.offset}-{args.samples}"
    for variant, overrides, extra in variants:
        slice_run(
            args,
            kind,
            f"{kind}/{args.arch}/{name}/{variant}",
            f"{kind}-{args.arch}-{name}-{variant}",
            overrides,
            extra,
            args.samples,
            args.epochs,
        )


def cmd_spread(args):
    """The same steps spent on more answers or on more epochs: for each E of --epochs, --samples
    answers for E epochs against E x --samples answers (from the same --offset of --data) for one,
    from scratch, measured on the same held-out prompts and answers. Whether a drafter kind learns
    more from new data than from repeated data at equal compute (the epoch curve repeats 2,000).
    --also adds runs of any size and length (e.g. the baseline given the other kind's minutes);
    --settings overrides the recipe for every run, named by --variant."""
    overrides = {"target_layer_ids": args.target_layer_ids} if args.target_layer_ids else {}
    overrides.update(json.loads(args.settings) if args.settings else {})
    extra = dict(overrides)
    suffix = f"-{args.variant}" if args.variant else ""
    runs = [(n, e) for e in args.epochs for n, e in ((args.samples, e), (args.samples * e, 1))]
    for spec in args.also:  # e.g. 4000x2.5: the baseline given the minutes of the other kind's steps
        samples, epochs = spec.split("x")
        runs.append((int(samples), float(epochs)))
    for samples, epochs in runs:
        name = f"{Path(args.data).name}-{args.offset}/{samples}x{epochs:g}{suffix}"
        slice_run(
            args,
            "spread",
            f"spread/{args.arch}/{name}",
            f"spread-{args.arch}-{name.replace('/', '-')}",
            overrides,
            extra,
            samples,
            epochs,
        )


def cmd_labels(args):
    """Hard labels (the answer's own tokens) against soft labels (the target's distribution at
    each block position, `--distill`) at equal steps (`slice_runs`). On sampled answers a hard
    label is often not the target's most likely token (17% of a1's at T 0.7:
    benchmarks/label_agreement.py), which is what greedy verification accepts; a soft label is the
    distribution the token was drawn from (its top TEACHER_TOPK tokens)."""
    slice_runs(
        args,
        "labels",
        [(f"distill-{d:g}", {"distill": d}, {"distill": d, "teacher_topk": TEACHER_TOPK}) for d in args.distill],
    )


def cmd_features(args):
    """The target's features as the trainer reads them from a float16 cache against an int8 one
    (`--feature-dtype int8`: half the disk), at equal steps with hard labels (`slice_runs`). Each
    --caches DTYPE=FOLDER must already hold the slice's features in that dtype
    (tools/convert_feature_cache.py copies a float16 cache's records into an int8 one)."""
    variants = []
    for spec in args.caches:
        dtype, folder = spec.split("=", 1)
        variants.append((dtype, {"feature_cache": folder, "feature_dtype": dtype}, {"feature_dtype": dtype}))
    slice_runs(args, "features", variants)


def cmd_blocks(args):
    """Add the teacher-forced acceptance to finished runs recorded without it (from their saved drafters)."""
    lines = [json.loads(line) for line in R.RESULTS.read_text().splitlines() if line.strip()]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for rec in lines:
        drafter = Path(rec["config"]["out"]) / "drafter"
        if "tau_blocks" in rec or not drafter.is_dir():
            continue
        trainer = Trainer(TrainConfig(**{k: v for k, v in rec["config"].items() if k in fields}))
        trainer._init_from_folder(drafter)
        rec.update(trainer.evaluate_blocks(R.BLOCK_SAMPLES))
        print(f"{rec['run']}: tau_blocks {rec['tau_blocks']}", file=sys.stderr)
        R.RESULTS.write_text("".join(json.dumps(r) + "\n" for r in lines))
