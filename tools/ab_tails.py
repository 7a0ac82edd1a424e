"""What issue 25's guards against memory past a sequence's end cost, measured in one process on the
decode and varlen cells (issue 25 item 1: "no measurable cost in the sweep and decode cells, shown in
the same run"). The sweep's dense cells compile none of the guards (byte-identical cubins,
docs/design/fwd_kv_tail.md / bwd_tail.md), so only ragged layouts are timed here.

    # CPU, the exact source tree of the device run (the disk cache key hashes flash4's sources):
    python tools/ab_tails.py --precompile --cache-dir .ab_tails
    # GPU (carry .device-deps and the cache):
    source .device-deps/activate.sh && python tools/ab_tails.py --cache-dir .ab_tails --out $OUT/ab_tails.json
    python tools/ab_tails.py --dry-run      # no GPU: the cells and the configs of both variants

Variants per cell: "shipped" (the guards in), "unguarded" (FLASH4_FWD_SWITCHES / FLASH4_BWD_SWITCHES
=no_tail_guard: FwdConfig / BwdConfig.no_tail_guard, an A/B-only switch: no zero_v_tail, ragged query
rows vote for the exact path; no zero_kv_tail / zero_q_tail in the backward). Both variants set the
environment variable on every call (the same host work); the doors read it per call.
Cells (bf16, d128; cache lengths 37 short of a key tile so the last block is partial and the V tail
is zeroed on every tile):
  decode_b{B}_{S}k   flash_attn_with_kvcache, one new query, 32 / 8 heads, contiguous cache of S keys
                     per sequence (cache_seqlens = S - 37), split-KV as flash4 picks it
  decode_paged64_b8_32k  the same with pages of 64 (TMA page pieces)
  decode_paged16_b8_32k  the same with pages of 16 (gathered rows; e.g. --env
                     FLASH4_FWD_SWITCHES=gather_ptr_shuffle times that candidate on the decode step)
  varlen_{fwd,bwd}   issue 9's packed training batch (65,536 tokens, lengths 128..16k, causal, 16
                     heads): flash4.forward.run / flash4.backward.run of the packed request
  paged128_fwd       the same batch in pages of 128 (seqused_k, TMA pieces), forward
Timing as tools/ab_switch.py (interleaved rounds, median of L2-flushed calls, order reversed every
other round); unguarded/shipped = shipped ms / unguarded ms (> 1: the guards cost that much).
Checks (exit 1 when one fails; none on speed): on clean memory both variants' outputs (out, lse;
dk, dv) equal bit for bit, dq (atomic adds in any order) within 1e-2 relative, all finite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import ab_switch  # noqa: E402  (tools/ab_switch.py: timing, comparisons)

ARCH, DTYPE, HEADDIM = 90, "bf16", 128
NUM_SMS = 132  # the H200's (the decode plan's split count; the device run reads its own)
SHORT = 37  # keys short of a full last tile
SWITCH = "no_tail_guard"
# the second variant's environment (--env NAME=VALUE replaces it, e.g. FLASH4_PAGE_PREFETCH=0: any plan
# variable the doors read per call) and its name
ALT = {"FLASH4_FWD_SWITCHES": SWITCH, "FLASH4_BWD_SWITCHES": SWITCH}
ALT_NAME = "unguarded"
DECODE = (("decode_b1_128k", 1, 131072, 0), ("decode_b8_32k", 8, 32768, 0), ("decode_b8_4k", 8, 4096, 0),
          ("decode_paged64_b8_32k", 8, 32768, 64), ("decode_paged16_b8_32k", 8, 32768, 16))
VARLEN = ("varlen_fwd", "varlen_bwd", "paged128_fwd")


def cells() -> list[str]:
    return [c[0] for c in DECODE] + list(VARLEN)


# ---------------------------------------------------------------------------------------------- plan
class _Env:
    """Within `with _Env(variant):` the environment of the variant ("shipped": ALT's names unset)."""

    def __init__(self, variant: str):
        self.variant, self.saved = variant, {}

    def __enter__(self):
        self.saved = {name: os.environ.get(name) for name in ALT}
        _set(self.variant)
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def decode_cfg(cell):
    """The decode step's forward config (flash4's plan under the current environment)."""
    from flash4.config.sm90 import decode_plan, gather_policy, page_divide_free_policy, page_policy

    _, batch, seqlen, page = cell
    plan = decode_plan(batch, 1, 32, 8, HEADDIM, DTYPE, False, page, seqlen, 0, ARCH, NUM_SMS,
                       page_policy=page_policy(), gather_zero_fill=gather_policy(),
                       divide_free=page_divide_free_policy())
    from flash4 import env
    from flash4.config.sm90 import with_fwd_switches

    return with_fwd_switches(plan.cfg, env.fwd_switches())


def varlen_request(page: int = 0, tensors=None):
    """The packed training batch's Request (meta tensors without `tensors`)."""
    import torch

    from flash4.bench.varlen import varlen_lengths
    from flash4.request import Request

    lengths = varlen_lengths()
    if tensors is None:
        total = sum(lengths)
        q = torch.empty(total, 16, HEADDIM, device="meta", dtype=torch.bfloat16)
        cu = torch.empty(len(lengths) + 1, device="meta", dtype=torch.int32)
        if page:
            pages = sum(-(-n // page) for n in lengths)
            kc = torch.empty(pages, page, 16, HEADDIM, device="meta", dtype=torch.bfloat16)
            table = torch.empty(len(lengths), max(-(-n // page) for n in lengths), device="meta", dtype=torch.int32)
            used = torch.empty(len(lengths), device="meta", dtype=torch.int32)
            tensors = (q, kc, kc, cu, used, table)
        else:
            tensors = (q, q, q, cu, None, None)
    q, k, v, cu, used, table = tensors
    m = max(lengths)  # paged: the keys of sequence b are its first seqused_k[b] rows of its pages
    return Request.varlen(q, k, v, cu, cu if table is None else None, m, m, None, used, table,
                          softmax_scale=HEADDIM ** -0.5, causal=True)


def plan_kernels() -> list[tuple]:
    """(kind, cfg) of every main kernel both variants load, without duplicates."""
    from flash4.config import bwd_config, fwd_config

    out = []
    for variant in ("shipped", ALT_NAME):
        with _Env(variant):
            out += [("fwd", decode_cfg(cell)) for cell in DECODE]
            out += [("fwd", fwd_config(varlen_request(page), ARCH).cfg) for page in (0, 128)]
            out += [("bwd", bwd_config(varlen_request(), ARCH).cfg)]
    return list(dict.fromkeys(out))


def print_plan() -> None:
    print(f"{DTYPE}, sm_{ARCH}a, d{HEADDIM}; variants: shipped, {ALT_NAME} ({ALT})")
    for kind, cfg in plan_kernels():
        print(f"  {kind} {cfg!r}")


def precompile() -> int:
    from ab_bwd_tiles import precompile as bwd_precompile
    from ab_fwd import precompile as fwd_precompile

    items = plan_kernels()
    bad = fwd_precompile([c for kind, c in items if kind == "fwd"])
    bad |= bwd_precompile([("bwd", c) for kind, c in items if kind == "bwd"])
    return bad


# -------------------------------------------------------------------------------------------- device
def _set(variant: str) -> None:
    """The environment of `variant`: ALT for ALT_NAME; ALT's names unset for "shipped"."""
    for name, value in ALT.items():
        if variant == ALT_NAME:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)


def run_decode(cell, rounds, rep_ms) -> dict:
    import torch

    from flash4 import flash_attn_with_kvcache

    name, batch, seqlen, page = cell
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 1, 32, HEADDIM, device="cuda", generator=g, dtype=torch.bfloat16)
    if page:
        pages = batch * seqlen // page
        kc = torch.randn(pages, page, 8, HEADDIM, device="cuda", generator=g, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(pages, device="cuda", generator=g).to(torch.int32).view(batch, seqlen // page)
    else:
        kc = torch.randn(batch, seqlen, 8, HEADDIM, device="cuda", generator=g, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = None
    lens = torch.full((batch,), seqlen - SHORT, device="cuda", dtype=torch.int32)
    outs = {}

    def call(variant):
        _set(variant)
        outs[variant] = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, return_lse=True)

    return _timed(name, call, outs, rounds, rep_ms, kv_bytes=2 * batch * (seqlen - SHORT) * 8 * HEADDIM * 2)


def run_varlen(name, rounds, rep_ms) -> dict:
    import torch

    from flash4 import backward, forward
    from flash4.bench.varlen import _paged, varlen_fwd_flops, varlen_lengths

    lengths = varlen_lengths()
    total = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(total, 16, HEADDIM, device="cuda", generator=g, dtype=torch.bfloat16)
                     for _ in range(4))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    if name == "paged128_fwd":
        kc, vc, table, used = _paged(k, v, cu, 128, torch.Generator().manual_seed(0))
        req = varlen_request(128, (q, kc, vc, cu, used, table))
    else:
        req = varlen_request(0, (q, k, v, cu, None, None))
    flops = varlen_fwd_flops(lengths, 16, HEADDIM, True)
    outs = {}
    if name.endswith("bwd"):
        _set("shipped")
        out, lse = forward.run(req)
        flops *= 2.5

        def call(variant):
            _set(variant)
            outs[variant] = backward.run(req, dout, out, lse)
    else:
        def call(variant):
            _set(variant)
            outs[variant] = forward.run(req)

    return _timed(name, call, outs, rounds, rep_ms, flops=flops)


def _timed(name, call, outs, rounds, rep_ms, flops=None, kv_bytes=None) -> dict:
    import torch

    row = {"cell": name}
    for variant in ("shipped", ALT_NAME):
        call(variant)
    torch.cuda.synchronize()
    a, b = (tuple(t for t in outs[v] if t is not None) for v in ("shipped", ALT_NAME))
    # the backward's dq is added across key tiles in any order (not deterministic): within 1e-2 relative
    # (ab_switch.DQ_TOL), dk / dv and every forward output bit for bit
    loose = {0} if name.endswith("bwd") else set()
    row["bitwise"] = all(ab_switch.reldiff(x, y) <= ab_switch.DQ_TOL if i in loose else ab_switch.same(x, y)
                         for i, (x, y) in enumerate(zip(a, b)))
    row["finite"] = all(bool(torch.isfinite(x).all()) for x in a)
    ms = ab_switch.interleaved({v: (lambda v=v: call(v)) for v in ("shipped", ALT_NAME)}, rounds, rep_ms)
    _set("shipped")
    for v in ms:
        row[f"{v}_ms"] = ms[v]
        if flops:
            row[f"{v}_tflops"] = flops / ms[v] / 1e9
        if kv_bytes:
            row[f"{v}_kv_gbps"] = kv_bytes / ms[v] / 1e6
    row["alt"] = ALT_NAME
    row["alt/shipped"] = ms["shipped"] / ms[ALT_NAME]
    return row


def format_row(row) -> str:
    unit = "tflops" if "shipped_tflops" in row else "kv_gbps"
    return (f"{row['cell']:24s} shipped {row[f'shipped_{unit}']:8.1f} {ALT_NAME} {row[f'{ALT_NAME}_{unit}']:8.1f} "
            f"{unit}  {ALT_NAME}/shipped {row['alt/shipped']:.3f}  bitwise {row['bitwise']} finite {row['finite']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--precompile", action="store_true")
    p.add_argument("--cache-dir")
    p.add_argument("--cells", nargs="*", help=f"only these ({', '.join(cells())})")
    p.add_argument("--rounds", type=int, default=ab_switch.ROUNDS)
    p.add_argument("--rep-ms", type=float, default=ab_switch.REP_MS)
    p.add_argument("--out")
    p.add_argument("--env", metavar="NAME=VALUE", nargs="*",
                   help="the second variant's environment instead of no_tail_guard (e.g. FLASH4_PAGE_PREFETCH=0)")
    args = p.parse_args(argv)
    global ALT, ALT_NAME
    if args.env:
        ALT, ALT_NAME = dict(e.split("=", 1) for e in args.env), "alt"
    if args.cache_dir:
        os.environ["FLASH4_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    if args.dry_run:
        print_plan()
        return 0
    if args.precompile:
        return precompile()
    rows = []
    for cell in DECODE:
        if not args.cells or cell[0] in args.cells:
            rows.append(run_decode(cell, args.rounds, args.rep_ms))
            print(format_row(rows[-1]), flush=True)
    for name in VARLEN:
        if not args.cells or name in args.cells:
            rows.append(run_varlen(name, args.rounds, args.rep_ms))
            print(format_row(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r["cell"] for r in rows if not (r["bitwise"] and r["finite"])]
    if bad:
        print("NOT BITWISE / NOT FINITE: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
