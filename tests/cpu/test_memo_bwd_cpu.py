"""The prepared dense backward (flash4.backward.PreparedBackward, kept per signature by
flash4.ops.dense_backward through flash4.memo.dense_backward_key) on the CPU: a call answered from the
memo issues exactly the kernel calls of the memo-less host path (flash4.backward.run), argument by
argument; a call differing in any part of the key (shapes, strides, dtype, mask, softcap, dlse,
sink_delta, a planning environment variable) gets its own plan. Kernels are recorders, as in
test_memo_cpu.py (whose fixture and helpers this file uses)."""

import pytest
import torch
from cpu_helpers import BF16
from test_memo_cpu import _memo_less, _randn, _record, recorder  # noqa: F401  (recorder: the fixture)

from flash4 import memo, ops
from flash4.compile import cache


@pytest.fixture(autouse=True)
def _fresh_bwd_runners():
    for fn in (cache.get_bwd_runner, cache.get_bwd_preprocess_runner, cache.get_bwd_postprocess_runner):
        fn.cache_clear()
    yield
    for fn in (cache.get_bwd_runner, cache.get_bwd_preprocess_runner, cache.get_bwd_postprocess_runner):
        fn.cache_clear()


def bwd_cell(b=2, sq=300, sk=260, h=4, hk=4, d=64, dtype=BF16, causal=True, window=(None, None), softcap=0.0,
             deterministic=False, dlse=False, sink_delta=False, split=True, dout_strided=False):
    """(fn, args, kwargs) of flash4.ops.dense_backward on CPU tensors."""
    q, k, v = _randn(b, sq, h, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype)
    out = _randn(b, sq, h, d, dtype=dtype)
    dout = _randn(b, sq, h, 2 * d, dtype=dtype)[..., :d] if dout_strided else _randn(b, sq, h, d, dtype=dtype)
    lse = torch.randn(b, h, sq)
    lse_split = torch.stack([lse * 1.4426950408889634, torch.zeros_like(lse)]) if split else None
    args = (dout, q, k, v, out, lse, lse_split, torch.randn(b, h, sq) if dlse else None, d ** -0.5, causal,
            deterministic, window[0], window[1], softcap, sink_delta)
    return ops.dense_backward, args, {}


CELLS = {
    "d64_causal": bwd_cell(),
    "d128_full": bwd_cell(d=128, causal=False),
    "gqa_accum": bwd_cell(sq=2048, sk=2048, h=8, hk=2, d=128),
    "window_softcap": bwd_cell(window=(32, 0), softcap=30.0),
    "deterministic_dlse": bwd_cell(deterministic=True, dlse=True),
    "sink_delta": bwd_cell(sink_delta=True),
    "no_split_strided_dout": bwd_cell(split=False, dout_strided=True),
    "fp16_d96": bwd_cell(d=96, dtype=torch.float16),
}


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_hit_launches_as_memo_less(recorder, monkeypatch, cell):  # noqa: F811
    fn, args, kw = CELLS[cell]
    reference = _memo_less(recorder, monkeypatch, fn, args, kw)
    hits = memo.stats["hits"]
    assert _record(recorder, fn, args, kw) == reference  # the first call: prepared and kept
    assert _record(recorder, fn, args, kw) == reference  # answered from the memo
    assert memo.stats["hits"] == hits + 1


def test_no_stale_plan(recorder, monkeypatch):  # noqa: F811
    """Calls differing from a kept one in a part of the key run their own plan."""
    base = bwd_cell()
    _record(recorder, *base[:2], {})
    for name, variant in (("causal", bwd_cell(causal=False)), ("window", bwd_cell(window=(16, 16))),
                          ("softcap", bwd_cell(softcap=20.0)), ("dlse", bwd_cell(dlse=True)),
                          ("sink_delta", bwd_cell(sink_delta=True)), ("shape", bwd_cell(sq=200)),
                          ("headdim", bwd_cell(d=128)), ("strides", bwd_cell(dout_strided=True))):
        reference = _memo_less(recorder, monkeypatch, *variant[:2], {})
        assert _record(recorder, *variant[:2], {}) == reference, name
        assert _record(recorder, *variant[:2], {}) == reference, name


@pytest.mark.parametrize("var, value", [("FLASH4_BWD_HEADS_PER_CTA", "1"), ("FLASH4_POSTPROCESS_WIDE", "0"),
                                        ("FLASH4_BWD_SWITCHES", "lse_early")])
def test_env_in_key(recorder, monkeypatch, var, value):  # noqa: F811
    """A planning variable of the backward set after a call was kept: the next call plans anew."""
    fn, args, kw = CELLS["gqa_accum"]
    before = _record(recorder, fn, args, kw)
    _record(recorder, fn, args, kw)
    monkeypatch.setenv(var, value)
    reference = _memo_less(recorder, monkeypatch, fn, args, kw)
    assert _record(recorder, fn, args, kw) == reference
    assert _record(recorder, fn, args, kw) == reference
    assert reference != before, f"{var}={value} did not change the plan of this cell (pick another cell)"


def test_key_not_kept_under_grad():
    """create_graph=True (grad mode on, an input requiring grad): no key; otherwise a key."""
    _, args, _ = bwd_cell()
    key = memo.dense_backward_key
    memo_enabled, memo_cpu = memo.ENABLED, memo.CPU
    memo.ENABLED, memo.CPU = True, True
    try:
        assert key(*args) is not None
        q = args[1].detach().clone().requires_grad_()
        assert key(args[0], q, *args[2:]) is None
        with torch.no_grad():
            assert key(args[0], q, *args[2:]) is not None
    finally:
        memo.ENABLED, memo.CPU = memo_enabled, memo_cpu
