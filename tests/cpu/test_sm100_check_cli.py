"""`python -m flash4 compile-check --arch sm_100a` (flash4.compile.sm100_check), forward and backward:
the PTX readers, the pass/fail rule, the report's label and columns, the CLI's dispatch and filters,
without compiling; then one real backward row (one compile, a few seconds). The real compiles of
every sm100 config are tests/cpu/test_sm100_compile.py's and test_sm100_bwd_compile.py's."""

from __future__ import annotations

import json

import pytest

from flash4 import __main__ as cli
from flash4.compile import sm100_check
from flash4.config import sm100

PTX = """
    setmaxnreg.inc.sync.aligned.u32 192;
    setmaxnreg.dec.sync.aligned.u32 72;
    setmaxnreg.dec.sync.aligned.u32 56;
    mov.b32 %r7, 512;
    tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r3], %r7;
"""


def test_ptx_readers():
    assert sm100_check.setmaxnreg_operands(PTX) == [("dec", 56), ("dec", 72), ("inc", 192)]
    assert sm100_check.tmem_alloc_operands(PTX) == [512]


def test_configs_and_filters():
    assert sm100_check.configs() == sm100.shipped_fwd_configs(features=False)
    # 96 1-CTA q_stage 2 + 8 2-CTA (hd128 non-causal) + 64 q_stage 1 ((192, 128) and hd256)
    assert len(sm100_check.configs(features=True)) == 168
    picked = sm100_check.configs(headdims=[128], dtypes=["bf16"], causals=(True,))
    assert picked == [sm100.select_fwd_config(128, "bf16", True)]
    # the backward: shipped_bwd_configs, the window ones with features
    bwd = sm100_check.configs(passes=("bwd",))
    # hd64 / hd128 16, (192, 128) 8, 2-CTA (hd128, then (192, 128)) 4 + 4
    assert len(bwd) == 16 + 8 + 4 + 4 and all(sm100_check.is_bwd(c) and not c.local for c in bwd)
    assert sm100_check.name(bwd[16]) == "bwd_sm100 d192v128 bf16 full 128x128 1cta q1do1"
    assert [c.cta_group for c in bwd[-8:]] == [2] * 8
    assert [(c.headdim, c.hdim_v) for c in bwd[-4:]] == [(192, 128)] * 4
    assert sm100_check.configs(passes=("bwd",), features=True) == sm100.shipped_bwd_configs()
    both = sm100_check.configs(headdims=[64], dtypes=["fp16"], causals=(True,), passes=("fwd", "bwd"))
    assert both == [sm100.select_fwd_config(64, "fp16", True), sm100.select_bwd_config(64, "fp16", True),
                    sm100.select_bwd_config(64, "fp16", True, deterministic=True)]
    assert sm100_check.name(both[2]) == "bwd_sm100 d64 fp16 causal 128x128 1cta q2do1 det"


def _row(cfg, **over):
    plan = sm100.register_plan(cfg)
    row = {"config": sm100_check.name(cfg), "pass": "fwd", "ok": True, "cta_group": cfg.cta_group, "error": None, "compile_s": 3.0, "compile_cpu_s": 2.9,
           "label": sm100_check.LABEL, "regs_softmax": plan.softmax, "regs_correction": plan.correction,
           "regs_other": plan.other, "tmem_used": sm100.tmem_used_cols(cfg), "tmem_alloc": 512,
           "smem_bytes": cfg.smem_bytes(), "setmaxnreg_ok": True, "tmem_alloc_ok": True, "spills": 0,
           "stack_bytes": 0, "hgmma": 0, "utchmma": 32, "utchmma_2cta": 32 if cfg.cta_group == 2 else 0, "utcbar": 9, "ldtm": 28, "sttm": 20, "utmaldg": 12,
           "utmastg": 4, "mufu_ex2": 338, "ffma2": 264, "fadd2_rm": 24, "mufu_tanh": 0}
    row.update(over)
    return row


