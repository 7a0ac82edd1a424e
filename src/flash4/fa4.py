"""flash-attn-4's Python API on flash4: moving from flash-attn-4 changes one import,

    flash-attn-4:  from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    flash4:        from flash4.fa4 import flash_attn_func, flash_attn_varlen_func

with flash-attn-4's signatures, defaults, return values and semantics (`flash_attn.cute.interface`,
4.0.0b27..b36): `(out, lse)` from both functions; window sides read literally with None for an
unbounded side (`(None, -5)`: a band ending 5 keys before the diagonal); `causal` and the window
resolved as flash-attn-4 resolves them (resolve_causal_window). Each call is translated into
flash4's request (flash4.request, through flash4.api's doors and flash4.validate) and runs flash4's
one host pipeline (flash4.forward / flash4.backward / flash4.autograd, the custom ops of flash4.ops
under torch.compile): this module adds no pipeline of its own.

    flash_attn_func(q, k, v, ...)            dense (batch, seqlen, nheads, headdim)
    flash_attn_varlen_func(q, k, v, ...)     flash-attn-4's one door for packed (cu_seqlens), seqused,
                                             paged (page_table) and KV-cache calls; its routes:
        4-D q and k/v, no metadata          -> flash4.api.flash_attn_func
        4-D q over a 4-D cache or a paged   -> flash4.api.flash_attn_with_kvcache (cache_seqlens =
        pool with seqused_k, no cu_seqlens,    seqused_k, num_splits as given), when no gradient is
        no gradient needed                     needed and the head dims have a kernel
        everything else                     -> flash4.api.flash_attn_varlen_func (a 4-D q / k / v
                                               becomes packed rows, cu_seqlens = arange * seqlen;
                                               out and lse are viewed back to flash-attn-4's shapes)
    get_scheduler_metadata(...)              a hint object flash4 accepts and ignores
    _flash_attn_fwd / _flash_attn_bwd        flash-attn-4's raw forward / backward (no autograd)

Returns: out like q with v's head dim; lse float32, (batch, nheads, seqlen_q) for a 4-D q and
(nheads, total_q) for a packed q. lse is None unless return_lse=True or an input requires grad;
with return_lse=True it is differentiable (a loss through it adds dLSE to the backward), without
it it carries no gradient (flash-attn-4 ignores dlse then).

Hints flash4 accepts and ignores (results are the same): pack_gqa (flash4 picks its GQA layout),
num_splits outside the KV-cache route (flash4's dense and packed forwards never split the keys;
its KV-cache route takes num_splits as flash-attn-4 does: 1 none, 0 or less its heuristic, n > 1
n splits), scheduler_metadata, disable_scheduler_metadata, min_seqlen_k, and _flash_attn_fwd /
_flash_attn_bwd's tile and thread knobs.

Arguments flash4 cannot serve raise NotImplementedError naming the argument: qv (MLA absorbed
attention), gather_kv_indices (sparse MLA), score_mod / score_mod_bwd, mask_mod, aux_tensors /
aux_scalars, block_sparse_tensors / block_sparse_tensors_bwd, fp8 inputs and q/k/v_descale,
seqlen_k_per_split, a paged pool at a head dim without a kernel (flash4 pads only packed and dense
inputs, flash4.headdim), and a page size flash4's paged kernels do not serve yet (not a multiple of
flash4.config.MIN_PAGE_ROWS). Head dims outside flash-attn-4's sm_90 rule raise
HeadDimError, both a ValueError and the AssertionError flash-attn-4 raises, with its message.
Other bad input raises flash4's own TypeError / ValueError (flash4.validate), naming the argument.
"""

from __future__ import annotations

import torch

from flash4 import api, headdim as hd
from flash4.geometry import Band

_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz") if hasattr(torch, name))

