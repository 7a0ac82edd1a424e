"""The first-use self-test gate on a real GPU (marker gpu via tests/conftest.py; skipped without CUDA).

On the H200 with the sm90 kernels: the self-test of real forward configs (head dims 64, 128, 256;
a window + softcap + sink config) and a backward config passes and is cached; a wrong kernel (the
real one with out * 1.01) and hanging ones (a GPU kernel that never finishes; a child that sleeps
after initializing CUDA) are refused, with the verdict cached, and this process (which holds a CUDA
context throughout) keeps working: CUDA and flash4's forward run afterwards. The gate itself
(support_problem / require) is driven with a gated sm_100 config whose runner maps it to the sm90
kernel, as the lead will wire it for Blackwell. The runners below are loaded by the children from
this file's path.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flash4 import selftest
from flash4.config.sm90 import select_bwd_config, select_fwd_config  # the sm90 family's, also when FLASH4_FAMILY forces another
from gpu_helpers import parent_still_works, report_verdict

HERE = Path(__file__).resolve()
RUN_TIMEOUT_S = 20.0


def runner(name: str) -> str:
    return f"{HERE}:{name}"


# ---------------------------------------------------------------- runners (in the child)

def _as_sm90(cfg):
    return dataclasses.replace(cfg, arch=90) if cfg.arch != 90 else cfg


def good_fwd(cfg, device):
    """The real sm90 forward, for cfg or (a gated sm_100 config) its sm90 twin."""
    return selftest.fwd_runner(_as_sm90(cfg), device)


def wrong_fwd(cfg, device):
    """The real sm90 forward with every output scaled by 1.01: a kernel with a small bug."""
    run = selftest.fwd_runner(_as_sm90(cfg), device)

    def wrong(inputs):
        res = run(inputs)
        res["out"].mul_(1.01)
        return res
    return wrong


def gpu_hang_fwd(cfg, device):
    """The real forward, but the third case launches a GPU kernel that spins for ~hours
    (torch.cuda._sleep) and then synchronizes: a kernel that never finishes."""
    run = selftest.fwd_runner(_as_sm90(cfg), device)

    def hang(inputs):
        if inputs["q"].shape[1] == 131:
            torch.cuda._sleep(1 << 44)
        return run(inputs)
    return hang


def sleep_after_cuda_init(cfg, device):
    """Initializes CUDA (a context and a kernel on the device), then never gets ready."""
    torch.ones(1, device=device).add_(1)
    torch.cuda.synchronize(device)
    time.sleep(3600)


# ---------------------------------------------------------------- fixtures

@pytest.fixture(autouse=True, scope="module")
def _sm90_only():
    from flash4.arch import device_arch

    if torch.cuda.is_available() and device_arch() != 90:
        pytest.skip(f"these tests run the sm_90 kernels; this GPU is sm_{device_arch()}")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One compile cache for the module (children compile each config once), verdicts cleared per test."""
    return tmp_path_factory.mktemp("flash4-cache")


@pytest.fixture(autouse=True)
def _isolated(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(cache_dir))
    monkeypatch.delenv("FLASH4_CACHE", raising=False)
    monkeypatch.delenv("FLASH4_SM100", raising=False)
    for path in (cache_dir / "selftest").glob("*.json"):
        path.unlink()
    selftest._forget()
    yield
    selftest._forget()


# ---------------------------------------------------------------- the real kernels pass

FWD_CONFIGS = [
    select_fwd_config(64, "bf16", False),
    select_fwd_config(128, "bf16", True),
    select_fwd_config(256, "fp16", True),
    select_fwd_config(128, "bf16", False, local=True, softcap=True, sink=True),
]


@pytest.mark.parametrize("cfg", FWD_CONFIGS, ids=lambda c: f"d{c.headdim}-{c.dtype}-{'causal' if c.causal else 'full'}"
                         + ("-local-softcap-sink" if c.local else ""))
def test_real_forward_passes(cfg):
    verdict = selftest.check(cfg, "cuda")
    report_verdict(verdict, 60)
    assert verdict.ok, (verdict.failure, verdict.log)
    assert len(verdict.checks) == len(selftest.cases_for(cfg)) and all(c["repeats"] for c in verdict.checks)
    assert Path(verdict.path).exists()
    selftest._forget()
    assert selftest.check(cfg, "cuda").created == verdict.created  # from the file


def test_real_backward_passes():
    cfg = select_bwd_config(128, "bf16", True)
    verdict = selftest.check(cfg, "cuda")
    report_verdict(verdict, 60)
    assert verdict.ok, (verdict.failure, verdict.log)
    assert {"dq_err", "dk_err", "dv_err"} <= set(verdict.checks[0])


