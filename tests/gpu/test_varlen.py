"""Varlen, paged and KV-cache attention on the GPU (marker gpu; skipped without CUDA).

Criterion (flash4.reference): per sequence against the float32 reference, max |x - ref| <= 2 *
max |PyTorch same-dtype - ref| + atol, for out, lse and dq/dk/dv. out/lse (and dq/dk/dv) are
preallocated NaN-filled, so an element the kernels should write and do not fails; query rows
outside every sequence (past cu_seqlens_q[-1] or seqused_q) must stay unwritten (NaN).
Coverage: random lengths 0..4096 incl. 0 and 1 (fixed seeds), batch 1..64, every head dim, causal
and not, GQA 8:1 and MQA, seqused shorter than the stored lengths, paged K/V at page sizes
8..256 bitwise equal to the same data contiguous, the interleaved K/V cache layouts (vLLM),
decode against caches of 1..64k keys with an in-place append, backward (deterministic bitwise),
no recompiles over 50 random varlen / decode steps, and a decode step replayed from a CUDA graph.
"""

import math
import random

import pytest
import torch

from flash4 import flash_attn_varlen_func, flash_attn_with_kvcache
from flash4.api import _flash_attn_varlen_backward, _flash_attn_varlen_forward
from flash4.config import SUPPORTED_HEADDIMS
from flash4.reference import (attention_varlen_ref, gather_paged, kvcache_ref, max_abs_err, paged_kv_cache,
                              varlen_fwd_errors, varlen_row_mask)
from flash4.validate import check_varlen_inputs

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, I32 = torch.bfloat16, torch.int32
GRAD_ATOL = 1e-3


@pytest.fixture(autouse=True, scope="module")
def _sm90_only():
    from flash4.arch import device_arch

    if torch.cuda.is_available() and device_arch() != 90:
        pytest.skip(f"flash4 has kernels for sm_90 only; this GPU is sm_{device_arch()}")


# ---------------------------------------------------------------- inputs
def rand_lengths(batch: int, max_len: int, seed: int, must=(0, 1)) -> list[int]:
    """batch lengths in [0, max_len], with each value of `must` at a random position (batch allowing)."""
    rng = random.Random(seed)
    lengths = [rng.randint(0, max_len) for _ in range(batch)]
    slots = rng.sample(range(batch), min(batch, len(must)))
    for slot, value in zip(slots, must):
        lengths[slot] = value
    return lengths


def cu(lengths) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=I32, device=DEV)


