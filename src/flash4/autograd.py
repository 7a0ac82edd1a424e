"""The one autograd path of flash_attn_func and flash_attn_varlen_func, eager and torch.compile alike.

    attention(request) -> (out, lse)      the doors' forward of a DENSE / VARLEN / PAGED request

FlashAttnFunction.apply(varlen, request, *args): args are flash4::fwd's (varlen False) or
flash4::varlen_fwd's arguments (flash4.ops.forward_args); request is the validated
flash4.request.Request in eager mode and None while torch.compile traces (Dynamo traces this
Function). Its forward runs flash4.forward.run(request) in eager mode and the op under
torch.compile (the op checks its arguments when the compiled graph runs); its backward runs the
backward ops' implementations (flash4.ops.dense_backward / varlen_backward -> flash4.backward.run)
in eager mode and the ops flash4::bwd / flash4::varlen_bwd under torch.compile. Calls that need no
gradient skip the Function (eager: flash4.forward.run; compile: the op).

The formula is written once (_save, _grads) and is also registered as the autograd of
flash4::fwd / flash4::varlen_fwd (for callers of the ops themselves):
  * saved: q, k, v, out, lse, the log2-domain LSE split and the sequence metadata (O(N) memory);
    the backward recomputes P from them (FlashAttention-2, section 3.1.2);
  * lse is differentiable: a loss that uses it (ring-attention merges, z-loss) adds dLSE to the
    backward, where dS = P * (dP - D) gains P * dLSE, i.e. D becomes D - dLSE (flash4.backward).
    Gradients are not materialized, so an unused lse (or out) costs nothing;
  * learnable_sink's gradient is sink_grad's (in torch, from lse, dlse and each row's D, which the
    backward kernel sums in fp32 from P and dP when the sink needs a gradient: the backward op's
    `sink_delta` and 4th output, flash4.backward.run's delta);
  * paged K/V (page_table) run the forward; their backward raises PAGED_BACKWARD_ERROR;
  * max_seqlen_k given as a tensor or None is resolved when the backward runs (eager: from the
    tensor; under torch.compile the op computes it from the metadata);
  * double backward is not supported: the gradients the backward returns carry a node that raises
    a RuntimeError saying so when something differentiates through them (`create_graph=True`
    followed by a backward through dq/dk/dv), instead of silently acting as constants.
"""

from __future__ import annotations

import torch

from flash4 import forward, ops
from flash4.request import Request

DOUBLE_BACKWARD_ERROR = (
    "flash4: double backward is not supported (a gradient of flash4's dq/dk/dv was requested, e.g. "
    "torch.autograd.grad(..., create_graph=True) followed by a backward through those gradients); "
    "compute that term with another attention implementation (e.g. torch SDPA's math backend)"
)

# Where flash4::varlen_fwd takes max_seqlen_q (the backward's only use of it: the empty case).
_MAX_SEQLEN_Q = ops.FORWARD_ARGS[1].index("max_seqlen_q")

PAGED_BACKWARD_ERROR = (
    "flash4: flash_attn_varlen_func has no backward for a paged K/V cache (page_table given); run paged "
    "attention under torch.no_grad() / torch.inference_mode(), or train with packed k/v and cu_seqlens_k"
)


def attention(request: Request):
    """(out, lse) of a DENSE, VARLEN or PAGED request, both differentiable when autograd records
    (grad mode on and q, k, v or learnable_sink requiring grad): through FlashAttnFunction then, or
    while torch.compile traces (the forward op); else flash4.forward.run directly (no autograd
    overhead). Under torch.compile the request is the unchecked one (flash4.request.Request)."""
    compiling = torch.compiler.is_compiling()
    if needs_grad(request):
        varlen, args = ops.forward_args(request)
        args, same = _unique_tensors(args)
        return FlashAttnFunction.apply(varlen, None if compiling else request, same, *args)
    if compiling:
        varlen, args = ops.forward_args(request)
        out, lse, _ = (torch.ops.flash4.varlen_fwd if varlen else torch.ops.flash4.fwd)(*args)
        return out, lse
    return forward.run(request)


def needs_grad(request: Request) -> bool:
    """Autograd records this call: grad mode on and q, k, v or learnable_sink requiring grad."""
    tensors = (request.q, request.k, request.v, request.score.sink)
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _unique_tensors(args):
    """(args, same): args with every tensor that is already an earlier argument (the same object:
    flash_attn_func(x, x, x), or one cu_seqlens for q and k) replaced by None, and the (position,
    earlier position) pairs of those (torch.compile's Dynamo refuses an autograd.Function that gets
    one tensor as two inputs). FlashAttnFunction puts them back and adds their gradients together."""
    same, seen = [], []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            first = next((j for j in seen if args[j] is arg), None)
            if first is None:
                seen.append(i)
            else:
                same.append((i, first))
    if not same:
        return args, ()
    args = list(args)
    for i, _ in same:
        args[i] = None
    return tuple(args), tuple(same)


