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
from cutlass import Float32

from flash4.kernels.common.exp2 import exp2_emulated, exp2_hw
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


class OnlineSoftmax(DynamicState):
    """Per-thread softmax state for the rows it owns: row_max (raw score units) and a partial
    row_sum (this thread's columns only; reduced across the quad in `finalize`).

    scale_log2:   softmax_scale * log2(e) (runtime Float32).
    num_rows:     rows per thread (static).
    rescale_threshold: tau in log2 units (static); 0 = always rescale.
    exp2_emu_frac: static share of exp2 evaluated by the FMA polynomial (0 = all MUFU.EX2).
    """

    _dynamic_fields = ("scale_log2", "row_max", "row_sum")

    def __init__(self, scale_log2: Float32, num_rows: int, rescale_threshold: float, exp2_emu_frac: float):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold
        self.exp2_emu_frac = exp2_emu_frac
        self.row_max = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_sum = cute.make_rmem_tensor((num_rows,), Float32)

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def online(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turns acc_S (raw scores) into unnormalized P in place; returns the per-row factor that
        O must be multiplied by (1.0 where the reference max did not move)."""
        s = acc_mn_view(acc_S)
        n_cols = cute.size(s, mode=[1])
        row_scale = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            m_tile = s[r, 0]
            for c in cutlass.range_constexpr(1, n_cols):
                m_tile = cute.arch.fmax(m_tile, s[r, c])
            m_tile = quad_allreduce_max(m_tile)
            if cutlass.const_expr(is_first):
                self.row_max[r] = m_tile
                row_scale[r] = Float32(1.0)
            else:
                m_old = self.row_max[r]
                m_new = cute.arch.fmax(m_old, m_tile)
                # NaN (both -inf) compares false: the row stays empty, nothing to rescale.
                grow = (m_new - m_old) * self.scale_log2
                move = grow > Float32(self.rescale_threshold)
                self.row_max[r] = Float32(cutlass.select_(move, m_new, m_old))
                row_scale[r] = Float32(cutlass.select_(move, exp2_hw((m_old - m_new) * self.scale_log2), Float32(1.0)))
            m_ref = self.row_max[r]
            # fully masked so far: use 0 so that exp2(-inf - 0) = 0, not NaN
            neg_max_scaled = Float32(cutlass.select_(m_ref == -Float32.inf, Float32(0.0), -(m_ref * self.scale_log2)))
            row_sum = Float32(0.0)
            for c in cutlass.range_constexpr(n_cols):
                x = s[r, c] * self.scale_log2 + neg_max_scaled
                p = exp2_emulated(x) if cutlass.const_expr(uses_emulated_exp2(c, self.exp2_emu_frac)) else exp2_hw(x)
                s[r, c] = p
                row_sum = row_sum + p
            if cutlass.const_expr(is_first):
                self.row_sum[r] = row_sum
            else:
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + row_sum
        return row_scale

    @cute.jit
    def rescale_O(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        """O[r, :] *= row_scale[r]; skipped for the whole warp when no row of it moved its max."""
        o = acc_mn_view(acc_O)
        if cutlass.const_expr(self.rescale_threshold > 0.0):
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
    def finalize(self) -> tuple:
        """Returns (inv_row_sum, lse): the factor that normalizes O (0 for rows that saw no key)
        and the natural-log LSE (-inf for rows that saw no key)."""
        inv = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = quad_allreduce_sum(self.row_sum[r])
            empty = (total == Float32(0.0)) | (total != total)
            inv_r = cute.arch.rcp_approx(total)
            lse_r = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * Float32(LN2)
            if empty:
                inv_r = Float32(0.0)
                lse_r = -Float32.inf
            inv[r] = inv_r
            lse[r] = lse_r
        return inv, lse
