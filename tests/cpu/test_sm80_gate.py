"""The portable (sm80) family on its own GPUs behind the first-use self-test, on the CPU.

The portable family (mma.sync, ldmatrix, cp.async) has run on the H200 only (forced with
FLASH4_FAMILY=portable, compiled for sm_90a), never on an A100, L40 or RTX card. On its own GPUs
(sm_80 / 86 / 89 / 120) the registry serves it behind flash4.selftest's gate with its own mode
variable, FLASH4_PORTABLE=off|selftest|on (Family.selftest_var; sm100 keeps FLASH4_SM100). Here, with
a mocked device (FLASH4_ARCH=80 / 86 / 89 / 120): the gate table, the mode variable, sm80 configs as
text (parse_config), the self-test's cases and default runners for sm80 configs (the family's kernel
classes through the registry; cute.compile replaced by a recorder), real self-test children with fake
kernels, and the host wiring (flash4.validate's door, forward.launch, backward.launch) with fixed
verdicts; FLASH4_FAMILY=portable on sm_90 is not gated; sm100 is unchanged (test_sm100_host.py).
tests/gpu/test_selftest_portable.py runs the real sm80 kernels through the gate on the H200.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import pytest
import torch

import flash4
from flash4 import env, forward, selftest, validate
from flash4.config import sm80, sm100
from flash4.kernels import registry
from flash4.request import Request

BF16 = torch.bfloat16
NATIVE = (80, 86, 89, 120)
SELFTEST_CPU = Path(__file__).resolve().parent / "test_selftest_cpu.py"  # its fake kernels, loaded by the children
HERE = Path(__file__).resolve()


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    for name in ("FLASH4_PORTABLE", "FLASH4_SM100", "FLASH4_FAMILY", "FLASH4_SM100_2CTA", "FLASH4_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path / "cache"))
    selftest._forget()
    yield
    selftest._forget()


@pytest.fixture(params=NATIVE)
def portable_device(request, monkeypatch):
    """CPU tensors through the device check, on a device that says sm_80 / 86 / 89 / 120; yields the arch."""
    device_problem = validate._device_problem

    def relative_only(q, others, dense=False):
        problem = device_problem(q, others, dense)
        return None if problem is not None and problem[1].startswith("q is on cpu") else problem

    monkeypatch.setattr(validate, "_device_problem", relative_only)
    monkeypatch.setenv("FLASH4_ARCH", str(request.param))
    return request.param


def verdicts(monkeypatch, ok: bool, sm: str = "sm_86"):
    """selftest.check replaced: every config gets a pass (ok) or a 'wrong' verdict; returns the
    configs it was asked about."""
    asked = []

    def check(cfg, device=None, **kwargs):
        asked.append(cfg)
        return selftest.Verdict(ok=ok, status="pass" if ok else "wrong", config=repr(cfg), gpu="NVIDIA RTX A6000",
                                sm=sm, gated=selftest.gated(cfg), created="2026-12-02T00:00:00+00:00",
                                failure=None if ok else "case 'odd lengths' (b2 sq17 sk17 h2/2): out error 0.5 > 0.01",
                                path="/tmp/verdict.json")

    monkeypatch.setattr(selftest, "check", check)
    return asked


@pytest.fixture
def compiled(monkeypatch):
    """flash4.compile.cache.get_fwd_runner / get_bwd_runner replaced by recorders (no compile, no launch)."""
    import flash4.compile.cache as cache

    got = []
    monkeypatch.setattr(cache, "get_fwd_runner", lambda cfg: got.append(cfg) or (lambda *a, **k: None))
    monkeypatch.setattr(cache, "get_bwd_runner", lambda cfg: got.append(cfg))
    return got


def qkv(d=128, sq=300, sk=300, h=4, hk=4, dtype=BF16, requires_grad=False, dv=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, sq, h, d, generator=g).to(dtype)
    k = torch.randn(1, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(1, sk, hk, dv or d, generator=g).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def _launch(causal=False, d=128):
    q, k, v = qkv(d=d)
    out, lse = torch.empty(1, 300, 4, d, dtype=BF16), torch.empty(1, 4, 300)
    forward.launch(Request.dense(q, k, v, causal=causal), out, lse)


# ---------------------------------------------------------------- the table and the mode variable

def test_one_gate_table():
    """The registry says which archs are gated and by which variable; selftest and env read it."""
    portable, blackwell = registry.by_name("portable"), registry.by_name("sm100")
    assert portable.selftest_gated and not portable.verified and portable.selftest_var == "FLASH4_PORTABLE"
    assert blackwell.selftest_gated and not blackwell.verified and blackwell.selftest_var == "FLASH4_SM100"
    assert selftest.GATED_ARCHS == registry.gated_archs() == (100, 80, 86, 89, 120)
    assert registry.selftest_vars() == ("FLASH4_SM100", "FLASH4_PORTABLE")
    for arch in NATIVE:
        assert registry.family(arch) is portable and registry.gate_family(arch) is portable
    assert registry.gate_family(100) is blackwell
    for arch in (90, 75, 103):
        assert registry.gate_family(arch) is None  # sm_90 runs the portable family ungated when forced
    assert 90 in portable.also_on and 90 not in registry.gated_archs()


@pytest.mark.parametrize("value,mode", [(None, "selftest"), ("", "selftest"), ("off", "off"), (" ON ", "on"),
                                        ("SelfTest", "selftest")])
def test_portable_mode(monkeypatch, value, mode):
    if value is not None:
        monkeypatch.setenv("FLASH4_PORTABLE", value)
    assert env.portable_mode() == mode == env.selftest_mode("FLASH4_PORTABLE")
    assert env.sm100_mode() == "selftest"  # the other gate's variable is its own


def test_portable_mode_malformed(monkeypatch):
    monkeypatch.setenv("FLASH4_PORTABLE", "sometimes")
    with pytest.raises(ValueError, match=r"FLASH4_PORTABLE='sometimes': allowed off, selftest, on"):
        env.portable_mode()
    assert env.sm100_mode() == "selftest"


def test_gated_by_arch_not_by_family():
    """An sm80 config for one of the family's own archs is gated, one for sm_90 (forced) is not."""
    for arch in NATIVE:
        cfg = sm80.select_fwd_config(128, arch=arch)
        assert selftest.gated(cfg) and selftest.gate_of(cfg).selftest_var == "FLASH4_PORTABLE"
        assert selftest.gated(sm80.select_bwd_config(64, arch=arch))
    assert not selftest.gated(sm80.select_fwd_config(128, arch=90)) and selftest.gate_of(
        sm80.select_fwd_config(128, arch=90)) is None
    assert selftest.gate_of(sm100.select_fwd_config(128)).selftest_var == "FLASH4_SM100"
    assert selftest.gate_of_text(repr(sm80.select_fwd_config(64, arch=89))).name == "sm80"


