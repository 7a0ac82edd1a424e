"""flash_attn_with_kvcache (decode, speculative decode, chunked prefill against a KV cache) without a
GPU: every argument error, the on-device value checks (check_seqlens), kvcache_ref against
attention_ref, and the door's plumbing with the reference in place of the kernels (conftest.py):
the in-place append (dense rows, cache_batch_idx, page_table), the decode step it hands to
flash4.forward.launch (seqused_k, num_splits), the cache_batch_idx path over the dense cache's
rows, empty caches and batches, windows. The decode plans themselves: test_decode_cpu.py."""

import math

import pytest
import torch
from cpu_helpers import BF16, I32, expected_cache, kv_args, kv_raises

from flash4.geometry import band
import flash4
from flash4.reference import attention_ref, kvcache_ref
from flash4.validate import check_kvcache_seqlens


# ================================================================ kvcache argument errors
def test_kvcache_valid_cpu_inputs_only_fail_on_device():
    kv_raises(ValueError, ("q is on cpu",), **kv_args())
    kv_raises(ValueError, ("q is on cpu",), **kv_args(paged=True))
    kv_raises(ValueError, ("q is on cpu",), **kv_args(s_new=0))
    kv_raises(ValueError, ("q is on cpu",), **dict(kv_args(s_new=0), cache_seqlens=None))
    kv_raises(ValueError, ("q is on cpu",), **dict(kv_args(), cache_seqlens=39))
    kv_raises(ValueError, ("q is on cpu",), **dict(kv_args(), num_splits=1))


