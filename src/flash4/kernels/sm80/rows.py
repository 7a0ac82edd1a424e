"""Row-predicated cp.async tile loads of the sm80 family (forward and backward): the rows of a
global tile that lie inside the sequence are copied into smem, the others zero-filled there.

A tile is loaded through a tiled copy of 16-byte cp.async chunks: per thread a (CPY, CPY_ROWS,
CPY_K) partition of the global and of the smem tile. Whether row index m of that partition lies
inside the sequence is decided without a per-row coordinate in a register: thread 0's row of each
m is a compile-time constant (`row_coords`, Python ints computed once per kernel object and tile
shape), compared against (valid rows - this thread's first row), as FlashAttention-2 does.

Trace-time lean (issue 24: compile <= 3 s per config). The copies issue the cute.copy op on
slices of (CPY, CPY_ROWS, (CPY_K)) views grouped once per call (the form cute.copy would build per
row, mma.copy_op), and the zero-fill is cute.autovec_copy's with its vector plan and the zeros'
side built once per call (mma.ZeroRowCopy, kernels/common/zero_rows.zeros_like): the same IR once
the canonicalizer has run, so the same cubins (tools/kernel_fingerprint.py --family sm80).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flash4.kernels.common.zero_rows import zeros_like
from flash4.kernels.sm80.mma import ZeroRowCopy, copy_op


def row_coords(cache: dict, tiled_copy, thr_copy, rows: int, cols: int):
    """(this thread's coordinate partition of a (rows, cols) tile, thread 0's row of each CPY_ROWS
    index as a tuple of Python ints). cache: a dict owned by the kernel object (the static rows
    depend on the tile shape and the copy's thread layout, which one kernel builds once per shape)."""
    c = cute.make_identity_tensor((rows, cols))
    key = (rows, cols)
    if key not in cache:
        t0XcX = tiled_copy.get_slice(0).partition_S(c)
        t0_rows = tuple(t0XcX[0, m, 0][0] for m in range(cute.size(t0XcX.shape[1])))
        assert all(isinstance(r, int) for r in t0_rows), t0_rows
        cache[key] = t0_rows
    return thr_copy.partition_S(c), cache[key]


@cute.jit
def load_rows(tiled_copy, tXgX: cute.Tensor, tXsX: cute.Tensor, tXcX: cute.Tensor, t0_rows: tuple,
              valid_rows: Int32):
    """cp.async the rows < valid_rows of a tile; zero the others in smem (16-byte stores). tXgX,
    tXsX: (CPY, CPY_ROWS, CPY_K) partitions; rows compared as thread 0's static row (t0_rows,
    row_coords) against (valid_rows - this thread's first row)."""
    limit = valid_rows - tXcX[0][0]
    zeros = zeros_like(tXsX[None, 0, None])
    gX, sX = cute.group_modes(tXgX, 2, 3), cute.group_modes(tXsX, 2, 3)
    zero_row = ZeroRowCopy(zeros, tXsX[None, 0, None]).copy
    for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
        if t0_rows[m] < limit:
            copy_op(tiled_copy, gX[None, m, None], sX[None, m, None])
        else:
            zero_row(tXsX[None, m, None])
