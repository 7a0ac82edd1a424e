"""The first-use self-test gate (flash4.selftest) on the CPU: FLASH4_SM100 parsing, cache keys,
atomic verdict files, config reprs, the verdict logic with fake kernels run in real child processes
(pass, wrong numbers, unwritten elements, a race, an exception, a crash, a hang while running and
while compiling: the timeouts kill the child, this process goes on), caching and the gate's modes
and error text. The fakes below are the runners the children load (by this file's path).
tests/gpu/test_selftest.py runs the real sm90 kernels through the same machinery.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from pathlib import Path

import pytest

from flash4 import env, selftest
from flash4.config import BwdConfig, FwdConfig
from flash4.reference import attention_ref

HERE = Path(__file__).resolve()
CPU = "cpu"
CFG = FwdConfig(headdim=64, dtype="bf16", causal=True)
GATED = dataclasses.replace(CFG, arch=100)


def runner(name: str) -> str:
    return f"{HERE}:{name}"


# ---------------------------------------------------------------- fake kernels (run in the child)

def _reference(inputs):
    out, lse = attention_ref(inputs["q"], inputs["k"], inputs["v"], inputs["softmax_scale"], inputs["causal"],
                             window_size=inputs["window_size"], softcap=inputs["softcap"],
                             learnable_sink=inputs["learnable_sink"])
    return {"out": out.to(inputs["q"].dtype), "lse": lse}


def fake_pass(cfg, device):
    return _reference


def fake_wrong(cfg, device):
    return lambda inputs: {k: (v * 1.01 if k == "out" else v) for k, v in _reference(inputs).items()}


def fake_unwritten(cfg, device):
    def run(inputs):
        res = _reference(inputs)
        res["out"][-1, -1, -1, -1] = math.nan  # the last element left unwritten (NaN-filled buffer)
        return res
    return run


def fake_race(cfg, device):
    calls = []

    def run(inputs):
        calls.append(1)
        res = _reference(inputs)
        if len(calls) == 4:  # the second run of the second case: one element one bf16 ulp up
            x = res["out"][0, 0, 0, 0]
            res["out"][0, 0, 0, 0] = x + x.abs() * 2.0 ** -7 if x != 0 else 1e-3
        return res
    return run


def fake_raise(cfg, device):
    def run(inputs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
    return run


def fake_crash(cfg, device):
    def run(inputs):
        os._exit(3)
    return run


def fake_hang(cfg, device):
    def run(inputs):
        if inputs["q"].shape[1] == 131:  # the third case hangs
            time.sleep(3600)
        return _reference(inputs)
    return run


def fake_hang_compiling(cfg, device):
    time.sleep(3600)


# ---------------------------------------------------------------- fixtures

@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASH4_CACHE", raising=False)
    monkeypatch.delenv("FLASH4_SM100", raising=False)
    selftest._forget()
    yield
    selftest._forget()


def _no_child(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a self-test child was started")
    monkeypatch.setattr(selftest, "run_child", fail)


# ---------------------------------------------------------------- FLASH4_SM100

@pytest.mark.parametrize("value,mode", [(None, "selftest"), ("", "selftest"), ("off", "off"), (" ON ", "on"),
                                        ("SelfTest", "selftest")])
def test_mode(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("FLASH4_SM100", raising=False)
    else:
        monkeypatch.setenv("FLASH4_SM100", value)
    assert env.sm100_mode() == mode


@pytest.mark.parametrize("value", ["1", "yes", "auto", "of"])
def test_mode_malformed(monkeypatch, value):
    monkeypatch.setenv("FLASH4_SM100", value)
    with pytest.raises(ValueError, match=r"FLASH4_SM100=.*off, selftest, on"):
        env.sm100_mode()


# ---------------------------------------------------------------- keys, files, configs

def test_cache_key():
    key = selftest.cache_key(CFG, CPU)
    assert key["config"] == repr(CFG) and key["gpu"] == "cpu" and key["sm"] == "cpu"
    assert key["flash4"] and key["sources"] and key["selftest"] == selftest.SELFTEST_VERSION
    assert selftest.key_digest(key) == selftest.key_digest(dict(key))
    other = selftest.cache_key(dataclasses.replace(CFG, causal=False), CPU)
    assert selftest.key_digest(other) != selftest.key_digest(key)
    assert selftest.key_digest(dict(key, gpu="NVIDIA B200", sm="sm_100")) != selftest.key_digest(key)
    path = selftest.verdict_path(key)
    assert path.parent == Path(os.environ["FLASH4_CACHE_DIR"]) / "selftest" and path.name.startswith("cpu-")


def _verdict(**kw):
    base = dict(ok=False, status="wrong", config=repr(GATED), gpu="NVIDIA B200", sm="sm_100", gated=True,
                failure="case 'odd lengths' (b2 sq17 sk17 h2/2): out error 0.5 > 2 x PyTorch bfloat16's 0.004 + 0.0001",
                checks=[{"case": "odd lengths", "ok": False}], seconds=12.5, created="2026-12-02T00:00:00+00:00")
    base.update(kw)
    return selftest.Verdict(**base)


def test_verdict_file_atomic_roundtrip(tmp_path):
    path = tmp_path / "v" / "x.json"
    verdict = _verdict()
    selftest.write_verdict(path, verdict)
    back = selftest.read_verdict(path)
    assert back.path == str(path) and dataclasses.replace(back, path=None) == verdict
    assert os.listdir(path.parent) == ["x.json"]  # no temporary left behind
    selftest.write_verdict(path, _verdict(ok=True, status="pass", failure=None))  # replaced in place
    assert selftest.read_verdict(path).ok


@pytest.mark.parametrize("content", ["", "{", '{"ok": true}', "[]", json.dumps({**json.loads(_verdict().to_json()),
                                                                                "ok": True})])
def test_verdict_file_corrupt_is_a_miss(tmp_path, content):
    path = tmp_path / "x.json"
    path.write_text(content)
    assert selftest.read_verdict(path) is None
    assert selftest.read_verdict(tmp_path / "missing.json") is None


def test_flock_timeout(tmp_path):
    lock = tmp_path / "x.lock"
    with selftest._flock(lock, 1.0):
        errors = []

        def other():
            try:
                with selftest._flock(lock, 0.3):
                    pass
            except TimeoutError as err:
                errors.append(err)
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert errors and "held by another process" in str(errors[0])
    with selftest._flock(lock, 0.3):  # released
        pass


@pytest.mark.parametrize("cfg", [CFG, GATED, FwdConfig(headdim=128, dtype="fp16", local=True, softcap=True, sink=True),
                                 BwdConfig(headdim=128, causal=True, deterministic=True)])
def test_parse_config_roundtrip(cfg):
    assert selftest.parse_config(repr(cfg)) == cfg
    assert selftest.config_pass(cfg) == ("bwd" if isinstance(cfg, BwdConfig) else "fwd")


@pytest.mark.parametrize("text,match", [
    ("FwdConfig(headdim=__import__('os').getpid())", "literals"),
    ("FwdConfig(64)", "ClassName"),
    ("NoSuchConfig(headdim=64)", "no config class"),
    ("os.system('true')", "ClassName"),
    ("FwdConfig(headdim=64", "not a config repr"),
])
def test_parse_config_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        selftest.parse_config(text)


def test_untestable():
    assert selftest.untestable_reason(CFG) is None
    cfg = dataclasses.replace(CFG, varlen_q=True, varlen_k=True)
    assert "varlen_q=True, varlen_k=True" in selftest.untestable_reason(cfg)
    verdict = selftest.check(cfg, CPU)  # refused without a child
    assert verdict.status == "untestable" and not verdict.ok


def test_cases():
    cases = selftest.cases_for(CFG)
    assert any(c.seqlen_q == c.seqlen_k == 1 for c in cases)
    assert any(c.nheads_k == 1 and c.nheads > 1 for c in cases) and any(1 < c.nheads_k < c.nheads for c in cases)
    assert any(c.seqlen_q % 128 and c.seqlen_q > c.seqlen_k for c in cases)
    assert any(-(-c.seqlen_k // 128) >= 10 for c in cases)
    packed = selftest.cases_for(dataclasses.replace(CFG, pack_gqa=4))
    assert all(c.nheads == 4 * c.nheads_k for c in packed)


# ---------------------------------------------------------------- the verdict logic (real children)

def _run(name, **kw):
    kw.setdefault("startup_timeout_s", 120.0)
    kw.setdefault("run_timeout_s", 60.0)
    return selftest.run_child(CFG, CPU, runner=runner(name), **kw)


def test_pass():
    v = _run("fake_pass")
    assert v.ok and v.status == "pass" and v.failure is None, (v.failure, v.log)
    assert len(v.checks) == len(selftest.cases_for(CFG)) and all(c["ok"] and c["repeats"] for c in v.checks)
    assert all(c["out_err"] <= 2 * c["out_pt_err"] + 1e-4 for c in v.checks)


@pytest.mark.parametrize("name,status,words", [
    ("fake_wrong", "wrong", ["out error", "> 2 x PyTorch bfloat16's"]),
    ("fake_unwritten", "wrong", ["NaN or inf", "unwritten"]),
    ("fake_race", "wrong", ["two runs on the same inputs differ", "'odd lengths'"]),
    ("fake_raise", "error", ["RuntimeError: CUDA error: an illegal memory access"]),
    ("fake_crash", "crash", ["exit status 3", "during case 'one query, one key'"]),
])
def test_refused(name, status, words):
    v = _run(name)
    assert not v.ok and v.status == status, (v.status, v.failure, v.log)
    for w in words:
        assert w in v.failure, v.failure


def _child_pid(verdict):
    for line in verdict.log.splitlines():
        if '"event": "started"' in line:
            return json.loads(line.split("] ", 1)[1])["pid"]
    raise AssertionError(f"no started event in the log:\n{verdict.log}")


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_hang_while_running_is_killed():
    t0 = time.monotonic()
    v = _run("fake_hang", run_timeout_s=3.0)
    assert v.status == "timeout" and "did not finish within 3 s" in v.failure, (v.failure, v.log)
    assert "MQA 4:1" in v.failure and len(v.checks) == 2  # the two cases before it finished
    assert time.monotonic() - t0 < 100
    assert _gone(_child_pid(v))


def test_hang_while_compiling_is_killed():
    v = _run("fake_hang_compiling", startup_timeout_s=8.0)
    assert v.status == "timeout" and "not ready after 8 s" in v.failure, (v.failure, v.log)
    assert _gone(_child_pid(v))


# ---------------------------------------------------------------- caching and the gate

def test_check_caches_on_disk_and_in_memory(monkeypatch):
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("fake_pass"))
    v = selftest.check(CFG, CPU)
    assert v.ok and Path(v.path).exists(), v.log
    _no_child(monkeypatch)
    assert selftest.check(CFG, CPU) is v  # memo
    selftest._forget()
    again = selftest.check(CFG, CPU)  # a new process: read from the file
    assert again.ok and again.path == v.path and again.created == v.created


def test_rerun(monkeypatch):
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("fake_pass"))
    first = selftest.check(CFG, CPU)
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("fake_wrong"))
    assert selftest.check(CFG, CPU) is first
    rerun = selftest.check(CFG, CPU, rerun=True)
    assert not rerun.ok and rerun.path == first.path and not selftest.read_verdict(Path(first.path)).ok


def test_cache_off_keeps_verdicts_in_memory(monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE", "0")
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("fake_pass"))
    v = selftest.check(CFG, CPU)
    assert v.ok and v.path is None
    assert not (Path(os.environ["FLASH4_CACHE_DIR"]) / "selftest").exists()


def test_gate_ignores_other_families(monkeypatch):
    _no_child(monkeypatch)
    monkeypatch.setenv("FLASH4_SM100", "off")
    assert selftest.support_problem(CFG, CPU) is None
    selftest.require(CFG, CPU)


def test_gate_modes_off_and_on(monkeypatch):
    _no_child(monkeypatch)
    monkeypatch.setenv("FLASH4_SM100", "off")
    problem = selftest.support_problem(GATED, CPU)
    assert "FLASH4_SM100=off" in problem and repr(GATED) in problem
    with pytest.raises(RuntimeError, match="FLASH4_SM100=off"):
        selftest.require(GATED, CPU)
    monkeypatch.setenv("FLASH4_SM100", "on")
    assert selftest.support_problem(GATED, CPU) is None
    monkeypatch.setenv("FLASH4_SM100", "maybe")
    with pytest.raises(ValueError, match="FLASH4_SM100"):
        selftest.support_problem(GATED, CPU)


def test_gate_refuses_a_wrong_kernel(monkeypatch):
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("fake_wrong"))
    problem = selftest.support_problem(GATED, CPU)
    with pytest.raises(RuntimeError) as info:
        selftest.require(GATED, CPU)
    assert str(info.value) == problem
    for words in (repr(GATED), "first-use self-test failed with wrong results", "out error",
                  "python -m flash4.selftest --rerun --config", selftest.REPORT, "FLASH4_SM100=off",
                  "FLASH4_SM100=on", "support_error"):
        assert words in problem, words
    path = selftest.cached_verdict(GATED, CPU).path
    assert path in problem and not selftest.read_verdict(Path(path)).ok
    _no_child(monkeypatch)
    selftest._forget()
    assert selftest.support_problem(GATED, CPU) == problem  # a later process: from the file


def test_gate_passes_a_good_kernel(monkeypatch):
    monkeypatch.setitem(selftest.DEFAULT_RUNNERS, "fwd", runner("fake_pass"))
    assert selftest.support_problem(GATED, CPU) is None
    _no_child(monkeypatch)
    selftest.require(GATED, CPU)


def test_waiting_for_another_process(monkeypatch):
    """Another process holds the config's lock (its self-test runs): past the wait, a timeout
    verdict that is neither written nor remembered, so the next call asks again."""
    monkeypatch.setattr(selftest, "_lock_timeout", lambda *a: 0.3)
    _no_child(monkeypatch)
    lock = selftest.verdict_path(selftest.cache_key(GATED, CPU)).with_suffix(".lock")
    with selftest._flock(lock, 1.0):
        result = []
        t = threading.Thread(target=lambda: result.append(selftest.support_problem(GATED, CPU)))
        t.start()
        t.join()
    assert "waiting for another process's self-test" in result[0] and "cached in" not in result[0]
    assert selftest.cached_verdict(GATED, CPU) is None and not selftest._GATE


def test_failure_message():
    text = selftest.failure_message(_verdict(path="/c/selftest/sm_100-x.json"))
    assert text.startswith(f"flash4: the sm_100 kernel {GATED!r} is not used on this GPU (NVIDIA B200)")
    assert "'odd lengths'" in text and "/c/selftest/sm_100-x.json" in text and "FLASH4_SM100=off" in text
    assert f'--config "{GATED!r}"' in text
    plain = selftest.failure_message(_verdict(gated=False, status="timeout", failure="case 'x' did not finish"))
    assert "FLASH4_SM100" not in plain and "a timeout (hang?)" in plain
    untestable = selftest.failure_message(_verdict(status="untestable", failure="dense batches only; varlen_q=True"))
    assert "cannot check it (dense batches only; varlen_q=True)" in untestable and "report" not in untestable
    assert "FLASH4_SM100=on" in untestable


def test_cli_with_an_explicit_runner():
    """`python -m flash4.selftest` (a process of its own, which starts the child): a runner given
    explicitly is an experiment, its verdict printed, not cached."""
    import subprocess
    import sys

    src = str(Path(selftest.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH")))))
    proc = subprocess.run([sys.executable, "-m", "flash4.selftest", "--config", repr(CFG), "--device", "cpu",
                           "--runner", runner("fake_wrong")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("FAIL FwdConfig(") and "out error" in proc.stdout and "cached in" not in proc.stdout
    assert "RuntimeWarning" not in proc.stderr, proc.stderr
    assert not (Path(os.environ["FLASH4_CACHE_DIR"]) / "selftest").exists()
    assert selftest.cached_verdict(CFG, CPU) is None


def test_the_child_runs_gated_configs(monkeypatch):
    """In the self-test's child the config under test runs whatever FLASH4_SM100 says (no recursion)."""
    _no_child(monkeypatch)
    monkeypatch.setattr(selftest, "_IN_CHILD", True)
    monkeypatch.setenv("FLASH4_SM100", "off")
    assert selftest.support_problem(GATED, CPU) is None


def test_load_runner_file_imports_its_own_folder(tmp_path):
    """A runner file loads as a script would: modules beside it import (the GPU self-test tests'
    runners import gpu_helpers from tests/gpu), and sys.path is left as it was."""
    import sys

    from flash4 import selftest

    (tmp_path / "beside_runner_helper.py").write_text("VALUE = 7\n")
    (tmp_path / "runner_file.py").write_text(
        "from beside_runner_helper import VALUE\n\ndef factory(cfg, device):\n    return VALUE\n")
    before = list(sys.path)
    factory = selftest.load_runner(f"{tmp_path / 'runner_file.py'}:factory")
    assert factory(None, "cuda") == 7
    assert sys.path == before
