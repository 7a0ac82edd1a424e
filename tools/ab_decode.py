"""A/B of the decode step's candidates on the bench's decode cells, as CUDA-graph replays (as
`python -m flash4 bench` times them: flash4.bench.varlen), against cuDNN, in one process (issue 25:
">= 1.0x cuDNN on the decode cells").

    # CPU, the exact source tree of the device run (the disk cache key hashes flash4's sources):
    python tools/ab_decode.py --precompile --cache-dir .ab_decode
    # GPU (carry .device-deps and the cache):
    source .device-deps/activate.sh && python tools/ab_decode.py --cache-dir .ab_decode --out $OUT/ab_decode.json
    python tools/ab_decode.py --dry-run      # no GPU: the cells, the variants, their configs

Cells: the bench's decode cells, decode_b{B}_{S}k for B in 1 / 8 / 64 and S in 4k / 32k / 128k keys
per sequence: one new query, 32 / 8 heads, d128, bf16, paged K/V (pages of 64, a random page table),
cache_seqlens = S, causal; flash_attn_with_kvcache (flash4) and SDPA's cuDNN backend reading the same
pool as a contiguous (B, S) cache (enable_gqa; as the bench does: no copy, the pool's own key order).
Variants (flash4; x2 / h / n<K> / the switches run on the plain combine):
  shipped    flash4 as it is (since 2026-12-06: the prefetching combine, by PDL from 4 splits)
  plain      FLASH4_DECODE_COMBINE=0: the plain combine, launched after the split kernel (before
             2026-12-06; the switches below are timed on top of it)
  pdl        FLASH4_FWD_SWITCHES=pdl_combine (FwdConfig.pdl_combine: the combine launched with
             programmatic dependent launch; split cells only, else the shipped plan)
  cp         FLASH4_FWD_SWITCHES=combine_prefetch (FwdConfig.combine_prefetch: the combine's merge
             with the LSEs in registers and several splits' loads in flight)
  pdlcp      both
  x2, h      num_splits twice / half the shipped plan's (flash4.config.choose_num_splits); clamped
             to [1, key blocks / 4]
  n<K>       num_splits=K (e.g. n16; the door clamps it to the key blocks); with --variants;
             "<switches>_n<K>" (e.g. pdlcp_n16): those switches with K splits
  cudnn      SDPA, cuDNN backend (the target)
Timing: each variant's call captured once in a CUDA graph and replayed; interleaved rounds (order
reversed every other round) of the median of L2-flushed replays (tools/ab_switch.py); KV GB/s =
K and V bytes / time. Checks (exit 1 when one fails; none on speed): plain / pdl / cp / pdlcp's out / lse bitwise
equal to shipped's; x2 / h (another split) within 1e-2 relative of shipped; every output finite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import ab_switch  # noqa: E402  (tools/ab_switch.py: timing, comparisons)

ARCH, DTYPE = 90, "bf16"
HEADS, HEADS_K, HEADDIM, PAGE = 32, 8, 128, 64  # flash4.bench.varlen's decode cells
CACHES, BATCHES = (4096, 32768, 131072), (1, 8, 64)
NUM_SMS = 132  # the H200's (the plans printed / precompiled here; the device run reads its own)
VARIANTS = ("shipped", "plain", "cudnn")  # --variants may add pdl, cp, pdlcp, x2, h, n<K>
SWITCHES = {"pdl": "pdl_combine", "cp": "combine_prefetch", "pdlcp": "pdl_combine,combine_prefetch"}
PLAIN = {"FLASH4_DECODE_COMBINE": "0"}  # the combine before 2026-12-06 (and the switches' baseline)


def cells() -> list[tuple]:
    return [(f"decode_b{b}_{s // 1024}k", b, s) for s in CACHES for b in BATCHES]


def plan(batch: int, seqlen: int, num_sms: int, switches=()):
    """flash4's decode plan of a cell (FwdPlan) with the named forward switches on."""
    from flash4.config.sm90 import (decode_combine_policy, decode_plan, gather_policy, page_divide_free_policy,
                                    page_policy, with_fwd_switches)
    import dataclasses

    p = decode_plan(batch, 1, HEADS, HEADS_K, HEADDIM, DTYPE, True, PAGE, seqlen, 0, ARCH, num_sms,
                    page_policy=page_policy(), gather_zero_fill=gather_policy(),
                    divide_free=page_divide_free_policy(), combine_policy=decode_combine_policy())
    return dataclasses.replace(p, cfg=with_fwd_switches(p.cfg, switches)) if switches else p


