"""Target model configuration, read from an HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import BlockdraftError
from .families import FAMILIES

# vision-language model_type -> its language model's (whose config is nested as `text_config`)
MULTIMODAL = {"qwen3_5": "qwen3_5_text"}

# mixture-of-experts families with published DFlash drafters that blockdraft does not run yet
MIXTURE_OF_EXPERTS = {
    "qwen3_moe",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
    "gpt_oss",
    "deepseek_v3",
    "kimi_k2",
    "kimi_k25",
}


def rope_settings(raw: dict, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) of an HF config: transformers 5 keeps them in
    `rope_parameters`, 4.x in `rope_theta` / `rope_scaling`."""
    rope = dict(raw.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", default_theta)))
    scaling = rope if rope.get("rope_type", "default") != "default" else raw.get("rope_scaling")
    return theta, scaling or None


@dataclass
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    mlp_bias: bool = False
    sliding_window: int | None = None
    # hybrid families (Qwen3.5): per layer "linear_attention" | "full_attention" (None: all full
    # attention), and the shape of the linear-attention (Gated DeltaNet) layers
    layer_types: list[str] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # rotary embedding on the first head_dim * factor dims of a head

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, raw: dict) -> TargetConfig:
        model_type = raw.get("model_type")
        if model_type in MULTIMODAL:  # the language model only; its output head is tied as the outer config says
            raw = {
                **raw["text_config"],
                "model_type": MULTIMODAL[model_type],
                "tie_word_embeddings": raw.get("tie_word_embeddings", False),
            }
            model_type = raw["model_type"]
        family = FAMILIES.get(model_type)
        if family is None:
            moe = " (mixture-of-experts targets are not supported yet)" if model_type in MIXTURE_OF_EXPERTS else ""
            known = ", ".join(sorted({*FAMILIES, *MULTIMODAL}))
            raise BlockdraftError(f"unsupported architecture {model_type!r}{moe}; supported: {known}")
        bias = family.qkv_bias if family.qkv_bias is not None else bool(raw.get("attention_bias", False))
        theta, scaling = rope_settings(raw, 10000.0)
        heads = raw["num_attention_heads"]
        fields = dict(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=family.qk_norm,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=raw.get("sliding_window"),
        )
        return cls(**{**fields, **family.extra(raw)})

    @classmethod
    def from_folder(cls, folder: str | Path) -> TargetConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise BlockdraftError(f"{folder}: not a model folder (no config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise BlockdraftError(f"{path}: invalid JSON ({exc})") from None
        return cls.from_dict(raw)
