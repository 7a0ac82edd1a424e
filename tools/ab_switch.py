"""A/B one of flash4's speed switches on the GPU, in one process (docs/design/speed_candidates.md).

    source .device-deps/activate.sh && python tools/ab_switch.py --switch early_q_release [--quick]
    source .device-deps/activate.sh && python tools/ab_switch.py --switch postprocess_wide [--quick]
    python tools/ab_switch.py --switch early_q_release --dry-run     # no GPU: the configs and the plan
    python tools/ab_switch.py --switch postprocess_wide --precompile # no GPU needed: fill the disk cache

Switches (both off by default in flash4; this tool turns them on for its "on" variant only):
  early_q_release   FwdConfig.early_q_release: persistent forwards with O in its own smem buffer free
                    Q's buffer after the tile's last Q K^T instead of after its last P V. "off" is the
                    persistent config (the shipped one where that is persistent, else the shipped one
                    made persistent, LPT order: the row says "forced"), "on" the same with the switch;
                    forced rows also time the shipped config ("shipped" column). Cells whose config
                    has no room for O's own buffer (d256) are skipped.
  postprocess_wide  the dQ postprocess's wide_stores (kernels/common/bwd_preprocess.py: 16-byte dQ
                    stores). Timed alone (flash4.compile.cache.get_bwd_postprocess_runner on a random
                    fp32 accumulator shaped as the backward's) and inside the whole backward
                    (flash4.backward.flash_attn_backward, its postprocess runner routed to the switch
                    by PostprocessRoute, no host code changed).

Cells: the sweep's shapes (flash4.bench.common.sweep_cells: batch * seqlen = 32k tokens, nheads =
2048 // headdim, seqlen_q = seqlen_k), bf16; head dims 64/128/256 x S 1k/4k/16k x full/causal
(--quick: 64/128 x 1k/4k). Each cell times its variants in ROUNDS interleaved rounds (order
off, on, ... then reversed, alternating), each time the median of many calls with L2 flushed
(flash4.bench.common.time_ms); the table gives the median over rounds, in TFLOPs (forward: 4 B H S^2 D,
halved when causal; backward 2.5x that) and as on / off ratios (> 1: the switch is faster). Outputs of
off and on are compared bitwise (same math, other schedule / stores): the forward's out / lse /
lse split, the postprocess's dq; in the whole backward dK, dV bitwise and dQ to a relative max
difference (its atomic adds vary in order between calls; bwd_dq_reldiff, ~1e-3 is that noise).
No assertion on speed; exit code 1 only when some on/off output differs (dq: by more than 1e-2).
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

SWITCHES = ("early_q_release", "postprocess_wide")
HEADDIMS, SEQLENS = (64, 128, 256), (1024, 4096, 16384)
QUICK_HEADDIMS, QUICK_SEQLENS = (64, 128), (1024, 4096)
ROUNDS, QUICK_ROUNDS = 5, 3
REP_MS, QUICK_REP_MS = 100.0, 50.0


# ---------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass
class FwdPlan:
    """One cell of the early_q_release A/B: the configs timed (name -> FwdConfig), or why skipped."""

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


@dataclasses.dataclass
class PostPlan:
    """One cell of the postprocess_wide A/B: the backward config (its dQ tile order) and the runner
    key of the postprocess, shared by off and on but for wide_stores."""

    cell: common.Cell
    bwd_cfg: object
    accum_tile_m: int | None

    def key(self) -> tuple:
        return (self.cell.headdim, self.cell.seqlen, self.accum_tile_m)


def post_plan(cell: common.Cell, dtype: str) -> PostPlan:
    cfg = select_bwd_config(cell.headdim, dtype, cell.causal)
    return PostPlan(cell, cfg, cfg.tile_m if cfg.dq_accum_order else None)


def short(cfg) -> str:
    """The fields of a FwdConfig that tell the A/B's variants apart."""
    bits = [f"d{cfg.headdim}", f"m{cfg.tile_m}n{cfg.tile_n}", "causal" if cfg.causal else "full"]
    bits += [name for name in ("persistent", "lpt", "early_q_release") if getattr(cfg, name)]
    return " ".join(bits)


