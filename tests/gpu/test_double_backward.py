"""Double backward (issue 8, item 4; marker gpu via tests/conftest.py; skipped without CUDA).

flash4's gradients cannot be differentiated again: with create_graph=True a backward through
dq/dk/dv must raise a RuntimeError that says "double backward" and names flash4, not silently treat
the gradients as constants (flash_attn_func with and without return_lse, causal and not, a
gradient penalty on each of dq, dk, dv). First-order gradients under create_graph=True are bitwise
those of an ordinary backward.
"""

import pytest
import torch

from flash4 import flash_attn_func


def small_leaves(seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, 128, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)]


def assert_double_backward_error(err):
    msg = str(err.value)
    assert "double backward" in msg.lower() and "flash4" in msg.lower(), msg


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_double_backward_raises(return_lse, causal):
    q, k, v = small_leaves()
    res = flash_attn_func(q, k, v, causal=causal, return_lse=return_lse)
    out = res[0] if return_lse else res
    dq, = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError) as err:
        (dq ** 2).sum().backward()
    assert_double_backward_error(err)


@pytest.mark.parametrize("which", ["dq", "dk", "dv"])
def test_double_backward_raises_through_every_gradient(which):
    """A gradient penalty on any one of dq, dk, dv (inputs all requiring grad), mixed with a
    first-order term: the backward through it raises."""
    q, k, v = small_leaves()
    out = flash_attn_func(q, k, v)
    first = torch.autograd.grad(out.float().pow(2).sum(), (q, k, v), create_graph=True)
    grads = dict(zip(("dq", "dk", "dv"), first))
    loss = out.float().sum() + grads[which].float().pow(2).sum()
    with pytest.raises(RuntimeError) as err:
        loss.backward()
    assert_double_backward_error(err)


@pytest.mark.parametrize("return_lse", [False, True])
def test_create_graph_first_order_matches(return_lse):
    """create_graph=True still gives the first-order gradients, bitwise equal to an ordinary
    backward (seqlen 128 is one key block at d 64: dq has one contribution per element)."""
    q, k, v = small_leaves()
    dout = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda").to(q.dtype)

    def first(create_graph):
        res = flash_attn_func(q, k, v, return_lse=return_lse)
        out = res[0] if return_lse else res
        return torch.autograd.grad(out, (q, k, v), dout, create_graph=create_graph)

    with_graph = first(True)
    plain = first(False)
    for name, a, b in zip(("dq", "dk", "dv"), with_graph, plain):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a.detach(), b), name
