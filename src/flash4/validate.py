"""Argument checks for the public API (precise TypeError / ValueError before any launch), and the
request builders: the one place a call's arguments become a flash4.request.Request.

    dense_request(...)    flash_attn_func's arguments     -> Request (layout DENSE)
    varlen_request(...)   flash_attn_varlen_func's        -> Request (VARLEN, or PAGED with page_table)
    kvcache_request(...)  flash_attn_with_kvcache's       -> Request (KVCACHE)

Each builder raises the first problem of its door's argument list, then builds the request
(metadata made contiguous, the optional on-device value checks run, max_seqlen_q and cache_seqlens
resolved). `support_error(...)` / `varlen_support_error(...)` / `kvcache_support_error(...)` are
pure (tensor metadata only, plus the device's SM version): they return the message of the first
problem or None, so a caller can ask "would flash4 take these?" and fall back. `check_inputs(...)`
and its varlen / kvcache siblings raise that same message as TypeError (wrong Python type or dtype)
or ValueError (everything else).

Every check is written once below and shared by the three doors; each door lists them in its
order: Python types, dtypes, ranks, shapes, head dim, strides/alignment, softmax_scale, causal,
window_size (window_problem), softcap (softcap_problem), learnable_sink (sink_problem: None or a
(nheads,) fp32/bf16/fp16 tensor on q's device), then device and SM version.
Metadata checks come before the device check, so every shape error is raised (and CPU-tested) for
CPU tensors too; an input that is only wrong by being on the CPU (empty or not) gets the device
error. The public functions also check window_size and softcap first of all (before tracing under
torch.compile), with the same messages.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

# served_page_rows(): page sizes must be multiples of it (1: gathered rows; 8 with FLASH4_SMALL_PAGES=0,
# flash4.config.paged_layout).
from flash4.config import SUPPORTED_HEADDIMS, hdimv_problem, select_fwd_config, served_page_rows
from flash4 import env
from flash4 import request as _request
from flash4.geometry import Band
from flash4.request import Request

# torch dtype -> the dtype name used in FwdConfig (flash4.request's; callers import it from here too).
DTYPE_NAMES = _request.DTYPE_NAMES
# The scale applied to QK^T: softmax_scale, or 1/sqrt(headdim) when None (flash4.request's).
resolve_softmax_scale = _request.resolve_softmax_scale

# TMA needs 16-byte aligned base addresses and strides (the compiled kernels assume it for every
# stride but the contiguous last one: compile/fake.py).
_ALIGN_BYTES = 16

# (exception type, message) of a problem, or None.
Problem = tuple[type, str] | None


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _raise(problem) -> None:
    if problem is not None:
        exc_type, message = problem
        raise exc_type(message)


def _contiguous(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


# ================================================================ checks passed before (host overhead)
# A serving loop calls a door with the same shapes, strides, dtypes and devices step after step: the
# builders (dense_request, varlen_request, kvcache_request) remember the signatures of argument lists
# that passed and skip the checks for them. A signature holds everything the checks read: per tensor
# its dtype, shape, strides, device and base address modulo 16 (TMA alignment); every other argument
# with its type (True and 1 differ); FLASH4_ARCH. Only CUDA tensors are remembered (the CPU tests
# monkeypatch the device checks), never the on-device value checks of check_seqlens (they always run).
_PASSED: set = set()
_MAX_PASSED = 4096
_REMEMBER_CPU = False  # tools/host_overhead.py --fake sets it (CPU tensors stand in for CUDA ones there)


def _signature(problem_fn, args) -> tuple | None:
    """The memo key of `args` for `problem_fn`, or None when they are not remembered (a tensor not
    on CUDA)."""
    parts = [problem_fn, env.arch_override(), env.family_override(), env.small_pages()]
    for a in args:
        if isinstance(a, torch.Tensor):
            if not (a.is_cuda or _REMEMBER_CPU):
                return None
            # the device as its CUDA index (an int: cheaper than a.device)
            parts.append((a.dtype, a.shape, a.stride(), a.get_device(), a.data_ptr() % _ALIGN_BYTES))
        else:
            parts.append((type(a), a))
    return tuple(parts)


def _checked(problem_fn, *args) -> None:
    """_raise(problem_fn(*args)), skipped for an argument signature that passed before."""
    key = _signature(problem_fn, args)
    if key is not None:
        try:
            if key in _PASSED:
                return
        except TypeError:  # an unhashable argument (a list window_size): not remembered
            key = None
    _raise(problem_fn(*args))
    if key is not None:
        if len(_PASSED) >= _MAX_PASSED:
            _PASSED.clear()
        _PASSED.add(key)


# ================================================================ the checks (each written once)
def _tensor_problem(name: str, t) -> Problem:
    if not isinstance(t, torch.Tensor):
        return TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}"
    return None


def _tensor_or_none_problem(name: str, t, what: str, required: bool = False) -> Problem:
    if t is None and not required:
        return None
    if not isinstance(t, torch.Tensor):
        return TypeError, f"{name} must be {what}, got {type(t).__name__}"
    return None


def _dtype_problem(q, others, together: str) -> Problem:
    """q bf16 / fp16, and every tensor of `others` ((name, tensor or None) pairs) of q's dtype;
    together: what the mismatch message says must share one dtype."""
    if q.dtype not in DTYPE_NAMES:
        return TypeError, (
            f"q.dtype is {q.dtype}; flash4 supports torch.bfloat16 and torch.float16 (convert with q.to(torch.bfloat16))"
        )
    for name, t in others:
        if t is not None and t.dtype != q.dtype:
            return TypeError, f"{name}.dtype is {t.dtype} but q.dtype is {q.dtype}; {together}"
    return None


def _int32_problem(name: str, t: torch.Tensor | None, layout: str) -> Problem:
    """dtype (TypeError) of an int32 metadata tensor; None passes."""
    if t is not None and t.dtype != torch.int32:
        return TypeError, (
            f"{name}.dtype is {t.dtype}; {name} {layout} must be torch.int32 (convert with {name}.to(torch.int32))"
        )
    return None


def _max_seqlen_type_problem(name: str, value) -> Problem:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            return TypeError, (
                f"{name} is a {value.dtype} tensor; it must be an integer (a Python int or an integer 0-d tensor)")
        if value.dim() != 0:
            return ValueError, f"{name} must be a 0-d tensor (or a Python int); got shape {_shape(value)}"
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return TypeError, f"{name} must be a Python int, a 0-d integer tensor or None; got {type(value).__name__}"
    if value < 0:
        return ValueError, f"{name} must be >= 0; got {value}"
    return None


def _headdim_rule_problem(headdim: int, headdim_v: int, axis: int) -> Problem:
    """flash4.headdim's rule for flash_attn_func / flash_attn_varlen_func: kernel head dims and pairs
    as they are, other multiples of 8 up to 256 zero-padded by the API; anything else a ValueError
    (the message the API raises)."""
    from flash4 import headdim as hd

    if hd.is_native(headdim, headdim_v):
        return None
    for name, value in (("q/k", headdim), ("v", headdim_v)):
        if not hd.servable(value):
            return ValueError, f"headdim {value} ({name}.shape[{axis}]) is not supported: {hd.RULE}"
    return None


def _heads_problem(q, k, v, v_rule: str, k_name: str = "k", v_name: str = "v", padded_ok: bool = False) -> Problem:
    """headdim equality, v shaped like k, nheads_k dividing nheads, supported headdim; the heads are
    dim -2 of q and of k in every layout. v_rule: the shape v must have, as the message says it.
    k_name / v_name: the arguments' names (k_cache / v_cache for flash_attn_with_kvcache).
    padded_ok: head dims flash4.headdim pads are fine (dense and packed varlen tensors; not a paged
    pool or a KV cache, which are never padded per call)."""
    qd, kd = q.dim() - 1, k.dim() - 1
    if k.shape[-1] != q.shape[-1]:
        return ValueError, (
            f"{k_name}.shape[{kd}] (headdim) is {k.shape[-1]} but q.shape[{qd}] is {q.shape[-1]}; q and {k_name} "
            f"need the same headdim (only {v_name}'s may differ); q.shape={_shape(q)}, {k_name}.shape={_shape(k)}"
        )
    if v.dim() != k.dim() or v.shape[:-1] != k.shape[:-1]:
        return ValueError, (
            f"{v_name} must have the shape of {k_name} {v_rule}; got {v_name}.shape={_shape(v)}, "
            f"{k_name}.shape={_shape(k)}")
    if padded_ok:
        problem = _headdim_rule_problem(q.shape[-1], v.shape[-1], qd)
        if problem is not None:
            return problem
    else:
        problem = hdimv_problem(q.shape[-1], v.shape[-1])
        if problem is not None:
            return ValueError, f"{problem}; q.shape={_shape(q)}, {v_name}.shape={_shape(v)}"
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads < 1 or nheads_k < 1:
        return ValueError, (
            f"nheads (q.shape[{qd - 1}]={nheads}) and nheads_k ({k_name}.shape[{kd - 1}]={nheads_k}) must be >= 1"
        )
    if nheads % nheads_k != 0:
        return ValueError, (
            f"nheads_k={nheads_k} ({k_name}.shape[{kd - 1}]) must divide nheads={nheads} (q.shape[{qd - 1}]) for "
            f"MQA/GQA; q.shape={_shape(q)}, {k_name}.shape={_shape(k)}"
        )
    headdim = q.shape[-1]
    if not padded_ok:
        served = _cache_headdims(q)
        if headdim not in served:
            from flash4 import env

            allowed = ", ".join(str(d) for d in served)
            switch = ("" if env.cache_headdim16() else
                      "; FLASH4_CACHE_HEADDIM16=0 is set: unset it to admit every kernel head dim of the GPU")
            return ValueError, (f"headdim {headdim} (q.shape[{qd}]) is not supported here; allowed: {allowed} (a KV "
                                f"cache or a paged pool is not zero-padded per call: allocate it with one of these head "
                                f"dims; flash_attn_func / flash_attn_varlen_func pad other multiples of 8, "
                                f"flash4.headdim{switch})")
    return None


def _cache_headdims(q) -> tuple:
    """flash4.headdim.cache_headdims for q's device: a CUDA device's SM version, FLASH4_ARCH for CPU
    tensors (the CPU tests; the device check refuses those later), SUPPORTED_HEADDIMS when unknown."""
    from flash4 import env
    from flash4.arch import device_arch  # late: keeps `import flash4.validate` free of device queries
    from flash4.headdim import cache_headdims

    if not env.cache_headdim16():
        return SUPPORTED_HEADDIMS
    try:
        arch = device_arch(q.device) if q.is_cuda else env.arch_override()
    except (RuntimeError, ValueError):
        arch = None
    return cache_headdims(arch)


def _page_size_problem(k: torch.Tensor, k_name: str = "k") -> Problem:
    page_size = k.shape[1]
    if page_size < 1:
        return ValueError, (
            f"page_size={page_size} ({k_name}.shape[1] of the paged cache {_shape(k)}) is not supported: a page "
            f"holds at least 1 row"
        )
    rows = served_page_rows()
    if page_size % rows:
        return ValueError, (
            f"page_size={page_size} ({k_name}.shape[1] of the paged cache {_shape(k)}) is not supported with "
            f"FLASH4_SMALL_PAGES=0: page sizes must be multiples of {rows}; unset FLASH4_SMALL_PAGES (or set it to 1) "
            f"to serve other page sizes on the gathered path"
        )
    return None


def _layouts_problem(named) -> Problem:
    """layout_problem of every (name, tensor or None) pair, as a ValueError."""
    for name, t in named:
        problem = layout_problem(name, t) if t is not None else None
        if problem is not None:
            return ValueError, problem
    return None


def layout_problem(name: str, t: torch.Tensor) -> str | None:
    """Stride/alignment problem of one input, or None. Empty tensors are not checked (never read)."""
    if t.numel() == 0:
        return None
    if t.stride(-1) != 1:
        return (
            f"{name} has stride(-1)={t.stride(-1)} (shape {_shape(t)}, strides {t.stride()}); the last dim must be "
            f"contiguous: pass {name}.contiguous()"
        )
    elt = t.element_size()
    if t.data_ptr() % _ALIGN_BYTES != 0:
        return (
            f"{name}.data_ptr() is not {_ALIGN_BYTES}-byte aligned (offset {t.data_ptr() % _ALIGN_BYTES} bytes, "
            f"e.g. a slice inside the last dim); pass {name}.contiguous()"
        )
    for dim in range(t.dim() - 1):
        # every stride, also of size-1 dims: the compiled kernel assumes all of them divisible
        if (t.stride(dim) * elt) % _ALIGN_BYTES != 0:
            return (
                f"{name}.stride({dim})={t.stride(dim)} elements is not a multiple of {_ALIGN_BYTES // elt} "
                f"({_ALIGN_BYTES} bytes; strides {t.stride()}); pass {name}.contiguous()"
            )
        if t.stride(dim) == 0 and t.shape[dim] > 1:
            hint = " (for MQA/GQA pass k/v with nheads_k heads instead of expanding them)" if dim == 2 else ""
            return (
                f"{name} is expanded along dim {dim} (stride 0, shape {_shape(t)}); TMA loads need real strides: "
                f"pass {name}.contiguous(){hint}"
            )
    return None



def _scale_causal_problem(softmax_scale, causal, window_size=(-1, -1), softcap=0.0) -> tuple[type, str] | None:
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            return TypeError, f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            # The kernel takes the row max of the raw scores and scales afterwards, which is
            # only the max of the scaled scores for a positive scale.
            return ValueError, f"softmax_scale must be finite and > 0 (or None for 1/sqrt(headdim)); got {softmax_scale}"
    if not isinstance(causal, bool):
        return TypeError, f"causal must be a bool, got {type(causal).__name__}"
    problem = window_problem(window_size)
    if problem is not None:
        return problem
    return softcap_problem(softcap)


def softcap_problem(softcap) -> tuple[type, str] | None:
    """(exception type, message) when softcap is not a finite real number >= 0 (0 = off), or None.
    TypeError for a non-real (bool included); ValueError for NaN, an infinity or a negative value."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        return TypeError, f"softcap must be a float (>= 0; 0 = no soft-capping), got {type(softcap).__name__}"
    if not (0 <= softcap < math.inf):  # NaN compares False (plain comparisons: traceable by torch.compile)
        return ValueError, f"softcap must be finite and >= 0 (0 = no soft-capping); got softcap={softcap}"
    return None


