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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax(scale * QK^T) V, materializing the (batch, nheads, seqlen_q, seqlen_k) scores.

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
        return _attention(q, k, v, scale, causal, upcast)


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


def _attention(q, k, v, scale, causal, upcast):
    seqlen_q, nheads = q.shape[1], q.shape[2]
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads != nheads_k:
        k = k.repeat_interleave(nheads // nheads_k, dim=2)
        v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(seqlen_q, seqlen_k, q.device), float("-inf"))
    lse_dtype = scores.dtype if upcast else torch.float32
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


def fwd_errors(q, k, v, out, lse=None, softmax_scale=None, causal=False) -> dict:
    """Errors of a forward result against the float32 reference, next to PyTorch's same-dtype errors.

    q, k, v: the inputs; out: (B, Sq, H, D); lse: (B, H, Sq) or None (then only out is judged).
    Returns {"out_err", "out_pt_err", "lse_err", "lse_pt_err", "ok"} (lse entries None without
    lse); ok applies err <= 2 * pt_err + atol (OUT_ATOL, LSE_ATOL) and needs finite PyTorch errors.
    """
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale, causal)
    out_pt, lse_pt = attention_ref(q, k, v, softmax_scale, causal, upcast=False)
    errs = {"out_err": max_abs_err(out, out_ref), "out_pt_err": max_abs_err(out_pt, out_ref),
            "lse_err": None, "lse_pt_err": None}
    ok = math.isfinite(errs["out_pt_err"]) and errs["out_err"] <= 2 * errs["out_pt_err"] + OUT_ATOL
    if lse is not None:
        errs["lse_err"] = max_abs_err(lse, lse_ref)
        errs["lse_pt_err"] = max_abs_err(lse_pt, lse_ref)
        ok = ok and math.isfinite(errs["lse_pt_err"]) and errs["lse_err"] <= 2 * errs["lse_pt_err"] + LSE_ATOL
    errs["ok"] = ok
    return errs
