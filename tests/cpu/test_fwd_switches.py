"""The forward's speed switch FwdConfig.softmax_vote_first (off by default; docs/design/speed_candidates.md
section 8), on the CPU: the config field (off everywhere, out of every shipped config's repr),
FLASH4_FWD_SWITCHES (flash4.env.fwd_switches, flash4.config.sm90.with_fwd_switches, the plans of
every door), and the SASS of the switched-on d128 forward (sm_90a): each MUFU.EX2 run of the common
path broken by FFMAs, no spill. The GPU side is tests/gpu/test_speed_switches.py::test_fwd_switches_env
(every door bitwise equal to the switch-off call, the exact path included) and tools/ab_fwd.py
--variants vf (speed)."""

import dataclasses
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config import FwdConfig, select_fwd_config, shipped_fwd_configs  # noqa: E402, F401 (eval)
from flash4.constants import FWD_SPEED_SWITCHES  # noqa: E402


def test_switch_off_and_out_of_repr():
    # the second: tests/cpu/test_tail_guard.py; the third: tests/cpu/test_lookahead_qk_cpu.py; the
    # fourth: test_mask_bits_off_and_out_of_repr below
    assert FWD_SPEED_SWITCHES == ("softmax_vote_first", "no_tail_guard", "lookahead_qk", "mask_bits", "rescale_always",
                                  "pv_zero_init", "flat_tile_order", "split_row_max", "softmax_branch_free",
                                  "gather_clamp_late", "gather_ptr_shuffle", "page_pieces_all_warps", "pin_p_convert",
                                  "page_divide_free", "page_row_shuffle", "pdl_combine", "combine_prefetch")
    from flash4.config.sm90 import shipped_vote_first

    on = []
    for cfg in shipped_fwd_configs():
        if isinstance(cfg, FwdConfig):  # on only where shipped_vote_first puts it (d128 dense full, long)
            if cfg.softmax_vote_first:
                on.append(cfg)
                if cfg.headdim == 128:
                    assert shipped_vote_first(dataclasses.replace(cfg, softmax_vote_first=False), 4096) == cfg
            else:
                assert "softmax_vote_first" not in repr(cfg)
    # d128: shipped_vote_first (long); d <= 32: shipped_small_d_softmax (with rescale_always)
    small = [c for c in on if c.headdim <= 32]
    assert all(c.rescale_always and not c.causal for c in small), small
    assert sorted((c.headdim, c.dtype, c.causal) for c in on if c.headdim == 128) == [(128, "bf16", False),
                                                                                      (128, "fp16", False)]
    on = dataclasses.replace(select_fwd_config(128, "bf16", False), softmax_vote_first=True)
    assert repr(on).endswith(", softmax_vote_first=True)") and eval(repr(on)) == on


def test_with_fwd_switches():
    from flash4.config.sm90 import with_fwd_switches

    cfg = select_fwd_config(64, "bf16", True)
    assert with_fwd_switches(cfg, ()) == cfg
    assert with_fwd_switches(cfg, ("softmax_vote_first",)) == dataclasses.replace(cfg, softmax_vote_first=True)


def _requests():
    from flash4.request import Request

    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(2, 1000, 4, 128, **meta)
    yield "dense", Request.dense(q, q, q, 128 ** -0.5, True)
    qv = torch.empty(1000, 4, 128, **meta)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    yield "varlen", Request.varlen(qv, qv, qv, cu, cu, 600, 600, softmax_scale=128 ** -0.5, causal=True)


@pytest.mark.parametrize("which", ["dense", "varlen"])
def test_fwd_switches_env(monkeypatch, which):
    """The plan of a call carries the switch while FLASH4_FWD_SWITCHES names it; an unknown name raises
    a ValueError naming the allowed ones; the variable is one the prepared calls key on."""
    from flash4 import env
    from flash4.config import fwd_config

    req = dict(_requests())[which]
    monkeypatch.delenv("FLASH4_FWD_SWITCHES", raising=False)
    assert env.fwd_switches() == ()
    plain = fwd_config(req, 90).cfg
    assert not plain.softmax_vote_first
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", " softmax_vote_first ")
    assert env.fwd_switches() == ("softmax_vote_first",)
    assert fwd_config(req, 90).cfg == dataclasses.replace(plain, softmax_vote_first=True)
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", "softmax_vote_first,fast")
    with pytest.raises(ValueError, match="FLASH4_FWD_SWITCHES.*fast.*softmax_vote_first"):
        env.fwd_switches()
    assert "FLASH4_FWD_SWITCHES" in env.PLAN_VARIABLES


def _ex2_runs(sass: str) -> list[int]:
    """Lengths of the runs of MUFU.EX2 with no FFMA between them, in program order."""
    runs, cur = [], 0
    for line in sass.splitlines():
        if "MUFU.EX2" in line:
            cur += 1
        elif re.search(r"\bFFMA\b", line):
            runs, cur = runs + [cur] if cur else runs, 0
    return runs + [cur] if cur else runs


