"""The public API without a GPU: errors before any device use, public names, import hygiene,
the empty-input fast paths of the host forward (flash4.forward.run) and the autograd plumbing
(flash4.autograd: the one path, with the launches stubbed)."""

import math
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import flash4
from flash4 import api, autograd, flash_attn_func, forward
from flash4.request import Request

SRC = Path(flash4.__file__).parent


def qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64, dtype=torch.bfloat16):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def test_public_names():
    assert flash4.__all__ == ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "__version__"]
    assert flash4.flash_attn_func is api.flash_attn_func
    assert flash4.flash_attn_varlen_func is api.flash_attn_varlen_func
    assert flash4.flash_attn_with_kvcache is api.flash_attn_with_kvcache


def test_version_matches_installed_metadata():
    try:
        installed = metadata.version("flash4")
    except metadata.PackageNotFoundError:
        pytest.skip("flash4 is not pip-installed here")
    assert installed == flash4.__version__


@pytest.mark.parametrize("shape", [(2, 16, 24), (0, 16, 24), (2, 0, 24), (2, 16, 0)])
def test_cpu_tensors_rejected_naming_the_device(shape):
    b, sq, sk = shape
    with pytest.raises(ValueError, match=r"q is on cpu; flash4 runs on CUDA tensors only"):
        flash_attn_func(*qkv(b=b, sq=sq, sk=sk))


def test_type_errors_come_first():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match="q.dtype is torch.float32"):
        flash_attn_func(q, k, v)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flash_attn_func(*qkv(), return_lse="yes")
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got NoneType"):
        flash_attn_func(qkv()[0], None, qkv()[2])


def test_shape_errors_on_cpu_tensors():
    q, k, v = qkv(h=6, hk=4)
    with pytest.raises(ValueError, match="nheads_k=4 .* must divide nheads=6"):
        flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=r"headdim 100 \(q/k.shape\[3\]\) is not supported: .*multiple of 8"):
        flash_attn_func(*qkv(d=100))
    with pytest.raises(ValueError, match="CUDA"):  # 80 is served (zero-padded to 96): only the device is wrong
        flash_attn_func(*qkv(d=80))


