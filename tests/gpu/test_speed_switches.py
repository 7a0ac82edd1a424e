"""flash4's speed switches (all off by default; docs/design/speed_candidates.md) switched on, against
the float32 reference on the GPU (marker gpu; skipped without CUDA). The CPU twin is
tests/cpu/test_speed_switches_cpu.py (and tests/cpu/test_bwd_switches.py); the speed A/B is
tools/ab_switch.py.

Backward (BwdConfig.exp_before_dp_wait, dq_handoff_per_wg; the dQ postprocess's wide_stores): the
backward's plan and postprocess are routed to the switched-on variant (monkeypatch on the module
attributes flash4.backward reads at call time), then dq, dk, dv are computed into NaN-filled
tensors and judged by the suite's rule (gpu_helpers.assert_grads: err <= 2 x PyTorch's same-dtype
error + atol); each test also checks that the route reached the backward. Forward
(FwdConfig.early_q_release, lookahead_qk): the config with the switch, into NaN-filled out / lse,
judged on out and lse (flash4.reference.fwd_errors), and bitwise equal to the switch-off kernel;
FLASH4_FWD_SWITCHES (softmax_vote_first, lookahead_qk): every door bitwise against the switch off.
Shapes: several m_blocks per key tile, a partial last query tile and causal rows past the first
tile; batch x heads above the SM count for the persistent forward.
"""

import dataclasses
import math

import pytest
import torch

import flash4.backward
from flash4 import forward
from flash4.backward import flash_attn_backward
from flash4.compile import cache
from flash4.config import select_fwd_config
from flash4.kernels.sm90.fwd import FlashAttentionForwardSm90
from flash4.reference import fwd_errors
from flash4.request import Request

from gpu_helpers import assert_grads, inputs, poisoned_fwd_buffers, ref_grads


def routed_backward(monkeypatch, edit, wide=False):
    """flash4.backward's plan takes edit(cfg) as its config, its postprocess wide_stores=wide; returns
    a list that counts the routed plans."""
    plan_fn, post_fn, calls = flash4.backward.bwd_config, cache.get_bwd_postprocess_runner, []

    def plan(*args, **kwargs):
        p = plan_fn(*args, **kwargs)
        calls.append(1)
        return dataclasses.replace(p, cfg=edit(p.cfg))

    monkeypatch.setattr(flash4.backward, "bwd_config", plan)
    if wide:
        monkeypatch.setattr(cache, "get_bwd_postprocess_runner",
                            lambda *a, **kw: post_fn(*a, **dict(kw, wide_stores=True)))
    return calls


def check_switched_bwd(monkeypatch, edit, b, s, h, d, causal, wide=False, seed=0):
    q, k, v, dout = inputs(b, s, s, h, h, d, seed=seed)
    scale = d ** -0.5
    out, lse = forward.run(Request.dense(q, k, v, scale, causal))
    calls = routed_backward(monkeypatch, edit, wide)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, causal, *grads)
    torch.cuda.synchronize()
    assert calls, "the route did not reach flash4.backward (host code moved)"
    assert_grads(grads, ref_grads(q, k, v, dout, causal, True), ref_grads(q, k, v, dout, causal, False))


