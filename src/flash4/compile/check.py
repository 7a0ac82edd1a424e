"""CPU-only compile check: build kernels for their target (sm_90a; the sm80 family's configs for
theirs) from fake tensors and report what the hardware would get (registers, spills, shared
memory, HGMMA/TMA or HMMA/LDSM/LDGSTS presence) and how long it took.

The cubin is read out of the compiled module (the DSL embeds it as `@kernels_binary`), then
`cuobjdump` (PyPI: nvidia-cuda-cuobjdump) reports resource usage and SASS. Without cuobjdump
the compile itself is still checked and the resource columns are None.
"""

from __future__ import annotations

import dataclasses
from functools import partial
import os
import re
import shutil
import subprocess
import tempfile
import time
import traceback

from flash4.compile.jit import export_only
from flash4.config import BwdConfig, FwdConfig, shipped_bwd_configs, shipped_fwd_configs


def _cuobjdump() -> str | None:
    path = shutil.which("cuobjdump")
    if path:
        return path
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        for base in nvidia.__path__:
            for sub in ("cu13", "cuda_cuobjdump", "cu12"):
                cand = os.path.join(base, sub, "bin", "cuobjdump")
                if os.path.exists(cand):
                    return cand
    except ImportError:
        pass
    return None


def sass_text(cubin: bytes) -> str | None:
    """cuobjdump --dump-sass of a cubin, or None without cuobjdump."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True).stdout


def _decode_mlir_string(body: str) -> bytes:
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            nxt = body[i + 1]
            if nxt in "0123456789abcdefABCDEF":
                out.append(int(body[i + 1 : i + 3], 16))
                i += 3
                continue
            out.append(ord(nxt))
            i += 2
            continue
        out.append(ord(ch))
        i += 1
    return bytes(out)


def extract_cubin(compiled) -> bytes | None:
    """The ELF cubin embedded in a compiled function's host module, or None."""
    text = str(compiled.ir_module)
    m = re.search(r'@kernels_binary\("((?:[^"\\]|\\.)*)"', text)
    if not m:
        return None
    blob = _decode_mlir_string(m.group(1))
    start = blob.find(b"\x7fELF")
    return blob[start:] if start >= 0 else None


def resource_usage(cubin: bytes) -> dict:
    """{registers, spills (bytes stored+loaded), smem_static, hgmma, utmaldg, utmastg, mufu_ex2,
    wgmma_serialized} via cuobjdump, and the sm_100a opcodes (sass_counts): utchmma (with .2CTA),
    utchmma_2cta, utcbar (utcbar_2cta_multicast), ldtm, sttm, utcatomsws (utcatomsws_2cta), ffma2, fadd2_rm,
    and utmaldg_2cta. On sm_100a `registers` is the launch cap
    (65536 / threads); the setmaxnreg budgets are in the PTX."""
    tool = _cuobjdump()
    if tool is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
        run = partial(subprocess.run, capture_output=True, text=True, env=env)
        res = run([tool, "--dump-resource-usage", path]).stdout
        sass = run([tool, "--dump-sass", path]).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    smem = re.search(r"SHARED:(\d+)", res)
    spill_st = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", res))
    local = len(re.findall(r"\b(LDL|STL)\b", sass))
    return {
        "registers": int(regs.group(1)) if regs else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "smem_static": int(smem.group(1)) if smem else None,
        "spills": local + spill_st,
        "hgmma": len(re.findall(r"\bHGMMA\b", sass)),
        "utmaldg": len(re.findall(r"\bUTMALDG\b", sass)),
        "utmaldg_2cta": len(re.findall(r"\bUTMALDG\.\w+\.2CTA\b", sass)),  # sm_100a .cta_group::2 TMA loads
        "utmastg": len(re.findall(r"\bUTMASTG\b", sass)),
        "mufu_ex2": len(re.findall(r"MUFU\.EX2", sass)),
        "mufu_tanh": len(re.findall(r"MUFU\.TANH", sass)),
        # The portable (sm80) family's instructions, and the ones it must not contain.
        "hmma_16816": len(re.findall(r"\bHMMA\.16816\.", sass)),
        "ldsm": len(re.findall(r"\bLDSM\.", sass)),
        "ldgsts": len(re.findall(r"\bLDGSTS\.", sass)),
        "stsm": len(re.findall(r"\bSTSM\.", sass)),
        "utma": len(re.findall(r"\bUTMA\w*", sass)),
        "utchmma": len(re.findall(r"\bUTCHMMA\b", sass)),
        "sass_arch": (re.search(r"code for (sm_\w+)", sass) or [None, None])[1],
        # ptxas C7512 ("wgmma.mma_async instructions are serialized due to insufficient register
        # resources"): it then fences every HGMMA on its own (WARPGROUP.ARRIVE before and
        # WARPGROUP.DEPBAR after each), so no GEMM overlaps anything. Unserialized kernels have one
        # arrive per GEMM (4-8 HGMMAs); serialized ones one per HGMMA.
        "wgmma_serialized": _wgmma_serialized(sass),
        **sass_counts(sass),
    }


