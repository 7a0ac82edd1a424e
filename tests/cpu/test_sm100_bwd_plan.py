"""The sm100 backward's pure plan (flash4.kernels.sm100.bwd_plan, flash4.config.sm100's backward):
the TMEM map (fits 512 columns, only declared aliases overlap, FA4's 1-CTA maps of BLACKWELL.md's
table), the register plan, the pipeline arrive counts, the config selection and its refusals, and
(with the CuTe DSL) that the MN-major operand views address the same bytes as the K-major / row-major
buffers they alias. No GPU; compile-verified, not run on hardware."""

import itertools

import pytest

from flash4.config import sm100
from flash4.kernels.sm100.bwd_plan import (BWD_NUM_THREADS, BWD_WARP_ROLES, BWD_WARPGROUPS, bwd_dq_passes,
                                           bwd_p_barrier, bwd_pipeline_specs, bwd_register_plan,
                                           bwd_register_plan_problem, bwd_serial_schedule, bwd_smem_bytes,
                                           bwd_tmem_alloc_cols, bwd_tmem_aliases, bwd_tmem_map, bwd_tmem_overlaps,
                                           bwd_tmem_problem, BwdRegisterPlan)
from flash4.kernels.sm100.plan import TMEM_COLUMNS
from cpu_helpers import layout_offset

CONFIGS = [c for c in sm100.shipped_bwd_configs() if c.cta_group == 1]  # 2-CTA: test_sm100_bwd_2cta.py


def test_shipped_configs():
    assert sm100.shipped_bwd_configs()[:len(CONFIGS)] == CONFIGS  # the 1-CTA configs first, then the 2-CTA ones
    assert [(c.headdim, c.dtype, c.causal, c.local, c.deterministic, c.softcap) for c in CONFIGS] == [
        (d, dt, c, lo, det, False) for det in (False, True) for d in (64, 128) for dt in ("bf16", "fp16")
        for c, lo in ((False, False), (True, False), (False, True))] + [
        (d, "bf16", c, False, False, True) for d in (64, 128) for c in (False, True)] + [
        (192, dt, c, lo, det, sc) for sc in (False, True) for det in (False, True) for dt in ("bf16", "fp16")
        for c, lo in ((False, False), (True, False), (False, True))
        if not (sc and det and dt == "bf16" and c)]  # bf16 causal deterministic softcap: refused (spills)
    assert [c.hdim_v for c in CONFIGS] == [c.headdim for c in CONFIGS[:28]] + [128] * 23
    # a window folds causal in (as sm90's BwdConfig)
    assert sm100.select_bwd_config(128, causal=True, local=True) == sm100.select_bwd_config(128, local=True)


def test_warp_roles_cover_16_warps_in_whole_warpgroups():
    warps = sorted(w for ws in BWD_WARP_ROLES.values() for w in ws)
    assert warps == list(range(16)) and BWD_NUM_THREADS == 512
    # TMEM readers are whole warpgroups (a warp reaches the 32 lanes of its index in its warpgroup)
    assert BWD_WARP_ROLES["reduce"] == (0, 1, 2, 3) and BWD_WARP_ROLES["compute"] == tuple(range(4, 12))
    assert len(BWD_WARPGROUPS) == 4


# FA4's 1-CTA maps (BLACKWELL.md section 1 table), columns [start, end).
REFERENCE = {
    64: {"S": (0, 128), "dV": (128, 192), "dP": (192, 320), "dK": (320, 384), "dQ": (192, 256),
         "P": (384, 448), "dS": (448, 512)},
    128: {"S": (0, 128), "dV": (128, 256), "dP": (256, 384), "dK": (384, 512), "dQ": (256, 384),
          "P": "inside S", "dS": "inside dP"},
}


def _span(m, name):
    start, n = m[name]
    return start, start + n


def test_serial_tmem_map_192_128():
    """(192, 128): dK + dV = 320 columns leave 192 for S^T and dP^T (128 each): FA4's hd192 map (there
    per CTA of a 2-CTA pair: dV 0-128, dK 128-320, S 320-448 with P inside, dP 384-512 with dS inside,
    dQ its 96 columns 416-512), here 1-CTA with dQ's 192 columns over S and dP (320-512)."""
    cfg = sm100.select_bwd_config(192, headdim_v=128)
    assert bwd_serial_schedule(cfg) and not any(bwd_serial_schedule(c) for c in CONFIGS[:28])
    m = bwd_tmem_map(cfg)
    assert {n: _span(m, n) for n in ("dV", "dK", "S", "dP", "dQ")} == {
        "dV": (0, 128), "dK": (128, 320), "S": (320, 448), "dP": (384, 512), "dQ": (320, 512)}
    # P^T contiguous at S's start and clear of dP (dV reads it after dP^T was written): needs the barrier
    assert [_span(m, f"P{w}") for w in (0, 1)] == [(320, 352), (352, 384)]
    assert all(_span(m, f"P{w}")[1] <= m["dP"][0] for w in (0, 1))
    # dS^T at the start of each warpgroup's own dP^T columns
    assert [_span(m, f"dS{w}") for w in (0, 1)] == [(384, 416), (448, 480)]
    assert bwd_tmem_overlaps(cfg) == (("S", "dP"),)
    assert bwd_p_barrier(cfg) and not any(bwd_p_barrier(c) for c in CONFIGS[:28])
    assert bwd_p_barrier(sm100.select_bwd_config(128, two_cta=True))  # P^T contiguous at S's start there too
    assert cfg.q_stages == 1 and cfg.smem_bytes() == 222208 <= sm100.BWD_SMEM_BUDGET  # 217 KiB
    assert bwd_smem_bytes(192, 128, q_stages=2) > sm100.BWD_SMEM_BUDGET  # 265.5 KiB


