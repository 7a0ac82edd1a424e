"""Where a named cell's time goes: GPU kernel time per call against the timed call, per impl.

    source .device-deps/activate.sh && python tools/prof_case.py sink_gptoss_d64_window128_causal_8k \
        --impls flash4 flash_attn_4 --out $OUT/prof_case.json

For each impl (flash4.bench.baselines names) and pass (forward, backward as the bench times it:
autograd.grad on a graph built once), prints the time per call as the bench takes it (
triton's do_bench median with L2 flushed), then the same call run CALLS times under torch.profiler: every GPU kernel
with its mean duration per call, their sum, and the host (CPU) time per call. A kernel sum well
under the timed call means the call is host-bound or has GPU gaps (launch latency, syncs); a kernel
that grew between two trees shows up by name. Cells: flash4.bench.cases.CASES (a name or prefix; Dv != D
cells included). Reads only flash4.bench.cases.CASES and flash4.bench.baselines.all_impls, so an older tree
runs it too (PYTHONPATH=.baseline/src).

--ncu fwd|bwd: no timing; each impl's pass is warmed up three times, then one call runs between
torch.cuda.profiler.start() / stop(), for Nsight Compute (docs/perf/ncu_*.md):

    ncu --clock-control none --profile-from-start off --set full -o fwd_flash4 \
        python tools/prof_case.py sink_gptoss_d64_window128 --impls flash4 --ncu fwd
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
CALLS = 20


def profile_calls(fn, calls: int = CALLS) -> dict:
    """{kernels: {name: mean us per call}, gpu_us, host_us} of `calls` calls of fn (after a warm-up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
    kernels: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.time_range.elapsed_us() / calls
    return {"kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])), "gpu_us": sum(kernels.values()),
            "host_us": host * 1e6}


def cprofile_calls(fn, calls: int, top: int = 30) -> str:
    """The host's Python profile of `calls` calls of fn (cProfile, after a warm-up and a sync): the
    functions with the most cumulative and own time, as text; plus the wall time per call with a
    synchronize after every call and without (a host-bound call reads the same both ways)."""
    import cProfile
    import io
    import pstats

    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    async_us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
        torch.cuda.synchronize()
    sync_us = (time.perf_counter() - t0) / calls * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return f"host per call: {async_us:.1f} us launching only, {sync_us:.1f} us with a sync after each call\n" \
        + text.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case")
    p.add_argument("--impls", nargs="+", default=["flash4", "flash_attn_4"])
    p.add_argument("--no-bwd", action="store_true")
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--out")
    p.add_argument("--ncu", choices=("fwd", "bwd"), help="profile one call of this pass for ncu; no timing")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile the host's Python over N calls of each pass (cProfile; printed)")
    args = p.parse_args(argv)
    import torch

    from triton.testing import do_bench

    from flash4.bench import baselines, cases  # both exist in older trees too (the two-tree comparison)

    case = next(c for c in cases.CASES if c.name == args.case or c.name.startswith(args.case))
    impls = {i.name: i for i in baselines.all_impls()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    hdim_v = getattr(case, "headdim_v", None) or case.headdim  # (older trees' Case has no headdim_v)
    q, k, v = (torch.randn(case.batch, case.seqlen_q if i == 0 else case.seqlen_k, case.nheads if i == 0 else case.nheads_k,
                           hdim_v if i == 2 else case.headdim, generator=gen, device="cuda", dtype=torch.bfloat16)
               for i in range(3))
    print(f"{case.name}: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    result = {}
    for name in args.impls:
        impl = impls[name]
        if impl.unavailable:
            print(f"{name}: unavailable ({impl.unavailable})")
            continue
        passes = {"fwd": impl.make(q, k, v, case.causal, **case.options())}
        if not args.no_bwd and args.ncu != "fwd":
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            with impl.context():
                out = impl.make(qg, kg, vg, case.causal, **case.options())()
            dout = torch.randn_like(out)
            passes["bwd"] = lambda out=out, qg=qg, kg=kg, vg=vg, dout=dout: torch.autograd.grad(
                out, (qg, kg, vg), dout, retain_graph=True)
        if args.ncu:
            fn = passes[args.ncu]
            with impl.context():  # (flash4.bench.common.profile_one_call, inlined: older trees lack it)
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                fn()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            print(f"{name} {args.ncu}: one call profiled")
            continue
        for pname, fn in passes.items():
            with impl.context():
                timed = float(do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median")) * 1e3
                row = profile_calls(fn)
            row["timed_us"] = timed
            result[f"{name}/{pname}"] = row
            print(f"{name} {pname}: timed {timed:.1f} us per call, GPU kernels {row['gpu_us']:.1f} us, "
                  f"host {row['host_us']:.1f} us")
            for kname, us in row["kernels"].items():
                print(f"    {us:9.1f} us  {kname[:140]}")
            if args.cprofile:
                with impl.context():
                    print(cprofile_calls(fn, args.cprofile))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"case": case.name, "rows": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
