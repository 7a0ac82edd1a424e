"""Pure-Python model of the forward tile schedulers (mirrored by the in-kernel scheduler).

A tile is (m_block, head, batch): one CTA's tile_m query rows of one head. A persistent kernel
launches one CTA per SM; each CTA repeatedly takes the next tile index t and maps it to a tile
with `tile_coords` (divmods only, what the kernel computes). `tile_order` is the same order
written as plain loops, the reference the closed form is tested against.

Order (FlashAttention-3/4 "L2 swizzle" + LPT, cf. flash_attn/cute/tile_scheduler.py):
  * (head, batch) pairs, hb = batch * num_heads + head, are cut into sections of
    `heads_per_l2_group` consecutive pairs, sized so the section's K/V fits in L2
    (`l2_section_heads`); sections are handed out one after another.
  * inside a section, m_block is the outer loop and hb the inner one, so the CTAs working at one
    time read the K/V of the same few heads.
  * causal + lpt: m_block descends (longest-processing-time first: with the bottom-right causal
    mask the last query block sees the most keys), so each section's short tiles fill the tail.
  * not lpt, no sections (heads_per_l2_group=None = 1): m_block fastest, ascending, then head,
    then batch: the plain non-persistent grid order (blockIdx.x = m_block).

`work` counts the K/V blocks a tile visits (its cost); `makespan` simulates the CTAs.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

try:  # the package import; tests also load this file alone, next to geometry.py
    from flash4.geometry import n_block_max
except ImportError:  # pragma: no cover
    import importlib.util as _util
    import pathlib as _pathlib

    import sys as _sys

    _spec = _util.spec_from_file_location("geometry", _pathlib.Path(__file__).with_name("geometry.py"))
    _geometry = _util.module_from_spec(_spec)
    _sys.modules.setdefault("geometry", _geometry)  # dataclasses look their module up
    _spec.loader.exec_module(_geometry)
    n_block_max = _geometry.n_block_max

Tile = tuple[int, int, int]  # (m_block, head, batch)

L2_BYTES = 50 * 1024 * 1024  # H100 / H200 L2 (FA3/FA4 budget K/V to this size)


def l2_section_heads(seqlen_k: int, headdim: int, headdim_v: int | None = None, elem_bytes: int = 2,
                     l2_bytes: int = L2_BYTES) -> int:
    """(head, batch) pairs per section: the largest power of two whose K + V (seqlen_k rows of
    headdim + headdim_v elements, elem_bytes each) fits in l2_bytes; at least 1."""
    one_head = seqlen_k * (headdim + (headdim if headdim_v is None else headdim_v)) * elem_bytes
    fit = l2_bytes // one_head if one_head > 0 else 1
    return 1 << (fit.bit_length() - 1) if fit >= 1 else 1


def l2_section_pairs(seqlen_k: int, headdim: int, headdim_v: int | None = None, kv_group: int = 1,
                     elem_bytes: int = 2, l2_bytes: int = L2_BYTES) -> int:
    """(head, batch) pairs per L2 section when the K/V of a KV head is counted once for the kv_group
    query heads that read it (FwdConfig.l2_kv_heads): l2_section_heads KV heads of kv_group query
    heads each. Query heads h of one KV head are adjacent (h // kv_group), and a section starts at a
    multiple of its size, so a section holds whole KV groups. kv_group 1: l2_section_heads."""
    return l2_section_heads(seqlen_k, headdim, headdim_v, elem_bytes, l2_bytes) * max(kv_group, 1)


def tile_order(num_m_blocks: int, num_heads: int, batch: int, *, causal: bool, lpt: bool,
               heads_per_l2_group: int | None = None) -> list[Tile]:
    """All tiles in the order a persistent scheduler hands them out (tile index t -> list[t])."""
    num_hb = num_heads * batch
    group = heads_per_l2_group or 1
    descending = lpt and causal  # without causal every tile costs the same
    m_blocks = list(range(num_m_blocks))[::-1] if descending else list(range(num_m_blocks))
    order = []
    for start in range(0, num_hb, group):
        for m in m_blocks:
            for hb in range(start, min(start + group, num_hb)):
                order.append((m, hb % num_heads, hb // num_heads))
    return order


def tile_coords(t: int, num_m_blocks: int, num_heads: int, batch: int, *, causal: bool, lpt: bool,
                heads_per_l2_group: int | None = None) -> Tile:
    """Closed form of tile_order(...)[t] with integer divmods only (the kernel's arithmetic).

    The last section may be short (num_hb % group pairs): its tiles divide by that residual.
    """
    num_hb = num_heads * batch
    group = min(heads_per_l2_group or 1, num_hb)
    section, r = divmod(t, group * num_m_blocks)
    full_sections = num_hb // group
    size = group if section < full_sections else num_hb - full_sections * group
    m_idx, hb_in = divmod(r, size)
    batch_idx, head = divmod(section * group + hb_in, num_heads)
    m_block = num_m_blocks - 1 - m_idx if (lpt and causal) else m_idx
    return m_block, head, batch_idx


def work(m_block: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, causal: bool) -> int:
    """K/V blocks of tile_n keys visited by query block m_block (0 if all its rows are masked):
    flash4.geometry.n_block_max, the kernels' own formula."""
    return n_block_max(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal)


def makespan(order: Sequence[Tile], num_workers: int, work_fn: Callable[[Tile], float], *,
             dynamic: bool = True) -> float:
    """Finish time of the last CTA (units of work_fn, e.g. K/V blocks).

    dynamic=True: greedy list scheduling, each CTA takes the next tile in `order` when it becomes
    free (an atomic tile counter). dynamic=False: CTA w takes tiles w, w + num_workers, ...
    (a static persistent loop `t += gridDim.x`).
    """
    if not dynamic:
        loads = [0.0] * num_workers
        for t, tile in enumerate(order):
            loads[t % num_workers] += work_fn(tile)
        return max(loads)
    free = [(0.0, w) for w in range(num_workers)]  # (time the CTA is free, CTA id)
    for tile in order:
        at, w = heapq.heappop(free)
        heapq.heappush(free, (at + work_fn(tile), w))
    return max(at for at, _ in free)


def lower_bound(order: Sequence[Tile], num_workers: int, work_fn: Callable[[Tile], float]) -> float:
    """No schedule beats max(total work / workers, longest tile)."""
    costs = [work_fn(tile) for tile in order]
    return max(sum(costs) / num_workers, max(costs))
