"""Nothing past a sequence's end reaches a forward result (issue 25, item 1; marker gpu, skipped
without CUDA).

Every element of K/V (and Q where the path has rows outside every sequence) that lies outside the
valid region -- key slots past seqused_k / cache_seqlens, the rows of neighbouring packed
sequences, rows past cu_seqlens[-1], the unused slots of a sequence's last page, unused pages and
cache rows, storage past a dense view's extent -- is filled with a poison (NaN, +inf, -inf, then
6e4 and 1e30, huge bf16-finite values), and the same call is made on clean memory (those elements
0). The caching allocator's free memory is filled with the same value before each call
(gpu_helpers.poison_allocator), so flash4's own torch.empty buffers (split-KV partials, packed
outputs) start poisoned as well.
out and lse of every query row inside a sequence must be bitwise equal (torch.equal) and free of
NaN. The forward zeroes the V rows past seqlen_k of the key-edge block (P = 0 alone would give
0 * NaN = NaN in P V) and masks the scores of those keys to -inf before the row max; query rows
past a sequence are never stored.

Paths: varlen with seqused_k (head dims 64, 128, 256 and the (192, 128) pair), packed varlen
whose neighbouring sequences and tail rows are poison, paged K/V through flash_attn_varlen_func
(page sizes 16, 64, 128, 256; d256's 80-key blocks of 16-row pieces), flash_attn_with_kvcache on a
dense cache (num_splits 1, auto and 4, GQA-packed decode, a speculative causal step, every head
dim), on a paged cache with an append across 16-key page boundaries, and with cache_batch_idx,
and flash_attn_func on views into larger poisoned storage; more splits than key blocks (empty
splits: partials O = 0, LSE = -inf, weight 0 in the combine); query rows past seqused_q in the
warps of valid rows (1e30 there scores above 2^20 / scale_log2: OnlineSoftmax's exact-path vote
must leave them out, or the valid rows of the warp change bits).
"""

import math

import pytest
import torch

from flash4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
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
    return torch.tensor(out, dtype=I32, device=DEV)


def _row_mask(cu, total):
    """(total,) bool: rows inside some sequence of the cumulative lengths cu."""
    rows = torch.zeros(total, dtype=torch.bool, device=DEV)
    c = cu.tolist()
    for a, b in zip(c[:-1], c[1:]):
        rows[a:b] = True
    return rows


def _assert_same(clean, poisoned, poison, what):
    (out_c, lse_c), (out_p, lse_p) = clean, poisoned
    assert not out_c.isnan().any() and not lse_c.isnan().any(), f"{what}: NaN on clean memory"
    assert not out_p.isnan().any(), f"{what}, poison {poison}: out has {int(out_p.isnan().sum())} NaN"
    assert not lse_p.isnan().any(), f"{what}, poison {poison}: lse has {int(lse_p.isnan().sum())} NaN"
    assert torch.equal(out_p, out_c), (
        f"{what}, poison {poison}: out differs at {int((out_p != out_c).sum())} elements")
    assert torch.equal(lse_p, lse_c), (
        f"{what}, poison {poison}: lse differs at {int((lse_p != lse_c).sum())} elements")


def _check_poisons(run, what):
    """run(value) -> (out, lse) of the valid rows with everything outside filled with value."""
    poison_allocator(CLEAN)
    clean = run(CLEAN)
    for poison in POISONS:
        poison_allocator(poison)
        _assert_same(clean, run(poison), poison, what)
    torch.cuda.synchronize()


# ================================================================ flash_attn_varlen_func
@pytest.mark.parametrize("d, dv, causal", [(64, 64, False), (128, 128, True), (256, 256, False), (192, 128, True)],
                         ids=["d64", "d128-causal", "d256", "d192v128-causal"])
