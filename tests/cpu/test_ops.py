"""flash4's custom ops (flash4.ops) without a GPU: schemas, fake implementations (sizes, strides,
dtypes of every output), autograd registration (fwd -> bwd, dLSE included) and tracing. Tensors
live on the meta device, where the ops run their fake implementations."""

import pytest
import torch
from cpu_helpers import (I32, flash4_calls, kvcache_meta, meta_inputs, op_argument, varlen_fwd_args, varlen_meta)
from torch.fx.experimental.proxy_tensor import make_fx

import flash4.ops  # noqa: F401
from flash4 import flash_attn_func
from flash4.geometry import band


@pytest.mark.parametrize("shape", [(2, 100, 120, 4, 2, 64), (1, 1, 257, 8, 1, 128), (3, 300, 17, 2, 2, 256)])
def test_fake_outputs_match_the_real_contract(shape):
    b, sq, sk, h, hk, d = shape
    q, k, v = meta_inputs(b, sq, sk, h, hk, d)
    out, lse, split = torch.ops.flash4.fwd(q, k, v, 0.125, True, False)
    # what flash4.forward.run returns: out contiguous like q, lse/split contiguous float32
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert split.shape == (2, b, h, sq) and split.dtype == torch.float32
    dq, dk, dv, delta = torch.ops.flash4.bwd(torch.empty_like(out), q, k, v, out, lse, split, None, 0.125, True, False)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous()
    assert delta.shape == (0,)  # each row's D only with sink_delta (a learnable sink needs a gradient)
    *_, delta = torch.ops.flash4.bwd(torch.empty_like(out), q, k, v, out, lse, split, None, 0.125, True, False,
                                     sink_delta=True)
    assert delta.shape == lse.shape and delta.dtype == torch.float32 and delta.is_contiguous()


@pytest.mark.parametrize("test", ["test_schema", "test_autograd_registration", "test_faketensor",
                                  "test_aot_dispatch_dynamic"])
def test_opcheck(test):
    q, k, v = meta_inputs()
    torch.library.opcheck(torch.ops.flash4.fwd.default, (q, k, v, 0.125, False, False), test_utils=(test,))
    out, lse, split = torch.ops.flash4.fwd(*(t.detach() for t in (q, k, v)), 0.125, False, False)
    dlse = torch.empty_like(lse)
    torch.library.opcheck(torch.ops.flash4.bwd.default,
                          (torch.empty_like(out), q.detach(), k.detach(), v.detach(), out, lse, split, dlse, 0.125,
                           False, True), test_utils=(test,))


