"""The public `softcap` keyword (logit soft-capping, Gemma 2; issue 10 item 2) without a GPU: its
validation on every entry point and every flash4.validate function (TypeError for a non-real or a
bool, ValueError naming softcap and the value for NaN / inf / negative values), and its plumbing:
flash_attn_func -> the request's ScoreSpec -> flash4.forward.launch (config variant and runner
value) and flash4.backward.launch; flash_attn_varlen_func and flash_attn_with_kvcache (decode and
cache_batch_idx) likewise (the reference stand-ins of conftest.py); the custom ops (schema,
opcheck, autograd, tracing). The kernels themselves: tests/gpu/test_softcap.py."""

import inspect
import math

import pytest
import torch
from cpu_helpers import (ENTRY_POINTS, flash4_calls, kv_args, kvcache_meta, meta_inputs, op_argument, qkv,
                         varlen_args, varlen_fwd_args, varlen_meta)
from torch.fx.experimental.proxy_tensor import make_fx

import flash4
from flash4 import autograd, backward, forward
from flash4.reference import attention_ref, attention_varlen_ref, kvcache_ref
from flash4.request import Request

BF16, I32 = torch.bfloat16, torch.int32
BAD_TYPES = [True, False, None, "1.0", (50.0,), [50.0], torch.tensor(50.0), 1j]
BAD_VALUES = [-1.0, -1e-30, -50, math.nan, math.inf, -math.inf, float("nan")]


# ================================================================ signatures and docs
@pytest.mark.parametrize("func", [flash4.flash_attn_func, flash4.flash_attn_varlen_func,
                                  flash4.flash_attn_with_kvcache])
def test_softcap_keyword(func):
    param = inspect.signature(func).parameters["softcap"]
    assert param.default == 0.0 and param.kind is inspect.Parameter.KEYWORD_ONLY
    doc = func.__doc__
    for fragment in ("softcap * tanh(softmax_scale * q.k / softcap)", "Gemma 2", "tanh.approx.f32", "Cost"):
        assert fragment in doc, (func.__name__, fragment)


# ================================================================ validation
def _raises(entry, exc, softcap):
    """The public function and check_* raise exc with one message naming softcap; support_error returns it."""
    func, support, check, kwargs = ENTRY_POINTS[entry]
    with pytest.raises(exc) as info:
        func(**kwargs(), softcap=softcap)
    message = str(info.value)
    assert "softcap" in message, message
    with pytest.raises(exc) as info:
        check(**kwargs(), softcap=softcap)
    assert str(info.value) == message
    assert support(**kwargs(), softcap=softcap) == message
    return message


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("softcap", BAD_TYPES, ids=repr)
def test_softcap_type_errors(entry, softcap):
    message = _raises(entry, TypeError, softcap)
    assert type(softcap).__name__ in message


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("softcap", BAD_VALUES, ids=repr)
def test_softcap_value_errors(entry, softcap):
    message = _raises(entry, ValueError, softcap)
    assert "finite and >= 0" in message and f"softcap={softcap}" in message


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("softcap", [0, 0.0, 1e-3, 15, 30.0, 50.0, 1e30])
def test_valid_softcap_only_fails_on_device(entry, softcap):
    func, support, check, kwargs = ENTRY_POINTS[entry]
    message = support(**kwargs(), softcap=softcap)
    assert message is not None and "cpu" in message and "softcap" not in message


def test_softcap_problem_and_check_softcap():
    from flash4.validate import check_softcap, softcap_problem

    assert softcap_problem(0) is None and softcap_problem(50.0) is None
    assert check_softcap(15) == 15.0 and type(check_softcap(15)) is float
    assert softcap_problem(True)[0] is TypeError and softcap_problem(-0.5)[0] is ValueError
    with pytest.raises(ValueError, match="softcap=nan"):
        check_softcap(math.nan)


def test_softcap_checked_after_the_window():
    """Order of checks: window_size before softcap (both bad: the window's error)."""
    with pytest.raises(TypeError, match="window_size"):
        flash4.flash_attn_func(*qkv(), window_size=None, softcap=-1.0)


# ================================================================ dense plumbing
@pytest.mark.parametrize("softcap", [0.0, 5, 30.0])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (4, 2))])
def test_flash_attn_func_routes_softcap(cpu_kernels, unchecked, softcap, causal, window):
    """The direct path and the autograd path hand softcap (a float) to the forward and the backward;
    results equal the reference with the same cap."""
    q, k, v = (t.float() * 4 for t in qkv(sq=20, sk=12))
    out = flash4.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
    assert [c["softcap"] for c in cpu_kernels] == [softcap] and type(cpu_kernels[0]["softcap"]) is float
    ref, _ = attention_ref(q, k, v, None, causal, window_size=window, softcap=softcap)
    assert torch.equal(out, ref)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash4.flash_attn_func(*leaves, causal=causal, window_size=window, softcap=softcap, return_lse=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * dout).sum().backward()
    assert cpu_kernels[-1]["softcap"] == cpu_kernels.backward[-1]["softcap"] == softcap
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*ref_leaves, None, causal, window_size=window, softcap=softcap)
    (ref * dout).sum().backward()
    assert torch.allclose(lse, ref_lse.float())
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert torch.allclose(leaf.grad, ref_leaf.grad, atol=1e-4)


