"""Fake (shape-only) tensors for compiling without a GPU or real data.

Every extent is a runtime symbol, strides are runtime symbols except the contiguous head dim; one
compiled kernel then serves every batch, seqlen, head count and (last-dim-contiguous) stride.
"""

import types

import cutlass
import cutlass.cute as cute

from flash4.kernels.common.dsl import DSL_DTYPES as DTYPES  # noqa: E402
# 16-byte alignment (TMA) for 16-bit elements: strides divisible by 8 elements.
DIV_16B = 8


def _fake(dtype, shape, leading_dim: int, divisibility: int):
    stride = tuple(1 if i == leading_dim else cute.sym_int64(divisibility=divisibility) for i in range(len(shape)))
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=divisibility * dtype.width // 8)


def fwd_fake_args(headdim: int, dtype: str, paged: bool = False, headdim_v: int | None = None,
                  tensor_hdims: tuple | None = None):
    """(q, k, v, out, lse, lse_hi, lse_lo) fake tensors: q (b, sq, h, d), k (b, sk, hk, d), v
    (b, sk, hk, dv), out (b, sq, h, dv) (dv = headdim_v, or headdim when None), lse/lse_hi/lse_lo
    (b, h, sq) fp32. paged: k/v (num_pages, page_size, hk, d / dv), their own extents.
    tensor_hdims: (d, dv) of the tensors when narrower than the kernel's (FwdConfig.tensor_hdims)."""
    dt = DTYPES[dtype]
    dv = headdim if headdim_v is None else headdim_v
    if tensor_hdims is not None:
        headdim, dv = tensor_hdims
    b, sq, sk, h, hk = (cute.sym_int32() for _ in range(5))
    bk = cute.sym_int32() if paged else b
    q = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    k = _fake(dt, (bk, sk, hk, headdim), 3, DIV_16B)
    v = _fake(dt, (bk, sk, hk, dv), 3, DIV_16B)
    o = _fake(dt, (b, sq, h, dv), 3, DIV_16B)
    lse, lse_hi, lse_lo = (_fake(cutlass.Float32, (b, h, sq), 2, 1) for _ in range(3))
    return q, k, v, o, lse, lse_hi, lse_lo


def seq_fake_args(cfg):
    """(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table) for a config's sequence
    layout (FwdConfig/BwdConfig varlen_q, varlen_k, seqused_q, seqused_k, paged): int32 fake
    tensors where the flag is on, None where it is off (the kernel specializes on None)."""
    nb1, nb, npages = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

    def vec(n):
        return _fake(cutlass.Int32, (n,), 0, 1)

    page_table = None
    if getattr(cfg, "paged", False):
        page_table = cute.runtime.make_fake_tensor(
            cutlass.Int32, (nb, npages), stride=(cute.sym_int64(), 1), assumed_align=4)
    return (vec(nb1) if cfg.varlen_q else None, vec(nb1) if cfg.varlen_k else None,
            vec(nb) if cfg.seqused_q else None, vec(nb) if cfg.seqused_k else None, page_table)


def bwd_fake_args(headdim: int, dtype: str, varlen_q: bool = False, varlen_k: bool = False,
                  seqused_q: bool = False, seqused_k: bool = False, headdim_v: int | None = None,
                  dkv_accum: bool = False, deterministic: bool = False, sink_delta: bool = False):
    """(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo,
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) fake tensors for the backward.

    Dense: q/dout (b, sq, h, d); k/v/dk/dv (b, sk, hk, d); lse_log2/dpsum fp32 (b, h, sq_pad);
    dq_accum fp32 (b, h, sq_pad, d), sq_pad a multiple of the backward tile_m; dq_semaphore and
    exact int32 (b, h, num_m_blocks); lse_hi/lse_lo fp32 (b, h, sq) (the forward's lse_split).
    varlen_q: the Q-side tensors have a batch mode of size 1 and the packed / padded row counts
    (q/dout (1, total_q, h, d), stats (1, h, padded_rows), lse_hi/lo (1, h, total_q)); varlen_k: the
    K-side ones (1, total_k, hk, d). cu_seqlens_* (batch + 1,) and seqused_* (batch,) int32 are
    given only when their flag is on (else None: the kernel is compiled without them).
    headdim_v: v / dout / dv have this head dim (None: headdim).
    dkv_accum: dk / dv are fp32 accumulators (same shapes); with deterministic the dK/dV semaphores,
    int32 (n_blocks * hk * b,), follow (else None). sink_delta: then the fp32 D buffer, shaped like
    dpsum (else None).
    """
    dt = DTYPES[dtype]
    dv_ = headdim if headdim_v is None else headdim_v
    b, sq, sk, h, hk, sq_pad, nmb = (cute.sym_int32() for _ in range(7))
    bq = 1 if varlen_q else b
    bk = 1 if varlen_k else b
    q = _fake(dt, (bq, sq, h, headdim), 3, DIV_16B)
    k = _fake(dt, (bk, sk, hk, headdim), 3, DIV_16B)
    v = _fake(dt, (bk, sk, hk, dv_), 3, DIV_16B)
    do = _fake(dt, (bq, sq, h, dv_), 3, DIV_16B)
    lse = _fake(cutlass.Float32, (bq, h, sq_pad), 2, 4)
    dpsum = _fake(cutlass.Float32, (bq, h, sq_pad), 2, 4)
    dq_acc = _fake(cutlass.Float32, (bq, h, sq_pad, headdim), 3, 4)
    dkv_dt = cutlass.Float32 if dkv_accum else dt
    dk = _fake(dkv_dt, (bk, sk, hk, headdim), 3, DIV_16B)
    dv = _fake(dkv_dt, (bk, sk, hk, dv_), 3, DIV_16B)
    dq_sem = _fake(cutlass.Int32, (bq, h, nmb), 2, 1)
    exact = _fake(cutlass.Int32, (bq, h, nmb), 2, 1)
    lse_hi = _fake(cutlass.Float32, (bq, h, sq), 2, 1)
    lse_lo = _fake(cutlass.Float32, (bq, h, sq), 2, 1)
    flags = types.SimpleNamespace(varlen_q=varlen_q, varlen_k=varlen_k, seqused_q=seqused_q, seqused_k=seqused_k)
    seq = seq_fake_args(flags)[:4]  # no page table: the backward reads packed K/V only
    dkv_sem = _fake(cutlass.Int32, (cute.sym_int32(),), 0, 1) if dkv_accum and deterministic else None
    delta = _fake(cutlass.Float32, (bq, h, sq_pad), 2, 4) if sink_delta else None
    return (q, k, v, do, lse, dpsum, dq_acc, dk, dv, dq_sem, exact, lse_hi, lse_lo) + seq + (dkv_sem, delta)


