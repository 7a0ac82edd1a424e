"""Tile-level numerics model of the sm100 (Blackwell) 1-CTA backward as built: what it computes, in torch on the CPU.

    dq, dk, dv = backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size=None, softcap=0.0)
    dq, dk, dv, stats = backward(..., return_stats=True)                                      # + what the dataflow did

It models flash4.kernels.sm100.bwd (docs/design/sm100_backward.md) on flash4.backward's host pipeline
(the preprocess and dQ postprocess sm90 shares) rounding step by rounding step, and checks its error
bands against flash4.reference. It checks the algorithm, not the kernel: the kernel is
compile-verified, not run on hardware; on a Blackwell GPU the first-use self-test (flash4.selftest)
checks it. A CTA owns one key block n of `tile_n` keys of one KV head; it walks, head after head of
the KV head's group of query heads (GQA / MQA), the query blocks m of `tile_m` rows that see any of
its keys (flash4.geometry.m_block_range), first to last. In this order:

 0. Host (flash4.backward.launch) and preprocess (flash4.kernels.common.bwd_preprocess, once per
    query row):
    D = rowsum(dO * O) in fp32, its order: lane l of 8 sums the 4-element chunks l, l + 8, ...
      (each product exact in fp32, one rounding per add), then a butterfly over the 8 lanes (xor
      4, 2, 1); then D = fp32(D - dLSE) on the host when the LSE has a gradient.
    lse_log2 = fp32(hi + lo), from the forward's log2-domain split (hi, lo) when given, else
      hi = where(LSE = -inf, +inf, fp32(LSE * fp32(log2 e))) (torch on the host), lo = 0; +inf for
      the padding rows of the last query block. exact[m] = 1 for query blocks m with a row whose
      lse_log2 is finite and |lse_log2| >= BWD_EXACT_LSE_LOG2 (2^10: past it half an fp32 ulp of
      lse_log2 moves P by more than 2^-14 relative): those blocks take the exact-LSE path (step 2).
 1. S^T = K Q^T and dP^T = V dO^T (UMMA, fp32 TMEM accumulators; 16-bit operands): each k-step of
    `mma_k` = 16 elements summed exactly, added to the accumulator with one rounding (as the
    forward model).
 2. x = fma(S^T, c, -lse_log2) (fma_packed_f32x2, one rounding), c = fp32(fp32(softmax_scale) *
    fp32(log2 e)) (the kernel's Float32 product).
    Exact-LSE path (issue 8; query blocks with exact[m], exact_lse=True as built): then x = fp32(x - r)
      with r = hi + lo - lse_log2 exactly (TwoSum in fp32: b = L - hi, a = L - b, r = (hi - a) +
      (lo - b); 0 where lse_log2 = +inf), so P is exact at the row max at any finite magnitude (the
      kernel's exact_residual; sm90 computes fp32(fma(S, c, -hi) - lo), the same up to where the
      small remainder is rounded).
    Softcap (flash4.kernels.common.score: scales, apply): first S^T -> t = tanh(fp32(S^T * a)) on
    MUFU.TANH (tanh.approx.f32; modelled as tanh rounded to fp32, times (1 + tanh_rel_err)), with
    a = fp32(fp32(softmax_scale) / fp32(softcap)) (div.rn); then x = fma(t, c, -lse_log2) with
    c = fp32(fp32(softcap) * fp32(log2 e)). Before the mask (masked scores get P = 0 either way).
 3. P^T = 2^x on MUFU.EX2 only (modelled as 2^x correctly rounded to fp32, 0 below 2^-126), then
    0 where the query does not see the key (a select, not a -inf score: the query is before
    geometry.first_query(key) (causal, a window's right side, keys past seqlen_k) or, with a
    window, at or past geometry.query_end(key)). Padding rows: lse_log2 = +inf, so P = 0.
 4. P^T rounded to the input dtype (the TMEM P^T, the dV UMMA's A operand); the fp32 P^T is kept
    in registers for dS.
 5. dS^T = fp32(fp32(fp32(dP^T - D) * P^T) * fp32(softmax_scale)) from the fp32 P (sub, mul, mul:
    sub_packed / mul_packed / mul_packed), rounded to the input dtype (TMEM for the dK UMMA, smem
    for the dQ UMMA). The softmax scale is in dS, so dK and dQ need no rescale (flash4's convention).
    Softcap: before the rounding, dS^T = fp32(dS^T * f) (mul_packed), f = score.grad_factor: t
    recovered from P and the query's lse_log2, t = fp32(fp32(log2 P + lse_log2) * r) with log2 on
    MUFU.LG2 (lg2.approx.ftz; modelled correctly rounded, P is never subnormal after EX2's flush)
    and r = fp32(1 / c) (rcp.rn), f = fma(-t, t, 1) (ptxas contracts 1 - t * t into one FFMA), and
    f = 0 where P = 0.
 6. dV += P16^T dO and dK += dS16^T Q (UMMA, k-steps of mma_k query rows) into the key block's fp32
    TMEM accumulators, ONE chain per (key block, KV head) over all its steps: the group's query
    heads in order, each over its query blocks m (GQA / MQA accumulate in TMEM, no fp32 sum of
    per-head tiles: the head split (dkv_accum) is not built for sm100).
 7. dQ_part = dS16 K (UMMA into fp32 TMEM, k-steps of mma_k keys), moved by the dQ reduce warps
    TMEM -> smem -> cp.reduce.async.bulk .add.f32 into the zeroed fp32 dq_accum: one fp32 add per
    element per key block. The parts of query block m land in `dq_order`: "forward" (n = 0, 1, ...:
    the deterministic configs' semaphore chain, from the band's first key block with a window),
    "reverse", or an int seed (a random order: the non-deterministic configs' CTAs land in any
    order).
 8. Epilogue: dK, dV of the key block rounded to the input dtype (zeros for a key block that no
    query sees); postprocess: dq = dq_accum rounded to the input dtype.

hd256 runs as two passes (backward_two_pass; bwd_pass): "dv" does steps 1-4 and dV's half of 6;
"dkdq" recomputes S^T and P^T (the same operands and k-steps: bitwise the same P, softcap's tanh
included), accumulates dP^T over BWD_VDO_COLS-column chunks of V and dO (one chain in the same
k-step order as one MMA: bitwise the same dP^T), and does 5, dK's half of 6, 7 and 8.

Not modelled: the MMA's accumulation rounding inside one k-step (modelled exact), MUFU's last ulps
(modelled correctly rounded), anything about timing (barriers, pipelines, TMEM aliasing): a race, a
hang or a wrong TMEM address has no analogue here. Packed batches: backward_packed (per sequence,
either layout and either pass). Not built in the kernel, so not here: the GQA head split; 2-CTA is
not modelled apart: its arithmetic is the 1-CTA steps', with the exact-LSE path where
flash4.kernels.sm100.bwd_plan.bwd_exact_lse(cfg) holds (hd128 bf16 full, bf16 / fp16 causal; (192, 128)
full, causal and bf16 softcap causal: exact_lse=True) and without it in the other 2-CTA configs (hd128
fp16 full, hd128 softcap, (192, 128) bf16 softcap full: exact_lse=False; they spilled with the branch).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flash4 import geometry
from flash4.constants import BWD_EXACT_LSE_LOG2, LOG2E
from flash4.kernels.common.exp2_poly import _fma_f32
from flash4.kernels.sm100.bwd_plan import BWD_PASSES, BWD_VDO_COLS
from flash4.models.sm100_fwd import UMMA_K, exp2_hw, fma_f32, mma_f32

# The 1-CTA backward's blocks (flash4.config.sm100.Sm100BwdConfig: tile_m = tile_n = 128).
TILE = 128
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


def lse_log2(lse: torch.Tensor, lse_split: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's lse_log2, (B, H, S) float32 (step 0): fp32(hi + lo) with (hi, lo) = lse_split's
    halves, or, without a split, flash4.backward's hi = where(lse = -inf, +inf, lse * log2 e)
    (torch fp32) and lo = 0. A row that saw no key gets +inf (its P is 0)."""
    if lse_split is None:
        return torch.where(lse == -math.inf, math.inf, lse.float() * LOG2E)  # + lo = 0: unchanged
    return lse_split[0].float() + lse_split[1].float()


