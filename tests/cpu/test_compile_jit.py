"""flash4.compile.jit: kernels compiled for the disk cache skip the CuTe DSL's in-process JIT engine
and give the same exported object; the cache loads what it wrote instead."""

import pytest

pytest.importorskip("cutlass")

pytestmark = pytest.mark.jit_engine  # these tests set export_only themselves (tests/cpu/conftest.py)

from flash4.compile import disk_cache, jit  # noqa: E402
from flash4.compile.cache import COMPILE_OPTIONS, compile_preprocess  # noqa: E402
from flash4.compile.check import extract_cubin  # noqa: E402


def test_export_only_is_scoped():
    assert not jit.exporting()
    with jit.export_only():
        assert jit.exporting()
        with jit.export_only():
            assert jit.exporting()
        assert jit.exporting()
    assert not jit.exporting()


def test_same_cubin_and_object_without_the_engine(tmp_path):
    with_engine = compile_preprocess(64, "bf16")
    with jit.export_only():
        without = compile_preprocess(64, "bf16")
    assert extract_cubin(with_engine) == extract_cubin(without) is not None
    for name, compiled in (("engine", with_engine), ("export_only", without)):
        compiled.export_to_c(str(tmp_path / f"{name}.o"), "fn")
    assert (tmp_path / "engine.o").read_bytes() == (tmp_path / "export_only.o").read_bytes()


@pytest.mark.parametrize("runtime_load", ["0", "1"])
def test_cache_compiles_without_the_engine_and_loads_its_entry(tmp_path, monkeypatch, runtime_load):
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASH4_CACHE", raising=False)
    monkeypatch.setenv("FLASH4_RUNTIME_LOAD", runtime_load)
    seen = []

    def compile_fn():
        seen.append(jit.exporting())
        return compile_preprocess(64, "bf16")

    fn = disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90, "jit-test"), COMPILE_OPTIONS, compile_fn)
    assert seen == [True]  # compiled inside export_only
    assert isinstance(fn, disk_cache._FromDisk)  # and loaded back from the entry it wrote
    assert len(list((tmp_path / "cache").glob("*.o"))) == 1


def test_cache_off_builds_the_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE", "0")
    seen = []

    def compile_fn():
        seen.append(jit.exporting())
        return compile_preprocess(64, "bf16")

    with jit.export_only():  # as in the CPU tests: the kernel is kept and called, so it gets its engine
        fn = disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90, "jit-test"), COMPILE_OPTIONS, compile_fn)
    assert seen == [False] and not isinstance(fn, disk_cache._FromDisk)


def test_failed_export_compiles_again_with_the_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASH4_CACHE", raising=False)

    def broken_export(compiled, path):
        raise OSError("disk full")

    monkeypatch.setattr(disk_cache, "_export", broken_export)
    seen = []

    def compile_fn():
        seen.append(jit.exporting())
        return compile_preprocess(64, "bf16")

    with pytest.warns(RuntimeWarning, match="compiling it again"), jit.export_only():
        fn = disk_cache.load_or_compile("bwd_preprocess", (64, "bf16", 90, "jit-test"), COMPILE_OPTIONS, compile_fn)
    assert seen == [True, False] and not isinstance(fn, disk_cache._FromDisk)
    assert not list((tmp_path / "cache").glob("*.o"))


def test_first_call_guard_recompiles_with_the_engine(tmp_path):
    seen = []

    def compile_fn():
        seen.append(jit.exporting())
        return lambda *args: "fresh"

    def broken(*args):
        raise RuntimeError("bad entry")

    entry = tmp_path / "entry.o"
    entry.write_bytes(b"x")
    guarded = disk_cache._FromDisk(broken, entry, compile_fn)
    with pytest.warns(RuntimeWarning, match="failed on its first call"), jit.export_only():
        assert guarded() == "fresh"
    assert seen == [False] and not entry.exists()
