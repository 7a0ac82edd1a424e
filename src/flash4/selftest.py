"""First-use self-test gate: a kernel config runs on a GPU only after it passed a self-test there.

flash4's sm_100 (Blackwell) kernels are compiled and checked on CPU-only machines but had never run
when they shipped; a first run may hang or return garbage (BLACKWELL.md, "Product stance"). The
portable (sm80) family has run on the H200 (sm_90a) only, never on an A100, L40 or RTX card. So
before a gated config (its arch in GATED_ARCHS) launches in a process, the host asks this module:

    problem = selftest.support_problem(cfg, device)   # None: go ahead; str: why not (fall back)
    selftest.require(cfg, device)                     # the same, raising RuntimeError(problem)

Mode: one variable per gated family (flash4.kernels.registry: Family.selftest_var, gate_family):
FLASH4_SM100 for sm100 configs (arch 100), FLASH4_PORTABLE for the portable sm80 family's configs
of its own archs (80, 86, 89, 120), read by flash4.env.selftest_mode: "off" refuses every config of
that family, "on" allows them unchecked, "selftest" (the default) allows a config once its verdict
is a pass. Configs of other families (sm90), and sm80 configs for sm_90 (the family forced on an
H100/H200 with FLASH4_FAMILY=portable), are never gated; `check` still self-tests any family's
config on request.

The verdict of a config on a GPU is looked up, in order: in this process's memo; in
<flash4.env.disk_cache_dir()>/selftest/<digest>.json; else the self-test runs in a child process
(`python -m flash4.selftest --child`; child_command) with a timeout, under an exclusive flock on <digest>.lock
so concurrent processes run it once, and its verdict (pass or fail) is written there atomically.
The key (cache_key) is the flash4 version and a hash of its sources, the CuTe DSL, torch and
driver versions, the GPU's name and SM version, the config's repr, and SELFTEST_VERSION. With
FLASH4_CACHE=0 verdicts are kept in memory only (each process tests again).

What the child does (child_main): builds the config from its repr (parse_config), gets the
kernel through a runner (a "module:function" or "file.py:function" factory(cfg, device) -> run;
fwd_runner / bwd_runner by default), reports "ready", then runs each small case (cases_for: odd
lengths, a single key, GQA / MQA, seqlen_q above and below seqlen_k, several key blocks, large
scores; the config's head dims, dtype, causal, window, softcap and sink) into NaN-filled outputs,
synchronizes, and compares with the float32 reference by the project's rule (err <= 2 x PyTorch's
same-dtype err + atol, flash4.reference); the forward runs each case twice and must repeat bit for
bit. It writes progress events and its verdict to files the parent reads. The parent kills the
child's whole process group (SIGKILL) when it is not ready within startup_timeout_s (imports,
compile) or a case does not finish within run_timeout_s of its start (a hang), and never touches
the GPU itself: a hung kernel costs the child, not the caller.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from flash4 import env
from flash4.kernels import registry as _registry

# Bump when the cases or the criterion change: verdicts of the old self-test are not reused.
SELFTEST_VERSION = 1
# SM versions whose kernels run only after their self-test passed: the registry's table
# (flash4.kernels.registry.gated_archs: sm100's 100, the portable family's 80, 86, 89, 120), each
# with its family's mode variable (gate_family(arch).selftest_var, flash4.env.selftest_mode).
GATED_ARCHS = _registry.gated_archs()
# The child: start, imports (torch, the CuTe DSL) and compiling / loading the kernel, up to "ready".
# Measured on the H200 machine (16 cores, 2026-12-02): import torch + flash4 3.8-4.7 s, then the
# first d128 causal forward 7.4 s cold (CuTe DSL import + compile) or 3.4 s from the disk cache;
# a 2-core box under load compiles a few times slower. 300 s: ~25x headroom over the whole start.
STARTUP_TIMEOUT_S = 300.0
# One case, from its start: the forward's cases run in milliseconds; a backward case may compile a
# kernel variant (GQA head split; ~10-20 s). Longer than this without progress counts as a hang.
RUN_TIMEOUT_S = 120.0
# After SIGKILL: how long to wait for the child to exit before giving up on it (a process in the
# driver's uninterruptible teardown is left to the OS; the caller goes on). Measured on the H200: a
# child spinning in a GPU kernel (torch.cuda._sleep) exited 0.11 s after SIGKILL, and the parent's
# CUDA work ran meanwhile (27 ms for a small op while the child spun) and after (0.2 s matmul).
KILL_WAIT_S = 30.0
POLL_S = 0.05
LOG_TAIL_CHARS = 6000
# Backward criterion atol (tests/gpu/test_bwd.py's GRAD_ATOL).
GRAD_ATOL = 1e-3
REPORT = "open an issue on the flash4 repository"
# Config flags the dense self-test cannot drive (sequence layouts, paged K/V, split KV).
UNTESTABLE_FLAGS = ("varlen_q", "varlen_k", "seqused_q", "seqused_k", "page_rows", "page_gather", "split_kv")
STATUSES = ("pass", "wrong", "error", "timeout", "crash", "untestable")


# ================================================================ verdicts and their cache

@dataclasses.dataclass
class Verdict:
    """The outcome of one config's self-test on one GPU.

    ok:      True only for status "pass".
    status:  "pass"; "wrong" (a case missed the criterion or did not repeat bit for bit);
             "error" (the child raised, e.g. a compile or CUDA error); "timeout" (not ready within
             startup_timeout_s, or a case ran past run_timeout_s: a hang); "crash" (the child died
             without a verdict); "untestable" (the self-test cannot drive this config).
    config:  repr of the config. gpu, sm: the device's name and SM version ("sm_100").
    gated:   the config's arch is in GATED_ARCHS (the message names its family's mode variable,
             FLASH4_SM100 or FLASH4_PORTABLE: gate_of_text).
    failure: one line: the first failing check, or None.
    checks:  one dict per case that finished: case, shape, ok, errors, problem.
    seconds: wall time of the self-test. created: ISO time. log: the child's output (tail).
    key:     cache_key's dict. path: the verdict file (None when not written).
    """

    ok: bool
    status: str
    config: str
    gpu: str
    sm: str
    gated: bool = False
    failure: str | None = None
    checks: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    created: str = ""
    log: str = ""
    key: dict = dataclasses.field(default_factory=dict)
    path: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a verdict is a JSON object, not {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        verdict = cls(**{k: v for k, v in data.items() if k in names})
        if verdict.status not in STATUSES or verdict.ok != (verdict.status == "pass"):
            raise ValueError(f"inconsistent verdict: status {verdict.status!r}, ok {verdict.ok!r}")
        return verdict


def gated(cfg) -> bool:
    """True when cfg's family runs only after its self-test (cfg.arch in GATED_ARCHS)."""
    return getattr(cfg, "arch", None) in GATED_ARCHS


