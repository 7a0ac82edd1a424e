"""sm_90 kernels at every multiple of 16 up to 128 (flash4.config.sm90.KERNEL_HEADDIMS, FLASH4_HEADDIM16):
the API's padding rule with the switch on and off (pure), the configs they select, and that the
kernels and row-wise passes compile for sm_90a clean at those head dims (no GPU)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4 import env, headdim as hd  # noqa: E402
from flash4.config import SUPPORTED_HEADDIMS, kernel_headdims, sm90  # noqa: E402

NEW = (16, 32, 48, 80, 112)


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("FLASH4_HEADDIM16", "1")
    monkeypatch.delenv("FLASH4_FAMILY", raising=False)


def test_kernel_headdims_table():
    assert sm90.KERNEL_HEADDIMS == (16, 32, 48, 64, 80, 96, 112, 128, 192, 256)
    assert set(SUPPORTED_HEADDIMS) <= set(sm90.KERNEL_HEADDIMS)
    assert all(d % sm90.HEADDIM_STEP == 0 for d in sm90.KERNEL_HEADDIMS)


def test_switch_on_by_default(monkeypatch):
    monkeypatch.delenv("FLASH4_HEADDIM16", raising=False)
    monkeypatch.delenv("FLASH4_FAMILY", raising=False)
    assert env.headdim16() and kernel_headdims(90) == sm90.KERNEL_HEADDIMS


def test_switch_off(monkeypatch):
    monkeypatch.setenv("FLASH4_HEADDIM16", "0")
    assert not env.headdim16() and kernel_headdims(90) == SUPPORTED_HEADDIMS
    assert hd.padded_headdims(80, 80, 90) == (96, 96) and not hd.is_native(80, 80, 90)
    assert "FLASH4_HEADDIM16" in env.PLAN_VARIABLES  # the memo keys on it


@pytest.mark.parametrize("d, want", [(80, 80), (112, 112), (32, 32), (48, 48), (16, 16), (8, 16), (24, 32),
                                     (40, 48), (72, 80), (88, 96), (120, 128), (64, 64), (136, 192), (200, 256)])
def test_padding_rule_on(on, d, want):
    assert kernel_headdims(90) == sm90.KERNEL_HEADDIMS
    assert hd.padded_headdims(d, d, 90) == (want, want)
    assert hd.is_native(d, d, 90) == (d == want)
    assert hd.training_headdims(d, d, 90) == (want, want)


@pytest.mark.parametrize("d, dv", [(32, 128), (112, 64), (40, 16), (192, 128)])
def test_unequal_pairs_keep_the_old_rule(on, d, dv):
    assert hd.padded_headdims(d, dv, 90) == hd.padded_headdims(d, dv)


@pytest.mark.parametrize("arch", [80, 100, None])
def test_other_families_unchanged(on, arch):
    assert hd.padded_headdims(80, 80, arch) == (96, 96) and not hd.is_native(80, 80, arch)


def test_forced_portable_family_unchanged(on, monkeypatch):
    monkeypatch.setenv("FLASH4_FAMILY", "portable")
    assert kernel_headdims(90) == SUPPORTED_HEADDIMS and hd.padded_headdims(80, 80, 90) == (96, 96)


@pytest.mark.parametrize("d", NEW)
@pytest.mark.parametrize("causal", [False, True])
def test_configs_select(d, causal):
    fwd = sm90.select_fwd_config(d, "bf16", causal)
    bwd = sm90.select_bwd_config(d, "bf16", causal)
    assert fwd.headdim == d and bwd.headdim == d and bwd.smem_bytes() <= sm90.BWD_SMEM_BUDGET
    # the tiles of the next SUPPORTED_HEADDIMS entry's range (d <= 64: 192 rows; else 128)
    assert fwd.tile_m == (192 if d <= 64 else 128)
    sm90.select_bwd_config(d, "bf16", causal, deterministic=True)
    sm90.select_fwd_config(d, "bf16", False, local=True, softcap=True)


@pytest.mark.parametrize("d", [144, 160, 240, 8, 72])
def test_not_kernel_headdims(d):
    with pytest.raises(ValueError, match="not supported"):
        sm90.select_fwd_config(d)
    with pytest.raises(ValueError, match="not supported"):
        sm90.select_bwd_config(d)


def _clean(compiled):
    from flash4.compile.check import extract_cubin, resource_usage

    res = resource_usage(extract_cubin(compiled))
    if not res:
        pytest.skip("cuobjdump not installed: resources not checked")
    assert res["spills"] == 0 and not res["wgmma_serialized"] and res["hgmma"] > 0, res
    return res


@pytest.mark.parametrize("d", NEW)
@pytest.mark.parametrize("causal", [False, True])
def test_main_kernels_compile_clean(d, causal):
    """sm_90a: the plain forward and backward at the new head dims: no spill, wgmma not serialized."""
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_bwd, compile_fwd

    _clean(compile_fwd(sm90.select_fwd_config(d, "bf16", causal)))
    _clean(compile_bwd(sm90.select_bwd_config(d, "bf16", causal)))


def _variants(d):
    from flash4.config import with_dkv_accum, with_seq_layout

    sel_f, sel_b = sm90.select_fwd_config, sm90.select_bwd_config
    fwd = [sel_f(d, "bf16", False, local=True), sel_f(d, "bf16", True, softcap=True), sel_f(d, "bf16", True, sink=True),
           with_seq_layout(sel_f(d, "bf16", True), varlen_q=True, varlen_k=True),
           with_seq_layout(sel_f(d, "bf16", False), seqused_k=True, split_kv=True),
           sm90.with_pack_gqa(sel_f(d, "bf16", False, local=True), 8, 2)]
    base = sel_b(d, "bf16", True)
    bwd = [sel_b(d, "bf16", False, local=True), sel_b(d, "bf16", True, softcap=True),
           sel_b(d, "bf16", True, deterministic=True),
           with_seq_layout(base, varlen_q=True, varlen_k=True),
           with_dkv_accum(sel_b(d, "bf16", False), 4, 1, 1), sm90.with_sink_delta(base)]
    return fwd, bwd


@pytest.mark.parametrize("d", [16, 80])
def test_variants_compile_clean(d):
    """Windows, softcap, sinks, packed layouts, split-KV, GQA packing, deterministic, the dK/dV fp32
    accumulation (GQA head split) and the sink gradient at an even and an odd multiple of 16."""
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_bwd, compile_fwd

    fwd, bwd = _variants(d)
    for cfg in fwd:
        _clean(compile_fwd(cfg))
    for cfg in bwd:
        _clean(compile_bwd(cfg))


@pytest.mark.parametrize("d", [16, 48, 80])
def test_row_passes_compile(d):
    """Preprocess, dQ postprocess (row-major, accumulator order, 16-byte stores) and the split-KV
    combine at head dims that are not multiples of 32 (the last pass of a row predicated)."""
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_combine, compile_postprocess, compile_preprocess

    for varlen in (False, True):
        compile_preprocess(d, "bf16", varlen)
        compile_postprocess(d, "bf16", varlen)
    tile_m = sm90.select_bwd_config(d, "bf16", False).tile_m
    compile_postprocess(d, "bf16", False, accum_tile_m=tile_m)
    compile_postprocess(d, "bf16", False, accum_tile_m=tile_m, wide_stores=True)
    compile_combine(d, "bf16")
    compile_combine(d, "bf16", packed_rows=True)


def _meta(*shape):
    import torch

    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("d, causal, hk", [(80, False, 8), (80, True, 2), (112, True, 8), (112, False, 1),
                                           (32, False, 8), (48, True, 2)])
def test_planned_configs_compile_clean(d, causal, hk):
    """The configs the API plans for a dense request (flash4.config.fwd_config / bwd_config: the
    shipped choices on top of the selectors: d80's 192-row p_smem forward tiles, d112's whole-tile
    per-warpgroup dQ hand-off, the GQA head split) compile clean for sm_90a."""
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_bwd, compile_fwd
    from flash4.config import bwd_config, fwd_config
    from flash4.request import Request

    request = Request.dense(_meta(2, 4096, 8, d), _meta(2, 4096, hk, d), _meta(2, 4096, hk, d), d ** -0.5, causal)
    fwd, bwd = fwd_config(request, 90).cfg, bwd_config(request, 90).cfg
    assert fwd.headdim == d and bwd.headdim == d
    if d == 80:
        assert fwd.p_smem and fwd.tile_m == 192
    if d == 112:
        assert bwd.dq_whole and bwd.dq_handoff_per_wg
    _clean(compile_fwd(fwd))
    _clean(compile_bwd(bwd))
