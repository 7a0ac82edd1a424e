"""Helpers shared by the GPU tests (tests/gpu/); the shared fixtures are in tests/gpu/conftest.py.

Imported as a plain module (`from gpu_helpers import ...`): tests/gpu has no __init__.py, so
pytest's default import mode (prepend) puts tests/gpu on sys.path, as it does for the test modules
themselves. No test module imports another test module; what two of them need is here.

The suite's criterion throughout (flash4.reference): against the float32 reference, a result's max
error is at most 2 x PyTorch's own same-dtype error + atol, computed into NaN-poisoned outputs so an
element the kernels do not write fails.

Dense:  inputs, poisoned_fwd_buffers, ref_grads, assert_grads, check_bwd, check_deterministic,
        check_bwd_dv.
Varlen (packed sequences, seqused, paged K/V through flash_attn_varlen_func): rand_lengths,
        cu_seqlens, make_varlen, max_seqlen, run_poisoned_varlen, check_fwd_varlen, ref_grads_varlen,
        check_grads_varlen, run_bwd_varlen.
Paged pools (tests/gpu/test_small_pages.py, test_cache_headdim16.py): PAGED_LENS, paged_pool,
        kvcache_step, kvcache_append_across_pages.
Compiles: compile_count (the no-recompile checks of varlen and decode loops).
Leaks (issue 25): poison_allocator (the caching allocator's free blocks filled with a value, so
        flash4's internal torch.empty buffers start out poisoned).
"""

import importlib
import math
import random

import torch

from flash4 import backward, flash_attn_with_kvcache, forward
from flash4.backward import flash_attn_backward
from flash4.reference import (attention_ref, attention_varlen_ref, kvcache_ref, max_abs_err, varlen_fwd_errors,
                              varlen_row_mask)
from flash4.request import Request
from flash4.validate import check_varlen_inputs

DEV = "cuda"
BF16, I32 = torch.bfloat16, torch.int32
GRAD_ATOL = 1e-3  # the atol of the gradient rule: err <= 2 * pt_err + GRAD_ATOL


# ================================================================ leaks
def poison_allocator(value: float) -> None:
    """Fill free memory of PyTorch's caching allocator with `value` (float32 words): blocks of the
    small pool (< 1 MiB, 2 MiB segments) and of the large pool are allocated, filled and released
    (kept cached), so torch.empty buffers allocated next -- flash4's split-KV partials, packed
    outputs, padded LSE / dQ accumulators -- most likely start with those bits instead of zeros. A
    result that depends on such a buffer's initial contents then differs between two values."""
    blocks = [torch.full((n,), value, dtype=torch.float32, device=DEV)
              for n in [1 << 10] * 64 + [1 << 14] * 64 + [1 << 17] * 16 + [1 << 22] * 8 + [1 << 24] * 4]
    torch.cuda.synchronize()
    del blocks


# ================================================================ dense
def inputs(b, sq, sk, h, hk, d, dv=None, dtype=BF16, seed=0):
    """q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv), dout (b, sq, h, dv) ~ randn from one
    seeded generator (dv None: dv = d)."""
    dv = d if dv is None else dv
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(s, generator=gen, device="cuda", dtype=dtype)
                 for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, h, dv)))


def poisoned_fwd_buffers(q, dv=None):
    """NaN-filled out (b, sq, h, dv) of q's dtype and lse (b, h, sq) float32 for the forward to
    overwrite (dv None: q's head dim)."""
    b, sq, h, d = q.shape
    out = torch.full((b, sq, h, d if dv is None else dv), math.nan, dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, sq), math.nan, dtype=torch.float32, device=q.device)
    return out, lse


def ref_grads(q, k, v, dout, causal, upcast, **ref_kw):
    """dq, dk, dv of flash4.reference.attention_ref (default scale): float32 leaves (upcast) or the
    input dtype's (PyTorch same dtype); ref_kw: window_size, softcap, ... as attention_ref takes them."""
    leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, causal=causal, upcast=upcast, **ref_kw)
    out.backward(dout.float() if upcast else dout)
    return [t.grad for t in leaves]


