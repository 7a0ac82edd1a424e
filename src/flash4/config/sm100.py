"""The sm100 (Blackwell B200, sm_100a) family's forward configuration and the pure plans its kernel
is built from: warp roles, the tensor-memory map, the register plan and the pipeline arrive counts.

Status: compile-verified, not run on hardware. Every number below is either read from
flash-attn-4's sm100 forward (cited as FA4, /work/shared/design/BLACKWELL.md section 1) or derived
from hardware limits; none was measured on a B200. The kernel (flash4.kernels.sm100.fwd) reads its
TMEM offsets, setmaxnreg budgets and mbarrier arrive counts only from here, and CPU tests check these
functions and the compiled PTX/SASS against each other (tests/cpu/test_sm100_*.py).

Everything here is pure Python (no torch, no CuTe DSL). The family is registered in
flash4.kernels.registry as "sm100" (arch 100 only), marked unverified: the API does not select it
until a hardware self-test gates it.
"""

from __future__ import annotations

import dataclasses
import enum

from flash4.arch import capacity
from flash4.config import HDIMV_PAIRS, SUPPORTED_HEADDIMS, FwdPlan
from flash4.constants import DTYPES, RESCALE_THRESHOLD_LOG2

ARCH = 100
# Head dims the sm100 forward has (FA4's 1-CTA forward runs these with q_stage 2; 192/256 need
# q_stage 1 or 2-CTA, BLACKWELL.md R5: not built yet).
SM100_FWD_HEADDIMS = (64, 96, 128)

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


@dataclasses.dataclass(frozen=True)
class Sm100FwdConfig:
    """One compiled sm100 forward kernel (the compile-cache key).

    headdim:       D of Q/K/V (64, 96, 128).
    dtype:         "bf16" or "fp16" (Q, K, V, O, and P in TMEM).
    causal:        bottom-right aligned causal mask; only the key blocks that cross the diagonal
                   (and the seqlen_k edge) are masked; LPT tile order.
    q_stage:       Q tiles per CTA (2: softmax warpgroups 0 and 1 each own one 128-row tile).
    kv_stages:     depth of the K/V TMA ring (K and V blocks take alternate stages).
    tile_m:        query rows per Q tile = TMEM lanes (128); a CTA covers q_stage * tile_m rows
                   (cta_tile_m): the host's grid counts CTA tiles of cta_tile_m rows.
    tile_n:        key rows per K/V block = S columns in TMEM (128).
    cta_group:     1 (tcgen05 .cta_group::1); 2-CTA is not built.
    regs_softmax / regs_correction / regs_other: setmaxnreg budgets per role (register_plan).
    exp2_emu_frac: share of exp2 done by the FMA polynomial; only 0 (all MUFU.EX2) is built.
    rescale_threshold: lazy-rescale tau in log2 units (flash4.constants).
    persistent, lpt: the tile order (flash4.kernels.common.scheduler.TileSchedule); lpt = causal.
    arch:          100 (sm_100a).
    The remaining fields mirror flash4.config.FwdConfig so the host can pass the same keys; the
    sm100 kernel implements none of them yet and a config with any of them set cannot be built
    (ValueError in __post_init__): varlen_q, varlen_k, seqused_q, seqused_k, page_rows, split_kv,
    local, softcap, sink, headdim_v, pack_gqa.
    """

    headdim: int
    dtype: str = "bf16"
    causal: bool = False
    q_stage: int = 2
    kv_stages: int = 3
    tile_m: int = 128
    tile_n: int = 128
    cta_group: int = 1
    regs_softmax: int = 192
    regs_correction: int = 80
    regs_other: int = 48
    exp2_emu_frac: float = 0.0
    rescale_threshold: float = RESCALE_THRESHOLD_LOG2
    persistent: bool = False
    lpt: bool = False
    arch: int = ARCH
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    page_rows: int = 0
    split_kv: bool = False
    local: bool = False
    softcap: bool = False
    sink: bool = False
    headdim_v: int | None = None
    pack_gqa: int = 1

    def __post_init__(self):
        problem = config_problem(self)
        if problem is not None:
            raise ValueError(f"sm100 forward config {self}: {problem}")

    @property
    def hdim_v(self) -> int:
        """Dv: the head dim of V and O (= headdim: Dv != D is not built)."""
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def cta_tile_m(self) -> int:
        """Query rows per CTA tile (q_stage Q tiles of tile_m rows)."""
        return self.q_stage * self.tile_m

    @property
    def num_threads(self) -> int:
        return NUM_THREADS

    def smem_bytes(self) -> int:
        """Dynamic shared memory of Q (q_stage tiles), O staging (q_stage tiles) and the K/V ring
        (bytes, without mbarriers and the softmax stats)."""
        return fwd_smem_bytes(self.headdim, self.hdim_v, self.q_stage, self.tile_m, self.tile_n, self.kv_stages)


