"""A training run's checkpoints and positions (`self`: the `Trainer`): a checkpoint (`OUT/checkpoint`,
optimizer state included) and a position (weights in fp16 and the schedule, for another machine),
resuming from either, and starting a drafter from another run's folder (`--init-from`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import BlockdraftError
from .config import SETTINGS_BEFORE, TrainConfig

SKIP_ON_RESUME = (
    "max_steps",
    "eval_every",
    "save_every",
    "data",
    "out",
    "feature_cache",
    "feature_dtype",
    "feature_cache_reserve",
)  # may change


def write_position(self, folder: Path, dtype: torch.dtype | None = None):
    """The drafter's weights (in `dtype`, default their own) and where the run stands (step,
    tokens, wall time, settings)."""
    self.drafter.save(folder / "drafter", dtype)
    (folder / "state.json").write_text(
        json.dumps(
            {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "elapsed": self.elapsed + time.perf_counter() - self._t0,
                "threads": torch.get_num_threads(),
                "processes": self.world,
                "target_dtype": str(self.dtype).removeprefix("torch."),
                "config": asdict(self.cfg),
            },
            indent=2,
        )
    )


def save_checkpoint(self):
    if self.rank != 0:
        return
    targets = [(self.out, "checkpoint", True)]
    if self.position_dir is not None:
        targets.append((self.position_dir.parent, self.position_dir.name, False))
    for parent, name, with_optimizer in targets:  # each replaced atomically
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
        # the committed position (no optimizer state: not bit for bit anyway) is half the size in fp16
        self.write_position(tmp, None if with_optimizer else torch.float16)
        if with_optimizer:
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        final = parent / name
        old = None
        if final.exists():
            old = parent / f".{name}.old.{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def init_from_folder(self, folder: Path):
    """Warm start from a saved drafter of the same shape (e.g. the shipped one): its weights
    and draft vocabulary replace the fresh ones; optimizer and schedule start anew. A Markov
    head or decoder layers past the saved drafter's keep this run's own initialization (a
    deeper drafter from a shallower one)."""
    if not (folder / "config.json").is_file():
        raise BlockdraftError(f"--init-from: no drafter in {folder} (expected config.json + model.safetensors)")
    loaded = type(self.drafter).load(folder, self.device, torch.float32)
    mine, theirs = self.drafter.state_dict(), loaded.state_dict()
    # a Markov head the saved drafter lacks starts fresh (DFlash weights -> a DSpark-style drafter)
    saved_layers = getattr(loaded.config, "num_hidden_layers", None)
    fresh = {
        k: v
        for k, v in mine.items()
        if k not in theirs
        and (
            k.startswith("markov_head.")
            or saved_layers is not None
            and k.startswith("layers.")
            and int(k.split(".")[1]) >= saved_layers
        )
    }
    theirs = {**theirs, **fresh}
    bad = sorted(
        k for k in set(mine) | set(theirs) if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape
    )
    if bad:
        raise BlockdraftError(
            f"--init-from: {folder} has another shape than this run's drafter "
            f"(differs in {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}); "
            "match --num-layers, --block-size, --draft-vocab, --target-layer-ids"
        )
    self.drafter.load_state_dict(theirs)


def widen_draft_vocab(self, weights: dict, optimizer: dict | None, step: int):
    """A checkpoint's weights (and AdamW state) for this run's wider draft vocabulary: the saved
    vocabulary kept, the samples' most frequent other answer tokens added (`frequent_tokens`), each
    kept token's rows (the drafter's `vocab_rows`: the Markov head's W2, and their AdamW moments) moved
    to its new index. An added token's row starts at the kept rows' mean: the Markov correction of a
    previous token shifts every kept token's logit by a common part (on wide16 at step 7,900 its mean
    over the vocabulary varies by 1.8 between previous tokens), so a row at 0 would lift the added
    tokens above the kept ones wherever that part is negative; its moments start at 0. The drafter's
    other weights and the schedule are unchanged."""
    old = weights["draft_vocab"]
    new = torch.as_tensor(self.frequent_tokens(keep=old.tolist()), dtype=torch.long)
    at = torch.searchsorted(new, old)  # each kept token's new index (both sorted)
    names = [name for name, _ in self.drafter.named_parameters()]

    def spread(rows: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        out = rows.new_zeros((new.numel(), *rows.shape[1:]))
        if fill is not None:
            out[:] = fill
        out[at.to(rows.device)] = rows
        return out

    weights = dict(weights, draft_vocab=new)
    wide = [k for k in self.drafter.vocab_rows if k in weights]
    for k in wide:
        weights[k] = spread(weights[k], weights[k].mean(0))
        moments = optimizer["state"].get(names.index(k), {}) if optimizer is not None else {}
        for m in ("exp_avg", "exp_avg_sq"):
            if m in moments:
                moments[m] = spread(moments[m])
    if self.rank == 0:
        print(
            f"train: draft vocabulary widened from {old.numel()} to {new.numel()} tokens at step {step} "
            f"({', '.join(wide) or 'no'} rows moved; the added tokens' at the kept rows' mean)",
            file=sys.stderr,
        )
    return weights, optimizer


def load_checkpoint(self):
    ck = self.out / "checkpoint"
    state = json.loads((ck / "state.json").read_text())
    # settings added since the checkpoint was made
    defaults = {**asdict(TrainConfig(data="", out="")), **SETTINGS_BEFORE}
    skip = SKIP_ON_RESUME
    saved = {k: v for k, v in {**defaults, **state["config"]}.items() if k not in skip}
    now = {k: v for k, v in asdict(self.cfg).items() if k not in skip}
    widen = 0 < saved["draft_vocab"] < now["draft_vocab"]  # a resumed run may widen its draft vocabulary
    if widen:
        saved["draft_vocab"] = now["draft_vocab"]
    if saved != now:
        diff = sorted(k for k in now if saved.get(k) != now[k])
        raise BlockdraftError(f"--resume: the checkpoint was made with other settings ({', '.join(diff)})")
    loaded = type(self.drafter).load(ck / "drafter", self.device, torch.float32)
    weights = loaded.state_dict()
    optimizer = torch.load(ck / "optimizer.pt", map_location=self.device) if (ck / "optimizer.pt").is_file() else None
    if widen:
        weights, optimizer = widen_draft_vocab(self, weights, optimizer, state["step"])
    self.drafter.load_state_dict(weights)
    if optimizer is not None:
        self.optimizer.load_state_dict(optimizer)
    elif self.rank == 0:
        print(
            f"train: {ck} holds no optimizer state (a committed position): AdamW's moments start anew at "
            f"step {state['step']}; the schedule, data order and anchors continue",
            file=sys.stderr,
        )
    self.step = state["step"]
    self.tokens_seen = state.get("tokens_seen", 0)
    self.elapsed = state.get("elapsed", 0.0)
    metrics = self.out / "metrics.jsonl"
    if self.rank == 0 and metrics.is_file():  # drop records of steps the checkpoint does not hold
        kept = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= self.step]
        metrics.write_text("".join(line + "\n" for line in kept))
