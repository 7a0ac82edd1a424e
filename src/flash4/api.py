"""Public entry points: validate -> config -> compile (cached) -> launch.

    flash_attn_func            dense (batch, seqlen, nheads, headdim) batches
    flash_attn_varlen_func     packed variable-length batches (cu_seqlens), seqused, paged K/V
    flash_attn_with_kvcache    decode / chunked prefill against a KV cache, appending new keys in place

flash4 is CUDA-only; gradients flow through flash4.autograd.FlashAttnFunc (backward: flash4.backward)
and FlashAttnVarlenFunc (flash4.varlen.varlen_backward).
"""

from __future__ import annotations

import contextlib

import torch

import flash4.ops  # noqa: F401  (registers the flash4:: custom ops torch.compile traces)
from flash4.arch import device_arch
from flash4.autograd import FlashAttnFunc, FlashAttnVarlenFunc, sink_kwargs
from flash4.config import select_fwd_config, with_pack_gqa
from flash4.geometry import canonical_mask, window_sides
from flash4.validate import (DTYPE_NAMES, check_inputs, check_kvcache_inputs, check_kvcache_seqlens, check_softcap,
                             check_varlen_inputs, check_varlen_seqlens, check_window_size, layout_problem,
                             packed_rows_per_batch, resolve_max_seqlen, resolve_softmax_scale)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, deterministic=False, *,
                    window_size=(-1, -1), softcap=0, learnable_sink=None):
    """Exact attention softmax(softmax_scale * Q K^T) V, FlashAttention conventions.

    Args:
        q: (batch, seqlen_q, nheads, headdim) torch.bfloat16 or torch.float16, on a CUDA device.
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads_k divides nheads
           (MQA/GQA: query head h reads key head h // (nheads // nheads_k)).
        v: same shape as k, except its head dim headdim_v, which may differ from q/k's: kernels for the
           pairs (headdim, headdim_v) of flash4.config.HDIMV_PAIRS: (192, 128) (DeepSeek-V3/R1 MLA
           prefill), (128, 64), (64, 128), other pairs of multiples of 8 zero-padded to one (or to an
           equal pair); out then has headdim_v (softmax_scale's default stays
           1 / sqrt(headdim of q)).
           q, k, v: last dim contiguous (stride 1), other strides and the base address 16-byte
           aligned (true of any tensor made by torch and of slices along batch/seqlen/heads).
           headdim: kernels for flash4.config.SUPPORTED_HEADDIMS (64, 96, 128, 192, 256); any other
           multiple of 8 from 8 to 256 runs zero-padded to the next of those (flash4.headdim: exact,
           costs the padded width).
           seqlen_q may differ from seqlen_k; batch, seqlen_q and seqlen_k may be 0.
        softmax_scale: float > 0 applied to Q K^T; None means 1 / sqrt(headdim).
        causal: bool; the mask is aligned to the bottom-right corner (as FlashAttention 2/3):
           query row i sees key j iff j <= i + seqlen_k - seqlen_q. Rows that see no key
           (i < seqlen_q - seqlen_k) give out = 0 and lse = -inf; so does seqlen_k == 0.
        return_lse: bool; also return the log-sum-exp of each row.
        deterministic: bool; the backward adds the dQ contributions of the key blocks (and, when GQA/MQA
           work is split over CTAs, the dK/dV contributions of the query-head groups) in a fixed
           order, so gradients are bitwise reproducible (slower). The forward is always deterministic.
        window_size: (left, right), two ints: sliding-window (local) attention, flash-attn's rule,
           aligned bottom-right like causal: query i sees key j iff
               i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right.
           -1 makes that side unbounded on its own: (-1, -1) (the default) is full attention,
           (-1, 0) exactly causal, (left, -1) bounds the left side only. causal=True sets
           right = 0 whatever is passed. Rows whose window holds no key (e.g. (0, 0) with
           i < seqlen_q - seqlen_k) give out = 0, lse = -inf and zero gradients. Cost: only the key
           blocks that meet the band run (with both sides bounded, about seqlen_q * (left + right
           + 1) scores rounded up to tiles, instead of seqlen_q * seqlen_k); the sides are runtime
           values (changing them never recompiles).
        softcap: float >= 0, logit soft-capping (Gemma 2; 0, the default, is off; the default is the
           int 0 because torch.compile(dynamic=True) traces a float default as a symbolic float and
           then restarts the trace): the scaled scores
           become softcap * tanh(softmax_scale * q.k / softcap) before the mask and the softmax, so
           no score exceeds softcap in magnitude (Gemma 2 uses 50 for attention); lse is the
           log-sum-exp of the capped scores and the backward uses the exact derivative
           (1 - tanh**2). tanh is the GPU's tanh.approx.f32 (relative error about 2**-11, below bf16
           rounding). Cost: one tanh per score (on the MUFU unit the exponentials also use), plus
           its derivative in the backward; the value is a runtime argument (changing it never
           recompiles; 0 and > 0 are two compiled variants).
        learnable_sink: None or a (nheads,) tensor (float32, bfloat16 or float16, on q's device):
           attention sinks (gpt-oss): one extra logit sink[h] per query head joins every row's softmax
           denominator and contributes no value, out_i = sum_j p_ij v_j / (sum_j p_ij + exp(sink_h - m));
           lse includes it (log(sum_j exp(s_ij) + exp(sink_h))); a row that sees no key gives out 0 and
           lse = sink_h. Differentiable (dsink computed in torch from out, dout and lse).

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v), dtype of q, contiguous; or
        (out, lse) when return_lse, lse: (batch, nheads, seqlen_q) torch.float32, natural log.

    Raises:
        TypeError: a non-tensor argument, a dtype other than bf16/fp16, q/k/v dtypes differing,
            softmax_scale not a real number, causal or return_lse not a bool, window_size not a
            tuple/list of two ints, softcap not a real number (a bool included).
        ValueError: a rank other than 4, batch/headdim/k-v shape mismatch, nheads_k not dividing
            nheads, an unsupported headdim, a non-contiguous last dim or misaligned stride,
            softmax_scale not finite and > 0, a window side below -1, softcap NaN, infinite or
            negative, tensors not on one CUDA device, a GPU without a flash4 kernel (sm_90 only for
            now). flash4.validate.support_error(q, k, v, softmax_scale, causal, window_size, softcap,
            learnable_sink) gives the same message without raising.

    Gradients: `.backward()` through `out` gives dq, dk, dv (flash4.backward); a loss that uses lse
        (return_lse=True) adds its gradient too (dS gains P * dLSE), at no cost when lse is unused.
        Double backward (differentiating dq, dk or dv again, e.g. a gradient penalty with
        create_graph=True) is not supported: it raises a RuntimeError saying so.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap)
    causal, window_size = canonical_mask(causal, window_size)  # (-1, 0) runs the causal kernel
    padded = _padded_headdims(q, k, v, q_dim=3)
    if padded is not None:  # a head dim without a kernel: zero-padded to one (flash4.headdim, exact)
        qp, kp, vp, dv = padded
        res = flash_attn_func(qp, kp, vp, resolve_softmax_scale(softmax_scale, q.shape[3]), causal, return_lse,
                              deterministic, window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
        return (res[0][..., :dv].contiguous(), res[1]) if return_lse else res[..., :dv].contiguous()
    if torch.compiler.is_compiling():
        # torch.compile: one custom op per call (flash4.ops); its real implementation checks the
        # arguments when the compiled graph runs (pointers and the device are not known here).
        out, lse, _ = torch.ops.flash4.fwd(q, k, v, resolve_softmax_scale(softmax_scale, q.shape[3]), causal,
                                           deterministic, *window_size, softcap, *_sink_arg(learnable_sink))
        return (out, lse) if return_lse else out
    check_inputs(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink)
    scale = resolve_softmax_scale(softmax_scale, q.shape[3])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (learnable_sink is not None and learnable_sink.requires_grad)):
        out, lse = FlashAttnFunc.apply(q, k, v, scale, causal, deterministic, window_size, softcap,
                                       *_sink_arg(learnable_sink))
    else:
        out, lse = _flash_attn_forward(q, k, v, scale, causal, window_size=window_size, softcap=softcap,
                                       **sink_kwargs(learnable_sink))
    return (out, lse) if return_lse else out


def _flash_attn_forward(q, k, v, softmax_scale=None, causal=False, out=None, lse=None, lse_split=None,
                        window_size=None, softcap: float = 0.0, learnable_sink=None):
    """Forward on validated inputs (flash4.validate.check_inputs); returns (out, lse).

    out: None or a preallocated (batch, seqlen_q, nheads, headdim_v) tensor of q's dtype and device
        (last dim contiguous, 16-byte aligned; headdim_v = v.shape[-1]) that the kernel overwrites;
    lse: None or a preallocated contiguous float32 (batch, nheads, seqlen_q) tensor.
    lse_split: None or a preallocated contiguous float32 (2, batch, nheads, seqlen_q) tensor that
        receives the log2-domain LSE unrounded, lse * log2(e) = lse_split[0] + lse_split[1] (+inf
        and 0 for rows that see no key); flash4.backward takes it for an exact P at any magnitude.
    window_size: None or flash-attn's (left, right) sliding window (flash_attn_func's rule; -1 per
        side is unbounded); flash4.geometry.window_sides turns it into the local config's runtime
        sides, or None for plain full / causal attention.
    softcap: float >= 0, logit soft-capping (flash_attn_func's; 0 = off): selects the softcap config
        variant (select_fwd_config(softcap=softcap > 0)) and is passed to the kernel as a runtime value.
    learnable_sink: None or a validated (nheads,) tensor (attention sinks): selects the sink config
        variant and is passed to the runner as a contiguous float32 (nheads,) tensor.
    Tests pass NaN-filled out/lse to catch unwritten elements. Empty problems never launch:
    batch == 0 or seqlen_q == 0 give empty out/lse; seqlen_k == 0 gives out = 0, lse = -inf (lse =
    the sink with learnable_sink).
    Raises ValueError for a preallocated out/lse of the wrong shape, dtype, device or layout.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, headdim_v = k.shape[1], v.shape[-1]
    scale = resolve_softmax_scale(softmax_scale, headdim)
    out_shape, lse_shape = (batch, seqlen_q, nheads, headdim_v), (batch, nheads, seqlen_q)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    else:
        _check_buffer("out", out, out_shape, q.dtype, q.device)
        problem = layout_problem("out", out)
        if problem is not None:
            raise ValueError(problem)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    else:
        _check_buffer("lse", lse, lse_shape, torch.float32, q.device)
        if not lse.is_contiguous():
            raise ValueError(f"lse must be contiguous; got strides {lse.stride()}")
    if out.numel() == 0:
        return out, lse
    sink = None if learnable_sink is None else learnable_sink.detach().float().contiguous()
    if seqlen_k == 0:
        out.zero_()
        _fill_no_key_lse(lse, sink, 1)
        if lse_split is not None:
            lse_split[0].fill_(float("inf"))
            lse_split[1].zero_()
        return out, lse

    from flash4.compile.cache import get_fwd_runner  # late: compiling pulls in the CuTe DSL

    window = window_sides(window_size, causal)
    cfg = select_fwd_config(headdim, DTYPE_NAMES[q.dtype], causal, arch=device_arch(q.device), local=window is not None,
                            softcap=softcap > 0, **({} if sink is None else {"sink": True}),
                            **({} if headdim_v == headdim else {"headdim_v": headdim_v}), seqlen_k=seqlen_k)
    cfg = with_pack_gqa(cfg, q.shape[2], k.shape[2])
    run = get_fwd_runner(cfg)
    kwargs = {"window": window, "softcap": softcap}
    if sink is not None:
        kwargs["sink"] = sink
    if q.device.index == torch.cuda.current_device():
        run(q, k, v, out, lse, scale, lse_split, **kwargs)
    else:
        with torch.cuda.device(q.device):
            run(q, k, v, out, lse, scale, lse_split, **kwargs)
    return out, lse


def _padded_headdims(q, k, v, q_dim: int):
    """None when (q, k, v) need no padding (native head dims, or inputs the validation will reject
    anyway); else (q, k, v) zero-padded on their last dim to the head dims flash4.headdim picks, and
    v's own head dim (the output is sliced back to it). Raises ValueError with flash4.headdim.RULE
    for a head dim that is not a multiple of 8 in [8, 256]. q_dim: q's head-dim axis (3 dense, 2 varlen)."""
    from flash4 import headdim as hd

    if not all(isinstance(t, torch.Tensor) and t.dim() == q_dim + 1 for t in (q, k, v)):
        return None
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if dk != d or hd.is_native(d, dv):
        return None
    for name, value in (("q/k", d), ("v", dv)):
        if not hd.servable(value):
            raise ValueError(f"headdim {value} ({name}.shape[{q_dim}]) is not supported: {hd.RULE}")
    d_p, dv_p = hd.padded_headdims(d, dv)
    return hd.pad_last(q, d_p), hd.pad_last(k, d_p), hd.pad_last(v, dv_p), dv


def _sink_arg(learnable_sink) -> tuple:
    """() or (learnable_sink,): the trailing positional sink of the ops / autograd Functions."""
    return () if learnable_sink is None else (learnable_sink,)


def _fill_no_key_lse(lse, sink, heads_dim: int) -> None:
    """lse of rows that see no key: -inf, or the sink of the row's head (learnable_sink; sink a
    float32 (nheads,) tensor, heads_dim the head axis of lse)."""
    if sink is None:
        lse.fill_(float("-inf"))
    else:
        shape = [1] * lse.dim()
        shape[heads_dim] = -1
        lse.copy_(sink.view(shape).expand_as(lse))


def _check_buffer(name, t, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be {dtype} of shape {shape} on {device}; got {t.dtype} of shape {tuple(t.shape)} on {t.device}"
        )


# ================================================================ varlen / paged
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                           seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0, return_lse=False, deterministic=False,
                           check_seqlens=False, learnable_sink=None):
    """Exact attention over a batch of variable-length sequences packed along one dim (flash-attn's
    `flash_attn_varlen_func` conventions; flash-attn-4's for paged K/V).

    Args:
        q: (total_q, nheads, headdim) torch.bfloat16 or torch.float16 on a CUDA device; sequence b's
           queries are rows cu_seqlens_q[b] : cu_seqlens_q[b + 1].
        k, v: (total_k, nheads_k, headdim), same dtype and device; sequence b's keys are rows
           cu_seqlens_k[b] : cu_seqlens_k[b + 1]. nheads_k divides nheads (MQA/GQA: query head h
           reads key head h // (nheads // nheads_k)). Head dims as flash_attn_func's (kernel head
           dims and flash4.config.HDIMV_PAIRS as they are, other multiples of 8 zero-padded; not for a
           paged pool, which keeps the kernel head dims); out is (total_q, nheads, headdim_v).
           Paged K/V (with page_table): (num_pages, page_size, nheads_k, headdim), page_size a
           multiple of 8 (16, 32, 64, 128, 256, ...); key j of sequence b is
           k[page_table[b, j // page_size], j % page_size]. K and V may be two views of one
           interleaved cache tensor (vLLM's layout): only the last dim must be contiguous, every
           other stride and the base 16-byte aligned (as flash_attn_func's q/k/v).
        cu_seqlens_q: (batch + 1,) torch.int32 on q's device, prefix sums starting at 0
           (cu_seqlens_q[-1] <= total_q). batch is cu_seqlens_q.numel() - 1.
        cu_seqlens_k: (batch + 1,) torch.int32 likewise over k/v; must be None with page_table.
        max_seqlen_q: >= every sequence's query count: sizes the launch grid. A Python int; a 0-d
           integer tensor (CPU or CUDA: read with .item(), a host sync for a CUDA tensor); or None:
           computed as max(seqused_q) or max(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) (a host sync).
           A value below the longest sequence leaves its later rows uncomputed (check_seqlens=True
           catches it). Changing it never recompiles (under torch.compile an int may specialize
           once before it is made dynamic; a tensor or None is computed from the metadata when the
           compiled graph runs, a host sync: flash4.ops).
        max_seqlen_k: the same for the keys; only the backward reads it (when None or a CUDA tensor,
           it is resolved, with a host sync, when the backward runs); ignored without autograd.
        seqused_q: None or (batch,) int32: only the first seqused_q[b] queries of sequence b are
           computed (the rows past it give out = 0, lse = -inf, and no gradient).
        seqused_k: None or (batch,) int32: only the first seqused_k[b] keys of sequence b are
           attended. Required with page_table (it is then each sequence's key count).
        page_table: None or (batch, max_pages_per_seq) int32: the cache pages of each sequence
           (paged K/V, flash-attn-4 / vLLM). Only the first ceil(seqused_k[b] / page_size) entries
           of row b are read. No backward: a loss through a paged call raises a RuntimeError when
           its backward runs.
        softmax_scale: float > 0 applied to Q K^T; None means 1 / sqrt(headdim).
        causal: bool; per sequence, aligned bottom-right: query i of a sequence with len_q queries
           and len_k keys sees key j iff j <= i + len_k - len_q. Rows that see no key (len_k == 0,
           or causal with i < len_q - len_k) give out = 0 and lse = -inf. Sequences of length 0
           (queries or keys) are valid anywhere in the batch.
        window_size: (left, right), two ints: sliding-window (local) attention per sequence,
           flash-attn's rule aligned bottom-right: query i of a sequence sees key j iff
               i + len_k - len_q - left <= j <= i + len_k - len_q + right
           (len_q / len_k: that sequence's counts, seqused_* when given). -1 makes that side
           unbounded on its own ((-1, -1), the default: full attention; (-1, 0): exactly causal);
           causal=True sets right = 0. Rows whose window holds no key give out = 0, lse = -inf and
           zero gradients; a sequence shorter than the window simply sees all of its keys the rule
           allows. Cost: only the key blocks that meet each sequence's band run; the sides are
           runtime values (changing them never recompiles). Paged K/V included.
        softcap: float >= 0, logit soft-capping (Gemma 2; 0, the default, is off): the scaled scores
           become softcap * tanh(softmax_scale * q.k / softcap) before the mask and the softmax, so
           no score exceeds softcap in magnitude (Gemma 2 uses 50 for attention); per sequence,
           paged K/V included; the backward uses the exact derivative (1 - tanh**2). tanh is the
           GPU's tanh.approx.f32 (relative error about 2**-11, below bf16 rounding). Cost: one tanh
           per score (on the MUFU unit the exponentials also use), plus its derivative in the
           backward; the value is a runtime argument (changing it never recompiles; 0 and > 0 are
           two compiled variants).
        learnable_sink: None or a (nheads,) tensor (float32, bfloat16 or float16, on q's device):
           attention sinks (gpt-oss): one extra logit sink[h] per query head joins every row's softmax
           denominator and contributes no value, out_i = sum_j p_ij v_j / (sum_j p_ij + exp(sink_h - m));
           lse includes it (log(sum_j exp(s_ij) + exp(sink_h))); a row that sees no key gives out 0 and
           lse = sink_h. Differentiable (dsink computed in torch from out, dout and lse over
           the rows inside a sequence).
        return_lse: bool; also return the log-sum-exp of each row.
        deterministic: bool; bitwise reproducible backward (dQ summed in a fixed order), slower.
        check_seqlens: bool; also check the values of the metadata on the device before launching
           (costs one host sync, so off by default): cu_seqlens start at 0, never decrease and stay
           within total_q / total_k; seqused within the stored lengths (paged: within
           page_table.shape[1] * page_size); the page_table entries in use within [0, num_pages);
           max_seqlen_q / max_seqlen_k (when given) not below the longest sequence. Without it,
           such values are undefined behaviour (out-of-range reads, rows left uncomputed).

    Returns:
        out: (total_q, nheads, headdim), dtype of q, contiguous; or (out, lse) when return_lse, lse:
        (nheads, total_q) torch.float32, natural log. Query rows outside every sequence are not
        computed: with seqused_q given, out is 0 and lse -inf there; without it, the rows past
        cu_seqlens_q[-1] are left unspecified (no memset, as flash-attn).

    Raises:
        TypeError: a non-tensor q/k/v/cu_seqlens_q; a dtype other than bf16/fp16 or q/k/v dtypes
            differing; cu_seqlens_*, seqused_* or page_table not torch.int32 (e.g. int64, float);
            max_seqlen_* neither an int, an integer 0-d tensor nor None; softmax_scale, causal,
            return_lse, deterministic or check_seqlens of the wrong type; window_size not a
            tuple/list of two ints; softcap not a real number (a bool included).
        ValueError: ranks (q 3-D; k/v 3-D, or 4-D with page_table), cu_seqlens_k / seqused_q /
            seqused_k / page_table not matching batch = cu_seqlens_q.numel() - 1, cu_seqlens_k given
            with page_table or missing without it, seqused_k missing with page_table, page_size not a
            multiple of 8 (e.g. 1), headdim / heads rules as flash_attn_func, strides, a window side
            below -1, softcap NaN, infinite or negative, devices (every tensor on q's CUDA device),
            the GPU's SM version; with
            check_seqlens, bad metadata values.
            flash4.validate.varlen_support_error(...) gives the metadata message without raising.

    Gradients: `.backward()` through out (and lse) gives dq, dk, dv (flash4.varlen.varlen_backward),
        not for paged K/V; double backward raises a RuntimeError, as flash_attn_func.
    Source convention: flash-attn 2/3 `flash_attn_varlen_func` (argument order, layouts, LSE
    (nheads, total_q)); paged K/V as flash-attn-4's (page_table + seqused_k, cu_seqlens_k None).
    """
    for name, value in (("return_lse", return_lse), ("deterministic", deterministic), ("check_seqlens", check_seqlens)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap)
    causal, window_size = canonical_mask(causal, window_size)  # (-1, 0) runs the causal kernel
    padded = None if page_table is not None else _padded_headdims(q, k, v, q_dim=2)  # pools are not padded per call
    if padded is not None:  # a head dim without a kernel: zero-padded to one (flash4.headdim, exact)
        qp, kp, vp, dv = padded
        res = flash_attn_varlen_func(
            qp, kp, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
            seqused_k=seqused_k, softmax_scale=resolve_softmax_scale(softmax_scale, q.shape[2]), causal=causal,
            window_size=window_size, softcap=softcap, return_lse=return_lse, deterministic=deterministic,
            check_seqlens=check_seqlens, learnable_sink=learnable_sink)
        return (res[0][..., :dv].contiguous(), res[1]) if return_lse else res[..., :dv].contiguous()
    if torch.compiler.is_compiling():
        # torch.compile: one flash4::varlen_fwd per call (flash4.ops), checked when the graph runs. A
        # max_seqlen given as a tensor (or None) is not read while tracing: the op computes it.
        out, lse, _ = torch.ops.flash4.varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, _host_int_or_none(max_seqlen_q),
            _host_int_or_none(max_seqlen_k), resolve_softmax_scale(softmax_scale, q.shape[2]), causal, deterministic,
            check_seqlens, *window_size, softcap, *_sink_arg(learnable_sink))
        return (out, lse) if return_lse else out
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_q = _prepare_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
        softmax_scale, causal, window_size, softcap, learnable_sink, check_seqlens)
    scale = resolve_softmax_scale(softmax_scale, q.shape[2])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (learnable_sink is not None and learnable_sink.requires_grad)):
        out, lse = FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
                                             max_q, max_seqlen_k, scale, causal, deterministic, window_size, softcap,
                                             *_sink_arg(learnable_sink))
    else:
        out, lse = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, scale, causal, seqused_q,
                                              seqused_k, page_table, window_size=window_size, softcap=softcap,
                                              **sink_kwargs(learnable_sink))
    return (out, lse) if return_lse else out


