"""What every part of the benchmark shares: sweep shapes and their FLOPs, the timer, input
tensors, CSV/JSON value formatting.

It imports no other flash4.bench module, so the orchestrator (run.py) and the cell families it
runs (cases.py, varlen.py, ablate.py) can all import it without an import cycle between them.
Torch is imported late (inside the functions that need a GPU), so the pure helpers here import
without it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
from pathlib import Path

TOKENS = 32768  # batch * seqlen of every sweep cell
HIDDEN = 2048  # nheads * headdim of every sweep cell
DTYPE_NAMES = ("bf16", "fp16")
DEFAULT_DTYPE = "bf16"
BWD_FLOPS_FACTOR = 2.5  # backward FLOPs = 2.5 x forward (2 GEMMs forward, 5 backward)


def torch_dtype(name: str):
    """"bf16" / "fp16" -> the torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


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
    """4 * batch * nheads * seqlen^2 * headdim, halved when causal."""
    flops = 4.0 * cell.batch * cell.nheads * cell.seqlen * cell.seqlen * cell.headdim
    return flops / 2 if cell.causal else flops


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def ratio(a, b) -> float:
    """a / b, NaN when either is missing or NaN or b is 0."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


# --- timing (GPU) ---------------------------------------------------------------------------------

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


def profile_one_call(fn, warmups: int = 3) -> None:
    """For Nsight Compute with `--profile-from-start off` (tools/prof_case.py --ncu, tools/ab_pages.py
    --ncu): fn called `warmups` times (compiles and caches out of the profile), then once between
    torch.cuda.profiler.start() / stop()."""
    import torch

    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _time_events(fn, warmup_ms: float, rep_ms: float) -> float:
    import torch

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


def make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, seed=0, headdim_v=None):
    """q, k, v on the GPU (v with headdim_v when given: a value head dim different from Q/K's)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim if headdim_v is None else headdim_v, generator=gen,
                    device="cuda", dtype=dtype)
    return q, k, v


def time_bwd(impl, q, k, v, causal, rep_ms, **options) -> float:
    """Milliseconds of one backward pass of impl (autograd.grad on a graph built once)."""
    import torch

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with impl.context():
        out = impl.make(qg, kg, vg, causal, **options)()
        dout = torch.randn_like(out)
        return time_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True), rep_ms=rep_ms)


# --- output files ---------------------------------------------------------------------------------

def csv_value(x, digits: int = 1):
    """A CSV field: "" for None, "nan", floats with `digits` decimals, anything else as it is."""
    if x is None:
        return ""
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}f}"
    return x


def write_rows_csv(rows, columns, path: Path, digits: dict | None = None) -> None:
    """One header line (`columns`), then one line per row dict (a missing key is an empty field);
    floats with 1 decimal unless `digits` names the column."""
    digits = digits or {}
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in rows:
            writer.writerow([csv_value(r.get(c), digits.get(c, 1)) for c in columns])


def json_safe(x):
    """NaN and infinities -> None (JSON has neither), through dicts and lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x
