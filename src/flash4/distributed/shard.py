"""Zigzag sharding of sequences across the W ranks of a ring: every sequence is cut into 2W equal
chunks and rank r keeps chunks r and 2W-1-r, in that order (flash4.distributed.schedule says why).

    zigzag_rows(cu_seqlens, rank, W)        int64 global rows of rank's shard of packed sequences
    zigzag_cu_seqlens(cu_seqlens, W)        the local cu_seqlens (the same on every rank)
    zigzag_shard(x, rank, W, cu_seqlens)    rank's shard: dense (B, S, ...) along dim 1, or packed
                                            (total, ...) with cu_seqlens
    zigzag_unshard(shards, cu_seqlens)      the inverse, from every rank's shard in rank order
"""

from __future__ import annotations

import torch


def _lengths(cu_seqlens, world_size: int) -> list[int]:
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    bad = [(i, n) for i, n in enumerate(lengths) if n % (2 * world_size)]
    if bad:
        i, n = bad[0]
        raise ValueError(f"zigzag sharding over {world_size} ranks cuts every sequence into {2 * world_size} equal "
                         f"chunks: sequence {i} of cu_seqlens has length {n}, not a multiple of {2 * world_size} "
                         f"(pad the sequences to a multiple of 2 * world_size)")
    return lengths


def zigzag_rows(cu_seqlens, rank: int, world_size: int) -> torch.Tensor:
    """int64 (total // world_size,) global row indices of rank's shard of the packed sequences
    cu_seqlens ((batch + 1,) tensor or list, every length a multiple of 2 * world_size; on the
    tensor's device): per sequence, chunk rank then chunk 2 * world_size - 1 - rank.
    Raises ValueError for a length that is not a multiple of 2 * world_size, or a bad rank."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size) for world_size {world_size}")
    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
    lengths = _lengths(cu_seqlens, world_size)
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    parts = []
    for start, n in zip(cu[:-1], lengths):
        c = n // (2 * world_size)
        for chunk in (rank, 2 * world_size - 1 - rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c, device=device))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def zigzag_cu_seqlens(cu_seqlens, world_size: int) -> torch.Tensor:
    """The local cu_seqlens of every rank's shard: cu_seqlens // world_size as int32 (on the
    tensor's device). Raises ValueError as zigzag_rows."""
    _lengths(cu_seqlens, world_size)
    cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens)
    return (cu // world_size).to(torch.int32)


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, cu_seqlens=None) -> torch.Tensor:
    """Rank's shard of x: dense (cu_seqlens None) x is (batch, seqlen, ...) and the shard
    (batch, seqlen // world_size, ...) = chunks rank and 2W-1-rank of dim 1; packed x is
    (total, ...) with cu_seqlens and the shard is x[zigzag_rows(...)]. Raises ValueError for a
    seqlen / sequence length that is not a multiple of 2 * world_size."""
    if cu_seqlens is None:
        if x.dim() < 2:
            raise ValueError(f"zigzag_shard: a dense x is (batch, seqlen, ...); got shape {tuple(x.shape)}")
        _lengths([0, x.shape[1]], world_size)
        chunks = x.chunk(2 * world_size, dim=1)
        return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=1)
    return x.index_select(0, zigzag_rows(cu_seqlens, rank, world_size).to(x.device))


def zigzag_unshard(shards, cu_seqlens=None) -> torch.Tensor:
    """The full tensor from every rank's shard (a list in rank order, as zigzag_shard made them)."""
    world_size = len(shards)
    if cu_seqlens is None:
        chunks = [None] * (2 * world_size)
        for r, s in enumerate(shards):
            chunks[r], chunks[2 * world_size - 1 - r] = s.chunk(2, dim=1)
        return torch.cat(chunks, dim=1)
    total = sum(s.shape[0] for s in shards)
    out = shards[0].new_empty((total,) + tuple(shards[0].shape[1:]))
    for r, s in enumerate(shards):
        out.index_copy_(0, zigzag_rows(cu_seqlens, r, world_size).to(s.device), s)
    return out
