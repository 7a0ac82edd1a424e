"""The sm100 (Blackwell B200, sm_100a) family's forward configuration and its selection; the pure
plans its kernel is built from (warp roles, the tensor-memory map, the register plan, the pipeline
arrive counts) are in flash4.kernels.sm100.plan and re-exported here.

Status: compile-verified, not run on hardware. Every number below is either read from
flash-attn-4's sm100 forward (cited as FA4, /work/shared/design/BLACKWELL.md section 1) or derived
from hardware limits; none was measured on a B200. The kernel (flash4.kernels.sm100.fwd) reads its
TMEM offsets, setmaxnreg budgets and mbarrier arrive counts only from the plan, and CPU tests check these
functions and the compiled PTX/SASS against each other (tests/cpu/test_sm100_*.py).

Everything here is pure Python (no torch, no CuTe DSL). The family is registered in
flash4.kernels.registry as "sm100" (arch 100 only), unverified and self-test-gated: the API selects
it on sm_100, and each config runs only after flash4.selftest passed it on that GPU.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools

from flash4 import env
from flash4.config import HDIMV_PAIRS, SUPPORTED_HEADDIMS, FwdPlan, with_seq_layout
from flash4.constants import DTYPES, RESCALE_THRESHOLD_LOG2
from flash4.kernels.common.exp2_poly import mixed_pattern
from flash4.kernels.sm100.bwd_plan import (  # noqa: F401  (the backward's plan)
    BWD_DO_STAGES, BWD_NUM_THREADS, BWD_Q_STAGES, BWD_SMEM_BUDGET, BWD_TILE_M, BWD_TILE_N, BWD_WARP_ROLES,
    SM100_BWD_HEADDIMS, BwdRegisterPlan, bwd_pipeline_specs, bwd_register_plan, bwd_register_plan_problem,
    bwd_smem_bytes, bwd_tmem_alloc_cols, bwd_tmem_aliases, bwd_tmem_map, bwd_tmem_used_cols,
    default_bwd_register_plan,
    BWD_Q_STAGES_2CTA, SM100_BWD_2CTA_PAIRS, default_bwd_register_plan_2cta,
    SM100_BWD_HEADDIM_PAIRS, bwd_q_stages, bwd_serial_problem, bwd_serial_schedule, bwd_tmem_problem,
    bwd_exact_lse,
    BWD_PASSES, SM100_BWD_TWO_PASS_PAIRS, BWD_TWO_PASS_ORDER, bwd_pass_tmem_problem, default_bwd_register_plan_pass,
)
from flash4.kernels.sm100.plan import (  # noqa: F401  (the plan, re-exported for the config's users)
    ARCH, EXP2_EMU_FRAC, EXP2_EMU_FRAC_CAUSAL, EXP2_EMU_GROUP, exp2_emu_frac_for, IDLE_REGS, LAUNCH_REGS, MAX_KV_STAGES, NUM_THREADS, NUM_WARPS, Party, PipelineSpec,
    ROLE_WARPS, RegisterPlan, SMEM_KV_BUDGET, Signal, TMEM_ALIASES, TMEM_COLUMNS,
    WARPGROUPS, WARP_ROLES, WARP_SIZE, default_register_plan, fwd_smem_bytes, kv_stages_for,
    pipeline_specs, q_stage_for, ragged_keys, register_plan, register_plan_problem, tma_tx_bytes, tmem_alloc_cols, tmem_map,
    tmem_used_cols,
)

# Head dims the sm100 forward has: (D, Dv) pairs. 64 / 96 / 128 with q_stage 2 (FA4's 1-CTA forward);
# (192, 128) (DeepSeek MLA prefill) and 256 with q_stage 1, 1-CTA only (FA4 runs both 2-CTA;
# plan.q_stage_for). (192, 192) has no FA4 design on sm100 (BLACKWELL.md R5). Compile-verified, not
# run on hardware.
SM100_FWD_HDIM_PAIRS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
SM100_FWD_HEADDIMS = tuple(d for d, _ in SM100_FWD_HDIM_PAIRS)  # Q/K head dims: 64, 96, 128, 192, 256

@dataclasses.dataclass(frozen=True)
class Sm100FwdConfig:
    """One compiled sm100 forward kernel (the compile-cache key).

    headdim:       D of Q/K (64, 96, 128, 192, 256; with headdim_v: SM100_FWD_HDIM_PAIRS).
    dtype:         "bf16" or "fp16" (Q, K, V, O, and P in TMEM).
    causal:        bottom-right aligned causal mask; only the key blocks that cross the diagonal
                   (and the seqlen_k edge) are masked; LPT tile order.
    q_stage:       Q tiles per CTA (2: softmax warpgroups 0 and 1 each own one 128-row tile; 1 for
                   (192, 128) and hd256: softmax0 owns the one tile, softmax1's warpgroup idles;
                   plan.q_stage_for).
    kv_stages:     depth of the K/V TMA ring (K and V blocks take alternate stages).
    tile_m:        query rows per Q tile and CTA = TMEM lanes (128); a tile covers q_stage * tile_m *
                   cta_group rows (cta_tile_m): the host's grid counts tiles of cta_tile_m rows.
    tile_n:        key rows per K/V block = S columns in TMEM (128).
    cta_group:     1 (tcgen05 .cta_group::1, one CTA per tile) or 2 (a cluster of 2 CTAs per tile,
                   .cta_group::2 MMAs of M = 256 issued by the leader CTA: each CTA holds 128 rows of
                   each of its q_stage Q tiles and half of each K/V block; built for head dim 128,
                   non-causal, no window, dense batches: TWO_CTA_HEADDIMS / two_cta_problem).
                   Compile-verified, not run on hardware; selected only with FLASH4_SM100_2CTA=1.
    regs_softmax / regs_correction / regs_other: setmaxnreg budgets per role (register_plan).
    exp2_emu_frac: share of exp2 done by the packed-f32x2 FMA polynomial, k / period (static per
                   column pair; 0 = all MUFU.EX2); selection: exp2_emu_frac_for(causal, local, cta_group).
    rescale_threshold: lazy-rescale tau in log2 units (flash4.constants).
    persistent, lpt: the tile order (flash4.kernels.common.scheduler.TileSchedule); lpt = causal.
    arch:          100 (sm_100a).
    The remaining fields mirror flash4.config.FwdConfig so the host can pass the same keys; the
    sm100 kernel implements softcap (score.apply on the row before the mask: tanh on MUFU), sink
    (the learnable sink in the softmax's finalize, sm90's rule) and local (a sliding window: the key
    blocks of flash4.geometry's n_block_min .. n_block_max, every block masked on both sides) and
    packed sequences (varlen_q, varlen_k, seqused_q: flash4.kernels.common.seqinfo; O stored row by
    row below seqlen_q) and seqused_k (dense or packed: the key count of each sequence; with varlen_k
    or seqused_k the load warp zeroes the V rows past seqlen_k of each tile's key-edge block, issue
    25), at every head dim (q_stage 1 too: there every role builds its tile schedule after its
    setmaxnreg, fwd.py late_sched), and none of the others yet; a config with any of them set cannot
    be built (ValueError in __post_init__): page_rows, split_kv, pack_gqa; headdim_v other than None
    or 128 with headdim 192.
    headdim_v:     Dv of V and O when it differs from headdim ((192, 128) only), else None.
    (GQA / MQA runs without packing: each query head reads K/V head head // (H / Hk).)
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
    exp2_emu_frac: float = EXP2_EMU_FRAC
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
    def paged(self) -> bool:
        """K/V are pages read through a page table (the host's question; never in this family yet)."""
        return self.page_rows > 0

    @property
    def hdim_v(self) -> int:
        """Dv: the head dim of V and O (headdim_v, or headdim)."""
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def cta_tile_m(self) -> int:
        """Query rows per tile: q_stage Q tiles of tile_m rows per CTA, times cta_group (a 2-CTA
        pair covers 2 x 256 = 512 rows; the grid has cta_group CTAs per tile)."""
        return self.q_stage * self.tile_m * self.cta_group

    @property
    def num_threads(self) -> int:
        return NUM_THREADS

    def smem_bytes(self) -> int:
        """Dynamic shared memory of Q (q_stage tiles), O staging (q_stage tiles) and the K/V ring
        (bytes, without mbarriers and the softmax stats)."""
        return fwd_smem_bytes(self.headdim, self.hdim_v, self.q_stage, self.tile_m, self.tile_n, self.kv_stages,
                              cta_group=self.cta_group)


# Feature flags a config may carry and the sm100 kernel does not implement (field -> its "off" value).
_UNBUILT_FLAGS = {
    "page_rows": 0, "split_kv": False, "pack_gqa": 1,
}


def config_problem(cfg: Sm100FwdConfig) -> str | None:
    """Why `cfg` cannot be built by the sm100 forward, or None."""
    if cfg.arch != ARCH:
        return f"arch={cfg.arch}; the sm100 family is sm_100a only (sm_103/110/120 are different GPUs)"
    if cfg.headdim_v is not None and cfg.headdim_v == cfg.headdim:
        return "headdim_v must be None (canonical) when it equals headdim"
    if (cfg.headdim, cfg.hdim_v) not in SM100_FWD_HDIM_PAIRS:
        return (f"(headdim, headdim_v)=({cfg.headdim}, {cfg.hdim_v}) not built on sm100; built: "
                f"{', '.join(f'({d}, {dv})' for d, dv in SM100_FWD_HDIM_PAIRS)}")
    if cfg.dtype not in DTYPES:
        return f"dtype={cfg.dtype!r}; allowed: {DTYPES}"
    on = [f for f, off in _UNBUILT_FLAGS.items() if getattr(cfg, f) != off]
    if on:
        return f"{', '.join(on)} not implemented by the sm100 forward yet"
    q_stage = q_stage_for(cfg.headdim, cfg.hdim_v)
    if (cfg.q_stage, cfg.tile_m, cfg.tile_n) != (q_stage, 128, 128) or cfg.cta_group not in (1, 2):
        return (f"(q_stage, tile_m, tile_n, cta_group)=({cfg.q_stage}, {cfg.tile_m}, {cfg.tile_n}, {cfg.cta_group}); "
                f"only ({q_stage}, 128, 128, 1{' or 2' if q_stage == 2 else ''}) is built for head dims "
                f"({cfg.headdim}, {cfg.hdim_v}) ({q_stage} 128-row Q tile(s) per CTA, 128-key blocks)")
    if cfg.cta_group == 2:
        problem = two_cta_problem(cfg.headdim, cfg.causal, cfg.local,
                                  cfg.varlen_q or cfg.varlen_k or cfg.seqused_q or cfg.seqused_k)
        if problem is not None:
            return problem
    try:
        mixed_pattern(cfg.exp2_emu_frac)
    except ValueError as err:
        return f"exp2_emu_frac={cfg.exp2_emu_frac!r}: {err}"
    if cfg.persistent:
        return "persistent=True is not built (one CTA per tile)"
    if cfg.lpt != (cfg.causal and not cfg.local):
        return (f"lpt={cfg.lpt} with causal={cfg.causal}, local={cfg.local}; the sm100 forward orders causal tiles "
                "LPT (lpt == causal and not local: a window's tiles have about equal work)")
    if not 1 <= cfg.kv_stages <= MAX_KV_STAGES or cfg.smem_bytes() > SMEM_KV_BUDGET:
        return f"kv_stages={cfg.kv_stages}: {cfg.smem_bytes()} bytes of smem > {SMEM_KV_BUDGET}"
    plan_problem = register_plan_problem(register_plan(cfg))
    if plan_problem is not None:
        return plan_problem
    return None


# ---------------------------------------------------------------- 2-CTA
# Head dims of the 2-CTA forward (FA4 runs 2-CTA for non-causal hd128, (192, 128) and 256; flash4
# builds hd128 only). Compile-verified, not run on hardware (BLACKWELL.md R3: the riskiest protocol).
TWO_CTA_HEADDIMS = (128,)


def two_cta_problem(headdim: int, causal: bool, local: bool = False, packed: bool = False) -> str | None:
    """Why the 2-CTA forward is not built for this problem class, or None."""
    if headdim not in TWO_CTA_HEADDIMS:
        return f"cta_group=2 with headdim={headdim}: the 2-CTA forward is built for {TWO_CTA_HEADDIMS} only"
    if causal or local:
        return "cta_group=2 with a causal or windowed mask: the 2-CTA forward is built non-causal only"
    if packed:
        return ("cta_group=2 with packed sequences or ragged keys (varlen / seqused_q / seqused_k): the 2-CTA "
                "forward is built for dense batches only")
    return None


# ---------------------------------------------------------------- selection
def select_fwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = ARCH,
                      local: bool = False, softcap: bool = False, sink: bool = False,
                      headdim_v: int | None = None, seqlen_k: int | None = None,
                      two_cta: bool = False) -> Sm100FwdConfig:
    """The sm100 forward config for one problem class (pure; CPU-tested). Same arguments as
    flash4.config.sm90.select_fwd_config; seqlen_k is accepted and ignored (no short-sequence
    policy on sm100 yet). two_cta: take the 2-CTA variant where it is built (two_cta_problem is
    None; otherwise the 1-CTA config); the host passes env.sm100_2cta() (default off). Raises
    ValueError for what the sm100 kernel does not build: another arch, a pair (headdim, headdim_v)
    outside SM100_FWD_HDIM_PAIRS."""
    if arch != ARCH:
        raise ValueError(f"flash4.config.sm100 builds sm_100a kernels only, got arch={arch}")
    dv = headdim if headdim_v is None else headdim_v
    if headdim not in SUPPORTED_HEADDIMS or headdim not in SM100_FWD_HEADDIMS:
        raise ValueError(f"headdim={headdim} not supported by the sm100 forward yet; built: {SM100_FWD_HEADDIMS}")
    if (headdim, dv) not in SM100_FWD_HDIM_PAIRS:
        detail = "" if (headdim, dv) in HDIMV_PAIRS or dv == headdim else " (nor on sm90)"
        built = ", ".join(f"({d}, {v})" for d, v in SM100_FWD_HDIM_PAIRS)
        raise ValueError(f"(headdim, headdim_v)=({headdim}, {dv}) is not implemented by the sm100 forward{detail}; "
                         f"built: {built}")
    q_stage = q_stage_for(headdim, dv)
    cta_group = 2 if two_cta and two_cta_problem(headdim, causal, local) is None else 1
    plan = default_register_plan(headdim, causal, cta_group, dv)
    return Sm100FwdConfig(
        headdim=headdim, dtype=dtype, causal=causal, q_stage=q_stage,
        kv_stages=kv_stages_for(headdim, dv, q_stage, cta_group=cta_group),
        cta_group=cta_group, regs_softmax=plan.softmax, regs_correction=plan.correction, regs_other=plan.other,
        exp2_emu_frac=exp2_emu_frac_for(causal, local, cta_group), lpt=causal and not local, softcap=softcap, sink=sink,
        local=local, headdim_v=None if dv == headdim else dv)


def shipped_fwd_configs(features: bool = True) -> list:
    """Every sm100 forward config the API can select: hd64/96/128 x bf16/fp16 x causal/not, 1-CTA,
    each without and (features) with every combination of a sliding window (local), softcap and a
    learnable sink (96 configs); then the 2-CTA configs (FLASH4_SM100_2CTA=1): hd128 non-causal x
    bf16/fp16, without and (features) with softcap / sink (2, or 8 with features); then the q_stage 1
    head dims (192, 128) and 256 x bf16/fp16 x causal/not, without and (features) with every
    combination of window / softcap / sink (8, or 64 with features)."""
    flags = list(itertools.product((False, True), repeat=3)) if features else [(False, False, False)]
    q2_pairs = [(d, dv) for d, dv in SM100_FWD_HDIM_PAIRS if q_stage_for(d, dv) == 2]
    one_cta = [select_fwd_config(d, dt, c, local=lo, softcap=sc, sink=sk) for lo, sc, sk in flags
               for d, _ in q2_pairs for dt in DTYPES for c in (False, True)]
    two_cta = [select_fwd_config(d, dt, False, softcap=sc, sink=sk, two_cta=True) for lo, sc, sk in flags if not lo
               for d in TWO_CTA_HEADDIMS for dt in DTYPES]
    q_stage_1 = [select_fwd_config(d, dt, c, local=lo, softcap=sc, sink=sk, headdim_v=None if dv == d else dv)
                 for lo, sc, sk in flags for d, dv in SM100_FWD_HDIM_PAIRS if q_stage_for(d, dv) == 1
                 for dt in DTYPES for c in (False, True)]
    return one_cta + two_cta + q_stage_1


# ---------------------------------------------------------------- the host's questions (flash4.config.fwd_config / bwd_config)
def fwd_plan(request, arch: int = ARCH, num_sms: int | None = None) -> FwdPlan:
    """The forward plan of a flash4.request.Request on sm100: dense batches, and packed sequences
    (VARLEN: cu_seqlens_q / cu_seqlens_k, optionally seqused_q and seqused_k) at every head dim
    (select_fwd_config's checks apply: head dims (SM100_FWD_HDIM_PAIRS)). Raises ValueError for
    paged K/V and decode requests."""
    q, seq, mask, score = request.q, request.seq, request.mask, request.score
    if seq.paged or seq.decode:
        raise ValueError(f"the sm100 forward has no {seq.layout} layout yet (dense and packed varlen batches only)")
    headdim, headdim_v = q.shape[-1], request.v.shape[-1]
    cfg = select_fwd_config(headdim, request.dtype, mask.causal, arch, mask.window is not None, score.softcap > 0,
                            score.sink is not None, None if headdim_v == headdim else headdim_v,
                            None if seq.packed else request.k.shape[1], two_cta=env.sm100_2cta() and not seq.packed)
    if seq.packed:
        cfg = with_seq_layout(cfg, varlen_q=True, varlen_k=True, seqused_q=seq.seqused_q is not None,
                              seqused_k=seq.seqused_k is not None)
    return FwdPlan(cfg)


# What flash4's API door serves of this family behind the first-use self-test
# (flash4.validate._gated_problem; the rest is refused by name before any self-test): the door
# layouts of the forward (fwd_plan) and of the backward, and whether the forward takes seqused_k
# and paged K/V (seqused_k: the V-tail zeroing of docs/design/sm100_forward.md section 11).
GATE_DOOR = {"fwd_layouts": ("dense", "varlen"), "bwd_layouts": ("dense", "varlen"), "seqused_k": True, "paged": False}


def gate_fwd_options(layout: str) -> dict:
    """select_fwd_config's extra arguments at the door for a `layout` batch: the 2-CTA switch as
    fwd_plan asks it (FLASH4_SM100_2CTA, dense batches only)."""
    return {"two_cta": True} if layout == "dense" and env.sm100_2cta() else {}


# ================================================================ the backward (1-CTA)
@dataclasses.dataclass(frozen=True)
class Sm100BwdConfig:
    """One compiled sm100 backward kernel (the compile-cache key). Compile-verified, not run on hardware.

    headdim:     D of Q/K (64, 128, 192: SM100_BWD_HEADDIM_PAIRS; 256 as two passes: bwd_pass; V's is headdim_v).
    dtype:       "bf16" or "fp16".
    causal:      bottom-right aligned causal mask.
    tile_m:      queries per step (S^T columns, 128); tile_n: keys per CTA (TMEM lanes, 128).
    q_stages / do_stages: depth of the Q (and LSE) / dO (and dPsum) TMA rings (FA4: 2 / 1).
    cta_group:   1 (tcgen05 .cta_group::1), or 2: a cluster of 2 CTAs per 2 x tile_n keys, the
                 leader CTA issuing .cta_group::2 MMAs for the pair, each CTA holding dQ of half the
                 query block (64 rows x D in D / 2 TMEM columns) and swapping half of dS with its peer
                 over DSMEM (hd128 pipelined, (192, 128) serial: bwd_two_cta_serial; full or causal,
                 softcap or not, not deterministic, no window: bwd_two_cta_problem; q_stages 1). Opt-in:
                 select_bwd_config(two_cta=True), which the host passes as FLASH4_SM100_2CTA.
                 Compile-verified, not run on hardware.
    regs_reduce / regs_compute / regs_other: setmaxnreg budgets (bwd_register_plan).
    arch:        100 (sm_100a).
    local:       a sliding window (runtime sides; causal folded into it: the config has causal False),
                 as flash4.config.BwdConfig: each key block walks the query blocks that see it
                 (flash4.geometry.m_block_range) and masks both sides.
    deterministic: the dQ adds of a query block in key-block order (sm90's semaphore chain: the
                 reduce warps wait until the block's semaphore reads their turn, add, wait for the
                 adds to land, release the next): bitwise-reproducible dQ; dK, dV are deterministic
                 anyway (no head split).
    softcap:     scores softcap * tanh(S * scale / softcap) (runtime cap): the compute warps take
                 tanh (flash4.kernels.common.score.apply, MUFU.TANH) before the exp2, and multiply dS
                 by score.grad_factor (1 - t^2, t recovered from P and the LSE), as the sm90 backward.
    varlen_q / varlen_k / seqused_q / seqused_k: packed sequences (1-CTA only; varlen_q and varlen_k
                 together, seqused_q / seqused_k only with them): one CTA per (key block of
                 max_seqlen_k, KV head, sequence), flash4.kernels.common.seqinfo.SeqInfo offsets, the
                 padded per-sequence LSE / dPsum / dQ accumulator of flash4.backward, K / V / Q / dO
                 rows past the sequence zeroed in smem by the MMA warp (docs/design/sm100_backward.md
                 section "Packed sequences"). Compile-verified, not run on hardware.
    headdim_v:   Dv, None when it equals headdim; built: 128 with headdim 192 ((192, 128): the serial
                 1-CTA schedule, bwd_serial_schedule: q_stages 1, softcap or not; docs/design/sm100_backward.md
                 section 10). Compile-verified, not run on hardware.
    bwd_pass:    "both" (every config above: one kernel issues the five MMAs), or one pass of a two-pass
                 config (SM100_BWD_TWO_PASS_PAIRS: hd256, whose dK + dV take all 512 TMEM columns): "dv"
                 (S^T, P^T, dV += P^T dO only; dV stored; 192.5 KiB of smem) or "dkdq" (S^T, dP^T, dS^T,
                 dK, dQ; dK stored, dQ reduced; V and dO streamed in 32-column chunks: 209 KiB). 1-CTA,
                 dense or packed (the MMA warp zeroes K / Q / dO, and in pass dkdq each V / dO chunk,
                 past the sequence), softcap or not (both passes take tanh before the exp2: P changes;
                 pass dkdq multiplies dS by grad_factor), one Q stage; the host runs both (bwd_passes).
                 docs/design/sm100_backward.md section 10.4. Compile-verified, not run on hardware.
    The remaining field mirrors flash4.config.BwdConfig so the host passes the same keys; it is not
    built on sm100 and a config with it set cannot be made (ValueError in __post_init__): dkv_accum
    (GQA head split: GQA runs with one CTA per KV head walking every query head of its group).
    """

    headdim: int
    dtype: str = "bf16"
    causal: bool = False
    tile_m: int = BWD_TILE_M
    tile_n: int = BWD_TILE_N
    q_stages: int = BWD_Q_STAGES
    do_stages: int = BWD_DO_STAGES
    cta_group: int = 1
    regs_reduce: int = 152
    regs_compute: int = 136
    regs_other: int = 88
    arch: int = ARCH
    deterministic: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    local: bool = False
    softcap: bool = False
    headdim_v: int | None = None
    dkv_accum: bool = False
    bwd_pass: str = "both"

    def __post_init__(self):
        problem = bwd_config_problem(self)
        if problem is not None:
            raise ValueError(f"sm100 backward config {self}: {problem}")

    @property
    def hdim_v(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def dq_accum_order(self) -> bool:
        """The dQ accumulator is row-major (B, H, rows, D) (the sm90 permuted order is Hopper's)."""
        return False

    @property
    def dynamic_seqlen_k(self) -> bool:
        return self.varlen_k or self.seqused_k

    @property
    def num_threads(self) -> int:
        return BWD_NUM_THREADS

    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.headdim, self.hdim_v, self.tile_m, self.tile_n, self.q_stages, self.do_stages,
                              cta_group=self.cta_group, bwd_pass=self.bwd_pass)


# Fields of flash4.config.BwdConfig the sm100 backward does not build yet (field -> its "off" value).
_BWD_UNBUILT = {"headdim_v": None, "dkv_accum": False}
_BWD_UNBUILT_WHAT = {
    "varlen_q": "packed varlen sequences (cu_seqlens_q)", "varlen_k": "packed varlen sequences (cu_seqlens_k)",
    "seqused_q": "seqused_q", "seqused_k": "seqused_k", "local": "a sliding window (window_size)",
    "softcap": "softcap", "headdim_v": "a V head dim different from Q/K's", "dkv_accum": "the GQA head split",
}


def bwd_padded_headdims(headdim: int, headdim_v: int) -> tuple[int, int]:
    """(D', Dv') the sm100 backward runs a (headdim, headdim_v) call at: the pair itself when the backward
    is built for it (SM100_BWD_HEADDIM_PAIRS, SM100_BWD_TWO_PASS_PAIRS: the one source of truth), else the
    narrowest built pair at least as wide in both that the sm100 forward also has (hd96 -> (128, 128)):
    the API then zero-pads the whole training call to it (flash4.headdim.training_headdims; exact: zero
    q/k columns add 0 to every score, zero v columns give output columns that are sliced off; the
    softmax scale stays the caller's head dim's). The pair itself when none is wider (select_bwd_config
    then names what is missing). Compile-verified, not run on hardware."""
    built = SM100_BWD_HEADDIM_PAIRS + SM100_BWD_TWO_PASS_PAIRS
    if (headdim, headdim_v) in built:
        return headdim, headdim_v
    wider = [(d, dv) for d, dv in built if d >= headdim and dv >= headdim_v and (d, dv) in SM100_FWD_HDIM_PAIRS]
    return min(wider, key=lambda p: (p[0] + p[1], p)) if wider else (headdim, headdim_v)


def _bwd_built_text(headdim: int) -> str:
    """What the sm100 backward builds, and why hd256 cannot be (its TMEM arithmetic)."""
    text = ("built: (D, Dv) in " + ", ".join(f"({d}, {dv})" for d, dv in SM100_BWD_HEADDIM_PAIRS)
            + " (compile-verified, not run on hardware)")
    if headdim == 256:
        text += (f"; hd256 cannot fit tensor memory: {bwd_tmem_problem(256, 256)} (in one kernel), so it runs as "
                 "two passes (bwd_pass \"dv\", \"dkdq\"; docs/design/sm100_backward.md section 10.4)")
    return text


def bwd_pass_smem_problem(headdim: int, hdim_v: int, bwd_pass: str) -> str | None:
    """Why pass `bwd_pass` of a two-pass config does not fit BWD_SMEM_BUDGET at one Q stage, or None
    (hd256: "dv" 192.5 KiB, "dkdq" 209 KiB with V and dO streamed in chunks; whole, 321 KiB)."""
    q_stages = bwd_q_stages(headdim, hdim_v, bwd_pass)
    need = bwd_smem_bytes(headdim, hdim_v, q_stages=q_stages, bwd_pass=bwd_pass)
    if need <= BWD_SMEM_BUDGET:
        return None
    return (f"pass {bwd_pass} at (D, Dv)=({headdim}, {hdim_v}) needs {need} bytes of smem tiles at one Q stage "
            f"(K, V, Q, dO {BWD_TILE_N * headdim * 2 // 1024} KiB each, dS {BWD_TILE_N * BWD_TILE_M * 2 // 1024}, "
            f"the dQ staging {4 * 8 * headdim * 4 // 1024}) > {BWD_SMEM_BUDGET}")


def bwd_config_problem(cfg) -> str | None:
    """Why `cfg` cannot be built by the sm100 backward, or None."""
    if cfg.arch != ARCH:
        return f"arch={cfg.arch}; the sm100 family is sm_100a only"
    if cfg.headdim_v is not None and cfg.headdim_v == cfg.headdim:
        return "headdim_v must be None (canonical) when it equals headdim"
    if cfg.bwd_pass not in BWD_PASSES:
        return f"bwd_pass={cfg.bwd_pass!r}; allowed: {BWD_PASSES}"
    two_pass = (cfg.headdim, cfg.hdim_v) in SM100_BWD_TWO_PASS_PAIRS
    if two_pass and cfg.bwd_pass == "both":
        return (f"(headdim, headdim_v)=({cfg.headdim}, {cfg.hdim_v}) runs as two passes (bwd_pass \"dv\", "
                f"\"dkdq\"), not one kernel: {bwd_tmem_problem(cfg.headdim, cfg.hdim_v)}")
    if cfg.bwd_pass != "both" and not two_pass:
        return (f"bwd_pass={cfg.bwd_pass!r} at (headdim, headdim_v)=({cfg.headdim}, {cfg.hdim_v}): the two-pass "
                f"backward is built for {SM100_BWD_TWO_PASS_PAIRS} only")
    if not two_pass and (cfg.headdim, cfg.hdim_v) not in SM100_BWD_HEADDIM_PAIRS:
        return f"(headdim, headdim_v)=({cfg.headdim}, {cfg.hdim_v}) has no sm100 backward; {_bwd_built_text(cfg.headdim)}"
    if cfg.dtype not in DTYPES:
        return f"dtype={cfg.dtype!r}; allowed: {DTYPES}"
    on = [f for f, off in _BWD_UNBUILT.items() if f != "headdim_v" and getattr(cfg, f) != off]
    if on:
        return "the sm100 backward has no " + ", ".join(_BWD_UNBUILT_WHAT[f] for f in on) + " yet"
    if cfg.local and cfg.causal:
        return "local=True folds causal into the window: causal must be False"
    packed = cfg.varlen_q or cfg.varlen_k or cfg.seqused_q or cfg.seqused_k
    if packed and not (cfg.varlen_q and cfg.varlen_k):
        return ("the sm100 backward takes packed sequences with cu_seqlens_q and cu_seqlens_k together "
                "(seqused_q / seqused_k only with them)")
    if packed and cfg.cta_group != 1:
        return "cta_group=2 with packed sequences: the 2-CTA backward is dense only"
    if two_pass:  # hd256: 1-CTA; dense or packed, softcap or not
        if cfg.cta_group != 1:
            return (f"cta_group=2 at (headdim, headdim_v)=({cfg.headdim}, {cfg.hdim_v}): the two-pass backward is "
                    "1-CTA")
        q_stages = bwd_q_stages(cfg.headdim, cfg.hdim_v, cfg.bwd_pass)
        if (cfg.tile_m, cfg.tile_n, cfg.q_stages, cfg.do_stages) != (BWD_TILE_M, BWD_TILE_N, q_stages, BWD_DO_STAGES):
            return (f"(tile_m, tile_n, q_stages, do_stages)=({cfg.tile_m}, {cfg.tile_n}, {cfg.q_stages}, "
                    f"{cfg.do_stages}); pass {cfg.bwd_pass} is built for ({BWD_TILE_M}, {BWD_TILE_N}, {q_stages}, "
                    f"{BWD_DO_STAGES})")
        problem = (bwd_pass_tmem_problem(cfg.headdim, cfg.hdim_v, cfg.bwd_pass, cfg.tile_m)
                   or bwd_pass_smem_problem(cfg.headdim, cfg.hdim_v, cfg.bwd_pass))
        if problem is not None:
            return problem
        return bwd_register_plan_problem(BwdRegisterPlan(cfg.regs_reduce, cfg.regs_compute, cfg.regs_other))
    if cfg.cta_group == 2:
        problem = bwd_two_cta_problem(cfg.headdim, cfg.causal, cfg.local, cfg.deterministic, cfg.softcap,
                                      headdim_v=cfg.headdim_v)
        if problem is not None:
            return problem
        if (cfg.tile_m, cfg.tile_n, cfg.q_stages, cfg.do_stages) != (BWD_TILE_M, BWD_TILE_N, BWD_Q_STAGES_2CTA,
                                                                      BWD_DO_STAGES):
            return (f"(tile_m, tile_n, q_stages, do_stages)=({cfg.tile_m}, {cfg.tile_n}, {cfg.q_stages}, "
                    f"{cfg.do_stages}); the 2-CTA backward is built for ({BWD_TILE_M}, {BWD_TILE_N}, "
                    f"{BWD_Q_STAGES_2CTA}, {BWD_DO_STAGES})")
    elif (cfg.tile_m, cfg.tile_n, cfg.cta_group, cfg.q_stages, cfg.do_stages) != (
            BWD_TILE_M, BWD_TILE_N, 1, bwd_q_stages(cfg.headdim, cfg.hdim_v), BWD_DO_STAGES):
        q_stages = bwd_q_stages(cfg.headdim, cfg.hdim_v)
        return (f"(tile_m, tile_n, cta_group, q_stages, do_stages)=({cfg.tile_m}, {cfg.tile_n}, {cfg.cta_group}, "
                f"{cfg.q_stages}, {cfg.do_stages}); only ({BWD_TILE_M}, {BWD_TILE_N}, 1, {q_stages}, "
                f"{BWD_DO_STAGES}) is built (1-CTA, D={cfg.headdim}, Dv={cfg.hdim_v})")
    if cfg.cta_group == 1 and bwd_tmem_problem(cfg.headdim, cfg.hdim_v, cfg.tile_m) is not None:
        return bwd_tmem_problem(cfg.headdim, cfg.hdim_v, cfg.tile_m)
    if bwd_serial_schedule(cfg):
        problem = bwd_serial_problem(cfg.softcap, cfg.dtype, cfg.causal, cfg.deterministic)
        if problem is not None:
            return problem
    if cfg.smem_bytes() > BWD_SMEM_BUDGET:
        return f"{cfg.smem_bytes()} bytes of smem tiles > {BWD_SMEM_BUDGET}"
    return bwd_register_plan_problem(BwdRegisterPlan(cfg.regs_reduce, cfg.regs_compute, cfg.regs_other))


# Problems the 2-CTA backward is built for (bwd_two_cta_problem).
BWD_TWO_CTA_CAUSAL = True
BWD_TWO_CTA_SOFTCAP = True


def bwd_two_cta_problem(headdim: int, causal: bool = False, local: bool = False,
                        deterministic: bool = False, softcap: bool = False,
                        headdim_v: int | None = None) -> str | None:
    """Why the 2-CTA backward cannot take a problem class, or None (hd128 with the pipelined schedule,
    (192, 128) with the serial one; full or causal, softcap or not, no window, not deterministic; dense
    batches: the host refuses packed sequences for every sm100 backward)."""
    dv = headdim if headdim_v is None else headdim_v
    if (headdim, dv) not in SM100_BWD_2CTA_PAIRS:
        return (f"cta_group=2 with (headdim, headdim_v)=({headdim}, {dv}): the 2-CTA backward is built for "
                f"(D, Dv) in {SM100_BWD_2CTA_PAIRS} only")
    if local:
        return "cta_group=2 with a sliding window: the 2-CTA backward is built without a window"
    if causal and not BWD_TWO_CTA_CAUSAL:
        return "cta_group=2 with a causal mask: the 2-CTA backward is built non-causal only"
    if deterministic:
        return ("cta_group=2 with deterministic=True: the 2-CTA backward has no dQ semaphore chain (the pair's "
                "two CTAs add different rows of one query block)")
    if softcap and not BWD_TWO_CTA_SOFTCAP:
        return "cta_group=2 with softcap: the 2-CTA backward is built without softcap (not compiled with it)"
    return None


def select_bwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = ARCH,
                      deterministic: bool = False, local: bool = False, softcap: bool = False,
                      headdim_v: int | None = None, two_cta: bool = False, bwd_pass: str = "both",
                      **kwargs) -> Sm100BwdConfig:
    """The sm100 backward config for one problem class (pure; CPU-tested): hd64 / hd128 and (192, 128)
    (headdim_v=128: the serial schedule; softcap except bf16 + causal + deterministic, bwd_serial_problem),
    bf16 / fp16, causal or not, a sliding window (local: causal folded in), deterministic or not, softcap
    or not, dense, MHA and GQA/MQA (one CTA per KV head walks its query heads), and hd256 as two passes
    (1-CTA; causal, window, deterministic and softcap as hd64/128; packed sequences through
    bwd_packed_config as every 1-CTA config). Raises ValueError naming what is missing for everything
    else (another head dim; another Dv; softcap at (192, 128) in bf16 with causal and deterministic).
    Same arguments as
    flash4.config.sm90.select_bwd_config (the others ignored). two_cta: take the 2-CTA variant where it
    is built (bwd_two_cta_problem is None; otherwise the 1-CTA config); the host passes
    env.sm100_2cta() (FLASH4_SM100_2CTA, default off). bwd_pass: one pass of a two-pass config (hd256:
    "dv" or "dkdq"; the default "both" gives the "dkdq" config there, which writes dK and dQ and names
    the call in the self-test; bwd_passes(cfg) lists the configs the host launches, "dv" first)."""
    if arch != ARCH:
        raise ValueError(f"flash4.config.sm100 builds sm_100a kernels only, got arch={arch}")
    dv = headdim if headdim_v is None else headdim_v
    if (headdim, dv) in SM100_BWD_TWO_PASS_PAIRS:  # hd256: "both" means the dkdq pass (bwd_passes has both)
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}; allowed: {DTYPES}")
        bwd_pass = "dkdq" if bwd_pass == "both" else bwd_pass  # two_cta falls back to the 1-CTA passes
        plan = default_bwd_register_plan_pass(bwd_pass)
        return Sm100BwdConfig(headdim=headdim, dtype=dtype, causal=causal and not local, local=local,
                              deterministic=deterministic, softcap=softcap, bwd_pass=bwd_pass,
                              q_stages=bwd_q_stages(headdim, dv, bwd_pass),
                              regs_reduce=plan.reduce, regs_compute=plan.compute, regs_other=plan.other)
    if bwd_pass != "both":
        raise ValueError(f"bwd_pass={bwd_pass!r} at (headdim, headdim_v)=({headdim}, {dv}): the two-pass backward "
                         f"is built for {SM100_BWD_TWO_PASS_PAIRS} only")
    if headdim not in {d for d, _ in SM100_BWD_HEADDIM_PAIRS}:
        raise ValueError(f"headdim={headdim}: no sm100 backward; {_bwd_built_text(headdim)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {DTYPES}")
    if (headdim, dv) not in SM100_BWD_HEADDIM_PAIRS:
        what = "V head dim different from Q/K's" if dv != headdim else "V head dim equal to Q/K's"
        tmem = bwd_tmem_problem(headdim, dv)
        raise ValueError(f"the sm100 backward has no {what} at (headdim, headdim_v)=({headdim}, {dv})"
                         + (f" ({tmem})" if tmem else "") + "; compile-verified 1-CTA backward: dense hd64/hd128 "
                         "(causal, window or neither, deterministic or not, softcap or not, MHA/GQA), (192, 128) "
                         "(the same; softcap not with bf16 + causal + deterministic) and hd256 as two passes; "
                         "2-CTA: hd128 and (192, 128)")
    hdv = None if dv == headdim else dv
    serial = 2 * BWD_TILE_M + headdim + dv > TMEM_COLUMNS
    if serial and bwd_serial_problem(softcap, dtype, causal and not local, deterministic) is not None:
        raise ValueError(bwd_serial_problem(softcap, dtype, causal and not local, deterministic))
    if two_cta and bwd_two_cta_problem(headdim, causal and not local, local, deterministic, softcap,
                                       headdim_v=hdv) is None:
        plan = default_bwd_register_plan_2cta(headdim, causal, dv, dtype, softcap)
        return Sm100BwdConfig(headdim=headdim, dtype=dtype, causal=causal, cta_group=2, q_stages=BWD_Q_STAGES_2CTA,
                              softcap=softcap, headdim_v=hdv, regs_reduce=plan.reduce, regs_compute=plan.compute,
                              regs_other=plan.other)
    plan = default_bwd_register_plan(headdim, causal)
    return Sm100BwdConfig(headdim=headdim, dtype=dtype, causal=causal and not local, local=local,
                          deterministic=deterministic, softcap=softcap, headdim_v=hdv,
                          q_stages=bwd_q_stages(headdim, dv),
                          regs_reduce=plan.reduce, regs_compute=plan.compute, regs_other=plan.other)


