"""Sequence and mask geometry: the one definition of which keys a query sees, which key blocks a
query tile visits, which query blocks a key tile visits, and which of those need the element mask.

Written once, for two kinds of integers: the kernels call these functions at trace time on device
`Int32` values with `DEVICE_OPS` (kernels/common/geometry.py), the host model, the reference and
the CPU tests call them on Python ints with `PY_OPS`. Every division has a non-negative numerator
(clamped first), so Python's floor division and the device's truncating one agree.

The rule (FlashAttention 2/3 conventions), for one (batch, head) with seqlen_q queries and
seqlen_k keys: query row i (0 <= i < seqlen_q) sees key j iff
    0 <= j < seqlen_k  and  (not causal or j <= i + seqlen_k - seqlen_q)     (bottom-right causal)
A row that sees no key has out = 0 and LSE = -inf. Keys past seqlen_k and queries past seqlen_q
inside a tile are masked explicitly (in a packed varlen batch they hold the next sequence's data).

`SeqLens` says where a sequence lives: dense (every batch entry has the tensors' seqlens),
varlen (cu_seqlens offsets into packed tensors) and seqused (fewer keys/queries used than stored).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence


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
def key_limit(row, seqlen_q, seqlen_k, causal: bool, ops: Ops = PY_OPS):
    """One past the last key that query `row` sees (row < seqlen_q); <= 0: it sees none."""
    if causal:
        return ops.min(seqlen_k, row + 1 + seqlen_k - seqlen_q)
    return seqlen_k


def first_query(key, seqlen_q, seqlen_k, causal: bool, ops: Ops = PY_OPS):
    """The first query row that sees `key`, NO_COLUMN for a key past seqlen_k (seen by none).
    The transpose of key_limit: row >= first_query(key) iff key < key_limit(row), for key >= 0."""
    first = key - (seqlen_k - seqlen_q) if causal else 0
    return ops.select(key >= seqlen_k, NO_COLUMN, first)


def visible(row, key, seqlen_q, seqlen_k, causal: bool) -> bool:
    """The rule itself (Python ints): does query `row` see `key`?"""
    return 0 <= row < seqlen_q and 0 <= key < key_limit(row, seqlen_q, seqlen_k, causal)


# ---------------------------------------------------------------- forward: key blocks of a query tile
def n_block_max(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, ops: Ops = PY_OPS):
    """One past the last key block that query tile m_block visits; 0 if it sees no key."""
    n_max = (ops.max(seqlen_k, 0) + tile_n - 1) // tile_n
    if causal:
        # the tile's last row (or seqlen_q - 1) sees the most keys
        last_row = ops.min((m_block + 1) * tile_m, seqlen_q) - 1
        limit = ops.max(key_limit(last_row, seqlen_q, seqlen_k, causal, ops), 0)
        n_max = ops.min(n_max, (limit + tile_n - 1) // tile_n)
    return n_max


def n_block_min_causal_mask(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, ops: Ops = PY_OPS):
    """Causal: key blocks >= this may hide keys from some row of the tile (they cross the diagonal);
    blocks below it are fully visible to every row of the tile."""
    first_limit = ops.max(key_limit(m_block * tile_m, seqlen_q, seqlen_k, True, ops), 0)
    return first_limit // tile_n


def n_block_seqlen_mask(seqlen_k, tile_n: int):
    """Key blocks >= this cross seqlen_k (the last block, when seqlen_k is not a multiple of tile_n)."""
    return seqlen_k // tile_n


# ---------------------------------------------------------------- backward: query blocks of a key tile
def m_block_range(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, ops: Ops = PY_OPS):
    """(m_block_min, m_block_max): the query blocks that see some key of key tile n_block."""
    m_max = (ops.max(seqlen_q, 0) + tile_m - 1) // tile_m
    m_min = 0
    if causal:
        first = ops.max(first_query(n_block * tile_n, seqlen_q, seqlen_k, causal, ops), 0)
        m_min = ops.min(first // tile_m, m_max)
    return m_min, m_max


def m_block_mask_end(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool, ops: Ops = PY_OPS):
    """The query blocks [m_block_min, end) of key tile n_block need the element mask; the rest see
    every key of the tile. All of them when the tile crosses seqlen_k; causal, those that cross the
    diagonal (below the first block whose every row sees the tile's last key)."""
    m_min, m_max = m_block_range(n_block, seqlen_q, seqlen_k, tile_m, tile_n, causal, ops)
    end = m_min
    if causal:
        last_key = (n_block + 1) * tile_n - 1
        first_full = ops.max(first_query(last_key, seqlen_q, seqlen_k, causal, ops), 0)
        end = ops.min(ops.max((first_full + tile_m - 1) // tile_m, m_min), m_max)
    return ops.select((n_block + 1) * tile_n > seqlen_k, m_max, end)


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
