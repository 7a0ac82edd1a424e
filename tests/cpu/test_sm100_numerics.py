"""The sm100 forward's numerics model (flash4.models.sm100_fwd) against flash4.reference, on the CPU.

Criterion (the project's): err <= 2 * err(PyTorch in the input dtype) + atol (reference.OUT_ATOL,
LSE_ATOL), both errors max |x - ref| against the float64 reference. Random inputs (head dims 64 and
128, causal and not, GQA, seqlen not a multiple of 128, bf16 and fp16) and adversarial ones (a row
max rising by less than tau per block in visiting order, so the stale max is used; huge, extreme
and tiny magnitudes; one dominant key seen last; rows that see one key or none; equal scores).
Equivalences: tau = 0 without emulation = a plain online softmax (to one output rounding); the
emulated columns' P = exp2_poly's bit-exact model and the others the MUFU model; lazy rescaling
within 2x of always-rescale plus one output ulp.

    python tests/cpu/test_sm100_numerics.py    # prints the error bands (docs/design/sm100_selftest.md)
"""

from __future__ import annotations

import math

import pytest
import torch

from flash4.constants import LOG2E
from flash4.kernels.common.exp2_poly import exp2_emulated_np
from flash4.models import sm100_fwd as M
from flash4.reference import LSE_ATOL, OUT_ATOL, attention_ref, max_abs_err

NOISE_LOG2 = 1.0
RAMP_PER_BLOCK = 7.0  # < tau: the max rises without moving the reference


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The model's float64 matmuls are small: on a shared 2-core box, 2 threads made them ~20x
    slower than 1 (measured: 13.8 ms vs 0.6 ms for (600, 16) @ (16, 128))."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def random_case(b, sq, sk, h, hk, d, dtype=torch.bfloat16, seed=0, magnitude=1.0, dv=None):
    g = _gen(seed)
    q, k, v = (torch.randn(s, generator=g) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, dv or d)))
    return (q * magnitude).to(dtype), (k * magnitude).to(dtype), v.to(dtype)


def biased_case(bias_log2, sq, d, seed=0, b=1, h=2, dtype=torch.bfloat16):
    """q, k, v whose scores in log2 units are bias_log2[j] + N(0, NOISE_LOG2): q[..., 0] = 1,
    k[j, 0] = bias_log2[j] / c, the other coordinates noise (softmax_scale 1 / sqrt(d))."""
    g = _gen(seed)
    c = LOG2E / math.sqrt(d)
    sk = bias_log2.shape[0]
    q = torch.randn(b, sq, h, d, generator=g)
    q[..., 0] = 1.0
    k = torch.randn(b, sk, h, d, generator=g) * (NOISE_LOG2 / (c * math.sqrt(d - 1)))
    k[..., 0] = (bias_log2 / c).view(1, sk, 1)
    v = torch.randn(b, sk, h, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def errors(q, k, v, causal, out, lse, scale=None):
    """Errors of (out, lse) and of PyTorch's same-dtype result, against the float64 reference."""
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal, compute_dtype=torch.float64)
    pt_out, pt_lse = attention_ref(q, k, v, scale, causal, upcast=False)
    return {"out": max_abs_err(out, ref_out), "out_pt": max_abs_err(pt_out, ref_out),
            "lse": max_abs_err(lse, ref_lse), "lse_pt": max_abs_err(pt_lse, ref_lse)}


def ratios(e):
    """err / (2 * pt_err + atol) for out and lse: <= 1 passes."""
    return e["out"] / (2 * e["out_pt"] + OUT_ATOL), e["lse"] / (2 * e["lse_pt"] + LSE_ATOL)


def check(q, k, v, causal, **kw):
    out, lse, stats = M.forward(q, k, v, None, causal, return_stats=True, **kw)
    e = errors(q, k, v, causal, out, lse)
    r_out, r_lse = ratios(e)
    assert r_out <= 1, f"out err {e['out']:.3e} > 2 x PyTorch {e['out_pt']:.3e} + {OUT_ATOL}"
    assert r_lse <= 1, f"lse err {e['lse']:.3e} > 2 x PyTorch {e['lse_pt']:.3e} + {LSE_ATOL}"
    return e, stats


