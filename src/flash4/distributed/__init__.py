"""flash4.distributed: context-parallel attention, one long sequence (or a packed batch of them)
sharded across the ranks of a torch.distributed group, K/V passed round a ring.

    ring_flash_attn_varlen_func(q, k, v, cu_seqlens, ...)   packed sequences (what torch's
                                                           context_parallel does not cover)
    ring_flash_attn_func(q, k, v, ...)                      dense (batch, seqlen, nheads, headdim)
    zigzag_shard / zigzag_unshard / zigzag_cu_seqlens / zigzag_rows   the sharding (shard.py)
    backward_here(out, dout, lse, dlse)                     the ring's backward on the calling thread
                                                           (ranks emulated by threads: local_rings)

Causal attention uses zigzag load balancing (each rank holds chunks r and 2W-1-r of every
sequence: schedule.py); K/V blocks go round the ring with batch_isend_irecv, overlapped with the
block's kernel (comm.py); partial (out, lse) are merged exactly in fp32 (merge.py); the backward
passes dK/dV round the ring with their blocks while dQ stays local (ring.py). The attention of one
block is injectable (kernel.py): flash4's kernels by default, the float reference for CPU tests.
docs/design/context_parallel.md has the algorithm and what was verified where.
"""

from __future__ import annotations

import math

import torch

from flash4.distributed.comm import TorchRing, local_rings
from flash4.distributed.kernel import Flash4Kernel, ReferenceKernel
from flash4.distributed.ring import Plan, RingAttnFunction
from flash4.distributed.shard import zigzag_cu_seqlens, zigzag_rows, zigzag_shard, zigzag_unshard

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "zigzag_shard", "zigzag_unshard",
           "zigzag_cu_seqlens", "zigzag_rows", "Flash4Kernel", "ReferenceKernel", "local_rings", "backward_here"]


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, *, softmax_scale=None, causal=False, return_lse=False,
                                group=None, kernel=None):
    """Exact attention of packed sequences sharded across the ranks of a ring; each rank calls it
    with its own shard (the same call on every rank of the group).

    Args:
        q: (total, nheads, headdim) this rank's query rows; with causal=True the zigzag shard of
           every sequence (zigzag_shard(x, rank, W, cu_seqlens_global): chunks r and 2W-1-r, so
           the causal mask is the global one); without causal any split with equal per-sequence
           row counts on every rank (the result is the same for any order of the keys).
        k, v: (total, nheads_k, headdim) / (total, nheads_k, headdim_v): the same rows of K and V;
           nheads_k divides nheads. dtype and device as the kernel needs (flash4's: bf16 / fp16 on
           an sm_90 GPU, head dims of the backward kernels).
        cu_seqlens: (batch + 1,) torch.int32 on q's device: the LOCAL prefix sums
           (zigzag_cu_seqlens(global, W)), identical on every rank, cu_seqlens[-1] == total; with
           causal every local length even (global lengths multiples of 2W).
        softmax_scale: float > 0; None means 1 / sqrt(headdim).
        causal: bool; per sequence, over the GLOBAL positions (self-attention: seqlen_q == seqlen_k).
        return_lse: also return lse (nheads, total) fp32, natural log (differentiable).
        group: a torch.distributed ProcessGroup (its ranks in group-rank order form the ring);
           None: the default group, or no ring (world size 1) when torch.distributed is not
           initialized; or a ring from local_rings(W) (W ranks emulated by threads of one process).
        kernel: the attention of one block (flash4.distributed.kernel): None = Flash4Kernel().

    Returns:
        out (total, nheads, headdim_v) in q's dtype; or (out, lse) with return_lse.

    Raises:
        TypeError: q/k/v/cu_seqlens not tensors, cu_seqlens not int32, q/k/v dtypes differing.
        ValueError: ranks or shapes (k/v rows or heads not matching q), cu_seqlens not 1-D or its
            last entry not total, an odd local length with causal, softmax_scale not finite > 0.
        The kernel's own errors (flash4's ValueError / TypeError) for what it cannot run.

    Gradients: out.backward() (and lse's) gives dq, dk, dv of this rank's shard; every rank must
    run the backward (it is a ring pass too).
    """
    lengths = _check(q, k, v, cu_seqlens, causal)
    scale = _scale(softmax_scale, q.shape[-1])
    ring = _ring(group)
    plan = Plan.create(cu_seqlens, lengths, scale, causal)
    out, lse = RingAttnFunction.apply(q, k, v, plan, ring, Flash4Kernel() if kernel is None else kernel)
    return (out, lse) if return_lse else out


