"""The backward kernel's speed switches (BwdConfig.exp_before_dp_wait, dq_handoff_per_wg; both off by
default; docs/design/speed_candidates.md), on the CPU: the config fields (off everywhere, out of every
shipped config's repr), the per-warpgroup dQ order (the real CuTe layout, read at trace time), and
the SASS of the switched-on kernels (sm_90a). The GPU side is tests/gpu/test_speed_switches.py
(results against the reference) and tools/ab_switch.py (speed); tools/kernel_fingerprint.py shows
the switched-off kernels unchanged.
"""

import dataclasses
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config import BwdConfig, select_bwd_config, shipped_bwd_configs  # noqa: E402, F401 (eval)

SWITCHES = ("exp_before_dp_wait", "dq_handoff_per_wg")


# ---------------------------------------------------------------------------------------- config
def test_switches_off_and_out_of_repr():
    """Off in every shipped backward config but where shipped_dq_handoff turns dq_handoff_per_wg on
    (since 2026-12-03), and then absent from its repr (the compile-cache and fingerprint key); on,
    shown once; repr round-trips either way."""
    for cfg in shipped_bwd_configs():
        for name in SWITCHES:
            on = getattr(cfg, name)
            wanted = (name == "dq_handoff_per_wg" and cfg.dq_accum_order and not cfg.deterministic
                      and (cfg.dq_whole or not cfg.dkv_accum or (cfg.headdim == 64 and cfg.causal)))
            assert on == wanted, (name, cfg)
            assert (name in repr(cfg)) == on
        assert eval(repr(cfg)) == cfg
    cfg = select_bwd_config(64, "bf16", True)
    for name in SWITCHES:
        on = dataclasses.replace(cfg, **{name: True})
        assert repr(on).endswith(f", {name}=True)") and eval(repr(on)) == on


def test_dq_handoff_per_wg_needs_the_accumulator_order():
    """dq_handoff_per_wg: dq_accum_order configs (dense, head dim <= 96) that are not deterministic."""
    dataclasses.replace(select_bwd_config(96, "bf16", False), dq_handoff_per_wg=True)
    for cfg in (select_bwd_config(128, "bf16", True), select_bwd_config(64, "bf16", True, deterministic=True)):
        with pytest.raises(AssertionError):
            dataclasses.replace(cfg, dq_handoff_per_wg=True)


def test_exp_before_dp_wait_refused_at_128_queries():
    """At tile_m 128 (d64 bf16) ptxas serializes the wgmmas with the switch: the kernel refuses it."""
    pytest.importorskip("cutlass")
    from flash4.kernels.sm90.bwd import FlashAttentionBackwardSm90

    cfg = select_bwd_config(64, "bf16", True)
    assert cfg.tile_m == 128
    with pytest.raises(ValueError, match="exp_before_dp_wait"):
        FlashAttentionBackwardSm90(dataclasses.replace(cfg, exp_before_dp_wait=True))
    FlashAttentionBackwardSm90(dataclasses.replace(cfg, tile_m=64, exp_before_dp_wait=True))