def test_autograd_traces_to_fwd_and_bwd():
    """A loss on out and lse differentiates through flash4::fwd into one flash4::bwd that receives dlse."""

    def step(q, k, v):
        out, lse, _ = torch.ops.flash4.fwd(q, k, v, 0.125, True, False)
        return torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))

    q, k, v = meta_inputs()
    gm = make_fx(step)(q, k, v)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("flash4.")]
    assert [str(n.target) for n in calls] == ["flash4.fwd.default", "flash4.bwd.default"]
    assert calls[1].args[7] is not None  # dlse reaches the backward
    grads = step(q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_flash_attn_func_uses_the_op_while_compiling(monkeypatch):
    """Under torch.compile's tracing flash_attn_func is one flash4::fwd call (no TVM-FFI call, no
    argument checks that need real pointers or the device)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v = meta_inputs()
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 100) and out.requires_grad
    gm = make_fx(lambda a, b, c: flash_attn_func(a, b, c))(q, k, v)
    assert any(str(n.target) == "flash4.fwd.default" for n in gm.graph.nodes)


# ================================================================ varlen / paged / kvcache ops
@pytest.mark.parametrize("shape", [(300, 260, 3, 4, 2, 64), (1, 4096, 1, 8, 1, 128), (17, 0, 2, 2, 2, 256)])
@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_fakes_match_the_real_contract(shape, seqused):
    total_q, total_k, batch, h, hk, d = shape
    q, k, v, meta = varlen_meta(total_q, total_k, batch, h, hk, d, seqused=seqused)
    out, lse, split = torch.ops.flash4.varlen_fwd(*varlen_fwd_args(q, k, v, meta))
    # what flash4.forward.run returns (packed): out (total_q, H, D) contiguous, lse (H, total_q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (h, total_q) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert split.shape == (2, h, total_q) and split.dtype == torch.float32 and split.is_contiguous()
    grads = torch.ops.flash4.varlen_bwd(torch.empty_like(out), q, k, v, out, lse, split, None, meta["cu_seqlens_q"],
                                        meta["cu_seqlens_k"], meta["seqused_q"], meta["seqused_k"], None, None, 0.125,
                                        True, False)
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous()


def test_paged_varlen_fake():
    q, k, v, meta = varlen_meta(paged=True, grad=False)
    out, lse, split = torch.ops.flash4.varlen_fwd(*varlen_fwd_args(q, k, v, meta, max_q=None))
    assert out.shape == q.shape and lse.shape == (4, 300) and split.shape == (2, 4, 300)


@pytest.mark.parametrize("test", ["test_schema", "test_autograd_registration", "test_faketensor",
                                  "test_aot_dispatch_dynamic"])
@pytest.mark.parametrize("variant", ["packed", "seqused", "max_none"])
def test_varlen_opcheck(test, variant):
    q, k, v, meta = varlen_meta(seqused=variant == "seqused")
    max_q, max_k = (None, None) if variant == "max_none" else (128, 130)
    torch.library.opcheck(torch.ops.flash4.varlen_fwd.default, varlen_fwd_args(q, k, v, meta, max_q, max_k),
                          test_utils=(test,))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse, split = torch.ops.flash4.varlen_fwd(*varlen_fwd_args(qd, kd, vd, meta, max_q, max_k))
    torch.library.opcheck(torch.ops.flash4.varlen_bwd.default,
                          (torch.empty_like(out), qd, kd, vd, out, lse, split, torch.empty_like(lse),
                           meta["cu_seqlens_q"], meta["cu_seqlens_k"], meta["seqused_q"], meta["seqused_k"], max_q,
                           max_k, 0.125, True, True), test_utils=(test,))


def test_varlen_autograd_traces_to_fwd_and_bwd():
    """A loss on out and lse differentiates through flash4::varlen_fwd into one flash4::varlen_bwd that
    receives dlse, the metadata and max_seqlen_k."""
    q, k, v, meta = varlen_meta()

    def step(q, k, v, cu_q, cu_k):
        out, lse, _ = torch.ops.flash4.varlen_fwd(q, k, v, cu_q, cu_k, None, None, None, 128, 131, 0.125, True,
                                                  False, False)
        return torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))

    gm = make_fx(step)(q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"])
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("flash4.")]
    assert [str(n.target) for n in calls] == ["flash4.varlen_fwd.default", "flash4.varlen_bwd.default"]
    bwd_args = calls[1].args
    assert bwd_args[7] is not None  # dlse
    assert bwd_args[12:14] == (128, 131)  # max_seqlen_q / max_seqlen_k reach the backward
    grads = step(q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"])
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_paged_varlen_backward_raises():
    from flash4.autograd import PAGED_BACKWARD_ERROR

    q, k, v, meta = varlen_meta(paged=True)
    out, _, _ = torch.ops.flash4.varlen_fwd(*varlen_fwd_args(q, k, v, meta))
    with pytest.raises(RuntimeError) as info:
        out.float().sum().backward()
    assert PAGED_BACKWARD_ERROR in str(info.value)


@pytest.mark.parametrize("max_seqlen", [256, None, "tensor"])
def test_varlen_func_uses_the_op_while_compiling(monkeypatch, max_seqlen):
    """Under torch.compile's tracing flash_attn_varlen_func is one flash4::varlen_fwd call; a tensor
    max_seqlen reaches the op as None (computed from the metadata when the graph runs)."""
    from flash4 import flash_attn_varlen_func

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v, meta = varlen_meta()
    max_q = torch.tensor(256, dtype=I32) if max_seqlen == "tensor" else max_seqlen
    out, lse = flash_attn_varlen_func(q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"], max_q, None, causal=True,
                                      return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 300) and out.requires_grad
    gm = make_fx(lambda a, b, c, cq, ck: flash_attn_varlen_func(a, b, c, cq, ck, max_q))(
        q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"])
    calls = [n for n in gm.graph.nodes if str(n.target) == "flash4.varlen_fwd.default"]
    assert len(calls) == 1
    assert calls[0].args[8] == (256 if max_seqlen == 256 else None)
    assert calls[0].args[10] == pytest.approx(1 / 8)  # 1/sqrt(64)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("new", [0, 3])
def test_kvcache_fake_and_schema(paged, new):
    q, k_cache, v_cache, k, v, page_table = kvcache_meta(seqlen_q=3, new=new, paged=paged)
    seqlens = torch.empty(2, dtype=I32, device="meta")
    out, lse = torch.ops.flash4.kvcache(q, k_cache, v_cache, k, v, seqlens, None, page_table, None, 0.1, True, 0, False)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 8, 3) and lse.dtype == torch.float32 and lse.is_contiguous()
    schema = torch.ops.flash4.kvcache.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == [
        "k_cache", "v_cache"]
    for test in ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"):
        torch.library.opcheck(torch.ops.flash4.kvcache.default,
                              (q, k_cache, v_cache, k, v, seqlens, None, page_table, None, 0.1, True, 0, False),
                              test_utils=(test,))


@pytest.mark.parametrize("cache_seqlens", [None, 7, "tensor"])
@pytest.mark.parametrize("with_out", [False, True])
def test_kvcache_func_uses_the_op_while_compiling(monkeypatch, cache_seqlens, with_out):
    """Under torch.compile's tracing flash_attn_with_kvcache is one flash4::kvcache call (an int
    cache_seqlens travels as cache_seqlens_int); out= receives a copy of the op's output."""
    from flash4 import flash_attn_with_kvcache

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k_cache, v_cache, k, v, _ = kvcache_meta(new=1)
    seqlens = torch.empty(2, dtype=I32, device="meta") if cache_seqlens == "tensor" else cache_seqlens
    if cache_seqlens is None:
        k = v = None  # the whole cache: no room to append
    out = torch.empty_like(q) if with_out else None

    def call(q, k_cache, v_cache):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, causal=True, return_lse=True, out=out)

    result, lse = call(q, k_cache, v_cache)
    assert result.shape == q.shape and lse.shape == (2, 8, 1)
    if with_out:
        assert result is out
    gm = make_fx(call)(q, k_cache, v_cache)
    calls = [n for n in gm.graph.nodes if str(n.target) == "flash4.kvcache.default"]
    assert len(calls) == 1
    assert (calls[0].args[5] is None) == (cache_seqlens != "tensor")
    assert calls[0].args[6] == (7 if cache_seqlens == 7 else None)
    assert any(str(n.target) == "aten.copy_.default" for n in gm.graph.nodes) == with_out


