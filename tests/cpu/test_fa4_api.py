"""flash4.fa4, flash-attn-4's Python API on flash4 (issue 29): signatures and defaults, the causal /
window resolution (literal sides, None unbounded), bands that exclude the diagonal through every
route (the reference stands in for the kernels: conftest.cpu_kernels), the returned LSE's rules,
refused arguments, raw forward / backward, and torch.compile's trace (ops get the literal sides)."""

from __future__ import annotations

import inspect

import pytest
import torch
from cpu_helpers import BF16, I32, cu, flash4_calls, meta_inputs, op_argument, qkv

from flash4 import fa4
from flash4.geometry import UNBOUNDED, Band, window_sides
from flash4.reference import attention_ref, attention_varlen_ref, kvcache_ref

# flash-attn-4's parameter lists (flash_attn/cute/interface.py, fa4-v4.0.0.beta27, plus b36's gather
# backward knobs at the end of the two public functions), in order, with their defaults.
FA4_FUNC = ("q", "k", "v", "qv", "gather_kv_indices", "softmax_scale", "causal", "window_size", "learnable_sink",
            "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod", "score_mod_bwd", "mask_mod",
            "aux_tensors", "aux_scalars", "block_sparse_tensors", "block_sparse_tensors_bwd", "return_lse",
            "gather_bwd_recompute_p", "gather_bwd_token_chunk")
FA4_VARLEN = ("q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "min_seqlen_k",
              "seqused_q", "seqused_k", "gather_kv_indices", "page_table", "softmax_scale", "causal", "window_size",
              "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod", "score_mod_bwd",
              "mask_mod", "block_sparse_tensors", "aux_tensors", "aux_scalars", "return_lse", "scheduler_metadata",
              "seqlen_k_per_split", "disable_scheduler_metadata", "gather_bwd_recompute_p", "gather_bwd_token_chunk")
FA4_METADATA = ("max_seqlen_q", "max_seqlen_k", "nheads", "nheads_kv", "headdim", "num_splits", "headdim_v",
                "pack_gqa", "causal", "window_size_left", "window_size_right", "seqlen_k_new", "cu_seqlens_q",
                "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q", "seqused_k", "leftpad_k", "seqlen_k_per_split",
                "_arch")
FA4_FWD = ("q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q",
           "max_seqlen_k", "min_seqlen_k", "page_table", "softmax_scale", "causal", "softcap", "window_size_left",
           "window_size_right", "learnable_sink", "tile_mn", "mma_pv_is_rs", "intra_wg_overlap", "num_threads",
           "num_splits", "pack_gqa", "_arch", "score_mod", "mask_mod", "block_sparse_tensors", "return_lse", "out",
           "lse", "aux_tensors", "aux_scalars", "q_descale", "k_descale", "v_descale", "gather_kv_indices",
           "scheduler_metadata", "seqlen_k_per_split", "disable_scheduler_metadata", "gather_bwd_recompute_p")
FA4_BWD = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap", "window_size_left",
           "window_size_right", "m_block_size", "n_block_size", "num_threads", "pack_gqa", "num_stages_Q",
           "num_stages_dO", "SdP_swapAB", "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP", "AtomLayoutNdKV",
           "AtomLayoutMdQ", "V_in_regs", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q",
           "max_seqlen_k", "deterministic", "dq", "dk", "dv", "score_mod", "score_mod_bwd", "mask_mod",
           "aux_tensors", "aux_scalars", "block_sparse_tensors", "dlse", "learnable_sink")
DEFAULTS = dict(causal=False, window_size=(None, None), softcap=0.0, num_splits=1, deterministic=False,
                return_lse=False, disable_scheduler_metadata=False, seqlen_k_new=0)


@pytest.mark.parametrize("func, names", [(fa4.flash_attn_func, FA4_FUNC), (fa4.flash_attn_varlen_func, FA4_VARLEN),
                                         (fa4.get_scheduler_metadata, FA4_METADATA), (fa4._flash_attn_fwd, FA4_FWD),
                                         (fa4._flash_attn_bwd, FA4_BWD)])
