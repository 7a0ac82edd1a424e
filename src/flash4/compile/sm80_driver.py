"""Compile and launch the sm80 forward directly: the CPU compile check's and the GPU tests' entry
until the host (flash4.compile.cache, flash4.api) is wired to the family.

`compile_fwd` builds one Sm80FwdConfig for its target (`--gpu-arch` from config.sm80.TARGETS,
passed per call: never CUTE_DSL_ARCH) from shape-only fake tensors, with the same parameter list
as the sm90 forward (flash4.compile.cache.compile_fwd's), so the host can drive either family
alike. `fwd_runner` wraps it for torch tensors (TVM-FFI, current stream).
"""

from __future__ import annotations

import functools
import time

import cutlass
import cutlass.cute as cute

from flash4.compile.jit import compile_kernel
from flash4.compile.fake import fwd_fake_args, seq_fake_args, sink_fake_arg, split_fake_args
from flash4.config.sm80 import Sm80FwdConfig, gpu_arch_name
from flash4.geometry import UNBOUNDED
from flash4.kernels.common.scales import host_scales
from flash4.kernels.sm80.fwd import FlashAttentionForwardSm80

COMPILE_OPTIONS = "--enable-tvm-ffi"


def compile_options(cfg: Sm80FwdConfig) -> str:
    return f"{COMPILE_OPTIONS} --gpu-arch {gpu_arch_name(cfg.arch)}"


def compile_fwd(cfg: Sm80FwdConfig, options: str = ""):
    """Compile one forward config for target cfg.arch (no GPU needed). The compiled callable takes
    (q, k, v, out, lse, lse_hi, lse_lo, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
    o_accum, lse_accum, sink, scale_log2, softcap_scale, batch, max_seqlen_q, num_splits,
    window_left, window_right, l2_group, num_ctas) as flash4.compile.cache.compile_fwd documents
    (page_table: page_gather configs only; o_accum, lse_accum: None in this family)."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return compile_kernel(
        FlashAttentionForwardSm80(cfg), *fwd_fake_args(cfg.headdim, cfg.dtype, paged=cfg.paged, headdim_v=cfg.headdim_v),
        *seq_fake_args(cfg), *split_fake_args(cfg), sink_fake_arg(cfg),
        cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
        cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1), stream,
        options=compile_options(cfg) + options,
    )


def num_tiles(cfg: Sm80FwdConfig, batch: int, max_seqlen_q: int, nheads: int) -> int:
    return -(-max_seqlen_q // cfg.tile_m) * nheads * batch


def fwd_compiled(cfg: Sm80FwdConfig):
    """compile_fwd(cfg) through the on-disk compile cache (flash4.compile.disk_cache)."""
    from flash4.compile.disk_cache import load_or_compile

    return load_or_compile("fwd_sm80", cfg, compile_options(cfg), lambda: compile_fwd(cfg))


def _warm(cfg: Sm80FwdConfig) -> float:
    t0 = time.perf_counter()
    fwd_compiled(cfg)
    return time.perf_counter() - t0


def prewarm(configs, workers: int | None = None) -> list[float]:
    """Compile `configs` into the on-disk cache in parallel processes (a GPU host's idle cores:
    fwd_runner then only loads them). Returns each config's seconds (0-ish where it was cached)."""
    import concurrent.futures
    import multiprocessing
    import os

    configs = list(dict.fromkeys(configs))
    workers = workers or max(1, min(len(configs), (os.cpu_count() or 2) - 1))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_warm, configs))


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

    compiled = fwd_compiled(cfg)

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
        scale_log2, softcap_scale = host_scales(softmax_scale, softcap, cfg.softcap)
        if tiles == 0:
            return
        compiled(q, k, v, out, lse, lse_split[0], lse_split[1], *seqs, None, None, None, sink, scale_log2,
                 softcap_scale, batch, max_seqlen_q, 1, left, right, l2_group, num_ctas)

    return run


