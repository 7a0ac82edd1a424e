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

from typing import NamedTuple

import math

import cutlass
import cutlass._mlir.dialects.cute as _cute_ir
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


# ---------------------------------------------------------------------- trace-time lean GEMMs
# cute.copy and cute.gemm canonicalize their operands on every call (append_ones + group_modes of
# each slice, and rank / size / shape checks): ~47 IR ops per ldmatrix k16 slice, of which a
# make_coord, slice, group_modes chain is live; the rest is dead introspection the first
# canonicalizer removes. The backward issues ~60 such slices per query tile, the forward 16-48 per
# key block (Q K^T and P V), each in every traced loop body, so that is much of their trace time
# (issue 24). KPipe (KPipeB: B only, A from registers) groups the
# copies' rest modes once per kernel (group_modes(t, 1, 2): (CPY, (CPY_M), CPY_K[, STAGE])), so a
# k16 slice of it already has the (V, (Rest)) form cute.copy would build, and gemm_kpipe (_rs) emit the
# cute.copy / cute.gemm ops on the slices directly: the same live IR, hence the same cubin (checked
# with tools/kernel_fingerprint.py), built from ~5 ops per slice.

class KPipe(NamedTuple):
    """One k-pipelined GEMM's per-thread operands: a, b the MMA fragments (MMA, MMA_M|N, MMA_K);
    sa, sb the ldmatrix partitions of the smem tiles, rest modes grouped as cute.copy would
    ((CPY, (CPY_M|N), CPY_K), a trailing STAGE mode where the operand is staged); copy_a, copy_b
    the per-thread ldmatrix copies; a_k, b_k, ra_k, rb_k the k16 slices of the fragments and of
    their ldmatrix retiles (rest modes grouped), one per k (static: sliced once per kernel)."""

    a: cute.Tensor
    b: cute.Tensor
    sa: cute.Tensor
    sb: cute.Tensor
    copy_a: object
    copy_b: object
    a_k: tuple
    b_k: tuple
    ra_k: tuple
    rb_k: tuple


def _group_rest(t: cute.Tensor) -> cute.Tensor:
    """(CPY, CPY_M, CPY_K, ...) -> (CPY, (CPY_M), CPY_K, ...): a k (and stage) slice of it is what
    cute.copy's group_modes(append_ones(slice, 2), 1) makes of the ungrouped slice."""
    return cute.group_modes(t, 1, 2)


def make_kpipe(a: cute.Tensor, b: cute.Tensor, sa: cute.Tensor, sb: cute.Tensor, copy_a, copy_b) -> KPipe:
    """KPipe of fragments a, b, ldmatrix partitions sa, sb (copy_x.partition_S of the smem tiles)
    and the per-thread copies (built once per kernel)."""
    ra, rb = _group_rest(copy_a.retile(a)), _group_rest(copy_b.retile(b))
    num_k = cute.size(a.shape[2])
    return KPipe(a, b, _group_rest(sa), _group_rest(sb), copy_a, copy_b,
                 tuple(a[None, None, k] for k in range(num_k)), tuple(b[None, None, k] for k in range(num_k)),
                 tuple(ra[None, None, k] for k in range(num_k)), tuple(rb[None, None, k] for k in range(num_k)))


def copy_op(atom, src: cute.Tensor, dst: cute.Tensor):
    """cute.copy(atom, src, dst) for operands already in its canonical rank-2 (V, (Rest)) form:
    the one cute.copy op, without the canonicalization and checks."""
    _cute_ir.copy(atom._unpack(), [src.value], [dst.value])


def _mma(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor):
    """cute.gemm(tiled_mma, acc, a, b, acc) without its rank checks: the one cute.gemm op."""
    _cute_ir.gemm(tiled_mma._unpack(), acc.value, [a.value], [b.value], acc.value)


