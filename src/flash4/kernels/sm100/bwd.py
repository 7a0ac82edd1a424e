"""FlashAttention backward for Blackwell (sm_100a, B200) in CuTe DSL: 1-CTA and (hd128) 2-CTA, dQ, dK, dV.

Status: compile-verified, not run on hardware (no Blackwell GPU has executed it; no speed claim).

One CTA per (key block n, KV head, batch), never persistent: it keeps K and V of its 128 keys in
shared memory and walks the query blocks m of every query head of its KV head (GQA/MQA: dK, dV
accumulate over the group in TMEM). Per step (FlashAttention-4's sm100 backward, BLACKWELL.md
section 1, "Backward"), five tcgen05 MMAs, every accumulator in tensor memory (TMEM):

    S^T  = K Q^T                     (SS; keys are the TMEM lanes)
    dP^T = V dO^T                    (SS)
    P^T  = 2^(S^T * scale*log2e - LSE*log2e)   (compute warps; masked 0) -> 16-bit, TMEM
    dV  += P^T dO                    (TS: P^T read from TMEM)
    dS^T = scale * P^T * (dP^T - D)  (compute warps) -> 16-bit, TMEM (for dK) and smem (for dQ)
    dK  += dS^T Q                    (TS: dS^T read from TMEM)
    dQ   = dS K                      (SS: dS from smem) -> the dQ-reduce warps: TMEM -> registers ->
                                     smem -> cp.reduce.async.bulk .add.f32 into the fp32 dQ
                                     accumulator of flash4.backward (shared pre/postprocess)
dS carries the softmax scale, so dK and dQ need no rescaling (flash4's convention, as on sm90).
Exact-LSE path (issue 8; every 1-CTA config and most 2-CTA ones, bwd_plan.bwd_exact_lse): query tiles the
preprocess flagged (|lse_log2| >= BWD_EXACT_LSE_LOG2 in some row; the flag is read per step, a branch
uniform over the CTA) subtract r = hi + lo - lse_log2 (the forward's unrounded split; TwoSum, one query
per lane, shuffled to the columns) from every exponent before the exp2, so P is exact at the row max at
any finite magnitude, as the sm90 backward (exact_residual). Not in the 2-CTA hd128 fp16 full, hd128 softcap
and (192, 128) bf16 softcap full configs (they spilled with it; bwd_two_cta_exact_lse): P uses the rounded lse_log2.
Softcap configs (the sm90 backward's order, through flash4.kernels.common.score): S^T -> tanh(S^T *
scale / softcap) (MUFU.TANH) before the exp2, whose scale is then softcap * log2e; dS^T is multiplied
by score.grad_factor = 1 - t^2, t recovered from P^T and the LSE (MUFU.LG2; no register kept for t),
so the LSE stage is released after dS^T instead of after P^T.

Every TMEM offset comes from flash4.kernels.sm100.bwd_plan.bwd_tmem_map, every setmaxnreg budget
from bwd_register_plan, every mbarrier arrive count from bwd_pipeline_specs (checked at trace time by
flash4.kernels.sm100.pipes). Masks: causal, a sliding window (local configs; runtime sides), keys
past seqlen_k, through flash4.geometry (m_block_range, first_query, query_end).

2-CTA (cfg.cta_group 2: hd128 and (192, 128), full or causal, softcap or not, not deterministic, no window;
opt-in FLASH4_SM100_2CTA): a cluster of 2 CTAs per 2 x 128 keys, the leader issuing .cta_group::2 MMAs for both (each CTA's own
keys are its M rows; Q, dO, Q^T, dO^T, K^T are loaded split along the MMA's N), dQ over S's tail in
TMEM (each CTA: 64 query rows x D), half of dS^T swapped with the peer over DSMEM
(cp.async.bulk.shared::cluster), a relay warp (14) forwarding "the peer's half arrived" to the
leader's MMA warp, and the pair's TMEM dealloc handshake. docs/design/sm100_backward.md section 8.
(192, 128) as a pair (bwd_two_cta_serial; section 8.1): FA4's hd192 per-CTA TMEM map (dQ, 96 columns, over S's
tail and dP), mma_serial's order issued by the leader with the pair's waits (dp empty before dK; ds and relay
before dQ), Q / Q^T and dO / dO^T through one smem ring each (bwd_two_cta_shared_rings: 223 KiB), the ds
arrive at the end of the step, dQ read out in 32-column passes. Compile-verified, not run on hardware.

Packed sequences (1-CTA: cfg.varlen_q / varlen_k, optionally seqused_q / seqused_k): one CTA per (key
block of max_seqlen_k, KV head, sequence), every global view offset to the sequence (SeqInfo; the
padded per-sequence LSE / dPsum / dQ accumulator of flash4.backward), the MMA warp zeroing K / V / Q / dO
rows past the sequence in smem before their first MMA (zero_tail). docs/design/sm100_backward.md section 9.

(192, 128) (DeepSeek's head dims; 1-CTA, dense or packed, softcap or not): dK + dV take 320 of the 512 TMEM
columns, so S^T and dP^T share columns (dP^T over S^T's second half, dQ over both: bwd_tmem_map_serial)
and each step runs serially (mma_serial: S(i) after dQ(i-1) was read out, dP(i) after P^T(i) was
written); the P^T halves lie contiguous at S's start, so the compute warpgroups sync before writing
them (bwd_p_barrier); the reduce warps read each thread's 192 dQ columns in passes of 64
(bwd_dq_passes); one Q stage (217 KiB of smem). docs/design/sm100_backward.md section 10.

hd256 (two passes over each key tile, cfg.bwd_pass; docs/design/sm100_backward.md section 10.4): dK + dV
alone fill the 512 TMEM columns, so pass "dv" keeps dV (256 columns) and S^T (P^T inside) and issues
only S^T = K Q^T and dV += P^T dO per step (mma_dv_pass; no V, dP^T, dS^T, dQ: the reduce warps idle,
the compute warps write P^T only and warpgroup 0 stores dV); pass "dkdq" keeps dK, S^T and dP^T side by
side with dQ over them (mma_serial's order without dV; P^T stays in registers), streams V and dO
through the do ring in BWD_VDO_COLS-column chunks (whole tiles would need 321 KiB of smem) and reads
dQ out in 32-column passes; warpgroup 1 stores dK. The host launches both (flash4.backward).
Softcap: both passes take tanh before the exp2 (softcap changes P, so pass dv needs it too; there
the LSE stage is released after P^T, there being no dS); pass dkdq multiplies dS^T by grad_factor.
Packed sequences: both passes zero K, Q and dO past the sequence as the one-kernel MMA warp does, and
pass dkdq each V / dO chunk of its do ring (zero_chunk_tails); pass dkdq's roles take the packed tile
computed before the role branch (pass_tile).

Not built (refused by flash4.config.sm100.select_bwd_config / bwd_config_problem): head dims other than
64 / 128 / (192, 128) (hd256: one of its two passes), other Dv != D, softcap at (192, 128) in bf16 with
causal and deterministic together (bwd_serial_problem: it spills), packed sequences, deterministic or windowed
configs in the 2-CTA variant, the GQA head split; the exact-LSE path in four shipped 2-CTA configs (above).
"""

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.tensor_utils import LayoutEnum

from flash4 import geometry as g
from flash4.constants import THREADS_PER_WG
from flash4.kernels.common import score
from flash4.kernels.common.dsl import DSL_DTYPES
from flash4.kernels.common.exp2 import exp2_hw
from flash4.kernels.common.geometry import DEVICE_OPS
from flash4.kernels.common.layout import select_modes
from flash4.kernels.common.pipeline import next_state
from flash4.kernels.common.seqinfo import SeqInfo
from flash4.kernels.sm100.bwd_plan import (BWD_VDO_COLS, BWD_WARP_ROLES, DQ_GROUP_ROWS, DQ_LD_COLS, BwdRegisterPlan,
                                           bwd_dq_group_rows, bwd_dq_passes, bwd_exact_lse, bwd_role_tiles,
                                           bwd_two_cta_serial, bwd_two_cta_shared_rings,
                                           bwd_p_barrier, bwd_pass, bwd_pipeline_specs, bwd_register_plan,
                                           bwd_serial_schedule, bwd_tmem_alloc_cols, bwd_tmem_map, bwd_warp_roles)
from flash4.kernels.sm100.pipes import (ArrivalLedger, Pipe, named_barrier_arrive, named_barrier_sync, tcgen05_fence_after,
                                         tcgen05_fence_before, thread_group)
from flash4.kernels.sm100.plan import TMEM_COLUMNS, WARP_SIZE

# Named barrier ids of this kernel (0 is __syncthreads).
TMEM_PTR_BARRIER = 1  # mma + compute + reduce warps: TMEM allocated / done with TMEM
REDUCE_BARRIER = 2  # the 4 reduce warps (deterministic: around the dQ semaphore)
COMPUTE_BARRIER = 3  # the 8 compute warps: S^T read before P^T is written (2-CTA, serial); 2-CTA: dS smem written before the exchange
# Columns per tcgen05.ld of S^T, dP^T (32x32b.x32: thread t gets 32 columns of lane t).
LD_COLS = 32
# Columns per tcgen05.ld of dK, dV in the epilogue and of dQ in the reduce warps.
EPI_COLS = 32


@dsl_user_op
def bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """gmem[0:n] += smem[0:n] (fp32) on the bulk copy engine, in this thread's bulk group."""
    llvm.inline_asm(
        None,
        [gmem_ptr.llvm_ptr, smem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bulk_copy_s2peer(src_ptr: cute.Pointer, dst_ptr: cute.Pointer, mbar_ptr: cute.Pointer, peer, num_bytes: int, *,
                     loc=None, ip=None):
    """The peer CTA's smem[dst .. + n] = this CTA's smem[src .. + n] over distributed shared memory
    (cp.async.bulk.shared::cluster.shared::cta; dst and mbar are this CTA's addresses of the same
    buffers, mapped to CTA `peer` of the cluster with mapa); completes n bytes of the peer's mbar."""
    llvm.inline_asm(
        None,
        [dst_ptr.toint(loc=loc, ip=ip).ir_value(), src_ptr.toint(loc=loc, ip=ip).ir_value(),
         mbar_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(peer).ir_value(loc=loc, ip=ip),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 d, m;\nmapa.shared::cluster.u32 d, $0, $3;\nmapa.shared::cluster.u32 m, $2, $3;\n"
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [d], [$1], $4, [m];\n}",
        "r,r,r,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bulk_copy_g2s(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, num_bytes: int, *,
                  loc=None, ip=None):
    """smem[0:n] = gmem[0:n] on the bulk copy engine; completes num_bytes of mbar's transaction count."""
    llvm.inline_asm(
        None,
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), gmem_ptr.llvm_ptr, mbar_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $3, [$2];",
        "r,l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def bwd_tiled_mmas(cfg):
    """The five tcgen05 tiled MMAs (fp32 accumulators): S^T = K Q^T, dP^T = V dO^T (both operands
    K-major), dV += P^T dO and dK += dS^T Q (A from TMEM, B MN-major), dQ = dS K (both MN-major).
    2-CTA (cfg.cta_group 2): .cta_group::2 with the pair's keys as M (2 tile_n: each CTA's own keys
    are its M rows) and as dQ's K; dQ's M = tile_m queries is split between the pair (tile_m / 2
    each). Trace time (inside a cute.jit function)."""
    dt = DSL_DTYPES[cfg.dtype]
    K_, MN_ = OperandMajorMode.K, OperandMajorMode.MN
    one = tcgen05.CtaGroup.TWO if cfg.cta_group == 2 else tcgen05.CtaGroup.ONE
    tm, tn, d, dv = cfg.tile_m, cfg.tile_n * cfg.cta_group, cfg.headdim, cfg.hdim_v
    tmem = tcgen05.OperandSource.TMEM
    return (sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, one, (tn, tm)),
            sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, one, (tn, tm)),
            sm100_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, one, (tn, dv), tmem),
            sm100_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, one, (tn, d), tmem),
            sm100_utils.make_trivial_tiled_mma(dt, dt, MN_, MN_, Float32, one, (tm, d)))


def bwd_smem_layouts(cfg, mmas=None) -> dict:
    """Shared-memory layouts (ComposedLayout: swizzle o offset o layout) of the operands, and the
    TMEM layouts of P^T / dS^T as A operands. K, V (A of S^T, dP^T), the Q ring and the dO ring (B of
    S^T, dP^T) are loaded K-major by TMA; dS^T is written row-major (keys x queries) by the compute
    warps. The other MMAs read the same bytes through MN-major views: sQmn (B of dK), sdOmn (B of
    dV), sKmn (B of dQ), sdS (A of dQ). A 128-byte-swizzled K-major atom of 8 rows x 64 elements is
    the MN-major atom of 64 elements x 8, so each pair addresses every element at the same offset
    (tests/cpu/test_sm100_bwd_plan.py checks it element by element). Trace time."""
    dt = DSL_DTYPES[cfg.dtype]
    mma_s, mma_dp, mma_dv, mma_dk, mma_dq = bwd_tiled_mmas(cfg) if mmas is None else mmas
    tm, tn, d, dv = cfg.tile_m, cfg.tile_n * cfg.cta_group, cfg.headdim, cfg.hdim_v
    t_s, t_dp, t_dv, t_dk, t_dq = (tn, tm, d), (tn, tm, dv), (tn, dv, tm), (tn, d, tm), (tm, d, tn)
    a, b = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b
    return {
        "sK": a(mma_s, t_s, dt, 1), "sQ": b(mma_s, t_s, dt, cfg.q_stages),
        "sV": a(mma_dp, t_dp, dt, 1), "sdO": b(mma_dp, t_dp, dt, cfg.do_stages),
        "sdOmn": b(mma_dv, t_dv, dt, cfg.do_stages), "sQmn": b(mma_dk, t_dk, dt, cfg.q_stages),
        "sdS": a(mma_dq, t_dq, dt, 1), "sKmn": b(mma_dq, t_dq, dt, 1),
        "sdSt": sm100_utils.make_smem_layout_epi(dt, LayoutEnum.ROW_MAJOR, (cfg.tile_n, tm), 1),
        "tP": a(mma_dv, t_dv, dt, 1), "tdS": a(mma_dk, t_dk, dt, 1),
    }


