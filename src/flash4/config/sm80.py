"""The sm80 (portable) family's kernel configurations and the pure functions that choose them.

The sm80 family is built on the warp-level tensor-core MMA (mma.sync m16n8k16), ldmatrix and
cp.async: instructions every GPU since Ampere executes. Its kernels (flash4.kernels.sm80) are one
source compiled per target: sm_80 (A100), sm_86 / sm_89 (RTX 30xx / 40xx, L4, L40), sm_120a (RTX 50xx,
RTX PRO 6000) and, for testing on Hopper, sm_90a (the same instructions run there). A config's
`arch` is the target it is compiled for, and its tiles are chosen to fit that target's shared
memory (flash4.arch.CAPS, CUTLASS's own table): the code path never depends on it.

Everything here is pure Python and tested on the CPU (tests/cpu/test_sm80_config.py).
"""

from __future__ import annotations

import dataclasses

from flash4 import env
from flash4.arch import capacity
from flash4.arch import gpu_arch_name as _target_name
from flash4.config import (SUPPORTED_HEADDIMS, BwdPlan, FwdPlan, canonical_hdimv, ceil_div, choose_num_splits,
                           with_seq_layout)
from flash4.constants import DTYPES, RESCALE_THRESHOLD_LOG2

# The SM versions this family is compiled for, and the --gpu-arch name of each (flash4.arch.
# gpu_arch_name: the arch-specific ("a") targets exist from sm_90 on; sm_80/86/89 take the plain names).
TARGETS = {80: "sm_80", 86: "sm_86", 89: "sm_89", 90: "sm_90a", 120: "sm_120a"}
# The archs the registry dispatches to this family by default (sm_90 runs the sm90 family unless
# the family is asked for explicitly: flash4.kernels.registry.family(90, prefer="sm80")).
NATIVE_ARCHS = (80, 86, 89, 120)

# Rows of the query tile per warp per MMA atom (mma.sync m16n8k16: M = 16).
MMA_M = 16


def gpu_arch_name(arch: int) -> str:
    """The DSL's --gpu-arch name of target `arch` (sm_80, sm_86, sm_89, sm_90a, sm_120a). Raises
    ValueError for an arch this family is not compiled for."""
    if arch not in TARGETS:
        raise ValueError(f"the sm80 family is not compiled for sm_{arch}; targets: {sorted(TARGETS)}")
    return _target_name(arch)


