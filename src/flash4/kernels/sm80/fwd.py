"""FlashAttention forward for the portable family (sm_80, sm_86, sm_89, sm_120; runs on sm_90 too)
in CuTe DSL.

O = softmax(scale * Q K^T) V and LSE, exact, O(N) memory, on the warp-level tensor-core MMA
(mma.sync m16n8k16), ldmatrix and cp.async: FlashAttention-2's schedule (Dao 2023, section 3)
with a multi-stage cp.async K/V pipeline and FlashAttention-4's lazy rescaling (kernels/common/
softmax.py). Every code path is fixed by the family, never by the DSL's target arch: no TMA,
wgmma, stmatrix or tcgen05 (the CPU compile check gates the SASS).
"""

from functools import partial
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.memory import SmemAllocator

from flash4.constants import LOG2E as LOG2E_F
from flash4.kernels.common import geometry, score
from flash4.kernels.common.dsl import DSL_DTYPES
from flash4.kernels.common.layout import acc_mn_view, select_modes, transpose_view
from flash4.kernels.common.paged_gather import PagedGather
from flash4.kernels.common.params import MaskParams, SeqParams
from flash4.kernels.common.scheduler import TileSchedule
from flash4.kernels.common.seqinfo import SeqInfo, store_rows_predicated, store_split_partials
from flash4.kernels.common.softmax import OnlineSoftmax
from flash4.kernels.sm80 import loop_clone
from flash4.kernels.sm80 import rows as tile_rows
from flash4.kernels.sm80.regs import RegCoords, ld, st
from flash4.kernels.sm80.mma import (KPipe, KPipeB, acc_to_operand_a, as_wgmma_acc, copy_op, gemm_kpipe,
                                     gemm_kpipe_rs, make_kpipe, make_kpipe_b, make_tiled_mma, pointer_swizzle,
                                     smem_layout_atom)

# 16-byte global accesses (cp.async.cg and the O store): 8 elements of 16 bits.
COPY_BITS = 128


# ---------------------------------------------------------------------- parameter bundles
class QKVO(NamedTuple):
    """One value per operand Q, K, V, O: global tensors (kernel view (seqlen, d, heads, batch)),
    smem layouts, or tiled copies (q, k, v: cp.async loads; o: the 16-byte store)."""

    q: object
    k: object
    v: object
    o: object


class LseParams(NamedTuple):
    """Per-row outputs, fp32 (seqlen_q, nheads, batch): the natural-log LSE and the log2-domain LSE
    unrounded as hi + lo (the backward's exact path); OnlineSoftmax.finalize's order."""

    lse: cute.Tensor
    lse_hi: cute.Tensor
    lse_lo: cute.Tensor


class ScoreParams(NamedTuple):
    """scale_log2: softmax_scale * log2 e (softcap: softcap * log2 e); softcap_scale: the tanh's
    input scale softmax_scale / softcap (ignored without softcap). kernels/common/score.scales."""

    scale_log2: Float32
    softcap_scale: Float32


class TileSpace(NamedTuple):
    """batch_size: number of sequences; max_seqlen_q: >= every sequence's query count;
    num_splits: split_kv: key-block runs per (m_block, head, batch) (None otherwise)."""

    batch_size: Int32
    max_seqlen_q: Int32
    num_splits: Optional[Int32] = None


class SplitParams(NamedTuple):
    """split_kv partial results, each split normalized by its own row sum (None otherwise); flash4's
    combine kernel (kernels/common/fwd_combine.py) merges them and adds a sink.

    o_acc: fp32 (seqlen_q, dv, nheads, batch, split).  lse_acc: fp32 (seqlen_q, nheads, batch, split).
    """

    o_acc: Optional[cute.Tensor]
    lse_acc: Optional[cute.Tensor]


