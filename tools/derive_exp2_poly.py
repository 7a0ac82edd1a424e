"""Derive the software-exp2 polynomial 2^f ~= p(f), f in [0, 1], p(0) = 1 (NumPy only).

    python tools/derive_exp2_poly.py              # degree 3 (flash4's choice): coefficients + errors
    python tools/derive_exp2_poly.py --compare    # degree 3 vs 4, least squares vs minimax

Fit: p(f) = 1 + sum_k c_k f^k minimizing the continuous L2 norm of p(f) - 2^f on [0, 1]
(normal equations with the Hilbert Gram matrix, right-hand side by Gauss-Legendre quadrature).
Absolute error is the right target because bf16 rounding of P in [1, 2) has a constant ulp
(see flash4/kernels/common/exp2_poly.py). `minimax` (Remez exchange on a dense grid, relative
error) is here for comparison. Coefficients are rounded to float32, as the kernel holds them;
errors are measured with the bit-exact fp32 model `exp2_emulated_np`.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np

# Loaded by path: exp2_poly.py is pure Python, so this script needs neither torch nor the DSL.
_POLY_PATH = Path(__file__).resolve().parents[1] / "src/flash4/kernels/common/exp2_poly.py"
_spec = importlib.util.spec_from_file_location("exp2_poly", _POLY_PATH)
exp2_poly = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp2_poly)
exp2_emulated_np = exp2_poly.exp2_emulated_np


def least_squares(degree: int) -> tuple[float, ...]:
    """float32 coefficients (lowest degree first, c0 = 1) of the L2-best fit of 2^f on [0, 1]."""
    k = np.arange(1, degree + 1)
    gram = 1.0 / (k[:, None] + k[None, :] + 1)  # int_0^1 f^i f^j df
    t, w = np.polynomial.legendre.leggauss(32)
    f, w = 0.5 * (t + 1), 0.5 * w
    rhs = (w * (np.exp2(f) - 1.0) * f[None, :] ** k[:, None]).sum(axis=1)  # int f^i (2^f - 1) df
    c = np.linalg.solve(gram, rhs)
    return tuple(float(v) for v in np.float32(np.concatenate([[1.0], c])))


def minimax(degree: int, n: int = 100_000, iters: int = 30) -> tuple[float, ...]:
    """float32 coefficients (c0 = 1) minimizing max |p(f) / 2^f - 1| (discrete Remez exchange)."""
    f = np.linspace(0.0, 1.0, n + 1)[1:]
    wt, b = np.exp2(-f), np.exp2(f) - 1.0
    a = f[:, None] ** np.arange(1, degree + 1)[None, :]
    ref = np.searchsorted(f, 0.5 - 0.5 * np.cos(np.pi * (np.arange(degree + 1) + 0.5) / (degree + 1)))
    for _ in range(iters):
        m = np.hstack([a[ref] * wt[ref, None], ((-1.0) ** np.arange(degree + 1))[:, None]])
        c = np.linalg.solve(m, b[ref] * wt[ref])[:degree]
        e = (a @ c - b) * wt
        segs = np.split(np.arange(n), np.flatnonzero(np.diff(np.sign(e)) != 0) + 1)
        ext = [s[np.argmax(np.abs(e[s]))] for s in segs]
        while len(ext) > degree + 1:  # keep an alternating set: drop the smaller end extremum
            ext.pop(0 if abs(e[ext[0]]) < abs(e[ext[-1]]) else -1)
        if len(ext) < degree + 1 or np.array_equal(ext, ref):
            break
        ref = np.array(ext)
    return tuple(float(v) for v in np.float32(np.concatenate([[1.0], c])))


def bf16_round(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even on the fp32 bits), returned as float32."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def errors(coeffs, n: int = 1 << 22) -> dict:
    """max relative error and bf16 match rate on a dense sweep of f (x = f - 1, f in [0, 1)) and
    on uniform x in [-126, 0] (normal-range outputs), plus x up to tau-range 8."""
    f = np.arange(n, dtype=np.float64) / n
    sweeps = {
        "f sweep": (f - 1.0).astype(np.float32),
        "x in [-126, 0]": np.random.default_rng(0).uniform(-126.0, 0.0, n).astype(np.float32),
        "x in [0, 8]": np.random.default_rng(1).uniform(0.0, 8.0, n).astype(np.float32),
    }
    out = {}
    for name, x in sweeps.items():
        y = exp2_emulated_np(x, coeffs)
        exact = np.exp2(x.astype(np.float64))
        out[name] = (
            float(np.max(np.abs(y / exact - 1.0))),
            float(np.mean(bf16_round(y) == bf16_round(exact.astype(np.float32)))),
        )
    return out


def report(name: str, coeffs) -> None:
    print(f"{name}:")
    for sweep, (rel, match) in errors(coeffs).items():
        print(f"  {sweep:16s} max rel err {rel:.3e}   bf16 match {100 * match:.3f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--degree", type=int, default=3)
    ap.add_argument("--compare", action="store_true", help="degree 3 vs 4, least squares vs minimax")
    args = ap.parse_args()
    coeffs = least_squares(args.degree)
    print("EXP2_POLY_COEFFS = (")
    for c in coeffs:
        print(f"    {c!r},  # 0x{np.float32(c).view(np.uint32):08x}")
    print(")")
    report(f"degree {args.degree}, least squares", coeffs)
    if args.compare:
        for d in (3, 4):
            report(f"degree {d}, minimax", minimax(d))
        report("degree 4, least squares", least_squares(4))


if __name__ == "__main__":
    main()