def candidate_configs(name: str, arch: int) -> list:
    """The backward speed candidate `name` (config.sm80.BWD_CANDIDATES; "shipped":
    shipped_bwd_candidate per config, what bwd_plan runs for plain dense problems) of each shipped backward
    config of target `arch`, where it applies (`--bwd --candidate NAME`). ValueError for an unknown
    name."""
    from flash4.config.sm80 import BWD_CANDIDATES, bwd_candidates, shipped_bwd_candidate, shipped_bwd_configs

    if name != "shipped" and name not in BWD_CANDIDATES:
        raise ValueError(f"--candidate {name!r}: not a candidate; allowed: "
                         f"{', '.join(sorted(BWD_CANDIDATES))}, shipped")
    out = []
    for c in shipped_bwd_configs(arch):
        cand = shipped_bwd_candidate(c) if name == "shipped" else name
        if cand in bwd_candidates(c):
            out.append(bwd_candidates(c)[cand])
    return out


def main(argv=None) -> int:
    """`python -m flash4.compile.sm80_driver [--bwd [--candidate NAME]] [ARCH ...]`: compile every
    shipped forward (with --bwd: backward; with --candidate: candidate_configs, e.g. `--bwd
    --candidate shipped 80` for what the plain dense backward runs) config of the given targets
    (default: all of TARGETS) on this machine and print registers, spills, SASS opcode counts and
    compile seconds per config. Exit status 1 if any
    failed, spilled or lacks the warp-level instructions / has arch-specific ones."""
    import sys

    from flash4.compile.check import compile_check
    from flash4.config.sm80 import TARGETS, shipped_bwd_configs
    from flash4.config.sm80 import shipped_fwd_configs as shipped

    import argparse

    p = argparse.ArgumentParser(prog="python -m flash4.compile.sm80_driver",
                                description="Compile every shipped portable (sm80 family) config for the given "
                                            "targets; print registers, spills, SASS opcode counts and seconds.")
    p.add_argument("--bwd", action="store_true", help="the backward configs instead of the forward ones")
    p.add_argument("--candidate", metavar="NAME",
                   help="with --bwd: the speed candidate NAME (config.sm80.BWD_CANDIDATES; 'shipped': "
                        "shipped_bwd_candidate, what the plain dense backward runs) of each shipped config "
                        "where it applies, instead of the shipped configs")
    p.add_argument("archs", nargs="*", metavar="ARCH",
                   help=f"targets, e.g. 80 or sm_86 (default: all of {sorted(TARGETS)})")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    compiler = compile_fwd
    if args.bwd:
        from flash4.compile.cache import compile_bwd as compiler

        shipped = shipped_bwd_configs
        if args.candidate is not None:
            try:
                candidate_configs(args.candidate, sorted(TARGETS)[0])
            except ValueError as e:
                p.error(str(e))
            shipped = functools.partial(candidate_configs, args.candidate)
    elif args.candidate is not None:
        p.error("--candidate needs --bwd")
    archs = []
    for a in args.archs:
        name = a.removeprefix("sm_").rstrip("a")
        if not name.isdigit() or int(name) not in TARGETS:
            p.error(f"ARCH {a!r}: not a portable target; allowed: {', '.join(f'sm_{t}' for t in sorted(TARGETS))}")
        archs.append(int(name))
    archs = archs or sorted(TARGETS)
    bad = 0
    print(f"{'config':60s} {'s':>5s} {'regs':>4s} {'spill':>5s} {'HMMA':>5s} {'LDSM':>4s} {'LDGSTS':>6s} "
          f"{'bad':>3s} {'smem':>5s}")
    for arch in archs:
        for cfg, row in zip(shipped(arch), compile_check(shipped(arch), compiler=compiler)):
            forbidden = sum(row.get(k) or 0 for k in ("hgmma", "utma", "stsm", "utchmma"))
            ok = (row["ok"] and row.get("spills") == 0 and forbidden == 0 and (row.get("hmma_16816") or 0) > 0
                  and (row.get("ldsm") or 0) > 0 and (row.get("ldgsts") or 0) > 0)
            bad += not ok
            print(f"{row['config']:60s} {row['compile_s']:5.1f} {row.get('registers') or '-':>4} "
                  f"{row.get('spills', '-'):>5} {row.get('hmma_16816', '-'):>5} {row.get('ldsm', '-'):>4} "
                  f"{row.get('ldgsts', '-'):>6} {forbidden:>3} {cfg.smem_bytes() // 1024:>4}K"
                  + ("" if ok else "  FAIL " + (row["error"] or "")[:200]), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
