r"""The host backward: dense and packed (varlen) requests, preprocess -> main kernel -> postprocess.

    run(request, dout, out, lse, lse_split=None, dlse=None, dq=None, dk=None, dv=None) -> (dq, dk, dv)
    flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, ...)  (the dense call by name)

    dpsum    = rowsum(dO * O)                      fp32, 0 on padding rows                      \ CuTe DSL
    lse_log2 = LSE * log2(e) = fp32(hi + lo)       fp32, +inf where LSE = -inf or padding        | kernels/
               (so P = 2^(S*c - lse_log2) = 0 there)                                          | common/
    exact    = 1 for query tiles with |lse_log2| >= BWD_EXACT_LSE_LOG2: the main kernel      | bwd_pre-
               computes P there from hi, lo unrounded (exact at any magnitude, issue 8)       | process.py
    dq_accum = 0                                   fp32 (.., H, rows, D), the kernel reduce-adds dQ /
                                                   (zeroed by the preprocess)
    dpsum   -= dLSE                                when the LSE has a gradient (dS = P * (dP - D) gains P * dLSE)
    dpsum   *= softmax_scale                       only with the sm90 speed candidate BwdConfig.dpsum_scaled
    delta    = 0                                   fp32 (.., H, rows), only when a learnable sink needs a
                                                   gradient (run's `delta`): the main kernel adds
                                                   D = sum_j P dP of each row (BwdConfig.sink_delta)
    main kernel (the family's, flash4.kernels.registry): dK, dV of its key tile, dQ reduce-added
    dq       = dq_accum converted to the input dtype (the kernel's dS already carries softmax_scale; the
               dQ postprocess)

Dense (B, Sq, H, D): the statistics are (B, H, Sq_pad), Sq_pad = seqlen_q rounded up to the query tile
so every TMA box stays in bounds. Packed (total_q, H, D) with cu_seqlens (the kernels take 4-D / 3-D
views with a batch mode of size 1): the statistics live in a padded layout where each sequence
starts on a query-tile boundary,
    row of query i of sequence b = padded_offset(b) + i,
    padded_offset(b) = (cu_seqlens_q[b] + b * tile_m) // tile_m * tile_m,
    padded_total = (total_q + batch * tile_m) // tile_m * tile_m rows in all,
so sequence b's query tile m is padded tile padded_offset(b) / tile_m + m (its dQ semaphore and exact
flag). One more tile, the scratch tile at row padded_total, takes the packed rows outside every
sequence (at or past cu_seqlens_q[-1], or past seqused_q[b]) (padded_row_index), so the preprocess
and the dlse scatter need no branch and the gather of dQ reads zeros for them (the preprocess
zeroes that tile's rows; no kernel adds to it). The main kernel's grid is (n_block, kv_head,
sequence) with ceil(max_seqlen_k / tile_n) n_blocks; it writes dK, dV rows < seqlen_k of each
sequence; the others (past cu_seqlens_k[-1] or seqused_k) are zeroed before the launch (one memset:
without a host sync the host cannot tell whether any exist). No call syncs with the host, except
resolving a max_seqlen given as None or a CUDA tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from flash4 import env
from flash4.arch import device_arch
from flash4.config import LOG2E, bwd_config, ceil_div, postprocess_wide_stores
from flash4.forward import device_guard
from flash4.request import Request, SeqSpec
from flash4.validate import resolve_max_seqlen

F32 = torch.float32


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, dq=None, dk=None, dv=None,
                        deterministic: bool = False, lse_split=None, dlse=None, window_size=None, softcap: float = 0.0,
                        delta=None):
    """Gradients of out = attention(q, k, v) for the upstream gradient dout (dense batches).

    q: (B, Sq, H, D); k: (B, Sk, Hk, D); v: (B, Sk, Hk, Dv); out, dout: (B, Sq, H, Dv) (Dv = D, or a
    flash4.config.HDIMV_PAIRS head dim); lse: fp32 (B, H, Sq) from the forward.
    lse_split: None, or the forward's fp32 (2, B, H, Sq) log2-domain LSE split (lse * log2 e =
    lse_split[0] + lse_split[1], flash4.forward): with it P is exact at the row max for any finite
    score magnitude; without it the split is taken from the rounded lse (exact while |lse| stays
    below ~2^9, where an ulp of lse is below 2^-14).
    dq, dk, dv: None, or preallocated contiguous tensors like q, k, v that are overwritten (tests
    pass NaN-filled ones to catch unwritten elements).
    dlse: None, or the gradient of the loss w.r.t. lse, (B, H, Sq): dS = P * (dP - D) gains
    P * dLSE (d LSE_i / d S_ij = P_ij), applied as D - dLSE (rows with LSE = -inf have P = 0).
    deterministic: add the dQ partial sums of the key blocks in a fixed order (bitwise-identical
    results across calls); dK and dV are reduced in registers, or (GQA/MQA head split: several
    CTAs per KV head) added in fp32 in head-split order. window_size: None or flash-attn's (left,
    right); softcap: the forward's (0 = off). delta: None, or an fp32 (B, H, Sq) tensor that receives
    each row's D = rowsum(dO * O) of the float32 output (run's; for flash4.autograd.sink_grad).
    Returns (dq, dk, dv) shaped like q, k, v in their dtype. Raises ValueError for a head dim the
    backward kernel does not support (flash4.config.BWD_SUPPORTED_HEADDIMS) or a problem beyond the
    kernels' grid/int32 limits (flash4.launch). The inputs are not validated (they come from a forward).
    """
    request = Request.dense(q, k, v, softmax_scale, causal, window_size, softcap, deterministic=deterministic)
    return run(request, dout, out, lse, lse_split, dlse, dq, dk, dv, delta)


def run(request: Request, dout, out, lse, lse_split=None, dlse=None, dq=None, dk=None, dv=None, delta=None):
    """Gradients (dq, dk, dv) of flash4.forward.run(request) for the upstream gradient dout, for a
    DENSE or VARLEN request (paged K/V have no backward). Shapes as the forward's (module docstrings);
    dlse: None or lse's shape; lse_split: None or the forward's; dq / dk / dv: None or preallocated
    tensors like q, k, v, overwritten (rows outside every sequence get 0).
    delta: None, or an fp32 tensor shaped like lse that receives D_i = rowsum(dO_i * O_i) of the
    float32 output, summed by the main kernel as sum_j P_ij dP_ij (BwdConfig.sink_delta; the
    learnable sink's gradient, flash4.autograd.sink_grad; 0 on rows outside every sequence); a family
    without sink_delta fills it from the 16-bit out. Packed: max_seqlen_k
    (given as None or a 0-d tensor: resolved here, a host sync for a CUDA tensor or None) sizes the
    grid; max_seqlen_q only detects the empty case (the kernel walks each sequence's own query
    tiles). Rows of q / dout outside every sequence may hold any finite values (a key tile loads
    query rows past a sequence's end; their P is 0, as in flash-attn); out / lse there are not read.
    Every gradient is 0, and nothing launches, when there is no query row or no key."""
    q, k, v, seq = request.q, request.k, request.v, request.seq
    assert not seq.paged, "paged K/V have no backward (flash4.autograd.PAGED_BACKWARD_ERROR)"
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if seq.packed:
        request = request.with_seq(_resolved(seq))
        seq = request.seq
        empty = (q.shape[0] == 0 or k.shape[0] == 0 or request.batch <= 0 or seq.max_seqlen_q <= 0
                 or seq.max_seqlen_k <= 0)
    else:
        empty = dq.numel() == 0 or dk.numel() == 0
    if empty:
        for g in (dq, dk, dv) + (() if delta is None else (delta,)):
            g.zero_()
        return dq, dk, dv  # no query or no key: every gradient is 0 (or empty)
    with device_guard(q.device):
        launch(request, dout, out, lse, lse_split, dlse, dq, dk, dv, delta)
    return dq, dk, dv


def launch(request: Request, dout, out, lse, lse_split, dlse, dq, dk, dv, delta=None) -> None:
    """The kernels of one backward with work to do (run() answered the empty cases, allocated dq /
    dk / dv and set the device): BackwardPlan(request, ...) decides, its launch() runs.
    delta: run's (None, or filled with each row's D)."""
    seq = request.seq if request.seq.packed else None
    BackwardPlan(request, delta is not None).launch(request.q, request.k, request.v, seq, dout, out, lse, lse_split,
                                                    dlse, dq, dk, dv, delta)


class BackwardPlan:
    """What one backward decides before its launches, from the request's signature alone (shapes,
    dtypes, mask, score options; for packed requests also their host max_seqlen_k): the plan of
    flash4.config.bwd_config, the self-test gate, the runners (preprocess, main kernel(s), dQ
    postprocess) and the statistics' shapes. launch() then does the per-call work: the statistics
    buffers, the preprocess, the main kernel, the dQ postprocess (module docstring). Kept per call
    signature by PreparedBackward (a dense backward seen before skips this constructor).
    sink_delta: the caller wants each row's D (run's delta is given)."""

    __slots__ = ("cfg", "heads_per_cta", "gated", "in_kernel", "packed", "stats_batch", "rows", "num_kv_tiles",
                 "nheads", "headdim", "preprocess", "postprocess", "run_kernels", "window", "softcap",
                 "softmax_scale", "bound", "dpsum_scaled")

    def __init__(self, request: Request, sink_delta: bool):
        from flash4 import selftest  # late: the gate pulls in its child-process machinery
        from flash4.compile.cache import (dq_postprocess_kwargs, get_bwd_postprocess_runner,  # late
                                           get_bwd_preprocess_runner, get_bwd_runner)

        q, k, seq = request.q, request.k, request.seq
        plan = bwd_config(request, device_arch(q.device), env.bwd_heads_per_cta_override(), sink_delta=sink_delta)
        cfg = self.cfg = plan.cfg
        selftest.require(cfg, q.device)  # gated families (sm100; portable on its own GPUs): only after the self-test passed
        self.gated = (cfg,) if selftest.gated(cfg) else ()
        self.heads_per_cta = plan.heads_per_cta
        self.in_kernel = sink_delta and getattr(cfg, "sink_delta", False)
        self.packed, self.nheads, self.headdim = seq.packed, request.nheads, request.headdim
        tile_m = cfg.tile_m
        if self.packed:  # the padded per-sequence layout plus its scratch tile (module docstring)
            total_q, batch = q.shape[0], request.batch
            self.stats_batch, self.rows = 1, padded_total(total_q, batch, tile_m) + tile_m
            self.num_kv_tiles = ceil_div(seq.max_seqlen_k, cfg.tile_n) * request.nheads_k * batch
        else:
            batch, seqlen_q = q.shape[:2]
            self.stats_batch, self.rows = batch, ceil_div(seqlen_q, tile_m) * tile_m
            self.num_kv_tiles = ceil_div(k.shape[1], cfg.tile_n) * request.nheads_k * batch
        # rowsum(dO * O) over Dv; dq_accum has q's head dim
        self.preprocess = get_bwd_preprocess_runner(request.headdim_v, cfg.dtype, cfg.arch, varlen=self.packed,
                                                    headdim_q=self.headdim)
        # the dQ tiles' order: row-major, accumulator order (sm90: per-warpgroup halves with
        # dq_handoff_per_wg), or the sm80 dQ MMA's register order (dq_coalesced)
        self.postprocess = get_bwd_postprocess_runner(self.headdim, cfg.dtype, cfg.arch, varlen=self.packed,
                                                      wide_stores=postprocess_wide_stores(),
                                                      **dq_postprocess_kwargs(cfg))
        # the main kernel: cfg, or (sm100 hd256) its passes in sequence, each writing its part (dV; dK and dQ)
        self.run_kernels = tuple(get_bwd_runner(c) for c in (plan.passes or (cfg,)))
        self.window, self.softcap = request.mask.window, request.score.softcap
        self.softmax_scale = request.score.softmax_scale
        self.dpsum_scaled = getattr(cfg, "dpsum_scaled", False)  # sm90 speed candidate (off)
        self.bound = None  # launch(): the host scalars of a dense signature, from its first launch

    def launch(self, q, k, v, seq: SeqSpec | None, dout, out, lse, lse_split, dlse, dq, dk, dv, delta=None) -> None:
        """The per-call work of launch() with this plan, for tensors of the signature it was made
        for (seq: the packed request's SeqSpec, None dense). A dense plan keeps, from its first
        launch, the compiled kernels' host scalars (`bound`: the runners' tail(), checked then), so a
        kept plan (PreparedBackward) calls the compiled kernels directly."""
        if self.gated:  # the verdict may change (flash4.selftest)
            from flash4 import selftest

            for cfg in self.gated:
                selftest.require(cfg, q.device)
        cfg, tile_m, nheads, packed = self.cfg, self.cfg.tile_m, self.nheads, self.packed
        bound = self.bound
        if bound is not None:  # a dense signature seen before: what its first launch decided
            ready, dq_ready = bound[3], bound[4]
            row_index, sequences = None, _NO_SEQUENCES
            if ready is not True:  # the tensors a kernel cannot read as they are (the key fixes which)
                q, k, v, out, dout = (t if r else t.contiguous() for t, r in zip((q, k, v, out, dout), ready))
            dk_view, dv_view = dk, dv
        elif packed:
            row_index = padded_row_index(seq.cu_seqlens_q, q.shape[0], tile_m, seq.seqused_q)
            sequences = dict(cu_seqlens_q=_int32_vector(seq.cu_seqlens_q), cu_seqlens_k=_int32_vector(seq.cu_seqlens_k),
                             seqused_q=_int32_vector(seq.seqused_q), seqused_k=_int32_vector(seq.seqused_k),
                             max_seqlen_k=seq.max_seqlen_k)
            q, k, v, out, dout = (_kernel_ready(t)[None] for t in (q, k, v, out, dout))  # a batch mode of size 1
            dk_view, dv_view = dk[None], dv[None]
        else:
            row_index, sequences = None, _NO_SEQUENCES
            ready = tuple(_is_kernel_ready(t) for t in (q, k, v, out, dout))
            q, k, v, out, dout = (t if r else t.contiguous() for t, r in zip((q, k, v, out, dout), ready))
            ready = True if all(ready) else ready
            dk_view, dv_view = dk, dv
        if lse_split is None:
            lse_split = torch.stack([torch.where(lse == float("-inf"), float("inf"), lse * LOG2E),
                                     torch.zeros_like(lse)])
        f32 = dict(dtype=F32, device=q.device)
        stats = (self.stats_batch, nheads, self.rows)
        if packed:  # the padded layout's gaps belong to no packed row: filled here (dpsum 0, lse_log2 +inf)
            zeroed = torch.zeros((2 if self.in_kernel else 1,) + stats, **f32)
            dpsum = zeroed[0]
            delta_rows = zeroed[1] if self.in_kernel else None  # the kernel adds D
            lse_log2 = torch.full(stats, float("inf"), **f32)
        else:  # the preprocess writes every row of both, padding rows included (one allocation, no fill)
            dpsum, lse_log2 = torch.empty((2,) + stats, **f32).unbind(0)
            delta_rows = torch.zeros(stats, **f32) if self.in_kernel else None  # the kernel adds D
        dq_accum = torch.empty(stats + (self.headdim,), **f32)  # zeroed by the preprocess
        # [0]: dQ semaphores (deterministic), [1]: exact-path flags of the (padded) query tiles; one memset.
        tile_flags = torch.zeros(2, self.stats_batch, nheads, self.rows // tile_m, dtype=torch.int32, device=q.device)
        dk_out, dv_out, dkv_sem, finish_dkv = dkv_targets(cfg, dk_view, dv_view, self.num_kv_tiles)
        hi, lo = lse_split.unbind(0)
        if packed:
            hi, lo = hi[None], lo[None]
        if bound is None:
            dq_out = dq_target(dq)
            dq_view = dq_out[None] if packed else dq_out
            bound = (self.preprocess.tail(out, dq_accum, tile_m, row_index),
                     tuple(r.tail(q, k, self.softmax_scale, window=self.window, softcap=self.softcap,
                                  heads_per_cta=self.heads_per_cta, dkv_semaphore=dkv_sem, delta=delta_rows,
                                  **sequences) for r in self.run_kernels),
                     self.postprocess.tail(dq_view, row_index))
            if not packed:  # packed tails read the sequences' values (max_seqlen_k)
                # with whether the tensors were kernel-ready: the signature (shape, strides, base
                # address modulo 16: flash4.memo's key) decides it for every later call
                self.bound = bound + (ready, dq_out is dq)
        else:  # dq: the caller's (PreparedBackward's) new contiguous tensor, ready as the first one was
            dq_out = dq if dq_ready else torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)
            dq_view = dq_out
        pre_tail, main_tails, post_tail = bound[:3]
        self.preprocess.compiled(out, dout, hi, lo, dpsum, lse_log2, tile_flags[1], dq_accum, *pre_tail, row_index)
        if dlse is not None:
            if packed:  # rows outside every sequence all land on the scratch row (never read)
                dpsum[0].index_add_(1, row_index, dlse.to(F32), alpha=-1.0)
            else:
                dpsum[:, :, :q.shape[1]] -= dlse
        if self.dpsum_scaled:  # BwdConfig.dpsum_scaled: the kernel reads D * scale (fp32, as it would compute)
            dpsum.mul_(self.softmax_scale)
        if packed and not cfg.dkv_accum:
            # the kernel writes the rows of every sequence; the others (past cu_seqlens_k[-1] or seqused_k) stay 0
            dk.zero_()
            dv.zero_()
        seq_tensors = (sequences.get("cu_seqlens_q"), sequences.get("cu_seqlens_k"), sequences.get("seqused_q"),
                       sequences.get("seqused_k")) if packed else _NO_SEQUENCE_TENSORS
        for run_kernel, main_tail in zip(self.run_kernels, main_tails):
            run_kernel.compiled(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, tile_flags[0], tile_flags[1],
                                hi, lo, *seq_tensors, dkv_sem if cfg.dkv_accum else None, delta_rows, *main_tail)
        finish_dkv()
        if delta is not None:
            _fill_delta(delta, delta_rows, dout[0] if packed else dout, out[0] if packed else out, packed, row_index)
        # packed row r <- padded row row_index[r]; rows outside every sequence read the scratch tile's zeros
        self.postprocess.compiled(dq_accum, dq_view, *post_tail)
        if dq_out is not dq:
            dq.copy_(dq_out)


_NO_SEQUENCES: dict = {}  # a dense launch's sequence arguments (never written)
_NO_SEQUENCE_TENSORS = (None, None, None, None)


class PreparedBackward:
    """run() of a DENSE request with its plan fixed (flash4.ops.dense_backward keeps one per call
    signature, flash4.memo.dense_backward_key): __call__(q, k, v, dout, out, lse, lse_split, dlse,
    delta) -> (dq, dk, dv), for tensors of the signature it was made with (the empty cases never
    get here: prepare_dense answers None for them). Host work per call: the allocations and the
    launches of BackwardPlan.launch, without the plan (flash4.config.bwd_config), the runner lookups
    or a Request (H200, 2026-12-03: the gpt-oss window-128 backward spent ~800 us of host time per
    call against ~360 us of kernels, docs/perf/README.md)."""

    __slots__ = ("plan",)

    def __init__(self, plan: BackwardPlan):
        self.plan = plan

    def __call__(self, q, k, v, dout, out, lse, lse_split=None, dlse=None, delta=None):
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        with device_guard(q.device):
            self.plan.launch(q, k, v, None, dout, out, lse, lse_split, dlse, dq, dk, dv, delta)
        return dq, dk, dv


def prepare_dense(request: Request, sink_delta: bool) -> PreparedBackward | None:
    """The PreparedBackward of a DENSE request with work to do (no query or no key: None, run()
    answers those)."""
    q, k, v = request.q, request.k, request.v
    if request.seq.packed or q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return None
    with device_guard(q.device):
        return PreparedBackward(BackwardPlan(request, sink_delta))


def _fill_delta(delta, delta_rows, dout, out, packed: bool, row_index) -> None:
    """delta (lse's shape: (B, H, Sq), packed (H, total_q)) <- the kernel's per-row D in the padded
    statistics layout (delta_rows; packed rows outside every sequence read the scratch tile's 0), or,
    for a family without sink_delta (delta_rows None), rowsum(dout * out) from the 16-bit out (packed
    rows outside every sequence: whatever out holds there; sink_grad's row mask drops them)."""
    if delta_rows is None:
        delta.copy_((dout.float() * out.float()).sum(-1).transpose(-1, -2))
    elif packed:
        delta.copy_(delta_rows[0].index_select(1, row_index.long()))
    else:
        delta.copy_(delta_rows[:, :, :delta.shape[-1]])


# ================================================================ helpers (CPU-tested)
def padded_total(total_q: int, batch: int, tile_m: int) -> int:
    """Rows of the padded per-sequence statistics layout (see the module docstring)."""
    return (total_q + batch * tile_m) // tile_m * tile_m


def padded_row_index(cu_seqlens_q: torch.Tensor, total_q: int, tile_m: int,
                     seqused_q: torch.Tensor | None = None) -> torch.Tensor:
    """int32 (total_q,): the padded-layout row of every packed query row, on cu_seqlens_q's device,
    without a host sync. Row r of sequence b (cu_seqlens_q[b] <= r < cu_seqlens_q[b + 1]) maps to
    padded_offset(b) + r - cu_seqlens_q[b]; rows outside every sequence (before cu_seqlens_q[0], at
    or past cu_seqlens_q[-1], or at or past seqused_q[b] in sequence b) map to
    padded_total(total_q, batch, tile_m), the scratch tile after the layout (module docstring)."""
    cu = cu_seqlens_q.long()
    device = cu.device
    batch = cu.numel() - 1
    scratch = padded_total(total_q, batch, tile_m)
    rows = torch.arange(total_q, device=device)
    if batch <= 0:
        return torch.full((total_q,), scratch, dtype=torch.int32, device=device)
    # sequence of each row: the number of sequence ends <= row (batch for rows past the last end)
    seq = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
    b = seq.clamp(max=batch - 1)
    start = cu[b]
    pos = rows - start
    valid = (seq < batch) & (pos >= 0)
    if seqused_q is not None:
        valid &= pos < seqused_q.long()[b]
    padded = (start + b * tile_m) // tile_m * tile_m + pos
    return torch.where(valid, padded, torch.full_like(padded, scratch)).to(torch.int32)


def dkv_targets(cfg, dk: torch.Tensor, dv: torch.Tensor, num_kv_tiles: int):
    """Where the backward kernel writes dK, dV: (dk_target, dv_target, semaphore, finish). Without
    cfg.dkv_accum: dk, dv themselves, no semaphore. With it: zeroed fp32 accumulators shaped like
    dk, dv, the deterministic chain's int32 counters (num_kv_tiles = key blocks x Hk x batch; None
    unless cfg.deterministic), and finish() copies the accumulators into dk, dv."""
    if not cfg.dkv_accum:
        return dk, dv, None, lambda: None
    dk_acc = torch.zeros(dk.shape, dtype=F32, device=dk.device)
    dv_acc = torch.zeros(dv.shape, dtype=F32, device=dv.device)
    sem = torch.zeros(num_kv_tiles, dtype=torch.int32, device=dk.device) if cfg.deterministic else None

    def finish():
        dk.copy_(dk_acc)
        dv.copy_(dv_acc)

    return dk_acc, dv_acc, sem, finish


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """Last dim contiguous, other strides multiples of 8 elements, 16-byte aligned base (TMA)."""
    return t if _is_kernel_ready(t) else t.contiguous()


def _is_kernel_ready(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def dq_target(dq: torch.Tensor) -> torch.Tensor:
    """Where the dQ postprocess writes: dq itself when a kernel may write it (_kernel_ready's rules),
    else a contiguous temporary that the caller copies into dq."""
    return dq if _is_kernel_ready(dq) else torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)


def _int32_vector(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read cu_seqlens / seqused as contiguous int32 vectors."""
    if t is None:
        return None
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _resolved(seq: SeqSpec) -> SeqSpec:
    """seq with max_seqlen_q / max_seqlen_k as host ints (given as a 0-d tensor or None: a host sync)."""
    return dataclasses.replace(
        seq, max_seqlen_q=resolve_max_seqlen("max_seqlen_q", seq.max_seqlen_q, seq.cu_seqlens_q, seq.seqused_q),
        max_seqlen_k=resolve_max_seqlen("max_seqlen_k", seq.max_seqlen_k, seq.cu_seqlens_k, seq.seqused_k))

