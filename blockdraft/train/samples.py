"""What a training run trains on: the samples of its --data folders as its settings cut them,
their identities across runs (`--skip-trained-by`), and adopting a committed training position."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import BlockdraftError
from .data import data_folders, iter_samples


def adopt_position(src: Path, out: Path) -> bool:
    """Make training position `src` (state.json + drafter/, e.g. a committed --position-dir
    folder) the checkpoint of run folder `out`, unless `out` already holds one as far or
    further; True if it was copied."""
    state = json.loads((src / "state.json").read_text())
    ck = out / "checkpoint"
    mine = json.loads((ck / "state.json").read_text())["step"] if (ck / "state.json").is_file() else -1
    if mine >= state["step"]:
        return False
    if ck.exists():
        shutil.rmtree(ck)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, ck)
    return True


def sample_key(folder: Path, sample: dict) -> tuple[str, str]:
    """A training sample's identity across runs: its folder and its id (two folders may answer one prompt)."""
    return str(folder.resolve()), sample["id"]


def training_samples(
    data: str,
    max_seq_len: int,
    folder_samples: list[int] | None = None,
    limit_samples: int | None = None,
    skip: set | frozenset = frozenset(),
):
    """What a run with these settings trains on: the training items of the --data folders, in
    folder and shard order, each (sequence cut to max_seq_len, prompt length, sample, folder),
    the first `folder_samples[n]` of folder n, less those whose `sample_key` is in `skip`, the
    first `limit_samples` of the rest. Also the held-out items, the count per folder (before
    `skip`) and how many `skip` left out."""
    folders = data_folders(data)
    for folder in folders:
        if not folder.is_dir():
            raise BlockdraftError(
                f"training data folder not found: {folder} (make it with `blockdraft data regenerate`)"
            )
    if folder_samples is not None and len(folder_samples) != len(folders):
        raise BlockdraftError(f"--folder-samples: one count per --data folder, got {folder_samples}")
    train, valid, counts = [], [], []
    for n, folder in enumerate(folders):
        mine = []
        for s in iter_samples(folder):
            item = ((s["prompt_ids"] + s["answer_ids"])[:max_seq_len], len(s["prompt_ids"]), s, folder)
            (valid if s["split"] == "valid" else mine).append(item)
        mine = [t for t in mine if len(t[0]) - t[1] >= 2]
        if folder_samples is not None:
            mine = mine[: folder_samples[n]]
        counts.append(len(mine))
        train += mine
    kept = [t for t in train if sample_key(t[3], t[2]) not in skip] if skip else train
    skipped = len(train) - len(kept)
    if limit_samples:
        kept = kept[:limit_samples]
    return kept, valid, counts, skipped


def trained_ids(position: str | Path | None) -> frozenset[tuple[str, str]]:
    """The `sample_key` of every sample the run at `position` (a --position-dir or a run's
    checkpoint folder: its state.json) trained on: its --data as it stood then (folders grow only
    at the end), cut as it cut them, with what its own --skip-trained-by run trained on. The run
    must have gone through all of its samples at least once. None (no --skip-trained-by): none."""
    if not position:
        return frozenset()
    state_file = Path(position) / "state.json"
    if not state_file.is_file():
        raise BlockdraftError(f"--skip-trained-by: no state.json in {position}")
    state = json.loads(state_file.read_text())
    cfg = state["config"]
    if not cfg.get("limit_samples") and not cfg.get("folder_samples"):
        raise BlockdraftError(
            f"--skip-trained-by: {position} fixed neither --limit-samples nor --folder-samples, "
            "so which of its folders' samples it trained on is not known"
        )
    done = trained_ids(cfg.get("skip_trained_by"))
    train, *_ = training_samples(
        cfg["data"], cfg.get("max_seq_len", 512), cfg.get("folder_samples"), cfg.get("limit_samples"), done
    )
    seen = state["step"] * cfg["batch_size"] * state.get("processes", 1)
    if seen < len(train):
        raise BlockdraftError(
            f"--skip-trained-by: {position} went through {seen:,} sequences, fewer than its "
            f"{len(train):,} samples, so not all of them were trained on"
        )
    return done | {sample_key(t[3], t[2]) for t in train}
