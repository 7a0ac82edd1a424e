"""One cached entry point per kernel kind: config (host scalars only) -> compiled launcher.

The in-memory cache is keyed by the frozen config; a second call with an equal config compiles
nothing. Compiled kernels take torch tensors directly (TVM-FFI) and launch on the current stream.
"""

from __future__ import annotations

import functools
import time

import os

from flash4 import arch
from flash4.config import LOG2E, BwdConfig, FwdConfig, ceil_div
from flash4.schedule import l2_section_heads

# Without a GPU the DSL would default to sm_100a: flash4 compiles for Hopper unless told otherwise.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from flash4.compile.fake import bwd_fake_args, fwd_fake_args  # noqa: E402

COMPILE_OPTIONS = "--enable-tvm-ffi"


def _arch_option(arch: int) -> str:
    return f" --gpu-arch sm_{arch}a"


def compile_fwd(cfg: FwdConfig, options: str = ""):
    """Compile one forward config (no GPU needed). Returns the compiled callable
    f(q, k, v, out, lse, softmax_scale_log2: float) that launches on the current CUDA stream."""
    from flash4.kernels.fwd_sm90 import FlashAttentionForwardSm90

    if cfg.arch != 90:
        raise ValueError(f"no forward kernel for sm_{cfg.arch}")
    kernel = FlashAttentionForwardSm90(cfg)
    q, k, v, o, lse = fwd_fake_args(cfg.headdim, cfg.dtype)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        kernel, q, k, v, o, lse, cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), stream,
        options=COMPILE_OPTIONS + _arch_option(cfg.arch) + options,
    )


@functools.lru_cache(maxsize=None)
def get_fwd_runner(cfg: FwdConfig):
    """Cached: compiled forward for `cfg`, as run(q, k, v, out, lse, softmax_scale).

    q: (B, Sq, H, D), k/v: (B, Sk, Hk, D), out like q, lse fp32 (B, H, Sq); all CUDA, last dim
    contiguous, 16-byte aligned. Launches on torch.cuda.current_stream(); returns None.
    """
    t0 = time.perf_counter()
    compiled = compile_fwd(cfg)
    get_fwd_runner.last_compile_s = time.perf_counter() - t0

    def run(q, k, v, out, lse, softmax_scale: float):
        batch, seqlen_q, nheads, _ = q.shape
        num_tiles = ceil_div(seqlen_q, cfg.tile_m) * nheads * batch
        # Tile order: L2 sections of (head, batch) pairs whose K/V fit in L2 (schedule.py).
        l2_group = l2_section_heads(k.shape[1], cfg.headdim) if cfg.lpt else 1
        num_ctas = min(num_tiles, arch.num_sms(q.device)) if cfg.persistent else num_tiles
        compiled(q, k, v, out, lse, softmax_scale * LOG2E, l2_group, num_ctas)

    return run


def compile_bwd(cfg: BwdConfig, options: str = ""):
    """Compile one backward config (no GPU needed). Returns the compiled callable
    f(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, softmax_scale: float)."""
    from flash4.kernels.bwd_sm90 import FlashAttentionBackwardSm90

    if cfg.arch != 90:
        raise ValueError(f"no backward kernel for sm_{cfg.arch}")
    args = bwd_fake_args(cfg.headdim, cfg.dtype)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        FlashAttentionBackwardSm90(cfg), *args, cutlass.Float32(1.0), stream,
        options=COMPILE_OPTIONS + _arch_option(cfg.arch) + options,
    )


@functools.lru_cache(maxsize=None)
def get_bwd_runner(cfg: BwdConfig):
    """Cached: compiled backward main kernel for `cfg`, as
    run(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, softmax_scale) on the current stream.
    The pre/postprocess (lse_log2, dpsum, dq_accum zeroing, dq conversion) is flash4.backward's."""
    compiled = compile_bwd(cfg)

    def run(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, softmax_scale: float):
        compiled(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, softmax_scale)

    return run


@functools.lru_cache(maxsize=None)
def get_bwd_preprocess_runner(headdim: int, dtype: str, arch: int = 90):
    """Cached: compiled backward preprocess, run(out, dout, lse, dpsum, lse_log2) (see
    kernels/bwd_preprocess.py) on the current stream."""
    from flash4.compile.fake import bwd_preprocess_fake_args
    from flash4.kernels.bwd_preprocess import BackwardPreprocess

    args = bwd_preprocess_fake_args(headdim, dtype)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        BackwardPreprocess(headdim, args[0].element_type), *args, stream,
        options=COMPILE_OPTIONS + _arch_option(arch),
    )
