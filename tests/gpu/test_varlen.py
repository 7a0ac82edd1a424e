"""Varlen attention on the GPU: packed sequences through flash_attn_varlen_func (cu_seqlens, seqused;
marker gpu; skipped without CUDA).

Criterion (flash4.reference): per sequence against the float32 reference, max |x - ref| <= 2 *
max |PyTorch same-dtype - ref| + atol, for out, lse and dq/dk/dv. out/lse (and dq/dk/dv) are
preallocated NaN-filled, so an element the kernels should write and do not fails; query rows
outside every sequence (past cu_seqlens_q[-1] or seqused_q) must stay unwritten (NaN).
Coverage: random lengths 0..4096 incl. 0 and 1 (fixed seeds), batch 1..64, every head dim, causal
and not, GQA 8:1 and MQA, seqused shorter than the stored lengths, sequences without keys, the
public function against the hook, the seqlens checks on device tensors, backward (GQA/MQA with
seqused, deterministic bitwise, a loss on the LSE through the public function), and no recompiles
over 50 random varlen steps (forward and backward).
Paged K/V: test_paged.py; the KV cache (decode): test_kvcache.py. The checks (check_fwd_varlen,
run_bwd_varlen, ...) are in gpu_helpers.py, shared with those and with test_gqa_bwd.py.
"""

import random

import pytest
import torch

from flash4 import flash_attn_varlen_func
from flash4.config import SUPPORTED_HEADDIMS

from gpu_helpers import (DEV, I32, check_fwd_varlen as check_fwd, check_grads_varlen as check_grads, compile_count,
                         make_varlen, rand_lengths, run_bwd_varlen as run_bwd, run_poisoned_varlen as run_poisoned)


# ================================================================ forward
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_every_headdim(d, causal):
    len_q = rand_lengths(7, 1100, seed=d)
    len_k = rand_lengths(7, 1100, seed=d + 1, must=(1, 0))
    check_fwd(*make_varlen(len_q, len_k, 4, 2, d, seed=d, pad_q=5, pad_k=3), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_long_sequences(d, causal):
    """Lengths up to 4096, len_q > len_k (causal rows without keys far past the first tile) and a
    single query against 4096 keys, next to empty sequences."""
    len_q, len_k = [4096, 0, 2999, 1, 3000], [4096, 5, 1000, 4096, 0]
    check_fwd(*make_varlen(len_q, len_k, 2, 1, d, seed=11), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch", [1, 64])
def test_batch_sizes(batch, causal):
    max_len = 4096 if batch == 1 else 400
    len_q = rand_lengths(batch, max_len, seed=batch, must=(max_len,) if batch == 1 else (0, 1))
    len_k = rand_lengths(batch, max_len, seed=batch + 7, must=(max_len - 3,) if batch == 1 else (1, 0, 129))
    check_fwd(*make_varlen(len_q, len_k, 2, 2, 128, seed=batch), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, hk", [(16, 2), (8, 1)], ids=["gqa8", "mqa"])
def test_gqa_mqa(h, hk, causal):
    len_q = rand_lengths(5, 700, seed=h)
    len_k = rand_lengths(5, 700, seed=h + 1)
    check_fwd(*make_varlen(len_q, len_k, h, hk, 128, seed=h), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqused_shorter_than_stored(causal):
    """seqused_q / seqused_k below the stored lengths: the tail queries stay unwritten, the tail keys
    (real data of the packed tensor) are masked."""
    len_q, len_k = [300, 129, 0, 1000, 64], [500, 129, 7, 1000, 1]
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 4, 2, 128, seed=3, pad_q=9)
    seqused_q = torch.tensor([299, 1, 0, 513, 64], dtype=I32, device=DEV)
    seqused_k = torch.tensor([130, 0, 7, 999, 1], dtype=I32, device=DEV)
    check_fwd(q, k, v, cu_q, cu_k, causal, seqused_q=seqused_q, seqused_k=seqused_k)
    check_fwd(q, k, v, cu_q, cu_k, causal, seqused_k=seqused_k)
    check_fwd(q, k, v, cu_q, cu_k, causal, seqused_q=seqused_q)


def test_fp16_and_softmax_scale():
    len_q, len_k = [17, 0, 333], [555, 1, 128]
    check_fwd(*make_varlen(len_q, len_k, 4, 2, 128, dtype=torch.float16, seed=2), True, softmax_scale=0.05)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_keys(causal):
    """Sequences without keys give out = 0, lse = -inf, whether K has storage (kernel path) or not."""
    q, k, v, cu_q, cu_k = make_varlen([3, 0, 130], [0, 0, 0], 4, 2, 64, pad_k=64)
    out, lse = check_fwd(q, k, v, cu_q, cu_k, causal)
    assert (out == 0).all() and torch.isneginf(lse).all()
    out, lse = check_fwd(q, k[:0], v[:0], cu_q, cu_k, causal)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_public_api_matches_hook(causal):
    len_q, len_k = [100, 0, 333, 1], [200, 3, 333, 50]
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 8, 2, 128, seed=4)
    out_hook, lse_hook = run_poisoned(q, k, v, cu_q, cu_k, causal)
    for max_seqlen_q in (333, 4096, torch.tensor(333, device=DEV), torch.tensor(333), None):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q, 333, causal=causal, return_lse=True)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (8, q.shape[0]) and lse.dtype == torch.float32
        assert torch.equal(out, out_hook) and torch.equal(lse, lse_hook)


def test_check_seqlens_on_device_tensors():
    q, k, v, cu_q, cu_k = make_varlen([3, 4], [5, 6], 2, 2, 64)
    bad = cu_k.clone()
    bad[1] = 12
    with pytest.raises(ValueError, match=r"cu_seqlens_k is not non-decreasing: cu_seqlens_k\[1\]=12"):
        flash_attn_varlen_func(q, k, v, cu_q, bad, check_seqlens=True)
    with pytest.raises(TypeError, match="cu_seqlens_q.dtype is torch.int64"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_k is on cpu but q is on cuda"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k.cpu())


# ================================================================ backward
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_backward_every_headdim(d, causal):
    """dq/dk/dv vs the float32 reference; rows outside every sequence (pad rows of q and k) get 0."""
    len_q = rand_lengths(5, 400, seed=100 + d)
    len_k = rand_lengths(5, 400, seed=200 + d, must=(1, 0))
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 4, 2, d, seed=d, pad_q=3, pad_k=5)
    dout = torch.randn_like(q)
    got = run_bwd(q, k, v, cu_q, cu_k, dout, causal)
    check_grads(got, q, k, v, cu_q, cu_k, dout, causal)
    assert (got[0][-3:] == 0).all() and (got[1][-5:] == 0).all() and (got[2][-5:] == 0).all()


@pytest.mark.parametrize("h, hk", [(16, 2), (8, 1)], ids=["gqa8", "mqa"])
def test_backward_gqa_mqa_seqused(h, hk):
    len_q, len_k = [300, 0, 129, 1000], [500, 64, 128, 999]
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, h, hk, 128, seed=h)
    seqused_q = torch.tensor([250, 0, 129, 1], dtype=I32, device=DEV)
    seqused_k = torch.tensor([400, 0, 128, 998], dtype=I32, device=DEV)
    dout = torch.randn_like(q)
    got = run_bwd(q, k, v, cu_q, cu_k, dout, True, seqused_q, seqused_k)
    check_grads(got, q, k, v, cu_q, cu_k, dout, True, seqused_q, seqused_k)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_deterministic_is_bitwise(causal):
    len_q, len_k = rand_lengths(8, 1500, seed=31), rand_lengths(8, 1500, seed=32)
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 8, 2, 128, seed=7)
    dout = torch.randn_like(q)
    first = run_bwd(q, k, v, cu_q, cu_k, dout, causal, deterministic=True)
    check_grads(first, q, k, v, cu_q, cu_k, dout, causal)
    for _ in range(10):
        again = run_bwd(q, k, v, cu_q, cu_k, dout, causal, deterministic=True)
        for g0, g1 in zip(first, again):
            assert torch.equal(g0, g1)


