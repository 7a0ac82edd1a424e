"""Forward tile scheduler on the device: tile index -> (m_block, head, batch).

The same closed form as `flash4.schedule.tile_coords` (the CPU-tested model): (head, batch)
pairs are cut into L2-sized sections; inside a section m_block is the outer loop (descending
for causal LPT), pairs the inner one. A CTA starts at tile blockIdx.x and steps by gridDim.x:
with grid = number of tiles every CTA takes one tile (the plain launch); with grid = number of
SMs the kernel is persistent.
"""

import cutlass
from cutlass import Int32

from flash4.kernels.common.dsl import DynamicState


def tile_coords(t: Int32, num_m_blocks: Int32, num_heads: Int32, num_hb: Int32, group: Int32,
                descending: bool):
    """(m_block, head, batch) of tile t. `group` (pairs per L2 section) is at least 1 and at
    most num_hb; the last section may be shorter. `descending` (static): LPT order."""
    section_tiles = group * num_m_blocks
    section = t // section_tiles
    r = t - section * section_tiles
    full_sections = num_hb // group
    size = cutlass.select_(section < full_sections, group, num_hb - full_sections * group)
    size = Int32(size)
    m_idx = r // size
    hb = section * group + (r - m_idx * size)
    batch = hb // num_heads
    head = hb - batch * num_heads
    m_block = num_m_blocks - 1 - m_idx if descending else m_idx
    return m_block, head, batch


def tile_coords_flat(t: Int32, num_m_blocks: Int32, num_heads: Int32):
    """tile_coords with one (head, batch) pair per section and ascending m_blocks (the order without
    LPT, whose l2_group the host always passes as 1): m_block fastest, then head, then batch. The
    same tiles in the same order from two integer divisions instead of four (FwdConfig.flat_tile_order)."""
    hb = t // num_m_blocks
    m_block = t - hb * num_m_blocks
    batch = hb // num_heads
    head = hb - batch * num_heads
    return m_block, head, batch


class TileSchedule(DynamicState):
    """The tile-order parameters (device Int32 values); read-only, carried through loops.
    flat (static): the order without sections (tile_coords_flat; only where l2_group is 1 and the
    order ascending)."""

    _dynamic_fields = ("num_m_blocks", "num_heads", "num_hb", "group")

    def __init__(self, num_m_blocks: Int32, num_heads: Int32, num_hb: Int32, l2_group: Int32, descending: bool,
                 flat: bool = False):
        assert not (flat and descending), "the flat order is the non-LPT one"
        self.num_m_blocks = num_m_blocks
        self.num_heads = num_heads
        self.num_hb = num_hb
        self.group = cutlass.max(cutlass.min(l2_group, num_hb), 1)
        self.descending = descending
        self.flat = flat

    def num_tiles(self) -> Int32:
        return self.num_m_blocks * self.num_hb

    def coords(self, t: Int32):
        if self.flat:
            return tile_coords_flat(t, self.num_m_blocks, self.num_heads)
        return tile_coords(t, self.num_m_blocks, self.num_heads, self.num_hb, self.group, self.descending)
