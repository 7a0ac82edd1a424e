"""flash_attn_varlen_func (packed variable-length batches) without a GPU: every argument error (CPU
tensors: metadata checks run before the device check), the on-device value checks
(check_seqlens), the varlen reference against a brute-force loop, and the door's plumbing
(max_seqlen, lse layouts, autograd routing, empty fast paths, windows) with the kernels replaced
by reference stand-ins that honour flash4.forward.launch's contract (conftest.py). Paged K/V:
test_paged_api.py; flash_attn_with_kvcache: test_kvcache_api.py."""

import math

import pytest
import torch
from cpu_helpers import (F64, I32, cu, naive_varlen, paged_args, seqlens_ok, seqlens_raises, varlen_args,
                         varlen_raises)

from flash4.geometry import Band, band
import flash4
from flash4 import autograd, backward, forward
from flash4.autograd import DOUBLE_BACKWARD_ERROR
from flash4.config import SUPPORTED_HEADDIMS
from flash4.reference import attention_varlen_ref, varlen_fwd_errors, varlen_row_mask
from flash4.request import Request
from flash4.validate import resolve_max_seqlen, varlen_support_error

BF16 = torch.bfloat16


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


# ================================================================ the reference
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


# ================================================================ API plumbing with reference kernels
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
    monkeypatch.setattr(forward, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(backward, "launch", lambda *a, **k: pytest.fail("launched"))
    args = varlen_args((0, 0), (3, 1))
    out, lse = forward.run(Request.varlen(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                          0, softmax_scale=0.1))
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
    args = varlen_args((2, 3), (0, 0))  # no keys anywhere
    request = Request.varlen(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], 3,
                             softmax_scale=0.1, causal=True)
    out = torch.full((5, 4, 64), math.nan, dtype=BF16)
    lse = torch.full((4, 5), math.nan)
    split = torch.full((2, 4, 5), math.nan)
    res = forward.run(request, out=out, lse=lse, lse_split=split)
    assert res[0] is out and res[1] is lse
    assert (out == 0).all() and torch.isneginf(lse).all() and torch.isposinf(split[0]).all() and (split[1] == 0).all()
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 of shape \(5, 4, 64\)"):
        forward.run(request, out=torch.empty(5, 4, 63, dtype=BF16))
    with pytest.raises(ValueError, match="lse must be contiguous"):
        forward.run(request, lse=torch.empty(5, 4).t())
    request = Request.varlen(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], 3, 0,
                             softmax_scale=0.1, causal=True)
    grads = backward.run(request, out, out, lse)
    assert [tuple(g.shape) for g in grads] == [(5, 4, 64), (0, 2, 64), (0, 2, 64)] and (grads[0] == 0).all()


# ---------------------------------------------------------------- autograd
def test_varlen_autograd_routes_backward(cpu_kernels, fake_backward):
    args = varlen_args((3, 0, 5), (4, 2, 6))
    q, k, v = (args[n].requires_grad_() for n in "qkv")
    seqused_k = torch.tensor([4, 1, 6], dtype=I32)
    out, lse = flash4.flash_attn_varlen_func(**args, seqused_k=seqused_k, causal=True, return_lse=True,
                                             deterministic=True)
    assert out.requires_grad and lse.requires_grad
    (out.float().sum() + 2 * lse.sum()).backward()
    expected = {"max_seqlen_q": 5, "max_seqlen_k": 6, "scale": 0.125, "causal": True, "det": True,
                "split": (2, 4, 8), "dlse": [2.0], "dout": [1.0], "seqused_k": seqused_k, "window_size": Band(None, None)}
    assert {key: fake_backward[key] for key in expected} == expected
    assert (q.grad == 1).all() and (k.grad == 2).all() and (v.grad == 3).all()

    q.grad = None
    out = flash4.flash_attn_varlen_func(**dict(args, k=k.detach(), v=v.detach()), max_seqlen_k=torch.tensor(9))
    out.float().sum().backward()
    assert fake_backward["max_seqlen_k"] == 9 and fake_backward["dlse"] is None and (q.grad == 1).all()


def test_varlen_double_backward_raises(cpu_kernels, fake_backward):
    args = varlen_args()
    q = args["q"].requires_grad_()
    out = flash4.flash_attn_varlen_func(**args)
    dq, = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError) as err:
        (dq.float() ** 2).sum().backward()
    assert str(err.value) == DOUBLE_BACKWARD_ERROR


def test_varlen_autograd_path_directly(cpu_kernels, fake_backward):
    """flash4.autograd.attention on an unchecked varlen request (float32): only lse in the loss."""
    args = varlen_args()
    q = args["q"].float().requires_grad_()
    k, v = args["k"].float(), args["v"].float()
    out, lse = autograd.attention(Request.varlen(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], 5, None,
                                                 softmax_scale=0.5))
    lse.sum().backward()  # only lse used: dout arrives as zeros
    assert fake_backward["dout"] == [0.0] and fake_backward["dlse"] == [1.0] and fake_backward["max_seqlen_k"] == 4


# ---------------------------------------------------------------- sliding windows (window_size)
@pytest.mark.parametrize("window, causal", [((2, 1), False), ((2, 1), True), ((-1, 0), False), ((0, 0), False),
                                            ([4, -1], True)])
def test_varlen_func_routes_the_window(cpu_kernels, fake_backward, window, causal):
    """flash_attn_varlen_func hands window_size (a tuple of ints) to the forward launch and, through
    the autograd path, to the backward launch; the result is the reference's with that window."""
    seen = fake_backward
    args = varlen_args((3, 0, 5, 7), (4, 2, 0, 3))
    out, lse = flash4.flash_attn_varlen_func(**args, causal=causal, window_size=window, return_lse=True)
    ref_out, ref_lse = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"],
                                            args["cu_seqlens_k"], causal=causal, window_size=window)
    assert torch.equal(out, ref_out.to(BF16)) and torch.equal(lse, ref_lse)
    # (-1, 0) is exactly causal: it reaches the kernels as causal=True without a window
    expected = Band(None, None) if tuple(window) == (-1, 0) else band(window)
    assert cpu_kernels[-1]["window_size"] == expected
    if tuple(window) == (0, 0):  # sequence 3: 7 queries, 3 keys: rows 0..3 see no key
        assert (out[8:12] == 0).all() and torch.isneginf(lse[:, 8:12]).all()
    q = args["q"].requires_grad_()
    flash4.flash_attn_varlen_func(**args, causal=causal, window_size=window).float().sum().backward()
    assert cpu_kernels[-1]["window_size"] == seen["window_size"] == expected and q.grad is not None
