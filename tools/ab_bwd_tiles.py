"""A/B of backward tile configurations on issue 26's worst Hopper cells, in one process
(docs/design/speed_candidates.md, section 6: the candidates and why).

    # CPU, the exact source tree of the device run (the disk cache key hashes flash4's sources);
    # compiles every kernel of the plan and checks each backward candidate for spills and
    # serialized wgmma (exit 1 if one has either):
    python tools/ab_bwd_tiles.py --precompile --cache-dir .ab_bwd
    # GPU (carry .device-deps and .ab_bwd):
    source .device-deps/activate.sh && python tools/ab_bwd_tiles.py --cache-dir .ab_bwd --out $OUT/ab_bwd.json
    python tools/ab_bwd_tiles.py --dry-run       # no GPU, no compile: the cells and each variant's config
    # the m80 candidate (d128 full; compile-verified, not run on hardware): its cells and a ragged
    # correctness cell (EXTRA_CELLS, named only), same kernels as the default precompile:
    source .device-deps/activate.sh && python tools/ab_bwd_tiles.py --cache-dir .ab_bwd \
        --cells d128_full ragged --out $OUT/ab_m80.json

Per cell, "shipped" is the plan flash4 picks today (flash4.config.bwd_config: config and GQA heads
per CTA); each other variant replaces that plan (TileRoute: the module attribute flash4.backward
reads at call time, so no host code changes; host buffers and the dQ postprocess follow the
variant's config). Variants (all with configs the sm90 kernel already has; shipped defaults untouched):
  MHA d64 (shipped tile_m 128 = flash-attn-4's 128 x 128, per-warpgroup dQ hand-off since 2026-12-03):
    rows    one dQ hand-off for both warpgroups (shipped until 2026-12-03)
    m64     tile_m 64
    lse     lse_early (the LSE reads under the S^T GEMM; section 6b)
  MHA d128 (shipped 64 x 128, dV after dS, since 2026-12-03 the whole dQ tile in the accumulator order
  handed over per warpgroup: dq_whole + dq_handoff_per_wg; window: dV before dS, since 2026-12-04 the
  same hand-off with mask_rel, the P^T mask from relative bounds, which makes it spill-free there):
    rows    dQ staged in padded rows, one bulk reduce-add per row (shipped until 2026-12-03; windows
            until 2026-12-04)
    whole   dq_whole without the per-warpgroup hand-off
    lse     lse_early; lse_exp: with exp_before_dp_wait (flash-attn-4's step order; not for windows)
    dkvT    transposed_dkv: 64 queries x 96 keys, dK^T / dV^T with the head dim on M (d192's shape)
    split   split_headdim: 64 x 64, both warpgroups share the keys, P^T / dS^T through smem
    exp     exp_before_dp_wait (not for the window cell)
    rel     mask_rel alone (causal / window cells; 1.000x geomean on 2026-12-04)
  windows the shipped hand-off does not cover: whole_wg / whole_wg_rel (a per-row window config:
  dq_whole + dq_handoff_per_wg without / with mask_rel), pwg / pwg_rel (d64 / d96 windows: the
  per-warpgroup hand-off without / with mask_rel)
    m80     full cells only: BwdConfig.dq_swapab, flash-attn-4's / FA3's 80 x 128 tile with the dQ GEMM
            transposed (dQ^T = K^T dS^T); 0.93-0.96x on the H200 (2026-12-03)
  GQA / MQA (shipped: head split, 2 query heads per CTA, fp32 dK/dV accumulators, tile_m 64 at
  d128, 128 at d64 since the 2026-12-02 A/B: m128 1.063x MQA, 1.069x gpt-oss over 64):
    h1      1 query head per CTA (flash-attn-4's: every (query head, key block) its own CTA)
    pwg / pwg_h1  d64 (no sink_delta): dq_handoff_per_wg with the split, 2 / 1 heads
    d64:  m64 / m64_h1     tile_m 64 with the accumulators (the former shipped), 2 / 1 heads
    d128: dkvT / dkvT_h1   transposed_dkv with the accumulators, 2 / 1 heads; rows / whole as MHA
  value head dims ((128, 64), (64, 128): the d128 / d64 tiles, no dQ hand-off change shipped there):
    hand    dq_whole (at D 128) + dq_handoff_per_wg, d128's shipped hand-off; whole: dq_whole alone
    exp     exp_before_dp_wait; hand_exp both; lse: hand + lse_early
  every cell where the step forms dS by fma (BwdConfig.ds_by_fma):
    dsc     dpsum_scaled: D multiplied by the softmax scale on the host, one FMUL per query column
            per step less in the kernel (section 19; same values)
  sink cells (sink_delta: the kernel sums D for the learnable sink's gradient):
    single  sink_delta_db off: the partial sums in one buffer, the dQEmpty wait before staging them
            (shipped until 2026-12-03 evening; the double buffer keeps it at the dQ hand-off: 1.159x on
            the gpt-oss causal cell, 0.998x on the window-128 one)
    nodelta sink_delta off: D from the 16-bit out in the preprocess (before 2026-12-02); its delta
            not compared (not asked for): what sink_delta costs
Timing as tools/ab_switch.py: ROUNDS interleaved rounds (order reversed every other round), each the
median of calls with L2 flushed (flash4.bench.common.time_ms); TFLOPs of the visible work (2.5x the
forward's) per variant, and variant/shipped = shipped ms / variant ms (> 1: the variant is faster).
The timed call is flash4.backward.run (preprocess, main kernel, dK/dV conversion where accumulated,
dQ postprocess); the sink cell passes `delta` (the kernel sums each row's D: BwdConfig.sink_delta),
its torch dsink (the same for every variant) is not timed.
Checks (exit 1 when one fails; none on speed): each variant's dQ, dK, dV (and the sink cell's delta)
within 1e-2 relative max difference of the shipped config's, every element written.
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
from flash4.config import BwdPlan  # noqa: E402
from flash4.bench.cases import Case, case_bwd_flops  # noqa: E402

ARCH, DTYPE = 90, "bf16"
ROUNDS, REP_MS, TOL = ab_switch.ROUNDS, ab_switch.REP_MS, ab_switch.DQ_TOL
RESOURCES = "ab_bwd_resources.json"  # spill / wgmma check of each compiled candidate, in the cache dir

# Issue 26's worst backward cells (bf16; 32k tokens per cell but the window one).
CELLS = (
    Case("d64_causal_1k", 64, True, 1024, 1024, 32, 32, 32),
    Case("d64_full_1k", 64, False, 1024, 1024, 32, 32, 32),
    Case("d128_causal_1k", 128, True, 1024, 1024, 32, 16, 16),
    Case("d128_causal_4k", 128, True, 4096, 4096, 8, 16, 16),
    Case("d128_full_4k", 128, False, 4096, 4096, 8, 16, 16),
    Case("d128_full_16k", 128, False, 16384, 16384, 2, 16, 16),
    Case("gqa32q8kv_d128_causal_8k", 128, True, 8192, 8192, 4, 32, 8),
    Case("mqa32q1kv_d64_causal_8k", 64, True, 8192, 8192, 4, 32, 1),
    Case("gptoss_sink_d64_causal_8k", 64, True, 8192, 8192, 1, 64, 8, sink=True),
    Case("window4096_d128_causal_32k", 128, True, 32768, 32768, 1, 16, 16, window=(4095, 0)),
)
# Named by --cells only (not in the default run): a correctness cell for the m80 candidate, with a
# last query tile of 1 row at tile_m 80 (4001 = 50 x 80 + 1) and a key tile cut by seqlen_k
# (3000 = 23 x 128 + 56: the masked loop runs), which the 4k / 16k cells do not reach.
EXTRA_CELLS = (
    Case("ragged_d128_full_4001x3000", 128, False, 4001, 3000, 8, 16, 16),
    # the sweep's worst backward cell (0.88x; its ncu of 2026-12-03 afternoon: the LSE short-scoreboard
    # stall, variant lse) and the one cell that lost since 2026-12-01 (94.1 -> 72.4 TFLOPs: sink_delta
    # on a 128-key window), docs/perf/README.md
    Case("d128_causal_32k", 128, True, 32768, 32768, 1, 16, 16),
    Case("gptoss_sink_d64_window128_causal_8k", 64, True, 8192, 8192, 1, 64, 8, window=(127, 0), sink=True),
    # gpt-oss's shape without sinks (the bench's sink_ref cell: 0.85x flash-attn-4 on 2026-12-04)
    Case("gptoss_d64_causal_8k", 64, True, 8192, 8192, 1, 64, 8),
    # value head dims (0.75x flash-attn-4 at (128, 64) on 2026-12-04; flash-attn-4 runs its d128 tile there)
    Case("hdimv_128_64_causal_4k", 128, True, 4096, 4096, 8, 16, 16, headdim_v=64),
    Case("hdimv_64_128_causal_4k", 64, True, 4096, 4096, 8, 16, 16, headdim_v=128),
    # windows beside the 2026-12-04 cell: a GQA window at d128 (its plan takes no head split at this
    # width, so it runs the shipped window hand-off, timed on this shape for the first time; with a
    # head split the variant would be whole_wg_rel, compile-checked 0 spills) and an MHA window at d64
    # (variants pwg / pwg_rel: compile-checked 0 spills, not timed)
    Case("gqa32q8kv_window4096_d128_causal_16k", 128, True, 16384, 16384, 2, 32, 8, window=(4095, 0)),
    Case("window1024_d64_causal_16k", 64, True, 16384, 16384, 2, 32, 32, window=(1023, 0)),
)


# ---------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class Variant:
    """One timed backward: the main kernel's config and the GQA query heads per CTA."""

    cfg: object
    heads_per_cta: int


