"""The backward step of the Hopper kernel's consumer warpgroups (kernels/sm90/bwd.py), written once.

`BwdStep.mma_one_m_block` is one query tile m_block against the CTA's key tile (FlashAttention-2
backward, Dao 2023, algorithm 2), per consumer warpgroup:

    wait Q; issue S; wait dO; issue dP; wait for S
    score transform (kernels/common/score.apply), exponent and mask -> P   (under the dP GEMM)
    stage_P: hand P on (dV issued from registers or from smem, or only wait for dP)
    sink_delta only: wait dQEmpty; the warp's partial sums of D = sum_j P dP to smem (stage_delta)
    dS = P * (dP - D) * scale [* score.grad_factor]                        (under dV, when issued)
    stage_dS: dS (and P) to registers / smem for dK and dQ, the dS barrier (dV issued here in some)
    dQ = dS K; release dO; issue dK; dQ tile to smem for warp 1 (under dK); wait; release Q

The three work splits (config.BwdConfig split_headdim, transposed_dkv) are subclasses that supply
the operands (built once, before the loop), the orientation of the score tile, the GEMM calls and
the hand-offs between the steps above; the order of the steps, the exponent (fast and exact
paths), dS and the dQ hand-off are the base class's:

  * StepRegs (headdim <= 128): the S^T formulation, keys on M; each warpgroup owns 64 keys and keeps
    dK, dV over the full headdim in registers; P^T and dS^T are dV's and dK's A operands from
    registers (RS); dS^T is staged in smem for dQ. dv_after_ds (FA3's order, BwdConfig docs in
    bwd.py): dV is issued after the dS math from one bf16 copy of dS^T, else before it.
  * StepSplitHd (headdim 256): S^T; both warpgroups share 64 keys, each computes S^T, dP^T for half
    of the queries and accumulates dK, dV, dQ for half of headdim; P^T and dS^T go through smem (SS).
  * StepRegsDqT (BwdConfig.dq_swapab, a speed candidate, off): StepRegs at tile_m 80 (flash-attn-4's
    head dim 128 non-causal tile) with the dQ GEMM transposed, dQ^T = K^T dS^T (M = head dim).
  * StepDkvT (transposed_dkv, head dim 192 and (192, 128)): query-major S, dP (each warpgroup a 48-key
    half); dV^T = dO^T P and dK^T = Q^T dS with the head dim on M, both operands from smem.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from flash4.constants import THREADS_PER_WG
from flash4.kernels.common import geometry, score
from flash4.kernels.common.barriers import NamedBarrierBwd
from flash4.kernels.common.dq_accum import store_accum_order, store_accum_order_wg
from flash4.kernels.common.dsl import DynamicState
from flash4.kernels.common.exp2 import exp2_hw, fma_rn
from flash4.kernels.common.gemm import wgmma
from flash4.kernels.common.layout import acc_mn_view, acc_to_frgA_layout, transpose_view
from flash4.kernels.common.pin import pin_ahead
from flash4.kernels.common.pipeline import next_state


def delta_buffer(s_delta, step, double_buffered: bool):
    """sink_delta: the (tile_m, slots) partial-sum buffer of step `step`: with BwdConfig.sink_delta_db
    the one of the step's parity (s_delta (tile_m, slots, 2)), else the only one."""
    if double_buffered:
        return s_delta[None, None, step % 2]
    return s_delta


