"""Argument checks for the public API: precise TypeError / ValueError before any launch.

`support_error(...)` is pure (tensor metadata only, plus the device's SM version): it returns the
message of the first problem or None, so a caller can ask "would flash4 take these?" and fall back.
`check_inputs(...)` raises that same message as TypeError (wrong Python type or dtype) or
ValueError (everything else).

Order of checks: Python types, dtypes, ranks, shapes, head dim, strides/alignment, softmax_scale,
causal, then device and SM version. Metadata checks come before the device check, so every shape
error is raised (and CPU-tested) for CPU tensors too; an input that is only wrong by being on the
CPU (empty or not) gets the device error.
"""

from __future__ import annotations

import math
import numbers

import torch

from flash4.config import SUPPORTED_HEADDIMS, select_fwd_config

# torch dtype -> the dtype name used in FwdConfig.
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# TMA needs 16-byte aligned base addresses and strides (the compiled kernels assume it for every
# stride but the contiguous last one: compile/fake.py).
_ALIGN_BYTES = 16


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _problem(q, k, v, softmax_scale=None, causal=False) -> tuple[type, str] | None:
    """(exception type, message) of the first problem with the arguments, or None."""
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            return TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if q.dtype not in DTYPE_NAMES:
        return TypeError, (
            f"q.dtype is {q.dtype}; flash4 supports torch.bfloat16 and torch.float16 "
            f"(convert with q.to(torch.bfloat16))"
        )
    for name, t in named[1:]:
        if t.dtype != q.dtype:
            return TypeError, f"{name}.dtype is {t.dtype} but q.dtype is {q.dtype}; q, k and v must share one dtype"

    layouts = {"q": "(batch, seqlen_q, nheads, headdim)", "k": "(batch, seqlen_k, nheads_k, headdim)",
               "v": "(batch, seqlen_k, nheads_k, headdim)"}
    for name, t in named:
        if t.dim() != 4:
            return ValueError, f"{name} must be 4-D {layouts[name]}; got shape {_shape(t)}"
    if k.shape[0] != q.shape[0]:
        return ValueError, (
            f"k.shape[0] (batch) is {k.shape[0]} but q.shape[0] is {q.shape[0]}; q, k and v need the same batch; "
            f"q.shape={_shape(q)}, k.shape={_shape(k)}"
        )
    if k.shape[3] != q.shape[3]:
        return ValueError, (
            f"k.shape[3] (headdim) is {k.shape[3]} but q.shape[3] is {q.shape[3]}; q, k and v need the same "
            f"headdim; q.shape={_shape(q)}, k.shape={_shape(k)}"
        )
    if v.shape != k.shape:
        return ValueError, (
            f"v must have the shape of k (batch, seqlen_k, nheads_k, headdim); got v.shape={_shape(v)}, "
            f"k.shape={_shape(k)}"
        )
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads < 1 or nheads_k < 1:
        return ValueError, (
            f"nheads (q.shape[2]={nheads}) and nheads_k (k.shape[2]={nheads_k}) must be >= 1"
        )
    if nheads % nheads_k != 0:
        return ValueError, (
            f"nheads_k={nheads_k} (k.shape[2]) must divide nheads={nheads} (q.shape[2]) for MQA/GQA; "
            f"q.shape={_shape(q)}, k.shape={_shape(k)}"
        )
    headdim = q.shape[3]
    if headdim not in SUPPORTED_HEADDIMS:
        allowed = ", ".join(str(d) for d in SUPPORTED_HEADDIMS)
        return ValueError, f"headdim {headdim} (q.shape[3]) is not supported; allowed: {allowed}"

    for name, t in named:
        problem = layout_problem(name, t)
        if problem is not None:
            return ValueError, problem

    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            return TypeError, f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            # The kernel takes the row max of the raw scores and scales afterwards, which is
            # only the max of the scaled scores for a positive scale.
            return ValueError, f"softmax_scale must be finite and > 0 (or None for 1/sqrt(headdim)); got {softmax_scale}"
    if not isinstance(causal, bool):
        return TypeError, f"causal must be a bool, got {type(causal).__name__}"

    for name, t in named:
        if t.device.type != "cuda":
            return ValueError, f"{name} is on {t.device}; flash4 runs on CUDA tensors only (move it with {name}.cuda())"
    for name, t in named[1:]:
        if t.device != q.device:
            return ValueError, f"{name} is on {t.device} but q is on {q.device}; q, k and v must be on one device"

    from flash4.arch import device_arch  # late: keeps `import flash4.validate` free of device queries

    arch = device_arch(q.device)
    try:
        select_fwd_config(headdim, DTYPE_NAMES[q.dtype], causal, arch=arch)
    except ValueError as err:
        return ValueError, f"{err} (q is on {q.device})"
    return None


def layout_problem(name: str, t: torch.Tensor) -> str | None:
    """Stride/alignment problem of one input, or None. Empty tensors are not checked (never read)."""
    if t.numel() == 0:
        return None
    if t.stride(-1) != 1:
        return (
            f"{name} has stride(-1)={t.stride(-1)} (shape {_shape(t)}, strides {t.stride()}); the last dim must be "
            f"contiguous: pass {name}.contiguous()"
        )
    elt = t.element_size()
    if t.data_ptr() % _ALIGN_BYTES != 0:
        return (
            f"{name}.data_ptr() is not {_ALIGN_BYTES}-byte aligned (offset {t.data_ptr() % _ALIGN_BYTES} bytes, "
            f"e.g. a slice inside the last dim); pass {name}.contiguous()"
        )
    for dim in range(t.dim() - 1):
        # every stride, also of size-1 dims: the compiled kernel assumes all of them divisible
        if (t.stride(dim) * elt) % _ALIGN_BYTES != 0:
            return (
                f"{name}.stride({dim})={t.stride(dim)} elements is not a multiple of {_ALIGN_BYTES // elt} "
                f"({_ALIGN_BYTES} bytes; strides {t.stride()}); pass {name}.contiguous()"
            )
        if t.stride(dim) == 0 and t.shape[dim] > 1:
            hint = " (for MQA/GQA pass k/v with nheads_k heads instead of expanding them)" if dim == 2 else ""
            return (
                f"{name} is expanded along dim {dim} (stride 0, shape {_shape(t)}); TMA loads need real strides: "
                f"pass {name}.contiguous(){hint}"
            )
    return None


def support_error(q, k, v, softmax_scale=None, causal=False) -> str | None:
    """Why flash4 cannot run these arguments, or None when it can.

    Arguments as in `flash4.flash_attn_func`. Never raises for bad arguments (only the device
    query of a CUDA tensor can raise, as torch.cuda does).
    """
    problem = _problem(q, k, v, softmax_scale, causal)
    return None if problem is None else problem[1]


def check_inputs(q, k, v, softmax_scale=None, causal=False) -> None:
    """Raise TypeError (non-tensor, dtype, mixed dtypes, softmax_scale/causal type) or ValueError
    (rank, batch/head/headdim mismatch, nheads_k not dividing nheads, unsupported headdim,
    non-contiguous last dim or misaligned stride, bad softmax_scale, non-CUDA or mixed devices,
    unsupported SM version) with the message of `support_error`."""
    problem = _problem(q, k, v, softmax_scale, causal)
    if problem is not None:
        exc_type, message = problem
        raise exc_type(message)


def resolve_softmax_scale(softmax_scale: float | None, headdim: int) -> float:
    """The scale applied to QK^T: softmax_scale, or 1/sqrt(headdim) when None."""
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
