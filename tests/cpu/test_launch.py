"""Launch plans (flash4.launch) for extreme shapes: pure Python, no compiling, no GPU.

Every kernel takes its grid from flash4.launch; here those functions run for batch 1 .. 2^24,
seqlens 1 .. 1M, 1 .. 128 heads, every shipped forward / backward config (so every head dim,
tile shape and dtype), persistent or not, and are checked against the rules:
  * each grid dimension is an int in 1 .. MAX_GRID (CUDA's (2^31 - 1, 65535, 65535)): batch and
    heads never land in gridDim.y / gridDim.z (batch 65536 once overflowed gridDim.z);
  * the grid covers the work: forward, grid x = min(tiles, SMs) when persistent, else tiles
    (capped only where the kernel's Int32 tile index, tile = blockIdx.x, += gridDim.x, would
    pass 2^31 - 1), and that loop visits every tile exactly once (simulated for small tile
    counts); backward, grid x = ceil(seqlen_k / tile_n) * nheads_k * batch (one CTA per key
    block); preprocess / dQ postprocess, grid x = ceil(seqlen_q / ROW_TILE) * nheads * batch;
  * a problem whose counts do not fit the kernels' int32 indices raises ValueError naming the
    kernel and the shape (batch=, seqlen=, nheads=), instead of launching a wrapped-around grid.
"""

import dataclasses
import itertools

import pytest

from flash4 import launch
from flash4.config import (
    SUPPORTED_HEADDIMS,
    ceil_div,
    shipped_bwd_configs,
    shipped_fwd_configs,
)
from flash4.launch import MAX_GRID, MAX_INT32, bwd_grid, bwd_rowwise_grid, check_grid, fwd_grid

BATCHES = (1, 65535, 65536, 2**20, 2**24)
SEQLENS = (1, 32, 128 * 1024, 2**20)
NHEADS = (1, 2, 3, 8, 32, 64, 128)
# H100 SXM / H200: 132 SMs; 0: what the host passes for a non-persistent config (unused there).
NUM_SMS = (0, 1, 132)
# Rows of one (batch, head) per CTA of the backward preprocess / dQ postprocess.
ROW_TILE = launch.ROW_TILE

# The one-CTA-per-tile shipped forward configs (the persistent short-sequence ones are in FWD_CONFIGS_ALL).
FWD_CONFIGS = [c for c in shipped_fwd_configs() if not c.persistent]
# Persistent variants of every shipped forward config (the grid is the SM count, capped by tiles).
FWD_CONFIGS_ALL = (FWD_CONFIGS + [dataclasses.replace(c, persistent=True) for c in FWD_CONFIGS]
                   + [c for c in shipped_fwd_configs() if c.persistent])
BWD_CONFIGS = shipped_bwd_configs()


def _fwd_id(c):
    mode = "causal" if c.causal else "full"
    return f"d{c.headdim}-{c.dtype}-{mode}-m{c.tile_m}{'-persistent' if c.persistent else ''}"


def _bwd_id(c):
    return f"d{c.headdim}-{c.dtype}-{'causal' if c.causal else 'full'}-n{c.tile_n}{'-det' if c.deterministic else ''}"


def assert_valid_grid(grid):
    assert isinstance(grid, tuple) and len(grid) == 3, grid
    for axis, (g, limit) in enumerate(zip(grid, MAX_GRID)):
        assert isinstance(g, int) and not isinstance(g, bool), (grid, axis)
        assert 1 <= g <= limit, f"grid {grid}: dimension {axis} = {g} outside 1..{limit}"


def assert_names_problem(err, kernel, **shape):
    """The ValueError names the kernel and every dimension of the problem that set the count."""
    msg = str(err.value)
    assert "flash4" in msg and kernel in msg, msg
    for name, value in shape.items():
        assert f"{name}={value}" in msg, (name, value, msg)


def test_limits_are_cudas():
    assert MAX_GRID == (2**31 - 1, 65535, 65535)
    assert MAX_INT32 == 2**31 - 1


def test_rowwise_tile():
    """The preprocess / postprocess kernels take their row tile and CTA size from flash4.constants
    (flash4.launch sizes their grids with the same)."""
    from flash4.kernels.common import bwd_preprocess

    assert ROW_TILE == 64 and launch.ROW_PASS_THREADS == 128
    assert ROW_TILE % bwd_preprocess.ROWS_PER_PASS == 0


@pytest.mark.parametrize("grid", [(1, 1, 1), (MAX_GRID[0], 1, 1), (1, 65535, 1), (1, 1, 65535), MAX_GRID])
def test_check_grid_accepts_cuda_limits(grid):
    check_grid("forward", grid)