# ---------------------------------------------------------------- sm80 configs in the self-test

def _sm80_configs():
    fwd = sm80.shipped_fwd_configs() + [
        sm80.select_fwd_config(128, "fp16", arch=86, local=True, softcap=True, sink=True),
        sm80.select_fwd_config(64, causal=True, arch=120, sink=True)]
    bwd = sm80.shipped_bwd_configs() + [sm80.select_bwd_config(128, arch=89, local=True, softcap=True),
                                        sm80.select_bwd_config(64, "fp16", True, arch=80, deterministic=True)]
    return fwd + bwd


def test_parse_config_rebuilds_sm80_configs():
    """Every shipped sm80 config of every target (and feature variants) round-trips through its repr
    (what the child gets), and the dense ones are testable."""
    for cfg in _sm80_configs():
        back = selftest.parse_config(repr(cfg))
        assert back == cfg and type(back) is type(cfg), cfg
        assert selftest.untestable_reason(cfg) is None, cfg
        assert selftest.config_pass(cfg) == ("bwd" if isinstance(cfg, sm80.Sm80BwdConfig) else "fwd")
    varlen = sm80.select_fwd_config(128, arch=86, varlen_q=True, varlen_k=True)
    assert "varlen_q=True" in selftest.untestable_reason(varlen)
    decode = sm80.select_fwd_config(128, arch=86, seqused_k=True)
    assert "seqused_k=True" in selftest.untestable_reason(decode)


