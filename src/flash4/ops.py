"""flash4 as PyTorch custom operators (`torch.library.custom_op`, namespace `flash4::`), so that
`torch.compile` sees one opaque op per kernel call (with fake implementations that give the
output sizes, strides and dtypes) instead of a graph break at a foreign TVM-FFI call.

    flash4::fwd(q, k, v, softmax_scale, causal, deterministic, window_left=None, window_right=None,
        softcap=0.0, learnable_sink?=None) -> (out, lse, lse_split)
    flash4::bwd(dout, q, k, v, out, lse, lse_split, dlse?, softmax_scale, causal, deterministic,
        window_left=None, window_right=None, softcap=0.0) -> (dq, dk, dv)
    flash4::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k?, seqused_q?, seqused_k?, page_table?,
        max_seqlen_q: int?, max_seqlen_k: int?, softmax_scale, causal, deterministic, check_seqlens,
        window_left=None, window_right=None, softcap=0.0, learnable_sink?=None) -> (out, lse, lse_split)
    flash4::varlen_bwd(dout, q, k, v, out, lse, lse_split, dlse?, cu_seqlens_q, cu_seqlens_k,
        seqused_q?, seqused_k?, max_seqlen_q: int?, max_seqlen_k: int?, softmax_scale, causal,
        deterministic, window_left=None, window_right=None, softcap=0.0) -> (dq, dk, dv)
    flash4::kvcache(q, k_cache!, v_cache!, k?, v?, cache_seqlens?, cache_seqlens_int: int?,
        page_table?, cache_batch_idx?, softmax_scale, causal, num_splits, check_seqlens,
        window_left=None, window_right=None, softcap=0.0, learnable_sink?=None) -> (out, lse)

An op's arguments are a flash4.request.Request laid flat: `forward_args(request)` / `kvcache_args(request)`
lay a request out for its op, and each forward op's real implementation builds the request again
through flash4.validate (its arguments are checked when the compiled graph runs: pointers and the
device are not known while tracing) and runs flash4.forward.run; the backward ops build theirs
unchecked (the forward ran) and run flash4.backward.run. The backward ops take the forward op's
arguments by the same names (the autograd formula, flash4.autograd, passes them on by name).

learnable_sink: None or the (nheads,) attention-sink logits (flash4.api.flash_attn_func's); its
gradient comes from flash4.autograd.sink_grad (in torch; the backward ops need no sink).
window_left / window_right: the window's literal sides (flash4.request.MaskSpec.window_size, a
flash4.geometry.Band: None unbounded on that side, any int, so bands that exclude the diagonal
travel too; the defaults are no window). softcap: the logit
soft-cap (0.0 = off).

Shapes and dtypes as in flash4.forward: dense q, out (B, Sq, H, D); k, v (B, Sk, Hk, D); lse (B, H, Sq)
float32; lse_split (2, B, H, Sq) float32 (the unrounded log2 LSE the backward's exact path uses).
Varlen: q, out (total_q, H, D); k, v (total_k, Hk, D) or paged (num_pages, page_size, Hk, D); lse
(H, total_q); lse_split (2, H, total_q). kvcache: out (B, Sq, H, D), lse (B, H, Sq). Every output
is a new contiguous tensor.

Autograd: flash_attn_func / flash_attn_varlen_func reach these ops through flash4.autograd's
FlashAttnFunction under torch.compile (the one autograd path, eager and compile alike); the same
formula is registered on flash4::fwd and flash4::varlen_fwd themselves (flash4.autograd), for
callers of the ops. The backward ops have no autograd, so differentiating them again raises
torch's "autograd not registered" error. A paged varlen_fwd (page_table given) raises
flash4.autograd.PAGED_BACKWARD_ERROR when its backward is built (under torch.compile: while
compiling a graph that needs it). flash4::kvcache has no autograd (as flash_attn_with_kvcache); it
mutates k_cache / v_cache (the in-place append of k / v) and says so in its schema (mutates_args),
so functionalization orders it correctly.

Constraints of torch's custom ops (2.11 and later), kept here: ops return every output (lse always),
take tensors positionally, never alias an input (flash_attn_with_kvcache's out= is a copy after the op
under torch.compile), and register autograd only on functional ops.

max_seqlen_q / max_seqlen_k are host ints (`int?` in the schema: SymInts under dynamic shapes).
None means "compute it from the metadata when the op runs": max(seqused) or the largest
cu_seqlens difference, read with one host sync inside the op's real implementation. Under
torch.compile, a max_seqlen given as a tensor reaches the op as None (reading a tensor while tracing
would break the graph): the op computes the exact maximum from the metadata instead (a host sync
when the compiled graph runs).

The fake implementations are checked on the CPU (tests/cpu/test_ops.py); torch.compile on a GPU is
covered by tests/gpu/test_integrations.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from flash4 import backward, forward, memo, validate
from flash4.geometry import Band
from flash4.request import Request

F32 = torch.float32


def _out_shape(q: Tensor, v: Tensor) -> tuple:
    """out: q's shape with v's head dim (headdim_v may differ from q/k's)."""
    return tuple(q.shape[:-1]) + (v.shape[-1],)


def _fwd_shapes(q: Tensor):
    batch, seqlen_q, nheads, _ = q.shape
    return (batch, nheads, seqlen_q), (2, batch, nheads, seqlen_q)


def _outputs(request: Request):
    """(out, lse, lse_split) of a forward op: flash4.forward.run with a new lse_split."""
    lse_split = forward.new_lse_split(request)
    out, lse = forward.run(request, lse_split=lse_split)
    return out, lse, lse_split


def _grads_fake(q, k, v):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


# ================================================================ dense
@torch.library.custom_op("flash4::fwd", mutates_args=(), device_types="cuda")
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, deterministic: bool,
        window_left: Optional[int] = None, window_right: Optional[int] = None, softcap: float = 0.0,
        learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _outputs(validate.dense_request(q, k, v, softmax_scale, causal, Band(window_left, window_right), softcap,
                                           learnable_sink, deterministic))


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic, window_left=None, window_right=None, softcap=0.0,
              learnable_sink=None):
    lse_shape, split_shape = _fwd_shapes(q)
    return (torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device),  # out has v's head dim
            torch.empty(lse_shape, dtype=F32, device=q.device),
            torch.empty(split_shape, dtype=F32, device=q.device))