# flash-attn-4's scheduler-metadata fields (SchedulerMetadataTensorsTorch); flash4 has no such scheduler.
SCHEDULER_FIELDS = ("num_splits_dynamic_ptr", "num_nheads_in_l2_ptr", "tile_count_semaphore", "cu_total_m_blocks",
                    "cu_total_splits_m_blocks", "num_m_blocks_ptr", "virtual_batch_idx")


class HeadDimError(ValueError, AssertionError):
    """A head dim outside flash-attn-4's sm_90 rule (multiples of 16 bytes from 8 to 256): a ValueError
    (flash4's convention) that is also the AssertionError flash-attn-4 raises, with its message."""


# ================================================================ argument translation
def resolve_causal_window(causal: bool, window_size_left, window_size_right) -> tuple[bool, Band]:
    """flash-attn-4's causal / window resolution -> (causal, Band) for flash4's request: causal sets
    the right side to 0; sides with left + right < 0 are no window; (None, 0) is causal; any other
    window is a literal band (causal folded into it). None: unbounded on that side."""
    left, right = window_size_left, window_size_right
    for name, value in (("window_size_left", left), ("window_size_right", right)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be None (unbounded) or an int, got {type(value).__name__} {value!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right is None:
        return causal, Band(None, None)
    if left is None and right == 0:
        return True, Band(None, None)
    return False, Band(left, right)


def _window_pair(window_size) -> tuple:
    if window_size is None:
        return None, None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair, each None (unbounded) or an int; got "
                        f"{window_size!r}")
    return window_size[0], window_size[1]


def _refuse(**features) -> None:
    """NotImplementedError naming the first flash-attn-4 argument in use that flash4 cannot serve."""
    what = {"qv": "MLA absorbed attention", "gather_kv_indices": "top-k sparse MLA", "score_mod": "score modifiers",
            "score_mod_bwd": "score modifiers", "mask_mod": "mask modifiers", "aux_tensors": "score/mask modifiers",
            "aux_scalars": "score/mask modifiers", "block_sparse_tensors": "block sparsity",
            "block_sparse_tensors_bwd": "block sparsity", "q_descale": "fp8", "k_descale": "fp8", "v_descale": "fp8",
            "seqlen_k_per_split": "fixed-size KV splits"}
    for name, value in features.items():
        if value is not None and not (name.startswith("aux_") and not value):
            raise NotImplementedError(f"flash4.fa4: {name} ({what[name]}) is not supported by flash4")


def _refuse_dtypes(**tensors) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.dtype in _FP8_DTYPES:
            raise NotImplementedError(f"flash4.fa4: {name} of dtype {t.dtype} (fp8) is not supported by flash4; "
                                      f"flash4 takes torch.bfloat16 and torch.float16")


def _check_gather_knobs(gather_kv_indices, gather_bwd_recompute_p, gather_bwd_token_chunk) -> None:
    """flash-attn-4's own check (b36): the gather backward knobs need gather_kv_indices."""
    if gather_kv_indices is None and (gather_bwd_recompute_p or gather_bwd_token_chunk is not None):
        raise ValueError("gather_bwd_recompute_p / gather_bwd_token_chunk only apply to sparse top-k MLA attention "
                         "(gather_kv_indices is not set on this call, so they would be silently ignored)")


def _check_head_dims(q, v) -> None:
    """flash-attn-4's sm_90 head-dim rule, its exception (HeadDimError is an AssertionError) and message."""
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor)) or q.dim() < 3 or v.dim() < 3:
        return  # flash4's validation names the argument
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    alignment = 16 // v.element_size()
    if not (8 <= head_dim <= 256 and 8 <= head_dim_v <= 256 and head_dim % alignment == 0
            and head_dim_v % alignment == 0):
        raise HeadDimError(f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM90. head_dim "
                           f"and head_dim_v must be between 8 and 256 and divisible by {alignment}.")