def check_softcap(softcap) -> float:
    """softcap as a Python float; raises softcap_problem's TypeError / ValueError."""
    problem = softcap_problem(softcap)
    if problem is not None:
        exc_type, message = problem
        raise exc_type(message)
    return float(softcap)


SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sink_problem(learnable_sink, q, nheads: int) -> tuple[type, str] | None:
    """(exception type, message) when learnable_sink (attention sinks, gpt-oss) is neither None nor a
    (nheads,) float32 / bfloat16 / float16 tensor on q's device, or None. nheads: q's head count."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor):
        return TypeError, (f"learnable_sink must be None or a torch.Tensor of shape (nheads,), got "
                           f"{type(learnable_sink).__name__}")
    if learnable_sink.dtype not in SINK_DTYPES:
        return TypeError, (f"learnable_sink must be torch.float32, torch.bfloat16 or torch.float16; got "
                           f"{learnable_sink.dtype}")
    if tuple(learnable_sink.shape) != (nheads,):
        return ValueError, (f"learnable_sink must have shape (nheads,) = ({nheads},) (one sink logit per query "
                            f"head); got shape {tuple(learnable_sink.shape)}")
    if learnable_sink.device != q.device:
        return ValueError, f"learnable_sink is on {learnable_sink.device} but q is on {q.device}; it must be on q's device"
    return None


def window_problem(window_size) -> tuple[type, str] | None:
    """(exception type, message) when window_size is not flash-attn's (left, right) sliding window,
    or None: a tuple or list of two Python ints (not bool), each >= -1 (-1: unbounded on that side).
    TypeError for the container, its length or an element's type; ValueError for a side below -1."""
    if isinstance(window_size, Band):
        return band_problem(window_size)
    allowed = "a tuple (left, right) of two ints, each >= 0, or -1 for unbounded on that side ((-1, -1): no window)"
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        what = (f"{type(window_size).__name__} of length {len(window_size)}" if isinstance(window_size, (tuple, list))
                else f"type {type(window_size).__name__}")
        return TypeError, f"window_size must be {allowed}; got window_size={window_size!r} ({what})"
    for side, value in zip(("left", "right"), window_size):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return TypeError, (f"window_size must be {allowed}; got window_size={window_size!r} (its {side} side is a "
                               f"{type(value).__name__})")
    for side, value in zip(("left", "right"), window_size):
        if value < -1:
            return ValueError, (f"window_size must be {allowed}; got window_size={window_size!r} ({side} side {value} "
                                f"< -1)")
    return None


