"""The 2-CTA sm100 backward (cta_group 2: hd128 pipelined, (192, 128) serial; docs/design/sm100_backward.md
sections 8 and 10.3): its pure plan (TMEM map = BLACKWELL.md's hd128 and (192, 128) 2-CTA rows, registers,
the pair's arrive counts, smem), the
config and its opt-in (FLASH4_SM100_2CTA), the launch grid in pairs, the dS exchange's smem view
(CuTe DSL, trace time), and the compile: sm_100a, 0 spills, the .2CTA SASS forms, the DSMEM copy,
setmaxnreg and tcgen05.alloc = the plans, PTX = SASS counts. No GPU; compile-verified, not run on
hardware."""

import itertools
import re

import pytest

from flash4.config import sm100
from flash4.kernels.sm100.bwd_plan import (BWD_WARP_ROLES_2CTA, DQ_GROUP_ROWS, BwdRegisterPlan, bwd_dq_group_rows,
                                           bwd_dq_passes, bwd_exact_lse, bwd_p_barrier, bwd_pipeline_specs,
                                           bwd_register_plan, bwd_register_plan_problem, bwd_smem_bytes,
                                           bwd_tmem_alloc_cols, bwd_tmem_aliases, bwd_tmem_map, bwd_tmem_overlaps,
                                           bwd_two_cta_exact_lse, bwd_two_cta_serial, bwd_two_cta_shared_rings)
from flash4.kernels.sm100.plan import TMEM_COLUMNS
from flash4.launch import bwd_grid
from cpu_helpers import compile_bwd_rows, layout_offset

TWO = [c for c in sm100.shipped_bwd_configs() if c.cta_group == 2]
IDS = [f"d{c.headdim}{f'v{c.headdim_v}' if c.headdim_v else ''}-{c.dtype}-{'causal' if c.causal else 'full'}"
       f"{'-softcap' if c.softcap else ''}-2cta" for c in TWO]
SERIAL = [c for c in TWO if bwd_two_cta_serial(c)]  # (192, 128)


# ---------------------------------------------------------------- config and selection
def test_shipped_two_cta_configs():
    def six(d, dv=None):
        return [sm100.select_bwd_config(d, dt, c, headdim_v=dv, two_cta=True) for dt in ("bf16", "fp16")
                for c in (False, True)] + [
            sm100.select_bwd_config(d, "bf16", c, softcap=True, headdim_v=dv, two_cta=True) for c in (False, True)]

    assert TWO == six(128) + six(192, 128)
    assert all(c.cta_group == 2 and c.q_stages == 1 and not c.deterministic and not c.local for c in TWO)
    assert [c.softcap for c in TWO] == ([False] * 4 + [True] * 2) * 2
    assert SERIAL == TWO[6:] and all((c.headdim, c.hdim_v) == (192, 128) for c in SERIAL)
    assert sm100.shipped_bwd_configs()[-len(TWO):] == TWO  # after the 1-CTA configs


def test_two_cta_is_opt_in():
    assert sm100.select_bwd_config(128).cta_group == 1  # default: 1-CTA
    assert sm100.select_bwd_config(128, two_cta=True).cta_group == 2
    assert sm100.select_bwd_config(128, causal=True, two_cta=True).cta_group == 2
    assert sm100.select_bwd_config(192, headdim_v=128).cta_group == 1  # default: the serial 1-CTA kernel
    for c in (False, True):
        cfg = sm100.select_bwd_config(192, "fp16", c, headdim_v=128, two_cta=True)
        assert cfg.cta_group == 2 and cfg.hdim_v == 128 and cfg.q_stages == 1 and bwd_two_cta_serial(cfg)
    # where the 2-CTA variant is not built, the switch keeps the 1-CTA config
    for kw in (dict(headdim=64), dict(headdim=128, deterministic=True), dict(headdim=128, local=True),
               dict(headdim=192, headdim_v=128, deterministic=True), dict(headdim=192, headdim_v=128, local=True),
               dict(headdim=256)):
        assert sm100.select_bwd_config(two_cta=True, **kw) == sm100.select_bwd_config(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(headdim=64), "built for \\(D, Dv\\) in"), (dict(headdim=128, deterministic=True), "deterministic"),
    (dict(headdim=128, local=True), "window"), (dict(headdim=128, q_stages=2), "q_stages"),
    (dict(headdim=192, headdim_v=128, deterministic=True), "deterministic"),
    (dict(headdim=192, headdim_v=128, local=True), "window"),
    (dict(headdim=192, headdim_v=128, q_stages=2), "q_stages"),
    (dict(headdim=192), "no sm100 backward"),
])
def test_config_refuses_two_cta_elsewhere(kw, match):
    base = dict(cta_group=2, q_stages=1, regs_reduce=136, regs_compute=136, regs_other=104)
    with pytest.raises(ValueError, match=match):
        sm100.Sm100BwdConfig(**{**base, **kw})


