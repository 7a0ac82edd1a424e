"""flash_attn_varlen_func / flash_attn_with_kvcache without a GPU: every argument error (CPU
tensors: metadata checks run before the device check), the on-device value checks
(check_seqlens), the varlen / paged / kvcache reference against a brute-force loop, the paged
layout helper, and the API's plumbing (packing, in-place append, cache_batch_idx offsets, lse
layouts, autograd routing, empty fast paths) with the kernels replaced by reference stand-ins
that honour flash4.varlen's contract."""

import math

import pytest
import torch

import flash4
from flash4 import api, validate
from flash4.autograd import DOUBLE_BACKWARD_ERROR, PAGED_BACKWARD_ERROR, FlashAttnVarlenFunc
from flash4.config import LOG2E, SUPPORTED_HEADDIMS
from flash4.reference import (PAGED_LAYOUTS, attention_ref, attention_varlen_ref, gather_paged, kvcache_ref,
                              max_abs_err, paged_kv_cache, paged_kv_to_varlen, varlen_fwd_errors, varlen_row_mask)
from flash4.validate import (check_kvcache_inputs, check_kvcache_seqlens, check_varlen_inputs, check_varlen_seqlens,
                             kvcache_support_error, resolve_max_seqlen, varlen_support_error)

BF16, F64, I32 = torch.bfloat16, torch.float64, torch.int32


def cu(lengths):
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=I32)


def varlen_args(len_q=(3, 0, 5), len_k=(4, 2, 0), h=4, hk=2, d=64, dtype=BF16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(len_q), h, d, generator=gen).to(dtype)
    k = torch.randn(sum(len_k), hk, d, generator=gen).to(dtype)
    v = torch.randn(sum(len_k), hk, d, generator=gen).to(dtype)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu(len_q), cu_seqlens_k=cu(len_k))


def paged_args(len_q=(3, 0, 5), len_k=(20, 0, 33), h=4, hk=2, d=64, page_size=16, layout="separate"):
    args = varlen_args(len_q, len_k, h, hk, d)
    k_cache, v_cache, page_table, seqused_k = paged_kv_cache(args["k"], args["v"], args["cu_seqlens_k"], page_size,
                                                             layout=layout)
    return dict(q=args["q"], k=k_cache, v=v_cache, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=None,
                page_table=page_table, seqused_k=seqused_k)


def varlen_raises(exc, match=(), **kwargs):
    """check_varlen_inputs and the public function raise exc with every fragment of `match`;
    varlen_support_error returns that message."""
    with pytest.raises(exc) as info:
        check_varlen_inputs(**kwargs)
    message = str(info.value)
    for fragment in match:
        assert fragment in message, (fragment, message)
    assert varlen_support_error(**kwargs) == message
    with pytest.raises(exc) as info:
        flash4.flash_attn_varlen_func(**kwargs)
    assert str(info.value) == message
    return message


# ================================================================ varlen argument errors
def test_valid_cpu_inputs_only_fail_on_device():
    varlen_raises(ValueError, ("q is on cpu", "CUDA"), **varlen_args())
    varlen_raises(ValueError, ("q is on cpu",), **paged_args())
    varlen_raises(ValueError, ("q is on cpu",), **varlen_args(len_q=(), len_k=()))  # batch 0


@pytest.mark.parametrize("which", ["q", "k", "v", "cu_seqlens_q"])
def test_non_tensor(which):
    args = varlen_args()
    args[which] = args[which].tolist()
    varlen_raises(TypeError, (f"{which} must be", "list"), **args)


def test_cu_seqlens_q_none():
    args = varlen_args()
    args["cu_seqlens_q"] = None
    varlen_raises(TypeError, ("cu_seqlens_q must be an int32 torch.Tensor", "NoneType"), **args)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.int16, torch.uint8])
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table"])
def test_metadata_dtype(which, dtype):
    args = paged_args() if which == "page_table" else varlen_args()
    if which == "seqused_q":
        args[which] = torch.tensor([1, 0, 2])
    if which == "seqused_k" and which not in args:
        args[which] = torch.tensor([1, 1, 0])
    args[which] = args[which].to(dtype)
    varlen_raises(TypeError, (f"{which}.dtype is {dtype}", "torch.int32", f"{which}.to(torch.int32)"), **args)


def test_qkv_dtypes():
    args = varlen_args()
    varlen_raises(TypeError, ("q.dtype is torch.float32",), **dict(args, q=args["q"].float()))
    varlen_raises(TypeError, ("k.dtype is torch.float16", "share one dtype"), **dict(args, k=args["k"].half()))
    varlen_raises(TypeError, ("v.dtype is torch.float32",), **dict(args, v=args["v"].float()))


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_types_and_values(which):
    args = varlen_args()
    varlen_raises(TypeError, (which, "float"), **dict(args, **{which: 5.0}))
    varlen_raises(TypeError, (which, "bool"), **dict(args, **{which: True}))
    varlen_raises(TypeError, (which, "torch.float32 tensor"), **dict(args, **{which: torch.tensor(5.0)}))
    varlen_raises(ValueError, (which, "0-d tensor", "(1,)"), **dict(args, **{which: torch.tensor([5])}))
    varlen_raises(ValueError, (f"{which} must be >= 0", "-1"), **dict(args, **{which: -1}))
    for ok in (5, torch.tensor(5), torch.tensor(5, dtype=torch.int64), None, 0):
        varlen_raises(ValueError, ("q is on cpu",), **dict(args, **{which: ok}))


def test_ranks():
    args = varlen_args()
    varlen_raises(ValueError, ("q must be 3-D (total_q, nheads, headdim)", "(8, 4, 64, 1)"),
                  **dict(args, q=args["q"][..., None]))
    k4 = args["k"].view(3, 2, 2, 64)
    varlen_raises(ValueError, ("k must be 3-D (total_k, nheads_k, headdim)", "needs page_table"), **dict(args, k=k4))
    paged = paged_args()
    varlen_raises(ValueError, ("v must be 4-D (num_pages, page_size, nheads_k, headdim)", "page_table"),
                  **dict(paged, v=paged["v"][0]))
    varlen_raises(ValueError, ("cu_seqlens_q must be 1-D (batch + 1,)",), **dict(args, cu_seqlens_q=args["cu_seqlens_q"][None]))
    varlen_raises(ValueError, ("page_table must be 2-D",), **dict(paged, page_table=paged["page_table"][0]))
    varlen_raises(ValueError, ("batch + 1 >= 1 entries",), **dict(args, cu_seqlens_q=torch.zeros(0, dtype=I32)))


def test_batch_mismatches():
    args = varlen_args()
    varlen_raises(ValueError, ("cu_seqlens_k has 3 entries but cu_seqlens_q has 4",),
                  **dict(args, cu_seqlens_k=args["cu_seqlens_k"][:3]))
    varlen_raises(ValueError, ("seqused_q must have shape (batch,) = (3,)", "(2,)"),
                  **dict(args, seqused_q=torch.zeros(2, dtype=I32)))
    varlen_raises(ValueError, ("seqused_k must have shape (batch,) = (3,)",), **dict(args, seqused_k=torch.zeros(4, dtype=I32)))
    paged = paged_args()
    varlen_raises(ValueError, ("page_table must have shape (batch, max_pages_per_seq) with batch = 3",),
                  **dict(paged, page_table=paged["page_table"][:2]))


def test_paged_needs_seqused_k_and_no_cu_seqlens_k():
    paged = paged_args()
    varlen_raises(ValueError, ("cu_seqlens_k must be None when page_table is given",),
                  **dict(paged, cu_seqlens_k=cu([20, 0, 33])))
    varlen_raises(ValueError, ("seqused_k (batch,) int32 is required with page_table",), **dict(paged, seqused_k=None))
    args = varlen_args()
    varlen_raises(ValueError, ("cu_seqlens_k is None; it is required unless K/V are paged",),
                  **dict(args, cu_seqlens_k=None))


