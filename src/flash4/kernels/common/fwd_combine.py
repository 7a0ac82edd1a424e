"""Split-KV combine (CuTe DSL): merge the partial results of the key splits of a decode forward.

The forward with FwdConfig.split_kv writes, for every query row and split s, O_s (normalized by
the split's own row sum, fp32) and LSE_s (natural log; -inf for a split that saw no key). The
exact result is the softmax-weighted merge (FlashDecoding, Dao et al. 2023; FlashAttention-2's
split-KV path):
    LSE = log(sum_s exp(LSE_s)),   O = sum_s exp(LSE_s - LSE) * O_s,
with LSE = -inf and O = 0 for a row whose splits all saw no key. A learnable sink (gpt-oss) is one
more term of the first sum, counted once here (the splits leave it out): LSE = log(sum_s exp(LSE_s)
+ exp(sink_h)); a row without keys then has LSE = sink_h.

Rows may be packed GQA rows (the decode path packs the `pack` query heads of one KV head into
the query dimension): packed row r of KV head hk is query r // pack of head hk * pack + r % pack.
One warp per packed row: lanes reduce LSE_s over the splits, then each lane merges headdim / 32
contiguous columns (so the warp reads each split's row once, coalesced); a head dim that is an odd
multiple of 16 (d80, d112) gives each lane ceil(headdim / 32) columns and the last lanes none.

Packed rows (`call_packed_rows`, compiled as its own variant: flash4.compile.cache's
get_combine_runner(packed_rows=True); __call__'s kernel is unchanged by it): out / lse are a varlen
request's (total_q, H, Dv) / (H, total_q), and the decode step's query slot s in [0, Sq) of sequence
b (Sq = seqlen_packed // pack) is varlen row cu_seqlens_q[b+1] - Sq + s (flash4.forward.
_packed_decode's right-aligned gather; flash4.forward.decode_slot_rows is the same map in Python).
The slot is written only when that row is >= cu_seqlens_q[b], i.e. s >= Sq - len_b: the rows
sequence b owns, each once; nothing else is written (rows past cu_seqlens_q[-1] keep what they held)
and unowned slots are not merged.
"""

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash4.constants import COMBINE_WARPS_PER_CTA, LOG2E, MAX_SPLITS  # noqa: F401  (importers of this module read it here)

