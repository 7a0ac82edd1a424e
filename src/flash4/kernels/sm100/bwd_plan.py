"""The sm100 backward's plan, as pure functions the kernel is built from and CPU tests check: warp
roles, the register plan (setmaxnreg per warpgroup), the tensor-memory map and the pipeline specs
(who produces, who consumes, how each signals: the mbarrier arrive counts).

Pure Python (no torch, no CuTe DSL). The kernel (flash4.kernels.sm100.bwd) reads its TMEM offsets
only from bwd_tmem_map, its setmaxnreg budgets only from bwd_register_plan and its arrive counts
only from bwd_pipeline_specs (checked at trace time by flash4.kernels.sm100.pipes). The design is
FlashAttention-4's 1-CTA sm100 backward (/work/shared/design/BLACKWELL.md section 1, "Backward");
the numbers are read from it, none was measured on a B200. Compile-verified, not run on hardware.
"""

from __future__ import annotations

import dataclasses

from flash4.kernels.sm100.plan import (LAUNCH_REGS, TMEM_COLUMNS, WARP_SIZE, Party, PipelineSpec,
                                       Signal)

# ---------------------------------------------------------------- warp roles (16 warps, 512 threads)
# FA4 flash_bwd_sm100.py: dQ-reduce 0-3, compute 4-11, MMA 12, load 13 (14: the 2-CTA relay warp,
# 15 empty). A warp reaches only the 32 TMEM lanes of its index in its warpgroup (warp % 4), so
# every TMEM-reading role is whole warpgroups: the reduce warpgroup reads dQ (all 128 lanes), the
# two compute warpgroups read S^T, dP^T, dK, dV, each half of the columns.
BWD_WARP_ROLES = {
    "reduce": (0, 1, 2, 3),
    "compute": (4, 5, 6, 7, 8, 9, 10, 11),
    "mma": (12,),
    "load": (13,),
    "idle": (14, 15),
}
# 2-CTA (cta_group 2): warp 14 is the relay warp (it waits until the peer CTA's half of dS landed in
# this CTA's smem and forwards that, one arrive, to the leader CTA's MMA warp); 15 stays idle.
BWD_WARP_ROLES_2CTA = {**{r: w for r, w in BWD_WARP_ROLES.items() if r != "idle"}, "relay": (14,), "idle": (15,)}
BWD_NUM_WARPS = 16
BWD_NUM_THREADS = BWD_NUM_WARPS * WARP_SIZE
# setmaxnreg works per warpgroup: reduce, compute (x2), and the warpgroup of mma, load and idle.
BWD_WARPGROUPS = (("reduce",), ("compute",), ("compute",), ("mma", "load", "idle"))
BWD_ROLE_WARPS = {role: len(w) for role, w in BWD_WARP_ROLES_2CTA.items()}


def bwd_warp_roles(cta_group: int = 1) -> dict:
    """The warp-role table of a config's cta_group (1: BWD_WARP_ROLES; 2: BWD_WARP_ROLES_2CTA)."""
    return BWD_WARP_ROLES_2CTA if cta_group == 2 else BWD_WARP_ROLES
# Head dims the 1-CTA backward is built for with Dv = D in one kernel (FA4's 1-CTA maps in BLACKWELL.md's
# table; hd256: SM100_BWD_TWO_PASS_PAIRS).
SM100_BWD_HEADDIMS = (64, 128)
# Every (D, Dv) the backward is built for: Dv = D at 64 / 128, and DeepSeek's (192, 128) with the
# serial schedule (bwd_serial_schedule: dK + dV take 320 of the 512 TMEM columns, S and dP share the
# other 192). hd256 cannot fit one kernel (bwd_tmem_problem): dK + dV alone are 512 columns; it runs as
# two passes (SM100_BWD_TWO_PASS_PAIRS).
SM100_BWD_HEADDIM_PAIRS = ((64, 64), (128, 128), (192, 128))
# (D, Dv) the backward takes as two passes over each key tile (bwd_pass, docs/design/sm100_backward.md
# section 10.4): dK + dV (512 columns at hd256) cannot be resident together, so pass "dv" keeps dV with
# S^T (P^T inside) and issues only S^T and dV += P^T dO; pass "dkdq" keeps dK with S^T, dP^T and dQ over
# them (the serial order). Compile-verified, not run on hardware.
SM100_BWD_TWO_PASS_PAIRS = ((256, 256),)
# The passes: "both" (one kernel: every MMA, the default of every other config), "dv", "dkdq".
BWD_PASSES = ("both", "dv", "dkdq")
# Pass "dkdq" streams V and dO (read by dP^T = V dO^T only) through a one-stage ring of chunks of
# BWD_VDO_COLS head-dim columns per step (dP^T accumulates over the chunks): K, Q (64 KiB each at
# hd256), dS 32 and the dQ staging 32 leave no room for whole V and dO tiles (321 KiB).
BWD_VDO_COLS = 32
# Pass order of a two-pass backward (the host launches them in sequence; neither reads the other's output).
BWD_TWO_PASS_ORDER = ("dv", "dkdq")
# The MMAs and TMEM accumulators each pass issues / holds (bwd_pass_mmas).
BWD_PASS_MMAS = {"both": ("S", "dP", "dV", "dK", "dQ"), "dv": ("S", "dV"), "dkdq": ("S", "dP", "dK", "dQ")}


def bwd_pass(cfg) -> str:
    """The config's pass ("both" where the config has no bwd_pass field)."""
    return getattr(cfg, "bwd_pass", "both")


def bwd_pass_mmas(cfg) -> tuple:
    """The accumulators (and the MMAs writing them) the config's pass has: BWD_PASS_MMAS."""
    return BWD_PASS_MMAS[bwd_pass(cfg)]


# Head dims the 2-CTA backward is built for (FA4 runs 2-CTA for hd >= 128): hd128 with the pipelined
# schedule, (192, 128) with FA4's serial hd192 schedule (bwd_two_cta_serial); hd256 not at all.
SM100_BWD_2CTA_HEADDIMS = (128, 192)
# (D, Dv) pairs of the 2-CTA backward (the one source of truth; SM100_BWD_2CTA_HEADDIMS lists their D).
SM100_BWD_2CTA_PAIRS = ((128, 128), (192, 128))
# dQ staging rows per reduce warp in the serial 2-CTA backward ((192, 128)): 8 rows of D / 2 = 96 fp32
# columns (12 KiB for the 4 warps) put the tiles at 229 KiB > BWD_SMEM_BUDGET; 4 rows (6 KiB): 223 KiB.
DQ_GROUP_ROWS_2CTA_SERIAL = 4
# dQ read-out pass of the serial 2-CTA pair's reduce warps (bwd_dq_passes): per group of rows the warp loads
# 32 of its 96 columns at a time (with all 96 live, 120 registers spilled 58-60 LDL / STL in causal configs).
DQ_PASS_COLS_2CTA_SERIAL = 32
# Q ring depth of the 2-CTA backward (FA4 Q_stage = 1 there: Q and Q^T both live in smem).
BWD_Q_STAGES_2CTA = 1
# Queries per step (S^T columns) and keys per CTA (TMEM lanes): FA4's 1-CTA tile.
BWD_TILE_M = 128
BWD_TILE_N = 128
# Q ring depth (FA4 Q_stage = 2 for 1-CTA), dO ring depth (FA4 dO_stage = 1).
BWD_Q_STAGES = 2
BWD_DO_STAGES = 1
# dQ leaves through smem: each reduce warp stages DQ_GROUP_ROWS whole rows of its 32 (all D fp32
# columns: one contiguous block of the row-major dQ accumulator) and one lane reduce-adds the block
# with one cp.reduce.async.bulk .add.f32 (8 x D x 4 bytes: 4 KiB at hd128), 32 / DQ_GROUP_ROWS per
# step. (A bulk op per lane per 32 columns, the first version, compiled to a 32-iteration
# ELECT / R2UR / UBLKRED loop per warp: the instruction takes uniform operands.)
DQ_GROUP_ROWS = 8
# Columns per tcgen05.ld of dQ (32x32b.x32).
DQ_LD_COLS = 32
# dQ columns a reduce thread holds in registers at once: its whole row up to DQ_MAX_LIVE_COLS (hd128:
# 128 of its 152 registers). A wider row (hd192) is read out in passes of DQ_PASS_COLS (bwd_dq_passes):
# per group of DQ_GROUP_ROWS rows, each pass loads DQ_PASS_COLS columns of the warp's 32 rows from TMEM
# again and the group's lanes stage theirs (96-column passes spilled at a 136-register reduce budget).
DQ_MAX_LIVE_COLS = 128
DQ_PASS_COLS = 64
# Rows wider than DQ_WIDE_ROW_COLS (hd256, pass dkdq) are read in passes of DQ_PASS_COLS_WIDE: with
# 64-column passes its reduce warps spilled 4 (LDL / STL) at 152 registers.
DQ_WIDE_ROW_COLS = 192
DQ_PASS_COLS_WIDE = 32
# smem budget of the tiles (the rest of 227 KiB: mbarriers, the TMEM pointer, LSE and dPsum).
BWD_SMEM_BUDGET = 224 * 1024