def test_varlen_seqused_k(d, dv, causal):
    """Packed K/V with seqused_k below the stored lengths: the stored keys past seqused_k (the
    slots between sequences), the rows past cu_seqlens_k[-1] and the query rows past
    cu_seqlens_q[-1] are poison."""
    len_q, len_k, used_k = [37, 0, 129, 1, 200, 64], [300, 50, 129, 77, 513, 64], [173, 0, 128, 1, 450, 13]
    pad_q, pad_k, h, hk = 7, 40, 4, 2
    gen = torch.Generator(device=DEV).manual_seed(d + dv)
    cu_q, cu_k = _cu(len_q), _cu(len_k)
    total_q, total_k = sum(len_q) + pad_q, sum(len_k) + pad_k
    q, k, v = _randn((total_q, h, d), gen), _randn((total_k, hk, d), gen), _randn((total_k, hk, dv), gen)
    seqused_k = torch.tensor(used_k, dtype=I32, device=DEV)
    valid_k = torch.zeros(total_k, dtype=torch.bool, device=DEV)
    for b, n in enumerate(used_k):
        valid_k[cu_k[b]: cu_k[b] + n] = True
    rows = _row_mask(cu_q, total_q)

    def run(value):
        out, lse = flash_attn_varlen_func(_fill(q, rows, value), _fill(k, valid_k, value), _fill(v, valid_k, value),
                                          cu_q, cu_k, max(len_q), seqused_k=seqused_k, causal=causal,
                                          return_lse=True)
        return out[rows], lse[:, rows]

    _check_poisons(run, f"varlen seqused_k d{d}/{dv}")


@pytest.mark.parametrize("d, causal", [(64, False), (96, True), (128, True), (192, False), (256, False)],
                         ids=["d64", "d96-causal", "d128-causal", "d192", "d256"])
def test_varlen_seqused_q_rows_in_valid_warps(d, causal):
    """Packed Q with seqused_q: the query rows past seqused_q (and past cu_seqlens_q[-1]) share
    16-row warps with valid rows (lengths not multiples of 16). With 1e30 there the poisoned rows'
    scores are far above 2^20 / scale_log2; left in OnlineSoftmax's warp-wide exact-path vote they
    would move the valid rows of the warp to the exact path (other bits)."""
    len_q, used_q, len_k, h, hk, pad_q = [40, 77, 19, 130], [29, 70, 0, 121], [90, 300, 5, 257], 4, 2, 9
    gen = torch.Generator(device=DEV).manual_seed(100 + d)
    cu_q, cu_k = _cu(len_q), _cu(len_k)
    total_q, total_k = sum(len_q) + pad_q, sum(len_k)
    q, k, v = _randn((total_q, h, d), gen), _randn((total_k, hk, d), gen), _randn((total_k, hk, d), gen)
    seqused_q = torch.tensor(used_q, dtype=I32, device=DEV)
    rows = torch.zeros(total_q, dtype=torch.bool, device=DEV)
    for b, n in enumerate(used_q):
        rows[cu_q[b]: cu_q[b] + n] = True

    def run(value):
        out, lse = flash_attn_varlen_func(_fill(q, rows, value), k, v, cu_q, cu_k, max(used_q), max(len_k),
                                          seqused_q=seqused_q, causal=causal, return_lse=True)
        return out[rows], lse[:, rows]

    _check_poisons(run, f"varlen seqused_q d{d}")


def test_varlen_packed_neighbours():
    """Packed K/V without seqused: sequences 1 and 3 have keys but no query, and their keys (the
    rows right after sequences 0 and 2's partial last key blocks) and the rows past
    cu_seqlens_k[-1] are poison; the other sequences' results must not change."""
    len_q, len_k, pad_k, h, hk, d = [100, 0, 77, 0], [200, 45, 131, 60], 30, 8, 2, 128
    gen = torch.Generator(device=DEV).manual_seed(3)
    cu_q, cu_k = _cu(len_q), _cu(len_k)
    total_q, total_k = sum(len_q), sum(len_k) + pad_k
    q, k, v = _randn((total_q, h, d), gen), _randn((total_k, hk, d), gen), _randn((total_k, hk, d), gen)
    valid_k = torch.zeros(total_k, dtype=torch.bool, device=DEV)
    for b in (0, 2):
        valid_k[cu_k[b]: cu_k[b + 1]] = True

    def run(value):
        return flash_attn_varlen_func(q, _fill(k, valid_k, value), _fill(v, valid_k, value), cu_q, cu_k,
                                      max(len_q), return_lse=True)

    _check_poisons(run, "varlen packed neighbours")


