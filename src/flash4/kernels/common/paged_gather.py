"""Gathered paged K/V (FwdConfig.page_gather, Sm80FwdConfig.page_gather): pages of any size >= 1.
The sm90 forward's producer warpgroup runs it (128 threads); the portable sm80 forward runs it
with every thread of its CTA (kernels/sm80/fwd.py), cp.async only, no TMA: one source for both.

A TMA copy needs a box of whole 8-row swizzle slabs, so pages that are not multiples of 8 rows
(and, as an A/B option, small pages: flash4.config.paged_layout) are gathered row by row instead:
the 128 threads of the producer warpgroup cp.async each key row of a block in 16-byte chunks from
its own page, K[page_table[batch, key // page_size], key % page_size] (FlashAttention-3's
non-TMA paged K/V).

Thread layout (one pass = rows_per_pass rows of the (tile_n, hdim) stage):
  * threads_per_row threads cover the chunk_cols = threads_per_row * 8 columns of a row (8 16-bit
    elements per 16-byte chunk); rows_per_pass = 128 / threads_per_row rows per pass, so thread t
    copies row m * rows_per_pass + t // threads_per_row of pass m, columns (k * threads_per_row +
    t % threads_per_row) * 8 + [0, 8) for every k.
  * Page lookup: each thread reads ONE page-table entry per key block, for its lookup row
    (t % threads_per_row) * rows_per_pass + t // threads_per_row. That is row m * rows_per_pass + g
    for the thread of lane (g * threads_per_row + m) % 32 in the same group of threads_per_row
    lanes, so pass m takes its (page, row in page) by a shuffle from lane m of the group (passes
    <= threads_per_row because tile_n <= 128). One global load per thread per block, issued two K loads
    ahead of the block's own (fwd.py load_paged: its latency hides behind them); V of a block
    reuses the entry of its K.
Rows at or past seqlen_k are not looked up (their entry is (0, 0)). By default (FwdConfig.
gather_zero_fill, flash4.config.GATHER_ZERO_FILL) the producer still writes them: a cp.async with
src-size 0 reads nothing and zero-fills the 16 bytes, so every byte of a stage is written by the
same producer thread on every fill, completion tracked by the same cp.async mbarrier arrive, and no
consumer writes a stage (the consumers' zero_v_tail is not traced; compute-sanitizer racecheck had
flagged its generic stores against the producer's cp.async). K rows past seqlen_k are 0 then, masked
to -inf all the same; V rows are exactly 0, as zero_v_tail made them. With the switch off those rows
are skipped and keep older data, which the consumers never let through (scores masked to -inf by
select, V rows zeroed by zero_v_tail before any P V). The inline cp.async takes a plain shared
address: the stage's swizzle (part of the smem pointer's type, which ptrtoint does not apply) is
applied by apply_swizzle. (The DSL's predicated cp.async copy zero-fills too, src-size 16 / 0, but
with the 64-bit row addresses of a removed candidate the d64 producer, 32 registers, spilled with
it: docs/design/small_pages.md.)
A page index outside [0, num_pages) is clamped into it (garbage in, but no read outside K/V;
check_seqlens=True rejects such tables on the host): in `lookup`, or with clamp_late
(FwdConfig.gather_clamp_late) in `load`, so that the look-ahead read of an entry is not waited for
by the clamp right after it (sm_90a SASS, 2026-12-04: the VIMNMX of the clamp directly after the
entry's LDG, each producer thread stalling on it once per key block).
With ptr_shuffle (FwdConfig.gather_ptr_shuffle) each thread forms the 64-bit address of its own
lookup row (column 0) once per load, and pass m shuffles that address from lane m of the group and
adds the thread's column offset, instead of shuffling (page, row in page) and redoing the row's
64-bit address math in every pass (flash-attn-4's sm90 non-TMA paged K/V, compute_X_ptr, does the
same): the same address, so the same bytes land in the same smem slots.
Completion: every producer thread commits a stage with cp.async.mbarrier.arrive.noinc
(kernels/common/pipeline.cp_async_pipeline_factory).
"""

import math
import re

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from flash4.constants import THREADS_PER_WG

