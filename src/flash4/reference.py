"""Attention reference: the test oracle (plain PyTorch, any device), and the accuracy criterion.

Conventions match flash4.flash_attn_func: layout (batch, seqlen, nheads, headdim); query head h
reads key/value head h // (nheads // nheads_k); causal is aligned to the bottom-right corner:
query row i sees key j iff j <= i + seqlen_k - seqlen_q. A row that sees no key (causal with
seqlen_q > seqlen_k, or seqlen_k == 0) has out = 0 and lse = -inf.
"""

from __future__ import annotations

import contextlib
import math

import torch

from flash4 import geometry

# Accuracy criterion (tests and bench): err(flash4) <= 2 * err(PyTorch same dtype) + atol, errors
# as max |x - ref| against the float32 reference.
# out: 1e-4 is ~1/80 of a bf16 ulp at 1.0; it only matters where PyTorch's same-dtype result is
# exact (e.g. seqlen_k == 1, where out == v).
OUT_ATOL = 1e-4
# lse: the kernel computes the scores in fp32 from the same inputs as the fp32 reference; what it
# adds is exp2/log2 approximation (<= ~1e-4 relative on the row sum, so <= ~1e-4 on lse).
# 1e-3 keeps 10x headroom while any masking or scaling bug moves lse by far more.
LSE_ATOL = 1e-3


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k), True where query row i may see key j (bottom-right aligned):
    j < flash4.geometry.key_limit(i), the kernels' own rule, evaluated on index tensors."""
    row = torch.arange(seqlen_q, device=device).unsqueeze(1)
    col = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return col < geometry.key_limit(row, seqlen_q, seqlen_k, True, _TORCH_OPS)


def window_mask(seqlen_q: int, seqlen_k: int, window_size, causal: bool = False, device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k): True where query row i sees key j under flash-attn's window rule
    (i + sk - sq - left <= j <= i + sk - sq + right, -1 = unbounded per side, causal sets right = 0),
    by flash4.geometry's key_start / key_limit on index tensors."""
    window = geometry.window_sides(window_size, causal)
    row = torch.arange(seqlen_q, device=device).unsqueeze(1)
    col = torch.arange(seqlen_k, device=device).unsqueeze(0)
    if window is None:
        mask = col < geometry.key_limit(row, seqlen_q, seqlen_k, causal, _TORCH_OPS)
    else:
        mask = (col >= geometry.key_start(row, seqlen_q, seqlen_k, _TORCH_OPS, window)) & (
            col < geometry.key_limit(row, seqlen_q, seqlen_k, False, _TORCH_OPS, window))
    return mask.expand(seqlen_q, seqlen_k)


