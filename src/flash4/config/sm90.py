"""The sm90 (Hopper) family's kernel configurations and the pure functions that choose them.

A config is a frozen dataclass of host scalars only: it is the compile-cache key (with the
source hash of the kernel files), so two calls that pick equal configs share one compiled kernel.
Everything here is pure Python and tested on the CPU. Family-neutral pieces (head dims, value
head dim pairs, page pieces, the plan types) are in flash4.config; this module is the sm90 entry of
flash4.kernels.registry. The host asks it through `fwd_plan(request, ...)` / `bwd_plan(request, ...)`
(end of this module), which compose the selectors below from a flash4.request.Request.
"""

from __future__ import annotations

import dataclasses
import functools
import types

from flash4.constants import BWD_SPEED_SWITCHES, DTYPES, FWD_SPEED_SWITCHES, RESCALE_THRESHOLD_LOG2, ROWS_PER_WARPGROUP
from flash4.config import (COMBINE_PREFETCH, GATHER_ZERO_FILL, HDIMV_PAIRS, MAX_SPLITS,  # noqa: F401
                           MIN_BLOCKS_PER_SPLIT, PDL_COMBINE_MIN_SPLITS,
                           PAGE_DIVIDE_FREE, PAGE_GATHER_MAX, PAGE_PIECES_ALL_WARPS, PAGE_PIECES_ALL_WARPS_MAX,
                           PAGE_DIVIDE_FREE_SPILL_HEADDIMS, PAGE_PREFETCH, PAGE_ROW_SHUFFLE, ROW_SHUFFLE_MIN_HEADDIM,
                           PAGED_KV_STAGES, PAGED_KV_STAGES_SMALL_PIECES, PREFILL_PAGE_GATHER_MAX,
                           SMALL_PIECE_MIN_HEADDIM, SMALL_PIECE_ROWS,
                           SMALL_PAGE_PIECE_ROWS, SPLIT_EFFICIENCY, SPLIT_WHEN_TILES_BELOW,
                           SUPPORTED_HEADDIMS, BwdPlan, FwdPlan, canonical_hdimv, ceil_div, choose_num_splits,
                           mean_queries_per_key, paged_layout, with_seq_layout)
from flash4.arch import capacity

# Head dims (D = Dv) the sm90 kernels are built for: every multiple of 16 from 16 to 128 and the
# wider SUPPORTED_HEADDIMS (192, 256). A wgmma's K step is 16 elements and its N any multiple of 8,
# so the forward's Q K^T / P V and the backward's five GEMMs take any multiple of 16; the smem
# swizzle atom follows the row width (sm90_utils.get_smem_layout_atom: d80 rows take the 32-byte
# swizzle), the row-wise passes predicate a row's last chunks (kernels/common/bwd_preprocess.py,
# fwd_combine.py). flash-attn-4's sm90 kernels round the tile's head dim up to 16 the same way. Above
# 128 the in-between dims (144 .. 240) are left to padding: the d192 / d256 tiles at d144 spill
# (compile check, causal: 16 instructions). Which of these the API runs unpadded: kernel_headdims().
HEADDIM_STEP = 16
KERNEL_HEADDIMS = tuple(sorted(set(range(HEADDIM_STEP, 129, HEADDIM_STEP)) | set(SUPPORTED_HEADDIMS)))


def kernel_headdims() -> tuple:
    """The equal head dims (D = Dv) the API runs on sm_90 without padding (flash4.headdim): every
    KERNEL_HEADDIMS entry while FLASH4_HEADDIM16 is on (flash4.env.headdim16), else SUPPORTED_HEADDIMS
    (the others zero-padded to the next of those). Read per call."""
    from flash4 import env

    return KERNEL_HEADDIMS if env.headdim16() else SUPPORTED_HEADDIMS


# Short-sequence forward (select_fwd_config's seqlen_k): at seqlen_k <= this a query tile visits at
# most 8 key blocks of 128, so its prologue (Q + first K load, first QK^T) and epilogue (O store)
# are a large share of it; persistent CTAs overlap them with the neighbouring tiles' main loops.
SHORT_SEQLEN_K = 1024


# FwdConfig / BwdConfig fields left out of their repr while at their default (off): speed switches
# added after the configs' reprs became cache and fingerprint keys (docs/design/speed_candidates.md).
# Left out of the repr (the compile-cache and fingerprint key) while off, so adding one keeps every
# other config's key: the speed switches, and sink_delta (on only when a learnable sink needs a gradient).
_QUIET_SWITCHES = ("early_q_release", "l2_kv_heads", "exp_before_dp_wait", "dq_handoff_per_wg", "sink_delta",
                   "gather_zero_fill", "dq_swapab", "dq_whole", "lse_early", "softmax_vote_first", "sink_delta_db",
                   "no_tail_guard", "lookahead_qk", "mask_bits", "p_smem", "rescale_always", "mask_rel", "pv_zero_init",
                   "flat_tile_order", "split_row_max", "softmax_branch_free", "gather_clamp_late", "gather_ptr_shuffle",
                   "tensor_hdims", "dpsum_scaled", "page_pieces_all_warps", "pin_p_convert",
                   "page_divide_free", "page_row_shuffle", "pdl_combine", "combine_prefetch")


