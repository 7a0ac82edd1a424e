"""FlashAttention forward for Hopper (sm_90a) in CuTe DSL.

O = softmax(scale * Q K^T) V and LSE, exact, O(N) memory. Design after FlashAttention-3
(Shah et al. 2024, sections 3.1-3.2) with FlashAttention-4's softmax tricks (lazy rescaling,
optional FMA-emulated exp2; Zadouri et al. 2025).
"""

import math
from functools import partial
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from flash4.constants import LOG2E as LOG2E_F, THREADS_PER_WG
from flash4.kernels.common import geometry, score
from flash4.kernels.common.barriers import NamedBarrierFwd
from flash4.kernels.common.gemm import wgmma, wgmma_first
from flash4.kernels.common.dsl import DSL_DTYPES
from flash4.kernels.common.params import MaskParams, SeqParams
from flash4.kernels.common.pipeline import cp_async_pipeline_factory, next_state, tma_pipeline_factory
from flash4.kernels.common.pin import keep_here_i32
from flash4.kernels.common.layout import (acc_mn_view, acc_to_frgA_layout, make_packed_tma_atom, pack_gqa_view,
                                          select_modes, transpose_view)
from flash4.kernels.common.scheduler import TileSchedule
from flash4.kernels.common.seqinfo import SeqInfo, store_rows_predicated, store_split_partials
from flash4.kernels.common.softmax import OnlineSoftmax
from flash4.kernels.common.paged_gather import ENTRY_AHEAD, PagedGather

# setmaxnreg budgets (producer, consumer) by consumer warpgroup count: 64K registers / CTA.
_REGS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
# Gathered paged K/V (page_gather): the producer warpgroup computes addresses and issues cp.async
# (FlashAttention-3 takes 40 / 232 for its non-TMA paged K/V with 2 consumer warpgroups).
_REGS_GATHER = {1: (56, 256), 2: (40, 232), 3: (32, 160)}
# the producer warpgroup's warps (FwdConfig.page_pieces_all_warps: each issues every fourth page piece)
PRODUCER_WARPS = THREADS_PER_WG // 32


# ---------------------------------------------------------------------- parameter bundles
# The kernel and its role methods take these NamedTuples instead of loose parameters; the shared
# ones (SeqParams, MaskParams) are in kernels/common/params.py. The DSL passes a bundle's fields as
# kernel parameters in field order (a None field specializes the kernel away), so the order of the
# kernel's bundles fixes the parameter buffer's layout: it is kept as it was with loose parameters
# (tensors, TMA descriptors, scalars), which keeps the SASS unchanged.
class QKVO(NamedTuple):
    """One value per operand Q, K, V, O: their TMA tensors, TMA atoms, smem layouts or smem tiles.

    TMA tensors, kernel view: q (seqlen_q, d, nheads, batch), GQA-packed ((pack, seqlen_q), d,
    nheads_k, batch); k, v (seqlen_k, d | dv, nheads_k, batch), paged (page_size, d | dv, nheads_k,
    num_pages); o like q with dv, or O itself for ragged queries (stored row-predicated).
    TMA atoms: q, k, v loads (paged K/V: one page piece per copy), o the store.
    smem: q, o (tile_m, d | dv); k, v (tile_n, d | dv, STAGE) (O may live in Q's buffer).
    """

    q: object
    k: object
    v: object
    o: object


class LseParams(NamedTuple):
    """Per-row outputs, fp32 (seqlen_q, nheads, batch) (GQA-packed: ((pack, seqlen_q), nheads_k,
    batch)): the natural-log LSE, and the log2-domain LSE unrounded as hi + lo (the backward's
    exact path); the order of OnlineSoftmax.finalize's (lse, lse_hi, lse_lo)."""

    lse: cute.Tensor
    lse_hi: cute.Tensor
    lse_lo: cute.Tensor


class SplitParams(NamedTuple):
    """split_kv partial results, each split normalized by its own row sum (None otherwise);
    flash4's combine kernel merges them.

    o_acc: fp32 (seqlen_q, dv, nheads, batch, split).  lse_acc: fp32 (seqlen_q, nheads, batch, split).
    """

    o_acc: Optional[cute.Tensor]
    lse_acc: Optional[cute.Tensor]


class ScoreParams(NamedTuple):
    """Scales of the scores, folded on the host (kernels/common/score.scales).

    scale_log2: the softmax's log2 scale, softmax_scale * log2 e (softcap: softcap * log2 e).
    softcap_scale: softcap: the tanh's input scale softmax_scale / softcap; else ignored.
    """

    scale_log2: Float32
    softcap_scale: Float32


class TileSpace(NamedTuple):
    """The tile space of the grid (kernels/common/scheduler.py orders it).

    batch_size: number of sequences.  max_seqlen_q: >= every sequence's query count.
    num_splits: split_kv: key-block ranges per (m_block, head, batch) (1 otherwise).
    """

    batch_size: Int32
    max_seqlen_q: Int32
    num_splits: Int32


class TiledMmas(NamedTuple):
    """qk: S = Q K^T (SS, tile_m x tile_n); pv: O += P V (RS, tile_m x dv); one wgmma atom per
    consumer warpgroup along M."""

    qk: cute.TiledMma
    pv: cute.TiledMma


class Pipelines(NamedTuple):
    """Device side: the producer -> consumer pipelines of Q (1 stage), K and V (kv_stages each)."""

    q: pipeline.PipelineTmaAsync
    k: pipeline.PipelineTmaAsync
    v: pipeline.PipelineTmaAsync


class MmaOperands(NamedTuple):
    """Device side, per consumer thread: the main loop's wgmma operands.

    q: (MMA, MMA_M, MMA_K) smem descriptors of Q; k, vt: (MMA, MMA_N, MMA_K, STAGE) of K and V^T;
    p: the A operand of P V: 16-bit P in registers (the S accumulator's fragment), or with
    FwdConfig.p_smem the smem descriptors of the warpgroup's P tile; acc_shape_S: S's shape;
    p_store: None, or with p_smem (the stmatrix thread copy, this thread's P destination in smem).
    """

    q: cute.Tensor
    k: cute.Tensor
    vt: cute.Tensor
    p: cute.Tensor
    acc_shape_S: tuple
    p_store: Optional[tuple] = None


