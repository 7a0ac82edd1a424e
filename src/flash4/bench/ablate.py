"""`python -m flash4 bench --ablate`: the forward with each FlashAttention-4 trick off/on.

Every variant is `select_fwd_config(..., seqlen_k=S)` (what flash_attn_func picks for the cell:
at S <= config.SHORT_SEQLEN_K the short-sequence config) with a few fields replaced (VARIANTS), timed on the
sweep's shapes (common.sweep_cells: batch * seqlen = 32768 tokens, nheads = 2048 // headdim, seqlen_q ==
seqlen_k), by default hdim 64/128/256, S = 4k and 16k, causal and not, bf16.
The compiled runner (flash4.compile.cache.get_fwd_runner) is called directly with preallocated
out/lse, so no variant pays the public API's checks and allocations (TFLOPs are a little higher
than the `flash4` column of the plain sweep for that reason).

Noise: the same kernel moves by about +-3% between runs on an H200, so the variants of one cell
are interleaved: ROUNDS rounds, each timing every variant once (the order rotated by one each
round), and the median of a variant's rounds is what is reported. Each time is itself the median
of many calls with L2 flushed (common.time_ms: triton.testing.do_bench when triton imports).
Variants whose config equals the default's on a cell (e.g. `lpt` on causal cells, where the
default already orders tiles LPT) are listed: their difference to `default` is pure noise.

Before timing, every variant is checked against the float32 reference on small shapes.
Writes into --out: ablation.csv (CSV_COLUMNS, causal 0/1), ablation.json (metadata, rows with the
per-round times, checks). Without a GPU: says so and compile-checks the variant configs instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path

from flash4.bench import common, run
from flash4.config import SUPPORTED_HEADDIMS, FwdConfig, select_fwd_config

# name -> FwdConfig fields replaced in select_fwd_config(...)'s choice (names as in the CSV).
VARIANTS: dict[str, dict] = {
    "default": {},
    "emulated_exp2_25": {"exp2_emu_frac": 0.25},
    "emulated_exp2_50": {"exp2_emu_frac": 0.5},
    "no_emulated_exp2": {"exp2_emu_frac": 0.0},
    "always_rescale": {"rescale_threshold": 0.0},
    "no_lpt_persistent": {"lpt": False, "persistent": False},
    "lpt_persistent": {"lpt": True, "persistent": True},
    "lpt": {"lpt": True, "persistent": False},
}
VARIANT_NAMES = tuple(VARIANTS)
DEFAULT_HEADDIMS = (64, 128, 256)
DEFAULT_SEQLENS = (4096, 16384)
QUICK_HEADDIMS = (128,)
QUICK_SEQLENS = (4096,)
ROUNDS = 3
CSV_COLUMNS = ("variant", "headdim", "causal", "seqlen", "fwd_tflops")
# Small shapes each variant is checked on before timing: (batch, seqlen_q, seqlen_k, nheads).
CHECK_SHAPES = ((2, 1000, 1000, 4), (2, 777, 1024, 4))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--ablate and --variants on the `bench` parser (the other options are run.add_arguments')."""
    parser.add_argument("--ablate", action="store_true",
                        help="instead of the sweep, time flash4's forward with each of its optimizations "
                             "switched off or on (emulated exp2, lazy rescaling, longest-first and persistent "
                             "tile scheduling), forward only; defaults: head dims "
                             f"{' '.join(map(str, DEFAULT_HEADDIMS))}, seqlens "
                             f"{' '.join(map(common.seqlen_label, DEFAULT_SEQLENS))}; writes ablation.csv and "
                             "ablation.json; without a GPU, compiles the variants' kernels instead")
    parser.add_argument("--variants", nargs="+", choices=VARIANT_NAMES, metavar="VARIANT",
                        help=f"with --ablate: the variants to time, any of {', '.join(VARIANT_NAMES)} "
                             "(default: all); 'default' (flash4 as shipped) is always timed, as the baseline "
                             "the others are compared to")


