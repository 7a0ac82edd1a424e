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
    but the benchmark), with the CuTe DSL version."""
    import cutlass

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("bench/"):
            continue
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"cutlass-dsl {getattr(cutlass, '__version__', '?')}".encode())
    return digest.hexdigest()


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
    import cutlass.cute as cute

    _preload_runtime()
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, EXPORT_NAME)


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
            with contextlib.suppress(OSError):
                self.path.unlink()
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
        return compile_fn()
    directory = Path(env.disk_cache_dir())
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        warnings.warn(f"flash4 compile cache: cannot create {directory} ({err}); compiling without it",
                      RuntimeWarning, stacklevel=2)
        counts["compiled"] += 1
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
            with contextlib.suppress(OSError):
                path.unlink()
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
        compiled = compile_fn()
        try:
            _export(compiled, path)
        except Exception as err:  # noqa: BLE001 - a full disk must not fail the call
            warnings.warn(f"flash4 compile cache: could not write {path} ({type(err).__name__}: {err})",
                          RuntimeWarning, stacklevel=2)
        return compiled