def test_kvcache_types_and_dtypes():
    args = kv_args()
    kv_raises(TypeError, ("k_cache must be a torch.Tensor",), **dict(args, k_cache=None))
    kv_raises(TypeError, ("cache_seqlens must be a Python int",), **dict(args, cache_seqlens=3.0))
    kv_raises(TypeError, ("cache_seqlens must be a Python int",), **dict(args, cache_seqlens=True))
    kv_raises(TypeError, ("cache_seqlens.dtype is torch.int64", "torch.int32"),
              **dict(args, cache_seqlens=args["cache_seqlens"].long()))
    kv_raises(TypeError, ("cache_seqlens.dtype is torch.float32",), **dict(args, cache_seqlens=args["cache_seqlens"].float()))
    kv_raises(TypeError, ("cache_batch_idx.dtype is torch.int64",), **dict(args, cache_batch_idx=torch.arange(3)))
    paged = kv_args(paged=True)
    kv_raises(TypeError, ("page_table.dtype is torch.int64",), **dict(paged, page_table=paged["page_table"].long()))
    kv_raises(TypeError, ("q.dtype is torch.float32",), **dict(args, q=args["q"].float()))
    kv_raises(TypeError, ("v_cache.dtype is torch.float16 but q.dtype is torch.bfloat16",),
              **dict(args, v_cache=args["v_cache"].half()))
    kv_raises(TypeError, ("k.dtype is torch.float32",), **dict(args, k=args["k"].float()))
    kv_raises(TypeError, ("out.dtype is torch.float32",), **dict(args, out=torch.empty(3, 1, 4, 64)))
    kv_raises(TypeError, ("num_splits must be an int",), **dict(args, num_splits=1.5))
    kv_raises(TypeError, ("num_splits must be an int",), **dict(args, num_splits=True))
    for flag in ("return_lse", "check_seqlens"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            flash4.flash_attn_with_kvcache(**args, **{flag: 1})


def test_kvcache_shapes():
    args = kv_args()
    kv_raises(ValueError, ("q must be 4-D (batch, seqlen_q, nheads, headdim)",), **dict(args, q=args["q"][0]))
    kv_raises(ValueError, ("k_cache must be 4-D (batch_cache, seqlen_cache",), **dict(args, k_cache=args["k_cache"][0]))
    kv_raises(ValueError, ("k_cache must be 4-D (num_pages, page_size",),
              **dict(kv_args(paged=True), k_cache=torch.zeros(3, 16, 128, dtype=BF16)))
    kv_raises(ValueError, ("cache_seqlens must be 1-D (batch,)",), **dict(args, cache_seqlens=torch.zeros(3, 1, dtype=I32)))
    kv_raises(ValueError, ("cache_seqlens must have shape (batch,) = (3,)",), **dict(args, cache_seqlens=torch.zeros(2, dtype=I32)))
    kv_raises(ValueError, ("k and v (the new keys and values to append) must be given together",), **dict(args, v=None))
    kv_raises(ValueError, ("k and v must be (batch, seqlen_new, nheads_k, headdim) = (3, 1, 2, 64)",),
              **dict(args, k=torch.zeros(3, 1, 4, 64, dtype=BF16), v=torch.zeros(3, 1, 4, 64, dtype=BF16)))
    kv_raises(ValueError, ("k_cache.shape[0] (batch_cache) is 3 but q.shape[0] (batch) is 2",),
              **dict(args, q=args["q"][:2], k=args["k"][:2], v=args["v"][:2], cache_seqlens=args["cache_seqlens"][:2]))
    kv_raises(ValueError, ("cache_batch_idx must have shape (batch,) = (3,)",), **dict(args, cache_batch_idx=torch.zeros(2, dtype=I32)))
    kv_raises(ValueError, ("out must have the shape of q",), **dict(args, out=torch.empty(3, 2, 4, 64, dtype=BF16)))
    kv_raises(ValueError, ("nheads_k=3 (k_cache.shape[2]) must divide nheads=4 (q.shape[2])",),
              **dict(args, k_cache=torch.zeros(3, 40, 3, 64, dtype=BF16), v_cache=torch.zeros(3, 40, 3, 64, dtype=BF16),
                     k=None, v=None))
    kv_raises(ValueError, ("k_cache.shape[3] (headdim) is 128 but q.shape[3] is 64",),
              **dict(args, k_cache=torch.zeros(3, 40, 2, 128, dtype=BF16), v_cache=torch.zeros(3, 40, 2, 128, dtype=BF16)))
    paged = kv_args(paged=True)
    kv_raises(ValueError, ("page_table must have shape (batch, max_pages_per_seq) with batch = 3",),
              **dict(paged, page_table=paged["page_table"][:2]))
    kv_raises(ValueError, ("cache_batch_idx is not supported with page_table",),
              **dict(paged, cache_batch_idx=torch.arange(3, dtype=I32)))
    kv_raises(ValueError, ("page_size=0 (k_cache.shape[1]", "at least 1 row"),
              **dict(paged, k_cache=torch.zeros(9, 0, 2, 64, dtype=BF16), v_cache=torch.zeros(9, 0, 2, 64, dtype=BF16)))


def test_kvcache_cache_too_small():
    args = kv_args(s_cache=40, s_new=3)
    kv_raises(ValueError, ("the cache is too small for the appended k/v", "seqlen_new=41", "seqlen_cache", "= 40"),
              **dict(args, k=torch.zeros(3, 41, 2, 64, dtype=BF16), v=torch.zeros(3, 41, 2, 64, dtype=BF16)))
    kv_raises(ValueError, ("cache_seqlens + seqlen_new = 38 + 3 > seqlen_cache = k_cache.shape[1] = 40",),
              **dict(args, cache_seqlens=38))
    kv_raises(ValueError, ("q is on cpu",), **dict(args, cache_seqlens=37))
    kv_raises(ValueError, ("cache_seqlens must be >= 0",), **dict(args, cache_seqlens=-1))
    kv_raises(ValueError, ("appending k/v needs cache_seqlens",), **dict(args, cache_seqlens=None))
    kv_raises(ValueError, ("cache_seqlens=41 is above", "= 40"), **dict(kv_args(s_new=0), cache_seqlens=41))
    paged = kv_args(paged=True, s_cache=40, s_new=2)  # 3 pages of 16 per sequence: capacity 48
    kv_raises(ValueError, ("47 + 2 > page_table.shape[1] * page_size = 48",), **dict(paged, cache_seqlens=47))


def test_kvcache_num_splits():
    args = kv_args()
    kv_raises(ValueError, ("q is on cpu",), **dict(args, num_splits=7))
    kv_raises(ValueError, ("num_splits=2", "not supported with cache_batch_idx"),
              **dict(args, num_splits=2, cache_batch_idx=torch.arange(3, dtype=I32)))
    kv_raises(ValueError, ("num_splits must be >= 0",), **dict(args, num_splits=-1))


def test_kvcache_strides():
    args = kv_args()
    q = torch.randn(3, 2, 4, 64, dtype=BF16)
    out = torch.empty(2, 3, 4, 64, dtype=BF16).transpose(0, 1)
    kv_raises(ValueError, ("out.stride(0) must be seqlen_q * out.stride(1)",), **dict(args, q=q, out=out))
    big = torch.randn(3, 40, 2, 2, 64, dtype=BF16)  # the interleaved (dense) cache layout is fine
    kv_raises(ValueError, ("q is on cpu",), **dict(args, k_cache=big[:, :, 0], v_cache=big[:, :, 1]))
    sliced = torch.randn(3, 50, 2, 64, dtype=BF16)[:, :40]  # a seqlen slice of a longer cache is fine too
    kv_raises(ValueError, ("q is on cpu",), **dict(args, k_cache=sliced, v_cache=torch.randn(3, 50, 2, 64, dtype=BF16)[:, :40]))
    idx = torch.tensor([2, 0, 1], dtype=I32)
    kv_raises(ValueError, ("q is on cpu",), **dict(args, k_cache=sliced, v_cache=sliced.contiguous()))
    kv_raises(ValueError, ("strides (6400, 128, 64, 1) / (5120, 128, 64, 1)", "same whole number"),
              **dict(args, k_cache=sliced, v_cache=sliced.contiguous(), cache_batch_idx=idx))  # one offset per row
    odd = torch.randn(40, 3, 2, 64, dtype=BF16).transpose(0, 1)  # batch stride 128 < 40 rows of 384
    kv_raises(ValueError, ("q is on cpu",), **dict(args, k_cache=odd, v_cache=odd.clone()))
    kv_raises(ValueError, ("stride(0) must be the same whole number", "seqlen_cache"),
              **dict(args, k_cache=odd, v_cache=odd.clone(), cache_batch_idx=idx))
    kv_raises(ValueError, ("k_cache has stride(-1)=2",),
              **dict(args, k_cache=torch.randn(3, 40, 2, 128, dtype=BF16)[..., ::2]))


def test_kvcache_devices():
    args = kv_args()
    kv_raises(ValueError, ("cache_seqlens is on meta but q is on cpu",), **dict(args, cache_seqlens=args["cache_seqlens"].to("meta")))
    kv_raises(ValueError, ("k_cache is on meta but q is on cpu",), **dict(args, k_cache=args["k_cache"].to("meta")))


def test_check_kvcache_seqlens():
    seqlens = torch.tensor([0, 5, 8], dtype=I32)
    check_kvcache_seqlens(seqlens, 2, 10)
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\]=8: the cache is too small .* 8 \+ 3 must be in \[0, 10\]"):
        check_kvcache_seqlens(seqlens, 3, 10)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=-1"):
        check_kvcache_seqlens(torch.tensor([-1, 0, 0], dtype=I32), 1, 10)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\]=4 is outside \[0, batch_cache = 4\)"):
        check_kvcache_seqlens(seqlens, 0, 10, batch_cache=4, cache_batch_idx=torch.tensor([0, 4, 1], dtype=I32))
    table = torch.tensor([[0, 1], [2, 9], [4, 5]], dtype=I32)
    check_kvcache_seqlens(seqlens, 2, 16, page_table=table, num_pages=6, page_size=8)  # row 1 uses 1 page
    with pytest.raises(ValueError, match=r"page_table\[1, 1\]=9 is not a page"):
        check_kvcache_seqlens(seqlens, 4, 16, page_table=table, num_pages=6, page_size=8)  # row 1 now needs 2


