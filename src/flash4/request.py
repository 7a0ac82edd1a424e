"""The request: one attention call, as everything after the public door reads it.

flash4.validate builds it once per call (checked: `validate.dense_request`, `varlen_request`,
`kvcache_request`); config selection (flash4.config.fwd_config / bwd_config), the host forward
(flash4.forward), the host backward (flash4.backward) and the custom ops (flash4.ops) read it.
The unchecked constructors here (`Request.dense`, `Request.varlen`, `Request.kvcache`) serve
callers whose inputs are known good (the backward of a forward that ran, the SDPA plug-in after
its own check, torch.compile's trace, where tensors have no data yet).

    Request
      q, k, v          the tensors (layouts: SeqSpec.layout)
      mask   MaskSpec  which keys a query sees: causal, the sliding window
      score  ScoreSpec how scores become probabilities: scale, softcap, sink (and a score_mod slot)
      seq    SeqSpec   where the sequences live: dense, packed (varlen), paged, a KV cache, decode
      cache  CacheSpec flash_attn_with_kvcache's append and split-KV knobs (None elsewhere)
      deterministic, check_seqlens

A new keyword is a field of one part here, a check in flash4.validate, and whatever the kernels
do with it (read from the request where the launch arguments are unpacked, once per pass).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from flash4.geometry import Band, band, window_sides

# torch dtype -> the dtype name used in the kernel configs (flash4.config).
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# SeqSpec.layout values.
DENSE = "dense"  # q (B, Sq, H, D), k/v (B, Sk, Hk, D): every sequence of a batch the same length
VARLEN = "varlen"  # q (total_q, H, D), k/v (total_k, Hk, D) packed, cu_seqlens_q / cu_seqlens_k
PAGED = "paged"  # q packed as VARLEN, k/v (num_pages, page_size, Hk, D) with page_table and seqused_k
KVCACHE = "kvcache"  # flash_attn_with_kvcache: q (B, Sq, H, D) over a dense or paged cache, before the append
DECODE = "decode"  # the attention of a KV cache step (after the append): seqused_k keys of each cache row


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Which keys a query sees (flash4.geometry's rule).

    causal:      bottom-right aligned causal mask (the kernels' causal flag; a window folds it in).
    window:      flash4.geometry.window_sides of (window_size, causal): the (left, right) sides the
                 kernels take, UNBOUNDED for an open side; None without a window (plain / causal).
    window_size: the window's literal sides, a flash4.geometry.Band (None = unbounded per side; any
                 int, so a band may exclude the diagonal); Band(None, None): none. Each door
                 translates its own spelling into it (flash-attn 2/3-style doors: -1 -> None;
                 flash4.fa4: literal). What the custom ops' window_left / window_right and the
                 reference take.
    """

    causal: bool = False
    window: tuple[int, int] | None = None
    window_size: Band = Band(None, None)

    @classmethod
    def create(cls, causal: bool, window_size=None) -> MaskSpec:
        """window_size: flash-attn 2/3's (left, right) (-1 per unbounded side), a Band, or None."""
        sides = band(window_size)
        sides = Band(None if sides.left is None else int(sides.left), None if sides.right is None else int(sides.right))
        return cls(causal, window_sides(sides, causal), sides)

    @property
    def local(self) -> bool:
        """A sliding window beyond what `causal` says: the kernels' local variant."""
        return self.window is not None


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """How a score s = q.k becomes a logit.

    softmax_scale: the float applied to Q K^T (resolved: 1 / sqrt(headdim) when the caller passed None).
    softcap:       logit soft-capping, softcap * tanh(scale * s / softcap) (0.0 = off).
    sink:          None or the caller's (nheads,) learnable sink logits (kept as given: autograd
                   differentiates it; `kernel_sink` is what the kernels read).
    score_mod:     reserved for a future score modification (always None today).
    """

    softmax_scale: float
    softcap: float = 0.0
    sink: torch.Tensor | None = None
    score_mod: None = None

    def kernel_sink(self) -> torch.Tensor | None:
        """The sink as the kernels read it: a contiguous float32 (nheads,) tensor without autograd."""
        return None if self.sink is None else self.sink.detach().float().contiguous()


@dataclasses.dataclass(frozen=True)
class SeqSpec:
    """Where the sequences live (layout: DENSE, VARLEN, PAGED, KVCACHE or DECODE; module constants).

    cu_seqlens_q / cu_seqlens_k: (batch + 1,) int32 prefix sums (VARLEN; PAGED: q only).
    seqused_q / seqused_k:       None or (batch,) int32: queries / keys used of each sequence (PAGED,
                                 DECODE: seqused_k always).
    page_table:                  (batch, max_pages) int32 (PAGED, and KVCACHE / DECODE over a paged cache).
    max_seqlen_q:                VARLEN / PAGED: a host int >= every sequence's query count (it sizes the
                                 grid; validate resolves it); None while torch.compile traces (the op
                                 computes it when the graph runs).
    max_seqlen_k:                VARLEN: as the caller gave it (an int, a 0-d tensor or None); only the
                                 backward reads it (flash4.backward resolves it then).
    """

    layout: str = DENSE
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqused_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        """q is packed rows (total_q, H, D) with cu_seqlens_q (VARLEN, PAGED)."""
        return self.layout in (VARLEN, PAGED)

    @property
    def paged(self) -> bool:
        """K/V are pages (num_pages, page_size, Hk, D) read through page_table."""
        return self.page_table is not None

    @property
    def decode(self) -> bool:
        """A KV cache step's attention (DECODE): seqused_k keys of each cache row or page-table row."""
        return self.layout == DECODE


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """flash_attn_with_kvcache's extras (layout KVCACHE, and the DECODE request made from it).

    cache_seqlens:   keys already in each cache row: a (batch,) int32 tensor (validate resolves an int
                     or None to one), or, while torch.compile traces, the int / None as given.
    k_new / v_new:   None or the (batch, seqlen_new, Hk, D) keys / values to append before attending.
    cache_batch_idx: None or (batch,) int32: the dense cache row of each sequence.
    num_splits:      split-KV runs per (sequence, KV head) tile: 0 = auto, 1 = none, n = n.
    """

    cache_seqlens: torch.Tensor | int | None = None
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    cache_batch_idx: torch.Tensor | None = None
    num_splits: int = 0

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k_new is None else self.k_new.shape[1]


