"""Tests of the pure-Python forward tile scheduler model (flash4.schedule).

Loaded by path: the module is pure Python, so these tests need neither torch nor the CuTe DSL.
"""

import importlib.util
import itertools
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "schedule", Path(__file__).resolve().parents[2] / "src/flash4/schedule.py"
)
sched = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sched)

# (num_m_blocks, num_heads, batch, heads_per_l2_group): even sections, a short last section,
# a group larger than all pairs, no grouping.
SHAPES = [(8, 4, 2, 2), (5, 6, 1, 4), (3, 3, 2, 16), (7, 5, 3, None), (1, 1, 1, None), (16, 16, 2, 4)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal, lpt", list(itertools.product([False, True], [False, True])))
def test_every_tile_exactly_once(shape, causal, lpt):
    m, h, b, g = shape
    order = sched.tile_order(m, h, b, causal=causal, lpt=lpt, heads_per_l2_group=g)
    assert len(order) == m * h * b
    assert set(order) == set(itertools.product(range(m), range(h), range(b)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal, lpt", list(itertools.product([False, True], [False, True])))
def test_closed_form_matches_order(shape, causal, lpt):
    m, h, b, g = shape
    order = sched.tile_order(m, h, b, causal=causal, lpt=lpt, heads_per_l2_group=g)
    coords = [sched.tile_coords(t, m, h, b, causal=causal, lpt=lpt, heads_per_l2_group=g) for t in range(len(order))]
    assert coords == order


def test_plain_order_is_grid_order():
    order = sched.tile_order(3, 2, 2, causal=True, lpt=False)
    assert order == [(m, h, b) for b in range(2) for h in range(2) for m in range(3)]


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(4096, 4096), (3000, 4096), (4096, 1000), (1000, 1000)])
@pytest.mark.parametrize("group", [None, 3, 4])
def test_lpt_non_increasing_within_section(seqlen_q, seqlen_k, group):
    tile_m = tile_n = 128
    m, h, b = -(-seqlen_q // tile_m), 3, 2
    order = sched.tile_order(m, h, b, causal=True, lpt=True, heads_per_l2_group=group)
    costs = [sched.work(t[0], seqlen_q, seqlen_k, tile_m, tile_n, True) for t in order]
    per_section = min(group or 1, h * b) * m
    for start in range(0, len(costs), per_section):
        sec = costs[start : start + per_section]
        assert all(x >= y for x, y in zip(sec, sec[1:])), sec


def test_work():
    assert sched.work(0, 1000, 4096, 128, 128, False) == 32
    assert [sched.work(i, 512, 512, 128, 128, True) for i in range(4)] == [1, 2, 3, 4]
    # bottom-right: 256 queries against 1024 keys, the last query row sees every key
    assert [sched.work(i, 256, 1024, 128, 128, True) for i in range(2)] == [7, 8]
    # more queries than keys: the first rows see no key at all
    assert [sched.work(i, 512, 128, 128, 128, True) for i in range(4)] == [0, 0, 0, 1]
    assert sched.work(1, 200, 200, 128, 64, True) == 4  # partial last block: rows 128..199


def test_l2_section_heads():
    assert sched.l2_section_heads(16384, 128) == 4  # K+V = 8 MiB per head -> 6 fit -> 4
    assert sched.l2_section_heads(16384, 64) == 8
    assert sched.l2_section_heads(16384, 256) == 2
    assert sched.l2_section_heads(1 << 20, 256) == 1


def test_makespan_small():
    order = [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    cost = {0: 3, 1: 2, 2: 2}
    assert sched.makespan(order, 2, lambda t: cost[t[0]]) == 4  # 3 | 2+2
    assert sched.makespan(order, 2, lambda t: cost[t[0]], dynamic=False) == 5  # 3+2 | 2


def test_lpt_makespan_causal_16k():
    """Causal S = 16k, B = 2, H = 16, 128 x 128 tiles, 132 SMs: LPT (with L2 sections) beats the
    plain grid order and is within 4/3 of the lower bound (measured: 2003 vs 2076, bound 2001.5)."""
    seqlen, batch, heads, tile, workers = 16384, 2, 16, 128, 132
    m = seqlen // tile
    group = sched.l2_section_heads(seqlen, 128)

    def cost(t):
        return sched.work(t[0], seqlen, seqlen, tile, tile, True)

    lpt = sched.tile_order(m, heads, batch, causal=True, lpt=True, heads_per_l2_group=group)
    plain = sched.tile_order(m, heads, batch, causal=True, lpt=False)
    bound = sched.lower_bound(lpt, workers, cost)
    for dynamic in (True, False):
        span_lpt = sched.makespan(lpt, workers, cost, dynamic=dynamic)
        span_plain = sched.makespan(plain, workers, cost, dynamic=dynamic)
        assert span_lpt <= span_plain, (dynamic, span_lpt, span_plain)
        assert span_lpt <= 4 / 3 * bound, (dynamic, span_lpt, bound)
    assert sched.makespan(lpt, workers, cost) <= 1.01 * bound  # greedy LPT is near optimal here