def band_problem(window) -> tuple[type, str] | None:
    """(exception type, message) when a literal window (a flash4.geometry.Band, flash-attn-4's
    convention) has a side that is neither None (unbounded) nor a Python int (not bool), or None.
    Any int is allowed: a negative side is a band that excludes the diagonal."""
    for side, value in zip(("left", "right"), window):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            return TypeError, (f"window_size must be (left, right), each None (unbounded) or an int; got "
                               f"window_size=({window.left!r}, {window.right!r}) (its {side} side is a "
                               f"{type(value).__name__})")
    return None


def check_window_size(window_size):
    """window_size as a (left, right) tuple of Python ints (flash-attn 2/3's spelling), or a
    flash4.geometry.Band with Python-int / None sides (the literal spelling flash4.fa4 passes);
    raises window_problem's TypeError / ValueError."""
    problem = window_problem(window_size)
    if problem is not None:
        exc_type, message = problem
        raise exc_type(message)
    if isinstance(window_size, Band):
        return Band(*(None if side is None else int(side) for side in window_size))
    return int(window_size[0]), int(window_size[1])



def cuda_problem(name: str, t: torch.Tensor) -> Problem:
    """t is not on a CUDA device: the message says how to move it, or that there is no CUDA device."""
    if t.device.type == "cuda":
        return None
    if torch.cuda.is_available():
        return ValueError, f"{name} is on {t.device}; flash4 runs on CUDA tensors only (move it with {name}.cuda())"
    return ValueError, (f"{name} is on {t.device}; flash4 runs on CUDA tensors only, and no CUDA device is available "
                        f"here (torch.cuda.is_available() is False)")


def _device_problem(q, others, dense: bool = False) -> Problem:
    """Every tensor of `others` ((name, tensor or None) pairs) on q's device, and q on CUDA.
    Varlen / kvcache: the relative check first (CPU-testable with meta tensors), then q's device.
    Dense (flash_attn_func): q, k, v each on CUDA first, then on one device (its order and words)."""
    if dense:
        for name, t in [("q", q)] + list(others):
            problem = cuda_problem(name, t)
            if problem is not None:
                return problem
        for name, t in others:
            if t.device != q.device:
                return ValueError, f"{name} is on {t.device} but q is on {q.device}; q, k and v must be on one device"
        return None
    for name, t in others:
        if t is not None and t.device != q.device:
            return ValueError, f"{name} is on {t.device} but q is on {q.device}; pass {name}.to(q.device)"
    return cuda_problem("q", q)


def _arch_problem(q, causal, door=None) -> Problem:
    """The SM version of q's (CUDA) device has no forward kernel for q's head dim and dtype; for a
    self-test-gated family (sm_100; the portable sm80 family on sm_80 / 86 / 89 / 120:
    flash4.kernels.registry.gate_family) also `_gated_problem` of the door's
    arguments (door: a _Door, or None to check the head dim and dtype only)."""
    from flash4.arch import device_arch  # late: keeps `import flash4.validate` free of device queries

    arch = device_arch(q.device)
    try:
        cfg = select_fwd_config(q.shape[-1], DTYPE_NAMES[q.dtype], causal, arch=arch)
    except ValueError as err:
        # a head dim built only with its own V head dim (sm100's 192: (192, 128)) asks with the door's
        headdim_v = door.v.shape[-1] if door is not None else q.shape[-1]
        if headdim_v == q.shape[-1]:
            return ValueError, f"{err} (q is on {q.device})"
        try:
            cfg = select_fwd_config(q.shape[-1], DTYPE_NAMES[q.dtype], causal, arch=arch, headdim_v=headdim_v)
        except ValueError as err_v:
            return ValueError, f"{err_v} (q is on {q.device})"
    from flash4 import selftest  # late: the gate pulls in its child-process machinery

    if door is None or not selftest.gated(cfg):
        return None
    return _gated_problem(q, causal, door, arch)


class _Door:
    """What `_gated_problem` reads of a door's arguments: layout ("dense", "varlen", "paged",
    "kvcache"), k and v (or k_cache / v_cache), window_size, softcap, learnable_sink, the varlen
    door's seqused_q / seqused_k (None elsewhere), and paged (a page table was given)."""

    __slots__ = ("layout", "k", "v", "window_size", "softcap", "learnable_sink", "seqused_q", "seqused_k", "paged")

    def __init__(self, layout, k, v, window_size, softcap, learnable_sink, seqused_q=None, seqused_k=None,
                 paged=False):
        self.layout, self.k, self.v = layout, k, v
        self.window_size, self.softcap, self.learnable_sink = window_size, softcap, learnable_sink
        self.seqused_q, self.seqused_k, self.paged = seqused_q, seqused_k, paged or layout == "paged"


# How _gated_problem names a door's layouts ("dense and packed varlen batches").
_LAYOUT_WORDS = {"dense": "dense", "varlen": "packed varlen", "paged": "paged", "kvcache": "KV-cache"}