def test_signatures_are_flash_attn_4s(func, names):
    params = inspect.signature(func).parameters
    assert tuple(params) == names
    for name, default in DEFAULTS.items():
        if name in params and params[name].default is not inspect.Parameter.empty and not (
                func is fa4._flash_attn_fwd and name == "softcap"):
            assert params[name].default == default, (func.__name__, name)
    if func is fa4._flash_attn_fwd:
        assert params["softcap"].default is None and params["num_threads"].default == 384
    if func is fa4._flash_attn_bwd:
        assert params["softcap"].default == 0.0 and params["m_block_size"].default == 64


# ================================================================ causal / window resolution
@pytest.mark.parametrize("causal, left, right, expected", [
    (False, None, None, (False, Band(None, None))),
    (True, None, None, (True, Band(None, None))),
    (False, None, 0, (True, Band(None, None))),  # (None, 0) is causal
    (True, 7, None, (False, Band(7, 0))),  # causal sets right = 0: a window with causal folded in
    (True, 7, 30, (False, Band(7, 0))),
    (False, 5, 3, (False, Band(5, 3))),
    (False, None, -5, (False, Band(None, -5))),  # ends 5 keys before the diagonal
    (False, -5, None, (False, Band(-5, None))),  # starts 5 keys after it
    (False, -5, 9, (False, Band(-5, 9))),
    (False, -5, 3, (False, Band(None, None))),  # left + right < 0: no window (flash-attn-4's rule)
    (True, -1, None, (True, Band(None, None))),  # -1 + 0 < 0: no window, causal stays
    (False, -1, -1, (False, Band(None, None))),
    (False, 0, 0, (False, Band(0, 0))),
])
def test_resolve_causal_window(causal, left, right, expected):
    assert fa4.resolve_causal_window(causal, left, right) == expected


def test_band_kernel_sides():
    """A Band's kernel sides are its literal sides (UNBOUNDED for None); flash-attn 2/3's -1 stays unbounded."""
    assert window_sides(Band(None, -5), False) == (UNBOUNDED, -5)
    assert window_sides(Band(-5, None), False) == (-5, UNBOUNDED)
    assert window_sides(Band(None, None), False) is None and window_sides(Band(None, 0), True) is None
    assert window_sides((-1, 5), False) == (UNBOUNDED, 5)


@pytest.mark.parametrize("window", [(1.5, None), ("a", 2), (None, True)])
def test_window_types(window):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="window_size_"):
        fa4.flash_attn_func(q, k, v, window_size=window)
    with pytest.raises(TypeError, match="window_size"):
        fa4.flash_attn_func(q, k, v, window_size=5)


# ================================================================ bands through every route
BANDS = [(None, -5), (-5, None), (-3, 9), (4, -2), (None, -40), (-40, None), (2, 3)]


def _band_rows_empty(sq, sk, window):
    """Rows of a (sq, sk) problem whose band holds no key (literal sides)."""
    left, right = window
    rows = []
    for i in range(sq):
        lo = 0 if left is None else max(0, i + sk - sq - left)
        hi = sk - 1 if right is None else min(sk - 1, i + sk - sq + right)
        if lo > hi:
            rows.append(i)
    return rows