def stage_state(step, stages: int, producer: bool):
    """The pipeline state of a `stages`-deep pipeline at step `step` (every step takes one stage),
    derived from the step count instead of carried through the loop (the dO pipeline of the
    transposed_dkv path when its depth differs from Q's)."""
    phase = (step // stages) % 2
    if producer:
        phase = phase ^ 1
    return pipeline.PipelineState(stages, Int32(step), Int32(step % stages), Int32(phase))


@dsl_user_op
def thread_idx_fresh(*, loc=None, ip=None) -> Int32:
    """threadIdx.x read by an opaque (side-effecting) instruction: what is derived from it (the
    zero stores' addresses) is computed where it is used, not hoisted out of the main loop and
    kept in registers across it."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def zero_threads(num_threads: int, rows: int, cols: int, vec: int) -> tuple[int, int]:
    """(threads, threads per row) of BwdStep.zero_rows: the most of the num_threads consumer
    threads, a multiple of 128, whose passes of 16-byte chunks (vec elements) tile a (rows, cols)
    tile evenly (threads per row = gcd(chunks per row, threads); rows per pass must divide rows)."""
    chunks_per_row = cols // vec
    for threads in range(num_threads, 0, -THREADS_PER_WG):
        per_row = math.gcd(chunks_per_row, threads)
        if rows % (threads // per_row) == 0:
            return threads, per_row
    raise ValueError(f"no even zero-fill layout of a ({rows}, {cols}) tile")


def butterfly_reduce_scatter(vals: list, lane, masks, select, shuffle_xor) -> list:
    """A warp's reduce-scatter of per-lane lists over the lanes l ^ mask (masks: the lane bits that
    differ between lanes holding the same items, in order). Per mask, while more than one item is
    left, the lane with that bit clear keeps the lower half of its items and the other the upper half,
    each adding the partner's copy of the half it keeps (shuffle_xor(x, mask)); with one item left
    the stage is an all-reduce. Returns this lane's items; item k is input item k + the halves kept.
    shuffle_xor None: only the selection (the items' indices or rows, replayed). Pure over its ops:
    the kernel binds select_ / shfl.bfly, the CPU test numpy arrays over 32 lanes."""
    for mask in masks:
        upper = (lane & mask) != 0
        if len(vals) == 1:
            if shuffle_xor is not None:
                vals = [vals[0] + shuffle_xor(vals[0], mask)]
            continue
        half = len(vals) // 2
        kept = []
        for i in range(half):
            keep = select(upper, vals[i + half], vals[i])
            if shuffle_xor is not None:
                keep = keep + shuffle_xor(select(upper, vals[i], vals[i + half]), mask)
            kept.append(keep)
        vals = kept
    return vals


def dq_t_coords(tidx: int, v: int, hdim_per_wg: int = 64) -> tuple[int, int]:
    """(query, head dim) in the (tile_m, headdim) dQ tile of value v of consumer thread tidx's dQ^T
    fragment (BwdConfig.dq_swapab, StepRegsDqT). The wgmma m64nNk16 fp32 accumulator of warpgroup
    w = tidx // 128 covers dQ^T rows (head dims) [64 w, 64 w + 64) and all N = tile_m columns
    (queries); CuTe's C layout ((4, 8, 4), (2, 2, N / 8)) : ((128, 1, 16), (64, 8, 512)) over
    (M, N) puts value v = v0 + 2 v1 + 4 v2 of lane l in warp u at row 16 u + l // 4 + 8 v1 and
    column 8 v2 + 2 (l % 4) + v0. Transposed back: dQ[query, d] = dQ^T[d, query]. Pure (the CPU
    test checks it tiles the dQ tile once and the staging offsets the SASS shows)."""
    wg, t = divmod(tidx, 128)
    warp, lane = divmod(t, 32)
    v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
    d = hdim_per_wg * wg + 16 * warp + lane // 4 + 8 * v1
    query = 8 * v2 + 2 * (lane % 4) + v0
    return query, d


def step_class(cfg):
    """The BwdStep subclass of a config (its work split)."""
    if cfg.transposed_dkv:
        return StepDkvT
    if cfg.dq_swapab:
        return StepRegsDqT
    return StepSplitHd if cfg.split_headdim else StepRegs


class BwdStep(DynamicState):
    """A consumer warpgroup's per-thread operands and accumulators (built at construction, before the
    main loop) and the per-m_block step. Loop-invariant: the step loop carries nothing of it (no
    dynamic fields; the accumulators are updated in place).

    kernel: the FlashAttentionBackwardSm90 (read for trace-time constants only: tiles, stages,
    flags, dtype); gmem: BwdTensors; smem: BwdSmem; mmas: BwdTiledMmas; pipes: BwdPipelines;
    sched: BwdSchedule; tidx: the thread's index among the consumer threads. acc_dK, acc_dV: the
    fp32 dK, dV accumulators (dK^T, dV^T with transposed_dkv) the epilogue stores."""

    def __init__(self, kernel, gmem, smem, mmas, pipes, sched, tidx):
        self.k, self.cfg = kernel, kernel.cfg
        self.gmem, self.smem, self.mmas, self.pipes, self.sched, self.tidx = gmem, smem, mmas, pipes, sched, tidx
        self.lse_pre = None  # BwdConfig.lse_early: the step's LSE values (preload_lse)
        self.wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        wg_slice = cute.make_layout(kernel.num_wg_mma, stride=THREADS_PER_WG)(self.wg_idx)
        wgs = [m.get_slice(wg_slice) for m in (mmas.sdp, mmas.dkv, mmas.dv, mmas.dq)]
        self.make_operands(*wgs, mmas.sdp.get_slice(tidx))
        self.make_dq_staging()

    def dq_tile(self):
        return (self.k.tile_m, self.k.hdim)

    def make_dq_staging(self):
        """dQ accumulator -> fp32 smem tile (queries x d).
        64-bit stores (2 adjacent columns of the accumulator stay adjacent in either layout)."""
        self.r2s_dQ = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64), self.mmas.dq
        ).get_slice(self.tidx)
        self.tdQsdQ = self.r2s_dQ.partition_D(self.smem.dq)

    # ---- the step --------------------------------------------------------------------------------
    @cute.jit
    def mma_one_m_block(self, m_block, head, step, state, masked: cutlass.Constexpr[bool], scales):
        """Query tile m_block of query head `head`: the module docstring's order. step: the step's
        index (dQ/dS buffers, the dO stage); state: the Q (and dO) pipeline state; masked: the
        element mask is applied (static); scales: StepScales. Returns the next pipeline state."""
        k, pipes = self.k, self.pipes
        tile, tile_batch = self.sched.tile_index(m_block)
        exact = self.gmem.exact[tile, head, tile_batch] != 0
        do_state = state
        if const_expr(k.do_stages != k.q_stages):
            do_state = stage_state(step, k.do_stages, producer=False)
        if const_expr(k.ragged_q and not self.cfg.no_tail_guard):  # (no_tail_guard: A/B only)
            self.zero_q_tail(m_block, state, do_state)  # the query-edge step: Q, dO rows >= seqlen_q -> 0
        pipes.q.consumer_wait(state)
        acc_S = cute.make_rmem_tensor(self.acc_shape_S, Float32)
        self.gemm_S(acc_S, state)
        # BwdConfig.lse_early: the LSE reads issued under the S^T GEMM (exponent reads them back)
        self.lse_pre = self.preload_lse(acc_S, state) if const_expr(self.cfg.lse_early) else None
        pipes.do.consumer_wait(do_state)
        acc_dP = cute.make_rmem_tensor(self.acc_shape_S, Float32)
        self.gemm_dP(acc_dP, do_state)
        score.apply(acc_S, scales.softcap_scale, self.cfg.softcap)
        self.probabilities(acc_S, exact, m_block, head, state, masked, scales.scale_log2)
        staged = self.stage_P(acc_S, step, state, do_state)
        if const_expr(self.cfg.sink_delta):
            self.stage_delta(acc_S, acc_dP, step)  # dP is complete here, P and dP both fp32
        self.grad_scores(acc_dP, acc_S, state, do_state, scales)
        staged = self.stage_dS(acc_dP, acc_S, staged, state)
        acc_dQ = cute.make_rmem_tensor(self.mmas.dq.partition_shape_C(self.dq_tile()), Float32)
        self.gemm_dQ(acc_dQ, staged)
        pipes.do.consumer_release(do_state)  # dV (the last reader of dO) is done
        # dK runs on the tensor cores while the dQ tile goes to smem.
        self.gemm_dK(staged, state)
        self.hand_off_dQ(acc_dQ, step)
        warpgroup.wait_group(0)
        pipes.q.consumer_release(state)  # dK (the last reader of Q) is done
        return next_state(state)

    # ---- rows past the sequence (ragged layouts) ----------------------------------------------------
    @cute.jit
    def zero_kv_tail(self):
        """Ragged-K configs (varlen_k / seqused_k), once per CTA after the K/V full barrier: K and V
        rows >= seqlen_k of the key tile -> 0 in smem. Those rows hold the next packed sequence or
        stale slots past seqused_k (NaN, inf); the mask makes their P exactly 0, but a GEMM still
        multiplies them: dP^T = V dO^T (dS = 0 * NaN) and dQ = dS K (0 * NaN). Zeroed, the smem
        tiles equal the dense layout's TMA-clipped ones, bit for bit."""
        k = self.k
        valid = self.sched.seq.seqlen_k - self.sched.n_block * k.tile_n
        if valid < k.tile_n:
            self.zero_rows(self.smem.k, valid)
            self.zero_rows(self.smem.v, valid)
            self.tail_barrier()

    @cute.jit
    def zero_q_tail(self, m_block, state, do_state):
        """Ragged-Q configs (varlen_q / seqused_q), the query-edge step only: Q and dO rows >=
        seqlen_q of the step's stages -> 0 in smem (the next packed sequence or rows past
        seqused_q: their P is 0 through the padded LSE only while S is finite, and dV += P^T dO,
        dK += dS^T Q, dP^T = V dO^T multiply them). Waits on both stages' full barriers first
        (the step's own waits then return at once; the stages are released only after the step's
        last GEMM)."""
        k = self.k
        valid = self.sched.seq.seqlen_q - m_block * k.tile_m
        if valid < k.tile_m:
            self.pipes.q.consumer_wait(state)
            self.pipes.do.consumer_wait(do_state)
            self.zero_rows(self.smem.q[None, None, state.index], valid)
            self.zero_rows(self.smem.do[None, None, do_state.index], valid)
            self.tail_barrier()

    def tail_barrier(self):
        """After zero_rows: each thread's generic-proxy zeros ordered before the async proxy (the
        wgmma reads, the stage's later TMA refill, the dK/dV TMA store), then every consumer thread
        (both warpgroups read every row of K, V, Q and dO) past the Tail barrier."""
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Tail), number_of_threads=self.k.num_mma_threads)

    @cute.jit
    def zero_rows(self, sX: cute.Tensor, valid):
        """Rows >= valid of a (rows, cols) 16-bit smem tile (any swizzle of 16-byte chunks) -> 0, in
        16-byte stores by the first `threads` consumer threads (zero_threads)."""
        k = self.k
        rows, cols = cute.size(sX, mode=[0]), cute.size(sX, mode=[1])
        vec = 128 // k.dtype.width
        threads, per_row = zero_threads(k.num_mma_threads, rows, cols, vec)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), k.dtype, num_bits_per_copy=128)
        thr_layout = cute.make_ordered_layout((threads // per_row, per_row), order=(1, 0))
        tiled = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))
        if const_expr(threads == k.num_mma_threads):
            self._zero_rows_thread(sX, tiled, atom, valid, rows, cols)
        else:
            if self.tidx < threads:
                self._zero_rows_thread(sX, tiled, atom, valid, rows, cols)

    @cute.jit
    def _zero_rows_thread(self, sX, tiled, atom, valid, rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int]):
        # the consumer thread index read afresh: the addresses are not kept live across the main loop
        thr = tiled.get_slice(thread_idx_fresh() - THREADS_PER_WG)
        tXsX = thr.partition_D(sX)
        tXcX = thr.partition_D(cute.make_identity_tensor((rows, cols)))
        zeros = cute.make_fragment_like(tXsX[None, 0, None])
        zeros.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            if tXcX[0, m, 0][0] >= valid:
                cute.copy(atom, zeros, tXsX[None, m, None])

    # ---- shared pieces ---------------------------------------------------------------------------
    @cute.jit
    def exponent(self, acc_S, exact, m_block, head, state, scale_log2):
        """s = score * scale_log2 - LSE_log2[query] in place, query by query (each LSE read once and
        used at once). Fast path: the padded log2 LSE staged with Q. exact (the query tiles the
        preprocess flagged, |LSE * log2 e| >= BWD_EXACT_LSE_LOG2): the forward's unrounded hi + lo
        from global memory, fma(score, scale_log2, -hi) - lo, exact-then-rounded, so P is exact at
        the row's max at any finite magnitude (issue 8); queries past seqlen_q get hi = +inf (P = 0),
        as the padded LSE of the fast path."""
        s = acc_mn_view(acc_S)
        seq = self.sched.seq
        if exact:
            for q in cutlass.range_constexpr(self.num_queries(s)):
                query = self.query(q, m_block)
                hi = Float32.inf
                lo = Float32(0.0)
                if query < seq.seqlen_q:
                    row, batch = seq.q_index(query)
                    hi = self.gmem.lse_hi[row, head, batch]
                    lo = self.gmem.lse_lo[row, head, batch]
                for j in cutlass.range_constexpr(self.num_keys(s)):
                    i = self.qk(q, j)
                    s[i] = fma_rn(s[i], scale_log2, -hi) - lo
        else:
            for q in cutlass.range_constexpr(self.num_queries(s)):
                if const_expr(self.lse_pre is not None):
                    lse_log2 = self.lse_pre[q]
                else:
                    lse_log2 = self.smem.lse[self.query(q), state.index]
                for j in cutlass.range_constexpr(self.num_keys(s)):
                    i = self.qk(q, j)
                    s[i] = s[i] * scale_log2 - lse_log2

    def preload_lse(self, acc_S, state) -> list:
        """BwdConfig.lse_early: the fast path's padded log2 LSE of this thread's queries, read from
        the Q stage's LSE rows into registers (one value per query, exponent's order). Read whatever
        the tile's exact flag says (the exact path does not use them)."""
        s = acc_mn_view(acc_S)
        return [self.smem.lse[self.query(q), state.index] for q in range(self.num_queries(s))]

    @cute.jit
    def grad_scores(self, acc_dP, acc_S, state, do_state, scales):
        """dP -> dS = scale * P * (dP - D[query]) in place (times score.grad_factor with softcap): the
        softmax scale is applied here, once, so dK = dS^T Q and dQ = dS K need no rescaling."""
        dp, s = acc_mn_view(acc_dP), acc_mn_view(acc_S)
        softmax_scale = scales.softmax_scale
        # D * scale from the host only where the fma form below reads it (BwdConfig.ds_by_fma)
        assert not self.cfg.dpsum_scaled or (self.fma_ds and not self.cfg.softcap), self.cfg
        for q in cutlass.range_constexpr(self.num_queries(dp)):
            query = self.query(q)
            dpsum = self.smem.dpsum[query, do_state.index]
            if const_expr(not self.cfg.softcap and self.fma_ds):
                # P * fma(dP, scale, -D * scale): 2 instructions per element, not 3 (the rounding
                # of D * scale is far below dP's own bf16-GEMM error); BwdConfig.dpsum_scaled: the
                # host multiplied D by the scale already (the same fp32 product)
                dpsum_scaled = dpsum if const_expr(self.cfg.dpsum_scaled) else dpsum * softmax_scale
                for j in cutlass.range_constexpr(self.num_keys(dp)):
                    i = self.qk(q, j)
                    dp[i] = s[i] * fma_rn(dp[i], softmax_scale, -dpsum_scaled)
            elif const_expr(not self.cfg.softcap):
                # (StepRegs with dV in flight here: the form above spills at d128 varlen / window)
                for j in cutlass.range_constexpr(self.num_keys(dp)):
                    i = self.qk(q, j)
                    dp[i] = (s[i] * softmax_scale) * (dp[i] - dpsum)
            else:
                lse_log2 = self.smem.lse[query, state.index]
                for j in cutlass.range_constexpr(self.num_keys(dp)):
                    i = self.qk(q, j)
                    p = s[i]
                    factor = score.grad_factor(p, lse_log2, scales.inv_scale_log2)
                    dp[i] = (p * softmax_scale) * (dp[i] - dpsum) * factor

    @cute.jit
    def hand_off_dQ(self, acc_dQ, step):
        """Stage the dQ tile for warp 1 once it has finished reading the previous one (dQEmpty), then
        signal it (dQFull). BwdConfig.dq_handoff_per_wg: this warpgroup's half only, on its own
        barrier pair (hand_off_dQ_wg). sink_delta: the dQEmpty wait came earlier in the step
        (stage_delta), but with sink_delta_db."""
        k = self.k
        if const_expr(self.cfg.dq_handoff_per_wg):
            self.hand_off_dQ_wg(acc_dQ, step)
            return
        if const_expr(not self.cfg.sink_delta or self.cfg.sink_delta_db):
            if step > 0:
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=k.num_mma_threads + 32)
        if const_expr(self.cfg.dq_accum_order):
            store_accum_order(acc_dQ, self.smem.dq.iterator, self.tidx, k.num_mma_threads)  # 16-byte, conflict-free
        else:
            cute.copy(self.r2s_dQ, self.r2s_dQ.retile(acc_dQ), self.tdQsdQ)
        # The bulk reduce reads sdQ through the async proxy: order our generic-proxy stores first.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQFull), number_of_threads=k.num_mma_threads + 32)

    @cute.jit
    def hand_off_dQ_wg(self, acc_dQ, step):
        """dq_handoff_per_wg: stage this warpgroup's dQ values in its half of the tile (per-warpgroup
        accumulator order) once warp 1 has read the previous step's half (dQEmptyWG), then signal
        that half (dQFullWG); 128 consumer threads + warp 1 per barrier."""
        k = self.k
        threads = THREADS_PER_WG + 32
        if step > 0:
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + self.wg_idx, number_of_threads=threads)
        store_accum_order_wg(acc_dQ, self.smem.dq.iterator, self.tidx, k.num_wg_mma)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.dQFullWG0) + self.wg_idx, number_of_threads=threads)

    # ---- sink_delta: D_i = sum_j P_ij dP_ij per query row (BwdConfig.sink_delta) ---------------------
    # The learnable sink's gradient needs D = rowsum(dO * O) of the float32 output; the preprocess's
    # comes from the rounded 16-bit O (off by a few 16-bit ulps of dSink, docs/conformance/fa4-suite.md).
    # Here D is summed from the step's own fp32 P and dP (sum_j P_ij dP_ij = dO_i . sum_j P_ij V_j):
    # per thread over its keys, then over the lanes that hold the same queries (a butterfly
    # reduce-scatter of delta_chunk queries at a time), staged in smem per warp (one slot each,
    # written as each chunk is reduced: no value stays live across the step's GEMMs), summed in slot
    # order by the store warp (bwd.add_delta) after dQFull. Where the dQEmpty wait moves, and the
    # shuffles, cost only sink_delta configs; the others compile to the same cubin.
    @cute.jit
    def stage_delta(self, acc_S, acc_dP, step):
        """The warp's partial D sums of this step into its slot of smem.delta, chunk by chunk
        (delta_chunks): each chunk's values are stored as soon as they are reduced. One buffer: once
        the store warp has read the previous step's (the dQEmpty wait, taken here instead of at the
        dQ hand-off).
        BwdConfig.sink_delta_db: into the buffer of the step's parity, which the store warp read at
        step - 2 and whose dQEmpty this warpgroup passed at step - 1's hand-off: no wait here."""
        if const_expr(not self.cfg.sink_delta_db):
            if step > 0:
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=self.k.num_mma_threads + 32)
        tidx = thread_idx_fresh() - THREADS_PER_WG  # read afresh: nothing derived from it is kept across the loop
        lane = tidx % 32
        slot = self.delta_slot(tidx)
        base = self.query_base()
        s, dp = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        s_delta = delta_buffer(self.smem.delta, step, self.cfg.sink_delta_db)
        for chunk in self.delta_chunks(self.num_queries(s)):
            for row, value in zip(self.delta_rows(chunk, lane, base), self.delta_partials(s, dp, chunk, lane)):
                s_delta[row, slot] = value

    # at most this many of a thread's queries are reduced together (the partial sums live at once):
    # 8 spilled 4-8 registers at head dim 128 with a window or softcap (compile check), 4 none
    delta_chunk = 4

    def delta_chunks(self, n: int) -> list:
        """The thread's n queries in chunks of delta_chunk, each reduced over the lanes on its own."""
        size = min(n, self.delta_chunk)
        return [list(range(c, c + size)) for c in range(0, n, size)]

    def delta_partials(self, s, dp, chunk, lane) -> list:
        """This lane's share of the warp's partial D sums of the chunk's queries (s, dp: acc_mn_view of
        the step's fp32 P and dP, before dS overwrites dP), through the butterfly over
        delta_lane_masks (see delta_rows). Two lanes that end with the same row (an all-reduce stage)
        hold, and write, the same value."""
        vals = []
        for q in chunk:
            part = None
            for j in range(self.num_keys(s)):
                i = self.qk(q, j)
                part = s[i] * dp[i] if part is None else part + s[i] * dp[i]
            vals.append(part)
        return butterfly_reduce_scatter(vals, lane, self.delta_lane_masks,
                                        lambda c, a, b: Float32(cutlass.select_(c, a, b)),
                                        lambda x, mask: cute.arch.shuffle_sync_bfly(x, offset=mask))

    def delta_rows(self, chunk, lane, base) -> list:
        """The query rows (in the tile) of delta_partials' values for the chunk on this lane: the same
        butterfly replayed on the static offsets of the thread's queries, plus the thread's base."""
        offsets = butterfly_reduce_scatter([self.query_offset(q) for q in chunk], lane, self.delta_lane_masks,
                                           lambda c, a, b: Int32(cutlass.select_(c, Int32(a), Int32(b))), None)
        return [base + o for o in offsets]

    def wait_dq_drained(self):
        """After the last step: wait until warp 1 has read this warpgroup's last staged dQ (matches
        its last dQEmpty arrive; the smem is reused after)."""
        k = self.k
        if const_expr(self.cfg.dq_handoff_per_wg):
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmptyWG0) + self.wg_idx,
                              number_of_threads=THREADS_PER_WG + 32)
        else:
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dQEmpty), number_of_threads=k.num_mma_threads + 32)

    def wait_dP(self, acc_S):
        """Wait for dP^T (every wgmma group of this warpgroup) where nothing of the step is issued
        before that wait. ptxas hoists the wait above P's exponentials, which it schedules next to
        the dS math (H200 ncu, d64: all 64 MUFU.EX2 after the WARPGROUP.DEPBAR, none under the dP^T
        GEMM); neither a wgmma fence nor a named barrier in between keeps them ahead (both tried).
        BwdConfig.exp_before_dp_wait: predicated-off shared stores of P (kernels/common/pin.py,
        never executed) before the wait, which ptxas keeps ahead of it, so every exponential is
        computed while dP^T is in flight. Same values."""
        if const_expr(self.cfg.exp_before_dp_wait):
            pin_ahead(acc_S, self.sched.seq.seqlen_q, self.smem.ds.iterator)
        warpgroup.wait_group(0)

    def stage_16bit(self, r2s, acc, dst):
        """acc (fp32) -> 16-bit registers -> smem dst through r2s (stmatrix); returns the registers."""
        r = cute.make_rmem_tensor(acc.shape, self.k.dtype)
        r.store(acc.load().to(self.k.dtype))
        cute.copy(r2s, r2s.retile(r), dst)
        return r

    # ---- what a work split supplies ---------------------------------------------------------------
    # make_operands(wg_sdp, wg_dkv, wg_dv, wg_dq, thr_sdp): smem fragments, accumulators, coordinates
    # num_queries(s), num_keys(s), qk(q, j), query(q, m_block=None): the score tile's orientation
    # gemm_S, gemm_dP, probabilities, stage_P, stage_dS, gemm_dQ, gemm_dK: the step's pieces