def _fwd_sass(cfg):
    """(resource usage, SASS text or None without cuobjdump) of cfg's sm_90a forward."""
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    cubin = extract_cubin(compile_fwd(cfg))
    return resource_usage(cubin), sass_text(cubin)


def test_softmax_vote_first_sass():
    """d128 non-causal: off, the 64 exponentials of each online step run back to back after every
    FFMA (4 runs of MUFU.EX2, the longest >= 64: the exact-path vote's branch splits the block);
    on, the common path's MUFU.EX2 sit among the FFMAs (dozens of short runs); no spill, wgmma not
    serialized, 168 registers either way."""
    pytest.importorskip("cutlass")
    cfg = dataclasses.replace(select_fwd_config(128, "bf16", False, seqlen_k=4096), softmax_vote_first=False)
    res_off, off = _fwd_sass(cfg)
    res_on, on = _fwd_sass(dataclasses.replace(cfg, softmax_vote_first=True))
    if not res_off:
        pytest.skip("cuobjdump not installed: resources and SASS not checked")
    for res in (res_off, res_on):
        assert res["spills"] == 0 and not res["wgmma_serialized"] and res["registers"] == 168, res
    if on is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    runs_off, runs_on = _ex2_runs(off), _ex2_runs(on)
    assert len(runs_off) <= 4 and max(runs_off) >= 64, runs_off
    assert len(runs_on) >= 32, runs_on


def test_shipped_small_d_softmax_and_tile_work():
    """softmax_vote_first + rescale_always ship for the plain dense non-causal forward at head dims <= 32
    (H200 2026-12-05: d32 full 1.057x, d16 full 1.036x; d32 causal 0.981x); pv_zero_init +
    flat_tile_order for the plain dense d128 non-causal forward at seqlen_k <= SHORT_SEQLEN_K (1k
    1.063x; 4k / 16k below 1.0x)."""
    from flash4.config.sm90 import SHORT_SEQLEN_K

    for d in (16, 32):
        for seqlen_k in (1024, 4096, 16384):
            c = select_fwd_config(d, "bf16", False, seqlen_k=seqlen_k)
            assert c.softmax_vote_first and c.rescale_always, c
    for kwargs in (dict(headdim=32, causal=True), dict(headdim=48), dict(headdim=64), dict(headdim=32, seqlen_k=None),
                   dict(headdim=32, local=True), dict(headdim=32, softcap=True), dict(headdim=32, sink=True)):
        args = dict(headdim=32, dtype="bf16", causal=False, seqlen_k=4096) | kwargs
        c = select_fwd_config(**args)
        assert not c.rescale_always and not c.softmax_vote_first, kwargs
    short = select_fwd_config(128, "bf16", False, seqlen_k=SHORT_SEQLEN_K)
    assert short.pv_zero_init and short.flat_tile_order and not short.softmax_vote_first
    for kwargs in (dict(seqlen_k=SHORT_SEQLEN_K + 1), dict(seqlen_k=None), dict(causal=True), dict(headdim=64),
                   dict(headdim=256), dict(local=True), dict(headdim_v=64)):
        args = dict(headdim=128, dtype="bf16", causal=False, seqlen_k=SHORT_SEQLEN_K) | kwargs
        c = select_fwd_config(**args)
        assert not c.pv_zero_init and not c.flat_tile_order, kwargs


def test_shipped_vote_first():
    """softmax_vote_first ships where it was measured faster (H200 2026-12-03 evening): the plain
    dense d128 non-causal forward above SHORT_SEQLEN_K keys; not causal, windows, softcap, sinks,
    value head dims, other head dims, short sequences or packed layouts (seqlen_k None)."""
    from flash4.config.sm90 import SHORT_SEQLEN_K

    assert select_fwd_config(128, "bf16", False, seqlen_k=4096).softmax_vote_first
    assert select_fwd_config(128, "fp16", False, seqlen_k=SHORT_SEQLEN_K + 1).softmax_vote_first
    for kwargs in (dict(seqlen_k=SHORT_SEQLEN_K), dict(seqlen_k=None), dict(causal=True, seqlen_k=4096),
                   dict(local=True, seqlen_k=4096), dict(softcap=True, seqlen_k=4096), dict(sink=True, seqlen_k=4096),
                   dict(headdim=64, seqlen_k=4096), dict(headdim=256, seqlen_k=4096),
                   dict(headdim_v=64, seqlen_k=4096)):
        args = dict(headdim=128, dtype="bf16", causal=False) | kwargs
        assert not select_fwd_config(**args).softmax_vote_first, kwargs


