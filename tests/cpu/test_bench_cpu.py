"""The benchmark harness without a GPU: sweep shapes, FLOPs, tables, targets, CSV/JSON/PNG, CLI."""

import csv
import json
import math
import sys
import types

import pytest
import torch

from flash4.__main__ import main as cli_main
from flash4.bench import common, run
from flash4.bench.report import format_table, select_configs
from flash4.config import shipped_bwd_configs, shipped_fwd_configs


def test_parse_seqlen():
    assert [run.parse_seqlen(s) for s in ("1k", "4K", "32k", "1000")] == [1024, 4096, 32768, 1000]
    for bad in ("0", "k", "x1", "-4"):
        with pytest.raises(Exception, match="not a positive integer"):
            run.parse_seqlen(bad)
    assert run.seqlen_label(16384) == "16k" and run.seqlen_label(1000) == "1000"


def test_sweep_cells_follow_the_issue():
    cells = run.sweep_cells(run.DEFAULT_HEADDIMS, run.DEFAULT_SEQLENS, (False, True))
    assert len(cells) == 3 * 4 * 2
    for c in cells:
        assert c.batch * c.seqlen == 32768 and c.nheads * c.headdim == 2048
    assert cells[0] == run.Cell(headdim=64, causal=False, seqlen=1024, batch=32, nheads=32)


def test_flops():
    full = run.Cell(headdim=128, causal=False, seqlen=4096, batch=8, nheads=16)
    causal = run.Cell(headdim=128, causal=True, seqlen=4096, batch=8, nheads=16)
    assert run.fwd_flops(full) == 4 * 8 * 16 * 4096 * 4096 * 128
    assert run.fwd_flops(causal) == run.fwd_flops(full) / 2
    assert math.isclose(run.tflops(1e12, 1000.0), 1.0)


def fake_rows():
    rows = []
    values = {"flash4": (650.0, 400.0), "flash_attn_4": (660.0, 420.0), "sdpa_cudnn": (600.0, 410.0),
              "sdpa_flash": (math.nan, 300.0)}
    for cell in run.sweep_cells((128,), (1024, 4096), (False, True)):
        for impl, (full, causal) in values.items():
            rows.append({"impl": impl, "headdim": cell.headdim, "causal": int(cell.causal), "seqlen": cell.seqlen,
                         "batch": cell.batch, "nheads": cell.nheads, "fwd_tflops": causal if cell.causal else full,
                         "bwd_tflops": None})
    return rows


def test_result_table_ratios():
    headers, table = run.result_table(fake_rows())
    assert headers[5:] == ["flash4", "flash_attn_4", "sdpa_cudnn", "sdpa_flash",
                           "flash4/flash_attn_4", "flash4/sdpa_cudnn", "flash4/sdpa_flash"]
    first = table[0]  # hdim 128 full 1k
    assert first[:5] == [128, 0, 1024, 32, 16]
    assert math.isclose(first[9], 650 / 660) and math.isclose(first[10], 650 / 600) and math.isnan(first[11])
    text = format_table(headers, table)
    assert "flash4/sdpa_cudnn" in text and "1.08" in text
    assert text.splitlines()[2].split()[8] == "-"  # NaN (sdpa_flash raised) shows as "-"


def test_targets_summary():
    lines = run.targets_summary(fake_rows())
    assert lines[0].startswith("fwd: flash4 >= 1.00x sdpa_cudnn (every cell): MISSED on 2/4 cells")
    assert "worst 0.976x at hdim 128 causal" in lines[0]
    assert lines[1].startswith("fwd: flash4 >= 0.85x flash_attn_4 (hdim 128, S >= 4k): MET")
    only_flash4 = [r for r in fake_rows() if r["impl"] == "flash4"]
    assert all(line.endswith("not measured") for line in run.targets_summary(only_flash4))


