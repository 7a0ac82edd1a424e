"""FLASH4_DECODE_SCATTER on the GPU (marker gpu; skipped without CUDA): flash_attn_varlen_func's decode
step (paged K/V, max_seqlen_q <= 8) with the switch on -- a split step's combine kernel writes the
varlen out / lse rows by cu_seqlens_q (kernels/common/fwd_combine.py, call_packed_rows) -- gives
bitwise the out and lse of the switch-off path (step buffers, then a searchsorted and two gathers)
on every row a sequence owns.

Cases: Sq = 1 (vLLM's cu_seqlens_q = arange(B + 1), batch 1, zero-length sequences mixed in) and
Sq = 2..4 (speculative drafts, uneven, zero-length ones), GQA 32/8 and MHA 8/8, head dims 64 and
128, the plan's splits forced above 1 (FLASH4_NUM_SMS=1024) and to 1 (FLASH4_NUM_SMS=1: the switch
then keeps the old path); both host paths (the prepared call of flash4.memo and flash4.forward.run);
a GQA-packed speculative step (non-causal: q copied into packed rows), a learnable sink. Rows outside
every sequence: in a caller's out / lse they keep their values (the old path, switch on or off);
the packed-rows combine itself writes no other row (NaN-filled buffers through flash4.forward.launch);
in buffers flash4 allocates they are unspecified, as before. A CUDA graph of vLLM's step with the
switch on replays with new lengths as the eager call computes.

    pytest tests/gpu/test_decode_scatter.py
"""

import math

import pytest
import torch

import flash4
from flash4 import forward, memo
from flash4.arch import device_arch, num_sms
from flash4.config import fwd_config
from flash4.reference import paged_kv_cache, varlen_fwd_errors, varlen_row_mask
from flash4.request import Request

from gpu_helpers import BF16, DEV, I32, cu_seqlens

CASES = {
    "vllm": ((1,) * 8, 1),            # cu_seqlens_q = arange(B + 1)
    "b1": ((1,), 1),                  # the batch 1 x long-context cell's shape
    "padded": ((1, 0, 1, 1, 0), 1),   # zero-length sequences (CUDA-graph batch padding)
    "q2": ((2, 2, 2), 2),
    "q3_zeros": ((0, 3, 3, 1, 0), 3),
    "uneven4": ((4, 1, 0, 3), 4),     # uneven speculative drafts
}
# FLASH4_NUM_SMS: the decode plan splits the keys (a pretend 1024-SM GPU: even 5 sequences x 32 heads
# of 3-4 queries fill less than 0.8 of it) / does not (1 SM: every tile count fills it)
SPLITS = {"split": "1024", "one": "1"}


def _inputs(len_q, h, hk, d, page_size=16, pad_q=3, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    len_k = tuple(1500 + 700 * i for i in range(len(len_q)))
    q = torch.randn(sum(len_q) + pad_q, h, d, generator=gen, device=DEV, dtype=BF16)
    k, v = (torch.randn(sum(len_k), hk, d, generator=gen, device=DEV, dtype=BF16) for _ in range(2))
    k_cache, v_cache, table, seqused_k = paged_kv_cache(k, v, cu_seqlens(len_k), page_size, extra_pages_per_seq=2,
                                                        generator=torch.Generator(device="cpu").manual_seed(seed))
    return q, cu_seqlens(len_q), k_cache, v_cache, table, seqused_k


def _splits(q, cu_q, max_q, k_cache, v_cache, table, seqused_k, causal, sink=None):
    """The decode plan's split count of this call (as flash4.memo plans it)."""
    request = Request.varlen(q, k_cache, v_cache, cu_q, None, max_q, None, seqused_k=seqused_k, page_table=table,
                             causal=causal, learnable_sink=sink)
    step = forward._decode_step(request, q.new_empty((cu_q.numel() - 1, max_q) + tuple(q.shape[1:])), seqused_k,
                                table)
    return fwd_config(step, device_arch(q.device), num_sms(q.device)).num_splits


def _door(q, cu_q, max_q, k_cache, v_cache, table, seqused_k, causal, sink=None):
    return flash4.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max_q, None, seqused_k=seqused_k,
                                         page_table=table, causal=causal, return_lse=True, learnable_sink=sink)


