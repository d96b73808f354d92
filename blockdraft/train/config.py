"""`TrainConfig`: every training setting, with the help text `blockdraft train --help` shows
(the one place each is documented), and the learning-rate schedule it defines."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import BlockdraftError


def _opt(default, help: str):
    """A TrainConfig field with its `blockdraft train --help` text (the one place it is documented)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    data: str = field(
        metadata={"help": "folder of regenerated shards (`blockdraft data regenerate`), or several separated by commas"}
    )
    out: str = field(metadata={"help": "run folder: checkpoint/, drafter/, metrics.jsonl"})
    target: str | None = _opt(None, "target model folder (default: the default target)")
    block_size: int = _opt(8, "trained block: the drafter runs at this block or any smaller one")
    num_layers: int = _opt(3, "drafter decoder layers")
    target_layer_ids: list[int] | None = _opt(
        None, "target layers whose hidden states feed the drafter (default: the published formula)"
    )
    mask_token_id: int | None = _opt(None, "token id of the block's mask positions (default: the default target's)")
    num_anchors: int = _opt(32, "blocks per sequence, opened at random anchors inside the answer")
    anchor_mode: str = _opt("random", "random | fixed (block boundaries, for the ablation)")
    gamma: float | None = _opt(
        None, "loss decay over block positions (default: the recipe's value for the block size; 0: no decay)"
    )
    position_weights: str = _opt(
        "dpace",
        "how the loss weighs block positions: dpace (D-PACE: from the drafter's "
        "own confidences, the expected acceptance that rides on each position; "
        "won the block-16 A/B) | decay (fixed, exp(-(k-1)/gamma))",
    )
    dpace_alpha: float = _opt(0.5, "D-PACE's confidence smoothing: each confidence q counts as (1-alpha) q + alpha")
    arch: str = _opt("dflash", "dflash | eagle3 (the EAGLE-3-style baseline, same data and pipeline)")
    context_mode: str = _opt("kv", "kv (context injected in every layer) | input (first layer only, for the ablation)")
    sliding_window: int | None = _opt(None, ">0: drafter layers see the context within this window")
    full_layers: list[int] | None = _opt(None, "with --sliding-window: these drafter layers keep full attention")
    batch_size: int = _opt(4, "sequences per step per process")
    max_seq_len: int = _opt(512, "longest training sequence (prompt + answer), in tokens")
    max_steps: int = _opt(1000, "optimizer steps")
    epochs: float | None = _opt(
        None,
        "train this many epochs instead of --max-steps: the steps and the samples "
        "(--folder-samples) are fixed when the run starts, so answers added to its "
        "folders later do not change it",
    )
    lr: float = _opt(6e-4, "peak learning rate (AdamW)")
    schedule: str = _opt("cosine", "cosine (to min_lr) | wsd (warmup, constant, linear decay over --decay-frac)")
    warmup_frac: float = _opt(0.04, "warmup as a fraction of --max-steps")
    warmup_steps: int = _opt(
        0,
        ">0: this many warmup steps, whatever --max-steps (runs of several lengths then "
        "share their first steps exactly, e.g. WSD branches)",
    )
    decay_frac: float = _opt(0.2, "wsd: the final fraction of steps that decays to the floor")
    min_lr_frac: float = _opt(0.0, "the schedule's floor, as a fraction of --lr")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    grad_clip: float = _opt(1.0, "gradient norm clipping (0: none)")
    markov_rank: int = _opt(
        0,
        ">0: a DSpark-style Markov head of this rank on the DFlash drafter (each draft "
        "position's logits corrected by the token before it; 256 in DSpark)",
    )
    draft_layout: str = _opt(
        "mask",
        "mask (DFlash's: block slots 1..B-1 draft, B-1 drafts a pass) | anchor "
        "(DSpark's sample_from_anchor, what the DSpark loaders of vLLM, SGLang and "
        "DeepSpec run: every slot drafts the token after it, B drafts a pass)",
    )
    distill: float = _opt(
        0.0,
        "weight of the soft-label loss (the target's own distribution, its top 32 tokens "
        "renormalized; kept in --feature-cache); 0: hard labels only",
    )
    dtype: str = _opt("auto", "the target's dtype: auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16")
    init_from: str | None = _opt(
        None,
        "start from this drafter folder's weights (e.g. the shipped drafter); its shapes must match the other settings",
    )
    seed: int = _opt(0, "seed of every random choice (data order, anchors, init)")
    eval_every: int = _opt(200, "steps between held-out tau evaluations in the decode loop (0: at the last step only)")
    eval_prompts: int = _opt(8, "held-out prompts of that evaluation")
    eval_max_new_tokens: int = _opt(64, "new tokens per held-out prompt in that evaluation")
    save_every: int = _opt(100, "steps between checkpoints (--resume continues from the last one)")
    log_every: int = _opt(10, "steps between metrics lines (the loop's only host syncs)")
    lm_head_chunk: int = _opt(1024, "block positions per LM-head chunk in the loss (memory vs speed)")
    init: str = _opt(
        "random",
        "random | target-first | target-last | target-last-fc (layers copied from the target; see init_from_target)",
    )
    draft_vocab: int = _opt(
        0,
        ">0: the drafter scores only the N most frequent answer tokens (0: all); a resumed run may widen it "
        "(the saved tokens kept, the most frequent others added, their Markov rows starting at the kept rows' mean)",
    )
    limit_samples: int | None = _opt(None, "train on the first N training samples only")
    skip_trained_by: str | None = _opt(
        None,
        "a run's position folder (its state.json): leave out every sample "
        "that run trained on, e.g. to go on from the drafter it made "
        "(--init-from) with only the samples added since",
    )
    folder_samples: list[int] | None = _opt(
        None,
        "train on the first N training samples of each --data folder only, one count per folder (--epochs sets it)",
    )
    feature_cache: str | None = _opt(
        None,
        "folder: the target's features (and, with --distill, its top tokens) "
        "kept on disk across epochs (pays from the second epoch)",
    )
    feature_dtype: str | None = _opt(
        None,
        "how --feature-cache stores the features this run computes: float16 or "
        "int8 (half the disk; a scale per position and layer); default: the "
        "cache folder's own (float16 for a new one)",
    )
    feature_cache_reserve: float = _opt(
        16.0,
        "GiB --feature-cache leaves free on its disk: it stores features until then, and the target "
        "runs every epoch for the samples that did not fit",
    )
    extra: dict = field(default_factory=dict)


# What a setting meant for runs saved before it existed (a resumed run keeps training as it started).
SETTINGS_BEFORE = {"position_weights": "decay"}


def lr_at(cfg: TrainConfig, step: int) -> float:
    warmup = cfg.warmup_steps or max(1, int(cfg.warmup_frac * cfg.max_steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    floor = cfg.lr * cfg.min_lr_frac
    if cfg.schedule == "wsd":
        decay = max(1, int(cfg.decay_frac * cfg.max_steps))
        start = cfg.max_steps - decay
        return cfg.lr if step < start else floor + (cfg.lr - floor) * max(0.0, (cfg.max_steps - step) / decay)
    if cfg.schedule != "cosine":
        raise BlockdraftError(f"--schedule must be cosine or wsd, not {cfg.schedule!r}")
    progress = (step - warmup) / max(1, cfg.max_steps - warmup)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
