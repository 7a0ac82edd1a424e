"""Backward kernel vs float32 autograd of the reference on the GPU (marker gpu; skipped without CUDA).

Criterion, per gradient: max |g - g_ref| <= 2 * max |g_pt - g_ref| + atol, where g_ref is the
float32 gradient of flash4.reference.attention_ref and g_pt the same computation in the input
dtype (what PyTorch itself would give). dq, dk, dv are preallocated NaN-filled, so an element the
kernels do not write fails. Shapes: every head dim (64/96/128/192/256: per-warpgroup keys and the
split-headdim kernel), causal and not, seqlens 1, 17, 128, 129, 1000, 4096, seqlen_q != seqlen_k
both ways, GQA 8:1 and MQA, bf16 and fp16.
"""

import math

import pytest
import torch

from flash4 import flash_attn_func
from flash4 import forward
from flash4.request import Request
from flash4.backward import flash_attn_backward
from flash4.config import BWD_SUPPORTED_HEADDIMS
from flash4.reference import attention_ref

from gpu_helpers import GRAD_ATOL, check_bwd, check_deterministic, ref_grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", BWD_SUPPORTED_HEADDIMS)
@pytest.mark.parametrize("s", [1, 17, 128, 129, 1000])
def test_square(s, d, causal):
    check_bwd(2, s, s, 2, 2, d, causal)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 1000), (1000, 17), (128, 4096), (4096, 1000), (129, 1), (1, 129)])