class _KeyMajor(BwdStep):
    """The S^T formulation (StepRegs, StepSplitHd): S^T = K Q^T, dP^T = V dO^T with keys on M; each
    thread's S^T fragment viewed (key rows, query columns). Per-query values (LSE, D) are read once
    per column; a column's query is the thread's first column plus a static offset (thread 0's)."""

    fma_ds = False  # dS by fma (StepRegs with dv_after_ds)

    def make_operands(self, wg_sdp, wg_dkv, wg_dv, wg_dq, thr_sdp):
        k, smem, mmas = self.k, self.smem, self.mmas
        # S^T = K Q^T: A = K (keys x d), B = Q (queries x d); dP^T = V dO^T likewise.
        self.tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.k))
        self.tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.q))
        self.tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.v))
        self.tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.do))
        # dV += P^T dO: B = dO^T (d x queries); dK += dS^T Q: B = Q^T.
        self.tdVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(smem.do)))
        self.tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(smem.q)))
        self.make_dq_operands(wg_dq)
        self.acc_shape_S = mmas.sdp.partition_shape_C((k.tile_n, k.tile_m))
        self.acc_dV = cute.make_rmem_tensor(mmas.dv.partition_shape_C((k.tile_n, k.hdim_v)), Float32)
        self.acc_dK = cute.make_rmem_tensor(mmas.dkv.partition_shape_C((k.tile_n, k.hdim)), Float32)
        self.acc_dV.fill(0.0)
        self.acc_dK.fill(0.0)
        self.frgA_layout = acc_to_frgA_layout(cute.make_layout(self.acc_shape_S))
        # Coordinates (key row, query col) of this thread's S^T values, and thread 0's (static).
        cS = cute.make_identity_tensor((k.tile_n, k.tile_m))
        self.tScS = acc_mn_view(thr_sdp.partition_C(cS))
        self.t0ScS_full = mmas.sdp.get_slice(0).partition_C(cS)
        self.t0ScS = acc_mn_view(self.t0ScS_full)
        # dS^T registers -> smem (keys x queries), the accumulator's own element order.
        self.r2s_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), k.dtype), mmas.sdp
        ).get_slice(self.tidx)
        self.tdSsdS = self.r2s_dS.partition_D(smem.ds)  # (CPY, CPY_M, CPY_N, 2)
        self.make_p_operands(wg_dkv, wg_dv)
        self.thread_col0 = self.tScS[0, 0][1]

    def make_dq_operands(self, wg_dq):
        """dQ = dS K: A = dS (queries x keys) = transposed dS^T; B = K^T (d x keys)."""
        smem = self.smem
        self.tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(smem.ds)))
        self.tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(smem.k)))

    def make_p_operands(self, wg_dkv, wg_dv):
        pass

    def num_queries(self, s):
        return cute.size(s, mode=[1])

    def num_keys(self, s):
        return cute.size(s, mode=[0])

    def qk(self, q, j):
        return j, q

    # sink_delta: lanes l and l ^ 4, 8, 16 hold the same query columns (the wgmma accumulator's rows
    # lane / 4 and lane / 4 + 8 of the warp's 16 keys)
    delta_lane_masks = (16, 8, 4)

    def query_offset(self, q):
        return self.t0ScS[0, q][1]

    def query_base(self):
        return self.thread_col0

    def delta_slot(self, tidx):
        """Every consumer warp holds 16 keys of all the tile's queries: slot = the warp's index."""
        return tidx // 32

    def query(self, q, m_block=None):
        """This thread's q-th query: in the tile, or (m_block given) in the sequence."""
        col = self.t0ScS[0, q][1]
        if const_expr(m_block is None):
            return self.thread_col0 + col
        return m_block * self.k.tile_m + self.thread_col0 + col

    def gemm_S(self, acc_S, state):
        wgmma(self.mmas.sdp, acc_S, self.tSrK, self.tSrQ[None, None, None, state.index], zero_init=True, wg_wait=-1)

    def gemm_dP(self, acc_dP, do_state):
        wgmma(self.mmas.sdp, acc_dP, self.tdPrV, self.tdPrdO[None, None, None, do_state.index], zero_init=True, wg_wait=1)

    @cute.jit
    def probabilities(self, acc_S, exact, m_block, head, state, masked: cutlass.Constexpr[bool], scale_log2):
        """P^T = 2^(S^T * scale_log2 - LSE_log2[query]), masked entries 0 (mask_probs_t after the
        exponential), column (query) outer."""
        k, sched = self.k, self.sched
        self.exponent(acc_S, exact, m_block, head, state, scale_log2)
        s = acc_mn_view(acc_S)
        bounds = None
        if const_expr(masked and self.cfg.mask_rel):  # BwdConfig.mask_rel: one step's bounds, static offsets
            bounds = geometry.key_row_bounds(self.tScS, m_block, sched.n_block, sched.seq.seqlen_q,
                                             sched.seq.seqlen_k, k.tile_m, k.tile_n, k.causal, sched.window)
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = self.t0ScS[0, c][1]
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                p = exp2_hw(s[r, c])
                if const_expr(masked and self.cfg.mask_rel):
                    p = geometry.mask_prob_rel(bounds, self.t0ScS[r, 0][0] - self.t0ScS[0, 0][0], col, p)
                elif const_expr(masked):
                    p = geometry.mask_probs_t(self.tScS, r, col, p, m_block, sched.n_block, sched.seq.seqlen_q,
                                              sched.seq.seqlen_k, k.tile_m, k.tile_n, k.causal, sched.window)
                s[r, c] = p

    def gemm_dQ(self, acc_dQ, staged):
        buf = staged[0]
        wgmma(self.mmas.dq, acc_dQ, self.tdQrdS[None, None, None, buf], self.tdQrKt, zero_init=True, wg_wait=1)