def print_plan(switch: str, cells, dtype: str) -> None:
    print(f"switch {switch}, {dtype}, {len(cells)} cells (B * S = {common.TOKENS} tokens, "
          f"H * D = {common.HIDDEN})")
    for cell in cells:
        shape = f"  {cell.label():24s} B={cell.batch:<3d} H={cell.nheads:<3d}"
        if switch == "early_q_release":
            plan = fwd_plan(cell, dtype)
            if plan.skip:
                print(f"{shape} skipped: {plan.skip}")
                continue
            print(f"{shape} {plan.note or 'shipped'}: " + "; ".join(f"{k}=[{short(c)}]" for k, c in plan.configs.items()))
        else:
            plan = post_plan(cell, dtype)
            order = f"accumulator order, tile_m {plan.accum_tile_m}" if plan.accum_tile_m else "row-major"
            print(f"{shape} postprocess {order}; get_bwd_postprocess_runner({cell.headdim}, {dtype!r}, 90, "
                  f"accum_tile_m={plan.accum_tile_m}, wide_stores=False / True); whole backward with "
                  f"BwdConfig tile_m {plan.bwd_cfg.tile_m} tile_n {plan.bwd_cfg.tile_n}")


def precompile(switch: str, cells, dtype: str) -> None:
    """Compile (or load) every kernel the A/B runs into flash4's disk cache (no GPU needed)."""
    from flash4.compile import cache

    t0 = time.perf_counter()
    for cell in cells:
        if switch == "early_q_release":
            for cfg in fwd_plan(cell, dtype).configs.values():
                cache.get_fwd_runner(cfg)
        else:
            plan = post_plan(cell, dtype)
            for wide in (False, True):
                cache.get_bwd_postprocess_runner(cell.headdim, dtype, 90, accum_tile_m=plan.accum_tile_m,
                                                 wide_stores=wide)
            cache.get_bwd_runner(plan.bwd_cfg)
            cache.get_bwd_preprocess_runner(cell.headdim, dtype, 90)
            cache.get_fwd_runner(select_fwd_config(cell.headdim, dtype, cell.causal, seqlen_k=cell.seqlen))
    print(f"precompiled in {time.perf_counter() - t0:.0f} s: {cache.compile_counts()}")


# ------------------------------------------------------------------------------------------- timing
def interleaved(fns: dict, rounds: int, rep_ms: float) -> dict:
    """{name: median ms over `rounds` rounds}; round r times the variants in their order, or
    reversed when r is odd (ABAB..., then BA...), so drift hits both sides alike."""
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


def run_fwd(cells, dtype: str, rounds: int, rep_ms: float) -> list[dict]:
    import torch

    from flash4.compile.cache import get_fwd_runner

    rows = []
    for cell in cells:
        plan = fwd_plan(cell, dtype)
        row = {"cell": cell.label(), "note": plan.note or plan.skip}
        if plan.skip:
            rows.append(row)
            continue
        q, k, v = common.make_inputs(cell.batch, cell.seqlen, cell.seqlen, cell.nheads, cell.nheads, cell.headdim,
                                     common.torch_dtype(dtype))
        scale = cell.headdim ** -0.5
        outs, fns = {}, {}
        for name, cfg in plan.configs.items():  # compile first: no compile inside a round
            runner = get_fwd_runner(cfg)
            out = torch.full_like(q, math.nan)
            lse = torch.full((cell.batch, cell.nheads, cell.seqlen), math.nan, device=q.device, dtype=torch.float32)
            lse_split = torch.full((2,) + tuple(lse.shape), math.nan, device=q.device, dtype=torch.float32)
            outs[name] = (out, lse, lse_split)
            fns[name] = (lambda runner=runner, o=out, l=lse, s=lse_split: runner(q, k, v, o, l, scale, lse_split=s))
            fns[name]()
        torch.cuda.synchronize()
        row["bitwise"] = all(same(a, b) for a, b in zip(outs["off"], outs["on"]))
        if "shipped" in outs:
            row["shipped_bitwise"] = all(same(a, b) for a, b in zip(outs["off"], outs["shipped"]))
        ms = interleaved(fns, rounds, rep_ms)
        flops = common.fwd_flops(cell)
        row.update({f"{name}_tflops": common.tflops(flops, t) for name, t in ms.items()})
        row["on/off"] = ms["off"] / ms["on"]
        if "shipped" in ms:
            row["on/shipped"] = ms["shipped"] / ms["on"]
        rows.append(row)
        print(format_row(row), flush=True)
        del q, k, v, outs, fns
    return rows


