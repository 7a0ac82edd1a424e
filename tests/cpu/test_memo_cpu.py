"""flash4.memo (prepared calls, issue 25 item 4) on the CPU: a second call with the same signature is
answered from the memo and issues exactly the kernel calls of the memo-less host path; a call that
differs in any part of the key (dtype, strides, alignment, causal, window, softcap, sink, page size,
num_splits, a planning environment variable, ...) is not answered with a stale plan; data checks
(check_seqlens=True) and argument checks still run.

Every compiled kernel is a recorder (flash4.compile.cache.load_or_compile patched, as
tools/host_overhead.py --fake does), so a call's launches are compared argument by argument: the
kernel (kind and config), every tensor's dtype, shape, strides and which input's memory it is (or
new), every host scalar."""

import pytest
import torch
from cpu_helpers import BF16, I32

import flash4
from flash4 import forward, memo, validate
from flash4.compile import cache

FP16 = torch.float16


@pytest.fixture
def recorder(monkeypatch):
    """CPU tensors through the checks, kernels recording their calls, the memo on for CPU tensors."""
    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.setenv("FLASH4_NUM_SMS", "132")
    device_problem = validate._device_problem

    def relative_only(q, others, dense=False):
        problem = device_problem(q, others, dense)
        return None if problem is not None and problem[1].startswith("q is on cpu") else problem

    monkeypatch.setattr(validate, "_device_problem", relative_only)
    monkeypatch.setattr(validate, "_arch_problem", lambda *args, **kwargs: None)
    calls = []

    def load_or_compile(kind, key, options, compile_fn):
        def kernel(*args):
            calls.append((kind, key) + tuple(_describe(a) for a in args))

        return kernel

    monkeypatch.setattr(cache, "load_or_compile", load_or_compile)
    monkeypatch.setattr(memo, "CPU", True)
    monkeypatch.setattr(memo, "ENABLED", True)
    _forget()
    yield calls
    _forget()


def _forget():
    memo.clear()
    cache.get_fwd_runner.cache_clear()
    cache.get_combine_runner.cache_clear()
    forward._runners.cache_clear()


_INPUTS: dict = {}  # storage address -> the input's name (the tensors of the call being described)


def _describe(a):
    if isinstance(a, torch.Tensor):
        origin = _INPUTS.get(a.untyped_storage().data_ptr(), "new")
        return ("tensor", a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), origin)
    return ("value", type(a), a)


def _record(calls, fn, args, kwargs):
    """The kernel calls of fn(*args, **kwargs)."""
    _INPUTS.clear()
    for name, value in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(value, torch.Tensor) and value.numel():
            _INPUTS[value.untyped_storage().data_ptr()] = str(name)
    del calls[:]
    fn(*args, **kwargs)
    got = list(calls)
    assert got, "no kernel launched"
    return got


def _memo_less(calls, monkeypatch, fn, args, kwargs):
    monkeypatch.setattr(memo, "ENABLED", False)
    try:
        return _record(calls, fn, args, kwargs)
    finally:
        monkeypatch.setattr(memo, "ENABLED", True)


def _randn(*shape, dtype=BF16):
    return torch.randn(*shape).to(dtype)


