"""The ring's forward and backward passes on one rank, and the autograd Function over them.

Forward (rank r of W, flash4.distributed.schedule for the steps):

    out, lse = 0, -inf                                 fp32 accumulators, (rows, H, Dv) / (H, rows)
    for each step s:
        post: send my current K/V block to r + 1, receive the next from r - 1   (overlaps the kernel)
        block = kernel.forward(q part, K/V part, causal only at step 0)
        out, lse = merge((out, lse), block) on the step's query rows        (flash4.distributed.merge)
        wait: K/V <- the received block

Backward (the kernels' formula with the merged out / lse: flash4.distributed.kernel):

    dq = 0 (local, fp32)
    for each step s:
        post: K/V to r + 1 (as in the forward)
        dq_b, dk_b, dv_b = kernel.backward(dout, q, K/V parts, out, lse, dlse of the step's rows)
        dq += dq_b on the step's rows
        dK/dV accumulator of the block held: dk_b, dv_b (step 0), else the one received from r - 1
            plus dk_b, dv_b on the block's rows
        wait: K/V <- the received block
        post: the accumulator to r + 1 (it travels with its K/V block, one step behind)
    wait: the accumulator of my own K/V block, home after W sends

Communication per step: the K/V block (input dtype) forward and backward, the dK/dV accumulator
(fp32) backward. With W = 1 nothing is sent.
"""

from __future__ import annotations

import dataclasses

import torch

from flash4.distributed import schedule as zz
from flash4.distributed.merge import merge_rows


@dataclasses.dataclass(frozen=True)
class Plan:
    """The local layout of one call: every rank's packed rows have the same per-sequence lengths.
    cu_seqlens / max_seqlen: the local sequences; half_cu_seqlens / half_max_seqlen: their halves
    (one chunk each; causal only); first / second: int64 row indices of every sequence's first /
    second half (causal only, else None)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    half_cu_seqlens: torch.Tensor | None
    half_max_seqlen: int
    first: torch.Tensor | None
    second: torch.Tensor | None
    softmax_scale: float
    causal: bool

    @classmethod
    def create(cls, cu_seqlens: torch.Tensor, lengths: list[int], softmax_scale: float, causal: bool) -> "Plan":
        """lengths: the local sequence lengths (host ints, each even when causal)."""
        max_seqlen = max(lengths, default=0)
        if not causal:
            return cls(cu_seqlens, max_seqlen, None, 0, None, None, softmax_scale, causal)
        device = cu_seqlens.device
        starts = cu_seqlens[:-1].long()
        halves = torch.tensor(lengths, dtype=torch.long, device=device) // 2
        first = torch.repeat_interleave(starts, halves) + _ranks_within(halves)
        second = first + torch.repeat_interleave(halves, halves)
        half_cu = (cu_seqlens // 2).to(torch.int32)
        return cls(cu_seqlens, max_seqlen, half_cu, max_seqlen // 2, first, second, softmax_scale, causal)

    def q_rows(self, step: zz.Step):
        """(row index or None for all, cu_seqlens, max_seqlen) of the step's queries."""
        if step.q_part == zz.ALL:
            return None, self.cu_seqlens, self.max_seqlen
        return self.second, self.half_cu_seqlens, self.half_max_seqlen

    def k_rows(self, step: zz.Step):
        """(row index or None for all, cu_seqlens, max_seqlen) of the step's keys."""
        if step.k_part == zz.ALL:
            return None, self.cu_seqlens, self.max_seqlen
        return self.first, self.half_cu_seqlens, self.half_max_seqlen


def _ranks_within(counts: torch.Tensor) -> torch.Tensor:
    """0, 1, .., counts[0] - 1, 0, 1, .., counts[1] - 1, ... (int64)."""
    total = int(counts.sum())
    ends = torch.cumsum(counts, 0)
    return torch.arange(total, device=counts.device) - torch.repeat_interleave(ends - counts, counts)


def _rows(t, index, dim=0):
    return t if index is None else t.index_select(dim, index)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the inputs' dtype when wider (float64 in the reference tests)."""
    return torch.promote_types(dtype, torch.float32)


def ring_forward(q, k, v, plan: Plan, ring, kernel):
    """(out in q's dtype, lse (H, rows) in the accumulator dtype) of this rank's queries against
    every rank's keys (module docstring)."""
    world = ring.world_size
    acc = accumulator_dtype(q.dtype)
    out = lse = None
    for step in zz.schedule(ring.rank, world, plan.causal):
        pending = ring.exchange([k, v]) if step.step + 1 < world else None
        q_idx, cu_q, max_q = plan.q_rows(step)
        k_idx, cu_k, max_k = plan.k_rows(step)
        block_out, block_lse = kernel.forward(_rows(q, q_idx), _rows(k, k_idx), _rows(v, k_idx), cu_q, cu_k, max_q,
                                              max_k, plan.softmax_scale, step.causal)
        if world == 1:  # one block: the kernel's result as it is (no fp32 copy of out)
            return block_out.to(q.dtype), block_lse.to(acc)
        if out is None:  # step 0 covers every query row
            assert q_idx is None
            out, lse = block_out.to(acc), block_lse.to(acc)
        else:
            merge_rows(out, lse, q_idx, block_out, block_lse)
        if pending is not None:
            k, v = pending.wait()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, dlse, plan: Plan, ring, kernel):
    """(dq, dk, dv) of this rank's q, k, v (module docstring); out / lse: ring_forward's."""
    world = ring.world_size
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device) if world > 1 else None
    dkv = pending_dkv = None
    for step in zz.schedule(ring.rank, world, plan.causal):
        pending_kv = ring.exchange([k, v]) if step.step + 1 < world else None
        q_idx, cu_q, max_q = plan.q_rows(step)
        k_idx, cu_k, max_k = plan.k_rows(step)
        dq_b, dk_b, dv_b = kernel.backward(
            _rows(dout, q_idx), _rows(q, q_idx), _rows(k, k_idx), _rows(v, k_idx), _rows(out, q_idx),
            _rows(lse, q_idx, 1), None if dlse is None else _rows(dlse, q_idx, 1), cu_q, cu_k, max_q, max_k,
            plan.softmax_scale, step.causal)
        if world == 1:  # one block: the kernel's gradients as they are
            return dq_b.to(q.dtype), dk_b.to(k.dtype), dv_b.to(v.dtype)
        _add_rows(dq, q_idx, dq_b)
        if dkv is None:  # step 0: my own block, every key row
            assert k_idx is None
            dkv = [dk_b.to(acc), dv_b.to(acc)]
        else:
            dkv = pending_dkv.wait()
            _add_rows(dkv[0], k_idx, dk_b)
            _add_rows(dkv[1], k_idx, dv_b)
        if pending_kv is not None:
            k, v = pending_kv.wait()
        if world > 1:
            pending_dkv = ring.exchange(dkv)
    if world > 1:
        dkv = pending_dkv.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _add_rows(acc, index, block) -> None:
    if index is None:
        acc.add_(block.to(acc.dtype))
    else:
        acc.index_add_(0, index, block.to(acc.dtype))


class RingAttnFunction(torch.autograd.Function):
    """apply(q, k, v, plan, ring, kernel) -> (out, lse): ring_forward, with ring_backward as its
    backward (lse differentiable: its gradient enters as dlse)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, ring, kernel):
        out, lse = ring_forward(q, k, v, plan, ring, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.ring, ctx.kernel = plan, ring, kernel
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, dlse, ctx.plan, ctx.ring, ctx.kernel)
        return dq, dk, dv, None, None, None