def test_backward_plan_follows_the_switch(monkeypatch):
    torch = pytest.importorskip("torch")
    from flash4.config import bwd_config
    from flash4.request import Request

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, 4, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    monkeypatch.delenv("FLASH4_SM100_2CTA", raising=False)
    assert bwd_config(Request.dense(q, k, v), 100).cfg.cta_group == 1
    monkeypatch.setenv("FLASH4_SM100_2CTA", "1")
    assert bwd_config(Request.dense(q, k, v), 100).cfg == sm100.select_bwd_config(128, two_cta=True)
    assert bwd_config(Request.dense(q, k, v, deterministic=True), 100).cfg.cta_group == 1
    q64, k64, v64 = (t[..., :64].contiguous() for t in (q, k, v))
    assert bwd_config(Request.dense(q64, k64, v64), 100).cfg.cta_group == 1
    q192, k192 = (torch.randn(1, 300, 4, 192, generator=g).to(torch.bfloat16) for _ in range(2))
    assert bwd_config(Request.dense(q192, k192, v, causal=True), 100).cfg == sm100.select_bwd_config(
        192, causal=True, headdim_v=128, two_cta=True)
    monkeypatch.delenv("FLASH4_SM100_2CTA")
    assert bwd_config(Request.dense(q192, k192, v), 100).cfg.cta_group == 1


def test_grid_has_whole_pairs_per_head():
    cfg = TWO[0]
    # ceil(300 / 256) pairs x 2 CTAs x 3 KV heads x 2 batches; an odd block count rounds up to a pair
    assert bwd_grid(cfg, 2, 300, 3) == (2 * 2 * 3 * 2, 1, 1)
    assert bwd_grid(cfg, 1, 100, 1) == (2, 1, 1)
    assert bwd_grid(sm100.select_bwd_config(128), 1, 100, 1) == (1, 1, 1)  # 1-CTA unchanged


# ---------------------------------------------------------------- plan
def _span(m, name):
    start, n = m[name]
    return start, start + n


# BLACKWELL.md's 2-CTA rows (FA4's per-CTA maps), columns [start, end)
TMEM_REFERENCE = {
    # hd128 (pipelined): dQ 64-128 over S's tail, P^T contiguous at S's start (clear of dQ), dS inside dP
    (128, 128): ({"S": (0, 128), "dV": (128, 256), "dP": (256, 384), "dK": (384, 512), "dQ": (64, 128)},
                 [(0, 32), (32, 64)], [(256, 288), (320, 352)]),
    # (192, 128) (serial, FA4's hd192 map): dP over S's second half, dQ (the pair's M = 128: 64 query rows x
    # 192 folded into 96 columns) the last 96 columns, P^T at S's start clear of dP, dS inside dP
    (192, 128): ({"dV": (0, 128), "dK": (128, 320), "S": (320, 448), "dP": (384, 512), "dQ": (416, 512)},
                 [(320, 352), (352, 384)], [(384, 416), (448, 480)]),
}


