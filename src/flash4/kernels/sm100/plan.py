"""The sm100 forward's plan, as pure functions the kernel is built from and CPU tests check: warp
roles, shared-memory budget, the register plan (setmaxnreg per role), the tensor-memory map and
the pipeline specs (who produces, who consumes, how each signals: the mbarrier arrive counts).

Pure Python (no torch, no CuTe DSL): the kernel (flash4.kernels.sm100.fwd, pipes) reads its TMEM
offsets, setmaxnreg budgets and arrive counts only from here; flash4.config.sm100 (the config class
and selection) builds configs with it. Numbers are read from flash-attn-4's sm100 forward
(BLACKWELL.md section 1) or derived from hardware limits; none was measured on a B200.
Compile-verified, not run on hardware.
"""

from __future__ import annotations

import dataclasses
import enum

from flash4.arch import capacity

ARCH = 100

# ---------------------------------------------------------------- warp roles (16 warps, 512 threads)
WARP_SIZE = 32
# warp ids of each role (FA4 flash_fwd_sm100.py:312-318). A warp may tcgen05.ld/st only the 32 TMEM
# lanes of its index in its warpgroup (warp_idx % 4), so every TMEM-reading role is one whole
# warpgroup: softmax0 (Q tile 0, S0/P0), softmax1 (Q tile 1, S1/P1), correction (O0, O1).
WARP_ROLES = {
    "softmax0": (0, 1, 2, 3),
    "softmax1": (4, 5, 6, 7),
    "correction": (8, 9, 10, 11),
    "mma": (12,),
    "epilogue": (13,),
    "load": (14,),
    "idle": (15,),
}
NUM_WARPS = 16
NUM_THREADS = NUM_WARPS * WARP_SIZE
# setmaxnreg works per warpgroup; the fourth warpgroup (mma, epilogue, load, idle) shares one budget.
WARPGROUPS = (("softmax0",), ("softmax1",), ("correction",), ("mma", "epilogue", "load", "idle"))
# Register file per SM / threads per CTA: the count every warp starts with (cuobjdump's REG:128).
LAUNCH_REGS = 65536 // NUM_THREADS
# TMEM: 128 lanes x 512 columns of 32 bits (flash4.arch.CAPS[100].tmem_bytes).
TMEM_COLUMNS = capacity(ARCH).tmem_bytes // (128 * 4)
# FA4's KV-stage budget (flash_fwd_sm100.py:426): Q, O and the K/V ring share 224 KiB of smem
# (the rest of 227 KiB: mbarriers, the TMEM pointer, the softmax stats).
SMEM_KV_BUDGET = 224 * 1024
MAX_KV_STAGES = 32

# ---------------------------------------------------------------- exp2: MUFU.EX2 and the FMA polynomial
# Share of each score row's exp2 done by the packed-f32x2 polynomial (flash4.kernels.common.exp2_poly)
# instead of MUFU.EX2, chosen statically per column pair: 1 pair of every 4 (FA4 emulates 8 of every
# 32 columns where it emulates, its hd128 ex2_emu_freq 16). On a B200 MUFU (16 ex2/clk/SM) bounds the
# softmax, not the tensor core; the share is FA4's tuning, not measured here (no Blackwell GPU).
# The numerics model (flash4.models.sm100_fwd) defaults to it; its error bands were measured there.
EXP2_EMU_FRAC = 0.25
# Causal and windowed configs: 1 pair of every 8. At 1/4 the masked non-first step (mask + rescale +
# polynomial in one body: the causal diagonal, every block of a window) spilled at FA4's softmax
# budgets: hd128 causal (192 registers) 11 LDL/STL, stack 40 bytes; hd64 causal (200) 3, stack 8;
# hd64 window 14. At 1/8 every such config compiles with 0 (CuTe DSL 4.8.1, 2026-12-02).
EXP2_EMU_FRAC_CAUSAL = 0.125
# Columns that share one choice: a packed f32x2 pair (exp2_emulated_pair works on two lanes).
EXP2_EMU_GROUP = 2


