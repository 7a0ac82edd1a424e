"""flash4.memo on the GPU (issue 25 item 4): a door's repeated call (a prepared call) gives bitwise the
result of the full host path; GQA packing through views (flash4.forward.PACK_VIEWS) gives bitwise the
result of the packing copies; a prepared kvcache decode step replays from a CUDA graph with new
lengths. (tests/cpu/test_memo_cpu.py checks the launches argument by argument on the CPU.)"""

import pytest
import torch

import flash4
from flash4 import forward, memo

from gpu_helpers import BF16, DEV, I32


def _randn(*shape, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEV, dtype=BF16)


def _cells():
    b, h, hk, d, keys, page = 2, 32, 8, 128, 8192, 64
    q, k, v = _randn(b, 1, h, d, seed=1), _randn(b, keys, hk, d, seed=2), _randn(b, keys, hk, d, seed=3)
    pages = keys // page
    k_pool, v_pool = k.view(b * pages, page, hk, d), v.view(b * pages, page, hk, d)
    table = torch.arange(b * pages, dtype=I32, device=DEV).view(b, pages)
    lens = torch.tensor([keys - 5, 3000], dtype=I32, device=DEV)
    cu_q = torch.arange(b + 1, dtype=I32, device=DEV)
    qp, kp, vp = _randn(2, 256, 8, 64, seed=4), _randn(2, 256, 2, 64, seed=5), _randn(2, 256, 2, 64, seed=6)
    sink = torch.randn(h, device=DEV)
    kv = flash4.flash_attn_with_kvcache
    return {
        "kvcache": lambda: kv(q, k, v, cache_seqlens=lens, causal=True, return_lse=True),
        "kvcache_unsplit": lambda: kv(q, k, v, cache_seqlens=lens, num_splits=1, return_lse=True),
        "kvcache_paged": lambda: kv(q, k_pool, v_pool, cache_seqlens=lens, page_table=table, causal=True,
                                    return_lse=True),
        "kvcache_sink_softcap": lambda: kv(q, k, v, cache_seqlens=lens, learnable_sink=sink, softcap=30.0,
                                           return_lse=True),
        "kvcache_window": lambda: kv(q, k, v, cache_seqlens=lens, window_size=(511, 0), return_lse=True),
        "func_decode": lambda: flash4.flash_attn_func(q, k, v, causal=True, return_lse=True),
        "func_prefill": lambda: flash4.flash_attn_func(qp, kp, vp, causal=True, window_size=(100, 0),
                                                       return_lse=True),
        "varlen_paged": lambda: flash4.flash_attn_varlen_func(q.view(b, h, d), k_pool, v_pool, cu_q, None, 1, None,
                                                              seqused_k=lens, page_table=table, causal=True,
                                                              return_lse=True),
    }


CELLS = ["kvcache", "kvcache_unsplit", "kvcache_paged", "kvcache_sink_softcap", "kvcache_window", "func_decode",
         "func_prefill", "varlen_paged"]


@pytest.mark.parametrize("cell", CELLS)
def test_prepared_call_bitwise(monkeypatch, cell):
    fn = _cells()[cell]
    monkeypatch.setattr(memo, "ENABLED", False)
    ref = [t.clone() for t in fn()]
    monkeypatch.setattr(memo, "ENABLED", True)
    memo.clear()
    first = fn()  # kept
    hits = memo.stats["hits"]
    second = fn()
    assert memo.stats["hits"] == hits + 1
    for got in (first, second):
        for a, b in zip(got, ref):
            assert torch.equal(a, b)


@pytest.mark.parametrize("cell", ["kvcache", "kvcache_unsplit", "kvcache_paged", "func_decode", "varlen_paged"])
def test_pack_views_bitwise(monkeypatch, cell):
    fn = _cells()[cell]
    monkeypatch.setattr(memo, "ENABLED", False)
    monkeypatch.setattr(forward, "PACK_VIEWS", False)
    ref = [t.clone() for t in fn()]
    monkeypatch.setattr(forward, "PACK_VIEWS", True)
    for a, b in zip(fn(), ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_splits", [0, 1])
def test_prepared_call_in_cuda_graph(num_splits):
    b, h, hk, d, keys = 2, 32, 8, 128, 8192
    q, k, v = _randn(b, 1, h, d, seed=7), _randn(b, keys, hk, d, seed=8), _randn(b, keys, hk, d, seed=9)
    lens = torch.tensor([keys, 100], dtype=I32, device=DEV)

    def step():
        return flash4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=num_splits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()  # kept, then a hit
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new in ([5000, 1], [keys, keys], [1, 7000]):
        lens.copy_(torch.tensor(new, dtype=I32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


# ================================================================ the prepared dense backward
_BWD_CELLS = {  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, options)
    "d64_causal": (2, 300, 300, 4, 4, 64, dict(causal=True)),
    "d128_full_ragged": (2, 333, 200, 4, 4, 128, dict(causal=False)),
    "gqa_split": (1, 2048, 2048, 8, 2, 128, dict(causal=True)),
    "window_sink": (1, 1024, 1024, 16, 2, 64, dict(causal=True, window_size=(127, 0), sink=True)),
    "softcap_d96": (2, 257, 257, 6, 6, 96, dict(causal=True, softcap=30.0)),
    "lse_grad": (2, 200, 300, 4, 4, 64, dict(causal=False, lse=True)),
}


@pytest.mark.parametrize("cell", sorted(_BWD_CELLS))
@pytest.mark.parametrize("deterministic", [False, True])
def test_prepared_backward_bitwise(monkeypatch, cell, deterministic):
    """flash4.ops.dense_backward from the memo (flash4.backward.PreparedBackward, the second and third
    calls) against the full host path: dk, dv bitwise; dq and dsink bitwise in deterministic mode,
    else within the atomics' reordering (relative 1e-2 of its max)."""
    b, sq, sk, h, hk, d, opts = _BWD_CELLS[cell]
    opts = dict(opts)
    sink = torch.randn(h, device=DEV, requires_grad=True) if opts.pop("sink", False) else None
    use_lse = opts.pop("lse", False)
    q, k, v = (_randn(b, s, n, d, seed=i).requires_grad_() for i, (s, n) in enumerate(((sq, h), (sk, hk), (sk, hk))))
    dout = _randn(b, sq, h, d, seed=7)

    def grads():
        out = flash4.flash_attn_func(q, k, v, deterministic=deterministic, learnable_sink=sink, return_lse=use_lse,
                                     **opts)
        loss = (out[0] * dout).sum() + out[1].sum() if use_lse else (out * dout).sum()
        inputs = (q, k, v) + ((sink,) if sink is not None else ())
        return [g.clone() for g in torch.autograd.grad(loss, inputs)]

    monkeypatch.setattr(memo, "ENABLED", False)
    ref = grads()
    monkeypatch.setattr(memo, "ENABLED", True)
    memo.clear()
    hits = memo.stats["hits"]
    for _ in range(3):
        got = grads()
        for i, (g, r) in enumerate(zip(got, ref)):
            if i in (0, 3) and not deterministic:  # dq, dsink: fp32 atomics / partial sums in any order
                assert (g.float() - r.float()).abs().max() <= 1e-2 * r.float().abs().max(), cell
            else:
                assert torch.equal(g, r), (cell, i)
    assert memo.stats["hits"] >= hits + 2, "the backward was not answered from the memo"
