"""`python -m flash4 compile-check --arch sm_100a`: the sm100 (Blackwell) forward's and backward's compile report.

No GPU is needed: CuTe DSL compiles sm_100a kernels on the CPU and cuobjdump reads their SASS. Per
config it reports the setmaxnreg budget of each warp role (from the PTX, checked against the plan:
flash4.config.sm100.register_plan for the forward's softmax / correction / other warps,
bwd_register_plan for the backward's dQ-reduce / compute / other warps), the tensor-memory columns
(used by the TMEM map / allocated by tcgen05.alloc, the PTX operand checked against the plan's
allocation), shared memory, the SASS opcode counts of the design (forward: UTCHMMA, UTCBAR, LDTM,
STTM, UTMALDG, UTMASTG, MUFU.EX2, FFMA2, FADD2.RM, MUFU.TANH; backward: UTCHMMA, UTCBAR, LDTM, STTM,
UTMALDG, UBLKRED (the dQ bulk reduce-add), UBLKCP (the LSE / dPsum bulk loads), MUFU.EX2 and the
deterministic dQ semaphore's strong LDG / REDG), local memory (LDL/STL lines, stack) and the compile
time. The forward configs are shipped_fwd_configs', the backward's shipped_bwd_configs' (what
select_bwd_config returns). Every line of it is "compile-verified for sm_100a, not yet run on
Blackwell hardware": nothing here executes a kernel.
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


# Backward SASS opcode columns: (header, row key); the keys resource_usage lacks are bwd_sass_counts'.
BWD_OPCODES = (("UTCHMMA", "utchmma"), ("UTCHMMA.2CTA", "utchmma_2cta"), ("UTCBAR", "utcbar"), ("LDTM", "ldtm"),
               ("STTM", "sttm"), ("UTMALDG", "utmaldg"), ("UBLKRED", "ublkred"), ("UBLKCP", "ublkcp"),
               ("MUFU.EX2", "mufu_ex2"), ("MUFU.TANH", "mufu_tanh"), ("LDG/REDG.STRONG", "strong_sem"))
PASSES = ("fwd", "bwd")


def configs(headdims=None, dtypes=None, causals=None, features: bool = False, passes=("fwd",)) -> list:
    """The shipped sm100 configs of `passes`, filtered by head dim, dtype and causal: the forward's
    (flash4.config.sm100.shipped_fwd_configs; with features also the window / softcap / sink
    variants), then the backward's (shipped_bwd_configs: full, causal, deterministic or not; with
    features also the sliding-window ones, whose config has causal False, and the softcap ones)."""
    from flash4.config import sm100

    def keep(c):
        return ((headdims is None or c.headdim in headdims) and (dtypes is None or c.dtype in dtypes)
                and (causals is None or c.causal in causals))

    out = []
    if "fwd" in passes:
        out += [c for c in sm100.shipped_fwd_configs(features=features) if keep(c)]
    if "bwd" in passes:
        out += [c for c in sm100.shipped_bwd_configs() if keep(c) and (features or not (c.local or c.softcap))]
    return out


def is_bwd(cfg) -> bool:
    from flash4.config.sm100 import Sm100BwdConfig

    return isinstance(cfg, Sm100BwdConfig)


def name(cfg) -> str:
    if is_bwd(cfg):
        mask = "window" if cfg.local else "causal" if cfg.causal else "full"
        dv = f"v{cfg.headdim_v}" if cfg.headdim_v is not None else ""
        return (f"bwd_sm100 d{cfg.headdim}{dv} {cfg.dtype} {mask} {cfg.tile_m}x{cfg.tile_n} {cfg.cta_group}cta "
                f"q{cfg.q_stages}do{cfg.do_stages}{' det' if cfg.deterministic else ''}"
                f"{' softcap' if cfg.softcap else ''}")
    flags = "".join(f" {f}" for f in ("local", "softcap", "sink") if getattr(cfg, f))
    return (f"fwd_sm100 d{cfg.headdim} {cfg.dtype} {'causal' if cfg.causal else 'full'} "
            f"{cfg.q_stage}x{cfg.tile_m}x{cfg.tile_n} {cfg.cta_group}cta {cfg.kv_stages}st emu{cfg.exp2_emu_frac:g}{flags}")


def bwd_sass_counts(sass: str) -> dict:
    """The backward's opcodes that resource_usage does not count: UBLKRED (cp.reduce.async.bulk, the
    dQ reduce-add), UBLKCP (cp.async.bulk), and the deterministic dQ semaphore's strong load and
    reduction (LDG.E.STRONG.GPU + REDG.E.ADD.STRONG.GPU: 3 in a deterministic config, else 0)."""
    count = lambda rx: len(re.findall(rx, sass))  # noqa: E731
    return {"ublkred": count(r"\bUBLKRED\b"), "ublkcp": count(r"\bUBLKCP\b"),
            "strong_sem": count(r"\bLDG\.E\.STRONG\.GPU\b") + count(r"\bREDG\.E\.ADD\.STRONG\.GPU\b")}


def _plan_row(cfg) -> tuple[dict, list]:
    """The row's planned columns and the setmaxnreg operands the PTX must have."""
    from flash4.config import sm100

    if is_bwd(cfg):
        plan = sm100.bwd_register_plan(cfg)
        row = {"regs_reduce": plan.reduce, "regs_compute": plan.compute, "regs_other": plan.other,
               "tmem_used": sm100.bwd_tmem_used_cols(cfg), "tmem_alloc": sm100.bwd_tmem_alloc_cols(cfg)}
        kind = lambda regs: "inc" if sm100.BwdRegisterPlan.is_increase(regs) else "dec"  # noqa: E731
        return row, sorted((kind(r), r) for r in (plan.reduce, plan.compute, plan.other))
    plan = sm100.register_plan(cfg)
    row = {"regs_softmax": plan.softmax, "regs_correction": plan.correction, "regs_other": plan.other,
           "tmem_used": sm100.tmem_used_cols(cfg), "tmem_alloc": sm100.tmem_alloc_cols(cfg)}
    return row, plan.setmaxnreg_sites()


