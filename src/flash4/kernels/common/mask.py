"""Masks applied to raw score tiles: keys past seqlen_k, and the causal (bottom-right aligned) limit.

Causal follows FlashAttention-2/3: query row i (0-based) sees key j iff j <= i + seqlen_k - seqlen_q.
Only the tiles that cross the diagonal or the seqlen_k edge are masked; `block_info` says which.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash4.kernels.common.layout import acc_mn_view


@cute.jit
def apply_mask(
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
):
    """Sets masked scores to -inf in place.

    acc_S: the thread's score fragment; tScS: identity tensor (tile_m, tile_n) partitioned the same
    way for this thread (values are (row, col) inside the tile); t0ScS: the same for thread 0, whose
    coordinates are compile-time constants. Columns are compared as (col - this thread's first col)
    against those constants, so no per-column coordinate lives in a register.
    """
    s = acc_mn_view(acc_S)
    c = acc_mn_view(tScS)
    c0 = acc_mn_view(t0ScS)
    thread_col0 = c[0, 0][1]
    col_limit_k = seqlen_k - n_block * tile_n - thread_col0
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        col_limit = col_limit_k
        if cutlass.const_expr(causal):
            row = m_block * tile_m + c[r, 0][0]
            col_limit = cutlass.min(col_limit, row + 1 + seqlen_k - seqlen_q - n_block * tile_n - thread_col0)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            # a select, not an `if`: a dynamic `if` would carry the whole fragment through it
            s[r, j] = Float32(cutlass.select_(c0[0, j][1] >= col_limit, -Float32.inf, s[r, j]))
