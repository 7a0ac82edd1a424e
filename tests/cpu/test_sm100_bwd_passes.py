"""hd256 backward on sm100 as two passes over each key tile (issue 23; docs/design/sm100_backward.md
section 10.4; compile-verified, not run on hardware): the plan (bwd_pass: TMEM maps, smem, pipelines,
register plans, the refusals, the host's pass list) and the compile of both passes with their SASS
gates: "dv" (S^T and dV += P^T dO only) and "dkdq" (S^T, dP^T over V / dO chunks, dS^T, dK, dQ)."""

import dataclasses
import itertools
import re

import pytest

from flash4.config.sm100 import (BWD_SMEM_BUDGET, Sm100BwdConfig, bwd_passes, bwd_pipeline_specs,
                                 bwd_register_plan, bwd_tmem_alloc_cols, bwd_tmem_map, select_bwd_config,
                                 shipped_bwd_configs, two_pass_bwd_configs)
from flash4.kernels.sm100.bwd_plan import (BWD_PASS_MMAS, BWD_VDO_COLS, DQ_GROUP_ROWS, BwdRegisterPlan, bwd_dq_passes,
                                           bwd_exact_lse, bwd_p_barrier, bwd_pass_mmas, bwd_pass_tmem_problem, bwd_serial_schedule,
                                           bwd_smem_bytes, bwd_tmem_aliases, bwd_tmem_map_pass, bwd_tmem_overlaps)
from flash4.kernels.sm100.plan import TMEM_COLUMNS

MASKS = {"full": {}, "causal": {"causal": True}, "window": {"local": True}}


def dv_cfg(dtype="bf16", mask="full", **kw):
    return select_bwd_config(256, dtype, bwd_pass="dv", **MASKS[mask], **kw)


def dkdq_plan(dtype="bf16", mask="full", **kw):
    return select_bwd_config(256, dtype, bwd_pass="dkdq", **MASKS[mask], **kw)


def _check_map(cfg):
    m = bwd_tmem_map(cfg)
    assert m == bwd_tmem_map_pass(cfg)
    assert all(0 <= s and s + n <= TMEM_COLUMNS for s, n in m.values())
    declared = {frozenset(p) for p in bwd_tmem_aliases(cfg) + bwd_tmem_overlaps(cfg)}
    for (a, (sa, na)), (b, (sb, nb)) in itertools.combinations(m.items(), 2):
        overlap = sa < sb + nb and sb < sa + na
        assert overlap == (frozenset((a, b)) in declared), (a, b)
    for inner, outer in bwd_tmem_aliases(cfg):  # declared aliases are containment
        (si, ni), (so, no) = m[inner], m[outer]
        assert so <= si and si + ni <= so + no, (inner, outer)
    inner = {i for i, _ in bwd_tmem_aliases(cfg)}
    assert sum(n for name, (_, n) in m.items() if name not in inner) <= TMEM_COLUMNS
    return m


def test_pass_dv_tmem_map():
    cfg = dv_cfg()
    m = _check_map(cfg)
    assert m == {"dV": (0, 256), "S": (256, 128), "P0": (256, 32), "P1": (320, 32)}
    assert bwd_tmem_overlaps(cfg) == ()
    # each P^T half at the start of its own warpgroup's S^T columns: no compute barrier needed
    assert not bwd_p_barrier(cfg) and not bwd_serial_schedule(cfg)
    assert bwd_tmem_alloc_cols(cfg) == 512  # 384 used, the allocation a power of two
    assert bwd_pass_mmas(cfg) == ("S", "dV") and set(m) - {"P0", "P1"} == set(bwd_pass_mmas(cfg))


def test_pass_dkdq_tmem_map():
    cfg = dkdq_plan()
    m = _check_map(cfg)
    assert m == {"dK": (0, 256), "S": (256, 128), "dP": (384, 128), "dQ": (256, 256), "dS0": (384, 32),
                 "dS1": (448, 32)}
    assert bwd_tmem_overlaps(cfg) == ()  # S^T and dP^T side by side (P^T is not an MMA operand here)
    assert not bwd_p_barrier(cfg) and bwd_serial_schedule(cfg)  # dQ over S and dP: S(i+1) after dQ(i) read out
    assert set(m) - {"dS0", "dS1"} == set(BWD_PASS_MMAS["dkdq"]) == set(bwd_pass_mmas(cfg))
    assert bwd_tmem_alloc_cols(cfg) == 512


