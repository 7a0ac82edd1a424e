"""flash4 as PyTorch custom operators (`torch.library.custom_op`, namespace `flash4::`), so that
`torch.compile` sees one opaque op per kernel call (with fake implementations that give the
output sizes, strides and dtypes) instead of a graph break at a foreign TVM-FFI call.

    flash4::fwd(q, k, v, softmax_scale, causal, deterministic, window_left=-1, window_right=-1,
        softcap=0.0, learnable_sink?=None) -> (out, lse, lse_split)
    flash4::bwd(dout, q, k, v, out, lse, lse_split, dlse?, softmax_scale, causal, deterministic,
        window_left=-1, window_right=-1, softcap=0.0) -> (dq, dk, dv)
    flash4::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k?, seqused_q?, seqused_k?, page_table?,
        max_seqlen_q: int?, max_seqlen_k: int?, softmax_scale, causal, deterministic, check_seqlens,
        window_left=-1, window_right=-1, softcap=0.0, learnable_sink?=None) -> (out, lse, lse_split)
    flash4::varlen_bwd(dout, q, k, v, out, lse, lse_split, dlse?, cu_seqlens_q, cu_seqlens_k,
        seqused_q?, seqused_k?, max_seqlen_q: int?, max_seqlen_k: int?, softmax_scale, causal,
        deterministic, window_left=-1, window_right=-1, softcap=0.0) -> (dq, dk, dv)
    flash4::kvcache(q, k_cache!, v_cache!, k?, v?, cache_seqlens?, cache_seqlens_int: int?,
        page_table?, cache_batch_idx?, softmax_scale, causal, num_splits, check_seqlens,
        window_left=-1, window_right=-1, softcap=0.0, learnable_sink?=None) -> (out, lse)

learnable_sink: None or the (nheads,) attention-sink logits (flash4.api.flash_attn_func's); the
autograd of fwd / varlen_fwd returns its gradient (flash4.autograd.sink_grad, in torch; the
backward ops need no sink).

window_left / window_right: flash-attn's sliding window (flash4.api.flash_attn_func's window_size,
one int per side, -1 unbounded on that side; the defaults are no window). softcap: the logit
soft-cap (flash4.api.flash_attn_func's; 0.0 = off). The forward ops validate them with the other
arguments when they run; the autograd formulas pass the forward's window and softcap to the
backward op.

Shapes and dtypes as in flash4.api: dense q, out (B, Sq, H, D); k, v (B, Sk, Hk, D); lse (B, H, Sq)
float32; lse_split (2, B, H, Sq) float32 (the unrounded log2 LSE the backward's exact path uses).
Varlen: q, out (total_q, H, D); k, v (total_k, Hk, D) or paged (num_pages, page_size, Hk, D); lse
(H, total_q); lse_split (2, H, total_q). kvcache: out (B, Sq, H, D), lse (B, H, Sq). Every output
is a new contiguous tensor.

Autograd is registered on flash4::fwd and flash4::varlen_fwd (their backward calls flash4::bwd /
flash4::varlen_bwd; dlse flows into dS as in flash4.autograd); the backward ops have none, so
differentiating them again raises torch's "autograd not registered" error. A paged varlen_fwd
(page_table given) raises flash4.autograd.PAGED_BACKWARD_ERROR when its backward is built (under
torch.compile: while compiling a graph that needs it). flash4::kvcache has no autograd (as
flash_attn_with_kvcache); it mutates k_cache / v_cache (the in-place append of k / v) and says so
in its schema (mutates_args), so functionalization orders it correctly.

Constraints of torch 2.11's custom ops, kept here: ops return every output (lse always), take
tensors positionally, never alias an input (flash_attn_with_kvcache's out= is a copy after the op
under torch.compile), and register autograd only on functional ops.

max_seqlen_q / max_seqlen_k are host ints (`int?` in the schema: SymInts under dynamic shapes).
None means "compute it from the metadata when the op runs": max(seqused) or the largest
cu_seqlens difference, read with one host sync inside the op's real implementation. Under
torch.compile, flash_attn_varlen_func passes None for a max_seqlen given as a tensor (reading a
tensor while tracing would break the graph), so a tensor max_seqlen is not used there: the op
computes the exact maximum from the metadata instead (a host sync when the compiled graph runs).

The public functions call these ops while torch.compile traces them (`torch.compiler.is_compiling()`),
and their autograd.Function / direct paths in eager mode; both run the same kernels
(flash4.api's private helpers). The fake implementations are checked on the CPU
(tests/cpu/test_ops.py); torch.compile on a GPU is covered by tests/gpu/test_integrations.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

F32 = torch.float32


def sink_kwargs(learnable_sink) -> dict:
    from flash4.autograd import sink_kwargs as kw

    return kw(learnable_sink)


def _out_shape(q: Tensor, v: Tensor) -> tuple:
    """out: q's shape with v's head dim (headdim_v may differ from q/k's)."""
    return tuple(q.shape[:-1]) + (v.shape[-1],)


def _fwd_shapes(q: Tensor):
    batch, seqlen_q, nheads, _ = q.shape
    return (batch, nheads, seqlen_q), (2, batch, nheads, seqlen_q)


# ================================================================ dense
@torch.library.custom_op("flash4::fwd", mutates_args=(), device_types="cuda")
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, deterministic: bool,
        window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
        learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    from flash4.api import _flash_attn_forward
    from flash4.validate import check_inputs

    window_size = (window_left, window_right)
    # real tensors: pointers and the device too
    check_inputs(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink)
    _, split_shape = _fwd_shapes(q)
    lse_split = torch.empty(split_shape, dtype=F32, device=q.device)
    out, lse = _flash_attn_forward(q, k, v, softmax_scale, causal, lse_split=lse_split, window_size=window_size,
                                   softcap=softcap, **sink_kwargs(learnable_sink))
    return out, lse, lse_split


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic, window_left=-1, window_right=-1, softcap=0.0,
              learnable_sink=None):
    lse_shape, split_shape = _fwd_shapes(q)
    return (torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device),  # out has v's head dim
            torch.empty(lse_shape, dtype=F32, device=q.device),
            torch.empty(split_shape, dtype=F32, device=q.device))


