"""flash4.integrations.sdpa without a GPU.

Pure parts: the window mapping (aten's -1-per-side encoding -> flash4's causal flag and
window_size, checked against the rule itself), the BHSD <-> BSHD views, the refusals. Registry
parts (where this torch has torch.nn.attention's plug-in registry): register / activate / restore
and the handle. Plumbing: the overrides installed for the
CPU dispatch key with a float32 reference in place of flash4's kernels (flash4._KERNELS is the only
substitution), then driven through the real aten ops and their autograd formulas, and through
torch.nn.attention.varlen.varlen_attn: layouts, output strides equal to the aten meta functions',
argument mapping, gradients against PyTorch's math attention (sliding windows against flash4's
float32 reference). The real kernels behind these ops are tests/gpu/test_integrations.py's.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash4.integrations import sdpa
from flash4.reference import attention_ref, window_mask

BF16, I32 = torch.bfloat16, torch.int32
aten = torch.ops.aten


# ================================================================ pure mappings
@pytest.mark.parametrize("is_causal, left, right, seqlen_q, seqlen_k, causal, window", [
    (False, None, None, 10, 10, False, (-1, -1)),
    (True, None, None, 10, 10, True, (-1, 0)),
    (False, -1, -1, 10, 10, False, (-1, -1)),
    (False, -1, 0, 10, 10, True, (-1, 0)),        # PyTorch's / vLLM's causal
    (True, -1, -1, 10, 10, True, (-1, 0)),        # is_causal sets the right side to 0
    (True, -1, 7, 10, 10, True, (-1, 0)),
    (True, 5, 7, 10, 10, True, (5, 0)),
    (False, -2, -5, 10, 10, False, (-1, -1)),     # any negative side is unbounded
    (False, 10, 0, 10, 10, True, (-1, 0)),        # left >= seqlen_k is unbounded (flash-attn 2's clamp)
    (False, 99, 10, 10, 10, False, (-1, -1)),     # right >= seqlen_q - 1 is unbounded
    (False, -1, 9, 10, 10, False, (-1, -1)),
    (False, -1, 8, 10, 10, False, (-1, 8)),
    (False, 5, 0, 10, 10, True, (5, 0)),          # sliding windows pass through
    (False, 0, 0, 10, 10, True, (0, 0)),
    (False, -1, 3, 10, 10, False, (-1, 3)),
    (False, 3, 3, 10, 10, False, (3, 3)),
    (False, -1, 12, 20, 10, False, (-1, 12)),     # right >= seqlen_k but seqlen_q > seqlen_k + 1: as given
    (False, 12, 12, 20, 10, False, (-1, 12)),
])
def test_resolve_window(is_causal, left, right, seqlen_q, seqlen_k, causal, window):
    assert sdpa.resolve_window(is_causal, left, right, seqlen_q, seqlen_k) == (causal, window)


def _aten_window_mask(seqlen_q, seqlen_k, left, right, is_causal):
    """The visibility rule as aten / flash-attn 2 state it, without any clamping (None or negative:
    unbounded side; is_causal: right 0)."""
    left = -1 if left is None or left < 0 else left
    right = 0 if is_causal else (-1 if right is None or right < 0 else right)
    off = seqlen_k - seqlen_q
    return torch.tensor([[(left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
                          for j in range(seqlen_k)] for i in range(seqlen_q)], dtype=torch.bool).reshape(
        seqlen_q, seqlen_k)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 7), (3, 9), (9, 3), (12, 4), (1, 5), (5, 1), (0, 4), (4, 0)])
def test_resolve_window_is_the_plain_rule(seqlen_q, seqlen_k):
    """Whatever resolve_window clamps, flash4's mask (window_mask of its (causal, window_size)) equals
    the rule applied to the sides as given: the clamps are exact, never flash-attn 2's approximation."""
    for left, right, is_causal in itertools.product([None, -1, 0, 2, 3, 4, 8, 9, 20],
                                                    [None, -3, 0, 1, 3, 4, 5, 8, 11, 20], [False, True]):
        causal, window = sdpa.resolve_window(is_causal, left, right, seqlen_q, seqlen_k)
        assert torch.equal(window_mask(seqlen_q, seqlen_k, window, causal),
                           _aten_window_mask(seqlen_q, seqlen_k, left, right, is_causal)), (left, right, is_causal)


