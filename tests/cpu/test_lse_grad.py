"""The backward's treatment of a gradient through the LSE, checked on the CPU in float64.

The kernels compute dS = scale * P * (dP - D) with D = rowsum(dO * O) (flash4.backward's dpsum);
with a loss that also uses LSE_i = log sum_j exp(scale * S_ij), dLSE_i / d(scale * S_ij) = P_ij, so
flash4.backward passes D - dLSE instead of D. This replays that formula with torch and compares
it with autograd through torch.logsumexp (the GPU test tests/gpu/test_bwd.py::test_lse_gradient
checks the kernels themselves).
"""

import math

import pytest
import torch

from flash4.reference import causal_mask


def kernel_formula(q, k, v, dout, dlse, scale, causal):
    """dq, dk, dv the way the kernels compute them, for (S, D) tensors of one head."""
    s = q @ k.T
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[0], k.shape[0]), float("-inf"))
    lse = torch.logsumexp(scale * s, dim=-1)
    # a row that sees no key: P = 0 (the kernels' lse_log2 = +inf there)
    p = torch.where(torch.isfinite(lse)[:, None], torch.exp(scale * s - lse[:, None]), 0.0)
    out = p @ v
    d = (dout * out).sum(-1) - dlse  # flash4.backward: dpsum[:, :, :seqlen_q] -= dlse
    dp = dout @ v.T
    ds = scale * p * (dp - d[:, None])
    return ds @ k, ds.T @ q, p.T @ dout


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(17, 33), (33, 17), (64, 64)])
def test_lse_gradient_formula(sq, sk, causal):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q, k, v = (torch.randn(n, 16, generator=gen, dtype=torch.float64) for n in (sq, sk, sk))
    dout = torch.randn(sq, 16, generator=gen, dtype=torch.float64)
    dlse = torch.randn(sq, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = scale * leaves[0] @ leaves[1].T
    if causal:
        s = s.masked_fill(~causal_mask(sq, sk), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # rows that see no key (causal, sq > sk): out = 0 and lse = -inf, kept out of the loss
    seen = torch.isfinite(lse)
    out = torch.where(seen[:, None], torch.softmax(s, dim=-1), 0.0) @ leaves[2]
    loss = (out * dout).sum() + torch.where(seen, lse * dlse, 0.0).sum()
    loss.backward()
    dlse_used = torch.where(seen, dlse, 0.0)
    got = kernel_formula(q, k, v, dout, dlse_used, scale, causal)
    for name, g, leaf in zip(("dq", "dk", "dv"), got, leaves):
        assert torch.allclose(g, torch.nan_to_num(leaf.grad), atol=1e-10, rtol=1e-8), name
