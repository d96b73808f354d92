"""`accelerator_job.py`'s training stage: a drafter on every answer, time-boxed, profiled, its weights kept."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
import accelerator_common as A  # noqa: E402


# What shapes a run's drafter and its loss: taken from a committed position by `recipe_from`.
RECIPE = (
    "arch", "block_size", "num_layers", "target_layer_ids", "mask_token_id", "num_anchors", "anchor_mode", "gamma",
    "position_weights", "dpace_alpha", "context_mode", "sliding_window", "full_layers", "max_seq_len",
    "markov_rank", "draft_layout", "distill", "draft_vocab",
)  # fmt: skip


def recipe_from(position: Path, batch: int) -> dict:
    """Settings that continue a committed run's drafter (`data/train-logs/positions/NAME`, e.g. the
    block-16 `wide16`) at the device's batch: its recipe (`RECIPE`), its data folders, its weights
    as the start, and its learning rate scaled by the square root of the batch ratio."""
    state = json.loads((position / "state.json").read_text())
    cfg = state["config"]
    out = {k: cfg[k] for k in RECIPE if k in cfg}
    out["init_from"] = str(position / "drafter")
    out["data"] = [str(A.ROOT / f) for f in cfg["data"].split(",")]
    out["lr"] = cfg["lr"] * (batch / cfg["batch_size"]) ** 0.5
    return out


def train(work: Path, seconds: float | None, target: str | None, batch: int, overrides: dict) -> Path:
    """A DSpark drafter (DFlash + rank-256 Markov head) on all the answers, its schedule sized
    from the first steps' speed so that it ends (decayed) inside `seconds` (None: the
    `max_steps` of `overrides`). `overrides["recipe_from"]`: a committed position whose run
    this continues (`recipe_from`; other overrides still win)."""
    import torch

    from blockdraft.train.config import TrainConfig
    from blockdraft.train.trainer import Trainer

    overrides = dict(overrides)
    recipe = recipe_from(Path(overrides.pop("recipe_from")), batch) if overrides.get("recipe_from") else {}
    data = recipe.pop("data", None) or [str(A.ROOT / f) for f in A.COMMITTED_ANSWERS if (A.ROOT / f).is_dir()]
    if (work / "regen" / A.NEW_ANSWERS).is_dir():
        data.append(str(work / "regen" / A.NEW_ANSWERS))
    settings = dict(
        block_size=8,
        num_layers=3,
        num_anchors=64,
        batch_size=batch,
        lr=2e-3,
        draft_vocab=8192,
        init="target-last-fc",
        max_seq_len=1024,
        markov_rank=256,
        schedule="wsd",
        warmup_steps=60,
        decay_frac=0.25,
        eval_every=0,
        eval_prompts=32,
        eval_max_new_tokens=96,
        save_every=10**9,
        log_every=20,
        max_steps=10**6,
    )
    settings.update(recipe)
    settings.update(overrides)
    t = time.time()
    cfg = TrainConfig(data=",".join(data), out=str(work / "train"), target=target, **settings)
    trainer = Trainer(cfg)
    A.log(f"train: {len(trainer.samples)} sequences loaded in {time.time() - t:.0f}s")
    decode_tau = trainer.evaluate_tau

    def evaluate_tau(*a, **kw):  # a failing decode-loop evaluation must not cost the weights
        try:
            return decode_tau(*a, **kw)
        except Exception:
            A.log(f"train: decode-loop evaluation FAILED:\n{traceback.format_exc()}")
            return float("nan")

    trainer.evaluate_tau = evaluate_tau
    if seconds is None:
        trainer.run()
        return finish_training(work, trainer)
    probe = 30
    trainer.run(until=10)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.time()
    trainer.run(until=probe)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.time() - t) / (probe - 10)
    if trainer.device.type == "cuda":
        A.stage("profile", profile_steps, trainer, probe + 3)
        probe += 3
    left = seconds - (time.time() - A.T0) - 40  # the final evaluation and packing
    cfg.max_steps = max(probe + 10, probe + int(left / per_step))
    A.log(
        f"train: {per_step * 1000:.0f} ms/step at batch {batch}; {cfg.max_steps} steps "
        f"({cfg.max_steps * batch / len(trainer.samples):.2f} epochs)"
    )
    trainer.run()
    return finish_training(work, trainer)


def profile_steps(trainer, until: int):
    """Where a few training steps' time goes on the device (for the next lease's sizing)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t, start = time.time(), trainer.step
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.run(until=until)
        torch.cuda.synchronize()
    A.log(
        f"profile: {until - start} steps in {time.time() - t:.2f}s wall under the profiler\n"
        + A.profile_tables(prof, 15, "self_device_time_total")
    )


def finish_training(work: Path, trainer) -> Path:
    if not (work / "train" / "drafter").is_dir():
        trainer.drafter.save(work / "train" / "drafter")
    blocks = trainer.evaluate_blocks(128)
    A.log(f"train: done; teacher-forced {json.dumps(blocks)[:300]}")
    (work / "train" / "blocks.json").write_text(json.dumps(blocks))
    return work / "train"