def request(case: Case, q=None, k=None, v=None, sink=None):
    """flash4's dense Request of a cell; without tensors, on the meta device (plans only: no memory)."""
    import torch

    from flash4.request import Request

    if q is None:
        dt = torch.bfloat16
        q = torch.empty(case.batch, case.seqlen_q, case.nheads, case.headdim, device="meta", dtype=dt)
        k = torch.empty(case.batch, case.seqlen_k, case.nheads_k, case.headdim, device="meta", dtype=dt)
        v = torch.empty(case.batch, case.seqlen_k, case.nheads_k, case.hdim_v, device="meta", dtype=dt)
        sink = torch.empty(case.nheads, device="meta", dtype=torch.float32) if case.sink else None
    window = case.window if case.window is not None else (-1, -1)
    return Request.dense(q, k, v, case.headdim ** -0.5, case.causal, window, 0.0, sink)


def shipped_plan(case: Case):
    from flash4.config import bwd_config

    return bwd_config(request(case), ARCH, None, sink_delta=case.sink)


def fwd_cfg(case: Case):
    from flash4.config import fwd_config

    return fwd_config(request(case), ARCH).cfg


# --variants: only these (and "shipped"); None: every variant of a cell
VARIANT_FILTER: tuple | None = None


def variants(case: Case) -> dict:
    """{name: Variant} of a cell, "shipped" first (module docstring), less those VARIANT_FILTER leaves out."""
    out, seen = {}, set()
    for name, v in _all_variants(case).items():  # a variant equal to an earlier one is not timed twice
        if v not in seen:
            out[name] = v
            seen.add(v)
    if VARIANT_FILTER:
        out = {name: v for name, v in out.items() if name == "shipped" or name in VARIANT_FILTER}
    return out


