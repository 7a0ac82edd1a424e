"""Device side of flash4.geometry: the same formulas on Int32 values, and the element masks.

flash4.geometry holds the rule (which key a query row sees) and the block ranges, written once for
Python ints and device Int32 alike; this module binds them to the DSL's min/max/select
(`DEVICE_OPS`) and applies the rule to score fragments:
  * `mask_scores` (forward): S (queries x keys) -> -inf where a key is not visible;
  * `mask_probs_t` (backward): P^T (keys x queries) -> 0 where a key is not visible (`mask_prob_rel`:
    the same from one step's relative bounds, BwdConfig.mask_rel).
Only the tiles the block ranges mark as crossing the diagonal or seqlen_k are masked.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

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
def paged_piece_divide_free(n_block, i, tile_n: cutlass.Constexpr[int], page_rows: cutlass.Constexpr[int],
                            page_size):
    """paged_piece (flash4.geometry) from the piece's index (FwdConfig.page_divide_free): piece i of
    key block n_block is piece n_block * tile_n / page_rows + i of the sequence, pieces_per_page =
    page_size / page_rows of them per page (page_rows: a compile-time power of two, so a shift), and
    the (column, row block) division runs only where a page holds more than one piece. For
    n_block >= 0 the same (first key, page-table column, row block) as paged_piece."""
    piece = n_block * (tile_n // page_rows) + i
    pieces_per_page = page_size // page_rows
    col = piece
    row_block = Int32(0)
    if pieces_per_page != 1:
        col = piece // pieces_per_page
        row_block = piece - col * pieces_per_page
    return piece * page_rows, col, row_block


# The score mask from bits (mask_scores(bits=True), FwdConfig.mask_bits): one 32-bit word per row and
# 32 of the thread's elements, bit j set where element j stays; each element's select tests a
# compile-time bit, which ptxas turns into R2P (7 predicates per instruction) instead of one or two
# integer compares per element.
MASK_WORD = 32


@dsl_user_op
def _ones_shifted(shift: Int32, right: bool, *, loc=None, ip=None) -> Uint32:
    """0xFFFFFFFF >> shift (right) or << shift, for shift in [0, 32]: PTX shr.u32 / shl.b32 clamp
    the amount at 32 (result 0), which an LLVM shift by the type width does not define."""
    op = "shr.u32" if right else "shl.b32"
    return Uint32(llvm.inline_asm(
        Uint32.mlir_type, [Int32(shift).ir_value(loc=loc, ip=ip)],
        f"{op} $0, 0xffffffff, $1;", "=r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


def _wgmma_fragment_cols(c0, ncols: int) -> bool:
    """Whether the compile-time columns of thread 0's elements of one row (mask_scores' t0ScS view)
    follow the Hopper wgmma accumulator pattern 0, 1, 8, 9, 16, 17, ... (two adjacent columns per 8):
    the pattern _elements_below counts."""
    return all(c0[0, j][1] == 8 * (j // 2) + j % 2 for j in range(ncols))


@cute.jit
def _elements_below(col_limit: Int32) -> Int32:
    """How many of a thread's row elements (columns 0, 1, 8, 9, ... relative to its first) lie left
    of col_limit (a column relative to the same first column; any Int32)."""
    lim = cutlass.max(col_limit, Int32(0))
    return (lim >> 3) * 2 + cutlass.min(lim & 7, Int32(2))


@cute.jit
def _keep_word(n_keep_below: Int32, n_hide_below, chunk: cutlass.Constexpr[int]) -> Uint32:
    """Bits of elements chunk*32 .. chunk*32+31 that stay: index < n_keep_below and (a window's
    left edge, n_hide_below not None) index >= n_hide_below."""
    base = chunk * MASK_WORD
    keep = _ones_shifted(MASK_WORD - cutlass.min(cutlass.max(n_keep_below - base, Int32(0)), Int32(MASK_WORD)), True)
    if cutlass.const_expr(n_hide_below is not None):
        keep = keep & _ones_shifted(cutlass.min(cutlass.max(n_hide_below - base, Int32(0)), Int32(MASK_WORD)), False)
    return keep


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
    bits: cutlass.Constexpr[bool] = False,
):
    """Forward: sets the scores of keys a row does not see to -inf, in place (window: None or the
    (left, right) Int32 pair; then both edges of the band are applied and `causal` is ignored).
    bits (FwdConfig.mask_bits): the same mask from one 32-bit word per row and 32 elements (R2P),
    where the fragment's columns follow the wgmma accumulator pattern; same results bit for bit.

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
    ncols = cute.size(s, mode=[1])
    wgmma_cols = _wgmma_fragment_cols(c0, ncols)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = m_block * tile_m + c[r, 0][0]
        if cutlass.const_expr(pack > 1):
            row = row // pack  # GQA-packed rows: the query of packed row r is r // pack
        col_limit = g.key_limit(row, seqlen_q, seqlen_k, causal, DEVICE_OPS, window) - col_base
        if cutlass.const_expr(bits and wgmma_cols):
            n_below = _elements_below(col_limit)
            n_left = None
            if cutlass.const_expr(window is not None):
                n_left = _elements_below(g.key_start(row, seqlen_q, seqlen_k, DEVICE_OPS, window) - col_base)
            for w in cutlass.range_constexpr((ncols + MASK_WORD - 1) // MASK_WORD):
                keep = _keep_word(n_below, n_left, w)
                for i in cutlass.range_constexpr(min(MASK_WORD, ncols - w * MASK_WORD)):
                    j = w * MASK_WORD + i
                    stays = cutlass.Boolean(keep & Uint32(1 << i))
                    s[r, j] = Float32(cutlass.select_(stays, s[r, j], -Float32.inf))
        elif cutlass.const_expr(window is None):
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                # a select, not an `if`: a dynamic `if` would carry the whole fragment through it
                s[r, j] = Float32(cutlass.select_(c0[0, j][1] >= col_limit, -Float32.inf, s[r, j]))
        else:
            col_start = g.key_start(row, seqlen_q, seqlen_k, DEVICE_OPS, window) - col_base
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                hidden = (c0[0, j][1] >= col_limit) | (c0[0, j][1] < col_start)
                s[r, j] = Float32(cutlass.select_(hidden, -Float32.inf, s[r, j]))


def key_row_bounds(tScS: cute.Tensor, m_block: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                   tile_m: int, tile_n: int, causal: bool, window=None):
    """Backward (BwdConfig.mask_rel): flash4.geometry.key_row_bounds of this thread's step (its first
    key and first query from tScS, the (rows, cols) view of its P^T coordinates)."""
    return g.key_row_bounds(n_block * tile_n + tScS[0, 0][0], m_block * tile_m + tScS[0, 0][1], seqlen_q, seqlen_k,
                            causal, window)


@cute.jit
def mask_prob_rel(bounds, dr: cutlass.Constexpr[int], col: cutlass.Constexpr[int], p: Float32) -> Float32:
    """Backward (BwdConfig.mask_rel): p, or 0 where element (first key + dr, first query + col) of
    this thread's P^T is hidden (flash4.geometry.probs_t_hidden; dr, col compile-time offsets)."""
    return Float32(cutlass.select_(g.probs_t_hidden(bounds, Int32(dr), Int32(col)), Float32(0.0), p))


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