def argument_error(args: argparse.Namespace) -> str | None:
    """Why the `bench` arguments do not go together (None when they do); pure. The ablation is
    forward-only: the sweep's backward switch (--no-bwd) is ignored by it."""
    if not args.ablate:
        return "--variants needs --ablate" if args.variants else None
    if args.impls:
        return "--impls does not apply to --ablate (it times flash4's own variants)"
    bad = [d for d in (args.headdims or ()) if d not in SUPPORTED_HEADDIMS]
    if bad:
        return f"--headdims {' '.join(map(str, bad))} not supported; allowed: {SUPPORTED_HEADDIMS}"
    return None


def selected_variants(names=None) -> list[str]:
    """Variants to time, in VARIANTS order, `default` always first (ratios are to it)."""
    wanted = set(names or VARIANT_NAMES) | {"default"}
    return [v for v in VARIANT_NAMES if v in wanted]


def variant_config(name: str, headdim: int, causal: bool, dtype: str = "bf16",
                   seqlen_k: int | None = None) -> FwdConfig:
    """The forward config of variant `name` for one problem class: the config flash_attn_func
    picks for it (select_fwd_config; with seqlen_k, the short-sequence choice where it applies)
    with VARIANTS[name]'s fields replaced."""
    return dataclasses.replace(select_fwd_config(headdim, dtype, causal, seqlen_k=seqlen_k), **VARIANTS[name])


def same_as_default(variants, headdims, causals, dtype: str = "bf16",
                    seqlens=(None,)) -> dict[str, list[tuple[int, bool]]]:
    """variant -> the (headdim, causal) classes where its config equals the default's at every
    seqlen in seqlens (variant_config's seqlen_k; only variants with at least one such class)."""
    same: dict[str, list[tuple[int, bool]]] = {}
    for v in variants:
        if v == "default":
            continue
        hits = [(d, c) for d in headdims for c in causals
                if all(variant_config(v, d, c, dtype, s) == variant_config("default", d, c, dtype, s)
                       for s in seqlens)]
        if hits:
            same[v] = hits
    return same


def round_orders(variants, rounds: int = ROUNDS) -> list[list[str]]:
    """The variant order of each round: every variant once, rotated by one per round."""
    n = len(variants)
    return [list(variants[r % n:]) + list(variants[: r % n]) for r in range(rounds)]


def median_or_nan(values) -> float:
    vals = [x for x in values if not math.isnan(x)]
    return statistics.median(vals) if len(vals) == len(values) and vals else math.nan


def _cell_rows(cell: common.Cell, times_ms: dict[str, list[float]]) -> list[dict]:
    rows = []
    for variant, times in times_ms.items():
        ms = median_or_nan(times)
        rows.append({"variant": variant, "headdim": cell.headdim, "causal": int(cell.causal),
                     "seqlen": cell.seqlen, "batch": cell.batch, "nheads": cell.nheads,
                     "fwd_tflops": math.nan if math.isnan(ms) else common.tflops(common.fwd_flops(cell), ms),
                     "times_ms": times})
    return rows


def ratio_table(rows) -> tuple[list[str], list[list]]:
    """Headers and rows: one line per cell with default's TFLOPs and each other variant's ratio
    to it, then a geometric-mean line over the cells."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    others = [v for v in variants if v != "default"]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["headdim"], r["causal"], r["seqlen"]), {})[r["variant"]] = r["fwd_tflops"]
    table, ratios = [], {v: [] for v in others}
    for (d, c, s), vals in cells.items():
        line = [d, c, common.seqlen_label(s), vals.get("default", math.nan)]
        for v in others:
            ratio = common.ratio(vals.get(v), vals.get("default"))
            line.append(ratio)
            if not math.isnan(ratio):
                ratios[v].append(ratio)
        table.append(line)
    geo = [math.exp(statistics.fmean(math.log(x) for x in ratios[v])) if ratios[v] else math.nan for v in others]
    table.append(["geomean", "", "", math.nan] + geo)
    return ["hdim", "causal", "seqlen", "default TFLOPs"] + [f"{v}/default" for v in others], table


def write_csv(rows, path: Path) -> None:
    common.write_rows_csv(rows, CSV_COLUMNS, path)


def write_json(path: Path, meta: dict, rows, checks, same: dict) -> None:
    doc = {"meta": meta, "rows": rows, "correctness": checks,
           "same_config_as_default": {v: [[d, int(c)] for d, c in hits] for v, hits in same.items()}}
    path.write_text(json.dumps(common.json_safe(doc), indent=2) + "\n")


def describe_same(same: dict, headdims, causals) -> list[str]:
    """One line per variant whose config equals the default's somewhere."""
    every = len(headdims) * len(causals)
    lines = []
    for v, hits in same.items():
        where = "every cell" if len(hits) == every else ", ".join(
            f"hdim {d} {'causal' if c else 'full'}" for d, c in hits)
        lines.append(f"  {v} = default on {where} (differences there are noise)")
    return lines