def test_bhsd_to_bshd_is_a_view():
    x = torch.randn(2, 7, 4, 64)  # BSHD memory, as SDPA's inputs usually are
    q = x.transpose(1, 2)  # what SDPA passes: (B, H, S, D)
    v = sdpa.bhsd_to_bshd(q)
    assert v.shape == (2, 7, 4, 64) and v.is_contiguous() and v.data_ptr() == x.data_ptr()
    assert sdpa.bhsd_to_bshd(v).shape == q.shape  # its own inverse
    out = torch.empty_like(q)  # the meta function's layout: BSHD memory again
    assert sdpa.bhsd_to_bshd(out).is_contiguous()


@pytest.mark.parametrize("kwargs, match", [
    (dict(dropout_p=0.1), "dropout"),
    (dict(return_debug_mask=True), "return_debug_mask"),
    (dict(alibi_slopes=torch.zeros(4)), "alibi"),
    (dict(block_table=torch.zeros(1, 1, dtype=I32)), "block_table"),
    (dict(seqused_k=torch.zeros(1, dtype=I32)), "seqused_k"),
])
def test_forward_problem(kwargs, match):
    assert match in sdpa.forward_problem(**kwargs)


def test_forward_problem_accepts_the_plain_case():
    assert sdpa.forward_problem() is None
    assert sdpa.forward_problem(seqused_k=torch.zeros(1, dtype=I32), varlen=True) is None


# ================================================================ registry
needs_registry = pytest.mark.skipif(not sdpa.available(), reason="this torch has no flash-attention plug-in registry")


@needs_registry
def test_register_activate_restore():
    import torch.nn.attention as attention

    ops = ("aten::" + name for name in sdpa._REQUIRED)
    cuda_build = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_flash_attention_forward", "CUDA")
    sdpa.register()
    sdpa.register()  # idempotent
    assert "flash4" in attention.list_flash_attention_impls()
    attention.activate_flash_attention_impl("flash4")
    try:
        assert attention.current_flash_attention_impl() == "flash4"
        handle = attention._registry._FLASH_ATTENTION_ACTIVE[1]
        assert isinstance(handle, sdpa.Flash4SdpaHandle) and handle.active and handle.dispatch_key == "CUDA"
        assert set(sdpa._REQUIRED) <= set(handle.ops)
        for op in ops:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None
    assert not handle.active
    if not cuda_build:  # a CPU-only torch has no CUDA kernel of its own: the override is gone
        for name in sdpa._REQUIRED:
            assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + name, "CUDA"), name


def test_register_without_the_registry_is_a_clear_error(monkeypatch):
    import torch.nn.attention as attention

    monkeypatch.delattr(attention, "register_flash_attention_impl", raising=False)
    assert not sdpa.available()
    with pytest.raises(RuntimeError, match="2.11"):
        sdpa.register()


def test_install_and_remove_on_a_key():
    """install() / remove() on the CPU key of a CPU-only build: the ops gain and lose the kernel."""
    name = "aten::_scaled_dot_product_flash_attention_backward"
    before = torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    handle = sdpa.install("CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    handle.remove()
    handle.remove()  # idempotent
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU") == before
    assert "removed" in repr(handle)


# ================================================================ plumbing through the dispatcher (CPU + reference)
def _cpu_only(error):
    """flash4's own support check, less its device check (the reference runs on the CPU): every
    shape, dtype and head-dim problem still comes through (they are checked first)."""
    return None if error is not None and "runs on CUDA tensors only" in error else error


def _ref_grads(dout, q, k, v, scale, causal, window_size=(-1, -1)):
    """dq, dk, dv of attention (BSHD, GQA, bottom-right causal / window) in float32, by the textbook
    formulas (no autograd: the overrides run below the autograd dispatch key)."""
    g = q.shape[2] // k.shape[2]
    qf, kf, vf, dof = (t.float() for t in (q, k, v, dout))
    ke, ve = kf.repeat_interleave(g, 2), vf.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, ke) * scale
    s = s.masked_fill(~window_mask(q.shape[1], k.shape[1], window_size, causal), float("-inf"))
    has_key = ~torch.isneginf(s.amax(-1, keepdim=True))
    p = torch.softmax(s.masked_fill(~has_key, 0.0), -1) * has_key
    o = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, ve)
    ds = p * (dp - (dof * o).sum(-1).transpose(1, 2).unsqueeze(-1))
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    fold = lambda t: t.view(t.shape[0], t.shape[1], k.shape[2], g, t.shape[3]).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _sequences(cu_q, cu_k):
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    return [(cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]) for b in range(len(cu_q) - 1)]


