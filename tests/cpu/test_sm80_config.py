"""The sm80 (portable) family's configs on the CPU: every shipped config fits its target's shared
memory (flash4.arch.CAPS, itself checked against CUTLASS's table), the tile rules hold, options the
family does not implement fail at selection, and the registry dispatches by exact arch."""

import dataclasses
import re

import pytest

from flash4.arch import CAPS, capacity
from flash4.config import DTYPES, SUPPORTED_HEADDIMS
from flash4.config import sm80
from flash4.config.sm80 import (NATIVE_ARCHS, PAGED_TILE_N, TARGETS, Sm80FwdConfig, gpu_arch_name,
                                select_bwd_config, select_fwd_config, shipped_bwd_configs, shipped_fwd_configs)
from flash4.kernels import registry

ALL = shipped_fwd_configs()


def test_shipped_covers_every_target_headdim_dtype_and_mask():
    keys = {(c.arch, c.headdim, c.dtype, c.causal) for c in ALL}
    assert keys == {(a, d, dt, c) for a in TARGETS for d in SUPPORTED_HEADDIMS for dt in DTYPES for c in (False, True)}
    assert len(ALL) == len(keys)
    assert shipped_fwd_configs(86) == [c for c in ALL if c.arch == 86]


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: f"sm{c.arch}-d{c.headdim}-{c.dtype}-{'c' if c.causal else 'f'}")
def test_smem_fits_target(cfg):
    assert cfg.smem_bytes() <= capacity(cfg.arch).smem_per_block, (cfg, cfg.smem_bytes())
    # tile rules the kernel relies on: 16-row mma slabs per warp, k16 slices of P, whole cp.async passes
    assert cfg.tile_m % (16 * cfg.num_warps) == 0 and cfg.tile_n % 16 == 0
    threads_per_row = (64 if cfg.headdim % 64 == 0 else 32) // 8
    rows_per_pass = cfg.num_threads // threads_per_row
    assert cfg.tile_m % rows_per_pass == 0 and cfg.tile_n % rows_per_pass == 0
    # the O + S accumulators leave room in 255 registers (the compile check proves no spill)
    assert cfg.accumulator_regs() <= 160


def test_smem_table_is_cutlass_table():
    """The capacities the configs are checked against are CUTLASS's own (sm_80 163 KiB, sm_86 /
    sm_89 / sm_120 99 KiB, sm_90 227 KiB per CTA)."""
    from cutlass.memory import get_smem_capacity_in_bytes

    for arch in TARGETS:
        assert CAPS[arch].smem_per_block == get_smem_capacity_in_bytes(f"sm_{arch}"), arch


def test_two_ctas_per_sm_where_fa2_has_them():
    """4-warp configs keep two CTAs per SM by shared memory (8 warps per SM), except d256 on the
    99 KiB parts (64 x 64, 96 KiB: FA2's choice there too); the 8-warp ones need one."""
    for cfg in ALL:
        small_d256 = cfg.headdim == 256 and capacity(cfg.arch).smem_per_block < 100 * 1024
        assert cfg.ctas_per_sm() >= (2 if cfg.num_warps == 4 and not small_d256 else 1), cfg


def test_gpu_arch_names():
    assert [gpu_arch_name(a) for a in (80, 86, 89, 90, 120)] == ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_120a"]
    with pytest.raises(ValueError, match="sm_100"):
        gpu_arch_name(100)
    with pytest.raises(ValueError, match="not compiled for sm_75"):
        select_fwd_config(128, arch=75)


def test_select_flags():
    cfg = select_fwd_config(128, "fp16", True, arch=86)
    assert cfg.causal and cfg.lpt and cfg.dtype == "fp16" and cfg.arch == 86
    win = select_fwd_config(64, causal=True, arch=80, local=True)
    assert win.local and not win.causal and not win.lpt  # a window folds causal into its right side
    full = select_fwd_config(96, arch=120, softcap=True, sink=True, varlen_q=True, seqused_k=True, seqlen_k=100)
    assert full.softcap and full.sink and full.varlen_q and full.seqused_k and not full.varlen_k
    assert select_fwd_config(64, arch=90, q_in_regs=True).q_in_regs
    assert hash(cfg) == hash(dataclasses.replace(cfg))  # a frozen, hashable compile key


