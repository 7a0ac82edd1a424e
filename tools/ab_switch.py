"""A/B flash4's speed switches on the GPU, all in one process (docs/design/speed_candidates.md).

    # CPU, same source tree as the device run (the disk cache key hashes flash4's sources):
    python tools/ab_switch.py --precompile --cache-dir .ab_cache          # 27 kernels, < 5 MB
    # GPU (carry .device-deps and .ab_cache), every switch on the issue-26 cells, ~2-4 min:
    source .device-deps/activate.sh && python tools/ab_switch.py --cache-dir .ab_cache --out $OUT/ab.json
    python tools/ab_switch.py --dry-run          # no GPU: the cells, the configs of every variant

Switches (all off by default in flash4; only this tool's variants turn them on):
  postprocess_wide    the dQ postprocess's wide_stores (kernels/common/bwd_preprocess.py: 16-byte dQ
                      stores). Variant "wide" of each backward cell; also timed alone (the postprocess
                      on a random fp32 accumulator shaped as the backward's).
  exp_before_dp_wait  BwdConfig.exp_before_dp_wait (kernels/sm90/bwd_step.py BwdStep.wait_dP: P's
                      exponentials pinned ahead of the dP^T wait). tile_m 64 / split configs only, so
                      a 128-query config (d64 bf16) is timed as "m64" (tile_m 64, switch off) and
                      "m64_exp" (tile_m 64, switch on); other cells as "exp".
  dq_handoff_per_wg   BwdConfig.dq_handoff_per_wg (per-warpgroup dQ hand-off to the store warp, its
                      own barrier pair and bulk reduce-add per warpgroup half). Variant "wg" of the
                      cells whose config stages dQ in accumulator order (d64, d96 dense).
  early_q_release     FwdConfig.early_q_release (forward: Q's buffer freed after the tile's last
                      Q K^T). Forward cells: "off" is the persistent config (the shipped one made
                      persistent when it is not: note "forced"), "on" the same with the switch,
                      "shipped" the shipped config when it differs from "off".
  --switch NAME times only that switch's variants (and its baseline); default all.

Cells (issue 26's worst sweep cells; sweep shapes: batch * seqlen = 32k tokens, nheads = 2048 //
headdim, bf16): backward d64 1k causal and full, d128 1k causal, d128 4k causal and full; forward
d128 1k full. --bwd-cells / --fwd-cells replace them (e.g. 64:1k:causal 128:4k:full).

Timing: each cell times all its variants in ROUNDS interleaved rounds (order reversed every other
round), each time the median of calls with L2 flushed (flash4.bench.common.time_ms); the table gives
the median over rounds in TFLOPs (forward 4 B H S^2 D, halved when causal; backward 2.5x that) and
each variant's ratio to its baseline (> 1: faster): wide, exp, m64, wg against off; m64_exp against m64.
The backward goes through flash4.backward.flash_attn_backward, its plan's config and postprocess
routed to the variant (BwdRoute; no host code changed).
Checks (exit code 1 when one fails; no assertion on speed): variants of the same tiling give dK, dV
bitwise equal to their baseline's (same math, other schedule / stores) and dQ within 1e-2 relative
max difference (its atomic adds vary in order between calls, ~1e-3); m64 against off (another
tiling) within 1e-2 for dQ, dK, dV; the postprocess alone and the forward's out / lse / lse split
bitwise.
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

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.bench import common  # noqa: E402  (torch is imported late there)
from flash4.config import select_bwd_config, select_fwd_config  # noqa: E402

SWITCHES = ("postprocess_wide", "exp_before_dp_wait", "dq_handoff_per_wg", "early_q_release")
BWD_SWITCHES = ("postprocess_wide", "exp_before_dp_wait", "dq_handoff_per_wg")
BWD_CELLS = ((64, 1024, True), (64, 1024, False), (128, 1024, True), (128, 4096, True), (128, 4096, False))
FWD_CELLS = ((128, 1024, False),)
ROUNDS, REP_MS = 5, 100.0
DQ_TOL = 1e-2  # relative max difference allowed for dQ (atomic-add order) and across tilings


# ---------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass
class BwdVariant:
    """One timed backward: its main-kernel config, dQ postprocess stores, and the variant whose
    outputs and time it is compared with (None: the cell's baseline)."""

    cfg: object
    wide: bool = False
    base: str | None = None
    same_tiling: bool = True  # dK, dV bitwise equal to the base's


def bwd_variants(cell: common.Cell, dtype: str, switches) -> dict:
    """{name: BwdVariant} of a backward cell, "off" (the shipped config) first."""
    off = select_bwd_config(cell.headdim, dtype, cell.causal)
    out = {"off": BwdVariant(off)}
    if "postprocess_wide" in switches:
        out["wide"] = BwdVariant(off, wide=True, base="off")
    if "exp_before_dp_wait" in switches:
        if off.split_headdim or off.transposed_dkv or off.tile_m == 64:
            out["exp"] = BwdVariant(dataclasses.replace(off, exp_before_dp_wait=True), base="off")
        else:  # 128 queries per step: the switch needs tile_m 64 (kernels/sm90/bwd.py)
            m64 = dataclasses.replace(off, tile_m=64)
            out["m64"] = BwdVariant(m64, base="off", same_tiling=False)
            out["m64_exp"] = BwdVariant(dataclasses.replace(m64, exp_before_dp_wait=True), base="m64")
    if "dq_handoff_per_wg" in switches and off.dq_accum_order and not off.deterministic:
        out["wg"] = BwdVariant(dataclasses.replace(off, dq_handoff_per_wg=True), base="off")
    return out


@dataclasses.dataclass
class FwdPlan:
    """One forward cell of the early_q_release A/B: the configs timed (name -> FwdConfig), or why skipped."""

    cell: common.Cell
    configs: dict
    note: str = ""
    skip: str = ""


def separate_o(cfg) -> bool:
    """Whether the sm90 forward kernel stages O in its own smem buffer for cfg (the kernel's own
    rule; building the kernel object compiles nothing)."""
    from flash4.kernels import registry

    return registry.kernel_class("fwd", cfg.arch)(cfg).separate_o


def fwd_plan(cell: common.Cell, dtype: str) -> FwdPlan:
    shipped = select_fwd_config(cell.headdim, dtype, cell.causal, seqlen_k=cell.seqlen)
    off = shipped if shipped.persistent else dataclasses.replace(shipped, persistent=True, lpt=True)
    if not separate_o(off):
        return FwdPlan(cell, {}, skip="no smem for O's own buffer: the switch does not apply")
    configs = {"off": off, "on": dataclasses.replace(off, early_q_release=True)}
    if off != shipped:
        configs["shipped"] = shipped
    return FwdPlan(cell, configs, note="" if off == shipped else "forced")


def accum_tile_m(cfg) -> int | None:
    """The dQ postprocess's accumulator-order tile (flash4.backward's rule), or None (row-major)."""
    return cfg.tile_m if cfg.dq_accum_order else None


def backward_fwd_config(cell: common.Cell, dtype: str):
    """The forward config whose out / lse feed a backward cell."""
    return select_fwd_config(cell.headdim, dtype, cell.causal, seqlen_k=cell.seqlen)


def short(cfg) -> str:
    """The fields of a config that tell the A/B's variants apart."""
    bits = [f"d{cfg.headdim}", f"m{cfg.tile_m}n{cfg.tile_n}", "causal" if cfg.causal else "full"]
    bits += [name for name in ("persistent", "lpt", "early_q_release", "exp_before_dp_wait", "dq_handoff_per_wg")
             if getattr(cfg, name, False)]
    return " ".join(bits)


def print_plan(bwd_cells, fwd_cells, dtype: str, switches) -> None:
    print(f"switches {', '.join(switches)}; {dtype}; B * S = {common.TOKENS} tokens, H * D = {common.HIDDEN}")
    for cell in bwd_cells:
        variants = bwd_variants(cell, dtype, switches).items()
        print(f"  bwd {cell.label():24s} B={cell.batch:<3d} H={cell.nheads:<3d} " + "; ".join(
            f"{name}=[{short(v.cfg)}{' wide' if v.wide else ''}]" for name, v in variants))
    for cell in fwd_cells:
        plan = fwd_plan(cell, dtype)
        shape = f"  fwd {cell.label():24s} B={cell.batch:<3d} H={cell.nheads:<3d}"
        print(f"{shape} skipped: {plan.skip}" if plan.skip else
              f"{shape} {plan.note or 'shipped'}: " + "; ".join(f"{k}=[{short(c)}]" for k, c in plan.configs.items()))


def plan_kernels(bwd_cells, fwd_cells, dtype: str, switches) -> list[tuple]:
    """Every kernel the run loads, as (kind, key...) without duplicates, in a fixed order."""
    out = []
    for cell in bwd_cells:
        out.append(("fwd", backward_fwd_config(cell, dtype)))
        for v in bwd_variants(cell, dtype, switches).values():
            out += [("bwd", v.cfg), ("bwd_preprocess", cell.headdim, dtype),
                    ("bwd_postprocess", cell.headdim, dtype, accum_tile_m(v.cfg), v.wide, v.cfg.dq_handoff_per_wg)]
    for cell in fwd_cells:
        out += [("fwd", cfg) for cfg in fwd_plan(cell, dtype).configs.values()]
    return list(dict.fromkeys(out))


def load_kernel(item: tuple):
    """Compile (or load from the disk cache) one plan_kernels item through flash4's runners."""
    from flash4.compile import cache

    kind = item[0]
    if kind == "fwd":
        return cache.get_fwd_runner(item[1])
    if kind == "bwd":
        return cache.get_bwd_runner(item[1])
    if kind == "bwd_preprocess":
        return cache.get_bwd_preprocess_runner(item[1], item[2], 90)
    halves = {"wg_halves": True} if item[5] else {}  # as flash4.backward asks for it
    return cache.get_bwd_postprocess_runner(item[1], item[2], 90, accum_tile_m=item[3], wide_stores=item[4], **halves)


def precompile(items) -> None:
    """Compile every kernel of the plan into the disk cache (no GPU needed)."""
    from flash4 import env
    from flash4.compile import cache

    t0 = time.perf_counter()
    for item in items:
        load_kernel(item)
    where = env.disk_cache_dir()
    size = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where) if f.endswith(".o"))
    print(f"precompiled {len(items)} kernels in {time.perf_counter() - t0:.0f} s: {cache.compile_counts()}; "
          f"{where}: {size / 2**20:.2f} MiB of objects")


