"""Compile and launch the sm80 forward directly: the CPU compile check's and the GPU tests' entry
until the host (flash4.compile.cache, flash4.api) is wired to the family.

`compile_fwd` builds one Sm80FwdConfig for its target (`--gpu-arch` from config.sm80.TARGETS,
passed per call: never CUTE_DSL_ARCH) from shape-only fake tensors, with the same parameter list
as the sm90 forward (flash4.compile.cache.compile_fwd's), so the host can drive either family
alike. `fwd_runner` wraps it for torch tensors (TVM-FFI, current stream).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute

from flash4.compile.fake import fwd_fake_args, seq_fake_args, sink_fake_arg, split_fake_args
from flash4.config.sm80 import Sm80FwdConfig, gpu_arch_name
from flash4.constants import LOG2E
from flash4.geometry import UNBOUNDED
from flash4.kernels.sm80.fwd import FlashAttentionForwardSm80

COMPILE_OPTIONS = "--enable-tvm-ffi"


def compile_options(cfg: Sm80FwdConfig) -> str:
    return f"{COMPILE_OPTIONS} --gpu-arch {gpu_arch_name(cfg.arch)}"


def compile_fwd(cfg: Sm80FwdConfig, options: str = ""):
    """Compile one forward config for target cfg.arch (no GPU needed). The compiled callable takes
    (q, k, v, out, lse, lse_hi, lse_lo, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
    o_accum, lse_accum, sink, scale_log2, softcap_scale, batch, max_seqlen_q, num_splits,
    window_left, window_right, l2_group, num_ctas) as flash4.compile.cache.compile_fwd documents
    (page_table, o_accum, lse_accum: None in this family)."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        FlashAttentionForwardSm80(cfg), *fwd_fake_args(cfg.headdim, cfg.dtype, headdim_v=cfg.headdim_v),
        *seq_fake_args(cfg), *split_fake_args(cfg), sink_fake_arg(cfg),
        cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
        cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1), stream,
        options=compile_options(cfg) + options,
    )


def num_tiles(cfg: Sm80FwdConfig, batch: int, max_seqlen_q: int, nheads: int) -> int:
    return -(-max_seqlen_q // cfg.tile_m) * nheads * batch


@functools.lru_cache(maxsize=None)
def fwd_runner(cfg: Sm80FwdConfig):
    """Cached: run(q, k, v, out, lse, softmax_scale, lse_split=None, seqs=None, batch=None,
    max_seqlen_q=None, window=None, softcap=0.0, sink=None, num_sms=None) on the current stream.

    Dense: q (B, Sq, H, D), k / v (B, Sk, Hk, D), out (B, Sq, H, D), lse fp32 (B, H, Sq), all CUDA with
    the last dim contiguous and 16-byte aligned. lse_split: None or fp32 (2, B, H, Sq) receiving the
    log2-domain LSE as hi + lo. Varlen: seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    (None where the config's flag is off), packed tensors with a batch mode of 1, batch = number of
    sequences, max_seqlen_q >= every sequence's query count. window: (left, right) from
    flash4.geometry.window_sides for local configs. num_sms: the grid of a persistent config."""
    import torch  # late: the compile path stays torch-free

    from flash4.schedule import l2_section_heads

    compiled = compile_fwd(cfg)

    def run(q, k, v, out, lse, softmax_scale: float, lse_split=None, seqs=None, batch=None, max_seqlen_q=None,
            window=None, softcap: float = 0.0, sink=None, num_sms=None):
        if batch is None:
            batch, max_seqlen_q = q.shape[0], q.shape[1]
        seqs = tuple(seqs) if seqs is not None else (None,) * 4
        if lse_split is None:
            lse_split = torch.empty((2,) + tuple(lse.shape), dtype=torch.float32, device=lse.device)
        tiles = num_tiles(cfg, batch, max_seqlen_q, q.shape[2])
        num_ctas = min(tiles, num_sms) if cfg.persistent else tiles
        seqlen_k = k.shape[1] // max(batch, 1) if cfg.varlen_k else k.shape[1]
        l2_group = l2_section_heads(seqlen_k, cfg.headdim) if cfg.lpt else 1
        left, right = window if window is not None else (UNBOUNDED, UNBOUNDED)
        scale_log2, softcap_scale = ((softcap * LOG2E, softmax_scale / softcap) if cfg.softcap
                                     else (softmax_scale * LOG2E, 1.0))
        if tiles == 0:
            return
        compiled(q, k, v, out, lse, lse_split[0], lse_split[1], *seqs, None, None, None, sink, scale_log2,
                 softcap_scale, batch, max_seqlen_q, 1, left, right, l2_group, num_ctas)

    return run
