"""Tile-level numerics model of the sm100 (Blackwell) 1-CTA backward: what it computes, in torch on the CPU.

    dq, dk, dv = backward(q, k, v, out, dout, lse, softmax_scale, causal, window_size=None)  # flash_attn_func's layouts

It checks the *algorithm* of flash4.kernels.sm100.bwd (docs/design/sm100_backward.md) and its error
bands against flash4.reference, not the kernel: the compiled kernel is checked on the hardware by
flash4.selftest. The host part is flash4.backward's (shared with sm90):

 0. D = rowsum(dO * O) in fp32 (the preprocess); lse_log2 = fp32(LSE * log2 e) (+inf where LSE = -inf).
Per key block n of 128 keys, per query head of its KV head, per query block m of 128 (the CTA's order):
 1. S^T = K Q^T, dP^T = V dO^T in fp32 (UMMA k-steps of 16, each exact, added with one rounding).
 2. P^T = 2^fma(S^T, c, -lse_log2) (c = fp32(scale * log2 e); one FMA rounding; MUFU.EX2 modelled as
    2^x correctly rounded to fp32, 0 below 2^-126), 0 where the query does not see the key (causal, a
    window's sides, keys past seqlen_k: flash4.geometry.first_query / query_end). P^T is kept in fp32 for dS and rounded to the input dtype for dV.
 3. dV += P16^T dO (fp32 TMEM accumulator over the whole group of query heads and all m).
 4. dS^T = fp32(fp32(fp32(dP^T - D) * P^T) * scale) (sub, mul, mul: FADD2 / FMUL2), rounded to the
    input dtype: dK += dS16^T Q (fp32 accumulator); dQ_m = dS16 K in fp32 (UMMA k-steps), reduce-added
    into the fp32 dQ accumulator (one fp32 add per element per key block, in key-block order here; on
    the GPU the CTAs' order varies: non-deterministic in the last bits).
 5. dq = dq_accum, dk, dv rounded to the input dtype.
Not modelled: the MMA's rounding inside one k-step, MUFU's last ulps, anything about timing.
"""

from __future__ import annotations

import math

import torch

from flash4.constants import LOG2E
from flash4.geometry import first_query, query_end, window_sides
from flash4.models.sm100_fwd import UMMA_K, exp2_hw, fma_f32, mma_f32

TILE = 128  # tile_m = tile_n of the 1-CTA backward


def _mm(acc, a, b):
    """acc + a @ b as the kernel's UMMA chain (fp32 accumulate, exact k-steps of 16)."""
    return mma_f32(acc, a.double(), b.double(), UMMA_K)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
             lse: torch.Tensor, softmax_scale: float | None = None, causal: bool = False, window_size=None):
    """(dq, dk, dv) like q, k, v in their dtype. q, out, dout: (B, Sq, H, D); k, v: (B, Sk, Hk, D);
    lse: fp32 (B, H, Sq) natural log (the forward's); window_size: None or flash-attn's (left, right)."""
    window = window_sides(window_size, causal)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dtype = q.dtype
    group = h // hk
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    c = float(torch.tensor(scale * LOG2E, dtype=torch.float32))
    d_rows = (dout.double() * out.double()).sum(-1).float().transpose(1, 2)  # (B, H, Sq)
    lse_log2 = torch.where(lse == -math.inf, math.inf, (lse.double() * LOG2E)).float()
    dq_acc = torch.zeros(b, h, sq, d, dtype=torch.float32)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    queries = torch.arange(sq)
    for bi in range(b):
        for n0 in range(0, sk, TILE):
            keys = torch.arange(n0, min(n0 + TILE, sk))
            first = torch.tensor([first_query(int(j), sq, sk, causal, window=window) for j in keys])  # (keys,)
            end = torch.tensor([query_end(int(j), sq, sk, window=window) for j in keys])
            for hki in range(hk):
                kt, vt = k[bi, keys, hki].float(), v[bi, keys, hki].float()  # (n, d)
                dk_acc = dv_acc = None
                for hi in range(hki * group, (hki + 1) * group):
                    for m0 in range(0, sq, TILE):
                        rows = queries[m0:m0 + TILE]
                        qt, dot = q[bi, rows, hi].float(), dout[bi, rows, hi].float()  # (m, d)
                        s_t = _mm(None, kt, qt.T)  # (n, m)
                        dp_t = _mm(None, vt, dot.T)
                        x = fma_f32(s_t, c, -lse_log2[bi, hi, rows].expand_as(s_t).contiguous())
                        p_t = exp2_hw(x)
                        hidden = (rows[None, :] < first[:, None]) | (rows[None, :] >= end[:, None])
                        p_t = torch.where(hidden, torch.zeros_like(p_t), p_t)
                        dv_acc = _mm(dv_acc, p_t.to(dtype).float(), dot)
                        ds_t = ((dp_t - d_rows[bi, hi, rows][None, :]) * p_t) * torch.tensor(scale, dtype=torch.float32)
                        ds16 = ds_t.to(dtype).float()
                        dk_acc = _mm(dk_acc, ds16, qt)
                        dq_acc[bi, hi, rows] += _mm(None, ds16.T.contiguous(), kt)
                dk[bi, keys, hki] = dk_acc.to(dtype)
                dv[bi, keys, hki] = dv_acc.to(dtype)
    return dq_acc.transpose(1, 2).to(dtype), dk, dv