def test_postprocess_runner_key_has_wg_halves(monkeypatch, tmp_path):
    """get_bwd_postprocess_runner keys the kernel by wg_halves (off: the key as before); it needs the
    accumulator order."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path))
    from flash4.compile import cache

    keys = []
    monkeypatch.setattr(cache, "load_or_compile", lambda kind, key, options, fn: keys.append(key))
    cache.get_bwd_postprocess_runner.__wrapped__(64, "bf16", 90, accum_tile_m=128)
    cache.get_bwd_postprocess_runner.__wrapped__(64, "bf16", 90, accum_tile_m=128, wg_halves=True)
    assert keys == [(64, "bf16", 90, "accum", 128), (64, "bf16", 90, "accum", 128, "wghalves")]
    with pytest.raises(ValueError, match="wg_halves"):
        cache.get_bwd_postprocess_runner.__wrapped__(128, "bf16", 90, wg_halves=True)


# ------------------------------------------------------------------ per-warpgroup dQ element order
def _flatten(shape, stride):
    if isinstance(shape, int):
        return [(shape, stride)]
    return [m for s, d in zip(shape, stride) for m in _flatten(s, d)]


@pytest.mark.parametrize("headdim, tile_m", [(64, 128), (96, 64), (64, 64)])
def test_wg_order_is_a_permutation_in_halves(headdim, tile_m):
    """accum_order_wg_layout (what the main kernel stores and the postprocess loads through): thread
    t's value v lands at one offset of the tile, every offset once, warpgroup w's values exactly in
    [w * half, (w + 1) * half), each thread's 4-value groups 16-byte aligned and contiguous."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from flash4.kernels.common.dq_accum import GROUP, accum_order_wg_layout

    values = tile_m * headdim // 256  # per consumer thread (2 warpgroups)
    got = {}

    @cute.jit
    def probe():
        layout = accum_order_wg_layout(values, 2)
        got["layout"] = (layout.shape, layout.stride)

    cute.compile(probe)
    modes = _flatten(*got["layout"])
    assert [s for s, _ in modes] == [GROUP, 128, values // GROUP, 2]
    e, t, g, w = np.meshgrid(*(np.arange(s) for s, _ in modes), indexing="ij")
    offsets = sum(c * d for c, (_, d) in zip((e, t, g, w), modes))
    tile = tile_m * headdim
    assert np.array_equal(np.sort(offsets.ravel()), np.arange(tile))
    half = tile // 2
    assert (offsets[..., 0] < half).all() and (offsets[..., 1] >= half).all()
    assert (offsets[0] % GROUP == 0).all() and np.array_equal(offsets[1:] - offsets[:1], e[1:])


# ------------------------------------------------------------------------------------------ SASS
def _sass_of(cfg):
    from flash4.compile.cache import compile_bwd
    from flash4.compile.check import _cuobjdump, extract_cubin, resource_usage

    cubin = extract_cubin(compile_bwd(cfg))
    tool = _cuobjdump()
    if tool is None:
        return resource_usage(cubin), None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return resource_usage(cubin), subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True).stdout


def _ex2_between_s_wait_and_dp_wait(sass: str) -> tuple[int, int]:
    """(MUFU.EX2 between a `WARPGROUP.DEPBAR.LE gsb0, 0x1` and the next `gsb0, 0x0`, all MUFU.EX2):
    the exponentials issued while dP^T (the last group of the pair S^T, dP^T) is still in flight."""
    inside, total, open_ = 0, 0, False
    for line in sass.splitlines():
        if "MUFU.EX2" in line:
            total += 1
            inside += open_
        elif re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b", line):
            open_ = True
        elif re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", line):
            open_ = False
    return inside, total


def _d128_causal_sass(**switches):
    """(the d128 causal config, the SASS of it with `switches` on) after checking the switched kernel
    for spills and serialized wgmma; skips without the CuTe DSL or cuobjdump."""
    pytest.importorskip("cutlass")
    cfg = select_bwd_config(128, "bf16", True)
    res_on, on = _sass_of(dataclasses.replace(cfg, **switches))
    assert res_on["spills"] == 0 and not res_on["wgmma_serialized"]
    if on is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    return cfg, on


def test_exp_before_dp_wait_sass():
    """d128 causal (tile_m 64): switched on, every MUFU.EX2 of P sits between the S^T wait and the dP^T
    wait (off: none; ptxas sinks them below the dP^T wait); no spill, wgmmas not serialized."""
    cfg, on = _d128_causal_sass(exp_before_dp_wait=True)
    inside, total = _ex2_between_s_wait_and_dp_wait(on)
    assert total > 0 and inside == total, (inside, total)
    _, off = _sass_of(cfg)
    assert _ex2_between_s_wait_and_dp_wait(off)[0] == 0


def test_dq_handoff_per_wg_sass():
    """d64 causal (tile_m 128): switched on, the dQ hand-off runs on the four per-warpgroup barriers
    of 160 threads (ids 8-11), none of 288 threads is left, the store warp issues one bulk
    reduce-add per half (2 UBLKRED); no spill, wgmmas not serialized."""
    pytest.importorskip("cutlass")
    res, sass = _sass_of(dataclasses.replace(select_bwd_config(64, "bf16", True), dq_handoff_per_wg=True))
    assert res["spills"] == 0 and not res["wgmma_serialized"]
    if sass is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    assert "0x120" not in " ".join(re.findall(r"BAR\.(?:SYNC\S*|ARV) [^;]*", sass))
    assert len(re.findall(r"\bUBLKRED\b", sass)) == 2
    named = set(re.findall(r"BAR\.(?:SYNC\S*|ARV) (0x[0-9a-f]+), 0xa0", sass))
    assert {"0x8", "0x9", "0xa", "0xb"} <= named, named