def _placeholder(arg, tensor):
    """A value of arg's schema type: the CPU tensor for tensors, None for optionals."""
    if isinstance(arg.type, torch._C.OptionalType):
        return None
    if arg.type.isSubtypeOf(torch._C.TensorType.get()):
        return tensor
    return {"float": 0.125, "bool": False}.get(str(arg.type), 1)


def test_ops_are_registered_for_cuda_only():
    """Every flash4 op has a CUDA kernel and a fake (Meta) kernel; its CPU kernel only refuses (a
    ValueError naming the argument, tests/cpu/test_ops_cpu_tensors.py): a CPU call is an error,
    never a silent fallback."""
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "kvcache"):
        qualname = f"flash4::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"), name
        op = getattr(torch.ops.flash4, name).default
        args = [_placeholder(arg, q) for arg in op._schema.arguments if not arg.has_default_value()]
        first = op._schema.arguments[0].name
        with pytest.raises(ValueError, match=f"{qualname}: {first} is on cpu"):
            op(*args)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flash4::varlen_fwd", "Autograd")


# ================================================================ torch.compile on the meta device
# torch.compile(fullgraph=True) with the aot_eager backend traces each public function (Dynamo),
# builds the joint forward/backward graph (AOTAutograd) and runs it on meta tensors, where the ops
# run their fakes: any graph break fails (fullgraph), and the backward graph is checked too. The
# GPU side (inductor, real kernels, values) is tests/gpu/test_integrations.py.
def _compiled(fn, dynamic=False):
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
def test_flash_attn_func_compiles_fullgraph(dynamic):
    def loss_fn(q, k, v):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out.float().sum() + lse.sum()

    step = _compiled(loss_fn, dynamic)
    for sq in (100, 37):  # a second seqlen: recompiled (static) or reused (dynamic), never a break
        q, k, v = meta_inputs(sq=sq)
        step(q, k, v).backward()
        assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]


