"""FlashAttention backward for the portable family (sm_80, sm_86, sm_89, sm_120; runs on sm_90 too)
in CuTe DSL: FlashAttention-2's backward (Dao 2023, algorithm 2) on mma.sync m16n8k16, ldmatrix and
cp.async.

One CTA per (key tile n_block, KV head, batch) keeps K, V in smem and dK, dV in fp32 registers and
walks the query tiles of every query head of its KV head (GQA / MQA: dK, dV summed in registers).
Per query tile it recomputes S = Q K^T and P = 2^(S scale_log2 - LSE_log2), computes dP = dO V^T,
dS = P (dP - D) softmax_scale, adds dV += P^T dO and dK += dS^T Q, and reduce-adds dQ = dS K into
the fp32 dq_accum with one relaxed red.global.add.f32 per element (deterministic: the key tiles of
a query tile add in n_block order, each waiting on the tile's counter, as the sm90 backward). The row statistics (LSE_log2, D = rowsum(dO O), the exact-path flags) and dq_accum come from
the arch-neutral preprocess (kernels/common/bwd_preprocess.py); its dQ postprocess converts dq_accum.
Every code path is fixed by the family, never by the DSL's target arch: no TMA, wgmma, stmatrix
(the CPU compile check gates the SASS).
"""

from functools import partial
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator

from flash4.kernels.common import geometry, score
from flash4.kernels.common.bwd_preprocess import store_dq_pairs, tile_coords
from flash4.kernels.common.dsl import DSL_DTYPES
from flash4.kernels.common.exp2 import exp2_hw, fma_rn
from flash4.kernels.common.layout import acc_mn_view, select_modes, transpose_view
from flash4.kernels.common.params import MaskParams, SeqParams
from flash4.kernels.common.paged_gather import cp_async_zfill
from flash4.kernels.common.pin import keep_here
from flash4.kernels.common.seqinfo import SeqInfo, store_rows_predicated
from flash4.kernels.sm80 import loop_clone
from flash4.kernels.sm80 import rows as tile_rows
from flash4.kernels.sm80.regs import RegCoords, ld, st
from flash4.kernels.sm80.mma import (KPipe, as_wgmma_acc, gemm_kpipe, gemm_kpipe_part, make_kpipe, make_tiled_mma,
                                     smem_layout_atom)

# 16-byte global accesses (cp.async.cg loads, the dK / dV stores): 8 elements of 16 bits.
COPY_BITS = 128


