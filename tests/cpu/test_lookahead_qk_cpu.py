"""The forward's speed switch FwdConfig.lookahead_qk (off by default; docs/design/speed_candidates.md
section 5), on the CPU: the config field (off everywhere, out of every shipped config's repr), where
it is built (flash4.config.sm90.lookahead_qk_error / lookahead_qk_config), FLASH4_FWD_SWITCHES
(with_fwd_switches turns it on only where it is built), and the sm_90a compile of the switched-on
kernels: no spill, wgmma not serialized, more HGMMA than off (the look-ahead Q K^T sites). The GPU
side is tests/gpu/test_speed_switches.py (test_lookahead_qk, test_fwd_switches_env) and
tools/ab_fwd.py --variants la (speed)."""

import dataclasses
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config import FwdConfig, select_fwd_config, shipped_fwd_configs  # noqa: E402, F401 (eval)
from flash4.config.sm90 import (LOOKAHEAD_QK_REGS, lookahead_qk_config, lookahead_qk_error,  # noqa: E402
                                lookahead_qk_regs, with_fwd_switches)
from flash4.constants import FWD_SPEED_SWITCHES  # noqa: E402


def test_off_everywhere_and_out_of_repr():
    assert "lookahead_qk" in FWD_SPEED_SWITCHES
    assert FwdConfig(headdim=128).lookahead_qk is False
    for cfg in shipped_fwd_configs():  # off (and out of the repr, so the cache keys stay) but where shipped
        if isinstance(cfg, FwdConfig) and not (cfg.headdim, cfg.headdim_v, cfg.causal, cfg.dtype) == (128, 64, True,
                                                                                                       "bf16"):
            assert not cfg.lookahead_qk and "lookahead_qk" not in repr(cfg), cfg
    on = lookahead_qk_config(select_fwd_config(128, "bf16", True, headdim_v=64))
    assert repr(on).endswith(", lookahead_qk=True)") and eval(repr(on)) == on


def test_registers_rule():
    """S + next S (fp32) + P (16-bit) + O (fp32) per thread of a 64-row warpgroup."""
    cfg = select_fwd_config(192, "bf16", False, headdim_v=128)
    assert (cfg.tile_n, lookahead_qk_regs(cfg)) == (128, 224)
    assert lookahead_qk_regs(dataclasses.replace(cfg, tile_n=112)) == 204 <= LOOKAHEAD_QK_REGS
    assert lookahead_qk_regs(select_fwd_config(128, "bf16", True, headdim_v=64)) == 192


@pytest.mark.parametrize("d, dv, causal, local, tile_n", [
    (192, 128, False, False, 112),  # shipped tile 128 needs 224 registers: 112
    (192, 128, True, False, 80),  # masked D = 192: 80 (spills at 112 and 96)
    (192, 128, False, True, 80),
    (128, 64, True, False, 128),
    (128, 64, False, False, 128),
    (128, 64, False, True, 128),
])
def test_built_where_it_fits(d, dv, causal, local, tile_n):
    base = select_fwd_config(d, "bf16", causal, local=local, headdim_v=dv)
    on = lookahead_qk_config(base)
    assert on is not None and on.lookahead_qk and on.tile_n == tile_n
    assert dataclasses.replace(on, lookahead_qk=False) == dataclasses.replace(base, tile_n=tile_n)
    assert lookahead_qk_error(on) is None


@pytest.mark.parametrize("kwargs, why", [
    (dict(headdim=128), "Dv < D only"),
    (dict(headdim=192), "Dv < D only"),
    (dict(headdim=64, headdim_v=128), "Dv < D only"),
    (dict(headdim=192, headdim_v=128), "224 accumulator registers"),
    (dict(headdim=192, headdim_v=128, tile_n=112, causal=True), "causal or windowed headdim=192"),
    (dict(headdim=192, headdim_v=128, tile_n=96, local=True), "causal or windowed headdim=192"),
    (dict(headdim=128, headdim_v=64, tile_m=192), "two consumer warpgroups"),
    (dict(headdim=128, headdim_v=64, kv_stages=1), "kv_stages >= 2"),
    (dict(headdim=128, headdim_v=64, page_gather=True, seqused_k=True), "page_gather"),
    (dict(headdim=128, headdim_v=64, arch=100), "sm90"),
])
def test_refused_elsewhere(kwargs, why):
    """Where the second S accumulator does not fit (or was not measured clean) the config refuses
    the switch with a ValueError that says why; off, the same config is fine."""
    FwdConfig(**kwargs)
    assert why in lookahead_qk_error(FwdConfig(**kwargs))
    with pytest.raises(ValueError, match=f"FwdConfig.lookahead_qk: .*{why}"):
        FwdConfig(**kwargs, lookahead_qk=True)


