"""The host's fold of the forward's scales (kernels/common/scales.host_scales) gives the float32 bits
the backward kernels fold on the device from the same softmax_scale and softcap (score.device_scales:
fp32(fp32(scale) * fp32(log2 e)), fp32(fp32(softcap) * fp32(log2 e)), fp32(fp32(scale) / fp32(softcap))).
A double-precision fold rounded once differs by an ulp at 129 of the head dims 8..512 (d192 among
them), which the exact-LSE path of the backward would see as a relative error in P growing with
the score."""

import math

import numpy as np
import pytest

from flash4.constants import LOG2E
from flash4.kernels.common.scales import host_scales, scales

f32 = np.float32


@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256, 80, 100, 33])
def test_plain_fold_equals_the_device_fold(headdim):
    scale = 1 / math.sqrt(headdim)
    scale_log2, softcap_scale = host_scales(scale, 0.0, False)
    assert scale_log2 == float(f32(f32(scale) * f32(LOG2E)))
    assert softcap_scale == 1.0


def test_the_double_fold_differs_somewhere():
    """Why the host folds in float32: the double fold rounded once is off by an ulp for d192."""
    scale = 1 / math.sqrt(192)
    assert float(f32(scale * LOG2E)) != host_scales(scale, 0.0, False)[0]
    ulp = np.spacing(f32(host_scales(scale, 0.0, False)[0]))
    assert abs(float(f32(scale * LOG2E)) - host_scales(scale, 0.0, False)[0]) == float(ulp)


@pytest.mark.parametrize("softcap", [50.0, 30.0, 15.0, 7.3])
def test_softcap_fold_equals_the_device_fold(softcap):
    scale = 1 / math.sqrt(256)
    scale_log2, softcap_scale = host_scales(scale, softcap, True)
    assert scale_log2 == float(f32(f32(softcap) * f32(LOG2E)))
    assert softcap_scale == float(f32(f32(scale) / f32(softcap)))
    # the same formula as the device's (scales with float32 arguments), inverse included
    c, a, r = scales(f32(scale), f32(softcap), True, one=f32(1.0), log2e=f32(LOG2E))
    assert (float(c), float(a)) == (scale_log2, softcap_scale) and r == f32(1.0) / c