@dsl_user_op
def cp_async_4(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, *, loc=None, ip=None):
    """cp.async.ca of 4 bytes gmem -> smem (joins the thread's current cp.async group)."""
    llvm.inline_asm(
        None,
        [Int32(smem_ptr.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip), gmem_ptr.toint(loc=loc, ip=ip).ir_value()],
        "cp.async.ca.shared.global [$0], [$1], 4;",
        "r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_f32(gmem_ptr: cute.Pointer, a: Float32, *, loc=None, ip=None):
    """gmem[0] += a (fp32, one relaxed red.global: every target since sm_20 has it)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip)],
        "red.global.add.f32 [$0], $1;",
        "l,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def ctaid_x_reread(*, loc=None, ip=None) -> Int32:
    """blockIdx.x, read by a volatile mov (not merged with the kernel's first read: a value
    re-derived where it is needed instead of held in a register across the main loop)."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [], "mov.u32 $0, %ctaid.x;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def opaque_i32(a: Int32, *, loc=None, ip=None) -> Int32:
    """a, through a volatile mov: arithmetic on it is not merged with the same arithmetic on a
    earlier (so its result is recomputed here rather than kept live from there)."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(a).ir_value(loc=loc, ip=ip)], "mov.u32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


def dq_order_view(tile_ptr: cute.Pointer, num_values: int, num_threads: int) -> cute.Tensor:
    """(value, thread) view of one contiguous fp32 dq_accum tile in the dQ MMA's register order
    (Sm80BwdConfig.dq_coalesced): [i, t] is value i (the flat index of the thread's accumulator
    fragment) of thread t, at tile offset i * num_threads + t."""
    return cute.make_tensor(tile_ptr, cute.make_layout((num_values, num_threads), stride=(num_threads, 1)))


# ---------------------------------------------------------------------- parameter bundles
class BwdTensors(NamedTuple):
    """Global tensors in the kernel view (seqlen, d, heads, batch): q, k, v, do (inputs), dk, dv
    (outputs, 16-bit)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    dk: cute.Tensor
    dv: cute.Tensor


class BwdStats(NamedTuple):
    """Per-row statistics (flash4.backward): lse2 (LSE log2, +inf on padding) and dpsum (D, 0 on
    padding), fp32 (rows_pad, heads, batch) in the padded layout; dq_accum fp32 (rows_pad, d, heads,
    batch), zeroed; exact int32 (tiles, heads, batch): 1 where the query tile takes P from the
    unrounded lse_hi + lo (fp32 (seqlen_q, heads, batch)); dq_sem int32 (tiles, heads, batch),
    zeroed: the deterministic dQ chain's counters."""

    lse2: cute.Tensor
    dpsum: cute.Tensor
    dq_accum: cute.Tensor
    exact: cute.Tensor
    lse_hi: cute.Tensor
    lse_lo: cute.Tensor
    dq_sem: cute.Tensor


class Scalars(NamedTuple):
    """softmax_scale; softcap (the cap, read with cfg.softcap only); seqlen_k_grid: the key count the
    grid was sized by (max_seqlen_k, or K's seqlen)."""

    softmax_scale: Float32
    softcap: Float32
    seqlen_k_grid: Int32


class Smem(NamedTuple):
    """Shared-memory tiles: q (tile_m, d, STAGE), do (tile_m, dv, STAGE), k (tile_n, d), v (tile_n,
    dv) (dK, dV are staged there in the epilogue), p and ds (tile_m, tile_n)."""

    q: cute.Tensor
    do: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    p: cute.Tensor
    ds: cute.Tensor
    lse: Optional[cute.Tensor] = None  # Sm80BwdConfig.lse_smem: (tile_m, STAGE) fp32, the staged tiles' LSE_log2
    dpsum: Optional[cute.Tensor] = None  # ... and their D
    exact: Optional[cute.Tensor] = None  # Sm80BwdConfig.p_before_dp: (4, STAGE) int32, [0, stage] the staged tile's exact flag
    lse_lo: Optional[cute.Tensor] = None  # ... and (tile_m, STAGE) fp32: 0, the exact tiles' unrounded lo


class Layouts(NamedTuple):
    q: object
    do: object
    k: object
    v: object
    pds: object


class Mmas(NamedTuple):
    """The three tiled MMAs: sdp (tile_m x tile_n: S, dP), dkv (tile_n x d: dV, dK), dq (tile_m x d)."""

    sdp: cute.TiledMma
    dkv: cute.TiledMma
    dq: cute.TiledMma


class Operands(NamedTuple):
    """Every GEMM's per-thread operands (mma.KPipe: fragments, ldmatrix partitions with a trailing
    STAGE mode where the operand is staged, copies)."""

    s: KPipe  # S = Q K^T
    dp: KPipe  # dP = dO V^T
    dv: KPipe  # dV += P^T dO
    dk: KPipe  # dK += dS^T Q
    dq: KPipe  # dQ = dS K


class FlashAttentionBackwardSm80:
    """Backward main kernel, one CTA of num_warps warps per (n_block, kv_head, batch), n_block
    fastest (flash4.launch.bwd_grid with one head split). No warp specialization: every thread
    loads (cp.async), multiplies and adds.

    Per CTA: cp.async K, V (rows past seqlen_k zero-filled); then for each query head of the KV
    head, the query tiles m_block_min .. m_block_max - 1 that see the key tile
    (flash4.geometry.m_block_range), Q / dO in q_stages smem buffers:
      * step m (`one_m_block`), stage r: wait for Q[m], dO[m] (cp.async.wait_group 0), barrier
        (they are visible; every thread is past step m - 1, so its stage and P / dS are free);
        q_stages 2: cp.async Q[m+1], dO[m+1] into the other stage now;
        S = Q K^T and dP = dO V^T (ldmatrix + mma.sync, warps_m_sdp x rest warps);
        softcap; mask (the tiles m_block_mask_end / m_block_left_mask_start mark); P = 2^(S *
        scale_log2 - LSE_log2) (the exact tiles: fma(S, scale_log2, -hi) - lo); P -> smem;
        dS = P (dP - D) softmax_scale (softcap: times 1 - t^2) -> smem; barrier;
        dV += P^T dO, dK += dS^T Q (ldmatrix.trans from smem), dQ = dS K -> red.global.add.f32
        into dq_accum (rows past seqlen_q add 0: their P is 0 and their padded rows exist;
        deterministic: after the key tile below has added, `wait_dq_turn`, then release the next);
        q_stages 1: barrier, cp.async Q[m+1], dO[m+1].
      * epilogue: dK, dV -> 16-bit -> K's / V's smem -> row-predicated 16-byte stores (a key tile
        that no query sees writes zeros).
    Rows past seqlen_q / keys past seqlen_k are never loaded: smem rows zero-filled, their P is 0
    (LSE_log2 = +inf on padding rows; keys masked or multiplied by zero K / V rows).
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.dtype = DSL_DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.hdim, self.hdim_v = cfg.tile_m, cfg.tile_n, cfg.headdim, cfg.hdim_v
        self.q_stages = cfg.q_stages
        self.num_threads = cfg.num_threads
        self.causal = cfg.causal

    # ------------------------------------------------------------------ host side (trace time)
    def _smem_layout(self, rows: int, cols: int, stages=None):
        atom = smem_layout_atom(self.dtype, cols)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def _gmem_copy(self, hdim: int, rows_list):
        """cp.async tiled copy of 16-byte chunks, threads row-major over one smem atom's width;
        every row count in rows_list must be a multiple of the rows one pass covers."""
        vec = COPY_BITS // self.dtype.width
        per_row = smem_layout_atom(self.dtype, hdim).outer.shape[1] // vec
        thr_layout = cute.make_ordered_layout((self.num_threads // per_row, per_row), order=(1, 0))
        for rows in rows_list:
            assert rows % (self.num_threads // per_row) == 0, (rows, self.num_threads, per_row)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                   num_bits_per_copy=COPY_BITS)
        return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))

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
        mCuSeqlensQ: Optional[cute.Tensor],  # (batch + 1,) int32 (varlen_q)
        mCuSeqlensK: Optional[cute.Tensor],  # (batch + 1,) int32 (varlen_k)
        mSeqUsedQ: Optional[cute.Tensor],  # (batch,) int32 (seqused_q)
        mSeqUsedK: Optional[cute.Tensor],  # (batch,) int32 (seqused_k)
        mdKVsem: Optional[cute.Tensor],  # None (no GQA head split here)
        mDelta: Optional[cute.Tensor],  # None (no sink_delta here: the host sums D in torch)
        softmax_scale: Float32,
        max_seqlen_k: Optional[Int32],  # varlen_k or seqused_k: >= every seqlen_k (sizes the grid); else None
        window_left: Int32,  # local: the window's sides (flash4.geometry.window_sides); ignored otherwise
        window_right: Int32,
        softcap: Float32,  # cfg.softcap: the cap; else ignored
        num_ctas: Int32,  # grid size: n_blocks * nheads_k * batch (flash4.launch.bwd_grid)
        heads_per_cta: Int32,  # every query head of the KV head (no head split here): unused
        stream: cuda.CUstream,
    ):
        """The sm90 backward's parameter list (flash4.compile.cache.compile_bwd), so the host drives
        either family with the same arguments; mdKVsem, mDelta and heads_per_cta are unused."""
        cfg = self.cfg
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type
                           == mdK.element_type == mdV.element_type == self.dtype)):
            raise TypeError(f"flash4 bwd_sm80: q, k, v, dout, dk, dv must all be {self.dtype}")
        given = (mCuSeqlensQ is not None, mCuSeqlensK is not None, mSeqUsedQ is not None, mSeqUsedK is not None,
                 max_seqlen_k is not None, mdKVsem is not None, mDelta is not None)
        if const_expr(given != (cfg.varlen_q, cfg.varlen_k, cfg.seqused_q, cfg.seqused_k, cfg.dynamic_seqlen_k,
                                False, False)):
            raise ValueError(f"flash4 bwd_sm80: sequence tensors given {given} do not match the config {cfg}")
        mQ, mK, mV, mdO, mdK, mdV = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSE2, mD = [select_modes(t, [2, 1, 0]) for t in (mLSE2, mD)]  # (seqlen_q_pad, nheads, batch)
        mdQacc = select_modes(mdQacc, [2, 3, 1, 0])  # (seqlen_q_pad, headdim, nheads, batch)
        mExact, mdQsem = [select_modes(t, [2, 1, 0]) for t in (mExact, mdQsem)]  # (num_m_blocks, nheads, batch)
        mLSEhi, mLSElo = [select_modes(t, [2, 1, 0]) for t in (mLSEhi, mLSElo)]  # (seqlen_q, nheads, batch)

        layouts = Layouts(
            self._smem_layout(self.tile_m, self.hdim, self.q_stages),
            self._smem_layout(self.tile_m, self.hdim_v, self.q_stages),
            self._smem_layout(self.tile_n, self.hdim),
            self._smem_layout(self.tile_n, self.hdim_v),
            self._smem_layout(self.tile_m, self.tile_n),
        )
        copy_qk = self._gmem_copy(self.hdim, (self.tile_m, self.tile_n))
        copy_vdo = self._gmem_copy(self.hdim_v, (self.tile_m, self.tile_n))
        w = cfg.num_warps
        mmas = Mmas(make_tiled_mma(self.dtype, w, w // cfg.warps_m_sdp),
                    make_tiled_mma(self.dtype, w, w // cfg.warps_n_dkv),
                    make_tiled_mma(self.dtype, w, w // cfg.warps_m_dq))

        SharedStorage = self._shared_storage(layouts)

        seqlen_k_grid = max_seqlen_k if const_expr(cfg.dynamic_seqlen_k) else mK.shape[0]
        self.kernel(
            BwdTensors(mQ, mK, mV, mdO, mdK, mdV),
            BwdStats(mLSE2, mD, mdQacc, mExact, mLSEhi, mLSElo, mdQsem),
            SeqParams(mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK),
            Scalars(softmax_scale, softcap, Int32(seqlen_k_grid)),
            MaskParams(window_left, window_right),
            layouts,
            (copy_qk, copy_vdo),
            mmas,
            SharedStorage,
        ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream)

    def _shared_storage(self, layouts: Layouts):
        """The CTA's smem struct (a plain method: the class body's `if` stays Python, outside the
        DSL's rewriting of the jit function)."""

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.q)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.do)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.k)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.v)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.pds)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.pds)], 1024]
            if self.cfg.lse_smem:  # (only then: the other configs keep their smem layout)
                sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.q_stages], 16]
                sD: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.q_stages], 16]
            if self.cfg.p_before_dp:
                sExact: cute.struct.Align[cute.struct.MemRange[Int32, 4 * self.q_stages], 16]
                sLSElo: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.q_stages], 16]

        return SharedStorage

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, gmem: BwdTensors, stats: BwdStats, seq_params: SeqParams, scalars: Scalars,
               mask_params: MaskParams, layouts: Layouts, copies: tuple, mmas: Mmas, SharedStorage: cutlass.Constexpr):
        tidx = cute.arch.thread_idx()[0]
        storage = SmemAllocator().allocate(SharedStorage)
        smem = Smem(storage.sQ.get_tensor(layouts.q), storage.sdO.get_tensor(layouts.do),
                    storage.sK.get_tensor(layouts.k), storage.sV.get_tensor(layouts.v),
                    storage.sP.get_tensor(layouts.pds), storage.sdS.get_tensor(layouts.pds),
                    *((storage.sLSE.get_tensor(cute.make_layout((self.tile_m, self.q_stages))),
                       storage.sD.get_tensor(cute.make_layout((self.tile_m, self.q_stages))))
                      if const_expr(self.cfg.lse_smem) else (None, None)),
                    *((storage.sExact.get_tensor(cute.make_layout((4, self.q_stages))),
                       storage.sLSElo.get_tensor(cute.make_layout((self.tile_m, self.q_stages))))
                      if const_expr(self.cfg.p_before_dp) else (None, None)))
        n_block, head_kv, seq = self.tile_coords(gmem, seq_params, scalars, cute.arch.block_idx()[0])
        if n_block * self.tile_n < seq.seqlen_k:  # (dynamic seqlen_k: CTAs past the sequence's keys exit)
            ops = self.mma_operands(smem, mmas, tidx)
            self.key_tile(gmem, stats, scalars, seq_params, mask_params, smem, copies, mmas, ops, tidx, n_block,
                          head_kv, seq)

    def tile_coords(self, gmem: BwdTensors, seq_params: SeqParams, scalars: Scalars, bid):
        """(n_block, head_kv, SeqInfo) of CTA bid: blockIdx.x = (batch * nheads_k + head_kv) * n_blocks + n_block."""
        num_n_blocks = cute.ceil_div(scalars.seqlen_k_grid, self.tile_n)
        n_block = bid % num_n_blocks
        rest = bid // num_n_blocks
        nheads_k = gmem.k.shape[2]
        head_kv = rest % nheads_k
        batch = rest // nheads_k
        seq = SeqInfo(batch, gmem.q.shape[0], gmem.k.shape[0], *seq_params.lengths(), tile_m_pad=self.tile_m)
        return n_block, head_kv, seq

    def mma_operands(self, smem: Smem, mmas: Mmas, tidx) -> Operands:
        """Every GEMM's fragments and ldmatrix partitions (built once per CTA)."""
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        sQt, sdOt, sKt, sPt, sdSt = (transpose_view(t) for t in (smem.q, smem.do, smem.k, smem.p, smem.ds))

        def gemm(mma, sA, sB, trans_a: bool, trans_b: bool, staged_a: bool, staged_b: bool) -> KPipe:
            thr = mma.get_slice(tidx)
            a = thr.make_fragment_A(thr.partition_A(sA[None, None, 0] if staged_a else sA))
            b = thr.make_fragment_B(thr.partition_B(sB[None, None, 0] if staged_b else sB))
            copy_a = cute.make_tiled_copy_A(ldsm_t if trans_a else ldsm, mma).get_slice(tidx)
            copy_b = cute.make_tiled_copy_B(ldsm_t if trans_b else ldsm, mma).get_slice(tidx)
            return make_kpipe(a, b, copy_a.partition_S(sA), copy_b.partition_S(sB), copy_a, copy_b)

        return Operands(
            gemm(mmas.sdp, smem.q, smem.k, False, False, True, False),  # S = Q K^T
            gemm(mmas.sdp, smem.do, smem.v, False, False, True, False),  # dP = dO V^T
            gemm(mmas.dkv, sPt, sdOt, True, True, False, True),  # dV += P^T dO
            gemm(mmas.dkv, sdSt, sQt, True, True, False, True),  # dK += dS^T Q
            gemm(mmas.dq, smem.ds, sKt, False, True, False, False),  # dQ = dS K
        )

    @cute.jit
    def key_tile(self, gmem: BwdTensors, stats: BwdStats, scalars: Scalars, seq_params: SeqParams,
                 mask_params: MaskParams, smem: Smem, copies: tuple, mmas: Mmas, ops: Operands, tidx: Int32,
                 n_block: Int32, head_kv: Int32, seq: SeqInfo):
        """K, V of key tile n_block in, dK, dV of it out, summed over every query head of head_kv."""
        cfg = self.cfg
        copy_qk, copy_vdo = copies
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        window = mask_params.window(cfg.local)
        group = gmem.q.shape[2] // gmem.k.shape[2]

        # K, V: one cp.async group, rows past seqlen_k zero-filled.
        thr_qk, thr_vdo = copy_qk.get_slice(tidx), copy_vdo.get_slice(tidx)
        gK = cute.local_tile(seq.k_view(gmem.k, head_kv), (self.tile_n, self.hdim), (n_block, 0))
        gV = cute.local_tile(seq.k_view(gmem.v, head_kv), (self.tile_n, self.hdim_v), (n_block, 0))
        tile_rows.load_rows(copy_qk, thr_qk.partition_S(gK), thr_qk.partition_D(smem.k),
                            *self.row_coords(copy_qk, thr_qk, self.tile_n, self.hdim), seqlen_k - n_block * self.tile_n)
        tile_rows.load_rows(copy_vdo, thr_vdo.partition_S(gV), thr_vdo.partition_D(smem.v),
                            *self.row_coords(copy_vdo, thr_vdo, self.tile_n, self.hdim_v),
                            seqlen_k - n_block * self.tile_n)
        cute.arch.cp_async_commit_group()

        thr_dkv = mmas.dkv.get_slice(tidx)
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.hdim_v)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        m_block_min, m_block_max = geometry.m_block_range(n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                                                          self.causal, window)
        mask_end = geometry.m_block_mask_end(n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal,
                                             window)
        left_start = m_block_max
        if const_expr(cfg.local):
            left_start = cutlass.max(geometry.m_block_left_mask_start(n_block, seqlen_q, seqlen_k, self.tile_m,
                                                                      self.tile_n, window), mask_end)
        scale_log2, softcap_scale, inv_scale_log2 = score.device_scales(scalars.softmax_scale, scalars.softcap,
                                                                        cfg.softcap)
        # (tile_m, tile_n) coordinates of this thread's / thread 0's S fragment
        thr_sdp = mmas.sdp.get_slice(tidx)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = as_wgmma_acc(thr_sdp.partition_C(cS))
        t0ScS = as_wgmma_acc(mmas.sdp.get_slice(0).partition_C(cS))
        s_rows = acc_mn_view(tScS)
        thr_dq = mmas.dq.get_slice(tidx)
        crds = RegCoords.make(cute.size(s_rows, mode=[0]), cute.size(s_rows, mode=[1]),
                              max(cute.size(s_rows, mode=[0]),
                                  cute.size(thr_dq.partition_shape_C((self.tile_m, self.hdim)))))
        mask = partial(geometry.mask_scores, tScS=tScS, t0ScS=t0ScS, n_block=n_block, seqlen_q=seqlen_q,
                       seqlen_k=seqlen_k, tile_m=self.tile_m, tile_n=self.tile_n, causal=self.causal, window=window)

        for h in cutlass.range(group, unroll=1):
            head = head_kv * group + h
            if m_block_max > m_block_min:
                gQ = cute.local_tile(seq.q_view(gmem.q, head), (self.tile_m, self.hdim), (None, 0))
                gdO = cute.local_tile(seq.q_view(gmem.do, head), (self.tile_m, self.hdim_v), (None, 0))
                load_q = partial(self.load_q_tile, copy_qk, thr_qk.partition_S(gQ), thr_qk.partition_D(smem.q),
                                 *self.row_coords(copy_qk, thr_qk, self.tile_m, self.hdim), seqlen_q)
                load_do = partial(self.load_q_tile, copy_vdo, thr_vdo.partition_S(gdO), thr_vdo.partition_D(smem.do),
                                  *self.row_coords(copy_vdo, thr_vdo, self.tile_m, self.hdim_v), seqlen_q)
                if const_expr(cfg.lse_smem):  # the tile's LSE_log2 and D ride along with its dO (same cp.async group)
                    load_do = partial(self.load_do_and_lse, load_do, seq.q_padded_view(stats.lse2, head),
                                      seq.q_padded_view(stats.dpsum, head), smem.lse, smem.dpsum, tidx,
                                      exact_flags=(stats, seq, head, smem.exact, smem.lse_lo) if const_expr(cfg.p_before_dp)
                                      else None)
                step = partial(self.one_m_block, stats=stats, seq=seq, head=head, n_block=n_block, window=window,
                               mmas=mmas, ops=ops, smem=smem,
                               acc_dK=acc_dK, acc_dV=acc_dV, load_q=load_q, load_do=load_do, m_block_max=m_block_max,
                               mask=mask, tScS=tScS, crds=crds, tidx=tidx, scales=(scalars.softmax_scale, scale_log2,
                                                                        softcap_scale, inv_scale_log2))
                # every thread is past the previous head's last step (its Q / dO stage is free)
                cute.arch.barrier()
                load_q(m_block_min, Int32(0))
                load_do(m_block_min, Int32(0))
                cute.arch.cp_async_commit_group()
                stage = Int32(0)
                # query tiles crossing the diagonal / seqlen_k, then full ones, then (window) the
                # ones crossing its left edge
                for m_block in cutlass.range(m_block_min, mask_end, unroll=1):
                    stage = step(m_block, stage, masked=True)
                stage = self.unmasked_loop(step, stage, mask_end, left_start)
                if const_expr(cfg.local):
                    for m_block in cutlass.range(left_start, m_block_max, unroll=1):
                        stage = step(m_block, stage, masked=True)
        if const_expr(cfg.dq_coalesced):
            # the tile's coordinates again from a fresh %ctaid.x read, instead of keeping them live
            # across the query loop (at 64 x 128, d128 ptxas spilled two of them there)
            n_block, head_kv, seq = self.tile_coords(
                gmem, seq_params, scalars._replace(seqlen_k_grid=opaque_i32(scalars.seqlen_k_grid)), ctaid_x_reread())
        self.epilogue(acc_dK, acc_dV, gmem, smem, mmas, tidx, n_block, head_kv, seq)

    @cute.jit
    def unmasked_loop(self, step, stage: Int32, lower: Int32, upper: Int32) -> Int32:
        """`for m_block in range(lower, upper): stage = step(m_block, stage, masked=False)`, the loop
        right after the masked one: emitted as a clone of the masked loop without the mask's ops
        (kernels/sm80/loop_clone.py: the same IR without tracing the body again, issue 24), or
        traced where the clone does not apply."""
        cloned = loop_clone.clone_without(self.__dict__.pop("_mask_span", None), stage.ir_value(), lower.ir_value(),
                                          upper.ir_value())
        if const_expr(cloned is not None):
            stage = Int32(cloned)
        else:
            for m_block in cutlass.range(lower, upper, unroll=1):
                stage = step(m_block, stage, masked=False)
        return stage

    @cute.jit
    def one_m_block(self, m_block: Int32, stage: Int32, stats: BwdStats, seq: SeqInfo, head: Int32, n_block: Int32,
                    window, mmas: Mmas,
                    ops: Operands, smem: Smem, acc_dK: cute.Tensor, acc_dV: cute.Tensor, load_q, load_do,
                    m_block_max: Int32, mask, tScS: cute.Tensor, crds: RegCoords, tidx: Int32, scales,
                    masked: cutlass.Constexpr[bool]) -> Int32:
        """Query tile m_block from smem stage `stage` (the class docstring's order). Returns the next
        tile's stage."""
        softmax_scale, scale_log2, softcap_scale, inv_scale_log2 = scales
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        next_stage = Int32(0)
        if const_expr(self.q_stages == 2):
            next_stage = 1 - stage
            if m_block + 1 < m_block_max:
                load_q(m_block + 1, next_stage)
                load_do(m_block + 1, next_stage)
            cute.arch.cp_async_commit_group()

        # this thread's query rows: LSE_log2 and D (padded rows: +inf and 0)
        lse_view = seq.q_padded_view(stats.lse2, head)
        dpsum_view = seq.q_padded_view(stats.dpsum, head)
        rows = acc_mn_view(tScS)
        num_rows = cute.size(rows, mode=[0])
        lse = cute.make_rmem_tensor(num_rows, Float32)
        dpsum = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = m_block * self.tile_m + rows[r, 0][0]
            if const_expr(self.cfg.p_before_dp):
                pass  # (P reads smem.lse itself, after stage_exact_rows may have rewritten it)
            elif const_expr(self.cfg.lse_smem):  # staged with this tile's dO (load_do_and_lse)
                lse[r] = smem.lse[rows[r, 0][0], stage]
            else:
                lse[r] = lse_view[row]
            if const_expr(self.cfg.lse_early):  # the loads stay here, under the S and dP GEMMs
                lse[r] = keep_here(lse[r])
            if const_expr(not self.cfg.lse_smem):  # (lse_smem: read where dS needs it, below)
                dpsum[r] = dpsum_view[row]
        tile, tile_batch = self.tile_index(seq, m_block)
        if const_expr(self.cfg.p_before_dp):
            # FlashAttention-2's order: S, P, dP in one basic block; the exact pair chosen up front
            self.stage_exact_rows(smem, stage, stats, seq, head, m_block, rows)
            acc_shape = mmas.sdp.partition_shape_C((self.tile_m, self.tile_n))
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width),
                mmas.sdp).get_slice(tidx)
            acc_S = cute.make_rmem_tensor(acc_shape, Float32)
            acc_S.fill(0.0)
            gemm_kpipe(mmas.sdp, acc_S, ops.s, ops.s.sa[None, None, None, stage], ops.s.sb)
            score.apply(acc_S, softcap_scale, self.cfg.softcap)
            if const_expr(masked):
                self._mask_span = loop_clone.traced_span(mask, as_wgmma_acc(acc_S), m_block=m_block)
            s = acc_mn_view(as_wgmma_acc(acc_S))
            # dp_split: dP's k-loop in two halves, the exponentials of the first half of the thread's
            # rows before the first, the rest (and P's store) before the second (else all of them, then
            # the whole dP GEMM)
            split_rows = num_rows // 2 if const_expr(self.cfg.dp_split) else num_rows
            for r in cutlass.range_constexpr(split_rows):
                hi, lo = smem.lse[rows[r, 0][0], stage], smem.lse_lo[rows[r, 0][0], stage]
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    st(s, crds.mn[r][c], exp2_hw(fma_rn(ld(s, crds.mn[r][c]), scale_log2, -hi) - lo))
            if const_expr(self.cfg.dp_split):
                num_k = cute.size(ops.dp.sb.shape[2])
                acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
                acc_dP.fill(0.0)
                gemm_kpipe_part(mmas.sdp, acc_dP, ops.dp, ops.dp.sa[None, None, None, stage], ops.dp.sb, 0,
                                num_k // 2)
                for r in cutlass.range_constexpr(split_rows, num_rows):
                    hi, lo = smem.lse[rows[r, 0][0], stage], smem.lse_lo[rows[r, 0][0], stage]
                    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                        st(s, crds.mn[r][c], exp2_hw(fma_rn(ld(s, crds.mn[r][c]), scale_log2, -hi) - lo))
            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            cute.copy(r2s, r2s.retile(rP), r2s.partition_D(smem.p))
            if const_expr(self.cfg.dp_split):
                gemm_kpipe_part(mmas.sdp, acc_dP, ops.dp, ops.dp.sa[None, None, None, stage], ops.dp.sb,
                                num_k // 2, num_k)
            else:
                acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
                acc_dP.fill(0.0)
                gemm_kpipe(mmas.sdp, acc_dP, ops.dp, ops.dp.sa[None, None, None, stage], ops.dp.sb)
        else:
            exact = stats.exact[tile, head, tile_batch] != 0

            acc_shape = mmas.sdp.partition_shape_C((self.tile_m, self.tile_n))
            acc_S = cute.make_rmem_tensor(acc_shape, Float32)
            acc_S.fill(0.0)
            gemm_kpipe(mmas.sdp, acc_S, ops.s, ops.s.sa[None, None, None, stage], ops.s.sb)
            acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
            acc_dP.fill(0.0)
            gemm_kpipe(mmas.sdp, acc_dP, ops.dp, ops.dp.sa[None, None, None, stage], ops.dp.sb)

            score.apply(acc_S, softcap_scale, self.cfg.softcap)
            s_view = as_wgmma_acc(acc_S)
            if const_expr(masked):
                # (unmasked_loop clones this step without the span of the mask's ops)
                self._mask_span = loop_clone.traced_span(mask, s_view, m_block=m_block)
            self.probabilities(acc_S, lse, exact, stats, seq, head, m_block, rows, scale_log2, crds)
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width),
                mmas.sdp).get_slice(tidx)
            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            cute.copy(r2s, r2s.retile(rP), r2s.partition_D(smem.p))
        # dS = P (dP - D) softmax_scale (softcap: times 1 - t^2): the scale is applied here once,
        # so dK = dS^T Q and dQ = dS K need none
        p, dp = acc_mn_view(as_wgmma_acc(acc_S)), acc_mn_view(as_wgmma_acc(acc_dP))
        for r in cutlass.range_constexpr(num_rows):
            if const_expr(self.cfg.lse_smem):
                dpsum_r = smem.dpsum[rows[r, 0][0], stage]
            else:
                dpsum_r = ld(dpsum, crds.flat[r])  # (read once per row: the same registers, fewer traced loads)
            lse_r = ld(lse, crds.flat[r]) if const_expr(self.cfg.softcap) else None
            for c in cutlass.range_constexpr(cute.size(p, mode=[1])):
                ds = (ld(p, crds.mn[r][c]) * softmax_scale) * (ld(dp, crds.mn[r][c]) - dpsum_r)
                if const_expr(self.cfg.softcap):
                    ds = ds * score.grad_factor(ld(p, crds.mn[r][c]), lse_r, inv_scale_log2)
                st(dp, crds.mn[r][c], ds)
        rdS = cute.make_fragment_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        cute.copy(r2s, r2s.retile(rdS), r2s.partition_D(smem.ds))
        cute.arch.barrier()  # P, dS complete in smem

        gemm_kpipe(mmas.dkv, acc_dV, ops.dv, ops.dv.sa, ops.dv.sb[None, None, None, stage])
        if const_expr(not self.cfg.dq_before_dk):
            gemm_kpipe(mmas.dkv, acc_dK, ops.dk, ops.dk.sa, ops.dk.sb[None, None, None, stage])
        self.dq_step(mmas, ops, stats, seq, head, m_block, n_block, tile, tile_batch, window, tidx, crds)
        if const_expr(self.cfg.dq_before_dk):  # (FlashAttention-2's order: the dQ adds under the dK GEMM)
            gemm_kpipe(mmas.dkv, acc_dK, ops.dk, ops.dk.sa, ops.dk.sb[None, None, None, stage])

        if const_expr(self.q_stages == 1):
            cute.arch.barrier()  # every thread is past its reads of Q, dO
            if m_block + 1 < m_block_max:
                load_q(m_block + 1, Int32(0))
                load_do(m_block + 1, Int32(0))
            cute.arch.cp_async_commit_group()
        return next_stage

    @cute.jit
    def dq_step(self, mmas, ops, stats: BwdStats, seq: SeqInfo, head: Int32, m_block: Int32, n_block: Int32,
                tile: Int32, tile_batch: Int32, window, tidx: Int32, crds: RegCoords):
        """dQ = dS K of this step, reduce-added into dq_accum (deterministic: in the query tile's n_block
        turn)."""
        thr_dq = mmas.dq.get_slice(tidx)
        acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((self.tile_m, self.hdim)), Float32)
        acc_dQ.fill(0.0)
        gemm_kpipe(mmas.dq, acc_dQ, ops.dq, ops.dq.sa, ops.dq.sb)
        # dQ -> dq_accum: the padded layout holds whole query tiles of each sequence, so rows past
        # seqlen_q (which add 0) need no predicate
        gdQ = cute.local_tile(seq.q_padded_view(stats.dq_accum, head), (self.tile_m, self.hdim), (m_block, 0))
        sem_ptr = stats.dq_sem[None, head, tile_batch].iterator + tile
        if const_expr(self.cfg.deterministic):
            self.wait_dq_turn(sem_ptr, self.dq_turn(m_block, n_block, seq, window), tidx)
        if const_expr(self.cfg.dq_coalesced):
            # register order: value i of thread t at tile offset i * T + t (the tile's tile_m x d
            # floats are contiguous), so a warp's red covers 128 contiguous bytes, one base pointer
            tdQgdQ = dq_order_view(gdQ.iterator, cute.size(acc_dQ), self.num_threads)
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                red_add_f32(tdQgdQ[i, None].iterator + tidx, ld(acc_dQ, crds.flat[i]))
        else:
            tdQgdQ = thr_dq.partition_C(gdQ)
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                red_add_f32(tdQgdQ.iterator + cute.crd2idx(i, tdQgdQ.layout), ld(acc_dQ, crds.flat[i]))
        if const_expr(self.cfg.deterministic):
            cute.arch.fence_acq_rel_gpu()  # this thread's adds before the release below
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.atomic_add(sem_ptr, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def stage_exact_rows(self, smem: Smem, stage: Int32, stats: BwdStats, seq: SeqInfo, head: Int32, m_block: Int32,
                         rows: cute.Tensor):
        """Sm80BwdConfig.p_before_dp: P = 2^(fma(S, scale_log2, -hi) - lo) per row, hi and lo from the
        staged smem.lse / smem.lse_lo (LSE_log2 and 0). On an exact tile each thread writes its rows'
        forward unrounded pair there first (hi +inf past seqlen_q; the threads sharing a row write
        the same values): fma(S, c, -LSE) - 0 is probabilities' common branch (contracted S * c -
        LSE), fma(S, c, -hi) - lo its exact one, the same bits."""
        if smem.exact[0, stage] != 0:
            for r in cutlass.range_constexpr(cute.size(rows, mode=[0])):
                hi, lo = self.exact_pair(stats, seq, head, m_block * self.tile_m + rows[r, 0][0])
                smem.lse[rows[r, 0][0], stage] = hi
                smem.lse_lo[rows[r, 0][0], stage] = lo

    @cute.jit
    def exact_pair(self, stats: BwdStats, seq: SeqInfo, head: Int32, query: Int32):
        """(hi, lo): query row `query`'s unrounded LSE * log2(e) = hi + lo from the forward (the exact
        path's exponent offsets); (+inf, 0) past seqlen_q, so P = 0 there."""
        hi = Float32.inf
        lo = Float32(0.0)
        if query < seq.seqlen_q:
            row_idx, batch_idx = seq.q_index(query)
            hi = stats.lse_hi[row_idx, head, batch_idx]
            lo = stats.lse_lo[row_idx, head, batch_idx]
        return hi, lo

    @cute.jit
    def probabilities(self, acc_S: cute.Tensor, lse: cute.Tensor, exact, stats: BwdStats, seq: SeqInfo, head: Int32,
                      m_block: Int32, rows: cute.Tensor, scale_log2: Float32, crds: RegCoords):
        """acc_S -> P = 2^(S * scale_log2 - LSE_log2[row]) in place. exact (the query tiles the
        preprocess flagged, |LSE log2| >= BWD_EXACT_LSE_LOG2): fma(S, scale_log2, -hi) - lo from the
        forward's unrounded hi + lo (rows past seqlen_q: hi = +inf, P = 0), as the sm90 backward."""
        s = acc_mn_view(as_wgmma_acc(acc_S))
        if exact:
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                hi, lo = self.exact_pair(stats, seq, head, m_block * self.tile_m + rows[r, 0][0])
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    st(s, crds.mn[r][c], exp2_hw(fma_rn(ld(s, crds.mn[r][c]), scale_log2, -hi) - lo))
        else:
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                lse_r = ld(lse, crds.flat[r])
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    st(s, crds.mn[r][c], exp2_hw(ld(s, crds.mn[r][c]) * scale_log2 - lse_r))

    def dq_turn(self, m_block, n_block, seq: SeqInfo, window):
        """This key tile's place in query tile m_block's deterministic chain of dQ adds: the key tiles
        adding to it are n_first, n_first + 1, ... (0 without a window; the first of its band with
        one: flash4.geometry.n_block_min), so each waits for the one below it, which has a lower
        blockIdx.x (launched first: no deadlock)."""
        turn = n_block
        if const_expr(self.cfg.local):
            turn = n_block - geometry.n_block_min(m_block, seq.seqlen_q, seq.seqlen_k, self.tile_m, self.tile_n,
                                                  window)
        return turn

    @cute.jit
    def wait_dq_turn(self, sem_ptr, turn: Int32, tidx: Int32):
        """Thread 0 spins until the query tile's counter reads `turn` (acquire), then the CTA goes on."""
        if tidx == 0:
            seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
            while turn != seen:
                seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
        cute.arch.barrier()

    def tile_index(self, seq: SeqInfo, m_block):
        """(tile, batch) of query tile m_block in the per-tile flag tensor (packed: its padded tile)."""
        if const_expr(self.cfg.varlen_q):
            return seq.padded_offset_q // self.tile_m + m_block, Int32(0)
        return m_block, seq.batch

    def row_coords(self, tiled_copy, thr_copy, rows: int, cols: int):
        """kernels/sm80/rows.row_coords, thread 0's static rows cached on this kernel object."""
        return tile_rows.row_coords(self.__dict__.setdefault("_t0_rows", {}), tiled_copy, thr_copy, rows, cols)

    @cute.jit
    def load_q_tile(self, tiled_copy, tXgX: cute.Tensor, tXsX: cute.Tensor, tXcX: cute.Tensor, t0_rows: tuple,
                    seqlen_q: Int32, m_block: Int32, stage: Int32):
        """cp.async query tile m_block of Q or dO (tXgX: (CPY, CPY_M, CPY_K, m_block)) into smem
        stage `stage` (tXsX: (CPY, CPY_M, CPY_K, STAGE)), rows past seqlen_q zero-filled."""
        tile_rows.load_rows(tiled_copy, tXgX[None, None, None, m_block], tXsX[None, None, None, stage], tXcX,
                            t0_rows, seqlen_q - m_block * self.tile_m)

    @cute.jit
    def load_do_and_lse(self, load_do, lse_view: cute.Tensor, dpsum_view: cute.Tensor, sLSE: cute.Tensor,
                        sD: cute.Tensor, tidx: Int32, m_block: Int32, stage: Int32, exact_flags=None):
        """load_do(m_block, stage), then query tile m_block's LSE_log2 and D (tile_m fp32 each of the
        padded per-row layout, which holds whole tiles: no predicate) into sLSE / sD[:, stage], 16
        bytes per thread of the first tile_m / 2 threads (Sm80BwdConfig.lse_smem). exact_flags (stats,
        seq, head, sExact, sLSElo) (Sm80BwdConfig.p_before_dp): also the tile's exact flag into
        sExact[0, stage] (4 bytes, the next thread) and zeros into sLSElo[:, stage] (the next
        tile_m / 4 threads; the step writes the exact tiles' lo there)."""
        load_do(m_block, stage)
        chunks = self.tile_m // 4
        if const_expr(exact_flags is not None):
            stats, seq, head, sExact, sLSElo = exact_flags
            if tidx == 2 * chunks:
                tile, tile_batch = self.tile_index(seq, m_block)
                cp_async_4(sExact.iterator + stage * 4, stats.exact[None, head, tile_batch].iterator + tile)
            elif tidx >= 3 * chunks and tidx < 4 * chunks:
                dst = sLSElo.iterator + stage * self.tile_m + (tidx - 3 * chunks) * 4
                cp_async_zfill(dst.toint(), lse_view.iterator, Int32(0))  # (reads nothing)
        if tidx < chunks:
            src = lse_view.iterator + m_block * self.tile_m + tidx * 4
            dst = sLSE.iterator + stage * self.tile_m + tidx * 4
            cp_async_zfill(dst.toint(), src, Int32(16))
        elif tidx < 2 * chunks:
            src = dpsum_view.iterator + m_block * self.tile_m + (tidx - chunks) * 4
            dst = sD.iterator + stage * self.tile_m + (tidx - chunks) * 4
            cp_async_zfill(dst.toint(), src, Int32(16))

    @cute.jit
    def epilogue(self, acc_dK: cute.Tensor, acc_dV: cute.Tensor, gmem: BwdTensors, smem: Smem, mmas: Mmas,
                 tidx: Int32, n_block: Int32, head_kv: Int32, seq: SeqInfo):
        """dK, dV -> 16-bit -> K's / V's smem (32-bit stores in the accumulator layout) -> 16-byte
        stores of the rows < seqlen_k."""
        cute.arch.cp_async_wait_group(0)  # (a tile no query sees never waited for K, V)
        cute.arch.barrier()  # every thread is past its last read of K, V
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width)
        r2s = cute.make_tiled_copy_C(store_atom, mmas.dkv).get_slice(tidx)
        for acc, sX in ((acc_dK, smem.k), (acc_dV, smem.v)):
            r = cute.make_fragment_like(acc, self.dtype)
            r.store(acc.load().to(self.dtype))
            cute.copy(r2s, r2s.retile(r), r2s.partition_D(sX))
        cute.arch.barrier()
        valid_rows = seq.seqlen_k - n_block * self.tile_n
        for sX, mX, hdim in ((smem.k, gmem.dk, self.hdim), (smem.v, gmem.dv, self.hdim_v)):
            gX = cute.local_tile(seq.k_view(mX, head_kv), (self.tile_n, hdim), (n_block, 0))
            store_rows_predicated(sX, gX, valid_rows, tidx, self.num_threads)


