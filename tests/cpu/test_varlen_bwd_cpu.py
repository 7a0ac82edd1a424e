"""Varlen backward on the CPU: the padded statistics layout (flash4.backward.padded_total /
padded_row_index) against a Python loop, the empty cases of flash4.backward.run on a packed
request (zeros, no launch), the fake arguments, and compile checks of a few varlen backward configs
(sm_90a, no spills)."""

import random

import pytest
import torch

from flash4 import backward
from flash4.backward import padded_row_index, padded_total
from flash4.config import select_bwd_config, with_dkv_accum, with_seq_layout
from flash4.request import Request


def _padded_offset(cu, b, tile):
    return (cu[b] + b * tile) // tile * tile


def _expected_rows(cu, total_q, tile, seqused=None):
    """The padded row of every packed row, by a loop over the sequences; scratch row for the rest."""
    batch = len(cu) - 1
    scratch = padded_total(total_q, batch, tile)
    rows = [scratch] * total_q
    for b in range(batch):
        length = cu[b + 1] - cu[b] if seqused is None else seqused[b]
        for i in range(length):
            rows[cu[b] + i] = _padded_offset(cu, b, tile) + i
    return rows


def _random_cu(rng, batch, max_len, extra_rows=0):
    lens = [rng.choice([0, 1, rng.randrange(max_len + 1)]) if rng.random() < 0.2 else rng.randrange(max_len + 1)
            for _ in range(batch)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu, cu[-1] + extra_rows


@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("seed", range(6))
def test_padded_row_index_matches_loop(tile, seed):
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 3, 7, 16])
    cu, total_q = _random_cu(rng, batch, rng.choice([5, 64, 130, 300]), extra_rows=rng.choice([0, 0, 3, 70]))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    got = padded_row_index(cu_t, total_q, tile)
    assert got.dtype == torch.int32 and got.shape == (total_q,)
    assert got.tolist() == _expected_rows(cu, total_q, tile)
    seqused = [rng.randrange(cu[b + 1] - cu[b] + 1) for b in range(batch)]
    got = padded_row_index(cu_t, total_q, tile, torch.tensor(seqused, dtype=torch.int32))
    assert got.tolist() == _expected_rows(cu, total_q, tile, seqused)


@pytest.mark.parametrize("seed", range(20))
def test_padded_layout_fits(seed):
    """Every sequence's query tiles start tile-aligned, do not overlap the next sequence's, and end
    by padded_total (so the scratch tile after it is never touched by a sequence)."""
    rng = random.Random(100 + seed)
    tile = rng.choice([64, 128])
    batch = rng.randrange(1, 12)
    cu, total_q = _random_cu(rng, batch, rng.choice([3, 64, 200, 1000]), extra_rows=rng.choice([0, 5]))
    end = padded_total(total_q, batch, tile)
    assert end % tile == 0
    for b in range(batch):
        start = _padded_offset(cu, b, tile)
        tiles = -(-(cu[b + 1] - cu[b]) // tile)
        assert start % tile == 0
        limit = _padded_offset(cu, b + 1, tile) if b + 1 < batch else end
        assert start + tiles * tile <= limit


def test_padded_row_index_edge_cases():
    # no sequence at all: every row is outside
    assert padded_row_index(torch.tensor([0], dtype=torch.int32), 5, 64).tolist() == [0] * 5
    # int64 cu_seqlens, rows past the last sequence, empty sequences
    cu = torch.tensor([0, 0, 3, 3], dtype=torch.int64)
    assert padded_row_index(cu, 5, 64).tolist() == [64, 65, 66, 192, 192]
    assert padded_row_index(cu, 0, 64).shape == (0,)


def _qkv(total_q, total_k, h=2, hk=1, d=64):
    q = torch.randn(total_q, h, d, dtype=torch.bfloat16)
    k = torch.randn(total_k, hk, d, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k), torch.randn_like(q), torch.randn(h, total_q)


@pytest.mark.parametrize("case", ["no_q", "no_k", "no_batch", "max_q_0", "max_k_0"])
def test_varlen_backward_empty_returns_zeros_without_launch(case, monkeypatch):
    """Empty problems return zeros before touching a device (these tensors live on the CPU)."""
    total_q, total_k = (0 if case == "no_q" else 5), (0 if case == "no_k" else 7)
    q, k, v, out, lse = _qkv(total_q, total_k)
    cu_q = torch.tensor([0] if case == "no_batch" else [0, total_q], dtype=torch.int32)
    cu_k = torch.tensor([0] if case == "no_batch" else [0, total_k], dtype=torch.int32)
    max_q = 0 if case == "max_q_0" else total_q
    max_k = 0 if case == "max_k_0" else total_k
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    monkeypatch.setattr(backward, "launch", lambda *a: pytest.fail("launched"))
    request = Request.varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=0.125, causal=True)
    got = backward.run(request, torch.randn_like(out), out, lse, dq=dq, dk=dk, dv=dv)
    for g, ref in zip(got, (dq, dk, dv)):
        assert g is ref and bool((g == 0).all())


