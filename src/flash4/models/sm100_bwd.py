"""Tile-level numerics model of the sm100 (Blackwell) backward: what it computes, in torch on the CPU.

    dq, dk, dv = backward(dout, q, k, v, out, lse, softmax_scale, causal)   # flash_attn_func's layouts
    dq, dk, dv, stats = backward(..., return_stats=True)                    # + what the dataflow did

It checks the *algorithm* of /work/shared/design/BLACKWELL.md section 1 (FA4's
FlashAttentionBackwardSm100, the five UMMAs with TMEM accumulators) on flash4's shared preprocess /
postprocess, and its error bands against flash4.reference; not a kernel: the compiled kernel is
checked on the hardware by flash4.selftest. A CTA owns one KV tile of `tile_n` keys (one query head
of it: GQA heads are separate CTAs); it visits the query tiles of `tile_m` rows that see any of its
keys, first to last, and per (query tile m, KV tile n), in this order:

 0. Preprocess (flash4.kernels.common.bwd_preprocess, once per query row): D = rowsum(dO * O) in
    fp32, its order: lane l of 8 sums the 4-element chunks l, l + 8, ... (each product exact in
    fp32, one rounding per add), then a butterfly over the 8 lanes (xor 4, 2, 1); D -= dLSE when
    the LSE has a gradient. L = fp32(L_hi + L_lo) (the forward's log2-domain LSE split; without
    one L_hi = fp32(lse * log2 e), L_lo = 0; +inf for a row that saw no key, and for the padding
    rows of the last query tile, so their P is 0). A query tile with some |L| >= BWD_EXACT_LSE_LOG2
    takes the exact path (step 2).
 1. S^T = K Q^T (UMMA, fp32 TMEM accumulator; bf16/fp16 operands): each k-step of `mma_k` = 16
    elements summed exactly, added to the accumulator with one rounding (as the forward model).
    Keys past seqlen_k and (causal, bottom-right) keys right of a row's diagonal are -inf.
 2. x = fma(S, c, -L) (fma_packed_f32x2, one rounding; c = fp32(softmax_scale * log2 e)); on an
    exact tile x = fma(S, c, -L_hi) - L_lo.
 3. P = 2^x on MUFU.EX2 only (FA4's backward emulates no exp2): 2^x rounded to fp32, 0 below 2^-126.
 4. The TMEM P (the dV UMMA's A operand, written over S's columns) is P rounded to the input dtype.
 5. dP^T = V dO^T (UMMA, fp32), k-steps as in 1.
 6. dS = P * (dP - D) from the fp32 P (not the rounded one), per element fp32:
    ds_scale "ds" (flash4's: the softmax scale folded in here, so dK and dQ need none):
      dS = fp32(fp32(P * scale) * fp32(dP - D));
    ds_scale "epilogue" (FA4's sub_packed / mul_packed, scale applied to dK at its epilogue and to
    dQ in the postprocess): dS = fp32(P * fp32(dP - D)).
    dS is rounded to the input dtype (TMEM for the dK UMMA over dP's columns, smem for dQ).
 7. dV += P^T dO and dK += dS^T Q (UMMA, the KV tile's fp32 TMEM accumulators, chained over the
    query tiles, k-steps of mma_k rows).
 8. dQ_part = dS K (UMMA into fp32 TMEM, k-steps of mma_k keys), moved by the dQ reduce warps
    TMEM -> smem -> cp.reduce.async.bulk.add.f32 into the zeroed fp32 dq_accum: each KV tile's
    part is one fp32 add per element; the parts of query tile m land in `dq_order` (the KV tiles'
    order: "forward" = the deterministic mode's semaphore chain, n = 0, 1, ...; "reverse"; or an
    int seed: a random order, as atomics from concurrent CTAs may land).
 9. Epilogue: dV and dK of the KV tile (dK * scale in fp32 first with ds_scale "epilogue") rounded
    to the input dtype; with GQA (H > Hk) each query head's fp32 dK / dV tile is added into an fp32
    accumulator (in head order), scaled (dK, "epilogue") and rounded at the end (FA4's dKV
    postprocess). Postprocess: dq = dq_accum (* scale in fp32 with "epilogue") rounded to the input
    dtype.

Not modelled: the MMA's accumulation rounding inside one k-step (modelled exact), MUFU's last ulps
(modelled correctly rounded), the 2-CTA split (it moves operands between the pair, not values:
each dQ half and the exchanged dS half are the same numbers), and anything about timing (barriers,
pipelines): a race or a wrong TMEM address has no analogue here.
"""

