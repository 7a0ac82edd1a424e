"""GQA packing of the dense forward (FwdConfig.pack_gqa) on the CPU: the policy (flash4.config.
with_pack_gqa: windowed GQA configs only, as measured) and compile checks of packed kernels without
spills. The block ranges of packed tiles are tests/cpu/test_geometry.py::test_packed_*; the
kernels' results are tests/gpu/test_pack_gqa.py."""

import dataclasses

import pytest

from flash4.config import FwdConfig, select_fwd_config, with_pack_gqa


def test_policy_packs_windowed_gqa_only():
    local = select_fwd_config(64, "bf16", True, local=True, sink=True)
    assert with_pack_gqa(local, 64, 8).pack_gqa == 8
    assert with_pack_gqa(local, 8, 8).pack_gqa == 1  # MHA: nothing to pack
    causal = select_fwd_config(128, "bf16", True)
    assert with_pack_gqa(causal, 64, 8) is causal  # measured slower at d128 causal 4k (0.91x)
    assert with_pack_gqa(causal, 64, 8, policy=lambda c, h, hk: True).pack_gqa == 8


def test_policy_respects_the_kernel_limits():
    local = select_fwd_config(128, "bf16", False, local=True)
    assert with_pack_gqa(local, 12, 1).pack_gqa == 1  # tile_m 128 is no multiple of 12
    varlen = dataclasses.replace(local, varlen_q=True, varlen_k=True)
    assert with_pack_gqa(varlen, 16, 2).pack_gqa == 1
    with pytest.raises(AssertionError):
        FwdConfig(headdim=128, tile_m=128, pack_gqa=3)
    with pytest.raises(AssertionError):
        FwdConfig(headdim=128, tile_m=128, pack_gqa=2, varlen_q=True, varlen_k=True)


pytest.importorskip("cutlass")

_R = dataclasses.replace
CONFIGS = {
    "d64_local_sink_p8": _R(select_fwd_config(64, "bf16", True, local=True, sink=True), pack_gqa=8),
    "d128_causal_p8": _R(select_fwd_config(128, "bf16", True), pack_gqa=8),
    "d256_local_softcap_p2": _R(select_fwd_config(256, "bf16", False, local=True, softcap=True), pack_gqa=2),
    "d192v128_causal_p4": _R(select_fwd_config(192, "bf16", True, headdim_v=128), pack_gqa=4),
}


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.check import compile_check

    return dict(zip(CONFIGS, compile_check(list(CONFIGS.values()))))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_kernels_compile(rows, name, compiled_clean):
    row = rows[name]
    compiled_clean(row)
