"""Drafter checkpoint folders: `config.json` + `model.safetensors` (the published format).

Reading checks the architecture and the weight names against the config; writing is
atomic (a temporary folder, then a rename), so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import BlockdraftError
from .models.layers import Rotary


def write_model_folder(folder: str | Path, config: dict, state: dict, dtype: torch.dtype | None = None):
    """Write `config.json` + `model.safetensors` atomically: a temp folder, then a rename (the
    old folder is kept until the new one is in place). Floating tensors are cast to `dtype`."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    weights = {
        k: v.detach().to("cpu", (dtype or v.dtype) if v.is_floating_point() else v.dtype).contiguous()
        for k, v in state.items()
    }
    floating = [v.dtype for v in weights.values() if v.is_floating_point()]
    config = dict(config, dtype=str(floating[0] if floating else torch.float32).removeprefix("torch."))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # a temp folder is private; the model folder is not
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)
    old = None
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
        os.rmdir(old)
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_config(folder: str | Path, *architectures: str, label: str = "drafter of this kind") -> dict:
    """A drafter folder's config.json, checked to be of one of `architectures` (the first is the
    kind's own; a folder naming none is taken as that); `label` names the kind in the error."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise BlockdraftError(f"{folder}: not a drafter folder (no config.json)")
    raw = json.loads((folder / "config.json").read_text())
    found = (raw.get("architectures") or [architectures[0]])[0]
    if found not in architectures:
        raise BlockdraftError(f"{folder}: not a {label} (architectures={raw.get('architectures')})")
    return raw


def load_weights(cls, cfg, folder: str | Path, device=None, dtype: torch.dtype | None = None):
    """Build `cls(cfg)` without allocating, then assign the folder's weights (checked by name)."""
    folder = Path(folder)
    if not (folder / "model.safetensors").is_file():
        raise BlockdraftError(f"{folder}: no model.safetensors")
    weights = {k.removeprefix("model."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    # weights a folder may carry that the model takes from elsewhere (a drafter: the target's
    # embedding and LM head, which DSpark checkpoints hold as copies)
    weights = {k: v for k, v in weights.items() if k not in getattr(cls, "borrowed_weights", ())}
    with torch.device("meta"):
        model = cls(cfg)
    expected = set(model.state_dict())
    missing, unexpected = expected - weights.keys(), weights.keys() - expected
    if missing or unexpected:
        raise BlockdraftError(
            f"{folder}: weights do not match the config (missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]})"
        )
    device, dtype = torch.device(device or "cpu"), dtype or torch.float32
    model.load_state_dict(
        {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in weights.items()}, assign=True
    )
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings).to(device)
    return model.eval()
