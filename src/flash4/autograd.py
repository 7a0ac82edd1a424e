"""torch.autograd.Functions for flash4 attention: FlashAttnFunc (dense batches, flash4.backward)
and FlashAttnVarlenFunc (packed variable-length batches, flash4.varlen; paged K/V forward only).

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
    """apply(q, k, v, softmax_scale: float, causal: bool, deterministic: bool = False,
    window_size: (left, right) | None = None, softcap: float = 0.0, learnable_sink: Tensor | None = None)
    -> (out, lse); both differentiable, and so is learnable_sink (dsink: sink_grad, in torch).

    Shapes and dtypes as in flash4.api._flash_attn_forward; window_size is flash-attn's sliding
    window and softcap the logit soft-cap (flash4.api.flash_attn_func; 0 = off), passed to the
    forward and the backward alike (the backward applies the cap's exact derivative). Saves q, k,
    v, out, lse and the log2-domain LSE split (O(N) memory); the backward recomputes P from it
    (FlashAttention-2, section 3.1.2).
    """

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic=False, window_size=None, softcap=0.0,
                learnable_sink=None):
        from flash4.api import _flash_attn_forward  # late: api imports this module

        batch, seqlen_q, nheads, _ = q.shape
        lse_split = torch.empty(2, batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
        out, lse = _flash_attn_forward(q, k, v, softmax_scale, causal, lse_split=lse_split, window_size=window_size,
                                       softcap=softcap, **sink_kwargs(learnable_sink))
        ctx.save_for_backward(q, k, v, out, lse, lse_split, learnable_sink)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.window_size, ctx.softcap = window_size, softcap
        ctx.set_materialize_grads(False)  # dout / dlse arrive as None when unused
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from flash4.backward import flash_attn_backward

        q, k, v, out, lse, lse_split, sink = ctx.saved_tensors
        if dout is None:  # only lse is used by the loss
            dout = torch.zeros_like(out)
        dsink = sink_grad(sink, out, dout, lse, dlse, 2) if sink is not None and ctx.needs_input_grad[8] else None
        dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                         deterministic=ctx.deterministic, lse_split=lse_split, dlse=dlse,
                                         window_size=ctx.window_size, softcap=ctx.softcap)
        needs = ctx.needs_input_grad
        grads = no_double_backward((dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                                    dsink), (q, k, v, dout, dlse))
        return grads[:3] + (None,) * 5 + grads[3:]


def sink_kwargs(learnable_sink) -> dict:
    """{"learnable_sink": it} or {} for None (callees without a sink keep their old signature)."""
    return {} if learnable_sink is None else {"learnable_sink": learnable_sink}


def sink_grad(learnable_sink, out, dout, lse, dlse, heads_dim: int, row_mask=None):
    """d loss / d learnable_sink (attention sinks, gpt-oss), in torch: the sink s_h is one more logit
    of every row's softmax with no value, so with P_sink = exp(s_h - LSE) (the LSE includes the sink)
        dsink_h = sum over rows of P_sink * (dLSE - D),   D = rowsum(dout * out) (fp32),
    dLSE = 0 when lse is unused. The kernels' dq/dk/dv need no change (P from the sink-including LSE).

    Dense: out/dout (B, Sq, H, D), lse/dlse (B, H, Sq), heads_dim=2. Varlen: out/dout (T, H, D),
    lse/dlse (H, T), heads_dim=1, row_mask None or a (T,) bool of the rows inside a sequence (rows
    outside are excluded whatever their lse). Returns a (H,) tensor of learnable_sink's dtype."""
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


PAGED_BACKWARD_ERROR = (
    "flash4: flash_attn_varlen_func has no backward for a paged K/V cache (page_table given); run paged "
    "attention under torch.no_grad() / torch.inference_mode(), or train with packed k/v and cu_seqlens_k"
)


class FlashAttnVarlenFunc(torch.autograd.Function):
    """apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q: int,
    max_seqlen_k: int | 0-d Tensor | None, softmax_scale: float, causal: bool, deterministic: bool,
    window_size: (left, right) | None = None, softcap: float = 0.0, learnable_sink=None) -> (out, lse);
    both differentiable, learnable_sink too (sink_grad over the rows inside a sequence) (lse as FlashAttnFunc's; window_size and softcap as
    flash4.api.flash_attn_varlen_func's, forward and backward).

    Varlen layouts as flash4.varlen: q/out (total_q, H, D), k/v (total_k, Hk, D), lse (H, total_q).
    Saves q, k, v, out, lse, the log2 LSE split and the sequence metadata (O(N) memory).
    max_seqlen_k is only needed by the backward: a tensor or None is resolved there (a host sync
    then, not in the forward). Paged K/V (page_table) run the forward; their backward raises
    PAGED_BACKWARD_ERROR (the varlen backward reads packed K/V only).
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q,
                max_seqlen_k, softmax_scale, causal, deterministic=False, window_size=None, softcap=0.0,
                learnable_sink=None):
        from flash4.api import _flash_attn_varlen_forward  # late: api imports this module

        ctx.paged = page_table is not None
        lse_split = None if ctx.paged else torch.empty(2, q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        out, lse = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal,
                                              seqused_q, seqused_k, page_table, lse_split=lse_split,
                                              window_size=window_size, softcap=softcap,
                                              **sink_kwargs(learnable_sink))
        if not ctx.paged:
            ctx.save_for_backward(q, k, v, out, lse, lse_split, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                  learnable_sink)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.window_size, ctx.softcap = window_size, softcap
        ctx.set_materialize_grads(False)  # dout / dlse arrive as None when unused
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if ctx.paged:
            raise RuntimeError(PAGED_BACKWARD_ERROR)
        from flash4.api import _flash_attn_varlen_backward
        from flash4.validate import resolve_max_seqlen

        q, k, v, out, lse, lse_split, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sink = ctx.saved_tensors
        if dout is None:  # only lse is used by the loss
            dout = torch.zeros_like(out)
        dsink = None
        if sink is not None and ctx.needs_input_grad[15]:
            dsink = sink_grad(sink, out, dout, lse, dlse, 1, varlen_row_mask(cu_seqlens_q, seqused_q, q.shape[0]))
        max_seqlen_k = resolve_max_seqlen("max_seqlen_k", ctx.max_seqlen_k, cu_seqlens_k, seqused_k)
        dq, dk, dv = _flash_attn_varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, max_seqlen_k, ctx.softmax_scale,
            ctx.causal, seqused_q, seqused_k, deterministic=ctx.deterministic, lse_split=lse_split, dlse=dlse,
            window_size=ctx.window_size, softcap=ctx.softcap)
        needs = ctx.needs_input_grad
        grads = no_double_backward((dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                                    dsink), (q, k, v, dout, dlse))
        return grads[:3] + (None,) * 12 + grads[3:]
