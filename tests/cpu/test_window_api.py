"""The public `window_size` keyword (sliding-window attention, issue 10) without a GPU: its
validation on every entry point and every flash4.validate function (TypeError for the container or
an element's type, ValueError for a side below -1, messages naming the argument, the value and what
is allowed), and its plumbing through the dense path: flash_attn_func -> the request's MaskSpec ->
flash4.forward.launch (config and runner receive flash4.geometry.window_sides) and
flash4.backward.launch. The varlen / paged / kvcache plumbing is in test_varlen_api.py,
test_paged_api.py and test_kvcache_api.py (the reference stand-ins of conftest.py), the custom ops
in test_ops.py, the SDPA plug-in in test_sdpa_plugin.py; the kernels themselves in
tests/gpu/test_window.py."""

import inspect

import numpy as np
import pytest
import torch
from cpu_helpers import ENTRY_POINTS, qkv

import flash4
from flash4 import autograd, forward, validate
from flash4.geometry import UNBOUNDED, Band, band, window_sides
from flash4.reference import attention_ref
from flash4.request import Request

BF16, I32 = torch.bfloat16, torch.int32
ALLOWED = "-1 for unbounded on that side"

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
        flash4.flash_attn_varlen_func(**dict(ENTRY_POINTS["varlen"][3](), q=None), window_size=(-3, 0))
    with pytest.raises(TypeError, match="window_size"):
        flash4.flash_attn_with_kvcache(**dict(ENTRY_POINTS["kvcache"][3](), k_cache=None), window_size=None)


def test_positional_window_size_says_keyword_only():
    """flash-attn-4's flash_attn_func takes window_size sixth; in flash4 that slot is return_lse: a
    tuple or list there is named as a keyword-only window_size (still a TypeError)."""
    q, k, v = qkv()
    for window in ((4, 0), [4, 0]):
        with pytest.raises(TypeError) as info:
            flash4.flash_attn_func(q, k, v, None, False, window)
        message = str(info.value)
        assert message.startswith(f"return_lse must be a bool, got {type(window).__name__}")
        assert "window_size is keyword-only" in message and "window_size=(4, 0)" in message
    with pytest.raises(TypeError, match=r"^return_lse must be a bool, got str$"):
        flash4.flash_attn_func(q, k, v, return_lse="yes")


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
@pytest.mark.parametrize("window, causal", [((4, 2), False), ((4, 2), True), ((-1, 3), False), ((0, 0), False),
                                            ([6, -1], True), ((-1, -1), False)])
def test_flash_attn_func_routes_the_window(cpu_kernels, unchecked, window, causal):
    """flash_attn_func hands window_size to the forward and, through the autograd path, to the
    backward launch (the reference stands in for both); results equal the reference's."""
    q, k, v = (t.float() for t in qkv(sq=20, sk=12))
    out = flash4.flash_attn_func(q, k, v, causal=causal, window_size=window)  # no grad: the direct path
    assert [(c["causal"], c["window_size"]) for c in cpu_kernels] == [(causal, band(window))]
    ref, _ = attention_ref(q, k, v, None, causal, window_size=window)
    assert torch.equal(out, ref)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash4.flash_attn_func(*leaves, causal=causal, window_size=window, return_lse=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(dout)
    fwd, bwd = cpu_kernels[-1], cpu_kernels.backward[-1]
    assert (fwd["causal"], fwd["window_size"]) == (bwd["causal"], bwd["window_size"]) == (causal, band(window))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*ref_leaves, None, causal, window_size=window)
    ref.backward(dout)
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert torch.allclose(leaf.grad, ref_leaf.grad, atol=1e-5)
    if tuple(window) == (0, 0):  # rows i < sq - sk = 8 see no key: out 0, lse -inf, dq 0
        assert (out[:, :8] == 0).all() and torch.isneginf(lse[:, :, :8]).all() and (leaves[0].grad[:, :8] == 0).all()


def test_autograd_path_default_is_no_window(cpu_kernels):
    """A request built without window_size has no window: the forward and backward launches see
    window None (the kernels' plain / causal variants) and the literal Band(None, None)."""
    q, k, v = (t.float().requires_grad_() for t in qkv())
    out, _ = autograd.attention(Request.dense(q, k, v, 0.125, True))
    out.sum().backward()
    seen = [(c["causal"], c["window"], c["window_size"]) for c in cpu_kernels + cpu_kernels.backward]
    assert seen == [(True, None, Band(None, None))] * 2


@pytest.mark.parametrize("window, causal, local", [
    (None, False, False), ((-1, -1), False, False), ((-1, -1), True, False), ((-1, 5), True, False),
    ((-1, 0), False, True), ((3, 0), False, True), ((3, 9), True, True), ((-1, 4), False, True),
])
def test_forward_launch_passes_window_sides_to_config_and_runner(monkeypatch, window, causal, local):
    """flash4.forward's dense launch selects a local config exactly when window_sides gives sides,
    and hands those sides to the runner (UNBOUNDED for a -1 side)."""
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
    monkeypatch.setenv("FLASH4_ARCH", "90")
    q, k, v = qkv()
    forward.run(Request.dense(q, k, v, None, causal, window))
    assert seen["cfg"].local is local and seen["cfg"].causal is (causal and not local)
    assert seen["window"] == window_sides(window, causal)
    if window == (-1, 4):
        assert seen["window"] == (UNBOUNDED, 4)