def _put(target, value):
    if target is None:
        return value.contiguous()
    target.copy_(value)
    return target


class RefKernels:
    """sdpa._KERNELS's interface on float32 math; records what each call received."""

    def __init__(self):
        self.calls = []

    def dense_error(self, q, k, v, scale, causal, window_size):
        from flash4.validate import support_error

        return _cpu_only(support_error(q, k, v, scale, causal, window_size))

    def varlen_error(self, q, k, v, cu_q, cu_k, seqused_k, scale, causal, window_size):
        from flash4.validate import varlen_support_error

        return _cpu_only(varlen_support_error(q, k, v, cu_q, cu_k, None, None, None, seqused_k, None, scale, causal,
                                              window_size))

    def dense_forward(self, q, k, v, scale, causal, window_size, out):
        self.calls.append(("dense_forward", dict(causal=causal, window_size=window_size, scale=scale, out=out, q=q)))
        o, lse = attention_ref(q, k, v, scale, causal, window_size=window_size)
        return _put(out, o.to(q.dtype)), lse.float().contiguous()

    def dense_backward(self, dout, q, k, v, out, lse, scale, causal, window_size, deterministic, dq, dk, dv):
        self.calls.append(("dense_backward", dict(causal=causal, window_size=window_size, deterministic=deterministic,
                                                  dq=dq, lse=lse)))
        grads = _ref_grads(dout, q, k, v, scale, causal, window_size)
        return tuple(_put(t, g.to(q.dtype)) for t, g in zip((dq, dk, dv), grads))

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, scale, causal, window_size, seqused_k, out):
        self.calls.append(("varlen_forward", dict(causal=causal, window_size=window_size, max_q=max_q,
                                                  seqused_k=seqused_k)))
        out = _put(out, torch.zeros_like(q))
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
        for b, (q0, q1, k0, k1) in enumerate(_sequences(cu_q, cu_k)):
            if seqused_k is not None:
                k1 = k0 + int(seqused_k[b])
            o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal, window_size=window_size)
            out[q0:q1], lse[:, q0:q1] = o[0].to(q.dtype), l[0]
        return out, lse

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window_size,
                        deterministic, dq, dk, dv):
        self.calls.append(("varlen_backward", dict(causal=causal, window_size=window_size, max_q=max_q, max_k=max_k)))
        grads = [torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v)]
        for q0, q1, k0, k1 in _sequences(cu_q, cu_k):
            if q0 == q1 or k0 == k1:
                continue  # no query or no key: zero gradients
            g = _ref_grads(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal,
                           window_size)
            for acc, part, (a, b) in zip(grads, g, ((q0, q1), (k0, k1), (k0, k1))):
                acc[a:b] = part[0]
        return tuple(_put(t, g.to(q.dtype)) for t, g in zip((dq, dk, dv), grads))


@pytest.fixture
def plugged(monkeypatch):
    """The overrides on the CPU key with RefKernels behind them; removed afterwards."""
    kernels = RefKernels()
    monkeypatch.setattr(sdpa, "_KERNELS", kernels)
    handle = sdpa.install("CPU")
    try:
        yield kernels
    finally:
        handle.remove()


def _sdpa_inputs(b, sq, sk, h, hk, d, seed=0):
    """Leaves in BSHD memory and the BHSD views SDPA passes."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(b, s, n, d, generator=gen).to(BF16).requires_grad_()
              for s, n in ((sq, h), (sk, hk), (sk, hk))]
    return leaves, [t.transpose(1, 2) for t in leaves]


def _math_sdpa(q, k, v, causal, scale):
    """PyTorch's math attention in float32 (BHSD; GQA by expanding K/V); grads w.r.t. float32 leaves."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    k_e, v_e = (t.repeat_interleave(g, 1) for t in leaves[1:])
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(leaves[0], k_e, v_e, is_causal=causal, scale=scale)
    return out, leaves


