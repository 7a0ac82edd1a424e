"""The backward kernel's own D for the learnable sink's gradient (BwdConfig.sink_delta, issue 29 item 4) on
the GPU (marker gpu; written on a CPU-only machine, not run yet).

flash4.backward.run(..., delta=buf) fills buf with D_i = sum_j P_ij dP_ij summed in fp32 by the main kernel,
which is rowsum(dO * O) of the float32 output: checked against float64 (to fp32 summation error, and far
closer than the same rowsum of the bf16 out), for every backward work split (128- and 64-query steps, the
row-pad and own-buffer staging, split_headdim, transposed_dkv, the GQA head split), dense and packed, causal /
window / softcap, deterministic (bitwise-equal D across calls). dq / dk / dv are unchanged by it (bitwise).
flash-attn-4's dSink rule itself: tests/gpu/test_fa4_door.py::test_dsink_suite_tolerance.
"""

import pytest
import torch

from flash4 import backward, forward
from flash4.geometry import Band
from flash4.reference import attention_ref, attention_varlen_ref
from flash4.request import Request

BF16 = torch.bfloat16

# (headdim, headdim_v): 64 takes 128-query steps (partials in their own smem buffer), 96 the whole-tile dQ
# (own buffer), 128 the dQ row pad, (192, 192) / (192, 128) transposed_dkv, 256 split_headdim.
HEADDIMS = [(64, 64), (96, 96), (128, 128), (128, 64), (192, 192), (192, 128), (256, 256)]


def _inputs(b, sq, sk, h, hk, d, dv, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(BF16)
    k = torch.randn(b, sk, hk, d, device="cuda", generator=g).to(BF16)
    v = torch.randn(b, sk, hk, dv, device="cuda", generator=g).to(BF16)
    dout = torch.randn(b, sq, h, dv, device="cuda", generator=g).to(BF16)
    sink = torch.randn(h, device="cuda", generator=g)
    return q, k, v, dout, sink


def _check(delta, dout, out, ref_out, what):
    """delta vs float64's rowsum(dO * O): within fp32 summation error, and 8x closer than the bf16 out's."""
    exact = (dout.double() * ref_out.double()).sum(-1).transpose(-1, -2)
    err = (delta.double() - exact).abs().max().item()
    bf16_err = ((dout.double() * out.double()).sum(-1).transpose(-1, -2) - exact).abs().max().item()
    assert err <= 1e-4 * exact.abs().max().item() + 1e-5, (what, err)
    assert 8 * err <= bf16_err, (what, err, bf16_err)


@pytest.mark.parametrize("d, dv", HEADDIMS)
@pytest.mark.parametrize("hk", [4, 1])
@pytest.mark.parametrize("causal, window, softcap", [(True, None, 0.0), (False, None, 0.0), (False, Band(40, 7), 0.0),
                                                     (True, None, 30.0)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dense_delta(d, dv, hk, causal, window, softcap, deterministic):
    q, k, v, dout, sink = _inputs(2, 177, 301, 4, hk, d, dv)
    fwd = Request.dense(q, k, v, None, causal, window if window is not None else (-1, -1), softcap, learnable_sink=sink)
    out, lse = forward.run(fwd)
    bwd = Request.dense(q, k, v, None, causal, window if window is not None else (-1, -1), softcap,
                        deterministic=deterministic)
    delta = torch.full(lse.shape, float("nan"), device="cuda")
    dq, dk, dv_ = backward.run(bwd, dout, out, lse, None, None, delta=delta)
    ref_out, _ = attention_ref(q, k, v, None, causal, compute_dtype=torch.float64, window_size=window,
                               softcap=softcap, learnable_sink=sink)
    _check(delta, dout, out, ref_out, "dense")
    if deterministic:  # sink_delta leaves dq / dk / dv as they were, bit for bit; D the same on every call
        plain = backward.run(bwd, dout, out, lse)
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv_), plain))
        again = torch.full(lse.shape, float("nan"), device="cuda")
        backward.run(bwd, dout, out, lse, None, None, delta=again)
        assert torch.equal(delta, again)


@pytest.mark.parametrize("d, dv", HEADDIMS)
@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_delta(d, dv, seqused):
    lens_q, lens_k = [37, 0, 130, 64], [50, 9, 130, 200]
    h, hk = 4, 2
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    total_q, total_k = int(cu_q[-1]) + 5, int(cu_k[-1])  # 5 packed rows past the last sequence
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(total_q, h, d, device="cuda", generator=g).to(BF16)
    k = torch.randn(total_k, hk, d, device="cuda", generator=g).to(BF16)
    v = torch.randn(total_k, hk, dv, device="cuda", generator=g).to(BF16)
    dout = torch.randn(total_q, h, dv, device="cuda", generator=g).to(BF16)
    sink = torch.randn(h, device="cuda", generator=g)
    used = torch.tensor([30, 0, 130, 60], dtype=torch.int32, device="cuda") if seqused else None
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), used, None, None, None, True)
    out, lse = forward.run(Request.varlen(*args, learnable_sink=sink))
    delta = torch.full(lse.shape, float("nan"), device="cuda")
    backward.run(Request.varlen(*args), dout, out, lse, None, None, delta=delta)
    ref_out, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, used, None, None, None, True,
                                      compute_dtype=torch.float64, learnable_sink=sink)
    rows = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    for b, n in enumerate(used.tolist() if seqused else lens_q):
        rows[int(cu_q[b]):int(cu_q[b]) + n] = True
    assert (delta[:, ~rows] == 0).all()  # rows outside every sequence: 0
    _check(delta[:, rows], dout[rows], out[rows], ref_out[rows], "varlen")