class StepRegs(_KeyMajor):
    """headdim <= 128: P^T and dS^T are dV's and dK's A operands from registers."""

    def __init__(self, kernel, *args):
        self.fma_ds = kernel.dv_after_ds
        super().__init__(kernel, *args)

    def stage_P(self, acc_S, step, state, do_state):
        """P^T as dV's A fragment; without dv_after_ds dV is issued now, before waiting for dP^T (the
        exponentials finish first, so they overlap the dP^T GEMM, and the dS^T math overlaps dV)."""
        k = self.k
        buf = step % 2  # two dS^T buffers: the other warpgroup may still read the previous step's
        tdVrP = cute.make_rmem_tensor(self.frgA_layout.shape, k.dtype)
        tdVrP.store(cute.make_tensor(acc_S.iterator, self.frgA_layout).load().to(k.dtype))
        if const_expr(k.dv_after_ds):
            self.wait_dP(acc_S)  # dV is issued after the dS^T math
        else:
            wgmma(self.mmas.dv, self.acc_dV, tdVrP, self.tdVrdOt[None, None, None, state.index], wg_wait=1)
        return buf, tdVrP

    def stage_dS(self, acc_dP, acc_S, staged, state):
        """dS^T in 16 bits: staged in smem for dQ and dK's A fragment; dv_after_ds: one copy for both
        (viewed as an A fragment), then dV is issued. dS barrier: both warpgroups' keys are staged."""
        k = self.k
        buf, tdVrP = staged
        if const_expr(k.dv_after_ds):
            rdS = self.stage_16bit(self.r2s_dS, acc_dP, self.tdSsdS[None, None, None, buf])
            tdKrdS = cute.make_tensor(rdS.iterator, self.frgA_layout)
            wgmma(self.mmas.dv, self.acc_dV, tdVrP, self.tdVrdOt[None, None, None, state.index], wg_wait=-1)
        else:
            tdKrdS = cute.make_rmem_tensor(self.frgA_layout.shape, k.dtype)
            tdKrdS.store(cute.make_tensor(acc_dP.iterator, self.frgA_layout).load().to(k.dtype))
            self.stage_16bit(self.r2s_dS, acc_dP, self.tdSsdS[None, None, None, buf])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dS), number_of_threads=k.num_mma_threads)
        return buf, tdKrdS

    def gemm_dK(self, staged, state):
        wgmma(self.mmas.dkv, self.acc_dK, staged[1], self.tdKrQt[None, None, None, state.index], wg_wait=1)


