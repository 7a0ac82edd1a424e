"""Nothing past a sequence's end reaches a gradient (issue 25, item 1, backward; marker gpu, skipped
without CUDA).

Everything outside the valid region -- rows of q / k / v / dout past seqused_q / seqused_k, the
rows past cu_seqlens[-1], the queries of a sequence without keys and the keys of a sequence
without queries (their gradients are 0 by definition), storage past a dense view's extent -- is
filled with a poison (NaN, +inf, -inf, then 6e4 and 1e30, huge bf16-finite values), and the same
forward + backward (autograd through flash_attn_varlen_func / flash_attn_func) is made on clean
memory (those elements 0). Before each run the caching allocator's free memory is filled with the
same value (gpu_helpers.poison_allocator): flash4's own torch.empty buffers start poisoned too. Inside the valid region out, dq, dk, dv must be bitwise equal (torch.equal);
outside it dq, dk, dv must be exactly 0 in both runs.

What makes it hold (kernels/sm90/bwd_step.py, docs/design/bwd_tail.md): the backward zeroes the K
and V rows >= seqlen_k of a CTA's key tile (once) and the Q and dO rows >= seqlen_q of the
query-edge step's stages in shared memory, so every GEMM operand equals the clean run's, bit for
bit; the host keeps dK / dV rows outside every sequence at 0 and gathers dq there from a zeroed
scratch tile.

Bitwise equality between two calls needs reproducible reductions: the dQ adds of different key
blocks (and the fp32 dK / dV adds of a GQA head split) are unordered unless deterministic=True,
and fp32 addition is commutative but not associative, so the non-deterministic cases keep at most
two key blocks per sequence (0 + a + b == 0 + b + a) and a head split of two CTAs per key tile;
the deterministic case has long sequences.
"""

import math

import pytest
import torch

from flash4 import flash_attn_func, flash_attn_varlen_func
from flash4.config import select_bwd_config
from gpu_helpers import poison_allocator

DEV = "cuda"
BF16, I32 = torch.bfloat16, torch.int32
POISONS = (math.nan, math.inf, -math.inf, 6e4, 1e30)
CLEAN = 0.0


def _randn(shape, gen):
    return torch.randn(shape, generator=gen, device=DEV, dtype=BF16)


def _fill(base, valid, value):
    """base where `valid` (a bool mask over base's leading dims), `value` elsewhere (a new tensor)."""
    mask = valid.reshape(valid.shape + (1,) * (base.dim() - valid.dim()))
    return torch.where(mask, base, torch.full((), value, dtype=base.dtype, device=base.device))


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _valid_rows(cu, used, other_used, total):
    """(total,) bool: the first used[b] rows of each sequence b whose other side has some row
    (a query without keys or a key without queries gets no gradient: it counts as outside)."""
    rows = torch.zeros(total, dtype=torch.bool)
    for b, (n, m) in enumerate(zip(used, other_used)):
        if m > 0:
            rows[cu[b]: cu[b] + n] = True
    return rows.to(DEV)


def _assert_grads(clean, poisoned, valid, poison, what):
    """clean / poisoned: (out, dq, dk, dv); valid: (valid_q, valid_q, valid_k, valid_k) row masks."""
    for name, c, p, rows in zip(("out", "dq", "dk", "dv"), clean, poisoned, valid):
        tag = f"{what}, poison {poison}: {name}"
        assert not c[rows].isnan().any(), f"{tag}: NaN on clean memory"
        assert not p[rows].isnan().any(), f"{tag}: {int(p[rows].isnan().sum())} NaN inside the sequences"
        assert torch.equal(p[rows], c[rows]), f"{tag}: differs at {int((p[rows] != c[rows]).sum())} elements"
        if name != "out":
            outside = ~rows
            assert (c[outside] == 0).all(), f"{tag}: nonzero outside the sequences on clean memory"
            assert (p[outside] == 0).all(), (
                f"{tag}: {int((p[outside] != 0).sum())} nonzero / NaN elements outside the sequences")


def _check_poisons(run, valid, what):
    """run(value) -> (out, dq, dk, dv) with everything outside the valid region filled with value."""
    poison_allocator(CLEAN)
    clean = run(CLEAN)
    for poison in POISONS:
        poison_allocator(poison)
        _assert_grads(clean, run(poison), valid, poison, what)
    torch.cuda.synchronize()


def _key_lengths(n):
    """Stored key counts (at most 2 n: two key blocks of n keys) and the seqused_k below them."""
    return [n + 37, 50, n, 77, 2 * n - 5, 64, 0], [n + 3, 0, n - 1, 1, 2 * n - 5, 13, 0]


# id, head dim, Dv, causal, window, heads, kv heads, seqused, heads per CTA (None: the whole group)
VARLEN = [
    ("d64-seqused", 64, 64, False, None, 4, 2, True, None),
    ("d96-causal-seqused", 96, 96, True, None, 4, 2, True, None),
    ("d128-causal-neighbours", 128, 128, True, None, 4, 4, False, None),
    ("d192-causal-seqused", 192, 192, True, None, 4, 2, True, None),
    ("d256-seqused", 256, 256, False, None, 2, 1, True, None),
    ("d192v128-causal-seqused", 192, 128, True, None, 4, 2, True, None),
    ("d128-causal-gqa-split", 128, 128, True, None, 4, 2, True, 1),
    ("d128-window", 128, 128, False, (48, 16), 4, 2, True, None),
]


