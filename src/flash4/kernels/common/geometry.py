"""Device side of flash4.geometry: the same formulas on Int32 values, and the element masks.

flash4.geometry holds the rule (which key a query row sees) and the block ranges, written once for
Python ints and device Int32 alike; this module binds them to the DSL's min/max/select
(`DEVICE_OPS`) and applies the rule to score fragments:
  * `mask_scores` (forward): S (queries x keys) -> -inf where a key is not visible;
  * `mask_probs_t` (backward): P^T (keys x queries) -> 0 where a key is not visible.
Only the tiles the block ranges mark as crossing the diagonal or seqlen_k are masked.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash4 import geometry as g
from flash4.kernels.common.layout import acc_mn_view

DEVICE_OPS = g.Ops(min=cutlass.min, max=cutlass.max, select=lambda cond, a, b: cutlass.select_(cond, a, b))


# window: None, or (left, right) device Int32 values (flash4.geometry.window_sides: unbounded
# sides are geometry.UNBOUNDED); with a window `causal` is ignored.
# pack: GQA packing (forward; flash4.geometry.tile_first_query): row r of a tile is query r // pack.
def n_block_max(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, window=None, pack: int = 1):
    return g.n_block_max(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal, DEVICE_OPS, window, pack)


def n_block_min(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, window=None, pack: int = 1):
    return g.n_block_min(m_block, seqlen_q, seqlen_k, tile_m, tile_n, DEVICE_OPS, window, pack)


def n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, window=None, pack: int = 1):
    return g.n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, tile_m, tile_n, DEVICE_OPS, window, pack)


def n_block_left_mask_end(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, window=None, pack: int = 1):
    return g.n_block_left_mask_end(m_block, seqlen_q, seqlen_k, tile_m, tile_n, DEVICE_OPS, window, pack)


def m_block_range(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, window=None):
    return g.m_block_range(n_block, seqlen_q, seqlen_k, tile_m, tile_n, causal, DEVICE_OPS, window)


def m_block_mask_end(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, window=None):
    return g.m_block_mask_end(n_block, seqlen_q, seqlen_k, tile_m, tile_n, causal, DEVICE_OPS, window)


def m_block_left_mask_start(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, window=None):
    return g.m_block_left_mask_start(n_block, seqlen_q, seqlen_k, tile_m, tile_n, DEVICE_OPS, window)


def paged_piece(n_block, i, tile_n: int, page_rows: int, page_size):
    return g.paged_piece(n_block, i, tile_n, page_rows, page_size)


@cute.jit
def mask_scores(
    acc_S: cute.Tensor,
    tScS: cute.Tensor,
    t0ScS: cute.Tensor,
    m_block: Int32,
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    window=None,
    pack: cutlass.Constexpr[int] = 1,
):
    """Forward: sets the scores of keys a row does not see to -inf, in place (window: None or the
    (left, right) Int32 pair; then both edges of the band are applied and `causal` is ignored).

    acc_S: the thread's score fragment; tScS: identity tensor (tile_m, tile_n) partitioned the same
    way for this thread (values are (row, col) inside the tile); t0ScS: the same for thread 0, whose
    coordinates are compile-time constants. pack > 1: GQA-packed rows (row r is query r // pack).
    Columns are compared as (col - this thread's first col)
    against those constants, so no per-column coordinate lives in a register.
    """
    s = acc_mn_view(acc_S)
    c = acc_mn_view(tScS)
    c0 = acc_mn_view(t0ScS)
    col_base = n_block * tile_n + c[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = m_block * tile_m + c[r, 0][0]
        if cutlass.const_expr(pack > 1):
            row = row // pack  # GQA-packed rows: the query of packed row r is r // pack
        col_limit = g.key_limit(row, seqlen_q, seqlen_k, causal, DEVICE_OPS, window) - col_base
        if cutlass.const_expr(window is None):
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                # a select, not an `if`: a dynamic `if` would carry the whole fragment through it
                s[r, j] = Float32(cutlass.select_(c0[0, j][1] >= col_limit, -Float32.inf, s[r, j]))
        else:
            col_start = g.key_start(row, seqlen_q, seqlen_k, DEVICE_OPS, window) - col_base
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                hidden = (c0[0, j][1] >= col_limit) | (c0[0, j][1] < col_start)
                s[r, j] = Float32(cutlass.select_(hidden, -Float32.inf, s[r, j]))


@cute.jit
def mask_probs_t(
    tScS: cute.Tensor,
    r: cutlass.Constexpr[int],
    col: cutlass.Constexpr[int],
    p: Float32,
    m_block: Int32,
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    window=None,
) -> Float32:
    """Backward, one element of P^T (row r = a key, static column `col` relative to the thread's
    first column): p, or 0 if the query of that column does not see the key (keys past seqlen_k:
    none does). tScS: the (row, col) coordinates of this thread's P^T elements, (rows, cols) view."""
    key = n_block * tile_n + tScS[r, 0][0]
    col0 = m_block * tile_m + tScS[0, 0][1]
    first = g.first_query(key, seqlen_q, seqlen_k, causal, DEVICE_OPS, window) - col0
    hidden = col < first
    if cutlass.const_expr(window is not None):
        hidden = hidden | (col >= g.query_end(key, seqlen_q, seqlen_k, DEVICE_OPS, window) - col0)
    return Float32(cutlass.select_(hidden, Float32(0.0), p))