class StepRegsDqT(StepRegs):
    """BwdConfig.dq_swapab (speed candidate, off; compile-verified, not run on hardware): StepRegs at
    flash-attn-4's head dim 128 non-causal tile, tile_m 80, with the dQ GEMM transposed so that its M
    is a multiple of 64 (dQ = dS K would put the 80 queries on M):

        dQ^T = K^T dS^T     M = head dim (warpgroup w: head dims [64w, 64w + 64)), N = tile_m queries,
                            K = the tile's 128 keys; A = K^T (K's smem, MN-major), B = dS^T viewed
                            (queries x keys) from the staged dS^T buffer (MN-major)

    Thread t of warpgroup w holds dQ^T[d, q] for d = 64w + the wgmma C row and q = its C column
    (dq_t_coords); hand_off_dQ writes each value to the row-major staging tile sdQ[q, d] (the
    transposed view of sdQ, one 32-bit store per value: two values adjacent in the fragment are
    adjacent queries, a row apart in sdQ), which the store warp reduce-adds whole onto the
    accumulator's rows m_block * tile_m .. + tile_m (row-major, unpadded: BwdConfig.dq_row_pad 0).
    S^T, dP^T (keys x 80 queries), P^T / dS^T as dV's / dK's register A operands (K = 80 = 5 k16
    slices), the exponent and dS math: StepRegs' code at N = 80. One change of order: dQ^T is
    issued only once dV has finished (wait_group(0) first; StepRegs issues dQ with dV in flight and
    waits for dV after): with dV's 16-bit P^T, dV, dK, the 16-bit dS^T and dQ^T's 40 fp32 all live
    at once, ptxas serialized every wgmma of the kernel (C7512) and spilled 40 registers of S^T in
    the exact-LSE path (sm_90a, compile check); with the wait, 0 spills and no serialization."""

    def dq_tile(self):
        return (self.k.hdim, self.k.tile_m)

    def make_dq_staging(self):
        """dQ^T accumulator (d x queries) -> the fp32 (queries x d) smem tile through its transposed
        view, 32-bit stores."""
        self.r2s_dQ = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=32), self.mmas.dq
        ).get_slice(self.tidx)
        self.tdQsdQ = self.r2s_dQ.partition_D(transpose_view(self.smem.dq))

    def make_dq_operands(self, wg_dq):
        smem = self.smem
        # dQ^T = K^T dS^T: A = K^T (d x keys), B = dS^T viewed (queries x keys), 2 buffers.
        self.tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(smem.k)))
        self.tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(smem.ds)))

    def gemm_dQ(self, acc_dQ, staged):
        buf = staged[0]
        warpgroup.wait_group(0)  # dV done: its 16-bit P^T is free before dQ^T's accumulator is taken
        wgmma(self.mmas.dq, acc_dQ, self.tdQrKt, self.tdQrdS[None, None, None, buf], zero_init=True, wg_wait=-1)


