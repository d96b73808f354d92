"""One registry of target families: a new family is one model file and one `register` line.

A family is an HF `model_type` with the class that implements the target interface
(`forward(tokens, positions, cache, slots=, mask=)`, `new_cache`, `commit`, `logits`, `embed`,
and `from_hf_weights` to map an HF checkpoint onto its parameters), the attention flags its
config does not state, and what else of its HF config the model needs (`extra(raw)`: fields of
`TargetConfig`, e.g. a hybrid family's layer layout). The class is named "module:Class" and
imported when a target of the family is built, so reading a config stays light:

    register(Family("my_type", "my_package.my_model:MyModel", qk_norm=True, extra=my_config_fields))

`tests/test_plugins.py` loads a toy family registered this way.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from collections.abc import Callable


@dataclass(frozen=True)
class Family:
    model_type: str  # HF config.json "model_type"
    model: str  # "module:Class" implementing the target interface
    qkv_bias: bool | None = None  # q/k/v projections have a bias (None: the config's attention_bias)
    qk_norm: bool = False  # q/k RMSNorm per head
    extra: Callable[[dict], dict] = field(default=lambda raw: {})  # HF config -> more TargetConfig fields

    def model_class(self) -> type:
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def window_if_used(raw: dict) -> dict:
    """Qwen2 / Qwen3 state a sliding window but use it only with `use_sliding_window`."""
    return {} if raw.get("use_sliding_window", False) else {"sliding_window": None}


def qwen3_5_fields(raw: dict) -> dict:
    """Qwen3.5's hybrid layout: which layers are linear attention (Gated DeltaNet), their shape,
    and the partial rotary embedding of its full-attention layers."""
    out = {
        k: raw[k]
        for k in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
    }
    interval = raw.get("full_attention_interval", 4)  # HF's default layout: every 4th layer is full
    out["layer_types"] = list(
        raw.get("layer_types")
        or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(raw["num_hidden_layers"])
        ]
    )
    rope = raw.get("rope_parameters") or {}
    out["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    return out


TRANSFORMER = "blockdraft.models.transformer:Transformer"
register(Family("llama", TRANSFORMER))
register(Family("mistral", TRANSFORMER, qkv_bias=False))
register(Family("qwen2", TRANSFORMER, qkv_bias=True, extra=window_if_used))
register(Family("qwen3", TRANSFORMER, qk_norm=True, extra=window_if_used))
register(Family("qwen3_5_text", "blockdraft.models.qwen3_5:Qwen3_5", qk_norm=True, extra=qwen3_5_fields))
