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

Three work splits between the consumer warpgroups (config.BwdConfig.split_headdim, transposed_dkv):
  * headdim <= 128: each warpgroup owns 64 keys (tile_n = 128) and accumulates their dK, dV over
    the full headdim in registers; P^T, dS^T feed dV, dK from registers (RS).
  * headdim > 128 (256): dK, dV over the full headdim would not fit 240 registers. Both warpgroups share
    64 keys (tile_n = 64); each computes S^T, dP^T for half of the queries, stages P^T and dS^T in
    smem, and accumulates dK, dV, dQ for half of headdim (SS wgmmas).
  * headdim 192 and (192, 128) (transposed_dkv, flash-attn-4's sm90 shape; `mma_t`): 64 queries x
    96 keys per step, query-major S = Q K^T and dP = dO V^T with each warpgroup owning a 48-key
    half; dV^T = dO^T P and dK^T = Q^T dS put the head dim on the wgmma M axis (192 x 48 per
    warpgroup fits the registers that 96 x 192 would not), both operands from smem (P, dS staged
    in smem, one buffer each); dQ = dS K split over head-dim halves. dO may have fewer stages
    than Q (d192: 1). The epilogue stores dK^T / dV^T with transposing stmatrix.
dK, dV leave through K's and V's smem and a TMA store.

Variable-length (packed) batches (config.BwdConfig.varlen_q / varlen_k / seqused_q / seqused_k;
host side flash4.varlen): Q, dO (1, total_q, H, D) and K, V, dK, dV (1, total_k, Hk, D) have a
batch mode of size 1 and the CTA reads its sequence's offsets and lengths from cu_seqlens /
seqused (kernels/common/seqinfo.py); every block range and mask takes that sequence's seqlen_q /
seqlen_k. The per-row statistics (LSE * log2 e, D), the dQ accumulator and the per-tile flags
(dQ semaphores, exact-path flags) live in the padded layout: sequence b starts at row
padded_offset(b), a multiple of tile_m, so its query tile m is padded tile padded_offset / tile_m
+ m (the deterministic semaphore chain runs per padded tile as in the dense case). The grid is
sized by max_seqlen_k (a host int): CTAs whose key tile starts past their sequence's seqlen_k exit
at once. Queries past seqlen_q need no mask (their padded LSE is +inf: P = 0, D = 0); keys past
seqlen_k are masked in the key-edge CTA as in the dense case. Packed dK, dV rows past seqlen_k
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
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from flash4.arch import capacity
from flash4.constants import LOG2E, THREADS_PER_WG
from flash4.kernels.common.barriers import NamedBarrierBwd
from flash4.kernels.common.dq_accum import make_dq_tiled_mma, store_accum_order
from flash4.kernels.common.exp2 import exp2_hw, fma_rn
from flash4.kernels.common import geometry
from flash4.kernels.common.gemm import wgmma
from flash4.kernels.common.dsl import DSL_DTYPES
from flash4.kernels.common.pipeline import next_state, tma_pipeline_factory
from flash4.kernels.common.layout import acc_mn_view, acc_to_frgA_layout, select_modes, transpose_view
from flash4.kernels.common.seqinfo import SeqInfo, store_rows_predicated

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


def stage_state(step, stages: int, producer: bool):
    """The pipeline state of a `stages`-deep pipeline at step `step` (every step takes one stage),
    derived from the step count instead of carried through the loop (the dO pipeline of the
    transposed_dkv path when its depth differs from Q's)."""
    phase = (step // stages) % 2
    if producer:
        phase = phase ^ 1
    return pipeline.PipelineState(stages, Int32(step), Int32(step % stages), Int32(phase))


@dsl_user_op
def block_idx_x_fresh(*, loc=None, ip=None) -> Int32:
    """blockIdx.x read by an opaque (side-effecting) instruction: the compiler cannot merge it with
    an earlier read, so what is derived from it is recomputed where used instead of being held in
    a register from the kernel's start."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %ctaid.x;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _half_split_atom_cols(cols: int):
    """None if the widest swizzle atom for `cols` 16-bit columns also tiles each half (cols/2);
    else cols/2, so the atom is chosen for the half (e.g. 96 -> 64 B atom of 32 columns does not
    tile 48 -> choose for 48: 32 B atom of 16 columns)."""
    width = next(w for w in (64, 32, 16, 8) if cols % w == 0)  # 128/64/32/16 B swizzle, 16-bit elements
    half = cols // 2
    return None if half % width == 0 or width % half == 0 else half


class FlashAttentionBackwardSm90:
    """Warp roles (threads 0-127 producer warpgroup, 128-383 two consumer warpgroups):
      * warp 0: TMA loads: K and V of the tile once; then per step Q (+ LSE*log2e) and dO (+ D).
      * warp 1: per step, waits for the consumers' dQ tile in smem and issues one bulk fp32
        reduce-add per row into the global dQ accumulator; frees the tile once it has been read.
      * consumer warpgroup w (64 keys each, or half of headdim): the five GEMMs above and the
        softmax gradient.
    Pipelines (producer -> consumers, one arrive per consumer warp on release):
      pipeline_kv (1 stage): K, V.  pipeline_q / pipeline_do (q_stages): Q + LSE, dO + D.
    Named barriers: dQFull (consumers -> warp 1: tile staged), dQEmpty (warp 1 -> consumers:
    tile read), dS (both consumer warpgroups: dS^T (and P^T) staged before the GEMMs read them),
    Epilogue (both consumer warpgroups: K/V smem free, then dK/dV staged for the TMA store).
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
        wide_layout = cfg.varlen_q or cfg.varlen_k or cfg.seqused_q or cfg.seqused_k or cfg.local
        self.dv_after_ds = not self.split_hd and not (max(cfg.headdim, cfg.hdim_v) >= 128 and wide_layout)
        assert self.hdim % 16 == 0 and (self.hdim // 2) % 16 == 0
        assert self.hdim_v % 16 == 0 and (self.hdim_v // 2) % 16 == 0
        # Sequence layout (all static): packed Q-side / K-side tensors, per-sequence lengths.
        self.varlen_q, self.varlen_k = cfg.varlen_q, cfg.varlen_k
        # seqlen_k differs per sequence: the grid is sized by max_seqlen_k, CTAs past it exit.
        self.dynamic_seqlen_k = cfg.dynamic_seqlen_k

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
        (1, H, total_q), padded_rows >= flash4.varlen.padded_total (the kernel touches only the
        tiles of each sequence). varlen_k: K, V, dK, dV (1, total_k, Hk, D). dkv_accum: dK, dV are
        fp32 accumulators of the same shapes, zeroed; the kernel adds its dK, dV into them."""
        cfg = self.cfg
        assert (mCuSeqlensQ is not None) == cfg.varlen_q and (mCuSeqlensK is not None) == cfg.varlen_k
        assert (mSeqUsedQ is not None) == cfg.seqused_q and (mSeqUsedK is not None) == cfg.seqused_k
        assert (max_seqlen_k is not None) == self.dynamic_seqlen_k
        assert (mdKVsem is not None) == (cfg.dkv_accum and cfg.deterministic)
        mQ, mK, mV, mdO, mdK, mdV = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSE2, mD = [select_modes(t, [2, 1, 0]) for t in (mLSE2, mD)]  # (seqlen_q_pad, nheads, batch)
        mdQacc = select_modes(mdQacc, [2, 3, 1, 0])  # (seqlen_q_pad, headdim, nheads, batch)
        mdQsem, mExact = [select_modes(t, [2, 1, 0]) for t in (mdQsem, mExact)]  # (num_m_blocks, nheads, batch)
        mLSEhi, mLSElo = [select_modes(t, [2, 1, 0]) for t in (mLSEhi, mLSElo)]  # (seqlen_q, nheads, batch)

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

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStatD_layout)], 128]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            # P^T (split_headdim; P with transposed_dkv; otherwise a token 128 B).
            sPt: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout) if self.split_hd or self.dkv_t else 64], 1024
            ]

        assert SharedStorage.size_in_bytes() <= capacity(90).smem_per_block, SharedStorage.size_in_bytes()

        # All CTAs in gridDim.x (batch x heads may exceed gridDim.y/z's 65535): flash4.launch.bwd_grid.
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_D, mdQacc, tma_dK, tma_dV, mdQsem, mExact, mLSEhi, mLSElo,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mdKVsem, heads_per_cta,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D, tma_atom_dK, tma_atom_dV,
            softmax_scale, max_seqlen_k, window_left, window_right, softcap, sQ_layout, sKV_layout, sV_layout, sdO_layout,
            sdS_layout, sStat_layout, sdQ_layout, mma_sdp, mma_dkv, mma_dv, mma_dq, SharedStorage,
        ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
        mdQsem: cute.Tensor, mExact: cute.Tensor, mLSEhi: cute.Tensor, mLSElo: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
        mdKVsem: Optional[cute.Tensor], heads_per_cta: Int32,
        tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
        tma_atom_dO: cute.CopyAtom, tma_atom_LSE: cute.CopyAtom, tma_atom_D: cute.CopyAtom,
        tma_atom_dK: Optional[cute.CopyAtom], tma_atom_dV: Optional[cute.CopyAtom],
        softmax_scale: Float32, max_seqlen_k: Optional[Int32], window_left: Int32, window_right: Int32,
        softcap: Float32,
        sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        sStat_layout: cute.Layout, sdQ_layout: cute.Layout,
        mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dv: cute.TiledMma, mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D):
                cpasync.prefetch_descriptor(atom)
        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        make_pipe = tma_pipeline_factory(self.num_mma_threads)
        pipeline_kv = make_pipe(barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, tx_count=self.tma_bytes_kv)
        pipeline_q = make_pipe(barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, tx_count=self.tma_bytes_q)
        pipeline_do = make_pipe(barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.do_stages, tx_count=self.tma_bytes_do)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sPt = (storage.sPt.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
               if const_expr(self.split_hd or self.dkv_t) else None)
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sD = storage.sD.get_tensor(cute.make_layout((self.tile_m, self.do_stages)))
        sdQ = storage.sdQ.get_tensor(sdQ_layout)

        n_block, _, head_kv, batch, head0, num_heads, _ = self.block_coords(mQ, mK, max_seqlen_k, heads_per_cta)
        # dkv_accum's epilogue decodes its split again (no register held across the main loop)
        self.block_coords_again = partial(self.block_coords, mQ, mK, max_seqlen_k, heads_per_cta, fresh=True)
        # This sequence's offsets and lengths (dense: batch index and the tensors' seqlens).
        seq = SeqInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                      tile_m_pad=self.tile_m)
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        self.window = (window_left, window_right) if const_expr(self.cfg.local) else None
        self.softcap = softcap
        m_block_min, m_block_max = geometry.m_block_range(n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                                                          self.causal, self.window)
        if const_expr(self.cfg.local):
            m_block_max = cutlass.max(m_block_max, m_block_min)  # a window's key tile may see no query
        num_steps = (m_block_max - m_block_min) * num_heads  # (query head, m_block) pairs
        self.mdKVsem = mdKVsem

        roles = partial(
            self.warp_roles, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mdQsem, mExact, mLSEhi, mLSElo,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D, tma_atom_dK, tma_atom_dV,
            softmax_scale, sQ, sK, sV, sdO, sdS, sPt, sLSE, sD, sdQ, mma_sdp, mma_dkv, mma_dv, mma_dq,
            pipeline_kv, pipeline_q, pipeline_do, warp_idx, seq, n_block, head_kv, head0, num_heads,
            m_block_min, m_block_max, num_steps)
        if const_expr(self.dynamic_seqlen_k):
            # Key tiles past this sequence's keys: nothing to compute, nothing to store (the rows
            # there are the next sequence's, or outside every sequence and zeroed by the host).
            if n_block * self.tile_n < seqlen_k:
                roles()
        else:
            roles()

    @cute.jit
    def warp_roles(self, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mdQsem, mExact, mLSEhi, mLSElo,
                   tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D, tma_atom_dK, tma_atom_dV,
                   softmax_scale, sQ, sK, sV, sdO, sdS, sPt, sLSE, sD, sdQ, mma_sdp, mma_dkv, mma_dv, mma_dq,
                   pipeline_kv, pipeline_q, pipeline_do, warp_idx, seq, n_block, head_kv, head0, num_heads,
                   m_block_min, m_block_max, num_steps):
        """The warp-specialized work of one CTA (the class docstring's roles)."""
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if const_expr(self.cfg.dkv_accum):
                # 24 registers: re-derive the head split here rather than keep the prologue's
                # (kept, they spill in these warps: compile check, varlen deterministic)
                _, _, _, _, head0, num_heads, _ = self.block_coords_again()
                num_steps = (m_block_max - m_block_min) * num_heads
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, mLSE2, mD, sQ, sK, sV, sdO, sLSE, sD,
                          tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D,
                          pipeline_kv, pipeline_q, pipeline_do, n_block, head_kv, seq,
                          head0, num_heads, m_block_min, m_block_max, num_steps)
            if warp_idx == 1:
                self.store_dQ(mdQacc, mdQsem, sdQ, n_block, seq, head0, num_heads,
                              m_block_min, m_block_max, num_steps)
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            tidx = cute.arch.thread_idx()[0] - THREADS_PER_WG
            mma_fn = self.mma_t if const_expr(self.dkv_t) else self.mma
            mma_fn(mdK, mdV, mExact, mLSEhi, mLSElo, tma_atom_dK, tma_atom_dV, sQ, sK, sV, sdO, sdS, sPt, sLSE, sD, sdQ, mma_sdp, mma_dkv, mma_dv, mma_dq,
                     pipeline_kv, pipeline_q, pipeline_do, softmax_scale, tidx,
                     n_block, head_kv, seq, m_block_min, num_steps, m_block_max, head0, num_heads)

    @cute.jit
    def block_coords(self, mQ, mK, max_seqlen_k, heads_per_cta, fresh=False):
        """blockIdx.x -> (n_block, split, head_kv, batch, head0, num_heads, kv_tile): n_block fastest,
        then the head split (dkv_accum; else 0), head_kv, batch (flash4.launch.bwd_grid; the
        deterministic dQ and dK/dV chains need lower n_blocks and splits to launch first). The CTA
        takes query heads head0 .. head0 + num_heads - 1: all of its KV head's, or heads_per_cta of
        them; kv_tile = its key tile's index among the n_blocks x nheads_k x batch tiles. Per-sequence
        seqlen_k: n_blocks of max_seqlen_k. fresh: decode from an opaque read of blockIdx.x (for the
        epilogue: nothing of the first decode stays live across the main loop)."""
        if const_expr(self.dynamic_seqlen_k):
            num_n_blocks = (max_seqlen_k + (self.tile_n - 1)) // self.tile_n
        else:
            num_n_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        bid = block_idx_x_fresh() if const_expr(fresh) else cute.arch.block_idx()[0]
        group = mQ.shape[2] // mK.shape[2]
        n_block = bid % num_n_blocks
        rest = bid // num_n_blocks
        split = Int32(0)
        head_first = Int32(0)
        num_heads = group
        if const_expr(self.cfg.dkv_accum):
            num_splits = (group + heads_per_cta - 1) // heads_per_cta
            split = rest % num_splits
            rest = rest // num_splits
            head_first = split * heads_per_cta
            num_heads = cutlass.min(heads_per_cta, group - head_first)
        head_kv = rest % mK.shape[2]
        batch = rest // mK.shape[2]
        kv_tile = (batch * mK.shape[2] + head_kv) * num_n_blocks + n_block
        return n_block, split, head_kv, batch, head_kv * group + head_first, num_heads, kv_tile

    def tile_index(self, seq, m_block):
        """(tile, batch) indices of query tile m_block of the sequence in the per-tile flag tensors
        (dQ semaphores, exact flags: (num_tiles, nheads, batch) views); packed: its padded tile."""
        if const_expr(self.varlen_q):
            return seq.padded_offset_q // self.tile_m + m_block, 0
        return m_block, seq.batch

    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE2, mD, sQ, sK, sV, sdO, sLSE, sD,
             tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D,
             pipeline_kv, pipeline_q, pipeline_do, n_block, head_kv, seq,
             head0, num_heads, m_block_min, m_block_max, num_steps):
        one = cute.make_layout(1)
        gK = cute.local_tile(seq.k_view(mK, head_kv), (self.tile_n, self.hdim), (n_block, 0))
        gV = cute.local_tile(seq.k_view(mV, head_kv), (self.tile_n, self.hdim_v), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipeline_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))

        num_m = m_block_max - m_block_min
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        for step in cutlass.range(num_steps, unroll=1):
            h_in_group = step // num_m
            m_block = m_block_min + (step - h_in_group * num_m)
            head = head0 + h_in_group
            gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (m_block, 0))
            gdO = cute.local_tile(seq.q_view(mdO, head), (self.tile_m, self.hdim_v), (m_block, 0))
            gLSE = cute.local_tile(seq.q_padded_view(mLSE2, head), (self.tile_m,), (m_block,))
            gD = cute.local_tile(seq.q_padded_view(mD, head), (self.tile_m,), (m_block,))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_dO, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
            tLsL, tLgL = cpasync.tma_partition(tma_atom_LSE, 0, one, cute.group_modes(sLSE, 0, 1), cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(tma_atom_D, 0, one, cute.group_modes(sD, 0, 1), cute.group_modes(gD, 0, 1))
            pipeline_q.producer_acquire(state)
            bar_q = pipeline_q.producer_get_barrier(state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ[None, state.index], tma_bar_ptr=bar_q)
            cute.copy(tma_atom_LSE, tLgL, tLsL[None, state.index], tma_bar_ptr=bar_q)
            do_state = state
            if const_expr(self.do_stages != self.q_stages):
                do_state = stage_state(step, self.do_stages, producer=True)
            pipeline_do.producer_acquire(do_state)
            bar_do = pipeline_do.producer_get_barrier(do_state)
            cute.copy(tma_atom_dO, tdOgdO, tdOsdO[None, do_state.index], tma_bar_ptr=bar_do)
            cute.copy(tma_atom_D, tDgD, tDsD[None, do_state.index], tma_bar_ptr=bar_do)
            state = next_state(state)

    @cute.jit
    def store_dQ(self, mdQacc, mdQsem, sdQ, n_block, seq, head0, num_heads,
                 m_block_min, m_block_max, num_steps):
        """Warp 1: per step, bulk fp32 reduce-add of the staged dQ tile into the accumulator (one per
        row, or one for the whole tile: BwdConfig.dq_whole_tile).

        Deterministic mode orders the adds of one dQ tile by n_block: the CTA of key block n waits
        until the tile's semaphore reads n (every key block below n has added), adds, waits for
        its add to complete, then releases n + 1. The key blocks that touch a query block are
        0, 1, ..., so the chain has no gap; lower n_block CTAs launch first (n_block is the fastest
        grid dimension), so it cannot deadlock. Packed batches: the chain of a sequence's query
        tile m runs on its padded tile (tile_index), its key blocks 0, 1, ... of that sequence.
        """
        lane = cute.arch.lane_idx()
        num_m = m_block_max - m_block_min
        row_bytes = self.hdim * 4
        for step in cutlass.range(num_steps, unroll=1):
            h_in_group = step // num_m
            m_block = m_block_min + (step - h_in_group * num_m)
            head = head0 + h_in_group
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQFull), number_of_threads=self.num_mma_threads + 32)
            gdQ = cute.local_tile(seq.q_padded_view(mdQacc, head), (self.tile_m, self.hdim), (m_block, 0))
            tile, tile_batch = self.tile_index(seq, m_block)
            sem_ptr = mdQsem[None, head, tile_batch].iterator + tile
            if const_expr(self.cfg.deterministic):
                # The key blocks that add to query block m are n_first(m), n_first(m) + 1, ...: 0 without
                # a window, the first block of its band with one (flash4.geometry.n_block_min, the
                # first n whose m_block_range holds m).
                turn = n_block
                if const_expr(self.cfg.local):
                    turn = n_block - geometry.n_block_min(m_block, seq.seqlen_q, seq.seqlen_k, self.tile_m, self.tile_n,
                                                          self.window)
                if lane == 0:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                    while seen != turn:
                        seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                cute.arch.sync_warp()
            if const_expr(self.cfg.dq_whole_tile):
                # unpadded staging tile = the accumulator's contiguous tile_m x headdim block
                if lane == 0:
                    bulk_reduce_add_f32(gdQ[0, None].iterator, sdQ[0, None].iterator, self.tile_m * row_bytes)
            else:
                for r in cutlass.range_constexpr(self.tile_m // 32):
                    row = r * 32 + lane
                    bulk_reduce_add_f32(gdQ[row, None].iterator, sdQ[row, None].iterator, row_bytes)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.cfg.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds are done in global memory
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.atomic_add(sem_ptr, Int32(1), sem="release", scope="gpu")
            else:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=self.num_mma_threads + 32)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def mma(self, mdK, mdV, mExact, mLSEhi, mLSElo, tma_atom_dK, tma_atom_dV, sQ, sK, sV, sdO, sdS, sPt, sLSE, sD, sdQ, mma_sdp, mma_dkv, mma_dv, mma_dq,
            pipeline_kv, pipeline_q, pipeline_do, softmax_scale, tidx,
            n_block, head_kv, seq, m_block_min, num_steps, m_block_max, head0, num_heads):
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        wg_slice = cute.make_layout(self.num_wg_mma, stride=THREADS_PER_WG)(wg_idx)
        wg_sdp = mma_sdp.get_slice(wg_slice)
        wg_dkv = mma_dkv.get_slice(wg_slice)
        wg_dv = mma_dv.get_slice(wg_slice)
        wg_dq = mma_dq.get_slice(wg_slice)
        thr_sdp = mma_sdp.get_slice(tidx)
        # S^T = K Q^T: A = K (keys x d), B = Q (queries x d); dP^T = V dO^T likewise.
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        # dV += P^T dO: B = dO^T (d x queries); dK += dS^T Q: B = Q^T.
        tdVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sQ)))
        # dQ = dS K: A = dS (queries x keys) = transposed dS^T; B = K^T (d x keys).
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sdS)))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        acc_shape_S = mma_sdp.partition_shape_C((self.tile_n, self.tile_m))
        acc_dV = cute.make_rmem_tensor(mma_dv.partition_shape_C((self.tile_n, self.hdim_v)), Float32)
        acc_dK = cute.make_rmem_tensor(mma_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        frgA_layout = acc_to_frgA_layout(cute.make_layout(acc_shape_S))
        # Coordinates (key row, query col) of this thread's S^T values, and thread 0's (static).
        cS = cute.make_identity_tensor((self.tile_n, self.tile_m))
        tScS = acc_mn_view(thr_sdp.partition_C(cS))
        t0ScS = acc_mn_view(mma_sdp.get_slice(0).partition_C(cS))
        # dS^T registers -> smem (keys x queries), the accumulator's own element order.
        r2s_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), mma_sdp
        ).get_slice(tidx)
        tdSsdS = r2s_dS.partition_D(sdS)  # (CPY, CPY_M, CPY_N, 2)
        if const_expr(self.split_hd):
            # dV += P^T dO, dK += dS^T Q with A from smem: every warpgroup needs all 64 keys x tile_m.
            tdVrPt = wg_dv.make_fragment_A(wg_dv.partition_A(sPt))
            tdKrdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(sdS))
            tPsPt = r2s_dS.partition_D(sPt)
        # dQ accumulator -> fp32 smem tile (queries x d).
        # 64-bit stores (2 adjacent columns of the accumulator stay adjacent in either layout).
        r2s_dQ = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64), mma_dq
        ).get_slice(tidx)
        tdQsdQ = r2s_dQ.partition_D(sdQ)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipeline_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        scale_log2, softcap_scale, inv_scale_log2 = self.score_scales(softmax_scale)
        thread_col0 = tScS[0, 0][1]
        # The m_blocks [m_block_min, m_mask_end) run with the element mask compiled in, the rest
        # without: causal, the first m_blocks of each head (those crossing the diagonal); and every
        # m_block of the CTA whose key tile crosses seqlen_k (the sequence's). Keys past seqlen_k are masked
        # explicitly, never left to TMA's zero fill (a zero K row scores 0, and 2^(0 - LSE)
        # overflows when every real score of the row is very negative). Queries past seqlen_q need
        # no mask: their LSE is +inf (flash4.backward pads it), so P = 0 there.
        # A window adds a third run: the m_blocks [m_left, m_block_max) that cross its left edge.
        m_mask_end, m_left = self.mask_phase_bounds(n_block, seqlen_q, seqlen_k, m_block_min, m_block_max)
        step = Int32(0)
        for h_in_group in cutlass.range(num_heads, unroll=1):
            head = head0 + h_in_group
            for phase in cutlass.range_constexpr(3 if self.cfg.local else 2):
                mask = phase != 1
                lo, hi = m_block_min, m_mask_end
                if const_expr(phase == 1):
                    lo, hi = m_mask_end, m_left
                if const_expr(phase == 2):
                    lo, hi = m_left, m_block_max
                for m_block in cutlass.range(lo, hi, unroll=1):
                    tile, tile_batch = self.tile_index(seq, m_block)
                    exact = mExact[tile, head, tile_batch] != 0
                    pipeline_q.consumer_wait(state)
                    acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                    wgmma(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, state.index], zero_init=True, wg_wait=-1)
                    pipeline_do.consumer_wait(state)
                    acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
                    wgmma(mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, state.index], zero_init=True, wg_wait=1)
                    # P^T = 2^(S^T * scale_log2 - LSE_log2[query]), masked entries 0 (overlaps the dP^T GEMM).
                    # Column (query) outer: each LSE value is read from smem once and used at once.
                    s = acc_mn_view(acc_S)
                    if const_expr(self.cfg.softcap):
                        for i in cutlass.range_constexpr(cute.size(acc_S)):
                            acc_S[i] = cute.math.tanh(acc_S[i] * softcap_scale, fastmath=True)
                    if exact:
                        self.exponent_exact(s, t0ScS, mLSEhi, mLSElo, scale_log2, m_block, thread_col0, head, seq)
                    else:
                        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                            lse_log2 = sLSE[thread_col0 + t0ScS[0, c][1], state.index]
                            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                                s[r, c] = s[r, c] * scale_log2 - lse_log2
                    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                        col = t0ScS[0, c][1]
                        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                            p = exp2_hw(s[r, c])
                            if const_expr(mask):
                                p = geometry.mask_probs_t(tScS, r, col, p, m_block, n_block, seqlen_q, seqlen_k,
                                                          self.tile_m, self.tile_n, self.causal, self.window)
                            s[r, c] = p
                    buf = step % 2  # two dS^T (P^T) buffers: the other warpgroup may still read the previous step's
                    if const_expr(not self.split_hd):
                        # dV += P^T dO from registers, issued before waiting for dP^T: the exponentials must
                        # finish first (so they overlap the dP^T GEMM) and the dS^T math overlaps dV.
                        tdVrP = cute.make_rmem_tensor(frgA_layout.shape, self.dtype)
                        tdVrP.store(cute.make_tensor(acc_S.iterator, frgA_layout).load().to(self.dtype))
                        if const_expr(self.dv_after_ds):
                            warpgroup.wait_group(0)  # dP^T; dV is issued after the dS^T math
                        else:
                            wgmma(mma_dv, acc_dV, tdVrP, tdVrdOt[None, None, None, state.index], wg_wait=1)
                    else:
                        warpgroup.wait_group(0)
                    # dS^T = scale * P^T * (dP^T - D[query]): the softmax scale is applied here, once, so
                    # dK = dS^T Q and dQ = dS K need no rescaling afterwards.
                    dp = acc_mn_view(acc_dP)
                    for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
                        col = t0ScS[0, c][1]
                        dpsum = sD[thread_col0 + col, state.index]
                        if const_expr(not self.cfg.softcap and self.dv_after_ds):
                            # P * fma(dP, scale, -D * scale): 2 instructions per element, not 3 (the
                            # rounding of D * scale is far below dP's own bf16-GEMM error)
                            dpsum_scaled = dpsum * softmax_scale
                            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                                dp[r, c] = s[r, c] * fma_rn(dp[r, c], softmax_scale, -dpsum_scaled)
                        elif const_expr(not self.cfg.softcap):
                            # (with dV in flight here, the form above spills at d128 varlen / window)
                            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                                dp[r, c] = (s[r, c] * softmax_scale) * (dp[r, c] - dpsum)
                        else:
                            # d(softcap * tanh(S * scale / softcap)) / dS = scale * (1 - t^2), with
                            # t = (log2 P + LSE log2) / (softcap log2 e) recovered from P (no register
                            # kept for t); P = 0 (masked, or underflowed) gives dS = 0 either way.
                            lse_log2 = sLSE[thread_col0 + col, state.index]
                            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                                p = s[r, c]
                                t = (cute.math.log2(p, fastmath=True) + lse_log2) * inv_scale_log2
                                dtanh = Float32(cutlass.select_(p == Float32(0.0), Float32(0.0), Float32(1.0) - t * t))
                                dp[r, c] = (p * softmax_scale) * (dp[r, c] - dpsum) * dtanh
                    if const_expr(self.dv_after_ds):
                        # One bf16 copy of dS^T: staged for dQ and, viewed as an A fragment, dK's operand.
                        rdS = cute.make_rmem_tensor(acc_dP.shape, self.dtype)
                        rdS.store(acc_dP.load().to(self.dtype))
                        tdKrdS = cute.make_tensor(rdS.iterator, frgA_layout)
                        cute.copy(r2s_dS, r2s_dS.retile(rdS), tdSsdS[None, None, None, buf])
                        wgmma(mma_dv, acc_dV, tdVrP, tdVrdOt[None, None, None, state.index], wg_wait=-1)
                    else:
                        if const_expr(not self.split_hd):
                            tdKrdS = cute.make_rmem_tensor(frgA_layout.shape, self.dtype)
                            tdKrdS.store(cute.make_tensor(acc_dP.iterator, frgA_layout).load().to(self.dtype))
                        else:
                            rP = cute.make_rmem_tensor(acc_S.shape, self.dtype)
                            rP.store(acc_S.load().to(self.dtype))
                            cute.copy(r2s_dS, r2s_dS.retile(rP), tPsPt[None, None, None, buf])
                        # Stage dS^T for the dQ GEMM (both warpgroups' keys are needed by each).
                        rdS = cute.make_rmem_tensor(acc_dP.shape, self.dtype)
                        rdS.store(acc_dP.load().to(self.dtype))
                        cute.copy(r2s_dS, r2s_dS.retile(rdS), tdSsdS[None, None, None, buf])
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dS), number_of_threads=self.num_mma_threads)
                    if const_expr(self.split_hd):
                        wgmma(mma_dv, acc_dV, tdVrPt[None, None, None, buf], tdVrdOt[None, None, None, state.index], wg_wait=-1)
                    acc_dQ = cute.make_rmem_tensor(mma_dq.partition_shape_C((self.tile_m, self.hdim)), Float32)
                    wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, buf], tdQrKt, zero_init=True, wg_wait=1)
                    pipeline_do.consumer_release(state)  # dV (the last reader of dO) is done
                    # dK runs on the tensor cores while the dQ tile goes to smem.
                    if const_expr(not self.split_hd):
                        wgmma(mma_dkv, acc_dK, tdKrdS, tdKrQt[None, None, None, state.index], wg_wait=1)
                    else:
                        wgmma(mma_dkv, acc_dK, tdKrdSt[None, None, None, buf], tdKrQt[None, None, None, state.index], wg_wait=1)
                    # Hand the dQ tile to warp 1 once it has finished reading the previous one.
                    if step > 0:
                        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=self.num_mma_threads + 32)
                    if const_expr(self.cfg.dq_accum_order):
                        store_accum_order(acc_dQ, sdQ.iterator, tidx, self.num_mma_threads)  # 16-byte, conflict-free
                    else:
                        cute.copy(r2s_dQ, r2s_dQ.retile(acc_dQ), tdQsdQ)
                    # The bulk reduce reads sdQ through the async proxy: order our generic-proxy stores first.
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQFull), number_of_threads=self.num_mma_threads + 32)
                    warpgroup.wait_group(0)
                    pipeline_q.consumer_release(state)  # dK (the last reader of Q) is done
                    state = next_state(state)
                    step += 1
        if num_steps > 0:
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=self.num_mma_threads + 32)
        if const_expr(self.cfg.dkv_accum):
            self.epilogue_dKV_accum(acc_dK, acc_dV, mdK, mdV, mma_dkv, mma_dv, tidx, n_block, head_kv, seq)
        else:
            self.epilogue_dKV(acc_dK, acc_dV, mdK, mdV, tma_atom_dK, tma_atom_dV, sK, sV, mma_dkv, mma_dv, tidx,
                              n_block, head_kv, seq)

    @cute.jit
    def mma_t(self, mdK, mdV, mExact, mLSEhi, mLSElo, tma_atom_dK, tma_atom_dV, sQ, sK, sV, sdO, sdS, sP, sLSE, sD, sdQ,
              mma_sdp, mma_dkv, mma_dv, mma_dq, pipeline_kv, pipeline_q, pipeline_do, softmax_scale, tidx,
              n_block, head_kv, seq, m_block_min, num_steps, m_block_max, head0, num_heads):
        """Consumer warpgroups, transposed_dkv (config.BwdConfig; flash-attn-4's sm90 shape for head
        dim 192): 64 queries x 96 keys per step, warpgroup w owns keys [48w, 48w + 48).
            S = Q K^T, dP = dO V^T      (query-major, wgmma SS, 64 x 48 per warpgroup)
            P = 2^(S * scale_log2 - LSE_log2[query]) -> sP (this warpgroup's key half)
            dV^T += dO^T P              (head dim on M, both operands from smem)
            dS = P * (dP * scale - D[query] * scale) -> sdS (both halves read by both dQs)
            dQ = dS K                   (warpgroup w: head dims [hdim/2 w, hdim/2 (w + 1)))
            dK^T += Q^T dS
        Order per step: S; dP; exponentials (under dP); stage P, warpgroup barrier, dV^T; dS math
        (under dV^T); barrier (the other warpgroup's previous dQ has read sdS); stage dS; barrier;
        dQ; release dO; dK^T; stage dQ for warp 1 (under dK^T); release Q. Masks, the exact-LSE
        path and softcap as in `mma` (query-major: geometry.mask_scores, the forward's)."""
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        wg_slice = cute.make_layout(self.num_wg_mma, stride=THREADS_PER_WG)(wg_idx)
        wg_sdp = mma_sdp.get_slice(wg_slice)
        wg_dkv = mma_dkv.get_slice(wg_slice)
        wg_dq = mma_dq.get_slice(wg_slice)
        thr_sdp = mma_sdp.get_slice(tidx)
        # S = Q K^T: A = Q (queries x d), B = K (keys x d); dP = dO V^T likewise.
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        # dV^T = dO^T P: A = dO^T (Dv x queries), B = P viewed (keys x queries); dK^T = Q^T dS likewise.
        tdVrdOt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_view(sdO)))
        tdVrP = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sP)))
        tdKrQt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_view(sQ)))
        tdKrdS = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sdS)))
        # dQ = dS K: A = dS (queries x keys, K-major), B = K^T (d x keys, MN-major).
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        acc_shape_S = mma_sdp.partition_shape_C((self.tile_m, self.tile_n))
        acc_dK = cute.make_rmem_tensor(mma_dkv.partition_shape_C((self.hdim, self.tile_n)), Float32)
        acc_dV = cute.make_rmem_tensor(mma_dkv.partition_shape_C((self.hdim_v, self.tile_n)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        # Coordinates (query row, key col) of this thread's S values, and thread 0's (static).
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_full = thr_sdp.partition_C(cS)
        t0ScS_full = mma_sdp.get_slice(0).partition_C(cS)
        tScS = acc_mn_view(tScS_full)
        # P, dS registers -> smem (queries x keys), the accumulator's own element order.
        r2s_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), mma_sdp
        ).get_slice(tidx)
        tPsP = r2s_PdS.partition_D(sP)
        tdSsdS = r2s_PdS.partition_D(sdS)
        r2s_dQ = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64), mma_dq
        ).get_slice(tidx)
        tdQsdQ = r2s_dQ.partition_D(sdQ)
        # this warpgroup's named barrier (P staged before its dV^T reads it)
        bar_pwg = int(NamedBarrierBwd.PWG0) + wg_idx

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipeline_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        scale_log2, softcap_scale, inv_scale_log2 = self.score_scales(softmax_scale)
        m_mask_end, m_left = self.mask_phase_bounds(n_block, seqlen_q, seqlen_k, m_block_min, m_block_max)
        step = Int32(0)
        for h_in_group in cutlass.range(num_heads, unroll=1):
            head = head0 + h_in_group
            for phase in cutlass.range_constexpr(3 if self.cfg.local else 2):
                mask = phase != 1
                lo, hi = m_block_min, m_mask_end
                if const_expr(phase == 1):
                    lo, hi = m_mask_end, m_left
                if const_expr(phase == 2):
                    lo, hi = m_left, m_block_max
                for m_block in cutlass.range(lo, hi, unroll=1):
                    tile, tile_batch = self.tile_index(seq, m_block)
                    exact = mExact[tile, head, tile_batch] != 0
                    do_state = state
                    if const_expr(self.do_stages != self.q_stages):
                        do_state = stage_state(step, self.do_stages, producer=False)
                    pipeline_q.consumer_wait(state)
                    acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                    wgmma(mma_sdp, acc_S, tSrQ[None, None, None, state.index], tSrK, zero_init=True, wg_wait=-1)
                    pipeline_do.consumer_wait(do_state)
                    acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
                    wgmma(mma_sdp, acc_dP, tdPrdO[None, None, None, do_state.index], tdPrV, zero_init=True, wg_wait=1)
                    s = acc_mn_view(acc_S)
                    if const_expr(self.cfg.softcap):
                        for i in cutlass.range_constexpr(cute.size(acc_S)):
                            acc_S[i] = cute.math.tanh(acc_S[i] * softcap_scale, fastmath=True)
                    if const_expr(mask):
                        geometry.mask_scores(acc_S, tScS_full, t0ScS_full, m_block, n_block, seqlen_q, seqlen_k,
                                             self.tile_m, self.tile_n, self.causal, self.window)
                    # P = 2^(S * scale_log2 - LSE_log2[query]); masked scores are -inf (P = 0).
                    if exact:
                        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                            query = m_block * self.tile_m + tScS[r, 0][0]
                            hi_l = Float32.inf
                            lo_l = Float32(0.0)
                            if query < seqlen_q:
                                row, batch = seq.q_index(query)
                                hi_l = mLSEhi[row, head, batch]
                                lo_l = mLSElo[row, head, batch]
                            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                                s[r, c] = fma_rn(s[r, c], scale_log2, -hi_l) - lo_l
                    else:
                        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                            lse_log2 = sLSE[tScS[r, 0][0], state.index]
                            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                                s[r, c] = s[r, c] * scale_log2 - lse_log2
                    for i in cutlass.range_constexpr(cute.size(acc_S)):
                        acc_S[i] = exp2_hw(acc_S[i])
                    # Stage P (this warpgroup's key half; its previous dV^T finished at the last
                    # wait_group(0)), then dV^T += dO^T P, which overlaps the dS math.
                    rP = cute.make_rmem_tensor(acc_S.shape, self.dtype)
                    rP.store(acc_S.load().to(self.dtype))
                    cute.copy(r2s_PdS, r2s_PdS.retile(rP), tPsP)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=bar_pwg, number_of_threads=THREADS_PER_WG)
                    wgmma(mma_dkv, acc_dV, tdVrdOt[None, None, None, do_state.index], tdVrP, wg_wait=1)  # dP done
                    # dS = P * (dP * scale - D * scale): the softmax scale is applied here, once.
                    dp = acc_mn_view(acc_dP)
                    for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                        row_q = tScS[r, 0][0]
                        dpsum = sD[row_q, do_state.index]
                        if const_expr(not self.cfg.softcap):
                            dpsum_scaled = dpsum * softmax_scale
                            for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
                                dp[r, c] = s[r, c] * fma_rn(dp[r, c], softmax_scale, -dpsum_scaled)
                        else:
                            lse_log2 = sLSE[row_q, state.index]
                            for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
                                p = s[r, c]
                                t = (cute.math.log2(p, fastmath=True) + lse_log2) * inv_scale_log2
                                dtanh = Float32(cutlass.select_(p == Float32(0.0), Float32(0.0), Float32(1.0) - t * t))
                                dp[r, c] = (p * softmax_scale) * (dp[r, c] - dpsum) * dtanh
                    rdS = cute.make_rmem_tensor(acc_dP.shape, self.dtype)
                    rdS.store(acc_dP.load().to(self.dtype))
                    # The other warpgroup's previous dQ has read sdS (it waited for it before this barrier).
                    cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dS), number_of_threads=self.num_mma_threads)
                    cute.copy(r2s_PdS, r2s_PdS.retile(rdS), tdSsdS)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dS), number_of_threads=self.num_mma_threads)
                    acc_dQ = cute.make_rmem_tensor(mma_dq.partition_shape_C((self.tile_m, self.hdim)), Float32)
                    wgmma(mma_dq, acc_dQ, tdQrdS, tdQrKt, zero_init=True, wg_wait=1)
                    pipeline_do.consumer_release(do_state)  # dV^T (the last reader of dO) is done
                    wgmma(mma_dkv, acc_dK, tdKrQt[None, None, None, state.index], tdKrdS, wg_wait=1)  # dQ done
                    if step > 0:
                        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=self.num_mma_threads + 32)
                    cute.copy(r2s_dQ, r2s_dQ.retile(acc_dQ), tdQsdQ)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQFull), number_of_threads=self.num_mma_threads + 32)
                    warpgroup.wait_group(0)
                    pipeline_q.consumer_release(state)  # dK^T (the last reader of Q) is done
                    state = next_state(state)
                    step += 1
        if num_steps > 0:
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=self.num_mma_threads + 32)
        if const_expr(self.cfg.dkv_accum):
            self.epilogue_dKV_accum(acc_dK, acc_dV, mdK, mdV, mma_dkv, mma_dv, tidx, n_block, head_kv, seq)
        else:
            self.epilogue_dKV(acc_dK, acc_dV, mdK, mdV, tma_atom_dK, tma_atom_dV, sK, sV, mma_dkv, mma_dv, tidx,
                              n_block, head_kv, seq)


    def score_scales(self, softmax_scale):
        """(scale_log2, softcap_scale, inv_scale_log2): P = 2^(S * scale_log2 - LSE_log2). With softcap
        the scores are softcap * tanh(S * scale / softcap): tanh's input scale softcap_scale, the
        softmax's log2 scale softcap * log2 e and its inverse (to recover tanh from P and the LSE for
        the derivative); without, the last two are None."""
        scale_log2 = softmax_scale * Float32(LOG2E)
        if const_expr(self.cfg.softcap):
            softcap_scale = softmax_scale / self.softcap
            scale_log2 = self.softcap * Float32(LOG2E)
            return scale_log2, softcap_scale, Float32(1.0) / scale_log2
        return scale_log2, None, None

    def mask_phase_bounds(self, n_block, seqlen_q, seqlen_k, m_block_min, m_block_max):
        """(m_mask_end, m_left): the step loop's m_blocks [m_block_min, m_mask_end) run with the element
        mask, [m_mask_end, m_left) without, and (a window) [m_left, m_block_max) with it again (the
        left edge); m_block_min <= m_mask_end <= m_left <= m_block_max, all equal for a tile without
        queries."""
        m_mask_end = geometry.m_block_mask_end(n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal,
                                               self.window)
        m_left = m_block_max
        if const_expr(self.cfg.local):
            m_mask_end = cutlass.min(cutlass.max(m_mask_end, m_block_min), m_block_max)
            m_left = geometry.m_block_left_mask_start(n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                                                      self.window)
            m_left = cutlass.min(cutlass.max(m_left, m_mask_end), m_block_max)
        return m_mask_end, m_left

    @cute.jit
    def exponent_exact(self, s, t0ScS, mLSEhi, mLSElo, scale_log2, m_block, thread_col0, head, seq):
        """s[r, c] = S^T * scale_log2 - (hi + lo)[query] with the forward's unrounded log2 LSE
        (lse_split): fma(S^T, scale_log2, -hi) is exact-then-rounded, so at the row's max it is the
        rounding error of m * scale_log2 exactly, and P is exact there at any finite magnitude
        (issue 8). Taken only for query tiles the preprocess flagged (|LSE * log2 e| >=
        BWD_EXACT_LSE_LOG2), so hi, lo come straight from global memory. Queries past seqlen_q get
        hi = +inf (P = 0), as the padded LSE of the fast path. mLSEhi, mLSElo: (seqlen_q, nheads,
        batch) views, packed (total_q, nheads, 1) with varlen_q (seq.q_index places the row)."""
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            query = m_block * self.tile_m + thread_col0 + t0ScS[0, c][1]
            hi = Float32.inf
            lo = Float32(0.0)
            if query < seq.seqlen_q:
                row, batch = seq.q_index(query)
                hi = mLSEhi[row, head, batch]
                lo = mLSElo[row, head, batch]
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                s[r, c] = fma_rn(s[r, c], scale_log2, -hi) - lo

    @cute.jit
    def epilogue_dKV_accum(self, acc_dK, acc_dV, mdKacc, mdVacc, mma_dkv, mma_dv, tidx, n_block, head_kv, seq):
        """dkv_accum: add the fp32 dK, dV of this CTA's query heads into the accumulators (red.global
        .add.v2.f32 straight from the registers: two adjacent columns per instruction), rows past
        seqlen_k skipped. Deterministic: the CTAs of one key tile add in split order 0, 1, ...
        (each waits until the tile's semaphore reads its split, adds, fences, releases split + 1);
        lower splits have lower blockIdx.x (flash4.launch.bwd_grid), so the chain cannot deadlock and
        every element's fp32 sum is taken in the same order on every call."""
        valid_rows = seq.seqlen_k - n_block * self.tile_n
        if const_expr(self.cfg.deterministic):
            _, split, _, _, _, _, kv_tile = self.block_coords_again()
            sem_ptr = self.mdKVsem.iterator + kv_tile
            if tidx == 0:
                seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                while seen != split:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
        for acc, mX, mma, hdim in ((acc_dK, mdKacc, mma_dkv, self.hdim), (acc_dV, mdVacc, mma_dv, self.hdim_v)):
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
    def epilogue_dKV(self, acc_dK, acc_dV, mdK, mdV, tma_atom_dK, tma_atom_dV, sK, sV, mma_dkv, mma_dv, tidx, n_block,
                     head_kv, seq):
        """dK, dV: registers -> 16-bit -> K's / V's smem (stmatrix) -> TMA store; rows past seqlen_k
        are clipped by the TMA unit. mdK, mdV: the TMA views of dK, dV (seqlen_k, headdim, nheads_k, batch).
        varlen_k: mdK, mdV are the packed tensors (total_k, headdim, nheads_k, 1) and all consumer
        threads store the rows < seqlen_k - n_block * tile_n (the rest belong to the next sequence)."""
        # Every consumer warpgroup has finished its GEMMs (wait_group(0) ends each step): K, V are free.
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.dkv_t, num_matrices=4),
                                       self.dtype)
        r2s = cute.make_tiled_copy_C(stmatrix, mma_dkv).get_slice(tidx)
        r2s_v = r2s if const_expr(self.hdim_v == self.hdim) else cute.make_tiled_copy_C(stmatrix, mma_dv).get_slice(tidx)
        for acc, sX, r2s in ((acc_dK, sK, r2s), (acc_dV, sV, r2s_v)):
            rX = cute.make_rmem_tensor(acc.shape, self.dtype)
            rX.store(acc.load().to(self.dtype))
            # transposed_dkv: dK^T / dV^T (d x keys) into the keys x d tile, transposing stmatrix
            cute.copy(r2s, r2s.retile(rX), r2s.partition_D(transpose_view(sX) if const_expr(self.dkv_t) else sX))
        if const_expr(self.varlen_k):
            # Generic-proxy reads of the staged tiles: the barrier alone orders them.
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
            valid_rows = seq.seqlen_k - n_block * self.tile_n
            for mX, sX, hdim in ((mdK, sK, self.hdim), (mdV, sV, self.hdim_v)):
                gX = cute.local_tile(seq.k_view(mX, head_kv), (self.tile_n, hdim), (n_block, 0))
                store_rows_predicated(sX, gX, valid_rows, tidx, self.num_mma_threads)
        else:
            cute.arch.fence_view_async_shared()  # smem writes -> visible to the TMA (async proxy)
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Epilogue), number_of_threads=self.num_mma_threads)
            if tidx < 32:
                for atom, mX, sX, hdim in ((tma_atom_dK, mdK, sK, self.hdim), (tma_atom_dV, mdV, sV, self.hdim_v)):
                    gX = cute.local_tile(seq.k_view(mX, head_kv), (self.tile_n, hdim), (n_block, 0))
                    tXsX, tXgX = cpasync.tma_partition(
                        atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
                    )
                    cute.copy(atom, tXsX, tXgX)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