def gate_of(cfg):
    """The gated family (flash4.kernels.registry.Family) whose gate cfg passes through (by cfg.arch:
    selftest_var, selftest_what), or None when cfg is not gated."""
    arch = getattr(cfg, "arch", None)
    return _registry.gate_family(arch) if arch in GATED_ARCHS else None


def gate_of_text(config: str):
    """gate_of for a config's repr (a verdict's `config`): by its arch=N field, None without one."""
    match = re.search(r"\barch=(\d+)", config)
    return _registry.gate_family(int(match.group(1))) if match else None


def config_pass(cfg) -> str:
    """"bwd" for a backward config (class name with "Bwd"), else "fwd"."""
    return "bwd" if "bwd" in type(cfg).__name__.lower() else "fwd"


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_identity(device=None) -> tuple[str, str]:
    """(GPU name, "sm_XY") of a CUDA device (default: current); ("cpu", "cpu") for the CPU (tests)."""
    device = _device(device)
    if device.type == "cpu":
        return "cpu", "cpu"
    props = torch.cuda.get_device_properties(device.index)
    return props.name, f"sm_{props.major}{props.minor}"


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 of flash4's sources (all *.py but the benchmark): a change to any kernel, host code or
    this self-test makes old verdicts stale (the version string alone does not change in development)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith("bench/"):
            digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (Linux /proc), or None."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(\S+)", text)
    return match.group(1) if match else None


def cache_key(cfg, device=None) -> dict:
    """What a verdict depends on (its file name is a hash of this dict)."""
    from flash4 import __version__

    gpu, sm = device_identity(device)
    return {"selftest": SELFTEST_VERSION, "flash4": __version__, "sources": source_hash(),
            "cute_dsl": _dist_version("nvidia-cutlass-dsl"), "torch": torch.__version__,
            "driver": driver_version() if sm != "cpu" else None, "gpu": gpu, "sm": sm, "config": repr(cfg)}


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def verdict_dir() -> Path:
    return Path(env.disk_cache_dir()) / "selftest"


def verdict_path(key: dict) -> Path:
    """<disk_cache_dir>/selftest/<sm>-<digest>.json"""
    return verdict_dir() / f"{key['sm']}-{key_digest(key)}.json"


