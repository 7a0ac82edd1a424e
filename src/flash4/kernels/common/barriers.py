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