def _quiet_repr(cfg) -> str:
    """The dataclass repr of cfg, less the speed switches while they are off (_QUIET_SWITCHES)."""
    fields = (f for f in dataclasses.fields(cfg)
              if not (f.name in _QUIET_SWITCHES and getattr(cfg, f.name) == f.default))
    return f"{type(cfg).__qualname__}({', '.join(f'{f.name}={getattr(cfg, f.name)!r}' for f in fields)})"


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """One compiled forward kernel.

    headdim:      D of Q/K/V (elements).
    dtype:        "bf16" or "fp16" (Q, K, V and O).
    causal:       bottom-right aligned causal mask.
    tile_m:       query rows per CTA (ROWS_PER_WARPGROUP x consumer warpgroups).
    tile_n:       key rows per K/V pipeline stage.
    kv_stages:    depth of the K/V TMA pipeline.
    persistent:   grid = number of SMs, each CTA loops over tiles (else one CTA per tile).
    lpt:          longest-processing-time-first tile order (causal); only with persistent.
    exp2_emu_frac: share of each row's exp2 done by the FMA polynomial (0 = all MUFU).
    rescale_threshold: lazy-rescale tau in log2 units (0 = rescale whenever the max grows).
    arch:         SM version the kernel is built for (90 = sm_90a).
    Sequence layout (flash4.geometry.SeqLens; the kernel reads offsets and lengths per batch):
    varlen_q:     Q/O/LSE packed (total_q, ...), sequence b at cu_seqlens_q[b] (else dense batches).
    varlen_k:     K/V packed (total_k, ...), sequence b at cu_seqlens_k[b].
    seqused_q:    a seqused_q tensor gives sequence b's query count (else cu_seqlens / the shape).
    seqused_k:    a seqused_k tensor gives sequence b's key count (paged KV always has one).
    page_rows:    0: K/V not paged; else K/V are (num_pages, page_size, nheads_k, headdim) with a
                  page_table, and each key block is loaded page piece by page piece, page_rows rows
                  per TMA copy (gcd(page_size, tile_n), a multiple of 8 rows; paged_page_rows()).
    page_gather:  K/V paged as with page_rows, but each key row is gathered through its own
                  page-table entry by the 128 producer threads' cp.async (16-byte chunks), for pages
                  of any size >= 1 (flash4.config.paged_layout picks it; page_rows is then 0).
    page_prefetch: with page_rows: the producer reads each key block's page-table entries two K
                  loads ahead and V reuses K's (kernels/sm90/fwd.py load_paged) instead of reading
                  them right before each K and each V load (on by default since 2026-12-03:
                  flash4.config.PAGE_PREFETCH; FLASH4_PAGE_PREFETCH=0 turns it off for A/B).
    split_kv:     the key blocks of each query tile are split into num_splits runs (a runtime
                  count) whose partial O / LSE go to fp32 buffers for the combine kernel (decode).
    local:        sliding window (flash4.geometry.window_sides): the (left, right) sides are runtime
                  Int32 arguments (any window, one compile); `causal` is then False (folded into
                  right = 0). Only the band's key blocks are visited; its edge blocks are masked.
    softcap:      scores -> softcap * tanh(scores * softmax_scale / softcap) (Gemma 2), the value a
                  runtime argument; tanh is the hardware tanh.approx.f32 (MUFU).
    sink:         a learnable sink logit per head (gpt-oss) joins every row's softmax denominator
                  (fp32 (nheads,) tensor argument); with split_kv the combine kernel adds it once.
    headdim_v:    Dv of V and O when it differs from headdim (DeepSeek MLA prefill: 192/128); None =
                  headdim. One of HDIMV_PAIRS with headdim. V tiles (tile_n, Dv), the P V MMA's N,
                  acc_O, O and the split-KV partials take Dv; Q and K keep headdim.
    pack_gqa:     1, or the query heads per KV head packed into each query tile's rows (GQA packing,
                  FlashAttention-3's PackGQA): row r of a tile is query r // pack_gqa of head
                  head_kv * pack_gqa + r % pack_gqa, so each K/V block is loaded once for them all
                  and a tile spans tile_m / pack_gqa queries (a small window then visits fewer key
                  blocks). Dense Q only (not varlen_q / seqused_q / split_kv); tile_m % pack_gqa == 0.
    early_q_release: speed switch, off by default (A/B: tools/ab_switch.py --switch early_q_release;
                  docs/design/speed_candidates.md). Persistent configs with O staged in its own smem
                  buffer release Q's buffer right after the tile's last Q K^T has completed (both
                  consumer warpgroups' wgmma waits) instead of after the last P V, so the next tile's
                  Q load overlaps this tile's last softmax, last P V and epilogue. persistent only;
                  the kernel raises if O would share Q's buffer. Shown in repr only when on, so every
                  other config keeps its repr (the compile-cache and kernel_fingerprint key).
    l2_kv_heads:  speed switch, off by default (A/B: tools/ab_fwd.py, variant "l2kv";
                  docs/design/speed_candidates.md section 7). LPT configs only. The host sizes the tile
                  order's L2 sections (flash4.schedule.l2_section_pairs) by the K/V of KV heads, not of
                  query heads: with nheads / nheads_k = g query heads per KV head a section takes g
                  times as many (head, batch) pairs (whole KV groups, whose query heads are adjacent
                  in the order), since the g heads of a group read one K/V. Host-only: the kernel is
                  the same code (the section size is its runtime l2_group). Shown in repr only when on.
    gather_zero_fill: page_gather only (issue 25): the producer writes every row of a K/V stage,
                  rows at or past seqlen_k as zeros (cp.async with src-size 0), so no consumer thread
                  writes a stage (zero_v_tail is not traced) and each stage's bytes have one writer.
                  Same results bit for bit: V rows past seqlen_k are exactly 0 either way and K rows
                  past it are masked to -inf. FLASH4_GATHER_ZERO_FILL; flash4.config.GATHER_ZERO_FILL.
                  Left out of the repr while off (as early_q_release).
    softmax_vote_first: on where shipped_vote_first puts it (the dense d128 non-causal forward above
                  SHORT_SEQLEN_K keys, since 2026-12-03) and, with rescale_always, where
                  shipped_small_d_softmax does (dense non-causal head dims <= 32, since 2026-12-05), elsewhere
                  off (FLASH4_FWD_SWITCHES=softmax_vote_first for A/B and GPU tests;
                  docs/design/speed_candidates.md section 8): the online softmax takes its exact-path vote
                  before forming the exponents, so each FFMA sits next to its MUFU.EX2 in one basic block
                  (kernels/common/softmax.py, OnlineSoftmax vote_first). Same bits. Left out of the repr while
                  off.
    no_tail_guard: A/B only, off (FLASH4_FWD_SWITCHES=no_tail_guard; tools/ab_tails.py): issue 25's
                  guards against memory past a sequence's end left out, to measure what they cost in
                  the same run: zero_v_tail (ragged K, TMA pages) and the ragged-Q rows' exclusion
                  from the exact-path vote. The gathered pages' zero fill (gather_zero_fill, itself
                  faster than zeroing V, 2026-12-02) stays. Results equal on clean memory; stale
                  NaN / inf past seqlen_k then leaks into outputs (never use it to serve).
                  Left out of the repr while off.
    lookahead_qk: speed switch, off (FLASH4_FWD_SWITCHES=lookahead_qk for A/B and GPU tests;
                  tools/ab_fwd.py variant "la"; docs/design/speed_candidates.md section 5). Each key
                  block's softmax runs under the next block's Q K^T as well as under its P V: a second
                  S accumulator holds S_{n-1} = Q K_{n-1}, issued before softmax(S_n)
                  (kernels/sm90/fwd.py key_blocks_lookahead). Same instructions per value: same bits.
                  Only where the second S fits the registers (lookahead_qk_error: Dv < D, two
                  consumer warpgroups, TMA K/V; (192, 128) at tile_n <= 112, masked <= 80:
                  lookahead_qk_config); elsewhere the config raises ValueError.
                  Left out of the repr while off.
    mask_bits:    on where shipped_mask_bits puts it (dense windows, since 2026-12-04), elsewhere off
                  (FLASH4_FWD_SWITCHES=mask_bits; tools/ab_fwd.py variant "mb"): the
                  causal / window / seqlen_k score mask from one 32-bit word per row and 32 elements
                  (kernels/common/geometry.py mask_scores(bits=True)), each element's select testing
                  a compile-time bit (ptxas: R2P) instead of one or two integer compares per element
                  (H200 ncu of the gpt-oss window-128 forward, 2026-12-04: 2 ISETP + 2 FSEL per
                  element, 19 % of its instructions). Same mask: same bits. Left out of the repr while off.
    p_smem:       on where shipped_p_smem puts it (the plain dense d96 forward at 192 x 128 causal /
                  192 x 144 full, since 2026-12-04 afternoon: 1.032-1.057x on the H200), elsewhere off
                  (tools/ab_fwd.py variants "p", "m192p", "m192n144p"; "nop" times it off where it
                  ships): P reaches the P V wgmma through a (tile_m, tile_n)
                  smem tile (stmatrix, the wgmma's A from smem; flash-attn-4's "mma_pv_is_rs=False")
                  instead of registers, so P's 16-bit fragment is not live across the next Q K^T:
                  what lets d96 take 192-row tiles (three consumer warpgroups at 160 registers; with P
                  in registers 78 spills). Not with lookahead_qk. Left out of the repr while off.
    rescale_always: speed switch, on where shipped_small_d_softmax puts it (since 2026-12-05), else off
                  (FLASH4_FWD_SWITCHES=rescale_always; tools/ab_fwd.py variant "ra"): O is multiplied by the
                  row factors at every key block, branch-free, instead of behind a warp vote on "some row's
                  reference moved" (kernels/common/softmax.py, OnlineSoftmax rescale_always). The factors stay
                  exactly 1.0 where the lazy rescale keeps the reference, so the same bits; without the branch
                  ptxas can issue the O multiplies and P's F2FP conversion under the MUFU.EX2 stream (H200 ncu
                  2026-12-04, d128 GQA causal: the F2FP waited after the branch). Left out of the repr while
                  off.
    pin_p_convert: speed switch, on where shipped_pin_p_convert puts it (d192 without window / softcap
                  / sink, since 2026-12-05 night), else off (FLASH4_FWD_SWITCHES=pin_p_convert; tools/ab_fwd.py variants "pin",
                  "pinvf"; P in registers only): each 32-bit word of P's 16-bit fragment goes through a
                  side-effecting mov right after the conversion (kernels/common/pin.py keep_here_i32), so
                  the compiler cannot sink the 32 F2FP below the lazy rescale's vote and branch. H100 ncu
                  2026-12-05 (docs/perf/ncu_2026-12-05.md), d64 full 4k: flash4's F2FPs ran back to back
                  after that branch (3.5 k wait + 2.0 k math stall samples, flash-attn-4 0.1 k: its F2FPs
                  fill the MUFU.EX2 stream's gaps); with the pin the sm_90a SASS interleaves them with the
                  MUFU.EX2 / FADD stream as flash-attn-4 does, and the O rescale stays lazy (behind its
                  branch, unlike rescale_always). The same values: the same bits. Timed 2026-12-05
                  night (shipped_pin_p_convert). Left out of the repr while off.
    pv_zero_init: speed switch, on where shipped_tile_work puts it (dense d128 non-causal, seqlen_k <=
                  SHORT_SEQLEN_K, since 2026-12-05), else off (FLASH4_FWD_SWITCHES=pv_zero_init;
                  tools/ab_fwd.py variant "pz"): the tile's first P V wgmma writes acc_O (its ACCUMULATE field
                  false, a run-time flag carried through the key-block loops) instead of acc_O zeroed per tile
                  (H200 ncu 2026-12-04, d128 full 1k: 64 CS2R per tile of the 1,104 per-tile instructions
                  against flash-attn-4's 700; flash-attn-4 does this). A tile without key blocks still zeroes
                  it. Not with lookahead_qk. The same values (0 + x = x). H200 2026-12-05: d128 full 1k 1.045x
                  alone, 0.980-1.008x on 10 other cells. Left out of the repr while off.
    flat_tile_order: speed switch, on where shipped_tile_work puts it (as pv_zero_init), else off
                  (FLASH4_FWD_SWITCHES=flat_tile_order; tools/ab_fwd.py variant "flat"): without LPT the tile
                  index decodes to (m_block, head, batch) with two integer divisions instead of the sectioned
                  order's four (kernels/common/scheduler.py tile_coords_flat; the host passes l2_group 1
                  there, so the same tiles in the same order): H200 ncu 2026-12-04, d128 full 1k, ~250 of the
                  tile's 1,104 per-tile instructions were these divisions. Not with cfg.lpt (its sections).
                  H200 2026-12-05: d128 full 1k 1.059x alone, 4k / 16k 0.996x / 0.983x. Left out of the repr
                  while off.
    split_row_max: speed switch, off (FLASH4_FWD_SWITCHES=split_row_max; tools/ab_fwd.py variant
                  "sm"): each row's max over a thread's columns as two FMNMX chains (even / odd
                  columns) instead of one (kernels/common/softmax.py, OnlineSoftmax split_max): half
                  the dependent latency between S's wait and the quad shuffles (sm_90a SASS of the
                  d32 forward, 2026-12-04: one 32-deep chain per row, flash-attn-4 two 16-deep ones).
                  A max in any order is the same value: the same bits. Compile-verified, not measured
                  yet. Left out of the repr while off.
    softmax_branch_free: speed switch, off (FLASH4_FWD_SWITCHES=softmax_branch_free; tools/ab_fwd.py
                  variants "bf" / "bfra" / "bfsm"): the exact path (issue 8) without a branch: the warp's vote
                  selects ref_lo (0 off the exact path) and every exponent subtracts it (one FADD per
                  element more), so the key block's softmax, P conversion and O rescale share one
                  basic block as in flash-attn-4's loop (kernels/common/softmax.py, OnlineSoftmax
                  branch_free). sm_90a SASS of the d32 forward, 2026-12-04: shipped forms all 64
                  exponents, branches, then runs its MUFU.EX2 back to back; softmax_vote_first
                  interleaves FFMA and MUFU.EX2 but its 32 F2FP are sunk below the branches' join
                  (ptxas merges the two branches' identical tails), all after the last MUFU.EX2.
                  x - 0 = x: the same bits. Replaces softmax_vote_first (with_fwd_switches turns that
                  off). Compile-verified, not measured yet. Left out of the repr while off.
    gather_clamp_late: page_gather only, speed switch, off (FLASH4_FWD_SWITCHES=gather_clamp_late;
                  tools/ab_pages.py variant "g_cl"): each producer thread clamps its page-table entry into [0, num_pages)
                  where the gather uses it (a key block later), not right after reading it
                  (kernels/common/paged_gather.py): sm_90a SASS of the page-16 d128 gather, 2026-12-04,
                  showed the clamp's VIMNMX directly after the entry's LDG, so the look-ahead read was
                  waited for at once, in every producer thread, once per key block. The same index:
                  the same bits. Measured 2026-12-05 (H200): no gain (0.846x / 0.847x of contiguous at
                  pages 16 / 32 against 0.838x / 0.847x): off. Left out of the repr while off.
    gather_ptr_shuffle: page_gather only, speed switch, off (FLASH4_FWD_SWITCHES=gather_ptr_shuffle;
                  tools/ab_pages.py variant "g_ps"): each producer thread forms the 64-bit address of
                  its own lookup row once per K / V load and the gather's passes shuffle that address
                  (two SHFL) and add the thread's column, instead of shuffling (page, row in page) and
                  redoing the 64-bit row-address math in every pass (flash-attn-4's sm90 non-TMA paged
                  K/V, paged_kv.py compute_X_ptr, does the same). sm_90a SASS of the page-16 d128 gather,
                  2026-12-05: the producer's steady-state loop 386 instructions per key block, ~250 of
                  them the per-pass address math, against the consumers' issue slots on the same SM
                  sub-partitions. The same addresses: the same bits. Compile-verified, not measured yet.
                  Left out of the repr while off.
    page_pieces_all_warps: TMA page pieces with page_prefetch only; the paged prefill's default for
                  pieces of <= 32 rows since 2026-12-05 (flash4.config.PAGE_PIECES_ALL_WARPS,
                  FLASH4_PAGE_PIECES_ALL_WARPS=0 turns it off), a speed switch elsewhere
                  (FLASH4_FWD_SWITCHES=page_pieces_all_warps; tools/ab_pages.py variants "tma_pf4" /
                  "tma_pf4_s3"): the four producer warps issue a key block's page pieces (warp w the
                  pieces w, w + 4, ...) instead of warp 0 alone; warp 0 still arrives once on the
                  stage's full barrier with the block's bytes, warps 1-3 only wait for the stage to be
                  empty (kernels/sm90/fwd.py acquire_kv). The TMA-piece times of 2026-12-03 grow about
                  linearly with the copies per block (page 16: 32 copies per K + V block, 0.79x of
                  contiguous; page 128: 4, 0.97x), the copies issued one after the other by one warp
                  (each cute.copy is an elect_one): up to 4x shorter issue chains. The same bytes in the
                  same smem slots: the same bits. H100 2026-12-05: bitwise equal to contiguous and to
                  the switch off (GPU tests), page 16 d128 causal 0.91-0.96x of contiguous vs
                  0.80-0.85x from warp 0 alone. Left out of the repr while off.
    page_divide_free: TMA page pieces only; on where with_page_divide_free puts it (pieces that are whole
                  pages, page_rows == page_size, in the paged prefill and decode plans, since 2026-12-05
                  night: flash4.config.PAGE_DIVIDE_FREE, FLASH4_PAGE_DIVIDE_FREE=0 turns it off), a speed
                  switch elsewhere (FLASH4_FWD_SWITCHES=page_divide_free; tools/ab_pages.py variants
                  "df" / "div"): no run-time division by the page size in the producer's piece loop.
                  Each lane's page-table lookup finds its piece's column and row block from the piece's
                  index and pieces_per_page = page_size / page_rows (a shift: page_rows is a compile-time
                  power of two; the division only where a page holds several pieces), and the piece
                  loop (kernels/sm90/fwd.py copy_page_pieces) takes row 0 where a piece is a whole page
                  and else shuffles the row block from the lane that looked the piece up, instead of
                  key // page_size and key % page_size per piece. H100 ncu 2026-12-05 evening
                  (docs/design/small_pages.md), d64 page-16 causal prefill with the four-warp pieces:
                  2.21 G warp instructions against 1.83 G contiguous, ~48 per piece in the producer of
                  which ~22 the signed division (I2F.RP, MUFU.RCP, F2I on the XU pipe that the
                  consumers' MUFU.EX2 use). H200: page 16 0.871 -> 0.974x of contiguous (d64), 0.957 ->
                  0.990x (d128). The same coordinates: the same bits. Left out of the repr while off.
    page_row_shuffle: TMA page pieces only, with page_divide_free; on where with_page_row_shuffle puts it
                  (the paged prefill's four-warp pieces of pages holding several, below head dim 128 and
                  for 8-row pieces at every head dim, since 2026-12-05 late night: flash4.config.PAGE_ROW_SHUFFLE,
                  FLASH4_PAGE_ROW_SHUFFLE=0 turns it off), a speed switch elsewhere
                  (FLASH4_FWD_SWITCHES=page_row_shuffle; tools/ab_pages.py variant "dfs"): pages of several pieces (24,
                  48, 96, 256 at tile_n 128; every page above 16 at d192 / d256, whose 112 / 80-key tiles
                  cut them into 16-row pieces) take each piece's row block from the lane that looked the
                  piece up (page_lookup returns (page, row block)) instead of dividing by the page size
                  in the piece loop. sm_90a SASS, d64 16-row pieces: every innermost piece loop 16-20
                  instructions without I2F / MUFU.RCP (49-52 with the division); d192 page 32: 38-46
                  against 53-61. The same coordinates: the same bits. H100 A/B 2026-12-05 late night: d64 page 48
                  0.885 -> 0.971x of contiguous, d128 page 24 0.927 -> 0.983x; d128 page 48 0.945 ->
                  0.924x (not there). Left out of the repr while off.
    pdl_combine:  split_kv only; on where with_combine_policy puts it (decode steps of at least
                  PDL_COMBINE_MIN_SPLITS splits, since 2026-12-06: flash4.config, FLASH4_DECODE_COMBINE=0
                  turns it off), a speed switch elsewhere (FLASH4_FWD_SWITCHES=pdl_combine; tools/ab_decode.py
                  variant "pdl"): programmatic dependent launch of the split-KV combine. Every CTA of
                  the split kernel executes griddepcontrol.launch_dependents at its start, the combine
                  is launched with the programmatic-serialization attribute and waits in
                  griddepcontrol.wait (the split kernel complete, its stores visible) before its first
                  read, so the combine's launch and CTA start overlap the split kernel instead of
                  following it (CUDA programming guide, "Programmatic Dependent Launch"; flash-attn-4
                  does the same for its combine and backward preprocess). Same math, same bits.
                  Left out of the repr while off.
    combine_prefetch: split_kv only; on where with_combine_policy puts it (every split decode step up to
                  MAX_SPLITS splits, since 2026-12-06: flash4.config.COMBINE_PREFETCH), a speed switch
                  elsewhere (FLASH4_FWD_SWITCHES=combine_prefetch; tools/ab_decode.py variant "cp"): the split-KV combine (kernels/common/fwd_combine.py,
                  SplitKVCombine.prefetch) keeps each lane's split LSEs in registers and takes the
                  merge weights by shuffles, its merge loop unrolled so several splits' O loads are in
                  flight (the plain loop: one split's loads at a time). Up to MAX_SPLITS splits (a
                  caller's larger num_splits gets the plain combine). The split kernel is unchanged.
                  Same operations in the same order: the same bits. Left out of the repr while off.
    tensor_hdims: None, or (D, Dv) of the q/k and v/out tensors when they are narrower than the
                  kernel's (headdim, hdim_v) (a head dim flash4.headdim pads, e.g. 32 / 80 / 112 on
                  the 64 / 96 / 128 kernels): the TMA loads read the tensors as they are and fill
                  the columns past D / Dv of each box with zeros (what the padding copy writes), the
                  O store clips them, so no padded copy of q, k, v or out is made. Same math as the
                  padded call (tensor_hdims_error: the dense TMA layouts only). Set by
                  flash4.forward.launch_narrow for no-grad dense flash_attn_func calls since
                  2026-12-04 (FLASH4_NARROW_HEADDIMS; H200 1.22-1.58x, bitwise;
                  docs/design/speed_candidates.md section 13); the plans never set it. Left out of
                  the repr while None.
    """

    headdim: int
    dtype: str = "bf16"
    causal: bool = False
    tile_m: int = 128
    tile_n: int = 128
    kv_stages: int = 2
    persistent: bool = False
    lpt: bool = False
    exp2_emu_frac: float = 0.0
    rescale_threshold: float = RESCALE_THRESHOLD_LOG2
    arch: int = 90
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    page_rows: int = 0
    page_gather: bool = False
    page_prefetch: bool = False
    split_kv: bool = False
    local: bool = False
    softcap: bool = False
    sink: bool = False
    headdim_v: int | None = None
    pack_gqa: int = 1
    early_q_release: bool = False
    l2_kv_heads: bool = False
    gather_zero_fill: bool = False
    softmax_vote_first: bool = False
    no_tail_guard: bool = False
    lookahead_qk: bool = False
    mask_bits: bool = False
    p_smem: bool = False
    rescale_always: bool = False
    tensor_hdims: tuple | None = None
    pv_zero_init: bool = False
    flat_tile_order: bool = False
    split_row_max: bool = False
    softmax_branch_free: bool = False
    gather_clamp_late: bool = False
    gather_ptr_shuffle: bool = False
    page_pieces_all_warps: bool = False
    pin_p_convert: bool = False
    page_divide_free: bool = False
    page_row_shuffle: bool = False
    pdl_combine: bool = False
    combine_prefetch: bool = False

    def __post_init__(self):
        assert self.headdim in KERNEL_HEADDIMS, self.headdim
        if self.lookahead_qk and lookahead_qk_error(self):
            raise ValueError(f"FwdConfig.lookahead_qk: {lookahead_qk_error(self)}")
        if self.p_smem and self.lookahead_qk:
            raise ValueError("FwdConfig.p_smem: not built with lookahead_qk")
        if self.softmax_branch_free and self.softmax_vote_first:
            raise ValueError("FwdConfig.softmax_branch_free: replaces softmax_vote_first, not with it")
        assert not self.early_q_release or self.persistent, self
        assert not self.l2_kv_heads or self.lpt, self
        assert self.headdim_v is None or (self.headdim, self.headdim_v) in HDIMV_PAIRS, (self.headdim, self.headdim_v)
        assert self.page_rows == 0 or (self.page_rows % 8 == 0 and self.tile_n % self.page_rows == 0
                                       and self.seqused_k and not self.varlen_k), self
        assert not self.page_gather or (self.page_rows == 0 and self.seqused_k and not self.varlen_k
                                        and self.tile_n <= 128), self
        assert not self.page_prefetch or self.page_rows > 0, self
        assert self.page_gather or not self.gather_zero_fill, self
        assert self.page_gather or not self.gather_clamp_late, self
        assert self.page_gather or not self.gather_ptr_shuffle, self
        assert self.page_rows > 0 or not self.page_divide_free, self
        assert self.page_rows > 0 or not self.page_row_shuffle, self
        assert self.split_kv or not self.pdl_combine, self
        assert self.split_kv or not self.combine_prefetch, self
        assert self.page_prefetch or not self.page_pieces_all_warps, self
        assert self.dtype in DTYPES, self.dtype
        assert self.tile_m % ROWS_PER_WARPGROUP == 0, self.tile_m
        assert self.tile_n % 16 == 0, self.tile_n
        assert self.pack_gqa == 1 or (self.pack_gqa > 1 and self.tile_m % self.pack_gqa == 0 and not self.varlen_q
                                      and not self.seqused_q and not self.split_kv), self
        if self.tensor_hdims is not None:
            problem = tensor_hdims_error(self)
            if problem:
                raise ValueError(f"FwdConfig.tensor_hdims={self.tensor_hdims}: {problem}")

    def __repr__(self) -> str:
        return _quiet_repr(self)

    @property
    def num_consumer_warpgroups(self) -> int:
        return self.tile_m // ROWS_PER_WARPGROUP

    @property
    def paged(self) -> bool:
        """K/V are pages read through a page table (TMA page pieces or gathered rows)."""
        return self.page_rows > 0 or self.page_gather

    @property
    def ragged_q(self) -> bool:
        """Query tiles may lie past their sequence (packed Q or seqused_q): rows there are not stored."""
        return self.varlen_q or self.seqused_q

    @property
    def ragged_k(self) -> bool:
        """Key blocks may hold rows past seqlen_k that are not TMA zeros (the next packed sequence,
        stale slots past seqused_k, a partial page piece): issue 25's guards are compiled in."""
        return self.varlen_k or self.seqused_k or self.paged

    @property
    def num_threads(self) -> int:
        # one producer warpgroup + the consumer warpgroups
        return 128 * (1 + self.num_consumer_warpgroups)

    @property
    def hdim_v(self) -> int:
        """Dv: the head dim of V and O."""
        return self.headdim if self.headdim_v is None else self.headdim_v

    def smem_bytes(self) -> int:
        """Shared memory for Q, the K/V stages and the O staging tile (bytes, no barriers)."""
        elt = 2
        # O reuses Q's buffer in the epilogue (sized for the larger of the two when Dv > D)
        q = self.tile_m * max(self.headdim, self.hdim_v) * elt
        kv = self.kv_stages * self.tile_n * (self.headdim + self.hdim_v) * elt
        p = self.tile_m * self.tile_n * elt if self.p_smem else 0
        return q + kv + p

    def separate_o_fits(self) -> bool:
        """Whether O can be staged in its own smem buffer (tile_m x Dv) beside smem_bytes() and the
        barriers: what a persistent forward needs to load the next tile's Q during this tile's
        epilogue (the kernel's separate_o; shipped_window_persistent)."""
        o = self.tile_m * self.hdim_v * 2
        return self.smem_bytes() + o + FWD_SMEM_OVERHEAD <= capacity(self.arch).smem_per_block


