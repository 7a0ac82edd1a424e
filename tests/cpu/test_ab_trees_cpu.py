"""tools/ab_trees.py on the CPU: the bench command per tree and the table, with a fake bench (no GPU)."""

import csv
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import ab_trees  # noqa: E402


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_named_cases_are_read_and_keyed_by_name(monkeypatch, tmp_path, capsys):
    seen = []

    def fake_run(cmd, env, capture_output, text):
        seen.append((cmd, env["PYTHONPATH"].split(os.pathsep)[0]))
        out = cmd[cmd.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        b = "B" in out  # the second tree: 10 % faster
        _write(os.path.join(out, "sweep.csv"), [dict(impl="flash4", headdim="128", causal="1", seqlen="1024",
                                                     fwd_tflops=100 * (1.1 if b else 1), bwd_tflops=50)])
        _write(os.path.join(out, "cases.csv"), [dict(impl="flash4", case="sink_x", headdim="64", causal="1",
                                                     fwd_tflops=80, bwd_tflops=70 * (1.1 if b else 1)),
                                                dict(impl="flash_attn_4", case="sink_x", headdim="64", causal="1",
                                                     fwd_tflops=1, bwd_tflops=1)])
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(ab_trees.subprocess, "run", fake_run)
    out = tmp_path / "ab"
    assert ab_trees.main(["a/src", "b/src", "--rounds", "1", "--cases", "sink_x", "--headdims", "128", "--seqlens",
                          "1k", "--causal", "1", "--out", str(out)]) == 0
    assert [cmd[cmd.index("--cases") + 1] for cmd, _ in seen] == ["sink_x", "sink_x"]
    assert [src.endswith(("a/src", "b/src")[i]) for i, (_, src) in enumerate(seen)] == [True, True]
    table = (out / "ab.csv").read_text().splitlines()
    assert table[1].startswith("d128 causal 1024,100.0,110.0,1.100")
    assert table[2].startswith("sink_x,80.0,80.0,1.000,70.0,77.0,1.100")
