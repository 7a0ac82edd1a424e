"""Backward preprocess and postprocess (CuTe DSL): the row-wise passes around the main backward kernel.

Preprocess, per (batch, seqlen_q, head) row, before the main kernel:
    dpsum[b, h, s]    = sum_d dO[b, s, h, d] * O[b, s, h, d]   (fp32; products of 16-bit values are
                        exact in fp32)
    lse_log2[b, h, s] = fp32(lse_hi + lse_lo) (the forward's unrounded LSE * log2(e), rounded;
                        +inf for a row that saw no key, so the backward's P = 2^(S*c - lse_log2)
                        is 0 there)
    exact[b, h, s // tile_m] = 1 if |lse_log2| >= BWD_EXACT_LSE_LOG2 (finite): that query tile
                        computes P from lse_hi, lse_lo unrounded (kernels/sm90/bwd.py and the
                        1-CTA kernels/sm100/bwd.py, issue 8)
    dq_accum[b, h, s, :] = 0 (the main kernel reduce-adds dQ into it; one pass instead of a
                        separate memset of the largest buffer of the backward)
Postprocess, after it: dq[b, s, h, :] = dq_accum[b, h, s, :] in the input dtype; with
BwdConfig.dq_accum_order the tiles of dq_accum are in the dQ accumulator's element order
(kernels/common/dq_accum.py) and BackwardPostprocessAccumOrder undoes it.
Padding rows (s >= seqlen_q) of dpsum / lse_log2: dense, written here too (dpsum 0, lse_log2 +inf,
every row up to seqlen_q_pad, so the caller allocates both unfilled); varlen, initialized by the
caller (the padded layout's gaps between sequences belong to no packed row). `exact` is zeroed by
the caller; dq_accum is zeroed up to seqlen_q_pad (dense: whole tiles, which the accumulator-order
layout needs) or at the packed rows' padded rows (varlen).

Layout of the work (both passes): a CTA of ROW_PASS_THREADS threads takes ROW_TILE consecutive rows
of one (batch, head); LANES_PER_ROW lanes share a row, lane l of it moving the 4-element chunks
l, l + 8, l + 16, ... (8-byte loads of O/dO, 16-byte fp32 stores), so each pass over 16 rows reads
and writes whole rows coalesced; the dot product is reduced over the 8 lanes with shuffles. The
CTA decodes (row tile, head, batch) from blockIdx.x (flash4.launch.bwd_rowwise_grid) once, so the
per-row cost is the memory traffic, not index arithmetic (the one-warp-per-row version it replaced
spent ~190 instructions per row; H200 ncu, d64, 1M rows: 0.255 ms + a 0.058 ms memset, vs
flash-attn-4's preprocess 0.136 ms; the torch strided copy of dQ 0.185 ms vs its 0.091 ms).

16-byte dQ stores (the `wide_stores` switch of both postprocesses, off by default; A/B:
tools/ab_switch.py --switch postprocess_wide, docs/design/speed_candidates.md). Row-major: a lane
moves WIDE_CHUNK = 8 elements (two 16-byte fp32 loads, one 16-byte store of 16-bit values) instead
of 4 (one 8-byte store). Accumulator order: the converted tile goes through shared memory
(stmatrix in the dQ MMA's layout, then 16-byte row chunks out, row-predicated), instead of 32-bit
stores of column pairs scattered over 8 rows per instruction (H200 ncu, d64 S 16k: 16 32-bit STG
per thread, half of each 32-byte sector written; 0.269 ms vs flash-attn-4's 0.091 ms,
docs/perf/ncu_2026-12-01.md). Same values (one fp32 -> 16-bit conversion each), other stores.

Varlen (packed) mode, when a row index is given (flash4.backward): out/dout/dq (1, total_q, H, D),
lse_hi/lo (1, H, total_q), and dpsum/lse_log2/dq_accum in the padded per-sequence layout
(1, H, padded_rows[, D]), exact (1, H, padded_rows / tile_m). Packed row s lives at padded row
row_index[s] (flash4.backward.padded_row_index; rows outside every sequence map to a scratch tile
that the main kernel never reads, so their dq is the zero the preprocess wrote there).
"""

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from flash4.constants import BWD_EXACT_LSE_LOG2, ROW_PASS_THREADS, ROW_TILE, THREADS_PER_WG
from flash4.kernels.common.dq_accum import GROUP, accum_order_view, accum_order_wg_view, make_dq_tiled_mma
from flash4.kernels.common.seqinfo import store_rows_predicated