def test_head_rules():
    varlen_raises(ValueError, ("k.shape[2] (headdim) is 128 but q.shape[2] is 64",),
                  **dict(varlen_args(), k=varlen_args(d=128)["k"], v=varlen_args(d=128)["v"]))
    args = varlen_args()
    varlen_raises(ValueError, ("v must have the shape of k", "(6, 1, 64)"), **dict(args, v=args["v"][:, :1]))
    varlen_raises(ValueError, ("nheads_k=3 (k.shape[1]) must divide nheads=4 (q.shape[1])",), **varlen_args(hk=3))
    varlen_raises(ValueError, ("must be >= 1",), **varlen_args(h=0, hk=0))
    # multiples of 8 without a kernel are zero-padded (flash4.headdim); others get the rule
    message = varlen_raises(ValueError, (r"headdim 100 (q/k.shape[2]) is not supported", "multiple of 8"),
                            **varlen_args(d=100))
    assert all(str(d) in message for d in SUPPORTED_HEADDIMS)
    assert varlen_support_error(**varlen_args(d=80)) is None or "headdim" not in varlen_support_error(**varlen_args(d=80))
    with pytest.raises(ValueError, match="CUDA"):  # 80 is served (padded to 96): only the device is wrong
        flash4.flash_attn_varlen_func(**varlen_args(d=80))
    paged = paged_args(hk=2)
    varlen_raises(ValueError, ("nheads_k=3 (k.shape[2])",), **dict(paged, q=torch.randn(8, 4, 64, dtype=BF16),
                                                                 k=torch.randn(4, 16, 3, 64, dtype=BF16),
                                                                 v=torch.randn(4, 16, 3, 64, dtype=BF16)))


@pytest.mark.parametrize("d", SUPPORTED_HEADDIMS)
def test_every_headdim_passes_metadata(d):
    assert "q is on cpu" in varlen_support_error(**varlen_args(d=d))
    assert "q is on cpu" in varlen_support_error(**paged_args(d=d))


@pytest.mark.parametrize("page_size", [1, 4, 12, 20])
def test_unsupported_page_sizes(page_size):
    paged = paged_args()
    k = torch.randn(6, page_size, 2, 64, dtype=BF16)
    varlen_raises(ValueError, (f"page_size={page_size}", "multiple of 8", "16, 32, 64, 128, 256"),
                  **dict(paged, k=k, v=k.clone()))


@pytest.mark.parametrize("page_size", [8, 16, 24, 32, 64, 128, 256])
@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
def test_supported_page_sizes_and_interleaved_layouts(page_size, layout):
    assert "q is on cpu" in varlen_support_error(**paged_args(page_size=page_size, layout=layout))


def test_strides_scale_causal():
    args = varlen_args()
    q = torch.randn(8, 4, 128, dtype=BF16)[..., ::2]
    varlen_raises(ValueError, ("q has stride(-1)=2",), **dict(args, q=q))
    varlen_raises(ValueError, ("softmax_scale must be finite and > 0",), **dict(args, softmax_scale=-1.0))
    varlen_raises(TypeError, ("softmax_scale must be a float",), **dict(args, softmax_scale="1"))
    varlen_raises(TypeError, ("causal must be a bool",), **dict(args, causal=1))


