"""flash4 as PyTorch's flash-attention implementation: the SDPA flash plug-in of torch 2.11.

    import torch, torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import flash4.integrations.sdpa

    flash4.integrations.sdpa.register()                          # names "flash4" in torch's registry
    torch.nn.attention.activate_flash_attention_impl("flash4")   # overrides the aten flash ops (CUDA)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # q, k, v (B, H, S, D): flash4
    torch.nn.attention.restore_flash_attention_impl()            # PyTorch's own kernels again

Once active, every call of these aten ops on a CUDA tensor runs flash4's kernels:
    _scaled_dot_product_flash_attention (+ _backward)   F.scaled_dot_product_attention's flash backend,
                                                        context-parallel SDPA (BHSD views)
    _flash_attention_forward (+ _flash_attention_backward)
                                                        torch.nn.attention.varlen.varlen_attn (packed
                                                        (T, H, D) with cum_seq_q / cum_seq_k) and any
                                                        direct caller (dense BSHD or packed)
    _flash_attention_forward_no_dropout_inplace         only where torch has it (newer than 2.11)
`register()` only names the implementation; `activate_flash_attention_impl("flash4")` calls
`install()`, which registers the overrides (`torch.library.Library("aten", "IMPL")`, dispatch key
CUDA) and returns a handle whose `remove()` drops them, so the previous kernels (PyTorch's FA2)
serve the ops again. `install()` can also be used directly, without the registry.

Mapping (schemas as in torch 2.11's native_functions.yaml; outputs as its meta functions):
  - SDPA passes BHSD views (B, H, S, D); flash4 takes BSHD, so each is `t.transpose(1, 2)` (a view,
    no copy: SDPA's usual inputs are BSHD memory). out is `torch.empty_like(query)` (the meta
    function's layout) written through its BSHD view; logsumexp (B, H, Sq) float32, natural log;
    dq/dk/dv are `empty_like` of query/key/value. Any tensor whose layout flash4 cannot read (last
    dim not contiguous, strides or base not 16-byte aligned, an expanded dim) is copied first; an
    output whose layout the kernels cannot write is computed contiguous and copied in.
  - `_flash_attention_forward` with cum_seq_q / cum_seq_k (int32, (batch + 1,)) runs flash4's varlen
    kernels (query (total_q, H, D), logsumexp (H, total_q)); without them, dense BSHD. seqused_k
    (varlen only) is passed through. max_q / max_k size the grid (max_k: the backward's).
  - Windows (sliding-window / local attention, e.g. varlen_attn's window_size): aten's (flash-attn
    2) encoding, one int per side, None or any negative value meaning unbounded on that side, and
    is_causal=True setting the right side to 0; flash4 runs them as flash-attn's rule, aligned
    bottom-right: query i of a sequence with Sq queries and Sk keys sees key j iff
    i + Sk - Sq - left <= j <= i + Sk - Sq + right. (-1, -1) is full attention, (-1, 0) causal (SDPA
    passes is_causal only when Sq == Sk, where every alignment agrees). flash-attn 2 also counts a
    side >= the key length (max_k for packed batches) as unbounded; flash4 keeps that for the left
    side only, where it is the same rule (the lower bound is then below 0 for every row). For the
    right side it is not the same when Sq > Sk + 1 (rows i < Sq - 1 - right would see fewer keys
    under the plain rule), so flash4 passes the right side as given (unbounded only when
    right >= Sq - 1, which is the plain rule again): there, and only there, flash4's result differs
    from PyTorch's own flash kernel. `resolve_window` is this mapping. Rows whose window holds no
    key give out 0, logsumexp -inf (flash-attn 2 writes +inf there; the backward that reads it is
    flash4's own) and zero gradients. Only the key blocks that meet the band run.
  - scale None means 1 / sqrt(head dim); the backward is deterministic when
    torch.are_deterministic_algorithms_enabled().
  - rng_state / philox outputs: zeros (uint64 (2,) and ()), debug_attn_mask empty: no dropout.
  - No recursion: the overrides call flash4's own kernels, never the aten op they replace.

Refused with a RuntimeError that says why (never a silent wrong result, never a fallback): dropout_p
> 0, return_debug_mask, alibi_slopes, a paged block_table, seqused_k without cum_seq_q, and
whatever flash4 itself cannot run (flash4.validate's message): a head dim outside
flash4.config.SUPPORTED_HEADDIMS and, on sm_90, the other multiples of 16 up to 128 (16, 32, 48, 80,
112: flash4.config.kernel_headdims; SDPA pads the head dim to a multiple of 8 before calling: 72
stays 72), a dtype other than fp16/bf16, a GPU other than sm_90. While "flash4" is active such
calls fail; `torch.nn.attention.restore_flash_attention_impl()` brings PyTorch's kernels back.

The backward recomputes P from the logsumexp alone (the schema has no room for flash4's unrounded
log2 split), which is exact while |lse| stays below ~2**9 (flash4.backward).
"""