def test_passes_cover_every_accumulator_once():
    """dV from pass dv, dK and dQ from pass dkdq; S^T in both (the recomputed work)."""
    dv, dkdq = set(BWD_PASS_MMAS["dv"]), set(BWD_PASS_MMAS["dkdq"])
    assert dv | dkdq == set(BWD_PASS_MMAS["both"]) and dv & dkdq == {"S"}


def test_pass_tmem_and_smem_arithmetic():
    assert bwd_pass_tmem_problem(256, 256, "dv") is None and bwd_pass_tmem_problem(256, 256, "dkdq") is None
    assert "TMEM columns" in bwd_pass_tmem_problem(448, 448, "dv")
    assert bwd_smem_bytes(256, 256, q_stages=1, bwd_pass="dv") == (64 + 64 + 64) * 1024 + 512
    assert bwd_smem_bytes(256, 256, q_stages=2, bwd_pass="dv") > BWD_SMEM_BUDGET  # so one Q stage
    assert dv_cfg().q_stages == 1 and dv_cfg().smem_bytes() <= BWD_SMEM_BUDGET
    # dkdq with whole V and dO tiles (the one-kernel arithmetic): K, V, Q, dO 64 KiB each + dS 32 + dQ
    # staging 32 + LSE / dPsum 1 does not fit; with V and dO as one 32-column chunk each: 209 KiB
    assert bwd_smem_bytes(256, 256, q_stages=1) == 321 * 1024 > BWD_SMEM_BUDGET
    assert BWD_VDO_COLS == 32
    assert bwd_smem_bytes(256, 256, q_stages=1, bwd_pass="dkdq") == 209 * 1024 == dkdq_plan().smem_bytes()
    assert bwd_smem_bytes(256, 256, q_stages=2, bwd_pass="dkdq") > BWD_SMEM_BUDGET and dkdq_plan().q_stages == 1
    # dQ rows of 256 columns leave the reduce warps in 32-column passes (hd192: 64)
    assert bwd_dq_passes(256) == 8 and bwd_dq_passes(192) == 3


def test_pass_dv_pipelines():
    specs = bwd_pipeline_specs(dv_cfg())
    assert list(specs) == ["kv", "q", "lse", "do", "s", "dkv"]  # no dpsum, dp, ds, dq
    assert specs["q"].full_arrivals() == 1 and specs["s"].empty_arrivals() == 8  # compute: one elected lane per warp
    full = bwd_pipeline_specs(select_bwd_config(128))
    for name, spec in specs.items():  # the same parties and counts as the one-kernel pipelines
        assert (spec.producers, spec.consumers, spec.waited_empty) == (
            full[name].producers, full[name].consumers, full[name].waited_empty)
    dkdq = bwd_pipeline_specs(dkdq_plan())
    assert list(dkdq) == list(full)  # every pipeline; do carries the V / dO chunks
    assert "chunk" in dkdq["do"].note and dkdq["do"].stages == 1
    for name, spec in dkdq.items():
        assert (spec.producers, spec.consumers, spec.waited_empty) == (
            full[name].producers, full[name].consumers, full[name].waited_empty)


def test_select_and_refusals():
    for dt, mask, det in itertools.product(("bf16", "fp16"), MASKS, (False, True)):
        cfg = dv_cfg(dt, mask, deterministic=det)
        assert (cfg.headdim, cfg.hdim_v, cfg.bwd_pass, cfg.cta_group, cfg.q_stages) == (256, 256, "dv", 1, 1)
        assert bwd_register_plan(cfg).per_warpgroup() == (96, 144, 144, 128)
        kq = dkdq_plan(dt, mask, deterministic=det)
        assert (kq.bwd_pass, kq.q_stages, kq.do_stages) == ("dkdq", 1, 1)
        assert bwd_register_plan(kq).per_warpgroup() == (128, 168, 168, 48)
        # the default (the API's selection) is the dkdq config; the host launches dv, then dkdq
        both = select_bwd_config(256, dt, mask == "causal", local=mask == "window", deterministic=det)
        assert both == kq and bwd_passes(both) == (cfg, kq) == bwd_passes(cfg)
    assert bwd_passes(select_bwd_config(128)) == (select_bwd_config(128),)
    assert len(two_pass_bwd_configs()) == 30
    assert sum(c.softcap for c in two_pass_bwd_configs()) == 6
    with pytest.raises(ValueError, match="two-pass backward is built for"):
        select_bwd_config(128, bwd_pass="dv")
    assert select_bwd_config(256, two_cta=True) == select_bwd_config(256)  # the 2-CTA opt-in falls back to 1-CTA
    with pytest.raises(ValueError, match="runs as two passes"):
        Sm100BwdConfig(headdim=256, q_stages=1)
    with pytest.raises(ValueError, match="bwd_pass='x'"):
        Sm100BwdConfig(headdim=256, q_stages=1, bwd_pass="x")
    assert all(c.bwd_pass == "both" for c in shipped_bwd_configs())


