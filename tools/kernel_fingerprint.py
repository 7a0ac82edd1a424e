"""Fingerprint every kernel flash4 can build: cubin sha256 and the SASS opcode histogram, per config.

The proof-of-no-change tool of a refactor (issue 21): run it before and after, on the CPU, and
compare. For each config either the cubins are byte-identical, or the per-opcode SASS counts are
(a moved or renamed kernel changes the cubin's symbol names, not its code); anything else is
listed for a same-call A/B on the GPU.

    CUTE_DSL_ARCH=sm_90a python tools/kernel_fingerprint.py --out before.json [--only fwd|bwd|rowpass]
    python tools/kernel_fingerprint.py --compare before.json after.json

The config list is shipped_fwd_configs() + shipped_bwd_configs() + the variants the API selects
at run time (windows, softcap, sinks, packed / seqused / paged layouts, split-KV, GQA packing,
value head dims) + the row-wise passes (preprocess, dQ postprocess, split-KV combine). Configs are
keyed by repr(config), which a refactor keeps (the frozen configs are the compile-cache key).
Compiling takes about 4 s per kernel on one core.

--family sm80 --arch 80 [--arch 90 ...]: the portable (sm80) family's kernels for those targets
instead (sm80_configs: every shipped forward and backward config, the backward speed candidates
and one config per feature path), e.g. before / after a change to kernels/sm80.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _config_module():
    import flash4.config as config
    return config


def fwd_variants(config) -> list:
    """Forward configs the API builds at run time beyond shipped_fwd_configs()."""
    from flash4.config.sm90 import with_gather

    sel, seq = config.select_fwd_config, config.with_seq_layout
    out = []
    for d in config.SUPPORTED_HEADDIMS:
        out += [sel(d, "bf16", False, local=True), sel(d, "bf16", False, softcap=True), sel(d, "bf16", True, softcap=True),
                sel(d, "bf16", True, sink=True), sel(d, "bf16", False, local=True, softcap=True),
                sel(d, "bf16", False, local=True, sink=True)]
        base = sel(d, "bf16", True)
        out += [seq(base, varlen_q=True, varlen_k=True), seq(base, varlen_q=True, varlen_k=True, seqused_q=True,
                                                             seqused_k=True)]
        full = sel(d, "bf16", False)
        page_rows = config.paged_page_rows(16, full.tile_n)
        out += [seq(full, varlen_q=True, seqused_k=True, page_rows=page_rows),
                seq(full, seqused_k=True, page_rows=page_rows, split_kv=True),
                seq(full, varlen_q=True, seqused_k=True, **config.paged_layout(5, full.tile_n, 0, False)),
                # gathered as the doors build it (flash4.config.sm90.with_gather: zero-fill by default)
                with_gather(seq(full, varlen_q=True, seqused_k=True, **config.paged_layout(5, full.tile_n, 0, False)),
                            config.GATHER_ZERO_FILL),
                seq(full, varlen_q=True, seqused_k=True, **config.paged_layout(16, full.tile_n, 0, True)),
                seq(full, seqused_k=True, split_kv=True),
                seq(sel(d, "bf16", False, sink=True), seqused_k=True, split_kv=True),
                seq(sel(d, "bf16", True, local=True, softcap=True), varlen_q=True, varlen_k=True)]
        local = sel(d, "bf16", False, local=True)
        for pack in (2, 4, 8):
            packed = config.with_pack_gqa(local, pack * 2, 2)
            if packed != local:
                out.append(packed)
    for d, dv in config.HDIMV_PAIRS:
        out += [sel(d, "bf16", False, local=True, headdim_v=dv),
                seq(sel(d, "bf16", True, headdim_v=dv), varlen_q=True, varlen_k=True),
                seq(sel(d, "bf16", False, headdim_v=dv), seqused_k=True, split_kv=True)]
    return out


def bwd_variants(config) -> list:
    sel, seq = config.select_bwd_config, config.with_seq_layout
    out = []
    for d in config.BWD_SUPPORTED_HEADDIMS:
        out += [sel(d, "bf16", False, local=True), sel(d, "bf16", True, softcap=True),
                sel(d, "bf16", False, local=True, softcap=True), sel(d, "bf16", True, local=True, deterministic=True)]
        base = sel(d, "bf16", True)
        out += [seq(base, varlen_q=True, varlen_k=True), seq(base, varlen_q=True, varlen_k=True, seqused_q=True,
                                                             seqused_k=True),
                seq(sel(d, "bf16", True, deterministic=True), varlen_q=True, varlen_k=True),
                seq(sel(d, "bf16", False, local=True, softcap=True), varlen_q=True, varlen_k=True)]
        varlen_split = config.with_dkv_accum(seq(base, varlen_q=True, varlen_k=True), 4, 1, 1)
        if varlen_split != seq(base, varlen_q=True, varlen_k=True):
            out.append(varlen_split)
    for d, dv in config.HDIMV_PAIRS:
        out += [sel(d, "bf16", True, local=True, headdim_v=dv),
                seq(sel(d, "bf16", True, headdim_v=dv), varlen_q=True, varlen_k=True)]
    # a learnable sink needing a gradient (BwdConfig.sink_delta): every head dim, dense and packed, deterministic
    if hasattr(config, "with_sink_delta"):
        sink = config.with_sink_delta
        for d in config.BWD_SUPPORTED_HEADDIMS:
            out += [sink(sel(d, "bf16", True)), sink(seq(sel(d, "bf16", True), varlen_q=True, varlen_k=True)),
                    sink(sel(d, "bf16", False, deterministic=True))]
    return out


def sm80_configs(arch: int, only: str | None = None) -> list[tuple[str, object]]:
    """The portable family's kernels of target `arch`: shipped forward configs, one per forward
    feature path (window + softcap + sink, varlen + seqused, Q in registers + persistent, split-KV
    decode steps, paged gather, a value head dim), shipped backward configs, the backward speed
    candidates (flash4.config.sm80.bwd_candidates; fp16: the shipped one, shipped_bwd_candidate) and one
    per backward feature path."""
    from flash4.config import sm80

    fsel, bsel = sm80.select_fwd_config, sm80.select_bwd_config
    items = []
    if only in (None, "fwd"):
        step = sm80.kvcache_step_plan
        fwd = sm80.shipped_fwd_configs(arch) + [
            fsel(64, "bf16", False, arch=arch, local=True, softcap=True, sink=True),
            fsel(128, "fp16", True, arch=arch, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True),
            dataclasses.replace(fsel(64, "bf16", True, arch=arch, q_in_regs=True), persistent=True),
            step(fsel(64, "bf16", True, arch=arch), 1, 1, 32, 65536, 0, 132).cfg,
            step(fsel(256, "fp16", False, arch=arch, sink=True), 1, 1, 32, 65536, 0, 132).cfg,
            [c for c in sm80.paged_fwd_configs(arch) if c.headdim == 128 and c.causal and c.varlen_q][0],
            fsel(192, "bf16", True, arch=arch, headdim_v=128),
        ]
        items += [("fwd", c) for c in fwd]
    if only in (None, "bwd"):
        bwd = list(sm80.shipped_bwd_configs(arch))
        for c in sm80.shipped_bwd_configs(arch):
            if c.dtype == "bf16":
                bwd += list(sm80.bwd_candidates(c).values())
            elif sm80.shipped_bwd_candidate(c) in sm80.bwd_candidates(c):  # what the plain fp16 backward runs
                bwd.append(sm80.bwd_candidates(c)[sm80.shipped_bwd_candidate(c)])
        bwd += [bsel(64, "bf16", True, arch=arch, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True),
                bsel(128, "bf16", False, arch=arch, local=True, softcap=True),
                bsel(64, "bf16", False, arch=arch, local=True, deterministic=True),
                bsel(128, "bf16", False, arch=arch, headdim_v=64)]
        items += [("bwd", c) for c in bwd]
    return items


def all_configs(only: str | None = None, family: str | None = None, archs=()) -> list[tuple[str, object]]:
    """[(kind, config)] in a fixed order, without duplicates: the sm90 family's (sm_90a), or with
    family "sm80" the portable family's for targets `archs` (default: sm_80)."""
    if family == "sm80":
        items = [item for arch in archs or (80,) for item in sm80_configs(arch, only)]
    else:
        items = default_configs(only)
    seen, out = set(), []
    for kind, cfg in items:
        key = (kind, repr(cfg))
        if key not in seen:
            seen.add(key)
            out.append((kind, cfg))
    return out


