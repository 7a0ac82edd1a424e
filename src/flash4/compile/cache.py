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
from flash4.arch import gpu_arch_name
from flash4.kernels import registry
from flash4.config import BwdConfig, FwdConfig
from flash4.geometry import UNBOUNDED
from flash4.kernels.common.scales import host_scales
from flash4.launch import bwd_dynamic_seqlen_k, bwd_grid, bwd_dq_tile_grid, bwd_num_splits, bwd_rowwise_grid, fwd_grid
from flash4.schedule import l2_section_pairs

# Without a GPU the DSL would default to sm_100a: flash4 compiles for Hopper unless told otherwise.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.compile.disk_cache import load_or_compile  # noqa: E402
from flash4.compile.jit import compile_kernel  # noqa: E402
from flash4.constants import COMBINE_WARPS_PER_CTA  # noqa: E402


def _dsl():
    """(cutlass, cutlass.cute), imported when something is compiled: a process whose kernels all
    come from the disk cache never imports the compiler here (docs/design/warm_start.md)."""
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute

COMPILE_OPTIONS = "--enable-tvm-ffi"


def compile_counts() -> dict:
    """Kernels this process has brought in so far: {"compiled": n, "loaded": n} (loaded = from the
    on-disk cache). A call that needs no new kernel leaves both unchanged; a test of "no recompiles"
    compares them before and after (flash4.compile.disk_cache.counts)."""
    from flash4.compile import disk_cache

    return dict(disk_cache.counts)


def _arch_option(arch: int) -> str:
    return f" --gpu-arch {gpu_arch_name(arch)}"


def compile_fwd(cfg: FwdConfig, options: str = ""):
    """Compile one forward config (no GPU needed). Returns the compiled callable
    f(q, k, v, out, lse, lse_hi, lse_lo, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
    o_accum, lse_accum, sink, softmax_scale_log2: float, softcap_scale: float, batch: int, max_seqlen_q: int,
    num_splits: int,
    window_left: int, window_right: int, l2_group: int, num_ctas: int) that
    launches on the current CUDA stream; the sequence-layout tensors are passed only where the
    config's flag is on (None otherwise)."""
    from flash4.compile.fake import fwd_fake_args, seq_fake_args, sink_fake_arg, split_fake_args

    cutlass, cute = _dsl()
    kernel = registry.config_family(cfg).kernel_class("fwd")(cfg)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return compile_kernel(
        kernel, *fwd_fake_args(cfg.headdim, cfg.dtype, paged=cfg.paged, headdim_v=cfg.headdim_v,
                              tensor_hdims=getattr(cfg, "tensor_hdims", None)),
        *seq_fake_args(cfg), *split_fake_args(cfg), sink_fake_arg(cfg),
        cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
        cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1), stream,
        options=COMPILE_OPTIONS + _arch_option(cfg.arch) + options,
    )


