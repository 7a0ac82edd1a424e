"""Attention sinks (issue 10 item 3) on the CPU: the reference's semantics, the decode plan's rules
for sinks, and compile checks of the sink forward, split-KV and combine kernels (sm_90a; not yet
run on a GPU)."""

import dataclasses

import pytest
import torch

from flash4.config import select_fwd_config, with_seq_layout
from flash4.config.sm90 import decode_plan
from flash4.reference import attention_ref


def test_reference_sink_joins_the_denominator_only():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    sink = torch.tensor([0.7, -3.0])
    out, lse = attention_ref(q, k, v, learnable_sink=sink)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8 ** 0.5
    want_lse = torch.logsumexp(torch.cat([scores, sink.view(1, 2, 1, 1).expand(1, 2, 4, 1)], -1), -1)
    assert torch.allclose(lse, want_lse, atol=1e-6)
    want_out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - want_lse[..., None]), v)
    assert torch.allclose(out, want_out, atol=1e-6)


def test_reference_sink_far_above_and_rows_without_keys():
    q, k = torch.randn(1, 3, 1, 8), torch.randn(1, 5, 1, 8)
    out, lse = attention_ref(q, k, k, learnable_sink=torch.tensor([40.0]))
    assert torch.allclose(lse, torch.full_like(lse, 40.0), atol=1e-4) and out.abs().max() < 1e-12
    out, lse = attention_ref(torch.randn(1, 6, 1, 8), k[:, :3], k[:, :3], window_size=(0, 0),
                             learnable_sink=torch.tensor([1.5]))
    assert torch.equal(lse[0, 0, :3], torch.full((3,), 1.5)) and (out[0, :3] == 0).all()


def test_decode_plan_with_sink():
    # GQA-packed rows carry several heads' sinks: the combine adds them, so a packed step splits
    plan = decode_plan(64, 1, 64, 8, 64, "bf16", True, 0, 8192, 0, 90, 132, None, False, True)
    assert plan.pack == 8 and plan.num_splits >= 2 and plan.cfg.split_kv and plan.cfg.sink
    # splitting refused (num_splits=1): not packed, the kernel adds each head's sink itself
    plan = decode_plan(64, 1, 64, 8, 64, "bf16", True, 0, 8192, 1, 90, 132, None, False, True)
    assert plan.pack == 1 and plan.num_splits == 1 and plan.cfg.sink and not plan.cfg.split_kv


pytest.importorskip("cutlass")


def _configs():
    return [
        select_fwd_config(128, "bf16", True, sink=True),
        select_fwd_config(64, "bf16", False, local=True, sink=True),
        with_seq_layout(select_fwd_config(64, "bf16", False, sink=True), varlen_q=True, varlen_k=True),
        decode_plan(1, 1, 64, 8, 64, "bf16", True, 64, 131072, 0, 90, 132, None, False, True).cfg,
    ]


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.check import compile_check

    return compile_check(_configs())


@pytest.mark.parametrize("i", range(4), ids=["fwd128c", "fwd64local", "varlen64", "decode_split_paged"])
def test_sink_kernels_compile(rows, i, compiled_clean):
    row = rows[i]
    compiled_clean(row)


def test_combine_with_sink_compiles():
    from flash4.compile.cache import get_combine_runner

    assert callable(get_combine_runner(64, "bf16", sink=True))
