"""Launch plans: the grid of every kernel launch, as pure host functions (CPU-tested).

Each kernel takes its grid from here, so the grid a test checks is the grid that launches. CUDA
limits a grid to (2^31 - 1, 65535, 65535) blocks; every flash4 kernel puts all of its work in
gridDim.x and decodes (block, head, batch) from blockIdx.x inside the kernel, so batch and heads
are never a grid dimension of their own (a batch of 65536 once overflowed gridDim.z). The
forward's tile loop also lets a grid smaller than its tile count cover every tile (persistent
CTAs step by gridDim.x), so its grid is capped instead of rejected. A problem whose work items
do not fit the kernels' 32-bit indices raises a ValueError naming the shape.
"""

from __future__ import annotations

from flash4.config import BwdConfig, FwdConfig, ceil_div
from flash4.constants import ROW_PASS_THREADS, ROW_TILE  # noqa: F401  (the row passes' grids below)

# CUDA's grid limits (blocks per dimension) on every GPU flash4 targets (sm_90, sm_100).
MAX_GRID = (2**31 - 1, 65535, 65535)
# Kernels index tiles, rows and blocks with Int32.
MAX_INT32 = 2**31 - 1


def _check_count(kernel: str, what: str, count: int, shape: str) -> None:
    if count > MAX_INT32:
        raise ValueError(
            f"flash4 {kernel}: {what} = {count} exceeds 2^31 - 1 (the kernels index it with int32); "
            f"problem {shape}: split the batch into smaller calls"
        )


def check_grid(kernel: str, grid: tuple[int, int, int]) -> None:
    """Raise ValueError if `grid` is outside CUDA's limits or empty."""
    for axis, (g, limit) in enumerate(zip(grid, MAX_GRID)):
        if not 1 <= g <= limit:
            raise ValueError(f"flash4 {kernel}: grid {grid} has dimension {axis} = {g}, allowed 1..{limit}")


def fwd_num_tiles(cfg: FwdConfig, batch: int, seqlen_q: int, nheads: int) -> int:
    """(m_block, head, batch) tiles of the forward; an m_block is the CTA's query rows: cfg.tile_m,
    or cfg.cta_tile_m where a CTA covers several Q tiles (sm100: q_stage x tile_m = 256 rows)."""
    rows = getattr(cfg, "cta_tile_m", cfg.tile_m)
    num_tiles = ceil_div(seqlen_q, rows) * nheads * batch
    _check_count("forward", "tiles (m_blocks x nheads x batch)", num_tiles,
                 f"batch={batch}, seqlen_q={seqlen_q}, nheads={nheads}, rows per tile={rows}")
    return num_tiles