@functools.lru_cache(maxsize=None)
def get_fwd_runner(cfg: FwdConfig):
    """Cached: compiled forward for `cfg`, as run(q, k, v, out, lse, softmax_scale, lse_split=None,
    seqs=None, batch=None, max_seqlen_q=None).

    Dense: q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv), out (B, Sq, H, Dv) (Dv =
    cfg.hdim_v), lse fp32 (B, H, Sq); all CUDA, last dim contiguous, 16-byte aligned. lse_split: None or a contiguous fp32 (2, B, H, Sq) tensor that
    receives the log2-domain LSE unrounded, as hi (lse_split[0]) + lo (lse_split[1]) (+inf, 0 for
    rows that see no key): the backward's exact path (flash4.backward).
    Varlen / paged (flash4.forward's packed layouts): the same tensors as 4-D/3-D views with batch 1 where packed,
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table) (None where the
    config's flag is off), batch = number of sequences, max_seqlen_q = host int bounding every
    sequence's query count. split_kv configs: accs = (o_accum fp32 (num_splits, B, Sq, H, D),
    lse_accum fp32 (num_splits, B, H, Sq)) receive the partial results (out/lse untouched); o_accum's
    last dim is Dv.
    local configs: window = (left, right) from flash4.geometry.window_sides (runtime values: any
    window runs on one compiled kernel).
    Launches on torch.cuda.current_stream(); returns None.
    """
    import torch  # late: keeps the compile path torch-free

    t0 = time.perf_counter()
    compiled = load_or_compile("fwd", cfg, COMPILE_OPTIONS + _arch_option(cfg.arch), lambda: compile_fwd(cfg))
    get_fwd_runner.last_compile_s = time.perf_counter() - t0

    @functools.lru_cache(maxsize=256)
    def launch_plan(batch: int, max_seqlen_q: int, nheads: int, seqlen_k_hint: int, num_splits: int, num_sms: int,
                    kv_group: int = 1):
        """(l2_group, grid size) of one problem class: a lookup on every later call. kv_group: query
        heads per KV head whose K/V an L2 section counts once (cfg.l2_kv_heads), else 1."""
        # Tile order: L2 sections of (head, batch) pairs whose K/V fit in L2 (schedule.py).
        l2_group = l2_section_pairs(seqlen_k_hint, cfg.headdim, cfg.headdim_v, kv_group) if cfg.lpt else 1
        return l2_group, fwd_grid(cfg, batch * num_splits, max_seqlen_q, nheads, num_sms)[0]

    def tail(q, k, softmax_scale: float, seqs=None, batch=None, max_seqlen_q=None, num_splits: int = 1, window=None,
             softcap: float = 0.0) -> tuple:
        """The host scalars that end the compiled call (scale_log2, softcap_scale, batch, max_seqlen_q,
        num_splits, window_left, window_right, l2_group, num_ctas), from run()'s arguments: a pure
        function of shapes, options and the device's SM count (flash4.forward's memo of prepared
        calls keeps it)."""
        if batch is None:
            batch, max_seqlen_q = q.shape[0], q.shape[1]
        if seqs is not None and seqs[4] is not None:  # paged: page_size x pages per sequence
            seqlen_k_hint = k.shape[1] * seqs[4].shape[1]
        else:  # packed K: the mean sequence
            seqlen_k_hint = k.shape[1] // max(batch, 1) if cfg.varlen_k else k.shape[1]
        pack = cfg.pack_gqa  # GQA-packed: pack x the rows, 1 / pack the heads
        kv_group = q.shape[2] // k.shape[2] if getattr(cfg, "l2_kv_heads", False) and pack == 1 else 1
        l2_group, num_ctas = launch_plan(batch, max_seqlen_q * pack, q.shape[2] // pack, seqlen_k_hint if cfg.lpt else 0,
                                         num_splits, arch.num_sms(q.device) if cfg.persistent else 0, kv_group)
        left, right = window if window is not None else (UNBOUNDED, UNBOUNDED)
        # softcap: scores softcap * tanh(S * scale / softcap); the softmax scales by softcap * log2 e;
        # folded in float32 as the backward kernel folds them (kernels/common/scales.py)
        scale_log2, softcap_scale = host_scales(softmax_scale, softcap, cfg.softcap)
        return scale_log2, softcap_scale, batch, max_seqlen_q, num_splits, left, right, l2_group, num_ctas

    def run(q, k, v, out, lse, softmax_scale: float, lse_split=None, seqs=None, batch=None, max_seqlen_q=None,
            accs=(None, None), num_splits: int = 1, window=None, softcap: float = 0.0, sink=None):
        scalars = tail(q, k, softmax_scale, seqs, batch, max_seqlen_q, num_splits, window, softcap)
        seqs = seqs if seqs is not None else (None,) * 5
        if lse_split is None:
            lse_split = torch.empty((2,) + tuple(lse.shape), dtype=torch.float32, device=lse.device)
        compiled(q, k, v, out, lse, lse_split[0], lse_split[1], *seqs, *accs, sink, *scalars)

    # flash4.forward's prepared calls take the compiled function and tail() apart: compiled(q, k, v,
    # out, lse, lse_hi, lse_lo, *seqs, *accs, sink, *tail(...)) is run() without its per-call work
    run.compiled, run.tail = compiled, tail
    return run


