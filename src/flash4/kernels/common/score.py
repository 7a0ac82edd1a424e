"""Score modifications: the transform of the raw scores S = Q K^T before the mask and the softmax,
its derivative for the backward, and the scales around it, written once for every kernel.

Softcap (Gemma 2) is the first: the scores become softcap * tanh(softmax_scale * S / softcap). The
kernels split it as tanh(S * softcap_scale) in place (`apply`), with the softmax's log2 scale
softcap * log2 e instead of softmax_scale * log2 e (`scales`); the backward recovers
t = tanh(...) from P and the LSE (t = (log2 P + LSE log2) / scale_log2, no register kept for t)
and multiplies dS by d(score)/dS / softmax_scale = 1 - t^2 (`grad_factor`). A later score
modification (an ALiBi bias, a user score_mod) adds its transform and derivative here and a
ScoreMod flag in the configs; the kernels call only these three functions.

`scales` (kernels/common/scales.py) is written for two kinds of numbers, as flash4.geometry: the
host calls it on numpy float32 values (`host_scales`, the forward's launch arguments), the backward
kernel on device Float32 values, so both fold the scales by the same formula to the same bits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from flash4.constants import LOG2E
from flash4.kernels.common.scales import scales  # noqa: F401 - one formula, host and device


def device_scales(softmax_scale: Float32, softcap: Float32, softcap_on: bool):
    """`scales` on device values (the backward kernel's runtime softmax_scale and softcap)."""
    return scales(softmax_scale, softcap, softcap_on, one=Float32(1.0), log2e=Float32(LOG2E))


@cute.jit
def apply(acc_S: cute.Tensor, softcap_scale, softcap_on: cutlass.Constexpr[bool]):
    """The score transform in place on a score fragment (any layout): with softcap, S ->
    tanh(S * softcap_scale) (hardware tanh.approx.f32, MUFU); a no-op otherwise. Before the mask,
    so masked keys still get -inf (forward) or P = 0 (backward)."""
    if const_expr(softcap_on):
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[i] = cute.math.tanh(acc_S[i] * softcap_scale, fastmath=True)


@cute.jit
def grad_factor(p: Float32, lse_log2: Float32, inv_scale_log2: Float32) -> Float32:
    """d score / dS divided by softmax_scale, for one element whose probability is p (softcap:
    1 - t^2 with t = (log2 p + lse_log2) * inv_scale_log2 recovered from P; 0 where p = 0, masked
    or underflowed, so dS = 0 there either way)."""
    t = (cute.math.log2(p, fastmath=True) + lse_log2) * inv_scale_log2
    return Float32(cutlass.select_(p == Float32(0.0), Float32(0.0), Float32(1.0) - t * t))