@pytest.mark.parametrize("cfg", TWO, ids=IDS)
def test_tmem_map_equals_the_reference(cfg):
    """BLACKWELL.md's 2-CTA rows; only declared aliases (one buffer inside another) and the serial map's
    declared partial overlaps (S / dP, S / dQ) overlap."""
    m = bwd_tmem_map(cfg)
    ref, p_spans, ds_spans = TMEM_REFERENCE[(cfg.headdim, cfg.hdim_v)]
    assert {n: _span(m, n) for n in ref} == ref
    assert [_span(m, f"P{w}") for w in (0, 1)] == p_spans
    assert [_span(m, f"dS{w}") for w in (0, 1)] == ds_spans
    assert bwd_tmem_alloc_cols(cfg) == 512
    assert bwd_p_barrier(cfg)  # P^T contiguous at S's start: both warpgroups read S^T before either writes P^T
    assert bwd_tmem_overlaps(cfg) == ((("S", "dP"), ("S", "dQ")) if bwd_two_cta_serial(cfg) else ())
    # P^T clear of dP and dQ (dV reads it after both were written), dQ clear of P^T
    assert all(_span(m, f"P{w}")[1] <= min(m["dP"][0], m["dQ"][0]) or _span(m, f"P{w}")[0] >= m["dQ"][0] + m["dQ"][1]
               for w in (0, 1))
    declared = {frozenset(p) for p in bwd_tmem_aliases(cfg) + bwd_tmem_overlaps(cfg)}
    for (a, (sa, na)), (b, (sb, nb)) in itertools.combinations(m.items(), 2):
        overlap = sa < sb + nb and sb < sa + na
        assert overlap == (frozenset((a, b)) in declared), (a, b)
    for inner, outer in bwd_tmem_aliases(cfg):
        (si, ni), (so, no) = m[inner], m[outer]
        assert so <= si and si + ni <= so + no and 0 <= so and so + no <= TMEM_COLUMNS, (inner, outer)


# the 2-CTA configs with the exact-LSE branch (bwd_two_cta_exact_lse; the others spilled with it at every split tried)
EXACT_IDS = {"d128-bf16-full-2cta", "d128-bf16-causal-2cta", "d128-fp16-causal-2cta", "d192v128-bf16-full-2cta",
             "d192v128-bf16-causal-2cta", "d192v128-fp16-full-2cta", "d192v128-fp16-causal-2cta",
             "d192v128-bf16-causal-softcap-2cta"}


def test_exact_lse_rule():
    assert {n for c, n in zip(TWO, IDS) if bwd_exact_lse(c)} == EXACT_IDS
    assert all(bwd_exact_lse(c) == bwd_two_cta_exact_lse(c.headdim, c.causal, c.hdim_v, c.dtype, c.softcap) for c in TWO)
    # selectable, not shipped: fp16 softcap follows bf16's rule
    for d, dv in ((128, None), (192, 128)):
        for causal in (False, True):
            cfg = sm100.select_bwd_config(d, "fp16", causal, softcap=True, headdim_v=dv, two_cta=True)
            assert cfg.cta_group == 2 and bwd_exact_lse(cfg) == (d == 192 and causal)
    assert all(bwd_exact_lse(c) for c in sm100.shipped_bwd_configs() if c.cta_group == 1)


@pytest.mark.parametrize("cfg", TWO, ids=IDS)
def test_register_plan(cfg):
    plan = bwd_register_plan(cfg)
    exact = bwd_exact_lse(cfg)
    if bwd_two_cta_serial(cfg):
        # (192, 128): the causal softcap compute step needs 152; the reduce warps read dQ in 32-column
        # passes and fit 104; the fourth warpgroup keeps 104 (96 and 88 spilled). With the exact-LSE
        # branch the causal configs spilled there and take 104 / 160 / 88
        want = BwdRegisterPlan(104, 160, 88) if exact and cfg.causal else BwdRegisterPlan(104, 152, 104)
        assert plan == want and bwd_dq_passes(192, 2, 128) == 3
    else:
        # FA4's 2-CTA budgets; causal moves 16 from the reduce to the compute warpgroups (136 spilled 3 LDL +
        # 3 STL in the causal compute step; the fourth warpgroup keeps 104: at 88 the load / MMA warps spill);
        # with the exact-LSE branch 112 / 144 / 112
        if exact:
            assert plan == BwdRegisterPlan(112, 144, 112)
        else:
            assert plan == (BwdRegisterPlan(120, 144, 104) if cfg.causal else BwdRegisterPlan(136, 136, 104))
        assert bwd_dq_passes(128, 2) == 1
    assert sum(plan.per_warpgroup()) == 512 and bwd_register_plan_problem(plan) is None


