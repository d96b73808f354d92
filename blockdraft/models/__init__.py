"""Target models: the Llama family, loaded from local HF folders."""

from .config import TargetConfig
from .loading import load_target, load_tokenizer
from .transformer import Transformer

__all__ = ["TargetConfig", "Transformer", "load_target", "load_tokenizer"]