def check_one(cfg) -> dict:
    """Compile one sm100 config (forward or backward) and read its PTX and SASS: the report's row
    (a compile error is a result: ok False, error set)."""
    from flash4.compile.cache import compile_bwd, compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    bwd = is_bwd(cfg)
    planned, want_regs = _plan_row(cfg)
    row = {"config": name(cfg), "pass": "bwd" if bwd else "fwd", "ok": False, "error": None, "compile_s": None,
           "label": LABEL, "cta_group": cfg.cta_group, **planned, "smem_bytes": cfg.smem_bytes()}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        with tempfile.TemporaryDirectory() as dump:
            compiled = (compile_bwd if bwd else compile_fwd)(cfg, options=f" --keep-ptx --dump-dir {dump}")
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            row["compile_cpu_s"] = round(time.process_time() - c0, 2)  # this process's CPU (a loaded box: < wall)
            ptx = compiled.__ptx__
            ptx = Path(ptx).read_text() if ptx and "\n" not in ptx and Path(ptx).is_file() else (ptx or "")
        row["setmaxnreg_ok"] = setmaxnreg_operands(ptx) == want_regs
        row["tmem_alloc_ok"] = tmem_alloc_operands(ptx) == [row["tmem_alloc"]]
        cubin = extract_cubin(compiled)
        if cubin is not None:
            row.update(resource_usage(cubin))
            if bwd:
                sass = sass_text(cubin)
                if sass is not None:
                    row.update(bwd_sass_counts(sass))
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


def format_report(rows: list[dict]) -> str:
    """The report's tables: the forward rows (regs softmax / correction / other), then the backward
    rows (regs dQ-reduce / compute / other), each with its own opcode columns."""
    from flash4.bench.report import format_table

    common = ["config", "ok", "compile_s", "cpu_s"]
    mem = ["TMEM used/alloc", "smem KiB", "LDL/STL", "stack"]

    def cells(r, regs):
        return ([r["config"], r["ok"], r["compile_s"], r.get("compile_cpu_s"), "/".join(str(r[k]) for k in regs),
                 f"{r['tmem_used']}/{r['tmem_alloc']}", round(r["smem_bytes"] / 1024, 1), r.get("spills"),
                 r.get("stack_bytes")])

    out = []
    fwd = [r for r in rows if r.get("pass", "fwd") == "fwd"]
    bwd = [r for r in rows if r.get("pass") == "bwd"]
    if fwd:
        regs = ("regs_softmax", "regs_correction", "regs_other")
        out.append(f"forward ({len(fwd)}):")
        out.append(format_table(common + ["regs sm/corr/other"] + mem + [h for h, _ in OPCODES],
                                [cells(r, regs) + [r.get(k) for _, k in OPCODES] for r in fwd]))
    if bwd:
        regs = ("regs_reduce", "regs_compute", "regs_other")
        out.append(f"backward ({len(bwd)}):")
        out.append(format_table(common + ["regs red/comp/other"] + mem + [h for h, _ in BWD_OPCODES],
                                [cells(r, regs) + [r.get(k) for _, k in BWD_OPCODES] for r in bwd]))
    return "\n".join(out)


def main(cfgs: list, json_path=None) -> int:
    """Compile `cfgs` (forward and backward sm100 configs), print the report (the label first), write
    JSON if asked. Returns 1 if any config fails (problems), else 0."""
    from flash4.bench.report import progress

    n_bwd = sum(is_bwd(c) for c in cfgs)
    print(f"compile check, sm_100a: {len(cfgs) - n_bwd} forward config(s), {n_bwd} backward config(s), {LABEL}")
    if not cfgs:
        print("no sm100 config matches the filters (forward head dims 64, 96, 128, 192 (Dv 128), 256; backward 64, 128; "
              "bf16, fp16)")
        return 1
    rows = []
    bar = progress(len(cfgs), "compile", "cfg")
    for cfg in cfgs:
        rows.append(check_one(cfg))
        bar.set_postfix_str(f"{rows[-1]['config']}: {'ok' if rows[-1]['ok'] else 'FAILED'} {rows[-1]['compile_s']} s")
        bar.update()
    bar.close()
    print(format_report(rows))
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