@dataclasses.dataclass(frozen=True)
class Request:
    """One attention call (module docstring). Shapes by seq.layout: DENSE / KVCACHE / DECODE q
    (B, Sq, H, D); VARLEN / PAGED q (total_q, H, D); k, v as SeqSpec says (the cache for KVCACHE /
    DECODE). v's head dim may differ from q/k's (flash4.config.HDIMV_PAIRS).

    deterministic: the backward adds dQ (and split dK/dV) partial sums in a fixed order.
    check_seqlens: the caller asked for the on-device value checks of the metadata (validate's
                   builders run them; the field carries the request through the custom ops).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: MaskSpec
    score: ScoreSpec
    seq: SeqSpec = dataclasses.field(default_factory=SeqSpec)
    cache: CacheSpec | None = None
    deterministic: bool = False
    check_seqlens: bool = False

    # ---------------------------------------------------------------- unchecked constructors
    @classmethod
    def dense(cls, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, learnable_sink=None,
              deterministic=False) -> Request:
        """flash_attn_func's request (arguments as flash4.validate.dense_request's), unchecked."""
        return cls(q, k, v, MaskSpec.create(causal, window_size), _score(q, softmax_scale, softcap, learnable_sink),
                   SeqSpec(), deterministic=deterministic)

    @classmethod
    def varlen(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
               seqused_k=None, page_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               learnable_sink=None, deterministic=False, check_seqlens=False) -> Request:
        """flash_attn_varlen_func's request (PAGED with page_table), unchecked; max_seqlen_q as given
        (flash4.validate.varlen_request resolves it to an int)."""
        seq = SeqSpec(PAGED if page_table is not None else VARLEN, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                      page_table, max_seqlen_q, max_seqlen_k)
        return cls(q, k, v, MaskSpec.create(causal, window_size), _score(q, softmax_scale, softcap, learnable_sink),
                   seq, deterministic=deterministic, check_seqlens=check_seqlens)

    @classmethod
    def kvcache(cls, q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None, cache_batch_idx=None,
                softmax_scale=None, causal=False, num_splits=0, window_size=(-1, -1), softcap=0.0, learnable_sink=None,
                check_seqlens=False) -> Request:
        """flash_attn_with_kvcache's request (k / v: the keys to append), unchecked."""
        cache = CacheSpec(cache_seqlens, k, v, cache_batch_idx, num_splits)
        return cls(q, k_cache, v_cache, MaskSpec.create(causal, window_size),
                   _score(q, softmax_scale, softcap, learnable_sink), SeqSpec(KVCACHE, page_table=page_table),
                   cache, check_seqlens=check_seqlens)

    # ---------------------------------------------------------------- derived sizes
    @property
    def dtype(self) -> str:
        """The dtype name of the kernel configs ("bf16", "fp16")."""
        return DTYPE_NAMES[self.q.dtype]

    @property
    def headdim(self) -> int:
        return self.q.shape[-1]

    @property
    def headdim_v(self) -> int:
        return self.v.shape[-1]

    @property
    def nheads(self) -> int:
        return self.q.shape[-2]

    @property
    def nheads_k(self) -> int:
        return self.k.shape[-2]

    @property
    def batch(self) -> int:
        """Sequences: q.shape[0], or cu_seqlens_q.numel() - 1 for packed q."""
        return self.seq.cu_seqlens_q.numel() - 1 if self.seq.packed else self.q.shape[0]

    @property
    def seqlen_q(self) -> int:
        """Queries per sequence (packed q: max_seqlen_q)."""
        return self.seq.max_seqlen_q if self.seq.packed else self.q.shape[1]

    @property
    def page_size(self) -> int:
        """Keys per page of a paged K/V (k.shape[1]), 0 when K/V are not paged."""
        return self.k.shape[1] if self.seq.paged else 0

    @property
    def capacity(self) -> int:
        """Keys a KV cache row holds (KVCACHE / DECODE): seqlen_cache, or pages per sequence x page_size."""
        return self.k.shape[1] * (self.seq.page_table.shape[1] if self.seq.paged else 1)

    def with_seq(self, seq: SeqSpec) -> Request:
        """This request over another sequence layout (the KV cache path's DECODE step, a resolved
        max_seqlen); built directly, not by dataclasses.replace (a decode step's host time counts)."""
        return Request(self.q, self.k, self.v, self.mask, self.score, seq, self.cache, self.deterministic,
                       self.check_seqlens)


def resolve_softmax_scale(softmax_scale: float | None, headdim: int) -> float:
    """The scale applied to QK^T: softmax_scale, or 1/sqrt(headdim) when None."""
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _score(q, softmax_scale, softcap, learnable_sink) -> ScoreSpec:
    return ScoreSpec(resolve_softmax_scale(softmax_scale, q.shape[-1]), float(softcap), learnable_sink)