@pytest.mark.parametrize("kwargs, words", [
    (dict(headdim_v=96, headdim=192), "headdim 96 differs"),
])
def test_unimplemented_options_fail_at_selection(kwargs, words):
    headdim = kwargs.pop("headdim", 128)
    with pytest.raises(ValueError, match=words):
        select_fwd_config(headdim, arch=80, **kwargs)
    with pytest.raises(AssertionError):
        Sm80FwdConfig(headdim=128, page_rows=16)


def test_bad_inputs():
    with pytest.raises(ValueError, match="headdim=80"):
        select_fwd_config(80, arch=80)
    with pytest.raises(ValueError, match="dtype"):
        select_fwd_config(64, "fp32", arch=80)


BWD = shipped_bwd_configs()


def test_bwd_shipped_per_target():
    for arch in TARGETS:
        keys = {(c.headdim, c.dtype, c.causal) for c in shipped_bwd_configs(arch)}
        assert keys == {(d, dt, c) for d in sm80.bwd_headdims(arch) for dt in DTYPES for c in (False, True)}
    # every head dim on the big-smem targets; d256 needs more than the 99 KiB parts have
    assert sm80.bwd_headdims(80) == sm80.bwd_headdims(90) == SUPPORTED_HEADDIMS
    for arch in (86, 89, 120):
        assert sm80.bwd_headdims(arch) == (64, 96, 128, 192)
        with pytest.raises(ValueError, match="does not implement a backward for headdim 256 on sm_%d" % arch):
            select_bwd_config(256, arch=arch)


@pytest.mark.parametrize("cfg", BWD, ids=lambda c: f"sm{c.arch}-d{c.headdim}-{c.dtype}-{'c' if c.causal else 'f'}")
def test_bwd_smem_fits_target(cfg):
    assert cfg.smem_bytes() <= capacity(cfg.arch).smem_per_block, (cfg, cfg.smem_bytes())
    # the register bound's bulk (dK + dV held across the loop, S + dP of a step) stays well below 255
    assert cfg.accumulator_regs() <= 160, cfg
    # host-shared fields the backward reads alike for every family
    assert not cfg.dkv_accum and not cfg.dq_accum_order and cfg.hdim_v == cfg.headdim


def test_bwd_options():
    cfg = select_bwd_config(128, "fp16", True, arch=89, varlen_q=True, varlen_k=True, seqused_k=True, softcap=True)
    assert cfg.causal and cfg.varlen_q and cfg.varlen_k and cfg.seqused_k and cfg.softcap and cfg.dynamic_seqlen_k
    assert select_bwd_config(64, causal=True, local=True, arch=80).causal is False  # folded into the window
    assert select_bwd_config(64, arch=80, deterministic=True).deterministic
    assert select_bwd_config(128, arch=80, headdim_v=64).hdim_v == 64  # a value head dim pair
    with pytest.raises(ValueError, match="headdim 32 differs"):
        select_bwd_config(128, arch=80, headdim_v=32)
    with pytest.raises(ValueError, match="headdim=80"):
        select_bwd_config(80, arch=80)
    assert sm80.unsupported(pack_gqa=True).startswith(sm80.UNSUPPORTED_PREFIX)
    with pytest.raises(AssertionError):
        sm80.Sm80BwdConfig(headdim=64, tile_m=48)  # not whole 16-row slabs per warp


def test_registry_dispatch():
    for arch in NATIVE_ARCHS:  # served behind the first-use self-test (FLASH4_PORTABLE; test_sm80_gate.py)
        fam = registry.family(arch)
        assert fam.name == "sm80" and fam.config_module() is sm80 and not fam.verified and fam.selftest_gated
        assert registry.family(arch, include_unverified=True) is fam and registry.gate_family(arch) is fam
        assert registry.family(arch, prefer="portable") is fam
    assert registry.family(90).name == "sm90"  # Hopper's own family by default
    assert registry.family(90, prefer="sm80").name == "sm80"  # the portable one on request (testing)
    assert registry.family(90, prefer="portable").name == "sm80"
    with pytest.raises(ValueError, match="does not run on sm_86"):
        registry.family(86, prefer="sm90")
    with pytest.raises(ValueError, match="no kernel family named 'sm70'"):
        registry.family(90, prefer="sm70")
    for arch in (75, 121):
        with pytest.raises(ValueError, match=f"sm_{arch}"):
            registry.family(arch)
    assert registry.family(100).name == "sm100"  # Blackwell's own family (behind its self-test)
    assert registry.family(86, "portable").kernels.keys() == {"fwd", "bwd"}
    # a config's family decides its kernel class, whatever arch it targets
    assert registry.config_family(select_fwd_config(64, arch=90)).name == "sm80"
    assert registry.config_family(select_bwd_config(64, arch=90)).name == "sm80"
    from flash4.config import sm90

    assert registry.config_family(sm90.select_fwd_config(64)).name == "sm90"


