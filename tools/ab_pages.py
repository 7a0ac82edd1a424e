"""A/B of the paged prefill candidates on the H200 against the same data laid out contiguously, in
one process (issue 25 item 3: page 16 and 32 prefill >= 0.95x contiguous).

    # CPU, the exact source tree of the device run (the disk cache key hashes flash4's sources):
    # compiles every kernel of the run for sm_90a into DIR, checks each for spills (exit 1 if one
    # spills) and the size of DIR's objects:
    python tools/ab_pages.py --precompile --cache-dir .ab_pages
    # GPU (carry .device-deps and .ab_pages):
    source .device-deps/activate.sh && python tools/ab_pages.py --cache-dir .ab_pages --out $OUT/ab_pages.json
    python tools/ab_pages.py --dry-run        # no GPU, no compile: every variant's config
    # --variants NAME ...: only those (and shipped), in all three modes
    # Nsight Compute, one call per kernel (contiguous first, then each page's variants), no timing:
    ncu --clock-control none --profile-from-start off --set full -o pages \
        python tools/ab_pages.py --headdim 64 --pages 16 --variants shipped --ncu

Data (tools/bench_pages.py's prefill): 64k tokens in sequences of 128..16k keys (flash4.bench.varlen's
lengths), causal, d128 (--headdim D, --full: other cells), 32 query / 8 KV heads, bf16. "contiguous" is the varlen config on packed
K/V (cu_seqlens_k); each page size P lays the same keys into pages of P rows in random order
(page_table + seqused_k), the rows past each sequence's end in its last page set to NaN (nothing past
seqlen_k may reach a result: the check below would see it).
Variants (kernel configs, called through flash4's runner directly; the shipped defaults are untouched):
  shipped        what flash4's plan picks for the page size today (flash4.config.fwd_config)
  g              gathered rows (page_gather), zero-fill off (FLASH4_GATHER_ZERO_FILL=0); pages <= 16
  g_zf           gathered rows with gather_zero_fill (the shipped gathered path since 2026-12-02): the
                 producer zero-fills rows past seqlen_k, no zero_v_tail
  g_zf_s3        the same with 3 K/V stages (kv_stages; 229,376 + 1,024 bytes of smem at d128)
  g_cl           g_zf with gather_clamp_late (each producer thread's page-table entry clamped where the
                 gather uses it, so the look-ahead read is not waited for right after it)
  g_ps           g_zf with gather_ptr_shuffle (each producer thread forms its lookup row's 64-bit address
                 once per load; the passes shuffle it instead of redoing the address math: 234 vs 386
                 producer instructions per key block, sm_90a SASS)
  tma, tma_s3    TMA page pieces (gcd(P, 128) rows per copy), 2 / 3 K/V stages
  tma_pf         the same with the page-table look-ahead (page_prefetch), every page size
  tma_pf_s3      both, pieces of <= 32 rows
  tma_pf4, tma_pf4_s3   tma_pf / tma_pf_s3 with page_pieces_all_warps (the four producer warps issue the
                 pieces, warp w every fourth one, instead of warp 0 alone); pieces of <= 32 rows
  df / div       where shipped loads TMA pieces without page_row_shuffle: shipped with page_divide_free
                 flipped (a piece's page and row block without the run-time division where a piece is a
                 whole page; the shipped default for whole pages since 2026-12-05 night,
                 flash4.config.PAGE_DIVIDE_FREE): "div" where shipped has it (the division back), "df"
                 where it does not (pages of several pieces that shipped divides)
  dfs            pages of several pieces that shipped divides (d128 pages 48 / 96, pieces of > 32 rows,
                 one-warp pieces): shipped with page_divide_free and page_row_shuffle (each piece's row
                 block shuffled from the lane that looked it up: no division in the loop)
  nos            where shipped has page_row_shuffle (flash4.config.PAGE_ROW_SHUFFLE, since 2026-12-05
                 late night: the four-warp pieces of pages holding several, below d128 and for 8-row
                 pieces at every head dim, e.g. pages 24 / 48 / 96 at d64, page 24 at d128): shipped
                 without page_row_shuffle and page_divide_free, the kernel with the division in the piece
                 loop that FLASH4_PAGE_ROW_SHUFFLE=0 ships (where that rule gathers, d64's 8-row pieces,
                 it ships g_zf instead); no df / div / dfs / s3 there
  s3             shipped with 3 K/V stages where shipped loads whole pages by TMA pieces without the
                 division on 2 stages (pages 16 / 32: the four-warp pieces)
  tma_pf4_df     where shipped gathers a multiple of 8 of pieces of < 16 rows (the small-piece rule,
                 8-row pieces below d128: FLASH4_PAGE_ROW_SHUFFLE=0 or FLASH4_PAGE_DIVIDE_FREE=0; by
                 default, since 2026-12-05 late night, these pages ship this config): the four-warp
                 pieces without the division (page_divide_free on whole pages, page_row_shuffle on pages
                 of several pieces), the rule's A/B
Gathered kernels do not depend on the page size (one compile serves every P). A third candidate,
64-bit row addresses shuffled per pass ("row offsets"), was removed after the H200 run of
2026-12-02 night gave wrong results (docs/design/small_pages.md).
Timing: per page size, ROUNDS interleaved rounds over contiguous + that page's variants (order
reversed every other round), each the median of calls (flash4.bench.common.time_ms); the table gives
TFLOPs (4 H D * visible pairs) and variant / contiguous = contiguous ms / variant ms (target >= 0.95).
Check (exit 1 when one fails; none on speed): each variant's out and lse (NaN-poisoned buffers, first
call) bitwise equal to the contiguous run's. The math is the same (same tiles, same key blocks in the
same order, keys past seqlen_k masked and their V rows zero in both), so bitwise is the claim, not a
tolerance; the max relative difference is printed too.
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

HEADDIM, NHEADS, NHEADS_K, DTYPE, CAUSAL = 128, 32, 8, "bf16", True
DEFAULT_HEADDIM = HEADDIM  # --headdim's default (set_cell changes HEADDIM)
PAGES = (16, 32, 64, 128)
ROUNDS, REP_MS = 5, 100.0


# ---------------------------------------------------------------------------------------------- plan
def set_cell(headdim: int, causal: bool) -> None:
    """The cell of this run (--headdim, --full): the module's HEADDIM and CAUSAL."""
    global HEADDIM, CAUSAL
    HEADDIM, CAUSAL = int(headdim), bool(causal)