@pytest.mark.parametrize("grid", [(0, 1, 1), (2**31, 1, 1), (1, 65536, 1), (1, 1, 65536), (1, 0, 1), (1, 1, 0),
                                  (-1, 1, 1)])
def test_check_grid_rejects(grid):
    with pytest.raises(ValueError) as err:
        check_grid("backward preprocess", grid)
    assert "flash4 backward preprocess" in str(err.value) and str(grid) in str(err.value), str(err.value)


FWD_GRID_CASES = [(c, n) for c in FWD_CONFIGS_ALL for n in NUM_SMS if n > 0 or not c.persistent]


@pytest.mark.parametrize("cfg, num_sms", FWD_GRID_CASES, ids=[f"{_fwd_id(c)}-sms{n}" for c, n in FWD_GRID_CASES])
def test_fwd_grid_extreme_shapes(cfg, num_sms):
    for batch, seqlen_q, nheads in itertools.product(BATCHES, SEQLENS, NHEADS):
        tiles = ceil_div(seqlen_q, cfg.tile_m) * nheads * batch
        where = (batch, seqlen_q, nheads)
        if tiles > MAX_INT32:
            with pytest.raises(ValueError) as err:
                fwd_grid(cfg, batch, seqlen_q, nheads, num_sms)
            assert_names_problem(err, "forward", batch=batch, seqlen_q=seqlen_q, nheads=nheads)
            continue
        grid = fwd_grid(cfg, batch, seqlen_q, nheads, num_sms)
        assert_valid_grid(grid)
        assert grid[1:] == (1, 1), (where, grid)
        # Strided tile loop: CTA x takes tiles x, x + grid, ...; with 1 <= grid <= tiles every
        # tile t is taken by CTA t % grid, exactly once, and no CTA is idle. The Int32 tile index
        # ends at most at tiles - 1 + grid, which must not wrap.
        assert 1 <= grid[0] <= tiles, (where, grid, tiles)
        assert tiles - 1 + grid[0] <= MAX_INT32, (where, grid, tiles)
        ctas = min(tiles, num_sms) if cfg.persistent else tiles
        if tiles - 1 + ctas <= MAX_INT32:  # (always below 2^30 tiles) nothing to cap
            assert grid[0] == ctas, (where, grid, tiles)
        assert launch.fwd_num_tiles(cfg, batch, seqlen_q, nheads) == tiles


def _simulate_fwd_loop(grid_x, num_tiles):
    """The kernel's tile loop: tile = blockIdx.x; while tile < num_tiles: ...; tile += gridDim.x."""
    visits = []
    for cta in range(grid_x):
        t = cta
        while t < num_tiles:
            visits.append(t)
            t += grid_x
    return visits


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("num_sms", [1, 7, 132])
def test_fwd_loop_visits_every_tile_once(persistent, num_sms):
    """Small problems, simulated: each (m_block, head, batch) tile is visited exactly once."""
    for base in FWD_CONFIGS:
        cfg = dataclasses.replace(base, persistent=persistent)
        for batch, seqlen_q, nheads in itertools.product((1, 3, 65), (1, 129, 1000), (1, 5)):
            tiles = ceil_div(seqlen_q, cfg.tile_m) * nheads * batch
            grid = fwd_grid(cfg, batch, seqlen_q, nheads, num_sms)
            visits = _simulate_fwd_loop(grid[0], tiles)
            assert sorted(visits) == list(range(tiles)), (cfg, batch, seqlen_q, nheads, grid)


@pytest.mark.parametrize("persistent", [False, True])
def test_fwd_loop_index_stays_in_int32(persistent):
    """Accepted forward problems never step the Int32 tile index past 2^31 - 1: a CTA's last step
    reaches num_tiles - 1 + gridDim.x, so above 2^30 tiles the grid must shrink (still covering
    every tile through the loop)."""
    for base in FWD_CONFIGS:
        cfg = dataclasses.replace(base, persistent=persistent)
        for batch in (2**30 - 1, 2**30 + 1, 2**31 - 200, MAX_INT32):
            try:
                grid = fwd_grid(cfg, batch, 1, 1, 132)
            except ValueError:
                continue
            tiles = batch
            assert 1 <= grid[0] <= tiles and tiles - 1 + grid[0] <= MAX_INT32, (cfg, batch, grid)


