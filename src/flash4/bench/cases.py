"""Named benchmark cells outside the standard sweep (issues 10, 11, 13): other head dims, GQA/MQA,
seqlen_q != seqlen_k, timed side by side like the sweep and written to `cases.csv` with columns
CASE_COLUMNS (the layout the recorded docs/perf/h200-cases.csv will have; not measured yet).

TFLOPs count only the unmasked work: 4 * batch * nheads * headdim * (visible (query, key) pairs),
the pairs counted with flash4.geometry's rule (for seqlen_q == seqlen_k causal that is the usual
half of the square, plus the diagonal). Backward FLOPs are 2.5x forward, as in the sweep. With a
value head dim Dv != D (hdimv_* cells) the forward is 2 * (D + Dv) per pair (Q K^T and P V) and the
backward 2 * (3 D + 2 Dv) (S, dP, dV, dK, dQ); the CSV's headdim column is D (the name gives Dv).
SDPA's `is_causal` is top-left aligned, so it is timed only where that equals flash4's
bottom-right mask (not causal, or seqlen_q == seqlen_k).
"""

from __future__ import annotations

import dataclasses
import math

from flash4 import geometry
from flash4.bench import common

CASE_COLUMNS = ("impl", "case", "headdim", "causal", "seqlen_q", "seqlen_k", "batch", "nheads", "nheads_k",
                "fwd_tflops", "bwd_tflops")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # prefix = the family (d96, d192, gqa, mqa, ...), as the issues name them
    headdim: int
    causal: bool
    seqlen_q: int
    seqlen_k: int
    batch: int
    nheads: int
    nheads_k: int
    window: tuple | None = None  # flash-attn's window_size (left, right); None: none
    softcap: float = 0.0  # logit soft-cap (0: off)
    sink: bool = False  # a learnable sink logit per head (gpt-oss)
    headdim_v: int | None = None  # V's / O's head dim when it differs from headdim (None: headdim)

    @property
    def hdim_v(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v

    def label(self) -> str:
        return self.name

    def options(self) -> dict:
        """The keyword arguments an Impl.make takes for this case's mask / score options."""
        opts = {}
        if self.window is not None:
            opts["window"] = self.window
        if self.softcap:
            opts["softcap"] = self.softcap
        if self.sink:
            opts["sink"] = True
        return opts


# Issue 11's cells that the standard sweep lacks (bf16; 32k tokens like the sweep).
CASES = (
    Case("d96_causal_4k", 96, True, 4096, 4096, 8, 21, 21),
    Case("d192_full_4k", 192, False, 4096, 4096, 8, 10, 10),
    Case("gqa_64q8kv_d128_causal_4k", 128, True, 4096, 4096, 8, 64, 8),
    Case("mqa_32q1kv_d64_causal_8k", 64, True, 8192, 8192, 4, 32, 1),
    # Issue 10: a 4096-key sliding window (Mistral-style: left 4095, right 0) at S = 32k, next to
    # full causal on the same shape (the band is ~25% of the causal work).
    Case("window4096_causal_32k_d128", 128, True, 32768, 32768, 1, 16, 16, window=(4095, 0)),
    Case("window_ref_causal_32k_d128", 128, True, 32768, 32768, 1, 16, 16),
    # Gemma-2 shape: softcap 50, d256, 16 query / 8 KV heads, S = 8k; next to the same without it.
    Case("softcap50_gemma2_d256_causal_8k", 256, True, 8192, 8192, 1, 16, 8, softcap=50.0),
    Case("softcap_ref_gemma2_d256_causal_8k", 256, True, 8192, 8192, 1, 16, 8),
    # gpt-oss shapes: 64 query / 8 KV heads, d64, sinks; a windowed (128) and a full layer at S = 8k,
    # and the full layer without sinks (their cost).
    Case("sink_gptoss_d64_window128_causal_8k", 64, True, 8192, 8192, 1, 64, 8, window=(127, 0), sink=True),
    Case("sink_gptoss_d64_causal_8k", 64, True, 8192, 8192, 1, 64, 8, sink=True),
    Case("sink_ref_gptoss_d64_causal_8k", 64, True, 8192, 8192, 1, 64, 8),
    # Issue 13: a value head dim different from Q/K's. DeepSeek-V3/R1 MLA prefill (q/k 192, v 128),
    # 16 heads, 32k tokens; and 128/64, 64/128.
    Case("hdimv_192_128_causal_4k", 192, True, 4096, 4096, 8, 16, 16, headdim_v=128),
    Case("hdimv_192_128_full_4k", 192, False, 4096, 4096, 8, 16, 16, headdim_v=128),
    Case("hdimv_192_128_causal_16k", 192, True, 16384, 16384, 2, 16, 16, headdim_v=128),
    Case("hdimv_192_128_full_16k", 192, False, 16384, 16384, 2, 16, 16, headdim_v=128),
    Case("hdimv_128_64_causal_4k", 128, True, 4096, 4096, 8, 16, 16, headdim_v=64),
    Case("hdimv_64_128_causal_4k", 64, True, 4096, 4096, 8, 16, 16, headdim_v=128),
    # Issue 13: head dims without a kernel of their own (zero-padded by flash4.headdim; TFLOPs of the
    # real head dim), against SDPA's backends (vision transformers: d32 / d80 / d112, not causal).
    Case("smalld_32_full_4k", 32, False, 4096, 4096, 8, 16, 16),
    Case("smalld_80_full_4k", 80, False, 4096, 4096, 8, 16, 16),
    Case("smalld_112_causal_4k", 112, True, 4096, 4096, 8, 16, 16),
    # Issue 26: the sweep's short cells, by name (32 sequences of 1k; the per-tile prologue and
    # epilogue weigh most there), so tools/prof_case.py can profile them.
    Case("short_d128_full_1k", 128, False, 1024, 1024, 32, 16, 16),
    Case("short_d128_causal_1k", 128, True, 1024, 1024, 32, 16, 16),
)


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window_size=None) -> int:
    """(query, key) pairs the mask lets through, for one (batch, head) (window_size: flash-attn's)."""
    window = geometry.window_sides(window_size, causal)
    return sum(max(0, geometry.key_limit(i, seqlen_q, seqlen_k, causal, window=window)
                   - geometry.key_start(i, seqlen_q, seqlen_k, window=window)) for i in range(seqlen_q))