def _close(x, ref, tol=3e-2):
    err = (x.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("b, sq, sk, h, hk, d, causal", [
    (2, 33, 33, 4, 4, 64, True),
    (2, 17, 40, 4, 2, 64, False),   # GQA unexpanded, Sq != Sk
    (1, 9, 9, 6, 1, 128, True),     # MQA
])
def test_sdpa_flash_op_forward_backward(plugged, b, sq, sk, h, hk, d, causal):
    (q_leaf, k_leaf, v_leaf), (q, k, v) = _sdpa_inputs(b, sq, sk, h, hk, d)
    scale = 0.3
    res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    out, lse = res[0], res[1]
    meta = aten._scaled_dot_product_flash_attention(*(t.detach().to("meta") for t in (q, k, v)), 0.0, causal,
                                                    scale=scale)
    # the meta function's sizes, strides and dtypes, output by output
    assert len(res) == len(meta) == 9
    for got, want in zip(res, meta):
        if isinstance(want, torch.Tensor):
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        else:
            assert got == want
    assert res[2] is None and res[3] is None and (res[4], res[5]) == (sq, sk)
    name, seen = plugged.calls[0]
    assert name == "dense_forward" and seen["causal"] is causal and seen["scale"] == scale
    assert seen["out"] is not None and seen["q"].data_ptr() == q_leaf.data_ptr()  # views, no copies

    ref, ref_leaves = _math_sdpa(q, k, v, causal, scale)
    _close(out, ref)
    _, lse_ref = attention_ref(q_leaf.detach(), k_leaf.detach(), v_leaf.detach(), scale, causal)
    _close(lse, lse_ref, 1e-4)

    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * w).sum().backward()
    (ref * w).sum().backward()
    for leaf, ref_leaf in zip((q_leaf, k_leaf, v_leaf), ref_leaves):
        _close(leaf.grad.transpose(1, 2), ref_leaf.grad)
    name, seen = plugged.calls[-1]
    assert name == "dense_backward" and seen["causal"] is causal and seen["dq"] is not None
    assert seen["deterministic"] is torch.are_deterministic_algorithms_enabled()


def test_sdpa_flash_backward_strides_match_meta(plugged):
    _, (q, k, v) = _sdpa_inputs(2, 20, 24, 4, 2, 64)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False)[:2]
    dout = torch.randn(out.shape).to(BF16)  # contiguous BHSD: a layout the kernels do not read as is
    rng = torch.zeros(2, dtype=torch.uint64)
    args = (dout, q, k, v, out, lse, None, None, 20, 24, 0.0, False, rng, rng[0])
    grads = aten._scaled_dot_product_flash_attention_backward(*args)
    meta = aten._scaled_dot_product_flash_attention_backward(
        *(t.to("meta") if isinstance(t, torch.Tensor) else t for t in args))
    for got, want in zip(grads, meta):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)