def _all_variants(case: Case) -> dict:
    from flash4.config.sm90 import DQ_WHOLE_TILE_MAX_HEADDIM, dq_swapab_config

    plan = shipped_plan(case)
    cfg, heads = plan.cfg, plan.heads_per_cta
    rep = dataclasses.replace
    # the dQ hand-off shipped before 2026-12-03 (per row at d128, one 288-thread pair): the base of the
    # structural variants (transposed / split tiles, m80 build on it)
    rows = rep(cfg, dq_whole=False, dq_handoff_per_wg=False, mask_rel=False)  # mask_rel: shipped only with them
    out = {"shipped": Variant(cfg, heads)}
    if cfg.dkv_accum:  # GQA / MQA head split
        out["h1"] = Variant(cfg, 1)
        if cfg.headdim == 64:  # shipped tile_m 128 since the A/B of 2026-12-02 (1.06-1.07x over 64)
            out["m64"] = Variant(rep(cfg, tile_m=64), heads)
            out["m64_h1"] = Variant(rep(cfg, tile_m=64), 1)
        if cfg.dq_accum_order and not cfg.dq_handoff_per_wg and not cfg.sink_delta:
            # the per-warpgroup dQ hand-off (shipped on the MHA d64 tiles; never measured with the split)
            out["pwg"] = Variant(rep(cfg, dq_handoff_per_wg=True), heads)
            out["pwg_h1"] = Variant(rep(cfg, dq_handoff_per_wg=True), 1)
        else:
            dkvt = rep(rows, transposed_dkv=True, tile_n=96, tile_m=64)
            out["dkvT"] = Variant(dkvt, heads)
            out["dkvT_h1"] = Variant(dkvt, 1)
    elif cfg.headdim_v is not None and not cfg.split_headdim and not cfg.transposed_dkv:
        # Dv != D on the d128 / d64 tiles (shipped_dq_handoff leaves value head dims out: not measured)
        whole = cfg.headdim > DQ_WHOLE_TILE_MAX_HEADDIM  # d128: dq_whole first; d64: already whole-tile
        hand = rep(cfg, dq_whole=True, dq_handoff_per_wg=True) if whole else rep(cfg, dq_handoff_per_wg=True)
        out["hand"] = Variant(hand, heads)
        if whole:
            out["whole"] = Variant(rep(cfg, dq_whole=True), heads)
        out["exp"] = Variant(rep(cfg, exp_before_dp_wait=True), heads)
        out["hand_exp"] = Variant(rep(hand, exp_before_dp_wait=True), heads)
        out["lse"] = Variant(rep(hand, lse_early=True), heads)
        return out
    elif cfg.headdim == 64:
        out["rows"] = Variant(rows, heads)  # one hand-off for both warpgroups (shipped until 2026-12-03)
        out["m64"] = Variant(rep(cfg, tile_m=64), heads)
        out["lse"] = Variant(rep(cfg, lse_early=True), heads)
    else:
        out["dkvT"] = Variant(rep(rows, transposed_dkv=True, tile_n=96, tile_m=64), heads)
        out["split"] = Variant(rep(rows, split_headdim=True, tile_n=64, tile_m=64), heads)
        if not cfg.local:
            out["exp"] = Variant(rep(cfg, exp_before_dp_wait=True), heads)
        m80 = dq_swapab_config(rows)  # None but for the non-causal cells
        if m80 is not None:
            out["m80"] = Variant(m80, heads)
    if cfg.sink_delta:
        # the sink cells: the partial sums in one buffer (the dQEmpty wait before them, shipped until
        # 2026-12-03 evening; now double-buffered, the wait at the hand-off), and
        # the kernel without sink_delta (D from the 16-bit out in the preprocess, as before 2026-12-02;
        # its delta is not asked for, so not compared): what sink_delta costs
        if cfg.sink_delta_db:
            out["single"] = Variant(rep(cfg, sink_delta_db=False), heads)
        out["nodelta"] = Variant(rep(cfg, sink_delta=False, sink_delta_db=False), heads)
    if cfg.headdim == 128 and not cfg.split_headdim and not cfg.transposed_dkv:
        # section 6b: shipped since 2026-12-03 where it applies (flash4.config.sm90.shipped_dq_handoff):
        # the whole-tile dQ hand-off per warpgroup; variants: the per-row hand-off before it, the whole
        # tile for both warpgroups at once, and the early LSE reads (with the exponentials pinned ahead)
        if cfg.dq_whole:
            out["rows"] = Variant(rows, heads)
            out["whole"] = Variant(rep(cfg, dq_handoff_per_wg=False), heads)
        elif cfg.local and cfg.dkv_accum:  # a GQA window: the whole tile per warpgroup with mask_rel
            out["whole_wg_rel"] = Variant(rep(cfg, dq_whole=True, dq_handoff_per_wg=True, mask_rel=True), heads)
        elif cfg.local and not cfg.dkv_accum:
            # windows: the shipped hand-off is per row (the store warp's 64 bulk reduce-adds per step;
            # H200 ncu 2026-12-04, window 4096: the consumers' dQEmpty wait is 11 % of the stall
            # samples); the whole tile per warpgroup, as on the causal cells, spills 20 scalar
            # registers outside the step loops (compile check): timed to see what it is worth
            out["whole_wg"] = Variant(rep(cfg, dq_whole=True, dq_handoff_per_wg=True), heads)
            out["whole"] = Variant(rep(cfg, dq_whole=True), heads)
            # with the P^T mask from relative bounds (BwdConfig.mask_rel): 0 spills (compile check)
            out["whole_wg_rel"] = Variant(rep(cfg, dq_whole=True, dq_handoff_per_wg=True, mask_rel=True), heads)
        if not cfg.dkv_accum:
            out["lse"] = Variant(rep(cfg, lse_early=True), heads)
            if not cfg.local:  # exp_before_dp_wait is not built with a window
                out["lse_exp"] = Variant(rep(cfg, lse_early=True, exp_before_dp_wait=True), heads)
    if cfg.local and cfg.dq_accum_order and not cfg.dq_handoff_per_wg and not cfg.sink_delta:
        # windows at d64 / d96 (already whole-tile): the per-warpgroup hand-off, with / without mask_rel
        out["pwg"] = Variant(rep(cfg, dq_handoff_per_wg=True), heads)
        out["pwg_rel"] = Variant(rep(cfg, dq_handoff_per_wg=True, mask_rel=True), heads)
    if (cfg.causal or cfg.local) and not cfg.transposed_dkv and not cfg.mask_rel:
        out["rel"] = Variant(rep(cfg, mask_rel=True), heads)  # BwdConfig.mask_rel alone (same values)
    if getattr(cfg, "ds_by_fma", False) and not cfg.sink_delta:  # BwdConfig.dpsum_scaled: D * scale from the host (same values;
        # with sink_delta 3 spills, so with_sink_delta turns it off)
        out["dsc"] = Variant(rep(cfg, dpsum_scaled=True), heads)
    return out


