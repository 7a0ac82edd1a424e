"""The oracle's own tests: attention_ref against a naive loop and against SDPA's math, in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash4.reference import LSE_ATOL, OUT_ATOL, attention_ref, causal_mask, fwd_errors, max_abs_err

F64 = torch.float64


def inputs(b, sq, sk, h, hk, d, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=gen, dtype=F64).to(dtype)
    return q, k, v


def naive(q, k, v, scale, causal):
    """Row by row in float64, straight from the definition (bottom-right causal)."""
    b_, sq, h_, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b_, sq, h_, d, dtype=F64)
    lse = torch.full((b_, h_, sq), -math.inf, dtype=F64)
    for b in range(b_):
        for h in range(h_):
            kh = h // (h_ // hk)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                s = torch.stack([(q[b, i, h].double() @ k[b, j, kh].double()) * scale for j in keys])
                m = s.max()
                p = torch.exp(s - m)
                lse[b, h, i] = m + torch.log(p.sum())
                out[b, i, h] = (p / p.sum()) @ torch.stack([v[b, j, kh].double() for j in keys])
    return out, lse


SHAPES = [  # (b, sq, sk, h, hk, d)
    (1, 1, 1, 1, 1, 8),
    (2, 5, 5, 2, 2, 16),
    (2, 3, 7, 4, 2, 8),   # sq < sk, GQA 2:1
    (1, 7, 3, 4, 1, 8),   # sq > sk (causal: first 4 rows see nothing), MQA
    (2, 9, 13, 8, 1, 32),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_matches_naive_loop(shape, causal, scale):
    q, k, v = inputs(*shape)
    out, lse = attention_ref(q, k, v, scale, causal, compute_dtype=F64)
    out_n, lse_n = naive(q, k, v, 1 / math.sqrt(shape[-1]) if scale is None else scale, causal)
    assert out.dtype == F64 and lse.dtype == F64
    assert out.shape == q.shape and lse.shape == (shape[0], shape[3], shape[1])
    torch.testing.assert_close(out, out_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_n, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] <= s[2]])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_math(shape, causal):
    """SDPA with an explicit bottom-right mask (no fully masked rows when sq <= sk)."""
    q, k, v = inputs(*shape)
    rep = shape[3] // shape[4]
    mask = causal_mask(shape[1], shape[2]) if causal else None
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2),
        attn_mask=mask, scale=0.25,
    ).transpose(1, 2)
    out, _ = attention_ref(q, k, v, 0.25, causal, compute_dtype=F64)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_causal_mask_is_bottom_right():
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert causal_mask(4, 2).tolist() == [[False, False], [False, False], [True, False], [True, True]]
    assert causal_mask(3, 3).tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()


def test_rows_without_keys_give_zero_and_neg_inf():
    q, k, v = inputs(2, 7, 3, 2, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True)
    assert torch.all(out[:, :4] == 0) and torch.all(torch.isneginf(lse[:, :, :4]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 4:]).all()


@pytest.mark.parametrize("b, sq, sk", [(0, 4, 4), (2, 0, 4), (2, 4, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty(b, sq, sk, causal):
    q, k, v = inputs(b, sq, sk, 2, 1, 8)
    out, lse = attention_ref(q, k, v, causal=causal)
    assert out.shape == (b, sq, 2, 8) and lse.shape == (b, 2, sq)
    if sk == 0:
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_false_rounds_like_pytorch(dtype):
    q, k, v = inputs(2, 33, 65, 4, 2, 64, dtype=dtype)
    out64, lse64 = attention_ref(q, k, v, causal=True, compute_dtype=F64)
    out32, lse32 = attention_ref(q, k, v, causal=True)
    out_pt, lse_pt = attention_ref(q, k, v, causal=True, upcast=False)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    assert out_pt.dtype == dtype and lse_pt.dtype == torch.float32
    err32, err_pt = max_abs_err(out32, out64), max_abs_err(out_pt, out64)
    assert err32 < 1e-5  # float32 reference: exact for this purpose
    assert 1e-4 < err_pt < 5e-2  # same-dtype result: visibly rounded, still close
    assert max_abs_err(lse32, lse64) < 1e-5 < max_abs_err(lse_pt, lse64) < 0.1


def test_max_abs_err():
    inf = math.inf
    assert max_abs_err(torch.tensor([1.0, -inf]), torch.tensor([1.5, -inf])) == 0.5
    assert max_abs_err(torch.tensor([1.0, 0.0]), torch.tensor([1.0, -inf])) == inf
    assert max_abs_err(torch.tensor([math.nan]), torch.tensor([0.0])) == inf
    assert max_abs_err(torch.empty(0), torch.empty(0)) == 0.0
    with pytest.raises(ValueError, match="shape mismatch"):
        max_abs_err(torch.zeros(2, 3), torch.zeros(3))


def test_fwd_errors_criterion():
    q, k, v = inputs(1, 40, 50, 2, 1, 64, dtype=torch.bfloat16)
    out_pt, lse_pt = attention_ref(q, k, v, causal=True, upcast=False)
    errs = fwd_errors(q, k, v, out_pt, lse_pt, causal=True)
    assert errs["ok"] and errs["out_err"] == errs["out_pt_err"] and errs["lse_err"] == errs["lse_pt_err"]

    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    assert fwd_errors(q, k, v, out_ref.bfloat16(), lse_ref, causal=True)["ok"]
    assert fwd_errors(q, k, v, out_ref.bfloat16(), None, causal=True)["lse_err"] is None

    bad_out = out_ref.clone()
    bad_out[0, 5, 1, 3] += 3 * errs["out_pt_err"] + OUT_ATOL
    assert not fwd_errors(q, k, v, bad_out, lse_ref, causal=True)["ok"]
    bad_lse = lse_ref.clone()
    bad_lse[0, 1, 7] += 3 * errs["lse_pt_err"] + LSE_ATOL
    assert not fwd_errors(q, k, v, out_ref, bad_lse, causal=True)["ok"]
    nan_out = out_ref.clone()
    nan_out[0, 0, 0, 0] = math.nan
    assert not fwd_errors(q, k, v, nan_out, lse_ref, causal=True)["ok"]
    # off-by-one diagonal: the non-causal result must fail the causal check
    out_full, lse_full = attention_ref(q, k, v, causal=False)
    assert not fwd_errors(q, k, v, out_full, lse_full, causal=True)["ok"]
