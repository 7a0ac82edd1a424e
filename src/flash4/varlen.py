r"""Variable-length (packed) batches and paged KV: host side of the forward and backward.

Layouts (flash-attn's varlen conventions):
    q, out, dout   (total_q, nheads, headdim)       sequence b = rows cu_seqlens_q[b] : cu_seqlens_q[b+1]
    k, v, dk, dv   (total_k, nheads_k, headdim)     sequence b = rows cu_seqlens_k[b] : cu_seqlens_k[b+1]
                   or paged: (num_pages, page_size, nheads_k, headdim) with page_table
                   (batch, max_pages_per_seq) int32 and seqused_k (batch,) int32: key j of
                   sequence b is k[page_table[b, j // page_size], j % page_size]
    lse            (nheads, total_q) float32, natural log
    lse_split      (2, nheads, total_q) float32: the log2-domain LSE unrounded (hi, lo), as the
                   dense path's (flash4.api._flash_attn_forward)
    cu_seqlens_*   (batch + 1,) int32 on q's device, prefix sums starting at 0
    seqused_*      (batch,) int32: only the first seqused[b] queries/keys of sequence b are used
The kernels take these as 4-D/3-D views with a batch mode of size 1 and read each sequence's
offset and length on the device (kernels/common/seqinfo.py), so no call syncs with the host and
changing lengths never recompiles (only max_seqlen_q / max_seqlen_k, host ints, size the grid).

Backward statistics (LSE * log2 e, D = rowsum(dO * O), the fp32 dQ accumulator, the per-tile
flags) live in a padded layout where each sequence starts on a query-tile boundary:
    row of query i of sequence b = padded_offset(b) + i,
    padded_offset(b) = (cu_seqlens_q[b] + b * tile_m) // tile_m * tile_m,
    padded_total = (total_q + batch * tile_m) // tile_m * tile_m rows in all,
so sequence b's query tile m is padded tile padded_offset(b) / tile_m + m (its dQ semaphore and
exact flag). The backward allocates one more tile, the scratch tile at row padded_total: packed
rows outside every sequence (at or past cu_seqlens_q[-1], or past seqused_q[b]) map there
(padded_row_index), so the preprocess and the dlse scatter need no branch and the gather of dQ
reads zeros for them (the preprocess zeroes that tile's rows; no kernel adds to it).

varlen_backward (tile_m = the backward config's query tile, flash4.config.select_bwd_config):
    preprocess (kernels/common/bwd_preprocess.py, varlen mode): dpsum = rowsum(dO * O), lse_log2 and the
        exact-path flags, scattered to the padded rows, and those rows of the fp32 dQ accumulator
        zeroed (the scratch tile's too); padding stays dpsum 0, lse_log2 +inf
    dpsum -= dlse (scattered likewise), when the LSE has a gradient
    main kernel (kernels/sm90/bwd.py with cu_seqlens / seqused): grid (n_block, kv_head,
        sequence) with ceil(max_seqlen_k / tile_n) n_blocks; writes dK, dV rows < seqlen_k of each
        sequence, reduce-adds dQ into the padded fp32 accumulator
    dq = the accumulator gathered back to packed rows (padded_row_index), in the input dtype (the
        dQ postprocess, kernels/common/bwd_preprocess.py)
dK, dV rows outside every sequence are zeroed before the launch (one memset: without a host sync
the host cannot tell whether any exist).
"""

from __future__ import annotations

import torch

