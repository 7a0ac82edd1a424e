"""The flash4:: custom ops called with CPU tensors raise flash4's ValueError naming the argument,
not the dispatcher's "Could not run ... with arguments from the 'CPU' backend"."""

import pytest
import torch

import flash4  # noqa: F401 - registers the ops


def _qkv():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    return q, q.clone(), q.clone()


def test_fwd_names_q():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"flash4::fwd: q is on cpu; flash4 runs on CUDA tensors only"):
        torch.ops.flash4.fwd(q, k, v, 0.125, False, False)


def test_varlen_fwd_names_q():
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"flash4::varlen_fwd: q is on cpu"):
        torch.ops.flash4.varlen_fwd(q, q, q, cu, cu, None, None, None, 8, 8, 0.125, False, False, False)


def test_kvcache_names_q():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"flash4::kvcache: q is on cpu"):
        torch.ops.flash4.kvcache(q, k, v, None, None, None, 8, None, None, 0.125, True, 1, False)


def test_the_public_function_says_the_same():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q is on cpu; flash4 runs on CUDA tensors only"):
        flash4.flash_attn_func(q, k, v)
