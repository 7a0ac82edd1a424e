"""flash4: exact attention (FlashAttention-4 style) written in CuTe DSL, called from PyTorch.

Public names: `flash_attn_func` (dense batches), `flash_attn_varlen_func` (packed variable-length
batches, paged K/V), `flash_attn_with_kvcache` (decode against a KV cache) and `__version__`.
Everything else is internal.
"""

__version__ = "0.1.0"

from flash4.api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "__version__"]
