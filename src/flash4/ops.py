"""flash4 as PyTorch custom operators (`torch.library.custom_op`, namespace `flash4::`), so that
`torch.compile` sees one opaque op per kernel call (with fake implementations that give the
output sizes, strides and dtypes) instead of a graph break at a foreign TVM-FFI call.

    flash4::fwd(q, k, v, softmax_scale, causal, deterministic) -> (out, lse, lse_split)
    flash4::bwd(dout, q, k, v, out, lse, lse_split, dlse?, softmax_scale, causal, deterministic)
        -> (dq, dk, dv)

Shapes and dtypes as in flash4.api.flash_attn_func: q, out (B, Sq, H, D); k, v (B, Sk, Hk, D);
lse (B, H, Sq) float32; lse_split (2, B, H, Sq) float32 (the unrounded log2 LSE the backward's
exact path uses). Autograd is registered on flash4::fwd (its backward calls flash4::bwd; dlse
flows into dS as in flash4.autograd); flash4::bwd has none, so differentiating it again raises
torch's "autograd not registered" error. Constraints of torch 2.11's custom ops, kept here: ops
return every output (lse always), take tensors positionally, and never alias an input.

flash_attn_func calls these ops while torch.compile traces it (`torch.compiler.is_compiling()`),
and the autograd.Function path in eager mode; both run the same kernels
(api._flash_attn_forward, backward.flash_attn_backward). The fake implementations are checked on
the CPU (tests/cpu/test_ops.py); torch.compile on a GPU is not yet measured.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _fwd_shapes(q: Tensor):
    batch, seqlen_q, nheads, _ = q.shape
    return (batch, nheads, seqlen_q), (2, batch, nheads, seqlen_q)


@torch.library.custom_op("flash4::fwd", mutates_args=(), device_types="cuda")
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
        deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    from flash4.api import _flash_attn_forward
    from flash4.validate import check_inputs

    check_inputs(q, k, v, softmax_scale, causal)  # real tensors here: pointers and the device too
    _, split_shape = _fwd_shapes(q)
    lse_split = torch.empty(split_shape, dtype=torch.float32, device=q.device)
    out, lse = _flash_attn_forward(q, k, v, softmax_scale, causal, lse_split=lse_split)
    return out, lse, lse_split


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic):
    lse_shape, split_shape = _fwd_shapes(q)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(lse_shape, dtype=torch.float32, device=q.device),
            torch.empty(split_shape, dtype=torch.float32, device=q.device))


@torch.library.custom_op("flash4::bwd", mutates_args=(), device_types="cuda")
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_split: Tensor,
        dlse: Optional[Tensor], softmax_scale: float, causal: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    from flash4.backward import flash_attn_backward

    return flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=deterministic,
                               lse_split=lse_split, dlse=dlse)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, lse_split, dlse, softmax_scale, causal, deterministic):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse, lse_split = output
    ctx.save_for_backward(q, k, v, out, lse, lse_split)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.mark_non_differentiable(lse_split)


def _backward(ctx, dout, dlse, dlse_split):
    q, k, v, out, lse, lse_split = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.flash4.bwd(dout, q, k, v, out, lse, lse_split, dlse, ctx.softmax_scale, ctx.causal,
                                      ctx.deterministic)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("flash4::fwd", _backward, setup_context=_setup_context)
