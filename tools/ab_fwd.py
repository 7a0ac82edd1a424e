"""A/B of forward speed candidates on issue 26's Hopper forward cells, in one process
(docs/design/speed_candidates.md, section 7: the candidates and why).

    # CPU, the exact source tree of the device run (the disk cache key hashes flash4's sources);
    # compiles every kernel of the plan and checks each for spills and serialized wgmma (exit 1 if
    # one has either; 36 kernels, ~6 min on the 2-core box; --variants la --cells hdimv: 8 kernels, ~2 min):
    python tools/ab_fwd.py --precompile --cache-dir .ab_fwd
    # GPU (carry .device-deps and .ab_fwd), ~2 min:
    source .device-deps/activate.sh && python tools/ab_fwd.py --cache-dir .ab_fwd --out $OUT/ab_fwd.json
    python tools/ab_fwd.py --dry-run       # no GPU, no compile: the cells and each variant's config

Per cell, "shipped" is the config flash4 picks today (flash4.config.fwd_config of the cell's dense
or varlen request); each other variant is that config with one candidate on (shipped defaults untouched):
  n160 / n176 / n192  key tiles of 160 / 176 / 192 rows (flash4.config.sm90.wide_tile_fwd_config;
                      FlashAttention-3's Hopper table takes 128 x 176 at d128 without causal):
                      d128 non-causal cells, d96 causal.
  s3                  3 K/V stages instead of 2 (same function, kv_stages=3): the same cells.
  l2kv                FwdConfig.l2_kv_heads: the LPT order's L2 sections counted in KV heads, so a
                      section holds g times as many (head, batch) pairs (g = nheads / nheads_k):
                      GQA / MQA causal cells and the varlen GQA cell. Same kernel code, same
                      math: out / lse bitwise.
  pack                FwdConfig.pack_gqa = g: the g query heads of a KV head share each query tile
                      (flash-attn-4 packs GQA by default; flash4 packs windows and, since 2026-12-04,
                      the bf16 d64 causal forward; d128 causal: 0.91-1.005x): dense GQA / MQA causal
                      cells where the shipped config does not pack.
  la / la_base        FwdConfig.lookahead_qk (Dv < D cells only; section 5): each block's softmax under the
                      next block's Q K^T as well as the previous P V (flash4.config.sm90.lookahead_qk_config:
                      (192, 128) needs tile_n 112 for the second S accumulator, 80 when causal;
                      (128, 64) keeps 128).
                      la_base: the same tile without the switch, where la narrowed it (the tile's own
                      effect). Same instructions per value: la bitwise equal to la_base, or to shipped
                      where the tile is shipped's. nola: the switch off where it ships (bf16 (128, 64)
                      causal, since 2026-12-03 night).
  p / m192p           d96: FwdConfig.p_smem (P through smem) at the 128-row tile, and with 192-row tiles
                      (m192n144p: 192 x 144 without a mask); shipped since 2026-12-04 on the plain dense
                      d96 forward (shipped_p_smem), where nop times the 128 x 128 tile with P in registers.
  p / n160p / n176p / n192p  d64 full: P through smem at the shipped 192 x 128 tile and with 160 / 176 /
                      192 keys per block (FlashAttention-3's d64 non-causal tile is 192 x 192 with P
                      through smem; with P in registers those tiles spill). Same math, another key
                      blocking: out within the tolerance, not bitwise (speed_candidates.md section 20).
  pers / pers_eq / n64  windows: persistent CTAs (O in its own buffer; pers_eq: Q released after the
                      last Q K^T as well), and 64-key blocks.
  mb / nomb           FwdConfig.mask_bits: the score mask from a 32-bit word per row (R2P) instead of
                      integer compares per element; nomb: off where it ships (dense windows, since
                      2026-12-04); mb: on, causal cells, only when --variants names it (measured
                      0.99-1.02x there). Same mask: out / lse bitwise.
  vf / novf           FwdConfig.softmax_vote_first on (novf: off where it ships, d128 full above 1k
                      keys, since 2026-12-03 evening): the softmax's exact-path vote before the
                      exponents, each FFMA next to its MUFU.EX2 (section 8): every cell. Same
                      operations per element: out / lse bitwise.
  ra / ravf           FwdConfig.rescale_always (ravf: with softmax_vote_first as well, where that is
                      not shipped): O multiplied by the row factors at every key block without the
                      vote and branch, so the O multiplies and P's F2FP run under the MUFU.EX2 stream
                      (section 11): every cell. Factors of exactly 1.0: out / lse bitwise.
  pz                  FwdConfig.pv_zero_init: the tile's first P V writes acc_O (no per-tile zeroing;
                      section 14's d128 full 1k profile): every cell. out / lse bitwise.
  flat / flatpz       FwdConfig.flat_tile_order (the non-LPT tile order decoded with two divisions
                      instead of four; flatpz: with pv_zero_init too): cells without LPT. Bitwise.
  sm / bf / bfra / bfrasm  the softmax step (section 17): FwdConfig.split_row_max (two FMNMX chains
                      per row), FwdConfig.softmax_branch_free (the exact path by selects: one basic
                      block per step), bf with rescale_always, and that with split_row_max: every
                      cell. Bitwise.
  pin / pinvf         FwdConfig.pin_p_convert (pinvf: with softmax_vote_first, where not shipped): P's
                      F2FPs pinned ahead of the lazy rescale's branch, so they run under the MUFU.EX2
                      stream while the O rescale stays lazy (docs/perf/ncu_2026-12-05.md): every cell
                      with P in registers. Bitwise.
  emu8 / vfemu8 / bfraemu8  head dims <= 48 (the MUFU.EX2-bound cells): 1 of every 8 exponentials on
                      the FMA polynomial (exp2_emu_frac 0.125) on shipped, on softmax_vote_first +
                      rescale_always, on bfra. Within the tolerances, not bitwise.
  bfraemu6 / bfraemu4 head dims <= 48: bfra with 3 of every 16 / 1 of every 4 exponentials emulated.
--variants NAME ... times only those variants (and shipped).
Timing as tools/ab_switch.py: ROUNDS interleaved rounds (order reversed every other round), each the
median of calls with L2 flushed (flash4.bench.common.time_ms); TFLOPs of the visible work per
variant, variant/shipped = shipped ms / variant ms (> 1: the variant is faster), and each variant's
TFLOPs over the same-run cuBLAS bf16 GEMM (8192^3). The timed call is the compiled forward runner
(flash4.compile.cache.get_fwd_runner: the kernel and its host tail, no torch-side work).
Checks (exit 1 when one fails; none on speed): every element of each variant's out and lse written
(buffers start as NaN, all finite after), out within 1e-2 relative max difference and lse within
1e-3 absolute of the shipped config's; l2kv bitwise equal to shipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import ab_switch  # noqa: E402  (tools/ab_switch.py: timing, comparisons)
from flash4.bench.cases import CASES as BENCH_CASES, Case, case_fwd_flops  # noqa: E402
from flash4.bench.varlen import VarlenCase, varlen_fwd_flops, varlen_lengths  # noqa: E402

ARCH, DTYPE = 90, "bf16"
ROUNDS, REP_MS = 7, 100.0
OUT_TOL, LSE_TOL = 1e-2, 1e-3  # out: relative max difference; lse: absolute (natural log units)
RESOURCES = "ab_fwd_resources.json"  # spill / wgmma check of each compiled kernel, in the cache dir
GEMM_N = 8192  # the same-run cuBLAS ceiling: bf16 GEMM N x N x N
DEVICE = "cuda"  # where run_cell allocates (the CPU test of its plumbing swaps it)

# Issue 26's forward cells behind flash-attn-4 (bf16; B * S = 32k tokens).
CELLS = (
    Case("d128_full_1k", 128, False, 1024, 1024, 32, 16, 16),
    Case("d128_full_4k", 128, False, 4096, 4096, 8, 16, 16),
    Case("d128_full_16k", 128, False, 16384, 16384, 2, 16, 16),
    Case("gqa_32q8kv_d128_causal_8k", 128, True, 8192, 8192, 4, 32, 8),
    Case("gqa_64q8kv_d128_causal_4k", 128, True, 4096, 4096, 8, 64, 8),
    Case("mqa_32q1kv_d64_causal_8k", 64, True, 8192, 8192, 4, 32, 1),
    Case("d96_causal_4k", 96, True, 4096, 4096, 8, 21, 21),
    # the sweep's varlen GQA cell (flash4.bench.varlen: 64k tokens, lengths log-uniform in 128..16k, seed 0)
    VarlenCase("varlen_gqa32q8kv_d128_causal", 32, 8),
    # Dv < D (issue 26 item 2, FwdConfig.lookahead_qk): the bench's own cells (flash4.bench.cases), so
    # the numbers compare with the sweep's hdimv rows
    *(c for c in BENCH_CASES if c.name in ("hdimv_192_128_causal_4k", "hdimv_192_128_full_4k",
                                           "hdimv_128_64_causal_4k")),
)
# Named by --cells only: the sweep's other dense cells where the forward trails flash-attn-4
# (2026-12-03 sweep: d64 full 1k / 4k 0.92, d64 causal 4k 0.93, d256 full 1k / 4k 0.97), for
# softmax_vote_first (variant vf) before widening flash4.config.sm90.shipped_vote_first.
EXTRA_CELLS = (
    Case("d64_full_1k", 64, False, 1024, 1024, 32, 32, 32),
    Case("d64_full_4k", 64, False, 4096, 4096, 8, 32, 32),
    Case("d64_full_16k", 64, False, 16384, 16384, 2, 32, 32),
    Case("d64_causal_4k", 64, True, 4096, 4096, 8, 32, 32),
    Case("d256_full_1k", 256, False, 1024, 1024, 32, 8, 8),
    Case("d256_full_4k", 256, False, 4096, 4096, 8, 8, 8),
    Case("d256_full_16k", 256, False, 16384, 16384, 2, 8, 8),
    # masked cells for mask_bits (variant mb): the bench's window / sink cells (flash4.bench.cases)
    *(c for c in BENCH_CASES if c.name in ("sink_gptoss_d64_window128_causal_8k", "sink_gptoss_d64_causal_8k",
                                           "window4096_causal_32k_d128")),
    Case("d128_causal_4k", 128, True, 4096, 4096, 8, 16, 16),
    Case("d64_causal_1k", 64, True, 1024, 1024, 32, 32, 32),
    Case("d96_full_4k", 96, False, 4096, 4096, 8, 21, 21),  # p_smem's 192-row tiles without a mask
    # the small head dims (issue 26: d32 forward 0.81x, d16 0.85x flash-attn-4; 2026-12-04 night):
    # MUFU.EX2-bound at 16-32 columns, for the softmax variants (sm, bf, bfra, bfsm, emu8, ...)
    Case("d32_full_4k", 32, False, 4096, 4096, 8, 16, 16),
    Case("d16_full_4k", 16, False, 4096, 4096, 8, 16, 16),
    Case("d32_causal_4k", 32, True, 4096, 4096, 8, 16, 16),
    Case("d48_causal_4k", 48, True, 4096, 4096, 8, 16, 16),
    # the confirmation cells of the small-d softmax variants and the per-tile switches (2026-12-05)
    Case("d32_full_1k", 32, False, 1024, 1024, 32, 16, 16),
    Case("d32_full_16k", 32, False, 16384, 16384, 2, 16, 16),
    Case("d48_full_4k", 48, False, 4096, 4096, 8, 16, 16),
    Case("d16_causal_4k", 16, True, 4096, 4096, 8, 16, 16),
    Case("d128_causal_1k", 128, True, 1024, 1024, 32, 16, 16),
    # pin_p_convert's rule by head dim (2026-12-05 night): the d192 / d256 causal and softcap cells
    *(c for c in BENCH_CASES if c.name in ("d192_full_4k", "softcap50_gemma2_d256_causal_8k")),
    Case("d192_causal_4k", 192, True, 4096, 4096, 8, 16, 16),
    Case("d256_causal_4k", 256, True, 4096, 4096, 8, 8, 8),
)
WIDE_TILES = (160, 176, 192)
EMU_FRAC = 0.125  # the emu variants' share of exponentials on the FMA polynomial (FwdConfig.exp2_emu_frac)
# bfra with larger shares at head dims <= 48: MUFU.EX2 at 16 / clock / SM against ~5 FMA-pipe
# instructions per element at 128 / clock put the balance near 1 / 6 of the exponentials emulated
EMU_MORE = {"bfraemu6": 0.1875, "bfraemu4": 0.25}


# ---------------------------------------------------------------------------------------------- plan
def request(case, q=None, k=None, v=None, cu=None):
    """flash4's Request of a cell (dense, or varlen for a VarlenCase); without tensors, on the meta
    device (plans only: no memory)."""
    import torch

    from flash4.request import Request

    varlen = isinstance(case, VarlenCase)
    if q is None:
        dt, meta = torch.bfloat16, "meta"
        lead = (sum(varlen_lengths()),) if varlen else (case.batch, case.seqlen_q)
        q = torch.empty(*lead, case.nheads, case.headdim, device=meta, dtype=dt)
        k = torch.empty(*lead, case.nheads_k, case.headdim, device=meta, dtype=dt)
        v = torch.empty(*lead, case.nheads_k, getattr(case, "hdim_v", case.headdim), device=meta, dtype=dt)
        cu = torch.empty(len(varlen_lengths()) + 1, device=meta, dtype=torch.int32) if varlen else None
    if varlen:
        maxlen = max(varlen_lengths())
        return Request.varlen(q, k, v, cu, cu, maxlen, maxlen, softmax_scale=case.headdim ** -0.5, causal=case.causal)
    window = getattr(case, "window", None) or (-1, -1)
    sink = torch.empty(case.nheads, device=q.device, dtype=torch.float32) if getattr(case, "sink", False) else None
    return Request.dense(q, k, v, case.headdim ** -0.5, case.causal, window, 0.0, sink)


def shipped_cfg(case):
    from flash4.config import fwd_config

    return fwd_config(request(case), ARCH).cfg


BITWISE = ("l2kv", "vf", "novf", "la", "nola", "mb", "nomb", "ra", "ravf", "pz", "flat", "flatpz", "sm", "bf", "bfra",
           "bfrasm", "pin", "pinvf")  # variants whose out / lse must equal their base's bit for bit
# The base of a bitwise check, where it is not shipped: la against la_base when that variant exists.
BITWISE_BASE = {"la": "la_base"}
ONLY = None  # --variants: the names to time besides shipped (None: all)


def variants(case) -> dict:
    """{name: FwdConfig} of a cell, "shipped" first (module docstring); a candidate that does not
    apply to the cell's config (or would equal another variant) is left out; with --variants, only
    the named ones."""
    out = _all_variants(case)
    keep = None if ONLY is None else set(ONLY) | {BITWISE_BASE[n] for n in ONLY if n in BITWISE_BASE}
    return {n: c for n, c in out.items() if n == "shipped" or keep is None or n in keep}


def _all_variants(case) -> dict:
    from flash4.config.sm90 import lookahead_qk_config, wide_tile_fwd_config, with_fwd_switches, with_l2_kv_heads

    cfg = shipped_cfg(case)
    out = {"shipped": cfg}
    group = case.nheads // case.nheads_k
    if getattr(case, "headdim_v", None) is not None:  # the Dv < D cells: the look-ahead candidate only
        if cfg.lookahead_qk:  # shipped there since 2026-12-03 night (shipped_lookahead_qk): time it off
            out["nola"] = dataclasses.replace(cfg, lookahead_qk=False)
            if cfg.causal and ONLY is not None and "mb" in ONLY:
                out["mb"] = with_fwd_switches(cfg, ("mask_bits",))
            return _pv_zero_init_variant(cfg, _rescale_always_variants(cfg, out))
        la = lookahead_qk_config(cfg)
        if la is not None:
            base = dataclasses.replace(la, lookahead_qk=False)
            if base != cfg:
                out["la_base"] = base
            out["la"] = la
        return _pv_zero_init_variant(cfg, _rescale_always_variants(cfg, out))
    if group == 1:
        for n in WIDE_TILES:
            wide = wide_tile_fwd_config(cfg, n)
            if wide != cfg:
                out[f"n{n}"] = wide
        s3 = wide_tile_fwd_config(cfg, kv_stages=3)
        if s3 != cfg:
            out["s3"] = s3
    else:
        l2kv = with_l2_kv_heads(cfg, case.nheads, case.nheads_k, on=True)
        if l2kv != cfg:
            out["l2kv"] = l2kv
        if cfg.pack_gqa == 1 and cfg.tile_m % group == 0 and not cfg.varlen_q:  # dense Q only
            out["pack"] = dataclasses.replace(cfg, pack_gqa=group)
    if cfg.local and not cfg.persistent:
        # windows: a CTA's work is a few key blocks, so its prologue / epilogue are a large share of it
        # (H200 ncu 2026-12-04: ~2 key blocks per 192-row tile at window 128): persistent CTAs overlap
        # them with the neighbours' (O in its own buffer; pers_eq: Q freed after the last Q K^T too)
        out["pers"] = dataclasses.replace(cfg, persistent=True)
        out["pers_eq"] = dataclasses.replace(cfg, persistent=True, early_q_release=True)
        out["n64"] = dataclasses.replace(cfg, tile_n=64)  # narrower key blocks: less of each band masked away
    if cfg.p_smem:  # shipped on the plain dense d96 forward since 2026-12-04 (shipped_p_smem): time it off
        out["nop"] = dataclasses.replace(cfg, p_smem=False, tile_m=128, tile_n=128)
    if cfg.headdim == 96 and not cfg.p_smem and not cfg.lookahead_qk:
        # FwdConfig.p_smem: P through smem (p: its cost at the shipped tile), which lets d96 take
        # flash-attn-4's 192-row tile (m192p; with P in registers that tile spills)
        out["p"] = dataclasses.replace(cfg, p_smem=True)
        out["m192p"] = dataclasses.replace(cfg, p_smem=True, tile_m=192)
        out["m192pra"] = dataclasses.replace(cfg, p_smem=True, tile_m=192, rescale_always=True)
        if not cfg.causal:  # flash-attn-4's d96 tile without a mask: 192 x 144
            out["m192n144p"] = dataclasses.replace(cfg, p_smem=True, tile_m=192, tile_n=144)
    if cfg.headdim == 64 and not cfg.causal and not cfg.local and not cfg.p_smem and not cfg.lookahead_qk:
        # d64 full: FlashAttention-3's 192 x 192 tile with P through smem (tile_size.h: MmaPV_is_RS
        # false there); with P in registers every wider key tile spills (35-137 instructions, sm_90a)
        from flash4.config.sm90 import fwd_smem_fits

        for name, n in (("p", cfg.tile_n), ("n160p", 160), ("n176p", 176), ("n192p", 192)):
            wide = dataclasses.replace(cfg, p_smem=True, tile_n=n)
            if fwd_smem_fits(wide):
                out[name] = wide
    if cfg.mask_bits:  # shipped on dense windows since 2026-12-04 (shipped_mask_bits): time it off
        out["nomb"] = dataclasses.replace(cfg, mask_bits=False)
    elif cfg.causal and ONLY is not None and "mb" in ONLY:  # measured neutral on causal cells: on request
        out["mb"] = with_fwd_switches(cfg, ("mask_bits",))
    if cfg.softmax_vote_first:  # shipped there since 2026-12-03 evening (shipped_vote_first): time it off
        out["novf"] = dataclasses.replace(cfg, softmax_vote_first=False)
    else:
        out["vf"] = with_fwd_switches(cfg, ("softmax_vote_first",))
    return _softmax_variants(cfg, _pv_zero_init_variant(cfg, _rescale_always_variants(cfg, out)))


def _softmax_variants(cfg, out: dict) -> dict:
    """out with the softmax step's candidates (docs/design/speed_candidates.md section 17): sm
    (FwdConfig.split_row_max: two FMNMX chains per row), bf (FwdConfig.softmax_branch_free: the exact
    path by selects, no branch), bfra (bf with rescale_always: the whole step one basic block), bfrasm
    (bfra with sm); at head dims <= 48 (MUFU.EX2-bound) also emu8 / vfemu8 / bframu8: 1 of every 8
    exponentials on the FMA polynomial (FwdConfig.exp2_emu_frac 0.125) on shipped, with
    softmax_vote_first and rescale_always, and on bfra. All but the emu ones bitwise equal to shipped."""
    from flash4.config.sm90 import with_fwd_switches

    def add(name, c):
        if c != cfg and c not in out.values():
            out[name] = c

    add("sm", with_fwd_switches(cfg, ("split_row_max",)))
    pin = with_fwd_switches(cfg, ("pin_p_convert",))
    add("pin", pin)
    if not cfg.softmax_vote_first:
        add("pinvf", with_fwd_switches(pin, ("softmax_vote_first",)))
    add("bf", with_fwd_switches(cfg, ("softmax_branch_free",)))
    bfra = with_fwd_switches(cfg, ("softmax_branch_free", "rescale_always"))
    add("bfra", bfra)
    add("bfrasm", with_fwd_switches(bfra, ("split_row_max",)))
    if cfg.headdim <= 48 and cfg.exp2_emu_frac == 0.0:
        add("emu8", dataclasses.replace(cfg, exp2_emu_frac=EMU_FRAC))
        add("vfemu8", dataclasses.replace(with_fwd_switches(cfg, ("softmax_vote_first", "rescale_always")),
                                          exp2_emu_frac=EMU_FRAC))
        add("bfraemu8", dataclasses.replace(bfra, exp2_emu_frac=EMU_FRAC))
        for name, frac in EMU_MORE.items():  # the balance point of MUFU and FMA estimated at ~1/6
            add(name, dataclasses.replace(bfra, exp2_emu_frac=frac))
    return out


def _pv_zero_init_variant(cfg, out: dict) -> dict:
    """out with pz: FwdConfig.pv_zero_init (the tile's first P V writes acc_O; no per-tile zeroing)."""
    from flash4.config.sm90 import with_fwd_switches

    on = with_fwd_switches(cfg, ("pv_zero_init",))
    if on != cfg:
        out["pz"] = on
    flat = with_fwd_switches(cfg, ("flat_tile_order",))
    if flat != cfg:
        out["flat"] = flat
        out["flatpz"] = with_fwd_switches(flat, ("pv_zero_init",))
    return out


def _rescale_always_variants(cfg, out: dict) -> dict:
    """out with FwdConfig.rescale_always's variants of cfg: ra (O rescaled branch-free) and ravf (with
    softmax_vote_first too, where cfg does not have it)."""
    from flash4.config.sm90 import with_fwd_switches

    if not cfg.rescale_always:
        out["ra"] = with_fwd_switches(cfg, ("rescale_always",))
        if not cfg.softmax_vote_first:
            out["ravf"] = with_fwd_switches(cfg, ("rescale_always", "softmax_vote_first"))
    return out


def cfg_short(c) -> str:
    """The fields of a forward config that tell the variants apart."""
    bits = [f"m{c.tile_m}n{c.tile_n}" + (f"s{c.kv_stages}" if c.kv_stages != 2 else "")]
    bits += [name for name in ("causal", "persistent", "lpt", "l2_kv_heads", "varlen_q", "softmax_vote_first",
                               "lookahead_qk", "mask_bits", "early_q_release", "p_smem", "rescale_always",
                               "pv_zero_init", "flat_tile_order", "split_row_max", "softmax_branch_free",
                               "pin_p_convert")
             if getattr(c, name, False)]
    bits += [f"emu{c.exp2_emu_frac:g}"] if c.exp2_emu_frac else []
    bits += [f"pack{c.pack_gqa}"] if c.pack_gqa > 1 else []
    return " ".join(bits)


def plan_kernels(cells) -> list:
    """Every forward config the run loads, without duplicates, in a fixed order."""
    return list(dict.fromkeys(cfg for case in cells for cfg in variants(case).values()))


def print_plan(cells) -> None:
    print(f"{DTYPE}, sm_{ARCH}a; variants replace flash4's forward config")
    for case in cells:
        shape = (f"{len(varlen_lengths())} sequences, {sum(varlen_lengths())} tokens" if isinstance(case, VarlenCase)
                 else f"B={case.batch}")
        dv = f" Dv={case.headdim_v}" if getattr(case, "headdim_v", None) is not None else ""
        print(f"  {case.name:28s} {shape} H={case.nheads}/{case.nheads_k} D={case.headdim}{dv}")
        for name, cfg in variants(case).items():
            print(f"      {name:8s} {cfg_short(cfg)} (smem {cfg.smem_bytes() // 1024} KiB)")


# ------------------------------------------------------------------------------------------ compile
def precompile(cfgs) -> int:
    """Compile every forward of the plan into the disk cache (no GPU) and check each: 0 spills,
    wgmma not serialized (the resource row is kept in RESOURCES, so a kernel found in the cache is
    not compiled again). Returns 1 when one fails the check."""
    from ab_bwd_tiles import check_compiled

    from flash4 import env
    from flash4.compile import cache, disk_cache

    where = env.disk_cache_dir()
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, RESOURCES)
    resources = json.load(open(path)) if os.path.exists(path) else {}
    t0 = time.perf_counter()
    bad = []
    for cfg in cfgs:
        key = repr(cfg)
        t = time.perf_counter()

        def compile_and_check(cfg=cfg, key=key):
            compiled = cache.compile_fwd(cfg)
            resources[key] = check_compiled(compiled)
            return compiled

        disk_cache.load_or_compile("fwd", cfg, cache.COMPILE_OPTIONS + cache._arch_option(cfg.arch), compile_and_check)
        if key not in resources:  # in the cache from another run: check it once
            resources[key] = check_compiled(cache.compile_fwd(cfg))
        row = resources[key]
        ok = row.get("spills") == 0 and row.get("wgmma_serialized") is False
        bad += [] if ok else [key]
        print(f"  fwd d{cfg.headdim} {cfg_short(cfg):36s} regs {row.get('registers')} spills {row.get('spills')} "
              f"serialized {row.get('wgmma_serialized')} {'ok' if ok else 'FAILS'} ({time.perf_counter() - t:.0f} s)",
              flush=True)
        with open(path, "w") as f:
            json.dump(resources, f, indent=1)
    size = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where) if f.endswith((".o", ".so")))
    print(f"precompiled {len(cfgs)} kernels in {time.perf_counter() - t0:.0f} s: {cache.compile_counts()}; "
          f"{where}: {size / 2**20:.2f} MiB of objects and shared libraries")
    if bad:
        print("SPILL / SERIALIZED WGMMA (drop these candidates): " + "; ".join(bad))
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------- device
def gemm_tflops(rounds: int, rep_ms: float) -> float:
    """The same-run ceiling: cuBLAS bf16 GEMM GEMM_N^3 (median over rounds, L2 flushed as the rest)."""
    import torch

    from flash4.bench import common

    a = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
    ms = statistics.median(common.time_ms(lambda: torch.matmul(a, b), rep_ms=rep_ms) for _ in range(rounds))
    return 2.0 * GEMM_N ** 3 / ms / 1e9


