"""env.py (the FLASH4_* settings) and arch.py (SM version / count, overrides, capacities)."""

import pytest
import torch

from flash4 import arch, env


@pytest.mark.parametrize("value, expected", [("90", 90), ("sm_90", 90), ("sm_90a", 90), ("SM90A", 90),
                                             ("9.0", 90), ("100", 100), ("sm_100a", 100), ("10.0", 100)])
def test_arch_override_forms(monkeypatch, value, expected):
    monkeypatch.setenv("FLASH4_ARCH", value)
    assert env.arch_override() == expected
    assert arch.device_arch() == expected  # the override wins, GPU or not


@pytest.mark.parametrize("value", ["hopper", "sm_", "9", "-90"])
def test_arch_override_bad(monkeypatch, value):
    monkeypatch.setenv("FLASH4_ARCH", value)
    with pytest.raises(ValueError, match="FLASH4_ARCH"):
        env.arch_override()


def test_num_sms_override(monkeypatch):
    monkeypatch.setenv("FLASH4_NUM_SMS", "132")
    assert env.num_sms_override() == 132 and arch.num_sms() == 132
    for bad in ("0", "many", "-3"):
        monkeypatch.setenv("FLASH4_NUM_SMS", bad)
        with pytest.raises(ValueError, match="FLASH4_NUM_SMS"):
            env.num_sms_override()
    monkeypatch.delenv("FLASH4_NUM_SMS")
    assert env.num_sms_override() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_no_gpu_without_override_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("FLASH4_ARCH", raising=False)
    monkeypatch.delenv("FLASH4_NUM_SMS", raising=False)
    with pytest.raises(RuntimeError, match="FLASH4_ARCH"):
        arch.device_arch()
    with pytest.raises(RuntimeError, match="FLASH4_NUM_SMS"):
        arch.num_sms()


def test_capacity():
    hopper = arch.capacity(90)
    assert hopper.smem_per_block == 232448 and hopper.tmem_bytes == 0 and hopper.regs_per_sm == 65536
    assert arch.capacity(100).tmem_bytes == 256 * 1024
    assert arch.capacity(80).smem_per_block == 163 * 1024 and arch.capacity(120).tmem_bytes == 0
    with pytest.raises(ValueError, match="sm_75"):
        arch.capacity(75)


def test_caps_smem_is_cutlass_table():
    """flash4.arch.CAPS is the one smem table flash4 reads (without importing the DSL on the host
    path); it must equal CUTLASS's own for every listed arch."""
    from cutlass.memory import get_smem_capacity_in_bytes

    from flash4.arch import CAPS

    for arch, caps in CAPS.items():
        assert caps.smem_per_block == get_smem_capacity_in_bytes(f"sm_{arch}"), arch


def test_registry_dispatches_by_exact_arch():
    from flash4.kernels import registry

    assert registry.family(90).name == "sm90"
    for arch in (80, 86, 89, 120):  # the portable family (mma.sync), by exact arch, behind its self-test
        assert registry.family(arch).name == "sm80"
        assert registry.family(arch, include_unverified=True).name == "sm80"
        assert registry.family(arch, prefer="portable").name == "sm80"
    assert registry.family(90, prefer="sm80").name == "sm80"  # the portable family, on Hopper for testing
    for arch in (75, 87, 101, 103, 110, 121):
        with pytest.raises(ValueError, match=f"sm_{arch}"):
            registry.family(arch)
    assert registry.family(100).name == "sm100"  # behind the first-use self-test (flash4.selftest)
    assert registry.kernel_class("fwd", 90).__name__ == "FlashAttentionForwardSm90"
    assert registry.kernel_class("bwd", 90).__name__ == "FlashAttentionBackwardSm90"
    with pytest.raises(ValueError, match="no 'nope' kernel"):
        registry.family(90).kernel_class("nope")
