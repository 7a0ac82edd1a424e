"""flash4.config.fwd_config / bwd_config: a request (flash4.request.Request, any layout) -> the plan
its family's module composes from the pure selectors (dense: the short-sequence rule and GQA
packing of windows; packed / paged: the sequence layout and page pieces; a decode step:
decode_plan; backward: the sequence layout and the GQA head split). Shapes only: the tensors live on
the meta device."""

import dataclasses

import pytest
import torch
from cpu_helpers import expected_page_divide_free, expected_prefill_paging

from flash4.config import (COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS,
                           GATHER_ZERO_FILL, PAGE_DIVIDE_FREE, PAGE_GATHER_MAX, PAGE_PREFETCH, BwdPlan, FwdPlan,
                           bwd_config, fwd_config, select_bwd_config, select_fwd_config,
                           with_dkv_accum, with_pack_gqa, with_seq_layout)
from flash4.config.sm90 import decode_plan, head_split_config, shipped_mask_bits, shipped_window_persistent
from flash4.geometry import window_sides
from flash4.request import DECODE, CacheSpec, Request, SeqSpec

BF16, I32 = torch.bfloat16, torch.int32


def meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


def dense(sq=300, sk=300, h=8, hk=2, d=128, dv=None, **kw):
    return Request.dense(meta(2, sq, h, d), meta(2, sk, hk, d), meta(2, sk, hk, dv or d), **kw)


@pytest.mark.parametrize("sk", [300, 5000])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(64, 0)), dict(softcap=30.0),
                                dict(learnable_sink=meta(8, dtype=torch.float32)), dict(causal=True, window_size=(7, 3))])
def test_dense_plan_is_the_selectors_composition(kw, sk):
    request = dense(sk=sk, **kw)
    plan = fwd_config(request, 90)
    mask = request.mask
    expected = shipped_window_persistent(shipped_mask_bits(with_pack_gqa(select_fwd_config(
        128, "bf16", mask.causal, arch=90, local=mask.window is not None, softcap=request.score.softcap > 0,
        sink="learnable_sink" in kw, seqlen_k=sk), 8, 2)))
    assert plan == FwdPlan(expected) and plan.pack == 1 and plan.num_splits == 1
    assert plan.cfg.mask_bits == ("window_size" in kw)  # the bit-word mask on dense windows (shipped_mask_bits)
    if "window_size" in kw:  # persistent CTAs on dense windows (shipped_window_persistent)
        assert plan.cfg.persistent
    # d128: only windows pack (pack_gqa_wanted; the bf16 d64 causal forward packs too)
    assert plan.cfg.pack_gqa == (4 if "window_size" in kw else 1)


def test_dense_plan_with_value_headdim():
    plan = fwd_config(dense(d=192, dv=128, causal=True), 90)
    assert plan.cfg == select_fwd_config(192, "bf16", True, headdim_v=128, seqlen_k=300)


def _packed(paged=False, seqused_q=False, page_size=16):
    cu = meta(4, dtype=I32)
    q = meta(500, 8, 64)
    if paged:
        k = v = meta(40, page_size, 2, 64)
        return Request.varlen(q, k, v, cu, None, 200, None, None, meta(3, dtype=I32), meta(3, 10, dtype=I32))
    return Request.varlen(q, meta(600, 2, 64), meta(600, 2, 64), cu, cu, 200, None,
                          meta(3, dtype=I32) if seqused_q else None, causal=True)


@pytest.mark.parametrize("seqused_q", [False, True])
def test_varlen_plan(seqused_q):
    plan = fwd_config(_packed(seqused_q=seqused_q), 90)
    assert plan.cfg == with_seq_layout(select_fwd_config(64, "bf16", True), varlen_q=True, varlen_k=True,
                                       seqused_q=seqused_q)
    assert plan.cfg.pack_gqa == 1 and not plan.cfg.persistent  # no dense-only policies on packed q


PAGE_SWITCHES = ("FLASH4_PAGE_PIECES_ALL_WARPS", "FLASH4_PAGE_GATHER_MAX", "FLASH4_PAGE_PREFETCH",
                 "FLASH4_PAGED_KV_STAGES", "FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGE_DIVIDE_FREE",
                 "FLASH4_PAGE_ROW_SHUFFLE", "FLASH4_DECODE_COMBINE")