def _paged_layout(used, page_size, gen_cpu, max_pages=None, spare_pages=3):
    """(page_table (batch, max_pages) int32, num_pages, valid slot mask (num_pages, page_size)):
    every table column of every sequence on its own page (randomly permuted), the slots of its
    first used[b] keys valid; the rest of the pages, the columns past its keys and spare_pages
    pages no table names are all outside the valid region."""
    max_pages = max(-(-n // page_size) for n in used) + 1 if max_pages is None else max_pages
    num_pages = len(used) * max_pages + spare_pages
    table = torch.randperm(num_pages, generator=gen_cpu)[: len(used) * max_pages].view(len(used), max_pages)
    valid = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for b, n in enumerate(used):
        for col in range(-(-n // page_size)):
            valid[table[b, col], : min(page_size, n - col * page_size)] = True
    return table.to(dtype=I32, device=DEV), num_pages, valid.to(DEV)


@pytest.mark.parametrize("page_size, d", [(16, 128), (64, 128), (128, 128), (256, 128), (64, 256)],
                         ids=["p16", "p64", "p128", "p256", "p64-d256"])
def test_paged_varlen(page_size, d):
    """Paged K/V (flash_attn_varlen_func with page_table): every slot but the sequences' keys --
    the tail of each last page, the spare pages the unused table columns point at -- is poison."""
    len_q, used, h, hk = [3, 1, 64, 0, 17], [1000, 1, 129, 40, 517], 8, 2
    gen = torch.Generator(device=DEV).manual_seed(page_size + d)
    table, num_pages, valid = _paged_layout(used, page_size, torch.Generator().manual_seed(page_size))
    cu_q = _cu(len_q)
    q = _randn((sum(len_q), h, d), gen)
    k, v = _randn((num_pages, page_size, hk, d), gen), _randn((num_pages, page_size, hk, d), gen)
    seqused_k = torch.tensor(used, dtype=I32, device=DEV)

    def run(value):
        return flash_attn_varlen_func(q, _fill(k, valid, value), _fill(v, valid, value), cu_q, None, max(len_q),
                                      seqused_k=seqused_k, page_table=table, return_lse=True)

    _check_poisons(run, f"paged varlen page {page_size} d{d}")


# ================================================================ flash_attn_with_kvcache
def _kvcache_run(q, k_cache, v_cache, valid, kn, vn, cache_seqlens, page_table=None, cache_batch_idx=None,
                 causal=True, num_splits=0):
    """run(value) for _check_poisons: fresh caches (the append writes into them) with every slot
    outside `valid` (a mask over the cache's first two dims) set to value."""

    def run(value):
        kc, vc = _fill(k_cache, valid, value), _fill(v_cache, valid, value)
        return flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens, page_table, cache_batch_idx=cache_batch_idx,
                                       causal=causal, num_splits=num_splits, return_lse=True)

    return run


KVCACHE_CASES = [  # d, dv, num_splits, seqlen_q, seqlen_new, causal
    (128, 128, 1, 1, 1, True),
    (128, 128, 0, 1, 1, True),
    (128, 128, 4, 1, 1, True),
    (128, 128, 0, 4, 4, True),  # speculative causal step: not GQA-packed
    (128, 128, 16, 1, 1, True),  # more splits than key blocks: empty splits in the combine
    (64, 64, 4, 1, 0, True),
    (256, 256, 4, 1, 1, False),
    (192, 128, 4, 1, 1, True),
]


@pytest.mark.parametrize("d, dv, num_splits, sq, s_new, causal", KVCACHE_CASES,
                         ids=["d128-split1", "d128-auto", "d128-split4", "d128-spec4", "d128-split16", "d64-split4-noappend",
                              "d256-split4", "d192v128-split4"])
def test_kvcache_dense(d, dv, num_splits, sq, s_new, causal):
    """Dense cache (batch, 2048, Hk, D), 8 query / 2 KV heads (decode steps GQA-packed): the slots
    past cache_seqlens are poison (the append overwrites its own). Lengths 0 (no key: split
    partials of LSE -inf, the combine), 129 (a 1-key edge block) and 1900 (a split's first block
    is the partial edge)."""
    b, h, hk, s_cache = 3, 8, 2, 2048
    gen = torch.Generator(device=DEV).manual_seed(d + dv + num_splits + sq)
    q = _randn((b, sq, h, d), gen)
    k_cache, v_cache = _randn((b, s_cache, hk, d), gen), _randn((b, s_cache, hk, dv), gen)
    kn, vn = (_randn((b, s_new, hk, d), gen), _randn((b, s_new, hk, dv), gen)) if s_new else (None, None)
    seqlens = [0 if s_new == 0 else 1, 129 - s_new, 1900 - s_new]
    cache_seqlens = torch.tensor(seqlens, dtype=I32, device=DEV)
    valid = torch.arange(s_cache, device=DEV)[None, :] < cache_seqlens[:, None]
    run = _kvcache_run(q, k_cache, v_cache, valid, kn, vn, cache_seqlens, causal=causal, num_splits=num_splits)
    _check_poisons(run, f"kvcache dense d{d}/{dv} splits {num_splits} sq {sq}")


@pytest.mark.parametrize("page_size, num_splits", [(16, 1), (16, 0), (64, 3)], ids=["p16-split1", "p16-auto",
                                                                                    "p64-split3"])
def test_kvcache_paged_append_across_pages(page_size, num_splits):
    """Paged cache whose every slot outside the sequences' keys is poison, and an append of 5 keys
    that crosses a page boundary (16-key pages: 14 -> 19, 30 -> 35, 1003 -> 1008)."""
    b, h, hk, d, s_new = 4, 8, 2, 128, 5
    seqlens = [14, 30, 0, 1003]
    gen = torch.Generator(device=DEV).manual_seed(page_size + num_splits)
    capacity = 1152
    table, num_pages, valid = _paged_layout(seqlens, page_size, torch.Generator().manual_seed(page_size),
                                            max_pages=capacity // page_size)
    q = _randn((b, 1, h, d), gen)
    k_cache, v_cache = _randn((num_pages, page_size, hk, d), gen), _randn((num_pages, page_size, hk, d), gen)
    kn, vn = _randn((b, s_new, hk, d), gen), _randn((b, s_new, hk, d), gen)
    cache_seqlens = torch.tensor(seqlens, dtype=I32, device=DEV)
    run = _kvcache_run(q, k_cache, v_cache, valid, kn, vn, cache_seqlens, page_table=table, num_splits=num_splits)
    _check_poisons(run, f"kvcache paged page {page_size} splits {num_splits}")


def test_kvcache_cache_batch_idx():
    """cache_batch_idx into a 5-row dense cache: rows 1 and 3 (no sequence's) and the slots past
    cache_seqlens of the used rows are poison; a 2-key append, 2 causal queries."""
    b, h, hk, d, s_cache, s_new = 3, 4, 1, 64, 600, 2
    gen = torch.Generator(device=DEV).manual_seed(5)
    idx = torch.tensor([4, 0, 2], dtype=I32, device=DEV)
    seqlens = torch.tensor([100, 0, 511], dtype=I32, device=DEV)
    q = _randn((b, 2, h, d), gen)
    k_cache, v_cache = _randn((5, s_cache, hk, d), gen), _randn((5, s_cache, hk, d), gen)
    kn, vn = _randn((b, s_new, hk, d), gen), _randn((b, s_new, hk, d), gen)
    row_len = torch.zeros(5, dtype=I32, device=DEV)
    row_len[idx.long()] = seqlens
    valid = torch.arange(s_cache, device=DEV)[None, :] < row_len[:, None]
    run = _kvcache_run(q, k_cache, v_cache, valid, kn, vn, seqlens, cache_batch_idx=idx, num_splits=1)
    _check_poisons(run, "kvcache cache_batch_idx")


# ================================================================ flash_attn_func (dense tails)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_views_of_poisoned_storage(causal):
    """q, k, v as sequence-sliced views of larger tensors whose rows past the views are poison: the
    TMA clips at the views' extent (seqlen_q 133, seqlen_k 333: partial query and key tiles)."""
    b, sq, sk, h, hk, d, room = 2, 133, 333, 4, 2, 128, 64
    gen = torch.Generator(device=DEV).manual_seed(7)
    q, k, v = _randn((b, sq + room, h, d), gen), _randn((b, sk + room, hk, d), gen), _randn((b, sk + room, hk, d), gen)
    valid_q = torch.arange(sq + room, device=DEV).expand(b, -1) < sq
    valid_k = torch.arange(sk + room, device=DEV).expand(b, -1) < sk

    def run(value):
        qv, kv, vv = _fill(q, valid_q, value), _fill(k, valid_k, value), _fill(v, valid_k, value)
        return flash_attn_func(qv[:, :sq], kv[:, :sk], vv[:, :sk], causal=causal, return_lse=True)

    _check_poisons(run, "dense views")
