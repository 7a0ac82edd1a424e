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
import math

from flash4.constants import DTYPES, LOG2E, RESCALE_THRESHOLD_LOG2, ROWS_PER_WARPGROUP  # noqa: F401

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


# Smallest page piece one TMA copy may load: the swizzle atom of the K/V smem tile is 8 rows.
MIN_PAGE_ROWS = 8


def paged_page_rows(page_size: int, tile_n: int) -> int:
    """Rows per TMA copy of a paged key block: gcd(page_size, tile_n) (a page piece never crosses
    a page or a key block). Raises ValueError when that is not a multiple of MIN_PAGE_ROWS."""
    rows = math.gcd(page_size, tile_n)
    if page_size < 1 or rows % MIN_PAGE_ROWS != 0:
        raise ValueError(
            f"page_size={page_size} is not supported: paged K/V needs page_size to be a multiple of "
            f"{MIN_PAGE_ROWS} (e.g. 16, 32, 64, 128, 256)")
    return rows


def with_seq_layout(cfg, **flags):
    """cfg with the sequence-layout fields (varlen_q, varlen_k, seqused_q, seqused_k, page_rows) set."""
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
    heads per CTA of the GQA/MQA head split (the whole group when not split)."""

    cfg: object
    heads_per_cta: int


def fwd_config(request, arch: int, num_sms: int | None = None) -> FwdPlan:
    """The forward plan of `request` (flash4.request.Request; any layout) on SM version `arch`.
    num_sms: the device's SM count (the split-KV choice of a DECODE request reads it; None elsewhere).
    Raises ValueError for an arch without a kernel family or an unsupported head dim."""
    return _family_config(arch).fwd_plan(request, arch, num_sms)


def bwd_config(request, arch: int, heads_per_cta: int | None = None) -> BwdPlan:
    """The backward plan of `request` (DENSE or VARLEN; max_seqlen_q / max_seqlen_k resolved) on SM
    version `arch`; heads_per_cta: None, or the FLASH4_BWD_HEADS_PER_CTA override (flash4.env)."""
    return _family_config(arch).bwd_plan(request, arch, heads_per_cta)


def _family_config(arch: int):
    from flash4.kernels import registry  # late: registry names this package's family modules

    return registry.family(arch).config_module()


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
    return _family_config(arch).shipped_fwd_configs()


def shipped_bwd_configs(arch: int = 90) -> list:
    """Every backward config the API can select on `arch` (plain, deterministic, value head dims,
    the GQA head split)."""
    return _family_config(arch).shipped_bwd_configs()


# The sm90 family's names, for callers that take its configs and policies directly.
from flash4.config.sm90 import (  # noqa: E402,F401
    BWD_SMEM_BUDGET, BWD_SPLIT_MIN_QUERIES, BWD_SUPPORTED_HEADDIMS, DQ_ROW_PAD, DQ_ROW_PAD_SPLIT,
    DQ_WHOLE_TILE_MAX_HEADDIM, SHORT_SEQLEN_K, SM90_MAX_SMEM_BYTES, TRANSPOSED_DKV_HEADDIMS, TRANSPOSED_DKV_VARIANTS,
    BwdConfig, FwdConfig, bwd_heads_per_cta, bwd_smem_bytes, dq_whole_tile, pack_gqa_wanted, short_seq_fwd_config,
    transposed_dkv_ok, with_dkv_accum, with_pack_gqa,
)
