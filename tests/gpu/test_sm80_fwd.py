"""The sm80 (portable) family's forward on the GPU, driven directly (flash4.compile.sm80_driver)
until the host is wired to the family. On an H200 the family is forced with
registry.family(90, prefer="sm80") and compiled for sm_90a (the same mma.sync / ldmatrix /
cp.async instructions as on sm_80 / 86 / 89 / 120); the tile shapes chosen for the other targets
run there too (their configs with arch 90), so every shipped tile shape is exercised.

Criterion (flash4.reference): max |x - ref| <= 2 * max |PyTorch same-dtype - ref| + atol for out
and LSE, into NaN-poisoned out / LSE / LSE hi-lo buffers (an unwritten element fails). Marker gpu
(tests/conftest.py); skipped without CUDA.

Speed against PyTorch's SDPA flash backend (FlashAttention-2): `python tests/gpu/test_sm80_fwd.py`.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch

from flash4.arch import device_arch
from flash4.config import sm80 as sm80_config
from flash4.geometry import window_sides
from flash4.kernels import registry
from flash4.reference import LSE_ATOL, OUT_ATOL, fwd_errors, varlen_fwd_errors

LN2 = math.log(2.0)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def family_config(headdim, dtype="bf16", causal=False, tiles_of=None, **kw):
    """The sm80 family's config on this GPU, forced through the registry override on sm_90.
    tiles_of: run the tiles chosen for that target (80, 86, 89, 120) on this GPU instead."""
    arch = device_arch()
    config = registry.family(arch, prefer="sm80").config_module()
    assert config is sm80_config
    cfg = config.select_fwd_config(headdim, dtype, causal, arch=tiles_of or arch, **kw)
    return dataclasses.replace(cfg, arch=arch)


def make_qkv(b, sq, sk, h, hk, d, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(s, generator=gen, device="cuda", dtype=dtype)
                 for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))


def poisoned(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device="cuda")


def run(cfg, q, k, v, softmax_scale=None, **kw):
    """The forward into NaN-filled out, LSE and LSE hi / lo; returns (out, lse, lse_split)."""
    from flash4.compile.sm80_driver import fwd_runner

    b, sq, h, d = q.shape
    out = poisoned((b, sq, h, v.shape[-1]), q.dtype)
    lse = poisoned((b, h, sq), torch.float32)
    lse_split = poisoned((2, b, h, sq), torch.float32)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    fwd_runner(cfg)(q, k, v, out, lse, scale, lse_split=lse_split, **kw)
    torch.cuda.synchronize()
    return out, lse, lse_split


def assert_lse_split(lse, lse_split):
    """hi + lo is the log2-domain LSE: (hi + lo) ln 2 == lse where a row saw keys; +inf, 0 where not."""
    hi, lo = lse_split
    assert not hi.isnan().any() and not lo.isnan().any(), "lse hi / lo unwritten"
    empty = torch.isneginf(lse)
    assert torch.isposinf(hi[empty]).all() and (lo[empty] == 0).all()
    full = ~empty
    torch.testing.assert_close(((hi[full].double() + lo[full].double()) * LN2).float(), lse[full], atol=1e-5, rtol=1e-6)


def check(cfg, b, sq, sk, h, hk, softmax_scale=None, window_size=None, softcap=0.0, sink=None, seed=0):
    q, k, v = make_qkv(b, sq, sk, h, hk, cfg.headdim, DTYPES[cfg.dtype], seed)
    window = window_sides(window_size, cfg.causal) if cfg.local else None
    out, lse, lse_split = run(cfg, q, k, v, softmax_scale, window=window, softcap=softcap, sink=sink)
    assert not out.isnan().any(), f"out has NaN at {out.isnan().nonzero()[:5].tolist()} (unwritten or computed)"
    assert not lse.isnan().any(), f"lse has NaN at {lse.isnan().nonzero()[:5].tolist()} (unwritten or computed)"
    errs = fwd_errors(q, k, v, out, lse, softmax_scale, cfg.causal, window_size=window_size, softcap=softcap,
                      learnable_sink=sink)
    assert errs["out_err"] <= 2 * errs["out_pt_err"] + OUT_ATOL, errs
    assert errs["lse_err"] <= 2 * errs["lse_pt_err"] + LSE_ATOL, errs
    assert_lse_split(lse, lse_split)
    if cfg.causal and sq > sk and sink is None:  # rows that see no key
        assert (out[:, : sq - sk] == 0).all() and torch.isneginf(lse[:, :, : sq - sk]).all()


# ---------------------------------------------------------------- parametrization
HEADDIMS = sm80_config.SUPPORTED_HEADDIMS
SEQLENS = (1, 17, 127, 128, 129, 1000)
RECT = ((1, 128), (17, 1000), (127, 129), (129, 17), (1000, 127), (1024, 300), (129, 1))
OTHER_TARGETS = (80, 86, 120)  # their tile tables (sm_89 has sm_86's)
HDIMV = ((192, 128), (128, 64), (64, 128))  # flash4.config.HDIMV_PAIRS
VARIANTS = {"q_in_regs": dict(q_in_regs=True), "persistent": dict(persistent=True),
            "always_rescale": dict(rescale_threshold=0.0), "exp2_emulated": dict(exp2_emu_frac=0.5)}


def used_configs():
    """Every config the tests below run (compiled up front by _prewarm, in parallel)."""
    cfgs = [family_config(d, dt, c) for d in HEADDIMS for dt in DTYPES for c in (False, True)]
    cfgs += [family_config(d, "bf16", c, tiles_of=t) for d in HEADDIMS for c in (False, True) for t in OTHER_TARGETS]
    cfgs += [dataclasses.replace(family_config(64, "bf16", c), **v) for c in (False, True) for v in VARIANTS.values()]
    cfgs += [family_config(d, "bf16", False, local=True) for d in (64, 128)]
    cfgs += [family_config(d, "bf16", c, softcap=True) for d in (64, 256) for c in (False, True)]
    cfgs += [family_config(128, "bf16", c, sink=True) for c in (False, True)]
    cfgs += [family_config(d, "bf16", c, varlen_q=True, varlen_k=True) for d in (64, 128) for c in (False, True)]
    cfgs += [family_config(128, "bf16", True, varlen_q=True, seqused_q=True, seqused_k=True)]
    cfgs += [family_config(d, "bf16", c, headdim_v=dv) for d, dv in HDIMV for c in (False, True)]
    return cfgs


@pytest.fixture(scope="module", autouse=True)
def _prewarm():
    """Compile every config of this module into the disk cache on the host's idle cores first
    (one process each): the tests then load instead of compiling one by one."""
    if torch.cuda.is_available():
        from flash4.compile.sm80_driver import prewarm

        prewarm(used_configs())


# ---------------------------------------------------------------- dense


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("seqlen", SEQLENS)
def test_square(headdim, causal, seqlen):
    check(family_config(headdim, "bf16", causal), 2, seqlen, seqlen, 4, 4)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("sq, sk", RECT)
def test_rectangular(headdim, causal, sq, sk):
    check(family_config(headdim, "bf16", causal), 2, sq, sk, 4, 4)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_fp16(headdim, causal):
    check(family_config(headdim, "fp16", causal), 2, 300, 517, 4, 2)


@pytest.mark.parametrize("h, hk", [(8, 1), (8, 2), (6, 3)], ids=["mqa", "gqa4", "gqa2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_gqa(headdim, causal, h, hk):
    check(family_config(headdim, "bf16", causal), 2, 333, 1024, h, hk)


@pytest.mark.parametrize("tiles_of", OTHER_TARGETS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_every_target_tile_shape(headdim, causal, tiles_of):
    """The tiles of sm_80 / sm_86-89 / sm_120 (those that fit the H200's smem: all of them) run here."""
    check(family_config(headdim, "bf16", causal, tiles_of=tiles_of), 2, 700, 900, 4, 2)


@pytest.mark.parametrize("headdim", [64, 128])
def test_long_and_scaled(headdim):
    check(family_config(headdim, "bf16", True), 1, 4096, 4096, 2, 1)
    check(family_config(headdim, "bf16", False), 1, 2048, 4096, 2, 2, softmax_scale=0.5)


def test_empty():
    cfg = family_config(128, "bf16", False)
    q, k, v = make_qkv(2, 64, 0, 4, 4, 128)
    out, lse, lse_split = run(cfg, q, k, v)
    assert (out == 0).all() and torch.isneginf(lse).all()  # no keys: out 0, LSE -inf
    assert_lse_split(lse, lse_split)
    q, k, v = make_qkv(2, 0, 64, 4, 4, 128)
    run(cfg, q, k, v)  # no queries: nothing to launch, nothing to write


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants(variant):
    for causal in (False, True):
        cfg = dataclasses.replace(family_config(64, "bf16", causal), **VARIANTS[variant])
        q, k, v = make_qkv(3, 555, 700, 4, 2, 64)
        kw = dict(num_sms=torch.cuda.get_device_properties(0).multi_processor_count) if cfg.persistent else {}
        out, lse, lse_split = run(cfg, q, k, v, **kw)
        errs = fwd_errors(q, k, v, out, lse, None, causal)
        assert errs["ok"], (variant, causal, errs)
        assert_lse_split(lse, lse_split)


def test_large_magnitude_scores():
    """Scores far from 0 (issue 8): the exact reference path keeps out and LSE within the rule."""
    cfg = family_config(128, "bf16", True)
    q, k, v = make_qkv(1, 300, 300, 2, 2, 128)
    out, lse, _ = run(cfg, q * 64, k * 64, v)
    errs = fwd_errors(q * 64, k * 64, v, out, lse, None, True)
    assert errs["ok"], errs


# ---------------------------------------------------------------- score / mask options
@pytest.mark.parametrize("window_size", [(64, 0), (100, 37), (0, 0), (-1, 50), (256, -1)])
@pytest.mark.parametrize("headdim", [64, 128])
def test_window(headdim, window_size):
    cfg = family_config(headdim, "bf16", False, local=True)
    check(cfg, 2, 555, 700, 4, 2, window_size=window_size)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 256])