# The paged prefill of _packed (d64, tile_n 128) spelled out: (page_rows, four warps, K/V stages,
# page_divide_free, page_row_shuffle), or None for gathered rows, by (FLASH4_PAGE_PIECES_ALL_WARPS,
# FLASH4_PAGE_ROW_SHUFFLE). Default (flash4.config.PAGE_PIECES_ALL_WARPS, H200 A/B of 2026-12-05, and
# flash4.config.PAGE_ROW_SHUFFLE, H100 A/B): every multiple of 8 by TMA pieces with the look-ahead, pieces
# of <= 32 rows from the four producer warps with 2 stages; pieces that are whole pages (8, 16, 64; not
# 256's 128-row pieces) find their page without the division (flash4.config.PAGE_DIVIDE_FREE, since
# 2026-12-05 night), and the four-warp pieces of pages holding several (24's 8-row pieces) their row block
# by a shuffle, without the division either. FLASH4_PAGE_ROW_SHUFFLE=0: the rule before it, 8-row pieces
# (pages 8, 24) gathered below d128. FLASH4_PAGE_PIECES_ALL_WARPS=0: the previous rules (gathered up to
# page 16, one warp, 3 stages for pieces of <= 32 rows; no shuffle either way).
_ONE_WARP = {8: None, 16: None, 24: (8, False, 3, False, False), 64: (64, False, 2, True, False),
             256: (128, False, 2, False, False)}
D64_PREFILL_PAGING = {
    (None, None): {8: (8, True, 2, True, False), 16: (16, True, 2, True, False), 24: (8, True, 2, True, True),
                   64: (64, False, 2, True, False), 256: (128, False, 2, False, False)},
    (None, "0"): {8: None, 16: (16, True, 2, True, False), 24: None, 64: (64, False, 2, True, False),
                  256: (128, False, 2, False, False)},
    ("0", None): _ONE_WARP, ("0", "0"): _ONE_WARP,
}


@pytest.mark.parametrize("row_shuffle", [None, "0"])
@pytest.mark.parametrize("all_warps", [None, "0"])
@pytest.mark.parametrize("page_size", [8, 16, 24, 64, 256])
def test_paged_plan(monkeypatch, page_size, all_warps, row_shuffle):
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    if all_warps is not None:
        monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", all_warps)
    if row_shuffle is not None:
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", row_shuffle)
    plan = fwd_config(_packed(paged=True, page_size=page_size), 90)
    base = select_fwd_config(64, "bf16", False)
    want = expected_prefill_paging(page_size, base.tile_n, 64, all_warps=None if all_warps is None else False,
                                   row_shuffle=None if row_shuffle is None else False)
    # gathered: the producer zero-fills rows past seqlen_k (GATHER_ZERO_FILL); TMA pieces of
    # gcd(page_size, tile_n) rows with the look-ahead, from the four warps up to PAGE_PIECES_ALL_WARPS_MAX rows
    # (whole pages and shuffled pieces: page_divide_free; page_row_shuffle: the field left at its default
    # where off, out of the repr)
    shuffle = {"page_row_shuffle": True} if want["page_row_shuffle"] else {}
    layout = ({"page_gather": True, "gather_zero_fill": GATHER_ZERO_FILL} if want["page_gather"] else
              {"page_rows": want["page_rows"], "page_prefetch": want["page_prefetch"],
               "page_pieces_all_warps": want["page_pieces_all_warps"], "page_divide_free": want["page_divide_free"],
               **shuffle})
    assert plan.cfg == with_seq_layout(base, varlen_q=True, seqused_k=True, kv_stages=want["stages"], **layout)
    spelled = D64_PREFILL_PAGING[all_warps, row_shuffle][page_size]  # the rule above, without the helper
    got = None if plan.cfg.page_gather else (plan.cfg.page_rows, plan.cfg.page_pieces_all_warps, plan.cfg.kv_stages,
                                             plan.cfg.page_divide_free, plan.cfg.page_row_shuffle)
    assert got == spelled and plan.cfg.page_prefetch == (spelled is not None)
    assert plan.cfg.gather_zero_fill == (spelled is None and GATHER_ZERO_FILL)
    if spelled is None:
        assert not plan.cfg.page_divide_free and not plan.cfg.page_row_shuffle