from __future__ import annotations

import math
import warnings

import torch

DEFAULT_NAME = "flash4"
_PREFIX = "flash4 SDPA plug-in: "
_RESTORE_HINT = " (torch.nn.attention.restore_flash_attention_impl() returns these ops to PyTorch's kernels)"


class SdpaPluginError(RuntimeError):
    """An input the flash4 overrides cannot serve; the message says which and why."""


def _fail(message: str) -> None:
    raise SdpaPluginError(_PREFIX + message + _RESTORE_HINT)


# ================================================================ pure mappings (CPU-tested)
def resolve_window(is_causal: bool, window_size_left, window_size_right, seqlen_q: int,
                   seqlen_k: int) -> tuple[bool, tuple[int, int]]:
    """aten's (flash-attn 2's) (is_causal, window_size_left, window_size_right) -> flash4's
    (causal, window_size), window_size flash-attn's (left, right) with -1 per side unbounded.

    None or any negative side is unbounded (-1); is_causal sets the right side to 0. seqlen_q /
    seqlen_k: the query and key lengths (max_q / max_k for packed batches). A left side >= seqlen_k
    is unbounded (flash-attn 2's clamp, and the same rule: i + Sk - Sq - left < 0 for every row). A
    right side is unbounded only when >= seqlen_q - 1 (then i + Sk - Sq + right >= Sk - 1 for every
    row); flash-attn 2's clamp of right >= seqlen_k is not applied (a different rule when
    seqlen_q > seqlen_k + 1: the module docstring). causal is True when the right side is 0, so
    (-1, 0) runs flash4's causal kernels and (-1, -1) its full ones; any other window runs the
    local (sliding-window) kernels.
    """
    left = -1 if window_size_left is None or int(window_size_left) < 0 else int(window_size_left)
    right = -1 if window_size_right is None or int(window_size_right) < 0 else int(window_size_right)
    if is_causal:
        right = 0
    if left >= seqlen_k:
        left = -1
    if right > 0 and right >= seqlen_q - 1:
        right = -1
    return right == 0, (left, right)


def bhsd_to_bshd(t: torch.Tensor) -> torch.Tensor:
    """SDPA's (B, H, S, D) view -> flash4's (B, S, H, D) view of the same memory (and back: the
    transpose is its own inverse)."""
    return t.transpose(1, 2)


def forward_problem(dropout_p: float = 0.0, return_debug_mask: bool = False, alibi_slopes=None, block_table=None,
                    varlen: bool = False, seqused_k=None) -> str | None:
    """The aten arguments the overrides refuse before looking at tensors, or None."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p}: flash4 has no dropout (use dropout_p=0.0, e.g. in eval mode)"
    if return_debug_mask:
        return "return_debug_mask=True is not supported"
    if alibi_slopes is not None:
        return "alibi_slopes are not supported"
    if block_table is not None:
        return "a paged block_table is not supported through the aten op (use flash4.flash_attn_varlen_func)"
    if seqused_k is not None and not varlen:
        return "seqused_k needs a packed batch (cum_seq_q / cum_seq_k)"
    return None


def _check(problem: str | None) -> None:
    if problem is not None:
        _fail(problem)


def _scale(scale, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if scale is None else float(scale)


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when flash4's kernels cannot read its layout."""
    from flash4.validate import layout_problem

    return t if layout_problem("t", t) is None else t.contiguous()


def _writable(view: torch.Tensor, contiguous: bool = False) -> torch.Tensor | None:
    """view when the kernels can write it in place (contiguous=True: the backward's dq/dk/dv must be
    contiguous), else None (computed into a new tensor, then copied in)."""
    from flash4.validate import layout_problem

    if contiguous:
        return view if view.is_contiguous() else None
    return view if layout_problem("out", view) is None else None