def fwd_smem_bytes(headdim: int, hdim_v: int, q_stage: int, tile_m: int, tile_n: int, kv_stages: int,
                   elt: int = 2, cta_group: int = 1) -> int:
    """Shared memory of one CTA's tiles: q_stage Q tiles and q_stage O tiles of tile_m rows, and
    kv_stages K/V blocks. In a 2-CTA pair (cta_group 2) each CTA holds half of every K/V block (the
    MMA's B operand is split along N: K's tile_n / 2 keys, V's dv / 2 columns; FA4 :397)."""
    q = q_stage * tile_m * headdim * elt
    o = q_stage * tile_m * hdim_v * elt
    kv_stage = tile_n * max(headdim, hdim_v) * elt // cta_group
    return q + o + kv_stages * kv_stage


def exp2_emu_frac_for(causal: bool, local: bool = False, cta_group: int = 1) -> float:
    """The share of exp2 on the FMA polynomial a config gets (EXP2_EMU_FRAC, or _CAUSAL for causal
    and windowed configs, whose masked non-first step holds the most registers, and for 2-CTA
    configs: at their 184 softmax registers, FA4's 2-CTA budget, 1/4 spilled 2 LDL + 2 STL in the
    hd128 softmax; 1/8 compiles with 0, CuTe DSL 4.8.1)."""
    return EXP2_EMU_FRAC_CAUSAL if causal or local or cta_group == 2 else EXP2_EMU_FRAC