def lse_split_halves(lse: torch.Tensor, lse_split: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo), float32 (B, H, S): the forward's split, or flash4.backward's stand-in without one
    (hi = where(lse = -inf, +inf, fp32(lse * log2 e)), lo = 0)."""
    if lse_split is None:
        return torch.where(lse == -math.inf, math.inf, lse.float() * LOG2E), torch.zeros_like(lse, dtype=torch.float32)
    return lse_split[0].float(), lse_split[1].float()


def exact_residual(hi: torch.Tensor, lo: torch.Tensor, big_l: torch.Tensor) -> torch.Tensor:
    """r = hi + lo - big_l exactly, big_l = fp32(hi + lo) (TwoSum in fp32 rounding, the kernel's
    exact_residual); 0 where big_l is +inf (padding rows, rows that saw no key)."""
    with np.errstate(invalid="ignore"):
        b_virtual = big_l - hi
        a_virtual = big_l - b_virtual
        r = (hi - a_virtual) + (lo - b_virtual)
    return torch.where(big_l < math.inf, r, torch.zeros_like(r))


def exact_tiles(big_l: torch.Tensor, tile_m: int) -> torch.Tensor:
    """The preprocess's per-query-block flags, bool (..., rows // tile_m) from the padded lse_log2
    (..., rows): some row finite with |lse_log2| >= BWD_EXACT_LSE_LOG2."""
    big = (big_l.abs() >= BWD_EXACT_LSE_LOG2) & torch.isfinite(big_l)
    return big.reshape(*big.shape[:-1], -1, tile_m).any(-1)


def tanh_hw(x: torch.Tensor, rel_err: float = 0.0) -> torch.Tensor:
    """MUFU.TANH model (tanh.approx.f32) of fp32 x: tanh rounded to fp32, times (1 + rel_err) when
    rel_err is given (a systematic error within the measured bound: the H200's tanh.approx.f32 is
    within 1.0e-5 relative of float64 tanh over [-20, 20], docs/perf/README.md; Blackwell's MUFU
    assumed alike), clamped to [-1, 1]."""
    t = torch.tanh(x.double())
    if rel_err:
        t = (t * (1.0 + rel_err)).clamp(-1.0, 1.0)
    return t.float()


def softcap_scales(softmax_scale: float, softcap: float) -> tuple[float, float, float]:
    """(c, a, r) as the kernel's score.device_scales computes them on Float32 values: c =
    fp32(softcap * log2 e) (the exp2's scale), a = fp32(softmax_scale / softcap) (tanh's input
    scale), r = fp32(1 / c)."""
    cap, scale = np.float32(softcap), np.float32(softmax_scale)
    c = cap * np.float32(LOG2E)
    return float(c), float(scale / cap), float(np.float32(1.0) / c)


def grad_factor(p: torch.Tensor, lse_l2: torch.Tensor, r: float) -> torch.Tensor:
    """score.grad_factor on fp32 p with the query's lse_log2 (broadcast): fma(-t, t, 1) with t =
    fp32(fp32(log2 p + lse_log2) * r), 0 where p = 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        t = (torch.log2(p.double()).float() + lse_l2) * r
        f = torch.from_numpy(np.ascontiguousarray(_fma_f32(-t.numpy(), t.numpy(), np.float32(1.0))))
    return torch.where(p == 0, torch.zeros_like(f), f)


