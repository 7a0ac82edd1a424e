"""Side-by-side SASS instruction mix of flash4's sm100 (Blackwell) kernels and flash-attn-4's, per
kernel and shape, compiled on the CPU (no GPU): forward hd64 / hd128, full and causal; backward hd64,
hd128. A sanity reference for a human (issues 22 and 23), and the tables of docs/design/
sm100_forward.md section 6 and sm100_backward.md section 5 ("Side by side with flash-attn-4"). Counts are static SASS instruction sites (cuobjdump), not executed
instructions; an opcode counts with its suffixes (UTCHMMA includes UTCHMMA.2CTA).

    pip install --no-deps --target /tmp/fa4 flash-attn-4==4.0.0b36 quack-kernels==0.6.5 einops
    PYTHONPATH=src python tools/fa4_sass_mix.py                 # both halves (FA4 from /tmp/fa4)
    PYTHONPATH=src python tools/fa4_sass_mix.py --flash4-only   # flash4's half
    PYTHONPATH=src python tools/fa4_sass_mix.py --kernels fwd128c,bwd128 --fa4-path DIR --json out.json

flash-attn-4 is the competitor, never a dependency: flash4's package code never imports this tool,
and this tool imports FA4 only from --fa4-path (default $FA4_PATH or /tmp/fa4). Without FA4 it says
so, prints flash4's half and exits 0. FA4 is driven as /work/shared/design/BLACKWELL.md section 3
and CUTE_CPU_COMPILE.md section 2.4 describe: its `_flash_attn_fwd` / `_flash_attn_bwd` on fake bf16
tensors (2, 1024, 8, hd) inside torch's FakeTensorMode, FLASH_ATTENTION_ARCH=sm_100a,
FLASH_ATTENTION_NUM_SMS=148, a no-op quack.autotuner (it imports triton) and a stub for
cutlass.utils.HardwareInfo (FA4's persistent scheduler asks the driver); cute.compile is wrapped to
catch what FA4 compiles, and the backward's main kernel is the largest of its compiles (the others
are its pre/postprocess). FA4 picks its own configs (2-CTA for the non-causal hd128 forward and
the hd128 backward); flash4's are the ones its API selects (flash4.config.sm100.select_fwd_config /
select_bwd_config), compiled as `python -m flash4 compile-check --arch sm_100a` compiles them
(flash4.compile.cache); a config select_*_config refuses is a row carrying its message.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_100a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "148")  # B200
os.environ.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)  # a cache hit would compile nothing

# SASS opcode columns: (header, regex over the cuobjdump listing).
OPCODES = (
    ("UTCHMMA", r"\bUTCHMMA\b"),  # tcgen05.mma kind::f16, with .2CTA
    ("UTCHMMA.2CTA", r"\bUTCHMMA\.2CTA\b"),
    ("UTCBAR", r"\bUTCBAR\b"),  # tcgen05.commit
    ("LDTM", r"\bLDTM\b"),  # tcgen05.ld
    ("STTM", r"\bSTTM\b"),  # tcgen05.st
    ("UTMALDG", r"\bUTMALDG\b"),  # TMA load
    ("MUFU.EX2", r"\bMUFU\.EX2\b"),
    ("FFMA2", r"\bFFMA2\b"),  # fma.rn.f32x2 (the exp2 polynomial, packed FMAs)
    ("FADD2.RM", r"\bFADD2\.RM\b"),  # add.rm.f32x2: the polynomial's range reduction
    ("UBLKRED", r"\bUBLKRED\b"),  # cp.reduce.async.bulk (the dQ reduce-add)
    ("UBLKCP", r"\bUBLKCP\b"),  # cp.async.bulk, any direction (FA4: .S.G loads of LSE / dPsum)
    ("UBLKCP.S.S", r"\bUBLKCP\.S\.S\b"),  # smem -> peer smem (2-CTA: the DSMEM dS exchange)
    ("LDL/STL", r"\b(?:LDL|STL)\b"),  # local memory (spills)
)
# name -> (pass, head dim, causal)
KERNELS = {"fwd64": ("fwd", 64, False), "fwd64c": ("fwd", 64, True), "fwd128": ("fwd", 128, False),
           "fwd128c": ("fwd", 128, True), "bwd64": ("bwd", 64, False), "bwd128": ("bwd", 128, False),
           "bwd64c": ("bwd", 64, True), "bwd128c": ("bwd", 128, True)}
DEFAULT_KERNELS = ("fwd64", "fwd64c", "fwd128", "fwd128c", "bwd64", "bwd128")
FAKE_SHAPE = (2, 1024, 8)  # batch, seqlen, heads of the fake tensors FA4 compiles for


def sass_mix(cubin: bytes) -> dict:
    """Opcode counts (OPCODES), SASS instruction lines, STACK bytes and kernel names of a cubin."""
    from flash4.compile.check import _cuobjdump, sass_text

    sass = sass_text(cubin)
    if sass is None:
        raise SystemExit("no cuobjdump: pip install nvidia-cuda-cuobjdump")
    mix = {name: len(re.findall(rx, sass)) for name, rx in OPCODES}
    mix["SASS lines"] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    stacks = [int(s) for s in re.findall(r"STACK:(\d+)", res)]
    mix["STACK"] = max(stacks) if stacks else None
    mix["kernels"] = re.findall(r"Function : (\S+)", sass)
    return mix


# ---------------------------------------------------------------- flash4's half

def flash4_mix(pass_: str, headdim: int, causal: bool) -> dict:
    """flash4's sm100 kernel for (pass, headdim, causal, bf16): {"config", "mix"} or {"absent": why}."""
    from flash4.compile.check import extract_cubin

    from flash4.config import sm100

    try:  # the config flash4's API runs for this shape
        cfg = (sm100.select_fwd_config if pass_ == "fwd" else sm100.select_bwd_config)(headdim, "bf16", causal)
    except ValueError as e:
        return {"absent": f"flash4: {e}"}
    from flash4.compile.cache import compile_bwd, compile_fwd
    from flash4.compile.sm100_check import name as config_name

    compile_ = compile_fwd if pass_ == "fwd" else compile_bwd
    name = config_name(cfg)
    cubin = extract_cubin(compile_(cfg))
    if cubin is None:
        return {"absent": f"{name}: no cubin in the compiled module"}
    return {"config": name, "mix": sass_mix(cubin)}


