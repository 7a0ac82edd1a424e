"""FwdConfig / BwdConfig.no_tail_guard (A/B only, off; tools/ab_tails.py): issue 25's guards against
memory past a sequence's end left out, to measure their cost in the same run. On the CPU: off and out
of the repr in every shipped config; FLASH4_FWD_SWITCHES / FLASH4_BWD_SWITCHES turn it on only where
the guards are compiled (ragged layouts), so a dense call keeps its config and its kernel; the switched
kernels compile for sm_90a with 0 spills."""

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config import FwdConfig, select_bwd_config, select_fwd_config, shipped_bwd_configs  # noqa: E402
from flash4.config import shipped_fwd_configs, with_seq_layout  # noqa: E402
from flash4.config.sm90 import with_bwd_switches, with_fwd_switches  # noqa: E402
from flash4.constants import BWD_SPEED_SWITCHES, FWD_SPEED_SWITCHES  # noqa: E402

SWITCH = "no_tail_guard"


def test_off_everywhere_and_out_of_repr():
    assert SWITCH in FWD_SPEED_SWITCHES and SWITCH in BWD_SPEED_SWITCHES
    for cfg in list(shipped_fwd_configs()) + list(shipped_bwd_configs()):
        if hasattr(cfg, SWITCH):
            assert not cfg.no_tail_guard and SWITCH not in repr(cfg)


def test_only_ragged_layouts_take_it():
    dense = select_fwd_config(128, "bf16", True)
    assert with_fwd_switches(dense, (SWITCH,)) == dense
    for flags in (dict(varlen_q=True, varlen_k=True), dict(seqused_k=True), dict(page_rows=64, seqused_k=True),
                  dict(page_gather=True, seqused_k=True), dict(seqused_q=True)):
        cfg = with_seq_layout(dense, **flags)
        assert with_fwd_switches(cfg, (SWITCH,)) == dataclasses.replace(cfg, no_tail_guard=True), flags
    bwd = select_bwd_config(128, "bf16", True)
    assert with_bwd_switches(bwd, (SWITCH,)) == bwd
    for flags in (dict(varlen_q=True, varlen_k=True), dict(seqused_q=True), dict(seqused_k=True)):
        cfg = with_seq_layout(bwd, **flags)
        assert with_bwd_switches(cfg, (SWITCH,)).no_tail_guard, flags


def test_env_reaches_the_plans(monkeypatch):
    from flash4.config import bwd_config, fwd_config
    from flash4.request import Request

    meta = dict(device="meta", dtype=torch.bfloat16)
    qv = torch.empty(1000, 4, 128, **meta)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    req = Request.varlen(qv, qv, qv, cu, cu, 600, 600, softmax_scale=128 ** -0.5, causal=True)
    q = torch.empty(2, 1000, 4, 128, **meta)
    dense = Request.dense(q, q, q, 128 ** -0.5, True)
    monkeypatch.delenv("FLASH4_FWD_SWITCHES", raising=False)
    monkeypatch.delenv("FLASH4_BWD_SWITCHES", raising=False)
    plain = (fwd_config(req, 90).cfg, bwd_config(req, 90).cfg, fwd_config(dense, 90).cfg, bwd_config(dense, 90).cfg)
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", SWITCH)
    monkeypatch.setenv("FLASH4_BWD_SWITCHES", SWITCH)
    on = (fwd_config(req, 90).cfg, bwd_config(req, 90).cfg, fwd_config(dense, 90).cfg, bwd_config(dense, 90).cfg)
    assert on[0] == dataclasses.replace(plain[0], no_tail_guard=True)
    assert on[1] == dataclasses.replace(plain[1], no_tail_guard=True)
    assert on[2:] == plain[2:]  # dense: nothing to leave out


COMPILED = [dataclasses.replace(with_seq_layout(select_fwd_config(128, "bf16", True), varlen_q=True, varlen_k=True),
                                no_tail_guard=True),
            dataclasses.replace(with_seq_layout(select_bwd_config(128, "bf16", True), varlen_q=True, varlen_k=True),
                                no_tail_guard=True)]


@pytest.mark.parametrize("cfg", COMPILED, ids=["fwd-varlen", "bwd-varlen"])
def test_unguarded_compiles_clean(cfg):
    """sm_90a: the switched varlen forward and backward compile, no spill, wgmma not serialized."""
    pytest.importorskip("cutlass")
    from cpu_helpers import compiled_row

    from flash4.compile.cache import compile_bwd, compile_fwd

    compiled = compile_fwd(cfg) if isinstance(cfg, FwdConfig) else compile_bwd(cfg)
    row = compiled_row(compiled, cfg)
    assert row["spills"] == 0 and not row["wgmma_serialized"], row