def test_what_fits_tensor_memory():
    """dK + dV stay resident; S^T and dP^T need tile_m + tile_m / 2 columns (they may share only the half
    P^T does not use); dQ goes over them. hd256 cannot fit at any tile_m: dK + dV alone are 512."""
    assert bwd_tmem_problem(64, 64) is None and bwd_tmem_problem(128, 128) is None
    assert bwd_tmem_problem(192, 128) is None
    assert "need 192, 128 are left" in bwd_tmem_problem(192, 192)
    assert "dK + dV take 256 + 256 = 512 of the 512" in bwd_tmem_problem(256, 256)
    assert all(bwd_tmem_problem(256, 256, tm) is not None for tm in (32, 64, 128))
    # the dQ read-out: the whole row up to 128 columns, else passes of 64
    assert [bwd_dq_passes(d) for d in (64, 128, 192)] == [1, 1, 3] and bwd_dq_passes(128, 2) == 1


@pytest.mark.parametrize("hd", [64, 128])
def test_tmem_map_equals_the_reference(hd):
    cfg = sm100.select_bwd_config(hd)
    m, ref = bwd_tmem_map(cfg), REFERENCE[hd]
    for name in ("S", "dV", "dP", "dK", "dQ"):
        assert _span(m, name) == ref[name], name
    for name, outer in (("P", "S"), ("dS", "dP")):
        halves = [_span(m, f"{name}{w}") for w in (0, 1)]
        if ref[name] == f"inside {outer}":
            lo, hi = _span(m, outer)
            # each compute warpgroup's half at the start of its own 64 columns of the outer buffer
            assert halves == [(lo, lo + 32), (lo + 64, lo + 96)] and hi == lo + 128
        else:
            assert (halves[0][0], halves[1][1]) == ref[name] and halves[0][1] == halves[1][0]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.headdim}-{c.dtype}-{c.causal}-{c.local}-{c.deterministic}")
def test_tmem_map_fits_and_only_declared_aliases_overlap(cfg):
    m = bwd_tmem_map(cfg)
    assert all(0 <= s and s + n <= TMEM_COLUMNS for s, n in m.values())
    assert bwd_tmem_alloc_cols(cfg) == 512
    # containment aliases, plus the serial map's one partial overlap (S^T's tail under dP^T)
    declared = {frozenset(p) for p in bwd_tmem_aliases(cfg) + bwd_tmem_overlaps(cfg)}
    for (a, (sa, na)), (b, (sb, nb)) in itertools.combinations(m.items(), 2):
        overlap = sa < sb + nb and sb < sa + na
        assert overlap == (frozenset((a, b)) in declared), (a, b)
    for inner, outer in bwd_tmem_aliases(cfg):  # declared aliases are containment
        (si, ni), (so, no) = m[inner], m[outer]
        assert so <= si and si + ni <= so + no, (inner, outer)


def test_tmem_budget_sums_within_512():
    # the distinct (non-aliased) buffers: S, dV, dP, dK (+ P, dS own slots at hd64) use at most 512
    for cfg in CONFIGS:
        m = bwd_tmem_map(cfg)
        inner = {i for i, _ in bwd_tmem_aliases(cfg)}
        assert sum(n for name, (_, n) in m.items() if name not in inner) <= TMEM_COLUMNS


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.headdim}-{c.dtype}-{c.causal}-{c.local}-{c.deterministic}")
def test_register_plan(cfg):
    plan = bwd_register_plan(cfg)
    # FA4's 1-CTA reduce / compute / load = mma; hd64 FA4's causal split (the exact-LSE branch spilled at 136)
    assert plan == (BwdRegisterPlan(136, 144, 88) if cfg.headdim == 64 else BwdRegisterPlan(152, 136, 88))
    assert bwd_register_plan_problem(plan) is None
    assert sum(plan.per_warpgroup()) == 512
    assert BwdRegisterPlan.is_increase(plan.reduce) and BwdRegisterPlan.is_increase(plan.compute)
    assert not BwdRegisterPlan.is_increase(plan.other)
    assert "sum to 520" in bwd_register_plan_problem(BwdRegisterPlan(160, 136, 88))
    assert "multiple of 8" in bwd_register_plan_problem(BwdRegisterPlan(150, 136, 88))