# (head dim, seqlen): seqlen 1000 leaves a partial last query tile; several m_blocks per key tile
SHAPES = [(64, 1000), (96, 777), (128, 1000), (256, 517)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, s", SHAPES, ids=[f"d{d}-s{s}" for d, s in SHAPES])
def test_exp_before_dp_wait(monkeypatch, d, s, causal):
    """exp_before_dp_wait (d64 at tile_m 64: the switch needs it)."""
    def edit(cfg):
        return dataclasses.replace(cfg, tile_m=64 if cfg.tile_m == 128 else cfg.tile_m, exp_before_dp_wait=True)
    check_switched_bwd(monkeypatch, edit, 2, s, 4, d, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, s", [(64, 1000), (96, 777)], ids=["d64-s1000", "d96-s777"])
def test_dq_handoff_per_wg(monkeypatch, d, s, causal):
    """dq_handoff_per_wg (the accumulator-order configs: d64 tile_m 128, d96 tile_m 64), and with the
    postprocess's wide stores on top."""
    check_switched_bwd(monkeypatch, lambda cfg: dataclasses.replace(cfg, dq_handoff_per_wg=True), 2, s, 4, d, causal)
    check_switched_bwd(monkeypatch, lambda cfg: dataclasses.replace(cfg, dq_handoff_per_wg=True), 1, s, 2, d, causal,
                       wide=True, seed=1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, s", [(64, 1000), (96, 777), (128, 1000)], ids=["d64-s1000", "d96-s777", "d128-s1000"])
def test_postprocess_wide_stores(monkeypatch, d, s, causal):
    """The dQ postprocess's 16-byte stores (accumulator order at d64 / d96, row-major at d128)."""
    check_switched_bwd(monkeypatch, lambda cfg: cfg, 2, s, 4, d, causal, wide=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_early_q_release(d, causal):
    """early_q_release on the persistent forward (with O in its own smem buffer): out and lse against
    the reference, bitwise equal to the same config switched off; 1000 rows (a partial last tile),
    batch x heads x tiles well above the SM count (several tiles per persistent CTA)."""
    b, s, h = 4, 1000, 16
    q, k, v, _ = inputs(b, s, s, h, h, d)
    scale = d ** -0.5
    base = select_fwd_config(d, "bf16", causal, seqlen_k=s)
    off = base if base.persistent else dataclasses.replace(base, persistent=True, lpt=True)
    if not FlashAttentionForwardSm90(off).separate_o:
        pytest.skip(f"no smem for O's own buffer: early_q_release does not apply to {off}")
    results = []
    for cfg in (dataclasses.replace(off, early_q_release=True), off):
        out, lse = poisoned_fwd_buffers(q)
        lse_split = torch.full((2,) + tuple(lse.shape), math.nan, device="cuda", dtype=torch.float32)
        cache.get_fwd_runner(cfg)(q, k, v, out, lse, scale, lse_split=lse_split)
        torch.cuda.synchronize()
        results.append((out, lse, lse_split))
    out, lse, _ = results[0]
    assert not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, scale, causal)
    assert errs["ok"], errs
    for a, b_ in zip(results[0], results[1]):
        assert torch.equal(a, b_)


# FLASH4_BWD_SWITCHES (flash4.config.sm90.with_bwd_switches): the backward's candidates of
# docs/design/speed_candidates.md section 6b, alone and together, through the plain door.
ENV_SWITCHES = ["lse_early", "lse_early,exp_before_dp_wait", "dq_whole", "dq_whole,dq_handoff_per_wg",
                "dq_whole,dq_handoff_per_wg,lse_early,exp_before_dp_wait"]
ENV_SHAPES = [(64, 1000, 4, 4), (128, 1000, 4, 4), (128, 517, 8, 2)]  # (d, seqlen, heads, kv heads)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, s, h, hk", ENV_SHAPES, ids=[f"d{d}-s{s}-h{h}/{hk}" for d, s, h, hk in ENV_SHAPES])
@pytest.mark.parametrize("switches", ENV_SWITCHES)
def test_bwd_switches_env(monkeypatch, switches, d, s, h, hk, causal):
    """The plan carries each switch that applies (with_bwd_switches), and dq, dk, dv, computed into
    NaN-filled tensors, pass the suite's rule (a partial last query tile; GQA with the head split)."""
    from flash4.config import bwd_config
    from flash4.config.sm90 import with_bwd_switches

    monkeypatch.setenv("FLASH4_BWD_SWITCHES", switches)
    q, k, v, dout = inputs(2, s, s, h, hk, d, seed=3)
    scale = d ** -0.5
    req = Request.dense(q, k, v, scale, causal)
    cfg = bwd_config(req, 90).cfg
    monkeypatch.delenv("FLASH4_BWD_SWITCHES")
    assert cfg == with_bwd_switches(bwd_config(req, 90).cfg, switches.split(","))
    monkeypatch.setenv("FLASH4_BWD_SWITCHES", switches)
    out, lse = forward.run(req)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, causal, *grads)
    torch.cuda.synchronize()
    assert_grads(grads, ref_grads(q, k, v, dout, causal, True), ref_grads(q, k, v, dout, causal, False))


# FLASH4_FWD_SWITCHES=softmax_vote_first (FwdConfig.softmax_vote_first; speed_candidates.md section 8):
# the same operations per element as the shipped softmax, so every door's out and lse must equal the
# switch-off call bit for bit, the exact path (scores of magnitude ~1e7: |m * c| >= FWD_EXACT_REF_LOG2)
# and ragged query tiles included. FLASH4_FWD_SWITCHES=lookahead_qk (FwdConfig.lookahead_qk, section 5):
# the same instructions per value in a different issue order (the next block's Q K^T under this
# block's softmax), so bit for bit as well; it is built where Dv < D fits the registers as shipped,
# the (128, 64) forward of every door (with_fwd_switches), hence those head dims for it. Since
# 2026-12-03 night the dense bf16 (128, 64) causal forward ships it (shipped_lookahead_qk), so on the
# dense_causal door both calls run it; test_lookahead_qk below compares the configs on and off directly.
# FLASH4_FWD_SWITCHES=mask_bits (FwdConfig.mask_bits): the same mask from per-row bit words (R2P), so
# bit for bit as well, on every masked door (causal, window, sink, seqlen_k tails, GQA-packed windows).
# FLASH4_FWD_SWITCHES=pv_zero_init (FwdConfig.pv_zero_init): the tile's first P V writes acc_O instead
# of adding to zeros (0 + x = x): bit for bit on every door, tiles without key blocks included (the
# varlen door's empty sequence, the kvcache door's split tails). FLASH4_FWD_SWITCHES=flat_tile_order
# (FwdConfig.flat_tile_order): the same tiles in the same order, decoded with fewer divisions.
# FLASH4_FWD_SWITCHES=split_row_max (FwdConfig.split_row_max): the row max from two chains (a max is
# exact in any order); softmax_branch_free (FwdConfig.softmax_branch_free): the exact path by selects,
# x - 0 = x off it: bit for bit on every door, the exact-path magnitudes included. gather_clamp_late
# (FwdConfig.gather_clamp_late, gathered pages: the paged door's page 16): the same clamped page index.
# gather_ptr_shuffle (FwdConfig.gather_ptr_shuffle, gathered pages): the same row addresses, shuffled.
# pin_p_convert (FwdConfig.pin_p_convert): the same P words, passed through a mov. page_divide_free
# (FwdConfig.page_divide_free, TMA page pieces: the paged and kvcache doors): the same piece coordinates.
FWD_ENV_KINDS = ["dense", "dense_causal", "window_softcap", "sink", "window_sink", "varlen", "paged", "kvcache"]
FWD_ENV_CASES = ([("softmax_vote_first", d, None) for d in (64, 96, 128, 192, 256)]
                 + [("lookahead_qk", 128, 64)]
                 + [("mask_bits", d, None) for d in (64, 96, 128, 192, 256)]
                 + [("mask_bits", 128, 64), ("mask_bits", 192, 128)]
                 + [("rescale_always", d, None) for d in (64, 96, 128, 192, 256)]
                 + [("rescale_always", 128, 64), ("rescale_always", 192, 128)]
                 + [("rescale_always,softmax_vote_first", d, None) for d in (32, 128)]
                 + [("pv_zero_init", d, None) for d in (64, 96, 128, 192, 256)]
                 + [("pv_zero_init", 128, 64), ("pv_zero_init", 192, 128), ("pv_zero_init", 80, None)]
                 + [("flat_tile_order", d, None) for d in (64, 128, 256)]
                 + [("flat_tile_order,pv_zero_init", 128, None)]
                 + [("split_row_max", d, None) for d in (32, 128)]
                 + [("softmax_branch_free", d, None) for d in (32, 64, 128, 256)]
                 + [("softmax_branch_free", 128, 64)]
                 + [("softmax_branch_free,rescale_always", d, None) for d in (32, 128)]
                 + [("softmax_branch_free,rescale_always,split_row_max", 32, None)]
                 + [("gather_clamp_late", d, None) for d in (64, 128)]
                 + [("gather_ptr_shuffle", d, None) for d in (64, 96, 128)]
                 + [("pin_p_convert", d, None) for d in (64, 128, 256)]
                 + [("pin_p_convert,softmax_vote_first", 64, None), ("pin_p_convert", 128, 64)]
                 + [("page_divide_free", d, None) for d in (64, 128, 256)]
                 + [("page_divide_free,page_row_shuffle", d, None) for d in (64, 192)]
                 + [("pdl_combine", d, None) for d in (64, 128)]
                 + [("combine_prefetch", d, None) for d in (64, 128)]
                 + [("pdl_combine,combine_prefetch", 128, None)])


def _fwd_call(kind, d, mag, dv=None):
    from flash4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    dv = d if dv is None else dv
    g = torch.Generator(device="cuda").manual_seed(11)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    if kind == "window_sink":  # gpt-oss's shape: a 128-key window, sinks, GQA (packed query tiles)
        q, k, v = rnd(2, 777, 8, d) * mag, rnd(2, 777, 1, d) * mag, rnd(2, 777, 1, dv)
        sink = torch.randn(8, device="cuda", generator=g)
        return lambda: flash_attn_func(q, k, v, causal=True, window_size=(127, 0), learnable_sink=sink,
                                       return_lse=True)
    if kind in ("dense", "dense_causal", "window_softcap", "sink"):
        q, k, v = rnd(2, 777, 4, d) * mag, rnd(2, 901, 2, d) * mag, rnd(2, 901, 2, dv)
        kw = {"causal": kind == "dense_causal", "return_lse": True}
        if kind == "window_softcap":
            kw.update(window_size=(200, 33), softcap=30.0)
        if kind == "sink":
            kw.update(causal=True, learnable_sink=torch.randn(4, device="cuda", generator=g))
        return lambda: flash_attn_func(q, k, v, **kw)
    if kind == "varlen":
        lens = [300, 1, 0, 517]
        cu = torch.tensor([0, 300, 301, 301, 818], device="cuda", dtype=torch.int32)
        q, k, v = rnd(818, 4, d) * mag, rnd(818, 2, d) * mag, rnd(818, 2, dv)
        return lambda: flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, return_lse=True)
    page = 16 if kind == "paged" else 64
    k_cache, v_cache = rnd(40, page, 2, d) * mag, rnd(40, page, 2, dv)
    table = torch.randperm(40, device="cuda", generator=g).to(torch.int32).view(2, 20)
    if kind == "paged":
        q = rnd(2 * 129, 4, d) * mag
        cu = torch.tensor([0, 129, 258], device="cuda", dtype=torch.int32)
        used = torch.tensor([20 * page - 5, 200], device="cuda", dtype=torch.int32)
        return lambda: flash_attn_varlen_func(q, k_cache, v_cache, cu, None, 129, None, seqused_k=used,
                                              page_table=table, causal=True, return_lse=True)
    q = rnd(2, 1, 4, d) * mag
    lens = torch.tensor([1000, 77], device="cuda", dtype=torch.int32)
    return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table, return_lse=True)