def _error_text(err: Exception) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def check_variants(variants, headdims, causals, dtype, seqlens=(None,)) -> list[dict]:
    """Each variant vs the float32 reference (reference.fwd_errors) on CHECK_SHAPES, NaN-poisoned
    out/lse. The rectangular shape is checked for causal only (bottom-right mask). seqlens: the
    timed sequence lengths; each distinct config they select (variant_config's seqlen_k) is
    checked once."""
    import torch

    from flash4.compile.cache import get_fwd_runner
    from flash4.reference import fwd_errors

    torch_dtype = common.torch_dtype(dtype)
    results = []
    for d in headdims:
        for c in causals:
            runs = [(name, cfg) for name in variants
                    for cfg in dict.fromkeys(variant_config(name, d, c, dtype, s) for s in seqlens)]
            for b, sq, sk, h in CHECK_SHAPES:
                if sq != sk and not c:
                    continue
                q, k, v = common.make_inputs(b, sq, sk, h, h, d, torch_dtype, seed=1)
                for name, cfg in runs:
                    shape = f"b{b} sq{sq} sk{sk} h{h} d{d}" + (" persistent" if cfg.persistent else "")
                    entry = {"variant": name, "shape": shape, "causal": c}
                    try:
                        out = torch.full_like(q, math.nan)
                        lse = torch.full((b, h, sq), math.nan, device=q.device, dtype=torch.float32)
                        get_fwd_runner(cfg)(q, k, v, out, lse, d ** -0.5)
                        torch.cuda.synchronize()
                        entry.update(fwd_errors(q, k, v, out, lse, None, c), error=None)
                    except Exception as err:
                        entry.update(ok=False, error=_error_text(err))
                    results.append(entry)
    return results


def measure(variants, cells, dtype, rounds: int = ROUNDS, rep_ms: float = 100.0) -> list[dict]:
    """Forward TFLOPs of every variant on every cell (median of `rounds` interleaved rounds);
    rows with CSV_COLUMNS keys plus batch, nheads and times_ms (NaN where a variant raised)."""
    import torch

    from flash4.bench.report import progress
    from flash4.compile.cache import get_fwd_runner

    torch_dtype = common.torch_dtype(dtype)
    rows, seen = [], set()
    bar = progress(len(cells) * len(variants) * rounds, "ablate", "run")

    def report(name, cell, err):
        message = _error_text(err)
        if (name, message) not in seen:
            seen.add((name, message))
            bar.write(f"{name} failed at {cell.label()}: {message} (NaN; repeats not shown)")

    for cell in cells:
        q, k, v = common.make_inputs(cell.batch, cell.seqlen, cell.seqlen, cell.nheads, cell.nheads, cell.headdim,
                                     torch_dtype)
        out = torch.empty_like(q)
        lse = torch.empty(cell.batch, cell.nheads, cell.seqlen, device=q.device, dtype=torch.float32)
        scale = cell.headdim ** -0.5
        fns = {}
        for name in variants:  # compile everything first: no compile inside a timing round
            try:
                runner = get_fwd_runner(variant_config(name, cell.headdim, cell.causal, dtype, cell.seqlen))
                fns[name] = lambda runner=runner: runner(q, k, v, out, lse, scale)
            except Exception as err:
                report(name, cell, err)
        times = {name: [] for name in variants}
        for order in round_orders(variants, rounds):
            for name in order:
                bar.set_postfix_str(f"{name} {cell.label()}")
                ms = math.nan
                if name in fns:
                    try:
                        ms = common.time_ms(fns[name], rep_ms=rep_ms)
                    except Exception as err:
                        report(name, cell, err)
                        fns.pop(name)
                        if isinstance(err, torch.cuda.OutOfMemoryError):
                            torch.cuda.empty_cache()
                times[name].append(ms)
                bar.update()
        rows.extend(_cell_rows(cell, times))
        del q, k, v, out, lse, fns
    bar.close()
    return rows


