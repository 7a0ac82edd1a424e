"""Paged K/V speed by page size (issue 29 item 2, issue 25 item 3): prefill and decode, as ratios.

    python tools/bench_pages.py [--pages 1,4,16,32,128] [--gather-max 0,32] [--rep-ms 100]

Prefill: 64k tokens in sequences of 128..16k keys (flash4.bench.varlen's lengths), causal, d128,
32 query / 8 KV heads, through flash_attn_varlen_func: contiguous (cu_seqlens_k) and paged at each
page size (random page order, page_table + seqused_k); TFLOPs and the ratio to contiguous.
Decode: batch 64 x 8k keys, one query, 32 / 8 heads, d128, through flash_attn_with_kvcache (a
CUDA graph replayed): a contiguous cache and a paged one at each page size; the K/V read rate as a
fraction of the device's copy bandwidth.
--gather-max: values of FLASH4_PAGE_GATHER_MAX to run each paged cell under (the A/B of gathered
rows against TMA page pieces for pages that are multiples of 8; pages of other sizes are always
gathered); the table shows one column per value. Needs a GPU; prints a table, writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("FLASH4_PAGE_GATHER_MAX", "0")


def _graph_ms(fn, rep_ms: float) -> float:
    import torch

    from flash4.bench import common

    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return common.time_ms(graph.replay, rep_ms=rep_ms)


def _with_gather_max(value: int, fn):
    os.environ["FLASH4_PAGE_GATHER_MAX"] = str(value)
    try:
        return fn()
    finally:
        os.environ["FLASH4_PAGE_GATHER_MAX"] = "0"


def prefill(pages, gather_maxes, rep_ms: float) -> list[list]:
    import torch

    import flash4
    from flash4.bench import common
    from flash4.bench.varlen import _paged, varlen_fwd_flops, varlen_lengths

    h, hk, d = 32, 8, 128
    lengths = varlen_lengths()
    cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device="cuda")
    total, max_s = sum(lengths), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, h, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = varlen_fwd_flops(lengths, h, d, True)
    contiguous = common.time_ms(lambda: flash4.flash_attn_varlen_func(q, k, v, cu, cu, max_s, max_s, causal=True),
                                rep_ms=rep_ms)
    base = common.tflops(flops, contiguous)
    rows = [["prefill contiguous", f"{base:.0f} TFLOPs"] + ["1.000"] * len(gather_maxes)]
    cpu_gen = torch.Generator().manual_seed(0)
    for page in pages:
        kc, vc, table, used = _paged(k, v, cu, page, cpu_gen)
        cells = []
        for gmax in gather_maxes:
            step = lambda kc=kc, vc=vc, table=table, used=used: flash4.flash_attn_varlen_func(  # noqa: E731
                q, kc, vc, cu, None, max_s, seqused_k=used, page_table=table, causal=True)
            ms = _with_gather_max(gmax, lambda: common.time_ms(step, rep_ms=rep_ms))
            cells.append(f"{common.tflops(flops, ms) / base:.3f}")
        rows.append([f"prefill page {page}", f"{_gathered(page, gather_maxes)}"] + cells)
        del kc, vc
    return rows


def decode(pages, gather_maxes, rep_ms: float, copy_gbps: float) -> list[list]:
    import torch

    import flash4

    batch, cache, h, hk, d = 64, 8192, 32, 8, 128
    kv_bytes = 2 * batch * cache * hk * d * 2
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    kd = torch.randn(batch, cache, hk, d, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    ms = _graph_ms(lambda kd=kd, vd=vd: flash4.flash_attn_with_kvcache(q, kd, vd, cache_seqlens=lens, causal=True),
                   rep_ms)
    rate = lambda t: kv_bytes / (t * 1e-3) / 1e9 / copy_gbps  # noqa: E731
    rows = [["decode contiguous", f"{rate(ms):.3f} of copy"] + [f"{rate(ms):.3f}"] * len(gather_maxes)]
    del kd, vd
    gen = torch.Generator().manual_seed(0)
    for page in pages:
        npg = cache // page
        kc = torch.randn(batch * npg, page, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(batch * npg, generator=gen).view(batch, npg).to(torch.int32).cuda()
        cells = []
        for gmax in gather_maxes:
            step = lambda kc=kc, vc=vc, table=table: flash4.flash_attn_with_kvcache(  # noqa: E731
                q, kc, vc, cache_seqlens=lens, page_table=table, causal=True)
            t = _with_gather_max(gmax, lambda: _graph_ms(step, rep_ms))
            cells.append(f"{rate(t):.3f}")
        rows.append([f"decode page {page}", f"{_gathered(page, gather_maxes)}"] + cells)
        del kc, vc
        torch.cuda.empty_cache()
    return rows


def _gathered(page: int, gather_maxes) -> str:
    return "gathered" if page % 8 else "TMA / gathered per column"


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default="1,4,16,32,128")
    p.add_argument("--gather-max", default="0,32", help="FLASH4_PAGE_GATHER_MAX values, one column each")
    p.add_argument("--rep-ms", type=float, default=100.0)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_pages: needs a CUDA GPU", file=sys.stderr)
        return 2
    from flash4.bench.varlen import _copy_gbps

    pages = [int(x) for x in args.pages.split(",")]
    gather_maxes = [int(x) for x in args.gather_max.split(",")]
    copy = _copy_gbps()
    head = ["cell", "path / base"] + [f"gather_max={g}" for g in gather_maxes]
    rows = prefill(pages, gather_maxes, args.rep_ms) + decode(pages, gather_maxes, args.rep_ms, copy)
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    print(f"device copy bandwidth {copy:.0f} GB/s; prefill: TFLOPs ratio to contiguous; decode: K/V read / copy rate")
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
