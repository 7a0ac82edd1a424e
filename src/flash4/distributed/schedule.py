"""The zigzag ring schedule: which query and key chunks each rank computes at each ring step (pure
Python, no torch).

Every sequence of length L (a multiple of 2W for causal, W = world size) is cut into 2W equal
chunks c_0 .. c_{2W-1}; rank r holds chunks (r, 2W-1-r) of every sequence, in that order, as one
local sequence of length L / W (its first half chunk r, its second half chunk 2W-1-r). Queries stay
home; K/V blocks travel round the ring r -> r+1, so at step s rank r holds the K/V of rank
source = (r - s) mod W. With a causal mask (query chunk a sees key chunk b fully when b < a, on
the diagonal when b == a, not at all when b > a):

    step 0        source == r  local q vs local k, causal (the two diagonal chunks and chunk
                                2W-1-r's full view of chunk r)
    source < r    q all, k first half (chunk source), no mask: both query chunks r and 2W-1-r
                  lie after chunk source; chunk 2W-1-source lies after both
    source > r    q second half (chunk 2W-1-r), k all, no mask: chunk r lies before both key
                  chunks; chunk 2W-1-r lies after both (2W-1-r > 2W-1-source and >= W > source)

Each step costs two chunk-by-chunk blocks (step 0: two half-blocks on the diagonal plus one
full block), so every rank does 2W blocks of work per pass: the ring is balanced, which a
contiguous split (rank r holding chunk r only) is not. Without a mask every step is q all vs k all.
"""

from __future__ import annotations

import dataclasses

ALL, FIRST, SECOND = "all", "first", "second"


@dataclasses.dataclass(frozen=True)
class Step:
    """One ring step of one rank: the K/V of rank `source` against this rank's queries.
    q_part: ALL or SECOND (the local queries' second half); k_part: ALL or FIRST (the K/V block's
    first half); causal: the kernel runs with the causal mask (step 0 of a causal pass only)."""

    step: int
    source: int
    q_part: str
    k_part: str
    causal: bool


def chunks(rank: int, world_size: int) -> tuple[int, int]:
    """The two global chunk ids rank `rank` holds (first half, second half of its local sequence)."""
    return rank, 2 * world_size - 1 - rank


def source_rank(rank: int, step: int, world_size: int) -> int:
    """Whose K/V rank `rank` holds at ring step `step` (blocks travel r -> r + 1)."""
    return (rank - step) % world_size


def schedule(rank: int, world_size: int, causal: bool) -> tuple[Step, ...]:
    """The W steps of rank `rank` (module docstring). Raises ValueError for a rank outside
    [0, world_size) or world_size < 1."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size) for world_size {world_size}")
    steps = []
    for s in range(world_size):
        src = source_rank(rank, s, world_size)
        if not causal:
            steps.append(Step(s, src, ALL, ALL, False))
        elif s == 0:
            steps.append(Step(s, src, ALL, ALL, True))
        elif src < rank:
            steps.append(Step(s, src, ALL, FIRST, False))
        else:
            steps.append(Step(s, src, SECOND, ALL, False))
    return tuple(steps)


def chunk_pairs(step: Step, rank: int, world_size: int) -> dict[tuple[int, int], str]:
    """{(query chunk, key chunk): "full" | "diagonal"} that `step` computes: the blocks the kernel
    sees with its mask (a pair a kernel call covers but masks out entirely is not listed)."""
    qc = chunks(rank, world_size)
    kc = chunks(step.source, world_size)
    q_sel = qc if step.q_part == ALL else qc[1:]
    k_sel = kc if step.k_part == ALL else kc[:1]
    pairs = {}
    for i, a in enumerate(q_sel):
        for j, b in enumerate(k_sel):
            if not step.causal:
                pairs[(a, b)] = "full"
                continue
            # causal over the local sequence [chunk first, chunk second] (same q and k layout at step 0):
            # local position of a and b decides (bottom-right alignment, equal lengths)
            qi, kj = q_sel.index(a), k_sel.index(b)
            if kj < qi:
                pairs[(a, b)] = "full"
            elif kj == qi:
                pairs[(a, b)] = "diagonal"
    return pairs


def work(steps, rank: int, world_size: int) -> float:
    """Work of `steps` in chunk-by-chunk blocks (a diagonal block counts 1/2)."""
    return sum(1.0 if kind == "full" else 0.5 for st in steps for kind in chunk_pairs(st, rank, world_size).values())
