"""The sm80 (portable) family's configs on the CPU: every shipped config fits its target's shared
memory (flash4.arch.CAPS, itself checked against CUTLASS's table), the tile rules hold, options the
family does not implement fail at selection, and the registry dispatches by exact arch."""

import dataclasses

import pytest

from flash4.arch import CAPS, capacity
from flash4.config import DTYPES, SUPPORTED_HEADDIMS
from flash4.config import sm80
from flash4.config.sm80 import (NATIVE_ARCHS, TARGETS, Sm80FwdConfig, gpu_arch_name, select_bwd_config,
                                select_fwd_config, shipped_bwd_configs, shipped_fwd_configs)
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
    (dict(paged=True), "paged"), (dict(split_kv=True), "split-KV"), (dict(headdim_v=128, headdim=192), "headdim_v"),
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


def test_no_backward_yet():
    with pytest.raises(ValueError, match="no sm80 backward yet"):
        select_bwd_config(128, arch=80)
    assert shipped_bwd_configs() == []
    assert sm80.unsupported(backward=True) is not None


def test_registry_dispatch():
    for arch in NATIVE_ARCHS:
        # not yet enabled for users (forward only, GPU tests pending): refused by default
        with pytest.raises(ValueError, match="compile-verified only"):
            registry.family(arch)
        fam = registry.family(arch, include_unverified=True)
        assert fam.name == "sm80" and fam.config_module() is sm80
    assert registry.family(90).name == "sm90"  # Hopper's own family by default
    assert registry.family(90, prefer="sm80").name == "sm80"  # the portable one on request (testing)
    assert registry.family(86, prefer="sm80").name == "sm80"
    with pytest.raises(ValueError, match="does not run on sm_86"):
        registry.family(86, prefer="sm90")
    with pytest.raises(ValueError, match="no kernel family named 'sm70'"):
        registry.family(90, prefer="sm70")
    for arch in (75, 100, 121):
        with pytest.raises(ValueError, match=f"sm_{arch}"):
            registry.family(arch)
    with pytest.raises(ValueError, match="no 'bwd' kernel"):
        registry.family(86, include_unverified=True).kernel_class("bwd")


def test_config_dispatch_through_flash4_config():
    from flash4 import config

    # the family is registered but not enabled for users yet: flash4.config's dispatch refuses it,
    # the family's own module selects
    with pytest.raises(ValueError, match="compile-verified only"):
        config.select_fwd_config(128, "bf16", False, arch=89)
    assert select_fwd_config(128, arch=89).arch == 89
    with pytest.raises(ValueError, match="no sm80 backward yet"):
        sm80.select_bwd_config(128, arch=120)