# Options the no-GPU ablation cannot honour (run.given_flags' form); --cases, --varlen and --no-bwd
# belong to the sweep and are ignored by the ablation in any case.
NO_GPU_IGNORED = (("--rep-ms", "rep_ms", run.DEFAULT_REP_MS), ("--out", "out", run.DEFAULT_OUT),
                  ("--cases", "cases", None), ("--varlen", "varlen", "all"), ("--no-bwd", "bwd", True))


def _no_gpu(configs, ignored=()) -> int:
    import torch

    from flash4.bench.report import compile_check_main

    print(f"No CUDA GPU found (torch {torch.__version__}, CUDA build {torch.version.cuda}): nothing can be "
          "timed. Compiling the variants' forward kernels instead (the compile check).")
    if ignored:
        print(f"Ignored: {', '.join(ignored)}.")
    return compile_check_main(configs)


def main(args: argparse.Namespace) -> int:
    """Run the ablation; returns the exit code (1 when a variant fails its correctness check)."""
    import torch

    from flash4.bench.report import format_table

    headdims = tuple(args.headdims or (QUICK_HEADDIMS if args.quick else DEFAULT_HEADDIMS))
    seqlens = tuple(args.seqlens or (QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS))
    causals = {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]
    variants = selected_variants(args.variants)
    dtype = args.dtype or common.DEFAULT_DTYPE
    if not torch.cuda.is_available():
        configs = [variant_config(v, d, c, dtype, s) for d in headdims for c in causals for v in variants
                   for s in seqlens]
        return _no_gpu(list(dict.fromkeys(configs)), run.given_flags(args, NO_GPU_IGNORED))

    meta = run.collect_metadata(dtype)
    meta.update(ablation={"rounds": ROUNDS, "rep_ms": args.rep_ms, "variants": {v: VARIANTS[v] for v in variants},
                          "call": "compiled runner, preallocated out/lse, softmax_scale = headdim**-0.5"})
    print("  ".join(f"{k}={v}" for k, v in meta.items() if k != "ablation"))
    print("variants: " + "; ".join(f"{v} {VARIANTS[v] or '(flash4 as shipped)'}" for v in variants))

    print("\nCorrectness of each variant vs float32 reference (ok: err <= 2 x PyTorch same-dtype err + atol):")
    checks = check_variants(variants, headdims, causals, dtype, seqlens)
    bad = [c for c in checks if not c["ok"]]
    print(f"{len(checks) - len(bad)}/{len(checks)} ok")
    if bad:
        print(format_table(["variant", "shape", "causal", "out_err", "out_pt_err", "lse_err", "lse_pt_err", "error"],
                           [[c["variant"], c["shape"], c["causal"], c.get("out_err"), c.get("out_pt_err"),
                             c.get("lse_err"), c.get("lse_pt_err"), c["error"]] for c in bad]))
        print("WARNING: some variants are wrong; their timings below mean little.")

    cells = common.sweep_cells(headdims, seqlens, causals)
    print(f"\nAblation: {len(cells)} cells x {len(variants)} variants x {ROUNDS} interleaved rounds, {dtype}, "
          f"batch*seqlen={common.TOKENS}, hidden={common.HIDDEN}; forward TFLOPs, median of rounds ({meta['timing']})")
    rows = measure(variants, cells, dtype, rep_ms=args.rep_ms)
    headers, table = ratio_table(rows)
    print(format_table(headers, table))
    same = same_as_default(variants, headdims, causals, dtype, seqlens)
    if same:
        print("Same config as default:")
        print("\n".join(describe_same(same, headdims, causals)))

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "ablation.csv")
    write_json(out_dir / "ablation.json", meta, rows, checks, same)
    print(f"\nwrote {out_dir / 'ablation.csv'}, {out_dir / 'ablation.json'}")
    if bad:
        print("FAILED: some variants are not correct (see the correctness table).")
    return 1 if bad else 0
