"""One decode engine behind every door, on the CPU: flash4.config.decode_door's rule (which calls
run as a decode step, from host ints only) and the routing of flash_attn_func and
flash_attn_varlen_func (paged, vLLM's decode layout and padded / uneven ones) into the decode plan,
with the reference in place of the kernels (conftest.py's cpu_kernels): the step the door builds
must give the varlen / dense reference's result on every row a sequence owns."""

import pytest
import torch
from cpu_helpers import BF16, I32, cu

import flash4
from flash4.config import DECODE_MAX_SEQLEN_Q, DECODE_MIN_SEQLEN_K, decode_door, fwd_config
from flash4.reference import attention_ref, attention_varlen_ref, paged_kv_cache, varlen_row_mask
from flash4.request import Request


@pytest.fixture
def sm90(monkeypatch, cpu_kernels):
    """The kernels replaced by the reference, on a pretend 132-SM sm_90 (decode_door reads the arch)."""
    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.setenv("FLASH4_NUM_SMS", "132")
    return cpu_kernels


def _meta(*shape):
    return torch.empty(*shape, dtype=BF16, device="meta")


def _dense(sq, sk, b=2, h=32, hk=8, d=128):
    return Request.dense(_meta(b, sq, h, d), _meta(b, sk, hk, d), _meta(b, sk, hk, d))


def _paged(max_q, pages, page_size=16, b=4, h=32, hk=8, d=128, seqused_q=False):
    total_q = b * max_q
    meta = torch.zeros(b + 1, dtype=I32, device="meta")
    return Request.varlen(_meta(total_q, h, d), _meta(64, page_size, hk, d), _meta(64, page_size, hk, d), meta, None,
                          max_q, None, seqused_q=torch.zeros(b, dtype=I32, device="meta") if seqused_q else None,
                          seqused_k=torch.zeros(b, dtype=I32, device="meta"),
                          page_table=torch.zeros(b, pages, dtype=I32, device="meta"))


# ================================================================ the rule
@pytest.mark.parametrize("sq,sk,expected", [
    (1, 131072, True),                              # decode, 128k keys
    (DECODE_MAX_SEQLEN_Q, DECODE_MIN_SEQLEN_K, True),  # the corner: 8 draft tokens over 1024 keys
    (DECODE_MAX_SEQLEN_Q + 1, 131072, False),       # 9 queries: a prefill chunk, the dense kernels
    (1, DECODE_MIN_SEQLEN_K - 1, False),            # a short cache: nothing to split
    (4, 4096, True),                                # speculative decoding
])
def test_rule_dense(sq, sk, expected):
    assert decode_door(_dense(sq, sk), 90) is expected
    assert decode_door(_dense(sq, sk), 90, lse_split=True) is False  # autograd's forward: the dense kernels
    assert decode_door(_dense(sq, sk), None) is False  # no arch (CPU tensors without FLASH4_ARCH)


def test_rule_families():
    # the sm80 family plans only flash_attn_with_kvcache's steps (config.sm80.kvcache_step_plan): its
    # doors keep their dense / packed configs, which its first-use self-test can drive
    assert decode_door(_dense(1, 4096), 80) is False
    # the sm100 family (unverified) is refused by the registry before any rule; the API rejects sm_100 earlier


@pytest.mark.parametrize("max_q,pages,page_size,seqused_q,expected", [
    (1, 64, 16, False, True),     # vLLM decode: 1024-key capacity at page 16
    (1, 63, 16, False, False),    # 1008 keys of capacity
    (8, 8, 128, False, True),     # speculative, page 128
    (9, 64, 16, False, False),
    (1, 64, 16, True, False),     # seqused_q: the varlen kernels
])
def test_rule_paged(max_q, pages, page_size, seqused_q, expected):
    assert decode_door(_paged(max_q, pages, page_size, seqused_q=seqused_q), 90) is expected


def test_rule_varlen_kv_and_unresolved_max_q():
    meta = torch.zeros(3, dtype=I32, device="meta")
    varlen = Request.varlen(_meta(2, 8, 64), _meta(4096, 2, 64), _meta(4096, 2, 64), meta, meta, 1, None)
    assert decode_door(varlen, 90) is False  # packed K/V: no cache rows to split
    paged = _paged(1, 64)
    unresolved = Request.varlen(paged.q, paged.k, paged.v, paged.seq.cu_seqlens_q, None, None, None,
                                seqused_k=paged.seq.seqused_k, page_table=paged.seq.page_table)
    assert decode_door(unresolved, 90) is False  # max_seqlen_q not a host int yet


def test_plan_of_a_door_step_is_the_kvcache_plan():
    """The step a door builds plans as flash_attn_with_kvcache's: packed GQA and split keys at batch 1 x 128k."""
    from flash4.forward import _decode_step

    request = _dense(1, 131072, b=1)
    step = _decode_step(request, request.q, torch.zeros(1, dtype=I32, device="meta"), None)
    plan = fwd_config(step, 90, 132)
    assert plan.pack == 4 and plan.num_splits > 1 and plan.cfg.split_kv and plan.cfg.seqused_k


