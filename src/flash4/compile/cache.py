"""One cached entry point per kernel kind: config (host scalars only) -> compiled launcher.

The in-memory cache is keyed by the frozen config; a second call with an equal config compiles
nothing; a new process loads what an earlier one compiled from the on-disk cache
(flash4.compile.disk_cache). Compiled kernels take torch tensors directly (TVM-FFI) and launch on
the current stream.
"""

from __future__ import annotations

import functools
import time

import os

from flash4 import arch
from flash4.config import LOG2E, BwdConfig, FwdConfig
from flash4.launch import bwd_grid, bwd_preprocess_grid, fwd_grid
from flash4.schedule import l2_section_heads

# Without a GPU the DSL would default to sm_100a: flash4 compiles for Hopper unless told otherwise.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from flash4.compile.disk_cache import load_or_compile  # noqa: E402
from flash4.compile.fake import bwd_fake_args, fwd_fake_args  # noqa: E402

COMPILE_OPTIONS = "--enable-tvm-ffi"


def _arch_option(arch: int) -> str:
    return f" --gpu-arch sm_{arch}a"


def compile_fwd(cfg: FwdConfig, options: str = ""):
    """Compile one forward config (no GPU needed). Returns the compiled callable
    f(q, k, v, out, lse, lse_hi, lse_lo, softmax_scale_log2: float, l2_group: int, num_ctas: int)
    that launches on the current CUDA stream."""
    from flash4.kernels.fwd_sm90 import FlashAttentionForwardSm90

    if cfg.arch != 90:
        raise ValueError(f"no forward kernel for sm_{cfg.arch}")
    kernel = FlashAttentionForwardSm90(cfg)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        kernel, *fwd_fake_args(cfg.headdim, cfg.dtype), cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), stream,
        options=COMPILE_OPTIONS + _arch_option(cfg.arch) + options,
    )


@functools.lru_cache(maxsize=None)
def get_fwd_runner(cfg: FwdConfig):
    """Cached: compiled forward for `cfg`, as run(q, k, v, out, lse, softmax_scale, lse_split=None).

    q: (B, Sq, H, D), k/v: (B, Sk, Hk, D), out like q, lse fp32 (B, H, Sq); all CUDA, last dim
    contiguous, 16-byte aligned. lse_split: None or a contiguous fp32 (2, B, H, Sq) tensor that
    receives the log2-domain LSE unrounded, as hi (lse_split[0]) + lo (lse_split[1]) (+inf, 0 for
    rows that see no key): the backward's exact path (flash4.backward). Launches on
    torch.cuda.current_stream(); returns None.
    """
    import torch  # late: keeps the compile path torch-free

    t0 = time.perf_counter()
    compiled = load_or_compile("fwd", cfg, COMPILE_OPTIONS + _arch_option(cfg.arch), lambda: compile_fwd(cfg))
    get_fwd_runner.last_compile_s = time.perf_counter() - t0

    def run(q, k, v, out, lse, softmax_scale: float, lse_split=None):
        batch, seqlen_q, nheads, _ = q.shape
        # Tile order: L2 sections of (head, batch) pairs whose K/V fit in L2 (schedule.py).
        l2_group = l2_section_heads(k.shape[1], cfg.headdim) if cfg.lpt else 1
        grid = fwd_grid(cfg, batch, seqlen_q, nheads, arch.num_sms(q.device) if cfg.persistent else 0)
        if lse_split is None:
            lse_split = torch.empty((2,) + tuple(lse.shape), dtype=torch.float32, device=lse.device)
        compiled(q, k, v, out, lse, lse_split[0], lse_split[1], softmax_scale * LOG2E, l2_group, grid[0])

    return run


def compile_bwd(cfg: BwdConfig, options: str = ""):
    """Compile one backward config (no GPU needed). Returns the compiled callable
    f(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo,
    softmax_scale: float, num_ctas: int)."""
    from flash4.kernels.bwd_sm90 import FlashAttentionBackwardSm90

    if cfg.arch != 90:
        raise ValueError(f"no backward kernel for sm_{cfg.arch}")
    args = bwd_fake_args(cfg.headdim, cfg.dtype)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        FlashAttentionBackwardSm90(cfg), *args, cutlass.Float32(1.0), cutlass.Int32(1), stream,
        options=COMPILE_OPTIONS + _arch_option(cfg.arch) + options,
    )


@functools.lru_cache(maxsize=None)
def get_bwd_runner(cfg: BwdConfig):
    """Cached: compiled backward main kernel for `cfg`, as
    run(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo, softmax_scale)
    on the current stream (grid: flash4.launch.bwd_grid). The pre/postprocess (lse_log2, dpsum,
    exact flags, dq_accum zeroing, dq conversion) is flash4.backward's."""
    compiled = load_or_compile("bwd", cfg, COMPILE_OPTIONS + _arch_option(cfg.arch), lambda: compile_bwd(cfg))

    def run(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo,
            softmax_scale: float):
        grid = bwd_grid(cfg, k.shape[0], k.shape[1], k.shape[2])
        compiled(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo,
                 softmax_scale, grid[0])

    return run


@functools.lru_cache(maxsize=None)
def get_bwd_preprocess_runner(headdim: int, dtype: str, arch: int = 90):
    """Cached: compiled backward preprocess, run(out, dout, lse_hi, lse_lo, dpsum, lse_log2, exact,
    tile_m) (see kernels/bwd_preprocess.py) on the current stream (grid: flash4.launch)."""
    from flash4.compile.fake import bwd_preprocess_fake_args
    from flash4.kernels.bwd_preprocess import BackwardPreprocess

    def compile_preprocess():
        args = bwd_preprocess_fake_args(headdim, dtype)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(
            BackwardPreprocess(headdim, args[0].element_type), *args, cutlass.Int32(64), cutlass.Int32(1), stream,
            options=COMPILE_OPTIONS + _arch_option(arch),
        )

    compiled = load_or_compile("bwd_preprocess", (headdim, dtype, arch), COMPILE_OPTIONS + _arch_option(arch),
                               compile_preprocess)

    def run(out, dout, lse_hi, lse_lo, dpsum, lse_log2, exact, tile_m: int):
        grid = bwd_preprocess_grid(out.shape[0], out.shape[1], out.shape[2])
        compiled(out, dout, lse_hi, lse_lo, dpsum, lse_log2, exact, tile_m, grid[0])

    return run
