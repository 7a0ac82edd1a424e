"""Logit soft-capping (issue 10 item 2) on the CPU: the reference's cap and the compile checks of
the softcap forward and backward kernels (sm_90a, no spills; not yet run on a GPU)."""

import pytest
import torch

from flash4.config import select_bwd_config, select_fwd_config
from flash4.reference import attention_ref


def test_reference_caps_the_scaled_scores():
    q, k = torch.randn(1, 3, 1, 4) * 30, torch.randn(1, 5, 1, 4) * 30
    _, lse = attention_ref(q, k, k, softmax_scale=1.0, softcap=7.0)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    assert torch.allclose(lse, torch.logsumexp(7.0 * torch.tanh(scores / 7.0), dim=-1), atol=1e-5)
    assert (lse <= 7.0 + torch.log(torch.tensor(5.0)) + 1e-5).all()


def test_softcap_configs():
    assert select_fwd_config(128, "bf16", True, softcap=True).softcap
    # a window and softcap together spill the 3-warpgroup d64 tile: two warpgroups there
    assert select_fwd_config(64, "bf16", False, local=True, softcap=True).tile_m == 128
    assert select_bwd_config(64, "bf16", True, softcap=True).tile_m == 64


pytest.importorskip("cutlass")


def _configs():
    return [
        select_fwd_config(128, "bf16", False, softcap=True),
        select_fwd_config(64, "bf16", True, softcap=True),
        select_fwd_config(64, "bf16", False, local=True, softcap=True),
        select_bwd_config(128, "bf16", True, softcap=True),
        select_bwd_config(64, "bf16", False, softcap=True, local=True),
        select_bwd_config(256, "bf16", True, softcap=True),
    ]


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.check import compile_check

    return compile_check(_configs())


@pytest.mark.parametrize("i", range(6), ids=["fwd128", "fwd64c", "fwd64local", "bwd128c", "bwd64local", "bwd256c"])
def test_softcap_kernels_compile(rows, i, compiled_clean):
    row = rows[i]
    compiled_clean(row)