def test_cases_fit_the_family():
    """The cases and inputs of sm80 configs use only what the family has: Dv = D (no headdim_v), no
    GQA packing (heads as listed, nheads_k dividing nheads), a sink only for sink forward configs
    (the backward config has none), a window / softcap only where the config has them."""
    for cfg in _sm80_configs():
        cases = selftest.cases_for(cfg)
        assert [c.name for c in cases] == [c[0] for c in selftest._CASES]
        for case in cases[:2]:
            assert case.nheads % case.nheads_k == 0
            inputs = selftest.make_inputs(cfg, case, "cpu")
            assert inputs["q"].shape[-1] == inputs["v"].shape[-1] == cfg.headdim
            assert inputs["q"].dtype == {"bf16": BF16, "fp16": torch.float16}[cfg.dtype]
            assert (inputs["learnable_sink"] is not None) == bool(getattr(cfg, "sink", False))
            assert (inputs["window_size"] is not None) == cfg.local
            assert (inputs["softcap"] > 0) == cfg.softcap
            assert inputs["causal"] == cfg.causal


def test_default_fwd_runner_drives_the_sm80_kernel(monkeypatch):
    """selftest.fwd_runner for an sm_86 config builds the sm80 family's kernel class (through the
    registry) for --gpu-arch sm_86 and launches it with NaN-filled out / lse (cute.compile and the
    disk cache replaced by recorders)."""
    import flash4.compile.cache as cache

    cutlass, cute = cache._dsl()
    built = []

    def fake_compile(kernel, *args, options="", **kwargs):  # kwargs: no_jit_engine (flash4.compile.jit)
        built.append((kernel, options))
        return lambda *a: built.append(a)

    monkeypatch.setattr(cute, "compile", fake_compile)
    monkeypatch.setattr(cache, "load_or_compile", lambda kind, cfg, options, fn: fn())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # CPU tensors here
    cache.get_fwd_runner.cache_clear()
    try:
        cfg = sm80.select_fwd_config(128, arch=86, local=True, softcap=True, sink=True)
        run = selftest.fwd_runner(cfg, torch.device("cpu"))
        kernel, options = built[0]
        assert type(kernel) is registry.kernel_class("fwd", 86) and type(kernel).__name__ == "FlashAttentionForwardSm80"
        assert "--gpu-arch sm_86" in options
        case = selftest.cases_for(cfg)[1]
        inputs = selftest.make_inputs(cfg, case, "cpu")
        result = run(inputs)
        args = built[1]
        assert args[0] is inputs["q"] and args[3] is result["out"] and args[4] is result["lse"]
        assert torch.isnan(result["out"]).all() and torch.isnan(result["lse"]).all()  # the fake wrote nothing
    finally:
        cache.get_fwd_runner.cache_clear()


def test_default_bwd_runner_runs_the_configs_family(monkeypatch):
    """selftest.bwd_runner drives the API's backward: for an sm80 config on sm_90 (the H200 testing
    route) it forces the portable family in the child (FLASH4_FAMILY), on the family's own archs it
    needs nothing, and it refuses to test a config whose family the API would not run."""
    from flash4.config import select_bwd_config

    monkeypatch.setenv("FLASH4_FAMILY", "")  # restored after the test (the runner sets it)
    monkeypatch.setenv("FLASH4_ARCH", "90")
    selftest.bwd_runner(sm80.select_bwd_config(64, arch=90), "cpu")
    assert env.family_override() == "sm80"
    assert isinstance(select_bwd_config(64, arch=90), sm80.Sm80BwdConfig)
    monkeypatch.setenv("FLASH4_FAMILY", "")
    monkeypatch.setenv("FLASH4_ARCH", "86")
    selftest.bwd_runner(sm80.select_bwd_config(64, arch=86), "cpu")
    assert env.family_override() is None
    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.setenv("FLASH4_FAMILY", "portable")
    from flash4.config import sm90

    with pytest.raises(RuntimeError, match="runs the sm80 family, not sm90"):
        selftest.bwd_runner(sm90.select_bwd_config(64), "cpu")


# ---------------------------------------------------------------- real children, fake kernels

def fake_grads(cfg, device):
    """A backward 'kernel' that returns the float32 reference gradients (in the child)."""
    def run(inputs):
        return dict(zip(("dq", "dk", "dv"), (g.to(inputs["q"].dtype) for g in selftest._ref_grads(inputs, True))))
    return run


