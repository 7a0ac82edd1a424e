r"""Backward pass host side: preprocess -> main kernel -> postprocess.

    dpsum    = rowsum(dO * O)                      fp32 (B, H, Sq_pad), 0 on padding rows  \ CuTe DSL
    lse_log2 = LSE * log2(e) = fp32(hi + lo)       fp32 (B, H, Sq_pad), +inf where LSE = -inf  | kernels/
               or padding (so P = 2^(S*c - lse_log2) = 0 there)                            | bwd_preprocess.py
    exact    = 1 for query tiles with |lse_log2| >= BWD_EXACT_LSE_LOG2: the main kernel     /
               computes P there from hi, lo unrounded (exact at any magnitude, issue 8)
    dq_accum = 0                                   fp32 (B, H, Sq_pad, D), the kernel reduce-adds dQ
                                                   (zeroed by the preprocess, every row)
    dq       = dq_accum                            converted to the input dtype, (B, Sq, H, D) (the
                                                   kernel's dS already carries softmax_scale; the
                                                   postprocess in kernels/common/bwd_preprocess.py)
Sq_pad rounds seqlen_q up to the kernel's query tile so every TMA box stays in bounds.
"""

from __future__ import annotations

import torch

from flash4.arch import device_arch
from flash4 import env
from flash4.config import (LOG2E, bwd_heads_per_cta, ceil_div, mean_queries_per_key, select_bwd_config,
                           with_dkv_accum)
from flash4.geometry import window_sides
from flash4.validate import DTYPE_NAMES


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """Last dim contiguous, other strides multiples of 8 elements, 16-byte aligned base (TMA)."""
    return t if _is_kernel_ready(t) else t.contiguous()


def _is_kernel_ready(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def dq_target(dq: torch.Tensor) -> torch.Tensor:
    """Where the dQ postprocess writes: dq itself when a kernel may write it (_kernel_ready's rules),
    else a contiguous temporary that the caller copies into dq."""
    return dq if _is_kernel_ready(dq) else torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)


def head_split_config(cfg, nheads: int, nheads_k: int, seqlen_q: int, seqlen_k: int, causal: bool, window):
    """(cfg, heads_per_cta) of the GQA/MQA head split (BwdConfig.dkv_accum, chosen by
    flash4.config.bwd_heads_per_cta from the mean visible queries per key, or FLASH4_BWD_HEADS_PER_CTA).
    seqlen_q, seqlen_k: the (max) sequence lengths; window: flash4.geometry.window_sides' or None.
    Apply it before anything is sized by cfg.tile_m: the split may change the query tile."""
    queries = mean_queries_per_key(seqlen_q, seqlen_k, causal, window)
    heads_per_cta = bwd_heads_per_cta(nheads, nheads_k, env.bwd_heads_per_cta_override(), queries)
    return with_dkv_accum(cfg, nheads, nheads_k, heads_per_cta), heads_per_cta


