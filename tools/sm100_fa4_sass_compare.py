"""Side-by-side SASS mix of flash4's sm100 forward and flash-attn-4's for the same shape, compiled on
the CPU (no GPU). A sanity reference for a human, not a CI test: it needs flash-attn-4 and its
dependencies, which flash4 does not depend on.

    pip install --target /tmp/fa4pkgs --no-deps flash_attn_4-4.0.0b36-py3-none-any.whl \
        quack-kernels==0.6.5 einops torch-c-dlpack-ext      # apache-tvm-ffi and torch are flash4's
    PYTHONPATH=src:/tmp/fa4pkgs python tools/sm100_fa4_sass_compare.py --headdim 128 --causal

FA4 is driven as BLACKWELL.md section 3 describes: `_flash_attn_fwd` on fake bf16 tensors inside
torch's FakeTensorMode, FLASH_ATTENTION_ARCH=sm_100a, FLASH_ATTENTION_NUM_SMS=148, a no-op
quack.autotuner (it imports triton), and (non-causal, FA4's persistent scheduler) a stub for
cutlass.utils.HardwareInfo. cute.compile is wrapped to catch FA4's compiled forward.
Counts are static SASS instruction sites (cuobjdump), not executed instructions.
"""

from __future__ import annotations

import argparse
import os
import sys
import types

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_100a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "148")

OPCODES = ("UTCHMMA", "UTCHMMA.2CTA", "UTCBAR", "LDTM", "STTM", "UTMALDG", "UTMASTG", "UTCATOMSWS", "MUFU.EX2",
           "FFMA2", "FADD2", "FMUL2", "SYNCS", "LDL", "STL")


def sass_mix(compiled) -> dict:
    import re
    import subprocess
    import tempfile

    from flash4.compile.check import _cuobjdump, extract_cubin

    cubin, tool = extract_cubin(compiled), _cuobjdump()
    if cubin is None or tool is None:
        raise SystemExit("no cubin in the compiled module, or no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    mix = {op: len(re.findall(rf"\b{re.escape(op)}\b", sass)) for op in OPCODES}
    mix["lines"] = sum(1 for line in sass.splitlines() if line.strip().startswith("/*"))
    stack = re.search(r"STACK:(\d+)", res)
    mix["STACK"] = int(stack.group(1)) if stack else None
    return mix


def flash4_mix(headdim: int, causal: bool) -> dict:
    from flash4.compile.cache import compile_fwd
    from flash4.config.sm100 import select_fwd_config

    return sass_mix(compile_fwd(select_fwd_config(headdim, "bf16", causal)))


def fa4_mix(headdim: int, causal: bool) -> dict:
    import cutlass.cute as cute
    import cutlass.utils

    # quack.autotuner imports triton (not needed to compile): a no-op stand-in.
    autotuner = types.ModuleType("quack.autotuner")
    autotuner.autotune = lambda *a, **k: (lambda f: f)
    autotuner.AutotuneConfig = type("AutotuneConfig", (), {"__init__": lambda self, *a, **k: None})
    sys.modules["quack.autotuner"] = autotuner

    class HardwareInfo:  # FA4's static persistent scheduler asks the driver for the SM count
        def __init__(self, *a, **k):
            pass

        def get_device_multiprocessor_count(self):
            return int(os.environ["FLASH_ATTENTION_NUM_SMS"])

        def get_max_active_clusters(self, cluster_size):
            return int(os.environ["FLASH_ATTENTION_NUM_SMS"]) // cluster_size

    cutlass.utils.HardwareInfo = HardwareInfo
    caught = []
    real_compile = cute.compile

    class Catch:  # cute.compile[...] and cute.compile(...) both occur
        def __getitem__(self, key):
            inner = real_compile[key]
            return lambda *a, **k: caught.append(inner(*a, **k)) or caught[-1]

        def __call__(self, *a, **k):
            caught.append(real_compile(*a, **k))
            return caught[-1]

    cute.compile = Catch()
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flash_attn.cute.interface as fi
    import flash_attn.cute.tile_scheduler as ts

    ts.HardwareInfo = HardwareInfo
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 1024, 8, headdim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        fi._flash_attn_fwd(q, k, v, causal=causal, return_lse=True)
    cute.compile = real_compile
    if not caught:
        raise SystemExit("flash-attn-4 compiled nothing (cached?); unset FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")
    return sass_mix(caught[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdim", type=int, default=128, choices=(64, 96, 128))
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    ours = flash4_mix(args.headdim, args.causal)
    theirs = fa4_mix(args.headdim, args.causal)
    print(f"sm_100a forward, bf16, hd{args.headdim}, {'causal' if args.causal else 'full'} (static SASS sites)")
    print(f"{'opcode':14s} {'flash4':>8s} {'FA4':>8s}")
    for key in ours:
        print(f"{key:14s} {ours[key]!s:>8s} {theirs[key]!s:>8s}")


if __name__ == "__main__":
    main()