def test_flash_attn_varlen_func_compiles_fullgraph():
    from flash4 import flash_attn_varlen_func

    def loss_fn(q, k, v, cu_q, cu_k, max_q):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, None, causal=True, return_lse=True)
        return out.float().square().sum() + lse.sum()

    step = _compiled(loss_fn, dynamic=True)
    for total_q, max_q in ((300, 128), (280, torch.tensor(100))):
        q, k, v, meta = varlen_meta(total_q=total_q)
        step(q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"], max_q).backward()
        assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]


def test_flash_attn_with_kvcache_compiles_fullgraph():
    from flash4 import flash_attn_with_kvcache

    def decode(q, k_cache, v_cache, k, v, seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, causal=True, return_lse=True)

    q, k_cache, v_cache, k, v, _ = kvcache_meta(new=1)
    out, lse = _compiled(decode)(q, k_cache, v_cache, k, v, torch.empty(2, dtype=I32, device="meta"))
    assert out.shape == q.shape and lse.shape == (2, 8, 1)


# ================================================================ sliding windows (window_left / window_right)
def _window_of(node):
    """(window_left, window_right) a traced flash4 op call received."""
    return op_argument(node, "window_left"), op_argument(node, "window_right")


def test_window_arguments_in_every_schema():
    """Every op has `SymInt? window_left=None, SymInt? window_right=None, float softcap=0.0` at its end
    (literal sides, None unbounded; then, on the forward ops, `Tensor? learnable_sink=None`, on the
    backward ops `bool sink_delta=False`) (callers without a window, a softcap or a sink keep working)."""
    for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "kvcache"):
        args = getattr(torch.ops.flash4, name).default._schema.arguments
        if name in ("fwd", "varlen_fwd", "kvcache"):
            assert args[-1].name == "learnable_sink" and args[-1].default_value is None, name
            assert str(args[-1].type) == "Optional[Tensor]", name
            args = args[:-1]
        else:
            assert args[-1].name == "sink_delta" and args[-1].default_value is False, name
            args = args[:-1]
        assert [(a.name, a.default_value) for a in args[-3:]] == [("window_left", None), ("window_right", None),
                                                                  ("softcap", 0.0)], name
        assert str(args[-1].type) == "float", name


@pytest.mark.parametrize("test", ["test_schema", "test_autograd_registration", "test_faketensor",
                                  "test_aot_dispatch_dynamic"])