@pytest.mark.parametrize("window", BANDS)
def test_dense_band_forward_backward(cpu_kernels, unchecked, window):
    """flash_attn_func with a band: the request holds the literal sides, out / lse / grads equal the
    reference's, rows without keys give out 0, lse -inf and zero dq."""
    q, k, v = (t.float() for t in qkv(sq=20, sk=24))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa4.flash_attn_func(*leaves, window_size=window, return_lse=True)
    resolved = fa4.resolve_causal_window(False, *window)[1]
    assert cpu_kernels[-1]["window_size"] == resolved
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*ref_leaves, None, False, window_size=resolved)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)
    ref.backward(dout)
    assert cpu_kernels.backward[-1]["window_size"] == resolved
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert torch.allclose(leaf.grad, ref_leaf.grad, atol=1e-5)
    empty = _band_rows_empty(20, 24, resolved)
    if empty:
        assert (out[:, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()
        assert (leaves[0].grad[:, empty] == 0).all()


@pytest.mark.parametrize("window", BANDS[:4])
def test_varlen_band_packed_and_4d(cpu_kernels, window):
    """flash_attn_varlen_func with a band, packed rows and a 4-D q / k / v with seqused_k (packed
    route): the reference's result per sequence; lse in flash-attn-4's layouts."""
    gen = torch.Generator().manual_seed(2)
    len_q, len_k = (3, 0, 9), (12, 4, 7)
    q = torch.randn(sum(len_q), 4, 64, generator=gen).to(BF16)
    k = torch.randn(sum(len_k), 2, 64, generator=gen).to(BF16)
    v = torch.randn(sum(len_k), 2, 64, generator=gen).to(BF16)
    band = fa4.resolve_causal_window(False, *window)[1]
    out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu(len_q), cu_seqlens_k=cu(len_k), max_seqlen_q=9,
                                          max_seqlen_k=12, window_size=window, return_lse=True)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu(len_q), cu(len_k), window_size=band)
    assert cpu_kernels[-1]["window_size"] == band and lse.shape == (4, sum(len_q))
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)

    q4, k4, v4 = qkv(b=2, sq=10, sk=14)
    seqused_k = torch.tensor([14, 9], dtype=I32)
    leaves = [t.clone().requires_grad_() for t in (q4, k4, v4)]  # a gradient: not the KV-cache route
    out, lse = fa4.flash_attn_varlen_func(*leaves, seqused_k=seqused_k, window_size=window, return_lse=True)
    assert cpu_kernels[-1]["layout"] == "varlen" and out.shape == (2, 10, 4, 64) and lse.shape == (2, 4, 10)
    for b in range(2):
        n = int(seqused_k[b])
        ref, ref_lse = attention_ref(q4[b:b + 1], k4[b:b + 1, :n], v4[b:b + 1, :n], None, False, window_size=band)
        assert torch.equal(out[b:b + 1].detach(), ref.to(BF16)) and torch.equal(lse[b:b + 1].detach(), ref_lse)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("window", [(None, -3), (-2, None)])
def test_kvcache_route_band(cpu_kernels, paged, window):
    """A 4-D q over a dense cache or a paged pool with seqused_k, no gradient: flash4's KV-cache door
    (a decode step), num_splits handed over, the band as given."""
    gen = torch.Generator().manual_seed(3)
    b, sq, hk, d = 2, 3, 2, 64
    q = torch.randn(b, sq, 4, d, generator=gen).to(BF16)
    seqlens = torch.tensor([30, 17], dtype=I32)
    if paged:
        k = torch.randn(8, 16, hk, d, generator=gen).to(BF16)
        v = torch.randn(8, 16, hk, d, generator=gen).to(BF16)
        table = torch.tensor([[3, 1], [6, 0]], dtype=I32)
    else:
        k = torch.randn(b, 32, hk, d, generator=gen).to(BF16)
        v = torch.randn(b, 32, hk, d, generator=gen).to(BF16)
        table = None
    out, lse = fa4.flash_attn_varlen_func(q, k, v, seqused_k=seqlens, page_table=table, window_size=window,
                                          num_splits=3, return_lse=True)
    call = cpu_kernels[-1]
    assert call.get("decode") and call["num_splits"] == 3 and call["window_size"] == Band(*window)
    ref, ref_lse = kvcache_ref(q, k, v, seqlens, page_table=table, window_size=Band(*window))
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)


# ================================================================ returned lse, gradients
def test_lse_rules(cpu_kernels, unchecked):
    q, k, v = (t.float() for t in qkv())
    out, lse = fa4.flash_attn_func(q, k, v)
    assert lse is None  # nothing asks for it
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa4.flash_attn_func(*leaves)
    assert lse is not None and not lse.requires_grad and lse.shape == (2, 4, 16)  # computed, no gradient
    out, lse = fa4.flash_attn_func(*leaves, return_lse=True)
    assert lse.requires_grad  # differentiable
    lse.sum().backward()
    assert cpu_kernels.backward[-1]["dlse"] is not None


