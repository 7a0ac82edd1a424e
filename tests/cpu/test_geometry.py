"""The geometry twin (flash4.geometry on Python ints: the very functions the kernels trace on Int32)
against a brute-force walk of the mask, for every tile shape the kernels use, causal and not,
seqlen_q vs seqlen_k both ways, and sequences placed dense, packed (varlen) and with seqused.

flash4.geometry is pure Python (no CuTe DSL needed).
"""

import itertools
import random

import pytest

from flash4 import geometry as geo

# (tile_m, tile_n) of the shipped kernels: forward 192x128 (d64), 128x128, 128x112, 128x80;
# backward queries x keys 64x128, 128x128, 64x64, 64x96 (transposed_dkv); plus odd ones.
TILES = [(192, 128), (128, 128), (128, 112), (128, 80), (64, 128), (64, 64), (64, 96), (16, 48)]
SEQLENS = [(1, 1), (1, 100), (100, 1), (17, 300), (300, 17), (128, 128), (129, 257), (257, 129), (1000, 777),
           (777, 1000), (0, 5), (5, 0)]


def brute_mask(sq, sk, causal):
    """visible[i][j] from the rule as stated (bottom-right causal), not from geometry's helpers."""
    return [[j < sk and (not causal or j <= i + sk - sq) for j in range(sk)] for i in range(sq)]


def block_has(mask, rows, cols):
    return any(mask[i][j] for i in rows for j in cols)


def block_full(mask, rows, cols):
    return all(mask[i][j] for i in rows for j in cols)