def default_configs(only: str | None = None) -> list[tuple[str, object]]:
    """The sm90 family's kernels and the row-wise passes (sm_90a)."""
    config = _config_module()
    items = []
    if only in (None, "fwd"):
        items += [("fwd", c) for c in config.shipped_fwd_configs() + fwd_variants(config)]
    if only in (None, "bwd"):
        items += [("bwd", c) for c in config.shipped_bwd_configs() + bwd_variants(config)]
    if only in (None, "rowpass"):
        for d in config.SUPPORTED_HEADDIMS:
            for dt in config.DTYPES:
                items.append(("bwd_preprocess", (d, dt, False, None)))
                items.append(("bwd_postprocess", (d, dt, False, None)))
                items.append(("fwd_combine", (d, dt, False)))
            items.append(("bwd_preprocess", (d, "bf16", True, None)))
            items.append(("bwd_postprocess", (d, "bf16", True, None)))
            items.append(("fwd_combine", (d, "bf16", True)))
            items.append(("fwd_combine_rows", (d, "bf16", False)))  # the varlen decode door's (packed rows)
        for d in (64, 96):
            items.append(("bwd_postprocess", (d, "bf16", False, 128 if d == 64 else 64)))
        for d, dv in config.HDIMV_PAIRS:
            items.append(("bwd_preprocess", (dv, "bf16", False, d)))
    return items