# ---------------------------------------------------------------- random inputs

SHAPES = [  # (b, sq, sk, h, hk)
    (1, 1, 1, 1, 1),
    (2, 77, 77, 2, 2),
    (1, 200, 333, 4, 1),  # MQA, sq < sk
    (1, 333, 200, 4, 2),  # sq > sk: causal rows without keys
    (1, 300, 1000, 2, 1),  # 8 key blocks, partial last
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_random(shape, d, causal):
    b, sq, sk, h, hk = shape
    check(*random_case(b, sq, sk, h, hk, d, seed=sq + d), causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dv", [(192, 128), (256, 256)], ids=["d192v128", "d256"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_random_q_stage_1_headdims(shape, d, dv, causal):
    """The head dims the kernel runs with one Q tile per CTA: the model is per query row, so q_stage
    does not enter; the longer QK^T (12 / 16 UMMA k-steps) and Dv != D do."""
    b, sq, sk, h, hk = shape
    check(*random_case(b, sq, sk, h, hk, d, seed=sq + d, dv=dv), causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dv", [(192, 128), (256, 256)], ids=["d192v128", "d256"])
def test_random_fp16_q_stage_1_headdims(d, dv, causal):
    check(*random_case(1, 257, 513, 2, 1, d, dtype=torch.float16, seed=5, dv=dv), causal)


@pytest.mark.parametrize("d,dv", [(192, 128), (256, 256)], ids=["d192v128", "d256"])
def test_stale_max_and_huge_magnitudes_q_stage_1_headdims(d, dv):
    """Adversarial inputs at these head dims: a max rising by less than tau per block (stale
    reference used), and scores of magnitude ~1e4 (the exact reference's range)."""
    q, k, v = biased_case(_ramp(700).flip(0), 150, d, seed=7)
    v = v[..., :dv].contiguous()
    _, stats = check(q, k, v, False)
    assert stats["stale_blocks"] > 0 and stats["max_stale_log2"] > 4, stats
    check(*random_case(1, 130, 300, 2, 2, d, seed=9, magnitude=30.0, dv=dv), True)


@pytest.mark.parametrize("causal", [False, True])
def test_random_fp16(causal):
    check(*random_case(1, 257, 513, 2, 1, 128, dtype=torch.float16, seed=3), causal)


@pytest.mark.parametrize("variant", [dict(rescale_step="fa4"), dict(key_order="forward"), dict(mma_k=None),
                                     dict(exp2_emu_frac=0.0), dict(exp2_emu_frac=0.125), dict(exp2_emu_frac=1.0),
                                     dict(exp2_emu_columns=M.fa4_emu_columns(128, 10)),
                                     dict(exact_ref=False), dict(tile_n=64)],
                         ids=lambda v: ",".join(f"{k}={'fa4:10' if torch.is_tensor(x) else x}" for k, x in v.items()))
def test_random_variants(variant):
    check(*random_case(1, 200, 700, 2, 1, 128, seed=11), True, **variant)


# ---------------------------------------------------------------- adversarial inputs

def _ramp(sk, per_block=RAMP_PER_BLOCK):
    j = torch.arange(sk, dtype=torch.float32)
    return (j - (sk - 1) / 2) * (per_block / 128)


def test_stale_max_slow_rise():
    """The max rises by 7 < tau per block in visiting order (last block first: bias falls along
    seqlen_k), so the reference stays stale by up to tau and P reaches > 2^4."""
    q, k, v = biased_case(_ramp(1000).flip(0), 260, 128)
    e, stats = check(q, k, v, False)
    assert stats["stale_blocks"] > 0 and stats["max_stale_log2"] > 4 and stats["p_max"] > 16, stats
    assert stats["max_stale_log2"] <= 8 and stats["p_max"] <= 2 ** 8 * 1.001, stats
    # forward order: the same ramp falls in visiting order, the max never moves after block 0
    _, fwd_stats = check(q, k, v, False, key_order="forward")
    assert fwd_stats["rescales"] == 0 and fwd_stats["stale_blocks"] == 0, fwd_stats


def test_stale_max_causal_rise():
    """Rising along seqlen_k with causal: each row's max sits at its diagonal (first visited)."""
    q, k, v = biased_case(_ramp(700), 700, 64)
    check(q, k, v, True)


def test_near_tau_jump():
    """One key in block 0 (visited last) 12 log2 units up: rows fall on both sides of tau."""
    bias = torch.zeros(777)
    bias[5] = 12.0
    e, stats = check(*biased_case(bias, 300, 128), False)
    assert stats["rescales"] > 0 and stats["stale_blocks"] > 0, stats


def test_dominant_key_seen_last():
    bias = torch.zeros(1000)
    bias[3] = 40.0
    e, stats = check(*biased_case(bias, 129, 128), False)
    assert stats["rescales"] > 0, stats


def test_huge_magnitudes():
    """Scores ~1e6 (log2 units beyond 2^20: some rows take the exact-reference path)."""
    q, k, v = random_case(1, 130, 300, 2, 1, 128, seed=5, magnitude=1000.0)
    e, stats = check(q, k, v, False)
    assert stats["exact_rows"] > 0, stats
    check(q, k, v, True, exact_ref=False)  # ulp(R) = 2^-3 here: the stale residual is still harmless


def test_extreme_magnitudes_need_exact_reference():
    """Scores ~1e30: ulp(R) ~ 1e23, so fma(S, c, -R) leaves exp2's range at the row max unless R_lo
    is subtracted too: flash4's exact path keeps the result exact; FA4's dataflow without it does not."""
    q, k, v = random_case(1, 64, 200, 1, 1, 64, seed=6, magnitude=1e15)
    e, stats = check(q, k, v, False)
    assert stats["exact_rows"] == 64, stats
    out, lse = M.forward(q, k, v, exact_ref=False)
    ref_out, _ = attention_ref(q, k, v, compute_dtype=torch.float64)
    assert not torch.isfinite(out).all() or max_abs_err(out, ref_out) > 0.1


def test_tiny_magnitudes():
    q, k, v = random_case(1, 100, 500, 2, 2, 64, seed=7, magnitude=1e-3)
    check(q, k, v, False)
    check(q, k, v, True)


def test_equal_scores():
    q, k, v = random_case(2, 50, 300, 2, 1, 64, seed=8)
    check(torch.zeros_like(q), k, v, False)


def test_rows_that_see_one_key_or_none():
    # causal, sq == sk: row 0 sees key 0 only (a single visible column in the last visited block)
    check(*random_case(1, 300, 300, 2, 1, 128, seed=9), True)
    # seqlen_k 1: out = v
    q, k, v = random_case(2, 65, 1, 2, 1, 64, seed=10)
    check(q, k, v, False)
    out, _ = M.forward(q, k, v)
    assert torch.equal(out, v.expand(2, 65, 2, 64)), "seqlen_k 1: out must be v exactly"
    # causal, sq > sk: rows 0..sq-sk-1 see no key: out 0, lse -inf
    q, k, v = random_case(1, 200, 70, 2, 2, 64, seed=12)
    out, lse = M.forward(q, k, v, None, True)
    assert (out[:, :130] == 0).all() and torch.isneginf(lse[:, :, :130]).all()
    check(q, k, v, True)


def test_no_keys():
    q, k, v = random_case(1, 5, 0, 2, 1, 64)
    out, lse = M.forward(q, k, v)
    assert (out == 0).all() and torch.isneginf(lse).all()


# ---------------------------------------------------------------- equivalences

def plain_online_softmax(q, k, v, scale, causal, tile_n=128):
    """Textbook online softmax, blocks in the kernel's order (last first), always rescaling, fp32
    state, one rounding per block product, P rounded to the input dtype for P V."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    c = scale * LOG2E
    q64 = q.permute(0, 2, 1, 3).double()
    k64 = k.repeat_interleave(h // hk, 2).permute(0, 2, 1, 3).double()
    v64 = v.repeat_interleave(h // hk, 2).permute(0, 2, 1, 3).double()
    s_all = (q64 @ k64.transpose(-1, -2)).float()
    if causal:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s_all = s_all.masked_fill(j > i + sk - sq, -math.inf)
    m = torch.full((b, h, sq), -math.inf)
    row_sum = torch.zeros(b, h, sq)
    o = torch.zeros(b, h, sq, v.shape[-1])
    for nb in reversed(range(-(-sk // tile_n))):
        s = s_all[..., nb * tile_n:(nb + 1) * tile_n]
        m_new = torch.maximum(m, s.amax(-1))
        ref = torch.where(m_new == -math.inf, 0.0, m_new)
        alpha = torch.exp2((m - ref) * c)
        p = torch.exp2(s * c - (ref * c)[..., None])
        row_sum = row_sum * alpha + p.sum(-1)
        o = o * alpha[..., None] + (p.to(q.dtype).double() @ v64[..., nb * tile_n:(nb + 1) * tile_n, :]).float()
        m = m_new
    empty = row_sum == 0
    out = torch.where(empty[..., None], 0.0, o / row_sum[..., None]).to(q.dtype).permute(0, 2, 1, 3)
    lse = torch.where(empty, -math.inf, (torch.where(empty, 0.0, m) * c + torch.log2(row_sum)) * math.log(2))
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_tau0_no_emulation_is_plain_online_softmax(causal):
    q, k, v = random_case(1, 200, 600, 2, 1, 64, seed=13)
    scale = 1 / 8
    out, lse, stats = M.forward(q, k, v, scale, causal, rescale_threshold=0.0, exp2_emu_frac=0.0, return_stats=True)
    p_out, p_lse = plain_online_softmax(q, k, v, scale, causal)
    ulp = 2.0 ** (math.floor(math.log2(p_out.abs().max().item())) - 7)  # bf16 ulp at the largest |out|
    assert max_abs_err(out, p_out) <= ulp
    assert (out != p_out).float().mean() < 0.01  # the arithmetic differs only in roundings
    assert max_abs_err(lse, p_lse) <= 1e-5
    assert stats["stale_blocks"] == 0 and stats["p_max"] <= 1 + 2 ** -20 and stats["emulated_frac"] == 0


@pytest.mark.parametrize("columns", ["frac0.25", "frac0.375", "fa4:16", "all"])
def test_emulated_exp2_is_bit_exact(columns):
    mask = {"frac0.25": M.emu_columns(128, 0.25), "frac0.375": M.emu_columns(128, 0.375),
            "fa4:16": M.fa4_emu_columns(128, 16), "all": M.emu_columns(128, 1.0)}[columns]
    q, k, v = random_case(1, 150, 300, 2, 1, 128, seed=14, magnitude=2.0)
    _, _, stats = M.forward(q, k, v, None, True, exp2_emu_columns=mask, return_stats=True, trace=True)
    assert len(stats["trace"]) == 3
    for blk in stats["trace"]:
        x, p, emu = blk["x"], blk["p"], blk["emulated"]
        assert torch.equal(emu, mask)
        want = torch.from_numpy(exp2_emulated_np(x[..., emu].numpy()))
        assert torch.equal(p[..., emu].view(torch.int32), want.view(torch.int32))  # bit for bit
        assert torch.equal(p[..., ~emu], M.exp2_hw(x[..., ~emu]))
        assert (p[..., ~emu] == 0).logical_or(x[..., ~emu] >= -126).all()


def test_emu_columns_match_the_kernel_rule():
    """The model's columns are the sm100 kernel's: packed pairs (EXP2_EMU_GROUP), of every period
    pairs the first k (RowSoftmax.exp2_pair asks exp2_poly.emulated_column, as the model does)."""
    from flash4.kernels.common.exp2_poly import mixed_pattern
    from flash4.kernels.sm100.plan import EXP2_EMU_FRAC, EXP2_EMU_FRAC_CAUSAL, EXP2_EMU_GROUP

    assert EXP2_EMU_GROUP == 2 and M.DEFAULT_EXP2_EMU_FRAC == EXP2_EMU_FRAC
    for frac in (0.0, 0.125, 0.25, 0.375, 0.5, 1.0):
        k, period = mixed_pattern(frac)
        cols = M.emu_columns(128, frac)
        assert cols.tolist() == [(c // 2) % period < k for c in range(128)]
        assert cols[0::2].tolist() == cols[1::2].tolist()  # a pair shares its unit
        assert abs(cols.float().mean().item() - frac) < 1e-9
    for frac in (EXP2_EMU_FRAC, EXP2_EMU_FRAC_CAUSAL):  # every shipped share is one the model runs
        assert M.emu_columns(128, frac).any()


def test_fa4_emu_columns():
    cols = M.fa4_emu_columns(128, 16).nonzero().flatten().tolist()
    # fragments 1 and 2 (start_frg 1, the last fragment never): columns 12-15 and 28-31 of each
    assert cols == [44, 45, 46, 47, 60, 61, 62, 63, 76, 77, 78, 79, 92, 93, 94, 95]
    assert M.fa4_emu_columns(128, 10, start_frg=0).sum() == 3 * 12
    assert M.fa4_emu_columns(128, 0).sum() == 0


def test_exp2_models_at_the_edges():
    x = torch.tensor([-math.inf, -200.0, -126.5, -126.0, -1.0, 0.0, 0.5, 7.99, 8.0], dtype=torch.float32)
    hw = M.exp2_hw(x)
    assert hw[:3].tolist() == [0.0, 0.0, 0.0] and hw[3].item() == 2.0 ** -126 and hw[5].item() == 1.0
    emu = M.exp2_mixed(x, torch.ones(9, dtype=torch.bool))
    assert emu[0].item() == 0.0 and emu[5].item() == 1.0 and emu[8].item() == 256.0


def test_row_sum_and_mma_primitives():
    g = _gen(15)
    p = torch.rand(3, 128, generator=g)
    init = torch.rand(3, generator=g)
    assert torch.allclose(M.row_sum_fa4(p, init).double(), p.double().sum(-1) + init.double(), rtol=1e-6)
    # lane order: 8 fp32 lanes over columns mod 8, then the tree
    lanes = p.reshape(3, 16, 8)
    manual = lanes[:, 0].clone()
    manual[:, 0] = init + p[:, 0]
    for i in range(1, 16):
        manual = manual + lanes[:, i]
    a = (manual[:, 0:2] + manual[:, 2:4]) + (manual[:, 4:6] + manual[:, 6:8])
    assert torch.equal(M.row_sum_fa4(p, init), a[:, 0] + a[:, 1])
    a64 = torch.randn(4, 64, generator=g, dtype=torch.float64)
    b64 = torch.randn(64, 5, generator=g, dtype=torch.float64)
    assert torch.equal(M.mma_f32(None, a64, b64, None), (a64 @ b64).float())
    assert torch.allclose(M.mma_f32(None, a64, b64, 16).double(), a64 @ b64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["slow_rise", "near_tau", "dominant_last"])
def test_lazy_within_2x_of_always(case):
    """err(tau = 8) <= 2 err(tau = 0) + one output ulp at the largest |out| (as the GPU test
    tests/gpu/test_softmax_adversarial.py); lse within 2x + 2.5e-4 (the polynomial's 1.25e-4
    moves the row sum by different amounts in the two)."""
    bias = {"slow_rise": _ramp(1000).flip(0), "near_tau": torch.zeros(1000).index_fill(0, torch.tensor([5]), 12.0),
            "dominant_last": torch.zeros(1000).index_fill(0, torch.tensor([3]), 40.0)}[case]
    q, k, v = biased_case(bias, 200, 128)
    ref_out, ref_lse = attention_ref(q, k, v, compute_dtype=torch.float64)
    lazy = M.forward(q, k, v)
    always = M.forward(q, k, v, rescale_threshold=0.0)
    ulp = 2.0 ** (math.floor(math.log2(ref_out.abs().max().item())) - 7)
    assert max_abs_err(lazy[0], ref_out) <= 2 * max_abs_err(always[0], ref_out) + ulp
    assert max_abs_err(lazy[1], ref_lse) <= 2 * max_abs_err(always[1], ref_lse) + 2.5e-4


def test_bad_arguments():
    q, k, v = random_case(1, 4, 4, 1, 1, 64)
    with pytest.raises(ValueError, match="tile_n"):
        M.forward(q, k, v, tile_n=100)
    with pytest.raises(ValueError, match="bfloat16 or all float16"):
        M.forward(q.float(), k, v)
    with pytest.raises(ValueError, match="key_order"):
        M.forward(q, k, v, key_order="sideways")
    with pytest.raises(ValueError, match="exp2_emu_columns"):
        M.forward(q, k, v, exp2_emu_columns=[True] * 3)


# ---------------------------------------------------------------- the bands (docs/design/sm100_selftest.md)

def bands():
    """Per case and model variant: out error in ulps of the output dtype at the largest |out|, lse
    error (absolute; relative to |lse| for the extreme case), and the worst ratio to the criterion's
    bound over out and lse (<= 1 passes); then the worst of each column over the cases."""
    cases = []
    for (b, sq, sk, h, hk) in SHAPES:
        for d in (64, 128):
            for causal in (False, True):
                cases.append((f"random {b}x{sq}x{sk}x{h}x{hk} d{d}{' causal' if causal else ''}",
                              random_case(b, sq, sk, h, hk, d, seed=sq + d), causal))
    cases.append(("random fp16 1x257x513x2x1 d128 causal",
                  random_case(1, 257, 513, 2, 1, 128, dtype=torch.float16, seed=3), True))
    adv = {"slow_rise": _ramp(1000).flip(0), "near_tau": torch.zeros(777).index_fill(0, torch.tensor([5]), 12.0),
           "dominant_last": torch.zeros(1000).index_fill(0, torch.tensor([3]), 40.0)}
    for name, bias in adv.items():
        cases.append((f"adversarial {name} 260x{bias.shape[0]} d128", biased_case(bias, 260, 128), False))
    cases.append(("adversarial causal rise 700x700 d64", biased_case(_ramp(700), 700, 64), True))
    cases.append(("huge (x1e3) 130x300 d128", random_case(1, 130, 300, 2, 1, 128, seed=5, magnitude=1000.0), False))
    cases.append(("extreme (x1e15) 64x200 d64", random_case(1, 64, 200, 1, 1, 64, seed=6, magnitude=1e15), False))
    cases.append(("tiny (x1e-3) 100x500 d64 causal", random_case(1, 100, 500, 2, 2, 64, seed=7, magnitude=1e-3), True))
    cases.append(("one key per row 300x300 d128 causal", random_case(1, 300, 300, 2, 1, 128, seed=9), True))
    variants = {"default": {}, "tau0,emu0": dict(rescale_threshold=0.0, exp2_emu_frac=0.0),
                "emu1.0": dict(exp2_emu_frac=1.0), "fa4-step": dict(rescale_step="fa4"),
                "fwd-order": dict(key_order="forward")}
    worst = {v: [0.0, 0.0, 0.0] for v in variants}
    print("case | " + " | ".join(f"{v}: out ulp, lse err, ratio" for v in variants))
    for name, (q, k, v), causal in cases:
        ref_out, ref_lse = attention_ref(q, k, v, None, causal, compute_dtype=torch.float64)
        bits = 7 if q.dtype == torch.bfloat16 else 10
        ulp = 2.0 ** (math.floor(math.log2(ref_out.abs().max().item())) - bits)
        finite = torch.isfinite(ref_lse)
        rel = ref_lse[finite].abs().max().item() > 1e6
        cells = []
        for vname, kw in variants.items():
            out, lse = M.forward(q, k, v, None, causal, **kw)
            e = errors(q, k, v, causal, out, lse)
            lse_err = e["lse"] / ref_lse[finite].abs().max().item() if rel else e["lse"]
            row = (e["out"] / ulp, lse_err, max(ratios(e)))
            worst[vname] = [max(a, b) for a, b in zip(worst[vname], row)]
            cells.append(f"{row[0]:.2f}, {row[1]:.2e}{' rel' if rel else ''}, {row[2]:.3f}")
        print(f"{name} | " + " | ".join(cells))
    print("worst | " + " | ".join(f"{w[0]:.2f}, {w[1]:.2e}, {w[2]:.3f}" for w in worst.values()))


if __name__ == "__main__":
    bands()