class DqPostprocessSm80:
    """dq[b, m * tile_m + r, h, c] = the dq_accum tile (b, h, m) in the dQ MMA's register order
    (Sm80BwdConfig.dq_coalesced; `dq_order_view`), converted to dtype: one CTA of the backward's
    num_warps warps per (query tile, head, batch) (flash4.launch.bwd_dq_tile_grid); thread t reads
    its values i at i * T + t (4-byte loads, a warp's 128 contiguous bytes) and stores them at the
    coordinates the dQ tiled MMA (make_tiled_mma(num_warps, num_warps // warps_m_dq)) gives them,
    two adjacent columns per 32-bit store, rows < seqlen_q. Dense layouts only."""

    def __init__(self, headdim: int, dtype, tile_m: int, num_warps: int, warps_m_dq: int):
        self.hdim, self.dtype, self.tile_m = headdim, dtype, tile_m
        self.num_warps, self.warps_m_dq = num_warps, warps_m_dq
        self.num_threads = 32 * num_warps

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, num_ctas: Int32, stream: cuda.CUstream):
        """mdQacc (batch, nheads, seqlen_q_pad, headdim) fp32 contiguous rows, tiles in register
        order; mdQ (batch, seqlen_q, nheads, headdim) 16-bit."""
        self.kernel(mdQacc, mdQ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor):
        tidx = cute.arch.thread_idx()[0]
        seqlen_q = mdQ.shape[1]
        m_block, head, b = tile_coords(cute.ceil_div(seqlen_q, self.tile_m), mdQ.shape[2])
        tiled_mma = make_tiled_mma(self.dtype, self.num_warps, self.num_warps // self.warps_m_dq)
        tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.hdim)))
        num_values = cute.size(tCcC)
        view = dq_order_view(mdQacc[b, head, m_block * self.tile_m, None].iterator, num_values, self.num_threads)
        acc = cute.make_rmem_tensor(num_values, Float32)
        for v in cutlass.range_constexpr(num_values):
            acc[v] = view[v, tidx]
        store_dq_pairs(acc, tCcC, mdQ, b, head, m_block * self.tile_m, seqlen_q, self.dtype)