# Feature flags a config may carry and the sm100 kernel does not implement (field -> its "off" value).
_UNBUILT_FLAGS = {
    "varlen_q": False, "varlen_k": False, "seqused_q": False, "seqused_k": False, "page_rows": 0,
    "split_kv": False, "local": False, "softcap": False, "sink": False, "headdim_v": None, "pack_gqa": 1,
}


def config_problem(cfg: Sm100FwdConfig) -> str | None:
    """Why `cfg` cannot be built by the sm100 forward, or None."""
    if cfg.arch != ARCH:
        return f"arch={cfg.arch}; the sm100 family is sm_100a only (sm_103/110/120 are different GPUs)"
    if cfg.headdim not in SM100_FWD_HEADDIMS:
        return f"headdim={cfg.headdim} not built on sm100; built: {SM100_FWD_HEADDIMS}"
    if cfg.dtype not in DTYPES:
        return f"dtype={cfg.dtype!r}; allowed: {DTYPES}"
    on = [f for f, off in _UNBUILT_FLAGS.items() if getattr(cfg, f) != off and not
          (f == "headdim_v" and cfg.headdim_v == cfg.headdim)]
    if on:
        return f"{', '.join(on)} not implemented by the sm100 forward yet"
    if cfg.headdim_v is not None:
        return "headdim_v must be None (canonical) when it equals headdim"
    if (cfg.q_stage, cfg.tile_m, cfg.tile_n, cfg.cta_group) != (2, 128, 128, 1):
        return (f"(q_stage, tile_m, tile_n, cta_group)=({cfg.q_stage}, {cfg.tile_m}, {cfg.tile_n}, {cfg.cta_group}); "
                "only (2, 128, 128, 1) is built (1-CTA, two 128-row Q tiles, 128-key blocks)")
    if cfg.exp2_emu_frac != 0.0:
        return (f"exp2_emu_frac={cfg.exp2_emu_frac}; only 0 (MUFU.EX2) is built: the packed f32x2 polynomial is "
                "a hook in kernels/sm100/softmax.py, not implemented")
    if cfg.persistent:
        return "persistent=True is not built (one CTA per tile)"
    if cfg.lpt != cfg.causal:
        return f"lpt={cfg.lpt} with causal={cfg.causal}; the sm100 forward orders causal tiles LPT (lpt == causal)"
    if not 1 <= cfg.kv_stages <= MAX_KV_STAGES or cfg.smem_bytes() > SMEM_KV_BUDGET:
        return f"kv_stages={cfg.kv_stages}: {cfg.smem_bytes()} bytes of smem > {SMEM_KV_BUDGET}"
    plan_problem = register_plan_problem(RegisterPlan(cfg.regs_softmax, cfg.regs_correction, cfg.regs_other))
    if plan_problem is not None:
        return plan_problem
    return None


def fwd_smem_bytes(headdim: int, hdim_v: int, q_stage: int, tile_m: int, tile_n: int, kv_stages: int,
                   elt: int = 2) -> int:
    q = q_stage * tile_m * headdim * elt
    o = q_stage * tile_m * hdim_v * elt
    kv_stage = tile_n * max(headdim, hdim_v) * elt
    return q + o + kv_stages * kv_stage


