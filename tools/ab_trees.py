"""A/B two flash4 source trees on one GPU, interleaved: `python tools/ab_trees.py A_SRC B_SRC`.

Each round runs `python -m flash4 bench --impls flash4 ...` once per tree (a subprocess with
PYTHONPATH set to that tree's src), alternating A, B, A, B, ..., and reads the sweep.csv each run
writes; the table gives per cell the median TFLOPs of each tree over the rounds and B / A. Both
trees compile into the same disk cache (keyed by their source fingerprints), so rounds after the
first only load kernels. Meant for a refactor or a kernel change against its parent (the device
call carries the older tree as an ignored folder, e.g. .baseline/src).

    python tools/ab_trees.py .baseline/src src --rounds 2 --headdims 64 128 256 --seqlens 1k 4k --out $OUT/ab
    # named cells (flash4.bench.cases) too, e.g. the gpt-oss window-128 + sinks layer, with a one-cell sweep:
    python tools/ab_trees.py .baseline/src src --cases sink_gptoss_d64_window128_causal_8k --headdims 128 \
        --seqlens 1k --causal 1 --out $OUT/ab
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_bench(src: str, out: Path, args) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cases = args.cases or ["none"]
    cmd = [sys.executable, "-m", "flash4", "bench", "--impls", "flash4", "--cases", *cases, "--varlen", "none",
           "--headdims", *map(str, args.headdims), "--seqlens", *args.seqlens, "--causal", args.causal,
           "--out", str(out)] + (["--no-bwd"] if args.no_bwd else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out / "stdout.txt").parent.mkdir(parents=True, exist_ok=True)
    (out / "stdout.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        raise SystemExit(f"bench failed for {src} (rc {proc.returncode})")
    rows = []
    for name in ("sweep.csv",) + (("cases.csv",) if args.cases else ()):
        with open(out / name) as f:
            rows += [r for r in csv.DictReader(f) if r.get("impl") == "flash4"]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a_src")
    p.add_argument("b_src")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlens", nargs="+", default=["1k", "4k"])
    p.add_argument("--causal", default="both")
    p.add_argument("--no-bwd", action="store_true")
    p.add_argument("--out", default="ab_out")
    p.add_argument("--cases", nargs="+", metavar="NAME", help="also these named cells (cases.csv rows, by name)")
    args = p.parse_args(argv)
    out = Path(args.out)
    results = {"A": [], "B": []}
    for r in range(args.rounds):
        for name, src in (("A", args.a_src), ("B", args.b_src)):
            rows = run_bench(src, out / f"{name}{r}", args)
            results[name].append(rows)
            print(f"round {r} {name} ({src}): {len(rows)} cells", flush=True)
    key = lambda row: (row["case"],) if row.get("case") else (row["headdim"], row["causal"], row["seqlen"])
    cols = [c for c in ("fwd_tflops", "bwd_tflops") if c in results["A"][0][0]]
    lines = ["cell," + ",".join(f"{c}_A,{c}_B,{c}_B/A" for c in cols)]
    print(f"{'cell':28s}" + "".join(f"{c + ' A':>14s}{c + ' B':>14s}{'B/A':>7s}" for c in cols))
    for row in results["A"][0]:
        k = key(row)
        cells = []
        for c in cols:
            med = {}
            for name in ("A", "B"):
                vals = [float(x[c]) for rows in results[name] for x in rows if key(x) == k and x[c] not in ("", "nan")]
                med[name] = statistics.median(vals) if vals else float("nan")
            cells.append((med["A"], med["B"], med["B"] / med["A"] if med["A"] else float("nan")))
        label = k[0] if len(k) == 1 else f"d{k[0]} {'causal' if k[1] in ('1', 'True', 'true') else 'full'} {k[2]}"
        print(f"{label:28s}" + "".join(f"{a:14.1f}{b:14.1f}{q:7.3f}" for a, b, q in cells))
        lines.append(label + "," + ",".join(f"{a:.1f},{b:.1f},{q:.3f}" for a, b, q in cells))
    (out / "ab.csv").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
