"""Backward preprocess (CuTe DSL): D = rowsum(dO * O) in fp32, and LSE in the log2 domain.

One warp per (batch, seqlen_q, head) row: each lane multiplies headdim/32 element pairs in fp32
(products of 16-bit values are exact in fp32), the warp sums them with shuffles, lane 0 writes
    dpsum[b, h, s]    = sum_d dO[b, s, h, d] * O[b, s, h, d]
    lse_log2[b, h, s] = LSE[b, h, s] * log2(e), or +inf where LSE = -inf (a row that saw no key:
                        the backward's P = 2^(S*c - lse_log2) is then 0, not inf).
Padding rows (s >= seqlen_q) are initialized by the caller (dpsum 0, lse_log2 +inf).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from flash4.config import LOG2E

WARPS_PER_CTA = 4


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
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) fp32
        mdPsum: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32
        mLSE2: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32
        stream: cuda.CUstream,
    ):
        num_rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        grid = (cute.ceil_div(num_rows, WARPS_PER_CTA), 1, 1)
        self.kernel(mO, mdO, mLSE, mdPsum, mLSE2).launch(grid=grid, block=[32 * WARPS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdPsum: cute.Tensor, mLSE2: cute.Tensor):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        row = cute.arch.block_idx()[0] * WARPS_PER_CTA + warp
        seqlen_q, nheads = mO.shape[1], mO.shape[2]
        if row < mO.shape[0] * seqlen_q * nheads:
            head = row % nheads
            bs = row // nheads
            s = bs % seqlen_q
            b = bs // seqlen_q
            per_lane = self.hdim // 32
            acc = Float32(0.0)
            for i in cutlass.range_constexpr(per_lane):
                d = lane * per_lane + i
                acc += Float32(mO[b, s, head, d]) * Float32(mdO[b, s, head, d])
            acc = cute.arch.warp_reduction_sum(acc)
            if lane == 0:
                mdPsum[b, head, s] = acc
                lse = mLSE[b, head, s]
                mLSE2[b, head, s] = Float32(cutlass.select_(lse == -Float32.inf, Float32.inf, lse * Float32(LOG2E)))