# ------------------------------------------------------------------------------------------- timing
def interleaved(fns: dict, rounds: int, rep_ms: float) -> dict:
    """{name: median ms over `rounds` rounds}; round r times the variants in their order, or
    reversed when r is odd, so drift hits every variant alike."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(common.time_ms(fns[name], rep_ms=rep_ms))
    return {name: statistics.median(ts) for name, ts in times.items()}


def same(a, b) -> bool:
    """Bitwise equality of two tensors of one dtype (their bits compared as integers: NaN == NaN)."""
    import torch

    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    return a.shape == b.shape and bool(torch.equal(a.view(as_int[a.element_size()]), b.view(as_int[b.element_size()])))


def reldiff(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class BwdRoute:
    """Within `with route:`, flash4.backward's plan takes route.cfg as its main-kernel config (its
    host buffers follow: tile_m sizes them) and its dQ postprocess wide_stores=route.wide; the
    module attributes it reads at call time are replaced, so no host code changes. `calls` counts
    the routed plans; 0 after a backward means the route did not reach it (host code moved)."""

    def __init__(self):
        import flash4.backward
        from flash4.compile import cache

        self.backward, self.cache = flash4.backward, cache
        self.original_plan = flash4.backward.bwd_config
        self.original_post = cache.get_bwd_postprocess_runner
        self.cfg, self.wide, self.calls = None, False, 0

    def plan(self, *args, **kwargs):
        plan = self.original_plan(*args, **kwargs)
        if self.cfg is None:
            return plan
        self.calls += 1
        return dataclasses.replace(plan, cfg=self.cfg)

    def post(self, *args, **kwargs):
        return self.original_post(*args, **dict(kwargs, wide_stores=self.wide))

    def __enter__(self):
        self.backward.bwd_config = self.plan
        self.cache.get_bwd_postprocess_runner = self.post
        return self

    def __exit__(self, *exc):
        self.backward.bwd_config = self.original_plan
        self.cache.get_bwd_postprocess_runner = self.original_post


def run_bwd_cell(cell: common.Cell, dtype: str, switches, rounds: int, rep_ms: float, alone_done: set) -> dict:
    import torch

    from flash4.backward import flash_attn_backward
    from flash4.compile.cache import get_bwd_postprocess_runner, get_fwd_runner

    torch_dtype = common.torch_dtype(dtype)
    variants = bwd_variants(cell, dtype, switches)
    row = {"cell": "bwd " + cell.label(), "variants": {k: short(v.cfg) + (" wide" if v.wide else "")
                                                       for k, v in variants.items()}}
    B, S, H, D = cell.batch, cell.seqlen, cell.nheads, cell.headdim
    off = variants["off"].cfg
    # The postprocess alone, wide against narrow (its work does not depend on causal: once per key).
    key = (D, S, accum_tile_m(off))
    if "wide" in variants and key not in alone_done:
        alone_done.add(key)
        tile = off.tile_m
        acc = torch.randn(B, H, -(-S // tile) * tile, D, device="cuda", dtype=torch.float32)
        dqs = {w: torch.full((B, S, H, D), math.nan, device="cuda", dtype=torch_dtype) for w in ("off", "on")}
        runners = {w: get_bwd_postprocess_runner(D, dtype, 90, accum_tile_m=key[2], wide_stores=(w == "on"))
                   for w in ("off", "on")}
        fns = {w: (lambda w=w: runners[w](acc, dqs[w])) for w in ("off", "on")}
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        row["post_bitwise"] = same(dqs["off"], dqs["on"])
        if key[2] is None:  # row-major: the plain conversion is the reference
            row["post_bitwise"] &= same(dqs["off"], acc[:, :, :S].permute(0, 2, 1, 3).to(torch_dtype))
        ms = interleaved(fns, rounds, rep_ms)
        row.update(post_off_us=ms["off"] * 1e3, post_wide_us=ms["on"] * 1e3, **{"post wide/off": ms["off"] / ms["on"]})
    # The whole backward per variant.
    q, k, v = common.make_inputs(B, S, S, H, H, D, torch_dtype)
    scale = D ** -0.5
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
    lse_split = torch.empty((2, B, H, S), device="cuda", dtype=torch.float32)
    get_fwd_runner(backward_fwd_config(cell, dtype))(q, k, v, out, lse, scale, lse_split=lse_split)
    dout = torch.randn_like(out)
    grads = {name: tuple(torch.full_like(t, math.nan) for t in (q, k, v)) for name in variants}
    with BwdRoute() as route:
        def bwd(name):
            route.cfg, route.wide = variants[name].cfg, variants[name].wide
            dq, dk, dv = grads[name]
            flash_attn_backward(dout, q, k, v, out, lse, scale, cell.causal, dq=dq, dk=dk, dv=dv, lse_split=lse_split)

        for name in variants:
            bwd(name)
        torch.cuda.synchronize()
        if route.calls < len(variants):
            row["error"] = "backward NOT routed (flash4.backward's plan moved): nothing timed"
            return row
        for name, var in variants.items():
            if var.base is None:
                continue
            gb, gv = grads[var.base], grads[name]
            row[f"{name}_dq_reldiff"] = reldiff(gv[0], gb[0])
            if var.same_tiling:
                row[f"{name}_dkdv_bitwise"] = same(gv[1], gb[1]) and same(gv[2], gb[2])
            else:
                row[f"{name}_dkdv_reldiff"] = max(reldiff(gv[1], gb[1]), reldiff(gv[2], gb[2]))
        ms = interleaved({name: (lambda name=name: bwd(name)) for name in variants}, rounds, rep_ms)
    flops = common.BWD_FLOPS_FACTOR * common.fwd_flops(cell)
    for name, var in variants.items():
        row[f"{name}_tflops"] = common.tflops(flops, ms[name])
        if var.base is not None:
            row[f"{name}/{var.base}"] = ms[var.base] / ms[name]
    return row


def run_fwd_cell(cell: common.Cell, dtype: str, rounds: int, rep_ms: float) -> dict:
    import torch

    from flash4.compile.cache import get_fwd_runner

    plan = fwd_plan(cell, dtype)
    row = {"cell": "fwd " + cell.label(), "note": plan.note or plan.skip,
           "variants": {k: short(c) for k, c in plan.configs.items()}}
    if plan.skip:
        return row
    q, k, v = common.make_inputs(cell.batch, cell.seqlen, cell.seqlen, cell.nheads, cell.nheads, cell.headdim,
                                 common.torch_dtype(dtype))
    scale = cell.headdim ** -0.5
    outs, fns = {}, {}
    for name, cfg in plan.configs.items():
        runner = get_fwd_runner(cfg)
        out = torch.full_like(q, math.nan)
        lse = torch.full((cell.batch, cell.nheads, cell.seqlen), math.nan, device=q.device, dtype=torch.float32)
        lse_split = torch.full((2,) + tuple(lse.shape), math.nan, device=q.device, dtype=torch.float32)
        outs[name] = (out, lse, lse_split)
        fns[name] = (lambda runner=runner, o=out, l=lse, s=lse_split: runner(q, k, v, o, l, scale, lse_split=s))
        fns[name]()
    torch.cuda.synchronize()
    row["on_bitwise"] = all(same(a, b) for a, b in zip(outs["off"], outs["on"]))
    ms = interleaved(fns, rounds, rep_ms)
    flops = common.fwd_flops(cell)
    row.update({f"{name}_tflops": common.tflops(flops, t) for name, t in ms.items()})
    row["on/off"] = ms["off"] / ms["on"]
    if "shipped" in ms:
        row["on/shipped"] = ms["shipped"] / ms["on"]
    return row


# ------------------------------------------------------------------------------------------- report
def num(key: str, x: float) -> str:
    """Ratios with 3 decimals, relative differences in e-notation, the rest (TFLOPs, us) 1."""
    return f"{x:.1e}" if "diff" in key else f"{x:.3f}" if "/" in key else f"{x:.1f}"


def format_row(row: dict) -> str:
    def fmt(key, x):
        if isinstance(x, bool):
            return f"{key}={'yes' if x else 'NO'}"
        if isinstance(x, float):
            return f"{key}={num(key, x)}"
        if isinstance(x, dict):
            return "[" + "; ".join(f"{k}: {v}" for k, v in x.items()) + "]"
        return f"{key}={x}" if x else ""
    return f"{row['cell']:30s} " + " ".join(filter(None, (fmt(k, v) for k, v in row.items() if k != "cell")))


def failures(rows) -> list[str]:
    bad = []
    for row in rows:
        for key, x in row.items():
            if (key.endswith("bitwise") and x is False) or ("reldiff" in key and isinstance(x, float) and
                                                            not x <= DQ_TOL) or key == "error":
                bad.append(f"{row['cell']}: {key}")
    return bad


def print_summary(rows) -> None:
    ratios = {}
    for row in rows:
        for key, x in row.items():
            if "/" in key and isinstance(x, float):
                ratios.setdefault(key, []).append(x)
    print("\nratio (> 1: the variant is faster) | geomean | min | max | cells")
    for key, xs in ratios.items():
        gm = math.exp(statistics.fmean(map(math.log, xs)))
        print(f"{key} | {gm:.3f} | {min(xs):.3f} | {max(xs):.3f} | {len(xs)}")


def parse_cells(texts, default):
    """'64:1k:causal' -> (64, 1024, True)."""
    if not texts:
        return default
    out = []
    for text in texts:
        d, s, mask = text.split(":")
        if mask not in ("causal", "full"):
            raise SystemExit(f"ab_switch: cell {text!r}: mask must be causal or full")
        out.append((int(d), common.parse_seqlen(s), mask == "causal"))
    return tuple(out)


def make_cells(specs) -> list:
    return [common.sweep_cells((d,), (s,), (c,))[0] for d, s, c in specs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", choices=SWITCHES + ("all",), default="all")
    p.add_argument("--bwd-cells", nargs="*", help="backward cells D:S:causal|full (default: issue 26's)")
    p.add_argument("--fwd-cells", nargs="*", help="forward cells D:S:causal|full (default: issue 26's)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and variants; run nothing (no GPU)")
    p.add_argument("--precompile", action="store_true", help="compile the plan's kernels into the disk cache and exit")
    p.add_argument("--cache-dir", help="the disk cache to fill / load (sets FLASH4_CACHE_DIR)")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--rep-ms", type=float, default=REP_MS)
    p.add_argument("--dtype", choices=common.DTYPE_NAMES, default="bf16")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if args.cache_dir:
        os.environ["FLASH4_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    switches = SWITCHES if args.switch == "all" else (args.switch,)
    bwd_specs = parse_cells(args.bwd_cells, BWD_CELLS) if set(switches) & set(BWD_SWITCHES) else ()
    fwd_specs = parse_cells(args.fwd_cells, FWD_CELLS) if "early_q_release" in switches else ()
    bwd_cells, fwd_cells = make_cells(bwd_specs), make_cells(fwd_specs)
    print_plan(bwd_cells, fwd_cells, args.dtype, switches)
    items = plan_kernels(bwd_cells, fwd_cells, args.dtype, switches)
    if args.dry_run:
        print(f"dry run: {len(items)} kernels; {args.rounds} rounds of {args.rep_ms:.0f} ms per variant; nothing run")
        return 0
    if args.precompile:
        precompile(items)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time (--dry-run prints the plan, --precompile compiles it)")
        return 2
    from flash4.compile import cache, disk_cache

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.rounds} rounds, {common.timing_method()}",
          flush=True)
    t0 = time.perf_counter()
    for item in items:  # load (or compile) everything before the first timed call
        load_kernel(item)
    print(f"kernels ready in {time.perf_counter() - t0:.0f} s: {disk_cache.timing_summary()}", flush=True)
    rows, alone_done = [], set()
    for cell in bwd_cells:
        rows.append(run_bwd_cell(cell, args.dtype, switches, args.rounds, args.rep_ms, alone_done))
        print(format_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    for cell in fwd_cells:
        rows.append(run_fwd_cell(cell, args.dtype, args.rounds, args.rep_ms))
        print(format_row(rows[-1]), flush=True)
    print_summary(rows)
    print(f"({time.perf_counter() - t0:.0f} s; {cache.compile_counts()})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"switches": switches, "dtype": args.dtype, "rounds": args.rounds, "rows": rows}, f, indent=1)
    bad = failures(rows)
    if bad:
        print("CHECKS FAILED: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