def _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                    page_table, softmax_scale, causal, window_size, softcap, learnable_sink, check_seqlens):
    """The varlen entry's checks and metadata preparation (eager path and flash4::varlen_fwd):
    argument checks, contiguous metadata, the optional on-device value checks, max_seqlen_q.
    Returns (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q)."""
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                        page_table, softmax_scale, causal, window_size, softcap, learnable_sink)
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table = (
        _contiguous(t) for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table))
    paged = page_table is not None
    if check_seqlens:
        check_varlen_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], seqused_q=seqused_q,
                             seqused_k=seqused_k, page_table=page_table, num_pages=k.shape[0] if paged else 0,
                             page_size=k.shape[1] if paged else 0, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    max_q = resolve_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, seqused_q)
    return cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_q


def _contiguous(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


def _host_int_or_none(value):
    """A max_seqlen for flash4::varlen_fwd under torch.compile: a tensor (or None) becomes None (the op
    computes the maximum from the metadata when it runs), anything else (an int, a SymInt) passes."""
    return None if value is None or isinstance(value, torch.Tensor) else value


def _device_guard(device: torch.device):
    """Launch on `device` when it is not the current CUDA device (a no-op for other devices)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, softmax_scale: float,
                               causal: bool, seqused_q=None, seqused_k=None, page_table=None, out=None, lse=None,
                               lse_split=None, window_size=None, softcap: float = 0.0, learnable_sink=None):
    """Forward on validated varlen / paged inputs (check_varlen_inputs; metadata contiguous);
    returns (out, lse) from flash4.varlen.varlen_forward.

    out: None or a preallocated (total_q, nheads, headdim) tensor of q's dtype and device (last dim
    contiguous, 16-byte aligned); lse: None or a contiguous float32 (nheads, total_q) tensor;
    lse_split: None or a contiguous float32 (2, nheads, total_q) tensor (the log2-domain LSE
    unrounded, for the backward). window_size: None or flash-attn's (left, right) sliding window,
    per sequence (flash_attn_varlen_func's rule). softcap: float >= 0 logit soft-capping (0 = off).
    Query rows outside every sequence are left as
    they were (tests pass NaN-filled buffers; out/lse allocated here start as 0 / -inf when
    seqused_q is given).
    Nothing launches when there is no query row (total_q, batch or max_seqlen_q 0); without any key
    storage (total_k == 0, or no pages) every row gets out = 0, lse = -inf. Raises ValueError for a
    preallocated buffer of the wrong shape, dtype, device or layout.
    """
    total_q, nheads, headdim = q.shape
    out, lse = _varlen_buffers(q, out, lse, lse_split, seqused_q, headdim_v=v.shape[-1])
    if total_q == 0 or cu_seqlens_q.numel() <= 1 or max_seqlen_q == 0:
        return out, lse
    sink = None if learnable_sink is None else learnable_sink.detach().float().contiguous()
    if k.numel() == 0:
        out.zero_()
        _fill_no_key_lse(lse, sink, 0)
        if lse_split is not None:
            lse_split[0].fill_(float("inf"))
            lse_split[1].zero_()
        return out, lse

    from flash4 import varlen  # late: the kernels' host side pulls in the compile cache when run

    with _device_guard(q.device):
        varlen.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal,
                              seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table, out=out, lse=lse,
                              lse_split=lse_split, window_size=window_size, softcap=softcap,
                              **sink_kwargs(sink))
    return out, lse


def _varlen_buffers(q, out, lse, lse_split, seqused_q=None, headdim_v=None):
    """out / lse checked, or allocated: as torch.empty, or, with seqused_q (rows that will stay
    unwritten inside the sequences), as 0 / -inf (flash4.varlen.varlen_forward's own choice)."""
    total_q, nheads, headdim = q.shape
    headdim = headdim if headdim_v is None else headdim_v  # out has v's head dim
    padded = seqused_q is not None
    if out is None:
        out = (torch.zeros if padded else torch.empty)(total_q, nheads, headdim, dtype=q.dtype, device=q.device)
    else:
        _check_buffer("out", out, (total_q, nheads, headdim), q.dtype, q.device)
        problem = layout_problem("out", out)
        if problem is not None:
            raise ValueError(problem)
    for name, buf, shape in (("lse", lse, (nheads, total_q)), ("lse_split", lse_split, (2, nheads, total_q))):
        if buf is not None:
            _check_buffer(name, buf, shape, torch.float32, q.device)
            if not buf.is_contiguous():
                raise ValueError(f"{name} must be contiguous; got strides {buf.stride()}")
    if lse is None:
        lse = (torch.full((nheads, total_q), float("-inf"), dtype=torch.float32, device=q.device) if padded
               else torch.empty(nheads, total_q, dtype=torch.float32, device=q.device))
    return out, lse


def _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                max_seqlen_k: int, softmax_scale: float, causal: bool, seqused_q=None, seqused_k=None,
                                deterministic=False, lse_split=None, dlse=None, dq=None, dk=None, dv=None,
                                window_size=None, softcap: float = 0.0):
    """Gradients (dq, dk, dv) through flash4.varlen.varlen_backward (packed K/V only); every
    gradient is 0 when no query row or no key exists (nothing launches then). window_size and
    softcap: the forward's (None or flash-attn's (left, right); 0 = no soft-capping)."""
    batch = cu_seqlens_q.numel() - 1
    if (q.shape[0] == 0 or k.shape[0] == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0):
        grads = []
        for g, like in ((dq, q), (dk, k), (dv, v)):
            grads.append(torch.zeros_like(like, memory_format=torch.contiguous_format) if g is None else g.zero_())
        return tuple(grads)

    from flash4 import varlen

    with _device_guard(q.device):
        return varlen.varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            seqused_q=seqused_q, seqused_k=seqused_k, deterministic=deterministic, lse_split=lse_split, dlse=dlse,
            dq=dq, dk=dk, dv=dv, window_size=window_size, softcap=softcap)