def test_config_none_where_not_built():
    assert lookahead_qk_config(select_fwd_config(128, "bf16", False)) is None
    assert lookahead_qk_config(select_fwd_config(64, "bf16", True, headdim_v=128)) is None


def test_with_fwd_switches():
    """FLASH4_FWD_SWITCHES=lookahead_qk turns it on only where the config is built as it is (no tile
    change): every (128, 64) forward with TMA K/V; (192, 128) and the other head dims unchanged."""
    names = ("lookahead_qk",)
    for d, dv, causal in ((128, 64, True), (128, 64, False)):
        cfg = select_fwd_config(d, "bf16", causal, headdim_v=dv)
        assert with_fwd_switches(cfg, names) == dataclasses.replace(cfg, lookahead_qk=True)
        assert with_fwd_switches(cfg, ()) == cfg
    for cfg in (select_fwd_config(192, "bf16", False, headdim_v=128), select_fwd_config(128, "bf16", False),
                select_fwd_config(64, "bf16", True), select_fwd_config(192, "bf16", True, local=True, headdim_v=128),
                dataclasses.replace(select_fwd_config(128, "bf16", True, headdim_v=64), page_gather=True,
                                    seqused_k=True)):
        assert with_fwd_switches(cfg, names) == cfg
    both = with_fwd_switches(select_fwd_config(128, "bf16", True, headdim_v=64), ("lookahead_qk", "softmax_vote_first"))
    assert both.lookahead_qk and both.softmax_vote_first


def test_env_names_it(monkeypatch):
    from flash4 import env

    monkeypatch.setenv("FLASH4_FWD_SWITCHES", "lookahead_qk")
    assert env.fwd_switches() == ("lookahead_qk",)


@pytest.mark.parametrize("d, dv, causal", [(192, 128, False), (192, 128, True), (128, 64, True)],
                         ids=["192-128-full", "192-128-causal", "128-64-causal"])
def test_lookahead_qk_compiles_clean(d, dv, causal):
    """sm_90a: the switched-on forward compiles with no spill and wgmma not serialized (ptxas C7512 /
    C7514 would give one WARPGROUP.ARRIVE per HGMMA), and has more HGMMA than the same tile off (the
    first block's look-ahead Q K^T, the pair steps' and the odd step's)."""
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage

    on = lookahead_qk_config(select_fwd_config(d, "bf16", causal, headdim_v=dv))
    res_on = resource_usage(extract_cubin(compile_fwd(on)))
    if not res_on:
        pytest.skip("cuobjdump not installed: resources not checked")
    res_off = resource_usage(extract_cubin(compile_fwd(dataclasses.replace(on, lookahead_qk=False))))
    for res in (res_on, res_off):
        assert res["spills"] == 0 and not res["wgmma_serialized"] and res["registers"] == 168, res
    assert res_on["hgmma"] > res_off["hgmma"] > 0, (res_on, res_off)


def test_shipped_lookahead_qk_rule():
    """shipped_lookahead_qk: on for the plain dense bf16 (128, 64) causal forward only (the measured
    cell), through fwd_plan's dense branch; (192, 128), fp16, non-causal, softcap and windows keep it off."""
    from flash4.config.sm90 import select_fwd_config, shipped_fwd_configs, shipped_lookahead_qk

    assert shipped_lookahead_qk(select_fwd_config(128, "bf16", True, headdim_v=64)).lookahead_qk
    for args, kw in (((128, "fp16", True), {}), ((128, "bf16", False), {}), ((192, "bf16", True), {}),
                     ((128, "bf16", True), {"softcap": True}), ((128, "bf16", True), {"local": True})):
        dv = 64 if args[0] == 128 else 128
        assert not shipped_lookahead_qk(select_fwd_config(*args, headdim_v=dv, **kw)).lookahead_qk, (args, kw)
    assert not shipped_lookahead_qk(select_fwd_config(128, "bf16", True)).lookahead_qk  # Dv = D
    assert [c for c in shipped_fwd_configs() if c.lookahead_qk] == [
        shipped_lookahead_qk(select_fwd_config(128, "bf16", True, headdim_v=64))]
