"""A DFlash drafter's configuration and its published `config.json` format (the z-lab reference,
vLLM, SGLang; DSpark's keys for a Markov head), with the recipe's defaults derived from the target."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata

from .errors import BlockdraftError
from .models.config import TargetConfig, rope_settings


def build_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Target layers whose outputs form the context feature (RESEARCH.md's formula)."""
    if num_ids == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_ids - 1))) for i in range(num_ids)]


def loss_decay_gamma(block_size: int) -> float:
    """gamma of the exp(-(k-1)/gamma) loss weights: 7 for B=16, 5 for B=10, 4 for B=8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    # per layer "full_attention" | "sliding_attention" (None: all full); a sliding layer's
    # query at position q sees context keys at positions > q - sliding_window (and its block)
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # rank of the Markov head (DSpark's first-order correction: each draft position's logits get
    # W2 W1[previous token]); 0: none, a plain DFlash drafter
    markov_rank: int = 0
    # the block layout. False (DFlash's): slot k of a block [anchor, MASK x (B-1)] drafts the token at
    # its own position, slots 1..B-1 draft (B-1 drafts a pass). True (DSpark's `sample_from_anchor`):
    # every slot drafts the token after it, the anchor's included (B drafts a pass)
    sample_from_anchor: bool = False
    extra: dict = field(default_factory=dict)  # unknown config keys, written back unchanged

    def __post_init__(self):
        types = self.layer_types
        if types is None:
            return
        if len(types) != self.num_hidden_layers or not set(types) <= {"full_attention", "sliding_attention"}:
            raise BlockdraftError(
                f"drafter layer_types must list 'full_attention' or 'sliding_attention' for each "
                f"of the {self.num_hidden_layers} layers, got {types}"
            )
        if "sliding_attention" in types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise BlockdraftError(f"sliding_attention layers need a positive sliding_window, got {self.sliding_window}")

    @property
    def first_draft_slot(self) -> int:
        """The first block slot whose output is a draft (1 in DFlash's layout, 0 in DSpark's)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def max_drafts(self) -> int:
        """Drafts one pass at the trained block gives (a verify then checks one more token)."""
        return self.block_size - self.first_draft_slot

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer (None: full attention)."""
        sliding = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @property
    def train_context(self) -> int | None:
        """The longest sequence (prompt + answer tokens) blockdraft trained this drafter on
        (None: unknown, e.g. a published drafter): the default draft window."""
        return self.extra.get("blockdraft", {}).get("train_context")

    @classmethod
    def for_target(
        cls,
        target: TargetConfig,
        *,
        num_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        sliding_window: int | None = None,
        full_layers: list[int] | None = None,
        markov_rank: int = 0,
        sample_from_anchor: bool = False,
    ) -> DraftConfig:
        """A drafter shaped like the target's layers (the published recipe). With
        `sliding_window`, every layer not in `full_layers` is a sliding-window layer."""
        ids = target_layer_ids or build_target_layer_ids(target.num_hidden_layers, num_layers)
        types = None
        if sliding_window:
            full = set(full_layers or ())
            if not full <= set(range(num_layers)):
                raise BlockdraftError(f"--full-layers must be layer indices below {num_layers}, got {sorted(full)}")
            types = ["full_attention" if i in full else "sliding_attention" for i in range(num_layers)]
        return cls(
            hidden_size=target.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=intermediate_size or target.intermediate_size,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_hidden_layers,
            target_layer_ids=list(ids),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            layer_types=types,
            sliding_window=sliding_window if types else None,
            markov_rank=markov_rank,
            sample_from_anchor=sample_from_anchor,
        )

    @classmethod
    def from_dict(cls, raw: dict) -> DraftConfig:
        try:
            dflash = raw.get("dflash_config") or {}
            dspark = (raw.get("architectures") or [ARCHITECTURE])[0] == DSPARK_ARCHITECTURE
            if dspark:
                # DSpark's layout keeps the mask token and target layers at the top level
                dflash = {
                    "mask_token_id": raw.get("mask_token_id"),
                    "target_layer_ids": raw.get("target_layer_ids"),
                    **{k: v for k, v in dflash.items() if v is not None},
                }
                if raw.get("enable_confidence_head"):
                    raise BlockdraftError(
                        "a DSpark drafter with a confidence head is not supported "
                        "(the head is unused by lossless verification; export it without one)"
                    )
            heads = raw["num_attention_heads"]
            layers = raw["num_hidden_layers"]
            ids = dflash.get("target_layer_ids") or build_target_layer_ids(raw["num_target_layers"], layers)
            theta, scaling = rope_settings(raw, 1e6)
            known = set(PUBLISHED_KEYS) | set(MARKOV_KEYS) | {"rope_parameters"}
            if dspark:
                known |= {"mask_token_id", "target_layer_ids", "confidence_head_with_markov", "num_anchors"}
            if raw.get("markov_head_type", "vanilla") != "vanilla":
                raise BlockdraftError(f"Markov head type {raw['markov_head_type']!r}: only 'vanilla' is supported")
            sliding = "sliding_attention" in (raw.get("layer_types") or ())
            return cls(
                hidden_size=raw["hidden_size"],
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                intermediate_size=raw["intermediate_size"],
                vocab_size=raw["vocab_size"],
                num_target_layers=raw["num_target_layers"],
                target_layer_ids=list(ids),
                mask_token_id=_required(dflash, "mask_token_id"),
                block_size=raw.get("block_size", 16),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=raw.get("max_position_embeddings", 40960),
                attention_bias=bool(raw.get("attention_bias", False)),
                layer_types=list(raw["layer_types"]) if sliding else None,
                sliding_window=raw.get("sliding_window") if sliding else None,
                markov_rank=int(raw.get("markov_rank") or 0),
                # DSpark's default is every slot drafting; a DFlash folder drafts after the anchor
                sample_from_anchor=bool(raw.get("sample_from_anchor", dspark)),
                extra={k: v for k, v in raw.items() if k not in known},
            )
        except KeyError as exc:
            raise BlockdraftError(f"drafter config.json lacks the key {exc}") from None

    def to_dict(self) -> dict:
        """The config.json written by the authors' drafter class (same keys), plus any extras."""
        try:
            tf_version = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            tf_version = "unknown"
        out = {
            "architectures": [ARCHITECTURE],
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "dtype": "float32",
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types or ["full_attention"] * self.num_hidden_layers),
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": self.rope_scaling,
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "transformers_version": tf_version,
            "use_cache": True,
            "use_sliding_window": self.sliding_window is not None,
            "vocab_size": self.vocab_size,
        }
        if self.markov_rank:  # a Markov head: the folder says it is DSpark's (DeepSpec's class and keys), so that
            # every engine either runs all of it or refuses it (the authors' DFlash class would drop the head)
            anchors = (self.extra.get("blockdraft") or {}).get("num_anchors", 32)
            out.update(
                {
                    "architectures": [DSPARK_ARCHITECTURE],
                    "mask_token_id": self.mask_token_id,
                    "target_layer_ids": list(self.target_layer_ids),
                    "num_anchors": anchors,
                    "markov_rank": self.markov_rank,
                    "markov_head_type": "vanilla",
                    "enable_confidence_head": False,
                }
            )
        if self.markov_rank or self.sample_from_anchor:  # the layout, where a DSpark reader looks for it
            out["sample_from_anchor"] = self.sample_from_anchor
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out


