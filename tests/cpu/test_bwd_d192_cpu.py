"""Head dim 192 and (192, 128) backward: the transposed_dkv path (config.BwdConfig.transposed_dkv;
design /work/notes/d192_bwd_design.md). Config rules, shared-memory budget, and a CPU compile check
(sm_90a: no spills, wgmma not serialized) of the configs that select it."""

import dataclasses

import pytest

from flash4.config import (
    BWD_SMEM_BUDGET,
    SM90_MAX_SMEM_BYTES,
    BwdConfig,
    bwd_smem_bytes,
    select_bwd_config,
    shipped_bwd_configs,
    with_dkv_accum,
    with_seq_layout,
)

DTYPES = ("bf16", "fp16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_d192_selects_transposed_dkv(dtype, causal, deterministic):
    cfg = select_bwd_config(192, dtype, causal, deterministic=deterministic)
    assert cfg.transposed_dkv and not cfg.split_headdim
    assert (cfg.tile_m, cfg.tile_n, cfg.q_stages, cfg.do_stages) == (64, 96, 2, 1)
    assert cfg.num_do_stages == 1 and cfg.causal == causal and cfg.deterministic == deterministic


@pytest.mark.parametrize("causal", [False, True])
def test_hdimv_192_128_selects_transposed_dkv(causal):
    cfg = select_bwd_config(192, "bf16", causal, headdim_v=128)
    assert cfg.transposed_dkv and not cfg.split_headdim and cfg.headdim_v == 128
    assert (cfg.tile_m, cfg.tile_n, cfg.q_stages, cfg.num_do_stages) == (64, 96, 2, 2)


@pytest.mark.parametrize("kw", [dict(local=True), dict(softcap=True), dict(local=True, softcap=True),
                                dict(causal=True, softcap=True)])
def test_d192_variants_keep_transposed_dkv(kw):
    for dv in (None, 128):
        cfg = select_bwd_config(192, "bf16", headdim_v=dv, **kw)
        assert cfg.transposed_dkv and cfg.tile_n == 96
        assert cfg.local == kw.get("local", False) and cfg.softcap == kw.get("softcap", False)
        if cfg.local:
            assert not cfg.causal


def test_seq_layout_and_head_split_keep_transposed_dkv():
    for dv in (None, 128):
        base = select_bwd_config(192, "bf16", True, headdim_v=dv)
        packed = with_seq_layout(base, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)
        assert packed.transposed_dkv and packed.tile_n == 96 and packed.varlen_q and packed.varlen_k
        split = with_dkv_accum(base, 8, 1, 2)
        assert split.dkv_accum and split.transposed_dkv and (split.tile_m, split.tile_n) == (64, 96)
        det = with_dkv_accum(select_bwd_config(192, "bf16", True, deterministic=True, headdim_v=dv), 8, 1, 2)
        assert det.dkv_accum and det.transposed_dkv


def test_other_headdims_unchanged():
    """Only 192 and (192, 128) take the new path; d256 stays split_headdim, d <= 128 as before."""
    for d in (64, 96, 128, 256):
        for dt in DTYPES:
            cfg = select_bwd_config(d, dt, True)
            assert not cfg.transposed_dkv and cfg.do_stages is None and cfg.num_do_stages == cfg.q_stages
            assert cfg.split_headdim == (d > 128) and cfg.tile_n == (64 if d > 128 else 128)
    for d, dv in ((128, 64), (64, 128)):
        cfg = select_bwd_config(d, "bf16", False, headdim_v=dv)
        assert not cfg.transposed_dkv and cfg.tile_n == 128


def test_smem_budget():
    """K, V (96 keys), 2 Q stages, 1 (d192) / 2 ((192, 128)) dO stages, P and dS (64 x 96 each),
    the fp32 dQ tile with 32-B padded rows, LSE / D stages (design: 224,000 and 220,160 bytes)."""
    d192 = select_bwd_config(192)
    assert d192.smem_bytes() == 96 * 384 * 2 + 2 * 64 * 192 * 2 + 64 * 192 * 2 + 2 * 64 * 96 * 2 + 64 * 200 * 4 + 3 * 64 * 4
    assert d192.smem_bytes() == 224_000 and d192.dq_row_pad == 8 and not d192.dq_whole_tile
    assert select_bwd_config(192, headdim_v=128).smem_bytes() == 220_160
    # a second dO stage does not fit at d192
    assert bwd_smem_bytes(192, 64, 96, 2, False, None, True, 2) > BWD_SMEM_BUDGET
    assert bwd_smem_bytes(192, 64, 96, 2, False, 128, True, 2) <= BWD_SMEM_BUDGET
    for cfg in (d192, select_bwd_config(192, headdim_v=128)):
        assert cfg.smem_bytes() <= BWD_SMEM_BUDGET < SM90_MAX_SMEM_BYTES
    # the old path's formula is unchanged
    assert bwd_smem_bytes(192, 64, 64, 2, True) == 231_424


def test_config_asserts():
    base = select_bwd_config(192)
    with pytest.raises(AssertionError):
        dataclasses.replace(base, tile_n=64)
    with pytest.raises(AssertionError):
        dataclasses.replace(base, split_headdim=True)
    with pytest.raises(AssertionError):
        dataclasses.replace(base, do_stages=2)  # over the smem budget
    with pytest.raises(AssertionError):
        BwdConfig(headdim=128, do_stages=1)  # do_stages is a transposed_dkv field


def test_shipped_configs_include_transposed():
    shipped = shipped_bwd_configs()
    t = [c for c in shipped if c.transposed_dkv]
    assert {(c.headdim, c.headdim_v) for c in t} == {(192, None), (192, 128)}
    assert any(c.dkv_accum for c in t) and any(c.deterministic for c in t)
    assert not any(c.split_headdim and c.headdim == 192 for c in shipped)


def _new_configs():
    sel = select_bwd_config
    cfgs = [sel(192, dt, c) for dt in DTYPES for c in (False, True)]
    cfgs += [sel(192, "bf16", True, deterministic=True)]
    cfgs += [sel(192, "bf16", c, headdim_v=128) for c in (False, True)]
    cfgs += [with_seq_layout(sel(192, "bf16", True), varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)]
    cfgs += [sel(192, "bf16", local=True), sel(192, "bf16", True, softcap=True)]
    cfgs += [with_dkv_accum(sel(192, "bf16", True), 2, 1, 1), with_dkv_accum(sel(192, "bf16", True, headdim_v=128), 2, 1, 1)]
    return cfgs


NEW = _new_configs()


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("cutlass")
    from flash4.compile.check import compile_check

    return compile_check(NEW)


@pytest.mark.parametrize("i", range(len(NEW)), ids=[
    f"d{c.headdim}{'' if c.headdim_v is None else f'v{c.headdim_v}'}-{c.dtype}{'-causal' if c.causal else ''}"
    f"{'-det' if c.deterministic else ''}{'-varlen' if c.varlen_q else ''}{'-local' if c.local else ''}"
    f"{'-softcap' if c.softcap else ''}{'-dkv-accum' if c.dkv_accum else ''}" for c in NEW])
def test_transposed_dkv_compiles_clean(rows, i, compiled_clean):
    assert NEW[i].transposed_dkv
    row = rows[i]
    compiled_clean(row)
    assert row["utmaldg"] > 0
    # 54 (d192) / 46 ((192, 128)) HGMMA per step, per loop copy (masked / unmasked, + window edge)
    per_step = 54 if NEW[i].headdim_v is None else 46
    assert row["hgmma"] % per_step == 0, row["hgmma"]
