"""The backward's work schedule on the device: one CTA's key tile, its query heads and the m_blocks
it walks (kernels/sm90/bwd.py), the twin of the forward's TileSchedule (kernels/common/scheduler.py).

blockIdx.x -> (n_block, head split, head_kv, batch) with n_block fastest, then the head split
(BwdConfig.dkv_accum; else 0), head_kv, batch (flash4.launch.bwd_grid; the deterministic dQ and
dK/dV chains need lower n_blocks and splits to launch first). The CTA takes query heads head0 ..
head0 + num_heads - 1 (all of its KV head's, or heads_per_cta of them) and for each the m_blocks
[m_block_min, m_block_max) that see its keys (flash4.geometry.m_block_range): num_steps (query head,
m_block) pairs, in that order (head outer). The consumers walk the m_blocks of a head in mask
phases (mask_phase_bounds); the producer warps walk the steps by index (step_coords).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flash4.kernels.common import geometry
from flash4.kernels.common.dsl import DynamicState
from flash4.kernels.common.seqinfo import SeqInfo


@dsl_user_op
def block_idx_x_fresh(*, loc=None, ip=None) -> Int32:
    """blockIdx.x read by an opaque (side-effecting) instruction: the compiler cannot merge it with
    an earlier read, so what is derived from it is recomputed where used instead of being held in
    a register from the kernel's start."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %ctaid.x;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


class BlockCoords(NamedTuple):
    """A CTA's coordinates, decoded from blockIdx.x (BwdSchedule.decode)."""

    n_block: Int32  # key tile
    split: Int32  # head split (dkv_accum; else 0)
    head_kv: Int32
    batch: Int32
    head0: Int32  # first query head
    num_heads: Int32  # query heads of this CTA
    kv_tile: Int32  # the key tile's index among the n_blocks x nheads_k x batch tiles


