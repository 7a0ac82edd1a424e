"""GQA/MQA backward head split (issue 11, item 1) on the CPU: the heads-per-CTA rule, the config it
selects, the grid, the environment override and the host-side buffers (no GPU, no CuTe DSL)."""

import pytest
import torch

from flash4 import env
from flash4.backward import dkv_targets
from flash4.config import BwdConfig, bwd_heads_per_cta, mean_queries_per_key, select_bwd_config, with_dkv_accum
from flash4.config.sm90 import head_split_config
from flash4.launch import bwd_grid, bwd_num_splits


@pytest.mark.parametrize("nheads, nheads_k, expected", [
    (16, 16, 1), (8, 4, 1), (6, 2, 1), (8, 2, 2), (64, 8, 2), (32, 1, 2), (0, 1, 0)])
def test_heads_per_cta_rule(nheads, nheads_k, expected):
    assert bwd_heads_per_cta(nheads, nheads_k) == expected


@pytest.mark.parametrize("queries, expected", [(None, 2), (1023.9, 8), (1024, 2), (4096, 2), (0, 8)])
def test_split_only_long_work(queries, expected):
    assert bwd_heads_per_cta(64, 8, None, queries) == expected


@pytest.mark.parametrize("sq, sk, causal, window, expected", [
    (1024, 1024, False, None, 1024), (1024, 1024, True, None, 512), (4096, 4096, True, None, 2048),
    (100, 1000, True, None, (900 * 100 + 100 * 100 / 2) / 1000), (1000, 100, True, None, 50),
    (8192, 8192, True, (127, 0), 128), (8192, 8192, False, (511, 511), 1023), (100, 8192, False, (4095, 0), 100),
    (0, 10, False, None, 0), (10, 0, True, None, 0)])
def test_mean_queries_per_key(sq, sk, causal, window, expected):
    assert mean_queries_per_key(sq, sk, causal, window) == pytest.approx(expected)


def test_mean_queries_per_key_matches_geometry():
    from flash4 import geometry

    for sq, sk in ((300, 300), (200, 700), (700, 200)):
        exact = sum(max(0, geometry.key_limit(i, sq, sk, True) - geometry.key_start(i, sq, sk)) for i in range(sq))
        assert mean_queries_per_key(sq, sk, True) == pytest.approx(exact / sk, rel=0.01)


def test_override_is_clipped_to_the_group():
    assert bwd_heads_per_cta(32, 1, 5) == 5
    assert bwd_heads_per_cta(32, 1, 99) == 32
    assert bwd_heads_per_cta(4, 4, 3) == 1


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dkv_accum_config(d, causal):
    cfg = select_bwd_config(d, "bf16", causal)
    assert with_dkv_accum(cfg, 8, 8, 1) is cfg  # MHA: unchanged
    assert with_dkv_accum(cfg, 8, 2, 4) is cfg  # the whole group per CTA: no split
    split = with_dkv_accum(cfg, 8, 2, 2)
    assert split.dkv_accum and split.tile_n == cfg.tile_n and split.q_stages == cfg.q_stages
    assert split.tile_m == cfg.tile_m  # d64's 128-query step too (0 spills; faster on the H200)
    assert isinstance(split, BwdConfig) and split.smem_bytes() <= cfg.smem_bytes()


def test_varlen_deterministic_keeps_one_cta_per_kv_head():
    from flash4.config import with_seq_layout

    det = with_seq_layout(select_bwd_config(128, "bf16", True, deterministic=True), varlen_q=True, varlen_k=True)
    assert with_dkv_accum(det, 8, 2, 1) is det
    fast = with_seq_layout(select_bwd_config(128, "bf16", True), varlen_q=True, varlen_k=True)
    assert with_dkv_accum(fast, 8, 2, 1).dkv_accum
    assert with_dkv_accum(select_bwd_config(128, "bf16", True, deterministic=True), 8, 2, 1).dkv_accum


def test_windows_keep_one_cta_per_kv_head():
    local = select_bwd_config(128, "bf16", True, local=True)
    assert with_dkv_accum(local, 8, 2, 1) is local


def test_grid_has_a_cta_per_split():
    cfg = with_dkv_accum(select_bwd_config(128, "bf16", True), 32, 8, 1)
    assert bwd_num_splits(cfg, 32, 8, 1) == 4 and bwd_num_splits(cfg, 32, 8, 3) == 2
    assert bwd_grid(cfg, 2, 1000, 8, 4) == (8 * 4 * 8 * 2, 1, 1)  # n_blocks x splits x Hk x batch
    plain = select_bwd_config(128, "bf16", True)
    assert bwd_num_splits(plain, 32, 8, 4) == 1 and bwd_grid(plain, 2, 1000, 8) == (8 * 8 * 2, 1, 1)


def test_env_override(monkeypatch):
    monkeypatch.delenv("FLASH4_BWD_HEADS_PER_CTA", raising=False)
    assert env.bwd_heads_per_cta_override() is None
    monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", "3")
    assert env.bwd_heads_per_cta_override() == 3
    args = (32, 1, 100, 100, True, None)  # short: the default would not split; the override does
    override = env.bwd_heads_per_cta_override()  # what flash4.backward passes to the plan
    split = (with_dkv_accum(select_bwd_config(128), 32, 1, 3), 3)
    assert head_split_config(select_bwd_config(128), *args, override) == split
    assert head_split_config(select_bwd_config(128), *args) == (select_bwd_config(128), 32)  # no override: no split
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", bad)
        with pytest.raises(ValueError, match="FLASH4_BWD_HEADS_PER_CTA"):
            env.bwd_heads_per_cta_override()


def test_dkv_targets():
    dk, dv = torch.randn(2, 100, 2, 128), torch.randn(2, 100, 2, 64)
    plain = select_bwd_config(128, "bf16", True)
    tk, tv, sem, finish = dkv_targets(plain, dk, dv, 4)
    assert tk is dk and tv is dv and sem is None
    for det in (False, True):
        cfg = with_dkv_accum(select_bwd_config(128, "bf16", True, deterministic=det), 8, 2, 1)
        tk, tv, sem, finish = dkv_targets(cfg, dk, dv, 4)
        assert tk.dtype == tv.dtype == torch.float32 and tk.shape == dk.shape and tv.shape == dv.shape
        assert bool((tk == 0).all()) and (sem is None) == (not det)
        if det:
            assert sem.dtype == torch.int32 and sem.shape == (4,) and bool((sem == 0).all())
        tk.fill_(1.5)
        tv.fill_(-2.0)
        finish()
        assert bool((dk == 1.5).all()) and bool((dv == -2.0).all())
