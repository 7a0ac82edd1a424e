"""The sm100 forward's pure plans (flash4.config.sm100), checked on the CPU: the shipped configs,
the TMEM map against flash-attn-4's, the setmaxnreg plan, the pipeline arrive counts, refusals of
what the kernel does not build, and the registry entry (unverified, served behind the first-use self-test)."""

import dataclasses
import itertools

import pytest

from flash4.config import sm100
from flash4.config.sm100 import (LAUNCH_REGS, TMEM_ALIASES, TMEM_COLUMNS, RegisterPlan, Signal, Sm100FwdConfig,
                                 default_register_plan, pipeline_specs, register_plan, select_bwd_config,
                                 select_fwd_config, shipped_bwd_configs, shipped_fwd_configs, tmem_alloc_cols,
                                 tmem_map, tmem_used_cols)
from flash4.kernels import registry

CONFIGS = shipped_fwd_configs()
IDS = [f"d{c.headdim}" + (f"v{c.headdim_v}" if c.headdim_v else "") + f"-{c.dtype}-{'causal' if c.causal else 'full'}"
       f"-{c.cta_group}cta" + ("-softcap" if c.softcap else "") + ("-sink" if c.sink else "")
       + ("-local" if c.local else "") for c in CONFIGS]
Q_STAGE_1 = [c for c in CONFIGS if c.q_stage == 1]
ONE_CTA = [c for c in CONFIGS if c.cta_group == 1 and c.q_stage == 2]
TWO_CTA = [c for c in CONFIGS if c.cta_group == 2]


def test_shipped_configs_cover_the_grid():
    assert len(CONFIGS) == 168 and len(ONE_CTA) == 96 and len(TWO_CTA) == 8 and len(Q_STAGE_1) == 64
    assert {(c.headdim, c.dtype, c.causal, c.local, c.softcap, c.sink) for c in ONE_CTA} == set(
        itertools.product((64, 96, 128), ("bf16", "fp16"), *[(False, True)] * 4))
    assert shipped_fwd_configs(features=False) == [c for c in CONFIGS if not (c.local or c.softcap or c.sink)]
    for c in ONE_CTA:
        assert (c.q_stage, c.tile_m, c.tile_n, c.cta_group, c.arch) == (2, 128, 128, 1, 100)
        assert c.cta_tile_m == 256 and c.num_threads == 512
        assert c.lpt == (c.causal and not c.local) and not c.persistent
        assert c.exp2_emu_frac == (sm100.EXP2_EMU_FRAC_CAUSAL if c.causal or c.local else sm100.EXP2_EMU_FRAC) > 0
        assert c.rescale_threshold == 8.0
        assert c.smem_bytes() <= sm100.SMEM_KV_BUDGET
    assert CONFIGS[-len(Q_STAGE_1):] == Q_STAGE_1  # shipped last: the q_stage 2 lists keep their order


def test_q_stage_1_configs():
    """(192, 128) and hd256 x bf16 / fp16 x causal / not x window / softcap / sink: one 128-row Q tile
    per CTA (q_stage 1), 1-CTA, dense; K/V stages from the 224 KiB formula; 256/152/80 plus the idle
    softmax1 warpgroup at 24 (plan.default_register_plan)."""
    assert {((c.headdim, c.hdim_v), c.dtype, c.causal, c.local, c.softcap, c.sink) for c in Q_STAGE_1} == set(
        itertools.product(((192, 128), (256, 256)), ("bf16", "fp16"), *[(False, True)] * 4))
    for c in Q_STAGE_1:
        assert (c.q_stage, c.tile_m, c.tile_n, c.cta_group, c.cta_tile_m) == (1, 128, 128, 1, 128)
        assert c.headdim_v == (128 if c.headdim == 192 else None)
        assert not c.varlen_q and c.lpt == (c.causal and not c.local)
        assert c.exp2_emu_frac == (sm100.EXP2_EMU_FRAC_CAUSAL if c.causal or c.local else sm100.EXP2_EMU_FRAC)
        plan = register_plan(c)
        assert dataclasses.astuple(plan) == (256, 152, 80, 1)
        assert plan.per_warpgroup() == (256, sm100.IDLE_REGS, 152, 80) and sum(plan.per_warpgroup()) == 512
        assert plan.by_role()["softmax1"] == sm100.IDLE_REGS == 24
        assert plan.setmaxnreg_sites() == [("dec", 24), ("dec", 80), ("inc", 152), ("inc", 256)]
        assert c.smem_bytes() <= sm100.SMEM_KV_BUDGET
    # (192, 128): Q 48 KiB + O 32 KiB + 3 x 48 KiB; hd256: 64 + 64 + 1 x 64 KiB (one K/V stage)
    assert {(c.headdim, c.kv_stages, c.smem_bytes()) for c in Q_STAGE_1} == {
        (192, 3, (48 + 32 + 3 * 48) * 1024), (256, 1, (64 + 64 + 64) * 1024)}
    # q_stage 2 would leave (192, 128) one stage (96 + 64 KiB of Q and O); hd256 does not fit (256 KiB)
    assert sm100.kv_stages_for(192, 128, q_stage=2) == 1 and sm100.kv_stages_for(256, 256, q_stage=2) < 1


