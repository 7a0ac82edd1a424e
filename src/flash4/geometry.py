"""Sequence and mask geometry: the one definition of which keys a query sees, which key blocks a
query tile visits, which query blocks a key tile visits, and which of those need the element mask.

Written once, for two kinds of integers: the kernels call these functions at trace time on device
`Int32` values with `DEVICE_OPS` (kernels/common/geometry.py), the host model, the reference and
the CPU tests call them on Python ints with `PY_OPS`. Every division has a non-negative numerator
(clamped first), so Python's floor division and the device's truncating one agree.

The rule (FlashAttention 2/3 conventions), for one (batch, head) with seqlen_q queries and
seqlen_k keys: query row i (0 <= i < seqlen_q) sees key j iff
    0 <= j < seqlen_k  and  (not causal or j <= i + seqlen_k - seqlen_q)     (bottom-right causal)
and, with a sliding window (left, right):
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
Two spellings of the sides reach here: flash-attn 2/3's window_size (a plain tuple, -1 = unbounded
per side, other negative values not allowed) and a `Band` (literal sides, None = unbounded, any
int: `Band(None, -5)` ends 5 keys before the diagonal, `Band(-5, None)` starts 5 keys after it,
flash-attn-4's convention). Negative sides are ordinary values of the same formulas. A row that
sees no key has out = 0 and LSE = -inf. Keys past seqlen_k and queries past seqlen_q
inside a tile are masked explicitly (in a packed varlen batch they hold the next sequence's data).

`SeqLens` says where a sequence lives: dense (every batch entry has the tensors' seqlens),
varlen (cu_seqlens offsets into packed tensors) and seqused (fewer keys/queries used than stored).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Ops:
    """The integer operations the formulas use: min, max and select(cond, a, b)."""

    min: Callable[[Any, Any], Any]
    max: Callable[[Any, Any], Any]
    select: Callable[[Any, Any, Any], Any]


PY_OPS = Ops(min=min, max=max, select=lambda cond, a, b: a if cond else b)

# A key index larger than any tile coordinate: "no query column of this key row is visible".
NO_COLUMN = 1 << 30


# ---------------------------------------------------------------- the element rule
# A window side larger than any sequence: "unbounded" (flash-attn's -1, per side).
UNBOUNDED = 1 << 30


class Band(NamedTuple):
    """A window with literal sides (flash-attn-4's convention): query row i sees keys
    i + sk - sq - left <= j <= i + sk - sq + right; None = unbounded on that side; any int, so a band
    may exclude the diagonal (Band(None, -5): ends 5 keys before it; Band(-5, None): starts 5 keys
    after it). Band(None, None): no window. flash4.request.MaskSpec holds every window as a Band."""

    left: Optional[int] = None
    right: Optional[int] = None


def band(window_size) -> Band:
    """Any window spelling -> its Band: a Band unchanged; None -> Band(None, None); flash-attn 2/3's
    (left, right) tuple with -1 (any negative) per unbounded side -> None there."""
    if isinstance(window_size, Band):
        return window_size
    if window_size is None:
        return Band(None, None)
    left, right = window_size
    return Band(None if left < 0 else left, None if right < 0 else right)


def window_sides(window_size, causal: bool):
    """A window (flash-attn 2/3's window_size tuple, -1 per unbounded side, or a literal Band) and
    causal -> the (left, right) the formulas take, or None for no window (Python ints; host side).
    Unbounded sides become UNBOUNDED; causal=True sets right = 0. Returns None when there is no
    window beyond what `causal` says (no window, or causal with an unbounded left side): the
    kernels' cheaper paths. (-1, 0) / Band(None, 0) with causal=False returns (UNBOUNDED, 0): the
    local kernel, whose result equals causal's (pass causal=True to get the causal kernel itself)."""
    left, right = band(window_size)
    if causal:
        right = 0
    if left is None and (right is None or (right == 0 and causal)):
        return None
    return (UNBOUNDED if left is None else left, UNBOUNDED if right is None else right)


def canonical_mask(causal: bool, window_size):
    """(causal, window_size) with a window that is exactly causal (unbounded left, right 0: (-1, 0) or
    Band(None, 0)) turned into causal=True and no window (of the same spelling), so it runs the
    causal kernel; anything else unchanged."""
    if isinstance(causal, bool) and window_size is not None:
        left, right = band(window_size)
        if left is None and right == 0:
            return True, (Band(None, None) if isinstance(window_size, Band) else (-1, -1))
    return causal, window_size


def _right_reach(causal: bool, window):
    """How far right of the diagonal a row sees: None (unbounded), 0 (causal) or window[1]."""
    if window is not None:
        return window[1]
    return 0 if causal else None


def key_limit(row, seqlen_q, seqlen_k, causal: bool, ops: Ops = PY_OPS, window=None):
    """One past the last key that query `row` sees (row < seqlen_q); <= key_start: it sees none.
    window: None, or (left, right) from window_sides (then `causal` is ignored)."""
    right = _right_reach(causal, window)
    if right is None:
        return seqlen_k
    return ops.min(seqlen_k, row + 1 + seqlen_k - seqlen_q + right)


def key_start(row, seqlen_q, seqlen_k, ops: Ops = PY_OPS, window=None):
    """The first key that query `row` sees (0 without a window)."""
    if window is None:
        return 0
    return ops.max(row + seqlen_k - seqlen_q - window[0], 0)


def first_query(key, seqlen_q, seqlen_k, causal: bool, ops: Ops = PY_OPS, window=None):
    """The first query row that sees `key`, NO_COLUMN for a key past seqlen_k (seen by none).
    The transpose of key_limit: row >= first_query(key) iff key < key_limit(row), for key >= 0."""
    right = _right_reach(causal, window)
    first = 0 if right is None else key - (seqlen_k - seqlen_q) - right
    return ops.select(key >= seqlen_k, NO_COLUMN, first)


def query_end(key, seqlen_q, seqlen_k, ops: Ops = PY_OPS, window=None):
    """One past the last query row that sees `key` on the left side of the window (the transpose
    of key_start: row < query_end(key) iff key_start(row) <= key); seqlen_q without a window."""
    if window is None:
        return seqlen_q
    return ops.min(key - (seqlen_k - seqlen_q) + window[0] + 1, seqlen_q)


class KeyRowBounds(NamedTuple):
    """The backward's P^T mask of one step (key rows x query columns) in coordinates relative to a
    thread's first element (key0 = its first key, col0 = its first query): element (dr, col) =
    (key0 + dr, col0 + col) is hidden iff `probs_t_hidden` says so. Built once per step by
    `key_row_bounds`; dr and col are the compile-time offsets of the fragment, so an element costs
    compares of one step value against immediates and no per-row value stays live across steps
    (BwdConfig.mask_rel). lo / hi / col_end: None where that side is unbounded."""

    lo: object       # hidden where col - dr < lo (the diagonal / window's right side)
    past: object     # hidden where dr >= past (keys at or past seqlen_k)
    hi: object       # hidden where col - dr >= hi (the window's left side)
    col_end: object  # hidden where col >= col_end (queries at or past seqlen_q, window only)


def key_row_bounds(key0, col0, seqlen_q, seqlen_k, causal: bool, window=None) -> KeyRowBounds:
    """KeyRowBounds of a thread's step: the same rule as first_query / query_end (query row >=
    first_query(key), and with a window < query_end(key)), rearranged around key0 - col0."""
    right = _right_reach(causal, window)
    diag = key0 - col0 - (seqlen_k - seqlen_q)
    lo = None if right is None else diag - right
    hi = col_end = None
    if window is not None:
        hi = diag + window[0] + 1
        col_end = seqlen_q - col0
    return KeyRowBounds(lo, seqlen_k - key0, hi, col_end)


def probs_t_hidden(b: KeyRowBounds, dr, col):
    """Whether element (key0 + dr, col0 + col) of P^T is hidden (bounds from key_row_bounds); the
    same answer as `col0 + col < first_query(key0 + dr)` or, with a window, `>= query_end(...)`."""
    hidden = dr >= b.past
    if b.lo is not None:
        hidden = hidden | (col - dr < b.lo)
    if b.hi is not None:
        hidden = hidden | (col - dr >= b.hi) | (col >= b.col_end)
    return hidden


def visible(row, key, seqlen_q, seqlen_k, causal: bool, window=None) -> bool:
    """The rule itself (Python ints): does query `row` see `key`?"""
    return (0 <= row < seqlen_q and key_start(row, seqlen_q, seqlen_k, window=window) <= key
            and 0 <= key < key_limit(row, seqlen_q, seqlen_k, causal, window=window))


# ---------------------------------------------------------------- forward: key blocks of a query tile
# pack (GQA packing, forward): the tile's rows are packed rows r = query * pack + (head offset), so
# row r is query r // pack; pack = 1 is the plain layout. A Python int (a kernel's constant).
def tile_first_query(m_block, tile_m: int, pack: int = 1):
    """The first query of query tile m_block."""
    return m_block * tile_m if pack == 1 else (m_block * tile_m) // pack


def tile_last_query(m_block, seqlen_q, tile_m: int, ops: Ops = PY_OPS, pack: int = 1):
    """The last query of query tile m_block (seqlen_q - 1 for the sequence's last tile)."""
    if pack == 1:
        return ops.min((m_block + 1) * tile_m, seqlen_q) - 1
    return ops.min(((m_block + 1) * tile_m - 1) // pack, seqlen_q - 1)


def n_block_max(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, ops: Ops = PY_OPS,
                window=None, pack: int = 1):
    """One past the last key block that query tile m_block visits; 0 if it sees no key."""
    n_max = (ops.max(seqlen_k, 0) + tile_n - 1) // tile_n
    if _right_reach(causal, window) is not None:
        # the tile's last row (or seqlen_q - 1) sees the most keys
        last_row = tile_last_query(m_block, seqlen_q, tile_m, ops, pack)
        limit = ops.max(key_limit(last_row, seqlen_q, seqlen_k, causal, ops, window), 0)
        n_max = ops.min(n_max, (limit + tile_n - 1) // tile_n)
    return n_max


def n_block_min(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, ops: Ops = PY_OPS, window=None,
                pack: int = 1):
    """The first key block that query tile m_block visits (0 without a window: the tile's first
    row starts the earliest)."""
    if window is None:
        return 0
    return key_start(tile_first_query(m_block, tile_m, pack), seqlen_q, seqlen_k, ops, window) // tile_n


def n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, ops: Ops = PY_OPS,
                            window=None, pack: int = 1):
    """Causal or a window's right side: key blocks >= this may hide keys from some row of the
    tile (they cross the diagonal / the right edge); blocks below it are fully visible on the
    right to every row of the tile."""
    first_limit = ops.max(key_limit(tile_first_query(m_block, tile_m, pack), seqlen_q, seqlen_k, True, ops, window), 0)
    return first_limit // tile_n


def n_block_left_mask_end(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, ops: Ops = PY_OPS, window=None,
                          pack: int = 1):
    """A window's left side: key blocks below this may hide keys from some row of the tile (they
    start before the last row's first key); blocks at or above it are fully visible on the left."""
    if window is None:
        return 0
    last_row = tile_last_query(m_block, seqlen_q, tile_m, ops, pack)
    return (key_start(last_row, seqlen_q, seqlen_k, ops, window) + tile_n - 1) // tile_n


def n_block_seqlen_mask(seqlen_k, tile_n: int):
    """Key blocks >= this cross seqlen_k (the last block, when seqlen_k is not a multiple of tile_n)."""
    return seqlen_k // tile_n


# ---------------------------------------------------------------- backward: query blocks of a key tile
def m_block_range(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, ops: Ops = PY_OPS,
                  window=None):
    """(m_block_min, m_block_max): the query blocks that see some key of key tile n_block
    (m_block_min >= m_block_max: none)."""
    m_max = (ops.max(seqlen_q, 0) + tile_m - 1) // tile_m
    m_min = 0
    if _right_reach(causal, window) is not None:
        first = ops.max(first_query(n_block * tile_n, seqlen_q, seqlen_k, causal, ops, window), 0)
        m_min = ops.min(first // tile_m, m_max)
    if window is not None:
        # the tile's last key (or seqlen_k - 1) is seen by the latest rows
        last_key = ops.min((n_block + 1) * tile_n, seqlen_k) - 1
        end = ops.max(query_end(last_key, seqlen_q, seqlen_k, ops, window), 0)
        m_max = ops.min(m_max, (end + tile_m - 1) // tile_m)
    return m_min, m_max


def m_block_mask_end(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, ops: Ops = PY_OPS,
                     window=None):
    """The query blocks [m_block_min, end) of key tile n_block need the element mask for the right
    side; the rest see every key of the tile on that side. All of them when the tile crosses
    seqlen_k; causal / a window, those that cross the diagonal (below the first block whose every
    row sees the tile's last key)."""
    m_min, m_max = m_block_range(n_block, seqlen_q, seqlen_k, tile_m, tile_n, causal, ops, window)
    end = m_min
    if _right_reach(causal, window) is not None:
        last_key = (n_block + 1) * tile_n - 1
        first_full = ops.max(first_query(last_key, seqlen_q, seqlen_k, causal, ops, window), 0)
        end = ops.min(ops.max((first_full + tile_m - 1) // tile_m, m_min), m_max)
    return ops.select((n_block + 1) * tile_n > seqlen_k, m_max, end)


def m_block_left_mask_start(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, ops: Ops = PY_OPS,
                            window=None):
    """A window's left side: the query blocks [start, m_block_max) of key tile n_block need the
    element mask (some row's first key lies past the tile's first key); m_block_max without a
    window."""
    m_min, m_max = m_block_range(n_block, seqlen_q, seqlen_k, tile_m, tile_n, False, ops, window)
    if window is None:
        return m_max
    # rows < query_end(first key) see the tile's first key on the left side
    full_end = ops.max(query_end(n_block * tile_n, seqlen_q, seqlen_k, ops, window), 0)
    return ops.max(ops.min(full_end // tile_m, m_max), m_min)


# ---------------------------------------------------------------- where a sequence lives
@dataclasses.dataclass(frozen=True)
class SeqLens:
    """Per-batch sequence placement (Python twin of the device SeqInfo).

    dense:   every sequence has seqlen_q / seqlen_k, batch b at offset b * seqlen (of its own tensor).
    varlen:  cu_seqlens_q / cu_seqlens_k (batch + 1 prefix sums) into packed (total, ...) tensors.
    seqused: seqused_q / seqused_k override the lengths (only the first seqused entries are used).
    paged:   page_table (batch, pages) and page_size: key j of sequence b is row j % page_size of
             page page_table[b][j // page_size] (seqused_k gives the lengths).
    """

    batch: int
    seqlen_q: int | None = None
    seqlen_k: int | None = None
    cu_seqlens_q: Sequence[int] | None = None
    cu_seqlens_k: Sequence[int] | None = None
    seqused_q: Sequence[int] | None = None
    seqused_k: Sequence[int] | None = None
    page_table: Sequence[Sequence[int]] | None = None
    page_size: int = 0

    def offset_q(self, b: int) -> int:
        return self.cu_seqlens_q[b] if self.cu_seqlens_q is not None else b * self.seqlen_q

    def offset_k(self, b: int) -> int:
        return self.cu_seqlens_k[b] if self.cu_seqlens_k is not None else b * self.seqlen_k

    def len_q(self, b: int) -> int:
        if self.seqused_q is not None:
            return self.seqused_q[b]
        if self.cu_seqlens_q is not None:
            return self.cu_seqlens_q[b + 1] - self.cu_seqlens_q[b]
        return self.seqlen_q

    def len_k(self, b: int) -> int:
        if self.seqused_k is not None:
            return self.seqused_k[b]
        if self.cu_seqlens_k is not None:
            return self.cu_seqlens_k[b + 1] - self.cu_seqlens_k[b]
        return self.seqlen_k

    def key_location(self, b: int, j: int) -> tuple[int, int]:
        """(index of the first mode, row) of key j of sequence b in K's storage: (b, j) dense,
        (0, cu_seqlens_k[b] + j) packed, (page, j % page_size) paged."""
        if self.page_table is not None:
            return self.page_table[b][j // self.page_size], j % self.page_size
        if self.cu_seqlens_k is not None:
            return 0, self.cu_seqlens_k[b] + j
        return b, j

    def padded_offset_q(self, b: int, tile: int) -> int:
        """First row of sequence b in the backward's padded statistics layout (tile-aligned; the
        device twin is kernels/common/seqinfo.padded_offset)."""
        return (self.offset_q(b) + b * tile) // tile * tile


def paged_piece(n_block, i, tile_n: int, page_rows: int, page_size):
    """Piece i (page_rows keys, one TMA box) of key block n_block of a paged K/V: (first key,
    page-table column, row block of page_rows rows inside that page). page_rows divides tile_n and
    page_size (flash4.config.paged_page_rows), so a piece never crosses a page."""
    key0 = n_block * tile_n + i * page_rows
    col = key0 // page_size
    return key0, col, (key0 - col * page_size) // page_rows


def paged_pieces(n_block: int, tile_n: int, page_rows: int, page_size: int):
    """Every piece of key block n_block (the forward's load_kv issues one TMA box per piece)."""
    return [paged_piece(n_block, i, tile_n, page_rows, page_size) for i in range(tile_n // page_rows)]