def base_config():
    from flash4.config import select_fwd_config

    return select_fwd_config(HEADDIM, DTYPE, CAUSAL)


def contiguous_config():
    from flash4.config import with_seq_layout

    return with_seq_layout(base_config(), varlen_q=True, varlen_k=True)


def shipped_config(page: int, headdim: int | None = None, causal: bool | None = None, nheads: int = NHEADS,
                   nheads_k: int = NHEADS_K):
    """flash4's plan for this page size (the door's config: the env switches and defaults apply), for
    this run's cell unless headdim / causal / heads are given (tests/cpu/test_paged_prefill_compile.py)."""
    import torch

    from flash4.config import fwd_config
    from flash4.request import Request

    headdim = HEADDIM if headdim is None else headdim
    causal = CAUSAL if causal is None else causal
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(1024, nheads, headdim, **meta)
    kc = torch.empty(64, page, nheads_k, headdim, **meta)
    i32 = dict(device="meta", dtype=torch.int32)
    request = Request.varlen(q, kc, torch.empty_like(kc), torch.empty(5, **i32), None, 512, None,
                             seqused_k=torch.empty(4, **i32), page_table=torch.empty(4, 16, **i32), causal=causal)
    return fwd_config(request, 90).cfg


def variants(page: int, only=None) -> dict:
    """{name: FwdConfig} of one page size, "shipped" first (module docstring); only: the names to keep
    (None: all; "shipped" is always kept)."""
    from flash4.config import SMALL_PIECE_ROWS, paged_page_rows, with_seq_layout

    paged = dict(varlen_q=True, seqused_k=True)
    base = base_config()

    def gathered(zero_fill, stages=2, clamp_late=False, ptr_shuffle=False):
        return with_seq_layout(base, **paged, page_gather=True, gather_zero_fill=zero_fill, kv_stages=stages,
                               gather_clamp_late=clamp_late, gather_ptr_shuffle=ptr_shuffle)

    def tma(prefetch, stages=2, all_warps=False):
        return with_seq_layout(base, **paged, page_rows=paged_page_rows(page, base.tile_n), page_prefetch=prefetch,
                               kv_stages=stages, page_pieces_all_warps=all_warps)

    out = {"shipped": shipped_config(page)}
    if out["shipped"].page_row_shuffle:  # shuffled (PAGE_ROW_SHUFFLE): "nos", the division in the piece loop
        out["nos"] = dataclasses.replace(out["shipped"], page_divide_free=False, page_row_shuffle=False)
    elif out["shipped"].page_rows:  # page_divide_free flipped: "div" where shipped has it, else "df"
        on = out["shipped"].page_divide_free
        out["div" if on else "df"] = dataclasses.replace(out["shipped"], page_divide_free=not on)
        if out["shipped"].page_rows < page:  # pages of several pieces: the row block shuffled too
            out["dfs"] = dataclasses.replace(out["shipped"], page_divide_free=True, page_row_shuffle=True)
        if on and out["shipped"].kv_stages < 3:  # the shipped whole-page pieces with a third K/V stage
            out["s3"] = dataclasses.replace(out["shipped"], kv_stages=3)
    elif out["shipped"].page_gather and page % 8 == 0 and paged_page_rows(page, base.tile_n) < SMALL_PIECE_ROWS:
        # gathered by the small-piece rule (8-row pieces below d128; since 2026-12-05 late night only with
        # FLASH4_PAGE_ROW_SHUFFLE=0 or FLASH4_PAGE_DIVIDE_FREE=0): the four-warp pieces without the
        # division, the rule's A/B since page_divide_free (what the default ships for these pages now)
        pieces = tma(True, all_warps=True)
        out["tma_pf4_df"] = dataclasses.replace(pieces, page_divide_free=True,
                                                page_row_shuffle=pieces.page_rows < page)
    if page <= 16:
        out.update(g=gathered(False))
    out.update(g_zf=gathered(True), g_zf_s3=gathered(True, 3), g_cl=gathered(True, clamp_late=True),
               g_ps=gathered(True, ptr_shuffle=True))
    out.update(tma=tma(False), tma_s3=tma(False, 3), tma_pf=tma(True))
    if paged_page_rows(page, base.tile_n) <= 32:
        out.update(tma_pf_s3=tma(True, 3), tma_pf4=tma(True, all_warps=True), tma_pf4_s3=tma(True, 3, all_warps=True))
    if only is not None:
        out = {name: cfg for name, cfg in out.items() if name == "shipped" or name in only}
    return out