# ================================================================ the doors' cells
def kvcache(dtype=BF16, paged=0, keys=4096, new=0, seqlens="tensor", out=False, sink=False, num_splits=0,
            causal=True, window=(-1, -1), softcap=0, sq=1, h=32, hk=8, d=128, check=False, strided=False):
    b = 2
    q = _randn(b, sq, h, d, dtype=dtype)
    if paged:
        pages = keys // paged
        k_cache, v_cache = _randn(b * pages, paged, hk, d, dtype=dtype), _randn(b * pages, paged, hk, d, dtype=dtype)
        table = torch.arange(b * pages, dtype=I32).view(b, pages)
    else:
        k_cache, v_cache = _randn(b, keys, hk, d, dtype=dtype), _randn(b, keys, hk, d, dtype=dtype)
        if strided:  # K and V as two views of one interleaved tensor
            kv = _randn(b, keys, 2, hk, d, dtype=dtype)
            k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
        table = None
    lens = {"tensor": torch.full((b,), keys // 2, dtype=I32), "int": keys // 2, "none": None}[seqlens]
    kw = dict(cache_seqlens=lens, page_table=table, causal=causal, window_size=window, softcap=softcap,
              num_splits=num_splits, check_seqlens=check, return_lse=True)
    if new:
        kw.update(k=_randn(b, new, hk, d, dtype=dtype), v=_randn(b, new, hk, d, dtype=dtype))
    if out:
        kw["out"] = torch.empty(b, sq, h, d, dtype=dtype)
    if sink:
        kw["learnable_sink"] = torch.randn(h)
    return flash4.flash_attn_with_kvcache, (q, k_cache, v_cache), kw


def func(dtype=BF16, sq=1, keys=4096, causal=True, window=(-1, -1), softcap=0, sink=False, h=32, hk=8, d=128,
         scale=None, transposed=False):
    b = 2
    q, k, v = _randn(b, sq, h, d, dtype=dtype), _randn(b, keys, hk, d, dtype=dtype), _randn(b, keys, hk, d, dtype=dtype)
    if transposed:  # (B, H, S, D) storage seen as (B, S, H, D)
        k, v = (_randn(b, hk, keys, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    kw = dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=scale, return_lse=True)
    if sink:
        kw["learnable_sink"] = torch.randn(h)
    return flash4.flash_attn_func, (q, k, v), kw


def varlen(dtype=BF16, paged=64, keys=4096, max_q=1, lens_q=(1, 1, 0), causal=True, window=(-1, -1), softcap=0,
           seqused_q=False, check=False, h=32, hk=8, d=128):
    b = len(lens_q)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=I32)
    total_q = int(cu_q[-1]) + 1  # a spare row past the last sequence
    q = _randn(total_q, h, d, dtype=dtype)
    kw = dict(causal=causal, window_size=window, softcap=softcap, check_seqlens=check, return_lse=True)
    if paged:
        pages = keys // paged
        k, v = _randn(b * pages, paged, hk, d, dtype=dtype), _randn(b * pages, paged, hk, d, dtype=dtype)
        kw.update(seqused_k=torch.full((b,), keys - 3, dtype=I32), page_table=torch.arange(b * pages, dtype=I32).view(b, pages))
        cu_k = None
    else:
        cu_k = torch.arange(b + 1, dtype=I32) * 100
        k, v = _randn(b * 100, hk, d, dtype=dtype), _randn(b * 100, hk, d, dtype=dtype)
    if seqused_q:
        kw["seqused_q"] = torch.tensor(lens_q, dtype=I32)
    return flash4.flash_attn_varlen_func, (q, k, v, cu_q, cu_k, max_q, None), kw


CELLS = {
    "kvcache": kvcache(),
    "kvcache_paged": kvcache(paged=64),
    "kvcache_page16": kvcache(paged=16),
    "kvcache_append": kvcache(new=2, sq=2),
    "kvcache_append_paged": kvcache(paged=64, new=1),
    "kvcache_int_seqlens": kvcache(seqlens="int"),
    "kvcache_no_seqlens": kvcache(seqlens="none"),
    "kvcache_out": kvcache(out=True),
    "kvcache_sink": kvcache(sink=True),
    "kvcache_one_split": kvcache(num_splits=1),
    "kvcache_unpacked_window": kvcache(window=(255, 0)),
    "kvcache_softcap": kvcache(softcap=30.0),
    "kvcache_check": kvcache(check=True),
    "kvcache_interleaved": kvcache(strided=True),
    "kvcache_big_batch_no_split": kvcache(h=64, hk=64, keys=2048),
    "func_decode": func(),
    "func_decode_sink": func(sink=True),
    "func_spec": func(sq=4, causal=False),
    "func_prefill": func(sq=128, keys=128, h=8, hk=8, d=64),
    "func_prefill_window": func(sq=128, keys=256, h=8, hk=2, d=64, window=(32, 8), softcap=5.0),
    "func_transposed": func(sq=64, keys=64, transposed=True),
    # padded head dims on the narrow tensors (flash4.forward.launch_narrow, memo.NarrowCall), and one
    # that packs GQA (d40 causal -> the d64 kernel): the padded copies, its inner call kept
    "func_narrow_d80": func(sq=128, keys=256, h=8, hk=8, d=80),
    "func_narrow_d32_gqa_full": func(sq=64, keys=300, h=8, hk=2, d=32, causal=False),
    "func_narrow_d112_window": func(sq=128, keys=256, h=4, hk=4, d=112, window=(32, 0)),
    "func_padded_d40_gqa_causal": func(sq=64, keys=300, h=8, hk=2, d=40),
    "varlen_paged_decode": varlen(),
    "varlen_paged_spec": varlen(max_q=3, lens_q=(3, 1, 2)),
    "varlen_paged_prefill": varlen(max_q=32, lens_q=(32, 5, 0), keys=512),
    "varlen_packed": varlen(paged=0, max_q=16, lens_q=(16, 3, 7)),
    "varlen_seqused_q": varlen(paged=0, max_q=16, lens_q=(16, 3, 7), seqused_q=True),
    "varlen_check": varlen(check=True),
}


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_hit_launches_as_memo_less(recorder, monkeypatch, cell):
    fn, args, kw = CELLS[cell]
    reference = _memo_less(recorder, monkeypatch, fn, args, kw)
    assert len(memo._MEMO) == 0
    first = _record(recorder, fn, args, kw)  # a miss: planned, kept, run through the prepared call
    assert len(memo._MEMO) == 1, "the call was not kept"
    hits = memo.stats["hits"]
    second = _record(recorder, fn, args, kw)
    assert memo.stats["hits"] == hits + 1
    assert first == reference and second == reference


# A call differing from the base cell in one part of the key: not answered from the base's entry,
# and launched as the memo-less path launches it.
VARIANTS = {
    "kvcache": [kvcache(dtype=FP16), kvcache(causal=False, sq=2), kvcache(window=(127, 0)), kvcache(softcap=10.0),
                kvcache(num_splits=1), kvcache(num_splits=3), kvcache(paged=64), kvcache(keys=8192),
                kvcache(sink=True), kvcache(strided=True), kvcache(hk=4), kvcache(seqlens="int")],
    "kvcache_paged": [kvcache(paged=16), kvcache(paged=128), kvcache(paged=64, new=1), kvcache(paged=64, check=True)],
    "func_decode": [func(dtype=FP16), func(keys=512), func(sq=9), func(scale=0.5), func(causal=False),
                    func(window=(100, 0))],
    "func_prefill": [func(sq=128, keys=128, h=8, hk=8, d=64, causal=False),
                     func(sq=128, keys=128, h=8, hk=8, d=64, softcap=3.0),
                     func(sq=128, keys=128, h=8, hk=8, d=64, dtype=FP16),
                     func(sq=128, keys=128, h=8, hk=8, d=128)],
    "varlen_paged_decode": [varlen(paged=16), varlen(max_q=2, lens_q=(1, 2, 0)), varlen(window=(64, 0)),
                            varlen(seqused_q=True)],
}


@pytest.mark.parametrize("base", sorted(VARIANTS))
def test_no_stale_plan(recorder, monkeypatch, base):
    fn, args, kw = CELLS[base]
    _record(recorder, fn, args, kw)
    for fn_v, args_v, kw_v in VARIANTS[base]:
        reference = _memo_less(recorder, monkeypatch, fn_v, args_v, kw_v)
        kept = memo.stats["kept"]
        got = _record(recorder, fn_v, args_v, kw_v)
        assert memo.stats["kept"] == kept + 1, "answered from another signature's entry"
        assert got == reference


def test_alignment_class_in_key(recorder, monkeypatch):
    """A q whose base address is 16-byte aligned and one that is not (a slice of the last dim) differ:
    the second raises validate's alignment error, every time."""
    fn, (q, k, v), kw = func(sq=1, keys=4096, d=64)
    _record(recorder, fn, (q, k, v), kw)
    wide = _randn(*q.shape[:3], 72)
    shifted = wide[..., 8:]  # 16 bytes in: aligned, kept
    _record(recorder, fn, (shifted, k, v), kw)
    off = wide[..., 4:68]  # 8 bytes in: misaligned
    for _ in range(2):
        with pytest.raises(ValueError, match="16-byte aligned"):
            fn(off, k, v, **kw)


def test_env_switch_in_key(recorder, monkeypatch):
    """A planning variable (FLASH4_PAGE_GATHER_MAX: page 64 gathered instead of TMA pieces) changes the key."""
    fn, args, kw = CELLS["kvcache_paged"]
    before = _record(recorder, fn, args, kw)
    monkeypatch.setenv("FLASH4_PAGE_GATHER_MAX", "64")
    reference = _memo_less(recorder, monkeypatch, fn, args, kw)
    got = _record(recorder, fn, args, kw)
    assert got == reference and got[0][1] != before[0][1]  # another forward config
    monkeypatch.setenv("FLASH4_NUM_SMS", "16")  # the split count follows the SM count
    assert _record(recorder, fn, args, kw) == _memo_less(recorder, monkeypatch, fn, args, kw)


def test_row_shuffle_switch_in_key(recorder, monkeypatch):
    """FLASH4_PAGE_ROW_SHUFFLE (flash4.config.PAGE_ROW_SHUFFLE): a d64 paged prefill of page 48 (three
    16-row pieces a page) shuffles the pieces' row block by default and divides with the switch at 0: a
    flip between two calls of the same shapes reaches the plan, either way."""
    monkeypatch.delenv("FLASH4_PAGE_ROW_SHUFFLE", raising=False)
    fn, args, kw = varlen(paged=48, keys=480, max_q=32, lens_q=(32, 5, 0), h=8, hk=2, d=64)
    on = _record(recorder, fn, args, kw)
    assert on == _memo_less(recorder, monkeypatch, fn, args, kw)
    assert "page_row_shuffle=True" in repr(on[0][1])
    monkeypatch.setenv("FLASH4_PAGE_ROW_SHUFFLE", "0")
    reference = _memo_less(recorder, monkeypatch, fn, args, kw)
    kept = memo.stats["kept"]
    got = _record(recorder, fn, args, kw)
    assert memo.stats["kept"] == kept + 1, "answered from the other setting's entry"
    assert got == reference and got[0][1] != on[0][1] and "page_row_shuffle" not in repr(got[0][1])
    monkeypatch.delenv("FLASH4_PAGE_ROW_SHUFFLE")
    hits = memo.stats["hits"]
    assert _record(recorder, fn, args, kw) == on and memo.stats["hits"] == hits + 1


def test_checks_still_run(recorder):
    """Argument errors are raised on every call (never kept); check_seqlens' value checks run on hits."""
    fn, args, kw = CELLS["kvcache_check"]
    _record(recorder, fn, args, kw)
    _record(recorder, fn, args, kw)
    bad = dict(kw, cache_seqlens=torch.full((2,), 5000, dtype=I32))  # same signature, past the 4096-key cache
    for _ in range(2):
        with pytest.raises(ValueError, match="cache_seqlens"):
            fn(*args, **bad)
    fn, args, kw = CELLS["varlen_check"]
    _record(recorder, fn, args, kw)
    bad = dict(kw, seqused_k=torch.full((3,), 5000, dtype=I32))
    with pytest.raises(ValueError, match="seqused_k"):
        fn(*args, **bad)
    fn, args, kw = CELLS["func_decode"]
    _record(recorder, fn, args, kw)
    for _ in range(2):
        with pytest.raises(ValueError, match="softcap"):
            fn(*args, **dict(kw, softcap=-1.0))
        with pytest.raises(TypeError, match="return_lse"):
            fn(*args, **dict(kw, return_lse=(-1, -1)))


def test_not_kept(recorder):
    """Autograd-recorded calls, CPU tensors without memo.CPU, a tensor max_seqlen_q and cache_batch_idx
    take the full host path."""
    fn, (q, k, v), kw = CELLS["func_prefill"]
    assert memo.dense_key(q.requires_grad_(), k, v, None, True, True, False, (-1, -1), 0, None) is None
    with torch.no_grad():
        assert memo.dense_key(q, k, v, None, True, True, False, (-1, -1), 0, None) is not None
    q.requires_grad_(False)
    memo.CPU = False
    try:
        assert memo.dense_key(q, k, v, None, True, True, False, (-1, -1), 0, None) is None
    finally:
        memo.CPU = True
    assert memo.varlen_key(q, k, v, None, None, torch.tensor(3), None, None, None, None, None, False, (-1, -1), 0,
                           False, False, False, None) is None
    assert memo.kvcache_key(q, k, v, None, None, None, None, torch.zeros(2, dtype=I32), None, False, (-1, -1), 0, 0,
                            False, None, False, None) is None
    assert memo.get(memo._key("dense", ([1, 2],))) is None  # unhashable: not kept, no error


@pytest.mark.parametrize("strided_out", [False, True])
def test_pack_views_match_copies(monkeypatch, strided_out):
    """forward.PACK_VIEWS: the packed q view holds the packed copy's values, and a kernel writing the
    packed out / lse views leaves in out / lse what unpack_out copies back from packed buffers."""
    b, h, hk, d, dv = 3, 32, 8, 128, 64
    pack = h // hk
    q = _randn(b, 1, h, d)
    view = forward.packed_q(q, hk, pack)
    monkeypatch.setattr(forward, "PACK_VIEWS", False)
    copy = forward.packed_q(q, hk, pack)
    assert view.shape == copy.shape and torch.equal(view, copy)
    assert view.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()  # no copy
    out_p, lse_p = _randn(b, pack, hk, dv), torch.randn(b, hk, pack)  # what a kernel writes
    base = _randn(b, 1, 2 * h, dv)
    out_ref = base[:, :, ::2] if strided_out else torch.empty(b, 1, h, dv, dtype=BF16)  # a caller's strided out
    lse_ref = torch.empty(b, h, 1)
    forward.unpack_out(out_ref, lse_ref, out_p, lse_p, hk, pack)
    monkeypatch.setattr(forward, "PACK_VIEWS", True)
    out = base.clone()[:, :, ::2] if strided_out else torch.empty(b, 1, h, dv, dtype=BF16)
    lse = torch.empty(b, h, 1)
    views = forward.packed_out(out, lse, hk, pack)
    views[0].copy_(out_p)
    views[1].copy_(lse_p)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    assert forward.packed_out(out, lse.transpose(0, 1).contiguous().transpose(0, 1), hk, pack) is None


def test_host_overhead_tool_fake():
    """tools/host_overhead.py --fake runs every door (in a child: it patches flash4 for good) and
    the memo answers the repeats: far fewer Python calls with the memo than without."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    res = subprocess.run([sys.executable, str(root / "tools" / "host_overhead.py"), "--fake", "--ab", "-n", "3"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    tables = res.stdout.split("flash4.memo on:")
    calls = [{line.split()[0]: float(line.split()[2]) for line in table.splitlines()
              if line.split() and line.split()[0] in ("kvcache", "kvcache_paged", "func", "varlen_paged", "func_prefill")}
             for table in tables]
    assert len(calls[0]) == len(calls[1]) == 5, res.stdout
    for door, n in calls[1].items():
        assert n < 0.6 * calls[0][door], (door, n, calls[0][door])


# ================================================================ the key's two forms, the hit path's shortcuts
def test_key_forms(recorder, monkeypatch):
    """Plain scalar arguments (None, bool, int, float, tuple) enter the key as (types, values); any
    other scalar type (a numpy float, a Band window) takes the per-argument form, which never equals
    the first. Both kinds of call are kept and launch as the memo-less path; the exact types count
    (causal=1 is not causal=True: its TypeError is raised every time)."""
    import numpy as np

    from flash4.geometry import Band

    fn, (q, k, v), kw = func()
    plain = memo.dense_key(q, k, v, None, True, True, False, (-1, -1), 0, None)
    other = memo.dense_key(q, k, v, np.float64(0.5), True, True, False, (-1, -1), 0, None)
    band = memo.dense_key(q, k, v, None, True, True, False, Band(None, 0), 0, None)
    assert plain is not None and other is not None and band is not None
    assert len(plain) != len(other) and len(other) == len(band)
    assert plain != memo.dense_key(q, k, v, None, 1, True, False, (-1, -1), 0, None)
    assert plain != memo.dense_key(q, k, v, None, True, True, False, (-1, -1), 0.0, None)
    for variant in (dict(kw), dict(kw, softmax_scale=np.float64(0.5)), dict(kw, window_size=Band(None, 0))):
        reference = _memo_less(recorder, monkeypatch, fn, (q, k, v), variant)
        kept = memo.stats["kept"]
        assert _record(recorder, fn, (q, k, v), variant) == reference
        assert memo.stats["kept"] == kept + 1
        hits = memo.stats["hits"]
        assert _record(recorder, fn, (q, k, v), variant) == reference
        assert memo.stats["hits"] == hits + 1
    for _ in range(2):
        with pytest.raises(TypeError, match="causal"):
            fn(q, k, v, **dict(kw, causal=1))
    fn, args, kw = CELLS["kvcache"]
    _record(recorder, fn, args, kw)
    for _ in range(2):
        with pytest.raises(TypeError, match="num_splits"):
            fn(*args, **dict(kw, num_splits=torch.tensor(0)))  # a tensor among the scalars: _key's form


def test_grad_in_key(recorder):
    """Under grad mode a float input requiring grad (any of the doors' float tensors, kvcache's out
    included) makes the call not kept; integer metadata never does; without grad mode it is kept."""
    fn, (q, k_cache, v_cache), kw = kvcache(out=True)
    out, lens = kw["out"], kw["cache_seqlens"]

    def key(**given):
        a = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=None, v=None, cache_seqlens=lens, page_table=None,
                 cache_batch_idx=None, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0,
                 num_splits=0, return_lse=True, out=out, check_seqlens=False, learnable_sink=None)
        a.update(given)
        return memo.kvcache_key(**a)

    assert key() is not None
    for name in ("q", "k_cache", "out"):
        t = {"q": q, "k_cache": k_cache, "out": out}[name].detach().clone().requires_grad_()
        assert key(**{name: t}) is None, name
        with torch.no_grad():
            assert key(**{name: t}) is not None, name
    sink = torch.randn(32, requires_grad=True)
    assert key(learnable_sink=sink) is None
    fn, (q, k, v), kw = func(sink=True)
    assert memo.dense_key(q, k, v, None, True, True, False, (-1, -1), 0, kw["learnable_sink"].requires_grad_()) is None


def test_hit_after_device_constants_cleared(recorder, monkeypatch):
    """A dense decode hit reads its seqused_k from forward's device constants by a fixed key, and
    makes it again when they were cleared."""
    fn, args, kw = CELLS["func_decode"]
    reference = _memo_less(recorder, monkeypatch, fn, args, kw)
    assert _record(recorder, fn, args, kw) == reference
    forward._DEVICE_CONSTANTS.clear()
    hits = memo.stats["hits"]
    assert _record(recorder, fn, args, kw) == reference
    assert _record(recorder, fn, args, kw) == reference
    assert memo.stats["hits"] == hits + 2


@pytest.mark.parametrize("cell", ["kvcache", "kvcache_one_split", "varlen_paged_decode", "func_decode"])
def test_pack_views_switched_after_prepare(recorder, monkeypatch, cell):
    """forward.PACK_VIEWS is read on every hit: a call kept with views on launches with copies once
    it is switched off (and back), as the memo-less path does."""
    fn, args, kw = CELLS[cell]
    _record(recorder, fn, args, kw)
    for views in (False, True):
        monkeypatch.setattr(forward, "PACK_VIEWS", views)
        reference = _memo_less(recorder, monkeypatch, fn, args, kw)
        hits = memo.stats["hits"]
        assert _record(recorder, fn, args, kw) == reference
        assert memo.stats["hits"] == hits + 1


def test_device_guard_no_op_shared():
    """device_guard's no-op (a device that needs no switch) is one stateless context, reusable nested."""
    cpu = torch.device("cpu")
    guard = forward.device_guard(cpu)
    assert guard is forward.device_guard(cpu)
    with guard:
        with forward.device_guard(cpu):
            pass


@pytest.mark.parametrize("cell", ["func_decode", "func_prefill", "kvcache", "varlen_paged_decode"])
def test_window_element_types_in_key(recorder, monkeypatch, cell):
    """A kept window (-1, -1) or (4, 0) does not answer (-1.0, -1.0) or (4, False), which compare equal
    as tuples but are not valid windows: their TypeError is raised every time (also through the
    per-argument form of the key: a numpy float softmax_scale)."""
    import numpy as np

    fn, args, kw = CELLS[cell]
    for good, bad in (((-1, -1), (-1.0, -1.0)), ((4, 0), (4, False))):
        for extra in ({}, {"softmax_scale": np.float64(0.1)}):
            kw_good = dict(kw, window_size=good, **extra)
            assert _record(recorder, fn, args, kw_good) == _memo_less(recorder, monkeypatch, fn, args, kw_good)
            _record(recorder, fn, args, kw_good)
            for _ in range(2):
                with pytest.raises(TypeError, match="window_size"):
                    fn(*args, **dict(kw_good, window_size=bad))


# ================================================================ FLASH4_DECODE_SCATTER: the combine writes the rows
@pytest.mark.parametrize("lens_q,max_q", [((1, 1, 0), 1), ((1, 1, 1, 1), 1), ((3, 1, 2), 3), ((0, 2, 2), 2)])
@pytest.mark.parametrize("h,hk,d", [(32, 8, 128), (8, 8, 64)], ids=["gqa", "mha"])
def test_decode_scatter_split_launches(recorder, monkeypatch, lens_q, max_q, h, hk, d):
    """The switch on, a split step: the forward kernel as with it off, then the combine's packed-rows
    variant on the door's own out (total_q, H, Dv) / lse (H, total_q) and the caller's cu_seqlens_q
    (no step buffers, no scatter); the prepared call launches the same."""
    fn, args, kw = varlen(max_q=max_q, lens_q=lens_q, h=h, hk=hk, d=d)
    q, cu_q = args[0], args[3]
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "0")
    off = _memo_less(recorder, monkeypatch, fn, args, kw)
    assert [c[0] for c in off] == ["fwd", "fwd_combine"], "this cell's plan should split"
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "1")
    on = _memo_less(recorder, monkeypatch, fn, args, kw)
    assert [c[0] for c in on] == ["fwd", "fwd_combine"]
    fwd, combine = on
    # the forward kernel's arguments: all as with the switch off but its out (never written there)
    assert [a for i, a in enumerate(fwd) if i != 5] == [a for i, a in enumerate(off[0]) if i != 5]
    assert fwd[5][:4] == off[0][5][:4]  # a stand-in of the same shape and strides
    # combine(o_acc, lse_acc, out, lse, sink, pack, ctas, cu_seqlens_q)
    assert combine[1] == off[1][1] + ("rows",) and combine[2:4] == off[1][2:4] and combine[6:9] == off[1][6:9]
    total_q = q.shape[0]
    assert combine[4] == ("tensor", BF16, (total_q, h, d), (h * d, d, 1), 0, "new")
    assert combine[5] == ("tensor", torch.float32, (h, total_q), (total_q, 1), 0, "new")
    assert combine[9] == ("tensor", I32, tuple(cu_q.shape), (1,), 0, "3")  # cu_seqlens_q itself
    memo.clear()
    assert _record(recorder, fn, args, kw) == on and _record(recorder, fn, args, kw) == on