def _layouts_text(layouts) -> str:
    words = [_LAYOUT_WORDS[name] for name in layouts]
    return (" and ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " and " + words[-1]) + " batches"


def _gated_problem(q, causal, door: _Door, arch: int) -> Problem:
    """A family served behind the first-use self-test (sm_100; the portable sm80 family on its own
    GPUs): the config the forward would select for these arguments exists (layouts, window,
    softcap, sink, headdim_v: ValueError naming what that family lacks), a backward config exists
    when autograd will ask for one (NotImplementedError naming what the family's backward lacks:
    on sm_100 e.g. softcap at (192, 128)), and flash4.selftest passed those
    configs (forward, and backward when training) on q's device (RuntimeError with the self-test's
    text: the config, the failing check, how to report it; on the first call for a config this runs
    the self-test, seconds, in a child process).

    What each family serves at this door is its config module's GATE_DOOR (flash4.config.sm100,
    flash4.config.sm80): fwd_layouts / bwd_layouts (the door layouts its forward / backward run),
    seqused_k and paged (the forward takes them, paged as select_fwd_config(paged=True); paged_text:
    how the family refuses paged K/V), and
    optionally its gate_fwd_options(layout)
    (extra select_fwd_config arguments: sm100's 2-CTA switch)."""
    from flash4 import selftest
    from flash4.geometry import canonical_mask, window_sides
    from flash4.kernels import registry

    fam = registry.gate_family(arch)
    module = fam.config_module()
    door_spec = module.GATE_DOOR
    where = f"(q is on {q.device}, sm_{arch}: flash4's {fam.name} kernels, compile-verified, not yet run on that GPU)"
    if door.paged and not door_spec["paged"] and "paged_text" in door_spec:  # the family's own words for it
        return ValueError, f"{door_spec['paged_text']} (sm_{arch}) {where}"
    if door.layout not in door_spec["fwd_layouts"]:
        return ValueError, (f"flash4's sm_{arch} forward runs {_layouts_text(door_spec['fwd_layouts'])} only; "
                            f"the {door.layout} layout is not implemented there yet {where}")
    if door.paged and not door_spec["paged"]:
        return ValueError, f"flash4's sm_{arch} forward has no paged K/V yet (a page table was given) {where}"
    if door.seqused_k is not None and not door_spec["seqused_k"]:
        return ValueError, f"flash4's sm_{arch} forward has no seqused_k yet (packed varlen with cu_seqlens_k) {where}"
    headdim, headdim_v = q.shape[-1], door.v.shape[-1]
    causal, window_size = canonical_mask(causal, door.window_size)  # as the API runs it: (-1, 0) is causal
    options = module.gate_fwd_options(door.layout) if hasattr(module, "gate_fwd_options") else {}
    try:
        cfg = module.select_fwd_config(headdim, DTYPE_NAMES[q.dtype], causal, arch=arch,
                                       local=window_sides(window_size, causal) is not None,
                                       softcap=door.softcap > 0, sink=door.learnable_sink is not None,
                                       headdim_v=None if headdim_v == headdim else headdim_v,
                                       seqlen_k=door.k.shape[1] if door.layout == "dense" else None, **options,
                                       **({"paged": True} if door.paged else {}))
    except ValueError as err:
        return ValueError, f"{err} {where}"
    seqused_k = {"seqused_k": True} if door.seqused_k is not None else {}
    try:  # the config refuses a layout its kernel lacks (e.g. sm100's 2-CTA: dense only)
        if door.layout in ("varlen", "paged"):  # as the family's fwd_plan lays it out (paged: no cu_seqlens_k)
            cfg = dataclasses.replace(cfg, varlen_q=True, varlen_k=door.layout == "varlen",
                                      seqused_q=door.seqused_q is not None, **seqused_k)
        elif door.layout == "kvcache":  # a decode step over the cache: seqused_k keys per cache row
            cfg = dataclasses.replace(cfg, seqused_k=True)
    except ValueError as err:
        return ValueError, f"{err} {where}"
    training = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, door.k, door.v, door.learnable_sink))
    bwd_cfg = None
    if training:
        hint = ("an input requires grad: run the forward under torch.no_grad() / torch.inference_mode(), or use "
                f"another attention implementation for training {where}")
        if not fam.has_pass("bwd"):
            return NotImplementedError, (f"flash4 has no backward on sm_{arch} yet (its {fam.name} family has a "
                                         f"forward only), and {hint}")
        if door.layout not in door_spec["bwd_layouts"]:
            return NotImplementedError, (f"flash4's sm_{arch} backward runs {_layouts_text(door_spec['bwd_layouts'])} "
                                         f"only (no {door.layout} layout yet), and {hint}")
        packed = {} if door.layout == "dense" else dict(  # as the family's bwd_plan lays packed batches out
            varlen_q=True, varlen_k=True, seqused_q=door.seqused_q is not None, seqused_k=door.seqused_k is not None)
        try:  # the backward config autograd will ask for (flash4.config.<family>.bwd_plan's selection)
            bwd_cfg = module.select_bwd_config(
                headdim, DTYPE_NAMES[q.dtype], causal, arch=arch, local=window_sides(window_size, causal) is not None,
                softcap=door.softcap > 0, headdim_v=None if headdim_v == headdim else headdim_v, **packed,
                # the sm100 2-CTA opt-in, as flash4.config.sm100.bwd_plan asks it (dense batches)
                **({"two_cta": True} if arch == 100 and door.layout == "dense" and env.sm100_2cta() else {}))
        except ValueError as err:
            return NotImplementedError, f"flash4 has no backward for this call on sm_{arch}: {err}; {hint}"
    problem = selftest.support_problem(cfg, q.device)
    if problem is None and bwd_cfg is not None:
        problem = selftest.support_problem(bwd_cfg, q.device)  # the backward runs behind its own self-test
    return None if problem is None else (RuntimeError, problem)


def _common_tail_problem(q, softmax_scale, causal, window_size, softcap, learnable_sink, devices,
                         dense: bool = False, layout: str = "dense") -> Problem:
    """The checks every door ends with: scale, causal, window, softcap, sink, devices, SM version
    (and, on a self-test-gated GPU, _gated_problem for the door's layout)."""
    for problem in (_scale_causal_problem(softmax_scale, causal, window_size, softcap),
                    sink_problem(learnable_sink, q, q.shape[-2]), _device_problem(q, devices, dense)):
        if problem is not None:
            return problem
    named = dict(devices)
    k, v = (named["k"], named["v"]) if layout != "kvcache" else (named["k_cache"], named["v_cache"])
    return _arch_problem(q, causal, _Door(layout, k, v, window_size, softcap, learnable_sink,
                                          named.get("seqused_q"), named.get("seqused_k"),
                                          named.get("page_table") is not None))


# ================================================================ flash_attn_func (dense)
_DENSE_LAYOUTS = {"q": "(batch, seqlen_q, nheads, headdim)", "k": "(batch, seqlen_k, nheads_k, headdim)",
                  "v": "(batch, seqlen_k, nheads_k, headdim)"}


def _problem(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
             softcap=0.0, learnable_sink=None) -> Problem:
    """(exception type, message) of the first problem with flash_attn_func's arguments, or None."""
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        problem = _tensor_problem(name, t)
        if problem is not None:
            return problem
    problem = _dtype_problem(q, named[1:], "q, k and v must share one dtype")
    if problem is not None:
        return problem
    for name, t in named:
        if t.dim() != 4:
            return ValueError, f"{name} must be 4-D {_DENSE_LAYOUTS[name]}; got shape {_shape(t)}"
    if k.shape[0] != q.shape[0]:
        return ValueError, (
            f"k.shape[0] (batch) is {k.shape[0]} but q.shape[0] is {q.shape[0]}; q, k and v need the same batch; "
            f"q.shape={_shape(q)}, k.shape={_shape(k)}"
        )
    for problem in (_heads_problem(q, k, v, "(batch, seqlen_k, nheads_k, headdim; only its headdim may differ)",
                                   padded_ok=True), _layouts_problem(named)):
        if problem is not None:
            return problem
    return _common_tail_problem(q, softmax_scale, causal, window_size, softcap, learnable_sink, named[1:], dense=True)


