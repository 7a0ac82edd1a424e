"""FlashAttention backward for Hopper (sm_90a) in CuTe DSL: dQ, dK, dV.

One CTA per (n_block, kv_head, batch): it keeps a tile of K and V in shared memory and walks the
query blocks of every query head that shares this K/V head (GQA/MQA reduce dK, dV in registers,
no atomics). GQA/MQA head split (config.BwdConfig.dkv_accum): one CTA per (n_block, head split,
kv_head, batch) walks heads_per_cta of those query heads and adds its fp32 dK, dV into zeroed
global accumulators (red.global.add.v2.f32; deterministic: in split order). Per query block m (FlashAttention-2 backward, Dao 2023, algorithm 2; the transposed
"S^T" formulation of FlashAttention-3's Hopper backward):

    S^T  = K Q^T                 (wgmma SS, keys are the M dimension)
    dP^T = V dO^T                (wgmma SS)
    P^T  = 2^(S^T * scale*log2e - LSE*log2e)      (LSE from the forward; masked entries 0)
    dS^T = scale * P^T * (dP^T - D),  D = rowsum(dO * O)  (from the preprocess)
    dV  += P^T dO                (wgmma RS: P^T stays in registers)
    dK  += dS^T Q                (wgmma RS)
    dQ_m = dS K                  (wgmma SS from dS^T staged in smem) -> fp32 bulk reduce-add to
                                 the dQ accumulator in global memory (cp.reduce.async.bulk)
    dS carries the softmax scale, so dK, dV and dQ need no rescaling; the postprocess converts dQ.

Order within a step (per consumer warpgroup, dv_after_ds: the non-split configs except d128
varlen/seqused/window): issue S^T, dP^T; exponentials (under dP^T); wait; dS^T; one bf16 copy of
dS^T, staged and kept as dK's A operand; issue dV; barrier; dQ; dK; stage dQ for the store warp
(under dK). Otherwise dV is issued before the dS^T math (dS^T then overlaps dV); at 128 queries
per step that order made ptxas serialize every wgmma (C7512). The store warp reduce-adds the dQ
tile with one bulk op per row, or (head dim <= 96, config.DQ_WHOLE_TILE_MAX_HEADDIM) one for the
whole unpadded tile, staged in the accumulator's own element order when the layout is dense
(BwdConfig.dq_accum_order, kernels/common/dq_accum.py: 16-byte conflict-free stores; the dQ
postprocess undoes the order). The element mask is compiled only into the loop
over the m_blocks that need it: causal, those that cross the diagonal; every m_block of the CTA
whose key tile crosses seqlen_k (keys past it are masked explicitly, never left to TMA's zero fill).
P uses the padded log2 LSE; query tiles whose |LSE * log2 e| is huge take an exact exponent from
the forward's unrounded LSE split (issue 8). One CTA per (n_block, kv_head, batch), all in gridDim.x.

Speed candidate (config.BwdConfig.dq_swapab, off, compile-verified, not run on hardware): head dim
128 non-causal at flash-attn-4's tile_m 80 with dQ^T = K^T dS^T (M = head dim), staged transposed
into an unpadded row-major fp32 tile and reduce-added whole (bwd_step.StepRegsDqT).

Three work splits between the consumer warpgroups (config.BwdConfig.split_headdim, transposed_dkv):
  * headdim <= 128: each warpgroup owns 64 keys (tile_n = 128) and accumulates their dK, dV over
    the full headdim in registers; P^T, dS^T feed dV, dK from registers (RS).
  * headdim > 128 (256): dK, dV over the full headdim would not fit 240 registers. Both warpgroups share
    64 keys (tile_n = 64); each computes S^T, dP^T for half of the queries, stages P^T and dS^T in
    smem, and accumulates dK, dV, dQ for half of headdim (SS wgmmas).
  * headdim 192 and (192, 128) (transposed_dkv, flash-attn-4's sm90 shape): 64 queries x
    96 keys per step, query-major S = Q K^T and dP = dO V^T with each warpgroup owning a 48-key
    half; dV^T = dO^T P and dK^T = Q^T dS put the head dim on the wgmma M axis (192 x 48 per
    warpgroup fits the registers that 96 x 192 would not), both operands from smem (P, dS staged
    in smem, one buffer each); dQ = dS K split over head-dim halves. dO may have fewer stages
    than Q (d192: 1). The epilogue stores dK^T / dV^T with transposing stmatrix.
dK, dV leave through K's and V's smem and a TMA store. The step is written once
(bwd_step.BwdStep.mma_one_m_block); the three splits are its subclasses StepRegs, StepSplitHd and
StepDkvT, which supply the operands, the GEMM calls and the P / dS hand-offs.

Files: this one (the kernel class: host setup, warp roles, epilogues), bwd_step.py (the consumer
step and its work splits), bwd_schedule.py (BwdSchedule: the CTA's coordinates and loop bounds),
bwd_params.py (the parameter bundles the kernel, roles and step take).

Variable-length (packed) batches (config.BwdConfig.varlen_q / varlen_k / seqused_q / seqused_k;
host side flash4.backward): Q, dO (1, total_q, H, D) and K, V, dK, dV (1, total_k, Hk, D) have a
batch mode of size 1 and the CTA reads its sequence's offsets and lengths from cu_seqlens /
seqused (kernels/common/seqinfo.py); every block range and mask takes that sequence's seqlen_q /
seqlen_k. The per-row statistics (LSE * log2 e, D), the dQ accumulator and the per-tile flags
(dQ semaphores, exact-path flags) live in the padded layout: sequence b starts at row
padded_offset(b), a multiple of tile_m, so its query tile m is padded tile padded_offset / tile_m
+ m (the deterministic semaphore chain runs per padded tile as in the dense case). The grid is
sized by max_seqlen_k (a host int): CTAs whose key tile starts past their sequence's seqlen_k exit
at once. Queries past seqlen_q need no mask (their padded LSE is +inf: P = 0, D = 0); keys past
seqlen_k are masked in the key-edge CTA as in the dense case. Rows past a sequence inside a tile
are not TMA zeros there (the next packed sequence, rows past seqused: any bits, NaN and inf
included), and the GEMMs multiply them even where P is 0 (0 * NaN = NaN): the consumers zero the K
and V rows >= seqlen_k of the key-edge tile once, and the Q and dO rows >= seqlen_q of the
query-edge step's stages, in shared memory before any wgmma reads them (BwdStep.zero_kv_tail /
zero_q_tail, docs/design/bwd_tail.md), so every operand equals the dense layout's TMA-clipped
tile. Packed dK, dV rows past seqlen_k
belong to the next sequence: with varlen_k the staged tiles are written by predicated 16-byte
stores of the rows < seqlen_k instead of the TMA store. Every varlen change is a const_expr: the
dense kernel (all flags off) is unchanged.
"""

