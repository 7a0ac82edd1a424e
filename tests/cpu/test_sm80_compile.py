"""The sm80 family's forward compiles on the CPU for every target: sm_80, sm_86, sm_89, sm_90a and
sm_120a (--gpu-arch per call, never CUTE_DSL_ARCH), with no register spill, the warp-level
instructions in its SASS (HMMA.16816, LDSM, LDGSTS) and none of the arch-specific ones (HGMMA,
UTMA*, STSM, UTCHMMA).

Coverage (compiling all 100 shipped configs takes ~10-15 min on the 2-core CPU box): every shipped
config of sm_90a (the target the H200 runs), every distinct tile shape of the other targets'
tables in one dtype/mask each, the feature variants (window + softcap + sink, varlen +
seqused, Q in registers + persistent), the value head dims (one config per pair) and the paged
(gathered) configs: sm_90a's eleven
(flash4.config.sm80.paged_fwd_configs), d128 causal on each other target. docs/design/sm80_family.md has the full sweep's table.
"""

import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from flash4.config.sm80 import (TARGETS, kvcache_step_plan, gpu_arch_name, paged_fwd_configs,  # noqa: E402
                                select_fwd_config, shipped_fwd_configs)
from flash4.arch import capacity  # noqa: E402

FULL_TARGET = 90
SUBSET = [
    select_fwd_config(128, "bf16", True, arch=80),  # 128 x 32, 2 stages
    select_fwd_config(256, "fp16", False, arch=80),  # 128 x 64 x 8 warps, 1 stage (a100 only)
    select_fwd_config(96, "bf16", True, arch=86),  # 64 x 64, 1 stage
    select_fwd_config(128, "bf16", False, arch=86),  # 128 x 32, 1 stage
    select_fwd_config(128, "fp16", True, arch=89),  # 64 x 64 d128
    select_fwd_config(192, "bf16", False, arch=89),  # 128 x 64 x 8 warps, 1 stage
    select_fwd_config(64, "bf16", True, arch=120),
    select_fwd_config(256, "bf16", False, arch=120),  # 64 x 64 d256, 1 stage
    select_fwd_config(96, "bf16", False, arch=120),  # 128 x 64, 1 stage, 64-byte smem rows
]
FEATURES = [
    select_fwd_config(64, "bf16", False, arch=80, local=True, softcap=True, sink=True),
    select_fwd_config(128, "fp16", True, arch=86, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True),
    dataclasses.replace(select_fwd_config(64, "bf16", True, arch=120, q_in_regs=True), persistent=True),
    # decode steps (64-row tiles) with split-KV over a contiguous cache, sink left to the combine
    kvcache_step_plan(select_fwd_config(64, "bf16", True, arch=86), 1, 1, 32, 65536, 0, 132).cfg,
    kvcache_step_plan(select_fwd_config(256, "fp16", False, arch=90, sink=True), 1, 1, 32, 65536, 0, 132).cfg,
]
# Paged K/V, gathered by every thread (page_gather): all of sm_90a's paged configs, one per other target.
PAGED = paged_fwd_configs(FULL_TARGET) + [c for a in sorted(TARGETS) if a != FULL_TARGET
                                          for c in paged_fwd_configs(a) if c.headdim == 128 and c.causal
                                          and c.varlen_q]
# Value head dims (flash4.config.HDIMV_PAIRS), forward only: each pair once, on three targets.
HDIMV = [select_fwd_config(192, "bf16", True, arch=90, headdim_v=128),
         select_fwd_config(128, "bf16", False, arch=86, headdim_v=64),
         select_fwd_config(64, "fp16", True, arch=120, headdim_v=128)]
CONFIGS = shipped_fwd_configs(FULL_TARGET) + SUBSET + FEATURES + PAGED + HDIMV


def _id(cfg):
    flags = "".join(f"-{f}" for f in ("local", "softcap", "sink", "varlen_q", "seqused_k", "q_in_regs", "persistent",
                                      "page_gather", "split_kv") if getattr(cfg, f))
    dv = "" if cfg.headdim_v is None else f"-dv{cfg.headdim_v}"
    return f"{gpu_arch_name(cfg.arch)}-d{cfg.headdim}{dv}-{cfg.dtype}-{'causal' if cfg.causal else 'full'}{flags}"


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.check import compile_check
    from flash4.compile.sm80_driver import compile_fwd

    return compile_check(CONFIGS, compiler=compile_fwd)


def test_covers_every_target_and_shape():
    assert {c.arch for c in CONFIGS} == set(TARGETS)
    shapes = {(c.headdim, c.tile_m, c.tile_n, c.num_warps, c.kv_stages) for c in shipped_fwd_configs()}
    assert shapes == {(c.headdim, c.tile_m, c.tile_n, c.num_warps, c.kv_stages) for c in CONFIGS if not c.paged
                      and c.headdim_v is None and not c.split_kv}
    assert {c.arch for c in PAGED} == set(TARGETS)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[_id(c) for c in CONFIGS])
def test_compiles_clean(rows, i):
    row, cfg = rows[i], CONFIGS[i]
    from cpu_helpers import assert_portable_row_clean

    assert_portable_row_clean(row, cfg)
    assert row["smem_bytes"] <= capacity(cfg.arch).smem_per_block


def test_cold_compile_time(rows):
    # Issue 24's target is <= 3 s per config on one core; the shared 2-core box measures 5-16 s
    # under load (docs/design/sm80_family.md has the numbers): this bound only catches blow-ups.
    assert max(r["compile_s"] for r in rows) < 60.0


def test_code_paths_do_not_read_the_target_arch():
    """One source for every target: nothing in kernels/sm80 asks the DSL which arch it compiles
    for (flash-attn-4's Sm80 forward picks a TMA epilogue from it and fails on sm_90a)."""
    kernels = Path(__file__).parents[2] / "src/flash4/kernels/sm80"
    for path in (kernels / "fwd.py", kernels / "mma.py"):  # driver.py names the target to compile for
        text = path.read_text()
        for word in ("get_arch", "arch_enum", "CUTE_DSL_ARCH", "Arch.", "BaseDSL", "cfg.arch", "self.arch"):
            assert not re.search(re.escape(word), text), f"{path.name} reads the target arch ({word})"
        code = re.sub(r"#.*|\"\"\"[\s\S]*?\"\"\"", "", text)  # without comments and docstrings
        for pattern in (r"(?<![a-z])tma", "TMA", "CopyBulk", "StMatrix", "warpgroup", "tcgen05", "setmaxregister"):
            assert not re.search(pattern, code), f"{path.name} uses {pattern}"