def bwd_packed_config(cfg, seqused_q: bool = False, seqused_k: bool = False):
    """`cfg` (a 1-CTA config of select_bwd_config) for packed sequences (varlen_q and varlen_k, optionally
    seqused_q / seqused_k) with the register plan of its packed layout (default_bwd_register_plan; a pass
    of a two-pass config keeps its pass's plan, default_bwd_register_plan_pass, dense or packed)."""
    if cfg.bwd_pass != "both":
        plan = default_bwd_register_plan_pass(cfg.bwd_pass)
    else:
        plan = default_bwd_register_plan(cfg.headdim, cfg.causal, packed=True)
    return with_seq_layout(cfg, varlen_q=True, varlen_k=True, seqused_q=seqused_q, seqused_k=seqused_k,
                           regs_reduce=plan.reduce, regs_compute=plan.compute, regs_other=plan.other)


def bwd_passes(cfg) -> tuple:
    """The configs the host launches in sequence for `cfg`: (cfg,), or for a pass of a two-pass config
    (hd256) the "dv" then the "dkdq" config of the same problem class (dV from the first, dK and dQ
    from the second; the same preprocess, dQ accumulator and postprocess)."""
    if cfg.bwd_pass == "both":
        return (cfg,)
    return tuple(_pass_config(cfg, p) for p in BWD_TWO_PASS_ORDER)