MAX_SPLIT_CHUNKS = -(-MAX_SPLITS // 32)  # LSE values per lane in the prefetching combine


class SplitKVCombine:
    """pdl: launched with programmatic dependent launch (FwdConfig.pdl_combine: the split kernel
    triggers its dependents at its start); every thread waits in griddepcontrol.wait for the split
    kernel's completion before its first read (a no-op when launched without the attribute).
    prefetch (FwdConfig.combine_prefetch): each lane keeps the LSE of its splits (lane, lane + 32, ..)
    in registers from the max pass and computes their weights once; the merge loop takes split s's
    weight from lane s % 32 by a shuffle instead of loading LSE_s again, and loads the O columns of
    PREFETCH_UNROLL splits into registers before merging them, so those loads are in flight together
    (the plain loop waits for one split's loads before the next: latency-bound at many splits).
    Same operations in the same order: the same bits."""

    PREFETCH_UNROLL = 4

    def __init__(self, headdim: int, dtype, pdl: bool = False, prefetch: bool = False):
        assert headdim % 16 == 0, headdim
        self.hdim = headdim
        self.dtype = dtype
        self.pdl = pdl
        self.prefetch = prefetch

    @cute.jit
    def __call__(
        self,
        mOacc: cute.Tensor,  # (num_splits, batch, seqlen_packed, nheads_k, headdim) fp32
        mLSEacc: cute.Tensor,  # (num_splits, batch, nheads_k, seqlen_packed) fp32
        mO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim) 16-bit
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) fp32
        mSink: Optional[cute.Tensor],  # (nheads,) fp32 sink logits, or None
        pack: Int32,  # query heads per packed KV head (1: no packing)
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(mOacc, mLSEacc, mO, mLSE, mSink, pack, None).launch(
            grid=(num_ctas, 1, 1), block=[32 * COMBINE_WARPS_PER_CTA, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.jit
    def call_packed_rows(
        self,
        mOacc: cute.Tensor,  # (num_splits, batch, seqlen_packed, nheads_k, headdim) fp32
        mLSEacc: cute.Tensor,  # (num_splits, batch, nheads_k, seqlen_packed) fp32
        mO: cute.Tensor,  # (total_q, nheads, headdim) 16-bit: a varlen request's out
        mLSE: cute.Tensor,  # (nheads, total_q) fp32: its lse
        mSink: Optional[cute.Tensor],  # (nheads,) fp32 sink logits, or None
        pack: Int32,  # query heads per packed KV head (1: no packing)
        num_ctas: Int32,
        stream: cuda.CUstream,
        mCuSeqlensQ: cute.Tensor,  # (batch + 1,) int32 cu_seqlens_q of the varlen rows
    ):
        """__call__ writing out / lse as packed varlen rows (the module docstring's row map)."""
        self.kernel(mOacc, mLSEacc, mO, mLSE, mSink, pack, mCuSeqlensQ).launch(
            grid=(num_ctas, 1, 1), block=[32 * COMBINE_WARPS_PER_CTA, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSink: Optional[cute.Tensor], pack: Int32, mCuSeqlensQ: Optional[cute.Tensor]):
        if cutlass.const_expr(self.pdl):  # the split kernel's partials: complete and visible after this
            cute.arch.griddepcontrol_wait()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        num_splits, batch, seqlen_p, nheads_k = mOacc.shape[0], mOacc.shape[1], mOacc.shape[2], mOacc.shape[3]
        row = cute.arch.block_idx()[0] * COMBINE_WARPS_PER_CTA + warp
        if row < batch * seqlen_p * nheads_k:
            hk = row % nheads_k
            bs = row // nheads_k
            sp = bs % seqlen_p
            b = bs // seqlen_p
            owned = True  # a Python bool: __call__'s kernel compiles without the test
            if cutlass.const_expr(mCuSeqlensQ is not None):
                # query slot sp // pack of sequence b is varlen row cu[b+1] - Sq + slot: owned when >= cu[b]
                owned = mCuSeqlensQ[b + 1] - seqlen_p // pack + sp // pack >= mCuSeqlensQ[b]
            if owned:
                if cutlass.const_expr(self.prefetch):
                    # the LSE of this lane's splits (lane, lane + 32, ...) kept in registers for the weights
                    lse_mine = cute.make_rmem_tensor((MAX_SPLIT_CHUNKS,), Float32)
                    lse_mine.fill(-Float32.inf)
                    for j in cutlass.range_constexpr(MAX_SPLIT_CHUNKS):
                        if lane + j * 32 < num_splits:
                            lse_mine[j] = mLSEacc[lane + j * 32, b, hk, sp]
                    m = -Float32.inf
                    for j in cutlass.range_constexpr(MAX_SPLIT_CHUNKS):
                        if lane + j * 32 < num_splits:
                            m = cute.arch.fmax(m, lse_mine[j])
                    m = cute.arch.warp_reduction_max(m)
                    query = sp // pack
                    head = hk * pack + (sp - query * pack)
                    sink = -Float32.inf
                    if cutlass.const_expr(mSink is not None):
                        sink = Float32(mSink[head])
                        m = cute.arch.fmax(m, sink)
                    total = Float32(0.0)
                    if m != -Float32.inf:
                        for j in cutlass.range_constexpr(MAX_SPLIT_CHUNKS):
                            if lane + j * 32 < num_splits:
                                total += cute.math.exp2((lse_mine[j] - m) * Float32(LOG2E), fastmath=True)
                    total = cute.arch.warp_reduction_sum(total)
                    if cutlass.const_expr(mSink is not None):
                        total += cute.math.exp2((sink - m) * Float32(LOG2E), fastmath=True)
                    lse = -Float32.inf
                    if m != -Float32.inf:
                        lse = m + cute.math.log(total, fastmath=True)
                    per_lane = -(-self.hdim // 32)
                    ragged = self.hdim % 32 != 0
                    acc = cute.make_rmem_tensor((per_lane,), Float32)
                    acc.fill(0.0)
                    if m != -Float32.inf:
                        for j in cutlass.range_constexpr(MAX_SPLIT_CHUNKS):
                            w_mine = cute.math.exp2((lse_mine[j] - lse) * Float32(LOG2E), fastmath=True)
                            # splits j * 32 + t, t < count: weight from lane t; groups of PREFETCH_UNROLL
                            # splits load their O columns into registers first (all in flight), then merge
                            count = cutlass.max(cutlass.min(num_splits - j * 32, 32), 0)
                            groups = count // self.PREFETCH_UNROLL
                            staged = cute.make_rmem_tensor((self.PREFETCH_UNROLL, per_lane), Float32)
                            for g in cutlass.range(groups, unroll=1):
                                t0 = j * 32 + g * self.PREFETCH_UNROLL
                                for u in cutlass.range_constexpr(self.PREFETCH_UNROLL):
                                    for i in cutlass.range_constexpr(per_lane):
                                        if cutlass.const_expr(not ragged):
                                            staged[u, i] = mOacc[t0 + u, b, sp, hk, lane * per_lane + i]
                                        else:
                                            staged[u, i] = Float32(0.0)
                                            if lane * per_lane + i < self.hdim:
                                                staged[u, i] = mOacc[t0 + u, b, sp, hk, lane * per_lane + i]
                                for u in cutlass.range_constexpr(self.PREFETCH_UNROLL):
                                    w = cute.arch.shuffle_sync(w_mine, g * self.PREFETCH_UNROLL + u)
                                    for i in cutlass.range_constexpr(per_lane):
                                        if cutlass.const_expr(not ragged):
                                            acc[i] += w * staged[u, i]
                                        else:
                                            if lane * per_lane + i < self.hdim:
                                                acc[i] += w * staged[u, i]
                            for t in cutlass.range(groups * self.PREFETCH_UNROLL, count, unroll=1):
                                w = cute.arch.shuffle_sync(w_mine, t)
                                for i in cutlass.range_constexpr(per_lane):
                                    if cutlass.const_expr(not ragged):
                                        acc[i] += w * mOacc[j * 32 + t, b, sp, hk, lane * per_lane + i]
                                    else:
                                        if lane * per_lane + i < self.hdim:
                                            acc[i] += w * mOacc[j * 32 + t, b, sp, hk, lane * per_lane + i]
                else:
                    # LSE over the splits: lanes take splits lane, lane + 32, ...
                    m = -Float32.inf
                    for s in cutlass.range((num_splits - lane + 31) // 32, unroll=1):
                        m = cute.arch.fmax(m, mLSEacc[lane + s * 32, b, hk, sp])
                    m = cute.arch.warp_reduction_max(m)
                    query = sp // pack
                    head = hk * pack + (sp - query * pack)
                    sink = -Float32.inf
                    if cutlass.const_expr(mSink is not None):
                        sink = Float32(mSink[head])
                        m = cute.arch.fmax(m, sink)
                    total = Float32(0.0)
                    if m != -Float32.inf:
                        for s in cutlass.range((num_splits - lane + 31) // 32, unroll=1):
                            total += cute.math.exp2((mLSEacc[lane + s * 32, b, hk, sp] - m) * Float32(LOG2E), fastmath=True)
                    total = cute.arch.warp_reduction_sum(total)
                    if cutlass.const_expr(mSink is not None):
                        total += cute.math.exp2((sink - m) * Float32(LOG2E), fastmath=True)
                    lse = -Float32.inf
                    if m != -Float32.inf:
                        lse = m + cute.math.log(total, fastmath=True)
                    # lane l merges columns [l * per_lane, (l + 1) * per_lane); a head dim that is not a
                    # multiple of 32 (d80: 3 per lane) leaves the columns past it to no lane (ragged)
                    per_lane = -(-self.hdim // 32)
                    ragged = self.hdim % 32 != 0
                    acc = cute.make_rmem_tensor((per_lane,), Float32)
                    acc.fill(0.0)
                    if m != -Float32.inf:
                        for s in cutlass.range(num_splits, unroll=1):
                            w = cute.math.exp2((mLSEacc[s, b, hk, sp] - lse) * Float32(LOG2E), fastmath=True)
                            for i in cutlass.range_constexpr(per_lane):
                                if cutlass.const_expr(not ragged):
                                    acc[i] += w * mOacc[s, b, sp, hk, lane * per_lane + i]
                                else:
                                    if lane * per_lane + i < self.hdim:
                                        acc[i] += w * mOacc[s, b, sp, hk, lane * per_lane + i]
                if cutlass.const_expr(mCuSeqlensQ is None):
                    for i in cutlass.range_constexpr(per_lane):
                        if cutlass.const_expr(not ragged):
                            mO[b, query, head, lane * per_lane + i] = acc[i].to(self.dtype)
                        else:
                            if lane * per_lane + i < self.hdim:
                                mO[b, query, head, lane * per_lane + i] = acc[i].to(self.dtype)
                    if lane == 0:
                        mLSE[b, head, query] = lse
                else:
                    row_q = mCuSeqlensQ[b + 1] - seqlen_p // pack + query
                    for i in cutlass.range_constexpr(per_lane):
                        if cutlass.const_expr(not ragged):
                            mO[row_q, head, lane * per_lane + i] = acc[i].to(self.dtype)
                        else:
                            if lane * per_lane + i < self.hdim:
                                mO[row_q, head, lane * per_lane + i] = acc[i].to(self.dtype)
                    if lane == 0:
                        mLSE[head, row_q] = lse
