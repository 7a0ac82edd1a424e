"""FlashAttention forward for Blackwell (sm_100a, B200) in CuTe DSL: two Q tiles per CTA, 1-CTA, or a
2-CTA pair (cfg.cta_group 2: a cluster of 2, .cta_group::2 MMAs of M = 256 issued by the leader CTA;
hd128 non-causal dense; docs/design/sm100_forward.md section 9); one Q tile per CTA (cfg.q_stage 1)
for head dims (192, 128) and 256, 1-CTA (section 10).

O = softmax(scale * Q K^T) V and LSE, exact. Design after FlashAttention-4's sm100 forward (Zadouri
et al. 2025; /work/shared/design/BLACKWELL.md section 1): tcgen05 MMAs from one thread into tensor
memory (TMEM), softmax over TMEM rows, P written back to TMEM as 16-bit and read by the PV MMA from
there, O rescaled in TMEM by a correction warpgroup only when a row max moved past tau.

Status: compile-verified, not run on hardware (the 2-CTA variant too). Every TMEM offset comes from
flash4.config.sm100.tmem_map, every setmaxnreg budget from register_plan, every mbarrier arrive
count from pipeline_specs (checked at trace time, kernels/sm100/pipes.py).
"""

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.tensor_utils import LayoutEnum

from flash4.kernels.sm100.plan import (TMEM_COLUMNS, WARP_ROLES, WARP_SIZE, RegisterPlan, pipeline_specs, ragged_keys,
                                 register_plan, tma_tx_bytes, tmem_alloc_cols, tmem_map)
from flash4.constants import LOG2E, THREADS_PER_WG
from flash4.kernels.common import geometry
from flash4.kernels.common.dsl import DSL_DTYPES
from flash4.kernels.common.layout import select_modes
from flash4.kernels.common.pipeline import next_state
from flash4.kernels.common.scheduler import TileSchedule
from flash4.kernels.common.seqinfo import SeqInfo, store_rows_predicated
from flash4.kernels.sm100.pipes import (ArrivalLedger, Pipe, named_barrier_arrive, named_barrier_sync, tcgen05_fence_after,
                                         tcgen05_fence_before, thread_group)
from flash4.kernels.sm100.softmax import RowSoftmax, mask_row

# Named barrier ids of this kernel (0 is __syncthreads).
TMEM_PTR_BARRIER = 1  # MMA + softmax + correction warps: TMEM allocated (ptr in smem) / done with TMEM
# Columns of O per TMEM load/store in the correction rescale (FA4 corr_tile_size, tunable).
RESCALE_COLS = 16
# Rows of O per pass of the varlen epilogue's row-by-row store (8 x 128 bf16 columns: 4 registers a
# lane; a whole 128-row tile at once spilled 301 LDL/STL at the epilogue warp's 56 registers).
EPI_ROWS = 8