def run_cell(case, rounds: int, rep_ms: float, gemm: float) -> dict:
    import torch

    from flash4.bench import common
    from flash4.compile.cache import get_fwd_runner

    vs = variants(case)
    row = {"cell": case.name, "variants": {name: cfg_short(cfg) for name, cfg in vs.items()}}
    scale = case.headdim ** -0.5
    if isinstance(case, VarlenCase):  # packed (total, H, D): the runner's batch-1 views (flash4.forward.launch)
        lengths = varlen_lengths()
        total = sum(lengths)
        q = torch.randn(total, case.nheads, case.headdim, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(total, case.nheads_k, case.headdim, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.tensor([0] + list(common_accumulate(lengths)), dtype=torch.int32, device=DEVICE)
        out_shape, lse_shape, flops = (total, case.nheads, case.headdim), (case.nheads, total), \
            varlen_fwd_flops(lengths, case.nheads, case.headdim, case.causal)
        call = dict(seqs=(cu, cu, None, None, None), batch=len(lengths), max_seqlen_q=max(lengths))
        views = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    else:
        q, k, v = common.make_inputs(case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k,
                                     case.headdim, torch.bfloat16, headdim_v=case.headdim_v)
        out_shape, lse_shape = (case.batch, case.seqlen_q, case.nheads, case.hdim_v), (case.batch, case.nheads,
                                                                                         case.seqlen_q)
        flops, call, views = case_fwd_flops(case), {}, (q, k, v)
        if getattr(case, "window", None) is not None:  # runtime (left, right) as flash4.forward passes them
            from flash4.geometry import window_sides

            call["window"] = window_sides(case.window, case.causal)
        if getattr(case, "sink", False):
            call["sink"] = torch.randn(case.nheads, device=DEVICE, dtype=torch.float32)
    unsq = (lambda t: t.unsqueeze(0)) if isinstance(case, VarlenCase) else (lambda t: t)
    outs, fns = {}, {}
    for name, cfg in list(vs.items()):
        runner = get_fwd_runner(cfg)
        out = torch.full(out_shape, math.nan, device=q.device, dtype=q.dtype)
        lse = torch.full(lse_shape, math.nan, device=q.device, dtype=torch.float32)
        split = torch.empty((2,) + lse_shape, device=q.device, dtype=torch.float32)
        outs[name] = (out, lse)
        fns[name] = (lambda runner=runner, o=unsq(out), l=unsq(lse), s=split.unsqueeze(1) if isinstance(case, VarlenCase) else split:
                     runner(*views, o, l, scale, lse_split=s, **call))
        try:
            fns[name]()
            torch.cuda.synchronize()
        except Exception as err:  # a host-side refusal: report it, time the others
            if name == "shipped":
                raise
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
            del vs[name], outs[name], fns[name]
    base_out, base_lse = outs["shipped"]
    row["shipped_written"] = bool(torch.isfinite(base_out).all() and torch.isfinite(base_lse).all())
    for name in list(vs)[1:]:
        out, lse = outs[name]
        row[f"{name}_written"] = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
        row[f"{name}_out_reldiff"] = ab_switch.reldiff(out, base_out)
        row[f"{name}_lse_absdiff"] = float((lse - base_lse).abs().max())
        if name in BITWISE:
            ref_out, ref_lse = outs.get(BITWISE_BASE.get(name), (base_out, base_lse))
            row[f"{name}_bitwise"] = ab_switch.same(out, ref_out) and ab_switch.same(lse, ref_lse)
    ms = ab_switch.interleaved(fns, rounds, rep_ms)
    for name in vs:
        row[f"{name}_tflops"] = flops / ms[name] / 1e9
        row[f"{name}_of_gemm"] = row[f"{name}_tflops"] / gemm
    for name in list(vs)[1:]:
        row[f"{name}/shipped"] = ms["shipped"] / ms[name]
    return row


def common_accumulate(xs):
    """Running sums of xs (the cu_seqlens of the varlen cell)."""
    total = 0
    for x in xs:
        total += x
        yield total


def format_row(row: dict) -> str:
    if "error" in row:
        return f"{row['cell']:28s} FAILED {row['error']}"
    names = [n for n in row["variants"] if f"{n}_tflops" in row]
    parts = [f"{row['cell']:28s}", f"shipped {row['shipped_tflops']:.1f} TF ({row['shipped_of_gemm']:.2f} of GEMM)"]
    parts += [f"{k[:-len('_error')]} FAILED {x}" for k, x in row.items() if k.endswith("_error")]
    for name in names[1:]:
        parts.append(f"{name} {row[f'{name}_tflops']:.1f} ({row[f'{name}/shipped']:.3f}x, "
                     f"out {row[f'{name}_out_reldiff']:.1e}, lse {row[f'{name}_lse_absdiff']:.1e})")
    return " | ".join(parts)


def failures(rows) -> list[str]:
    bad = []
    for row in rows:
        cell = row["cell"]
        bad += [f"{cell}: {k} {x}" for k, x in row.items() if k == "error" or k.endswith("_error")]
        bad += [f"{cell}: {k}" for k, x in row.items() if k.endswith(("_written", "_bitwise")) and x is False]
        bad += [f"{cell}: {k} = {x:.2e}" for k, x in row.items() if k.endswith("_out_reldiff") and not x <= OUT_TOL]
        bad += [f"{cell}: {k} = {x:.2e}" for k, x in row.items() if k.endswith("_lse_absdiff") and not x <= LSE_TOL]
    return bad


def print_summary(rows) -> None:
    print("\nbest per cell (variant/shipped; > 1: faster than shipped):")
    ratios = {}
    for row in rows:
        rs = {k.split("/")[0]: x for k, x in row.items() if k.endswith("/shipped")}
        for name, x in rs.items():
            ratios.setdefault(name, []).append(x)
        if rs:
            best = max(rs, key=rs.get)
            print(f"  {row['cell']:28s} {best if rs[best] > 1 else 'shipped'} ({max(rs[best], 1.0):.3f}x); "
                  + ", ".join(f"{n} {x:.3f}" for n, x in rs.items()))
    print("variant | geomean over its cells | min | max | cells")
    for name, xs in ratios.items():
        gm = math.exp(statistics.fmean(map(math.log, xs)))
        print(f"  {name} | {gm:.3f} | {min(xs):.3f} | {max(xs):.3f} | {len(xs)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", nargs="*", help="only these cells (names or prefixes, CELLS and EXTRA_CELLS; default: CELLS)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and variants; run nothing (no GPU)")
    p.add_argument("--precompile", action="store_true",
                   help="compile the plan's kernels into the disk cache, check spills / serialized wgmma, exit")
    p.add_argument("--cache-dir", help="the disk cache to fill / load (sets FLASH4_CACHE_DIR)")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--rep-ms", type=float, default=REP_MS)
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument("--variants", nargs="*", help="time only these variants besides shipped (default: all)")
    args = p.parse_args(argv)
    global ONLY
    ONLY = tuple(args.variants) if args.variants else None
    if args.cache_dir:
        os.environ["FLASH4_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    cells = list(CELLS) if not args.cells else [c for c in CELLS + EXTRA_CELLS
                                                   if any(c.name.startswith(n) for n in args.cells)]
    if not cells:
        raise SystemExit(f"ab_fwd: no cell matches {args.cells}; cells: {[c.name for c in CELLS + EXTRA_CELLS]}")
    print_plan(cells)
    cfgs = plan_kernels(cells)
    if args.dry_run:
        n = sum(len(variants(c)) for c in cells)
        print(f"dry run: {len(cfgs)} kernels; {n} timed variants x {args.rounds} rounds of {args.rep_ms:.0f} ms; "
              "nothing run")
        return 0
    if args.precompile:
        return precompile(cfgs)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time (--dry-run prints the plan, --precompile compiles it)")
        return 2
    from flash4.bench import common
    from flash4.compile import cache, disk_cache

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.rounds} rounds, {common.timing_method()}",
          flush=True)
    t0 = time.perf_counter()
    for cfg in cfgs:  # load (or compile) everything before the first timed call
        cache.get_fwd_runner(cfg)
    print(f"kernels ready in {time.perf_counter() - t0:.0f} s: {disk_cache.timing_summary()}", flush=True)
    gemm = gemm_tflops(args.rounds, args.rep_ms)
    print(f"cuBLAS bf16 GEMM {GEMM_N}^3: {gemm:.1f} TFLOPs", flush=True)
    rows = []
    for case in cells:
        try:
            rows.append(run_cell(case, args.rounds, args.rep_ms, gemm))
        except Exception as err:  # the shipped config itself failed: report it, go on with the other cells
            rows.append({"cell": case.name, "error": f"{type(err).__name__}: {err}"[:500]})
        print(format_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print_summary(rows)
    print(f"({time.perf_counter() - t0:.0f} s; {cache.compile_counts()})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": DTYPE, "rounds": args.rounds, "gemm_tflops": gemm, "rows": rows}, f, indent=1)
    bad = failures(rows)
    if bad:
        print("CHECKS FAILED: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
