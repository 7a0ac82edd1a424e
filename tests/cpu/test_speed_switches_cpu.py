"""The two speed switches of docs/design/speed_candidates.md (both off by default), on the CPU.

dQ postprocess `wide_stores` (kernels/common/bwd_preprocess.py): NumPy models of the thread ->
element maps (the real CuTe layouts, read at trace time, where the kernel takes them from CuTe)
show that every dq element is written exactly once, with the value the narrow path writes there;
the compiled kernels store 16 bytes at a time (STG.E.128, no narrower STG) without spills.
Forward `FwdConfig.early_q_release` (kernels/sm90/fwd.py): the config field (off everywhere, out of
every shipped config's repr), and the SASS of the switched-on kernels: Q's buffer is released
right after a wgmma wait, before the tile's last P V. The GPU side (bitwise equal outputs, speed)
is tools/ab_switch.py; tools/kernel_fingerprint.py shows the switched-off kernels unchanged.
"""

import dataclasses
import math
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config import BWD_SUPPORTED_HEADDIMS, FwdConfig, select_fwd_config, shipped_fwd_configs  # noqa: E402
from flash4.constants import ROW_PASS_THREADS, ROW_TILE  # noqa: E402

# (headdim, tile_m) of the accumulator-order postprocess (BwdConfig.dq_accum_order configs).
ACCUM_ORDER = [(64, 128), (96, 64)]
THREADS = 256  # the accumulator-order postprocess's CTA: the backward's two consumer warpgroups


# ---------------------------------------------------------------------------------------- helpers
def _flatten(shape, stride):
    if isinstance(shape, int):
        return [(shape, stride)]
    return [m for s, d in zip(shape, stride) for m in _flatten(s, d)]


def _eval_mode(shape, stride, x: np.ndarray) -> np.ndarray:
    """A (nested) layout mode at 1-D coordinates x (column-major, as CuTe)."""
    out = np.zeros_like(x)
    for s, d in _flatten(shape, stride):
        out += (x % s) * d
        x = x // s
    return out


def _tv_to_rc(layout, rows: int, num_threads: int, num_values: int):
    """(row, col) arrays [thread, value] of a (thread, value) -> tile-index layout (column-major
    (rows, cols) tile), given as (shape, stride) read at trace time."""
    shape, stride = layout
    t = _eval_mode(shape[0], stride[0], np.arange(num_threads))
    v = _eval_mode(shape[1], stride[1], np.arange(num_values))
    idx = t[:, None] + v[None, :]
    return idx % rows, idx // rows


def _trace_layouts(tile_m: int, headdim: int) -> dict:
    """What the wide accumulator-order postprocess builds, read at trace time (static layouts are
    Python ints there): the dQ MMA's C (thread, value) layout, its stmatrix tiled copy's, and the
    16-byte row copy of store_rows_predicated (rebuilt as there) with its tiler."""
    import cutlass
    import cutlass.cute as cute

    from flash4.kernels.common.bwd_preprocess import BackwardPostprocessAccumOrder
    from flash4.kernels.common.dq_accum import make_dq_tiled_mma

    got = {}
    pp = BackwardPostprocessAccumOrder(headdim, cutlass.BFloat16, tile_m, wide_stores=True)

    @cute.jit
    def probe():
        mma = make_dq_tiled_mma(cutlass.BFloat16, tile_m, headdim, 2)
        tv = mma.tv_layout_C_tiled
        got["mma"] = (tv.shape, tv.stride)
        got["values"] = cute.size(tv, mode=[1])
        stm = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.BFloat16),
            mma)
        got["stmatrix"] = (stm.layout_tv_tiled.shape, stm.layout_tv_tiled.stride)
        layout = pp._smem_layout()
        got["smem_shape"] = (cute.size(layout, mode=[0]), cute.size(layout, mode=[1]))
        # store_rows_predicated's tiled copy (kernels/common/seqinfo.py)
        chunks = headdim // 8
        per_row = math.gcd(chunks, THREADS)
        thr = cute.make_ordered_layout((THREADS // per_row, per_row), order=(1, 0))
        rows = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128),
            thr, cute.make_layout((1, 8)))
        got["rows"] = (rows.layout_tv_tiled.shape, rows.layout_tv_tiled.stride)
        got["rows_tiler"] = tuple(cute.size(t) for t in rows.tiler_mn)

    cute.compile(probe, options="--gpu-arch sm_90a")  # whatever CUTE_DSL_ARCH an earlier test left
    return got


