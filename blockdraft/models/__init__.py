"""Target models: the Llama family and Qwen3.5, loaded from local HF folders."""

from .config import TargetConfig
from .loading import eos_token_ids, load_target, load_tokenizer, stop_token_ids
from .transformer import Transformer

__all__ = ["TargetConfig", "Transformer", "eos_token_ids", "load_target", "load_tokenizer", "stop_token_ids"]