@pytest.mark.parametrize("mag", [1.0, 1000.0], ids=["normal", "exact_path"])
@pytest.mark.parametrize("switch, d, dv", FWD_ENV_CASES,
                         ids=[f"{n}-d{d}" + (f"-dv{dv}" if dv else "") for n, d, dv in FWD_ENV_CASES])
@pytest.mark.parametrize("kind", FWD_ENV_KINDS)
def test_fwd_switches_env(monkeypatch, kind, switch, d, dv, mag):
    """Every door with FLASH4_FWD_SWITCHES naming the switch: out / lse (finite where rows see keys)
    equal the switch-off call's bit for bit."""
    from flash4.config import SUPPORTED_HEADDIMS
    from flash4.config.sm90 import with_fwd_switches  # noqa: F401  (the switch's one source)

    if kind in ("paged", "kvcache") and d not in SUPPORTED_HEADDIMS:
        # a KV cache / paged pool is not zero-padded per call: those doors refuse d32 / d80 (validate)
        pytest.skip(f"the {kind} door takes head dims {SUPPORTED_HEADDIMS}")
    call = _fwd_call(kind, d, mag, dv)
    monkeypatch.delenv("FLASH4_FWD_SWITCHES", raising=False)
    out_off, lse_off = (t.clone() for t in call()[:2])
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", switch)
    out_on, lse_on = call()[:2]
    torch.cuda.synchronize()
    assert not out_on.isnan().any()
    assert torch.equal(out_on, out_off)
    assert torch.equal(lse_on, lse_off)