def test_contiguous_bhsd_inputs(plugged):
    """A query that is contiguous BHSD (not a view of BSHD memory): out keeps query's layout (empty_like)
    and the kernels still see BSHD views."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=gen).to(BF16) for _ in range(3))
    out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    assert out.stride() == q.stride()
    ref, _ = _math_sdpa(q, k, v, True, None)
    _close(out, ref)


def test_flash_attention_forward_dense(plugged):
    """_flash_attention_forward without cum_seq: BSHD in, (B, H, Sq) logsumexp, meta layouts."""
    (q, k, v), _ = _sdpa_inputs(2, 12, 12, 4, 4, 64)
    q, k, v = (t.detach() for t in (q, k, v))
    args = (q, k, v, None, None, 12, 12, 0.0, False, False)
    res = aten._flash_attention_forward(*args, window_size_left=-1, window_size_right=0)
    meta = aten._flash_attention_forward(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in args))
    for got, want in zip(res, meta):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert plugged.calls[-1][1]["causal"] is True  # (-1, 0) is causal
    out_ref, lse_ref = attention_ref(q, k, v, None, True)
    _close(res[0], out_ref)
    _close(res[1], lse_ref, 1e-4)


def _packed(lengths, h, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, generator=gen).to(BF16).requires_grad_() for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=I32)
    return q, k, v, cu


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)])
def test_varlen_attn_forward_backward(plugged, window):
    """torch.nn.attention.varlen.varlen_attn reaches the overrides (packed path) forward and backward."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    lengths = [5, 0, 17, 1, 9]
    q, k, v, cu = _packed(lengths, 4, 64)
    out, lse = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), return_aux=AuxRequest(lse=True),
                           window_size=window)
    assert out.shape == q.shape and lse.shape == (4, sum(lengths)) and lse.dtype == torch.float32
    causal = window == (-1, 0)
    name, seen = plugged.calls[0]
    assert name == "varlen_forward" and seen["causal"] is causal and seen["max_q"] == 17
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * w).sum().backward()
    assert plugged.calls[-1][0] == "varlen_backward" and plugged.calls[-1][1]["max_k"] == 17
    cu_list = cu.tolist()
    for b in range(len(lengths)):
        s = slice(cu_list[b], cu_list[b + 1])
        if s.start == s.stop:
            continue
        ref, leaves = _math_sdpa(*(t.detach()[s].transpose(0, 1)[None] for t in (q, k, v)), causal, None)
        _close(out[s], ref[0].transpose(0, 1))
        (ref * w[s].transpose(0, 1)[None]).sum().backward()
        for t, leaf in zip((q, k, v), leaves):
            _close(t.grad[s], leaf.grad[0].transpose(0, 1))


def test_varlen_forward_strides_and_seqused(plugged):
    q, k, v, cu = _packed([3, 8], 2, 64)
    q, k, v = (t.detach() for t in (q, k, v))
    used = torch.tensor([2, 8], dtype=I32)
    args = (q, k, v, cu, cu, 8, 8, 0.0, False, False)
    res = aten._flash_attention_forward(*args, seqused_k=used)
    meta = aten._flash_attention_forward(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in args))
    for got, want in zip(res, meta):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert plugged.calls[-1][1]["seqused_k"] is not None
    out_ref, _ = attention_ref(q[None, :3], k[None, :2], v[None, :2])
    _close(res[0][:3], out_ref[0])


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.1), "dropout"),
    (lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, True), "return_debug_mask"),
    (lambda q, k, v: aten._scaled_dot_product_flash_attention(q[..., :48], k[..., :48], v[..., :48]), "headdim 48"),
    (lambda q, k, v: aten._scaled_dot_product_flash_attention(q.float(), k.float(), v.float()), "dtype|bfloat16"),
])
def test_refusals_through_the_dispatcher(plugged, call, match):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 16, 2, 64, generator=gen).to(BF16) for _ in range(3))
    with pytest.raises(RuntimeError, match=match) as info:
        call(q, k, v)
    assert "flash4 SDPA plug-in" in str(info.value)
    assert not any(name.endswith("forward") for name, _ in plugged.calls)  # nothing ran