@pytest.mark.parametrize("which", ["k", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"])
def test_metadata_on_another_device(which):
    args = varlen_args()
    if which.startswith("seqused"):
        args[which] = torch.zeros(3, dtype=I32)
    args[which] = args[which].to("meta")
    varlen_raises(ValueError, (f"{which} is on meta but q is on cpu", f"{which}.to(q.device)"), **args)


def test_public_flag_types():
    for flag in ("return_lse", "deterministic", "check_seqlens"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            flash4.flash_attn_varlen_func(**varlen_args(), **{flag: "yes"})


# ================================================================ check_seqlens (values on the device)
def seqlens_ok(args, **kw):
    check_varlen_seqlens(args["cu_seqlens_q"], args.get("cu_seqlens_k"), args["q"].shape[0], args["k"].shape[0], **kw)


def seqlens_raises(match, args, **kw):
    with pytest.raises(ValueError) as info:
        seqlens_ok(args, **kw)
    for fragment in match:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_check_seqlens_accepts_valid_metadata():
    args = varlen_args()
    seqlens_ok(args)
    seqlens_ok(args, seqused_q=torch.tensor([3, 0, 1], dtype=I32), seqused_k=torch.tensor([0, 2, 0], dtype=I32),
               max_seqlen_q=5, max_seqlen_k=torch.tensor(4))
    paged = paged_args()
    seqlens_ok(paged, seqused_k=paged["seqused_k"], page_table=paged["page_table"], num_pages=paged["k"].shape[0],
               page_size=16)
    seqlens_ok(varlen_args(len_q=(), len_k=()))


@pytest.mark.parametrize("which, total", [("cu_seqlens_q", 8), ("cu_seqlens_k", 6)])
def test_check_seqlens_cu_seqlens(which, total):
    args = varlen_args()
    bad = args[which].clone()
    bad[0] = 1
    seqlens_raises((f"{which}[0] is 1", "starting at 0"), dict(args, **{which: bad}))
    bad = args[which].clone()
    bad[2] = bad[1] - 1
    seqlens_raises((f"{which} is not non-decreasing", f"{which}[1]=", f"{which}[2]="), dict(args, **{which: bad}))
    bad = args[which].clone()
    bad[-1] = total + 1
    seqlens_raises((f"{which}[-1]={total + 1} is past the end",), dict(args, **{which: bad}))


def test_check_seqlens_seqused():
    args = varlen_args()  # len_q (3, 0, 5), len_k (4, 2, 0)
    seqlens_raises(("seqused_q[2]=6 is outside [0, cu_seqlens_q[b + 1] - cu_seqlens_q[b]] = [0, 5]",),
                   args, seqused_q=torch.tensor([3, 0, 6], dtype=I32))
    seqlens_raises(("seqused_k[0]=-1",), args, seqused_k=torch.tensor([-1, 0, 0], dtype=I32))
    paged = paged_args()  # 3 pages per row at most (2 + 1 extra column), page 16
    capacity = paged["page_table"].shape[1] * 16
    seqlens_raises((f"seqused_k[1]={capacity + 1}", "page_table.shape[1] * page_size"), paged,
                   seqused_k=torch.tensor([20, capacity + 1, 33], dtype=I32), page_table=paged["page_table"],
                   num_pages=paged["k"].shape[0], page_size=16)


def test_check_seqlens_page_indices():
    paged = paged_args()
    num_pages = paged["k"].shape[0]
    kw = dict(seqused_k=paged["seqused_k"], page_table=paged["page_table"], num_pages=num_pages, page_size=16)
    bad = paged["page_table"].clone()
    bad[2, 2] = num_pages  # sequence 2 (33 keys) uses pages 0..2 of its row
    seqlens_raises((f"page_table[2, 2]={num_pages} is not a page of the cache", f"num_pages = {num_pages}",
                    "uses pages 0..2"), paged, **dict(kw, page_table=bad))
    bad = paged["page_table"].clone()
    bad[0, 0] = -1
    seqlens_raises(("page_table[0, 0]=-1",), paged, **dict(kw, page_table=bad))
    fine = paged["page_table"].clone()
    fine[1, :] = 10 ** 6  # sequence 1 has no keys: its row is never read
    fine[0, 2] = -5  # sequence 0 (20 keys) reads pages 0..1 only
    seqlens_ok(paged, **dict(kw, page_table=fine))


def test_check_seqlens_max_seqlen():
    args = varlen_args()  # longest q 5, longest k 4
    seqlens_raises(("max_seqlen_q=4 is below the longest sequence (5)",), args, max_seqlen_q=4)
    seqlens_raises(("max_seqlen_k=3 is below the longest sequence (4)",), args, max_seqlen_k=torch.tensor(3))
    seqlens_ok(args, max_seqlen_q=2, seqused_q=torch.tensor([2, 0, 1], dtype=I32))


def test_resolve_max_seqlen():
    c = cu([3, 0, 5])
    assert resolve_max_seqlen("m", 7, c, None) == 7
    assert resolve_max_seqlen("m", torch.tensor(6), c, None) == 6
    assert resolve_max_seqlen("m", None, c, None) == 5
    assert resolve_max_seqlen("m", None, c, torch.tensor([1, 0, 2], dtype=I32)) == 2
    assert resolve_max_seqlen("m", None, cu([]), None) == 0
    with pytest.raises(ValueError, match="m must be >= 0"):
        resolve_max_seqlen("m", torch.tensor(-2), c, None)


# ================================================================ kvcache argument errors
def kv_args(b=3, sq=1, s_cache=40, h=4, hk=2, d=64, s_new=1, paged=False, page_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    args = dict(q=torch.randn(b, sq, h, d, generator=gen).to(BF16))
    if paged:
        pages_per_seq = -(-s_cache // page_size)
        num_pages = b * pages_per_seq + 2
        args["k_cache"] = torch.randn(num_pages, page_size, hk, d, generator=gen).to(BF16)
        args["v_cache"] = torch.randn(num_pages, page_size, hk, d, generator=gen).to(BF16)
        args["page_table"] = torch.randperm(num_pages, generator=gen)[: b * pages_per_seq].view(b, pages_per_seq).to(I32)
    else:
        args["k_cache"] = torch.randn(b, s_cache, hk, d, generator=gen).to(BF16)
        args["v_cache"] = torch.randn(b, s_cache, hk, d, generator=gen).to(BF16)
    if s_new:
        args["k"] = torch.randn(b, s_new, hk, d, generator=gen).to(BF16)
        args["v"] = torch.randn(b, s_new, hk, d, generator=gen).to(BF16)
    args["cache_seqlens"] = torch.randint(0, s_cache - s_new + 1, (b,), generator=gen).to(I32)
    return args


def kv_raises(exc, match=(), **kwargs):
    with pytest.raises(exc) as info:
        check_kvcache_inputs(**kwargs)
    message = str(info.value)
    for fragment in match:
        assert fragment in message, (fragment, message)
    assert kvcache_support_error(**kwargs) == message
    with pytest.raises(exc) as info:
        flash4.flash_attn_with_kvcache(**kwargs)
    assert str(info.value) == message
    return message


def test_kvcache_valid_cpu_inputs_only_fail_on_device():
    kv_raises(ValueError, ("q is on cpu",), **kv_args())
    kv_raises(ValueError, ("q is on cpu",), **kv_args(paged=True))
    kv_raises(ValueError, ("q is on cpu",), **kv_args(s_new=0))
    kv_raises(ValueError, ("q is on cpu",), **dict(kv_args(s_new=0), cache_seqlens=None))
    kv_raises(ValueError, ("q is on cpu",), **dict(kv_args(), cache_seqlens=39))
    kv_raises(ValueError, ("q is on cpu",), **dict(kv_args(), num_splits=1))


def test_kvcache_types_and_dtypes():
    args = kv_args()
    kv_raises(TypeError, ("k_cache must be a torch.Tensor",), **dict(args, k_cache=None))
    kv_raises(TypeError, ("cache_seqlens must be a Python int",), **dict(args, cache_seqlens=3.0))
    kv_raises(TypeError, ("cache_seqlens must be a Python int",), **dict(args, cache_seqlens=True))
    kv_raises(TypeError, ("cache_seqlens.dtype is torch.int64", "torch.int32"),
              **dict(args, cache_seqlens=args["cache_seqlens"].long()))
    kv_raises(TypeError, ("cache_seqlens.dtype is torch.float32",), **dict(args, cache_seqlens=args["cache_seqlens"].float()))
    kv_raises(TypeError, ("cache_batch_idx.dtype is torch.int64",), **dict(args, cache_batch_idx=torch.arange(3)))
    paged = kv_args(paged=True)
    kv_raises(TypeError, ("page_table.dtype is torch.int64",), **dict(paged, page_table=paged["page_table"].long()))
    kv_raises(TypeError, ("q.dtype is torch.float32",), **dict(args, q=args["q"].float()))
    kv_raises(TypeError, ("v_cache.dtype is torch.float16 but q.dtype is torch.bfloat16",),
              **dict(args, v_cache=args["v_cache"].half()))
    kv_raises(TypeError, ("k.dtype is torch.float32",), **dict(args, k=args["k"].float()))
    kv_raises(TypeError, ("out.dtype is torch.float32",), **dict(args, out=torch.empty(3, 1, 4, 64)))
    kv_raises(TypeError, ("num_splits must be an int",), **dict(args, num_splits=1.5))
    kv_raises(TypeError, ("num_splits must be an int",), **dict(args, num_splits=True))
    for flag in ("return_lse", "check_seqlens"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            flash4.flash_attn_with_kvcache(**args, **{flag: 1})


def test_kvcache_shapes():
    args = kv_args()
    kv_raises(ValueError, ("q must be 4-D (batch, seqlen_q, nheads, headdim)",), **dict(args, q=args["q"][0]))
    kv_raises(ValueError, ("k_cache must be 4-D (batch_cache, seqlen_cache",), **dict(args, k_cache=args["k_cache"][0]))
    kv_raises(ValueError, ("k_cache must be 4-D (num_pages, page_size",),
              **dict(kv_args(paged=True), k_cache=torch.zeros(3, 16, 128, dtype=BF16)))
    kv_raises(ValueError, ("cache_seqlens must be 1-D (batch,)",), **dict(args, cache_seqlens=torch.zeros(3, 1, dtype=I32)))
    kv_raises(ValueError, ("cache_seqlens must have shape (batch,) = (3,)",), **dict(args, cache_seqlens=torch.zeros(2, dtype=I32)))
    kv_raises(ValueError, ("k and v (the new keys and values to append) must be given together",), **dict(args, v=None))
    kv_raises(ValueError, ("k and v must be (batch, seqlen_new, nheads_k, headdim) = (3, 1, 2, 64)",),
              **dict(args, k=torch.zeros(3, 1, 4, 64, dtype=BF16), v=torch.zeros(3, 1, 4, 64, dtype=BF16)))
    kv_raises(ValueError, ("k_cache.shape[0] (batch_cache) is 3 but q.shape[0] (batch) is 2",),
              **dict(args, q=args["q"][:2], k=args["k"][:2], v=args["v"][:2], cache_seqlens=args["cache_seqlens"][:2]))
    kv_raises(ValueError, ("cache_batch_idx must have shape (batch,) = (3,)",), **dict(args, cache_batch_idx=torch.zeros(2, dtype=I32)))
    kv_raises(ValueError, ("out must have the shape of q",), **dict(args, out=torch.empty(3, 2, 4, 64, dtype=BF16)))
    kv_raises(ValueError, ("nheads_k=3 (k_cache.shape[2]) must divide nheads=4 (q.shape[2])",),
              **dict(args, k_cache=torch.zeros(3, 40, 3, 64, dtype=BF16), v_cache=torch.zeros(3, 40, 3, 64, dtype=BF16),
                     k=None, v=None))
    kv_raises(ValueError, ("k_cache.shape[3] (headdim) is 128 but q.shape[3] is 64",),
              **dict(args, k_cache=torch.zeros(3, 40, 2, 128, dtype=BF16), v_cache=torch.zeros(3, 40, 2, 128, dtype=BF16)))
    paged = kv_args(paged=True)
    kv_raises(ValueError, ("page_table must have shape (batch, max_pages_per_seq) with batch = 3",),
              **dict(paged, page_table=paged["page_table"][:2]))
    kv_raises(ValueError, ("cache_batch_idx is not supported with page_table",),
              **dict(paged, cache_batch_idx=torch.arange(3, dtype=I32)))
    kv_raises(ValueError, ("page_size=1 (k_cache.shape[1]", "multiple of 8"),
              **dict(paged, k_cache=torch.zeros(9, 1, 2, 64, dtype=BF16), v_cache=torch.zeros(9, 1, 2, 64, dtype=BF16)))


def test_kvcache_cache_too_small():
    args = kv_args(s_cache=40, s_new=3)
    kv_raises(ValueError, ("the cache is too small for the appended k/v", "seqlen_new=41", "seqlen_cache", "= 40"),
              **dict(args, k=torch.zeros(3, 41, 2, 64, dtype=BF16), v=torch.zeros(3, 41, 2, 64, dtype=BF16)))
    kv_raises(ValueError, ("cache_seqlens + seqlen_new = 38 + 3 > seqlen_cache = k_cache.shape[1] = 40",),
              **dict(args, cache_seqlens=38))
    kv_raises(ValueError, ("q is on cpu",), **dict(args, cache_seqlens=37))
    kv_raises(ValueError, ("cache_seqlens must be >= 0",), **dict(args, cache_seqlens=-1))
    kv_raises(ValueError, ("appending k/v needs cache_seqlens",), **dict(args, cache_seqlens=None))
    kv_raises(ValueError, ("cache_seqlens=41 is above", "= 40"), **dict(kv_args(s_new=0), cache_seqlens=41))
    paged = kv_args(paged=True, s_cache=40, s_new=2)  # 3 pages of 16 per sequence: capacity 48
    kv_raises(ValueError, ("47 + 2 > page_table.shape[1] * page_size = 48",), **dict(paged, cache_seqlens=47))


def test_kvcache_num_splits():
    args = kv_args()
    kv_raises(ValueError, ("q is on cpu",), **dict(args, num_splits=7))
    kv_raises(ValueError, ("num_splits=2", "not supported with cache_batch_idx"),
              **dict(args, num_splits=2, cache_batch_idx=torch.arange(3, dtype=I32)))
    kv_raises(ValueError, ("num_splits must be >= 0",), **dict(args, num_splits=-1))


def test_kvcache_strides():
    args = kv_args()
    q = torch.randn(3, 2, 4, 64, dtype=BF16)
    out = torch.empty(2, 3, 4, 64, dtype=BF16).transpose(0, 1)
    kv_raises(ValueError, ("out.stride(0) must be seqlen_q * out.stride(1)",), **dict(args, q=q, out=out))
    big = torch.randn(3, 40, 2, 2, 64, dtype=BF16)  # the interleaved (dense) cache layout is fine
    kv_raises(ValueError, ("q is on cpu",), **dict(args, k_cache=big[:, :, 0], v_cache=big[:, :, 1]))
    sliced = torch.randn(3, 50, 2, 64, dtype=BF16)[:, :40]  # a seqlen slice of a longer cache is fine too
    kv_raises(ValueError, ("q is on cpu",), **dict(args, k_cache=sliced, v_cache=torch.randn(3, 50, 2, 64, dtype=BF16)[:, :40]))
    idx = torch.tensor([2, 0, 1], dtype=I32)
    kv_raises(ValueError, ("q is on cpu",), **dict(args, k_cache=sliced, v_cache=sliced.contiguous()))
    kv_raises(ValueError, ("strides (6400, 128, 64, 1) / (5120, 128, 64, 1)", "same whole number"),
              **dict(args, k_cache=sliced, v_cache=sliced.contiguous(), cache_batch_idx=idx))  # one offset per row
    odd = torch.randn(40, 3, 2, 64, dtype=BF16).transpose(0, 1)  # batch stride 128 < 40 rows of 384
    kv_raises(ValueError, ("q is on cpu",), **dict(args, k_cache=odd, v_cache=odd.clone()))
    kv_raises(ValueError, ("stride(0) must be the same whole number", "seqlen_cache"),
              **dict(args, k_cache=odd, v_cache=odd.clone(), cache_batch_idx=idx))
    kv_raises(ValueError, ("k_cache has stride(-1)=2",),
              **dict(args, k_cache=torch.randn(3, 40, 2, 128, dtype=BF16)[..., ::2]))


def test_kvcache_devices():
    args = kv_args()
    kv_raises(ValueError, ("cache_seqlens is on meta but q is on cpu",), **dict(args, cache_seqlens=args["cache_seqlens"].to("meta")))
    kv_raises(ValueError, ("k_cache is on meta but q is on cpu",), **dict(args, k_cache=args["k_cache"].to("meta")))


def test_check_kvcache_seqlens():
    seqlens = torch.tensor([0, 5, 8], dtype=I32)
    check_kvcache_seqlens(seqlens, 2, 10)
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\]=8: the cache is too small .* 8 \+ 3 must be in \[0, 10\]"):
        check_kvcache_seqlens(seqlens, 3, 10)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=-1"):
        check_kvcache_seqlens(torch.tensor([-1, 0, 0], dtype=I32), 1, 10)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\]=4 is outside \[0, batch_cache = 4\)"):
        check_kvcache_seqlens(seqlens, 0, 10, batch_cache=4, cache_batch_idx=torch.tensor([0, 4, 1], dtype=I32))
    table = torch.tensor([[0, 1], [2, 9], [4, 5]], dtype=I32)
    check_kvcache_seqlens(seqlens, 2, 16, page_table=table, num_pages=6, page_size=8)  # row 1 uses 1 page
    with pytest.raises(ValueError, match=r"page_table\[1, 1\]=9 is not a page"):
        check_kvcache_seqlens(seqlens, 4, 16, page_table=table, num_pages=6, page_size=8)  # row 1 now needs 2


# ================================================================ the reference
def naive_varlen(q, k, v, offs_q, lens_q, offs_k, lens_k, scale, causal, key_of=None):
    """Row by row in float64 from the definition. key_of(b, j) -> (k row, v row) overrides packed K."""
    total_q, h, d = q.shape
    hk = k.shape[-2]
    out = torch.zeros(total_q, h, d, dtype=F64)
    lse = torch.full((h, total_q), -math.inf, dtype=F64)
    for b in range(len(lens_q)):
        lq, lk = lens_q[b], lens_k[b]
        keys = [key_of(b, j) if key_of else (k[offs_k[b] + j], v[offs_k[b] + j]) for j in range(lk)]
        for i in range(lq):
            row = offs_q[b] + i
            visible = [j for j in range(lk) if not causal or j <= i + lk - lq]
            for hh in range(h):
                kh = hh // (h // hk)
                if not visible:
                    continue
                s = torch.stack([q[row, hh].double() @ keys[j][0][kh].double() * scale for j in visible])
                p = torch.exp(s - s.max())
                lse[hh, row] = s.max() + torch.log(p.sum())
                out[row, hh] = (p / p.sum()) @ torch.stack([keys[j][1][kh].double() for j in visible])
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [((3, 0, 5, 1), (4, 2, 0, 7)), ((1,), (1,)), ((6, 2), (3, 9)), ((), ())])
@pytest.mark.parametrize("h, hk", [(4, 4), (4, 2), (4, 1)])
def test_varlen_reference_matches_naive(lens, causal, h, hk):
    len_q, len_k = lens
    args = varlen_args(len_q, len_k, h=h, hk=hk, d=16, dtype=F64)
    out, lse = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                    softmax_scale=0.3, causal=causal, compute_dtype=F64)
    offs_q, offs_k = args["cu_seqlens_q"].tolist()[:-1], args["cu_seqlens_k"].tolist()[:-1]
    out_n, lse_n = naive_varlen(args["q"], args["k"], args["v"], offs_q, list(len_q), offs_k, list(len_k), 0.3, causal)
    torch.testing.assert_close(out, out_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_n, rtol=1e-12, atol=1e-12)
    assert out.shape == (sum(len_q), h, 16) and lse.shape == (h, sum(len_q))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_reference_seqused_and_tail_rows(causal):
    args = varlen_args((3, 4, 5), (6, 2, 7), d=16, dtype=F64)
    total_q = 14  # two rows past cu_seqlens_q[-1]
    q = torch.cat([args["q"], torch.randn(2, 4, 16, dtype=F64)])
    seqused_q, seqused_k = torch.tensor([2, 4, 0], dtype=I32), torch.tensor([6, 1, 3], dtype=I32)
    out, lse = attention_varlen_ref(q, args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], seqused_q,
                                    seqused_k, causal=causal, compute_dtype=F64)
    out_n, lse_n = naive_varlen(q, args["k"], args["v"], [0, 3, 7], [2, 4, 0], [0, 6, 8], [6, 1, 3], 0.25, causal)
    torch.testing.assert_close(out, out_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_n, rtol=1e-12, atol=1e-12)
    rows = varlen_row_mask(args["cu_seqlens_q"], total_q, seqused_q)
    assert rows.tolist() == [True, True, False] + [True] * 4 + [False] * 7
    assert (out[~rows] == 0).all() and torch.isneginf(lse[:, ~rows]).all()


@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_reference_equals_contiguous(layout, page_size, causal):
    args = varlen_args((3, 0, 5, 2), (40, 0, 17, 1), d=16, dtype=F64)
    k_cache, v_cache, table, seqused_k = paged_kv_cache(args["k"], args["v"], args["cu_seqlens_k"], page_size,
                                                        layout=layout)
    paged = attention_varlen_ref(args["q"], k_cache, v_cache, args["cu_seqlens_q"], None, None, seqused_k, table,
                                 causal=causal, compute_dtype=F64)
    packed = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                  causal=causal, compute_dtype=F64)
    assert torch.equal(paged[0], packed[0]) and torch.equal(paged[1], packed[1])
    # the brute force reading the paged storage itself
    out_n, lse_n = _naive_paged(args["q"], k_cache, v_cache, table, [0, 3, 3, 8], [3, 0, 5, 2], [40, 0, 17, 1], causal)
    torch.testing.assert_close(paged[0], out_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(paged[1], lse_n, rtol=1e-12, atol=1e-12)


def _naive_paged(q, k_cache, v_cache, table, offs_q, lens_q, lens_k, causal):
    page_size = k_cache.shape[1]
    hk = k_cache.shape[2]

    def key_of(b, j):
        page = int(table[b, j // page_size])
        return k_cache[page, j % page_size], v_cache[page, j % page_size]

    dummy = torch.zeros(1, hk, q.shape[2], dtype=F64)
    return naive_varlen(q, dummy, dummy, offs_q, lens_q, None, lens_k, 0.25, causal, key_of=key_of)


@pytest.mark.parametrize("layout", PAGED_LAYOUTS)
@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_paged_layout_round_trip(layout, page_size):
    args = varlen_args((1, 1, 1, 1), (70, 0, 16, 3), hk=2, d=64)
    seqused = torch.tensor([65, 0, 16, 2], dtype=I32)
    for used in (None, seqused):
        gen = torch.Generator().manual_seed(7)
        k_cache, v_cache, table, seqused_k = paged_kv_cache(args["k"], args["v"], args["cu_seqlens_k"], page_size,
                                                            used, layout=layout, generator=gen)
        lengths = [70, 0, 16, 3] if used is None else seqused.tolist()
        assert seqused_k.dtype == I32 and seqused_k.tolist() == lengths
        assert table.dtype == I32 and table.shape == (4, max(-(-n // page_size) for n in lengths) + 1)
        num_pages = k_cache.shape[0]
        assert k_cache.shape == v_cache.shape == (num_pages, page_size, 2, 64) and k_cache.stride(-1) == 1
        assert ((table >= 0) & (table < num_pages)).all()
        used_pages = [int(table[b, i]) for b, n in enumerate(lengths) for i in range(-(-n // page_size))]
        assert len(set(used_pages)) == len(used_pages)  # no page shared between sequences
        k_back, v_back, cu_back = paged_kv_to_varlen(k_cache, v_cache, table, seqused_k)
        keep = torch.cat([torch.arange(o, o + n) for o, n in zip([0, 70, 70, 86], lengths)])
        assert torch.equal(k_back, args["k"][keep]) and torch.equal(v_back, args["v"][keep])
        assert cu_back.tolist() == cu(lengths).tolist()
        if layout == "interleaved":
            assert k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
            assert k_cache.stride(1) == 2 * 2 * 64 and v_cache.data_ptr() - k_cache.data_ptr() == 2 * 64 * 2
        if layout == "vllm":
            assert k_cache.stride(1) == 2 * 2 * 64 and k_cache.stride(2) == 2 * 64
            assert v_cache.data_ptr() - k_cache.data_ptr() == 64 * 2


def test_paged_layout_permutes_pages_and_fills_the_rest():
    k = torch.arange(64 * 2 * 8, dtype=torch.float32).view(64, 2, 8)
    k_cache, _, table, _ = paged_kv_cache(k, k, cu([64]), 8, spare_pages=0, generator=torch.Generator().manual_seed(1))
    assert sorted(table[0, :8].tolist()) == list(range(8)) and table[0, :8].tolist() != list(range(8))
    k_cache, _, table, _ = paged_kv_cache(k, k, cu([60]), 8, fill=float("nan"))
    tail = k_cache[table[0, 7], 4:]
    assert tail.isnan().all() and not k_cache[table[0, 7], :4].isnan().any()
    assert gather_paged(k_cache, table[0], 60).equal(k[:60])
    with pytest.raises(ValueError, match="layout must be one of"):
        paged_kv_cache(k, k, cu([64]), 8, layout="bad")


def test_varlen_fwd_errors_judges_only_rows_inside_sequences():
    args = varlen_args((5, 3), (7, 4), d=64)
    q = torch.cat([args["q"], torch.zeros(2, 4, 64, dtype=BF16)])
    seqused_q = torch.tensor([4, 3], dtype=I32)
    kw = dict(seqused_q=seqused_q, causal=True)
    out_pt, lse_pt = attention_varlen_ref(q, args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                          seqused_q, upcast=False, causal=True)
    out_pt[~varlen_row_mask(args["cu_seqlens_q"], 10, seqused_q)] = math.nan  # unwritten rows: not judged
    errs = varlen_fwd_errors(q, args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], out_pt, lse_pt, **kw)
    assert errs["ok"] and errs["out_err"] == errs["out_pt_err"]
    bad = out_pt.clone()
    bad[5, 1, 0] += 1.0
    assert not varlen_fwd_errors(q, args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], bad, lse_pt, **kw)["ok"]


@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_ref_matches_attention_ref(causal):
    args = kv_args(b=2, sq=3, s_cache=20, s_new=0)
    lens = [7, 20]
    out, lse = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], lens, causal=causal)
    for b, n in enumerate(lens):
        o, l = attention_ref(args["q"][b:b + 1], args["k_cache"][b:b + 1, :n], args["v_cache"][b:b + 1, :n],
                             causal=causal)
        assert torch.equal(out[b:b + 1], o) and torch.equal(lse[b:b + 1], l)
    out_idx, _ = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], [20, 7], cache_batch_idx=[1, 0],
                             causal=causal)
    o, _ = attention_ref(args["q"][:1], args["k_cache"][1:2, :20], args["v_cache"][1:2, :20], causal=causal)
    assert torch.equal(out_idx[:1], o)


# ================================================================ API plumbing with reference kernels
def _contract_forward(calls):
    """A stand-in for flash4.varlen.varlen_forward honouring its documented contract (checked)."""

    def fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, seqused_q=None, seqused_k=None,
             page_table=None, out=None, lse=None, lse_split=None, window_size=None, softcap=0.0, learnable_sink=None):
        assert learnable_sink is None or (learnable_sink.dtype == torch.float32 and learnable_sink.is_contiguous()
                                          and learnable_sink.shape == (q.shape[1],))
        assert isinstance(max_seqlen_q, int) and isinstance(softmax_scale, float) and isinstance(causal, bool)
        assert type(softcap) is float and softcap >= 0
        assert window_size is None or (isinstance(window_size, tuple) and len(window_size) == 2
                                       and all(type(side) is int for side in window_size))
        for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table):
            assert t is None or (t.dtype == I32 and t.is_contiguous() and t.device == q.device)
        assert (cu_seqlens_k is None) == (page_table is not None)
        assert page_table is None or seqused_k is not None
        assert out is not None and lse is not None and lse.shape == (q.shape[1], q.shape[0])
        o, l = attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
                                    softmax_scale, causal, window_size=window_size, softcap=softcap,
                                    learnable_sink=learnable_sink)
        rows = varlen_row_mask(cu_seqlens_q, q.shape[0], seqused_q)
        lengths = (seqused_q if seqused_q is not None else cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        assert max_seqlen_q >= max(lengths + [0])
        out[rows] = o[rows].to(out.dtype)
        lse[:, rows] = l[:, rows]
        if lse_split is not None:
            lse_split[0][:, rows] = l[:, rows] * LOG2E
            lse_split[1][:, rows] = 0.0
        calls.append(dict(cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                          page_table=page_table, k=k, window_size=window_size, softcap=softcap,
                          learnable_sink=learnable_sink))
        return out, lse

    return fake


def _contract_decode(calls):
    """A stand-in for flash4.decode.decode_forward (the kvcache path without cache_batch_idx)."""

    def fake(q, k_cache, v_cache, seqused_k, softmax_scale, causal, page_table=None, num_splits=0, out=None, lse=None,
             window_size=None, softcap=0.0, learnable_sink=None):
        assert type(softcap) is float and softcap >= 0
        assert learnable_sink is None or (learnable_sink.dtype == torch.float32 and learnable_sink.is_contiguous())
        assert seqused_k.dtype == I32 and seqused_k.shape == (q.shape[0],) and isinstance(num_splits, int)
        assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous()
        o, l = kvcache_ref(q, k_cache, v_cache, seqused_k, page_table, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
        out.copy_(o)
        lse.copy_(l)
        calls.append(dict(seqused_k=seqused_k.clone(), page_table=page_table, num_splits=num_splits, decode=True,
                          window_size=window_size, softcap=softcap, learnable_sink=learnable_sink))
        return out, lse

    return fake


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Let CPU tensors through the device check and run the reference in place of the kernels."""
    import inspect

    import flash4.decode as decode
    import flash4.varlen as varlen

    # the stand-ins take the real entry points' arguments
    assert list(inspect.signature(decode.decode_forward).parameters) == list(
        inspect.signature(_contract_decode([])).parameters)
    assert list(inspect.signature(varlen.varlen_forward).parameters) == list(
        inspect.signature(_contract_forward([])).parameters)
    assert list(inspect.signature(varlen.varlen_backward).parameters) == list(
        inspect.signature(_fake_backward({})).parameters)

    device_problem = validate._device_problem

    def relative_only(q, others):
        problem = device_problem(q, others)
        return None if problem is not None and problem[1].startswith("q is on cpu") else problem

    monkeypatch.setattr(validate, "_device_problem", relative_only)
    monkeypatch.setattr(validate, "_arch_problem", lambda q, causal: None)
    calls = []
    monkeypatch.setattr(varlen, "varlen_forward", _contract_forward(calls))
    monkeypatch.setattr(decode, "decode_forward", _contract_decode(calls))
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_func_runs_the_contract(cpu_kernels, causal):
    args = varlen_args((3, 0, 5, 1), (4, 2, 0, 9))
    out = flash4.flash_attn_varlen_func(**args, causal=causal)
    out2, lse = flash4.flash_attn_varlen_func(**args, max_seqlen_q=torch.tensor(5), causal=causal, return_lse=True,
                                              check_seqlens=True)
    ref_out, ref_lse = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"],
                                            args["cu_seqlens_k"], causal=causal)
    assert out.shape == (9, 4, 64) and out.dtype == BF16 and lse.shape == (4, 9) and lse.dtype == torch.float32
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(out2, out) and torch.equal(lse, ref_lse)
    assert [c["max_seqlen_q"] for c in cpu_kernels] == [5, 5]  # None computed; the tensor read


def test_varlen_func_paged_and_non_contiguous_metadata(cpu_kernels):
    paged = paged_args(len_q=(3, 0, 5), len_k=(20, 0, 33), layout="interleaved")
    table = torch.zeros(3, 2 * paged["page_table"].shape[1], dtype=I32)[:, ::2]
    table.copy_(paged["page_table"])  # a non-contiguous page_table is made contiguous
    out = flash4.flash_attn_varlen_func(**dict(paged, page_table=table), max_seqlen_q=5, causal=True)
    ref, _ = attention_varlen_ref(paged["q"], paged["k"], paged["v"], paged["cu_seqlens_q"], None, None,
                                  paged["seqused_k"], paged["page_table"], causal=True)
    assert torch.equal(out, ref.to(BF16))
    assert cpu_kernels[0]["page_table"].is_contiguous() and cpu_kernels[0]["cu_seqlens_k"] is None


def test_varlen_func_check_seqlens_raises(cpu_kernels):
    args = varlen_args()
    bad = args["cu_seqlens_k"].clone()
    bad[-1] = 99
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\]=99 is past the end of k"):
        flash4.flash_attn_varlen_func(**dict(args, cu_seqlens_k=bad), check_seqlens=True)
    with pytest.raises(ValueError, match="max_seqlen_q=2 is below the longest sequence"):
        flash4.flash_attn_varlen_func(**args, max_seqlen_q=2, check_seqlens=True)
    assert cpu_kernels == []


def test_varlen_empty_fast_paths(monkeypatch):
    import flash4.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_forward", lambda *a, **k: pytest.fail("launched"))
    args = varlen_args((0, 0), (3, 1))
    out, lse = api._flash_attn_varlen_forward(args["q"], args["k"], args["v"], args["cu_seqlens_q"],
                                              args["cu_seqlens_k"], 0, 0.1, False)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
    args = varlen_args((2, 3), (0, 0))  # no keys anywhere
    out = torch.full((5, 4, 64), math.nan, dtype=BF16)
    lse = torch.full((4, 5), math.nan)
    split = torch.full((2, 4, 5), math.nan)
    res = api._flash_attn_varlen_forward(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                         3, 0.1, True, out=out, lse=lse, lse_split=split)
    assert res[0] is out and res[1] is lse
    assert (out == 0).all() and torch.isneginf(lse).all() and torch.isposinf(split[0]).all() and (split[1] == 0).all()
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 of shape \(5, 4, 64\)"):
        api._flash_attn_varlen_forward(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                       3, 0.1, True, out=torch.empty(5, 4, 63, dtype=BF16))
    with pytest.raises(ValueError, match="lse must be contiguous"):
        api._flash_attn_varlen_forward(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                       3, 0.1, True, lse=torch.empty(5, 4).t())
    grads = api._flash_attn_varlen_backward(out, args["q"], args["k"], args["v"], out, lse, args["cu_seqlens_q"],
                                            args["cu_seqlens_k"], 3, 0, 0.1, True)
    assert [tuple(g.shape) for g in grads] == [(5, 4, 64), (0, 2, 64), (0, 2, 64)] and (grads[0] == 0).all()


# ---------------------------------------------------------------- autograd
def _fake_backward(seen):
    def fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
             seqused_q=None, seqused_k=None, deterministic=False, lse_split=None, dlse=None, dq=None, dk=None,
             dv=None, window_size=None, softcap=0.0):
        seen.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=softmax_scale, causal=causal,
                    det=deterministic, split=None if lse_split is None else lse_split.shape,
                    dlse=None if dlse is None else dlse.unique().tolist(), dout=dout.unique().tolist(),
                    seqused_k=seqused_k, window_size=window_size)
        if softcap:
            seen.update(softcap=softcap)
        return torch.ones_like(q), 2 * torch.ones_like(k), 3 * torch.ones_like(v)

    return fake


def test_varlen_autograd_routes_backward(cpu_kernels, monkeypatch):
    import flash4.varlen as varlen

    seen = {}
    monkeypatch.setattr(varlen, "varlen_backward", _fake_backward(seen))
    args = varlen_args((3, 0, 5), (4, 2, 6))
    q, k, v = (args[n].requires_grad_() for n in "qkv")
    seqused_k = torch.tensor([4, 1, 6], dtype=I32)
    out, lse = flash4.flash_attn_varlen_func(**args, seqused_k=seqused_k, causal=True, return_lse=True,
                                             deterministic=True)
    assert out.requires_grad and lse.requires_grad
    (out.float().sum() + 2 * lse.sum()).backward()
    assert seen == {"max_seqlen_q": 5, "max_seqlen_k": 6, "scale": 0.125, "causal": True, "det": True,
                    "split": (2, 4, 8), "dlse": [2.0], "dout": [1.0], "seqused_k": seqused_k,
                    "window_size": (-1, -1)}
    assert (q.grad == 1).all() and (k.grad == 2).all() and (v.grad == 3).all()

    q.grad = None
    out = flash4.flash_attn_varlen_func(**dict(args, k=k.detach(), v=v.detach()), max_seqlen_k=torch.tensor(9))
    out.float().sum().backward()
    assert seen["max_seqlen_k"] == 9 and seen["dlse"] is None and (q.grad == 1).all()


def test_varlen_double_backward_raises(cpu_kernels, monkeypatch):
    import flash4.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_backward", _fake_backward({}))
    args = varlen_args()
    q = args["q"].requires_grad_()
    out = flash4.flash_attn_varlen_func(**args)
    dq, = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError) as err:
        (dq.float() ** 2).sum().backward()
    assert str(err.value) == DOUBLE_BACKWARD_ERROR


def test_paged_backward_raises(cpu_kernels):
    paged = paged_args()
    q = paged["q"].requires_grad_()
    out = flash4.flash_attn_varlen_func(**paged)  # the forward runs
    assert out.requires_grad
    with pytest.raises(RuntimeError) as err:
        out.float().sum().backward()
    assert str(err.value) == PAGED_BACKWARD_ERROR
    with torch.no_grad():
        assert not flash4.flash_attn_varlen_func(**paged).requires_grad


def test_varlen_function_apply_directly(cpu_kernels, monkeypatch):
    import flash4.varlen as varlen

    seen = {}
    monkeypatch.setattr(varlen, "varlen_backward", _fake_backward(seen))
    args = varlen_args()
    q = args["q"].float().requires_grad_()
    k, v = args["k"].float(), args["v"].float()
    out, lse = FlashAttnVarlenFunc.apply(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], None, None, None, 5,
                                         None, 0.5, False, False)
    lse.sum().backward()  # only lse used: dout arrives as zeros
    assert seen["dout"] == [0.0] and seen["dlse"] == [1.0] and seen["max_seqlen_k"] == 4


# ---------------------------------------------------------------- kvcache
def _expected_cache(args, seqlens, rows=None, table=None):
    """The caches after appending args' k/v at seqlens (python ints), by plain indexing."""
    k_cache, v_cache = args["k_cache"].clone(), args["v_cache"].clone()
    page_size = k_cache.shape[1]
    for b in range(args["q"].shape[0]):
        for t in range(args["k"].shape[1]):
            pos = seqlens[b] + t
            if table is not None:
                where = (int(table[b, pos // page_size]), pos % page_size)
            else:
                where = (rows[b] if rows is not None else b, pos)
            k_cache[where] = args["k"][b, t]
            v_cache[where] = args["v"][b, t]
    return k_cache, v_cache


@pytest.mark.parametrize("sq, s_new, causal", [(1, 1, False), (1, 1, True), (3, 3, True), (4, 2, True), (2, 0, True)])
def test_kvcache_dense_appends_and_attends(cpu_kernels, sq, s_new, causal):
    args = kv_args(b=3, sq=sq, s_new=s_new)
    seqlens = args["cache_seqlens"].tolist()
    k_exp, v_exp = _expected_cache(args, seqlens) if s_new else (args["k_cache"].clone(), args["v_cache"].clone())
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=causal, return_lse=True, check_seqlens=True)
    assert torch.equal(args["k_cache"], k_exp) and torch.equal(args["v_cache"], v_exp)
    ref_out, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + s_new for n in seqlens], causal=causal)
    assert out.shape == args["q"].shape and lse.shape == (3, 4, sq) and lse.is_contiguous()
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    call = cpu_kernels[0]
    assert call["decode"] and call["seqused_k"].tolist() == [n + s_new for n in seqlens] and call["num_splits"] == 0


def test_kvcache_int_cache_seqlens_broadcast_and_out(cpu_kernels):
    args = kv_args(b=2, sq=1, s_new=1)
    args["cache_seqlens"] = 30
    out = torch.full_like(args["q"], math.nan)
    k_exp, v_exp = _expected_cache(args, [30, 30])
    res = flash4.flash_attn_with_kvcache(**args, out=out, num_splits=3)
    assert res is out and torch.equal(args["k_cache"], k_exp) and cpu_kernels[0]["num_splits"] == 3
    ref, _ = kvcache_ref(args["q"], k_exp, v_exp, [31, 31])
    assert torch.equal(out, ref.to(BF16))


def test_kvcache_batch_idx_gives_non_monotonic_offsets(cpu_kernels):
    args = kv_args(b=3, sq=2, s_new=2)
    # batch_cache 5; each entry a 40-row slice of 48 rows (stride(0) = 48 rows)
    k_storage, v_storage = torch.randn(5, 48, 2, 64, dtype=BF16), torch.randn(5, 48, 2, 64, dtype=BF16)
    args["k_cache"], args["v_cache"] = k_storage[:, :40], v_storage[:, :40]
    tails = k_storage[:, 40:].clone(), v_storage[:, 40:].clone()
    idx = torch.tensor([4, 0, 2], dtype=I32)
    seqlens = args["cache_seqlens"].tolist()
    k_exp, v_exp = _expected_cache(args, seqlens, rows=idx.tolist())
    out, lse = flash4.flash_attn_with_kvcache(**args, cache_batch_idx=idx, causal=True, check_seqlens=True,
                                             return_lse=True)
    assert torch.equal(args["k_cache"], k_exp) and torch.equal(args["v_cache"], v_exp)
    assert torch.equal(k_storage[:, 40:], tails[0]) and torch.equal(v_storage[:, 40:], tails[1])
    ref, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + 2 for n in seqlens], cache_batch_idx=idx, causal=True)
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse) and lse.shape == (3, 4, 2)
    call = cpu_kernels[0]
    assert call["cu_seqlens_k"].tolist() == [4 * 48, 0, 2 * 48, 4 * 48 + 40]
    assert call["k"].shape == (4 * 48 + 40, 2, 64) and call["k"].data_ptr() == k_storage.data_ptr()
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\]=5 is outside"):
        flash4.flash_attn_with_kvcache(**args, cache_batch_idx=torch.tensor([5, 0, 1], dtype=I32), check_seqlens=True)