def _pass_config(cfg, bwd_pass: str):
    plan = default_bwd_register_plan_pass(bwd_pass)
    return dataclasses.replace(cfg, bwd_pass=bwd_pass, regs_reduce=plan.reduce, regs_compute=plan.compute,
                               regs_other=plan.other)


def two_pass_bwd_configs() -> list:
    """The hd256 pass configs (compile-checked in tests/cpu/test_sm100_bwd_passes.py, not in
    shipped_bwd_configs' generic gates): bf16 / fp16 x (full, causal, window) x deterministic or not,
    each as its "dv" and "dkdq" pass (24), then softcap in bf16 x (full, causal, window), each pass
    (6; as shipped_bwd_configs: softcap only adds the compute warps' tanh, and in pass dkdq the dS
    factor, independent of the dtype and the deterministic dQ chain). Packed variants (with_seq_layout,
    as bwd_plan makes them) are compile-checked there too but not listed: the host builds them on demand."""
    masks = ((False, False), (True, False), (False, True))
    plain = [c for det in (False, True) for dt in DTYPES for causal, local in masks
             for c in bwd_passes(select_bwd_config(256, dt, causal, local=local, deterministic=det))]
    softcap = [c for causal, local in masks
               for c in bwd_passes(select_bwd_config(256, "bf16", causal, local=local, softcap=True))]
    return plain + softcap