def test_env_override(monkeypatch):
    from flash4 import config, env
    from flash4.config import active_family

    monkeypatch.delenv("FLASH4_FAMILY", raising=False)
    assert env.family_override() is None
    assert active_family(90).name == "sm90"
    monkeypatch.setenv("FLASH4_FAMILY", "Portable")
    assert env.family_override() == "sm80"
    assert active_family(90).name == "sm80"
    assert isinstance(config.select_fwd_config(128, arch=90), Sm80FwdConfig)
    assert isinstance(config.select_bwd_config(128, arch=90), sm80.Sm80BwdConfig)
    monkeypatch.setenv("FLASH4_FAMILY", "sm90")
    with pytest.raises(ValueError, match="FLASH4_FAMILY"):
        active_family(86)
    monkeypatch.setenv("FLASH4_FAMILY", "sm70")
    with pytest.raises(ValueError, match="no kernel family named 'sm70'"):
        active_family(90)


def test_config_dispatch_through_flash4_config(monkeypatch):
    from flash4 import config

    monkeypatch.delenv("FLASH4_FAMILY", raising=False)  # the family is the default on its own archs
    # sm_80 / 86 / 89 / 120 select the portable family through flash4.config's dispatch
    assert config.select_fwd_config(128, "bf16", False, arch=89) == select_fwd_config(128, arch=89)
    assert config.select_bwd_config(128, "bf16", True, arch=120) == select_bwd_config(128, causal=True, arch=120)
    assert config.shipped_bwd_configs(86) == shipped_bwd_configs(86)


def test_host_plans_on_portable_archs(monkeypatch):
    """flash4.config.fwd_config / bwd_config (the host's questions) on sm_86, and on sm_90 forced:
    the family's configs for dense, packed, decode and paged requests (paged: gathered rows)."""
    import torch

    from flash4.config import bwd_config, fwd_config
    from flash4.request import DECODE, Request, SeqSpec

    monkeypatch.delenv("FLASH4_FAMILY", raising=False)  # the family is the default on its own archs

    q = torch.zeros(2, 100, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 300, 2, 128, dtype=torch.bfloat16)
    dense = Request.dense(q, k, k, 0.1, True)
    plan = fwd_config(dense, 86)
    assert isinstance(plan.cfg, Sm80FwdConfig) and plan.cfg.arch == 86 and plan.cfg.causal and plan.pack == 1
    bplan = bwd_config(dense, 86)
    assert isinstance(bplan.cfg, sm80.Sm80BwdConfig) and bplan.heads_per_cta == 4 and bplan.cfg.q_stages == 1
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    packed = Request.varlen(q[0], k[0], k[0], cu, cu, 60, 60, None, None, None, 0.1, False)
    cfg = fwd_config(packed, 80).cfg
    assert cfg.varlen_q and cfg.varlen_k and not cfg.seqused_q
    bcfg = bwd_config(packed, 80).cfg
    assert bcfg.varlen_q and bcfg.varlen_k and bcfg.dynamic_seqlen_k
    step = dense.with_seq(SeqSpec(DECODE, seqused_k=torch.full((2,), 300, dtype=torch.int32)))
    plan = fwd_config(step, 120, 84)
    assert plan.cfg.seqused_k and plan.num_splits == 1 and plan.pack == 1 and plan.heads_p == 8
    paged = dense.with_seq(SeqSpec(DECODE, seqused_k=torch.full((2,), 300, dtype=torch.int32),
                                   page_table=torch.zeros(2, 3, dtype=torch.int32)))
    plan = fwd_config(paged, 89, 84)  # paged: gathered rows (page_gather), the decode step's layout
    assert plan.cfg.page_gather and plan.cfg.paged and plan.cfg.seqused_k
    assert plan.num_splits == 2 and plan.cfg.split_kv  # 16 tiles on 84 SMs, 900 keys of capacity: split
    pages = torch.zeros(2, 3, dtype=torch.int32)
    used = torch.full((2,), 100, dtype=torch.int32)
    kp = torch.zeros(6, 64, 2, 128, dtype=torch.bfloat16)
    prefill = Request.varlen(q[0], kp, kp, cu, None, 60, 300, seqused_k=used, page_table=pages, softmax_scale=0.1,
                             causal=True)
    cfg = fwd_config(prefill, 80).cfg
    assert cfg.page_gather and cfg.varlen_q and not cfg.varlen_k and cfg.seqused_k
    assert not isinstance(fwd_config(dense, 90).cfg, Sm80FwdConfig)  # Hopper's own family by default