def _compile(kind: str, cfg):
    """The compiled function of one kernel (the package's own compile entry points)."""
    import cutlass
    import cutlass.cute as cute
    from flash4.compile import cache

    if kind == "fwd":
        return cache.compile_fwd(cfg)
    if kind == "bwd":
        return cache.compile_bwd(cfg)
    return cache.compile_rowpass(kind, *cfg) if hasattr(cache, "compile_rowpass") else _compile_rowpass_legacy(kind, cfg)


def _compile_rowpass_legacy(kind, cfg):
    """Row-wise passes through the pre-refactor get_*_runner internals (their compile closures)."""
    import cutlass
    import cutlass.cute as cute
    from flash4.compile import cache, disk_cache

    captured = {}

    def fake_load_or_compile(k, key, options, compile_fn):
        captured["fn"] = compile_fn()
        return captured["fn"]

    real = cache.load_or_compile
    cache.load_or_compile = fake_load_or_compile
    try:
        if kind == "bwd_preprocess":
            d, dt, varlen, dq = cfg
            cache.get_bwd_preprocess_runner.__wrapped__(d, dt, 90, varlen, dq)
        elif kind == "bwd_postprocess":
            d, dt, varlen, accum_tile_m = cfg
            cache.get_bwd_postprocess_runner.__wrapped__(d, dt, 90, varlen, accum_tile_m)
        elif kind == "fwd_combine_rows":
            raise ValueError("fwd_combine_rows: no such kernel before compile_rowpass")
        else:
            d, dt, sink = cfg
            cache.get_combine_runner.__wrapped__(d, dt, 90, sink)
    finally:
        cache.load_or_compile = real
    return captured["fn"]


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_histogram(cubin: bytes) -> tuple[dict, str]:
    from flash4.compile.check import _cuobjdump

    tool = _cuobjdump()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    hist = collections.Counter(m.group(1) for m in _OPCODE.finditer(sass))
    return dict(sorted(hist.items())), res, sass_digest(sass)


