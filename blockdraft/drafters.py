"""One registry of drafter kinds: the engine, the trainer, the exporters and the CLI look a kind
up here and never compare kind names themselves.

A kind says how to load a folder of it, build a fresh one for training, start its layers from
the target's, run its training forward over a batch of blocks, and which proposer drafts with
it. Adding a drafter kind is one new module with those functions plus one `register(...)` line:

    register(DrafterKind("my-kind", "my drafter", "MyDraftModel", "--my-draft", engine_slot="my_drafter",
                         load=..., build=..., init_layers=..., train_hidden=..., proposer=...))

`tests/test_drafters.py` plugs a toy kind in this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from .draft_config import ARCHITECTURE, LABEL
from .errors import BlockdraftError


@dataclass(frozen=True)
class DrafterKind:
    name: str  # the kind's name: --arch, a method's `drafter`, a drafter module's `kind`
    label: str  # how messages name it
    architecture: str  # config.json "architectures"
    flag: str  # the CLI flag that names a folder of this kind
    engine_slot: str  # the Engine attribute holding the loaded drafter
    load: Callable  # (folder, device, dtype) -> drafter module
    build: Callable  # (target config, TrainConfig, draft vocabulary size or None) -> a fresh drafter
    init_layers: Callable  # (drafter, target, how) -> None: layers copied from the target (--init)
    # (model, target, batch, tokens [N, L], features, positions [N, L]) -> hidden states of every block
    # position [N, A*B, H]; `model` is the drafter or its DDP wrapper; runs with grad
    train_hidden: Callable
    proposer: Callable  # (drafter, target) -> the Proposer that drafts with it
    soft_labels: bool = False  # supports --distill (the target's distribution at each block position)
    # runs in bf16 beside an fp32 target (draft_weights "bf16"): its proposer casts what it reads from the target
    bf16_beside_fp32: bool = False
    describe: Callable = lambda drafter: ""  # a few words on its shape, for the training banner


KINDS: dict[str, DrafterKind] = {}
PRIMARY = "dflash"  # the kind `--draft` names, `Engine.drafter` holds and `--arch` trains by default


def register(kind: DrafterKind) -> DrafterKind:
    KINDS[kind.name] = kind
    return kind


def kind(name: str) -> DrafterKind:
    """The kind of that name, or a clear error listing the known ones."""
    found = KINDS.get(name)
    if found is None:
        raise BlockdraftError(f"unknown drafter kind {name!r}; choose one of {', '.join(KINDS)}")
    return found


def load_drafter(name: str, folder, target, *, draft_weights: str = "float", packed: bool = False):
    """The one way a drafter is made ready to decode: a folder of kind `name` loaded in the
    target's device and dtype, checked against the target, its linears (and LM-head rows) in
    int8 when `draft_weights` is "int8", its products through prepacked weights when `packed`
    (fp32; bf16 on a CPU with AVX512-BF16 through blockdraft's native kernel). "bf16" (an fp32
    target, `engine.resolve_draft_weights`): a kind that can runs in bf16, its pass native where
    `draft_native` allows, its share of the target's LM head kept as bf16 rows; another kind as
    "auto" would have it without bf16 (int8 where that pays, else float)."""
    spec = kind(name)
    if draft_weights == "bf16" and not spec.bf16_beside_fp32:
        from .models.quant import without_bf16

        draft_weights = without_bf16(target.device, target.dtype)
    dtype = torch.bfloat16 if draft_weights == "bf16" else target.dtype
    module = spec.load(folder, target.device, dtype)
    module.check_target(target.config)
    if draft_weights == "int8":
        from .draft_head import quantize_drafter

        quantize_drafter(module)
    if packed or draft_weights == "bf16":
        from .draft_head import pack_drafter
        from .draft_native import use_native_draft
        from .models.exact import native_linears

        pack_drafter(module)
        native_linears(module)
        use_native_draft(module)
    module.head.dtype = dtype  # the rows of the target's head it scores, in its own dtype
    return module


def kind_of(drafter) -> DrafterKind:
    """The kind of a drafter module (its `kind` attribute)."""
    return kind(getattr(drafter, "kind", ""))


# ---- DFlash ------------------------------------------------------------------------------


def _dflash_load(folder, device=None, dtype=None):
    from .draft import DFlashDrafter

    return DFlashDrafter.load(folder, device, dtype)


def _dflash_build(target_config, cfg, draft_vocab_size):
    from .draft import DFlashDrafter, DraftConfig

    draft_cfg = DraftConfig.for_target(
        target_config,
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=cfg.target_layer_ids,
        sliding_window=cfg.sliding_window,
        full_layers=cfg.full_layers,
        markov_rank=cfg.markov_rank,
        sample_from_anchor=cfg.draft_layout == "anchor",
    )
    # what the published format cannot say: the longest context trained on (the default
    # --draft-window when decoding), an ablation's context mode, a draft vocabulary
    ours = {"train_context": cfg.max_seq_len, "num_anchors": cfg.num_anchors}
    if cfg.context_mode != "kv":
        ours["context_mode"] = cfg.context_mode
    if draft_vocab_size:
        ours["draft_vocab_size"] = draft_vocab_size
    draft_cfg.extra = {"blockdraft": ours}
    return DFlashDrafter(draft_cfg)


def _dflash_train_hidden(model, target, batch, tokens, features, positions):
    from .draft import BlockMask

    dev = tokens.device
    noise = target.embed(batch.block_tokens.to(dev))
    return model(noise, batch.block_positions.to(dev), features, positions, mask=BlockMask.of(batch.mask.to(dev)))


def _dflash_init(drafter, target, how):
    from .train.init import init_dflash_layers

    init_dflash_layers(drafter, target, how)


def _dflash_proposer(drafter, target):
    from .proposers import DFlashProposer

    return DFlashProposer(drafter, target)


register(
    DrafterKind(
        "dflash",
        LABEL,
        ARCHITECTURE,
        "--draft",
        "drafter",
        _dflash_load,
        _dflash_build,
        _dflash_init,
        _dflash_train_hidden,
        _dflash_proposer,
        soft_labels=True,
        bf16_beside_fp32=True,
        describe=lambda d: (
            f"{len(d.layers)} layer(s)" + (f", Markov head rank {d.config.markov_rank}" if d.config.markov_rank else "")
        ),
    )
)


# ---- the EAGLE-3-style baseline ----------------------------------------------------------


def _eagle_load(folder, device=None, dtype=None):
    from .eagle import EagleDrafter

    return EagleDrafter.load(folder, device, dtype)


def _eagle_build(target_config, cfg, draft_vocab_size):
    from .eagle import EagleConfig, EagleDrafter

    if cfg.markov_rank:
        raise BlockdraftError("--markov-rank adds a Markov head to a DFlash drafter (--arch dflash)")
    return EagleDrafter(
        EagleConfig.for_target(
            target_config,
            block_size=cfg.block_size,
            target_layer_ids=cfg.target_layer_ids,
            draft_vocab_size=draft_vocab_size,
        )
    )


def _eagle_train_hidden(model, target, batch, tokens, features, positions):
    """EAGLE-3's training-time test: from each anchor, the chain fed the answer's own tokens."""
    n, b, dev = tokens.shape[0], int(batch.offsets[0].max()) + 1, tokens.device  # b: the block size
    anchors = batch.block_positions[:, ::b].to(dev)
    later = batch.labels.view(n, -1, b)[:, :, 1 : b - 1].clamp(min=0)  # x_{a+1} .. x_{a+B-2}
    forced = torch.cat([batch.block_tokens[:, ::b, None], later], dim=2).to(dev)
    return model(target.embed, tokens, features, anchors, forced)


def _eagle_init(drafter, target, how):
    from .train.init import init_eagle_layers

    init_eagle_layers(drafter, target, how)


def _eagle_proposer(drafter, target):
    from .proposers import EagleProposer

    return EagleProposer(drafter, target)


register(
    DrafterKind(
        "eagle3",
        "EAGLE-3-style drafter",
        "Eagle3DraftModel",
        "--eagle",
        "eagle",
        _eagle_load,
        _eagle_build,
        _eagle_init,
        _eagle_train_hidden,
        _eagle_proposer,
        describe=lambda d: "1 layer",
    )
)