# FwdConfig.lookahead_qk where it needs a narrower key tile than shipped ((192, 128): 128 -> 112, causal
# 80; flash4.config.sm90.lookahead_qk_config) and the (128, 64) configs: the switched-on runner against
# the same tile switched off, bit for bit, and against the float32 reference (the suite's 2x rule).
# Key counts: one block, two, an odd and an even number after the first (the pair loop and its odd
# step), a partial last block; a partial last query tile (777 queries; causal: as many as keys, so
# every row sees one, and the tiles of a sequence visit 1 .. all of its blocks).
LOOKAHEAD_CASES = [(192, 128, False), (192, 128, True), (128, 64, False), (128, 64, True)]


@pytest.mark.parametrize("sk", [100, 224, 337, 1000])
@pytest.mark.parametrize("d, dv, causal", LOOKAHEAD_CASES,
                         ids=[f"d{d}-dv{dv}-" + ("causal" if c else "full") for d, dv, c in LOOKAHEAD_CASES])
def test_lookahead_qk(d, dv, causal, sk):
    from flash4.config.sm90 import lookahead_qk_config

    b, h = 2, 8
    sq = sk if causal else 777  # causal: every row sees a key
    q, k, v, _ = inputs(b, sq, sk, h, h, d, dv)
    scale = d ** -0.5
    on = lookahead_qk_config(select_fwd_config(d, "bf16", causal, headdim_v=dv))
    results = []
    for cfg in (on, dataclasses.replace(on, lookahead_qk=False)):
        out, lse = poisoned_fwd_buffers(q, dv)
        lse_split = torch.full((2,) + tuple(lse.shape), math.nan, device="cuda", dtype=torch.float32)
        cache.get_fwd_runner(cfg)(q, k, v, out, lse, scale, lse_split=lse_split)
        torch.cuda.synchronize()
        results.append((out, lse, lse_split))
    out, lse, _ = results[0]
    assert not out.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, scale, causal)
    assert errs["ok"], errs
    for a, b_ in zip(results[0], results[1]):
        assert torch.equal(a.nan_to_num(), b_.nan_to_num())


# FwdConfig.mask_bits, shipped on the dense window forwards since 2026-12-04 (shipped_mask_bits): the
# planned config against the same config switched off, run directly, bit for bit (out, lse, the log2
# split), and against the float32 reference; NaN-poisoned outputs. gpt-oss's shape (a 128-key window,
# sinks, 8:1 GQA: packed 192-row tiles), a two-sided band, softcap; queries != keys and equal.
MASK_BITS_CASES = [(64, 8, 1, (127, 0), True, True, 0.0), (128, 4, 4, (200, 33), False, False, 0.0),
                   (64, 4, 2, (50, 50), False, False, 30.0), (96, 6, 2, (300, 0), True, False, 0.0)]


@pytest.mark.parametrize("sq, sk", [(777, 901), (1000, 1000), (64, 3000)])
@pytest.mark.parametrize("d, h, hk, window, causal, sink, softcap", MASK_BITS_CASES,
                         ids=[f"d{c[0]}-h{c[1]}:{c[2]}-w{c[3][0]}_{c[3][1]}" + ("-causal" if c[4] else "")
                              + ("-sink" if c[5] else "") + ("-softcap" if c[6] else "") for c in MASK_BITS_CASES])
def test_mask_bits_shipped(d, h, hk, window, causal, sink, softcap, sq, sk):
    from flash4.config import fwd_config
    from flash4.geometry import window_sides

    q, k, v, _ = inputs(2, sq, sk, h, hk, d)
    scale = d ** -0.5
    sinks = torch.randn(h, device="cuda", dtype=torch.float32) if sink else None
    on = fwd_config(Request.dense(q, k, v, scale, causal, window, softcap, sinks), 90).cfg
    assert on.mask_bits and on.local
    sides = window_sides(window, causal)
    results = []
    for cfg in (on, dataclasses.replace(on, mask_bits=False)):
        out, lse = poisoned_fwd_buffers(q, d)
        lse_split = torch.full((2,) + tuple(lse.shape), math.nan, device="cuda", dtype=torch.float32)
        cache.get_fwd_runner(cfg)(q, k, v, out, lse, scale, lse_split=lse_split, window=sides, softcap=softcap,
                                  sink=sinks)
        torch.cuda.synchronize()
        results.append((out, lse, lse_split))
    for a, b_ in zip(results[0], results[1]):
        assert torch.equal(a.nan_to_num(), b_.nan_to_num())
    out, lse, _ = results[0]
    assert not out.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, scale, causal, window_size=window, softcap=softcap, learnable_sink=sinks)
    assert errs["ok"], errs


# FwdConfig.p_smem (first run on the H200 by this test, 2026-12-04; shipped since for the plain dense
# d96 forward at 192 rows, flash4.config.sm90.shipped_p_smem, which the doors' tests run too): P
# through a shared-memory tile into the P V wgmma. The same P values and the same MMAs, so out / lse
# are compared with the register path's at the same tile (bitwise expected, within 1e-2 / 1e-3
# demanded) and against the float32 reference (the 2x rule); NaN-poisoned outputs; d96's 192-row tile
# (what the switch is for) against the reference only. Queries != keys, partial tiles, causal and not.
P_SMEM_CASES = [(96, 128, True), (96, 128, False), (96, 192, True), (96, 192, False), (64, 128, True),
                (128, 128, False)]


@pytest.mark.parametrize("sq, sk", [(777, 901), (1000, 1000), (64, 300)])
@pytest.mark.parametrize("d, tile_m, causal", P_SMEM_CASES,
                         ids=[f"d{d}-m{m}-" + ("causal" if c else "full") for d, m, c in P_SMEM_CASES])