# ================================================================ KV cache (decode)
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None, *,
                            cache_batch_idx=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0,
                            num_splits=0, return_lse=False, out=None, check_seqlens=False, learnable_sink=None):
    """Attention of new queries against a KV cache, appending new keys/values to the cache in place
    first (flash-attn 2/3's `flash_attn_with_kvcache`: decode, speculative decode, chunked prefill).

    Args:
        q: (batch, seqlen_q, nheads, headdim) torch.bfloat16 or torch.float16 on a CUDA device.
        k_cache, v_cache: the cache, same dtype and device, either dense
           (batch_cache, seqlen_cache, nheads_k, headdim) (sequence b uses row cache_batch_idx[b],
           or row b; then batch_cache == batch), or paged (num_pages, page_size, nheads_k, headdim)
           (v_cache, and the appended v, may have their own head dim for the pairs of
           flash4.config.HDIMV_PAIRS; out is then (batch, seqlen_q, nheads, headdim_v))
           with page_table (page_size a multiple of 8). nheads_k divides nheads (MQA/GQA).
           K and V may be two views of one interleaved tensor; last dim contiguous, other strides
           16-byte aligned; with cache_batch_idx, a dense cache's batch stride must be the same
           whole number (>= seqlen_cache) of token rows in k_cache and v_cache.
        k, v: None, or the new keys/values (batch, seqlen_new, nheads_k, headdim), written in place
           into the cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of
           sequence b (through page_table when paged) before attending. Both or neither.
        cache_seqlens: the number of keys already in each sequence's cache: a Python int (the same
           for every sequence), a (batch,) torch.int32 tensor (read on the device: no host sync, so
           CUDA-graph safe), or None (the whole cache: seqlen_cache, or page_table.shape[1] *
           page_size; not allowed with k/v). Each sequence attends cache_seqlens[b] + seqlen_new keys.
        page_table: None or (batch, max_pages_per_seq) torch.int32: the pages of each sequence.
        cache_batch_idx: None or (batch,) torch.int32: the cache row of each sequence (dense cache
           only; with page_table index its rows instead). With duplicates and k/v given, which
           sequence's new keys land in a shared row is unspecified (as flash-attn).
        softmax_scale: float > 0; None means 1 / sqrt(headdim).
        causal: bool; aligned bottom-right: query i (of seqlen_q) of sequence b sees key j iff
           j <= i + n_b - seqlen_q, n_b = cache_seqlens[b] + seqlen_new (decode with seqlen_q 1
           sees every key either way). Rows that see no key give out = 0, lse = -inf.
        window_size: (left, right), two ints: sliding-window (local) attention, flash-attn's rule
           aligned bottom-right: query i of sequence b sees key j iff
               i + n_b - seqlen_q - left <= j <= i + n_b - seqlen_q + right
           (n_b = cache_seqlens[b] + seqlen_new, as for causal). -1 makes that side unbounded on its
           own ((-1, -1), the default: the whole cache; (-1, 0): exactly causal); causal=True sets
           right = 0. A decode step with window (W - 1, 0) attends the last W keys of each cache.
           Rows whose window holds no key give out = 0, lse = -inf. Cost: only the key blocks that
           meet the band are read (a window over a long cache reads about left + right + 1 keys
           per query, not the whole cache); a real window turns off the GQA packing of decode steps
           (flash4.decode). The sides are runtime values (changing them never recompiles).
        softcap: float >= 0, logit soft-capping (Gemma 2; 0, the default, is off): the scaled scores
           become softcap * tanh(softmax_scale * q.k / softcap) before the mask and the softmax, so
           no score exceeds softcap in magnitude (Gemma 2 uses 50 for attention); both paths (decode
           and cache_batch_idx). tanh is the GPU's tanh.approx.f32 (relative error about 2**-11,
           below bf16 rounding). Cost: one tanh per score (on the MUFU unit the exponentials also
           use); the value is a runtime argument (changing it never recompiles; 0 and > 0 are two
           compiled variants).
        learnable_sink: None or a (nheads,) tensor (float32, bfloat16 or float16, on q's device):
           attention sinks (gpt-oss): one extra logit sink[h] per query head joins every row's softmax
           denominator and contributes no value, out_i = sum_j p_ij v_j / (sum_j p_ij + exp(sink_h - m));
           lse includes it (log(sum_j exp(s_ij) + exp(sink_h))); a row that sees no key gives out 0 and
           lse = sink_h. Both paths, split-KV
           included (the combine kernel adds the sink).
        num_splits: how many CTAs share the keys of one (sequence, KV head) tile (split-KV; their
           partial results are merged by a combine kernel): 0 = auto (flash4.decode.choose_num_splits:
           split only when batch x KV-head tiles fill less than 80% of the SMs, from host-known sizes
           only), 1 = no split, n > 1 = n (clamped to the cache's key blocks). Not with
           cache_batch_idx (0 and 1 only there).
        return_lse: bool; also return the log-sum-exp of each row.
        out: None or a preallocated (batch, seqlen_q, nheads, headdim) tensor of q's dtype (last dim
           contiguous, out.stride(0) == seqlen_q * out.stride(1)); written and returned.
        check_seqlens: bool; check cache_seqlens (>= 0, room for the appended k/v), cache_batch_idx
           and the page_table entries in use on the device before writing anything (one host
           sync). Without it, with a tensor cache_seqlens the caller guarantees
           cache_seqlens[b] + seqlen_new <= the cache's capacity and valid page indices: values out
           of range are undefined behaviour (a device-side assert in the append).

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; or (out, lse) when return_lse, lse:
        (batch, nheads, seqlen_q) torch.float32, natural log.

    Raises:
        TypeError: non-tensors, dtypes (q bf16/fp16; caches, k, v and out of q's dtype;
            cache_seqlens, page_table and cache_batch_idx torch.int32), num_splits, softmax_scale,
            causal, return_lse or check_seqlens of the wrong type, window_size not a tuple/list of
            two ints, softcap not a real number (a bool included).
        ValueError: ranks and shapes (batch, heads, headdim, page size), k without v, a cache too
            small for the appended k/v (seqlen_new above the capacity, or cache_seqlens +
            seqlen_new above it for an int cache_seqlens; per sequence with check_seqlens),
            cache_batch_idx with page_table, num_splits > 1 with cache_batch_idx, a window side below
            -1, softcap NaN, infinite or negative, strides, devices, the SM version.
            flash4.validate.kvcache_support_error(...) gives the message without raising.

    No autograd (the result carries no gradient), as flash-attn's. The attention runs in
    flash4.decode.decode_forward with seqused_k = cache_seqlens + seqlen_new: the query heads of one
    KV head are packed into one tile (K/V read once per KV head) and the keys split as num_splits
    says. With cache_batch_idx it runs in flash4.varlen.varlen_forward over the dense cache seen as
    packed rows (row offsets cache_batch_idx[b] * rows per entry). Changing cache_seqlens,
    page_table or the batch contents never recompiles; the call has no host sync (with a tensor
    cache_seqlens and check_seqlens=False), so it can be captured in a CUDA graph.
    """
    for name, value in (("return_lse", return_lse), ("check_seqlens", check_seqlens)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap)
    causal, window_size = canonical_mask(causal, window_size)  # (-1, 0) runs the causal kernel
    if torch.compiler.is_compiling():
        # torch.compile: one flash4::kvcache per call (it mutates k_cache / v_cache; flash4.ops);
        # an out= buffer receives a copy of the op's result (an op output may not alias an input).
        tensor_seqlens = isinstance(cache_seqlens, torch.Tensor)
        with torch.no_grad():
            result, lse = torch.ops.flash4.kvcache(
                q, k_cache, v_cache, k, v, cache_seqlens if tensor_seqlens else None,
                None if tensor_seqlens else cache_seqlens, page_table, cache_batch_idx,
                resolve_softmax_scale(softmax_scale, q.shape[3]), causal, num_splits, check_seqlens, *window_size,
                softcap, *_sink_arg(learnable_sink))
            if out is not None:
                out.copy_(result)
                result = out
        return (result, lse) if return_lse else result
    check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale, causal,
                         num_splits, out, window_size, softcap, learnable_sink)
    scale = resolve_softmax_scale(softmax_scale, q.shape[3])
    with torch.no_grad():
        out, lse = _flash_attn_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, scale,
                                       causal, num_splits, out=out, check_seqlens=check_seqlens,
                                       window_size=window_size, softcap=softcap, **sink_kwargs(learnable_sink))
    return (out, lse) if return_lse else out


