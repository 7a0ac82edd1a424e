"""Register/shared-memory layout views for sm90 wgmma fragments.

A wgmma accumulator fragment (per thread) has layout ((2, 2, V), MMA_M, MMA_N): mode 0 holds
2 adjacent columns x 2 rows (8 apart) x V column groups (8 apart). Softmax wants it as a
(rows, cols) matrix; the P @ V wgmma wants it as an A-operand fragment ((2, 2, 2), MMA_M, K/16).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


def acc_to_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)): rows x cols of the thread's values."""
    flat = cute.make_layout(acc_layout.shape)  # column-major positions of the fragment
    shape = (
        (flat.shape[0][1], flat.shape[1]),
        (flat.shape[0][0], flat.shape[0][2], flat.shape[2]),
    )
    stride = (
        (flat.stride[0][1], flat.stride[1]),
        (flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
    )
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View of an accumulator (or an identity/global tensor partitioned like one) as (rows, cols)."""
    return cute.make_tensor(acc.iterator, acc_to_mn_layout(acc.layout))


def acc_to_frgA_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (V/2, MMA_N)) for a 16-bit RS wgmma A operand.

    Each k16 slice of the A operand takes two adjacent 8-column groups of the accumulator.
    """
    assert acc_layout.shape[0][2] % 2 == 0, "tile_n must be a multiple of 16"
    l = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2])),
        stride=(
            (l.stride[0][0], l.stride[0][1], l.stride[0][2][0]),
            l.stride[1],
            (l.stride[0][2][1], l.stride[2]),
        ),
    )


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly swizzled) shared-memory tensor: (N, D, ...) -> (D, N, ...)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes: list) -> cute.Tensor:
    """Reorder a tensor's modes without moving data (e.g. (B, S, H, D) -> (S, D, H, B))."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


# ---------------------------------------------------------------- GQA packing (forward)
# The `pack` query heads that share a KV head become rows of one query tile: packed row
# r = query * pack + j holds query r // pack of head head_kv * pack + j (j = r % pack), so a tile of
# tile_m rows covers tile_m / pack queries of all `pack` heads and each K/V block is loaded once for
# them (FlashAttention-3's PackGQA layout). Views only: no data moves.
def pack_gqa_view(t: cute.Tensor, pack: int, head_mode: int) -> cute.Tensor:
    """Kernel view (seqlen, ..., nheads, ...) -> ((pack, seqlen), ..., nheads // pack, ...): mode 0
    becomes the packed rows (head offset fastest), the head mode counts KV heads."""
    head_stride = t.stride[head_mode]
    shape = ((pack, t.shape[0]),) + tuple(t.shape[1:head_mode]) + (t.shape[head_mode] // pack,) \
        + tuple(t.shape[head_mode + 1:])
    stride = ((head_stride, t.stride[0]),) + tuple(t.stride[1:head_mode]) + (head_stride * pack,) \
        + tuple(t.stride[head_mode + 1:])
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def make_packed_tma_atom(op, t: cute.Tensor, smem_layout, tile: tuple, pack: int):
    """TMA atom and tensor for a GQA-packed Q or O tile. t: kernel view (seqlen, d, nheads, batch);
    tile: (tile_m, d) with tile_m % pack == 0. The TMA tensor is built on ((nheads, seqlen), d, batch)
    (still a 4-D copy: box (pack, tile_m / pack, d, 1)) and returned as coordinates
    ((pack, seqlen), d, nheads // pack, batch), the shape of pack_gqa_view(t, pack, 2)."""
    assert tile[0] % pack == 0, (tile, pack)
    hsb = cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 0, 1, 3]))  # (nheads, seqlen, d, batch)
    hsb = cute.group_modes(hsb, 0, 2)  # ((nheads, seqlen), d, batch)
    atom, tma = cpasync.make_tiled_tma_atom(op, hsb, smem_layout, ((pack, tile[0] // pack), tile[1]))
    shape = ((pack, tma.shape[0][1]), tma.shape[1], tma.shape[0][0] // pack, tma.shape[2])
    stride = (tma.stride[0], tma.stride[1], tma.stride[0][0] * pack, tma.stride[2])
    return atom, cute.make_tensor(tma.iterator, cute.make_layout(shape, stride=stride))
