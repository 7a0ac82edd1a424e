"""NumPy tests of the software exp2 (FlashAttention-4's FMA emulation of 2^x), through the
bit-exact fp32 model `exp2_emulated_np` of what the kernel computes.

The module under test is pure Python; it is loaded by path so these tests need neither torch
nor the CuTe DSL.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


poly = _load("exp2_poly", ROOT / "src/flash4/kernels/common/exp2_poly.py")
derive = _load("derive_exp2_poly", ROOT / "tools/derive_exp2_poly.py")
emu = poly.exp2_emulated_np
bf16_round = derive.bf16_round

N = 1 << 22  # dense sweeps: 4M points each


def _exact(x: np.ndarray) -> np.ndarray:
    return np.exp2(x.astype(np.float64))


def _f_sweep() -> np.ndarray:
    """x = f - 1 for f on a dense uniform grid of [0, 1): every reduced argument the kernel sees."""
    return (np.arange(N, dtype=np.float64) / N - 1.0).astype(np.float32)


def _x_uniform(lo: float, hi: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(lo, hi, N).astype(np.float32)


def test_coefficients_shape():
    assert poly.EXP2_POLY_DEGREE == 3 == len(poly.EXP2_POLY_COEFFS) - 1
    assert poly.EXP2_POLY_COEFFS[0] == 1.0  # exact: gives exp2(-inf) == 0 and exp2(k) == 2^k
    for c in poly.EXP2_POLY_COEFFS:
        assert float(np.float32(c)) == c  # stored as exact float32 values


@pytest.mark.parametrize(
    "x",
    [_f_sweep(), _x_uniform(-126.0, 0.0, 0), _x_uniform(0.0, 8.0, 1)],  # [0, 8]: lazy rescale tau
    ids=["f_sweep", "x_-126_0", "x_0_8"],
)
def test_max_relative_error(x):
    rel = np.abs(emu(x) / _exact(x) - 1.0)
    assert rel.max() <= 1.5e-4, rel.max()


def test_relative_error_at_every_exponent():
    """n = floor(x) only moves the exponent: the error must not depend on it (x in [-126, 127))."""
    f = (np.arange(4096) / 4096.0)[None, :]
    x = (np.arange(-126, 127)[:, None] + f).astype(np.float32).ravel()
    rel = np.abs(emu(x) / _exact(x) - 1.0)
    assert rel.max() <= 1.5e-4, rel.max()


def test_subnormal_range_is_tiny():
    """x in [-127, -126): the bit trick yields a subnormal pattern, not 2^x; both are < 2^-126."""
    x = np.linspace(-127.0, -126.0, 10_001, endpoint=False).astype(np.float32)
    y = emu(x)
    assert np.all(y >= 0) and np.all(y < 2.0**-126)


@pytest.mark.parametrize("x", [_f_sweep(), _x_uniform(-126.0, 0.0, 2)], ids=["f_sweep", "x_-126_0"])
def test_bf16_match_rate(x):
    match = np.mean(bf16_round(emu(x)) == bf16_round(_exact(x).astype(np.float32)))
    assert match >= 0.99, match


def test_bf16_round_is_rne():
    vals = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, -(1.0 + 2.0**-8)], np.float32)
    expect = np.array([1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7, -1.0], np.float32)  # ties to even, above tie up
    np.testing.assert_array_equal(bf16_round(vals), expect)


def test_masked_is_exactly_zero():
    y = emu(np.array([-np.inf, -np.inf, np.nan, -127.0, -1e30], np.float32))
    assert np.all(y == 0.0) and not np.any(np.signbit(y))  # +0.0


def test_no_nan_inf_and_monotone_range():
    x = np.concatenate(
        [
            np.array([-np.inf, -127.0, -126.0, -1e-30, -0.0, 0.0, 1e-30, 8.0, 127.99], np.float32),
            _x_uniform(-200.0, 0.0, 3),
            np.float32(-np.logspace(-40, 2.3, 10_000)),
        ]
    )
    y = emu(x)
    assert np.all(np.isfinite(y)) and np.all(y >= 0)
    assert np.all(y[x >= -126] > 0)


def test_integers_are_exact():
    k = np.arange(-126, 128, dtype=np.float32)
    np.testing.assert_array_equal(emu(k), np.exp2(k.astype(np.float64)).astype(np.float32))


def test_fma_model_rounds_once():
    """_fma_f32 must match a single rounding where float64 double rounding would not."""
    a = np.full(2, 1.0 + 2.0**-23, np.float32)
    b = np.full(2, 2.0**-25 * (1.0 - 2.0**-23), np.float32)
    c = np.array([0.75, 0.75 + 2.0**-24], np.float32)  # a*b + c lies just below a float32 midpoint
    np.testing.assert_array_equal(poly._fma_f32(a, b, c), c)


def test_derivation_reproduces_module_coefficients():
    np.testing.assert_allclose(derive.least_squares(poly.EXP2_POLY_DEGREE), poly.EXP2_POLY_COEFFS, rtol=2.0**-21)


@pytest.mark.parametrize(
    "frac, expect",
    [(0.0, (0, 1)), (0.25, (1, 4)), (0.5, (1, 2)), (0.375, (3, 8)), (1.0, (1, 1))],
)
def test_mixed_pattern(frac, expect):
    assert poly.mixed_pattern(frac) == expect


@pytest.mark.parametrize("frac", [-0.1, 1.5, 0.33])
def test_mixed_pattern_rejects(frac):
    with pytest.raises(ValueError, match="emu_frac"):
        poly.mixed_pattern(frac)
