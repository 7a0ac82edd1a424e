"""torch.autograd.Function for flash4 attention: forward and backward kernels.

The public function only goes through this Function when autograd is recording (grad mode on and
an input requiring grad); inference calls skip its overhead. lse is returned but not
differentiable (its gradient is ignored: marked non-differentiable).
"""

from __future__ import annotations

import torch

class FlashAttnFunc(torch.autograd.Function):
    """apply(q, k, v, softmax_scale: float, causal: bool, deterministic: bool = False) -> (out, lse);
    lse is not differentiable.

    Shapes and dtypes as in flash4.api._flash_attn_forward. Saves q, k, v, out and lse (O(N)
    memory); the backward recomputes P from lse (FlashAttention-2, section 3.1.2).
    """

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic=False):
        from flash4.api import _flash_attn_forward  # late: api imports this module

        out, lse = _flash_attn_forward(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from flash4.backward import flash_attn_backward

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                         deterministic=ctx.deterministic)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None, None, None)