def make_varlen(len_q, len_k, h, hk, d, dtype=BF16, seed=0, pad_q=0, pad_k=0):
    """Packed q (sum(len_q) + pad_q, h, d), k/v (sum(len_k) + pad_k, hk, d) and cu_seqlens (the pad
    rows lie past cu_seqlens[-1]: outside every sequence)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(sum(len_q) + pad_q, h, d, generator=gen, device=DEV, dtype=dtype)
    k = torch.randn(sum(len_k) + pad_k, hk, d, generator=gen, device=DEV, dtype=dtype)
    v = torch.randn(sum(len_k) + pad_k, hk, d, generator=gen, device=DEV, dtype=dtype)
    return q, k, v, cu(len_q), cu(len_k)


def _max_len(cu_seqlens, seqused):
    lengths = seqused if seqused is not None else cu_seqlens[1:] - cu_seqlens[:-1]
    return int(lengths.max().item()) if lengths.numel() else 0


def run_poisoned(q, k, v, cu_q, cu_k, causal, seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None):
    """The forward into NaN-filled out/lse (the hook flash_attn_varlen_func uses)."""
    total_q, h, d = q.shape
    check_varlen_inputs(q, k, v, cu_q, cu_k, None, None, seqused_q, seqused_k, page_table, softmax_scale, causal)
    out = torch.full((total_q, h, d), math.nan, dtype=q.dtype, device=DEV)
    lse = torch.full((h, total_q), math.nan, dtype=torch.float32, device=DEV)
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    res = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, _max_len(cu_q, seqused_q), scale, causal, seqused_q,
                                     seqused_k, page_table, out=out, lse=lse)
    assert res[0] is out and res[1] is lse
    torch.cuda.synchronize()
    return out, lse


def check_fwd(q, k, v, cu_q, cu_k, causal, seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None):
    out, lse = run_poisoned(q, k, v, cu_q, cu_k, causal, seqused_q, seqused_k, page_table, softmax_scale)
    rows = varlen_row_mask(cu_q, q.shape[0], seqused_q)
    assert not out[rows].isnan().any(), f"out has NaN at {out[rows].isnan().nonzero()[:5].tolist()} (unwritten?)"
    assert not lse[:, rows].isnan().any(), f"lse has NaN at {lse[:, rows].isnan().nonzero()[:5].tolist()}"
    if k.numel() > 0:  # rows outside every sequence are never written (they may belong to someone else)
        assert out[~rows].isnan().all() and lse[:, ~rows].isnan().all(), "a row outside every sequence was written"
    errs = varlen_fwd_errors(q, k, v, cu_q, cu_k, out, lse, seqused_q, seqused_k, page_table, softmax_scale, causal)
    assert errs["ok"], errs
    return out, lse


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


# ================================================================ paged K/V
def paged_from(q, k, v, cu_q, cu_k, page_size, layout="separate", seed=0):
    return paged_kv_cache(k, v, cu_k, page_size, layout=layout, generator=torch.Generator().manual_seed(seed))


PAGED_LENS = ([5, 0, 300, 1, 129, 64], [1000, 7, 300, 0, 129, 1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size", [8, 16, 32, 64, 128, 256])
def test_paged_is_bitwise_contiguous(page_size, causal):
    """A paged call equals the same data laid out contiguously (cu_seqlens_k), bit for bit, and the
    reference; the page tails and unused table columns hold other (finite) data."""
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 8, 2, 128, seed=page_size)
    k_cache, v_cache, table, seqused_k = paged_from(q, k, v, cu_q, cu_k, page_size, seed=page_size)
    out_p, lse_p = check_fwd(q, k_cache, v_cache, cu_q, None, causal, seqused_k=seqused_k, page_table=table)
    out_c, lse_c = run_poisoned(q, k, v, cu_q, cu_k, causal)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_p[rows], out_c[rows]) and torch.equal(lse_p[:, rows], lse_c[:, rows])


@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_paged_every_headdim(d):
    """The page piece per TMA copy is gcd(page_size, tile_n): 16 rows at d192 (tile_n 112) and d256 (80)."""
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 4, 1, d, seed=d)
    k_cache, v_cache, table, seqused_k = paged_from(q, k, v, cu_q, cu_k, 64, seed=d)
    out_p, _ = check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    out_c, _ = run_poisoned(q, k, v, cu_q, cu_k, True)
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_p[rows], out_c[rows])


@pytest.mark.parametrize("layout", ["interleaved", "vllm"])
def test_paged_interleaved_cache_layouts(layout):
    """K and V as two views of one cache tensor (page/token strides not their own sizes): equal to
    separate K/V tensors holding the same pages."""
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 8, 2, 128, seed=21)
    sep = paged_from(q, k, v, cu_q, cu_k, 16, seed=5)
    inter = paged_from(q, k, v, cu_q, cu_k, 16, layout=layout, seed=5)
    assert torch.equal(sep[2], inter[2])  # same page table (same seed)
    assert inter[0].stride(1) == 2 * 2 * 128  # the token stride spans K and V
    out_s, lse_s = run_poisoned(q, sep[0], sep[1], cu_q, None, True, seqused_k=sep[3], page_table=sep[2])
    out_i, lse_i = check_fwd(q, inter[0], inter[1], cu_q, None, True, seqused_k=inter[3], page_table=inter[2])
    rows = varlen_row_mask(cu_q, q.shape[0])
    assert torch.equal(out_s[rows], out_i[rows]) and torch.equal(lse_s[:, rows], lse_i[:, rows])


def test_paged_seqused_below_pages_and_public_api():
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 8, 2, 128, seed=9)
    k_cache, v_cache, table, _ = paged_from(q, k, v, cu_q, cu_k, 64)
    seqused_k = torch.tensor([999, 0, 250, 0, 65, 1], dtype=I32, device=DEV)  # inside the laid-out keys
    check_fwd(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 300, seqused_k=seqused_k, page_table=table,
                                 causal=True, check_seqlens=True)
    ref, _ = run_poisoned(q, k_cache, v_cache, cu_q, None, True, seqused_k=seqused_k, page_table=table)
    assert torch.equal(out, ref)
    bad = table.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]=.* is not a page of the cache"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, seqused_k=seqused_k, page_table=bad,
                               check_seqlens=True)


# ================================================================ backward
def ref_grads(q, k, v, cu_q, cu_k, dout, causal, upcast, seqused_q=None, seqused_k=None, dlse=None):
    leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_varlen_ref(*leaves, cu_q, cu_k, seqused_q, seqused_k, causal=causal, upcast=upcast)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        rows = varlen_row_mask(cu_q, q.shape[0], seqused_q)
        loss = loss + (lse[:, rows].float() * dlse[:, rows]).sum()
    loss.backward()
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def check_grads(got, q, k, v, cu_q, cu_k, dout, causal, seqused_q=None, seqused_k=None, dlse=None):
    g_ref = ref_grads(q, k, v, cu_q, cu_k, dout, causal, True, seqused_q, seqused_k, dlse)
    g_pt = ref_grads(q, k, v, cu_q, cu_k, dout, causal, False, seqused_q, seqused_k, dlse)
    for name, g, gr, gp in zip(("dq", "dk", "dv"), got, g_ref, g_pt):
        assert not g.isnan().any(), f"{name} has NaN at {g.isnan().nonzero()[:4].tolist()} (unwritten?)"
        err, pt_err = max_abs_err(g.float(), gr), max_abs_err(gp.float(), gr)
        assert err <= 2 * pt_err + GRAD_ATOL, f"{name}: err {err:.3e} > 2 * pt_err {pt_err:.3e} + {GRAD_ATOL}"


def run_bwd(q, k, v, cu_q, cu_k, dout, causal, seqused_q=None, seqused_k=None, deterministic=False):
    """Forward with the log2 LSE split, then the backward into NaN-filled dq/dk/dv."""
    d = q.shape[2]
    scale = 1 / math.sqrt(d)
    split = torch.empty(2, q.shape[1], q.shape[0], dtype=torch.float32, device=DEV)
    max_q, max_k = _max_len(cu_q, seqused_q), _max_len(cu_k, seqused_k)
    out, lse = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, scale, causal, seqused_q, seqused_k,
                                          lse_split=split)
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    res = _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, seqused_q,
                                      seqused_k, deterministic=deterministic, lse_split=split, dq=dq, dk=dk, dv=dv)
    assert all(r is g for r, g in zip(res, (dq, dk, dv)))
    torch.cuda.synchronize()
    return dq, dk, dv


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


def test_paged_backward_raises():
    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 4, 2, 64)
    k_cache, v_cache, table, seqused_k = paged_from(q, k, v, cu_q, cu_k, 16)
    q.requires_grad_()
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, seqused_k=seqused_k, page_table=table)
    with pytest.raises(RuntimeError, match="no backward for a paged K/V cache"):
        out.sum().backward()


# ================================================================ KV cache (decode)
def kv_inputs(b, sq, s_new, h, hk, d, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen, device=DEV, dtype=BF16)
    kn = torch.randn(b, s_new, hk, d, generator=gen, device=DEV, dtype=BF16)
    vn = torch.randn(b, s_new, hk, d, generator=gen, device=DEV, dtype=BF16)
    return q, kn, vn


def append_expected(k_cache, v_cache, kn, vn, cache_seqlens, page_table=None, rows=None):
    """The caches after the append, by plain indexing (a copy)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    page_size = k_cache.shape[1]
    for b, start in enumerate(cache_seqlens):
        for t in range(kn.shape[1]):
            pos = start + t
            where = ((int(page_table[b, pos // page_size]), pos % page_size) if page_table is not None
                     else (rows[b] if rows is not None else b, pos))
            k_cache[where], v_cache[where] = kn[b, t], vn[b, t]
    return k_cache, v_cache


def check_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, page_table=None, causal=True, num_splits=0,
                  cache_batch_idx=None):
    """flash_attn_with_kvcache into a NaN-filled out: the cache after the append and the attention
    against the float32 reference (2x-PyTorch rule)."""
    seqlens = cache_seqlens.tolist() if isinstance(cache_seqlens, torch.Tensor) else [cache_seqlens] * q.shape[0]
    s_new = 0 if kn is None else kn.shape[1]
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else None
    k_exp, v_exp = (append_expected(k_cache, v_cache, kn, vn, seqlens, page_table, rows) if s_new
                    else (k_cache.clone(), v_cache.clone()))
    out = torch.full_like(q, math.nan)
    res, lse = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, page_table,
                                       cache_batch_idx=cache_batch_idx, causal=causal, num_splits=num_splits,
                                       return_lse=True, out=out)
    torch.cuda.synchronize()
    assert res is out and not out.isnan().any() and not lse.isnan().any()
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous()
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), "the append wrote the wrong cache slots"
    lengths = [n + s_new for n in seqlens]
    ref_out, ref_lse = kvcache_ref(q, k_cache, v_cache, lengths, page_table, cache_batch_idx, causal=causal)
    pt_out, pt_lse = kvcache_ref(q, k_cache, v_cache, lengths, page_table, cache_batch_idx, causal=causal,
                                 upcast=False)
    out_err, pt_err = max_abs_err(out, ref_out), max_abs_err(pt_out, ref_out)
    assert out_err <= 2 * pt_err + 1e-4, (out_err, pt_err)
    lse_err, lse_pt_err = max_abs_err(lse, ref_lse), max_abs_err(pt_lse, ref_lse)
    assert lse_err <= 2 * lse_pt_err + 1e-3, (lse_err, lse_pt_err)
    return out, lse


