"""`python -m flash4 bench --ablate` without a GPU: variant table, round order, tables, CSV/JSON, CLI."""

import csv
import dataclasses
import json
import math
import sys
import types

import pytest
import torch

from flash4.__main__ import build_parser
from flash4.__main__ import main as cli_main
from flash4.bench import ablate, common, run
from flash4.bench.report import format_table
from flash4.config import select_fwd_config


def test_variant_table_names_and_overrides():
    assert ablate.VARIANT_NAMES == ("default", "emulated_exp2_25", "emulated_exp2_50", "no_emulated_exp2",
                                    "always_rescale", "no_lpt_persistent", "lpt_persistent", "lpt")
    for d in (64, 128, 256):
        for causal in (False, True):
            base = select_fwd_config(d, "bf16", causal)
            cfg = {v: ablate.variant_config(v, d, causal) for v in ablate.VARIANT_NAMES}
            assert cfg["default"] == base
            assert cfg["emulated_exp2_25"] == dataclasses.replace(base, exp2_emu_frac=0.25)
            assert cfg["emulated_exp2_50"] == dataclasses.replace(base, exp2_emu_frac=0.5)
            assert cfg["no_emulated_exp2"].exp2_emu_frac == 0.0
            assert cfg["always_rescale"] == dataclasses.replace(base, rescale_threshold=0.0)
            assert (cfg["no_lpt_persistent"].lpt, cfg["no_lpt_persistent"].persistent) == (False, False)
            assert (cfg["lpt_persistent"].lpt, cfg["lpt_persistent"].persistent) == (True, True)
            assert (cfg["lpt"].lpt, cfg["lpt"].persistent) == (True, False)
            for c in cfg.values():  # only the ablated fields differ
                assert (c.headdim, c.causal, c.tile_m, c.tile_n, c.kv_stages) == (
                    base.headdim, base.causal, base.tile_m, base.tile_n, base.kv_stages)


def test_selected_variants_default_first():
    assert ablate.selected_variants() == list(ablate.VARIANT_NAMES)
    assert ablate.selected_variants(["lpt", "always_rescale"]) == ["default", "always_rescale", "lpt"]


def test_round_orders_interleave_every_variant_once_per_round():
    names = ["default", "a", "b"]
    orders = ablate.round_orders(names, 3)
    assert orders == [["default", "a", "b"], ["a", "b", "default"], ["b", "default", "a"]]
    orders = ablate.round_orders(ablate.VARIANT_NAMES, ablate.ROUNDS)
    assert ablate.ROUNDS == 3 and len(orders) == 3
    assert all(sorted(o) == sorted(ablate.VARIANT_NAMES) for o in orders)


def test_same_as_default():
    same = ablate.same_as_default(ablate.VARIANT_NAMES, (64, 128), (False, True))
    # as of this commit select_fwd_config: no emulated exp2, tau = 8, lpt = causal, not persistent
    base = select_fwd_config(128, "bf16", True)
    if base.exp2_emu_frac == 0.0 and not base.persistent and base.lpt and not select_fwd_config(128).lpt:
        assert same["no_emulated_exp2"] == [(64, False), (64, True), (128, False), (128, True)]
        assert same["lpt"] == [(64, True), (128, True)]
        assert same["no_lpt_persistent"] == [(64, False), (128, False)]
    assert "default" not in same and "always_rescale" not in same and "emulated_exp2_25" not in same
    lines = ablate.describe_same({"x": [(64, False), (128, False)], "y": [(64, True)]}, (64, 128), (False,))
    assert lines == ["  x = default on every cell (differences there are noise)",
                     "  y = default on hdim 64 causal (differences there are noise)"]


def test_median_of_rounds():
    assert ablate.median_or_nan([1.0, 3.0, 2.0]) == 2.0
    assert math.isnan(ablate.median_or_nan([1.0, math.nan, 2.0]))
    assert math.isnan(ablate.median_or_nan([]))


