"""GQA packing in the dense forward (FwdConfig.pack_gqa; marker gpu, skipped without CUDA).

The pack = nheads / nheads_k query heads of a KV head share each query tile (packed row r = query
r // pack of head head_kv * pack + r % pack). Here the packing policy is forced on for every mask
kind (full, causal, windows, sinks, softcap) and head dim, so the packed kernels are checked on
more than the shapes the default policy packs: out and lse against the float32 reference (the
2x-PyTorch-error rule, flash4.reference.fwd_errors), NaN-poisoned outputs, sq != sk both ways,
sequence lengths that leave the last tile partly past the sequence, and a backward through the
packed forward's LSE.
"""

import pytest
import torch

import flash4.config.sm90
from flash4 import flash_attn_func
from flash4 import forward
from flash4.request import Request
from flash4.reference import attention_ref, fwd_errors

from gpu_helpers import poisoned_fwd_buffers


@pytest.fixture(autouse=True)
def _pack_always(monkeypatch):
    """Pack every GQA problem the kernel can pack; record the configs that ran."""
    import flash4.compile.cache as cache

    seen = []
    real = cache.get_fwd_runner
    # the sm90 family's packing policy (flash4.config.sm90.with_pack_gqa reads it there)
    monkeypatch.setattr(flash4.config.sm90, "pack_gqa_wanted", lambda cfg, h, hk: True)

    def spy(cfg):
        seen.append(cfg)
        return real(cfg)

    monkeypatch.setattr(cache, "get_fwd_runner", spy)
    return seen


def _inputs(b, sq, sk, h, hk, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16)
                 for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))


def _check(q, k, v, causal=False, window=(-1, -1), softcap=0.0, sink=None):
    d = q.shape[-1]
    out, lse = poisoned_fwd_buffers(q)
    forward.run(Request.dense(q, k, v, d ** -0.5, causal, window, softcap, sink), out=out, lse=lse)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, None, causal, window_size=window, softcap=softcap, learnable_sink=sink)
    assert errs["ok"], errs


MASKS = [dict(), dict(causal=True), dict(window=(64, 0)), dict(window=(5, 9)), dict(window=(0, 0)),
         dict(window=(-1, 17)), dict(causal=True, softcap=30.0)]


@pytest.mark.parametrize("pack", [2, 4, 8])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()) or "full")
@pytest.mark.parametrize("sq, sk", [(333, 333), (200, 517), (517, 200), (1, 300)])
def test_packed_forward_d128(pack, mask, sq, sk, _pack_always):
    q, k, v = _inputs(2, sq, sk, 2 * pack, 2, 128)
    _check(q, k, v, **mask)
    assert any(c.pack_gqa == pack for c in _pack_always), _pack_always


@pytest.mark.parametrize("d", [64, 96, 192, 256])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(100, 0))], ids=["causal", "window"])
def test_packed_forward_every_headdim(d, mask, _pack_always):
    q, k, v = _inputs(1, 700, 700, 8, 1, d)  # MQA, pack 8
    _check(q, k, v, **mask)
    assert any(c.pack_gqa == 8 for c in _pack_always)


@pytest.mark.parametrize("kind", ["normal", "high", "low"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(127, 0))], ids=["causal", "window"])
def test_packed_sinks(kind, mask, _pack_always):
    q, k, v = _inputs(2, 600, 600, 16, 2, 64)
    gen = torch.Generator(device="cpu").manual_seed(3)
    sink = {"normal": torch.randn(16, generator=gen), "high": torch.full((16,), 30.0),
            "low": torch.full((16,), -30.0)}[kind].cuda()
    sink[::3] = -sink[::3]  # the heads of one tile have different sinks
    _check(q, k, v, sink=sink, **mask)
    assert any(c.pack_gqa == 8 for c in _pack_always)


def test_packed_forward_backward(_pack_always):
    """The backward reads the packed forward's LSE (same layout): gradients within the rule."""
    q, k, v = _inputs(2, 300, 300, 8, 2, 128, seed=4)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=True, window_size=(50, 0))
    dout = torch.randn_like(out)
    out.backward(dout)
    assert any(c.pack_gqa == 4 for c in _pack_always)
    for upcast in (True, False):
        ref = [t.detach().clone().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
               for t in (q, k, v)]
        o, _ = attention_ref(*ref, causal=True, upcast=upcast, window_size=(50, 0))
        o.backward(dout.float() if upcast else dout)
        if upcast:
            hi = [t.grad for t in ref]
        else:
            lo = [t.grad for t in ref]
    for got, h_, l_ in zip((t.grad for t in leaves), hi, lo):
        err, bound = (got.float() - h_).abs().max(), 2 * (l_.float() - h_).abs().max() + 1e-3
        assert err <= bound, (err, bound)
