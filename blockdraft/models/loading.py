"""Load a target model (and its tokenizer) from a local HF folder of safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import BlockdraftError
from .config import TargetConfig
from .layers import Rotary
from .families import FAMILIES
from .transformer import Transformer


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BlockdraftError(f"{folder}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def read_safetensors(folder: Path, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    weights = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return weights


def load_target(folder: str | Path, device=None, dtype: torch.dtype | None = None) -> Transformer:
    """Build the target model of an HF model folder (config.json + safetensors), by family."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BlockdraftError(f"target model folder not found: {folder}")
    cfg = TargetConfig.from_folder(folder)
    family = FAMILIES[cfg.model_type].model_class()  # (TargetConfig refuses a model_type with no family)
    device = torch.device(device or "cpu")
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = family(cfg)
    weights = family.from_hf_weights(read_safetensors(folder, dtype, device))
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - weights.keys())
    if missing:
        raise BlockdraftError(
            f"{folder}: weights missing from the checkpoint: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )
    model.load_state_dict({k: weights[k] for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings).to(device)
    return model.eval()


def stop_token_ids(folder: str | Path | None, tokenizer) -> list[int]:
    """The ids that end an answer: the folder's end-of-sequence ids and the tokenizer's."""
    ids = set(eos_token_ids(folder)) if folder else set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def eos_token_ids(folder: str | Path) -> list[int]:
    """End-of-sequence ids declared by the model folder (generation_config.json, config.json)."""
    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises many types for a bad folder
        raise BlockdraftError(f"{folder}: could not load a tokenizer ({exc})") from None