# FwdConfig.lookahead_qk: the most accumulator registers per consumer thread (S + next S + P + O,
# lookahead_qk_regs) that leave ptxas room in the 240 of two consumer warpgroups. sm_90a, CuTe DSL
# 4.8.1, 2026-12-03: (192, 128) full at tile_n 112 (204) and 96 (184): 0 spills, wgmma not
# serialized; at tile_n 128 (224): spills and every wgmma serialized (ptxas C7512). (128, 64) at
# tile_n 128 (192): full, causal, causal + softcap, causal + sink clean.
LOOKAHEAD_QK_REGS = 208
# ... and the widest key tile of a masked (causal / window) (192, 128) forward with it: at tile_n 112
# and 96 ptxas spills 4 bytes (causal: one scheduler value, reloaded once per tile) / 8 (window),
# at 80 none (2026-12-03, same compiler); (128, 64) causal at 128 is clean.
LOOKAHEAD_QK_MASKED_D192_TILE_N = 80


def lookahead_qk_regs(cfg: FwdConfig) -> int:
    """Accumulator registers per consumer thread with FwdConfig.lookahead_qk (64 query rows per
    warpgroup of 128 threads): S and the next S in fp32 (tile_n / 2 each), P in 16 bits (tile_n / 4),
    O in fp32 (Dv / 2): while S_n is softened, S_{n-1} and O += P_{n+1} V_{n+1} are in flight."""
    return 2 * (cfg.tile_n // 2) + cfg.tile_n // 4 + cfg.hdim_v // 2


def lookahead_qk_error(cfg: FwdConfig) -> str | None:
    """Why FwdConfig.lookahead_qk cannot be on for cfg, or None where it is built (pure): the sm90
    forward with Dv < D (the (192, 128) and (128, 64) pairs; issue 26 item 2), two consumer
    warpgroups, K/V loaded by TMA (gathered pages leave the consumers 232 registers), at least two
    K/V stages (K_n and K_{n-1} are held together), the accumulators within LOOKAHEAD_QK_REGS
    ((128, 64) at tile_n 128: 192; (192, 128) at tile_n <= 112: 204, 128 would need 224), and a
    masked (causal / window) D = 192 forward at tile_n <= LOOKAHEAD_QK_MASKED_D192_TILE_N (80): at
    112 and 96 it spills 4 / 8 bytes (ptxas, 2026-12-03; the causal one a single value reloaded
    once per tile, but the compile check asks for none)."""
    if cfg.arch != 90:
        return f"sm90 forward only, not arch={cfg.arch}"
    if cfg.headdim_v is None or cfg.headdim_v >= cfg.headdim:
        return f"built for Dv < D only ((192, 128), (128, 64)), not headdim={cfg.headdim}, headdim_v={cfg.headdim_v}"
    if cfg.num_consumer_warpgroups != 2:
        return f"needs two consumer warpgroups (tile_m 128), not tile_m={cfg.tile_m}"
    if cfg.kv_stages < 2:
        return f"needs kv_stages >= 2 (K_n and K_(n-1) are held together), not {cfg.kv_stages}"
    if cfg.page_gather:
        return "not with page_gather (its consumers get 232 registers, not 240)"
    if lookahead_qk_regs(cfg) > LOOKAHEAD_QK_REGS:
        return (f"tile_n={cfg.tile_n} with Dv={cfg.hdim_v} needs {lookahead_qk_regs(cfg)} accumulator registers per "
                f"thread (S, next S, P, O), more than {LOOKAHEAD_QK_REGS}: use lookahead_qk_config (a narrower tile)")
    if cfg.headdim == 192 and (cfg.causal or cfg.local) and cfg.tile_n > LOOKAHEAD_QK_MASKED_D192_TILE_N:
        return (f"a causal or windowed headdim=192 forward needs tile_n <= {LOOKAHEAD_QK_MASKED_D192_TILE_N} "
                f"(it spills at 112 and 96), not {cfg.tile_n}: use lookahead_qk_config")
    return None


def lookahead_qk_config(cfg: FwdConfig) -> FwdConfig | None:
    """cfg with FwdConfig.lookahead_qk on, at the widest tile_n <= cfg.tile_n (a multiple of 16) that
    lookahead_qk_error allows ((192, 128): 128 -> 112, causal / window 80), or None where no tile
    does. Pure; for the A/B (tools/ab_fwd.py variant "la") and the GPU test, whose switch-off base
    is the same tile."""
    for tile_n in range(cfg.tile_n, 63, -16):
        on = dataclasses.replace(cfg, tile_n=tile_n, lookahead_qk=False)
        if lookahead_qk_error(on) is None:
            return dataclasses.replace(on, lookahead_qk=True)
    return None


def tensor_hdims_error(cfg: FwdConfig) -> str | None:
    """Why FwdConfig.tensor_hdims cannot be compiled, or None (pure). (D, Dv): multiples of 8 (whole
    16-byte chunks: TMA strides), 8 <= D <= headdim, 8 <= Dv <= hdim_v. Only where every global
    access of Q, K, V and O is a TMA box of the dense layout (zero-fill on load, clipping on store):
    not with packed / ragged queries (row-predicated O stores), pages (gathered rows or page pieces),
    split-KV (fp32 partial O) or GQA packing (packed TMA views)."""
    dims = cfg.tensor_hdims
    if not (isinstance(dims, tuple) and len(dims) == 2 and all(isinstance(d, int) for d in dims)):
        return "must be a (D, Dv) tuple of ints"
    d, dv = dims
    if not (8 <= d <= cfg.headdim and d % 8 == 0 and 8 <= dv <= cfg.hdim_v and dv % 8 == 0):
        return f"needs multiples of 8 with 8 <= D <= {cfg.headdim} and 8 <= Dv <= {cfg.hdim_v}"
    if cfg.ragged_q or cfg.paged or cfg.split_kv or cfg.pack_gqa > 1:
        return "dense TMA layouts only (no varlen / seqused queries, pages, split-KV or GQA packing)"
    return None


def select_fwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = 90,
                      local: bool = False, softcap: bool = False, sink: bool = False,
                      headdim_v: int | None = None, seqlen_k: int | None = None) -> FwdConfig:
    """Pick the forward config for one problem class (pure; CPU-tested). local: a sliding window
    (flash4.geometry.window_sides; causal is folded into it, so the config has causal False).
    headdim_v: V's / O's head dim (None or headdim: the same as Q/K; else a HDIMV_PAIRS pair).
    seqlen_k: keys per sequence of a dense problem, or None (the config for long sequences). With
    seqlen_k <= SHORT_SEQLEN_K the plain (no window, softcap or sink) d64 and d128-causal forwards
    are persistent (short_seq_fwd_config).

    Raises ValueError for an unsupported head dim (the API validates earlier, with the user-facing
    message; this is the second line). The arch is chosen by flash4.kernels.registry.
    """
    if headdim not in KERNEL_HEADDIMS:
        raise ValueError(f"headdim={headdim} not supported; allowed: {KERNEL_HEADDIMS}")
    headdim_v = canonical_hdimv(headdim, headdim_v)
    if headdim_v is not None:
        return _select_fwd_config_hdimv(headdim, headdim_v, dtype, causal, arch, local, softcap, sink)
    # (tile_m, tile_n): the largest tiles whose accumulators fit the consumer register budget and
    # whose Q + 2 K/V stages fit 227 KiB of smem (FA3's Hopper table, hopper/tile_size.h).
    if headdim <= 64 and not (local and softcap):
        tile_m, tile_n = 192, 128  # 3 consumer warpgroups (160 regs each)
    elif headdim <= 64:
        tile_m, tile_n = 128, 128  # a window's third loop + softcap spill at 160 regs (compile check: 4-6)
    elif headdim <= 128:
        tile_m, tile_n = 128, 128
    elif headdim <= 192:
        tile_m, tile_n = 128, 112
    else:
        tile_m, tile_n = 128, 80
    # Causal: LPT tile order (longest m_blocks first, L2 sections of heads); H200, d128/d256 S=16k:
    # +3% / +6% over the plain grid order. Persistent CTAs measured slower from 2k keys on (the static
    # round-robin is coarser than the hardware's block dispatch): only short sequences use them
    # (short_seq_fwd_config).
    # A window's tiles cost about the same (a band): no LPT order.
    cfg = FwdConfig(headdim=headdim, dtype=dtype, causal=causal and not local, tile_m=tile_m, tile_n=tile_n,
                    kv_stages=2, lpt=causal and not local, arch=arch, local=local, softcap=softcap, sink=sink)
    if seqlen_k is not None and seqlen_k <= SHORT_SEQLEN_K:
        cfg = short_seq_fwd_config(cfg)
    return shipped_pin_p_convert(
        shipped_tile_work(shipped_small_d_softmax(shipped_vote_first(cfg, seqlen_k), seqlen_k), seqlen_k))


def shipped_pin_p_convert(cfg: FwdConfig) -> FwdConfig:
    """FwdConfig.pin_p_convert where it was measured faster (pure): head dim 192 without a window,
    softcap or sink (every layout: dense, varlen, paged, decode derive from this config). H200,
    2026-12-05 night (tools/ab_fwd.py --variants pin, 5 interleaved rounds): d192 full 4k 626.6 ->
    658.0 TFLOPs (1.050x), causal 4k 548.6 -> 562.4 (1.025x). Elsewhere not: d128 0.997-1.000x on the
    H200 (1.004-1.040x on an H100), d256 1.005-1.019x, d64 0.976-1.015x. Same bits as off (GPU test:
    every door, the exact path included)."""
    if (cfg.headdim == 192 and cfg.headdim_v is None and not cfg.local and not cfg.softcap and not cfg.sink
            and not cfg.p_smem):
        return dataclasses.replace(cfg, pin_p_convert=True)
    return cfg


def shipped_vote_first(cfg: FwdConfig, seqlen_k: int | None) -> FwdConfig:
    """FwdConfig.softmax_vote_first where it was measured faster (pure): the plain dense d128
    non-causal forward above SHORT_SEQLEN_K keys. H200, 2026-12-03 evening (tools/ab_fwd.py --variants
    vf, 5 interleaved rounds, docs/design/speed_candidates.md section 8): d128 full 4k 1.024x, 16k
    1.035x; 1k 0.992x (persistent config), causal / GQA / MQA / d96 cells 0.968-0.994x, so not there.
    Same bits as off (GPU test: every door, the exact path included)."""
    if (cfg.headdim == 128 and not cfg.causal and not cfg.local and not cfg.softcap and not cfg.sink
            and cfg.headdim_v is None and not cfg.persistent and seqlen_k is not None and seqlen_k > SHORT_SEQLEN_K):
        return dataclasses.replace(cfg, softmax_vote_first=True)
    return cfg


def shipped_small_d_softmax(cfg: FwdConfig, seqlen_k: int | None) -> FwdConfig:
    """softmax_vote_first with rescale_always (pure) for the plain dense non-causal forward at head dims
    <= 32, where the step is MUFU.EX2-bound (docs/design/speed_candidates.md section 17): the lazy
    rescale's vote ahead of the exponentials and O rescaled branch-free let ptxas interleave the
    exponentials with the FFMAs. H200, 2026-12-05 (tools/ab_fwd.py, variant ravf, 3 interleaved
    rounds): d32 full 4k 265.6 -> 280.8 TFLOPs (1.057x), d16 full 4k 147.0 -> 152.4 (1.036x); d32
    causal 4k 0.981x, so not there (nor at d48 / d64 or above: ravf 0.968x geomean over 23 cells on
    2026-12-04). Windows, softcap, sinks, value head dims and packed layouts were not measured. Same
    bits as off (GPU test: every door, the exact path included)."""
    if (cfg.headdim <= 32 and not cfg.causal and not cfg.local and not cfg.softcap and not cfg.sink
            and cfg.headdim_v is None and not cfg.persistent and seqlen_k is not None and cfg.pack_gqa == 1):
        return dataclasses.replace(cfg, softmax_vote_first=True, rescale_always=True)
    return cfg


def shipped_tile_work(cfg: FwdConfig, seqlen_k: int | None) -> FwdConfig:
    """pv_zero_init and flat_tile_order (pure) for the plain dense d128 non-causal forward of short
    sequences (seqlen_k <= SHORT_SEQLEN_K), whose tiles visit few key blocks so that the per-tile work
    (acc_O zeroing, the tile index's divisions) is a visible share (docs/design/speed_candidates.md
    section 16). H200, 2026-12-05 (tools/ab_fwd.py, 5 interleaved rounds): d128 full 1k 479.1 ->
    509.6 TFLOPs (1.063x; pz alone 1.045x, flat alone 1.059x); at 4k / 16k both together 0.985x /
    0.965x (pz alone 1.008 / 1.000, flat 0.996 / 0.983), so not there; pz on 10 other cells 0.980-1.004x.
    Same bits as off (GPU test: every door)."""
    if (cfg.headdim == 128 and not cfg.causal and not cfg.local and not cfg.softcap and not cfg.sink
            and cfg.headdim_v is None and not cfg.persistent and not cfg.lpt and not cfg.lookahead_qk
            and cfg.pack_gqa == 1 and seqlen_k is not None and seqlen_k <= SHORT_SEQLEN_K):
        return dataclasses.replace(cfg, pv_zero_init=True, flat_tile_order=True)
    return cfg