def test_public_autograd_with_lse_loss():
    """flash_attn_varlen_func trains: out and lse both carry gradients (dlse into dq/dk); max_seqlen_k
    None is resolved in the backward."""
    len_q, len_k = [200, 1, 0, 333], [300, 129, 5, 333]
    q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 8, 2, 64, seed=13)
    dout = torch.randn_like(q)
    dlse = torch.randn(8, q.shape[0], device=DEV)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_varlen_func(*leaves, cu_q, cu_k, 333, causal=True, return_lse=True)
    assert out.requires_grad and lse.requires_grad
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    check_grads([t.grad for t in leaves], q, k, v, cu_q, cu_k, dout, True, dlse=dlse)


# ================================================================ no recompiles
def test_fifty_varlen_steps_compile_nothing_new():
    """Random batch sizes, lengths, max_seqlen (int, rounded-up int, CUDA tensor, None), forward and
    backward: one compile per config, none in the 50 steps after the first."""
    rng = random.Random(0)

    def step(i, len_q, len_k):
        q, k, v, cu_q, cu_k = make_varlen(len_q, len_k, 4, 2, 128, seed=i)
        max_q = [max(len_q), 1024, torch.tensor(max(len_q), device=DEV), None][i % 4]
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, [max(len_k), None][i % 2], causal=True)
        out.backward(torch.ones_like(out))

    step(0, [300, 0, 1], [200, 5, 129])  # compiles (or loads) the forward and backward configs
    torch.cuda.synchronize()
    before = compile_count()
    assert before > 0, "no functools-cached compile entry point found: the counter would count nothing"
    for i in range(1, 51):
        batch = rng.randint(1, 16)
        step(i, rand_lengths(batch, 600, seed=1000 + i), rand_lengths(batch, 600, seed=2000 + i))
    torch.cuda.synchronize()
    assert compile_count() == before