def kv_stages_for(headdim: int, hdim_v: int, q_stage: int = 2, tile_m: int = 128, tile_n: int = 128,
                  cta_group: int = 1) -> int:
    """FA4's K/V ring depth: as many K/V blocks as fit next to Q and O in 224 KiB, at most 32
    (hd64: 10, hd96: 5, hd128: 3; hd128 2-CTA: 6, each CTA holding half of a block; q_stage 1:
    (192, 128) 3, hd256 1). A block takes max(D, Dv) columns: K and V share the ring."""
    q_o = fwd_smem_bytes(headdim, hdim_v, q_stage, tile_m, tile_n, 0)
    return min((SMEM_KV_BUDGET - q_o) // (tile_n * max(headdim, hdim_v) * 2 // cta_group), MAX_KV_STAGES)


# Q tiles per CTA by head dims (D, Dv). q_stage 2 (two 128-row Q tiles, softmax0 and softmax1) up to
# D = 128; q_stage 1 (one Q tile, softmax1's warpgroup idle) above: hd256 as FA4 (interface.py:389 of
# 4.0.0b36); (192, 128) too, where FA4 keeps q_stage 2 by overlapping sO with sQ and an uneven K/V
# ring (flash_fwd_sm100.py :248, :402): without those (not built here), q_stage 2 leaves room for one
# K/V block (96 + 64 KiB of Q and O), and the MMA warp's order (PV_0, then wait K[j], then PV_1 and
# release V) needs two. q_stage 1 gives (192, 128) three.
Q_STAGE_1_MIN_HEADDIM = 192


def q_stage_for(headdim: int, hdim_v: int) -> int:
    """Q tiles per CTA (see Q_STAGE_1_MIN_HEADDIM)."""
    return 1 if max(headdim, hdim_v) >= Q_STAGE_1_MIN_HEADDIM else 2


# ---------------------------------------------------------------- registers (setmaxnreg)
# Budget of softmax1's idle warpgroup with q_stage 1: setmaxnreg's minimum, so the others get its
# registers (the MMA warp's share: see default_register_plan).
IDLE_REGS = 24


@dataclasses.dataclass(frozen=True)
class RegisterPlan:
    """setmaxnreg budget per role (registers per thread). softmax: each softmax warpgroup;
    correction: the correction warpgroup; other: the warpgroup of the mma, epilogue, load and idle
    warps. Every warp starts at LAUNCH_REGS; a budget above it is a setmaxnreg.inc, below it a .dec.
    softmax_warpgroups: the config's q_stage; with 1, softmax1's warpgroup is idle and decreases to
    IDLE_REGS (FA4 moves its warps to the empty warps)."""

    softmax: int
    correction: int
    other: int
    softmax_warpgroups: int = 2

    def per_warpgroup(self) -> tuple:
        """Budgets of the four warpgroups in WARPGROUPS order."""
        second = self.softmax if self.softmax_warpgroups == 2 else IDLE_REGS
        return (self.softmax, second, self.correction, self.other)

    def by_role(self) -> dict:
        return {"softmax0": self.softmax, "softmax1": self.per_warpgroup()[1], "correction": self.correction,
                "mma": self.other, "epilogue": self.other, "load": self.other, "idle": self.other}

    @staticmethod
    def is_increase(regs: int) -> bool:
        """setmaxnreg.inc (True) or .dec (False) from LAUNCH_REGS; equal counts as .dec."""
        return regs > LAUNCH_REGS

    def setmaxnreg_sites(self) -> list:
        """The kernel's setmaxnreg instructions as sorted ("inc" | "dec", registers): one site per
        budget (the softmax warpgroups share one code path; with one Q tile the idle softmax1
        warpgroup has its own), as the compiled PTX must show them."""
        budgets = [self.softmax, self.correction, self.other] + ([IDLE_REGS] if self.softmax_warpgroups == 1 else [])
        return sorted(("inc" if self.is_increase(r) else "dec", r) for r in budgets)


def register_plan_problem(plan: RegisterPlan) -> str | None:
    if plan.softmax_warpgroups not in (1, 2):
        return f"softmax_warpgroups={plan.softmax_warpgroups}: 1 or 2 (the config's q_stage)"
    for role, regs in (("softmax", plan.softmax), ("correction", plan.correction), ("other", plan.other)):
        if regs % 8 or not 24 <= regs <= 256:
            return f"regs_{role}={regs}: setmaxnreg takes a multiple of 8 in [24, 256]"
    total = sum(plan.per_warpgroup())
    if total > 512:
        return (f"register plan {plan}: warpgroup budgets sum to {total} > 512 (64K registers / 128 threads "
                "per warpgroup)")
    return None


def register_plan(cfg) -> RegisterPlan:
    """The config's setmaxnreg budgets (what the kernel's setmaxregister_increase/decrease take)."""
    return RegisterPlan(cfg.regs_softmax, cfg.regs_correction, cfg.regs_other, cfg.q_stage)


def default_register_plan(headdim: int, causal: bool, cta_group: int = 1, hdim_v: int | None = None) -> RegisterPlan:
    """FA4's budgets for its forward (flash_fwd_sm100.py:380-403, _TUNING_CONFIG :103), tuned by
    FA4 on B200 (not measured here): hd < 96: 200/64/48; hd128 causal: 192/72 (_TUNING_CONFIG);
    hd128 2-CTA: 184/80/64; otherwise 192/80. "other" takes what is left of 512 per 4 warpgroups,
    rounded down to 8 and capped at LAUNCH_REGS (setmaxnreg.dec may not exceed the launch count).
    q_stage 1 ((192, 128), hd256): FA4's hd256 softmax budget 256 (BLACKWELL.md section 1, from FA4's
    2-CTA hd256 tuning: FA4 has no 1-CTA one), the correction 152 (FA4's 160 less 8), the idle softmax1
    warpgroup IDLE_REGS and the other warps the rest, 80: 256 + 24 + 152 + 80 = 512. Measured on the
    CPU compile (CuTe DSL 4.8.1): at FA4's 48 the hd256 MMA warp spilled its 16 QK^T k-step descriptors
    (19 LDL / 17 STL); at 256 / 160 / 72 hd256 with window + softcap + sink spilled 5 LDL/STL (stack 8);
    at 256 / 152 / 80 every q_stage 1 config compiles with 0."""
    dv = headdim if hdim_v is None else hdim_v
    if q_stage_for(headdim, dv) == 1:
        return RegisterPlan(256, 152, 80, softmax_warpgroups=1)
    if cta_group == 2 and headdim == 128 and not causal:
        return RegisterPlan(184, 80, 64)
    if headdim < 96:
        return RegisterPlan(200, 64, 48)
    softmax, correction = (192, 72) if (headdim == 128 and causal) else (192, 80)
    other = min((512 - 2 * softmax - correction) // 8 * 8, LAUNCH_REGS)
    return RegisterPlan(softmax, correction, other)


# ---------------------------------------------------------------- tensor memory
# S buffers the TMEM map reserves before O whatever q_stage (FA4 tmem_s_offset = [0, tile_n]).
S_BUFFERS = 2

def tmem_map(cfg) -> dict:
    """TMEM columns of every buffer: name -> (start_col, ncols), 32-bit columns, all 128 lanes.

    S_i (q_stage of them): fp32 scores of Q tile i, tile_n columns at tile_n * i.
    O_i: fp32 output accumulator of Q tile i, Dv columns at 2 * tile_n + i * Dv (FA4 places O after
         two S buffers whatever q_stage: with q_stage 1, columns tile_n .. 2 tile_n stay unused and
         hd256's O0 ends at column 512, FA4's map).
    P_i: 16-bit probabilities of Q tile i, packed two per column, in the upper half of S_i
         (tile_n / 2 columns at S_i + tile_n / 2; FA4 tmem_s_to_p_offset): the PV MMA reads P_i from
         TMEM while the softmax is done with S_i's columns. Declared aliases: P_i inside S_i only.
    This is the kernel's only source of TMEM offsets (flash4.kernels.sm100.fwd)."""
    s_cols, dv = cfg.tile_n, cfg.hdim_v
    m = {}
    for i in range(cfg.q_stage):
        m[f"S{i}"] = (i * s_cols, s_cols)
    for i in range(cfg.q_stage):
        m[f"O{i}"] = (S_BUFFERS * s_cols + i * dv, dv)
    for i in range(cfg.q_stage):
        m[f"P{i}"] = (i * s_cols + s_cols // 2, s_cols // 2)
    return m


# Buffers allowed to overlap: (inner, outer), inner inside outer (P1 / S1 exist with q_stage 2 only).
TMEM_ALIASES = (("P0", "S0"), ("P1", "S1"))


def tmem_used_cols(cfg) -> int:
    return max(start + n for start, n in tmem_map(cfg).values())


def tmem_alloc_cols(cfg) -> int:
    """Columns the MMA warp allocates (tcgen05.alloc): the used columns rounded up to a power of two,
    at least 32 (the instruction's rule). 512 for every forward config ((192, 128) uses 384)."""
    cols = 32
    while cols < tmem_used_cols(cfg):
        cols *= 2
    return cols


# ---------------------------------------------------------------- pipelines and their arrive counts
class Signal(enum.Enum):
    """How one party arrives on an mbarrier."""

    TMA = "TMA"  # one elected thread: mbarrier.arrive.expect_tx, the TMA unit completes the bytes
    COMMIT = "tcgen05.commit"  # one elected thread: tcgen05.commit.mbarrier::arrive::one
    ELECTED = "elected lane"  # one elected lane per warp
    ALL_THREADS = "all threads"  # every thread of every warp of the role


# Warps of each party role. "softmax" is the softmax warpgroup of the pipeline stage's Q tile
# (softmax0 on stage 0, softmax1 on stage 1): the per-Q-tile pipelines have one stage per Q tile.
ROLE_WARPS = {**{role: len(w) for role, w in WARP_ROLES.items()}, "softmax": len(WARP_ROLES["softmax0"])}


@dataclasses.dataclass(frozen=True)
class Party:
    """A role arriving on one side of a pipeline: its name (ROLE_WARPS) and how it signals.

    to_leader: in a 2-CTA pair, this party's threads in both CTAs arrive on the leader CTA's barrier
    (the thread side of a pipeline bridging to the pair's one MMA thread: FA4's
    softmax_correction_threads_cluster; the DSL's PipelineUmmaAsync routes consumer releases to the
    leader, peer rank // 2 * 2). Other thread parties arrive on their own CTA's barrier."""

    role: str
    signal: Signal
    to_leader: bool = False

    def arrivals(self, cta_group: int = 1) -> int:
        """Arrivals this party adds to one phase of one CTA's barrier.

        TMA: 1, the elected thread's mbarrier.arrive.expect_tx. In a pair only the leader's load warp
        arrives (PipelineTmaUmma.producer_acquire), on the leader's barrier, expecting both CTAs'
        bytes (tx x cta_group: the peer's .cta_group::2 TMA completes on the leader's barrier).
        tcgen05.commit: 1 per barrier; in a pair the leader's commit is multicast (one arrival on the
        barrier of each CTA of the mask). Elected lanes: one per warp; all threads: 32 per warp;
        times cta_group where the party arrives to_leader."""
        warps = ROLE_WARPS[self.role]
        if self.signal in (Signal.TMA, Signal.COMMIT):
            return 1
        pair = cta_group if self.to_leader else 1
        if self.signal is Signal.ELECTED:
            return warps * pair
        return WARP_SIZE * warps * pair


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """One mbarrier pipeline: `full` is arrived by the producers and waited on by the consumers,
    `empty` the other way round. stages: barriers per side (per_q_tile: stage i belongs to Q tile
    i, used once per key block or per tile). waited_empty False: the empty side is never waited on
    (back-pressure comes from another pipeline, named in `note`), so its consumers do not arrive.
    cta_group: the config's (2: a CTA pair; the counts are those of one CTA's barrier, the leader's
    where only the leader's is used)."""

    name: str
    stages: int
    producers: tuple
    consumers: tuple
    note: str = ""
    waited_empty: bool = True
    per_q_tile: bool = False
    cta_group: int = 1

    def full_arrivals(self, cta_group: int | None = None) -> int:
        g = self.cta_group if cta_group is None else cta_group
        return sum(p.arrivals(g) for p in self.producers)

    def empty_arrivals(self, cta_group: int | None = None) -> int:
        g = self.cta_group if cta_group is None else cta_group
        return sum(p.arrivals(g) for p in self.consumers)

    def describe(self, cta_group: int | None = None) -> str:
        g = self.cta_group if cta_group is None else cta_group

        def side(parties):
            return " + ".join(f"{p.role} ({p.signal.value}{' from both CTAs' if p.to_leader and g > 1 else ''}: "
                              f"{p.arrivals(g)})" for p in parties)
        return (f"{self.name}: full = {side(self.producers)} = {self.full_arrivals(g)}; "
                f"empty = {side(self.consumers)} = {self.empty_arrivals(g)}")


def tma_tx_bytes(cfg, bytes_per_cta: int) -> int:
    """The tx count a TMA pipeline's full barrier expects per stage: one CTA's bytes, times
    cta_group (in a pair the leader's barrier counts both CTAs' halves; FA4 :627)."""
    return bytes_per_cta * cfg.cta_group


def pipeline_specs(cfg) -> dict:
    """Every mbarrier pipeline of the forward, name -> PipelineSpec. The kernel builds each pipeline
    from its own role table, asserts at trace time that the DSL's mbarrier init counts equal
    full_arrivals / empty_arrivals, and records which roles arrive where (kernels/sm100/pipes.py):
    a mismatch, a hang on hardware, is a compile error here."""
    P = Party
    q = cfg.q_stage
    g = cfg.cta_group
    specs = [
        PipelineSpec("q", q, (P("load", Signal.TMA),), (P("mma", Signal.COMMIT),),
                     "the CTA tile's q_stage Q tiles; released by the MMA warp after the tile's last QK^T",
                     cta_group=g),
        PipelineSpec("kv", cfg.kv_stages, (P("load", Signal.TMA),), (P("mma", Signal.COMMIT),),
                     "K and V blocks in one ring, in the MMA's order K[n-1] V[n-1] K[n-2] V[n-2] ...",
                     cta_group=g),
        # MMA commits "S_i ready" after QK^T; the softmax releases "P_i written" and the correction
        # "O_i rescaled (or read out)": the MMA waits for both before PV_i (FA4 pipeline_s_p_o).
        PipelineSpec("s_p_o", q, (P("mma", Signal.COMMIT),),
                     (P("softmax", Signal.ALL_THREADS, True), P("correction", Signal.ALL_THREADS, True)),
                     "S_i ready -> softmax_i; P_i written + O_i rescaled -> MMA (PV_i)", per_q_tile=True, cta_group=g),
        # softmax -> correction: the row's O rescale factor (blocks 1..n-1), then 1 / row_sum.
        PipelineSpec("sm_stats", q, (P("softmax", Signal.ALL_THREADS),), (P("correction", Signal.ALL_THREADS),),
                     "per-row factor for O_i through smem sScale[:, i] (CTA-local)", per_q_tile=True, cta_group=g),
        # MMA -> correction: the tile's last PV_i is complete.
        PipelineSpec("o_full", q, (P("mma", Signal.COMMIT),), (P("correction", Signal.ALL_THREADS, True),),
                     "back-pressure on O_i is s_p_o (the correction releases it after reading O_i)",
                     waited_empty=False, per_q_tile=True, cta_group=g),
        PipelineSpec("corr_epi", q, (P("correction", Signal.ALL_THREADS),), (P("epilogue", Signal.ELECTED),),
                     "O_i staged in smem sO[i] -> TMA store; released once the store has read sO[i] (CTA-local)",
                     per_q_tile=True, cta_group=g),
    ]
    return {s.name: s for s in specs}