def kv_stages_for(headdim: int, hdim_v: int, q_stage: int = 2, tile_m: int = 128, tile_n: int = 128) -> int:
    """FA4's K/V ring depth: as many K/V blocks as fit next to Q and O in 224 KiB, at most 32
    (hd64: 10, hd96: 5, hd128: 3)."""
    q_o = fwd_smem_bytes(headdim, hdim_v, q_stage, tile_m, tile_n, 0)
    return min((SMEM_KV_BUDGET - q_o) // (tile_n * max(headdim, hdim_v) * 2), MAX_KV_STAGES)


# ---------------------------------------------------------------- registers (setmaxnreg)
@dataclasses.dataclass(frozen=True)
class RegisterPlan:
    """setmaxnreg budget per role (registers per thread). softmax: each softmax warpgroup;
    correction: the correction warpgroup; other: the warpgroup of the mma, epilogue, load and idle
    warps. Every warp starts at LAUNCH_REGS; a budget above it is a setmaxnreg.inc, below it a .dec."""

    softmax: int
    correction: int
    other: int

    def per_warpgroup(self) -> tuple:
        """Budgets of the four warpgroups in WARPGROUPS order."""
        return (self.softmax, self.softmax, self.correction, self.other)

    def by_role(self) -> dict:
        return {"softmax0": self.softmax, "softmax1": self.softmax, "correction": self.correction,
                "mma": self.other, "epilogue": self.other, "load": self.other, "idle": self.other}

    @staticmethod
    def is_increase(regs: int) -> bool:
        """setmaxnreg.inc (True) or .dec (False) from LAUNCH_REGS; equal counts as .dec."""
        return regs > LAUNCH_REGS


def register_plan_problem(plan: RegisterPlan) -> str | None:
    for role, regs in (("softmax", plan.softmax), ("correction", plan.correction), ("other", plan.other)):
        if regs % 8 or not 24 <= regs <= 256:
            return f"regs_{role}={regs}: setmaxnreg takes a multiple of 8 in [24, 256]"
    total = sum(plan.per_warpgroup())
    if total > 512:
        return (f"register plan {plan}: warpgroup budgets sum to {total} > 512 (64K registers / 128 threads "
                "per warpgroup)")
    return None


def register_plan(cfg: Sm100FwdConfig) -> RegisterPlan:
    """The config's setmaxnreg budgets (what the kernel's setmaxregister_increase/decrease take)."""
    return RegisterPlan(cfg.regs_softmax, cfg.regs_correction, cfg.regs_other)


def default_register_plan(headdim: int, causal: bool) -> RegisterPlan:
    """FA4's budgets for its 1-CTA forward (flash_fwd_sm100.py:380-403, _TUNING_CONFIG :103), tuned by
    FA4 on B200 (not measured here): hd < 96: 200/64/48; hd128 causal: 192/72 (_TUNING_CONFIG);
    otherwise 192/80. "other" takes what is left of 512 per 4 warpgroups, rounded down to 8 and
    capped at LAUNCH_REGS (setmaxnreg.dec may not exceed the launch count)."""
    if headdim < 96:
        return RegisterPlan(200, 64, 48)
    softmax, correction = (192, 72) if (headdim == 128 and causal) else (192, 80)
    other = min((512 - 2 * softmax - correction) // 8 * 8, LAUNCH_REGS)
    return RegisterPlan(softmax, correction, other)


# ---------------------------------------------------------------- tensor memory
def tmem_map(cfg: Sm100FwdConfig) -> dict:
    """TMEM columns of every buffer: name -> (start_col, ncols), 32-bit columns, all 128 lanes.

    S_i (q_stage of them): fp32 scores of Q tile i, tile_n columns at tile_n * i.
    O_i: fp32 output accumulator of Q tile i, Dv columns at 2 * tile_n + i * Dv.
    P_i: 16-bit probabilities of Q tile i, packed two per column, in the upper half of S_i
         (tile_n / 2 columns at S_i + tile_n / 2; FA4 tmem_s_to_p_offset): the PV MMA reads P_i from
         TMEM while the softmax is done with S_i's columns. Declared aliases: P_i inside S_i only.
    This is the kernel's only source of TMEM offsets (flash4.kernels.sm100.fwd)."""
    s_cols, dv = cfg.tile_n, cfg.hdim_v
    m = {}
    for i in range(cfg.q_stage):
        m[f"S{i}"] = (i * s_cols, s_cols)
    for i in range(cfg.q_stage):
        m[f"O{i}"] = (cfg.q_stage * s_cols + i * dv, dv)
    for i in range(cfg.q_stage):
        m[f"P{i}"] = (i * s_cols + s_cols // 2, s_cols // 2)
    return m


# Buffers allowed to overlap: (inner, outer), inner inside outer.
TMEM_ALIASES = (("P0", "S0"), ("P1", "S1"))


def tmem_used_cols(cfg: Sm100FwdConfig) -> int:
    return max(start + n for start, n in tmem_map(cfg).values())


def tmem_alloc_cols(cfg: Sm100FwdConfig) -> int:
    """Columns the MMA warp allocates (tcgen05.alloc): the used columns rounded up to a power of two,
    at least 32 (the instruction's rule). 512 for hd64/96/128 with q_stage 2."""
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
    """A role arriving on one side of a pipeline: its name (ROLE_WARPS) and how it signals."""

    role: str
    signal: Signal

    def arrivals(self, cta_group: int = 1) -> int:
        """Arrivals this party adds to one phase of one barrier. TMA and tcgen05.commit: one per CTA
        of the MMA group; elected lanes: one per warp; all threads: 32 per warp."""
        warps = ROLE_WARPS[self.role]
        if self.signal in (Signal.TMA, Signal.COMMIT):
            return cta_group
        if self.signal is Signal.ELECTED:
            return warps
        return WARP_SIZE * warps


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """One mbarrier pipeline: `full` is arrived by the producers and waited on by the consumers,
    `empty` the other way round. stages: barriers per side (per_q_tile: stage i belongs to Q tile
    i, used once per key block or per tile). waited_empty False: the empty side is never waited on
    (back-pressure comes from another pipeline, named in `note`), so its consumers do not arrive."""

    name: str
    stages: int
    producers: tuple
    consumers: tuple
    note: str = ""
    waited_empty: bool = True
    per_q_tile: bool = False

    def full_arrivals(self, cta_group: int = 1) -> int:
        return sum(p.arrivals(cta_group) for p in self.producers)

    def empty_arrivals(self, cta_group: int = 1) -> int:
        return sum(p.arrivals(cta_group) for p in self.consumers)

    def describe(self, cta_group: int = 1) -> str:
        def side(parties):
            return " + ".join(f"{p.role} ({p.signal.value}: {p.arrivals(cta_group)})" for p in parties)
        return (f"{self.name}: full = {side(self.producers)} = {self.full_arrivals(cta_group)}; "
                f"empty = {side(self.consumers)} = {self.empty_arrivals(cta_group)}")


def pipeline_specs(cfg: Sm100FwdConfig) -> dict:
    """Every mbarrier pipeline of the forward, name -> PipelineSpec. The kernel builds each pipeline
    from its own role table, asserts at trace time that the DSL's mbarrier init counts equal
    full_arrivals / empty_arrivals, and records which roles arrive where (kernels/sm100/pipes.py):
    a mismatch, a hang on hardware, is a compile error here."""
    P = Party
    q = cfg.q_stage
    specs = [
        PipelineSpec("q", q, (P("load", Signal.TMA),), (P("mma", Signal.COMMIT),),
                     "Q tiles 0 and 1 of a CTA tile; released by the MMA warp after the tile's last QK^T"),
        PipelineSpec("kv", cfg.kv_stages, (P("load", Signal.TMA),), (P("mma", Signal.COMMIT),),
                     "K and V blocks in one ring, in the MMA's order K[n-1] V[n-1] K[n-2] V[n-2] ..."),
        # MMA commits "S_i ready" after QK^T; the softmax releases "P_i written" and the correction
        # "O_i rescaled (or read out)": the MMA waits for both before PV_i (FA4 pipeline_s_p_o).
        PipelineSpec("s_p_o", q, (P("mma", Signal.COMMIT),),
                     (P("softmax", Signal.ALL_THREADS), P("correction", Signal.ALL_THREADS)),
                     "S_i ready -> softmax_i; P_i written + O_i rescaled -> MMA (PV_i)", per_q_tile=True),
        # softmax -> correction: the row's O rescale factor (blocks 1..n-1), then 1 / row_sum.
        PipelineSpec("sm_stats", q, (P("softmax", Signal.ALL_THREADS),), (P("correction", Signal.ALL_THREADS),),
                     "per-row factor for O_i through smem sScale[:, i]", per_q_tile=True),
        # MMA -> correction: the tile's last PV_i is complete.
        PipelineSpec("o_full", q, (P("mma", Signal.COMMIT),), (P("correction", Signal.ALL_THREADS),),
                     "back-pressure on O_i is s_p_o (the correction releases it after reading O_i)",
                     waited_empty=False, per_q_tile=True),
        PipelineSpec("corr_epi", q, (P("correction", Signal.ALL_THREADS),), (P("epilogue", Signal.ELECTED),),
                     "O_i staged in smem sO[i] -> TMA store; released once the store has read sO[i]",
                     per_q_tile=True),
    ]
    return {s.name: s for s in specs}


# ---------------------------------------------------------------- selection
def select_fwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = ARCH,
                      local: bool = False, softcap: bool = False, sink: bool = False,
                      headdim_v: int | None = None, seqlen_k: int | None = None) -> Sm100FwdConfig:
    """The sm100 forward config for one problem class (pure; CPU-tested). Same arguments as
    flash4.config.sm90.select_fwd_config; seqlen_k is accepted and ignored (no short-sequence
    policy on sm100 yet). Raises ValueError for what the sm100 kernel does not build: another arch,
    a head dim outside SM100_FWD_HEADDIMS, local, softcap, sink, Dv != D."""
    if arch != ARCH:
        raise ValueError(f"flash4.config.sm100 builds sm_100a kernels only, got arch={arch}")
    if headdim not in SUPPORTED_HEADDIMS or headdim not in SM100_FWD_HEADDIMS:
        raise ValueError(f"headdim={headdim} not supported by the sm100 forward yet; built: {SM100_FWD_HEADDIMS}")
    if headdim_v is not None and headdim_v != headdim:
        detail = "" if (headdim, headdim_v) in HDIMV_PAIRS else " (nor on sm90)"
        raise ValueError(f"headdim_v={headdim_v} != headdim={headdim} is not implemented by the sm100 forward{detail}")
    unbuilt = [name for name, on in (("local", local), ("softcap", softcap), ("sink", sink)) if on]
    if unbuilt:
        raise ValueError(f"{', '.join(unbuilt)} not implemented by the sm100 forward yet")
    plan = default_register_plan(headdim, causal)
    return Sm100FwdConfig(
        headdim=headdim, dtype=dtype, causal=causal, kv_stages=kv_stages_for(headdim, headdim),
        regs_softmax=plan.softmax, regs_correction=plan.correction, regs_other=plan.other, lpt=causal)


def shipped_fwd_configs() -> list:
    """Every sm100 forward config: hd64/96/128 x bf16/fp16 x causal/not, 1-CTA."""
    return [select_fwd_config(d, dt, c) for d in SM100_FWD_HEADDIMS for dt in DTYPES for c in (False, True)]


def select_bwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = ARCH, **kwargs):
    raise ValueError("no sm100 backward yet (flash4's sm_100 family has a forward only)")


def shipped_bwd_configs() -> list:
    return []


# ---------------------------------------------------------------- the host's questions (flash4.config.fwd_config / bwd_config)
def fwd_plan(request, arch: int = ARCH, num_sms: int | None = None) -> FwdPlan:
    """The forward plan of a flash4.request.Request on sm100: dense batches only (select_fwd_config's
    checks apply: head dims, no window / softcap / sink / Dv != D yet). Raises ValueError for a packed,
    paged or decode request (the sm100 kernel has no sequence layouts yet)."""
    q, seq, mask, score = request.q, request.seq, request.mask, request.score
    if seq.packed or seq.decode:
        raise ValueError(f"the sm100 forward has no {seq.layout} layout yet (dense batches only)")
    headdim, headdim_v = q.shape[-1], request.v.shape[-1]
    return FwdPlan(select_fwd_config(headdim, request.dtype, mask.causal, arch, mask.window is not None,
                                     score.softcap > 0, score.sink is not None,
                                     None if headdim_v == headdim else headdim_v, request.k.shape[1]))


def bwd_plan(request, arch: int = ARCH, heads_per_cta: int | None = None):
    raise ValueError("no sm100 backward yet (flash4's sm_100 family has a forward only)")
