"""Zero-filling the smem rows of a tile that lie past a sequence, traced once per tile load
instead of once per row.

`dst.fill(0)` on a shared-memory tensor traces a scalar loop: it builds a register tensor, writes
its elements one by one (several DSL calls each: coordinate packing, a memref store) and copies it
out (cute.autovec_copy). `zeros_like` builds that register tensor once per load; each row past the
sequence then costs one autovec_copy. The cubins are byte-identical
(tools/kernel_fingerprint.py --family sm80).

Tried and not kept (docs/design/sm80_family.md, "Compile sweep"): whole-row TensorSSA forms of the
register-fragment arithmetic (the epilogue's O * 1 / rowsum, OnlineSoftmax.rescale_O, the
softmax's exponent fma, the score mask's compare + select), as vector ops or as scalar ops on
vector.extract'ed elements: cheaper to trace, but the backend then schedules (and for d128 causal
on sm_80 spills) differently, so the SASS changes.
"""

import cutlass.cute as cute


def zeros_like(t: cute.Tensor) -> cute.Tensor:
    """A register tensor of t's shape and element type, all zero: built once, then copied
    (`cute.autovec_copy(zeros, dst)`) wherever a tensor shaped like t is to be zeroed, as
    `dst.fill(0)` does for an smem dst after its scalar loop."""
    zeros = cute.make_rmem_tensor_like(t, dtype=t.element_type)
    zeros.fill(0)
    return zeros