def support_error(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  learnable_sink=None) -> str | None:
    """Why flash4 cannot run these arguments, or None when it can.

    Arguments as in `flash4.flash_attn_func`. Never raises for bad arguments (only the device
    query of a CUDA tensor can raise, as torch.cuda does).
    """
    problem = _problem(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink)
    return None if problem is None else problem[1]


def check_inputs(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 learnable_sink=None) -> None:
    """Raise TypeError (non-tensor, dtype, mixed dtypes, softmax_scale/causal/window_size type) or
    ValueError (rank, batch/head/headdim mismatch, nheads_k not dividing nheads, unsupported headdim,
    non-contiguous last dim or misaligned stride, bad softmax_scale, a window side below -1, softcap
    not finite and >= 0, non-CUDA or mixed devices, unsupported SM version) with the message of
    `support_error`. softcap: a real number (TypeError otherwise, bool included)."""
    _raise(_problem(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink))


def dense_request(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, learnable_sink=None,
                  deterministic=False) -> Request:
    """flash_attn_func's checked request (check_inputs' errors; layout DENSE)."""
    _checked(_problem, q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink)
    return Request.dense(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, deterministic)


# ================================================================ flash_attn_varlen_func (varlen / paged)
_VARLEN_LAYOUTS = {
    "q": "(total_q, nheads, headdim)",
    "k": "(total_k, nheads_k, headdim)",
    "v": "(total_k, nheads_k, headdim)",
    "paged k": "(num_pages, page_size, nheads_k, headdim)",
    "paged v": "(num_pages, page_size, nheads_k, headdim)",
}


