"""The portable (sm80) family's backward on the GPU, through the host pipeline (flash4.forward /
flash4.backward / flash_attn_func), with the family forced by FLASH4_FAMILY=portable (on the H200:
compiled for sm_90a, the same mma.sync / ldmatrix / cp.async instructions as on sm_80 / 86 / 89 /
120). The tiles of the 99 KiB targets (sm_86 / 89 / 120) run here too (`small_tiles`).

Criterion (flash4.reference, tests/gpu/gpu_helpers.py): per gradient, max |g - g_ref| <= 2 * max
|g_pt - g_ref| + GRAD_ATOL against the float32 reference, g_pt the same computation in the input
dtype; dq / dk / dv NaN-poisoned before the call (an unwritten element fails). Marker gpu; skipped
without CUDA or where the portable family does not run.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash4 import flash_attn_func, forward
from flash4.arch import device_arch
from flash4.backward import flash_attn_backward
from flash4.config import active_family, bwd_config
from flash4.config import sm80 as sm80_config
from flash4.request import Request

from gpu_helpers import (assert_grads, check_bwd, check_bwd_dv, check_deterministic, check_grads_varlen, make_varlen,
                         rand_lengths,
                         ref_grads, run_bwd_varlen)


@pytest.fixture(autouse=True, scope="module")
def portable():
    """FLASH4_FAMILY=portable for the whole module; skip where the family does not run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASH4_FAMILY", "portable")
        if torch.cuda.is_available():
            try:
                assert active_family(device_arch()).name == "sm80"
            except ValueError as err:
                pytest.skip(f"the portable family does not run here: {err}")
        yield


@pytest.fixture
def small_tiles(monkeypatch):
    """The tiles chosen for the 99 KiB targets (sm_86 / 89 / 120) on this GPU."""
    arch = device_arch()
    monkeypatch.setitem(sm80_config._BWD_SMEM_CLASS, arch, "small")
    monkeypatch.setitem(sm80_config._SMEM_CLASS, arch, "small")


def test_the_family_runs():
    """The backward plan is the portable family's (the wiring this module relies on)."""
    q = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    plan = bwd_config(Request.dense(q, q, q, 0.125, False), device_arch())
    assert isinstance(plan.cfg, sm80_config.Sm80BwdConfig)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("s", [1, 17, 129, 1000])
def test_square(s, d, causal):
    check_bwd(2, s, s, 2, 2, d, causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 1000), (1000, 17), (129, 1), (1, 129), (300, 2048)])
def test_rect(sq, sk, causal, d):
    check_bwd(1, sq, sk, 2, 2, d, causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hk", [1, 2])  # MQA (16:1) and GQA 8:1
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(hk, causal, d):
    check_bwd(2, 700, 700, 16, hk, d, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64), (64, 128)], ids=["192-128", "128-64", "64-128"])
def test_value_headdim(d, dv, causal):
    """v's head dim differs from q/k's (flash4.config.HDIMV_PAIRS): forward and backward of the family
    into NaN-filled gradients, against the float32 reference; GQA 8:2, rectangular."""
    gen = torch.Generator(device="cuda").manual_seed(d + dv)
    q = torch.randn(2, 333, 8, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 555, 2, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 555, 2, dv, generator=gen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 333, 8, dv, generator=gen, device="cuda", dtype=torch.bfloat16)
    assert bwd_config(Request.dense(q, k, v, d ** -0.5, causal), device_arch()).cfg.hdim_v == dv
    check_bwd_dv(q, k, v, dout, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp16(d):
    check_bwd(2, 333, 555, 4, 2, d, True, dtype=torch.float16)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [128, 192])  # the shapes that differ from this GPU's own (d64, d96: the same)
def test_small_tiles(small_tiles, d, causal):
    """The sm_86 / 89 / 120 tiles (one Q / dO buffer at d128, 32 x 64 at d192) on this GPU."""
    check_bwd(2, 333, 555, 4, 2, d, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen(d, causal):
    lens_q, lens_k = rand_lengths(6, 300, seed=d), rand_lengths(6, 300, seed=d + 1)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, d, seed=d)
    dout = torch.randn_like(q)
    got = run_bwd_varlen(q, k, v, cu_q, cu_k, dout, causal)
    check_grads_varlen(got, q, k, v, cu_q, cu_k, dout, causal)


def test_varlen_seqused():
    lens = rand_lengths(5, 200, seed=3)
    q, k, v, cu_q, cu_k = make_varlen(lens, lens, 2, 1, 64, seed=3)
    used = torch.tensor([max(n - 7, 0) for n in lens], dtype=torch.int32, device="cuda")
    dout = torch.randn_like(q)
    got = run_bwd_varlen(q, k, v, cu_q, cu_k, dout, True, seqused_q=used, seqused_k=used)
    check_grads_varlen(got, q, k, v, cu_q, cu_k, dout, True, seqused_q=used, seqused_k=used)


@pytest.mark.parametrize("window,softcap", [((64, 0), 0.0), ((100, 30), 0.0), ((-1, -1), 30.0), ((50, 50), 20.0)])
@pytest.mark.parametrize("d", [64, 128])
def test_window_softcap(d, window, softcap):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, dout = (torch.randn(2, n, 4, d, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for n in (400, 500, 500, 400))
    scale = d ** -0.5
    req = Request.dense(q, k, v, scale, False, window, softcap)
    out, lse = forward.run(req)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, False, *grads, window_size=window, softcap=softcap)
    torch.cuda.synchronize()
    kw = dict(window_size=window, softcap=softcap)
    assert_grads(grads, ref_grads(q, k, v, dout, False, True, **kw), ref_grads(q, k, v, dout, False, False, **kw))