def _ref_with_grads(q, k, v, dout, causal, window, scale=None):
    """flash4's float32 reference (BSHD) with autograd: out, lse and dq, dk, dv for dout."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, scale, causal, window_size=window)
    out.backward(dout.float())
    return out, lse, [t.grad for t in leaves]


@pytest.mark.parametrize("sq, sk, left, right, is_causal, window", [
    (24, 24, 4, 0, False, (4, 0)),
    (24, 24, 3, 5, False, (3, 5)),
    (24, 24, 6, 9, True, (6, 0)),        # is_causal sets the right side to 0
    (16, 40, 5, -1, False, (5, -1)),     # one side unbounded, Sq != Sk
    (40, 16, 0, 0, False, (0, 0)),       # rows i < 24 see no key: out 0, lse -inf, dq 0
    (40, 16, -1, 20, False, (-1, 20)),   # right >= Sk with Sq > Sk + 1: passed as given
])
def test_flash_attention_windows_dense(plugged, sq, sk, left, right, is_causal, window):
    """_flash_attention_forward / _backward (dense BSHD, through aten's autograd) run sliding windows:
    the kernels receive flash4's window_size and the result is the rule's (flash4's reference)."""
    (q, k, v), _ = _sdpa_inputs(2, sq, sk, 4, 2, 64, seed=5)
    out, lse = aten._flash_attention_forward(q, k, v, None, None, sq, sk, 0.0, is_causal, False,
                                             window_size_left=left, window_size_right=right)[:2]
    name, seen = plugged.calls[0]
    assert name == "dense_forward" and seen["window_size"] == window and seen["causal"] is (window[1] == 0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(BF16)
    out.backward(dout)
    name, seen = plugged.calls[-1]
    assert name == "dense_backward" and seen["window_size"] == window
    out_ref, lse_ref, grads_ref = _ref_with_grads(q, k, v, dout, False, (left, 0 if is_causal else right))
    _close(out, out_ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    _close(lse.masked_fill(torch.isneginf(lse), 0), lse_ref.masked_fill(torch.isneginf(lse_ref), 0), 1e-4)
    for leaf, g_ref in zip((q, k, v), grads_ref):
        _close(leaf.grad, g_ref)
    if window == (0, 0) and sq > sk:
        assert (out[:, :sq - sk] == 0).all() and torch.isneginf(lse[:, :, :sq - sk]).all()
        assert (q.grad[:, :sq - sk] == 0).all()


@pytest.mark.parametrize("window", [(8, 0), (3, 4), (-1, 2), (0, 0), (100, 100)])
def test_varlen_attn_sliding_window(plugged, window):
    """torch.nn.attention.varlen.varlen_attn's window_size reaches flash4's varlen kernels per
    sequence (sequences shorter than the window included), forward and backward."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    lengths = [40, 0, 5, 1, 23]
    q, k, v, cu = _packed(lengths, 2, 64, seed=7)
    out, lse = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), return_aux=AuxRequest(lse=True),
                           window_size=window)
    resolved = sdpa.resolve_window(False, *window, max(lengths), max(lengths))
    name, seen = plugged.calls[0]
    assert name == "varlen_forward" and (seen["causal"], seen["window_size"]) == resolved
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(BF16)
    out.backward(dout)
    name, seen = plugged.calls[-1]
    assert name == "varlen_backward" and (seen["causal"], seen["window_size"]) == resolved
    cu_list = cu.tolist()
    for b in range(len(lengths)):
        s = slice(cu_list[b], cu_list[b + 1])
        if s.start == s.stop:
            continue
        o_ref, l_ref, g_ref = _ref_with_grads(*(t[s][None] for t in (q, k, v, dout)), False, window)
        _close(out[s], o_ref[0])
        _close(lse[:, s], l_ref[0], 1e-4)
        for t, g in zip((q, k, v), g_ref):
            _close(t.grad[s], g[0])


def test_removed_overrides_leave_no_kernel():
    """After remove() the CPU key has no kernel again: a call fails instead of reaching flash4."""
    handle = sdpa.install("CPU")
    handle.remove()
    q = torch.randn(1, 2, 8, 64).to(BF16)
    with pytest.raises(NotImplementedError):
        aten._scaled_dot_product_flash_attention(q, q, q)


def test_scale_default():
    assert sdpa._scale(None, 64) == pytest.approx(1 / math.sqrt(64))
    assert sdpa._scale(0.5, 64) == 0.5


def test_headdim16_on_sm90(monkeypatch):
    """With FLASH4_ARCH=90 (q's GPU) the plug-in takes sm_90's multiples of 16 up to 128 as kernel head
    dims (FLASH4_HEADDIM16, on by default); 72 is refused naming them; off: 80 refused too."""
    from flash4.integrations.sdpa import _native_headdim_error

    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.delenv("FLASH4_FAMILY", raising=False)
    t = lambda d: torch.empty(1, 8, 2, d, dtype=BF16)  # noqa: E731
    monkeypatch.delenv("FLASH4_HEADDIM16", raising=False)
    assert _native_headdim_error(t(80), t(80)) is None and _native_headdim_error(t(48), t(48)) is None
    msg = _native_headdim_error(t(72), t(72))
    assert msg is not None and "headdim 72" in msg and "80" in msg
    monkeypatch.setenv("FLASH4_HEADDIM16", "0")
    assert "headdim 80" in _native_headdim_error(t(80), t(80))