def test_real_child_passes_and_refuses_sm80_configs(monkeypatch):
    """The child rebuilds an sm_86 config from its repr and runs its cases: a right kernel passes
    (the gate then lets the config through), a wrong one is refused with the config and
    FLASH4_PORTABLE in the text."""
    cfg = sm80.select_fwd_config(64, causal=True, arch=86)
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", f"{SELFTEST_CPU}:fake_pass")
    assert selftest.support_problem(cfg, "cpu") is None
    verdict = selftest.cached_verdict(cfg, "cpu")
    assert verdict.ok and verdict.gated and len(verdict.checks) == len(selftest._CASES)
    wrong = sm80.select_fwd_config(128, arch=120, softcap=True)
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", f"{SELFTEST_CPU}:fake_wrong")
    problem = selftest.support_problem(wrong, "cpu")
    assert problem is not None and repr(wrong) in problem and "out error" in problem
    assert "FLASH4_PORTABLE=off never uses the portable (sm80 family) kernels" in problem
    assert "FLASH4_PORTABLE=on runs them without the self-test" in problem and "FLASH4_SM100" not in problem
    with pytest.raises(RuntimeError, match="first-use self-test failed with wrong results"):
        selftest.require(wrong, "cpu")


def test_real_child_backward_sm80_config(monkeypatch):
    cfg = sm80.select_bwd_config(64, causal=True, arch=89)
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "bwd", f"{HERE}:fake_grads")
    verdict = selftest.check(cfg, "cpu")
    assert verdict.ok, (verdict.failure, verdict.log)
    assert {"dq_err", "dk_err", "dv_err"} <= set(verdict.checks[0])


# ---------------------------------------------------------------- the host on the family's own GPUs

def test_support_error_passes_after_a_pass(portable_device, monkeypatch):
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(d=64, h=6, hk=2)
    assert validate.support_error(q, k, v, causal=True) is None
    assert asked == [sm80.select_fwd_config(64, "bf16", True, arch=portable_device)]
    validate.check_inputs(q, k, v, causal=True)


def test_support_error_returns_the_selftest_failure(portable_device, monkeypatch):
    verdicts(monkeypatch, ok=False)
    q, k, v = qkv()
    cfg = sm80.select_fwd_config(128, arch=portable_device)
    text = validate.support_error(q, k, v)
    assert text is not None and repr(cfg) in text and "out error" in text
    assert "Please report it" in text and "python -m flash4.selftest --rerun" in text and "FLASH4_PORTABLE" in text
    with pytest.raises(RuntimeError, match="first-use self-test failed with wrong results"):
        validate.check_inputs(q, k, v)
    with pytest.raises(RuntimeError, match="FLASH4_PORTABLE"):
        flash4.flash_attn_func(q, k, v)


def test_modes_off_and_on(portable_device, monkeypatch):
    asked = verdicts(monkeypatch, ok=False)
    q, k, v = qkv()
    cfg = sm80.select_fwd_config(128, arch=portable_device)
    monkeypatch.setenv("FLASH4_PORTABLE", "off")
    text = validate.support_error(q, k, v)
    assert "FLASH4_PORTABLE=off" in text and repr(cfg) in text and "portable" in text
    monkeypatch.setenv("FLASH4_SM100", "on")  # the other family's variable changes nothing here
    assert "FLASH4_PORTABLE=off" in validate.support_error(q, k, v)
    monkeypatch.setenv("FLASH4_PORTABLE", "on")
    monkeypatch.setenv("FLASH4_SM100", "off")
    assert validate.support_error(q, k, v) is None
    assert asked == []  # neither mode runs the self-test
    monkeypatch.setenv("FLASH4_PORTABLE", "sometimes")
    with pytest.raises(ValueError, match="FLASH4_PORTABLE"):
        validate.support_error(q, k, v)


def test_launch_requires_the_selftest_before_compiling(portable_device, monkeypatch, compiled):
    asked = verdicts(monkeypatch, ok=False)
    with pytest.raises(RuntimeError, match=r"Sm80FwdConfig\(headdim=128.*Please report it"):
        _launch(causal=True)
    assert compiled == [] and asked == [sm80.select_fwd_config(128, "bf16", True, arch=portable_device)]
    monkeypatch.setenv("FLASH4_PORTABLE", "off")
    with pytest.raises(RuntimeError, match="FLASH4_PORTABLE=off"):
        _launch()
    assert compiled == []


def test_launch_after_a_pass_gets_the_sm80_kernel(portable_device, monkeypatch, compiled):
    asked = verdicts(monkeypatch, ok=True)
    _launch()
    _launch()
    cfg = sm80.select_fwd_config(128, arch=portable_device)
    assert compiled == [cfg, cfg] and asked == [cfg]  # the verdict is asked once per process