def sass_digest(sass: str) -> str:
    """sha256 of the instruction text alone (no addresses, encodings, symbol or section names):
    equal when two cubins hold the same code under other kernel names."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            lines.append(re.sub(r"\s+", " ", m.group(1)))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def fingerprint(kind: str, cfg) -> dict:
    from flash4.compile.check import extract_cubin

    t0 = time.perf_counter()
    row = {"kind": kind, "config": repr(cfg)}
    try:
        compiled = _compile(kind, cfg)
        cubin = extract_cubin(compiled)
        row["sha256"] = hashlib.sha256(cubin).hexdigest()
        row["opcodes"], res, row["sass"] = sass_histogram(cubin)
        regs = re.search(r"REG:(\d+)", res)
        row["registers"] = int(regs.group(1)) if regs else None
    except Exception as e:  # recorded, compared like any other result
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


def compare(before_path: str, after_path: str) -> int:
    load = lambda p: {(r["kind"], r["config"]): r for r in map(json.loads, open(p))}
    before, after = load(before_path), load(after_path)
    identical = same_text = same_sass = 0
    differ, missing = [], []
    for key, b in before.items():
        a = after.get(key)
        if a is None:
            missing.append(key)
        elif a.get("sha256") and a.get("sha256") == b.get("sha256"):
            identical += 1
        elif a.get("sass") and a.get("sass") == b.get("sass"):
            same_text += 1
        elif a.get("opcodes") and a.get("opcodes") == b.get("opcodes") and a.get("registers") == b.get("registers"):
            same_sass += 1
        else:
            delta = {op: (b.get("opcodes", {}).get(op, 0), a.get("opcodes", {}).get(op, 0))
                     for op in set(b.get("opcodes", {})) | set(a.get("opcodes", {}))
                     if b.get("opcodes", {}).get(op, 0) != a.get("opcodes", {}).get(op, 0)}
            differ.append((key, b.get("registers"), a.get("registers"), delta, a.get("error")))
    extra = [k for k in after if k not in before]
    print(f"{len(before)} kernels before, {len(after)} after: {identical} byte-identical cubins, "
          f"{same_text} identical SASS instruction text (other kernel names), "
          f"{same_sass} identical SASS opcode counts (and registers), {len(differ)} differ, "
          f"{len(missing)} missing after, {len(extra)} new")
    for key, rb, ra, delta, err in differ:
        print(f"  DIFFER {key[0]} {key[1]}: registers {rb} -> {ra}; " +
              (f"error {err}" if err else ", ".join(f"{op} {x}->{y}" for op, (x, y) in sorted(delta.items())[:12])))
    for key in missing:
        print(f"  MISSING {key[0]} {key[1]}")
    return 0 if not differ and not missing else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write one JSON line per kernel here")
    p.add_argument("--only", choices=("fwd", "bwd", "rowpass"))
    p.add_argument("--match", help="only configs whose repr contains this text")
    p.add_argument("--list", action="store_true", help="print the configs and exit")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--family", choices=("sm80",), help="another family's kernels: sm80 (the portable family)")
    p.add_argument("--arch", type=int, action="append", default=[],
                   help="with --family sm80: a target (80, 86, 89, 90, 120); repeatable; default 80")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    items = all_configs(args.only, args.family, tuple(args.arch))
    if args.match:
        items = [(k, c) for k, c in items if args.match in repr(c)]
    if args.list:
        for kind, cfg in items:
            print(kind, cfg)
        print(len(items), "kernels")
        return 0
    out = open(args.out, "w") if args.out else sys.stdout
    for i, (kind, cfg) in enumerate(items):
        row = fingerprint(kind, cfg)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(f"[{i + 1}/{len(items)}] {kind} {row.get('sha256', 'ERROR')[:12]} {row['compile_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
