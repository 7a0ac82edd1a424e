"""Warp-level tensor-core building blocks of the sm80 family: the tiled mma.sync m16n8k16, the
swizzled smem tiles ldmatrix reads without bank conflicts, the k-pipelined GEMMs, and the views
that let the arch-neutral kernels/common code (OnlineSoftmax, geometry.mask_scores) read an
mma.sync accumulator.

An mma.sync m16n8k16 accumulator (per thread) is ((2, 2), MMA_M, MMA_N): mode 0 holds 2 adjacent
columns x 2 rows 8 apart (lane l: row l / 4, columns 2 (l % 4) + {0, 1}), so the 4 lanes of a quad
share each row, exactly as in a wgmma accumulator ((2, 2, V), MMA_M, MMA_N) with V = 1. The
common code's row reductions (quad shuffles with offsets 2 and 1) therefore apply unchanged once
the accumulator is viewed with the unit V mode (`as_wgmma_acc`).

Only instructions every target runs are used here (mma.sync, ldmatrix, cp.async, plain ld/st):
no TMA, wgmma, stmatrix or tcgen05, whatever the DSL's target arch is.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import warp

# mma.sync shape: M x N x K per instruction.
MMA_SHAPE = (16, 8, 16)


def make_tiled_mma(dtype, num_warps: int, warps_n: int = 1) -> cute.TiledMma:
    """num_warps // warps_n warps stacked along M (each owns 16-row slabs of A's rows) times warps_n
    along N (the forward: all along M); the N and K permutation of 16 per warp lets one
    ldmatrix.x4 feed two n8 atoms of B."""
    warps_m = num_warps // warps_n
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, MMA_SHAPE), (warps_m, warps_n, 1),
        permutation_mnk=(warps_m * 16, warps_n * 16, 16),
    )


def swizzle_params(elem_bits: int, hdim: int) -> tuple[int, int, int]:
    """(BBits, MBase, SShift) of smem_layout_atom's swizzle on ELEMENT offsets: 16-byte chunks
    (2^MBase elements) of a 128-byte row (3 bits, 64- and 128-element head dims' multiples) or a
    64-byte row (2 bits, head dim 96) XOR-ed with the row index (pure; CPU-tested)."""
    row_bytes = hdim * elem_bits // 8
    block_bytes = 128 if row_bytes % 128 == 0 else 64
    base = (128 // elem_bits).bit_length() - 1  # 16 bytes = 2^base elements
    return (3 if block_bytes == 128 else 2), base, 3


def pointer_swizzle_params(elem_bits: int, hdim: int) -> tuple[int, int, int]:
    """The same swizzle on BYTE addresses, as a swizzle on a shared-memory pointer is applied
    (the sm90 stages' S<3,4,3>): MBase moves up by log2(bytes per element). Putting the element
    swizzle S<3,3,3> on the pointer instead permutes 8-byte pieces: every 16-byte ldmatrix /
    cp.async then reads a misaligned address (the paged portable forward on the H200, 2026-12-03)."""
    bits, base, shift = swizzle_params(elem_bits, hdim)
    return bits, base + (elem_bits // 8).bit_length() - 1, shift


def smem_layout_atom(dtype, hdim: int):
    """8 rows x (64 or 32) 16-bit columns, XOR-swizzled on 16-byte chunks: the 8 rows an ldmatrix
    8x8 reads (and the rows a cp.async wave writes) fall on 8 different bank groups. 128-byte rows
    where the head dim allows (64, 128, 192, 256), 64-byte rows for 96 (192 bytes). The swizzle is
    on element offsets (swizzle_params); on a pointer use pointer_swizzle."""
    bits, base, shift = swizzle_params(dtype.width, hdim)
    cols = (64 if bits == 3 else 32) * 16 // dtype.width
    return cute.make_composed_layout(cute.make_swizzle(bits, base, shift), 0,
                                     cute.make_ordered_layout((8, cols), order=(1, 0)))


def pointer_swizzle(dtype, hdim: int):
    """smem_layout_atom's swizzle on byte addresses, for SmemAllocator get_tensor(outer, swizzle=...)
    (pointer_swizzle_params)."""
    return cute.make_swizzle(*pointer_swizzle_params(dtype.width, hdim))


def as_wgmma_acc(t: cute.Tensor) -> cute.Tensor:
    """((2, 2), MMA_M, MMA_N) accumulator (or a tensor partitioned like one, e.g. an identity
    tensor) -> the same elements as ((2, 2, 1), MMA_M, MMA_N): the shape kernels/common/layout.
    acc_mn_view reads, so OnlineSoftmax and geometry.mask_scores work on it unchanged."""
    l = t.layout
    return cute.make_tensor(t.iterator, cute.composition(l, cute.make_layout(((2, 2, 1), l.shape[1], l.shape[2]))))


def acc_to_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2), MMA_M, MMA_N) accumulator -> ((2, 2, 2), MMA_M, MMA_N / 2) A-operand fragment of the
    next GEMM: a k16 slice of A is two adjacent n8 accumulator atoms (a0-a3 from the first,
    a4-a7 from the second), so P feeds P V from registers without a shuffle."""
    assert acc_layout.shape[2] % 2 == 0, "tile_n must be a multiple of 16"
    l = cute.logical_divide(acc_layout, (None, None, 2))
    return cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[2][0]), l.shape[1], l.shape[2][1]),
        stride=((l.stride[0][0], l.stride[0][1], l.stride[2][0]), l.stride[1], l.stride[2][1]),
    )


@cute.jit
def gemm_ss(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
            tCsA: cute.Tensor, tCsB: cute.Tensor, copy_A: cute.TiledCopy, copy_B: cute.TiledCopy,
            a_in_regs: cutlass.Constexpr[bool] = False):
    """acc += A B^T over the K mode, A and B read from smem by ldmatrix one k16 slice ahead of the
    mma.sync that uses it (register double buffering). a_in_regs: tCrA already holds all of A.

    tCrA (MMA, MMA_M, MMA_K), tCrB (MMA, MMA_N, MMA_K): register fragments; tCsA, tCsB: the ldmatrix
    partitions of the smem tiles; copy_A, copy_B: the per-thread ldmatrix copies."""
    tCrA_view = copy_A.retile(tCrA)
    tCrB_view = copy_B.retile(tCrB)
    num_k = cute.size(tCsB.shape[2])
    if cutlass.const_expr(not a_in_regs):
        cute.copy(copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k < num_k - 1):
            if cutlass.const_expr(not a_in_regs):
                cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_rs(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
            tCsB: cute.Tensor, copy_B: cute.TiledCopy):
    """acc += A B^T with A in registers (P) and B ldmatrix'd from smem one k16 slice ahead."""
    tCrB_view = copy_B.retile(tCrB)
    num_k = cute.size(tCrA.shape[2])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k < num_k - 1):
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