# ================================================================ the reference
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_ref_matches_attention_ref(causal):
    args = kv_args(b=2, sq=3, s_cache=20, s_new=0)
    lens = [7, 20]
    out, lse = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], lens, causal=causal)
    for b, n in enumerate(lens):
        o, l = attention_ref(args["q"][b:b + 1], args["k_cache"][b:b + 1, :n], args["v_cache"][b:b + 1, :n],
                             causal=causal)
        assert torch.equal(out[b:b + 1], o) and torch.equal(lse[b:b + 1], l)
    out_idx, _ = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], [20, 7], cache_batch_idx=[1, 0],
                             causal=causal)
    o, _ = attention_ref(args["q"][:1], args["k_cache"][1:2, :20], args["v_cache"][1:2, :20], causal=causal)
    assert torch.equal(out_idx[:1], o)


# ================================================================ API plumbing with reference kernels
@pytest.mark.parametrize("sq, s_new, causal", [(1, 1, False), (1, 1, True), (3, 3, True), (4, 2, True), (2, 0, True)])
def test_kvcache_dense_appends_and_attends(cpu_kernels, sq, s_new, causal):
    args = kv_args(b=3, sq=sq, s_new=s_new)
    seqlens = args["cache_seqlens"].tolist()
    k_exp, v_exp = expected_cache(args, seqlens) if s_new else (args["k_cache"].clone(), args["v_cache"].clone())
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=causal, return_lse=True, check_seqlens=True)
    assert torch.equal(args["k_cache"], k_exp) and torch.equal(args["v_cache"], v_exp)
    ref_out, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + s_new for n in seqlens], causal=causal)
    assert out.shape == args["q"].shape and lse.shape == (3, 4, sq) and lse.is_contiguous()
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    call = cpu_kernels[0]
    assert call["decode"] and call["seqused_k"].tolist() == [n + s_new for n in seqlens] and call["num_splits"] == 0