def test_softcap_passes():
    """softcap at hd256: both passes, every mask, the same schedule as without (softcap changes P, so
    pass dv takes tanh too; pass dkdq also multiplies dS by grad_factor); the host runs both."""
    for dt, mask, det in itertools.product(("bf16", "fp16"), MASKS, (False, True)):
        for make in (dv_cfg, dkdq_plan):
            sc, plain = make(dt, mask, deterministic=det, softcap=True), make(dt, mask, deterministic=det)
            assert sc.softcap and dataclasses.replace(sc, softcap=False) == plain
            assert bwd_register_plan(sc) == bwd_register_plan(plain) and bwd_tmem_map(sc) == bwd_tmem_map(plain)
            assert bwd_pipeline_specs(sc) == bwd_pipeline_specs(plain)
        both = select_bwd_config(256, dt, mask == "causal", local=mask == "window", deterministic=det, softcap=True)
        assert [c.bwd_pass for c in bwd_passes(both)] == ["dv", "dkdq"] and all(c.softcap for c in bwd_passes(both))
    assert select_bwd_config(256, softcap=True, two_cta=True) == select_bwd_config(256, softcap=True)


def packed(cfg, seqused=False):
    return dataclasses.replace(cfg, varlen_q=True, varlen_k=True, seqused_q=seqused, seqused_k=seqused)


def test_packed_passes():
    """Packed sequences at hd256 (as the hd256 forward takes them): both passes, the dense passes' plan;
    bwd_plan of a packed request launches the packed dv then dkdq configs; 2-CTA stays refused."""
    import torch

    from flash4.config.sm100 import bwd_plan
    from flash4.request import Request

    for make, su in itertools.product((dv_cfg, dkdq_plan), (False, True)):
        cfg = packed(make("bf16", "causal", softcap=su), su)
        assert cfg.dynamic_seqlen_k and bwd_tmem_map(cfg) == bwd_tmem_map(make("bf16", "causal"))
        assert bwd_pipeline_specs(cfg) == bwd_pipeline_specs(make("bf16", "causal"))
        assert cfg.smem_bytes() == make().smem_bytes() <= BWD_SMEM_BUDGET
    with pytest.raises(ValueError, match="cta_group=2"):
        dataclasses.replace(dv_cfg(), cta_group=2)
    cu = torch.zeros(4, dtype=torch.int32, device="meta")
    q, k = (torch.empty(n, h, 256, dtype=torch.bfloat16, device="meta") for n, h in ((500, 8), (600, 2)))
    plan = bwd_plan(Request.varlen(q, k, k, cu, cu, 200, None, None, causal=True), 100)
    assert plan.passes == (packed(dv_cfg("bf16", "causal")), packed(dkdq_plan("bf16", "causal")))
    assert plan.cfg == plan.passes[1]


# ---------------------------------------------------------------- compile (CPU, sm_100a)
COMBOS = (("bf16", "full", False), ("bf16", "causal", False), ("fp16", "full", False), ("fp16", "causal", False),
          ("bf16", "window", False), ("fp16", "window", False), ("bf16", "causal", True), ("bf16", "window", True))
