"""`python -m flash4 compile-check --arch sm_100a` (flash4.compile.sm100_check) without compiling: the
PTX readers, the pass/fail rule, the report's label and columns, the CLI's dispatch and filters. The
real compiles of the sm100 configs are tests/cpu/test_sm100_compile.py's."""

from __future__ import annotations

import json

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


def _row(cfg, **over):
    plan = sm100.register_plan(cfg)
    row = {"config": sm100_check.name(cfg), "ok": True, "cta_group": cfg.cta_group, "error": None, "compile_s": 3.0, "compile_cpu_s": 2.9,
           "label": sm100_check.LABEL, "regs_softmax": plan.softmax, "regs_correction": plan.correction,
           "regs_other": plan.other, "tmem_used": sm100.tmem_used_cols(cfg), "tmem_alloc": 512,
           "smem_bytes": cfg.smem_bytes(), "setmaxnreg_ok": True, "tmem_alloc_ok": True, "spills": 0,
           "stack_bytes": 0, "hgmma": 0, "utchmma": 32, "utchmma_2cta": 32 if cfg.cta_group == 2 else 0, "utcbar": 9, "ldtm": 28, "sttm": 20, "utmaldg": 12,
           "utmastg": 4, "mufu_ex2": 338, "ffma2": 264, "fadd2_rm": 24, "mufu_tanh": 0}
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
    rc = cli.main(["compile-check", "--arch", "sm_100a", "--headdims", "64", "128", "--dtypes", "bf16",
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
    assert "16 forward config(s)" in capsys.readouterr().out