@pytest.mark.parametrize("cfg", FWD_CONFIGS, ids=_fwd_id)
def test_fwd_int32_boundary(cfg):
    """2^31 tiles (or more) raise; a batch of 2^24 one-tile problems launches one CTA per tile."""
    for batch, seqlen_q, nheads in ((2**31, 1, 1), (1, cfg.tile_m * 2**31, 1), (2**30, cfg.tile_m + 1, 1),
                                    (2**24, 2**20, 128)):
        with pytest.raises(ValueError) as err:
            fwd_grid(cfg, batch, seqlen_q, nheads, 132)
        assert_names_problem(err, "forward", batch=batch, seqlen_q=seqlen_q, nheads=nheads)
    assert fwd_grid(cfg, 2**24, 1, 1, 132) == (2**24, 1, 1)
    assert fwd_grid(cfg, 65536, 32, 1, 132) == (65536, 1, 1)
    assert fwd_grid(dataclasses.replace(cfg, persistent=True), 65536, 32, 1, 132) == (132, 1, 1)


@pytest.mark.parametrize("cfg", BWD_CONFIGS, ids=_bwd_id)
def test_bwd_grid_extreme_shapes(cfg):
    for batch, seqlen_k, nheads_k in itertools.product(BATCHES, SEQLENS, NHEADS):
        ctas = ceil_div(seqlen_k, cfg.tile_n) * nheads_k * batch
        where = (batch, seqlen_k, nheads_k)
        if ctas > MAX_INT32:
            with pytest.raises(ValueError) as err:
                bwd_grid(cfg, batch, seqlen_k, nheads_k)
            assert_names_problem(err, "backward", batch=batch, seqlen_k=seqlen_k, nheads_k=nheads_k)
            assert "preprocess" not in str(err.value)
            continue
        grid = bwd_grid(cfg, batch, seqlen_k, nheads_k)
        assert_valid_grid(grid)
        # one CTA per (n_block, kv_head, batch), all of it in gridDim.x
        assert grid == (ctas, 1, 1), (where, grid, ctas)


@pytest.mark.parametrize("cfg", BWD_CONFIGS, ids=_bwd_id)
def test_bwd_int32_boundary(cfg):
    assert bwd_grid(cfg, MAX_INT32, 1, 1) == (MAX_INT32, 1, 1)
    assert bwd_grid(cfg, 65536, 32, 1) == (65536, 1, 1)
    assert bwd_grid(cfg, 65536, cfg.tile_n + 1, 3) == (65536 * 2 * 3, 1, 1)
    for batch, seqlen_k, nheads_k in ((2**31, 1, 1), (2**30, cfg.tile_n + 1, 1), (2**24, 2**20, 1)):
        with pytest.raises(ValueError) as err:
            bwd_grid(cfg, batch, seqlen_k, nheads_k)
        assert_names_problem(err, "backward", batch=batch, seqlen_k=seqlen_k, nheads_k=nheads_k)


def _check_preprocess(batch, seqlen_q, nheads):
    ctas = ceil_div(seqlen_q, ROW_TILE) * nheads * batch
    if ctas > MAX_INT32 or seqlen_q + ROW_TILE > MAX_INT32:
        with pytest.raises(ValueError) as err:
            bwd_rowwise_grid(batch, seqlen_q, nheads)
        assert_names_problem(err, "backward preprocess", batch=batch, seqlen_q=seqlen_q, nheads=nheads)
        return
    grid = bwd_rowwise_grid(batch, seqlen_q, nheads)
    assert_valid_grid(grid)
    assert grid == (ctas, 1, 1), (batch, seqlen_q, nheads, grid)  # one CTA per row tile of each (batch, head)


def test_bwd_preprocess_grid_extreme_shapes():
    for batch, seqlen_q, nheads in itertools.product(BATCHES, SEQLENS, NHEADS):
        _check_preprocess(batch, seqlen_q, nheads)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 63, 64, 65, 2**31 - 65, 2**31 - 64, 2**31 - 1, 2**31, 2**37, 2**40])
def test_bwd_preprocess_int32_boundary(rows):
    _check_preprocess(rows, 1, 1)
    if rows % 2 == 0:
        _check_preprocess(2, rows // 2, 1)
        _check_preprocess(1, 1, rows)
        _check_preprocess(1, rows, 1)


def test_issue_batch_65536_fits_every_kernel():
    """Issue 8's input (batch 65536, seqlen 32, 1 head): every kernel launches, batch only in gridDim.x."""
    for cfg in FWD_CONFIGS:
        assert fwd_grid(cfg, 65536, 32, 1, 132) == (65536, 1, 1)
    for cfg in BWD_CONFIGS:
        assert bwd_grid(cfg, 65536, 32, 1) == (65536, 1, 1)
    assert bwd_rowwise_grid(65536, 32, 1) == (65536, 1, 1)


def test_every_headdim_has_configs():
    assert {c.headdim for c in FWD_CONFIGS} == set(SUPPORTED_HEADDIMS)
    assert {c.headdim for c in BWD_CONFIGS} == set(SUPPORTED_HEADDIMS)
