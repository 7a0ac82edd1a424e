"""Decode path on the CPU: the split-KV heuristic, GQA packing, the decode plan, and compile
checks of the varlen / paged / split-KV forward configs and the combine kernel (sm_90a)."""

import pytest

from flash4.config import paged_page_rows, select_fwd_config, with_seq_layout
from flash4.config.sm90 import MAX_SPLITS, MIN_BLOCKS_PER_SPLIT, choose_num_splits, decode_plan, pack_factor


@pytest.mark.parametrize("tiles,blocks,expected", [
    (8, 1024, 16),     # 1 x 128k keys, 8 KV heads: 16 splits fill 128 of 132 SMs
    (64, 256, 2),      # 8 x 32k: 2 splits
    (512, 32, 1),      # 64 x 4k: the tiles fill the GPU already
    (106, 1000, 1),    # >= 80% of the SMs
    (8, 4, 1),         # too few key blocks to split
    (1, 100000, 128),  # capped... 132 SMs, efficiency picks the fewest near-best splits
])
def test_choose_num_splits(tiles, blocks, expected):
    got = choose_num_splits(tiles, blocks, 132)
    if expected == 128:
        assert 100 <= got <= MAX_SPLITS
    else:
        assert got == expected


def test_splits_keep_enough_blocks():
    for tiles in (1, 2, 5, 8, 33):
        for blocks in (1, 3, 8, 17, 64, 1000):
            s = choose_num_splits(tiles, blocks, 132)
            assert 1 <= s <= MAX_SPLITS
            assert s == 1 or blocks // s >= MIN_BLOCKS_PER_SPLIT


def test_pack_factor():
    assert pack_factor(32, 8, 1, causal=True) == 4  # one query sees every key: packing is exact
    assert pack_factor(32, 8, 4, causal=False) == 4
    assert pack_factor(32, 8, 4, causal=True) == 1  # causal rows would need per-row key limits
    assert pack_factor(8, 8, 1, causal=True) == 1


def test_decode_plan():
    plan = decode_plan(1, 1, 32, 8, 128, "bf16", True, 64, 131072, 0, 90, 132)
    assert plan.pack == 4 and plan.heads_p == 8 and plan.seqlen_p == 4
    assert plan.num_splits > 1 and plan.cfg.split_kv and not plan.cfg.causal
    assert plan.cfg.page_rows == paged_page_rows(64, plan.cfg.tile_n) and plan.cfg.seqused_k
    plan = decode_plan(64, 1, 32, 8, 128, "bf16", True, 0, 32768, 0, 90, 132)
    assert plan.num_splits == 1 and not plan.cfg.split_kv and plan.cfg.page_rows == 0
    plan = decode_plan(2, 3, 8, 8, 64, "bf16", True, 0, 512, 5, 90, 132)
    assert plan.pack == 1 and plan.cfg.causal and plan.num_splits == 4  # 5 asked, clamped to the 4 key blocks


def test_paged_page_rows():
    assert paged_page_rows(16, 128) == 16
    assert paged_page_rows(256, 128) == 128
    assert paged_page_rows(64, 80) == 16
    for bad in (1, 4, 12, 0):
        with pytest.raises(ValueError, match="page_size"):
            paged_page_rows(bad, 128)


cutlass = pytest.importorskip("cutlass")


def _layouts():
    base = select_fwd_config(128, "bf16", causal=True)
    return [
        with_seq_layout(base, varlen_q=True, varlen_k=True),
        with_seq_layout(base, varlen_q=True, seqused_k=True, page_rows=16),
        with_seq_layout(select_fwd_config(64, "bf16", causal=False), seqused_k=True, split_kv=True),
        with_seq_layout(select_fwd_config(256, "bf16", causal=False), seqused_k=True, split_kv=True, page_rows=16),
    ]


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.check import compile_check

    return compile_check(_layouts())


@pytest.mark.parametrize("i", range(4), ids=["varlen", "paged16", "split_d64", "split_paged_d256"])
def test_seq_layout_configs_compile(rows, i, compiled_clean):
    row = rows[i]
    compiled_clean(row)
    assert row["utmaldg"] > 0
    assert row["compile_s"] < 10.0


def test_combine_compiles():
    from flash4.compile.cache import get_combine_runner

    get_combine_runner.cache_clear()
    assert callable(get_combine_runner(128, "bf16"))


def test_compile_counts_count_new_kernels_only():
    from flash4.compile import cache as compile_cache
    from flash4.compile.cache import compile_counts

    before = compile_counts()
    compile_cache.get_combine_runner.cache_clear()
    compile_cache.get_combine_runner(64, "bf16")  # a new kernel in this process: compiled or loaded
    mid = compile_counts()
    assert sum(mid.values()) == sum(before.values()) + 1
    compile_cache.get_combine_runner(64, "bf16")  # cached: nothing new
    assert compile_counts() == mid


def test_varlen_bench_cells():
    from flash4.bench.varlen import VARLEN_COLUMNS, varlen_fwd_flops, varlen_lengths, varlen_table

    lengths = varlen_lengths()
    assert sum(lengths) == 65536 and all(1 <= n <= 16384 for n in lengths)
    assert varlen_lengths() == lengths  # fixed seed
    assert varlen_fwd_flops([4], 2, 8, causal=True) == 4.0 * 2 * 8 * 10
    assert varlen_fwd_flops([4], 2, 8, causal=False) == 4.0 * 2 * 8 * 16
    rows = [dict(zip(VARLEN_COLUMNS, r)) for r in (
        ("flash4", "varlen_x", 128, 1, 10, 500.0, 400.0, None, 4000.0),
        ("flash_attn_4", "varlen_x", 128, 1, 10, 600.0, 500.0, None, 4000.0),
        ("flash4", "decode_b1_4k", 128, 1, 1, None, None, 2000.0, 4000.0),
        ("flash_attn_4", "decode_b1_4k", 128, 1, 1, None, None, 1000.0, 4000.0),
    )]
    headers, table = varlen_table(rows)
    assert headers[-1] == "flash4/flash_attn_4"
    by = {(r[0], r[1]): r for r in table}
    assert by[("decode_b1_4k", "% copy bw")][2] == 50.0 and by[("decode_b1_4k", "% copy bw")][-1] == 2.0
    assert abs(by[("varlen_x", "fwd TFLOPs")][-1] - 500 / 600) < 1e-12
