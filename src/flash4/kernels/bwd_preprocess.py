"""Backward preprocess (CuTe DSL): D = rowsum(dO * O) in fp32, the LSE in the log2 domain, and the
query tiles that need the backward's exact P path.

One warp per (batch, seqlen_q, head) row: each lane multiplies headdim/32 element pairs in fp32
(products of 16-bit values are exact in fp32), the warp sums them with shuffles, lane 0 writes
    dpsum[b, h, s]    = sum_d dO[b, s, h, d] * O[b, s, h, d]
    lse_log2[b, h, s] = fp32(lse_hi + lse_lo) (the forward's unrounded LSE * log2(e), rounded;
                        +inf for a row that saw no key, so the backward's P = 2^(S*c - lse_log2)
                        is 0 there)
    exact[b, h, s // tile_m] = 1 if |lse_log2| >= BWD_EXACT_LSE_LOG2 (finite): that query tile
                        computes P from lse_hi, lse_lo unrounded (kernels/bwd_sm90.py, issue 8)
Padding rows (s >= seqlen_q) are initialized by the caller (dpsum 0, lse_log2 +inf); `exact` is
zeroed by the caller. The grid comes from flash4.launch.bwd_preprocess_grid.

Varlen (packed) mode, when a row index is given (flash4.varlen): out/dout (1, total_q, H, D),
lse_hi/lo (1, H, total_q), and the outputs in the padded per-sequence layout: dpsum/lse_log2
(1, H, padded_rows), exact (1, H, padded_rows / tile_m). Packed row s goes to padded row
row_index[s] (flash4.varlen.padded_row_index; rows outside every sequence map to a scratch tile
that the backward never reads), so each sequence starts on a query-tile boundary.
"""

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from flash4.config import BWD_EXACT_LSE_LOG2
from flash4.launch import PREPROCESS_WARPS_PER_CTA


class BackwardPreprocess:
    def __init__(self, headdim: int, dtype):
        assert headdim % 32 == 0
        self.hdim = headdim
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim)
        mdO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim)
        mLSEhi: cute.Tensor,  # (batch, nheads, seqlen_q) fp32
        mLSElo: cute.Tensor,  # (batch, nheads, seqlen_q) fp32
        mdPsum: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32
        mLSE2: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32
        mExact: cute.Tensor,  # (batch, nheads, num_m_blocks) int32, zeroed
        tile_m: Int32,  # the backward's query tile
        num_ctas: Int32,
        stream: cuda.CUstream,
        mRowIdx: Optional[cute.Tensor] = None,  # varlen: (total_q,) int32 padded row of each packed row
    ):
        self.kernel(mO, mdO, mLSEhi, mLSElo, mdPsum, mLSE2, mExact, tile_m, mRowIdx).launch(
            grid=(num_ctas, 1, 1), block=[32 * PREPROCESS_WARPS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSEhi: cute.Tensor, mLSElo: cute.Tensor,
               mdPsum: cute.Tensor, mLSE2: cute.Tensor, mExact: cute.Tensor, tile_m: Int32,
               mRowIdx: Optional[cute.Tensor]):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        row = cute.arch.block_idx()[0] * PREPROCESS_WARPS_PER_CTA + warp
        seqlen_q, nheads = mO.shape[1], mO.shape[2]  # varlen: seqlen_q = total_q, batch = 1
        if row < mO.shape[0] * seqlen_q * nheads:
            head = row % nheads
            bs = row // nheads
            s = bs % seqlen_q
            b = bs // seqlen_q
            if const_expr(mRowIdx is not None):
                s, b = bs, 0
            per_lane = self.hdim // 32
            acc = Float32(0.0)
            for i in cutlass.range_constexpr(per_lane):
                d = lane * per_lane + i
                acc += Float32(mO[b, s, head, d]) * Float32(mdO[b, s, head, d])
            acc = cute.arch.warp_reduction_sum(acc)
            if lane == 0:
                p = s if const_expr(mRowIdx is None) else mRowIdx[s]  # row in the (padded) statistics
                mdPsum[b, head, p] = acc
                lse_log2 = mLSEhi[b, head, s] + mLSElo[b, head, s]
                mLSE2[b, head, p] = lse_log2
                magnitude = cute.arch.fmax(lse_log2, -lse_log2)
                if (magnitude >= Float32(BWD_EXACT_LSE_LOG2)) & (magnitude != Float32.inf):
                    mExact[b, head, p // tile_m] = Int32(1)