def shipped_bwd_configs() -> list:
    """The sm100 backward configs compiled in CI: every one the API can select without softcap,
    hd64/128 x bf16/fp16 x (full, causal, window) x deterministic or not (24), then one softcap
    config per head dim and mask, bf16, hd64/128 x (full, causal) (4; the API selects the other
    softcap combinations too: softcap only adds the compute warps' tanh and dS factor, independent of
    the dtype, the window and the deterministic dQ chain), then the same 12 without softcap at (192, 128)
    (the serial 1-CTA schedule, bwd_serial_schedule) and the 11 of them with softcap that are built
    (bwd_serial_problem), then the 2-CTA configs (opt-in, FLASH4_SM100_2CTA=1): hd128 x bf16/fp16 x the masks
    bwd_two_cta_problem accepts (full, causal: 4), and softcap in bf16, full and causal (2), then the same 6
    at (192, 128) (the serial 2-CTA schedule, bwd_two_cta_serial)."""
    no_softcap = [select_bwd_config(d, dt, c, local=lo, deterministic=det) for det in (False, True)
                  for d in SM100_BWD_HEADDIMS for dt in DTYPES
                  for c, lo in ((False, False), (True, False), (False, True))]
    softcap = [select_bwd_config(d, "bf16", c, softcap=True) for d in SM100_BWD_HEADDIMS for c in (False, True)]
    # (192, 128), the serial schedule: the same 12 combinations without softcap, then those with softcap that
    # are built (11: every one, at the edge of its register budget, is compiled)
    serial = [select_bwd_config(d, dt, c, local=lo, deterministic=det, headdim_v=dv, softcap=sc)
              for sc in (False, True) for d, dv in SM100_BWD_HEADDIM_PAIRS if d != dv for det in (False, True)
              for dt in DTYPES for c, lo in ((False, False), (True, False), (False, True))
              if bwd_serial_problem(sc, dt, c, det) is None]
    two_cta = []
    for d, dv in SM100_BWD_2CTA_PAIRS:  # hd128 (pipelined), then (192, 128) (serial)
        hdv = None if dv == d else dv
        two_cta += [select_bwd_config(d, dt, c, headdim_v=hdv, two_cta=True) for dt in DTYPES for c in (False, True)
                    if bwd_two_cta_problem(d, c, headdim_v=hdv) is None]
        two_cta += [select_bwd_config(d, "bf16", c, softcap=True, headdim_v=hdv, two_cta=True) for c in (False, True)
                    if bwd_two_cta_problem(d, c, softcap=True, headdim_v=hdv) is None]
    return no_softcap + softcap + serial + two_cta