class FlashAttnFunction(torch.autograd.Function):
    """apply(varlen: bool, request: Request | None, same, *args) -> (out, lse): the one autograd
    path (module docstring). args: flash4::fwd's or flash4::varlen_fwd's arguments, with repeated
    tensors as None and `same` the (position, earlier position) pairs to restore (_unique_tensors);
    request: the validated request (eager) or None (torch.compile: the ops run)."""

    @staticmethod
    def forward(ctx, varlen, request, same, *args):
        if same:
            args = list(args)
            for i, first in same:
                args[i] = args[first]
            args = tuple(args)
        ctx.same = same
        if request is None:
            out, lse, lse_split = (torch.ops.flash4.varlen_fwd if varlen else torch.ops.flash4.fwd)(*args)
            max_seqlen_q = args[_MAX_SEQLEN_Q] if varlen else None
        else:
            lse_split = forward.new_lse_split(request)
            out, lse = forward.run(request, lse_split=lse_split)
            max_seqlen_q = request.seq.max_seqlen_q  # resolved by validate: the backward needs no sync for it
        _save(ctx, varlen, args, (out, lse, lse_split), max_seqlen_q, use_ops=request is None)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        needs = list(ctx.needs_input_grad[3:])
        for i, first in ctx.same:  # a repeated tensor needs its gradient where its first occurrence does
            needs[i] = needs[first]
        grads = list(_grads(ctx, dout, dlse, needs))
        for i, first in ctx.same:  # one input: the sum of its occurrences' gradients
            if grads[i] is not None:
                grads[first] = grads[i] if grads[first] is None else grads[first] + grads[i]
            grads[i] = None
        return (None, None, None) + tuple(grads)


# ================================================================ the formula
# What the backward keeps of a forward call, by name: the backward op's arguments that the forward
# op or its outputs provide, and the sink (its gradient is computed here), per `varlen`.
_KEPT = tuple(tuple(n for n in ops.BACKWARD_ARGS[varlen] if n in ops.FORWARD_ARGS[varlen] + ("out", "lse", "lse_split"))
              + ("learnable_sink",) for varlen in (False, True))


def _save(ctx, varlen: bool, args, outputs, max_seqlen_q, use_ops: bool) -> None:
    """What the backward needs, by the backward op's argument names: the tensors through
    save_for_backward, the rest (scalars, None) on ctx. use_ops: the backward calls the ops (under
    torch.compile, and for the ops' own autograd) instead of their implementations."""
    varlen = int(varlen)  # an index (torch 2.11's Dynamo refuses a bool as a tuple index)
    named = dict(zip(ops.FORWARD_ARGS[varlen], args))
    ctx.varlen, ctx.use_ops, ctx.num_args = varlen, use_ops, len(args)
    ctx.paged = named.get("page_table") is not None
    ctx.set_materialize_grads(False)  # dout / dlse arrive as None when unused
    if ctx.paged:
        return  # no backward: nothing to save
    if varlen:
        named["max_seqlen_q"] = max_seqlen_q
    named["out"], named["lse"], named["lse_split"] = outputs
    tensors, values = [], {}
    for name in _KEPT[varlen]:
        if isinstance(named[name], torch.Tensor):
            tensors.append(name)
        else:
            values[name] = named[name]
    ctx.tensor_names, ctx.values = tuple(tensors), values
    ctx.save_for_backward(*(named[n] for n in tensors))


def _grads(ctx, dout, dlse, needs) -> tuple:
    """The gradient of every forward-op argument (None but for q, k, v and learnable_sink, the last)."""
    if ctx.paged:
        raise RuntimeError(PAGED_BACKWARD_ERROR)
    named = dict(zip(ctx.tensor_names, ctx.saved_tensors))
    named.update(ctx.values)
    q, k, v, out, lse, sink = (named[n] for n in ("q", "k", "v", "out", "lse", "learnable_sink"))
    if dout is None:  # only lse is used by the loss
        dout = torch.zeros_like(out)
    sink_needed = sink is not None and needs[-1]
    # sink_delta: the op also returns each row's D in fp32, from the kernel's P and dP
    named["dout"], named["dlse"], named["sink_delta"] = dout, dlse, sink_needed
    args = tuple(named[n] for n in ops.BACKWARD_ARGS[ctx.varlen])
    dq, dk, dv, delta = (ops.BACKWARD_OPS if ctx.use_ops else ops.BACKWARD_IMPLS)[ctx.varlen](*args)
    dsink = None
    if sink_needed:
        if ctx.varlen:
            rows = varlen_row_mask(named["cu_seqlens_q"], named["seqused_q"], q.shape[0])
            dsink = sink_grad(sink, out, dout, lse, dlse, 1, rows, delta=delta)
        else:
            dsink = sink_grad(sink, out, dout, lse, dlse, 2, delta=delta)
    grads = no_double_backward((dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, dsink),
                               (q, k, v, dout, dlse))
    return grads[:3] + (None,) * (ctx.num_args - 4) + grads[3:]