def _flash_attn_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale: float,
                        causal: bool, num_splits: int = 0, out=None, lse=None, check_seqlens=False,
                        window_size=None, softcap: float = 0.0, learnable_sink=None):
    """flash_attn_with_kvcache on validated inputs (check_kvcache_inputs): append, then attend.
    out: None or (batch, seqlen_q, nheads, headdim); lse: None or a contiguous float32
    (batch, nheads, seqlen_q); window_size: None or flash-attn's (left, right); softcap: float >= 0
    (0 = off) (both paths).
    Returns (out, lse).

    The attention runs in flash4.decode.decode_forward (GQA packing, split-KV) over the cache
    rows 0..batch-1 or the page_table; with cache_batch_idx it runs in flash4.varlen.varlen_forward
    over the dense cache seen as packed rows (_dense_cache_rows), without splitting."""
    batch, seqlen_q, nheads, headdim = q.shape
    headdim_v = v_cache.shape[-1]
    paged = page_table is not None
    page_table, cache_batch_idx = _contiguous(page_table), _contiguous(cache_batch_idx)
    seqlen_new = 0 if k is None else k.shape[1]
    capacity = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    device = q.device
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = _contiguous(cache_seqlens)
    else:
        seqlens = torch.full((batch,), capacity if cache_seqlens is None else cache_seqlens, dtype=torch.int32,
                             device=device)
    if check_seqlens:
        check_kvcache_seqlens(seqlens, seqlen_new, capacity, batch_cache=k_cache.shape[0],
                              cache_batch_idx=cache_batch_idx, page_table=page_table, num_pages=k_cache.shape[0],
                              page_size=k_cache.shape[1])
    if out is None:
        out = torch.empty(batch, seqlen_q, nheads, headdim_v, dtype=q.dtype, device=device)
    if lse is None:
        lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=device)
    if seqlen_new > 0 and batch > 0:
        _append_kv(k_cache, v_cache, k, v, seqlens, page_table, cache_batch_idx)
    seqused_k = seqlens + seqlen_new if seqlen_new > 0 else seqlens

    if out.numel() == 0:
        return out, lse
    sink = None if learnable_sink is None else learnable_sink.detach().float().contiguous()
    if k_cache.numel() == 0:  # no key storage: every sequence has 0 keys
        out.zero_()
        _fill_no_key_lse(lse, sink, 1)
        return out, lse
    if cache_batch_idx is None:
        from flash4 import decode  # late: the kernels' host side

        with _device_guard(device):
            decode.decode_forward(q, k_cache, v_cache, seqused_k, softmax_scale, causal, page_table=page_table,
                                  num_splits=num_splits, out=out, lse=lse, window_size=window_size, softcap=softcap,
                                  **sink_kwargs(sink))
        return out, lse
    total_q = batch * seqlen_q
    k_rows, v_rows, cu_seqlens_k = _dense_cache_rows(k_cache, v_cache, batch, cache_batch_idx)
    cu_seqlens_q = torch.arange(0, total_q + 1, seqlen_q, dtype=torch.int32, device=device)
    lse_packed = torch.empty(nheads, total_q, dtype=torch.float32, device=device)
    _flash_attn_varlen_forward(q.reshape(total_q, nheads, headdim), k_rows, v_rows, cu_seqlens_q, cu_seqlens_k,
                               seqlen_q, softmax_scale, causal, seqused_k=seqused_k,
                               out=out.view(total_q, nheads, headdim_v), lse=lse_packed, window_size=window_size,
                               softcap=softcap, **sink_kwargs(sink))
    lse.copy_(lse_packed.view(nheads, batch, seqlen_q).transpose(0, 1))
    return out, lse