def test_backward_launch_requires_the_selftest(portable_device, monkeypatch, compiled):
    from flash4 import backward

    asked = verdicts(monkeypatch, ok=False)
    q, k, v = qkv(d=64)
    request = Request.dense(q, k, v, causal=True)
    out, dout, lse = torch.zeros_like(q), torch.randn_like(q), torch.zeros(1, 4, 300)
    with pytest.raises(RuntimeError, match=r"Sm80BwdConfig\(headdim=64.*FLASH4_PORTABLE"):
        backward.run(request, dout, out, lse)
    # the plan's config: the shipped fa2 candidate on the >= 163 KiB targets, the table elsewhere
    assert compiled == [] and asked == [sm80.bwd_plan(request, portable_device).cfg]


def test_training_asks_both_selftests(portable_device, monkeypatch):
    asked = verdicts(monkeypatch, ok=True)
    arch = portable_device
    q, k, v = qkv(requires_grad=True)
    assert validate.support_error(q, k, v, causal=True) is None
    assert asked == [sm80.select_fwd_config(128, "bf16", True, arch=arch),
                     sm80.select_bwd_config(128, "bf16", True, arch=arch)]
    with torch.no_grad():
        assert validate.support_error(q, k, v, softcap=5.0) is None
    assert asked[2:] == [sm80.select_fwd_config(128, arch=arch, softcap=True)]
    assert validate.support_error(q, k, v, window_size=(45, 7), softcap=5.0) is None
    assert asked[3:] == [sm80.select_fwd_config(128, arch=arch, local=True, softcap=True),
                         sm80.select_bwd_config(128, arch=arch, local=True, softcap=True)]


def test_what_the_family_lacks_is_refused_before_the_selftest(portable_device, monkeypatch):
    """Training at a head dim without a backward on the 99 KiB parts (d256) is refused with
    NotImplementedError naming it, and a v head dim with neither a kernel nor a padding with a
    ValueError; the value head dims (forward and backward) and paged K/V (the gathered paged
    forward) are served and ask the self-test; no self-test runs for a refused call."""
    asked = verdicts(monkeypatch, ok=True)
    q, k, v = qkv(dv=64, requires_grad=True)
    assert validate.support_error(q, k, v) is None  # (128, 64): forward and backward exist
    assert [c.headdim_v for c in asked[-2:]] == [64, 64] and isinstance(asked[-1], sm80.Sm80BwdConfig)
    q, k, v = qkv(dv=100)  # not a multiple of 8: no kernel, no padding
    n = len(asked)
    with pytest.raises(ValueError, match="100"):
        flash4.flash_attn_func(q, k, v)
    assert len(asked) == n
    q, k, v = (t[0] for t in qkv())
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    used = torch.tensor([50, 200], dtype=torch.int32)
    pages = torch.zeros(2, 4, dtype=torch.int32)
    kp = torch.randn(8, 64, 4, 128).to(BF16)
    # paged K/V is served (gathered rows): the door asks the self-test about the paged config
    before = len(asked)
    assert validate.varlen_support_error(q, kp, kp, cu, None, 200, 200, seqused_k=used, page_table=pages) is None
    qd, kc, vc = qkv(sq=1)
    assert validate.kvcache_support_error(qd, kp, kp, cache_seqlens=used[:1], page_table=pages[:1]) is None
    assert [c.page_gather for c in asked[before:]] == [True, True], asked[before:]
    assert asked[before].varlen_q and not asked[before].varlen_k and asked[before].seqused_k
    q, k, v = qkv(d=256, requires_grad=True)
    text = validate.support_error(q, k, v)
    if portable_device == 80:  # 163 KiB: a d256 backward fits
        assert text is None
    else:
        assert "no backward for this call" in text and "headdim 256" in text and "torch.no_grad()" in text
        with torch.no_grad():
            assert validate.support_error(q, k, v) is None
    assert all(c.headdim == 256 for c in asked[before + 2:])


