"""Prepared calls: a door's host path for an argument signature it has seen before (issue 25 item 4).

A serving loop calls a door with the same shapes, strides, dtypes, devices and options step after
step. The first call with a signature runs the whole host path (flash4.validate's checks and request,
the plan: flash4.config.fwd_config / decode_door, the runner lookups, the launch scalars) and keeps
what it decided as a prepared call; a later call with the same signature only does what depends on
values outside the signature:

    kvcache_key / dense_key / varlen_key(...) -> key, or None (not kept: see below)
    get(key) -> a prepared call, or None;  put(key, call)
    prepare_kvcache / prepare_dense / prepare_varlen(request, ...) -> a prepared call, or None

    a prepared call's per-call work: the metadata made contiguous, check_seqlens' on-device value
    checks (check_seqlens=True: one host sync, as before), an int cache_seqlens as a tensor, the
    learnable sink as the kernels read it, out / lse / scratch allocation, the KV append, the small
    device ops of the packed decode (gathers), the self-test gate of a gated family's config
    (flash4.selftest.require: the verdict may change), and the compiled kernels' calls with their
    host scalars (flash4.compile.cache's runner.tail) fixed.

The key holds everything the checks and the plan read: per tensor its dtype, shape, strides, CUDA
index and base address modulo 16 (TMA alignment); every other argument with its type (True and 1
differ; an unhashable argument, e.g. a list window_size, is not kept); the environment variables a
plan reads (flash4.env.PLAN_VARIABLES). Validation that depends only on the key is skipped on a hit
(it passed with the same key); a call whose checks fail is never kept. Not kept: calls while
torch.compile traces (the custom ops check themselves), calls that autograd records (grad mode on
and an input requiring grad: FlashAttnFunction's path), CPU tensors (the CPU tests replace
flash4.forward.launch; CPU = True lets tools/host_overhead.py --fake and tests/cpu/test_memo_cpu.py
through), the cases without kernel work (empty batches, no keys), flash_attn_with_kvcache with
cache_batch_idx, and flash_attn_varlen_func with max_seqlen_q given as a tensor or None (a host
sync per call). Those run the host path of flash4.forward.run as before.

No host sync is added: a hit is pure host work plus the same device work as the first call, so it
is CUDA-graph safe exactly where the door was. ENABLED (env.memo_enabled(), read at import; on unless switched off there; GPU-tested on the
H200, tests/gpu/test_memo.py) turns it on; tests and tools set it directly.
"""

from __future__ import annotations

import torch

from flash4 import env, forward, validate
from flash4.arch import device_arch, num_sms
from flash4.config import decode_door, fwd_config

F32 = torch.float32
# TMA alignment of base addresses (flash4.validate's rule): the key keeps data_ptr() modulo it.
_ALIGN = 16

ENABLED = env.memo_enabled()  # on by default (flash4.env)
CPU = False  # keep CPU tensors too (tools/host_overhead.py --fake, tests/cpu/test_memo_cpu.py)
_MEMO: dict = {}
MAX_ENTRIES = 4096  # then cleared (a process that keeps making new signatures pays the full path)
stats = {"hits": 0, "kept": 0}


# ================================================================ keys
_Tensor = torch.Tensor


def _key(door: str, args) -> tuple | None:
    """The key of a door's argument list, or None: when autograd would record the call (grad mode on
    and a tensor argument requiring grad; besides the float inputs q, k, v, k_cache, v_cache, k, v,
    out and learnable_sink, a door's tensor arguments are integer metadata, which cannot require
    grad, or tensors the checks reject), or when a tensor has no data pointer to read (a meta or
    storage-less tensor: the full path gives its error). A None argument enters as None (no other
    argument's entry is None); a tuple (window_size) with its elements' types: (-1.0, -1.0) or
    (4, False) equal (-1, -1) or (4, 0) but are not valid windows."""
    parts = [door, env.plan_snapshot()]
    return tuple(parts) if _append_entries(parts.append, args, torch.is_grad_enabled()) else None


