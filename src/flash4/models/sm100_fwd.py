"""Tile-level numerics model of the sm100 (Blackwell) forward: what it computes, in torch on the CPU.

    out, lse = forward(q, k, v, softmax_scale, causal)                 # flash_attn_func's layouts
    out, lse, stats = forward(..., return_stats=True)                  # + what the dataflow did

It checks the *algorithm* of /work/shared/design/BLACKWELL.md (FA4's FlashAttentionForwardSm100)
and its error bands against flash4.reference, not a kernel: the compiled kernel is checked on the
hardware by flash4.selftest. Per query row and per key block of `tile_n` keys (visited from the
last block down to block 0, as the kernel does), in this order:

 1. S = Q K^T in fp32 (the QK UMMA; bf16/fp16 operands): each UMMA k-step of `mma_k` = 16 elements
    is summed exactly and added to the fp32 accumulator with one round-to-nearest. Columns past
    seqlen_k and (causal) past the bottom-right diagonal are -inf, and every block is tile_n wide,
    so a column keeps its kernel position (it picks the exp2 unit and the row-sum lane).
 2. Row max (softmax warpgroup, one TMEM row per thread): m_tile = max over the block; the reference
    max moves only when it grew by more than tau = rescale_threshold (log2 units), FA4's
    update_row_max: step = fp32(fp32(m_old - m_new) * c) (c = fp32(softmax_scale * log2 e)); keep
    the stale m_old while step >= -tau. tau = 0 moves it whenever it grows.
 3. x = fma(S, c, -R), R = fp32(m * c) (FA4's fma_packed_f32x2; an FMA, one rounding; a row without a
    key yet has R = 0). exact_ref (flash4's sm90 rule, FWD_EXACT_REF_LOG2): from |R| >= 2^20 on, the
    row also subtracts R_lo = m*c - R (exact), so the row max gives 2^0 at any finite magnitude.
 4. P = 2^x per column: the columns chosen by `exp2_emu_frac` (the kernel's rule,
    exp2_poly.emulated_column(col, frac, EXP2_EMU_GROUP): by packed pairs of columns, of every
    `period` pairs the first k) or by an explicit `exp2_emu_columns` mask (fa4_emu_columns: FA4's
    "last 4 of every freq in each 32-column fragment but the last") take the degree-3 polynomial,
    bit-exact through exp2_poly.exp2_emulated_np; the others MUFU.EX2, modelled as 2^x correctly
    rounded to fp32 and flushed to 0 below 2^-126 (ex2.approx.ftz: <= 2 ulp of fp32 off, 2^-14 of
    a bf16 ulp).
 5. The TMEM P is P rounded to p_dtype (bf16/fp16, round to nearest even). The split P arrival
    (the PV MMA starts on the first 3/4 of P) changes when the MMA runs, not what it adds: the
    UMMA's k-steps accumulate into O in column order either way.
 6. Row sum from the fp32 P (not the rounded one), FA4's fadd_reduce on packed f32x2: 8 fp32 lanes
    (lane = column mod 8, lane 0 starts from row_sum * scale), then (0+2, 1+3), (4+6, 5+7), pairs
    added, the two halves added; every add fp32 round-to-nearest.
 7. O (fp32, TMEM): when the reference moved, the correction warpgroup multiplies O by
    scale = 2^(R_old - R_new) (rescale_step "ref", flash4's sm90 factor, exactly the change of P's
    reference) or by 2^step (rescale_step "fa4", FA4's factor); its warp vote (any of 32 rows
    with scale < 1) only decides whether rows with scale 1 are multiplied by 1.0, which is exact,
    so it is counted (stats) but changes nothing. Then O += P V (UMMA k-steps of mma_k keys).
 8. out = fp32(O * fp32(1 / row_sum)) rounded to the input dtype; lse = fp32(fp32(R + fp32(R_lo +
    log2 row_sum)) * fp32(ln 2)). Rows that saw no key: out 0, lse -inf.

Ragged keys (seqused_k: the kernel's varlen_k / seqused_k configs): only the first seqused_k[b] of
the tensor's keys belong to sequence b; the key-edge block is loaded from memory as the TMA loads it
(the rows past seqused_k up to the tensor's end are whatever memory holds: the next packed sequence,
a stale cache slot, NaN; past the tensor's end the TMA's zero fill), the softmax masks their scores
to -inf (P = 0 exactly), and the load warp's V-tail zeroing sets those V rows to 0 before P V
(zero_v_tail=True, the kernel). zero_v_tail=False models the kernel without it: a NaN or inf there
reaches O through 0 x NaN = NaN in P V (issue 25).

Not modelled: the MMA's own accumulation rounding inside one k-step (modelled exact), MUFU's last
ulps, rcp.approx / lg2.approx's (modelled correctly rounded), and anything about timing (barriers,
pipelines): a race or a wrong TMEM address has no analogue here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from flash4.constants import FWD_EXACT_REF_LOG2, RESCALE_THRESHOLD_LOG2
from flash4.kernels.common.scales import host_scales
from flash4.kernels.common.exp2_poly import _fma_f32, emulated_column, exp2_emulated_np
from flash4.kernels.sm100.plan import EXP2_EMU_FRAC, EXP2_EMU_GROUP

# Share of exp2 on the FMA polynomial by default: the sm100 kernel's non-causal share (1 pair of
# columns of every 4; causal configs use plan.EXP2_EMU_FRAC_CAUSAL, half of it).
DEFAULT_EXP2_EMU_FRAC = EXP2_EMU_FRAC
# Elements per k-step of one 16-bit UMMA (tcgen05.mma kind::f16: K = 16).
UMMA_K = 16
# Rows per warp of the correction warpgroup: its rescale vote covers 32 TMEM lanes.
VOTE_ROWS = 32
# Columns per fragment of FA4's softmax (apply_exp2_convert's frg_tile).
FA4_FRAGMENT = 32
KEY_ORDERS = ("reverse", "forward")
RESCALE_STEPS = ("ref", "fa4")
_LN2_F32 = np.float32(math.log(2.0))
_TINY_F32 = torch.finfo(torch.float32).tiny  # 2^-126


def emu_columns(tile_n: int, exp2_emu_frac: float, group: int = EXP2_EMU_GROUP) -> torch.Tensor:
    """Bool (tile_n,): True where the block's column uses the polynomial: the sm100 kernel's rule
    exp2_poly.emulated_column(col, exp2_emu_frac, group) (groups of `group` columns share a choice:
    2, a packed f32x2 pair; (col // group) % period < k, k / period = exp2_emu_frac)."""
    return torch.tensor([emulated_column(col, exp2_emu_frac, group) for col in range(tile_n)], dtype=torch.bool)


def fa4_emu_columns(tile_n: int, freq: int, start_frg: int = 1, res: int = 4) -> torch.Tensor:
    """Bool (tile_n,): FA4's apply_exp2_convert choice (flash_attn/cute/softmax.py): in 32-column
    fragment j, the pair (k, k+1) is emulated iff k % freq >= freq - res, start_frg <= j and j is
    not the last fragment; freq 0 = none."""
    cols = torch.arange(tile_n)
    if freq == 0:
        return torch.zeros(tile_n, dtype=torch.bool)
    frag, k = cols // FA4_FRAGMENT, (cols % FA4_FRAGMENT) // 2 * 2
    last = tile_n // FA4_FRAGMENT - 1
    return (k % freq >= freq - res) & (frag >= start_frg) & (frag < last)


def exp2_hw(x: torch.Tensor) -> torch.Tensor:
    """MUFU.EX2 model (ex2.approx.ftz.f32): 2^x rounded to fp32, 0 below 2^-126; -inf -> 0."""
    y = torch.exp2(x.double()).float()
    return torch.where(y < _TINY_F32, torch.zeros_like(y), y)


def exp2_mixed(x: torch.Tensor, emulated: torch.Tensor) -> torch.Tensor:
    """2^x of fp32 x (..., n), column j on the polynomial where emulated[j] (bit-exact
    exp2_poly.exp2_emulated_np), else exp2_hw."""
    p = exp2_hw(x)
    if bool(emulated.any()):
        with np.errstate(invalid="ignore", over="ignore"):
            p[..., emulated] = torch.from_numpy(exp2_emulated_np(x[..., emulated].numpy()))
    return p


def fma_f32(a: torch.Tensor, b: float, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c) with one rounding (FFMA / fma.rn.f32x2), through exp2_poly's exact model."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = _fma_f32(a.numpy(), np.float32(b), c.numpy())
    return torch.from_numpy(np.ascontiguousarray(out))


def row_sum_fa4(p: torch.Tensor, init: torch.Tensor | None) -> torch.Tensor:
    """FA4's fadd_reduce (arch >= 100) of fp32 p (..., n), n % 8 == 0: lane l sums columns l, l+8, ...
    (lane 0 starts from init), then lanes (0+2, 1+3) and (4+6, 5+7), those pairs, the two halves."""
    lanes = p[..., :8].clone()
    if init is not None:
        lanes[..., 0] = init + p[..., 0]
    for i in range(8, p.shape[-1], 8):
        lanes = lanes + p[..., i:i + 8]
    a = lanes[..., 0:2] + lanes[..., 2:4]
    b = lanes[..., 4:6] + lanes[..., 6:8]
    a = a + b
    return a[..., 0] + a[..., 1]


def mma_f32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, k_step: int | None) -> torch.Tensor:
    """acc + a @ b in fp32 as a UMMA chain: each k-step of k_step (None: all of K at once) summed
    exactly (float64 operands) and added to the fp32 accumulator with one rounding. acc None = zero
    (the first MMA of a tile, accumulate off)."""
    k = a.shape[-1]
    step = k if k_step is None else k_step
    for c in range(0, k, step):
        part = a[..., c:c + step] @ b[..., c:c + step, :]
        acc = part.float() if acc is None else (acc.double() + part).float()
    return acc


def _check_args(q, k, v, tile_n, key_order, rescale_step, p_dtype):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, seqlen, nheads, headdim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must all be bfloat16 or all float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] % k.shape[2] or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(batch, seqlen_k and nheads_k shared by k and v; nheads a multiple of nheads_k)")
    if tile_n < 8 or tile_n % 8:
        raise ValueError(f"tile_n must be a positive multiple of 8 (the row sum's 8 lanes); got {tile_n}")
    if key_order not in KEY_ORDERS:
        raise ValueError(f"key_order must be one of {KEY_ORDERS}; got {key_order!r}")
    if rescale_step not in RESCALE_STEPS:
        raise ValueError(f"rescale_step must be one of {RESCALE_STEPS}; got {rescale_step!r}")
    if p_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"p_dtype must be torch.bfloat16 or torch.float16; got {p_dtype}")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
            causal: bool = False, *, tile_n: int = 128, rescale_threshold: float = RESCALE_THRESHOLD_LOG2,
            exp2_emu_frac: float = DEFAULT_EXP2_EMU_FRAC, exp2_emu_columns: Sequence[bool] | torch.Tensor | None = None,
            p_dtype: torch.dtype | None = None, key_order: str = "reverse", mma_k: int | None = UMMA_K,
            rescale_step: str = "ref", exact_ref: bool = True, return_stats: bool = False, trace: bool = False,
            seqused_k: int | Sequence[int] | None = None, zero_v_tail: bool = True):
    """(out, lse) as the sm100 forward computes them (module docstring, steps 1-8).

    q: (B, Sq, H, D); k: (B, Sk, Hk, D); v: (B, Sk, Hk, Dv); all bfloat16 or all float16 (CPU);
      Hk divides H (query head h reads K/V head h // (H // Hk)). Causal is bottom-right aligned.
    softmax_scale: None = 1 / sqrt(D).
    tile_n: keys per block (a multiple of 8). rescale_threshold: tau, log2 units (0 = always).
    exp2_emu_frac: share of columns on the polynomial (emu_columns); exp2_emu_columns: an explicit
      bool mask of tile_n columns instead (e.g. fa4_emu_columns(128, 16)).
    p_dtype: the TMEM P's dtype (default q's). key_order: "reverse" (the kernel's: last block
      first) or "forward". mma_k: UMMA k-step (None: one rounding per block product).
    rescale_step: "ref" (2^(R_old - R_new)) or "fa4" (2^(fp32(m_old - m_new) * c)).
    exact_ref: subtract R_lo once |R| >= FWD_EXACT_REF_LOG2 (flash4's huge-magnitude path).
    seqused_k: keys of each sequence (an int for all, or one per batch row), <= k.shape[1]: the rest
      of k / v is memory past the sequence's end, loaded with the key-edge block (module docstring).
    zero_v_tail: with seqused_k, zero the key-edge block's V rows past seqused_k before P V (the
      kernel's V-tail zeroing); False models the kernel without it.
    Returns (out (B, Sq, H, Dv) in q's dtype, lse (B, H, Sq) float32), and with return_stats a dict:
      blocks: key blocks visited; stale_blocks: (row, block) pairs where the true running max was
      above the reference (a stale max was used); max_stale_log2: the largest such gap (log2
      units, <= tau); rescales: (row, block) pairs whose reference moved after the first block;
      warp_rescales: (32-row group, block) pairs the correction warp vote passes; p_max: largest
      fp32 P (<= 2^tau); emulated_frac: share of exp2 evaluations on the polynomial; exact_rows:
      rows that took the exact_ref path; trace (with trace=True): per visited block
      {"n_block", "x", "p", "emulated"} (fp32 exponents and P, (B, H, Sq, tile_n), the mask).
    """
    p_dtype = q.dtype if p_dtype is None else p_dtype
    _check_args(q, k, v, tile_n, key_order, rescale_step, p_dtype)
    if seqused_k is not None and not isinstance(seqused_k, int):
        used = [int(x) for x in seqused_k]
        if len(used) != q.shape[0]:
            raise ValueError(f"seqused_k must hold one count per batch row ({q.shape[0]}); got {len(used)}")
        kw = dict(softmax_scale=softmax_scale, causal=causal, tile_n=tile_n, rescale_threshold=rescale_threshold,
                  exp2_emu_frac=exp2_emu_frac, exp2_emu_columns=exp2_emu_columns, p_dtype=p_dtype,
                  key_order=key_order, mma_k=mma_k, rescale_step=rescale_step, exact_ref=exact_ref,
                  zero_v_tail=zero_v_tail)
        rows = [forward(q[b:b + 1], k[b:b + 1], v[b:b + 1], seqused_k=used[b], **kw) for b in range(q.shape[0])]
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    batch, seqlen_q, nheads, headdim = q.shape
    keys_in_memory, nheads_k, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    seqlen_k = keys_in_memory if seqused_k is None else seqused_k
    if not 0 <= seqlen_k <= keys_in_memory:
        raise ValueError(f"seqused_k={seqused_k} must be in [0, k.shape[1]={keys_in_memory}]")
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    c = host_scales(scale, 0.0, False)[0]  # the kernel's Float32 scale_log2, folded as the host does
    if exp2_emu_columns is None:
        emulated = emu_columns(tile_n, exp2_emu_frac)
    else:
        emulated = torch.as_tensor(exp2_emu_columns, dtype=torch.bool)
        if emulated.shape != (tile_n,):
            raise ValueError(f"exp2_emu_columns must hold tile_n={tile_n} booleans; got shape {tuple(emulated.shape)}")

    group = nheads // nheads_k
    q64 = q.permute(0, 2, 1, 3).double()  # (B, H, Sq, D)
    k64 = k.repeat_interleave(group, dim=2).permute(0, 2, 1, 3).double()  # (B, H, Sk, D)
    v64 = v.repeat_interleave(group, dim=2).permute(0, 2, 1, 3).double()  # (B, H, Sk, Dv)
    n_blocks = -(-seqlen_k // tile_n)
    order = range(n_blocks - 1, -1, -1) if key_order == "reverse" else range(n_blocks)
    rows = torch.arange(seqlen_q).unsqueeze(1)
    rowshape = (batch, nheads, seqlen_q)
    neg_inf = torch.full(rowshape, -math.inf)

    m = neg_inf.clone()  # reference max (raw score units, fp32)
    m_true = neg_inf.clone()  # the true running max (stats only)
    hi = torch.zeros(rowshape)  # R = fp32(m_safe * c)
    lo = torch.zeros(rowshape)  # R_lo (exact_ref rows)
    exact = torch.zeros(rowshape, dtype=torch.bool)
    row_sum = o = None
    stats = {"blocks": 0, "stale_blocks": 0, "max_stale_log2": 0.0, "rescales": 0, "warp_rescales": 0,
             "p_max": 0.0, "emulated_frac": float(emulated.float().mean()), "exact_rows": 0}
    if trace:
        stats["trace"] = []

    for idx, nb in enumerate(order):
        first = idx == 0
        start = nb * tile_n
        # the block as the TMA loads it: memory up to the tensor's end (past seqlen_k: another sequence's
        # or stale rows with ragged keys), its zero fill beyond
        width = min(tile_n, keys_in_memory - start)
        k_blk = torch.zeros(batch, nheads, tile_n, headdim, dtype=torch.float64)
        v_blk = torch.zeros(batch, nheads, tile_n, headdim_v, dtype=torch.float64)
        k_blk[:, :, :width] = k64[:, :, start:start + width]
        v_blk[:, :, :width] = v64[:, :, start:start + width]
        if zero_v_tail and seqlen_k - start < tile_n:
            v_blk[:, :, seqlen_k - start:] = 0.0  # the load warp's V-tail zeroing (ragged keys)
        # 1. S in fp32, masked columns -inf
        s = mma_f32(None, q64, k_blk.transpose(-1, -2), mma_k)
        col = start + torch.arange(tile_n).unsqueeze(0)
        visible = col < seqlen_k
        if causal:
            visible = visible & (col <= rows + seqlen_k - seqlen_q)
        s = s.masked_fill(~visible, -math.inf)
        # 2. row max, stale unless it grew by more than tau
        m_tile = s.amax(-1)
        m_true = torch.maximum(m_true, m_tile)
        if first:
            m_new, moved = m_tile, torch.zeros(rowshape, dtype=torch.bool)
        else:
            m_new = torch.maximum(m, m_tile)
            safe_new = torch.where(m_new == -math.inf, 0.0, m_new)
            step = ((m - safe_new).double() * c).float()  # fp32(m_old - m_new), then * c in fp32
            move = ~(step >= -rescale_threshold) if rescale_threshold > 0 else torch.ones(rowshape, dtype=torch.bool)
            moved = move & (m_new != m)
            m_new = torch.where(move, m_new, m)
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
        hi_new = (m_safe.double() * c).float()
        lo_new = torch.zeros(rowshape)
        if exact_ref:
            exact = exact | (hi_new.abs() >= FWD_EXACT_REF_LOG2)
            lo_new = torch.where(exact, (m_safe.double() * c - hi_new.double()).float(), lo_new)
        # 7a. the factor O and the row sum move by
        # (a change of R_lo alone, when a row enters the exact path, moves P's reference too)
        if not first:
            if rescale_step == "ref":
                ref_step = (hi - hi_new) + (lo - lo_new)
            else:
                ref_step = torch.where(move, step, 0.0) + (lo - lo_new)
            # min(step, 64): a row that saw no key (O, row sum 0) may step up from R = 0; 0 * 2^64 = 0
            row_scale = torch.where(ref_step == 0, 1.0, exp2_hw(torch.clamp(ref_step, max=64.0)))
        m, hi, lo = m_new, hi_new, lo_new
        # 3.-4. exponent and exp2
        x = fma_f32(s, c, -hi.unsqueeze(-1))
        if exact_ref and bool(exact.any()):
            x = torch.where(exact.unsqueeze(-1), x - lo.unsqueeze(-1), x)
        p = exp2_mixed(x, emulated)
        p_low = p.to(p_dtype)  # 5. the TMEM P
        # 6. row sum from the fp32 P; 7. O
        if first:
            row_sum = row_sum_fa4(p, None)
            o = mma_f32(None, p_low.double(), v_blk, mma_k)
        else:
            row_sum = row_sum_fa4(p, row_sum * row_scale)
            o = mma_f32(o * row_scale.unsqueeze(-1), p_low.double(), v_blk, mma_k)
            stats["rescales"] += int(moved.sum())
            votes = (row_scale < 1).reshape(batch, nheads, -1)
            pad = -seqlen_q % VOTE_ROWS
            votes = torch.nn.functional.pad(votes, (0, pad)).reshape(batch, nheads, -1, VOTE_ROWS)
            stats["warp_rescales"] += int(votes.any(-1).sum())
        stale = (m_true > m) & torch.isfinite(m_true)
        stats["stale_blocks"] += int(stale.sum())
        if bool(stale.any()):
            gap = ((m_true.double() - m.double()) * c)[stale].max().item()
            stats["max_stale_log2"] = max(stats["max_stale_log2"], gap)
        stats["p_max"] = max(stats["p_max"], float(p.max()) if p.numel() else 0.0)
        stats["blocks"] += 1
        if trace:
            stats["trace"].append({"n_block": nb, "x": x, "p": p, "emulated": emulated})

    # 8. epilogue
    if row_sum is None:  # seqlen_k == 0
        out = torch.zeros(batch, seqlen_q, nheads, headdim_v, dtype=q.dtype)
        lse = torch.full(rowshape, -math.inf)
    else:
        empty = (row_sum == 0) | row_sum.isnan()
        inv = 1.0 / torch.where(empty, 1.0, row_sum)
        out = (o * inv.unsqueeze(-1)).to(q.dtype).permute(0, 2, 1, 3).contiguous()
        log_sum = torch.log2(torch.where(empty, 1.0, row_sum).double()).float()
        lse = (hi + (lo + log_sum)) * torch.tensor(_LN2_F32)
        lse = torch.where(empty, -math.inf, lse)
    stats["exact_rows"] = int(exact.sum())
    return (out, lse, stats) if return_stats else (out, lse)