def bwd_smem_bytes(headdim: int, hdim_v: int, tile_m: int = BWD_TILE_M, tile_n: int = BWD_TILE_N,
                   q_stages: int = BWD_Q_STAGES, do_stages: int = BWD_DO_STAGES, elt: int = 2,
                   cta_group: int = 1, bwd_pass: str = "both") -> int:
    """Bytes of the tiles: K, V (one each), the Q ring, the dO ring, dS (16-bit, tile_n x tile_m),
    the dQ staging (4 reduce warps x DQ_GROUP_ROWS rows x D fp32) and LSE / dPsum (fp32 per Q / dO
    stage). hd128: 32 + 32 + 64 + 32 + 32 + 16 + 1.5 = 209.5 KiB; hd64: 121.5 KiB.

    bwd_pass "dv" (S^T and dV only): K, the Q ring, the dO ring and LSE (no V, dS, dQ staging, dPsum):
    hd256 at one Q stage 64 + 64 + 64 + 0.5 = 192.5 KiB. "dkdq": V and dO as do_stages chunks of
    BWD_VDO_COLS columns (they are read by dP^T only, which accumulates over the chunks): hd256
    K 64 + Q 64 + V 8 + dO 8 + dS 32 + dQ staging 32 + LSE / dPsum 1 = 209 KiB (whole V and dO tiles:
    64 x 4 + 32 + 32 + 1 = 321 KiB, the "both" arithmetic).

    2-CTA (cta_group 2; bwd_smem_bytes_2cta): every MMA's B operand is split along N between the
    pair, so the operands the 1-CTA kernel reads through a second view of one buffer are loaded
    twice, each half as the MMA wants it: hd128 216 + 1 = 217 KiB."""
    if cta_group == 2:
        return bwd_smem_bytes_2cta(headdim, hdim_v, tile_m, tile_n, q_stages, do_stages, elt)
    k = tile_n * headdim * elt
    v = tile_n * hdim_v * elt
    q = q_stages * tile_m * headdim * elt
    do = do_stages * tile_m * hdim_v * elt
    ds = tile_n * tile_m * elt
    dq = 4 * DQ_GROUP_ROWS * headdim * 4
    stats = (q_stages + do_stages) * tile_m * 4
    if bwd_pass == "dv":
        return k + q + do + q_stages * tile_m * 4
    if bwd_pass == "dkdq":
        v = do_stages * tile_n * BWD_VDO_COLS * elt
        do = do_stages * tile_m * BWD_VDO_COLS * elt
    return k + v + q + do + ds + dq + stats


def bwd_two_cta_serial_dims(headdim: int, hdim_v: int, tile_m: int = BWD_TILE_M) -> bool:
    """Whether a 2-CTA pair at (D, Dv) runs the serial schedule: each CTA's TMEM cannot hold S^T, dP^T,
    dV and dK side by side (2 tile_m + D + Dv > 512; (192, 128): 576), as the 1-CTA bwd_serial_schedule."""
    return 2 * tile_m + headdim + hdim_v > TMEM_COLUMNS


def bwd_two_cta_serial(cfg) -> bool:
    """True for a 2-CTA config with the serial schedule ((192, 128): FA4's hd192 backward, 2-CTA only
    there): per step S ; dP ; dV ; dK ; dQ, each after the previous step's dQ was read out
    (bwd_tmem_map_2cta's serial map), Q and Q^T through one ring, dO and dO^T through one ring
    (bwd_two_cta_shared_rings), no S(i+1) while step i's dS is computed."""
    return getattr(cfg, "cta_group", 1) == 2 and bwd_two_cta_serial_dims(cfg.headdim, cfg.hdim_v, cfg.tile_m)


def bwd_two_cta_shared_rings(cfg) -> bool:
    """Whether Q and Q^T share one smem ring (and dO and dO^T another): the serial 2-CTA schedule, whose
    tiles do not fit otherwise ((192, 128): 269 KiB with both pairs apart). Q (tile_m / 2 x D) and Q^T
    (D / 2 x tile_m) are the same number of elements, as dO and dO^T: the load warp fills the stage with
    Q, the MMA warp releases it after S^T, the load warp refills it with Q^T for dK (FA4's hd192 order:
    "Q^T, the Q ring again"); dO then dO^T likewise (dP^T, then dV)."""
    return bwd_two_cta_serial(cfg)


def bwd_role_tiles(cfg) -> bool:
    """Whether each warp role computes the tile's coordinates after its setmaxnreg instead of once
    before the role branch (where the launch's 128-register cap holds them across the cluster / TMEM
    setup): pass dkdq (dense; the first query block spilled there, 1 STL + 3 LDL at every split tried)
    and the serial 2-CTA pair (the query block count spilled, 1 STL + 9 LDL, bf16 full at 136 / 136 / 104)."""
    return (bwd_pass(cfg) == "dkdq" and not getattr(cfg, "varlen_q", False)) or bwd_two_cta_serial(cfg)


def bwd_dq_group_rows(headdim: int, hdim_v: int, cta_group: int = 1) -> int:
    """Rows a reduce warp stages per bulk reduce group: DQ_GROUP_ROWS, DQ_GROUP_ROWS_2CTA_SERIAL in the
    serial 2-CTA backward (smem: bwd_smem_bytes_2cta)."""
    if cta_group == 2 and bwd_two_cta_serial_dims(headdim, hdim_v):
        return DQ_GROUP_ROWS_2CTA_SERIAL
    return DQ_GROUP_ROWS


