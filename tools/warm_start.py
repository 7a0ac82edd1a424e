"""Warm process start: what `import flash4` plus the first forward and backward cost in a new process
whose kernels are all in the on-disk compile cache (issue 25 item 5; docs/design/warm_start.md).

    python tools/warm_start.py                 # GPU: both load paths, a private cache directory
    python tools/warm_start.py --runtime-load 1 --cache-dir DIR

Runs fresh Python processes: the first fills the cache (compiles or loads whatever the measured
step needs), the next ones measure. A measured process times, in order: `import torch`; making the
inputs on the GPU (CUDA context creation, not flash4's); torch's own first backward with an explicit
gradient (a torch-only op: torch imports sympy there, ~2 s, whatever the op); `import flash4`; the first forward +
backward (dense bf16, batch 2 x 1024, 16 heads, d128, causal) and a decode step
(flash_attn_with_kvcache, 1 query over 8k keys), each with a synchronize. flash4's warm start is
import flash4 + first step; the target is <= 0.3 s. It also prints how many kernels were loaded /
compiled (a compile in a measured process means the cache missed) and whether the CuTe DSL
(`cutlass`) was imported. --runtime-load picks FLASH4_RUNTIME_LOAD (0: the object files through the
CuTe DSL's loader; 1: shared libraries through TVM-FFI alone); default: both, in that order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0

t0 = time.perf_counter()
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v, dout = (torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_()
qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
kc, vc = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
lens = torch.full((1,), 8000, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
t_inputs = time.perf_counter() - t0

# torch's own first backward with an explicit gradient: torch.autograd._make_grads imports
# torch.fx.experimental.symbolic_shapes (and sympy, ~2 s on the H200 host) the first time any
# .backward(grad) runs in a process, whatever the op; a training step's loss.backward() does not
# take that path. Paid here, by a torch-only op, so the flash4 steps below measure flash4 alone.
t0 = time.perf_counter()
x = torch.ones(4, device="cuda", requires_grad=True)
(x * 2).backward(torch.ones_like(x))
torch.cuda.synchronize()
t_torch_backward = time.perf_counter() - t0

t0 = time.perf_counter()
import flash4
t_import = time.perf_counter() - t0

import os
prof = None
if os.environ.get("WARM_START_PROFILE"):
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t0 = time.perf_counter()
out = flash4.flash_attn_func(q, k, v, causal=True)
out.backward(dout)
torch.cuda.synchronize()
t_fwd_bwd = time.perf_counter() - t0
if prof is not None:
    import io, pstats
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(25)
    stats.sort_stats("tottime").print_stats(12)
    print(text.getvalue(), file=sys.stderr)
t0 = time.perf_counter()
out = flash4.flash_attn_func(q, k, v, causal=True)
out.backward(dout)
torch.cuda.synchronize()
t_second = time.perf_counter() - t0

t0 = time.perf_counter()
flash4.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens)
torch.cuda.synchronize()
t_decode = time.perf_counter() - t0

from flash4.compile import disk_cache
print(json.dumps(dict(import_torch=t_torch, cuda_inputs=t_inputs, torch_first_backward=t_torch_backward, import_flash4=t_import, first_fwd_bwd=t_fwd_bwd, second_fwd_bwd=t_second,
                      first_decode=t_decode, counts=dict(disk_cache.counts),
                      cutlass_imported="cutlass" in sys.modules)))
"""


def run_child(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=1800)
    if env.get("WARM_START_PROFILE"):
        print(proc.stderr[-12000:])
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="compile cache directory (default: a fresh temporary one, "
                                                           "so the fill step compiles everything: minutes)")
    parser.add_argument("--runtime-load", choices=("0", "1"), default=None, help="FLASH4_RUNTIME_LOAD (default: both)")
    parser.add_argument("--profile", action="store_true", help="cProfile the first forward + backward of the last "
                        "measured process and print its top entries")
    parser.add_argument("--repeat", type=int, default=2, help="measured processes per setting")
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="flash4-warm-")
    # PYTHONPYCACHEPREFIX: the fill process's bytecode is reused by the measured ones wherever it is
    # written. On the H200 (2026-12-02, night) a measured process still spent 0.095 s of a 0.208 s
    # first step compiling 68 modules (TVM-FFI's, flash4's lazily imported ones) from source: the
    # unpacked device deps' / copied tree's bytecode was not reused (cause not established). An
    # installed package has its .pyc from pip's install step, so a user's warm process never pays it.
    # PYTHONDONTWRITEBYTECODE (set in some sandboxes: the CPU box of 2026-12-03 has it) makes the fill
    # write no bytecode at all, so every measured process compiles from source whatever the prefix:
    # a likely cause of the H200 profile's 68 compiles (not checked there). The children drop it.
    base = dict(os.environ, FLASH4_CACHE_DIR=cache_dir, PYTHONPYCACHEPREFIX=os.path.join(cache_dir, "pycache"),
                PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base.pop("PYTHONDONTWRITEBYTECODE", None)
    settings = [args.runtime_load] if args.runtime_load else ["0", "1"]
    print(f"cache: {cache_dir}")
    for setting in settings:
        env = dict(base, FLASH4_RUNTIME_LOAD=setting)
        fill = run_child(env)  # compiles (or loads, and with 1 links the shared libraries)
        print(f"FLASH4_RUNTIME_LOAD={setting}  fill: {fill['counts']}")
        for i in range(args.repeat):
            profile = args.profile and i == args.repeat - 1
            r = run_child(dict(env, WARM_START_PROFILE="1") if profile else env)
            warm = r["import_flash4"] + r["first_fwd_bwd"]
            print(f"  import torch {r['import_torch']:.2f} s | CUDA + inputs {r['cuda_inputs']:.2f} s | "
                  f"torch's first backward(grad) {r['torch_first_backward']:.2f} s | import flash4 {r['import_flash4']:.3f} s | first fwd+bwd {r['first_fwd_bwd']:.3f} s "
                  f"(second {r['second_fwd_bwd']:.3f} s) | "
                  f"first decode {r['first_decode']:.3f} s | warm start (import + fwd+bwd) {warm:.3f} s "
                  f"(target 0.3) | kernels {r['counts']} | cutlass imported: {r['cutlass_imported']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