@pytest.mark.parametrize("b, sq", [(0, 16), (2, 0)])
def test_forward_empty_outputs(b, sq):
    q, k, v = qkv(b=b, sq=sq)
    out, lse = forward.run(Request.dense(q, k, v, None, True))
    assert out.shape == (b, sq, 4, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (b, 4, sq) and lse.dtype == torch.float32


def test_forward_no_keys_gives_zero_and_neg_inf():
    q, k, v = qkv(sk=0)
    out = torch.full((2, 16, 4, 64), math.nan, dtype=torch.bfloat16)
    lse = torch.full((2, 4, 16), math.nan)
    res = forward.run(Request.dense(q, k, v, 0.1, False), out=out, lse=lse)
    assert res[0] is out and res[1] is lse
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_forward_rejects_bad_buffers():
    q, k, v = qkv(sk=0)
    request = Request.dense(q, k, v, None, False)
    with pytest.raises(ValueError, match="out must be torch.bfloat16 of shape"):
        forward.run(request, out=torch.empty(2, 16, 4, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lse must be torch.float32 of shape"):
        forward.run(request, lse=torch.empty(2, 4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lse must be contiguous"):
        forward.run(request, lse=torch.empty(2, 16, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="out has stride"):
        forward.run(request, out=torch.empty(2, 16, 64, 4, dtype=torch.bfloat16).transpose(2, 3))
    with pytest.raises(ValueError, match=r"lse_split must be torch.float32 of shape \(2, 2, 4, 16\)"):
        forward.run(request, lse_split=torch.empty(2, 4, 16))


def test_forward_accepts_odd_seqlen_lse():
    q, k, v = qkv(sq=17, sk=0)  # lse rows of 17 floats: contiguous is all lse needs
    out, lse = forward.run(Request.dense(q, k, v, None, False), lse=torch.empty(2, 4, 17))
    assert torch.isneginf(lse).all()


@pytest.fixture
def stub_forward(monkeypatch):
    """flash4.forward.launch replaced by out = q, lse = 0, lse_split = (7, 0.5); returns what it saw."""
    seen = {}

    def launch(request, out, lse, lse_split=None):
        seen.update(fwd_window=request.mask.window, fwd_softcap=request.score.softcap)
        out.copy_(request.q)
        lse.zero_()
        if lse_split is not None:
            lse_split[0].fill_(7.0)
            lse_split[1].fill_(0.5)

    monkeypatch.setattr(forward, "launch", launch)
    return seen


def _subset(seen, expected):
    return {key: seen[key] for key in expected}


def test_autograd_routes_backward(stub_forward, fake_backward):
    """The autograd path saves what the backward needs (the log2 LSE split too) and returns grads only where asked."""
    q, k, v = (t.float() for t in qkv())
    q.requires_grad_()
    v.requires_grad_()
    out, lse = autograd.attention(Request.dense(q, k, v, 0.125, True))
    assert out.requires_grad and lse.requires_grad
    out.sum().backward()
    expected = {"scale": 0.125, "causal": True, "lse_shape": (q.shape[0], q.shape[2], q.shape[1]), "det": False,
                "split_values": ([7.0], [0.5]), "dlse": None, "dout": [1.0], "window": None, "softcap": 0.0}
    assert _subset(fake_backward, expected) == expected and stub_forward == {"fwd_window": None, "fwd_softcap": 0.0}
    assert torch.equal(q.grad, torch.ones_like(q)) and torch.equal(v.grad, 3 * torch.ones_like(v))
    assert k.grad is None


def test_autograd_skipped_without_grad(stub_forward, fake_backward):
    """No input requiring grad (or grad mode off): flash4.forward.run directly, outputs without autograd."""
    q, k, v = (t.float() for t in qkv())
    out, lse = autograd.attention(Request.dense(q, k, v, 0.125, True))
    assert not out.requires_grad and not lse.requires_grad
    with torch.no_grad():
        out, _ = autograd.attention(Request.dense(q.requires_grad_(), k, v, 0.125, True))
    assert not out.requires_grad


def test_lse_gradient_is_routed(stub_forward, fake_backward):
    """A loss on lse reaches the backward as dlse (None when lse is unused); a loss on lse alone
    gives a zero dout."""
    q, k, v = (t.float().requires_grad_() for t in qkv())
    out, lse = autograd.attention(Request.dense(q, k, v, 0.125, False))
    (3.0 * lse).sum().backward()
    assert fake_backward["dlse"] == [3.0] and fake_backward["dout"] == [0.0]
    out, lse = autograd.attention(Request.dense(q, k, v, 0.125, False))
    (out.sum() + 2.0 * lse.sum()).backward()
    assert fake_backward["dlse"] == [2.0] and fake_backward["dout"] == [1.0]


def test_one_tensor_as_q_k_and_v(stub_forward, fake_backward):
    """flash_attn_func(x, x, x): the autograd path takes x once and hands it dq + dk + dv."""
    x = qkv(hk=4)[0].float().requires_grad_()
    out, _ = autograd.attention(Request.dense(x, x, x, 0.125, True))
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 6.0))  # 1 + 2 + 3 (fake_backward's dq, dk, dv)


def test_double_backward_raises(stub_forward, fake_backward):
    """A gradient penalty through flash4's dq (create_graph=True, then a backward through dq) raises
    flash4's error instead of silently treating dq as a constant; first-order grads are unchanged."""
    from flash4.autograd import DOUBLE_BACKWARD_ERROR

    q, k, v = (t.float().requires_grad_() for t in qkv())
    out, _ = autograd.attention(Request.dense(q, k, v, 0.125, False))
    dq, dk = torch.autograd.grad(out.sum(), (q, k), create_graph=True)
    assert torch.equal(dq, torch.ones_like(q)) and torch.equal(dk, 2 * torch.ones_like(k))
    assert dq.requires_grad and dk.requires_grad
    with pytest.raises(RuntimeError, match="double backward is not supported") as err:
        ((dq ** 2).sum() + (v ** 2).sum()).backward()
    assert str(err.value) == DOUBLE_BACKWARD_ERROR
    # Without create_graph the gradients carry no graph (nothing to guard).
    out, _ = autograd.attention(Request.dense(q, k, v, 0.125, False))
    dq, = torch.autograd.grad(out.sum(), q)
    assert not dq.requires_grad


def test_import_is_light():
    """`import flash4` pulls in neither the CuTe DSL nor flash_attn (both load only when needed)."""
    code = "import sys, flash4; print(sorted(m for m in ('cutlass', 'flash_attn') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_flash_attn_is_imported_only_in_baselines():
    offenders = [
        str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
        if p.name != "baselines.py" and any(
            line.lstrip().startswith(("import flash_attn", "from flash_attn")) for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []


def test_env_is_the_only_reader_of_flash4_variables():
    offenders = [
        str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
        if p.name != "env.py" and "FLASH4_" in p.read_text()
        and ("environ" in p.read_text() or "getenv" in p.read_text())
    ]
    assert offenders == []
