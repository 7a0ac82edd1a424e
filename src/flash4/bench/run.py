"""`python -m flash4 bench`: correctness on a few shapes, then the forward and backward TFLOPs sweep;
the orchestrator of the benchmark (the other bench modules never import it back).

Sweep: batch * seqlen = 32768 tokens, hidden 2048 (nheads = 2048 // headdim), seqlen_q ==
seqlen_k, bf16 (--dtype), causal and not; implementations named as in the CSV: flash4,
flash_attn_4 (when importable), sdpa_cudnn, sdpa_flash (baselines.py).
FLOPs of the forward: 4 * batch * nheads * seqlen^2 * headdim, halved when causal.
Times are medians, flushing L2 between calls (common.time_ms: triton.testing.do_bench when triton
imports, else CUDA events). An implementation that raises on a cell gets NaN there; its error is
printed once. Backward (unless --no-bwd): the time of torch.autograd.grad(out, (q, k, v), dout) on
a graph built once per cell (the backward kernels with their pre/postprocess), FLOPs 2.5x the
forward's; NaN where an implementation has no backward for the cell or raised there.
Ceiling: once per run, a GEMM_SIZE^3 torch.matmul (cuBLAS) in the sweep's dtype, timed like the
cells; every row carries its TFLOPs as a fraction of that rate (fwd_gemm_ratio, bwd_gemm_ratio).
Writes into --out (default bench_out/): sweep.csv (CSV_COLUMNS), sweep.json (metadata with the
GEMM ceiling, rows, correctness, targets), sweep.png. Without a GPU it says so and runs the compile
check of the configs the flags select instead (no_gpu_plan).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from flash4.bench import common
from flash4.bench.common import (  # noqa: F401 - also this module's public names (tests, scripts)
    BWD_FLOPS_FACTOR,
    DEFAULT_DTYPE,
    DTYPE_NAMES,
    HIDDEN,
    TOKENS,
    Cell,
    fwd_flops,
    parse_seqlen,
    ratio,
    seqlen_label,
    sweep_cells,
    tflops,
    timing_method,
)

DEFAULT_HEADDIMS = (64, 128, 256)
DEFAULT_SEQLENS = (1024, 4096, 16384, 32768)
QUICK_HEADDIMS = (128,)
QUICK_SEQLENS = (1024, 4096)
DEFAULT_REP_MS = 100.0
DEFAULT_OUT = "bench_out"
IMPL_NAMES = ("flash4", "flash_attn_4", "sdpa_cudnn", "sdpa_flash")  # order of baselines.all_impls()
# sweep.csv's columns (docs/perf/h200.csv is written by this code: new columns go at the end).
CSV_COLUMNS = ("impl", "headdim", "causal", "seqlen", "batch", "nheads", "fwd_tflops", "bwd_tflops",
               "gemm_tflops", "fwd_gemm_ratio", "bwd_gemm_ratio")
CSV_DIGITS = {"fwd_gemm_ratio": 3, "bwd_gemm_ratio": 3}  # decimals; other floats 1
DTYPES = {name: common.torch_dtype(name) for name in DTYPE_NAMES}
# Targets: flash4 / sdpa_cudnn >= 1.0 on every cell; flash4 / flash_attn_4 >= 0.85 at headdim 128,
# seqlen >= 4k (forward and backward alike).
TARGET_VS_CUDNN = 1.0
TARGET_VS_FA4 = 0.85
GEMM_SIZE = 8192  # the ceiling: an M = N = K = GEMM_SIZE matrix multiply

DESCRIPTION = f"""\
Check flash4's results against a float32 reference on a few shapes, then time flash4 and the other
attention implementations installed here on the same problems, forward and backward, in TFLOPs.

The sweep is every combination of head dim (--headdims), sequence length (--seqlens) and mask
(--causal). In every cell batch * seqlen = {TOKENS} tokens and nheads * headdim = {HIDDEN}; queries and
keys have the same length. Forward FLOPs: 4 * batch * nheads * seqlen^2 * headdim, half that with
the causal mask; backward FLOPs: {BWD_FLOPS_FACTOR}x the forward's. Each time is the median of many
calls, with the GPU's L2 cache flushed between calls.

