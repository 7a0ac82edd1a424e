"""Head-dim rules (flash4.headdim, issue 13 item 2): which head dims are native, which are padded to
what, which are refused, and that zero-padding is exact (torch reference on the CPU)."""

import math

import pytest
import torch

from flash4.config import HDIMV_PAIRS, SUPPORTED_HEADDIMS
from flash4.headdim import (RULE, is_native, pad_last, padded_headdims, servable, training_headdims,
                            training_may_pad)
from flash4.reference import attention_ref


@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_native_equal_pairs_unchanged(d):
    assert is_native(d, d) and padded_headdims(d, d) == (d, d)


@pytest.mark.parametrize("pair", HDIMV_PAIRS)
def test_native_pairs_unchanged(pair):
    assert padded_headdims(*pair) == pair


@pytest.mark.parametrize("d,dv,arch,expected", [
    (96, 96, 100, (128, 128)),  # sm100 has no hd96 backward: the training call pads to hd128's
    (80, 80, 100, (128, 128)), (72, 72, 100, (128, 128)),  # padded to 96 for the forward, to 128 to train
    (96, 96, 90, (96, 96)), (80, 80, 90, (80, 80)),  # sm90 has an hd96 backward, and hd80 (FLASH4_HEADDIM16)
    (64, 64, 100, (64, 64)), (128, 128, 100, (128, 128)), (192, 128, 100, (192, 128)), (256, 256, 100, (256, 256)),
    (32, 32, 100, (64, 64)), (112, 112, 100, (128, 128))])
def test_training_headdims(d, dv, arch, expected):
    """The pair a training call runs at (forward and backward): sm100's backward pairs
    (flash4.config.sm100.bwd_padded_headdims) widen hd96; training_may_pad says when to ask the arch."""
    assert training_headdims(d, dv, arch) == expected
    assert training_may_pad(*padded_headdims(d, dv)) == (padded_headdims(d, dv) == (96, 96))


@pytest.mark.parametrize("d,expected", [(8, 64), (16, 64), (32, 64), (56, 64), (72, 96), (80, 96), (88, 96),
                                         (104, 128), (112, 128), (120, 128), (136, 192), (160, 192),
                                         (184, 192), (200, 256), (248, 256)])
def test_padded_to_next_native(d, expected):
    assert servable(d) and not is_native(d, d)
    assert padded_headdims(d, d) == (expected, expected)


def test_every_multiple_of_8_is_served_with_a_native_result():
    for d in range(8, 257, 8):
        for dv in range(8, 257, 8):
            dp, dvp = padded_headdims(d, dv)
            assert dp >= d and dvp >= dv and is_native(dp, dvp), (d, dv, dp, dvp)


def test_unequal_pairs():
    assert padded_headdims(192, 128) == (192, 128)  # native MLA pair
    assert padded_headdims(160, 128) == (192, 128)  # pads q/k only: (192, 128) is native
    assert padded_headdims(64, 32) == (64, 64)  # (64, 64) equal
    assert padded_headdims(32, 128) == (64, 128)  # native pair after padding q/k
    assert padded_headdims(256, 64) == (256, 256)  # (256, 64) is no pair: v padded to 256
    assert padded_headdims(16, 256) == (256, 256)


@pytest.mark.parametrize("d", [0, 4, 12, 100, 264, 512, -8])
def test_refused_with_the_rule(d):
    assert not servable(d)
    with pytest.raises(ValueError, match="multiple of 8") as err:
        padded_headdims(d, 64)
    assert f"headdim={d}" in str(err.value) and RULE in str(err.value)
    with pytest.raises(ValueError, match=f"headdim_v={d}"):
        padded_headdims(64, d)


@pytest.mark.parametrize("d,dv", [(8, 8), (40, 40), (72, 72), (32, 128), (112, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_padding_is_exact(d, dv, causal):
    """The padded problem's output (sliced), LSE and gradients equal the unpadded ones (float64)."""
    torch.manual_seed(0)
    q = torch.randn(2, 37, 4, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 45, 2, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 45, 2, dv, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 37, 4, dv, dtype=torch.float64)
    dp, dvp = padded_headdims(d, dv)
    scale = 1 / math.sqrt(d)
    out, lse = attention_ref(q, k, v, scale, causal, compute_dtype=torch.float64)
    g = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, k, v))
    outp, lsep = attention_ref(pad_last(q, dp), pad_last(k, dp), pad_last(v, dvp), scale, causal,
                               compute_dtype=torch.float64)
    gp = torch.autograd.grad((outp[..., :dv] * dout).sum() + lsep.sum(), (q, k, v))
    assert outp.shape[-1] == dvp and (outp[..., dv:] == 0).all()
    torch.testing.assert_close(outp[..., :dv], out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lsep, lse, rtol=1e-12, atol=1e-12)
    for a, b in zip(gp, g):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_pad_last_is_identity_at_width():
    t = torch.randn(2, 3, 64)
    assert pad_last(t, 64) is t and pad_last(t, 96).shape == (2, 3, 96)
