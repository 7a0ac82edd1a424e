"""FwdConfig.tensor_hdims (candidate: a padded head dim's forward read from the narrow tensors):
where it applies (pure), that it stays out of the repr while None, and that the kernels compile
for sm_90a clean with the narrow fake tensors (no GPU)."""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config.sm90 import FwdConfig, select_fwd_config, tensor_hdims_error  # noqa: E402


def test_off_and_out_of_repr():
    cfg = select_fwd_config(64, "bf16", True)
    assert cfg.tensor_hdims is None and "tensor_hdims" not in repr(cfg)
    on = dataclasses.replace(cfg, tensor_hdims=(32, 32))
    assert repr(on).endswith(", tensor_hdims=(32, 32))") and eval(repr(on)) == on and on != cfg


@pytest.mark.parametrize("dims, ok", [((32, 32), True), ((8, 8), True), ((64, 64), True), ((40, 64), True),
                                      ((72, 64), False), ((32, 72), False), ((36, 32), False), ((0, 32), False),
                                      ((32,), False), ([32, 32], False)])
def test_dims_rule(dims, ok):
    cfg = select_fwd_config(64, "bf16", False)
    probe = dataclasses.replace(cfg)  # tensor_hdims_error reads fields only
    object.__setattr__(probe, "tensor_hdims", dims)
    assert (tensor_hdims_error(probe) is None) == ok
    if not ok:
        with pytest.raises(ValueError, match="tensor_hdims"):
            dataclasses.replace(cfg, tensor_hdims=dims)


@pytest.mark.parametrize("flags", [dict(varlen_q=True, varlen_k=True), dict(seqused_q=True),
                                   dict(seqused_k=True, page_rows=64), dict(seqused_k=True, page_gather=True),
                                   dict(split_kv=True), dict(pack_gqa=4)])
def test_dense_tma_layouts_only(flags):
    cfg = FwdConfig(headdim=128, **flags)
    with pytest.raises(ValueError, match="dense TMA layouts only"):
        dataclasses.replace(cfg, tensor_hdims=(112, 112))


@pytest.mark.parametrize("d, dp, causal", [(32, 64, False), (80, 96, False), (112, 128, True), (200, 256, True)])
def test_compiles_clean(d, dp, causal):
    """sm_90a: the narrow kernels compile with no spill, wgmma not serialized, Q / K / V read by TMA
    (UTMALDG) and O stored by TMA (UTMASTG), as the padded kernel."""
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage

    cfg = dataclasses.replace(select_fwd_config(dp, "bf16", causal), tensor_hdims=(d, d))
    res = resource_usage(extract_cubin(compile_fwd(cfg)))
    if not res:
        pytest.skip("cuobjdump not installed: resources not checked")
    assert res["spills"] == 0 and not res["wgmma_serialized"] and res["hgmma"] > 0, res
    assert res["utmaldg"] > 0 and res["utmastg"] > 0, res


def test_api_gate_without_gpu(monkeypatch):
    """flash4.api._narrow_forward leaves every call it cannot take to the padded path (None): CPU
    tensors, native head dims, autograd-recorded calls, a learnable sink, the switch off."""
    import torch

    from flash4 import api, env

    q = torch.randn(1, 16, 2, 40, dtype=torch.bfloat16)
    args = (None, False, (-1, -1), 0.0, None, False)
    assert env.narrow_headdims() is True
    assert api._narrow_forward(q, q, q, *args) is None  # not CUDA
    assert api._narrow_forward(q[..., :32].contiguous(), q[..., :32].contiguous(), q[..., :32].contiguous(),
                               *args) is None
    qg = q.clone().requires_grad_()
    assert api._narrow_forward(qg, q, q, *args) is None
    monkeypatch.setenv("FLASH4_NARROW_HEADDIMS", "0")
    assert env.narrow_headdims() is False
    monkeypatch.setenv("FLASH4_NARROW_HEADDIMS", "maybe")
    with pytest.raises(ValueError, match="FLASH4_NARROW_HEADDIMS"):
        env.narrow_headdims()