def test_cli():
    cfg = FWD_CONFIGS[0]
    proc = subprocess.run([sys.executable, "-m", "flash4.selftest", "--config", repr(cfg), "--device", "cuda:0"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0 and proc.stdout.startswith("PASS FwdConfig("), proc.stdout + proc.stderr


# ---------------------------------------------------------------- broken kernels are refused

def test_wrong_kernel_refused_and_cached(monkeypatch):
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("wrong_fwd"))
    cfg = FWD_CONFIGS[1]
    verdict = selftest.check(cfg, "cuda")
    report_verdict(verdict, 60)
    assert verdict.status == "wrong" and "out error" in verdict.failure, (verdict.failure, verdict.log)
    assert not selftest.read_verdict(Path(verdict.path)).ok
    parent_still_works()


def test_gpu_hang_killed(monkeypatch):
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("gpu_hang_fwd"))
    cfg = FWD_CONFIGS[0]
    t0 = time.monotonic()
    verdict = selftest.check(cfg, "cuda", run_timeout_s=RUN_TIMEOUT_S)
    report_verdict(verdict, 60)
    assert verdict.status == "timeout" and "MQA 4:1" in verdict.failure, (verdict.failure, verdict.log)
    assert "left to the OS" not in verdict.failure  # the child exited after SIGKILL
    assert not selftest.read_verdict(Path(verdict.path)).ok
    print(f"hang refused after {time.monotonic() - t0:.1f} s")
    parent_still_works()


def test_sleep_after_cuda_init_killed(monkeypatch):
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("sleep_after_cuda_init"))
    verdict = selftest.check(FWD_CONFIGS[0], "cuda", startup_timeout_s=30.0)
    report_verdict(verdict, 60)
    assert verdict.status == "timeout" and "not ready after 30 s" in verdict.failure, (verdict.failure, verdict.log)
    parent_still_works()


# ---------------------------------------------------------------- the gate, as for sm_100

GATED = dataclasses.replace(FWD_CONFIGS[1], arch=100)


def test_gate_refuses_then_allows(monkeypatch):
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("wrong_fwd"))
    problem = selftest.support_problem(GATED, "cuda")
    assert problem is not None and repr(GATED) in problem and "out error" in problem
    with pytest.raises(RuntimeError, match="first-use self-test failed with wrong results"):
        selftest.require(GATED, "cuda")
    monkeypatch.setenv("FLASH4_SM100", "on")
    selftest.require(GATED, "cuda")  # unchecked
    monkeypatch.setenv("FLASH4_SM100", "off")
    assert "FLASH4_SM100=off" in selftest.support_problem(GATED, "cuda")
    monkeypatch.delenv("FLASH4_SM100")
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("good_fwd"))
    assert selftest.check(GATED, "cuda", rerun=True).ok
    selftest._forget()
    t0 = time.perf_counter()
    selftest.require(GATED, "cuda")  # from the file now
    selftest.require(GATED, "cuda")  # from memory
    t_memo = time.perf_counter()
    for _ in range(1000):
        selftest.require(GATED, "cuda")
    per_call_us = (time.perf_counter() - t_memo) / 1000 * 1e6
    print(f"require: first (file) + memo {1e3 * (t_memo - t0):.1f} ms, then {per_call_us:.1f} us per call")
    assert per_call_us < 200
    parent_still_works()


# ---------------------------------------------------------------- the host wiring, as on a B200

def test_host_refuses_an_sm100_kernel_that_cannot_run_here(monkeypatch):
    """flash4's host on a device that says sm_100 (FLASH4_ARCH=100 on the H200): the API selects the
    sm100 config, its first-use self-test runs in a child, which compiles the kernel for sm_100a and
    cannot launch it on this sm_90 GPU (an error or a crash: either is a refusal); support_error
    returns the text, flash_attn_func raises RuntimeError naming the config before any launch in
    this process, training is refused at the door, and this process keeps working."""
    import flash4
    from flash4 import validate
    from flash4.config import sm100

    monkeypatch.setenv("FLASH4_ARCH", "100")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 77, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    cfg = sm100.select_fwd_config(64, "bf16", True)
    t0 = time.monotonic()
    text = validate.support_error(q, k, v, causal=True)
    print(f"\nsm100 gate on sm_90: refused after {time.monotonic() - t0:.1f} s: {text[:300]}")
    assert text is not None and repr(cfg) in text and "first-use self-test failed with" in text, text
    assert "Please report it" in text
    verdict = selftest.cached_verdict(cfg, "cuda")
    assert verdict is not None and verdict.status in ("error", "crash") and Path(verdict.path).exists()
    with pytest.raises(RuntimeError, match="first-use self-test failed"):
        flash4.flash_attn_func(q, k, v, causal=True)  # from the memo: no second child
    with pytest.raises(RuntimeError, match="first-use self-test failed"):  # training: the forward's verdict first
        flash4.flash_attn_func(q.requires_grad_(), k, v, causal=True)
    monkeypatch.delenv("FLASH4_ARCH")
    parent_still_works()
