"""Target model configuration, read from an HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import BlockdraftError

# model_type -> (q/k/v projections have a bias, q/k RMSNorm per head)
ARCHITECTURES = {
    "llama": (None, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (None, True),
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

    @classmethod
    def from_dict(cls, raw: dict) -> "TargetConfig":
        model_type = raw.get("model_type")
        if model_type not in ARCHITECTURES:
            raise BlockdraftError(
                f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        fixed_bias, qk_norm = ARCHITECTURES[model_type]
        bias = fixed_bias if fixed_bias is not None else bool(raw.get("attention_bias", False))
        theta, scaling = rope_settings(raw, 10000.0)
        heads = raw["num_attention_heads"]
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        if model_type == "qwen3" and not raw.get("use_sliding_window", False):
            window = None
        return cls(
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
            qk_norm=qk_norm,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=window,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "TargetConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise BlockdraftError(f"{folder}: not a model folder (no config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise BlockdraftError(f"{path}: invalid JSON ({exc})") from None
        return cls.from_dict(raw)