def bwd_preprocess_fake_args(headdim: int, dtype: str, varlen: bool = False, headdim_q: int | None = None):
    """(out, dout, lse_hi, lse_lo, dpsum, lse_log2, exact, dq_accum) (+ row_index when varlen).

    Dense: out/dout (b, sq, h, d) (d = headdim, O's head dim); lse_hi/lse_lo fp32 (b, h, sq);
    dpsum/lse_log2 fp32 (b, h, sq_pad); exact int32 (b, h, num_m_blocks); dq_accum fp32
    (b, h, sq_pad, dq) (dq = headdim_q, or headdim when None), rows contiguous. varlen: b = 1,
    sq = total_q, sq_pad = the padded rows, and row_index int32 (total_q,)
    (flash4.backward.padded_row_index)."""
    dt = DTYPES[dtype]
    dq = headdim if headdim_q is None else headdim_q
    b, sq, h, sq_pad, nmb = (cute.sym_int32() for _ in range(5))
    if varlen:
        b = 1
    o = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    do = _fake(dt, (b, sq, h, headdim), 3, DIV_16B)
    lse_hi = _fake(cutlass.Float32, (b, h, sq), 2, 1)
    lse_lo = _fake(cutlass.Float32, (b, h, sq), 2, 1)
    dpsum = _fake(cutlass.Float32, (b, h, sq_pad), 2, 4)
    lse2 = _fake(cutlass.Float32, (b, h, sq_pad), 2, 4)
    exact = _fake(cutlass.Int32, (b, h, nmb), 2, 1)
    dq_accum = _fake(cutlass.Float32, (b, h, sq_pad, dq), 3, 4)
    if varlen:
        return o, do, lse_hi, lse_lo, dpsum, lse2, exact, dq_accum, _fake(cutlass.Int32, (sq,), 0, 1)
    return o, do, lse_hi, lse_lo, dpsum, lse2, exact, dq_accum


def bwd_postprocess_fake_args(headdim: int, dtype: str, varlen: bool = False):
    """(dq_accum, dq) (+ row_index when varlen): dq_accum fp32 (b, h, sq_pad, headdim), rows
    contiguous; dq (b, sq, h, headdim) 16-bit; varlen: b = 1, sq = total_q, row_index int32 (total_q,)."""
    b, sq, h, sq_pad = (cute.sym_int32() for _ in range(4))
    if varlen:
        b = 1
    dq_accum = _fake(cutlass.Float32, (b, h, sq_pad, headdim), 3, 4)
    dq = _fake(DTYPES[dtype], (b, sq, h, headdim), 3, DIV_16B)
    if varlen:
        return dq_accum, dq, _fake(cutlass.Int32, (sq,), 0, 1)
    return dq_accum, dq


def sink_fake_arg(cfg):
    """The (nheads,) fp32 sink logits of a sink forward config, else None."""
    if not getattr(cfg, "sink", False):
        return None
    return _fake(cutlass.Float32, (cute.sym_int32(),), 0, 1)


def split_fake_args(cfg):
    """(o_accum, lse_accum) for a split_kv forward config: fp32 (splits, b, sq, h, dv) and
    (splits, b, h, sq); (None, None) otherwise."""
    if not getattr(cfg, "split_kv", False):
        return None, None
    ns, b, sq, h = (cute.sym_int32() for _ in range(4))
    o_acc = _fake(cutlass.Float32, (ns, b, sq, h, cfg.hdim_v), 4, 4)
    lse_acc = _fake(cutlass.Float32, (ns, b, h, sq), 3, 1)
    return o_acc, lse_acc