def cfg_short(c) -> str:
    """The fields of a backward config that tell the variants apart."""
    bits = [f"m{c.tile_m}n{c.tile_n}q{c.q_stages}"]
    bits += [name for name in ("transposed_dkv", "split_headdim", "dkv_accum", "exp_before_dp_wait",
                               "dq_handoff_per_wg", "sink_delta", "sink_delta_db", "local", "dq_swapab", "dq_whole",
                               "lse_early", "mask_rel", "dpsum_scaled")
             if getattr(c, name, False)]
    return " ".join(bits)


def short(v: Variant) -> str:
    return cfg_short(v.cfg) + (f" h{v.heads_per_cta}" if v.cfg.dkv_accum else "")


def plan_kernels(cells) -> list[tuple]:
    """Every kernel the run loads, as (kind, key...) without duplicates, in a fixed order: the
    forward that makes out / lse, the preprocess, and per variant its main kernel and dQ postprocess."""
    from flash4.config import postprocess_wide_stores

    wide = postprocess_wide_stores()
    out = []
    for case in cells:
        out += [("fwd", fwd_cfg(case)), ("bwd_preprocess", case.hdim_v, DTYPE)]
        for v in variants(case).values():
            accum = v.cfg.tile_m if v.cfg.dq_accum_order else None
            out += [("bwd", v.cfg), ("bwd_postprocess", case.headdim, DTYPE, accum, wide, v.cfg.dq_handoff_per_wg)]
    return list(dict.fromkeys(out))