def test_warp_roles_have_the_relay_warp():
    assert BWD_WARP_ROLES_2CTA["relay"] == (14,) and BWD_WARP_ROLES_2CTA["idle"] == (15,)
    assert sorted(w for ws in BWD_WARP_ROLES_2CTA.values() for w in ws) == list(range(16))


@pytest.mark.parametrize("cfg", [TWO[0], SERIAL[0]], ids=["d128", "d192v128"])
def test_pipeline_arrive_counts(cfg):
    specs = bwd_pipeline_specs(cfg)
    counts = {n: (s.stages, s.full_arrivals(), s.empty_arrivals()) for n, s in specs.items()}
    want = {
        "kv": (1, 1, 1), "q": (1, 1, 1), "qt": (1, 1, 1), "lse": (1, 1, 8), "do": (1, 1, 1), "dpsum": (1, 1, 8),
        # thread parties that report to the leader's MMA: both CTAs' warps on the leader's barrier
        "s": (1, 1, 16), "dp": (1, 1, 16), "ds": (1, 16, 1), "dq": (1, 1, 8), "dkv": (1, 1, 8),
        # the dS exchange: the peer's expect_tx (its bulk copy completes the bytes), both relay warps
        "dsx": (1, 1, 1), "relay": (1, 2, 1)}
    if bwd_two_cta_shared_rings(cfg):  # (192, 128): Q^T through the q ring, dO^T through the do ring
        del want["qt"]
        assert "two uses per step" in specs["q"].note and "two uses per step" in specs["do"].note
    assert counts == want
    assert {n for n, s in specs.items() if not s.waited_empty} == {"kv", "dkv", "dsx", "relay"}
    assert "compute (elected lane from both CTAs: 16)" in specs["ds"].describe()
    assert all(s.cta_group == 2 for s in specs.values())


def test_smem_budget():
    assert bwd_smem_bytes(128, 128, q_stages=1, cta_group=2) == 217 * 1024
    # (192, 128): K 48 + V 32 + Q / Q^T 24 + dO / dO^T 16 + K^T 48 + dS^T 32 + exchange 16 + dQ staging 6
    # (4 rows x 96 fp32 per warp) + LSE / dPsum 1 = 223 KiB (Q^T, dO^T in buffers of their own and 8-row
    # staging: 269 KiB > 227 KiB)
    assert bwd_smem_bytes(192, 128, q_stages=1, cta_group=2) == 223 * 1024
    assert bwd_dq_group_rows(192, 128, 2) == 4 and bwd_dq_group_rows(128, 128, 2) == DQ_GROUP_ROWS == 8
    assert all(bwd_two_cta_shared_rings(c) == (c.headdim == 192) for c in TWO)
    assert all(c.smem_bytes() <= sm100.BWD_SMEM_BUDGET for c in TWO)
    assert sm100.BWD_SMEM_BUDGET + 3 * 1024 == 227 * 1024  # the mbarriers and the TMEM pointer fit the rest