def fwd_grid(cfg: FwdConfig, batch: int, seqlen_q: int, nheads: int, num_sms: int) -> tuple[int, int, int]:
    """Forward grid: one CTA per tile (capped at gridDim.x's limit), or one per SM when persistent.
    The kernel's tile loop (tile = blockIdx.x, += gridDim.x) covers every tile either way.
    A 2-CTA config (sm100 cta_group 2, launched with cluster (2, 1, 1)): cta_group CTAs per tile,
    gridDim.x a multiple of cta_group (tile = blockIdx.x / 2, += gridDim.x / 2)."""
    group = getattr(cfg, "cta_group", 1)
    num_tiles = fwd_num_tiles(cfg, batch, seqlen_q, nheads)
    ctas = min(num_tiles, num_sms // group) if cfg.persistent else num_tiles
    # A CTA's Int32 tile index ends at (its last tile) + gridDim.x <= num_tiles - 1 + gridDim.x:
    # keep that within int32 (only binds above 2^30 tiles, beyond any GPU's memory today).
    tiles = min(ctas, MAX_GRID[0] // group, (MAX_INT32 + 1 - num_tiles) // group)
    grid = (tiles * group, 1, 1)
    check_grid("forward", grid)
    return grid


def bwd_dynamic_seqlen_k(cfg: BwdConfig) -> bool:
    """The backward's key count differs per sequence (BwdConfig.dynamic_seqlen_k): its grid is
    sized by max_seqlen_k (a host int) and CTAs past their sequence's keys exit at once."""
    return cfg.dynamic_seqlen_k


def bwd_num_splits(cfg: BwdConfig, nheads: int, nheads_k: int, heads_per_cta: int) -> int:
    """CTAs per (n_block, kv_head, batch): ceil(group / heads_per_cta) with cfg.dkv_accum, else 1."""
    return ceil_div(nheads // nheads_k, heads_per_cta) if cfg.dkv_accum else 1


def bwd_grid(cfg: BwdConfig, batch: int, seqlen_k: int, nheads_k: int, num_splits: int = 1) -> tuple[int, int, int]:
    """Backward grid: one CTA per (n_block, head split, kv_head, batch), n_block fastest, then the
    split (the deterministic dQ and dK/dV orders rely on lower n_blocks and lower splits launching
    first), flattened into gridDim.x. num_splits: bwd_num_splits (1 without GQA head split). Varlen:
    batch = the number of sequences, seqlen_k = max_seqlen_k when bwd_dynamic_seqlen_k(cfg) (the
    kernel decodes blockIdx.x with the same n_block count). A 2-CTA config (cta_group 2: a cluster of
    2 CTAs per 2 x tile_n keys) rounds the n_blocks of each (head, batch) up to whole pairs, so a
    cluster never straddles two heads (the odd pair's second CTA holds keys past seqlen_k only)."""
    group = getattr(cfg, "cta_group", 1)
    num_n_blocks = ceil_div(seqlen_k, cfg.tile_n * group) * group
    ctas = num_n_blocks * num_splits * nheads_k * batch
    _check_count("backward", "CTAs (n_blocks x head splits x nheads_k x batch)", ctas,
                 f"batch={batch}, seqlen_k={seqlen_k}, nheads_k={nheads_k}, head splits={num_splits}, "
                 f"tile_n={cfg.tile_n}")
    grid = (ctas, 1, 1)
    check_grid("backward", grid)
    return grid


def _row_tile_grid(kernel: str, batch: int, seqlen_q: int, nheads: int, tile: int) -> tuple[int, int, int]:
    """One CTA per `tile` rows of one (batch, head): blockIdx.x = (batch * nheads + head) *
    ceil(seqlen_q / tile) + row tile."""
    ctas = ceil_div(seqlen_q, tile) * nheads * batch
    _check_count(kernel, "CTAs (row tiles x nheads x batch)", ctas,
                 f"batch={batch}, seqlen_q={seqlen_q}, nheads={nheads}, tile={tile}")
    grid = (ctas, 1, 1)
    check_grid(kernel, grid)
    return grid


def bwd_dq_tile_grid(batch: int, seqlen_q: int, nheads: int, tile_m: int) -> tuple[int, int, int]:
    """Grid of the accumulator-order dQ postprocess (BwdConfig.dq_accum_order): one CTA per
    (query tile, head, batch)."""
    return _row_tile_grid("dQ postprocess", batch, seqlen_q, nheads, tile_m)


def bwd_rowwise_grid(batch: int, seqlen_q: int, nheads: int) -> tuple[int, int, int]:
    """Grid of the backward preprocess and dQ postprocess: one CTA per ROW_TILE rows of one
    (batch, head). Varlen: batch 1, seqlen_q = total_q. The kernel forms row indices up to the last
    tile's end."""
    _check_count("backward preprocess", "seqlen_q + ROW_TILE", seqlen_q + ROW_TILE,
                 f"batch={batch}, seqlen_q={seqlen_q}, nheads={nheads}")
    return _row_tile_grid("backward preprocess", batch, seqlen_q, nheads, ROW_TILE)