_TORCH_OPS = geometry.Ops(min=lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)),
                          max=lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)),
                          select=lambda cond, a, b: torch.where(cond, a, b))


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    upcast: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    window_size=None,
    softcap: float = 0.0,
    learnable_sink=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax(scale * QK^T) V, materializing the (batch, nheads, seqlen_q, seqlen_k) scores.
    learnable_sink: None or (nheads,) sink logits (gpt-oss): one more logit per row in the softmax
      denominator with no value; the LSE includes it; rows without keys get out 0, LSE = sink.
    window_size: None or flash-attn's (left, right) sliding window (window_mask).
    softcap: > 0 caps the scaled scores as softcap * tanh(scores / softcap) (Gemma 2); 0 = off.

    q: (B, Sq, H, D); k, v: (B, Sk, Hk, D) with Hk dividing H; any float dtype, one device.
    upcast=True: computed in `compute_dtype` (float32 or float64); out is returned in it.
    upcast=False: computed the way plain PyTorch would in the input dtype (matmuls and softmax in
      q.dtype, so scores and probabilities are rounded to it); out is in q.dtype. This is the
      "PyTorch same-dtype" result whose error the criterion scales.
    Returns (out (B, Sq, H, D), lse (B, H, Sq)); lse is natural-log logsumexp of the scaled scores,
    in compute_dtype when upcast else float32 (of the input-dtype scores).
    """
    headdim = q.shape[3]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    if upcast:
        q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    with _full_precision_matmul(enabled=upcast):
        sink = None
        if learnable_sink is not None:
            sink = learnable_sink.to(compute_dtype if upcast else torch.float32)
        return _attention(q, k, v, scale, causal, upcast, window_size, softcap, sink)


@contextlib.contextmanager
def _full_precision_matmul(enabled: bool):
    """No TF32 in the float32 reference, whatever the caller set (restored on exit)."""
    if not enabled:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _attention(q, k, v, scale, causal, upcast, window_size=None, softcap=0.0, sink=None):
    seqlen_q, nheads = q.shape[1], q.shape[2]
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads != nheads_k:
        k = k.repeat_interleave(nheads // nheads_k, dim=2)
        v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if geometry.window_sides(window_size, causal) is not None:
        scores = scores.masked_fill(~window_mask(seqlen_q, seqlen_k, window_size, causal, q.device), float("-inf"))
    elif causal:
        scores = scores.masked_fill(~causal_mask(seqlen_q, seqlen_k, q.device), float("-inf"))
    lse_dtype = scores.dtype if upcast else torch.float32
    if sink is not None:
        # the sink joins the denominator: LSE over the scores and the sink; probabilities over the keys
        sink_col = sink.to(lse_dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        lse = torch.logsumexp(torch.cat([scores.to(lse_dtype), sink_col], dim=-1), dim=-1)
        probs = torch.exp(scores.to(lse_dtype) - lse.unsqueeze(-1)).to(v.dtype)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse
    lse = torch.logsumexp(scores.to(lse_dtype), dim=-1)
    # Rows without a visible key have output 0 by convention. A softmax over all -inf would be NaN
    # (in autograd too), so such rows get finite scores and are zeroed afterwards.
    has_key = ~torch.isneginf(lse).unsqueeze(-1)
    probs = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1) * has_key
    probs = probs.to(v.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def max_abs_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| in float64; equal infinities count as 0, any NaN in x or an infinity of x or
    ref not matched by the other gives inf. Raises ValueError when the shapes differ."""
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    x, ref = x.double(), ref.double()
    if x.numel() == 0:
        return 0.0
    if torch.isnan(x).any() or torch.isnan(ref).any():
        return math.inf
    same_inf = torch.isinf(x) & (x == ref)
    diff = torch.where(same_inf, torch.zeros_like(x), (x - ref).abs())
    return diff.max().item()


def fwd_errors(q, k, v, out, lse=None, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
               learnable_sink=None) -> dict:
    """Errors of a forward result against the float32 reference, next to PyTorch's same-dtype errors.

    q, k, v: the inputs; out: (B, Sq, H, D); lse: (B, H, Sq) or None (then only out is judged).
    Returns {"out_err", "out_pt_err", "lse_err", "lse_pt_err", "ok"} (lse entries None without
    lse); ok applies err <= 2 * pt_err + atol (OUT_ATOL, LSE_ATOL) and needs finite PyTorch errors.
    """
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale, causal, window_size=window_size, softcap=softcap,
                                     learnable_sink=learnable_sink)
    out_pt, lse_pt = attention_ref(q, k, v, softmax_scale, causal, upcast=False, window_size=window_size,
                                   softcap=softcap, learnable_sink=learnable_sink)
    errs = {"out_err": max_abs_err(out, out_ref), "out_pt_err": max_abs_err(out_pt, out_ref),
            "lse_err": None, "lse_pt_err": None}
    ok = math.isfinite(errs["out_pt_err"]) and errs["out_err"] <= 2 * errs["out_pt_err"] + OUT_ATOL
    if lse is not None:
        errs["lse_err"] = max_abs_err(lse, lse_ref)
        errs["lse_pt_err"] = max_abs_err(lse_pt, lse_ref)
        ok = ok and math.isfinite(errs["lse_pt_err"]) and errs["lse_err"] <= 2 * errs["lse_pt_err"] + LSE_ATOL
    errs["ok"] = ok
    return errs