@pytest.mark.parametrize("case", VARLEN, ids=[c[0] for c in VARLEN])
def test_varlen_backward(case, monkeypatch):
    """Packed q / k / v / dout with seqused below the stored lengths (or, 'neighbours', without
    seqused: the sequences without queries / keys are poison), rows past cu_seqlens[-1] poison;
    non-deterministic kernels, at most two key blocks per sequence. gqa-split: two CTAs per key
    tile (BwdConfig.dkv_accum), each adding its fp32 dK, dV."""
    what, d, dv, causal, window, h, hk, seqused, heads_per_cta = case
    monkeypatch.setenv("FLASH4_BWD_HEADS_PER_CTA", str(heads_per_cta or h // hk))
    tile_n = select_bwd_config(d, "bf16", causal, headdim_v=None if dv == d else dv).tile_n
    len_k, used_k = _key_lengths(tile_n)
    # sequence 1: keys, no query; 6: queries, no key (both poison); 5's query tile ends in 6's rows
    len_q, used_q = [37, 0, 129, 1, 200, 50, 30], [30, 0, 100, 1, 200, 13, 30]
    if not seqused:
        used_q, used_k = len_q, len_k
    _run_varlen(what, d, dv, causal, window, h, hk, len_q, len_k, used_q if seqused else None,
                used_k if seqused else None, pad_q=7, pad_k=40, deterministic=False)


def test_varlen_backward_deterministic_long():
    """deterministic=True (the dQ adds in key-block order): sequences of up to 700 keys and queries,
    GQA 8:2, causal, seqused."""
    len_q, used_q = [700, 0, 129, 1, 333, 64], [650, 0, 129, 1, 300, 63]
    len_k, used_k = [640, 50, 300, 77, 513, 0], [601, 0, 257, 1, 513, 0]
    _run_varlen("d128-causal-deterministic", 128, 128, True, None, 8, 2, len_q, len_k, used_q, used_k,
                pad_q=5, pad_k=11, deterministic=True)


def _run_varlen(what, d, dv, causal, window, h, hk, len_q, len_k, used_q, used_k, pad_q, pad_k, deterministic):
    gen = torch.Generator(device=DEV).manual_seed(d + dv + h)
    eff_q, eff_k = used_q or len_q, used_k or len_k
    cu_q, cu_k = _cu(len_q), _cu(len_k)
    total_q, total_k = cu_q[-1] + pad_q, cu_k[-1] + pad_k
    q, k, v = _randn((total_q, h, d), gen), _randn((total_k, hk, d), gen), _randn((total_k, hk, dv), gen)
    dout = _randn((total_q, h, dv), gen)
    valid_q = _valid_rows(cu_q, eff_q, eff_k, total_q)
    valid_k = _valid_rows(cu_k, eff_k, eff_q, total_k)
    cu_q_t, cu_k_t = (torch.tensor(c, dtype=I32, device=DEV) for c in (cu_q, cu_k))
    seq_kw = {name: torch.tensor(u, dtype=I32, device=DEV)
              for name, u in (("seqused_q", used_q), ("seqused_k", used_k)) if u is not None}
    window_size = (-1, -1) if window is None else window

    def run(value):
        leaves = [_fill(t, rows, value).requires_grad_() for t, rows in ((q, valid_q), (k, valid_k), (v, valid_k))]
        out = flash_attn_varlen_func(*leaves, cu_q_t, cu_k_t, max(eff_q), max(eff_k), causal=causal,
                                     window_size=window_size, deterministic=deterministic, **seq_kw)
        out.backward(_fill(dout, valid_q, value))
        return (out.detach(), *(t.grad for t in leaves))

    _check_poisons(run, (valid_q, valid_q, valid_k, valid_k), f"varlen {what}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_views_of_poisoned_storage(causal):
    """q, k, v, dout as sequence-sliced views of larger tensors whose rows past the views are
    poison (partial query and key tiles, two key blocks): the TMA clips at the views' extent."""
    b, sq, sk, h, hk, d, room = 2, 133, 201, 4, 2, 128, 64
    gen = torch.Generator(device=DEV).manual_seed(11)
    q, k, v = _randn((b, sq + room, h, d), gen), _randn((b, sk + room, hk, d), gen), _randn((b, sk + room, hk, d), gen)
    dout = _randn((b, sq + room, h, d), gen)
    valid_q = torch.arange(sq + room, device=DEV).expand(b, -1) < sq
    valid_k = torch.arange(sk + room, device=DEV).expand(b, -1) < sk

    def run(value):
        qs, ks, vs = _fill(q, valid_q, value), _fill(k, valid_k, value), _fill(v, valid_k, value)
        leaves = [t[:, :n].requires_grad_() for t, n in ((qs, sq), (ks, sk), (vs, sk))]
        out = flash_attn_func(*leaves, causal=causal)
        out.backward(_fill(dout, valid_q, value)[:, :sq])
        return (out.detach(), *(t.grad for t in leaves))

    rows_q, rows_k = torch.ones(b, sq, dtype=torch.bool, device=DEV), torch.ones(b, sk, dtype=torch.bool, device=DEV)
    _check_poisons(run, (rows_q, rows_q, rows_k, rows_k), "dense views")
