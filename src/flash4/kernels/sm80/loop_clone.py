"""Trace a loop body once, emit it twice (issue 24: compile <= 3 s per config).

The backward walks a key tile's query tiles in two loops with the same body but for the score
mask: the tiles crossing the diagonal / seqlen_k (masked), then the full ones (unmasked). Tracing
that body (`one_m_block`: five k-pipelined GEMMs, P, dS, the dQ adds) is most of the backward's
trace time, and tracing it a second time only to leave the mask out repeats the same Python work
for the same IR. The causal / windowed forward likewise walks its key blocks crossing the diagonal
(masked), then the unmasked ones (`one_n_block`: Q K^T, the online softmax, P V), both downwards
from a first key block computed outside the loop. `clone_without` makes the second loop instead
from the first: it clones the first loop's scf.for op, gives it the second loop's bounds and
initial value, erases from the clone's body the ops the mask call emitted (recorded with
`traced_span` around that call), and (`remap`, the forward's first key block) replaces the uses of
an outer value in the clone's body by another. The result is the op sequence tracing the second
loop would emit, so the cubins are the same (checked with tools/kernel_fingerprint.py --family
sm80, byte for byte).

Pure, operand-free ops the mask emitted that later code of the body reuses (the DSL caches
constants per insertion point) are kept; any other value of the mask's used after it, a loop
shape other than one scf.for with one carried value before the insertion point, or a span not in
that loop's body makes `clone_without` return None, and the caller traces the loop. Between the
loop and the clone's place only region-free ops may lie (the second loop's bounds, computed where
the traced code computes them: the forward computing them before the first loop instead changed
two cubins, its window and split-KV configs).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from cutlass._mlir import ir


# Region-free ops (the next loop's bounds) allowed between the loop and the clone's place.
MAX_OPS_AFTER = 32


class Span(NamedTuple):
    """Ops [start, end) of `block` (operation indices), emitted by one call while tracing."""

    block: object
    start: int
    end: int


def traced_span(fn, *args, **kwargs) -> Optional[Span]:
    """Call fn(*args, **kwargs) while tracing, under an insertion point of its own at the end of
    the current block (the same place: the DSL caches constants per insertion point, so none that
    fn makes is reused by the code after it), and return the span of ops it emitted; None (fn
    traced as usual) where the current insertion point is not at a block's end."""
    ip = ir.InsertionPoint.current
    if ip.ref_operation is not None:
        fn(*args, **kwargs)
        return None
    block = ip.block
    start = len(block.operations)
    with ir.InsertionPoint(block):
        fn(*args, **kwargs)
    return Span(block, start, len(block.operations))


def _raw(v) -> Optional[ir.Value]:
    """The ir.Value of an op result (the DSL's value casters hand cute types back wrapped, e.g. a
    memref as a cute Tensor holding it in .value); None if it is not found that way."""
    if isinstance(v, ir.Value):
        return v
    inner = getattr(v, "value", None)
    return inner if isinstance(inner, ir.Value) else None


def _same(a, b) -> bool:
    """a and b are the same ir.Value (ir.Value's own equality: the DSL's arithmetic values
    overload == to build a comparison op)."""
    return a is not None and b is not None and ir.Value.__eq__(a, b)


def _top_level(op, block):
    """(the ancestor of op, or op, that lies directly in `block`, else None; op's root op)."""
    top = None
    while True:
        op = op.operation  # (an OpView where the bindings know the op's class)
        if top is None and op.block == block:
            top = op
        parent = op.parent
        if parent is None:
            return top, op
        op = parent


def _removable(body_ops: list, sp: Span) -> Optional[set]:
    """Indices in the span to erase: all but the operand-free, region-free ops whose results are
    used after the span (cached constants); None if another span value is used outside it. The
    DSL's value casters build ops when handed a result (a cute Tensor's get_iter): they go to a
    scratch module, whose uses are not counted, and which is dropped afterwards."""
    first = body_ops[sp.start]
    after = body_ops[sp.end] if sp.end < len(body_ops) else None
    scratch = ir.Module.create()
    erase = set()
    with ir.InsertionPoint(scratch.body):
        for i in range(sp.start, sp.end):
            op = body_ops[i]
            used_outside = False
            for res in op.results:
                res = _raw(res)
                if res is None:
                    return None
                for use in res.uses:
                    top, root = _top_level(use.owner, sp.block)
                    if root == scratch.operation:
                        continue
                    inside = (top is not None and not top.is_before_in_block(first)
                              and (after is None or top.is_before_in_block(after)))
                    used_outside |= not inside
            if not used_outside:
                erase.add(i)
            elif len(op.operands) or len(op.regions):
                return None
    return erase


def _replace_uses(root, old: ir.Value, new: ir.Value):
    """Every use of `old` by an op nested in op `root` becomes a use of `new`."""
    hits = []
    for use in old.uses:
        op = use.owner.operation
        parent = op.parent
        while parent is not None and parent != root:
            parent = parent.parent
        if parent is not None:
            hits.append((op, use.operand_number))
    for op, i in hits:
        op.operands[i] = new


def clone_without(sp: Optional[Span], init, lower, upper, remap=()):
    """The scf.for whose body holds span sp, cloned at the current insertion point with bounds
    [lower, upper) (lower None: the loop's own) and carried value init (ir.Values), the span's ops
    erased from the clone's body, and in it every use of a value `old` defined outside the loop
    replaced by `new`, for each (old, new) pair of remap (the forward's first key block of the
    loop: its key blocks run downwards from it). Returns the clone's result (ir.Value), or None
    where this does not apply (see the module docstring): then trace the loop."""
    if sp is None:
        return None
    loop = sp.block.owner
    loop = loop.operation if loop is not None else None
    if loop is None or loop.name != "scf.for" or len(loop.results) != 1 or len(loop.operands) != 4:
        return None
    block = ir.InsertionPoint.current.block
    ops = block.operations
    last = len(ops) - 1
    while last >= 0 and ops[last] != loop and len(ops[last].regions) == 0 and len(ops) - last <= MAX_OPS_AFTER:
        last -= 1  # (the clone's bounds, computed after the loop)
    if last < 0 or ops[last] != loop or not _same(init, _raw(loop.results[0])):
        return None
    body_ops = list(sp.block.operations)
    if not 0 <= sp.start <= sp.end < len(body_ops):
        return None
    erase = _removable(body_ops, sp)
    if erase is None:
        return None
    clone = loop.clone()
    for i, v in ((0, lower), (1, upper), (3, init)):
        if v is not None:
            clone.operands[i] = v
    clone_body = list(clone.regions[0].blocks[0].operations)
    for i in sorted(erase, reverse=True):
        clone_body[i].erase()
    for old, new in remap:
        _replace_uses(clone, old, new)
    return _raw(clone.results[0])  # (scf.for's i32 result: an ir.Value)
