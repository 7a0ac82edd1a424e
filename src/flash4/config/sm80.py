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

from flash4.arch import capacity
from flash4.config import SUPPORTED_HEADDIMS, canonical_hdimv
from flash4.constants import DTYPES, RESCALE_THRESHOLD_LOG2

# The SM versions this family is compiled for, and the --gpu-arch name of each: the arch-specific
# ("a") targets exist from sm_90 on; sm_80/86/89 take the plain names.
TARGETS = {80: "sm_80", 86: "sm_86", 89: "sm_89", 90: "sm_90a", 120: "sm_120a"}
# The archs the registry dispatches to this family by default (sm_90 runs the sm90 family unless
# the family is asked for explicitly: flash4.kernels.registry.family(90, prefer="sm80")).
NATIVE_ARCHS = (80, 86, 89, 120)

# Rows of the query tile per warp per MMA atom (mma.sync m16n8k16: M = 16).
MMA_M = 16


def gpu_arch_name(arch: int) -> str:
    """The DSL's --gpu-arch name of target `arch` (sm_80, sm_86, sm_89, sm_90a, sm_120a). Raises
    ValueError for an arch this family is not compiled for."""
    try:
        return TARGETS[arch]
    except KeyError:
        raise ValueError(f"the sm80 family is not compiled for sm_{arch}; targets: {sorted(TARGETS)}") from None


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
    Fields the family does not implement yet, kept so the host's code reads every config alike:
    page_rows (paged K/V) = 0, split_kv = False, headdim_v = None (Dv = D), pack_gqa = 1.
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

    def __post_init__(self):
        assert self.headdim in SUPPORTED_HEADDIMS, self.headdim
        assert self.dtype in DTYPES, self.dtype
        assert self.arch in TARGETS, self.arch
        assert self.tile_m % (MMA_M * self.num_warps) == 0, (self.tile_m, self.num_warps)
        assert self.tile_n % 16 == 0 and self.kv_stages >= 1, (self.tile_n, self.kv_stages)
        assert not (self.causal and self.local), "a window folds causal into its right side"
        assert self.page_rows == 0 and not self.split_kv and self.headdim_v is None and self.pack_gqa == 1, (
            f"not implemented in the sm80 family: {self}")

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
_SMEM_CLASS = {80: "a100", 86: "small", 89: "small", 90: "hopper", 120: "small"}


def unsupported(headdim_v: int | None = None, paged: bool = False, split_kv: bool = False, pack_gqa: bool = False,
                backward: bool = False) -> str | None:
    """Why the sm80 family has no kernel for these options, or None (one text for the config
    selection's error and for a dispatcher's support check). headdim_v: canonical_hdimv's value
    (None when it equals headdim)."""
    if backward:
        return "the sm80 family has no backward kernel yet"
    missing = [name for name, on in (("paged K/V", paged), ("split-KV decode", split_kv), ("GQA packing", pack_gqa),
                                      ("headdim_v != headdim", headdim_v is not None)) if on]
    if missing:
        return f"the sm80 family does not implement {', '.join(missing)} yet"
    return None


def select_fwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = 80,
                      local: bool = False, softcap: bool = False, sink: bool = False,
                      headdim_v: int | None = None, seqlen_k: int | None = None, varlen_q: bool = False,
                      varlen_k: bool = False, seqused_q: bool = False, seqused_k: bool = False,
                      paged: bool = False, split_kv: bool = False, q_in_regs: bool | None = None) -> Sm80FwdConfig:
    """The forward config for one problem class on target `arch` (pure; CPU-tested).

    local: a sliding window (causal folded into it: the config has causal False). seqlen_k is
    accepted for the host's common call and unused (no short-sequence variant yet). q_in_regs:
    None = the table's choice (Q in smem). Raises ValueError for an unsupported head dim, a
    target this family is not compiled for, or an option it does not implement yet
    (`unsupported`)."""
    if headdim not in SUPPORTED_HEADDIMS:
        raise ValueError(f"headdim={headdim} not supported; allowed: {SUPPORTED_HEADDIMS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} not supported; allowed: {DTYPES}")
    gpu_arch_name(arch)
    headdim_v = canonical_hdimv(headdim, headdim_v)
    problem = unsupported(headdim_v=headdim_v, paged=paged, split_kv=split_kv)
    if problem is not None:
        raise ValueError(f"flash4: {problem} (sm_{arch})")
    causal = causal and not local
    tile_m, tile_n, num_warps, stages, q_regs = _TILES[_SMEM_CLASS[arch]][headdim][1 if causal else 0]
    # Q in registers fits the two loop bodies of a non-causal kernel; a window adds a third (like
    # causal) and then spills with it (d64 on sm_80: 2), without it not (compile sweep).
    q_regs = (q_regs and not local) if q_in_regs is None else q_in_regs
    cfg = Sm80FwdConfig(headdim=headdim, dtype=dtype, causal=causal, tile_m=tile_m, tile_n=tile_n,
                        num_warps=num_warps, kv_stages=stages, q_in_regs=q_regs, arch=arch,
                        lpt=causal, local=local, softcap=softcap, sink=sink, varlen_q=varlen_q,
                        varlen_k=varlen_k, seqused_q=seqused_q, seqused_k=seqused_k)
    assert cfg.smem_bytes() <= capacity(arch).smem_per_block, cfg
    return cfg


def shipped_fwd_configs(arch: int | None = None) -> list[Sm80FwdConfig]:
    """Every plain forward config the table gives (head dims x dtypes x causal) for target `arch`,
    or for every target (TARGETS) when None."""
    archs = sorted(TARGETS) if arch is None else [arch]
    return [select_fwd_config(d, dt, c, arch=a) for a in archs for d in SUPPORTED_HEADDIMS for dt in DTYPES
            for c in (False, True)]


def select_bwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = 80, **kwargs):
    """No sm80 backward kernel yet: raises ValueError."""
    raise ValueError("no sm80 backward yet")


def shipped_bwd_configs(arch: int | None = None) -> list:
    return []