DV_CONFIGS = [dv_cfg(dt, mask, deterministic=det) for dt, mask, det in COMBOS[:5] + COMBOS[6:7]]
DV_CONFIGS += [dkdq_plan(dt, mask, deterministic=det) for dt, mask, det in COMBOS]
# softcap (two_pass_bwd_configs' 6): bf16 x (full, causal, window), each pass
DV_CONFIGS += [make("bf16", mask, softcap=True) for mask in MASKS for make in (dv_cfg, dkdq_plan)]
# packed sequences (zero_tail: K, Q, dO; pass dkdq each V / dO chunk): each pass bf16 causal, with
# seqused_q / seqused_k and softcap, and dkdq fp16 window deterministic
DV_CONFIGS += [packed(make("bf16", "causal")) for make in (dv_cfg, dkdq_plan)]
DV_CONFIGS += [packed(make("bf16", "full", softcap=True), seqused=True) for make in (dv_cfg, dkdq_plan)]
DV_CONFIGS += [packed(dkdq_plan("fp16", "window", deterministic=True))]
# packed dv softcap + seqused: spilled (10 LDL / STL) at the dv plan before 96 / 144 / 128 (the exact-LSE branch)
DV_CONFIGS += [packed(dv_cfg("bf16", "causal", softcap=True), seqused=True)]
DV_IDS = [f"d256-{c.bwd_pass}-{c.dtype}-{'causal' if c.causal else 'window' if c.local else 'full'}"
          + ("-det" if c.deterministic else "") + ("-softcap" if c.softcap else "")
          + ("-varlen" if c.varlen_q else "") + ("-seqused" if c.seqused_q else "") for c in DV_CONFIGS]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from cpu_helpers import compile_bwd_rows
    return compile_bwd_rows(DV_CONFIGS, DV_IDS, tmp_path_factory.mktemp("sm100bwd_dv"))


def sass_count(sass: str, opcode: str) -> int:
    return len(re.findall(rf"\b{re.escape(opcode)}\b", sass))


@pytest.mark.parametrize("name", [n for n in DV_IDS if "-dv-" in n])
def test_pass_dv_compiles_with_its_gates(built, name):
    cfg, cpu_s, ptx, row, sass = built[name]
    assert ".target sm_100a" in ptx
    d, dv, tm, tn = cfg.headdim, cfg.hdim_v, cfg.tile_m, cfg.tile_n
    plan = bwd_register_plan(cfg)
    got = sorted((kind, int(n)) for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx))
    kind = lambda regs: "inc" if BwdRegisterPlan.is_increase(regs) else "dec"  # noqa: E731
    assert got == sorted((kind(r), r) for r in (plan.reduce, plan.compute, plan.other))
    cols = []
    for reg in re.findall(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]+\],\s*(%r\d+);", ptx):
        cols += [int(v) for v in re.findall(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx)]
    assert cols == [bwd_tmem_alloc_cols(cfg)]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    # S^T (D / 16 k-blocks) and dV += P^T dO (tile_m / 16), one code site each; nothing else
    assert row["utchmma"] == d // 16 + tm // 16 and row["utchmma_2cta"] == 0
    assert row["utcbar"] == 4  # S ready, Q release, dO release, dV final
    assert row["ldtm"] == tm // 2 // 32 + dv // 32  # S^T (64 columns per thread), the dV epilogue
    assert row["sttm"] == tm // 2 // 32  # P^T
    assert sass_count(sass, "UBLKRED.G.S.ADD.F32") == 0  # no dQ in this pass
    assert sass_count(sass, "UBLKCP.S.G") == 1  # LSE rows only (no dPsum)
    assert row["utmaldg"] == d // 64 + d // 64 + dv // 64  # K, Q, dO boxes of 64 columns; no V
    # softcap: tanh before every exp2 (P changes); no grad_factor (no dS in this pass: no MUFU.LG2)
    assert row["mufu_ex2"] == tm // 2 and row["mufu_tanh"] == (tm // 2 if cfg.softcap else 0)
    assert sass_count(sass, "MUFU.LG2") == 0
    assert row["utcatomsws"] == 3
    assert row["hgmma"] == 0
    assert row["spills"] == 0 and sass_count(sass, "LDL") == 0 and sass_count(sass, "STL") == 0
    assert row["stack_bytes"] == 0
    assert sass_count(sass, "REDG.E.ADD.STRONG.GPU") == 0  # deterministic: nothing to order without dQ
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    assert (count(r"\btcgen05\.mma\b"), count(r"\btcgen05\.commit\b"), count(r"\btcgen05\.ld\b"),
            count(r"\btcgen05\.st\b")) == (row["utchmma"], row["utcbar"], row["ldtm"], row["sttm"])
    assert count(r"cta_group::2") == 0