def test_vote_first_reaches_the_dense_plan(monkeypatch):
    from flash4.config import fwd_config
    from flash4.request import Request

    monkeypatch.delenv("FLASH4_FWD_SWITCHES", raising=False)
    meta = dict(device="meta", dtype=torch.bfloat16)
    long, short = torch.empty(2, 4096, 4, 128, **meta), torch.empty(2, 1024, 4, 128, **meta)
    assert fwd_config(Request.dense(long, long, long, 0.1, False), 90).cfg.softmax_vote_first
    assert not fwd_config(Request.dense(long, long, long, 0.1, True), 90).cfg.softmax_vote_first
    assert not fwd_config(Request.dense(short, short, short, 0.1, False), 90).cfg.softmax_vote_first


def test_mask_bits_off_and_out_of_repr():
    """FwdConfig.mask_bits: off in every config compile-check builds (no windows there) and out of its
    repr; on exactly where shipped_mask_bits puts it (dense windows), shown once then; repr
    round-trips either way."""
    import dataclasses

    from flash4.config.sm90 import shipped_mask_bits

    for cfg in shipped_fwd_configs():
        if isinstance(cfg, FwdConfig):
            assert not cfg.mask_bits and "mask_bits" not in repr(cfg)
    window = select_fwd_config(64, "bf16", local=True, sink=True)
    on = shipped_mask_bits(window)
    assert on.mask_bits and repr(on).endswith(", mask_bits=True)") and eval(repr(on)) == on
    for cfg in (select_fwd_config(128, "bf16", True), select_fwd_config(64, "bf16", False),
                dataclasses.replace(window, varlen_q=True, varlen_k=True)):
        assert shipped_mask_bits(cfg) == cfg


def test_window_persistent_shipped():
    """shipped_window_persistent: dense windows up to head dim 128 run persistent CTAs (O in its own
    smem buffer); d256 (no room for it), packed layouts and the non-window configs are unchanged."""
    import dataclasses

    from flash4.config.sm90 import SM90_MAX_SMEM_BYTES, shipped_window_persistent

    for d in (64, 96, 128):
        for softcap in (False, True):
            cfg = select_fwd_config(d, "bf16", local=True, softcap=softcap)
            on = shipped_window_persistent(cfg)
            assert on == dataclasses.replace(cfg, persistent=True)
            assert on.smem_bytes() + on.tile_m * on.hdim_v * 2 + 1024 <= SM90_MAX_SMEM_BYTES
    for cfg in (select_fwd_config(256, "bf16", local=True), select_fwd_config(128, "bf16", True),
                dataclasses.replace(select_fwd_config(64, "bf16", local=True), varlen_q=True, varlen_k=True)):
        assert shipped_window_persistent(cfg) == cfg


def test_p_smem_off_and_out_of_repr():
    """FwdConfig.p_smem: on exactly in the plain dense d96 configs at 192 rows (shipped_p_smem since
    2026-12-04: 192 x 128 causal, 192 x 144 without a mask), off and out of the repr elsewhere; on,
    shown once, counted in smem_bytes (the P tile), refused with lookahead_qk."""
    import dataclasses

    import pytest

    on_in = []
    for cfg in shipped_fwd_configs():
        if isinstance(cfg, FwdConfig):
            assert cfg.p_smem == ("p_smem" in repr(cfg)), cfg
            if cfg.p_smem:
                on_in.append((cfg.headdim, cfg.dtype, cfg.causal, cfg.tile_m, cfg.tile_n))
    assert sorted(on_in) == [(96, dt, c, 192, 128 if c else 144) for dt in ("bf16", "fp16") for c in (False, True)]
    cfg = select_fwd_config(96, "bf16", True)
    on = dataclasses.replace(cfg, p_smem=True, tile_m=192)
    assert repr(on).endswith(", p_smem=True)") and eval(repr(on)) == on
    assert on.smem_bytes() == dataclasses.replace(on, p_smem=False).smem_bytes() + 192 * 128 * 2
    with pytest.raises(ValueError):
        dataclasses.replace(select_fwd_config(128, "bf16", True, headdim_v=64), lookahead_qk=True, p_smem=True)


@pytest.mark.parametrize("d, tile_m, causal", [(96, 192, True), (96, 192, False), (96, 128, True), (64, 128, True)],
                         ids=["96-m192-causal", "96-m192-full", "96-m128-causal", "64-m128-causal"])
def test_p_smem_compiles_clean(d, tile_m, causal):
    """sm_90a: the p_smem forward compiles with no spill and wgmma not serialized, with stmatrix (STSM)
    for P; at d96 with 192-row tiles (three consumer warpgroups, 160 registers each), where P in
    registers spills (78, 2026-12-04)."""
    import dataclasses

    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    cfg = dataclasses.replace(select_fwd_config(d, "bf16", causal), p_smem=True, tile_m=tile_m)
    cubin = extract_cubin(compile_fwd(cfg))
    res = resource_usage(cubin)
    if not res:
        pytest.skip("cuobjdump not installed: resources not checked")
    assert res["spills"] == 0 and not res["wgmma_serialized"] and res["hgmma"] > 0, res
    assert "STSM" in sass_text(cubin)