def write_verdict(path: Path, verdict: Verdict) -> None:
    """Atomic: written to a temporary file in the same directory, fsynced, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(verdict.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_verdict(path: Path) -> Verdict | None:
    """The verdict stored at path; None when missing, unreadable, truncated or inconsistent (a miss:
    the self-test runs again and overwrites it)."""
    try:
        verdict = Verdict.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return None
    verdict.path = str(path)
    return verdict


@contextlib.contextmanager
def _flock(path: Path, timeout_s: float):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lock {path} held by another process for over {timeout_s:.0f} s") from None
                time.sleep(0.1)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# ================================================================ the gate

_IN_CHILD = False  # True in the self-test's child: the config under test runs ungated
_MEMO: dict = {}  # key digest -> Verdict (this process)
_GATE: dict = {}  # (cfg, device) -> support_problem's answer in mode "selftest"
_LOCK = threading.Lock()


def cached_verdict(cfg, device=None) -> Verdict | None:
    """The verdict known for cfg on device (memo or file), without running anything."""
    key = cache_key(cfg, device)
    digest = key_digest(key)
    if digest in _MEMO:
        return _MEMO[digest]
    return read_verdict(verdict_path(key)) if env.disk_cache_enabled() else None


def check(cfg, device=None, *, runner: str | None = None, rerun: bool = False,
          startup_timeout_s: float = STARTUP_TIMEOUT_S, run_timeout_s: float = RUN_TIMEOUT_S) -> Verdict:
    """The verdict of cfg (any family's config) on device: cached, or the self-test runs now (in a
    child process) and its verdict is cached. rerun: ignore a cached verdict and test again.
    runner: the kernel runner's "module:function" / "file.py:function" (default: fwd_runner or
    bwd_runner by config_pass); a custom runner's verdict is not cached on disk (tests inject
    broken kernels this way)."""
    key = cache_key(cfg, device)
    digest = key_digest(key)
    path = verdict_path(key)
    persist = env.disk_cache_enabled() and runner is None
    with _LOCK:
        if not rerun and runner is None:
            if digest in _MEMO:
                return _MEMO[digest]
            if persist:
                verdict = read_verdict(path)
                if verdict is not None:
                    _MEMO[digest] = verdict
                    return verdict
        problem = untestable_reason(cfg)
        if problem is not None:
            verdict = Verdict(ok=False, status="untestable", config=repr(cfg), gpu=key["gpu"], sm=key["sm"],
                              gated=gated(cfg), failure=problem, created=_now(), key=key)
            if runner is None:
                _MEMO[digest] = verdict
            return verdict
        if not persist:
            verdict = run_child(cfg, device, runner=runner, startup_timeout_s=startup_timeout_s,
                                run_timeout_s=run_timeout_s, key=key)
            if runner is None:
                _MEMO[digest] = verdict
            return verdict
        try:
            with _flock(path.with_suffix(".lock"), _lock_timeout(startup_timeout_s, run_timeout_s)):
                verdict = None if rerun else read_verdict(path)  # another process may have finished it
                if verdict is None:
                    verdict = run_child(cfg, device, runner=None, startup_timeout_s=startup_timeout_s,
                                        run_timeout_s=run_timeout_s, key=key)
                    verdict.path = str(path)
                    try:
                        write_verdict(path, verdict)
                    except OSError as err:
                        verdict.path = None
                        verdict.log += f"\n(flash4.selftest: could not write {path}: {err})"
        except TimeoutError as err:  # not cached (created ""): the next call waits / tries again
            return Verdict(ok=False, status="timeout", config=repr(cfg), gpu=key["gpu"], sm=key["sm"],
                           gated=gated(cfg), failure=f"waiting for another process's self-test of this config: {err}",
                           key=key)
        _MEMO[digest] = verdict
        _GATE.clear()  # a new verdict (rerun): support_problem asks again
        return verdict


def _lock_timeout(startup_timeout_s: float, run_timeout_s: float) -> float:
    """How long to wait for another process's self-test of the same config: its longest run."""
    return startup_timeout_s + (len(_CASES) + 1) * run_timeout_s + KILL_WAIT_S + 60


def failure_message(verdict: Verdict) -> str:
    """The error text of a failed verdict: config, GPU, the failing check, where the verdict is, how
    to test again and to report it, and what to do meanwhile."""
    head = f"flash4: the {verdict.sm} kernel {verdict.config} is not used on this GPU ({verdict.gpu}): "
    tail = "Calls that need this kernel fall back (support_error returns this text)"
    gate = gate_of_text(verdict.config) if verdict.gated else None
    if gate is not None:
        var = gate.selftest_var
        tail += (f"; {var}=off never uses {gate.selftest_what}, {var}=on runs them without the self-test "
                 "(at your own risk)")
    if verdict.status == "untestable":
        return head + f"its first-use self-test cannot check it ({verdict.failure}). " + tail + "."
    kind = {"wrong": "wrong results", "error": "an error", "timeout": "a timeout (hang?)",
            "crash": "the test process crashed"}.get(verdict.status, verdict.status)
    where = f"The verdict is cached in {verdict.path} (with the test's log); " if verdict.path else ""
    return (head + f"its first-use self-test failed with {kind}: {verdict.failure}. {where}"
            f"to test again: python -m flash4.selftest --rerun --config \"{verdict.config}\". "
            f"Please report it ({REPORT}) with this message and the log. " + tail + ".")