def _required(found: dict, key: str):
    if found.get(key) is None:
        raise KeyError(key)
    return found[key]


# a drafter folder's config.json "architectures": the authors' DFlash class, or DeepSpec's DSpark class
# (what `blockdraft export drafter` writes for a drafter with a Markov head)
ARCHITECTURE = "DFlashDraftModel"
DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
LABEL = "DFlash drafter"  # how messages name the kind


def read_draft_config(folder) -> dict:
    """A DFlash (or DSpark) drafter folder's config.json; a clear error for any other folder."""
    from .checkpoint import read_config

    return read_config(folder, ARCHITECTURE, DSPARK_ARCHITECTURE, label=LABEL)


# the config.json keys of a Markov head (DSpark's names)
MARKOV_KEYS = ("markov_rank", "markov_head_type", "sample_from_anchor", "enable_confidence_head")

# the config.json keys of the authors' published drafters (`export` writes these and nothing else)
PUBLISHED_KEYS = (
    "architectures attention_bias attention_dropout block_size dflash_config dtype head_dim hidden_act "
    "hidden_size initializer_range intermediate_size layer_types max_position_embeddings max_window_layers "
    "model_type num_attention_heads num_hidden_layers num_key_value_heads num_target_layers rms_norm_eps "
    "rope_scaling rope_theta sliding_window tie_word_embeddings transformers_version use_cache "
    "use_sliding_window vocab_size"
).split()