def test_softcap(headdim, causal):
    check(family_config(headdim, "bf16", causal, softcap=True), 2, 400, 513, 4, 2, softcap=30.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sink(causal):
    sink = torch.tensor([-2.0, 0.0, 3.0, 50.0], device="cuda")
    check(family_config(128, "bf16", causal, sink=True), 2, 300, 200, 4, 2, sink=sink)


# ---------------------------------------------------------------- varlen / seqused
def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128])
def test_varlen(headdim, causal):
    lens_q, lens_k = [1, 300, 0, 129, 64], [17, 250, 5, 0, 1000]
    cfg = family_config(headdim, "bf16", causal, varlen_q=True, varlen_k=True)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q, k, v = make_qkv(1, sum(lens_q), sum(lens_k), 4, 2, headdim)
    out, lse, lse_split = run(cfg, q, k, v, seqs=(cu_q, cu_k, None, None), batch=len(lens_q),
                              max_seqlen_q=max(lens_q))
    errs = varlen_fwd_errors(q[0], k[0], v[0], cu_q, cu_k, out[0], lse[0], causal=causal)
    assert errs["ok"], errs
    assert not out.isnan().any() and not lse.isnan().any()  # every packed row belongs to some sequence
    assert_lse_split(lse, lse_split)


def test_seqused():
    """Packed Q with seqused_q and packed K/V (sequences of sk rows) with seqused_k, the layout the
    varlen door makes: rows past seqused_q stay unwritten. (Packed Q with dense, batched K is no
    layout of the host: the H200 run of c206542 refused it at the call, K's batch against Q's.)"""
    b, sk, h, hk, d = 3, 400, 4, 2, 128
    lens_q, used_q, used_k = [100, 200, 50], [100, 150, 0], [400, 17, 300]
    cfg = family_config(d, "bf16", True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)
    cu_q = _cu(lens_q)
    cu_k = _cu([sk] * b)
    q, _, _ = make_qkv(1, sum(lens_q), 1, h, hk, d)
    _, k, v = make_qkv(1, 1, b * sk, h, hk, d, seed=1)
    sq_t, sk_t = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (used_q, used_k))
    out, lse, _ = run(cfg, q, k, v, seqs=(cu_q, cu_k, sq_t, sk_t), batch=b, max_seqlen_q=max(lens_q))
    errs = varlen_fwd_errors(q[0], k[0], v[0], cu_q, cu_k, out[0], lse[0],
                             seqused_q=sq_t, seqused_k=sk_t, causal=True)
    assert errs["ok"], errs


