"""Public entry points (the doors): check the Python flags, zero-pad head dims without a kernel
(flash4.headdim), build the request (flash4.validate; flash4.request), run it.

    flash_attn_func            dense (batch, seqlen, nheads, headdim) batches
    flash_attn_varlen_func     packed variable-length batches (cu_seqlens), seqused, paged K/V
    flash_attn_with_kvcache    decode / chunked prefill against a KV cache, appending new keys in place

flash4 is CUDA-only. The host forward is flash4.forward, the backward flash4.backward; gradients
flow through flash4.autograd (one path for eager mode and torch.compile, over the custom ops of
flash4.ops); calls that need no gradient run flash4.forward directly.
"""

from __future__ import annotations

import torch

from flash4 import autograd, forward, memo, ops, validate
from flash4.geometry import canonical_mask
from flash4.request import Request
from flash4.validate import check_softcap, check_window_size, resolve_softmax_scale


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
           headdim: kernels for flash4.config.SUPPORTED_HEADDIMS (64, 96, 128, 192, 256) and, on
           sm_90, every multiple of 16 up to 128 (16, 32, 48, 80, 112; FLASH4_HEADDIM16); any other
           multiple of 8 from 8 to 256 runs zero-padded to the next kernel head dim (flash4.headdim:
           exact, costs the padded width).
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
            softmax_scale not a real number, causal or return_lse not a bool (a tuple or list where
            return_lse goes is a window_size passed positionally: the message says it is
            keyword-only), window_size not a tuple/list of two ints, softcap not a real number (a
            bool included).
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

    Decode: a call without autograd whose queries are few (seqlen_q <= 8) and keys many (seqlen_k >=
        1024) runs as flash_attn_with_kvcache's decode step (GQA packing, split-KV and its combine),
        chosen from the shapes alone (flash4.config.decode_door; no host sync, CUDA-graph safe).
    """
    # a signature seen before: its prepared call (flash4.memo: checks and plan skipped, same launches)
    key = memo.dense_key(q, k, v, softmax_scale, causal, return_lse, deterministic, window_size, softcap,
                         learnable_sink)
    call = memo.get(key)
    if call is not None:
        out, lse = call(q, k, v, learnable_sink)
        return (out, lse) if return_lse else out
    _check_flags(return_lse=return_lse, deterministic=deterministic)
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap)
    causal, window_size = canonical_mask(causal, window_size)  # (-1, 0) runs the causal kernel
    narrow = _narrow_forward(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, deterministic,
                             key)
    if narrow is not None:  # a padded head dim without autograd: the narrow tensors read as they are
        return narrow if return_lse else narrow[0]
    padded = _padded_headdims(q, k, v, q_dim=3, learnable_sink=learnable_sink)
    if padded is not None:  # a head dim without a kernel: zero-padded to one (flash4.headdim, exact)
        qp, kp, vp, dv = padded
        res = flash_attn_func(qp, kp, vp, resolve_softmax_scale(softmax_scale, q.shape[3]), causal, return_lse,
                              deterministic, window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
        return (res[0][..., :dv].contiguous(), res[1]) if return_lse else res[..., :dv].contiguous()
    args = (q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, deterministic)
    # torch.compile: the request unchecked (pointers and the device are not known while tracing); the
    # op checks it when the compiled graph runs (flash4.ops)
    request = Request.dense(*args) if torch.compiler.is_compiling() else validate.dense_request(*args)
    call = None if key is None else memo.prepare_dense(request)
    if call is not None:
        memo.put(key, call)
        out, lse = call(q, k, v, learnable_sink)
    else:
        out, lse = autograd.attention(request)
    return (out, lse) if return_lse else out


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
           paged pool, which takes flash4.config.SUPPORTED_HEADDIMS and, unless FLASH4_CACHE_HEADDIM16=0, the
           GPU's kernel head dims, flash4.headdim.cache_headdims); out is (total_q, nheads, headdim_v).
           Paged K/V (with page_table): (num_pages, page_size, nheads_k, headdim), any page_size
           >= 1 (pages of <= 16 rows or not a multiple of 8 are gathered row by row; FLASH4_SMALL_PAGES=0
           refuses sizes that are not multiples of 8); key j of sequence b is
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
            multiple of 8 with FLASH4_SMALL_PAGES=0, headdim / heads rules as flash_attn_func, strides, a window side
            below -1, softcap NaN, infinite or negative, devices (every tensor on q's CUDA device),
            the GPU's SM version; with
            check_seqlens, bad metadata values.
            flash4.validate.varlen_support_error(...) gives the metadata message without raising.

    Gradients: `.backward()` through out (and lse) gives dq, dk, dv (flash4.backward),
        not for paged K/V; double backward raises a RuntimeError, as flash_attn_func.
    Decode: paged K/V with an int max_seqlen_q <= 8, no seqused_q and page_table.shape[1] * page_size
        >= 1024 (vLLM's decode and speculative steps) run as flash_attn_with_kvcache's decode step
        (GQA packing, split-KV), chosen from host ints alone (flash4.config.decode_door; no host sync,
        CUDA-graph safe); each sequence's queries are gathered on the device, any cu_seqlens_q.
    Source convention: flash-attn 2/3 `flash_attn_varlen_func` (argument order, layouts, LSE
    (nheads, total_q)); paged K/V as flash-attn-4's (page_table + seqused_k, cu_seqlens_k None).
    """
    key = memo.varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                          page_table, softmax_scale, causal, window_size, softcap, return_lse, deterministic,
                          check_seqlens, learnable_sink)
    call = memo.get(key)
    if call is not None:  # a signature seen before (flash4.memo)
        out, lse = call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q,
                        max_seqlen_k, learnable_sink)
        return (out, lse) if return_lse else out
    _check_flags(return_lse=return_lse, deterministic=deterministic, check_seqlens=check_seqlens)
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap)
    causal, window_size = canonical_mask(causal, window_size)  # (-1, 0) runs the causal kernel
    # pools are not padded per call
    padded = None if page_table is not None else _padded_headdims(q, k, v, q_dim=2, learnable_sink=learnable_sink)
    if padded is not None:  # a head dim without a kernel: zero-padded to one (flash4.headdim, exact)
        qp, kp, vp, dv = padded
        res = flash_attn_varlen_func(
            qp, kp, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
            seqused_k=seqused_k, softmax_scale=resolve_softmax_scale(softmax_scale, q.shape[2]), causal=causal,
            window_size=window_size, softcap=softcap, return_lse=return_lse, deterministic=deterministic,
            check_seqlens=check_seqlens, learnable_sink=learnable_sink)
        return (res[0][..., :dv].contiguous(), res[1]) if return_lse else res[..., :dv].contiguous()
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
            softmax_scale, causal, window_size, softcap, learnable_sink, deterministic, check_seqlens)
    # torch.compile: unchecked; flash4::varlen_fwd checks (and computes a max_seqlen given as a tensor)
    request = Request.varlen(*args) if torch.compiler.is_compiling() else validate.varlen_request(*args)
    call = None if key is None else memo.prepare_varlen(request)
    if call is not None:
        memo.put(key, call)
        seq = request.seq  # checked and contiguous (validate ran the value checks)
        out, lse = call.run(q, k, v, (seq.cu_seqlens_q, seq.cu_seqlens_k, seq.seqused_q, seq.seqused_k,
                                      seq.page_table), request.score.kernel_sink())
    else:
        out, lse = autograd.attention(request)
    return (out, lse) if return_lse else out


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
           with page_table (any page_size >= 1). nheads_k divides nheads (MQA/GQA). headdim: one of
           flash4.config.SUPPORTED_HEADDIMS (a cache is not padded per call), and
           unless FLASH4_CACHE_HEADDIM16=0 also the GPU's kernel head dims (sm_90: multiples of 16 up
           to 128; flash4.headdim.cache_headdims).
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
           (flash4.config.sm90.pack_factor). The sides are runtime values (changing them never recompiles).
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
           partial results are merged by a combine kernel): 0 = auto (flash4.config.choose_num_splits:
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
    flash4.forward as a decode step with seqused_k = cache_seqlens + seqlen_new: the query heads of
    one KV head are packed into one tile (K/V read once per KV head) and the keys split as
    num_splits says. With cache_batch_idx it runs as a packed (varlen) forward over the dense cache
    seen as packed rows (row offsets cache_batch_idx[b] * rows per entry). Changing cache_seqlens,
    page_table or the batch contents never recompiles; the call has no host sync (with a tensor
    cache_seqlens and check_seqlens=False), so it can be captured in a CUDA graph.
    """
    key = memo.kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale, causal,
                           window_size, softcap, num_splits, return_lse, out, check_seqlens, learnable_sink)
    call = memo.get(key)
    if call is not None:  # a signature seen before (flash4.memo)
        result, lse = call(q, k_cache, v_cache, k, v, cache_seqlens, page_table, out, learnable_sink)
        return (result, lse) if return_lse else result
    _check_flags(return_lse=return_lse, check_seqlens=check_seqlens)
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap)
    causal, window_size = canonical_mask(causal, window_size)  # (-1, 0) runs the causal kernel
    args = (q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale, causal, num_splits)
    options = dict(window_size=window_size, softcap=softcap, learnable_sink=learnable_sink, check_seqlens=check_seqlens)
    if torch.compiler.is_compiling():
        # torch.compile: one flash4::kvcache per call (it mutates k_cache / v_cache; flash4.ops);
        # an out= buffer receives a copy of the op's result (an op output may not alias an input).
        with torch.no_grad():
            result, lse = torch.ops.flash4.kvcache(*ops.kvcache_args(Request.kvcache(*args, **options)))
            if out is not None:
                out.copy_(result)
                result = out
        return (result, lse) if return_lse else result
    request = validate.kvcache_request(*args, out=out, **options)
    call = None if key is None else memo.prepare_kvcache(request, out)
    if call is not None:
        memo.put(key, call)
        cache = request.cache  # checked: cache_seqlens a contiguous tensor, value checks run
        result, lse = call.run(q, k_cache, v_cache, cache.k_new, cache.v_new, cache.cache_seqlens, request.seq.page_table,
                               out, request.score.kernel_sink())
        return (result, lse) if return_lse else result
    with torch.no_grad():
        result, lse = forward.run(request, out=out)
    return (result, lse) if return_lse else result


def _check_flags(**flags) -> None:
    """TypeError for a flag that is not a bool. return_lse getting a tuple or list is a window_size
    passed positionally (flash-attn-4's sixth positional argument): the message says it is keyword-only."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            hint = ""
            if name == "return_lse" and isinstance(value, (tuple, list)):
                hint = (f" (was it a window_size? window_size is keyword-only in flash4: pass "
                        f"window_size={tuple(value)!r})")
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}{hint}")


def _padded_headdims(q, k, v, q_dim: int, learnable_sink=None):
    """None when (q, k, v) need no padding (native head dims, or inputs the validation will reject
    anyway); else (q, k, v) zero-padded on their last dim to the head dims flash4.headdim picks, and
    v's own head dim (the output is sliced back to it). Raises ValueError with flash4.headdim.RULE
    for a head dim that is not a multiple of 8 in [8, 256]. q_dim: q's head-dim axis (3 dense, 2 varlen).
    A call autograd records (grad mode on and q, k, v or learnable_sink requiring grad, as
    flash4.validate's gate decides) on a GPU whose backward lacks the pair is padded as a whole to the
    pair that backward has (flash4.headdim.training_headdims: hd96 -> 128 on sm_100), forward included."""
    from flash4 import headdim as hd

    if not all(isinstance(t, torch.Tensor) and t.dim() == q_dim + 1 for t in (q, k, v)):
        return None
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if dk != d:
        return None
    if hd.is_native(d, dv):
        d_p, dv_p = d, dv
    else:
        for name, value in (("q/k", d), ("v", dv)):
            if not hd.servable(value):
                raise ValueError(f"headdim {value} ({name}.shape[{q_dim}]) is not supported: {hd.RULE}")
        d_p, dv_p = hd.padded_headdims(d, dv, _known_arch(q))  # the GPU's family's own head dims count
    if _records_grad(q, k, v, learnable_sink) and hd.training_may_pad(d_p, dv_p):
        arch = _known_arch(q)
        if arch is not None:
            d_p, dv_p = hd.training_headdims(d_p, dv_p, arch)
    if (d_p, dv_p) == (d, dv):
        return None
    return hd.pad_last(q, d_p), hd.pad_last(k, d_p), hd.pad_last(v, dv_p), dv


def _narrow_forward(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, deterministic, key=None):
    """(out, lse) of a flash_attn_func call whose head dim flash4.headdim pads, run without padded
    copies (flash4.forward.launch_narrow; FLASH4_NARROW_HEADDIMS, on by default), or None where that
    path does not apply and the padded path runs: autograd records the call (its backward pads),
    a learnable sink, torch.compile tracing, native or unservable head dims, other dtypes or devices,
    empty inputs, strides TMA cannot read (last dim not contiguous, other strides not multiples of 8
    elements, pointers not 16-byte aligned: the padded copies are contiguous), a decode step or GQA
    packing. The problem is validated as the padded call's (flash4.validate.dense_request on stand-in
    tensors of the padded shapes), so bad input raises the same errors. key: the call's flash4.memo
    key (None: not kept): a launched call is kept as a memo.NarrowCall, so a repeated signature skips
    this host work."""
    from flash4 import env, headdim as hd

    tensors = (q, k, v)
    if (not env.narrow_headdims() or learnable_sink is not None or torch.compiler.is_compiling()
            or not all(isinstance(t, torch.Tensor) and t.dim() == 4 and (t.is_cuda or memo.CPU) for t in tensors)
            or _records_grad(q, k, v, learnable_sink)):
        return None
    d, dv = q.shape[-1], v.shape[-1]
    if (k.shape[-1] != d or hd.is_native(d, dv, _known_arch(q)) or not (hd.servable(d) and hd.servable(dv))
            or q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in tensors)
            or any(t.device != q.device for t in tensors) or q.numel() == 0 or k.numel() == 0):
        return None
    if not all(t.stride(-1) == 1 and all(st % 8 == 0 for st in t.stride()[:-1]) and t.data_ptr() % 16 == 0
               for t in tensors):
        return None
    scale = resolve_softmax_scale(softmax_scale, d)
    stand_in = forward.narrow_stand_in(q, k, v, scale, causal, window_size, softcap)
    validate.dense_request(stand_in.q, stand_in.k, stand_in.v, scale, causal, window_size, softcap, None,
                           deterministic)
    cfg = forward.narrow_config(stand_in, d, dv)
    if cfg is None:
        return None
    out = torch.empty(q.shape[:3] + (dv,), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    forward.launch_narrow(q, k, v, out, lse, stand_in, cfg)
    if key is not None:
        memo.put(key, memo.NarrowCall(stand_in, cfg))
    return out, lse


def _records_grad(q, k, v, learnable_sink) -> bool:
    """Autograd will ask for a backward (flash4.autograd.needs_grad's test, on the raw arguments)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, learnable_sink))


def _known_arch(q) -> int | None:
    """The SM version of q's device (a CUDA tensor, or FLASH4_ARCH), or None (validation names the
    device problem)."""
    from flash4.arch import device_arch

    try:
        return device_arch(q.device)
    except (RuntimeError, ValueError):
        return None
