"""tools/kernel_fingerprint.py --family sm80 on the CPU (nothing compiled): the portable family's
kernel list per target."""

import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import kernel_fingerprint as tool  # noqa: E402
from flash4.config import sm80  # noqa: E402


def test_sm80_list_covers_the_shipped_configs_of_each_target():
    items = tool.all_configs(family="sm80", archs=(80, 90))
    keys = [(kind, repr(cfg)) for kind, cfg in items]
    assert len(keys) == len(set(keys))
    assert {type(cfg).__name__ for _, cfg in items} == {"Sm80FwdConfig", "Sm80BwdConfig"}
    for arch in (80, 90):
        fwd = {repr(c) for k, c in items if k == "fwd" and c.arch == arch}
        bwd = {repr(c) for k, c in items if k == "bwd" and c.arch == arch}
        assert {repr(c) for c in sm80.shipped_fwd_configs(arch)} < fwd
        assert {repr(c) for c in sm80.shipped_bwd_configs(arch)} < bwd
        assert any(c.page_gather for k, c in items if k == "fwd" and c.arch == arch)
        assert any(c.split_kv for k, c in items if k == "fwd" and c.arch == arch)
        assert any(c.dq_coalesced for k, c in items if k == "bwd" and c.arch == arch)
        # what the plain dense backward runs (the shipped candidate), bf16 and fp16
        shipped = [sm80.bwd_candidates(c)[sm80.shipped_bwd_candidate(c)] for c in sm80.shipped_bwd_configs(arch)
                   if sm80.shipped_bwd_candidate(c) in sm80.bwd_candidates(c)]
        assert {c.dtype for c in shipped} == {"bf16", "fp16"} and {repr(c) for c in shipped} < bwd


def test_sm80_only_and_default_arch():
    assert {k for k, _ in tool.all_configs("bwd", family="sm80")} == {"bwd"}
    assert {c.arch for _, c in tool.all_configs("fwd", family="sm80")} == {80}


def test_list_cli(capsys):
    assert tool.main(["--family", "sm80", "--arch", "86", "--only", "fwd", "--list"]) == 0
    out = capsys.readouterr().out
    assert "Sm80FwdConfig(" in out and "arch=86" in out and "Sm80BwdConfig" not in out