def compile_bwd(cfg: BwdConfig, options: str = ""):
    """Compile one backward config (no GPU needed). Returns the compiled callable
    f(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo,
      cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, dkv_semaphore, delta, softmax_scale: float, max_seqlen_k,
      window_left: int, window_right: int, softcap: float, num_ctas: int, heads_per_cta: int)
    where each of cu_seqlens_q / cu_seqlens_k / seqused_q / seqused_k is an int32 tensor when its
    config flag is on and None otherwise, and max_seqlen_k an int when cfg.varlen_k or
    cfg.seqused_k, else None (compile/fake.bwd_fake_args gives the layouts); dkv_semaphore an int32
    tensor with cfg.dkv_accum and cfg.deterministic, else None; delta a zeroed fp32 tensor shaped like
    dpsum with cfg.sink_delta (the kernel adds D = sum_j P dP of every query row to it), else None."""
    from flash4.compile.fake import bwd_fake_args

    cutlass, cute = _dsl()
    args = bwd_fake_args(cfg.headdim, cfg.dtype, cfg.varlen_q, cfg.varlen_k, cfg.seqused_q, cfg.seqused_k,
                         headdim_v=cfg.headdim_v, dkv_accum=cfg.dkv_accum, deterministic=cfg.deterministic,
                         sink_delta=getattr(cfg, "sink_delta", False))
    max_seqlen_k = cutlass.Int32(1) if bwd_dynamic_seqlen_k(cfg) else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return compile_kernel(
        registry.config_family(cfg).kernel_class("bwd")(cfg), *args, cutlass.Float32(1.0), max_seqlen_k, cutlass.Int32(0), cutlass.Int32(0),
        cutlass.Float32(0.0), cutlass.Int32(1), cutlass.Int32(1), stream,
        options=COMPILE_OPTIONS + _arch_option(cfg.arch) + options,
    )


@functools.lru_cache(maxsize=None)
def get_bwd_runner(cfg: BwdConfig):
    """Cached: compiled backward main kernel for `cfg`, as
    run(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo, softmax_scale,
        cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_k=None, window=None,
        softcap=0.0, heads_per_cta=None, dkv_semaphore=None, delta=None)
    on the current stream (grid: flash4.launch.bwd_grid). The pre/postprocess (lse_log2, dpsum,
    exact flags, dq_accum zeroing, dq conversion) is flash4.backward's (dense and packed).

    Dense configs take the dense layouts and no sequence tensors. Sequence-layout configs take
    the tensors of their flags (kernels/sm90/bwd.py gives the packed layouts, with a batch mode of
    size 1); max_seqlen_k (host int, >= every sequence's key count) is required with cfg.varlen_k
    and defaults to k.shape[1] with cfg.seqused_k alone. The batch count is cu_seqlens_q's length
    - 1 with cfg.varlen_q, else q.shape[0]. window: (left, right) for local configs
    (flash4.geometry.window_sides), None otherwise. cfg.dkv_accum: dk, dv are zeroed fp32 accumulators
    shaped like k, v, heads_per_cta (required) the query heads per CTA, and with cfg.deterministic
    dkv_semaphore a zeroed int32 tensor of (key blocks x nheads_k x batch) elements. cfg.sink_delta:
    delta (required) a zeroed fp32 tensor shaped like dpsum; the kernel adds each row's D to it."""
    compiled = load_or_compile("bwd", cfg, COMPILE_OPTIONS + _arch_option(cfg.arch), lambda: compile_bwd(cfg))
    dynamic_k = bwd_dynamic_seqlen_k(cfg)

    def tail(q, k, softmax_scale: float, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
             max_seqlen_k=None, window=None, softcap: float = 0.0, heads_per_cta=None, dkv_semaphore=None,
             delta=None) -> tuple:
        """The compiled function's host scalars after its tensors, checked (run's arguments; of the
        tensors only q's and k's shapes and which of the others are given are read)."""
        if (delta is not None) != getattr(cfg, "sink_delta", False):
            raise ValueError(f"flash4 backward: delta is required exactly with sink_delta (config {cfg})")
        given = (cu_seqlens_q is not None, cu_seqlens_k is not None, seqused_q is not None, seqused_k is not None)
        if given != (cfg.varlen_q, cfg.varlen_k, cfg.seqused_q, cfg.seqused_k):
            raise ValueError(f"flash4 backward: sequence tensors given {given} do not match the config {cfg}")
        batch = cu_seqlens_q.shape[0] - 1 if cfg.varlen_q else q.shape[0]
        if dynamic_k:
            if max_seqlen_k is None:
                if cfg.varlen_k:
                    raise ValueError("flash4 backward: max_seqlen_k is required with cu_seqlens_k")
                max_seqlen_k = k.shape[1]
            seqlen_k = int(max_seqlen_k)
        else:
            seqlen_k, max_seqlen_k = k.shape[1], None
        group = q.shape[2] // k.shape[2]
        if cfg.dkv_accum:
            if heads_per_cta is None or not 1 <= heads_per_cta < group:
                raise ValueError(f"flash4 backward: dkv_accum needs 1 <= heads_per_cta < {group}, got {heads_per_cta}")
            if (dkv_semaphore is not None) != cfg.deterministic:
                raise ValueError("flash4 backward: dkv_semaphore is required exactly with deterministic dkv_accum")
        else:
            heads_per_cta = group
        grid = bwd_grid(cfg, batch, seqlen_k, k.shape[2], bwd_num_splits(cfg, q.shape[2], k.shape[2], heads_per_cta))
        return (softmax_scale, max_seqlen_k, *(window if window is not None else (UNBOUNDED, UNBOUNDED)),
                float(softcap), grid[0], heads_per_cta)

    def run(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo,
            softmax_scale: float, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
            max_seqlen_k=None, window=None, softcap: float = 0.0, heads_per_cta=None, dkv_semaphore=None,
            delta=None):
        scalars = tail(q, k, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_k, window,
                       softcap, heads_per_cta, dkv_semaphore, delta)
        compiled(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphore, exact, lse_hi, lse_lo,
                 cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, dkv_semaphore if cfg.dkv_accum else None, delta,
                 *scalars)

    # flash4.backward's prepared calls: compiled(q, ..., lse_lo, *sequence tensors, dkv_semaphore, delta,
    # *tail(...)) is run() without its per-call checks
    run.compiled, run.tail = compiled, tail
    return run