def test_learnable_sink_gradient(cpu_kernels, unchecked):
    q, k, v = (t.float() for t in qkv())
    sink = torch.randn(4, generator=torch.Generator().manual_seed(4)).requires_grad_()
    out, _ = fa4.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    out.sum().backward()
    sink_ref = sink.detach().clone().requires_grad_()
    ref, _ = attention_ref(q, k, v, None, True, learnable_sink=sink_ref)
    ref.sum().backward()
    assert torch.allclose(sink.grad, sink_ref.grad, atol=1e-5)


# ================================================================ refusals and errors
@pytest.mark.parametrize("kwargs, name", [
    (dict(qv="x"), "qv"), (dict(gather_kv_indices="x"), "gather_kv_indices"), (dict(score_mod=abs), "score_mod"),
    (dict(mask_mod=abs), "mask_mod"), (dict(aux_tensors=["x"]), "aux_tensors"),
    (dict(block_sparse_tensors="x"), "block_sparse_tensors"), (dict(score_mod_bwd=abs), "score_mod_bwd"),
])
def test_refused_arguments(kwargs, name):
    q, k, v = qkv()
    for func in (fa4.flash_attn_func, fa4.flash_attn_varlen_func):
        with pytest.raises(NotImplementedError, match=name):
            func(q, k, v, **kwargs)
    with pytest.raises(NotImplementedError, match="seqlen_k_per_split"):
        fa4.flash_attn_varlen_func(q, k, v, seqlen_k_per_split=64)
    with pytest.raises(NotImplementedError, match="q_descale"):
        fa4._flash_attn_fwd(q, k, v, q_descale=torch.ones(1))
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(NotImplementedError, match="fp8"):
            fa4.flash_attn_func(q.to(torch.float8_e4m3fn), k, v)


def test_gather_knobs_need_gather_indices():
    with pytest.raises(ValueError, match="gather_kv_indices is not set"):
        fa4.flash_attn_func(*qkv(), gather_bwd_recompute_p=True)


@pytest.mark.parametrize("head_dim", [4, 12, 264])
def test_head_dim_error_is_flash_attn_4s(head_dim):
    q = torch.zeros(1, 8, 2, head_dim, dtype=BF16)
    with pytest.raises(AssertionError, match=rf"\(head_dim, head_dim_v\)=\({head_dim}, {head_dim}\) is not supported"):
        fa4.flash_attn_func(q, q, q)
    with pytest.raises(ValueError):
        fa4.flash_attn_func(q, q, q)


def test_paged_pool_at_a_padded_head_dim_is_refused():
    q = torch.zeros(5, 2, 80, dtype=BF16)
    pool = torch.zeros(4, 16, 2, 80, dtype=BF16)
    with pytest.raises(NotImplementedError, match="paged"):
        fa4.flash_attn_varlen_func(q, pool, pool, cu_seqlens_q=cu((5,)), seqused_k=torch.tensor([20], dtype=I32),
                                   page_table=torch.zeros(1, 2, dtype=I32))


def test_scheduler_metadata_is_a_hint(cpu_kernels):
    meta = fa4.get_scheduler_metadata(10, 12, 4, 2, 64, 1, cu_seqlens_q=cu((3, 7)), cu_seqlens_k=cu((5, 7)))
    with pytest.raises(NotImplementedError, match="tile_count_semaphore"):
        meta.tile_count_semaphore  # noqa: B018
    args = dict(q=torch.randn(10, 4, 64).to(BF16), k=torch.randn(12, 2, 64).to(BF16),
                v=torch.randn(12, 2, 64).to(BF16))
    out, _ = fa4.flash_attn_varlen_func(**args, cu_seqlens_q=cu((3, 7)), cu_seqlens_k=cu((5, 7)),
                                        scheduler_metadata=meta, pack_gqa=True)
    assert out.shape == (10, 4, 64)
    with pytest.raises(AssertionError, match="requires at least one"):
        fa4.get_scheduler_metadata(10, 12, 4, 2, 64, 1)