def test_rect(sq, sk, causal, d):
    check_bwd(1, sq, sk, 2, 2, d, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_long(causal, d):
    check_bwd(1, 4096, 4096, 2, 1, d, causal)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("hk", [1, 2])  # MQA and GQA 8:1 (nheads 16)
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(hk, causal, d):
    check_bwd(2, 1000, 1000, 8 * hk if hk == 2 else 16, hk, d, causal)


@pytest.mark.parametrize("d", BWD_SUPPORTED_HEADDIMS)
def test_fp16(d):
    check_bwd(2, 333, 555, 4, 2, d, True, dtype=torch.float16)


def test_autograd_end_to_end():
    """flash_attn_func trains: grads only for inputs that require them, equal to the direct call."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 300, 4, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q.requires_grad_()
    v.requires_grad_()
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert k.grad is None and q.grad is not None and v.grad is not None
    o2, lse = forward.run(Request.dense(q.detach(), k, v.detach(), 1 / 8, True))
    dq, dk, dv = flash_attn_backward(dout, q.detach(), k, v.detach(), o2, lse, 1 / 8, True)
    assert torch.equal(q.grad, dq) or (q.grad - dq).abs().max() < 1e-2  # dq accumulation order may differ
    assert torch.equal(v.grad, dv)


def test_autocast():
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", requires_grad=True) for _ in range(3))  # fp32 leaves
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = flash_attn_func(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16))
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("d", [96, 192, 256])
def test_autograd_every_headdim(d):
    """flash_attn_func trains at the head dims of the split-headdim / 32-byte-swizzle kernels."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (torch.randn(2, 257, 4, d, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    g_ref = ref_grads(q, k, v, dout, True, upcast=True)
    g_pt = ref_grads(q, k, v, dout, True, upcast=False)
    for g, gr, gp in zip((q.grad, k.grad, v.grad), g_ref, g_pt):
        assert (g.float() - gr).abs().max() <= 2 * (gp.float() - gr).abs().max() + GRAD_ATOL


def lse_loss_grads(q, k, v, dout, dlse, causal, fn):
    """dq, dk, dv of sum(out * dout) + sum(lse * dlse), out and lse from fn(q, k, v)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    (out.float() * dout.float()).sum().add((lse.float() * dlse).sum()).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient(d, causal):
    """A loss that uses the LSE (return_lse=True) carries dLSE into dq and dk (issue 13): flash4
    against autograd through the float32 reference's logsumexp, the usual 2x-PyTorch rule; and a
    loss on lse alone."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v, dout = (torch.randn(2, 300, 4, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    dlse = torch.randn(2, 4, 300, generator=gen, device="cuda")
    scale = 1 / math.sqrt(d)
    got = lse_loss_grads(q, k, v, dout, dlse, causal,
                         lambda a, b, c: flash_attn_func(a, b, c, causal=causal, return_lse=True))
    g_ref = lse_loss_grads(q.float(), k.float(), v.float(), dout, dlse, causal,
                           lambda a, b, c: attention_ref(a, b, c, scale, causal, upcast=True))
    g_pt = lse_loss_grads(q, k, v, dout, dlse, causal,
                          lambda a, b, c: attention_ref(a, b, c, scale, causal, upcast=False))
    for name, g, gr, gp in zip(("dq", "dk", "dv"), got, g_ref, g_pt):
        assert torch.isfinite(g).all(), name
        err, pt_err = (g.float() - gr).abs().max().item(), (gp.float() - gr).abs().max().item()
        assert err <= 2 * pt_err + GRAD_ATOL, f"{name}: err {err:.3e} > 2 * {pt_err:.3e} + {GRAD_ATOL}"
    # lse alone: dv = 0, dq and dk from dLSE only
    got = lse_loss_grads(q, k, v, torch.zeros_like(dout), dlse, causal,
                         lambda a, b, c: flash_attn_func(a, b, c, causal=causal, return_lse=True))
    g_ref = lse_loss_grads(q.float(), k.float(), v.float(), torch.zeros_like(dout), dlse, causal,
                           lambda a, b, c: attention_ref(a, b, c, scale, causal, upcast=True))
    g_pt = lse_loss_grads(q, k, v, torch.zeros_like(dout), dlse, causal,
                          lambda a, b, c: attention_ref(a, b, c, scale, causal, upcast=False))
    assert torch.count_nonzero(got[2]) == 0
    for g, gr, gp in zip(got[:2], g_ref[:2], g_pt[:2]):
        assert (g.float() - gr).abs().max() <= 2 * (gp.float() - gr).abs().max() + GRAD_ATOL


def test_memory_is_linear():
    """fwd + bwd at S = 16k, hdim 128, causal: extra memory O(N) (PyTorch's math path needs ~66 GB)."""
    b, s, h, d = 1, 16384, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    flash_attn_func(q, k, v, causal=True).backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # out, lse, dq/dk/dv, fp32 dq accumulator and dpsum/lse_log2: ~ 10 x one input (64 MiB) < 1 GiB
    assert extra < 1 << 30, f"{extra / 2**20:.0f} MiB extra"


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_is_bitwise_reproducible(causal, d):
    """deterministic=True: 100 backward passes give bitwise-identical dq, dk, dv (and they are right)."""
    check_bwd(2, 1000, 1000, 4, 2, d, causal)  # correctness of the default path on the same shape
    check_deterministic(2, 1000, 4, 2, d, causal, calls=100, seed=3)


@pytest.mark.parametrize("d", [64, 192])
def test_dq_accumulator_zeroed_in_recycled_memory(d):
    """The fp32 dQ accumulator is torch.empty memory that the preprocess zeroes (no memset): fill the
    caching allocator's blocks with NaN first, so memory the preprocess failed to zero poisons dq."""
    for _ in range(2):
        poison = torch.full((64 << 20,), math.nan, device="cuda")  # 256 MiB, freed into the cache
        del poison
        check_bwd(2, 1000, 1000, 4, 4, d, causal=True)


def test_dq_into_strided_tensor():
    """A preallocated dq whose strides the postprocess cannot write (a slice of a wider tensor):
    it goes through a temporary, every element still written."""
    b, s, h, d = 2, 300, 4, 64
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out, lse = forward.run(Request.dense(q, k, v, scale, False))
    wide = torch.full((b, s, h, d + 4), math.nan, device="cuda", dtype=torch.bfloat16)
    dq = wide[..., :d]
    dk, dv = (torch.full_like(t, math.nan) for t in (k, v))
    # deterministic: the two calls' dQ sums are bitwise comparable
    flash_attn_backward(dout, q, k, v, out, lse, scale, False, dq=dq, dk=dk, dv=dv, deterministic=True)
    dq_ref, _, _ = flash_attn_backward(dout, q, k, v, out, lse, scale, False, deterministic=True)
    assert torch.equal(dq, dq_ref) and wide[..., d:].isnan().all()
