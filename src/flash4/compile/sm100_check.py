"""`python -m flash4 compile-check --arch sm_100a`: the sm100 (Blackwell) forward's compile report.

No GPU is needed: CuTe DSL compiles sm_100a kernels on the CPU and cuobjdump reads their SASS. Per
config it reports the setmaxnreg budget of each warp role (from the PTX, checked against
flash4.config.sm100.register_plan), the tensor-memory columns (used by tmem_map / allocated by
tcgen05.alloc, the PTX operand checked against tmem_alloc_cols), shared memory, the SASS opcode
counts of the design (UTCHMMA, UTCBAR, LDTM, STTM, UTMALDG, UTMASTG, MUFU.EX2, FFMA2, FADD2.RM,
MUFU.TANH), local memory (LDL/STL lines, stack) and the compile time. Every line of it is
"compile-verified for sm_100a, not yet run on Blackwell hardware": nothing here executes a kernel.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import traceback
from pathlib import Path

LABEL = "compile-verified for sm_100a, not yet run on Blackwell hardware"
# SASS opcode columns of the report: (header, resource_usage key).
OPCODES = (("UTCHMMA", "utchmma"), ("UTCHMMA.2CTA", "utchmma_2cta"), ("UTCBAR", "utcbar"), ("LDTM", "ldtm"), ("STTM", "sttm"),
           ("UTMALDG", "utmaldg"), ("UTMASTG", "utmastg"), ("MUFU.EX2", "mufu_ex2"), ("FFMA2", "ffma2"),
           ("FADD2.RM", "fadd2_rm"), ("MUFU.TANH", "mufu_tanh"))


def setmaxnreg_operands(ptx: str) -> list[tuple[str, int]]:
    """The (inc|dec, registers) operands of every setmaxnreg in a PTX text, sorted."""
    return sorted((kind, int(n)) for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx))


def tmem_alloc_operands(ptx: str) -> list[int]:
    """The column operand of every tcgen05.alloc (an immediate moved into the register it names)."""
    cols = []
    for reg in re.findall(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]+\],\s*(%r\d+);", ptx):
        cols += [int(v) for v in re.findall(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx)]
    return cols


def configs(headdims=None, dtypes=None, causals=None, features: bool = False) -> list:
    """The shipped sm100 forward configs (flash4.config.sm100.shipped_fwd_configs; with features
    also the window / softcap / sink variants), filtered by head dim, dtype and causal."""
    from flash4.config import sm100

    return [c for c in sm100.shipped_fwd_configs(features=features)
            if (headdims is None or c.headdim in headdims) and (dtypes is None or c.dtype in dtypes)
            and (causals is None or c.causal in causals)]


def name(cfg) -> str:
    flags = "".join(f" {f}" for f in ("local", "softcap", "sink") if getattr(cfg, f))
    return (f"fwd_sm100 d{cfg.headdim} {cfg.dtype} {'causal' if cfg.causal else 'full'} "
            f"{cfg.q_stage}x{cfg.tile_m}x{cfg.tile_n} {cfg.cta_group}cta {cfg.kv_stages}st emu{cfg.exp2_emu_frac:g}{flags}")


def check_one(cfg) -> dict:
    """Compile one sm100 config and read its PTX and SASS: the report's row (a compile error is a
    result: ok False, error set)."""
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage
    from flash4.config.sm100 import register_plan, tmem_alloc_cols, tmem_used_cols

    plan = register_plan(cfg)
    row = {"config": name(cfg), "ok": False, "error": None, "compile_s": None, "label": LABEL, "cta_group": cfg.cta_group,
           "regs_softmax": plan.softmax, "regs_correction": plan.correction, "regs_other": plan.other,
           "tmem_used": tmem_used_cols(cfg), "tmem_alloc": tmem_alloc_cols(cfg), "smem_bytes": cfg.smem_bytes()}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        with tempfile.TemporaryDirectory() as dump:
            compiled = compile_fwd(cfg, options=f" --keep-ptx --dump-dir {dump}")
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            row["compile_cpu_s"] = round(time.process_time() - c0, 2)  # this process's CPU (a loaded box: < wall)
            ptx = compiled.__ptx__
            ptx = Path(ptx).read_text() if ptx and "\n" not in ptx and Path(ptx).is_file() else (ptx or "")
        want = plan.setmaxnreg_sites()
        row["setmaxnreg_ok"] = setmaxnreg_operands(ptx) == want
        row["tmem_alloc_ok"] = tmem_alloc_operands(ptx) == [row["tmem_alloc"]]
        cubin = extract_cubin(compiled)
        if cubin is not None:
            row.update(resource_usage(cubin))
        row["ok"] = True
    except Exception as e:  # noqa: BLE001  (a compile failure is a result here)
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-4000:]
    return row


def problems(row: dict) -> list[str]:
    """What fails the check in one row: a compile error, local memory, a setmaxnreg / alloc operand
    that differs from the plan, a Hopper opcode, a tcgen05 MMA whose .2CTA form differs from the
    config's cta_group."""
    if not row["ok"]:
        return [f"compile error: {row['error'].splitlines()[0][:200]}"]
    out = []
    if row.get("spills") or row.get("stack_bytes"):
        out.append(f"local memory: {row.get('spills')} LDL/STL, stack {row.get('stack_bytes')} bytes")
    if not row.get("setmaxnreg_ok"):
        out.append("setmaxnreg operands differ from register_plan")
    if not row.get("tmem_alloc_ok"):
        out.append("tcgen05.alloc columns differ from tmem_alloc_cols")
    if row.get("hgmma"):
        out.append(f"{row['hgmma']} HGMMA (a Hopper opcode) in an sm_100a kernel")
    if row.get("utchmma") is not None:
        two = row.get("cta_group", 1) == 2
        if row.get("utchmma_2cta", 0) != (row["utchmma"] if two else 0):
            out.append(f"{row.get('utchmma_2cta', 0)} of {row['utchmma']} UTCHMMA are .2CTA in a "
                       f"{row.get('cta_group', 1)}-CTA config (.2CTA exactly where the config says 2-CTA)")
    return out


