"""Sliding-window attention (issue 10) on the CPU: the reference oracle's window mask against the
rule as stated, the configs a window selects, and compile checks of the local forward and backward
kernels (sm_90a, no spills). The band's block ranges are tested in test_geometry.py."""

import pytest
import torch

from flash4.config import select_bwd_config, select_fwd_config
from flash4.reference import attention_ref, causal_mask, window_mask


@pytest.mark.parametrize("sq, sk", [(5, 7), (7, 5), (1, 9), (9, 1), (16, 16)])
@pytest.mark.parametrize("window", [(0, 0), (2, 0), (0, 3), (-1, 0), (3, -1), (1, 1), (-1, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_mask_is_the_rule(sq, sk, window, causal):
    left, right = window
    if causal:
        right = 0
    off = sk - sq
    want = torch.tensor([[(left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
                          for j in range(sk)] for i in range(sq)])
    assert torch.equal(window_mask(sq, sk, window, causal), want)


def test_minus_one_is_per_side():
    assert torch.equal(window_mask(6, 9, (-1, 0)), causal_mask(6, 9))


def test_reference_rows_without_keys():
    k = torch.randn(1, 6, 2, 8)
    # window (0, 0) with sq > sk: rows i < sq - sk see no key
    out, lse = attention_ref(torch.randn(1, 6, 1, 8), k[:, :3, :1], k[:, :3, :1], window_size=(0, 0))
    assert torch.isneginf(lse[0, 0, :3]).all() and (out[0, :3] == 0).all() and torch.isfinite(lse[0, 0, 3:]).all()


def test_window_configs():
    cfg = select_fwd_config(128, "bf16", causal=True, local=True)
    assert cfg.local and not cfg.causal and not cfg.lpt
    bcfg = select_bwd_config(64, "bf16", causal=True, local=True)
    assert bcfg.local and not bcfg.causal and bcfg.tile_m == 64  # 128 spills with the third masked loop


pytest.importorskip("cutlass")


def _configs():
    return [
        select_fwd_config(64, "bf16", False, local=True),
        select_fwd_config(128, "bf16", True, local=True),
        select_fwd_config(256, "bf16", False, local=True),
        select_bwd_config(64, "bf16", True, local=True),
        select_bwd_config(128, "bf16", False, local=True, deterministic=True),
        select_bwd_config(256, "bf16", True, local=True),
    ]


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.check import compile_check

    return compile_check(_configs())


@pytest.mark.parametrize("i", range(6), ids=["fwd64", "fwd128", "fwd256", "bwd64", "bwd128det", "bwd256"])
def test_local_kernels_compile(rows, i, compiled_clean):
    row = rows[i]
    compiled_clean(row)