def _maybe_contiguous(t):
    """flash-attn-4's canonicalization of an input whose last dim is strided (a contiguous copy),
    and of one whose other strides or base address are not 16-byte aligned as flash4's kernels need
    (a contiguous, aligned copy: the door only reads q / k / v, it never appends to a cache)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.numel() == 0:
        return t
    if t.stride(-1) != 1:
        t = t.contiguous()
    size = t.element_size()
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return t
    if t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:-1]):
        t = t.contiguous()
        t = t if t.data_ptr() % 16 == 0 else t.clone()
    return t


def _check_page_size(k, page_table) -> None:
    """Page sizes flash4's paged kernels serve (flash4.config.MIN_PAGE_ROWS); others are refused as
    not implemented (flash-attn-4 takes any page size)."""
    from flash4 import config

    rows = config.served_page_rows()
    if page_table is not None and isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[1] % rows:
        raise NotImplementedError(f"flash4.fa4: page_size={k.shape[1]} (k.shape[1]) is not supported by flash4 "
                                  f"with FLASH4_SMALL_PAGES=0: paged K/V pages must be multiples of {rows} rows (unset it: "
                                  f"any page size)")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _fa4_lse(lse, return_lse: bool, *tensors):
    """flash-attn-4's returned lse: differentiable with return_lse; else computed only when an input
    requires grad, and carrying no gradient; else None."""
    if return_lse:
        return lse
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return lse.detach()
    return None


def _arange_cu(batch: int, step: int, device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * step, step, dtype=torch.int32, device=device)


# ================================================================ the doors
def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """flash-attn-4's flash_attn_func: softmax(softmax_scale * Q K^T) V of dense batches.

    q: (batch, seqlen_q, nheads, headdim) bf16 / fp16 on a CUDA device; k: (batch, seqlen_k,
    nheads_k, headdim); v: (batch, seqlen_k, nheads_k, headdim_v); nheads_k divides nheads.
    window_size: (left, right), literal sides, None = unbounded (resolve_causal_window).
    learnable_sink: None or (nheads,) sink logits; softcap: 0 (off) or > 0; deterministic: a
    reproducible backward; num_splits, pack_gqa: hints (module docstring).
    Returns (out (batch, seqlen_q, nheads, headdim_v), lse (batch, nheads, seqlen_q) float32 or None).
    Raises NotImplementedError for the arguments flash4 cannot serve (module docstring),
    HeadDimError / TypeError / ValueError for bad input.
    """
    _check_gather_knobs(gather_kv_indices, gather_bwd_recompute_p, gather_bwd_token_chunk)
    _refuse(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
            block_sparse_tensors=block_sparse_tensors, block_sparse_tensors_bwd=block_sparse_tensors_bwd)
    _refuse_dtypes(q=q, k=k, v=v)
    causal, band = resolve_causal_window(causal, *_window_pair(window_size))
    _check_head_dims(q, v)
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    out, lse = api.flash_attn_func(q, k, v, softmax_scale, causal, True, bool(deterministic), window_size=band,
                                   softcap=0.0 if softcap is None else softcap, learnable_sink=learnable_sink)
    return out, _fa4_lse(lse, return_lse, q, k, v, learnable_sink)


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                           gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """flash-attn-4's flash_attn_varlen_func: packed, seqused, paged and KV-cache attention.

    q: (total_q, nheads, headdim) with cu_seqlens_q, or (batch, seqlen_q, nheads, headdim);
    k / v: (total_k, nheads_k, headdim / headdim_v) with cu_seqlens_k, (batch, seqlen_k, ...), or a
    paged pool (num_pages, page_size, nheads_k, ...) with page_table (batch, max_pages) int32 and
    seqused_k. cu_seqlens_*: (batch + 1,) int32; seqused_*: (batch,) int32. Other arguments as
    flash_attn_func. Returns (out like q with headdim_v, lse (nheads, total_q) for a packed q or
    (batch, nheads, seqlen_q) for a 4-D q, float32, or None). Routes: module docstring.
    """
    _check_gather_knobs(gather_kv_indices, gather_bwd_recompute_p, gather_bwd_token_chunk)
    _refuse(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
            block_sparse_tensors=block_sparse_tensors, seqlen_k_per_split=seqlen_k_per_split)
    _refuse_dtypes(q=q, k=k, v=v)
    causal, band = resolve_causal_window(causal, *_window_pair(window_size))
    _check_head_dims(q, v)
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                       page_table, softmax_scale, causal, band, softcap, learnable_sink, bool(deterministic),
                       num_splits, grad=_needs_grad(q, k, v, learnable_sink))
    return out, _fa4_lse(lse, return_lse, q, k, v, learnable_sink)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
            softmax_scale, causal, band, softcap, learnable_sink, deterministic, num_splits, grad):
    """flash_attn_varlen_func's routes (module docstring) -> (out, lse) in flash-attn-4's layouts."""
    softcap = 0.0 if softcap is None else softcap
    q4, paged = isinstance(q, torch.Tensor) and q.dim() == 4, page_table is not None
    k4 = isinstance(k, torch.Tensor) and k.dim() == 4
    if q4 and k4 and not paged and cu_seqlens_q is None and cu_seqlens_k is None and seqused_q is None \
            and seqused_k is None:
        return api.flash_attn_func(q, k, v, softmax_scale, causal, True, deterministic, window_size=band,
                                   softcap=softcap, learnable_sink=learnable_sink)
    _check_page_size(k, page_table)
    native = hd.is_native(q.shape[-1], v.shape[-1]) if q4 or q.dim() == 3 else True
    if paged and not native:
        raise NotImplementedError(f"flash4.fa4: a paged K/V pool at (head_dim, head_dim_v)=({q.shape[-1]}, "
                                  f"{v.shape[-1]}): flash4 pads only packed and dense inputs, not caches "
                                  f"({hd.RULE})")
    if q4 and k4 and cu_seqlens_q is None and seqused_q is None and cu_seqlens_k is None and seqused_k is not None \
            and not grad and native:
        with torch.no_grad():  # a KV cache: flash4's decode door (cache_seqlens = seqused_k)
            splits = 0 if num_splits is None or num_splits < 1 else int(num_splits)
            return api.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqused_k, page_table=page_table,
                                               softmax_scale=softmax_scale, causal=causal, window_size=band,
                                               softcap=softcap, num_splits=splits, return_lse=True,
                                               learnable_sink=learnable_sink)
    q_rows, k_rows, v_rows = q, k, v
    if q4:
        if cu_seqlens_q is not None:
            raise ValueError(f"q of shape {tuple(q.shape)} with cu_seqlens_q: a packed q is (total_q, nheads, "
                             f"headdim)")
        batch, seqlen_q = q.shape[:2]
        q_rows = q.reshape(batch * seqlen_q, *q.shape[2:])
        cu_seqlens_q, max_seqlen_q = _arange_cu(batch, seqlen_q, q.device), seqlen_q
    if k4 and not paged:
        if cu_seqlens_k is not None:
            raise ValueError(f"k of shape {tuple(k.shape)} with cu_seqlens_k: a packed k is (total_k, nheads_k, "
                             f"headdim)")
        batch_k, seqlen_k = k.shape[:2]
        k_rows, v_rows = (t.reshape(batch_k * seqlen_k, *t.shape[2:]) for t in (k, v))
        cu_seqlens_k, max_seqlen_k = _arange_cu(batch_k, seqlen_k, k.device), seqlen_k
    out, lse = api.flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
                                          page_table=page_table, softmax_scale=softmax_scale, causal=causal,
                                          window_size=band, softcap=softcap, return_lse=True,
                                          deterministic=deterministic, learnable_sink=learnable_sink)
    if q4:
        batch, seqlen_q = q.shape[:2]
        out = out.view(batch, seqlen_q, *out.shape[1:])
        lse = lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1)
    return out, lse


class SchedulerMetadata:
    """What get_scheduler_metadata returns: its arguments, nothing precomputed. flash_attn_varlen_func
    accepts and ignores it (flash4 schedules its own tiles). Reading one of flash-attn-4's scheduler
    fields (SCHEDULER_FIELDS) raises NotImplementedError naming it."""

    def __init__(self, **kwargs):
        self.__dict__["arguments"] = dict(kwargs)

    def __getattr__(self, name):
        if name not in SCHEDULER_FIELDS:
            raise AttributeError(name)
        raise NotImplementedError(f"flash4.fa4: scheduler metadata field {name!r} (flash-attn-4's tile scheduler) "
                                  f"does not exist in flash4, which schedules its own tiles")


def get_scheduler_metadata(max_seqlen_q, max_seqlen_k, nheads, nheads_kv, headdim, num_splits, headdim_v=None,
                           pack_gqa=None, causal=False, window_size_left=None, window_size_right=None,
                           seqlen_k_new=0, cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None,
                           seqused_q=None, seqused_k=None, leftpad_k=None, seqlen_k_per_split=None, _arch=None):
    """flash-attn-4's get_scheduler_metadata: a SchedulerMetadata hint object (flash4 ignores it).
    Raises NotImplementedError for leftpad_k, cu_seqlens_k_new and seqlen_k_per_split (flash4 has
    no such inputs), AssertionError as flash-attn-4 without any of cu_seqlens_q / cu_seqlens_k /
    seqused_q / seqused_k."""
    _refuse(seqlen_k_per_split=seqlen_k_per_split)
    for name, value in (("leftpad_k", leftpad_k), ("cu_seqlens_k_new", cu_seqlens_k_new)):
        if value is not None:
            raise NotImplementedError(f"flash4.fa4: {name} is not supported by flash4")
    assert any(t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)), (
        "get_scheduler_metadata requires at least one of cu_seqlens_q/cu_seqlens_k/seqused_q/seqused_k")
    causal, band = resolve_causal_window(causal, window_size_left, window_size_right)
    return SchedulerMetadata(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, nheads=nheads, nheads_kv=nheads_kv,
                             headdim=headdim, headdim_v=headdim if headdim_v is None else headdim_v,
                             num_splits=num_splits, causal=causal, window=band, seqlen_k_new=seqlen_k_new)


# ================================================================ flash-attn-4's raw forward / backward
def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                    causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                    tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1,
                    pack_gqa=None, _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None,
                    return_lse=False, out=None, lse=None, aux_tensors=None, aux_scalars=None, q_descale=None,
                    k_descale=None, v_descale=None, gather_kv_indices=None, scheduler_metadata=None,
                    seqlen_k_per_split=None, disable_scheduler_metadata=False, gather_bwd_recompute_p=False):
    """flash-attn-4's raw forward (no autograd graph) -> (out, lse, None, None) (its out, lse, p,
    row_max; flash4 keeps neither p nor row_max). lse is None unless return_lse, a preallocated lse,
    or an input requiring grad asks for it. Preallocated out / lse are written and returned."""
    if q is None or k is None:
        raise NotImplementedError("flash4.fa4: q or k None (MLA absorbed attention) is not supported by flash4")
    _refuse(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, mask_mod=mask_mod,
            aux_tensors=aux_tensors, aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, seqlen_k_per_split=seqlen_k_per_split)
    _refuse_dtypes(q=q, k=k, v=v)
    if _arch is not None and _arch // 10 != 9:
        raise NotImplementedError(f"flash4.fa4: _arch={_arch}: flash4.fa4 serves sm_90")
    causal, band = resolve_causal_window(causal, window_size_left, window_size_right)
    _check_head_dims(q, v)
    needs_lse = return_lse or lse is not None or any(isinstance(t, torch.Tensor) and t.requires_grad
                                                     for t in (q, k, v, learnable_sink))
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    with torch.no_grad():
        o, l = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                       page_table, softmax_scale, causal, band, softcap, learnable_sink, False, num_splits, grad=False)
        if out is not None:
            out.copy_(o)
            o = out
        if lse is not None:
            lse.copy_(l)
            l = lse
    return o, (l if needs_lse else None), None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                    window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
                    num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,
                    AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None,
                    cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None, mask_mod=None,
                    aux_tensors=None, aux_scalars=None, block_sparse_tensors=None, dlse=None, learnable_sink=None):
    """flash-attn-4's raw backward -> (dq, dk, dv), plus dsink with learnable_sink: flash4.backward.run
    on the request of the forward that gave out and lse (dense, or packed with cu_seqlens / seqused),
    dsink from flash4.autograd.sink_grad with each row's D from the kernel (run's delta). Preallocated
    dq / dk / dv are written and returned."""
    from flash4 import backward as bwd
    from flash4.autograd import sink_grad, varlen_row_mask
    from flash4.request import Request, resolve_softmax_scale

    _refuse(score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
            aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors)
    _refuse_dtypes(q=q, k=k, v=v)
    causal, band = resolve_causal_window(causal, window_size_left, window_size_right)
    _check_head_dims(q, v)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    packed = cu_seqlens_q is not None
    d, d_v = q.shape[-1], v.shape[-1]
    d_p, dv_p = hd.padded_headdims(d, d_v)
    pad = (lambda t, width: hd.pad_last(t, width)) if (d_p, dv_p) != (d, d_v) else (lambda t, width: t)
    qp, kp, vp, outp, doutp = pad(q, d_p), pad(k, d_p), pad(v, dv_p), pad(out, dv_p), pad(dout, dv_p)
    qp, kp, vp, outp, doutp = (t.contiguous() for t in (qp, kp, vp, outp, doutp))
    softcap = 0.0 if softcap is None else float(softcap)
    with torch.no_grad():
        if packed:
            if cu_seqlens_k is None:
                raise ValueError("_flash_attn_bwd with cu_seqlens_q needs cu_seqlens_k (flash4 has no paged backward)")
            request = Request.varlen(qp, kp, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                     seqused_k, None, scale, causal, band, softcap, deterministic=deterministic)
        else:
            request = Request.dense(qp, kp, vp, scale, causal, band, softcap, deterministic=deterministic)
        same = (d_p, dv_p) == (d, d_v)
        # each row's D in fp32 from the kernel's P and dP when the sink needs a gradient (sink_grad)
        delta = None if learnable_sink is None else torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
        grads = bwd.run(request, doutp, outp, lse.contiguous(), None, dlse, *((dq, dk, dv) if same else (None,) * 3),
                        delta=delta)
        if not same:
            grads = tuple(g[..., :width] for g, width in zip(grads, (d, d, d_v)))
            for buf, g in zip((dq, dk, dv), grads):
                if buf is not None:
                    buf.copy_(g)
            grads = tuple(g if buf is None else buf for buf, g in zip((dq, dk, dv), grads))
        if learnable_sink is None:
            return tuple(grads)
        if packed:
            rows = varlen_row_mask(cu_seqlens_q, seqused_q, q.shape[0])
            dsink = sink_grad(learnable_sink, out, dout, lse, dlse, 1, rows, delta=delta)
        else:
            dsink = sink_grad(learnable_sink, out, dout, lse, dlse, 2, delta=delta)
    return (*grads, dsink)


def _flash_attn_bwd_sparse_mla(*args, **kwargs):
    """flash-attn-4's sparse (top-k gather) MLA backward: flash4 has no MLA."""
    raise NotImplementedError("flash4.fa4: _flash_attn_bwd_sparse_mla (sparse MLA) is not supported by flash4")