class StepSplitHd(_KeyMajor):
    """headdim 256 (split_headdim): P^T and dS^T staged in smem, dV and dK read them from there (every
    warpgroup needs all 64 keys x tile_m for its half of headdim)."""

    def delta_slot(self, tidx):
        """A warpgroup's 4 warps hold the 64 keys of its half of the queries: slot = warp in the group."""
        return (tidx // 32) % 4

    def make_p_operands(self, wg_dkv, wg_dv):
        smem = self.smem
        self.tdVrPt = wg_dv.make_fragment_A(wg_dv.partition_A(smem.p))
        self.tdKrdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(smem.ds))
        self.tPsPt = self.r2s_dS.partition_D(smem.p)

    def stage_P(self, acc_S, step, state, do_state):
        buf = step % 2  # two dS^T (P^T) buffers: the other warpgroup may still read the previous step's
        self.wait_dP(acc_S)
        return (buf,)

    def stage_dS(self, acc_dP, acc_S, staged, state):
        """P^T and dS^T to smem; dS barrier; dV from smem."""
        k = self.k
        buf = staged[0]
        self.stage_16bit(self.r2s_dS, acc_S, self.tPsPt[None, None, None, buf])
        self.stage_16bit(self.r2s_dS, acc_dP, self.tdSsdS[None, None, None, buf])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dS), number_of_threads=k.num_mma_threads)
        wgmma(self.mmas.dv, self.acc_dV, self.tdVrPt[None, None, None, buf], self.tdVrdOt[None, None, None, state.index],
              wg_wait=-1)
        return staged

    def gemm_dK(self, staged, state):
        buf = staged[0]
        wgmma(self.mmas.dkv, self.acc_dK, self.tdKrdSt[None, None, None, buf], self.tdKrQt[None, None, None, state.index],
              wg_wait=1)