def print_plan(cells) -> None:
    print(f"{DTYPE}, sm_{ARCH}a; variants replace flash4's backward plan (config, heads per CTA)")
    for case in cells:
        print(f"  {case.name:28s} B={case.batch} H={case.nheads}/{case.nheads_k} D={case.headdim}"
              f"{' window=' + str(case.window) if case.window else ''}{' sink' if case.sink else ''}")
        for name, v in variants(case).items():
            print(f"      {name:8s} {short(v)}")


# ------------------------------------------------------------------------------------------ compile
def check_compiled(compiled) -> dict:
    """Registers, spills, serialized wgmma of a compiled kernel (cuobjdump; {} without it)."""
    from flash4.compile.check import extract_cubin, resource_usage

    cubin = extract_cubin(compiled)
    row = resource_usage(cubin) if cubin is not None else {}
    return {k: row.get(k) for k in ("registers", "spills", "wgmma_serialized", "hgmma")}


def precompile(items) -> int:
    """Compile every kernel of the plan into the disk cache (no GPU) and check each backward main
    kernel: 0 spills, wgmma not serialized (the resource row is kept in RESOURCES, so a kernel
    found in the cache is not compiled again). Returns 1 when one fails the check."""
    from flash4 import env
    from flash4.compile import cache, disk_cache

    where = env.disk_cache_dir()
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, RESOURCES)
    resources = json.load(open(path)) if os.path.exists(path) else {}
    t0 = time.perf_counter()
    bad = []
    for item in items:
        if item[0] != "bwd":
            ab_switch.load_kernel(item)
            continue
        cfg, key = item[1], repr(item[1])
        t = time.perf_counter()

        def compile_and_check(cfg=cfg, key=key):
            compiled = cache.compile_bwd(cfg)
            resources[key] = check_compiled(compiled)
            return compiled

        disk_cache.load_or_compile("bwd", cfg, cache.COMPILE_OPTIONS + cache._arch_option(cfg.arch), compile_and_check)
        if key not in resources:  # in the cache from another run: check it once
            resources[key] = check_compiled(cache.compile_bwd(cfg))
        row = resources[key]
        ok = row.get("spills") == 0 and row.get("wgmma_serialized") is False
        bad += [] if ok else [key]
        mask = "window" if cfg.local else "causal" if cfg.causal else "full"
        print(f"  bwd d{cfg.headdim} {mask:6s} {cfg_short(cfg):44s} regs "
              f"{row.get('registers')} spills {row.get('spills')} serialized {row.get('wgmma_serialized')} "
              f"{'ok' if ok else 'FAILS'} ({time.perf_counter() - t:.0f} s)", flush=True)
        with open(path, "w") as f:
            json.dump(resources, f, indent=1)
    size = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where) if f.endswith(".o"))
    print(f"precompiled {len(items)} kernels in {time.perf_counter() - t0:.0f} s: {cache.compile_counts()}; "
          f"{where}: {size / 2**20:.2f} MiB of objects")
    if bad:
        print("SPILL / SERIALIZED WGMMA (drop these candidates): " + "; ".join(bad))
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------- device
class TileRoute:
    """Within `with route:`, flash4.backward's plan is route.plan (a flash4.config.BwdPlan) when it
    is set; `calls` counts the routed plans (0 after a backward: the host code moved)."""

    def __init__(self):
        import flash4.backward

        self.backward = flash4.backward
        self.original = flash4.backward.bwd_config
        self.plan, self.calls = None, 0

    def routed(self, *args, **kwargs):
        plan = self.original(*args, **kwargs)
        if self.plan is None:
            return plan
        self.calls += 1
        return self.plan

    def __enter__(self):
        self.backward.bwd_config = self.routed
        return self

    def __exit__(self, *exc):
        self.backward.bwd_config = self.original


