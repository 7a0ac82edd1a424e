"""Keep register values computed ahead of an instruction that ptxas would otherwise hoist above them
(pin_ahead), and keep a load where the source issues it (keep_here).

ptxas schedules a wgmma wait (WARPGROUP.DEPBAR) as early as it can and moves independent arithmetic
(MUFU, FFMA) across it, named barriers and wgmma fences included. A store is not moved across the
wait, so a store of the values pins their computation ahead of it. The stores here are predicated
off by a run-time flag ptxas cannot see through (never true): they cost one issue slot per 16
bytes and write nothing.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def _store_if_negative(smem_addr, a, b, c, d, flag, *, loc=None, ip=None):
    """st.shared.v4.b32 [smem_addr], {a, b, c, d} predicated on flag < 0 (i32 IR values)."""
    llvm.inline_asm(
        None,
        [smem_addr, a, b, c, d, flag],
        "{\n.reg .pred p;\nsetp.lt.s32 p, $5, 0;\n@p st.shared.v4.b32 [$0], {$1, $2, $3, $4};\n}",
        "r,r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def pin_ahead(regs: cute.Tensor, never_negative: Int32, smem_ptr: cute.Pointer):
    """Predicated-off 16-byte shared stores of every 32-bit word of regs (a register tensor of 32-bit
    values, size a multiple of 4) at smem_ptr (16-byte aligned): never executed when
    never_negative >= 0 at run time (e.g. a sequence length), but every value of regs is computed
    before them, hence before what follows them in program order that ptxas does not move stores
    across (a wgmma wait)."""
    words = cute.recast_tensor(regs, Int32)
    addr = smem_ptr.toint().ir_value()
    flag = Int32(never_negative).ir_value()
    for i in cutlass.range_constexpr(cute.size(words) // 4):
        _store_if_negative(addr, words[4 * i].ir_value(), words[4 * i + 1].ir_value(), words[4 * i + 2].ir_value(),
                           words[4 * i + 3].ir_value(), flag)


@dsl_user_op
def keep_here(x: Float32, *, loc=None, ip=None) -> Float32:
    """x through an inline-asm mov marked as having side effects: the compiler's IR passes may not
    sink what produces x (a global load) below this point, e.g. into the one branch that reads it
    (LLVM's sinking put the sm80 backward's per-step LSE loads after the S and dP GEMMs, into the
    common branch of the exact-path vote, so each step waited on them there). In SASS the mov
    vanishes; the load stays where the source issues it."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;",
                                   "=f,f", has_side_effects=True, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def keep_here_i32(x: Int32, *, loc=None, ip=None) -> Int32:
    """keep_here for a 32-bit integer word (e.g. two packed 16-bit values of P)."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;",
                                 "=r,r", has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