@pytest.mark.parametrize("num_splits", [0, 1], ids=["auto", "nosplit"])
@pytest.mark.parametrize("sq, s_new", [(1, 1), (4, 4), (1, 0)], ids=["decode", "spec4", "no-append"])
def test_decode_dense_cache_up_to_64k(sq, s_new, num_splits):
    """Cache lengths 1 .. 64k (after the append), 32 query / 8 KV heads, d128; split-KV chosen by
    the heuristic (batch 4 x 8 KV heads leaves most SMs idle) and disabled."""
    q, kn, vn = kv_inputs(4, sq, s_new, 32, 8, 128, seed=sq)
    gen = torch.Generator(device=DEV).manual_seed(1)
    k_cache = torch.randn(4, 65536, 8, 128, generator=gen, device=DEV, dtype=BF16)
    v_cache = torch.randn(4, 65536, 8, 128, generator=gen, device=DEV, dtype=BF16)
    start = [1 - s_new if s_new <= 1 else 0, 4096 - s_new, 30000, 65536 - s_new]
    cache_seqlens = torch.tensor([max(n, 0) for n in start], dtype=I32, device=DEV)
    check_kvcache(q, k_cache, v_cache, kn if s_new else None, vn if s_new else None, cache_seqlens,
                  num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [0, 1, 3], ids=["auto", "nosplit", "split3"])
