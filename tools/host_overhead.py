"""Host (Python) time per call of each flash4 door, and eager vs CUDA-graph replay of a decode step.

    python tools/host_overhead.py                  # on a GPU: real launches
    python tools/host_overhead.py --fake           # no GPU needed: CPU tensors, every compiled kernel a no-op
    python tools/host_overhead.py --fake --profile kvcache   # cProfile of one door's host path
    HOST_OVERHEAD_MEMO=0 python tools/host_overhead.py      # flash4.memo off: the full host path per call
    python tools/host_overhead.py --ab                      # memo off, then on, in one process
    python tools/host_overhead.py --env FLASH4_DECODE_SCATTER=0,1 varlen_paged   # each value in turn, one process

Doors (decode cells: batch 1, one query, 32 query / 8 KV heads, head dim 128, bf16):
    kvcache        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=t)   dense cache
    kvcache_paged  the same over a page-64 cache
    func           flash_attn_func(q, k, v)                                        dense K/V
    varlen_paged   flash_attn_varlen_func as vLLM calls it (q (1, H, D), cu_seqlens_q = arange(2),
                   max_seqlen_q = 1, paged K/V, seqused_k, page_table)
    func_prefill   flash_attn_func on a tiny prefill (1 x 128 x 8 heads x 64): the dense kernels' path

Real mode prints per door: host us/call (time to issue N calls, no sync), eager us/call (N calls then
a sync: whichever of host and GPU is slower), graph us/call (one call captured, replayed N times), and
eager / graph. The decode cells use `--keys` keys (default 131072: the issue's batch 1 x 128k cell).
Fake mode replaces flash4.compile.disk_cache.load_or_compile's kernels by no-ops (so the host path
runs whole: plans, runner lookups, argument marshalling, buffer allocations, but no TVM-FFI call) and
lets CPU tensors through the device checks (FLASH4_ARCH=90, FLASH4_NUM_SMS=132); the numbers
measure flash4's Python (the thread's CPU time, best of 5, and Python calls per call), not the CUDA
driver's launch cost nor the CUDA caching allocator's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# FLASH4_SRC: another checkout's src/ (the before / after numbers of docs/perf/host_overhead.md)
sys.path.insert(0, os.environ.get("FLASH4_SRC") or os.path.join(ROOT, "src"))


def _fake_kernels():
    """CPU tensors through flash4's checks; every compiled kernel a no-op (nothing is compiled)."""
    os.environ["FLASH4_ARCH"] = "90"
    os.environ["FLASH4_NUM_SMS"] = "132"
    from flash4 import validate
    from flash4.compile import cache

    device_problem = validate._device_problem

    def relative_only(q, others, dense=False):
        problem = device_problem(q, others, dense)
        return None if problem is not None and problem[1].startswith("q is on cpu") else problem

    validate._device_problem = relative_only
    validate._arch_problem = lambda *args, **kwargs: None
    if hasattr(validate, "_REMEMBER_CPU"):  # the memo of passed checks, as CUDA tensors get it
        validate._REMEMBER_CPU = True
    try:  # the memo of prepared calls (flash4.memo), as CUDA tensors get it
        from flash4 import memo

        memo.CPU = True
    except ImportError:  # an older flash4 (FLASH4_SRC)
        pass

    def no_kernel(*args, **kwargs):
        return None

    cache.load_or_compile = lambda kind, key, options, compile_fn: no_kernel