def _append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx) -> None:
    """k/v (batch, seqlen_new, Hk, D) -> cache positions cache_seqlens[b] + t, in place, on the
    device (index_put_: no host sync; out-of-range positions trip a device-side assert)."""
    batch, seqlen_new = k.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)[None]  # (batch, seqlen_new)
    if page_table is not None:
        page_size = k_cache.shape[1]
        index = (page_table.gather(1, pos // page_size).long(), pos % page_size)
    else:
        rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch, device=k.device)
        index = (rows[:, None].expand(batch, seqlen_new), pos)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def _dense_cache_rows(k_cache, v_cache, batch: int, cache_batch_idx):
    """A non-empty dense cache (batch_cache, seqlen_cache, Hk, D) as packed rows (total_rows, Hk, D)
    of stride stride(1) (a view of the same memory) and the (batch + 1,) int32 row offsets of each
    sequence's cache row, cache_batch_idx[b] times the rows per batch entry. The offsets need not
    increase (cache_batch_idx is any selection): with seqused_k given the kernel reads
    cu_seqlens_k[b] as sequence b's offset only (flash4.kernels.common.seqinfo); the last entry is
    total_rows."""
    device = k_cache.device
    rows_per_batch = packed_rows_per_batch(k_cache)
    total_rows = (k_cache.shape[0] - 1) * rows_per_batch + k_cache.shape[1]
    if total_rows >= 2 ** 31:
        raise ValueError(f"the dense cache spans {total_rows} token rows; flash4 addresses at most 2**31 - 1 "
                         f"(use a paged cache)")

    def rows(cache):
        return cache.as_strided((total_rows,) + tuple(cache.shape[2:]), (cache.stride(1),) + cache.stride()[2:])

    cu_seqlens_k = torch.full((batch + 1,), total_rows, dtype=torch.int32, device=device)
    torch.mul(cache_batch_idx, rows_per_batch, out=cu_seqlens_k[:batch])
    return rows(k_cache), rows(v_cache), cu_seqlens_k