@pytest.mark.parametrize("name", [n for n in DV_IDS if "-dkdq-" in n])
def test_pass_dkdq_compiles_with_its_gates(built, name):
    cfg, cpu_s, ptx, row, sass = built[name]
    assert ".target sm_100a" in ptx
    d, dv, tm, tn = cfg.headdim, cfg.hdim_v, cfg.tile_m, cfg.tile_n
    plan = bwd_register_plan(cfg)
    got = sorted((kind, int(n)) for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx))
    # the reduce warpgroup's 128 is the launch budget: a setmaxnreg.dec to the same count (BwdRegisterPlan)
    kind = lambda regs: "inc" if BwdRegisterPlan.is_increase(regs) else "dec"  # noqa: E731
    assert got == sorted((kind(r), r) for r in (plan.reduce, plan.compute, plan.other))
    assert plan.reduce == 128 and kind(plan.reduce) == "dec"
    cols = []
    for reg in re.findall(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]+\],\s*(%r\d+);", ptx):
        cols += [int(v) for v in re.findall(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx)]
    assert cols == [bwd_tmem_alloc_cols(cfg)]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    # S^T (D / 16 k-blocks), dP^T per V / dO chunk (the first chunk and the rolled loop over the others:
    # 2 code sites of BWD_VDO_COLS / 16), dK (tile_m / 16), dQ (tile_n / 16); no dV
    assert row["utchmma"] == d // 16 + 2 * (BWD_VDO_COLS // 16) + tm // 16 + tn // 16 and row["utchmma_2cta"] == 0
    # S ready, Q release, the chunk releases (2 sites), dP ready, dQ ready, dS consumed, dK final
    assert row["utcbar"] == 8
    # S^T, dP^T (2 x 32 columns each), the dK epilogue, dQ read in 32-column passes per group of rows
    assert row["ldtm"] == 4 + d // 32 + (32 // DQ_GROUP_ROWS) * d // 32
    assert row["sttm"] == 2  # dS^T only (P^T stays in registers)
    assert sass_count(sass, "UBLKRED.G.S.ADD.F32") == 32 // DQ_GROUP_ROWS
    assert sass_count(sass, "BRA.U.ANY") == 0
    assert sass_count(sass, "UBLKCP.S.G") == 2  # LSE and dPsum rows
    assert row["utmaldg"] == d // 64 + d // 64 + 2  # K, Q boxes of 64 columns; one V and one dO chunk box
    assert sass_count(sass, "REDG.E.ADD.STRONG.GPU") == int(cfg.deterministic)
    assert sass_count(sass, "LDG.E.STRONG.GPU") == 2 * int(cfg.deterministic)
    # softcap: tanh before every exp2, and grad_factor's log2 (t recovered from P and the LSE) per dS
    assert row["mufu_ex2"] == tm // 2 and row["mufu_tanh"] == (tm // 2 if cfg.softcap else 0)
    assert sass_count(sass, "MUFU.LG2") == (tm // 2 if cfg.softcap else 0)
    assert row["utcatomsws"] == 3
    assert row["hgmma"] == 0
    assert row["spills"] == 0 and sass_count(sass, "LDL") == 0 and sass_count(sass, "STL") == 0
    assert row["stack_bytes"] == 0
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    assert (count(r"\btcgen05\.mma\b"), count(r"\btcgen05\.commit\b"), count(r"\btcgen05\.ld\b"),
            count(r"\btcgen05\.st\b")) == (row["utchmma"], row["utcbar"], row["ldtm"], row["sttm"])
    assert count(r"cta_group::2") == 0


@pytest.mark.parametrize("name", DV_IDS)
def test_exact_lse_branch_in_both_passes(built, name):
    """The exact-LSE path (issue 8; bwd_exact_lse) in both passes, dense or packed, softcap or not: 32
    shuffles of r per 32-column chunk (exact_residual), two chunks per warpgroup, in PTX and SASS."""
    cfg, _, ptx, row, sass = built[name]
    assert bwd_exact_lse(cfg)
    # (the PTX has 3 more shfl.sync.idx: warp-uniform broadcasts of lane 0, which ptxas drops)
    assert len(re.findall(r"\bshfl\.sync\.idx\b", ptx)) >= cfg.tile_m // 2
    if row:
        assert sass_count(sass, "SHFL.IDX") == cfg.tile_m // 2


@pytest.mark.parametrize("name", DV_IDS)
def test_packed_tail_zeroing_only_in_packed_passes(built, name):
    """The MMA warp's zero_tail in packed passes, one rolled loop of STS.128 [..], RZ per site (a site
    stores cols / 8 / gcd(cols / 8, 32) vectors per lane and pass: 1 for 256 and for 32 columns): pass
    dv K, Q, dO (3); pass dkdq K, Q and, at both chunk sites of the do ring, the V and dO chunks (6);
    none in dense passes."""
    cfg, _, _, row, sass = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    want = 3 if cfg.bwd_pass == "dv" else 2 + 2 * 2
    assert len(re.findall(r"\bSTS\.128 \[[^\]]+\], RZ", sass)) == (want if cfg.varlen_q else 0)
