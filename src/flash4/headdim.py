"""Which head dims flash4 serves, and how (issue 13 item 2).

The kernels are compiled for the native head dims flash4.config.SUPPORTED_HEADDIMS (64, 96, 128,
192, 256) and the (q/k, v) pairs flash4.config.HDIMV_PAIRS. Every other head dim that is a
multiple of 8 from 8 to 256 (8, 16, 32 for small models and vision transformers, 72, 80, 112, 160,
...) is served by zero-padding the last dim to a native one before the kernel and slicing the
output after it:

  * q and k padded with zeros to the same width D' >= D: q.k is unchanged (the padded products are
    0), so scores, the softmax and the LSE are exactly those of the unpadded problem;
    softmax_scale's default stays 1/sqrt(D) of the real head dim.
  * v padded to Dv' >= Dv: the output's extra columns are sum_j p_ij * 0 = 0 and are dropped.
  * the backward runs through autograd's F.pad / slice: the padded columns' gradients are dropped,
    the real ones are the kernels' (exact, as above).

Padding costs a copy of q, k, v (and of the output) per call and the FLOPs of the padded width
(d8 runs as d64: 8x the work of an ideal d8 kernel); speed is reported against SDPA's best backend in
docs/perf. Since 2026-12-04 a dense flash_attn_func call that autograd does not record skips the
copies on sm_90 (flash4.forward.launch_narrow, FLASH4_NARROW_HEADDIMS): the padded kernel reads the
narrow tensors, its TMA boxes zero-filling the columns past D / Dv and its O store clipping them
(FwdConfig.tensor_hdims; the same bits; 1.22-1.58x on the H200); the padded FLOPs remain. A KV cache (flash_attn_with_kvcache, or a paged varlen call) is not padded per call: a
cache is appended to in place and copying it every step would cost more than the attention; those
entry points serve the native head dims only (allocate the cache with a native head dim), and with
FLASH4_CACHE_HEADDIM16 (on by default since 2026-12-05, when its GPU tests passed on an H100; 0 turns it off)
every kernel head dim of the GPU's family (`cache_headdims`: on sm_90 the multiples of 16 up to 128).

On sm_90 (FLASH4_HEADDIM16, on by default since 2026-12-04 night) the kernels are also built for
every multiple of 16 up to 128 (flash4.config.sm90.KERNEL_HEADDIMS: 16, 32, 48, 80, 112): those head
dims run unpadded, forward and backward, and the other multiples of 8 up to 128 pad to the next
multiple of 16 (d40 -> 48, d72 -> 80, d120 -> 128; the no-grad forward reads them narrow); above
128 the rule below still applies (the d192 / d256 tiles spill at d144-d240). H200 against the
padding to 64 / 96 / 128: backward 1.02-1.64x, forward 1.00-1.17x (tools/ab_headdim16.py,
docs/perf/README.md). padded_headdims / is_native take the SM version for this (`arch`); without
it they answer the rule below, which every family has.

Training on a GPU whose backward lacks a pair the forward has (sm_100: hd96; flash4.config.sm100's
SM100_BWD_HEADDIM_PAIRS) pads the whole call, forward included, to the pair that backward has
(`training_headdims`: hd96 -> 128), so q, k, v, out and lse reach the backward at one width; without
grad the forward keeps its own kernel. Compile-verified on sm_100, not run on hardware.

Rule (`padded_headdims`): D and Dv multiples of 8 in [8, 256]; D' = the smallest native head dim
>= D, Dv' likewise; if (D', Dv') is neither equal nor a native pair, both become max(D', Dv') (a
pair of equal width, always native). Anything else raises ValueError naming the rule.
"""

from __future__ import annotations

from flash4.config import HDIMV_PAIRS, SUPPORTED_HEADDIMS

HEADDIM_MULTIPLE = 8  # TMA rows and 16-byte vectors: the last dim in whole 16-byte chunks (bf16/fp16)
MAX_HEADDIM = max(SUPPORTED_HEADDIMS)
RULE = (f"head dims are served natively for {', '.join(map(str, SUPPORTED_HEADDIMS))} (and the (q/k, v) pairs "
        f"{', '.join(f'({d}, {dv})' for d, dv in HDIMV_PAIRS)}), and by zero-padding to the next native one for "
        f"every other multiple of {HEADDIM_MULTIPLE} from {HEADDIM_MULTIPLE} to {MAX_HEADDIM}")


