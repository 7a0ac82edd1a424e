"""Plain-text tables, and the compile-check report behind `python -m flash4 compile-check`."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path


class LineProgress:
    """Progress for output that is not a terminal (a file, a pipe, CI): one plain line per finished
    item, "desc i/total postfix", instead of a bar whose carriage returns pile up into one giant
    line. The subset of tqdm's interface the benchmark uses."""

    def __init__(self, total: int, desc: str, file=None):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self.file = sys.stderr if file is None else file

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.write(f"{self.desc} {self.n}/{self.total} {self.postfix}".rstrip())

    def close(self) -> None:
        pass


def progress(total: int, desc: str, unit: str = "it", file=None):
    """A tqdm bar on a terminal, a LineProgress otherwise (stderr unless `file` is given)."""
    stream = sys.stderr if file is None else file
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream)
    return LineProgress(total, desc, stream)


def format_table(headers: list[str], rows: list[list]) -> str:
    """Fixed-width text table; floats with 2 decimals (NaN as "-"), None as "", numbers right-aligned."""

    def cell(x) -> str:
        if x is None:
            return ""
        if isinstance(x, bool):
            return "yes" if x else "no"
        if isinstance(x, float):
            return "-" if math.isnan(x) else f"{x:.2f}"
        return str(x)

    texts = [[cell(x) for x in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in texts]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]

    def line(items) -> str:
        return "  ".join(s.rjust(w) if num else s.ljust(w) for s, w, num in zip(items, widths, numeric)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in texts])


def _summary(text: str | None, width: int = 100) -> str | None:
    """First lines of an error message, ANSI colors removed, on one line of at most `width` chars."""
    if not text:
        return None
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if ln.strip()]
    joined = " | ".join(lines)
    return joined if len(joined) <= width else joined[: width - 3] + "..."


def select_configs(headdims=None, dtypes=None, causals=None, passes=None) -> list:
    """Shipped forward and backward configs filtered by head dim, dtype name, causal and pass
    ("fwd" / "bwd"; None = all)."""
    from flash4.config import shipped_bwd_configs, shipped_fwd_configs

    fwd, bwd = shipped_fwd_configs(), shipped_bwd_configs()
    candidates = (fwd if passes is None or "fwd" in passes else []) + (bwd if passes is None or "bwd" in passes
                                                                         else [])
    return [
        c for c in candidates
        if (headdims is None or c.headdim in headdims)
        and (dtypes is None or c.dtype in dtypes)
        and (causals is None or c.causal in causals)
    ]


from flash4.config import SUPPORTED_HEADDIMS, BwdConfig, postprocess_wide_stores  # noqa: E402


def compile_check_main(configs: list | None = None, json_path: str | Path | None = None) -> int:
    """Compile `configs` (None: every shipped forward and backward config) without a GPU and print a table of
    registers, spills, shared memory and compile time. Returns 1 on any compile error, spill or serialized
    wgmma (ptxas C7512), else 0."""
    from flash4.compile.check import compile_check  # late: pulls in the CuTe DSL

    configs = select_configs() if configs is None else list(configs)
    if not configs:
        print("compile check: no kernel matches the filters (kernel head dims: "
              f"{', '.join(map(str, SUPPORTED_HEADDIMS))}; other multiples of 8 run zero-padded to the next one "
              "of these, on those kernels)")
        return 1
    n_bwd = sum(isinstance(c, BwdConfig) for c in configs)
    print(f"compile check: {len(configs)} config(s) ({len(configs) - n_bwd} forward, {n_bwd} backward), "
          "no GPU needed")
    results = []
    bar = progress(len(configs), "compile", "cfg")
    for cfg in configs:
        results.extend(compile_check([cfg]))
        bar.set_postfix_str(f"{results[-1]['config']}: {'ok' if results[-1]['ok'] else 'FAILED'} "
                            f"{results[-1]['compile_s']} s")
        bar.update()
    bar.close()
    # hgmma / utmaldg: SASS instruction counts, when the check reports them
    rows = [
        [r["config"], r["ok"], r["compile_s"], r["registers"], r["spills"], r["smem_bytes"],
         r.get("hgmma"), r.get("utmaldg"), r.get("wgmma_serialized"), _summary(r["error"])]
        for r in results
    ]
    headers = ["config", "ok", "compile_s", "registers", "spills", "smem_bytes", "HGMMA", "UTMALDG", "wgmma_serial",
               "error"]
    print(format_table(headers, rows))
    bad = [r for r in results if not r["ok"] or (r["spills"] or 0) > 0 or r.get("wgmma_serialized")]
    unchecked = [r for r in results if r["ok"] and r["registers"] is None]
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2))
        print(f"wrote {json_path}")
    slowest = max((r["compile_s"] for r in results), default=0.0)
    if unchecked:
        print(f"note: registers/spills not read for {len(unchecked)} config(s): cuobjdump not found "
              "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    print(f"{len(results) - len(bad)}/{len(results)} ok (no compile error"
          f"{', no spill, no serialized wgmma' if not unchecked else ''}); slowest compile {slowest:.2f} s")
    for r in bad:
        print(f"FAILED {r['config']}: " + (r["error"] or (f"{r['spills']} spill(s)" if r["spills"]
                                                          else "wgmma serialized by ptxas (C7512)")))
    return 1 if bad else 0


def warmup_main(configs: list | None = None) -> int:
    """Compile (or load) `configs` (None: every shipped config) into the on-disk compile cache, so
    later processes load them instead of compiling. Prints the one-time CuTe DSL import time and,
    per config, the seconds to get it and whether it was compiled or loaded. Returns 0, or 1 if any
    config failed."""
    import time

    from flash4 import env
    from flash4.config import BwdConfig

    t0 = time.perf_counter()
    from flash4.compile import cache  # pulls in the CuTe DSL

    import_s = time.perf_counter() - t0
    configs = select_configs() if configs is None else list(configs)
    on = env.disk_cache_enabled()
    print(f"flash4 warmup: {len(configs)} config(s) into "
          f"{env.disk_cache_dir() if on else '(nowhere: FLASH4_CACHE=0)'}; CuTe DSL import {import_s:.2f} s (once per process)")
    rows, failed = [], 0
    bar = progress(len(configs), "warmup", "cfg")
    from flash4.compile import disk_cache
    from flash4.compile.check import _short

    for cfg in configs:
        before = dict(disk_cache.counts)
        t1 = time.perf_counter()
        try:
            if isinstance(cfg, BwdConfig):
                cache.get_bwd_preprocess_runner(cfg.hdim_v, cfg.dtype, cfg.arch, headdim_q=cfg.headdim)
                cache.get_bwd_postprocess_runner(cfg.headdim, cfg.dtype, cfg.arch,
                                                 wide_stores=postprocess_wide_stores(),
                                                 **cache.dq_postprocess_kwargs(cfg))
                cache.get_bwd_runner(cfg)
            else:
                cache.get_fwd_runner(cfg)
            error = None
        except Exception as err:  # a failure is a result here
            error, failed = _summary(f"{type(err).__name__}: {err}"), failed + 1
        seconds = time.perf_counter() - t1
        how = "compiled" if disk_cache.counts["compiled"] > before["compiled"] else "loaded"
        rows.append([_short(cfg), how if error is None else "failed", round(seconds, 3), error])
        bar.set_postfix_str(f"{rows[-1][0]}: {seconds:.2f} s")
        bar.update()
    bar.close()
    print(format_table(["config", "from", "seconds", "error"], rows))
    return 1 if failed else 0
