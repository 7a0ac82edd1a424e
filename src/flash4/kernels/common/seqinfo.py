"""Where one sequence lives, on the device: the twin of flash4.geometry.SeqLens.

A kernel sees every tensor in its kernel view (seqlen, headdim, heads, batch) (or (seqlen, heads,
batch) for per-row statistics). Dense batches index the batch mode; packed varlen tensors have a
batch mode of size 1 and sequence b starts at row cu_seqlens[b] (a domain offset of the view, so
TMA coordinates and plain indexing shift alike). seqused overrides the length. Per-sequence
statistics of the backward (LSE, D, dQ accumulator) live in a padded layout: sequence b starts at
row padded_offset(b) = (cu_seqlens[b] + b * tile) // tile * tile, tile-aligned, with room for
ceil(len / tile) tiles (FlashAttention-3's layout); flash4.backward.padded_total gives its size.

Keys past seqlen_k and queries past seqlen_q inside a tile hold other sequences' data in a packed
tensor: the kernels mask them explicitly (flash4.geometry) and never store rows past a length.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from flash4.kernels.common.dsl import DynamicState


def padded_offset(offset, batch, tile: int):
    """Row where sequence `batch` starts in the padded per-sequence layout (tile-aligned)."""
    return cute.assume((offset + batch * tile) // tile * tile, divby=tile)


class SeqInfo(DynamicState):
    """Offsets and lengths of sequence `batch` (device Int32 values, or 0 / static shapes).

    offset_q / offset_k: first row of the sequence in Q (O, LSE) / K (V); 0 for dense batches.
    seqlen_q / seqlen_k: its query / key count (seqused, else cu_seqlens difference, else shape).
    padded_offset_q: first row in the padded statistics layout (varlen_q; else 0).
    Carried through dynamic control flow (DynamicState); the varlen flags are trace-time constants.
    """

    _dynamic_fields = ("batch", "offset_q", "offset_k", "padded_offset_q", "seqlen_q", "seqlen_k")

    def __init__(self, batch: Int32, seqlen_q_static, seqlen_k_static,
                 mCuSeqlensQ: Optional[cute.Tensor] = None, mCuSeqlensK: Optional[cute.Tensor] = None,
                 mSeqUsedQ: Optional[cute.Tensor] = None, mSeqUsedK: Optional[cute.Tensor] = None,
                 tile_m_pad: int = 1):
        self.batch = batch
        self.varlen_q = mCuSeqlensQ is not None
        self.varlen_k = mCuSeqlensK is not None
        self.offset_q = Int32(0) if const_expr(not self.varlen_q) else mCuSeqlensQ[batch]
        self.offset_k = Int32(0) if const_expr(not self.varlen_k) else mCuSeqlensK[batch]
        self.padded_offset_q = (Int32(0) if const_expr(not self.varlen_q)
                                else padded_offset(self.offset_q, batch, tile_m_pad))
        if const_expr(mSeqUsedQ is not None):
            self.seqlen_q = mSeqUsedQ[batch]
        elif const_expr(self.varlen_q):
            self.seqlen_q = mCuSeqlensQ[batch + 1] - self.offset_q
        else:
            self.seqlen_q = seqlen_q_static
        if const_expr(mSeqUsedK is not None):
            self.seqlen_k = mSeqUsedK[batch]
        elif const_expr(self.varlen_k):
            self.seqlen_k = mCuSeqlensK[batch + 1] - self.offset_k
        else:
            self.seqlen_k = seqlen_k_static
        self.seqlen_q, self.seqlen_k = Int32(self.seqlen_q), Int32(self.seqlen_k)
        self.padded_offset_q = Int32(self.padded_offset_q)

    # ---- views of one (sequence, head): (seqlen, headdim) or (seqlen,) starting at the sequence
    def _view(self, mX: cute.Tensor, head, varlen: bool, offset):
        if const_expr(cute.rank(mX) == 4):
            if const_expr(not varlen):
                return mX[None, None, head, self.batch]
            return cute.domain_offset((offset, 0), mX[None, None, head, 0])
        if const_expr(not varlen):
            return mX[None, head, self.batch]
        return cute.domain_offset((offset,), mX[None, head, 0])

    def q_view(self, mX: cute.Tensor, head):
        """Q, O, dO (seqlen_q, headdim, heads, batch) or LSE-like (seqlen_q, heads, batch)."""
        return self._view(mX, head, self.varlen_q, self.offset_q)

    def q_padded_view(self, mX: cute.Tensor, head):
        """Padded per-row statistics (LSE * log2 e, D, dQ accumulator) of the backward."""
        return self._view(mX, head, self.varlen_q, self.padded_offset_q)

    def k_view(self, mX: cute.Tensor, head_kv):
        """K, V, dK, dV (seqlen_k, headdim, heads_k, batch)."""
        return self._view(mX, head_kv, self.varlen_k, self.offset_k)

    def q_index(self, row):
        """(row index, batch index) of query `row` of this sequence in a (seqlen_q, heads, batch) view."""
        if const_expr(self.varlen_q):
            return self.offset_q + row, Int32(0)
        return row, self.batch


@cute.jit
def store_rows_predicated(sX: cute.Tensor, gX: cute.Tensor, valid_rows: Int32, tidx: Int32,
                          num_threads: cutlass.Constexpr[int]):
    """Copy a (rows, cols) 16-bit tile from shared to global memory, 16 bytes per thread access,
    writing only rows < valid_rows (a packed varlen tensor holds the next sequence right after).

    sX: smem tile (any swizzle of 16-byte chunks); gX: the global (rows, cols) view, cols
    contiguous; every thread of the `num_threads` calling ones takes part (no barrier inside: the
    caller orders the smem writes before it)."""
    dtype = sX.element_type
    vec = 128 // dtype.width
    rows, cols = cute.size(sX, mode=[0]), cute.size(sX, mode=[1])
    threads_per_row, rows_per_pass = row_copy_shape(rows, cols // vec, num_threads)
    if cutlass.const_expr(rows_per_pass * threads_per_row == num_threads):
        _store_rows(sX, gX, valid_rows, tidx, threads_per_row, rows_per_pass, vec)
    else:  # few 16-byte chunks per row (d80: 10) and few rows: the threads past one pass idle
        if tidx < rows_per_pass * threads_per_row:
            _store_rows(sX, gX, valid_rows, tidx, threads_per_row, rows_per_pass, vec)


def row_copy_shape(rows: int, chunks_per_row: int, num_threads: int) -> tuple:
    """(threads per row, rows per pass) of store_rows_predicated (pure): threads_per_row =
    gcd(chunks, threads); rows per pass num_threads / threads_per_row, or, where that exceeds the
    tile's rows (a (64, 80) dQ tile: 10 chunks, 2 threads per row, 128 rows per pass), the largest
    divisor of `rows` below it (the other threads idle): a pass never reaches past the tile."""
    threads_per_row = _gcd(chunks_per_row, num_threads)
    rows_per_pass = num_threads // threads_per_row
    if rows_per_pass > rows:
        rows_per_pass = max(r for r in range(1, rows + 1) if rows % r == 0 and r <= rows_per_pass)
    return threads_per_row, rows_per_pass


@cute.jit
def _store_rows(sX: cute.Tensor, gX: cute.Tensor, valid_rows: Int32, tidx: Int32,
                threads_per_row: cutlass.Constexpr[int], rows_per_pass: cutlass.Constexpr[int],
                vec: cutlass.Constexpr[int]):
    dtype = sX.element_type
    rows, cols = cute.size(sX, mode=[0]), cute.size(sX, mode=[1])
    thr_layout = cute.make_ordered_layout((rows_per_pass, threads_per_row), order=(1, 0))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    tiled_copy = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))
    thr_copy = tiled_copy.get_slice(tidx)
    tS = thr_copy.partition_S(sX)
    tG = thr_copy.partition_D(gX)
    tC = thr_copy.partition_S(cute.make_identity_tensor((rows, cols)))
    r = cute.make_fragment_like(tS)
    cute.autovec_copy(tS, r)
    for m in cutlass.range_constexpr(cute.size(tS, mode=[1])):
        if tC[0, m, 0][0] < valid_rows:
            cute.copy(atom, r[None, m, None], tG[None, m, None])


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@cute.jit
def store_split_partials(o: cute.Tensor, tOcO: cute.Tensor, tOgO: cute.Tensor, lse: cute.Tensor, mL: cute.Tensor,
                         m_block: Int32, tile_m: cutlass.Constexpr[int], head: Int32, seq: SeqInfo,
                         row_scale: Optional[cute.Tensor] = None):
    """split_kv's epilogue (the sm90 and sm80 forwards): one split's fp32 O and natural-log LSE from
    registers to the partial buffers, rows < seqlen_q only; flash4's combine kernel merges the splits.
    o: the thread's O accumulator as an (M, N) view; tOcO: its (row, column) coordinates in the
    (tile_m, dv) tile; tOgO: the same thread partition of this split's global O tile; lse: the rows'
    LSE (M,); mL: this split's LSE (seqlen_q, nheads, batch); row_scale: None (O already normalized)
    or each row's 1 / rowsum. The threads holding column 0 write the LSE."""
    seqlen_q = seq.seqlen_q
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        if m_block * tile_m + tOcO[r, 0][0] < seqlen_q:
            for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                if const_expr(row_scale is None):
                    tOgO[r, c] = o[r, c]
                else:
                    tOgO[r, c] = o[r, c] * row_scale[r]
    if tOcO[0, 0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
            row = m_block * tile_m + tOcO[r, 0][0]
            if row < seqlen_q:
                row_idx, batch_idx = seq.q_index(row)
                mL[row_idx, head, batch_idx] = lse[r]