def bwd_smem_bytes_2cta(headdim: int, hdim_v: int, tile_m: int = BWD_TILE_M, tile_n: int = BWD_TILE_N,
                        q_stages: int = BWD_Q_STAGES_2CTA, do_stages: int = BWD_DO_STAGES, elt: int = 2) -> int:
    """One CTA's tiles in a 2-CTA pair (FA4's 2-CTA layout, flash_bwd_sm100.py SharedStorage):
    K, V of its own tile_n keys (A of S^T, dP^T: 32 + 32 KiB); per Q stage Q (B of S^T: tile_m / 2
    queries x D) and Q^T (B of dK: D / 2 x tile_m queries), 16 + 16; dO (B of dP^T) and dO^T (B of
    dV), 16 + 16; K^T (B of dQ: D / 2 x the pair's 2 tile_n keys), 32; dS^T (tile_n x tile_m, the
    A of dQ after the exchange: this CTA's tile_m / 2 queries x the pair's keys), 32; the half of dS^T
    sent to the peer (tile_n x tile_m / 2), 16; the dQ staging (4 warps x DQ_GROUP_ROWS rows x D / 2
    fp32), 8; LSE / dPsum, 1. hd128: 217 KiB.

    The serial schedule ((192, 128), bwd_two_cta_shared_rings): Q and Q^T share one buffer, dO and dO^T
    another, and the dQ staging holds DQ_GROUP_ROWS_2CTA_SERIAL rows per warp: K 48 + V 32 + Q / Q^T 24
    + dO / dO^T 16 + K^T 48 + dS^T 32 + exchange 16 + dQ staging 6 + LSE / dPsum 1 = 223 KiB (apart:
    269 KiB)."""
    shared = bwd_two_cta_serial_dims(headdim, hdim_v, tile_m)
    rings = 1 if shared else 2  # Q and Q^T (dO and dO^T): one buffer each, or two
    k = tile_n * headdim * elt
    v = tile_n * hdim_v * elt
    q = q_stages * rings * (tile_m // 2) * headdim * elt
    do = do_stages * rings * (tile_m // 2) * hdim_v * elt
    kt = 2 * tile_n * (headdim // 2) * elt
    ds = tile_n * tile_m * elt
    xchg = tile_n * (tile_m // 2) * elt
    dq = 4 * bwd_dq_group_rows(headdim, hdim_v, 2) * (headdim // 2) * 4
    stats = (q_stages + do_stages) * tile_m * 4
    return k + v + q + do + kt + ds + xchg + dq + stats


# ---------------------------------------------------------------- registers (setmaxnreg)
@dataclasses.dataclass(frozen=True)
class BwdRegisterPlan:
    """setmaxnreg budget per role (registers per thread): reduce (warps 0-3), compute (each of the
    two compute warpgroups), other (mma, load and idle share the fourth warpgroup)."""

    reduce: int
    compute: int
    other: int

    def per_warpgroup(self) -> tuple:
        return (self.reduce, self.compute, self.compute, self.other)

    @staticmethod
    def is_increase(regs: int) -> bool:
        return regs > LAUNCH_REGS


def bwd_register_plan_problem(plan: BwdRegisterPlan) -> str | None:
    for role, regs in (("reduce", plan.reduce), ("compute", plan.compute), ("other", plan.other)):
        if regs % 8 or not 24 <= regs <= 256:
            return f"regs_{role}={regs}: setmaxnreg takes a multiple of 8 in [24, 256]"
    total = sum(plan.per_warpgroup())
    if total > 512:
        return f"register plan {plan}: warpgroup budgets sum to {total} > 512 (64K registers / 128 threads)"
    return None


def default_bwd_register_plan(headdim: int, causal: bool, packed: bool = False) -> BwdRegisterPlan:
    """FA4's 1-CTA budgets (flash_bwd_sm100.py __init__): reduce / compute / load = mma 152 / 136 / 88,
    summing to 512 (tuned by FA4 on B200, not here). FA4 moves 16 registers from the reduce to the
    compute warpgroups for causal (136 / 144 / 88); flash4 keeps 152 / 136 / 88 for every 1-CTA
    config until a compile shows a spill (the causal mask is one threshold per thread here).
    (192, 128) too: 0 spills at 152 / 136 / 88 for its 12 configs without softcap. Tried and rejected
    there (CuTe DSL 4.8.1, 2026-12-02; spills in LDL / STL of one compile each): 136 / 144 / 88 and
    120 / 144 / 104 (the MMA warp's descriptors or a prologue value, 15-32), 136 / 136 / 104 (FA4's
    hd192 numbers: the reduce warps, 39-50 without the deterministic chain), 144 / 144 / 80 (26).
    Since the exact-LSE branch in the compute step (issue 8; CuTe DSL 4.8.1, 2026-12-02): hd64
    136 / 144 / 88 (FA4's causal split: 152 / 136 / 88 spilled 1 LDL + 1 STL in each of the 12 hd64
    configs; 144 / 144 / 80 also clean); packed hd128 (varlen, seqused) 144 / 144 / 80 (152 / 136 / 88
    spilled 3 + 3 full bf16, 136 / 144 / 88 2 + 2; the dense deterministic hd128 configs spill 1-13 at
    144 / 144 / 80 in the reduce warps, so dense hd128 keeps 152 / 136 / 88)."""
    del causal
    if headdim == 64:
        return BwdRegisterPlan(136, 144, 88)
    if headdim == 128 and packed:
        return BwdRegisterPlan(144, 144, 80)
    return BwdRegisterPlan(152, 136, 88)


def default_bwd_register_plan_pass(bwd_pass: str) -> BwdRegisterPlan:
    """The budgets of a pass of a two-pass config (hd256). "dv": 96 / 144 / 128 (its reduce warps idle).
    "dkdq": 128 / 168 / 48 -- its compute step (P kept in registers for dS, the window's bounds, the
    coordinates computed after setmaxnreg) spilled at 136 (4 LDL / STL full fp16, 18 with a window at
    144); its reduce warps (dQ read in 32-column passes) keep the launch budget 128 (less made the bf16
    window softcap config worse: 27 at 120 / 152 / 88, 48 at 112 / 152 / 96); its MMA / load warps
    fit 48. Tried and rejected for dkdq before the exact-LSE branch: 152 / 136 / 88, 136 / 144 / 88,
    144 / 144 / 80, 160 / 136 / 80, 152 / 128 / 104, 144 / 136 / 96, 136 / 136 / 104.
    Before the exact-LSE branch (issue 8) the plans were 152 / 136 / 88 and 128 / 152 / 80. With it
    (CuTe DSL 4.8.1, 2026-12-02; LDL + STL of one compile): dv bf16 causal softcap spilled 13 at
    152 / 136 / 88 (the same at 104 / 160 / 88, 120 / 152 / 88, 136 / 136 / 104; 3 at 128 / 136 / 112;
    0 at 120 / 136 / 120), packed dv bf16 causal / window softcap + seqused 10 / 7 at 120 / 136 / 120,
    104 / 136 / 136 and 112 / 136 / 128 (0 at 96 / 144 / 128); dkdq bf16 window softcap 10 at
    128 / 152 / 80 (0 at 128 / 160 / 64); packed dkdq bf16 full softcap + seqused 3 (a prologue value,
    seqlen_k, stored before the role branch, reloaded in the compute and MMA warps) at 128 / 152 / 80,
    128 / 160 / 64, 136 / 152 / 72, 128 / 144 / 96, 120 / 152 / 88, 112 / 152 / 96 (144 / 144 / 80:
    25). At these plans: 0 spills for the 30 configs of two_pass_bwd_configs and 11 packed ones
    (tests/cpu/test_sm100_bwd_passes.py compiles 26 of them)."""
    return BwdRegisterPlan(128, 168, 48) if bwd_pass == "dkdq" else BwdRegisterPlan(96, 144, 128)


def default_bwd_register_plan_2cta(headdim: int, causal: bool, hdim_v: int | None = None, dtype: str = "bf16",
                                   softcap: bool = False) -> BwdRegisterPlan:
    """FA4's 2-CTA budgets (flash_bwd_sm100.py __init__, hd128, causal or not): reduce / compute /
    load = mma 136 / 136 / 104: 136 + 2 x 136 + 104 = 512 (FA4's relay warp takes the MMA's 104, its
    empty warp 24; here the relay and idle warps share the fourth warpgroup's 104). Where the config
    carries the exact-LSE branch (bwd_two_cta_exact_lse; CuTe DSL 4.8.1, 2026-12-03, LDL + STL of one
    compile) the splits below; the spills of the others are listed there."""
    dv = headdim if hdim_v is None else hdim_v
    if bwd_two_cta_serial_dims(headdim, dv):
        # (192, 128), full or causal, softcap or not: 104 / 152 / 104 (CuTe DSL 4.8.1, 2026-12-03; LDL +
        # STL of one compile). With the reduce warps holding all 96 dQ values: FA4's hd192 split
        # 136 / 136 / 104 spilled 3 + 3 bf16 full (the compute step) and 8 bf16 causal; 120 / 144 / 104 was
        # clean in full configs but spilled 73-91 in causal ones (58-60 in the reduce warps, 10-31 in
        # the compute step); 136 / 144 / 88 66 (the MMA / load warps), 128 / 144 / 96 41. The causal
        # softcap compute step is clean at 152, so the reduce warps read dQ in 32-column passes
        # (bwd_dq_passes) and fit 104; 88 / 152 / 120 spilled 35.
        # With the exact-LSE branch the causal configs (bf16 / fp16, bf16 softcap) spilled at 104 / 152 / 104
        # (38 + 9, 36 + 7, 4 + 4) and take 104 / 160 / 88 (0; also clean without softcap: 96 / 160 / 96,
        # 88 / 160 / 104, 112 / 144 / 112); the full ones stay clean at 104 / 152 / 104.
        if causal and bwd_two_cta_exact_lse(headdim, causal, dv, dtype, softcap):
            return BwdRegisterPlan(104, 160, 88)
        return BwdRegisterPlan(104, 152, 104)
    if bwd_two_cta_exact_lse(headdim, causal, dv, dtype, softcap):
        # hd128 with the exact-LSE branch (bf16 full, bf16 / fp16 causal): 112 / 144 / 112 (0 LDL / STL).
        # At the plans below the branch spilled 55 + 9 (full) and 50 + 3 (causal); 120 / 152 / 88 was clean
        # in bf16 causal only (31 + 1 in bf16 full: a prologue value, the mbarrier base, stored before the
        # role branch and reloaded in the wait loops, with the fourth warpgroup at 88 or 96)
        return BwdRegisterPlan(112, 144, 112)
    if causal:
        # flash4's causal compute step held 6 registers more than 136 (3 LDL + 3 STL, stack 24): 16
        # move from the reduce warpgroup (its 64 dQ values fit in 120) to the compute ones
        return BwdRegisterPlan(120, 144, 104)
    return BwdRegisterPlan(136, 136, 104)


def bwd_two_cta_exact_lse(headdim: int, causal: bool, hdim_v: int | None = None, dtype: str = "bf16",
                          softcap: bool = False) -> bool:
    """Whether a 2-CTA config (bwd_two_cta_problem None) carries the exact-LSE branch (issue 8), the
    per-config rule (CuTe DSL 4.8.1, 2026-12-03; LDL + STL of one compile with the branch, at the splits
    tried; compile-verified, not run on hardware):

      hd128 bf16 full, bf16 / fp16 causal: yes, at 112 / 144 / 112 (default_bwd_register_plan_2cta).
      hd128 fp16 full: no. 66 + 25 at 112 / 144 / 112 (its compute step at 144, where bf16 is clean),
          55 + 9 at 136 / 136 / 104, 75 + 24 at 120 / 144 / 104 and 104 / 144 / 120, 79 + 36 at
          128 / 136 / 112 and 112 / 136 / 128, 47 + 2 at 104 / 152 / 104, 31 + 1 at 112 / 152 / 96,
          120 / 152 / 88, 128 / 144 / 96, 136 / 144 / 88, 31 + 31 at 128 / 152 / 80, 40 + 40 at 104 / 168 / 72.
      hd128 softcap (bf16, full and causal): no. The compute step needs 152 (144: 77-80 + 23-24 at
          112 / 144 / 112, 120 / 144 / 104, 104 / 144 / 120); at 152 the reduce or fourth warpgroup
          reloads prologue values (the mbarrier addresses, stored before the role branch): 47-52 +
          2-3 at 104 / 152 / 104 (dQ in 1 or 2 read-out passes), 96 / 152 / 112, 88 / 152 / 120; 31-34 +
          1-2 at 112 / 152 / 96, 120 / 152 / 88; 30-36 + 30-36 at 128 / 152 / 80; 160 / 168 with the
          fourth warpgroup at 64-96: 29-50 (+ 1-50).
      (192, 128) bf16 / fp16 full: yes, at 104 / 152 / 104; causal (bf16 / fp16, bf16 softcap): yes, at
          104 / 160 / 88.
      (192, 128) bf16 full softcap: no. 2 + 2 at 104 / 152 / 104 and 112 / 152 / 96 (two 64-bit values in
          the compute step), 4 + 4 at 120 / 152 / 88, 15 + 15 at 104 / 160 / 88, 29 + 1 at 96 / 160 / 96 and
          88 / 160 / 104, 26 + 21 at 96 / 152 / 112, 31 + 24 at 112 / 144 / 112, 36 + 36 at 112 / 160 / 80
          and 96 / 168 / 80, 41 + 41 at 104 / 168 / 72.
    Without the branch P uses the rounded lse_log2 (exact while |LSE log2 e| < BWD_EXACT_LSE_LOG2, off by
    up to half an fp32 ulp of it beyond). fp16 softcap (selectable, not shipped) follows its bf16 rule."""
    dv = headdim if hdim_v is None else hdim_v
    if bwd_two_cta_serial_dims(headdim, dv):
        return causal or not softcap
    return not softcap and (causal or dtype == "bf16")


def bwd_register_plan(cfg) -> BwdRegisterPlan:
    return BwdRegisterPlan(cfg.regs_reduce, cfg.regs_compute, cfg.regs_other)


# ---------------------------------------------------------------- tensor memory
def bwd_tmem_map(cfg) -> dict:
    """TMEM columns of every buffer of the 1-CTA backward: name -> (start_col, ncols) (32-bit
    columns, all 128 lanes = the CTA's 128 keys). FA4's maps (BLACKWELL.md table), from one rule:

      S   = S^T = K Q^T, fp32, tile_m columns at 0
      dV  = sum P^T dO, fp32, Dv columns after S
      dP  = dP^T = V dO^T, fp32, tile_m columns after dV
      dK  = sum dS^T Q, fp32, D columns after dP
      dQ  = dS K, fp32, D columns over dP (written after the compute warps turned dP into dS)
      P0, P1 = P^T, 16-bit (two per column), one half per compute warpgroup (its 64 query columns:
            32 columns): own slots after dK when they fit in 512 columns (hd64: P^T contiguous at
            384-448), else inside S, each half at the start of ITS warpgroup's S columns (hd128: 0-32
            and 64-96), so no warpgroup writes S columns the other still reads
      dS0, dS1 = dS^T, likewise after P (hd64: 448-512) or inside dP (hd128: 256-288, 320-352)
    hd128: S 0-128, dV 128-256, dP 256-384, dK 384-512, dQ 256-384, P inside S, dS inside dP.
    hd64:  S 0-128, dV 128-192, dP 192-320, dK 320-384, dQ 192-256, P 384-448, dS 448-512.
    (FA4 keeps P^T contiguous at S's start and syncs its two compute warpgroups before writing it;
    the MMAs that read P^T / dS^T here take the halves as two runs of k-blocks.) This is the
    kernel's only source of TMEM offsets."""
    if getattr(cfg, "cta_group", 1) == 2:
        return bwd_tmem_map_2cta(cfg)
    if bwd_pass(cfg) != "both":
        return bwd_tmem_map_pass(cfg)
    if bwd_serial_schedule(cfg):
        return bwd_tmem_map_serial(cfg)
    tm, d, dv = cfg.tile_m, cfg.headdim, cfg.hdim_v
    wgs = 2  # compute warpgroups (BWD_WARP_ROLES)
    wg_cols = tm // wgs  # fp32 columns of S^T / dP^T per compute warpgroup
    half = wg_cols // 2  # its 16-bit P^T / dS^T columns
    m = {"S": (0, tm), "dV": (tm, dv), "dP": (tm + dv, tm)}
    m["dK"] = (m["dP"][0] + tm, d)
    m["dQ"] = (m["dP"][0], d)
    end = m["dK"][0] + d
    own = end + 2 * wgs * half <= TMEM_COLUMNS
    for w in range(wgs):
        if own:
            m[f"P{w}"] = (end + w * half, half)
            m[f"dS{w}"] = (end + wgs * half + w * half, half)
        else:
            m[f"P{w}"] = (m["S"][0] + w * wg_cols, half)
            m[f"dS{w}"] = (m["dP"][0] + w * wg_cols, half)
    return m


def bwd_tmem_problem(headdim: int, hdim_v: int, tile_m: int = BWD_TILE_M) -> str | None:
    """Why no 1-CTA TMEM map fits (D, Dv) at tile_m, or None. dK (D columns) and dV (Dv) stay resident
    for the whole CTA; S^T and dP^T (tile_m columns each) hold P^T / dS^T (16-bit: tile_m / 2 columns
    each) until dV / dK read them, so the two cannot share more than tile_m / 2 columns (P^T must
    survive dP^T's write); dQ (D columns) goes over S and dP once both were read. Fits when
    D + Dv + 3 tile_m / 2 <= 512 and D <= the columns left after dK and dV."""
    free = TMEM_COLUMNS - headdim - hdim_v
    if free < tile_m + tile_m // 2:
        return (f"(D, Dv)=({headdim}, {hdim_v}): dK + dV take {headdim} + {hdim_v} = {headdim + hdim_v} of the "
                f"{TMEM_COLUMNS} TMEM columns; S^T and dP^T (tile_m={tile_m} columns each, sharing at most "
                f"{tile_m // 2}: P^T must survive dP^T's write) need {tile_m + tile_m // 2}, {free} are left")
    if headdim > free:
        return f"(D, Dv)=({headdim}, {hdim_v}): dQ ({headdim} columns) does not fit the {free} columns after dK, dV"
    return None


def bwd_serial_schedule(cfg) -> bool:
    """True where the pipelined 1-CTA map (S, dV, dP, dK side by side: 2 tile_m + D + Dv columns) does
    not fit 512 columns, so S^T and dP^T share columns and each step runs serially (FA4's hd192
    schedule, there in 2-CTA): S(i) after dQ(i-1) was read out, dP(i) after P^T(i) was written
    ((192, 128): 128 + 192 + 128 + 128 = 576 > 512)."""
    if getattr(cfg, "cta_group", 1) != 1:
        return False
    if bwd_pass(cfg) != "both":  # "dkdq": dQ over S and dP, the serial order; "dv": S and dV only
        return bwd_pass(cfg) == "dkdq"
    return 2 * cfg.tile_m + cfg.headdim + cfg.hdim_v > TMEM_COLUMNS


def bwd_tmem_map_serial(cfg) -> dict:
    """TMEM columns of the serial 1-CTA backward ((192, 128); FA4's hd192 map, there per CTA of a
    2-CTA pair, here for a 1-CTA tile of 128 keys x 128 queries):

      dV  = 0 .. Dv, dK after it (resident: Dv + D = 320 columns)
      S   = S^T, tile_m columns after dK (320-448)
      dP  = dP^T, the LAST tile_m columns (384-512): over S's second half, written after both compute
            warpgroups read S^T and wrote P^T (the s pipeline), so S and dP overlap (bwd_tmem_overlaps)
      P0, P1 = P^T contiguous at S's start (320-352, 352-384), clear of dP (dV reads P^T after dP^T
            was written); P1 lies in warpgroup 0's S columns, so the compute warpgroups sync (a named
            barrier, bwd_p_barrier) between reading S^T and writing P^T, as the 2-CTA kernel and FA4
      dS0, dS1 = dS^T inside each warpgroup's own dP^T columns (384-416, 448-480), as 1-CTA
      dQ  = dS K, D columns over S and dP (320-512): written after dV and dK read P^T and dS^T
            (issued before it) and after the compute warps read dP^T (ds full); S(i+1) waits until
            the reduce warps read dQ(i) out (dq empty)."""
    if cfg.cta_group != 1:
        raise ValueError("bwd_tmem_map_serial is the 1-CTA serial map")
    problem = bwd_tmem_problem(cfg.headdim, cfg.hdim_v, cfg.tile_m)
    if problem is not None:
        raise ValueError(problem)
    tm, d, dv = cfg.tile_m, cfg.headdim, cfg.hdim_v
    wgs = 2
    half = tm // wgs // 2
    m = {"dV": (0, dv), "dK": (dv, d), "S": (dv + d, tm), "dP": (TMEM_COLUMNS - tm, tm)}
    m["dQ"] = (dv + d, d)
    for w in range(wgs):
        m[f"P{w}"] = (m["S"][0] + w * half, half)
        m[f"dS{w}"] = (m["dP"][0] + w * (tm // wgs), half)
    return m


def bwd_tmem_map_pass(cfg) -> dict:
    """TMEM columns of one pass of a two-pass config (bwd_pass "dv" or "dkdq", 1-CTA, 128 keys x
    tile_m queries; hd256: docs/design/sm100_backward.md section 10.4):

    "dv"   dV = 0 .. Dv (resident), S = S^T after it (Dv .. Dv + tile_m), P0, P1 = P^T halves at the
           start of EACH warpgroup's own S^T columns (as the pipelined hd128 map: no warpgroup writes
           S^T columns the other reads, so no barrier). hd256: dV 0-256, S 256-384, P 256-288, 320-352.
    "dkdq" dK = 0 .. D (resident), S = S^T after it, dP = dP^T the last tile_m columns (clear of S:
           P^T is not an MMA operand in this pass, it stays in registers for dS), dS0, dS1 = dS^T
           at the start of each warpgroup's own dP^T columns, dQ = D columns over S and dP (written
           after the compute warps read dP^T and dK read dS^T; S(i+1) waits for dQ(i)'s read-out).
           hd256: dK 0-256, S 256-384, dP 384-512, dS 384-416, 448-480, dQ 256-512."""
    if cfg.cta_group != 1:
        raise ValueError("the two-pass backward is 1-CTA")
    problem = bwd_pass_tmem_problem(cfg.headdim, cfg.hdim_v, bwd_pass(cfg), cfg.tile_m)
    if problem is not None:
        raise ValueError(problem)
    tm, d, dv = cfg.tile_m, cfg.headdim, cfg.hdim_v
    wgs = 2
    wg_cols = tm // wgs
    half = wg_cols // 2
    if bwd_pass(cfg) == "dv":
        m = {"dV": (0, dv), "S": (dv, tm)}
        for w in range(wgs):
            m[f"P{w}"] = (dv + w * wg_cols, half)
        return m
    m = {"dK": (0, d), "S": (d, tm), "dP": (d + tm, tm), "dQ": (d, d)}
    for w in range(wgs):
        m[f"dS{w}"] = (d + tm + w * wg_cols, half)
    return m


def bwd_pass_tmem_problem(headdim: int, hdim_v: int, bwd_pass: str, tile_m: int = BWD_TILE_M) -> str | None:
    """Why pass `bwd_pass` of a two-pass config does not fit 512 TMEM columns, or None: "dv" needs
    Dv + tile_m, "dkdq" D + 2 tile_m (S^T and dP^T side by side) and dQ (D) within S and dP."""
    if bwd_pass == "dv":
        need = hdim_v + tile_m
    elif bwd_pass == "dkdq":
        need = headdim + 2 * tile_m
        if headdim > 2 * tile_m:
            return f"pass dkdq at D={headdim}: dQ ({headdim} columns) does not fit over S^T and dP^T (2 x {tile_m})"
    else:
        return f"bwd_pass={bwd_pass!r}: not a pass of a two-pass config ({BWD_PASSES[1:]})"
    if need > TMEM_COLUMNS:
        return f"pass {bwd_pass} at (D, Dv)=({headdim}, {hdim_v}): {need} TMEM columns > {TMEM_COLUMNS}"
    return None


def bwd_serial_problem(softcap: bool = False, dtype: str = "bf16", causal: bool = False,
                       deterministic: bool = False) -> str | None:
    """Why the serial schedule ((192, 128)) cannot take a problem class, or None. Softcap is built (11 of
    its 12 dtype x mask x deterministic combinations compile with 0 spills at 152 / 136 / 88) except bf16,
    causal, deterministic: its kernel keeps one value of the prologue (before the role branch) in local
    memory, 1 STL + 3 LDL, at every register split tried (CuTe DSL 4.8.1, 2026-12-02: 152 / 136 / 88,
    136 / 144 / 88 4; 144 / 136 / 96 36, 152 / 136 / 80 74, 136 / 136 / 104 73, 160 / 136 / 72 82; each role
    computing its coordinates after its setmaxnreg, as pass dkdq does, left 2 and made the causal
    non-deterministic config spill 2)."""
    if softcap and dtype == "bf16" and causal and deterministic:
        return ("softcap with bf16, causal and deterministic=True at (headdim, headdim_v)=(192, 128): that serial "
                "sm100 backward config spills (1 STL + 3 LDL at every register split tried; fp16, or "
                "deterministic=False, or a window are built; docs/design/sm100_backward.md section 10.3)")
    return None


def bwd_exact_lse(cfg) -> bool:
    """Whether the kernel carries the exact-LSE path (issue 8: query tiles the preprocess flagged take
    P from the forward's unrounded hi + lo): every 1-CTA config (hd64, hd128, (192, 128), both hd256
    passes, packed or not), and the 2-CTA configs of bwd_two_cta_exact_lse (hd128 bf16 full, bf16 / fp16
    causal; (192, 128) full and causal, bf16 softcap causal: every 2-CTA config but hd128 fp16 full,
    hd128 softcap and (192, 128) bf16 full softcap, which spilled with it at every register split tried;
    there P uses the rounded lse_log2)."""
    if getattr(cfg, "cta_group", 1) == 1:
        return True
    return bwd_two_cta_exact_lse(cfg.headdim, cfg.causal, cfg.hdim_v, cfg.dtype, cfg.softcap)


def bwd_tmem_overlaps(cfg) -> tuple:
    """Overlapping buffers neither of which contains the other, (a, b): only the serial map's S and
    dP (S^T's second half is dead once P^T is written; P^T itself lies outside dP); the serial 2-CTA map
    adds S and dQ (dQ over S's last D / 2 - tile_m / 2 columns, read before P^T was written)."""
    if bwd_two_cta_serial(cfg):
        return (("S", "dP"), ("S", "dQ"))
    return (("S", "dP"),) if bwd_serial_schedule(cfg) and bwd_pass(cfg) == "both" else ()


def bwd_p_barrier(cfg) -> bool:
    """Whether a compute warpgroup's P^T half lies in S^T columns ANOTHER warpgroup reads (P^T
    contiguous at S's start: 2-CTA, serial), so the warpgroups sync between reading S^T and writing P^T."""
    m = bwd_tmem_map(cfg)
    s0, wg_cols = m["S"][0], cfg.tile_m // 2
    if "P0" not in m:  # pass dkdq: P^T stays in registers (no dV MMA reads it)
        return False
    for w in range(2):
        start, n = m[f"P{w}"]
        for other in range(2):
            lo = s0 + other * wg_cols
            if other != w and start < lo + wg_cols and lo < start + n:
                return True
    return False


def bwd_dq_passes(headdim: int, cta_group: int = 1, hdim_v: int | None = None) -> int:
    """Read-out passes of a reduce thread's dQ row (D / cta_group fp32 columns): 1 up to
    DQ_MAX_LIVE_COLS (hd64 / hd128, the 2-CTA halves), else passes of DQ_PASS_COLS (hd192: 3 x 64).
    The serial 2-CTA pair ((192, 128); hdim_v given): passes of DQ_PASS_COLS_2CTA_SERIAL (3 x 32 of the
    96 columns), so its reduce warps fit the 104 registers the causal compute step leaves them."""
    cols = headdim // cta_group
    if cta_group == 2 and hdim_v is not None and bwd_two_cta_serial_dims(headdim, hdim_v):
        return cols // DQ_PASS_COLS_2CTA_SERIAL
    if cols <= DQ_MAX_LIVE_COLS:
        return 1
    pass_cols = DQ_PASS_COLS if cols <= DQ_WIDE_ROW_COLS else DQ_PASS_COLS_WIDE
    if cols % pass_cols:
        raise ValueError(f"no dQ read-out pass split for {cols} columns")
    return cols // pass_cols


def bwd_q_stages(headdim: int, hdim_v: int, bwd_pass: str = "both") -> int:
    """The Q ring's depth of a 1-CTA config: FA4's 2 where the tiles fit BWD_SMEM_BUDGET, else 1
    ((192, 128): 265.5 KiB with 2 stages, 217 KiB with 1; hd256 pass "dv": 256.5 / 192.5 KiB)."""
    return BWD_Q_STAGES if bwd_smem_bytes(headdim, hdim_v, bwd_pass=bwd_pass) <= BWD_SMEM_BUDGET else 1


def bwd_tmem_map_2cta(cfg) -> dict:
    """TMEM columns of one CTA of a 2-CTA pair (hd128, FA4's pipelined 2-CTA map, BLACKWELL.md table):
    S 0-128, dV 128-256, dP 256-384, dK 384-512 as 1-CTA (each CTA's 128 lanes are its own keys:
    the M = 256 MMAs put M rows 128 v .. 128 v + 127 in CTA v), and

      dQ  = dS K, the pair's M = 128 MMA (each CTA: its tile_m / 2 queries x D, PTX data-path layout
            B: the two column halves folded onto lanes 0-63 / 64-127), D / 2 columns over S's tail:
            64-128. Written after both CTAs' compute warps read S(i+1) (the ds arrive comes after that
            load) and overwritten by S(i+2) only after the reduce warps read it (dq empty).
      P0, P1 = P^T, contiguous at S's start (0-32, 32-64: FA4's tmem_P_offset 0), so P stays clear of
            dQ; warpgroup 1's half lies in S columns warpgroup 0 reads, so the compute warpgroups
            sync (a named barrier) between reading S^T and writing P^T, as FA4 does.
      dS0, dS1 = dS^T inside each warpgroup's own dP^T columns (256-288, 320-352), as 1-CTA.

    The serial schedule ((192, 128), bwd_two_cta_serial; FA4's hd192 map, BLACKWELL.md table): dV 0-128,
    dK 128-320 (resident), S 320-448, dP 384-512 (the last tile_m columns: over S's second half, as the
    1-CTA serial map), dQ 416-512 (the last D / 2 columns: the pair's M = 128 dQ, each CTA's tile_m / 2
    query rows x D folded into D / 2 columns; inside dP, over S's last 32 columns and over dS1: written
    after dK read dS^T and the compute warps read dP^T (ds), S(i+1) waits for its read-out), P^T
    contiguous at S's start (320-352, 352-384: clear of dP and dQ), dS^T at the start of each
    warpgroup's own dP^T columns (384-416, 448-480)."""
    tm, d, dv = cfg.tile_m, cfg.headdim, cfg.hdim_v
    wgs = 2
    half = tm // wgs // 2
    if bwd_two_cta_serial(cfg):
        m = {"dV": (0, dv), "dK": (dv, d), "S": (dv + d, tm), "dP": (TMEM_COLUMNS - tm, tm),
             "dQ": (TMEM_COLUMNS - d // 2, d // 2)}
        for w in range(wgs):
            m[f"P{w}"] = (m["S"][0] + w * half, half)
            m[f"dS{w}"] = (m["dP"][0] + w * (tm // wgs), half)
        return m
    m = {"S": (0, tm), "dV": (tm, dv), "dP": (tm + dv, tm)}
    m["dK"] = (m["dP"][0] + tm, d)
    m["dQ"] = (tm - d // 2, d // 2)
    for w in range(wgs):
        m[f"P{w}"] = (w * half, half)
        m[f"dS{w}"] = (m["dP"][0] + w * (tm // wgs), half)
    return m


def bwd_tmem_aliases(cfg) -> tuple:
    """The overlaps the map declares, (inner, outer) with inner inside outer: dQ over dP always
    (D <= tile_m); where P^T / dS^T have no slot of their own (hd128) the P halves inside S and the
    dS halves inside dP, and then inside dQ's columns too (dQ is written after dK read dS^T)."""
    m = bwd_tmem_map(cfg)

    def inside(inner, outer):
        (si, ni), (so, no) = m[inner], m[outer]
        return so <= si and si + ni <= so + no

    if bwd_two_cta_serial(cfg):  # dQ inside dP; each half inside whichever of S, dP, dQ holds it
        return (("dQ", "dP"),) + tuple(
            (f"{x}{w}", o) for w in range(2) for x in ("P", "dS") for o in ("S", "dP", "dQ") if inside(f"{x}{w}", o))
    if getattr(cfg, "cta_group", 1) == 2:
        return (("dQ", "S"),) + tuple((f"{x}{w}", o) for w in range(2) for x, o in (("P", "S"), ("dS", "dP")))
    if bwd_pass(cfg) == "dv":  # P^T inside S
        return tuple((f"P{w}", "S") for w in range(2))
    if bwd_pass(cfg) == "dkdq":  # dQ over S and dP; dS^T inside dP (and so inside dQ)
        return (("S", "dQ"), ("dP", "dQ")) + tuple((f"dS{w}", o) for w in range(2) for o in ("dP", "dQ"))
    if bwd_serial_schedule(cfg):  # dQ over S and dP; each half inside whichever of them holds it
        return (("S", "dQ"), ("dP", "dQ")) + tuple(
            (f"{x}{w}", o) for w in range(2) for x in ("P", "dS") for o in ("S", "dP", "dQ") if inside(f"{x}{w}", o))
    pairs = [("dQ", "dP")]
    for w in range(2):
        pairs += [(inner, outer) for inner, outer in ((f"P{w}", "S"), (f"dS{w}", "dP"), (f"dS{w}", "dQ"))
                  if inside(inner, outer)]
    return tuple(pairs)


def bwd_tmem_used_cols(cfg) -> int:
    return max(start + n for start, n in bwd_tmem_map(cfg).values())


def bwd_tmem_alloc_cols(cfg) -> int:
    """Columns the MMA warp allocates: the used columns rounded up to a power of two >= 32 (512 for
    hd64 and hd128)."""
    cols = 32
    while cols < bwd_tmem_used_cols(cfg):
        cols *= 2
    return cols


# ---------------------------------------------------------------- pipelines and their arrive counts
def _arrivals(party: Party, cta_group: int = 1) -> int:
    """Arrivals `party` adds to one phase of one CTA's barrier (the forward's Party.arrivals rule with
    the backward's roles): a TMA expect_tx or a tcgen05.commit is 1 (in a pair: the leader's
    expect_tx counting both CTAs' bytes; the leader's commit multicast to both CTAs' barriers); an
    elected lane per warp, or every thread, times cta_group where the party arrives on the leader's
    barrier from both CTAs (to_leader)."""
    warps = BWD_ROLE_WARPS[party.role]
    if party.signal in (Signal.TMA, Signal.COMMIT):
        return 1
    pair = cta_group if party.to_leader else 1
    if party.signal is Signal.ELECTED:
        return warps * pair
    return WARP_SIZE * warps * pair


@dataclasses.dataclass(frozen=True)
class BwdPipelineSpec(PipelineSpec):
    """A PipelineSpec whose roles are the backward's (BWD_ROLE_WARPS)."""

    # cta_group None: the spec's own (as PipelineSpec; pipes.check_init_counts passes None)
    def full_arrivals(self, cta_group: int | None = None) -> int:
        g = self.cta_group if cta_group is None else cta_group
        return sum(_arrivals(p, g) for p in self.producers)

    def empty_arrivals(self, cta_group: int | None = None) -> int:
        g = self.cta_group if cta_group is None else cta_group
        return sum(_arrivals(p, g) for p in self.consumers)

    def describe(self, cta_group: int | None = None) -> str:
        g = self.cta_group if cta_group is None else cta_group

        def side(parties):
            return " + ".join(f"{p.role} ({p.signal.value}{' from both CTAs' if p.to_leader and g > 1 else ''}: "
                              f"{_arrivals(p, g)})" for p in parties)
        return (f"{self.name}: full = {side(self.producers)} = {self.full_arrivals(g)}; "
                f"empty = {side(self.consumers)} = {self.empty_arrivals(g)}")


def bwd_pipeline_specs(cfg) -> dict:
    """Every mbarrier pipeline of the backward, name -> BwdPipelineSpec (one CTA, or one pair, per key
    tile, never persistent: K, V and the dK / dV accumulators are used once per CTA). 2-CTA configs:
    bwd_pipeline_specs_2cta."""
    if getattr(cfg, "cta_group", 1) == 2:
        return bwd_pipeline_specs_2cta(cfg)
    P = Party
    S = BwdPipelineSpec
    specs = [
        S("kv", 1, (P("load", Signal.TMA),), (P("mma", Signal.COMMIT),),
          "K and V of the CTA's key tile, once; never released (one tile per CTA)", waited_empty=False),
        S("q", cfg.q_stages, (P("load", Signal.TMA),), (P("mma", Signal.COMMIT),),
          "Q[m]: read by S^T = K Q^T and dK += dS^T Q; released by the commit after dK"),
        S("lse", cfg.q_stages, (P("load", Signal.TMA),), (P("compute", Signal.ELECTED),),
          "LSE * log2 e of Q[m]'s rows (bulk copy) -> compute (P = exp2(S^T c - lse))"),
        S("do", cfg.do_stages, (P("load", Signal.TMA),), (P("mma", Signal.COMMIT),),
          "dO[m]: read by dP^T = V dO^T and dV += P^T dO; released by the commit after dV"),
        S("dpsum", cfg.do_stages, (P("load", Signal.TMA),), (P("compute", Signal.ELECTED),),
          "D = rowsum(dO * O) of dO[m]'s rows (bulk copy) -> compute (dS = P (dP - D))"),
        S("s", 1, (P("mma", Signal.COMMIT),), (P("compute", Signal.ELECTED),),
          "S^T ready -> compute; P^T written to TMEM -> mma (dV += P^T dO)"),
        S("dp", 1, (P("mma", Signal.COMMIT),), (P("compute", Signal.ELECTED),),
          "dP^T ready -> compute; back-pressure is ds (dS written means dP was read)", waited_empty=False),
        S("ds", 1, (P("compute", Signal.ELECTED),), (P("mma", Signal.COMMIT),),
          "dS^T written (TMEM and smem) -> mma (dK, dQ); released by the commit after dQ"),
        S("dq", 1, (P("mma", Signal.COMMIT),), (P("reduce", Signal.ELECTED),),
          "dQ ready in TMEM -> reduce; read out -> mma (the next dP^T overwrites dQ's columns)"),
        S("dkv", 1, (P("mma", Signal.COMMIT),), (P("compute", Signal.ELECTED),),
          "the tile's dV and dK are final -> compute epilogue (never released: one tile per CTA)",
          waited_empty=False),
    ]
    if bwd_pass(cfg) == "dkdq":
        # V and dO stream through the do ring in BWD_VDO_COLS-column chunks (dP^T only); K alone on kv
        specs = [dataclasses.replace(s, note=BWD_PASS_DKDQ_NOTE.get(s.name, s.note)) for s in specs]
    if bwd_pass(cfg) == "dv":
        # S^T and dV only: no dP^T, dS^T, dQ; K alone on kv (V is not read); dO read by dV alone
        drop = ("dpsum", "dp", "ds", "dq")
        specs = [dataclasses.replace(s, note=BWD_PASS_DV_NOTE.get(s.name, s.note)) for s in specs if s.name not in drop]
    return {s.name: s for s in specs}


BWD_PASS_DKDQ_NOTE = {
    "kv": "K of the CTA's key tile, once (pass dkdq: V streams through the do ring); never released",
    "do": "pass dkdq: chunk c of V (the key tile's) and of dO[m] (BWD_VDO_COLS columns each), the A and B "
          "of dP^T's k-blocks of that chunk; released by the commit after them",
    "s": "S^T ready -> compute; S^T read -> mma (pass dkdq: P^T stays in registers)",
    "dkv": "the tile's dK is final -> compute epilogue (pass dkdq; never released)",
}

BWD_PASS_DV_NOTE = {
    "kv": "K of the CTA's key tile, once (pass dv: V is not read); never released",
    "q": "Q[m]: read by S^T = K Q^T; released by the commit after S^T (pass dv)",
    "dkv": "the tile's dV is final -> compute epilogue (pass dv; never released)",
}


def bwd_pipeline_specs_2cta(cfg) -> dict:
    """The pipelines of one CTA of a 2-CTA pair (counts per barrier of one CTA; where only the
    leader's barrier is waited on, the leader's). The leader's MMA warp issues every MMA of the pair;
    its tcgen05.commit is multicast to both CTAs' barriers; the thread parties that release what an
    MMA reads or report what it waits for arrive on the leader's barrier from both CTAs (to_leader);
    TMA: the leader's load warp expects both CTAs' bytes, each CTA's .cta_group::2 TMA completes its
    half on the leader's barrier. Two pipelines are new: dsx (per CTA: the peer's compute thread
    arrives with expect_tx on this CTA's barrier and its bulk copy over DSMEM completes the bytes:
    the peer's half of dS landed here; waited by this CTA's relay warp) and relay (the leader's:
    both CTAs' relay warps arrive once per step; the MMA warp waits before dQ = dS K)."""
    P = Party
    g = 2

    def S(*a, **kw):
        return BwdPipelineSpec(*a, cta_group=g, **kw)

    T = Signal.TMA
    specs = [
        S("kv", 1, (P("load", T),), (P("mma", Signal.COMMIT),),
          "K, V (A of S^T, dP^T) and K^T (B of dQ: D / 2 x the pair's keys) once; never released",
          waited_empty=False),
        S("q", cfg.q_stages, (P("load", T),), (P("mma", Signal.COMMIT),),
          "Q[m] (B of S^T: tile_m / 2 queries x D per CTA); released by the commit after S^T"),
        S("qt", cfg.q_stages, (P("load", T),), (P("mma", Signal.COMMIT),),
          "Q^T[m] (B of dK: D / 2 x tile_m queries per CTA); released by the commit after dK"),
        S("lse", cfg.q_stages, (P("load", T),), (P("compute", Signal.ELECTED),),
          "LSE * log2 e of Q[m]'s rows (bulk copy, CTA-local: each CTA's compute sees all tile_m queries)"),
        S("do", cfg.do_stages, (P("load", T),), (P("mma", Signal.COMMIT),),
          "dO[m] (B of dP^T) and dO^T[m] (B of dV) on one barrier; released by the commit after dV"),
        S("dpsum", cfg.do_stages, (P("load", T),), (P("compute", Signal.ELECTED),),
          "D = rowsum(dO * O) of dO[m]'s rows (bulk copy, CTA-local)"),
        S("s", 1, (P("mma", Signal.COMMIT),), (P("compute", Signal.ELECTED, True),),
          "S^T ready -> compute (both CTAs); P^T written -> the leader's MMA (dV)"),
        S("dp", 1, (P("mma", Signal.COMMIT),), (P("compute", Signal.ELECTED, True),),
          "dP^T ready -> compute; dS^T written to TMEM (both CTAs) -> the leader's MMA (dK)"),
        S("ds", 1, (P("compute", Signal.ELECTED, True),), (P("mma", Signal.COMMIT),),
          "dS^T(i) in smem (own half; the peer's half sent) and S^T(i+1) read out of TMEM (dQ lies over "
          "S's tail) -> the leader's MMA (dQ); released by the commit after dQ (both CTAs' dS smem free)"),
        S("dq", 1, (P("mma", Signal.COMMIT),), (P("reduce", Signal.ELECTED, True),),
          "dQ ready -> reduce; read out (both CTAs) -> the leader's MMA (S^T(i+2) overwrites dQ's columns)"),
        S("dkv", 1, (P("mma", Signal.COMMIT),), (P("compute", Signal.ELECTED),),
          "dV and dK final -> compute epilogue (never released)", waited_empty=False),
        S("dsx", 1, (P("compute", T),), (P("relay", Signal.ELECTED),),
          "the peer's half of dS^T landed in this CTA's dS smem (the peer's compute thread 0: "
          "arrive.expect_tx on this barrier + cp.async.bulk.shared::cluster completing the bytes) -> relay; "
          "back-pressure is ds (the sender waits for dQ(i-1), which read both CTAs' dS)", waited_empty=False),
        S("relay", 1, (P("relay", Signal.ELECTED, True),), (P("mma", Signal.COMMIT),),
          "both CTAs hold their whole dS (own half + the peer's) -> the leader's MMA (dQ); back-pressure "
          "is dsx / ds", waited_empty=False),
    ]
    if bwd_two_cta_shared_rings(cfg):  # (192, 128): Q^T through the q ring, dO^T through the do ring
        note = {"q": "Q[m] (B of S^T; released by the commit after S^T), then Q^T[m] in the same stage (B of dK: "
                     "D / 2 x tile_m queries per CTA; released by the commit after dK): two uses per step",
                "do": "dO[m] (B of dP^T; released by the commit after dP^T), then dO^T[m] in the same stage (B of dV; "
                      "released by the commit after dV): two uses per step",
                "ds": "dS^T(i) in smem (own half; the peer's half sent) -> the leader's MMA (dQ; the serial order "
                      "issues S(i+1) after dQ(i) was read out, so nothing else waits); released by the commit "
                      "after dQ (both CTAs' dS smem free)"}
        specs = [dataclasses.replace(s, note=note.get(s.name, s.note)) for s in specs if s.name != "qt"]
    return {s.name: s for s in specs}