def ring_flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, *, group=None, kernel=None):
    """ring_flash_attn_varlen_func for dense batches: q (batch, seqlen, nheads, headdim), k / v
    (batch, seqlen, nheads_k, headdim[_v]), this rank's zigzag shard along seqlen
    (zigzag_shard(x, rank, W): chunks r and 2W-1-r of each sequence; seqlen even with causal).
    Returns out (batch, seqlen, nheads, headdim_v), and lse (batch, nheads, seqlen) fp32 with
    return_lse. Runs the packed ring over the batch's rows (a view when q/k/v are contiguous).
    Raises TypeError / ValueError as ring_flash_attn_varlen_func (a rank other than 4, k/v batch
    or seqlen not q's)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ring_flash_attn_func: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"ring_flash_attn_func: {name} must be 4-D (batch, seqlen, nheads, headdim), got shape "
                             f"{tuple(t.shape)}")
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"ring_flash_attn_func: k and v must have q's (batch, seqlen) {tuple(q.shape[:2])} (a ring "
                         f"shards self-attention), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    batch, seqlen = q.shape[:2]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen
    res = ring_flash_attn_varlen_func(q.reshape(batch * seqlen, *q.shape[2:]), k.reshape(batch * seqlen, *k.shape[2:]),
                                      v.reshape(batch * seqlen, *v.shape[2:]), cu, softmax_scale=softmax_scale,
                                      causal=causal, return_lse=True, group=group, kernel=kernel)
    out = res[0].view(batch, seqlen, *res[0].shape[1:])
    if not return_lse:
        return out
    return out, res[1].view(-1, batch, seqlen).permute(1, 0, 2)


def backward_here(out, dout, lse=None, dlse=None):
    """(dq, dk, dv) of the ring call that returned `out` (and `lse`), computed on the calling thread
    instead of by out.backward(): for ranks emulated by threads of one process (local_rings) on a
    GPU. torch's autograd engine runs every CUDA backward node on one worker thread per device, so
    emulated ranks calling .backward() queue behind each other there and the first waits for its
    neighbour's dK/dV forever; real ranks (one process each) use .backward() as usual.

    Args:
        out: the ring call's out (either door, any reshape of it); must require grad.
        dout: the gradient of out, out's shape and dtype.
        lse / dlse: the call's lse and its gradient (lse's shape, fp32), or None for no lse gradient.

    Returns:
        dq, dk, dv shaped as the packed (total, heads, headdim) rows the ring ran on (views: reshape
        to q's shape for the dense door), in q / k / v's dtype.

    Raises:
        ValueError: out does not come from a ring call, or dout / dlse do not match out / lse.
    """
    node = _ring_node(out)
    if dout.shape != out.shape:
        raise ValueError(f"backward_here: dout must have out's shape {tuple(out.shape)}, got {tuple(dout.shape)}")
    if (lse is None) != (dlse is None) or (lse is not None and dlse.shape != lse.shape):
        raise ValueError("backward_here: pass lse and dlse together, dlse of lse's shape")
    saved_out = node.saved_tensors[3]  # RingAttnFunction.forward saves (q, k, v, out, lse)
    grad_lse = None
    if dlse is not None:  # the dense door returns lse (batch, nheads, seqlen): the ring's (nheads, rows)
        grad_lse = dlse.permute(1, 0, 2).reshape(dlse.shape[1], -1) if dlse.dim() == 3 else dlse
        grad_lse = grad_lse.contiguous()
    grads = node.apply(dout.reshape(saved_out.shape).contiguous(), grad_lse)
    return tuple(grads[:3])


def _ring_node(t):
    """The RingAttnFunction node that t's graph comes from (through the doors' reshapes / views)."""
    stack = [getattr(t, "grad_fn", None)]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if getattr(node, "_forward_cls", None) is RingAttnFunction:
            return node
        stack.extend(n for n, _ in node.next_functions)
    raise ValueError("backward_here: out does not come from ring_flash_attn_func / ring_flash_attn_varlen_func "
                     "(or it does not require grad)")


class _Solo:
    """The ring of one rank (torch.distributed not initialized): nothing is ever exchanged."""

    rank, world_size = 0, 1

    def exchange(self, tensors):
        raise AssertionError("a ring of one rank exchanges nothing")


def _ring(group):
    if group is not None and hasattr(group, "exchange"):
        return group
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return _Solo()
    return TorchRing(group)


def _scale(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return float(softmax_scale)


def _check(q, k, v, cu_seqlens, causal) -> list[int]:
    """The ring's own checks (the kernel checks the rest); returns the local lengths (one host sync)."""
    where = "ring_flash_attn_varlen_func"
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"{where}: causal must be a bool, got {type(causal).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{where}: {name} must be 3-D (total, heads, headdim), got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{where}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"{where}: k and v must hold q's {q.shape[0]} rows (a ring shards self-attention), got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if v.shape[1] != k.shape[1] or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"{where}: k (total, nheads_k, headdim) must have q's headdim {q.shape[2]} and v's nheads_k, "
                         f"nheads_k dividing nheads {q.shape[1]}; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{where}: cu_seqlens must be torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{where}: cu_seqlens must be 1-D (batch + 1,), got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(n < 0 for n in lengths):
        raise ValueError(f"{where}: cu_seqlens must rise from 0 to total = {q.shape[0]} (the local rows), got "
                         f"{cu if len(cu) <= 8 else cu[:4] + ['...'] + cu[-2:]}")
    odd = [i for i, n in enumerate(lengths) if n % 2]
    if causal and odd:
        raise ValueError(f"{where}: with causal=True every local sequence holds two zigzag chunks (an even length); "
                         f"sequence {odd[0]} has length {lengths[odd[0]]} (global lengths must be multiples of "
                         f"2 * world_size: zigzag_shard)")
    return lengths