class PostprocessRoute:
    """Within `with route:`, flash4's backward gets its dQ postprocess from
    get_bwd_postprocess_runner(..., wide_stores=route.wide) (set route.wide to switch): the module
    attribute it imports at call time is replaced, so no host code changes. `calls` counts the
    backward's requests; 0 after a backward means the route did not reach it (host code moved)."""

    def __init__(self):
        import flash4.backward
        from flash4.compile import cache

        self.modules = [m for m in (cache, flash4.backward) if hasattr(m, "get_bwd_postprocess_runner")]
        self.original = cache.get_bwd_postprocess_runner
        self.wide, self.calls = False, 0

    def runner(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **dict(kwargs, wide_stores=self.wide))

    def __enter__(self):
        for m in self.modules:
            m.get_bwd_postprocess_runner = self.runner
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.get_bwd_postprocess_runner = self.original


def run_post(cells, dtype: str, rounds: int, rep_ms: float) -> list[dict]:
    import torch

    from flash4.backward import flash_attn_backward
    from flash4.compile.cache import get_bwd_postprocess_runner, get_fwd_runner

    torch_dtype = common.torch_dtype(dtype)
    rows, alone_done = [], set()
    for cell in cells:
        plan = post_plan(cell, dtype)
        row = {"cell": cell.label(), "note": f"accum m{plan.accum_tile_m}" if plan.accum_tile_m else "row-major"}
        B, S, H, D = cell.batch, cell.seqlen, cell.nheads, cell.headdim
        # The postprocess alone (its work does not depend on causal: timed once per key).
        if plan.key() not in alone_done:
            alone_done.add(plan.key())
            tile = plan.bwd_cfg.tile_m
            acc = torch.randn(B, H, -(-S // tile) * tile, D, device="cuda", dtype=torch.float32)
            dqs = {w: torch.full((B, S, H, D), math.nan, device="cuda", dtype=torch_dtype) for w in ("off", "on")}
            runners = {w: get_bwd_postprocess_runner(D, dtype, 90, accum_tile_m=plan.accum_tile_m,
                                                     wide_stores=(w == "on")) for w in ("off", "on")}
            fns = {w: (lambda w=w: runners[w](acc, dqs[w])) for w in ("off", "on")}
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            row["post_bitwise"] = same(dqs["off"], dqs["on"])
            if plan.accum_tile_m is None:  # row-major: the plain conversion is the reference
                row["post_bitwise"] &= same(dqs["off"], acc[:, :, :S].permute(0, 2, 1, 3).to(torch_dtype))
            ms = interleaved(fns, rounds, rep_ms)
            moved = acc[:, :, :S].numel() * (4 + torch.finfo(torch_dtype).bits // 8)
            row.update(post_off_us=ms["off"] * 1e3, post_on_us=ms["on"] * 1e3,
                       post_on_gbs=moved / (ms["on"] * 1e-3) / 1e9, **{"post on/off": ms["off"] / ms["on"]})
            del acc, dqs, fns
        # The whole backward, its postprocess routed to the switch.
        q, k, v = common.make_inputs(B, S, S, H, H, D, torch_dtype)
        scale = D ** -0.5
        out = torch.empty_like(q)
        lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
        lse_split = torch.empty((2, B, H, S), device="cuda", dtype=torch.float32)
        get_fwd_runner(select_fwd_config(D, dtype, cell.causal, seqlen_k=S))(q, k, v, out, lse, scale,
                                                                              lse_split=lse_split)
        dout = torch.randn_like(out)
        grads = {w: tuple(torch.empty_like(t) for t in (q, k, v)) for w in ("off", "on")}
        with PostprocessRoute() as route:
            def bwd(w):
                route.wide = (w == "on")
                dq, dk, dv = grads[w]
                flash_attn_backward(dout, q, k, v, out, lse, scale, cell.causal, dq=dq, dk=dk, dv=dv,
                                    lse_split=lse_split)
            for w in ("off", "on"):
                bwd(w)
            torch.cuda.synchronize()
            if route.calls == 0:
                row["note"] += "; whole backward NOT routed (host code changed): postprocess alone only"
            else:
                # dQ's atomic adds vary in order between calls: dq is compared to within that (the
                # postprocess itself is compared bitwise above); dK, dV bitwise.
                dq_off, dq_on = grads["off"][0].float(), grads["on"][0].float()
                row["bwd_dq_reldiff"] = float((dq_on - dq_off).abs().max() / dq_off.abs().max().clamp_min(1e-30))
                row["bwd_dkdv_bitwise"] = all(same(a, b) for a, b in zip(grads["off"][1:], grads["on"][1:]))
                ms = interleaved({w: (lambda w=w: bwd(w)) for w in ("off", "on")}, rounds, rep_ms)
                flops = common.BWD_FLOPS_FACTOR * common.fwd_flops(cell)
                row.update(bwd_off_tflops=common.tflops(flops, ms["off"]), bwd_on_tflops=common.tflops(flops, ms["on"]),
                           **{"bwd on/off": ms["off"] / ms["on"]})
        rows.append(row)
        print(format_row(row), flush=True)
        del q, k, v, out, lse, lse_split, dout, grads
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------- report
def num(key: str, x: float) -> str:
    """Ratios with 3 decimals, relative differences in e-notation, the rest (TFLOPs, us, GB/s) 1."""
    return f"{x:.3f}" if "/" in key else f"{x:.1e}" if "diff" in key else f"{x:.1f}"


def format_row(row: dict) -> str:
    def fmt(key, x):
        if isinstance(x, bool):
            return f"{key}={'yes' if x else 'NO'}"
        if isinstance(x, float):
            return f"{key}={num(key, x)}"
        return f"{key}={x}" if x else ""
    return f"{row['cell']:24s} " + " ".join(filter(None, (fmt(k, v) for k, v in row.items() if k != "cell")))


def print_table(switch: str, rows: list[dict]) -> None:
    if switch == "early_q_release":
        cols = ["off_tflops", "on_tflops", "on/off", "shipped_tflops", "on/shipped", "bitwise", "note"]
    else:
        cols = ["post_off_us", "post_on_us", "post on/off", "post_on_gbs", "post_bitwise",
                "bwd_off_tflops", "bwd_on_tflops", "bwd on/off", "bwd_dq_reldiff", "bwd_dkdv_bitwise", "note"]
    print("\n" + " | ".join(["cell"] + cols))
    print("|".join(["---"] * (len(cols) + 1)))
    for row in rows:
        cells = [row["cell"]]
        for c in cols:
            x = row.get(c)
            cells.append("" if x is None else "yes" if x is True else "NO" if x is False else
                         num(c, x) if isinstance(x, float) else str(x))
        print(" | ".join(cells))
    ratios = [row[c] for row in rows for c in ("on/off", "post on/off", "bwd on/off") if isinstance(row.get(c), float)]
    if ratios:
        print(f"\non/off ratios: geometric mean {math.exp(statistics.fmean(map(math.log, ratios))):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}; > 1: the switch is faster)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", required=True, choices=SWITCHES)
    p.add_argument("--quick", action="store_true", help="head dims 64/128, S 1k/4k, 3 rounds of 50 ms")
    p.add_argument("--dry-run", action="store_true", help="print the configs and the plan; run nothing (no GPU)")
    p.add_argument("--precompile", action="store_true", help="compile the plan's kernels into the disk cache and exit")
    p.add_argument("--headdims", type=int, nargs="+", help="override the head dims")
    p.add_argument("--seqlens", type=common.parse_seqlen, nargs="+", help="override the sequence lengths (4k = 4096)")
    p.add_argument("--causal", choices=("both", "full", "causal"), default="both")
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {ROUNDS}, --quick {QUICK_ROUNDS})")
    p.add_argument("--dtype", choices=common.DTYPE_NAMES, default="bf16")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)

    headdims = args.headdims or (QUICK_HEADDIMS if args.quick else HEADDIMS)
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else SEQLENS)
    causals = {"both": (False, True), "full": (False,), "causal": (True,)}[args.causal]
    cells = common.sweep_cells(headdims, seqlens, causals)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    rep_ms = QUICK_REP_MS if args.quick else REP_MS
    print_plan(args.switch, cells, args.dtype)
    if args.dry_run:
        print(f"dry run: {rounds} rounds of {rep_ms:.0f} ms per variant would be timed; nothing run")
        return 0
    if args.precompile:
        precompile(args.switch, cells, args.dtype)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time (--dry-run prints the plan, --precompile compiles it)")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {rounds} rounds, {common.timing_method()}",
          flush=True)
    t0 = time.perf_counter()
    run = run_fwd if args.switch == "early_q_release" else run_post
    rows = run(cells, args.dtype, rounds, rep_ms)
    print_table(args.switch, rows)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"switch": args.switch, "dtype": args.dtype, "rounds": rounds, "rows": rows}, f, indent=1)
    differ = [r["cell"] for r in rows for key in ("bitwise", "post_bitwise", "bwd_dkdv_bitwise") if r.get(key) is False]
    differ += [r["cell"] for r in rows if r.get("bwd_dq_reldiff", 0.0) > 1e-2]
    if differ:
        print(f"OUTPUTS DIFFER between off and on: {sorted(set(differ))}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