def test_kvcache_int_cache_seqlens_broadcast_and_out(cpu_kernels):
    args = kv_args(b=2, sq=1, s_new=1)
    args["cache_seqlens"] = 30
    out = torch.full_like(args["q"], math.nan)
    k_exp, v_exp = expected_cache(args, [30, 30])
    res = flash4.flash_attn_with_kvcache(**args, out=out, num_splits=3)
    assert res is out and torch.equal(args["k_cache"], k_exp) and cpu_kernels[0]["num_splits"] == 3
    ref, _ = kvcache_ref(args["q"], k_exp, v_exp, [31, 31])
    assert torch.equal(out, ref.to(BF16))


def test_kvcache_batch_idx_gives_non_monotonic_offsets(cpu_kernels):
    args = kv_args(b=3, sq=2, s_new=2)
    # batch_cache 5; each entry a 40-row slice of 48 rows (stride(0) = 48 rows)
    k_storage, v_storage = torch.randn(5, 48, 2, 64, dtype=BF16), torch.randn(5, 48, 2, 64, dtype=BF16)
    args["k_cache"], args["v_cache"] = k_storage[:, :40], v_storage[:, :40]
    tails = k_storage[:, 40:].clone(), v_storage[:, 40:].clone()
    idx = torch.tensor([4, 0, 2], dtype=I32)
    seqlens = args["cache_seqlens"].tolist()
    k_exp, v_exp = expected_cache(args, seqlens, rows=idx.tolist())
    out, lse = flash4.flash_attn_with_kvcache(**args, cache_batch_idx=idx, causal=True, check_seqlens=True,
                                             return_lse=True)
    assert torch.equal(args["k_cache"], k_exp) and torch.equal(args["v_cache"], v_exp)
    assert torch.equal(k_storage[:, 40:], tails[0]) and torch.equal(v_storage[:, 40:], tails[1])
    ref, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + 2 for n in seqlens], cache_batch_idx=idx, causal=True)
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse) and lse.shape == (3, 4, 2)
    call = cpu_kernels[0]
    assert call["cu_seqlens_k"].tolist() == [4 * 48, 0, 2 * 48, 4 * 48 + 40]
    assert call["k"].shape == (4 * 48 + 40, 2, 64) and call["k"].data_ptr() == k_storage.data_ptr()
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\]=5 is outside"):
        flash4.flash_attn_with_kvcache(**args, cache_batch_idx=torch.tensor([5, 0, 1], dtype=I32), check_seqlens=True)


@pytest.mark.parametrize("layout", ["separate", "interleaved"])
@pytest.mark.parametrize("sq, s_new", [(1, 1), (3, 3), (1, 0)])
def test_kvcache_paged_appends_through_page_table(cpu_kernels, layout, sq, s_new):
    args = kv_args(b=3, sq=sq, s_new=s_new, paged=True, s_cache=40, page_size=16)
    if layout == "interleaved":
        kv = torch.randn(args["k_cache"].shape[0], 16, 2, 2, 64, dtype=BF16)
        args["k_cache"], args["v_cache"] = kv[:, :, 0], kv[:, :, 1]
    seqlens = args["cache_seqlens"].tolist()
    table = args["page_table"]
    k_exp, v_exp = expected_cache(args, seqlens, table=table) if s_new else (args["k_cache"].clone(),
                                                                               args["v_cache"].clone())
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=True, return_lse=True, check_seqlens=True)
    assert torch.equal(args["k_cache"], k_exp) and torch.equal(args["v_cache"], v_exp)
    ref_out, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + s_new for n in seqlens], page_table=table, causal=True)
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    assert cpu_kernels[0]["decode"] and cpu_kernels[0]["page_table"] is table