@pytest.mark.parametrize("d, dtype, pack, softcap, sink", [(64, "bf16", 8, False, True), (64, "bf16", 1, True, False),
                                                           (96, "bf16", 1, False, False), (128, "bf16", 4, False, True),
                                                           (128, "fp16", 1, False, False), (256, "bf16", 1, False, False)],
                         ids=["64-pack8-sink", "64-softcap", "96", "128-pack4-sink", "128-fp16", "256"])
def test_shipped_window_forwards_compile_clean(d, dtype, pack, softcap, sink):
    """sm_90a: the dense window forwards as the plan ships them since 2026-12-04 (mask_bits, persistent
    up to d128, GQA-packed where the heads allow) compile with no spill and wgmma not serialized
    (compile-check's shipped_fwd_configs lists no window config)."""
    import dataclasses

    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage
    from flash4.config.sm90 import shipped_mask_bits, shipped_window_persistent

    cfg = select_fwd_config(d, dtype, local=True, softcap=softcap, sink=sink)
    if pack > 1:
        cfg = dataclasses.replace(cfg, pack_gqa=pack)
    cfg = shipped_window_persistent(shipped_mask_bits(cfg))
    assert cfg.mask_bits and cfg.persistent == (d <= 128)
    res = resource_usage(extract_cubin(compile_fwd(cfg)))
    if not res:
        pytest.skip("cuobjdump not installed: resources not checked")
    assert res["spills"] == 0 and not res["wgmma_serialized"] and res["hgmma"] > 0, res


def test_pv_zero_init_switch():
    """FwdConfig.pv_zero_init: off and out of the repr in every shipped config but where shipped_tile_work
    puts it (with flat_tile_order; since 2026-12-05); with_fwd_switches turns it on except with
    lookahead_qk (the look-ahead loop keeps zeroing acc_O)."""
    from flash4.config.sm90 import SHORT_SEQLEN_K, shipped_tile_work, with_fwd_switches

    for c in shipped_fwd_configs():
        if getattr(c, "pv_zero_init", False):
            plain = dataclasses.replace(c, pv_zero_init=False, flat_tile_order=False)
            assert c.flat_tile_order and shipped_tile_work(plain, SHORT_SEQLEN_K) == c, c
        else:
            assert "pv_zero_init" not in repr(c) and not getattr(c, "flat_tile_order", False), c
    cfg = select_fwd_config(128, "bf16", False)
    on = with_fwd_switches(cfg, ("pv_zero_init",))
    assert on == dataclasses.replace(cfg, pv_zero_init=True) and "pv_zero_init" not in repr(cfg)
    assert repr(on).endswith(", pv_zero_init=True)") and eval(repr(on)) == on
    hdimv = select_fwd_config(128, "bf16", True, headdim_v=64)
    assert not with_fwd_switches(hdimv, ("lookahead_qk", "pv_zero_init")).pv_zero_init


def _switch_sass_counts(cfg, switch: str, pattern: str) -> list:
    """[off, on]: occurrences of the regex `pattern` in cfg's sm_90a SASS without and with the forward
    speed switch (with_fwd_switches); both compiled with 0 spills and unserialized wgmma."""
    import re

    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text
    from flash4.config.sm90 import with_fwd_switches

    counts = []
    for c in (cfg, with_fwd_switches(cfg, (switch,))):
        cubin = extract_cubin(compile_fwd(c))
        sass = sass_text(cubin)
        if sass is None:
            pytest.skip("cuobjdump not installed")
        res = resource_usage(cubin)
        assert res["spills"] == 0 and not res["wgmma_serialized"], res
        counts.append(len(re.findall(pattern, sass)))
    return counts


@pytest.mark.parametrize("d, causal, kw", [(128, False, {}), (128, True, {}), (64, True, {"local": True}),
                                           (96, False, {"sink": True})])
def test_pv_zero_init_sass(d, causal, kw):
    """sm_90a: with the switch the per-tile acc_O zeroing (CS2R) is gone from the tile loop (one CS2R
    site may stay: the no-key-block tile's zeroing), 0 spills, wgmma not serialized."""
    pytest.importorskip("cutlass")
    off, on = _switch_sass_counts(select_fwd_config(d, "bf16", causal, **kw), "pv_zero_init", r"\bCS2R\b")
    assert on <= off - 16, (off, on)