def test_decode_scatter_unsplit_launches_as_off(recorder, monkeypatch):
    """The switch on, a step the plan does not split (4 SMs): the launches of the switch-off path
    (step buffers, then the scatter, in flash4.forward.launch), memo or not."""
    monkeypatch.setenv("FLASH4_NUM_SMS", "4")
    fn, args, kw = varlen(max_q=2, lens_q=(2, 1, 0, 2), h=16, hk=16, d=64)
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "0")
    off = _memo_less(recorder, monkeypatch, fn, args, kw)
    assert [c[0] for c in off] == ["fwd"], "this cell's plan should not split"
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "1")
    assert _memo_less(recorder, monkeypatch, fn, args, kw) == off
    memo.clear()
    assert _record(recorder, fn, args, kw) == off and _record(recorder, fn, args, kw) == off


def test_decode_scatter_switch_in_key(recorder, monkeypatch):
    """FLASH4_DECODE_SCATTER is a key entry: switching it is never answered by the other setting's entry."""
    fn, args, kw = varlen()
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "0")
    off = _record(recorder, fn, args, kw)
    kept = memo.stats["kept"]
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "1")
    on = _record(recorder, fn, args, kw)
    assert memo.stats["kept"] == kept + 1 and on[-1][1] == off[-1][1] + ("rows",)
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "0")
    assert _record(recorder, fn, args, kw) == off