def test_p_smem(d, tile_m, causal, sq, sk):
    if causal and sq > sk:
        sq = sk  # every row sees a key
    q, k, v, _ = inputs(2, sq, sk, 4, 4, d)
    scale = d ** -0.5
    shipped = select_fwd_config(d, "bf16", causal)
    on = dataclasses.replace(shipped, p_smem=True, tile_m=tile_m)
    results = []
    for cfg in (on, dataclasses.replace(on, p_smem=False) if tile_m == shipped.tile_m else None):
        if cfg is None:
            continue
        out, lse = poisoned_fwd_buffers(q, d)
        cache.get_fwd_runner(cfg)(q, k, v, out, lse, scale)
        torch.cuda.synchronize()
        results.append((out, lse))
    out, lse = results[0]
    assert not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, scale, causal)
    assert errs["ok"], errs
    if len(results) == 2:
        out_r, lse_r = results[1]
        assert (out.float() - out_r.float()).abs().max() <= 1e-2 * out_r.float().abs().max()
        assert (lse - lse_r).abs().max() <= 1e-3


# BwdConfig.sink_delta_db (shipped with sink_delta where it fits since 2026-12-03 evening): the sink path's
# partial sums of D double-buffered by step parity, the dQEmpty wait at the dQ hand-off, against the one
# buffer of before (routed). The same sums in the same order: deterministic, dq, dk, dv and the kernel's D
# equal bit for bit; otherwise dk, dv bitwise (each CTA owns its key tile) and dq, D (added across key
# tiles in any order) within fp32 rounding. CTAs of one step, of two and of many (window 128 / causal /
# full; GQA head split, a partial last query tile, packed varlen); NaN-poisoned outputs.
DB_CASES = [(64, 1000, 8, 8, True, (127, 0)), (64, 1000, 8, 2, True, None), (128, 777, 4, 4, False, None),
            (128, 1000, 4, 4, True, (127, 0)), (96, 300, 4, 4, False, (40, 7)), (128, 517, 8, 2, True, None),
            (192, 517, 4, 4, True, None), (64, 100, 4, 4, True, None)]


def _sink_bwd(req, dout, out, lse):
    from flash4 import backward

    delta = torch.full_like(lse, math.nan)
    grads = backward.run(req, dout, out, lse, None, None, delta=delta)
    torch.cuda.synchronize()
    return tuple(grads) + (delta,)