def _wgmma_c_model(tile_m: int, headdim: int):
    """(row, col) [thread, value] of the dQ wgmma accumulator from the PTX ISA's m64nNk16 D
    fragment: warp w, lane l, value v = e + 2 h + 4 j -> row 16 w + l // 4 + 8 h, column
    8 j + 2 (l % 4) + e; the second warpgroup takes rows +64 (tile_m 128) or columns +N (N =
    headdim / 2 otherwise, make_dq_tiled_mma)."""
    n = headdim if tile_m == 128 else headdim // 2
    t = np.arange(THREADS)[:, None]
    v = np.arange(64 * n // 128)[None, :]
    wg, warp, lane = t // 128, (t % 128) // 32, t % 32
    e, h, j = v % 2, (v // 2) % 2, v // 4
    row = 16 * warp + lane // 4 + 8 * h
    col = 8 * j + 2 * (lane % 4) + e
    return (row + 64 * wg, col) if tile_m == 128 else (row, col + n * wg)


# ------------------------------------------------------------------------ postprocess: element maps
@pytest.mark.parametrize("headdim", BWD_SUPPORTED_HEADDIMS)
def test_wide_row_major_writes_each_element_once(headdim):
    """Row-major wide postprocess (BackwardPostprocess(wide_stores=True)): lane l of the 8 lanes
    of a row moves chunk wide_row_chunks(headdim)[j][l] in pass j (two 16-byte fp32 loads, one
    16-byte store); the CTA's passes take each of its ROW_TILE rows once. Every element of every
    row is written once with its own accumulator value, as the narrow path (4-element chunks)."""
    pytest.importorskip("cutlass")
    from flash4.kernels.common.bwd_preprocess import CHUNK, LANES_PER_ROW, ROWS_PER_PASS, WIDE_CHUNK, wide_row_chunks

    rng = np.random.default_rng(0)
    acc = rng.standard_normal((ROW_TILE, headdim)).astype(np.float32)
    wide, narrow = np.full_like(acc, np.nan), np.full_like(acc, np.nan)
    writes = np.zeros(acc.shape, int)
    chunks = wide_row_chunks(headdim)
    for tidx in range(ROW_PASS_THREADS):
        lane = tidx % LANES_PER_ROW
        for i in range(ROW_TILE // ROWS_PER_PASS):
            s = i * ROWS_PER_PASS + tidx // LANES_PER_ROW
            for per_pass in chunks:
                c = per_pass[lane]
                if c < 0:
                    continue
                half = WIDE_CHUNK // 2
                racc = np.concatenate([acc[s, half * (2 * c + h):half * (2 * c + h + 1)] for h in range(2)])
                wide[s, WIDE_CHUNK * c:WIDE_CHUNK * (c + 1)] = racc
                writes[s, WIDE_CHUNK * c:WIDE_CHUNK * (c + 1)] += 1
            for j in range(headdim // (CHUNK * LANES_PER_ROW)):
                c = lane + LANES_PER_ROW * j
                narrow[s, CHUNK * c:CHUNK * (c + 1)] = acc[s, CHUNK * c:CHUNK * (c + 1)]
    assert (writes == 1).all()
    assert np.array_equal(wide, acc) and np.array_equal(wide, narrow)


@pytest.mark.parametrize("headdim, tile_m", ACCUM_ORDER)
def test_wide_accum_order_writes_each_element_once(headdim, tile_m):
    """Accumulator-order wide postprocess (BackwardPostprocessAccumOrder(wide_stores=True)), one
    tile, whole and with a partial last tile: the main kernel leaves value v of thread t at
    (v // 4) * 4T + 4t + v % 4 (dq_accum.py); the postprocess thread t loads those 16-byte groups
    back (its own fragment), stmatrix puts value v at the MMA coordinate of (t, v) (its tiled copy
    has the MMA's C layout), and the 16-byte row copy writes every row < valid once. Result: each
    element written once, with the value the narrow path (32-bit pairs at tCcC[v]) writes there,
    and rows >= valid untouched. The MMA layout is CuTe's, checked against the PTX wgmma model."""
    pytest.importorskip("cutlass")
    got = _trace_layouts(tile_m, headdim)
    V = got["values"]
    row, col = _tv_to_rc(got["mma"], tile_m, THREADS, V)
    model_row, model_col = _wgmma_c_model(tile_m, headdim)
    assert np.array_equal(row, model_row) and np.array_equal(col, model_col)
    assert got["stmatrix"] == got["mma"]  # stmatrix writes (t, v) where the MMA has it
    assert tuple(got["smem_shape"]) == (tile_m, headdim)

    rng = np.random.default_rng(1)
    dq = rng.standard_normal((tile_m, headdim)).astype(np.float32)  # the tile's true dQ
    # the main kernel's reduce-add (dq_accum.store_accum_order): accumulator order in memory
    accum = np.full(tile_m * headdim, np.nan, np.float32)
    t, v = np.meshgrid(np.arange(THREADS), np.arange(V), indexing="ij")
    offset = (v // 4) * 4 * THREADS + 4 * t + v % 4
    assert len(np.unique(offset)) == accum.size
    accum[offset] = dq[row, col]
    # postprocess: thread t's 16-byte group loads give back its fragment (accum_order_view)
    frag = accum[offset]
    # stmatrix into the staging tile at the MMA coordinates
    smem = np.full((tile_m, headdim), np.nan, np.float32)
    smem_writes = np.zeros(smem.shape, int)
    np.add.at(smem_writes, (row, col), 1)
    smem[row, col] = frag
    assert (smem_writes == 1).all()
    # 16-byte row chunks out (store_rows_predicated), rows < valid only
    rows_t, cols_t = got["rows_tiler"]
    r_thr, c_thr = _tv_to_rc(got["rows"], rows_t, THREADS, 8)
    assert np.array_equal(c_thr[:, 1:] - c_thr[:, :-1], np.ones((THREADS, 7), int))  # 8 contiguous columns
    narrow = np.full_like(smem, np.nan)
    pairs = np.arange(0, V, 2)
    for valid in (tile_m, tile_m - 37):
        out = np.full_like(smem, np.nan)
        writes = np.zeros(smem.shape, int)
        for m in range(tile_m // rows_t):
            for n in range(headdim // cols_t):
                rr, cc = r_thr + m * rows_t, c_thr + n * cols_t
                keep = rr < valid
                np.add.at(writes, (rr[keep], cc[keep]), 1)
                out[rr[keep], cc[keep]] = smem[rr[keep], cc[keep]]
        # the narrow path: thread t stores values v, v + 1 at (row, col), (row, col + 1), rows < valid
        narrow[:] = np.nan
        for p in (pairs, pairs + 1):
            keep = row[:, p] < valid
            narrow[row[:, p][keep], col[:, p][keep]] = frag[:, p][keep]
        assert (writes[:valid] == 1).all() and (writes[valid:] == 0).all()
        assert np.array_equal(out[:valid], dq[:valid]) and np.isnan(out[valid:]).all()
        assert np.array_equal(out, narrow, equal_nan=True)


# ---------------------------------------------------------------------------- postprocess: SASS
def _sass(cubin: bytes) -> str | None:
    from flash4.compile.check import _cuobjdump

    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True).stdout


def _postprocess_row(headdim, varlen, accum_tile_m, wide):
    from flash4.compile.cache import compile_postprocess
    from flash4.compile.check import extract_cubin, resource_usage

    cubin = extract_cubin(compile_postprocess(headdim, "bf16", varlen, accum_tile_m, wide_stores=wide))
    return resource_usage(cubin), _sass(cubin)


def _stores(sass: str) -> dict:
    """{opcode: count} of the global stores (STG.E, STG.E.64, STG.E.128) in a SASS listing."""
    ops = re.findall(r"\b(STG\.E(?:\.\d+)?)\b", sass)
    return {op: ops.count(op) for op in sorted(set(ops))}


# (headdim, varlen, accum_tile_m, STG.E.128 per thread): the accumulator-order tiles, row-major d128
# (dense) and d96 varlen (a pass with idle lanes).
WIDE_KERNELS = [(64, False, 128, 4), (96, False, 64, 3), (128, False, None, 8), (96, True, None, 8)]


@pytest.mark.parametrize("headdim, varlen, accum_tile_m, per_thread", WIDE_KERNELS,
                         ids=["d64-accum128", "d96-accum64", "d128-rows", "d96-rows-varlen"])
def test_wide_postprocess_sass(headdim, varlen, accum_tile_m, per_thread):
    """16-byte stores only (STG.E.128, per thread: the tile's bytes / 16 / threads, or per row pass
    of the row-major kernel), 16-byte accumulator loads, no spill; the accumulator-order kernel
    stages through smem (STSM, one barrier, LDS.128)."""
    pytest.importorskip("cutlass")
    res, sass = _postprocess_row(headdim, varlen, accum_tile_m, True)
    if sass is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    assert res["spills"] == 0
    assert _stores(sass) == {"STG.E.128": per_thread}, _stores(sass)
    assert "LDG.E.128" in sass
    if accum_tile_m:
        assert "STSM" in sass and "LDS.128" in sass and sass.count("BAR.SYNC") == 1


def test_narrow_postprocess_sass_for_contrast():
    """The switch-off d64 accumulator-order postprocess (what the ncu profile measured): 16
    32-bit stores per thread."""
    pytest.importorskip("cutlass")
    res, sass = _postprocess_row(64, False, 128, False)
    if sass is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    assert _stores(sass) == {"STG.E": 16}


def test_postprocess_runner_key_has_the_switch(monkeypatch, tmp_path):
    """get_bwd_postprocess_runner keys the compiled kernel by wide_stores (off: the key as before)."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FLASH4_CACHE_DIR", str(tmp_path))
    from flash4.compile import cache

    keys = []
    monkeypatch.setattr(cache, "load_or_compile", lambda kind, key, options, fn: keys.append(key))
    cache.get_bwd_postprocess_runner.__wrapped__(64, "bf16", 90, accum_tile_m=128)
    cache.get_bwd_postprocess_runner.__wrapped__(64, "bf16", 90, accum_tile_m=128, wide_stores=True)
    assert keys == [(64, "bf16", 90, "accum", 128), (64, "bf16", 90, "accum", 128, "wide")]


# ------------------------------------------------------------------------- forward: early_q_release
def test_early_q_release_is_off_and_out_of_repr():
    """Off in every shipped config, and absent from their repr (the compile-cache and fingerprint
    key), present once on; repr round-trips either way."""
    for cfg in shipped_fwd_configs():
        assert not cfg.early_q_release and "early_q_release" not in repr(cfg)
        assert eval(repr(cfg)) == cfg
    on = dataclasses.replace(select_fwd_config(64, seqlen_k=1024), early_q_release=True)
    assert repr(on).endswith(", early_q_release=True)") and eval(repr(on)) == on
    with pytest.raises(AssertionError):
        FwdConfig(headdim=64, early_q_release=True)  # not persistent


def test_early_q_release_needs_a_separate_o_buffer():
    """d256's persistent forward keeps O in Q's buffer (no smem for its own): the kernel refuses."""
    pytest.importorskip("cutlass")
    from flash4.kernels.sm90.fwd import FlashAttentionForwardSm90

    cfg = dataclasses.replace(select_fwd_config(256), persistent=True, lpt=True, early_q_release=True)
    with pytest.raises(ValueError, match="early_q_release"):
        FlashAttentionForwardSm90(cfg)
    assert FlashAttentionForwardSm90(dataclasses.replace(select_fwd_config(64, seqlen_k=1024),
                                                         early_q_release=True)).separate_o


Q_RELEASE = re.compile(r"SYNCS\.ARRIVE\.TRANS64\.A1T0 RZ, \[UR\d+\+0x8\]")  # mbar_q[1]: Q's empty barrier
# (name, config, key-block loops: each inlines mma_one_n_block, so each has its release site)
EARLY = [("d64-full-1k", select_fwd_config(64, "bf16", False, seqlen_k=1024), 1),
         ("d128-causal-1k", select_fwd_config(128, "bf16", True, seqlen_k=1024), 2)]


def _fwd_sass(cfg):
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage

    cubin = extract_cubin(compile_fwd(cfg))
    return resource_usage(cubin), _sass(cubin)


@pytest.mark.parametrize("name, cfg, loops", EARLY, ids=[n for n, _, _ in EARLY])
def test_early_q_release_sass(name, cfg, loops):
    """Switched on, Q's empty barrier gets 2 + loops arrive sites (the single-block tile after its
    first Q K^T, each key-block loop at the tile's last block after its S wait, a tile without
    keys), each reached after a wgmma wait (WARPGROUP.DEPBAR) with no HGMMA issued in between, the
    loops' before the tile's last P V; off (this config as shipped), one arrive after every HGMMA.
    No spill."""
    pytest.importorskip("cutlass")
    assert cfg.persistent
    res_on, on = _fwd_sass(dataclasses.replace(cfg, early_q_release=True))
    if on is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    assert res_on["spills"] == 0
    lines = on.splitlines()
    sites = [i for i, line in enumerate(lines) if Q_RELEASE.search(line)]
    assert len(sites) == 2 + loops, sites
    for i in sites:
        before = [line for line in lines[:i] if "HGMMA" in line or "WARPGROUP.DEPBAR" in line]
        assert "WARPGROUP.DEPBAR" in before[-1], (i, before[-1])
    last_hgmma = max(i for i, line in enumerate(lines) if "HGMMA" in line)
    assert min(sites) < last_hgmma
    if name == "d64-full-1k":  # the shipped (off) kernel, for contrast
        _, off = _fwd_sass(cfg)
        off_sites = [i for i, line in enumerate(off.splitlines()) if Q_RELEASE.search(line)]
        assert len(off_sites) == 1
        assert off_sites[0] > max(i for i, line in enumerate(off.splitlines()) if "HGMMA" in line)


def test_postprocess_wide_stores_is_the_default(monkeypatch):
    """The dQ postprocess's 16-byte stores are on by default since the H200 A/B of 2026-12-02
    (flash4.config.POSTPROCESS_WIDE_STORES); FLASH4_POSTPROCESS_WIDE turns them off for an A/B, and a
    value that is not a boolean is a ValueError naming the variable."""
    from flash4.config import POSTPROCESS_WIDE_STORES, postprocess_wide_stores

    monkeypatch.delenv("FLASH4_POSTPROCESS_WIDE", raising=False)
    assert POSTPROCESS_WIDE_STORES is True and postprocess_wide_stores() is True
    monkeypatch.setenv("FLASH4_POSTPROCESS_WIDE", "0")
    assert postprocess_wide_stores() is False
    monkeypatch.setenv("FLASH4_POSTPROCESS_WIDE", "maybe")
    with pytest.raises(ValueError, match="FLASH4_POSTPROCESS_WIDE"):
        postprocess_wide_stores()
