"""flash4: exact attention (FlashAttention-4 style) written in CuTe DSL, called from PyTorch.

Public names: `flash_attn_func` and `__version__`. Everything else is internal.
"""

__version__ = "0.1.0"

from flash4.api import flash_attn_func

__all__ = ["flash_attn_func", "__version__"]
