"""The public `window_size` keyword (sliding-window attention, issue 10) without a GPU: its
validation on every entry point and every flash4.validate function (TypeError for the container or
an element's type, ValueError for a side below -1, messages naming the argument, the value and what
is allowed), and its plumbing through the dense path: flash_attn_func -> FlashAttnFunc ->
_flash_attn_forward (config and runner receive flash4.geometry.window_sides) and
flash4.backward.flash_attn_backward. The varlen / kvcache plumbing is in test_varlen_api.py (contract
stand-ins), the custom ops in test_ops.py, the SDPA plug-in in test_sdpa_plugin.py; the kernels
themselves in tests/gpu/test_window.py."""

import inspect

import numpy as np
import pytest
import torch

import flash4
from flash4 import api, validate
from flash4.autograd import FlashAttnFunc
from flash4.geometry import UNBOUNDED, window_sides
from flash4.reference import attention_ref

BF16, I32 = torch.bfloat16, torch.int32
ALLOWED = "-1 for unbounded on that side"


def qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, s, n, d, generator=gen).to(BF16) for s, n in ((sq, h), (sk, hk), (sk, hk)))


def varlen_kwargs():
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 3, 8], dtype=I32)
    return dict(q=torch.randn(8, 4, 64, generator=gen).to(BF16), k=torch.randn(8, 2, 64, generator=gen).to(BF16),
                v=torch.randn(8, 2, 64, generator=gen).to(BF16), cu_seqlens_q=cu, cu_seqlens_k=cu)


def kvcache_kwargs():
    gen = torch.Generator().manual_seed(2)
    return dict(q=torch.randn(2, 1, 4, 64, generator=gen).to(BF16),
                k_cache=torch.randn(2, 32, 2, 64, generator=gen).to(BF16),
                v_cache=torch.randn(2, 32, 2, 64, generator=gen).to(BF16),
                cache_seqlens=torch.tensor([5, 17], dtype=I32))


# (public function, its validate pair (support_error-like, check_*), keyword arguments)
ENTRY_POINTS = {
    "dense": (flash4.flash_attn_func, validate.support_error, validate.check_inputs, lambda: dict(zip("qkv", qkv()))),
    "varlen": (flash4.flash_attn_varlen_func, validate.varlen_support_error, validate.check_varlen_inputs,
               varlen_kwargs),
    "kvcache": (flash4.flash_attn_with_kvcache, validate.kvcache_support_error, validate.check_kvcache_inputs,
                kvcache_kwargs),
}

BAD_TYPES = [None, 5, "(1, 1)", (1,), (1, 2, 3), [], (True, 0), (0, False), (1.0, 0), (0, 2.5), ("1", 0),
             (None, 0), (0, torch.tensor(3)), {1: 2}, torch.tensor([1, 2])]
BAD_VALUES = [(-2, 0), (0, -2), (-5, -5), (-1, -100), (3, -7)]


# ================================================================ validation
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("window", BAD_TYPES, ids=repr)
def test_window_type_errors(entry, window):
    func, support, check, kwargs = ENTRY_POINTS[entry]
    with pytest.raises(TypeError) as info:
        func(**kwargs(), window_size=window)
    message = str(info.value)
    assert message.startswith("window_size must be a tuple (left, right) of two ints") and ALLOWED in message
    assert f"got window_size={window!r}" in message
    # the validate functions give the same message (support_error returns it, check_* raises it)
    assert support(**kwargs(), window_size=window) == message
    with pytest.raises(TypeError) as info:
        check(**kwargs(), window_size=window)
    assert str(info.value) == message


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("window", BAD_VALUES + [list(w) for w in BAD_VALUES[:2]], ids=repr)
def test_window_value_errors(entry, window):
    func, support, check, kwargs = ENTRY_POINTS[entry]
    with pytest.raises(ValueError) as info:
        func(**kwargs(), window_size=window)
    message = str(info.value)
    side, value = ("left", window[0]) if window[0] < -1 else ("right", window[1])
    assert f"got window_size={window!r} ({side} side {value} < -1)" in message and ALLOWED in message
    assert support(**kwargs(), window_size=window) == message
    with pytest.raises(ValueError) as info:
        check(**kwargs(), window_size=window)
    assert str(info.value) == message


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (-1, 0), (0, -1), [3, 4], (10 ** 6, 10 ** 6),
                                    (np.int64(5), np.int32(0))], ids=repr)
def test_valid_windows_pass_every_metadata_check(entry, window):
    """A valid window only meets the device error on CPU tensors (every other check passed)."""
    func, support, check, kwargs = ENTRY_POINTS[entry]
    with pytest.raises(ValueError, match="q is on cpu"):
        func(**kwargs(), window_size=window)
    assert "q is on cpu" in support(**kwargs(), window_size=window)