def _setup_line() -> str:
    """flash4's memo switch (HOST_OVERHEAD_MEMO=0 turns flash4.memo off: the full host path on every
    call, the 'before' of docs/perf/host_overhead.md in one checkout), and how TVM-FFI takes torch
    tensors: through torch's C DLPack exchange API (no Python per tensor) or its Python fallback."""
    import torch

    try:
        from flash4 import memo

        memo.ENABLED = os.environ.get("HOST_OVERHEAD_MEMO", "1") != "0"
        state = "on" if memo.ENABLED else "off (HOST_OVERHEAD_MEMO=0)"
    except ImportError:
        state = "absent (an older flash4)"
    exchange = hasattr(torch.Tensor, "__dlpack_c_exchange_api__") and \
        os.environ.get("TVM_FFI_SKIP_DLPACK_C_EXCHANGE_API", "0") != "1"
    try:
        import tvm_ffi

        ffi = f"tvm_ffi {tvm_ffi.__version__}"
    except ImportError:
        ffi = "tvm_ffi absent"
    return (f"flash4.memo {state}; torch {torch.__version__}, {ffi}, tensors passed through "
            f"{'the C DLPack exchange API' if exchange else 'the Python DLPack fallback (slow)'}")


def cells(device: str, keys: int):
    """door name -> a no-argument callable making one call."""
    import torch

    import flash4

    bf16, i32 = torch.bfloat16, torch.int32
    b, h, hk, d, page = 1, 32, 8, 128, 64
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=bf16)

    q = randn(b, 1, h, d)
    k, v = randn(b, keys, hk, d), randn(b, keys, hk, d)
    pages = keys // page
    k_pool, v_pool = k.view(pages, page, hk, d), v.view(pages, page, hk, d)
    table = torch.arange(pages, dtype=i32, device=device).view(1, pages)
    seqlens = torch.full((b,), keys, dtype=i32, device=device)
    cu_q = torch.arange(b + 1, dtype=i32, device=device)
    q_packed = q.view(b, h, d)
    qp, kp, vp = randn(1, 128, 8, 64), randn(1, 128, 8, 64), randn(1, 128, 8, 64)
    # the backward doors: gpt-oss's shape class (d64, 64 / 8 heads) with a learnable sink and a
    # 128-key window, small enough for CPU tensors; autograd.grad on a graph built once (the bench's way)
    qb, kb, vb = randn(1, 256, 16, 64), randn(1, 256, 2, 64), randn(1, 256, 2, 64)
    sink = torch.randn(16, generator=gen, device=device, dtype=torch.float32)
    for t in (qb, kb, vb, sink):
        t.requires_grad_(True)
    dout = randn(1, 256, 16, 64)
    out_sink = flash4.flash_attn_func(qb, kb, vb, causal=True, window_size=(128, 0), learnable_sink=sink)
    out_plain = flash4.flash_attn_func(qb, kb, vb, causal=True)
    return {
        "kvcache": lambda: flash4.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True),
        "kvcache_paged": lambda: flash4.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens,
                                                                page_table=table, causal=True),
        "func": lambda: flash4.flash_attn_func(q, k, v, causal=True),
        "varlen_paged": lambda: flash4.flash_attn_varlen_func(q_packed, k_pool, v_pool, cu_q, None, 1, None,
                                                              seqused_k=seqlens, page_table=table, causal=True),
        "func_prefill": lambda: flash4.flash_attn_func(qp, kp, vp, causal=True),
        "bwd": lambda: torch.autograd.grad(out_plain, (qb, kb, vb), dout, retain_graph=True),
        "bwd_sink_window": lambda: torch.autograd.grad(out_sink, (qb, kb, vb, sink), dout, retain_graph=True),
    }


def host_us(fn, n: int, clock=time.perf_counter) -> float:
    """Mean time of n calls (no sync) on `clock`, microseconds."""
    t0 = clock()
    for _ in range(n):
        fn()
    return (clock() - t0) / n * 1e6