# ================================================================ varlen / paged / kvcache
# flash4.flash_attn_varlen_func's conventions: q (total_q, H, D), k/v (total_k, Hk, D) packed by
# cu_seqlens, or paged (num_pages, page_size, Hk, D) with page_table; lse (H, total_q). Sequence b's
# offsets and lengths are flash4.geometry.SeqLens's: offset cu_seqlens[b], length seqused[b] if
# given else cu_seqlens[b + 1] - cu_seqlens[b] (so with seqused_k the offsets need not increase).


def _host_ints(t) -> list[int] | None:
    if t is None:
        return None
    return [int(x) for x in (t.tolist() if isinstance(t, torch.Tensor) else t)]


def varlen_seqlens(cu_seqlens_q, cu_seqlens_k=None, seqused_q=None, seqused_k=None) -> geometry.SeqLens:
    """The host SeqLens of a varlen / paged batch (reads the tensors: a host sync on a GPU)."""
    cu_q = _host_ints(cu_seqlens_q)
    return geometry.SeqLens(batch=len(cu_q) - 1, cu_seqlens_q=cu_q, cu_seqlens_k=_host_ints(cu_seqlens_k),
                            seqused_q=_host_ints(seqused_q), seqused_k=_host_ints(seqused_k))


def gather_paged(cache: torch.Tensor, page_table_row, length: int) -> torch.Tensor:
    """The first `length` rows (length, Hk, D) of one sequence of a paged cache (num_pages,
    page_size, Hk, D): key j is cache[page_table_row[j // page_size], j % page_size]."""
    page_size = cache.shape[1]
    pages = _host_ints(page_table_row)[: (length + page_size - 1) // page_size]
    if not pages:
        return cache.new_zeros((0,) + tuple(cache.shape[2:]))
    return cache[torch.tensor(pages, device=cache.device)].reshape((-1,) + tuple(cache.shape[2:]))[:length]


def varlen_row_mask(cu_seqlens_q, total_q: int, seqused_q=None) -> torch.Tensor:
    """Bool (total_q,) on cu_seqlens_q's device: True for the query rows inside some sequence (the
    rows the kernel computes; the others are left unwritten)."""
    seqs = varlen_seqlens(cu_seqlens_q, seqused_q=seqused_q)
    mask = torch.zeros(total_q, dtype=torch.bool)
    for b in range(seqs.batch):
        mask[seqs.offset_q(b): seqs.offset_q(b) + seqs.len_q(b)] = True
    return mask.to(cu_seqlens_q.device if isinstance(cu_seqlens_q, torch.Tensor) else "cpu")


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q,
    cu_seqlens_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    upcast: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    window_size=None,
    softcap: float = 0.0,
    learnable_sink=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen / paged attention, each sequence attended densely by `attention_ref` (window_size
    per sequence, as causal).

    q: (total_q, H, D); k, v: (total_k, Hk, D) with cu_seqlens_k, or paged (num_pages, page_size,
    Hk, D) with page_table (batch, max_pages) and seqused_k. cu_seqlens_*: (batch + 1,), seqused_*:
    (batch,) (tensors on any device, or lists). Causal is bottom-right per sequence. upcast and
    compute_dtype as attention_ref. Returns (out (total_q, H, D), lse (H, total_q)); query rows
    outside every sequence get out = 0 and lse = -inf. Differentiable (dq/dk/dv of the reference).
    """
    seqs = varlen_seqlens(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    total_q, nheads, _ = q.shape
    headdim_v = v.shape[-1]  # out has v's head dim (it may differ from q/k's)
    out_dtype = compute_dtype if upcast else q.dtype
    out = torch.zeros(total_q, nheads, headdim_v, dtype=out_dtype, device=q.device)
    lse = torch.full((nheads, total_q), float("-inf"), dtype=compute_dtype if upcast else torch.float32,
                     device=q.device)
    for b in range(seqs.batch):
        start, len_q, len_k = seqs.offset_q(b), seqs.len_q(b), seqs.len_k(b)
        if len_q == 0:
            continue
        if page_table is not None:
            k_b, v_b = gather_paged(k, page_table[b], len_k), gather_paged(v, page_table[b], len_k)
        else:
            k_start = seqs.offset_k(b)
            k_b, v_b = k[k_start: k_start + len_k], v[k_start: k_start + len_k]
        o_b, l_b = attention_ref(q[start: start + len_q][None], k_b[None], v_b[None], softmax_scale, causal, upcast,
                                 compute_dtype, window_size, softcap, learnable_sink)
        out[start: start + len_q] = o_b[0].to(out_dtype)
        lse[:, start: start + len_q] = l_b[0].to(lse.dtype)
    return out, lse


def varlen_fwd_errors(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse=None, seqused_q=None, seqused_k=None,
                      page_table=None, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                      learnable_sink=None) -> dict:
    """fwd_errors for varlen / paged results: out (total_q, H, D), lse (H, total_q) or None, judged
    on the rows inside some sequence only (the others are not written by the kernel). Returns
    fwd_errors' dict."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, softmax_scale, causal)
    out_ref, lse_ref = attention_varlen_ref(*args, window_size=window_size, softcap=softcap,
                                            learnable_sink=learnable_sink)
    out_pt, lse_pt = attention_varlen_ref(*args, upcast=False, window_size=window_size, softcap=softcap,
                                          learnable_sink=learnable_sink)
    rows = varlen_row_mask(cu_seqlens_q, q.shape[0], seqused_q).to(q.device)
    errs = {"out_err": max_abs_err(out[rows], out_ref[rows]), "out_pt_err": max_abs_err(out_pt[rows], out_ref[rows]),
            "lse_err": None, "lse_pt_err": None}
    ok = math.isfinite(errs["out_pt_err"]) and errs["out_err"] <= 2 * errs["out_pt_err"] + OUT_ATOL
    if lse is not None:
        errs["lse_err"] = max_abs_err(lse[:, rows], lse_ref[:, rows])
        errs["lse_pt_err"] = max_abs_err(lse_pt[:, rows], lse_ref[:, rows])
        ok = ok and math.isfinite(errs["lse_pt_err"]) and errs["lse_err"] <= 2 * errs["lse_pt_err"] + LSE_ATOL
    errs["ok"] = ok
    return errs


# Paged cache layouts paged_kv_cache builds: K and V as separate tensors, or as two views of one
# interleaved tensor (their page/token strides then are not their own sizes).
PAGED_LAYOUTS = ("separate", "interleaved", "vllm")


def paged_kv_cache(k, v, cu_seqlens_k, page_size: int, seqused_k=None, *, layout: str = "separate",
                   spare_pages: int = 3, extra_pages_per_seq: int = 1, generator: torch.Generator | None = None,
                   fill: float | None = None):
    """Lay packed varlen K/V (total_k, Hk, D) out in a paged cache whose pages are randomly permuted.

    Sequence b's keys k[cu_seqlens_k[b] : cu_seqlens_k[b] + len_b] (len_b = seqused_k[b] if given,
    else the cu_seqlens difference) fill ceil(len_b / page_size) pages. Every other slot (the tail
    of a last page, spare pages) holds random data (or `fill`), and the page_table columns past a
    sequence's pages (extra_pages_per_seq of them at least) point at random real pages, so a kernel
    that reads past seqused_k sees real-looking data.
    layout: "separate" (two (num_pages, page_size, Hk, D) tensors), "interleaved" (K, V =
    kv[:, :, 0], kv[:, :, 1] of one (num_pages, page_size, 2, Hk, D) tensor) or "vllm" (K, V = the
    two halves of the last dim of one (num_pages, page_size, Hk, 2 * D) tensor: token stride Hk*2*D).
    Returns (k_cache, v_cache, page_table (batch, max_pages) int32, seqused_k (batch,) int32), on
    k's device. `generator`: a CPU torch.Generator (the permutation and the filler data).
    """
    if layout not in PAGED_LAYOUTS:
        raise ValueError(f"layout must be one of {PAGED_LAYOUTS}; got {layout!r}")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    offsets = _host_ints(cu_seqlens_k)
    lengths = _host_ints(seqused_k) if seqused_k is not None else [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    batch, (_, nheads_k, headdim) = len(lengths), k.shape
    pages_per_seq = [(n + page_size - 1) // page_size for n in lengths]
    max_pages = max(pages_per_seq + [0]) + extra_pages_per_seq
    max_pages = max(max_pages, 1)
    num_pages = max(sum(pages_per_seq) + spare_pages, 1)

    # the page permutation and table first: the same generator seed gives the same pages in every layout
    perm = torch.randperm(num_pages, generator=gen).tolist()
    page_table = torch.randint(0, num_pages, (batch, max_pages), generator=gen, dtype=torch.int32)
    shapes = {"separate": (num_pages, page_size, nheads_k, headdim),
              "interleaved": (num_pages, page_size, 2, nheads_k, headdim),
              "vllm": (num_pages, page_size, nheads_k, 2 * headdim)}
    n_tensors = 2 if layout == "separate" else 1
    storage = []
    for _ in range(n_tensors):
        if fill is None:
            t = torch.randn(shapes[layout], generator=gen, dtype=torch.float32)
        else:
            t = torch.full(shapes[layout], fill, dtype=torch.float32)
        storage.append(t.to(dtype=k.dtype, device=k.device))
    if layout == "separate":
        k_cache, v_cache = storage
    elif layout == "interleaved":
        k_cache, v_cache = storage[0][:, :, 0], storage[0][:, :, 1]
    else:
        k_cache, v_cache = storage[0].split(headdim, dim=-1)

    src, dst_page, dst_slot, next_page = [], [], [], 0
    for b in range(batch):
        page_table[b, : pages_per_seq[b]] = torch.tensor(perm[next_page: next_page + pages_per_seq[b]],
                                                          dtype=torch.int32)
        for j in range(lengths[b]):
            src.append(offsets[b] + j)
            dst_page.append(perm[next_page + j // page_size])
            dst_slot.append(j % page_size)
        next_page += pages_per_seq[b]
    if src:
        index = [torch.tensor(x, device=k.device) for x in (src, dst_page, dst_slot)]
        with torch.no_grad():
            k_cache[index[1], index[2]] = k[index[0]].to(k_cache.dtype)
            v_cache[index[1], index[2]] = v[index[0]].to(v_cache.dtype)
    seqused = torch.tensor(lengths, dtype=torch.int32)
    return k_cache, v_cache, page_table.to(k.device), seqused.to(k.device)


def paged_kv_to_varlen(k_cache, v_cache, page_table, seqused_k):
    """The inverse of paged_kv_cache: packed (total_k, Hk, D) K and V of every sequence's first
    seqused_k[b] keys, and their cu_seqlens_k (batch + 1,) int32."""
    lengths = _host_ints(seqused_k)
    ks = [gather_paged(k_cache, page_table[b], n) for b, n in enumerate(lengths)]
    vs = [gather_paged(v_cache, page_table[b], n) for b, n in enumerate(lengths)]
    empty = k_cache.new_zeros((0,) + tuple(k_cache.shape[2:]))
    cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device=k_cache.device)
    return torch.cat(ks or [empty]), torch.cat(vs or [empty]), cu


def _cumsum(values):
    total = 0
    for x in values:
        total += x
        yield total


def kvcache_ref(q, k_cache, v_cache, seqlens_k, page_table=None, cache_batch_idx=None, softmax_scale=None,
                causal=False, upcast=True, compute_dtype=torch.float32, window_size=None, softcap=0.0,
                learnable_sink=None):
    """flash_attn_with_kvcache's attention (after the append) by attention_ref, sequence by sequence.

    q: (B, Sq, H, D); k_cache/v_cache: dense (B_cache, S_cache, Hk, D) (row cache_batch_idx[b], or b)
    or paged (num_pages, page_size, Hk, D) with page_table; seqlens_k: the key count of each sequence
    (cache_seqlens + seqlen_new). Returns (out (B, Sq, H, D), lse (B, H, Sq)).
    """
    lengths = _host_ints(seqlens_k)
    rows = _host_ints(cache_batch_idx) if cache_batch_idx is not None else list(range(q.shape[0]))
    outs, lses = [], []
    for b, n in enumerate(lengths):
        if page_table is not None:
            k_b, v_b = gather_paged(k_cache, page_table[b], n), gather_paged(v_cache, page_table[b], n)
        else:
            k_b, v_b = k_cache[rows[b], :n], v_cache[rows[b], :n]
        o_b, l_b = attention_ref(q[b: b + 1], k_b[None], v_b[None], softmax_scale, causal, upcast, compute_dtype,
                                 window_size, softcap, learnable_sink)
        outs.append(o_b)
        lses.append(l_b)
    if not outs:
        dtype = compute_dtype if upcast else q.dtype
        return (q.new_zeros(tuple(q.shape[:-1]) + (v_cache.shape[-1],), dtype=dtype),
                q.new_zeros((0, q.shape[2], q.shape[1]), dtype=compute_dtype if upcast else torch.float32))
    return torch.cat(outs), torch.cat(lses)


def attention_bwd_ref(dout, q, k, v, out, lse, dlse=None, softmax_scale: float | None = None, causal: bool = False,
                      compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels' formula, given the forward's out and lse instead of recomputing them:
    P = exp(scale * S - lse) (0 where lse = -inf or masked), D = rowsum(dout * out) - dlse,
    dS = P * (dP - D), dq = scale * dS K, dk = scale * dS^T Q, dv = P^T dout. Equal to autograd of
    attention_ref when out / lse are this block's own; with out / lse of a larger key set (a ring
    attention's merged result) it gives this block's exact share of the gradients.

    q: (B, Sq, H, D); k: (B, Sk, Hk, D); v: (B, Sk, Hk, Dv); out, dout: (B, Sq, H, Dv);
    lse, dlse: (B, H, Sq) (dlse None = 0). Causal bottom-right as attention_ref. Returns (dq, dk, dv)
    in compute_dtype, shaped like q, k, v."""
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    q, k, v, out, dout, lse = (t.to(compute_dtype) for t in (q, k, v, out, dout, lse))
    nheads, nheads_k = q.shape[2], k.shape[2]
    group = nheads // nheads_k
    kx, vx = (t.repeat_interleave(group, dim=2) for t in (k, v))
    with _full_precision_matmul(enabled=True):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
        if causal:
            scores = scores.masked_fill(~causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
        seen = torch.isfinite(lse).unsqueeze(-1)
        p = torch.where(seen, torch.exp(scores - torch.where(seen, lse.unsqueeze(-1), 0.0)), 0.0)
        d = torch.einsum("bqhd,bqhd->bhq", dout, out)
        if dlse is not None:
            d = d - dlse.to(compute_dtype)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, vx)
        ds = p * (dp - d.unsqueeze(-1))
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kx) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    b, sk = k.shape[:2]
    dk = dk.reshape(b, sk, nheads_k, group, -1).sum(3)
    dv = dv.reshape(b, sk, nheads_k, group, -1).sum(3)
    return dq, dk, dv