def _bwd_row(cfg, **over):
    plan = sm100.bwd_register_plan(cfg)
    row = {"config": sm100_check.name(cfg), "pass": "bwd", "ok": True, "cta_group": 1, "error": None, "compile_s": 2.5,
           "compile_cpu_s": 2.3, "label": sm100_check.LABEL, "regs_reduce": plan.reduce, "regs_compute": plan.compute,
           "regs_other": plan.other, "tmem_used": sm100.bwd_tmem_used_cols(cfg), "tmem_alloc": 512,
           "smem_bytes": cfg.smem_bytes(), "setmaxnreg_ok": True, "tmem_alloc_ok": True, "spills": 0, "stack_bytes": 0,
           "hgmma": 0, "utchmma": 40, "utchmma_2cta": 0, "utcbar": 9, "ldtm": 10, "sttm": 4, "utmaldg": 4,
           "ublkred": 4, "ublkcp": 2, "mufu_ex2": 64, "strong_sem": 3 if cfg.deterministic else 0}
    row.update(over)
    return row


def test_problems():
    cfg = sm100.select_fwd_config(128, "bf16", True)
    assert sm100_check.problems(_row(cfg)) == []
    assert "local memory" in sm100_check.problems(_row(cfg, spills=3, stack_bytes=8))[0]
    assert "setmaxnreg" in sm100_check.problems(_row(cfg, setmaxnreg_ok=False))[0]
    assert "tcgen05.alloc" in sm100_check.problems(_row(cfg, tmem_alloc_ok=False))[0]
    assert "HGMMA" in sm100_check.problems(_row(cfg, hgmma=4))[0]
    assert "compile error" in sm100_check.problems(_row(cfg, ok=False, error="DSLRuntimeError: boom"))[0]
    # .2CTA exactly where the config says 2-CTA
    assert ".2CTA" in sm100_check.problems(_row(cfg, utchmma_2cta=32))[0]
    two = sm100.select_fwd_config(128, two_cta=True)
    assert sm100_check.problems(_row(two)) == []
    assert ".2CTA" in sm100_check.problems(_row(two, utchmma_2cta=0))[0]


