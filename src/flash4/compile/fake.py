"""Fake (shape-only) tensors for compiling without a GPU or real data.

Every extent is a runtime symbol, strides are runtime symbols except the contiguous head dim; one
compiled kernel then serves every batch, seqlen, head count and (last-dim-contiguous) stride.
"""

import cutlass
import cutlass.cute as cute

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
# 16-byte alignment (TMA) for 16-bit elements: strides divisible by 8 elements.
DIV_16B = 8


def _fake(dtype, shape, leading_dim: int, divisibility: int):
    stride = tuple(1 if i == leading_dim else cute.sym_int64(divisibility=divisibility) for i in range(len(shape)))
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=divisibility * dtype.width // 8)


def fwd_fake_args(headdim: int, dtype: str):
    """(q, k, v, out, lse, lse_hi, lse_lo) fake tensors: q/out (b, sq, h, d), k/v (b, sk, hk, d),
    lse/lse_hi/lse_lo (b, h, sq) fp32."""
    dt = DTYPES[dtype]
    b, sq, sk, h, hk = (cute.sym_int32() for _ in range(5))
    q = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    k = _fake(dt, (b, sk, hk, headdim), 3, DIV_16B)
    v = _fake(dt, (b, sk, hk, headdim), 3, DIV_16B)
    o = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    lse, lse_hi, lse_lo = (_fake(cutlass.Float32, (b, h, sq), 2, 1) for _ in range(3))
    return q, k, v, o, lse, lse_hi, lse_lo


def bwd_fake_args(headdim: int, dtype: str):
    """(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo) fake
    tensors for the backward.

    q/dout (b, sq, h, d); k/v/dk/dv (b, sk, hk, d); lse_log2/dpsum fp32 (b, h, sq_pad);
    dq_accum fp32 (b, h, sq_pad, d), sq_pad a multiple of the backward tile_m; dq_semaphore and
    exact int32 (b, h, num_m_blocks); lse_hi/lse_lo fp32 (b, h, sq) (the forward's lse_split).
    """
    dt = DTYPES[dtype]
    b, sq, sk, h, hk, sq_pad, nmb = (cute.sym_int32() for _ in range(7))
    q = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    k = _fake(dt, (b, sk, hk, headdim), 3, DIV_16B)
    v = _fake(dt, (b, sk, hk, headdim), 3, DIV_16B)
    do = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    lse = _fake(cutlass.Float32, (b, h, sq_pad), 2, 4)
    dpsum = _fake(cutlass.Float32, (b, h, sq_pad), 2, 4)
    dq_acc = _fake(cutlass.Float32, (b, h, sq_pad, headdim), 3, 4)
    dk = _fake(dt, (b, sk, hk, headdim), 3, DIV_16B)
    dv = _fake(dt, (b, sk, hk, headdim), 3, DIV_16B)
    dq_sem = _fake(cutlass.Int32, (b, h, nmb), 2, 1)
    exact = _fake(cutlass.Int32, (b, h, nmb), 2, 1)
    lse_hi = _fake(cutlass.Float32, (b, h, sq), 2, 1)
    lse_lo = _fake(cutlass.Float32, (b, h, sq), 2, 1)
    return q, k, v, do, lse, dpsum, dq_acc, dk, dv, dq_sem, exact, lse_hi, lse_lo


def bwd_preprocess_fake_args(headdim: int, dtype: str):
    """(out, dout, lse_hi, lse_lo, dpsum, lse_log2, exact): out/dout (b, sq, h, d);
    lse_hi/lse_lo fp32 (b, h, sq); dpsum/lse_log2 fp32 (b, h, sq_pad); exact int32 (b, h, num_m_blocks)."""
    dt = DTYPES[dtype]
    b, sq, h, sq_pad, nmb = (cute.sym_int32() for _ in range(5))
    o = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    do = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    lse_hi = _fake(cutlass.Float32, (b, h, sq), 2, 1)
    lse_lo = _fake(cutlass.Float32, (b, h, sq), 2, 1)
    dpsum = _fake(cutlass.Float32, (b, h, sq_pad), 2, 4)
    lse2 = _fake(cutlass.Float32, (b, h, sq_pad), 2, 4)
    exact = _fake(cutlass.Int32, (b, h, nmb), 2, 1)
    return o, do, lse_hi, lse_lo, dpsum, lse2, exact