def test_fake_args_follow_the_flags():
    pytest.importorskip("cutlass")
    from flash4.compile.fake import bwd_fake_args, bwd_preprocess_fake_args

    dense = bwd_fake_args(128, "bf16")
    assert len(dense) == 19 and dense[13:] == (None, None, None, None, None, None)
    packed = bwd_fake_args(128, "bf16", varlen_q=True, varlen_k=True, seqused_k=True)
    assert [t is None for t in packed[13:]] == [False, False, True, False, True, True]  # + dK/dV semaphores, delta
    assert bwd_fake_args(128, "bf16", sink_delta=True)[18] is not None
    import cutlass

    accum = bwd_fake_args(128, "bf16", dkv_accum=True, deterministic=True)
    assert accum[7].element_type == accum[8].element_type == cutlass.Float32 and accum[17] is not None
    assert packed[0].shape[0] == 1 and packed[1].shape[0] == 1  # batch mode of size 1
    assert len(bwd_preprocess_fake_args(64, "bf16")) == 8  # + the dQ accumulator it zeroes
    assert len(bwd_preprocess_fake_args(64, "bf16", varlen=True)) == 9


# Varlen backward configs: one per tile shape (d64: 128-query steps; d128; split headdim d192/d256),
# with the seqused and deterministic variants; kept short (each compile takes a few seconds).
VARLEN = dict(varlen_q=True, varlen_k=True)
SEQUSED = dict(VARLEN, seqused_q=True, seqused_k=True)
CONFIGS = [
    with_seq_layout(select_bwd_config(64, "bf16", causal=True), **VARLEN),
    with_seq_layout(select_bwd_config(128, "bf16", causal=False), **SEQUSED),
    with_seq_layout(select_bwd_config(192, "bf16", causal=True, deterministic=True), **VARLEN),
    with_seq_layout(select_bwd_config(256, "bf16", causal=True), **SEQUSED),
    # GQA head split (fp32 dK/dV adds, predicated per row)
    with_dkv_accum(with_seq_layout(select_bwd_config(128, "bf16", causal=True), **VARLEN), 8, 2, 2),
]


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("cutlass")
    from flash4.compile.check import compile_check

    return compile_check(CONFIGS)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[
    f"d{c.headdim}{'-causal' if c.causal else ''}{'-seqused' if c.seqused_q else ''}{'-det' if c.deterministic else ''}"
    f"{'-dkv-accum' if c.dkv_accum else ''}" for c in CONFIGS])
def test_varlen_bwd_compiles_without_spills(rows, i, compiled_clean):
    row = rows[i]
    compiled_clean(row)
    assert row["utmaldg"] > 0
    # packed dK / dV rows past a sequence belong to the next one: predicated stores, no TMA store
    assert row["utmastg"] == 0


def test_varlen_preprocess_compiles():
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute

    from flash4.compile.cache import COMPILE_OPTIONS
    from flash4.compile.check import extract_cubin
    from flash4.compile.fake import bwd_preprocess_fake_args
    from flash4.kernels.common.bwd_preprocess import BackwardPreprocess

    args = bwd_preprocess_fake_args(128, "bf16", varlen=True)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    compiled = cute.compile(BackwardPreprocess(128, args[0].element_type), *args[:8], cutlass.Int32(64),
                            cutlass.Int32(1), stream, args[8], options=COMPILE_OPTIONS + " --gpu-arch sm_90a")
    assert extract_cubin(compiled) is not None