def support_problem(cfg, device=None) -> str | None:
    """None when cfg may run on device; else why not (the text a caller shows, or uses to fall back
    to SDPA). Not gated (cfg.arch not in GATED_ARCHS): None. Else by the mode variable of cfg's
    gated family (gate_of: FLASH4_SM100, FLASH4_PORTABLE): off: refused; on: None; selftest
    (default): the self-test's verdict, run in a child process on first use (seconds to a minute:
    compile and small cases), then cached on disk and in memory."""
    gate = gate_of(cfg)
    if gate is None or _IN_CHILD:
        return None
    var = gate.selftest_var
    mode = env.selftest_mode(var)
    if mode == "off":
        return (f"flash4: {gate.selftest_what} are turned off ({var}=off), so {cfg!r} is not used; "
                f"unset {var} (or set it to selftest) to use them once their first-use self-test passed")
    if mode == "on":
        return None
    dev = _device(device)
    memo_key = (cfg, str(dev))
    if memo_key in _GATE:
        return _GATE[memo_key]
    verdict = check(cfg, dev)
    problem = None if verdict.ok else failure_message(verdict)
    if verdict.created:  # not a wait for another process's self-test (that one is asked again)
        _GATE[memo_key] = problem
    return problem


def require(cfg, device=None) -> None:
    """Raise RuntimeError(support_problem(cfg, device)) when cfg may not run on device."""
    problem = support_problem(cfg, device)
    if problem is not None:
        raise RuntimeError(problem)


def _forget() -> None:
    """Drop this process's memo (tests)."""
    _MEMO.clear()
    _GATE.clear()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ================================================================ the parent side of the child

def _src_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def _child_root() -> str:
    """This flash4's root for the child's sys.path; "" when it is a site-packages directory (the same
    interpreter finds it there anyway, and putting it first could reorder other packages)."""
    import site

    root = _src_root()
    sites = {str(Path(d).resolve()) for d in site.getsitepackages() + [site.getusersitepackages()]}
    return "" if root in sites else root


# The child's bootstrap: this flash4 first on sys.path, then flash4.selftest.main (the module itself,
# not a __main__ copy, so child_main's _IN_CHILD is the flag flash4's own gate reads).
_CHILD_BOOT = ("import sys; r = sys.argv[1]; r and sys.path.insert(0, r); "
               "from flash4.selftest import main; sys.exit(main(sys.argv[2:]))")


def child_command(cfg, device, runner: str | None, progress: Path, result: Path) -> list[str]:
    """argv of the child (the same as `python -m flash4.selftest --child ...`): runner None =
    DEFAULT_RUNNERS[config_pass(cfg)] (resolved here, so a test can point it at a broken kernel by
    patching DEFAULT_RUNNERS in this process)."""
    return [sys.executable, "-c", _CHILD_BOOT, _child_root(), "--child", "--config", repr(cfg),
            "--device", str(_device(device)), "--runner", runner or DEFAULT_RUNNERS[config_pass(cfg)],
            "--progress", str(progress), "--result", str(result)]


def _read_events(path: Path, offset: int) -> tuple[list, int]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events, offset + end