def _append_entries(append, args, grad_mode: bool) -> bool:
    """Append each argument's key entry (_key's forms); False when the call has no key (a tensor
    requiring grad in grad mode, or one without a data pointer)."""
    try:
        for a in args:
            if a is None:
                append(None)
            elif isinstance(a, _Tensor):
                if grad_mode and a.requires_grad:
                    return False
                append((a.dtype, a.shape, a.stride(), a.get_device(), a.data_ptr() % _ALIGN))
            elif isinstance(a, tuple):
                append((type(a), a, tuple(map(type, a))))
            else:
                append((type(a), a))
    except (RuntimeError, NotImplementedError):
        return False
    return True


# Types of scalar arguments that _scalar_key keeps as (types, values) in one entry: the scalars of a
# call all of these types (the usual case) skip _key's per-argument test.
_PLAIN = frozenset((type(None), bool, int, float, tuple))


_OTHER = object()  # _scalar_key's answer for scalars not all of _PLAIN types


def _scalar_key(door: str, scalars: tuple, window, tensors: tuple):
    """_key's information in fewer steps: `scalars` (the arguments that are not tensors when the
    checks pass, window_size among them) enter as their types and values in two entries, when all
    are of _PLAIN types, and the window (a tuple then, or None) with its elements' types; `tensors`
    (the arguments that may be tensors) as _key's entries. Otherwise (a tensor, a list, a Band, ...
    among the scalars) _OTHER: the door then takes _key's form of its arguments (never equal to this
    form: another length)."""
    types = tuple(map(type, scalars))
    if not _PLAIN.issuperset(types):
        return _OTHER
    parts = [door, env.plan_snapshot(), types, scalars, None if window is None else tuple(map(type, window))]
    if not _append_entries(parts.append, tensors, torch.is_grad_enabled()):
        return None
    return tuple(parts)


def dense_key(q, k, v, softmax_scale, causal, return_lse, deterministic, window_size, softcap, learnable_sink):
    """flash_attn_func's key, or None when the call is not kept."""
    if not ENABLED or torch.compiler.is_compiling() or not isinstance(q, _Tensor) or not (q.is_cuda or CPU):
        return None
    key = _scalar_key("dense", (softmax_scale, causal, return_lse, deterministic, window_size, softcap), window_size,
                      (q, k, v, learnable_sink))
    if key is _OTHER:
        return _key("dense", (q, k, v, softmax_scale, causal, return_lse, deterministic, window_size, softcap,
                              learnable_sink))
    return key


def varlen_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
               softmax_scale, causal, window_size, softcap, return_lse, deterministic, check_seqlens, learnable_sink):
    """flash_attn_varlen_func's key, or None (also for max_seqlen_q other than an int)."""
    if (type(max_seqlen_q) is not int or not ENABLED or torch.compiler.is_compiling() or not isinstance(q, _Tensor)
            or not (q.is_cuda or CPU)):
        return None
    key = _scalar_key("varlen", (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, return_lse,
                                 deterministic, check_seqlens), window_size,
                      (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink))
    if key is _OTHER:
        return _key("varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                               page_table, softmax_scale, causal, window_size, softcap, return_lse, deterministic,
                               check_seqlens, learnable_sink))
    return key


def kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale, causal,
                window_size, softcap, num_splits, return_lse, out, check_seqlens, learnable_sink):
    """flash_attn_with_kvcache's key, or None (also with cache_batch_idx). cache_seqlens (an int, a
    tensor or None) enters with the tensors."""
    if (cache_batch_idx is not None or not ENABLED or torch.compiler.is_compiling() or not isinstance(q, _Tensor)
            or not (q.is_cuda or CPU)):
        return None
    key = _scalar_key("kvcache", (softmax_scale, causal, window_size, softcap, num_splits, return_lse, check_seqlens),
                      window_size, (q, k_cache, v_cache, k, v, cache_seqlens, page_table, out, learnable_sink))
    if key is _OTHER:
        return _key("kvcache", (q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale, causal,
                                window_size, softcap, num_splits, return_lse, out, check_seqlens, learnable_sink))
    return key