class FlashAttentionForwardSm90:
    """Warp-specialized forward kernel, one CTA per (m_block, head, batch) tile (persistent: one
    CTA per SM walking the tile order, kernels/common/scheduler.py).

    Warp roles (threads 0-127 = producer warpgroup, then one consumer warpgroup per 64 query rows);
    `kernel` sets up smem, pipelines and the tile order and hands off to one method per role:
      * producer warp 0 (`load`): TMA loads. Per tile K[n_max-1], then Q, then for each next block
        K[n] followed by V[n+1] (the order the consumers use them); last V[n_min] (`load_kv`: one
        TMA copy per block, or per page piece when paged). Warps 1-3 only give up registers.
      * consumer warpgroups 1..W (`mma`): wgmma S = Q K^T (SS), softcap (kernels/common/score.py),
        mask and online softmax on S in registers, P converted to 16-bit in registers, wgmma
        O += P V (RS), epilogue (`epilogue`, or `epilogue_split` for split_kv).
    Pipelines (producer -> consumer; the producer thread's TMA completes the tx-count, consumers
    release with one arrive per warp):
      * pipeline_q (1 stage): Q tile; released once the epilogue's store has read O back out of
        Q's buffer, or (O in its own buffer) right after the tile's last P V, or (FwdConfig.
        early_q_release) right after the tile's last Q K^T has completed.
      * pipeline_k, pipeline_v (kv_stages each): K and V blocks, sharing one state; K released
        once S = Q K^T is done, V once O += P V is.
    Consumer steady state per key block n (`mma_one_n_block`, intra-warpgroup overlap, FA3 section 3.2):
      issue S_n = Q K_n ; issue O += P_{n+1} V_{n+1} ; wait S_n ; release K_n ; softcap + mask +
      softmax(S_n) ; wait O ; release V_{n+1} ; P_n = cvt(S_n) ; rescale O if some row max moved past tau.
    Inter-warpgroup ping-pong (FA3 section 3.1): warpgroup w issues its GEMMs only after the other
    warpgroup has issued its own, so one warpgroup's softmax overlaps the other's GEMMs.
    Epilogue: O / rowsum -> 16-bit -> smem (Q's buffer, or its own when persistent and smem allows)
    via stmatrix -> one TMA store; LSE straight from registers. split_kv: fp32 O and LSE of the
    split straight from registers to the partial buffers.
    Parameters: the kernel and the role methods take the bundles defined above (QKVO, LseParams,
    SplitParams, ScoreParams, TileSpace, TiledMmas; SeqParams, MaskParams from
    kernels/common/params.py); runtime values reach device code only as arguments, never as
    attributes of `self` (those are trace-time constants from the config).
    Sequence layouts (FwdConfig varlen_q / varlen_k / seqused_* / page_rows, kernels/common/seqinfo.py):
    each tile reads its sequence's offsets and lengths; a query tile past its sequence's length is
    skipped; packed Q/K/V are addressed through domain offsets of the TMA views; a packed O is
    stored row-predicated from smem (rows past the sequence belong to the next one); paged K/V
    are loaded page piece by page piece (page_rows rows per TMA copy, page index from page_table;
    page_prefetch: `load_paged` reads the entries two K loads ahead), or with page_gather gathered
    row by row by all four producer warps' cp.async (`load_paged`, paged_gather.py: pages of any
    size; the K/V pipelines are then cp.async pipelines, the Q pipeline stays TMA).
    Nothing past a sequence reaches a result: keys past seqlen_k get score -inf (mask_scores, before
    the row max), and with a ragged K side (varlen_k / seqused_k / paged, where those rows hold other
    data rather than TMA zeros) the V rows past seqlen_k of the key-edge block are zeroed in smem
    before any P V reads them (`zero_v_tail`: 0 * NaN would be NaN), or, gathered pages with
    FwdConfig.gather_zero_fill, written as zeros by the producer's cp.async (src-size 0) so no
    consumer writes a stage; rows past seqlen_q are never stored (TMA clipping, or row-predicated
    stores).
    GQA packing (FwdConfig.pack_gqa = p > 1, dense Q): a tile's rows are packed rows r = query * p + j
    of the p query heads of one KV head (layout.pack_gqa_view); Q and O move as TMA boxes
    (p heads x tile_m / p queries x d), the tile order runs over KV heads, the masks and block ranges
    take query r // p (flash4.geometry's pack argument), each row reads its own head's sink and LSE.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.dtype = DSL_DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.hdim = cfg.tile_m, cfg.tile_n, cfg.headdim
        self.hdim_v = cfg.hdim_v  # V / O head dim (Dv; = hdim unless cfg.headdim_v)
        self.num_stages = cfg.kv_stages
        self.causal = cfg.causal
        self.num_wg_mma = cfg.num_consumer_warpgroups
        self.num_mma_threads = THREADS_PER_WG * self.num_wg_mma
        self.num_threads = cfg.num_threads
        self.num_producer_regs, self.num_mma_regs = (_REGS_GATHER if cfg.page_gather else _REGS)[self.num_wg_mma]
        self.use_scheduler_barrier = self.num_wg_mma >= 2 and self.hdim <= 128
        self.buffer_align_bytes = 1024
        # Persistent CTAs stage O in its own buffer when smem allows, so the next tile's Q can
        # load during this tile's epilogue; otherwise O reuses Q's buffer.
        self.separate_o = cfg.persistent and cfg.separate_o_fits()
        # FwdConfig.early_q_release: Q's buffer is freed after the tile's last Q K^T (`mma`); only
        # with O in its own buffer (Q's would still receive O).
        self.early_q_release = cfg.early_q_release
        # FwdConfig.lookahead_qk: the next block's Q K^T runs under this block's softmax (key_blocks_lookahead)
        self.lookahead_qk = cfg.lookahead_qk
        # FwdConfig.pv_zero_init: the tile's first P V writes acc_O (not with the look-ahead loop)
        self.pv_zero_init = cfg.pv_zero_init and not cfg.lookahead_qk
        # FwdConfig.p_smem: P reaches P V through shared memory (the wgmma's A from smem), not registers
        self.p_smem = cfg.p_smem
        if self.early_q_release and not self.separate_o:
            raise ValueError(f"flash4 fwd_sm90: early_q_release needs O in its own smem buffer (persistent, "
                             f"smem for it): {cfg}")
        self.page_rows = cfg.page_rows
        # Paged K/V gathered row by row by the whole producer warpgroup (paged_gather.py).
        self.page_gather = cfg.page_gather
        self.gather = (PagedGather(self.dtype, self.tile_n, self.hdim, self.hdim_v, cfg.gather_zero_fill,
                                   clamp_late=cfg.gather_clamp_late, ptr_shuffle=cfg.gather_ptr_shuffle)
                       if cfg.page_gather else None)
        # Query tiles may lie past their sequence (varlen: the grid covers max_seqlen_q).
        self.ragged_q = cfg.ragged_q
        # GQA packing: the pack query heads of a KV head share each query tile (layout.pack_gqa_view).
        self.pack = cfg.pack_gqa
        # Key blocks may hold rows past seqlen_k that are not TMA zeros (stale cache slots, the
        # next packed sequence, a partial page piece): the key-edge block's V tail is zeroed.
        self.ragged_k = cfg.ragged_k
        # ... unless the gathering producer zero-fills those rows itself (FwdConfig.gather_zero_fill):
        # then no consumer writes a K/V stage (zero_v_tail is not traced).
        self.zero_v_tail_needed = self.ragged_k and not cfg.gather_zero_fill and not cfg.no_tail_guard
        # FwdConfig.no_tail_guard (A/B only: what issue 25's guards cost): rows past seqlen_q vote too
        self.vote_row_limit = self.ragged_q and not cfg.no_tail_guard

    # ------------------------------------------------------------------ host side (trace time)
    def _smem_layout(self, rows: int, stages=None, rows_outer: bool = False, hdim=None):
        """Swizzled (rows, hdim[, stages]) tile (hdim: the Q/K head dim unless given, e.g. Dv).
        rows_outer: swizzle atoms tile headdim first, so every 8-row slab is contiguous (a paged
        key block's page pieces are TMA boxes)."""
        hdim = self.hdim if hdim is None else hdim
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, hdim), self.dtype
        )
        shape = (rows, hdim) if stages is None else (rows, hdim, stages)
        if rows_outer:
            return cute.tile_to_shape(atom, shape, order=(1, 0) if stages is None else (1, 0, 2))
        return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))

    def _tiled_mmas(self):
        atom_layout = (self.num_wg_mma, 1, 1)
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K,
            Float32, atom_layout, (64, self.tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN,
            Float32, atom_layout, (64, self.hdim_v),
            a_source=warpgroup.OperandSource.SMEM if self.p_smem else warpgroup.OperandSource.RMEM,
        )
        return tiled_mma_qk, tiled_mma_pv

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
        mPageTable: Optional[cute.Tensor],  # (batch, max_pages) int32 when paged: K/V (num_pages, page_size, nheads_k, d)
        mOacc: Optional[cute.Tensor],  # split_kv: (num_splits, batch, seqlen_q, nheads, dv) fp32 partial O
        mLSEacc: Optional[cute.Tensor],  # split_kv: (num_splits, batch, nheads, seqlen_q) fp32 partial LSE
        mSink: Optional[cute.Tensor],  # sink: (nheads,) fp32 sink logits (natural units)
        softmax_scale_log2: Float32,  # softmax_scale * log2(e); softcap: softcap * log2(e)
        softcap_scale: Float32,  # softcap: softmax_scale / softcap (the tanh's input scale); else ignored
        batch_size: Int32,  # number of sequences
        max_seqlen_q: Int32,  # >= every sequence's query count: sizes the tile space
        num_splits: Int32,  # split_kv: key-block ranges per (m_block, head, batch) (1 otherwise)
        window_left: Int32,  # local: the window's sides (flash4.geometry.window_sides); ignored otherwise
        window_right: Int32,
        l2_group: Int32,  # (head, batch) pairs per L2 section of the tile order (>= 1)
        num_ctas: Int32,  # grid size: number of tiles, or number of SMs when persistent
        stream: cuda.CUstream,
    ):
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError(f"flash4 fwd_sm90: tensors must all be {self.dtype}")
        # Kernel-side views: (seqlen, headdim, nheads, batch) and LSE (seqlen_q, nheads, batch).
        mQ, mK, mV, mO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        if const_expr(self.cfg.split_kv):
            mOacc = select_modes(mOacc, [2, 4, 3, 1, 0])  # (seqlen_q, d, nheads, batch, split)
            mLSEacc = select_modes(mLSEacc, [3, 2, 1, 0])  # (seqlen_q, nheads, batch, split)
        mLSE, mLSEhi, mLSElo = [select_modes(t, [2, 1, 0]) for t in (mLSE, mLSEhi, mLSElo)]
        if const_expr(self.pack > 1):  # ((pack, seqlen_q), nheads_k, batch): row r = query r // pack
            mLSE, mLSEhi, mLSElo = [pack_gqa_view(t, self.pack, 1) for t in (mLSE, mLSEhi, mLSElo)]

        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        sQ_layout = self._smem_layout(self.tile_m)
        sK_layout = self._smem_layout(self.tile_n, self.num_stages)
        sV_layout = sK_layout
        sO_layout = sQ_layout  # O is staged in Q's buffer once Q is no longer read
        if const_expr(self.hdim_v != self.hdim):
            sV_layout = self._smem_layout(self.tile_n, self.num_stages, hdim=self.hdim_v)
            sO_layout = self._smem_layout(self.tile_m, hdim=self.hdim_v)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        if const_expr(self.pack > 1):
            tma_atom_Q, tma_Q = make_packed_tma_atom(load_op, mQ, sQ_layout, (self.tile_m, self.hdim), self.pack)
        else:
            tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_layout, (self.tile_m, self.hdim))
        # Paged: TMA boxes of page pieces (page_rows x headdim).
        kv_box_rows = self.page_rows if const_expr(self.page_rows > 0) else self.tile_n
        if const_expr(self.page_gather):  # K/V read through plain pointers (paged_gather.py)
            tma_atom_K, tma_K, tma_atom_V, tma_V = None, mK, None, mV
            k_stage_layout, v_stage_layout = cute.select(sK_layout, mode=[0, 1]), cute.select(sV_layout, mode=[0, 1])
        else:
            tma_atom_K, tma_K, k_stage_layout = self._kv_tma(load_op, mK, sK_layout, self.hdim, kv_box_rows)
            tma_atom_V, tma_V, v_stage_layout = self._kv_tma(load_op, mV, sV_layout, self.hdim_v, kv_box_rows)
        if const_expr(self.pack > 1):
            tma_atom_O, tma_O = make_packed_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout,
                                                     (self.tile_m, self.hdim_v), self.pack)
        else:
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (self.tile_m, self.hdim_v)
            )
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tma_bytes_kv = cute.size_in_bytes(self.dtype, k_stage_layout)
        self.tma_bytes_v = cute.size_in_bytes(self.dtype, v_stage_layout)

        o_elems = cute.cosize(sO_layout) if const_expr(self.separate_o) else 0
        p_elems = cute.cosize(self._smem_layout(self.tile_m, hdim=self.tile_n)) if const_expr(self.p_smem) else 0
        # O staged in Q's buffer: sized for the larger of the two (Dv > D).
        q_elems = cute.cosize(sQ_layout)
        if const_expr(not self.separate_o):
            q_elems = max(q_elems, cute.cosize(sO_layout))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], self.buffer_align_bytes]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], self.buffer_align_bytes]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], self.buffer_align_bytes]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, o_elems], self.buffer_align_bytes]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], self.buffer_align_bytes]

        # A packed O is stored row-predicated (plain stores): the kernel needs O itself.
        mO_out = mO if const_expr(self.ragged_q) else tma_O
        self.kernel(
            QKVO(tma_Q, tma_K, tma_V, mO_out),
            LseParams(mLSE, mLSEhi, mLSElo),
            SeqParams(mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable),
            SplitParams(mOacc, mLSEacc),
            mSink,
            QKVO(tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O),
            ScoreParams(softmax_scale_log2, softcap_scale),
            TileSpace(batch_size, max_seqlen_q, num_splits),
            MaskParams(window_left, window_right),
            l2_group,
            QKVO(sQ_layout, sK_layout, sV_layout, sO_layout),
            TiledMmas(tiled_mma_qk, tiled_mma_pv),
            SharedStorage,
        ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def _kv_tma(self, load_op, mX, sX_layout, hdim: int, box_rows: int):
        """(TMA atom, TMA tensor, stage layout) of K or V (hdim: its head dim). Paged: a page piece is
        rows [i * page_rows, (i + 1) * page_rows) of the stage tile, the stage layout composed with
        that row range (its 64-column chunks are contiguous boxes)."""
        stage_layout = cute.select(sX_layout, mode=[0, 1])
        box_layout = stage_layout
        if const_expr(self.page_rows > 0):
            box_layout = cute.composition(stage_layout, cute.make_layout((self.page_rows, hdim), stride=(1, self.tile_n)))
        atom, tma = cpasync.make_tiled_tma_atom(load_op, mX, box_layout, (box_rows, hdim), 1)
        return atom, tma, stage_layout

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        # In the order of the kernel's parameter buffer: tensors, TMA descriptors, scalars (see the bundles).
        tma: QKVO,  # TMA tensors of Q, K, V, O (O itself for ragged queries)
        lse_out: LseParams,
        seq_params: SeqParams,
        split_params: SplitParams,
        sink: Optional[cute.Tensor],  # sink: (nheads,) fp32 sink logits (natural units)
        atoms: QKVO,  # TMA atoms of Q, K, V (loads) and O (store)
        score_params: ScoreParams,
        tiles: TileSpace,
        mask_params: MaskParams,
        l2_group: Int32,  # (head, batch) pairs per L2 section of the tile order (>= 1)
        layouts: QKVO,  # smem layouts of Q, K, V, O
        mmas: TiledMmas,
        SharedStorage: cutlass.Constexpr,
    ):
        if const_expr(self.cfg.pdl_combine):  # the combine (launched with PDL) may start now: it waits for us
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in atoms:
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        make_pipe = tma_pipeline_factory(self.num_mma_threads)
        pipeline_q = make_pipe(barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, tx_count=self.tma_bytes_q)
        if const_expr(self.page_gather):
            make_kv_pipe = cp_async_pipeline_factory(THREADS_PER_WG, self.num_mma_threads)
            pipeline_k = make_kv_pipe(barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages)
            pipeline_v = make_kv_pipe(barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages)
        else:
            pipeline_k = make_pipe(
                barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages, tx_count=self.tma_bytes_kv
            )
            pipeline_v = make_pipe(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages, tx_count=self.tma_bytes_v
            )
        pipes = Pipelines(pipeline_q, pipeline_k, pipeline_v)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # (tile_m, d) / (tile_n, d, STAGE) / (tile_n, dv, STAGE) / (tile_m, dv)
        sQ = storage.sQ.get_tensor(layouts.q.outer, swizzle=layouts.q.inner)
        sK = storage.sK.get_tensor(layouts.k.outer, swizzle=layouts.k.inner)
        sV = storage.sV.get_tensor(layouts.v.outer, swizzle=layouts.v.inner)
        sO_storage = storage.sO if const_expr(self.separate_o) else storage.sQ
        sO = sO_storage.get_tensor(layouts.o.outer, swizzle=layouts.o.inner)
        smem_tiles = QKVO(sQ, sK, sV, sO)
        sP = None
        if const_expr(self.p_smem):  # (tile_m, tile_n) 16-bit P, swizzled as a K-major wgmma A operand
            sP_layout = self._smem_layout(self.tile_m, hdim=self.tile_n)
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        # Tile order (see common/scheduler.py): this CTA takes tiles blockIdx.x, + gridDim.x, ...
        num_m_blocks = cute.ceil_div(tiles.max_seqlen_q * self.pack, self.tile_m)  # packed rows (pack = 1: queries)
        # split_kv: the "batch" of the tile order runs over (batch, split) pairs, split fastest.
        num_hb = tma.q.shape[2] * tiles.batch_size * (tiles.num_splits if const_expr(self.cfg.split_kv) else 1)
        # FwdConfig.flat_tile_order: without cfg.lpt the host's l2_group is 1 (compile/cache.py), so the
        # order decodes without sections
        sched = TileSchedule(num_m_blocks, tma.q.shape[2], num_hb, l2_group, self.causal and self.cfg.lpt,
                             flat=self.cfg.flat_tile_order and not self.cfg.lpt)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.num_producer_regs)
            if const_expr(self.page_gather):  # the whole producer warpgroup gathers K/V
                self.load_paged(tma, atoms, seq_params, mask_params, smem_tiles, pipes, sched, tiles.num_splits,
                                warp_idx)
            elif const_expr(self.cfg.page_prefetch and self.cfg.page_pieces_all_warps):
                # FwdConfig.page_pieces_all_warps: the four producer warps issue the page pieces
                self.load_paged(tma, atoms, seq_params, mask_params, smem_tiles, pipes, sched, tiles.num_splits,
                                warp_idx)
            elif const_expr(self.cfg.page_prefetch):
                if warp_idx == 0:
                    self.load_paged(tma, atoms, seq_params, mask_params, smem_tiles, pipes, sched, tiles.num_splits,
                                    warp_idx)
            elif warp_idx == 0:
                self.load(tma, atoms, seq_params, mask_params, smem_tiles, pipes, sched, tiles.num_splits)
        else:
            cute.arch.setmaxregister_increase(self.num_mma_regs)
            tidx = cute.arch.thread_idx()[0] - THREADS_PER_WG
            self.mma(tma, atoms, lse_out, split_params, sink, score_params, seq_params, mask_params, smem_tiles, mmas,
                     pipes, sched, tiles.num_splits, tidx, sP)

    @cute.jit
    def load(self, tma: QKVO, atoms: QKVO, seq_params: SeqParams, mask_params: MaskParams, smem: QKVO,
             pipes: Pipelines, sched: TileSchedule, num_splits: Int32):
        """Producer warp: per tile, TMA loads of K[n_max-1], Q, then K[n] / V[n+1] pairs down to
        n_min, then V[n_min]. K/V of the next tile stream in while the consumers finish this one."""
        mQ, mK, mV = tma.q, tma.k, tma.v
        sQ, sK, sV = smem.q, smem.k, smem.v
        pipeline_q, pipeline_k, pipeline_v = pipes
        window = mask_params.window(self.cfg.local)
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        one_cta = cute.make_layout(1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        tile_idx = cute.arch.block_idx()[0]
        while tile_idx < sched.num_tiles():
            m_block, head, batch = sched.coords(tile_idx)
            batch, split = self.split_coords(batch, num_splits)
            seq = SeqInfo(batch, self.seqlen_q_static(mQ), mK.shape[0], *seq_params.lengths())
            in_range = True
            if const_expr(self.ragged_q):
                in_range = m_block * self.tile_m < seq.seqlen_q
            if in_range:
                head_kv = head // qhead_per_kvhead
                gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (m_block, 0))
                # ((atom_v, rest_v)) / ((atom_v, rest_v), STAGE)
                tQsQ, tQgQ = cpasync.tma_partition(atoms.q, 0, one_cta, cute.group_modes(sQ, 0, 2),
                                                   cute.group_modes(gQ, 0, 2))
                page_table = seq_params.page_table
                load_K = partial(self.load_kv, atoms.k, mK, sK, pipeline_k, head_kv, seq, page_table, self.hdim)
                load_V = partial(self.load_kv, atoms.v, mV, sV, pipeline_v, head_kv, seq, page_table, self.hdim_v)
                n_block_min, n_block_max = self.n_block_range(m_block, seq, split, num_splits, window)
                if n_block_max > n_block_min:
                    pipeline_k.producer_acquire(state)
                    load_K(n_block_max - 1, state)
                # Q always goes through its pipeline (also for a tile that sees no key): its buffer
                # may hold this tile's O, so the consumers' release orders the reuse.
                pipeline_q.producer_acquire(q_state)
                cute.copy(atoms.q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
                q_state = next_state(q_state)
                if n_block_max > n_block_min:
                    for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                        n_prev = n_block_max - 1 - i
                        state_prev = state
                        state = next_state(state)
                        pipeline_k.producer_acquire(state)
                        load_K(n_prev - 1, state)
                        pipeline_v.producer_acquire(state_prev)
                        load_V(n_prev, state_prev)
                    pipeline_v.producer_acquire(state)
                    load_V(n_block_min, state)
                    state = next_state(state)
            tile_idx += cute.arch.grid_dim()[0]

    @cute.jit
    def load_kv(self, tma_atom, mX, sX, pipe, head_kv, seq, mPageTable, hdim: cutlass.Constexpr[int], n_block, state):
        """TMA load of key block n_block of K or V (kernel view (seqlen, d, heads_k, batch), or paged
        (page_size, d, heads_k, num_pages); hdim: its head dim) into stage state.index, completing
        on its barrier."""
        one_cta = cute.make_layout(1)
        bar = pipe.producer_get_barrier(state)
        if const_expr(self.page_rows == 0):
            gX = cute.local_tile(seq.k_view(mX, head_kv), (self.tile_n, hdim), (n_block, 0))
            tXsX, tXgX = cpasync.tma_partition(tma_atom, 0, one_cta, cute.group_modes(sX, 0, 2),
                                               cute.group_modes(gX, 0, 2))
            cute.copy(tma_atom, tXgX, tXsX[None, state.index], tma_bar_ptr=bar)
        else:
            # Page pieces of page_rows keys: key j of the sequence is row j % page_size of page
            # page_table[batch, j // page_size]. A piece past seqlen_k reads page num_pages (out of
            # bounds: the TMA unit fills zeros and still counts the bytes), so neither the page
            # table nor K/V is read past the sequence.
            # The block's page-table entries are read at once, lane i taking piece i (one global
            # load latency per block instead of one per piece), then broadcast by shuffles.
            page_size, num_pages = mX.shape[0], mX.shape[3]
            max_pages = mPageTable.shape[1]
            num_pieces = self.tile_n // self.page_rows
            lane = cute.arch.lane_idx()
            lane_key, lane_col, lane_row = self.paged_piece(n_block, lane, page_size)
            lane_page = num_pages
            if (lane < num_pieces) & (lane_key < seq.seqlen_k):
                lane_page = mPageTable[seq.batch, cutlass.min(lane_col, max_pages - 1)]
            entry = (lane_page, lane_row) if const_expr(self.cfg.page_row_shuffle) else lane_page
            self.copy_page_pieces(tma_atom, mX, sX[None, None, state.index], head_kv, hdim, bar, entry, n_block,
                                  0, 1)

    @cute.jit
    def load_paged(self, tma: QKVO, atoms: QKVO, seq_params: SeqParams, mask_params: MaskParams, smem: QKVO,
                   pipes: Pipelines, sched: TileSchedule, num_splits: Int32, warp_idx):
        """Producer of a paged K/V with page-table look-ahead: gathered rows (page_gather; all four
        producer warps, paged_gather.py) or TMA page pieces with page_prefetch (warp 0). `load`'s
        order (K[n_max-1], Q, K[n] / V[n+1] pairs, V[n_min]); the page-table entries of a key block
        are read two K loads before its own, so the producer never waits on them in the steady
        state (one exposed read per tile), and V reuses the entries of its K. Q stays one TMA copy
        of warp 0. FwdConfig.page_pieces_all_warps: all four producer warps run this loop, each
        issuing every fourth page piece (acquire_kv, load_paged_block)."""
        mQ, mK, mV = tma.q, tma.k, tma.v
        sQ, sK, sV = smem.q, smem.k, smem.v
        pipeline_q, pipeline_k, pipeline_v = pipes
        window = mask_params.window(self.cfg.local)
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        tidx = cute.arch.thread_idx()[0]
        one_cta = cute.make_layout(1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        tile_idx = cute.arch.block_idx()[0]
        while tile_idx < sched.num_tiles():
            m_block, head, batch = sched.coords(tile_idx)
            batch, split = self.split_coords(batch, num_splits)
            seq = SeqInfo(batch, self.seqlen_q_static(mQ), mK.shape[0], *seq_params.lengths())
            in_range = True
            if const_expr(self.ragged_q):
                in_range = m_block * self.tile_m < seq.seqlen_q
            if in_range:
                head_kv = head // qhead_per_kvhead
                lookup = partial(self.page_lookup, seq_params.page_table, mK, seq, tidx)
                load_K = partial(self.load_paged_block, atoms.k, mK, sK, pipeline_k, head_kv, seq, tidx, self.hdim)
                load_V = partial(self.load_paged_block, atoms.v, mV, sV, pipeline_v, head_kv, seq, tidx, self.hdim_v)
                n_block_min, n_block_max = self.n_block_range(m_block, seq, split, num_splits, window)
                entry_k = lookup(n_block_max - 1, n_block_min)
                entry_next = lookup(n_block_max - 2, n_block_min)
                if n_block_max > n_block_min:
                    self.acquire_kv(pipeline_k, state, warp_idx)
                    load_K(n_block_max - 1, state, entry_k)
                # Q: warp 0's TMA copy, always through its pipeline (see `load`).
                if warp_idx == 0:
                    gQ = cute.local_tile(seq.q_view(mQ, head), (self.tile_m, self.hdim), (m_block, 0))
                    tQsQ, tQgQ = cpasync.tma_partition(atoms.q, 0, one_cta, cute.group_modes(sQ, 0, 2),
                                                       cute.group_modes(gQ, 0, 2))
                    pipeline_q.producer_acquire(q_state)
                    cute.copy(atoms.q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
                q_state = next_state(q_state)
                if n_block_max > n_block_min:
                    for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                        n_prev = n_block_max - 1 - i
                        entry_v = entry_k
                        entry_k = entry_next
                        # The next iteration loads K[n_prev - 2]: its entries are in flight over the two
                        # loads below (paged_gather.load_order models this loop; ENTRY_AHEAD blocks ahead).
                        entry_next = lookup(n_prev - 1 - ENTRY_AHEAD, n_block_min)
                        state_prev = state
                        state = next_state(state)
                        self.acquire_kv(pipeline_k, state, warp_idx)
                        load_K(n_prev - 1, state, entry_k)
                        self.acquire_kv(pipeline_v, state_prev, warp_idx)
                        load_V(n_prev, state_prev, entry_v)
                    self.acquire_kv(pipeline_v, state, warp_idx)
                    load_V(n_block_min, state, entry_k)
                    state = next_state(state)
            tile_idx += cute.arch.grid_dim()[0]

    @cute.jit
    def acquire_kv(self, pipe, state, warp_idx):
        """The producer's acquire of a K / V stage. With FwdConfig.page_pieces_all_warps (TMA page
        pieces issued by four warps against one full barrier) warp 0 acquires as usual (waits for the
        stage to be empty, then arrives once on its full barrier with the block's transaction bytes)
        and warps 1-3 only wait for the stage to be empty: the full barrier expects one arrival, so
        its phase cannot complete before warp 0's, and the bytes of a piece that lands before that
        arrival count the transaction count below zero until warp 0 adds the block's total (PTX
        mbarrier: the tx-count may go negative within a phase). A warp waits for the stage's
        empty phase, which the consumers signal only after the stage's previous full phase
        completed, so no piece of a warp ahead of warp 0 lands in the previous phase."""
        if const_expr(self.cfg.page_pieces_all_warps):
            if warp_idx == 0:
                pipe.producer_acquire(state)
            else:
                pipe.sync_object_empty.wait(state.index, state.phase)
        else:
            pipe.producer_acquire(state)

    @cute.jit
    def page_lookup(self, mPageTable, mK, seq, tidx, n_block, n_block_min):
        """The page-table entries this thread holds for key block n_block (none are read when
        n_block < n_block_min): gathered, (page, row in page) of its lookup row (paged_gather.py);
        TMA pieces, lane i the page of piece i, num_pages (out of bounds: the TMA fills zeros) for a
        piece past seqlen_k or the block's pieces."""
        page_size, num_pages = mK.shape[0], mK.shape[3]
        in_blocks = n_block >= n_block_min
        if const_expr(self.page_gather):
            return self.gather.lookup(mPageTable, seq.batch, n_block, seq.seqlen_k, page_size, num_pages, tidx,
                                      in_blocks)
        lane = cute.arch.lane_idx()
        lane_key, lane_col, lane_row = self.paged_piece(n_block, lane, page_size)
        lane_page = num_pages
        if in_blocks & (lane < self.tile_n // self.page_rows) & (lane_key < seq.seqlen_k):
            lane_page = mPageTable[seq.batch, cutlass.min(lane_col, mPageTable.shape[1] - 1)]
        if const_expr(self.cfg.page_row_shuffle):  # the piece's row block too (copy_page_pieces)
            return lane_page, lane_row
        return lane_page

    def paged_piece(self, n_block, i, page_size):
        """(first key, page-table column, row block in the page) of page piece i of key block n_block
        (flash4.geometry.paged_piece; FwdConfig.page_divide_free: without the run-time division where
        a piece is a whole page). Plain Python: runs while the calling jit function traces."""
        if self.cfg.page_divide_free:
            return geometry.paged_piece_divide_free(n_block, i, self.tile_n, self.page_rows, page_size)
        return geometry.paged_piece(n_block, i, self.tile_n, self.page_rows, page_size)

    @cute.jit
    def load_paged_block(self, tma_atom, mX, sX, pipe, head_kv, seq, tidx, hdim: cutlass.Constexpr[int], n_block,
                         state, entry):
        """Key block n_block of a paged K or V into stage state.index with the block's page-table
        entries (page_lookup): gathered rows, committed by every producer thread's cp.async arrive;
        or its page pieces' TMA copies (warp 0; with FwdConfig.page_pieces_all_warps warp w of the four
        producer warps the pieces w, w + 4, ...), completing on the stage's barrier."""
        if const_expr(self.page_gather):
            page, in_page = entry
            self.gather.load(mX, sX[None, None, state.index], head_kv, page, in_page, n_block, seq.seqlen_k, tidx)
            pipe.producer_commit(state)
        else:
            bar = pipe.producer_get_barrier(state)
            first, step = 0, 1
            if const_expr(self.cfg.page_pieces_all_warps):
                first, step = cute.arch.make_warp_uniform(tidx // 32), PRODUCER_WARPS
            self.copy_page_pieces(tma_atom, mX, sX[None, None, state.index], head_kv, hdim, bar, entry, n_block,
                                  first, step)

    @cute.jit
    def copy_page_pieces(self, tma_atom, mX, sStage, head_kv, hdim: cutlass.Constexpr[int], bar, entry, n_block,
                         first, step):
        """The TMA copies of key block n_block's page pieces first, first + step, ... into the stage
        sStage, completing on bar; entry (page_lookup): lane i holds the page of piece i, with
        FwdConfig.page_row_shuffle (lane i's page, lane i's row block in its page).
        FwdConfig.page_divide_free: where a piece is a whole page (page_size == page_rows; a uniform
        branch around the loop, so the compiler cannot fold the other path into it by predication)
        every piece starts at row 0 of its page; else (pages of several pieces) the row block by the
        division, or with page_row_shuffle shuffled from the lane that looked the piece up."""
        num_pieces = self.tile_n // self.page_rows
        lane_page, lane_row = entry if const_expr(self.cfg.page_row_shuffle) else (entry, None)
        if const_expr(self.cfg.page_divide_free):
            if mX.shape[0] == self.page_rows:
                for i in cutlass.range(first, num_pieces, step, unroll=1):  # unrolled, the producer spills
                    self.copy_piece(tma_atom, mX, sStage, head_kv, hdim, bar, cute.arch.shuffle_sync(lane_page, i),
                                    0, i)
            else:
                self.copy_page_pieces_general(tma_atom, mX, sStage, head_kv, hdim, bar, lane_page, lane_row, n_block,
                                              first, step)
        else:
            self.copy_page_pieces_general(tma_atom, mX, sStage, head_kv, hdim, bar, lane_page, lane_row, n_block,
                                          first, step)

    @cute.jit
    def copy_page_pieces_general(self, tma_atom, mX, sStage, head_kv, hdim: cutlass.Constexpr[int], bar, lane_page,
                                 lane_row, n_block, first, step):
        """copy_page_pieces' loop for any page size: each piece's row block in its page by the division
        (paged_piece), or with FwdConfig.page_row_shuffle shuffled from lane_row."""
        for i in cutlass.range(first, self.tile_n // self.page_rows, step, unroll=1):
            if const_expr(self.cfg.page_row_shuffle):
                row_block = cute.arch.shuffle_sync(lane_row, i)
            else:
                _, _, row_block = self.paged_piece(n_block, i, mX.shape[0])
            self.copy_piece(tma_atom, mX, sStage, head_kv, hdim, bar, cute.arch.shuffle_sync(lane_page, i),
                            row_block, i)

    def copy_piece(self, tma_atom, mX, sStage, head_kv, hdim: int, bar, page, row_block, i):
        """One page piece's TMA copy: rows row_block * page_rows ... of page `page` (head head_kv) into
        rows i * page_rows ... of sStage. Plain Python: runs while the calling jit function traces."""
        gX = cute.local_tile(mX[None, None, head_kv, page], (self.page_rows, hdim), (row_block, 0))
        sPiece = cute.local_tile(sStage, (self.page_rows, hdim), (i, 0))
        tXsX, tXgX = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sPiece, 0, 2),
                                           cute.group_modes(gX, 0, 2))
        cute.copy(tma_atom, tXgX, tXsX, tma_bar_ptr=bar)

    @cute.jit
    def mma(self, tma: QKVO, atoms: QKVO, lse_out: LseParams, split_params: SplitParams, sink: Optional[cute.Tensor],
            score_params: ScoreParams, seq_params: SeqParams, mask_params: MaskParams, smem: QKVO, mmas: TiledMmas,
            pipes: Pipelines, sched: TileSchedule, num_splits: Int32, tidx: Int32, sP: Optional[cute.Tensor] = None):
        """Consumer warpgroups: per tile, the attention main loop and the epilogue (sP: FwdConfig.p_smem's
        P tile, else None)."""
        mQ, mK = tma.q, tma.k
        sQ, sK, sV = smem.q, smem.k, smem.v
        tiled_mma_qk, tiled_mma_pv = mmas
        pipeline_q, pipeline_k, pipeline_v = pipes
        window = mask_params.window(self.cfg.local)
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        wg_slice = cute.make_layout(self.num_wg_mma, stride=THREADS_PER_WG)(wg_idx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_slice)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_slice)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        # (MMA, MMA_M, MMA_K) and (MMA, MMA_N, MMA_K, STAGE) smem descriptors
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_view(sV)))
        acc_shape_S = tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((self.tile_m, self.hdim_v)), Float32)
        # P: the S accumulator viewed as the A operand of P @ V, in 16 bits
        p_store = None
        if const_expr(self.p_smem):  # ... stored to sP (stmatrix), read by the wgmma from there
            tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_A(sP))
            p_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                         self.dtype)
            p_copy = cute.make_tiled_copy_C(p_atom, tiled_mma_qk).get_slice(tidx)
            p_store = (p_copy, p_copy.partition_D(sP))
        else:
            tOrP = cute.make_rmem_tensor(acc_to_frgA_layout(cute.make_layout(acc_shape_S)).shape, self.dtype)
        ops = MmaOperands(tSrQ, tSrK, tOrVt, tOrP, acc_shape_S, p_store)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = thr_mma_qk.partition_C(cS)
        t0ScS = tiled_mma_qk.get_slice(0).partition_C(cS)
        softmax = OnlineSoftmax(
            score_params.scale_log2, cute.size(acc_mn_view(tScS), mode=[0]),
            self.cfg.rescale_threshold, self.cfg.exp2_emu_frac,
            # ragged queries: rows past seqlen_q (another sequence's, stale) do not vote for the exact path
            row_coords=acc_mn_view(tScS) if const_expr(self.vote_row_limit) else None,
            vote_first=self.cfg.softmax_vote_first,  # FwdConfig.softmax_vote_first (speed switch)
            rescale_always=self.cfg.rescale_always,  # FwdConfig.rescale_always (speed switch)
            split_max=self.cfg.split_row_max,  # FwdConfig.split_row_max (speed switch)
            branch_free=self.cfg.softmax_branch_free,  # FwdConfig.softmax_branch_free (speed switch)
        )
        self.scheduler_barrier_init(wg_idx)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        tile_idx = cute.arch.block_idx()[0]
        while tile_idx < sched.num_tiles():
            m_block, head, batch = sched.coords(tile_idx)
            batch, split = self.split_coords(batch, num_splits)
            seq = SeqInfo(batch, self.seqlen_q_static(mQ), mK.shape[0], *seq_params.lengths())
            seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
            in_range = True
            if const_expr(self.ragged_q):
                in_range = m_block * self.tile_m < seqlen_q
            if in_range:
                n_block_min, n_block_max = self.n_block_range(m_block, seq, split, num_splits, window)
                mask = partial(geometry.mask_scores, tScS=tScS, t0ScS=t0ScS, m_block=m_block, seqlen_q=seqlen_q,
                               seqlen_k=seqlen_k, tile_m=self.tile_m, tile_n=self.tile_n, window=window,
                               pack=self.pack, bits=self.cfg.mask_bits)
                softmax.reset(seqlen_q - m_block * self.tile_m if const_expr(self.vote_row_limit) else None)
                o_acc = cutlass.Boolean(False)  # pv_zero_init: no P V has written acc_O yet
                if const_expr(not self.pv_zero_init):
                    acc_O.fill(0.0)
                pipeline_q.consumer_wait(q_state)
                if const_expr(self.pv_zero_init):
                    if n_block_max <= n_block_min:  # no key block: no P V writes acc_O
                        acc_O.fill(0.0)
                if n_block_max > n_block_min:
                    if const_expr(self.lookahead_qk):
                        state = self.key_blocks_lookahead(n_block_min, n_block_max, m_block, seq, window, state,
                                                          q_state, mmas, ops, acc_O, softmax, pipes, score_params,
                                                          mask, sV, tidx, wg_idx)
                    else:
                        # First block (the diagonal / seqlen_k edge): S only; its P V is issued next iteration.
                        pipeline_k.consumer_wait(state)
                        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True, wg_wait=0)
                        pipeline_k.consumer_release(state)
                        if const_expr(self.early_q_release):
                            if n_block_max - 1 == n_block_min:  # the tile's only Q K^T has completed (wg_wait=0)
                                pipeline_q.consumer_release(q_state)
                        score.apply(acc_S, score_params.softcap_scale, self.cfg.softcap)
                        mask(acc_S, n_block=n_block_max - 1, causal=self.causal)
                        softmax.online(acc_S, is_first=True)
                        self.convert_P(acc_S, tOrP, p_store)
                        if const_expr(self.zero_v_tail_needed):
                            # Before any P V reads this block's V stage (next iteration, or the last P V).
                            self.zero_v_tail(sV, pipeline_v, state, n_block_max - 1, seqlen_k, tidx)
                        # Blocks that cross the causal diagonal (a window's right edge), then unmasked
                        # blocks, then (window) blocks that cross its left edge. Together they take
                        # n_block_max - 2 down to n_block_min once each, n_block_min last (early_q_release
                        # frees Q there: q_release).
                        q_release = None
                        if const_expr(self.early_q_release):
                            q_release = (q_state, n_block_min)
                        n_block_unmasked = n_block_max - 1
                        n_block_left = n_block_min
                        if const_expr(self.causal or self.cfg.local):
                            n_causal = geometry.n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, self.tile_m,
                                                                        self.tile_n, window, self.pack)
                            n_causal = cutlass.max(cutlass.min(n_causal, n_block_max - 1), n_block_min)
                            for i in cutlass.range(n_block_max - 1 - n_causal, unroll=1):
                                if const_expr(self.pv_zero_init):
                                    state, o_acc = self.mma_one_n_block(
                                        n_block_max - 2 - i, state, mmas, ops, acc_O, softmax, pipes, score_params,
                                        mask, True, wg_idx, q_release, o_acc)
                                else:
                                    state = self.mma_one_n_block(n_block_max - 2 - i, state, mmas, ops, acc_O, softmax,
                                                                 pipes, score_params, mask, True, wg_idx, q_release)
                            n_block_unmasked = n_causal
                        if const_expr(self.cfg.local):
                            n_left = geometry.n_block_left_mask_end(m_block, seqlen_q, seqlen_k, self.tile_m,
                                                                    self.tile_n, window, self.pack)
                            n_block_left = cutlass.max(cutlass.min(n_left, n_block_unmasked), n_block_min)
                        for i in cutlass.range(n_block_unmasked - n_block_left, unroll=1):
                            if const_expr(self.pv_zero_init):
                                state, o_acc = self.mma_one_n_block(
                                    n_block_unmasked - 1 - i, state, mmas, ops, acc_O, softmax, pipes, score_params,
                                    mask, False, wg_idx, q_release, o_acc)
                            else:
                                state = self.mma_one_n_block(n_block_unmasked - 1 - i, state, mmas, ops, acc_O,
                                                             softmax, pipes, score_params, mask, False, wg_idx,
                                                             q_release)
                        if const_expr(self.cfg.local):
                            for i in cutlass.range(n_block_left - n_block_min, unroll=1):
                                if const_expr(self.pv_zero_init):
                                    state, o_acc = self.mma_one_n_block(
                                        n_block_left - 1 - i, state, mmas, ops, acc_O, softmax, pipes, score_params,
                                        mask, True, wg_idx, q_release, o_acc)
                                else:
                                    state = self.mma_one_n_block(n_block_left - 1 - i, state, mmas, ops, acc_O,
                                                                 softmax, pipes, score_params, mask, True, wg_idx,
                                                                 q_release)
                    # Last P V.
                    pipeline_v.consumer_wait(state)
                    if const_expr(self.pv_zero_init):
                        wgmma_first(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], o_acc, wg_wait=0)
                    else:
                        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], wg_wait=0)
                    pipeline_v.consumer_release(state)
                    state = next_state(state)
                if const_expr(self.separate_o and not self.early_q_release):
                    pipeline_q.consumer_release(q_state)  # Q no longer read: next tile's Q may load
                if const_expr(self.early_q_release):
                    if n_block_max <= n_block_min:  # no key block: Q was never read (else freed above)
                        pipeline_q.consumer_release(q_state)
                sink_log2 = None
                if const_expr(self.cfg.sink and not self.cfg.split_kv):  # split_kv: the combine adds it
                    if const_expr(self.pack > 1):
                        sink_log2 = self.packed_sinks_log2(sink, tScS, m_block, head, softmax.num_rows)
                    else:
                        sink_log2 = Float32(sink[head]) * Float32(LOG2E_F)
                inv_row_sum, lse, lse_hi, lse_lo = softmax.finalize(sink_log2)
                self.normalize_O(acc_O, inv_row_sum)
                if const_expr(self.cfg.split_kv):
                    self.epilogue_split(acc_O, lse, split_params, tiled_mma_pv, tidx, m_block, head, seq, split)
                else:
                    self.epilogue(acc_O, (lse, lse_hi, lse_lo), tma.o, atoms.o, lse_out, smem.o, tiled_mma_pv, tidx,
                                  m_block, head, seq)
                if const_expr(not self.separate_o):
                    # O was staged in Q's buffer: free it once the TMA store has read it.
                    cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_mma_threads)
                    pipeline_q.consumer_release(q_state)
                q_state = next_state(q_state)
            tile_idx += cute.arch.grid_dim()[0]

    def seqlen_q_static(self, mQ):
        """seqlen_q of the Q view (its mode 0 is (pack, seqlen_q) when GQA-packed)."""
        return mQ.shape[0][1] if const_expr(self.pack > 1) else mQ.shape[0]

    def split_coords(self, batch_split, num_splits):
        """(batch, split) of the tile order's pair index (split fastest); split 0 without split_kv."""
        if const_expr(self.cfg.split_kv):
            return batch_split // num_splits, batch_split % num_splits
        return batch_split, Int32(0)

    def n_block_range(self, m_block, seq, split, num_splits, window):
        """[n_block_min, n_block_max): the key blocks this tile visits. Without split_kv all that
        the query tile sees (flash4.geometry; window: MaskParams.window); with it, split `split` of
        num_splits equal runs."""
        n_block_max = geometry.n_block_max(m_block, seq.seqlen_q, seq.seqlen_k, self.tile_m, self.tile_n, self.causal,
                                           window, self.pack)
        n_block_min = Int32(0)
        if const_expr(self.cfg.local):
            n_block_min = geometry.n_block_min(m_block, seq.seqlen_q, seq.seqlen_k, self.tile_m, self.tile_n,
                                               window, self.pack)
        if const_expr(self.cfg.split_kv):
            per_split = (cutlass.max(n_block_max - n_block_min, 0) + num_splits - 1) // num_splits
            n_block_min = cutlass.min(n_block_min + split * per_split, n_block_max)
            n_block_max = cutlass.min(n_block_min + per_split, n_block_max)
        return n_block_min, n_block_max

    @cute.jit
    def packed_sinks_log2(self, mSink, tScS, m_block, head_kv, num_rows: cutlass.Constexpr[int]):
        """GQA-packed rows: each of this thread's rows gets its own head's sink (mSink (nheads,),
        log2 units); packed row r is head head_kv * pack + r % pack."""
        sinks = cute.make_rmem_tensor((num_rows,), Float32)
        c = acc_mn_view(tScS)
        for r in cutlass.range_constexpr(num_rows):
            head = head_kv * self.pack + (m_block * self.tile_m + c[r, 0][0]) % self.pack
            sinks[r] = Float32(mSink[head]) * Float32(LOG2E_F)
        return sinks

    @cute.jit
    def epilogue_split(self, acc_O, lse, split_params: SplitParams, tiled_mma_pv, tidx, m_block, head, seq, split):
        """split_kv: this split's O (normalized by its own row sum) in fp32 and its natural-log LSE
        (-inf, O = 0 for a split without keys) go to the partial buffers, straight from registers,
        rows < seqlen_q only; flash4's combine kernel merges the splits."""
        mOacc, mLSEacc = split_params
        thr_mma = tiled_mma_pv.get_slice(tidx)
        tOcO = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v))))
        gO = cute.local_tile(seq.q_view(mOacc[None, None, None, None, split], head), (self.tile_m, self.hdim_v),
                             (m_block, 0))
        tOgO = acc_mn_view(thr_mma.partition_C(gO))
        store_split_partials(acc_mn_view(acc_O), tOcO, tOgO, lse, mLSEacc[None, None, None, split], m_block,
                             self.tile_m, head, seq)

    @cute.jit
    def mma_one_n_block(self, n_block, state, mmas: TiledMmas, ops: MmaOperands, acc_O, softmax, pipes: Pipelines,
                        score_params: ScoreParams, mask, masked: cutlass.Constexpr[bool], wg_idx, q_release=None,
                        o_acc=None):
        """One key block with intra-warpgroup overlap: S_n = Q K_n runs while O += P_{n+1} V_{n+1}.

        q_release: None, or (q_state, n_block_last) with FwdConfig.early_q_release: at key block
        n_block_last (the tile's last) Q's buffer is released as soon as S_n is complete. Every
        consumer warp arrives after its own warpgroup's wait_group(1) (S_n done; its earlier Q K^T
        were waited for in their own steps), and the producer's acquire of the Q stage waits for the
        arrivals of all consumer warps, so sQ is overwritten only after every warpgroup's last Q K^T."""
        tiled_mma_qk, tiled_mma_pv = mmas
        tSrQ, tSrK, tOrVt, tOrP, acc_shape_S = ops[:5]
        pipeline_k, pipeline_v = pipes.k, pipes.v
        state_v = state
        state = next_state(state)
        pipeline_k.consumer_wait(state)
        self.scheduler_barrier_sync(wg_idx)
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True, wg_wait=-1)
        pipeline_v.consumer_wait(state_v)
        if const_expr(o_acc is None):
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state_v.index], wg_wait=-1)
        else:  # FwdConfig.pv_zero_init: the tile's first P V writes acc_O
            wgmma_first(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state_v.index], o_acc, wg_wait=-1)
        self.scheduler_barrier_arrive(wg_idx)
        warpgroup.wait_group(1)
        pipeline_k.consumer_release(state)
        if const_expr(q_release is not None):
            q_state, n_block_last = q_release
            if n_block == n_block_last:  # S_n, the tile's last Q K^T, is complete
                pipes.q.consumer_release(q_state)
        score.apply(acc_S, score_params.softcap_scale, self.cfg.softcap)
        if const_expr(masked):
            mask(acc_S, n_block=n_block, causal=self.causal)
        row_scale = softmax.online(acc_S, is_first=False)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(state_v)
        self.convert_P(acc_S, tOrP, ops.p_store)
        softmax.rescale_O(acc_O, row_scale)
        if const_expr(o_acc is not None):
            return state, cutlass.Boolean(True)
        return state

    @cute.jit
    def key_blocks_lookahead(self, n_block_min, n_block_max, m_block, seq, window, state, q_state, mmas: TiledMmas,
                             ops: MmaOperands, acc_O, softmax, pipes: Pipelines, score_params: ScoreParams, mask, sV,
                             tidx, wg_idx):
        """FwdConfig.lookahead_qk: a tile's key blocks n_block_max - 1 ... n_block_min (at least one)
        up to the last P V, each block's softmax under the next block's Q K^T as well as under the
        previous block's P V (docs/design/speed_candidates.md section 5). Returns the pipeline state
        of block n_block_min (its V is the caller's last P V).

        Two S accumulators, acc_S and acc_S_next: the first block's S_{max-1} goes to acc_S and is
        waited for; S_{max-2} is issued into acc_S_next before the first block's softmax; from then
        on the S of the next block to soften is in acc_S_next at the start of every run of steps
        (`lookahead_run`: pairs of steps that alternate the two buffers, then for an odd count one
        step that issues its next Q K^T into its own buffer once P is converted and O rescaled), so no
        buffer is chosen at run time. The tile's last block (n_block_min) issues no Q K^T (its own
        step after the runs), masked where the tile has a mask (a fully visible block's mask selects
        nothing: the same bits as unmasked). The masked / unmasked / left-masked split is the one of
        `mma`, over n_block_max - 2 ... n_block_min + 1. A tile of one block: the first block only.
        Every look-ahead Q K^T is issued and waited for inside the `n_block_max - 1 > n_block_min`
        branch (so the first block's softmax is traced twice): a wgmma in flight where two paths
        join serializes all of them (ptxas C7514).

        Pipelines: K_n is waited for before the Q K^T that reads it and released after the wait on
        that Q K^T, one step later than without the switch, so K holds two blocks (kv_stages >= 2,
        lookahead_qk_error); each step waits V_{n+1}, then K_{n-1}: the producer's load order (K[n],
        V[n+1], K[n-1]). Every step after the first block runs one ping-pong round (scheduler_barrier_
        sync / arrive) as `mma_one_n_block` does, so the rounds per tile are unchanged; its waits come
        before its round, and K_{n-1}'s needs only the other warpgroup's release of K_{n+1}, made
        right after that warpgroup's previous round. early_q_release: Q is released after the wait
        on the tile's last Q K^T (S_{n_block_min}, or the only block's), as without the switch."""
        tiled_mma_qk = mmas[0]
        tSrQ, tSrK, tOrVt, tOrP, acc_shape_S = ops[:5]
        pipeline_k = pipes.k
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        acc_S_next = cute.make_rmem_tensor(acc_shape_S, Float32)
        # First block (the diagonal / seqlen_k edge): S only; its P V is issued by the next step.
        pipeline_k.consumer_wait(state)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True, wg_wait=0)
        pipeline_k.consumer_release(state)
        first = partial(self.first_block_softmax, n_block_max - 1, state, acc_S, tOrP, softmax, pipes, score_params,
                        mask, sV, seqlen_k, tidx)
        if n_block_max - 1 > n_block_min:
            # S_{max-2} runs under this block's softmax. The whole life of a look-ahead Q K^T lies in
            # this branch: a wgmma still running where two paths join serializes them all (ptxas
            # C7514), hence the first block's softmax is traced in both branches.
            state_next = next_state(state)
            pipeline_k.consumer_wait(state_next)
            wgmma(tiled_mma_qk, acc_S_next, tSrQ, tSrK[None, None, None, state_next.index], zero_init=True,
                  wg_wait=-1)
            first()
            args = (mmas, ops, acc_O, acc_S, acc_S_next, softmax, pipes, score_params, mask, wg_idx)
            n_block_lo = n_block_min + 1  # the runs stop above the tile's last block
            n_block_unmasked = n_block_max - 1
            n_block_left = n_block_lo
            if const_expr(self.causal or self.cfg.local):
                n_causal = geometry.n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                                                            window, self.pack)
                n_causal = cutlass.max(cutlass.min(n_causal, n_block_max - 1), n_block_lo)
                state = self.lookahead_run(n_block_max - 1, n_causal, state, *args, True)
                n_block_unmasked = n_causal
            if const_expr(self.cfg.local):
                n_left = geometry.n_block_left_mask_end(m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                                                        window, self.pack)
                n_block_left = cutlass.max(cutlass.min(n_left, n_block_unmasked), n_block_lo)
            state = self.lookahead_run(n_block_unmasked, n_block_left, state, *args, False)
            if const_expr(self.cfg.local):
                state = self.lookahead_run(n_block_left, n_block_lo, state, *args, True)
            # The tile's last block: no next Q K^T.
            q_release = q_state if const_expr(self.early_q_release) else None
            state = self.mma_one_n_block_lookahead(n_block_min, state, mmas, ops, acc_O, acc_S_next, acc_S, softmax,
                                                   pipes, score_params, mask, self.causal or self.cfg.local, 0,
                                                   wg_idx, q_release)
        else:
            if const_expr(self.early_q_release):
                pipes.q.consumer_release(q_state)  # the tile's only Q K^T has completed (wg_wait=0)
            first()
        return state

    @cute.jit
    def first_block_softmax(self, n_block, state, acc_S, tOrP, softmax, pipes: Pipelines, score_params: ScoreParams,
                            mask, sV, seqlen_k, tidx):
        """lookahead_qk: the first block's softcap, mask, softmax and P (its P V is issued by the next
        step, or is the tile's last); ragged K: its V tail zeroed before any P V reads it."""
        score.apply(acc_S, score_params.softcap_scale, self.cfg.softcap)
        mask(acc_S, n_block=n_block, causal=self.causal)
        softmax.online(acc_S, is_first=True)
        self.convert_P(acc_S, tOrP)
        if const_expr(self.zero_v_tail_needed):
            self.zero_v_tail(sV, pipes.v, state, n_block, seqlen_k, tidx)

    @cute.jit
    def lookahead_run(self, n_block_hi, n_block_lo, state, mmas: TiledMmas, ops: MmaOperands, acc_O, acc_S, acc_S_next,
                      softmax, pipes: Pipelines, score_params: ScoreParams, mask, wg_idx,
                      masked: cutlass.Constexpr[bool]):
        """lookahead_qk: key blocks n_block_hi - 1 down to n_block_lo (none when n_block_hi <= n_block_lo),
        none of them the tile's last. On entry and on return the S of the next block to soften is in
        acc_S_next (issued, maybe in flight). Unmasked: pairs of steps (acc_S_next -> acc_S, then
        acc_S -> acc_S_next), an odd count's last step issuing its next Q K^T into acc_S_next once
        P is converted. Masked runs (a few blocks per tile: the diagonal, a window's edges) take
        that last form for every step: one copy of the masked step's code."""
        count = n_block_hi - n_block_lo
        if const_expr(masked):
            for i in cutlass.range(count, unroll=1):
                state = self.mma_one_n_block_lookahead(n_block_hi - 1 - i, state, mmas, ops, acc_O, acc_S_next,
                                                       acc_S_next, softmax, pipes, score_params, mask, True, 2,
                                                       wg_idx)
        else:
            for i in cutlass.range(count // 2, unroll=1):
                n_block = n_block_hi - 1 - 2 * i
                state = self.mma_one_n_block_lookahead(n_block, state, mmas, ops, acc_O, acc_S_next, acc_S, softmax,
                                                       pipes, score_params, mask, False, 1, wg_idx)
                state = self.mma_one_n_block_lookahead(n_block - 1, state, mmas, ops, acc_O, acc_S, acc_S_next,
                                                       softmax, pipes, score_params, mask, False, 1, wg_idx)
            if count % 2 == 1:
                state = self.mma_one_n_block_lookahead(n_block_lo, state, mmas, ops, acc_O, acc_S_next, acc_S_next,
                                                       softmax, pipes, score_params, mask, False, 2, wg_idx)
        return state

    @cute.jit
    def mma_one_n_block_lookahead(self, n_block, state, mmas: TiledMmas, ops: MmaOperands, acc_O, acc_S, acc_S_next,
                                  softmax, pipes: Pipelines, score_params: ScoreParams, mask,
                                  masked: cutlass.Constexpr[bool], next_qk: cutlass.Constexpr[int], wg_idx,
                                  q_release=None):
        """lookahead_qk: one key block. On entry S_n = Q K_n has been issued into acc_S (it ran under
        the previous block's softmax) and P_{n+1} is in registers; `state` is block n + 1's. Wait for
        S_n, release K_n; issue O += P_{n+1} V_{n+1}, then (next_qk 1) S_{n-1} = Q K_{n-1} into
        acc_S_next; softcap, mask, online softmax of S_n while both GEMMs run; wait for the P V (the
        wgmma groups complete in order: P V first, S_{n-1} may still run), release V_{n+1};
        P_n = cvt(S_n); rescale O; (next_qk 2) S_{n-1} into acc_S itself, now free. next_qk 0: the
        tile's last block, no next Q K^T. q_release: the tile's Q stage (early_q_release, last
        block), released once S_n, the tile's last Q K^T, is complete. Returns block n's state.

        S_n is waited for with wait_group(0) before this step issues anything: ptxas serializes every
        wgmma of the kernel (C7514) when a wait_group(N > 0) has to retire a group committed before
        a loop's back edge (tried 2026-12-03: S_n waited for with wait_group(2) after this step's
        issues), and a look-ahead Q K^T is always committed one step, hence one iteration, earlier.
        The wait that keeps S_{n-1} running (wait_group(1), P V only) retires a group of this step."""
        tiled_mma_qk, tiled_mma_pv = mmas
        tSrQ, tSrK, tOrVt, tOrP, _ = ops[:5]
        pipeline_k, pipeline_v = pipes.k, pipes.v
        state_v = state
        state = next_state(state)  # block n (S_n issued by the previous step)
        state_next = next_state(state)  # block n - 1
        warpgroup.wait_group(0)  # S_n complete
        pipeline_k.consumer_release(state)
        if const_expr(q_release is not None):
            pipes.q.consumer_release(q_release)
        pipeline_v.consumer_wait(state_v)
        if const_expr(next_qk == 1):
            pipeline_k.consumer_wait(state_next)
        self.scheduler_barrier_sync(wg_idx)
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state_v.index], wg_wait=-1)
        if const_expr(next_qk == 1):
            wgmma(tiled_mma_qk, acc_S_next, tSrQ, tSrK[None, None, None, state_next.index], zero_init=True,
                  wg_wait=-1)
        self.scheduler_barrier_arrive(wg_idx)
        score.apply(acc_S, score_params.softcap_scale, self.cfg.softcap)
        if const_expr(masked):
            mask(acc_S, n_block=n_block, causal=self.causal)
        row_scale = softmax.online(acc_S, is_first=False)
        warpgroup.wait_group(1 if next_qk == 1 else 0)  # P_{n+1} V_{n+1} complete
        pipeline_v.consumer_release(state_v)
        self.convert_P(acc_S, tOrP)
        softmax.rescale_O(acc_O, row_scale)
        if const_expr(next_qk == 2):
            pipeline_k.consumer_wait(state_next)
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state_next.index], zero_init=True, wg_wait=-1)
        return state

    @cute.jit
    def zero_v_tail(self, sV: cute.Tensor, pipeline_v, state, n_block, seqlen_k, tidx):
        """Ragged-K configs (varlen_k / seqused_k / paged): V rows >= seqlen_k of key block n_block
        (the tile's first block, the only one that can cross seqlen_k) -> exactly 0 in the V stage
        `state`, so a stale or poisoned slot past the sequence (NaN, inf) cannot reach O through
        0 * NaN in P V. K needs nothing: mask_scores selects -inf over any score of those keys.

        Only tiles whose block is partial take the branch (valid < tile_n depends on the tile and
        the sequence only: uniform over the CTA's consumer threads). Race-free: the TMA's writes
        are visible once the V full barrier's phase completed (consumer_wait; the loop's own wait
        on this stage later returns at once, the stage is released only after its P V); each
        thread's generic-proxy zeros are ordered before the async proxy (wgmma reads, the
        producer's later TMA refill) by fence_view_async_shared, and the VTail named barrier over
        all consumer threads orders every warpgroup's zeros before any warpgroup's P V.
        Deadlock-free: called after the first block's softmax, outside mma_one_n_block, so no
        thread sits in a ping-pong barrier (WarpSchedulerWG*) meanwhile. Every consumer thread
        runs the same sequence of all-consumer barriers (VTail, Epilogue) under CTA-uniform
        conditions, and between two of them each warpgroup runs the same number of ping-pong
        rounds, whose token ring (warpgroup w waits on the arrive of w - 1 of the same round, w = 0
        on that of the last warpgroup's previous round or the init) is closed inside that segment.
        """
        valid = seqlen_k - n_block * self.tile_n
        if valid < self.tile_n:
            pipeline_v.consumer_wait(state)
            zero_threads, tiled_zero = self._v_zero_copy()
            sVs = sV[None, None, state.index]
            if tidx < zero_threads:
                thr = tiled_zero.get_slice(tidx)
                tVsV = thr.partition_D(sVs)
                tVcV = thr.partition_D(cute.make_identity_tensor((self.tile_n, self.hdim_v)))
                zeros = cute.make_fragment_like(tVsV)
                zeros.fill(0.0)
                for m in cutlass.range_constexpr(cute.size(tVsV, mode=[1])):
                    if tVcV[0, m, 0][0] >= valid:
                        cute.copy(tiled_zero, zeros[None, m, None], tVsV[None, m, None])
            cute.arch.fence_view_async_shared()  # generic-proxy zeros -> visible to wgmma / TMA
            cute.arch.barrier(barrier_id=int(NamedBarrierFwd.VTail), number_of_threads=self.num_mma_threads)

    def _v_zero_copy(self):
        """(threads, tiled copy) that zero a (tile_n, Dv) V stage in 16-byte stores (v_zero_threads)."""
        vec = 128 // self.dtype.width
        threads, per_row = v_zero_threads(self.num_mma_threads, self.tile_n, self.hdim_v, vec)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        thr_layout = cute.make_ordered_layout((threads // per_row, per_row), order=(1, 0))
        return threads, cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))

    @cute.jit
    def convert_P(self, acc_S: cute.Tensor, tOrP: cute.Tensor, p_store=None):
        """fp32 P (accumulator layout) -> 16-bit A-operand fragment, two values per cvt (pinned there
        with FwdConfig.pin_p_convert). p_store
        (FwdConfig.p_smem): the fragment goes to the warpgroup's P tile in smem instead (stmatrix),
        fenced for the async proxy; each warp's wgmma rows are its own, so a warp sync suffices
        (the P V that read the previous P completed before this: its wait precedes every call)."""
        src = cute.make_tensor(acc_S.iterator, acc_to_frgA_layout(acc_S.layout))
        if const_expr(p_store is None):
            tOrP.store(src.load().to(self.dtype))
            if const_expr(self.cfg.pin_p_convert):  # kept ahead of the lazy rescale's branch (FwdConfig)
                words = cute.recast_tensor(tOrP, Int32)
                for i in cutlass.range_constexpr(cute.size(words)):
                    words[i] = keep_here_i32(words[i])
        else:
            p_copy, tPsP = p_store
            rP = cute.make_rmem_tensor(src.layout.shape, self.dtype)
            rP.store(src.load().to(self.dtype))
            cute.copy(p_copy, p_copy.retile(rP), tPsP)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()

    @cute.jit
    def normalize_O(self, acc_O: cute.Tensor, inv_row_sum: cute.Tensor):
        o = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                o[r, c] = o[r, c] * inv_row_sum[r]

    @cute.jit
    def epilogue(self, acc_O, lses, mO, tma_atom_O, mLSEs: LseParams, sO, tiled_mma_pv, tidx, m_block, head, seq):
        """O: registers -> 16-bit -> smem (stmatrix) -> TMA store (rows past seqlen_q are clipped by
        the TMA unit), or for ragged queries (varlen / seqused) row-predicated 16-byte stores by all
        consumer threads. LSE (natural log, and the log2 split hi + lo for the backward): the
        threads owning column 0 write their rows."""
        seqlen_q = seq.seqlen_q
        rO = cute.make_rmem_tensor(acc_O.shape, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        if const_expr(self.separate_o):
            if tidx < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # previous tile's O store has read sO
        # sO is free: all warpgroups done with their last QK^T (Q's buffer) / the previous store.
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_mma_threads)
        smem_copy_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        smem_thr_copy = cute.make_tiled_copy_C(smem_copy_atom, tiled_mma_pv).get_slice(tidx)
        cute.copy(smem_copy_atom, smem_thr_copy.retile(rO), smem_thr_copy.partition_D(sO))

        thr_mma = tiled_mma_pv.get_slice(tidx)
        tOcO = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v))))
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
                row = m_block * self.tile_m + tOcO[r, 0][0]
                if row < seqlen_q * self.pack:  # packed: row r of ((pack, seqlen_q), heads_k, batch)
                    row_idx, batch_idx = seq.q_index(row)
                    for mX, x in zip(mLSEs, lses):
                        mX[row_idx, head, batch_idx] = x[r]

        cute.arch.fence_view_async_shared()  # smem writes -> visible to the TMA (async proxy)
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_mma_threads)
        if const_expr(self.ragged_q):
            gO = cute.local_tile(seq.q_view(mO, head), (self.tile_m, self.hdim_v), (m_block, 0))
            store_rows_predicated(sO, gO, seqlen_q - m_block * self.tile_m, tidx, self.num_mma_threads)
        elif tidx < 32:
            gO = cute.local_tile(seq.q_view(mO, head), (self.tile_m, self.hdim_v), (m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            # One lane issues the store: a bulk tensor copy is issued by every thread that executes
            # it (the DSL elects a lane for TMA loads, not for stores), so without the election each
            # of the warp's 32 lanes stored the whole O tile (PTX: 32 threads reached the
            # cp.async.bulk.tensor). Waits stay warp-wide: a lane without bulk groups returns at once.
            with cute.arch.elect_one():
                cute.copy(tma_atom_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.separate_o):
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    # Inter-warpgroup ping-pong (FA3 section 3.1).
    @cute.jit
    def scheduler_barrier_init(self, wg_idx):
        if const_expr(self.use_scheduler_barrier):
            if wg_idx == 0:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1),
                                         number_of_threads=2 * THREADS_PER_WG)

    @cute.jit
    def scheduler_barrier_sync(self, wg_idx):
        if const_expr(self.use_scheduler_barrier):
            cute.arch.barrier(barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1) + wg_idx,
                              number_of_threads=2 * THREADS_PER_WG)

    @cute.jit
    def scheduler_barrier_arrive(self, wg_idx):
        if const_expr(self.use_scheduler_barrier):
            next_wg = (wg_idx + 1) % self.num_wg_mma
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1) + next_wg,
                                     number_of_threads=2 * THREADS_PER_WG)


def v_zero_threads(num_mma_threads: int, tile_n: int, hdim_v: int, vec: int = 8) -> tuple[int, int]:
    """(threads, threads per row) of zero_v_tail's copy: the most consumer threads, a multiple of
    128, whose passes of 16-byte chunks (vec elements) tile the (tile_n, hdim_v) stage evenly
    (threads per row = gcd(chunks per row, threads); rows per pass must divide tile_n)."""
    chunks_per_row = hdim_v // vec
    for threads in range(num_mma_threads, 0, -THREADS_PER_WG):
        per_row = math.gcd(chunks_per_row, threads)
        if tile_n % (threads // per_row) == 0:
            return threads, per_row
    raise ValueError(f"no even zero-fill layout of a ({tile_n}, {hdim_v}) V stage")