# ---------------------------------------------------------------- flash-attn-4's half

class _HardwareInfo:
    """cutlass.utils.HardwareInfo without a driver: FA4's persistent scheduler asks for the SM count."""

    def __init__(self, *a, **k):
        pass

    def get_device_multiprocessor_count(self):
        return int(os.environ["FLASH_ATTENTION_NUM_SMS"])

    def get_max_active_clusters(self, cluster_size):
        return int(os.environ["FLASH_ATTENTION_NUM_SMS"]) // cluster_size


def load_fa4(path: str | None):
    """Import flash-attn-4's interface from `path` (stubs installed first): (module, version) or
    (None, why)."""
    if path and os.path.isdir(path) and path not in sys.path:
        sys.path.append(path)
    stubbed = "quack.autotuner" not in sys.modules
    if stubbed:  # quack.autotuner imports triton; compiling needs none of it
        autotuner = types.ModuleType("quack.autotuner")
        autotuner.autotune = lambda *a, **k: (lambda f: f)
        autotuner.AutotuneConfig = type("AutotuneConfig", (), {"__init__": lambda self, *a, **k: None})
        sys.modules["quack.autotuner"] = autotuner
    try:
        import cutlass.utils
        import cutlass.utils.hardware_info

        import flash_attn.cute.interface as fi
        import flash_attn.cute.tile_scheduler as ts
    except ImportError as e:
        if stubbed:
            del sys.modules["quack.autotuner"]
        return None, f"flash-attn-4 not importable from {path!r} ({e})"
    cutlass.utils.HardwareInfo = cutlass.utils.hardware_info.HardwareInfo = ts.HardwareInfo = _HardwareInfo
    from importlib import metadata

    try:
        version = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        version = "?"
    return fi, version


@contextlib.contextmanager
def catching_compiles():
    """Within it, every cute.compile result (FA4 calls both cute.compile(...) and
    cute.compile[options](...)) is also appended to the yielded list."""
    import cutlass.cute as cute

    caught, real = [], cute.compile

    class Catch:
        def __getitem__(self, key):
            inner = real[key]
            return lambda *a, **k: caught.append(inner(*a, **k)) or caught[-1]

        def __call__(self, *a, **k):
            caught.append(real(*a, **k))
            return caught[-1]

    cute.compile = Catch()
    try:
        yield caught
    finally:
        cute.compile = real