def assert_grads(grads, g_ref, g_pt):
    """dq, dk, dv: the reference's shapes, no NaN (no unwritten element), err <= 2 * pt_err + GRAD_ATOL."""
    for name, g, gr, gp in zip(("dq", "dk", "dv"), grads, g_ref, g_pt):
        assert g.shape == gr.shape, (name, g.shape, gr.shape)
        assert not g.isnan().any(), f"{name} has NaN at {g.isnan().nonzero()[:4].tolist()}"
        err = (g.float() - gr).abs().max().item()
        pt_err = (gp.float() - gr).abs().max().item()
        assert err <= 2 * pt_err + GRAD_ATOL, f"{name}: err {err:.3e} > 2 * pt_err {pt_err:.3e} + {GRAD_ATOL}"


def check_bwd(b, sq, sk, h, hk, d, causal, dtype=torch.bfloat16, seed=0):
    """Random (b, sq, h, d) / (b, sk, hk, d) inputs: the forward, then the backward into NaN-filled
    dq/dk/dv, against the float32 reference (assert_grads)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(s, generator=gen, device="cuda", dtype=dtype)
               for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = torch.randn(b, sq, h, d, generator=gen, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(d)
    out, lse = forward.run(Request.dense(q, k, v, scale, causal))
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, causal, dq=dq, dk=dk, dv=dv)
    torch.cuda.synchronize()
    g_ref = ref_grads(q, k, v, dout, causal, upcast=True)
    g_pt = ref_grads(q, k, v, dout, causal, upcast=False)
    assert_grads((dq, dk, dv), g_ref, g_pt)


def check_deterministic(b, s, h, hk, d, causal, calls, seed):
    """deterministic=True: right (2x-PyTorch rule) and bitwise equal over `calls` more calls."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for n in (h, hk, hk, h))
    scale = 1 / math.sqrt(d)
    out, lse = forward.run(Request.dense(q, k, v, scale, causal))
    first = flash_attn_backward(dout, q, k, v, out, lse, scale, causal, deterministic=True)
    g_ref = ref_grads(q, k, v, dout, causal, upcast=True)
    g_pt = ref_grads(q, k, v, dout, causal, upcast=False)
    for g, gr, gp in zip(first, g_ref, g_pt):
        assert (g.float() - gr).abs().max() <= 2 * (gp.float() - gr).abs().max() + GRAD_ATOL
    for _ in range(calls):
        again = flash_attn_backward(dout, q, k, v, out, lse, scale, causal, deterministic=True)
        for g0, g1 in zip(first, again):
            assert torch.equal(g0, g1)


def check_bwd_dv(q, k, v, dout, causal=False, deterministic=False):
    """The backward of given inputs (v and dout of any value head dim) into NaN-filled dq/dk/dv,
    against the float32 reference (assert_grads); returns (dq, dk, dv)."""
    scale = q.shape[-1] ** -0.5
    out, lse = forward.run(Request.dense(q, k, v, scale, causal))
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, causal, *grads, deterministic=deterministic)
    torch.cuda.synchronize()
    assert_grads(grads, ref_grads(q, k, v, dout, causal, True), ref_grads(q, k, v, dout, causal, False))
    return grads


# ================================================================ varlen (packed sequences, seqused, paged K/V)
def rand_lengths(batch: int, max_len: int, seed: int, must=(0, 1)) -> list[int]:
    """batch lengths in [0, max_len], with each value of `must` at a random position (batch allowing)."""
    rng = random.Random(seed)
    lengths = [rng.randint(0, max_len) for _ in range(batch)]
    slots = rng.sample(range(batch), min(batch, len(must)))
    for slot, value in zip(slots, must):
        lengths[slot] = value
    return lengths