@pytest.mark.parametrize("layout", ["separate", "vllm"])
def test_decode_paged_cache(layout, num_splits):
    """Paged page-64 cache (random page permutation, vLLM's interleaved layout too), lengths 0..40k
    before the append; each num_splits against the reference, and reproducible bit for bit."""
    b, hk, d, page_size, max_pages = 5, 8, 128, 64, 640
    num_pages = b * max_pages + 7
    gen = torch.Generator(device=DEV).manual_seed(2)
    if layout == "separate":
        k_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
        v_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
    else:
        kv = torch.randn(num_pages, page_size, hk, 2 * d, generator=gen, device=DEV, dtype=BF16)
        k_cache, v_cache = kv.split(d, dim=-1)
    table = torch.randperm(num_pages, generator=gen, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
    cache_seqlens = torch.tensor([0, 63, 64, 12345, 40959], dtype=I32, device=DEV)
    q, kn, vn = kv_inputs(b, 1, 1, 32, hk, d, seed=3)
    out, lse = check_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, table, num_splits=num_splits)
    # the same step without the append (the new keys are in the cache now) gives the same bits
    again, lse2 = flash_attn_with_kvcache(q, k_cache, v_cache, None, None, cache_seqlens + 1, table, causal=True,
                                          num_splits=num_splits, return_lse=True)
    assert torch.equal(again, out) and torch.equal(lse2, lse)


