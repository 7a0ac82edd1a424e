"""The host wiring of the sm_100 (Blackwell) forward and backward, on the CPU with a mocked device (FLASH4_ARCH=100).

The sm100 family is compile-verified only (never run on a B200), so it is served behind the
first-use self-test (flash4.selftest): the registry hands it out (Family.selftest_gated), config
selection picks its configs, and both the API's support check (flash4.validate) and the one forward
launch site (flash4.forward.launch) ask `selftest.support_problem` / `selftest.require` first.
Here the self-test itself is replaced by fixed verdicts (its machinery has its own tests:
test_selftest_cpu.py, tests/gpu/test_selftest.py); flash4.compile is replaced by a recorder.
"""

from __future__ import annotations

import dataclasses

import re

import pytest
import torch

import flash4
from flash4 import forward, selftest, validate
from flash4.config import fwd_config, sm100
from flash4.kernels import registry
from flash4.launch import fwd_grid, fwd_num_tiles
from flash4.request import Request

BF16 = torch.bfloat16


@pytest.fixture
def sm100_device(monkeypatch):
    """CPU tensors through the device check, on a device that says sm_100; no verdict memo."""
    device_problem = validate._device_problem

    def relative_only(q, others, dense=False):
        problem = device_problem(q, others, dense)
        return None if problem is not None and problem[1].startswith("q is on cpu") else problem

    monkeypatch.setattr(validate, "_device_problem", relative_only)
    monkeypatch.setenv("FLASH4_ARCH", "100")
    monkeypatch.delenv("FLASH4_SM100", raising=False)
    selftest._forget()
    yield
    selftest._forget()


def verdicts(monkeypatch, ok: bool):
    """selftest.check replaced: every config gets a pass (ok) or a 'wrong' verdict; returns the
    configs it was asked about."""
    asked = []

    def check(cfg, device=None, **kwargs):
        asked.append(cfg)
        return selftest.Verdict(ok=ok, status="pass" if ok else "wrong", config=repr(cfg), gpu="NVIDIA B200",
                                sm="sm_100", gated=True, created="2026-12-02T00:00:00+00:00",
                                failure=None if ok else "case 'odd lengths' (b2 sq17 sk17 h2/2): out error 0.5 > 0.01",
                                path="/tmp/verdict.json")

    monkeypatch.setattr(selftest, "check", check)
    return asked


