"""flash4's custom ops (flash4.ops) without a GPU: schemas, fake implementations (sizes, strides,
dtypes of every output), autograd registration (fwd -> bwd, dLSE included) and tracing. Tensors
live on the meta device, where the ops run their fake implementations."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import flash4.ops  # noqa: F401
from flash4 import flash_attn_func


def meta_inputs(b=2, sq=100, sk=120, h=4, hk=2, d=64, dtype=torch.bfloat16, grad=True):
    return [torch.empty(b, s, n, d, dtype=dtype, device="meta", requires_grad=grad)
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


@pytest.mark.parametrize("shape", [(2, 100, 120, 4, 2, 64), (1, 1, 257, 8, 1, 128), (3, 300, 17, 2, 2, 256)])
def test_fake_outputs_match_the_real_contract(shape):
    b, sq, sk, h, hk, d = shape
    q, k, v = meta_inputs(b, sq, sk, h, hk, d)
    out, lse, split = torch.ops.flash4.fwd(q, k, v, 0.125, True, False)
    # what api._flash_attn_forward returns: out contiguous like q, lse/split contiguous float32
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert split.shape == (2, b, h, sq) and split.dtype == torch.float32
    dq, dk, dv = torch.ops.flash4.bwd(torch.empty_like(out), q, k, v, out, lse, split, None, 0.125, True, False)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous()


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