def compile_preprocess(headdim: int, dtype: str, varlen: bool = False, headdim_q: int | None = None, arch: int = 90,
                       options: str = ""):
    """Compile the backward preprocess (kernels/common/bwd_preprocess.py; no GPU needed): headdim is
    O's head dim (Dv), headdim_q dq_accum's (None: the same); varlen: packed rows with a row_index."""
    from flash4.compile.fake import bwd_preprocess_fake_args

    cutlass, cute = _dsl()

    headdim_q = headdim if headdim_q is None else headdim_q
    args = bwd_preprocess_fake_args(headdim, dtype, varlen, headdim_q)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = registry.row_pass_class("bwd_preprocess")(headdim, args[0].element_type, headdim_q)
    return compile_kernel(kernel, *args[:8], cutlass.Int32(64), cutlass.Int32(1), stream, *args[8:],
                        options=COMPILE_OPTIONS + _arch_option(arch) + options)


def compile_postprocess(headdim: int, dtype: str, varlen: bool = False, accum_tile_m: int | None = None,
                        arch: int = 90, options: str = "", wide_stores: bool = False, wg_halves: bool = False,
                        sm80_warps: tuple | None = None):
    """Compile the dQ postprocess (row-major, or in the accumulator's order with accum_tile_m);
    wide_stores: the 16-byte-store variant (kernels/common/bwd_preprocess.py, a speed switch);
    wg_halves: tiles in per-warpgroup accumulator order (BwdConfig.dq_handoff_per_wg); sm80_warps
    (num_warps, warps_m_dq): tiles in the sm80 family's dQ MMA register order
    (Sm80BwdConfig.dq_coalesced; kernels/sm80/bwd.py DqPostprocessSm80; wide_stores ignored)."""
    from flash4.compile.fake import bwd_postprocess_fake_args

    cutlass, cute = _dsl()

    args = bwd_postprocess_fake_args(headdim, dtype, varlen)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    wide = {"wide_stores": True} if wide_stores else {}
    if wg_halves:
        wide["wg_halves"] = True
    if sm80_warps is not None:
        from flash4.kernels.sm80.bwd import DqPostprocessSm80

        assert accum_tile_m is not None and not varlen and not wg_halves, (accum_tile_m, varlen, wg_halves)
        kernel = DqPostprocessSm80(headdim, args[1].element_type, accum_tile_m, *sm80_warps)
    elif accum_tile_m is not None:
        kernel = registry.row_pass_class("bwd_postprocess_accum_order")(headdim, args[1].element_type, accum_tile_m,
                                                                        **wide)
    else:
        kernel = registry.row_pass_class("bwd_postprocess")(headdim, args[1].element_type, **wide)
    return compile_kernel(kernel, *args[:2], cutlass.Int32(1), stream, *args[2:],
                        options=COMPILE_OPTIONS + _arch_option(arch) + options)