def test_autograd_path_softcap_default_and_positional(cpu_kernels):
    q, k, v = (t.float().requires_grad_() for t in qkv())
    autograd.attention(Request.dense(q, k, v, 0.125, True))[0].sum().backward()
    autograd.attention(Request.dense(q, k, v, 0.125, True, None, 20.0))[0].sum().backward()
    assert [c["softcap"] for c in cpu_kernels] == [c["softcap"] for c in cpu_kernels.backward] == [0.0, 20.0]


@pytest.mark.parametrize("softcap, window", [(0.0, None), (30.0, None), (30.0, (3, 0)), (0.0, (3, 0))])
def test_forward_launch_passes_softcap_to_config_and_runner(monkeypatch, softcap, window):
    """flash4.forward's dense launch selects the softcap config variant exactly when softcap > 0 and
    hands the value to the runner."""
    import flash4.compile.cache as cache

    seen = {}

    def fake_runner(cfg):
        seen["cfg"] = cfg

        def run(q, k, v, out, lse, scale, lse_split=None, window=None, softcap=0.0):
            seen["softcap"], seen["window"] = softcap, window
            out.zero_()
            lse.zero_()

        return run

    monkeypatch.setattr(cache, "get_fwd_runner", fake_runner)
    monkeypatch.setenv("FLASH4_ARCH", "90")
    forward.run(Request.dense(*qkv(), None, False, window, softcap))
    assert seen["cfg"].softcap is (softcap > 0) and seen["softcap"] == softcap
    assert seen["cfg"].local is (window is not None)


# ================================================================ varlen / kvcache plumbing
@pytest.mark.parametrize("softcap", [0.0, 7.5])
def test_varlen_func_routes_softcap(cpu_kernels, fake_backward, softcap):
    args = varlen_args((3, 0, 5), (4, 2, 6))
    args.update(q=args["q"] * 4, k=args["k"] * 4)
    out, lse = flash4.flash_attn_varlen_func(**args, causal=True, softcap=softcap, return_lse=True)
    ref, ref_lse = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                        causal=True, softcap=softcap)
    assert cpu_kernels[-1]["softcap"] == softcap and torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)

    q = args["q"].clone().requires_grad_()
    flash4.flash_attn_varlen_func(**dict(args, q=q), window_size=(2, 1), softcap=softcap).float().sum().backward()
    assert cpu_kernels[-1]["softcap"] == softcap and fake_backward["softcap"] == softcap
    assert fake_backward["window_size"] == (2, 1)


def test_varlen_backward_passes_softcap(fake_backward):
    args = varlen_args((3, 5), (4, 6))
    out = torch.zeros_like(args["q"])
    request = Request.varlen(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], 5, 6,
                             softmax_scale=0.1, softcap=12.0)
    backward.run(request, out, out, None)
    assert fake_backward["softcap"] == 12.0 and fake_backward["layout"] == "varlen"


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_kvcache_routes_softcap_to_decode(cpu_kernels, paged, softcap):  # noqa: F811
    args = kv_args(b=3, sq=2, s_cache=40, s_new=1, paged=paged)
    args["q"] = args["q"] * 4
    seqlens = args["cache_seqlens"].clone()
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=True, softcap=softcap, return_lse=True)
    assert cpu_kernels[0]["decode"] and cpu_kernels[0]["softcap"] == softcap
    ref, ref_lse = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], seqlens + 1, args.get("page_table"),
                               causal=True, softcap=softcap)
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_kvcache_batch_idx_routes_softcap_to_varlen(cpu_kernels, softcap):  # noqa: F811
    args = kv_args(b=2, sq=3, s_cache=24, s_new=0)
    args["q"] = args["q"] * 4
    idx = torch.tensor([1, 0], dtype=I32)
    out, lse = flash4.flash_attn_with_kvcache(**args, cache_batch_idx=idx, softcap=softcap, return_lse=True)
    assert "decode" not in cpu_kernels[0] and cpu_kernels[0]["softcap"] == softcap
    ref, ref_lse = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"],
                               cache_batch_idx=idx, softcap=softcap)
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)


# ================================================================ custom ops
def _softcap_of(node):
    return op_argument(node, "softcap")


@pytest.mark.parametrize("test", ["test_schema", "test_autograd_registration", "test_faketensor",
                                  "test_aot_dispatch_dynamic"])