def shipped_lookahead_qk(cfg: FwdConfig) -> FwdConfig:
    """FwdConfig.lookahead_qk where it was measured faster (pure): the plain dense bf16 (128, 64)
    causal forward (the next Q K^T issued under this block's softmax; tile unchanged at 128 x 128).
    H200, 2026-12-03 night (tools/ab_fwd.py --variants la, 5 interleaved rounds): (128, 64) causal
    4k 446.3 -> 470.1 TFLOPs (1.053x); (192, 128) needs a narrower tile (full: 112 keys, 1.009x of
    shipped; causal: 80, 0.975x), so not there; fp16, the non-causal (128, 64) and the varlen /
    paged layouts were not measured. Same bits as off (GPU test: every door, the exact path included)."""
    if not (cfg.headdim == 128 and cfg.headdim_v == 64 and cfg.causal and cfg.dtype == "bf16" and not cfg.local
            and not cfg.softcap and not cfg.sink and cfg.pack_gqa == 1 and not cfg.lookahead_qk):
        return cfg
    on = dataclasses.replace(cfg, lookahead_qk=True)
    return cfg if lookahead_qk_error(on) else on


def shipped_mask_bits(cfg: FwdConfig) -> FwdConfig:
    """FwdConfig.mask_bits where it was measured faster (pure): the dense window forwards, where
    every key block of a narrow band is masked on both edges. H200, 2026-12-04 (tools/ab_fwd.py
    --variants mb, 5 interleaved rounds): gpt-oss d64 window 128 + sinks causal 8k (GQA-packed 192 x
    128 tiles) 83.0 -> 94.0 TFLOPs (1.132x), window 4096 d128 causal 32k 1.007x; causal cells
    0.991-1.019x (d128 causal 4k 0.997, GQA 64:8 0.991, d96 0.991, (128, 64) 1.012, d64 1k 1.019,
    gpt-oss causal + sinks 0.994), so not there. Packed / paged windows were not measured. Same bits
    as off (GPU test: every door, the exact path included)."""
    if cfg.local and not cfg.ragged_q and not cfg.ragged_k:
        return dataclasses.replace(cfg, mask_bits=True)
    return cfg


def shipped_p_smem(cfg: FwdConfig) -> FwdConfig:
    """flash-attn-4's d96 forward tiles (pure): 192 query rows (three consumer warpgroups) with P
    through shared memory (FwdConfig.p_smem; with P in registers that tile spills 78 instructions),
    192 x 128 causal and 192 x 144 without a mask, for the plain dense d96 forward: no window, softcap
    or sink, Dv = D, not GQA-packed, not persistent, no wide key tile (FWD_WIDE_TILE_N). H200, 2026-12-04 (tools/ab_fwd.py, variants p /
    m192p / m192n144p, 5-7 interleaved rounds, bf16; out / lse within 1e-2 / 1e-3 of the 128 x 128
    tile, every element written): d96 21 heads causal 4k 448.0 -> 462.4 TFLOPs (1.032x) and, in a
    second call, 431.6 -> 450.4 (1.044x); full 4k 513.7 -> 542.9 at 192 x 144 (1.057x; 192 x 128
    1.044x); P through smem at the 128-row tile alone 0.974x. d80 (its own kernel since
    FLASH4_HEADDIM16) takes the same tiles: H200, 2026-12-04 night (tools/ab_headdim16.py, 3 rounds),
    full 4k 492.7 TFLOPs vs 420.8 at 128 x 128 in the call before (the d96 kernel on the narrow
    tensors: 468.1), causal 4k 422.6 (d96 narrow 405.7)."""
    if (cfg.headdim in (80, 96) and cfg.headdim_v is None and (cfg.tile_m, cfg.tile_n) == (128, 128)
            and not (cfg.local or cfg.softcap or cfg.sink or cfg.persistent or cfg.ragged_q or cfg.ragged_k
                     or cfg.split_kv or cfg.lookahead_qk or cfg.pack_gqa > 1)):
        return dataclasses.replace(cfg, tile_m=192, tile_n=128 if cfg.causal else 144, p_smem=True)
    return cfg


def shipped_window_persistent(cfg: FwdConfig) -> FwdConfig:
    """Persistent CTAs for the dense window forwards up to head dim 128 where O fits its own smem
    buffer (pure): a window's query tile visits few key blocks, so its prologue (Q and first K
    loads, first Q K^T) and epilogue (O store) are a large share of it, and a persistent CTA overlaps
    them with its next tile's (O staged apart from Q). H200, 2026-12-04 (tools/ab_fwd.py, variant
    pers, 5 interleaved rounds; with mask_bits): gpt-oss d64 window 128 + sinks causal 8k 93.9 ->
    123.1 TFLOPs (1.311x), window 4096 d128 causal 32k 1.014x; out / lse bitwise equal to the grid
    launch. Not measured: d > 128 (d256 has no room for the separate O; persistent lost there on
    long causal cells, 2026-12-01), packed / paged windows."""
    if (cfg.local and not cfg.persistent and not cfg.ragged_q and not cfg.ragged_k and not cfg.split_kv
            and max(cfg.headdim, cfg.hdim_v) <= 128 and cfg.separate_o_fits()):
        return dataclasses.replace(cfg, persistent=True)
    return cfg


def short_seq_fwd_config(cfg: FwdConfig) -> FwdConfig:
    """The forward config for seqlen_k <= SHORT_SEQLEN_K: cfg persistent (grid = SM count, LPT /
    L2-section tile order, O staged in its own smem buffer so the next tile's Q loads during this
    tile's epilogue) for the plain d64 forward and the plain causal d128 one; d64 causal also takes
    128-row query tiles (a 1k sequence fills 8 of them exactly instead of 5.3 of 192 rows). Other
    configs are returned unchanged (d96 and the rest: not measured, or measured slower).

    Measured on the H200 (bf16, B * S = 32k tokens, hidden 2048; `bench --ablate`, interleaved
    rounds, 2026-12-01), TFLOPs ratio to the non-persistent config:
      d64 causal 1k: persistent 1.15x, persistent with 128-row tiles 1.32x (2k 1.03x, 4k 0.96x);
      d64 full 1k: persistent 1.08x (128-row tiles 1.00x; 2k 1.01x, 4k 0.98x);
      d128 causal 1k: 1.07x / 1.10x (two runs; 2k 1.01-1.03x, 4k 0.98x); d128 full 1k 0.98x;
      d256 (no room for the separate O buffer) causal 1k 0.89x, full 0.93x.
    """
    plain = (cfg.headdim_v is None and not (cfg.local or cfg.softcap or cfg.sink) and cfg.pack_gqa == 1
             and not (cfg.varlen_q or cfg.varlen_k or cfg.seqused_q or cfg.seqused_k or cfg.split_kv))
    if not plain or not (cfg.headdim == 64 or (cfg.headdim == 128 and cfg.causal)):  # measured cells only
        return cfg
    tile_m = 128 if cfg.headdim == 64 and cfg.causal else cfg.tile_m
    return dataclasses.replace(cfg, persistent=True, lpt=True, tile_m=tile_m)


def _select_fwd_config_hdimv(headdim: int, headdim_v: int, dtype: str, causal: bool, arch: int, local: bool,
                             softcap: bool, sink: bool) -> FwdConfig:
    """Tiles of the Dv != D forward (HDIMV_PAIRS). Two consumer warpgroups (240 registers each):
    acc_O is 64 x Dv and S 64 x tile_n per warpgroup.
      (192, 128): 128 x 128 (FA3's hopper/tile_size.h for hdim 192, hdim_v <= 128): Q 48 KiB + 2 K
                  stages 96 KiB + 2 V stages 64 KiB = 208 KiB; registers as d128. A window: 112.
      (128, 64):  128 x 128, as d128 (V and O take half the smem; acc_O 32 registers).
      (64, 128):  128 x 128: d64's 3 warpgroups (160 registers) would hold acc_O 64 + S 64 + P 32
                  registers and spill; Q's buffer is sized for O (128 x 128).
    """
    tile_m, tile_n = 128, 128
    if headdim == 192 and local:
        tile_n = 112
    return FwdConfig(headdim=headdim, dtype=dtype, causal=causal and not local, tile_m=tile_m, tile_n=tile_n,
                     kv_stages=2, lpt=causal and not local, arch=arch, local=local, softcap=softcap, sink=sink,
                     headdim_v=headdim_v)


def pack_gqa_wanted(cfg: FwdConfig, nheads: int, nheads_k: int) -> bool:
    """The GQA-packing policy of the dense forward: pack when the config has a sliding window (a tile
    of tile_m / pack queries visits fewer key blocks of a narrow band, and each K/V block is loaded
    once for all pack heads). Measured on the H200 (docs/perf, same call, packed / unpacked forward):
    gpt-oss d64 64/8 heads window 128 at 8k 1.19x; causal cells 0.91x (d128 64/8 4k) to 1.02x (d64
    64/8 and 32/1 at 8k), d256 16/8 softcap 1.00x, d128 32/8 full 1k 0.99x, window 1024 d128 1.01x:
    only the narrow window gains, so only windows pack. Since 2026-12-04 the bf16 d64 causal GQA /
    MQA forward packs too (tools/ab_fwd.py --variants pack, 5 interleaved rounds, out / lse bitwise
    equal to unpacked): MQA 32:1 causal 8k 1.052x, gpt-oss 64:8 causal 8k + sinks 1.029x (d128 GQA
    32:8 8k 0.991x, 64:8 4k 1.005x: not there)."""
    return cfg.local or (cfg.headdim == 64 and cfg.headdim_v is None and cfg.causal and cfg.dtype == "bf16")


def with_pack_gqa(cfg: FwdConfig, nheads: int, nheads_k: int, policy=None) -> FwdConfig:
    """cfg with pack_gqa = nheads // nheads_k when GQA packing applies (dense Q, tile_m a multiple of
    the pack, policy(cfg, nheads, nheads_k) true: pack_gqa_wanted by default), else cfg."""
    pack = nheads // max(nheads_k, 1)
    policy = pack_gqa_wanted if policy is None else policy
    if (pack <= 1 or cfg.tile_m % pack or cfg.varlen_q or cfg.seqused_q or cfg.split_kv
            or not policy(cfg, nheads, nheads_k)):
        return cfg
    return dataclasses.replace(cfg, pack_gqa=pack)


# ================================================================ forward speed candidates (issue 26)
# Off by default: the shipped configs (and their SASS) are unchanged until the H200 A/B
# (tools/ab_fwd.py; docs/design/speed_candidates.md section 7) says otherwise.
#
# Wider key tiles: {(headdim, causal): tile_n} for the plain dense forward (wide_tile_fwd_config).
# FlashAttention-3's Hopper table (hopper/tile_size.h) takes 128 x 176 at d128 without causal or
# window (flash-attn-4's Python sm90 keeps 128 x 128). Empty: every cell keeps select_fwd_config's
# tile. Compile-checked for sm_90a, bf16, 2 consumer warpgroups, every one 0 spills and wgmma not
# serialized (tests/cpu/test_fwd_candidates_cpu.py): d128 non-causal 160 / 176 / 192 (smem 192 /
# 208 / 224 KiB), d96 causal and non-causal 160 / 176 / 192.
FWD_WIDE_TILE_N: dict = {}
WIDE_TILE_N_CANDIDATES = {(128, False): (160, 176, 192), (96, False): (160, 176, 192), (96, True): (160, 176, 192)}
# A third K/V stage: {(headdim, causal): kv_stages} for the same plain forwards (d128 128 x 128: Q
# 32 KiB + 3 x 64 KiB = 224 KiB; d96 168 KiB). Empty: 2 stages everywhere (FA3 / flash-attn-4 take 2).
FWD_KV_STAGES: dict = {}
# L2 sections counted in KV heads for GQA / MQA LPT configs (FwdConfig.l2_kv_heads): off.
FWD_L2_KV_HEADS = False


def wide_tile_fwd_config(cfg: FwdConfig, tile_n: int | None = None, kv_stages: int | None = None) -> FwdConfig:
    """cfg with key tiles of tile_n rows and kv_stages K/V stages (None: FWD_WIDE_TILE_N's /
    FWD_KV_STAGES' entry for (headdim, causal), or cfg's own when there is none) where the candidate
    applies: the plain dense, non-persistent forward (no window, softcap, sink, Dv != D, GQA
    packing, packed / paged / split layouts: their tiles are chosen by their own rules) whose Q +
    K/V stages still fit shared memory. Else cfg."""
    if tile_n is None and kv_stages is None and not (FWD_WIDE_TILE_N or FWD_KV_STAGES):
        return cfg  # switched off: fwd_plan's per-call cost is this test
    key = (cfg.headdim, cfg.causal)
    tile_n = FWD_WIDE_TILE_N.get(key, cfg.tile_n) if tile_n is None else tile_n
    kv_stages = FWD_KV_STAGES.get(key, cfg.kv_stages) if kv_stages is None else kv_stages
    plain = (cfg.headdim_v is None and not (cfg.local or cfg.softcap or cfg.sink or cfg.persistent)
             and cfg.pack_gqa == 1 and not (cfg.varlen_q or cfg.varlen_k or cfg.seqused_q or cfg.seqused_k
                                            or cfg.split_kv or cfg.paged))
    if (tile_n, kv_stages) == (cfg.tile_n, cfg.kv_stages) or not plain:
        return cfg
    wide = dataclasses.replace(cfg, tile_n=tile_n, kv_stages=kv_stages)
    return wide if wide.smem_bytes() <= SM90_MAX_SMEM_BYTES - 1024 else cfg


def with_l2_kv_heads(cfg: FwdConfig, nheads: int, nheads_k: int, on: bool | None = None) -> FwdConfig:
    """cfg with FwdConfig.l2_kv_heads where it changes the order: an LPT config, unpacked GQA / MQA
    (nheads > nheads_k, pack_gqa 1) and `on` (None: FWD_L2_KV_HEADS). Else cfg."""
    on = FWD_L2_KV_HEADS if on is None else on
    if not on or not cfg.lpt or cfg.pack_gqa > 1 or nheads <= nheads_k:
        return cfg
    return dataclasses.replace(cfg, l2_kv_heads=True)


def shipped_fwd_configs() -> list[FwdConfig]:
    """Every config the API can select: what `python -m flash4 compile-check` builds."""
    return [
        select_fwd_config(d, dt, c)
        for d in SUPPORTED_HEADDIMS
        for dt in DTYPES
        for c in (False, True)
    ] + [
        select_fwd_config(d, dt, c, headdim_v=dv)
        for d, dv in HDIMV_PAIRS
        for dt in DTYPES
        for c in (False, True)
    ] + [
        short
        for d in SUPPORTED_HEADDIMS
        for dt in DTYPES
        for c in (False, True)
        if (short := select_fwd_config(d, dt, c, seqlen_k=SHORT_SEQLEN_K)) != select_fwd_config(d, dt, c)
    ] + [  # the long dense forwards that differ (shipped_vote_first: d128 non-causal)
        long
        for d in SUPPORTED_HEADDIMS
        for dt in DTYPES
        for c in (False, True)
        if (long := select_fwd_config(d, dt, c, seqlen_k=SHORT_SEQLEN_K + 1)) != select_fwd_config(d, dt, c)
    ] + [  # the dense forwards with the look-ahead Q K^T (shipped_lookahead_qk: bf16 (128, 64) causal)
        la
        for d, dv in HDIMV_PAIRS
        for dt in DTYPES
        for c in (False, True)
        if (la := shipped_lookahead_qk(select_fwd_config(d, dt, c, headdim_v=dv)))
        != select_fwd_config(d, dt, c, headdim_v=dv)
    ] + [  # the dense d96 forwards at 192 rows with P through smem (shipped_p_smem)
        p
        for d in SUPPORTED_HEADDIMS
        for dt in DTYPES
        for c in (False, True)
        if (p := shipped_p_smem(select_fwd_config(d, dt, c))) != select_fwd_config(d, dt, c)
    ] + [  # the tiles switched on in FWD_WIDE_TILE_N / FWD_KV_STAGES (none while they are empty)
        wide
        for d in SUPPORTED_HEADDIMS
        for dt in DTYPES
        for c in (False, True)
        if (wide := wide_tile_fwd_config(select_fwd_config(d, dt, c))) != select_fwd_config(d, dt, c)
    ]