class BwdSchedule(DynamicState):
    """One CTA's coordinates and loop bounds (device Int32 values; read-only).

    n_block, head_kv, head0, num_heads: BlockCoords'. seq: the sequence's offsets and lengths
    (SeqInfo). window: (left, right) for local configs, else None. [m_block_min, m_block_max): the
    query tiles that see the key tile; num_steps = (m_block_max - m_block_min) * num_heads.
    Also kept, to decode blockIdx.x again (`decode(fresh=True)`, `refreshed`): the head counts,
    the key count of the grid and heads_per_cta (kernel parameters, nothing computed). The config
    (a frozen BwdConfig: tiles, flags) is a trace-time constant.
    """

    _dynamic_fields = ("n_block", "head_kv", "head0", "num_heads", "seq", "window", "m_block_min",
                       "m_block_max", "num_steps", "nheads", "nheads_k", "seqlen_k_grid", "max_seqlen_k",
                       "heads_per_cta")

    def __init__(self, cfg, nheads, nheads_k, seqlen_k_grid, max_seqlen_k, heads_per_cta):
        self.cfg = cfg
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.nheads, self.nheads_k = nheads, nheads_k
        self.seqlen_k_grid, self.max_seqlen_k = seqlen_k_grid, max_seqlen_k
        self.heads_per_cta = heads_per_cta

    @staticmethod
    def create(cfg, mQ: cute.Tensor, mK: cute.Tensor, seq_params, max_seqlen_k, heads_per_cta, mask):
        """The schedule of this CTA. mQ, mK: kernel views (seqlen, headdim, heads, batch);
        seq_params: SeqParams; max_seqlen_k: None unless cfg.dynamic_seqlen_k; mask: MaskParams."""
        sched = BwdSchedule(cfg, mQ.shape[2], mK.shape[2], mK.shape[0], max_seqlen_k, heads_per_cta)
        coords = sched.decode()
        sched.n_block, sched.head_kv = coords.n_block, coords.head_kv
        sched.head0, sched.num_heads = coords.head0, coords.num_heads
        # This sequence's offsets and lengths (dense: batch index and the tensors' seqlens).
        sched.seq = SeqInfo(coords.batch, mQ.shape[0], mK.shape[0], *seq_params.lengths(), tile_m_pad=cfg.tile_m)
        sched.window = mask.window(cfg.local)
        m_block_min, m_block_max = geometry.m_block_range(sched.n_block, sched.seq.seqlen_q, sched.seq.seqlen_k,
                                                          cfg.tile_m, cfg.tile_n, cfg.causal, sched.window)
        if const_expr(cfg.local):
            m_block_max = cutlass.max(m_block_max, m_block_min)  # a window's key tile may see no query
        sched.m_block_min, sched.m_block_max = m_block_min, m_block_max
        sched.num_steps = (m_block_max - m_block_min) * sched.num_heads  # (query head, m_block) pairs
        return sched

    def decode(self, fresh: bool = False) -> BlockCoords:
        """blockIdx.x -> BlockCoords (the module docstring's order). Per-sequence seqlen_k: n_blocks
        of max_seqlen_k. fresh: decode from an opaque read of blockIdx.x (where registers are
        scarce: nothing of the first decode stays live across the main loop)."""
        if const_expr(self.cfg.dynamic_seqlen_k):
            num_n_blocks = (self.max_seqlen_k + (self.tile_n - 1)) // self.tile_n
        else:
            num_n_blocks = cute.ceil_div(self.seqlen_k_grid, self.tile_n)
        bid = block_idx_x_fresh() if const_expr(fresh) else cute.arch.block_idx()[0]
        group = self.nheads // self.nheads_k
        n_block = bid % num_n_blocks
        rest = bid // num_n_blocks
        split = Int32(0)
        head_first = Int32(0)
        num_heads = group
        if const_expr(self.cfg.dkv_accum):
            num_splits = (group + self.heads_per_cta - 1) // self.heads_per_cta
            split = rest % num_splits
            rest = rest // num_splits
            head_first = split * self.heads_per_cta
            num_heads = cutlass.min(self.heads_per_cta, group - head_first)
        head_kv = rest % self.nheads_k
        batch = rest // self.nheads_k
        kv_tile = (batch * self.nheads_k + head_kv) * num_n_blocks + n_block
        return BlockCoords(n_block, split, head_kv, batch, head_kv * group + head_first, num_heads, kv_tile)

    def refreshed(self) -> "BwdSchedule":
        """This schedule with the head split (head0, num_heads, num_steps) decoded again from a
        fresh blockIdx.x: for the producer warps (24 registers), where the prologue's values, kept
        across the main loop, spill (compile check, varlen deterministic). Itself without
        dkv_accum (the head range is then the KV head's group, nothing to keep)."""
        if const_expr(not self.cfg.dkv_accum):
            return self
        coords = self.decode(fresh=True)
        new = copy.copy(self)
        new.head0, new.num_heads = coords.head0, coords.num_heads
        new.num_steps = (self.m_block_max - self.m_block_min) * coords.num_heads
        return new

    def step_coords(self, step, num_m):
        """(m_block, head) of step `step` (head outer); num_m = m_block_max - m_block_min."""
        h_in_group = step // num_m
        m_block = self.m_block_min + (step - h_in_group * num_m)
        return m_block, self.head0 + h_in_group

    def tile_index(self, m_block):
        """(tile, batch) indices of query tile m_block of the sequence in the per-tile flag tensors
        (dQ semaphores, exact flags: (num_tiles, nheads, batch) views); packed: its padded tile."""
        if const_expr(self.cfg.varlen_q):
            return self.seq.padded_offset_q // self.tile_m + m_block, 0
        return m_block, self.seq.batch

    def dq_turn(self, m_block):
        """This key tile's place in the deterministic chain of query tile m_block's dQ adds: the key
        blocks that add to it are n_first(m), n_first(m) + 1, ...: 0 without a window, the first
        block of its band with one (flash4.geometry.n_block_min, the first n whose m_block_range
        holds m)."""
        turn = self.n_block
        if const_expr(self.cfg.local):
            turn = self.n_block - geometry.n_block_min(m_block, self.seq.seqlen_q, self.seq.seqlen_k, self.tile_m,
                                                       self.tile_n, self.window)
        return turn

    def mask_phase_bounds(self):
        """(m_mask_end, m_left): the step loop's m_blocks [m_block_min, m_mask_end) run with the element
        mask, [m_mask_end, m_left) without, and (a window) [m_left, m_block_max) with it again (the
        left edge); m_block_min <= m_mask_end <= m_left <= m_block_max, all equal for a tile without
        queries."""
        cfg, seqlen_q, seqlen_k = self.cfg, self.seq.seqlen_q, self.seq.seqlen_k
        m_mask_end = geometry.m_block_mask_end(self.n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, cfg.causal,
                                               self.window)
        m_left = self.m_block_max
        if const_expr(cfg.local):
            m_mask_end = cutlass.min(cutlass.max(m_mask_end, self.m_block_min), self.m_block_max)
            m_left = geometry.m_block_left_mask_start(self.n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                                                      self.window)
            m_left = cutlass.min(cutlass.max(m_left, m_mask_end), self.m_block_max)
        return m_mask_end, m_left

    def phases(self):
        """The number of mask phases (static): masked, unmasked and (a window) masked again."""
        return 3 if self.cfg.local else 2

    def phase_range(self, phase: int, bounds):
        """(lo, hi, masked) of mask phase `phase` (static) given mask_phase_bounds()."""
        m_mask_end, m_left = bounds
        if phase == 1:
            return m_mask_end, m_left, False
        if phase == 2:
            return m_left, self.m_block_max, True
        return self.m_block_min, m_mask_end, True
