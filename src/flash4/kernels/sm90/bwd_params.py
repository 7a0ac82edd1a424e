"""Parameter bundles of the Hopper backward (kernels/sm90/bwd.py): what the kernel, its warp roles
and its step take, one argument per bundle instead of forty loose positional parameters.

Each is a NamedTuple: as a @cute.kernel argument the DSL passes its fields in field order (a None
field specializes the kernel away), so the kernel's flattened parameter list (and with it every
constant-bank offset of the compiled code) is the order of the fields below. The sequence layout
and the window are kernels/common/params.SeqParams and MaskParams.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass.cute as cute
from cutlass import Float32, Int32, pipeline


class BwdTensors(NamedTuple):
    """Global tensors in kernel view (FlashAttentionBackwardSm90.__call__ gives the host shapes).
    q, k, v, do, lse_log2, dpsum, dk, dv are TMA views (dk, dv: plain tensors when written without
    TMA: varlen_k's predicated stores, dkv_accum's fp32 adds); the rest are indexed directly."""

    q: cute.Tensor  # (seqlen_q, headdim, nheads, batch)
    k: cute.Tensor  # (seqlen_k, headdim, nheads_k, batch)
    v: cute.Tensor  # (seqlen_k, headdim_v, nheads_k, batch)
    do: cute.Tensor  # (seqlen_q, headdim_v, nheads, batch)
    lse_log2: cute.Tensor  # (seqlen_q_pad, nheads, batch) fp32: LSE * log2 e, +inf on padding
    dpsum: cute.Tensor  # (seqlen_q_pad, nheads, batch) fp32: D = rowsum(dO * O)
    dq_accum: cute.Tensor  # (seqlen_q_pad, headdim, nheads, batch) fp32, zeroed
    dk: cute.Tensor  # (seqlen_k, headdim, nheads_k, batch)
    dv: cute.Tensor  # (seqlen_k, headdim_v, nheads_k, batch)
    dq_sem: cute.Tensor  # (num_m_blocks, nheads, batch) int32: deterministic dQ chain
    exact: cute.Tensor  # (num_m_blocks, nheads, batch) int32: 1 where the tile takes the exact P path
    lse_hi: cute.Tensor  # (seqlen_q, nheads, batch) fp32: LSE * log2 e = hi + lo, unrounded
    lse_lo: cute.Tensor
    # BwdConfig.sink_delta: (seqlen_q_pad, nheads, batch) fp32, zeroed: D = sum_j P dP per query row
    delta: Optional[cute.Tensor] = None


class HeadSplit(NamedTuple):
    """GQA/MQA head split (BwdConfig.dkv_accum): query heads per CTA, and with deterministic the
    per key tile semaphores ordering the CTAs' dK/dV adds (None otherwise)."""

    dkv_sem: Optional[cute.Tensor]  # (n_blocks * nheads_k * batch,) int32, zeroed
    heads_per_cta: Int32


class BwdTmaAtoms(NamedTuple):
    """TMA copy atoms of the BwdTensors of the same names (dk, dv: None without the TMA store)."""

    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom
    do: cute.CopyAtom
    lse_log2: cute.CopyAtom
    dpsum: cute.CopyAtom
    dk: Optional[cute.CopyAtom]
    dv: Optional[cute.CopyAtom]

    def loads(self):
        """The load atoms (their descriptors are prefetched at the kernel's start)."""
        return self.q, self.k, self.v, self.do, self.lse_log2, self.dpsum


class BwdSmemLayouts(NamedTuple):
    """Shared-memory layouts (static), built once in __call__."""

    q: cute.ComposedLayout  # (tile_m, headdim, q_stages)
    k: cute.ComposedLayout  # (tile_n, headdim): K, and dK in the epilogue
    v: cute.ComposedLayout  # (tile_n, headdim_v): V, and dV in the epilogue
    do: cute.ComposedLayout  # (tile_m, headdim_v, do_stages)
    ds: cute.ComposedLayout  # dS^T (P^T) (tile_n, tile_m, 2); transposed_dkv: dS (P) (tile_m, tile_n)
    lse: cute.Layout  # (tile_m, q_stages)
    dq: cute.Layout  # (tile_m, headdim) fp32 staging tile, padded rows


class BwdSmem(NamedTuple):
    """Shared-memory tensors (the kernel's SharedStorage viewed through BwdSmemLayouts)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    ds: cute.Tensor
    p: Optional[cute.Tensor]  # P^T (split_headdim) / P (transposed_dkv); None otherwise
    lse: cute.Tensor  # (tile_m, q_stages) LSE * log2 e of the staged Q tiles
    dpsum: cute.Tensor  # (tile_m, do_stages) D of the staged dO tiles
    dq: cute.Tensor
    # BwdConfig.sink_delta: (tile_m, slots) fp32, the consumer warps' partial sums of D = sum_j P dP
    # (the dQ staging tile's row pad, or a buffer of its own)
    delta: Optional[cute.Tensor] = None


class BwdTiledMmas(NamedTuple):
    """The tiled MMAs (static): S/dP, dK (and dV when Dv == headdim), dV, dQ."""

    sdp: cute.TiledMma
    dkv: cute.TiledMma
    dv: cute.TiledMma
    dq: cute.TiledMma


class BwdPipelines(NamedTuple):
    """TMA producer (warp 0) -> consumer warpgroups."""

    kv: pipeline.PipelineTmaAsync  # 1 stage: K, V
    q: pipeline.PipelineTmaAsync  # q_stages: Q + LSE * log2 e
    do: pipeline.PipelineTmaAsync  # do_stages: dO + D


class ScoreArgs(NamedTuple):
    """The runtime score parameters: the softmax scale and (BwdConfig.softcap) the cap."""

    softmax_scale: Float32
    softcap: Float32


class StepScales(NamedTuple):
    """The step's scales: softmax_scale, and score.device_scales' (scale_log2, softcap_scale,
    inv_scale_log2): P = 2^(score * scale_log2 - LSE_log2); the last two None without softcap."""

    softmax_scale: Float32
    scale_log2: Float32
    softcap_scale: Optional[Float32]
    inv_scale_log2: Optional[Float32]