@pytest.mark.parametrize("det", [False, True], ids=["", "det"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("d, s, h, hk, causal, window", DB_CASES,
                         ids=[f"d{c[0]}-s{c[1]}-h{c[2]}/{c[3]}{'-causal' if c[4] else ''}"
                              f"{'-w' + str(c[5][0]) if c[5] else ''}" for c in DB_CASES])
def test_sink_delta_db_bitwise(monkeypatch, d, s, h, hk, causal, window, varlen, det):
    from flash4.config import bwd_config

    monkeypatch.delenv("FLASH4_BWD_SWITCHES", raising=False)
    q, k, v, dout = inputs(2, s, s, h, hk, d, seed=5)
    sink = torch.randn(h, device="cuda")
    window = window or (-1, -1)
    if varlen:  # two sequences, s // 3 and 2 s - s // 3 rows
        n = 2 * s - s // 3
        cu = torch.tensor([0, s // 3, 2 * s], device="cuda", dtype=torch.int32)
        q, k, v, dout = (t.reshape(2 * s, *t.shape[2:]) for t in (q, k, v, dout))
        make = lambda **kw: Request.varlen(q, k, v, cu, cu, n, n, causal=causal, window_size=window, **kw)
    else:
        make = lambda **kw: Request.dense(q, k, v, None, causal, window, **kw)
    out, lse = forward.run(make(learnable_sink=sink))
    req = make(deterministic=det)
    assert bwd_config(req, 90, sink_delta=True).cfg.sink_delta_db  # shipped
    shipped = _sink_bwd(req, dout, out, lse)
    calls = routed_backward(monkeypatch, lambda cfg: dataclasses.replace(cfg, sink_delta_db=False))
    single = _sink_bwd(req, dout, out, lse)
    assert calls, "the route did not reach flash4.backward (host code moved)"
    for name, a, b in zip(("dq", "dk", "dv", "delta"), shipped, single):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), name
        if det or name in ("dk", "dv"):
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2 if name == "dq" else 1e-5, atol=1e-4)


def grads_switched(monkeypatch, switch, grads, dq_bitwise):
    """(on, off): grads() with FLASH4_BWD_SWITCHES=switch and without; asserts no NaN and dk / dv (dq too
    where dq_bitwise: a fixed key-block order) equal bit for bit."""
    monkeypatch.delenv("FLASH4_BWD_SWITCHES", raising=False)
    off = grads()
    monkeypatch.setenv("FLASH4_BWD_SWITCHES", switch)
    on = grads()
    torch.cuda.synchronize()
    for name, a, b_ in zip(("dq", "dk", "dv"), on, off):
        assert not a.isnan().any(), name
        if name != "dq" or dq_bitwise:
            assert torch.equal(a, b_), name
    return on, off


# BwdConfig.mask_rel (FLASH4_BWD_SWITCHES=mask_rel): the backward's P^T mask from one step's bounds
# relative to the thread's first element hides the same elements as the per-row rule, so the
# gradients equal the switch-off call's bit for bit: dk / dv always (each CTA owns its key tile), dq
# too with deterministic=True (its key-block order fixed). With the whole-tile per-warpgroup dQ
# hand-off it is what makes the d128 window backward spill-free, and it ships there since 2026-12-04
# (flash4.config.sm90.shipped_dq_handoff): the d128 window cases run that shipped kernel on both
# calls (the switch cannot turn it off), the other cases compare the switch on and off; every case
# against the float32 reference (the suite's 2x rule). NaN-filled gradients; partial tiles at both
# sequence ends; windows with both sides, one side, and causal + window; GQA.
MASK_REL_CASES = [  # (d, sq, sk, h, hk, causal, window_size)
    (128, 1000, 1000, 4, 4, True, (-1, -1)),
    (128, 777, 1100, 4, 2, False, (200, 33)),
    (128, 1000, 1000, 4, 4, True, (300, -1)),
    (128, 1100, 700, 4, 4, False, (150, 150)),
    (64, 1000, 1000, 8, 2, True, (-1, -1)),
    (64, 517, 901, 4, 4, False, (127, 0)),
    (96, 700, 700, 4, 4, True, (100, 0)),
    (256, 600, 600, 4, 4, True, (-1, -1)),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("d, sq, sk, h, hk, causal, window", MASK_REL_CASES,
                         ids=[f"d{c[0]}-{c[1]}x{c[2]}-h{c[3]}/{c[4]}-{'causal' if c[5] else 'full'}-w{c[6][0]}_{c[6][1]}"
                              for c in MASK_REL_CASES])
def test_bwd_mask_rel(monkeypatch, d, sq, sk, h, hk, causal, window, deterministic):
    from flash4 import flash_attn_func

    q, k, v, dout = inputs(2, sq, sk, h, hk, d, seed=5)

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal, window_size=window, deterministic=deterministic)
        return torch.autograd.grad(out, leaves, dout)

    on, _ = grads_switched(monkeypatch, "mask_rel", grads, deterministic)
    assert_grads(on, ref_grads(q, k, v, dout, causal, True, window_size=window),
                 ref_grads(q, k, v, dout, causal, False, window_size=window))


# BwdConfig.dpsum_scaled (FLASH4_BWD_SWITCHES=dpsum_scaled): the host multiplies D by the softmax scale
# (fp32, after the dLSE subtraction) and the step reads it instead of forming the same fp32 product
# itself, so the gradients equal the switch-off call's bit for bit (deterministic dQ: its key-block
# order fixed; dK / dV always). Where the step does not form dS by fma (softcap; d128 packed layouts,
# windows) the switch does not apply and both calls run the same kernel. The LSE-gradient path
# (return_lse with a gradient through lse) checks that the scale comes after the subtraction.
DPSUM_CASES = [  # (d, s, h, hk, causal, window, softcap, lse_grad)
    (64, 1000, 4, 4, True, (-1, -1), 0.0, False),
    (64, 777, 8, 2, False, (-1, -1), 0.0, True),
    (96, 700, 4, 4, False, (-1, -1), 0.0, False),
    (128, 1000, 4, 4, False, (-1, -1), 0.0, True),
    (128, 1000, 8, 2, True, (-1, -1), 0.0, False),
    (128, 900, 4, 4, False, (200, 33), 0.0, False),
    (192, 600, 4, 4, True, (-1, -1), 0.0, False),
    (64, 600, 4, 4, True, (-1, -1), 30.0, False),
]


@pytest.mark.parametrize("d, s, h, hk, causal, window, softcap, lse_grad", DPSUM_CASES,
                         ids=[f"d{c[0]}-s{c[1]}-h{c[2]}/{c[3]}-{'causal' if c[4] else 'full'}-w{c[5][0]}_{c[5][1]}"
                              f"-cap{c[6]:g}{'-dlse' if c[7] else ''}" for c in DPSUM_CASES])
def test_bwd_dpsum_scaled(monkeypatch, d, s, h, hk, causal, window, softcap, lse_grad):
    from flash4 import flash_attn_func

    q, k, v, dout = inputs(2, s, s, h, hk, d, seed=7)
    dlse = torch.randn(2, h, s, device=q.device, dtype=torch.float32)

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn_func(*leaves, causal=causal, window_size=window, softcap=softcap, return_lse=True,
                                   deterministic=True)
        outputs, upstream = ((out, lse), (dout, dlse)) if lse_grad else ((out,), (dout,))
        return torch.autograd.grad(outputs, leaves, upstream)

    on, _ = grads_switched(monkeypatch, "dpsum_scaled", grads, True)
    if not lse_grad:
        assert_grads(on, ref_grads(q, k, v, dout, causal, True, window_size=window, softcap=softcap),
                     ref_grads(q, k, v, dout, causal, False, window_size=window, softcap=softcap))


def test_bwd_dpsum_scaled_varlen(monkeypatch):
    """The packed layout (d64: the switch applies; d128: it does not, the same kernel both calls),
    with seqused_k and an empty sequence: bit for bit."""
    from gpu_helpers import make_varlen, run_bwd_varlen

    for d in (64, 128):
        q, k, v, cu_q, cu_k = make_varlen([300, 0, 517, 64], [300, 0, 700, 64], 4, 2, d, seed=2)
        dout = torch.randn_like(q)
        seqused_k = (cu_k[1:] - cu_k[:-1]).clamp(max=600).to(torch.int32)
        monkeypatch.delenv("FLASH4_BWD_SWITCHES", raising=False)
        off = run_bwd_varlen(q, k, v, cu_q, cu_k, dout, True, seqused_k=seqused_k, deterministic=True)
        monkeypatch.setenv("FLASH4_BWD_SWITCHES", "dpsum_scaled")
        on = run_bwd_varlen(q, k, v, cu_q, cu_k, dout, True, seqused_k=seqused_k, deterministic=True)
        for name, a, b_ in zip(("dq", "dk", "dv"), on, off):
            assert torch.equal(a, b_), (d, name)


# FwdConfig.page_pieces_all_warps (FLASH4_FWD_SWITCHES=page_pieces_all_warps; TMA page pieces with the
# page-table look-ahead): the four producer warps issue a key block's page pieces, warp 0 alone arrives
# on the stage's full barrier with the block's bytes. The same bytes into the same smem slots, so bit
# for bit against the switch off and against the same keys laid out contiguously; the pool's slots
# outside the sequences hold NaN (nothing may leak); pages 8 .. 64 (16 .. 2 pieces per 128-key block,
# pages up to 16 gathered unless FLASH4_PAGE_GATHER_MAX=0), 2 and 3 K/V stages, GQA 8 / 2.
PIECES_CASES = [(p, d, s) for p in (8, 16, 32, 64) for d in (64, 128) for s in (2, 3)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size, d, stages", PIECES_CASES,
                         ids=[f"page{p}-d{d}-s{s}" for p, d, s in PIECES_CASES])
def test_page_pieces_all_warps(monkeypatch, page_size, d, stages, causal):
    import ab_pages  # tools/: the door's plan for a page size (shipped_config)

    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "0")
    monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "1")
    monkeypatch.setenv("FLASH4_PAGED_KV_STAGES", str(stages))
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", "page_pieces_all_warps")
    assert ab_pages.shipped_config(page_size).page_pieces_all_warps  # the door's plan takes it

    def switch_off():
        monkeypatch.delenv("FLASH4_FWD_SWITCHES")
        monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "0")  # the prefill default since 2026-12-05
        assert not ab_pages.shipped_config(page_size).page_pieces_all_warps

    _paged_on_off_contiguous(page_size, d, causal, page_size + d, switch_off)


