"""The implementations the benchmark times, flash4 and its competitors.

This is the only module of flash4 that imports flash_attn (the flash-attn-4 package, optional).
Each Impl turns (q, k, v, causal) in flash4's layout (batch, seqlen, nheads, headdim) into a
no-argument callable returning out in that layout; `context()` is entered around all calls of it
(the SDPA backend choice), so the per-call cost is the implementation's own.
SDPA gets transposed views of the same memory ((batch, nheads, seqlen, headdim), last dim
contiguous), as a model holding (batch, seqlen, nheads, headdim) activations would pass them.
Its `is_causal` is top-left aligned: equal to flash4's bottom-right mask only when seqlen_q ==
seqlen_k, which holds in the sweep and in the checks the benchmark runs on SDPA.
v may have its own head dim (the hdimv_* cells): every impl gets it as it is (flash-attn-4 and
cuDNN SDPA take Dv != D; an impl that refuses it raises, and the cell is NaN).
"""

from __future__ import annotations

import contextlib
import dataclasses
from importlib import metadata
from typing import Callable

import torch.nn.functional as F

try:
    from flash_attn.cute import flash_attn_func as _fa4_func

    FA4_IMPORT_ERROR = None
except Exception as err:  # ImportError, or a broken install failing inside its import
    _fa4_func = None
    FA4_IMPORT_ERROR = f"{type(err).__name__}: {err}"


def fa4_varlen_func():
    """flash-attn-4's flash_attn_varlen_func (packed, paged and decode cells), or None."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - not installed, or a broken install
        return None
    return flash_attn_varlen_func


@dataclasses.dataclass(frozen=True)
class Impl:
    """name: the CSV name; make(q, k, v, causal) -> fn; context() -> context manager;
    unavailable: why it cannot run here (None when it can)."""

    name: str
    make: Callable
    context: Callable = contextlib.nullcontext
    unavailable: str | None = None


def _sink(q):
    import torch

    return torch.randn(q.shape[2], device=q.device, dtype=torch.float32)


def _make_flash4(q, k, v, causal, window=None, softcap=0.0, sink=False):
    from flash4 import flash_attn_func

    extra = {} if window is None else {"window_size": window}
    if softcap:
        extra["softcap"] = softcap
    if sink:
        extra["learnable_sink"] = _sink(q)
    return lambda: flash_attn_func(q, k, v, causal=causal, **extra)


def _make_sdpa(q, k, v, causal, **unsupported):
    if unsupported:
        raise ValueError(f"SDPA has no {sorted(unsupported)}")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa).transpose(1, 2)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, name)
    return lambda: sdpa_kernel(backend)


def _make_fa4(q, k, v, causal, window=None, softcap=0.0, sink=False):
    # flash-attn-4 4.0.0b36 reads -1 as unbounded only when both sides are negative: pass the
    # windows the bench uses (both sides >= 0) as they are.
    extra = {} if window is None else {"window_size": tuple(window)}
    if softcap:
        extra["softcap"] = softcap
    if sink:
        extra["learnable_sink"] = _sink(q)

    def fn():
        res = _fa4_func(q, k, v, causal=causal, **extra)
        return res[0] if isinstance(res, tuple) else res  # some versions return (out, lse)

    return fn


def flash_attn_version() -> str | None:
    """Installed flash-attn(-4) version, or None when not installed."""
    for dist in ("flash-attn-4", "flash_attn_4", "flash-attn", "flash_attn"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def all_impls() -> list[Impl]:
    """flash4, flash_attn_4, sdpa_cudnn, sdpa_flash (in this order; CSV names)."""
    return [
        Impl("flash4", _make_flash4),
        Impl("flash_attn_4", _make_fa4, unavailable=FA4_IMPORT_ERROR),
        Impl("sdpa_cudnn", _make_sdpa, context=_sdpa_backend("CUDNN_ATTENTION")),
        Impl("sdpa_flash", _make_sdpa, context=_sdpa_backend("FLASH_ATTENTION")),
    ]


def math_impl() -> Impl:
    """PyTorch's math attention (materializes the scores): the memory yardstick, not timed."""
    return Impl("sdpa_math", _make_sdpa, context=_sdpa_backend("MATH"))