def dense_backward_key(dout, q, k, v, out, lse, lse_split, dlse, softmax_scale, causal, deterministic, window_left,
                       window_right, softcap, sink_delta):
    """flash4.ops.dense_backward's key (flash4.backward.PreparedBackward), or None when not kept: the
    arguments' signature plus the environment the backward's plan reads (env.bwd_plan_snapshot).
    The backward runs with grad mode off; under create_graph=True (grad mode on, inputs requiring
    grad) the call is not kept."""
    if not ENABLED or torch.compiler.is_compiling() or not isinstance(q, _Tensor) or not (q.is_cuda or CPU):
        return None
    scalars = (softmax_scale, causal, deterministic, window_left, window_right, softcap, sink_delta)
    types = tuple(map(type, scalars))
    if not _PLAIN.issuperset(types):
        return None
    parts = ["dense_bwd", env.bwd_plan_snapshot(), types, scalars]
    if not _append_entries(parts.append, (dout, q, k, v, out, lse, lse_split, dlse), torch.is_grad_enabled()):
        return None
    return tuple(parts)


def get(key):
    """The prepared call of `key`, or None (None key or unhashable: None)."""
    if key is None:
        return None
    try:
        call = _MEMO.get(key)
    except TypeError:  # an unhashable argument
        return None
    if call is not None:
        stats["hits"] += 1
    return call


def put(key, call) -> None:
    try:
        hash(key)
    except TypeError:
        return
    if len(_MEMO) >= MAX_ENTRIES:
        _MEMO.clear()
    _MEMO[key] = call
    stats["kept"] += 1


def clear() -> None:
    _MEMO.clear()


def _sink(learnable_sink):
    """ScoreSpec.kernel_sink of the caller's sink (per call: its values may change)."""
    return None if learnable_sink is None else learnable_sink.detach().float().contiguous()


