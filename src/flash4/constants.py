"""Constants shared by the host and the kernels: the one place each is written.

Pure Python (no torch, no CuTe DSL): device code may import this module (and flash4.arch,
flash4.geometry), nothing else on the host side. Per-arch hardware limits are in flash4.arch.CAPS;
tuned tile sizes live with the family's config (flash4.config.sm90).
"""

from __future__ import annotations

import math

# log2(e): exp(x) = 2^(x * LOG2E); every kernel works in the log2 domain.
LOG2E = math.log2(math.e)

# dtype names used in configs and compile keys (strings, so configs stay torch-free and hashable).
# The torch dtypes are mapped in flash4.validate.DTYPE_NAMES, the DSL types in
# flash4.kernels.common.dsl.DSL_DTYPES.
DTYPES = ("bf16", "fp16")

# Threads of one warpgroup (4 warps): the unit of wgmma on sm90 and of the warp roles.
THREADS_PER_WG = 128
# Rows of the query tile handled by one consumer warpgroup (one wgmma M).
ROWS_PER_WARPGROUP = 64

# Lazy-rescale threshold tau in the log2 domain: rescale only when the row max grew by more
# than 2**tau (FlashAttention-4 paper, section on conditional rescaling). 8 -> factor 256.
RESCALE_THRESHOLD_LOG2 = 8.0
# Exact max subtraction (issue 8, huge-magnitude inputs). The forward's exponent is
# fma(s, c, -R) with R = fp32(m * c) (c = softmax_scale * log2 e, m the row's reference max): at
# s = m it is m*c - R, up to half an ulp of R, which leaves exp2's range once |R| is ~2^31 (and
# bf16/fp16 P's headroom well before). A warp whose reference |R| reaches FWD_EXACT_REF_LOG2
# switches to (s - m) * c, exact at the max at any finite magnitude; below it the FMA path's
# residual is at most 2^-4 (log2 units), which O and the row sum share, so the result is exact.
FWD_EXACT_REF_LOG2 = 2.0**20
# The backward's exponent is fma(s, c, -L) with L = fp32(LSE * log2 e); its rounding (half an
# ulp of L) moves P by that much in log2 units. Query tiles with some |L| at or above
# BWD_EXACT_LSE_LOG2 (2^10: the error would exceed 2^-14) use fma(s, c, -L_hi) - L_lo instead,
# with L = L_hi + L_lo kept unrounded from the forward.
BWD_EXACT_LSE_LOG2 = 2.0**10

# The backward's row-wise passes (preprocess, dQ postprocess; kernels/common/bwd_preprocess.py):
# threads per CTA and consecutive rows of one (batch, head) per CTA (flash4.launch sizes their grids).
ROW_PASS_THREADS = 128
ROW_TILE = 64

# Most key splits of a decode step that the split-KV heuristic picks (flash4.config.choose_num_splits);
# the prefetching combine keeps up to this many split LSEs in registers (kernels/common/fwd_combine.py).
MAX_SPLITS = 128

# The split-KV combine (kernels/common/fwd_combine.py): one warp per output row, this many warps per
# CTA (flash4.compile.cache sizes its grid).
COMBINE_WARPS_PER_CTA = 4

# The sm90 backward's speed switches that FLASH4_BWD_SWITCHES may turn on (flash4.env.bwd_switches,
# flash4.config.sm90.with_bwd_switches), in the order with_bwd_switches applies them
# (dq_handoff_per_wg needs dq_whole's accumulator order first).
BWD_SPEED_SWITCHES = ("dq_whole", "dq_handoff_per_wg", "lse_early", "exp_before_dp_wait", "no_tail_guard",
                      "mask_rel", "dpsum_scaled")

# The sm90 forward's speed switches that FLASH4_FWD_SWITCHES may turn on (flash4.env.fwd_switches,
# flash4.config.sm90.with_fwd_switches).
FWD_SPEED_SWITCHES = ("softmax_vote_first", "no_tail_guard", "lookahead_qk", "mask_bits", "rescale_always",
                      "pv_zero_init", "flat_tile_order", "split_row_max", "softmax_branch_free",
                      "gather_clamp_late", "gather_ptr_shuffle", "page_pieces_all_warps", "pin_p_convert",
                      "page_divide_free", "page_row_shuffle", "pdl_combine",
                      "combine_prefetch")
