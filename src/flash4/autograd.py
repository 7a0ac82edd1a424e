"""torch.autograd.Function for flash4 attention: forward and backward kernels.

The public function only goes through this Function when autograd is recording (grad mode on and
an input requiring grad); inference calls skip its overhead. lse is differentiable: a loss that
uses it (ring-attention merges, z-loss) adds dLSE to the backward, where dS = P * (dP - D) gains
P * dLSE, i.e. D becomes D - dLSE (flash4.backward). Gradients are not materialized, so an unused
lse (or out) costs nothing.

Double backward is not supported: the gradients the backward returns carry a node that raises a
RuntimeError saying so when something differentiates through them (`create_graph=True` followed
by a backward through dq/dk/dv), instead of silently acting as constants. Every flash4 autograd
entry point returns its gradients through `no_double_backward`.
"""

from __future__ import annotations

import torch

DOUBLE_BACKWARD_ERROR = (
    "flash4: double backward is not supported (a gradient of flash4's dq/dk/dv was requested, e.g. "
    "torch.autograd.grad(..., create_graph=True) followed by a backward through those gradients); "
    "compute that term with another attention implementation (e.g. torch SDPA's math backend)"
)


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


class FlashAttnFunc(torch.autograd.Function):
    """apply(q, k, v, softmax_scale: float, causal: bool, deterministic: bool = False) -> (out, lse);
    both differentiable.

    Shapes and dtypes as in flash4.api._flash_attn_forward. Saves q, k, v, out, lse and the
    log2-domain LSE split (O(N) memory); the backward recomputes P from it (FlashAttention-2,
    section 3.1.2).
    """

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic=False):
        from flash4.api import _flash_attn_forward  # late: api imports this module

        batch, seqlen_q, nheads, _ = q.shape
        lse_split = torch.empty(2, batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
        out, lse = _flash_attn_forward(q, k, v, softmax_scale, causal, lse_split=lse_split)
        ctx.save_for_backward(q, k, v, out, lse, lse_split)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.set_materialize_grads(False)  # dout / dlse arrive as None when unused
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from flash4.backward import flash_attn_backward

        q, k, v, out, lse, lse_split = ctx.saved_tensors
        if dout is None:  # only lse is used by the loss
            dout = torch.zeros_like(out)
        dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                         deterministic=ctx.deterministic, lse_split=lse_split, dlse=dlse)
        needs = ctx.needs_input_grad
        grads = no_double_backward((dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None),
                                   (q, k, v, dout, dlse))
        return grads + (None, None, None)