LANES_PER_ROW = 8  # a row's lanes: a warp covers 4 rows per pass
CHUNK = 4  # elements per lane access (8 bytes of 16-bit, 16 bytes of fp32)
ROWS_PER_PASS = ROW_PASS_THREADS // LANES_PER_ROW
WIDE_CHUNK = 8  # wide_stores: elements per lane access (16 bytes of 16-bit, two 16-byte fp32 loads)
HEADDIM_STEP = 16  # the head dims these passes take: multiples of 16 (sm90 kernel head dims, flash4.config.sm90)


def row_passes(headdim: int) -> int:
    """Passes of the LANES_PER_ROW lanes over a row of headdim elements in CHUNK-element chunks."""
    return -(-(headdim // CHUNK) // LANES_PER_ROW)


def full_pass(headdim: int, j: int) -> bool:
    """Pass j of a row moves a chunk on every lane (else only lanes l with l + 8 j < headdim / CHUNK:
    the last pass of a head dim that is not a multiple of 32, e.g. d80's lanes 0-3)."""
    return (j + 1) * LANES_PER_ROW <= headdim // CHUNK


def wide_row_chunks(headdim: int) -> list[list[int]]:
    """The row-major wide postprocess's lane -> chunk map (pure; tests/cpu/test_speed_switches_cpu.py):
    [j][l] = the WIDE_CHUNK-element chunk that lane l of a row moves in pass j, or -1 (idle: the
    head dim is not a multiple of LANES_PER_ROW chunks, d96 / d192)."""
    chunks = headdim // WIDE_CHUNK
    passes = -(-chunks // LANES_PER_ROW)
    return [[l + LANES_PER_ROW * j if l + LANES_PER_ROW * j < chunks else -1 for l in range(LANES_PER_ROW)]
            for j in range(passes)]


def tile_coords(num_tiles: Int32, nheads: Int32):
    """(tile, head, batch) of this CTA from blockIdx.x = (batch * H + head) * num_tiles + tile (the
    pre- and postprocess grids, sm90's and the sm80 family's)."""
    bid = cute.arch.block_idx()[0]
    tile = bid % num_tiles
    bh = bid // num_tiles
    return tile, bh % nheads, bh // nheads


@cute.jit
def store_dq_pairs(acc: cute.Tensor, tCcC: cute.Tensor, mdQ: cute.Tensor, b: Int32, head: Int32, row0: Int32,
                   seqlen_q: Int32, dtype: cutlass.Constexpr):
    """A thread's fp32 dQ values (acc, in its MMA accumulator's order, coordinates tCcC within the
    tile) -> mdQ (batch, seqlen_q, nheads, headdim) in dtype, rows row0 + r < seqlen_q only: values v,
    v + 1 of a wgmma or mma.sync accumulator are columns c, c + 1 of one row (c even), one 32-bit
    store per pair (the sm90 accumulator-order and the sm80 register-order postprocesses)."""
    pair = cute.make_rmem_tensor(2, dtype)
    store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=32)
    for v in cutlass.range_constexpr(0, cute.size(tCcC), 2):
        row, col = tCcC[v]
        s = row0 + row
        if s < seqlen_q:
            pair[0] = acc[v].to(dtype)
            pair[1] = acc[v + 1].to(dtype)
            cute.copy(store_atom, pair, cute.local_tile(mdQ[b, s, head, None], (2,), (col // 2,)))


def _row_coords(num_row_tiles: Int32, nheads: Int32):
    """(first row of this CTA's tile, head, batch): tile_coords over ROW_TILE-row tiles."""
    tile, head, b = tile_coords(num_row_tiles, nheads)
    return tile * ROW_TILE, head, b


def _chunk(row: cute.Tensor, j: int, sub_lane: Int32) -> cute.Tensor:
    """Chunk sub_lane + 8 j (CHUNK contiguous elements) of a 1-D contiguous row."""
    return cute.local_tile(row, (CHUNK,), (sub_lane + LANES_PER_ROW * j,))


class BackwardPreprocess:
    def __init__(self, headdim_v: int, dtype, headdim: Optional[int] = None):
        """headdim_v: O's / dO's head dim (the dot product's length); headdim: dq_accum's (Q's) head
        dim, headdim_v when None. Both multiples of HEADDIM_STEP (16)."""
        headdim = headdim_v if headdim is None else headdim
        assert headdim_v % HEADDIM_STEP == 0 and headdim % HEADDIM_STEP == 0, (headdim_v, headdim)
        self.hdim_v = headdim_v
        self.hdim = headdim
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim_v)
        mdO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim_v)
        mLSEhi: cute.Tensor,  # (batch, nheads, seqlen_q) fp32
        mLSElo: cute.Tensor,  # (batch, nheads, seqlen_q) fp32
        mdPsum: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32
        mLSE2: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32
        mExact: cute.Tensor,  # (batch, nheads, num_m_blocks) int32, zeroed
        mdQacc: cute.Tensor,  # (batch, nheads, seqlen_q_pad, headdim) fp32, rows contiguous
        tile_m: Int32,  # the backward's query tile
        num_ctas: Int32,
        stream: cuda.CUstream,
        mRowIdx: Optional[cute.Tensor] = None,  # varlen: (total_q,) int32 padded row of each packed row
    ):
        self.kernel(mO, mdO, mLSEhi, mLSElo, mdPsum, mLSE2, mExact, mdQacc, tile_m, mRowIdx).launch(
            grid=(num_ctas, 1, 1), block=[ROW_PASS_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSEhi: cute.Tensor, mLSElo: cute.Tensor,
               mdPsum: cute.Tensor, mLSE2: cute.Tensor, mExact: cute.Tensor, mdQacc: cute.Tensor, tile_m: Int32,
               mRowIdx: Optional[cute.Tensor]):
        tidx = cute.arch.thread_idx()[0]
        sub_lane = tidx % LANES_PER_ROW
        seqlen_q, nheads = mO.shape[1], mO.shape[2]  # varlen: seqlen_q = total_q, batch = 1
        # dense: every accumulator row (seqlen_q_pad: whole tiles, the accumulator-order layout
        # mixes a tile's rows); varlen: the packed rows (their padded rows, the scratch tile's)
        num_rows = mdQacc.shape[2] if const_expr(mRowIdx is None) else seqlen_q
        row0, head, b = _row_coords(cute.ceil_div(num_rows, ROW_TILE), nheads)
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=CHUNK * 16)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=CHUNK * 32)
        zeros = cute.make_rmem_tensor((CHUNK,), Float32)
        zeros.fill(0.0)
        rO = cute.make_rmem_tensor((CHUNK,), self.dtype)
        rdO = cute.make_rmem_tensor((CHUNK,), self.dtype)
        for i in cutlass.range_constexpr(ROW_TILE // ROWS_PER_PASS):
            s = row0 + i * ROWS_PER_PASS + tidx // LANES_PER_ROW
            acc = Float32(0.0)
            if s < seqlen_q:
                gO = mO[b, s, head, None]
                gdO = mdO[b, s, head, None]
                for j in cutlass.range_constexpr(row_passes(self.hdim_v)):
                    if const_expr(full_pass(self.hdim_v, j)):
                        acc = self.dot_chunk(gO, gdO, j, sub_lane, load_atom, rO, rdO, acc)
                    else:  # the last pass of a head dim that is an odd multiple of 16 (d80: lanes 0-3)
                        if sub_lane + LANES_PER_ROW * j < self.hdim_v // CHUNK:
                            acc = self.dot_chunk(gO, gdO, j, sub_lane, load_atom, rO, rdO, acc)
            # every lane shuffles (rows past seqlen_q add zeros): no divergent shfl.sync
            acc = cute.arch.warp_reduction_sum(acc, threads_in_group=LANES_PER_ROW)
            if s < num_rows:
                p = s if const_expr(mRowIdx is None) else mRowIdx[s]  # row in the (padded) statistics
                gdQ = mdQacc[b, head, p, None]
                for j in cutlass.range_constexpr(row_passes(self.hdim)):
                    if const_expr(full_pass(self.hdim, j)):
                        cute.copy(store_atom, zeros, _chunk(gdQ, j, sub_lane))
                    else:
                        if sub_lane + LANES_PER_ROW * j < self.hdim // CHUNK:
                            cute.copy(store_atom, zeros, _chunk(gdQ, j, sub_lane))
            if s < seqlen_q:
                p = s if const_expr(mRowIdx is None) else mRowIdx[s]
                if sub_lane == 0:
                    mdPsum[b, head, p] = acc
                    lse_log2 = mLSEhi[b, head, s] + mLSElo[b, head, s]
                    mLSE2[b, head, p] = lse_log2
                    magnitude = cute.arch.fmax(lse_log2, -lse_log2)
                    if (magnitude >= Float32(BWD_EXACT_LSE_LOG2)) & (magnitude != Float32.inf):
                        mExact[b, head, p // tile_m] = Int32(1)
            if const_expr(mRowIdx is None):
                # dense: the padding rows of the last query tile (seqlen_q <= s < seqlen_q_pad) get
                # dpsum 0 and lse_log2 +inf here (P = 0 there), so the caller allocates both unfilled
                if (s >= seqlen_q) & (s < num_rows):
                    if sub_lane == 0:
                        mdPsum[b, head, s] = Float32(0.0)
                        mLSE2[b, head, s] = Float32.inf

    @cute.jit
    def dot_chunk(self, gO: cute.Tensor, gdO: cute.Tensor, j: cutlass.Constexpr[int], sub_lane: Int32, load_atom,
                  rO: cute.Tensor, rdO: cute.Tensor, acc: Float32) -> Float32:
        """acc + the dot product of chunk sub_lane + 8 j of one O row and its dO row."""
        cute.copy(load_atom, _chunk(gO, j, sub_lane), rO)
        cute.copy(load_atom, _chunk(gdO, j, sub_lane), rdO)
        for e in cutlass.range_constexpr(CHUNK):
            acc += Float32(rO[e]) * Float32(rdO[e])
        return acc


class BackwardPostprocess:
    """dq[b, s, h, :] = dq_accum[b, h, row(s), :] converted to dtype (row(s) = s, or row_index[s]).
    wide_stores: WIDE_CHUNK-element lane accesses (16-byte stores; lane -> chunk map wide_row_chunks)."""

    def __init__(self, headdim: int, dtype, wide_stores: bool = False):
        assert headdim % HEADDIM_STEP == 0, headdim
        self.hdim = headdim
        self.dtype = dtype
        self.wide_stores = wide_stores

    @cute.jit
    def __call__(
        self,
        mdQacc: cute.Tensor,  # (batch, nheads, seqlen_q_pad, headdim) fp32, rows contiguous
        mdQ: cute.Tensor,  # (batch, seqlen_q, nheads, headdim) 16-bit
        num_ctas: Int32,
        stream: cuda.CUstream,
        mRowIdx: Optional[cute.Tensor] = None,  # varlen: (total_q,) int32 padded row of each packed row
    ):
        self.kernel(mdQacc, mdQ, mRowIdx).launch(grid=(num_ctas, 1, 1), block=[ROW_PASS_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mRowIdx: Optional[cute.Tensor]):
        tidx = cute.arch.thread_idx()[0]
        sub_lane = tidx % LANES_PER_ROW
        seqlen_q, nheads = mdQ.shape[1], mdQ.shape[2]
        row0, head, b = _row_coords(cute.ceil_div(seqlen_q, ROW_TILE), nheads)
        if const_expr(self.wide_stores):
            self.rows_wide(mdQacc, mdQ, mRowIdx, row0, head, b, tidx, seqlen_q)
        else:
            load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=CHUNK * 32)
            store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=CHUNK * 16)
            racc = cute.make_rmem_tensor((CHUNK,), Float32)
            rdQ = cute.make_rmem_tensor((CHUNK,), self.dtype)
            for i in cutlass.range_constexpr(ROW_TILE // ROWS_PER_PASS):
                s = row0 + i * ROWS_PER_PASS + tidx // LANES_PER_ROW
                if s < seqlen_q:
                    p = s if const_expr(mRowIdx is None) else mRowIdx[s]
                    gacc = mdQacc[b, head, p, None]
                    gdQ = mdQ[b, s, head, None]
                    for j in cutlass.range_constexpr(row_passes(self.hdim)):
                        if const_expr(full_pass(self.hdim, j)):
                            self.convert_narrow_chunk(gacc, gdQ, j, sub_lane, load_atom, store_atom, racc, rdQ)
                        else:  # an odd multiple of 16 (d80): the last pass's lanes 4-7 idle
                            if sub_lane + LANES_PER_ROW * j < self.hdim // CHUNK:
                                self.convert_narrow_chunk(gacc, gdQ, j, sub_lane, load_atom, store_atom, racc, rdQ)

    @cute.jit
    def convert_narrow_chunk(self, gacc: cute.Tensor, gdQ: cute.Tensor, j: cutlass.Constexpr[int], sub_lane: Int32,
                             load_atom, store_atom, racc: cute.Tensor, rdQ: cute.Tensor):
        """Chunk sub_lane + 8 j (CHUNK elements) of one row: a 16-byte fp32 load, an 8-byte store."""
        cute.copy(load_atom, _chunk(gacc, j, sub_lane), racc)
        rdQ.store(racc.load().to(self.dtype))
        cute.copy(store_atom, rdQ, _chunk(gdQ, j, sub_lane))

    @cute.jit
    def rows_wide(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mRowIdx: Optional[cute.Tensor], row0: Int32,
                  head: Int32, b: Int32, tidx: Int32, seqlen_q: Int32):
        """wide_stores: lane l of a row converts chunk wide_row_chunks(hdim)[j][l] (WIDE_CHUNK
        elements: two 16-byte fp32 loads, one 16-byte store) in pass j."""
        sub_lane = tidx % LANES_PER_ROW
        num_chunks = self.hdim // WIDE_CHUNK
        racc = cute.make_rmem_tensor((WIDE_CHUNK,), Float32)
        rdQ = cute.make_rmem_tensor((WIDE_CHUNK,), self.dtype)
        for i in cutlass.range_constexpr(ROW_TILE // ROWS_PER_PASS):
            s = row0 + i * ROWS_PER_PASS + tidx // LANES_PER_ROW
            if s < seqlen_q:
                p = s if const_expr(mRowIdx is None) else mRowIdx[s]
                gacc = mdQacc[b, head, p, None]
                gdQ = mdQ[b, s, head, None]
                for j in cutlass.range_constexpr(cute.ceil_div(num_chunks, LANES_PER_ROW)):
                    c = sub_lane + LANES_PER_ROW * j
                    if const_expr((j + 1) * LANES_PER_ROW <= num_chunks):
                        self.convert_chunk(gacc, gdQ, c, racc, rdQ)
                    else:  # the last pass of d96 / d192 leaves lanes idle (wide_row_chunks: -1)
                        if c < num_chunks:
                            self.convert_chunk(gacc, gdQ, c, racc, rdQ)

    @cute.jit
    def convert_chunk(self, gacc: cute.Tensor, gdQ: cute.Tensor, c: Int32, racc: cute.Tensor, rdQ: cute.Tensor):
        """Chunk c (WIDE_CHUNK elements) of one row: two 16-byte fp32 loads, one 16-byte store."""
        half = WIDE_CHUNK // 2
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        for h in cutlass.range_constexpr(2):
            cute.copy(load_atom, cute.local_tile(gacc, (half,), (2 * c + h,)), cute.local_tile(racc, (half,), (h,)))
        rdQ.store(racc.load().to(self.dtype))
        cute.copy(store_atom, rdQ, cute.local_tile(gdQ, (WIDE_CHUNK,), (c,)))


def accum_wide_ok(headdim: int, tile_m: int, num_wg: int = 2) -> bool:
    """BackwardPostprocessAccumOrder's wide_stores applies (pure): each warpgroup's dQ columns (the dQ
    MMA's N: headdim, or headdim / 2 where the warpgroups split the head dim) a multiple of 16, the
    columns one warp's 4-matrix stmatrix writes."""
    n = headdim if tile_m == 64 * num_wg else headdim // 2
    return n % 16 == 0


class BackwardPostprocessAccumOrder:
    """dq[b, m * tile_m + r, h, c] = dq_accum tile (b, h, m) at the accumulator-order position of
    (r, c) (kernels/common/dq_accum.py), converted to dtype: one CTA of num_threads (the main
    kernel's consumer threads) per tile; thread t reads its values with 16-byte loads (coalesced
    across threads) and writes them at the coordinates the dQ tiled MMA gives them, two adjacent
    columns per 32-bit store. Dense layouts only (BwdConfig.dq_accum_order)."""

    def __init__(self, headdim: int, dtype, tile_m: int, num_wg: int = 2, wide_stores: bool = False,
                 wg_halves: bool = False):
        """wide_stores: the converted tile is staged in shared memory (stmatrix, in the dQ MMA's
        layout) and leaves in 16-byte row chunks (store_rows_predicated) instead of 32-bit column
        pairs from registers. wg_halves: the tiles are in per-warpgroup accumulator order
        (BwdConfig.dq_handoff_per_wg; kernels/common/dq_accum.py accum_order_wg_view)."""
        self.wg_halves = wg_halves
        self.hdim = headdim
        self.dtype = dtype
        self.tile_m = tile_m
        self.num_wg = num_wg
        self.num_threads = 128 * num_wg
        # the staging tile's stmatrix writes 16 columns per warp: a warpgroup's columns must be a
        # multiple of 16 (not d80's 40 or d112's 56 at 64 queries: those keep the 32-bit pairs)
        self.wide_stores = wide_stores and accum_wide_ok(headdim, tile_m, num_wg)

    @cute.jit
    def __call__(
        self,
        mdQacc: cute.Tensor,  # (batch, nheads, seqlen_q_pad, headdim) fp32 contiguous, tiles in accumulator order
        mdQ: cute.Tensor,  # (batch, seqlen_q, nheads, headdim) 16-bit
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(mdQacc, mdQ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor):
        tidx = cute.arch.thread_idx()[0]
        seqlen_q = mdQ.shape[1]
        m_block, head, b = tile_coords(cute.ceil_div(seqlen_q, self.tile_m), mdQ.shape[2])
        if const_expr(self.wide_stores):
            self.tile_wide(mdQacc, mdQ, m_block, head, b, tidx, seqlen_q)
        else:
            self.tile_pairs(mdQacc, mdQ, m_block, head, b, tidx, seqlen_q)

    @cute.jit
    def tile_wide(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, m_block: Int32, head: Int32, b: Int32, tidx: Int32,
                  seqlen_q: Int32):
        """wide_stores: 16-byte loads of this thread's accumulator values (as tile_pairs), one
        conversion each, stmatrix into a swizzled (tile_m, headdim) smem tile in the dQ MMA's
        layout, then every thread stores 16-byte row chunks of rows < seqlen_q."""
        tiled_mma = make_dq_tiled_mma(self.dtype, self.tile_m, self.hdim, self.num_wg)
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((self.tile_m, self.hdim)), Float32)
        num_values = cute.size(acc)
        # register order v of the fragment = its flat (column-major) index, as tile_pairs' tCcC[v]
        flat = cute.make_tensor(acc.iterator, cute.make_layout(num_values))
        groups = cute.logical_divide(flat, cute.make_layout(GROUP))
        self.load_values(mdQacc[b, head, m_block * self.tile_m, None].iterator, groups, num_values, tidx)
        rdQ = cute.make_rmem_tensor(acc.shape, self.dtype)
        rdQ.store(acc.load().to(self.dtype))

        smem = SmemAllocator()
        layout = self._smem_layout()
        sdQ = smem.allocate_tensor(self.dtype, layout.outer, byte_alignment=1024, swizzle=layout.inner)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_copy = cute.make_tiled_copy_C(stmatrix, tiled_mma).get_slice(tidx)
        cute.copy(stmatrix, thr_copy.retile(rdQ), thr_copy.partition_D(sdQ))
        cute.arch.barrier()  # every thread's stmatrix before any row is read back
        gdQ = cute.local_tile(mdQ[b, None, head, None], (self.tile_m, self.hdim), (m_block, 0))
        store_rows_predicated(sdQ, gdQ, seqlen_q - m_block * self.tile_m, tidx, self.num_threads)

    @cute.jit
    def load_values(self, tile_ptr: cute.Pointer, groups: cute.Tensor, num_values: cutlass.Constexpr[int], tidx: Int32):
        """This thread's accumulator values of the tile at tile_ptr into groups (GROUP, group): 16-byte
        loads, coalesced across threads; the tile's order is the main kernel's (wg_halves or not)."""
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        if const_expr(self.wg_halves):
            view = accum_order_wg_view(tile_ptr, num_values, self.num_wg)
            t, wg = tidx % THREADS_PER_WG, tidx // THREADS_PER_WG
            for g in cutlass.range_constexpr(num_values // GROUP):
                cute.copy(load_atom, view[None, t, g, wg], groups[None, g])
        else:
            view = accum_order_view(tile_ptr, num_values, self.num_threads)
            for g in cutlass.range_constexpr(num_values // GROUP):
                cute.copy(load_atom, view[None, tidx, g], groups[None, g])

    def _n_atom(self) -> int:
        """Columns of one warpgroup's dQ wgmma (make_dq_tiled_mma's N)."""
        return self.hdim if self.tile_m == 64 * self.num_wg else self.hdim // 2

    def _smem_layout(self):
        """The (tile_m, headdim) 16-bit staging tile, swizzled as the kernels' row-major wgmma tiles
        (conflict-free stmatrix and 16-byte row chunks); the swizzle atom's width divides one
        warpgroup's columns (d96: 48, so 16 columns, 32-byte swizzle), which the stmatrix
        partition of the second warpgroup's half needs."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, self._n_atom()), self.dtype)
        return cute.tile_to_shape(atom, (self.tile_m, self.hdim), order=(0, 1))

    @cute.jit
    def tile_pairs(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, m_block: Int32, head: Int32, b: Int32, tidx: Int32,
                   seqlen_q: Int32):
        """Registers -> dq: two adjacent columns per 32-bit store."""
        thr_mma = make_dq_tiled_mma(self.dtype, self.tile_m, self.hdim, self.num_wg).get_slice(tidx)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim)))
        num_values = cute.size(tCcC)
        acc = cute.make_rmem_tensor(num_values, Float32)
        groups = cute.logical_divide(acc, cute.make_layout(GROUP))
        self.load_values(mdQacc[b, head, m_block * self.tile_m, None].iterator, groups, num_values, tidx)
        store_dq_pairs(acc, tCcC, mdQ, b, head, m_block * self.tile_m, seqlen_q, self.dtype)