# sm_100a (tcgen05) opcodes: SASS name -> row key. UTCHMMA = tcgen05.mma kind::f16, UTCBAR =
# tcgen05.commit, LDTM / STTM = tcgen05.ld / st, UTCATOMSWS = tcgen05.alloc / dealloc / relinquish;
# FFMA2 / FADD2.RM = fma / add.rm .f32x2 (FADD2.RM: one per pair of the exp2 polynomial's range reduction).
# The .2CTA forms are the .cta_group::2 instructions of a 2-CTA kernel (UTCBAR.2CTA.MULTICAST: a commit
# multicast to the pair's barriers).
SM100_OPCODES = {"UTCHMMA": "utchmma", "UTCHMMA.2CTA": "utchmma_2cta", "UTCBAR": "utcbar",
                 "UTCBAR.2CTA.MULTICAST": "utcbar_2cta_multicast", "LDTM": "ldtm", "STTM": "sttm",
                 "UTCATOMSWS": "utcatomsws", "UTCATOMSWS.2CTA": "utcatomsws_2cta", "FFMA2": "ffma2",
                 "FADD2.RM": "fadd2_rm"}


def sass_counts(sass: str) -> dict:
    """Counts of the sm_100a opcodes (SM100_OPCODES) in a SASS listing; an opcode counts with its
    suffixes (UTCHMMA includes UTCHMMA.2CTA)."""
    return {key: len(re.findall(rf"\b{re.escape(op)}\b", sass)) for op, key in SM100_OPCODES.items()}


def _wgmma_serialized(sass: str) -> bool:
    """True when ptxas serialized the kernel's wgmmas (C7512): one WARPGROUP.ARRIVE per HGMMA."""
    hgmma = len(re.findall(r"\bHGMMA\b", sass))
    arrive = len(re.findall(r"WARPGROUP\.ARRIVE", sass))
    return hgmma > 8 and arrive >= 0.9 * hgmma


def compile_check(configs: list | None = None, compiler=None) -> list[dict]:
    """Compile each config (default: every shipped forward and backward config) on this machine.

    compiler: config -> compiled function (default: flash4.compile.cache's compile_fwd /
    compile_bwd by config type); e.g. flash4.compile.sm80_driver.compile_fwd for the sm80 family.
    Returns one dict per config: config, ok, error, compile_s, registers, spills (count of local
    memory instructions in SASS), smem_bytes (dynamic, from the config), and the SASS opcode counts
    of resource_usage.
    """
    if compiler is None:
        from flash4.compile.cache import compile_bwd, compile_fwd

        def compiler(cfg):
            return compile_bwd(cfg) if _is_bwd(cfg) else compile_fwd(cfg)

    rows = []
    for cfg in configs if configs is not None else shipped_fwd_configs() + shipped_bwd_configs():
        row = {"config": _short(cfg), "ok": False, "error": None, "compile_s": None,
               "registers": None, "spills": None, "smem_bytes": cfg.smem_bytes()}
        t0 = time.perf_counter()
        try:
            with export_only():  # the cubin is all that is read: no JIT engine (flash4.compile.jit)
                compiled = compiler(cfg)
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            cubin = extract_cubin(compiled)
            if cubin is not None:
                row.update(resource_usage(cubin))
            row["ok"] = True
        except Exception as e:  # a compile failure is a result here, not a crash
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]
        rows.append(row)
    return rows


def _is_bwd(cfg) -> bool:
    """A backward config of any family (flash4.config.BwdConfig, flash4.config.sm80.Sm80BwdConfig)."""
    return type(cfg).__name__.endswith("BwdConfig")


def _short(cfg) -> str:
    d = dataclasses.asdict(cfg)
    hd = f"{d['headdim']}" if d.get("headdim_v") is None else f"{d['headdim']}v{d['headdim_v']}"
    if _is_bwd(cfg):
        family = "bwd_portable" if "num_warps" in d else "bwd"  # the sm80 family's configs have num_warps
        return (f"{family}_sm{d['arch']} d{hd} {d['dtype']} {'causal' if d['causal'] else 'full'} "
                f"{d['tile_m']}x{d['tile_n']}x{d['q_stages']}st{' det' if d['deterministic'] else ''}"
                f"{' dkv-accum' if d['dkv_accum'] else ''}{' dkvT' if d.get('transposed_dkv') else ''}"
                f"{' window' if d.get('local') else ''}")
    extras = "".join([f" w{d['num_warps']}" if "num_warps" in d else "", " qregs" if d.get("q_in_regs") else "",
                      " persist" if d["persistent"] else "", " lpt" if d["lpt"] else "",
                      f" emu{d['exp2_emu_frac']:g}" if d["exp2_emu_frac"] else "",
                      f" tau{d['rescale_threshold']:g}" if d["rescale_threshold"] != 8.0 else "",
                      " vote-first" if d.get("softmax_vote_first") else "", " window" if d.get("local") else "",
                      " lookahead" if d.get("lookahead_qk") else "", " p-smem" if d.get("p_smem") else ""])
    family = "fwd_portable" if "num_warps" in d else "fwd"  # the sm80 family's configs have num_warps
    return (f"{family}_sm{d['arch']} d{hd} {d['dtype']} {'causal' if d['causal'] else 'full'} "
            f"{d['tile_m']}x{d['tile_n']}x{d['kv_stages']}st{extras}")


def format_table(rows: list[dict]) -> str:
    head = f"{'config':56s} {'ok':>3s} {'sec':>5s} {'regs':>4s} {'spill':>5s} {'smem KiB':>8s} {'HGMMA':>5s} {'TMA':>4s}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['config']:56s} {'yes' if r['ok'] else 'NO':>3s} {r['compile_s'] or 0:5.2f} "
            f"{r.get('registers') or '-':>4} {r.get('spills') if r.get('spills') is not None else '-':>5} "
            f"{r['smem_bytes'] / 1024:8.1f} {r.get('hgmma', '-'):>5} {r.get('utmaldg', '-'):>4}"
        )
        if r["error"]:
            lines.append("    error: " + r["error"].splitlines()[0][:200])
    return "\n".join(lines)