class FlashAttentionBackwardSm100:
    """Warp-specialized backward: one CTA per (key block, KV head, batch); 2-CTA (cfg.cta_group 2): one
    cluster of 2 per (pair of key blocks, KV head, batch), see mma_2cta / load_2cta / reduce_2cta /
    relay and compute's cta_v branches. The 1-CTA description:

    Warp roles (flash4.kernels.sm100.bwd_plan.BWD_WARP_ROLES; 16 warps, 512 threads):
      * reduce = warps 0-3: thread t owns dQ row t (TMEM lane t): loads the step's dQ (D columns),
        frees dQ's columns, then per 32 columns stages its row piece in its warp's smem buffer and
        reduce-adds it into the fp32 dQ accumulator with one 128-byte cp.reduce.async.bulk.
      * compute = warps 4-11, two warpgroups; thread t of warpgroup w owns key row t and query
        columns [64 w, 64 w + 64) of S^T and dP^T: P^T = exp2(S^T c - lse) (MUFU), masked; P^T (16-bit)
        into the first half of its OWN S^T columns (P_w), dS^T into its own dP^T columns (dS_w) and
        into smem: no warpgroup writes TMEM columns the other still reads, so no barrier between
        them. At the end: dV (warpgroup 0) and dK (warpgroup 1) TMEM -> 16-bit -> global, rows < seqlen_k.
      * mma = warp 12: allocates TMEM (512 columns), issues the five MMAs, frees TMEM.
      * load = warp 13: TMA K, V once; per step Q, dO (TMA) and LSE, dPsum (bulk copies).
      * idle = warps 14, 15 (FA4's 2-CTA relay warp and its empty warp).
    Pipelines (bwd_pipeline_specs has the arrive counts):
      kv (load -> mma), q (2 stages) and do (1 stage) (load -> mma, released by the MMA's commits),
      lse (2) and dpsum (1) (load -> compute), s (mma: S^T ready; compute: P^T written), dp (mma:
      dP^T ready), ds (compute: dS^T written; mma: dS consumed), dq (mma: dQ ready; reduce: dQ read
      out), dkv (mma: dK, dV final).
    MMA warp per CTA with steps i = 0 .. n-1 (n = query heads of the group x query blocks):
      S(0) ; dP(0) ; per i: [wait s: P(i) written] dV += P^T dO(i) ; release dO(i) ;
      (i+1 < n: S(i+1), which overwrites P(i)'s columns only after dV(i) read them: tcgen05 MMAs of one
      thread run in order) ; [wait ds] dK += dS^T Q(i) ; release Q(i) ; dQ = dS K ; commit dq, ds ;
      (i+1 < n: [wait dq empty: dQ(i) read out] dP(i+1), over dQ(i)'s and dS(i)'s columns) ; finally dkv.
    Compute per step: [exact flag of the query tile] ; wait lse, s ; S^T -> registers ; (softcap: tanh)
      exponents (flagged tile: minus the exact-LSE residual) ; P (fp32, kept) ; P^T -> TMEM ;
      arrive s ; release lse (softcap: after dS) ; wait dpsum, dp, ds empty ; per 32 columns dP^T ->
      dS^T (softcap: times grad_factor) -> TMEM and smem ; arrive ds ; release dpsum.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.dtype = DSL_DTYPES[cfg.dtype]
        self.hdim, self.hdim_v = cfg.headdim, cfg.hdim_v
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.q_stages, self.do_stages = cfg.q_stages, cfg.do_stages
        self.causal = cfg.causal
        # 2-CTA (cta_group 2): a cluster of 2 CTAs per 2 x tile_n keys; the leader (rank 0) issues
        # .cta_group::2 MMAs whose M (S^T, dP^T, dV, dK) or K (dQ) is the pair's 2 tile_n keys.
        self.cta_group = cfg.cta_group
        self.two_cta = cfg.cta_group == 2
        # packed sequences (1-CTA; flash4.config.sm100.bwd_config_problem): SeqInfo offsets, tails zeroed
        self.packed = cfg.varlen_q or cfg.varlen_k
        # (192, 128): S^T and dP^T share TMEM columns, so each step runs serially (mma_serial)
        self.serial = bwd_serial_schedule(cfg)
        # (192, 128) 2-CTA: the same serial order for the pair (mma_serial's two_cta branches), Q / Q^T
        # through one smem ring and dO / dO^T through another (bwd_two_cta_shared_rings)
        self.serial_2cta = bwd_two_cta_serial(cfg)
        self.shared_rings = bwd_two_cta_shared_rings(cfg)
        # each role computes the tile's coordinates after its setmaxnreg (bwd_role_tiles)
        self.role_tiles = bwd_role_tiles(cfg)
        # the exact-LSE path (issue 8) in the compute step: every 1-CTA config, 2-CTA by bwd_two_cta_exact_lse
        self.exact_lse = bwd_exact_lse(cfg)
        # P^T halves contiguous at S's start (2-CTA, serial): both warpgroups read S^T before either writes P^T
        self.p_barrier = bwd_p_barrier(cfg)
        # hd256 pass "dv" (bwd_pass): S^T and dV += P^T dO only; no V, dP^T, dS^T, dK, dQ (mma_dv_pass)
        self.dv_pass = bwd_pass(cfg) == "dv"
        # hd256 pass "dkdq": no dV; V and dO stream through the do ring in BWD_VDO_COLS-column chunks
        # (dP^T accumulates over them); dQ over S and dP in the serial order (mma_serial)
        self.dkdq_pass = bwd_pass(cfg) == "dkdq"
        pair_n = self.cta_group * self.tile_n
        self.mma_tiler_s = (pair_n, self.tile_m, self.hdim)  # S^T = K Q^T
        self.mma_tiler_dp = (pair_n, self.tile_m, self.hdim_v)  # dP^T = V dO^T
        # the V / dO tiles as loaded: whole, or (pass dkdq) one BWD_VDO_COLS-column chunk per ring stage
        self.vdo_cols = BWD_VDO_COLS if self.dkdq_pass else self.hdim_v
        self.vdo_chunks = self.hdim_v // self.vdo_cols
        self.mma_tiler_vdo = (pair_n, self.tile_m, self.vdo_cols)
        self.mma_tiler_dv = (pair_n, self.hdim_v, self.tile_m)  # dV += P^T dO
        self.mma_tiler_dk = (pair_n, self.hdim, self.tile_m)  # dK += dS^T Q
        self.mma_tiler_dq = (self.tile_m, self.hdim, pair_n)  # dQ = dS K
        self.tmem = bwd_tmem_map(cfg)
        self.tmem_cols = bwd_tmem_alloc_cols(cfg)
        self.regs: BwdRegisterPlan = bwd_register_plan(cfg)
        self.specs = bwd_pipeline_specs(cfg)
        self.roles = bwd_warp_roles(cfg.cta_group)
        self.num_threads = cfg.num_threads
        self.tmem_users = WARP_SIZE * sum(len(BWD_WARP_ROLES[r]) for r in ("mma", "compute", "reduce"))
        self.compute_wgs = len(BWD_WARP_ROLES["compute"]) // 4
        # dQ columns (fp32) each CTA reduces: all D, or in a pair half of the pair's M = tile_m
        # queries' D columns (the M = 128 .cta_group::2 accumulator: tile_m / 2 rows x D per CTA)
        self.dq_cols = self.hdim // self.cta_group
        # rows a reduce warp stages per bulk group (2-CTA; the 1-CTA reduce uses DQ_GROUP_ROWS)
        self.dq_group_rows = bwd_dq_group_rows(self.hdim, self.hdim_v, self.cta_group)
        # read-out passes of a reduce thread's dQ row (hd192: 3 x 64 columns; else 1)
        self.dq_passes = bwd_dq_passes(self.hdim, self.cta_group, self.hdim_v if self.two_cta else None)
        # query columns of S^T / dP^T per compute warpgroup, and their 16-bit halves in TMEM columns
        self.wg_cols = self.tile_m // self.compute_wgs
        self.half_cols = self.wg_cols // 2
        self.buffer_align_bytes = 1024

    # ------------------------------------------------------------------ host side (trace time)
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, headdim)
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_k, headdim)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # (batch, seqlen_q, nheads, headdim)
        mLSE2: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32: LSE * log2(e), +inf on padding
        mD: cute.Tensor,  # (batch, nheads, seqlen_q_pad) fp32: rowsum(dO * O), 0 on padding
        mdQacc: cute.Tensor,  # (batch, nheads, seqlen_q_pad, headdim) fp32, zeroed, row-major
        mdK: cute.Tensor,  # (batch, seqlen_k, nheads_k, headdim)
        mdV: cute.Tensor,
        mdQsem: cute.Tensor,  # (batch, nheads, num_m_blocks) int32, zeroed; used when deterministic
        mExact: cute.Tensor,  # (batch, nheads, num_m_blocks) int32: 1 where the query tile takes the exact P path
        mLSEhi: cute.Tensor,  # (batch, nheads, seqlen_q) fp32: LSE * log2(e) = hi + lo, unrounded (exact path)
        mLSElo: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],  # packed configs (1-CTA): (batch + 1,) int32; else None
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mdKVsem: Optional[cute.Tensor],
        mDelta: Optional[cute.Tensor],  # must be None (no sink_delta on sm100: the host sums D in torch)
        softmax_scale: Float32,
        max_seqlen_k: Optional[Int32],  # packed configs: >= every seqlen_k (sizes the grid); else None
        window_left: Int32,  # local configs: the window's sides (flash4.geometry.window_sides); else ignored
        window_right: Int32,
        softcap: Float32,  # cfg.softcap: the cap (scores softcap * tanh(S * scale / softcap)); else ignored
        num_ctas: Int32,  # grid size: n_blocks * nheads_k * batch (flash4.launch.bwd_grid)
        heads_per_cta: Int32,  # the query heads per KV head (no head split on sm100)
        stream: cuda.CUstream,
    ):
        for name, t, flag in (("cu_seqlens_q", mCuSeqlensQ, self.cfg.varlen_q),
                              ("cu_seqlens_k", mCuSeqlensK, self.cfg.varlen_k),
                              ("seqused_q", mSeqUsedQ, self.cfg.seqused_q), ("seqused_k", mSeqUsedK, self.cfg.seqused_k),
                              ("max_seqlen_k", max_seqlen_k, self.packed)):
            if const_expr((t is not None) != flag):
                raise ValueError(f"flash4 bwd_sm100: {name} given={t is not None} but the config says {flag}")
        for name, t in (("dkv_semaphore", mdKVsem), ("delta (sink_delta)", mDelta)):
            if const_expr(t is not None):
                raise NotImplementedError(f"flash4 bwd_sm100: {name} is not implemented on sm100 yet")
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type
                           == mdK.element_type == mdV.element_type == self.dtype)):
            raise TypeError(f"flash4 bwd_sm100: q, k, v, dout, dk, dv must all be {self.dtype}")
        # Kernel views: (seqlen, d, heads, batch); statistics (seqlen_pad, heads, batch).
        mQ, mK, mV, mdO, mdK, mdV = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSE2, mD = [select_modes(t, [2, 1, 0]) for t in (mLSE2, mD)]
        mdQacc = select_modes(mdQacc, [2, 3, 1, 0])  # (seqlen_pad, d, heads, batch)
        mdQsem, mExact = [select_modes(t, [2, 1, 0]) for t in (mdQsem, mExact)]  # (num_m_blocks, heads, batch)
        mLSEhi, mLSElo = [select_modes(t, [2, 1, 0]) for t in (mLSEhi, mLSElo)]  # (seqlen_q, heads, batch)
        lse_exact = (mExact, mLSEhi, mLSElo)

        cta_group = tcgen05.CtaGroup.TWO if const_expr(self.two_cta) else tcgen05.CtaGroup.ONE
        mma_s, mma_dp, mma_dv, mma_dk, mma_dq = bwd_tiled_mmas(self.cfg)
        lay = bwd_smem_layouts(self.cfg, (mma_s, mma_dp, mma_dv, mma_dk, mma_dq))
        sK_layout, sQ_layout, sV_layout, sdO_layout = lay["sK"], lay["sQ"], lay["sV"], lay["sdO"]
        sdOmn_layout, sQmn_layout, sdS_layout, sKmn_layout = lay["sdOmn"], lay["sQmn"], lay["sdS"], lay["sKmn"]
        sdSt_layout, tP_layout, tdS_layout = lay["sdSt"], lay["tP"], lay["tdS"]
        dt = self.dtype
        if const_expr(self.dkdq_pass):  # V, dO: rings of BWD_VDO_COLS-column chunks (A / B of dP^T's k-blocks)
            sV_layout = sm100_utils.make_smem_layout_a(mma_dp, self.mma_tiler_vdo, dt, self.do_stages)
            sdO_layout = sm100_utils.make_smem_layout_b(mma_dp, self.mma_tiler_vdo, dt, self.do_stages)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((self.cta_group, 1, 1)), (mma_s.thr_id.shape,))
        # 1-CTA: Q, dO, K and dS are each read through two views of one buffer. 2-CTA: only dS (the
        # others are loaded twice, each half as its MMA splits it).
        views = (("Q", sQ_layout, sQmn_layout), ("dO", sdO_layout, sdOmn_layout), ("K", sK_layout, sKmn_layout),
                 ("dS", sdSt_layout, sdS_layout))
        if const_expr(self.dkdq_pass):  # dO is read by dP^T only (no MN-major view)
            views = tuple(v for v in views if v[0] != "dO")
        for name, a, b in views[3:] if const_expr(self.two_cta) else views:
            if const_expr(cute.cosize(a) != cute.cosize(b)):
                raise RuntimeError(f"flash4 bwd_sm100: the two views of {name} differ in size")

        load_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        sel = lambda lay: cute.select(lay, mode=[0, 1, 2])  # noqa: E731
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(load_op, mK, sel(sK_layout), self.mma_tiler_s, mma_s,
                                                             cluster_vmnk.shape)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_B(load_op, mQ, sel(sQ_layout), self.mma_tiler_s, mma_s,
                                                             cluster_vmnk.shape)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(load_op, mV, sel(sV_layout), self.mma_tiler_vdo, mma_dp,
                                                             cluster_vmnk.shape)
        tma_atom_dO, tma_dO = cute.nvgpu.make_tiled_tma_atom_B(load_op, mdO, sel(sdO_layout), self.mma_tiler_vdo,
                                                               mma_dp, cluster_vmnk.shape)
        self.tma_bytes = {
            "kv": cute.size_in_bytes(dt, sel(sK_layout)) + cute.size_in_bytes(dt, sel(sV_layout)),
            "q": cute.size_in_bytes(dt, sel(sQ_layout)),
            "do": cute.size_in_bytes(dt, sel(sdO_layout)),
            "lse": self.tile_m * 4,
            "dpsum": self.tile_m * 4,
        }
        if const_expr(self.dv_pass or self.dkdq_pass):  # pass dv: K alone (V is not read); dkdq: V streams
            self.tma_bytes["kv"] = cute.size_in_bytes(dt, sel(sK_layout))
        if const_expr(self.dkdq_pass):  # one stage of the do ring: a chunk of V and a chunk of dO
            self.tma_bytes["do"] = cute.size_in_bytes(dt, sel(sV_layout)) + cute.size_in_bytes(dt, sel(sdO_layout))
        extra = ()
        if const_expr(self.two_cta):
            # the three operands the 1-CTA kernel reads through a second view: Q^T (B of dK), dO^T (B
            # of dV), K^T (B of dQ), each CTA's half along N; (d, seqlen, heads, batch) views
            mQt, mdOt, mKt = [select_modes(t, [1, 0, 2, 3]) for t in (mQ, mdO, mK)]
            tma_atom_Qt, tma_Qt = cute.nvgpu.make_tiled_tma_atom_B(load_op, mQt, sel(sQmn_layout), self.mma_tiler_dk,
                                                                   mma_dk, cluster_vmnk.shape)
            tma_atom_dOt, tma_dOt = cute.nvgpu.make_tiled_tma_atom_B(load_op, mdOt, sel(sdOmn_layout),
                                                                     self.mma_tiler_dv, mma_dv, cluster_vmnk.shape)
            tma_atom_Kt, tma_Kt = cute.nvgpu.make_tiled_tma_atom_B(load_op, mKt, sel(sKmn_layout), self.mma_tiler_dq,
                                                                   mma_dq, cluster_vmnk.shape)
            extra = (tma_Qt, tma_dOt, tma_Kt, tma_atom_Qt, tma_atom_dOt, tma_atom_Kt)
            # per stage one CTA's bytes, times 2: the leader's barrier counts both CTAs' halves
            self.tma_bytes["kv"] = 2 * (self.tma_bytes["kv"] + cute.size_in_bytes(dt, sel(sKmn_layout)))
            self.tma_bytes["q"] = 2 * self.tma_bytes["q"]
            if const_expr(self.shared_rings):
                # Q then Q^T through the q ring, dO then dO^T through the do ring: one tx count per ring
                for a, b in ((sQ_layout, sQmn_layout), (sdO_layout, sdOmn_layout)):
                    if const_expr(cute.size_in_bytes(dt, sel(a)) != cute.size_in_bytes(dt, sel(b))
                                  or cute.cosize(a) != cute.cosize(b)):
                        raise RuntimeError("flash4 bwd_sm100: an operand and its transpose differ in size: "
                                           "they cannot share one ring stage")
                self.tma_bytes["do"] = 2 * self.tma_bytes["do"]
            else:  # Q^T on its own ring, dO^T on dO's barrier
                self.tma_bytes["qt"] = 2 * cute.size_in_bytes(dt, sel(sQmn_layout))
                self.tma_bytes["do"] = 2 * (self.tma_bytes["do"] + cute.size_in_bytes(dt, sel(sdOmn_layout)))
            # the dS exchange: query half h of dS^T (tile_n x tile_m / 2) is elements [h, h + 1) x half
            half = self.tile_n * self.tile_m // 2
            if const_expr(cute.crd2idx((0, self.tile_m // 2, 0), sdSt_layout.outer) != half
                          or cute.cosize(sdSt_layout) != 2 * half):
                raise RuntimeError("flash4 bwd_sm100: dS^T's query halves are not contiguous: the 2-CTA exchange "
                                   "copies one half as a block")
            self.tma_bytes["dsx"] = half * (dt.width // 8)
            transposes = 0 if const_expr(self.shared_rings) else cute.cosize(sQmn_layout) + cute.cosize(sdOmn_layout)
            smem_tiles = ((cute.cosize(sK_layout) + cute.cosize(sV_layout) + cute.cosize(sQ_layout)
                           + cute.cosize(sdO_layout) + transposes
                           + cute.cosize(sKmn_layout) + cute.cosize(sdSt_layout) + half) * (dt.width // 8)
                          + 4 * self.dq_group_rows * self.dq_cols * 4
                          + (self.q_stages + self.do_stages) * self.tile_m * 4)
        elif const_expr(self.dv_pass):  # K, Q, dO and LSE only
            smem_tiles = ((cute.cosize(sK_layout) + cute.cosize(sQ_layout) + cute.cosize(sdO_layout)) * (dt.width // 8)
                          + self.q_stages * self.tile_m * 4)
        else:
            smem_tiles = ((cute.cosize(sK_layout) + cute.cosize(sV_layout) + cute.cosize(sQ_layout)
                           + cute.cosize(sdO_layout) + cute.cosize(sdSt_layout)) * (dt.width // 8)
                          + 4 * DQ_GROUP_ROWS * self.hdim * 4 + (self.q_stages + self.do_stages) * self.tile_m * 4)
        if const_expr(smem_tiles != self.cfg.smem_bytes()):
            raise RuntimeError(f"flash4 bwd_sm100: smem tiles take {smem_tiles} bytes, the config says "
                               f"{self.cfg.smem_bytes()}")
        num_mbar = 2 * sum(s.stages for s in self.specs.values())
        storage_2cta = self.shared_storage_2cta(num_mbar, lay) if const_expr(self.two_cta) else None
        storage_dv = self.shared_storage_dv(num_mbar, lay) if const_expr(self.dv_pass) else None

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, num_mbar]
            tmem_holding_buf: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.q_stages * self.tile_m], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, self.do_stages * self.tile_m], 128]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, 4 * DQ_GROUP_ROWS * self.hdim], 128]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], self.buffer_align_bytes]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], self.buffer_align_bytes]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], self.buffer_align_bytes]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)], self.buffer_align_bytes]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdSt_layout)], self.buffer_align_bytes]

        layouts = (sK_layout, sQ_layout, sV_layout, sdO_layout, sdOmn_layout, sQmn_layout, sdS_layout, sKmn_layout,
                   sdSt_layout, tP_layout, tdS_layout)
        if const_expr(self.two_cta):
            # a cluster of 2 per 2 x tile_n keys (flash4.launch.bwd_grid rounds n_blocks up to pairs)
            self.kernel(
                tma_K, tma_Q, tma_V, tma_dO, mLSE2, mD, mdQacc, mdQsem, lse_exact, mdK, mdV, tma_atom_K, tma_atom_Q,
                tma_atom_V,
                tma_atom_dO, softmax_scale, window_left, window_right, *layouts, mma_s, mma_dp, mma_dv, mma_dk, mma_dq,
                storage_2cta, softcap if const_expr(self.cfg.softcap) else None, extra,
            ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], cluster=[self.cta_group, 1, 1],
                     stream=stream, min_blocks_per_mp=1)
        elif const_expr(self.packed):
            # packed sequences: the sequence tensors and max_seqlen_k (tile_coords_packed)
            self.kernel(
                tma_K, tma_Q, tma_V, tma_dO, mLSE2, mD, mdQacc, mdQsem, lse_exact, mdK, mdV, tma_atom_K, tma_atom_Q,
                tma_atom_V,
                tma_atom_dO, softmax_scale, window_left, window_right, *layouts, mma_s, mma_dp, mma_dv, mma_dk, mma_dq,
                storage_dv if const_expr(self.dv_pass) else SharedStorage,
                softcap if const_expr(self.cfg.softcap) else None, (),
                (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_k),
            ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)
        elif const_expr(self.dv_pass):
            self.kernel(
                tma_K, tma_Q, tma_V, tma_dO, mLSE2, mD, mdQacc, mdQsem, lse_exact, mdK, mdV, tma_atom_K, tma_atom_Q,
                tma_atom_V,
                tma_atom_dO, softmax_scale, window_left, window_right, *layouts, mma_s, mma_dp, mma_dv, mma_dk, mma_dq,
                storage_dv, softcap if const_expr(self.cfg.softcap) else None,
            ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)
        else:
            self.kernel(
                tma_K, tma_Q, tma_V, tma_dO, mLSE2, mD, mdQacc, mdQsem, lse_exact, mdK, mdV, tma_atom_K, tma_atom_Q,
                tma_atom_V,
                tma_atom_dO, softmax_scale, window_left, window_right, *layouts, mma_s, mma_dp, mma_dv, mma_dk, mma_dq,
                SharedStorage, softcap if const_expr(self.cfg.softcap) else None,
            ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def shared_storage_2cta(self, num_mbar: int, lay: dict):
        """One CTA's smem in a 2-CTA pair: the mbarriers, the pair's TMEM dealloc mbarrier, LSE / dPsum,
        the dQ staging (D / 2 columns), K, V, Q, Q^T, dO, dO^T, K^T, and dS^T followed by the half of it
        that goes to the peer (one buffer: the exchange half is addressed from dS^T's base)."""
        dt, align = self.dtype, self.buffer_align_bytes
        ds_elems = cute.cosize(lay["sdSt"]) + self.tile_n * self.tile_m // 2
        if const_expr(self.shared_rings):
            return self.shared_storage_2cta_shared(num_mbar, lay, ds_elems)

        @cute.struct
        class SharedStorage2Cta:
            mbar: cute.struct.MemRange[cutlass.Int64, num_mbar]
            tmem_dealloc_mbar: cutlass.Int64
            tmem_holding_buf: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.q_stages * self.tile_m], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, self.do_stages * self.tile_m], 128]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, 4 * DQ_GROUP_ROWS * self.dq_cols], 128]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sK"])], align]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sV"])], align]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sQ"])], align]
            sQt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sQmn"])], align]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sdO"])], align]
            sdOt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sdOmn"])], align]
            sKt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sKmn"])], align]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, ds_elems], align]

        return SharedStorage2Cta

    def shared_storage_2cta_shared(self, num_mbar: int, lay: dict, ds_elems: int):
        """shared_storage_2cta for the serial 2-CTA schedule ((192, 128), bwd_two_cta_shared_rings): Q and
        Q^T in one buffer (the q ring's stage), dO and dO^T in another; the dQ staging holds
        dq_group_rows rows per warp."""
        dt, align = self.dtype, self.buffer_align_bytes

        @cute.struct
        class SharedStorage2CtaShared:
            mbar: cute.struct.MemRange[cutlass.Int64, num_mbar]
            tmem_dealloc_mbar: cutlass.Int64
            tmem_holding_buf: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.q_stages * self.tile_m], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, self.do_stages * self.tile_m], 128]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, 4 * self.dq_group_rows * self.dq_cols], 128]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sK"])], align]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sV"])], align]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sQ"])], align]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sdO"])], align]
            sKt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sKmn"])], align]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, ds_elems], align]

        return SharedStorage2CtaShared

    def shared_storage_dv(self, num_mbar: int, lay: dict):
        """Pass dv's smem (hd256: 192.5 KiB): the mbarriers, LSE, K, the Q ring and the dO ring (no V,
        dS, dQ staging or dPsum: nothing reads them in this pass)."""
        dt, align = self.dtype, self.buffer_align_bytes

        @cute.struct
        class SharedStorageDv:
            mbar: cute.struct.MemRange[cutlass.Int64, num_mbar]
            tmem_holding_buf: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.q_stages * self.tile_m], 128]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sK"])], align]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sQ"])], align]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay["sdO"])], align]

        return SharedStorageDv

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mK: cute.Tensor, mQ: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mdQacc: cute.Tensor, mdQsem: cute.Tensor, lse_exact: tuple, mdK: cute.Tensor,
               mdV: cute.Tensor,
               tma_atom_K: cute.CopyAtom, tma_atom_Q: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, softmax_scale: Float32, window_left: Int32, window_right: Int32,
               sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sdOmn_layout: cute.ComposedLayout, sQmn_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sKmn_layout: cute.ComposedLayout, sdSt_layout: cute.ComposedLayout,
               tP_layout: cute.ComposedLayout, tdS_layout: cute.ComposedLayout,
               mma_s: cute.TiledMma, mma_dp: cute.TiledMma, mma_dv: cute.TiledMma, mma_dk: cute.TiledMma,
               mma_dq: cute.TiledMma, SharedStorage: cutlass.Constexpr, softcap: Optional[Float32],
               extra: tuple = (), seqs: tuple = ()):
        """lse_exact: the exact-LSE path's (exact flags (num_m_blocks, heads, batch), LSE hi, LSE lo
        (seqlen_q, heads, batch)). extra (2-CTA only): the TMA tensors and atoms of Q^T, dO^T and K^T.
        seqs (packed configs only): (cu_seqlens_q, cu_seqlens_k, seqused_q or None, seqused_k or None,
        max_seqlen_k)."""
        mmas = (mma_s, mma_dp, mma_dv, mma_dk, mma_dq)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.roles["load"][0]:
            for atom in (tma_atom_K, tma_atom_Q, tma_atom_V, tma_atom_dO):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.two_cta):
                for atom in extra[3:]:
                    cpasync.prefetch_descriptor(atom)

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        ledger = ArrivalLedger(self.specs)
        self.ledger = ledger  # the raw 2-CTA barriers (dsx, relay) record their arrivals here (ledger_note)
        cta_v = 0  # this CTA's rank in its pair (0: the leader, which issues the MMAs); 1-CTA: 0
        is_leader = True
        if const_expr(self.two_cta):
            cluster_vmnk = cute.tiled_divide(cute.make_layout((self.cta_group, 1, 1)), (mma_s.thr_id.shape,))
            pipes = self.make_pipelines_2cta(storage.mbar.data_ptr(), ledger, cluster_vmnk, warp_idx)
            cta_v = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            is_leader = cta_v == 0
            # the dealloc handshake's mbarrier is initialized by the allocator warp here, before the
            # cluster arrive that publishes every barrier init to the peer CTA
            tmem = TmemAllocator(storage.tmem_holding_buf.ptr,
                                 barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_PTR_BARRIER,
                                                                            num_threads=self.tmem_users),
                                 allocator_warp_id=self.roles["mma"][0], is_two_cta=True,
                                 two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr, arch="sm_100")
            # the two raw barriers of the pair (bwd_pipeline_specs_2cta: dsx, relay), counts from the spec
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for name in ("dsx", "relay"):
                        cute.arch.mbarrier_init(pipes[name], self.specs[name].full_arrivals())
            pipeline_init_arrive(cluster_shape_mn=cluster_vmnk, is_relaxed=True)
        else:
            pipes = self.make_pipelines(storage.mbar.data_ptr(), ledger)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

        def view(buf, lay):
            return cute.make_tensor(cute.recast_ptr(buf.iterator, lay.inner, dtype=self.dtype), lay.outer)

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sV, sdSt, sD, sdQ = None, None, None, None  # pass dv: not in its smem
        if const_expr(not self.dv_pass):
            sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
            sdSt = storage.sdS.get_tensor(sdSt_layout.outer, swizzle=sdSt_layout.inner)  # (tile_n, tile_m, 1)
        if const_expr(self.dv_pass):  # K, Q (S^T), dO through its MN-major view (B of dV)
            smem_t = dict(sK=sK, sQ=sQ, sdO=sdO, sdOmn=view(sdO, sdOmn_layout))
        elif const_expr(self.dkdq_pass):  # V, dO: the chunk ring (dP^T only)
            smem_t = dict(sK=sK, sV=sV, sQ=sQ, sdO=sdO, sdSt=sdSt, sQmn=view(sQ, sQmn_layout),
                          sKmn=view(sK, sKmn_layout), sdS=view(sdSt, sdS_layout))
        elif const_expr(self.shared_rings):
            # Q^T, dO^T: the q / do ring's buffer again (two uses per step); K^T on its own
            smem_t = dict(sK=sK, sV=sV, sQ=sQ, sdO=sdO, sdSt=sdSt,
                          sQmn=storage.sQ.get_tensor(sQmn_layout.outer, swizzle=sQmn_layout.inner),
                          sdOmn=storage.sdO.get_tensor(sdOmn_layout.outer, swizzle=sdOmn_layout.inner),
                          sKmn=storage.sKt.get_tensor(sKmn_layout.outer, swizzle=sKmn_layout.inner),
                          sdS=view(sdSt, sdS_layout))
        elif const_expr(self.two_cta):
            # Q^T, dO^T, K^T: loaded on their own (each CTA's half along the MMA's N)
            smem_t = dict(sK=sK, sV=sV, sQ=sQ, sdO=sdO, sdSt=sdSt,
                          sQmn=storage.sQt.get_tensor(sQmn_layout.outer, swizzle=sQmn_layout.inner),
                          sdOmn=storage.sdOt.get_tensor(sdOmn_layout.outer, swizzle=sdOmn_layout.inner),
                          sKmn=storage.sKt.get_tensor(sKmn_layout.outer, swizzle=sKmn_layout.inner),
                          sdS=view(sdSt, sdS_layout))
        else:
            smem_t = dict(sK=sK, sV=sV, sQ=sQ, sdO=sdO, sdSt=sdSt, sQmn=view(sQ, sQmn_layout),
                          sdOmn=view(sdO, sdOmn_layout), sKmn=view(sK, sKmn_layout), sdS=view(sdSt, sdS_layout))
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.tile_m, self.q_stages)))
        if const_expr(not self.dv_pass):
            sD = storage.sD.get_tensor(cute.make_layout((self.tile_m, self.do_stages)))
            # (D, DQ_GROUP_ROWS, reduce warp): per warp a block of whole rows, row-major like the accumulator
            # (2-CTA: D / 2 columns per row, the thread's half)
            sdQ = storage.sdQ.get_tensor(cute.make_layout((self.dq_cols, self.dq_group_rows, 4)))
        if const_expr(not self.two_cta):
            tmem = TmemAllocator(storage.tmem_holding_buf.ptr,
                                 barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_PTR_BARRIER,
                                                                            num_threads=self.tmem_users),
                                 allocator_warp_id=self.roles["mma"][0], arch="sm_100")

        window = (window_left, window_right) if const_expr(self.cfg.local) else None
        if const_expr(self.packed):
            # this CTA's sequence: every global view starts at it (batch index 0 from here on)
            tile, seq = self.tile_coords_packed(mQ, mK, window, seqs)
            mQ, mdO = [cute.domain_offset((seq.offset_q, 0, 0, 0), t) for t in (mQ, mdO)]
            mK, mV, mdK, mdV = [cute.domain_offset((seq.offset_k, 0, 0, 0), t) for t in (mK, mV, mdK, mdV)]
            mLSE2, mD = [cute.domain_offset((seq.padded_offset_q, 0, 0), t) for t in (mLSE2, mD)]
            mdQacc = cute.domain_offset((seq.padded_offset_q, 0, 0, 0), mdQacc)
            mdQsem = cute.domain_offset((seq.padded_offset_q // self.tile_m, 0, 0), mdQsem)
            mExact, mLSEhi, mLSElo = lse_exact  # flags: padded tiles; hi, lo: packed rows
            lse_exact = (cute.domain_offset((seq.padded_offset_q // self.tile_m, 0, 0), mExact),
                         cute.domain_offset((seq.offset_q, 0, 0), mLSEhi),
                         cute.domain_offset((seq.offset_q, 0, 0), mLSElo))
        elif const_expr(self.role_tiles):
            # pass dkdq, the serial 2-CTA pair: each role computes its coordinates after its setmaxnreg
            # (kept live from here, the query block count spilled: pass dkdq 1 STL + 3 LDL at every
            # register split tried; the (192, 128) pair 1 STL + 9 LDL at 136 / 136 / 104)
            tile = None
        else:
            tile = self.tile_coords(mQ, mK, window)
        if const_expr(self.two_cta):
            # every barrier of both CTAs initialized (the cluster arrive above) before any remote
            # arrive, TMA, DSMEM copy or the pair's TMEM allocation
            pipeline_init_wait(cluster_shape_mn=cluster_vmnk)

        if warp_idx < self.roles["compute"][0]:
            self.set_regs(self.regs.reduce)
            self.wait_tmem_alloc()
            if const_expr(self.two_cta):
                self.reduce_2cta(mmas[4], mdQacc, sdQ, pipes, self.pass_tile(tile, mQ, mK, window), cta_v)
            elif const_expr(self.dkdq_pass):
                self.reduce(mmas[4], mdQacc, mdQsem, sdQ, pipes, self.pass_tile(tile, mQ, mK, window), window)
            elif const_expr(not self.dv_pass):  # pass dv has no dQ: the reduce warps only take part in TMEM's barrier
                self.reduce(mmas[4], mdQacc, mdQsem, sdQ, pipes, tile, window)
            self.release_tmem()
        elif warp_idx < self.roles["mma"][0]:
            self.set_regs(self.regs.compute)
            self.wait_tmem_alloc()
            if const_expr(self.two_cta):
                self.compute(mmas, sLSE, lse_exact, sD, sdSt, mdK, mdV, pipes, self.pass_tile(tile, mQ, mK, window),
                             softmax_scale, window, softcap, cta_v)
            elif const_expr(self.dkdq_pass):
                self.compute(mmas, sLSE, lse_exact, sD, sdSt, mdK, mdV, pipes, self.pass_tile(tile, mQ, mK, window),
                             softmax_scale, window, softcap)
            else:
                self.compute(mmas, sLSE, lse_exact, sD, sdSt, mdK, mdV, pipes, tile, softmax_scale, window, softcap)
            self.release_tmem()
        else:
            self.set_regs(self.regs.other)
            if warp_idx == self.roles["mma"][0]:
                tmem.allocate(self.tmem_cols)  # 2-CTA: .cta_group::2, both CTAs' allocator warps
                self.wait_tmem_alloc()
                if const_expr(self.two_cta):
                    if is_leader:  # the pair's MMAs and their commits come from the leader only
                        if const_expr(self.serial_2cta):
                            self.mma_serial(mmas, smem_t, tP_layout, tdS_layout, pipes,
                                            self.pass_tile(tile, mQ, mK, window))
                        else:
                            self.mma_2cta(mmas, smem_t, tP_layout, tdS_layout, pipes, tile)
                elif const_expr(self.dv_pass):
                    self.mma_dv_pass(mmas, smem_t, tP_layout, pipes, tile)
                elif const_expr(self.dkdq_pass):
                    self.mma_serial(mmas, smem_t, tP_layout, tdS_layout, pipes, self.pass_tile(tile, mQ, mK, window))
                elif const_expr(self.serial):
                    self.mma_serial(mmas, smem_t, tP_layout, tdS_layout, pipes, tile)
                else:
                    self.mma(mmas, smem_t, tP_layout, tdS_layout, pipes, tile)
                # 2-CTA: free() first exchanges an arrive with the peer's allocator warp (each CTA's
                # TMEM users are done), then deallocates .cta_group::2
                tmem.relinquish_alloc_permit()
                named_barrier_sync(TMEM_PTR_BARRIER, self.tmem_users)
                tcgen05_fence_after()
                tmem.free(tmem.retrieve_ptr(Float32), self.tmem_cols)
            elif warp_idx == self.roles["load"][0]:
                if const_expr(self.two_cta):
                    self.load_2cta(mmas, mK, mQ, mV, mdO, mLSE2, mD, smem_t, sLSE, sD, tma_atom_K, tma_atom_Q,
                                   tma_atom_V, tma_atom_dO, extra, pipes, self.pass_tile(tile, mQ, mK, window), cta_v)
                elif const_expr(self.dkdq_pass):
                    self.load(mmas, mK, mQ, mV, mdO, mLSE2, mD, smem_t, sLSE, sD, tma_atom_K, tma_atom_Q, tma_atom_V,
                              tma_atom_dO, pipes, self.pass_tile(tile, mQ, mK, window))
                else:
                    self.load(mmas, mK, mQ, mV, mdO, mLSE2, mD, smem_t, sLSE, sD, tma_atom_K, tma_atom_Q, tma_atom_V,
                              tma_atom_dO, pipes, tile)
            if const_expr(self.two_cta):
                if warp_idx == self.roles["relay"][0]:
                    self.relay(pipes, self.pass_tile(tile, mQ, mK, window))
        ledger.check()

    def pass_tile(self, tile, mQ, mK, window):
        """A role's tile: the one computed before the role branch where there is one (the packed tile:
        the sequence's offsets apply to every view; every config but pass dkdq and the serial 2-CTA
        pair), else the dense one, computed here after the role's setmaxnreg (pass dkdq, serial 2-CTA)."""
        return tile if const_expr(self.packed or tile is not None) else self.tile_coords(mQ, mK, window)

    def set_regs(self, regs: int):
        if const_expr(BwdRegisterPlan.is_increase(regs)):
            cute.arch.setmaxregister_increase(regs)
        else:
            cute.arch.setmaxregister_decrease(regs)

    def wait_tmem_alloc(self):
        tcgen05_fence_before()
        named_barrier_sync(TMEM_PTR_BARRIER, self.tmem_users)
        tcgen05_fence_after()

    def release_tmem(self):
        tcgen05_fence_before()
        named_barrier_arrive(TMEM_PTR_BARRIER, self.tmem_users)

    def tmem_base(self):
        """The TMEM base: the MMA warp allocates all TMEM_COLUMNS columns, so the allocation starts at
        lane 0, column 0 (address 0), as in the forward."""
        if const_expr(self.tmem_cols != TMEM_COLUMNS):
            raise NotImplementedError("flash4 bwd_sm100: a partial TMEM allocation needs tmem.retrieve_ptr")
        return cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)

    def make_pipelines(self, mbar_ptr, ledger: ArrivalLedger) -> dict:
        """Every pipeline of bwd_pipeline_specs, from this kernel's role table (elected-lane parties
        count one arrival per warp), wrapped in a Pipe that checks the init counts against the spec."""
        warps = {role: len(w) for role, w in self.roles.items()}
        one = thread_group(1)
        pipes, offset = {}, 0

        def add(name, cls, producer, consumer, **kw):
            nonlocal offset
            spec = self.specs[name]
            p = cls.create(barrier_storage=mbar_ptr + offset, num_stages=spec.stages, producer_group=producer,
                           consumer_group=consumer, defer_sync=True, **kw)
            offset += 2 * spec.stages
            pipes[name] = Pipe(spec, p, ledger)

        compute, reduce = thread_group(warps["compute"]), thread_group(warps["reduce"])
        add("kv", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes["kv"])
        add("q", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes["q"])
        add("lse", pipeline.PipelineTmaAsync, one, compute, tx_count=self.tma_bytes["lse"])
        add("do", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes["do"])
        if const_expr(not self.dv_pass):  # pass dv: no dPsum, dP^T, dS^T, dQ (bwd_pipeline_specs)
            add("dpsum", pipeline.PipelineTmaAsync, one, compute, tx_count=self.tma_bytes["dpsum"])
        add("s", pipeline.PipelineUmmaAsync, one, compute)
        if const_expr(not self.dv_pass):
            add("dp", pipeline.PipelineUmmaAsync, one, compute)
            add("ds", pipeline.PipelineAsyncUmma, compute, one)
            add("dq", pipeline.PipelineUmmaAsync, one, reduce)
        add("dkv", pipeline.PipelineUmmaAsync, one, compute)
        return pipes

    def make_pipelines_2cta(self, mbar_ptr, ledger: ArrivalLedger, cluster_vmnk, warp_idx) -> dict:
        """The pipelines of bwd_pipeline_specs_2cta: the TMA and MMA-bridging ones get the pair's
        cluster layout (the leader's expect_tx for both CTAs' bytes, the leader's commits multicast to
        both CTAs, the thread parties' arrivals routed to the leader's barrier, counting both CTAs);
        LSE / dPsum stay CTA-local. dsx and relay are raw mbarriers (their pointers; the kernel
        initializes them with the spec's counts)."""
        warps = {role: len(w) for role, w in self.roles.items()}
        one = thread_group(1)
        pipes, offset = {}, 0
        pair = {"cta_layout_vmnk": cluster_vmnk}
        g = self.cta_group

        def add(name, cls, producer, consumer, **kw):
            nonlocal offset
            spec = self.specs[name]
            p = cls.create(barrier_storage=mbar_ptr + offset, num_stages=spec.stages, producer_group=producer,
                           consumer_group=consumer, defer_sync=True, **kw)
            offset += 2 * spec.stages
            pipes[name] = Pipe(spec, p, ledger)

        compute = thread_group(warps["compute"])
        add("kv", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes["kv"], **pair)
        add("q", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes["q"], **pair)
        if const_expr(not self.shared_rings):  # shared rings: Q^T comes through q
            add("qt", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes["qt"], **pair)
        add("lse", pipeline.PipelineTmaAsync, one, compute, tx_count=self.tma_bytes["lse"])
        add("do", pipeline.PipelineTmaUmma, one, one, tx_count=self.tma_bytes["do"], **pair)
        add("dpsum", pipeline.PipelineTmaAsync, one, compute, tx_count=self.tma_bytes["dpsum"])
        add("s", pipeline.PipelineUmmaAsync, one, thread_group(g * warps["compute"]), **pair)
        add("dp", pipeline.PipelineUmmaAsync, one, thread_group(g * warps["compute"]), **pair)
        add("ds", pipeline.PipelineAsyncUmma, thread_group(g * warps["compute"]), one, **pair)
        add("dq", pipeline.PipelineUmmaAsync, one, thread_group(g * warps["reduce"]), **pair)
        add("dkv", pipeline.PipelineUmmaAsync, one, compute, **pair)
        for name in ("dsx", "relay"):
            pipes[name] = mbar_ptr + offset  # full barrier (its empty slot unused: never released)
            offset += 2 * self.specs[name].stages
        return pipes

    # ---------------------------------------------------------------- the CTA's work (all roles)
    def tile_coords(self, mQ, mK, window):
        """(n_block, head_kv, batch, group, m_min, num_m, seqlen_q, seqlen_k) of this CTA (window: None or
        the local config's (left, right) sides, which narrow the query blocks): blockIdx.x =
        ((batch * nheads_k) + head_kv) * n_blocks + n_block (flash4.launch.bwd_grid's order). The CTA
        runs group * num_m steps: query head head_kv * group + i // num_m, query block m_min + i % num_m."""
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        if const_expr(self.two_cta):
            # whole pairs per (head, batch): the pair of n_block // 2 covers 2 tile_n keys; CTA v of the
            # cluster (blockIdx.x % 2) holds keys (n_block // 2) 2 tile_n + v tile_n ..
            n_blocks = cute.ceil_div(seqlen_k, self.cta_group * self.tile_n) * self.cta_group
        else:
            n_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        nheads_k = mK.shape[2]
        bid = cute.arch.block_idx()[0]
        n_block = bid % n_blocks
        rest = bid // n_blocks
        head_kv, batch = rest % nheads_k, rest // nheads_k
        group = mQ.shape[2] // nheads_k
        if const_expr(self.two_cta):
            # both CTAs of the pair walk the query blocks of the pair's keys (their MMAs are joint)
            m_min, m_max = g.m_block_range(n_block // self.cta_group, seqlen_q, seqlen_k, self.tile_m,
                                           self.cta_group * self.tile_n, self.causal, DEVICE_OPS, window)
        else:
            m_min, m_max = g.m_block_range(n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal,
                                           DEVICE_OPS, window)
        num_m = cutlass.max(m_max - m_min, 0)
        return (n_block, head_kv, batch, group, m_min, num_m, seqlen_q, seqlen_k)

    def tile_coords_packed(self, mQ, mK, window, seqs):
        """tile_coords for packed sequences: (the tile tuple with batch index 0 and the sequence's
        seqlen_q / seqlen_k, SeqInfo of the sequence). blockIdx.x decodes with the n_blocks of
        max_seqlen_k (flash4.launch.bwd_grid); a CTA whose key block starts at or past its sequence's
        seqlen_k runs no step (it stores nothing: every key >= seqlen_k)."""
        cu_q, cu_k, used_q, used_k, max_seqlen_k = seqs
        n_blocks = (max_seqlen_k + (self.tile_n - 1)) // self.tile_n
        nheads_k = mK.shape[2]
        bid = cute.arch.block_idx()[0]
        n_block = bid % n_blocks
        rest = bid // n_blocks
        head_kv, batch = rest % nheads_k, rest // nheads_k
        group = mQ.shape[2] // nheads_k
        seq = SeqInfo(batch, mQ.shape[0], mK.shape[0], cu_q, cu_k, used_q, used_k, tile_m_pad=self.tile_m)
        m_min, m_max = g.m_block_range(n_block, seq.seqlen_q, seq.seqlen_k, self.tile_m, self.tile_n, self.causal,
                                       DEVICE_OPS, window)
        num_m = cutlass.max(m_max - m_min, 0)
        num_m = cutlass.select_(n_block * self.tile_n < seq.seqlen_k, num_m, Int32(0))
        return (n_block, head_kv, Int32(0), group, m_min, num_m, seq.seqlen_q, seq.seqlen_k), seq

    def step_coords(self, tile, i):
        """(query head, query block) of step i."""
        _, head_kv, _, group, m_min, num_m, _, _ = tile
        return head_kv * group + i // num_m, m_min + i % num_m

    # ---------------------------------------------------------------- load warp
    @cute.jit
    def load(self, mmas, mK, mQ, mV, mdO, mLSE2, mD, smem_t, sLSE, sD, tma_atom_K, tma_atom_Q, tma_atom_V,
             tma_atom_dO, pipes, tile):
        """K, V once; per step Q[m], LSE[m] (q ring), dO[m], D[m] (do ring), in the MMA's order."""
        mma_s, mma_dp = mmas[0], mmas[1]
        n_block, head_kv, batch, group, m_min, num_m, _, _ = tile
        n_steps = group * num_m
        thr_s, thr_dp = mma_s.get_slice(0), mma_dp.get_slice(0)
        one_cta = cute.make_layout(1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        d_state = None  # pass dkdq: dPsum's own ring state (the do ring advances per chunk)
        if const_expr(self.dkdq_pass):
            d_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        if n_steps > 0:
            # (MMA, MMA_M, MMA_K, n_blocks): K as S^T's A, V as dP^T's A
            tSgK = thr_s.partition_A(cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.hdim), (None, 0)))
            tPgV, tVsV, tVgV = None, None, None  # pass dv does not read V
            if const_expr(self.dkdq_pass):  # (MMA, MMA_M, MMA_K, n_blocks, chunks): V's BWD_VDO_COLS-column chunks
                tPgV = thr_dp.partition_A(cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.vdo_cols),
                                                          (None, None)))
            elif const_expr(not self.dv_pass):
                tPgV = thr_dp.partition_A(cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.hdim_v),
                                                          (None, 0)))
            tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one_cta, cute.group_modes(smem_t["sK"], 0, 3),
                                               cute.group_modes(tSgK, 0, 3))
            if const_expr(not self.dv_pass):
                tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one_cta, cute.group_modes(smem_t["sV"], 0, 3),
                                                   cute.group_modes(tPgV, 0, 3))
            pipe_kv = pipes["kv"]
            pipe_kv.acquire(kv_state, "load")
            cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, 0], tma_bar_ptr=pipe_kv.barrier_full(0))
            if const_expr(not (self.dv_pass or self.dkdq_pass)):  # pass dkdq: V streams with dO (below)
                cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, 0], tma_bar_ptr=pipe_kv.barrier_full(0))
            for i in cutlass.range(n_steps, unroll=1):
                head, m_block = self.step_coords(tile, i)
                tSgQ = thr_s.partition_B(cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.hdim), (None, 0)))
                if const_expr(self.dkdq_pass):
                    tPgdO = thr_dp.partition_B(cute.local_tile(mdO[None, None, head, batch],
                                                               (self.tile_m, self.vdo_cols), (None, None)))
                else:
                    tPgdO = thr_dp.partition_B(cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.hdim_v),
                                                               (None, 0)))
                tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one_cta, cute.group_modes(smem_t["sQ"], 0, 3),
                                                   cute.group_modes(tSgQ, 0, 3))
                tOsO, tOgO = cpasync.tma_partition(tma_atom_dO, 0, one_cta, cute.group_modes(smem_t["sdO"], 0, 3),
                                                   cute.group_modes(tPgdO, 0, 3))
                pipes["q"].acquire(q_state, "load")
                cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, q_state.index],
                          tma_bar_ptr=pipes["q"].barrier_full(q_state.index))
                self.load_row_stats(pipes["lse"], q_state, mLSE2, sLSE, head, batch, m_block)
                q_state = next_state(q_state)
                if const_expr(self.dkdq_pass):
                    # chunk c of V and of dO[m] per stage of the do ring, in dP^T's k-block order
                    for c in cutlass.range(self.vdo_chunks, unroll=1):
                        pipes["do"].acquire(do_state, "load")
                        cute.copy(tma_atom_V, tVgV[None, n_block, c], tVsV[None, do_state.index],
                                  tma_bar_ptr=pipes["do"].barrier_full(do_state.index))
                        cute.copy(tma_atom_dO, tOgO[None, m_block, c], tOsO[None, do_state.index],
                                  tma_bar_ptr=pipes["do"].barrier_full(do_state.index))
                        do_state = next_state(do_state)
                    self.load_row_stats(pipes["dpsum"], d_state, mD, sD, head, batch, m_block)
                    d_state = next_state(d_state)
                else:
                    pipes["do"].acquire(do_state, "load")
                    cute.copy(tma_atom_dO, tOgO[None, m_block], tOsO[None, do_state.index],
                              tma_bar_ptr=pipes["do"].barrier_full(do_state.index))
                    if const_expr(not self.dv_pass):  # pass dv: dS is not computed, D not read
                        self.load_row_stats(pipes["dpsum"], do_state, mD, sD, head, batch, m_block)
                    do_state = next_state(do_state)
        pipes["q"].producer_tail(q_state)
        pipes["do"].producer_tail(do_state)

    @cute.jit
    def load_row_stats(self, pipe, state, mX, sX, head, batch, m_block):
        """tile_m fp32 row statistics of query block m_block (the padded layout: always in bounds)
        -> sX[:, state.index] with one bulk copy on the stage's barrier."""
        pipe.acquire(state, "load")
        gX = cute.local_tile(mX[None, head, batch], (self.tile_m,), (m_block,))
        with cute.arch.elect_one():
            bulk_copy_g2s(sX[None, state.index].iterator, gX.iterator, pipe.barrier_full(state.index),
                          self.tile_m * 4)

    @cute.jit
    def load_2cta(self, mmas, mK, mQ, mV, mdO, mLSE2, mD, smem_t, sLSE, sD, tma_atom_K, tma_atom_Q, tma_atom_V,
                  tma_atom_dO, extra, pipes, tile, cta_v):
        """2-CTA load warp (both CTAs): this CTA's half of every operand (the MMA slice of its rank).
        K, V and K^T once (kv); per step Q[m] (q), LSE[m], dO[m] with dO^T[m] (do), D[m], Q^T[m] (qt),
        in the order the leader's MMA warp consumes them. Each CTA's .cta_group::2 TMA completes on the
        leader's barrier; the leader's load warp expects both CTAs' bytes (PipelineTmaUmma).
        Shared rings (the serial (192, 128) pair): per step Q[m] (q), LSE[m], dO[m] (do), D[m], then Q^T[m]
        into the q stage once S^T released it and dO^T[m] into the do stage once dP^T released it (LSE
        and D keep their own ring states: the q and do rings advance twice per step)."""
        tma_Qt, tma_dOt, tma_Kt, tma_atom_Qt, tma_atom_dOt, tma_atom_Kt = extra
        mma_s, mma_dp, mma_dv, mma_dk, mma_dq = mmas
        n_block, head_kv, batch, group, m_min, num_m, _, _ = tile
        n_steps = group * num_m
        pair_n = n_block // self.cta_group
        thr_s, thr_dp, thr_dv, thr_dk, thr_dq = [m.get_slice(cta_v) for m in mmas]
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        qt_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        lse_state, d_state = None, None  # shared rings: the LSE / D rings' own states
        if const_expr(self.shared_rings):
            lse_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
            d_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        part = self.tma_part

        pair_tile = self.cta_group * self.tile_n
        if n_steps > 0:
            tKsK, tKgK = part(tma_atom_K, smem_t["sK"], thr_s.partition_A(
                cute.local_tile(mK[None, None, head_kv, batch], (pair_tile, self.hdim), (None, 0))))
            tVsV, tVgV = part(tma_atom_V, smem_t["sV"], thr_dp.partition_A(
                cute.local_tile(mV[None, None, head_kv, batch], (pair_tile, self.hdim_v), (None, 0))))
            tKtsK, tKtgK = part(tma_atom_Kt, smem_t["sKmn"], thr_dq.partition_B(
                cute.local_tile(tma_Kt[None, None, head_kv, batch], (self.hdim, pair_tile), (0, None))))
            pipe_kv = pipes["kv"]
            pipe_kv.acquire(kv_state, "load")
            cute.copy(tma_atom_K, tKgK[None, pair_n], tKsK[None, 0], tma_bar_ptr=pipe_kv.barrier_full(0))
            cute.copy(tma_atom_V, tVgV[None, pair_n], tVsV[None, 0], tma_bar_ptr=pipe_kv.barrier_full(0))
            cute.copy(tma_atom_Kt, tKtgK[None, pair_n], tKtsK[None, 0], tma_bar_ptr=pipe_kv.barrier_full(0))
            for i in cutlass.range(n_steps, unroll=1):
                head, m_block = self.step_coords(tile, i)
                tQsQ, tQgQ = part(tma_atom_Q, smem_t["sQ"], thr_s.partition_B(
                    cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.hdim), (None, 0))))
                tOsO, tOgO = part(tma_atom_dO, smem_t["sdO"], thr_dp.partition_B(
                    cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.hdim_v), (None, 0))))
                tOtsO, tOtgO = part(tma_atom_dOt, smem_t["sdOmn"], thr_dv.partition_B(
                    cute.local_tile(tma_dOt[None, None, head, batch], (self.hdim_v, self.tile_m), (0, None))))
                tQtsQ, tQtgQ = part(tma_atom_Qt, smem_t["sQmn"], thr_dk.partition_B(
                    cute.local_tile(tma_Qt[None, None, head, batch], (self.hdim, self.tile_m), (0, None))))
                if const_expr(self.shared_rings):
                    pipes["q"].acquire(q_state, "load")
                    cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, q_state.index],
                              tma_bar_ptr=pipes["q"].barrier_full(q_state.index))
                    q_state = next_state(q_state)
                    self.load_row_stats(pipes["lse"], lse_state, mLSE2, sLSE, head, batch, m_block)
                    lse_state = next_state(lse_state)
                    pipes["do"].acquire(do_state, "load")
                    cute.copy(tma_atom_dO, tOgO[None, m_block], tOsO[None, do_state.index],
                              tma_bar_ptr=pipes["do"].barrier_full(do_state.index))
                    do_state = next_state(do_state)
                    self.load_row_stats(pipes["dpsum"], d_state, mD, sD, head, batch, m_block)
                    d_state = next_state(d_state)
                    pipes["q"].acquire(q_state, "load")  # S^T(i) read Q: Q^T into the same stage
                    cute.copy(tma_atom_Qt, tQtgQ[None, m_block], tQtsQ[None, q_state.index],
                              tma_bar_ptr=pipes["q"].barrier_full(q_state.index))
                    q_state = next_state(q_state)
                    pipes["do"].acquire(do_state, "load")  # dP^T(i) read dO: dO^T into the same stage
                    cute.copy(tma_atom_dOt, tOtgO[None, m_block], tOtsO[None, do_state.index],
                              tma_bar_ptr=pipes["do"].barrier_full(do_state.index))
                    do_state = next_state(do_state)
                else:
                    pipes["q"].acquire(q_state, "load")
                    cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, q_state.index],
                              tma_bar_ptr=pipes["q"].barrier_full(q_state.index))
                    self.load_row_stats(pipes["lse"], q_state, mLSE2, sLSE, head, batch, m_block)
                    q_state = next_state(q_state)
                    pipes["do"].acquire(do_state, "load")
                    cute.copy(tma_atom_dO, tOgO[None, m_block], tOsO[None, do_state.index],
                              tma_bar_ptr=pipes["do"].barrier_full(do_state.index))
                    cute.copy(tma_atom_dOt, tOtgO[None, m_block], tOtsO[None, do_state.index],
                              tma_bar_ptr=pipes["do"].barrier_full(do_state.index))
                    self.load_row_stats(pipes["dpsum"], do_state, mD, sD, head, batch, m_block)
                    do_state = next_state(do_state)
                    pipes["qt"].acquire(qt_state, "load")
                    cute.copy(tma_atom_Qt, tQtgQ[None, m_block], tQtsQ[None, qt_state.index],
                              tma_bar_ptr=pipes["qt"].barrier_full(qt_state.index))
                    qt_state = next_state(qt_state)
        pipes["q"].producer_tail(q_state)
        if const_expr(not self.shared_rings):
            pipes["qt"].producer_tail(qt_state)
        pipes["do"].producer_tail(do_state)

    @staticmethod
    def tma_part(atom, s, gt):
        """(smem, gmem) TMA partitions of one operand (no multicast: the pair splits each MMA operand)."""
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 3),
                                     cute.group_modes(gt, 0, 3))

    @cute.jit
    def relay(self, pipes, tile):
        """2-CTA relay warp (both CTAs), once per step: wait until the peer's half of dS^T landed in
        this CTA's smem (dsx: the peer's DSMEM copy completed its bytes), then one elected arrive on the
        leader's relay barrier (a remote arrive from the follower). The leader's MMA warp waits for
        both CTAs' arrivals before dQ = dS K reads the pair's dS."""
        n_steps = tile[3] * tile[5]
        phase = Int32(0)
        self.ledger_note("relay", "full", "relay")
        for _ in cutlass.range(n_steps, unroll=1):
            cute.arch.mbarrier_wait(pipes["dsx"], phase)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(pipes["relay"], Int32(0))
            phase = phase ^ 1

    # ---------------------------------------------------------------- MMA warp
    @cute.jit
    def mma_operands(self, mmas, smem_t, tP_layout, tdS_layout):
        """The MMA warp's operands, 1-CTA and 2-CTA alike: smem descriptors (MMA, MMA_M/N, MMA_K[, stage])
        of K, Q, V, dO, their MN-major views and dS; the five TMEM accumulators (S, dP, dV, dK, dQ at
        bwd_tmem_map's columns); the P^T / dS^T halves (one per compute warpgroup) as TMEM A operands."""
        mma_s, mma_dp, mma_dv, mma_dk, mma_dq = mmas
        base = self.tmem_base()
        tSrK = mma_s.make_fragment_A(smem_t["sK"])[None, None, None, 0]
        tSrQ = mma_s.make_fragment_B(smem_t["sQ"])
        if const_expr(self.dkdq_pass):  # V: the chunk ring (a stage mode, like dO's); no dV
            tPrV = mma_dp.make_fragment_A(smem_t["sV"])
        else:
            tPrV = mma_dp.make_fragment_A(smem_t["sV"])[None, None, None, 0]
        tPrdO = mma_dp.make_fragment_B(smem_t["sdO"])
        tVrdO, tVtV, tVrP = None, None, None
        if const_expr(not self.dkdq_pass):
            tVrdO = mma_dv.make_fragment_B(smem_t["sdOmn"])
        tKrQ = mma_dk.make_fragment_B(smem_t["sQmn"])
        tQrdS = mma_dq.make_fragment_A(smem_t["sdS"])[None, None, None, 0]
        tQrK = mma_dq.make_fragment_B(smem_t["sKmn"])[None, None, None, 0]
        tStS = self.tmem_acc(base, mma_s, self.mma_tiler_s, "S")
        tPtP = self.tmem_acc(base, mma_dp, self.mma_tiler_dp, "dP")
        if const_expr(not self.dkdq_pass):
            tVtV = self.tmem_acc(base, mma_dv, self.mma_tiler_dv, "dV")
        tKtK = self.tmem_acc(base, mma_dk, self.mma_tiler_dk, "dK")
        tQtQ = self.tmem_acc(base, mma_dq, self.mma_tiler_dq, "dQ")
        if const_expr(not self.dkdq_pass):
            tVrP = [self.tmem_operand(base, mma_dv, tP_layout, f"P{w}") for w in range(self.compute_wgs)]
        tKrdS = [self.tmem_operand(base, mma_dk, tdS_layout, f"dS{w}") for w in range(self.compute_wgs)]
        return tSrK, tSrQ, tPrV, tPrdO, tVrdO, tKrQ, tQrdS, tQrK, tStS, tPtP, tVtV, tKtK, tQtQ, tVrP, tKrdS

    @cute.jit
    def mma(self, mmas, smem_t, tP_layout, tdS_layout, pipes, tile):
        mma_s, mma_dp, mma_dv, mma_dk, mma_dq = mmas
        _, _, _, group, _, num_m, _, _ = tile
        n_steps = group * num_m
        (tSrK, tSrQ, tPrV, tPrdO, tVrdO, tKrQ, tQrdS, tQrK, tStS, tPtP, tVtV, tKtK, tQtQ, tVrP,
         tKrdS) = self.mma_operands(mmas, smem_t, tP_layout, tdS_layout)

        pipe_q, pipe_do, pipe_s, pipe_dp, pipe_ds, pipe_dq = (pipes[n] for n in ("q", "do", "s", "dp", "ds", "dq"))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        phase = Int32(0)  # s, ds: waited once per step
        dq_phase = Int32(0)  # dq empty, waited before dP^T(i+1): the i-th wait needs dQ(i) read out
        if n_steps > 0:
            pipes["kv"].wait_full(0, 0)
            pipe_q.wait_full(q_state.index, q_state.phase)
            if const_expr(self.packed):  # rows past the sequence -> 0 (zero_tail)
                valid_k = tile[7] - tile[0] * self.tile_n
                self.zero_tail(smem_t["sK"], 0, valid_k, self.tile_n)
                self.zero_tail(smem_t["sV"], 0, valid_k, self.tile_n)
                self.zero_tail(smem_t["sQ"], q_state.index, self.valid_q(tile, 0), self.tile_m)
            self.gemm(mma_s, tStS, [tSrK], tSrQ[None, None, None, q_state.index], False)
            pipe_s.arrive_full(0, "mma")
            pipe_do.wait_full(do_state.index, do_state.phase)
            if const_expr(self.packed):
                self.zero_tail(smem_t["sdO"], do_state.index, self.valid_q(tile, 0), self.tile_m)
            self.gemm(mma_dp, tPtP, [tPrV], tPrdO[None, None, None, do_state.index], False)
            pipe_dp.arrive_full(0, "mma")
            for i in cutlass.range(n_steps, unroll=1):
                pipe_s.wait_empty(0, phase)  # P^T(i) written
                tcgen05_fence_after()
                self.gemm(mma_dv, tVtV, tVrP, tVrdO[None, None, None, do_state.index], i > 0)
                pipe_do.arrive_empty(do_state.index, "mma")
                do_state = next_state(do_state)
                q_next = next_state(q_state)
                if i + 1 < n_steps:
                    pipe_q.wait_full(q_next.index, q_next.phase)
                    if const_expr(self.packed):
                        self.zero_tail(smem_t["sQ"], q_next.index, self.valid_q(tile, i + 1), self.tile_m)
                    self.gemm(mma_s, tStS, [tSrK], tSrQ[None, None, None, q_next.index], False)
                    pipe_s.arrive_full(0, "mma")
                pipe_ds.wait_full(0, phase)  # dS^T(i) in TMEM and smem
                tcgen05_fence_after()
                self.gemm(mma_dk, tKtK, tKrdS, tKrQ[None, None, None, q_state.index], i > 0)
                pipe_q.arrive_empty(q_state.index, "mma")
                q_state = q_next
                self.gemm(mma_dq, tQtQ, [tQrdS], tQrK, False)
                pipe_dq.arrive_full(0, "mma")
                pipe_ds.arrive_empty(0, "mma")
                if i + 1 < n_steps:
                    pipe_do.wait_full(do_state.index, do_state.phase)
                    if const_expr(self.packed):
                        self.zero_tail(smem_t["sdO"], do_state.index, self.valid_q(tile, i + 1), self.tile_m)
                    pipe_dq.wait_empty(0, dq_phase)  # dQ(i) read out: dP^T(i+1) overwrites its columns
                    tcgen05_fence_after()
                    dq_phase = dq_phase ^ 1
                    self.gemm(mma_dp, tPtP, [tPrV], tPrdO[None, None, None, do_state.index], False)
                    pipe_dp.arrive_full(0, "mma")
                phase = phase ^ 1
            pipes["dkv"].arrive_full(0, "mma")  # commits cover every earlier MMA: dK, dV final

    @cute.jit
    def mma_serial(self, mmas, smem_t, tP_layout, tdS_layout, pipes, tile):
        """The MMA warp of the serial 1-CTA schedule ((192, 128), bwd_tmem_map_serial: dQ over S and
        dP, dP over S's second half), steps i = 0 .. n-1 (FA4's hd192 order, 1-CTA):
          [q] [i > 0: dq empty: dQ(i-1) read out] S(i) ;
          [do] [s empty: P^T(i) written, S^T(i) read] dP(i) (over S's second half) ; dV += P^T dO(i) ;
          release dO ; [ds: dS^T(i) in TMEM and smem] dK += dS^T Q(i) ; release Q ;
          dQ(i) = dS K (over S and dP: after dV, dK read P^T, dS^T; tcgen05 MMAs of one thread run
          in order) ; commit dq, ds ;
        finally dkv. The pipelines and their counts are the pipelined 1-CTA kernel's.

        2-CTA ((192, 128), bwd_two_cta_serial: the leader's MMA warp, .cta_group::2 MMAs for the pair,
        commits multicast; bwd_tmem_map_2cta's serial map: dQ over S's tail and dP): per step
          [q: Q(i)] [i > 0: dq empty: dQ(i-1) read out, both CTAs] S(i) ; release Q ;
          [do: dO(i)] [s empty: P^T(i) written, both CTAs] dP(i) ; release dO ;
          [do: dO^T(i), the same stage] dV += P^T dO(i) ; release dO^T ;
          [dp empty: dS^T(i) in TMEM, both CTAs] [q: Q^T(i), the same stage] dK += dS^T Q^T(i) ; release Q^T ;
          [ds: dS(i) in both CTAs' smem] [relay: each CTA holds the peer's half] dQ(i) = dS K ;
          commit dq ; release dS ;
        finally dkv."""
        mma_s, mma_dp, mma_dv, mma_dk, mma_dq = mmas
        _, _, _, group, _, num_m, _, _ = tile
        n_steps = group * num_m
        (tSrK, tSrQ, tPrV, tPrdO, tVrdO, tKrQ, tQrdS, tQrK, tStS, tPtP, tVtV, tKtK, tQtQ, tVrP,
         tKrdS) = self.mma_operands(mmas, smem_t, tP_layout, tdS_layout)
        pipe_q, pipe_do, pipe_s, pipe_dp, pipe_ds, pipe_dq = (pipes[n] for n in ("q", "do", "s", "dp", "ds", "dq"))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        phase = Int32(0)  # s, ds: once per step; dq empty: before S(i), i > 0, for dQ(i-1)
        if n_steps > 0:
            pipes["kv"].wait_full(0, 0)
            valid_k = None
            if const_expr(self.packed):  # rows past the sequence -> 0 (zero_tail)
                valid_k = tile[7] - tile[0] * self.tile_n
                self.zero_tail(smem_t["sK"], 0, valid_k, self.tile_n)
                if const_expr(not self.dkdq_pass):  # pass dkdq: V arrives in chunks (zeroed per chunk)
                    self.zero_tail(smem_t["sV"], 0, valid_k, self.tile_n)
            for i in cutlass.range(n_steps, unroll=1):
                pipe_q.wait_full(q_state.index, q_state.phase)
                if const_expr(self.packed):
                    self.zero_tail(smem_t["sQ"], q_state.index, self.valid_q(tile, i), self.tile_m)
                if i > 0:
                    pipe_dq.wait_empty(0, phase ^ 1)  # dQ(i-1) read out: S(i) overwrites its columns
                    tcgen05_fence_after()
                self.gemm(mma_s, tStS, [tSrK], tSrQ[None, None, None, q_state.index], False)
                pipe_s.arrive_full(0, "mma")
                if const_expr(self.two_cta):  # shared rings: the q stage takes Q^T(i) next
                    pipe_q.arrive_empty(q_state.index, "mma")
                # the q ring's state dK reads: Q(i)'s (1-CTA: Q read through its MN-major view), or Q^T(i)'s
                # (2-CTA: the stage's next use; a name of its own keeps the loop-carried values as 1-CTA's)
                dk_state = next_state(q_state) if const_expr(self.two_cta) else q_state
                if const_expr(self.dkdq_pass):
                    # dP^T(i) = sum over the chunks c of V[:, c] dO(i)[:, c]^T (clear of S: no s wait);
                    # each chunk's stage released by the commit after its k-blocks
                    pipe_do.wait_full(do_state.index, do_state.phase)
                    self.zero_chunk_tails(smem_t, do_state.index, valid_k, tile, i)
                    self.gemm(mma_dp, tPtP, [tPrV[None, None, None, do_state.index]],
                              tPrdO[None, None, None, do_state.index], False)
                    pipe_do.arrive_empty(do_state.index, "mma")
                    do_state = next_state(do_state)
                    for _ in cutlass.range(self.vdo_chunks - 1, unroll=1):
                        pipe_do.wait_full(do_state.index, do_state.phase)
                        self.zero_chunk_tails(smem_t, do_state.index, valid_k, tile, i)
                        self.gemm(mma_dp, tPtP, [tPrV[None, None, None, do_state.index]],
                                  tPrdO[None, None, None, do_state.index], True)
                        pipe_do.arrive_empty(do_state.index, "mma")
                        do_state = next_state(do_state)
                    pipe_dp.arrive_full(0, "mma")
                    pipe_s.wait_empty(0, phase)  # S^T(i) read (dQ(i) overwrites it; ds implies it too)
                else:
                    pipe_do.wait_full(do_state.index, do_state.phase)
                    if const_expr(self.packed):
                        self.zero_tail(smem_t["sdO"], do_state.index, self.valid_q(tile, i), self.tile_m)
                    pipe_s.wait_empty(0, phase)  # P^T(i) written (both warpgroups read S^T(i) first)
                    tcgen05_fence_after()
                    self.gemm(mma_dp, tPtP, [tPrV], tPrdO[None, None, None, do_state.index], False)
                    pipe_dp.arrive_full(0, "mma")
                    if const_expr(self.two_cta):  # shared rings: dO^T(i) in the do stage after dO(i)
                        pipe_do.arrive_empty(do_state.index, "mma")
                        do_state = next_state(do_state)
                        pipe_do.wait_full(do_state.index, do_state.phase)
                        tcgen05_fence_after()
                    self.gemm(mma_dv, tVtV, tVrP, tVrdO[None, None, None, do_state.index], i > 0)
                    pipe_do.arrive_empty(do_state.index, "mma")
                    do_state = next_state(do_state)
                if const_expr(self.two_cta):
                    pipe_dp.wait_empty(0, phase)  # dS^T(i) in TMEM (both CTAs)
                    pipe_q.wait_full(dk_state.index, dk_state.phase)  # Q^T(i)
                else:
                    pipe_ds.wait_full(0, phase)  # dS^T(i) in TMEM and smem (dP^T(i) read)
                tcgen05_fence_after()
                self.gemm(mma_dk, tKtK, tKrdS, tKrQ[None, None, None, dk_state.index], i > 0)
                pipe_q.arrive_empty(dk_state.index, "mma")
                q_state = next_state(dk_state)
                if const_expr(self.two_cta):
                    pipe_ds.wait_full(0, phase)  # dS(i) in both CTAs' smem (own half; the peer's half sent)
                    cute.arch.mbarrier_wait(pipes["relay"], phase)  # each CTA holds the peer's half of dS(i)
                    tcgen05_fence_after()
                self.gemm(mma_dq, tQtQ, [tQrdS], tQrK, False)
                pipe_dq.arrive_full(0, "mma")
                pipe_ds.arrive_empty(0, "mma")
                phase = phase ^ 1
            pipes["dkv"].arrive_full(0, "mma")  # commits cover every earlier MMA: dK, dV final

    @cute.jit
    def mma_dv_pass(self, mmas, smem_t, tP_layout, pipes, tile):
        """The MMA warp of pass dv (hd256, bwd_tmem_map_pass: dV resident, S^T after it, P^T inside S^T),
        steps i = 0 .. n-1:
          [q] S(i) (over P^T(i-1): dV(i-1) was issued before it; tcgen05 MMAs of one thread run in
          order) ; commit s full ; release Q (its only reader) ; [do] [s empty: P^T(i) written, S^T(i)
          read] dV += P^T dO(i) ; release dO ;
        finally dkv. No V, dP^T, dS^T, dK or dQ: their pipelines do not exist in this pass."""
        mma_s, mma_dv = mmas[0], mmas[2]
        _, _, _, group, _, num_m, _, _ = tile
        n_steps = group * num_m
        base = self.tmem_base()
        tSrK = mma_s.make_fragment_A(smem_t["sK"])[None, None, None, 0]
        tSrQ = mma_s.make_fragment_B(smem_t["sQ"])
        tVrdO = mma_dv.make_fragment_B(smem_t["sdOmn"])
        tStS = self.tmem_acc(base, mma_s, self.mma_tiler_s, "S")
        tVtV = self.tmem_acc(base, mma_dv, self.mma_tiler_dv, "dV")
        tVrP = [self.tmem_operand(base, mma_dv, tP_layout, f"P{w}") for w in range(self.compute_wgs)]
        pipe_q, pipe_do, pipe_s = (pipes[n] for n in ("q", "do", "s"))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        phase = Int32(0)  # s empty: once per step
        if n_steps > 0:
            pipes["kv"].wait_full(0, 0)
            if const_expr(self.packed):  # rows past the sequence -> 0 (zero_tail): K, and per step Q, dO
                self.zero_tail(smem_t["sK"], 0, tile[7] - tile[0] * self.tile_n, self.tile_n)
            for i in cutlass.range(n_steps, unroll=1):
                pipe_q.wait_full(q_state.index, q_state.phase)
                if const_expr(self.packed):
                    self.zero_tail(smem_t["sQ"], q_state.index, self.valid_q(tile, i), self.tile_m)
                self.gemm(mma_s, tStS, [tSrK], tSrQ[None, None, None, q_state.index], False)
                pipe_s.arrive_full(0, "mma")
                pipe_q.arrive_empty(q_state.index, "mma")
                q_state = next_state(q_state)
                pipe_do.wait_full(do_state.index, do_state.phase)
                if const_expr(self.packed):
                    self.zero_tail(smem_t["sdO"], do_state.index, self.valid_q(tile, i), self.tile_m)
                pipe_s.wait_empty(0, phase)  # P^T(i) written
                tcgen05_fence_after()
                self.gemm(mma_dv, tVtV, tVrP, tVrdO[None, None, None, do_state.index], i > 0)
                pipe_do.arrive_empty(do_state.index, "mma")
                do_state = next_state(do_state)
                phase = phase ^ 1
            pipes["dkv"].arrive_full(0, "mma")  # commits cover every earlier MMA: dV final

    def zero_chunk_tails(self, smem_t, index, valid_k, tile, i):
        """Pass dkdq, packed configs: the V and dO chunks in stage `index` of the do ring -> rows past the
        sequence zeroed (zero_tail), before dP^T's k-blocks read them; nothing otherwise."""
        if const_expr(self.packed):
            self.zero_tail(smem_t["sV"], index, valid_k, self.tile_n)
            self.zero_tail(smem_t["sdO"], index, self.valid_q(tile, i), self.tile_m)

    def valid_q(self, tile, i):
        """Query rows of step i's block inside the sequence (seqlen_q - m_block tile_m; >= tile_m: all)."""
        _, m_block = self.step_coords(tile, i)
        return tile[6] - m_block * self.tile_m

    @cute.jit
    def zero_tail(self, sX, index, valid, rows: cutlass.Constexpr[int]):
        """Packed configs, MMA warp, after the stage's full barrier and before its first MMA: rows >=
        valid of stage `index` of a K-major operand buffer (K, V: keys; Q, dO: queries) -> 0. Those
        rows hold the next packed sequence or stale rows past seqused (any bits): the masks make
        their P and dS exactly 0 only while the operand is finite, and dV += P^T dO, dK += dS^T Q,
        dQ = dS K, dP^T = V dO^T multiply them (0 x NaN = NaN). Zeroed, the tile is the one a dense
        layout's TMA clipping gives. Race-free: the stage is released (and refilled) only by this
        warp's commit after its last MMA on it, and nobody else writes it meanwhile; the generic
        stores are ordered before the MMAs' async-proxy reads by fence.proxy.async.shared::cta in
        each lane, then __syncwarp before the elected lane issues the MMA."""
        if valid < rows:
            lane = cute.arch.lane_idx()
            sXr = self.stage_rows(sX, index, rows)
            cols = cute.size(sXr, mode=[1])
            vec = 128 // self.dtype.width
            per_row = math.gcd(cols // vec, WARP_SIZE)
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
            thr_layout = cute.make_ordered_layout((WARP_SIZE // per_row, per_row), order=(1, 0))
            tiled = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))
            thr = tiled.get_slice(lane)
            tXs = thr.partition_D(sXr)
            tXc = thr.partition_D(cute.make_identity_tensor((rows, cols)))
            zeros = cute.make_fragment_like(tXs[None, 0, None])  # one pass row: 16-byte stores of RZ
            zeros.fill(0.0)
            # a rolled loop: unrolled, the 88-register MMA warp kept every pass's address and
            # predicate live across the main loop and spilled (hd128)
            for m in cutlass.range(cute.size(tXs, mode=[1]), unroll=1):
                if tXc[0, m, 0][0] >= valid:
                    cute.copy(atom, zeros, tXs[None, m, None])
            cute.arch.fence_view_async_shared()  # generic zeros -> the MMA's async-proxy reads
            cute.arch.sync_warp()

    def stage_rows(self, sX, index, rows: int):
        """Stage `index` of a K-major operand buffer as a (rows, head dim) tensor (same swizzled
        pointer): its modes are ((rows, 16), 1, D / 16, stage) with coordinates ((r, c % 16), 0,
        c // 16) (tests/cpu/test_sm100_bwd_plan.py), regrouped into (r, (c % 16, c // 16))."""
        stage = sX[None, None, None, index]
        o = stage.layout
        if const_expr(not (isinstance(o.shape[0], tuple) and len(o.shape[0]) == 2 and o.shape[0][1] == 16
                           and cute.size(o.shape[0][0]) == rows and cute.size(o.shape[1]) == 1)):
            raise RuntimeError(f"flash4 bwd_sm100: operand stage layout {o} is not ((rows, 16), 1, D / 16)")
        (r_shape, k_shape), (r_stride, k_stride) = o.shape[0], o.stride[0]
        layout = cute.make_layout((r_shape, (k_shape, o.shape[2])), stride=(r_stride, (k_stride, o.stride[2])))
        return cute.make_tensor(stage.iterator, layout)

    def ledger_note(self, name: str, side: str, role: str):
        """Record (trace time) that `role` arrives on `side` of the raw barrier `name` (dsx, relay), as
        Pipe does for the DSL pipelines."""
        spec = self.specs[name]
        parties = spec.producers if side == "full" else spec.consumers
        self.ledger.record(name, side, role, next(p.signal for p in parties if p.role == role))

    @cute.jit
    def mma_2cta(self, mmas, smem_t, tP_layout, tdS_layout, pipes, tile):
        """The leader's MMA warp of a 2-CTA pair: .cta_group::2 MMAs for both CTAs, commits multicast to
        both. dQ lies over S's tail (bwd_tmem_map_2cta), which reorders the 1-CTA schedule (FA4's
        pipelined 2-CTA order): steps i = 0 .. n-1,
          S(0) ; release Q ; dP(0) ;
          per i: [s empty: P(i) written, both CTAs] dV += P^T dO(i) ; release dO ;
                 [dp empty: dS^T(i) in TMEM, both CTAs] [qt] dK += dS^T Q^T(i) ; release Q^T ;
                 (i+1 < n: [q] [i > 0: dq empty: dQ(i-1) read out, S(i+1) overwrites it] S(i+1) ;
                  release Q ; [do] dP(i+1), which overwrites dS^T(i) after dK(i) read it) ;
                 (i+1 == n > 1: [dq empty] as above, before dQ(i) overwrites dQ(i-1)) ;
                 [ds: dS(i) in smem and S(i+1) read out, both CTAs] [relay: both CTAs hold the
                 peer's half] dQ(i) = dS K over S(i+1)'s tail ; commit dq ; release dS ;
          finally dkv."""
        mma_s, mma_dp, mma_dv, mma_dk, mma_dq = mmas
        _, _, _, group, _, num_m, _, _ = tile
        n_steps = group * num_m
        (tSrK, tSrQ, tPrV, tPrdO, tVrdO, tKrQ, tQrdS, tQrK, tStS, tPtP, tVtV, tKtK, tQtQ, tVrP,
         tKrdS) = self.mma_operands(mmas, smem_t, tP_layout, tdS_layout)

        pipe_q, pipe_qt, pipe_do, pipe_s, pipe_dp, pipe_ds, pipe_dq = (
            pipes[n] for n in ("q", "qt", "do", "s", "dp", "ds", "dq"))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        qt_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        phase = Int32(0)  # s, dp (empty), ds, relay: once per step
        dq_phase = Int32(0)
        if n_steps > 0:
            pipes["kv"].wait_full(0, 0)
            pipe_q.wait_full(q_state.index, q_state.phase)
            self.gemm(mma_s, tStS, [tSrK], tSrQ[None, None, None, q_state.index], False)
            pipe_s.arrive_full(0, "mma")
            pipe_q.arrive_empty(q_state.index, "mma")
            q_state = next_state(q_state)
            pipe_do.wait_full(do_state.index, do_state.phase)
            self.gemm(mma_dp, tPtP, [tPrV], tPrdO[None, None, None, do_state.index], False)
            pipe_dp.arrive_full(0, "mma")
            for i in cutlass.range(n_steps, unroll=1):
                pipe_s.wait_empty(0, phase)  # P^T(i) written (both CTAs)
                tcgen05_fence_after()
                self.gemm(mma_dv, tVtV, tVrP, tVrdO[None, None, None, do_state.index], i > 0)
                pipe_do.arrive_empty(do_state.index, "mma")
                do_state = next_state(do_state)
                pipe_dp.wait_empty(0, phase)  # dS^T(i) in TMEM (both CTAs)
                pipe_qt.wait_full(qt_state.index, qt_state.phase)
                tcgen05_fence_after()
                self.gemm(mma_dk, tKtK, tKrdS, tKrQ[None, None, None, qt_state.index], i > 0)
                pipe_qt.arrive_empty(qt_state.index, "mma")
                qt_state = next_state(qt_state)
                if i + 1 < n_steps:
                    pipe_q.wait_full(q_state.index, q_state.phase)
                    if i > 0:
                        pipe_dq.wait_empty(0, dq_phase)  # dQ(i-1) read out: S(i+1) overwrites its columns
                        dq_phase = dq_phase ^ 1
                    tcgen05_fence_after()
                    self.gemm(mma_s, tStS, [tSrK], tSrQ[None, None, None, q_state.index], False)
                    pipe_s.arrive_full(0, "mma")
                    pipe_q.arrive_empty(q_state.index, "mma")
                    q_state = next_state(q_state)
                    pipe_do.wait_full(do_state.index, do_state.phase)
                    self.gemm(mma_dp, tPtP, [tPrV], tPrdO[None, None, None, do_state.index], False)
                    pipe_dp.arrive_full(0, "mma")
                else:
                    if i > 0:
                        pipe_dq.wait_empty(0, dq_phase)  # dQ(i-1) read out: dQ(i) overwrites it
                        dq_phase = dq_phase ^ 1
                pipe_ds.wait_full(0, phase)  # dS(i) in both CTAs' smem, S(i+1) read out of TMEM
                cute.arch.mbarrier_wait(pipes["relay"], phase)  # each CTA holds the peer's half of dS(i)
                tcgen05_fence_after()
                self.gemm(mma_dq, tQtQ, [tQrdS], tQrK, False)
                pipe_dq.arrive_full(0, "mma")
                pipe_ds.arrive_empty(0, "mma")
                phase = phase ^ 1
            pipes["dkv"].arrive_full(0, "mma")  # commits cover every earlier MMA: dK, dV final

    @cute.jit
    def gemm(self, tiled_mma, acc, a_parts, b, accumulate):
        """acc (+)= A B, one tcgen05.mma per 16 of K. a_parts: A as one fragment, or as K-halves (P^T,
        dS^T: one per compute warpgroup, in different TMEM columns, each laid out as if it held all
        of K) covering K in order: part p supplies k-blocks p * n/len .. (p+1) * n/len - 1 from its
        own first ones."""
        atom = cute.make_mma_atom(tiled_mma.op)
        per_part = cute.size(b, mode=[2]) // len(a_parts)
        for p in cutlass.range_constexpr(len(a_parts)):
            for k in cutlass.range_constexpr(per_part):
                atom.set(tcgen05.Field.ACCUMULATE, accumulate or p + k != 0)
                cute.gemm(atom, acc, a_parts[p][None, None, k], b[None, None, p * per_part + k], acc)

    def tmem_acc(self, base, tiled_mma, tiler, name):
        """Accumulator `name` of bwd_tmem_map: ((M, N), 1, 1) fp32."""
        thr = tiled_mma.get_slice(0)
        layout = thr.make_fragment_C(thr.partition_shape_C(tiler[:2])).layout
        return cute.make_tensor(base + self.tmem[name][0], layout)

    def tmem_operand(self, base, tiled_mma, t_layout, name):
        """16-bit A operand `name` (a P^T / dS^T half of bwd_tmem_map) in TMEM: (MMA, MMA_M, MMA_K),
        laid out from the half's first column (gemm uses its first MMA_K / halves k-blocks)."""
        thr = tiled_mma.get_slice(0)
        frag = thr.make_fragment_A(cute.make_tensor(base, t_layout.outer))[None, None, None, 0]
        return cute.make_tensor(cute.recast_ptr(base + self.tmem[name][0], dtype=self.dtype), frag.layout)

    # ---------------------------------------------------------------- compute warpgroups
    @cute.jit
    def compute(self, mmas, sLSE, lse_exact, sD, sdSt, mdK, mdV, pipes, tile, softmax_scale: Float32, window, softcap,
                cta_v=None):
        """Compute warpgroups (see the class docstring). 2-CTA (cta_v: this CTA's rank): P^T halves are
        contiguous at S's start, so both warpgroups read S^T before either writes P^T (a named
        barrier); after writing dS^T to TMEM they arrive on the leader's dp empty (dK may read it);
        the query half of dS^T the peer's dQ needs (half cta_v ^ 1) goes to the exchange buffer, and
        after a named barrier compute thread 0 sends it over DSMEM into the peer's dS^T (at half
        cta_v) with the peer's dsx barrier counting the bytes; the ds arrive of step i comes at step
        i + 1 after S^T(i+1) was read (dQ(i) overwrites S's tail), the last one after the loop."""
        mma_s, mma_dp, mma_dv, mma_dk = mmas[0], mmas[1], mmas[2], mmas[3]
        n_block, head_kv, batch, group, m_min, num_m, seqlen_q, seqlen_k = tile
        n_steps = group * num_m
        tidx = cute.arch.thread_idx()[0] % THREADS_PER_WG
        wg = (cute.arch.make_warp_uniform(cute.arch.warp_idx()) - self.roles["compute"][0]) // 4
        base = self.tmem_base()
        # softcap: (softcap log2 e, softmax_scale / softcap, 1 / (softcap log2 e)); else (scale log2 e, None, None)
        scale_log2, softcap_scale, inv_scale_log2 = score.device_scales(softmax_scale, softcap, self.cfg.softcap)
        tStS = self.tmem_acc(base, mma_s, self.mma_tiler_s, "S")[(None, None), 0, 0]  # (tile_n, tile_m)
        tPtP = None  # pass dv: no dP^T (nor dS^T)
        if const_expr(not self.dv_pass):
            tPtP = self.tmem_acc(base, mma_dp, self.mma_tiler_dp, "dP")[(None, None), 0, 0]
        # S^T, dP^T: tcgen05.ld 32x32b.x32 per LD_COLS columns: thread t gets lane t (key t).
        chunk = cute.make_layout((self.tile_n, LD_COLS))
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(LD_COLS)), Float32)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, cute.composition(tStS, chunk))
        thr_ld = tiled_ld.get_slice(tidx)
        tS_src = thr_ld.partition_S(cute.composition(tStS, chunk))
        tP_src = None
        if const_expr(not self.dv_pass):
            tP_src = thr_ld.partition_S(cute.composition(tPtP, chunk))
        cS = cute.make_identity_tensor((self.tile_n, LD_COLS))
        tScS = thr_ld.partition_D(cS)
        t0ScS = tiled_ld.get_slice(0).partition_D(cS)  # static column of each register
        frag_shape = tScS.shape
        lane_row = tScS[0][0]  # this thread's key row (TMEM lane)
        # P^T / dS^T (16-bit pairs in 32-bit columns): LD_COLS / 2 columns per chunk, into half P_wg / dS_wg.
        st_cols = LD_COLS // 2
        st_chunk = cute.composition(tStS.layout, cute.make_layout((self.tile_n, st_cols)))
        st_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(st_cols)), Float32)
        thr_st = tcgen05.make_tmem_copy(st_atom, cute.make_tensor(base, st_chunk)).get_slice(tidx)
        p_dst = None  # pass dkdq: P^T stays in registers (no dV MMA reads it)
        if const_expr(not self.dkdq_pass):
            p_dst = thr_st.partition_D(cute.make_tensor(base + self.half_offset("P", wg), st_chunk))
        ds_dst, tsdS_part, r2s = None, None, None  # pass dv: no dS^T
        if const_expr(not self.dv_pass):
            ds_dst = thr_st.partition_D(cute.make_tensor(base + self.half_offset("dS", wg), st_chunk))
        st_shape = thr_st.partition_S(cute.make_identity_tensor((self.tile_n, st_cols))).shape
        if const_expr(not self.dv_pass):
            # dS^T -> smem (tile_n x tile_m row-major, the MMA's swizzle): the same thread/element map as the load.
            sdS2 = sdSt[None, None, 0]
            tsdS = cute.logical_divide(sdS2, chunk)  # ((tile_n, LD_COLS), (1, chunks))
            tsdS_part = thr_ld.partition_D(tsdS[(None, None), None])
            r2s = cute.make_tiled_copy_D(sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32,
                                                                       tiled_ld), tiled_ld)
        chunks_per_wg = self.wg_cols // LD_COLS
        key = n_block * self.tile_n + lane_row
        ds_chunk0 = None  # 2-CTA: this warpgroup's first LD_COLS-column chunk of dS^T in smem
        if const_expr(self.two_cta):
            # dS^T and the exchange buffer after it as one (tile_n, 3 tile_m / 2) row-major tile whose
            # query halves are contiguous blocks: this warpgroup's half stays in place when it is this
            # CTA's own (wg == cta_v), the peer's half goes to the third block (the exchange buffer)
            lay3 = sm100_utils.make_smem_layout_epi(self.dtype, LayoutEnum.ROW_MAJOR,
                                                    (self.tile_n, self.tile_m + self.tile_m // 2), 1).outer
            if const_expr(cute.crd2idx((0, self.tile_m, 0), lay3) != self.tile_n * self.tile_m):
                raise RuntimeError("flash4 bwd_sm100: the dS^T exchange block does not follow dS^T")
            tsdS3 = cute.logical_divide(cute.make_tensor(sdSt.iterator, lay3)[None, None, 0], chunk)
            tsdS_part = thr_ld.partition_D(tsdS3[(None, None), None])
            ds_chunk0 = cutlass.select_(wg == cta_v, wg, Int32(2)) * chunks_per_wg

        s_phase = Int32(0)
        ds_phase = Int32(1)  # dS smem free: the first wait passes
        lse_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        d_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        mExact = lse_exact[0]
        for i in cutlass.range(n_steps, unroll=1):
            head, m_block = self.step_coords(tile, i)
            # the query tile's exact-LSE flag (the preprocess's; uniform over the CTA), loaded before the waits
            exact = False
            if const_expr(self.exact_lse):
                exact = mExact[m_block, head, batch] != 0
            # query columns [first, end) of this warpgroup's chunk 0 see this key (first NO_COLUMN: none;
            # end: the window's left side, else past every column)
            col0 = m_block * self.tile_m + wg * self.wg_cols
            first = g.first_query(key, seqlen_q, seqlen_k, self.causal, DEVICE_OPS, window) - col0
            end = Int32(self.tile_m)
            if const_expr(window is not None):
                end = g.query_end(key, seqlen_q, seqlen_k, DEVICE_OPS, window) - col0
            pipes["lse"].wait_full(lse_state.index, lse_state.phase)
            pipes["s"].wait_full(0, s_phase)
            tcgen05_fence_after()
            p0 = cute.make_rmem_tensor(frag_shape, Float32)
            p1 = cute.make_rmem_tensor(frag_shape, Float32)
            ps = (p0, p1)
            for j in cutlass.range_constexpr(chunks_per_wg):
                col = wg * self.wg_cols + j * LD_COLS
                cute.copy(thr_ld, cute.make_tensor(tS_src.iterator + col, tS_src.layout), ps[j])
            cute.arch.fence_view_async_tmem_load()
            if const_expr(self.two_cta and not self.serial_2cta):
                if i > 0:
                    tcgen05_fence_before()
                    self.arrive_elected(pipes["ds"], 0, "compute", False)  # dS(i-1) in smem, S^T(i) read
            if const_expr(self.p_barrier):  # P^T halves in S^T columns the other warpgroup reads
                named_barrier_sync(COMPUTE_BARRIER, len(self.roles["compute"]) * WARP_SIZE)  # S^T read: P^T may land
            for j in cutlass.range_constexpr(chunks_per_wg):
                col = wg * self.wg_cols + j * LD_COLS
                score.apply(ps[j], softcap_scale, self.cfg.softcap)  # softcap: S -> tanh(S * softcap_scale)
                self.exponent(ps[j], t0ScS, sLSE, lse_state.index, col, scale_log2)
            if exact:  # issue 8: |lse_log2| >= BWD_EXACT_LSE_LOG2 in some row of the tile (rare; static False
                # without bwd_exact_lse)
                for j in cutlass.range_constexpr(chunks_per_wg):
                    col = wg * self.wg_cols + j * LD_COLS
                    self.exact_residual(ps[j], t0ScS, sLSE, lse_state.index, col, lse_exact, head, batch,
                                        m_block * self.tile_m + col, seqlen_q)
            for j in cutlass.range_constexpr(chunks_per_wg):
                self.probs(ps[j], t0ScS, first - j * LD_COLS, end - j * LD_COLS)
                if const_expr(not self.dkdq_pass):
                    self.store16(ps[j], thr_st, cute.make_tensor(p_dst.iterator + j * st_cols, p_dst.layout), st_shape)
            cute.arch.fence_view_async_tmem_store()
            tcgen05_fence_before()
            self.arrive_elected(pipes["s"], 0, "compute", True)  # P^T written
            if const_expr(not self.cfg.softcap or self.dv_pass):  # softcap: dS reads the LSE (pass dv has none)
                self.arrive_elected(pipes["lse"], lse_state.index, "compute", True)
                lse_state = next_state(lse_state)

            if const_expr(not self.dv_pass):  # pass dv: P^T only (no dP^T, dS^T)
                pipes["dpsum"].wait_full(d_state.index, d_state.phase)
                pipes["dp"].wait_full(0, s_phase)
                pipes["ds"].wait_empty(0, ds_phase)  # dS smem (and TMEM half) free: dK, dQ of step i-1 done
                tcgen05_fence_after()
                for j in cutlass.range_constexpr(chunks_per_wg):
                    col = wg * self.wg_cols + j * LD_COLS
                    dp = cute.make_rmem_tensor(frag_shape, Float32)
                    cute.copy(thr_ld, cute.make_tensor(tP_src.iterator + col, tP_src.layout), dp)
                    cute.arch.fence_view_async_tmem_load()
                    self.dscores(ps[j], dp, t0ScS, sD, d_state.index, col, softmax_scale, sLSE, lse_state.index,
                                 inv_scale_log2)
                    ds16 = self.store16(dp, thr_st, cute.make_tensor(ds_dst.iterator + j * st_cols, ds_dst.layout),
                                        st_shape)
                    if const_expr(self.two_cta):
                        cute.copy(r2s, ds16[None, 0, 0], tsdS_part[None, 0, 0, ds_chunk0 + j])
                    else:
                        cute.copy(r2s, ds16[None, 0, 0], tsdS_part[None, 0, 0, wg * chunks_per_wg + j])
                cute.arch.fence_view_async_tmem_store()
                if const_expr(self.two_cta):
                    tcgen05_fence_before()
                    self.arrive_elected(pipes["dp"], 0, "compute", True)  # dS^T in TMEM (dK may read it)
                    cute.arch.fence_view_async_shared()  # dS smem writes -> visible to the async proxy
                    named_barrier_sync(COMPUTE_BARRIER, len(self.roles["compute"]) * WARP_SIZE)
                    if tidx == 0 and wg == 0:
                        self.send_ds_half(sdSt, pipes["dsx"], cta_v)
                    if const_expr(self.serial_2cta):  # the serial order: dQ(i) needs no S^T(i+1) read first
                        self.arrive_elected(pipes["ds"], 0, "compute", False)  # dS^T(i) in smem
                else:
                    cute.arch.fence_view_async_shared()  # dS smem writes -> visible to the MMA (async proxy)
                    tcgen05_fence_before()
                    self.arrive_elected(pipes["ds"], 0, "compute", False)  # dS^T written
                self.arrive_elected(pipes["dpsum"], d_state.index, "compute", True)
                d_state = next_state(d_state)
                if const_expr(self.cfg.softcap):  # dS read the LSE too (score.grad_factor)
                    self.arrive_elected(pipes["lse"], lse_state.index, "compute", True)
                    lse_state = next_state(lse_state)
            s_phase = s_phase ^ 1
            ds_phase = ds_phase ^ 1

        if const_expr(self.two_cta and not self.serial_2cta):
            if n_steps > 0:
                self.arrive_elected(pipes["ds"], 0, "compute", False)  # the last step's dS in smem
        # epilogue: warpgroup 0 stores dV, warpgroup 1 dK (zeros when the tile saw no query)
        if n_steps > 0:
            pipes["dkv"].wait_full(0, 0)
            tcgen05_fence_after()
        if wg == 0:
            if const_expr(not self.dkdq_pass):  # pass dkdq stores dK only (dV: pass dv)
                self.store_dkv(base, mma_dv, self.mma_tiler_dv, "dV", mdV, tidx, key, seqlen_k, head_kv, batch,
                               n_steps > 0)
        else:
            if const_expr(not self.dv_pass):  # pass dv stores dV only (dK: pass dkdq)
                self.store_dkv(base, mma_dk, self.mma_tiler_dk, "dK", mdK, tidx, key, seqlen_k, head_kv, batch,
                               n_steps > 0)

    @cute.jit
    def send_ds_half(self, sdSt, dsx_bar, cta_v):
        """One thread: the peer's query half of this CTA's dS^T (in the exchange buffer after sdSt)
        -> the peer's sdSt at half cta_v (where the peer's dQ A operand wants this CTA's keys), over
        DSMEM; the peer's dsx barrier expects the bytes (arrive.expect_tx, then the copy completes
        them)."""
        half_elems = self.tile_n * self.tile_m // 2
        nbytes = half_elems * (self.dtype.width // 8)
        peer = cta_v ^ 1
        self.ledger_note("dsx", "full", "compute")
        cute.arch.mbarrier_arrive_and_expect_tx(dsx_bar, nbytes, peer_cta_rank_in_cluster=peer)
        bulk_copy_s2peer(sdSt.iterator + 2 * half_elems, sdSt.iterator + cta_v * half_elems, dsx_bar, peer, nbytes)

    def half_offset(self, name: str, wg):
        """Column of half `name`{wg} (bwd_tmem_map; the halves are evenly spaced, wg may be runtime)."""
        starts = [self.tmem[f"{name}{w}"][0] for w in range(self.compute_wgs)]
        stride = starts[1] - starts[0] if len(starts) > 1 else 0
        return starts[0] + wg * stride

    @cute.jit
    def arrive_elected(self, pipe, index, role: str, empty: bool):
        """One arrival per warp (ELECTED parties), after every lane of the warp got here."""
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            if const_expr(empty):
                pipe.arrive_empty(index, role)
            else:
                pipe.arrive_full(index, role)

    @cute.jit
    def exponent(self, s, t0ScS, sLSE, stage, col0, scale_log2: Float32):
        """s (one chunk of this thread's S^T row, queries col0 ..) -> fma(s, c, -lse_log2) in place, the
        padded log2 LSE staged in smem (+inf on padded rows, so P = 0 there)."""
        for j in cutlass.range(0, cute.size(s), 2, unroll_full=True):
            c0, c1 = t0ScS[j][1], t0ScS[j + 1][1]
            s[j], s[j + 1] = cute.arch.fma_packed_f32x2((s[j], s[j + 1]), (scale_log2, scale_log2),
                                                        (-sLSE[col0 + c0, stage], -sLSE[col0 + c1, stage]))

    @cute.jit
    def exact_residual(self, s, t0ScS, sLSE, stage, col0, lse_exact, head, batch, query0, seqlen_q):
        """The exact-LSE path (issue 8) on one chunk of exponents from `exponent`, for a query tile the
        preprocess flagged (|lse_log2| >= BWD_EXACT_LSE_LOG2 in some row): s -= r, r the rounding error
        of the staged lse_log2 = fp32(hi + lo) (the preprocess's sum of the forward's unrounded split),
        recovered exactly by TwoSum (hi + lo = lse_log2 + r). So s = fp32(fp32(S c - lse_log2) - r):
        the sm90 backward's fp32(fp32(S c - hi) - lo) up to where the small remainder is rounded, exact
        at the row max at any finite magnitude. Lane l computes r of query query0 + l (the chunk's
        LD_COLS = 32 columns: one per lane; hi, lo from global memory) and each column's r is
        broadcast by shuffle (one value per column: hi and lo broadcast separately, or loaded per
        column, were hoisted by ptxas and spilled). r = 0 where lse_log2 is +inf (padded rows, rows
        that saw no key: P is already 0)."""
        if const_expr(LD_COLS != WARP_SIZE):
            raise RuntimeError("flash4 bwd_sm100: exact_residual computes one query per lane")
        _, mLSEhi, mLSElo = lse_exact
        lane = cute.arch.lane_idx()
        row = cutlass.min(query0 + lane, seqlen_q - 1)  # in bounds (seqlen_q >= 1 when a step runs)
        hi, lo = mLSEhi[row, head, batch], mLSElo[row, head, batch]
        big_l = sLSE[col0 + lane, stage]  # = fp32(hi + lo) for rows < seqlen_q, +inf past it
        b_virtual = big_l - hi  # TwoSum(hi, lo) with its rounded sum big_l: r = hi + lo - big_l exactly
        a_virtual = big_l - b_virtual
        r_lane = (hi - a_virtual) + (lo - b_virtual)
        r_lane = cutlass.select_(big_l < Float32.inf, r_lane, Float32(0.0))
        for j in cutlass.range(0, cute.size(s), 2, unroll_full=True):
            r0, r1 = cute.arch.shuffle_sync(r_lane, t0ScS[j][1]), cute.arch.shuffle_sync(r_lane, t0ScS[j + 1][1])
            s[j], s[j + 1] = cute.arch.sub_packed_f32x2((s[j], s[j + 1]), (r0, r1))

    @cute.jit
    def probs(self, s, t0ScS, first, end):
        """s (one chunk of exponents: exponent, and exact_residual on flagged tiles) -> P = exp2(s), 0 where the query
        does not see the key (column < first, or >= end: a window's left side)."""
        for j in cutlass.range(0, cute.size(s), 2, unroll_full=True):
            c0, c1 = t0ScS[j][1], t0ScS[j + 1][1]
            hidden0, hidden1 = c0 < first, c1 < first
            if const_expr(self.cfg.local):
                hidden0, hidden1 = hidden0 | (c0 >= end), hidden1 | (c1 >= end)
            s[j] = Float32(cutlass.select_(hidden0, Float32(0.0), exp2_hw(s[j])))
            s[j + 1] = Float32(cutlass.select_(hidden1, Float32(0.0), exp2_hw(s[j + 1])))

    @cute.jit
    def dscores(self, p, dp, t0ScS, sD, stage, col0, scale: Float32, sLSE, lse_stage, inv_scale_log2):
        """dp <- scale * p * (dp - D), in place (D = rowsum(dO * O) of each query column); softcap:
        times score.grad_factor (1 - t^2, t recovered from p and the column's LSE; 0 where p = 0)."""
        for j in cutlass.range(0, cute.size(dp), 2, unroll_full=True):
            c0, c1 = t0ScS[j][1], t0ScS[j + 1][1]
            d0, d1 = cute.arch.sub_packed_f32x2((dp[j], dp[j + 1]), (sD[col0 + c0, stage], sD[col0 + c1, stage]))
            d0, d1 = cute.arch.mul_packed_f32x2((d0, d1), (p[j], p[j + 1]))
            dp[j], dp[j + 1] = cute.arch.mul_packed_f32x2((d0, d1), (scale, scale))
            if const_expr(self.cfg.softcap):
                f0 = score.grad_factor(p[j], sLSE[col0 + c0, lse_stage], inv_scale_log2)
                f1 = score.grad_factor(p[j + 1], sLSE[col0 + c1, lse_stage], inv_scale_log2)
                dp[j], dp[j + 1] = cute.arch.mul_packed_f32x2((dp[j], dp[j + 1]), (f0, f1))

    @cute.jit
    def store16(self, x, thr_st, dst, st_shape):
        """x (fp32) -> 16-bit pairs -> tcgen05.st into dst; returns the 16-bit fragment."""
        packed = cute.make_rmem_tensor(st_shape, Float32)
        x16 = cute.make_tensor(cute.recast_ptr(packed.iterator, dtype=self.dtype), x.layout)
        x16.store(x.load().to(self.dtype))
        cute.copy(thr_st, packed, dst)
        return x16

    @cute.jit
    def store_dkv(self, base, tiled_mma, tiler, name, mX, tidx, key, seqlen_k, head_kv, batch, has_steps):
        """Accumulator `name` (dK or dV; this thread's key row) -> 16-bit -> global row `key` (keys <
        seqlen_k only), EPI_COLS columns per TMEM load; zeros when the tile saw no query."""
        acc = self.tmem_acc(base, tiled_mma, tiler, name)[(None, None), 0, 0]
        chunk = cute.make_layout((self.tile_n, EPI_COLS))
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(EPI_COLS)), Float32)
        thr_ld = tcgen05.make_tmem_copy(ld_atom, cute.composition(acc, chunk)).get_slice(tidx)
        src = thr_ld.partition_S(cute.composition(acc, chunk))
        frag_shape = thr_ld.partition_D(cute.make_identity_tensor((self.tile_n, EPI_COLS))).shape
        if key < seqlen_k:
            gRow = mX[key, None, head_kv, batch]
            for c in cutlass.range_constexpr(tiler[1] // EPI_COLS):
                frg = cute.make_rmem_tensor(frag_shape, Float32)
                frg.fill(0.0)
                if has_steps:
                    cute.copy(thr_ld, cute.make_tensor(src.iterator + c * EPI_COLS, src.layout), frg)
                    cute.arch.fence_view_async_tmem_load()
                out = cute.make_rmem_tensor((EPI_COLS,), self.dtype)
                out.store(cute.make_tensor(frg.iterator, cute.make_layout(EPI_COLS)).load().to(self.dtype))
                cute.autovec_copy(out, cute.local_tile(gRow, (EPI_COLS,), (c,)))

    # ---------------------------------------------------------------- dQ-reduce warps
    @cute.jit
    def reduce(self, mma_dq, mdQacc, mdQsem, sdQ, pipes, tile, window):
        """Per step: dQ (TMEM, this thread's row, all D columns) -> registers; free dQ's columns; then per
        group of DQ_GROUP_ROWS rows of the warp: those lanes write their rows into the warp's smem
        block (row-major, as the accumulator), and lane 0 reduce-adds the block into the accumulator's
        rows with one cp.reduce.async.bulk.add.f32 (the rows of a query block are contiguous there).

        Deterministic configs order the adds of one query block by key block (sm90's chain): thread 0
        waits until the block's semaphore reads this key block's turn (n_block; with a window, counted
        from the first key block of the query block's band), the four warps add, wait until their
        adds landed in global memory, and thread 0 releases turn + 1. Lower key blocks launch first
        (flash4.launch.bwd_grid), so the chain cannot deadlock."""
        n_block, _, batch, _, _, _, seqlen_q, seqlen_k = tile
        n_steps = tile[3] * tile[5]
        tidx = cute.arch.thread_idx()[0] % THREADS_PER_WG
        warp = tidx // WARP_SIZE
        lane = cute.arch.lane_idx()
        base = self.tmem_base()
        acc = self.tmem_acc(base, mma_dq, self.mma_tiler_dq, "dQ")[(None, None), 0, 0]  # (tile_m, d)
        chunk = cute.make_layout((self.tile_m, DQ_LD_COLS))
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(DQ_LD_COLS)), Float32)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, cute.composition(acc, chunk))
        thr_ld = tiled_ld.get_slice(tidx)
        src = thr_ld.partition_S(cute.composition(acc, chunk))
        cq = cute.make_identity_tensor((self.tile_m, DQ_LD_COLS))
        frag_shape = thr_ld.partition_D(cq).shape
        n_chunks = self.hdim // DQ_LD_COLS
        pass_chunks = n_chunks // self.dq_passes  # chunks a thread holds at once (bwd_dq_passes)
        groups = WARP_SIZE // DQ_GROUP_ROWS
        block = sdQ[None, None, warp]  # (D, DQ_GROUP_ROWS) fp32, this warp's staging block
        my_row = block[None, lane % DQ_GROUP_ROWS]  # (D,): where this lane's row goes in its group
        block_bytes = DQ_GROUP_ROWS * self.hdim * 4
        phase = Int32(0)
        for i in cutlass.range(n_steps, unroll=1):
            head, m_block = self.step_coords(tile, i)
            pipes["dq"].wait_full(0, phase)
            tcgen05_fence_after()
            frags = [cute.make_rmem_tensor(frag_shape, Float32) for _ in range(pass_chunks)]
            if const_expr(self.dq_passes == 1):  # the whole row at once, dQ's columns freed at once
                for c in cutlass.range_constexpr(n_chunks):
                    cute.copy(thr_ld, cute.make_tensor(src.iterator + c * DQ_LD_COLS, src.layout), frags[c])
                cute.arch.fence_view_async_tmem_load()
                tcgen05_fence_before()
                self.arrive_elected(pipes["dq"], 0, "reduce", True)  # dQ read out
            sem_ptr = mdQsem[None, head, batch].iterator + m_block
            if const_expr(self.cfg.deterministic):
                turn = n_block
                if const_expr(window is not None):
                    turn = n_block - g.n_block_min(m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, DEVICE_OPS,
                                                   window)
                if tidx == 0:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                    while turn != seen:
                        seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                named_barrier_sync(REDUCE_BARRIER, THREADS_PER_WG)
            for grp in cutlass.range_constexpr(groups):
                self.bulk_wait(lane, True)  # the block's previous reduce-add read it
                cute.arch.sync_warp()
                if const_expr(self.dq_passes == 1):
                    if lane // DQ_GROUP_ROWS == grp:
                        for c in cutlass.range_constexpr(n_chunks):
                            cute.autovec_copy(cute.make_tensor(frags[c].iterator, cute.make_layout(DQ_LD_COLS)),
                                              cute.local_tile(my_row, (DQ_LD_COLS,), (c,)))
                        cute.arch.fence_view_async_shared()  # smem writes -> visible to the bulk copy (async proxy)
                else:
                    # hd192: per pass the warp loads pass_chunks chunks of its 32 rows (tcgen05.ld is
                    # warp-wide) and the group's lanes stage theirs; dQ's columns are free after the
                    # last group's last pass (the serial schedule's next S^T waits for that)
                    for ps in cutlass.range_constexpr(self.dq_passes):
                        for c in cutlass.range_constexpr(pass_chunks):
                            col = (ps * pass_chunks + c) * DQ_LD_COLS
                            cute.copy(thr_ld, cute.make_tensor(src.iterator + col, src.layout), frags[c])
                        cute.arch.fence_view_async_tmem_load()
                        if lane // DQ_GROUP_ROWS == grp:
                            for c in cutlass.range_constexpr(pass_chunks):
                                cute.autovec_copy(cute.make_tensor(frags[c].iterator, cute.make_layout(DQ_LD_COLS)),
                                                  cute.local_tile(my_row, (DQ_LD_COLS,), (ps * pass_chunks + c,)))
                            if const_expr(ps == self.dq_passes - 1):
                                cute.arch.fence_view_async_shared()
                        cute.arch.sync_warp()  # reconverged before the next warp-wide tcgen05.ld
                cute.arch.sync_warp()
                if const_expr(self.dq_passes == 1):
                    if lane == 0:
                        row0 = m_block * self.tile_m + warp * WARP_SIZE + grp * DQ_GROUP_ROWS
                        bulk_reduce_add_f32(mdQacc[row0, None, head, batch].iterator, block.iterator, block_bytes)
                        cute.arch.cp_async_bulk_commit_group()
                else:  # elected, not lane 0: ptxas then needs no ELECT / BRA.U.ANY loop around UBLKRED
                    with cute.arch.elect_one():
                        row0 = m_block * self.tile_m + warp * WARP_SIZE + grp * DQ_GROUP_ROWS
                        bulk_reduce_add_f32(mdQacc[row0, None, head, batch].iterator, block.iterator, block_bytes)
                        cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.dq_passes > 1):  # the last group's last pass read dQ out
                tcgen05_fence_before()
                self.arrive_elected(pipes["dq"], 0, "reduce", True)
            if const_expr(self.cfg.deterministic):
                self.bulk_wait(lane, False)  # this warp's adds landed in global memory
                named_barrier_sync(REDUCE_BARRIER, THREADS_PER_WG)
                if tidx == 0:
                    cute.arch.atomic_add(sem_ptr, Int32(1), sem="release", scope="gpu")
            phase = phase ^ 1
        self.bulk_wait(lane, True)

    @cute.jit
    def bulk_wait(self, lane, read: cutlass.Constexpr[bool]):
        """cp.async.bulk.wait_group 0 in the thread that issues this warp's dQ reduce-adds (bulk groups
        are per thread): lane 0 with one read-out pass; with several (hd192) the elect.sync leader
        (the same lane every time for a full mask, PTX ISA), as the reduce-adds are issued there."""
        if const_expr(self.dq_passes == 1):
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=read)
        else:
            with cute.arch.elect_one():
                cute.arch.cp_async_bulk_wait_group(0, read=read)

    @cute.jit
    def reduce_2cta(self, mma_dq, mdQacc, sdQ, pipes, tile, cta_v):
        """2-CTA dQ-reduce warps (both CTAs). The pair's dQ = dS K is one M = tile_m MMA: each CTA's
        TMEM holds tile_m / 2 query rows x D, folded into 128 lanes x D / 2 columns (PTX data-path
        layout B). Per step: wait dq, load this thread's D / 2 values (tcgen05.ld 32x32b), arrive on the
        leader's dq empty, then per group of dq_group_rows lanes of the warp: the lanes write their
        values into the warp's smem block (one row of D / 2 per lane), and lane 0 reduce-adds each lane's
        runs of DQ_LD_COLS columns into the fp32 accumulator at that lane's (query, column), read from
        the MMA's partition of an identity tensor (no assumption on the folding) and passed by shuffle."""
        _, _, batch, _, _, _, _, _ = tile
        n_steps = tile[3] * tile[5]
        tidx = cute.arch.thread_idx()[0] % THREADS_PER_WG
        warp = tidx // WARP_SIZE
        lane = cute.arch.lane_idx()
        base = self.tmem_base()
        acc = self.tmem_acc(base, mma_dq, self.mma_tiler_dq, "dQ")
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(DQ_LD_COLS)), Float32)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, acc)
        thr_ld = tiled_ld.get_slice(tidx)
        src = thr_ld.partition_S(acc)
        # (query row in the tile, column) of each value this thread loads
        coords = thr_ld.partition_D(mma_dq.get_slice(cta_v).partition_C(
            cute.make_identity_tensor(cute.select(self.mma_tiler_dq, mode=[0, 1]))))
        n_chunks = self.dq_cols // DQ_LD_COLS
        if const_expr(cute.size(coords) != self.dq_cols):
            raise RuntimeError(f"flash4 bwd_sm100: a dQ reduce thread loads {cute.size(coords)} values, the plan "
                               f"says {self.dq_cols}")
        # element offset (row * D + column) of each chunk's first value in a query block of the accumulator
        offs = [coords[c * DQ_LD_COLS][0] * self.hdim + coords[c * DQ_LD_COLS][1] for c in range(n_chunks)]
        groups = WARP_SIZE // self.dq_group_rows
        block = sdQ[None, None, warp]  # (D / 2, dq_group_rows) fp32, this warp's staging block
        my_row = block[None, lane % self.dq_group_rows]
        phase = Int32(0)
        pass_chunks = n_chunks // self.dq_passes  # DQ_LD_COLS chunks a thread holds at once (bwd_dq_passes)
        for i in cutlass.range(n_steps, unroll=1):
            head, m_block = self.step_coords(tile, i)
            pipes["dq"].wait_full(0, phase)
            tcgen05_fence_after()
            flat = None
            if const_expr(self.dq_passes == 1):  # all D / 2 values at once, dQ's columns freed at once
                frag = cute.make_rmem_tensor(coords.shape, Float32)
                cute.copy(thr_ld, src, frag)
                cute.arch.fence_view_async_tmem_load()
                tcgen05_fence_before()
                self.arrive_elected(pipes["dq"], 0, "reduce", True)  # dQ read out (on the leader's barrier)
                flat = cute.make_tensor(frag.iterator, cute.make_layout(self.dq_cols))
            gblock = mdQacc[m_block * self.tile_m, None, head, batch].iterator  # the query block's first row
            for grp in cutlass.range_constexpr(groups):
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # the block's previous reduce-adds read it
                cute.arch.sync_warp()
                if const_expr(self.dq_passes == 1):
                    if lane // self.dq_group_rows == grp:
                        cute.autovec_copy(flat, my_row)
                        cute.arch.fence_view_async_shared()  # smem writes -> visible to the bulk copy (async proxy)
                else:
                    # (192, 128): per pass the warp loads pass_chunks chunks of its 32 lanes (tcgen05.ld is
                    # warp-wide) and the group's lanes stage theirs; dQ's columns are free after the last
                    # group's last pass (the serial schedule's next S^T waits for that)
                    for ps in cutlass.range_constexpr(self.dq_passes):
                        # src / part modes: (the load's values, chunk of DQ_LD_COLS columns, 1, 1)
                        part = cute.make_rmem_tensor((coords.shape[0], pass_chunks, 1, 1), Float32)
                        for c in cutlass.range_constexpr(pass_chunks):
                            cute.copy(thr_ld, src[None, ps * pass_chunks + c, None, None], part[None, c, None, None])
                        cute.arch.fence_view_async_tmem_load()
                        if lane // self.dq_group_rows == grp:
                            cols = pass_chunks * DQ_LD_COLS
                            cute.autovec_copy(cute.make_tensor(part.iterator, cute.make_layout(cols)),
                                              cute.local_tile(my_row, (cols,), (ps,)))
                            if const_expr(ps == self.dq_passes - 1):
                                cute.arch.fence_view_async_shared()
                        cute.arch.sync_warp()  # reconverged before the next warp-wide tcgen05.ld
                cute.arch.sync_warp()
                for r in cutlass.range(self.dq_group_rows, unroll=1):
                    dst = [cute.arch.shuffle_sync(offs[c], grp * self.dq_group_rows + r) for c in range(n_chunks)]
                    if lane == 0:
                        for c in cutlass.range_constexpr(n_chunks):
                            bulk_reduce_add_f32(gblock + dst[c], block[None, r].iterator + c * DQ_LD_COLS,
                                                DQ_LD_COLS * 4)
                if lane == 0:
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.dq_passes > 1):  # the last group's last pass read dQ out
                tcgen05_fence_before()
                self.arrive_elected(pipes["dq"], 0, "reduce", True)
            phase = phase ^ 1
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
