r"""The host forward: every layout, from a flash4.request.Request to out and lse.

    run(request, out=None, lse=None, lse_split=None) -> (out, lse)

Layouts (flash4.request; flash-attn's conventions):
    DENSE    q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv)   out (B, Sq, H, Dv), lse (B, H, Sq)
    VARLEN   q (total_q, H, D), k / v (total_k, Hk, D|Dv)         out (total_q, H, Dv), lse (H, total_q)
             sequence b = rows cu_seqlens_q[b] : cu_seqlens_q[b+1] (and cu_seqlens_k); seqused_* (batch,)
             int32: only the first seqused[b] queries / keys of sequence b are used
    PAGED    as VARLEN with k / v (num_pages, page_size, Hk, D) and page_table (batch, max_pages) int32:
             key j of sequence b is k[page_table[b, j // page_size], j % page_size], j < seqused_k[b]
    KVCACHE  q (B, Sq, H, D) over a dense (B_cache, S_cache, Hk, D) or paged cache: k_new / v_new are
             appended in place at cache_seqlens[b] (index_put_, no host sync), then the attention runs
             as DECODE (seqused_k = cache_seqlens + seqlen_new keys of each cache row or page-table
             row) or, with cache_batch_idx, as VARLEN over the dense cache seen as packed rows
    lse_split  None or (2,) + lse's shape, fp32: the log2-domain LSE unrounded, lse * log2(e) =
             lse_split[0] + lse_split[1] (+inf, 0 for rows that see no key); flash4.backward's exact path.

run() allocates (or checks) out / lse, answers the problems without work (no query row: nothing
runs; no key: out = 0, lse = -inf, or the sink with learnable_sink) and calls launch() on the
tensors' device. launch() is the one place a request becomes kernel launches: the plan from
flash4.config.fwd_config (the family's tiles, GQA packing, page pieces, split-KV), the compiled
runners from flash4.compile.cache, the kernel arguments unpacked from the request. A config of a
self-test-gated family (sm_100; the portable family on sm_80/86/89/120) launches only once
flash4.selftest passed it on this GPU
(`selftest.require`: RuntimeError naming the config and how to report it otherwise; a no-op field
compare for the other families). The packed
layouts hand the kernels 4-D views with a batch mode of size 1; each sequence's offset and length
are read on the device (kernels/common/seqinfo.py), so no call syncs with the host and changing
lengths never recompiles (only max_seqlen_q, a host int, sizes the grid). A DECODE step packs the
query heads of a KV head into one tile's rows (q copied into (B, Sq * pack, Hk, D)) and splits the
keys over num_splits CTAs whose partial results the combine kernel merges (flash4.config.sm90's
decode notes). The CPU tests replace launch() by the reference (tests/cpu/conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from flash4.arch import device_arch, num_sms
from flash4 import env
from flash4.config import MAX_SPLITS, decode_door, fwd_config
from flash4.request import DECODE, KVCACHE, VARLEN, CacheSpec, Request, SeqSpec
from flash4.validate import layout_problem, packed_rows_per_batch, resolve_max_seqlen

F32 = torch.float32


def run(request: Request, out=None, lse=None, lse_split=None):
    """(out, lse) of `request` (any layout; the module docstring gives the shapes). out / lse /
    lse_split: None, or preallocated tensors of those shapes (q's dtype for out, fp32 contiguous
    for lse and lse_split; out's last dim contiguous and 16-byte aligned) that the kernels
    overwrite (tests pass NaN-filled ones to catch unwritten elements). Packed layouts: query rows
    outside every sequence are not written (out / lse allocated here start as 0 / -inf when
    seqused_q is given). KVCACHE: out as flash_attn_with_kvcache's (no lse_split).
    Raises ValueError for a preallocated buffer of the wrong shape, dtype, device or layout."""
    seq = request.seq
    if seq.layout == KVCACHE:
        return _kvcache(request, out, lse)
    if seq.packed and not isinstance(seq.max_seqlen_q, int):
        request = request.with_seq(_with_max_q(seq))
    given = (out is not None, lse is not None)
    out, lse = _buffers(request, out, lse, lse_split)
    if seq.packed:
        if request.q.shape[0] == 0 or request.batch <= 0 or request.seq.max_seqlen_q == 0:
            return out, lse
        no_key, heads_dim = request.k.numel() == 0, 0
    else:
        if out.numel() == 0:
            return out, lse
        no_key, heads_dim = request.k.shape[1] == 0, 1
    if no_key:
        _no_key(request, out, lse, lse_split, heads_dim)
        return out, lse
    with device_guard(request.q.device):
        if decode_door(request, _door_arch(request.q.device), lse_split is not None):
            _door_decode(request, out, lse, given)
        else:
            launch(request, out, lse, lse_split)
    return out, lse


def new_lse_split(request: Request) -> torch.Tensor:
    """An empty fp32 lse_split for `request` (DENSE (2, B, H, Sq), packed (2, H, total_q))."""
    q = request.q
    shape = (q.shape[1], q.shape[0]) if request.seq.packed else (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty((2,) + shape, dtype=F32, device=q.device)


def launch(request: Request, out, lse, lse_split=None, rows=None) -> None:
    """The kernels of one forward with work to do (run() answered the empty cases and set the
    device): a DENSE, VARLEN, PAGED or DECODE request, out / lse (and lse_split or None) of its
    layout. The request's mask, score and sequence parts are unpacked into kernel arguments here,
    once; the runners' argument lists are flash4.compile.cache's.
    rows: None, or, for a DECODE request of q (B, Sq, H, D) from a varlen door (_packed_decode with
    FLASH4_DECODE_SCATTER), the door's contiguous int32 cu_seqlens_q (B + 1,): out / lse are then the
    varlen (total_q, H, Dv) / (H, total_q) and the step's query slot s of sequence b is written to
    row cu[b+1] - Sq + s when that row is >= cu[b] (decode_slot_rows), nothing else. A split step's
    combine writes those rows itself; an unsplit one runs into step buffers that scatter_rows copies."""
    from flash4 import selftest  # late: `python -m flash4.selftest` must not find it imported by `import flash4`
    from flash4.compile.cache import get_fwd_runner  # late: compiling pulls in the CuTe DSL

    q, k, v, seq = request.q, request.k, request.v, request.seq
    scale, window, softcap = request.score.softmax_scale, request.mask.window, request.score.softcap
    sink = request.score.kernel_sink()
    arch = device_arch(q.device)
    if seq.decode:
        plan = fwd_config(request, arch, num_sms(q.device))
        selftest.require(plan.cfg, q.device)
        if rows is not None and plan.num_splits == 1:  # no combine: the step's buffers, then the scatter
            out_step, lse_step = decode_step_buffers(q, request.headdim_v)
            _launch_decode(request, out_step, lse_step, plan, window, softcap, sink)
            scatter_rows(rows, q.shape[0], q.shape[1], out_step, lse_step, out, lse)
            return
        _launch_decode(request, out, lse, plan, window, softcap, sink, rows)
        return
    cfg = fwd_config(request, arch).cfg
    selftest.require(cfg, q.device)  # gated families (sm100; portable on its own GPUs): only after the self-test passed
    run_kernel = get_fwd_runner(cfg)
    if not seq.packed:
        extra = {} if sink is None else {"sink": sink}  # runners of sink-free configs take no sink
        run_kernel(q, k, v, out, lse, scale, lse_split, window=window, softcap=softcap, **extra)
        return
    if lse_split is None:
        lse_split = new_lse_split(request)
    k4, v4 = (k, v) if seq.paged else (k.unsqueeze(0), v.unsqueeze(0))
    seqs = tuple(_contiguous(t) for t in (seq.cu_seqlens_q, None if seq.paged else seq.cu_seqlens_k, seq.seqused_q,
                                          seq.seqused_k, seq.page_table))
    run_kernel(q.unsqueeze(0), k4, v4, out.unsqueeze(0), lse.unsqueeze(0), scale, lse_split.unsqueeze(1), seqs=seqs,
               batch=request.batch, max_seqlen_q=int(seq.max_seqlen_q), window=window, softcap=softcap, sink=sink)


# ================================================================ buffers and the cases without work
def _buffers(request: Request, out, lse, lse_split):
    """out / lse checked, or allocated: as torch.empty, or, for packed q with seqused_q (rows that
    stay unwritten inside the sequences), as 0 / -inf. lse_split checked when given."""
    q = request.q
    if request.seq.packed:
        out_shape, lse_shape = (q.shape[0], q.shape[1], request.headdim_v), (q.shape[1], q.shape[0])
        fill = request.seq.seqused_q is not None
    else:
        batch, seqlen_q, nheads = q.shape[:3]
        out_shape, lse_shape, fill = (batch, seqlen_q, nheads, request.headdim_v), (batch, nheads, seqlen_q), False
    if out is None:
        out = (torch.zeros if fill else torch.empty)(out_shape, dtype=q.dtype, device=q.device)
    else:
        _check_buffer("out", out, out_shape, q.dtype, q.device)
        problem = layout_problem("out", out)
        if problem is not None:
            raise ValueError(problem)
    for name, buf, shape in (("lse", lse, lse_shape), ("lse_split", lse_split, (2,) + lse_shape)):
        if buf is not None:
            _check_buffer(name, buf, shape, F32, q.device)
            if not buf.is_contiguous():
                raise ValueError(f"{name} must be contiguous; got strides {buf.stride()}")
    if lse is None:
        lse = (torch.full(lse_shape, float("-inf"), dtype=F32, device=q.device) if fill
               else torch.empty(lse_shape, dtype=F32, device=q.device))
    return out, lse


def _check_buffer(name, t, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be {dtype} of shape {shape} on {device}; got {t.dtype} of shape {tuple(t.shape)} on {t.device}"
        )


def _no_key(request: Request, out, lse, lse_split, heads_dim: int) -> None:
    """Rows that see no key: out = 0, lse = -inf (or the sink of the row's head; heads_dim: lse's
    head axis), lse_split = (+inf, 0)."""
    out.zero_()
    sink = request.score.kernel_sink()
    if sink is None:
        lse.fill_(float("-inf"))
    else:
        shape = [1] * lse.dim()
        shape[heads_dim] = -1
        lse.copy_(sink.view(shape).expand_as(lse))
    if lse_split is not None:
        lse_split[0].fill_(float("inf"))
        lse_split[1].zero_()


def _with_max_q(seq: SeqSpec) -> SeqSpec:
    """seq with max_seqlen_q as a host int (given as a 0-d tensor or None: a host sync)."""
    return dataclasses.replace(seq, max_seqlen_q=resolve_max_seqlen("max_seqlen_q", seq.max_seqlen_q, seq.cu_seqlens_q,
                                                                    seq.seqused_q))


def _contiguous(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


_NO_GUARD = contextlib.nullcontext()  # stateless: one instance serves every `with`, nested or not


def device_guard(device: torch.device):
    """Launch on `device` when it is not the current CUDA device (a no-op for other devices)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(device)


# ================================================================ KV cache: append, then attend
def _kvcache(request: Request, out, lse):
    """flash_attn_with_kvcache on a KVCACHE request: append k_new / v_new, then the attention as a
    DECODE request (cache rows 0..batch-1 or the page_table), or, with cache_batch_idx, as a VARLEN
    request over the dense cache's rows (_dense_cache_rows), without splitting."""
    q, k_cache, v_cache, cache, page_table = request.q, request.k, request.v, request.cache, request.seq.page_table
    batch, seqlen_q, nheads, headdim = q.shape
    headdim_v, device, seqlen_new = request.headdim_v, q.device, cache.seqlen_new
    seqlens = cache.cache_seqlens
    if not isinstance(seqlens, torch.Tensor):  # validate's builder gives a tensor; an unchecked request may not
        seqlens = torch.full((batch,), request.capacity if seqlens is None else seqlens, dtype=torch.int32,
                             device=device)
    if out is None:
        out = torch.empty(batch, seqlen_q, nheads, headdim_v, dtype=q.dtype, device=device)
    if lse is None:
        lse = torch.empty(batch, nheads, seqlen_q, dtype=F32, device=device)
    if seqlen_new > 0 and batch > 0:
        _append_kv(k_cache, v_cache, cache.k_new, cache.v_new, seqlens, page_table, cache.cache_batch_idx)
    seqused_k = seqlens + seqlen_new if seqlen_new > 0 else seqlens
    if out.numel() == 0:
        return out, lse
    if k_cache.numel() == 0:  # no key storage: every sequence has 0 keys
        _no_key(request, out, lse, None, 1)
        return out, lse
    if cache.cache_batch_idx is None:
        step = request.with_seq(SeqSpec(DECODE, seqused_k=_contiguous(seqused_k), page_table=page_table))
        with device_guard(device):
            launch(step, out, lse)
        return out, lse
    total_q = batch * seqlen_q
    k_rows, v_rows, cu_seqlens_k = _dense_cache_rows(k_cache, v_cache, batch, cache.cache_batch_idx)
    cu_seqlens_q = torch.arange(0, total_q + 1, seqlen_q, dtype=torch.int32, device=device)
    rows = Request(q.reshape(total_q, nheads, headdim), k_rows, v_rows, request.mask, request.score,
                   SeqSpec(VARLEN, cu_seqlens_q, cu_seqlens_k, seqused_k=seqused_k, max_seqlen_q=seqlen_q))
    lse_packed = torch.empty(nheads, total_q, dtype=F32, device=device)
    run(rows, out=out.view(total_q, nheads, headdim_v), lse=lse_packed)
    lse.copy_(lse_packed.view(nheads, batch, seqlen_q).transpose(0, 1))
    return out, lse


def _append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx) -> None:
    """k/v (batch, seqlen_new, Hk, D) -> cache positions cache_seqlens[b] + t, in place, on the
    device (index_put_: no host sync; out-of-range positions trip a device-side assert)."""
    batch, seqlen_new = k.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)[None]  # (batch, seqlen_new)
    if page_table is not None:
        page_size = k_cache.shape[1]
        index = (page_table.gather(1, pos // page_size).long(), pos % page_size)
    else:
        rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch, device=k.device)
        index = (rows[:, None].expand(batch, seqlen_new), pos)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def _dense_cache_rows(k_cache, v_cache, batch: int, cache_batch_idx):
    """A non-empty dense cache (batch_cache, seqlen_cache, Hk, D) as packed rows (total_rows, Hk, D)
    of stride stride(1) (a view of the same memory) and the (batch + 1,) int32 row offsets of each
    sequence's cache row, cache_batch_idx[b] times the rows per batch entry. The offsets need not
    increase (cache_batch_idx is any selection): with seqused_k given the kernel reads
    cu_seqlens_k[b] as sequence b's offset only (flash4.kernels.common.seqinfo); the last entry is
    total_rows."""
    device = k_cache.device
    rows_per_batch = packed_rows_per_batch(k_cache)
    total_rows = (k_cache.shape[0] - 1) * rows_per_batch + k_cache.shape[1]
    if total_rows >= 2 ** 31:
        raise ValueError(f"the dense cache spans {total_rows} token rows; flash4 addresses at most 2**31 - 1 "
                         f"(use a paged cache)")

    def rows(cache):
        return cache.as_strided((total_rows,) + tuple(cache.shape[2:]), (cache.stride(1),) + cache.stride()[2:])

    cu_seqlens_k = torch.full((batch + 1,), total_rows, dtype=torch.int32, device=device)
    torch.mul(cache_batch_idx, rows_per_batch, out=cu_seqlens_k[:batch])
    return rows(k_cache), rows(v_cache), cu_seqlens_k


# ================================================================ decode steps from the other doors
def _door_arch(device: torch.device) -> int | None:
    """The SM version decode_door reads: the CUDA device's; for CPU tensors (the CPU tests) the
    FLASH4_ARCH override, else None (no decode step)."""
    return device_arch(device) if device.type == "cuda" else env.arch_override()


def _door_decode(request: Request, out, lse, given=(False, False)) -> None:
    """A DENSE or PAGED request that flash4.config.decode_door sends to the decode plan, as one
    DECODE step: dense K/V are a cache whose every row holds seqlen_k keys (seqused_k = seqlen_k,
    a cached device tensor); paged K/V keep their seqused_k and page table, and the packed queries
    are gathered per sequence on the device (_packed_decode). given: whether out / lse are the
    caller's buffers (their rows outside every sequence are then kept)."""
    q, seq = request.q, request.seq
    if not seq.packed:
        seqused_k = _full_seqused(q.shape[0], request.k.shape[1], q.device)
        batch, seqlen_q = q.shape[:2]
        # the decode step writes out as packed (batch * seqlen_q) rows (flash4.validate's kvcache out rule)
        rows_ok = batch == 1 or seqlen_q == 1 or out.stride(0) == seqlen_q * out.stride(1)
        target = out if rows_ok else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        launch(_decode_step(request, q, seqused_k, None), target, lse)
        if target is not out:
            out.copy_(target)
        return
    _packed_decode(request, out, lse, given)


def _decode_step(request: Request, q, seqused_k, page_table) -> Request:
    """The DECODE request of a door's call: q (B, Sq, H, D) over the request's K/V, automatic splits."""
    return Request(q, request.k, request.v, request.mask, request.score,
                   SeqSpec(DECODE, seqused_k=seqused_k, page_table=page_table), _AUTO_SPLITS)


_AUTO_SPLITS = CacheSpec()  # num_splits 0: the decode plan chooses


def _packed_decode(request: Request, out, lse, given=(False, False)) -> None:
    """A PAGED request with max_seqlen_q = Sq <= DECODE_MAX_SEQLEN_Q as a decode step, no host sync.

    Sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 (len_b <= Sq of them,
    any layout: vLLM's arange, padding sequences of length 0 anywhere). The step's q (B, Sq, H, D)
    takes, for sequence b, the Sq rows that END at cu_seqlens_q[b+1]: slot s <- row
    cu_seqlens_q[b+1] - Sq + s (clamped at 0). Right-aligned, so query i of a sequence sits in slot
    Sq - len_b + i, which the decode kernel aligns with key seqused_k[b] - Sq + (Sq - len_b + i) =
    seqused_k[b] - len_b + i: the varlen bottom-right rule (causal, windows). The first Sq - len_b
    slots hold other rows; their results are dropped: out row r of sequence b (the b with
    cu[b] <= r < cu[b+1], a searchsorted) is slot r - cu[b+1] + Sq of b. Rows past cu_seqlens_q[-1]
    (unspecified without seqused_q) get some slot's values in buffers allocated here and keep theirs
    in a caller's (`given`: out, lse; one select each). Extra device work, vLLM's decode (Sq = 1,
    total_q >= batch): a searchsorted and three gathers (q, out, lse); with Sq > 1 a few more
    integer ops on (B, Sq) and (total_q,) indices.
    With FLASH4_DECODE_SCATTER (flash4.env.decode_scatter) and out / lse allocated here, the step
    writes the rows itself (launch's `rows`: a split step's combine kernel writes row cu[b+1] - Sq +
    s of slot s when it is >= cu[b]; rows outside every sequence are then not written: torch.empty's
    contents, as unspecified as before), so only the q gather is left of the above. (The next step:
    the decode kernel reading cu_seqlens_q itself.)"""
    seq = request.seq
    seqused_k, page_table = _contiguous(seq.seqused_k), _contiguous(seq.page_table)
    direct = not any(given) and env.decode_scatter()
    cu = _contiguous(seq.cu_seqlens_q) if direct else seq.cu_seqlens_q

    def step(q_step, out_step, lse_step):
        launch(_decode_step(request, q_step, seqused_k, page_table), out_step, lse_step, rows=cu if direct else None)

    packed_decode_rows(request.q, cu, request.batch, seq.max_seqlen_q, request.headdim_v, out, lse, given, step,
                       direct)


def packed_decode_rows(q, cu, batch: int, seqlen_q: int, headdim_v: int, out, lse, given, step,
                       direct: bool = False) -> None:
    """_packed_decode's device work around its decode step (shared with flash4.memo's prepared
    calls): q (total_q, H, D) packed rows, cu = cu_seqlens_q, out / lse the request's buffers;
    step(q_step, out_step, lse_step) launches the decode step of q_step (B, Sq, H, D). direct: the
    step writes out / lse's rows itself (step(q_step, out, lse): the combine's packed-rows variant,
    flash4.forward.launch's `rows`); else into new step buffers that scatter_rows copies."""
    total_q, nheads, headdim = q.shape
    if seqlen_q == 1 and total_q >= batch:
        # lengths <= 1, so cu[b] <= b < total_q: the row of sequence b (any row when it is empty)
        src = cu[:-1]
    else:
        offsets, _ = _gather_ramps(seqlen_q, total_q, q.device)
        src = torch.add(cu[1:].unsqueeze(1), offsets).clamp_(min=0).view(-1)  # (B * Sq,) int64 rows of q
    q_step = q.index_select(0, src).view(batch, seqlen_q, nheads, headdim)
    if direct:
        step(q_step, out, lse)
        return
    out_step, lse_step = decode_step_buffers(q_step, headdim_v)
    step(q_step, out_step, lse_step)
    scatter_rows(cu, batch, seqlen_q, out_step, lse_step, out, lse, given)


def decode_step_buffers(q_step, headdim_v: int):
    """New (out_step, lse_step) of a decode step of q_step (B, Sq, H, D): (B, Sq, H, Dv), fp32 (B, H, Sq)."""
    batch, seqlen_q, nheads, _ = q_step.shape
    return (torch.empty(batch, seqlen_q, nheads, headdim_v, dtype=q_step.dtype, device=q_step.device),
            torch.empty(batch, nheads, seqlen_q, dtype=F32, device=q_step.device))


def decode_slot_rows(cu: list, seqlen_q: int) -> list:
    """The row map of a varlen door's decode step, in plain Python (the rule the combine kernel's
    packed-rows variant and scatter_rows implement; the CPU tests' reference): for each sequence b
    and query slot s in [0, Sq), the varlen row cu[b+1] - Sq + s it writes, or None when that row is
    below cu[b] (s < Sq - len_b: a slot holding another sequence's query). Every row in [cu[0], cu[-1])
    appears once; no other row appears."""
    return [[r if r >= cu[b] else None for r in range(cu[b + 1] - seqlen_q, cu[b + 1])] for b in range(len(cu) - 1)]


def scatter_rows(cu, batch: int, seqlen_q: int, out_step, lse_step, out, lse, given=(False, False)) -> None:
    """out (total_q, H, Dv) / lse (H, total_q) of a varlen door from its decode step's out_step
    (B, Sq, H, Dv) / lse_step (B, H, Sq): row r of sequence b (cu[b] <= r < cu[b+1]) <- slot
    r - cu[b+1] + Sq of b (decode_slot_rows' map, by a searchsorted and a gather each). Rows past
    cu[-1] are written with some slot's values, except in a caller's buffer (`given`: out, lse),
    which keeps them."""
    total_q, nheads, headdim_v = out.shape
    _, rows = _gather_ramps(seqlen_q, total_q, out.device)
    # the sequence b of row r: #{b' < batch - 1 : cu[b' + 1] <= r}, in [0, batch - 1] (rows past the
    # last sequence count as its rows)
    owner = torch.searchsorted(cu[1:-1], rows, right=True)
    if seqlen_q == 1:
        slot = owner  # a row inside sequence b is its only query
    else:
        slot = torch.sub(rows, cu[1:].index_select(0, owner)).add_(owner, alpha=seqlen_q)
        slot = slot.add_(seqlen_q).clamp_(0, batch * seqlen_q - 1)
    out_rows = out_step.view(batch * seqlen_q, nheads, headdim_v)
    lse_rows = lse_step.view(batch, nheads).t() if seqlen_q == 1 else \
        lse_step.permute(1, 0, 2).reshape(nheads, batch * seqlen_q)
    inside = rows < cu[-1] if any(given) else None  # (total_q,) rows some sequence owns
    if given[0]:
        torch.where(inside[:, None, None], out_rows.index_select(0, slot), out, out=out)
    else:
        torch.index_select(out_rows, 0, slot, out=out)
    if given[1]:
        torch.where(inside, lse_rows.index_select(1, slot), lse, out=lse)
    else:
        torch.index_select(lse_rows, 1, slot, out=lse)


# Small device tensors the door decode steps reuse (read-only): (device, batch, seqlen_k) -> the
# seqused_k of a dense cache; (device, Sq, total_q) -> (slot offsets - Sq, row indices). Not filled
# while a CUDA graph is being captured (a tensor made then belongs to the graph's memory pool).
_DEVICE_CONSTANTS: dict = {}
_MAX_DEVICE_CONSTANTS = 256


def _cached(key, make):
    value = _DEVICE_CONSTANTS.get(key)
    if value is None:
        value = make()
        if not (key[1].type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(_DEVICE_CONSTANTS) >= _MAX_DEVICE_CONSTANTS:
                _DEVICE_CONSTANTS.clear()
            _DEVICE_CONSTANTS[key] = value
    return value


def _full_seqused(batch: int, seqlen_k: int, device) -> torch.Tensor:
    """(batch,) int32 filled with seqlen_k on `device` (cached)."""
    return _cached(("seqused", device, batch, seqlen_k),
                   lambda: torch.full((batch,), seqlen_k, dtype=torch.int32, device=device))


def _gather_ramps(seqlen_q: int, total_q: int, device):
    """(arange(Sq) - Sq as int64, arange(total_q) as int32: searchsorted takes cu_seqlens' dtype)
    on `device` (cached)."""
    return _cached(("ramps", device, seqlen_q, total_q), lambda: (
        torch.arange(-seqlen_q, 0, dtype=torch.int64, device=device),
        torch.arange(total_q, dtype=torch.int32, device=device)))


# ================================================================ decode steps (GQA packing, split-KV)
@functools.lru_cache(maxsize=1024)
def _runners(plan, packed_rows: bool = False):
    """(forward runner, combine runner or None) of a decode plan (compiled once, then a lookup);
    packed_rows: the combine's variant writing a varlen door's rows (launch's `rows`)."""
    from flash4.compile.cache import get_combine_runner, get_fwd_runner  # late: CuTe DSL

    rows = {"packed_rows": True} if packed_rows else {}  # the plain call keeps its one lru_cache key
    if getattr(plan.cfg, "pdl_combine", False):  # sm90 configs only
        rows["pdl"] = True
    if getattr(plan.cfg, "combine_prefetch", False) and plan.num_splits <= MAX_SPLITS:  # its LSE registers' bound
        rows["prefetch"] = True
    combine = (get_combine_runner(plan.cfg.hdim_v, plan.cfg.dtype, plan.cfg.arch, sink=plan.cfg.sink, **rows)
               if plan.num_splits > 1 else None)
    return get_fwd_runner(split_kernel_config(plan.cfg)), combine


def split_kernel_config(cfg):
    """The config the split kernel is compiled from: cfg without FwdConfig.combine_prefetch, which
    chooses the combine only (the same split kernel, one compile and one cache entry)."""
    if getattr(cfg, "combine_prefetch", False):
        return dataclasses.replace(cfg, combine_prefetch=False)
    return cfg


def _packed_sink(sink):
    """Packed GQA rows see kernel head hk for query heads hk * pack + r: one sink per kernel head
    only when every query head of the group has the same sink -- not in general. So a packed,
    unsplit step with a sink is not planned (decode_plan never packs with a sink); kept as a guard."""
    if sink is None:
        return None
    raise AssertionError("a learnable sink with GQA packing needs the split-KV combine (decode_plan avoids it)")


# GQA packing without copies: a decode step with one query per sequence (the common case) hands the
# kernel its packed q (B, pack, Hk, D) as a strided view of q (packed row r of KV head g is query head
# g * pack + r: rows one head stride apart, KV heads pack head strides apart), and, unsplit, its
# packed out / lse as views of out / lse, so no copy kernel runs before or after the step (two to
# three launches and their host time fewer). False: q copied into a packed tensor, out / lse copied
# back from packed buffers (the kernels take any 16-byte aligned strides: compile/fake.py).
PACK_VIEWS = env.pack_views_enabled()  # on unless FLASH4_PACK_VIEWS=0


def head_pack_view(t, size: tuple):
    """A one-token (B, 1, H, D) tensor t seen as size = (B, pack, Hk, D): the pack query heads of
    each KV head as rows (head h = hk * pack + p at row p), a strided view of t's storage."""
    s = t.stride()
    return t.as_strided(size, (s[0], s[2], size[1] * s[2], s[3]), t.storage_offset())


def packed_q(q, nheads_k: int, pack: int):
    """q (B, Sq, H, D) as the packed (B, Sq * pack, Hk, D) rows of a decode step: a view when
    Sq == 1 and PACK_VIEWS, else a copy."""
    batch, seqlen_q, _, headdim = q.shape
    if PACK_VIEWS and seqlen_q == 1:
        return head_pack_view(q, (batch, pack, nheads_k, headdim))
    return q.view(batch, seqlen_q, nheads_k, pack, headdim).transpose(2, 3).reshape(
        batch, seqlen_q * pack, nheads_k, headdim)


def packed_out(out, lse, nheads_k: int, pack: int):
    """(out, lse) of a decode step seen as its packed (B, pack, Hk, Dv) / (B, Hk, pack) rows (views
    the kernel writes directly) when Sq == 1, PACK_VIEWS and lse is contiguous; else None."""
    batch, seqlen_q, _, headdim_v = out.shape
    if not PACK_VIEWS or seqlen_q != 1 or not lse.is_contiguous():
        return None
    return head_pack_view(out, (batch, pack, nheads_k, headdim_v)), lse.view(batch, nheads_k, pack)


def split_out_arg(q_run, out, lse, nheads_k: int, pack: int):
    """The out argument of a packed split-KV launch (never written there: a well-formed (B, Sq * pack,
    Hk, Dv) tensor): out's packed view (Sq == 1, PACK_VIEWS), else q_run (same head dim) or a new
    tensor. lse: unused (kept for the callers' symmetry with packed_out)."""
    batch, seqlen_p, heads_p, headdim = q_run.shape
    if PACK_VIEWS and out.shape[1] == 1:  # packed_out's view of out (lse is not needed here)
        return head_pack_view(out, (batch, pack, nheads_k, out.shape[-1]))
    if out.shape[-1] == headdim:
        return q_run
    return torch.empty(batch, seqlen_p, heads_p, out.shape[-1], dtype=q_run.dtype, device=q_run.device)


def rows_out_arg(q_run, headdim_v: int):
    """The out argument of a split-KV launch whose combine writes a varlen door's rows (never written
    there): q_run (B, Sp, Hp, D) itself when D == Dv, else a new (B, Sp, Hp, Dv) tensor."""
    if q_run.shape[-1] == headdim_v:
        return q_run
    return torch.empty(q_run.shape[:3] + (headdim_v,), dtype=q_run.dtype, device=q_run.device)


def unpack_out(out, lse, out_p, lse_p, nheads_k: int, pack: int) -> None:
    """Copy an unsplit packed step's out_p / lse_p back into out (B, Sq, H, Dv) / lse (B, H, Sq)."""
    batch, seqlen_q, nheads, headdim_v = out.shape
    out.copy_(out_p.view(batch, seqlen_q, pack, nheads_k, headdim_v).transpose(2, 3).reshape(out.shape))
    lse.copy_(lse_p.view(batch, nheads_k, seqlen_q, pack).transpose(2, 3).reshape(batch, nheads, seqlen_q))


def _launch_decode(request: Request, out, lse, plan, window, softcap: float, sink, rows=None) -> None:
    """A DECODE request's kernels: q over the first seqused_k[b] keys of each cache row (or
    page-table row); causal aligns query i with key seqused_k[b] - Sq + i (bottom-right). plan:
    flash4.config.FwdPlan (pack, num_splits, seqlen_p, heads_p). rows: launch's (split plans only):
    out / lse are a varlen door's, which the combine writes by cu_seqlens_q = rows."""
    q, k_cache, v_cache, seq = request.q, request.k, request.v, request.seq
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k, headdim_v = request.nheads_k, request.headdim_v
    scale = request.score.softmax_scale
    run_kernel, combine = _runners(plan) if rows is None else _runners(plan, True)
    pack, seqlen_p, heads_p = plan.pack, plan.seqlen_p, plan.heads_p
    q_run = packed_q(q, nheads_k, pack) if pack > 1 else q
    seqs = (None, None, None, seq.seqused_k, seq.page_table)
    if plan.num_splits > 1:
        o_acc = torch.empty(plan.num_splits, batch, seqlen_p, heads_p, headdim_v, dtype=F32, device=q.device)
        lse_acc = torch.empty(plan.num_splits, batch, heads_p, seqlen_p, dtype=F32, device=q.device)
        # out / lse are not written by a split_kv launch (its partials go to o_acc / lse_acc);
        # it gets them only as well-formed arguments (packed shapes) for the kernel's views.
        if rows is not None:  # out is a varlen door's (total_q, H, Dv): a (B, Sp, Hp, Dv) stand-in
            o_arg = rows_out_arg(q_run, headdim_v)
        else:
            o_arg = out if pack == 1 else split_out_arg(q_run, out, lse, nheads_k, pack)
        run_kernel(q_run, k_cache, v_cache, o_arg, lse_acc[0], scale, lse_split=lse_acc[:2], seqs=seqs, batch=batch,
                   max_seqlen_q=seqlen_p, accs=(o_acc, lse_acc), num_splits=plan.num_splits, window=window,
                   softcap=softcap, sink=sink)
        if rows is not None:
            combine(o_acc, lse_acc, out, lse, pack, sink=sink, cu_seqlens_q=rows)
        else:
            combine(o_acc, lse_acc, out, lse, pack, sink=sink)
    elif pack > 1:
        views = packed_out(out, lse, nheads_k, pack)
        out_p, lse_p = views if views is not None else (
            torch.empty(batch, seqlen_p, heads_p, headdim_v, dtype=q.dtype, device=q.device),
            torch.empty(batch, heads_p, seqlen_p, dtype=F32, device=q.device))
        run_kernel(q_run, k_cache, v_cache, out_p, lse_p, scale, seqs=seqs, batch=batch, max_seqlen_q=seqlen_p,
                   softcap=softcap, sink=_packed_sink(sink))
        if views is None:
            unpack_out(out, lse, out_p, lse_p, nheads_k, pack)
    else:
        run_kernel(q, k_cache, v_cache, out, lse, scale, seqs=seqs, batch=batch, max_seqlen_q=seqlen_q, window=window,
                   softcap=softcap, sink=sink)


# ================================================================ narrow head dims without copies
def narrow_stand_in(q, k, v, softmax_scale: float, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0):
    """The padded call's DENSE request for q, k (B, S, H, D), v (B, Sk, Hk, Dv) of a head dim
    flash4.headdim pads: the same shapes at the padded (D', Dv'), on fresh uninitialized stand-in
    tensors that no kernel reads (launch_narrow plans from their shapes; the API validates them as
    it would the padded copies). softmax_scale: resolved (the caller's D, not D')."""
    from flash4 import headdim as hd

    d_p, dv_p = hd.padded_headdims(q.shape[-1], v.shape[-1], device_arch(q.device))
    return Request.dense(q.new_empty(q.shape[:-1] + (d_p,)), k.new_empty(k.shape[:-1] + (d_p,)),
                         v.new_empty(v.shape[:-1] + (dv_p,)), softmax_scale, causal, window_size, softcap)


def narrow_config(stand_in: Request, headdim: int, headdim_v: int):
    """The config launch_narrow runs for narrow tensors of head dims (headdim, headdim_v) and their
    narrow_stand_in request: the padded call's own plan (flash4.config.fwd_config) with
    tensor_hdims = (headdim, headdim_v); None where that does not apply (not sm_90 or not its
    family's config, a decode step, GQA packing: flash4.config.sm90.tensor_hdims_error)."""
    arch = device_arch(stand_in.q.device)
    if arch != 90 or decode_door(stand_in, arch):
        return None
    cfg = fwd_config(stand_in, arch).cfg
    if not hasattr(cfg, "tensor_hdims"):  # another family forced on this GPU (FLASH4_FAMILY=portable)
        return None
    try:  # FwdConfig.__post_init__ raises tensor_hdims_error's problem
        return dataclasses.replace(cfg, tensor_hdims=(headdim, headdim_v))
    except ValueError:
        return None


def launch_narrow(q, k, v, out, lse, stand_in: Request, cfg=None) -> bool:
    """The dense forward of a head dim flash4.headdim pads (q, k (B, S, H, D), v (B, Sk, Hk, Dv); D / Dv
    not native; last dim contiguous, other strides multiples of 8 elements, 16-byte aligned) on the
    padded kernel straight from the narrow tensors (FwdConfig.tensor_hdims): its TMA loads zero-fill
    the columns past D / Dv and the O store clips them, so no padded copy of q, k, v or out is made.
    out (B, Sq, H, Dv) and lse fp32 (B, H, Sq) are written. stand_in: narrow_stand_in's request; cfg:
    narrow_config's for it (None: computed here): the padded call's plan with tensor_hdims = (D, Dv),
    the same kernel math, the same bits (tests/gpu/test_tensor_hdims.py). Returns False, launching
    nothing, where narrow_config is None, else True. Inputs are not validated here."""
    from flash4.compile.cache import get_fwd_runner  # late: compiling pulls in the CuTe DSL

    if cfg is None:
        cfg = narrow_config(stand_in, q.shape[-1], v.shape[-1])
        if cfg is None:
            return False
    run_kernel = get_fwd_runner(cfg)
    with device_guard(q.device):
        run_kernel(q, k, v, out, lse, stand_in.score.softmax_scale, None, window=stand_in.mask.window,
                   softcap=stand_in.score.softcap)
    return True
