"""Kernel configurations: what every family shares, and the per-arch selection.

A config is a frozen dataclass of host scalars only (the compile-cache key). Each GPU family has a
module here with its config classes and pure selection functions (flash4.config.sm90 for Hopper),
registered in flash4.kernels.registry; select_fwd_config / select_bwd_config / shipped_*_configs
dispatch on `arch` through that registry, so a new family adds a module and a registry entry and
no host module changes. Everything here is pure Python and tested on the CPU.

The host passes (flash4.forward, flash4.backward) ask one question per pass, with the request
(flash4.request.Request) in hand: `fwd_config(request, arch)` -> FwdPlan, `bwd_config(request, arch)`
-> BwdPlan. The family's module answers it (its fwd_plan / bwd_plan compose its pure selectors), so
the host names no family policy (tile rules, GQA packing, split-KV, the backward head split).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from flash4.constants import DTYPES, LOG2E, MAX_SPLITS, RESCALE_THRESHOLD_LOG2, ROWS_PER_WARPGROUP  # noqa: F401

# Head dims with kernels (the public API pads other multiples of 8 to one of these: flash4.headdim).
SUPPORTED_HEADDIMS = (64, 96, 128, 192, 256)
# (headdim, headdim_v) pairs with Dv != D that have kernels (forward and backward): DeepSeek-V3/R1
# MLA prefill (192, 128) and 128/64, 64/128. Equal pairs are every SUPPORTED_HEADDIMS entry.
HDIMV_PAIRS = ((192, 128), (128, 64), (64, 128))


def hdimv_problem(headdim: int, headdim_v: int | None) -> str | None:
    """Why (headdim, headdim_v) has no kernel, or None (headdim_v None or equal: the plain case)."""
    if headdim_v is None or headdim_v == headdim:
        return None
    if (headdim, headdim_v) not in HDIMV_PAIRS:
        allowed = ", ".join(f"({d}, {dv})" for d, dv in HDIMV_PAIRS)
        return (f"v's headdim {headdim_v} differs from q/k's headdim {headdim}; the (q/k, v) head dim pairs "
                f"supported are {allowed} and every equal pair")
    return None


def canonical_hdimv(headdim: int, headdim_v: int | None) -> int | None:
    """headdim_v as a config field: None when it equals headdim (the plain configs' key); raises
    ValueError for an unsupported pair."""
    problem = hdimv_problem(headdim, headdim_v)
    if problem is not None:
        raise ValueError(problem)
    return None if headdim_v is None or headdim_v == headdim else headdim_v


# Page sizes the doors take by default (the peer suite's shim reads MIN_PAGE_ROWS): multiples of 8
# (TMA page pieces). By default any page size >= 1 is served, the others by the gathered path
# (paged_layout); FLASH4_SMALL_PAGES=0 refuses them (served_page_rows).
MIN_PAGE_ROWS = 8


def served_page_rows() -> int:
    """Page sizes must be multiples of this: 1, or MIN_PAGE_ROWS with FLASH4_SMALL_PAGES=0 (flash4.env)."""
    from flash4 import env

    return 1 if env.small_pages() else MIN_PAGE_ROWS
# Smallest page piece one TMA copy may load: the swizzle atom of the K/V smem tile is 8 rows. Pages
# whose size is not a multiple of it are gathered row by row (FwdConfig.page_gather).
TMA_PAGE_ROWS = 8
# Pages of at most this many rows (and multiples of TMA_PAGE_ROWS) are gathered instead of loaded
# by TMA page pieces (FLASH4_PAGE_GATHER_MAX overrides it, flash4.env.page_gather_max). 16 since the
# H200 A/B of 2026-12-02 (tools/bench_pages.py, docs/design/small_pages.md): page 16 prefill 0.787
# of contiguous gathered vs 0.721 by TMA pieces, decode 0.965 of copy bandwidth vs 0.876. Page 32
# was not measured, so it keeps TMA pieces. Since 2026-12-05 it rules decode steps only (and the paged
# prefill with FLASH4_PAGE_PIECES_ALL_WARPS=0): the prefill takes PREFILL_PAGE_GATHER_MAX below.
PAGE_GATHER_MAX = 16
# TMA page pieces with the page-table look-ahead (FwdConfig.page_prefetch; FLASH4_PAGE_PREFETCH
# overrides it). H200 A/B of 2026-12-02 night (tools/ab_pages.py, docs/design/small_pages.md): page 16
# 426 vs 410 TF (+3.9%), page 32 502 vs 482 TF (+4.1%), bitwise equal; 2026-12-03 afternoon: page 32
# 0.916 of contiguous vs 0.892 off, pages 64 / 128 ties (0.945-0.967). On since 2026-12-03 evening,
# after the paged GPU tests passed with it (and 3 stages: 177 of 177, test_paged / small_pages /
# kvcache / leak_fwd / decode_doors).
PAGE_PREFETCH = True
# Gathered pages (FwdConfig.gather_zero_fill): the producer zero-fills K/V rows past seqlen_k with
# cp.async of src-size 0, and the consumers no longer zero V's tail (zero_v_tail). Same results bit for
# bit (V rows past seqlen_k exactly 0 either way, K rows past it masked), and every byte of a stage has
# one writer: compute-sanitizer racecheck of tools/sanitize.py paged_16 went from 12 hazards (the
# consumers' zeros against the producer's cp.async) to 0. H200 A/B of 2026-12-02 night
# (tools/ab_pages.py): page 16 d128 prefill 473 TF (shipped) and 458 TF (the same config as "g_zf")
# vs 442 TF off, +3.6% to +7%, bitwise equal to contiguous. FLASH4_GATHER_ZERO_FILL=0 turns it off.
GATHER_ZERO_FILL = True
# Paged prefill K/V stages on sm90 (flash4.config.sm90.with_paged_kv_stages; FLASH4_PAGED_KV_STAGES=3
# asks for 3). 2: a third stage gained nothing in the H200 A/B of 2026-12-02 night (tools/ab_pages.py, TMA
# pieces 2 vs 3 stages: page 16 0.744 vs 0.738 of contiguous, page 32 0.877 vs 0.878, page 128 0.958
# vs 0.949).
PAGED_KV_STAGES = 2
# ... but 3 for TMA page pieces of at most SMALL_PAGE_PIECE_ROWS rows with the look-ahead on (pages of
# 24 or 32 rows, a multiple of 8 above PAGE_GATHER_MAX): H200 A/B of 2026-12-03 afternoon, page 32
# 0.934 of contiguous with both vs 0.916 with the look-ahead alone (where the smem allows: d <= 128).
# Pieces issued by one warp only: the four-warp pieces below take PAGED_KV_STAGES.
PAGED_KV_STAGES_SMALL_PIECES = 3
SMALL_PAGE_PIECE_ROWS = 32
# Paged prefill (not decode): pages that are multiples of TMA_PAGE_ROWS load by TMA page pieces with the
# look-ahead (none gathered: PREFILL_PAGE_GATHER_MAX), pieces of at most PAGE_PIECES_ALL_WARPS_MAX rows
# issued by all four producer warps (FwdConfig.page_pieces_all_warps) with 2 K/V stages; pieces of
# fewer than SMALL_PIECE_ROWS rows (pages 8, 24, 40, ...) only at head dims >= SMALL_PIECE_MIN_HEADDIM,
# below it such pages are gathered (this small-piece rule holds only with PAGE_ROW_SHUFFLE off, and at
# PAGE_DIVIDE_FREE_SPILL_HEADDIMS, since 2026-12-05 late night: PAGE_ROW_SHUFFLE below). H200 A/B of 2026-12-05 evening (tools/ab_pages.py,
# docs/design/small_pages.md; 64k tokens varlen, 32:8 heads, x contiguous, all bitwise equal), four
# warps / gathered / one warp (the previous rule: gathered up to page 16, one warp above):
#   page 16: d128 causal 0.931 / 0.866, full 0.921 / 0.840, d64 causal 0.871 / 0.870, full 0.869 / 0.858
#   page 32: d128 causal 0.937 / tma 0.896, full 0.935 / 0.886, d64 causal 0.943 / 0.667, full 0.948 / 0.644
#   page 48: d128 0.920 / 0.781, 0.931 / 0.763; d64 0.888 / gathered 0.887, 0.862 / 0.860
#   pages 8 / 24 (8-row pieces): d128 0.876-0.904 / gathered 0.835-0.857; d64 0.645-0.663 / gathered 0.858-0.879
# FLASH4_PAGE_PIECES_ALL_WARPS=0: the previous rules; FLASH4_PAGE_GATHER_MAX set: that gather limit, and
# no head-dim rule for small pieces.
PAGE_PIECES_ALL_WARPS = True
PREFILL_PAGE_GATHER_MAX = 0
PAGE_PIECES_ALL_WARPS_MAX = 32
SMALL_PIECE_ROWS = 16
SMALL_PIECE_MIN_HEADDIM = 128
# TMA page pieces that are whole pages (page_size == gcd(page_size, tile_n): pages 8..128 at tile_n 128)
# find their page without the run-time division by page_size (FwdConfig.page_divide_free), prefill and
# decode. H200 A/B of 2026-12-05 night (tools/ab_pages.py, 5 interleaved rounds, x contiguous, all
# bitwise equal), the four-warp pieces without / with it:
#   d64 causal page 16 0.871 / 0.974, page 32 0.949 / 0.991; d128 causal page 16 0.957 / 0.990, page 32
#   0.944 / 0.949; pages of several pieces (page 48: the general path behind a run-time branch) d64
#   0.876 / 0.920, d128 0.951 / 0.930, so not there.
# FLASH4_PAGE_DIVIDE_FREE=0 turns it off.
PAGE_DIVIDE_FREE = True
# Paged prefill: four-warp TMA pieces of pages that hold several pieces take each piece's row block from
# the lane that looked it up (FwdConfig.page_row_shuffle, with page_divide_free: no division in the piece
# loop) at head dims below ROW_SHUFFLE_MIN_HEADDIM, and for pieces of fewer than SMALL_PIECE_ROWS rows at
# every head dim; with it, pieces of fewer than SMALL_PIECE_ROWS rows are no longer gathered below
# SMALL_PIECE_MIN_HEADDIM (the small-piece rule above). H100 80GB HBM3 A/B of 2026-12-05 late night
# (tools/ab_pages.py, 5 interleaved rounds, x contiguous, all bitwise equal), shipped / with it:
#   d64 causal page 8 (gathered / divide-free whole pages) 0.868 / 0.971, page 24 (gathered / shuffled
#   8-row pieces) 0.881 / 0.966, page 48 0.885 / 0.971, page 96 0.941 / 0.959; d64 full page 8 0.914 /
#   1.036, page 24 0.836 / 0.907, page 48 0.886 / 0.965; d128 causal page 24 0.927 / 0.983, but page 48
#   0.945 / 0.924 and 0.978 / 0.970 (two runs), page 96 0.948 / 0.942: not for 16- or 32-row pieces there.
# Head dims 192 / 256 (8-row pieces at page 24) and the kernel head dims between 16 and 112 take the rule
# without their own measurement (compile check: 0 spills). Decode steps unchanged. FLASH4_PAGE_ROW_SHUFFLE=0 restores the previous plan.
PAGE_ROW_SHUFFLE = True
ROW_SHUFFLE_MIN_HEADDIM = 128
# Head dims whose divide-free paged-prefill pieces spill (sm_90a compile check, 2026-12-05 late night: d112
# at 168 registers, whole-page pieces 8 local-memory instructions, the row shuffle 22; with the division 0):
# the paged prefill keeps the division, and the small-piece rule, there (sm90 _fwd_plan,
# with_page_row_shuffle). Decode steps keep page_divide_free (d112's 64-row decode tiles: 0 spills).
PAGE_DIVIDE_FREE_SPILL_HEADDIMS = (112,)

# The dQ postprocess stores 16-byte chunks (kernels/common/bwd_preprocess.py wide_stores): on since
# the H200 A/B of 2026-12-02 (tools/ab_switch.py, docs/design/speed_candidates.md: the postprocess
# alone 2.25x faster at d64 in accumulator order, the whole backward 1.05-1.09x at d64 1k, neutral
# elsewhere; dQ bitwise equal). FLASH4_POSTPROCESS_WIDE=0 turns it off (flash4.env).
POSTPROCESS_WIDE_STORES = True


def postprocess_wide_stores() -> bool:
    """Whether the dQ postprocess uses 16-byte stores: FLASH4_POSTPROCESS_WIDE when set, else
    POSTPROCESS_WIDE_STORES."""
    from flash4 import env

    value = env.postprocess_wide()
    return POSTPROCESS_WIDE_STORES if value is None else value


def paged_page_rows(page_size: int, tile_n: int) -> int:
    """Rows per TMA copy of a paged key block: gcd(page_size, tile_n) (a page piece never crosses
    a page or a key block). Raises ValueError when that is not a multiple of TMA_PAGE_ROWS (such
    pages are gathered: paged_layout)."""
    rows = math.gcd(page_size, tile_n)
    if page_size < 1 or rows % TMA_PAGE_ROWS != 0:
        raise ValueError(
            f"page_size={page_size} has no TMA page pieces: they need page_size to be a multiple of "
            f"{TMA_PAGE_ROWS} (e.g. 16, 32, 64, 128, 256); other sizes are gathered (paged_layout)")
    return rows


def paged_layout(page_size: int, tile_n: int, gather_max: int | None = None, prefetch: bool | None = None) -> dict:
    """The paged fields of a forward config for pages of page_size rows (>= 1): TMA page pieces of
    gcd(page_size, tile_n) rows ({"page_rows": r, "page_gather": False, "page_prefetch": prefetch})
    when page_size is a multiple of TMA_PAGE_ROWS and above gather_max, else gathered rows
    ({"page_rows": 0, "page_gather": True}: each key row through its own page-table entry, by the
    producer warps' cp.async). gather_max / prefetch: None = FLASH4_PAGE_GATHER_MAX /
    FLASH4_PAGE_PREFETCH, else PAGE_GATHER_MAX / PAGE_PREFETCH. Raises ValueError for
    page_size < 1."""
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    if gather_max is None or prefetch is None:
        from flash4.config.sm90 import page_policy  # late: the env readers are host-only

        env_max, env_prefetch = page_policy()
        gather_max = env_max if gather_max is None else gather_max
        prefetch = env_prefetch if prefetch is None else prefetch
    if page_size % TMA_PAGE_ROWS or page_size <= gather_max:
        return {"page_rows": 0, "page_gather": True}
    return {"page_rows": paged_page_rows(page_size, tile_n), "page_gather": False, "page_prefetch": bool(prefetch)}


# Split-KV heuristic (every family's decode plan): split only when the tiles fill less than this share of the SMs; then take the
# fewest splits whose wave efficiency is within SPLIT_EFFICIENCY of the best, each split keeping at
# least MIN_BLOCKS_PER_SPLIT key blocks, at most MAX_SPLITS splits (flash4.constants: the combine kernel's bound too).
SPLIT_WHEN_TILES_BELOW = 0.8
SPLIT_EFFICIENCY = 0.95
MIN_BLOCKS_PER_SPLIT = 4


# The split-KV combine of a decode step (kernels/common/fwd_combine.py; FwdConfig.combine_prefetch /
# pdl_combine): its merge with the split LSEs in registers and the O loads of several splits in flight
# (COMBINE_PREFETCH, every split decode step up to MAX_SPLITS splits), and its launch by programmatic
# dependent launch when the step has at least PDL_COMBINE_MIN_SPLITS splits. H100 A/B 2026-12-06
# (tools/ab_decode.py, the bench's decode cells, CUDA-graph replays, two runs): batch 1 (8 / 16
# splits) 4k / 32k / 128k keys 1.069-1.074x / 1.030-1.031x / 1.016x with both (x cuDNN 0.909 -> 0.971,
# 0.933 -> 0.962, 0.958 -> 0.973); with 2 splits (batch 8) the early launch cost 0.972-0.974x at 4k
# keys (prefetch alone 0.995x), hence the split floor. FLASH4_DECODE_COMBINE=0 restores the plain
# combine (config.sm90.decode_combine_policy).
COMBINE_PREFETCH = True
PDL_COMBINE_MIN_SPLITS = 4


def choose_num_splits(num_tiles: int, num_n_blocks: int, num_sms: int) -> int:
    """Splits of the key blocks for `num_tiles` (m_block, head, batch) tiles of `num_n_blocks` key
    blocks each on `num_sms` SMs (pure; CPU-tested). 1 when the tiles already fill the GPU."""
    if num_tiles <= 0 or num_tiles >= SPLIT_WHEN_TILES_BELOW * num_sms:
        return 1
    max_splits = max(1, min(MAX_SPLITS, num_n_blocks // MIN_BLOCKS_PER_SPLIT))

    def efficiency(s):
        ctas = num_tiles * s
        return ctas / (ceil_div(ctas, num_sms) * num_sms)

    best = max(efficiency(s) for s in range(1, max_splits + 1))
    return next(s for s in range(1, max_splits + 1) if efficiency(s) >= SPLIT_EFFICIENCY * best)


def with_seq_layout(cfg, **flags):
    """cfg with the sequence-layout fields (varlen_q, varlen_k, seqused_q, seqused_k, page_rows,
    page_gather, page_prefetch) set."""
    return dataclasses.replace(cfg, **flags)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_m_blocks(seqlen_q: int, cfg: FwdConfig) -> int:
    return ceil_div(seqlen_q, cfg.tile_m)




def mean_queries_per_key(seqlen_q: int, seqlen_k: int, causal: bool, window=None) -> float:
    """Mean number of queries that see a key (host estimate; flash4.geometry's bottom-right causal
    alignment). window: flash4.geometry.window_sides' (left, right) or None (a band that excludes the
    diagonal has a negative side; its width left + right + 1 is what a key's column holds, 0 at least)."""
    if seqlen_k <= 0 or seqlen_q <= 0:
        return 0.0
    if window is not None:
        return float(max(0, min(seqlen_q, window[0] + window[1] + 1)))
    if causal:
        # key k < seqlen_k - seqlen_q: every query; then the triangle
        both = min(seqlen_q, seqlen_k)
        return (max(0, seqlen_k - seqlen_q) * seqlen_q + both * both / 2) / seqlen_k
    return float(seqlen_q)



@dataclasses.dataclass(frozen=True)
class FwdPlan:
    """What one forward call runs (a family's fwd_plan): the kernel config and the host steps
    around it. pack: query heads the host packs into the rows of one KV head's tile (decode; q is
    copied into (B, seqlen_p, heads_p, D) packed rows, 1 = none); num_splits: split-KV runs merged
    by the combine kernel (1 = none); seqlen_p / heads_p: the packed query rows per sequence and
    the heads the kernel sees (seqlen_q * pack, nheads // pack)."""

    cfg: object
    pack: int = 1
    num_splits: int = 1
    seqlen_p: int = 0
    heads_p: int = 0


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """What one backward call runs (a family's bwd_plan): the main kernel's config and the query
    heads per CTA of the GQA/MQA head split (the whole group when not split). passes: where the main
    kernel runs as several configs in sequence (sm100 hd256: its "dv" and "dkdq" passes, cfg being the
    last), those configs; empty otherwise (cfg alone)."""

    cfg: object
    heads_per_cta: int
    passes: tuple = ()


def fwd_config(request, arch: int, num_sms: int | None = None) -> FwdPlan:
    """The forward plan of `request` (flash4.request.Request; any layout) on SM version `arch`.
    num_sms: the device's SM count (the split-KV choice of a DECODE request reads it; None elsewhere).
    Raises ValueError for an arch without a kernel family or an unsupported head dim."""
    return _family_config(arch).fwd_plan(request, arch, num_sms)


# ================================================================ decode steps behind every door
# flash_attn_with_kvcache always runs its attention as a decode step: the family's decode_plan
# (flash4.config.sm90: GQA packing of the query heads of a KV head into one tile, split-KV when the
# (sequence, KV head) tiles cannot fill the GPU, a combine kernel). flash_attn_func, the SDPA plug-in
# and flash_attn_varlen_func (vLLM's decode: q (B, H, D), cu_seqlens_q = arange(B + 1),
# max_seqlen_q = 1, paged K/V with seqused_k and a page table) run the same plan when decode_door
# says so. The rule reads host ints only (shapes, max_seqlen_q, the page table's width): no host
# sync, CUDA-graph safe, and the plan never depends on the lengths stored on the device.
#
# Queries per sequence up to which a call is a decode step: 1 (decode) to 8 (speculative decoding
# drafts); the packed rows of a step (seqlen_q x the GQA group) then fit one 64-row tile.
DECODE_MAX_SEQLEN_Q = 8
# Keys (dense: seqlen_k; paged: pages per sequence x page_size) from which a call is a decode step:
# below 8 key blocks of 128 the split-KV rule (MIN_BLOCKS_PER_SPLIT = 4 blocks per split) cannot
# split, and the door's own kernels (the dense path packs GQA in the kernel) serve short caches.
DECODE_MIN_SEQLEN_K = 1024


def decode_door(request, arch: int | None, lse_split: bool = False) -> bool:
    """Whether a DENSE or PAGED request from a door runs as a decode step (the decode plan of
    flash_attn_with_kvcache; the notes above). All of:
      * the family of SM version `arch` plans decode steps (flash4.config.sm90; arch None: no);
      * no lse_split is wanted (autograd's forward keeps one for the backward; a decode step has none);
      * queries per sequence in 1..DECODE_MAX_SEQLEN_Q: DENSE q.shape[1]; PAGED the host int
        max_seqlen_q, without seqused_q (packed rows are gathered per sequence on the device);
      * keys per sequence >= DECODE_MIN_SEQLEN_K: DENSE k.shape[1]; PAGED page_table.shape[1] x
        page_size (the capacity; the lengths in seqused_k stay on the device).
    VARLEN K/V (cu_seqlens_k, not paged) stays on the varlen kernels. Pure host arithmetic on the
    request's shapes and ints (CPU-tested: tests/cpu/test_decode_doors_cpu.py). Under torch.compile
    the forward ops always keep lse_split (flash4.ops), so compiled graphs keep the door's kernels."""
    seq = request.seq
    if lse_split or arch is None:
        return False
    if seq.layout == "dense":
        seqlen_q, seqlen_k = request.q.shape[1], request.k.shape[1]
    elif seq.layout == "paged":
        if seq.seqused_q is not None or not isinstance(seq.max_seqlen_q, int):
            return False
        seqlen_q, seqlen_k = seq.max_seqlen_q, request.k.shape[1] * seq.page_table.shape[1]
    else:
        return False
    if not (1 <= seqlen_q <= DECODE_MAX_SEQLEN_Q and seqlen_k >= DECODE_MIN_SEQLEN_K):
        return False
    return _plans_decode(arch)


@functools.lru_cache(maxsize=None)
def _plans_decode(arch: int) -> bool:
    """The family of SM version `arch` has a decode_plan (decode steps with packing and split-KV);
    False for an arch without a family (the API refuses it before any rule)."""
    from flash4.kernels import registry  # late: registry names this package's family modules

    try:
        module = registry.family(arch, include_unverified=True).config_module()
    except ValueError:
        return False
    return hasattr(module, "decode_plan")


def bwd_config(request, arch: int, heads_per_cta: int | None = None, sink_delta: bool = False) -> BwdPlan:
    """The backward plan of `request` (DENSE or VARLEN; max_seqlen_q / max_seqlen_k resolved) on SM
    version `arch`; heads_per_cta: None, or the FLASH4_BWD_HEADS_PER_CTA override (flash4.env).
    sink_delta: the main kernel also sums D = sum_j P dP per query row where the family can (sm90's
    BwdConfig.sink_delta; a learnable sink needs a gradient); plan.cfg.sink_delta says whether it does."""
    module = _family_config(arch)
    if sink_delta and hasattr(module, "with_sink_delta"):
        return module.bwd_plan(request, arch, heads_per_cta, sink_delta=True)
    return module.bwd_plan(request, arch, heads_per_cta)


def active_family(arch: int):
    """The kernel family (flash4.kernels.registry.Family) the host runs on SM version `arch`: the
    arch's own, or the one FLASH4_FAMILY names (flash4.env; "portable" forces the sm80 family, e.g.
    on the H200 for testing). Raises ValueError naming the arch, the supported ones, and the
    variable when it is set."""
    from flash4 import env
    from flash4.kernels import registry  # late: registry names this package's family modules

    prefer = env.family_override()
    try:
        return registry.family(arch, prefer)
    except ValueError as err:
        if prefer is None:
            raise
        raise ValueError(f"{err} (FLASH4_FAMILY={prefer!r}; unset it to run the GPU's own family)") from None


def _family_config(arch: int):
    """The config module of the family the host runs on `arch` (active_family; a dict hit per call)."""
    from flash4 import env

    return _family_config_of(arch, env.family_override())


@functools.lru_cache(maxsize=None)
def _family_config_of(arch: int, prefer):
    """active_family(arch)'s config module for one FLASH4_FAMILY value (cached; a ValueError is
    not cached, so it is raised again on every call)."""
    return active_family(arch).config_module()


def kernel_headdims(arch: int) -> tuple:
    """The equal head dims (D = Dv) the kernel family of SM version `arch` runs without padding:
    its config module's kernel_headdims() (sm90: flash4.config.sm90.KERNEL_HEADDIMS while
    FLASH4_HEADDIM16 is on), else SUPPORTED_HEADDIMS; SUPPORTED_HEADDIMS for an arch without a
    family (the API names that problem elsewhere)."""
    try:
        module = _family_config(arch)
    except ValueError:
        return SUPPORTED_HEADDIMS
    own = getattr(module, "kernel_headdims", None)
    return SUPPORTED_HEADDIMS if own is None else own()


def select_fwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = 90, **kwargs):
    """The forward config of the family of SM version `arch` (flash4.config.sm90.select_fwd_config's
    arguments). Raises ValueError for an arch without a kernel family or an unsupported head dim."""
    return _family_config(arch).select_fwd_config(headdim, dtype, causal, arch=arch, **kwargs)


def select_bwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = 90, **kwargs):
    """The backward config of the family of SM version `arch` (flash4.config.sm90.select_bwd_config's
    arguments). Raises ValueError as select_fwd_config."""
    return _family_config(arch).select_bwd_config(headdim, dtype, causal, arch=arch, **kwargs)