from __future__ import annotations

import math

import torch

from flash4.constants import BWD_EXACT_LSE_LOG2, LOG2E
from flash4.models.sm100_fwd import UMMA_K, exp2_hw, fma_f32, mma_f32

DS_SCALES = ("ds", "epilogue")
# Preprocess dot product: lanes per row and elements per lane access (kernels/common/bwd_preprocess.py).
PRE_LANES = 8
PRE_CHUNK = 4


def preprocess_dpsum(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dout * out) in fp32 in the preprocess's order (step 0): out, dout (B, S, H, Dv),
    Dv a multiple of 32. Returns (B, H, S) float32."""
    b, s, h, dv = out.shape
    if dv % (PRE_LANES * PRE_CHUNK):
        raise ValueError(f"the preprocess needs a head dim that is a multiple of {PRE_LANES * PRE_CHUNK}; got {dv}")
    prod = (out.float() * dout.float()).permute(0, 2, 1, 3)  # exact: 16-bit x 16-bit fits fp32
    # (B, H, S, pass j, lane l, e): element (j * 8 + l) * 4 + e
    prod = prod.reshape(b, h, s, dv // (PRE_LANES * PRE_CHUNK), PRE_LANES, PRE_CHUNK)
    lanes = torch.zeros(b, h, s, PRE_LANES)
    for j in range(prod.shape[3]):
        for e in range(PRE_CHUNK):
            lanes = lanes + prod[:, :, :, j, :, e]
    for offset in (4, 2, 1):  # butterfly: lane l adds lane l ^ offset
        lanes = lanes + lanes[..., torch.arange(PRE_LANES) ^ offset]
    return lanes[..., 0].contiguous()


def lse_log2_parts(lse: torch.Tensor, lse_split: torch.Tensor | None = None):
    """(L, L_hi, L_lo), each (B, H, S) float32, as the preprocess and the exact path read them:
    L_hi + L_lo = lse * log2 e (lse_split's two halves, or fp32(lse * log2 e) and 0); rows with
    lse = -inf (no key) get L = L_hi = +inf, L_lo = 0."""
    if lse_split is None:
        hi = (lse.double() * LOG2E).float()
        lo = torch.zeros_like(hi)
    else:
        hi, lo = lse_split[0].float(), lse_split[1].float()
    empty = torch.isneginf(lse) | torch.isposinf(hi)
    hi = torch.where(empty, math.inf, hi)
    lo = torch.where(empty, 0.0, lo)
    return hi + lo, hi, lo


def _check_args(dout, q, k, v, out, lse, tile_m, tile_n, ds_scale, dq_order):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, seqlen, nheads, headdim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in (k, v, out, dout)):
        raise ValueError(f"q, k, v, out, dout must all be bfloat16 or all float16; got "
                         f"{[str(t.dtype) for t in (q, k, v, out, dout)]}")
    if q.shape[2] % k.shape[2] or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(batch, seqlen_k and nheads_k shared by k and v; nheads a multiple of nheads_k)")
    want = q.shape[:3] + (v.shape[3],)
    if out.shape != want or dout.shape != want or lse.shape != (q.shape[0], q.shape[2], q.shape[1]):
        raise ValueError(f"out, dout must be {tuple(want)} and lse {(q.shape[0], q.shape[2], q.shape[1])}; got "
                         f"{tuple(out.shape)}, {tuple(dout.shape)}, {tuple(lse.shape)}")
    for name, t in (("tile_m", tile_m), ("tile_n", tile_n)):
        if t < 16 or t % 16:
            raise ValueError(f"{name} must be a positive multiple of 16 (a UMMA k-step); got {t}")
    if ds_scale not in DS_SCALES:
        raise ValueError(f"ds_scale must be one of {DS_SCALES}; got {ds_scale!r}")
    if not (dq_order in ("forward", "reverse") or isinstance(dq_order, int)):
        raise ValueError(f"dq_order must be 'forward', 'reverse' or an int seed; got {dq_order!r}")


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(B, H, S, X) float64 zero-padded to S = rows (TMA reads zeros past the end)."""
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[2]))


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, softmax_scale: float | None = None, causal: bool = False, *,
             lse_split: torch.Tensor | None = None, dlse: torch.Tensor | None = None, tile_m: int = 128,
             tile_n: int = 128, mma_k: int | None = UMMA_K, ds_scale: str = "ds", exact_lse: bool = True,
             dq_order: str | int = "forward", return_stats: bool = False):
    """(dq, dk, dv) as the sm100 backward computes them (module docstring, steps 0-9).

    dout, out: (B, Sq, H, Dv); q: (B, Sq, H, D); k: (B, Sk, Hk, D); v: (B, Sk, Hk, Dv); all
      bfloat16 or all float16 (CPU); Hk divides H. lse: float32 (B, H, Sq), the forward's natural-log
      LSE (-inf for rows that saw no key). Causal is bottom-right aligned. softmax_scale: None = 1/sqrt(D).
    lse_split: None or float32 (2, B, H, Sq), the forward's unrounded log2-domain LSE (flash4.forward).
    dlse: None or (B, H, Sq), the LSE's gradient (D -= dlse).
    tile_m / tile_n: query rows / keys per tile (multiples of 16). mma_k: UMMA k-step (None: one
      rounding per tile product). ds_scale: "ds" or "epilogue" (step 6). exact_lse: take the exact
      path on tiles with |L| >= BWD_EXACT_LSE_LOG2 (False: never). dq_order: step 8.
    Returns dq, dk, dv in the input dtype (shaped like q, k, v) and, with return_stats, a dict:
      kv_tiles, tile_pairs (the (m, n) pairs computed), skipped_pairs (causal pairs without a
      visible key, never visited), exact_tiles ((query tile, head) pairs on the exact path), p_max
      (largest fp32 P: <= 1 up to the forward's error), ds_absmax, dq_adds (fp32 adds into dq_accum).
    """
    _check_args(dout, q, k, v, out, lse, tile_m, tile_n, ds_scale, dq_order)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    dtype = q.dtype
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    c = float(torch.tensor(scale * LOG2E, dtype=torch.float32))  # the kernel's Float32 scale_log2
    scale_f32 = float(torch.tensor(scale, dtype=torch.float32))
    group = nheads // nheads_k
    m_tiles, n_tiles = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    rows_q, rows_k = m_tiles * tile_m, n_tiles * tile_n

    # 0. preprocess: D, L (padding rows: D 0, L +inf)
    d_sum = preprocess_dpsum(out, dout)
    if dlse is not None:
        d_sum = d_sum - dlse.float()
    big_l, hi, lo = lse_log2_parts(lse, lse_split)
    pad = (0, rows_q - seqlen_q)
    d_sum = torch.nn.functional.pad(d_sum, pad)
    big_l, hi = (torch.nn.functional.pad(t, pad, value=math.inf) for t in (big_l, hi))
    lo = torch.nn.functional.pad(lo, pad)
    finite_l = torch.where(torch.isfinite(big_l), big_l.abs(), 0.0)
    exact = finite_l.reshape(batch, nheads, m_tiles, tile_m).amax(-1) >= BWD_EXACT_LSE_LOG2  # (B, H, m_tiles)
    if not exact_lse:
        exact = torch.zeros_like(exact)

    # operands as (B, H, rows, X) float64 (exact 16-bit values); K, V per query head
    q64 = _pad_rows(q.permute(0, 2, 1, 3).double(), rows_q)
    do64 = _pad_rows(dout.permute(0, 2, 1, 3).double(), rows_q)
    k64 = _pad_rows(k.repeat_interleave(group, dim=2).permute(0, 2, 1, 3).double(), rows_k)
    v64 = _pad_rows(v.repeat_interleave(group, dim=2).permute(0, 2, 1, 3).double(), rows_k)

    stats = {"kv_tiles": n_tiles, "tile_pairs": 0, "skipped_pairs": 0, "exact_tiles": int(exact.sum()),
             "p_max": 0.0, "ds_absmax": 0.0, "dq_adds": 0}
    dk_acc = torch.zeros(batch, nheads, rows_k, headdim)  # fp32 per query head
    dv_acc = torch.zeros(batch, nheads, rows_k, headdim_v)
    dq_parts = [[None] * n_tiles for _ in range(m_tiles)]  # fp32 (B, H, tile_m, D) per (m, n)
    qi = torch.arange(tile_m)
    kj = torch.arange(tile_n).unsqueeze(1)  # S^T: rows are keys, columns queries
    for n in range(n_tiles):
        ksl = slice(n * tile_n, (n + 1) * tile_n)
        k_t, v_t = k64[:, :, ksl], v64[:, :, ksl]
        dk_t = dv_t = None  # the TMEM accumulators
        for m in range(m_tiles):
            row, col = m * tile_m + qi, n * tile_n + kj
            visible = (col < seqlen_k) & (row < seqlen_q)  # (tile_n, tile_m)
            if causal:
                visible = visible & (col <= row + seqlen_k - seqlen_q)
            if not bool(visible.any()):
                stats["skipped_pairs"] += 1
                continue
            stats["tile_pairs"] += 1
            qsl = slice(m * tile_m, (m + 1) * tile_m)
            q_t, do_t = q64[:, :, qsl], do64[:, :, qsl]
            # 1. S^T in fp32, masked -inf
            s_t = mma_f32(None, k_t, q_t.transpose(-1, -2), mma_k).masked_fill(~visible, -math.inf)
            # 2.-3. P^T = 2^(S^T c - L[query]) on MUFU
            ex = exact[:, :, m].view(batch, nheads, 1, 1)
            x = fma_f32(s_t, c, -torch.where(ex, hi[:, :, qsl].unsqueeze(2), big_l[:, :, qsl].unsqueeze(2)))
            x = torch.where(ex, x - lo[:, :, qsl].unsqueeze(2), x)
            p = exp2_hw(x)
            p16 = p.to(dtype)  # 4. the TMEM P
            # 5.-6. dP^T, dS^T
            dp = mma_f32(None, v_t, do_t.transpose(-1, -2), mma_k)
            diff = dp - d_sum[:, :, qsl].unsqueeze(2)
            ds = (p * scale_f32) * diff if ds_scale == "ds" else p * diff
            ds16 = ds.to(dtype)
            # 7. dV += P^T dO, dK += dS^T Q (k-steps over the tile's query rows)
            dv_t = mma_f32(dv_t, p16.double(), do_t, mma_k)
            dk_t = mma_f32(dk_t, ds16.double(), q_t, mma_k)
            # 8. this KV tile's dQ part (k-steps over its keys)
            dq_parts[m][n] = mma_f32(None, ds16.double().transpose(-1, -2), k_t, mma_k)
            stats["p_max"] = max(stats["p_max"], float(p.max()))
            stats["ds_absmax"] = max(stats["ds_absmax"], float(ds.abs().max()))
        if dk_t is not None:
            dk_acc[:, :, ksl], dv_acc[:, :, ksl] = dk_t, dv_t

    # 8. dq_accum: per query tile, the KV tiles' parts in dq_order, one fp32 add each
    if dq_order == "forward":
        order = list(range(n_tiles))
    elif dq_order == "reverse":
        order = list(range(n_tiles - 1, -1, -1))
    else:
        order = torch.randperm(n_tiles, generator=torch.Generator().manual_seed(dq_order)).tolist()
    dq_accum = torch.zeros(batch, nheads, rows_q, headdim)
    for m in range(m_tiles):
        qsl = slice(m * tile_m, (m + 1) * tile_m)
        for n in order:
            if dq_parts[m][n] is not None:
                dq_accum[:, :, qsl] = dq_accum[:, :, qsl] + dq_parts[m][n]
                stats["dq_adds"] += 1

    # 9. epilogue / postprocess (GQA: the group's heads added in fp32, head order, then scaled)
    if group > 1:
        dk_sum = torch.zeros(batch, nheads_k, rows_k, headdim)
        dv_sum = torch.zeros(batch, nheads_k, rows_k, headdim_v)
        for g in range(group):
            dk_sum = dk_sum + dk_acc[:, g::group]
            dv_sum = dv_sum + dv_acc[:, g::group]
        dk_acc, dv_acc = dk_sum, dv_sum
    if ds_scale == "epilogue":
        dk_acc = dk_acc * scale_f32
        dq_accum = dq_accum * scale_f32
    dq = dq_accum[:, :, :seqlen_q].to(dtype).permute(0, 2, 1, 3).contiguous()
    dk = dk_acc[:, :, :seqlen_k].to(dtype).permute(0, 2, 1, 3).contiguous()
    dv = dv_acc[:, :, :seqlen_k].to(dtype).permute(0, 2, 1, 3).contiguous()
    return (dq, dk, dv, stats) if return_stats else (dq, dk, dv)
