"""Parameter bundles shared by the kernels: runtime values passed to a kernel and its role
methods as one argument each, instead of loose positional parameters or attributes set on `self`
inside a kernel.

Each bundle is a NamedTuple: the DSL passes its fields as kernel parameters in field order (None
fields specialize the kernel away) and it reads like a struct in device code. A field that a
config leaves off is None. Pass-specific bundles live with their kernel (flash4.kernels.sm90.fwd,
flash4.kernels.sm90.bwd); the ones here mean the same in every kernel.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass.cute as cute
from cutlass import Int32


class SeqParams(NamedTuple):
    """Where each sequence lives (FwdConfig/BwdConfig varlen_q, varlen_k, seqused_q, seqused_k,
    page_rows; kernels/common/seqinfo.SeqInfo reads them per sequence). Each is None when its
    config flag is off.

    cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 row offsets of packed Q / K.
    seqused_q, seqused_k:       (batch,) int32 query / key counts used.
    page_table:                 (batch, max_pages) int32 pages of paged K/V (forward only).
    """

    cu_seqlens_q: Optional[cute.Tensor]
    cu_seqlens_k: Optional[cute.Tensor]
    seqused_q: Optional[cute.Tensor]
    seqused_k: Optional[cute.Tensor]
    page_table: Optional[cute.Tensor] = None

    def lengths(self):
        """(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k): SeqInfo's trailing arguments."""
        return self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_q, self.seqused_k


class MaskParams(NamedTuple):
    """The sliding window's sides (flash4.geometry.window_sides; runtime values, any window runs on
    one compiled kernel). Read only by local configs; the causal flag is static (the config's)."""

    window_left: Int32
    window_right: Int32

    def window(self, local: bool):
        """(left, right) for the geometry functions when `local` (a config flag), else None."""
        return (self.window_left, self.window_right) if local else None
