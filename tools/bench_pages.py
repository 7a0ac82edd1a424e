"""Paged K/V speed by page size (issue 29 item 2, issue 25 item 3), flash4 and (--fa4) flash-attn-4.

    python tools/bench_pages.py [--pages 1,4,16,32,128] [--gather-max default,0,32] [--fa4] [--rep-ms 100]
                                [--rounds 3] [--out DIR]

Prefill: 64k tokens in sequences of 128..16k keys (flash4.bench.varlen's lengths), causal, d128,
32 query / 8 KV heads, through flash_attn_varlen_func: contiguous (cu_seqlens_k) and paged at each
page size (random page order, page_table + seqused_k); TFLOPs.
Decode: batch 64 x 8k keys, one query, 32 / 8 heads, d128, a CUDA graph replayed: flash4's
flash_attn_with_kvcache on a contiguous cache and a paged one at each page size; the K/V read rate
as a fraction of the device's copy bandwidth.
--fa4: flash-attn-4 (flash_attn.cute.flash_attn_varlen_func, imported only then, through
flash4.bench.baselines) on the same tensors in the same process: prefill with cu_seqlens_q +
page_table + seqused_k, decode with q (64, 1, 32, 128) + page_table + seqused_k (a contiguous
(64, 8k, 8, 128) cache + seqused_k for the contiguous row), graph-replayed as flash4's. A page size
flash-attn-4 rejects (any exception) is printed as "refused", not fatal.
--gather-max: values of FLASH4_PAGE_GATHER_MAX to run flash4's paged cells under, one row each
("default" = unset, flash4.config.PAGE_GATHER_MAX; 0 = TMA page pieces for every multiple of 8).
The table: per page size, flash4 and flash-attn-4 (TFLOPs; decode: read / copy rate), flash4 / FA4,
flash4 / flash4's own contiguous row, and issue 29's targets (prefill at pages 1 and 4 >= 1.0x
flash-attn-4 at the same page size and >= 0.85x flash4 contiguous; decode >= 0.87 of copy bandwidth).
--out DIR: also writes DIR/bench_pages.csv (one line per measurement) and DIR/bench_pages.txt (the
table). Needs a GPU (exits 2 without one).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys

COLUMNS = ("pass", "page", "gather_max", "impl", "tflops", "kv_gbps", "copy_gbps", "note")
PREFILL_TARGET_PAGES = (1, 4)
PREFILL_VS_FA4, PREFILL_VS_CONTIGUOUS, DECODE_OF_COPY = 1.0, 0.85, 0.87  # issue 29's targets


@contextlib.contextmanager
def _gather_max(value: str):
    """FLASH4_PAGE_GATHER_MAX = value inside ("default": unset); the caller's setting restored."""
    old = os.environ.pop("FLASH4_PAGE_GATHER_MAX", None)
    if value != "default":
        os.environ["FLASH4_PAGE_GATHER_MAX"] = value
    try:
        yield
    finally:
        os.environ.pop("FLASH4_PAGE_GATHER_MAX", None)
        if old is not None:
            os.environ["FLASH4_PAGE_GATHER_MAX"] = old