@cute.jit
def gemm_kpipe(tiled_mma: cute.TiledMma, acc: cute.Tensor, p: KPipe, sa: cute.Tensor, sb: cute.Tensor,
               a_in_regs: cutlass.Constexpr[bool] = False):
    """acc += A B^T over the K mode on KPipe operands, A and B ldmatrix'd from smem one k16 slice
    ahead of the mma.sync that uses it (register double buffering). sa, sb: p.sa / p.sb, or their
    stage slice where staged ((CPY, (CPY_M|N), CPY_K)). a_in_regs: p.a already holds all of A (the
    forward's Q in registers), only B is loaded."""
    num_k = cute.size(sb.shape[2])
    if cutlass.const_expr(not a_in_regs):
        copy_op(p.copy_a, sa[None, None, 0], p.ra_k[0])
    copy_op(p.copy_b, sb[None, None, 0], p.rb_k[0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k < num_k - 1):
            if cutlass.const_expr(not a_in_regs):
                copy_op(p.copy_a, sa[None, None, k + 1], p.ra_k[k + 1])
            copy_op(p.copy_b, sb[None, None, k + 1], p.rb_k[k + 1])
        _mma(tiled_mma, acc, p.a_k[k], p.b_k[k])


@cute.jit
def gemm_kpipe_part(tiled_mma: cute.TiledMma, acc: cute.Tensor, p: KPipe, sa: cute.Tensor, sb: cute.Tensor,
                    k_lo: cutlass.Constexpr[int], k_hi: cutlass.Constexpr[int]):
    """gemm_kpipe over the k16 slices k_lo .. k_hi - 1 only (A and B from smem, one slice ahead of
    the mma.sync that uses it; the part's first slice loaded here, nothing past k_hi): gemm_kpipe's
    k-loop issued in parts with other work between them (Sm80BwdConfig.dp_split)."""
    copy_op(p.copy_a, sa[None, None, k_lo], p.ra_k[k_lo])
    copy_op(p.copy_b, sb[None, None, k_lo], p.rb_k[k_lo])
    for k in cutlass.range_constexpr(k_lo, k_hi):
        if cutlass.const_expr(k < k_hi - 1):
            copy_op(p.copy_a, sa[None, None, k + 1], p.ra_k[k + 1])
            copy_op(p.copy_b, sb[None, None, k + 1], p.rb_k[k + 1])
        _mma(tiled_mma, acc, p.a_k[k], p.b_k[k])


class KPipeB(NamedTuple):
    """A k-pipelined GEMM whose A comes from registers per call (the forward's P of O += P V):
    KPipe's B side only. b the MMA fragment (MMA, MMA_N, MMA_K); sb the ldmatrix partition of the
    smem tile, rest modes grouped ((CPY, (CPY_N), CPY_K[, STAGE])); copy_b the per-thread ldmatrix
    copy; b_k, rb_k the k16 slices of b and of its ldmatrix retile (built once per kernel)."""

    b: cute.Tensor
    sb: cute.Tensor
    copy_b: object
    b_k: tuple
    rb_k: tuple


def make_kpipe_b(b: cute.Tensor, sb: cute.Tensor, copy_b) -> KPipeB:
    """KPipeB of fragment b, ldmatrix partition sb (copy_b.partition_S of the smem tile) and the
    per-thread copy (built once per kernel)."""
    rb = _group_rest(copy_b.retile(b))
    num_k = cute.size(b.shape[2])
    return KPipeB(b, _group_rest(sb), copy_b, tuple(b[None, None, k] for k in range(num_k)),
                  tuple(rb[None, None, k] for k in range(num_k)))


@cute.jit
def gemm_kpipe_rs(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, p: KPipeB, sb: cute.Tensor):
    """acc += A B^T on KPipeB operands, A (MMA, MMA_M, MMA_K) in registers (the forward's P), B
    ldmatrix'd from smem one k16 slice ahead of the mma.sync that uses it. sb: p.sb or its stage
    slice ((CPY, (CPY_N), CPY_K))."""
    num_k = cute.size(a.shape[2])
    copy_op(p.copy_b, sb[None, None, 0], p.rb_k[0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k < num_k - 1):
            copy_op(p.copy_b, sb[None, None, k + 1], p.rb_k[k + 1])
        _mma(tiled_mma, acc, a[None, None, k], p.b_k[k])


class ZeroRowCopy:
    """cute.autovec_copy(zeros, row) for many rows of one layout (the rows of a tile past a
    sequence): its vector plan (max_common_layout, the vector width) and the zeros' tiled view are
    built once, each row then costs its two logical_divides, the copy atom and the copy op, as
    autovec_copy emits them. A row whose type differs from the first's goes through
    cute.autovec_copy itself."""

    def __init__(self, zeros: cute.Tensor, row: cute.Tensor):
        self.zeros, self.row_type = zeros, row.type
        width = zeros.element_type.width
        self.vec_layout = cute.max_common_layout(zeros, row)
        num = cute.size(self.vec_layout)
        bound = math.gcd(zeros.layout.max_alignment, row.layout.max_alignment)
        bound = math.gcd(bound, num) * width
        bound = math.gcd(bound, zeros.iterator.max_alignment * 8)
        bound = math.gcd(bound, row.iterator.max_alignment * 8)
        self.bits = math.gcd(bound, 256)
        self.vectorized = num > 1 and self.bits % 8 == 0 and zeros.element_type is not cutlass.Boolean
        if self.vectorized:
            self.num = self.bits // width
            self.tiled_zeros = cute.logical_divide(cute.logical_divide(zeros, self.vec_layout),
                                                   cute.make_layout(self.num))

    def copy(self, row: cute.Tensor):
        if not self.vectorized or row.type != self.row_type:
            cute.autovec_copy(self.zeros, row)
            return
        from cutlass.cute.algorithm import _make_copy_atom

        tiled_row = cute.logical_divide(cute.logical_divide(row, self.vec_layout), cute.make_layout(self.num))
        atom = _make_copy_atom(self.zeros.element_type, self.bits, self.zeros.iterator.memspace, row.iterator.memspace)
        _cute_ir.copy(atom, [self.tiled_zeros.value], [tiled_row.value])