# ------------------------------------------- section 6b: dq_whole, lse_early, FLASH4_BWD_SWITCHES
NEW_SWITCHES = ("dq_whole", "lse_early", "mask_rel")


def test_new_switches_off_and_out_of_repr():
    """lse_early off everywhere; dq_whole on exactly where shipped_dq_handoff puts it (d128 dense, any
    Dv since 2026-12-04, not deterministic; with a window only MHA at Dv = D); mask_rel only with it on
    a window (2026-12-04: the window kernel spills without it)."""
    for cfg in shipped_bwd_configs():
        assert not cfg.lse_early and "lse_early" not in repr(cfg)
        whole = (cfg.headdim == 128 and not cfg.deterministic and not cfg.softcap and not cfg.split_headdim
                 and not cfg.transposed_dkv
                 and not (cfg.local and (cfg.dkv_accum or cfg.headdim_v is not None)))
        assert cfg.dq_whole == whole and ("dq_whole" in repr(cfg)) == whole, cfg
        assert cfg.mask_rel == (whole and cfg.local) and ("mask_rel" in repr(cfg)) == cfg.mask_rel, cfg
        assert not cfg.mask_rel or cfg.dq_handoff_per_wg, cfg
    cfg = select_bwd_config(128, "bf16", True)
    for name in NEW_SWITCHES:
        on = dataclasses.replace(cfg, **{name: True})
        assert repr(on).endswith(f", {name}=True)") and eval(repr(on)) == on


def test_dq_whole_config():
    """dq_whole at d128: one unpadded tile (accumulator order when dense, row-major when packed), which
    dq_handoff_per_wg may then split per warpgroup; 2 KiB less smem than the padded rows; refused with
    split_headdim / transposed_dkv."""
    from flash4.config.sm90 import with_seq_layout

    cfg = select_bwd_config(128, "bf16", False)
    on = dataclasses.replace(cfg, dq_whole=True)
    assert on.dq_whole_tile and on.dq_accum_order and on.dq_row_pad == 0
    assert cfg.smem_bytes() - on.smem_bytes() == cfg.tile_m * cfg.dq_row_pad * 4
    dataclasses.replace(on, dq_handoff_per_wg=True)
    packed = with_seq_layout(on, varlen_q=True, varlen_k=True)
    assert packed.dq_whole_tile and not packed.dq_accum_order
    for other in (select_bwd_config(256, "bf16", True), select_bwd_config(192, "bf16", True)):
        with pytest.raises(AssertionError):
            dataclasses.replace(other, dq_whole=True)


def test_with_bwd_switches_where_each_applies():
    from flash4.config.sm90 import BWD_SPEED_SWITCHES, with_bwd_switches

    every = BWD_SPEED_SWITCHES
    d128 = with_bwd_switches(select_bwd_config(128, "bf16", True), every)
    assert all(getattr(d128, n) for n in every if n not in ("sink_delta_db", "no_tail_guard"))
    assert not d128.sink_delta_db and not d128.no_tail_guard  # no sink, dense
    d64 = with_bwd_switches(select_bwd_config(64, "bf16", True), every)  # tile_m 128, already whole
    assert (d64.dq_whole, d64.dq_handoff_per_wg, d64.lse_early, d64.exp_before_dp_wait) == (False, True, True, False)
    window = with_bwd_switches(select_bwd_config(128, "bf16", False, local=True), every)
    assert (window.dq_whole, window.dq_handoff_per_wg, window.lse_early, window.exp_before_dp_wait) == (
        False, False, True, False)
    det = with_bwd_switches(select_bwd_config(128, "bf16", True, deterministic=True), every)
    assert det.dq_whole and not det.dq_handoff_per_wg
    d192 = select_bwd_config(192, "bf16", True)
    assert with_bwd_switches(d192, every) == dataclasses.replace(d192, dpsum_scaled=True)  # transposed_dkv: only it
    assert with_bwd_switches(d128, ()) == d128