@pytest.mark.parametrize("hd,dv", [(192, 128), (256, None)])
def test_q_stage_1_packed_varlen_is_built(hd, dv):
    """(192, 128) and hd256 take packed sequences (varlen, seqused_q / seqused_k) and dense seqused_k,
    at q_stage 1 with the dense config's plan (compile-verified, not run on hardware)."""
    base = select_fwd_config(hd, headdim_v=dv)
    for layout in (dict(varlen_q=True, varlen_k=True), dict(varlen_q=True, varlen_k=True, seqused_q=True),
                   dict(varlen_q=True, varlen_k=True, seqused_k=True), dict(seqused_k=True)):
        cfg = dataclasses.replace(base, **layout)
        assert (cfg.q_stage, cfg.kv_stages, register_plan(cfg)) == (1, base.kv_stages, register_plan(base))
        assert "v_tail" in pipeline_specs(cfg)  # ragged keys: the V-tail zeroing, one K/V stage at hd256
    with pytest.raises(ValueError, match="only \\(1, 128, 128, 1\\)"):
        dataclasses.replace(base, q_stage=2)


def test_kv_stages_are_fa4s_formula():
    # min((224 KiB - Q - O) / stage, 32), Q and O two 128-row tiles each (FA4 flash_fwd_sm100.py:426);
    # 2-CTA: a stage is half a K/V block per CTA (FA4 :397), so hd128 fits 6
    assert {c.headdim: c.kv_stages for c in ONE_CTA} == {64: 10, 96: 5, 128: 3}
    assert {c.kv_stages for c in TWO_CTA} == {6} and {c.smem_bytes() for c in TWO_CTA} == {sm100.SMEM_KV_BUDGET}


# ---------------------------------------------------------------- 2-CTA
def test_two_cta_configs():
    """hd128 non-causal x bf16 / fp16 x softcap / sink, a cluster of 2 per tile of 512 query rows,
    FA4's 2-CTA register plan (184/80/64), exp2 emulation 1/8 (1/4 spilled at 184 registers)."""
    assert {(c.headdim, c.dtype, c.causal, c.local, c.softcap, c.sink) for c in TWO_CTA} == set(
        itertools.product((128,), ("bf16", "fp16"), (False,), (False,), (False, True), (False, True)))
    for c in TWO_CTA:
        assert (c.q_stage, c.tile_m, c.tile_n, c.cta_tile_m) == (2, 128, 128, 512)
        assert dataclasses.astuple(register_plan(c)) == (184, 80, 64, 2)
        assert c.exp2_emu_frac == sm100.EXP2_EMU_FRAC_CAUSAL and not c.lpt
        assert tmem_map(c) == tmem_map(select_fwd_config(128))  # the TMEM map is per CTA, unchanged
    assert dataclasses.astuple(default_register_plan(128, False, cta_group=2))[:3] == (184, 80, 64)  # FA4 :380-403


def test_two_cta_is_opt_in():
    """select_fwd_config returns 1-CTA unless asked (two_cta; the host passes FLASH4_SM100_2CTA), and
    asked, only where 2-CTA is built (otherwise the 1-CTA config)."""
    assert select_fwd_config(128).cta_group == 1
    assert select_fwd_config(128, two_cta=True).cta_group == 2
    for kwargs in (dict(headdim=64), dict(headdim=96), dict(headdim=128, causal=True), dict(headdim=128, local=True)):
        assert select_fwd_config(two_cta=True, **kwargs) == select_fwd_config(**kwargs)