class FlashAttentionForwardSm100:
    """Warp-specialized forward, one CTA per tile of 2 x 128 query rows (Q tiles 0 and 1).

    Warp roles (flash4.config.sm100.WARP_ROLES; 16 warps, 512 threads):
      * softmax0 = warps 0-3, softmax1 = warps 4-7: thread t owns row t of its Q tile (TMEM lane t):
        loads S_i (tcgen05.ld 32x32b), masks diagonal / seqlen_k blocks, row max in-thread, lazy
        rescale (tau), P_i = exp2 -> 16-bit -> tcgen05.st into S_i's upper half; sends the O rescale
        factor (and finally 1 / row_sum) to the correction warpgroup through smem; writes LSE.
      * correction = warps 8-11: rescales O_i in TMEM when a warp's rows moved their max (warp
        vote), then O_i / row_sum -> 16-bit -> smem sO[i] for the epilogue.
      * mma = warp 12: allocates TMEM (512 columns, tmem_map), issues S_i = Q_i K^T and
        O_i += P_i V (P from TMEM) with tcgen05.mma, signals with tcgen05.commit; frees TMEM.
      * epilogue = warp 13: TMA store of sO[i]. load = warp 14: TMA loads of Q0, Q1, K, V.
      * idle = warp 15.
    Pipelines (producer -> consumer, flash4.config.sm100.pipeline_specs has the arrive counts; the
    per-Q-tile ones have one stage per Q tile, indexed by the tile, with a phase bit per round):
      * q (2 stages, TMA): load -> mma. Q0, Q1 of the tile; released after the tile's last QK^T.
      * kv (kv_stages, TMA): load -> mma, ring order K[n-1] V[n-1] K[n-2] V[n-2] ... (descending).
      * s_p_o: mma commits "S_i ready"; softmax_i arrives "P_i written", the correction "O_i
        rescaled / read out"; the mma waits for both before PV_i (FA4's pipeline_s_p_o).
      * sm_stats: softmax_i -> correction, the row's O factor for blocks 1..n-1, then 1 / row_sum
        (through smem sScale[row, i]).
      * o_full: mma -> correction, the tile's last PV_i is done (never waited empty: s_p_o orders it).
      * corr_epi: correction -> epilogue, sO[i] written; released after the TMA store read it.
      * v_tail (ragged keys only: varlen_k / seqused_k): load -> mma, the key-edge block's V rows
        past seqlen_k zeroed in smem (zero_v_tail, after fence.proxy.async) before the tile's first
        PV; acknowledged by the MMA's elected lane (docs/design/sm100_forward.md section 11).
    Per tile with n key blocks and Q tile i, every role counts the same n (flash4.geometry's
    n_block_max for the 256-row CTA tile); an empty tile (n = 0) touches only corr_epi (O = 0).
      mma: S_i(0) ; n - 1 times [wait s_p_o_i ; PV_i(j-1) ; S_i(j)] ; wait s_p_o_i ; PV_i(n-1) ; o_full_i.
      softmax_i: n times [wait S_i ; (j > 0: factor -> sm_stats) ; P_i -> TMEM ; arrive s_p_o_i] ;
        1 / row_sum -> sm_stats ; LSE -> global.
      correction: once at start [arrive s_p_o_i] ; n - 1 times [factor <- sm_stats ; rescale O_i if a
        row of the warp moved ; arrive s_p_o_i] ; 1 / row_sum <- sm_stats ; wait o_full_i ; O_i -> sO[i]
        -> corr_epi ; arrive s_p_o_i (O_i read: the next tile's first PV may overwrite it).
      So each phase of s_p_o_i gets 128 softmax + 128 correction arrivals, in order, and the MMA
      waits once per phase.
    MMA steady state per key block j >= 1 (Q tiles i = 0, 1):
      wait V[j-1]; for i: wait s_p_o_i (P_i(j-1) written, O_i rescaled) ; O_i += P_i V[j-1] ;
      (i = 1: release V[j-1]) ; (i = 0: wait K[j]) ; S_i = Q_i K[j] ; commit s_p_o_i ; then release K[j].
      The commit of S_i(j) also covers PV_i(j-1) (tcgen05.commit tracks all earlier MMAs of the
      thread), so when softmax_i sees S_i(j) the correction may read O_i; and QK^T(j+1) is issued
      after PV(j), so S_i is overwritten only after P_i(j) was consumed.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.dtype = DSL_DTYPES[cfg.dtype]
        self.hdim, self.hdim_v = cfg.headdim, cfg.hdim_v
        self.q_stage, self.kv_stages = cfg.q_stage, cfg.kv_stages
        self.tile_m, self.tile_n, self.cta_tile_m = cfg.tile_m, cfg.tile_n, cfg.cta_tile_m
        self.causal = cfg.causal
        # 2-CTA (cta_group 2): a cluster of 2 CTAs per tile; the leader CTA (rank 0) issues
        # .cta_group::2 MMAs of M = 2 x tile_m, each CTA holding tile_m rows of the Q tile (and of
        # S, P, O in its own TMEM) and half of each K/V block (the B operand split along N).
        self.cta_group = cfg.cta_group
        self.two_cta = cfg.cta_group == 2
        self.mma_tiler_qk = (self.cta_group * self.tile_m, self.tile_n, self.hdim)
        self.mma_tiler_pv = (self.cta_group * self.tile_m, self.hdim_v, self.tile_n)
        self.tmem = tmem_map(cfg)
        self.tmem_cols = tmem_alloc_cols(cfg)
        self.regs: RegisterPlan = register_plan(cfg)
        self.specs = pipeline_specs(cfg)
        self.roles = WARP_ROLES
        self.num_threads = cfg.num_threads
        # q_stage 1 ((192, 128), hd256): softmax0 owns the one Q tile; softmax1's warpgroup is idle
        # (it only lowers its registers), so it takes no part in the TMEM named barrier.
        self.softmax_roles = ("softmax0", "softmax1")[:self.q_stage]
        # Ragged keys (varlen_k, seqused_k): V rows past seqlen_k of a tile's key-edge block hold other
        # data (the next packed sequence, stale cache rows); the load warp zeroes them before the
        # first PV (zero_v_tail, pipeline v_tail; issue 25: 0 x NaN = NaN in P V).
        self.ragged_k = ragged_keys(cfg)
        # q_stage 1 with packed sequences: every role builds its tile schedule after its setmaxnreg (built
        # once before the role branch, its L2 group / query-block count stayed live into every role and
        # spilled at hd256: 4 LDL + 1 STL full, 10 + 1 causal when only the schedule object moved)
        self.late_sched = self.q_stage == 1 and (cfg.varlen_q or cfg.varlen_k or cfg.seqused_q or cfg.seqused_k)
        self.tmem_users = WARP_SIZE * sum(len(WARP_ROLES[r]) for r in ("mma", *self.softmax_roles, "correction"))
        self.buffer_align_bytes = 1024
        self.smem_budget = cfg.smem_bytes()

    # ------------------------------------------------------------------ host side (trace time)
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, headdim), headdim contiguous
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_k, headdim)
        mV: cute.Tensor,  # (batch, seqlen_k, nheads_k, headdim_v)
        mO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim_v)
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) float32, natural log
        mLSEhi: cute.Tensor,  # (batch, nheads, seqlen_q) float32: log2-domain LSE = hi + lo, unrounded
        mLSElo: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],  # varlen_q / varlen_k / seqused_q configs: (batch + 1,) /
        mCuSeqlensK: Optional[cute.Tensor],  # (batch + 1,) / (batch,) int32 (kernels/common/seqinfo.py);
        mSeqUsedQ: Optional[cute.Tensor],  # seqused_k configs: (batch,) int32 key counts; the rest of the
        mSeqUsedK: Optional[cute.Tensor],  # sm90 forward's ABI must be None (paged K/V, split-KV: not built)
        mPageTable: Optional[cute.Tensor],
        mOacc: Optional[cute.Tensor],
        mLSEacc: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],  # sink configs: (nheads,) fp32 sink logits (natural units)
        softmax_scale_log2: Float32,  # softmax_scale * log2(e)
        softcap_scale: Float32,  # softcap configs: tanh's input scale softmax_scale / softcap (score.scales)
        batch_size: Int32,
        max_seqlen_q: Int32,  # sizes the tile space (cta_tile_m rows per tile)
        num_splits: Int32,  # ignored (1)
        window_left: Int32,  # local configs: the window's sides (flash4.geometry.window_sides; UNBOUNDED
        window_right: Int32,  # for an open side); ignored otherwise
        l2_group: Int32,  # (head, batch) pairs per L2 section of the tile order (>= 1)
        num_ctas: Int32,  # grid size: cta_group CTAs per tile (ceil(max_seqlen_q / cta_tile_m) * heads * batch tiles)
        stream: cuda.CUstream,
    ):
        for name, t in (("page_table", mPageTable), ("o_accum", mOacc), ("lse_accum", mLSEacc)):
            if const_expr(t is not None):
                raise NotImplementedError(f"flash4 fwd_sm100: {name} is not implemented on sm100 yet")
        for name, t, flag in (("cu_seqlens_q", mCuSeqlensQ, self.cfg.varlen_q),
                              ("cu_seqlens_k", mCuSeqlensK, self.cfg.varlen_k),
                              ("seqused_q", mSeqUsedQ, self.cfg.seqused_q),
                              ("seqused_k", mSeqUsedK, self.cfg.seqused_k)):
            if const_expr((t is not None) != flag):
                raise ValueError(f"flash4 fwd_sm100: {name} {'missing' if flag else 'given'} for a config with "
                                 f"{name.replace('cu_seqlens', 'varlen')}={flag}")
        if const_expr((mSink is not None) != self.cfg.sink):
            raise ValueError(f"flash4 fwd_sm100: sink tensor {'missing' if self.cfg.sink else 'given'} for a config with "
                             f"sink={self.cfg.sink}")
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError(f"flash4 fwd_sm100: tensors must all be {self.dtype}")
        # Kernel views: Q, K, O (seqlen, d, heads, batch); V transposed (dv, seqlen_k, heads_k, batch)
        # (the PV MMA's B operand, MN-major); LSE (seqlen_q, heads, batch).
        mQ, mK, mO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]
        mV = select_modes(mV, [3, 1, 2, 0])
        mLSE, mLSEhi, mLSElo = [select_modes(t, [2, 1, 0]) for t in (mLSE, mLSEhi, mLSElo)]

        cta_group = tcgen05.CtaGroup.TWO if const_expr(self.two_cta) else tcgen05.CtaGroup.ONE
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, cta_group, self.mma_tiler_qk[:2])
        # P comes from TMEM (K-major), V from smem (MN-major).
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, cta_group,
            self.mma_tiler_pv[:2], tcgen05.OperandSource.TMEM)
        cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((self.cta_group, 1, 1)), (tiled_mma_qk.thr_id.shape,))

        # (MMA, MMA_M, MMA_K, STAGE) smem layouts; tP: P's layout as the PV MMA's A operand in TMEM.
        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, self.mma_tiler_qk, self.dtype, self.q_stage)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, self.mma_tiler_qk, self.dtype, self.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, self.mma_tiler_pv, self.dtype, self.q_stage)
        sV_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, self.mma_tiler_pv, self.dtype, self.kv_stages)
        if const_expr(self.hdim != self.hdim_v):
            # Dv != D: K and V blocks take alternate stages of one ring, so both views step by the
            # larger block (K's), or V's stage i would overlap K's stage i - 1.
            sK_layout, sV_layout = self.common_stage_stride(sK_layout, sV_layout)
        self.o_layout = LayoutEnum.from_tensor(mO)
        self.epi_tile = (self.tile_m, self.hdim_v)
        sO_layout = sm100_utils.make_smem_layout_epi(self.dtype, self.o_layout, self.epi_tile, self.q_stage)

        load_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), self.mma_tiler_qk, tiled_mma_qk,
            cluster_layout_vmnk.shape)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mK, cute.select(sK_layout, mode=[0, 1, 2]), self.mma_tiler_qk, tiled_mma_qk,
            cluster_layout_vmnk.shape)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mV, cute.select(sV_layout, mode=[0, 1, 2]), self.mma_tiler_pv, tiled_mma_pv,
            cluster_layout_vmnk.shape)
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), self.epi_tile)
        # tx bytes per stage: one CTA's, times cta_group (a pair's leader barrier counts both halves)
        self.tma_bytes_q = tma_tx_bytes(self.cfg, cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2])))
        self.tma_bytes_k = tma_tx_bytes(self.cfg, cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2])))
        # the ring's barriers expect K's bytes; a V block of other size (Dv != D) passes its own
        self.tma_bytes_v = tma_tx_bytes(self.cfg, cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1, 2])))
        if const_expr((self.tma_bytes_v != self.tma_bytes_k) != (self.hdim != self.hdim_v)):
            raise RuntimeError(f"flash4 fwd_sm100: V blocks of {self.tma_bytes_v} bytes, K blocks of {self.tma_bytes_k} "
                               f"with head dims ({self.hdim}, {self.hdim_v})")

        kv_elems = max(cute.cosize(sK_layout), cute.cosize(sV_layout))
        smem_tiles = (cute.cosize(sQ_layout) + cute.cosize(sO_layout) + kv_elems) * (self.dtype.width // 8)
        if const_expr(smem_tiles != self.smem_budget):
            raise RuntimeError(f"flash4 fwd_sm100: smem tiles take {smem_tiles} bytes, the config says {self.smem_budget}")
        num_mbar = 2 * sum(s.stages for s in self.specs.values())

        SharedStorage = self.shared_storage(num_mbar, cute.cosize(sO_layout), cute.cosize(sQ_layout), kv_elems)

        kernel = self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mO if const_expr(self.cfg.varlen_q) else None, mLSE, mLSEhi, mLSElo, mSink,
            (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK), tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            softmax_scale_log2, softcap_scale, batch_size, max_seqlen_q, l2_group, window_left, window_right,
            sQ_layout, sK_layout, tP_layout, sV_layout, sO_layout, tiled_mma_qk, tiled_mma_pv, SharedStorage,
        )
        if const_expr(self.two_cta):
            # a cluster of 2 per tile: num_ctas (flash4.launch.fwd_grid) is a multiple of 2
            kernel.launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], cluster=[self.cta_group, 1, 1],
                          stream=stream, min_blocks_per_mp=1)
        else:
            kernel.launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @staticmethod
    def common_stage_stride(sK_layout, sV_layout):
        """sK / sV layouts whose stage mode steps by the larger of their two stage strides (the K/V
        ring of Dv != D: one buffer, either block in any stage)."""
        stride = max(max(sK_layout.outer.stride[-1], 0), max(sV_layout.outer.stride[-1], 0))

        def restride(layout):
            outer = layout.outer
            return cute.make_composed_layout(layout.inner, 0, cute.make_layout(
                outer.shape, stride=(*outer.stride[:-1], stride)))
        return restride(sK_layout), restride(sV_layout)

    def shared_storage(self, num_mbar: int, o_elems: int, q_elems: int, kv_elems: int):
        """The kernel's smem struct: mbarriers, the TMEM address, sScale, sO, sQ, the K/V ring; a
        2-CTA config also the pair's TMEM dealloc mbarrier (TmemAllocator's handshake)."""
        dtype, align = self.dtype, self.buffer_align_bytes
        if self.two_cta:
            @cute.struct
            class SharedStorage2Cta:
                mbar: cute.struct.MemRange[cutlass.Int64, num_mbar]
                tmem_dealloc_mbar: cutlass.Int64
                tmem_holding_buf: Int32
                sScale: cute.struct.MemRange[Float32, self.q_stage * self.tile_m]
                sO: cute.struct.Align[cute.struct.MemRange[dtype, o_elems], align]
                sQ: cute.struct.Align[cute.struct.MemRange[dtype, q_elems], align]
                sK: cute.struct.Align[cute.struct.MemRange[dtype, kv_elems], align]
            return SharedStorage2Cta

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, num_mbar]
            tmem_holding_buf: Int32
            # softmax -> correction: per row and Q tile, the O rescale factor or 1 / row_sum
            sScale: cute.struct.MemRange[Float32, self.q_stage * self.tile_m]
            sO: cute.struct.Align[cute.struct.MemRange[dtype, o_elems], align]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, q_elems], align]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, kv_elems], align]
        return SharedStorage

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mO_rows: Optional[cute.Tensor],
        mLSE: cute.Tensor, mLSEhi: cute.Tensor, mLSElo: cute.Tensor, mSink: Optional[cute.Tensor],
        seqs: tuple,
        tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_O: cute.CopyAtom,
        softmax_scale_log2: Float32, softcap_scale: Float32, batch_size: Int32, max_seqlen_q: Int32, l2_group: Int32,
        window_left: Int32, window_right: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.roles["load"][0]:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        ledger = ArrivalLedger(self.specs)
        cluster_vmnk = self.cluster_layout_vmnk(tiled_mma_qk)
        pipes = self.make_pipelines(storage.mbar.data_ptr(), ledger, cluster_vmnk)
        # cta_v: this CTA's rank in its pair (2-CTA; 0 = the leader, which issues the MMAs), else 0
        cta_v = 0
        is_leader = True
        if const_expr(self.two_cta):
            cta_v = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            is_leader = cta_v == 0
            # The dealloc handshake's mbarrier is initialized here (the allocator warp), before the
            # cluster arrive that publishes every barrier init to the peer CTA.
            tmem = TmemAllocator(storage.tmem_holding_buf.ptr,
                                 barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_PTR_BARRIER,
                                                                            num_threads=self.tmem_users),
                                 allocator_warp_id=self.roles["mma"][0], is_two_cta=True,
                                 two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr, arch="sm_100")
            pipeline_init_arrive(cluster_shape_mn=cluster_vmnk, is_relaxed=True)
        else:
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (MMA, MMA_M, MMA_K, q_stage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (MMA, MMA_N, MMA_K, kv_stages)
        # V shares K's ring (the stage a block lands in decides which it is), with V's own swizzle.
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # (tile_m, dv, q_stage)
        sScale = storage.sScale.get_tensor(cute.make_layout((self.tile_m, self.q_stage)))
        if const_expr(not self.two_cta):
            tmem = TmemAllocator(storage.tmem_holding_buf.ptr,
                                 barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_PTR_BARRIER,
                                                                            num_threads=self.tmem_users),
                                 allocator_warp_id=self.roles["mma"][0], arch="sm_100")

        # Slice 0 of each MMA: the CTA-local view (TMEM accumulators, smem operands, row coordinates:
        # a 2-CTA CTA holds rows 0 .. tile_m - 1 of its half in its own TMEM lanes).
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        # The load warp's global partition: this CTA's half of each operand (slice cta_v).
        load_mma_qk, load_mma_pv = thr_mma_qk, thr_mma_pv
        if const_expr(self.two_cta):
            load_mma_qk, load_mma_pv = tiled_mma_qk.get_slice(cta_v), tiled_mma_pv.get_slice(cta_v)
        sched_args = (max_seqlen_q, mQ.shape[2], batch_size, l2_group)
        sched = None if const_expr(self.late_sched) else self.make_sched(*sched_args)  # late_sched: role_sched
        # the sliding window's (left, right) sides (local configs), read by every role's key-block range
        window = (window_left, window_right) if const_expr(self.cfg.local) else None
        if const_expr(self.two_cta):
            # every barrier of both CTAs initialized (the cluster arrive above) before any remote
            # arrive, TMA or the pair's TMEM allocation
            pipeline_init_wait(cluster_shape_mn=cluster_vmnk)

        # setmaxnreg per warpgroup (register_plan), then each role. The fourth warpgroup (mma,
        # epilogue, load, idle) shares one budget.
        softmax_args = (thr_mma_qk, sScale, mQ, mK, mLSE, mLSEhi, mLSElo, mSink, pipes, softmax_scale_log2,
                        softcap_scale, sched, window, seqs, cta_v)
        if warp_idx < self.roles["correction"][0]:
            if const_expr(self.q_stage == 1):
                # one Q tile: softmax0 (warps 0-3) owns it; softmax1's warpgroup (4-7) idles and
                # gives its registers back (register_plan; FA4 moves these warps to its empty warps)
                if warp_idx < self.roles["softmax1"][0]:
                    self.softmax_role(warp_idx, softmax_args, sched_args)
                else:
                    self.set_regs(self.regs.per_warpgroup()[1])
            else:
                self.softmax_role(warp_idx, softmax_args)
        elif warp_idx < self.roles["mma"][0]:
            self.set_regs(self.regs.correction)
            self.wait_tmem_alloc()
            self.correction(thr_mma_pv, sScale, sO, mQ, mK, pipes, self.role_sched(sched, sched_args), window, seqs,
                            cta_v)
            self.release_tmem()
        else:
            self.set_regs(self.regs.other)
            if warp_idx == self.roles["mma"][0]:
                tmem.allocate(self.tmem_cols)  # 2-CTA: .cta_group::2, both CTAs' allocator warps
                self.wait_tmem_alloc()
                if const_expr(self.two_cta):
                    if is_leader:  # the pair's MMAs (and their commits) come from the leader only
                        self.mma(tiled_mma_qk, tiled_mma_pv, thr_mma_pv, sQ, sK, sV, tP_layout, mQ, mK, pipes, sched,
                                 window, seqs)
                else:
                    self.mma(tiled_mma_qk, tiled_mma_pv, thr_mma_pv, sQ, sK, sV, tP_layout, mQ, mK, pipes,
                             self.role_sched(sched, sched_args), window, seqs)
                # TMEM is free once every user arrived (the correction after its last O read). The
                # allocated address is read back only now (no register holds it through the loop).
                # 2-CTA: free() first exchanges an arrive with the peer's allocator warp (each CTA's
                # users are done), then deallocates .cta_group::2.
                tmem.relinquish_alloc_permit()
                named_barrier_sync(TMEM_PTR_BARRIER, self.tmem_users)
                tcgen05_fence_after()
                tmem.free(tmem.retrieve_ptr(Float32), self.tmem_cols)
            elif warp_idx == self.roles["epilogue"][0]:
                self.epilogue(mO, mO_rows, mQ, mK, sO, tma_atom_O, pipes, self.role_sched(sched, sched_args), seqs,
                              cta_v)
            elif warp_idx == self.roles["load"][0]:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, load_mma_qk, load_mma_pv,
                          pipes, self.role_sched(sched, sched_args), window, seqs)
        ledger.check()

    def softmax_role(self, warp_idx, softmax_args, sched_args=None):
        """A softmax warpgroup: its registers, the TMEM handshake, its Q tile's softmax loop."""
        self.set_regs(self.regs.softmax)
        if const_expr(self.late_sched):  # the schedule (softmax_args[11]) built after setmaxnreg
            softmax_args = softmax_args[:11] + (self.role_sched(None, sched_args),) + softmax_args[12:]
        self.wait_tmem_alloc()
        # q_stage 2: softmax0 (warps 0-3) owns Q tile 0, softmax1 (4-7) Q tile 1: one code path, the
        # Q tile (pipeline stage, TMEM columns) a warp-uniform runtime value. q_stage 1: tile 0.
        stage = 0 if const_expr(self.q_stage == 1) else warp_idx // len(self.roles["softmax0"])
        self.softmax(stage, *softmax_args)
        self.release_tmem()

    def make_sched(self, max_seqlen_q, num_heads, batch_size, l2_group):
        """The tile schedule: cta_tile_m-row query tiles of every (head, batch), L2-grouped, LPT when causal."""
        num_m_blocks = cute.ceil_div(max_seqlen_q, self.cta_tile_m)
        return TileSchedule(num_m_blocks, num_heads, num_heads * batch_size, l2_group, self.causal and self.cfg.lpt)

    def role_sched(self, sched, sched_args):
        """The tile schedule a role walks: `sched`, or (late_sched) one built here, after the role's
        setmaxnreg (its values computed in the role: none stays live across the register split)."""
        return self.make_sched(*sched_args) if const_expr(self.late_sched) else sched

    def set_regs(self, regs: int):
        if const_expr(RegisterPlan.is_increase(regs)):
            cute.arch.setmaxregister_increase(regs)
        else:
            cute.arch.setmaxregister_decrease(regs)

    def wait_tmem_alloc(self):
        """Wait for the MMA warp's tcgen05.alloc (it takes part in the same named barrier)."""
        tcgen05_fence_before()
        named_barrier_sync(TMEM_PTR_BARRIER, self.tmem_users)
        tcgen05_fence_after()

    def release_tmem(self):
        """This warp is done with TMEM: arrive on the barrier the MMA warp waits on before dealloc."""
        tcgen05_fence_before()
        named_barrier_arrive(TMEM_PTR_BARRIER, self.tmem_users)

    def tmem_base(self):
        """The TMEM base address. The MMA warp allocates all TMEM_COLUMNS columns, so the allocation
        starts at lane 0, column 0: address 0 (FA4 relies on the same). A constant base makes every
        TMEM address an immediate (the MMA warp has 48-56 registers)."""
        if const_expr(self.tmem_cols != TMEM_COLUMNS):
            raise NotImplementedError(f"flash4 fwd_sm100: a {self.tmem_cols}-column TMEM allocation needs the "
                                      "allocated address (tmem.retrieve_ptr), not the constant base 0")
        return cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)

    def cluster_layout_vmnk(self, tiled_mma_qk):
        """(V, M, N, K) layout of the cluster: (1, 1, 1, 1), or a pair (2, 1, 1, 1) for 2-CTA."""
        return cute.tiled_divide(cute.make_layout((self.cta_group, 1, 1)), (tiled_mma_qk.thr_id.shape,))

    def first_tile(self):
        """This CTA's first tile: blockIdx.x (2-CTA: the cluster's index, blockIdx.x / 2)."""
        if const_expr(self.two_cta):
            return cute.arch.block_idx()[0] // self.cta_group
        return cute.arch.block_idx()[0]

    def tile_stride(self):
        """Tiles between a CTA's consecutive tiles: gridDim.x (2-CTA: the number of clusters)."""
        if const_expr(self.two_cta):
            return cute.arch.grid_dim()[0] // self.cta_group
        return cute.arch.grid_dim()[0]

    def q_tile(self, m_block, stage, cta_v):
        """Index of this CTA's 128-row Q tile `stage` of tile m_block in units of tile_m rows: the
        stage's Q tile, and in a pair this CTA's half of it (rows ((q_stage m_block + stage) 2 +
        cta_v) x 128, as the .cta_group::2 MMA splits M)."""
        if const_expr(self.two_cta):
            return (self.q_stage * m_block + stage) * self.cta_group + cta_v
        return self.q_stage * m_block + stage

    def make_pipelines(self, mbar_ptr, ledger: ArrivalLedger, cluster_vmnk) -> dict:
        """Every pipeline of pipeline_specs, created from this kernel's own role table (which thread
        groups arrive) and wrapped in a Pipe that checks the DSL's init counts against the spec.
        2-CTA: the TMA and MMA-bridging pipelines get the pair's cluster layout (leader-only
        expect_tx, multicast commits, thread releases routed to the leader CTA's barrier), and the
        thread side of s_p_o / o_full counts both CTAs' threads."""
        threads = {role: WARP_SIZE * len(w) for role, w in self.roles.items()}
        softmax_wg = threads["softmax0"]  # the softmax warpgroup of one Q tile
        one = thread_group(1)  # one elected thread: TMA expect_tx, tcgen05.commit
        pipes, offset = {}, 0
        pair = {"cta_layout_vmnk": cluster_vmnk} if self.two_cta else {}

        def add(name, cls, producer, consumer, **kw):
            nonlocal offset
            spec = self.specs[name]
            p = cls.create(barrier_storage=mbar_ptr + offset, num_stages=spec.stages, producer_group=producer,
                           consumer_group=consumer, defer_sync=True, **kw)
            offset += 2 * spec.stages
            pipes[name] = Pipe(spec, p, ledger)

        g = self.cta_group
        add("q", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes_q, **pair)
        add("kv", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes_k, **pair)
        add("s_p_o", pipeline.PipelineUmmaAsync, one, thread_group(g * (softmax_wg + threads["correction"])), **pair)
        add("sm_stats", pipeline.PipelineAsync, thread_group(softmax_wg), thread_group(threads["correction"]))
        add("o_full", pipeline.PipelineUmmaAsync, one, thread_group(g * threads["correction"]), **pair)
        add("corr_epi", pipeline.PipelineAsync, thread_group(threads["correction"]),
            thread_group(len(self.roles["epilogue"])))  # the epilogue warp's elected lane
        if const_expr(self.ragged_k):
            # every lane of the load warp (each after its own fence.proxy.async) -> the MMA warp's elected lane
            add("v_tail", pipeline.PipelineAsync, thread_group(threads["load"]), thread_group(len(self.roles["mma"])))
        return pipes

    # ---------------------------------------------------------------- tile geometry (all roles)
    def key_blocks(self, m_block, seq, window):
        """(n_min, n): the CTA tile (cta_tile_m rows) visits key blocks n_min .. n_min + n - 1, from the
        last down (flash4.geometry's ranges; n <= 0: no key, an empty tile). n_min is the constant 0
        without a window. Every role asks this, so all count the same n blocks per tile."""
        n_max = geometry.n_block_max(m_block, seq.seqlen_q, seq.seqlen_k, self.cta_tile_m, self.tile_n, self.causal,
                                     window)
        if const_expr(self.cfg.varlen_q or self.cfg.seqused_q):
            # a tile past its sequence's queries (the grid is sized by max_seqlen_q): empty
            n_max = cutlass.select_(m_block * self.cta_tile_m < seq.seqlen_q, n_max, 0)
        if const_expr(window is None):
            return 0, n_max
        n_min = geometry.n_block_min(m_block, seq.seqlen_q, seq.seqlen_k, self.cta_tile_m, self.tile_n, window)
        return n_min, n_max - n_min

    def tile_seq(self, mQ, mK, batch, seqs):
        """SeqInfo of sequence `batch`; seqs: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), None
        where off."""
        return SeqInfo(batch, mQ.shape[0], mK.shape[0], seqs[0], seqs[1], seqs[2], seqs[3])

    def v_tail_rows(self, seq, n_min, n_blocks):
        """Valid keys of the tile's key-edge block n_min + n_blocks - 1 (the first the MMA consumes, the
        only one that can cross seqlen_k): the V rows at or past it are zeroed when it is < tile_n.
        The load and MMA warps both ask this (ragged configs), so they agree on the tiles that signal."""
        return seq.seqlen_k - (n_min + n_blocks - 1) * self.tile_n

    def v_view(self, mV, seq, head_kv):
        """V of the sequence in its transposed kernel view (dv, seqlen_k): packed K/V start at the
        sequence's offset_k (a domain offset, so TMA coordinates shift with it)."""
        if const_expr(self.cfg.varlen_k):
            return cute.domain_offset((0, seq.offset_k), mV[None, None, head_kv, 0])
        return mV[None, None, head_kv, seq.batch]

    # ---------------------------------------------------------------- load warp
    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, thr_mma_qk, thr_mma_pv, pipes, sched,
             window, seqs):
        """TMA loads per tile with key blocks n_min .. n_min + n - 1: K[last], Q0, Q1, V[last], then
        K[j], V[j] down to n_min (the MMA's order)."""
        pipe_q, pipe_kv = pipes["q"], pipes["kv"]
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        vt_phase = Int32(1)  # ragged keys: v_tail's producer phase (its first wait on empty passes)
        one_cta = cute.make_layout(1)
        tile_idx = self.first_tile()
        while tile_idx < sched.num_tiles():
            m_block, head, batch = sched.coords(tile_idx)
            seq = self.tile_seq(mQ, mK, batch, seqs)
            n_min, n_blocks = self.key_blocks(m_block, seq, window)
            if n_blocks > 0:
                head_kv = head // qhead_per_kvhead
                # (MMA, MMA_M, MMA_K, m_blocks of tile_m rows) / (MMA, MMA_N, MMA_K, n_blocks)
                tSgQ = thr_mma_qk.partition_A(
                    cute.local_tile(seq.q_view(mQ, head), (self.mma_tiler_qk[0], self.hdim), (None, 0)))
                tSgK = thr_mma_qk.partition_B(cute.local_tile(seq.k_view(mK, head_kv), (self.tile_n, self.hdim), (None, 0)))
                tOgV = thr_mma_pv.partition_B(
                    cute.local_tile(self.v_view(mV, seq, head_kv), (self.hdim_v, self.tile_n), (0, None)))
                tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one_cta, cute.group_modes(sQ, 0, 3),
                                                   cute.group_modes(tSgQ, 0, 3))
                tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one_cta, cute.group_modes(sK, 0, 3),
                                                   cute.group_modes(tSgK, 0, 3))
                tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one_cta, cute.group_modes(sV, 0, 3),
                                                   cute.group_modes(tOgV, 0, 3))
                last = n_min + n_blocks - 1
                kv_state = self.load_block(tma_atom_K, tKgK, tKsK, last, pipe_kv, kv_state)
                for stage in cutlass.range_constexpr(self.q_stage):
                    q_state = self.load_block(tma_atom_Q, tQgQ, tQsQ, self.q_stage * m_block + stage, pipe_q, q_state)
                v_state = kv_state
                kv_state = self.load_block(tma_atom_V, tVgV, tVsV, last, pipe_kv, kv_state, self.v_tx())
                if const_expr(self.ragged_k):
                    valid = self.v_tail_rows(seq, n_min, n_blocks)
                    if valid < self.tile_n:
                        vt_phase = self.zero_v_tail(sV, pipe_kv, v_state, pipes["v_tail"], vt_phase, valid)
                for i in cutlass.range(n_blocks - 1, unroll=1):
                    kv_state = self.load_block(tma_atom_K, tKgK, tKsK, last - 1 - i, pipe_kv, kv_state)
                    kv_state = self.load_block(tma_atom_V, tVgV, tVsV, last - 1 - i, pipe_kv, kv_state, self.v_tx())
            tile_idx += self.tile_stride()
        # Wait for the MMA warp's last releases (no tcgen05.commit may land after exit).
        pipe_kv.producer_tail(kv_state)
        pipe_q.producer_tail(q_state)

    @cute.jit
    def zero_v_tail(self, sV, pipe_kv, v_state, pipe_vt, vt_phase, valid):
        """Ragged keys (load warp, right after issuing the key-edge block's V): wait until that V has
        landed, zero its rows >= valid (the keys past seqlen_k: another sequence's or stale rows; a
        NaN / inf there would reach O through 0 x NaN in P V), fence.proxy.async.shared::cta (these
        generic-proxy stores before the MMA's async-proxy reads and the stage's later TMA refill),
        then signal the MMA warp on v_tail, which it waits on before the tile's first PV.
        Race-free: the stage is released (and refilled) only after that PV, so the wait on its full
        barrier sees exactly this load's phase (the warp itself acquired the stage for it). No
        deadlock: the wait is on this warp's own TMA; v_tail's empty side waits for the MMA's
        acknowledgement of the previous tile's signal, which the MMA gives before any PV of that
        tile, needing only loads this warp issued before it. Returns v_tail's next producer phase."""
        pipe_kv.wait_full(v_state.index, v_state.phase ^ 1)  # a producer's phase is the consumer's ^ 1
        lane = cute.arch.lane_idx()
        tiled_zero = self.v_zero_copy()
        thr = tiled_zero.get_slice(lane)
        sVt = self.v_stage_rows(sV, v_state.index)  # (tile_n, dv) of the stage
        tVsV = thr.partition_D(sVt)
        tVcV = thr.partition_D(cute.make_identity_tensor((self.tile_n, self.hdim_v)))
        zeros = cute.make_fragment_like(tVsV)
        zeros.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(tVsV, mode=[1])):
            if tVcV[0, m, 0][0] >= valid:
                cute.copy(tiled_zero, zeros[None, m, None], tVsV[None, m, None])
        cute.arch.fence_view_async_shared()  # fence.proxy.async.shared::cta: generic zeros -> async proxy
        pipe_vt.wait_empty(0, vt_phase)  # the MMA took the previous tile's signal
        pipe_vt.arrive_full(0, "load")
        return vt_phase ^ 1

    def v_stage_rows(self, sV, index):
        """Stage `index` of the K/V ring as V's (tile_n keys, dv) view: sV's modes are (((dv...), 16
        keys), 1, tile_n / 16, stage) (the PV MMA's MN-major B operand), regrouped into (keys, dv)
        with the same swizzled pointer."""
        stage = sV[None, None, None, index]
        o = stage.layout
        d_shape, k16_shape = o.shape[0]
        d_stride, k16_stride = o.stride[0]
        # the tcgen05 B-operand partition of a (dv, tile_n) tile is ((dv, 16), 1, tile_n / 16) with
        # coordinates (d, k16 + 16 kb) (thr_mma_pv.partition_B of an identity tensor:
        # ((dv,16),1,8):((1@0,1@1),0,16@1)): the regrouping relies on that shape
        if const_expr(cute.size(d_shape) != self.hdim_v or k16_shape * cute.size(o.shape[2]) != self.tile_n
                      or cute.size(o.shape[1]) != 1):
            raise RuntimeError(f"flash4 fwd_sm100: V stage layout {o} is not ((dv, k), 1, tile_n / k)")
        layout = cute.make_layout(((k16_shape, o.shape[2]), d_shape), stride=((k16_stride, o.stride[2]), d_stride))
        return cute.make_tensor(stage.iterator, layout)

    def v_zero_copy(self):
        """The load warp's tiled copy over a (tile_n, dv) V stage: 16-byte stores, lanes along dv."""
        vec = 128 // self.dtype.width
        per_row = math.gcd(self.hdim_v // vec, WARP_SIZE)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        thr_layout = cute.make_ordered_layout((WARP_SIZE // per_row, per_row), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))

    def v_tx(self):
        """A V block's tx bytes where they differ from the ring's (K's; Dv != D), else None."""
        return self.tma_bytes_v if const_expr(self.tma_bytes_v != self.tma_bytes_k) else None

    @cute.jit
    def load_block(self, tma_atom, tXgX, tXsX, block, pipe, state, expected_tx: cutlass.Constexpr = None):
        """TMA copy of block `block` of a partitioned global tensor into the ring stage of `state`
        (expected_tx: the block's bytes, when not the barrier's init tx count)."""
        pipe.acquire(state, "load", expected_tx)
        cute.copy(tma_atom, tXgX[None, block], tXsX[None, state.index], tma_bar_ptr=pipe.barrier_full(state.index))
        return next_state(state)

    # ---------------------------------------------------------------- MMA warp
    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, thr_mma_pv, sQ, sK, sV, tP_layout, mQ, mK, pipes, sched, window, seqs):
        """tcgen05.mma from this warp (one thread issues): per tile S_i = Q_i K[n-1]^T for both Q
        tiles, then per block O_i += P_i V[j-1] and S_i = Q_i K[j]^T, finally O_i += P_i V[0].
        The Q tile i is a runtime loop index: its descriptors and TMEM addresses are computed where
        they are used, not hoisted out of the key-block loop (this warp has 48-56 registers)."""
        pipe_q, pipe_kv, pipe_spo, pipe_ofull = pipes["q"], pipes["kv"], pipes["s_p_o"], pipes["o_full"]
        tSrQ = tiled_mma_qk.make_fragment_A(sQ)  # (MMA, MMA_M, MMA_K, q_stage) smem descriptors
        tSrK = tiled_mma_qk.make_fragment_B(sK)  # (MMA, MMA_N, MMA_K, kv_stages)
        tOrV = tiled_mma_pv.make_fragment_B(sV)  # (MMA, MMA_N, MMA_K, kv_stages)
        base = self.tmem_base()
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        # P as the PV MMA's A operand in TMEM: (MMA, MMA_M, MMA_K), 16-bit elements.
        tOrP_layout = thr_mma_pv.make_fragment_A(
            cute.make_tensor(self.tmem_tensor_S(base, thr_mma_qk, 0).iterator, tP_layout.outer))[None, None, None, 0].layout

        q_phase = Int32(0)  # the Q ring's phase: both stages (Q tiles) once per tile
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        # The MMA's waits on s_p_o (one per Q tile and key block; one phase bit for both Q tiles):
        # the first needs the softmax's first P and the correction's initial release: phase 0.
        spo_phase = Int32(0)
        vt_phase = Int32(0)  # ragged keys: v_tail's consumer phase
        tile_idx = self.first_tile()
        while tile_idx < sched.num_tiles():
            m_block, head, batch = sched.coords(tile_idx)
            seq = self.tile_seq(mQ, mK, batch, seqs)
            n_min, n_blocks = self.key_blocks(m_block, seq, window)
            if n_blocks > 0:
                # Q tile i sits in stage i of the Q ring (two Q tiles per CTA tile, in order).
                pipe_kv.wait_full(kv_state.index, kv_state.phase)
                for stage in cutlass.range(self.q_stage, unroll=1):
                    pipe_q.wait_full(stage, q_phase)
                    self.gemm_qk(tiled_mma_qk, self.tmem_tensor_S(base, thr_mma_qk, stage),
                                 tSrQ[None, None, None, stage], tSrK[None, None, None, kv_state.index])
                    pipe_spo.arrive_full(stage, "mma")  # S_stage ready
                pipe_kv.arrive_empty(kv_state.index, "mma")
                kv_state = next_state(kv_state)
                if const_expr(self.ragged_k):
                    # the key-edge block's V rows past seqlen_k are zeroed (load warp) before any PV
                    if self.v_tail_rows(seq, n_min, n_blocks) < self.tile_n:
                        pipes["v_tail"].wait_full(0, vt_phase)
                        with cute.arch.elect_one():
                            pipes["v_tail"].arrive_empty(0, "mma")
                        vt_phase = vt_phase ^ 1
                        tcgen05_fence_after()
                for i in cutlass.range(n_blocks - 1, unroll=1):
                    v_state = kv_state
                    k_state = next_state(kv_state)
                    pipe_kv.wait_full(v_state.index, v_state.phase)
                    for stage in cutlass.range(self.q_stage, unroll=1):
                        pipe_spo.wait_empty(stage, spo_phase)  # P_stage written, O_stage rescaled
                        tcgen05_fence_after()
                        self.gemm_pv(tiled_mma_pv, self.tmem_tensor_O(base, thr_mma_pv, stage),
                                     self.tmem_tensor_P(base, tOrP_layout, stage),
                                     tOrV[None, None, None, v_state.index], i > 0)
                        if stage == self.q_stage - 1:
                            pipe_kv.arrive_empty(v_state.index, "mma")
                        if stage == 0:
                            pipe_kv.wait_full(k_state.index, k_state.phase)
                        self.gemm_qk(tiled_mma_qk, self.tmem_tensor_S(base, thr_mma_qk, stage),
                                     tSrQ[None, None, None, stage], tSrK[None, None, None, k_state.index])
                        pipe_spo.arrive_full(stage, "mma")
                    pipe_kv.arrive_empty(k_state.index, "mma")
                    kv_state = next_state(k_state)
                    spo_phase = spo_phase ^ 1
                # Q is read by no later MMA of this tile.
                for stage in cutlass.range_constexpr(self.q_stage):
                    pipe_q.arrive_empty(stage, "mma")
                q_phase = q_phase ^ 1
                pipe_kv.wait_full(kv_state.index, kv_state.phase)
                for stage in cutlass.range(self.q_stage, unroll=1):
                    pipe_spo.wait_empty(stage, spo_phase)
                    tcgen05_fence_after()
                    self.gemm_pv(tiled_mma_pv, self.tmem_tensor_O(base, thr_mma_pv, stage),
                                 self.tmem_tensor_P(base, tOrP_layout, stage),
                                 tOrV[None, None, None, kv_state.index], n_blocks > 1)
                    pipe_ofull.arrive_full(stage, "mma")  # the tile's O_stage is final
                pipe_kv.arrive_empty(kv_state.index, "mma")
                kv_state = next_state(kv_state)
                spo_phase = spo_phase ^ 1
            tile_idx += self.tile_stride()

    @cute.jit
    def gemm_qk(self, tiled_mma, tStS, tSrQ, tSrK):
        """S = Q K^T (zero-initialized): one tcgen05.mma per 16 columns of the head dim. A fresh MMA
        atom per call: setting ACCUMULATE on the kernel's tiled MMA would leak a value out of the loop."""
        mma_atom = cute.make_mma_atom(tiled_mma.op)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            mma_atom.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(mma_atom, tStS, tSrQ[None, None, k], tSrK[None, None, k], tStS)

    @cute.jit
    def gemm_pv(self, tiled_mma, tOtO, tOrP, tOrV, accumulate):
        """O (+)= P V with P from TMEM: one tcgen05.mma per 16 keys; O starts from zero unless accumulate."""
        mma_atom = cute.make_mma_atom(tiled_mma.op)
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            mma_atom.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)
            cute.gemm(mma_atom, tOtO, tOrP[None, None, k], tOrV[None, None, k], tOtO)

    # ---------------------------------------------------------------- TMEM tensors (tmem_map)
    def tmem_tensor_S(self, base, thr_mma_qk, i):
        """S_i: ((tile_m, tile_n), 1, 1) fp32 accumulator at tmem_map's S_i columns (i may be a
        runtime Q tile: the S_i are evenly spaced)."""
        layout = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C(self.mma_tiler_qk[:2])).layout
        return cute.make_tensor(base + self.tmem_offset("S", i), layout)

    def tmem_tensor_O(self, base, thr_mma_pv, i):
        """O_i: ((tile_m, dv), 1, 1) fp32 accumulator at tmem_map's O_i columns."""
        layout = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C(self.mma_tiler_pv[:2])).layout
        return cute.make_tensor(base + self.tmem_offset("O", i), layout)

    def tmem_tensor_P(self, base, tOrP_layout, i):
        """P_i: 16-bit, packed two per column at tmem_map's P_i columns (inside S_i)."""
        return cute.make_tensor(cute.recast_ptr(base + self.tmem_offset("P", i), dtype=self.dtype), tOrP_layout)

    def tmem_offset(self, name: str, i):
        """Column of buffer name_i (tmem_map); i a Python int or a runtime Int32 (the buffers of
        the Q tiles are evenly spaced, checked here)."""
        starts = [self.tmem[f"{name}{j}"][0] for j in range(self.q_stage)]
        stride = starts[1] - starts[0] if self.q_stage > 1 else 0
        assert all(b - a == stride for a, b in zip(starts, starts[1:])), (name, starts)
        if isinstance(i, int):
            return starts[i]
        return starts[0] + i * stride

    # ---------------------------------------------------------------- softmax warpgroups
    @cute.jit
    def softmax(self, stage, thr_mma_qk, sScale, mQ, mK, mLSE, mLSEhi, mLSElo, mSink, pipes, softmax_scale_log2,
                softcap_scale, sched, window, seqs, cta_v):
        """Softmax warpgroup of Q tile `stage` (runtime, warp-uniform): per key block S_stage (TMEM)
        -> P_stage (TMEM) and the O factor to the correction; per tile 1 / row_sum to the correction
        and the LSE to global memory. Thread t owns row t of the Q tile (TMEM lane t)."""
        pipe_spo, pipe_stats = pipes["s_p_o"], pipes["sm_stats"]
        tidx = cute.arch.thread_idx()[0] % THREADS_PER_WG
        base = self.tmem_base()
        tSAcc = self.tmem_tensor_S(base, thr_mma_qk, stage)[(None, None), 0, 0]  # (tile_m, tile_n)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        # S: tcgen05.ld 32x32b, 32 columns per instruction: thread t gets row t, all columns.
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        tiled_load = tcgen05.make_tmem_copy(load_atom, tSAcc)
        thr_load = tiled_load.get_slice(tidx)
        tStS_t2r = thr_load.partition_S(tSAcc)
        tScS_t2r = thr_load.partition_D(cS)
        t0ScS_t2r = tiled_load.get_slice(0).partition_D(cS)  # static columns of each register
        # P: 16-bit pairs packed in 32-bit columns, tile_n / 2 columns inside S_stage (tmem_map P_i).
        p_cols = self.tmem["P0"][1]
        tStP = cute.make_tensor(base + self.tmem_offset("P", stage),
                                cute.composition(tSAcc.layout, cute.make_layout((self.tile_m, p_cols))))
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)), Float32)
        thr_store = tcgen05.make_tmem_copy(store_atom, tStP).get_slice(tidx)
        tStP_r2t = thr_store.partition_D(tStP)
        tSrP_shape = thr_store.partition_S(cute.make_identity_tensor((self.tile_m, p_cols))).shape
        lane_row = tScS_t2r[0][0]  # this thread's row in the Q tile (its TMEM lane)
        frags = (thr_load, tStS_t2r, tScS_t2r, t0ScS_t2r, thr_store, tStP_r2t, tSrP_shape)

        softmax = RowSoftmax(softmax_scale_log2, self.cfg.rescale_threshold, self.cfg.exp2_emu_frac,
                             softcap_scale if const_expr(self.cfg.softcap) else None)
        spo_phase = Int32(0)  # S ready: waited once per key block
        stats_phase = Int32(1)  # sScale free: the producer's first wait passes
        tile_idx = self.first_tile()
        while tile_idx < sched.num_tiles():
            m_block, head, batch = sched.coords(tile_idx)
            seq = self.tile_seq(mQ, mK, batch, seqs)
            n_min, n_blocks = self.key_blocks(m_block, seq, window)
            row = self.q_tile(m_block, stage, cta_v) * self.tile_m + lane_row
            sink_log2 = None
            if const_expr(self.cfg.sink):
                sink_log2 = Float32(mSink[head]) * Float32(LOG2E)
            # no key: LSE -inf, log2 split (+inf, 0); with a sink: LSE = the sink, split (sink_log2, 0)
            lse = (-Float32.inf, Float32.inf, Float32(0.0))
            if const_expr(self.cfg.sink):
                lse = (Float32(mSink[head]), sink_log2, Float32(0.0))
            if n_blocks > 0:
                softmax.reset()
                phases = (spo_phase, stats_phase)
                # the first block (the seqlen_k edge, and the diagonal when causal) is masked
                phases = self.softmax_step(stage, n_min + n_blocks - 1, True, True, row, seq, softmax, frags, sScale,
                                           pipe_spo, pipe_stats, phases, lane_row, window)
                if const_expr(window is not None):
                    # a window: every block is masked (either side may cut any block for some row)
                    for i in cutlass.range(n_blocks - 1, unroll=1):
                        phases = self.softmax_step(stage, n_min + n_blocks - 2 - i, False, True, row, seq, softmax,
                                                   frags, sScale, pipe_spo, pipe_stats, phases, lane_row, window)
                else:
                    n_unmasked = n_blocks - 1
                    if const_expr(self.causal):
                        # key blocks >= n_causal cross the diagonal of some row of the CTA tile
                        n_causal = geometry.n_block_min_causal_mask(m_block, seq.seqlen_q, seq.seqlen_k,
                                                                    self.cta_tile_m, self.tile_n)
                        n_causal = cutlass.max(cutlass.min(n_causal, n_blocks - 1), 0)
                        for i in cutlass.range(n_blocks - 1 - n_causal, unroll=1):
                            phases = self.softmax_step(stage, n_blocks - 2 - i, False, True, row, seq, softmax, frags,
                                                       sScale, pipe_spo, pipe_stats, phases, lane_row, window)
                        n_unmasked = n_causal
                    for i in cutlass.range(n_unmasked, unroll=1):
                        phases = self.softmax_step(stage, n_unmasked - 1 - i, False, False, row, seq, softmax, frags,
                                                   sScale, pipe_spo, pipe_stats, phases, lane_row, window)
                spo_phase, stats_phase = phases
                inv_row_sum, lse_e, lse_hi, lse_lo = softmax.finalize(sink_log2)
                stats_phase = self.send_stat(pipe_stats, stage, stats_phase, sScale, lane_row, inv_row_sum)
                lse = (lse_e, lse_hi, lse_lo)
            self.store_lse(row, seq, head, lse, (mLSE, mLSEhi, mLSElo))
            tile_idx += self.tile_stride()

    @cute.jit
    def softmax_step(self, stage, n_block, is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool], row,
                     seq, softmax, frags, sScale, pipe_spo, pipe_stats, phases, lane_row, window):
        """One key block: wait S, (mask), row max and the O factor -> correction, P -> TMEM, release."""
        thr_load, tStS_t2r, tScS_t2r, t0ScS_t2r, thr_store, tStP_r2t, tSrP_shape = frags
        spo_phase, stats_phase = phases
        pipe_spo.wait_full(stage, spo_phase)  # S_stage ready
        tcgen05_fence_after()
        tSrS = cute.make_rmem_tensor(tScS_t2r.shape, Float32)
        cute.copy(thr_load, tStS_t2r, tSrS)
        cute.arch.fence_view_async_tmem_load()
        softmax.score_mod(tSrS)  # softcap: S -> tanh(S * softcap_scale), before the mask
        if const_expr(masked):
            mask_row(tSrS, t0ScS_t2r, row, n_block, seq.seqlen_q, seq.seqlen_k, self.tile_n, self.causal, window)
        row_scale = softmax.update_max(tSrS, is_first)
        if const_expr(not is_first):
            stats_phase = self.send_stat(pipe_stats, stage, stats_phase, sScale, lane_row, row_scale)
        tSrP_f32 = cute.make_rmem_tensor(tSrP_shape, Float32)
        tSrP = cute.make_tensor(cute.recast_ptr(tSrP_f32.iterator, dtype=self.dtype), tSrS.layout)
        softmax.exp2_convert(tSrS, tSrP, row_scale, is_first)
        cute.copy(thr_store, tSrP_f32, tStP_r2t)
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence_before()
        pipe_spo.arrive_empty(stage, "softmax")  # P_stage written
        return spo_phase ^ 1, stats_phase

    @cute.jit
    def send_stat(self, pipe_stats, stage, phase, sScale, lane_row, value: Float32):
        """softmax -> correction: this row's value in sScale[lane_row, stage] (the slot is free once
        the correction released the previous one)."""
        pipe_stats.wait_empty(stage, phase)
        sScale[lane_row, stage] = value
        pipe_stats.arrive_full(stage, "softmax")
        return phase ^ 1

    @cute.jit
    def store_lse(self, row, seq, head, values, tensors):
        if row < seq.seqlen_q:
            row_idx, batch_idx = seq.q_index(row)
            for mX, x in zip(tensors, values):
                mX[row_idx, head, batch_idx] = x

    # ---------------------------------------------------------------- correction warpgroup
    @cute.jit
    def correction(self, thr_mma_pv, sScale, sO, mQ, mK, pipes, sched, window, seqs, cta_v):
        """Per block j >= 1 and Q tile i: read the O_i factor, rescale O_i in TMEM if some row of the
        warp moved its max, release s_p_o. Per tile: O_i / row_sum -> 16-bit -> sO[i] -> epilogue.
        An empty tile (no key) writes O = 0 without touching TMEM or the MMA's pipelines."""
        pipe_spo, pipe_stats, pipe_ofull, pipe_epi = pipes["s_p_o"], pipes["sm_stats"], pipes["o_full"], pipes["corr_epi"]
        tidx = cute.arch.thread_idx()[0] % THREADS_PER_WG
        base = self.tmem_base()
        row = self.o_lane_row(thr_mma_pv, tidx)  # this thread's row of O_i: the sScale slot it reads
        # O_i is free for the first tile's first PV.
        tcgen05_fence_before()
        for stage in cutlass.range_constexpr(self.q_stage):
            pipe_spo.arrive_empty(stage, "correction")
        stats_phase = Int32(0)
        ofull_phase = Int32(0)
        epi_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        tile_idx = self.first_tile()
        while tile_idx < sched.num_tiles():
            m_block, head, batch = sched.coords(tile_idx)
            _, n_blocks = self.key_blocks(m_block, self.tile_seq(mQ, mK, batch, seqs), window)
            for i in cutlass.range(cutlass.max(n_blocks - 1, 0), unroll=1):
                for stage in cutlass.range(self.q_stage, unroll=1):
                    pipe_stats.wait_full(stage, stats_phase)
                    scale = sScale[row, stage]
                    pipe_stats.arrive_empty(stage, "correction")
                    tcgen05_fence_after()
                    if cute.arch.vote_any_sync(scale != Float32(1.0)):
                        self.rescale_O(self.tmem_tensor_O(base, thr_mma_pv, stage), thr_mma_pv, tidx, scale)
                    tcgen05_fence_before()
                    pipe_spo.arrive_empty(stage, "correction")  # O_stage rescaled
                stats_phase = stats_phase ^ 1
            has_keys = n_blocks > 0
            for stage in cutlass.range(self.q_stage, unroll=1):
                inv_row_sum = Float32(0.0)
                if has_keys:
                    pipe_stats.wait_full(stage, stats_phase)
                    inv_row_sum = sScale[row, stage]
                    pipe_stats.arrive_empty(stage, "correction")
                    pipe_ofull.wait_full(stage, ofull_phase)  # the tile's last PV_stage is done
                    tcgen05_fence_after()
                pipe_epi.wait_empty(epi_state.index, epi_state.phase)  # sO[stage] free
                self.store_O(self.tmem_tensor_O(base, thr_mma_pv, stage), thr_mma_pv, sO[None, None, stage], tidx,
                             inv_row_sum, has_keys)
                cute.arch.fence_view_async_shared()  # sO writes -> visible to the TMA store (async proxy)
                pipe_epi.arrive_full(epi_state.index, "correction")
                epi_state = next_state(epi_state)
                if has_keys:
                    tcgen05_fence_before()
                    pipe_spo.arrive_empty(stage, "correction")  # O_stage read: the next tile may overwrite it
            if has_keys:
                stats_phase = stats_phase ^ 1
                ofull_phase = ofull_phase ^ 1
            tile_idx += self.tile_stride()
        pipe_epi.producer_tail(epi_state)

    def o_lane_row(self, thr_mma_pv, tidx):
        """The O row (TMEM lane) thread tidx of the correction warpgroup reads with tcgen05.ld 32x32b."""
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor(self.mma_tiler_pv[:2]))
        tOcO_i = cute.composition(tOcO, cute.make_layout((self.tile_m, RESCALE_COLS)))
        ld = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(RESCALE_COLS)), Float32)
        tOtO0 = self.tmem_tensor_O(self.tmem_base(), thr_mma_pv, 0)
        thr_ld = tcgen05.make_tmem_copy(ld, cute.composition(tOtO0, cute.make_layout((self.tile_m, RESCALE_COLS))))
        return thr_ld.get_slice(tidx).partition_D(tOcO_i)[0][0]

    @cute.jit
    def rescale_O(self, tOtO, thr_mma_pv, tidx, scale: Float32):
        """O *= scale (this thread's row) in TMEM, RESCALE_COLS columns per ld / mul / st."""
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor(self.mma_tiler_pv[:2]))
        tOtO_i = cute.composition(tOtO, cute.make_layout((self.tile_m, RESCALE_COLS)))
        tOcO_i = cute.composition(tOcO, cute.make_layout((self.tile_m, RESCALE_COLS)))
        ld = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(RESCALE_COLS)), Float32)
        st = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(RESCALE_COLS)), Float32)
        thr_ld = tcgen05.make_tmem_copy(ld, tOtO_i).get_slice(tidx)
        thr_st = tcgen05.make_tmem_copy(st, tOtO_i).get_slice(tidx)
        tOtO_t2r = thr_ld.partition_S(tOtO_i)
        tOtO_r2t = thr_st.partition_D(tOtO_i)
        frg_shape = thr_ld.partition_D(tOcO_i).shape
        for c in cutlass.range(self.hdim_v // RESCALE_COLS, unroll_full=True):
            frg = cute.make_rmem_tensor(frg_shape, Float32)
            cute.copy(thr_ld, cute.make_tensor(tOtO_t2r.iterator + c * RESCALE_COLS, tOtO_t2r.layout), frg)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are read (PTX)
            for j in cutlass.range(0, cute.size(frg), 2, unroll_full=True):
                frg[j], frg[j + 1] = cute.arch.mul_packed_f32x2((frg[j], frg[j + 1]), (scale, scale))
            cute.copy(thr_st, frg, cute.make_tensor(tOtO_r2t.iterator + c * RESCALE_COLS, tOtO_r2t.layout))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def store_O(self, tOtO, thr_mma_pv, sO_stage, tidx, inv_row_sum: Float32, has_keys):
        """O * inv_row_sum -> 16-bit -> sO_stage, 32 bytes of a row per TMEM load; without keys
        (an empty tile, whose O was never written) zeros, TMEM not read."""
        corr_cols = 32 * 8 // self.dtype.width
        cO = cute.make_identity_tensor(self.mma_tiler_pv[:2])
        tOsO = thr_mma_pv.partition_C(sO_stage)
        tOcO = thr_mma_pv.partition_C(cO)
        tOtO_i = cute.logical_divide(tOtO, cute.make_layout((self.tile_m, corr_cols)))
        tOcO_i = cute.logical_divide(tOcO, cute.make_layout((self.tile_m, corr_cols)))
        tOsO_i = cute.logical_divide(tOsO, cute.make_layout((self.tile_m, corr_cols)))
        load_atom = sm100_utils.get_tmem_load_op(self.mma_tiler_pv, self.o_layout, self.dtype, Float32,
                                                 (self.tile_m, corr_cols), use_2cta_instrs=self.two_cta)
        tiled_load = tcgen05.make_tmem_copy(load_atom, tOtO_i[(None, None), 0])
        thr_load = tiled_load.get_slice(tidx)
        tTMEM_LOADtO = thr_load.partition_S(tOtO_i[(None, None), None])
        tTMEM_LOADsO = thr_load.partition_D(tOsO_i[(None, None), None])
        tTMEM_LOADcO = thr_load.partition_D(tOcO_i[(None, None), None])
        smem_atom = sm100_utils.get_smem_store_op(self.o_layout, self.dtype, Float32, tiled_load)
        tiled_smem_store = cute.make_tiled_copy_D(smem_atom, tiled_load)
        for c in cutlass.range(self.hdim_v // corr_cols, unroll_full=True):
            frg = cute.make_rmem_tensor(tTMEM_LOADcO[None, 0, 0, c].shape, Float32)
            frg.fill(0.0)
            if has_keys:
                self.load_scaled(tiled_load, tTMEM_LOADtO[None, 0, 0, c], frg, inv_row_sum)
            out = cute.make_rmem_tensor(frg.shape, self.dtype)
            out.store(frg.load().to(self.dtype))
            cute.copy(tiled_smem_store, out, tTMEM_LOADsO[None, 0, 0, c])
        cute.arch.fence_view_async_tmem_load()

    @cute.jit
    def load_scaled(self, tiled_load, src, frg, scale: Float32):
        """frg = src (TMEM) * scale; register-tensor writes only (called under a runtime branch)."""
        cute.copy(tiled_load, src, frg)
        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are read (PTX)
        for j in cutlass.range(0, cute.size(frg), 2, unroll_full=True):
            frg[j], frg[j + 1] = cute.arch.mul_packed_f32x2((frg[j], frg[j + 1]), (scale, scale))

    # ---------------------------------------------------------------- epilogue warp
    @cute.jit
    def epilogue(self, mO, mO_rows, mQ, mK, sO, tma_atom_O, pipes, sched, seqs, cta_v):
        """Dense: TMA store of sO[i] to Q tile i's rows (rows past seqlen_q are clipped by the TMA unit).
        varlen_q: the warp stores sO[i]'s rows below the sequence's seqlen_q with 16-byte stores
        (mO_rows, the plain view of O: a packed O holds the next sequence right after)."""
        pipe_epi = pipes["corr_epi"]
        epi_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        lane = cute.arch.lane_idx()
        tile_idx = self.first_tile()
        while tile_idx < sched.num_tiles():
            m_block, head, batch = sched.coords(tile_idx)
            if const_expr(self.cfg.varlen_q):
                seq = self.tile_seq(mQ, mK, batch, seqs)
                gO_rows = cute.local_tile(seq.q_view(mO_rows, head), self.epi_tile, (None, 0))
                for stage in cutlass.range_constexpr(self.q_stage):
                    pipe_epi.wait_full(epi_state.index, epi_state.phase)
                    q_tile = self.q_stage * m_block + stage
                    # EPI_ROWS rows per pass: the warp's registers hold one pass (this warp has 48-56)
                    sO_rows = cute.local_tile(sO[None, None, stage], (EPI_ROWS, self.hdim_v), (None, 0))
                    gO_pass = cute.local_tile(gO_rows[None, None, q_tile], (EPI_ROWS, self.hdim_v), (None, 0))
                    valid = seq.seqlen_q - q_tile * self.tile_m
                    for c in cutlass.range(self.tile_m // EPI_ROWS, unroll=1):
                        store_rows_predicated(sO_rows[None, None, c], gO_pass[None, None, c], valid - c * EPI_ROWS,
                                              lane, WARP_SIZE)
                    cute.arch.sync_warp()  # every lane read its part of sO[stage]
                    with cute.arch.elect_one():
                        pipe_epi.arrive_empty(epi_state.index, "epilogue")
                    epi_state = next_state(epi_state)
            else:
                gO = cute.local_tile(mO[None, None, head, batch], self.epi_tile, (None, 0))  # (tile_m, dv, m_blocks)
                tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                first = epi_state
                for stage in cutlass.range_constexpr(self.q_stage):
                    pipe_epi.wait_full(epi_state.index, epi_state.phase)
                    # One lane issues the store and owns its bulk group (the DSL elects for TMA loads,
                    # not for stores: a whole warp would store the tile 32 times).
                    with cute.arch.elect_one():
                        cute.copy(tma_atom_O, tOsO[None, stage], tOgO[None, self.q_tile(m_block, stage, cta_v)])
                        cute.arch.cp_async_bulk_commit_group()
                    epi_state = next_state(epi_state)
                rel = first
                for stage in cutlass.range_constexpr(self.q_stage):
                    with cute.arch.elect_one():
                        cute.arch.cp_async_bulk_wait_group(self.q_stage - 1 - stage, read=True)  # sO[stage] read
                        pipe_epi.arrive_empty(rel.index, "epilogue")
                    rel = next_state(rel)
            tile_idx += self.tile_stride()
        with cute.arch.elect_one():
            cute.arch.cp_async_bulk_wait_group(0, read=False)
