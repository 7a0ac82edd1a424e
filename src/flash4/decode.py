"""Decode forward (host side): attention of a few new queries over a KV cache.

Two measures make a decode step read the cache at memory speed (FlashDecoding, Dao et al. 2023;
FlashAttention-3's decode path):
  * GQA packing: the `pack = nheads // nheads_k` query heads that share a KV head become query
    rows of one tile, so K/V are read once per KV head instead of once per query head. The host
    packs q (a copy of the small query tensor: (B, Sq, H, D) -> (B, Sq * pack, Hk, D), packed row
    r = query r // pack of head hk * pack + r % pack). The kernel sees a non-causal problem with
    Sq * pack queries, which is exact when Sq == 1 (the one query sees every key, causal or not);
    causal steps with Sq > 1 are not packed.
  * Split-KV: when batch x nheads_k tiles cannot fill the GPU, each tile's key blocks are split
    over `num_splits` CTAs (FwdConfig.split_kv); their partial O / LSE are merged by the combine
    kernel (kernels/common/fwd_combine.py), which also unpacks the GQA rows.
num_splits is chosen from host-known sizes only (batch, heads, the cache's capacity), never from
cache_seqlens' contents, so a step is CUDA-graph safe and changing lengths never recompiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from flash4.config import ceil_div
from flash4.geometry import window_sides

# Split-KV heuristic: split only when the tiles fill less than this share of the SMs; then take the
# fewest splits whose wave efficiency is within SPLIT_EFFICIENCY of the best, each split keeping at
# least MIN_BLOCKS_PER_SPLIT key blocks, at most MAX_SPLITS splits.
SPLIT_WHEN_TILES_BELOW = 0.8
SPLIT_EFFICIENCY = 0.95
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 128


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


# Deepest K/V pipeline a decode config takes (the step streams the cache: more loads in flight).
MAX_DECODE_KV_STAGES = 4


def decode_tiles(cfg, seqlen_p: int):
    """The forward config with decode tiles: when the packed query rows fit one warpgroup (64),
    one consumer warpgroup (tile_m 64: half the tensor-core work of a 128-row tile whose rows are
    mostly empty) and the deepest K/V pipeline that fits shared memory (at most
    MAX_DECODE_KV_STAGES)."""
    from flash4.config import ROWS_PER_WARPGROUP, SM90_MAX_SMEM_BYTES

    if seqlen_p > ROWS_PER_WARPGROUP:
        return cfg
    cfg = dataclasses.replace(cfg, tile_m=ROWS_PER_WARPGROUP, lpt=False, kv_stages=1)
    per_stage = cfg.tile_n * (cfg.headdim + cfg.hdim_v) * 2
    stages = (SM90_MAX_SMEM_BYTES - 1024 - cfg.smem_bytes() + per_stage) // per_stage
    return dataclasses.replace(cfg, kv_stages=max(2, min(MAX_DECODE_KV_STAGES, stages)))


def pack_factor(nheads: int, nheads_k: int, seqlen_q: int, causal: bool, window=None) -> int:
    """Query heads packed per KV head (1: no packing); see the module docstring. Not with a
    sliding window (its band follows the query index, which packing would change)."""
    group = nheads // nheads_k
    return group if group > 1 and window is None and (seqlen_q == 1 or not causal) else 1


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What a decode step runs for one problem class (cached: a step's host work is a lookup)."""

    cfg: object  # FwdConfig
    pack: int
    num_splits: int
    seqlen_p: int  # packed query rows per sequence
    heads_p: int  # heads the kernel sees (nheads // pack)


@functools.lru_cache(maxsize=1024)
def decode_plan(batch: int, seqlen_q: int, nheads: int, nheads_k: int, headdim: int, dtype: str, causal: bool,
                page_size: int, capacity: int, num_splits: int, arch: int, num_sms: int,
                window=None, softcap: bool = False, sink: bool = False, headdim_v: int | None = None) -> DecodePlan:
    """The plan of a decode step (pure; CPU-tested): packing, config and split count.
    page_size: 0 for a contiguous cache; capacity: keys the cache can hold per sequence.
    headdim_v: V's head dim (None: headdim)."""
    from flash4.config import paged_page_rows, select_fwd_config, with_seq_layout

    pack = pack_factor(nheads, nheads_k, seqlen_q, causal, window)
    # A packed tile's rows belong to `pack` query heads, each with its own sink: the sink is then
    # added by the combine kernel (which unpacks the rows), so a packed step with a sink always
    # splits (at least 2 runs); with a single key block to split, it is not packed.
    tile_n_hint = select_fwd_config(headdim, dtype, False, arch=arch, headdim_v=headdim_v).tile_n
    if sink and pack > 1 and num_splits != 1 and ceil_div(capacity, tile_n_hint) < 2:
        pack = 1
    if sink and pack > 1 and num_splits == 1:
        pack = 1  # splitting was refused: unpacked, the kernel adds each head's sink itself
    kernel_causal = causal and pack == 1  # packed steps have Sq == 1 or are non-causal
    seqlen_p, heads_p = seqlen_q * pack, nheads // pack
    cfg = decode_tiles(select_fwd_config(headdim, dtype, kernel_causal, arch=arch, local=window is not None,
                                         softcap=softcap, sink=sink, headdim_v=headdim_v), seqlen_p)
    n_blocks = max(1, ceil_div(capacity, cfg.tile_n))
    if num_splits == 0:
        num_splits = choose_num_splits(batch * heads_p * ceil_div(seqlen_p, cfg.tile_m), n_blocks, num_sms)
    num_splits = max(1, min(num_splits, n_blocks))
    if sink and pack > 1:
        num_splits = max(num_splits, 2)
    cfg = with_seq_layout(cfg, seqused_k=True, page_rows=paged_page_rows(page_size, cfg.tile_n) if page_size else 0,
                          split_kv=num_splits > 1)
    return DecodePlan(cfg, pack, num_splits, seqlen_p, heads_p)