def test_host_plans_forced_on_sm90(monkeypatch):
    import torch

    from flash4.config import bwd_config, fwd_config
    from flash4.request import Request

    monkeypatch.setenv("FLASH4_FAMILY", "portable")
    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    req = Request.dense(q, q, q, 0.1, False, deterministic=True)
    assert fwd_config(req, 90).cfg == select_fwd_config(64, "fp16", arch=90)
    assert bwd_config(req, 90).cfg == select_bwd_config(64, "fp16", arch=90, deterministic=True)


def test_paged_configs_gather():
    """paged=True selects the table's tiles with page_gather (every thread's cp.async rows from their
    own pages); the repr of every non-paged config is unchanged (page_gather left out while off:
    the compile-cache key)."""
    for arch in sm80.TARGETS:
        for d in (64, 128, 256):
            plain, paged = select_fwd_config(d, arch=arch), select_fwd_config(d, arch=arch, paged=True)
            assert paged.page_gather and paged.paged and not plain.paged
            tile_n = PAGED_TILE_N.get(d, plain.tile_n)  # the gather's d96 / d256 tile
            assert dataclasses.replace(paged, page_gather=False) == dataclasses.replace(plain, tile_n=tile_n)
            assert "page_gather" not in repr(plain) and "page_gather=True" in repr(paged)
    assert all(c.page_gather and c.seqused_k for c in sm80.paged_fwd_configs())


def test_value_headdims_take_the_wider_tile():
    """(192, 128), (128, 64), (64, 128) (flash4.config.HDIMV_PAIRS): the forward exists, with the table's
    tile of max(D, Dv), forward (the causal row's on the 99 KiB parts) and backward."""
    for arch in sm80.TARGETS:
        for d, dv in ((192, 128), (128, 64), (64, 128)):
            for causal in (False, True):
                cfg = select_fwd_config(d, causal=causal, arch=arch, headdim_v=dv)
                small = arch in (86, 89, 120)
                wide = select_fwd_config(max(d, dv), causal=causal or small, arch=arch)
                assert (cfg.headdim_v, cfg.hdim_v) == (dv, dv)
                assert (cfg.tile_m, cfg.tile_n, cfg.num_warps, cfg.kv_stages) == (
                    wide.tile_m, wide.tile_n, wide.num_warps, wide.kv_stages)
                assert cfg.smem_bytes() <= wide.smem_bytes()
                bwd = sm80.select_bwd_config(d, causal=causal, arch=arch, headdim_v=dv)
                wide_bwd = sm80.select_bwd_config(max(d, dv), causal=causal, arch=arch)
                assert bwd.hdim_v == dv and (bwd.tile_m, bwd.tile_n, bwd.num_warps) == (
                    wide_bwd.tile_m, wide_bwd.tile_n, wide_bwd.num_warps)
                assert sm80.bwd_candidates(bwd) == {}  # the speed candidates were checked at Dv = D only
    with pytest.raises(ValueError, match="headdim 96 differs"):
        sm80.select_bwd_config(192, arch=80, headdim_v=96)