def _check_args(dout, q, k, v, out, lse, tile_m, tile_n, dq_order):
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
    if not (dq_order in ("forward", "reverse") or isinstance(dq_order, int)):
        raise ValueError(f"dq_order must be 'forward', 'reverse' or an int seed; got {dq_order!r}")


def _heads_rows(t: torch.Tensor, group: int, rows: int) -> torch.Tensor:
    """(B, S, H, X) -> float64 (B, H // group, group, rows, X), rows zero-padded (TMA reads zeros)."""
    b, s, h, x = t.shape
    t = torch.nn.functional.pad(t.permute(0, 2, 1, 3).double(), (0, 0, 0, rows - s))
    return t.reshape(b, h // group, group, rows, x)


def _dq_add_order(dq_order, n_tiles: int) -> list[int]:
    if dq_order == "forward":
        return list(range(n_tiles))
    if dq_order == "reverse":
        return list(range(n_tiles - 1, -1, -1))
    return torch.randperm(n_tiles, generator=torch.Generator().manual_seed(dq_order)).tolist()


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, softmax_scale: float | None = None, causal: bool = False, window_size=None,
             softcap: float = 0.0, *, tanh_rel_err: float = 0.0, lse_split: torch.Tensor | None = None,
             dlse: torch.Tensor | None = None, tile_m: int = TILE, tile_n: int = TILE, mma_k: int | None = UMMA_K,
             dq_order: str | int = "forward", exact_lse: bool = True, return_stats: bool = False,
             bwd_pass: str = "both"):
    """(dq, dk, dv) as the sm100 backward computes them (module docstring, steps 0-8).

    dout, out: (B, Sq, H, Dv); q: (B, Sq, H, D); k: (B, Sk, Hk, D); v: (B, Sk, Hk, Dv); all
      bfloat16 or all float16 (CPU); Hk divides H. lse: float32 (B, H, Sq), the forward's natural-log
      LSE (-inf for rows that saw no key). Causal is bottom-right aligned. softmax_scale: None = 1/sqrt(D).
    window_size: None or flash-attn's (left, right) (-1 = unbounded; causal sets right = 0).
    softcap: > 0: scores softcap * tanh(scale * S / softcap) (steps 2 and 5); tanh_rel_err: tanh_hw's.
    lse_split: None or float32 (2, B, H, Sq), the forward's log2-domain LSE split (step 0).
    exact_lse: the exact-LSE path of flagged query blocks (step 2; the kernel as built); False models
      a kernel without it (P from the rounded lse_log2 everywhere).
    dlse: None or (B, H, Sq), the LSE's gradient (D -= dlse).
    tile_m / tile_n: query rows / keys per block (the kernel's 128; multiples of 16). mma_k: UMMA
      k-step (None: one rounding per tile product). dq_order: step 7.
    bwd_pass: "both" (one kernel), or one pass of the two-pass backward (hd256; backward_two_pass):
      "dv" (steps 1-4 for S^T / P^T, 6 for dV only; dq, dk returned as zeros) or "dkdq" (S^T and P^T
      recomputed, dP^T accumulated over BWD_VDO_COLS-column chunks of V and dO, steps 5-8 for dK and
      dQ; dv returned as zeros).
    Returns dq, dk, dv in the input dtype (shaped like q, k, v) and, with return_stats, a dict:
      kv_tiles, tile_pairs ((m, n) pairs a CTA visits, per KV head and batch: m_block_range),
      skipped_pairs (the others), steps (CTA steps summed over the key blocks of one (batch, KV head):
      group x visited query blocks), p_max (largest fp32 P: <= 1 up to the forward's error),
      ds_absmax, dq_adds (fp32 adds into dq_accum per query head and batch), exact_blocks (flagged
      query blocks over batch and heads).
    """
    _check_args(dout, q, k, v, out, lse, tile_m, tile_n, dq_order)
    if bwd_pass not in BWD_PASSES:
        raise ValueError(f"bwd_pass={bwd_pass!r}; allowed: {BWD_PASSES}")
    with_dv, with_dkdq = bwd_pass != "dkdq", bwd_pass != "dv"
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    dtype = q.dtype
    window = geometry.window_sides(window_size, causal)
    scale_f32 = np.float32(1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale)
    c = float(scale_f32 * np.float32(LOG2E))  # the kernel's Float32 scale_log2
    if softcap > 0:
        c, softcap_scale, inv_c = softcap_scales(scale_f32, softcap)
    scale_f32 = float(scale_f32)
    group = nheads // nheads_k
    m_tiles, n_tiles = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    rows_q, rows_k = m_tiles * tile_m, n_tiles * tile_n

    # 0. host and preprocess: D, lse_log2 (padding rows: D 0, lse_log2 +inf), as (B, Hk, group, rows)
    d_sum = preprocess_dpsum(out, dout)
    if dlse is not None:
        d_sum = d_sum - dlse.float()
    pad = (0, rows_q - seqlen_q)
    d_sum = torch.nn.functional.pad(d_sum, pad).reshape(batch, nheads_k, group, rows_q)
    big_l = torch.nn.functional.pad(lse_log2(lse, lse_split), pad, value=math.inf)
    hi, lo = (torch.nn.functional.pad(t, pad) for t in lse_split_halves(lse, lse_split))
    resid = exact_residual(hi, lo, big_l).reshape(batch, nheads_k, group, rows_q)
    flags = exact_tiles(big_l, tile_m).reshape(batch, nheads_k, group, m_tiles)
    if not exact_lse:
        flags = torch.zeros_like(flags)
    big_l = big_l.reshape(batch, nheads_k, group, rows_q)

    q64, do64 = _heads_rows(q, group, rows_q), _heads_rows(dout, group, rows_q)  # (B, Hk, group, rows_q, D)
    k64, v64 = _heads_rows(k, 1, rows_k)[:, :, 0], _heads_rows(v, 1, rows_k)[:, :, 0]  # (B, Hk, rows_k, D)

    stats = {"kv_tiles": n_tiles, "tile_pairs": 0, "skipped_pairs": 0, "steps": 0, "p_max": 0.0,
             "ds_absmax": 0.0, "dq_adds": 0, "exact_blocks": int(flags.sum())}
    dk = torch.zeros(batch, nheads_k, rows_k, headdim, dtype=dtype)
    dv = torch.zeros(batch, nheads_k, rows_k, headdim_v, dtype=dtype)
    dq_parts = {}  # (m, n) -> fp32 (B, Hk, group, tile_m, D)
    qi = torch.arange(tile_m)
    for n in range(n_tiles):
        ksl = slice(n * tile_n, (n + 1) * tile_n)
        k_t, v_t = k64[:, :, ksl], v64[:, :, ksl]
        keys = range(n * tile_n, (n + 1) * tile_n)
        first = torch.tensor([geometry.first_query(j, seqlen_q, seqlen_k, causal, window=window) for j in keys])
        end = torch.tensor([geometry.query_end(j, seqlen_q, seqlen_k, window=window) for j in keys])
        m_min, m_max = geometry.m_block_range(n, seqlen_q, seqlen_k, tile_m, tile_n, causal, window=window)
        blocks = range(m_min, max(m_max, m_min))
        stats["tile_pairs"] += len(blocks)
        stats["steps"] += group * len(blocks)
        dk_t = dv_t = None  # the TMEM accumulators: one chain over every step of the CTA
        for g in range(group):
            for m in blocks:
                qsl = slice(m * tile_m, (m + 1) * tile_m)
                row = (m * tile_m + qi).unsqueeze(0)
                hidden = (row < first.unsqueeze(1)) | (row >= end.unsqueeze(1))  # (tile_n, tile_m): S^T's
                q_t, do_t = q64[:, :, g, qsl], do64[:, :, g, qsl]  # (B, Hk, tile_m, D)
                # 1. S^T, dP^T in fp32
                s_t = mma_f32(None, k_t, q_t.transpose(-1, -2), mma_k)  # (B, Hk, tile_n, tile_m)
                do_tt = do_t.transpose(-1, -2)
                if bwd_pass == "dkdq":  # dP^T over the V / dO chunks of the do ring, one chain
                    dp_t = None
                    for col in range(0, headdim_v, BWD_VDO_COLS):
                        chunk = slice(col, col + BWD_VDO_COLS)
                        dp_t = mma_f32(dp_t, v_t[..., chunk], do_tt[..., chunk, :], mma_k)
                elif with_dkdq:
                    dp_t = mma_f32(None, v_t, do_tt, mma_k)
                # 2.-3. P^T = 2^fma(S^T, c, -lse_log2[query]) on MUFU, then the mask's select
                neg_l = (-big_l[:, :, g, qsl]).unsqueeze(2).expand_as(s_t).contiguous()
                if softcap > 0:  # score.apply: S^T -> tanh(S^T * a), before the mask
                    s_t = tanh_hw(s_t * softcap_scale, tanh_rel_err)
                x = fma_f32(s_t, c, neg_l)
                # the exact-LSE path of flagged blocks (per (batch, KV head) of this query head g)
                flag = flags[:, :, g, m].reshape(batch, nheads_k, 1, 1)
                x = torch.where(flag, x - resid[:, :, g, qsl].unsqueeze(2), x)
                p = exp2_hw(x).masked_fill(hidden, 0.0)
                p16 = p.to(dtype)  # 4. the TMEM P^T
                stats["p_max"] = max(stats["p_max"], float(p.max()))
                if with_dv:  # 6. dV += P^T dO (k-steps over the block's query rows)
                    dv_t = mma_f32(dv_t, p16.double(), do_t, mma_k)
                if not with_dkdq:
                    continue
                # 5. dS^T from the fp32 P^T
                ds = ((dp_t - d_sum[:, :, g, qsl].unsqueeze(2)) * p) * scale_f32
                if softcap > 0:  # score.grad_factor
                    ds = ds * grad_factor(p, big_l[:, :, g, qsl].unsqueeze(2), inv_c)
                ds16 = ds.to(dtype).double()
                # 6. dK += dS^T Q (k-steps over the block's query rows)
                dk_t = mma_f32(dk_t, ds16, q_t, mma_k)
                # 7. this key block's dQ part (k-steps over its keys)
                part = dq_parts.setdefault((m, n), torch.zeros(batch, nheads_k, group, tile_m, headdim))
                part[:, :, g] = mma_f32(None, ds16.transpose(-1, -2), k_t, mma_k)
                stats["ds_absmax"] = max(stats["ds_absmax"], float(ds.abs().max()))
        if dk_t is not None:  # 8. epilogue (zeros for a key block no query sees)
            dk[:, :, ksl] = dk_t.to(dtype)
        if dv_t is not None:
            dv[:, :, ksl] = dv_t.to(dtype)
    stats["skipped_pairs"] = m_tiles * n_tiles - stats["tile_pairs"]

    # 7. dq_accum: per query block, the key blocks' parts in dq_order, one fp32 add each
    order = _dq_add_order(dq_order, n_tiles)
    dq_accum = torch.zeros(batch, nheads_k, group, rows_q, headdim)
    for m in range(m_tiles):
        qsl = slice(m * tile_m, (m + 1) * tile_m)
        for n in order:
            if (m, n) in dq_parts:
                dq_accum[:, :, :, qsl] = dq_accum[:, :, :, qsl] + dq_parts[(m, n)]
                stats["dq_adds"] += 1

    # 8. postprocess
    dq = dq_accum.reshape(batch, nheads, rows_q, headdim)[:, :, :seqlen_q].to(dtype).permute(0, 2, 1, 3).contiguous()
    dk = dk[:, :, :seqlen_k].permute(0, 2, 1, 3).contiguous()
    dv = dv[:, :, :seqlen_k].permute(0, 2, 1, 3).contiguous()
    return (dq, dk, dv, stats) if return_stats else (dq, dk, dv)