@functools.lru_cache(maxsize=1024)
def _runners(plan: DecodePlan):
    """(forward runner, combine runner or None) of a plan (compiled once, then a lookup)."""
    from flash4.compile.cache import get_combine_runner, get_fwd_runner  # late: CuTe DSL

    combine = (get_combine_runner(plan.cfg.hdim_v, plan.cfg.dtype, plan.cfg.arch, sink=plan.cfg.sink)
               if plan.num_splits > 1 else None)
    return get_fwd_runner(plan.cfg), combine


def _packed_sink(sink, nheads_k: int, pack: int):
    """Packed GQA rows see kernel head hk for query heads hk * pack + r: one sink per kernel head
    only when every query head of the group has the same sink -- not in general. So a packed,
    unsplit step with a sink is not planned (decode_plan never packs with a sink); kept as a guard."""
    if sink is None:
        return None
    raise AssertionError("a learnable sink with GQA packing needs the split-KV combine (decode_plan avoids it)")


def decode_forward(q, k_cache, v_cache, seqused_k, softmax_scale: float, causal: bool, page_table=None,
                   num_splits: int = 0, out=None, lse=None, window_size=None, softcap: float = 0.0,
                   learnable_sink=None):
    """Attention of q over the first seqused_k[b] keys of each cache row; returns (out, lse).

    q: (B, Sq, H, D) 16-bit CUDA; k_cache, v_cache: (B, S_cache, Hk, D), or paged
    (num_pages, page_size, Hk, D) with page_table int32 (B, max_pages); seqused_k: int32 (B,)
    keys per sequence (<= the cache's capacity). Causal aligns query i with key
    seqused_k[b] - Sq + i (bottom-right). num_splits: 0 = choose_num_splits, 1 = no split, n = n.
    out: None or a (B, Sq, H, D) tensor of q's dtype to write; lse: None or fp32 (B, H, Sq).
    window_size: None or flash-attn's (left, right) sliding window (then no GQA packing).
    Validated inputs only (flash4.api.flash_attn_with_kvcache checks them).
    """
    from flash4 import arch
    from flash4.validate import DTYPE_NAMES

    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k, headdim_v = k_cache.shape[2], v_cache.shape[-1]
    paged = page_table is not None
    if out is None:
        out = torch.empty(batch, seqlen_q, nheads, headdim_v, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    capacity = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
    window = window_sides(window_size, causal)
    plan = decode_plan(batch, seqlen_q, nheads, nheads_k, headdim, DTYPE_NAMES[q.dtype], causal,
                       k_cache.shape[1] if paged else 0, capacity, num_splits, arch.device_arch(q.device),
                       arch.num_sms(q.device), window, softcap > 0, learnable_sink is not None,
                       **({} if headdim_v == headdim else {"headdim_v": headdim_v}))
    sink = None if learnable_sink is None else learnable_sink.float().contiguous()
    run, combine = _runners(plan)
    pack, seqlen_p, heads_p = plan.pack, plan.seqlen_p, plan.heads_p
    if pack > 1:
        q_run = q.view(batch, seqlen_q, nheads_k, pack, headdim).transpose(2, 3).reshape(batch, seqlen_p, heads_p, headdim)
    else:
        q_run = q
    seqs = (None, None, None, seqused_k if seqused_k.is_contiguous() else seqused_k.contiguous(), page_table)
    with contextlib.nullcontext() if q.device.index == torch.cuda.current_device() else torch.cuda.device(q.device):
        if plan.num_splits > 1:
            o_acc = torch.empty(plan.num_splits, batch, seqlen_p, heads_p, headdim_v, dtype=torch.float32,
                                device=q.device)
            lse_acc = torch.empty(plan.num_splits, batch, heads_p, seqlen_p, dtype=torch.float32, device=q.device)
            # out / lse are not written by a split_kv launch (its partials go to o_acc / lse_acc);
            # it gets them only as well-formed arguments (packed shapes) for the kernel's views.
            o_arg = out if pack == 1 else (q_run if headdim_v == headdim else torch.empty(
                batch, seqlen_p, heads_p, headdim_v, dtype=q.dtype, device=q.device))
            run(q_run, k_cache, v_cache, o_arg, lse_acc[0], softmax_scale, lse_split=lse_acc[:2], seqs=seqs,
                batch=batch, max_seqlen_q=seqlen_p, accs=(o_acc, lse_acc), num_splits=plan.num_splits, window=window,
                softcap=softcap, sink=sink)
            combine(o_acc, lse_acc, out, lse, pack, sink=sink)
        elif pack > 1:
            out_p = torch.empty(batch, seqlen_p, heads_p, headdim_v, dtype=q.dtype, device=q.device)
            lse_p = torch.empty(batch, heads_p, seqlen_p, dtype=torch.float32, device=q.device)
            run(q_run, k_cache, v_cache, out_p, lse_p, softmax_scale, seqs=seqs, batch=batch, max_seqlen_q=seqlen_p,
                softcap=softcap, sink=_packed_sink(sink, nheads_k, pack))
            out.copy_(out_p.view(batch, seqlen_q, pack, nheads_k, headdim_v).transpose(2, 3).reshape(out.shape))
            lse.copy_(lse_p.view(batch, nheads_k, seqlen_q, pack).transpose(2, 3).reshape(batch, nheads, seqlen_q))
        else:
            run(q, k_cache, v_cache, out, lse, softmax_scale, seqs=seqs, batch=batch, max_seqlen_q=seqlen_q,
                window=window, softcap=softcap, sink=sink)
    return out, lse