@pytest.mark.parametrize("m, h, b", [(8, 4, 2), (5, 6, 1), (1, 1, 1), (7, 5, 3), (33, 16, 4)])
def test_flat_tile_order_is_the_plain_order(m, h, b):
    """kernels/common/scheduler.tile_coords_flat (FwdConfig.flat_tile_order) decodes the non-LPT order
    (l2_group 1, as the host passes it): the pure model's tiles in its order (flash4.schedule, whose
    closed form the sectioned device decode mirrors: tests/cpu/test_schedule.py). Plain integers
    stand in for the device Int32 values."""
    pytest.importorskip("cutlass")
    from flash4 import schedule
    from flash4.kernels.common.scheduler import tile_coords_flat

    got = [tile_coords_flat(t, m, h) for t in range(m * h * b)]
    assert got == [schedule.tile_coords(t, m, h, b, causal=False, lpt=False) for t in range(m * h * b)]
    assert got == schedule.tile_order(m, h, b, causal=False, lpt=False)


def test_flat_tile_order_switch():
    """Off and out of the repr in every shipped config but with pv_zero_init where shipped_tile_work puts
    both (test_pv_zero_init_switch); with_fwd_switches leaves it off where cfg.lpt (the host's L2
    sections)."""
    from flash4.config.sm90 import with_fwd_switches

    assert all(c.pv_zero_init for c in shipped_fwd_configs() if getattr(c, "flat_tile_order", False))
    full = select_fwd_config(128, "bf16", False)
    on = with_fwd_switches(full, ("flat_tile_order",))
    assert on.flat_tile_order and repr(on).endswith(", flat_tile_order=True)") and eval(repr(on)) == on
    causal = select_fwd_config(128, "bf16", True)
    assert causal.lpt and not with_fwd_switches(causal, ("flat_tile_order",)).flat_tile_order


@pytest.mark.parametrize("d, causal, kw", [(128, False, {}), (64, False, {"local": True}), (96, False, {})])
def test_flat_tile_order_sass(d, causal, kw):
    """sm_90a: fewer integer-division sequences (MUFU.RCP) with the switch, 0 spills."""
    pytest.importorskip("cutlass")
    off, on = _switch_sass_counts(select_fwd_config(d, "bf16", causal, **kw), "flat_tile_order", r"MUFU\.RCP")
    assert on < off, (off, on)


def test_softmax_step_switches():
    """FwdConfig.split_row_max and softmax_branch_free (section 17): off and out of the repr in every
    shipped config; with_fwd_switches turns each on, softmax_branch_free replacing softmax_vote_first
    (the config refuses both)."""
    from flash4.config.sm90 import with_fwd_switches

    for name in ("split_row_max", "softmax_branch_free"):
        assert not any(getattr(c, name, False) for c in shipped_fwd_configs())
    full = select_fwd_config(128, "bf16", False, seqlen_k=4096)
    assert full.softmax_vote_first  # shipped there (shipped_vote_first)
    sm = with_fwd_switches(full, ("split_row_max",))
    assert sm == dataclasses.replace(full, split_row_max=True) and eval(repr(sm)) == sm
    assert repr(sm).endswith(", split_row_max=True)") and "split_row_max" not in repr(full)
    bf = with_fwd_switches(full, ("softmax_branch_free",))
    assert bf == dataclasses.replace(full, softmax_vote_first=False, softmax_branch_free=True)
    assert with_fwd_switches(full, ("softmax_vote_first", "softmax_branch_free")) == bf
    assert repr(bf).endswith(", softmax_branch_free=True)") and eval(repr(bf)) == bf
    with pytest.raises(ValueError, match="softmax_branch_free"):
        dataclasses.replace(full, softmax_branch_free=True)


def _opcode_runs(sass: str, opcode: str, breaker: str) -> list[int]:
    """Lengths of the runs of `opcode` lines with no `breaker` line between them, in program order."""
    runs, cur = [], 0
    for line in sass.splitlines():
        if re.search(rf"\b{re.escape(opcode)}\b", line):
            cur += 1
        elif re.search(rf"\b{re.escape(breaker)}\b", line):
            runs, cur = runs + [cur] if cur else runs, 0
    return runs + [cur] if cur else runs


def _fmnmx_depth(sass: str) -> int:
    """The longest chain of dependent FMNMX (each reading the previous one's result) in the SASS; any
    other instruction writing a register ends that register's chain."""
    depth, longest = {}, 0
    for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+([^;]*);", sass, re.M):
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        regs = [re.sub(r"[|\-]|\.reuse", "", a) for a in args]
        if op.startswith("FMNMX") and regs and regs[0].startswith("R"):
            d = 1 + max(depth.get(r, 0) for r in regs[1:3])
            depth[regs[0]] = d
            longest = max(longest, d)
        elif regs and regs[0].startswith("R"):
            depth.pop(regs[0], None)
    return longest


