"""Online softmax in the log2 domain with lazy (conditional) rescaling.

Scores S arrive raw (unscaled) in wgmma accumulator fragments. With c = softmax_scale * log2(e),
P = 2^(c*S - c*m) where m is the row max seen so far; O and the row sum are rescaled by
2^(c*m_old - c*m_new) when m grows. FlashAttention-4 (Zadouri et al. 2025, "conditional softmax
rescaling") only moves the reference max when it grew by more than tau (log2 units): otherwise
the stale max is kept, P stays bounded by 2^tau, and the final O / row_sum is still exact because
O and the row sum always share one reference max. tau = 0 is the classic always-rescale.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash4.constants import FWD_EXACT_REF_LOG2
from flash4.kernels.common.exp2 import fma_rn, exp2_emulated, exp2_hw
from flash4.kernels.common.exp2_poly import mixed_pattern
from flash4.kernels.common.dsl import DynamicState
from flash4.kernels.common.layout import acc_mn_view

LN2 = math.log(2.0)


def uses_emulated_exp2(col: int, frac: float) -> bool:
    """Static choice (per register column) of the exp2 unit: True = FMA polynomial. Of every
    `period` columns the first k are emulated, where k / period == frac (exp2_poly.mixed_pattern)."""
    k, period = mixed_pattern(frac)
    return (col % period) < k


@cute.jit
def quad_allreduce_max(x: Float32) -> Float32:
    """Max over the 4 lanes of a quad (the 4 threads that share one accumulator row)."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_allreduce_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


@cute.jit
def _ref_step_scale(step: Float32) -> Float32:
    """2^step, the factor that moves O and the row sum from the old reference to the new one
    (step = old ref - new ref, log2 units); exactly 1 where the reference did not move. A row that
    was empty (O, row sum 0, reference 0) may give a large step: min(step, 64) keeps the factor
    finite (and maps a NaN step, both references empty, to a finite one) so 0 * factor = 0."""
    return Float32(cutlass.select_(step == Float32(0.0), Float32(1.0), exp2_hw(cute.arch.fmin(step, Float32(64.0)))))


