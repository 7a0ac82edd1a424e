"""`cute.compile` for flash4's kernels, with or without the CuTe DSL's in-process JIT engine.

A plain `cute.compile` builds the kernel's cubin and host launcher, then JIT-compiles the host
module twice so that the result can be called in this process: an MLIR execution engine (MCJIT,
whose entry lookup compiles the module) and, for TVM-FFI, the same module emitted to an object
again and linked with JITLink. When the disk cache is on (the default) flash4 exports the compiled
kernel to an object file anyway and can load it from there (flash4.compile.disk_cache), so inside
`export_only()` the engine is not built (`no_jit_engine=True`): the cubin and the exported object
are byte-identical, and the compile is ~0.35 s shorter (CPU box, portable d64 backward for sm_90a:
3.1 -> 2.7 s). Outside it (FLASH4_CACHE=0, tools that call the compiled function directly) the
engine is built as before, also inside an enclosing export_only() where the result is called
(`with_engine()`: the disk cache's fallbacks, which keep a kernel that a cached runner then calls).
"""

from __future__ import annotations

import contextlib
import contextvars

_EXPORT_ONLY = contextvars.ContextVar("flash4_export_only", default=False)


@contextlib.contextmanager
def export_only():
    """Within this context, compile_kernel builds no JIT engine: its result can be exported
    (`export_to_c`) and its cubin read, but not called."""
    token = _EXPORT_ONLY.set(True)
    try:
        yield
    finally:
        _EXPORT_ONLY.reset(token)


@contextlib.contextmanager
def with_engine():
    """Within this context, compile_kernel builds the JIT engine whatever an enclosing export_only()
    says: for a compile whose result is called in this process (the disk cache's fallbacks)."""
    token = _EXPORT_ONLY.set(False)
    try:
        yield
    finally:
        _EXPORT_ONLY.reset(token)


def exporting() -> bool:
    """Whether compile_kernel currently skips the JIT engine (inside export_only())."""
    return _EXPORT_ONLY.get()


def compile_kernel(fn, *args, options: str):
    """cute.compile(fn, *args, options=options), without the JIT engine inside export_only()."""
    import cutlass.cute as cute

    if _EXPORT_ONLY.get():
        return cute.compile(fn, *args, options=options, no_jit_engine=True)
    return cute.compile(fn, *args, options=options)