@pytest.mark.parametrize("layout", ["separate", "interleaved"])
@pytest.mark.parametrize("sq, s_new", [(1, 1), (3, 3), (1, 0)])
def test_kvcache_paged_appends_through_page_table(cpu_kernels, layout, sq, s_new):
    args = kv_args(b=3, sq=sq, s_new=s_new, paged=True, s_cache=40, page_size=16)
    if layout == "interleaved":
        kv = torch.randn(args["k_cache"].shape[0], 16, 2, 2, 64, dtype=BF16)
        args["k_cache"], args["v_cache"] = kv[:, :, 0], kv[:, :, 1]
    seqlens = args["cache_seqlens"].tolist()
    table = args["page_table"]
    k_exp, v_exp = _expected_cache(args, seqlens, table=table) if s_new else (args["k_cache"].clone(),
                                                                               args["v_cache"].clone())
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=True, return_lse=True, check_seqlens=True)
    assert torch.equal(args["k_cache"], k_exp) and torch.equal(args["v_cache"], v_exp)
    ref_out, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + s_new for n in seqlens], page_table=table, causal=True)
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    assert cpu_kernels[0]["decode"] and cpu_kernels[0]["page_table"] is table


def test_kvcache_check_seqlens_before_writing(cpu_kernels):
    args = kv_args(b=2, s_cache=40, s_new=2)
    args["cache_seqlens"] = torch.tensor([3, 39], dtype=I32)
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]=39: the cache is too small"):
        flash4.flash_attn_with_kvcache(**args, check_seqlens=True)
    assert torch.equal(args["k_cache"], before) and cpu_kernels == []
    paged = kv_args(b=2, paged=True, s_new=1)
    paged["page_table"][0, 0] = 10 ** 5
    paged["cache_seqlens"] = torch.tensor([0, 3], dtype=I32)
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]=100000 is not a page"):
        flash4.flash_attn_with_kvcache(**paged, check_seqlens=True)


