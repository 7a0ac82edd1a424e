"""tools/ab_tails.py on the CPU (no GPU, no compile): the plan of both variants, and --env."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))


@pytest.fixture
def tool(monkeypatch):
    import ab_tails

    for name in ("FLASH4_FWD_SWITCHES", "FLASH4_BWD_SWITCHES", "FLASH4_PAGE_PREFETCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ab_tails, "ALT", dict(ab_tails.ALT))
    monkeypatch.setattr(ab_tails, "ALT_NAME", ab_tails.ALT_NAME)
    return ab_tails


def test_plan_pairs_each_kernel_with_its_unguarded_twin(tool):
    items = tool.plan_kernels()
    guarded = [c for _, c in items if not c.no_tail_guard]
    unguarded = [c for _, c in items if c.no_tail_guard]
    assert len(guarded) == len(unguarded) >= 4  # decode (dense, paged), varlen, paged prefill, backward
    import dataclasses

    assert {dataclasses.replace(c, no_tail_guard=False) for c in unguarded} == set(guarded)
    assert "FLASH4_FWD_SWITCHES" not in os.environ  # the plan leaves the environment as it was


def test_env_variant(tool, capsys):
    assert tool.main(["--dry-run", "--env", "FLASH4_PAGE_PREFETCH=0"]) == 0
    assert tool.ALT == {"FLASH4_PAGE_PREFETCH": "0"} and tool.ALT_NAME == "alt"
    paged = [c for kind, c in tool.plan_kernels() if kind == "fwd" and c.page_rows]
    assert {c.page_prefetch for c in paged} == {True, False}  # shipped: the look-ahead; alt: off
    assert "FLASH4_PAGE_PREFETCH" not in os.environ