def fa4_mix(fi, pass_: str, headdim: int, causal: bool) -> dict:
    """FA4's sm100 kernel for (pass, headdim, causal, bf16) on FAKE_SHAPE: {"config", "mix"}."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash4.compile.check import extract_cubin

    with catching_compiles() as caught, FakeTensorMode():
        b, s, h = FAKE_SHAPE
        q, k, v = (torch.empty(b, s, h, headdim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        if pass_ == "fwd":
            fi._flash_attn_fwd(q, k, v, causal=causal, return_lse=True)
        else:
            out, dout = torch.empty_like(q), torch.empty_like(q)
            lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
            fi._flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)
    if not caught:
        raise RuntimeError("flash-attn-4 compiled nothing (an in-memory cache hit?)")
    mixes = [sass_mix(c) for c in (extract_cubin(c) for c in caught) if c is not None]
    main = max(mixes, key=lambda m: m["SASS lines"])  # bwd: the main kernel, not the pre/postprocess
    return {"config": f"{pass_} d{headdim} bf16 {'causal' if causal else 'full'} ({len(caught)} compile(s))",
            "mix": main}


# ---------------------------------------------------------------- the table

def versions(fa4_version: str | None) -> dict:
    import cutlass

    import flash4

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "?"
    except OSError:
        rev = "?"
    return {"date": datetime.date.today().isoformat(), "flash4": f"{getattr(flash4, '__version__', '?')} @ {rev}",
            "flash-attn-4": fa4_version, "nvidia-cutlass-dsl": getattr(cutlass, "__version__", "?"),
            "arch": os.environ["CUTE_DSL_ARCH"]}


def format_rows(rows: list[dict]) -> str:
    """A markdown table: one row per (kernel, side), the OPCODES columns, SASS lines and STACK."""
    heads = ["kernel", "side", "config"] + [n for n, _ in OPCODES] + ["SASS lines", "STACK"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * 3 + "---:|" * (len(heads) - 3)]
    for r in rows:
        for side in ("flash4", "FA4"):
            got = r.get(side)
            if got is None:
                continue
            if "mix" in got:
                cells = [str(got["mix"][n]) for n, _ in OPCODES] + [str(got["mix"]["SASS lines"]), str(got["mix"]["STACK"])]
                config = got["config"]
            else:
                cells = ["-"] * (len(OPCODES) + 2)
                config = got["absent"]
            lines.append("| " + " | ".join([r["kernel"], side, config] + cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(DEFAULT_KERNELS),
                    help=f"comma-separated, of {', '.join(KERNELS)} (c = causal); default {','.join(DEFAULT_KERNELS)}")
    ap.add_argument("--fa4-path", default=os.environ.get("FA4_PATH", "/tmp/fa4"),
                    help="directory flash-attn-4 (+ quack-kernels, einops) was installed into with pip --target")
    ap.add_argument("--flash4-only", action="store_true", help="skip flash-attn-4")
    ap.add_argument("--json", help="also write the rows (with versions) to this JSON file")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    bad = [n for n in names if n not in KERNELS]
    if bad:
        ap.error(f"unknown kernel(s) {bad}; choose from {list(KERNELS)}")

    rows = []
    for n in names:  # flash4 first: FA4's stubs and imports never touch flash4's compiles
        pass_, hd, causal = KERNELS[n]
        try:
            got = flash4_mix(pass_, hd, causal)
        except Exception as e:  # noqa: BLE001  (a compile failure is a row)
            got = {"absent": f"compile error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        rows.append({"kernel": n, "flash4": got})
    fa4_version = None
    if args.flash4_only:
        print("flash-attn-4: skipped (--flash4-only)")
    else:
        fi, fa4_version = load_fa4(args.fa4_path)
        if fi is None:
            print(f"flash-attn-4: absent, {fa4_version}; flash4's half only. Install it with: pip install --no-deps "
                  f"--target {args.fa4_path} flash-attn-4==4.0.0b36 quack-kernels==0.6.5 einops")
            fa4_version = None
        else:
            for row in rows:
                pass_, hd, causal = KERNELS[row["kernel"]]
                try:
                    row["FA4"] = fa4_mix(fi, pass_, hd, causal)
                except Exception as e:  # noqa: BLE001
                    row["FA4"] = {"absent": f"compile error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    meta = versions(fa4_version)
    print("sm_100a SASS mix, bf16, static instruction sites (cuobjdump); compile-verified for sm_100a, "
          "not run on Blackwell hardware")
    print(", ".join(f"{k} {v}" for k, v in meta.items() if v is not None))
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": meta, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