class Smem(NamedTuple):
    """Shared-memory tiles: q (tile_m, d); k (tile_n, d, STAGE); v (tile_n, dv, STAGE); o (tile_m, dv),
    which is Q's buffer (O is staged there once the last Q K^T has read Q)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    o: cute.Tensor


class Operands(NamedTuple):
    """Per thread, the main loop's MMA operands (kernels/sm80/mma.py's k-pipelined GEMMs, built
    once per kernel): s for S = Q K^T (fragments tSrQ (MMA, MMA_M, MMA_K), tSrK (MMA, MMA_N,
    MMA_K); ldmatrix partitions of sQ and, with a STAGE mode, of sK), o for O += P V (fragment
    tOrVt (MMA, MMA_N, MMA_K), the ldmatrix.trans partition of sV^T with a STAGE mode; P comes from
    registers), and tSsQ, sQ's ldmatrix partition (CPY, MMA_M, MMA_K) ungrouped, for loading all of
    Q into s.a once per tile (q_in_regs)."""

    s: KPipe
    o: KPipeB
    tSsQ: cute.Tensor


class FlashAttentionForwardSm80:
    """Forward kernel, one CTA per (m_block, head, batch) tile (persistent: CTAs walk the tile
    order, kernels/common/scheduler.py); num_warps warps, each owning tile_m / num_warps query rows.

    No warp specialization: every thread issues cp.async loads, ldmatrix + mma.sync, the softmax
    and the epilogue. Per tile (`attend`):
      * prologue: Q, then K[n_max-1], V[n_max-1], ..., K[n_max-S] (S = kv_stages) as cp.async
        commit groups (`prologue`); blocks run n_max-1 down to n_min.
      * per key block n, stage r (`one_n_block`; groups are committed in the order K, V, K, V, ...):
          wait K[n] (cp.async.wait_group 2S-2) ; barrier (K[n] visible, previous block's P V done) ;
          cp.async V[n-S+1] into the stage the previous P V freed ;
          S = Q K[n]^T (ldmatrix Q and K one k16 slice ahead of each mma.sync) ; softcap ;
          S = 1: wait V[n], barrier, cp.async K[n-1] into the freed K stage ;
          mask (blocks crossing seqlen_k / the diagonal / the window only) ; online softmax with lazy
          rescale (kernels/common/softmax.py) ; P = 16-bit S in registers ;
          S > 1: wait V[n], barrier, cp.async K[n-S] into the freed K stage ;
          O += P V[n] (ldmatrix.trans V).
        So K runs S blocks ahead and V S-1 blocks ahead; S = 1 is FlashAttention-2's schedule.
      * epilogue (`epilogue`): O / rowsum -> 16-bit -> smem (Q's buffer) -> row-predicated 16-byte
        stores; the LSE (natural log, and log2 hi + lo) from the threads owning column 0.
    Rows past seqlen_q / keys past seqlen_k are never loaded: their smem rows are zero-filled (a
    stale V row would put NaN into P V through 0 * NaN) and their scores masked.
    Parameters: the kernel takes the bundles above and kernels/common/params.py's SeqParams and
    MaskParams; runtime values reach device code only as arguments, never as attributes of `self`.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.dtype = DSL_DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.hdim, self.hdim_v = cfg.tile_m, cfg.tile_n, cfg.headdim, cfg.hdim_v
        self.num_stages = cfg.kv_stages
        self.num_threads = cfg.num_threads
        self.causal = cfg.causal
        self.q_in_regs = cfg.q_in_regs
        # Query tiles may lie past their sequence (varlen / seqused: the grid covers max_seqlen_q).
        self.ragged_q = cfg.varlen_q or cfg.seqused_q

    # ------------------------------------------------------------------ host side (trace time)
    def _smem_layout(self, rows: int, hdim: int, stages=None):
        """Swizzled (rows, hdim[, stages]) tile of smem_layout_atom."""
        atom = smem_layout_atom(self.dtype, hdim)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, hdim), (0, 1))
        return cute.tile_to_shape(atom, (rows, hdim, stages), (0, 1, 2))

    def _gmem_copy(self, hdim: int, op, rows: int):
        """Tiled copy of 16-byte chunks, threads laid row-major over one smem atom's width (a row of
        the atom is one 64- or 128-byte segment of global memory); `rows` must be a multiple of the
        rows one pass covers."""
        vec = COPY_BITS // self.dtype.width
        per_row = smem_layout_atom(self.dtype, hdim).outer.shape[1] // vec
        thr_layout = cute.make_ordered_layout((self.num_threads // per_row, per_row), order=(1, 0))
        assert rows % (self.num_threads // per_row) == 0, (rows, self.num_threads, per_row)
        atom = cute.make_copy_atom(op, self.dtype, num_bits_per_copy=COPY_BITS)
        return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, headdim), headdim contiguous
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_k, headdim)
        mV: cute.Tensor,  # (batch, seqlen_k, nheads_k, headdim_v)
        mO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim_v)
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) float32
        mLSEhi: cute.Tensor,  # (batch, nheads, seqlen_q) float32: log2-domain LSE = hi + lo, unrounded
        mLSElo: cute.Tensor,  # (batch, nheads, seqlen_q) float32
        mCuSeqlensQ: Optional[cute.Tensor],  # (batch + 1,) int32 when varlen_q (then Q/O/LSE have batch 1)
        mCuSeqlensK: Optional[cute.Tensor],  # (batch + 1,) int32 when varlen_k (then K/V have batch 1)
        mSeqUsedQ: Optional[cute.Tensor],  # (batch,) int32 when seqused_q
        mSeqUsedK: Optional[cute.Tensor],  # (batch,) int32 when seqused_k
        mPageTable: Optional[cute.Tensor],  # page_gather: (batch, max_pages) int32; K/V (num_pages, page_size, hk, d)
        mOacc: Optional[cute.Tensor],  # split_kv: (num_splits, batch, seqlen_q, nheads, dv) fp32 partial O
        mLSEacc: Optional[cute.Tensor],  # split_kv: (num_splits, batch, nheads, seqlen_q) fp32 partial LSE
        mSink: Optional[cute.Tensor],  # sink: (nheads,) fp32 sink logits (natural units)
        softmax_scale_log2: Float32,  # softmax_scale * log2(e); softcap: softcap * log2(e)
        softcap_scale: Float32,  # softcap: softmax_scale / softcap (the tanh's input scale); else ignored
        batch_size: Int32,  # number of sequences
        max_seqlen_q: Int32,  # >= every sequence's query count: sizes the tile space
        num_splits: Int32,  # split_kv: key-block runs per (m_block, head, batch) (1 otherwise)
        window_left: Int32,  # local: the window's sides (flash4.geometry.window_sides); ignored otherwise
        window_right: Int32,
        l2_group: Int32,  # (head, batch) pairs per L2 section of the tile order (>= 1)
        num_ctas: Int32,  # grid size: number of tiles, or number of SMs when persistent
        stream: cuda.CUstream,
    ):
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError(f"flash4 fwd_sm80: q, k, v, out must all be {self.dtype}")
        if const_expr((mOacc is not None, mLSEacc is not None) != (self.cfg.split_kv, self.cfg.split_kv)):
            raise ValueError(f"flash4 fwd_sm80: o_accum / lse_accum given {mOacc is not None} / "
                             f"{mLSEacc is not None}, the config's split_kv is {self.cfg.split_kv}")
        if const_expr((mPageTable is not None) != self.cfg.page_gather):
            raise ValueError(f"flash4 fwd_sm80: page_table given {mPageTable is not None}, the config's page_gather "
                             f"is {self.cfg.page_gather}")
        given = (mCuSeqlensQ is not None, mCuSeqlensK is not None, mSeqUsedQ is not None, mSeqUsedK is not None,
                 mSink is not None)
        wanted = (self.cfg.varlen_q, self.cfg.varlen_k, self.cfg.seqused_q, self.cfg.seqused_k, self.cfg.sink)
        if const_expr(given != wanted):
            raise ValueError(f"flash4 fwd_sm80: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sink) given "
                             f"{given}, the config wants {wanted}")
        # Kernel-side views: (seqlen, headdim, nheads, batch) and LSE (seqlen_q, nheads, batch); paged
        # K/V: (page_size, headdim, nheads_k, num_pages).
        mQ, mK, mV, mO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mLSE, mLSEhi, mLSElo = [select_modes(t, [2, 1, 0]) for t in (mLSE, mLSEhi, mLSElo)]
        if const_expr(self.cfg.split_kv):
            mOacc = select_modes(mOacc, [2, 4, 3, 1, 0])  # (seqlen_q, dv, nheads, batch, split)
            mLSEacc = select_modes(mLSEacc, [3, 2, 1, 0])  # (seqlen_q, nheads, batch, split)

        sQ_layout = self._smem_layout(self.tile_m, self.hdim)
        sK_layout = self._smem_layout(self.tile_n, self.hdim, self.num_stages)
        sV_layout = self._smem_layout(self.tile_n, self.hdim_v, self.num_stages)
        sO_layout = self._smem_layout(self.tile_m, self.hdim_v)
        load = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)  # cp.async.cg: L2 only
        copies = QKVO(
            self._gmem_copy(self.hdim, load, self.tile_m),
            self._gmem_copy(self.hdim, load, self.tile_n),
            self._gmem_copy(self.hdim_v, load, self.tile_n),
            None,  # O leaves through kernels/common/seqinfo.store_rows_predicated
        )
        tiled_mma = make_tiled_mma(self.dtype, self.cfg.num_warps)
        q_elems = max(cute.cosize(sQ_layout), cute.cosize(sO_layout))  # O is staged in Q's buffer

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        self.kernel(
            QKVO(mQ, mK, mV, mO),
            LseParams(mLSE, mLSEhi, mLSElo),
            SeqParams(mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable),
            mSink,
            ScoreParams(softmax_scale_log2, softcap_scale),
            TileSpace(batch_size, max_seqlen_q, num_splits if const_expr(self.cfg.split_kv) else None),
            SplitParams(mOacc, mLSEacc),
            MaskParams(window_left, window_right),
            l2_group,
            QKVO(sQ_layout, sK_layout, sV_layout, sO_layout),
            copies,
            tiled_mma,
            SharedStorage,
        ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        gmem: QKVO,  # Q, K, V, O in the kernel view (seqlen, d, heads, batch)
        lse_out: LseParams,
        seq_params: SeqParams,
        sink: Optional[cute.Tensor],  # sink: (nheads,) fp32 sink logits (natural units)
        score_params: ScoreParams,
        tiles: TileSpace,
        split_params: SplitParams,
        mask_params: MaskParams,
        l2_group: Int32,  # (head, batch) pairs per L2 section of the tile order (>= 1)
        layouts: QKVO,  # smem layouts of Q, K, V, O
        copies: QKVO,  # cp.async tiled copies of Q, K, V
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx = cute.arch.thread_idx()[0]
        storage = SmemAllocator().allocate(SharedStorage)
        # (tile_m, d) / (tile_n, d, STAGE) / (tile_n, dv, STAGE) / (tile_m, dv)
        sQ = storage.sQ.get_tensor(layouts.q)
        if const_expr(self.cfg.page_gather):
            # The gather's inline cp.async applies the stages' swizzle itself, read off the pointer
            # type (paged_gather.pointer_swizzle): the swizzle goes on the pointer, as sm90's stages.
            # A pointer's swizzle acts on byte addresses (mma.pointer_swizzle), the layout's on elements.
            sK = storage.sK.get_tensor(layouts.k.outer, swizzle=pointer_swizzle(self.dtype, self.hdim))
            sV = storage.sV.get_tensor(layouts.v.outer, swizzle=pointer_swizzle(self.dtype, self.hdim_v))
        else:
            sK = storage.sK.get_tensor(layouts.k)
            sV = storage.sV.get_tensor(layouts.v)
        sO = storage.sQ.get_tensor(layouts.o)
        smem = Smem(sQ, sK, sV, sO)
        ops = self.mma_operands(smem, tiled_mma, tidx)

        mQ = gmem.q
        num_m_blocks = cute.ceil_div(tiles.max_seqlen_q, self.tile_m)
        # split_kv: the "batch" of the tile order runs over (batch, split) pairs, split fastest.
        num_hb = mQ.shape[2] * tiles.batch_size * (tiles.num_splits if const_expr(self.cfg.split_kv) else 1)
        sched = TileSchedule(num_m_blocks, mQ.shape[2], num_hb, l2_group, self.causal and self.cfg.lpt)
        tile = partial(self.tile, gmem, lse_out, seq_params, sink, score_params, mask_params, smem, copies, tiled_mma,
                       ops, tidx, sched, tiles, split_params)
        tile_idx = cute.arch.block_idx()[0]
        if const_expr(self.cfg.persistent):
            while tile_idx < sched.num_tiles():
                tile(tile_idx)
                tile_idx += cute.arch.grid_dim()[0]
        else:
            tile(tile_idx)  # one tile per CTA: no loop state lives across the main loop

    @cute.jit
    def tile(self, gmem: QKVO, lse_out: LseParams, seq_params: SeqParams, sink: Optional[cute.Tensor],
             score_params: ScoreParams, mask_params: MaskParams, smem: Smem, copies: QKVO, tiled_mma: cute.TiledMma,
             ops: Operands, tidx: Int32, sched: TileSchedule, tiles: TileSpace, split_params: SplitParams,
             tile_idx: Int32):
        """Tile tile_idx of the tile order: its sequence (and split_kv's split), then `attend` unless
        the query tile lies past the sequence (varlen / seqused)."""
        m_block, head, batch = sched.coords(tile_idx)
        split = Int32(0)
        if const_expr(self.cfg.split_kv):
            batch, split = batch // tiles.num_splits, batch % tiles.num_splits
        seq = SeqInfo(batch, gmem.q.shape[0], gmem.k.shape[0], *seq_params.lengths())
        in_range = True
        if const_expr(self.ragged_q):
            in_range = m_block * self.tile_m < seq.seqlen_q
        if in_range:
            self.attend(gmem, lse_out, sink, score_params, mask_params, smem, copies, tiled_mma, ops, tidx, m_block,
                        head, seq, seq_params.page_table, split_params, split, tiles.num_splits)

    def mma_operands(self, smem: Smem, tiled_mma, tidx) -> Operands:
        """The thread's MMA fragments and ldmatrix partitions (tile-independent: built once)."""
        thr_mma = tiled_mma.get_slice(tidx)
        sVt = transpose_view(smem.v)  # (dv, tile_n, STAGE)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(smem.q))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(smem.k[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        copy_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        copy_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        copy_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        # (CPY, MMA_M, MMA_K) / (CPY, MMA_N, MMA_K, STAGE) / (CPY, MMA_N, MMA_K, STAGE)
        tSsQ = copy_q.partition_S(smem.q)
        return Operands(make_kpipe(tSrQ, tSrK, tSsQ, copy_k.partition_S(smem.k), copy_q, copy_k),
                        make_kpipe_b(tOrVt, copy_v.partition_S(sVt), copy_v), tSsQ)

    @cute.jit
    def attend(self, gmem: QKVO, lse_out: LseParams, sink: Optional[cute.Tensor], score_params: ScoreParams,
               mask_params: MaskParams, smem: Smem, copies: QKVO, tiled_mma: cute.TiledMma, ops: Operands,
               tidx: Int32, m_block: Int32, head: Int32, seq: SeqInfo, seq_page_table: Optional[cute.Tensor],
               split_params: SplitParams, split: Int32, num_splits: Optional[Int32]):
        """One query tile: prologue loads, the key-block loop (masked blocks first, then unmasked,
        then a window's left edge), epilogue. seq_page_table: page_gather configs' page table.
        split_kv: split `split` of num_splits runs of the key blocks, written to the partials."""
        mQ, mK, mV = gmem.q, gmem.k, gmem.v
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        window = mask_params.window(self.cfg.local)
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        n_block_min, n_block_max = self.n_block_range(m_block, seq, window, split, num_splits)

        # Global -> smem partitions. (CPY, CPY_M, CPY_K) for Q; (CPY, CPY_N, CPY_K, n_block) and
        # (CPY, CPY_N, CPY_K, STAGE) for K and V.
        gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (m_block, 0))
        thr_q = copies.q.get_slice(tidx)
        load_q = partial(tile_rows.load_rows, copies.q, thr_q.partition_S(gQ), thr_q.partition_D(smem.q),
                         *self.row_coords(copies.q, thr_q, self.tile_m, self.hdim))
        if const_expr(self.cfg.page_gather):
            # Every thread gathers its key rows from their own pages (kernels/common/paged_gather.py),
            # rows past seqlen_k zero-filled by the same cp.async stream.
            gather = PagedGather(self.dtype, self.tile_n, self.hdim, self.hdim_v, zero_fill=True,
                                 num_threads=self.num_threads)
            load_k = partial(self.load_kv_paged, gather, mK, smem.k, head_kv, seq_page_table, seq, tidx)
            load_v = partial(self.load_kv_paged, gather, mV, smem.v, head_kv, seq_page_table, seq, tidx)
        else:
            gK = cute.local_tile(seq.k_view(mK, head_kv), (self.tile_n, self.hdim), (None, 0))
            gV = cute.local_tile(seq.k_view(mV, head_kv), (self.tile_n, self.hdim_v), (None, 0))
            thr_k, thr_v = copies.k.get_slice(tidx), copies.v.get_slice(tidx)
            load_k = partial(self.load_kv, copies.k, thr_k.partition_S(gK), thr_k.partition_D(smem.k),
                             *self.row_coords(copies.k, thr_k, self.tile_n, self.hdim), seqlen_k)
            load_v = partial(self.load_kv, copies.v, thr_v.partition_S(gV), thr_v.partition_D(smem.v),
                             *self.row_coords(copies.v, thr_v, self.tile_n, self.hdim_v), seqlen_k)

        thr_mma = tiled_mma.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.hdim_v)), Float32)
        acc_O.fill(0.0)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = as_wgmma_acc(thr_mma.partition_C(cS))
        t0ScS = as_wgmma_acc(tiled_mma.get_slice(0).partition_C(cS))
        softmax = OnlineSoftmax(score_params.scale_log2, cute.size(acc_mn_view(tScS), mode=[0]),
                                self.cfg.rescale_threshold, self.cfg.exp2_emu_frac)
        softmax.reset()
        mask = partial(geometry.mask_scores, tScS=tScS, t0ScS=t0ScS, m_block=m_block, seqlen_q=seqlen_q,
                       seqlen_k=seqlen_k, tile_m=self.tile_m, tile_n=self.tile_n, window=window)

        self.prologue(load_q, load_k, load_v, ops, m_block, seqlen_q, n_block_min, n_block_max)
        block = partial(self.one_n_block, tiled_mma=tiled_mma, ops=ops, acc_O=acc_O, softmax=softmax,
                        load_k=load_k, load_v=load_v, n_block_min=n_block_min, score_params=score_params,
                        mask=mask)
        if n_block_max > n_block_min:
            # First block (the seqlen_k edge / the diagonal): masked, starts the softmax.
            stage = block(n_block_max - 1, Int32(0), is_first=True, masked=True)
            # Blocks that cross the causal diagonal (a window's right edge), then unmasked blocks,
            # then (window) blocks that cross its left edge.
            n_block_unmasked = n_block_max - 1
            n_block_left = n_block_min
            masked_top = None
            if const_expr(self.causal or self.cfg.local):
                n_causal = geometry.n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                                                            window)
                n_causal = cutlass.max(cutlass.min(n_causal, n_block_max - 1), n_block_min)
                masked_top = n_block_max - 2
                for i in cutlass.range(n_block_max - 1 - n_causal, unroll=1):
                    stage = block(masked_top - i, stage, is_first=False, masked=True)
                n_block_unmasked = n_causal
            if const_expr(self.cfg.local):
                n_left = geometry.n_block_left_mask_end(m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, window)
                n_block_left = cutlass.max(cutlass.min(n_left, n_block_unmasked), n_block_min)
            stage = self.unmasked_loop(block, stage, n_block_unmasked - n_block_left, n_block_unmasked - 1, masked_top)
            if const_expr(self.cfg.local):
                for i in cutlass.range(n_block_left - n_block_min, unroll=1):
                    stage = block(n_block_left - 1 - i, stage, is_first=False, masked=True)

        sink_log2 = None
        if const_expr(self.cfg.sink and not self.cfg.split_kv):  # split_kv: the combine adds it
            sink_log2 = Float32(sink[head]) * Float32(LOG2E_F)
        inv_row_sum, lse, lse_hi, lse_lo = softmax.finalize(sink_log2)
        if const_expr(self.cfg.split_kv):
            self.epilogue_split(acc_O, inv_row_sum, lse, split_params, tiled_mma, tidx, m_block, head, seq, split)
        else:
            self.epilogue(acc_O, inv_row_sum, (lse, lse_hi, lse_lo), gmem.o, lse_out, smem.o, tiled_mma, tidx,
                          m_block, head, seq)

    def n_block_range(self, m_block, seq, window, split, num_splits):
        """[n_block_min, n_block_max): the key blocks query tile m_block sees (flash4.geometry); with
        split_kv, split `split` of num_splits equal runs of them (the sm90 forward's rule)."""
        n_block_max = geometry.n_block_max(m_block, seq.seqlen_q, seq.seqlen_k, self.tile_m, self.tile_n,
                                           self.causal, window)
        n_block_min = Int32(0)
        if const_expr(self.cfg.local):
            n_block_min = geometry.n_block_min(m_block, seq.seqlen_q, seq.seqlen_k, self.tile_m, self.tile_n, window)
        if const_expr(self.cfg.split_kv):
            per_split = (cutlass.max(n_block_max - n_block_min, 0) + num_splits - 1) // num_splits
            n_block_min = cutlass.min(n_block_min + split * per_split, n_block_max)
            n_block_max = cutlass.min(n_block_min + per_split, n_block_max)
        return n_block_min, n_block_max

    @cute.jit
    def prologue(self, load_q, load_k, load_v, ops: Operands, m_block: Int32, seqlen_q: Int32, n_block_min: Int32,
                 n_block_max: Int32):
        """cp.async groups Q, K[n_max-1], V[n_max-1], ..., V[n_max-S+1], K[n_max-S] (2S groups, empty
        where the block does not exist); the first K / V block is the only one that may cross
        seqlen_k (row-predicated). q_in_regs: wait for Q and load its fragments once."""
        load_q(seqlen_q - m_block * self.tile_m)
        cute.arch.cp_async_commit_group()
        for s in cutlass.range_constexpr(self.num_stages):
            if n_block_max - 1 - s >= n_block_min:
                load_k(n_block_max - 1 - s, Int32(s), edge=(s == 0))
            cute.arch.cp_async_commit_group()
            if const_expr(s < self.num_stages - 1):
                if n_block_max - 1 - s >= n_block_min:
                    load_v(n_block_max - 1 - s, Int32(s), edge=(s == 0))
                cute.arch.cp_async_commit_group()
        if const_expr(self.q_in_regs):
            cute.arch.cp_async_wait_group(2 * self.num_stages - 1)
            cute.arch.barrier()
            cute.copy(ops.s.copy_a, ops.tSsQ, ops.s.copy_a.retile(ops.s.a))

    @cute.jit
    def one_n_block(self, n_block: Int32, stage: Int32, tiled_mma: cute.TiledMma, ops: Operands, acc_O: cute.Tensor,
                    softmax: OnlineSoftmax, load_k, load_v, n_block_min: Int32, score_params: ScoreParams, mask,
                    is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool]) -> Int32:
        """Key block n_block from smem stage `stage` (see the class docstring for the order of waits,
        barriers and loads). Returns the next block's stage."""
        S = self.num_stages
        # K[n] has landed (2S-2 groups were committed after it) and every thread is past the
        # previous block's P V: the V stage it read is free.
        cute.arch.cp_async_wait_group(2 * S - 2)
        cute.arch.barrier()
        if const_expr(S == 1):
            load_v(n_block, stage, edge=is_first)
        else:
            prev_stage = Int32(cutlass.select_(stage > 0, stage - 1, Int32(S - 1)))
            if n_block - (S - 1) >= n_block_min:
                load_v(n_block - (S - 1), prev_stage, edge=False)
        cute.arch.cp_async_commit_group()

        acc_S = cute.make_rmem_tensor(tiled_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        gemm_kpipe(tiled_mma, acc_S, ops.s, ops.s.sa, ops.s.sb[None, None, None, stage], a_in_regs=self.q_in_regs)
        score.apply(acc_S, score_params.softcap_scale, self.cfg.softcap)
        if const_expr(S == 1):
            self.release_k(n_block - 1, stage, n_block_min, load_k)
        s_view = as_wgmma_acc(acc_S)
        if const_expr(masked):
            # (unmasked_loop clones the masked loop's block without the span of the mask's ops)
            self._mask_span = loop_clone.traced_span(mask, s_view, n_block=n_block, causal=self.causal)
        row_scale = softmax.online(s_view, is_first=is_first)
        if const_expr(not is_first):
            softmax.rescale_O(as_wgmma_acc(acc_O), row_scale)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        tOrP = cute.make_tensor(rP.iterator, acc_to_operand_a(rP.layout))
        if const_expr(S > 1):
            self.release_k(n_block - S, stage, n_block_min, load_k)
        gemm_kpipe_rs(tiled_mma, acc_O, tOrP, ops.o, ops.o.sb[None, None, None, stage])
        next_stage = Int32(0)
        if const_expr(S > 1):
            next_stage = Int32(cutlass.select_(stage < S - 1, stage + 1, Int32(0)))
        return next_stage

    @cute.jit
    def unmasked_loop(self, block, stage: Int32, count: Int32, top: Int32, masked_top: Optional[Int32]) -> Int32:
        """`for i in range(count): stage = block(top - i, stage, is_first=False, masked=False)`: the
        key blocks no mask touches, walked downwards. masked_top: the first block of the masked loop
        (`for i in range(..): stage = block(masked_top - i, stage, is_first=False, masked=True)`, the
        blocks crossing the causal diagonal / a window's right edge) traced just before, else None.
        Then this loop is emitted as that loop's clone without the mask's ops, `top` in place of
        masked_top (kernels/sm80/loop_clone.py: the same IR without tracing one_n_block a third
        time, issue 24); else (no masked loop, or the clone does not apply) it is traced."""
        span = self.__dict__.pop("_mask_span", None)
        cloned = None
        if const_expr(masked_top is not None):
            cloned = loop_clone.clone_without(span, stage.ir_value(), None, count.ir_value(),
                                              remap=((masked_top.ir_value(), top.ir_value()),))
        if const_expr(cloned is not None):
            stage = Int32(cloned)
        else:
            for i in cutlass.range(count, unroll=1):
                stage = block(top - i, stage, is_first=False, masked=False)
        return stage

    @cute.jit
    def release_k(self, n_next: Int32, stage: Int32, n_block_min: Int32, load_k):
        """Wait for this block's V (2S-2 groups were committed after it), barrier (every thread is past
        Q K^T: K's stage is free, V visible to all), then cp.async K[n_next] into the freed stage."""
        cute.arch.cp_async_wait_group(2 * self.num_stages - 2)
        cute.arch.barrier()
        if n_next >= n_block_min:
            load_k(n_next, stage, edge=False)
        cute.arch.cp_async_commit_group()

    def row_coords(self, tiled_copy, thr_copy, rows: int, cols: int):
        """kernels/sm80/rows.row_coords, thread 0's static rows cached on this kernel object."""
        return tile_rows.row_coords(self.__dict__.setdefault("_t0_rows", {}), tiled_copy, thr_copy, rows, cols)

    @cute.jit
    def load_kv(self, tiled_copy, tXgX: cute.Tensor, tXsX: cute.Tensor, tXcX: cute.Tensor, t0_rows: tuple,
                seqlen_k: Int32, n_block: Int32, stage: Int32, edge: cutlass.Constexpr[bool]):
        """cp.async key block n_block of K or V into smem stage `stage`. edge: the block may cross
        seqlen_k (row-predicated, rows past it zeroed); else a whole block."""
        if const_expr(edge):
            tile_rows.load_rows(tiled_copy, tXgX[None, None, None, n_block], tXsX[None, None, None, stage], tXcX,
                                t0_rows, seqlen_k - n_block * self.tile_n)
        else:
            # cute.copy's (V, (Rest)) form of the block, grouped on the unsliced partitions (the
            # same op without its canonicalization per call: mma.copy_op)
            copy_op(tiled_copy, cute.group_modes(tXgX, 1, 3)[None, None, n_block],
                    cute.group_modes(tXsX, 1, 3)[None, None, stage])

    @cute.jit
    def epilogue_split(self, acc_O, inv_row_sum, lse, split_params: SplitParams, tiled_mma, tidx, m_block, head, seq,
                       split):
        """split_kv: this split's O (normalized by its own row sum) in fp32 and its natural-log LSE
        (-inf, O = 0 for a split without keys) go to the partial buffers straight from registers,
        rows < seqlen_q only; flash4's combine kernel merges the splits. (No smem is touched, so no
        barrier: the next tile's Q load waits on the usual cp.async group and barrier.)"""
        cute.arch.cp_async_wait_group(0)  # a split without key blocks never waited for its Q load
        mOacc, mLSEacc = split_params
        thr_mma = tiled_mma.get_slice(tidx)
        tOcO = acc_mn_view(as_wgmma_acc(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v)))))
        gO = cute.local_tile(seq.q_view(mOacc[None, None, None, None, split], head), (self.tile_m, self.hdim_v),
                             (m_block, 0))
        tOgO = acc_mn_view(as_wgmma_acc(thr_mma.partition_C(gO)))
        store_split_partials(acc_mn_view(as_wgmma_acc(acc_O)), tOcO, tOgO, lse, mLSEacc[None, None, None, split],
                             m_block, self.tile_m, head, seq, row_scale=inv_row_sum)

    @cute.jit
    def load_kv_paged(self, gather: PagedGather, mX: cute.Tensor, sX: cute.Tensor, head_kv: Int32,
                      mPageTable: cute.Tensor, seq: SeqInfo, tidx: Int32, n_block: Int32, stage: Int32,
                      edge: cutlass.Constexpr[bool]):
        """cp.async key block n_block of a paged K or V (kernel view (page_size, d, heads_k, num_pages))
        into smem stage `stage`, each row from its own page (this thread's page-table entry of the block,
        shuffled to the threads of its row group); rows past seqlen_k zero-filled, so `edge` changes
        nothing here."""
        page, in_page = gather.lookup(mPageTable, seq.batch, n_block, seq.seqlen_k, mX.shape[0], mX.shape[3], tidx,
                                      n_block >= Int32(0))
        gather.load(mX, sX[None, None, stage], head_kv, page, in_page, n_block, seq.seqlen_k, tidx)

    @cute.jit
    def epilogue(self, acc_O, inv_row_sum, lses, mO, lse_out: LseParams, sO, tiled_mma, tidx, m_block, head, seq):
        """O / rowsum -> 16-bit -> smem (Q's buffer, 32-bit stores in the accumulator layout) -> 16-byte
        row-predicated global stores; LSE (natural log, log2 hi + lo) from the threads owning column 0,
        rows < seqlen_q."""
        seqlen_q = seq.seqlen_q
        o = acc_mn_view(as_wgmma_acc(acc_O))
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        crds = RegCoords.make(rows, cols, rows)  # (element by element without a coordinate per access)
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                st(o, crds.mn[r][c], ld(o, crds.mn[r][c]) * ld(inv_row_sum, crds.flat[r]))
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # Every thread is past its last Q K^T (Q's buffer is free) and Q's own load has landed
        # (a tile without keys never waited for it).
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width)
        thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma).get_slice(tidx)
        cute.copy(store_atom, thr_store.retile(rO), thr_store.partition_D(sO))

        thr_mma = tiled_mma.get_slice(tidx)
        tOcO = acc_mn_view(as_wgmma_acc(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v)))))
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
                row = m_block * self.tile_m + tOcO[r, 0][0]
                if row < seqlen_q:
                    row_idx, batch_idx = seq.q_index(row)
                    for mX, x in zip(lse_out, lses):
                        mX[row_idx, head, batch_idx] = x[r]
        cute.arch.barrier()  # sO complete
        gO = cute.local_tile(seq.q_view(mO, head), (self.tile_m, self.hdim_v), (m_block, 0))
        store_rows_predicated(sO, gO, seqlen_q - m_block * self.tile_m, tidx, self.num_threads)
        if const_expr(self.cfg.persistent):
            cute.arch.barrier()  # sO read out before the next tile's Q lands in its buffer