def test_kvcache_no_autograd_and_empty_batch(cpu_kernels):
    args = kv_args(b=2)
    q = args["q"].requires_grad_()
    out = flash4.flash_attn_with_kvcache(**args)
    assert not out.requires_grad and q.grad is None
    empty = kv_args(b=0, s_new=1)
    out, lse = flash4.flash_attn_with_kvcache(**empty, return_lse=True)
    assert out.shape == (0, 1, 4, 64) and lse.shape == (0, 4, 1) and cpu_kernels == [cpu_kernels[0]]


def test_kvcache_cache_seqlens_none_uses_the_whole_cache(cpu_kernels):
    args = kv_args(b=2, s_new=0)
    out = flash4.flash_attn_with_kvcache(**dict(args, cache_seqlens=None))
    ref, _ = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], [40, 40])
    assert torch.equal(out, ref.to(BF16))


def test_kvcache_empty_cache_gives_zero_and_neg_inf(cpu_kernels):
    args = kv_args(b=2, sq=3, s_cache=0, s_new=0)
    out, lse = flash4.flash_attn_with_kvcache(**dict(args, cache_seqlens=0), causal=True, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and cpu_kernels == []


# ---------------------------------------------------------------- sliding windows (window_size)
@pytest.mark.parametrize("window, causal", [((2, 1), False), ((2, 1), True), ((-1, 0), False), ((0, 0), False),
                                            ([4, -1], True)])
def test_varlen_func_routes_the_window(cpu_kernels, monkeypatch, window, causal):
    """flash_attn_varlen_func hands window_size (a tuple of ints) to varlen_forward and, through
    FlashAttnVarlenFunc, to varlen_backward; the result is the reference's with that window."""
    import flash4.varlen as varlen

    seen = {}
    monkeypatch.setattr(varlen, "varlen_backward", _fake_backward(seen))
    args = varlen_args((3, 0, 5, 7), (4, 2, 0, 3))
    out, lse = flash4.flash_attn_varlen_func(**args, causal=causal, window_size=window, return_lse=True)
    ref_out, ref_lse = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"],
                                            args["cu_seqlens_k"], causal=causal, window_size=window)
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    # (-1, 0) is exactly causal: it reaches the kernels as causal=True without a window
    expected = (-1, -1) if tuple(window) == (-1, 0) else tuple(window)
    assert cpu_kernels[-1]["window_size"] == expected
    if tuple(window) == (0, 0):  # sequence 3: 7 queries, 3 keys: rows 0..3 see no key
        assert (out[8:12] == 0).all() and torch.isneginf(lse[:, 8:12]).all()
    q = args["q"].requires_grad_()
    flash4.flash_attn_varlen_func(**args, causal=causal, window_size=window).float().sum().backward()
    assert cpu_kernels[-1]["window_size"] == seen["window_size"] == expected and q.grad is not None