# ================================================================ routing, results against the reference
def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("sq", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_decode(sm90, sq, causal):
    gen = _gen(sq)
    b, sk, h, hk, d = 2, DECODE_MIN_SEQLEN_K + 40, 8, 2, 64
    q = torch.randn(b, sq, h, d, generator=gen).to(BF16)
    k, v = (torch.randn(b, sk, hk, d, generator=gen).to(BF16) for _ in range(2))
    out, lse = flash4.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert sm90[-1]["layout"] == "decode" and sm90[-1]["seqused_k"].tolist() == [sk] * b
    o_ref, l_ref = attention_ref(q, k, v, causal=causal)
    torch.testing.assert_close(out.float(), o_ref.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=0)


def test_flash_attn_func_short_or_grad_stays_dense(sm90):
    gen = _gen()
    q = torch.randn(1, 1, 4, 64, generator=gen).to(BF16)
    k, v = (torch.randn(1, DECODE_MIN_SEQLEN_K - 8, 2, 64, generator=gen).to(BF16) for _ in range(2))
    flash4.flash_attn_func(q, k, v)
    assert sm90[-1]["layout"] == "dense"
    k, v = (torch.randn(1, DECODE_MIN_SEQLEN_K, 2, 64, generator=gen).to(BF16) for _ in range(2))
    flash4.flash_attn_func(q.requires_grad_(), k, v)
    assert sm90[-1]["layout"] == "dense"  # autograd's forward keeps lse_split for the backward
    with torch.no_grad():
        flash4.flash_attn_func(q, k, v)
    assert sm90[-1]["layout"] == "decode"


def _paged_call(len_q, len_k, max_q, causal, page_size=16, h=8, hk=2, d=64, window_size=(-1, -1), total_pad=0,
                seed=0):
    """flash_attn_varlen_func over a paged cache whose pages hold len_k keys per sequence, and the
    varlen reference; returns (out, lse, o_ref, l_ref, rows owned by a sequence)."""
    gen = _gen(seed)
    total_q = sum(len_q) + total_pad
    q = torch.randn(total_q, h, d, generator=gen).to(BF16)
    k, v = (torch.randn(sum(len_k), hk, d, generator=gen).to(BF16) for _ in range(2))
    cu_k = cu(len_k)
    k_cache, v_cache, page_table, seqused_k = paged_kv_cache(k, v, cu_k, page_size, generator=gen,
                                                             extra_pages_per_seq=DECODE_MIN_SEQLEN_K // page_size)
    cu_q = cu(len_q)
    out, lse = flash4.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max_q, None, seqused_k=seqused_k,
                                             page_table=page_table, causal=causal, window_size=window_size,
                                             return_lse=True)
    o_ref, l_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window_size)
    return out, lse, o_ref, l_ref, varlen_row_mask(cu_q, total_q, None)


@pytest.mark.parametrize("len_q,max_q", [
    ((1, 1, 1, 1), 1),         # vLLM: cu_seqlens_q = arange(B + 1)
    ((1, 0, 1, 0), 1),         # padding sequences of length 0 between real ones
    ((0, 1, 0, 0, 0, 0), 1),   # fewer rows than sequences (total_q < batch)
    ((1,), 1),                 # batch 1 (no sequence boundary to search)
    ((3,), 4),
    ((2, 2, 2), 2),
    ((4, 1, 0, 3), 4),         # uneven speculative drafts (right-aligned: bottom-right causal holds)
    ((8, 5), 8),
])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged_decode(sm90, len_q, max_q, causal):
    len_k = tuple(300 + 97 * i for i in range(len(len_q)))
    out, lse, o_ref, l_ref, rows = _paged_call(len_q, len_k, max_q, causal, total_pad=2)
    assert sm90[-1]["layout"] == "decode"
    torch.testing.assert_close(out[rows].float(), o_ref[rows].float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[:, rows], l_ref[:, rows], atol=1e-4, rtol=0)


def test_varlen_paged_decode_window_and_gqa(sm90):
    len_q, len_k = (3, 1, 0, 2), (900, 40, 7, 1200)
    out, lse, o_ref, l_ref, rows = _paged_call(len_q, len_k, 3, True, window_size=(100, 0), h=12, hk=3)
    assert sm90[-1]["layout"] == "decode"
    torch.testing.assert_close(out[rows].float(), o_ref[rows].float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[:, rows], l_ref[:, rows], atol=1e-4, rtol=0)


def test_varlen_paged_prefill_stays_varlen(sm90):
    _paged_call((9, 3), (1000, 1100), 9, True)
    assert sm90[-1]["layout"] == "paged"