# ================================================================ raw forward / backward
def test_raw_forward_backward(cpu_kernels):
    """_flash_attn_fwd fills preallocated out / lse; _flash_attn_bwd gives the reference's gradients
    and dsink, with a band (dense) and packed (cu_seqlens)."""
    q, k, v = qkv(sq=12, sk=20)
    sink = torch.randn(4, generator=torch.Generator().manual_seed(5))
    out = torch.full((2, 12, 4, 64), float("nan"), dtype=BF16)
    lse = torch.full((2, 4, 12), float("nan"))
    o, l, p, m = fa4._flash_attn_fwd(q, k, v, window_size_left=-2, window_size_right=None, learnable_sink=sink,
                                     out=out, lse=lse)
    assert o is out and l is lse and p is None and m is None and not torch.isnan(out.float()).any()
    ref, ref_lse = attention_ref(q, k, v, None, False, window_size=Band(-2, None), learnable_sink=sink)
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)
    assert fa4._flash_attn_fwd(q, k, v)[1] is None
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(BF16)
    dq, dk, dv, dsink = fa4._flash_attn_bwd(q, k, v, out, dout, lse, window_size_left=-2, learnable_sink=sink)
    leaves = [t.float().requires_grad_() for t in (q, k, v)] + [sink.clone().requires_grad_()]
    r, _ = attention_ref(*leaves[:3], None, False, window_size=Band(-2, None), learnable_sink=leaves[3])
    # dsink from each row's D = sum_j P dP of the backward (flash4.backward.run's delta; here the CPU
    # stand-in's, rowsum(dout * O) of the float32 output): the reference's to fp32 rounding, where the
    # same formula on the bf16 out (the old sink_grad) differs by its rounding
    from flash4.autograd import sink_grad
    ref_dsink = torch.autograd.grad(r, leaves[3], dout.float())[0]
    assert torch.allclose(dsink, ref_dsink, atol=1e-4, rtol=1e-4)
    assert torch.allclose(sink_grad(sink, out, dout, lse, None, 2), ref_dsink, atol=0.05, rtol=0.05)
    # dq / dk / dv without a sink: the CPU stand-in recomputes P from q, k, v (the kernels read the
    # forward's sink-including lse instead)
    o, l, _, _ = fa4._flash_attn_fwd(q, k, v, window_size_left=-2, return_lse=True)
    dq, dk, dv = fa4._flash_attn_bwd(q, k, v, o, dout, l, window_size_left=-2)
    r, _ = attention_ref(*leaves[:3], None, False, window_size=Band(-2, None))
    grads = torch.autograd.grad(r, leaves[:3], dout.float())
    for g, ref_g in zip((dq, dk, dv), grads):
        assert torch.allclose(g.float(), ref_g, atol=2e-2, rtol=2e-2)
    assert (dq[:, -2:] == 0).all()  # the last two rows' bands start past the last key

    q_rows, k_rows, v_rows = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    cu_q, cu_k = cu((12, 12)), cu((20, 20))
    o, l, _, _ = fa4._flash_attn_fwd(q_rows, k_rows, v_rows, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=12,
                                     max_seqlen_k=20, causal=True, return_lse=True)
    dq2, dk2, dv2 = fa4._flash_attn_bwd(q_rows, k_rows, v_rows, o, dout.reshape(24, 4, 64), l, causal=True,
                                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=12, max_seqlen_k=20)
    assert cpu_kernels.backward[-1]["request"].seq.layout == "varlen", cpu_kernels.backward[-1]["request"].seq.layout
    assert dq2.shape == q_rows.shape


# ================================================================ torch.compile
def test_compile_fullgraph_passes_the_band():
    """torch.compile(fullgraph=True) of flash4.fa4.flash_attn_func with a band (meta tensors, forward
    and backward): one graph, flash4's ops, the literal sides on both."""
    import torch._dynamo
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    def loss_fn(q, k, v):
        out, lse = fa4.flash_attn_func(q, k, v, window_size=(None, -5), return_lse=True)
        return out.float().sum() + lse.sum()

    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    q, k, v = meta_inputs()
    torch.compile(loss_fn, fullgraph=True, backend=backend)(q, k, v).backward()
    calls = [c for g in backend.fw_graphs + backend.bw_graphs for c in flash4_calls(g)]
    assert [str(c.target) for c in calls] == ["flash4.fwd.default", "flash4.bwd.default"]
    assert all((op_argument(c, "window_left"), op_argument(c, "window_right")) == (None, -5) for c in calls)


