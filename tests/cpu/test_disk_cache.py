"""The on-disk compile cache (flash4.compile.disk_cache) on the CPU: keys, a second load compiles
nothing, corrupt and truncated entries recompile with a warning, FLASH4_CACHE=0, two processes
compiling the same kernel at once, and a cached kernel whose first call fails."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from flash4.compile import disk_cache  # noqa: E402
from flash4.compile.cache import COMPILE_OPTIONS  # noqa: E402
from flash4.config import select_bwd_config, select_fwd_config  # noqa: E402

OPTIONS = COMPILE_OPTIONS + " --gpu-arch sm_90a"


def compile_preprocess(headdim=64, dtype="bf16"):
    """A small real kernel (the backward preprocess compiles in about a second)."""
    import cutlass
    import cutlass.cute as cute

    from flash4.compile.fake import bwd_preprocess_fake_args
    from flash4.kernels.common.bwd_preprocess import BackwardPreprocess

    args = bwd_preprocess_fake_args(headdim, dtype)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(BackwardPreprocess(headdim, args[0].element_type), *args, cutlass.Int32(64),
                        cutlass.Int32(1), stream, options=OPTIONS)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASH4_CACHE", raising=False)
    return tmp_path / "cache"


class Counter:
    def __init__(self, fn=compile_preprocess):
        self.calls, self.fn = 0, fn

    def __call__(self):
        self.calls += 1
        return self.fn()


def test_key_depends_on_kind_config_options():
    fwd = select_fwd_config(128, "bf16", True)
    keys = {
        disk_cache.entry_key("fwd", fwd, OPTIONS),
        disk_cache.entry_key("fwd", select_fwd_config(128, "bf16", False), OPTIONS),
        disk_cache.entry_key("fwd", select_fwd_config(128, "fp16", True), OPTIONS),
        disk_cache.entry_key("bwd", select_bwd_config(128, "bf16", True), OPTIONS),
        disk_cache.entry_key("fwd", fwd, COMPILE_OPTIONS + " --gpu-arch sm_100a"),
    }
    assert len(keys) == 5
    assert disk_cache.entry_key("fwd", fwd, OPTIONS) == disk_cache.entry_key("fwd", fwd, OPTIONS)
    assert len(disk_cache.source_fingerprint()) == 64


def test_second_load_compiles_nothing(cache_dir):
    first = Counter()
    disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, first)
    assert first.calls == 1 and len(list(cache_dir.glob("*.o"))) == 1
    again = Counter()
    fn = disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, again)
    assert again.calls == 0 and isinstance(fn, disk_cache._FromDisk)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_damaged_entry_recompiles_with_a_warning(cache_dir, damage, monkeypatch):
    # The object is what this test damages: with FLASH4_RUNTIME_LOAD on (the default) a good
    # shared library beside it would be loaded instead (the next test damages that one).
    monkeypatch.setenv("FLASH4_RUNTIME_LOAD", "0")
    disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, Counter())
    (entry,) = cache_dir.glob("*.o")
    data = entry.read_bytes()
    entry.write_bytes({"garbage": b"not an object file" * 10, "truncated": data[: len(data) // 2],
                       "empty": b""}[damage])
    counter = Counter()
    with pytest.warns(RuntimeWarning, match="flash4 compile cache"):
        disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, counter)
    assert counter.calls == 1
    assert entry.read_bytes() == data or len(entry.read_bytes()) > len(data) // 2  # rewritten, whole
    fresh = Counter()
    disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, fresh)
    assert fresh.calls == 0


@pytest.mark.parametrize("damage", ["garbage", "empty"])
def test_damaged_shared_library_falls_back_to_the_object(cache_dir, damage, monkeypatch):
    """FLASH4_RUNTIME_LOAD on: a damaged <key>.so warns, loads the object through the CuTe DSL
    (no compile) and is linked afresh for the next process."""
    # The entry is compiled (and loaded from its object) without the runtime loader and then
    # linked, as an earlier process would have: a library this process has loaded would be found
    # again by dlopen under its path whatever the file now holds.
    monkeypatch.setenv("FLASH4_RUNTIME_LOAD", "0")
    disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, Counter())
    (entry,) = cache_dir.glob("*.o")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        disk_cache._link_shared(entry)
    shared = list(cache_dir.glob("*.so"))
    if not shared:
        pytest.skip("no C compiler driver here to link the shared library with")
    monkeypatch.setenv("FLASH4_RUNTIME_LOAD", "1")
    (shared,) = shared
    shared.write_bytes({"garbage": b"not a shared library" * 10, "empty": b""}[damage])
    counter = Counter()
    with pytest.warns(RuntimeWarning, match="flash4 compile cache"):
        disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, counter)
    assert counter.calls == 0
    assert shared.exists() and shared.stat().st_size > 1000  # relinked from the object


def test_cache_off(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE", "0")
    counter = Counter()
    disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, counter)
    assert counter.calls == 1 and not cache_dir.exists()
    monkeypatch.setenv("FLASH4_CACHE", "maybe")
    with pytest.raises(ValueError, match="FLASH4_CACHE"):
        disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, counter)


def test_two_processes_compile_once(cache_dir, tmp_path):
    """Two processes asking for the same kernel at once: one compiles and stores it, the other waits
    on the lock and loads it; both succeed."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_disk_cache import compile_preprocess, OPTIONS
        from flash4.compile import disk_cache
        def compile_and_mark():
            open({str(tmp_path)!r} + "/compiled." + str(__import__("os").getpid()), "w").close()
            return compile_preprocess()
        fn = disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90), OPTIONS, compile_and_mark)
        print(type(fn).__name__)
    """)
    env = dict(os.environ, FLASH4_CACHE_DIR=str(cache_dir))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len(list(tmp_path.glob("compiled.*"))) == 1, outs
    assert "_FromDisk" in [o.strip() for o in outs]  # the waiting one loaded it
    assert len(list(cache_dir.glob("*.o"))) == 1 and not list(cache_dir.glob(".*tmp*"))


def test_failing_cached_kernel_is_recompiled(tmp_path):
    entry = tmp_path / "x.o"
    entry.write_bytes(b"x")

    def broken(*args):
        raise RuntimeError("undefined symbol")

    fn = disk_cache._FromDisk(broken, entry, lambda: (lambda *args: sum(args)))
    with pytest.warns(RuntimeWarning, match="failed on its first call"):
        assert fn(1, 2) == 3
    assert not entry.exists() and fn(2, 2) == 4


def test_warmup_cli_fills_the_cache_and_loads_it_back(tmp_path):
    """`python -m flash4 warmup` compiles into FLASH4_CACHE_DIR; a second process loads every config
    from there (each well under the issue's 50 ms once the CuTe DSL is imported)."""
    env = dict(os.environ, FLASH4_CACHE_DIR=str(tmp_path / "c"))
    env.pop("FLASH4_CACHE", None)
    cmd = [sys.executable, "-m", "flash4", "warmup", "--headdims", "64", "--dtypes", "bf16", "--causal", "0"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "CuTe DSL import" in first.stdout
    entries = list((tmp_path / "c").glob("*.o"))
    # forward, backward, deterministic backward, preprocess, two dQ postprocesses (accumulator order
    # of 128-query tiles: in per-warpgroup halves for the backward's per-warpgroup hand-off, whole for
    # the deterministic one); the (64, 128) head dim pair's forward, backward, its preprocess (over
    # Dv = 128) and dQ postprocess (64-query tiles, shared with the GQA split); the GQA head-split
    # (dkv_accum) backward; the short-sequence (persistent) forward
    assert len(entries) == 12
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    how = [line.split()[-2] for line in second.stdout.splitlines() if line.startswith(("fwd_sm90", "bwd_sm90"))]
    assert how == ["loaded"] * 7, second.stdout
    assert [line.split()[-2] for line in first.stdout.splitlines()
            if line.startswith(("fwd_sm90", "bwd_sm90"))] == ["compiled"] * 7, first.stdout