def cu_seqlens(lengths) -> torch.Tensor:
    """int32 CUDA cumulative lengths [0, l0, l0 + l1, ...]."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=I32, device=DEV)


def make_varlen(len_q, len_k, h, hk, d, dtype=BF16, seed=0, pad_q=0, pad_k=0):
    """Packed q (sum(len_q) + pad_q, h, d), k/v (sum(len_k) + pad_k, hk, d) and cu_seqlens (the pad
    rows lie past cu_seqlens[-1]: outside every sequence)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(sum(len_q) + pad_q, h, d, generator=gen, device=DEV, dtype=dtype)
    k = torch.randn(sum(len_k) + pad_k, hk, d, generator=gen, device=DEV, dtype=dtype)
    v = torch.randn(sum(len_k) + pad_k, hk, d, generator=gen, device=DEV, dtype=dtype)
    return q, k, v, cu_seqlens(len_q), cu_seqlens(len_k)


def max_seqlen(cu, seqused):
    """The longest sequence: of seqused where given, else of the cumulative lengths cu (0 for an empty batch)."""
    lengths = seqused if seqused is not None else cu[1:] - cu[:-1]
    return int(lengths.max().item()) if lengths.numel() else 0


def run_poisoned_varlen(q, k, v, cu_q, cu_k, causal, seqused_q=None, seqused_k=None, page_table=None,
                        softmax_scale=None):
    """The varlen forward into NaN-filled out/lse (the hook flash_attn_varlen_func uses)."""
    total_q, h, d = q.shape
    check_varlen_inputs(q, k, v, cu_q, cu_k, None, None, seqused_q, seqused_k, page_table, softmax_scale, causal)
    out = torch.full((total_q, h, d), math.nan, dtype=q.dtype, device=DEV)
    lse = torch.full((h, total_q), math.nan, dtype=torch.float32, device=DEV)
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    request = Request.varlen(q, k, v, cu_q, cu_k, max_seqlen(cu_q, seqused_q), None, seqused_q, seqused_k, page_table,
                             scale, causal)
    res = forward.run(request, out=out, lse=lse)
    assert res[0] is out and res[1] is lse
    torch.cuda.synchronize()
    return out, lse


def check_fwd_varlen(q, k, v, cu_q, cu_k, causal, seqused_q=None, seqused_k=None, page_table=None,
                     softmax_scale=None):
    """run_poisoned_varlen: every row of a sequence written, rows outside every sequence not, out and
    lse within the rule (flash4.reference.varlen_fwd_errors); returns (out, lse)."""
    out, lse = run_poisoned_varlen(q, k, v, cu_q, cu_k, causal, seqused_q, seqused_k, page_table, softmax_scale)
    rows = varlen_row_mask(cu_q, q.shape[0], seqused_q)
    assert not out[rows].isnan().any(), f"out has NaN at {out[rows].isnan().nonzero()[:5].tolist()} (unwritten?)"
    assert not lse[:, rows].isnan().any(), f"lse has NaN at {lse[:, rows].isnan().nonzero()[:5].tolist()}"
    if k.numel() > 0:  # rows outside every sequence are never written (they may belong to someone else)
        assert out[~rows].isnan().all() and lse[:, ~rows].isnan().all(), "a row outside every sequence was written"
    errs = varlen_fwd_errors(q, k, v, cu_q, cu_k, out, lse, seqused_q, seqused_k, page_table, softmax_scale, causal)
    assert errs["ok"], errs
    return out, lse


def ref_grads_varlen(q, k, v, cu_q, cu_k, dout, causal, upcast, seqused_q=None, seqused_k=None, dlse=None):
    """dq, dk, dv of flash4.reference.attention_varlen_ref (loss out . dout, + lse . dlse over the
    sequences' rows where dlse is given); zeros where a leaf gets no gradient."""
    leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_varlen_ref(*leaves, cu_q, cu_k, seqused_q, seqused_k, causal=causal, upcast=upcast)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        rows = varlen_row_mask(cu_q, q.shape[0], seqused_q)
        loss = loss + (lse[:, rows].float() * dlse[:, rows]).sum()
    loss.backward()
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def check_grads_varlen(got, q, k, v, cu_q, cu_k, dout, causal, seqused_q=None, seqused_k=None, dlse=None):
    """got = (dq, dk, dv): no NaN (no unwritten element), err <= 2 * pt_err + GRAD_ATOL."""
    g_ref = ref_grads_varlen(q, k, v, cu_q, cu_k, dout, causal, True, seqused_q, seqused_k, dlse)
    g_pt = ref_grads_varlen(q, k, v, cu_q, cu_k, dout, causal, False, seqused_q, seqused_k, dlse)
    for name, g, gr, gp in zip(("dq", "dk", "dv"), got, g_ref, g_pt):
        assert not g.isnan().any(), f"{name} has NaN at {g.isnan().nonzero()[:4].tolist()} (unwritten?)"
        err, pt_err = max_abs_err(g.float(), gr), max_abs_err(gp.float(), gr)
        assert err <= 2 * pt_err + GRAD_ATOL, f"{name}: err {err:.3e} > 2 * pt_err {pt_err:.3e} + {GRAD_ATOL}"