from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from flash4.arch import capacity
from flash4.constants import THREADS_PER_WG
from flash4.kernels.common import score
from flash4.kernels.common.barriers import NamedBarrierBwd
from flash4.kernels.common.dq_accum import make_dq_tiled_mma
from flash4.kernels.common.dsl import DSL_DTYPES
from flash4.kernels.common.layout import select_modes, transpose_view
from flash4.kernels.common.params import MaskParams, SeqParams
from flash4.kernels.common.pipeline import next_state, tma_pipeline_factory
from flash4.kernels.common.seqinfo import store_rows_predicated
from flash4.kernels.sm90.bwd_params import (
    BwdPipelines, BwdSmem, BwdSmemLayouts, BwdTensors, BwdTiledMmas, BwdTmaAtoms, HeadSplit, ScoreArgs, StepScales,
)
from flash4.kernels.sm90.bwd_schedule import BwdSchedule
from flash4.kernels.sm90.bwd_step import delta_buffer, stage_state, step_class

# setmaxnreg budgets: producer warpgroup, 2 consumer warpgroups (64K registers per CTA).
_PRODUCER_REGS, _CONSUMER_REGS = 24, 240


@dsl_user_op
def bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """gmem[0:n] += smem[0:n] (fp32), asynchronously on the bulk copy engine (one bulk group)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.llvm_ptr, smem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_f32x2(gmem_ptr: cute.Pointer, a: Float32, b: Float32, *, loc=None, ip=None):
    """gmem[0] += a, gmem[1] += b (fp32, one relaxed red.global, 8-byte aligned gmem_ptr)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip),
         Float32(b).ir_value(loc=loc, ip=ip)],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_f32(gmem_ptr: cute.Pointer, a: Float32, *, loc=None, ip=None):
    """gmem[0] += a (fp32, one relaxed red.global)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip)],
        "red.global.add.f32 [$0], $1;",
        "l,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _half_split_atom_cols(cols: int):
    """None if the widest swizzle atom for `cols` 16-bit columns also tiles each half (cols/2);
    else cols/2, so the atom is chosen for the half (e.g. 96 -> 64 B atom of 32 columns does not
    tile 48 -> choose for 48: 32 B atom of 16 columns)."""
    width = next(w for w in (64, 32, 16, 8) if cols % w == 0)  # 128/64/32/16 B swizzle, 16-bit elements
    half = cols // 2
    return None if half % width == 0 or width % half == 0 else half


class FlashAttentionBackwardSm90:
    """Warp roles (threads 0-127 producer warpgroup, 128-383 two consumer warpgroups), one method each:
      * warp 0 (`load`): TMA loads: K and V of the tile once; then per step Q (+ LSE*log2e) and dO (+ D).
      * warp 1 (`store_dQ`): per step, waits for the consumers' dQ tile in smem and issues the bulk
        fp32 reduce-adds into the global dQ accumulator (deterministic: in key-block order); frees
        the tile once it has been read. sink_delta: also adds each query row's D = sum_j P dP (the
        consumer warps' partials staged with the tile, `add_delta`) to a global fp32 buffer.
      * consumer warpgroups (`mma`; 64 keys each, half of the queries and of headdim, or a 48-key
        half): per (query head, m_block) the step bwd_step.BwdStep.mma_one_m_block, then the dK, dV
        epilogue (`epilogue_dKV`: TMA store; `epilogue_dKV_accum`: fp32 adds, dkv_accum).
    Steady state of a consumer warpgroup, per step: wait Q; S; wait dO; dP; score transform,
    exponent, mask (under dP); P hand-off (dV here or after dS); dS; dS staged, dS barrier; dQ;
    release dO; dK; dQ tile to smem for warp 1 (dQEmpty, dQFull; under dK); wait; release Q.
    Pipelines (producer warp 0 -> consumers; the TMA's transaction bytes complete the full barrier,
    one arrive per consumer warp on release):
      kv (1 stage): K, V.  q (q_stages): Q + LSE.  do (do_stages, = q_stages except transposed_dkv):
      dO + D.
    Named barriers (kernels/common/barriers.NamedBarrierBwd): dQFull (consumers -> warp 1: tile
    staged), dQEmpty (warp 1 -> consumers: tile read), dS (both consumer warpgroups: dS^T (and P^T)
    staged before the GEMMs read them; transposed_dkv: also the other warpgroup's previous dQ has
    read sdS), PWG0/PWG1 (transposed_dkv: one warpgroup's P staged before its dV^T reads it),
    Epilogue (both consumer warpgroups: K/V smem free, then dK/dV staged for the TMA store; the
    dkv_accum deterministic chain), Tail (both consumer warpgroups, packed / seqused layouts only:
    the K/V rows past seqlen_k, or a query-edge step's Q/dO rows past seqlen_q, zeroed in smem).
    Parameters: __call__ keeps the host ABI (compile/cache.compile_bwd); the kernel takes the
    bundles of bwd_params.py and kernels/common/params.py, and the CTA's coordinates live in one
    BwdSchedule. Trace-time constants of the config (tiles, stages, flags, TMA byte counts) are
    attributes; no runtime value is kept on the instance.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.dtype = DSL_DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.hdim = cfg.tile_m, cfg.tile_n, cfg.headdim
        self.hdim_v = cfg.hdim_v  # V / dO / dV head dim (Dv; = hdim unless cfg.headdim_v)
        self.q_stages = cfg.q_stages
        self.causal = cfg.causal
        self.split_hd = cfg.split_headdim
        # transposed_dkv (config.BwdConfig): dK^T, dV^T with the head dim on M, 64 x 96 tiles.
        self.dkv_t = cfg.transposed_dkv
        self.do_stages = cfg.num_do_stages
        self.num_wg_mma = 2
        self.num_mma_threads = 2 * THREADS_PER_WG
        self.num_threads = 3 * THREADS_PER_WG
        if self.dkv_t:
            assert self.tile_n == 96 and self.tile_m == 64 and not self.split_hd
        else:
            assert self.tile_n == (64 if self.split_hd else 64 * self.num_wg_mma)
            assert self.do_stages == self.q_stages
        # dV after the dS^T math (FA3's order): dS^T first (P^T fp32 dies), one bf16 copy of dS^T for
        # both the smem stage and the dK A operand, then dV. Issuing dV before the dS^T math (P^T
        # fp32, P^T bf16 in flight, dP^T, dV, dK all live at once) left ptxas short of registers at
        # 128 queries per step (d64 bf16): it serialized every wgmma of the kernel (ptxas C7512,
        # SASS: WARPGROUP.DEPBAR after each HGMMA). At 64 queries it did not, but dV after dS^T is
        # faster there too (H200, same call: d128 +1-3.5%, d96 +1%, GQA 64/8 d128 +2%). Not for head
        # dim 128 with a packed / seqused layout or a window: there it spills (compile check: 12-14
        # local-memory instructions), so those keep dV before the dS^T math.
        self.dv_after_ds = cfg.dv_after_ds
        # BwdConfig.exp_before_dp_wait (bwd_step.BwdStep.wait_dP): at 128 queries per step, P^T, dP^T,
        # dK and dV all live across the dP^T wait left ptxas short of registers: it serialized every
        # wgmma (sm_90a, d64 bf16: 8 spill instructions); refused there.
        if cfg.exp_before_dp_wait and not self.split_hd and not self.dkv_t and self.tile_m > 64:
            raise ValueError(f"flash4 bwd_sm90: exp_before_dp_wait needs tile_m 64 (ptxas serializes the wgmmas "
                             f"at {self.tile_m}): {cfg}")
        assert self.hdim % 16 == 0 and (self.hdim // 2) % 8 == 0
        assert self.hdim_v % 16 == 0 and (self.hdim_v // 2) % 8 == 0
        # Sequence layout (all static): packed Q-side / K-side tensors, per-sequence lengths.
        self.varlen_q, self.varlen_k = cfg.varlen_q, cfg.varlen_k
        # seqlen_k differs per sequence: the grid is sized by max_seqlen_k, CTAs past it exit.
        self.dynamic_seqlen_k = cfg.dynamic_seqlen_k
        # Rows past a sequence inside a tile that are not TMA zeros (issue 25): packed queries / keys
        # of the next sequence, rows past seqused. Zeroed in smem before any GEMM reads them
        # (bwd_step.BwdStep.zero_kv_tail / zero_q_tail); dense configs compile none of it.
        self.ragged_q, self.ragged_k = cfg.ragged_q, cfg.ragged_k

    def _smem_layout(self, rows: int, cols: int, stages=None, atom_cols=None):
        """Row-major (cols contiguous) swizzled smem tile. atom_cols: pick the swizzle as if the
        rows had this many columns (a GEMM that splits the columns in halves needs an atom that
        divides the half: headdim 96 -> 48 -> 32-byte swizzle)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, atom_cols or cols), self.dtype
        )
        shape = (rows, cols) if stages is None else (rows, cols, stages)
        return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))

    def _tiled_mmas(self):
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        make = partial(sm90_utils.make_trivial_tiled_mma, self.dtype, self.dtype)
        if const_expr(self.dkv_t):
            # Atom (1, 2, 1): warpgroup w owns keys [48w, 48w + 48) of S, dP, dV^T, dK^T and head
            # dims [hdim/2 w, hdim/2 (w + 1)) of dQ.
            mma_sdp = make(K, K, Float32, (1, 2, 1), (64, self.tile_n // 2))  # S = Q K^T, dP = dO V^T
            mma_dkv = make(MN, MN, Float32, (1, 2, 1), (64, self.tile_n // 2))  # dK^T = Q^T dS, dV^T = dO^T P
            mma_dq = make(K, MN, Float32, (1, 2, 1), (64, self.hdim // 2))  # dQ = dS K
            return mma_sdp, mma_dkv, mma_dq
        if const_expr(not self.split_hd):
            # S^T, dP^T: (tile_n keys) x (tile_m queries), keys split over the 2 warpgroups.
            mma_sdp = make(K, K, Float32, (2, 1, 1), (64, self.tile_m))
            # dV, dK: (tile_n keys) x headdim, A = P^T / dS^T from registers; B = dO^T / Q^T (MN-major).
            mma_dkv = make(K, MN, Float32, (2, 1, 1), (64, self.hdim), a_source=warpgroup.OperandSource.RMEM)
        else:
            # split_headdim: S^T, dP^T split over queries; dV, dK over headdim, A = P^T / dS^T from smem.
            mma_sdp = make(K, K, Float32, (1, 2, 1), (64, self.tile_m // 2))
            mma_dkv = make(K, MN, Float32, (1, 2, 1), (64, self.hdim // 2))
        # dQ: (tile_m queries) x headdim, queries or headdim split over the 2 warpgroups; A = dS (from the
        # staged dS^T: M-major), B = K^T (MN-major). The dQ postprocess builds the same (accumulator order).
        if const_expr(self.cfg.dq_swapab):
            # dQ^T = K^T dS^T: (headdim) x (tile_m queries), head-dim halves over the 2 warpgroups (M 64
            # each at any tile_m); A = K^T (from K's smem, MN-major), B = dS^T viewed queries x keys
            # (MN-major), K = the tile's 128 keys.
            return mma_sdp, mma_dkv, make(MN, MN, Float32, (self.num_wg_mma, 1, 1), (64, self.tile_m))
        mma_dq = make_dq_tiled_mma(self.dtype, self.tile_m, self.hdim, self.num_wg_mma)
        return mma_sdp, mma_dkv, mma_dq

    def _tiled_mma_dv(self, mma_dkv):
        """dV += P^T dO: mma_dkv with N = Dv (the same tiled MMA when Dv == headdim)."""
        if const_expr(self.hdim_v == self.hdim or self.dkv_t):
            return mma_dkv  # transposed_dkv: Dv is M, the tiled MMA does not depend on it
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        make = partial(sm90_utils.make_trivial_tiled_mma, self.dtype, self.dtype)
        if const_expr(not self.split_hd):
            return make(K, MN, Float32, (2, 1, 1), (64, self.hdim_v), a_source=warpgroup.OperandSource.RMEM)
        return make(K, MN, Float32, (1, 2, 1), (64, self.hdim_v // 2))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, headdim)
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_k, headdim)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim)
        mLSE2: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32: LSE * log2(e), +inf on padding
        mD: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32: rowsum(dO * O), 0 on padding
        mdQacc: cute.Tensor,  # (batch, nheads, seqlen_q_pad, headdim) fp32, zeroed
        mdK: cute.Tensor,  # (batch, seqlen_k, nheads_k, headdim)
        mdV: cute.Tensor,
        mdQsem: cute.Tensor,  # (batch, nheads, num_m_blocks) int32, zeroed; used when deterministic
        mExact: cute.Tensor,  # (batch, nheads, num_m_blocks) int32: 1 where the query tile takes the exact P path
        mLSEhi: cute.Tensor,  # (batch, nheads, seqlen_q) fp32: LSE * log2(e) = hi + lo, unrounded (exact path)
        mLSElo: cute.Tensor,
        # Sequence layout: each None unless its config flag is on (the compile specializes on None).
        mCuSeqlensQ: Optional[cute.Tensor],  # (batch + 1,) int32 (varlen_q)
        mCuSeqlensK: Optional[cute.Tensor],  # (batch + 1,) int32 (varlen_k)
        mSeqUsedQ: Optional[cute.Tensor],  # (batch,) int32 (seqused_q)
        mSeqUsedK: Optional[cute.Tensor],  # (batch,) int32 (seqused_k)
        mdKVsem: Optional[cute.Tensor],  # (n_blocks * nheads_k * batch,) int32, zeroed: dkv_accum + deterministic
        mDelta: Optional[cute.Tensor],  # (batch, nheads, seqlen_q_pad) fp32, zeroed: sink_delta (D = sum_j P dP)
        softmax_scale: Float32,
        max_seqlen_k: Optional[Int32],  # varlen_k or seqused_k: >= every seqlen_k (sizes the grid); else None
        window_left: Int32,  # local: the window's sides (flash4.geometry.window_sides); ignored otherwise
        window_right: Int32,
        softcap: Float32,  # cfg.softcap: the cap (scores softcap * tanh(S * scale / softcap)); else ignored
        num_ctas: Int32,  # grid size: n_blocks * head splits * nheads_k * batch (flash4.launch.bwd_grid)
        heads_per_cta: Int32,  # dkv_accum: query heads per CTA (the rest of its KV head's go to others)
        stream: cuda.CUstream,
    ):
        """Dense: the shapes above. varlen_q: Q, dO (1, total_q, H, D), LSE2, D (1, H, padded_rows),
        dQacc (1, H, padded_rows, D), dQsem, exact (1, H, padded_rows / tile_m), LSEhi/lo
        (1, H, total_q), padded_rows >= flash4.backward.padded_total (the kernel touches only the
        tiles of each sequence). varlen_k: K, V, dK, dV (1, total_k, Hk, D). dkv_accum: dK, dV are
        fp32 accumulators of the same shapes, zeroed; the kernel adds its dK, dV into them."""
        cfg = self.cfg
        assert (mCuSeqlensQ is not None) == cfg.varlen_q and (mCuSeqlensK is not None) == cfg.varlen_k
        assert (mSeqUsedQ is not None) == cfg.seqused_q and (mSeqUsedK is not None) == cfg.seqused_k
        assert (max_seqlen_k is not None) == self.dynamic_seqlen_k
        assert (mdKVsem is not None) == (cfg.dkv_accum and cfg.deterministic)
        assert (mDelta is not None) == cfg.sink_delta
        mQ, mK, mV, mdO, mdK, mdV = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSE2, mD = [select_modes(t, [2, 1, 0]) for t in (mLSE2, mD)]  # (seqlen_q_pad, nheads, batch)
        mdQacc = select_modes(mdQacc, [2, 3, 1, 0])  # (seqlen_q_pad, headdim, nheads, batch)
        mdQsem, mExact = [select_modes(t, [2, 1, 0]) for t in (mdQsem, mExact)]  # (num_m_blocks, nheads, batch)
        mLSEhi, mLSElo = [select_modes(t, [2, 1, 0]) for t in (mLSEhi, mLSElo)]  # (seqlen_q, nheads, batch)
        if const_expr(cfg.sink_delta):
            mDelta = select_modes(mDelta, [2, 1, 0])  # (seqlen_q_pad, nheads, batch)

        mma_sdp, mma_dkv, mma_dq = self._tiled_mmas()
        mma_dv = self._tiled_mma_dv(mma_dkv)
        sQ_layout = self._smem_layout(self.tile_m, self.hdim, self.q_stages)
        # K is also the B operand of the dQ GEMM, whose warpgroups split headdim in halves.
        half_cols = _half_split_atom_cols(self.hdim)
        sKV_layout = self._smem_layout(self.tile_n, self.hdim, atom_cols=half_cols)
        # Q, dO are the B operands of dK, dV: split in headdim halves when split_headdim.
        if const_expr(self.split_hd):
            sQ_layout = self._smem_layout(self.tile_m, self.hdim, self.q_stages, atom_cols=half_cols)
        # V, dV (tile_n, Dv) and dO (tile_m, Dv): K's and Q's layouts when Dv == headdim.
        sV_layout, sdO_layout = sKV_layout, sQ_layout
        if const_expr(self.hdim_v != self.hdim):
            half_cols_v = _half_split_atom_cols(self.hdim_v)
            sV_layout = self._smem_layout(self.tile_n, self.hdim_v, atom_cols=half_cols_v)
            sdO_layout = self._smem_layout(self.tile_m, self.hdim_v, self.q_stages,
                                           atom_cols=half_cols_v if self.split_hd else None)
        sdS_layout = self._smem_layout(self.tile_n, self.tile_m, 2)  # dS^T: keys x queries, 2 buffers
        if const_expr(self.dkv_t):
            # V (B of dP, K-major) and dO (A of dP, A of dV^T MN-major): full-width swizzle;
            # P, dS: queries x keys, one buffer each, the swizzle chosen for the 48-key halves.
            sV_layout = self._smem_layout(self.tile_n, self.hdim_v)
            sdO_layout = self._smem_layout(self.tile_m, self.hdim_v, self.do_stages)
            sdS_layout = self._smem_layout(self.tile_m, self.tile_n, atom_cols=self.tile_n // 2)
        sStat_layout = cute.make_layout((self.tile_m, self.q_stages))
        sStatD_layout = cute.make_layout((self.tile_m, self.do_stages))
        if const_expr(self.cfg.stat_stage_rows != self.tile_m):
            # each stage 128-byte aligned for its TMA load (tile_m 80: stages of 96 rows)
            sStat_layout = cute.make_layout((self.tile_m, self.q_stages), stride=(1, self.cfg.stat_stage_rows))
            sStatD_layout = cute.make_layout((self.tile_m, self.do_stages), stride=(1, self.cfg.stat_stage_rows))
        # dQ staging tile (fp32), rows padded against bank conflicts (one bulk reduce-add per row).
        sdQ_layout = cute.make_layout((self.tile_m, self.hdim), stride=(self.hdim + self.cfg.dq_row_pad, 1))

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        q_stage_layout = cute.select(sQ_layout, mode=[0, 1])
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, q_stage_layout, (self.tile_m, self.hdim))
        do_stage_layout = cute.select(sdO_layout, mode=[0, 1])
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(load_op, mdO, do_stage_layout, (self.tile_m, self.hdim_v))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, sKV_layout, (self.tile_n, self.hdim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, sV_layout, (self.tile_n, self.hdim_v))
        stat_stage = cute.make_layout((self.tile_m,))
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(load_op, mLSE2, stat_stage, (self.tile_m,))
        tma_atom_D, tma_D = cpasync.make_tiled_tma_atom(load_op, mD, stat_stage, (self.tile_m,))
        # dK, dV leave through K's and V's smem (free after the main loop) and a TMA store; packed
        # (varlen_k): by predicated stores of the sequence's rows from there (no TMA atom).
        tma_atom_dK, tma_dK, tma_atom_dV, tma_dV = None, mdK, None, mdV
        if const_expr(not self.varlen_k and not self.cfg.dkv_accum):
            store_op = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(store_op, mdK, sKV_layout, (self.tile_n, self.hdim))
            tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(store_op, mdV, sV_layout, (self.tile_n, self.hdim_v))
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, q_stage_layout) + self.tile_m * 4
        self.tma_bytes_do = cute.size_in_bytes(self.dtype, do_stage_layout) + self.tile_m * 4
        self.tma_bytes_kv = cute.size_in_bytes(self.dtype, sKV_layout) + cute.size_in_bytes(self.dtype, sV_layout)

        delta_own = cfg.sink_delta and not cfg.sink_delta_in_row_pad
        # sink_delta in the row pad: the last row's pad lies past the layout's cosize; allocate it too
        dq_pad_tail = cfg.dq_row_pad if cfg.sink_delta and cfg.sink_delta_in_row_pad else 0

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStatD_layout)], 128]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout) + dq_pad_tail], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            # P^T (split_headdim; P with transposed_dkv; otherwise a token 128 B).
            sPt: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout) if self.split_hd or self.dkv_t else 64], 1024
            ]
            if const_expr(delta_own):  # sink_delta without a dQ row pad to hold the partial sums (whole-tile configs)
                sDelta: cute.struct.Align[cute.struct.MemRange[
                    Float32, self.tile_m * cfg.sink_delta_slots * cfg.sink_delta_stages], 128]

        assert SharedStorage.size_in_bytes() <= capacity(90).smem_per_block, SharedStorage.size_in_bytes()


        # All CTAs in gridDim.x (batch x heads may exceed gridDim.y/z's 65535): flash4.launch.bwd_grid.
        # The bundles' fields flatten in the order of the kernel's parameters before issue 21's bundling.
        gmem = BwdTensors(tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_D, mdQacc, tma_dK, tma_dV, mdQsem, mExact,
                          mLSEhi, mLSElo, mDelta)
        atoms = BwdTmaAtoms(tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D, tma_atom_dK,
                            tma_atom_dV)
        layouts = BwdSmemLayouts(sQ_layout, sKV_layout, sV_layout, sdO_layout, sdS_layout, sStat_layout, sdQ_layout)
        self.kernel(
            gmem, SeqParams(mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK), HeadSplit(mdKVsem, heads_per_cta), atoms,
            softmax_scale, max_seqlen_k, MaskParams(window_left, window_right), softcap, layouts,
            BwdTiledMmas(mma_sdp, mma_dkv, mma_dv, mma_dq), SharedStorage,
        ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        gmem: BwdTensors,
        seq_params: SeqParams,
        head_split: HeadSplit,
        atoms: BwdTmaAtoms,
        softmax_scale: Float32,
        max_seqlen_k: Optional[Int32],
        mask: MaskParams,
        softcap: Float32,
        layouts: BwdSmemLayouts,
        mmas: BwdTiledMmas,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in atoms.loads():
                cpasync.prefetch_descriptor(atom)
        allocator = SmemAllocator()
        storage = allocator.allocate(SharedStorage)
        make_pipe = tma_pipeline_factory(self.num_mma_threads)
        pipes = BwdPipelines(
            kv=make_pipe(barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, tx_count=self.tma_bytes_kv),
            q=make_pipe(barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, tx_count=self.tma_bytes_q),
            do=make_pipe(barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.do_stages,
                         tx_count=self.tma_bytes_do),
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(layouts.q.outer, swizzle=layouts.q.inner)
        sdO = storage.sdO.get_tensor(layouts.do.outer, swizzle=layouts.do.inner)
        sK = storage.sK.get_tensor(layouts.k.outer, swizzle=layouts.k.inner)
        sV = storage.sV.get_tensor(layouts.v.outer, swizzle=layouts.v.inner)
        sdS = storage.sdS.get_tensor(layouts.ds.outer, swizzle=layouts.ds.inner)
        sP = (storage.sPt.get_tensor(layouts.ds.outer, swizzle=layouts.ds.inner)
              if const_expr(self.split_hd or self.dkv_t) else None)
        sLSE = storage.sLSE.get_tensor(layouts.lse)
        if const_expr(self.cfg.stat_stage_rows != self.tile_m):
            sD = storage.sD.get_tensor(cute.make_layout((self.tile_m, self.do_stages),
                                                        stride=(1, self.cfg.stat_stage_rows)))
        else:
            sD = storage.sD.get_tensor(cute.make_layout((self.tile_m, self.do_stages)))
        sdQ = storage.sdQ.get_tensor(layouts.dq)
        sDelta = None
        if const_expr(self.cfg.sink_delta):
            slots = self.cfg.sink_delta_slots
            if const_expr(self.cfg.sink_delta_in_row_pad):
                # columns [hdim, hdim + slots) of the dQ staging rows: the row pad, which neither the
                # dQ staging nor the store warp's per-row bulk adds touch
                sDelta = cute.make_tensor(sdQ.iterator + self.hdim, cute.make_layout(
                    (self.tile_m, slots), stride=(self.hdim + self.cfg.dq_row_pad, 1)))
            elif const_expr(self.cfg.sink_delta_db):  # (tile_m, slots, step parity)
                sDelta = storage.sDelta.get_tensor(cute.make_layout((self.tile_m, slots, 2),
                                                                    stride=(slots, 1, self.tile_m * slots)))
            else:
                sDelta = storage.sDelta.get_tensor(cute.make_layout((self.tile_m, slots), stride=(slots, 1)))
        smem = BwdSmem(q=sQ, k=sK, v=sV, do=sdO, ds=sdS, p=sP, lse=sLSE, dpsum=sD, dq=sdQ, delta=sDelta)

        sched = BwdSchedule.create(self.cfg, gmem.q, gmem.k, seq_params, max_seqlen_k, head_split.heads_per_cta, mask)
        roles = partial(self.warp_roles, gmem, atoms, smem, mmas, pipes, sched, ScoreArgs(softmax_scale, softcap),
                        head_split.dkv_sem, warp_idx)
        if const_expr(self.dynamic_seqlen_k):
            # Key tiles past this sequence's keys: nothing to compute, nothing to store (the rows
            # there are the next sequence's, or outside every sequence and zeroed by the host).
            if sched.n_block * self.tile_n < sched.seq.seqlen_k:
                roles()
        else:
            roles()

    @cute.jit
    def warp_roles(self, gmem, atoms, smem, mmas, pipes, sched, score_args, dkv_sem, warp_idx):
        """The warp-specialized work of one CTA (the class docstring's roles). gmem: BwdTensors;
        atoms: BwdTmaAtoms; smem: BwdSmem; mmas: BwdTiledMmas; pipes: BwdPipelines; sched:
        BwdSchedule; score_args: ScoreArgs; dkv_sem: HeadSplit.dkv_sem."""
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            # 24 registers: dkv_accum re-derives the head split here rather than keep the prologue's
            # (kept, they spill in these warps: compile check, varlen deterministic)
            producer_sched = sched.refreshed()
            if warp_idx == 0:
                self.load(gmem, atoms, smem, pipes, producer_sched)
            if warp_idx == 1:
                self.store_dQ(gmem.dq_accum, gmem.dq_sem, smem.dq, producer_sched, gmem.delta, smem.delta)
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            tidx = cute.arch.thread_idx()[0] - THREADS_PER_WG
            self.mma(gmem, atoms, smem, mmas, pipes, sched, score_args, dkv_sem, tidx)

    @cute.jit
    def load(self, gmem, atoms, smem, pipes, sched):
        """Warp 0: K and V of the tile once; then per step Q (+ LSE * log2 e) and dO (+ D)."""
        one = cute.make_layout(1)
        seq = sched.seq
        gK = cute.local_tile(seq.k_view(gmem.k, sched.head_kv), (self.tile_n, self.hdim), (sched.n_block, 0))
        gV = cute.local_tile(seq.k_view(gmem.v, sched.head_kv), (self.tile_n, self.hdim_v), (sched.n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(atoms.k, 0, one, cute.group_modes(smem.k, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(atoms.v, 0, one, cute.group_modes(smem.v, 0, 2), cute.group_modes(gV, 0, 2))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipes.kv.producer_acquire(kv_state)
        cute.copy(atoms.k, tKgK, tKsK, tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))
        cute.copy(atoms.v, tVgV, tVsV, tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))

        num_m = sched.m_block_max - sched.m_block_min
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        for step in cutlass.range(sched.num_steps, unroll=1):
            m_block, head = sched.step_coords(step, num_m)
            gQ = cute.local_tile(seq.q_view(gmem.q, head), (self.tile_m, self.hdim), (m_block, 0))
            gdO = cute.local_tile(seq.q_view(gmem.do, head), (self.tile_m, self.hdim_v), (m_block, 0))
            gLSE = cute.local_tile(seq.q_padded_view(gmem.lse_log2, head), (self.tile_m,), (m_block,))
            gD = cute.local_tile(seq.q_padded_view(gmem.dpsum, head), (self.tile_m,), (m_block,))
            tQsQ, tQgQ = cpasync.tma_partition(atoms.q, 0, one, cute.group_modes(smem.q, 0, 2), cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(atoms.do, 0, one, cute.group_modes(smem.do, 0, 2),
                                                   cute.group_modes(gdO, 0, 2))
            tLsL, tLgL = cpasync.tma_partition(atoms.lse_log2, 0, one, cute.group_modes(smem.lse, 0, 1),
                                               cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(atoms.dpsum, 0, one, cute.group_modes(smem.dpsum, 0, 1),
                                               cute.group_modes(gD, 0, 1))
            pipes.q.producer_acquire(state)
            bar_q = pipes.q.producer_get_barrier(state)
            cute.copy(atoms.q, tQgQ, tQsQ[None, state.index], tma_bar_ptr=bar_q)
            cute.copy(atoms.lse_log2, tLgL, tLsL[None, state.index], tma_bar_ptr=bar_q)
            do_state = state
            if const_expr(self.do_stages != self.q_stages):
                do_state = stage_state(step, self.do_stages, producer=True)
            pipes.do.producer_acquire(do_state)
            bar_do = pipes.do.producer_get_barrier(do_state)
            cute.copy(atoms.do, tdOgdO, tdOsdO[None, do_state.index], tma_bar_ptr=bar_do)
            cute.copy(atoms.dpsum, tDgD, tDsD[None, do_state.index], tma_bar_ptr=bar_do)
            state = next_state(state)

    @cute.jit
    def store_dQ(self, mdQacc, mdQsem, sdQ, sched, mDelta=None, sDelta=None):
        """Warp 1: per step, bulk fp32 reduce-add of the staged dQ tile into the accumulator (one per
        row, or one for the whole tile: BwdConfig.dq_whole_tile). sink_delta: also the step's
        D = sum_j P dP of each query row (add_delta), in the same turn.

        Deterministic mode orders the adds of one dQ tile by n_block: the CTA of key block n waits
        until the tile's semaphore reads n (every key block below n has added), adds, waits for
        its add to complete, then releases n + 1. The key blocks that touch a query block are
        0, 1, ... (a window: from the first of its band, BwdSchedule.dq_turn), so the chain has no
        gap; lower n_block CTAs launch first (n_block is the fastest grid dimension), so it cannot
        deadlock. Packed batches: the chain of a sequence's query tile m runs on its padded tile
        (BwdSchedule.tile_index), its key blocks 0, 1, ... of that sequence.
        """
        if const_expr(self.cfg.dq_handoff_per_wg):
            self.store_dQ_per_wg(mdQacc, sdQ, sched)
            return
        lane = cute.arch.lane_idx()
        num_m = sched.m_block_max - sched.m_block_min
        row_bytes = self.hdim * 4
        for step in cutlass.range(sched.num_steps, unroll=1):
            m_block, head = sched.step_coords(step, num_m)
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQFull), number_of_threads=self.num_mma_threads + 32)
            gdQ = cute.local_tile(sched.seq.q_padded_view(mdQacc, head), (self.tile_m, self.hdim), (m_block, 0))
            tile, tile_batch = sched.tile_index(m_block)
            sem_ptr = mdQsem[None, head, tile_batch].iterator + tile
            if const_expr(self.cfg.deterministic):
                turn = sched.dq_turn(m_block)
                if lane == 0:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                    while turn != seen:
                        seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                cute.arch.sync_warp()
            if const_expr(self.cfg.sink_delta):
                self.add_delta(mDelta, delta_buffer(sDelta, step, self.cfg.sink_delta_db), head, m_block, lane, sched)
            if const_expr(self.cfg.dq_whole_tile or self.cfg.dq_swapab):
                # unpadded staging tile = the accumulator's contiguous tile_m x headdim block (dq_swapab:
                # row-major, the dQ^T values staged transposed)
                if lane == 0:
                    bulk_reduce_add_f32(gdQ[0, None].iterator, sdQ[0, None].iterator, self.tile_m * row_bytes)
            else:
                for r in cutlass.range_constexpr(self.tile_m // 32):
                    row = r * 32 + lane
                    bulk_reduce_add_f32(gdQ[row, None].iterator, sdQ[row, None].iterator, row_bytes)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.cfg.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds are done in global memory
                if const_expr(self.cfg.sink_delta):
                    cute.arch.fence_acq_rel_gpu()  # this lane's D adds before the release below
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.atomic_add(sem_ptr, Int32(1), sem="release", scope="gpu")
            else:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=self.num_mma_threads + 32)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def add_delta(self, mDelta, sDelta, head, m_block, lane, sched):
        """sink_delta, warp 1 after dQFull: each query row's partial sums of D = sum_j P dP staged by
        the consumer warps (sDelta (tile_m, slots)), summed in slot order and added to the row's fp32
        D (red.global.add; deterministic: inside the tile's dQ turn, so every row's sum over the key
        blocks is taken in n_block order). Rows past seqlen_q add 0 (their P is 0) to padded rows."""
        gDelta = cute.local_tile(sched.seq.q_padded_view(mDelta, head), (self.tile_m,), (m_block,))
        for r in cutlass.range(self.tile_m // 32, unroll=1):  # unrolled, the loads spill (24 registers)
            row = r * 32 + lane
            total = sDelta[row, 0]
            for slot in cutlass.range_constexpr(1, self.cfg.sink_delta_slots):
                total = total + sDelta[row, slot]
            red_add_f32(gDelta.iterator + row, total)

    @cute.jit
    def store_dQ_per_wg(self, mdQacc, sdQ, sched):
        """Warp 1 with BwdConfig.dq_handoff_per_wg: per step and consumer warpgroup w, wait for w's
        half of the staged tile (dQFullWG0 + w), reduce-add it onto its half of the accumulator tile
        (the per-warpgroup accumulator order keeps each half contiguous in both), then free each
        half as soon as the bulk copy has read it (dQEmptyWG0 + w; the bulk groups complete in
        order). Not deterministic (BwdConfig asserts it)."""
        lane = cute.arch.lane_idx()
        num_m = sched.m_block_max - sched.m_block_min
        half = self.tile_m * self.hdim // self.num_wg_mma  # fp32 elements per warpgroup
        threads = THREADS_PER_WG + 32
        for step in cutlass.range(sched.num_steps, unroll=1):
            m_block, head = sched.step_coords(step, num_m)
            gdQ = cute.local_tile(sched.seq.q_padded_view(mdQacc, head), (self.tile_m, self.hdim), (m_block, 0))
            for wg in cutlass.range_constexpr(self.num_wg_mma):
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQFullWG0) + wg, number_of_threads=threads)
                if lane == 0:
                    bulk_reduce_add_f32(gdQ[0, None].iterator + wg * half, sdQ[0, None].iterator + wg * half, half * 4)
                cute.arch.cp_async_bulk_commit_group()
            for wg in cutlass.range_constexpr(self.num_wg_mma):
                cute.arch.cp_async_bulk_wait_group(self.num_wg_mma - 1 - wg, read=True)
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + wg, number_of_threads=threads)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def mma(self, gmem, atoms, smem, mmas, pipes, sched, score_args, dkv_sem, tidx):
        """Consumer warpgroups: the config's BwdStep (bwd_step.py) for every (query head, m_block) of
        the schedule, then the dK, dV epilogue. tidx: the thread's index among the consumer threads."""
        step_fn = step_class(self.cfg)(self, gmem, smem, mmas, pipes, sched, tidx)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipes.kv.consumer_wait(kv_state)
        if const_expr(self.ragged_k and not self.cfg.no_tail_guard):  # (no_tail_guard: A/B only)
            step_fn.zero_kv_tail()  # the key-edge tile: K, V rows >= seqlen_k -> 0
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        scales = StepScales(score_args.softmax_scale,
                            *score.device_scales(score_args.softmax_scale, score_args.softcap, self.cfg.softcap))
        # The m_blocks [m_block_min, m_mask_end) run with the element mask compiled in, the rest
        # without: causal, the first m_blocks of each head (those crossing the diagonal); and every
        # m_block of the CTA whose key tile crosses seqlen_k (the sequence's). Keys past seqlen_k are masked
        # explicitly, never left to TMA's zero fill (a zero K row scores 0, and 2^(0 - LSE)
        # overflows when every real score of the row is very negative). Queries past seqlen_q need
        # no mask: their LSE is +inf (flash4.backward pads it), so P = 0 there (their Q and dO rows
        # are zeros: TMA clipping, or zero_q_tail with a packed / seqused layout).
        # A window adds a third run: the m_blocks [m_left, m_block_max) that cross its left edge.
        bounds = sched.mask_phase_bounds()
        step = Int32(0)
        for h_in_group in cutlass.range(sched.num_heads, unroll=1):
            head = sched.head0 + h_in_group
            for phase in cutlass.range_constexpr(sched.phases()):
                lo, hi, masked = sched.phase_range(phase, bounds)
                for m_block in cutlass.range(lo, hi, unroll=1):
                    state = step_fn.mma_one_m_block(m_block, head, step, state, masked, scales)
                    step += 1
        if sched.num_steps > 0:
            step_fn.wait_dq_drained()
        if const_expr(self.cfg.dkv_accum):
            self.epilogue_dKV_accum(step_fn.acc_dK, step_fn.acc_dV, gmem, mmas, tidx, sched, dkv_sem)
        else:
            self.epilogue_dKV(step_fn.acc_dK, step_fn.acc_dV, gmem, atoms, smem, mmas, tidx, sched)

    @cute.jit
    def epilogue_dKV_accum(self, acc_dK, acc_dV, gmem, mmas, tidx, sched, dkv_sem):
        """dkv_accum: add the fp32 dK, dV of this CTA's query heads into the accumulators gmem.dk,
        gmem.dv (red.global.add.v2.f32 straight from the registers: two adjacent columns per
        instruction), rows past seqlen_k skipped. Deterministic: the CTAs of one key tile add in
        split order 0, 1, ... (each waits until the tile's semaphore in dkv_sem reads its split,
        adds, fences, releases split + 1); lower splits have lower blockIdx.x (flash4.launch.bwd_grid),
        so the chain cannot deadlock and every element's fp32 sum is taken in the same order on
        every call. The split and the tile's index are decoded again here (BwdSchedule.decode
        fresh): nothing of the prologue's decode stays live across the main loop."""
        seq, n_block, head_kv = sched.seq, sched.n_block, sched.head_kv
        valid_rows = seq.seqlen_k - n_block * self.tile_n
        if const_expr(self.cfg.deterministic):
            coords = sched.decode(fresh=True)
            split = coords.split
            sem_ptr = dkv_sem.iterator + coords.kv_tile
            if tidx == 0:
                seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                while seen != split:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
        for acc, mX, mma, hdim in ((acc_dK, gmem.dk, mmas.dkv, self.hdim), (acc_dV, gmem.dv, mmas.dv, self.hdim_v)):
            thr = mma.get_slice(tidx)
            if const_expr(self.dkv_t):
                # dK^T, dV^T (head dim x keys): no two gmem-adjacent elements in a thread's
                # fragment, so one scalar red.global.add.f32 per element.
                gX = cute.local_tile(seq.k_view(mX, head_kv), (self.tile_n, hdim), (n_block, 0))
                tXgX = thr.partition_C(transpose_view(gX))
                tXcX = thr.partition_C(cute.make_identity_tensor((hdim, self.tile_n)))
                for i2 in cutlass.range_constexpr(cute.size(acc) // 2):  # (two loops: a flat one of 72 warns)
                    for i1 in cutlass.range_constexpr(2):
                        i = 2 * i2 + i1
                        if tXcX[i][1] < valid_rows:
                            red_add_f32(tXgX.iterator + cute.crd2idx(i, tXgX.layout), acc[i])
            else:
                tXgX = thr.partition_C(cute.local_tile(seq.k_view(mX, head_kv), (self.tile_n, hdim), (n_block, 0)))
                tXcX = thr.partition_C(cute.make_identity_tensor((self.tile_n, hdim)))
                # element i, i + 1 (i even): the accumulator's two adjacent columns of one row
                for i in cutlass.range_constexpr(0, cute.size(acc), 2):
                    if tXcX[i][0] < valid_rows:
                        red_add_f32x2(tXgX.iterator + cute.crd2idx(i, tXgX.layout), acc[i], acc[i + 1])
        if const_expr(self.cfg.deterministic):
            cute.arch.fence_acq_rel_gpu()  # this thread's adds before the release below
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
            if tidx == 0:
                cute.arch.atomic_add(sem_ptr, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def epilogue_dKV(self, acc_dK, acc_dV, gmem, atoms, smem, mmas, tidx, sched):
        """dK, dV: registers -> 16-bit -> K's / V's smem (stmatrix) -> TMA store; rows past seqlen_k
        are clipped by the TMA unit. gmem.dk, gmem.dv: the TMA views of dK, dV (seqlen_k, headdim,
        nheads_k, batch). varlen_k: the packed tensors (total_k, headdim, nheads_k, 1) and all
        consumer threads store the rows < seqlen_k - n_block * tile_n (the rest belong to the next
        sequence)."""
        seq, n_block, head_kv = sched.seq, sched.n_block, sched.head_kv
        sK, sV = smem.k, smem.v
        # Every consumer warpgroup has finished its GEMMs (wait_group(0) ends each step): K, V are free.
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.dkv_t, num_matrices=4),
                                       self.dtype)
        r2s = cute.make_tiled_copy_C(stmatrix, mmas.dkv).get_slice(tidx)
        r2s_v = r2s if const_expr(self.hdim_v == self.hdim) else cute.make_tiled_copy_C(stmatrix, mmas.dv).get_slice(tidx)
        for acc, sX, r2s in ((acc_dK, sK, r2s), (acc_dV, sV, r2s_v)):
            rX = cute.make_rmem_tensor(acc.shape, self.dtype)
            rX.store(acc.load().to(self.dtype))
            # transposed_dkv: dK^T / dV^T (d x keys) into the keys x d tile, transposing stmatrix
            cute.copy(r2s, r2s.retile(rX), r2s.partition_D(transpose_view(sX) if const_expr(self.dkv_t) else sX))
        if const_expr(self.varlen_k):
            # Generic-proxy reads of the staged tiles: the barrier alone orders them.
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
            valid_rows = seq.seqlen_k - n_block * self.tile_n
            for mX, sX, hdim in ((gmem.dk, sK, self.hdim), (gmem.dv, sV, self.hdim_v)):
                gX = cute.local_tile(seq.k_view(mX, head_kv), (self.tile_n, hdim), (n_block, 0))
                store_rows_predicated(sX, gX, valid_rows, tidx, self.num_mma_threads)
        else:
            cute.arch.fence_view_async_shared()  # smem writes -> visible to the TMA (async proxy)
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
            if tidx < 32:
                stores = []
                for atom, mX, sX, hdim in ((atoms.dk, gmem.dk, sK, self.hdim), (atoms.dv, gmem.dv, sV, self.hdim_v)):
                    gX = cute.local_tile(seq.k_view(mX, head_kv), (self.tile_n, hdim), (n_block, 0))
                    tXsX, tXgX = cpasync.tma_partition(
                        atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
                    )
                    stores.append((atom, tXsX, tXgX))
                # One lane issues the stores and their commit: a bulk tensor copy is issued by every
                # thread that executes it (the DSL elects a lane for TMA loads, not for stores), so
                # without the election each of the warp's 32 lanes stored both whole tiles. The wait
                # stays warp-wide: a lane without bulk groups returns at once.
                with cute.arch.elect_one():
                    for atom, tXsX, tXgX in stores:
                        cute.copy(atom, tXsX, tXgX)
                    cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