def fake_rows():
    cells = common.sweep_cells((128,), (4096,), (False, True))
    rows = []
    for cell in cells:
        times = {"default": [1.0, 1.1, 0.9], "always_rescale": [1.2, 1.2, 1.3], "lpt": [math.nan] * 3}
        if cell.causal:
            times["always_rescale"] = [0.5, 0.5, 0.5]
        rows.extend(ablate._cell_rows(cell, times))
    return rows


def test_cell_rows_and_ratio_table():
    rows = fake_rows()
    assert [r["variant"] for r in rows[:3]] == ["default", "always_rescale", "lpt"]
    full = common.Cell(headdim=128, causal=False, seqlen=4096, batch=8, nheads=16)
    assert math.isclose(rows[0]["fwd_tflops"], common.tflops(common.fwd_flops(full), 1.0))
    assert rows[0]["times_ms"] == [1.0, 1.1, 0.9] and math.isnan(rows[2]["fwd_tflops"])
    headers, table = ablate.ratio_table(rows)
    assert headers == ["hdim", "causal", "seqlen", "default TFLOPs", "always_rescale/default", "lpt/default"]
    assert table[0][:3] == [128, 0, "4k"] and math.isclose(table[0][4], 1.0 / 1.2)
    assert math.isclose(table[1][4], 1.0 / 0.5) and math.isnan(table[1][5])
    assert table[2][0] == "geomean" and math.isclose(table[2][4], math.sqrt(1.0 / 1.2 * 2.0))
    assert math.isnan(table[2][5])
    text = format_table(headers, table)
    assert "always_rescale/default" in text and "geomean" in text and "2.00" in text


def test_csv_and_json(tmp_path):
    rows = fake_rows()
    ablate.write_csv(rows, tmp_path / "ablation.csv")
    with open(tmp_path / "ablation.csv") as f:
        records = list(csv.reader(f))
    assert records[0] == ["variant", "headdim", "causal", "seqlen", "fwd_tflops"]
    assert len(records) == 1 + 6
    assert records[1][:4] == ["default", "128", "0", "4096"] and float(records[1][4]) > 0
    assert records[3] == ["lpt", "128", "0", "4096", "nan"]
    assert {r[2] for r in records[1:]} == {"0", "1"}
    ablate.write_json(tmp_path / "ablation.json", {"gpu": "test"}, rows, [], {"lpt": [(128, True)]})
    doc = json.loads((tmp_path / "ablation.json").read_text())
    assert doc["meta"] == {"gpu": "test"} and doc["rows"][2]["fwd_tflops"] is None
    assert doc["rows"][2]["times_ms"] == [None] * 3 and doc["same_config_as_default"] == {"lpt": [[128, 1]]}


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_cli_parsing():
    args = parse("--ablate", "--headdims", "128", "256", "--seqlens", "4k", "16384", "--causal", "1",
                 "--variants", "lpt", "always_rescale", "--out", "somewhere")
    assert args.ablate and args.headdims == [128, 256] and args.seqlens == [4096, 16384]
    assert args.causal == "1" and args.variants == ["lpt", "always_rescale"] and args.out == "somewhere"
    assert ablate.argument_error(args) is None
    plain = parse()
    assert not plain.ablate and plain.variants is None and ablate.argument_error(plain) is None
    assert ablate.argument_error(parse("--variants", "lpt")) == "--variants needs --ablate"
    assert "--impls" in ablate.argument_error(parse("--ablate", "--impls", "flash4"))
    assert ablate.argument_error(parse("--ablate", "--no-bwd")) is None  # forward-only anyway
    assert "--headdims 32 not supported" in ablate.argument_error(parse("--ablate", "--headdims", "32", "128"))
    with pytest.raises(SystemExit):
        parse("--ablate", "--variants", "no_such_variant")


@pytest.mark.parametrize("argv", [["--variants", "lpt"], ["--ablate", "--impls", "sdpa_cudnn"],
                                  ["--ablate", "--headdims", "48"]])
