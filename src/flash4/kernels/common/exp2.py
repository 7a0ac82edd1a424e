"""exp2 on the device: MUFU.EX2 (`exp2_hw`), the FMA polynomial (`exp2_emulated`), and a
static mix of both over a register fragment (`exp2_fragment_mixed`).

The polynomial, its coefficients and the exact arithmetic are defined (and CPU-tested through a
bit-exact NumPy model) in `flash4.kernels.common.exp2_poly`; see its docstring for the method
(Cody–Waite range reduction, FlashAttention-4's software exp2 emulation).

Per element, `exp2_emulated` costs 1 FMNMX + 3 FADD + 3 FFMA (degree 3) + SHL + IADD, all on the
FMA/ALU pipes, vs 1 MUFU.EX2 for `exp2_hw`. sm_90 has no packed f32x2 arithmetic, so this is
scalar; on sm_100 `exp2_emulated_pair` does two elements per instruction (FADD2.RM, FADD2, 3 FFMA2:
half the FMA-pipe instructions), with the same per-lane arithmetic, so it is bit-exact to the
same NumPy model.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import dsl_user_op

from flash4.kernels.common.exp2_poly import EXP2_INPUT_MIN, EXP2_POLY_COEFFS, ROUND_MAGIC, mixed_pattern


def _f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.bitcast(Int32.mlir_type, x.ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def _bits_f32(x: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, x.ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def _add(a: Float32, b: Float32, rnd, *, loc=None, ip=None) -> Float32:
    """fp32 add with an explicit rounding mode (never contracted or reassociated)."""
    return Float32(nvvm.addf(a.ir_value(loc=loc, ip=ip), b.ir_value(loc=loc, ip=ip), rnd=rnd, loc=loc, ip=ip))


def fma_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """fp32 a * b + c, one round-to-nearest (llvm.fma -> fma.rn.f32 -> FFMA)."""
    a, b, c = (v.ir_value(loc=loc, ip=ip) for v in (a, b, c))
    return Float32(llvm.intr_fma(a, b, c, loc=loc, ip=ip))


@dsl_user_op
def exp2_hw(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the SFU: ex2.approx.ftz.f32 (MUFU.EX2). -inf -> +0, rel. error ~2^-22."""
    return Float32(nvvm.ex2(Float32(x).ir_value(loc=loc, ip=ip), ftz=True, loc=loc, ip=ip))


@dsl_user_op
def exp2_emulated(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA units (steps 1-5 of exp2_poly's docstring; bit-exact to exp2_emulated_np).

    x: fp32, must be < 128. -inf and NaN give exactly +0.0. Max rel. error 1.25e-4 for x >= -126.
    Checked on an H200: 8.4M inputs in [-130, 128) plus -inf/NaN/±0/subnormals, 0 bit mismatches.
    """
    rm, rn = nvvm.FPRoundingMode.RM, nvvm.FPRoundingMode.RN
    magic = Float32(ROUND_MAGIC)
    xc = cute.arch.fmax(Float32(x), Float32(EXP2_INPUT_MIN), loc=loc, ip=ip)
    r = _add(xc, magic, rm, loc=loc, ip=ip)  # low mantissa bits of r = floor(xc)
    n = _add(r, Float32(-ROUND_MAGIC), rn, loc=loc, ip=ip)  # floor(xc) as a float, exact
    f = _add(xc, -n, rn, loc=loc, ip=ip)  # in [0, 1], exact
    p = Float32(EXP2_POLY_COEFFS[-1])
    for c in reversed(EXP2_POLY_COEFFS[:-1]):  # Horner, unrolled at trace time
        p = fma_rn(p, f, Float32(c), loc=loc, ip=ip)
    bits = _f32_bits(p, loc=loc, ip=ip) + (_f32_bits(r, loc=loc, ip=ip) << 23)
    return _bits_f32(bits, loc=loc, ip=ip)


@dsl_user_op
def exp2_emulated_pair(x0: Float32, x1: Float32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """(2^x0, 2^x1) on the FMA units with packed f32x2 arithmetic (sm_100a and later only:
    add/sub/fma .f32x2 do not exist on sm_90). Steps 1-5 of exp2_poly's docstring, each lane with
    exactly the rounding of `exp2_emulated` (add.rm, add/sub.rn, fma.rn; no ftz), so every lane is
    bit-exact to exp2_emulated_np. SASS: 2 FMNMX, FADD2.RM, FADD2, FADD2, 3 FFMA2, 2 x (SHL, IADD)."""
    kw = dict(loc=loc, ip=ip)
    low, magic = Float32(EXP2_INPUT_MIN), Float32(ROUND_MAGIC)
    xc = (cute.arch.fmax(Float32(x0), low, **kw), cute.arch.fmax(Float32(x1), low, **kw))
    r = cute.arch.add_packed_f32x2(xc, (magic, magic), rnd="rm", **kw)  # low mantissa bits = floor(xc)
    n = cute.arch.add_packed_f32x2(r, (-magic, -magic), rnd="rn", **kw)  # floor(xc) as floats, exact
    f = cute.arch.sub_packed_f32x2(xc, n, rnd="rn", **kw)  # in [0, 1], exact
    top = Float32(EXP2_POLY_COEFFS[-1])
    p = (top, top)
    for c in reversed(EXP2_POLY_COEFFS[:-1]):  # Horner, unrolled at trace time
        p = cute.arch.fma_packed_f32x2(p, f, (Float32(c), Float32(c)), rnd="rn", **kw)
    out = tuple(_bits_f32(_f32_bits(p[i], **kw) + (_f32_bits(r[i], **kw) << 23), **kw) for i in (0, 1))
    return out[0], out[1]


@cute.jit
def exp2_fragment_mixed(
    frag: cute.Tensor,
    emu_frac: cutlass.Constexpr[float],
    group: cutlass.Constexpr[int] = 1,
):
    """In place frag[i] = 2^frag[i] for a register fragment, splitting the work between the FMA
    polynomial and MUFU.EX2 by a pattern fixed at compile time.

    frag:     fp32 register tensor of static size (any layout; indexed by flat position i).
    emu_frac: share done by the polynomial, k / period with period <= 16 (0.25 -> 1 of every 4);
              0 = all MUFU, 1 = all polynomial.
    group:    elements that share one choice. Element i uses the polynomial when
              (i // group) % period < k.

    On a row of the (rows, cols) view (`acc_mn_view(acc)[r, None]`), group=1 gives every row
    the same share. On a whole sm90 wgmma accumulator ((2, 2, V), MMA_M, MMA_N), pass group=4
    (one 8-column block of a thread: 2 columns x 2 rows) so both of the thread's rows get it.
    """
    k, period = mixed_pattern(emu_frac)
    for i in cutlass.range_constexpr(cute.size(frag)):
        if cutlass.const_expr((i // group) % period < k):
            frag[i] = exp2_emulated(frag[i])
        else:
            frag[i] = exp2_hw(frag[i])
