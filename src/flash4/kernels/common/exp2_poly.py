"""Software exp2 on the FMA units: the polynomial (single source of truth) and a NumPy model.

FlashAttention-4 (Zadouri et al. 2025, "software emulation of the exponential") computes part of
the softmax's 2^x with FMAs instead of MUFU.EX2 so both units work in parallel. The method is
Cody–Waite range reduction:

    x = n + f,  n = floor(x) (an integer),  f in [0, 1)
    2^x = 2^n * 2^f ~= 2^n * p(f),  p(f) = c0 + c1 f + c2 f^2 + c3 f^3,  c0 = 1 exactly

and 2^n is applied by adding n << 23 to the integer bits of p(f) (n goes straight into the
exponent field). Kernel steps, all fp32 (`exp2_emulated_np` below is a bit-exact model of them,
`flash4.kernels.common.exp2.exp2_emulated` is the device code):

    1. xc = max(x, -127)            FMNMX, NaN-quiet: NaN -> -127
    2. r  = xc + 1.5*2^23  (round toward -inf)   r's low mantissa bits now hold n = floor(xc)
    3. f  = xc - (r - 1.5*2^23)     both exact (round-to-nearest)
    4. p  = ((c3 f + c2) f + c1) f + c0        Horner, 3 FMAs (rn)
    5. out = bits(p) + (bits(r) << 23)          integer add; bits(r) << 23 == n << 23 (mod 2^32)

Masked scores (x = -inf) give exactly +0.0: xc = -127 makes n = -127, f = 0 and p = c0 = 1.0
(0x3F800000), so bits = 0x3F800000 - (127 << 23) = 0. This is why c0 is pinned to 1.0 (p(0) = 1
also keeps 2^k exact for integer k, e.g. 2^0 = 1 for the row max). Clamping costs no extra
instruction over what range reduction needs and avoids a select on -inf.

Domain: x < 128 (the kernel sees x <= tau = 8 with lazy rescaling). For x in [-127, -126) the
output is a subnormal bit pattern that is not 2^x (absolute error < 2^-126; the kernel's FTZ
arithmetic treats it as 0); for x >= -126 the relative error is the polynomial's (see below).

Why these coefficients (tools/derive_exp2_poly.py derives them):
  bf16 rounding of P is what the kernel keeps, and a bf16 mismatch happens with probability
  ~ |p(f) - 2^f| / ulp_bf16 with ulp_bf16 = 2^-7 constant on [1, 2). So the mean *absolute*
  error on [0, 1] is what to minimize, not the max relative error. The continuous least-squares
  fit (p(0) = 1 fixed) does that almost as well as the L1 optimum (99.10% vs 99.13% bf16 match),
  in closed form. Degree 3 meets the targets with 3 FMAs:
      degree 3, least squares: max rel err 1.25e-4, bf16 match 99.10%
      degree 3, minimax:       max rel err 8.6e-5,  bf16 match 98.999% (misses 99%)
      degree 4, minimax:       max rel err 3.0e-6,  bf16 match 99.97% (one more FMA)
"""

from __future__ import annotations

from fractions import Fraction

# Lowest degree first: EXP2_POLY_COEFFS[k] multiplies f**k. Exact float32 values (printed by
# `python tools/derive_exp2_poly.py`, continuous least squares on [0, 1] with c0 = 1).
EXP2_POLY_COEFFS = (
    1.0,  # 0x3f800000
    0.6954281330108643,  # 0x3f320794
    0.2269476056098938,  # 0x3e6864f4
    0.07737407833337784,  # 0x3d9e764d
)
EXP2_POLY_DEGREE = len(EXP2_POLY_COEFFS) - 1

# 1.5 * 2^23: adding it (round down) leaves floor(x) in the low mantissa bits for |x| < 2^22.
ROUND_MAGIC = 12582912.0
# Lowest input kept: -127 maps -inf (and NaN) to exactly 0 (see module docstring).
EXP2_INPUT_MIN = -127.0


def mixed_pattern(emu_frac: float, max_period: int = 16) -> tuple[int, int]:
    """(k, period) such that emu_frac == k / period: of every `period` elements, the first `k`
    use the polynomial and the rest MUFU.EX2. emu_frac must be in [0, 1] and a fraction with
    denominator <= max_period (0.25 -> (1, 4), 0.5 -> (1, 2), 0.375 -> (3, 8), 0 -> (0, 1))."""
    if not 0.0 <= emu_frac <= 1.0:
        raise ValueError(f"emu_frac must be in [0, 1], got {emu_frac!r}")
    frac = Fraction(emu_frac).limit_denominator(max_period)
    if abs(float(frac) - emu_frac) > 1e-9:
        raise ValueError(
            f"emu_frac={emu_frac!r} is not k/period with period <= {max_period}; use e.g. 0.25 or 0.375"
        )
    return frac.numerator, frac.denominator


def emulated_column(col: int, emu_frac: float, group: int = 1) -> bool:
    """The static choice of the exp2 unit for column `col` of a score row: True = the polynomial.
    Columns go in groups of `group` that share one choice (2 on sm_100: a packed f32x2 pair); of
    every `period` groups the first k take the polynomial, k / period == emu_frac (mixed_pattern)."""
    k, period = mixed_pattern(emu_frac)
    return (col // group) % period < k


def _fma_f32(a, b, c):
    """fp32 fma(a, b, c) with one round-to-nearest-even, like FFMA (NumPy arrays of float32).

    a*b is exact in float64; a*b + c is then rounded once to float64 and once more to float32.
    That double rounding differs from one rounding only when the float64 sum lands exactly on a
    float32 midpoint, so there the float64 sum is nudged by one ulp toward the exact value.
    """
    import numpy as np

    prod = a.astype(np.float64) * b.astype(np.float64)
    c64 = np.asarray(c, np.float64)
    s = prod + c64
    bb = s - prod
    err = (prod - (s - bb)) + (c64 - bb)  # TwoSum: s + err == prod + c exactly
    bits = s.view(np.uint64)
    midpoint = (bits & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)  # float32 has 24-bit significand
    fix = midpoint & (err != 0)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def exp2_emulated_np(x, coeffs=EXP2_POLY_COEFFS):
    """Bit-exact NumPy model of the kernel's software exp2 (steps 1-5 in the module docstring).

    x: array-like, any shape, converted to float32. coeffs: lowest degree first, float32 values.
    Returns float32 array of x's shape. Valid for x < 128 (and -inf / NaN -> +0.0).
    """
    import numpy as np

    x = np.asarray(x, dtype=np.float32)
    xc = np.fmax(x, np.float32(EXP2_INPUT_MIN))  # step 1 (fmax ignores NaN like FMNMX)
    n = np.floor(xc)  # step 2: exact, so C + n is the round-down sum
    r = (n + np.float32(ROUND_MAGIC)).astype(np.float32)
    f = (xc - (r - np.float32(ROUND_MAGIC))).astype(np.float32)  # step 3
    c32 = [np.float32(c) for c in coeffs]
    p = np.full_like(f, c32[-1])
    for c in reversed(c32[:-1]):  # step 4
        p = _fma_f32(p, f, c)
    out = p.view(np.uint32) + (r.view(np.uint32) << np.uint32(23))  # step 5, wraps mod 2^32
    return out.astype(np.uint32).view(np.float32)