def dkv_targets(cfg, dk: torch.Tensor, dv: torch.Tensor, num_kv_tiles: int):
    """Where the backward kernel writes dK, dV: (dk_target, dv_target, semaphore, finish). Without
    cfg.dkv_accum: dk, dv themselves, no semaphore. With it: zeroed fp32 accumulators shaped like
    dk, dv, the deterministic chain's int32 counters (num_kv_tiles = key blocks x Hk x batch; None
    unless cfg.deterministic), and finish() copies the accumulators into dk, dv."""
    if not cfg.dkv_accum:
        return dk, dv, None, lambda: None
    dk_acc = torch.zeros(dk.shape, dtype=torch.float32, device=dk.device)
    dv_acc = torch.zeros(dv.shape, dtype=torch.float32, device=dv.device)
    sem = torch.zeros(num_kv_tiles, dtype=torch.int32, device=dk.device) if cfg.deterministic else None

    def finish():
        dk.copy_(dk_acc)
        dv.copy_(dv_acc)

    return dk_acc, dv_acc, sem, finish


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, dq=None, dk=None, dv=None,
                        deterministic: bool = False, lse_split=None, dlse=None, window_size=None, softcap: float = 0.0):
    """Gradients of out = attention(q, k, v) for the upstream gradient dout.

    q: (B, Sq, H, D); k: (B, Sk, Hk, D); v: (B, Sk, Hk, Dv); out, dout: (B, Sq, H, Dv) (Dv = D, or a
    flash4.config.HDIMV_PAIRS head dim); lse: fp32 (B, H, Sq) from the forward.
    lse_split: None, or the forward's fp32 (2, B, H, Sq) log2-domain LSE split (lse * log2 e =
    lse_split[0] + lse_split[1], flash4.api._flash_attn_forward): with it P is exact at the row max
    for any finite score magnitude; without it the split is taken from the rounded lse (exact
    while |lse| stays below ~2^9, where an ulp of lse is below 2^-14).
    dq, dk, dv: None, or preallocated contiguous tensors like q, k, v that are overwritten (tests
    pass NaN-filled ones to catch unwritten elements).
    dlse: None, or the gradient of the loss w.r.t. lse, (B, H, Sq): dS = P * (dP - D) gains
    P * dLSE (d LSE_i / d S_ij = P_ij), applied as D - dLSE (rows with LSE = -inf have P = 0).
    deterministic: add the dQ partial sums of the key blocks in a fixed order (bitwise-identical
    results across calls); dK and dV are reduced in registers, or (GQA/MQA head split: several
    CTAs per KV head) added in fp32 in head-split order.
    Returns (dq, dk, dv) shaped like q, k, v in their dtype. Raises ValueError for a head dim the
    backward kernel does not support (flash4.config.BWD_SUPPORTED_HEADDIMS) or a problem beyond the
    kernels' grid/int32 limits (flash4.launch).
    """
    batch, seqlen_q, nheads, headdim = q.shape
    headdim_v = v.shape[-1]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if dq.numel() == 0 or dk.numel() == 0:
        for g in (dq, dk, dv):
            g.zero_()
        return dq, dk, dv  # no query or no key: every gradient is 0 (or empty)
    window = window_sides(window_size, causal)
    cfg = select_bwd_config(headdim, DTYPE_NAMES[q.dtype], causal, arch=device_arch(q.device),
                            deterministic=deterministic, local=window is not None, softcap=softcap > 0,
                            **({} if headdim_v == headdim else {"headdim_v": headdim_v}))
    cfg, heads_per_cta = head_split_config(cfg, nheads, k.shape[2], seqlen_q, k.shape[1], causal, window)
    num_m_blocks = ceil_div(seqlen_q, cfg.tile_m)
    seqlen_q_pad = num_m_blocks * cfg.tile_m
    dout = _kernel_ready(dout)
    if lse_split is None:
        lse_split = torch.stack([torch.where(lse == float("-inf"), float("inf"), lse * LOG2E), torch.zeros_like(lse)])
    f32 = dict(dtype=torch.float32, device=q.device)
    dpsum = torch.zeros(batch, nheads, seqlen_q_pad, **f32)
    lse_log2 = torch.full((batch, nheads, seqlen_q_pad), float("inf"), **f32)
    dq_accum = torch.empty(batch, nheads, seqlen_q_pad, headdim, **f32)  # zeroed by the preprocess
    # [0]: dQ semaphores (deterministic), [1]: exact-path flags of the query tiles; one memset.
    tile_flags = torch.zeros(2, batch, nheads, num_m_blocks, dtype=torch.int32, device=q.device)

    from flash4.compile.cache import get_bwd_postprocess_runner, get_bwd_preprocess_runner, get_bwd_runner  # late

    num_kv_tiles = ceil_div(k.shape[1], cfg.tile_n) * k.shape[2] * batch
    dk_out, dv_out, dkv_sem, finish_dkv = dkv_targets(cfg, dk, dv, num_kv_tiles)
    preprocess = get_bwd_preprocess_runner(headdim_v, cfg.dtype, cfg.arch, headdim_q=headdim)  # rowsum(dO * O) over Dv
    postprocess = get_bwd_postprocess_runner(headdim, cfg.dtype, cfg.arch,
                                             accum_tile_m=cfg.tile_m if cfg.dq_accum_order else None)
    run = get_bwd_runner(cfg)
    with torch.cuda.device(q.device):
        preprocess(_kernel_ready(out), dout, lse_split[0], lse_split[1], dpsum, lse_log2, tile_flags[1], dq_accum,
                   cfg.tile_m)
        if dlse is not None:
            dpsum[:, :, :seqlen_q] -= dlse
        run(_kernel_ready(q), _kernel_ready(k), _kernel_ready(v), dout, lse_log2, dpsum, dq_accum, dk_out, dv_out,
            tile_flags[0], tile_flags[1], lse_split[0], lse_split[1], softmax_scale, window=window,
            softcap=softcap, heads_per_cta=heads_per_cta, dkv_semaphore=dkv_sem)
        finish_dkv()
        dq_out = dq_target(dq)
        postprocess(dq_accum, dq_out)
    if dq_out is not dq:
        dq.copy_(dq_out)
    return dq, dk, dv
