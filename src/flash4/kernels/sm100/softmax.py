"""Row softmax of the sm100 forward: one thread owns one whole score row (one TMEM lane).

On sm100 the softmax warpgroup reads S from tensor memory with tcgen05.ld 32x32b: thread t of the
warpgroup gets all tile_n scores of row t, so the row max and row sum need no shuffles (the sm90
OnlineSoftmax of flash4.kernels.common.softmax reduces over a quad of threads). The arithmetic is
the sm90 one, per row:

  * lazy rescale (FlashAttention-4): the reference max moves only when the row max grew by more
    than tau (cfg.rescale_threshold, log2 units); O and the row sum share the reference, so the
    final O / row_sum is exact. The factor that moves O is sent to the correction warpgroup.
  * exact reference (issue 8, flash4.constants.FWD_EXACT_REF_LOG2): every exponent is
    fma(s, c, -ref_hi) - ref_lo with ref_hi = fp32(m * c); ref_lo is 0 until a row of the warp
    reaches |ref_hi| >= 2^20, then the residual m * c - ref_hi (sticky for the tile): the values
    sm90's OnlineSoftmax computes, without its branch (see exp2_convert).
  * exp2: a static per-column-pair mix (FA4's "software exp2 emulation"): of every period pairs of
    columns the first k go through the packed-f32x2 Cody-Waite polynomial on the FMA units
    (flash4.kernels.common.exp2.exp2_emulated_pair, bit-exact to exp2_poly.exp2_emulated_np), the
    rest through MUFU.EX2 (exp2_hw); k / period = cfg.exp2_emu_frac (plan.EXP2_EMU_FRAC by default),
    the rule exp2_poly.emulated_column(col, frac, EXP2_EMU_GROUP). The same rule on every block
    (FA4 removed CUTLASS's "emulate only on unmasked tiles": masked columns are exact 0 either way).

Status: compile-verified, not run on hardware.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from flash4 import geometry as g
from flash4.constants import FWD_EXACT_REF_LOG2
from flash4.kernels.common import score
from flash4.kernels.common.dsl import DynamicState
from flash4.kernels.common.exp2 import exp2_emulated_pair, exp2_hw, fma_rn
from flash4.kernels.common.exp2_poly import emulated_column
from flash4.kernels.common.geometry import DEVICE_OPS
from flash4.kernels.common.softmax import LN2, _ref_step_scale
from flash4.kernels.sm100.plan import EXP2_EMU_GROUP


@cute.jit
def mask_row(s: cute.Tensor, col0: cute.Tensor, row: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
             tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool], window=None):
    """Scores of keys row `row` does not see -> -inf, in place (flash4.geometry.key_limit: keys past
    seqlen_k, and right of the causal diagonal or the window's right side; key_start: left of the
    window's left side). s: the thread's row fragment; col0: the column of each of its registers
    (static, from thread 0's partition of the identity tensor). window: None or (left, right)."""
    col_limit = g.key_limit(row, seqlen_q, seqlen_k, causal, DEVICE_OPS, window) - n_block * tile_n
    if const_expr(window is None):
        for j in cutlass.range(cute.size(s), unroll_full=True):
            s[j] = Float32(cutlass.select_(col0[j][1] >= col_limit, -Float32.inf, s[j]))
    else:
        col_start = g.key_start(row, seqlen_q, seqlen_k, DEVICE_OPS, window) - n_block * tile_n
        for j in cutlass.range(cute.size(s), unroll_full=True):
            hidden = (col0[j][1] >= col_limit) | (col0[j][1] < col_start)
            s[j] = Float32(cutlass.select_(hidden, -Float32.inf, s[j]))


class RowSoftmax(DynamicState):
    """Softmax state of the one row a thread owns: the raw running max, the reference actually
    subtracted (log2 units, ref_hi + ref_lo), the row sum against that reference, and the sticky
    warp-uniform exact flag. Scalars live in 1-element register tensors so they survive dynamic
    loops (DynamicState carries them).

    scale_log2: the softmax's log2 scale (runtime: softmax_scale * log2 e, or softcap * log2 e with
    softcap, flash4.kernels.common.score.scales); rescale_threshold: tau (static);
    exp2_emu_frac: static share of exp2 on the FMA polynomial (0: all MUFU; k / period, by pairs);
    softcap_scale: None (no softcap, static), or tanh's runtime input scale (score_mod)."""

    _dynamic_fields = ("scale_log2", "state", "exact")

    # state[i]: 0 row max (raw units), 1 ref_hi, 2 ref_lo, 3 row sum
    def __init__(self, scale_log2: Float32, rescale_threshold: float, exp2_emu_frac: float, softcap_scale=None):
        self.scale_log2 = scale_log2
        self.softcap_scale = softcap_scale
        if softcap_scale is not None:  # a device value to carry through the dynamic loops too
            self._dynamic_fields = RowSoftmax._dynamic_fields + ("softcap_scale",)
        self.rescale_threshold = rescale_threshold
        self.exp2_emu_frac = exp2_emu_frac
        self.state = cute.make_rmem_tensor((4,), Float32)
        self.exact = cute.make_rmem_tensor((1,), Int32)

    @cute.jit
    def reset(self):
        self.state[0] = -Float32.inf
        self.state[1] = Float32(0.0)
        self.state[2] = Float32(0.0)
        self.state[3] = Float32(0.0)
        self.exact[0] = Int32(0)

    @cute.jit
    def score_mod(self, s: cute.Tensor):
        """The score transform of flash4.kernels.common.score in place on the row (softcap: tanh of
        S * softcap_scale on MUFU.TANH); a no-op without softcap. Before the mask."""
        if const_expr(self.softcap_scale is not None):
            score.apply(s, self.softcap_scale, True)

    @cute.jit
    def update_max(self, s: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> Float32:
        """Takes the block's raw scores; moves the reference if the row max grew by more than tau
        (always on the first block) and returns the factor O and the row sum must be multiplied
        by (exactly 1.0 where the reference did not move; unused on the first block)."""
        m_tile = s[0]
        for j in cutlass.range(1, cute.size(s), unroll_full=True):
            m_tile = cute.arch.fmax(m_tile, s[j])
        if const_expr(is_first):
            m_ref = m_tile
        else:
            m_old = self.state[0]
            m_new = cute.arch.fmax(m_old, m_tile)
            # NaN (both -inf) compares false: the row stays empty.
            grow = (m_new - m_old) * self.scale_log2
            m_ref = Float32(cutlass.select_(grow > Float32(self.rescale_threshold), m_new, m_old))
        self.state[0] = m_ref
        # A row that saw no key yet keeps reference 0 (exp2(-inf - 0) = 0, not NaN).
        hi = Float32(cutlass.select_(m_ref == -Float32.inf, Float32(0.0), m_ref * self.scale_log2))
        huge = (self.exact[0] != 0) | (cute.arch.fmax(hi, -hi) >= Float32(FWD_EXACT_REF_LOG2))
        if cute.arch.vote_any_sync(huge):
            self._enter_exact()
        # the residual m * c - hi (exact by one FMA); 0 until the warp took the exact path
        use_lo = (self.exact[0] != 0) & (m_ref != -Float32.inf)
        lo = Float32(cutlass.select_(use_lo, fma_rn(m_ref, self.scale_log2, -hi), Float32(0.0)))
        row_scale = Float32(1.0)
        if const_expr(not is_first):
            row_scale = _ref_step_scale((self.state[1] - hi) + (self.state[2] - lo))
        self.state[1] = hi
        self.state[2] = lo
        return row_scale

    @cute.jit
    def exp2_convert(self, s: cute.Tensor, p: cute.Tensor, row_scale: Float32, is_first: cutlass.Constexpr[bool]):
        """s (raw scores) -> P = 2^(s * c - ref) in place (fp32), p[j] = P[j] in p's 16-bit type,
        and the row sum updated (row_sum * row_scale + sum P). Pairs of columns go through packed
        f32x2 FMAs (FFMA2)."""
        neg_hi, neg_lo = -self.state[1], -self.state[2]
        c = self.scale_log2
        # fma(s, c, -hi) - lo: lo is 0 until the warp took the exact path (then s - lo is what
        # sm90's branch computes). Unconditional: a branch over the 128-register row made ptxas copy
        # and spill the row (hd128 causal: 184 bytes of stack); this costs one FADD2 per pair.
        for j in cutlass.range(0, cute.size(s), 2, unroll_full=True):
            s[j], s[j + 1] = cute.arch.fma_packed_f32x2((s[j], s[j + 1]), (c, c), (neg_hi, neg_hi))
            s[j], s[j + 1] = cute.arch.add_packed_f32x2((s[j], s[j + 1]), (neg_lo, neg_lo))
        total = (Float32(0.0), Float32(0.0))
        if const_expr(self.exp2_emu_frac == 0.0):
            # one traced body, unrolled by the compiler (every column on MUFU.EX2)
            for j in cutlass.range(0, cute.size(s), 2, unroll_full=True):
                s[j], s[j + 1] = exp2_hw(s[j]), exp2_hw(s[j + 1])
                total = cute.arch.add_packed_f32x2(total, (s[j], s[j + 1]))
        else:
            # the mix, traced pair by pair (the unit is a static choice per pair)
            for j in cutlass.range_constexpr(0, cute.size(s), 2):
                s[j], s[j + 1] = self.exp2_pair(s[j], s[j + 1], j)
                total = cute.arch.add_packed_f32x2(total, (s[j], s[j + 1]))
        p.store(s.load().to(p.element_type))
        block_sum = total[0] + total[1]
        if const_expr(is_first):
            self.state[3] = block_sum
        else:
            self.state[3] = self.state[3] * row_scale + block_sum

    @cute.jit
    def _enter_exact(self):
        """Sticky for the tile (reset clears it). Only register-tensor writes: nothing escapes the
        warp-uniform branch that calls it."""
        self.exact[0] = Int32(1)

    @cute.jit
    def exp2_pair(self, x0: Float32, x1: Float32, col: cutlass.Constexpr[int]):
        """2^x0, 2^x1 for columns col, col + 1 (col even): the packed-f32x2 FMA polynomial where the
        static rule picks the pair (emulated_column with EXP2_EMU_GROUP), else MUFU.EX2 twice."""
        if const_expr(emulated_column(col, self.exp2_emu_frac, EXP2_EMU_GROUP)):
            return exp2_emulated_pair(x0, x1)
        return exp2_hw(x0), exp2_hw(x1)

    @cute.jit
    def finalize(self, sink_log2=None):
        """(inv_row_sum, lse, lse_hi, lse_lo) as flash4.kernels.common.softmax.OnlineSoftmax.finalize:
        1 / row_sum (0 for a row that saw no key), the natural-log LSE (-inf for such rows), and the
        log2-domain LSE unrounded as hi + lo (+inf, 0 for such rows) for the backward's exact path.
        sink_log2: None, or the row's learnable-sink logit in log2 units (Float32): one more term
        2^sink in the denominator, against its own reference when it is above the row's (sm90's
        rule, OnlineSoftmax._finalize_sink); a row without keys then has O = 0 and LSE = the sink."""
        total = self.state[3]
        hi = self.state[1]
        if const_expr(sink_log2 is not None):
            lo = self.state[2]
            sink_above = (sink_log2 > hi + lo) | (total == Float32(0.0))
            shift = Float32(cutlass.select_(sink_above, (hi - sink_log2) + lo, Float32(0.0)))
            old = Float32(cutlass.select_(total == Float32(0.0), Float32(0.0), exp2_hw(shift)))
            extra = exp2_hw(Float32(cutlass.select_(sink_above, Float32(0.0), (sink_log2 - hi) - lo)))
            total_new = total * old + extra
            log_total = cute.math.log2(total_new, fastmath=True)
            inv = old * cute.arch.rcp_approx(total_new)
            hi = Float32(cutlass.select_(sink_above, sink_log2, hi))
            lo = Float32(cutlass.select_(sink_above, log_total, lo + log_total))
            return inv, (hi + lo) * Float32(LN2), hi, lo
        empty = (total == Float32(0.0)) | (total != total)
        inv = cute.arch.rcp_approx(total)
        lo = self.state[2] + cute.math.log2(total, fastmath=True)
        lse = (hi + lo) * Float32(LN2)
        if empty:
            inv = Float32(0.0)
            lse = -Float32.inf
            hi = Float32.inf
            lo = Float32(0.0)
        return inv, lse, hi, lo