@dataclasses.dataclass(frozen=True)
class Sm80FwdConfig:
    """One compiled sm80-family forward kernel (the compile-cache key).

    headdim:      D of Q/K/V (elements), one of SUPPORTED_HEADDIMS.
    dtype:        "bf16" or "fp16".
    causal:       bottom-right aligned causal mask.
    tile_m:       query rows per CTA; a multiple of 16 x num_warps (each warp owns tile_m / num_warps rows).
    tile_n:       key rows per K/V block (a multiple of 16: P's k16 slices).
    num_warps:    warps per CTA; every warp loads (cp.async), multiplies and writes.
    kv_stages:    K and V smem buffers each: K runs kv_stages blocks ahead of the block being
                  multiplied, V kv_stages - 1 (1 = FlashAttention-2's schedule: next K during this
                  block's softmax and P V, this V during Q K^T).
    q_in_regs:    Q's MMA fragments are loaded from smem into registers once per tile (else
                  ldmatrix'd from smem at every key block; Q's smem holds O in the epilogue either way).
    arch:         the target it is compiled for (TARGETS): decides the tiles, never the code path.
    rescale_threshold: lazy-rescale tau in log2 units (kernels/common/softmax.OnlineSoftmax).
    exp2_emu_frac: share of exp2 evaluated by the FMA polynomial (0 = all MUFU.EX2).
    lpt:          causal: longest-processing-time-first tile order (kernels/common/scheduler.py).
    persistent:   grid = number of SMs, each CTA loops over tiles (else one CTA per tile).
    local, softcap, sink: sliding window, Gemma-2 softcap, learnable sink logit (as FwdConfig).
    Sequence layouts varlen_q / varlen_k / seqused_q / seqused_k: as FwdConfig (cu_seqlens / seqused
    tensors; the loads and stores are predicated per row).
    page_gather:  paged K/V (a page table; pages of any size >= 1): every thread cp.asyncs its key rows
                  from their own pages (kernels/common/paged_gather.PagedGather, the sm90 producer's
                  gather run by all the CTA's threads), rows past seqlen_k zero-filled. No TMA.
    split_kv:     the key blocks of each query tile are split into num_splits runs (a runtime
                  argument), each writing fp32 partial O / LSE that flash4's combine kernel merges
                  (the decode step of a KV cache; the sm90 forward's scheme).
    headdim_v:    V's head dim when it differs (flash4.config.HDIMV_PAIRS; None: Dv = D).
    Fields the family does not implement, kept so the host's code reads every config alike:
    page_rows (TMA page pieces) = 0, pack_gqa = 1.
    """

    headdim: int
    dtype: str = "bf16"
    causal: bool = False
    tile_m: int = 128
    tile_n: int = 64
    num_warps: int = 4
    kv_stages: int = 2
    q_in_regs: bool = False
    arch: int = 80
    rescale_threshold: float = RESCALE_THRESHOLD_LOG2
    exp2_emu_frac: float = 0.0
    lpt: bool = False
    persistent: bool = False
    local: bool = False
    softcap: bool = False
    sink: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    page_rows: int = 0
    split_kv: bool = False
    headdim_v: int | None = None
    pack_gqa: int = 1
    page_gather: bool = False

    def __repr__(self) -> str:
        # page_gather only when on: every non-paged config keeps its repr (the compile-cache key).
        fields = (f for f in dataclasses.fields(self) if not (f.name == "page_gather" and not self.page_gather))
        return f"{type(self).__qualname__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"

    def __post_init__(self):
        assert self.headdim in SUPPORTED_HEADDIMS, self.headdim
        assert self.dtype in DTYPES, self.dtype
        assert self.arch in TARGETS, self.arch
        assert self.tile_m % (MMA_M * self.num_warps) == 0, (self.tile_m, self.num_warps)
        assert self.tile_n % 16 == 0 and self.kv_stages >= 1, (self.tile_n, self.kv_stages)
        assert not (self.causal and self.local), "a window folds causal into its right side"
        assert self.page_rows == 0 and self.pack_gqa == 1, (
            f"not implemented in the sm80 family: {self}")
        assert self.headdim_v is None or canonical_hdimv(self.headdim, self.headdim_v) == self.headdim_v, self

    @property
    def paged(self) -> bool:
        """K/V are pages read through a page table (gathered rows: page_gather)."""
        return self.page_rows > 0 or self.page_gather

    @property
    def hdim_v(self) -> int:
        """Dv: the head dim of V and O (= headdim in this family so far)."""
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def rows_per_warp(self) -> int:
        return self.tile_m // self.num_warps

    def smem_bytes(self) -> int:
        """Dynamic shared memory (bytes): Q (O reuses it in the epilogue) + kv_stages K and V
        blocks. Every buffer is a multiple of 1 KiB, so the 1 KiB alignment of each adds nothing."""
        elt = 2
        q = self.tile_m * max(self.headdim, self.hdim_v) * elt
        kv = self.kv_stages * self.tile_n * (self.headdim + self.hdim_v) * elt
        return q + kv

    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM allowed by shared memory alone (capacity of `arch` per CTA; the
        per-SM pool is that plus 1 KiB on every target listed)."""
        per_sm = capacity(self.arch).smem_per_block + 1024
        return per_sm // self.smem_bytes()

    def accumulator_regs(self) -> int:
        """fp32 registers per thread of the O and S accumulators (the register budget's bulk:
        each warp holds rows_per_warp x (Dv + tile_n) values over 32 lanes)."""
        return self.rows_per_warp * (self.hdim_v + self.tile_n) // 32


# Tiles per (smem class, headdim): ((tile_m, tile_n, num_warps, kv_stages, q_in_regs) non-causal,
# the same causal).
# The three shared-memory classes (flash4.arch.CAPS, CUTLASS's table):
#   "hopper": sm_90  227 KiB/CTA (228 KiB/SM);   "a100": sm_80 163 KiB/CTA (164 KiB/SM);
#   "small":  sm_86, sm_89, sm_120  99 KiB/CTA (100 KiB/SM).
# Starting point: FlashAttention-2's table (flash_fwd_launch_template.h, measured there on A100,
# RTX 3090 and H100): 4 warps with two CTAs per SM wherever registers and smem allow (8 warps per
# SM; two CTAs drift apart, so one's softmax overlaps the other's MMAs), 8 warps at d192, and on the
# 99 KiB parts the shapes FA2 measured fastest there ("square" 64 x 64 tiles for causal d96/d128).
# Then every shape must compile without a register spill on every target (the CPU compile sweep,
# CuTe DSL 4.8.1's ptxas): 4 warps x 32 query rows hold O (32 x D) and S (32 x tile_n) in
# registers, and FA2's 128 x 128 at d64 (O 64 + S 128 fp32 registers per thread) and 128 x 64 at
# d128 (O 128 + S 64) spill 81 and 72-98 local-memory instructions (CUTLASS's own Ampere example
# spills 57 at 128 x 64 d128), so d64 takes 128 x 64 and d128 128 x 32 (FA2's sm86 choice): the
# same 32 rows per warp, so each ldmatrix'd K/V fragment still feeds two m16 MMAs. d64 non-causal
# keeps Q in registers: with Q from smem ptxas spills 41 on sm_80/86/89 (none on sm_90a/120a), with
# Q in registers none anywhere (and 10% fewer LDSM); causal d64 is the other way round (2 spills
# with Q in registers on sm_80/86). kv_stages takes what smem gives while keeping those CTAs per
# SM: 2 stages where they fit, else FA2's single buffer.
# Not yet timed on any GPU (docs/design/sm80_family.md says what ran where).
_TILES = {
    "hopper": {
        64: ((128, 64, 4, 2, True), (128, 64, 4, 2, False)),  # 48 KiB
        96: ((128, 64, 4, 2, False), (128, 64, 4, 2, False)),  # 72 KiB
        128: ((128, 32, 4, 2, False), (128, 32, 4, 2, False)),  # 64 KiB
        192: ((128, 64, 8, 2, False), (128, 64, 8, 2, False)),  # 144 KiB: one CTA of 8 warps (O, S: 96 + 32 registers)
        256: ((64, 64, 4, 1, False), (64, 64, 4, 1, False)),  # 96 KiB: FA2's H100 choice (2 CTAs) over 128 x 64 x 8 warps
    },
    "a100": {
        64: ((128, 64, 4, 2, True), (128, 64, 4, 2, False)),  # 48 KiB
        96: ((128, 64, 4, 2, False), (128, 64, 4, 2, False)),  # 72 KiB
        128: ((128, 32, 4, 2, False), (128, 32, 4, 2, False)),  # 64 KiB
        192: ((128, 64, 8, 2, False), (128, 64, 8, 2, False)),  # 144 KiB: one CTA of 8 warps
        256: ((128, 64, 8, 1, False), (128, 64, 8, 1, False)),  # 128 KiB: FA2's A100 choice
    },
    "small": {
        64: ((128, 64, 4, 2, True), (128, 64, 4, 2, False)),  # 48 KiB: 2 CTAs
        96: ((128, 64, 4, 1, False), (64, 64, 4, 1, False)),  # 48 / 36 KiB
        128: ((128, 32, 4, 1, False), (64, 64, 4, 1, False)),  # 48 / 48 KiB
        192: ((128, 64, 8, 1, False), (128, 64, 8, 1, False)),  # 96 KiB: one CTA of 8 warps
        256: ((64, 64, 4, 1, False), (64, 64, 4, 1, False)),  # 96 KiB
    },
}
# Paged (gathered) K/V: key tile per head dim where the table's spills with the gather (compile
# sweep, CuTe DSL 4.8.1: d256 64 x 64 spilled 34 / 44 local-memory instructions full / causal on
# sm_90a, 128 x 64 x 8 warps 15 / 35; 64 x 32: 0; d96 128 x 64 spilled 12 on sm_120a, 128 x 32: 0).
# Every other head dim keeps the table's tile.
PAGED_TILE_N = {96: 32, 256: 32}
_SMEM_CLASS = {80: "a100", 86: "small", 89: "small", 90: "hopper", 120: "small"}


# The words every "not in this family" error starts with: the GPU tests, run with the family forced
# (FLASH4_FAMILY=portable), skip a test whose error carries them (tests/gpu/conftest.py).
UNSUPPORTED_PREFIX = "flash4's portable kernel family (sm80) does not implement"


def unsupported(headdim_v: int | None = None, pack_gqa: bool = False) -> str | None:
    """Why the sm80 family has no kernel for these options, or None (one text for the config
    selection's error and for a dispatcher's support check). headdim_v: canonical_hdimv's value
    (None when it equals headdim), asked by the backward (the forward takes the value head dims).
    Paged K/V (gathered rows) and split-KV are served by the forward."""
    missing = [name for name, on in (("GQA packing", pack_gqa),
                                      ("headdim_v != headdim", headdim_v is not None)) if on]
    if missing:
        return f"{UNSUPPORTED_PREFIX} {', '.join(missing)} yet"
    return None


def select_fwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = 80,
                      local: bool = False, softcap: bool = False, sink: bool = False,
                      headdim_v: int | None = None, seqlen_k: int | None = None, varlen_q: bool = False,
                      varlen_k: bool = False, seqused_q: bool = False, seqused_k: bool = False,
                      paged: bool = False, split_kv: bool = False, q_in_regs: bool | None = None) -> Sm80FwdConfig:
    """The forward config for one problem class on target `arch` (pure; CPU-tested).

    local: a sliding window (causal folded into it: the config has causal False). seqlen_k is
    accepted for the host's common call and unused (no short-sequence variant yet). q_in_regs:
    None = the table's choice (Q in smem). paged: K/V through a page table, gathered row by row
    (page_gather; the tiles are the table's). Raises ValueError for an unsupported head dim, a
    target this family is not compiled for, or an option it does not implement yet
    (`unsupported`)."""
    if headdim not in SUPPORTED_HEADDIMS:
        raise ValueError(f"headdim={headdim} not supported; allowed: {SUPPORTED_HEADDIMS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} not supported; allowed: {DTYPES}")
    gpu_arch_name(arch)
    headdim_v = canonical_hdimv(headdim, headdim_v)
    causal = causal and not local
    # A value head dim (HDIMV_PAIRS) takes the tile of the wider of D and Dv: O (Dv) and S share the
    # registers the table balances per head dim ((64, 128) runs d128's 32-key tile); on the 99 KiB
    # parts its causal row's (d128 64 x 64: (64, 128) with the full row's 128 x 32 spilled 2 on
    # sm_120a).
    tile_key = max(headdim, headdim_v or headdim)
    row = 1 if causal or (headdim_v is not None and _SMEM_CLASS[arch] == "small") else 0
    tile_m, tile_n, num_warps, stages, q_regs = _TILES[_SMEM_CLASS[arch]][tile_key][row]
    # Q in registers fits the two loop bodies of a non-causal kernel; a window adds a third (like
    # causal) and then spills with it (d64 on sm_80: 2), without it not (compile sweep).
    q_regs = (q_regs and not local) if q_in_regs is None else q_in_regs
    if paged:  # the gather's page lookups and row addresses need registers the table's d256 tile lacks
        tile_n = PAGED_TILE_N.get(headdim, tile_n)
    cfg = Sm80FwdConfig(headdim=headdim, dtype=dtype, causal=causal, tile_m=tile_m, tile_n=tile_n,
                        num_warps=num_warps, kv_stages=stages, q_in_regs=q_regs, arch=arch,
                        lpt=causal, local=local, softcap=softcap, sink=sink, varlen_q=varlen_q,
                        varlen_k=varlen_k, seqused_q=seqused_q, seqused_k=seqused_k, headdim_v=headdim_v,
                        page_gather=paged, split_kv=split_kv)
    assert cfg.smem_bytes() <= capacity(arch).smem_per_block, cfg
    return cfg


def shipped_fwd_configs(arch: int | None = None) -> list[Sm80FwdConfig]:
    """Every plain forward config the table gives (head dims x dtypes x causal) for target `arch`,
    or for every target (TARGETS) when None."""
    archs = sorted(TARGETS) if arch is None else [arch]
    return [select_fwd_config(d, dt, c, arch=a) for a in archs for d in SUPPORTED_HEADDIMS for dt in DTYPES
            for c in (False, True)]


def paged_fwd_configs(arch: int | None = None) -> list[Sm80FwdConfig]:
    """The paged (gathered) forward configs the CPU compile check covers for target `arch` (every
    target when None): every head dim, bf16, causal or not, as the paged varlen door selects them
    (packed queries, seqused_k), and d128's decode step (seqused_k, dense queries, split-KV)."""
    archs = sorted(TARGETS) if arch is None else [arch]
    configs = []
    for a in archs:
        for d in SUPPORTED_HEADDIMS:
            for c in (False, True):
                configs.append(with_seq_layout(select_fwd_config(d, "bf16", c, arch=a, paged=True), varlen_q=True,
                                               seqused_k=True))
        # a decode step over a paged cache: 64-row tile, split-KV (32 heads x 1 query on 132 SMs)
        configs.append(kvcache_step_plan(select_fwd_config(128, "bf16", True, arch=a, paged=True), 1, 1, 32, 65536, 0,
                                   132).cfg)
    return configs


# ================================================================ backward
# Sm80BwdConfig fields left out of its repr (the compile-cache key) while off.
_SWITCHES_OFF_UNSHOWN = ("lse_early", "lse_smem", "p_before_dp", "dq_before_dk", "dp_split")


@dataclasses.dataclass(frozen=True)
class Sm80BwdConfig:
    """One compiled sm80-family backward kernel (the compile-cache key): FlashAttention-2's
    backward, one CTA per (key tile, KV head, batch) walking the query tiles of every query head of
    its KV head (kernels/sm80/bwd.py).

    headdim, dtype, causal, arch, local, softcap, varlen_q / varlen_k / seqused_q / seqused_k: as
    Sm80FwdConfig (the sequence layouts as flash4.config.BwdConfig's).
    tile_n:   keys per CTA (K, V, dK, dV stay in smem / registers for the whole CTA).
    tile_m:   queries per step of the CTA's loop.
    num_warps: warps per CTA (every warp loads, multiplies, and adds its dQ share).
    q_stages: Q / dO smem buffers each (2: the next query tile loads during this one; 1: after it).
    warps_m_sdp: warps along the queries of S = Q K^T and dP = dO V^T (the rest along the keys).
    warps_n_dkv: warps along the keys of dV = P^T dO and dK = dS^T Q (the rest along the head dim).
    warps_m_dq:  warps along the queries of dQ = dS K (the rest along the head dim).
    deterministic: the key tiles of a query tile add their dQ in n_block order (a counter per query
                  tile; bitwise-reproducible gradients), else unordered fp32 atomics.
    lse_early:    (speed candidate, off; FLASH4_PORTABLE_BWD=fa2e, tools/ab_portable.py variant "fa2e") the
                  step's LSE loads stay at the step's top, under the S and dP GEMMs (pin.keep_here):
                  without it LLVM sinks them into the common branch of the exact-path vote, after
                  both GEMMs, where every step waits for them (sm_90a SASS of the d64 "fa2" backward,
                  2026-12-04: the two LDG.E right before their first FFMA; FlashAttention-2 loads LSE
                  before its S GEMM). The same values: bitwise.
    lse_smem:     (speed candidate, off; FLASH4_PORTABLE_BWD=fa2s, variant "fa2s") the query tile's LSE_log2
                  and D come through shared memory: cp.async'd with the tile's dO (one 16-byte copy each
                  of the first tile_m / 2 threads), read back with LDS where the step uses them, so
                  nothing waits on a global load there and no register holds them across the GEMMs
                  (lse_early's cost at d128: 12 spill instructions). 2 * tile_m * q_stages * 4 bytes of
                  smem more. The same values: bitwise.
    p_before_dp:  (speed candidate, off; variants "fa2wp" / "fa2sp"; needs lse_smem) the step in
                  FlashAttention-2's order S, P, dP (P's exponentials between the two GEMMs, not after
                  both) and P without the exact-path branch there: P = 2^(fma(S, scale_log2, -hi) - lo)
                  with (hi, lo) = (LSE_log2, 0) on the common tiles and the forward's unrounded pair on
                  the exact ones, chosen at the step's top from the tile's exact flag, which rides
                  along with its dO into smem (4 bytes); so the S GEMM's tail, the exponentials and
                  the dP GEMM share one basic block ptxas can interleave, and dP's accumulators are not
                  live during the S GEMM. sm_90a SASS of the d64 fa2w step (2026-12-05): its 64
                  MUFU.EX2 per thread sit in a branch after all 128 HMMAs of S and dP, FlashAttention-2's
                  among its dP HMMAs. One FADD per element more (x - 0 = x: the same bits as the branch).
    dq_before_dk: (speed candidate, off; variants "fa2wq" / "fa2sq") the step's GEMMs in
                  FlashAttention-2's order dV, dQ, dK, so the dQ red.global.adds issue under the dK
                  GEMM instead of in one run after the last MMA (the same 2026-12-05 SASS: flash4's 32
                  REDG per thread after its last HMMA, FlashAttention-2's among its dK HMMAs). The same
                  values: bitwise (independent accumulators; the adds' order was never fixed but
                  under deterministic, where the turn wait moves with them).
    dp_split:     (speed candidate, off; variants "fa2wps" / "fa2wpqs", "fa2sps" / "fa2spqs"; needs
                  p_before_dp) p_before_dp's step with the dP = dO V^T GEMM's k-loop issued in two
                  halves and P's exponentials in two halves of the thread's rows: S, the first rows'
                  exponentials, dP's first k-half, the other rows' exponentials, P -> smem, dP's
                  second k-half; so each block of MUFU.EX2 sits next to independent MMA work
                  instead of one block in front of the whole dP GEMM (p_before_dp spills 2-21
                  instructions at two Q / dO stages, d64). Compiled (2026-12-05 evening) it spills
                  more, not less: sm_90a d64 17-46, d128 22-56 instructions (docs/design/sm80_family.md,
                  "dp_split"); A/B only. The same operations per element: bitwise.
    dq_coalesced: dq_accum's tiles are in the dQ MMA's register order (value i of thread t at tile
                  offset i * num_threads + t, FlashAttention-2's dQaccum order), so each warp's
                  red.global.add covers 128 contiguous bytes instead of 8 rows x 32 bytes; the dQ
                  postprocess undoes it (kernels/sm80/bwd.py DqPostprocessSm80). Dense only (not
                  varlen_q). A speed candidate (docs/design/sm80_family.md, "Backward speed").
    Host-shared fields with fixed values here (flash4.backward reads every family's config alike):
    headdim_v None, dkv_accum False (dK / dV of every query head of a KV head are summed in
    registers); dq_accum_order = dq_coalesced (else row-major fp32 dQ).
    """

    headdim: int
    dtype: str = "bf16"
    causal: bool = False
    tile_m: int = 64
    tile_n: int = 128
    num_warps: int = 8
    q_stages: int = 2
    warps_m_sdp: int = 4
    warps_n_dkv: int = 4
    warps_m_dq: int = 4
    arch: int = 80
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    local: bool = False
    softcap: bool = False
    deterministic: bool = False
    headdim_v: int | None = None
    dkv_accum: bool = False
    dq_coalesced: bool = False
    lse_early: bool = False
    lse_smem: bool = False
    p_before_dp: bool = False
    dq_before_dk: bool = False
    dp_split: bool = False

    def __repr__(self) -> str:
        # the candidates' switches only when on: every other config keeps its repr (the compile-cache key).
        fields = (f for f in dataclasses.fields(self) if not (f.name in _SWITCHES_OFF_UNSHOWN
                                                               and not getattr(self, f.name)))
        return f"{type(self).__qualname__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"

    def __post_init__(self):
        assert self.headdim in SUPPORTED_HEADDIMS, self.headdim
        assert self.dtype in DTYPES, self.dtype
        assert self.arch in TARGETS, self.arch
        assert not (self.causal and self.local), "a window folds causal into its right side"
        assert not (self.dq_coalesced and self.varlen_q), "the register-order dq_accum is for dense layouts only"
        assert not self.dkv_accum, f"not implemented in the sm80 family: {self}"
        assert self.headdim_v is None or canonical_hdimv(self.headdim, self.headdim_v) == self.headdim_v, self
        w = self.num_warps
        for warps_a, extent_a, extent_b in ((self.warps_m_sdp, self.tile_m, self.tile_n),
                                             (self.warps_n_dkv, self.tile_n, self.headdim),
                                             (self.warps_n_dkv, self.tile_n, self.hdim_v),
                                             (self.warps_m_dq, self.tile_m, self.headdim)):
            # each warp takes 16 x 16 blocks of the GEMM's (A rows x B rows) tile
            assert w % warps_a == 0 and extent_a % (16 * warps_a) == 0 and extent_b % (16 * (w // warps_a)) == 0, (
                self, warps_a, extent_a, extent_b)
        assert self.q_stages in (1, 2), self.q_stages
        assert not self.p_before_dp or (self.lse_smem and not self.softcap), (
            "p_before_dp reads the staged LSE (lse_smem); softcap's dS reads the rounded LSE_log2")
        assert not self.p_before_dp or self.tile_m <= self.num_threads, (
            "p_before_dp stages LSE, D, the exact flag and lo with tile_m / 4 threads each")
        assert not self.dp_split or self.p_before_dp, "dp_split splits p_before_dp's step (needs p_before_dp)"

    @property
    def hdim_v(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def dynamic_seqlen_k(self) -> bool:
        """The key count differs per sequence (BwdConfig.dynamic_seqlen_k's meaning)."""
        return self.varlen_k or self.seqused_k

    @property
    def dq_accum_order(self) -> bool:
        """dq_accum's tiles are in the dQ MMA's register order (dq_coalesced: flash4.backward converts
        them with DqPostprocessSm80), else row-major (the plain postprocess)."""
        return self.dq_coalesced

    def smem_bytes(self) -> int:
        """K, V (one tile each), q_stages Q and dO tiles, P and dS (tile_m x tile_n, 16-bit)."""
        elt = 2
        kv = self.tile_n * (self.headdim + self.hdim_v) * elt
        q_do = self.q_stages * self.tile_m * (self.headdim + self.hdim_v) * elt
        p_ds = 2 * self.tile_m * self.tile_n * elt
        lse = 2 * self.q_stages * self.tile_m * 4 if self.lse_smem else 0  # LSE and D
        lse += (16 + 4 * self.tile_m) * self.q_stages if self.p_before_dp else 0  # exact flags (16-byte slots), lo
        return kv + q_do + p_ds + lse

    def accumulator_regs(self) -> int:
        """fp32 registers per thread held across the query loop (dK, dV) plus S and dP of a step."""
        return (self.tile_n * (self.headdim + self.hdim_v) + 2 * self.tile_m * self.tile_n) // self.num_threads


# Backward tiles per (smem class, headdim): (tile_m, tile_n, num_warps, q_stages, warps_m_sdp,
# warps_n_dkv, warps_m_dq), causal or not. Starting point FlashAttention-2's sm80 backward
# (64 x 128 at d64, 8 warps); with CuTe DSL's ptxas the register bound is dK + dV (held across the
# CTA's whole loop) + S + dP: 8 warps over 64 x 128 (d64) keep 32 + 32 + 32 + 32 fp32 registers per
# thread; d96 / d128 take 64 x 64 (dK + dV 48 / 64, S + dP 32), d192 64 x 64 (dK + dV 96) or
# 32 x 64 on the 99 KiB parts, d256 64 x 32 (64 x 64: dK + dV 128, spills 2 on sm_80). The Q / dO double buffer where smem allows it (sm_80, sm_90: 227 /
# 163 KiB), one buffer on the 99 KiB parts where two do not fit. No d256 backward on the 99 KiB
# parts (K + V alone take 64 KiB of tile_n = 64). Not yet timed on any GPU.
_BWD_TILES = {
    "big": {
        64: (64, 128, 8, 2, 4, 4, 4),  # 96 KiB
        96: (64, 64, 8, 2, 4, 4, 4),  # 88 KiB
        128: (64, 64, 8, 2, 4, 4, 4),  # 112 KiB
        192: (64, 64, 8, 1, 4, 4, 4),  # 112 KiB
        256: (64, 32, 8, 1, 4, 2, 4),  # 104 KiB: 64 x 64 spills 2 on sm_80 (dK + dV alone 128 registers)
    },
    "small": {
        64: (64, 128, 8, 2, 4, 4, 4),  # 96 KiB
        96: (64, 64, 8, 2, 4, 4, 4),  # 88 KiB
        128: (64, 64, 8, 1, 4, 4, 4),  # 80 KiB
        192: (32, 64, 8, 1, 2, 4, 2),  # 80 KiB
    },
}
_BWD_SMEM_CLASS = {80: "big", 86: "small", 89: "small", 90: "big", 120: "small"}


def bwd_headdims(arch: int) -> tuple:
    """Head dims with a backward kernel on target `arch`."""
    return tuple(sorted(_BWD_TILES[_BWD_SMEM_CLASS[arch]]))


def select_bwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = 80,
                      deterministic: bool = False, local: bool = False, softcap: bool = False,
                      headdim_v: int | None = None, varlen_q: bool = False, varlen_k: bool = False,
                      seqused_q: bool = False, seqused_k: bool = False) -> Sm80BwdConfig:
    """The backward config for one problem class on target `arch` (pure; CPU-tested). A value head
    dim (flash4.config.HDIMV_PAIRS) takes the table's tiles of max(D, Dv). Raises ValueError for an
    unsupported head dim / dtype / target / (D, Dv) pair."""
    if headdim not in SUPPORTED_HEADDIMS:
        raise ValueError(f"headdim={headdim} not supported; allowed: {SUPPORTED_HEADDIMS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} not supported; allowed: {DTYPES}")
    gpu_arch_name(arch)
    headdim_v = canonical_hdimv(headdim, headdim_v)
    table = _BWD_TILES[_BWD_SMEM_CLASS[arch]]
    tile_key = max(headdim, headdim_v or headdim)
    if tile_key not in table:
        raise ValueError(f"{UNSUPPORTED_PREFIX} a backward for headdim {tile_key} on sm_{arch} (its 99 KiB of shared "
                         f"memory per CTA; head dims with a backward there: {bwd_headdims(arch)})")
    tile_m, tile_n, num_warps, q_stages, wm_sdp, wn_dkv, wm_dq = table[tile_key]
    cfg = Sm80BwdConfig(headdim=headdim, dtype=dtype, causal=causal and not local, tile_m=tile_m, tile_n=tile_n,
                        num_warps=num_warps, q_stages=q_stages, warps_m_sdp=wm_sdp, warps_n_dkv=wn_dkv,
                        warps_m_dq=wm_dq, arch=arch, varlen_q=varlen_q, varlen_k=varlen_k, seqused_q=seqused_q,
                        seqused_k=seqused_k, local=local, softcap=softcap, deterministic=deterministic,
                        headdim_v=headdim_v)
    assert cfg.smem_bytes() <= capacity(arch).smem_per_block, cfg
    return cfg


# Backward speed candidates (docs/design/sm80_family.md, "Backward speed"): the A/B harness
# tools/ab_portable.py times each against the table on the H200 and checks its gradients; the one
# that won is shipped for plain dense problems (SHIPPED_BWD_CANDIDATE, below).
#   coal: the table's tiles with dq_coalesced (dQ reduce-adds in the MMA's register order: one
#         128-byte line per warp-wide red instead of 8 rows x 32 bytes); every target.
#   fa2:  FlashAttention-2's sm80 backward tiles for >= 144 KiB of smem per CTA
#         (flash_bwd_launch_template.h: d64 Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4>, d128
#         <128, 64, 128, 8, 2, 4, 2>) with dq_coalesced: twice the keys (d128) / queries (d64) per
#         ldmatrix'd fragment and per dQ add; 160 KiB of smem, so the 163 / 227 KiB targets only.
#         Without dq_coalesced both spill under CuTe DSL 4.8.1's ptxas (d128: 21 local-memory
#         instructions, d64: 6, sm_90a); with it, and the tile's coordinates re-derived after the
#         loop, FA2's exact d128 shape compiles clean non-causal but spills 2 causal, so d128 takes
#         2 warps along the keys of dK / dV (64 keys x 32 columns each; the same ldmatrix per MMA):
#         0 spills. d64 non-causal still spills with FA2's warps (4 x 2 on S / dP: 4 local-memory
#         instructions in the loop; 2 x 4: 12; q_stages 1: 4), so it takes all 8 warps along the
#         queries of S / dP (16 rows x 128 keys each): 0 spills.
#   m128: d128 with 128 queries x 64 keys (warps 4, 2, 4), dq_coalesced: half fa2's dK / dV
#         registers (64 + S, dP 32 + 32 per thread), about its ldmatrix per MMA (0.475 vs 0.45
#         in SASS), a dQ add per 64 keys. q_stages 2 (192 KiB) where it fits (sm_90), else 1
#         (128 KiB: sm_80). 0 spills on sm_90a.
# A candidate whose smem exceeds the target's capacity with q_stages 2 takes q_stages 1, else is
# dropped for that target.
#   fa2s: fa2 with lse_smem (the step's LSE and D through smem, staged with its dO; compile-verified,
#         not run on hardware yet): d64 and d128.
#   fa2w: d64 at FlashAttention-2's own warp layout (4 warps along the queries of S / dP, 2 along the
#         keys: Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4>) with lse_smem, which frees the
#         registers whose lack made fa2 take 8 x 1 (0 spills on sm_90a; ldmatrix per step 168 -> 144,
#         FA2's count). Compile-verified, not run on hardware yet.
#   fa2e: fa2 with lse_early (the step's LSE loads kept under its S and dP GEMMs; compile-verified,
#         not run on hardware yet). d64 only: at d128 (253 registers) holding the step's 8 LSE values
#         across the GEMMs spills 12 local-memory instructions (sm_90a); there the LSE would have to
#         come through smem with the Q / dO cp.async stage.
BWD_CANDIDATES = {
    "coal": {},
    "fa2": {"big": {64: (128, 128, 8, 2, 8, 4, 4), 128: (64, 128, 8, 2, 2, 2, 2)}},
    "m128": {"big": {128: (128, 64, 8, 2, 4, 2, 4)}},
    "fa2e": {"big": {64: (128, 128, 8, 2, 8, 4, 4)}},
    "fa2s": {"big": {64: (128, 128, 8, 2, 8, 4, 4), 128: (64, 128, 8, 2, 2, 2, 2)}},
    "fa2w": {"big": {64: (128, 128, 8, 2, 4, 4, 4)}},
}
# Fields a candidate sets besides its tiles and dq_coalesced.
#   fa2wp / fa2wq / fa2wpq, fa2sp / fa2sq / fa2spq: the shipped fa2w (d64) / fa2s (d128) with
#         p_before_dp, dq_before_dk or both (2026-12-05, from the sm_90a SASS of fa2w's step against
#         FlashAttention-2's: the same ~1,350 executed instructions per step, but flash4's exponentials
#         and dQ adds each in a run of their own; compile-verified, not run on hardware). p_before_dp
#         spills at q_stages 2 (255 registers: d64 2-21, d128 8 spill instructions), not at q_stages 1:
#   fa2wp1 / fa2wpq1, fa2sp1 / fa2spq1: the same with one Q / dO buffer (the next tile loads after the
#         step, behind a barrier), 0 spills at d64 / d128, full and causal (sm_90a); fa2w1 the d64
#         one-buffer control without the switches (at d128 fa2s with one buffer and no switch spills
#         2 / 4 instructions, full / causal: no control there).
#   fa2wps / fa2wpqs, fa2sps / fa2spqs: fa2wp / fa2wpq, fa2sp / fa2spq (two Q / dO stages) with
#         dp_split (dP's k-loop in two halves, half of P's exponentials between them; 2026-12-05
#         evening, compile-verified, not run on hardware; spills more than p_before_dp: sm_90a d64
#         17-46, d128 22-56 instructions: docs/design/sm80_family.md, "dp_split").
BWD_CANDIDATE_FIELDS = {"fa2e": {"lse_early": True}, "fa2s": {"lse_smem": True}, "fa2w": {"lse_smem": True}}

# The step-order candidates, generated: base (its tiles at head dim d) + "p" (p_before_dp) / "q"
# (dq_before_dk) + "1" (one Q / dO buffer) + "s" (dp_split, with "p" only). No "fa2s1": at d128 one
# buffer without a switch spills.
_STEP_ORDER_VARIANTS = {"fa2w": (64, ("p", "q", "pq", "1", "p1", "pq1", "ps", "pqs")),
                        "fa2s": (128, ("p", "q", "pq", "p1", "pq1", "ps", "pqs"))}
for _base, (_d, _suffixes) in _STEP_ORDER_VARIANTS.items():
    for _sfx in _suffixes:
        _tiles = BWD_CANDIDATES[_base]["big"][_d]
        if _sfx.endswith("1"):
            _tiles = _tiles[:3] + (1,) + _tiles[4:]
        BWD_CANDIDATES[_base + _sfx] = {"big": {_d: _tiles}}
        BWD_CANDIDATE_FIELDS[_base + _sfx] = {"lse_smem": True, **({"p_before_dp": True} if "p" in _sfx else {}),
                                              **({"dq_before_dk": True} if "q" in _sfx else {}),
                                              **({"dp_split": True} if "s" in _sfx else {})}
del _base, _d, _suffixes, _sfx, _tiles

# The candidate the backward ships (bwd_plan) for dense, plain problems (no softcap, window or
# deterministic order; full or causal, bf16 / fp16) where it applies (shipped_bwd_candidate): "fa2"
# (d64 / d128 on the >= 163 KiB targets) since 2026-12-02 night, H200, tools/ab_portable.py (5
# interleaved rounds), the 8 sweep cells d64 / d128 x full / causal x 1k / 4k: 1.27-2.16x the table
# (geomean 1.64), i.e. 0.88-0.99x FlashAttention-2 (SDPA flash) in the same run, where the table ran
# 0.46-0.72x. Not for the other problems: with fa2's tiles softcap spills on sm_90a (d64 16, d128 4
# local-memory instructions) and sm_80 (d64 2), a d128 window spills 4 on sm_90a, d128 deterministic
# 24 on sm_80 (compile check, CuTe DSL 4.8.1); those keep the table. FLASH4_PORTABLE_BWD=table runs
# the table. Since 2026-12-05, per head dim (SHIPPED_BWD_BY_HEADDIM): d64 "fa2w" (FA2's warp layout,
# LSE and D through smem) and d128 "fa2s" (fa2's tiles, LSE and D through smem), H200, same tool (3
# interleaved rounds) against fa2: fa2w 1.086-1.095x on the four d64 cells, fa2s 1.021-1.033x on the
# four d128 cells, gradients within the A/B's comparison, the portable GPU backward suite (100 tests)
# passed with each. d128 on sm_80 keeps fa2: fa2s spills 2 local-memory instructions there (bf16
# causal, compile check).
SHIPPED_BWD_CANDIDATE = "fa2"  # where SHIPPED_BWD_BY_HEADDIM names nothing (or on sm_80 at d128)
SHIPPED_BWD_BY_HEADDIM = {64: "fa2w", 128: "fa2s"}


def shipped_bwd_candidate(cfg: Sm80BwdConfig) -> str:
    """The name of the speed candidate the plain dense backward ships for cfg's head dim and target
    (SHIPPED_BWD_BY_HEADDIM, SHIPPED_BWD_CANDIDATE); bwd_candidates(cfg) says whether it applies. Pure."""
    name = SHIPPED_BWD_BY_HEADDIM.get(cfg.headdim, SHIPPED_BWD_CANDIDATE)
    if name == "fa2s" and cfg.arch == 80:  # 2 spill instructions there (bf16 causal)
        return SHIPPED_BWD_CANDIDATE
    return name


def bwd_candidates(cfg: Sm80BwdConfig) -> dict:
    """{name: config} of the speed candidates (BWD_CANDIDATES) that apply to the shipped config cfg
    (same problem class and target; dense layouts with Dv = D only: dq_coalesced is, and the
    candidates' tiles were checked at Dv = D)."""
    if cfg.varlen_q or cfg.headdim_v is not None:
        return {}
    out = {}
    for name, tables in BWD_CANDIDATES.items():
        tiles = tables.get(_BWD_SMEM_CLASS[cfg.arch], {}).get(cfg.headdim) if tables else None
        if tables and tiles is None:
            continue
        fields = {"dq_coalesced": True, **BWD_CANDIDATE_FIELDS.get(name, {})}
        if fields.get("p_before_dp") and cfg.softcap:  # (softcap's dS reads the rounded LSE_log2)
            continue
        if tiles is not None:
            fields.update(zip(("tile_m", "tile_n", "num_warps", "q_stages", "warps_m_sdp", "warps_n_dkv",
                               "warps_m_dq"), tiles))
        cand = dataclasses.replace(cfg, **fields)
        if cand.smem_bytes() > capacity(cfg.arch).smem_per_block and cand.q_stages == 2:
            cand = dataclasses.replace(cand, q_stages=1)
        if cand.smem_bytes() <= capacity(cfg.arch).smem_per_block:
            out[name] = cand
    return out


def shipped_bwd_configs(arch: int | None = None) -> list[Sm80BwdConfig]:
    """Every plain backward config of target `arch` (every target when None): head dims x dtypes x
    causal."""
    archs = sorted(TARGETS) if arch is None else [arch]
    return [select_bwd_config(d, dt, c, arch=a) for a in archs for d in bwd_headdims(a) for dt in DTYPES
            for c in (False, True)]


# What flash4's API door serves of this family behind the first-use self-test on its own GPUs
# (flash4.validate._gated_problem; FLASH4_PORTABLE): the forward runs dense, packed varlen (with
# seqused_q / seqused_k), paged (gathered rows) and KV-cache decode batches (fwd_plan), the backward
# dense and packed varlen ones (bwd_plan). The dense self-test drives dense configs only: the others
# are "untestable" for it, so on those GPUs they run only with FLASH4_PORTABLE=on
# (flash4.selftest.UNTESTABLE_FLAGS).
GATE_DOOR = {"fwd_layouts": ("dense", "varlen", "paged", "kvcache"), "bwd_layouts": ("dense", "varlen"), "seqused_k": True,
             "paged": True}


# ================================================================ the host's questions (flash4.config.fwd_config / bwd_config)
# Query rows of a decode step's tile (seqlen_q <= this): 4 warps x one 16-row MMA slab, so a step of
# 1-8 queries does a quarter of a 128-row tile's MMA and softmax work (the sm90 family's decode tiles
# halve theirs the same way); the 16 rows per warp also leave the registers a split_kv epilogue needs
# (d64 causal 128 x 64 spilled 16 with it on sm_86; 64 x 64: 0).
DECODE_TILE_M = 64


def kvcache_step_plan(cfg: Sm80FwdConfig, batch: int, seqlen_q: int, nheads: int, capacity: int, num_splits: int,
                      num_sms: int | None, nheads_k: int | None = None, causal: bool = False,
                      window=None) -> FwdPlan:
    """A flash_attn_with_kvcache decode step's plan (pure; CPU-tested): the sm90 family's host GQA
    packing (flash4.config.sm90.pack_factor: the query heads of a KV head as rows of one tile, so each
    KV head's keys are read once, not once per query head; the kernel sees a non-causal problem of
    seqlen_q * pack rows and nheads_k heads, flash4.forward packs q and unpacks out / lse), cfg with
    seqused_k, DECODE_TILE_M query rows for short steps, and, where the (m_block, head, batch) tiles
    leave SMs idle, split_kv over num_splits runs of the cache's key blocks
    (flash4.config.choose_num_splits, from host-known sizes only: CUDA-graph safe). cfg: the step's
    config as select_fwd_config gives it for `causal`; num_splits: the caller's (0 = auto, 1 = off);
    num_sms None: no split; nheads_k None: no packing. A learnable sink with packing needs the
    combine (each packed row has its own head's sink), so such a step always splits, or is not
    packed where it cannot split (the sm90 rule).

    Not named decode_plan on purpose: flash4.config.decode_door sends the dense / paged doors'
    short-query calls to the decode plan of families that have one, and on this family's own GPUs
    those DECODE configs are untestable for the first-use self-test, so a plain dense call there
    would be refused; the doors keep their dense / packed configs here."""
    from flash4.config.sm90 import pack_factor  # the one packing rule (host arithmetic, no kernel code)

    pack = pack_factor(nheads, nheads_k, seqlen_q, causal, window) if nheads_k else 1
    n_blocks = max(1, ceil_div(capacity, cfg.tile_n))
    if cfg.sink and pack > 1 and (num_splits == 1 or n_blocks < 2):
        pack = 1  # the kernel adds each head's sink itself only unpacked
    if pack > 1 and cfg.causal:  # a packed step is non-causal (Sq == 1: its query sees every key)
        cfg = dataclasses.replace(cfg, causal=False, lpt=False)
    seqlen_p, heads_p = seqlen_q * pack, nheads // pack
    if seqlen_p <= DECODE_TILE_M < cfg.tile_m and DECODE_TILE_M % (MMA_M * cfg.num_warps) == 0:
        cfg = dataclasses.replace(cfg, tile_m=DECODE_TILE_M)  # one 16-row slab per warp: the rows are mostly empty
    n_blocks = max(1, ceil_div(capacity, cfg.tile_n))
    if num_splits == 0:
        tiles = batch * heads_p * ceil_div(seqlen_p, cfg.tile_m)
        num_splits = choose_num_splits(tiles, n_blocks, num_sms) if num_sms else 1
    num_splits = max(1, min(num_splits, n_blocks))
    if cfg.sink and pack > 1:
        num_splits = max(num_splits, 2)
    cfg = with_seq_layout(cfg, seqused_k=True, split_kv=num_splits > 1)
    return FwdPlan(cfg, pack, num_splits, seqlen_p, heads_p)


def fwd_plan(request, arch: int, num_sms: int | None = None) -> FwdPlan:
    """The forward plan of a flash4.request.Request: dense, packed (varlen / seqused), paged (packed
    queries over a page table, gathered rows) or a decode step over a contiguous or paged cache
    (kvcache_step_plan: host GQA packing, seqused_k, split-KV by the sm90 family's rules). Raises
    ValueError as select_fwd_config."""
    q, k, seq, mask, score = request.q, request.k, request.seq, request.mask, request.score
    headdim, headdim_v = q.shape[-1], request.v.shape[-1]
    cfg = select_fwd_config(headdim, request.dtype, mask.causal, arch, local=mask.window is not None,
                            softcap=score.softcap > 0, sink=score.sink is not None,
                            headdim_v=None if headdim_v == headdim else headdim_v, paged=seq.paged)
    if seq.decode:
        num_splits = request.cache.num_splits if request.cache is not None else 0  # 0: auto
        return kvcache_step_plan(cfg, q.shape[0], q.shape[1], q.shape[2], request.capacity, num_splits, num_sms,
                                 nheads_k=k.shape[-2], causal=mask.causal, window=mask.window)
    if not seq.packed:
        return FwdPlan(cfg)
    return FwdPlan(with_seq_layout(cfg, varlen_q=True, varlen_k=not seq.paged, seqused_q=seq.seqused_q is not None,
                                   seqused_k=seq.seqused_k is not None))


def bwd_plan(request, arch: int, heads_per_cta: int | None = None) -> BwdPlan:
    """The backward plan of a dense or packed (not paged) flash4.request.Request: the config and
    the query heads per CTA (every query head of the KV head: heads_per_cta, the sm90 family's
    head-split override, is ignored here). Raises as select_bwd_config."""
    seq, mask = request.seq, request.mask
    packed = seq.packed
    cfg = select_bwd_config(request.headdim, request.dtype, mask.causal, arch=arch,
                            deterministic=request.deterministic, local=mask.local,
                            softcap=request.score.softcap > 0,
                            headdim_v=None if request.headdim_v == request.headdim else request.headdim_v,
                            varlen_q=packed, varlen_k=packed, seqused_q=packed and seq.seqused_q is not None,
                            seqused_k=packed and seq.seqused_k is not None)
    candidate = env.portable_bwd_candidate()
    if candidate is not None:  # FLASH4_PORTABLE_BWD: a speed candidate where it applies (A/B, GPU tests)
        if candidate != "table" and candidate not in BWD_CANDIDATES:
            raise ValueError(f"FLASH4_PORTABLE_BWD={candidate!r}: not a candidate; allowed: "
                             f"{sorted(BWD_CANDIDATES) + ['table']}")
        if candidate != "table":
            cfg = bwd_candidates(cfg).get(candidate, cfg)
    elif not (cfg.softcap or cfg.local or cfg.deterministic):  # the shipped candidate (shipped_bwd_candidate)
        cfg = bwd_candidates(cfg).get(shipped_bwd_candidate(cfg), cfg)
    return BwdPlan(cfg, request.nheads // request.nheads_k)