def test_decode_plan_splits_by_the_shared_rule():
    """A decode step splits the cache's key blocks where the tiles leave SMs idle
    (flash4.config.choose_num_splits), never into runs shorter than its rule allows; num_splits
    given by the caller is kept (clamped to the key blocks); no GQA packing."""
    from flash4.config import MIN_BLOCKS_PER_SPLIT, choose_num_splits

    cfg = select_fwd_config(128, arch=86)
    plan = sm80.kvcache_step_plan(cfg, 1, 1, 32, 128 * 1024, 0, 84)
    n_blocks = 128 * 1024 // cfg.tile_n
    assert plan.num_splits == choose_num_splits(32, n_blocks, 84) > 1
    assert plan.cfg.split_kv and plan.cfg.seqused_k and plan.pack == 1 and plan.heads_p == 32
    assert n_blocks // plan.num_splits >= MIN_BLOCKS_PER_SPLIT
    busy = sm80.kvcache_step_plan(cfg, 64, 1, 32, 4096, 0, 84)  # 2048 tiles fill the GPU
    assert busy.num_splits == 1 and not busy.cfg.split_kv
    assert sm80.kvcache_step_plan(cfg, 1, 1, 32, 4096, 1, 84).num_splits == 1  # off
    forced = sm80.kvcache_step_plan(cfg, 1, 1, 32, 4096, 7, 84)
    assert forced.num_splits == 7 and forced.cfg.split_kv
    assert sm80.kvcache_step_plan(cfg, 1, 1, 32, 100, 7, 84).num_splits == -(-100 // cfg.tile_n)  # clamped
    assert sm80.kvcache_step_plan(cfg, 1, 1, 32, 4096, 0, None).num_splits == 1


def test_kvcache_step_packs_gqa_heads():
    """The sm90 family's host GQA packing on the portable family's kvcache steps: the query heads of
    a KV head become rows of one tile (non-causal; Sq == 1 sees every key), except with a window,
    causal steps of several queries, or a sink that cannot go to the combine."""
    causal = select_fwd_config(128, causal=True, arch=86)
    plan = sm80.kvcache_step_plan(causal, 2, 1, 32, 65536, 0, 84, nheads_k=8, causal=True)
    assert (plan.pack, plan.seqlen_p, plan.heads_p) == (4, 4, 8)
    assert not plan.cfg.causal and plan.cfg.tile_m == sm80.DECODE_TILE_M and plan.cfg.seqused_k
    assert sm80.kvcache_step_plan(causal, 2, 4, 32, 65536, 0, 84, nheads_k=8, causal=True).pack == 1
    full = select_fwd_config(128, arch=86)
    assert sm80.kvcache_step_plan(full, 2, 4, 32, 65536, 0, 84, nheads_k=8).seqlen_p == 16  # non-causal: packs
    local = select_fwd_config(128, arch=86, local=True)
    assert sm80.kvcache_step_plan(local, 2, 1, 32, 65536, 0, 84, nheads_k=8, window=(100, 0)).pack == 1
    sink = select_fwd_config(128, causal=True, arch=86, sink=True)
    assert sm80.kvcache_step_plan(sink, 2, 1, 32, 65536, 1, 84, nheads_k=8, causal=True).pack == 1  # no split
    packed = sm80.kvcache_step_plan(sink, 64, 1, 32, 65536, 0, 84, nheads_k=8, causal=True)
    assert packed.pack == 4 and packed.num_splits >= 2 and packed.cfg.split_kv  # the combine adds the sinks
    assert sm80.kvcache_step_plan(causal, 2, 1, 32, 65536, 0, 84).pack == 1  # nheads_k not given


@pytest.mark.parametrize("hdim,expect", [(64, (3, 3, 3)), (128, (3, 3, 3)), (256, (3, 3, 3)), (96, (2, 3, 3))])
def test_pointer_swizzle_is_the_layout_swizzle_in_bytes(hdim, expect):
    """The portable smem stages' swizzle on element offsets (the layouts) and on byte addresses (a
    pointer's swizzle, paged forward): the pointer's moves whole 16-byte chunks. The element swizzle put
    on the pointer (S<3,3,3> on bytes) made every 16-byte ldmatrix / cp.async of the paged forward
    misaligned on the H200 (2026-12-03)."""
    from flash4.kernels.sm80.mma import pointer_swizzle_params, swizzle_params

    assert swizzle_params(16, hdim) == expect
    bits, base, shift = pointer_swizzle_params(16, hdim)
    assert (bits, base, shift) == (expect[0], 4, 3)
    for elem in range(0, 8 * 128, 8):  # the same permutation: swizzle(2 * o) == 2 * swizzle(o) on 16-byte chunks
        def sw(x, b, m, s):
            return x ^ ((x >> s) & (((1 << b) - 1) << m))
        assert sw(2 * elem, bits, base, shift) == 2 * sw(elem, *expect)