from flash4.geometry import window_sides


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


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, softmax_scale: float, causal: bool,
                   seqused_q=None, seqused_k=None, page_table=None, out=None, lse=None, lse_split=None,
                   window_size=None, softcap: float = 0.0, learnable_sink=None):
    """Forward on validated varlen/paged inputs; returns (out, lse). Layouts: module docstring.

    cu_seqlens_k is None when paged (page_table given; seqused_k then required). max_seqlen_q: a
    host int >= every sequence's query count (sizes the grid). out/lse/lse_split: None or
    preallocated tensors of the documented shapes that the kernel overwrites (tests pass NaN-filled
    ones). Rows that see no key give out = 0, lse = -inf (lse_split +inf, 0); query rows outside
    every sequence (past cu_seqlens_q[-1] or seqused_q) are not written (when flash4 allocates
    out/lse and seqused_q is given, they start as 0 / -inf).
    """
    from flash4.arch import device_arch
    from flash4.config import paged_page_rows, select_fwd_config, with_seq_layout
    from flash4.validate import DTYPE_NAMES

    total_q, nheads, headdim = q.shape
    headdim_v = v.shape[-1]
    batch = cu_seqlens_q.numel() - 1
    paged = page_table is not None
    if paged and seqused_k is None:
        raise ValueError("paged K/V (page_table given) needs seqused_k, the key count of every sequence")
    if not paged and cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is required unless page_table is given")
    if out is None:
        out = (torch.zeros if seqused_q is not None else torch.empty)((total_q, nheads, headdim_v), dtype=q.dtype,
                                                                      device=q.device)
    if lse is None:
        lse = (torch.full((nheads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
               if seqused_q is not None else torch.empty(nheads, total_q, dtype=torch.float32, device=q.device))
    if batch <= 0 or total_q == 0 or max_seqlen_q <= 0:
        return out, lse
    window = window_sides(window_size, causal)
    cfg = select_fwd_config(headdim, DTYPE_NAMES[q.dtype], causal, arch=device_arch(q.device), local=window is not None,
                            softcap=softcap > 0, sink=learnable_sink is not None,
                            **({} if headdim_v == headdim else {"headdim_v": headdim_v}))
    page_rows = paged_page_rows(k.shape[1], cfg.tile_n) if paged else 0
    cfg = with_seq_layout(cfg, varlen_q=True, varlen_k=not paged, seqused_q=seqused_q is not None,
                          seqused_k=seqused_k is not None, page_rows=page_rows)
    from flash4.compile.cache import get_fwd_runner  # late: compiling pulls in the CuTe DSL

    run = get_fwd_runner(cfg)
    if lse_split is None:
        lse_split = torch.empty(2, nheads, total_q, dtype=torch.float32, device=q.device)
    if paged:
        k4, v4 = k, v
        page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    else:
        k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    seqs = tuple(None if t is None else (t if t.is_contiguous() else t.contiguous())
                 for t in (cu_seqlens_q, cu_seqlens_k if not paged else None, seqused_q, seqused_k)) + (page_table,)
    with torch.cuda.device(q.device):
        run(q.unsqueeze(0), k4, v4, out.unsqueeze(0), lse.unsqueeze(0), softmax_scale, lse_split.unsqueeze(1),
            seqs=seqs, batch=batch, max_seqlen_q=int(max_seqlen_q), window=window, softcap=softcap,
            sink=None if learnable_sink is None else learnable_sink.float().contiguous())
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    softmax_scale: float, causal: bool, seqused_q=None, seqused_k=None, deterministic: bool = False,
                    lse_split=None, dlse=None, dq=None, dk=None, dv=None, window_size=None,
                    softcap: float = 0.0):
    """Gradients (dq, dk, dv) of varlen_forward for the upstream gradient dout (not paged).

    Shapes as the module docstring; dlse: None or (nheads, total_q) (the LSE's gradient, as
    flash4.backward). dq/dk/dv: None or preallocated tensors like q/k/v, overwritten; rows outside
    every sequence get 0. max_seqlen_k: a host int >= every sequence's key count (seqused_k when
    given, else the cu_seqlens_k difference); it sizes the grid, and key blocks past it would be
    skipped. max_seqlen_q only detects the empty case (the kernel walks each sequence's own query
    tiles). lse_split: None or the forward's (2, nheads, total_q) log2 LSE split (exact P at any
    score magnitude, flash4.backward); without it the split is taken from the rounded lse.
    Rows of q / dout outside every sequence may hold any finite values (a key tile loads query
    rows past a sequence's end; their P is 0, as in flash-attn); out / lse there are not read.
    No host sync. Raises ValueError as flash4.backward (head dim, grid limits).
    """
    from flash4.arch import device_arch
    from flash4.backward import _kernel_ready, dq_target
    from flash4.config import LOG2E, select_bwd_config, with_seq_layout
    from flash4.validate import DTYPE_NAMES

    total_q, nheads, headdim = q.shape
    headdim_v = v.shape[-1]
    total_k = k.shape[0]
    batch = cu_seqlens_q.shape[0] - 1
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if total_q == 0 or total_k == 0 or batch <= 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0:
        for g in (dq, dk, dv):
            g.zero_()
        return dq, dk, dv  # no query or no key in any sequence: every gradient is 0
    window = window_sides(window_size, causal)
    cfg = select_bwd_config(headdim, DTYPE_NAMES[q.dtype], causal, arch=device_arch(q.device),
                            deterministic=deterministic, local=window is not None, softcap=softcap > 0,
                            **({} if headdim_v == headdim else {"headdim_v": headdim_v}))
    cfg = with_seq_layout(cfg, varlen_q=True, varlen_k=True, seqused_q=seqused_q is not None,
                          seqused_k=seqused_k is not None)
    from flash4.backward import dkv_targets, head_split_config

    cfg, heads_per_cta = head_split_config(cfg, nheads, k.shape[1], max_seqlen_q, max_seqlen_k, causal, window)
    tile_m = cfg.tile_m
    # the padded layout plus its scratch tile
    rows = padded_total(total_q, batch, tile_m) + tile_m
    row_index = padded_row_index(cu_seqlens_q, total_q, tile_m, seqused_q)
    cu_q, cu_k = (_int32_vector(t) for t in (cu_seqlens_q, cu_seqlens_k))
    used_q, used_k = (None if t is None else _int32_vector(t) for t in (seqused_q, seqused_k))
    dout = _kernel_ready(dout)
    if lse_split is None:
        lse_split = torch.stack([torch.where(lse == float("-inf"), float("inf"), lse * LOG2E), torch.zeros_like(lse)])
    f32 = dict(dtype=torch.float32, device=q.device)
    dpsum = torch.zeros(1, nheads, rows, **f32)
    lse_log2 = torch.full((1, nheads, rows), float("inf"), **f32)
    dq_accum = torch.empty(1, nheads, rows, headdim, **f32)  # the rows of row_index zeroed by the preprocess
    # [0]: dQ semaphores (deterministic), [1]: exact-path flags of the padded query tiles; one memset.
    tile_flags = torch.zeros(2, 1, nheads, rows // tile_m, dtype=torch.int32, device=q.device)

    from flash4.compile.cache import get_bwd_postprocess_runner, get_bwd_preprocess_runner, get_bwd_runner  # late

    num_kv_tiles = -(-max_seqlen_k // cfg.tile_n) * k.shape[1] * batch
    dk_out, dv_out, dkv_sem, finish_dkv = dkv_targets(cfg, dk, dv, num_kv_tiles)
    preprocess = get_bwd_preprocess_runner(headdim_v, cfg.dtype, cfg.arch, varlen=True, headdim_q=headdim)
    postprocess = get_bwd_postprocess_runner(headdim, cfg.dtype, cfg.arch, varlen=True)
    run = get_bwd_runner(cfg)
    with torch.cuda.device(q.device):
        preprocess(_kernel_ready(out)[None], dout[None], lse_split[0][None], lse_split[1][None], dpsum, lse_log2,
                   tile_flags[1], dq_accum, tile_m, row_index)
        if dlse is not None:
            # rows outside every sequence all land on the scratch row (never read)
            dpsum[0].index_add_(1, row_index, dlse.to(torch.float32), alpha=-1.0)
        # the kernel writes the rows of every sequence; the others (past cu_seqlens_k[-1] or seqused_k) stay 0
        if not cfg.dkv_accum:
            dk.zero_()
            dv.zero_()
        run(_kernel_ready(q)[None], _kernel_ready(k)[None], _kernel_ready(v)[None], dout[None], lse_log2, dpsum,
            dq_accum, dk_out[None], dv_out[None], tile_flags[0], tile_flags[1], lse_split[0][None],
            lse_split[1][None], softmax_scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
            seqused_k=used_k, max_seqlen_k=max_seqlen_k, window=window, softcap=softcap,
            heads_per_cta=heads_per_cta, dkv_semaphore=dkv_sem)
        finish_dkv()
        # packed row r <- padded row row_index[r]; rows outside every sequence read the scratch tile's zeros
        dq_out = dq_target(dq)
        postprocess(dq_accum, dq_out[None], row_index)
    if dq_out is not dq:
        dq.copy_(dq_out)
    return dq, dk, dv


def _int32_vector(t: torch.Tensor) -> torch.Tensor:
    """The kernels read cu_seqlens / seqused as contiguous int32 vectors."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