def test_varlen_and_kvcache_doors(portable_device, monkeypatch):
    """Packed varlen (with seqused_q / seqused_k) and the KV cache select the family's packed / decode
    configs (the dense self-test calls them untestable: test_varlen_is_untestable...)."""
    asked = verdicts(monkeypatch, ok=True)
    arch = portable_device
    q, k, v = (t[0] for t in qkv())
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    used = torch.tensor([50, 200], dtype=torch.int32)
    assert validate.varlen_support_error(q, k, v, cu, cu, 200, 200, causal=True) is None
    assert validate.varlen_support_error(q, k, v, cu, cu, 200, 200, seqused_q=used, seqused_k=used) is None
    qd, kc, vc = qkv(sq=1)
    assert validate.kvcache_support_error(qd, kc, vc, cache_seqlens=100) is None
    base = sm80.select_fwd_config(128, arch=arch)
    assert asked == [sm80.select_fwd_config(128, causal=True, arch=arch, varlen_q=True, varlen_k=True),
                     dataclasses.replace(base, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True),
                     dataclasses.replace(base, seqused_k=True)]
    q, k, v = (t[0] for t in qkv(requires_grad=True))
    assert validate.varlen_support_error(q, k, v, cu, cu, 200, 200) is None  # training: its backward is asked too
    assert asked[3:] == [dataclasses.replace(base, varlen_q=True, varlen_k=True),
                         sm80.select_bwd_config(128, arch=arch, varlen_q=True, varlen_k=True)]


def test_varlen_is_untestable_for_the_real_selftest(portable_device):
    """What an A100 / RTX user gets for packed varlen today: the dense self-test cannot drive the
    config, so the gate refuses it unless FLASH4_PORTABLE=on."""
    q, k, v = (t[0] for t in qkv())
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    text = validate.varlen_support_error(q, k, v, cu, cu, 200, 200)
    assert "self-test cannot check it" in text and "varlen_q=True" in text and "FLASH4_PORTABLE=on" in text


# ---------------------------------------------------------------- not gated: forced on sm_90; sm100 as before

def test_forced_on_sm90_is_not_gated(monkeypatch, compiled):
    """FLASH4_FAMILY=portable on an H100/H200 (the testing route): the user asked for the family, so
    neither the door nor the launch asks the self-test, whatever FLASH4_PORTABLE says."""
    device_problem = validate._device_problem
    monkeypatch.setattr(validate, "_device_problem", lambda q, others, dense=False: (
        None if (p := device_problem(q, others, dense)) is not None and p[1].startswith("q is on cpu") else p))
    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.setenv("FLASH4_FAMILY", "portable")
    monkeypatch.setenv("FLASH4_PORTABLE", "off")
    asked = verdicts(monkeypatch, ok=False)
    q, k, v = qkv(requires_grad=True)
    assert validate.support_error(q, k, v, causal=True) is None
    _launch(causal=True)
    assert compiled == [sm80.select_fwd_config(128, causal=True, arch=90)] and asked == []


def test_sm100_keeps_its_own_variable(monkeypatch, compiled):
    """FLASH4_PORTABLE does not touch sm100 (FLASH4_SM100 does, as before)."""
    monkeypatch.setenv("FLASH4_ARCH", "100")
    monkeypatch.setenv("FLASH4_PORTABLE", "off")
    asked = verdicts(monkeypatch, ok=True, sm="sm_100")
    _launch()
    cfg = sm100.select_fwd_config(128)
    assert compiled == [cfg] and asked == [cfg]
    monkeypatch.setenv("FLASH4_SM100", "off")
    monkeypatch.setenv("FLASH4_PORTABLE", "on")
    selftest._forget()
    with pytest.raises(RuntimeError, match=r"the sm_100 kernels are turned off \(FLASH4_SM100=off\)"):
        _launch()
    verdict = selftest.Verdict(ok=False, status="wrong", config=repr(cfg), gpu="NVIDIA B200", sm="sm_100", gated=True,
                               failure="x")
    assert "FLASH4_SM100=off never uses the sm_100 kernels" in selftest.failure_message(verdict)


def test_sm80_verdict_text_without_math():
    """failure_message of an sm80 verdict names FLASH4_PORTABLE (from the config's arch)."""
    cfg = sm80.select_bwd_config(128, arch=86)
    verdict = selftest.Verdict(ok=False, status="timeout", config=repr(cfg), gpu="NVIDIA GeForce RTX 3090", sm="sm_86",
                               gated=True, failure=f"case 'x' did not finish within {math.inf} s")
    text = selftest.failure_message(verdict)
    assert text.startswith(f"flash4: the sm_86 kernel {cfg!r} is not used on this GPU (NVIDIA GeForce RTX 3090)")
    assert "FLASH4_PORTABLE=off" in text and "FLASH4_SM100" not in text