def test_cli_refuses_bad_combinations(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", *argv])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.fixture
def fake_compile_check(monkeypatch):
    calls = []

    def compile_check(configs):
        calls.extend(configs)
        return [{"config": str(c), "ok": True, "error": None, "compile_s": 1.0, "registers": 168, "spills": 0,
                 "smem_bytes": c.smem_bytes()} for c in configs]

    module = types.ModuleType("flash4.compile.check")
    module.compile_check = compile_check
    monkeypatch.setitem(sys.modules, "flash4.compile.check", module)
    return calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_ablate_without_gpu_compile_checks_the_variants(fake_compile_check, capsys):
    calls = fake_compile_check
    assert cli_main(["bench", "--ablate", "--headdims", "128", "--variants", "always_rescale", "lpt"]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU found" in out and "Ignored" not in out
    expected = {ablate.variant_config(v, 128, c, "bf16", s) for v in ("default", "always_rescale", "lpt")
                for c in (False, True) for s in ablate.DEFAULT_SEQLENS}
    assert len(calls) == len(expected) and set(calls) == expected  # equal configs compiled once
    calls.clear()
    argv = ["bench", "--ablate", "--headdims", "64", "--dtype", "fp16", "--causal", "1", "--variants", "lpt",
            "--rep-ms", "10", "--out", "x"]
    assert cli_main(argv) == 0
    assert "Ignored: --rep-ms, --out." in capsys.readouterr().out
    assert set(calls) == {ablate.variant_config(v, 64, True, "fp16", s) for v in ("default", "lpt")
                          for s in ablate.DEFAULT_SEQLENS}


def test_measure_interleaves_rounds(monkeypatch):
    """measure() with CPU tensors, a fake runner and a fake timer: every round times every variant
    once, rotated; the reported TFLOPs come from the median round."""
    launched, timed = [], []

    def get_fwd_runner(cfg):
        return lambda q, k, v, out, lse, scale: launched.append(cfg)

    fake_cache = types.ModuleType("flash4.compile.cache")
    fake_cache.get_fwd_runner = get_fwd_runner
    monkeypatch.setitem(sys.modules, "flash4.compile.cache", fake_cache)
    monkeypatch.setattr(common, "make_inputs", lambda b, sq, sk, h, hk, d, dtype, seed=0: tuple(
        torch.zeros(b, sq if i == 0 else sk, h, d, dtype=dtype) for i in range(3)))
    ms_of = {"default": iter([1.0, 3.0, 2.0]), "always_rescale": iter([4.0, 4.0, 4.0]), "lpt": iter([2.0, 2.0, 2.0])}

    def time_ms(fn, rep_ms=100.0):
        n = len(launched)
        fn()
        name = next(v for v in ms_of if ablate.variant_config(v, 128, False, "bf16", 64) == launched[n])
        timed.append(name)
        return next(ms_of[name])

    monkeypatch.setattr(common, "time_ms", time_ms)
    cell = common.Cell(headdim=128, causal=False, seqlen=64, batch=2, nheads=2)
    # lpt's config differs from default's on non-causal cells (d128 full: no short-sequence config),
    # so the fake runner tells them apart
    rows = ablate.measure(["default", "always_rescale", "lpt"], [cell], "bf16")
    assert timed == ["default", "always_rescale", "lpt", "always_rescale", "lpt", "default",
                     "lpt", "default", "always_rescale"]
    by = {r["variant"]: r for r in rows}
    assert by["default"]["times_ms"] == [1.0, 3.0, 2.0]
    assert math.isclose(by["default"]["fwd_tflops"], common.tflops(common.fwd_flops(cell), 2.0))
    assert math.isclose(by["always_rescale"]["fwd_tflops"], common.tflops(common.fwd_flops(cell), 4.0))


def test_ablate_main_end_to_end_with_fakes(monkeypatch, tmp_path, capsys):
    """ablate.main as on a GPU, with CPU tensors: the runner writes the float32 reference (so every
    variant passes its check) and the timer returns a fixed time per variant."""
    from flash4.reference import attention_ref

    def get_fwd_runner(cfg):
        def runner(q, k, v, out, lse, scale):
            o, l = attention_ref(q, k, v, scale, cfg.causal)
            out.copy_(o)
            lse.copy_(l)
        runner.cfg = cfg
        return runner

    fake_cache = types.ModuleType("flash4.compile.cache")
    fake_cache.get_fwd_runner = get_fwd_runner
    monkeypatch.setitem(sys.modules, "flash4.compile.cache", fake_cache)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(run, "collect_metadata", lambda dtype: {"gpu": "fake", "timing": "fake", "dtype": dtype})
    monkeypatch.setattr(common, "make_inputs", lambda b, sq, sk, h, hk, d, dtype, seed=0: tuple(
        torch.randn(b, sq if i == 0 else sk, h, d).to(dtype) for i in range(3)))
    monkeypatch.setattr(ablate, "CHECK_SHAPES", ((1, 40, 40, 2), (1, 30, 50, 2)))
    ms = {"default": 2.0, "always_rescale": 2.5, "lpt": 1.0}

    def time_ms(fn, rep_ms=100.0):
        cfg = fn.__defaults__[0].cfg  # the runner bound into measure()'s lambda
        return next(ms[v] for v in ms if ablate.variant_config(v, 256, cfg.causal) == cfg)

    monkeypatch.setattr(common, "time_ms", time_ms)
    argv = ["bench", "--ablate", "--headdims", "256", "--seqlens", "256", "--variants", "always_rescale", "lpt",
            "--out", str(tmp_path)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "9/9 ok" in out  # 3 variants x (square full, square causal, rectangular causal)
    assert "always_rescale/default" in out and "lpt = default on hdim 256 causal" in out
    with open(tmp_path / "ablation.csv") as f:
        records = list(csv.DictReader(f))
    assert [(r["variant"], r["causal"]) for r in records] == [
        ("default", "0"), ("always_rescale", "0"), ("lpt", "0"), ("default", "1"), ("always_rescale", "1"),
        ("lpt", "1")]
    by = {(r["variant"], r["causal"]): float(r["fwd_tflops"]) for r in records}
    assert math.isclose(by[("always_rescale", "0")] / by[("default", "0")], 2.0 / 2.5, rel_tol=1e-2)
    doc = json.loads((tmp_path / "ablation.json").read_text())
    assert doc["meta"]["ablation"]["rounds"] == 3 and len(doc["correctness"]) == 9
    assert all(len(r["times_ms"]) == 3 for r in doc["rows"])


def test_variants_follow_the_short_sequence_config():
    """At seqlen_k <= SHORT_SEQLEN_K the ablation's default is what flash_attn_func runs there
    (the persistent short-sequence config), and variants replace fields on top of it."""
    from flash4.config import SHORT_SEQLEN_K, select_fwd_config

    for d, c in ((64, False), (64, True), (128, True), (128, False), (256, True)):
        assert ablate.variant_config("default", d, c, "bf16", SHORT_SEQLEN_K) == select_fwd_config(
            d, "bf16", c, seqlen_k=SHORT_SEQLEN_K)
        assert ablate.variant_config("default", d, c, "bf16", 4096) == select_fwd_config(d, "bf16", c, seqlen_k=4096)
    short = ablate.variant_config("no_lpt_persistent", 64, True, "bf16", 1024)
    assert not short.persistent and not short.lpt and short.tile_m == 128
    # lpt_persistent equals the default at 1k (d64) but not at 4k: not listed as the same config
    assert (64, False) not in ablate.same_as_default(["default", "lpt_persistent"], (64,), (False,), "bf16",
                                                     (1024, 4096)).get("lpt_persistent", [])
    assert (64, False) in ablate.same_as_default(["default", "lpt_persistent"], (64,), (False,), "bf16",
                                                 (1024,)).get("lpt_persistent", [])
