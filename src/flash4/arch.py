"""GPU architecture: SM version and SM count of a device (overridable), and per-arch capacities.

The device is asked through torch.cuda once per device index; FLASH4_ARCH / FLASH4_NUM_SMS
(read through env.py on every call) take precedence, so a CPU-only machine can name the target.
Importing this module imports neither torch nor the CuTe DSL (device code reads CAPS): torch is
imported by the device queries when they run.
"""

from __future__ import annotations

import dataclasses
import functools

from flash4 import env


@dataclasses.dataclass(frozen=True)
class ArchCaps:
    """Hardware limits of one SM version that kernel configs must fit.

    smem_per_block: largest dynamic shared memory one CTA may opt into (bytes).
    regs_per_sm:    32-bit registers per SM.
    max_regs_per_thread: register cap of one thread.
    tmem_bytes:     tensor memory per SM (0 where the arch has none).
    """

    arch: int
    name: str
    smem_per_block: int
    regs_per_sm: int
    max_regs_per_thread: int
    tmem_bytes: int


# CUDA programming guide, "Technical specifications per compute capability". smem_per_block is
# CUTLASS's own table (cutlass.memory.get_smem_capacity_in_bytes("sm_90") == 232448 == 227 KiB):
# flash4 reads it here, without importing the CuTe DSL on the host path, and a CPU test
# (tests/cpu/test_env_arch.py) checks every entry against CUTLASS's.
CAPS = {
    # Ampere A100 / A30 (sm_80): 164 KiB of shared memory per SM, 163 KiB per CTA.
    80: ArchCaps(80, "Ampere", smem_per_block=163 * 1024, regs_per_sm=65536, max_regs_per_thread=255, tmem_bytes=0),
    # Ampere GA10x (RTX 30xx, A10, A40) and Ada (RTX 40xx, L4, L40): 100 KiB per SM, 99 KiB per CTA.
    86: ArchCaps(86, "Ampere (GA10x)", smem_per_block=99 * 1024, regs_per_sm=65536, max_regs_per_thread=255,
                 tmem_bytes=0),
    89: ArchCaps(89, "Ada", smem_per_block=99 * 1024, regs_per_sm=65536, max_regs_per_thread=255, tmem_bytes=0),
    90: ArchCaps(90, "Hopper", smem_per_block=227 * 1024, regs_per_sm=65536, max_regs_per_thread=255, tmem_bytes=0),
    # 128 lanes x 512 columns x 4 bytes of tensor memory.
    100: ArchCaps(100, "Blackwell", smem_per_block=227 * 1024, regs_per_sm=65536, max_regs_per_thread=255,
                  tmem_bytes=128 * 512 * 4),
    # Consumer Blackwell (RTX 50xx, RTX PRO 6000): no tensor memory, 100 KiB per SM, 99 KiB per CTA.
    120: ArchCaps(120, "Blackwell (consumer)", smem_per_block=99 * 1024, regs_per_sm=65536, max_regs_per_thread=255,
                  tmem_bytes=0),
}


def capacity(arch: int) -> ArchCaps:
    """Limits of SM version `arch`. Raises ValueError for an arch not in CAPS."""
    try:
        return CAPS[arch]
    except KeyError:
        raise ValueError(f"no capacity table for sm_{arch}; known: {sorted(CAPS)}") from None


def _device_index(device) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device {device} is not a CUDA device")
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _queried(index: int) -> tuple[int, int]:
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.major * 10 + props.minor, props.multi_processor_count


def _require_cuda(what: str, variable: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device to read the {what} from; set {variable} to name it")


def device_arch(device=None) -> int:
    """SM version (e.g. 90 for H100/H200) of `device` (default: current); FLASH4_ARCH overrides.

    Raises RuntimeError without CUDA and without the override.
    """
    override = env.arch_override()
    if override is not None:
        return override
    _require_cuda("SM version", "FLASH4_ARCH")
    return _queried(_device_index(device))[0]


def num_sms(device=None) -> int:
    """Number of SMs of `device` (default: current); FLASH4_NUM_SMS overrides.

    Raises RuntimeError without CUDA and without the override.
    """
    override = env.num_sms_override()
    if override is not None:
        return override
    _require_cuda("SM count", "FLASH4_NUM_SMS")
    return _queried(_device_index(device))[1]