@pytest.mark.parametrize("d", [32, 128])
def test_softmax_step_switches_sass(d):
    """sm_90a, plain dense non-causal forward, 0 spills and unserialized wgmma with each switch:
    split_row_max halves the row max's FMNMX chain (one chain of a row's 64 / 32 columns -> two);
    softmax_branch_free with rescale_always puts the steady-state step's F2FP among its MUFU.EX2
    (shipped: one run of 32 F2FP after the exponentials; flash-attn-4's loop interleaves them)."""
    pytest.importorskip("cutlass")
    from flash4.config.sm90 import with_fwd_switches

    base = dataclasses.replace(select_fwd_config(d, "bf16", False), softmax_vote_first=False)
    sass = {}
    for name, cfg in (("off", base), ("sm", with_fwd_switches(base, ("split_row_max",))),
                      ("bfra", with_fwd_switches(base, ("softmax_branch_free", "rescale_always")))):
        res, sass[name] = _fwd_sass(cfg)
        if not res or sass[name] is None:
            pytest.skip("cuobjdump not installed: resources and SASS not checked")
        assert res["spills"] == 0 and not res["wgmma_serialized"], (name, res)
    assert _fmnmx_depth(sass["sm"]) <= _fmnmx_depth(sass["off"]) // 2 + 4, (_fmnmx_depth(sass["off"]),
                                                                           _fmnmx_depth(sass["sm"]))
    from cpu_helpers import sass_main_loop

    off, bfra = sass_main_loop(sass["off"]), sass_main_loop(sass["bfra"])
    assert max(_opcode_runs(off, "F2FP", "MUFU")) >= 32, _opcode_runs(off, "F2FP", "MUFU")
    assert max(_opcode_runs(bfra, "F2FP", "MUFU")) < 16, _opcode_runs(bfra, "F2FP", "MUFU")


@pytest.mark.parametrize("switch", ["gather_clamp_late", "gather_ptr_shuffle"])
def test_gather_switch(switch):
    """FwdConfig.gather_clamp_late / gather_ptr_shuffle: off and out of the repr in every shipped config;
    with_fwd_switches turns it on for gathered pages only (page_gather); the config refuses it elsewhere."""
    from flash4.config import with_seq_layout
    from flash4.config.sm90 import with_fwd_switches

    assert not any(getattr(c, switch, False) for c in shipped_fwd_configs())
    base = select_fwd_config(128, "bf16", True)
    gathered = with_seq_layout(base, varlen_q=True, seqused_k=True, page_gather=True, gather_zero_fill=True)
    on = with_fwd_switches(gathered, (switch,))
    assert on == dataclasses.replace(gathered, **{switch: True}) and eval(repr(on)) == on
    assert switch not in repr(gathered)
    assert with_fwd_switches(base, (switch,)) == base
    with pytest.raises(AssertionError):
        dataclasses.replace(base, **{switch: True})


def _first_use_distance(loop: list[str]) -> list[int]:
    """For each unpredicated global load (LDG) of a loop's lines: how many LDGSTS (the gather's
    cp.async) are issued between it and the first instruction that reads its destination register,
    going around the loop's back edge."""
    out = []
    for i, line in enumerate(loop):
        m = re.search(r"\*/\s+LDG\.E\S*\s+(R\d+),", line)
        if not m:
            continue
        reg = m.group(1)
        copies = 0
        for j in range(1, len(loop)):
            other = loop[(i + j) % len(loop)]
            operands = other.split(";")[0].split(",", 1)
            if len(operands) == 2 and re.search(rf"\b{reg}\b", operands[1]):
                break
            copies += "LDGSTS" in other
        out.append(copies)
    return out


def _producer_gather_loop(sass: str) -> list:
    """The gathering producer's steady-state loop (the innermost loop that issues LDGSTS)."""
    lines = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+[^;]*;", sass, re.M)
    addr = lambda line: int(re.search(r"/\*([0-9a-f]+)\*/", line).group(1), 16)  # noqa: E731
    start = next(i for i, line in enumerate(lines) if "LDGSTS" in line)
    back = next(i for i in range(start, len(lines)) if re.search(r"\bBRA\b", lines[i])
                and int(re.search(r"0x([0-9a-f]+)", lines[i].split("BRA")[1]).group(1), 16) <= addr(lines[i]))
    target = int(re.search(r"0x([0-9a-f]+)", lines[back].split("BRA")[1]).group(1), 16)
    head = next(i for i, line in enumerate(lines) if addr(line) == target)
    return lines[head:back + 1]