def _contiguous(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


# ================================================================ the launches with their plan fixed
class _Kernel:
    """flash4.forward.launch's DENSE / VARLEN / PAGED kernel call with its config, runner and host
    scalars fixed: __call__(q, k, v, out, lse, seqs, sink) launches (seqs: the contiguous
    (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table) of a packed request, None dense)."""

    __slots__ = ("fwd", "tail", "packed", "paged", "split_shape", "gated")

    def __init__(self, request, cfg=None):
        from flash4 import selftest
        from flash4.compile.cache import get_fwd_runner

        q, k, seq = request.q, request.k, request.seq
        if cfg is None:  # else a config chosen for the request (NarrowCall: forward.narrow_config's)
            cfg = fwd_config(request, device_arch(q.device)).cfg
        selftest.require(cfg, q.device)
        self.gated = (cfg,) if selftest.gated(cfg) else ()
        runner = get_fwd_runner(cfg)
        self.fwd, self.packed, self.paged = runner.compiled, seq.packed, seq.paged
        window, softcap, scale = request.mask.window, request.score.softcap, request.score.softmax_scale
        if seq.packed:
            k4 = k if seq.paged else k.unsqueeze(0)
            seqs = (seq.cu_seqlens_q, None if seq.paged else seq.cu_seqlens_k, seq.seqused_q, seq.seqused_k,
                    seq.page_table)
            self.tail = runner.tail(q.unsqueeze(0), k4, scale, seqs, request.batch, int(seq.max_seqlen_q), 1, window,
                                    softcap)
            self.split_shape = (2, 1, q.shape[1], q.shape[0])  # new_lse_split(request).unsqueeze(1)
        else:
            self.tail = runner.tail(q, k, scale, None, None, None, 1, window, softcap)
            self.split_shape = (2, q.shape[0], q.shape[2], q.shape[1])

    def __call__(self, q, k, v, out, lse, seqs, sink) -> None:
        split = torch.empty(self.split_shape, dtype=F32, device=q.device)
        if self.packed:
            if not self.paged:
                k, v = k.unsqueeze(0), v.unsqueeze(0)
            cu_q, cu_k, used_q, used_k, table = seqs
            self.fwd(q.unsqueeze(0), k, v, out.unsqueeze(0), lse.unsqueeze(0), split[0], split[1], cu_q,
                     None if self.paged else cu_k, used_q, used_k, table, None, None, sink, *self.tail)
        else:
            self.fwd(q, k, v, out, lse, split[0], split[1], None, None, None, None, None, None, None, sink, *self.tail)


class _Decode:
    """flash4.forward._launch_decode with its plan fixed: __call__(q, k_cache, v_cache, out, lse,
    seqused_k, page_table, sink, rows=None) runs a DECODE step of q (B, Sq, H, D) (GQA packing,
    split-KV and its combine as the plan says). rows (split plans prepared with packed_rows only):
    flash4.forward.launch's, the varlen door's cu_seqlens_q whose rows of out / lse the combine writes."""

    __slots__ = ("fwd", "combine", "tail", "pack", "splits", "batch", "seqlen_q", "nheads_k", "headdim", "headdim_v",
                 "seqlen_p", "heads_p", "combine_ctas", "gated", "q_view", "out_view", "acc_shapes", "combine_rows")

    def __init__(self, step, packed_rows: bool = False):
        """step: the DECODE request (flash4.forward's) of the first call; packed_rows: a split plan also
        gets the combine's packed-rows variant (combine_rows; None otherwise)."""
        from flash4 import selftest
        from flash4.compile.cache import combine_ctas

        q, seq = step.q, step.seq
        plan = fwd_config(step, device_arch(q.device), num_sms(q.device))
        selftest.require(plan.cfg, q.device)
        self.gated = (plan.cfg,) if selftest.gated(plan.cfg) else ()
        run_kernel, combine = forward._runners(plan)
        self.fwd, self.combine = run_kernel.compiled, None if combine is None else combine.compiled
        self.combine_rows = None
        if packed_rows and plan.num_splits > 1:
            self.combine_rows = forward._runners(plan, True)[1].compiled
        self.batch, self.seqlen_q, _, self.headdim = q.shape
        self.nheads_k, self.headdim_v = step.nheads_k, step.headdim_v
        self.pack, self.splits, self.seqlen_p, self.heads_p = plan.pack, plan.num_splits, plan.seqlen_p, plan.heads_p
        shape = _Shape((self.batch, self.seqlen_p, self.heads_p, self.headdim), q.device)  # q as the kernel sees it
        seqs = (None, None, None, seq.seqused_k, seq.page_table)
        window = step.mask.window if self.splits > 1 or self.pack == 1 else None  # as _launch_decode passes it
        self.tail = run_kernel.tail(shape, step.k, step.score.softmax_scale, seqs, self.batch, self.seqlen_p,
                                    self.splits, window, step.score.softcap)
        self.combine_ctas = combine_ctas(self.batch, self.seqlen_p, self.heads_p) if self.splits > 1 else 0
        # the sizes of forward.packed_q's / split_out_arg's views (Sq == 1, PACK_VIEWS) and of the
        # split-KV scratch (o_acc, lse_acc): fixed by the key's shapes
        self.q_view = (self.batch, self.pack, self.nheads_k, self.headdim)
        self.out_view = (self.batch, self.pack, self.nheads_k, self.headdim_v)
        self.acc_shapes = ((self.splits, self.batch, self.seqlen_p, self.heads_p, self.headdim_v),
                           (self.splits, self.batch, self.heads_p, self.seqlen_p))

    def __call__(self, q, k_cache, v_cache, out, lse, seqused_k, page_table, sink, rows=None) -> None:
        pack, nheads_k = self.pack, self.nheads_k
        if pack == 1:
            q_run = q
        elif self.seqlen_q == 1 and forward.PACK_VIEWS:  # forward.packed_q's view, its sizes fixed
            q_run = forward.head_pack_view(q, self.q_view)
        else:
            q_run = forward.packed_q(q, nheads_k, pack)
        if self.splits > 1:
            device = q.device
            o_shape, lse_shape = self.acc_shapes
            o_acc = torch.empty(o_shape, dtype=F32, device=device)
            lse_acc = torch.empty(lse_shape, dtype=F32, device=device)
            # out / lse are not written by a split_kv launch (its partials go to o_acc / lse_acc)
            if rows is not None:  # a varlen door's out (total_q, H, Dv): forward.rows_out_arg
                o_arg = forward.rows_out_arg(q_run, self.headdim_v)
            elif pack == 1:
                o_arg = out
            elif self.seqlen_q == 1 and forward.PACK_VIEWS:  # forward.split_out_arg's view of out
                o_arg = forward.head_pack_view(out, self.out_view)
            else:
                o_arg = forward.split_out_arg(q_run, out, lse, nheads_k, pack)
            lse0 = lse_acc[0]
            self.fwd(q_run, k_cache, v_cache, o_arg, lse0, lse0, lse_acc[1], None, None, None, seqused_k, page_table,
                     o_acc, lse_acc, sink, *self.tail)
            if rows is not None:  # out (total_q, H, Dv) / lse (H, total_q): get_combine_runner(packed_rows=True)
                self.combine_rows(o_acc, lse_acc, out, lse, sink, pack, self.combine_ctas, rows)
            else:
                self.combine(o_acc, lse_acc, out, lse, sink, pack, self.combine_ctas)
        elif pack > 1:
            batch, seqlen_p, heads_p, device = self.batch, self.seqlen_p, self.heads_p, q.device
            views = forward.packed_out(out, lse, nheads_k, pack)
            out_p, lse_p = views if views is not None else (
                torch.empty(batch, seqlen_p, heads_p, self.headdim_v, dtype=q.dtype, device=device),
                torch.empty(batch, heads_p, seqlen_p, dtype=F32, device=device))
            split = torch.empty(2, batch, heads_p, seqlen_p, dtype=F32, device=device)
            self.fwd(q_run, k_cache, v_cache, out_p, lse_p, split[0], split[1], None, None, None, seqused_k, page_table,
                     None, None, forward._packed_sink(sink), *self.tail)
            if views is None:
                forward.unpack_out(out, lse, out_p, lse_p, nheads_k, pack)
        else:
            split = torch.empty((2,) + tuple(lse.shape), dtype=F32, device=q.device)
            self.fwd(q, k_cache, v_cache, out, lse, split[0], split[1], None, None, None, seqused_k, page_table, None,
                     None, sink, *self.tail)


class _Shape:
    """What runner.tail reads of q: its shape and device."""

    __slots__ = ("shape", "device")

    def __init__(self, shape, device):
        self.shape, self.device = shape, device


def _gate(cfgs, device) -> None:
    if cfgs:
        from flash4 import selftest

        for cfg in cfgs:
            selftest.require(cfg, device)


# ================================================================ the doors' prepared calls
class DenseCall:
    """flash_attn_func without autograd: __call__(q, k, v, learnable_sink) -> (out, lse)."""

    __slots__ = ("out_shape", "lse_shape", "decode", "kernel", "seqlen_k", "gated", "seqused_key")

    def __init__(self, request):
        q = request.q
        batch, seqlen_q, nheads = q.shape[:3]
        self.out_shape, self.lse_shape = (batch, seqlen_q, nheads, request.headdim_v), (batch, nheads, seqlen_q)
        self.seqlen_k = request.k.shape[1]
        self.seqused_key = ("seqused", q.device, batch, self.seqlen_k)  # forward._full_seqused's cache key
        self.decode = self.kernel = None
        with forward.device_guard(q.device):
            if decode_door(request, forward._door_arch(q.device), False):
                seqused_k = forward._full_seqused(batch, self.seqlen_k, q.device)
                self.decode = _Decode(forward._decode_step(request, q, seqused_k, None))
            else:
                self.kernel = _Kernel(request)
        self.gated = (self.decode or self.kernel).gated

    def __call__(self, q, k, v, learnable_sink):
        device = q.device
        out = torch.empty(self.out_shape, dtype=q.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=F32, device=device)
        sink = None if learnable_sink is None else _sink(learnable_sink)
        if self.gated:
            _gate(self.gated, device)
        with forward.device_guard(device):
            if self.decode is not None:
                seqused_k = forward._DEVICE_CONSTANTS.get(self.seqused_key)  # forward._full_seqused, its key fixed
                if seqused_k is None:
                    seqused_k = forward._full_seqused(q.shape[0], self.seqlen_k, device)
                self.decode(q, k, v, out, lse, seqused_k, None, sink)
            else:
                self.kernel(q, k, v, out, lse, None, sink)
        return out, lse


class NarrowCall:
    """flash_attn_func without autograd at a head dim flash4.headdim pads, on the narrow tensors
    (flash4.forward.launch_narrow): __call__(q, k, v, learnable_sink) -> (out, lse). stand_in: the
    call's forward.narrow_stand_in request (the padded shapes; its tensors are not kept), cfg:
    forward.narrow_config's for it. The launch is launch_narrow's (tests/cpu/test_memo_cpu.py)."""

    __slots__ = ("out_shape", "lse_shape", "kernel")

    def __init__(self, stand_in, cfg):
        batch, seqlen_q, nheads = stand_in.q.shape[:3]
        self.out_shape, self.lse_shape = (batch, seqlen_q, nheads, cfg.tensor_hdims[1]), (batch, nheads, seqlen_q)
        self.kernel = _Kernel(stand_in, cfg)

    def __call__(self, q, k, v, learnable_sink):
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=F32, device=q.device)
        with forward.device_guard(q.device):
            self.kernel(q, k, v, out, lse, None, None)
        return out, lse


