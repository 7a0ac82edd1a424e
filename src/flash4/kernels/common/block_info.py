"""Which key blocks (n_block) a query tile (m_block) visits, and which of them need a mask.

All arithmetic is on device Int32 values but the same formulas hold in Python (see schedule.py).
"""

import cutlass
from cutlass import Int32


def n_block_max(m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, tile_m: int, tile_n: int, causal: bool) -> Int32:
    """One past the last key block the tile sees (may be <= 0: the tile sees no key)."""
    n_max = (seqlen_k + tile_n - 1) // tile_n
    if cutlass.const_expr(causal):
        last_col = (m_block + 1) * tile_m + seqlen_k - seqlen_q  # one past the last visible key
        n_max = cutlass.min(n_max, (last_col + tile_n - 1) // tile_n)
    return n_max


def n_block_min_causal_mask(m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, tile_m: int, tile_n: int) -> Int32:
    """Key blocks >= this may cross the diagonal of the tile's first row: they get the causal mask."""
    first_row_limit = m_block * tile_m + seqlen_k - seqlen_q + 1  # keys < this are visible to every row
    return cutlass.max(first_row_limit // tile_n, 0)