def _gathered_loops(switch: str) -> dict:
    """{"off", "on"}: the producer's steady-state loop (_producer_gather_loop) of the page-16 gathered
    d128 forward (varlen, seqused_k, zero-fill; sm_90a) without / with the gathered-page switch, each
    checked for 0 spills, wgmma not serialized and its 64 LDGSTS; skips without cutlass or cuobjdump."""
    pytest.importorskip("cutlass")
    from flash4.config import with_seq_layout

    gathered = with_seq_layout(select_fwd_config(128, "bf16", True), varlen_q=True, seqused_k=True,
                               page_gather=True, gather_zero_fill=True)
    loops = {}
    for name, cfg in (("off", gathered), ("on", dataclasses.replace(gathered, **{switch: True}))):
        res, sass = _fwd_sass(cfg)
        if not res or sass is None:
            pytest.skip("cuobjdump not installed")
        assert res["spills"] == 0 and not res["wgmma_serialized"] and res["ldgsts"] == 64, res
        loops[name] = _producer_gather_loop(sass)
    return loops


def test_gather_clamp_late_sass():
    """sm_90a, the page-16 gathered d128 forward (varlen, seqused_k, zero-fill): the producer loop's
    page-table load is read by the clamp at once without the switch (no cp.async between), and only
    after the block's cp.asyncs with it; 0 spills either way."""
    dist = {name: _first_use_distance(loop) for name, loop in _gathered_loops("gather_clamp_late").items()}
    assert dist["off"] and min(dist["off"]) == 0, dist
    assert dist["on"] and min(dist["on"]) > 0, dist


def test_gather_ptr_shuffle_sass():
    """sm_90a, the page-16 gathered d128 forward (varlen, seqused_k, zero-fill): with the switch the
    producer's steady-state loop (one K and one V load) keeps its 32 LDGSTS and 32 SHFL and drops the
    per-pass 64-bit address math (386 -> 234 instructions on 2026-12-05); 0 spills either way."""
    loops = _gathered_loops("gather_ptr_shuffle")
    for name, loop in loops.items():
        assert sum(" LDGSTS.E" in line for line in loop) == 32, name
        assert sum("SHFL.IDX" in line for line in loop) == 32, name
    assert len(loops["on"]) <= 0.7 * len(loops["off"]), (len(loops["on"]), len(loops["off"]))


def test_page_pieces_all_warps_switch():
    """FwdConfig.page_pieces_all_warps: off and out of the repr in every shipped dense config (the paged
    prefill's plan turns it on: flash4.config.PAGE_PIECES_ALL_WARPS, tests/cpu/test_paged_speed_cpu.py;
    its page-16 kernel compiles in test_page_pieces_all_warps_sass below); with_fwd_switches
    turns it on for TMA page pieces with the look-ahead only (page_prefetch); the config refuses it
    elsewhere."""
    from flash4.config import with_seq_layout
    from flash4.config.sm90 import with_fwd_switches

    switch = "page_pieces_all_warps"
    assert not any(getattr(c, switch, False) for c in shipped_fwd_configs())
    base = select_fwd_config(128, "bf16", True)
    paged = dict(varlen_q=True, seqused_k=True, page_rows=16)
    pieces = with_seq_layout(base, **paged, page_prefetch=True)
    on = with_fwd_switches(pieces, (switch,))
    assert on == dataclasses.replace(pieces, **{switch: True}) and eval(repr(on)) == on
    assert switch not in repr(pieces) and switch in repr(on)
    for cfg in (base, with_seq_layout(base, **paged),
                with_seq_layout(base, varlen_q=True, seqused_k=True, page_gather=True)):
        assert with_fwd_switches(cfg, (switch,)) == cfg
        with pytest.raises(AssertionError):
            dataclasses.replace(cfg, **{switch: True})


def test_page_pieces_all_warps_sass():
    """sm_90a, page-16 TMA pieces with the look-ahead (d128 causal, varlen q, seqused_k): 0 spills, wgmma
    not serialized and the same static UTMALDG count with the switch, and a different kernel (warps
    1-3 of the producer warpgroup run the loop too). Off, the cubins of the shipped page 16 / 32
    configs, tma_pf / tma_pf_s3 and the contiguous config were byte-identical to those of the commit
    before the switch (2026-12-05, FLASH4_CACHE=0, sha256 compared)."""
    pytest.importorskip("cutlass")
    from flash4.config import with_seq_layout

    pieces = with_seq_layout(select_fwd_config(128, "bf16", True), varlen_q=True, seqused_k=True, page_rows=16,
                             page_prefetch=True)
    res_off, off = _fwd_sass(pieces)
    res_on, on = _fwd_sass(dataclasses.replace(pieces, page_pieces_all_warps=True))
    if not res_off:
        pytest.skip("cuobjdump not installed: resources and SASS not checked")
    for res in (res_off, res_on):
        assert res["spills"] == 0 and not res["wgmma_serialized"] and res["utmaldg"] == res_off["utmaldg"], res
    if on is None or off is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    assert on != off


def _pin_p_convert_shipped(cfg) -> bool:
    """The rule of shipped_pin_p_convert spelled out (H200 2026-12-05 night): head dim 192 with Dv = D,
    no window, softcap or sink, P in registers."""
    return (cfg.headdim == 192 and cfg.headdim_v is None and not cfg.local and not cfg.softcap and not cfg.sink
            and not cfg.p_smem)