def test_two_cta_env_switch(monkeypatch):
    from flash4 import env

    monkeypatch.delenv("FLASH4_SM100_2CTA", raising=False)
    assert env.sm100_2cta() is False
    for value, want in (("1", True), ("on", True), ("0", False)):
        monkeypatch.setenv("FLASH4_SM100_2CTA", value)
        assert env.sm100_2cta() is want
    monkeypatch.setenv("FLASH4_SM100_2CTA", "maybe")
    with pytest.raises(ValueError, match="FLASH4_SM100_2CTA"):
        env.sm100_2cta()


@pytest.mark.parametrize("base,fields,match", [
    (dict(headdim=64), {}, "headdim=64"), (dict(headdim=96), {}, "headdim=96"),
    (dict(headdim=128, causal=True), {}, "causal"), (dict(headdim=128, local=True), {}, "windowed"),
    (dict(headdim=128), dict(varlen_q=True, varlen_k=True), "packed"), (dict(headdim=128), dict(seqused_q=True), "packed"),
])
def test_two_cta_outside_its_problems_cannot_exist(base, fields, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(select_fwd_config(**base), cta_group=2, **fields)


@pytest.mark.parametrize("seqlen_q,heads,batch,tiles", [(1, 1, 1, 1), (512, 1, 1, 1), (513, 3, 2, 12), (4096, 16, 4, 512)])
def test_two_cta_grid_is_two_ctas_per_tile(seqlen_q, heads, batch, tiles):
    """flash4.launch: a tile is 512 query rows (the pair's 2 x 2 Q tiles of 128), gridDim.x = 2 x tiles
    (launched with cluster (2, 1, 1): a multiple of 2); the 1-CTA grid is unchanged."""
    from flash4 import launch

    cfg = select_fwd_config(128, two_cta=True)
    assert launch.fwd_num_tiles(cfg, batch, seqlen_q, heads) == tiles
    assert launch.fwd_grid(cfg, batch, seqlen_q, heads, 148) == (2 * tiles, 1, 1)
    one = select_fwd_config(128)
    assert launch.fwd_grid(one, batch, seqlen_q, heads, 148) == (-(-seqlen_q // 256) * heads * batch, 1, 1)


# ---------------------------------------------------------------- TMEM
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_tmem_map_fits_and_only_declared_aliases_overlap(cfg):
    m = tmem_map(cfg)
    assert set(m) == {f"{b}{i}" for b in "SOP" for i in range(cfg.q_stage)}
    assert tmem_used_cols(cfg) <= TMEM_COLUMNS == 512
    alloc = tmem_alloc_cols(cfg)
    assert alloc >= 32 and alloc & (alloc - 1) == 0 and tmem_used_cols(cfg) <= alloc <= TMEM_COLUMNS
    for (a, (sa, na)), (b, (sb, nb)) in itertools.combinations(m.items(), 2):
        overlap = sa < sb + nb and sb < sa + na
        declared = (a, b) in TMEM_ALIASES or (b, a) in TMEM_ALIASES
        assert overlap == declared, (a, b, m)
    for inner, outer in TMEM_ALIASES:  # P_i inside S_i
        if inner not in m:  # q_stage 1: no P1 / S1
            continue
        (si, ni), (so, no) = m[inner], m[outer]
        assert so <= si and si + ni <= so + no


@pytest.mark.parametrize("hd,used", [(64, 384), (96, 448), (128, 512)])
def test_tmem_map_equals_flash_attn_4(hd, used):
    """FA4 flash_fwd_sm100.py:360-374 (BLACKWELL.md section 1): S_i at 128 i, O_i at 256 + i dv,
    P_i in the upper half of S_i; columns used hd64 384, hd96 448, hd128 512; 512 allocated."""
    cfg = select_fwd_config(hd)
    assert tmem_map(cfg) == {"S0": (0, 128), "S1": (128, 128), "O0": (256, hd), "O1": (256 + hd, hd),
                             "P0": (64, 64), "P1": (192, 64)}
    assert tmem_used_cols(cfg) == used
    assert tmem_alloc_cols(cfg) == 512


@pytest.mark.parametrize("hd,dv,used", [(192, 128, 384), (256, 256, 512)])
def test_tmem_map_q_stage_1(hd, dv, used):
    """One Q tile: S0 at 0, P0 in its upper half, O0 at 256 (FA4 places O after two S buffers
    whatever q_stage, flash_fwd_sm100.py tmem_o_offset): hd256 uses 512 columns, FA4's count
    (BLACKWELL.md section 1). (192, 128) uses 384; FA4's 512 for it is its q_stage 2 map (O1 at 384),
    not built here. Columns 128 .. 256 stay unused."""
    cfg = select_fwd_config(hd, headdim_v=None if dv == hd else dv)
    assert tmem_map(cfg) == {"S0": (0, 128), "O0": (256, dv), "P0": (64, 64)}
    assert tmem_used_cols(cfg) == used and tmem_alloc_cols(cfg) == 512


# ---------------------------------------------------------------- registers
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_register_plan_is_valid(cfg):
    plan = register_plan(cfg)
    for regs in (plan.softmax, plan.correction, plan.other):
        assert regs % 8 == 0 and 24 <= regs <= 256
    assert sum(plan.per_warpgroup()) <= 512  # 64K registers / 128 threads per warpgroup
    assert LAUNCH_REGS == 65536 // 512 == 128
    # the softmax warpgroups grow (setmaxnreg.inc), the others shrink (.dec below the launch count);
    # q_stage 1: the correction grows too (160, FA4's hd256 budget), softmax1's idle warpgroup shrinks
    assert RegisterPlan.is_increase(plan.softmax)
    assert RegisterPlan.is_increase(plan.correction) == (cfg.q_stage == 1)
    assert not RegisterPlan.is_increase(plan.other)
    assert set(plan.by_role()) == set(sm100.WARP_ROLES)


@pytest.mark.parametrize("hd,causal,plan", [
    (64, False, (200, 64, 48)), (64, True, (200, 64, 48)),  # hd < 96 (FA4 :380-403)
    (96, False, (192, 80, 48)), (96, True, (192, 80, 48)),  # FA4 default
    (128, False, (192, 80, 48)), (128, True, (192, 72, 56)),  # FA4 _TUNING_CONFIG (1-CTA, causal)
])
def test_register_plan_equals_flash_attn_4(hd, causal, plan):
    assert dataclasses.astuple(default_register_plan(hd, causal))[:3] == plan
    assert dataclasses.astuple(register_plan(select_fwd_config(hd, causal=causal))) == (*plan, 2)


def test_register_plan_problems_are_refused():
    with pytest.raises(ValueError, match="sum to 520"):
        Sm100FwdConfig(headdim=128, regs_softmax=200, regs_correction=72, regs_other=48)
    with pytest.raises(ValueError, match="multiple of 8"):
        Sm100FwdConfig(headdim=128, regs_correction=70)


# ---------------------------------------------------------------- pipelines
def test_pipeline_arrive_counts():
    specs = pipeline_specs(select_fwd_config(128))
    counts = {name: (s.stages, s.full_arrivals(), s.empty_arrivals()) for name, s in specs.items()}
    assert counts == {
        "q": (2, 1, 1),  # TMA expect_tx / tcgen05.commit
        "kv": (3, 1, 1),
        "s_p_o": (2, 1, 256),  # commit; softmax warpgroup 128 + correction 128 threads
        "sm_stats": (2, 128, 128),
        "o_full": (2, 1, 128),
        "corr_epi": (2, 128, 1),  # correction threads; the epilogue warp's elected lane
    }
    assert not specs["o_full"].waited_empty
    assert "softmax (all threads: 128) + correction (all threads: 128) = 256" in specs["s_p_o"].describe()


@pytest.mark.parametrize("hd,dv,kv", [(192, 128, 3), (256, None, 1)])
def test_pipeline_arrive_counts_q_stage_1(hd, dv, kv):
    """One Q tile: one stage of each per-Q-tile pipeline, the same arrivals per stage (the softmax
    party is one warpgroup either way)."""
    specs = pipeline_specs(select_fwd_config(hd, headdim_v=dv))
    counts = {name: (s.stages, s.full_arrivals(), s.empty_arrivals()) for name, s in specs.items()}
    assert counts == {"q": (1, 1, 1), "kv": (kv, 1, 1), "s_p_o": (1, 1, 256), "sm_stats": (1, 128, 128),
                      "o_full": (1, 1, 128), "corr_epi": (1, 128, 1)}


def test_two_cta_pipeline_arrive_counts():
    """Per CTA barrier, in a pair (the DSL's PipelineTmaUmma / PipelineUmmaAsync with the pair's
    cluster layout, and FA4's *_cluster groups): the leader's load warp alone arrives with
    expect_tx of both CTAs' bytes (1 arrival, tx x 2); a commit is multicast, one arrival on each
    CTA's barrier; the softmax and correction threads of both CTAs release s_p_o / o_full on the
    leader's barrier (x 2); sm_stats and corr_epi stay CTA-local."""
    cfg = select_fwd_config(128, two_cta=True)
    specs = pipeline_specs(cfg)
    counts = {name: (s.stages, s.full_arrivals(), s.empty_arrivals()) for name, s in specs.items()}
    assert counts == {
        "q": (2, 1, 1), "kv": (6, 1, 1),
        "s_p_o": (2, 1, 512),  # multicast commit; 2 x (softmax 128 + correction 128)
        "sm_stats": (2, 128, 128),
        "o_full": (2, 1, 256),
        "corr_epi": (2, 128, 1),
    }
    assert "correction (all threads from both CTAs: 256) = 512" in specs["s_p_o"].describe()
    assert sm100.tma_tx_bytes(cfg, 16384) == 32768 and sm100.tma_tx_bytes(select_fwd_config(128), 16384) == 16384
    # the 1-CTA specs are the same parties, counted for one CTA
    assert {n: (s.producers, s.consumers) for n, s in specs.items()} == {
        n: (s.producers, s.consumers) for n, s in pipeline_specs(select_fwd_config(128)).items()}


@pytest.mark.parametrize("layout", [dict(varlen_q=True, varlen_k=True), dict(seqused_k=True),
                                    dict(varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)])
def test_ragged_keys_add_the_v_tail_pipeline(layout):
    """Ragged keys (varlen_k or seqused_k): one more pipeline, v_tail (issue 25's V-row zeroing): every
    lane of the load warp arrives full (32, each after its fence.proxy.async), the MMA warp's elected
    lane acknowledges (1); the other pipelines unchanged. Without ragged keys no v_tail."""
    base = select_fwd_config(128, "bf16", True)
    cfg = dataclasses.replace(base, **layout)
    assert sm100.ragged_keys(cfg) and not sm100.ragged_keys(base)
    assert not sm100.ragged_keys(dataclasses.replace(base, varlen_q=True, seqused_q=True))
    specs = pipeline_specs(cfg)
    plain = pipeline_specs(base)
    assert "v_tail" not in plain and {n: s for n, s in specs.items() if n != "v_tail"} == plain
    vt = specs["v_tail"]
    assert (vt.stages, vt.full_arrivals(), vt.empty_arrivals(), vt.waited_empty) == (1, 32, 1, True)
    assert [(p.role, p.signal) for p in vt.producers] == [("load", Signal.ALL_THREADS)]
    assert [(p.role, p.signal) for p in vt.consumers] == [("mma", Signal.ELECTED)]


@pytest.mark.parametrize("hd,dv", [(192, 128), (256, None)])
def test_seqused_k_is_1cta_only(hd, dv):
    """seqused_k (dense or packed) is built for every 1-CTA head dim (q_stage 2: hd 64 / 96 / 128; q_stage
    1: (192, 128), hd256); 2-CTA refuses it by name."""
    for d in (64, 96, 128):
        for causal in (False, True):
            assert dataclasses.replace(select_fwd_config(d, "bf16", causal), seqused_k=True).seqused_k
    assert dataclasses.replace(select_fwd_config(hd, headdim_v=dv), seqused_k=True).seqused_k
    with pytest.raises(ValueError, match="ragged keys"):
        dataclasses.replace(select_fwd_config(128, two_cta=True), seqused_k=True)


def test_every_party_is_a_role():
    for spec in pipeline_specs(select_fwd_config(64)).values():
        for party in spec.producers + spec.consumers:
            assert party.role in sm100.ROLE_WARPS and isinstance(party.signal, Signal)


# ---------------------------------------------------------------- refusals
def test_softcap_sink_and_window_are_built():
    cfg = select_fwd_config(128, "bf16", True, softcap=True)
    assert cfg.softcap and cfg.causal and cfg == dataclasses.replace(select_fwd_config(128, "bf16", True), softcap=True)
    cfg = select_fwd_config(64, "fp16", False, sink=True)
    assert cfg.sink and cfg == dataclasses.replace(select_fwd_config(64, "fp16", False), sink=True)
    cfg = select_fwd_config(96, "bf16", True, local=True)
    assert cfg.local and cfg.causal and not cfg.lpt  # a window's tiles: no LPT order
    packed = dataclasses.replace(select_fwd_config(128), varlen_q=True, varlen_k=True, seqused_q=True)
    assert packed.varlen_q and packed.varlen_k and packed.seqused_q


@pytest.mark.parametrize("kwargs,match", [
    ({"headdim_v": 64}, "headdim_v"), ({"arch": 103}, "sm_100a"),
])
def test_unbuilt_features_raise_at_selection(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_fwd_config(128, "bf16", False, **kwargs)


@pytest.mark.parametrize("hd", [32, 80])
def test_unbuilt_headdims_raise(hd):
    with pytest.raises(ValueError, match=f"headdim={hd}"):
        select_fwd_config(hd)


@pytest.mark.parametrize("hd,dv", [(192, None), (192, 192), (256, 128), (128, 64), (64, 128)])
def test_unbuilt_headdim_pairs_raise(hd, dv):
    """(192, 192) has no FA4 design on sm100; the other Dv != D pairs are not built."""
    with pytest.raises(ValueError, match=f"\\(headdim, headdim_v\\)=\\({hd}, {dv or hd}\\)"):
        select_fwd_config(hd, headdim_v=dv)


@pytest.mark.parametrize("field,value", [
    ("page_rows", 16),
    ("split_kv", True), ("headdim_v", 64), ("pack_gqa", 2),
    ("exp2_emu_frac", 0.33), ("exp2_emu_frac", 1.5), ("persistent", True), ("cta_group", 3), ("q_stage", 1), ("tile_n", 64),
    ("arch", 110), ("kv_stages", 4),
])
def test_a_config_with_an_unbuilt_field_cannot_exist(field, value):
    """The host sets sequence-layout fields with dataclasses.replace (flash4.config.with_seq_layout):
    on sm100 that raises instead of compiling into something wrong."""
    with pytest.raises(ValueError, match="sm100 forward config"):
        dataclasses.replace(select_fwd_config(128), **{field: value})


def test_backward_configs():
    """The 1-CTA backward (tests/cpu/test_sm100_bwd_plan.py has its plan): hd64 / hd128: 24 configs
    without softcap, 4 with (bf16, hd64 / hd128, full / causal); (192, 128) (the serial schedule): 12
    without softcap, 11 with (bf16 causal deterministic softcap is refused: it spills); then the 2-CTA
    hd128 and (192, 128) ones (tests/cpu/test_sm100_bwd_2cta.py)."""
    shipped = shipped_bwd_configs()
    assert [c.cta_group for c in shipped] == [1] * 51 + [2] * 12 and select_bwd_config(128).arch == 100
    assert [(c.headdim, c.causal) for c in shipped if c.softcap and c.cta_group == 1][:4] == [
        (64, False), (64, True), (128, False), (128, True)]
    assert [(c.headdim, c.hdim_v, c.q_stages) for c in shipped[28:51]] == [(192, 128, 1)] * 23
    assert sum(c.softcap for c in shipped[28:51]) == 11
    assert select_bwd_config(128, "fp16", local=True, deterministic=True, softcap=True).softcap
    with pytest.raises(ValueError, match="headdim=96: no sm100 backward"):
        select_bwd_config(96)


# ---------------------------------------------------------------- registry
def test_registry_serves_sm100_behind_the_selftest():
    """sm100 is registered (compile_fwd dispatches on cfg.arch), unverified but self-test-gated:
    family(100) serves it (config selection, the API's support check), and the host runs each of its
    configs only after flash4.selftest passed it (tests/cpu/test_sm100_host.py)."""
    fam = registry.family(100)
    assert fam.name == "sm100" and fam.archs == (100,) and not fam.verified and fam.selftest_gated
    assert fam.config_module() is sm100
    assert 100 not in registry.supported_archs() and 90 in registry.supported_archs()
    assert registry.gated_archs() == (100, 80, 86, 89, 120)  # and the portable family's own archs
    for arch in (103, 110, 121):  # other Blackwell parts are different GPUs: refused by name
        with pytest.raises(ValueError, match=f"no kernels for sm_{arch}"):
            registry.family(arch, include_unverified=True)
    # consumer Blackwell (no tensor memory) belongs to the portable mma.sync family, never to sm100
    assert registry.family(120, include_unverified=True).name == "sm80"
    assert fam.has_pass("bwd")  # the 1-CTA backward (compile-verified, not run on hardware)
