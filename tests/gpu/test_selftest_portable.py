"""The portable (sm80) family through the first-use self-test on the H200 (marker gpu via
tests/conftest.py; skipped without CUDA or on another GPU than sm_90).

The portable family is served behind the self-test on its own GPUs (sm_80 / 86 / 89 / 120,
FLASH4_PORTABLE=off|selftest|on); the H200 runs its kernels compiled for sm_90a (the same mma.sync /
ldmatrix / cp.async instructions). Here:
- the real self-test, with its default runners, of sm80 configs for sm_90 (forward: head dims 64,
  128 causal, 256 fp16, a window + softcap + sink config; backward: hd128 causal and deterministic
  hd64): the child rebuilds each config from its repr and drives the sm80 kernels (the backward
  through the API with the family forced in the child, selftest.bwd_runner);
- the gate on gated sm_86 configs (an RTX 30xx / A10 target) whose runners map them to their sm_90a
  twins with the same tiles (as test_selftest.py maps its arch=100 config to the sm90 kernel): a
  wrong twin is refused with FLASH4_PORTABLE in the text, off / on, then a good twin passes (forward
  and backward);
- the host with FLASH4_ARCH=86 (as a user's sm_86 GPU would select): the API selects the sm_86 config,
  its self-test runs in a child on the kernel compiled for sm_86, and the gate follows the verdict
  whichever it is (an sm_86 binary may or may not load on sm_90: the test prints which), while this
  process keeps working.
The runners below are loaded by the children from this file's path.

Run (the lead, on the H200):
    PYTHONPATH=$PWD/src:$PYTHONPATH python3 -m pytest -q -s tests/gpu/test_selftest_portable.py
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch

from flash4 import selftest
from flash4.config import sm80
from gpu_helpers import parent_still_works, report_verdict

HERE = Path(__file__).resolve()


def runner(name: str) -> str:
    return f"{HERE}:{name}"


# ---------------------------------------------------------------- runners (in the child)

def _twin(cfg):
    """cfg for sm_90a with the same tiles (the sm80 family's code path never depends on the arch)."""
    return dataclasses.replace(cfg, arch=90)


def twin_fwd(cfg, device):
    """The real sm80 forward of cfg's sm_90a twin (a gated sm_86 config run on the H200)."""
    return selftest.fwd_runner(_twin(cfg), device)


def wrong_twin_fwd(cfg, device):
    """The real sm80 forward with every output scaled by 1.01: a kernel with a small bug."""
    run = selftest.fwd_runner(_twin(cfg), device)

    def wrong(inputs):
        res = run(inputs)
        res["out"].mul_(1.01)
        return res
    return wrong


def twin_bwd(cfg, device):
    """The real backward of the portable family through the API, with cfg's (sm_86) tiles chosen
    for sm_90 (tests/gpu/test_sm80_bwd.py's small_tiles, in the child)."""
    os.environ.pop("FLASH4_ARCH", None)
    sm80._SMEM_CLASS[90] = sm80._SMEM_CLASS[cfg.arch]
    sm80._BWD_SMEM_CLASS[90] = sm80._BWD_SMEM_CLASS[cfg.arch]
    twin = _twin(cfg)
    assert sm80.select_bwd_config(cfg.headdim, cfg.dtype, cfg.causal, arch=90, local=cfg.local, softcap=cfg.softcap,
                                  deterministic=cfg.deterministic) == twin, twin
    return selftest.bwd_runner(twin, device)


# ---------------------------------------------------------------- fixtures

@pytest.fixture(autouse=True, scope="module")
def _h200_only():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"these tests run the portable kernels for sm_90a; this GPU is {torch.cuda.get_device_capability()}")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One compile cache for the module (children compile each config once), verdicts cleared per test."""
    return tmp_path_factory.mktemp("flash4-cache")


@pytest.fixture(autouse=True)
def _isolated(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(cache_dir))
    for name in ("FLASH4_CACHE", "FLASH4_PORTABLE", "FLASH4_SM100", "FLASH4_FAMILY", "FLASH4_ARCH"):
        monkeypatch.delenv(name, raising=False)
    for path in (cache_dir / "selftest").glob("*.json"):
        path.unlink()
    selftest._forget()
    yield
    selftest._forget()


# ---------------------------------------------------------------- the real sm80 kernels pass (default runners)

FWD_CONFIGS = [
    sm80.select_fwd_config(64, "bf16", False, arch=90),
    sm80.select_fwd_config(128, "bf16", True, arch=90),
    sm80.select_fwd_config(256, "fp16", True, arch=90),
    sm80.select_fwd_config(128, "bf16", False, arch=90, local=True, softcap=True, sink=True),
]


@pytest.mark.parametrize("cfg", FWD_CONFIGS, ids=lambda c: f"d{c.headdim}-{c.dtype}-{'causal' if c.causal else 'full'}"
                         + ("-local-softcap-sink" if c.local else ""))
def test_real_portable_forward_passes(cfg):
    assert not selftest.gated(cfg)  # sm_90 (forced by the user): not gated, but `check` tests any config
    verdict = selftest.check(cfg, "cuda")
    report_verdict(verdict)
    assert verdict.ok, (verdict.failure, verdict.log)
    assert len(verdict.checks) == len(selftest.cases_for(cfg)) and all(c["repeats"] for c in verdict.checks)
    assert Path(verdict.path).exists()


@pytest.mark.parametrize("cfg", [sm80.select_bwd_config(128, "bf16", True, arch=90),
                                 sm80.select_bwd_config(64, "fp16", False, arch=90, deterministic=True)],
                         ids=["d128-bf16-causal", "d64-fp16-deterministic"])
def test_real_portable_backward_passes(cfg):
    """The default backward runner forces the portable family in the child (sm_90 runs sm90 by
    default), so the API's backward is the sm80 one."""
    verdict = selftest.check(cfg, "cuda")
    report_verdict(verdict)
    assert verdict.ok, (verdict.failure, verdict.log)
    assert {"dq_err", "dk_err", "dv_err"} <= set(verdict.checks[0]) and len(verdict.checks) == len(selftest._CASES)