def run_cell(case: Case, rounds: int, rep_ms: float) -> dict:
    import torch

    from flash4 import backward, forward
    from flash4.bench import common

    vs = variants(case)
    row = {"cell": case.name, "variants": {name: short(v) for name, v in vs.items()}}
    q, k, v = common.make_inputs(case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k, case.headdim,
                                 torch.bfloat16, headdim_v=case.headdim_v)
    sink = torch.randn(case.nheads, device="cuda", dtype=torch.float32) if case.sink else None
    req = request(case, q, k, v, sink)
    lse_split = forward.new_lse_split(req)
    out, lse = forward.run(req, lse_split=lse_split)
    dout = torch.randn_like(out)
    grads = {name: tuple(torch.full_like(t, math.nan) for t in (q, k, v)) for name in vs}
    deltas = {name: (torch.full_like(lse, math.nan) if getattr(vs[name].cfg, "sink_delta", False) else None) for name in vs}
    with TileRoute() as route:
        def bwd(name):
            route.plan = BwdPlan(vs[name].cfg, vs[name].heads_per_cta)
            dq, dk, dv = grads[name]
            backward.run(req, dout, out, lse, lse_split, dq=dq, dk=dk, dv=dv, delta=deltas[name])

        for name in list(vs):
            try:
                bwd(name)
                torch.cuda.synchronize()
            except Exception as err:  # a host-side refusal: report it, time the others
                if name == "shipped":
                    raise
                row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
                del vs[name]
        if route.calls < len(vs):
            row["error"] = "backward NOT routed (flash4.backward's plan moved): nothing timed"
            return row
        base = grads["shipped"]
        for name in list(vs)[1:]:
            diffs = [ab_switch.reldiff(a, b) for a, b in zip(grads[name], base)]
            if deltas[name] is not None and deltas["shipped"] is not None:
                diffs.append(ab_switch.reldiff(deltas[name], deltas["shipped"]))
            row[f"{name}_reldiff"] = max(diffs) if all(d == d for d in diffs) else math.nan
        row["shipped_finite"] = all(bool(torch.isfinite(t).all()) for t in base)
        ms = ab_switch.interleaved({name: (lambda name=name: bwd(name)) for name in vs}, rounds, rep_ms)
    flops = case_bwd_flops(case)
    for name in vs:
        row[f"{name}_tflops"] = flops / ms[name] / 1e9
    for name in list(vs)[1:]:
        row[f"{name}/shipped"] = ms["shipped"] / ms[name]
    return row