def compile_combine(headdim: int, dtype: str, sink: bool = False, arch: int = 90, options: str = "",
                    packed_rows: bool = False, pdl: bool = False, prefetch: bool = False):
    """Compile the split-KV combine (kernels/common/fwd_combine.py). packed_rows: its variant that
    writes a varlen out / lse by cu_seqlens_q (SplitKVCombine.call_packed_rows: one more argument,
    the int32 (batch + 1,) cu_seqlens_q, after the stream); off, the kernel of __call__, unchanged.
    pdl: launched with programmatic dependent launch (FwdConfig.pdl_combine); prefetch: the merge
    with the LSEs in registers and unrolled loads (FwdConfig.combine_prefetch)."""
    from flash4.compile.fake import DTYPES, _fake

    cutlass, cute = _dsl()

    ns, b, sp, hk, sq, h = (cute.sym_int32() for _ in range(6))
    o_acc = _fake(cutlass.Float32, (ns, b, sp, hk, headdim), 4, 4)
    lse_acc = _fake(cutlass.Float32, (ns, b, hk, sp), 3, 1)
    if packed_rows:  # a varlen request's out (total_q, H, D) / lse (H, total_q)
        out, lse = _fake(DTYPES[dtype], (sq, h, headdim), 2, 8), _fake(cutlass.Float32, (h, sq), 1, 1)
    else:
        out = _fake(DTYPES[dtype], (b, sq, h, headdim), 3, 8)
        lse = _fake(cutlass.Float32, (b, h, sq), 2, 1)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    sink_arg = _fake(cutlass.Float32, (cute.sym_int32(),), 0, 1) if sink else None
    kernel = registry.row_pass_class("fwd_combine")(headdim, DTYPES[dtype], pdl=pdl, prefetch=prefetch)
    args = (o_acc, lse_acc, out, lse, sink_arg, cutlass.Int32(1), cutlass.Int32(1), stream)
    if packed_rows:
        cu_seqlens_q = _fake(cutlass.Int32, (cute.sym_int32(),), 0, 1)
        return compile_kernel(kernel.call_packed_rows, *args, cu_seqlens_q,
                            options=COMPILE_OPTIONS + _arch_option(arch) + options)
    return compile_kernel(kernel, *args, options=COMPILE_OPTIONS + _arch_option(arch) + options)


def compile_rowpass(kind: str, *key):
    """Compile one row-wise pass by kind and key (tools/kernel_fingerprint.py): "bwd_preprocess"
    (headdim, dtype, varlen, headdim_q), "bwd_postprocess" (headdim, dtype, varlen, accum_tile_m),
    "fwd_combine" (headdim, dtype, sink), "fwd_combine_rows" (headdim, dtype, sink: the packed-rows
    variant)."""
    if kind == "fwd_combine_rows":
        return compile_combine(*key, packed_rows=True)
    return {"bwd_preprocess": compile_preprocess, "bwd_postprocess": compile_postprocess,
            "fwd_combine": compile_combine}[kind](*key)