COPY_BITS = 128  # one cp.async: 16 bytes
# fwd.load_paged's loop iteration that loads K[n - 1] and V[n] reads the page-table entries of key
# block n - 1 - ENTRY_AHEAD: the K block of the next iteration (blocks are loaded from the last down).
ENTRY_AHEAD = 1


def load_order(n_block_min: int, n_block_max: int, ahead: int = ENTRY_AHEAD) -> list[tuple[str, int, int]]:
    """The paged producer's loads of one tile as fwd.load_paged issues them: (K or V, key block,
    key block whose page-table entries the load uses). Pure; the CPU test checks that every load
    uses its own block's entries (a look-ahead off by one block read the entries of the block after
    next: wrong pages from the third key block on, found on the H200)."""
    loads = []
    if n_block_max <= n_block_min:
        return loads
    entry_k, entry_next = n_block_max - 1, n_block_max - 2
    loads.append(("K", n_block_max - 1, entry_k))
    for i in range(n_block_max - 1 - n_block_min):
        n_prev = n_block_max - 1 - i
        entry_v, entry_k = entry_k, entry_next
        entry_next = n_prev - 1 - ahead
        loads.append(("K", n_prev - 1, entry_k))
        loads.append(("V", n_prev, entry_v))
    loads.append(("V", n_block_min, entry_k))
    return loads