def _kill_group(proc: subprocess.Popen) -> str:
    """SIGKILL the child's process group (it leads its own session); '' or a note when it lingers."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        return f" (the test process {proc.pid} had not exited {KILL_WAIT_S:.0f} s after SIGKILL; left to the OS)"
    return ""


def run_child(cfg, device=None, *, runner: str | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S,
              run_timeout_s: float = RUN_TIMEOUT_S, key: dict | None = None) -> Verdict:
    """Run the self-test of cfg in a child process and return its verdict (nothing cached). The
    child inherits the caller's variables, runs this flash4 (child_command), lets its own gated configs
    run (it is the test: _IN_CHILD), and leads a session of its own; this process only polls files
    and, on a timeout, kills the child's process group."""
    key = key if key is not None else cache_key(cfg, device)
    base = dict(config=repr(cfg), gpu=key["gpu"], sm=key["sm"], gated=gated(cfg), key=key, created=_now())
    workdir = Path(tempfile.mkdtemp(prefix="flash4-selftest-"))
    progress, result, log = workdir / "progress.jsonl", workdir / "result.json", workdir / "log.txt"
    t0 = time.monotonic()
    checks, phase, current, note = [], "startup", None, ""
    proc = None
    try:
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(child_command(cfg, device, runner, progress, result), stdin=subprocess.DEVNULL,
                                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, offset, timed_out = t0 + startup_timeout_s, 0, False
        while True:
            rc = proc.poll()
            events, offset = _read_events(progress, offset)
            for ev in events:
                if ev.get("event") in ("ready", "case_start", "case_done"):
                    phase = "run"
                    deadline = time.monotonic() + run_timeout_s
                if ev.get("event") == "case_start":
                    current = ev.get("case")
                elif ev.get("event") == "case_done":
                    checks.append(ev.get("check"))
                    current = None
            if rc is not None:
                break
            if time.monotonic() > deadline:
                timed_out = True
                note = _kill_group(proc)
                break
            time.sleep(POLL_S)
    finally:
        if proc is not None and proc.poll() is None and not note:
            note = _kill_group(proc)  # interrupted (KeyboardInterrupt, ...): never leave the child behind
        seconds = time.monotonic() - t0
        log_text = _tail(log)
        verdict_json = None
        with contextlib.suppress(OSError):
            verdict_json = result.read_text()
        _rmtree(workdir)
    base.update(seconds=round(seconds, 2), log=log_text)
    if timed_out:
        if phase == "startup":
            failure = (f"the test process was not ready after {startup_timeout_s:.0f} s (imports and compiling the "
                       f"kernel){note}")
        elif current is not None:
            failure = f"case {current!r} did not finish within {run_timeout_s:.0f} s (a hang?){note}"
        elif verdict_json is not None:
            failure = (f"the test process did not exit within {run_timeout_s:.0f} s of writing its verdict "
                       f"({json.loads(verdict_json)['status']}){note}")
        else:
            failure = f"no progress for {run_timeout_s:.0f} s after the kernel was ready{note}"
        return Verdict(ok=False, status="timeout", failure=failure, checks=checks, **base)
    if verdict_json is None:
        how = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        where = f" during case {current!r}" if current is not None else f" ({phase})"
        return Verdict(ok=False, status="crash", failure=f"the test process died with {how}{where} without a verdict",
                       checks=checks, **base)
    data = json.loads(verdict_json)
    status = data["status"]
    return Verdict(ok=status == "pass", status=status, failure=data.get("failure"), checks=data.get("checks", checks),
                   **base)


def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-LOG_TAIL_CHARS:].decode("utf-8", "replace")


def _rmtree(path: Path) -> None:
    for child in path.iterdir():
        with contextlib.suppress(OSError):
            child.unlink()
    with contextlib.suppress(OSError):
        path.rmdir()


# ================================================================ configs as text

def _config_modules():
    """Every flash4.config module (registered families first), imported."""
    import pkgutil

    import flash4.config as config_pkg
    from flash4.kernels import registry

    mods = [fam.config_module() for fam in registry.FAMILIES]
    for info in pkgutil.iter_modules(config_pkg.__path__):
        mod = importlib.import_module(f"flash4.config.{info.name}")
        if mod not in mods:
            mods.append(mod)
    return mods + [config_pkg]