def is_native(headdim: int, headdim_v: int, arch: int | None = None) -> bool:
    """True when a kernel exists for (headdim, headdim_v) as is: on every family, or (arch given) on
    the family of SM version `arch` (flash4.config.kernel_headdims: sm_90's multiples of 16 while
    FLASH4_HEADDIM16 is on)."""
    if headdim in SUPPORTED_HEADDIMS and (headdim_v == headdim or (headdim, headdim_v) in HDIMV_PAIRS):
        return True  # every family's: no family lookup
    return arch is not None and headdim_v == headdim and headdim in _kernel_headdims(arch)


def _kernel_headdims(arch: int) -> tuple:
    from flash4.config import kernel_headdims

    return kernel_headdims(arch)


def cache_headdims(arch: int | None) -> tuple:
    """The head dims a KV cache or a paged pool may have (never padded per call): SUPPORTED_HEADDIMS;
    with FLASH4_CACHE_HEADDIM16 on and the SM version `arch` known, every kernel head dim of that
    GPU's family (flash4.config.kernel_headdims: on sm_90 every multiple of 16 up to 128 while
    FLASH4_HEADDIM16 is on). Read per call."""
    from flash4 import env

    if arch is None or not env.cache_headdim16():
        return SUPPORTED_HEADDIMS
    return tuple(sorted(set(SUPPORTED_HEADDIMS) | set(_kernel_headdims(arch))))


def servable(headdim: int) -> bool:
    """True for a multiple of 8 from 8 to 256 (native or padded)."""
    return isinstance(headdim, int) and HEADDIM_MULTIPLE <= headdim <= MAX_HEADDIM and headdim % HEADDIM_MULTIPLE == 0


def _next_native(headdim: int) -> int:
    return min(d for d in SUPPORTED_HEADDIMS if d >= headdim)


def padded_headdims(headdim: int, headdim_v: int, arch: int | None = None) -> tuple[int, int]:
    """(D', Dv') the kernels run for the caller's (D, Dv): (D, Dv) itself when native, else the
    module docstring's rule. arch: the SM version, when known: its family's own kernel head dims
    count (is_native); on sm_90 with FLASH4_HEADDIM16 on, an equal pair pads to the next multiple
    of 16 (d40 -> 48, d72 -> 80) where that is a kernel head dim. Raises ValueError (naming the
    rule) when D or Dv is not servable."""
    for name, d in (("headdim", headdim), ("headdim_v", headdim_v)):
        if not servable(d):
            raise ValueError(f"{name}={d} is not served: {RULE}")
    if is_native(headdim, headdim_v, arch):
        return headdim, headdim_v
    if arch is not None and headdim_v == headdim:
        wider = [d for d in _kernel_headdims(arch) if d >= headdim]
        if wider and min(wider) < _next_native(headdim):
            return min(wider), min(wider)
    d_p, dv_p = _next_native(headdim), _next_native(headdim_v)
    if is_native(d_p, dv_p):
        return d_p, dv_p
    wide = max(d_p, dv_p)
    return wide, wide


def training_headdims(headdim: int, headdim_v: int, arch: int) -> tuple[int, int]:
    """(D', Dv') the kernels run a call at when autograd will ask for its backward on SM version `arch`:
    padded_headdims(D, Dv), then, on sm_100, the pair the sm100 backward has for it
    (flash4.config.sm100.bwd_padded_headdims: hd96 -> 128; compile-verified, not run on hardware). The
    forward runs at that width too, so q, k, v, out and lse reach the backward consistent; exact, as
    every padding here (softmax_scale's default stays 1/sqrt(D) of the caller's D). Raises ValueError as
    padded_headdims."""
    d_p, dv_p = padded_headdims(headdim, headdim_v, arch)
    if arch == 100:
        from flash4.config import sm100

        return sm100.bwd_padded_headdims(d_p, dv_p)
    return d_p, dv_p


def training_may_pad(headdim: int, headdim_v: int) -> bool:
    """True when training_headdims may widen the kernels' pair (headdim, headdim_v) on some GPU (sm_100's
    backward lacks it: hd96), so the caller must ask q's SM version; pure (no device query)."""
    from flash4.config import sm100

    return sm100.bwd_padded_headdims(headdim, headdim_v) != (headdim, headdim_v)


def headdim_error(headdim: int, headdim_v: int, what: str = "q/k") -> str | None:
    """The ValueError message for an unservable (headdim, headdim_v), or None."""
    try:
        padded_headdims(headdim, headdim_v)
    except ValueError as err:
        return f"{what}: {err}"
    return None


def pad_last(t, width: int):
    """t with its last dim zero-padded to `width` (t itself when it has that width already)."""
    import torch.nn.functional as F

    extra = width - t.shape[-1]
    return t if extra == 0 else F.pad(t, (0, extra))
