"""Compile check of the sm100 backward on the CPU (no GPU; the kernel has never run on hardware):
every config select_bwd_config can return builds for sm_100a ((192, 128): the serial schedule, its
S^T / dP^T MMAs at one code site each and the dQ read in passes), and its PTX and SASS show the design --
the five tcgen05 MMAs per step (1-CTA, no .2CTA), their commits, TMEM loads/stores, the dQ bulk
reduce-add (UBLKRED.G.S.ADD.F32), TMA loads, the TMEM allocation of bwd_tmem_map and the setmaxnreg
budgets of bwd_register_plan -- with no Hopper opcodes, no local memory and a stack of 0; PTX and
SASS counts of the tcgen05 instructions agree. Softcap configs add one MUFU.TANH per score (the
score transform) and one MUFU.LG2 per score (t recovered from P for dS's factor), nothing else of
the gates changes. Packed configs (varlen, seqused) pass the same gates plus the tail zeroing: six
predicated 16-byte RZ store sites (K, V once; Q, dO in the prologue and the step loop)."""

import math
import re

import pytest
from cpu_helpers import compile_bwd_rows

pytest.importorskip("cutlass")

from flash4.config.sm100 import (bwd_packed_config, bwd_register_plan, bwd_tmem_alloc_cols,  # noqa: E402
                                  select_bwd_config, shipped_bwd_configs)
from flash4.kernels.sm100.bwd_plan import (DQ_GROUP_ROWS, bwd_dq_passes, bwd_exact_lse,  # noqa: E402
                                           bwd_serial_schedule)

CONFIGS = [c for c in shipped_bwd_configs() if c.cta_group == 1]  # the 2-CTA configs: test_sm100_bwd_2cta.py
# packed sequences (issue 23; 1-CTA): hd64 / hd128, with and without seqused_q / seqused_k
PACKED = [bwd_packed_config(select_bwd_config(d, "bf16", causal), seqused_q=su, seqused_k=su)
          for d, causal, su in ((64, True, False), (128, False, False), (128, True, True))]
# (192, 128) packed (the serial schedule's zero_tail sites; the forward takes packed (192, 128) too)
PACKED += [bwd_packed_config(select_bwd_config(192, "bf16", True, headdim_v=128), seqused_q=True, seqused_k=True)]
CONFIGS += PACKED
IDS = [f"d{c.headdim}" + (f"v{c.headdim_v}" if c.headdim_v else "") + f"-{c.dtype}-{'causal' if c.causal else 'window' if c.local else 'full'}"
       + ("-det" if c.deterministic else "") + ("-softcap" if c.softcap else "")
       + ("-varlen" if c.varlen_q else "") + ("-seqused" if c.seqused_q else "") for c in CONFIGS]
# CPU seconds of one cold compile (one core): measured 1.9-2.3 s on the 2-core box (2026-12-02); the
# target is 5 s, the assert leaves room for a loaded machine.
COMPILE_CPU_LIMIT_S = 10.0