def parse_config(text: str):
    """The config whose repr is `text`, e.g. "FwdConfig(headdim=128, dtype='bf16', ...)": a call of a
    dataclass of a flash4.config module with literal keyword arguments only (nothing is evaluated).
    Where several modules have the class name, the one whose family runs the config's arch wins.
    Raises ValueError for anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"not a config repr: {text!r} ({err.msg})") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError(f"not a config repr (want ClassName(field=literal, ...)): {text!r}")
    try:
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except ValueError:
        raise ValueError(f"config fields must be literals: {text!r}") from None
    from flash4.kernels import registry

    candidates = [m for m in _config_modules() if dataclasses.is_dataclass(getattr(m, node.func.id, None))]
    if not candidates:
        raise ValueError(f"no config class {node.func.id!r} in flash4.config")
    arch = kwargs.get("arch")
    for fam in registry.FAMILIES:
        if arch in fam.archs and fam.config_module() in candidates:
            return getattr(fam.config_module(), node.func.id)(**kwargs)
    return getattr(candidates[0], node.func.id)(**kwargs)


def untestable_reason(cfg) -> str | None:
    """Why the dense self-test cannot drive cfg (a sequence-layout, paged or split-KV flag), or a
    repr that does not round-trip; None when it can."""
    flags = [f for f in UNTESTABLE_FLAGS if getattr(cfg, f, False)]
    if flags:
        listed = ", ".join(f"{f}={getattr(cfg, f)!r}" for f in flags)
        return f"the self-test drives dense batches only; this config has {listed}"
    try:
        same = parse_config(repr(cfg)) == cfg
    except (ValueError, TypeError, AssertionError) as err:
        return f"the config's repr does not parse back ({err})"
    return None if same else "the config's repr does not parse back to an equal config"


# ================================================================ cases, inputs, checks (the child)

@dataclasses.dataclass(frozen=True)
class Case:
    """One small problem: batch, lengths, heads (nheads_k divides nheads), score magnitude, seed."""

    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    magnitude: float = 1.0
    seed: int = 0

    def shape(self) -> str:
        return (f"b{self.batch} sq{self.seqlen_q} sk{self.seqlen_k} h{self.nheads}/{self.nheads_k}"
                + (f" x{self.magnitude:g}" if self.magnitude != 1 else ""))


# (name, batch, seqlen_q, seqlen_k, nheads, nheads_k, magnitude)
_CASES = (
    ("one query, one key", 1, 1, 1, 1, 1, 1.0),
    ("odd lengths", 2, 17, 17, 2, 2, 1.0),
    ("MQA 4:1, seqlen_q < seqlen_k", 1, 131, 300, 4, 1, 1.0),
    ("GQA 3:1, 3 query tiles", 2, 257, 257, 6, 2, 1.0),
    ("seqlen_q > seqlen_k", 1, 300, 131, 2, 1, 1.0),
    ("12 key blocks", 1, 260, 1500, 2, 2, 1.0),
    ("large scores (rescaling)", 1, 200, 700, 2, 1, 4.0),
)
# Window (left, right) of local configs, softcap value of softcap configs.
_WINDOW = (45, 7)
_SOFTCAP = 5.0


def cases_for(cfg) -> list[Case]:
    """The cases of cfg: _CASES, with nheads = nheads_k * pack_gqa for GQA-packed configs."""
    pack = getattr(cfg, "pack_gqa", 1) or 1
    cases = []
    for i, (name, b, sq, sk, h, hk, mag) in enumerate(_CASES):
        if pack > 1:
            h = hk * pack
        cases.append(Case(name, b, sq, sk, h, hk, mag, seed=i))
    return cases


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(cfg, case: Case, device) -> dict:
    """The tensors and arguments of one case (random, seeded; built on the CPU, moved to device)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    dtype = _DTYPES[getattr(cfg, "dtype", "bf16")]
    d = cfg.headdim
    dv = getattr(cfg, "headdim_v", None) or d
    b, sq, sk, h, hk = case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k
    q = torch.randn(b, sq, h, d, generator=g) * case.magnitude
    k = torch.randn(b, sk, hk, d, generator=g) * case.magnitude
    v = torch.randn(b, sk, hk, dv, generator=g)
    inputs = {"q": q, "k": k, "v": v, "dout": torch.randn(b, sq, h, dv, generator=g)}
    inputs = {name: t.to(dtype=dtype, device=device) for name, t in inputs.items()}
    inputs.update(softmax_scale=1.0 / math.sqrt(d), causal=bool(getattr(cfg, "causal", False)),
                  window_size=_WINDOW if getattr(cfg, "local", False) else None,
                  softcap=_SOFTCAP if getattr(cfg, "softcap", False) else 0.0,
                  learnable_sink=(torch.randn(h, generator=g) * 2).to(device) if getattr(cfg, "sink", False) else None)
    return inputs


def _ref_kwargs(inputs) -> dict:
    return dict(window_size=inputs["window_size"], softcap=inputs["softcap"], learnable_sink=inputs["learnable_sink"])


def evaluate(pass_: str, case: Case, inputs: dict, result: dict) -> dict:
    """The check row of one case: errors against the float32 reference, ok by the 2x rule, and the
    first problem as text."""
    from flash4 import reference

    row = {"case": case.name, "shape": case.shape(), "ok": False, "problem": None}
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if pass_ == "fwd":
        errs = reference.fwd_errors(q, k, v, result["out"], result.get("lse"), inputs["softmax_scale"],
                                    inputs["causal"], **_ref_kwargs(inputs))
        row.update({name: errs[name] for name in ("out_err", "out_pt_err", "lse_err", "lse_pt_err")})
        row["ok"] = bool(errs["ok"])
        if not row["ok"]:
            for name, atol in (("out", reference.OUT_ATOL), ("lse", reference.LSE_ATOL)):
                err, pt = errs[f"{name}_err"], errs[f"{name}_pt_err"]
                if err is not None and not err <= 2 * pt + atol:
                    row["problem"] = _err_text(case, name, err, pt, atol, q.dtype)
                    break
        return row
    grads_ref = _ref_grads(inputs, upcast=True)
    grads_pt = _ref_grads(inputs, upcast=False)
    row["ok"] = True
    for name, g_ref, g_pt in zip(("dq", "dk", "dv"), grads_ref, grads_pt):
        err = reference.max_abs_err(result[name], g_ref)
        pt = reference.max_abs_err(g_pt, g_ref)
        row[f"{name}_err"], row[f"{name}_pt_err"] = err, pt
        if not err <= 2 * pt + GRAD_ATOL and row["ok"]:
            row["ok"] = False
            row["problem"] = _err_text(case, name, err, pt, GRAD_ATOL, q.dtype)
    return row


