"""The sm80 family's backward compiles on the CPU for every target (sm_80, sm_86, sm_89, sm_90a,
sm_120a; --gpu-arch per call) with no register spill, HMMA.16816 / LDSM / LDGSTS in its SASS and
no HGMMA / UTMA* / STSM / UTCHMMA; the arch-neutral pre/postprocess compile for sm_80 too.

Coverage (a backward config takes ~10-30 s to compile on the shared 2-core box): every distinct
tile shape of the table (flash4.config.sm80._BWD_TILES) on at least one target, each target at
least twice, the feature variants (varlen + seqused, window + softcap, window + deterministic) and
each value head dim pair once. The whole table:
`python -m flash4.compile.sm80_driver --bwd`.
"""

import pytest

pytest.importorskip("cutlass")

from flash4.arch import capacity  # noqa: E402
from flash4.config.sm80 import TARGETS, gpu_arch_name, select_bwd_config, shipped_bwd_configs  # noqa: E402

CONFIGS = [
    select_bwd_config(64, "bf16", False, arch=90),  # 64 x 128, 2 stages
    select_bwd_config(128, "bf16", True, arch=90),  # 64 x 64, 2 stages
    select_bwd_config(96, "fp16", False, arch=90),  # 64-byte smem rows
    select_bwd_config(192, "bf16", True, arch=90),  # 64 x 64, 1 stage
    select_bwd_config(256, "bf16", False, arch=80),  # 64 x 32, 1 stage, warps 2 x 4 on dK / dV
    select_bwd_config(128, "fp16", False, arch=80),
    select_bwd_config(128, "bf16", True, arch=86),  # 64 x 64, 1 stage
    select_bwd_config(192, "bf16", False, arch=86),  # 32 x 64: warps 2 x 4 on S / dQ
    select_bwd_config(64, "fp16", True, arch=89),
    select_bwd_config(96, "bf16", True, arch=120),
    select_bwd_config(192, "fp16", True, arch=120),
    select_bwd_config(64, "bf16", True, arch=90, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True),
    select_bwd_config(128, "bf16", False, arch=86, local=True, softcap=True),
    select_bwd_config(64, "bf16", False, arch=90, local=True, deterministic=True),  # the ordered dQ chain
]
# Value head dims (flash4.config.HDIMV_PAIRS): the tiles of max(D, Dv), each pair once.
HDIMV = [
    select_bwd_config(192, "bf16", True, arch=90, headdim_v=128),
    select_bwd_config(128, "bf16", False, arch=86, headdim_v=64),
    select_bwd_config(64, "fp16", True, arch=120, headdim_v=128, deterministic=True),
]
CONFIGS += HDIMV


def _id(cfg):
    flags = "".join(f"-{f}" for f in ("local", "softcap", "varlen_q", "seqused_k", "deterministic") if getattr(cfg, f))
    dv = "" if cfg.headdim_v is None else f"-dv{cfg.headdim_v}"
    return f"{gpu_arch_name(cfg.arch)}-d{cfg.headdim}{dv}-{cfg.dtype}-{'causal' if cfg.causal else 'full'}{flags}"


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.cache import compile_bwd
    from flash4.compile.check import compile_check

    return compile_check(CONFIGS, compiler=compile_bwd)


def test_covers_every_target_and_shape():
    assert {c.arch for c in CONFIGS} == set(TARGETS)
    def shape(c):
        return (c.headdim, c.tile_m, c.tile_n, c.num_warps, c.q_stages)
    assert {shape(c) for c in shipped_bwd_configs()} == {shape(c) for c in CONFIGS if c.headdim_v is None}


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[_id(c) for c in CONFIGS])
def test_compiles_clean(rows, i):
    row, cfg = rows[i], CONFIGS[i]
    from cpu_helpers import assert_portable_row_clean

    assert_portable_row_clean(row, cfg)
    assert row["smem_bytes"] <= capacity(cfg.arch).smem_per_block


@pytest.mark.parametrize("varlen", [False, True])
def test_row_passes_compile_for_sm80(varlen):
    """The backward's pre/postprocess (kernels/common/bwd_preprocess.py) for the plain sm_80 target."""
    from flash4.compile.cache import compile_postprocess, compile_preprocess

    compile_preprocess(128, "bf16", varlen, arch=80)
    compile_postprocess(128, "bf16", varlen, arch=80)