def prepare_dense(request):
    """The prepared call of a checked DENSE request without autograd, or None (nothing to launch)."""
    q, k = request.q, request.k
    if q.numel() == 0 or q.shape[0] * q.shape[1] * q.shape[2] * request.headdim_v == 0 or k.shape[1] == 0:
        return None
    return DenseCall(request)


class VarlenCall:
    """flash_attn_varlen_func without autograd, max_seqlen_q an int: __call__(q, k, v, cu_seqlens_q,
    cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k, learnable_sink) ->
    (out, lse)."""

    __slots__ = ("out_shape", "lse_shape", "fill", "check", "batch", "max_q", "decode", "kernel", "headdim_v",
                 "gated", "direct")

    def __init__(self, request):
        q, seq = request.q, request.seq
        total_q, nheads = q.shape[:2]
        self.out_shape, self.lse_shape = (total_q, nheads, request.headdim_v), (nheads, total_q)
        self.fill, self.check = seq.seqused_q is not None, request.check_seqlens
        self.batch, self.max_q, self.headdim_v = request.batch, int(seq.max_seqlen_q), request.headdim_v
        self.decode = self.kernel = None
        with forward.device_guard(q.device):
            if decode_door(request, forward._door_arch(q.device), False):
                q_step = q.new_empty((self.batch, self.max_q, nheads, q.shape[2]))  # the step's shape (the plan's input)
                step = forward._decode_step(request, q_step, seq.seqused_k, seq.page_table)
                scatter = env.decode_scatter()  # a key entry (env.PLAN_VARIABLES): fixed for this call
                self.decode = _Decode(step, packed_rows=scatter)
            else:
                self.kernel = _Kernel(request)
        self.gated = (self.decode or self.kernel).gated
        # the decode step's combine writes out / lse's rows (forward._packed_decode's `direct`): split plans
        self.direct = self.decode is not None and self.decode.combine_rows is not None

    def run(self, q, k, v, seqs, sink):
        """The launches of checked arguments (seqs: the contiguous metadata)."""
        device = q.device
        if self.fill:
            out = torch.zeros(self.out_shape, dtype=q.dtype, device=device)
            lse = torch.full(self.lse_shape, float("-inf"), dtype=F32, device=device)
        else:
            out = torch.empty(self.out_shape, dtype=q.dtype, device=device)
            lse = torch.empty(self.lse_shape, dtype=F32, device=device)
        if self.gated:
            _gate(self.gated, device)
        with forward.device_guard(device):
            if self.decode is not None:
                decode, used_k, table, direct = self.decode, seqs[3], seqs[4], self.direct
                rows = seqs[0] if direct else None

                def step(q_step, out_step, lse_step):
                    decode(q_step, k, v, out_step, lse_step, used_k, table, sink, rows)

                forward.packed_decode_rows(q, seqs[0], self.batch, self.max_q, self.headdim_v, out, lse,
                                           (False, False), step, direct)
            else:
                self.kernel(q, k, v, out, lse, seqs, sink)
        return out, lse

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, max_seqlen_q,
                 max_seqlen_k, learnable_sink):
        seqs = (_contiguous(cu_seqlens_q), _contiguous(cu_seqlens_k), _contiguous(seqused_q), _contiguous(seqused_k),
                _contiguous(page_table))
        if self.check:
            paged = seqs[4] is not None
            validate.check_varlen_seqlens(seqs[0], seqs[1], q.shape[0], k.shape[0], seqused_q=seqs[2],
                                          seqused_k=seqs[3], page_table=seqs[4], num_pages=k.shape[0] if paged else 0,
                                          page_size=k.shape[1] if paged else 0, max_seqlen_q=max_seqlen_q,
                                          max_seqlen_k=max_seqlen_k)
        return self.run(q, k, v, seqs, None if learnable_sink is None else _sink(learnable_sink))