@torch.library.custom_op("flash4::bwd", mutates_args=(), device_types="cuda")
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_split: Tensor,
        dlse: Optional[Tensor], softmax_scale: float, causal: bool, deterministic: bool, window_left: int = -1,
        window_right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    from flash4.backward import flash_attn_backward

    return flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=deterministic,
                               lse_split=lse_split, dlse=dlse, window_size=(window_left, window_right),
                               softcap=softcap)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, lse_split, dlse, softmax_scale, causal, deterministic, window_left=-1,
              window_right=-1, softcap=0.0):
    return _grads_fake(q, k, v)


def _grads_fake(q, k, v):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap, learnable_sink = inputs
    out, lse, lse_split = output
    ctx.save_for_backward(q, k, v, out, lse, lse_split, learnable_sink)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window, ctx.softcap = (window_left, window_right), softcap
    ctx.mark_non_differentiable(lse_split)


def _backward(ctx, dout, dlse, dlse_split):
    from flash4.autograd import sink_grad

    q, k, v, out, lse, lse_split, sink = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dsink = sink_grad(sink, out, dout, lse, dlse, 2) if sink is not None and ctx.needs_input_grad[9] else None
    dq, dk, dv = torch.ops.flash4.bwd(dout, q, k, v, out, lse, lse_split, dlse, ctx.softmax_scale, ctx.causal,
                                      ctx.deterministic, *ctx.window, ctx.softcap)
    return (dq, dk, dv) + (None,) * 6 + (dsink,)


torch.library.register_autograd("flash4::fwd", _backward, setup_context=_setup_context)


# ================================================================ varlen / paged
def _varlen_shapes(q: Tensor):
    total_q, nheads, _ = q.shape
    return (nheads, total_q), (2, nheads, total_q)


def _max_seqlen(name: str, value: Optional[int], cu_seqlens: Optional[Tensor], seqused: Optional[Tensor]) -> int:
    from flash4.validate import resolve_max_seqlen

    return resolve_max_seqlen(name, value, cu_seqlens, seqused)


@torch.library.custom_op("flash4::varlen_fwd", mutates_args=(), device_types="cuda")
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor],
               seqused_q: Optional[Tensor], seqused_k: Optional[Tensor], page_table: Optional[Tensor],
               max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], softmax_scale: float, causal: bool,
               deterministic: bool, check_seqlens: bool, window_left: int = -1,
               window_right: int = -1, softcap: float = 0.0,
               learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    from flash4.api import _flash_attn_varlen_forward, _prepare_varlen

    window_size = (window_left, window_right)
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_q = _prepare_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
        softmax_scale, causal, window_size, softcap, learnable_sink, check_seqlens)
    _, split_shape = _varlen_shapes(q)
    lse_split = torch.empty(split_shape, dtype=F32, device=q.device)
    out, lse = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, softmax_scale, causal,
                                          seqused_q, seqused_k, page_table, lse_split=lse_split,
                                          window_size=window_size, softcap=softcap, **sink_kwargs(learnable_sink))
    return out, lse, lse_split


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, deterministic, check_seqlens, window_left=-1,
                     window_right=-1, softcap=0.0, learnable_sink=None):
    lse_shape, split_shape = _varlen_shapes(q)
    return (torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device),
            torch.empty(lse_shape, dtype=F32, device=q.device),
            torch.empty(split_shape, dtype=F32, device=q.device))