@pytest.mark.parametrize("cell, narrow", [("func_narrow_d80", (80, 80)), ("func_narrow_d32_gqa_full", (32, 32)),
                                          ("func_narrow_d112_window", (112, 112)), ("func_padded_d40_gqa_causal", None)])
def test_narrow_head_dims_kept(recorder, monkeypatch, cell, narrow):
    """A padded head dim without autograd runs its padded kernel on the narrow tensors (the launch's
    config has tensor_hdims, q / k / v are the caller's tensors) and is kept as a memo.NarrowCall;
    FLASH4_NARROW_HEADDIMS=0 (a key entry) gives the padded copies; GQA packing keeps the copies.
    With FLASH4_HEADDIM16 off: on (the default) these head dims have kernels of their own
    (test_headdim16_native_kept)."""
    monkeypatch.setenv("FLASH4_HEADDIM16", "0")
    fn, args, kw = CELLS[cell]
    launches = _record(recorder, fn, args, kw)
    fwd = [c for c in launches if c[0] == "fwd"]
    assert len(fwd) == 1
    assert getattr(fwd[0][1], "tensor_hdims", None) == narrow
    if narrow is not None:
        assert [d[-1] for d in fwd[0][2:5]] == ["0", "1", "2"]  # q, k, v themselves: no copies
        assert any(isinstance(c, memo.NarrowCall) for c in memo._MEMO.values())
        monkeypatch.setenv("FLASH4_NARROW_HEADDIMS", "0")
        padded = [c for c in _record(recorder, fn, args, kw) if c[0] == "fwd"]
        assert getattr(padded[0][1], "tensor_hdims", None) is None and padded[0][2][-1] == "new"