def _aux(query: torch.Tensor):
    """rng_state, unused (philox offset), debug_attn_mask as the meta functions lay them out."""
    return (torch.zeros((2,), dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


# ================================================================ the flash4 calls (a seam for CPU tests)
def _native_headdim_error(q, v):
    """The plug-in runs flash4's kernels on the tensors as given (no zero-padding: it writes into
    aten's preallocated layouts), so only the kernel head dims of q's GPU (flash4.config.kernel_headdims:
    on sm_90 every multiple of 16 up to 128 too, FLASH4_HEADDIM16): a message for others, else None."""
    from flash4.headdim import is_native

    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor)) or is_native(q.shape[-1], v.shape[-1]):
        return None  # every family's head dims: no device query on the plug-in's per-call path
    arch = _arch_of(q)
    if is_native(q.shape[-1], v.shape[-1], arch):
        return None
    from flash4.config import HDIMV_PAIRS, SUPPORTED_HEADDIMS, kernel_headdims

    dims = SUPPORTED_HEADDIMS if arch is None else kernel_headdims(arch)
    return (f"headdim {q.shape[-1]} (v: {v.shape[-1]}): the SDPA plug-in runs flash4's kernel head dims "
            f"{', '.join(map(str, dims))} and the pairs {HDIMV_PAIRS} (flash4.flash_attn_func "
            f"zero-pads the other multiples of 8)")


def _arch_of(q) -> int | None:
    """The SM version of q's GPU (FLASH4_ARCH when set), or None (no CUDA: the rule without it)."""
    from flash4.arch import device_arch

    try:
        return device_arch(q.device if q.is_cuda else None)
    except (RuntimeError, ValueError):
        return None


class _Flash4Kernels:
    """What the overrides run: flash4's support checks and its host forward / backward on requests
    built after those checks (flash4.request.Request's unchecked constructors). The CPU tests
    substitute a reference with the same methods (no GPU there); nothing else should."""

    @staticmethod
    def dense_error(q, k, v, scale, causal, window_size):
        from flash4.validate import support_error

        return support_error(q, k, v, scale, causal, window_size)

    @staticmethod
    def varlen_error(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, scale, causal, window_size):
        from flash4.validate import varlen_support_error

        return varlen_support_error(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, None, seqused_k, None, scale,
                                    causal, window_size)

    @staticmethod
    def dense_forward(q, k, v, scale, causal, window_size, out):
        from flash4 import forward
        from flash4.request import Request

        return forward.run(Request.dense(q, k, v, scale, causal, window_size), out=out)

    @staticmethod
    def dense_backward(dout, q, k, v, out, lse, scale, causal, window_size, deterministic, dq, dk, dv):
        from flash4 import backward
        from flash4.request import Request

        request = Request.dense(q, k, v, scale, causal, window_size, deterministic=deterministic)
        return backward.run(request, dout, out, lse, dq=dq, dk=dk, dv=dv)

    @staticmethod
    def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, scale, causal, window_size, seqused_k, out):
        from flash4 import forward
        from flash4.request import Request

        request = Request.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, seqused_k=seqused_k, softmax_scale=scale,
                                 causal=causal, window_size=window_size)
        return forward.run(request, out=out)

    @staticmethod
    def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, causal, window_size,
                        deterministic, dq, dk, dv):
        from flash4 import backward
        from flash4.request import Request

        request = Request.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                 window_size=window_size, deterministic=deterministic)
        return backward.run(request, dout, out, lse, dq=dq, dk=dk, dv=dv)


_KERNELS = _Flash4Kernels()