class StepDkvT(BwdStep):
    """transposed_dkv (flash-attn-4's sm90 shape for head dim 192): 64 queries x 96 keys per step,
    warpgroup w owns keys [48w, 48w + 48).
        S = Q K^T, dP = dO V^T      (query-major, wgmma SS, 64 x 48 per warpgroup)
        P = 2^(S * scale_log2 - LSE_log2[query]) -> sP (this warpgroup's key half)
        dV^T += dO^T P              (head dim on M, both operands from smem)
        dS = P * (dP * scale - D[query] * scale) -> sdS (both halves read by both dQs)
        dQ = dS K                   (warpgroup w: head dims [hdim/2 w, hdim/2 (w + 1)))
        dK^T += Q^T dS
    Order per step: S; dP; mask, exponentials (under dP); stage P, warpgroup barrier, dV^T; dS math
    (under dV^T); barrier (the other warpgroup's previous dQ has read sdS); stage dS; barrier; dQ;
    release dO; dK^T; stage dQ for warp 1 (under dK^T); release Q. The mask sets scores to -inf
    before the exponential (geometry.mask_scores, the forward's). dO may have fewer stages than Q
    (its state is derived from the step: stage_state)."""

    fma_ds = True

    def __init__(self, *args):
        super().__init__(*args)
        # this warpgroup's named barrier (P staged before its dV^T reads it)
        self.bar_pwg = int(NamedBarrierBwd.PWG0) + self.wg_idx

    def make_operands(self, wg_sdp, wg_dkv, wg_dv, wg_dq, thr_sdp):
        k, smem, mmas = self.k, self.smem, self.mmas
        # S = Q K^T: A = Q (queries x d), B = K (keys x d); dP = dO V^T likewise.
        self.tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.q))
        self.tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.k))
        self.tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.do))
        self.tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.v))
        # dV^T = dO^T P: A = dO^T (Dv x queries), B = P viewed (keys x queries); dK^T = Q^T dS likewise.
        self.tdVrdOt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_view(smem.do)))
        self.tdVrP = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(smem.p)))
        self.tdKrQt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_view(smem.q)))
        self.tdKrdS = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(smem.ds)))
        # dQ = dS K: A = dS (queries x keys, K-major), B = K^T (d x keys, MN-major).
        self.tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(smem.ds))
        self.tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(smem.k)))
        self.acc_shape_S = mmas.sdp.partition_shape_C((k.tile_m, k.tile_n))
        self.acc_dK = cute.make_rmem_tensor(mmas.dkv.partition_shape_C((k.hdim, k.tile_n)), Float32)
        self.acc_dV = cute.make_rmem_tensor(mmas.dkv.partition_shape_C((k.hdim_v, k.tile_n)), Float32)
        self.acc_dK.fill(0.0)
        self.acc_dV.fill(0.0)
        # Coordinates (query row, key col) of this thread's S values, and thread 0's (static).
        cS = cute.make_identity_tensor((k.tile_m, k.tile_n))
        self.tScS_full = thr_sdp.partition_C(cS)
        self.t0ScS_full = mmas.sdp.get_slice(0).partition_C(cS)
        self.tScS = acc_mn_view(self.tScS_full)
        # P, dS registers -> smem (queries x keys), the accumulator's own element order.
        self.r2s_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), k.dtype), mmas.sdp
        ).get_slice(self.tidx)
        self.tPsP = self.r2s_PdS.partition_D(smem.p)
        self.tdSsdS = self.r2s_PdS.partition_D(smem.ds)

    def num_queries(self, s):
        return cute.size(s, mode=[0])

    def num_keys(self, s):
        return cute.size(s, mode=[1])

    def qk(self, q, j):
        return q, j

    # sink_delta: lanes l ^ 1, 2 hold the same query rows (their key columns differ)
    delta_lane_masks = (2, 1)

    def query_offset(self, q):
        return acc_mn_view(self.t0ScS_full)[q, 0][0]

    def query_base(self):
        return self.tScS[0, 0][0]

    def delta_slot(self, tidx):
        """Both warpgroups hold all 64 queries, each a 48-key half: slot = the warpgroup."""
        return tidx // THREADS_PER_WG

    def query(self, q, m_block=None):
        """This thread's q-th query (row): in the tile, or (m_block given) in the sequence."""
        if const_expr(m_block is None):
            return self.tScS[q, 0][0]
        return m_block * self.k.tile_m + self.tScS[q, 0][0]

    def gemm_S(self, acc_S, state):
        wgmma(self.mmas.sdp, acc_S, self.tSrQ[None, None, None, state.index], self.tSrK, zero_init=True, wg_wait=-1)

    def gemm_dP(self, acc_dP, do_state):
        wgmma(self.mmas.sdp, acc_dP, self.tdPrdO[None, None, None, do_state.index], self.tdPrV, zero_init=True, wg_wait=1)

    @cute.jit
    def probabilities(self, acc_S, exact, m_block, head, state, masked: cutlass.Constexpr[bool], scale_log2):
        """P = 2^(S * scale_log2 - LSE_log2[query]); masked scores are -inf first (P = 0)."""
        k, sched = self.k, self.sched
        if const_expr(masked):
            geometry.mask_scores(acc_S, self.tScS_full, self.t0ScS_full, m_block, sched.n_block, sched.seq.seqlen_q,
                                 sched.seq.seqlen_k, k.tile_m, k.tile_n, k.causal, sched.window)
        self.exponent(acc_S, exact, m_block, head, state, scale_log2)
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[i] = exp2_hw(acc_S[i])

    def stage_P(self, acc_S, step, state, do_state):
        """Stage P (this warpgroup's key half; its previous dV^T finished at the last wait_group(0)),
        then dV^T += dO^T P, which overlaps the dS math."""
        self.stage_16bit(self.r2s_PdS, acc_S, self.tPsP)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=self.bar_pwg, number_of_threads=THREADS_PER_WG)
        wgmma(self.mmas.dkv, self.acc_dV, self.tdVrdOt[None, None, None, do_state.index], self.tdVrP, wg_wait=1)  # dP done
        return None

    def stage_dS(self, acc_dP, acc_S, staged, state):
        k = self.k
        rdS = cute.make_rmem_tensor(acc_dP.shape, k.dtype)
        rdS.store(acc_dP.load().to(k.dtype))
        # The other warpgroup's previous dQ has read sdS (it waited for it before this barrier).
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dS), number_of_threads=k.num_mma_threads)
        cute.copy(self.r2s_PdS, self.r2s_PdS.retile(rdS), self.tdSsdS)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.dS), number_of_threads=k.num_mma_threads)
        return None

    def gemm_dQ(self, acc_dQ, staged):
        wgmma(self.mmas.dq, acc_dQ, self.tdQrdS, self.tdQrKt, zero_init=True, wg_wait=1)

    def gemm_dK(self, staged, state):
        wgmma(self.mmas.dkv, self.acc_dK, self.tdKrQt[None, None, None, state.index], self.tdKrdS, wg_wait=1)  # dQ done