def test_opcheck_with_window(test):
    q, k, v = meta_inputs()
    torch.library.opcheck(torch.ops.flash4.fwd.default, (q, k, v, 0.125, True, False, 64, 0), test_utils=(test,))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse, split = torch.ops.flash4.fwd(qd, kd, vd, 0.125, False, False, 16, 7)
    torch.library.opcheck(torch.ops.flash4.bwd.default,
                          (torch.empty_like(out), qd, kd, vd, out, lse, split, torch.empty_like(lse), 0.125, False,
                           True, 16, 7), test_utils=(test,))
    vq, vk, vv, meta = varlen_meta()
    torch.library.opcheck(torch.ops.flash4.varlen_fwd.default,
                          varlen_fwd_args(vq, vk, vv, meta, 128, 130) + (5, None), test_utils=(test,))
    vq, vk, vv = (t.detach() for t in (vq, vk, vv))
    out, lse, split = torch.ops.flash4.varlen_fwd(*varlen_fwd_args(vq, vk, vv, meta, 128, 130), 5, None)
    torch.library.opcheck(torch.ops.flash4.varlen_bwd.default,
                          (torch.empty_like(out), vq, vk, vv, out, lse, split, None, meta["cu_seqlens_q"],
                           meta["cu_seqlens_k"], None, None, 128, 130, 0.125, True, False, 5, None), test_utils=(test,))
    if test != "test_autograd_registration":  # kvcache has no autograd (mutating op)
        q, k_cache, v_cache, k, v, _ = kvcache_meta(new=1)
        torch.library.opcheck(torch.ops.flash4.kvcache.default,
                              (q, k_cache, v_cache, k, v, torch.empty(2, dtype=I32, device="meta"), None, None, None,
                               0.1, True, 0, False, 1023, 0), test_utils=(test,))