def _contiguous(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


# ================================================================ shared bodies (flash4's BSHD / packed layouts)
def _forward_into(out_view, q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, window_size_left,
                  window_size_right, seqused_k):
    """Attention of flash4-layout q/k/v (dense BSHD, or packed (T, H, D) with cum_seq_q/k) written
    into out_view (same layout); returns the logsumexp ((B, H, Sq) dense, (H, total_q) packed)."""
    varlen = cum_seq_q is not None
    if varlen and cum_seq_k is None:
        _fail("cum_seq_q without cum_seq_k (a packed batch needs both)")
    if not varlen and cum_seq_k is not None:
        _fail("cum_seq_k without cum_seq_q (a packed batch needs both)")
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    causal, window = resolve_window(is_causal, window_size_left, window_size_right,
                                    *((int(max_q), int(max_k)) if varlen else (q.shape[1], k.shape[1])))
    scale = _scale(scale, q.shape[-1])
    target = _writable(out_view)
    if varlen:
        cum_seq_q, cum_seq_k, seqused_k = (_contiguous(t) for t in (cum_seq_q, cum_seq_k, seqused_k))
        _check(_KERNELS.varlen_error(q, k, v, cum_seq_q, cum_seq_k, seqused_k, scale, causal, window))
        out, lse = _KERNELS.varlen_forward(q, k, v, cum_seq_q, cum_seq_k, int(max_q), scale, causal, window,
                                           seqused_k, target)
    else:
        _check(_native_headdim_error(q, v) or _KERNELS.dense_error(q, k, v, scale, causal, window))
        out, lse = _KERNELS.dense_forward(q, k, v, scale, causal, window, target)
    if target is None:
        out_view.copy_(out)
    return lse


def _backward_into(grad_views, dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                   window_size_left, window_size_right):
    """dq, dk, dv of flash4-layout tensors written into grad_views (flash4 layouts too)."""
    varlen = cum_seq_q is not None
    if varlen != (cum_seq_k is not None):
        _fail("a packed batch needs both cum_seq_q and cum_seq_k")
    q, k, v, out = (_kernel_layout(t) for t in (q, k, v, out))
    causal, window = resolve_window(is_causal, window_size_left, window_size_right,
                                    *((int(max_q), int(max_k)) if varlen else (q.shape[1], k.shape[1])))
    scale = _scale(scale, q.shape[-1])
    lse = lse.float()
    deterministic = torch.are_deterministic_algorithms_enabled()
    targets = [_writable(g, contiguous=True) for g in grad_views]
    if varlen:
        cum_seq_q, cum_seq_k = _contiguous(cum_seq_q), _contiguous(cum_seq_k)
        _check(_KERNELS.varlen_error(q, k, v, cum_seq_q, cum_seq_k, None, scale, causal, window))
        grads = _KERNELS.varlen_backward(dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, int(max_q), int(max_k), scale,
                                         causal, window, deterministic, *targets)
    else:
        _check(_native_headdim_error(q, v) or _KERNELS.dense_error(q, k, v, scale, causal, window))
        grads = _KERNELS.dense_backward(dout, q, k, v, out, lse, scale, causal, window, deterministic, *targets)
    for view, target, grad in zip(grad_views, targets, grads):
        if target is None:
            view.copy_(grad)


# ================================================================ the aten overrides
def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention on BHSD query/key/value -> (output, logsumexp,
    cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask), as its meta function."""
    _check(forward_problem(dropout_p, return_debug_mask))
    out = torch.empty_like(query)
    lse = _forward_into(bhsd_to_bshd(out), bhsd_to_bshd(query), bhsd_to_bshd(key), bhsd_to_bshd(value), None, None,
                        query.size(2), key.size(2), is_causal, scale, None, None, None)
    return (out, lse, None, None, query.size(2), key.size(2)) + _aux(query)


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward (BHSD) -> (grad_query, grad_key, grad_value)."""
    _check(forward_problem(dropout_p))
    grads = tuple(torch.empty_like(t) for t in (query, key, value))
    _backward_into([bhsd_to_bshd(g) for g in grads], *(bhsd_to_bshd(t) for t in (grad_out, query, key, value, out)),
                   logsumexp, None, None, max_q, max_k, is_causal, scale, None, None)
    return grads


def _reject_unknown(extra: dict) -> None:
    unknown = {name: value for name, value in extra.items() if value is not None}
    if unknown:
        _fail(f"unsupported arguments {sorted(unknown)} (this plug-in follows torch 2.11's schemas)")


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None, **extra):
    """aten::_flash_attention_forward: dense BSHD, or packed (T, H, D) with cum_seq_q / cum_seq_k ->
    (output, softmax_logsumexp, rng_state, unused, debug_attn_mask). num_splits (newer torch) is a
    performance hint and is ignored."""
    _reject_unknown(extra)
    _check(forward_problem(dropout_p, return_debug_mask, alibi_slopes, block_table, cum_seq_q is not None, seqused_k))
    out = torch.empty_like(query)
    lse = _forward_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                        window_size_left, window_size_right, seqused_k)
    return (out, lse) + _aux(query)


def flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                               is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                                               window_size_right=None, seqused_k=None, alibi_slopes=None,
                                               block_table=None, num_splits=None, **extra):
    """aten::_flash_attention_forward_no_dropout_inplace (torch newer than 2.11): writes out, returns
    the logsumexp."""
    _reject_unknown(extra)
    _check(forward_problem(dropout_p, return_debug_mask, alibi_slopes, block_table, cum_seq_q is not None, seqused_k))
    return _forward_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                         window_size_left, window_size_right, seqused_k)


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None, **extra):
    """aten::_flash_attention_backward (dense BSHD or packed) -> (grad_query, grad_key, grad_value)."""
    _reject_unknown(extra)
    _check(forward_problem(dropout_p))
    grads = tuple(torch.empty_like(t) for t in (query, key, value))
    _backward_into(list(grads), grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   is_causal, scale, window_size_left, window_size_right)
    return grads


# aten op name -> override; ops this torch lacks are skipped (the first four are in every torch the
# registry exists in).
OVERRIDES = {
    "_scaled_dot_product_flash_attention": sdpa_flash_forward,
    "_scaled_dot_product_flash_attention_backward": sdpa_flash_backward,
    "_flash_attention_forward": flash_attention_forward,
    "_flash_attention_backward": flash_attention_backward,
    "_flash_attention_forward_no_dropout_inplace": flash_attention_forward_no_dropout_inplace,
}
_REQUIRED = tuple(list(OVERRIDES)[:4])


def _op_exists(name: str) -> bool:
    try:
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


# ================================================================ install / register
class Flash4SdpaHandle:
    """What `install()` returns (and torch's registry keeps while "flash4" is active): `remove()`
    drops the overrides (idempotent); `ops` names the aten ops overridden."""

    def __init__(self, library, ops: tuple[str, ...], dispatch_key: str):
        self._library = library
        self.ops = ops
        self.dispatch_key = dispatch_key

    @property
    def active(self) -> bool:
        return self._library is not None

    def remove(self) -> None:
        library, self._library = self._library, None
        if library is not None:
            library._destroy()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"Flash4SdpaHandle({state}, {self.dispatch_key}: {', '.join(self.ops)})"


def install(dispatch_key: str = "CUDA") -> Flash4SdpaHandle:
    """Override the aten flash-attention ops for `dispatch_key` with flash4 (the register_fn that
    torch.nn.attention.activate_flash_attention_impl calls). Returns the handle whose remove()
    undoes it. Works without the registry (any torch whose ops have 2.11's schemas); tests use
    dispatch_key="CPU" with a reference in place of the kernels."""
    missing = [name for name in _REQUIRED if not _op_exists(name)]
    if missing:
        raise RuntimeError(f"{_PREFIX}this torch ({torch.__version__}) lacks the aten ops {missing}")
    ops = tuple(name for name in OVERRIDES if name in _REQUIRED or _op_exists(name))
    library = torch.library.Library("aten", "IMPL", dispatch_key)  # noqa: TOR901
    try:
        with warnings.catch_warnings():
            # overriding PyTorch's own kernel for these ops is the point; torch warns about it
            warnings.filterwarnings("ignore", message=".*previously registered kernel.*")
            for name in ops:
                try:
                    library.impl(name, OVERRIDES[name], dispatch_key, allow_override=True)
                except TypeError:  # a torch whose Library.impl has no allow_override
                    library.impl(name, OVERRIDES[name], dispatch_key)
    except BaseException:
        library._destroy()
        raise
    return Flash4SdpaHandle(library, ops, dispatch_key)


def _registry():
    import torch.nn.attention as attention

    needed = ("register_flash_attention_impl", "activate_flash_attention_impl", "restore_flash_attention_impl")
    missing = [name for name in needed if not hasattr(attention, name)]
    if missing:
        raise RuntimeError(
            f"{_PREFIX}torch {torch.__version__} has no flash-attention plug-in registry (torch.nn.attention."
            f"{missing[0]} is missing; it arrived in PyTorch 2.11). flash4.integrations.sdpa.install() overrides "
            f"the ops without it, at your own risk on other versions.")
    return attention


def available() -> bool:
    """Whether this torch has the plug-in registry `register()` needs."""
    try:
        _registry()
    except RuntimeError:
        return False
    return True


def register(name: str = DEFAULT_NAME) -> None:
    """Name flash4 in torch's flash-attention registry (nothing is overridden yet). Then
    `torch.nn.attention.activate_flash_attention_impl(name)` installs it and
    `torch.nn.attention.restore_flash_attention_impl()` removes it. Idempotent. Raises RuntimeError
    when this torch has no registry (before 2.11)."""
    _registry().register_flash_attention_impl(name, register_fn=install)