def test_window_type_error_comes_before_tensor_checks():
    """The public functions check window_size with their other Python flags, before any tensor."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match="window_size"):
        flash4.flash_attn_func(q.float(), k, v, window_size=(0.5, 0))
    with pytest.raises(ValueError, match="window_size"):
        flash4.flash_attn_varlen_func(**dict(varlen_kwargs(), q=None), window_size=(-3, 0))
    with pytest.raises(TypeError, match="window_size"):
        flash4.flash_attn_with_kvcache(**dict(kvcache_kwargs(), k_cache=None), window_size=None)


def test_default_validate_arguments_are_no_window():
    for func in (validate.support_error, validate.check_inputs, validate.varlen_support_error,
                 validate.check_varlen_inputs, validate.kvcache_support_error, validate.check_kvcache_inputs):
        assert inspect.signature(func).parameters["window_size"].default == (-1, -1), func.__name__


def test_check_window_size_normalizes():
    assert validate.check_window_size([np.int64(4), 0]) == (4, 0)
    assert all(type(side) is int for side in validate.check_window_size((np.int16(2), np.int64(-1))))
    assert validate.window_problem((-1, -1)) is None and validate.window_problem([7, 9]) is None


def test_public_signatures():
    """flash-attn's name and default; keyword-only in flash4 (whose positional order differs from
    flash-attn's anyway: no dropout_p)."""
    for func in (flash4.flash_attn_func, flash4.flash_attn_varlen_func, flash4.flash_attn_with_kvcache):
        param = inspect.signature(func).parameters["window_size"]
        assert param.default == (-1, -1) and param.kind is inspect.Parameter.KEYWORD_ONLY, func.__name__
        assert "i + seqlen_k - seqlen_q - left" in func.__doc__ or "- left <= j <=" in func.__doc__, func.__name__


# ================================================================ dense plumbing
def _cpu_fake_kernels(monkeypatch, seen):
    """The dense forward/backward kernels replaced by the float32 reference (same window), recording
    what they received."""
    import flash4.backward as bwd

    def fake_forward(q, k, v, softmax_scale, causal, lse_split=None, window_size=None, softcap=0.0):
        seen.setdefault("forward", []).append(dict(causal=causal, window_size=window_size))
        seen.setdefault("fwd_softcap", []).append(softcap)
        out, lse = attention_ref(q, k, v, softmax_scale, causal, window_size=window_size, softcap=softcap)
        return out.to(q.dtype), lse

    def fake_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False, lse_split=None, dlse=None,
                      window_size=None, softcap=0.0):
        seen.setdefault("backward", []).append(dict(causal=causal, window_size=window_size))
        seen.setdefault("bwd_softcap", []).append(softcap)
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            ref, _ = attention_ref(*leaves, softmax_scale, causal, window_size=window_size, softcap=softcap)
            grads = torch.autograd.grad(ref, leaves, dout.float())
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))

    monkeypatch.setattr(api, "_flash_attn_forward", fake_forward)
    monkeypatch.setattr(bwd, "flash_attn_backward", fake_backward)
    monkeypatch.setattr(validate, "_problem", lambda *args: None)  # CPU tensors through check_inputs


@pytest.mark.parametrize("window, causal", [((4, 2), False), ((4, 2), True), ((-1, 3), False), ((0, 0), False),
                                            ([6, -1], True), ((-1, -1), False)])
def test_flash_attn_func_routes_the_window(monkeypatch, window, causal):
    seen = {}
    _cpu_fake_kernels(monkeypatch, seen)
    q, k, v = (t.float() for t in qkv(sq=20, sk=12))
    out = flash4.flash_attn_func(q, k, v, causal=causal, window_size=window)  # no grad: the direct path
    assert seen["forward"] == [dict(causal=causal, window_size=tuple(window))]
    ref, _ = attention_ref(q, k, v, None, causal, window_size=window)
    assert torch.equal(out, ref)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash4.flash_attn_func(*leaves, causal=causal, window_size=window, return_lse=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(dout)
    assert seen["forward"][-1] == seen["backward"][-1] == dict(causal=causal, window_size=tuple(window))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*ref_leaves, None, causal, window_size=window)
    ref.backward(dout)
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert torch.allclose(leaf.grad, ref_leaf.grad, atol=1e-5)
    if tuple(window) == (0, 0):  # rows i < sq - sk = 8 see no key: out 0, lse -inf, dq 0
        assert (out[:, :8] == 0).all() and torch.isneginf(lse[:, :, :8]).all() and (leaves[0].grad[:, :8] == 0).all()


def test_flash_attn_function_default_is_no_window(monkeypatch):
    seen = {}
    _cpu_fake_kernels(monkeypatch, seen)
    q, k, v = (t.float().requires_grad_() for t in qkv())
    out, _ = FlashAttnFunc.apply(q, k, v, 0.125, True)
    out.sum().backward()
    assert seen["forward"] == seen["backward"] == [dict(causal=True, window_size=None)]


@pytest.mark.parametrize("window, causal, local", [
    (None, False, False), ((-1, -1), False, False), ((-1, -1), True, False), ((-1, 5), True, False),
    ((-1, 0), False, True), ((3, 0), False, True), ((3, 9), True, True), ((-1, 4), False, True),
])
def test_forward_hook_passes_window_sides_to_config_and_runner(monkeypatch, window, causal, local):
    """_flash_attn_forward selects a local config exactly when window_sides gives sides, and hands
    those sides to the runner (UNBOUNDED for a -1 side)."""
    import flash4.compile.cache as cache

    seen = {}

    def fake_runner(cfg):
        seen["cfg"] = cfg

        def run(q, k, v, out, lse, scale, lse_split=None, window=None, softcap=0.0):
            seen["window"], seen["softcap"] = window, softcap
            out.zero_()
            lse.zero_()

        return run

    monkeypatch.setattr(cache, "get_fwd_runner", fake_runner)
    monkeypatch.setattr(api, "device_arch", lambda device: 90)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # CPU tensors: device.index is None
    q, k, v = qkv()
    api._flash_attn_forward(q, k, v, None, causal, window_size=window)
    assert seen["cfg"].local is local and seen["cfg"].causal is (causal and not local)
    assert seen["window"] == window_sides(window, causal)
    if window == (-1, 4):
        assert seen["window"] == (UNBOUNDED, 4)
