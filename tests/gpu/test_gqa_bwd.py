"""GQA/MQA backward with the query heads of a KV head split over CTAs (BwdConfig.dkv_accum): each
CTA adds its fp32 dK, dV into zeroed accumulators, the host converts them (issue 11, item 1).

Every heads-per-CTA choice (FLASH4_BWD_HEADS_PER_CTA: 1 = the default, 2, 3 (not dividing the
group: a short last split), the whole group = no split) against the float32 reference with the
2x-PyTorch rule and NaN-poisoned dq/dk/dv; key counts that end inside a key tile (the accumulating
epilogue skips rows past seqlen_k); deterministic mode bitwise across calls with splits; varlen.
"""

import pytest
import torch

from flash4.config import bwd_heads_per_cta

from gpu_helpers import check_bwd, check_deterministic


@pytest.mark.parametrize("heads_per_cta", [1, 2, 3, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_heads_per_cta(d, causal, heads_per_cta, monkeypatch):
    monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", str(heads_per_cta))
    check_bwd(2, 1000, 1000, 16, 2, d, causal)  # GQA 8:1, 1000 keys: the last key tile is partial


@pytest.mark.parametrize("sq,sk", [(17, 1000), (1000, 17), (129, 1), (1, 129), (4096, 333)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rect_mqa(sq, sk, causal, monkeypatch):
    monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", "1")  # split at every shape (the default keeps short ones whole)
    check_bwd(1, sq, sk, 8, 1, 128, causal)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_every_headdim_fp16(d, monkeypatch):
    monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", "2")
    check_bwd(2, 333, 555, 8, 2, d, True, dtype=torch.float16)


def test_dv_pair(monkeypatch):
    """(192, 128): the transposed-dK/dV kernel's accumulating epilogue with Dv != D."""
    monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", "1")
    from gpu_helpers import check_bwd_dv, inputs

    q, k, v, dout = inputs(2, 500, 700, 8, 2, 192, 128, seed=9)
    check_bwd_dv(q, k, v, dout, True)


def test_mqa_32_heads_long():
    check_bwd(1, 4096, 4096, 32, 1, 64, True)


@pytest.mark.parametrize("heads_per_cta", [1, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_bitwise_with_splits(causal, heads_per_cta, monkeypatch):
    """deterministic=True with split heads: the splits add in order 0, 1, ..., so 30 calls are
    bitwise equal (and right)."""
    monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", str(heads_per_cta))
    assert bwd_heads_per_cta(8, 1, heads_per_cta) == heads_per_cta
    check_deterministic(2, 1000, 8, 1, 128, causal, calls=30, seed=5)


@pytest.mark.parametrize("heads_per_cta", [1, 2, 4])
def test_varlen_splits(heads_per_cta, monkeypatch):
    """Packed sequences: the accumulating epilogue writes each sequence's rows only (rows outside
    every sequence stay 0)."""
    from gpu_helpers import check_grads_varlen as check_grads, make_varlen, rand_lengths, run_bwd_varlen as run_bwd

    monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", str(heads_per_cta))
    len_q = rand_lengths(5, 700, seed=41)
    len_k = rand_lengths(5, 700, seed=42, must=(1, 0))
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 8, 2, 128, seed=3, pad_q=3, pad_k=5)
    dout = torch.randn_like(q)
    got = run_bwd(q, k, v, cu_q, cu_k, dout, True)
    check_grads(got, q, k, v, cu_q, cu_k, dout, True)
    assert (got[1][-5:] == 0).all() and (got[2][-5:] == 0).all()


def test_default_splits_long_gqa_only():
    """The default heads-per-CTA choice splits long GQA/MQA work and leaves MHA and short work whole;
    the whole-group path (one CTA per KV head, bf16 dK/dV stores) stays right for GQA too."""
    assert bwd_heads_per_cta(16, 16) == 1
    assert bwd_heads_per_cta(32, 1, queries_per_key=2048) < 32
    assert bwd_heads_per_cta(64, 8, queries_per_key=512) == 8
    check_bwd(2, 1000, 1000, 16, 2, 128, True)  # 500 queries per key: not split