@functools.lru_cache(maxsize=None)
def get_bwd_preprocess_runner(headdim: int, dtype: str, arch: int = 90, varlen: bool = False,
                              headdim_q: int | None = None):
    """Cached: compiled backward preprocess, run(out, dout, lse_hi, lse_lo, dpsum, lse_log2, exact,
    dq_accum, tile_m, row_index=None) (see kernels/common/bwd_preprocess.py) on the current stream (grid:
    flash4.launch.bwd_rowwise_grid). headdim: O's head dim (Dv); headdim_q: dq_accum's (None: the
    same). varlen: packed layouts with a batch mode of size 1 and row_index, int32 (total_q,), the
    padded row of each packed row (flash4.backward.padded_row_index), required."""
    headdim_q = headdim if headdim_q is None else headdim_q
    key = (headdim, dtype, arch) + (("varlen",) if varlen else ()) + ((headdim_q,) if headdim_q != headdim else ())
    compiled = load_or_compile("bwd_preprocess", key, COMPILE_OPTIONS + _arch_option(arch),
                               lambda: compile_preprocess(headdim, dtype, varlen, headdim_q, arch))

    def tail(out, dq_accum, tile_m: int, row_index=None) -> tuple:
        """The host scalars between dq_accum and row_index (checked; shapes read only)."""
        if (row_index is not None) != varlen:
            raise ValueError(f"flash4 backward preprocess: row_index must be given iff varlen (varlen={varlen})")
        # dense: every accumulator row (whole tiles); varlen: the packed rows
        grid = bwd_rowwise_grid(out.shape[0], out.shape[1] if varlen else dq_accum.shape[2], out.shape[2])
        return (tile_m, grid[0])

    def run(out, dout, lse_hi, lse_lo, dpsum, lse_log2, exact, dq_accum, tile_m: int, row_index=None):
        # row_index is a parameter of the compiled function either way (None: dense).
        compiled(out, dout, lse_hi, lse_lo, dpsum, lse_log2, exact, dq_accum, *tail(out, dq_accum, tile_m, row_index),
                 row_index)

    run.compiled, run.tail = compiled, tail  # flash4.backward's prepared calls
    return run


def dq_postprocess_kwargs(cfg) -> dict:
    """get_bwd_postprocess_runner's dQ-order arguments for a backward config of any family:
    accum_tile_m (cfg.dq_accum_order), wg_halves (sm90 dq_handoff_per_wg), sm80_warps (sm80
    dq_coalesced). flash4.backward and the warm-up ask for the postprocess through this."""
    if not cfg.dq_accum_order:
        return {"accum_tile_m": None}
    kwargs = {"accum_tile_m": cfg.tile_m}
    if getattr(cfg, "dq_handoff_per_wg", False):
        kwargs["wg_halves"] = True
    if getattr(cfg, "dq_coalesced", False):
        kwargs["sm80_warps"] = (cfg.num_warps, cfg.warps_m_dq)
    return kwargs


@functools.lru_cache(maxsize=None)
def get_bwd_postprocess_runner(headdim: int, dtype: str, arch: int = 90, varlen: bool = False,
                               accum_tile_m: int | None = None, wide_stores: bool = False, wg_halves: bool = False,
                               sm80_warps: tuple | None = None):
    """Cached: compiled dQ postprocess, run(dq_accum, dq, row_index=None): dq (B, Sq, H, D) in dtype
    from the fp32 dq_accum (B, H, Sq_pad, D) (kernels/common/bwd_preprocess.py); varlen as the preprocess.
    accum_tile_m: the backward's query tile when its dQ tiles are in accumulator order
    (BwdConfig.dq_accum_order; dense only), else None (row-major). wide_stores: 16-byte dQ stores
    (a speed switch, off by default; tools/ab_switch.py --switch postprocess_wide). wg_halves: the
    tiles are in per-warpgroup accumulator order (BwdConfig.dq_handoff_per_wg; accum_tile_m needed).
    sm80_warps (num_warps, warps_m_dq): the tiles are in the sm80 family's dQ register order
    (Sm80BwdConfig.dq_coalesced; accum_tile_m needed; `dq_postprocess_kwargs` gives all three)."""
    if accum_tile_m is not None and varlen:
        raise ValueError("flash4 dQ postprocess: the accumulator order is for dense layouts only")
    if wg_halves and accum_tile_m is None:
        raise ValueError("flash4 dQ postprocess: wg_halves is an accumulator order (accum_tile_m required)")
    key = ((headdim, dtype, arch) + (("varlen",) if varlen else ()) + (("accum", accum_tile_m) if accum_tile_m else ())
           + (("wide",) if wide_stores else ()) + (("wghalves",) if wg_halves else ())
           + (("sm80", *sm80_warps) if sm80_warps else ()))
    if sm80_warps is not None and accum_tile_m is None:
        raise ValueError("flash4 dQ postprocess: sm80_warps is an accumulator order (accum_tile_m required)")
    compiled = load_or_compile("bwd_postprocess", key, COMPILE_OPTIONS + _arch_option(arch),
                               lambda: compile_postprocess(headdim, dtype, varlen, accum_tile_m, arch,
                                                           wide_stores=wide_stores, wg_halves=wg_halves,
                                                           sm80_warps=sm80_warps))

    def tail(dq, row_index=None) -> tuple:
        """The compiled function's arguments after dq_accum and dq (checked; dq's shape read only)."""
        if (row_index is not None) != varlen:
            raise ValueError(f"flash4 dQ postprocess: row_index must be given iff varlen (varlen={varlen})")
        if accum_tile_m is not None:
            return (bwd_dq_tile_grid(dq.shape[0], dq.shape[1], dq.shape[2], accum_tile_m)[0],)
        return (bwd_rowwise_grid(dq.shape[0], dq.shape[1], dq.shape[2])[0], row_index)

    def run(dq_accum, dq, row_index=None):
        compiled(dq_accum, dq, *tail(dq, row_index))

    run.compiled, run.tail = compiled, tail  # flash4.backward's prepared calls (dense: row_index None)
    return run