def _paged_on_off_contiguous(page_size, d, causal, seed, switch_off):
    """A paged varlen forward (GQA 8 / 2, PAGED_LENS, NaN in the pool outside the sequences) through the
    door as the environment stands, checked against the reference; then switch_off() and the same
    call again, and the same keys laid out contiguously: out / lse bitwise equal to the first call's
    on every row of a sequence."""
    from flash4.reference import varlen_row_mask

    from gpu_helpers import PAGED_LENS, check_fwd_varlen, make_varlen, paged_pool, run_poisoned_varlen

    q, k, v, cu_q, cu_k = make_varlen(*PAGED_LENS, 8, 2, d, seed=seed)
    k_cache, v_cache, table, used = paged_pool(k, v, cu_k, page_size, seed=page_size, fill=math.nan)
    out_on, lse_on = check_fwd_varlen(q, k_cache, v_cache, cu_q, None, causal, seqused_k=used, page_table=table)
    switch_off()
    out_off, lse_off = run_poisoned_varlen(q, k_cache, v_cache, cu_q, None, causal, seqused_k=used, page_table=table)
    out_c, lse_c = run_poisoned_varlen(q, k, v, cu_q, cu_k, causal)
    torch.cuda.synchronize()
    rows = varlen_row_mask(cu_q, q.shape[0])
    for out, lse in ((out_off, lse_off), (out_c, lse_c)):
        assert torch.equal(out_on[rows], out[rows]) and torch.equal(lse_on[:, rows], lse[:, rows])


# The shipped paged-prefill rule since 2026-12-05 (flash4.config.PAGE_PIECES_ALL_WARPS: TMA page pieces
# for every multiple of 8, four producer warps for pieces of <= 32 rows; since 2026-12-05 late night
# flash4.config.PAGE_ROW_SHUFFLE: whole pages and, below d128 or for 8-row pieces, pages of several pieces
# without the division, 8-row pieces no longer gathered below d128) through the door, against the previous rule (FLASH4_PAGE_PIECES_ALL_WARPS=0: pages <= 16 gathered, one
# warp) and the contiguous layout: bit for bit, NaN in the pool outside the sequences.
DEFAULT_PAGES_CASES = [(p, d) for p in (8, 16, 24, 32, 48) for d in (64, 128)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size, d", DEFAULT_PAGES_CASES, ids=[f"page{p}-d{d}" for p, d in DEFAULT_PAGES_CASES])
def test_page_pieces_default_rule(monkeypatch, page_size, d, causal):
    for name in ("FLASH4_PAGE_GATHER_MAX", "FLASH4_PAGE_PREFETCH", "FLASH4_PAGED_KV_STAGES", "FLASH4_FWD_SWITCHES",
                 "FLASH4_PAGE_PIECES_ALL_WARPS", "FLASH4_PAGE_ROW_SHUFFLE", "FLASH4_PAGE_DIVIDE_FREE"):
        monkeypatch.delenv(name, raising=False)
    _paged_on_off_contiguous(page_size, d, causal, page_size * 3 + d,
                             lambda: monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "0"))


# FwdConfig.page_divide_free (FLASH4_FWD_SWITCHES=page_divide_free; TMA page pieces): a piece's page and
# row block from its index, the division skipped where a piece is a whole page. Pages 8 / 16 / 32 / 128
# (whole pages: pieces of gcd(page, 128) = page rows), 48 / 96 / 256 (3 / 3 / 2 pieces per page: the
# general path; with FwdConfig.page_row_shuffle too: the row block shuffled from the lookup lane, no
# division); the three producers: four warps with the look-ahead (the shipped rule), warp 0 with it
# (FLASH4_PAGE_PIECES_ALL_WARPS=0) and warp 0 without it (FLASH4_PAGE_PREFETCH=0: load_kv), the gather
# off; against the switch off and the contiguous layout: bit for bit, NaN in the pool outside the
# sequences.
DIVIDE_FREE_CASES = [(p, d, w) for p in (8, 16, 32, 48, 96, 128, 256) for d in (64, 128)
                     for w in ("four", "one", "noprefetch")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size, d, producer", DIVIDE_FREE_CASES,
                         ids=[f"page{p}-d{d}-{w}" for p, d, w in DIVIDE_FREE_CASES])