def _op_setup_context(varlen: bool):
    def setup_context(ctx, inputs, output):
        max_seqlen_q = inputs[_MAX_SEQLEN_Q] if varlen else None
        _save(ctx, varlen, inputs, output, max_seqlen_q, use_ops=True)
        ctx.mark_non_differentiable(output[2])  # lse_split

    return setup_context


def _op_backward(ctx, dout, dlse, dlse_split):
    return _grads(ctx, dout, dlse, ctx.needs_input_grad)


torch.library.register_autograd("flash4::fwd", _op_backward, setup_context=_op_setup_context(False))
torch.library.register_autograd("flash4::varlen_fwd", _op_backward, setup_context=_op_setup_context(True))


# ================================================================ pieces of the formula
class _DoubleBackwardError(torch.autograd.Function):
    """apply(n, *grads, *inputs) -> views of grads that depend on `inputs` in the graph; their
    backward raises DOUBLE_BACKWARD_ERROR."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(g.view_as(g) for g in tensors[:n])

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def no_double_backward(grads, inputs):
    """Return `grads` (a tuple, None entries allowed) unchanged, except that when autograd is
    recording (the backward runs under create_graph=True) they are tied to `inputs` (the tensors
    the true gradients depend on: q, k, v, dout, ...) through a node whose backward raises
    DOUBLE_BACKWARD_ERROR. Without that node the gradients would silently act as constants."""
    grads = tuple(grads)
    present = [g for g in grads if g is not None]
    linked = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not torch.is_grad_enabled() or not present or not linked:
        return grads
    wrapped = iter(_DoubleBackwardError.apply(len(present), *present, *linked))
    return tuple(None if g is None else next(wrapped) for g in grads)


def sink_grad(learnable_sink, out, dout, lse, dlse, heads_dim: int, row_mask=None, delta=None):
    """d loss / d learnable_sink (attention sinks, gpt-oss), in torch: the sink s_h is one more logit
    of every row's softmax with no value, so with P_sink = exp(s_h - LSE) (the LSE includes the sink)
        dsink_h = sum over rows of P_sink * (dLSE - D),   D = rowsum(dout * out) (fp32),
    dLSE = 0 when lse is unused. The kernels' dq/dk/dv need no change (P from the sink-including LSE).

    Dense: out/dout (B, Sq, H, D), lse/dlse (B, H, Sq), heads_dim=2. Varlen: out/dout (T, H, D),
    lse/dlse (H, T), heads_dim=1, row_mask None or a (T,) bool of the rows inside a sequence (rows
    outside are excluded whatever their lse). delta: None, or D itself in lse's shape (fp32): the
    backward kernel's sum_j P_ij dP_ij (flash4.backward.run's delta), which is rowsum(dout * out) of
    the float32 output; without it D comes from `out`, whose 16-bit rounding puts dsink a few ulps
    of its dtype off the float32 reference (docs/conformance/fa4-suite.md, dSink). Returns a (H,)
    tensor of learnable_sink's dtype."""
    if delta is None:
        delta = (dout.float() * out.float()).sum(-1)  # (B, Sq, H) or (T, H)
        delta = delta.transpose(-1, -2)  # (B, H, Sq) or (H, T), as lse
    shape = [1] * lse.dim()
    shape[lse.dim() - 2] = -1
    p_sink = torch.exp(learnable_sink.float().view(shape) - lse)
    grad = -delta if dlse is None else dlse.float() - delta
    terms = p_sink * grad
    if row_mask is not None:
        terms = torch.where(row_mask, terms, torch.zeros((), dtype=terms.dtype, device=terms.device))
    dims = [d for d in range(terms.dim()) if d != lse.dim() - 2]
    return terms.sum(dims).to(learnable_sink.dtype)


def varlen_row_mask(cu_seqlens_q, seqused_q, total_q: int):
    """(total_q,) bool: the packed query rows inside a sequence (row < cu_seqlens_q[b] + len_b, len_b
    seqused_q[b] or the stored length); on the device, no host sync."""
    batch = cu_seqlens_q.numel() - 1
    rows = torch.arange(total_q, device=cu_seqlens_q.device)
    if batch <= 0:
        return torch.zeros(total_q, dtype=torch.bool, device=cu_seqlens_q.device)
    cu = cu_seqlens_q.long()
    b = torch.searchsorted(cu[1:], rows, right=True)
    inside = b < batch
    b = b.clamp(max=batch - 1)
    start = cu[b]
    length = (cu[1:] - cu[:-1])[b] if seqused_q is None else seqused_q.long()[b]
    return inside & (rows >= start) & (rows - start < length)