def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                    seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, learnable_sink=None) -> Problem:
    """(exception type, message) of the first problem with varlen / paged arguments, or None.
    Order as `_problem`: Python types, dtypes, ranks, shapes, head dims, strides, scale, causal,
    devices (other tensors on q's device first, then CUDA), SM version."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        problem = _tensor_problem(name, t)
        if problem is not None:
            return problem
    metadata = (
        ("cu_seqlens_q", cu_seqlens_q, "an int32 torch.Tensor of shape (batch + 1,)", True),
        ("cu_seqlens_k", cu_seqlens_k, "an int32 torch.Tensor of shape (batch + 1,) or None", False),
        ("seqused_q", seqused_q, "an int32 torch.Tensor of shape (batch,) or None", False),
        ("seqused_k", seqused_k, "an int32 torch.Tensor of shape (batch,) or None", False),
        ("page_table", page_table, "an int32 torch.Tensor of shape (batch, max_pages_per_seq) or None", False),
    )
    for name, t, what, required in metadata:
        problem = _tensor_or_none_problem(name, t, what, required)
        if problem is not None:
            return problem
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        problem = _max_seqlen_type_problem(name, value)
        if problem is not None:
            return problem

    problem = _dtype_problem(q, (("k", k), ("v", v)), "q, k and v must share one dtype")
    if problem is not None:
        return problem
    layouts = {"cu_seqlens_q": "(batch + 1,)", "cu_seqlens_k": "(batch + 1,)", "seqused_q": "(batch,)",
               "seqused_k": "(batch,)", "page_table": "(batch, max_pages_per_seq)"}
    for name, t, _, _ in metadata:
        problem = _int32_problem(name, t, layouts[name])
        if problem is not None:
            return problem

    paged = page_table is not None
    if q.dim() != 3:
        return ValueError, f"q must be 3-D {_VARLEN_LAYOUTS['q']} (packed sequences); got shape {_shape(q)}"
    for name, t in (("k", k), ("v", v)):
        if paged and t.dim() != 4:
            return ValueError, (
                f"{name} must be 4-D {_VARLEN_LAYOUTS['paged ' + name]} when page_table is given (paged K/V); "
                f"got shape {_shape(t)}"
            )
        if not paged and t.dim() != 3:
            hint = " (a 4-D paged cache needs page_table and seqused_k)" if t.dim() == 4 else ""
            return ValueError, f"{name} must be 3-D {_VARLEN_LAYOUTS[name]}{hint}; got shape {_shape(t)}"
    ranks = {"cu_seqlens_q": 1, "cu_seqlens_k": 1, "seqused_q": 1, "seqused_k": 1, "page_table": 2}
    for name, t, _, _ in metadata:
        if t is not None and t.dim() != ranks[name]:
            return ValueError, f"{name} must be {ranks[name]}-D {layouts[name]}; got shape {_shape(t)}"

    if cu_seqlens_q.numel() < 1:
        return ValueError, "cu_seqlens_q must have batch + 1 >= 1 entries (prefix sums starting at 0); got 0 entries"
    batch = cu_seqlens_q.numel() - 1
    if paged:
        if cu_seqlens_k is not None:
            return ValueError, (
                "cu_seqlens_k must be None when page_table is given: the keys of sequence b are "
                "k[page_table[b, j // page_size], j % page_size] for j < seqused_k[b]"
            )
        if seqused_k is None:
            return ValueError, "seqused_k (batch,) int32 is required with page_table: it gives each sequence's key count"
    elif cu_seqlens_k is None:
        return ValueError, "cu_seqlens_k is None; it is required unless K/V are paged (page_table and seqused_k given)"
    if cu_seqlens_k is not None and cu_seqlens_k.numel() != batch + 1:
        return ValueError, (
            f"cu_seqlens_k has {cu_seqlens_k.numel()} entries but cu_seqlens_q has {batch + 1}; both are (batch + 1,) "
            f"prefix sums over the same batch"
        )
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None and t.shape[0] != batch:
            return ValueError, (
                f"{name} must have shape (batch,) = ({batch},) (batch = cu_seqlens_q.numel() - 1); got {_shape(t)}"
            )
    if paged and page_table.shape[0] != batch:
        return ValueError, (
            f"page_table must have shape (batch, max_pages_per_seq) with batch = {batch} (cu_seqlens_q.numel() - 1); "
            f"got {_shape(page_table)}"
        )
    k_desc = _VARLEN_LAYOUTS["paged k" if paged else "k"]
    for problem in (_heads_problem(q, k, v, f"{k_desc} (only its headdim may differ)", padded_ok=not paged),
                    _page_size_problem(k) if paged else None, _layouts_problem((("q", q), ("k", k), ("v", v)))):
        if problem is not None:
            return problem
    devices = [("k", k), ("v", v)] + [(name, t) for name, t, _, _ in metadata]
    return _common_tail_problem(q, softmax_scale, causal, window_size, softcap, learnable_sink, devices,
                                layout="paged" if paged else "varlen")


def varlen_support_error(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                         seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, learnable_sink=None) -> str | None:
    """Why flash4 cannot run these varlen / paged arguments (as flash4.flash_attn_varlen_func takes
    them), or None when it can. Metadata only: the values inside cu_seqlens / seqused / page_table
    are not read (check_varlen_seqlens does that, at the cost of a host sync)."""
    problem = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                              page_table, softmax_scale, causal, window_size, softcap, learnable_sink)
    return None if problem is None else problem[1]


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                        seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, learnable_sink=None) -> None:
    """Raise the message of `varlen_support_error` as TypeError (a non-tensor where a tensor is
    needed, q/k/v dtype, a metadata tensor not int32, a max_seqlen or window_size of the wrong type)
    or ValueError (ranks, batch mismatches, a missing or extra cu_seqlens_k / seqused_k, head rules,
    page size, strides, softmax_scale, a window side below -1, softcap not finite and >= 0 (TypeError
    when not a real number), devices, SM version)."""
    _raise(_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                           page_table, softmax_scale, causal, window_size, softcap, learnable_sink))


def varlen_request(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                   seqused_k=None, page_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                   softcap=0.0, learnable_sink=None, deterministic=False, check_seqlens=False) -> Request:
    """flash_attn_varlen_func's checked request (layout VARLEN, or PAGED with page_table):
    check_varlen_inputs' errors, the metadata made contiguous, with check_seqlens the on-device
    value checks (check_varlen_seqlens, one host sync), max_seqlen_q resolved to a host int
    (resolve_max_seqlen: a host sync for a CUDA tensor or None). max_seqlen_k stays as given."""
    _checked(_varlen_problem, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
             page_table, softmax_scale, causal, window_size, softcap, learnable_sink)
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table = (
        _contiguous(t) for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table))
    paged = page_table is not None
    if check_seqlens:
        check_varlen_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], seqused_q=seqused_q,
                             seqused_k=seqused_k, page_table=page_table, num_pages=k.shape[0] if paged else 0,
                             page_size=k.shape[1] if paged else 0, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    max_q = resolve_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, seqused_q)
    return Request.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_seqlen_k, seqused_q, seqused_k, page_table,
                          softmax_scale, causal, window_size, softcap, learnable_sink, deterministic, check_seqlens)


# ================================================================ flash_attn_with_kvcache
_KVCACHE_LAYOUTS = {
    "q": "(batch, seqlen_q, nheads, headdim)",
    "k_cache": "(batch_cache, seqlen_cache, nheads_k, headdim)",
    "paged k_cache": "(num_pages, page_size, nheads_k, headdim)",
    "k": "(batch, seqlen_new, nheads_k, headdim)",
}


def packed_rows_per_batch(cache: torch.Tensor) -> int | None:
    """Rows between consecutive batch entries of a dense cache (batch_cache, seqlen_cache, nheads_k,
    headdim) seen as packed rows of stride cache.stride(1): stride(0) / stride(1), or None when the
    batch stride is not a whole number of rows (or smaller than seqlen_cache rows)."""
    row = cache.stride(1)
    if cache.shape[0] <= 1:
        return cache.shape[1]
    if row <= 0 or cache.stride(0) % row != 0 or cache.stride(0) // row < cache.shape[1]:
        return None
    return cache.stride(0) // row


def _kvcache_problem(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None, cache_batch_idx=None,
                     softmax_scale=None, causal=False, num_splits=0, out=None,
                     window_size=(-1, -1), softcap=0.0, learnable_sink=None) -> Problem:
    """(exception type, message) of the first problem with flash_attn_with_kvcache's arguments."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        problem = _tensor_problem(name, t)
        if problem is not None:
            return problem
    optional = (("k", k, "a torch.Tensor or None"), ("v", v, "a torch.Tensor or None"),
                ("page_table", page_table, "an int32 torch.Tensor of shape (batch, max_pages_per_seq) or None"),
                ("cache_batch_idx", cache_batch_idx, "an int32 torch.Tensor of shape (batch,) or None"),
                ("out", out, "a torch.Tensor or None"))
    for name, t, what in optional:
        problem = _tensor_or_none_problem(name, t, what)
        if problem is not None:
            return problem
    seqlens_tensor = isinstance(cache_seqlens, torch.Tensor)
    if cache_seqlens is not None and not seqlens_tensor and (
            isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral)):
        return TypeError, (
            f"cache_seqlens must be a Python int, an int32 torch.Tensor of shape (batch,) or None; "
            f"got {type(cache_seqlens).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        return TypeError, f"num_splits must be an int (0 = auto, 1 = no split), got {type(num_splits).__name__}"

    problem = _dtype_problem(q, (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("out", out)),
                             "q, the caches, k, v and out share one dtype")
    if problem is not None:
        return problem
    int_layouts = (("cache_seqlens", cache_seqlens if seqlens_tensor else None, "(batch,)", 1),
                   ("page_table", page_table, "(batch, max_pages_per_seq)", 2),
                   ("cache_batch_idx", cache_batch_idx, "(batch,)", 1))
    for name, t, layout, _ in int_layouts:
        problem = _int32_problem(name, t, layout)
        if problem is not None:
            return problem

    paged = page_table is not None
    cache_layout = _KVCACHE_LAYOUTS["paged k_cache" if paged else "k_cache"]
    ranked = (("q", q, _KVCACHE_LAYOUTS["q"]), ("k_cache", k_cache, cache_layout), ("v_cache", v_cache, cache_layout),
              ("k", k, _KVCACHE_LAYOUTS["k"]), ("v", v, _KVCACHE_LAYOUTS["k"]), ("out", out, _KVCACHE_LAYOUTS["q"]))
    for name, t, layout in ranked:
        if t is not None and t.dim() != 4:
            return ValueError, f"{name} must be 4-D {layout}; got shape {_shape(t)}"
    for name, t, layout, rank in int_layouts:
        if t is not None and t.dim() != rank:
            return ValueError, f"{name} must be {rank}-D {layout}; got shape {_shape(t)}"

    batch, seqlen_q = q.shape[0], q.shape[1]
    for problem in (_heads_problem(q, k_cache, v_cache, f"{cache_layout} (only its headdim may differ)", "k_cache",
                                   "v_cache"), _page_size_problem(k_cache, "k_cache") if paged else None):
        if problem is not None:
            return problem
    if (k is None) != (v is None):
        return ValueError, "k and v (the new keys and values to append) must be given together or both be None"
    seqlen_new = 0
    if k is not None:
        expected = (batch, k.shape[1], k_cache.shape[2], k_cache.shape[3])
        expected_v = expected[:3] + (v_cache.shape[3],)
        if _shape(k) != expected or _shape(v) != expected_v:
            what = (f"k and v must be {_KVCACHE_LAYOUTS['k']} = {expected}" if expected == expected_v else
                    f"k and v must be {_KVCACHE_LAYOUTS['k']} = {expected} and {expected_v}")
            return ValueError, (
                f"{what} (batch of q, nheads_k and headdim of k_cache / v_cache); "
                f"got k.shape={_shape(k)}, v.shape={_shape(v)}")
        seqlen_new = k.shape[1]
    if seqlens_tensor and _shape(cache_seqlens) != (batch,):
        return ValueError, f"cache_seqlens must have shape (batch,) = ({batch},); got {_shape(cache_seqlens)}"
    if not seqlens_tensor and cache_seqlens is not None and cache_seqlens < 0:
        return ValueError, f"cache_seqlens must be >= 0; got {cache_seqlens}"
    if paged:
        if page_table.shape[0] != batch:
            return ValueError, (
                f"page_table must have shape (batch, max_pages_per_seq) with batch = {batch} (q.shape[0]); "
                f"got {_shape(page_table)}")
        if cache_batch_idx is not None:
            return ValueError, (
                "cache_batch_idx is not supported with page_table (a paged cache is indexed through page_table: "
                "pass page_table[cache_batch_idx] instead)")
        capacity, capacity_desc = page_table.shape[1] * k_cache.shape[1], "page_table.shape[1] * page_size"
    else:
        if cache_batch_idx is not None:
            if _shape(cache_batch_idx) != (batch,):
                return ValueError, (
                    f"cache_batch_idx must have shape (batch,) = ({batch},); got {_shape(cache_batch_idx)}")
        elif k_cache.shape[0] != batch:
            return ValueError, (
                f"k_cache.shape[0] (batch_cache) is {k_cache.shape[0]} but q.shape[0] (batch) is {batch}; without "
                f"cache_batch_idx the cache holds one row per sequence")
        capacity, capacity_desc = k_cache.shape[1], "seqlen_cache = k_cache.shape[1]"
    if seqlen_new > 0:
        if cache_seqlens is None:
            return ValueError, "appending k/v needs cache_seqlens (where each sequence's new keys go); got None"
        if seqlen_new > capacity:
            return ValueError, (
                f"the cache is too small for the appended k/v: seqlen_new={seqlen_new} (k.shape[1]) > {capacity_desc} "
                f"= {capacity}")
        if not seqlens_tensor and cache_seqlens + seqlen_new > capacity:
            return ValueError, (
                f"the cache is too small for the appended k/v: cache_seqlens + seqlen_new = {cache_seqlens} + "
                f"{seqlen_new} > {capacity_desc} = {capacity}")
    elif not seqlens_tensor and cache_seqlens is not None and cache_seqlens > capacity:
        return ValueError, f"cache_seqlens={cache_seqlens} is above the cache's {capacity_desc} = {capacity}"
    out_shape = _shape(q)[:3] + (v_cache.shape[3],)
    if out is not None and _shape(out) != out_shape:
        with_v = "" if out_shape == _shape(q) else " with v_cache's headdim"
        return ValueError, (f"out must have the shape of q{with_v} {_KVCACHE_LAYOUTS['q']} = {out_shape}; got "
                            f"{_shape(out)}")
    if num_splits < 0:
        return ValueError, f"num_splits must be >= 0 (0 = auto, 1 = no split); got {num_splits}"
    if num_splits > 1 and cache_batch_idx is not None:
        return ValueError, (
            f"num_splits={num_splits}: splitting the keys is not supported with cache_batch_idx; pass 0 or 1 (or "
            f"index the cache rows yourself)")

    problem = _layouts_problem((("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)))
    if problem is not None:
        return problem
    if cache_batch_idx is not None and k_cache.numel() > 0:  # read as packed rows (flash4.forward's cache rows)
        rows = [packed_rows_per_batch(c) for c in (k_cache, v_cache)]
        if rows[0] is None or rows[0] != rows[1]:
            return ValueError, (
                f"k_cache / v_cache strides {k_cache.stride()} / {v_cache.stride()}: with cache_batch_idx flash4 reads "
                f"a dense cache as rows of stride stride(1), so stride(0) must be the same whole number "
                f"(>= seqlen_cache) of rows in both; pass k_cache.contiguous() / v_cache.contiguous() (and write the "
                f"cache back)")
    if out is not None and batch > 1 and seqlen_q > 1 and out.numel() > 0 and out.stride(0) != seqlen_q * out.stride(1):
        return ValueError, (
            f"out strides {out.stride()}: flash4 writes out as packed (batch * seqlen_q, nheads, headdim) rows, so "
            f"out.stride(0) must be seqlen_q * out.stride(1); pass a contiguous out")
    devices = [("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("out", out),
               ("page_table", page_table), ("cache_batch_idx", cache_batch_idx),
               ("cache_seqlens", cache_seqlens if seqlens_tensor else None)]
    return _common_tail_problem(q, softmax_scale, causal, window_size, softcap, learnable_sink, devices,
                                layout="kvcache")


def kvcache_support_error(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
                          cache_batch_idx=None, softmax_scale=None, causal=False, num_splits=0, out=None,
                          window_size=(-1, -1), softcap=0.0, learnable_sink=None) -> str | None:
    """Why flash4.flash_attn_with_kvcache cannot take these arguments, or None. Metadata only."""
    problem = _kvcache_problem(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale,
                               causal, num_splits, out, window_size, softcap, learnable_sink)
    return None if problem is None else problem[1]


def check_kvcache_inputs(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
                         cache_batch_idx=None, softmax_scale=None, causal=False, num_splits=0, out=None,
                         window_size=(-1, -1), softcap=0.0, learnable_sink=None) -> None:
    """Raise the message of `kvcache_support_error` as TypeError (non-tensors, dtypes, int32
    metadata, cache_seqlens / num_splits / window_size types) or ValueError (everything else, e.g. a
    cache too small for the appended k/v, num_splits > 1 with cache_batch_idx, a window side below
    -1, softcap not finite and >= 0; a softcap that is not a real number is a TypeError)."""
    _raise(_kvcache_problem(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale,
                            causal, num_splits, out, window_size, softcap, learnable_sink))


def kvcache_request(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None, cache_batch_idx=None,
                    softmax_scale=None, causal=False, num_splits=0, out=None, window_size=(-1, -1), softcap=0.0,
                    learnable_sink=None, check_seqlens=False) -> Request:
    """flash_attn_with_kvcache's checked request (layout KVCACHE): check_kvcache_inputs' errors (out
    is checked, not kept: flash4.forward.run takes it), page_table / cache_batch_idx made contiguous,
    cache_seqlens as a (batch,) int32 tensor on q's device (an int for every sequence, None for the
    whole cache), and with check_seqlens the on-device value checks (check_kvcache_seqlens, one host
    sync) before anything is written."""
    _checked(_kvcache_problem, q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale,
             causal, num_splits, out, window_size, softcap, learnable_sink)
    page_table, cache_batch_idx = _contiguous(page_table), _contiguous(cache_batch_idx)
    paged = page_table is not None
    capacity = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = _contiguous(cache_seqlens)
    else:
        seqlens = torch.full((q.shape[0],), capacity if cache_seqlens is None else cache_seqlens, dtype=torch.int32,
                             device=q.device)
    if check_seqlens:
        check_kvcache_seqlens(seqlens, 0 if k is None else k.shape[1], capacity, batch_cache=k_cache.shape[0],
                              cache_batch_idx=cache_batch_idx, page_table=page_table, num_pages=k_cache.shape[0],
                              page_size=k_cache.shape[1])
    return Request.kvcache(q, k_cache, v_cache, k, v, seqlens, page_table, cache_batch_idx, softmax_scale, causal,
                           num_splits, window_size, softcap, learnable_sink, check_seqlens)


# ================================================================ on-device value checks (check_seqlens)
def resolve_max_seqlen(name: str, value, cu_seqlens: torch.Tensor | None, seqused: torch.Tensor | None) -> int:
    """max_seqlen as a host int: a Python int as is; a 0-d tensor through .item() (a host sync for a
    CUDA tensor); None computed as max(seqused) or max(cu_seqlens[b+1] - cu_seqlens[b]) (a host sync
    for CUDA tensors). Raises ValueError for a negative value."""
    if isinstance(value, torch.Tensor):
        value = int(value.item())
    elif value is None:
        lengths = seqused if seqused is not None else cu_seqlens[1:] - cu_seqlens[:-1]
        value = max(int(lengths.max().item()), 0) if lengths.numel() > 0 else 0
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return int(value)


class _DeviceChecks:
    """Conditions evaluated on the tensors' device and read back in one host sync. add(flag, message)
    takes a 0-d bool tensor that is True where something is wrong and a callable giving the message."""

    def __init__(self):
        self.flags, self.messages = [], []

    def add(self, flag: torch.Tensor, message) -> None:
        self.flags.append(flag.reshape(()))
        self.messages.append(message)

    def raise_first(self) -> None:
        if not self.flags:
            return
        device = self.flags[0].device
        bad = torch.stack([f.to(device) for f in self.flags]).tolist()  # the one host sync
        for is_bad, message in zip(bad, self.messages):
            if is_bad:
                raise ValueError(message())


def _first_index(mask: torch.Tensor) -> tuple:
    return tuple(mask.nonzero()[0].tolist())


def _cu_seqlens_checks(checks: _DeviceChecks, name: str, cu: torch.Tensor, total: int, tensor: str) -> None:
    checks.add(cu[0] != 0, lambda: f"{name}[0] is {cu[0].item()}; cu_seqlens are prefix sums starting at 0")
    if cu.numel() > 1:
        steps = cu[1:] < cu[:-1]

        def decreasing():
            i = _first_index(steps)[0]
            return (f"{name} is not non-decreasing: {name}[{i}]={cu[i].item()} > {name}[{i + 1}]={cu[i + 1].item()} "
                    f"(sequence {i} would have a negative length)")

        checks.add(steps.any(), decreasing)
    checks.add(cu[-1] > total, lambda: (
        f"{name}[-1]={cu[-1].item()} is past the end of {tensor} ({tensor}.shape[0]={total} rows)"))


def _lengths(cu: torch.Tensor) -> torch.Tensor:
    return cu[1:] - cu[:-1]


def check_varlen_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, *, seqused_q=None, seqused_k=None,
                         page_table=None, num_pages: int = 0, page_size: int = 0, max_seqlen_q=None,
                         max_seqlen_k=None) -> None:
    """The value checks of flash4.flash_attn_varlen_func(..., check_seqlens=True), on the tensors'
    device with one host sync (that is their cost; the call itself never syncs otherwise). Raises
    ValueError, naming the argument and the first bad entry, when:
    cu_seqlens_q / cu_seqlens_k does not start at 0, decreases, or ends past total_q / total_k rows;
    seqused_q[b] / seqused_k[b] is negative or above the sequence's stored length (paged: above
    page_table.shape[1] * page_size); a page_table entry that sequence b uses (pages
    0 .. ceil(seqused_k[b] / page_size) - 1) is outside [0, num_pages); a max_seqlen given as an int
    (or a CPU 0-d tensor) is below the longest sequence (rows past it would be left uncomputed).
    Arguments: validated metadata (check_varlen_inputs); cu_seqlens_k None when paged."""
    checks = _DeviceChecks()
    _cu_seqlens_checks(checks, "cu_seqlens_q", cu_seqlens_q, total_q, "q")
    if cu_seqlens_k is not None:
        _cu_seqlens_checks(checks, "cu_seqlens_k", cu_seqlens_k, total_k, "k")
    len_q = _lengths(cu_seqlens_q)
    if seqused_q is not None:
        _seqused_checks(checks, "seqused_q", seqused_q, len_q, "cu_seqlens_q[b + 1] - cu_seqlens_q[b]")
        len_q = seqused_q
    if page_table is not None:
        capacity = page_table.shape[1] * page_size
        cap = torch.full_like(seqused_k, capacity)
        _seqused_checks(checks, "seqused_k", seqused_k, cap, f"page_table.shape[1] * page_size = {capacity}")
        _page_table_checks(checks, page_table, seqused_k, num_pages, page_size, "seqused_k")
        len_k = seqused_k
    else:
        len_k = _lengths(cu_seqlens_k)
        if seqused_k is not None:
            _seqused_checks(checks, "seqused_k", seqused_k, len_k, "cu_seqlens_k[b + 1] - cu_seqlens_k[b]")
            len_k = seqused_k
    for name, value, lengths in (("max_seqlen_q", max_seqlen_q, len_q), ("max_seqlen_k", max_seqlen_k, len_k)):
        if value is None or lengths.numel() == 0:
            continue
        if isinstance(value, torch.Tensor):
            value = value.to(lengths.device)
        longest = lengths.max()
        checks.add(longest > value, lambda name=name, value=value, longest=longest: (
            f"{name}={int(value)} is below the longest sequence ({int(longest.item())}); rows past it would be left "
            f"uncomputed: pass max_seqlen >= every length, or None to compute it"))
    checks.raise_first()


def _seqused_checks(checks: _DeviceChecks, name: str, seqused: torch.Tensor, stored: torch.Tensor, what: str) -> None:
    if seqused.numel() == 0:
        return
    bad = (seqused < 0) | (seqused > stored)

    def message():
        b = _first_index(bad)[0]
        return f"{name}[{b}]={seqused[b].item()} is outside [0, {what}] = [0, {stored[b].item()}] (sequence {b})"

    checks.add(bad.any(), message)


def _page_table_checks(checks: _DeviceChecks, page_table: torch.Tensor, used: torch.Tensor, num_pages: int,
                       page_size: int, used_name: str) -> None:
    """Entries page_table[b, :ceil(used[b] / page_size)] in [0, num_pages)."""
    if page_table.numel() == 0:
        return
    pages_used = (used.long().clamp(min=0) + page_size - 1) // page_size
    column = torch.arange(page_table.shape[1], device=page_table.device)
    bad = (column < pages_used[:, None]) & ((page_table < 0) | (page_table >= num_pages))

    def message():
        b, j = _first_index(bad)
        return (f"page_table[{b}, {j}]={page_table[b, j].item()} is not a page of the cache (num_pages = {num_pages}, "
                f"the cache's shape[0]); sequence {b} uses pages 0..{pages_used[b].item() - 1} of its row "
                f"({used[b].item()} keys ({used_name}), page_size {page_size})")

    checks.add(bad.any(), message)



def check_kvcache_seqlens(cache_seqlens, seqlen_new: int, capacity: int, *, batch_cache: int = 0,
                          cache_batch_idx=None, page_table=None, num_pages: int = 0, page_size: int = 0) -> None:
    """The value checks of flash_attn_with_kvcache(..., check_seqlens=True), one host sync, before
    anything is written: cache_seqlens[b] >= 0 and cache_seqlens[b] + seqlen_new <= capacity
    (seqlen_cache, or page_table.shape[1] * page_size); cache_batch_idx in [0, batch_cache); the
    page_table entries of the pages each sequence uses (after the append) in [0, num_pages).
    cache_seqlens: the int32 (batch,) tensor. Raises ValueError."""
    checks = _DeviceChecks()
    if cache_seqlens.numel() > 0:
        bad = (cache_seqlens < 0) | (cache_seqlens + seqlen_new > capacity)

        def message():
            b = _first_index(bad)[0]
            return (f"cache_seqlens[{b}]={cache_seqlens[b].item()}: the cache is too small for the appended k/v or the "
                    f"length is negative (cache_seqlens + seqlen_new = {cache_seqlens[b].item()} + {seqlen_new} must be "
                    f"in [0, {capacity}])")

        checks.add(bad.any(), message)
    if cache_batch_idx is not None and cache_batch_idx.numel() > 0:
        bad_idx = (cache_batch_idx < 0) | (cache_batch_idx >= batch_cache)

        def idx_message():
            b = _first_index(bad_idx)[0]
            return f"cache_batch_idx[{b}]={cache_batch_idx[b].item()} is outside [0, batch_cache = {batch_cache})"

        checks.add(bad_idx.any(), idx_message)
    if page_table is not None:
        _page_table_checks(checks, page_table, cache_seqlens.clamp(min=0) + seqlen_new, num_pages, page_size,
                           "cache_seqlens + seqlen_new")
    checks.raise_first()
