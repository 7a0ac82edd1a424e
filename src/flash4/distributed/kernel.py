"""The attention the ring runs on each block, injectable: flash4's kernels (the default) or the
float reference (CPU tests).

A kernel has two methods over packed (varlen) blocks, flash4's layouts:

    forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        -> (out (total_q, H, Dv), lse (H, total_q) fp32, natural log; rows without keys 0 / -inf)
    backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, causal) -> (dq, dk, dv)

The backward gets out / lse of the WHOLE ring (the merged result), not the block's own: the
block's P = exp(scale * S - lse) is then its exact share of the full softmax and
D = rowsum(dout * out) - dlse the full row's, so the block's dq / dk / dv are exactly its terms of
the full gradient (ring-flash-attention's scheme; flash4.backward takes out, lse and dlse as given).
"""

from __future__ import annotations

import torch

from flash4 import backward, validate
from flash4 import headdim as hd
from flash4.api import flash_attn_varlen_func
from flash4.reference import attention_bwd_ref, attention_varlen_ref


class Flash4Kernel:
    """flash4's varlen forward (flash_attn_varlen_func with return_lse=True, no autograd) and its
    host backward (flash4.backward.run with the ring's out, lse and dlse). Inputs: bf16 / fp16 on
    an sm_90 GPU; head dims as flash_attn_varlen_func's (a head dim without a kernel is zero-padded
    to one, flash4.headdim, in the backward too). deterministic: flash4's deterministic backward."""

    def __init__(self, deterministic: bool = False):
        self.deterministic = bool(deterministic)

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        with torch.no_grad():
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale=softmax_scale, causal=causal, return_lse=True)

    def backward(self, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal):
        d, d_v = q.shape[-1], v.shape[-1]
        if not hd.is_native(d, d_v):  # as the forward door does: zero columns change no score (flash4.headdim)
            d_p, dv_p = hd.padded_headdims(d, d_v)
            q, k = hd.pad_last(q, d_p), hd.pad_last(k, d_p)
            v, out, dout = (hd.pad_last(t, dv_p) for t in (v, out, dout))
        request = validate.varlen_request(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale=softmax_scale, causal=causal,
                                          deterministic=self.deterministic)
        dq, dk, dv = backward.run(request, dout.contiguous(), out.contiguous(), lse, dlse=dlse)
        if dq.shape[-1] != d or dv.shape[-1] != d_v:
            dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d_v]
        return dq, dk, dv


class ReferenceKernel:
    """flash4.reference in `compute_dtype` (any device): attention_varlen_ref for the forward, the
    backward kernels' formula (attention_bwd_ref) per sequence for the backward. Outputs in
    compute_dtype (lse too)."""

    def __init__(self, compute_dtype: torch.dtype = torch.float32):
        self.compute_dtype = compute_dtype

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        return attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal,
                                    compute_dtype=self.compute_dtype)

    def backward(self, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal):
        grads = [torch.zeros(t.shape, dtype=self.compute_dtype, device=t.device) for t in (q, k, v)]
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            if cq[b + 1] == cq[b] or ck[b + 1] == ck[b]:
                continue
            dq, dk, dv = attention_bwd_ref(
                dout[rq][None], q[rq][None], k[rk][None], v[rk][None], out[rq][None], lse[:, rq][None],
                None if dlse is None else dlse[:, rq][None], softmax_scale, causal, self.compute_dtype)
            grads[0][rq], grads[1][rk], grads[2][rk] = dq[0], dk[0], dv[0]
        return tuple(grads)