def format_row(row: dict) -> str:
    parts = [f"{row['cell']:28s}"]
    if "error" in row:
        return parts[0] + " " + row["error"]
    names = [n for n in row["variants"] if f"{n}_tflops" in row]
    parts.append(f"shipped {row['shipped_tflops']:.1f} TF")
    parts += [f"{k[:-len('_error')]} FAILED {x}" for k, x in row.items() if k.endswith("_error")]
    for name in names[1:]:
        parts.append(f"{name} {row[f'{name}_tflops']:.1f} ({row[f'{name}/shipped']:.3f}x, "
                     f"diff {row[f'{name}_reldiff']:.1e})")
    return " | ".join(parts)


def failures(rows) -> list[str]:
    bad = []
    for row in rows:
        bad += [f"{row['cell']}: {k} {x}" for k, x in row.items() if k == "error" or k.endswith("_error")]
        if row.get("shipped_finite") is False:
            bad.append(f"{row['cell']}: shipped gradients not all finite")
        bad += [f"{row['cell']}: {k} = {x:.2e}" for k, x in row.items() if k.endswith("_reldiff") and not x <= TOL]
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
    p.add_argument("--cells", nargs="*", help="only these cells (names or prefixes; default: all of CELLS; "
                                              "EXTRA_CELLS only by name)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and variants; run nothing (no GPU)")
    p.add_argument("--precompile", action="store_true",
                   help="compile the plan's kernels into the disk cache, check spills / serialized wgmma, exit")
    p.add_argument("--cache-dir", help="the disk cache to fill / load (sets FLASH4_CACHE_DIR)")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--rep-ms", type=float, default=REP_MS)
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument("--variants", nargs="*", help="only these variants (and shipped); default: every one")
    args = p.parse_args(argv)
    global VARIANT_FILTER
    VARIANT_FILTER = tuple(args.variants) if args.variants else None
    if args.cache_dir:
        os.environ["FLASH4_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    pool = CELLS + EXTRA_CELLS if args.cells else CELLS
    cells = [c for c in pool if not args.cells or any(c.name.startswith(n) for n in args.cells)]
    if not cells:
        raise SystemExit(f"ab_bwd_tiles: no cell matches {args.cells}; cells: {[c.name for c in pool]}")
    print_plan(cells)
    items = plan_kernels(cells)
    if args.dry_run:
        n = sum(len(variants(c)) for c in cells)
        print(f"dry run: {len(items)} kernels; {n} timed variants x {args.rounds} rounds of {args.rep_ms:.0f} ms; "
              "nothing run")
        return 0
    if args.precompile:
        return precompile(items)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time (--dry-run prints the plan, --precompile compiles it)")
        return 2
    from flash4.bench import common
    from flash4.compile import cache, disk_cache

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.rounds} rounds, {common.timing_method()}",
          flush=True)
    t0 = time.perf_counter()
    for item in items:  # load (or compile) everything before the first timed call
        ab_switch.load_kernel(item)
    print(f"kernels ready in {time.perf_counter() - t0:.0f} s: {disk_cache.timing_summary()}", flush=True)
    rows = []
    for case in cells:
        rows.append(run_cell(case, args.rounds, args.rep_ms))
        print(format_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print_summary(rows)
    print(f"({time.perf_counter() - t0:.0f} s; {cache.compile_counts()})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": DTYPE, "rounds": args.rounds, "rows": rows}, f, indent=1)
    bad = failures(rows)
    if bad:
        print("CHECKS FAILED: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