def test_pipeline_arrive_counts():
    specs = bwd_pipeline_specs(CONFIGS[0])
    counts = {n: (s.stages, s.full_arrivals(), s.empty_arrivals()) for n, s in specs.items()}
    assert counts == {
        "kv": (1, 1, 1), "q": (2, 1, 1), "lse": (2, 1, 8), "do": (1, 1, 1), "dpsum": (1, 1, 8),
        "s": (1, 1, 8), "dp": (1, 1, 8), "ds": (1, 8, 1), "dq": (1, 1, 4), "dkv": (1, 1, 8)}
    assert {n for n, s in specs.items() if not s.waited_empty} == {"kv", "dp", "dkv"}
    assert "compute (elected lane: 8)" in specs["ds"].describe()


def test_smem_budget():
    assert bwd_smem_bytes(128, 128) == 214528 and bwd_smem_bytes(64, 64) == 124416
    assert all(c.smem_bytes() <= sm100.BWD_SMEM_BUDGET for c in CONFIGS)


@pytest.mark.parametrize("kwargs, match", [
    (dict(headdim=96), "no sm100 backward; built: \\(D, Dv\\) in \\(64, 64\\), \\(128, 128\\), \\(192, 128\\)"),
    (dict(headdim=128, headdim_v=64), "V head dim"), (dict(headdim=192), "V head dim equal .* 128 are left"),
    (dict(headdim=192, headdim_v=128, softcap=True, causal=True, deterministic=True),
     "softcap with bf16, causal and deterministic=True at \\(headdim, headdim_v\\)=\\(192, 128\\)"),
    (dict(headdim=128, arch=90), "sm_100a kernels only"), (dict(headdim=128, dtype="fp8"), "dtype"),
])
def test_select_refuses_what_is_not_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sm100.select_bwd_config(**kwargs)


def test_config_refuses_unbuilt_fields():
    for field, value in (("varlen_q", True), ("seqused_k", True), ("dkv_accum", True), ("cta_group", 2),
                         ("regs_compute", 132)):
        with pytest.raises(ValueError):
            sm100.Sm100BwdConfig(128, **{field: value})
    cfg = sm100.select_bwd_config(128, "fp16", True)
    assert not cfg.dq_accum_order and not cfg.dynamic_seqlen_k and cfg.hdim_v == 128
    for kw in (dict(q_stages=2), dict(softcap=True, causal=True, deterministic=True),
               dict(cta_group=2, q_stages=1, deterministic=True)):
        with pytest.raises(ValueError):
            sm100.Sm100BwdConfig(192, headdim_v=128, **{"q_stages": 1, **kw})
    assert sm100.Sm100BwdConfig(192, headdim_v=128, q_stages=1, softcap=True).softcap  # softcap built at (192, 128)
    with pytest.raises(ValueError, match="canonical"):
        sm100.Sm100BwdConfig(128, headdim_v=128)
    # the 2-CTA (192, 128) (serial; tests/cpu/test_sm100_bwd_2cta.py) only with the opt-in
    assert sm100.select_bwd_config(192, headdim_v=128).cta_group == 1
    assert sm100.select_bwd_config(192, headdim_v=128, two_cta=True).cta_group == 2


# ---------------------------------------------------------------- operand views (CuTe DSL, trace time only)
@pytest.mark.parametrize("hd, dv", [(64, 64), (128, 128), (192, 128)])
def test_mn_major_views_alias_the_loaded_buffers(hd, dv):
    """Every element of Q, dO, K (TMA-loaded K-major) and dS^T (written row-major) sits at the same
    swizzled offset in the MN-major view another MMA reads it through (same swizzle, equal offset
    before it), for every (row, column) of one stage."""
    cute = pytest.importorskip("cutlass.cute")
    import cutlass

    from flash4.kernels.sm100.bwd import bwd_smem_layouts

    got = {}

    @cute.jit
    def grab(d: cutlass.Constexpr, e: cutlass.Constexpr):
        for k, v in bwd_smem_layouts(sm100.select_bwd_config(d, headdim_v=None if e == d else e)).items():
            got[k] = (v.outer.shape, v.outer.stride, str(v.inner))

    cute.compile(grab, hd, dv, options="--gpu-arch sm_100a")  # whatever CUTE_DSL_ARCH an earlier test left
    off = {k: (lambda crd, s=v[0], t=v[1]: layout_offset(crd, s, t)) for k, v in got.items()}
    assert len({v[2] for v in got.values()}) == 1  # one swizzle for all (S<3,4,3>: 128-byte)
    rows = range(128)
    for kmajor, mnmajor, cols in (("sQ", "sQmn", hd), ("sdO", "sdOmn", dv), ("sK", "sKmn", hd)):
        for r, c in itertools.product(rows, range(cols)):  # r: query / key row, c: head-dim column
            assert off[kmajor](((r, c % 16), 0, c // 16, 0)) == off[mnmajor](((c, r % 16), 0, r // 16, 0)), \
                (kmajor, r, c)
    for key, q in itertools.product(rows, rows):
        assert off["sdSt"]((key, q, 0)) == off["sdS"](((q, key % 16), 0, key // 16, 0)), (key, q)
