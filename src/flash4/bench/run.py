"""`python -m flash4 bench`: correctness on a few shapes, then the forward and backward TFLOPs sweep.

Sweep (issue 2): batch * seqlen = 32768 tokens, hidden 2048 (nheads = 2048 // headdim),
seqlen_q == seqlen_k, bf16 (--dtype), causal and not; implementations named as in the CSV: flash4,
flash_attn_4 (when importable), sdpa_cudnn, sdpa_flash (see baselines.py).
FLOPs of the forward: 4 * batch * nheads * seqlen^2 * headdim, halved when causal.
Times are medians, flushing L2 between calls: triton.testing.do_bench when triton imports, else
CUDA events. An implementation that raises on a cell gets NaN there; its error is printed once.
Writes into --out (default bench_out/): sweep.csv (CSV_COLUMNS), sweep.json (metadata, rows,
correctness, targets), sweep.png. Without a GPU it says so and runs the compile check instead.
Backward (unless --no-bwd): the time of torch.autograd.grad(out, (q, k, v), dout) on a graph built
once per cell (the backward kernels with their pre/postprocess), FLOPs 2.5x the forward's; NaN where
an implementation has no backward for the cell or raised there.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

TOKENS = 32768
HIDDEN = 2048
DEFAULT_HEADDIMS = (64, 128, 256)
DEFAULT_SEQLENS = (1024, 4096, 16384, 32768)
QUICK_HEADDIMS = (128,)
QUICK_SEQLENS = (1024, 4096)
IMPL_NAMES = ("flash4", "flash_attn_4", "sdpa_cudnn", "sdpa_flash")  # order of baselines.all_impls()
CSV_COLUMNS = ("impl", "headdim", "causal", "seqlen", "batch", "nheads", "fwd_tflops", "bwd_tflops")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Targets of issue 2: flash4 / sdpa_cudnn >= 1.0 on every cell; flash4 / flash_attn_4 >= 0.85 at
# headdim 128, seqlen >= 4k.
TARGET_VS_CUDNN = 1.0
TARGET_VS_FA4 = 0.85
BWD_FLOPS_FACTOR = 2.5  # backward FLOPs = 2.5 x forward (2 GEMMs forward, 5 backward)


def parse_seqlen(text: str) -> int:
    """"4096", "4k" or "4K" -> 4096."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"seqlen {text!r} is not a positive integer (e.g. 4096 or 4k)")
    return value


def seqlen_label(seqlen: int) -> str:
    return f"{seqlen // 1024}k" if seqlen % 1024 == 0 else str(seqlen)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--headdims", type=int, nargs="+", metavar="D",
                        help=f"head dims (default {' '.join(map(str, DEFAULT_HEADDIMS))})")
    parser.add_argument("--seqlens", type=parse_seqlen, nargs="+", metavar="S",
                        help="sequence lengths, e.g. 1k 4k (default 1k 4k 16k 32k)")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both", help="causal, non-causal or both")
    parser.add_argument("--impls", nargs="+", choices=IMPL_NAMES, metavar="IMPL",
                        help=f"implementations (default all available: {' '.join(IMPL_NAMES)})")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sweep: headdim {QUICK_HEADDIMS[0]}, seqlens 1k 4k (unless given); "
                             "without a GPU, a small compile check")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="timing budget per measurement (ms)")
    parser.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
    parser.add_argument("--no-bwd", dest="bwd", action="store_false",
                        help="time the forward only (default: forward and backward)")
    parser.add_argument("--cases", nargs="+", metavar="NAME",
                        help="named cells beyond the sweep to time after it (flash4.bench.cases: d96, d192, gqa, "
                             "mqa, window, softcap, sink, hdimv, smalld; a name or prefix, 'all' (default) or 'none'); written to cases.csv")
    parser.add_argument("--varlen", choices=("all", "none", "only"), default="all",
                        help="packed-varlen, paged-KV and decode cells (flash4.bench.varlen) after the sweep: "
                             "'all' (default), 'none', or 'only' (skip the sweep and cases); written to varlen.csv")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One sweep point: seqlen_q == seqlen_k == seqlen, nheads_k == nheads."""

    headdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int

    def label(self) -> str:
        return f"hdim {self.headdim} {'causal' if self.causal else 'full'} S={seqlen_label(self.seqlen)}"


def sweep_cells(headdims, seqlens, causals, tokens: int = TOKENS, hidden: int = HIDDEN) -> list[Cell]:
    """Cells in (headdim, causal, seqlen) order; batch = tokens // seqlen, nheads = hidden // headdim
    (each at least 1)."""
    return [
        Cell(d, c, s, batch=max(1, tokens // s), nheads=max(1, hidden // d))
        for d in headdims for c in causals for s in seqlens
    ]


def fwd_flops(cell: Cell) -> float:
    flops = 4.0 * cell.batch * cell.nheads * cell.seqlen * cell.seqlen * cell.headdim
    return flops / 2 if cell.causal else flops


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def timing_method() -> str:
    try:
        import triton.testing  # noqa: F401
    except ImportError:
        return "cuda events (median, L2 flushed)"
    return "triton.testing.do_bench (median, L2 flushed)"


def time_ms(fn, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of one fn() in milliseconds (GPU time, fn launched on the current stream)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _time_events(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _time_events(fn, warmup_ms: float, rep_ms: float) -> float:
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    n = max(5, int(rep_ms / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, seed=0, headdim_v=None):
    """q, k, v on the GPU (v with headdim_v when given: a value head dim different from Q/K's)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim if headdim_v is None else headdim_v, generator=gen,
                    device="cuda", dtype=dtype)
    return q, k, v


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
                q, k, v = _inputs(b, sq, sk, h, hk, d, dtype, seed=1)
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