def test_pin_p_convert_switch():
    """FwdConfig.pin_p_convert: on (and in the repr) in exactly the shipped configs of head dim 192
    without Dv / window / softcap / sink (shipped_pin_p_convert), off and out of the repr in every other
    shipped config; with_fwd_switches turns it on where P stays in registers (not p_smem: the switch
    only pins the register fragment) and keeps it at d192."""
    from flash4.config.sm90 import with_fwd_switches

    switch = "pin_p_convert"
    on_d192 = []
    for c in shipped_fwd_configs():
        assert getattr(c, switch, False) == _pin_p_convert_shipped(c), c
        if c.pin_p_convert:
            on_d192.append(c)
            assert repr(c).endswith(f", {switch}=True)") and eval(repr(c)) == c
        else:
            assert switch not in repr(c), c
    # every dtype, causal or not, long and short (seqlen_k <= SHORT_SEQLEN_K): at least 4 plain d192 configs
    assert len(on_d192) >= 4 and {(c.dtype, c.causal) for c in on_d192} == {
        (dt, causal) for dt in ("bf16", "fp16") for causal in (False, True)}
    for kw in (dict(local=True), dict(softcap=True), dict(sink=True), dict(headdim_v=128)):
        for causal in (False, True):
            assert not select_fwd_config(192, "bf16", causal, **kw).pin_p_convert, kw
    for d, causal in ((64, False), (128, True), (256, False)):
        base = select_fwd_config(d, "bf16", causal)
        on = with_fwd_switches(base, (switch,))
        assert on == dataclasses.replace(base, **{switch: True}) and eval(repr(on)) == on
        assert switch not in repr(base) and repr(on).endswith(f", {switch}=True)")
    d192 = select_fwd_config(192, "bf16", True)
    assert d192.pin_p_convert and with_fwd_switches(d192, (switch,)) == with_fwd_switches(d192, ()) == d192
    p_smem = dataclasses.replace(select_fwd_config(96, "bf16", False), p_smem=True)
    assert with_fwd_switches(p_smem, (switch,)) == p_smem


@pytest.mark.parametrize("d", [16, 32, 64, 96, 128, 192, 256])
def test_shipped_pin_p_convert(d):
    """shipped_pin_p_convert (pure): pin_p_convert on at head dim 192 only, with Dv = D and no window,
    softcap, sink or P through smem; every other config unchanged (idempotent, never turns it off)."""
    from flash4.config.sm90 import shipped_pin_p_convert

    for dtype in ("bf16", "fp16"):
        for causal in (False, True):
            plain = dataclasses.replace(select_fwd_config(d, dtype, causal), pin_p_convert=False)
            got = shipped_pin_p_convert(plain)
            assert got == (dataclasses.replace(plain, pin_p_convert=True) if d == 192 else plain), got
            assert shipped_pin_p_convert(got) == got
            for kw in (dict(local=True, causal=False), dict(softcap=True), dict(sink=True), dict(p_smem=True)):
                other = dataclasses.replace(plain, **kw)
                assert shipped_pin_p_convert(other) == other, kw
            on = dataclasses.replace(plain, pin_p_convert=True)  # set by hand elsewhere: kept
            assert shipped_pin_p_convert(on) == on
    if d == 192:
        hdimv = dataclasses.replace(select_fwd_config(192, "bf16", True, headdim_v=128), pin_p_convert=False)
        assert shipped_pin_p_convert(hdimv) == hdimv


@pytest.mark.parametrize("d", [64, 128])
def test_pin_p_convert_sass(d):
    """sm_90a, plain dense non-causal forward: 0 spills, wgmma not serialized, registers unchanged with
    the switch; off, the steady-state step converts P in one run of 32 F2FP after the lazy rescale's
    branch (docs/perf/ncu_2026-12-05.md); on, the F2FPs sit among the MUFU.EX2 (runs < 16)."""
    pytest.importorskip("cutlass")
    from cpu_helpers import sass_main_loop

    base = select_fwd_config(d, "bf16", False)
    res_off, off = _fwd_sass(base)
    res_on, on = _fwd_sass(dataclasses.replace(base, pin_p_convert=True))
    if not res_off or off is None or on is None:
        pytest.skip("cuobjdump not installed: resources and SASS not checked")
    for res in (res_off, res_on):
        assert res["spills"] == 0 and not res["wgmma_serialized"] and res["registers"] == res_off["registers"], res
    runs_off = _opcode_runs(sass_main_loop(off), "F2FP", "MUFU")
    runs_on = _opcode_runs(sass_main_loop(on), "F2FP", "MUFU")
    assert max(runs_off) >= 32 and max(runs_on) < 16, (runs_off, runs_on)
