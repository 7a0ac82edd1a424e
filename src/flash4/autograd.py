"""torch.autograd.Function for flash4 attention (forward only for now).

The forward runs the kernel; the backward is not written yet, so it raises NotImplementedError.
The public function only goes through this Function when autograd is recording (grad mode on and
an input requiring grad): a graph is then built as usual, and `.backward()` fails loudly instead of
silently producing no or wrong gradients. Inference calls skip the Function's overhead.
"""

from __future__ import annotations

import torch

BACKWARD_MISSING = (
    "flash4: the attention backward pass is not implemented yet (forward only). Call flash_attn_func "
    "under torch.no_grad() / on inputs that do not require grad, or use "
    "torch.nn.functional.scaled_dot_product_attention where gradients are needed."
)


class FlashAttnFunc(torch.autograd.Function):
    """apply(q, k, v, softmax_scale: float, causal: bool) -> (out, lse); lse is not differentiable.

    Shapes and dtypes as in flash4.api._flash_attn_forward. backward raises NotImplementedError.
    """

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal):
        from flash4.api import _flash_attn_forward  # late: api imports this module

        out, lse = _flash_attn_forward(q, k, v, softmax_scale, causal)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError(BACKWARD_MISSING)
