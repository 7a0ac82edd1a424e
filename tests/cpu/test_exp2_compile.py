"""Compile-only (CPU) check of the device exp2 helpers for sm_90a: a kernel loads a register
fragment from global memory, applies `exp2_fragment_mixed`, stores it; the PTX must hold exactly
the expected number of MUFU (ex2.approx) and polynomial (add.rm + 3 fma.rn) sequences."""

import math
import os
import sys
from pathlib import Path

# Before the DSL is imported (compile() below also names the arch, in case it already was).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402
from cutlass.cutlass_dsl import CuTeDSL  # noqa: E402

try:
    import flash4  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from flash4.kernels.common.exp2 import exp2_fragment_mixed  # noqa: E402
from flash4.kernels.common.exp2_poly import EXP2_POLY_DEGREE  # noqa: E402

THREADS = 128


@pytest.fixture
def ptx_dump_dir(tmp_path, monkeypatch):
    """--keep-ptx writes into the DSL's dump dir (the cwd at import by default): use tmp_path."""
    monkeypatch.setattr(CuTeDSL._get_dsl().envar, "dump_dir", str(tmp_path))
    return tmp_path


def _size(shape) -> int:
    """Number of elements of a (nested) shape tuple, outside any DSL context."""
    return math.prod(_size(s) for s in shape) if isinstance(shape, tuple) else shape


def _compile_ptx(frag_shape, emu_frac: float, group: int) -> str:
    n = _size(frag_shape)

    @cute.kernel
    def kernel(g_in: cute.Tensor, g_out: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        frag = cute.make_rmem_tensor(frag_shape, Float32)  # e.g. ((2, 2, 8), 1, 1) like a wgmma acc
        for i in cutlass.range_constexpr(n):
            frag[i] = g_in[i, tid]
        exp2_fragment_mixed(frag, emu_frac, group)
        for i in cutlass.range_constexpr(n):
            g_out[i, tid] = frag[i]

    @cute.jit
    def host(g_in: cute.Tensor, g_out: cute.Tensor):
        kernel(g_in, g_out).launch(grid=(1, 1, 1), block=(THREADS, 1, 1))

    g_in = make_fake_compact_tensor(Float32, (n, THREADS))  # (elements, threads)
    g_out = make_fake_compact_tensor(Float32, (n, THREADS))
    compiled = cute.compile(host, g_in, g_out, options="--gpu-arch sm_90a --keep-ptx")
    ptx = compiled.__ptx__  # the PTX text, or the path it was dumped to
    return Path(ptx).read_text() if os.path.isfile(ptx) else ptx


@pytest.mark.parametrize(
    "frag_shape, emu_frac, group, n_emu",
    [
        ((32,), 0.25, 1, 8),  # one row of the (rows, cols) view, 1 of every 4 on the FMA units
        (((2, 2, 8), 1, 1), 0.5, 4, 16),  # a whole m64n64 wgmma accumulator, per 8-column block
        ((16,), 0.0, 1, 0),  # all MUFU
        ((16,), 1.0, 1, 16),  # all polynomial
    ],
)
def test_exp2_fragment_mixed_compiles_sm90(frag_shape, emu_frac, group, n_emu, ptx_dump_dir):
    ptx = _compile_ptx(frag_shape, emu_frac, group)
    n = _size(frag_shape)
    assert ".target sm_90a" in ptx
    assert ptx.count("ex2.approx.ftz.f32") == n - n_emu
    assert ptx.count("add.rm.f32") == n_emu  # the Cody-Waite round-down, once per emulated element
    assert ptx.count("fma.rn.f32") == EXP2_POLY_DEGREE * n_emu


def _compile_pair_ptx(n: int, emu_frac: float) -> str:
    """sm_100a: n elements per thread, pairs (2j, 2j + 1) through exp2_emulated_pair where the sm100
    rule (exp2_poly.emulated_column, groups of 2) picks them, else exp2_hw twice."""
    from flash4.kernels.common.exp2 import exp2_emulated_pair, exp2_hw
    from flash4.kernels.common.exp2_poly import emulated_column

    @cute.kernel
    def kernel(g_in: cute.Tensor, g_out: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        frag = cute.make_rmem_tensor((n,), Float32)
        for i in cutlass.range_constexpr(n):
            frag[i] = g_in[i, tid]
        for j in cutlass.range_constexpr(0, n, 2):
            if cutlass.const_expr(emulated_column(j, emu_frac, 2)):
                frag[j], frag[j + 1] = exp2_emulated_pair(frag[j], frag[j + 1])
            else:
                frag[j], frag[j + 1] = exp2_hw(frag[j]), exp2_hw(frag[j + 1])
        for i in cutlass.range_constexpr(n):
            g_out[i, tid] = frag[i]

    @cute.jit
    def host(g_in: cute.Tensor, g_out: cute.Tensor):
        kernel(g_in, g_out).launch(grid=(1, 1, 1), block=(THREADS, 1, 1))

    g_in = make_fake_compact_tensor(Float32, (n, THREADS))
    g_out = make_fake_compact_tensor(Float32, (n, THREADS))
    compiled = cute.compile(host, g_in, g_out, options="--gpu-arch sm_100a --keep-ptx")
    ptx = compiled.__ptx__
    return Path(ptx).read_text() if os.path.isfile(ptx) else ptx


@pytest.mark.parametrize("emu_frac, pairs_emu", [(0.25, 4), (0.125, 2), (1.0, 16), (0.0, 0)])
def test_exp2_emulated_pair_compiles_sm100(emu_frac, pairs_emu, ptx_dump_dir):
    """The sm100 softmax's packed polynomial: per emulated pair one add.rm.f32x2 (the round-down),
    one add.rn and one sub.rn .f32x2, EXP2_POLY_DEGREE fma.rn.f32x2; MUFU for the other pairs."""
    n = 32
    ptx = _compile_pair_ptx(n, emu_frac)
    assert ".target sm_100a" in ptx
    assert ptx.count("ex2.approx.ftz.f32") == n - 2 * pairs_emu
    assert ptx.count("add.rm.f32x2") == pairs_emu
    assert ptx.count("sub.rn.f32x2") == pairs_emu
    assert ptx.count("fma.rn.f32x2") == EXP2_POLY_DEGREE * pairs_emu
    assert ptx.count("add.rm.f32 ") + ptx.count("fma.rn.f32 ") == 0  # nothing scalar on the FMA pipe
