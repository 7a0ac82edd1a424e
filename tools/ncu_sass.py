"""Read Nsight Compute's SASS source page (CSV) of one or two profiles: per kernel, the executed
instruction mix by opcode, the warp-stall samples by reason, and the hottest SASS lines.

    # on the GPU machine, after `ncu ... -o prof` (tools/prof_case.py --ncu, tools/prof_bwd.py):
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.sass.csv
    # anywhere (no GPU):
    python tools/ncu_sass.py prof.sass.csv [other.sass.csv] [--kernel SUBSTRING] [--top 25] [--by-opcode]

With two files, the opcode table puts them side by side (executed warp instructions, millions, and
the ratio), which is how docs/perf/ncu_*.md compares flash4 with flash-attn-4 on one cell.
The file holds one section per profiled kernel, each starting with a "Kernel Name" row; --kernel
keeps the kernels whose name contains SUBSTRING (default: the one with the most instructions).
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re
import sys


def read_kernels(path: str) -> dict:
    """{kernel name: [row dict per SASS line]} of one `--page source --csv --print-source sass` export."""
    kernels, name, lines = {}, None, []
    for line in open(path, newline=""):
        if line.startswith('"Kernel Name"'):
            if name is not None:
                kernels[name] = lines
            name, lines = next(csv.reader([line]))[1], []
            n = sum(1 for k in kernels if k == name or k.startswith(name + " #"))
            name = name if n == 0 else f"{name} #{n + 1}"  # the same kernel profiled again (another config)
        else:
            lines.append(line)
    if name is not None:
        kernels[name] = lines
    return {k: list(csv.DictReader(io.StringIO("".join(v)))) for k, v in kernels.items()}


def num(s) -> float:
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return 0.0


def opcode(src: str) -> str:
    """The SASS opcode of a source line, without its predicate and with its first modifier
    (HGMMA.64x128x16 -> HGMMA, FFMA2 stays, LDG.E.128 -> LDG.E)."""
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    op = s.split(" ")[0] if s else "?"
    parts = op.split(".")
    return ".".join(parts[:2]) if parts[0] in ("LDG", "STG", "LDS", "STS", "LDSM", "SYNCS", "UTMALDG") else parts[0]


def pick(kernels: dict, substring: str | None):
    names = [k for k in kernels if substring is None or substring in k]
    if not names:
        raise SystemExit(f"no kernel matches {substring!r}: {list(kernels)}")
    return max(names, key=lambda k: sum(num(r["Instructions Executed"]) for r in kernels[k]))


def summary(rows) -> dict:
    """{ops: executed per opcode, stalls: samples per reason, by_op: {opcode: samples per reason},
    total, samples} of one kernel's rows."""
    ops = collections.Counter()
    stalls = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    for r in rows:
        op = opcode(r["Source"])
        ops[op] += num(r["Instructions Executed"])
        for key, val in r.items():
            if key and key.startswith("stall_") and "(Not Issued)" not in key:
                stalls[key[6:]] += num(val)
                by_op[op][key[6:]] += num(val)
    return {"ops": ops, "stalls": stalls, "by_op": by_op, "total": sum(ops.values()), "samples": sum(stalls.values())}


def print_by_opcode(sums, top: int) -> None:
    """Stall samples per opcode and reason, the opcodes whose samples differ most between the files
    first (reasons under 1 % of an opcode's samples left out)."""
    ops = set().union(*(s["by_op"] for s in sums))
    key = (lambda k: -abs(sum(sums[0]["by_op"][k].values()) - sum(sums[1]["by_op"][k].values()))) if len(sums) == 2 \
        else (lambda k: -sum(sums[0]["by_op"][k].values()))
    print("\nstall samples by opcode and reason (" + " / ".join(f"({i})" for i in range(len(sums))) + ")")
    for op in sorted(ops, key=key)[:top]:
        reasons = sorted(set().union(*(s["by_op"][op] for s in sums)), key=lambda r: -sums[0]["by_op"][op][r])
        total = max(sum(s["by_op"][op].values()) for s in sums)
        cells = [f"{r}=" + "/".join(f"{s['by_op'][op][r]:.0f}" for s in sums) for r in reasons
                 if max(s["by_op"][op][r] for s in sums) >= 0.01 * max(total, 1)]
        print(f"  {op:12s} " + "/".join(f"{sum(s['by_op'][op].values()):.0f}" for s in sums) + "  " + " ".join(cells))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--kernel", help="keep the kernel whose name contains this (default: the largest)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--by-opcode", action="store_true", help="also the stall samples per opcode and reason")
    args = p.parse_args(argv)
    sums, names, rows_of = [], [], []
    for path in args.files[:2]:
        kernels = read_kernels(path)
        name = pick(kernels, args.kernel)
        names.append(name)
        rows_of.append(kernels[name])
        sums.append(summary(kernels[name]))
        print(f"{path}: {name[:110]} ({len(kernels[name])} SASS lines, "
              f"{sums[-1]['total'] / 1e6:.2f} M warp instructions, {sums[-1]['samples']:.0f} stall samples)")
    print("\nopcode | " + " | ".join(f"M executed ({i})" for i in range(len(sums))) + (" | ratio" if len(sums) == 2 else ""))
    keys = sorted(set().union(*(s["ops"] for s in sums)), key=lambda k: -max(s["ops"][k] for s in sums))
    for k in keys[:args.top]:
        vals = [s["ops"][k] / 1e6 for s in sums]
        ratio = f" | {vals[0] / vals[1]:.2f}" if len(vals) == 2 and vals[1] else ""
        print(f"{k:14s} | " + " | ".join(f"{v:8.2f}" for v in vals) + ratio)
    print("\nstall reason | " + " | ".join(f"% of samples ({i})" for i in range(len(sums))))
    skeys = sorted(set().union(*(s["stalls"] for s in sums)), key=lambda k: -max(s["stalls"][k] for s in sums))
    for k in skeys[:14]:
        print(f"{k:18s} | " + " | ".join(f"{100 * s['stalls'][k] / max(s['samples'], 1):6.1f}" for s in sums))
    if args.by_opcode:
        print_by_opcode(sums, args.top)
    for i, rows in enumerate(rows_of):
        print(f"\nhottest lines ({i}: stall samples, executed, source)")
        hot = sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[:args.top]
        for r in hot:
            print(f"  {num(r['Warp Stall Sampling (All Samples)']):7.0f} {num(r['Instructions Executed']):11.0f}  "
                  f"{r['Address']}  {r['Source'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