@torch.library.custom_op("flash4::varlen_bwd", mutates_args=(), device_types="cuda")
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_split: Tensor,
               dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q: Optional[Tensor],
               seqused_k: Optional[Tensor], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
               softmax_scale: float, causal: bool, deterministic: bool, window_left: int = -1,
               window_right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    from flash4.api import _contiguous, _flash_attn_varlen_backward

    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = (
        _contiguous(t) for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))
    max_q = _max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, seqused_q)
    max_k = _max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k, seqused_k)
    return _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                       softmax_scale, causal, seqused_q, seqused_k, deterministic=deterministic,
                                       lse_split=lse_split, dlse=dlse, window_size=(window_left, window_right),
                                       softcap=softcap)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, lse_split, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, window_left=-1,
                     window_right=-1, softcap=0.0):
    return _grads_fake(q, k, v)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k,
     softmax_scale, causal, deterministic, _check_seqlens, window_left, window_right, softcap, learnable_sink) = inputs
    out, lse, lse_split = output
    ctx.paged = page_table is not None
    if not ctx.paged:
        ctx.save_for_backward(q, k, v, out, lse, lse_split, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                              learnable_sink)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window, ctx.softcap = (window_left, window_right), softcap
    ctx.mark_non_differentiable(lse_split)


def _varlen_backward(ctx, dout, dlse, dlse_split):
    from flash4.autograd import PAGED_BACKWARD_ERROR

    if ctx.paged:
        raise RuntimeError(PAGED_BACKWARD_ERROR)
    from flash4.autograd import sink_grad, varlen_row_mask

    q, k, v, out, lse, lse_split, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sink = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dsink = None
    if sink is not None and ctx.needs_input_grad[17]:
        dsink = sink_grad(sink, out, dout, lse, dlse, 1, varlen_row_mask(cu_seqlens_q, seqused_q, q.shape[0]))
    dq, dk, dv = torch.ops.flash4.varlen_bwd(dout, q, k, v, out, lse, lse_split, dlse, cu_seqlens_q, cu_seqlens_k,
                                             seqused_q, seqused_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                                             ctx.softmax_scale, ctx.causal, ctx.deterministic, *ctx.window,
                                             ctx.softcap)
    return (dq, dk, dv) + (None,) * 14 + (dsink,)


torch.library.register_autograd("flash4::varlen_fwd", _varlen_backward, setup_context=_varlen_setup_context)


# ================================================================ KV cache (decode)
@torch.library.custom_op("flash4::kvcache", mutates_args=("k_cache", "v_cache"), device_types="cuda")
def kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
            cache_seqlens: Optional[Tensor], cache_seqlens_int: Optional[int], page_table: Optional[Tensor],
            cache_batch_idx: Optional[Tensor], softmax_scale: float, causal: bool, num_splits: int,
            check_seqlens: bool, window_left: int = -1, window_right: int = -1,
            softcap: float = 0.0, learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """flash_attn_with_kvcache as an op: cache_seqlens is the (batch,) int32 tensor, or None with
    cache_seqlens_int the Python int (or None too: the whole cache). Appends k / v to the caches
    in place, then attends; returns new (out, lse)."""
    from flash4.api import _flash_attn_kvcache
    from flash4.validate import check_kvcache_inputs

    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    window_size = (window_left, window_right)
    check_kvcache_inputs(q, k_cache, v_cache, k, v, seqlens, page_table, cache_batch_idx, softmax_scale, causal,
                         num_splits, window_size=window_size, softcap=softcap, **sink_kwargs(learnable_sink))
    return _flash_attn_kvcache(q, k_cache, v_cache, k, v, seqlens, page_table, cache_batch_idx, softmax_scale,
                               causal, num_splits, check_seqlens=check_seqlens, window_size=window_size,
                               softcap=softcap, **sink_kwargs(learnable_sink))


@kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, page_table, cache_batch_idx,
                  softmax_scale, causal, num_splits, check_seqlens, window_left=-1, window_right=-1, softcap=0.0,
                  learnable_sink=None):
    lse_shape, _ = _fwd_shapes(q)
    return (torch.empty(_out_shape(q, v_cache), dtype=q.dtype, device=q.device),
            torch.empty(lse_shape, dtype=F32, device=q.device))