def test_window_reaches_the_backward_op():
    """The autograd formulas hand the forward's window to flash4::bwd / flash4::varlen_bwd."""

    def step(q, k, v):
        out, lse, _ = torch.ops.flash4.fwd(q, k, v, 0.125, False, False, 32, 3)
        return torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))

    calls = flash4_calls(make_fx(step)(*meta_inputs()))
    assert [str(n.target) for n in calls] == ["flash4.fwd.default", "flash4.bwd.default"]
    assert _window_of(calls[1]) == (32, 3)

    q, k, v, meta = varlen_meta()

    def varlen_step(q, k, v, cu_q, cu_k):
        out, lse, _ = torch.ops.flash4.varlen_fwd(q, k, v, cu_q, cu_k, None, None, None, 128, 131, 0.125, True,
                                                  False, False, 9, 0)
        return torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))

    calls = flash4_calls(make_fx(varlen_step)(q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"]))
    assert [str(n.target) for n in calls] == ["flash4.varlen_fwd.default", "flash4.varlen_bwd.default"]
    assert _window_of(calls[1]) == (9, 0)


@pytest.mark.parametrize("window", [(-1, -1), (100, 0), (0, -1), [7, 7]])
def test_public_functions_pass_the_window_while_compiling(monkeypatch, window):
    """Under torch.compile's tracing each public function hands window_size to its op as its literal
    sides (flash4.geometry.band: -1 -> None; a list is accepted like a tuple)."""
    from flash4 import flash_attn_varlen_func, flash_attn_with_kvcache

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v = meta_inputs()
    calls = flash4_calls(make_fx(lambda a, b, c: flash_attn_func(a, b, c, window_size=window))(q, k, v))
    assert [str(n.target) for n in calls] == ["flash4.fwd.default"] and _window_of(calls[0]) == tuple(band(window))

    q, k, v, meta = varlen_meta()
    gm = make_fx(lambda a, b, c, cq, ck: flash_attn_varlen_func(a, b, c, cq, ck, 128, window_size=window))(
        q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"])
    calls = flash4_calls(gm)
    assert [str(n.target) for n in calls] == ["flash4.varlen_fwd.default"]
    assert _window_of(calls[0]) == tuple(band(window))

    q, k_cache, v_cache, k, v, _ = kvcache_meta(new=1)
    seqlens = torch.empty(2, dtype=I32, device="meta")
    gm = make_fx(lambda a, kc, vc: flash_attn_with_kvcache(a, kc, vc, k, v, seqlens, window_size=window))(
        q, k_cache, v_cache)
    calls = flash4_calls(gm)
    assert [str(n.target) for n in calls] == ["flash4.kvcache.default"] and _window_of(calls[0]) == tuple(band(window))


@pytest.mark.parametrize("window, exc", [((-2, 0), ValueError), ((1.5, 0), TypeError), (None, TypeError)])
def test_public_functions_check_the_window_while_compiling(monkeypatch, window, exc):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(exc, match="window_size"):
        flash_attn_func(*meta_inputs(), window_size=window)


def test_compiled_window_fullgraph():
    """torch.compile(fullgraph=True, dynamic=True) of flash_attn_func with a window (forward and backward
    on meta tensors): one graph, the window reaching both ops."""
    import torch._dynamo
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    def loss_fn(q, k, v):
        out, lse = flash_attn_func(q, k, v, causal=True, window_size=(256, -1), return_lse=True)
        return out.float().sum() + lse.sum()

    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    step = torch.compile(loss_fn, fullgraph=True, backend=backend, dynamic=True)
    for sq in (100, 37):
        q, k, v = meta_inputs(sq=sq)
        step(q, k, v).backward()
        assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    fwd_calls = [c for g in backend.fw_graphs for c in flash4_calls(g)]
    bwd_calls = [c for g in backend.bw_graphs for c in flash4_calls(g)]
    assert fwd_calls and bwd_calls
    assert {str(c.target) for c in fwd_calls} == {"flash4.fwd.default"}
    assert {str(c.target) for c in bwd_calls} == {"flash4.bwd.default"}
    assert all(_window_of(c) == (256, None) for c in fwd_calls + bwd_calls)


# ================================================================ one tensor as two arguments
def test_one_tensor_as_several_arguments_compiles_fullgraph():
    """Self-attention (q, k and v one tensor) and one cu_seqlens for q and k: the autograd path takes
    each tensor once (Dynamo refuses an autograd.Function with a repeated tensor input), the ops get
    every argument, and the backward reaches every leaf."""
    import torch._dynamo
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from flash4 import flash_attn_varlen_func

    def self_attention(x):
        return flash_attn_func(x, x, x, causal=True).float().sum()

    def packed(q, k, v, cu):
        out, lse = flash_attn_varlen_func(q, k, v, cu, cu, 128, None, causal=True, return_lse=True)
        return out.float().sum() + lse.sum()

    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    x = torch.empty(2, 100, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    torch.compile(self_attention, fullgraph=True, backend=backend)(x).backward()
    assert x.grad.shape == x.shape
    q, k, v, meta = varlen_meta()
    torch.compile(packed, fullgraph=True, backend=backend, dynamic=True)(q, k, v, meta["cu_seqlens_q"]).backward()
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    targets = [str(c.target) for g in backend.fw_graphs + backend.bw_graphs for c in flash4_calls(g)]
    assert targets == ["flash4.fwd.default", "flash4.varlen_fwd.default", "flash4.bwd.default",
                       "flash4.varlen_bwd.default"]


def test_saved_varlen_flag_is_an_int_index():
    """The autograd formula indexes per-door tuples with ctx.varlen; under torch.compile, torch 2.11's
    Dynamo refuses a bool as a tuple index (H200 run of c206542: every compiled backward failed with
    "indices must be integers or slices, not bool"), so the flag is kept as an int."""
    from types import SimpleNamespace

    from flash4 import autograd, ops

    for varlen in (False, True):
        ctx = SimpleNamespace(set_materialize_grads=lambda value: None)
        args = [None] * len(ops.FORWARD_ARGS[varlen])
        if varlen:
            args[ops.FORWARD_ARGS[1].index("page_table")] = object()  # paged: _save stops after the flags
        else:
            ctx.save_for_backward = lambda *tensors: None
        autograd._save(ctx, varlen, tuple(args), (None, None, None), None, use_ops=True)
        assert type(ctx.varlen) is int and ctx.varlen == int(varlen)
