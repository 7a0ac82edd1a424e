"""Warm process start on the CPU (docs/design/warm_start.md): the compile path is the only importer
of the CuTe DSL, the source fingerprint is computed once per install, and with FLASH4_RUNTIME_LOAD a
cached kernel is linked into a shared library that a new process loads through TVM-FFI alone (every
symbol resolved at load, LD_BIND_NOW), falling back to the DSL's loader when the library is bad."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _python(code: str, **env) -> str:
    full = dict(os.environ, PYTHONPATH=SRC, **env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def test_host_path_imports_no_dsl():
    """import flash4 and the modules a cached-kernel launch goes through leave the CuTe DSL unimported."""
    out = _python("""
        import sys
        import flash4, flash4.forward, flash4.backward, flash4.compile.cache, flash4.compile.disk_cache
        print(sorted(m for m in sys.modules if m.split('.')[0] == 'cutlass'))  # (torch imports cuda.bindings itself)
    """)
    assert out == "[]"


def test_fingerprint_once_per_install(tmp_path, monkeypatch):
    from flash4.compile import disk_cache

    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASH4_CACHE", raising=False)
    disk_cache.source_fingerprint.cache_clear()
    try:
        value = disk_cache.source_fingerprint()
        memos = list((tmp_path / "fingerprints").iterdir())
        assert len(value) == 64 and len(memos) == 1 and memos[0].read_text() == value
        disk_cache.source_fingerprint.cache_clear()

        def no_reading(self):
            raise AssertionError(f"{self} was read: the memo should have answered")

        monkeypatch.setattr(Path, "read_bytes", no_reading)
        assert disk_cache.source_fingerprint() == value
    finally:
        disk_cache.source_fingerprint.cache_clear()


LOAD = """
    import sys
    from flash4.compile import cache, disk_cache
    def no_compile():
        raise AssertionError("the cache missed")
    fn = disk_cache.load_or_compile("fwd_combine", (64, "bf16", 90), cache.COMPILE_OPTIONS + " --gpu-arch sm_90a",
                                    no_compile)
    print(type(fn.fn).__module__.split(".")[0], "cutlass" in sys.modules, dict(disk_cache.counts))
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler driver to link the shared library")
def test_runtime_load_without_the_dsl(tmp_path):
    pytest.importorskip("cutlass")
    env = dict(FLASH4_CACHE_DIR=str(tmp_path), FLASH4_RUNTIME_LOAD="1", CUTE_DSL_ARCH="sm_90a")
    _python("""
        from flash4.compile.cache import get_combine_runner
        get_combine_runner(64, "bf16", 90)
    """, **env)
    shared = list(tmp_path.glob("*.so"))
    assert len(shared) == 1 and len(list(tmp_path.glob("*.o"))) == 1
    listings = list(tmp_path.glob("runtime_libs-*.txt"))  # this environment's (disk_cache.runtime_libs_name)
    assert len(listings) == 1 and listings[0].read_text().split()
    # a new process: loaded through TVM-FFI, the DSL never imported, every symbol bound at dlopen
    assert _python(LOAD, LD_BIND_NOW="1", **env) == "tvm_ffi False {'loaded': 1, 'compiled': 0}"
    # without the switch: the object through the DSL's loader, as before
    assert _python(LOAD, **dict(env, FLASH4_RUNTIME_LOAD="0")).startswith("tvm_ffi True")
    # a damaged shared library: a warning, the object through the DSL, the library linked again
    shared[0].write_bytes(b"not a library")
    assert _python(LOAD, **env).startswith("tvm_ffi True")
    assert shared[0].stat().st_size > 1000
    assert _python(LOAD, **env).startswith("tvm_ffi False")


def test_runtime_libs_listing_is_per_install(monkeypatch):
    """Two Python environments sharing a cache directory read their own runtime-library listings: the
    name hashes where `cutlass` and `tvm_ffi` are installed (a process loading another environment's
    libtvm_ffi.so next to its own aborted)."""
    import importlib.util

    from flash4.compile import disk_cache

    disk_cache.runtime_libs_name.cache_clear()
    try:
        here = disk_cache.runtime_libs_name()
        assert here.startswith("runtime_libs-") and here.endswith(".txt") and here == disk_cache.runtime_libs_name()
        real = importlib.util.find_spec

        def elsewhere(name, *a, **k):
            spec = real(name, *a, **k)
            if name == "tvm_ffi" and spec is not None:
                spec = importlib.util.spec_from_file_location(name, "/other/venv/tvm_ffi/__init__.py")
            return spec

        disk_cache.runtime_libs_name.cache_clear()
        monkeypatch.setattr(importlib.util, "find_spec", elsewhere)
        assert disk_cache.runtime_libs_name() != here
    finally:
        monkeypatch.undo()
        disk_cache.runtime_libs_name.cache_clear()