def test_paged_varlen_routes_the_window(cpu_kernels):
    paged = paged_args(len_q=(3, 0, 5), len_k=(20, 0, 33))
    out = flash4.flash_attn_varlen_func(**paged, causal=True, window_size=(6, -1))
    ref, _ = attention_varlen_ref(paged["q"], paged["k"], paged["v"], paged["cu_seqlens_q"], None, None,
                                  paged["seqused_k"], paged["page_table"], causal=True, window_size=(6, -1))
    assert torch.equal(out, ref.to(BF16)) and cpu_kernels[0]["window_size"] == (6, -1)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sq, s_new", [(1, 1), (3, 2)])
@pytest.mark.parametrize("window", [(7, 0), (2, 3), (-1, -1)])
def test_kvcache_routes_the_window(cpu_kernels, paged, sq, s_new, window):
    """flash_attn_with_kvcache hands window_size to decode_forward (after the append); the result is
    kvcache_ref's with that window (n_b = cache_seqlens[b] + seqlen_new keys per sequence)."""
    args = kv_args(b=3, sq=sq, s_new=s_new, paged=paged)
    seqlens = args["cache_seqlens"].tolist()
    table = args.get("page_table")
    k_exp, v_exp = _expected_cache(args, seqlens, table=table)
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=True, window_size=window, return_lse=True)
    ref_out, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + s_new for n in seqlens], page_table=table,
                                   causal=True, window_size=window)
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    assert cpu_kernels[0]["decode"] and cpu_kernels[0]["window_size"] == window


def test_kvcache_batch_idx_routes_the_window(cpu_kernels):
    """The cache_batch_idx path (varlen_forward over the dense cache's rows) gets the window too."""
    args = kv_args(b=3, sq=2, s_new=2)
    k_storage, v_storage = torch.randn(5, 40, 2, 64, dtype=BF16), torch.randn(5, 40, 2, 64, dtype=BF16)
    args["k_cache"], args["v_cache"] = k_storage, v_storage
    idx = torch.tensor([4, 0, 2], dtype=I32)
    seqlens = args["cache_seqlens"].tolist()
    k_exp, v_exp = _expected_cache(args, seqlens, rows=idx.tolist())
    out, lse = flash4.flash_attn_with_kvcache(**args, cache_batch_idx=idx, window_size=(3, 1), return_lse=True)
    ref, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + 2 for n in seqlens], cache_batch_idx=idx,
                               window_size=(3, 1))
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)
    assert "decode" not in cpu_kernels[0] and cpu_kernels[0]["window_size"] == (3, 1)