def dense_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_split: Tensor,
                   dlse: Optional[Tensor], softmax_scale: float, causal: bool, deterministic: bool,
                   window_left: Optional[int] = None, window_right: Optional[int] = None,
                   softcap: float = 0.0, sink_delta: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """flash4::bwd's implementation (the eager autograd path calls it without the op's dispatch):
    (dq, dk, dv, delta). sink_delta (a learnable sink needs a gradient): delta is each row's D in fp32,
    lse's shape (flash4.backward.run's delta); else an empty tensor."""
    key = memo.dense_backward_key(dout, q, k, v, out, lse, lse_split, dlse, softmax_scale, causal, deterministic,
                                  window_left, window_right, softcap, sink_delta)
    call = memo.get(key)
    delta = _delta_buffer(lse, sink_delta)
    if call is None:
        request = Request.dense(q, k, v, softmax_scale, causal, Band(window_left, window_right), softcap,
                                deterministic=deterministic)
        call = None if key is None else backward.prepare_dense(request, sink_delta)
        if call is None:  # not kept, or no work (empty): the whole host path
            grads = backward.run(request, dout, out, lse, lse_split, dlse, delta=delta if sink_delta else None)
            return (*grads, delta)
        memo.put(key, call)
    return (*call(q, k, v, dout, out, lse, lse_split, dlse, delta if sink_delta else None), delta)


def _delta_buffer(lse: Tensor, sink_delta: bool) -> Tensor:
    """The backward ops' 4th output: lse-shaped fp32 for each row's D with sink_delta, else empty."""
    return torch.empty(lse.shape if sink_delta else (0,), dtype=F32, device=lse.device)