@functools.lru_cache(maxsize=None)
def get_combine_runner(headdim: int, dtype: str, arch: int = 90, sink: bool = False, packed_rows: bool = False,
                       pdl: bool = False, prefetch: bool = False):
    """Cached: compiled split-KV combine (kernels/common/fwd_combine.py), as run(o_accum, lse_accum, out,
    lse, pack) on the current stream: o_accum fp32 (splits, B, Sp, Hk, D), lse_accum fp32
    (splits, B, Hk, Sp), out (B, Sp // pack, Hk * pack, D), lse fp32 (B, Hk * pack, Sp // pack).
    packed_rows: the variant run(o_accum, lse_accum, out, lse, pack, sink=None, cu_seqlens_q=...)
    whose out / lse are a varlen request's (total_q, Hk * pack, D) / (Hk * pack, total_q) and
    cu_seqlens_q its int32 (B + 1,) offsets: slot s of sequence b goes to row cu[b+1] - Sq + s
    when that row is >= cu[b] (Sq = Sp // pack), nothing else is written. pdl: the variant launched
    with programmatic dependent launch (FwdConfig.pdl_combine); prefetch: FwdConfig.combine_prefetch's
    merge (at most MAX_SPLITS splits)."""
    key = ((headdim, dtype, arch) + (("sink",) if sink else ()) + (("pdl",) if pdl else ())
           + (("prefetch",) if prefetch else ()) + (("rows",) if packed_rows else ()))
    compiled = load_or_compile("fwd_combine", key, COMPILE_OPTIONS + _arch_option(arch),
                               lambda: compile_combine(headdim, dtype, sink, arch, packed_rows=packed_rows, pdl=pdl,
                                                               prefetch=prefetch))

    if packed_rows:
        def run(o_accum, lse_accum, out, lse, pack: int, sink=None, cu_seqlens_q=None):
            _, batch, seqlen_p, nheads_k, _ = o_accum.shape
            compiled(o_accum, lse_accum, out, lse, sink, pack, combine_ctas(batch, seqlen_p, nheads_k), cu_seqlens_q)
    else:
        def run(o_accum, lse_accum, out, lse, pack: int, sink=None):
            _, batch, seqlen_p, nheads_k, _ = o_accum.shape
            compiled(o_accum, lse_accum, out, lse, sink, pack, combine_ctas(batch, seqlen_p, nheads_k))

    # flash4.memo's prepared calls: compiled(..., sink, pack, combine_ctas(...)), packed_rows: (..., cu_seqlens_q)
    run.compiled = compiled
    return run


def combine_ctas(batch: int, seqlen_p: int, nheads_k: int) -> int:
    """CTAs of the split-KV combine: one warp per (batch, packed row, KV head) row."""
    return -(-(batch * seqlen_p * nheads_k) // COMBINE_WARPS_PER_CTA)