@pytest.mark.parametrize("row_shuffle", [None, "0"])
@pytest.mark.parametrize("all_warps", [None, "0"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page", [8, 16, 24, 32, 64])
def test_decode_keeps_gathered_page_16(monkeypatch, page, d, all_warps, row_shuffle):
    """The four-warp page pieces, the prefill's gather limit and the row shuffle are prefill rules: a
    decode step keeps page_policy() (pages of <= PAGE_GATHER_MAX rows gathered, page 16 included; TMA
    pieces from warp 0, no row shuffle), the same plan with FLASH4_PAGE_PIECES_ALL_WARPS /
    FLASH4_PAGE_ROW_SHUFFLE unset or 0. TMA pieces that are whole pages (32, 64; not 24's 8-row pieces)
    find their page without the division (page_divide_free_policy())."""
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    if all_warps is not None:
        monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", all_warps)
    if row_shuffle is not None:
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", row_shuffle)
    seq = SeqSpec(DECODE, seqused_k=meta(4, dtype=I32), page_table=meta(4, 16, dtype=I32))
    step = Request.kvcache(meta(4, 1, 32, d), meta(64, page, 8, d), meta(64, page, 8, d), causal=True).with_seq(seq)
    plan = fwd_config(step, 90, 132)
    assert plan == decode_plan(4, 1, 32, 8, d, "bf16", True, page, 16 * page, 0, 90, 132, window_sides(None, True),
                               page_policy=(PAGE_GATHER_MAX, PAGE_PREFETCH), gather_zero_fill=GATHER_ZERO_FILL,
                               divide_free=PAGE_DIVIDE_FREE,
                               combine_policy=(COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS))
    assert not plan.cfg.page_pieces_all_warps and not plan.cfg.page_row_shuffle
    assert plan.cfg.page_gather == (page % 8 != 0 or page <= PAGE_GATHER_MAX)
    if page <= 16:
        assert plan.cfg.page_gather  # PAGE_GATHER_MAX == 16 (test_small_pages_cpu.py)
    assert plan.cfg.page_divide_free == expected_page_divide_free(page, plan.cfg.page_rows) == (page in (32, 64))


@pytest.mark.parametrize("paged, num_splits, window", [(False, 0, None), (True, 0, None), (False, 3, None),
                                                       (True, 1, (127, 0))])
def test_decode_plan_from_a_decode_request(monkeypatch, paged, num_splits, window):
    for name in PAGE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    q = meta(4, 1, 32, 128)
    if paged:
        k = v = meta(64, 64, 8, 128)
        seq = SeqSpec(DECODE, seqused_k=meta(4, dtype=I32), page_table=meta(4, 16, dtype=I32))
    else:
        k = v = meta(4, 4096, 8, 128)
        seq = SeqSpec(DECODE, seqused_k=meta(4, dtype=I32))
    base = Request.kvcache(q, k, v, causal=True, num_splits=num_splits, window_size=window)
    step = base.with_seq(seq)
    plan = fwd_config(step, 90, 132)
    sides, capacity = window_sides(window, True), 16 * 64 if paged else 4096  # pages x page_size, or seqlen_cache
    assert plan == decode_plan(4, 1, 32, 8, 128, "bf16", True, 64 if paged else 0, capacity, num_splits, 90, 132,
                               sides, page_policy=(PAGE_GATHER_MAX, PAGE_PREFETCH), divide_free=PAGE_DIVIDE_FREE,
                               combine_policy=(COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS))
    # page 64: TMA pieces that are whole pages, found without the division (PAGE_DIVIDE_FREE)
    assert (plan.cfg.page_rows, plan.cfg.page_divide_free) == ((64, True) if paged else (0, False))
    assert step.cache == CacheSpec(None, None, None, None, num_splits) and step.capacity == capacity


@pytest.mark.parametrize("kw, hk", [(dict(), 8), (dict(causal=True), 2), (dict(deterministic=True), 2),
                                    (dict(window_size=(32, 0)), 2), (dict(softcap=5.0), 1)])
def test_dense_backward_plan(kw, hk):
    from flash4.config.sm90 import shipped_dq_handoff

    request = dense(sq=2048, sk=2048, hk=hk, **kw)
    plan = bwd_config(request, 90)
    mask = request.mask
    cfg = select_bwd_config(128, "bf16", mask.causal, deterministic=kw.get("deterministic", False),
                            local=mask.window is not None, softcap="softcap" in kw)
    cfg, heads = head_split_config(cfg, 8, hk, 2048, 2048, mask.causal, mask.window)
    assert (plan.cfg, plan.heads_per_cta) == (shipped_dq_handoff(cfg), heads)


def test_backward_plan_override_and_packed_layout():
    from flash4.config.sm90 import shipped_dq_handoff

    request = dense(sq=100, sk=100, hk=1)
    assert bwd_config(request, 90).heads_per_cta == 8  # short: the whole group per CTA
    plan = bwd_config(request, 90, heads_per_cta=2)  # FLASH4_BWD_HEADS_PER_CTA
    assert plan.heads_per_cta == 2 and plan == type(plan)(
        shipped_dq_handoff(with_dkv_accum(select_bwd_config(128), 8, 1, 2)), 2)
    cu = meta(4, dtype=I32)
    packed = Request.varlen(meta(500, 8, 64), meta(600, 2, 64), meta(600, 2, 64), cu, cu, 200, 3000,
                            seqused_k=meta(3, dtype=I32), causal=True)
    plan = bwd_config(packed, 90)
    expected = with_seq_layout(select_bwd_config(64, "bf16", True), varlen_q=True, varlen_k=True, seqused_k=True)
    assert (plan.cfg, plan.heads_per_cta) == head_split_config(expected, 8, 2, 200, 3000, True, None)


def test_sm100_plans():
    """The sm100 family (unverified, served behind the first-use self-test) answers dense and packed
    varlen forward requests (seqused_k too) and refuses paged K/V and Dv != D but (192, 128); its backward plan answers
    dense and packed requests (every query head of a KV head in its CTA; packed: 1-CTA)."""
    from flash4.config import sm100

    q, k = meta(2, 300, 8, 128), meta(2, 300, 8, 128)
    plan = sm100.fwd_plan(Request.dense(q, k, k, causal=True), 100)
    assert plan == FwdPlan(sm100.select_fwd_config(128, "bf16", True))
    for seqused_q in (False, True):
        assert sm100.fwd_plan(_packed(seqused_q=seqused_q), 100).cfg == dataclasses.replace(
            sm100.select_fwd_config(64, "bf16", True), varlen_q=True, varlen_k=True, seqused_q=seqused_q)
    with pytest.raises(ValueError, match="no paged layout"):
        sm100.fwd_plan(_packed(paged=True), 100)
    cu = meta(4, dtype=I32)
    assert sm100.fwd_plan(Request.varlen(meta(500, 8, 64), meta(600, 2, 64), meta(600, 2, 64), cu, cu, 200, None, None,
                                         meta(3, dtype=I32)), 100).cfg == dataclasses.replace(
        sm100.select_fwd_config(64), varlen_q=True, varlen_k=True, seqused_k=True)
    assert sm100.fwd_plan(Request.dense(q, k, k, window_size=(3, 3)), 100).cfg.local
    with pytest.raises(ValueError, match=r"\(headdim, headdim_v\)=\(128, 64\) is not implemented"):
        sm100.fwd_plan(Request.dense(q, k, meta(2, 300, 8, 64)), 100)
    # (192, 128) is built (one Q tile per CTA), dense or packed
    q192 = meta(2, 300, 8, 192)
    assert sm100.fwd_plan(Request.dense(q192, q192, meta(2, 300, 8, 128)), 100).cfg == sm100.select_fwd_config(
        192, headdim_v=128)
    cu = meta(4, dtype=I32)  # packed hd256 (q_stage 1; compile-verified, not run on hardware)
    assert sm100.fwd_plan(Request.varlen(meta(500, 8, 256), meta(600, 2, 256), meta(600, 2, 256), cu, cu, 200, None,
                                         None), 100).cfg == dataclasses.replace(
        sm100.select_fwd_config(256), varlen_q=True, varlen_k=True)
    assert sm100.bwd_plan(Request.dense(q, k, k), 100) == BwdPlan(sm100.select_bwd_config(128), 1)
    # packed backward (1-CTA; compile-verified, not run on hardware)
    for seqused_q in (False, True):
        assert sm100.bwd_plan(_packed(seqused_q=seqused_q), 100) == BwdPlan(dataclasses.replace(
            sm100.select_bwd_config(64, "bf16", True), varlen_q=True, varlen_k=True, seqused_q=seqused_q), 4)
    assert fwd_config(Request.dense(q, k, k), 100) == FwdPlan(sm100.select_fwd_config(128))