def python_calls(fn, n: int = 20) -> float:
    """Python function calls (cProfile's count, C functions included) per call of fn: a measure of
    the host path that a loaded machine does not blur."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    return pstats.Stats(prof).total_calls / n


def measure(device: str, keys: int, n: int, only=None) -> list[dict]:
    import torch

    rows = []
    for name, fn in cells(device, keys).items():
        if only and name not in only:
            continue
        for _ in range(5):  # compile / load, caches
            fn()
        row = {"door": name}
        if device == "cuda":
            torch.cuda.synchronize()
            row["host_us"] = host_us(fn, n)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            row["eager_us"] = (time.perf_counter() - t0) / n * 1e6
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                graph.replay()
            torch.cuda.synchronize()
            row["graph_us"] = (time.perf_counter() - t0) / n * 1e6
            row["eager/graph"] = row["eager_us"] / row["graph_us"]
        else:  # the thread's CPU time: other processes on a shared box do not count
            row["host_us"] = min(host_us(fn, n, time.thread_time) for _ in range(5))
            row["py_calls"] = python_calls(fn)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fake", action="store_true", help="no GPU: CPU tensors, no-op kernels")
    parser.add_argument("--keys", type=int, default=None, help="keys of the decode cells (default 131072; fake: 4096)")
    parser.add_argument("-n", type=int, default=300, help="calls per measurement")
    parser.add_argument("--profile", default=None, help="cProfile one door (fake or real) and print the top entries")
    parser.add_argument("--ab", action="store_true", help="measure with flash4.memo off, then on (one process)")
    parser.add_argument("--env", action="append", default=[], metavar="VAR=V1,V2",
                        help="measure once per value of environment variable VAR, in this process (e.g. "
                             "FLASH4_DECODE_SCATTER=0,1: the varlen door's combine writing the rows, off then on); "
                             "repeatable: every combination")
    parser.add_argument("doors", nargs="*", help="doors to run (default: all)")
    args = parser.parse_args(argv)
    if args.fake:
        _fake_kernels()
    print(_setup_line())
    device = "cpu" if args.fake else "cuda"
    keys = args.keys or (4096 if args.fake else 131072)
    if args.profile:
        import cProfile
        import pstats

        for setting in env_settings(args.env):
            if setting:
                os.environ.update(setting)
                print("with " + " ".join(f"{k}={v}" for k, v in setting.items()) + ":")
            fn = cells(device, keys)[args.profile]
            for _ in range(5):
                fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.n):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    states = (False, True) if args.ab else (None,)
    for state in states:
        if state is not None:  # --ab: flash4.memo off, then on, in one process
            from flash4 import memo

            memo.ENABLED = state
            memo.clear()
            print(f"flash4.memo {'on' if state else 'off'}:")
        for setting in env_settings(args.env):
            if setting:  # --env: the variables set for this measurement (flash4 reads them per call)
                os.environ.update(setting)
                print("with " + " ".join(f"{k}={v}" for k, v in setting.items()) + ":")
            report(device, keys, measure(device, keys, args.n, set(args.doors)), args.fake)
    return 0


def env_settings(specs: list) -> list[dict]:
    """--env's "VAR=V1,V2" specs as the list of their combinations ({VAR: value, ...}); [{}] for none.
    ValueError for a spec without "=" or without a value."""
    settings = [{}]
    for spec in specs:
        name, sep, values = spec.partition("=")
        choices = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not name.strip() or not choices:
            raise ValueError(f"--env {spec!r}: expected VAR=V1[,V2...], e.g. FLASH4_DECODE_SCATTER=0,1")
        settings = [dict(s, **{name.strip(): v}) for s in settings for v in choices]
    return settings


def report(device: str, keys: int, rows: list, fake: bool) -> None:
    """Print one measurement's table."""
    cols = ["door"] + [c for c in ("host_us", "py_calls", "eager_us", "graph_us", "eager/graph") if c in rows[0]]
    print(("fake (no-op kernels, CPU tensors)" if fake else "cuda") + f", decode cells: 1 x {keys} keys")
    print("  ".join(f"{c:>14}" for c in cols))
    for row in rows:
        print("  ".join(f"{row[c]:>14.1f}" if isinstance(row[c], float) else f"{row[c]:>14}" for c in cols))


if __name__ == "__main__":
    sys.exit(main())