def backward_two_pass(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, softmax_scale: float | None = None, causal: bool = False, window_size=None,
                      softcap: float = 0.0, **kwargs):
    """(dq, dk, dv) as the two-pass sm100 backward (hd256; docs/design/sm100_backward.md section 10.4)
    computes them: pass "dv" (dv) then pass "dkdq" (dq, dk), each `backward(..., bwd_pass=...)` over the
    same preprocess, each recomputing S^T and P^T (softcap: tanh before the exp2 in both; grad_factor
    in dkdq). Compile-verified kernel, not run on hardware."""
    _, _, dv = backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, bwd_pass="dv", **kwargs)
    dq, dk, _ = backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, bwd_pass="dkdq",
                         **kwargs)
    return dq, dk, dv


def backward_packed(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                    softmax_scale: float | None = None, causal: bool = False, **kwargs):
    """(dq, dk, dv) of a packed batch as the 1-CTA sm100 backward computes them (varlen configs;
    compile-verified, not run on hardware). q, dout, out: (total_q, H, D); k, v: (total_k, Hk, D);
    lse: (H, total_q); cu_seqlens_*: (batch + 1,); seqused_*: None or (batch,) (the used length of
    each sequence). Rows outside every sequence (past seqused, past cu_seqlens[-1]) may hold anything,
    NaN included.

    The kernel's CTAs of sequence b see, in shared memory, the sequence's rows and, past its end, the
    rows zero_tail zeroed (the next sequence's rows or stale ones): exactly the tiles a dense batch-1
    call on the sequence's rows gets from TMA clipping; its LSE / D rows come from the padded
    per-sequence layout (+inf / 0 past the end, as a dense call's padding), its dQ adds land in the
    sequence's padded rows, its dK / dV stores stop at seqlen_k. So sequence b's gradients are this
    model's dense `backward` of its rows; dq rows outside every sequence are the scratch tile's 0, dk /
    dv rows outside every sequence the host's memset 0."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        lq = int(seqused_q[b]) if seqused_q is not None else cu_q[b + 1] - cu_q[b]
        lk = int(seqused_k[b]) if seqused_k is not None else cu_k[b + 1] - cu_k[b]
        if lq == 0 or lk == 0:  # no step runs: dq stays 0 (its zeroed rows), dk / dv 0 (memset)
            continue
        rq, rk = slice(cu_q[b], cu_q[b] + lq), slice(cu_k[b], cu_k[b] + lk)
        g = backward(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq], lse[None, :, rq],
                     softmax_scale, causal, **kwargs)
        dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