# ---------------------------------------------------------------- the gate, as on an sm_86 GPU

GATED_FWD = sm80.select_fwd_config(128, "bf16", True, arch=86)
GATED_BWD = sm80.select_bwd_config(128, "bf16", True, arch=86)


def test_gate_refuses_then_allows(monkeypatch):
    assert selftest.gated(GATED_FWD) and selftest.gate_of(GATED_FWD).selftest_var == "FLASH4_PORTABLE"
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("wrong_twin_fwd"))
    problem = selftest.support_problem(GATED_FWD, "cuda")
    report_verdict(selftest.cached_verdict(GATED_FWD, "cuda"))
    assert problem is not None and repr(GATED_FWD) in problem and "out error" in problem
    assert "FLASH4_PORTABLE=off never uses the portable (sm80 family) kernels" in problem
    with pytest.raises(RuntimeError, match="first-use self-test failed with wrong results"):
        selftest.require(GATED_FWD, "cuda")
    monkeypatch.setenv("FLASH4_PORTABLE", "on")
    selftest.require(GATED_FWD, "cuda")  # unchecked
    monkeypatch.setenv("FLASH4_PORTABLE", "off")
    assert "FLASH4_PORTABLE=off" in selftest.support_problem(GATED_FWD, "cuda")
    monkeypatch.setenv("FLASH4_SM100", "off")  # the other family's variable: no effect here
    monkeypatch.delenv("FLASH4_PORTABLE")
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("twin_fwd"))
    verdict = selftest.check(GATED_FWD, "cuda", rerun=True)
    report_verdict(verdict)
    assert verdict.ok, (verdict.failure, verdict.log)
    selftest._forget()
    selftest.require(GATED_FWD, "cuda")  # from the file now
    parent_still_works()


def test_gate_backward_with_sm86_tiles(monkeypatch):
    assert selftest.gated(GATED_BWD)
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "bwd", runner("twin_bwd"))
    assert selftest.support_problem(GATED_BWD, "cuda") is None, selftest.cached_verdict(GATED_BWD, "cuda").log
    verdict = selftest.cached_verdict(GATED_BWD, "cuda")
    report_verdict(verdict)
    assert verdict.ok and verdict.gated and len(verdict.checks) == len(selftest._CASES)
    parent_still_works()


# ---------------------------------------------------------------- the host, as on an sm_86 GPU

def test_host_on_a_device_that_says_sm86(monkeypatch):
    """FLASH4_ARCH=86: the API selects the portable family's sm_86 config (no FLASH4_FAMILY), the
    gate runs its self-test in a child on the kernel compiled for sm_86, and the API follows the
    verdict: a pass runs flash_attn_func (checked against the reference), anything else is refused
    before any launch in this process with the config and FLASH4_PORTABLE named."""
    import flash4
    from flash4 import validate
    from flash4.reference import fwd_errors

    monkeypatch.setenv("FLASH4_ARCH", "86")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 77, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    cfg = sm80.select_fwd_config(64, "bf16", True, arch=86)
    t0 = time.monotonic()
    text = validate.support_error(q, k, v, causal=True)
    verdict = selftest.cached_verdict(cfg, "cuda")
    assert verdict is not None and Path(verdict.path).exists()
    print(f"\nsm_86 portable kernel on the H200: {verdict.status} after {time.monotonic() - t0:.1f} s"
          + (f": {verdict.failure}" if verdict.failure else ""))
    if verdict.ok:
        assert text is None
        out, lse = flash4.flash_attn_func(q, k, v, causal=True, return_lse=True)
        torch.cuda.synchronize()
        assert fwd_errors(q, k, v, out, lse, causal=True)["ok"]
    else:
        assert text is not None and repr(cfg) in text and "FLASH4_PORTABLE" in text, text
        with pytest.raises(RuntimeError, match="FLASH4_PORTABLE"):
            flash4.flash_attn_func(q, k, v, causal=True)  # from the memo: no second child
    monkeypatch.setenv("FLASH4_PORTABLE", "off")
    assert "FLASH4_PORTABLE=off" in validate.support_error(q, k, v, causal=True)
    monkeypatch.delenv("FLASH4_ARCH")
    parent_still_works()