def _run(q, cu_q, max_q, k_cache, v_cache, table, seqused_k, causal, sink=None, out=None, lse=None):
    request = Request.varlen(q, k_cache, v_cache, cu_q, None, max_q, None, seqused_k=seqused_k, page_table=table,
                             softmax_scale=1 / math.sqrt(q.shape[-1]), causal=causal, learnable_sink=sink)
    return forward.run(request, out=out, lse=lse)


def _both_paths(monkeypatch, scatter: bool, *args, **kwargs):
    """[(out, lse) of the prepared call (memo: a miss, then a hit), of flash4.forward.run] with the switch set."""
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "1" if scatter else "0")
    monkeypatch.setattr(memo, "ENABLED", True)
    door = [_door(*args, **kwargs) for _ in range(2)]
    monkeypatch.setattr(memo, "ENABLED", False)
    full = _run(*args, **kwargs)
    torch.cuda.synchronize()
    return door + [full]


def _assert_same_rows(got, ref, rows, what):
    (out, lse), (out_ref, lse_ref) = got, ref
    assert torch.equal(out[rows], out_ref[rows]), f"{what}: out differs on a row a sequence owns"
    assert torch.equal(lse[:, rows], lse_ref[:, rows]), f"{what}: lse differs on a row a sequence owns"
    assert not out[rows].isnan().any() and not lse[:, rows].isnan().any(), what


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("h,hk", [(32, 8), (8, 8)], ids=["gqa", "mha"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("splits", list(SPLITS))
def test_switch_on_equals_off(monkeypatch, case, h, hk, d, splits):
    len_q, max_q = CASES[case]
    monkeypatch.setenv("FLASH4_NUM_SMS", SPLITS[splits])
    args = _inputs(len_q, h, hk, d)
    q, cu_q = args[0], args[1]
    call = (q, cu_q, max_q) + args[2:] + (True,)
    n = _splits(*call)
    assert (n > 1) == (splits == "split"), n
    off = _both_paths(monkeypatch, False, *call)
    on = _both_paths(monkeypatch, True, *call)
    rows = varlen_row_mask(cu_q, q.shape[0], None)
    for i, got in enumerate(off[1:] + on):
        _assert_same_rows(got, off[0], rows, f"result {i + 1} of {len(off) - 1 + len(on)}")
    errs = varlen_fwd_errors(q, args[2], args[3], cu_q, None, on[0][0], on[0][1], None, args[5], args[4], None, True)
    assert errs["ok"], errs


@pytest.mark.parametrize("sink", [False, True], ids=["plain", "sink"])
def test_packed_speculative_and_sink(monkeypatch, sink):
    """GQA packing of a non-causal Sq = 3 step (q copied into packed rows) and a learnable sink (the
    combine adds it): switch on equals off."""
    monkeypatch.setenv("FLASH4_NUM_SMS", SPLITS["split"])
    args = _inputs((3, 0, 2, 3), 32, 8, 128, seed=4)
    q, cu_q = args[0], args[1]
    s = torch.randn(32, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)) if sink else None
    call = (q, cu_q, 3) + args[2:] + (False,)
    assert _splits(*call, sink=s) > 1
    off = _both_paths(monkeypatch, False, *call, sink=s)
    on = _both_paths(monkeypatch, True, *call, sink=s)
    rows = varlen_row_mask(cu_q, q.shape[0], None)
    for got in off[1:] + on:
        _assert_same_rows(got, off[0], rows, "packed" + (" sink" if sink else ""))


@pytest.mark.parametrize("case", ["vllm", "padded", "uneven4"])
@pytest.mark.parametrize("splits", list(SPLITS))
def test_callers_rows_kept(monkeypatch, case, splits):
    """A caller's NaN-filled out / lse (flash4.forward.run): the rows past cu_seqlens_q[-1] stay NaN and
    every owned row is written, the switch on as off."""
    len_q, max_q = CASES[case]
    monkeypatch.setenv("FLASH4_NUM_SMS", SPLITS[splits])
    monkeypatch.setattr(memo, "ENABLED", False)
    args = _inputs(len_q, 32, 8, 128, seed=2)
    q, cu_q = args[0], args[1]
    rows = varlen_row_mask(cu_q, q.shape[0], None)
    results = []
    for scatter in ("0", "1"):
        monkeypatch.setenv("FLASH4_DECODE_SCATTER", scatter)
        out = torch.full(q.shape, math.nan, dtype=BF16, device=DEV)
        lse = torch.full((q.shape[1], q.shape[0]), math.nan, dtype=torch.float32, device=DEV)
        results.append(_run(q, cu_q, max_q, *args[2:], True, out=out, lse=lse))
        torch.cuda.synchronize()
        assert out[~rows].isnan().all() and lse[:, ~rows].isnan().all(), "a row outside every sequence was written"
    _assert_same_rows(results[1], results[0], rows, "caller's buffers")


@pytest.mark.parametrize("case", ["vllm", "padded", "q3_zeros", "uneven4"])
@pytest.mark.parametrize("h,hk", [(32, 8), (8, 8)], ids=["gqa", "mha"])
def test_packed_rows_combine_writes_owned_rows_only(monkeypatch, case, h, hk):
    """flash4.forward.launch with rows = cu_seqlens_q into NaN-filled varlen out / lse, a split plan:
    the combine writes exactly the rows sequences own (rows past cu_seqlens_q[-1] stay NaN), with the
    values of the switch-off door."""
    len_q, max_q = CASES[case]
    monkeypatch.setenv("FLASH4_NUM_SMS", SPLITS["split"])
    monkeypatch.setattr(memo, "ENABLED", False)
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "0")
    args = _inputs(len_q, h, hk, 128, seed=3)
    q, cu_q, k_cache, v_cache, table, seqused_k = args
    assert _splits(q, cu_q, max_q, k_cache, v_cache, table, seqused_k, True) > 1
    ref = _run(q, cu_q, max_q, k_cache, v_cache, table, seqused_k, True)
    request = Request.varlen(q, k_cache, v_cache, cu_q, None, max_q, None, seqused_k=seqused_k, page_table=table,
                             softmax_scale=1 / math.sqrt(128), causal=True)
    batch = cu_q.numel() - 1
    src = torch.add(cu_q[1:].unsqueeze(1), torch.arange(-max_q, 0, device=DEV)).clamp_(min=0).view(-1)
    q_step = q.index_select(0, src).view(batch, max_q, h, 128)
    out = torch.full(q.shape, math.nan, dtype=BF16, device=DEV)
    lse = torch.full((h, q.shape[0]), math.nan, dtype=torch.float32, device=DEV)
    forward.launch(forward._decode_step(request, q_step, seqused_k, table), out, lse, rows=cu_q)
    torch.cuda.synchronize()
    rows = varlen_row_mask(cu_q, q.shape[0], None)
    assert out[~rows].isnan().all() and lse[:, ~rows].isnan().all(), "a row outside every sequence was written"
    _assert_same_rows((out, lse), ref, rows, "launch(rows=cu_seqlens_q)")