def _err_text(case, name, err, pt, atol, dtype) -> str:
    dt = str(dtype).removeprefix("torch.")
    if not math.isfinite(err):
        return f"case {case.name!r} ({case.shape()}): {name} has NaN or inf (elements left unwritten?)"
    return (f"case {case.name!r} ({case.shape()}): {name} error {err:.3g} > 2 x PyTorch {dt}'s {pt:.3g} + {atol:g} "
            "(max |x - float32 reference|)")


def _ref_grads(inputs, upcast: bool):
    from flash4.reference import attention_ref

    leaves = [inputs[n].detach().float() if upcast else inputs[n].detach().clone() for n in ("q", "k", "v")]
    leaves = [t.requires_grad_() for t in leaves]
    out, _ = attention_ref(*leaves, inputs["softmax_scale"], inputs["causal"], upcast=upcast, **_ref_kwargs(inputs))
    dout = inputs["dout"].float() if upcast else inputs["dout"]
    return torch.autograd.grad(out, leaves, dout)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(view), b.contiguous().view(view)
    return torch.equal(a, b)


# ================================================================ runners (the child)

def fwd_runner(cfg, device):
    """Factory of the forward runner: compiles (or loads) exactly cfg's kernel
    (flash4.compile.cache.get_fwd_runner) and returns run(inputs) -> {"out", "lse"}, written into
    NaN-filled tensors so an element the kernel leaves unwritten fails."""
    from flash4.compile.cache import get_fwd_runner
    from flash4.geometry import window_sides

    kernel = get_fwd_runner(cfg)

    def run(inputs):
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        b, sq, h, _ = q.shape
        out = torch.full((b, sq, h, v.shape[-1]), math.nan, dtype=q.dtype, device=q.device)
        lse = torch.full((b, h, sq), math.nan, dtype=torch.float32, device=q.device)
        kwargs = {"window": window_sides(inputs["window_size"], inputs["causal"]), "softcap": inputs["softcap"]}
        if inputs["learnable_sink"] is not None:
            kwargs["sink"] = inputs["learnable_sink"].float().contiguous()
        with torch.cuda.device(q.device):
            kernel(q, k, v, out, lse, inputs["softmax_scale"], **kwargs)
        return {"out": out, "lse": lse}

    return run


def bwd_runner(cfg, device):
    """Factory of the backward runner: flash4.flash_attn_func and autograd for the config's problem
    class (headdim, dtype, causal, window, softcap, deterministic); run(inputs) -> {"dq", "dk", "dv"}.
    The backward config is the one the API selects for each case (GQA cases may take its head-split
    variant); the forward kernel runs too (ungated in the child: _IN_CHILD). The API runs cfg's own
    family (flash4.kernels.registry.config_family): where that is not the device's default family
    but runs there (the portable sm80 family on sm_90, an also_on arch), FLASH4_FAMILY is set to it
    in this process (the child), as `FLASH4_FAMILY=portable` does for a user."""
    import flash4
    from flash4.arch import device_arch
    from flash4.config import active_family

    fam = _registry.config_family(cfg)
    arch = device_arch(device if torch.device(device).type == "cuda" else None)
    if arch in fam.also_on and active_family(arch).name != fam.name:
        env.force_family(fam.name)
    if active_family(arch).name != fam.name:
        raise RuntimeError(f"the backward on sm_{arch} runs the {active_family(arch).name} family, not {fam.name} "
                           f"(the family of {cfg!r})")

    def run(inputs):
        q, k, v = (inputs[n].detach().clone().requires_grad_() for n in ("q", "k", "v"))
        out = flash4.flash_attn_func(q, k, v, inputs["softmax_scale"], inputs["causal"],
                                     deterministic=bool(getattr(cfg, "deterministic", False)),
                                     window_size=inputs["window_size"] or (-1, -1), softcap=inputs["softcap"],
                                     learnable_sink=inputs["learnable_sink"])
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs["dout"])
        return {"dq": dq, "dk": dk, "dv": dv}

    return run


DEFAULT_RUNNERS = {"fwd": "flash4.selftest:fwd_runner", "bwd": "flash4.selftest:bwd_runner"}


def load_runner(spec: str):
    """The factory named by "package.module:function" or "/path/to/file.py:function" (a file is
    loaded with its own folder on sys.path, as a script would be)."""
    module_name, sep, func = spec.rpartition(":")
    if not sep or not module_name or not func:
        raise ValueError(f"runner must be 'module:function' or 'file.py:function'; got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        name = "_flash4_selftest_runner_" + hashlib.sha256(module_name.encode()).hexdigest()[:8]
        spec_obj = importlib.util.spec_from_file_location(name, module_name)
        if spec_obj is None:
            raise ValueError(f"cannot load runner file {module_name!r}")
        module = importlib.util.module_from_spec(spec_obj)
        sys.modules[name] = module
        # as a script: its own folder importable (a test file's runners import its helpers)
        folder = os.path.dirname(os.path.abspath(module_name))
        added = folder not in sys.path
        if added:
            sys.path.insert(0, folder)
        try:
            spec_obj.loader.exec_module(module)
        finally:
            if added:
                sys.path.remove(folder)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, func)