def prepare_varlen(request):
    """The prepared call of a checked VARLEN / PAGED request (max_seqlen_q an int) without autograd,
    or None (nothing to launch: no query rows, no sequence, max_seqlen_q 0 or no keys)."""
    q, seq = request.q, request.seq
    if q.shape[0] == 0 or request.batch <= 0 or seq.max_seqlen_q == 0 or request.k.numel() == 0:
        return None
    if q.shape[1] * request.headdim_v == 0:
        return None
    return VarlenCall(request)


class KvcacheCall:
    """flash_attn_with_kvcache without cache_batch_idx: __call__(q, k_cache, v_cache, k, v,
    cache_seqlens, page_table, out, learnable_sink) -> (out, lse)."""

    __slots__ = ("decode", "seqlen_new", "capacity", "check", "out_shape", "lse_shape", "gated")

    def __init__(self, request):
        q, cache = request.q, request.cache
        batch, seqlen_q, nheads = q.shape[:3]
        self.out_shape, self.lse_shape = (batch, seqlen_q, nheads, request.headdim_v), (batch, nheads, seqlen_q)
        self.seqlen_new, self.capacity, self.check = cache.seqlen_new, request.capacity, request.check_seqlens
        # the DECODE step of forward._kvcache (its plan does not read seqused_k's values)
        step = request.with_seq(forward.SeqSpec(forward.DECODE, seqused_k=cache.cache_seqlens,
                                                page_table=request.seq.page_table))
        with forward.device_guard(q.device):
            self.decode = _Decode(step)
        self.gated = self.decode.gated

    def run(self, q, k_cache, v_cache, k, v, seqlens, page_table, out, sink):
        """The append and the attention of checked arguments (seqlens: the (batch,) int32 tensor)."""
        device = q.device
        if out is None:
            out = torch.empty(self.out_shape, dtype=q.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=F32, device=device)
        seqlen_new = self.seqlen_new
        if seqlen_new > 0:
            if q.shape[0] > 0:
                forward._append_kv(k_cache, v_cache, k, v, seqlens, page_table, None)
            seqlens = _contiguous(seqlens + seqlen_new)
        if self.gated:
            _gate(self.gated, device)
        with forward.device_guard(device):
            self.decode(q, k_cache, v_cache, out, lse, seqlens, page_table, sink)
        return out, lse

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, page_table, out, learnable_sink):
        if page_table is not None and not page_table.is_contiguous():
            page_table = page_table.contiguous()
        if isinstance(cache_seqlens, _Tensor):
            seqlens = cache_seqlens if cache_seqlens.is_contiguous() else cache_seqlens.contiguous()
        else:
            seqlens = torch.full((q.shape[0],), self.capacity if cache_seqlens is None else cache_seqlens,
                                 dtype=torch.int32, device=q.device)
        if self.check:
            validate.check_kvcache_seqlens(seqlens, self.seqlen_new, self.capacity, batch_cache=k_cache.shape[0],
                                           cache_batch_idx=None, page_table=page_table, num_pages=k_cache.shape[0],
                                           page_size=k_cache.shape[1])
        return self.run(q, k_cache, v_cache, k, v, seqlens, page_table, out,
                        None if learnable_sink is None else _sink(learnable_sink))


def prepare_kvcache(request, out):
    """The prepared call of a checked KVCACHE request without cache_batch_idx, or None (nothing to
    launch: an empty out, or a cache without key storage). out: the caller's buffer or None."""
    q, k_cache = request.q, request.k
    if request.cache.cache_batch_idx is not None:
        return None
    if q.shape[0] * q.shape[1] * q.shape[2] * request.headdim_v == 0 or k_cache.numel() == 0:
        return None
    return KvcacheCall(request)