# Head dims of the sm90 backward's shipped configs (the compile check's list; every KERNEL_HEADDIMS
# entry compiles, tests/cpu/test_headdim16_cpu.py): every head dim of the forward. Up to 128 each consumer
# warpgroup owns 64 keys and accumulates their dK, dV over the full headdim in registers; above
# 128 that would not fit the 240-register budget, so both warpgroups share 64 keys and split dK, dV
# over headdim (P^T and dS^T go through shared memory): `BwdConfig.split_headdim` (d256); head dim
# 192 and (192, 128) compute dK^T, dV^T with the head dim on M instead: `BwdConfig.transposed_dkv`.
BWD_SUPPORTED_HEADDIMS = SUPPORTED_HEADDIMS
# Pad of each fp32 row of the backward's dQ staging tile (floats): 32 B, so the 8 rows of one
# 64-bit accumulator store (4 lanes x 8 B each) fall on disjoint banks in pairs (no conflicts).
# The split-headdim configs are short of smem and take 16 B (2-way conflicts).
DQ_ROW_PAD, DQ_ROW_PAD_SPLIT = 8, 4
# Up to this head dim the dQ tile leaves in ONE bulk reduce-add per step (unpadded rows: one
# contiguous block, as in the dQ accumulator), not one per row: H200, same call (bf16 backward
# TFLOPs, per-row / whole tile): d64 16k 346 / 442, d64 causal 4k 289 / 361, causal 1k 182 / 221,
# d96 causal 4k 351 / 376; d128 full 4k 490 / 461 and d256 causal 4k 335 / 271 lose (the rows'
# bank conflicts cost more than the per-row issue saves there).
DQ_WHOLE_TILE_MAX_HEADDIM = 96
# Largest dynamic shared memory of one sm90 CTA (227 KiB: flash4.arch.CAPS, CUTLASS's table).
SM90_MAX_SMEM_BYTES = capacity(90).smem_per_block
# What the backward's tiles may take of it: 1 KiB stays for mbarriers and struct alignment.
BWD_SMEM_BUDGET = SM90_MAX_SMEM_BYTES - 1024


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """One compiled backward kernel.

    headdim, dtype, causal: as FwdConfig.
    tile_n:   keys per CTA: 128 (2 consumer warpgroups x 64 keys), 64 when split_headdim, 96 when
              transposed_dkv.
    tile_m:   queries per step of the CTA's loop.
    q_stages: depth of the Q / dO TMA pipelines.
    split_headdim: the 2 consumer warpgroups share the CTA's 64 keys; each computes S^T/dP^T for
              half of the queries and dK/dV/dQ for half of headdim (P^T, dS^T staged in smem).
    deterministic: dQ partial sums added in n_block order (bitwise reproducible), at some speed.
    varlen_q, varlen_k, seqused_q, seqused_k: the sequence layout, as FwdConfig (no paged KV).
    local:    sliding window, as FwdConfig (runtime sides; causal False).
    headdim_v: Dv of V, dO and dV when it differs from headdim (HDIMV_PAIRS); None = headdim. dP^T
              = V dO^T reduces over Dv, dV is (tile_n, Dv); Q, K, dQ, dK keep headdim. split_headdim
              when either head dim is above 128.
    dkv_accum: GQA/MQA head split: several CTAs share a KV head's key tile, each takes some of its
              query heads (heads_per_cta, a launch argument: flash4.config.bwd_heads_per_cta) and adds
              its fp32 dK, dV into zeroed fp32 accumulators (red.global); the host converts them. Off:
              one CTA walks every query head of its KV head and stores dK, dV itself.
    transposed_dkv: head dim 192 / (192, 128) (flash-attn-4's sm90 shape): 64 queries x 96 keys per
              step; S = Q K^T and dP = dO V^T with each warpgroup owning a 48-key half; dV^T = dO^T P
              and dK^T = Q^T dS with the head dim on the wgmma M axis (both operands from smem, P and
              dS staged); dQ = dS K split over head-dim halves. tile_n 96, tile_m 64.
    do_stages: depth of the dO pipeline (None: q_stages). transposed_dkv only.
    exp_before_dp_wait: speed switch, off by default (A/B: tools/ab_switch.py --switch
              exp_before_dp_wait; docs/design/speed_candidates.md). Where the step waits for dP^T
              with nothing of its own issued before the wait (StepRegs with dv_after_ds, StepSplitHd),
              predicated-off shared stores of P (never executed) are placed between P's
              exponentials and that wait, so ptxas keeps them ahead of it and they run under the dP^T
              GEMM (off, ptxas sinks every MUFU.EX2 below the wait). tile_m 64 or split_headdim only:
              at 128 queries per step (d64 bf16) ptxas serializes the wgmmas with it (the kernel
              raises ValueError). Same values.
    dq_handoff_per_wg: on where shipped_dq_handoff puts it (since 2026-12-03: d64 / d96 MHA, d128 with
              dq_whole; A/B: tools/ab_bwd_tiles.py, tools/ab_switch.py). Each consumer warpgroup hands its own half of the staged dQ tile to
              the store warp (its dQFullWG / dQEmptyWG barrier pair of 160 threads; the store warp
              reduce-adds each half on its own and frees it as soon as that half is read) instead of
              both warpgroups behind one 288-thread pair and one whole-tile reduce-add (flash-attn-4's
              hand-off). The halves are the per-warpgroup accumulator order (kernels/common/
              dq_accum.py), which the dQ postprocess reads back (get_bwd_postprocess_runner(...,
              wg_halves=True)). dq_accum_order configs (dense; head dim <= 96 or dq_whole), not
              deterministic.
              Same values (each dQ element added once per step).
    sink_delta: off by default; on only when a learnable sink needs a gradient (with_sink_delta).
              The kernel also sums D_i = sum_j P_ij dP_ij (the exact rowsum(dO * O) of the float32
              output; the learnable sink's gradient needs it to the float32 reference's accuracy,
              docs/conformance/fa4-suite.md) per query row into a zeroed fp32 (B, H, Sq_pad) buffer:
              each consumer warp's partial sums (reduced over the lanes sharing a query) go to
              shared memory at the dQ hand-off (the staging tile's row pad, or sink_delta_smem_bytes
              of their own on whole-tile configs); the dQ store warp adds their sum (in a fixed order)
              to the buffer, deterministic: inside its dQ turn. Not with dq_handoff_per_wg.
              With one buffer (sink_delta_db off) the consumers take the dQEmpty wait before
              staging their partial sums (not at the dQ hand-off), since the store warp reads that
              buffer after dQFull.
    sink_delta_db: on with sink_delta where its two buffers fit (with_sink_delta; all but d256's
              split_headdim, 0.5 KiB over). The partial sums double-buffered by step parity in a buffer
              of their own (2 x sink_delta_smem_bytes): step s writes buffer s % 2, which the store
              warp last read at step s - 2, and the consumers passed that read's dQEmpty at step
              s - 1's hand-off; so the dQEmpty wait stays at the dQ hand-off as without sink_delta.
              H200, 2026-12-03 evening (tools/ab_bwd_tiles.py, 5 interleaved rounds): gpt-oss d64
              64/8 heads causal 8k with the sink gradient 342.2 -> 396.5 TFLOPs (1.159x; without
              sink_delta 450.9), the window-128 layer 0.998x (its cost is the reductions: 1.114x
              without sink_delta). Same values.
    no_tail_guard: A/B only, off (FLASH4_BWD_SWITCHES=no_tail_guard; tools/ab_tails.py): ragged
              layouts (varlen / seqused) skip zero_kv_tail / zero_q_tail (issue 25's guards), to
              measure their cost in the same run. Same gradients on clean memory; stale NaN / inf
              past a sequence's end then leaks into them (never use it to train).
    dq_swapab: speed candidate, off by default and in no shipped selection (A/B: tools/ab_bwd_tiles.py,
              variant "m80"; docs/design/speed_candidates.md section 6). flash-attn-4's / FA3's head dim
              128 non-causal tile: tile_m 80 (DQ_SWAPAB_TILE_M), and the dQ GEMM computed transposed,
              dQ^T = K^T dS^T (M = head dim, split over the two warpgroups; N = tile_m; K = the 128
              keys), so that every wgmma has M a multiple of 64 at a query tile that is not. The
              dQ^T accumulator is staged transposed into an unpadded row-major (tile_m, headdim)
              fp32 tile (scalar stores) and reduce-added with one bulk op per step into the row-major
              dQ accumulator (the postprocess is the row-major one); per-stage LSE / D rows padded to
              a multiple of 32 (TMA stage addresses 128-byte aligned). Head dim 128, dense, no mask
              but the key edge, not deterministic, no sink_delta. Compile-verified, not run on hardware.
    mask_rel: speed switch (FLASH4_BWD_SWITCHES=mask_rel; tools/ab_bwd_tiles.py): the P^T mask of the
              keys-major steps from one step's bounds relative to the thread's first element
              (flash4.geometry.key_row_bounds / probs_t_hidden: compares of a step value against the
              fragment's compile-time offsets) instead of first_query / query_end per key row, whose
              key-only parts ptxas kept live across the step loops (window d128: 2 rows x 2 bounds).
              The same elements hidden (CPU test against the per-row rule): same values. On where
              shipped_dq_handoff puts it (the d128 window backward, with its whole-tile per-warpgroup
              dQ hand-off, which spills without it; since 2026-12-04), elsewhere off (alone: 1.000x).
              Left out of the repr while off.
    dq_whole: the whole-tile dQ hand-off (one bulk reduce-add per step, unpadded staging; dense
              layouts in the accumulator order, so with dq_handoff_per_wg flash-attn-4's per-warpgroup
              hand-off) above DQ_WHOLE_TILE_MAX_HEADDIM (head dim 128), instead of one bulk reduce-add
              per staged row (H200 ncu, d128 causal 4k: 64 per step; the consumers' dQEmpty wait was
              the step's largest stall). On where shipped_dq_handoff puts it (since 2026-12-03: d128
              dense, H200 1.04-1.09x; docs/design/speed_candidates.md section 6b). Same values.
    lse_early: speed candidate, off by default and in no shipped selection (A/B: tools/ab_bwd_tiles.py,
              variant "lse"). The step's LSE values (the fast path's padded log2 LSE staged with Q)
              are read from shared memory into registers right after the S^T GEMM is issued, so
              their latency passes under the S^T / dP^T GEMMs (flash-attn-4's order) instead of
              after the S^T wait, where the exponent's first FFMA waited on them (H200 ncu, d128
              causal 4k: 5.6 % of the kernel's stall samples on that one instruction). Same values.
    dpsum_scaled: speed candidate, off by default and in no shipped selection (FLASH4_BWD_SWITCHES=
              dpsum_scaled; tools/ab_bwd_tiles.py variant "dsc"). The host hands the kernel D already
              multiplied by the softmax scale (flash4.backward: one fp32 multiply per row after the
              preprocess and the dLSE subtraction), so the step reads D * scale instead of computing
              it: one FMUL per query column per step less (sm_90a SASS, d128 full: 16 per thread of a
              452-instruction step; d64 128-query steps: 32). The same fp32 product as the kernel's
              (fp32(D) * fp32(scale), rounded to nearest): same values. Only where the step forms dS
              by fma (ds_by_fma: no softcap; dV after dS^T, or transposed_dkv).
    """

    headdim: int
    dtype: str = "bf16"
    causal: bool = False
    tile_m: int = 64
    tile_n: int = 128
    q_stages: int = 2
    split_headdim: bool = False
    deterministic: bool = False
    arch: int = 90
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    local: bool = False
    softcap: bool = False
    headdim_v: int | None = None
    dkv_accum: bool = False
    transposed_dkv: bool = False
    do_stages: int | None = None
    exp_before_dp_wait: bool = False
    dq_handoff_per_wg: bool = False
    sink_delta: bool = False
    dq_swapab: bool = False
    dq_whole: bool = False
    lse_early: bool = False
    sink_delta_db: bool = False
    no_tail_guard: bool = False
    mask_rel: bool = False
    dpsum_scaled: bool = False

    def __post_init__(self):
        assert self.headdim in KERNEL_HEADDIMS, self.headdim
        assert not self.sink_delta_db or self.sink_delta, self
        assert not self.dpsum_scaled or self.ds_by_fma, self
        assert not self.dq_handoff_per_wg or (self.dq_accum_order and not self.deterministic), self
        assert not (self.sink_delta and self.dq_handoff_per_wg), self
        assert self.headdim_v is None or (self.headdim, self.headdim_v) in HDIMV_PAIRS, (self.headdim, self.headdim_v)
        assert self.dtype in DTYPES, self.dtype
        assert not self.dq_whole or not (self.split_headdim or self.transposed_dkv or self.dq_swapab), self
        if self.transposed_dkv:
            assert not self.split_headdim and self.tile_n == 96 and self.tile_m == 64, self
        elif self.dq_swapab:
            assert dq_swapab_ok(self), self
        else:
            assert self.tile_n == (64 if self.split_headdim else 128) and self.tile_m % 64 == 0
            assert self.do_stages is None, self
        assert self.smem_bytes() <= BWD_SMEM_BUDGET, self.smem_bytes()

    def __repr__(self) -> str:
        return _quiet_repr(self)

    @property
    def dv_after_ds(self) -> bool:
        """Whether the kernel issues dV after the dS^T math (FA3's order; kernels/sm90/bwd.py): not
        split_headdim, and not head dim 128 or more with a packed / seqused layout or a window
        (there that order spills: the compile check's 12-14 local-memory instructions)."""
        wide_layout = self.varlen_q or self.varlen_k or self.seqused_q or self.seqused_k or self.local
        return not self.split_headdim and not (max(self.headdim, self.hdim_v) >= 128 and wide_layout)

    @property
    def ds_by_fma(self) -> bool:
        """Whether the step forms dS = P * fma(dP, scale, -D * scale) (two instructions per element;
        kernels/sm90/bwd_step.py grad_scores): no softcap, and transposed_dkv (StepDkvT) or the
        register steps with dV after dS^T (StepRegs, StepRegsDqT). Where dpsum_scaled applies."""
        if self.softcap:
            return False
        return self.transposed_dkv or (not self.split_headdim and self.dv_after_ds)

    @property
    def dq_row_pad(self) -> int:
        if self.dq_swapab or self.dq_whole:
            return 0  # one contiguous tile, reduce-added whole (dq_swapab, dq_whole above)
        return _dq_row_pad(self.split_headdim, self.headdim, self.transposed_dkv)

    @property
    def stat_stage_rows(self) -> int:
        """Rows of one LSE / D stage in shared memory: tile_m, rounded up to a multiple of 32 (128
        bytes, the TMA destination's alignment) where it is not one (dq_swapab's tile_m 80: 96)."""
        return stat_stage_rows(self.tile_m)

    @property
    def dq_whole_tile(self) -> bool:
        """One bulk reduce-add of the whole staged dQ tile per step (unpadded rows) instead of one per
        row (DQ_WHOLE_TILE_MAX_HEADDIM)."""
        return self.dq_whole or dq_whole_tile(self.split_headdim, self.headdim, self.transposed_dkv)

    @property
    def dq_accum_order(self) -> bool:
        """dQ staged and accumulated in the dQ wgmma accumulator's element order (kernels/common/
        dq_accum.py: 16-byte conflict-free smem stores, the postprocess un-permutes) instead of
        row-major (8-way bank-conflicted 64-bit stores at a 256 B row pitch: H200 ncu, d64 16k, 805M
        excess store wavefronts). Whole-tile configs with the dense layout (a packed layout's dQ
        gather keeps rows)."""
        return self.dq_whole_tile and not (self.varlen_q or self.seqused_q)

    @property
    def hdim_v(self) -> int:
        """Dv: the head dim of V, dO and dV."""
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def dynamic_seqlen_k(self) -> bool:
        """The key count differs per sequence (cu_seqlens_k or seqused_k): the grid is sized by
        max_seqlen_k (a host int) and CTAs past their sequence's keys exit at once."""
        return self.varlen_k or self.seqused_k

    @property
    def ragged_q(self) -> bool:
        """Query rows past a sequence inside a tile are not TMA zeros (packed Q, seqused_q)."""
        return self.varlen_q or self.seqused_q

    @property
    def ragged_k(self) -> bool:
        """Key rows past a sequence inside a tile are not TMA zeros (packed K, seqused_k)."""
        return self.varlen_k or self.seqused_k

    @property
    def num_do_stages(self) -> int:
        """Depth of the dO pipeline (do_stages, or q_stages when None)."""
        return self.q_stages if self.do_stages is None else self.do_stages

    @property
    def sink_delta_slots(self) -> int:
        """sink_delta: partial sums per query row a step stages (one per consumer warp that holds
        some of the row's keys): 8 (two warpgroups x 4 warps of 16 keys), 4 with split_headdim (one
        warpgroup's 4 warps), 2 with transposed_dkv (the two 48-key halves)."""
        return sink_delta_slots(self.split_headdim, self.transposed_dkv)

    @property
    def sink_delta_in_row_pad(self) -> bool:
        """sink_delta: the partial sums live in the dQ staging tile's row pad (dq_row_pad >= slots);
        else (whole-tile configs, no pad; sink_delta_db) in a buffer of their own (sink_delta_smem_bytes)."""
        return self.dq_row_pad >= self.sink_delta_slots and not self.sink_delta_db

    @property
    def sink_delta_stages(self) -> int:
        """Buffers of the partial sums: 2 with sink_delta_db (by step parity), else 1."""
        return 2 if self.sink_delta_db else 1

    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.headdim, self.tile_m, self.tile_n, self.q_stages, self.split_headdim,
                              self.headdim_v, self.transposed_dkv, self.do_stages,
                              dq_swapab=self.dq_swapab, dq_whole=self.dq_whole) + self.sink_delta_smem_bytes()

    def sink_delta_smem_bytes(self) -> int:
        """Shared memory sink_delta adds: 0 off or in the row pad, else tile_m x slots fp32 per
        buffer (sink_delta_stages)."""
        if not self.sink_delta or self.sink_delta_in_row_pad:
            return 0
        return self.tile_m * self.sink_delta_slots * 4 * self.sink_delta_stages