def run_bwd_varlen(q, k, v, cu_q, cu_k, dout, causal, seqused_q=None, seqused_k=None, deterministic=False):
    """Forward with the log2 LSE split, then the backward into NaN-filled dq/dk/dv."""
    d = q.shape[2]
    scale = 1 / math.sqrt(d)
    split = torch.empty(2, q.shape[1], q.shape[0], dtype=torch.float32, device=DEV)
    max_q, max_k = max_seqlen(cu_q, seqused_q), max_seqlen(cu_k, seqused_k)
    request = Request.varlen(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k, None, scale, causal,
                             deterministic=deterministic)
    out, lse = forward.run(request, lse_split=split)
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    res = backward.run(request, dout, out, lse, lse_split=split, dq=dq, dk=dk, dv=dv)
    assert all(r is g for r, g in zip(res, (dq, dk, dv)))
    torch.cuda.synchronize()
    return dq, dk, dv


# ================================================================ compiles
def paged_tile_differs(headdim: int) -> bool:
    """True where the running family's paged forward takes another key tile than its contiguous one:
    the portable family's gather at d96 / d256 (flash4.config.sm80.PAGED_TILE_N, the gather's
    registers). There the summation order differs, so the tests compare a paged call bitwise with
    the same data in another page layout (same config) instead of the contiguous call."""
    from flash4.arch import device_arch
    from flash4.config import active_family
    from flash4.config.sm80 import PAGED_TILE_N

    return active_family(device_arch()).name == "sm80" and headdim in PAGED_TILE_N


def compile_count() -> int:
    """Misses of every functools cache of the modules that compile or hold compiled kernels (a miss
    = a compile or an on-disk cache load)."""
    from flash4.compile.cache import compile_counts

    total = sum(compile_counts().values())  # kernels compiled or loaded from disk by this process
    for name in ("flash4.compile.cache", "flash4.backward"):
        module = importlib.import_module(name)
        total += sum(f.cache_info().misses for f in vars(module).values() if callable(getattr(f, "cache_info", None)))
    return total


# ================================================================ self-test tests (test_selftest*.py)
def parent_still_works():
    """This process's CUDA context and flash4 forward (the GPU's own family), after a self-test child
    was refused or killed."""
    import flash4
    from flash4.reference import fwd_errors

    x = torch.arange(4, device="cuda", dtype=torch.float32)
    assert (x + 1).sum().item() == 10
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 77, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out, lse = flash4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    assert fwd_errors(q, k, v, out, lse, causal=True)["ok"]


def report_verdict(verdict, width: int = 70):
    """Print a self-test verdict (status, config, seconds, and when the child was ready)."""
    import json

    ready = [json.loads(line.split("] ", 1)[1]) for line in verdict.log.splitlines() if '"event": "ready"' in line]
    print(f"\n{verdict.status} {verdict.config[:width]}... {verdict.seconds:.1f} s"
          + (f" (ready after {ready[0]['seconds']} s of compiling / loading)" if ready else ""))

# ================================================================ paged pools (flash_attn_with_kvcache, paged varlen)
PAGED_LENS = ([5, 0, 300, 1, 129, 64, 33], [1000, 7, 300, 0, 129, 1, 190])  # (queries, keys) per sequence


def paged_pool(k, v, cu_k, page_size, seed=0, fill=None):
    """flash4.reference.paged_kv_cache with a seeded CPU generator: (k_cache, v_cache, page_table, seqused_k)."""
    from flash4.reference import paged_kv_cache

    return paged_kv_cache(k, v, cu_k, page_size, generator=torch.Generator().manual_seed(seed), fill=fill)


