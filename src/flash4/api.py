"""Public entry points: validate -> config -> compile (cached) -> launch.

flash4 is CUDA-only; gradients flow through flash4.autograd.FlashAttnFunc (backward: flash4.backward).
"""

from __future__ import annotations

import torch

import flash4.ops  # noqa: F401  (registers the flash4:: custom ops torch.compile traces)
from flash4.arch import device_arch
from flash4.autograd import FlashAttnFunc
from flash4.config import select_fwd_config
from flash4.validate import DTYPE_NAMES, layout_problem, check_inputs, resolve_softmax_scale


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, deterministic=False):
    """Exact attention softmax(softmax_scale * Q K^T) V, FlashAttention conventions.

    Args:
        q: (batch, seqlen_q, nheads, headdim) torch.bfloat16 or torch.float16, on a CUDA device.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads_k divides nheads
           (MQA/GQA: query head h reads key head h // (nheads // nheads_k)).
        v: same shape as k.
           q, k, v: last dim contiguous (stride 1), other strides and the base address 16-byte
           aligned (true of any tensor made by torch and of slices along batch/seqlen/heads).
           headdim one of flash4.config.SUPPORTED_HEADDIMS (64, 96, 128, 192, 256).
           seqlen_q may differ from seqlen_k; batch, seqlen_q and seqlen_k may be 0.
        softmax_scale: float > 0 applied to Q K^T; None means 1 / sqrt(headdim).
        causal: bool; the mask is aligned to the bottom-right corner (as FlashAttention 2/3):
           query row i sees key j iff j <= i + seqlen_k - seqlen_q. Rows that see no key
           (i < seqlen_q - seqlen_k) give out = 0 and lse = -inf; so does seqlen_k == 0.
        return_lse: bool; also return the log-sum-exp of each row.
        deterministic: bool; the backward adds the dQ contributions of the key blocks in a fixed
           order, so gradients are bitwise reproducible (slower). The forward is always deterministic.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q, contiguous; or
        (out, lse) when return_lse, lse: (batch, nheads, seqlen_q) torch.float32, natural log.

    Raises:
        TypeError: a non-tensor argument, a dtype other than bf16/fp16, q/k/v dtypes differing,
            softmax_scale not a real number, causal or return_lse not a bool.
        ValueError: a rank other than 4, batch/headdim/k-v shape mismatch, nheads_k not dividing
            nheads, an unsupported headdim, a non-contiguous last dim or misaligned stride,
            softmax_scale not finite and > 0, tensors not on one CUDA device, a GPU without a
            flash4 kernel (sm_90 only for now).
            flash4.validate.support_error(q, k, v, softmax_scale, causal) gives the same message
            without raising.

    Gradients: `.backward()` through `out` gives dq, dk, dv (flash4.backward); a loss that uses lse
        (return_lse=True) adds its gradient too (dS gains P * dLSE), at no cost when lse is unused.
        Double backward (differentiating dq, dk or dv again, e.g. a gradient penalty with
        create_graph=True) is not supported: it raises a RuntimeError saying so.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if torch.compiler.is_compiling():
        # torch.compile: one custom op per call (flash4.ops); its real implementation checks the
        # arguments when the compiled graph runs (pointers and the device are not known here).
        out, lse, _ = torch.ops.flash4.fwd(q, k, v, resolve_softmax_scale(softmax_scale, q.shape[3]), causal,
                                           deterministic)
        return (out, lse) if return_lse else out
    check_inputs(q, k, v, softmax_scale, causal)
    scale = resolve_softmax_scale(softmax_scale, q.shape[3])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = FlashAttnFunc.apply(q, k, v, scale, causal, deterministic)
    else:
        out, lse = _flash_attn_forward(q, k, v, scale, causal)
    return (out, lse) if return_lse else out


def _flash_attn_forward(q, k, v, softmax_scale=None, causal=False, out=None, lse=None, lse_split=None):
    """Forward on validated inputs (flash4.validate.check_inputs); returns (out, lse).

    out: None or a preallocated (batch, seqlen_q, nheads, headdim) tensor of q's dtype and device
        (last dim contiguous, 16-byte aligned) that the kernel overwrites;
    lse: None or a preallocated contiguous float32 (batch, nheads, seqlen_q) tensor.
    lse_split: None or a preallocated contiguous float32 (2, batch, nheads, seqlen_q) tensor that
        receives the log2-domain LSE unrounded, lse * log2(e) = lse_split[0] + lse_split[1] (+inf
        and 0 for rows that see no key); flash4.backward takes it for an exact P at any magnitude.
    Tests pass NaN-filled out/lse to catch unwritten elements. Empty problems never launch:
    batch == 0 or seqlen_q == 0 give empty out/lse; seqlen_k == 0 gives out = 0, lse = -inf.
    Raises ValueError for a preallocated out/lse of the wrong shape, dtype, device or layout.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = resolve_softmax_scale(softmax_scale, headdim)
    out_shape, lse_shape = (batch, seqlen_q, nheads, headdim), (batch, nheads, seqlen_q)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    else:
        _check_buffer("out", out, out_shape, q.dtype, q.device)
        problem = layout_problem("out", out)
        if problem is not None:
            raise ValueError(problem)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    else:
        _check_buffer("lse", lse, lse_shape, torch.float32, q.device)
        if not lse.is_contiguous():
            raise ValueError(f"lse must be contiguous; got strides {lse.stride()}")
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        if lse_split is not None:
            lse_split[0].fill_(float("inf"))
            lse_split[1].zero_()
        return out, lse

    from flash4.compile.cache import get_fwd_runner  # late: compiling pulls in the CuTe DSL

    cfg = select_fwd_config(headdim, DTYPE_NAMES[q.dtype], causal, arch=device_arch(q.device))
    run = get_fwd_runner(cfg)
    if q.device.index == torch.cuda.current_device():
        run(q, k, v, out, lse, scale, lse_split)
    else:
        with torch.cuda.device(q.device):
            run(q, k, v, out, lse, scale, lse_split)
    return out, lse


def _check_buffer(name, t, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be {dtype} of shape {shape} on {device}; got {t.dtype} of shape {tuple(t.shape)} on {t.device}"
        )