def test_csv_json_png(tmp_path):
    rows = fake_rows()
    run.write_csv(rows, tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv") as f:
        records = list(csv.reader(f))
    # the recorded docs/perf/h200.csv's columns first, in their order; the GEMM ceiling's after them
    assert records[0] == ["impl", "headdim", "causal", "seqlen", "batch", "nheads", "fwd_tflops", "bwd_tflops",
                          "gemm_tflops", "fwd_gemm_ratio", "bwd_gemm_ratio"]
    assert records[1] == ["flash4", "128", "0", "1024", "32", "16", "650.0", "", "", "", ""]  # no ceiling measured
    assert {r[0] for r in records[1:]} == {"flash4", "flash_attn_4", "sdpa_cudnn", "sdpa_flash"}
    assert {r[2] for r in records[1:]} == {"0", "1"}
    assert ["sdpa_flash", "128", "0", "1024", "32", "16", "nan", "", "", "", ""] in records

    run.write_json(tmp_path / "sweep.json", {"gpu": "test"}, rows, [], ["t"])
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["meta"] == {"gpu": "test"} and doc["rows"][3]["fwd_tflops"] is None and doc["targets"] == ["t"]

    run.plot(rows, tmp_path / "sweep.png", "test plot")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_impl_names_match_baselines():
    from flash4.bench.baselines import all_impls

    impls = all_impls()
    assert tuple(i.name for i in impls) == run.IMPL_NAMES
    assert [i.name for i in impls if i.unavailable] in ([], ["flash_attn_4"])


def test_check_cases():
    assert len(run.check_cases("flash4", (64, 128), (False, True))) == 4 + 3
    assert all(c[1] == c[2] for c in run.check_cases("sdpa_cudnn", (128,), (False, True)))


def test_select_configs():
    assert select_configs() == shipped_fwd_configs() + shipped_bwd_configs()
    some = select_configs(headdims=(128,), dtypes=("bf16",))
    plain = [c for c in some if c.headdim_v is None]  # (128, 64) head dim pairs match headdim 128 too
    # fwd, the short-sequence fwds (full: pv_zero_init + flat_tile_order, shipped_tile_work; causal:
    # persistent), the long full fwd (vote-first), bwd, bwd deterministic, the window bwd (its own dQ
    # hand-off: shipped_dq_handoff); GQA head split (dkv_accum): causal and not, deterministic causal
    pairs = [(128, "bf16", False), (128, "bf16", True)]
    assert [(c.headdim, c.dtype, c.causal) for c in plain] == pairs * 2 + [(128, "bf16", False)] + \
        pairs * 2 + [(128, "bf16", False)] + pairs + [(128, "bf16", True)]
    assert [getattr(c, "pv_zero_init", False) for c in plain] == [False, False, True] + [False] * 10
    assert [getattr(c, "persistent", False) for c in plain] == [False] * 3 + [True] + [False] * 9
    assert [getattr(c, "softmax_vote_first", False) for c in plain] == [False] * 4 + [True] + [False] * 8
    assert [c.local for c in plain] == [False] * 9 + [True] + [False] * 3
    assert [getattr(c, "dkv_accum", False) for c in plain] == [False] * 10 + [True] * 3
    # the (128, 64) pair: fwd causal and not, the causal look-ahead fwd (shipped_lookahead_qk), bwd
    pair = [c for c in some if c.headdim_v is not None]
    assert [(c.headdim_v, c.causal) for c in pair] == [(64, False), (64, True), (64, True), (64, False), (64, True)]
    assert [getattr(c, "lookahead_qk", False) for c in pair] == [False, False, True, False, False]


@pytest.fixture
def fake_compile_check(monkeypatch):
    """Stands in for flash4.compile.check (the CuTe DSL compile) and records what it was asked."""
    calls, result = [], {"spills": 0}

    def compile_check(configs):
        calls.extend(configs)
        return [{"config": f"d{c.headdim} {c.dtype} {int(c.causal)}", "ok": True, "error": None, "compile_s": 1.5,
                 "registers": 168, "spills": result["spills"], "smem_bytes": c.smem_bytes()} for c in configs]

    module = types.ModuleType("flash4.compile.check")
    module.compile_check = compile_check
    monkeypatch.setitem(sys.modules, "flash4.compile.check", module)
    return calls, result


def test_cli_compile_check(fake_compile_check, capsys, tmp_path):
    calls, result = fake_compile_check
    assert cli_main(["compile-check", "--headdims", "128", "--dtypes", "bf16", "--json", str(tmp_path / "c.json")]) == 0
    # fwd, bwd, bwd det; causal and not; + the short-sequence fwds (causal persistent, full with
    # shipped_tile_work); + the long full fwd (vote-first); + the (128, 64) head dim pair's fwd and
    # bwd, and its causal look-ahead fwd; + the window bwd (its own dQ hand-off); + GQA head split
    # (dkv_accum) causal and not, and deterministic causal
    assert [(c.headdim, c.dtype) for c in calls] == [(128, "bf16")] * 18
    out = capsys.readouterr().out
    assert "18/18 ok" in out and "registers" in out
    assert len(json.loads((tmp_path / "c.json").read_text())) == 18
    result["spills"] = 4
    assert cli_main(["compile-check", "--headdims", "64", "--causal", "1"]) == 1
    assert "FAILED d64 bf16 1: 4 spill(s)" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_gpu_runs_the_compile_check(fake_compile_check, capsys):
    calls, _ = fake_compile_check
    assert cli_main(["bench"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("No CUDA GPU found") and "compile check" in out
    assert ("head dims 64 96 128 192 256 and their value-head-dim pairs; bf16 and fp16; with and without the causal "
            "mask; forward and backward") in out
    assert "Ignored" not in out
    assert calls == shipped_fwd_configs() + shipped_bwd_configs()
    calls.clear()
    assert cli_main(["bench", "--quick"]) == 0
    # as compile-check --headdims 128 --dtypes bf16 above
    assert [(c.headdim, c.dtype) for c in calls] == [(128, "bf16")] * 18


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_gpu_honours_the_kernel_filters_and_names_the_others(fake_compile_check, capsys):
    """--dtype, --causal and --no-bwd choose the kernels compiled, as --headdims does; the options
    that only choose what is timed are named as ignored."""
    from flash4.config import BwdConfig, FwdConfig

    calls, _ = fake_compile_check
    argv = ["bench", "--no-bwd", "--dtype", "fp16", "--causal", "1", "--headdims", "64", "--seqlens", "4k",
            "--cases", "gqa", "--rep-ms", "50"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert calls and all(isinstance(c, FwdConfig) and (c.headdim, c.dtype, c.causal) == (64, "fp16", True)
                         for c in calls)
    assert calls == select_configs(headdims=(64,), dtypes=("fp16",), causals=(True,), passes=("fwd",))
    assert "head dim 64; fp16; with the causal mask; forward only" in out
    assert "Ignored without a GPU: --seqlens, --cases, --rep-ms (" in out
    assert "compile check: 3 config(s) (3 forward, 0 backward)" in out
    calls.clear()
    assert cli_main(["bench", "--dtype", "bf16", "--causal", "0", "--headdims", "128", "--varlen", "only"]) == 0
    out = capsys.readouterr().out
    assert {(c.dtype, c.causal) for c in calls} == {("bf16", False)}
    assert any(isinstance(c, BwdConfig) for c in calls) and any(isinstance(c, FwdConfig) for c in calls)
    assert "Ignored without a GPU: --varlen (" in out


def test_no_gpu_plan():
    from flash4.__main__ import build_parser

    def plan(*argv):
        return run.no_gpu_plan(build_parser().parse_args(["bench", *argv]))

    assert plan() == {"headdims": None, "dtypes": None, "causals": None, "passes": None, "ignored": [],
                      "describe": "head dims 64 96 128 192 256 and their value-head-dim pairs; bf16 and fp16; "
                                  "with and without the causal mask; forward and backward"}
    quick = plan("--quick")
    assert (quick["headdims"], quick["dtypes"]) == ((128,), ("bf16",))
    assert plan("--quick", "--headdims", "64", "--dtype", "fp16")["headdims"] == (64,)
    assert plan("--headdims", "64", "128")["describe"].startswith("head dims 64 128; bf16 and fp16;")
    assert plan("--quick", "--dtype", "fp16")["dtypes"] == ("fp16",)
    p = plan("--causal", "0", "--no-bwd", "--impls", "flash4", "--out", "x", "--varlen", "none")
    assert (p["causals"], p["passes"]) == ((False,), ("fwd",))
    assert p["ignored"] == ["--impls", "--varlen", "--out"]


def test_select_configs_by_pass():
    fwd, bwd = shipped_fwd_configs(), shipped_bwd_configs()
    assert select_configs(passes=("fwd",)) == fwd and select_configs(passes=("bwd",)) == bwd
    assert select_configs(passes=("fwd", "bwd")) == fwd + bwd
    assert select_configs(headdims=(128,), passes=("bwd",)) == [c for c in bwd if c.headdim == 128]


def test_help_speaks_to_users():
    """No issue numbers or internal identifiers in any help text; defaults and units stated."""
    from flash4.__main__ import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "bench" in a.choices).choices
    texts = [parser.format_help()] + [p.format_help() for p in subparsers.values()]
    for text in texts:
        for word in ("issue", "CSV_COLUMNS", "baselines.py", "flash4.bench", "select_fwd_config", "FA4"):
            assert word not in text
    bench = subparsers["bench"].format_help()
    for phrase in ("milliseconds", "default: 64 128 256", "default: 1k 4k 16k 32k", "default: bench_out",
                   "default: bf16", "8192 x 8192 x 8192", "fwd_gemm_ratio", "Without a GPU"):
        assert phrase in " ".join(bench.split()), phrase


def test_bench_times_backward_unless_told_not_to():
    from flash4.__main__ import build_parser

    assert build_parser().parse_args(["bench"]).bwd is True
    assert build_parser().parse_args(["bench", "--no-bwd"]).bwd is False



def test_progress_is_one_line_per_item_when_not_a_terminal():
    """Written to a file or a pipe, progress is one plain line per finished item (no carriage
    returns piling up into one line); on a terminal it is a tqdm bar."""
    import io

    from flash4.bench.report import LineProgress, progress

    out = io.StringIO()
    bar = progress(3, "sweep", "run", file=out)
    assert isinstance(bar, LineProgress)
    for i in range(3):
        bar.set_postfix_str(f"cell {i}: fwd 1.0 TFLOPs")
        bar.update()
    bar.write("a note")
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    assert text.splitlines() == ["sweep 1/3 cell 0: fwd 1.0 TFLOPs", "sweep 2/3 cell 1: fwd 1.0 TFLOPs",
                                 "sweep 3/3 cell 2: fwd 1.0 TFLOPs", "a note"]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress(3, "sweep", "run", file=Tty()), LineProgress)


def test_plot_has_backward_panels_and_own_scales(tmp_path):
    """Forward and backward panels, each y-axis scaled to its own data (no panel flattened by a
    larger head dim's numbers)."""
    from matplotlib.figure import Figure

    rows = [{"impl": impl, "headdim": d, "causal": c, "seqlen": s, "batch": 1, "nheads": 1,
             "fwd_tflops": d * 2.0 * f, "bwd_tflops": d * 1.0 * f}
            for impl, f in (("flash4", 1.0), ("sdpa_cudnn", 0.9)) for d in (64, 256) for c in (0, 1)
            for s in (1024, 4096)]
    saved = {}
    orig = Figure.savefig

    def capture(self, *a, **k):
        saved["fig"] = self
        return orig(self, *a, **k)

    Figure.savefig = capture
    try:
        run.plot(rows, tmp_path / "p.png", "t")
    finally:
        Figure.savefig = orig
    axes = saved["fig"].axes
    assert len(axes) == 2 * 2 * 2  # (fwd, bwd) x causal x headdim
    titles = [ax.get_title() for ax in axes]
    assert sum(t.startswith("backward") for t in titles) == 4
    for ax in axes:
        top = max(max(line.get_ydata()) for line in ax.get_lines())
        assert ax.get_ylim()[1] <= 1.2 * top  # own scale: the data fills the panel


def test_cases_flops_selection_and_csv(tmp_path):
    """Named cells: FLOPs of the unmasked work (geometry's rule), selection by name / prefix,
    SDPA skipped where its top-left causal mask differs, and the cases.csv layout."""
    from flash4.bench import cases

    assert cases.visible_pairs(4, 4, True) == 10 and cases.visible_pairs(4, 4, False) == 16
    assert cases.visible_pairs(2, 5, True) == 4 + 5 and cases.visible_pairs(5, 2, True) == 0 + 0 + 0 + 1 + 2
    c = cases.Case("x", 128, True, 4096, 4096, 8, 16, 16)
    assert cases.case_fwd_flops(c) == 4.0 * 8 * 16 * 128 * (4096 * 4097 // 2)
    assert [c.name for c in cases.select_cases(["gqa"])] == ["gqa_64q8kv_d128_causal_4k"]
    assert cases.select_cases(["none"]) == [] and len(cases.select_cases(None)) == len(cases.CASES)
    with pytest.raises(ValueError, match="--cases: unknown"):
        cases.select_cases(["nope"])
    assert not cases.impl_applies("sdpa_cudnn", cases.Case("r", 64, True, 10, 20, 1, 1, 1))
    assert cases.impl_applies("flash4", cases.Case("r", 64, True, 10, 20, 1, 1, 1))
    rows = [{"impl": i, "case": "d96_causal_4k", "headdim": 96, "causal": 1, "seqlen_q": 4096, "seqlen_k": 4096,
             "batch": 8, "nheads": 21, "nheads_k": 21, "fwd_tflops": t, "bwd_tflops": t / 2}
            for i, t in (("flash4", 400.0), ("flash_attn_4", 500.0))]
    cases.write_cases_csv(rows, tmp_path / "cases.csv")
    lines = (tmp_path / "cases.csv").read_text().splitlines()
    assert lines[0] == ",".join(cases.CASE_COLUMNS)
    assert lines[1] == "flash4,d96_causal_4k,96,1,4096,4096,8,21,21,400.0,200.0"
    headers, table = cases.cases_table(rows)
    assert headers == ["case", "flash4", "flash_attn_4", "flash4/flash_attn_4"] and table[0][-1] == 0.8


def gemm_rows(gemm=800.0):
    rows = fake_rows()
    for r in rows:
        r["bwd_tflops"] = r["fwd_tflops"] / 2
    return run.add_gemm_ratios(rows, gemm)


def test_gemm_ratios_math_table_and_csv(tmp_path):
    """Every row's TFLOPs as a fraction of the run's GEMM rate, forward and backward; the tables'
    last column is flash4's; the CSV keeps its first columns and adds the ceiling after them."""
    rows = gemm_rows(800.0)
    first = rows[0]  # flash4, hdim 128 full 1k: 650 fwd, 325 bwd
    assert first["gemm_tflops"] == 800.0
    assert math.isclose(first["fwd_gemm_ratio"], 650 / 800) and math.isclose(first["bwd_gemm_ratio"], 325 / 800)
    assert math.isnan(rows[3]["fwd_gemm_ratio"])  # sdpa_flash raised there
    no_bwd = run.add_gemm_ratios(fake_rows(), 800.0)
    assert no_bwd[0]["bwd_gemm_ratio"] is None and math.isclose(no_bwd[0]["fwd_gemm_ratio"], 650 / 800)
    assert all(math.isnan(r["fwd_gemm_ratio"]) for r in run.add_gemm_ratios(fake_rows(), math.nan))

    headers, table = run.result_table(rows)
    assert headers[-1] == "flash4/gemm" and headers[5:9] == ["flash4", "flash_attn_4", "sdpa_cudnn", "sdpa_flash"]
    assert math.isclose(table[0][-1], 650 / 800) and math.isnan(table[0][-2])  # before it: flash4/sdpa_flash
    headers_b, table_b = run.result_table(rows, "bwd_tflops")
    assert headers_b[-1] == "flash4/gemm" and math.isclose(table_b[0][-1], 325 / 800)
    assert "flash4/gemm" in format_table(headers, table)
    # without a ceiling (rows from measure() alone) or without flash4: no column
    assert "flash4/gemm" not in run.result_table(fake_rows())[0]
    assert "flash4/gemm" not in run.result_table([r for r in rows if r["impl"] != "flash4"])[0]

    run.write_csv(rows, tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv") as f:
        records = list(csv.DictReader(f))
    assert records[0] == {"impl": "flash4", "headdim": "128", "causal": "0", "seqlen": "1024", "batch": "32",
                          "nheads": "16", "fwd_tflops": "650.0", "bwd_tflops": "325.0", "gemm_tflops": "800.0",
                          "fwd_gemm_ratio": "0.812", "bwd_gemm_ratio": "0.406"}
    assert records[3]["fwd_gemm_ratio"] == "nan"


def test_measure_gemm_with_a_fake_timer(monkeypatch):
    """The ceiling: 2 * n^3 FLOPs over common.time_ms of torch.matmul (on the CPU here), recorded
    with its shape and dtype; a failure is a NaN ceiling, said in its line."""
    seen = []

    def time_ms(fn, rep_ms=100.0):
        out = fn()
        seen.append((tuple(out.shape), out.dtype, rep_ms))
        return 0.5

    monkeypatch.setattr(common, "time_ms", time_ms)
    gemm = run.measure_gemm("bf16", rep_ms=20.0, size=64, device="cpu")
    assert seen == [((64, 64), torch.bfloat16, 20.0)]
    assert gemm["m"] == gemm["n"] == gemm["k"] == 64 and gemm["dtype"] == "bf16" and gemm["error"] is None
    assert math.isclose(gemm["tflops"], 2 * 64 ** 3 / 0.5e-3 / 1e12) and gemm["ms"] == 0.5
    assert run.gemm_flops() == 2.0 * 8192 ** 3
    line = run.describe_gemm(gemm)
    assert line.startswith("GEMM ceiling: torch.matmul (cuBLAS) bf16 64 x 64 x 64:") and "flash4/gemm" in line

    def broken(fn, rep_ms=100.0):
        raise RuntimeError("no device")

    monkeypatch.setattr(common, "time_ms", broken)
    failed = run.measure_gemm("fp16", size=8, device="cpu")
    assert math.isnan(failed["tflops"]) and failed["error"] == "RuntimeError: no device"
    assert "failed, RuntimeError: no device" in run.describe_gemm(failed)


def test_bench_main_end_to_end_with_fakes(monkeypatch, tmp_path, capsys):
    """run.main as on a GPU, with CPU tensors, fake implementations and a fake timer: the GEMM
    ceiling is measured once, printed, kept in sweep.json, and every table and CSV row has its
    ratio to it."""
    from flash4.bench import baselines

    ms_of = {"gemm": 1.0, "flash4": 0.5, "sdpa_cudnn": 1.0}
    bwd_ms_of = {"flash4": 2.0, "sdpa_cudnn": 2.5}
    calls = []

    def make(name):
        def make_fn(q, k, v, causal, **options):
            fn = lambda: q  # noqa: E731
            fn.impl = name
            return fn
        return make_fn

    def time_ms(fn, rep_ms=100.0):
        calls.append(getattr(fn, "impl", "gemm"))
        fn()
        return ms_of[calls[-1]]

    real_gemm = run.measure_gemm
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "_dsl_import_seconds", lambda: 0.0)
    monkeypatch.setattr(run, "_print_compile_summary", lambda import_s: None)
    monkeypatch.setattr(run, "collect_metadata", lambda dtype: {"gpu": "fake", "timing": "fake", "dtype": dtype,
                                                                "date": "2026-01-01T00:00:00"})
    monkeypatch.setattr(run, "check_correctness", lambda impls, headdims, causals, dtype: [
        {"impl": i.name, "shape": "s", "causal": c, "ok": True, "error": None} for i in impls for c in causals])
    monkeypatch.setattr(run, "measure_gemm", lambda name, rep_ms: real_gemm(name, rep_ms, size=64, device="cpu"))
    monkeypatch.setattr(run, "measure_memory", lambda impls, dtype: {i.name: 1.0 for i in impls})
    monkeypatch.setattr(baselines, "all_impls", lambda: [baselines.Impl("flash4", make("flash4")),
                                                         baselines.Impl("sdpa_cudnn", make("sdpa_cudnn"))])
    monkeypatch.setattr(common, "make_inputs", lambda *a, **k: tuple(torch.zeros(1, 2, 1, 8) for _ in range(3)))
    monkeypatch.setattr(common, "time_ms", time_ms)
    monkeypatch.setattr(common, "time_bwd", lambda impl, q, k, v, causal, rep_ms, **o: bwd_ms_of[impl.name])
    argv = ["bench", "--headdims", "128", "--seqlens", "1k", "--causal", "both", "--cases", "none",
            "--varlen", "none", "--out", str(tmp_path)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert calls.count("gemm") == 1 and calls[0] == "gemm"  # once per run, before the sweep
    gemm = 2 * 64 ** 3 / 1e-3 / 1e12
    assert f"GEMM ceiling: torch.matmul (cuBLAS) bf16 64 x 64 x 64: {gemm:.1f} TFLOPs" in out
    assert out.count("flash4/gemm") >= 3  # the ceiling's line, the forward and the backward table
    with open(tmp_path / "sweep.csv") as f:
        records = list(csv.DictReader(f))
    assert len(records) == 4 and list(records[0])[-3:] == ["gemm_tflops", "fwd_gemm_ratio", "bwd_gemm_ratio"]
    full = run.Cell(headdim=128, causal=False, seqlen=1024, batch=32, nheads=16)
    fwd = run.tflops(run.fwd_flops(full), 0.5)
    assert math.isclose(float(records[0]["fwd_tflops"]), fwd, rel_tol=1e-3)
    assert records[0]["fwd_gemm_ratio"] == f"{fwd / gemm:.3f}"
    assert records[0]["bwd_gemm_ratio"] == f"{run.tflops(2.5 * run.fwd_flops(full), 2.0) / gemm:.3f}"
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["meta"]["gemm"]["m"] == 64 and math.isclose(doc["meta"]["gemm"]["tflops"], gemm)
    assert math.isclose(doc["rows"][0]["fwd_gemm_ratio"], fwd / gemm)


def test_portable_family_rows_and_target(tmp_path):
    """--family portable: issue 24's CSV columns (impl flash4_portable) and the FA2 target."""
    from flash4.__main__ import build_parser

    assert build_parser().parse_args(["bench", "--family", "portable"]).family == "portable"
    assert build_parser().parse_args(["bench"]).family == "default"
    rows = [dict(impl="flash4", headdim=128, causal=False, seqlen=16384, batch=2, nheads=16, fwd_tflops=200.0,
                 bwd_tflops=100.0),
            dict(impl="sdpa_flash", headdim=128, causal=False, seqlen=16384, batch=2, nheads=16, fwd_tflops=150.0,
                 bwd_tflops=120.0)]
    run.write_portable_csv(rows, tmp_path / "portable.csv")
    lines = (tmp_path / "portable.csv").read_text().splitlines()
    assert lines[0] == ",".join(run.PORTABLE_COLUMNS)
    assert lines[1].startswith("flash4_portable,d128_16k_full,128,0,16384,16384,2,16,16,200.0,100.0")
    fwd, = run.targets_summary(rows, family="portable")
    bwd, = run.targets_summary(rows, "bwd_tflops", family="portable")
    assert "sdpa_flash" in fwd and "MET" in fwd and "MISSED" in bwd