def kvcache_step(q, k_cache, v_cache, kn, vn, cache_seqlens, table, num_splits):
    """flash_attn_with_kvcache into a NaN-filled out: the appended slots (plain indexing), out and
    lse within the rule against the reference."""
    page_size = k_cache.shape[1]
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(cache_seqlens.tolist()):
        for t in range(kn.shape[1]):
            pos = start + t
            where = (int(table[b, pos // page_size]), pos % page_size)
            k_exp[where], v_exp[where] = kn[b, t], vn[b, t]
    out = torch.full_like(q, math.nan)
    res, lse = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens, table, causal=True,
                                       num_splits=num_splits, return_lse=True, out=out)
    torch.cuda.synchronize()
    assert res is out and not out.isnan().any() and not lse.isnan().any()
    # NaN slots compare unequal: compare where the expected cache is a number, and NaN where it is NaN
    for got, exp in ((k_cache, k_exp), (v_cache, v_exp)):
        assert torch.equal(got.isnan(), exp.isnan()), "the append wrote the wrong cache slots"
        assert torch.equal(got.nan_to_num(0.0), exp.nan_to_num(0.0)), "the append wrote the wrong cache slots"
    lengths = [n + kn.shape[1] for n in cache_seqlens.tolist()]
    ref_out, ref_lse = kvcache_ref(q, k_cache, v_cache, lengths, table, causal=True)
    pt_out, pt_lse = kvcache_ref(q, k_cache, v_cache, lengths, table, causal=True, upcast=False)
    assert max_abs_err(out, ref_out) <= 2 * max_abs_err(pt_out, ref_out) + 1e-4
    assert max_abs_err(lse, ref_lse) <= 2 * max_abs_err(pt_lse, ref_lse) + 1e-3
    return out, lse


def kvcache_append_across_pages(page_size, d, sq, num_splits):
    """32 / 8 heads; sq new tokens appended at lengths that put them across page boundaries, into a
    pool whose unused slots are NaN; the attention against the reference; the same step again
    without the append gives the same bits."""
    b, h, hk = 5, 32, 8
    capacity = 2112  # keys per sequence: pages of the table
    max_pages = -(-capacity // page_size)
    num_pages = b * max_pages + 3
    gen = torch.Generator(device=DEV).manual_seed(page_size * 10 + d)
    k_cache = torch.full((num_pages, page_size, hk, d), math.nan, device=DEV, dtype=BF16)
    v_cache = torch.full_like(k_cache, math.nan)
    table = torch.randperm(num_pages, generator=gen, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
    # lengths before the append: 0, a page end minus 1, a page end, and long ones crossing pages
    starts = [0, max(page_size - 1, 0), page_size, 1000 + page_size // 2, capacity - sq]
    cache_seqlens = torch.tensor(starts, dtype=I32, device=DEV)
    for bi, n in enumerate(starts):  # the valid keys before the append
        if n:
            pages = table[bi, : -(-n // page_size)].long()
            k_rows = torch.randn(len(pages) * page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
            v_rows = torch.randn_like(k_rows)
            k_rows[n:], v_rows[n:] = math.nan, math.nan  # the last page's tail stays poisoned
            k_cache[pages] = k_rows.view(len(pages), page_size, hk, d)
            v_cache[pages] = v_rows.view(len(pages), page_size, hk, d)
    q = torch.randn(b, sq, h, d, generator=gen, device=DEV, dtype=BF16)
    kn = torch.randn(b, sq, hk, d, generator=gen, device=DEV, dtype=BF16)
    vn = torch.randn(b, sq, hk, d, generator=gen, device=DEV, dtype=BF16)
    out, lse = kvcache_step(q, k_cache, v_cache, kn, vn, cache_seqlens, table, num_splits)
    again, lse2 = flash_attn_with_kvcache(q, k_cache, v_cache, None, None, cache_seqlens + sq, table, causal=True,
                                          num_splits=num_splits, return_lse=True)
    assert torch.equal(again, out) and torch.equal(lse2, lse)