def test_cli_reports_with_the_label(monkeypatch, capsys, tmp_path):
    seen = []

    def fake_check_one(cfg):
        seen.append(cfg)
        return _row(cfg, spills=2) if cfg.headdim == 64 else _row(cfg)

    monkeypatch.setattr(sm100_check, "check_one", fake_check_one)
    out_json = tmp_path / "r.json"
    rc = cli.main(["compile-check", "--arch", "sm_100a", "--pass", "fwd", "--headdims", "64", "128", "--dtypes", "bf16",
                   "--causal", "0", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert seen == [sm100.select_fwd_config(64), sm100.select_fwd_config(128), sm100.select_fwd_config(128, two_cta=True)]
    assert rc == 1 and "FAIL fwd_sm100 d64" in text  # a spill fails the check
    assert text.count("compile-verified for sm_100a, not yet run on Blackwell hardware") == 2
    assert "1cta" in text and "2cta" in text and "184/80/64" in text  # the 2-CTA config is in the report
    for header in ("regs sm/corr/other", "TMEM used/alloc", "smem KiB", "UTCHMMA", "MUFU.EX2", "FFMA2", "compile_s"):
        assert header in text
    assert "200/64/48" in text and "192/80/48" in text  # FA4's budgets for hd64 / hd128 full
    rows = json.loads(out_json.read_text())
    assert [r["label"] for r in rows] == [sm100_check.LABEL] * 3
    monkeypatch.setattr(sm100_check, "check_one", lambda cfg: _row(cfg))
    assert cli.main(["compile-check", "--arch", "sm_100a", "--features", "--headdims", "96", "--dtypes", "fp16"]) == 0
    assert "16 forward config(s), 0 backward config(s)" in capsys.readouterr().out


def test_cli_reports_backward_rows(monkeypatch, capsys, tmp_path):
    """The default report lists the backward's configs after the forward's, in their own table
    (regs dQ-reduce / compute / other, UBLKRED, ...); --pass bwd alone; a bwd spill fails it."""
    seen = []

    def fake_check_one(cfg):
        seen.append(cfg)
        if sm100_check.is_bwd(cfg):
            return _bwd_row(cfg, spills=4) if cfg.deterministic else _bwd_row(cfg)
        return _row(cfg)

    monkeypatch.setattr(sm100_check, "check_one", fake_check_one)
    out_json = tmp_path / "r.json"
    rc = cli.main(["compile-check", "--arch", "sm_100a", "--headdims", "128", "--dtypes", "bf16", "--causal", "1",
                   "--json", str(out_json)])
    text = capsys.readouterr().out
    assert seen == [sm100.select_fwd_config(128, "bf16", True), sm100.select_bwd_config(128, "bf16", True),
                    sm100.select_bwd_config(128, "bf16", True, deterministic=True),
                    sm100.select_bwd_config(128, "bf16", True, two_cta=True)]  # the 2-CTA backward (opt-in)
    assert "1 forward config(s), 3 backward config(s)" in text
    assert text.count(sm100_check.LABEL) == 2
    fwd_at, bwd_at = text.index("forward (1):"), text.index("backward (3):")
    assert fwd_at < bwd_at and text.index("fwd_sm100 d128") < bwd_at < text.index("bwd_sm100 d128 bf16 causal")
    for header in ("regs red/comp/other", "TMEM used/alloc", "smem KiB", "LDL/STL", "stack", "UTCHMMA", "UBLKRED",
                   "UBLKCP", "MUFU.EX2", "LDG/REDG.STRONG", "compile_s", "cpu_s"):
        assert header in text[bwd_at:], header
    assert "152/136/88" in text and "512/512" in text
    assert rc == 1 and "FAIL bwd_sm100 d128 bf16 causal 128x128 1cta q2do1 det: local memory" in text
    rows = json.loads(out_json.read_text())
    assert [r["pass"] for r in rows] == ["fwd", "bwd", "bwd", "bwd"] and rows[1]["ublkred"] == 4
    assert cli.main(["compile-check", "--arch", "sm_100a", "--pass", "bwd", "--features", "--dtypes", "fp16",
                     "--causal", "0"]) == 1
    text = capsys.readouterr().out
    # hd64 / hd128 8, (192, 128) 4 + 4 with softcap, 2-CTA 1 + 1 (hd128, (192, 128))
    assert "0 forward config(s), 18 backward config(s)" in text and "bwd_sm100 d64 fp16 window" in text
    assert "bwd_sm100 d192v128 fp16 window" in text


def test_one_real_backward_row():
    """check_one on one backward config (hd64 bf16, one compile): the PTX's setmaxnreg / alloc
    operands equal the plan, the SASS has the dQ reduce-adds and the bulk loads, nothing fails."""
    pytest.importorskip("cutlass")
    row = sm100_check.check_one(sm100.select_bwd_config(64, "bf16", False))
    assert row["ok"], row.get("traceback")
    assert row["pass"] == "bwd" and row["setmaxnreg_ok"] and row["tmem_alloc_ok"], row
    assert (row["regs_reduce"], row["regs_compute"], row["regs_other"]) == (136, 144, 88)  # hd64's plan
    assert row["tmem_alloc"] == 512 and row["label"] == sm100_check.LABEL
    if row.get("utchmma") is None:
        pytest.skip("cuobjdump not installed: SASS not read")
    assert (row["ublkred"], row["ublkcp"], row["strong_sem"], row["utchmma_2cta"]) == (4, 2, 0, 0), row
    assert sm100_check.problems(row) == [], row