bwd = torch.library.custom_op("flash4::bwd", dense_backward, mutates_args=(), device_types="cuda")


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, lse_split, dlse, softmax_scale, causal, deterministic, window_left=None,
              window_right=None, softcap=0.0, sink_delta=False):
    return (*_grads_fake(q, k, v), _delta_buffer(lse, sink_delta))


# ================================================================ varlen / paged
def _varlen_shapes(q: Tensor):
    total_q, nheads, _ = q.shape
    return (nheads, total_q), (2, nheads, total_q)


@torch.library.custom_op("flash4::varlen_fwd", mutates_args=(), device_types="cuda")
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor],
               seqused_q: Optional[Tensor], seqused_k: Optional[Tensor], page_table: Optional[Tensor],
               max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], softmax_scale: float, causal: bool,
               deterministic: bool, check_seqlens: bool, window_left: Optional[int] = None,
               window_right: Optional[int] = None, softcap: float = 0.0,
               learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _outputs(validate.varlen_request(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
        softmax_scale, causal, Band(window_left, window_right), softcap, learnable_sink, deterministic, check_seqlens))


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, deterministic, check_seqlens, window_left=None,
                     window_right=None, softcap=0.0, learnable_sink=None):
    lse_shape, split_shape = _varlen_shapes(q)
    return (torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device),
            torch.empty(lse_shape, dtype=F32, device=q.device),
            torch.empty(split_shape, dtype=F32, device=q.device))


def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_split: Tensor,
                    dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q: Optional[Tensor],
                    seqused_k: Optional[Tensor], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                    softmax_scale: float, causal: bool, deterministic: bool, window_left: Optional[int] = None,
                    window_right: Optional[int] = None, softcap: float = 0.0,
                    sink_delta: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """flash4::varlen_bwd's implementation (the eager autograd path calls it without the op's
    dispatch, with max_seqlen_k possibly a 0-d tensor: flash4.backward.run resolves it):
    (dq, dk, dv, delta), delta as dense_backward's ((H, total_q) with sink_delta)."""
    request = Request.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                             None, softmax_scale, causal, Band(window_left, window_right), softcap,
                             deterministic=deterministic)
    delta = _delta_buffer(lse, sink_delta)
    return (*backward.run(request, dout, out, lse, lse_split, dlse, delta=delta if sink_delta else None), delta)


varlen_bwd = torch.library.custom_op("flash4::varlen_bwd", varlen_backward, mutates_args=(), device_types="cuda")


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, lse_split, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, window_left=None,
                     window_right=None, softcap=0.0, sink_delta=False):
    return (*_grads_fake(q, k, v), _delta_buffer(lse, sink_delta))


# ================================================================ KV cache (decode)
@torch.library.custom_op("flash4::kvcache", mutates_args=("k_cache", "v_cache"), device_types="cuda")
def kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
            cache_seqlens: Optional[Tensor], cache_seqlens_int: Optional[int], page_table: Optional[Tensor],
            cache_batch_idx: Optional[Tensor], softmax_scale: float, causal: bool, num_splits: int,
            check_seqlens: bool, window_left: Optional[int] = None, window_right: Optional[int] = None,
            softcap: float = 0.0, learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """flash_attn_with_kvcache as an op: cache_seqlens is the (batch,) int32 tensor, or None with
    cache_seqlens_int the Python int (or None too: the whole cache). Appends k / v to the caches
    in place, then attends; returns new (out, lse)."""
    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    return forward.run(validate.kvcache_request(
        q, k_cache, v_cache, k, v, seqlens, page_table, cache_batch_idx, softmax_scale, causal, num_splits,
        window_size=Band(window_left, window_right), softcap=softcap, learnable_sink=learnable_sink,
        check_seqlens=check_seqlens))


@kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, page_table, cache_batch_idx,
                  softmax_scale, causal, num_splits, check_seqlens, window_left=None, window_right=None, softcap=0.0,
                  learnable_sink=None):
    lse_shape, _ = _fwd_shapes(q)
    return (torch.empty(_out_shape(q, v_cache), dtype=q.dtype, device=q.device),
            torch.empty(lse_shape, dtype=F32, device=q.device))


# ================================================================ a request laid out for its op
def _names(op) -> tuple:
    return tuple(a.name for a in op.default._schema.arguments)


# The argument names of the forward and backward ops, indexed by `varlen` (False: fwd / bwd).
FORWARD_ARGS = (_names(torch.ops.flash4.fwd), _names(torch.ops.flash4.varlen_fwd))
BACKWARD_ARGS = (_names(torch.ops.flash4.bwd), _names(torch.ops.flash4.varlen_bwd))
# What computes the backward: the ops (torch.compile) and their implementations (eager, no dispatch).
BACKWARD_OPS = (torch.ops.flash4.bwd, torch.ops.flash4.varlen_bwd)
BACKWARD_IMPLS = (dense_backward, varlen_backward)


def _op_int(value):
    """A max_seqlen as an `int?` argument: while torch.compile traces, a tensor (or None) becomes None
    (the op computes the maximum from the metadata when it runs); otherwise the value as given."""
    if torch.compiler.is_compiling() and isinstance(value, torch.Tensor):
        return None
    return value


def forward_args(request: Request) -> tuple[bool, tuple]:
    """(varlen, args): a DENSE (varlen False) or VARLEN / PAGED request laid out as the arguments of
    flash4::fwd or flash4::varlen_fwd. Outside torch.compile a max_seqlen_k given as a 0-d tensor
    stays one (the eager backward reads it when it runs); the op itself takes ints or None."""
    q, k, v, mask, score, seq = request.q, request.k, request.v, request.mask, request.score, request.seq
    tail = (*mask.window_size, score.softcap, score.sink)
    if not seq.packed:
        return False, (q, k, v, score.softmax_scale, mask.causal, request.deterministic) + tail
    return True, (q, k, v, seq.cu_seqlens_q, seq.cu_seqlens_k, seq.seqused_q, seq.seqused_k, seq.page_table,
                  _op_int(seq.max_seqlen_q), _op_int(seq.max_seqlen_k), score.softmax_scale, mask.causal,
                  request.deterministic, request.check_seqlens) + tail


def kvcache_args(request: Request) -> tuple:
    """A KVCACHE request laid out as flash4::kvcache's arguments (an int cache_seqlens as cache_seqlens_int)."""
    cache, mask, score = request.cache, request.mask, request.score
    seqlens = cache.cache_seqlens
    tensor = isinstance(seqlens, torch.Tensor)
    return (request.q, request.k, request.v, cache.k_new, cache.v_new, seqlens if tensor else None,
            None if tensor else seqlens, request.seq.page_table, cache.cache_batch_idx, score.softmax_scale,
            mask.causal, cache.num_splits, request.check_seqlens, *mask.window_size, score.softcap, score.sink)


# ================================================================ CPU tensors: a clear error
def _refuse_cpu(op) -> None:
    """op's CPU kernel: instead of the dispatcher's "Could not run 'flash4::...' with arguments from
    the 'CPU' backend", the ValueError the public functions raise, naming the first argument that is
    not on a CUDA device (flash4.validate's words)."""
    qualname = f"flash4::{op._name}"
    names = [arg.name for arg in getattr(torch.ops.flash4, op._name).default._schema.arguments]

    def refuse(*args, **kwargs):
        named = list(zip(names, args)) + list(kwargs.items())
        for name, value in named:
            if isinstance(value, Tensor):
                problem = validate.cuda_problem(name, value)
                if problem is not None:
                    kind, message = problem
                    raise kind(f"{qualname}: {message}")
        raise ValueError(f"{qualname}: runs on CUDA tensors only")

    op.register_kernel("cpu", refuse)


for _op in (fwd, bwd, varlen_fwd, varlen_bwd, kvcache):
    _refuse_cpu(_op)