def plan_configs(pages=PAGES, only=None) -> list:
    """Every kernel config the run loads, without duplicates, in a fixed order."""
    out = [contiguous_config()]
    for page in pages:
        out += list(variants(page, only).values())
    return list(dict.fromkeys(out))


def short(cfg) -> str:
    if cfg.page_gather:
        bits = ["gather"] + (["gather_zero_fill"] if cfg.gather_zero_fill else []) + (
            ["clamp_late"] if cfg.gather_clamp_late else []) + (["ptr_shuffle"] if cfg.gather_ptr_shuffle else [])
    elif cfg.page_rows:
        bits = [f"tma pieces {cfg.page_rows}"] + (["prefetch"] if cfg.page_prefetch else []) + (
            ["four warps"] if cfg.page_pieces_all_warps else []) + (["divide-free"] if cfg.page_divide_free else []) + (
            ["row shuffle"] if cfg.page_row_shuffle else [])
    else:
        bits = ["contiguous"]
    return " ".join(bits + [f"stages {cfg.kv_stages}"])


def print_plan(pages, only=None) -> None:
    print(f"prefill: 64k tokens varlen, {'causal' if CAUSAL else 'full'}, d{HEADDIM}, {NHEADS}/{NHEADS_K} heads, {DTYPE}")
    print(f"  contiguous: {short(contiguous_config())}")
    for page in pages:
        for name, cfg in variants(page, only).items():
            print(f"  page {page:4d} {name:12s} {short(cfg)}  (smem {cfg.smem_bytes()} B)")
    print(f"{len(plan_configs(pages, only))} kernels")


# ------------------------------------------------------------------------------------------- compile
def precompile(pages, only=None) -> int:
    """Compile every kernel of the run into the disk cache (no GPU); 1 if one spills."""
    from flash4 import env
    from flash4.compile import cache
    from flash4.compile.check import compile_check

    t0 = time.perf_counter()
    configs = plan_configs(pages, only)
    rows = compile_check(configs, compiler=lambda cfg: _compile_and_store(cache, cfg))
    bad = 0
    for cfg, row in zip(configs, rows):
        ok = row["ok"] and not row.get("spills")
        bad += not ok
        print(f"  {'ok ' if ok else 'BAD'} {short(cfg):40s} regs {row.get('registers')} spills {row.get('spills')} "
              f"ldgsts {row.get('ldgsts')} {row.get('error') or ''}")
    where = env.disk_cache_dir()
    size = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where) if f.endswith(".o"))
    print(f"precompiled {len(configs)} kernels in {time.perf_counter() - t0:.0f} s; {where}: "
          f"{size / 2**20:.2f} MiB of objects")
    return 1 if bad else 0


