"""Warpgroup MMA (wgmma) issue helpers for sm90."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def wgmma(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool] = False,
    wg_wait: cutlass.Constexpr[int] = 0,
):
    """acc (+)= A @ B over all k16 blocks: fence, issue, commit; then wait until at most
    `wg_wait` wgmma groups are in flight (wg_wait < 0: don't wait).

    tCrA: (MMA, MMA_M, MMA_K) smem descriptors or registers; tCrB: (MMA, MMA_N, MMA_K).
    """
    wgmma_first(tiled_mma, acc, tCrA, tCrB, not zero_init, wg_wait)


@cute.jit
def wgmma_first(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    accumulate: cutlass.Boolean,
    wg_wait: cutlass.Constexpr[int] = 0,
):
    """wgmma whose first k16 block adds to acc only where `accumulate` (a run-time value, or a
    Python bool: wgmma's not zero_init) is true: acc = A @ B on a tile's first P V, acc += A @ B
    after (FwdConfig.pv_zero_init: acc_O needs no zeroing; flash-attn-4's sm90 forward does the
    same). Otherwise as wgmma."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: we toggle its ACCUMULATE field
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)