def _attempt(label: str, fn) -> tuple:
    """(fn(), "") or (None, "refused: <error>") when it raises (printed to stderr)."""
    import torch

    try:
        return fn(), ""
    except Exception as err:  # noqa: BLE001 - a page size an impl rejects is a cell, not a crash
        if isinstance(err, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        text = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        print(f"{label}: refused ({type(err).__name__}: {text})", file=sys.stderr)
        return None, f"refused: {type(err).__name__}: {text}"


def _graph_ms(fn, rep_ms: float, rounds: int = 1) -> tuple[float, str]:
    """(median ms of fn captured in a CUDA graph and replayed, over `rounds` timings, ""); fn's own error (a refused page size)
    propagates; a failed capture is timed eagerly instead, with the note "eager"."""
    import torch

    from flash4.bench import common
    from flash4.bench.varlen import graph_replay

    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    try:
        replay = graph_replay(fn, warmup=False)
    except Exception as err:  # noqa: BLE001
        print(f"CUDA graph capture failed ({type(err).__name__}); timed eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        return _median_of(rounds, lambda: common.time_ms(fn, rep_ms=rep_ms)), "eager"
    return _median_of(rounds, lambda: common.time_ms(replay, rep_ms=rep_ms)), ""


def _median_of(rounds: int, fn) -> float:
    """The median of `rounds` calls of fn (each a timing in ms): one slow pass of a cell (a clock dip,
    a neighbour on the machine) no longer decides its row."""
    return statistics.median(fn() for _ in range(max(1, rounds)))


def prefill(pages, gather_maxes, rep_ms: float, fa4, rounds: int = 1) -> list[dict]:
    import torch

    import flash4
    from flash4.bench import common
    from flash4.bench.varlen import _paged, itertools_accumulate, varlen_fwd_flops, varlen_lengths

    h, hk, d = 32, 8, 128
    lengths = varlen_lengths()
    cu = torch.tensor([0] + list(itertools_accumulate(lengths)), dtype=torch.int32, device="cuda")
    total, max_s = sum(lengths), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, h, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = varlen_fwd_flops(lengths, h, d, True)
    rows = []

    def cell(impl, page, gmax, step):
        ms, note = _attempt(f"prefill {impl} page {page or 'contiguous'}",
                            lambda: _median_of(rounds, lambda: common.time_ms(step, rep_ms=rep_ms)))
        rows.append({"pass": "prefill", "page": page, "gather_max": gmax, "impl": impl,
                     "tflops": common.tflops(flops, ms) if ms else math.nan, "note": note})

    cell("flash4", 0, "", lambda: flash4.flash_attn_varlen_func(q, k, v, cu, cu, max_s, max_s, causal=True))
    if fa4:
        cell("fa4", 0, "", lambda: fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_s,
                                       max_seqlen_k=max_s, causal=True))
    cpu_gen = torch.Generator().manual_seed(0)
    for page in pages:
        kc, vc, table, used = _paged(k, v, cu, page, cpu_gen)
        for gmax in gather_maxes:
            with _gather_max(gmax):
                cell("flash4", page, gmax, lambda: flash4.flash_attn_varlen_func(
                    q, kc, vc, cu, None, max_s, max_s, seqused_k=used, page_table=table, causal=True))
        if fa4:
            cell("fa4", page, "", lambda: fa4(q, kc, vc, cu_seqlens_q=cu, max_seqlen_q=max_s, max_seqlen_k=max_s,
                                              seqused_k=used, page_table=table, causal=True))
        del kc, vc
        torch.cuda.empty_cache()
    return rows


def decode(pages, gather_maxes, rep_ms: float, fa4, rounds: int = 1) -> list[dict]:
    import torch

    import flash4

    batch, cache, h, hk, d = 64, 8192, 32, 8, 128
    kv_bytes = 2 * batch * cache * hk * d * 2
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    rows = []

    def cell(impl, page, gmax, step):
        timed, note = _attempt(f"decode {impl} page {page or 'contiguous'}", lambda: _graph_ms(step, rep_ms, rounds))
        ms, eager = timed or (None, "")
        rows.append({"pass": "decode", "page": page, "gather_max": gmax, "impl": impl,
                     "kv_gbps": kv_bytes / (ms * 1e-3) / 1e9 if ms else math.nan, "note": note or eager})

    kd = torch.randn(batch, cache, hk, d, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    cell("flash4", 0, "", lambda: flash4.flash_attn_with_kvcache(q, kd, vd, cache_seqlens=lens, causal=True))
    if fa4:
        cell("fa4", 0, "", lambda: fa4(q, kd, vd, max_seqlen_k=cache, seqused_k=lens, causal=True))
    del kd, vd
    gen = torch.Generator().manual_seed(0)
    for page in pages:
        npg = -(-cache // page)  # the last page part-filled when page does not divide the cache
        kc = torch.randn(batch * npg, page, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(batch * npg, generator=gen).view(batch, npg).to(torch.int32).cuda()
        for gmax in gather_maxes:
            with _gather_max(gmax):
                cell("flash4", page, gmax, lambda: flash4.flash_attn_with_kvcache(
                    q, kc, vc, cache_seqlens=lens, page_table=table, causal=True))
        if fa4:
            cell("fa4", page, "", lambda: fa4(q, kc, vc, max_seqlen_k=cache, seqused_k=lens, page_table=table,
                                              causal=True))
        del kc, vc
        torch.cuda.empty_cache()
    return rows


def table(records: list[dict], copy_gbps: float) -> list[list[str]]:
    """The printed table (header first) of prefill() / decode() records; pure (tested on the CPU)."""
    head = ["cell", "flash4", "FA4", "flash4/FA4", "flash4/contiguous", "issue 29 target"]
    value = lambda r: r["tflops"] if r["pass"] == "prefill" else r["kv_gbps"] / copy_gbps  # noqa: E731
    lines = [head]
    for kind in ("prefill", "decode"):
        mine = [r for r in records if r["pass"] == kind]
        fa4 = {r["page"]: r for r in mine if r["impl"] == "fa4"}
        base = next((value(r) for r in mine if r["impl"] == "flash4" and r["page"] == 0), math.nan)
        for r in (r for r in mine if r["impl"] == "flash4"):
            f4, other = value(r), fa4.get(r["page"])
            theirs = value(other) if other else math.nan
            vs_fa4, vs_base = f4 / theirs, f4 / base
            label = f"{kind} " + (f"page {r['page']}" if r["page"] else "contiguous")
            if r["gather_max"] not in ("", "default"):
                label += f" gather_max={r['gather_max']}"
            lines.append([label, _num(f4, r, kind), _num(theirs, other, kind) if other else "-",
                          _num(vs_fa4, None), _num(vs_base, None), _target(kind, r["page"], f4, vs_fa4, vs_base)])
    return lines


def _num(x: float, record, kind: str = "ratio") -> str:
    if record is not None and record.get("note", "").startswith("refused"):
        return "refused"
    if x != x:  # NaN
        return "-"
    eager = " (eager)" if record is not None and record.get("note") == "eager" else ""
    return (f"{x:.0f}" if kind == "prefill" else f"{x:.3f}") + eager


def _target(kind: str, page: int, f4: float, vs_fa4: float, vs_base: float) -> str:
    if kind == "decode":
        return "met" if f4 >= DECODE_OF_COPY else f"MISSED (< {DECODE_OF_COPY} of copy)"
    if page not in PREFILL_TARGET_PAGES:
        return "-"
    missed = []
    if not vs_fa4 >= PREFILL_VS_FA4:  # NaN (FA4 refused or not run) is not met
        missed.append(f"{PREFILL_VS_FA4}x FA4")
    if not vs_base >= PREFILL_VS_CONTIGUOUS:
        missed.append(f"{PREFILL_VS_CONTIGUOUS}x contiguous")
    return "met" if not missed else "MISSED (< " + ", < ".join(missed) + ")"


def format_table(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def write_outputs(out_dir: str, records: list[dict], copy_gbps: float, text: str) -> None:
    from flash4.bench import common

    os.makedirs(out_dir, exist_ok=True)
    common.write_rows_csv([dict(r, copy_gbps=copy_gbps) for r in records], COLUMNS,
                          os.path.join(out_dir, "bench_pages.csv"))
    with open(os.path.join(out_dir, "bench_pages.txt"), "w") as f:
        f.write(text + "\n")


def _fa4_func():
    """flash-attn-4's flash_attn_varlen_func (imported here only, through flash4.bench.baselines)."""
    from flash4.bench import baselines

    fn = baselines.fa4_varlen_func()
    if fn is None:
        raise SystemExit(f"bench_pages: --fa4 needs flash-attn-4 ({baselines.FA4_IMPORT_ERROR})")
    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default="1,4,16,32,128", help="page sizes (rows), comma-separated")
    p.add_argument("--gather-max", default="default",
                   help="FLASH4_PAGE_GATHER_MAX values for flash4's paged rows, e.g. default,0,32")
    p.add_argument("--fa4", action="store_true", help="time flash-attn-4 on the same data (flash_attn.cute)")
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=3, help="timings per cell, the median kept (default 3)")
    p.add_argument("--out", help="directory for bench_pages.csv and bench_pages.txt")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_pages: needs a CUDA GPU", file=sys.stderr)
        return 2
    from flash4.bench.varlen import _copy_gbps

    pages = [int(x) for x in args.pages.split(",")]
    gather_maxes = [x.strip() for x in args.gather_max.split(",")]
    fa4 = _fa4_func() if args.fa4 else None
    copy = _copy_gbps()
    records = (prefill(pages, gather_maxes, args.rep_ms, fa4, args.rounds)
               + decode(pages, gather_maxes, args.rep_ms, fa4, args.rounds))
    text = (f"{torch.cuda.get_device_name()}; copy bandwidth {copy:.0f} GB/s; prefill: TFLOPs; "
            f"decode: K/V read rate / copy rate\n" + format_table(table(records, copy)))
    print(text)
    if args.out:
        write_outputs(args.out, records, copy, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