def test_autograd_end_to_end():
    """flash_attn_func's backward with the family forced equals the direct call's gradients."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (torch.randn(2, 257, 4, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*leaves, causal=True).backward(dout)
    assert_grads([t.grad for t in leaves], ref_grads(q, k, v, dout, True, True), ref_grads(q, k, v, dout, True, False))


def test_large_scores_exact_path():
    """Scores of ~1000 (|LSE log2| past BWD_EXACT_LSE_LOG2): P from the forward's unrounded LSE split."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, dout = (torch.randn(1, 200, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    q = q * 80  # scores ~ N(0, 640): |LSE log2| ~ 2000, past BWD_EXACT_LSE_LOG2 = 1024
    scale = 1.0
    split = torch.empty(2, 1, 2, 200, dtype=torch.float32, device="cuda")
    req = Request.dense(q, k, v, scale, True)
    out, lse = forward.run(req, lse_split=split)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    flash_attn_backward(dout, q, k, v, out, lse, scale, True, *grads, lse_split=split)
    torch.cuda.synchronize()
    kw = dict(softmax_scale=scale)
    assert_grads(grads, ref_grads(q, k, v, dout, True, True, **kw), ref_grads(q, k, v, dout, True, False, **kw))


@pytest.mark.parametrize("d,hk,causal", [(64, 2, False), (128, 1, True)])
def test_deterministic(d, hk, causal):
    """deterministic=True: the dQ adds in n_block order: right, and bitwise equal over 3 more calls."""
    check_deterministic(2, 1000, 4, hk, d, causal, calls=3, seed=d)


def test_deterministic_window():
    """With a window the chain of a query tile starts at its band's first key tile."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v, dout = (torch.randn(1, 900, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale, window = 0.125, (200, 0)
    out, lse = forward.run(Request.dense(q, k, v, scale, False, window))
    first = flash_attn_backward(dout, q, k, v, out, lse, scale, False, deterministic=True, window_size=window)
    again = flash_attn_backward(dout, q, k, v, out, lse, scale, False, deterministic=True, window_size=window)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    kw = dict(window_size=window, softmax_scale=scale)
    assert_grads(first, ref_grads(q, k, v, dout, False, True, **kw), ref_grads(q, k, v, dout, False, False, **kw))


@pytest.mark.parametrize("name,base", [("fa2wq", "fa2w"), ("fa2wp", "fa2w"), ("fa2wpq", "fa2w"), ("fa2w1", "fa2w"),
                                       ("fa2wp1", "fa2w"), ("fa2wpq1", "fa2w"), ("fa2sq", "fa2s"), ("fa2sp", "fa2s"),
                                       ("fa2spq", "fa2s"), ("fa2sp1", "fa2s"), ("fa2spq1", "fa2s"),
                                       ("fa2wps", "fa2w"), ("fa2wpqs", "fa2w"), ("fa2sps", "fa2s"), ("fa2spqs", "fa2s")])
@pytest.mark.parametrize("causal", [False, True])
def test_step_order_candidates_bitwise(monkeypatch, name, base, causal):
    """Sm80BwdConfig.dq_before_dk / p_before_dp / dp_split and the one-stage variants (FLASH4_PORTABLE_BWD
    candidates, off): the same bits as the shipped candidate of the same tiles (fa2w at d64, fa2s at
    d128), dQ included (deterministic order on both sides), with exact-path and common query tiles
    walked by the same CTA (GQA 4:2: heads 0 and 1 share a KV head; head 1's rows 256-639 have |LSE
    log2| ~ 2000, so an exact tile's rewritten LSE / lo stage is refilled for a common one), and a
    partial last query / key tile."""
    from flash4.constants import BWD_EXACT_LSE_LOG2

    d = 64 if name.startswith("fa2w") else 128
    gen = torch.Generator(device="cuda").manual_seed(7 + d)
    q, dout = (torch.randn(2, 1000, 4, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 1000, 2, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = q / 8
    q[:, 256:640, 1] *= 640  # scores ~ N(0, (80 sqrt(d))^2): query tiles 256-639 (of 64 or 128 rows) exact
    scale = 1.0
    split = torch.empty(2, 2, 4, 1000, dtype=torch.float32, device="cuda")
    req = Request.dense(q, k, v, scale, causal)
    out, lse = forward.run(req, lse_split=split)
    lse_log2 = (lse[:, 1] * math.log2(math.e)).abs()
    assert bool((lse_log2[:, 256:640] >= BWD_EXACT_LSE_LOG2).all() and (lse_log2[:, :256] < BWD_EXACT_LSE_LOG2).all())
    got = {}
    for cand in (base, name):
        monkeypatch.setenv("FLASH4_PORTABLE_BWD", cand)
        plan = bwd_config(Request.dense(q, k, v, scale, causal, deterministic=True), device_arch())
        fields = sm80_config.BWD_CANDIDATE_FIELDS[cand]
        assert plan.cfg.deterministic and all(getattr(plan.cfg, f) == on for f, on in fields.items()), plan.cfg
        assert plan.cfg.p_before_dp == ("p_before_dp" in fields) and plan.cfg.dq_before_dk == ("dq_before_dk" in fields)
        assert plan.cfg.dp_split == ("dp_split" in fields)
        grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
        flash_attn_backward(dout, q, k, v, out, lse, scale, causal, *grads, lse_split=split, deterministic=True)
        got[cand] = grads
    torch.cuda.synchronize()
    for a, b, what in zip(got[base], got[name], ("dq", "dk", "dv")):
        assert torch.equal(a, b), (what, (a.float() - b.float()).abs().max().item())
    kw = dict(softmax_scale=scale)
    assert_grads(got[name], ref_grads(q, k, v, dout, causal, True, **kw), ref_grads(q, k, v, dout, causal, False, **kw))