# ================================================================ page sizes, layouts
def test_page_size_flash4_lacks_is_refused(monkeypatch):
    """With FLASH4_SMALL_PAGES=0 page sizes must be multiples of 8 (flash4.config.served_page_rows):
    others are refused as not implemented, naming FLASH4_SMALL_PAGES."""
    monkeypatch.setenv("FLASH4_SMALL_PAGES", "0")
    q = torch.zeros(5, 4, 64, dtype=BF16)
    pool = torch.zeros(20, 4, 2, 64, dtype=BF16)  # pages of 4 rows
    with pytest.raises(NotImplementedError, match="page_size=4.*FLASH4_SMALL_PAGES"):
        fa4.flash_attn_varlen_func(q, pool, pool, cu_seqlens_q=cu((5,)), seqused_k=torch.tensor([20], dtype=I32),
                                   page_table=torch.zeros(1, 5, dtype=I32))


def test_small_pages_pass_through_when_enabled(cpu_kernels, monkeypatch):
    """By default (FLASH4_SMALL_PAGES unset) a page size of 4 reaches flash4's paged door and gives a result."""
    monkeypatch.delenv("FLASH4_SMALL_PAGES", raising=False)
    q = torch.randn(5, 4, 64, dtype=BF16)
    pool = torch.randn(20, 4, 2, 64, dtype=BF16)  # pages of 4 rows
    out, lse = fa4.flash_attn_varlen_func(q, pool, pool, cu_seqlens_q=cu((5,)), seqused_k=torch.tensor([20], dtype=I32),
                                          page_table=torch.arange(5, dtype=I32)[None], max_seqlen_q=5)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()


def test_unaligned_inputs_are_copied(cpu_kernels):
    """A q whose last dim is strided, or whose base address is not 16-byte aligned: contiguous copies
    (flash-attn-4 canonicalizes such inputs too); the result equals the aligned call's."""
    q, k, v = qkv()
    base = torch.zeros(q.numel() + 1, dtype=BF16)
    shifted = base[1:].view(q.shape)
    shifted.copy_(q)
    strided = torch.zeros(*q.shape[:-1], 2 * q.shape[-1], dtype=BF16)[..., ::2]
    strided.copy_(q)
    want, _ = fa4.flash_attn_func(q, k, v)
    for odd in (shifted, strided):
        got, _ = fa4.flash_attn_func(odd, k, v)
        assert torch.equal(got, want)


# ================================================================ bands run the window kernels
def test_band_plans_are_the_window_plans():
    """A band is a runtime value of the local kernels: its forward and backward plans (configs) equal
    those of a non-negative window (no new kernels)."""
    from flash4.config import bwd_config, fwd_config
    from flash4.request import Request

    q, k, v = qkv(sq=300, sk=300, d=128)
    for hk_v in ((k, v),):
        plans = {fwd_config(Request.dense(q, *hk_v, 0.1, False, window), 90).cfg
                 for window in (Band(None, -5), Band(-5, None), Band(7, 9), (7, 9))}
        assert len(plans) == 1 and next(iter(plans)).local
        bplans = {bwd_config(Request.dense(q, *hk_v, 0.1, False, window), 90).cfg
                  for window in (Band(None, -5), Band(-5, None), (7, 9))}
        assert len(bplans) == 1 and next(iter(bplans)).local


def test_band_forward_compiles_for_sm90(compiled_clean):
    """The kernel a band request selects compiles for sm_90a without spills (CUTE_DSL_ARCH=sm_90a)."""
    pytest.importorskip("cutlass")
    from flash4.compile.check import compile_check
    from flash4.config import fwd_config
    from flash4.request import Request

    q, k, v = qkv(sq=300, sk=300, d=128)
    cfg = fwd_config(Request.dense(q, k, v, 0.1, False, Band(None, -5)), 90).cfg
    compiled_clean(compile_check([cfg])[0])