@pytest.mark.parametrize("row_shuffle", [False, True], ids=["divide", "row_shuffle"])
def test_page_divide_free(monkeypatch, page_size, d, producer, causal, row_shuffle):
    import ab_pages  # tools/: the door's plan for a page size (shipped_config)

    for name in ("FLASH4_PAGE_PREFETCH", "FLASH4_PAGED_KV_STAGES", "FLASH4_PAGE_PIECES_ALL_WARPS",
                 "FLASH4_PAGE_ROW_SHUFFLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "0")  # TMA pieces at every page size
    if not row_shuffle:  # the paged prefill's default shuffles d64's pages of several pieces since 2026-12-05 late night
        monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "0")
    if producer != "four":
        monkeypatch.setenv("FLASH4_PAGE_PIECES_ALL_WARPS", "0")
    if producer == "noprefetch":
        monkeypatch.setenv("FLASH4_PAGE_PREFETCH", "0")
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", "page_divide_free" + (",page_row_shuffle" if row_shuffle else ""))
    cfg = ab_pages.shipped_config(page_size, headdim=d)
    assert cfg.page_divide_free and cfg.page_rows > 0 and cfg.page_prefetch == (producer != "noprefetch"), cfg
    assert cfg.page_row_shuffle == row_shuffle, cfg
    assert cfg.page_pieces_all_warps == (producer == "four" and cfg.page_rows <= 32), cfg

    def switch_off():
        monkeypatch.delenv("FLASH4_FWD_SWITCHES")
        monkeypatch.setenv("FLASH4_PAGE_DIVIDE_FREE", "0")  # the whole-page default since 2026-12-05 night
        off = ab_pages.shipped_config(page_size, headdim=d)
        assert not off.page_divide_free and not off.page_row_shuffle

    _paged_on_off_contiguous(page_size, d, causal, page_size * 5 + d, switch_off)


# FwdConfig.pdl_combine / combine_prefetch (FLASH4_FWD_SWITCHES): the split-KV combine launched with
# programmatic dependent launch / its merge with the LSEs in registers and staged loads. Many splits
# (batch 1, 8 KV heads, 8k+ keys; num_splits auto, 40 (two LSE chunks per lane, a partial load group),
# and 150 > MAX_SPLITS where combine_prefetch falls back to the plain merge), contiguous and paged,
# eagerly and replayed from a CUDA graph (serving stacks' decode; the graph keeps the programmatic
# edge) after q changed in place: out / lse bitwise equal to the switches-off eager call, out poisoned
# with NaN before each call.
COMBINE_CASES = [("pdl_combine", 128, 0, 0), ("pdl_combine", 64, 64, 0), ("combine_prefetch", 128, 0, 0),
                 ("combine_prefetch", 128, 64, 40), ("combine_prefetch", 64, 0, 150),
                 ("pdl_combine,combine_prefetch", 128, 64, 0), ("pdl_combine,combine_prefetch", 128, 0, 40)]


@pytest.mark.parametrize("switches, d, page, num_splits", COMBINE_CASES,
                         ids=[f"{w}-d{d}-page{p}-s{n}" for w, d, p, n in COMBINE_CASES])
def test_pdl_combine_bitwise(monkeypatch, switches, d, page, num_splits):
    from flash4 import flash_attn_with_kvcache

    g = torch.Generator(device="cuda").manual_seed(5)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    keys = (20000 if num_splits > 128 else 8192) + 77
    q = rnd(1, 1, 32, d)
    if page:
        npg = -(-keys // page)
        kc, vc = rnd(npg, page, 8, d), rnd(npg, page, 8, d)
        table = torch.randperm(npg, device="cuda", generator=g).to(torch.int32).view(1, npg)
    else:
        kc, vc, table = rnd(1, keys, 8, d), rnd(1, keys, 8, d), None
    lens = torch.tensor([keys - 5], device="cuda", dtype=torch.int32)
    out = torch.full_like(q, float("nan"))

    def call():
        out.fill_(float("nan"))
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True, out=out,
                                       num_splits=num_splits, return_lse=True)

    monkeypatch.delenv("FLASH4_FWD_SWITCHES", raising=False)
    ref_out, ref_lse = (t.clone() for t in call())
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", switches)
    from flash4.config.sm90 import decode_plan

    assert decode_plan(1, 1, 32, 8, d, "bf16", True, page, keys, num_splits, 90,
                       torch.cuda.get_device_properties(0).multi_processor_count).num_splits > 1
    got_out, got_lse = call()
    torch.cuda.synchronize()
    assert torch.equal(got_out, ref_out) and torch.equal(got_lse, ref_lse)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lse_graph = call()[1]
    q.copy_(rnd(1, 1, 32, d))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.delenv("FLASH4_FWD_SWITCHES", raising=False)
    got_out, got_lse = out.clone(), lse_graph.clone()
    ref_out, ref_lse = call()
    torch.cuda.synchronize()
    assert not got_out.isnan().any()
    assert torch.equal(got_out, ref_out) and torch.equal(got_lse, ref_lse)