def test_kvcache_check_seqlens_before_writing(cpu_kernels):
    args = kv_args(b=2, s_cache=40, s_new=2)
    args["cache_seqlens"] = torch.tensor([3, 39], dtype=I32)
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]=39: the cache is too small"):
        flash4.flash_attn_with_kvcache(**args, check_seqlens=True)
    assert torch.equal(args["k_cache"], before) and cpu_kernels == []
    paged = kv_args(b=2, paged=True, s_new=1)
    paged["page_table"][0, 0] = 10 ** 5
    paged["cache_seqlens"] = torch.tensor([0, 3], dtype=I32)
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]=100000 is not a page"):
        flash4.flash_attn_with_kvcache(**paged, check_seqlens=True)


def test_kvcache_no_autograd_and_empty_batch(cpu_kernels):
    args = kv_args(b=2)
    q = args["q"].requires_grad_()
    out = flash4.flash_attn_with_kvcache(**args)
    assert not out.requires_grad and q.grad is None
    empty = kv_args(b=0, s_new=1)
    out, lse = flash4.flash_attn_with_kvcache(**empty, return_lse=True)
    assert out.shape == (0, 1, 4, 64) and lse.shape == (0, 4, 1) and cpu_kernels == [cpu_kernels[0]]


def test_kvcache_cache_seqlens_none_uses_the_whole_cache(cpu_kernels):
    args = kv_args(b=2, s_new=0)
    out = flash4.flash_attn_with_kvcache(**dict(args, cache_seqlens=None))
    ref, _ = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], [40, 40])
    assert torch.equal(out, ref.to(BF16))


def test_kvcache_empty_cache_gives_zero_and_neg_inf(cpu_kernels):
    args = kv_args(b=2, sq=3, s_cache=0, s_new=0)
    out, lse = flash4.flash_attn_with_kvcache(**dict(args, cache_seqlens=0), causal=True, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and cpu_kernels == []


# ---------------------------------------------------------------- sliding windows (window_size)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sq, s_new", [(1, 1), (3, 2)])
@pytest.mark.parametrize("window", [(7, 0), (2, 3), (-1, -1)])
def test_kvcache_routes_the_window(cpu_kernels, paged, sq, s_new, window):
    """flash_attn_with_kvcache hands window_size to decode_forward (after the append); the result is
    kvcache_ref's with that window (n_b = cache_seqlens[b] + seqlen_new keys per sequence)."""
    args = kv_args(b=3, sq=sq, s_new=s_new, paged=paged)
    seqlens = args["cache_seqlens"].tolist()
    table = args.get("page_table")
    k_exp, v_exp = expected_cache(args, seqlens, table=table)
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=True, window_size=window, return_lse=True)
    ref_out, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + s_new for n in seqlens], page_table=table,
                                   causal=True, window_size=window)
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    assert cpu_kernels[0]["decode"] and cpu_kernels[0]["window_size"] == band(window)


def test_kvcache_batch_idx_routes_the_window(cpu_kernels):
    """The cache_batch_idx path (varlen_forward over the dense cache's rows) gets the window too."""
    args = kv_args(b=3, sq=2, s_new=2)
    k_storage, v_storage = torch.randn(5, 40, 2, 64, dtype=BF16), torch.randn(5, 40, 2, 64, dtype=BF16)
    args["k_cache"], args["v_cache"] = k_storage, v_storage
    idx = torch.tensor([4, 0, 2], dtype=I32)
    seqlens = args["cache_seqlens"].tolist()
    k_exp, v_exp = expected_cache(args, seqlens, rows=idx.tolist())
    out, lse = flash4.flash_attn_with_kvcache(**args, cache_batch_idx=idx, window_size=(3, 1), return_lse=True)
    ref, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + 2 for n in seqlens], cache_batch_idx=idx,
                               window_size=(3, 1))
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)
    assert "decode" not in cpu_kernels[0] and cpu_kernels[0]["window_size"] == (3, 1)
