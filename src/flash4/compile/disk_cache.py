"""On-disk compile cache: compiled kernels persist across processes.

A compiled CuTe DSL function is exported to an object file (`export_to_c`) and loaded back with
`cutlass.runtime.load_module(..., enable_tvm_ffi=True)`, which returns a function called with the
same arguments as the freshly compiled one. Entries live in flash4.env.disk_cache_dir()
(FLASH4_CACHE_DIR; FLASH4_CACHE=0 turns the cache off), one `<key>.o` per kernel, where the key
hashes the kernel kind, its config (a frozen dataclass of host scalars), a fingerprint of flash4's
sources, the CuTe DSL version and the compile options (which name the GPU arch).

Safe with several processes: a compile holds an exclusive `flock` on `<key>.lock` (the others wait
and then load what it wrote), the object is written to a temporary name and renamed into place
(atomic), and loads take the lock shared. A corrupt or truncated entry is a miss: a warning, the
entry is removed and the kernel recompiled, never a crash. A function loaded from disk whose first
call raises is likewise replaced by a fresh compile (and the entry removed).

A miss is compiled without the DSL's in-process JIT engine (flash4.compile.jit.export_only: the same
cubin and exported object, ~0.35 s less), exported, and then loaded from the entry like a hit, so
the process that compiled a kernel runs exactly what later processes load.

Measured on the 2-core CPU box (d128 causal forward, 92 KB object): compile 4.1 s, export 0.17 s,
load of a cached entry 2 ms once the DSL runtime is up (its one-time start, `import cutlass` plus
the runtime libraries, is reported separately by `python -m flash4 warmup`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import time
import warnings
from pathlib import Path
from typing import Callable

from flash4 import env
from flash4.compile.jit import export_only, with_engine

EXPORT_NAME = "flash4_kernel"
LOCK_TIMEOUT_S = 600.0
# What load_or_compile did in this process: kernels loaded from disk, and compiled, and the wall
# seconds each kind took in all (a load includes the lock and the file read; see timing_summary).
counts = {"loaded": 0, "compiled": 0}
seconds = {"loaded": 0.0, "compiled": 0.0}


def timing_summary() -> str:
    """One line: how many kernels this process loaded from the disk cache / compiled, and the mean
    time of each (what `python -m flash4 bench` prints)."""
    parts = []
    for how, unit, scale in (("loaded", "ms", 1e3), ("compiled", "s", 1.0)):
        n = counts[how]
        mean = f" (mean {seconds[how] / n * scale:.{0 if unit == 'ms' else 2}f} {unit})" if n else ""
        parts.append(f"{n} {how}{mean}")
    where = env.disk_cache_dir() if env.disk_cache_enabled() else "off (FLASH4_CACHE=0)"
    return f"compile cache {where}: kernels " + ", ".join(parts)


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 of every flash4 source file that can change a compiled kernel (all of the package
    but the benchmark), with the CuTe DSL version. Computed once per install: the value is kept in
    the cache directory under a key made of the files' paths, sizes and modification times (and the
    CuTe DSL's package file's), so a later process stats the files instead of reading, hashing them
    and importing the DSL for its version (docs/design/warm_start.md)."""
    root = Path(__file__).resolve().parents[1]
    files = [(path.relative_to(root).as_posix(), path) for path in sorted(root.rglob("*.py"))]
    files = [(rel, path) for rel, path in files if not rel.startswith("bench/")]
    stat_key = hashlib.sha256()
    for rel, path in files + [("<cutlass>", _dsl_origin())]:
        if path is None:
            continue
        st = path.stat()
        stat_key.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    memo = Path(env.disk_cache_dir()) / "fingerprints" / stat_key.hexdigest()[:40]
    if env.disk_cache_enabled():
        with contextlib.suppress(OSError, UnicodeDecodeError):
            text = memo.read_text().strip()
            if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
                return text
    digest = hashlib.sha256()
    for rel, path in files:
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"cutlass-dsl {_dsl_version()}".encode())
    value = digest.hexdigest()
    if env.disk_cache_enabled():
        with contextlib.suppress(OSError):
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
            tmp.write_text(value)
            os.replace(tmp, memo)
    return value


def _dsl_origin() -> Path | None:
    """The CuTe DSL package's __init__.py, found without importing it (None when not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("cutlass")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _dsl_version() -> str:
    """The CuTe DSL's version: the installed distribution's, else cutlass.__version__ (an import)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        import cutlass

        return getattr(cutlass, "__version__", "?")


