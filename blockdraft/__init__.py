"""blockdraft: DFlash block-diffusion speculative decoding, lossless and fast."""

__version__ = "0.1.0"

from .engine import Engine, Generation  # noqa: E402
from .errors import BlockdraftError  # noqa: E402

__all__ = ["Engine", "Generation", "BlockdraftError", "__version__"]