def bwd_plan(request, arch: int = ARCH, heads_per_cta: int | None = None):
    """The backward plan of a dense or packed (cu_seqlens, optionally seqused_q / seqused_k; 1-CTA
    only) flash4.request.Request on sm100: select_bwd_config's checks; the query heads of a KV head all run in its CTA (no head split).
    Raises ValueError naming what is missing."""
    from flash4.config import BwdPlan

    seq, mask = request.seq, request.mask
    if seq.paged or seq.decode:
        raise ValueError(f"the sm100 backward has no {seq.layout} layout")
    cfg = select_bwd_config(request.headdim, request.dtype, mask.causal, arch=arch,
                            deterministic=request.deterministic, local=mask.local,
                            softcap=request.score.softcap > 0,
                            headdim_v=None if request.headdim_v == request.headdim else request.headdim_v,
                            two_cta=env.sm100_2cta() and not seq.packed)
    if seq.packed:  # 1-CTA only (the 2-CTA backward is dense)
        cfg = bwd_packed_config(cfg, seqused_q=seq.seqused_q is not None, seqused_k=seq.seqused_k is not None)
    passes = bwd_passes(cfg)  # hd256: the dv and dkdq passes (cfg is the dkdq one)
    return BwdPlan(cfg, request.nheads // request.nheads_k, passes=passes if len(passes) > 1 else ())