def _time_bwd(impl, q, k, v, causal, rep_ms, **options) -> float:
    """Milliseconds of one backward pass of impl (autograd.grad on a graph built once)."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with impl.context():
        out = impl.make(qg, kg, vg, causal, **options)()
        dout = torch.randn_like(out)
        return time_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True), rep_ms=rep_ms)


def measure(impls, cells, dtype, rep_ms: float = 100.0, bwd: bool = False) -> list[dict]:
    """Forward (and backward) TFLOPs of every impl on every cell; rows with CSV_COLUMNS keys
    (NaN where it raised)."""
    from flash4.bench.report import progress

    rows, seen = [], set()
    bar = progress(len(cells) * len(impls), "sweep", "run")
    for cell in cells:
        q, k, v = _inputs(cell.batch, cell.seqlen, cell.seqlen, cell.nheads, cell.nheads, cell.headdim, dtype)
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
                    fwd = tflops(fwd_flops(cell), time_ms(fn, rep_ms=rep_ms))
            except Exception as err:
                fwd = math.nan
                report(err, "fwd")
            bwd_tf = None
            if bwd:
                try:
                    bwd_tf = tflops(BWD_FLOPS_FACTOR * fwd_flops(cell), _time_bwd(impl, q, k, v, cell.causal, rep_ms))
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


def _by_cell(rows, metric: str = "fwd_tflops") -> dict:
    cells: dict = {}
    for r in rows:
        key = (r["headdim"], r["causal"], r["seqlen"], r["batch"], r["nheads"])
        cells.setdefault(key, {})[r["impl"]] = r.get(metric)
    return cells


def _ratio(a, b) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def result_table(rows, metric: str = "fwd_tflops") -> tuple[list[str], list[list]]:
    """Headers and rows: one line per cell, TFLOPs (`metric`) per impl, then flash4's ratio to each
    other impl."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    others = [i for i in impls if i != "flash4"] if "flash4" in impls else []
    headers = ["hdim", "causal", "seqlen", "batch", "nheads"] + impls + [f"flash4/{i}" for i in others]
    table = []
    for (d, c, s, b, h), vals in _by_cell(rows, metric).items():
        table.append([d, c, s, b, h] + [vals.get(i, math.nan) for i in impls]
                     + [_ratio(vals.get("flash4"), vals.get(i)) for i in others])
    return headers, table


def targets_summary(rows, metric: str = "fwd_tflops") -> list[str]:
    """One line per target (issue 2 forward, issue 3 backward: the same two): met, missed (with the
    cells), or not measured."""
    cells = _by_cell(rows, metric)
    specs = [
        ("sdpa_cudnn", TARGET_VS_CUDNN, "every cell", lambda d, s: True),
        ("flash_attn_4", TARGET_VS_FA4, "hdim 128, S >= 4k", lambda d, s: d == 128 and s >= 4096),
    ]
    lines = []
    for other, target, where, applies in specs:
        ratios = {key: _ratio(v.get("flash4"), v.get(other)) for key, v in cells.items() if applies(key[0], key[2])}
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
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in rows:
            writer.writerow([_csv_value(r[c]) for c in CSV_COLUMNS])


def _csv_value(x):
    if x is None:
        return ""
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.1f}"
    return x


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


