"""Attention sinks (learnable_sink, gpt-oss; issue 10 item 3) on the GPU (marker gpu).

Forward (out, lse) and dq/dk/dv/dsink against autograd through flash4.reference with the same sink:
error vs the fp32 reference at most 2x PyTorch's own bf16 error + atol; NaN-poisoned outputs
(flash4.forward.run). Sinks far above / below the row max (+-30 vs scores ~N(0,1)), rows without
keys (causal, seqlen_q > seqlen_k: out 0, lse = sink), GQA, window + softcap, varlen, decode incl.
split-KV (num_splits 3)."""

import pytest
import torch

from flash4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash4 import forward
from flash4.request import Request
from flash4.reference import attention_ref, attention_varlen_ref, kvcache_ref

from gpu_helpers import BF16

ATOL = {"out": 2e-3, "lse": 1e-3, "grad": 2e-3}


def _close(got, ref, low, atol, name):
    """|got - ref| <= 2 |low - ref| + atol (low: the same computation in bf16 by PyTorch)."""
    got, ref, low = (t.float() for t in (got, ref, low))
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin), name
    err, bound = (got - ref)[fin].abs().max(), 2 * (low - ref)[fin].abs().max() + atol
    assert err <= bound, f"{name}: {err} > {bound}"


def _lse_is_sink(lse, sink):
    """A row without keys has LSE = sink; the kernel gets it through the log2 domain (sink * log2 e, then
    * ln 2 in float32), so it may differ from sink in the last bits: a few float32 ulps, nothing more."""
    torch.testing.assert_close(lse, sink.float(), rtol=4 * torch.finfo(torch.float32).eps, atol=1e-6)


def _sinks(h, kind, device):
    gen = torch.Generator(device="cpu").manual_seed(7)
    base = {"normal": torch.randn(h, generator=gen), "high": torch.full((h,), 30.0),
            "low": torch.full((h,), -30.0), "mixed": torch.tensor([30.0, -30.0] * (h // 2))}[kind]
    return base.to(device)


@pytest.mark.parametrize("kind", ["normal", "high", "low", "mixed"])
@pytest.mark.parametrize("causal,sq,sk", [(False, 128, 200), (True, 160, 96)])  # causal 160 > 96: rows without keys
@pytest.mark.parametrize("extra", [{}, {"window_size": (32, 8), "softcap": 20.0}])
def test_dense_forward_backward(kind, causal, sq, sk, extra):
    torch.manual_seed(0)
    b, h, hk, d = 2, 4, 2, 128
    q = torch.randn(b, sq, h, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=BF16) for _ in range(2))
    sink = _sinks(h, kind, "cuda")
    out = torch.full((b, sq, h, d), float("nan"), device="cuda", dtype=BF16)
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    forward.run(Request.dense(q, k, v, None, causal, learnable_sink=sink, **extra), out=out, lse=lse)
    ref, ref_lse = attention_ref(q, k, v, None, causal, learnable_sink=sink, **extra)
    low, low_lse = attention_ref(q, k, v, None, causal, learnable_sink=sink, upcast=False, **extra)
    _close(out, ref, low, ATOL["out"], "out")
    _close(lse, ref_lse, low_lse, ATOL["lse"], "lse")
    if causal:  # rows 0..sq-sk-1 see no key
        assert (out[:, : sq - sk] == 0).all()
        _lse_is_sink(lse[:, :, : sq - sk], sink.view(1, h, 1).expand(b, h, sq - sk))

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [sink.clone().requires_grad_()]
    o, l = flash_attn_func(*leaves[:3], None, causal, return_lse=True, learnable_sink=leaves[3], **extra)
    dout, dlse = torch.randn_like(o), torch.randn_like(l)
    grads = torch.autograd.grad((o.float() * dout).sum() + (l * dlse).sum(), leaves)
    for upcast, store in ((True, "ref"), (False, "low")):
        rl = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
        ro, rlse = attention_ref(*rl[:3], None, causal, learnable_sink=rl[3], upcast=upcast, **extra)
        g = torch.autograd.grad((ro.float() * dout).sum() + (rlse.float() * dlse).sum(), rl)
        if store == "ref":
            ref_grads = g
        else:
            low_grads = g
    for name, got, r, lo in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads, low_grads):
        _close(got, r, lo, ATOL["grad"], name)


def test_varlen_forward_backward():
    torch.manual_seed(1)
    lens_q, lens_k, h, hk, d = [37, 0, 128, 5], [50, 9, 100, 0], 4, 1, 64
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hk, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
    sink = torch.tensor([30.0, -30.0, 0.5, -1.0], device="cuda", requires_grad=True)
    o, l = flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, return_lse=True, learnable_sink=sink)
    ro, rl = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, learnable_sink=sink)
    lo, ll = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, learnable_sink=sink, upcast=False)
    _close(o, ro, lo, ATOL["out"], "out")
    _close(l, rl, ll, ATOL["lse"], "lse")
    dout = torch.randn_like(o)
    grads = [torch.autograd.grad((x.float() * dout).sum() + y.float().sum(), (q, k, v, sink))
             for x, y in ((o, l), (ro, rl), (lo, ll))]
    for name, got, r, lw in zip(("dq", "dk", "dv", "dsink"), *grads):
        _close(got, r, lw, ATOL["grad"], name)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kind", ["normal", "high", "low"])
def test_decode_split_kv(num_splits, kind):
    torch.manual_seed(2)
    b, h, hk, d, s_cache = 3, 8, 2, 128, 700
    q = torch.randn(b, 1, h, d, device="cuda", dtype=BF16)
    k_cache, v_cache = (torch.randn(b, s_cache, hk, d, device="cuda", dtype=BF16) for _ in range(2))
    seqlens = torch.tensor([0, 311, 700], dtype=torch.int32, device="cuda")  # sequence 0 has no key
    sink = _sinks(h, kind, "cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits,
                                       return_lse=True, learnable_sink=sink)
    ref, ref_lse = kvcache_ref(q, k_cache, v_cache, seqlens, learnable_sink=sink)
    low, low_lse = kvcache_ref(q, k_cache, v_cache, seqlens, learnable_sink=sink, upcast=False, compute_dtype=BF16)
    _close(out, ref, low, ATOL["out"], "out")
    _close(lse, ref_lse, low_lse, ATOL["lse"], "lse")
    assert (out[0] == 0).all()
    _lse_is_sink(lse[0, :, 0], sink)