class _Events:
    def __init__(self, path: str | None):
        self.file = open(path, "a", buffering=1) if path else None

    def __call__(self, event: str, **fields):
        line = json.dumps({"event": event, "t": round(time.time(), 3), **fields}, default=str)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()
        print(f"[flash4.selftest] {line}", flush=True)


def child_main(args) -> int:
    """The self-test proper (in the child): events to args.progress, the verdict to args.result."""
    global _IN_CHILD
    _IN_CHILD = True  # the kernels under test run here whatever FLASH4_SM100 / FLASH4_PORTABLE say
    emit = _Events(args.progress)
    checks = []
    status, failure = "pass", None
    try:
        emit("started", pid=os.getpid(), torch=torch.__version__)
        cfg = parse_config(args.config)
        device = torch.device(args.device)
        if device.type == "cpu":  # fake kernels in CPU tests: small ops, often on a shared box
            torch.set_num_threads(1)
        pass_ = config_pass(cfg)
        factory = load_runner(args.runner or DEFAULT_RUNNERS[pass_])
        t0 = time.monotonic()
        run = factory(cfg, device)
        emit("ready", seconds=round(time.monotonic() - t0, 2))
        for case in cases_for(cfg):
            emit("case_start", case=case.name, shape=case.shape())
            inputs = make_inputs(cfg, case, device)
            result = run(inputs)
            _sync(device)
            row = evaluate(pass_, case, inputs, result)
            if pass_ == "fwd":
                again = run(inputs)
                _sync(device)
                row["repeats"] = all(_bitwise_equal(result[n], again[n]) for n in result)
                if not row["repeats"] and row["ok"]:
                    row["ok"] = False
                    row["problem"] = (f"case {case.name!r} ({case.shape()}): two runs on the same inputs differ "
                                      "(a race?)")
            emit("case_done", case=case.name, check=row)
            checks.append(row)
            if not row["ok"] and status == "pass":
                status, failure = "wrong", row["problem"]
    except Exception as err:  # noqa: BLE001 - any failure of the kernel under test is a verdict
        traceback.print_exc()
        status = "error"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        failure = f"{type(err).__name__}: {first_line}" if first_line else type(err).__name__
    payload = json.dumps({"status": status, "failure": failure, "checks": checks}, default=str)
    if args.result:
        tmp = f"{args.result}.tmp"
        with open(tmp, "w") as f:
            f.write(payload)
        os.replace(tmp, args.result)
    print(f"[flash4.selftest] verdict: {status}" + (f": {failure}" if failure else ""), flush=True)
    return 0 if status in ("pass", "wrong") else 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ================================================================ command line

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flash4.selftest",
        description="Self-test kernel configs on this GPU (cached verdicts; see flash4.selftest's docstring).")
    parser.add_argument("--config", action="append", required=True, metavar="REPR",
                        help="a config's repr, e.g. \"FwdConfig(headdim=128, dtype='bf16', causal=True, ...)\" "
                             "(repeat for several)")
    parser.add_argument("--device", default=None, help="cuda:N (default: the current device)")
    parser.add_argument("--rerun", action="store_true", help="ignore cached verdicts and test again")
    parser.add_argument("--runner", default=None, help="kernel runner factory, module:function or file.py:function")
    parser.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, metavar="S")
    parser.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT_S, metavar="S")
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        if len(args.config) != 1:
            raise SystemExit("--child takes one --config")
        args.config = args.config[0]
        return child_main(args)
    all_ok = True
    for text in args.config:
        cfg = parse_config(text)
        verdict = check(cfg, args.device, runner=args.runner, rerun=args.rerun,
                        startup_timeout_s=args.startup_timeout, run_timeout_s=args.run_timeout)
        all_ok = all_ok and verdict.ok
        if args.json:
            print(verdict.to_json())
        else:
            print(f"{'PASS' if verdict.ok else 'FAIL'} {verdict.config} on {verdict.gpu} ({verdict.sm}), "
                  f"{verdict.seconds:.1f} s" + (f", cached in {verdict.path}" if verdict.path else ""))
            if not verdict.ok:
                print("  " + failure_message(verdict))
    return 0 if all_ok else 1


if __name__ == "__main__":
    from flash4.selftest import main as _main  # the module proper, not this __main__ copy

    sys.exit(_main())