# ---------------------------------------------------------------- the dS exchange's smem view (trace time)
@pytest.mark.parametrize("cfg", [TWO[0], SERIAL[0]], ids=["d128", "d192v128"])
def test_dq_operand_view_is_the_exchanged_halves(cfg):
    """dQ = dS K reads, in each CTA, its tile_m / 2 queries x the pair's 2 tile_n keys (MN-major A).
    Element (query q, key k of the pair) must be the element (key k % tile_n, query (k // tile_n)
    tile_m / 2 + q) of the row-major dS^T buffer: query half h of dS^T holds the keys of CTA h (its
    own half stays, the peer's arrives there over DSMEM), and the halves are contiguous blocks."""
    cute = pytest.importorskip("cutlass.cute")

    from flash4.kernels.sm100.bwd import bwd_smem_layouts

    got = {}

    @cute.jit
    def grab():
        for k, v in bwd_smem_layouts(cfg).items():
            got[k] = (v.outer.shape, v.outer.stride, str(v.inner))

    cute.compile(grab, options="--gpu-arch sm_100a")  # whatever CUTE_DSL_ARCH an earlier test left
    off = {k: (lambda crd, s=v[0], t=v[1]: layout_offset(crd, s, t)) for k, v in got.items()}
    assert got["sdS"][2] == got["sdSt"][2]  # one swizzle
    half = 128 * 64
    assert off["sdSt"]((0, 64, 0)) == half and max(off["sdSt"]((r, c, 0)) for r in range(128) for c in range(64)) < half
    for q, k in itertools.product(range(64), range(256)):
        assert off["sdS"](((q, k % 16), 0, k // 16, 0)) == off["sdSt"]((k % 128, (k // 128) * 64 + q, 0)), (q, k)


# ---------------------------------------------------------------- compile, SASS and PTX
COMPILE_CPU_LIMIT_S = 10.0


def sass_count(sass: str, opcode: str) -> int:
    """Instructions whose opcode is exactly `opcode` (no further .suffix)."""
    return len(re.findall(rf"(?<![\w.]){re.escape(opcode)}(?![\w.])", sass))


def sass_count_prefix(sass: str, opcode: str) -> int:
    """Instructions whose opcode is `opcode` with any .suffixes."""
    return len(re.findall(rf"(?<![\w.]){re.escape(opcode)}(?![\w])", sass))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    return compile_bwd_rows(TWO, IDS, tmp_path_factory.mktemp("sm100bwd2cta"))


@pytest.mark.parametrize("name", IDS)
def test_compiles_for_sm100a(built, name):
    _, cpu_s, ptx, _, _ = built[name]
    assert ".target sm_100a" in ptx
    assert cpu_s < COMPILE_CPU_LIMIT_S, f"{name}: {cpu_s:.1f} s CPU to compile"


@pytest.mark.parametrize("name", IDS)
def test_sass_gates(built, name):
    cfg, _, _, row, sass = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    d, dv, tm, tn = cfg.headdim, cfg.hdim_v, cfg.tile_m, cfg.tile_n
    serial = bwd_two_cta_serial(cfg)
    # every MMA is the pair's: S^T, dP^T (hd128: prologue + loop; serial: one site each), dV, dK over
    # tile_m, dQ over the pair's keys
    sites = 1 if serial else 2
    n_mma = sites * d // 16 + sites * dv // 16 + 2 * tm // 16 + 2 * tn // 16
    assert sass_count(sass, "UTCHMMA.2CTA") == n_mma and sass_count(sass, "UTCHMMA") == 0
    # commits, all multicast to the pair. hd128: S x2, dP x2, Q x2, Q^T, dO, dQ ready, dS consumed, dK/dV
    # final; serial: S, dP, Q, Q^T, dO, dO^T (the shared rings' two releases each), dQ ready, dS consumed, final
    n_bar = 9 if serial else 11
    assert sass_count(sass, "UTCBAR.2CTA.MULTICAST") == n_bar and sass_count_prefix(sass, "UTCBAR") == n_bar
    # TMA: every load .cta_group::2 (K, V, K^T, Q, dO, dO^T, Q^T boxes: 2 + 2 + 1 + 2 + 2 + 1 + 1 = 11 at
    # hd128; (192, 128): 3 + 2 + 3 + 3 + 2 + 1 + 3 = 17, the 96-element MN-major halves of K^T and Q^T in 3)
    assert row["utmaldg"] == row["utmaldg_2cta"] == (17 if serial else 11)
    # the dQ bulk reduce-adds (groups of dq_group_rows lanes x D / 64 runs of 32 columns) and the dS exchange
    rows, runs = bwd_dq_group_rows(d, dv, 2), d // 2 // 32
    assert sass_count_prefix(sass, "UBLKRED.G.S.ADD.F32") == (32 // rows) * runs
    assert sass_count(sass, "UBLKCP.S.S") == 1  # cp.async.bulk.shared::cluster.shared::cta: half of dS^T
    assert sass_count(sass, "UBLKCP.S.G") == 2  # LSE and dPsum rows
    # S^T 2 + dP^T 2 + the epilogue's dV, dK + dQ (hd128: once; serial: per group of rows, 3 passes of 32)
    dq_loads = runs * (32 // rows if bwd_dq_passes(d, 2, dv) > 1 else 1)
    assert row["ldtm"] == 4 + dv // 32 + d // 32 + dq_loads and row["sttm"] == 4
    assert row["utcatomsws"] == 3 and row["utcatomsws_2cta"] == 2  # pair alloc + relinquish; dealloc .AND
    assert row["mufu_ex2"] == tm // 2 and row["hgmma"] == 0
    # softcap: tanh per score before the exp2, log2 per score for dS (as the 1-CTA kernel)
    assert row["mufu_tanh"] == (tm // 2 if cfg.softcap else 0)
    assert sass_count(sass, "MUFU.LG2") == (tm // 2 if cfg.softcap else 0)
    assert row["spills"] == 0 and sass_count(sass, "LDL") == 0 and sass_count(sass, "STL") == 0
    assert row["stack_bytes"] == 0


@pytest.mark.parametrize("name", IDS)
def test_exact_lse_branch_where_planned(built, name):
    """The exact-LSE path (issue 8) where bwd_two_cta_exact_lse puts it: 32 shuffles of r per 32-column
    chunk (exact_residual), two chunks per compute warpgroup: tile_m / 2 SHFL.IDX more than without the
    branch (the kernel's other SHFL.IDX, outside the compute step: 8 at hd128, 24 at (192, 128), measured
    in the configs without it)."""
    cfg, _, ptx, row, sass = built[name]
    exact = bwd_exact_lse(cfg)
    assert exact == (name in EXACT_IDS)
    if exact:
        assert len(re.findall(r"\bshfl\.sync\.idx\b", ptx)) >= cfg.tile_m // 2
    if row:
        base = 24 if bwd_two_cta_serial(cfg) else 8
        assert sass_count(sass, "SHFL.IDX") == base + (cfg.tile_m // 2 if exact else 0)


@pytest.mark.parametrize("name", IDS)
def test_ptx_counts_equal_sass_counts(built, name):
    _, _, ptx, row, _ = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    assert count(r"\btcgen05\.mma\.cta_group::2\b") == count(r"\btcgen05\.mma\b") == row["utchmma_2cta"]
    assert count(r"\btcgen05\.mma\.cta_group::1\b") == 0
    assert (count(r"\btcgen05\.commit\.cta_group::2\.mbarrier::arrive::one\.shared::cluster\.multicast::cluster"),
            count(r"\btcgen05\.ld\b"), count(r"\btcgen05\.st\b")) == (row["utcbar"], row["ldtm"], row["sttm"])
    assert count(r"cp\.async\.bulk\.shared::cluster\.shared::cta\.mbarrier::complete_tx::bytes") == 1
    assert count(r"\bmapa\.shared::cluster") >= 2  # the exchange's destination and its mbarrier in the peer


@pytest.mark.parametrize("name", IDS)
def test_setmaxnreg_and_tmem_allocation_match_the_plans(built, name):
    cfg, _, ptx, _, _ = built[name]
    plan = bwd_register_plan(cfg)
    kind = lambda regs: "inc" if BwdRegisterPlan.is_increase(regs) else "dec"  # noqa: E731
    got = sorted((k, int(n)) for k, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx))
    assert got == sorted((kind(r), r) for r in (plan.reduce, plan.compute, plan.other))
    allocs = re.findall(r"tcgen05\.alloc\.cta_group::2\.[\w:.]+\s+\[[^\]]+\],\s*(%r\d+);", ptx)
    cols = [int(v) for reg in allocs for v in re.findall(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx)]
    assert cols == [bwd_tmem_alloc_cols(cfg)]