def test_opcheck_with_softcap(test):
    q, k, v = meta_inputs()
    torch.library.opcheck(torch.ops.flash4.fwd.default, (q, k, v, 0.125, True, False, -1, -1, 30.0),
                          test_utils=(test,))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse, split = torch.ops.flash4.fwd(qd, kd, vd, 0.125, False, False, 16, 7, 50.0)
    torch.library.opcheck(torch.ops.flash4.bwd.default,
                          (torch.empty_like(out), qd, kd, vd, out, lse, split, None, 0.125, False, True, -1, -1, 50.0),
                          test_utils=(test,))
    vq, vk, vv, meta = varlen_meta()
    torch.library.opcheck(torch.ops.flash4.varlen_fwd.default,
                          varlen_fwd_args(vq, vk, vv, meta, 128, 130) + (-1, -1, 15.0), test_utils=(test,))
    vq, vk, vv = (t.detach() for t in (vq, vk, vv))
    out, lse, split = torch.ops.flash4.varlen_fwd(*varlen_fwd_args(vq, vk, vv, meta, 128, 130), 5, -1, 15.0)
    torch.library.opcheck(torch.ops.flash4.varlen_bwd.default,
                          (torch.empty_like(out), vq, vk, vv, out, lse, split, None, meta["cu_seqlens_q"],
                           meta["cu_seqlens_k"], None, None, 128, 130, 0.125, True, False, 5, -1, 15.0),
                          test_utils=(test,))
    if test != "test_autograd_registration":  # kvcache has no autograd (mutating op)
        q, k_cache, v_cache, k, v, _ = kvcache_meta(new=1)
        torch.library.opcheck(torch.ops.flash4.kvcache.default,
                              (q, k_cache, v_cache, k, v, torch.empty(2, dtype=I32, device="meta"), None, None, None,
                               0.1, True, 0, False, -1, -1, 50.0), test_utils=(test,))


def test_softcap_reaches_the_backward_ops():
    def step(q, k, v):
        out, lse, _ = torch.ops.flash4.fwd(q, k, v, 0.125, False, False, -1, -1, 30.0)
        return torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))

    calls = flash4_calls(make_fx(step)(*meta_inputs()))
    assert [str(n.target) for n in calls] == ["flash4.fwd.default", "flash4.bwd.default"]
    assert _softcap_of(calls[0]) == _softcap_of(calls[1]) == 30.0

    q, k, v, meta = varlen_meta()

    def varlen_step(q, k, v, cu_q, cu_k):
        out, lse, _ = torch.ops.flash4.varlen_fwd(q, k, v, cu_q, cu_k, None, None, None, 128, 131, 0.125, True,
                                                  False, False, 9, 0, 20.0)
        return torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))

    calls = flash4_calls(make_fx(varlen_step)(q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"]))
    assert [str(n.target) for n in calls] == ["flash4.varlen_fwd.default", "flash4.varlen_bwd.default"]
    assert _softcap_of(calls[1]) == 20.0


@pytest.mark.parametrize("softcap", [0.0, 50, 12.5])
def test_public_functions_pass_softcap_while_compiling(monkeypatch, softcap):
    from flash4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v = meta_inputs()
    calls = flash4_calls(make_fx(lambda a, b, c: flash_attn_func(a, b, c, softcap=softcap))(q, k, v))
    assert [str(n.target) for n in calls] == ["flash4.fwd.default"] and _softcap_of(calls[0]) == softcap

    q, k, v, meta = varlen_meta()
    gm = make_fx(lambda a, b, c, cq, ck: flash_attn_varlen_func(a, b, c, cq, ck, 128, softcap=softcap))(
        q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"])
    calls = flash4_calls(gm)
    assert [str(n.target) for n in calls] == ["flash4.varlen_fwd.default"] and _softcap_of(calls[0]) == softcap

    q, k_cache, v_cache, k, v, _ = kvcache_meta(new=1)
    seqlens = torch.empty(2, dtype=I32, device="meta")
    gm = make_fx(lambda a, kc, vc: flash_attn_with_kvcache(a, kc, vc, k, v, seqlens, softcap=softcap))(
        q, k_cache, v_cache)
    calls = flash4_calls(gm)
    assert [str(n.target) for n in calls] == ["flash4.kvcache.default"] and _softcap_of(calls[0]) == softcap


@pytest.mark.parametrize("softcap, exc", [(-1.0, ValueError), (math.nan, ValueError), (True, TypeError),
                                          ("50", TypeError)])
def test_public_functions_check_softcap_while_compiling(monkeypatch, softcap, exc):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(exc, match="softcap"):
        flash4.flash_attn_func(*meta_inputs(), softcap=softcap)


def test_compiled_softcap_fullgraph():
    """torch.compile(fullgraph=True) of flash_attn_func with a softcap: one graph, softcap reaching fwd and bwd."""
    import torch._dynamo
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    def loss_fn(q, k, v):
        out, lse = flash4.flash_attn_func(q, k, v, causal=True, softcap=30.0, return_lse=True)
        return out.float().sum() + lse.sum()

    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    step = torch.compile(loss_fn, fullgraph=True, backend=backend)
    step(*meta_inputs()).backward()
    targets = [(str(n.target), _softcap_of(n)) for g in backend.fw_graphs + backend.bw_graphs
               for n in g.graph.nodes if n.op == "call_function" and str(n.target).startswith("flash4.")]
    assert targets == [("flash4.fwd.default", 30.0), ("flash4.bwd.default", 30.0)]