def test_cuda_graph_vllm_decode_switch_on(monkeypatch):
    """vLLM's decode step with the switch on, captured once (the prepared call), replayed after
    seqused_k, the page table and q changed in place: the eager result, and the switch-off one."""
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "1")
    b, h, hk, d, page_size, max_pages = 6, 32, 8, 128, 16, 256
    gen = torch.Generator(device=DEV).manual_seed(13)
    num_pages = b * max_pages + 8
    k_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_pages, generator=gen, device=DEV)[: b * max_pages].view(b, max_pages).to(I32)
    seqused_k = torch.tensor([4000, 1, 0, 2048, 17, 4096], dtype=I32, device=DEV)
    cu_q = torch.arange(b + 1, dtype=I32, device=DEV)
    q = torch.randn(b, h, d, generator=gen, device=DEV, dtype=BF16)
    out, lse = torch.empty_like(q), torch.empty(h, b, device=DEV)
    assert _splits(q, cu_q, 1, k_cache, v_cache, table, seqused_k, True) > 1

    def call():
        return _door(q, cu_q, 1, k_cache, v_cache, table, seqused_k, True)

    def step():
        o, l = call()
        out.copy_(o)
        lse.copy_(l)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seqused_k.copy_(torch.tensor([5, 4096, 3000, 0, 1024, 77], dtype=I32))
    table.copy_(torch.randperm(num_pages, generator=gen, device=DEV)[: table.numel()].view_as(table).to(I32))
    q.copy_(torch.randn(q.shape, generator=gen, device=DEV, dtype=BF16))
    graph.replay()
    torch.cuda.synchronize()
    eager = call()
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "0")
    off = call()
    assert torch.equal(out, off[0]) and torch.equal(lse, off[1])