def test_bwd_switches_env(monkeypatch):
    from flash4 import env
    from flash4.config import bwd_config
    from flash4.request import Request

    import torch

    monkeypatch.delenv("FLASH4_BWD_SWITCHES", raising=False)
    assert env.bwd_switches() == ()
    q = torch.empty(2, 1000, 4, 128, device="meta", dtype=torch.bfloat16)
    req = Request.dense(q, q, q, 128 ** -0.5, True)
    plain = bwd_config(req, 90).cfg
    monkeypatch.setenv("FLASH4_BWD_SWITCHES", "lse_early, dq_whole")
    assert env.bwd_switches() == ("lse_early", "dq_whole")
    assert bwd_config(req, 90).cfg == dataclasses.replace(plain, lse_early=True, dq_whole=True)
    monkeypatch.setenv("FLASH4_BWD_SWITCHES", "lse_early,fast")
    with pytest.raises(ValueError, match="FLASH4_BWD_SWITCHES.*fast"):
        env.bwd_switches()


def _lds_before_s_wait(sass: str) -> int:
    """LDS issued after a step's Q / dO full-barrier waits (SYNCS.PHASECHK) and before its first
    `WARPGROUP.DEPBAR.LE` (the S^T wait), summed over the kernel's step loops."""
    count, in_step = 0, False
    for line in sass.splitlines():
        if "SYNCS.PHASECHK" in line:
            in_step = True
        elif "WARPGROUP.DEPBAR.LE" in line:
            in_step = False
        elif in_step and re.search(r"\bLDS\b", line):
            count += 1
    return count


def test_lse_early_sass():
    """d128 causal: switched on, the 8 LSE loads of each step (two step loops: 16) are issued under the
    S^T GEMM, before its wait (off: none); no spill, wgmmas not serialized."""
    cfg, on = _d128_causal_sass(lse_early=True)
    assert _lds_before_s_wait(on) == 16, _lds_before_s_wait(on)
    _, off = _sass_of(cfg)
    assert _lds_before_s_wait(off) == 0


def test_dq_whole_sass():
    """d128 causal with dq_whole (+ dq_handoff_per_wg): the dQ tile staged by 16-byte stores, no
    64-bit ones, and reduce-added by one bulk op per step (per half); no spill, not serialized."""
    pytest.importorskip("cutlass")
    cfg = select_bwd_config(128, "bf16", True)
    for edit in (dict(dq_whole=True), dict(dq_whole=True, dq_handoff_per_wg=True)):
        res, sass = _sass_of(dataclasses.replace(cfg, **edit))
        assert res["spills"] == 0 and not res["wgmma_serialized"], edit
        if sass is None:
            pytest.skip("cuobjdump not installed: SASS not checked")
        assert len(re.findall(r"\bSTS\.128\b", sass)) == 16 and not re.findall(r"\bSTS\.64\b", sass), edit
        assert len(re.findall(r"\bUBLKRED\b", sass)) == (2 if edit.get("dq_handoff_per_wg") else 1), edit


# ------------------------------------------------------- dpsum_scaled (D * softmax_scale from the host)
def test_dpsum_scaled_config():
    """Off in every shipped config and out of its repr; with_bwd_switches turns it on exactly where the
    step forms dS by fma (BwdConfig.ds_by_fma: no softcap; dV after dS^T, i.e. not split_headdim and not
    head dim >= 128 with a packed / seqused layout or a window; or transposed_dkv); refused elsewhere."""
    from flash4.config.sm90 import with_bwd_switches, with_seq_layout

    for cfg in shipped_bwd_configs():
        assert not cfg.dpsum_scaled and "dpsum_scaled" not in repr(cfg)
        on = with_bwd_switches(cfg, ("dpsum_scaled",))
        assert on.dpsum_scaled == cfg.ds_by_fma, cfg
        if on.dpsum_scaled:
            assert repr(on).endswith(", dpsum_scaled=True)") and eval(repr(on)) == on
        else:
            with pytest.raises(AssertionError):
                dataclasses.replace(cfg, dpsum_scaled=True)
    d128, d64 = select_bwd_config(128, "bf16", False), select_bwd_config(64, "bf16", True)
    assert d128.ds_by_fma and d64.ds_by_fma and select_bwd_config(192, "bf16", True).ds_by_fma  # transposed_dkv
    assert not with_seq_layout(d128, varlen_q=True, varlen_k=True).ds_by_fma  # spills there: dV before dS^T
    assert with_seq_layout(d64, varlen_q=True, varlen_k=True).ds_by_fma
    assert not select_bwd_config(128, "bf16", True, local=True).ds_by_fma
    assert not select_bwd_config(64, "bf16", True, softcap=True).ds_by_fma
    assert not select_bwd_config(256, "bf16", True).ds_by_fma  # split_headdim
    from flash4.config.sm90 import with_sink_delta

    # with sink_delta the switched kernel spills (d64 GQA causal: 3 instructions): turned off there
    assert not with_sink_delta(with_bwd_switches(d64, ("dpsum_scaled",))).dpsum_scaled