def test_varlen_paged_decode_keeps_rows_outside_sequences(sm90):
    """Into a caller's NaN-filled out / lse (flash4.forward.run): every row a sequence owns written,
    the rows past cu_seqlens_q[-1] left as they were."""
    import math

    from flash4 import forward

    gen = _gen(3)
    len_q, len_k, pad = (2, 0, 1), (1500, 30, 1100), 3
    q = torch.randn(sum(len_q) + pad, 4, 64, generator=gen).to(BF16)
    k, v = (torch.randn(sum(len_k), 2, 64, generator=gen).to(BF16) for _ in range(2))
    cu_k = cu(len_k)
    k_cache, v_cache, page_table, seqused_k = paged_kv_cache(k, v, cu_k, 64, generator=gen, extra_pages_per_seq=20)
    cu_q = cu(len_q)
    out = torch.full((q.shape[0], 4, 64), math.nan, dtype=BF16)
    lse = torch.full((4, q.shape[0]), math.nan)
    request = Request.varlen(q, k_cache, v_cache, cu_q, None, 2, None, seqused_k=seqused_k, page_table=page_table,
                             causal=True)
    forward.run(request, out=out, lse=lse)
    assert sm90[-1]["layout"] == "decode"
    rows = varlen_row_mask(cu_q, q.shape[0], None)
    o_ref, l_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out[rows].float(), o_ref[rows].float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[:, rows], l_ref[:, rows], atol=1e-4, rtol=0)
    assert out[~rows].isnan().all() and lse[:, ~rows].isnan().all()


# ================================================================ FLASH4_DECODE_SCATTER (the combine writes the rows)
@pytest.mark.parametrize("len_q,max_q", [((1, 1, 1, 1), 1), ((1, 0, 1, 0), 1), ((0, 1, 0, 0, 0, 0), 1), ((1,), 1),
                                         ((2, 2, 2), 2), ((4, 1, 0, 3), 4), ((0, 3, 1), 3)])
def test_varlen_paged_decode_scatter_switch(sm90, monkeypatch, len_q, max_q):
    """The switch on: launch gets rows = cu_seqlens_q and the door's own out / lse (the stand-in writes
    them by flash4.forward.decode_slot_rows, the combine kernel's map); every row a sequence owns as
    with the switch off, and as the reference."""
    len_k = tuple(300 + 97 * i for i in range(len(len_q)))
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "0")
    out_off, lse_off, o_ref, l_ref, rows = _paged_call(len_q, len_k, max_q, True, total_pad=2)
    assert sm90[-1]["decode"] and sm90[-1]["rows"] is None
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "1")
    out_on, lse_on, *_ = _paged_call(len_q, len_k, max_q, True, total_pad=2)
    assert sm90[-1]["decode"] and torch.equal(sm90[-1]["rows"], cu(len_q))
    assert torch.equal(out_on[rows], out_off[rows]) and torch.equal(lse_on[:, rows], lse_off[:, rows])
    torch.testing.assert_close(out_on[rows].float(), o_ref[rows].float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse_on[:, rows], l_ref[:, rows], atol=1e-4, rtol=0)


@pytest.mark.parametrize("which", ["out", "lse", "both"])
def test_varlen_paged_decode_scatter_keeps_callers_rows(sm90, monkeypatch, which):
    """A caller's out or lse: the old path (step buffers, then the scatter) with the switch on, so its
    rows outside every sequence are kept."""
    import math

    from flash4 import forward

    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "1")
    gen = _gen(5)
    len_q, len_k, pad = (2, 0, 1), (1500, 30, 1100), 3
    q = torch.randn(sum(len_q) + pad, 4, 64, generator=gen).to(BF16)
    k, v = (torch.randn(sum(len_k), 2, 64, generator=gen).to(BF16) for _ in range(2))
    cu_k = cu(len_k)
    k_cache, v_cache, page_table, seqused_k = paged_kv_cache(k, v, cu_k, 64, generator=gen, extra_pages_per_seq=20)
    cu_q = cu(len_q)
    out = torch.full((q.shape[0], 4, 64), math.nan, dtype=BF16) if which != "lse" else None
    lse = torch.full((4, q.shape[0]), math.nan) if which != "out" else None
    request = Request.varlen(q, k_cache, v_cache, cu_q, None, 2, None, seqused_k=seqused_k, page_table=page_table,
                             causal=True)
    got_out, got_lse = forward.run(request, out=out, lse=lse)
    assert sm90[-1]["decode"] and sm90[-1]["rows"] is None
    rows = varlen_row_mask(cu_q, q.shape[0], None)
    o_ref, l_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(got_out[rows].float(), o_ref[rows].float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(got_lse[:, rows], l_ref[:, rows], atol=1e-4, rtol=0)
    if out is not None:
        assert got_out[~rows].isnan().all()
    if lse is not None:
        assert got_lse[:, ~rows].isnan().all()