def sass_count(sass: str, opcode: str) -> int:
    return len(re.findall(rf"\b{re.escape(opcode)}\b", sass))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each config compiled once: {id: (cfg, cpu seconds, ptx, resource row, sass text)}."""
    return compile_bwd_rows(CONFIGS, IDS, tmp_path_factory.mktemp("sm100bwd"))


@pytest.mark.parametrize("name", IDS)
def test_compiles_for_sm100a(built, name):
    cfg, cpu_s, ptx, _, _ = built[name]
    assert ".target sm_100a" in ptx
    assert cpu_s < COMPILE_CPU_LIMIT_S, f"{name}: {cpu_s:.1f} s CPU to compile"


@pytest.mark.parametrize("name", IDS)
def test_sass_gates(built, name):
    cfg, _, _, row, sass = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    d, dv, tm, tn = cfg.headdim, cfg.hdim_v, cfg.tile_m, cfg.tile_n
    # one code site per k-block: S^T and dP^T in the prologue and the step loop (the serial schedule,
    # (192, 128): the step loop only), dV, dK, dQ once
    sites = 1 if bwd_serial_schedule(cfg) else 2
    assert row["utchmma"] == sites * (d // 16 + dv // 16) + 2 * tm // 16 + tn // 16, row
    assert row["utchmma_2cta"] == 0  # 1-CTA
    # commits: S ready and dP ready (x2 pipelined), dO and Q releases, dQ ready, dS consumed, dK/dV final
    assert row["utcbar"] == 2 * sites + 5
    # tcgen05.ld: S^T and dP^T (2 x 32 columns each per compute thread), the dV / dK epilogue and the
    # dQ read-out (32 columns each; hd192, read in passes: once per group of DQ_GROUP_ROWS rows);
    # tcgen05.st: P^T and dS^T (2 each)
    dq_reads = 1 if bwd_dq_passes(d) == 1 else 32 // DQ_GROUP_ROWS
    assert row["ldtm"] == 4 + dv // 32 + d // 32 + dq_reads * d // 32
    assert row["sttm"] == 4
    # dQ: one reduce-add of DQ_GROUP_ROWS whole rows per group of a warp's 32 (uniform operands: no per-lane loop)
    assert sass_count(sass, "UBLKRED.G.S.ADD.F32") == 32 // DQ_GROUP_ROWS
    assert sass_count(sass, "BRA.U.ANY") == 0
    # deterministic: the dQ semaphore, acquired by a strong load, released by one strong reduction
    assert sass_count(sass, "REDG.E.ADD.STRONG.GPU") == int(cfg.deterministic)
    assert sass_count(sass, "LDG.E.STRONG.GPU") == 2 * int(cfg.deterministic)
    assert sass_count(sass, "UBLKCP.S.G") == 2  # LSE and dPsum rows (bulk copies)
    assert row["utmaldg"] > 0
    assert row["utcatomsws"] == 3  # alloc, relinquish, dealloc
    assert row["mufu_ex2"] == tm // 2  # P^T: one MUFU.EX2 per score of the thread's 64 columns
    # softcap: tanh per score before the exp2 (score.apply), log2 per score for dS (score.grad_factor)
    assert row["mufu_tanh"] == (tm // 2 if cfg.softcap else 0)
    assert sass_count(sass, "MUFU.LG2") == (tm // 2 if cfg.softcap else 0)
    assert row["hgmma"] == 0
    assert row["spills"] == 0, f"{name}: {row['spills']} LDL/STL"
    assert sass_count(sass, "LDL") == 0 and sass_count(sass, "STL") == 0
    assert row["stack_bytes"] == 0
    assert row["registers"] == 128  # the launch cap 65536 / 512; the budgets are setmaxnreg's


@pytest.mark.parametrize("name", IDS)
def test_exact_lse_branch_is_built(built, name):
    """The exact-LSE path (issue 8) in every 1-CTA config (bwd_exact_lse): per 32-column chunk of the
    compute step, 32 shuffles of r (exact_residual), two chunks per warpgroup: tile_m / 2 in PTX and SASS."""
    cfg, _, ptx, row, sass = built[name]
    assert bwd_exact_lse(cfg)
    # (the PTX has 3 more shfl.sync.idx: warp-uniform broadcasts of lane 0, which ptxas drops)
    assert len(re.findall(r"\bshfl\.sync\.idx\b", ptx)) >= cfg.tile_m // 2
    if row:
        assert sass_count(sass, "SHFL.IDX") == cfg.tile_m // 2


@pytest.mark.parametrize("name", IDS)
def test_ptx_counts_equal_sass_counts(built, name):
    _, _, ptx, row, _ = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    assert count(r"cta_group::2") == 0
    assert (count(r"\btcgen05\.mma\b"), count(r"\btcgen05\.commit\b"), count(r"\btcgen05\.ld\b"),
            count(r"\btcgen05\.st\b")) == (row["utchmma"], row["utcbar"], row["ldtm"], row["sttm"])


@pytest.mark.parametrize("name", IDS)
def test_setmaxnreg_and_tmem_allocation_match_the_plans(built, name):
    cfg, _, ptx, _, _ = built[name]
    plan = bwd_register_plan(cfg)
    got = sorted((kind, int(n)) for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx))
    assert got == sorted([("inc", plan.reduce), ("inc", plan.compute), ("dec", plan.other)])
    cols = []
    for reg in re.findall(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]+\],\s*(%r\d+);", ptx):
        cols += [int(v) for v in re.findall(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx)]
    assert cols == [bwd_tmem_alloc_cols(cfg)]


@pytest.mark.parametrize("name", IDS)
def test_packed_tail_zeroing_only_in_packed_configs(built, name):
    """The MMA warp's zero_tail: one rolled loop of STS.128 [..], RZ per site in packed configs (K, V,
    then Q and dO in the prologue and in the step loop; the serial schedule: Q and dO in the step loop
    only), none in dense ones. A site stores cols / 8 / gcd(cols / 8, 32) 16-byte vectors per lane and
    pass (hd192: 3)."""
    cfg, _, _, row, sass = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    per_site = lambda cols: cols // 8 // math.gcd(cols // 8, 32)  # noqa: E731
    sites = 1 if bwd_serial_schedule(cfg) else 2
    want = (1 + sites) * (per_site(cfg.headdim) + per_site(cfg.hdim_v))
    assert len(re.findall(r"\bSTS\.128 \[[^\]]+\], RZ", sass)) == (want if cfg.varlen_q else 0)