@pytest.mark.parametrize("sq, sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_rule_matches_brute_force(sq, sk, causal):
    mask = brute_mask(sq, sk, causal)
    for i in range(sq):
        for j in range(sk + 3):  # keys past seqlen_k too
            want = j < sk and mask[i][j]
            assert geo.visible(i, j, sq, sk, causal) == want
            assert (j < geo.key_limit(i, sq, sk, causal)) == want
            # the transpose, as the backward uses it: column i of key row j
            assert (i >= geo.first_query(j, sq, sk, causal)) == want


@pytest.mark.parametrize("tile_m, tile_n", TILES)
@pytest.mark.parametrize("sq, sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_block_ranges(tile_m, tile_n, sq, sk, causal):
    """Query tile m visits exactly the key blocks [0, n_block_max) that hold a visible key (the last
    one included), and the blocks below the mask bounds are fully visible to every row."""
    mask = brute_mask(sq, sk, causal)
    n_blocks = -(-sk // tile_n)
    for m in range(-(-sq // tile_m)):
        rows = range(m * tile_m, min((m + 1) * tile_m, sq))
        n_max = geo.n_block_max(m, sq, sk, tile_m, tile_n, causal)
        visited = [n for n in range(n_blocks) if block_has(mask, rows, range(n * tile_n, min((n + 1) * tile_n, sk)))]
        assert n_max == (visited[-1] + 1 if visited else 0), (m, visited)
        assert visited == list(range(n_max))  # no hole: every block below n_max is visited
        unmasked_end = geo.n_block_seqlen_mask(sk, tile_n)
        if causal:
            unmasked_end = min(unmasked_end, geo.n_block_min_causal_mask(m, sq, sk, tile_m, tile_n))
        for n in range(min(unmasked_end, n_max)):
            cols = range(n * tile_n, (n + 1) * tile_n)  # the whole tile, keys past seqlen_k included
            assert block_full(mask, rows, [j for j in cols if j < sk]) and max(cols) < sk, (m, n)


@pytest.mark.parametrize("tile_m, tile_n", TILES)
@pytest.mark.parametrize("sq, sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_block_ranges(tile_m, tile_n, sq, sk, causal):
    """Key tile n visits exactly the query blocks [m_min, m_max) that see one of its keys, and the
    blocks at or past m_block_mask_end see every key of the whole tile (no key past seqlen_k)."""
    mask = brute_mask(sq, sk, causal)
    m_blocks = -(-sq // tile_m)
    for n in range(-(-sk // tile_n)):
        keys = range(n * tile_n, (n + 1) * tile_n)
        m_min, m_max = geo.m_block_range(n, sq, sk, tile_m, tile_n, causal)
        seen = [m for m in range(m_blocks)
                if block_has(mask, range(m * tile_m, min((m + 1) * tile_m, sq)), [j for j in keys if j < sk])]
        if seen:
            assert seen == list(range(seen[0], seen[-1] + 1))
            assert m_min <= seen[0] and seen[-1] < m_max, (n, seen, m_min, m_max)
            # m_min is tight (causal skips only blocks that see nothing); m_max is the last query block
            assert m_min == seen[0] and m_max == m_blocks
        end = geo.m_block_mask_end(n, sq, sk, tile_m, tile_n, causal)
        assert m_min <= end <= m_max
        for m in range(end, m_max):
            rows = range(m * tile_m, min((m + 1) * tile_m, sq))
            assert max(keys) < sk and block_full(mask, rows, keys), (n, m)


def test_division_operands_never_negative():
    """Every floor division in geometry sees a non-negative numerator, so the device's truncating
    division gives the same result: probe the formulas with an Ops that records min/max inputs."""
    seen = []

    def rec_max(a, b):
        seen.append(max(a, b))
        return max(a, b)

    ops = geo.Ops(min=min, max=rec_max, select=lambda c, a, b: a if c else b)
    for (tm, tn), (sq, sk), causal in itertools.product(TILES, SEQLENS, (False, True)):
        for m in range(-(-max(sq, 1) // tm)):
            geo.n_block_max(m, sq, sk, tm, tn, causal, ops)
            geo.n_block_min_causal_mask(m, sq, sk, tm, tn, ops)
        for n in range(-(-max(sk, 1) // tn)):
            geo.m_block_mask_end(n, sq, sk, tm, tn, causal, ops)
    assert seen and min(seen) >= 0


def _random_layout(rng, batch):
    lens_q = [rng.choice([0, 1, rng.randint(1, 300)]) for _ in range(batch)]
    lens_k = [rng.choice([0, 1, rng.randint(1, 300)]) for _ in range(batch)]
    cu_q = list(itertools.accumulate([0] + lens_q))
    cu_k = list(itertools.accumulate([0] + lens_k))
    return lens_q, lens_k, cu_q, cu_k


@pytest.mark.parametrize("seed", range(5))
def test_seqlens_layouts(seed):
    """Dense, varlen (cu_seqlens) and seqused place every sequence where the packed tensors hold
    it, with the lengths the mask walk uses; sequences of length 0 anywhere are fine."""
    rng = random.Random(seed)
    batch = rng.randint(1, 8)
    lens_q, lens_k, cu_q, cu_k = _random_layout(rng, batch)
    varlen = geo.SeqLens(batch, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    # packed "tensors": element = (batch, position) so a wrong offset is visible
    packed_q = [(b, i) for b in range(batch) for i in range(lens_q[b])]
    packed_k = [(b, j) for b in range(batch) for j in range(lens_k[b])]
    for b in range(batch):
        assert varlen.len_q(b) == lens_q[b] and varlen.len_k(b) == lens_k[b]
        assert packed_q[varlen.offset_q(b):varlen.offset_q(b) + varlen.len_q(b)] == [(b, i) for i in range(lens_q[b])]
        assert packed_k[varlen.offset_k(b):varlen.offset_k(b) + varlen.len_k(b)] == [(b, j) for j in range(lens_k[b])]
    used_k = [rng.randint(0, n) for n in lens_k]
    seqused = geo.SeqLens(batch, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k)
    for b in range(batch):
        assert seqused.offset_k(b) == cu_k[b] and seqused.len_k(b) == used_k[b]
    dense = geo.SeqLens(batch, seqlen_q=7, seqlen_k=9)
    assert [(dense.offset_q(b), dense.len_q(b), dense.offset_k(b), dense.len_k(b)) for b in range(batch)] == [
        (7 * b, 7, 9 * b, 9) for b in range(batch)]


@pytest.mark.parametrize("page_size,tile_n", [(16, 128), (64, 128), (128, 128), (256, 128), (64, 80), (256, 112)])
def test_paged_layout_and_pieces(page_size, tile_n):
    """Paged K: every key of every sequence is found through the page table, and the forward's
    page pieces (gcd(page_size, tile_n) rows each) cover each key block exactly, never crossing a page."""
    import math

    from flash4.config import paged_page_rows

    rng = random.Random(page_size + tile_n)
    batch = 4
    lens = [rng.randint(0, 700) for _ in range(batch)]
    pages = [-(-n // page_size) for n in lens]
    perm = list(range(sum(pages)))
    rng.shuffle(perm)
    table, it = [], iter(perm)
    for n in pages:
        table.append([next(it) for _ in range(n)] + [0] * (max(pages) - n))
    layout = geo.SeqLens(batch, cu_seqlens_q=[0] * (batch + 1), seqused_k=lens, page_table=table, page_size=page_size)
    storage = {}
    for b in range(batch):
        for j in range(lens[b]):
            storage[table[b][j // page_size], j % page_size] = (b, j)
    for b in range(batch):
        assert [storage[layout.key_location(b, j)] for j in range(lens[b])] == [(b, j) for j in range(lens[b])]
    rows = paged_page_rows(page_size, tile_n)
    assert rows == math.gcd(page_size, tile_n) and rows % 8 == 0
    for n_block in range(6):
        keys = []
        for key0, col, row_block in geo.paged_pieces(n_block, tile_n, rows, page_size):
            first = col * page_size + row_block * rows
            assert first == key0 and row_block * rows + rows <= page_size  # inside one page
            keys += list(range(first, first + rows))
        assert keys == list(range(n_block * tile_n, (n_block + 1) * tile_n))


def test_padded_offsets_are_tile_aligned_and_disjoint():
    from flash4.backward import padded_total

    rng = random.Random(7)
    for _ in range(50):
        batch = rng.randint(1, 9)
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 500)]) for _ in range(batch)]
        cu = list(itertools.accumulate([0] + lens))
        layout = geo.SeqLens(batch, cu_seqlens_q=cu, cu_seqlens_k=cu)
        for tile in (64, 128):
            offs = [layout.padded_offset_q(b, tile) for b in range(batch)]
            assert all(o % tile == 0 for o in offs)
            ends = [o + -(-n // tile) * tile for o, n in zip(offs, lens)]
            assert all(ends[b] <= offs[b + 1] for b in range(batch - 1))
            assert max(ends) <= padded_total(cu[-1], batch, tile)


# ---------------------------------------------------------------- sliding windows (issue 10)
WINDOWS = [(0, 0), (3, 0), (0, 5), (17, 9), (100, -1), (-1, 31), (1000, 1000), (64, 64), (129, 0)]
WIN_TILES = [(128, 128), (128, 80), (64, 128), (64, 96), (16, 48)]
WIN_SEQLENS = [(1, 1), (1, 100), (100, 1), (17, 300), (300, 17), (129, 257), (257, 129), (600, 555), (0, 5), (5, 0)]


def brute_window(sq, sk, left, right):
    """visible[i][j] from flash-attn's window rule as stated: i + sk - sq - left <= j <= i + sk - sq + right,
    -1 = unbounded on that side alone."""
    off = sk - sq
    return [[(left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right) for j in range(sk)]
            for i in range(sq)]


def test_window_sides():
    U = geo.UNBOUNDED
    assert geo.window_sides(None, False) is None and geo.window_sides((-1, -1), False) is None
    assert geo.window_sides((-1, 0), False) == (U, 0)  # -1 is per side: (-1, 0) is a causal window
    assert geo.window_sides((-1, -1), True) is None  # plain causal
    assert geo.window_sides((-1, 5), True) is None  # causal sets right = 0
    assert geo.window_sides((4, -1), False) == (4, U)
    assert geo.window_sides((4, 7), True) == (4, 0)


@pytest.mark.parametrize("sq, sk", WIN_SEQLENS)
@pytest.mark.parametrize("left, right", WINDOWS)
def test_window_rule_matches_brute_force(sq, sk, left, right):
    window = geo.window_sides((left, right), False)
    mask = brute_window(sq, sk, left, right)
    for i in range(sq):
        for j in range(sk + 3):
            want = j < sk and mask[i][j]
            assert geo.visible(i, j, sq, sk, False, window=window) == want
            in_rows = geo.key_start(i, sq, sk, window=window) <= j < geo.key_limit(i, sq, sk, False, window=window)
            assert in_rows == want
            # the transposes, as the backward uses them
            in_cols = (geo.first_query(j, sq, sk, False, window=window) <= i < geo.query_end(j, sq, sk, window=window))
            assert in_cols == want


@pytest.mark.parametrize("tile_m, tile_n", WIN_TILES)
@pytest.mark.parametrize("sq, sk", WIN_SEQLENS)
@pytest.mark.parametrize("left, right", WINDOWS)
def test_window_forward_block_ranges(tile_m, tile_n, sq, sk, left, right):
    """Query tile m visits the key blocks [n_block_min, n_block_max) (every block holding a visible
    key is inside; blocks outside the band are never visited), and the blocks in
    [n_block_left_mask_end, min(n_block_min_causal_mask, seqlen mask)) are fully visible."""
    window = geo.window_sides((left, right), False)
    mask = brute_window(sq, sk, left, right)
    n_blocks = -(-sk // tile_n)
    for m in range(-(-sq // tile_m)):
        rows = range(m * tile_m, min((m + 1) * tile_m, sq))
        n_min = geo.n_block_min(m, sq, sk, tile_m, tile_n, window=window)
        n_max = geo.n_block_max(m, sq, sk, tile_m, tile_n, False, window=window)
        visited = [n for n in range(n_blocks) if block_has(mask, rows, range(n * tile_n, min((n + 1) * tile_n, sk)))]
        if visited:
            assert n_min <= visited[0] and visited[-1] < n_max, (m, visited, n_min, n_max)
            assert n_max == visited[-1] + 1  # the right end is tight
        # no visited block is skipped, and the band costs about a window's worth of blocks
        assert n_max - n_min <= len(visited) + 1 or not visited
        lo = max(n_min, geo.n_block_left_mask_end(m, sq, sk, tile_m, tile_n, window=window))
        hi = min(n_max, geo.n_block_seqlen_mask(sk, tile_n),
                 geo.n_block_min_causal_mask(m, sq, sk, tile_m, tile_n, window=window))
        for n in range(lo, hi):
            cols = range(n * tile_n, (n + 1) * tile_n)
            assert max(cols) < sk and block_full(mask, rows, cols), (m, n, lo, hi)


@pytest.mark.parametrize("tile_m, tile_n", WIN_TILES)
@pytest.mark.parametrize("sq, sk", WIN_SEQLENS)
@pytest.mark.parametrize("left, right", WINDOWS)
def test_window_backward_block_ranges(tile_m, tile_n, sq, sk, left, right):
    """Key tile n visits the query blocks [m_min, m_max) that see one of its keys, and the blocks
    in [m_block_mask_end, m_block_left_mask_start) see every key of the whole tile."""
    window = geo.window_sides((left, right), False)
    mask = brute_window(sq, sk, left, right)
    m_blocks = -(-sq // tile_m)
    for n in range(-(-sk // tile_n)):
        keys = range(n * tile_n, (n + 1) * tile_n)
        m_min, m_max = geo.m_block_range(n, sq, sk, tile_m, tile_n, False, window=window)
        seen = [m for m in range(m_blocks)
                if block_has(mask, range(m * tile_m, min((m + 1) * tile_m, sq)), [j for j in keys if j < sk])]
        if seen:
            assert m_min <= seen[0] and seen[-1] < m_max, (n, seen, m_min, m_max)
            assert m_min == seen[0]
        end = geo.m_block_mask_end(n, sq, sk, tile_m, tile_n, False, window=window)
        start = geo.m_block_left_mask_start(n, sq, sk, tile_m, tile_n, window=window)
        assert m_min <= end and start <= max(m_max, m_min)
        for m in range(end, start):
            rows = range(m * tile_m, min((m + 1) * tile_m, sq))
            assert max(keys) < sk and block_full(mask, rows, keys), (n, m, end, start)


# ---------------------------------------------------------------- GQA-packed query tiles (forward)
PACKS = [2, 4, 8, 16]
PACK_MASKS = [("full", None), ("causal", None), ("window", (37, 0)), ("window", (5, 9)), ("window", (0, 0)),
              ("window", (-1, 3))]


@pytest.mark.parametrize("pack", PACKS)
@pytest.mark.parametrize("tile_m, tile_n", [(192, 128), (128, 128), (64, 128), (128, 80)])
@pytest.mark.parametrize("sq, sk", [(1, 100), (17, 300), (300, 17), (129, 257), (257, 129), (1000, 777)])
@pytest.mark.parametrize("kind, window_size", PACK_MASKS)
def test_packed_forward_block_ranges(pack, tile_m, tile_n, sq, sk, kind, window_size):
    """Packed rows r = query * pack + j (query r // pack): tile m's rows are the queries
    [m * tile_m // pack, ((m + 1) * tile_m - 1) // pack]; the block range covers every key block a
    packed row sees, its right end is tight, and the blocks between the mask bounds are fully
    visible to every row of the tile."""
    causal = kind == "causal"
    window = geo.window_sides(window_size, False) if window_size is not None else None
    if window_size is not None:
        mask = brute_window(sq, sk, *window_size)
    else:
        mask = brute_mask(sq, sk, causal)
    n_blocks = -(-sk // tile_n)
    for m in range(-(-(sq * pack) // tile_m)):
        queries = sorted({r // pack for r in range(m * tile_m, min((m + 1) * tile_m, sq * pack))})
        assert queries[0] == geo.tile_first_query(m, tile_m, pack)
        assert queries[-1] == geo.tile_last_query(m, sq, tile_m, pack=pack)
        n_min = geo.n_block_min(m, sq, sk, tile_m, tile_n, window=window, pack=pack)
        n_max = geo.n_block_max(m, sq, sk, tile_m, tile_n, causal, window=window, pack=pack)
        visited = [n for n in range(n_blocks) if block_has(mask, queries, range(n * tile_n, min((n + 1) * tile_n, sk)))]
        if visited:
            assert n_min <= visited[0] and visited[-1] < n_max and n_max == visited[-1] + 1, (m, visited)
        else:
            assert n_max <= n_min or n_max == 0
        lo = n_min
        if window is not None:
            lo = max(n_min, geo.n_block_left_mask_end(m, sq, sk, tile_m, tile_n, window=window, pack=pack))
        hi = min(n_max, geo.n_block_seqlen_mask(sk, tile_n))
        if causal or window is not None:
            hi = min(hi, geo.n_block_min_causal_mask(m, sq, sk, tile_m, tile_n, window=window, pack=pack))
        for n in range(lo, hi):
            cols = range(n * tile_n, (n + 1) * tile_n)
            assert max(cols) < sk and block_full(mask, queries, cols), (m, n, lo, hi)


# ---------------------------------------------------------------- bands that exclude the diagonal (issue 29)
# Literal sides (geo.Band, flash-attn-4's convention): negative values are ordinary values of the
# formulas. As flash-attn-4 resolves them, left + right >= 0 (its doors turn < 0 into no window), but
# the geometry holds for any band; (-7, 2) (every row empty) checks that nothing is visited wrongly.
BANDS = [(None, -5), (-5, None), (None, -1), (-1, None), (-3, 9), (9, -3), (4, -2), (-2, 2), (0, 0), (None, -200),
         (-200, None), (-130, 140), (-7, 2)]


def brute_band(sq, sk, left, right):
    """visible[i][j] from the literal rule: i + sk - sq - left <= j <= i + sk - sq + right, None unbounded."""
    off = sk - sq
    return [[(left is None or j >= i + off - left) and (right is None or j <= i + off + right) for j in range(sk)]
            for i in range(sq)]


@pytest.mark.parametrize("sq, sk", WIN_SEQLENS)
@pytest.mark.parametrize("left, right", BANDS)
def test_band_rule_matches_brute_force(sq, sk, left, right):
    window = geo.window_sides(geo.Band(left, right), False)
    mask = brute_band(sq, sk, left, right)
    for i in range(sq):
        for j in range(sk + 3):
            want = j < sk and mask[i][j]
            assert geo.visible(i, j, sq, sk, False, window=window) == want
            in_cols = (geo.first_query(j, sq, sk, False, window=window) <= i < geo.query_end(j, sq, sk, window=window))
            assert in_cols == want


@pytest.mark.parametrize("tile_m, tile_n", WIN_TILES)
@pytest.mark.parametrize("sq, sk", WIN_SEQLENS)
@pytest.mark.parametrize("left, right", BANDS)
def test_band_forward_phases(tile_m, tile_n, sq, sk, left, right):
    """The sm90 forward's loop for query tile m with a band: blocks [n_min, n_max) (skipped when
    n_max <= n_min) contain every visible key block, and the blocks it runs unmasked (the kernel's
    clamps: n_causal in [n_min, n_max - 1], n_left in [n_min, n_causal]) are fully visible."""
    window = geo.window_sides(geo.Band(left, right), False)
    mask = brute_band(sq, sk, left, right)
    n_blocks = -(-sk // tile_n)
    for m in range(-(-sq // tile_m)):
        rows = range(m * tile_m, min((m + 1) * tile_m, sq))
        n_min = geo.n_block_min(m, sq, sk, tile_m, tile_n, window=window)
        n_max = geo.n_block_max(m, sq, sk, tile_m, tile_n, False, window=window)
        visited = [n for n in range(n_blocks) if block_has(mask, rows, range(n * tile_n, min((n + 1) * tile_n, sk)))]
        if visited:
            assert n_min <= visited[0] and visited[-1] < n_max == visited[-1] + 1, (m, visited, n_min, n_max)
        if n_max <= n_min:
            continue
        n_causal = max(min(geo.n_block_min_causal_mask(m, sq, sk, tile_m, tile_n, window=window), n_max - 1), n_min)
        n_left = max(min(geo.n_block_left_mask_end(m, sq, sk, tile_m, tile_n, window=window), n_causal), n_min)
        for n in range(n_left, n_causal):
            cols = range(n * tile_n, (n + 1) * tile_n)
            assert max(cols) < sk and block_full(mask, rows, cols), (m, n, n_left, n_causal)


@pytest.mark.parametrize("tile_m, tile_n", WIN_TILES)
@pytest.mark.parametrize("sq, sk", WIN_SEQLENS)
@pytest.mark.parametrize("left, right", BANDS)
def test_band_backward_phases(tile_m, tile_n, sq, sk, left, right):
    """The sm90 backward for key tile n with a band (BwdSchedule's clamps): [m_min, max(m_max, m_min))
    holds every query block that sees one of its keys; the unmasked phase [m_mask_end, m_left) sees
    every key of the tile; and the deterministic dQ chain of query block m (turn n - n_block_min(m))
    is 0, 1, 2, ... over the key tiles that visit it."""
    window = geo.window_sides(geo.Band(left, right), False)
    mask = brute_band(sq, sk, left, right)
    m_blocks = -(-sq // tile_m)
    visitors = {m: [] for m in range(m_blocks)}
    for n in range(-(-sk // tile_n)):
        keys = range(n * tile_n, (n + 1) * tile_n)
        m_min, m_max = geo.m_block_range(n, sq, sk, tile_m, tile_n, False, window=window)
        m_max = max(m_max, m_min)
        seen = [m for m in range(m_blocks)
                if block_has(mask, range(m * tile_m, min((m + 1) * tile_m, sq)), [j for j in keys if j < sk])]
        if seen:
            assert m_min <= seen[0] and seen[-1] < m_max, (n, seen, m_min, m_max)
        end = min(max(geo.m_block_mask_end(n, sq, sk, tile_m, tile_n, False, window=window), m_min), m_max)
        start = min(max(geo.m_block_left_mask_start(n, sq, sk, tile_m, tile_n, window=window), end), m_max)
        for m in range(end, start):
            rows = range(m * tile_m, min((m + 1) * tile_m, sq))
            assert max(keys) < sk and block_full(mask, rows, keys), (n, m, end, start)
        for m in range(m_min, m_max):
            visitors[m].append(n)
    for m, ns in visitors.items():
        turns = [n - geo.n_block_min(m, sq, sk, tile_m, tile_n, window=window) for n in ns]
        assert turns == list(range(len(ns))), (m, ns, turns)


def test_band_division_operands_never_negative():
    """As test_division_operands_never_negative, for bands: every clamped numerator stays >= 0."""
    seen = []

    def rec_max(a, b):
        seen.append(max(a, b))
        return max(a, b)

    ops = geo.Ops(min=min, max=rec_max, select=lambda c, a, b: a if c else b)
    for (tm, tn), (sq, sk), sides in itertools.product(WIN_TILES, WIN_SEQLENS, BANDS):
        window = geo.window_sides(geo.Band(*sides), False)
        for m in range(-(-max(sq, 1) // tm)):
            geo.n_block_max(m, sq, sk, tm, tn, False, ops, window)
            geo.n_block_min(m, sq, sk, tm, tn, ops, window)
            geo.n_block_min_causal_mask(m, sq, sk, tm, tn, ops, window)
            geo.n_block_left_mask_end(m, sq, sk, tm, tn, ops, window)
        for n in range(-(-max(sk, 1) // tn)):
            geo.m_block_range(n, sq, sk, tm, tn, False, ops, window)
            geo.m_block_mask_end(n, sq, sk, tm, tn, False, ops, window)
            geo.m_block_left_mask_start(n, sq, sk, tm, tn, ops, window)
    assert seen and min(seen) >= 0


# BwdConfig.mask_rel: the backward's P^T mask from one step's bounds relative to a thread's first
# element (key_row_bounds / probs_t_hidden) hides exactly the elements the per-row rule hides
# (col0 + col < first_query(key), and with a window >= query_end(key)): causal, full, windows with
# unbounded / zero / negative sides, keys and queries past the sequence ends, the sentinels.
@pytest.mark.parametrize("seed", range(4))
def test_relative_probs_t_mask_matches_per_row_rule(seed):
    rng = random.Random(seed)
    sides = [geo.UNBOUNDED, 0, 1, 7, 100, -3, -20]
    for _ in range(600):
        sq, sk = rng.randint(1, 300), rng.randint(1, 300)
        causal = rng.random() < 0.5
        window = (rng.choice(sides), rng.choice(sides)) if rng.random() < 0.6 else None
        key0, col0 = rng.randint(0, 320), rng.randint(0, 320)
        bounds = geo.key_row_bounds(key0, col0, sq, sk, causal, window)
        for dr in (0, 8, 16, 24):
            key = key0 + dr
            first = geo.first_query(key, sq, sk, causal, window=window) - col0
            end = geo.query_end(key, sq, sk, window=window) - col0 if window is not None else None
            for col in range(0, 48):
                hidden = col < first or (end is not None and col >= end)
                assert bool(geo.probs_t_hidden(bounds, dr, col)) == hidden, (sq, sk, causal, window, key0, col0,
                                                                            dr, col)