@pytest.mark.parametrize("cell, headdim", [("func_narrow_d80", 80), ("func_narrow_d32_gqa_full", 32),
                                           ("func_narrow_d112_window", 112), ("func_padded_d40_gqa_causal", 48)])
def test_headdim16_native_kept(recorder, monkeypatch, cell, headdim):
    """FLASH4_HEADDIM16 on (the default): d80 / d32 / d112 launch the kernel of their own width on the
    caller's q / k / v (no tensor_hdims, no copies) and are kept as an ordinary prepared call; d40
    runs the d48 kernel on the narrow tensors (tensor_hdims (40, 40)); the switch is a memo key entry."""
    monkeypatch.setenv("FLASH4_HEADDIM16", "1")
    fn, args, kw = CELLS[cell]
    launches = [c for c in _record(recorder, fn, args, kw) if c[0] == "fwd"]
    assert len(launches) == 1 and launches[0][1].headdim == headdim
    d = args[0].shape[-1] if hasattr(args[0], "shape") else None
    narrow = None if headdim == d else (d, d)
    assert getattr(launches[0][1], "tensor_hdims", None) == narrow
    assert [x[-1] for x in launches[0][2:5]] == ["0", "1", "2"]  # q, k, v themselves: no copies
    again = [c for c in _record(recorder, fn, args, kw) if c[0] == "fwd"]
    assert again == launches
    monkeypatch.setenv("FLASH4_HEADDIM16", "0")
    off = [c for c in _record(recorder, fn, args, kw) if c[0] == "fwd"]
    assert off[0][1].headdim != headdim  # padded to 64 / 96 / 128