# Memory yardstick of issue 3: fwd + bwd at B=1, H=16, S=16k, hdim 128, causal.
MEMORY_SHAPE = dict(batch=1, seqlen=16384, nheads=16, headdim=128, causal=True)


def measure_memory(impls, dtype) -> dict:
    """Peak device memory (MiB) that one forward + backward adds on top of q, k, v and dout, per
    impl, at MEMORY_SHAPE; NaN where an impl raises (e.g. out of memory)."""
    shape = MEMORY_SHAPE
    result = {}
    for impl in impls:
        q, k, v = _inputs(shape["batch"], shape["seqlen"], shape["seqlen"], shape["nheads"], shape["nheads"],
                          shape["headdim"], dtype)
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
    path.write_text(json.dumps(_json_safe(doc), indent=2) + "\n")


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

    print(f"No CUDA GPU found (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
          "nothing to time. Running the compile check instead.")
    if args.quick:
        configs = select_configs(headdims=QUICK_HEADDIMS, dtypes=(args.dtype,))
    elif args.headdims:
        configs = select_configs(headdims=args.headdims)
    else:
        configs = None
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
    if not torch.cuda.is_available():
        return _no_gpu(args)

    import_s = _dsl_import_seconds()  # before the baselines: flash-attn-4 imports the CuTe DSL too
    from flash4.bench.baselines import all_impls

    headdims = args.headdims or (QUICK_HEADDIMS if args.quick else DEFAULT_HEADDIMS)
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    causals = {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]
    dtype = DTYPES[args.dtype]
    wanted = args.impls or IMPL_NAMES
    impls = []
    for impl in all_impls():
        if impl.name not in wanted:
            continue
        if impl.unavailable:
            print(f"{impl.name}: not available ({impl.unavailable}); skipped")
        else:
            impls.append(impl)
    meta = collect_metadata(args.dtype)
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

    cells = sweep_cells(headdims, seqlens, causals)
    print(f"\nSweep: {len(cells)} cells x {len(impls)} impls, {args.dtype}, batch*seqlen={TOKENS}, "
          f"hidden={HIDDEN}; {'forward and backward' if args.bwd else 'forward'} TFLOPs ({meta['timing']})")
    rows = measure(impls, cells, dtype, rep_ms=args.rep_ms, bwd=args.bwd)
    headers, table = result_table(rows)
    print("forward TFLOPs\n" + format_table(headers, table))
    targets = targets_summary(rows)
    if args.bwd:
        headers, table = result_table(rows, "bwd_tflops")
        print("\nbackward TFLOPs\n" + format_table(headers, table))
        targets += targets_summary(rows, "bwd_tflops")
    print("\n".join(targets))

    memory = None
    if args.bwd:
        from flash4.bench.baselines import math_impl

        memory = measure_memory(impls + [math_impl()], dtype)
        print(f"\nExtra device memory of forward + backward, {MEMORY_SHAPE}:")
        print("  ".join(f"{name}={mib:.0f} MiB" for name, mib in memory.items()))
        if "flash_attn_4" in memory and memory.get("flash4", math.nan) == memory.get("flash4"):
            print(f"flash4 / flash_attn_4 = {_ratio(memory['flash4'], memory['flash_attn_4']):.2f} (target <= 1.5); "
                  f"sdpa_math / flash4 = {_ratio(memory.get('sdpa_math'), memory['flash4']):.0f} (target >= 50)")

    case_rows = []
    if cases:
        print(f"\nCases beyond the sweep ({len(cases)}): TFLOPs of the unmasked work ({args.dtype})")
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
    write_json(out_dir / "sweep.json", meta, rows, checks, targets, memory)
    plot(rows, out_dir / "sweep.png", f"{meta['gpu']}, {args.dtype}, {meta['date'][:10]}")
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
    """The varlen / paged / decode cells (flash4.bench.varlen): table and varlen.csv."""
    from flash4.bench import varlen as bench_varlen
    from flash4.bench.report import format_table

    names = [i.name for i in impls if i.name in ("flash4", "flash_attn_4", "sdpa_cudnn")]
    print(f"\nVarlen, paged and decode cells ({args.dtype}): TFLOPs of the unmasked work; decode as the share "
          "of the device-to-device copy bandwidth that the K/V reads reach")
    rows = bench_varlen.measure_varlen(names, dtype, rep_ms=args.rep_ms, bwd=args.bwd)
    headers, table = bench_varlen.varlen_table(rows)
    print(format_table(headers, table))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench_varlen.write_varlen_csv(rows, out_dir / "varlen.csv")
    print(f"wrote {out_dir / 'varlen.csv'}")
    return 0