# ---------------------------------------------------------------- speed (python tests/gpu/test_sm80_fwd.py)
def bench(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def speed_table(cells=None, variants=None):
    """TFLOPs of the sm80 family's forward (table config and `variants`: name -> config changes)
    next to SDPA's flash backend, bf16, 16k tokens per batch, 2048 hidden."""
    import torch.nn.functional as F

    cells = cells or [(d, c, s) for d in (64, 128, 256) for c in (False, True) for s in (1024, 4096, 16384)]
    print(f"{'cell':24s} {'sdpa':>7s} " + " ".join(f"{n:>12s}" for n in ["table"] + list(variants or {})))
    for d, causal, s in cells:
        h = 2048 // d
        b = max(1, 16384 // s)
        q, k, v = make_qkv(b, s, s, h, h, d)
        flops = 4 * b * h * s * s * d // (2 if causal else 1)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            t_ref = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
        row = [flops / t_ref / 1e12]
        base = family_config(d, "bf16", causal)
        for change in [{}] + list((variants or {}).values()):
            cfg = dataclasses.replace(base, **change)
            out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
            from flash4.compile.sm80_driver import fwd_runner

            runner = fwd_runner(cfg)
            row.append(flops / bench(lambda: runner(q, k, v, out, lse, 1 / math.sqrt(d))) / 1e12)
        ratio = row[1] / row[0]
        print(f"d{d} {'causal' if causal else 'full'} {s:>6d}      {row[0]:7.1f} "
              + " ".join(f"{x:7.1f} ({x / row[0]:.2f})" for x in row[1:]) + ("" if ratio >= 1 else "  < FA2"))

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim, headdim_v", HDIMV, ids=[f"{d}-{dv}" for d, dv in HDIMV])
def test_value_headdim(headdim, headdim_v, causal):
    """v's head dim differs from q/k's (out has v's): within the rule, NaN-poisoned out / LSE."""
    cfg = family_config(headdim, "bf16", causal, headdim_v=headdim_v)
    q, k, _ = make_qkv(2, 300, 517, 4, 2, headdim, seed=3)
    v = torch.randn(2, 517, 2, headdim_v, generator=torch.Generator(device="cuda").manual_seed(4), device="cuda",
                    dtype=torch.bfloat16)
    out, lse, lse_split = run(cfg, q, k, v)
    assert out.shape[-1] == headdim_v and not out.isnan().any() and not lse.isnan().any()
    errs = fwd_errors(q, k, v, out, lse, None, causal)
    assert errs["out_err"] <= 2 * errs["out_pt_err"] + OUT_ATOL, errs
    assert errs["lse_err"] <= 2 * errs["lse_pt_err"] + LSE_ATOL, errs
    assert_lse_split(lse, lse_split)


@pytest.mark.parametrize("num_splits", [1, 0, 3], ids=["nosplit", "auto", "split3"])
@pytest.mark.parametrize("page_size", [0, 16, 5], ids=["dense", "page16", "page5"])
def test_kvcache_decode(page_size, num_splits, monkeypatch):
    """flash_attn_with_kvcache with the family forced (FLASH4_FAMILY=portable): a decode step (1 query,
    32 / 8 heads, d128) over a contiguous or paged (gathered) cache whose slots past each sequence
    hold NaN; split-KV off, automatic and 3 runs (the combine kernel): within the rule against the
    reference, out and LSE."""
    monkeypatch.setenv("FLASH4_FAMILY", "portable")
    monkeypatch.setenv("FLASH4_SMALL_PAGES", "1")
    from flash4 import flash_attn_with_kvcache
    from flash4.reference import kvcache_ref, max_abs_err

    b, h, hk, d, cap = 3, 32, 8, 128, 1100
    gen = torch.Generator(device="cuda").manual_seed(10 * page_size + num_splits)
    seqlens = torch.tensor([1, 517, cap], dtype=torch.int32, device="cuda")
    table = None
    if page_size:
        max_pages = -(-cap // page_size)
        num_pages = b * max_pages + 2
        k_cache = torch.randn(num_pages, page_size, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(num_pages, generator=gen, device="cuda")[: b * max_pages].view(b, max_pages)
        table = table.to(torch.int32)
    else:
        k_cache = torch.randn(b, cap + 37, hk, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(k_cache.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    for bi, n in enumerate(seqlens.tolist()):  # every slot past the sequence: NaN
        if page_size:
            pos = torch.arange(n, table.shape[1] * page_size, device="cuda")
            rows = (table[bi, pos // page_size].long(), pos % page_size)
        else:
            rows = (bi, slice(n, None))
        k_cache[rows] = math.nan
        v_cache[rows] = math.nan
    q = torch.randn(b, 1, h, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=True,
                                       num_splits=num_splits, return_lse=True)
    ref_out, ref_lse = kvcache_ref(q, k_cache, v_cache, seqlens, page_table=table, causal=True)
    pt_out, pt_lse = kvcache_ref(q, k_cache, v_cache, seqlens, page_table=table, causal=True, upcast=False)
    assert not out.isnan().any() and not lse.isnan().any()
    assert max_abs_err(out, ref_out) <= 2 * max_abs_err(pt_out, ref_out) + OUT_ATOL
    assert max_abs_err(lse, ref_lse) <= 2 * max_abs_err(pt_lse, ref_lse) + LSE_ATOL


if __name__ == "__main__":
    # Tile alternatives to time next to the table's (each must also pass the CPU compile check).
    ALTERNATIVES = {"s3": dict(kv_stages=3), "qregs": dict(q_in_regs=True), "s1": dict(kv_stages=1)}
    speed_table(variants=ALTERNATIVES if "--variants" in sys.argv else None)

