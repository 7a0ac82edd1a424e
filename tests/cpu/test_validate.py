"""flash4.validate on CPU tensors: every metadata check runs before the device check."""

import math

import numpy as np
import pytest
import torch

from flash4.config import SUPPORTED_HEADDIMS
from flash4.validate import check_inputs, resolve_softmax_scale, support_error

BF16 = torch.bfloat16


def qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64, dtype=BF16):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, d, dtype=dtype)
    return q, k, v


def raises(exc, *args, match=(), **kwargs):
    """check_inputs raises exc with every fragment of `match`; support_error returns that message."""
    with pytest.raises(exc) as info:
        check_inputs(*args, **kwargs)
    message = str(info.value)
    for fragment in match:
        assert fragment in message, (fragment, message)
    assert support_error(*args, **kwargs) == message
    return message


def test_valid_cpu_inputs_only_fail_on_device(monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU: move the tensor there
    raises(ValueError, q, k, v, match=("q is on cpu", "CUDA", "q.cuda()"))


def test_no_cuda_device_says_so(monkeypatch):
    """Without a CUDA device, 'move it with q.cuda()' would fail again: the message says there is none."""
    q, k, v = qkv()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = raises(ValueError, q, k, v, match=("q is on cpu; flash4 runs on CUDA tensors only", "no CUDA device",
                                                 "torch.cuda.is_available() is False"))
    assert "q.cuda()" not in message
    from flash4.validate import kvcache_support_error, varlen_support_error

    cu = torch.tensor([0, 16], dtype=torch.int32)
    for message in (varlen_support_error(q[0], k[0], v[0], cu, torch.tensor([0, 24], dtype=torch.int32)),
                    kvcache_support_error(q, k, v, cache_seqlens=4)):
        assert "no CUDA device" in message and "q.cuda()" not in message


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_tensor(which):
    args = dict(zip("qkv", qkv()))
    args[which] = args[which].tolist()
    raises(TypeError, args["q"], args["k"], args["v"], match=(f"{which} must be a torch.Tensor", "list"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    q, k, v = (t.to(dtype) for t in qkv())
    raises(TypeError, q, k, v, match=(f"q.dtype is {dtype}", "torch.bfloat16", "torch.float16"))


@pytest.mark.parametrize("which", ["k", "v"])
def test_mixed_dtypes(which):
    args = dict(zip("qkv", qkv()))
    args[which] = args[which].half()
    raises(TypeError, args["q"], args["k"], args["v"],
           match=(f"{which}.dtype is torch.float16", "q.dtype is torch.bfloat16", "share one dtype"))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank(which):
    args = dict(zip("qkv", qkv()))
    args[which] = args[which][0]
    shape = tuple(args[which].shape)
    raises(ValueError, args["q"], args["k"], args["v"], match=(f"{which} must be 4-D", str(shape)))


def test_batch_mismatch():
    q, _, _ = qkv(b=2)
    _, k, v = qkv(b=3)
    raises(ValueError, q, k, v, match=("k.shape[0] (batch) is 3", "q.shape[0] is 2"))


def test_headdim_mismatch():
    q, _, _ = qkv(d=64)
    _, k, v = qkv(d=128)
    raises(ValueError, q, k, v, match=("k.shape[3] (headdim) is 128", "q.shape[3] is 64"))


def test_v_shape_differs_from_k():
    q, k, _ = qkv(sk=24)
    _, _, v = qkv(sk=25)
    raises(ValueError, q, k, v, match=("v must have the shape of k", "(2, 25, 2, 64)", "(2, 24, 2, 64)"))


def test_nheads_k_must_divide_nheads():
    q, k, v = qkv(h=8, hk=3)
    raises(ValueError, q, k, v, match=("nheads_k=3", "nheads=8", "divide"))


def test_zero_heads():
    q, k, v = qkv(h=0, hk=0)
    raises(ValueError, q, k, v, match=("nheads", ">= 1"))


@pytest.mark.parametrize("d", [4, 100, 260, 512])
def test_unsupported_headdim(d):
    q, k, v = qkv(d=d)
    message = raises(ValueError, q, k, v, match=(f"headdim {d}", "not supported", "multiple of 8"))
    for allowed in SUPPORTED_HEADDIMS:
        assert str(allowed) in message


@pytest.mark.parametrize("d", [8, 32, 80, 160, 248])
def test_padded_headdims_pass_the_rule(d):
    """Multiples of 8 without a kernel are served (flash_attn_func zero-pads them): support_error
    says nothing about the head dim (on CPU tensors only the device is wrong)."""
    message = support_error(*qkv(d=d))
    assert message is None or "headdim" not in message


@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_supported_headdims_pass_metadata_checks(d):
    q, k, v = qkv(d=d)
    assert "cpu" in support_error(q, k, v)  # only the device is wrong


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_contiguous_last_dim(which):
    args = dict(zip("qkv", qkv()))
    t = args[which]
    args[which] = torch.randn(*t.shape[:-1], 2 * t.shape[-1], dtype=BF16)[..., ::2]
    raises(ValueError, args["q"], args["k"], args["v"], match=(f"{which} has stride(-1)=2", f"{which}.contiguous()"))


def test_misaligned_base_address():
    q, k, v = qkv()
    q = torch.randn(q.numel() + 1, dtype=BF16)[1:].view(q.shape)  # 2 bytes past an aligned address
    raises(ValueError, q, k, v, match=("q.data_ptr() is not 16-byte aligned",))


def test_stride_not_multiple_of_16_bytes():
    q, k, v = qkv()
    k = torch.randn(*k.shape[:-1], 65, dtype=BF16)[..., :64]  # strides (3120, 130, 65, 1)
    raises(ValueError, q, k, v, match=("k.stride(1)=130", "not a multiple of 8", "(3120, 130, 65, 1)"))


def test_packed_qkv_views_are_accepted():
    qkv_packed = torch.randn(2, 16, 3, 4, 64, dtype=BF16)
    q, k, v = qkv_packed.unbind(dim=2)
    assert "cpu" in support_error(q, k, v)


def test_size_one_dims_need_aligned_strides_too():
    q, k, v = qkv(b=1, h=1, hk=1)
    q = q.as_strided(q.shape, (q.stride(0), q.stride(1), 3, 1))
    raises(ValueError, q, k, v, match=("q.stride(2)=3", "not a multiple of 8"))


def test_expanded_kv_heads_rejected_with_gqa_hint():
    q, k, v = qkv(h=4, hk=1)
    k = k.expand(-1, -1, 4, -1)
    v = v.expand(-1, -1, 4, -1)
    raises(ValueError, q, k, v, match=("k is expanded along dim 2", "stride 0", "nheads_k"))


def test_expanded_size_one_dim_is_fine():
    q, k, v = qkv(b=1)
    k = k.as_strided(k.shape, (0,) + k.stride()[1:])  # size-1 batch with stride 0: never stepped along
    assert "cpu" in support_error(q, k, v)


@pytest.mark.parametrize("scale", ["0.1", True, torch.tensor(0.1), [0.1]])
def test_softmax_scale_type(scale):
    raises(TypeError, *qkv(), softmax_scale=scale, match=("softmax_scale must be a float or None",))


@pytest.mark.parametrize("scale", [0.0, -0.125, math.nan, math.inf])
def test_softmax_scale_value(scale):
    raises(ValueError, *qkv(), softmax_scale=scale, match=("softmax_scale must be finite and > 0", str(scale)))


@pytest.mark.parametrize("scale", [None, 0.125, 1, np.float32(0.5), np.float64(0.5)])
def test_softmax_scale_accepted(scale):
    assert "cpu" in support_error(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("causal", [1, "yes", None])
def test_causal_must_be_bool(causal):
    raises(TypeError, *qkv(), causal=causal, match=("causal must be a bool",))


@pytest.mark.parametrize("shape", [(0, 16, 24), (2, 0, 24), (2, 16, 0)])
def test_empty_cpu_inputs_get_the_device_error(shape):
    b, sq, sk = shape
    raises(ValueError, *qkv(b=b, sq=sq, sk=sk), match=("is on cpu", "CUDA"))


def test_meta_device_is_rejected():
    q, k, v = (t.to("meta") for t in qkv())
    raises(ValueError, q, k, v, match=("q is on meta",))


def test_resolve_softmax_scale():
    assert resolve_softmax_scale(None, 64) == 0.125
    assert resolve_softmax_scale(None, 256) == 1 / 16
    assert resolve_softmax_scale(0.3, 64) == 0.3
    assert isinstance(resolve_softmax_scale(1, 64), float)