def entry_key(kind: str, config, options: str) -> str:
    """The cache key of one kernel: kind (fwd/bwd/bwd_preprocess), config repr, compile options
    (including --gpu-arch) and the source fingerprint."""
    text = "\n".join([kind, repr(config), options, source_fingerprint()])
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@contextlib.contextmanager
def _flock(path: Path, exclusive: bool):
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flash4 compile cache: lock {path} held for over {LOCK_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@functools.lru_cache(maxsize=1)
def _preload_runtime() -> None:
    """Load the DSL's runtime libraries with RTLD_GLOBAL once, so a loaded object finds their
    symbols (cutlass.runtime.load_module opens them privately)."""
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _load(path: Path):
    """The kernel of a cache entry: with FLASH4_RUNTIME_LOAD, from its shared library (<key>.so,
    TVM-FFI alone, no CuTe DSL import) when there is one; else the object through the CuTe DSL's
    loader (and, with FLASH4_RUNTIME_LOAD, the shared library linked for the next process)."""
    runtime = env.runtime_load_enabled()
    shared = path.with_suffix(".so")
    if runtime and shared.exists():
        try:
            return _load_shared(shared)
        except Exception as err:  # noqa: BLE001 - fall back to the object (and relink)
            warnings.warn(f"flash4 compile cache: cannot load {shared.name} through TVM-FFI ({type(err).__name__}: "
                          f"{err}); loading the object through the CuTe DSL", RuntimeWarning, stacklevel=3)
            with contextlib.suppress(OSError):
                shared.unlink()
    import cutlass.cute as cute

    _preload_runtime()
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    fn = getattr(module, EXPORT_NAME)
    if runtime:
        _link_shared(path)
    return fn


# ---------------------------------------------------------------- shared libraries (FLASH4_RUNTIME_LOAD)
# The object an entry stores (export_to_c) holds the kernel's cubin and a host launcher whose only
# undefined symbols are the CuTe DSL runtime library's (CUDA library loading, launches) and
# TVM-FFI's. Linked into a shared library (`cc -shared`), it loads with dlopen through
# tvm_ffi.load_module once those two libraries are loaded globally, without the DSL's compiler
# (its MLIR bindings and execution engine are most of a warm process start). RUNTIME_LIBS, in the
# cache directory, names the runtime libraries the DSL found when it linked (the DSL's choice of
# CUDA 12 / 13 flavour is kept). One listing per install of the CuTe DSL and TVM-FFI
# (runtime_libs_name): two Python installs (virtualenvs) sharing the cache directory (the default
# ~/.cache/flash4) must each load their own libraries; loading another install's libtvm_ffi.so
# into a process that had imported its own aborted the process (2026-12-04, a fresh virtualenv next to
# the system site-packages, README's test command: "Fatal Python error: Aborted").
RUNTIME_LIBS = "runtime_libs.txt"


@functools.lru_cache(maxsize=1)
def runtime_libs_name() -> str:
    """The name of this Python install's runtime-library listing in a cache directory:
    RUNTIME_LIBS tagged with a hash of where the CuTe DSL (`cutlass`) and TVM-FFI packages are
    installed (importlib.util.find_spec: neither is imported)."""
    import importlib.util

    origins = []
    for name in ("cutlass", "tvm_ffi"):
        spec = importlib.util.find_spec(name)
        origins.append(str(spec.origin if spec is not None else None))
    tag = hashlib.sha256("\n".join(origins).encode()).hexdigest()[:16]
    stem, suffix = RUNTIME_LIBS.rsplit(".", 1)
    return f"{stem}-{tag}.{suffix}"


def _link_shared(obj: Path) -> None:
    """Link the cached object `obj` into obj.with_suffix('.so') and record the runtime libraries
    (best effort: a warning, never an error, without a C compiler driver)."""
    import shutil
    import subprocess

    shared = obj.with_suffix(".so")
    if shared.exists():
        return
    try:
        import cutlass.cute as cute

        libs = [lib for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True) if Path(lib).exists()]
        listing = obj.parent / runtime_libs_name()
        if not listing.exists() or listing.read_text().split() != libs:
            tmp = listing.with_name(f".{listing.name}.{os.getpid()}.tmp")
            tmp.write_text("\n".join(libs) + "\n")
            os.replace(tmp, listing)
        cc = shutil.which("cc")
        if cc is None:
            raise OSError("no C compiler driver (cc) to link the shared library with")
        tmp = shared.with_name(f".{shared.stem}.{os.getpid()}.tmp.so")
        try:
            subprocess.run([cc, "-shared", "-o", str(tmp), str(obj)], check=True, capture_output=True, timeout=120)
            os.replace(tmp, shared)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    except Exception as err:  # noqa: BLE001 - the object entry still works
        warnings.warn(f"flash4 compile cache: could not link {shared.name} ({type(err).__name__}: {err}); "
                      f"this kernel will keep loading through the CuTe DSL", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _runtime_libs(directory: str) -> tuple:
    """Load the runtime libraries named in this install's listing in `directory`
    (runtime_libs_name) with RTLD_GLOBAL (once); returns their paths. Raises OSError when the
    listing is missing or a library cannot be loaded."""
    name = runtime_libs_name()
    libs = tuple((Path(directory) / name).read_text().split())
    if not libs:
        raise OSError(f"{name} lists no library")
    for lib in libs:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return libs


def _load_shared(shared: Path):
    """The kernel function of a linked entry, through TVM-FFI alone."""
    import tvm_ffi

    _runtime_libs(str(shared.parent))
    module = tvm_ffi.load_module(str(shared))
    return module[EXPORT_NAME]


def _export(compiled, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.o")
    try:
        compiled.export_to_c(str(tmp), EXPORT_NAME)
        if tmp.stat().st_size == 0:
            raise OSError(f"empty object file {tmp}")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    if env.runtime_load_enabled():
        _link_shared(path)


class _FromDisk:
    """A function loaded from the cache. Its first call is guarded: if it raises, the entry is
    removed and the kernel compiled afresh (warning), so a bad entry costs a compile, not a crash."""

    def __init__(self, fn, path: Path, compile_fn: Callable[[], object]):
        self.fn, self.path, self.compile_fn, self.checked = fn, path, compile_fn, False

    def __call__(self, *args):
        if self.checked:
            return self.fn(*args)
        try:
            result = self.fn(*args)
        except Exception as err:  # noqa: BLE001 - any failure of a cached object means: recompile
            warnings.warn(f"flash4 compile cache: the cached kernel {self.path.name} failed on its first call "
                          f"({type(err).__name__}: {err}); recompiling it", RuntimeWarning, stacklevel=2)
            for stale in (self.path, self.path.with_suffix(".so")):
                with contextlib.suppress(OSError):
                    stale.unlink()
            with with_engine():
                self.fn = self.compile_fn()
            result = self.fn(*args)
        self.checked = True
        return result


def load_or_compile(kind: str, config, options: str, compile_fn: Callable[[], object]):
    """The compiled kernel for (kind, config, options): from the disk cache when it holds a good
    entry, else compile_fn() (and store it). With the cache off (FLASH4_CACHE=0), compile_fn().
    Counts and times what it did in `counts` / `seconds`."""
    t0 = time.perf_counter()
    before = counts["compiled"]
    try:
        return _load_or_compile(kind, config, options, compile_fn)
    finally:
        seconds["compiled" if counts["compiled"] > before else "loaded"] += time.perf_counter() - t0


def _load_or_compile(kind: str, config, options: str, compile_fn: Callable[[], object]):
    if not env.disk_cache_enabled():
        counts["compiled"] += 1
        with with_engine():  # called in this process (and kept by the runner caches)
            return compile_fn()
    directory = Path(env.disk_cache_dir())
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        warnings.warn(f"flash4 compile cache: cannot create {directory} ({err}); compiling without it",
                      RuntimeWarning, stacklevel=2)
        counts["compiled"] += 1
        with with_engine():
            return compile_fn()
    key = entry_key(kind, config, options)
    path, lock = directory / f"{key}.o", directory / f"{key}.lock"

    def try_load():
        if not path.exists():
            return None
        try:
            return _FromDisk(_load(path), path, compile_fn)
        except Exception as err:  # noqa: BLE001 - a corrupt / truncated / foreign entry
            warnings.warn(f"flash4 compile cache: unreadable entry {path} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); recompiling", RuntimeWarning,
                          stacklevel=3)
            for stale in (path, path.with_suffix(".so")):
                with contextlib.suppress(OSError):
                    stale.unlink()
            return None

    with _flock(lock, exclusive=False):
        loaded = try_load()
    if loaded is not None:
        counts["loaded"] += 1
        return loaded
    with _flock(lock, exclusive=True):
        loaded = try_load()  # another process may have compiled it while we waited
        if loaded is not None:
            counts["loaded"] += 1
            return loaded
        counts["compiled"] += 1
        # Compiled without the DSL's in-process JIT engine (flash4.compile.jit): the entry is
        # exported and then loaded exactly as a later process loads it.
        with export_only():
            compiled = compile_fn()
        try:
            _export(compiled, path)
            return _FromDisk(_load(path), path, compile_fn)
        except Exception as err:  # noqa: BLE001 - a full disk must not fail the call
            warnings.warn(f"flash4 compile cache: could not write or load {path} ({type(err).__name__}: {err}); "
                          f"compiling it again to run in this process", RuntimeWarning, stacklevel=2)
            for stale in (path, path.with_suffix(".so")):
                with contextlib.suppress(OSError):
                    stale.unlink()
        with with_engine():
            return compile_fn()
