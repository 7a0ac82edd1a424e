"""The sm100 backward's numerics model (flash4.models.sm100_bwd) against flash4.reference, on the CPU.

Criterion (the project's, flash4.selftest's for gradients): err <= 2 * err(PyTorch in the input
dtype) + GRAD_ATOL, both max |x - float32 reference|. Random inputs: head dims 64 and 128, causal,
a sliding window or neither, GQA / MQA, lengths not multiples of 128, seqlen_q above and below seqlen_k, bf16 and fp16,
larger scores. It checks the algorithm (P^T rounded for dV, dS^T rounded for dK and dQ, fp32
accumulators, the rounded log2 LSE), not the kernel (never run on hardware).

    python tests/cpu/test_sm100_bwd_numerics.py    # prints the error bands
"""

from __future__ import annotations

import pytest
import torch

from flash4.models import sm100_bwd_kernel as M
from flash4.reference import attention_ref, max_abs_err
from flash4.selftest import GRAD_ATOL

CASES = [  # (b, sq, sk, h, hk, d, causal, dtype, magnitude, window_size)
    (1, 200, 300, 2, 2, 128, False, torch.bfloat16, 1.0, None),
    (1, 300, 131, 4, 1, 128, True, torch.bfloat16, 1.0, None),
    (2, 131, 257, 4, 2, 64, True, torch.float16, 1.0, None),
    (1, 257, 257, 3, 1, 64, False, torch.bfloat16, 3.0, None),
    (1, 300, 200, 2, 1, 128, False, torch.bfloat16, 1.0, (45, 7)),
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _grads(q, k, v, dout, causal, upcast, window_size=None):
    leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, None, causal, upcast=upcast, window_size=window_size)
    return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


def errors(case):
    b, sq, sk, h, hk, d, causal, dtype, mag, window = case
    g = torch.Generator().manual_seed(sq * 7 + sk)
    q = (torch.randn(b, sq, h, d, generator=g) * mag).to(dtype)
    k = (torch.randn(b, sk, hk, d, generator=g) * mag).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    dout = torch.randn(b, sq, h, d, generator=g).to(dtype)
    out, lse = attention_ref(q, k, v, None, causal, window_size=window)  # the forward's out and lse
    got = M.backward(q, k, v, out.to(dtype), dout, lse.float(), None, causal, window)
    ref = _grads(q, k, v, dout, causal, True, window)
    pt = _grads(q, k, v, dout, causal, False, window)
    return {name: (max_abs_err(x, r), max_abs_err(p, r)) for name, x, r, p in zip(("dq", "dk", "dv"), got, ref, pt)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-"
                         f"{'causal' if c[6] else 'full'}-{str(c[7])[6:]}-x{c[8]:g}" + (f"-w{c[9]}" if c[9] else ""))
def test_model_within_the_2x_rule(case):
    for name, (err, pt) in errors(case).items():
        assert err <= 2 * pt + GRAD_ATOL, (name, err, pt)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for case in CASES:
        print(case, {n: (f"{e:.3g}", f"{p:.3g}") for n, (e, p) in errors(case).items()})