def sink_delta_slots(split_headdim: bool, transposed_dkv: bool) -> int:
    return 2 if transposed_dkv else 4 if split_headdim else 8


def with_sink_delta(cfg: BwdConfig) -> BwdConfig:
    """cfg that also sums D = sum_j P dP per query row (BwdConfig.sink_delta: a learnable sink needs a
    gradient), its partial sums double-buffered where they fit (sink_delta_db); the per-warpgroup dQ
    hand-off and the whole-tile d128 hand-off (speed switches, shipped_dq_handoff: not measured with
    sink_delta) off, and with them the window's mask_rel (shipped only together with them: alone it
    spills the d128 window kernel) and the dpsum_scaled candidate (3 spill instructions with it)."""
    on = dataclasses.replace(cfg, sink_delta=True, dq_handoff_per_wg=False, dq_whole=False, mask_rel=False,
                             dpsum_scaled=False)  # dpsum_scaled: 3 spills with sink_delta (d64 GQA causal)
    return dataclasses.replace(on, sink_delta_db=True) if sink_delta_db_fits(on) else on


def sink_delta_db_fits(cfg: BwdConfig) -> bool:
    """Whether a sink_delta cfg's two partial-sum buffers (sink_delta_db) fit the smem budget."""
    db_bytes = 2 * cfg.tile_m * cfg.sink_delta_slots * 4
    return cfg.smem_bytes() - cfg.sink_delta_smem_bytes() + db_bytes <= BWD_SMEM_BUDGET


# BwdConfig.dq_swapab (speed candidate, off): flash-attn-4's head dim 128 non-causal query tile.
DQ_SWAPAB_TILE_M = 80


