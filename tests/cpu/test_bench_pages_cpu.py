"""tools/bench_pages.py without a GPU: --help, the no-GPU exit, the table's ratios, refused cells and
issue 29's target verdicts on made-up numbers, the CSV; flash_attn is not imported without --fa4."""

import ast
import csv
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools/bench_pages.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_pages", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records():
    pre = lambda impl, page, tf, gmax="", note="": {  # noqa: E731
        "pass": "prefill", "page": page, "gather_max": gmax, "impl": impl, "tflops": tf, "note": note}
    dec = lambda impl, page, gbps, gmax="", note="": {  # noqa: E731
        "pass": "decode", "page": page, "gather_max": gmax, "impl": impl, "kv_gbps": gbps, "note": note}
    return [pre("flash4", 0, 600.0), pre("fa4", 0, 580.0),
            pre("flash4", 1, 540.0, "default"), pre("fa4", 1, 500.0),
            pre("flash4", 4, 480.0, "default"), pre("fa4", 4, math.nan, note="refused: AssertionError: page"),
            pre("flash4", 16, 470.0, "0"), pre("flash4", 16, 500.0, "32"), pre("fa4", 16, 450.0),
            dec("flash4", 0, 4000.0), dec("fa4", 0, 3800.0),
            dec("flash4", 1, 3400.0, "default"), dec("fa4", 1, 3000.0, note="eager")]


def test_help_and_no_gpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "--fa4" in res.stdout and "--out" in res.stdout
    code = ("import runpy, sys, torch; torch.cuda.is_available = lambda: False; sys.argv = ['bench_pages', '--fa4'];"
            f"runpy.run_path({str(TOOL)!r}, run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code + "\n"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr


def test_table_ratios_and_targets():
    tool = _tool()
    lines = tool.table(_records(), copy_gbps=4000.0)
    assert lines[0] == ["cell", "flash4", "FA4", "flash4/FA4", "flash4/contiguous", "issue 29 target"]
    rows = {line[0]: line[1:] for line in lines[1:]}
    assert rows["prefill contiguous"] == ["600", "580", "1.034", "1.000", "-"]
    assert rows["prefill page 1"] == ["540", "500", "1.080", "0.900", "met"]
    assert rows["prefill page 4"][:4] == ["480", "refused", "-", "0.800"]
    assert rows["prefill page 4"][4] == "MISSED (< 1.0x FA4, < 0.85x contiguous)"
    assert rows["prefill page 16 gather_max=0"] == ["470", "450", "1.044", "0.783", "-"]
    assert rows["prefill page 16 gather_max=32"][:2] == ["500", "450"]
    assert rows["decode contiguous"] == ["1.000", "0.950", "1.053", "1.000", "met"]
    assert rows["decode page 1"] == ["0.850", "0.750 (eager)", "1.133", "0.850", "MISSED (< 0.87 of copy)"]
    assert "decode" in tool.format_table(lines)


def test_csv(tmp_path):
    tool = _tool()
    records = _records()
    tool.write_outputs(str(tmp_path / "out"), records, 4000.0, "the table")
    with open(tmp_path / "out/bench_pages.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(tool.COLUMNS) and len(rows) == len(records)
    assert rows[5]["impl"] == "fa4" and rows[5]["note"].startswith("refused")
    assert (tmp_path / "out/bench_pages.txt").read_text() == "the table\n"


def test_flash_attn_only_with_fa4():
    """flash-attn-4 is reached only through flash4.bench.baselines, inside _fa4_func (called for --fa4)."""
    tree = ast.parse(TOOL.read_text())
    users = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
             for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))
             and ("baselines" in ast.dump(sub) or "flash_attn" in ast.dump(sub))}
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert users == {"_fa4_func"} and not any("flash_attn" in ast.dump(n) or "bench" in ast.dump(n) for n in top)


def test_median_of_rounds():
    """--rounds: each cell's time is the median of its timings (one slow pass does not decide a row)."""
    import bench_pages

    times = iter([1.0, 9.0, 2.0])
    assert bench_pages._median_of(3, lambda: next(times)) == 2.0
    assert bench_pages._median_of(0, lambda: 5.0) == 5.0  # at least one timing