def gather_layout(hdim: int, hdim_v: int, tile_n: int, elem_bits: int = 16,
                  num_threads: int = THREADS_PER_WG) -> tuple[int, int, int]:
    """(threads_per_row, rows_per_pass, passes) of the gather of a (tile_n, hdim | hdim_v) stage by
    num_threads threads: rows are split into chunks of the widest power-of-two column count that
    divides both head dims, at most one 128-byte swizzle row (pure; CPU-tested)."""
    vec = COPY_BITS // elem_bits
    chunk_cols = math.gcd(hdim, hdim_v, 1024 // elem_bits)
    threads_per_row = chunk_cols // vec
    assert threads_per_row >= 1 and 32 % threads_per_row == 0, (hdim, hdim_v)
    rows_per_pass = num_threads // threads_per_row
    assert tile_n % rows_per_pass == 0 or tile_n < num_threads, (tile_n, rows_per_pass)
    passes = -(-tile_n // rows_per_pass)
    assert passes <= threads_per_row, (tile_n, threads_per_row)  # one lookup row per thread
    return threads_per_row, rows_per_pass, passes


class PagedGather:
    """Trace-time description of the gather of one kernel config (dtype, tile_n, head dims) and its
    switch (FwdConfig.gather_zero_fill), by num_threads threads (the sm90 producer warpgroup's 128;
    the sm80 forward's whole CTA: kernels/sm80/fwd.py)."""

    def __init__(self, dtype, tile_n: int, hdim: int, hdim_v: int, zero_fill: bool = False,
                 num_threads: int = THREADS_PER_WG, clamp_late: bool = False, ptr_shuffle: bool = False):
        self.dtype = dtype
        # FwdConfig.gather_clamp_late: the page index is clamped into [0, num_pages) where `load` uses
        # it, not where `lookup` reads it, so a look-ahead read is not waited for at once.
        self.clamp_late = clamp_late
        # FwdConfig.gather_ptr_shuffle: the passes shuffle each lookup row's 64-bit address (formed once
        # per load by its owner) instead of (page, row in page), whose address math each pass redid.
        self.ptr_shuffle = ptr_shuffle
        self.tile_n = tile_n
        self.vec = COPY_BITS // dtype.width
        self.threads_per_row, self.rows_per_pass, self.passes = gather_layout(hdim, hdim_v, tile_n, dtype.width,
                                                                              num_threads)
        self.zero_fill = zero_fill

    def tiled_copy(self):
        """cp.async (L2 only) of 16-byte chunks, threads row-major over (rows_per_pass, threads_per_row)."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                   num_bits_per_copy=COPY_BITS)
        thr_layout = cute.make_ordered_layout((self.rows_per_pass, self.threads_per_row), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, self.vec)))

    @cute.jit
    def lookup(self, mPageTable: cute.Tensor, batch, n_block, seqlen_k, page_size, num_pages, tidx, in_blocks):
        """(page, row in page) of this thread's lookup row of key block n_block; (0, 0) for a row
        at or past seqlen_k (or past tile_n), or when in_blocks is false (a look-ahead past the
        tile's blocks), whose page-table entry is not read."""
        tpr = self.threads_per_row
        row = (tidx % tpr) * self.rows_per_pass + tidx // tpr
        key = n_block * self.tile_n + row
        page = Int32(0)
        in_page = Int32(0)
        valid = in_blocks & (key < seqlen_k)
        if const_expr(self.tile_n < self.threads_per_row * self.rows_per_pass):  # lookup rows past the block
            valid = valid & (row < self.tile_n)
        if valid:
            col = key // page_size
            in_page = key - col * page_size
            col = cutlass.min(col, mPageTable.shape[1] - 1)
            if const_expr(self.clamp_late):  # the raw entry: `load` clamps it (the read stays in flight)
                page = mPageTable[batch, col]
            else:
                page = cutlass.max(cutlass.min(mPageTable[batch, col], num_pages - 1), 0)
        return page, in_page

    @cute.jit
    def load(self, mX: cute.Tensor, sX: cute.Tensor, head_kv, page: Int32, in_page: Int32, n_block, seqlen_k,
             tidx):
        """cp.async key block n_block of K or V (kernel view (page_size, d, heads_k, num_pages)) into
        the (tile_n, d) smem stage sX. (page, in_page): this thread's lookup entry of the block
        (lookup). Rows >= seqlen_k: skipped, or with zero_fill written as zeros by a cp.async of
        src-size 0 (the same thread writes the same smem bytes on every fill of a stage)."""
        tpr = self.threads_per_row
        if const_expr(self.clamp_late):  # lookup's raw entry, clamped where it is first needed
            page = cutlass.max(cutlass.min(page, mX.shape[3] - 1), 0)
        tiled_copy = self.tiled_copy()
        thr = tiled_copy.get_slice(tidx)
        tXsX = thr.partition_D(sX)  # (CPY, passes, chunks per row per thread)
        group = cute.arch.lane_idx() // tpr * tpr
        col0 = (tidx % tpr) * self.vec
        limit = seqlen_k - n_block * self.tile_n - tidx // tpr  # rows of this thread < limit are keys
        if const_expr(self.zero_fill):
            # The inline cp.async takes a plain shared address: the stage's swizzle (a property of
            # the pointer type) is applied here, once, to this thread's first chunk; the other
            # chunks lie whole swizzle periods away (swizzle_invariant_offset checks it).
            swizzle = pointer_swizzle(sX.iterator)
            # The pointer's swizzle acts on byte addresses: it must move whole 16-byte chunks.
            assert swizzle[0] == 0 or swizzle[1] >= 4, f"stage swizzle {swizzle} splits 16-byte chunks"
            dst_base = apply_swizzle(tXsX[None, 0, 0].iterator.toint(), swizzle)
        own_row = None
        if const_expr(self.ptr_shuffle):
            # the address of this thread's lookup row at column 0 (a row past seqlen_k: entry (0, 0))
            own_row = self.row_pointer(mX, page, in_page, 0, head_kv).toint()
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            is_key = m * self.rows_per_pass < limit
            if const_expr(self.ptr_shuffle):
                row_ptr = self.shuffled_row(own_row, group + m, col0)
            else:
                src_page = cute.arch.shuffle_sync(page, group + m)
                src_row = cute.arch.shuffle_sync(in_page, group + m)
            if const_expr(self.zero_fill):
                # Every row is written: keys copied (16 bytes), rows past seqlen_k zero-filled (src-size
                # 0 reads nothing; their entry is (0, 0), a valid address all the same).
                if const_expr(not self.ptr_shuffle):
                    row_ptr = self.row_pointer(mX, src_page, src_row, col0, head_kv)
                src_bytes = cutlass.select_(is_key, Int32(COPY_BITS // 8), Int32(0))
                for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                    dst_addr = dst_base + swizzle_invariant_offset(tXsX.layout, m, k, self.dtype.width, swizzle)
                    cp_async_zfill(dst_addr, row_ptr + k * tpr * self.vec, src_bytes)
            else:
                if is_key:  # the address math only for rows that are keys
                    if const_expr(self.ptr_shuffle):
                        self.copy_row(tiled_copy, tXsX, m, row_ptr)
                    else:
                        self.copy_row(tiled_copy, tXsX, m, self.row_pointer(mX, src_page, src_row, col0, head_kv))

    @cute.jit
    def copy_row(self, tiled_copy, tXsX: cute.Tensor, m: cutlass.Constexpr[int], row_ptr):
        """cp.async the chunks of this thread's row of pass m from row_ptr (its first column)."""
        for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
            dst = tXsX[None, m, k]
            src_ptr = cute.make_ptr(self.dtype, (row_ptr + k * self.threads_per_row * self.vec).toint(),
                                    cute.AddressSpace.gmem, assumed_align=16)
            cute.copy(tiled_copy, cute.make_tensor(src_ptr, dst.layout), dst)

    @cute.jit
    def shuffled_row(self, own_row, src_lane, col0):
        """Pointer to column col0 of the lookup row owned by lane src_lane (its column-0 address,
        own_row, an Int64 formed once per load by that lane)."""
        addr = cute.arch.shuffle_sync(own_row, src_lane)
        return cute.make_ptr(self.dtype, addr, cute.AddressSpace.gmem, assumed_align=16) + col0

    @staticmethod
    def row_pointer(mX: cute.Tensor, page, in_page, col0, head_kv):
        """Pointer to element (in_page, col0) of head head_kv of page `page` of K or V."""
        return mX.iterator + cute.crd2idx((in_page, col0, head_kv, page), mX.layout)


def pointer_swizzle(ptr) -> tuple[int, int, int]:
    """(BBits, MBase, SShift) of a shared-memory pointer's swizzle, read off its type (e.g.
    !cute.ptr<bf16, smem, align<1024>, S<3,4,3>>: on byte addresses, bits [M, M + B) xor bits
    [M + S, M + S + B)); the K/V stages always have one (asserted)."""
    text = str(ptr.type) if hasattr(ptr, "type") else str(ptr)
    found = re.search(r"S<(\d+),(\d+),(\d+)>", text)
    assert found is not None, f"no swizzle in the smem pointer type {text!r}"  # K/V stages are always swizzled
    return tuple(int(x) for x in found.groups())


def apply_swizzle(addr, swizzle: tuple[int, int, int]):
    """The swizzled shared byte address of addr (Int32): addr ^ ((addr >> S) & (2^B - 1) << M)."""
    bits, base, shift = swizzle
    if bits == 0:
        return addr
    return addr ^ ((addr >> shift) & (((1 << bits) - 1) << base))


def swizzle_invariant_offset(layout, m: int, k: int, elem_bits: int, swizzle: tuple[int, int, int]) -> int:
    """Byte offset of element (0, m, k) of a (CPY, passes, chunks) partition from element (0, 0, 0):
    a static multiple of the swizzle period 2^(M + B + S), so swizzle(base + offset) = swizzle(base) +
    offset (asserted at trace time)."""
    offset = cute.crd2idx((0, m, k), layout) * elem_bits // 8
    bits, base, shift = swizzle
    period = 1 << (base + bits + shift)
    assert isinstance(offset, int) and offset % period == 0, (offset, swizzle)
    return offset


@dsl_user_op
def cp_async_zfill(smem_addr: Int32, gmem_ptr: cute.Pointer, src_bytes: Int32, *, loc=None, ip=None):
    """cp.async.cg (L2 only) of 16 bytes gmem -> smem that reads src_bytes (16 or 0) and zero-fills
    the rest (PTX cp.async's src-size operand): src_bytes 0 writes 16 zero bytes and reads nothing.
    smem_addr: the shared byte address, swizzle applied (ptrtoint of a swizzled pointer does not
    apply it)."""
    llvm.inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), gmem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(src_bytes).ir_value(loc=loc, ip=ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