def qkv(d=128, sq=300, sk=300, h=4, hk=4, dtype=BF16, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, sq, h, d, generator=g).to(dtype)
    k = torch.randn(1, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(1, sk, hk, d, generator=g).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


# ---------------------------------------------------------------- the registry
def test_registry_serves_sm100_behind_the_gate():
    fam = registry.family(100)
    assert fam.name == "sm100" and not fam.verified and fam.selftest_gated and fam.usable
    assert fam.has_pass("fwd") and fam.has_pass("bwd")  # the 1-CTA backward (compile-verified, not run)
    assert 90 in registry.supported_archs() and 100 not in registry.supported_archs()
    assert registry.gated_archs() == (100, 80, 86, 89, 120) == selftest.GATED_ARCHS  # sm100, the portable family
    assert registry.gate_family(100) is fam and fam.selftest_var == "FLASH4_SM100"
    assert registry.family(90).name == "sm90"


@pytest.mark.parametrize("arch, gpu", [(101, "Thor"), (103, "B300"), (110, "Thor"), (121, "GB10")])
def test_blackwell_relatives_refused_by_name(arch, gpu):
    """sm_103 / 110 / 121 (and the old 101) are different GPUs: refused explicitly, never `arch >= 100`."""
    for unverified in (False, True):
        with pytest.raises(ValueError, match=f"no kernels for sm_{arch}: .*{gpu}"):
            registry.family(arch, include_unverified=unverified)


def test_consumer_blackwell_never_gets_sm100():
    assert registry.family(120, include_unverified=True).name == "sm80"
    assert registry.family(120).name == "sm80"  # the portable family behind its own gate (FLASH4_PORTABLE), never sm100
    assert registry.gate_family(120).selftest_var == "FLASH4_PORTABLE"


# ---------------------------------------------------------------- config selection and the grid
def test_fwd_config_on_sm100():
    q, k, v = qkv()
    plan = fwd_config(Request.dense(q, k, v, causal=True), 100)
    assert plan.cfg == sm100.select_fwd_config(128, "bf16", True) and selftest.gated(plan.cfg)


def test_two_cta_is_selected_only_with_its_switch(monkeypatch):
    """FLASH4_SM100_2CTA=1: hd128 non-causal dense batches get the 2-CTA config; causal, other head
    dims and packed batches keep 1-CTA; unset: always 1-CTA."""
    q, k, v = qkv()
    monkeypatch.delenv("FLASH4_SM100_2CTA", raising=False)
    assert fwd_config(Request.dense(q, k, v), 100).cfg.cta_group == 1
    monkeypatch.setenv("FLASH4_SM100_2CTA", "1")
    plan = fwd_config(Request.dense(q, k, v), 100)
    assert plan.cfg == sm100.select_fwd_config(128, "bf16", False, two_cta=True) and plan.cfg.cta_group == 2
    assert selftest.gated(plan.cfg)
    assert fwd_config(Request.dense(q, k, v, causal=True), 100).cfg.cta_group == 1
    q64, k64, v64 = qkv(d=64)
    assert fwd_config(Request.dense(q64, k64, v64), 100).cfg.cta_group == 1


def test_two_cta_launch_is_gated_by_its_own_selftest(sm100_device, monkeypatch, compiled):
    """With the switch on, the support check and the launch ask the self-test about the 2-CTA config
    (the one that runs), and the grid has 2 CTAs per 512-row tile."""
    monkeypatch.setenv("FLASH4_SM100_2CTA", "1")
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv()
    two = sm100.select_fwd_config(128, "bf16", False, two_cta=True)
    assert validate.support_error(q, k, v) is None
    _launch()
    assert asked == [two] and compiled == [two]
    assert fwd_grid(two, 1, 300, 4, 148) == (2 * 4, 1, 1)  # ceil(300 / 512) tiles x 4 heads, 2 CTAs each


@pytest.mark.parametrize("hd,dv", [(256, None), (192, 128)])
def test_grid_counts_cta_tiles_of_128_rows_with_one_q_tile(hd, dv):
    cfg = sm100.select_fwd_config(hd, "bf16", True, headdim_v=dv)
    assert cfg.q_stage == 1 and cfg.cta_tile_m == 128
    assert fwd_num_tiles(cfg, 2, 300, 4) == 2 * 4 * 3  # ceil(300 / 128) m_blocks
    assert fwd_grid(cfg, 2, 257, 4, 132) == (24, 1, 1)


def test_grid_counts_cta_tiles_of_256_rows():
    cfg = sm100.select_fwd_config(128, "bf16", False)
    assert cfg.cta_tile_m == 256
    assert fwd_num_tiles(cfg, 2, 300, 4) == 2 * 4 * 2  # ceil(300 / 256) m_blocks
    assert fwd_grid(cfg, 2, 257, 4, 132) == (16, 1, 1)
    sm90 = flash4.config.select_fwd_config(128)
    assert fwd_num_tiles(sm90, 2, 300, 4) == 3 * 4 * 2  # sm90 tiles of tile_m rows, unchanged


# ---------------------------------------------------------------- the API's support check
def test_support_error_passes_after_a_pass(sm100_device, monkeypatch):
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(d=64, h=6, hk=2)
    assert validate.support_error(q, k, v, causal=True) is None
    assert asked == [sm100.select_fwd_config(64, "bf16", True)]
    validate.check_inputs(q, k, v, causal=True)


def test_support_error_returns_the_selftest_failure(sm100_device, monkeypatch):
    verdicts(monkeypatch, ok=False)
    q, k, v = qkv()
    cfg = sm100.select_fwd_config(128, "bf16", False)
    text = validate.support_error(q, k, v)
    assert text is not None and repr(cfg) in text and "out error" in text
    assert "Please report it" in text and "python -m flash4.selftest --rerun" in text and "FLASH4_SM100" in text
    with pytest.raises(RuntimeError, match="first-use self-test failed with wrong results"):
        validate.check_inputs(q, k, v)
    with pytest.raises(RuntimeError, match="first-use self-test failed"):
        flash4.flash_attn_func(q, k, v)


def test_modes_off_and_on(sm100_device, monkeypatch):
    asked = verdicts(monkeypatch, ok=False)
    q, k, v = qkv()
    monkeypatch.setenv("FLASH4_SM100", "off")
    assert "FLASH4_SM100=off" in validate.support_error(q, k, v)
    monkeypatch.setenv("FLASH4_SM100", "on")
    assert validate.support_error(q, k, v) is None
    assert asked == []  # neither mode runs the self-test
    monkeypatch.setenv("FLASH4_SM100", "sometimes")
    with pytest.raises(ValueError, match="FLASH4_SM100"):
        validate.support_error(q, k, v)


def test_what_sm100_lacks_is_refused_before_the_selftest(sm100_device, monkeypatch):
    """Dv != D (a (128, 64) pair: sm90 has it, sm100 not yet) is refused by name, without a self-test."""
    asked = verdicts(monkeypatch, ok=True)
    q, k, _ = qkv()
    v = torch.randn(1, 300, 4, 64).to(BF16)
    what = "(headdim, headdim_v)=(128, 64) is not implemented by the sm100 forward"
    text = validate.support_error(q, k, v)
    assert text is not None and what in text and "sm_100" in text
    assert asked == []
    with pytest.raises(ValueError, match=re.escape(what)):
        flash4.flash_attn_func(q, k, v)


def test_features_select_their_kernels(sm100_device, monkeypatch):
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv()
    assert validate.support_error(q, k, v, causal=True, softcap=5.0) is None
    assert validate.support_error(q, k, v, learnable_sink=torch.zeros(4)) is None
    assert validate.support_error(q, k, v, window_size=(100, 7)) is None
    assert validate.support_error(q, k, v, causal=True, window_size=(64, 0)) is None
    assert asked == [sm100.select_fwd_config(128, "bf16", True, softcap=True),
                     sm100.select_fwd_config(128, "bf16", False, sink=True),
                     sm100.select_fwd_config(128, "bf16", False, local=True),
                     sm100.select_fwd_config(128, "bf16", True, local=True)]


def test_exactly_causal_window_is_causal(sm100_device, monkeypatch):
    verdicts(monkeypatch, ok=True)
    q, k, v = qkv()
    assert validate.support_error(q, k, v, window_size=(-1, 0)) is None


def test_headdim_without_sm100_kernel(sm100_device, monkeypatch):
    """(192, 192) has no sm100 kernel (no FA4 design): refused by name, without a self-test."""
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(d=192)
    text = validate.support_error(q, k, v)
    assert "(headdim, headdim_v)=(192, 192) is not implemented by the sm100 forward" in text and "cpu" in text
    assert asked == []


def test_q_stage_1_headdims_are_served_behind_the_selftest(sm100_device, monkeypatch):
    """hd256 and (192, 128) (one Q tile per CTA) pass the API door on sm100 and go to the self-test,
    dense, causal or not, with window / softcap / sink, and packed (varlen; the gate's self-test verdict
    decides, which on a B200 reports packed configs untestable: test_varlen_is_untestable_for_the_real_selftest)."""
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(d=256)
    assert validate.support_error(q, k, v) is None
    assert validate.support_error(q, k, v, causal=True) is None
    q, k, _ = qkv(d=192)
    v = torch.randn(1, 300, 4, 128).to(BF16)
    assert validate.support_error(q, k, v) is None
    assert asked == [sm100.select_fwd_config(256), sm100.select_fwd_config(256, causal=True),
                     sm100.select_fwd_config(192, headdim_v=128)]
    assert [c.q_stage for c in asked] == [1, 1, 1]
    assert validate.support_error(q, k, v, causal=True, softcap=5.0) is None
    assert asked[-1] == sm100.select_fwd_config(192, "bf16", True, softcap=True, headdim_v=128)
    cu = torch.tensor([0, 300], dtype=torch.int32)
    assert validate.varlen_support_error(q[0], k[0], v[0], cu, cu, 300, 300) is None
    assert asked[-1] == dataclasses.replace(sm100.select_fwd_config(192, headdim_v=128), varlen_q=True, varlen_k=True)
    assert len(asked) == 5


def test_varlen_door_and_the_refused_layouts(sm100_device, monkeypatch):
    """Packed varlen (cu_seqlens, seqused_q, seqused_k) selects the sm100 varlen config (the real
    self-test calls it untestable, so on a B200 it runs only with FLASH4_SM100=on); paged K/V and the
    KV cache are refused by name, before any self-test."""
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = (t[0] for t in qkv())
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    used = torch.tensor([50, 200], dtype=torch.int32)
    assert validate.varlen_support_error(q, k, v, cu, cu, 200, 200, causal=True) is None
    assert validate.varlen_support_error(q, k, v, cu, cu, 200, 200, seqused_q=used) is None
    base = sm100.select_fwd_config(128, "bf16", True)
    assert asked == [dataclasses.replace(base, varlen_q=True, varlen_k=True),
                     dataclasses.replace(sm100.select_fwd_config(128), varlen_q=True, varlen_k=True, seqused_q=True)]
    assert validate.varlen_support_error(q, k, v, cu, cu, 200, 200, seqused_k=used) is None
    assert asked[-1] == dataclasses.replace(sm100.select_fwd_config(128), varlen_q=True, varlen_k=True,
                                            seqused_k=True)
    qd, kc, vc = qkv(sq=1)
    text = validate.kvcache_support_error(qd, kc, vc, cache_seqlens=100)
    assert "dense and packed varlen batches only" in text and "kvcache layout" in text
    assert len(asked) == 3


def test_varlen_is_untestable_for_the_real_selftest(sm100_device):
    """What a B200 user gets for packed varlen today: the dense self-test cannot drive the config, so
    the gate refuses it (support_error says why) unless FLASH4_SM100=on."""
    q, k, v = (t[0] for t in qkv())
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    text = validate.varlen_support_error(q, k, v, cu, cu, 200, 200)
    assert "self-test cannot check it" in text and "varlen_q=True" in text
    text = validate.varlen_support_error(q, k, v, cu, cu, 200, 200, seqused_k=torch.tensor([50, 200], dtype=torch.int32))
    assert "self-test cannot check it" in text and "seqused_k=True" in text


def test_training_asks_both_selftests(sm100_device, monkeypatch):
    """Inputs that require grad (in grad mode): the backward config autograd will run must exist and
    pass its own self-test too; inference asks the forward's only."""
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(requires_grad=True)
    assert validate.support_error(q, k, v, causal=True) is None
    assert asked == [sm100.select_fwd_config(128, "bf16", True), sm100.select_bwd_config(128, "bf16", True)]
    with torch.no_grad():
        assert validate.support_error(q, k, v) is None
    assert asked[2:] == [sm100.select_fwd_config(128, "bf16", False)]
    q, k, v = qkv(d=64, h=4, hk=2)
    sink = torch.zeros(4, requires_grad=True)  # the sink's gradient is torch's (flash4.autograd)
    assert validate.support_error(q, k, v, learnable_sink=sink) is None
    assert asked[3:] == [sm100.select_fwd_config(64, "bf16", False, sink=True), sm100.select_bwd_config(64)]
    q, k, v = qkv(requires_grad=True)  # a window: the local backward config
    assert validate.support_error(q, k, v, window_size=(45, 7)) is None
    assert asked[5:] == [sm100.select_fwd_config(128, "bf16", False, local=True),
                         sm100.select_bwd_config(128, "bf16", False, local=True)]
    assert validate.support_error(q, k, v, causal=True, softcap=5.0) is None  # softcap: the softcap backward
    assert asked[7:] == [sm100.select_fwd_config(128, "bf16", True, softcap=True),
                         sm100.select_bwd_config(128, "bf16", True, softcap=True)]
    assert asked[8].softcap


def test_the_softcap_backward_selftest_runs_with_softcap():
    """The self-test of a softcap backward config can drive it (its repr parses back) and feeds every
    case a softcap (selftest._SOFTCAP) through flash_attn_func's autograd (bwd_runner)."""
    cfg = sm100.select_bwd_config(128, "bf16", True, softcap=True)
    assert selftest.untestable_reason(cfg) is None and selftest.config_pass(cfg) == "bwd"
    for case in selftest.cases_for(cfg)[:2]:
        inputs = selftest.make_inputs(cfg, case, torch.device("cpu"))
        assert inputs["softcap"] == selftest._SOFTCAP > 0 and inputs["causal"]


def test_training_with_the_2cta_switch_asks_the_2cta_backward(sm100_device, monkeypatch):
    """FLASH4_SM100_2CTA=1: the door asks the self-test about the backward config autograd will run
    (flash4.config.sm100.bwd_plan's selection): the 2-CTA one for hd128 (causal too), 1-CTA elsewhere."""
    monkeypatch.setenv("FLASH4_SM100_2CTA", "1")
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(requires_grad=True)
    assert validate.support_error(q, k, v, causal=True) is None
    assert asked[1] == sm100.select_bwd_config(128, "bf16", True, two_cta=True) and asked[1].cta_group == 2
    assert asked[1] == flash4.config.bwd_config(Request.dense(q, k, v, causal=True), 100).cfg
    q, k, v = qkv(d=64, requires_grad=True)
    assert validate.support_error(q, k, v) is None
    assert asked[3] == sm100.select_bwd_config(64) and asked[3].cta_group == 1


def test_training_a_backward_failure_is_refused(sm100_device, monkeypatch):
    """A backward config that failed its self-test refuses training (the forward passed)."""
    monkeypatch.setattr(selftest, "check", lambda cfg, device=None, **kw: selftest.Verdict(
        ok="Bwd" not in type(cfg).__name__, status="pass" if "Bwd" not in type(cfg).__name__ else "wrong",
        config=repr(cfg), gpu="NVIDIA B200", sm="sm_100", gated=True, failure=None if "Bwd" not in
        type(cfg).__name__ else "case 'odd lengths': dq error 0.5 > ...", path="/tmp/verdict.json"))
    q, k, v = qkv(requires_grad=True)
    assert "Sm100BwdConfig(headdim=128" in validate.support_error(q, k, v)
    with torch.no_grad():
        assert validate.support_error(q, k, v) is None


def test_training_what_the_backward_lacks_is_refused_at_the_door(sm100_device, monkeypatch):
    """What the sm100 backward does not build (hd96) is refused by name at the kernel door (the
    tensors as given: validate.support_error, what the SDPA plug-in asks, which never pads) when an
    input requires grad; without grad the forward serves it. flash_attn_func pads such a call to
    hd128 first (test_hd96_training_runs_padded_to_the_hd128_backward). Packed varlen passes (issue 23)."""
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(requires_grad=True)
    q96, k96, v96 = qkv(d=96, requires_grad=True)
    text = validate.support_error(q96, k96, v96)
    assert "no backward for this call on sm_100" in text and "built: (D, Dv) in (64, 64), (128, 128), (192, 128)" in text
    assert "torch.no_grad()" in text
    with torch.no_grad():
        assert validate.support_error(q96, k96, v96) is None
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    assert all(type(c).__name__ == "Sm100FwdConfig" for c in asked)  # no backward self-test was run
    # packed varlen training passes the door (the 1-CTA packed backward: compile-verified, not run on
    # hardware), behind the backward's self-test
    assert validate.varlen_support_error(q[0], k[0], v[0], cu, cu, 200, 200) is None


def test_hd96_training_runs_padded_to_the_hd128_backward(sm100_device, monkeypatch):
    """hd96 training on sm100 (no hd96 backward: flash4.config.sm100.bwd_padded_headdims) runs as one
    zero-padded hd128 call, forward and backward (flash4.headdim.training_headdims): the door asks the
    self-test about the hd128 forward and backward configs, the kernels get 128-wide q/k/v with hd96's
    softmax scale (1/sqrt(96)) and hd128's backward config, out comes back 96 wide and the gradients
    reach the 96-wide inputs (their padded columns dropped). Without grad the native hd96 forward runs.
    forward.run / backward.run are recorders here (no compile, no launch; the padding's exactness is
    tests/cpu/test_headdim_cpu.py's)."""
    from flash4 import backward
    from flash4.config import bwd_config

    assert sm100.bwd_padded_headdims(96, 96) == (128, 128)
    for pair in sm100.SM100_BWD_HEADDIM_PAIRS + sm100.SM100_BWD_TWO_PASS_PAIRS:
        assert sm100.bwd_padded_headdims(*pair) == pair  # the built pairs run as they are
    asked = verdicts(monkeypatch, ok=True)
    fwd_got, bwd_got = [], []

    def fwd_run(request, out=None, lse=None, lse_split=None):
        fwd_got.append(request)
        b, sq, h, _ = request.q.shape
        return torch.zeros(b, sq, h, request.headdim_v, dtype=request.q.dtype), torch.zeros(b, h, sq)

    def bwd_run(request, dout, out, lse, lse_split=None, dlse=None, **kwargs):
        bwd_got.append((request, dout.shape, out.shape))
        return tuple(torch.ones_like(t) for t in (request.q, request.k, request.v))

    monkeypatch.setattr(forward, "run", fwd_run)
    monkeypatch.setattr(backward, "run", bwd_run)
    q, k, v = qkv(d=96, requires_grad=True)
    out = flash4.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (1, 300, 4, 96)
    req = fwd_got[-1]
    assert req.headdim == req.headdim_v == 128 and req.score.softmax_scale == pytest.approx(96 ** -0.5)
    assert torch.equal(req.q[..., 96:], torch.zeros_like(req.q[..., 96:])) and torch.equal(req.q[..., :96], q)
    assert asked == [sm100.select_fwd_config(128, "bf16", True), sm100.select_bwd_config(128, "bf16", True)]
    out.sum().backward()
    breq, dout_shape, out_shape = bwd_got[-1]
    assert dout_shape[-1] == out_shape[-1] == 128 and breq.headdim == 128
    assert breq.score.softmax_scale == pytest.approx(96 ** -0.5)
    assert bwd_config(breq, 100).cfg == sm100.select_bwd_config(128, "bf16", True)
    for t in (q, k, v):  # the kernels' 128-wide gradients sliced back to 96
        assert t.grad.shape == t.shape and torch.equal(t.grad, torch.ones_like(t))
    q, k, v = qkv(d=96)  # no grad: the native hd96 forward, asked about alone
    flash4.flash_attn_func(q, k, v)
    assert fwd_got[-1].headdim == 96 and asked[2:] == [sm100.select_fwd_config(96, "bf16", False)]
    q, k, v = qkv(d=80, requires_grad=True)  # hd80 (padded to 96 for the forward) trains at 128 too
    flash4.flash_attn_func(q, k, v)
    assert fwd_got[-1].headdim == 128 and fwd_got[-1].score.softmax_scale == pytest.approx(80 ** -0.5)


# ---------------------------------------------------------------- the launch site
@pytest.fixture
def compiled(monkeypatch):
    """flash4.compile.cache.get_fwd_runner replaced by a recorder (no DSL compile, no launch)."""
    import flash4.compile.cache as cache

    got = []

    def get_fwd_runner(cfg):
        got.append(cfg)
        return lambda *args, **kwargs: None

    monkeypatch.setattr(cache, "get_fwd_runner", get_fwd_runner)
    return got


def _launch(causal=False):
    q, k, v = qkv()
    request = Request.dense(q, k, v, causal=causal)
    out, lse = torch.empty(1, 300, 4, 128, dtype=BF16), torch.empty(1, 4, 300)
    forward.launch(request, out, lse)


def test_launch_requires_the_selftest(sm100_device, monkeypatch, compiled):
    asked = verdicts(monkeypatch, ok=False)
    with pytest.raises(RuntimeError, match=r"Sm100FwdConfig\(headdim=128.*Please report it"):
        _launch(causal=True)
    assert compiled == [] and asked == [sm100.select_fwd_config(128, "bf16", True)]


def test_launch_after_a_pass_gets_the_sm100_kernel(sm100_device, monkeypatch, compiled):
    asked = verdicts(monkeypatch, ok=True)
    _launch()
    _launch()
    cfg = sm100.select_fwd_config(128, "bf16", False)
    assert compiled == [cfg, cfg] and asked == [cfg]  # the verdict is asked once per process


def test_launch_sm90_is_not_gated(monkeypatch, compiled):
    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.setenv("FLASH4_SM100", "off")
    _launch()
    assert compiled == [flash4.config.select_fwd_config(128, seqlen_k=300)]  # 300 keys: the short-sequence config


def test_backward_plan_on_sm100():
    """Past the door (torch.compile's trace skips it), the backward plan: the 1-CTA config with every
    query head of a KV head in its CTA, or ValueError naming what is missing."""
    q, k, v = qkv(h=4, hk=2)
    plan = flash4.config.bwd_config(Request.dense(q, k, v, causal=True), 100)
    assert plan.cfg == sm100.select_bwd_config(128, "bf16", True) and plan.heads_per_cta == 2
    assert flash4.config.bwd_config(Request.dense(q, k, v, deterministic=True), 100).cfg.deterministic
    assert flash4.config.bwd_config(Request.dense(q, k, v, softcap=5.0), 100).cfg == sm100.select_bwd_config(
        128, "bf16", softcap=True)
    with pytest.raises(ValueError, match="V head dim"):
        flash4.config.bwd_config(Request.dense(q, k, v[..., :64]), 100)


def test_backward_launch_requires_the_selftest(sm100_device, monkeypatch):
    """flash4.backward.launch asks the gate for its config before anything compiles or launches."""
    import flash4.compile.cache as cache
    from flash4 import backward

    got = []
    monkeypatch.setattr(cache, "get_bwd_runner", lambda cfg: got.append(cfg))
    asked = verdicts(monkeypatch, ok=False)
    q, k, v = qkv()
    request = Request.dense(q, k, v, causal=True)
    out, dout, lse = torch.zeros_like(q), torch.randn_like(q), torch.zeros(1, 4, 300)
    with pytest.raises(RuntimeError, match=r"Sm100BwdConfig\(headdim=128.*Please report it"):
        backward.run(request, dout, out, lse)
    assert got == [] and asked == [sm100.select_bwd_config(128, "bf16", True)]


def test_training_192_128_and_hd256_at_the_door(sm100_device, monkeypatch):
    """(192, 128) training passes the door behind the backward's self-test (the serial 1-CTA backward:
    compile-verified, not run on hardware), with softcap too. hd256 (its dK + dV accumulators alone fill
    the 512 TMEM columns) trains as two passes, softcap or not, dense or packed: the door asks the
    self-test about its "dkdq" config (whose self-test runs flash_attn_func's whole backward)."""
    asked = verdicts(monkeypatch, ok=True)
    q, k, _ = qkv(d=192, requires_grad=True)
    v = torch.randn(1, 300, 4, 128).to(BF16).requires_grad_()
    assert validate.support_error(q, k, v, causal=True) is None
    assert asked[-1] == sm100.select_bwd_config(192, "bf16", True, headdim_v=128)
    assert asked[-1].q_stages == 1 and asked[-1].hdim_v == 128
    assert validate.support_error(q, k, v, softcap=5.0) is None
    assert asked[-1] == sm100.select_bwd_config(192, "bf16", False, softcap=True, headdim_v=128)
    q, k, v = qkv(d=256, requires_grad=True)
    assert validate.support_error(q, k, v, causal=True) is None
    assert asked[-1] == sm100.select_bwd_config(256, "bf16", True) and asked[-1].bwd_pass == "dkdq"
    assert validate.support_error(q, k, v, softcap=5.0) is None  # softcap: both passes take tanh (dkdq: dS too)
    assert asked[-1] == sm100.select_bwd_config(256, "bf16", softcap=True) and asked[-1].softcap
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)  # packed: both passes zero the rows past a sequence
    assert validate.varlen_support_error(q[0], k[0], v[0], cu, cu, 200, 200, causal=True) is None
    assert asked[-1] == dataclasses.replace(sm100.select_fwd_config(256, "bf16", True), varlen_q=True, varlen_k=True)
    with torch.no_grad():
        assert validate.support_error(q, k, v) is None  # the hd256 forward stays served


