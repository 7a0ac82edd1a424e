"""The scales around the scores, on the host and on the device, folded by one formula
(kernels/common/score.py's docstring: softcap splits into tanh(S * softcap_scale) and the
softmax's log2 scale softcap * log2 e). Pure Python and numpy: the host imports it without the
CuTe DSL (the runtime loader's warm start).

The forward receives its scales folded on the host; the backward folds them on the device from
softmax_scale and softcap as Float32 values. Both must give the same float32 bits: the backward
recomputes P = 2^(S * scale_log2 - LSE_log2) against the forward's LSE, and its exact path
(hi + lo LSE) is exact only with the forward's scale_log2 (a 1-ulp difference is a relative error of
|S * scale_log2| * 2^-24 in P, 1e-3 at scores of 1e4). So the host folds in float32 as the device
does (numpy float32 arithmetic is IEEE round-to-nearest, as the device's FMUL / FDIV), not in
Python's double followed by one rounding.
"""

from __future__ import annotations

import numpy as np

from flash4.constants import LOG2E


def scales(softmax_scale, softcap, softcap_on: bool, one=1.0, log2e=LOG2E):
    """(scale_log2, softcap_scale, inv_scale_log2): P = 2^(score * scale_log2 - LSE_log2).

    Without softcap: (softmax_scale * log2 e, None, None). With it (softcap_on, softcap > 0): the
    tanh's input scale softmax_scale / softcap, the softmax's log2 scale softcap * log2 e and its
    inverse. The arithmetic is that of the argument types: device Float32 values (pass
    one=Float32(1.0), log2e=Float32(LOG2E)) or numpy float32 (host_scales)."""
    if not softcap_on:
        return softmax_scale * log2e, None, None
    softcap_scale = softmax_scale / softcap
    scale_log2 = softcap * log2e
    return scale_log2, softcap_scale, one / scale_log2


def host_scales(softmax_scale: float, softcap: float, softcap_on: bool) -> tuple[float, float]:
    """(scale_log2, softcap_scale) as Python floats holding the float32 values the backward kernel
    folds on the device from the same softmax_scale and softcap (softcap_scale 1.0 without softcap)."""
    f32 = np.float32
    scale_log2, softcap_scale, _ = scales(f32(softmax_scale), f32(softcap) if softcap_on else None, softcap_on,
                                          one=f32(1.0), log2e=f32(LOG2E))
    return float(scale_log2), float(softcap_scale) if softcap_on else 1.0