Ceiling: the same run times one {GEMM_SIZE} x {GEMM_SIZE} x {GEMM_SIZE} matrix multiply (torch.matmul, cuBLAS,
in --dtype) the same way, and shows each cell also as a fraction of that rate ("flash4/gemm" in the
tables; fwd_gemm_ratio and bwd_gemm_ratio in sweep.csv).

Implementations: flash4; flash_attn_4 (the flash-attn-4 package, when installed); sdpa_cudnn and
sdpa_flash (PyTorch's scaled_dot_product_attention with its cuDNN or its FlashAttention-2 backend).
An implementation that fails on a cell has no number there ("-" in the tables, nan in the CSV);
its error is printed once.

After the sweep come the named cases (--cases) and the variable-length, paged-KV and decode cells
(--varlen). Files written to --out: sweep.csv (a line per implementation and cell), sweep.json
(the same plus date, GPU, library versions, the correctness results and the GEMM ceiling),
sweep.png (plots), cases.csv, varlen.csv.

Without a GPU nothing can be timed: the command says so and compiles flash4's kernels instead
(as `python -m flash4 compile-check`), for the head dims, dtype, mask and passes chosen with
--headdims, --dtype, --causal and --no-bwd (default: every shipped kernel), and names the options
it ignored.

With --family portable, flash4 runs its portable kernel family (mma.sync, the kernels of sm_80 / 86 /
89 / 120 GPUs) on this GPU instead of the GPU's own (FLASH4_FAMILY=portable), its target becomes
sdpa_flash (FlashAttention-2, also an mma.sync kernel), and portable.csv gets one line per
implementation and cell (impl flash4_portable for flash4; columns impl, case (d64_4k_causal, ...),
headdim, causal, seqlen_q, seqlen_k, batch, nheads, nheads_k, fwd_tflops, bwd_tflops).

With --ablate it times flash4's forward with each of its optimizations switched off or on instead
of the sweep (--variants)."""

# portable.csv (--family portable; docs/perf/h200-portable.csv is written from it): issue 24's columns.
PORTABLE_COLUMNS = ("impl", "case", "headdim", "causal", "seqlen_q", "seqlen_k", "batch", "nheads", "nheads_k",
                    "fwd_tflops", "bwd_tflops")
FAMILIES = ("default", "portable")
TARGET_VS_FA2 = 1.0  # --family portable: flash4 / sdpa_flash on every cell


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--headdims", type=int, nargs="+", metavar="D",
                        help=f"head dims to sweep (default: {' '.join(map(str, DEFAULT_HEADDIMS))}; "
                             f"with --quick: {' '.join(map(str, QUICK_HEADDIMS))})")
    parser.add_argument("--seqlens", type=parse_seqlen, nargs="+", metavar="S",
                        help="sequence lengths to sweep, in tokens, e.g. 4096 or 4k "
                             f"(default: {' '.join(map(seqlen_label, DEFAULT_SEQLENS))}; "
                             f"with --quick: {' '.join(map(seqlen_label, QUICK_SEQLENS))})")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both",
                        help="0: without a mask only, 1: with the causal mask only, both: each (default)")
    parser.add_argument("--impls", nargs="+", choices=IMPL_NAMES, metavar="IMPL",
                        help=f"implementations to time: {', '.join(IMPL_NAMES)} "
                             "(default: each of them that is installed)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES,
                        help=f"data type of q, k and v: {' or '.join(DTYPE_NAMES)} (default: {DEFAULT_DTYPE}; "
                             "without a GPU the compile check covers both unless --dtype is given)")
    parser.add_argument("--quick", action="store_true",
                        help="a short sweep: head dim 128, seqlens 1k 4k (unless --headdims / --seqlens say "
                             f"otherwise); without a GPU, the compile check of those head dims only, in "
                             f"{DEFAULT_DTYPE} unless --dtype is given")
    parser.add_argument("--rep-ms", type=float, default=DEFAULT_REP_MS, metavar="MS",
                        help=f"time spent timing each measurement, in milliseconds (default: {DEFAULT_REP_MS:g}); "
                             "more gives steadier numbers and a longer run")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"directory the result files are written to (default: {DEFAULT_OUT})")
    parser.add_argument("--no-bwd", dest="bwd", action="store_false",
                        help="time the forward pass only (default: forward and backward)")
    parser.add_argument("--cases", nargs="+", metavar="NAME",
                        help="named problems outside the sweep, timed after it: other head dims (d96, d192, "
                             "smalld), grouped-query and multi-query attention (gqa, mqa), a sliding window "
                             "(window), a logit soft-cap (softcap), attention sinks (sink), a value head dim "
                             "other than the query's (hdimv). A full name or its beginning; 'all' (default) "
                             "or 'none'. Written to cases.csv")
    parser.add_argument("--family", choices=FAMILIES, default="default",
                        help="kernel family flash4 runs: default (this GPU's own) or portable (the mma.sync "
                             "kernels of A100 / RTX 30xx-50xx / L4 / L40 GPUs, run on this GPU: FLASH4_FAMILY="
                             "portable); portable also writes portable.csv and compares against sdpa_flash")
    parser.add_argument("--varlen", choices=("all", "none", "only"), default="all",
                        help="batches of sequences of different lengths, a paged KV cache and single-token "
                             "decode steps: 'all' times them after the sweep (default), 'none' skips them, "
                             "'only' times them alone (no sweep, no cases). Written to varlen.csv")


# Options that only choose what to time or where results go: the no-GPU compile check cannot
# honour them. (flag, args attribute, value when not given)
TIMING_ONLY_FLAGS = (("--seqlens", "seqlens", None), ("--impls", "impls", None), ("--cases", "cases", None),
                     ("--varlen", "varlen", "all"), ("--rep-ms", "rep_ms", DEFAULT_REP_MS),
                     ("--out", "out", DEFAULT_OUT))


def given_flags(args: argparse.Namespace, flags) -> list[str]:
    """The flags among `flags` ((flag, attribute, value when not given)) that the command line set."""
    return [flag for flag, attr, unset in flags if getattr(args, attr, unset) != unset]


def no_gpu_plan(args: argparse.Namespace) -> dict:
    """What `bench` without a GPU compiles (pure): select_configs' filters from the flags the
    compile check can honour (--headdims, --dtype, --causal, --no-bwd, --quick), a sentence saying
    so, and the flags it ignores."""
    from flash4.config import SUPPORTED_HEADDIMS

    every_headdim = f"head dims {' '.join(map(str, SUPPORTED_HEADDIMS))} and their value-head-dim pairs"
    headdims = tuple(args.headdims) if args.headdims else (QUICK_HEADDIMS if args.quick else None)
    dtypes = (args.dtype,) if args.dtype else ((DEFAULT_DTYPE,) if args.quick else None)
    causals = {"0": (False,), "1": (True,), "both": None}[args.causal]
    passes = None if args.bwd else ("fwd",)
    what = [
        (f"head dim{'s' if len(headdims) > 1 else ''} " + " ".join(map(str, headdims))) if headdims
        else every_headdim,
        " and ".join(dtypes) if dtypes else "bf16 and fp16",
        {None: "with and without the causal mask", (False,): "without a mask", (True,): "with the causal mask"}[
            causals],
        "forward only" if passes else "forward and backward",
    ]
    return {"headdims": headdims, "dtypes": dtypes, "causals": causals, "passes": passes,
            "describe": "; ".join(what), "ignored": given_flags(args, TIMING_ONLY_FLAGS)}
def check_cases(impl_name: str, headdims, causals) -> list[tuple]:
    """(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal) shapes checked before timing."""
    d0 = headdims[0]
    if impl_name != "flash4":  # one shape per causal value: validates the harness's call of it
        return [(2, 1000, 1000, 8, 8, d0, c) for c in causals]
    cases = [(2, 1000, 1000, 8, 8, d, c) for d in headdims for c in causals]
    cases += [(2, 129, 1000, 8, 8, d0, True), (2, 1000, 129, 8, 8, d0, True), (1, 1000, 1000, 16, 2, d0, True)]
    return cases


def check_correctness(impls, headdims, causals, dtype) -> list[dict]:
    """Compare each impl to the float32 reference (reference.fwd_errors) on check_cases()."""
    from flash4 import flash_attn_func
    from flash4.reference import fwd_errors

    results = []
    for impl in impls:
        for case in check_cases(impl.name, headdims, causals):
            b, sq, sk, h, hk, d, causal = case
            entry = {"impl": impl.name, "shape": f"b{b} sq{sq} sk{sk} h{h}/{hk} d{d}", "causal": causal}
            try:
                q, k, v = common.make_inputs(b, sq, sk, h, hk, d, dtype, seed=1)
                lse = None
                with impl.context():
                    if impl.name == "flash4":
                        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
                    else:
                        out = impl.make(q, k, v, causal)()
                entry.update(fwd_errors(q, k, v, out, lse, None, causal), error=None)
            except Exception as err:
                entry.update(ok=False, error=f"{type(err).__name__}: {err}".splitlines()[0][:300])
            results.append(entry)
    return results


def measure(impls, cells, dtype, rep_ms: float = 100.0, bwd: bool = False) -> list[dict]:
    """Forward (and backward) TFLOPs of every impl on every cell; rows with the first eight
    CSV_COLUMNS keys (NaN where it raised; bwd_tflops None when not timed). add_gemm_ratios adds
    the others."""
    from flash4.bench.report import progress

    rows, seen = [], set()
    bar = progress(len(cells) * len(impls), "sweep", "run")
    for cell in cells:
        q, k, v = common.make_inputs(cell.batch, cell.seqlen, cell.seqlen, cell.nheads, cell.nheads, cell.headdim,
                                     dtype)
        for impl in impls:
            bar.set_postfix_str(f"{impl.name} {cell.label()}")
            def report(err, what):
                message = f"{what}: {type(err).__name__}: {err}".splitlines()[0][:300]
                if (impl.name, message) not in seen:
                    seen.add((impl.name, message))
                    bar.write(f"{impl.name} failed at {cell.label()}: {message} (NaN; repeats not shown)")
                if isinstance(err, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()

            try:
                fn = impl.make(q, k, v, cell.causal)
                with impl.context():
                    fwd = tflops(fwd_flops(cell), common.time_ms(fn, rep_ms=rep_ms))
            except Exception as err:
                fwd = math.nan
                report(err, "fwd")
            bwd_tf = None
            if bwd:
                try:
                    bwd_tf = tflops(BWD_FLOPS_FACTOR * fwd_flops(cell),
                                    common.time_bwd(impl, q, k, v, cell.causal, rep_ms))
                except Exception as err:
                    bwd_tf = math.nan
                    report(err, "bwd")
            rows.append({"impl": impl.name, "headdim": cell.headdim, "causal": int(cell.causal),
                         "seqlen": cell.seqlen, "batch": cell.batch, "nheads": cell.nheads,
                         "fwd_tflops": fwd, "bwd_tflops": bwd_tf})
            bar.set_postfix_str(f"{impl.name} {cell.label()}: fwd {fwd:.1f}"
                                + ("" if bwd_tf is None else f", bwd {bwd_tf:.1f}") + " TFLOPs")
            bar.update()
        del q, k, v
    bar.close()
    return rows


def gemm_flops(size: int = GEMM_SIZE) -> float:
    """2 * M * N * K of the square ceiling GEMM."""
    return 2.0 * size ** 3


def measure_gemm(dtype_name: str, rep_ms: float = DEFAULT_REP_MS, size: int = GEMM_SIZE,
                 device: str = "cuda") -> dict:
    """The run's ceiling: TFLOPs of torch.matmul (cuBLAS) of two size x size matrices in the
    sweep's dtype, timed like the attention cells (common.time_ms, the same rep_ms). Returns the
    record kept in sweep.json's meta["gemm"]; tflops NaN (and error set) when it raised."""
    entry = {"op": "torch.matmul", "m": size, "n": size, "k": size, "dtype": dtype_name}
    try:
        dtype = common.torch_dtype(dtype_name)
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        ms = common.time_ms(lambda: torch.matmul(a, b), rep_ms=rep_ms)
        entry.update(ms=ms, tflops=tflops(gemm_flops(size), ms), error=None)
        del a, b
    except Exception as err:  # no ceiling: the ratios are NaN, the sweep still runs
        entry.update(ms=math.nan, tflops=math.nan, error=f"{type(err).__name__}: {err}".splitlines()[0][:300])
        if isinstance(err, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
    return entry


def add_gemm_ratios(rows, gemm_tflops: float) -> list[dict]:
    """Each row (in place, and returned) gets gemm_tflops and its forward and backward TFLOPs as
    a fraction of it: fwd_gemm_ratio, bwd_gemm_ratio (None where the backward was not timed, NaN
    where a number is missing)."""
    for r in rows:
        r["gemm_tflops"] = gemm_tflops
        r["fwd_gemm_ratio"] = ratio(r.get("fwd_tflops"), gemm_tflops)
        r["bwd_gemm_ratio"] = None if r.get("bwd_tflops") is None else ratio(r["bwd_tflops"], gemm_tflops)
    return rows


def describe_gemm(gemm: dict) -> str:
    """The line printed about the ceiling."""
    shape = f"{gemm['m']} x {gemm['n']} x {gemm['k']}"
    if gemm.get("error"):
        return f"GEMM ceiling ({gemm['op']} {gemm['dtype']} {shape}): failed, {gemm['error']}; no flash4/gemm ratios"
    return (f"GEMM ceiling: {gemm['op']} (cuBLAS) {gemm['dtype']} {shape}: {gemm['tflops']:.1f} TFLOPs "
            f"({gemm['ms']:.3f} ms); 'flash4/gemm' below is flash4's TFLOPs / this")


def _by_cell(rows, metric: str = "fwd_tflops") -> dict:
    cells: dict = {}
    for r in rows:
        key = (r["headdim"], r["causal"], r["seqlen"], r["batch"], r["nheads"])
        cells.setdefault(key, {})[r["impl"]] = r.get(metric)
    return cells


def result_table(rows, metric: str = "fwd_tflops") -> tuple[list[str], list[list]]:
    """Headers and rows: one line per cell, TFLOPs (`metric`) per impl, then flash4's ratio to each
    other impl, then (when the rows carry it, add_gemm_ratios) flash4's fraction of the GEMM
    ceiling, "flash4/gemm"."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    others = [i for i in impls if i != "flash4"] if "flash4" in impls else []
    gemm_key = metric.replace("_tflops", "_gemm_ratio")
    with_gemm = "flash4" in impls and any(gemm_key in r for r in rows)
    headers = (["hdim", "causal", "seqlen", "batch", "nheads"] + impls + [f"flash4/{i}" for i in others]
               + (["flash4/gemm"] if with_gemm else []))
    gemm = _by_cell(rows, gemm_key)
    table = []
    for key, vals in _by_cell(rows, metric).items():
        line = list(key) + [vals.get(i, math.nan) for i in impls] + [ratio(vals.get("flash4"), vals.get(i))
                                                                      for i in others]
        if with_gemm:
            g = gemm[key].get("flash4")
            line.append(math.nan if g is None else g)
        table.append(line)
    return headers, table


def targets_summary(rows, metric: str = "fwd_tflops", family: str = "default") -> list[str]:
    """One line per target (the same for forward and backward): met, missed (with the cells), or
    not measured. family "portable": flash4 >= sdpa_flash (FlashAttention-2) on every cell."""
    cells = _by_cell(rows, metric)
    specs = [
        ("sdpa_cudnn", TARGET_VS_CUDNN, "every cell", lambda d, s: True),
        ("flash_attn_4", TARGET_VS_FA4, "hdim 128, S >= 4k", lambda d, s: d == 128 and s >= 4096),
    ]
    if family == "portable":
        specs = [("sdpa_flash", TARGET_VS_FA2, "every cell", lambda d, s: True)]
    lines = []
    for other, target, where, applies in specs:
        ratios = {key: ratio(v.get("flash4"), v.get(other)) for key, v in cells.items() if applies(key[0], key[2])}
        ratios = {key: r for key, r in ratios.items() if not math.isnan(r)}
        name = f"{metric.split('_')[0]}: flash4 >= {target:.2f}x {other} ({where})"
        if not ratios:
            lines.append(f"{name}: not measured")
            continue
        worst = min(ratios, key=ratios.get)
        missed = [key for key, r in ratios.items() if r < target]
        status = "MET" if not missed else f"MISSED on {len(missed)}/{len(ratios)} cells"
        lines.append(f"{name}: {status}; worst {ratios[worst]:.3f}x at hdim {worst[0]} "
                     f"{'causal' if worst[1] else 'full'} S={seqlen_label(worst[2])}")
    return lines


def write_csv(rows, path: Path) -> None:
    """sweep.csv: CSV_COLUMNS (a row without the GEMM keys leaves those fields empty)."""
    common.write_rows_csv(rows, CSV_COLUMNS, path, CSV_DIGITS)


def portable_rows(rows) -> list[dict]:
    """Sweep rows in PORTABLE_COLUMNS: impl flash4 -> flash4_portable, case d{D}_{S}_{causal|full}
    (S as seqlen_label), seqlen_q = seqlen_k, nheads_k = nheads (the sweep has no GQA)."""
    out = []
    for r in rows:
        out.append(dict(impl="flash4_portable" if r["impl"] == "flash4" else r["impl"],
                        case=f"d{r['headdim']}_{seqlen_label(r['seqlen'])}_{'causal' if r['causal'] else 'full'}",
                        headdim=r["headdim"], causal=int(bool(r["causal"])), seqlen_q=r["seqlen"], seqlen_k=r["seqlen"],
                        batch=r["batch"], nheads=r["nheads"], nheads_k=r["nheads"], fwd_tflops=r.get("fwd_tflops"),
                        bwd_tflops=r.get("bwd_tflops")))
    return out


def write_portable_csv(rows, path: Path) -> None:
    """portable.csv: portable_rows(rows) in PORTABLE_COLUMNS."""
    common.write_rows_csv(portable_rows(rows), PORTABLE_COLUMNS, path)


# Memory yardstick: fwd + bwd at B=1, H=16, S=16k, hdim 128, causal.
MEMORY_SHAPE = dict(batch=1, seqlen=16384, nheads=16, headdim=128, causal=True)


def measure_memory(impls, dtype) -> dict:
    """Peak device memory (MiB) that one forward + backward adds on top of q, k, v and dout, per
    impl, at MEMORY_SHAPE; NaN where an impl raises (e.g. out of memory)."""
    shape = MEMORY_SHAPE
    result = {}
    for impl in impls:
        q, k, v = common.make_inputs(shape["batch"], shape["seqlen"], shape["seqlen"], shape["nheads"],
                                     shape["nheads"], shape["headdim"], dtype)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(q)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            with impl.context():
                impl.make(q, k, v, shape["causal"])().backward(dout)
            torch.cuda.synchronize()
            result[impl.name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as err:
            print(f"memory: {impl.name} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            result[impl.name] = math.nan
        del q, k, v, dout
        torch.cuda.empty_cache()
    return result


def write_json(path: Path, meta: dict, rows, checks, targets, memory=None) -> None:
    doc = {"meta": meta, "rows": rows, "correctness": checks, "targets": targets, "memory_mib": memory}
    path.write_text(json.dumps(common.json_safe(doc), indent=2) + "\n")


def plot(rows, path: Path, title: str) -> None:
    """TFLOPs vs seqlen (PNG, no display): one panel per (pass, causal, headdim), forward rows first,
    then backward rows when any backward was timed; one line per impl. Each panel has its own
    y-axis from 0 to just above its largest value (head dims differ by ~2x in TFLOPs: a shared
    axis flattens the small ones)."""
    from matplotlib.figure import Figure

    headdims = sorted({r["headdim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    seqlens = sorted({r["seqlen"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))

    def finite(x):
        return x is not None and not math.isnan(x)

    metrics = [("fwd_tflops", "forward")]
    if any(finite(r.get("bwd_tflops")) for r in rows):
        metrics.append(("bwd_tflops", "backward"))
    panels = [(m, name, c) for m, name in metrics for c in causals]
    fig = Figure(figsize=(4.5 * len(headdims), 3.6 * len(panels)))
    axes = fig.subplots(len(panels), len(headdims), squeeze=False)
    for i, (metric, name, c) in enumerate(panels):
        for j, d in enumerate(headdims):
            ax = axes[i][j]
            top = 0.0
            for impl in impls:
                pts = sorted((r["seqlen"], r.get(metric)) for r in rows
                             if r["impl"] == impl and r["headdim"] == d and r["causal"] == c and finite(r.get(metric)))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
                    top = max(top, max(p[1] for p in pts))
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [seqlen_label(s) for s in seqlens])
            ax.set_title(f"{name}, hdim {d}, {'causal' if c else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel(f"{name} TFLOPs")
            ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))  # room for the title
    fig.savefig(path, dpi=120)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def collect_metadata(dtype_name: str) -> dict:
    """Date, GPU, versions and sweep constants recorded with every run."""
    import flash4
    from flash4.arch import device_arch, num_sms
    from flash4.bench.baselines import flash_attn_version

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "sm": device_arch(),
        "num_sms": num_sms(),
        "flash4": flash4.__version__,
        "git": _git_revision(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nvidia-cutlass-dsl": _dist_version("nvidia-cutlass-dsl"),
        "flash-attn": flash_attn_version(),
        "triton": _dist_version("triton"),
        "timing": timing_method(),
        "dtype": dtype_name,
        "tokens": TOKENS,
        "hidden": HIDDEN,
    }


def _no_gpu(args) -> int:
    from flash4.bench.report import compile_check_main, select_configs

    plan = no_gpu_plan(args)
    print(f"No CUDA GPU found (torch {torch.__version__}, CUDA build {torch.version.cuda}): nothing can be "
          f"timed. Compiling flash4's kernels instead (the compile check): {plan['describe']}.")
    if plan["ignored"]:
        print(f"Ignored without a GPU: {', '.join(plan['ignored'])} (they choose what is timed, or where "
              "its results go).")
    configs = select_configs(headdims=plan["headdims"], dtypes=plan["dtypes"], causals=plan["causals"],
                             passes=plan["passes"])
    return compile_check_main(configs)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit code (1 when flash4 fails its correctness check)."""
    from flash4.bench.report import format_table

    from flash4.bench import cases as bench_cases

    try:
        cases = bench_cases.select_cases(getattr(args, "cases", None))
    except ValueError as err:
        print(err)
        return 2
    family = getattr(args, "family", "default")
    if family == "portable":
        from flash4 import env

        env.force_family("portable")  # read by flash4.config on every selection
        print("flash4 runs its portable kernel family here (FLASH4_FAMILY=portable)")
    if not torch.cuda.is_available():
        return _no_gpu(args)

    import_s = _dsl_import_seconds()  # before the baselines: flash-attn-4 imports the CuTe DSL too
    from flash4.bench.baselines import all_impls

    headdims = args.headdims or (QUICK_HEADDIMS if args.quick else DEFAULT_HEADDIMS)
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    causals = {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]
    dtype_name = args.dtype or DEFAULT_DTYPE
    dtype = DTYPES[dtype_name]
    wanted = args.impls or IMPL_NAMES
    impls = []
    for impl in all_impls():
        if impl.name not in wanted:
            continue
        if impl.unavailable:
            print(f"{impl.name}: not available ({impl.unavailable}); skipped")
        else:
            impls.append(impl)
    meta = collect_metadata(dtype_name)
    meta["cute_dsl_import_s"] = round(import_s, 3)
    print("  ".join(f"{k}={v}" for k, v in meta.items()))
    if getattr(args, "varlen", "all") == "only":
        code = _run_varlen(impls, dtype, args)
        _print_compile_summary(import_s)
        return code

    print("\nCorrectness vs float32 reference (ok: err <= 2 x PyTorch same-dtype err + atol):")
    checks = check_correctness(impls, headdims, causals, dtype)
    print(format_table(
        ["impl", "shape", "causal", "ok", "out_err", "out_pt_err", "lse_err", "lse_pt_err", "error"],
        [[c["impl"], c["shape"], c["causal"], c["ok"], c.get("out_err"), c.get("out_pt_err"),
          c.get("lse_err"), c.get("lse_pt_err"), c["error"]] for c in checks],
    ))
    flash4_failed = any(not c["ok"] for c in checks if c["impl"] == "flash4")
    if any(not c["ok"] for c in checks):
        print("WARNING: some results are wrong; their timings below mean little.")

    gemm = measure_gemm(dtype_name, rep_ms=args.rep_ms)
    meta["gemm"] = gemm
    print("\n" + describe_gemm(gemm))

    cells = sweep_cells(headdims, seqlens, causals)
    print(f"\nSweep: {len(cells)} cells x {len(impls)} impls, {dtype_name}, batch*seqlen={TOKENS}, "
          f"hidden={HIDDEN}; {'forward and backward' if args.bwd else 'forward'} TFLOPs ({meta['timing']})")
    rows = add_gemm_ratios(measure(impls, cells, dtype, rep_ms=args.rep_ms, bwd=args.bwd), gemm["tflops"])
    headers, table = result_table(rows)
    print("forward TFLOPs\n" + format_table(headers, table))
    targets = targets_summary(rows, family=family)
    if args.bwd:
        headers, table = result_table(rows, "bwd_tflops")
        print("\nbackward TFLOPs\n" + format_table(headers, table))
        targets += targets_summary(rows, "bwd_tflops", family=family)
    print("\n".join(targets))

    memory = None
    if args.bwd:
        from flash4.bench.baselines import math_impl

        memory = measure_memory(impls + [math_impl()], dtype)
        m = MEMORY_SHAPE
        print(f"\nExtra device memory of forward + backward, batch {m['batch']}, {m['nheads']} heads, "
              f"seqlen {seqlen_label(m['seqlen'])}, hdim {m['headdim']}{', causal' if m['causal'] else ''}:")
        print("  ".join(f"{name}={mib:.0f} MiB" for name, mib in memory.items()))
        if "flash_attn_4" in memory and memory.get("flash4", math.nan) == memory.get("flash4"):
            print(f"flash4 / flash_attn_4 = {ratio(memory['flash4'], memory['flash_attn_4']):.2f} (target <= 1.5); "
                  f"sdpa_math / flash4 = {ratio(memory.get('sdpa_math'), memory['flash4']):.0f} (target >= 50)")

    case_rows = []
    if cases:
        print(f"\nCases beyond the sweep ({len(cases)}): TFLOPs of the unmasked work ({dtype_name})")
        case_rows = bench_cases.measure_cases(impls, cases, dtype, rep_ms=args.rep_ms, bwd=args.bwd)
        for metric in ("fwd_tflops",) + (("bwd_tflops",) if args.bwd else ()):
            headers, table = bench_cases.cases_table(case_rows, metric)
            print(f"{metric.split('_')[0]}ward TFLOPs\n" + format_table(headers, table))

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if case_rows:
        bench_cases.write_cases_csv(case_rows, out_dir / "cases.csv")
        print(f"wrote {out_dir / 'cases.csv'}")
    write_csv(rows, out_dir / "sweep.csv")
    if family == "portable":
        write_portable_csv(rows, out_dir / "portable.csv")
        print(f"wrote {out_dir / 'portable.csv'}")
    write_json(out_dir / "sweep.json", meta, rows, checks, targets, memory)
    plot(rows, out_dir / "sweep.png", f"{meta['gpu']}, {dtype_name}, {meta['date'][:10]}")
    print(f"\nwrote {out_dir / 'sweep.csv'}, {out_dir / 'sweep.json'}, {out_dir / 'sweep.png'}")
    if getattr(args, "varlen", "all") == "all":
        _run_varlen(impls, dtype, args)
    _print_compile_summary(import_s)
    if flash4_failed:
        print("FAILED: flash4 is not correct on some shapes (see the correctness table).")
    return 1 if flash4_failed else 0


def _dsl_import_seconds() -> float:
    """Wall seconds of importing flash4's compile layer (the CuTe DSL runtime), once per process;
    0.0 when something imported it already."""
    import sys
    import time

    if "flash4.compile.cache" in sys.modules:
        return 0.0
    t0 = time.perf_counter()
    import flash4.compile.cache  # noqa: F401

    return time.perf_counter() - t0


def _print_compile_summary(import_s: float) -> None:
    """The one-time costs of this process: the CuTe DSL import and what the compile cache did
    (kernels loaded from disk, mean ms; kernels compiled, mean s)."""
    from flash4.compile import disk_cache

    print(f"\nCuTe DSL import {import_s:.2f} s (once per process); {disk_cache.timing_summary()}")


def _run_varlen(impls, dtype, args) -> int:
    """The varlen / paged / decode cells (varlen.py): table and varlen.csv."""
    from flash4.bench import varlen as bench_varlen
    from flash4.bench.report import format_table

    names = [i.name for i in impls if i.name in ("flash4", "flash_attn_4", "sdpa_cudnn")]
    print(f"\nVarlen, paged and decode cells ({args.dtype or DEFAULT_DTYPE}): TFLOPs of the unmasked work; "
          "decode as the share of the device-to-device copy bandwidth that the K/V reads reach")
    rows = bench_varlen.measure_varlen(names, dtype, rep_ms=args.rep_ms, bwd=args.bwd)
    headers, table = bench_varlen.varlen_table(rows)
    print(format_table(headers, table))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench_varlen.write_varlen_csv(rows, out_dir / "varlen.csv")
    print(f"wrote {out_dir / 'varlen.csv'}")
    return 0