def case_fwd_flops(case: Case) -> float:
    pairs = visible_pairs(case.seqlen_q, case.seqlen_k, case.causal, case.window)
    if case.headdim_v is None:
        return 4.0 * case.batch * case.nheads * case.headdim * pairs
    return 2.0 * case.batch * case.nheads * (case.headdim + case.hdim_v) * pairs


def case_bwd_flops(case: Case) -> float:
    """2.5x the forward (the sweep's factor); with Dv != D, 2 * (3 D + 2 Dv) per visible pair."""
    if case.headdim_v is None:
        return common.BWD_FLOPS_FACTOR * case_fwd_flops(case)
    pairs = visible_pairs(case.seqlen_q, case.seqlen_k, case.causal, case.window)
    return 2.0 * case.batch * case.nheads * (3 * case.headdim + 2 * case.hdim_v) * pairs


def impl_applies(impl_name: str, case: Case) -> bool:
    """SDPA's causal mask is top-left aligned: skip it where that differs from flash4's; SDPA has
    no sliding window."""
    if impl_name.startswith("sdpa") and (case.window is not None or case.softcap or case.sink):
        return False
    return not (impl_name.startswith("sdpa") and case.causal and case.seqlen_q != case.seqlen_k)


def select_cases(names) -> list[Case]:
    """CASES filtered by name or name prefix (None or ["all"]: all; ["none"]: none). Raises
    ValueError naming the unknown ones and listing the known names."""
    if names is None or list(names) == ["all"]:
        return list(CASES)
    if list(names) == ["none"]:
        return []
    picked, unknown = [], []
    for name in names:
        hits = [c for c in CASES if c.name == name or c.name.startswith(name)]
        (picked.extend(h for h in hits if h not in picked) if hits else unknown.append(name))
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; known: {[c.name for c in CASES]} (or a prefix, all, none)")
    return picked


def measure_cases(impls, cases, dtype, rep_ms: float = 100.0, bwd: bool = True) -> list[dict]:
    """TFLOPs of every impl on every case (NaN where it raised or does not apply); CASE_COLUMNS rows."""
    import torch

    from flash4.bench.report import progress

    rows = []
    bar = progress(len(cases) * len(impls), "cases", "run")
    for case in cases:
        q, k, v = common.make_inputs(case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k,
                                     case.headdim, dtype, headdim_v=case.headdim_v)
        flops = case_fwd_flops(case)
        for impl in impls:
            fwd_tf = bwd_tf = math.nan
            if impl_applies(impl.name, case):
                try:
                    fn = impl.make(q, k, v, case.causal, **case.options())
                    with impl.context():
                        fwd_tf = common.tflops(flops, common.time_ms(fn, rep_ms=rep_ms))
                    if bwd:
                        bwd_tf = common.tflops(case_bwd_flops(case),
                                               common.time_bwd(impl, q, k, v, case.causal, rep_ms, **case.options()))
                except Exception as err:  # a failing impl is a NaN cell, reported once per line
                    bar.write(f"{impl.name} failed at {case.name}: {type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''}")
                    if isinstance(err, torch.cuda.OutOfMemoryError):
                        torch.cuda.empty_cache()
            rows.append({"impl": impl.name, "case": case.name, "headdim": case.headdim, "causal": int(case.causal),
                         "seqlen_q": case.seqlen_q, "seqlen_k": case.seqlen_k, "batch": case.batch,
                         "nheads": case.nheads, "nheads_k": case.nheads_k, "fwd_tflops": fwd_tf,
                         "bwd_tflops": bwd_tf if bwd else None})
            bar.set_postfix_str(f"{impl.name} {case.name}: fwd {fwd_tf:.1f}" + (f", bwd {bwd_tf:.1f}" if bwd else ""))
            bar.update()
        del q, k, v
    bar.close()
    return rows


def write_cases_csv(rows, path) -> None:
    common.write_rows_csv(rows, CASE_COLUMNS, path)


def cases_table(rows, metric: str = "fwd_tflops"):
    """(headers, rows) for report.format_table: one line per case, TFLOPs per impl and flash4's ratios."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by_case: dict = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["impl"]] = r[metric]
    others = [i for i in impls if i != "flash4"]
    headers = ["case"] + impls + [f"flash4/{o}" for o in others if "flash4" in impls]
    table = []
    for name, vals in by_case.items():
        line = [name] + [vals.get(i, math.nan) for i in impls]
        if "flash4" in impls:
            f4 = vals.get("flash4", math.nan)
            line += [f4 / vals[o] if vals.get(o) and not math.isnan(vals[o]) else math.nan for o in others]
        table.append(line)
    return headers, table