class OnlineSoftmax(DynamicState):
    """Per-thread softmax state for the rows it owns: the reference max m (raw score units), the
    reference in log2 units actually subtracted, ref = ref_hi + ref_lo, and a partial row_sum
    (this thread's columns only; reduced across the quad in `finalize`).

    The reference is exact (issue 8: huge-magnitude inputs). ref_hi = fp32(m * c) and every
    exponent is first fma(s, c, -ref_hi): one FFMA, exact-then-rounded, so at s = m it equals the
    rounding error of m * c exactly. While every row of the warp has |ref_hi| < FWD_EXACT_REF_LOG2
    that error is at most 2^-4 and is simply part of the reference (ref_lo = 0): O, the row sum and
    the LSE all use ref_hi, so the result is exact. Once some row reaches it (a warp-uniform branch
    over rare work; sticky for the rest of the tile), ref_lo = m*c - ref_hi (one FFMA, exact) is
    subtracted from every exponent as well, so the row max gives 2^0 at any finite magnitude; the
    rescale factors and the LSE use ref_hi + ref_lo.

    scale_log2:   softmax_scale * log2(e) (runtime Float32).
    num_rows:     rows per thread (static).
    rescale_threshold: tau in log2 units (static); 0 = always rescale.
    exp2_emu_frac: static share of exp2 evaluated by the FMA polynomial (0 = all MUFU.EX2).
    row_coords:   None, or (ragged queries: packed varlen / seqused_q) the thread's accumulator
                  coordinates in (row, col) view (acc_mn_view of the partitioned identity tensor):
                  rows >= reset()'s row_limit (queries past the sequence: the next packed
                  sequence's, or stale rows past seqused_q) are then left out of the exact-path
                  vote, so whatever such a row holds (a score above 2^20 / scale_log2) cannot move
                  the valid rows of its warp to the other path and change their bits (issue 25).
                  None compiles none of it (dense and GQA-packed queries: rows past seqlen_q are
                  TMA zeros).
    vote_first:   (static; FwdConfig.softmax_vote_first, a speed switch) the exact-path vote is taken
                  on the per-row references, before any exponent is formed, and the element loop is
                  traced twice: the common branch computes p = 2^fma(s, c, -ref_hi) element by element
                  (so ptxas can interleave each FFMA with its MUFU.EX2 and the row sum), the rare one
                  subtracts ref_lo first. Off: every FFMA, then the vote's branch, then the
                  exponentials (the branch splits the basic block, so the 64 MUFU.EX2 of a row pair run
                  back to back: H200 ncu of 2026-12-03, docs/perf/ncu_2026-12-03.md). The same
                  operations in the same order per element either way: bit-identical results.
    rescale_always: (static; FwdConfig.rescale_always, a speed switch) rescale_O multiplies O by the
                  row factors on every call, without the warp vote and branch around it: the factor is
                  exactly 1.0 where the reference did not move (the lazy rescale keeps that), and
                  x * 1.0 = x bit for bit, so the results are those of the branch. Without the branch
                  the O multiplies and P's conversion to 16 bits share the exponentials' basic block,
                  where ptxas can issue them under the MUFU.EX2 stream (H200 ncu of the d128 GQA causal
                  forward, 2026-12-04: flash4's 32 F2FP per step ran after the branch, each waiting;
                  flash-attn-4 rescales O always and interleaves both under its MUFU.EX2).
    split_max:    (static; FwdConfig.split_row_max, a speed switch) each row's max over the thread's
                  columns runs as two independent FMNMX chains (even and odd columns) joined by one
                  more, instead of one chain through every column: half the dependent latency before
                  the quad shuffles (flash-attn-4's sm90 forward keeps two chains per row). A max is
                  exact whatever the order: the same value.
    branch_free:  (static; FwdConfig.softmax_branch_free, a speed switch) no branch around the exact
                  path: its warp vote feeds selects (ref_lo = 0 unless the warp is on the exact
                  path) and every exponent is fma(s, c, -ref_hi) - ref_lo, one FADD per element
                  more, so a key block's softmax, P conversion and O rescale form one basic block
                  (flash-attn-4's sm90 loop has no exact path and no branch; ptxas then issues the
                  FFMA, F2FP and O multiplies under the MUFU.EX2 stream). x - 0 = x and the
                  factors' steps gain + 0: the bits of the branches. Not with vote_first.
    """

    _dynamic_fields = ("scale_log2", "row_max", "ref_hi", "ref_lo", "row_sum", "exact")

    def __init__(self, scale_log2: Float32, num_rows: int, rescale_threshold: float, exp2_emu_frac: float,
                 row_coords=None, vote_first: bool = False, rescale_always: bool = False, split_max: bool = False,
                 branch_free: bool = False):
        assert not (vote_first and branch_free), "OnlineSoftmax: vote_first or branch_free, not both"
        self.vote_first = vote_first
        self.split_max = split_max
        self.branch_free = branch_free
        self.rescale_always = rescale_always
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold
        self.exp2_emu_frac = exp2_emu_frac
        self.row_max = cute.make_rmem_tensor((num_rows,), Float32)
        self.ref_hi = cute.make_rmem_tensor((num_rows,), Float32)
        self.ref_lo = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        self.exact = cute.make_rmem_tensor((1,), Int32)  # warp-uniform: 1 once the tile took the exact path
        self.row_coords = row_coords
        if row_coords is not None:  # the tile's valid row count, carried like the other fields
            self._dynamic_fields = OnlineSoftmax._dynamic_fields + ("row_limit",)
            self.row_limit = Int32(0)

    @cute.jit
    def reset(self, row_limit=None):
        """A new tile. row_limit (with row_coords only): its rows < row_limit are inside the sequence."""
        if cutlass.const_expr(self.row_coords is not None):
            self.row_limit = Int32(row_limit)
        self.row_max.fill(-Float32.inf)
        self.ref_hi.fill(0.0)
        self.ref_lo.fill(0.0)
        self.row_sum.fill(0.0)
        self.exact.fill(0)

    @cute.jit
    def online(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turns acc_S (raw scores) into unnormalized P in place; returns the per-row factor that
        O must be multiplied by (1.0 where the reference did not move)."""
        s = acc_mn_view(acc_S)
        n_cols = cute.size(s, mode=[1])
        row_scale = cute.make_rmem_tensor((self.num_rows,), Float32)
        hi_new = cute.make_rmem_tensor((self.num_rows,), Float32)
        huge = self.exact[0] != 0
        for r in cutlass.range_constexpr(self.num_rows):
            m_tile = self._thread_row_max(s, r, n_cols)
            m_tile = quad_allreduce_max(m_tile)
            if cutlass.const_expr(is_first):
                self.row_max[r] = m_tile
            else:
                m_old = self.row_max[r]
                m_new = cute.arch.fmax(m_old, m_tile)
                # NaN (both -inf) compares false: the row stays empty.
                grow = (m_new - m_old) * self.scale_log2
                self.row_max[r] = Float32(cutlass.select_(grow > Float32(self.rescale_threshold), m_new, m_old))
            m_ref = self.row_max[r]
            # A row that saw no key yet keeps reference 0 (exp2(-inf - 0) = 0, not NaN).
            hi = Float32(cutlass.select_(m_ref == -Float32.inf, Float32(0.0), m_ref * self.scale_log2))
            hi_new[r] = hi
            big = cute.arch.fmax(hi, -hi) >= Float32(FWD_EXACT_REF_LOG2)
            if cutlass.const_expr(self.row_coords is not None):
                big = big & (self.row_coords[r, 0][0] < self.row_limit)
            huge = huge | big
            if cutlass.const_expr(not is_first and not self.branch_free):
                row_scale[r] = _ref_step_scale(self.ref_hi[r] - hi)
            if cutlass.const_expr(not self.vote_first and not self.branch_free):
                for c in cutlass.range_constexpr(n_cols):
                    s[r, c] = fma_rn(s[r, c], self.scale_log2, -hi)
        if cutlass.const_expr(self.branch_free):
            self._exact_select(row_scale, hi_new, cute.arch.vote_any_sync(huge), is_first)
            self._exponentials(s, row_scale, hi_new, is_first, subtract_lo=True)
        elif cutlass.const_expr(self.vote_first):
            if cute.arch.vote_any_sync(huge):
                self._exact_fixup(s, row_scale, hi_new, is_first, scaled=False)
                self._exponentials(s, row_scale, hi_new, is_first, subtract_lo=True)
            else:
                self._exponentials(s, row_scale, hi_new, is_first, subtract_lo=False)
        else:
            if cute.arch.vote_any_sync(huge):
                self._exact_fixup(s, row_scale, hi_new, is_first)
            self._exponentials(s, row_scale, hi_new, is_first, scaled=True)
        return row_scale

    @cute.jit
    def _thread_row_max(self, s: cute.Tensor, r: cutlass.Constexpr[int], n_cols: cutlass.Constexpr[int]) -> Float32:
        """Max of row r over this thread's n_cols columns: one FMNMX chain, or with split_max two
        (even / odd columns) joined at the end."""
        m_tile = s[r, 0]
        if cutlass.const_expr(self.split_max and n_cols >= 4):
            m_odd = s[r, 1]
            for c in cutlass.range_constexpr(2, n_cols, 2):
                m_tile = cute.arch.fmax(m_tile, s[r, c])
                if cutlass.const_expr(c + 1 < n_cols):
                    m_odd = cute.arch.fmax(m_odd, s[r, c + 1])
            m_tile = cute.arch.fmax(m_tile, m_odd)
        else:
            for c in cutlass.range_constexpr(1, n_cols):
                m_tile = cute.arch.fmax(m_tile, s[r, c])
        return m_tile

    @cute.jit
    def _exponentials(self, s: cute.Tensor, row_scale: cute.Tensor, hi_new: cute.Tensor,
                      is_first: cutlass.Constexpr[bool], scaled: cutlass.Constexpr[bool] = False,
                      subtract_lo: cutlass.Constexpr[bool] = False):
        """s -> P = 2^x in place, the row sums updated, ref_hi <- hi_new. scaled: s already holds
        the exponents x (vote_first off); else x = fma(s, c, -ref_hi) here, minus ref_lo where
        subtract_lo (the exact path, vote_first on): _exact_fixup's operations in its order."""
        for r in cutlass.range_constexpr(self.num_rows):
            hi = hi_new[r]
            self.ref_hi[r] = hi
            row_sum = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                x = s[r, c]
                if cutlass.const_expr(not scaled):
                    x = fma_rn(x, self.scale_log2, -hi)
                    if cutlass.const_expr(subtract_lo):
                        x = x - self.ref_lo[r]
                p = exp2_emulated(x) if cutlass.const_expr(uses_emulated_exp2(c, self.exp2_emu_frac)) else exp2_hw(x)
                s[r, c] = p
                row_sum = row_sum + p
            if cutlass.const_expr(is_first):
                self.row_sum[r] = row_sum
                row_scale[r] = Float32(1.0)
            else:
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + row_sum

    @cute.jit
    def _exact_fixup(self, s: cute.Tensor, row_scale: cute.Tensor, hi_new: cute.Tensor,
                     is_first: cutlass.Constexpr[bool], scaled: cutlass.Constexpr[bool] = True):
        """Rare (|m * c| >= FWD_EXACT_REF_LOG2 somewhere in the warp): subtract the rounding error of
        m * c from the exponents too, and take it into the rescale factor (ref_lo is 0 before the
        first time here). Only memory (register tensor) writes: nothing escapes the branch.
        scaled=False (vote_first): the exponents are not formed yet; only ref_lo and the rescale
        factors are set here (_exponentials(subtract_lo=True) subtracts ref_lo)."""
        self.exact[0] = Int32(1)
        for r in cutlass.range_constexpr(self.num_rows):
            m_ref = self.row_max[r]
            hi = hi_new[r]
            lo = Float32(cutlass.select_(m_ref == -Float32.inf, Float32(0.0), fma_rn(m_ref, self.scale_log2, -hi)))
            if cutlass.const_expr(not is_first):
                row_scale[r] = _ref_step_scale((self.ref_hi[r] - hi) + (self.ref_lo[r] - lo))
            self.ref_lo[r] = lo
            if cutlass.const_expr(scaled):
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    s[r, c] = s[r, c] - lo

    @cute.jit
    def _exact_select(self, row_scale: cute.Tensor, hi_new: cute.Tensor, exact, is_first: cutlass.Constexpr[bool]):
        """branch_free: _exact_fixup's reference split and rescale factors by selects on the warp's
        vote `exact` (sticky through self.exact) instead of a branch. Without it ref_lo = lo = 0, so
        the factor's step (ref_hi - hi) + (0 - 0) and each exponent x - 0 keep their values (the sign
        of a zero step aside, which maps to 1.0 either way): the common branch's bits."""
        self.exact[0] = Int32(cutlass.select_(exact, Int32(1), Int32(0)))
        for r in cutlass.range_constexpr(self.num_rows):
            m_ref = self.row_max[r]
            hi = hi_new[r]
            lo = Float32(cutlass.select_(exact & (m_ref != -Float32.inf), fma_rn(m_ref, self.scale_log2, -hi),
                                         Float32(0.0)))
            if cutlass.const_expr(not is_first):
                row_scale[r] = _ref_step_scale((self.ref_hi[r] - hi) + (self.ref_lo[r] - lo))
            self.ref_lo[r] = lo

    @cute.jit
    def rescale_O(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        """O[r, :] *= row_scale[r]; skipped for the whole warp when no row of it moved its max (unless
        rescale_always: then every call, branch-free; the same bits)."""
        o = acc_mn_view(acc_O)
        if cutlass.const_expr(self.rescale_threshold > 0.0 and not self.rescale_always):
            moved = False
            for r in cutlass.range_constexpr(self.num_rows):
                moved = moved | (row_scale[r] != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                for r in cutlass.range_constexpr(self.num_rows):
                    for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                        o[r, c] = o[r, c] * row_scale[r]
        else:
            for r in cutlass.range_constexpr(self.num_rows):
                for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                    o[r, c] = o[r, c] * row_scale[r]

    @cute.jit
    def finalize(self, sink_log2=None) -> tuple:
        """Returns (inv_row_sum, lse, lse_hi, lse_lo): the factor that normalizes O (0 for rows that
        saw no key), the natural-log LSE (-inf for rows that saw no key), and the log2-domain LSE
        unrounded as lse_hi + lse_lo (lse_hi = ref_hi, lse_lo = ref_lo + log2(row sum); +inf and 0
        for rows that saw no key) for the backward's exact path.

        sink_log2: None, or the row's attention-sink logit in log2 units (learnable sink, gpt-oss;
        a Float32 for every row, or a (num_rows,) register tensor, one per row of this thread):
        one more term 2^sink in the denominator that contributes no value. It is added against its
        own reference (the larger of the row's and the sink), so a sink far above or below the row
        max neither overflows nor vanishes early; a row without keys then has O = 0 and LSE = sink."""
        if cutlass.const_expr(sink_log2 is not None):
            return self._finalize_sink(sink_log2)
        inv = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse_hi = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse_lo = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = quad_allreduce_sum(self.row_sum[r])
            empty = (total == Float32(0.0)) | (total != total)
            inv_r = cute.arch.rcp_approx(total)
            hi = self.ref_hi[r]
            lo = self.ref_lo[r] + cute.math.log2(total, fastmath=True)
            lse_r = (hi + lo) * Float32(LN2)
            if empty:
                inv_r = Float32(0.0)
                lse_r = -Float32.inf
                hi = Float32.inf
                lo = Float32(0.0)
            inv[r] = inv_r
            lse[r] = lse_r
            lse_hi[r] = hi
            lse_lo[r] = lo
        return inv, lse, lse_hi, lse_lo

    @cute.jit
    def _finalize_sink(self, sinks_log2) -> tuple:
        inv = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse_hi = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse_lo = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            sink_log2 = sinks_log2
            if cutlass.const_expr(isinstance(sinks_log2, cute.Tensor)):
                sink_log2 = sinks_log2[r]  # GQA-packed rows: each row's own head's sink
            total = quad_allreduce_sum(self.row_sum[r])
            hi = self.ref_hi[r]
            lo = self.ref_lo[r]
            # the row's reference, or the sink when it is larger (or the row saw no key)
            sink_above = (sink_log2 > hi + lo) | (total == Float32(0.0))
            shift = Float32(cutlass.select_(sink_above, (hi - sink_log2) + lo, Float32(0.0)))
            old = Float32(cutlass.select_(total == Float32(0.0), Float32(0.0), exp2_hw(shift)))
            extra = exp2_hw(Float32(cutlass.select_(sink_above, Float32(0.0), (sink_log2 - hi) - lo)))
            total_new = total * old + extra
            log_total = cute.math.log2(total_new, fastmath=True)
            inv[r] = old * cute.arch.rcp_approx(total_new)
            lse_hi[r] = Float32(cutlass.select_(sink_above, sink_log2, hi))
            lse_lo[r] = Float32(cutlass.select_(sink_above, log_total, lo + log_total))
            lse[r] = (lse_hi[r] + lse_lo[r]) * Float32(LN2)
        return inv, lse, lse_hi, lse_lo