def test_decode_int_cache_seqlens_and_batch_idx():
    q, kn, vn = kv_inputs(3, 2, 2, 8, 2, 64, seed=4)
    gen = torch.Generator(device=DEV).manual_seed(4)
    storage_k = torch.randn(6, 1100, 2, 64, generator=gen, device=DEV, dtype=BF16)
    storage_v = torch.randn(6, 1100, 2, 64, generator=gen, device=DEV, dtype=BF16)
    k_cache, v_cache = storage_k[:, :1024], storage_v[:, :1024]  # batch stride 1100 rows
    check_kvcache(q, k_cache, v_cache, kn, vn, 1000, cache_batch_idx=torch.tensor([5, 0, 3], dtype=I32, device=DEV))
    check_kvcache(q[:1], k_cache[:1], v_cache[:1], kn[:1], vn[:1], 1022)


# ================================================================ no recompiles, CUDA graphs
def compile_count() -> int:
    """Misses of every functools cache of the modules that compile or hold compiled kernels (a miss
    = a compile or an on-disk cache load)."""
    import importlib

    from flash4.compile.cache import compile_counts

    total = sum(compile_counts().values())  # kernels compiled or loaded from disk by this process
    for name in ("flash4.compile.cache", "flash4.varlen", "flash4.backward", "flash4.api"):
        module = importlib.import_module(name)
        total += sum(f.cache_info().misses for f in vars(module).values() if callable(getattr(f, "cache_info", None)))
    return total


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


def test_fifty_decode_steps_compile_nothing_new():
    b_max, hk, d, page_size, max_pages = 16, 2, 128, 64, 32
    num_pages = b_max * max_pages
    k_cache = torch.randn(num_pages, page_size, hk, d, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    rng = random.Random(1)

    def step(i, b):
        q, kn, vn = kv_inputs(b, 1, 1, 16, hk, d, seed=i)
        table = torch.randperm(num_pages, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
        seqlens = torch.randint(0, max_pages * page_size, (b,), device=DEV, dtype=I32)
        flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, seqlens, table, causal=True)

    for b in (1, 4, b_max):  # every config the batch range can select (split-KV or not) compiles here
        step(0, b)
    torch.cuda.synchronize()
    before = compile_count()
    for i in range(1, 51):
        step(i, rng.randint(1, b_max))
    torch.cuda.synchronize()
    assert compile_count() == before


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_cuda_graph_decode_step(paged):
    """A decode step (append + attention) captured once, replayed after cache_seqlens, page_table, q
    and the new k/v changed in place: the result and the cache equal the eager call's."""
    b, h, hk, d, page_size, max_pages = 4, 16, 4, 128, 64, 16
    gen = torch.Generator(device=DEV).manual_seed(8)
    if paged:
        num_pages = b * max_pages + 8
        k_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
        table = torch.randperm(num_pages, generator=gen, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
    else:
        k_cache = torch.randn(b, max_pages * page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
        table = None
    v_cache = torch.randn(k_cache.shape, generator=gen, device=DEV, dtype=BF16)
    q, kn, vn = kv_inputs(b, 1, 1, h, hk, d, seed=9)
    cache_seqlens = torch.tensor([10, 0, 500, 1000], dtype=I32, device=DEV)
    out = torch.empty_like(q)
    snapshot = k_cache.clone(), v_cache.clone()

    def step():
        flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, table, causal=True, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    cache_seqlens.copy_(torch.tensor([1023, 7, 0, 64], dtype=I32))
    if paged:
        table.copy_(torch.randperm(table.numel() + 8, generator=gen, device=DEV)[: table.numel()].view_as(table))
    for t in (q, kn, vn):
        t.copy_(torch.randn(t.shape, generator=gen, device=DEV, dtype=BF16))
    k_cache.copy_(snapshot[0])
    v_cache.copy_(snapshot[1])
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone(), k_cache.clone(), v_cache.clone()

    k_cache.copy_(snapshot[0])
    v_cache.copy_(snapshot[1])
    eager = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, table, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(replayed[1], k_cache) and torch.equal(replayed[2], v_cache)
    assert torch.equal(replayed[0], eager)
    lengths = (cache_seqlens + 1).tolist()
    ref, _ = kvcache_ref(q, k_cache, v_cache, lengths, table, causal=True)
    pt, _ = kvcache_ref(q, k_cache, v_cache, lengths, table, causal=True, upcast=False)
    assert max_abs_err(eager, ref) <= 2 * max_abs_err(pt, ref) + 1e-4
    if paged:  # the replay read the new page table: the keys sit where the new table says
        assert torch.equal(gather_paged(k_cache, table[3], 65)[64], kn[3, 0])