def splits_of(variant: str, shipped: int, seqlen: int) -> int | None:
    """The num_splits argument of a variant (None: flash4's own choice); "n<K>": K splits (the door
    clamps it to the key blocks)."""
    from flash4.config import MIN_BLOCKS_PER_SPLIT

    variant = variant.split("_")[-1]  # "pdlcp_n16": the switches of pdlcp with 16 splits
    if variant.startswith("n") and variant[1:].isdigit():
        return int(variant[1:])
    cap = max(1, seqlen // 128 // MIN_BLOCKS_PER_SPLIT)
    if variant == "x2":
        return max(1, min(cap, 2 * shipped))
    if variant == "h":
        return max(1, shipped // 2)
    return None


def plan_kernels() -> list:
    """The split kernels' configs (flash4.forward.split_kernel_config: as the doors compile them)."""
    from flash4.forward import split_kernel_config

    out = []
    for _, batch, seqlen in cells():
        for switches in ((),) + tuple(tuple(v.split(",")) for v in SWITCHES.values()):
            for plain in (False, True):
                os.environ.pop("FLASH4_DECODE_COMBINE", None)
                if plain:
                    os.environ.update(PLAIN)
                out.append(split_kernel_config(plan(batch, seqlen, NUM_SMS, switches).cfg))
            os.environ.pop("FLASH4_DECODE_COMBINE", None)
    return list(dict.fromkeys(out))


def precompile() -> int:
    from ab_fwd import precompile as fwd_precompile
    from flash4.compile.cache import get_combine_runner

    bad = fwd_precompile(plan_kernels())
    for pdl in (False, True):
        for prefetch in (False, True):
            get_combine_runner(HEADDIM, DTYPE, ARCH, pdl=pdl, prefetch=prefetch)
    return bad


def print_plan() -> None:
    for name, batch, seqlen in cells():
        p = plan(batch, seqlen, NUM_SMS)
        print(f"{name:18s} pack {p.pack} splits {p.num_splits} (x2 {splits_of('x2', p.num_splits, seqlen)}, "
              f"h {splits_of('h', p.num_splits, seqlen)})")
    for cfg in plan_kernels():
        print(f"  {cfg!r}")


# -------------------------------------------------------------------------------------------- device
def run_cell(cell, rounds: int, rep_ms: float, variants) -> dict:
    import torch

    from flash4 import flash_attn_with_kvcache
    from flash4.bench.varlen import graph_replay

    name, batch, seqlen = cell
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 1, HEADS, HEADDIM, device="cuda", generator=g, dtype=torch.bfloat16)
    npg = seqlen // PAGE
    kc = torch.randn(batch * npg, PAGE, HEADS_K, HEADDIM, device="cuda", generator=g, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(batch * npg, device="cuda", generator=g).to(torch.int32).view(batch, npg)
    lens = torch.full((batch,), seqlen, device="cuda", dtype=torch.int32)
    shipped_splits = plan(batch, seqlen, torch.cuda.get_device_properties(0).multi_processor_count).num_splits
    outs, replays = {}, {}
    for v in variants:
        if v == "cudnn":  # the pool read as a contiguous cache, as flash4.bench.varlen does (no copy)
            kt = kc.view(batch, seqlen, HEADS_K, HEADDIM).transpose(1, 2)
            vt = vc.view(batch, seqlen, HEADS_K, HEADDIM).transpose(1, 2)
            qt = q.transpose(1, 2)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def fn(qt=qt, kt=kt, vt=vt):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    outs["cudnn"] = (torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                                     .transpose(1, 2),)
        else:
            os.environ.pop("FLASH4_FWD_SWITCHES", None)
            os.environ.pop("FLASH4_DECODE_COMBINE", None)
            if v.split("_")[0] in SWITCHES:
                os.environ.update(PLAIN, FLASH4_FWD_SWITCHES=SWITCHES[v.split("_")[0]])
            elif v == "plain" or v in ("x2", "h") or v.startswith("n"):
                os.environ.update(PLAIN)
            ns = splits_of(v, shipped_splits, seqlen)

            def fn(v=v, ns=ns):
                outs[v] = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True,
                                                  num_splits=ns or 0, return_lse=True)
        replays[v] = graph_replay(fn)  # the environment is read while capturing
        os.environ.pop("FLASH4_FWD_SWITCHES", None)
        os.environ.pop("FLASH4_DECODE_COMBINE", None)
    for r in replays.values():
        r()
    torch.cuda.synchronize()
    row = {"cell": name, "batch": batch, "seqlen": seqlen, "splits": shipped_splits}
    base = outs["shipped"]
    row["finite"] = all(bool(torch.isfinite(t).all()) for v in variants for t in outs[v])
    checks = {}
    for v in variants:
        if v in ("shipped", "cudnn"):  # cudnn reads the pool in pool order: another key order
            continue
        if v in SWITCHES or v == "plain":  # the same split: the same bits
            checks[v] = all(ab_switch.same(a, b) for a, b in zip(outs[v], base))
        else:
            checks[v] = ab_switch.reldiff(outs[v][0], base[0]) <= 1e-2
    row["checks"] = checks
    ms = ab_switch.interleaved(replays, rounds, rep_ms)
    kv_bytes = 2 * batch * seqlen * HEADS_K * HEADDIM * 2
    for v, t in ms.items():
        row[f"{v}_ms"] = t
        row[f"{v}_kv_gbps"] = kv_bytes / t / 1e6
    if "cudnn" in ms:
        row.update({f"{v}/cudnn": ms["cudnn"] / ms[v] for v in ms if v != "cudnn"})
    row.update({f"{v}/shipped": ms["shipped"] / ms[v] for v in ms if v not in ("shipped", "cudnn")})
    return row


def format_row(row) -> str:
    parts = [f"{row['cell']:16s} s{row['splits']:<3d}"]
    parts += [f"{k[:-8]} {row[k]:7.1f}" for k in row if k.endswith("_kv_gbps")]
    parts += [f"{k} {row[k]:.3f}" for k in row if k.endswith("/cudnn") or k.endswith("/shipped")]
    ok = row["finite"] and all(row["checks"].values())
    return "  ".join(parts) + ("" if ok else f"  CHECK FAILED {row['checks']} finite {row['finite']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--precompile", action="store_true")
    p.add_argument("--cache-dir")
    p.add_argument("--cells", nargs="*", help="only these (decode_b1_4k, ...)")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=ab_switch.ROUNDS)
    p.add_argument("--rep-ms", type=float, default=ab_switch.REP_MS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.cache_dir:
        os.environ["FLASH4_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    if args.dry_run:
        print_plan()
        return 0
    if args.precompile:
        return precompile()
    variants = ["shipped"] + [v for v in args.variants if v != "shipped"]
    rows = []
    for cell in cells():
        if not args.cells or cell[0] in args.cells:
            rows.append(run_cell(cell, args.rounds, args.rep_ms, variants))
            print(format_row(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r["cell"] for r in rows if not (r["finite"] and all(r["checks"].values()))]
    if bad:
        print("CHECK FAILED: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