def test_dpsum_scaled_sass():
    """d128 full and d64 causal switched on: the step's per-query D * scale FMULs are gone (16 per step
    at 64 queries, 32 at 128; two step loops each), registers as off, no spill, not serialized."""
    pytest.importorskip("cutlass")
    for d, causal, fewer in ((128, False, 32), (64, True, 64)):
        cfg = select_bwd_config(d, "bf16", causal)
        res_off, off = _sass_of(cfg)
        res_on, on = _sass_of(dataclasses.replace(cfg, dpsum_scaled=True))
        assert res_on["spills"] == 0 and not res_on["wgmma_serialized"], d
        assert res_on["registers"] == res_off["registers"], d
        if on is None:
            pytest.skip("cuobjdump not installed: SASS not checked")
        fmul = [len(re.findall(r"\bFMUL\b", s)) for s in (off, on)]
        assert fmul[0] - fmul[1] == fewer, (d, fmul)


def test_dpsum_scaled_host(monkeypatch):
    """flash4.backward hands the main kernel dpsum * softmax_scale (after the dLSE subtraction: the
    kernel's product of the switch-off path) only with the switch; kernels are recorders (CPU)."""
    import torch
    from cpu_helpers import BF16

    import flash4.backward as backward
    from flash4 import memo, validate
    from flash4.compile import cache

    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.setenv("FLASH4_NUM_SMS", "132")
    monkeypatch.setattr(validate, "_device_problem", lambda *a, **k: None)
    monkeypatch.setattr(validate, "_arch_problem", lambda *a, **k: None)
    monkeypatch.setattr(memo, "ENABLED", False)
    seen = {}

    def load_or_compile(kind, key, options, compile_fn):
        def kernel(*args):
            if kind == "bwd_preprocess":
                args[4].fill_(3.0)  # dpsum
            elif kind == "bwd":
                seen["dpsum"] = args[5].clone()
        return kernel

    monkeypatch.setattr(cache, "load_or_compile", load_or_compile)
    for fn in (cache.get_bwd_runner, cache.get_bwd_preprocess_runner, cache.get_bwd_postprocess_runner):
        fn.cache_clear()
    b, s, h, d = 2, 200, 4, 128
    q, k, v, out, dout = (torch.randn(b, s, h, d).to(BF16) for _ in range(5))
    lse, dlse = torch.randn(b, h, s), torch.randn(b, h, s)
    scale = 0.1  # not a power of two: the product rounds
    try:
        for switches, use_dlse in (("", False), ("dpsum_scaled", False), ("dpsum_scaled", True)):
            monkeypatch.setenv("FLASH4_BWD_SWITCHES", switches)
            backward.flash_attn_backward(dout, q, k, v, out, lse, scale, False, dlse=dlse if use_dlse else None)
            got = seen.pop("dpsum")[:, :, :s]
            want = torch.full((b, h, s), 3.0) - (dlse if use_dlse else 0.0)
            if switches:
                want = want * scale
            assert torch.equal(got, want), (switches, use_dlse)
    finally:
        for fn in (cache.get_bwd_runner, cache.get_bwd_preprocess_runner, cache.get_bwd_postprocess_runner):
            fn.cache_clear()
