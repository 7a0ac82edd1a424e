"""Element-wise access to fp32 register fragments with coordinates built once (issue 24: compile
<= 3 s per config).

`t[r, c]` on a register tensor packs its coordinate (a make_coord op) and checks the tensor on every
access; the sm80 kernels' per-element loops (the backward's P / dS and dQ adds, the forward's
epilogue O * 1 / rowsum) touch each fragment element once or more per traced body. `RegCoords`
packs the static coordinates once per kernel, and `ld` / `st` emit the same cute.memref.load /
store with them: the same IR once canonicalized, so the same cubins (tools/kernel_fingerprint.py
--family sm80).
"""

from typing import NamedTuple

import cutlass._mlir.dialects.cute as _cute_ir
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.core import _pack_coord


class RegCoords(NamedTuple):
    """Packed static coordinates of register fragments read element by element, made once per
    kernel. mn[r][c]: (r, c) of a (rows, cols) view (the backward's S / dP, the forward's O);
    flat[i]: i of a 1-D fragment (LSE, D, dQ, 1 / rowsum)."""

    mn: tuple
    flat: tuple

    @staticmethod
    def make(rows: int, cols: int, flat: int) -> "RegCoords":
        return RegCoords(tuple(tuple(_pack_coord((r, c)) for c in range(cols)) for r in range(rows)),
                         tuple(_pack_coord(i) for i in range(flat)))


def ld(t: cute.Tensor, crd) -> Float32:
    """t[crd] of an fp32 register tensor, crd a RegCoords value."""
    return Float32(_cute_ir.memref_load(t.value, crd))


def st(t: cute.Tensor, crd, v):
    """t[crd] = v (fp32) of an fp32 register tensor, crd a RegCoords value."""
    assert isinstance(v, Float32), type(v)
    _cute_ir.memref_store(t.value, crd, v.ir_value())
