"""Named barrier ids (bar.sync / bar.arrive). Id 0 is __syncthreads; ours start at 1."""

import enum


class NamedBarrierFwd(enum.IntEnum):
    # All consumer threads (+ nothing else): O staged in smem before the TMA store.
    Epilogue = 1
    # Inter-warpgroup ping-pong: consumer warpgroup w waits on WarpSchedulerWG1 + w - 1 before issuing
    # its GEMMs and arrives on the other warpgroup's barrier after issuing them (FA3, section 3.1).
    WarpSchedulerWG1 = 2
    WarpSchedulerWG2 = 3
    WarpSchedulerWG3 = 4
    # All consumer threads: the V rows past seqlen_k of the key-edge block are zeroed (ragged-K
    # configs only) before any warpgroup's P V reads the stage.
    VTail = 5


class NamedBarrierBwd(enum.IntEnum):
    # Consumers -> dQ store warp: the dQ tile is staged in smem (consumer threads arrive, warp syncs).
    dQFull = 1
    # dQ store warp -> consumers: the bulk reduce has read the staged tile (warp arrives, consumers sync).
    dQEmpty = 2
    # Both consumer warpgroups: dS^T is staged in smem before either dQ GEMM reads it.
    dS = 3
    # Both consumer warpgroups: K, V smem free (epilogue) / dK, dV staged before the TMA store.
    Epilogue = 4
    # transposed_dkv: one consumer warpgroup (128 threads): its P half staged before its dV^T reads it
    # (PWG0 + warpgroup index).
    PWG0 = 5
    PWG1 = 6
    # Both consumer warpgroups (ragged layouts only): rows past the sequence zeroed in smem, the K/V
    # rows >= seqlen_k of the key tile (once) or the Q/dO rows >= seqlen_q of the query-edge step's
    # stages, before any warpgroup's wgmma reads them (bwd_step.BwdStep.zero_kv_tail / zero_q_tail).
    Tail = 7
    # BwdConfig.dq_handoff_per_wg: dQFull / dQEmpty per consumer warpgroup (its 128 threads and the
    # store warp; dQFullWG0 + warpgroup index, dQEmptyWG0 + warpgroup index).
    dQFullWG0 = 8
    dQFullWG1 = 9
    dQEmptyWG0 = 10
    dQEmptyWG1 = 11
