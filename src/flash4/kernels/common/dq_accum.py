"""The dQ accumulator's element order (BwdConfig.dq_accum_order): one source of truth for the main
backward kernel, which stages and reduce-adds dQ tiles in it, and the dQ postprocess, which undoes it.

The dQ wgmma leaves each of the T = 256 consumer threads V = tile_m * headdim / T fp32 values (its
accumulator fragment, in register order v). Row-major staging of that fragment costs 8-way shared-
memory bank conflicts (a warp's 64-bit stores hit 8 rows 256 B apart at d64: H200 ncu, d64 16k
backward, 805M excess store wavefronts, 63% of the gap to flash-attn-4). Accumulator order instead:

    value v of thread t  ->  tile offset (v // 4) * 4T + 4 t + v % 4      (fp32 elements)

so each thread stores 16-byte groups and a warp's 32 stores fill 512 contiguous bytes (no
conflict). The staged tile is one contiguous block of tile_m * headdim floats, reduce-added as a
whole onto the accumulator's tile (same order in global memory); the postprocess reads it back with
the same tiled MMA's coordinates (flash-attn-4's sm90 backward does the same, "dQ_accum" + its
postprocess).

Per-warpgroup halves (BwdConfig.dq_handoff_per_wg, a speed switch): warpgroup w = t // 128 owns
the contiguous block [w * 128 V, (w + 1) * 128 V) of the tile, in accumulator order among its own
128 threads,

    value v of thread t  ->  tile offset (t // 128) * 128 V + (v // 4) * 512 + 4 (t % 128) + v % 4

so each warpgroup's half is handed to the store warp and reduce-added on its own.
"""

from functools import partial

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode

from flash4.constants import THREADS_PER_WG

GROUP = 4  # fp32 values per 16-byte group


def make_dq_tiled_mma(dtype, tile_m: int, headdim: int, num_wg: int = 2):
    """The dQ = dS K tiled MMA of the backward's keys-major configs (kernels/sm90/bwd.py `mma`):
    (tile_m queries) x headdim, A = dS (from the staged dS^T), B = K^T, both MN-major. 128 queries
    (= 64 * num_wg): the queries split over the warpgroups (N = headdim); else head-dim halves
    (N = headdim / 2)."""
    MN = OperandMajorMode.MN
    make = partial(sm90_utils.make_trivial_tiled_mma, dtype, dtype)
    if tile_m == 64 * num_wg:
        # Halving headdim instead (N = 32 at d64) would make the SS wgmma read more smem per FLOP
        # than the tensor cores use.
        return make(MN, MN, Float32, (num_wg, 1, 1), (64, headdim))
    return make(MN, MN, Float32, (1, num_wg, 1), (64, headdim // 2))


def accum_order_view(tile_ptr: cute.Pointer, num_values: int, num_threads: int) -> cute.Tensor:
    """(GROUP, thread, group) view of a contiguous fp32 tile in accumulator order: [None, t, g] is
    thread t's values 4g .. 4g + 3 (16 bytes; tile_ptr 16-byte aligned)."""
    layout = cute.make_layout((GROUP, num_threads, num_values // GROUP), stride=(1, GROUP, GROUP * num_threads))
    return cute.make_tensor(tile_ptr, layout)


@cute.jit
def store_accum_order(acc: cute.Tensor, tile_ptr: cute.Pointer, tidx: cutlass.Int32,
                      num_threads: cutlass.Constexpr[int]):
    """Store this thread's fp32 fragment `acc` (V values, register order) into the staged tile at
    tile_ptr in accumulator order: V / 4 conflict-free 16-byte stores."""
    num_values = cute.size(acc)
    view = accum_order_view(tile_ptr, num_values, num_threads)
    groups = cute.logical_divide(cute.make_tensor(acc.iterator, cute.make_layout(num_values)),
                                 cute.make_layout(GROUP))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    for g in cutlass.range_constexpr(num_values // GROUP):
        cute.copy(atom, groups[None, g], view[None, tidx, g])


def accum_order_wg_layout(num_values: int, num_wg: int) -> cute.Layout:
    """(GROUP, thread in warpgroup, group, warpgroup) -> tile offset of the per-warpgroup accumulator
    order (module docstring): [e, t % 128, g, t // 128] is thread t's value 4g + e; warpgroup w's
    values fill the block [w * 128 * num_values, (w + 1) * 128 * num_values)."""
    return cute.make_layout((GROUP, THREADS_PER_WG, num_values // GROUP, num_wg),
                            stride=(1, GROUP, GROUP * THREADS_PER_WG, THREADS_PER_WG * num_values))


def accum_order_wg_view(tile_ptr: cute.Pointer, num_values: int, num_wg: int) -> cute.Tensor:
    """accum_order_wg_layout over a contiguous fp32 tile at tile_ptr (16-byte aligned): [None, t % 128,
    g, t // 128] is thread t's 16-byte group g."""
    return cute.make_tensor(tile_ptr, accum_order_wg_layout(num_values, num_wg))


@cute.jit
def store_accum_order_wg(acc: cute.Tensor, tile_ptr: cute.Pointer, tidx: cutlass.Int32, num_wg: cutlass.Constexpr[int]):
    """store_accum_order in per-warpgroup halves (accum_order_wg_view): V / 4 conflict-free 16-byte
    stores into this thread's warpgroup's block."""
    num_values = cute.size(acc)
    view = accum_order_wg_view(tile_ptr, num_values, num_wg)
    groups = cute.logical_divide(cute.make_tensor(acc.iterator, cute.make_layout(num_values)),
                                 cute.make_layout(GROUP))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    t, wg = tidx % THREADS_PER_WG, tidx // THREADS_PER_WG
    for g in cutlass.range_constexpr(num_values // GROUP):
        cute.copy(atom, groups[None, g], view[None, t, g, wg])