def stat_stage_rows(tile_m: int) -> int:
    """BwdConfig.stat_stage_rows: tile_m rounded up to a multiple of 32 (a 128-byte aligned stage)."""
    return -(-tile_m // 32) * 32


def dq_swapab_ok(cfg) -> bool:
    """Where BwdConfig.dq_swapab is built: head dim 128 (Dv too), 128 keys in the S^T split, tile_m a
    multiple of 16 (the wgmma K of dK / dV; N of S^T / dP^T / dQ^T), dense, no mask but the key edge,
    none of the other switches, not deterministic."""
    return (cfg.headdim == 128 and cfg.hdim_v == 128 and cfg.tile_n == 128 and cfg.tile_m % 16 == 0
            and 16 <= cfg.tile_m <= 256 and not cfg.split_headdim and not cfg.transposed_dkv
            and cfg.do_stages is None and not cfg.causal and not cfg.local and not cfg.deterministic
            and not (cfg.varlen_q or cfg.varlen_k or cfg.seqused_q or cfg.seqused_k) and not cfg.dkv_accum
            and not cfg.softcap and not cfg.sink_delta and not cfg.dq_handoff_per_wg and not cfg.exp_before_dp_wait)


def dq_swapab_config(cfg):
    """The dq_swapab candidate of a shipped head dim 128 full config (tile_m DQ_SWAPAB_TILE_M), or None
    where it is not built (dq_swapab_ok). For tools/ab_bwd_tiles.py only: no selection returns it."""
    if not isinstance(cfg, BwdConfig):
        return None
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields.update(tile_m=DQ_SWAPAB_TILE_M, exp_before_dp_wait=False, dq_handoff_per_wg=False, dq_swapab=True,
                  dq_whole=False)
    cand = types.SimpleNamespace(**fields, hdim_v=cfg.hdim_v)
    if not dq_swapab_ok(cand):
        return None
    return BwdConfig(**fields)


def dq_whole_tile(split_headdim: bool, headdim: int, transposed_dkv: bool = False) -> bool:
    return not split_headdim and not transposed_dkv and headdim <= DQ_WHOLE_TILE_MAX_HEADDIM


def _dq_row_pad(split_headdim: bool, headdim: int, transposed_dkv: bool = False) -> int:
    if dq_whole_tile(split_headdim, headdim, transposed_dkv):
        return 0  # the tile is one contiguous block, as its rows are in the dQ accumulator
    return DQ_ROW_PAD_SPLIT if split_headdim else DQ_ROW_PAD


def bwd_smem_bytes(headdim: int, tile_m: int, tile_n: int, q_stages: int, split_headdim: bool,
                   headdim_v: int | None = None, transposed_dkv: bool = False, do_stages: int | None = None,
                   dq_swapab: bool = False, dq_whole: bool = False) -> int:
    """Backward smem: K, V, the Q/dO stages, two dS^T (and P^T) buffers, the fp32 dQ tile and the
    LSE/D stages (bytes, no barriers). headdim_v: V's / dO's head dim (None: headdim).
    transposed_dkv: one P and one dS tile (tile_m x tile_n each), do_stages dO / D stages (None:
    q_stages). dq_swapab: the dQ tile unpadded, the LSE / D stages of stat_stage_rows rows.
    dq_whole: the dQ tile unpadded."""
    if dq_swapab:
        dv = headdim if headdim_v is None else headdim_v
        return (tile_n * (headdim + dv) * 2 + q_stages * tile_m * (headdim + dv) * 2 + 2 * tile_n * tile_m * 2
                + tile_m * headdim * 4 + 2 * q_stages * stat_stage_rows(tile_m) * 4)
    elt = 2
    dv = headdim if headdim_v is None else headdim_v
    kv = tile_n * (headdim + dv) * elt
    if transposed_dkv:
        do_stages = q_stages if do_stages is None else do_stages
        q_do = q_stages * tile_m * headdim * elt + do_stages * tile_m * dv * elt
        ds = 2 * tile_n * tile_m * elt
        stats = (q_stages + do_stages) * tile_m * 4
    else:
        q_do = q_stages * tile_m * (headdim + dv) * elt
        ds = (2 if split_headdim else 1) * 2 * tile_n * tile_m * elt
        stats = 2 * q_stages * tile_m * 4
    dq = tile_m * (headdim + (0 if dq_whole else _dq_row_pad(split_headdim, headdim, transposed_dkv))) * 4
    return kv + q_do + ds + dq + stats


def _transposed_dkv_config(headdim: int, headdim_v: int | None, dtype: str, causal: bool, arch: int,
                           deterministic: bool, local: bool, softcap: bool) -> BwdConfig | None:
    """The transposed_dkv config (64 queries x 96 keys, 2 Q stages, as many dO stages of (2, 1) as
    fit the smem budget: 1 at d192, 2 at (192, 128)), or None where it does not apply (see
    TRANSPOSED_DKV_HEADDIMS and transposed_dkv_ok)."""
    if (headdim, headdim_v) not in TRANSPOSED_DKV_HEADDIMS:
        return None
    if not transposed_dkv_ok(deterministic=deterministic, local=local, softcap=softcap):
        return None
    do_stages = next((n for n in (2, 1) if bwd_smem_bytes(headdim, 64, 96, 2, False, headdim_v, True, n)
                      <= BWD_SMEM_BUDGET), None)
    if do_stages is None:
        return None
    return BwdConfig(headdim=headdim, dtype=dtype, causal=causal and not local, tile_m=64, tile_n=96, q_stages=2,
                     deterministic=deterministic, arch=arch, local=local, softcap=softcap, headdim_v=headdim_v,
                     transposed_dkv=True, do_stages=do_stages)


# (headdim, headdim_v) pairs that take the transposed_dkv backward (headdim_v None: = headdim).
TRANSPOSED_DKV_HEADDIMS = ((192, None), (192, 128))
# Variants of the transposed_dkv path that compile without spills / serialized wgmma (compile
# check); the others keep split_headdim.
TRANSPOSED_DKV_VARIANTS = {"deterministic": True, "local": True, "softcap": True, "dkv_accum": True}


def transposed_dkv_ok(deterministic: bool = False, local: bool = False, softcap: bool = False) -> bool:
    flags = {"deterministic": deterministic, "local": local, "softcap": softcap}
    return all(TRANSPOSED_DKV_VARIANTS[k] for k, on in flags.items() if on)


def select_bwd_config(headdim: int, dtype: str = "bf16", causal: bool = False, arch: int = 90,
                      deterministic: bool = False, local: bool = False, softcap: bool = False,
                      headdim_v: int | None = None) -> BwdConfig:
    """Pick the backward config (pure; CPU-tested). Raises ValueError for what has no kernel.
    local: a sliding window (causal folded into it: the config has causal False).
    headdim_v: V's / dO's head dim (None or headdim: the same; else a HDIMV_PAIRS pair)."""
    if headdim not in KERNEL_HEADDIMS:
        raise ValueError(f"flash4 backward: headdim={headdim} not supported; allowed: {KERNEL_HEADDIMS}")
    headdim_v = canonical_hdimv(headdim, headdim_v)
    if headdim_v is not None:
        return _select_bwd_config_hdimv(headdim, headdim_v, dtype, causal, arch, deterministic, local, softcap)
    cfg_t = _transposed_dkv_config(headdim, None, dtype, causal, arch, deterministic, local, softcap)
    if cfg_t is not None:
        return cfg_t
    split = headdim > 128
    # d64 bf16: 128 queries per step (S^T, dP^T 64x128 per warpgroup) halves the per-step overhead
    # (barriers, dQ hand-off); H200: +4-7% over 64. It fits 240 registers without spills in bf16
    # only (fp16 spills 12-24 registers: the compile check rejects it), so fp16 keeps 64.
    # A window's third (left-edge) masked loop spills at 128 (compile check: 11 spill instructions).
    # softcap's derivative (a log2 per element) spills there too (18).
    tile_m = 128 if headdim <= 64 and dtype == "bf16" and not local and not softcap else 64
    tile_n = 64 if split else 128
    # Two Q/dO stages where they fit in shared memory (d256 needs one).
    q_stages = next((n for n in (2, 1) if bwd_smem_bytes(headdim, tile_m, tile_n, n, split) <= BWD_SMEM_BUDGET), None)
    if q_stages is None:
        raise AssertionError(f"no backward config fits shared memory for headdim={headdim}")
    return BwdConfig(headdim=headdim, dtype=dtype, causal=causal and not local, tile_m=tile_m, tile_n=tile_n,
                     q_stages=q_stages, split_headdim=split, deterministic=deterministic, arch=arch, local=local,
                     softcap=softcap)


def _select_bwd_config_hdimv(headdim: int, headdim_v: int, dtype: str, causal: bool, arch: int,
                             deterministic: bool, local: bool, softcap: bool) -> BwdConfig:
    """Tiles of the Dv != D backward (HDIMV_PAIRS), 240 registers per consumer warpgroup:
      (192, 128): transposed_dkv (_transposed_dkv_config: 64 queries x 96 keys, dK^T 72 + dV^T 48
                  registers per thread). Where that path is off (TRANSPOSED_DKV_VARIANTS): split_headdim (64 keys, 64 queries): dK over the full 192 in registers would
                  take 96 + dV 64 + S^T/dP^T 64 + dQ 48 > 240; split, each warpgroup holds dK 48 +
                  dV 32. K, V 40 KiB + 2 Q/dO stages 80 KiB + dS^T/P^T 32 KiB + dQ 49 KiB.
      (128, 64):  as d128: 128 keys x 64 queries, dK 64 + dV 32 registers.
      (64, 128):  128 keys x 64 queries (not d64's 128 queries: S^T, dP^T 64 each + dV 64 + dK 32
                  + dQ 32 > 240).
    """
    cfg_t = _transposed_dkv_config(headdim, headdim_v, dtype, causal, arch, deterministic, local, softcap)
    if cfg_t is not None:
        return cfg_t
    split = max(headdim, headdim_v) > 128
    tile_m, tile_n = 64, (64 if split else 128)
    q_stages = next((n for n in (2, 1) if bwd_smem_bytes(headdim, tile_m, tile_n, n, split, headdim_v)
                     <= BWD_SMEM_BUDGET), None)
    if q_stages is None:
        raise AssertionError(f"no backward config fits shared memory for headdim={headdim}, headdim_v={headdim_v}")
    return BwdConfig(headdim=headdim, dtype=dtype, causal=causal and not local, tile_m=tile_m, tile_n=tile_n,
                     q_stages=q_stages, split_headdim=split, deterministic=deterministic, arch=arch, local=local,
                     softcap=softcap, headdim_v=headdim_v)


# The GQA/MQA backward splits a KV head's query heads over CTAs only when each (key tile, query
# head) pair has at least this many visible queries on average (mean_queries_per_key): below it a
# CTA's work per head is short and the split's per-CTA costs (K/V load, fp32 adds) dominate.
BWD_SPLIT_MIN_QUERIES = 1024


def bwd_heads_per_cta(nheads: int, nheads_k: int, override: int | None = None,
                      queries_per_key: float | None = None) -> int:
    """Query heads per backward CTA (GQA/MQA head split, BwdConfig.dkv_accum): the whole group
    (nheads // nheads_k; no split) for MHA and when queries_per_key (mean_queries_per_key, None =
    unknown: split) is below BWD_SPLIT_MIN_QUERIES; else 1 for groups of 2 and 3, 2 for groups of 4
    and more (each CTA adds its fp32 dK, dV into accumulators). Measured on the H200, bf16 backward
    TFLOPs, heads per CTA 1 / 2 / whole group (docs/perf/README.md, "Backward work of 2026-12-01"):
      split wins: 64q/8kv d128 causal 4k 420 / 427 / 398; 32q/1kv d64 causal 8k 301 / 306 / 231;
                  64q/8kv d64 causal 8k 297 / 297 / 276;
      split loses: 32q/8kv d128 causal 1k 253 / 273 / 300; 64q/8kv d64 causal 1k 194 / 209 / 231;
                  window 512 d128 32q/8kv 8k 223 / 241 / 272; gpt-oss window 128 64 / 71 / 83;
      even: window 4096 d128 32q/8kv 16k 437 / 450 / 459.
    override: a positive int (FLASH4_BWD_HEADS_PER_CTA, for measurements), clipped to the group."""
    group = nheads // max(nheads_k, 1)
    if override is not None:
        return max(1, min(override, group))
    if group <= 1 or (queries_per_key is not None and queries_per_key < BWD_SPLIT_MIN_QUERIES):
        return group
    return 1 if group < 4 else 2


def with_dkv_accum(cfg: BwdConfig, nheads: int, nheads_k: int, heads_per_cta: int) -> BwdConfig:
    """cfg with dkv_accum on when heads_per_cta splits the query heads of a KV head (GQA/MQA).
    d64's 128-query step stays (the accumulating epilogue once spilled there, 24 local-memory
    instructions; with today's kernel every d64 dkv_accum variant compiles at 128 with 0 spills:
    plain, sink_delta, deterministic, packed, seqused, causal or not). H200 A/B
    (tools/ab_bwd_tiles.py, 2026-12-02), 128 against 64 queries: MQA 32:1 d64 causal 8k 445 / 419
    TFLOPs (1.063x), gpt-oss d64 64:8 causal 8k + sinks 344 / 322 (1.069x). Packed
    (varlen) deterministic configs keep one CTA per KV head: split, they spill a register (one
    value, reloaded outside the main loop, but the compile check admits no spill). Windowed (local)
    configs too: split, they measured no faster (window 128 / 512 / 4096: 71 / 241 / 450 vs 83 / 272 /
    459 TFLOPs whole) and d128 spills (7 local-memory instructions)."""
    if heads_per_cta >= nheads // max(nheads_k, 1):
        return cfg
    if cfg.deterministic and (cfg.varlen_q or cfg.varlen_k):
        return cfg
    if cfg.local:
        return cfg  # windows: the whole group measured as fast or faster (bwd_heads_per_cta), and d128 spills
    if cfg.transposed_dkv and not TRANSPOSED_DKV_VARIANTS["dkv_accum"]:
        cfg = dataclasses.replace(cfg, transposed_dkv=False, tile_n=64, do_stages=None, split_headdim=True)
    return dataclasses.replace(cfg, dkv_accum=True)


def shipped_bwd_configs() -> list[BwdConfig]:
    configs = [select_bwd_config(d, dt, c) for d in BWD_SUPPORTED_HEADDIMS for dt in DTYPES for c in (False, True)]
    configs += [select_bwd_config(d, "bf16", c, deterministic=True) for d in BWD_SUPPORTED_HEADDIMS for c in (False, True)]
    configs += [select_bwd_config(d, dt, c, headdim_v=dv) for d, dv in HDIMV_PAIRS for dt in DTYPES
                for c in (False, True)]
    # GQA/MQA head split (dkv_accum): every head dim in bf16, fp16 at d128, deterministic, a Dv pair.
    accum = [select_bwd_config(d, "bf16", c) for d in BWD_SUPPORTED_HEADDIMS for c in (False, True)]
    accum += [select_bwd_config(128, "fp16", c) for c in (False, True)]
    accum += [select_bwd_config(d, "bf16", True, deterministic=True) for d in (64, 128)]
    accum += [select_bwd_config(192, "bf16", True, headdim_v=128)]
    # the d128 window backward (shipped_dq_handoff: whole-tile per-warpgroup hand-off with mask_rel)
    configs += [select_bwd_config(128, dt, False, local=True) for dt in DTYPES]
    return [shipped_dq_handoff(cfg) for cfg in configs + [with_dkv_accum(cfg, 2, 1, 1) for cfg in accum]]


def head_split_config(cfg: BwdConfig, nheads: int, nheads_k: int, seqlen_q: int, seqlen_k: int, causal: bool, window,
                      override: int | None = None) -> tuple[BwdConfig, int]:
    """(cfg, heads_per_cta) of the GQA/MQA head split (BwdConfig.dkv_accum, chosen by
    bwd_heads_per_cta from the mean visible queries per key, or `override`: FLASH4_BWD_HEADS_PER_CTA).
    seqlen_q, seqlen_k: the (max) sequence lengths; window: flash4.geometry.window_sides' or None.
    Apply it before anything is sized by cfg.tile_m: the split may change the query tile."""
    queries = mean_queries_per_key(seqlen_q, seqlen_k, causal, window)
    heads_per_cta = bwd_heads_per_cta(nheads, nheads_k, override, queries)
    return with_dkv_accum(cfg, nheads, nheads_k, heads_per_cta), heads_per_cta


# ================================================================ decode (flash_attn_with_kvcache)
# Two measures make a decode step read the cache at memory speed (FlashDecoding, Dao et al. 2023;
# FlashAttention-3's decode path):
#   * GQA packing: the `pack = nheads // nheads_k` query heads that share a KV head become query
#     rows of one tile, so K/V are read once per KV head instead of once per query head. The host
#     packs q (a copy of the small query tensor: (B, Sq, H, D) -> (B, Sq * pack, Hk, D), packed row
#     r = query r // pack of head hk * pack + r % pack). The kernel sees a non-causal problem with
#     Sq * pack queries, which is exact when Sq == 1 (the one query sees every key, causal or not);
#     causal steps with Sq > 1 are not packed.
#   * Split-KV: when batch x nheads_k tiles cannot fill the GPU, each tile's key blocks are split
#     over `num_splits` CTAs (FwdConfig.split_kv); their partial O / LSE are merged by the combine
#     kernel (kernels/common/fwd_combine.py), which also unpacks the GQA rows.
# num_splits is chosen from host-known sizes only (batch, heads, the cache's capacity), never from
# cache_seqlens' contents, so a step is CUDA-graph safe and changing lengths never recompiles.

# Deepest K/V pipeline a decode config takes (the step streams the cache: more loads in flight).
MAX_DECODE_KV_STAGES = 4


def decode_tiles(cfg: FwdConfig, seqlen_p: int) -> FwdConfig:
    """The forward config with decode tiles: when the packed query rows fit one warpgroup (64),
    one consumer warpgroup (tile_m 64: half the tensor-core work of a 128-row tile whose rows are
    mostly empty) and the deepest K/V pipeline that fits shared memory (at most
    MAX_DECODE_KV_STAGES)."""
    if seqlen_p > ROWS_PER_WARPGROUP:
        return cfg
    cfg = dataclasses.replace(cfg, tile_m=ROWS_PER_WARPGROUP, lpt=False, kv_stages=1)
    per_stage = cfg.tile_n * (cfg.headdim + cfg.hdim_v) * 2
    stages = (SM90_MAX_SMEM_BYTES - 1024 - cfg.smem_bytes() + per_stage) // per_stage
    return dataclasses.replace(cfg, kv_stages=max(2, min(MAX_DECODE_KV_STAGES, stages)))


def pack_factor(nheads: int, nheads_k: int, seqlen_q: int, causal: bool, window=None) -> int:
    """Query heads packed per KV head (1: no packing); see the decode notes above. Not with a
    sliding window (its band follows the query index, which packing would change)."""
    group = nheads // nheads_k
    return group if group > 1 and window is None and (seqlen_q == 1 or not causal) else 1


@functools.lru_cache(maxsize=1024)
def decode_plan(batch: int, seqlen_q: int, nheads: int, nheads_k: int, headdim: int, dtype: str, causal: bool,
                page_size: int, capacity: int, num_splits: int, arch: int, num_sms: int,
                window=None, softcap: bool = False, sink: bool = False, headdim_v: int | None = None,
                page_policy: tuple = (0, False), gather_zero_fill: bool = False,
                divide_free: bool = False, combine_policy: tuple = (False, 0)) -> FwdPlan:
    """The plan of a decode step (pure; CPU-tested; cached: a step's host work is a lookup):
    packing, config and split count. page_size: 0 for a contiguous cache; capacity: keys the cache
    can hold per sequence. headdim_v: V's head dim (None: headdim). page_policy: (gather_max,
    prefetch) of paged_layout (page_policy()); gather_zero_fill: the zero-fill switch of a gathered
    config (gather_policy()); divide_free: with_page_divide_free's switch (page_divide_free_policy());
    combine_policy: with_combine_policy's (prefetch, pdl_min_splits) (decode_combine_policy())."""
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
    paged = paged_layout(page_size, cfg.tile_n, *page_policy) if page_size else {}
    cfg = with_seq_layout(cfg, seqused_k=True, split_kv=num_splits > 1, **paged)
    cfg = with_page_divide_free(with_gather(cfg, gather_zero_fill), page_size, divide_free)
    return FwdPlan(with_combine_policy(cfg, num_splits, combine_policy), pack, num_splits, seqlen_p, heads_p)


def decode_combine_policy() -> tuple:
    """(prefetch, pdl_min_splits) of this call's split-KV combine: (COMBINE_PREFETCH,
    PDL_COMBINE_MIN_SPLITS), or (False, 0) under FLASH4_DECODE_COMBINE=0 (the plain combine)."""
    from flash4 import env  # late: host-only

    if env.decode_combine() is False:
        return (False, 0)
    return (COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS)


def with_combine_policy(cfg: FwdConfig, num_splits: int, policy: tuple) -> FwdConfig:
    """cfg of a decode step with num_splits splits, with FwdConfig.combine_prefetch (up to MAX_SPLITS
    splits) and pdl_combine (at least pdl_min_splits splits, > 0) as policy = (prefetch,
    pdl_min_splits) says; unchanged without a split. Pure."""
    prefetch, pdl_min_splits = policy
    if not cfg.split_kv:
        return cfg
    flags = {}
    if prefetch and num_splits <= MAX_SPLITS:
        flags["combine_prefetch"] = True
    if pdl_min_splits > 0 and num_splits >= pdl_min_splits:
        flags["pdl_combine"] = True
    return dataclasses.replace(cfg, **flags) if flags else cfg


# ================================================================ the host's questions (flash4.config.fwd_config / bwd_config)
def fwd_plan(request, arch: int, num_sms: int | None = None) -> FwdPlan:
    """The forward plan of a flash4.request.Request: dense (the short-sequence rule from seqlen_k,
    GQA packing of windows), packed / paged (the sequence-layout fields, page pieces), or a decode
    step (decode_plan: host GQA packing, split-KV from num_sms); the speed switches that
    FLASH4_FWD_SWITCHES names on top (with_fwd_switches)."""
    from flash4 import env  # late: host-only

    plan = _fwd_plan(request, arch, num_sms)
    switches = env.fwd_switches()
    if switches:
        plan = dataclasses.replace(plan, cfg=with_fwd_switches(plan.cfg, switches))
    return plan


def with_fwd_switches(cfg: FwdConfig, names) -> FwdConfig:
    """cfg with each named forward speed switch (FWD_SPEED_SWITCHES) on where the kernel builds it
    (softmax_vote_first: every sm90 forward config; no_tail_guard: ragged layouts, where the guards
    are compiled; lookahead_qk: where lookahead_qk_error allows it, Dv < D; pv_zero_init: not with
    lookahead_qk; flat_tile_order: not with the LPT order; softmax_branch_free: turns softmax_vote_first
    off; gather_clamp_late, gather_ptr_shuffle: gathered pages only; page_pieces_all_warps: TMA page
    pieces with page_prefetch only; pin_p_convert: P in registers only; page_divide_free, page_row_shuffle:
    TMA page pieces only). Pure."""
    for name in FWD_SPEED_SWITCHES:
        if name == "lookahead_qk" and lookahead_qk_error(cfg):
            continue
        if name == "pv_zero_init" and (cfg.lookahead_qk or "lookahead_qk" in names):
            continue
        if name == "flat_tile_order" and cfg.lpt:  # the host's L2 sections (l2_group > 1) need the full decode
            continue
        if name in ("gather_clamp_late", "gather_ptr_shuffle") and not cfg.page_gather:  # the gathered producer only
            continue
        if name == "page_pieces_all_warps" and not cfg.page_prefetch:  # TMA page pieces with the look-ahead only
            continue
        if name == "pin_p_convert" and cfg.p_smem:  # P in registers only
            continue
        if name in ("pdl_combine", "combine_prefetch") and not cfg.split_kv:  # the split-KV decode step only
            continue
        if name in ("page_divide_free", "page_row_shuffle") and not cfg.page_rows:  # TMA page pieces only
            continue
        if name == "softmax_branch_free" and name in names:  # replaces the vote-first branches
            cfg = dataclasses.replace(cfg, softmax_vote_first=False)
        if name in names and (name != "no_tail_guard" or cfg.ragged_q or cfg.ragged_k):
            cfg = dataclasses.replace(cfg, **{name: True})
    return cfg


def _fwd_plan(request, arch: int, num_sms: int | None = None) -> FwdPlan:
    """fwd_plan without the FLASH4_FWD_SWITCHES overrides."""
    q, k, seq, mask, score = request.q, request.k, request.seq, request.mask, request.score
    headdim, headdim_v, nheads, nheads_k = q.shape[-1], request.v.shape[-1], q.shape[-2], k.shape[-2]
    headdim_v = None if headdim_v == headdim else headdim_v
    dtype, local, softcap, sink = request.dtype, mask.window is not None, score.softcap > 0, score.sink is not None
    if seq.decode:
        return decode_plan(q.shape[0], q.shape[1], nheads, nheads_k, headdim, dtype, mask.causal, request.page_size,
                           request.capacity, request.cache.num_splits, arch, num_sms, mask.window, softcap, sink,
                           headdim_v, page_policy(), gather_policy(), page_divide_free_policy(),
                           decode_combine_policy())
    if not seq.packed:
        cfg = select_fwd_config(headdim, dtype, mask.causal, arch, local, softcap, sink, headdim_v, k.shape[1])
        cfg = shipped_p_smem(shipped_lookahead_qk(with_pack_gqa(wide_tile_fwd_config(cfg), nheads, nheads_k)))
        return FwdPlan(shipped_window_persistent(shipped_mask_bits(with_l2_kv_heads(cfg, nheads, nheads_k))))
    cfg = with_l2_kv_heads(select_fwd_config(headdim, dtype, mask.causal, arch, local, softcap, sink, headdim_v),
                           nheads, nheads_k)
    divide_free_ok = cfg.headdim not in PAGE_DIVIDE_FREE_SPILL_HEADDIMS  # d112's divide-free pieces spill
    policy = prefill_page_policy(row_shuffle=divide_free_ok)
    paged = prefill_paged_layout(k.shape[1], cfg.tile_n, headdim, policy) if seq.paged else {}
    cfg = with_seq_layout(cfg, varlen_q=True, varlen_k=not seq.paged, seqused_q=seq.seqused_q is not None,
                          seqused_k=seq.seqused_k is not None, **paged)
    cfg = with_page_pieces_all_warps(cfg, policy[2])
    if seq.paged:
        cfg = with_page_divide_free(cfg, k.shape[1], divide_free_ok and page_divide_free_policy())
        cfg = with_page_row_shuffle(cfg, k.shape[1], headdim, page_row_shuffle_policy())
    return FwdPlan(with_paged_kv_stages(with_gather(cfg, gather_policy()), paged_kv_stages_policy(cfg)))


def gather_policy() -> bool:
    """The zero-fill switch of gathered paged configs for this call (with_gather):
    FLASH4_GATHER_ZERO_FILL, else GATHER_ZERO_FILL."""
    from flash4 import env  # host-only reader

    zero_fill = env.gather_zero_fill()
    return GATHER_ZERO_FILL if zero_fill is None else zero_fill


def with_gather(cfg: FwdConfig, zero_fill: bool) -> FwdConfig:
    """cfg with gather_zero_fill = zero_fill when it gathers its pages (page_gather); other configs
    unchanged (the field needs page_gather)."""
    if not cfg.page_gather:
        return cfg
    return dataclasses.replace(cfg, gather_zero_fill=bool(zero_fill))


def paged_kv_stages_policy(cfg: FwdConfig | None = None) -> int:
    """K/V stages asked for the paged prefill forward cfg: FLASH4_PAGED_KV_STAGES, else
    PAGED_KV_STAGES_SMALL_PIECES for TMA page pieces of at most SMALL_PAGE_PIECE_ROWS rows with the
    page-table look-ahead issued by one warp, else PAGED_KV_STAGES."""
    from flash4 import env

    stages = env.paged_kv_stages()
    if stages is not None:
        return stages
    if cfg is not None and 0 < cfg.page_rows <= SMALL_PAGE_PIECE_ROWS and cfg.page_prefetch \
            and not cfg.page_pieces_all_warps:  # four-warp pieces: 2 stages (PAGE_PIECES_ALL_WARPS)
        return PAGED_KV_STAGES_SMALL_PIECES
    return PAGED_KV_STAGES


# The forward kernel's shared memory beyond FwdConfig.smem_bytes(): its mbarriers, padded to the
# 1024-byte alignment of the Q buffer (H200 ncu: 164.86 KB dynamic for smem_bytes() = 160 KiB).
FWD_SMEM_OVERHEAD = 1024


def fwd_smem_fits(cfg: FwdConfig) -> bool:
    """Whether cfg's forward fits the arch's per-CTA shared memory (barriers included)."""
    return cfg.smem_bytes() + FWD_SMEM_OVERHEAD <= capacity(cfg.arch).smem_per_block


def with_paged_kv_stages(cfg: FwdConfig, stages: int) -> FwdConfig:
    """A paged, non-persistent cfg with `stages` K/V stages where its smem allows (fwd_smem_fits:
    d64, d96, d128 and the 128/64, 64/128 pairs take 3; d192 and d256 do not), else cfg. A third
    stage lets the producer run two key blocks ahead of the consumers (issue 25: paged prefill is
    latency-bound, not bandwidth- or issue-bound, in the H200 ncu of 2026-12-02)."""
    if not cfg.paged or cfg.persistent or stages <= cfg.kv_stages:
        return cfg
    more = dataclasses.replace(cfg, kv_stages=stages)
    return more if fwd_smem_fits(more) else cfg


def prefill_page_policy(row_shuffle: bool = True) -> tuple[int, bool, bool, bool]:
    """(gather_max, prefetch, all_warps, small_piece_rule) of a paged prefill (prefill_paged_layout):
    page_policy(), and all_warps = FLASH4_PAGE_PIECES_ALL_WARPS, else PAGE_PIECES_ALL_WARPS, only with the
    look-ahead on; with all_warps on and FLASH4_PAGE_GATHER_MAX unset, gather_max is
    PREFILL_PAGE_GATHER_MAX and small_piece_rule is True (pieces of < SMALL_PIECE_ROWS rows gathered
    below SMALL_PIECE_MIN_HEADDIM) unless page_row_shuffle_policy() is on (those pieces then load by TMA
    without the division: with_page_row_shuffle; row_shuffle False: as if that policy were off, for the
    head dims where those kernels spill, PAGE_DIVIDE_FREE_SPILL_HEADDIMS). Decode steps keep page_policy()."""
    from flash4 import env  # late: host-only

    gather_max, prefetch = page_policy()
    flag = env.page_pieces_all_warps()
    all_warps = bool(PAGE_PIECES_ALL_WARPS if flag is None else flag) and prefetch
    small_piece_rule = all_warps and env.page_gather_max() is None
    if small_piece_rule and row_shuffle and page_row_shuffle_policy():
        return min(gather_max, PREFILL_PAGE_GATHER_MAX), prefetch, all_warps, False
    if small_piece_rule:
        gather_max = min(gather_max, PREFILL_PAGE_GATHER_MAX)
    return gather_max, prefetch, all_warps, small_piece_rule


def prefill_paged_layout(page_size: int, tile_n: int, headdim: int, policy: tuple) -> dict:
    """The paged fields of a prefill forward config (paged_layout with policy = prefill_page_policy()),
    pages whose TMA pieces would have fewer than SMALL_PIECE_ROWS rows gathered instead at head dims
    below SMALL_PIECE_MIN_HEADDIM when the policy's small_piece_rule is on (flash4.config: the H200 A/B
    of 2026-12-05). Pure."""
    gather_max, prefetch, _, small_piece_rule = policy
    paged = paged_layout(page_size, tile_n, gather_max, prefetch)
    if small_piece_rule and 0 < paged.get("page_rows", 0) < SMALL_PIECE_ROWS and headdim < SMALL_PIECE_MIN_HEADDIM:
        return {"page_rows": 0, "page_gather": True}
    return paged


def page_divide_free_policy() -> bool:
    """Whether whole-page TMA pieces skip the division by the page size for this call
    (with_page_divide_free): FLASH4_PAGE_DIVIDE_FREE, else PAGE_DIVIDE_FREE."""
    from flash4 import env  # late: host-only

    flag = env.page_divide_free()
    return bool(PAGE_DIVIDE_FREE if flag is None else flag)


def with_page_divide_free(cfg: FwdConfig, page_size: int, on: bool) -> FwdConfig:
    """cfg with page_divide_free when on and cfg loads TMA page pieces that are whole pages
    (page_rows == page_size, flash4.config.PAGE_DIVIDE_FREE); else cfg (the paged prefill passes on False
    at PAGE_DIVIDE_FREE_SPILL_HEADDIMS). Pure."""
    if on and 0 < cfg.page_rows == page_size:
        return dataclasses.replace(cfg, page_divide_free=True)
    return cfg


def page_row_shuffle_policy() -> bool:
    """Whether the paged prefill's four-warp pieces of pages that hold several pieces shuffle their row
    block (with_page_row_shuffle) for this call: FLASH4_PAGE_ROW_SHUFFLE, else PAGE_ROW_SHUFFLE; off
    where page_divide_free_policy() is (the shuffled loop is page_divide_free's general path)."""
    from flash4 import env  # late: host-only

    flag = env.page_row_shuffle()
    return bool(PAGE_ROW_SHUFFLE if flag is None else flag) and page_divide_free_policy()


def with_page_row_shuffle(cfg: FwdConfig, page_size: int, headdim: int, on: bool) -> FwdConfig:
    """cfg with page_divide_free and page_row_shuffle when on and cfg's TMA pieces are issued by the four
    producer warps (page_pieces_all_warps), a page holds several of them (page_rows < page_size), and the
    head dim is below ROW_SHUFFLE_MIN_HEADDIM or the pieces have fewer than SMALL_PIECE_ROWS rows
    (flash4.config.PAGE_ROW_SHUFFLE: the A/B of 2026-12-05 late night), but not at the head dims where
    that spills (PAGE_DIVIDE_FREE_SPILL_HEADDIMS); else cfg. Pure."""
    if on and cfg.page_pieces_all_warps and 0 < cfg.page_rows < page_size \
            and cfg.headdim not in PAGE_DIVIDE_FREE_SPILL_HEADDIMS and (
            headdim < ROW_SHUFFLE_MIN_HEADDIM or cfg.page_rows < SMALL_PIECE_ROWS):
        return dataclasses.replace(cfg, page_divide_free=True, page_row_shuffle=True)
    return cfg


def with_page_pieces_all_warps(cfg: FwdConfig, all_warps: bool) -> FwdConfig:
    """cfg with page_pieces_all_warps when all_warps and cfg loads TMA page pieces of at most
    PAGE_PIECES_ALL_WARPS_MAX rows with the look-ahead; else cfg. Pure."""
    if all_warps and cfg.page_prefetch and 0 < cfg.page_rows <= PAGE_PIECES_ALL_WARPS_MAX:
        return dataclasses.replace(cfg, page_pieces_all_warps=True)
    return cfg


def page_policy() -> tuple[int, bool]:
    """(gather_max, prefetch) of paged_layout for this call: FLASH4_PAGE_GATHER_MAX, else
    PAGE_GATHER_MAX; FLASH4_PAGE_PREFETCH, else PAGE_PREFETCH."""
    from flash4 import env  # late: host-only

    gather_max, prefetch = env.page_gather_max(), env.page_prefetch()
    return (PAGE_GATHER_MAX if gather_max is None else gather_max, PAGE_PREFETCH if prefetch is None else prefetch)


def bwd_plan(request, arch: int, heads_per_cta: int | None = None, sink_delta: bool = False) -> BwdPlan:
    """The backward plan of a dense or packed (not paged) flash4.request.Request whose max_seqlen_q /
    max_seqlen_k are host ints: the config (sequence layout for packed q) and the GQA head split
    (head_split_config; heads_per_cta: an override of its choice, or None). sink_delta: the kernel
    also sums D per query row (with_sink_delta; a learnable sink needs a gradient)."""
    seq, mask = request.seq, request.mask
    cfg = select_bwd_config(request.headdim, request.dtype, mask.causal, arch=arch,
                            deterministic=request.deterministic, local=mask.local, softcap=request.score.softcap > 0,
                            headdim_v=None if request.headdim_v == request.headdim else request.headdim_v)
    if seq.packed:
        cfg = with_seq_layout(cfg, varlen_q=True, varlen_k=True, seqused_q=seq.seqused_q is not None,
                              seqused_k=seq.seqused_k is not None)
        seqlen_q, seqlen_k = seq.max_seqlen_q, seq.max_seqlen_k
    else:
        seqlen_q, seqlen_k = request.q.shape[1], request.k.shape[1]
    cfg, heads = head_split_config(cfg, request.nheads, request.nheads_k, seqlen_q, seqlen_k, mask.causal,
                                   mask.window, heads_per_cta)
    from flash4 import env

    cfg = shipped_dq_handoff(cfg)
    switches = env.bwd_switches()
    if switches:
        cfg = with_bwd_switches(cfg, switches)
    if sink_delta:
        cfg = with_sink_delta(cfg)
    return BwdPlan(cfg, heads)


def shipped_dq_handoff(cfg: BwdConfig) -> BwdConfig:
    """The shipped dQ hand-off of a selected backward config (pure): dense (not packed / seqused q),
    not deterministic, no window, no sink_delta. Head dim 128 (any Dv, no softcap, not split or
    transposed): dq_whole, one bulk reduce-add of the whole tile in the accumulator order; with it,
    and on the d64 / d96 accumulator-order configs without the GQA head split (not measured there):
    dq_handoff_per_wg, flash-attn-4's per-warpgroup hand-off. H200, 2026-12-03 (tools/ab_bwd_tiles.py,
    5 interleaved rounds; docs/design/speed_candidates.md section 6b), both together against the
    per-row hand-off: d128 causal 1k / 4k
    1.042x / 1.066x, full 4k / 16k 1.062x / 1.064x, GQA 32:8 causal 8k 1.085x; per-warpgroup alone at
    d64 1.015-1.017x (2026-12-01/02). Value head dims on the d128 / d64 tiles since 2026-12-04 (same
    tools, 5 rounds): (128, 64) causal 4k 1.157x (dq_whole + per warpgroup), (64, 128) 1.045x (per
    warpgroup); (192, 128) is transposed_dkv (neither applies). The d64 GQA / MQA head split
    (dkv_accum, 2 query heads per CTA), causal, since 2026-12-04: per warpgroup 1.071x MQA 32:1
    causal 8k, 1.055x gpt-oss 64:8 causal 8k (non-causal: 24 spill instructions at 128 x 128 in the
    compile check, so not there; d96's split: not measured). Left as they were (not measured with
    it): deterministic, packed layouts (the row-major whole tile lost at d128, 2026-12-01), softcap,
    sink_delta. Windows, since 2026-12-04: the d128 dense window backward (no GQA head split) takes
    the whole tile per warpgroup with the P^T mask from relative bounds (BwdConfig.mask_rel; without
    it that kernel spills 20 scalar registers, with it 0): window 4096 d128 32k 1.058x (1.066x /
    1.113x without mask_rel in two calls; mask_rel alone on the causal cells 0.987-1.025x, geomean
    1.000, so not there); other window configs keep the per-row hand-off (not measured). d112 (its
    own kernel since FLASH4_HEADDIM16) as d128, since 2026-12-04 night: H200 ncu, d112 causal 4k, the
    per-row hand-off's row-major STS.64 staging was the kernel's hottest stall (56 k of 295 k samples)
    and 8.7 M UBLKRED against flash-attn-4's 0.3 M; with the whole tile per warpgroup the bench's
    backward 394 -> 427 TFLOPs (two calls; flash-attn-4 0.74 -> 0.90x), GPU tests and memcheck clean."""
    if cfg.deterministic or cfg.varlen_q or cfg.seqused_q or cfg.sink_delta:
        return cfg
    if cfg.local:
        if (cfg.headdim == 128 and cfg.headdim_v is None and not (cfg.softcap or cfg.split_headdim or cfg.dkv_accum
                or cfg.transposed_dkv or cfg.dq_swapab or cfg.varlen_k or cfg.seqused_k)):
            return dataclasses.replace(cfg, dq_whole=True, dq_handoff_per_wg=True, mask_rel=True)
        return cfg
    if (cfg.headdim in (112, 128) and not cfg.softcap and not cfg.split_headdim
            and not cfg.transposed_dkv and not cfg.dq_swapab):
        cfg = dataclasses.replace(cfg, dq_whole=True)
    if cfg.dq_accum_order and (cfg.dq_whole or not cfg.dkv_accum or (cfg.headdim == 64 and cfg.causal)):
        cfg = dataclasses.replace(cfg, dq_handoff_per_wg=True)
    return cfg


def with_bwd_switches(cfg: BwdConfig, names) -> BwdConfig:
    """cfg with each named speed switch (BWD_SPEED_SWITCHES) on where the kernel builds it, the
    others unchanged (candidates' A/B and GPU tests, FLASH4_BWD_SWITCHES): dq_whole above
    DQ_WHOLE_TILE_MAX_HEADDIM without split_headdim / transposed_dkv / dq_swapab / a window;
    dq_handoff_per_wg where the dQ tile is in the accumulator order and not deterministic; lse_early on the keys-major
    steps (not transposed_dkv); exp_before_dp_wait at tile_m 64 or split_headdim, no window, not
    transposed_dkv; no_tail_guard on ragged layouts; dpsum_scaled where the step forms dS by fma (ds_by_fma). Pure."""
    for name in BWD_SPEED_SWITCHES:
        if name not in names:
            continue
        if name == "dq_whole":
            ok = (cfg.headdim > DQ_WHOLE_TILE_MAX_HEADDIM and not cfg.split_headdim and not cfg.transposed_dkv
                  and not cfg.dq_swapab and not cfg.local)  # window: 4 / 20 spills with it (compile check)
        elif name == "dq_handoff_per_wg":
            ok = cfg.dq_accum_order and not cfg.deterministic and not cfg.sink_delta
        elif name == "lse_early":
            ok = not cfg.transposed_dkv
        elif name == "no_tail_guard":  # A/B only: where zero_kv_tail / zero_q_tail are compiled
            ok = cfg.ragged_q or cfg.ragged_k
        elif name == "mask_rel":  # the keys-major steps' P^T mask (not transposed_dkv)
            ok = not cfg.transposed_dkv
        elif name == "dpsum_scaled":  # where the step forms dS by fma
            ok = cfg.ds_by_fma
        else:  # exp_before_dp_wait
            ok = (cfg.tile_m == 64 or cfg.split_headdim) and not cfg.local and not cfg.transposed_dkv
        if ok:
            cfg = dataclasses.replace(cfg, **{name: True})
    return cfg