def test_hd256_backward_launches_two_passes(sm100_device, monkeypatch):
    """flash4.backward routes hd256 on sm100 to its two passes: the plan's passes (dv, then dkdq, the
    plan's cfg), the gate asked about cfg, and one main-kernel launch per pass in that order between the
    shared preprocess and postprocess (runners recorded: no compile, no launch)."""
    import flash4.compile.cache as cache
    from flash4 import backward

    calls = []

    def runner(record):  # flash4.backward calls run.compiled(..., *run.tail(...))
        run = lambda *a, **kw: calls.append(record)  # noqa: E731
        run.compiled, run.tail = run, lambda *a, **kw: ()
        return run

    monkeypatch.setattr(cache, "get_bwd_runner", lambda cfg: runner(("main", cfg)))
    monkeypatch.setattr(cache, "get_bwd_preprocess_runner", lambda *a, **kw: runner("pre"))
    monkeypatch.setattr(cache, "get_bwd_postprocess_runner", lambda *a, **kw: runner("post"))
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(d=256)
    request = Request.dense(q, k, v, causal=True)
    plan = flash4.config.bwd_config(request, 100)
    dv_cfg, dkdq_cfg = (sm100.select_bwd_config(256, "bf16", True, bwd_pass=p) for p in ("dv", "dkdq"))
    assert plan.cfg == dkdq_cfg and plan.passes == (dv_cfg, dkdq_cfg)
    assert flash4.config.bwd_config(Request.dense(*qkv()), 100).passes == ()  # one kernel elsewhere
    out, dout, lse = torch.zeros_like(q), torch.randn_like(q), torch.zeros(1, 4, 300)
    backward.run(request, dout, out, lse)
    assert asked == [dkdq_cfg]
    assert calls == ["pre", ("main", dv_cfg), ("main", dkdq_cfg), "post"]