def main(cfgs: list, json_path=None) -> int:
    """Compile `cfgs`, print the report (the label first), write JSON if asked. Returns 1 if any
    config fails (problems), else 0."""
    from flash4.bench.report import format_table, progress

    print(f"compile check, sm_100a: {len(cfgs)} forward config(s), {LABEL}")
    if not cfgs:
        print("no sm100 config matches the filters (head dims 64, 96, 128, 192 (Dv 128), 256; bf16, fp16)")
        return 1
    rows = []
    bar = progress(len(cfgs), "compile", "cfg")
    for cfg in cfgs:
        rows.append(check_one(cfg))
        bar.set_postfix_str(f"{rows[-1]['config']}: {'ok' if rows[-1]['ok'] else 'FAILED'} {rows[-1]['compile_s']} s")
        bar.update()
    bar.close()
    headers = (["config", "ok", "compile_s", "cpu_s", "regs sm/corr/other", "TMEM used/alloc", "smem KiB", "LDL/STL", "stack"]
               + [h for h, _ in OPCODES])
    table = [[r["config"], r["ok"], r["compile_s"], r.get("compile_cpu_s"), f"{r['regs_softmax']}/{r['regs_correction']}/{r['regs_other']}",
              f"{r['tmem_used']}/{r['tmem_alloc']}", round(r["smem_bytes"] / 1024, 1), r.get("spills"),
              r.get("stack_bytes")] + [r.get(key) for _, key in OPCODES] for r in rows]
    print(format_table(headers, table))
    bad = [(r["config"], p) for r in rows for p in problems(r)]
    for config, problem in bad:
        print(f"FAIL {config}: {problem}")
    if any(r["ok"] and r.get("utchmma") is None for r in rows):
        print("note: SASS not read (cuobjdump not found: pip install nvidia-cuda-cuobjdump)")
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(rows, indent=2))
        print(f"wrote {json_path}")
    print(f"{len(rows) - len({c for c, _ in bad})}/{len(rows)} config(s) pass; {LABEL} (no speed is claimed)")
    return 1 if bad else 0