def shipped_fwd_configs(arch: int = 90) -> list:
    """Every forward config the API can select on `arch`: what `python -m flash4 compile-check` builds."""
    return [c for c in _family_config(arch).shipped_fwd_configs() if c.arch == arch]


def shipped_bwd_configs(arch: int = 90) -> list:
    """Every backward config the API can select on `arch` (plain, deterministic, value head dims,
    the GQA head split)."""
    return [c for c in _family_config(arch).shipped_bwd_configs() if c.arch == arch]


# The sm90 family's names, for callers that take its configs and policies directly.
from flash4.config.sm90 import (  # noqa: E402,F401
    BWD_SMEM_BUDGET, BWD_SPLIT_MIN_QUERIES, BWD_SUPPORTED_HEADDIMS, DQ_ROW_PAD, DQ_ROW_PAD_SPLIT,
    DQ_WHOLE_TILE_MAX_HEADDIM, SHORT_SEQLEN_K, SM90_MAX_SMEM_BYTES, TRANSPOSED_DKV_HEADDIMS, TRANSPOSED_DKV_VARIANTS,
    BwdConfig, FwdConfig, bwd_heads_per_cta, bwd_smem_bytes, dq_whole_tile, pack_gqa_wanted, short_seq_fwd_config,
    transposed_dkv_ok, with_dkv_accum, with_pack_gqa, with_sink_delta,
)