def _compile_and_store(cache, cfg):
    """Compile cfg through cache.get_fwd_runner (which stores it in the disk cache) and return the
    compiled module for compile_check's SASS (cache.compile_fwd recorded on the way; compiled a second
    time only when the disk cache already held the kernel)."""
    got, original = [], cache.compile_fwd

    def recording(*args, **kwargs):
        got.append(original(*args, **kwargs))
        return got[-1]

    cache.compile_fwd = recording  # get_fwd_runner looks compile_fwd up at call time
    try:
        cache.get_fwd_runner(cfg)
    finally:
        cache.compile_fwd = original
    return got[-1] if got else original(cfg)


# ------------------------------------------------------------------------------------------- GPU run
def paged_pool(k, v, cu, page: int, gen, fill=math.nan):
    """K/V of each sequence laid into pages of `page` rows in random page order: (k_cache, v_cache,
    page_table, seqused_k); the rows of a last page past its sequence's end hold `fill`."""
    import torch

    lengths = (cu[1:] - cu[:-1]).tolist()
    npages = [-(-n // page) for n in lengths]
    perm = torch.randperm(sum(npages), generator=gen).to(k.device)
    kc = torch.full((sum(npages), page) + tuple(k.shape[1:]), fill, dtype=k.dtype, device=k.device)
    vc = torch.full_like(kc, fill)
    table = torch.zeros(len(lengths), max(npages), dtype=torch.int32, device=k.device)
    j = 0
    for b, (n, npg) in enumerate(zip(lengths, npages)):
        idx = perm[j:j + npg]
        j += npg
        table[b, :npg] = idx.to(torch.int32)
        start = int(cu[b])
        for name, src, dst in (("k", k, kc), ("v", v, vc)):
            rows = torch.full((npg * page,) + tuple(src.shape[1:]), fill, dtype=src.dtype, device=src.device)
            rows[:n] = src[start:start + n]
            dst[idx] = rows.view(npg, page, *src.shape[1:])
    return kc, vc, table, (cu[1:] - cu[:-1]).to(torch.int32)


def same(a, b) -> bool:
    import torch

    as_int = {2: torch.int16, 4: torch.int32}
    return a.shape == b.shape and bool(torch.equal(a.view(as_int[a.element_size()]), b.view(as_int[b.element_size()])))


def reldiff(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().nan_to_num(math.inf).max() / b.abs().max().clamp_min(1e-30))


def profile_once(fns: dict) -> None:
    """--ncu: each function warmed up three times, then called once between
    torch.cuda.profiler.start() / stop() (ncu --profile-from-start off sees one launch per function, in
    the order of fns: contiguous first)."""
    from flash4.bench.common import profile_one_call

    for name, fn in fns.items():
        profile_one_call(fn)
        print(f"  profiled {name}", flush=True)


def run(pages, rounds: int, rep_ms: float, only=None, ncu: bool = False) -> list[dict]:
    import torch

    from flash4.bench import common
    from flash4.bench.varlen import itertools_accumulate, varlen_fwd_flops, varlen_lengths
    from flash4.compile.cache import get_fwd_runner

    lengths = varlen_lengths()
    total, max_s = sum(lengths), max(lengths)
    cu = torch.tensor([0] + list(itertools_accumulate(lengths)), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, NHEADS, HEADDIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, NHEADS_K, HEADDIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = varlen_fwd_flops(lengths, NHEADS, HEADDIM, CAUSAL)
    scale = HEADDIM ** -0.5
    batch = len(lengths)

    def call(cfg, kx, vx, seqs):
        runner = get_fwd_runner(cfg)
        out = torch.full((1, total, NHEADS, HEADDIM), math.nan, device="cuda", dtype=torch.bfloat16)
        lse = torch.full((1, NHEADS, total), math.nan, device="cuda", dtype=torch.float32)
        split = torch.full((2, 1, NHEADS, total), math.nan, device="cuda", dtype=torch.float32)

        def fn():
            runner(q.unsqueeze(0), kx, vx, out, lse, scale, split, seqs=seqs, batch=batch, max_seqlen_q=max_s)
        return fn, (out, lse)

    contiguous, ref = call(contiguous_config(), k.unsqueeze(0), v.unsqueeze(0), (cu, cu, None, None, None))
    contiguous()
    torch.cuda.synchronize()
    rows = []
    cpu_gen = torch.Generator().manual_seed(0)
    for page in pages:
        kc, vc, table, used = paged_pool(k, v, cu, page, cpu_gen)
        seqs = (cu, None, None, used, table)
        row = {"page": page, "variants": {}}
        fns = {"contiguous": contiguous}
        for name, cfg in variants(page, only).items():
            fn, outs = call(cfg, kc, vc, seqs)
            fn()
            torch.cuda.synchronize()
            row["variants"][name] = {"config": short(cfg), "out_bitwise": same(outs[0], ref[0]),
                                     "lse_bitwise": same(outs[1], ref[1]), "out_reldiff": reldiff(outs[0], ref[0])}
            fns[name] = fn
        if ncu:
            profile_once(fns if page == pages[0] else {k: f for k, f in fns.items() if k != "contiguous"})
            rows.append(row)
            continue
        names = list(fns)
        times = {name: [] for name in names}
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                times[name].append(common.time_ms(fns[name], rep_ms=rep_ms))
        ms = {name: statistics.median(ts) for name, ts in times.items()}
        row["contiguous_tflops"] = common.tflops(flops, ms["contiguous"])
        for name in row["variants"]:
            row["variants"][name].update(tflops=common.tflops(flops, ms[name]),
                                         vs_contiguous=ms["contiguous"] / ms[name])
        rows.append(row)
        print(format_row(row), flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    return rows


def format_row(row: dict) -> str:
    lines = [f"page {row['page']}: contiguous {row['contiguous_tflops']:.0f} TF"]
    for name, x in row["variants"].items():
        check = "bitwise" if x["out_bitwise"] and x["lse_bitwise"] else f"NOT bitwise (out reldiff {x['out_reldiff']:.1e})"
        met = "met" if x["vs_contiguous"] >= 0.95 else "-"
        lines.append(f"  {name:12s} {x['tflops']:6.0f} TF  {x['vs_contiguous']:.3f}x contiguous ({met})  {check}  "
                     f"[{x['config']}]")
    return "\n".join(lines)


def failures(rows) -> list[str]:
    return [f"page {row['page']} {name}" for row in rows for name, x in row["variants"].items()
            if not (x["out_bitwise"] and x["lse_bitwise"])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default=",".join(map(str, PAGES)), help="page sizes, comma-separated")
    p.add_argument("--precompile", action="store_true", help="compile every kernel into the cache (CPU)")
    p.add_argument("--cache-dir", help="flash4's disk cache directory (FLASH4_CACHE_DIR) for this run")
    p.add_argument("--dry-run", action="store_true", help="print the variants' configs only")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--rep-ms", type=float, default=REP_MS)
    p.add_argument("--out", help="JSON file for the rows")
    p.add_argument("--variants", nargs="+", help="the variants to run (default all; shipped always)")
    p.add_argument("--headdim", type=int, default=DEFAULT_HEADDIM, help=f"head dim (default {DEFAULT_HEADDIM})")
    p.add_argument("--full", action="store_true", help="no causal mask (default causal)")
    p.add_argument("--ncu", action="store_true",
                   help="no timing: one profiled call per kernel (contiguous, then each page's variants), for "
                        "ncu --profile-from-start off")
    args = p.parse_args(argv)
    set_cell(args.headdim, not args.full)
    pages = tuple(int(x) for x in args.pages.split(","))
    only = args.variants
    if only is not None:
        known = {name for page in pages for name in variants(page)}
        unknown = sorted(set(only) - known)
        if unknown:
            p.error(f"--variants: unknown {unknown}; these pages have {sorted(known)}")
    if args.cache_dir:
        os.environ["FLASH4_CACHE_DIR"] = os.path.abspath(args.cache_dir)
        os.environ.pop("FLASH4_CACHE", None)
    if args.dry_run:
        print_plan(pages, only)
        return 0
    if args.precompile:
        print_plan(pages, only)
        return precompile(pages, only)
    import torch

    if not torch.cuda.is_available():
        print("ab_pages: needs a CUDA GPU (or --precompile / --dry-run)", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}; d{HEADDIM} {'causal' if CAUSAL else 'full'}, {NHEADS}/{NHEADS_K} heads; "
          f"rounds {args.rounds}, rep {args.rep_ms} ms")
    t0 = time.perf_counter()
    rows = run(pages, args.rounds, args.rep_ms, only, ncu=args.ncu)
    if args.ncu:
        bad = failures(rows)
        print("profiled; " + ("bitwise" if not bad else "NOT bitwise: " + ", ".join(bad)))
        return 1 if bad else 0
    bad = failures(rows)
    print(f"\n{time.perf_counter() - t0:.0f} s; " + ("all variants bitwise equal to contiguous" if not bad else
                                                      "NOT bitwise: " + ", ".join(bad)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
