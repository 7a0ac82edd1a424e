"""Helpers shared by the CPU tests (inputs, brute-force references, traced-op lookups); the
fixtures that stand in for the kernels are in conftest.py. Test files import from here, never
from each other."""

from __future__ import annotations

import math

import torch

import flash4
from flash4 import validate

BF16, F64, I32 = torch.bfloat16, torch.float64, torch.int32


# ================================================================ dense / varlen / paged / kvcache inputs
def qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64):
    """Seeded bf16 dense (q, k, v)."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, s, n, d, generator=gen).to(BF16) for s, n in ((sq, h), (sk, hk), (sk, hk)))


def cu(lengths):
    """int32 prefix sums (batch + 1,) of `lengths`."""
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=I32)


def varlen_args(len_q=(3, 0, 5), len_k=(4, 2, 0), h=4, hk=2, d=64, dtype=BF16, seed=0):
    """flash_attn_varlen_func keyword arguments of packed sequences with those lengths."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(len_q), h, d, generator=gen).to(dtype)
    k = torch.randn(sum(len_k), hk, d, generator=gen).to(dtype)
    v = torch.randn(sum(len_k), hk, d, generator=gen).to(dtype)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu(len_q), cu_seqlens_k=cu(len_k))


def paged_args(len_q=(3, 0, 5), len_k=(20, 0, 33), h=4, hk=2, d=64, page_size=16, layout="separate"):
    """flash_attn_varlen_func keyword arguments over a paged K/V cache (flash4.reference.paged_kv_cache)."""
    from flash4.reference import paged_kv_cache

    args = varlen_args(len_q, len_k, h, hk, d)
    k_cache, v_cache, page_table, seqused_k = paged_kv_cache(args["k"], args["v"], args["cu_seqlens_k"], page_size,
                                                             layout=layout)
    return dict(q=args["q"], k=k_cache, v=v_cache, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=None,
                page_table=page_table, seqused_k=seqused_k)


def kv_args(b=3, sq=1, s_cache=40, h=4, hk=2, d=64, s_new=1, paged=False, page_size=16, seed=0):
    """flash_attn_with_kvcache keyword arguments: a dense or paged cache, s_new keys to append."""
    gen = torch.Generator().manual_seed(seed)
    args = dict(q=torch.randn(b, sq, h, d, generator=gen).to(BF16))
    if paged:
        pages_per_seq = -(-s_cache // page_size)
        num_pages = b * pages_per_seq + 2
        args["k_cache"] = torch.randn(num_pages, page_size, hk, d, generator=gen).to(BF16)
        args["v_cache"] = torch.randn(num_pages, page_size, hk, d, generator=gen).to(BF16)
        args["page_table"] = torch.randperm(num_pages, generator=gen)[: b * pages_per_seq].view(b, pages_per_seq).to(I32)
    else:
        args["k_cache"] = torch.randn(b, s_cache, hk, d, generator=gen).to(BF16)
        args["v_cache"] = torch.randn(b, s_cache, hk, d, generator=gen).to(BF16)
    if s_new:
        args["k"] = torch.randn(b, s_new, hk, d, generator=gen).to(BF16)
        args["v"] = torch.randn(b, s_new, hk, d, generator=gen).to(BF16)
    args["cache_seqlens"] = torch.randint(0, s_cache - s_new + 1, (b,), generator=gen).to(I32)
    return args


def expected_cache(args, seqlens, rows=None, table=None):
    """The caches after appending args' k/v at seqlens (python ints), by plain indexing."""
    k_cache, v_cache = args["k_cache"].clone(), args["v_cache"].clone()
    page_size = k_cache.shape[1]
    for b in range(args["q"].shape[0]):
        for t in range(args["k"].shape[1]):
            pos = seqlens[b] + t
            if table is not None:
                where = (int(table[b, pos // page_size]), pos % page_size)
            else:
                where = (rows[b] if rows is not None else b, pos)
            k_cache[where] = args["k"][b, t]
            v_cache[where] = args["v"][b, t]
    return k_cache, v_cache


def expected_page_divide_free(page: int, page_rows: int, divide_free=None, headdim=None) -> bool:
    """Whether a paged plan (prefill or decode) whose pages of `page` rows load as TMA pieces of
    page_rows rows (0: gathered) should set FwdConfig.page_divide_free, by the rule written above
    flash4.config.PAGE_DIVIDE_FREE (not from flash4.config.sm90): TMA pieces that are whole pages
    (page_rows == page: pages 8..128 at tile_n 128), unless switched off or, for a prefill, the kernel
    head dim is one of PAGE_DIVIDE_FREE_SPILL_HEADDIMS (headdim None: a decode step, not checked). divide_free: the value of
    FLASH4_PAGE_DIVIDE_FREE (bool), None where unset."""
    from flash4.config import PAGE_DIVIDE_FREE, PAGE_DIVIDE_FREE_SPILL_HEADDIMS

    on = PAGE_DIVIDE_FREE if divide_free is None else bool(divide_free)
    return bool(on and 0 < page_rows == page and headdim not in PAGE_DIVIDE_FREE_SPILL_HEADDIMS)


def expected_prefill_paging(page: int, tile_n: int, headdim: int, all_warps=None, gather_max=None,
                            prefetch=None, divide_free=None, row_shuffle=None) -> dict:
    """What the paged PREFILL plan should load pages of `page` rows with, derived from flash4.config's
    constants by the rule written above PAGE_PIECES_ALL_WARPS (not from flash4.config.sm90, whose code
    this checks). all_warps / gather_max / prefetch: the values of FLASH4_PAGE_PIECES_ALL_WARPS (bool) /
    FLASH4_PAGE_GATHER_MAX (int) / FLASH4_PAGE_PREFETCH (bool), None where unset; divide_free: the value
    of FLASH4_PAGE_DIVIDE_FREE (bool), None where unset.

    Default: pages that are multiples of TMA_PAGE_ROWS load by TMA pieces of gcd(page, tile_n) rows with
    the look-ahead (none gathered: PREFILL_PAGE_GATHER_MAX); pieces of <= PAGE_PIECES_ALL_WARPS_MAX rows
    issued by the four producer warps with PAGED_KV_STAGES stages; pieces of < SMALL_PIECE_ROWS rows
    gathered below SMALL_PIECE_MIN_HEADDIM. all_warps False (or no look-ahead): the previous rules
    (gathered up to PAGE_GATHER_MAX, one warp, PAGED_KV_STAGES_SMALL_PIECES for pieces of <=
    SMALL_PAGE_PIECE_ROWS rows with the look-ahead). gather_max set: that limit and no head-dim rule
    (the four warps still apply).

    TMA pieces that are whole pages (page_rows == page) find their page without the division by the
    page size (page_divide_free, flash4.config.PAGE_DIVIDE_FREE: expected_page_divide_free).

    flash4.config.PAGE_ROW_SHUFFLE (row_shuffle: the value of FLASH4_PAGE_ROW_SHUFFLE, None where unset;
    needs page_divide_free's switch on): no small-piece rule (pieces of < SMALL_PIECE_ROWS rows load by
    TMA at every head dim), and four-warp pieces of pages holding several of them get page_divide_free
    and page_row_shuffle below ROW_SHUFFLE_MIN_HEADDIM, and at every head dim for pieces of <
    SMALL_PIECE_ROWS rows. At the head dims of PAGE_DIVIDE_FREE_SPILL_HEADDIMS (those kernels spill)
    neither page_divide_free nor the row shuffle, and the small-piece rule stays.

    Returns page_rows, page_gather, page_prefetch, page_pieces_all_warps, page_divide_free,
    page_row_shuffle and stages: the
    K/V stages the plan asks for (with_paged_kv_stages then keeps 2 where 3 do not fit the smem)."""
    from flash4.config import (PAGE_DIVIDE_FREE, PAGE_GATHER_MAX, PAGE_PIECES_ALL_WARPS, PAGE_PIECES_ALL_WARPS_MAX,
                               PAGE_DIVIDE_FREE_SPILL_HEADDIMS, PAGE_PREFETCH, PAGE_ROW_SHUFFLE, PAGED_KV_STAGES,
                               PAGED_KV_STAGES_SMALL_PIECES,
                               PREFILL_PAGE_GATHER_MAX, ROW_SHUFFLE_MIN_HEADDIM, SMALL_PAGE_PIECE_ROWS,
                               SMALL_PIECE_MIN_HEADDIM, SMALL_PIECE_ROWS, TMA_PAGE_ROWS)

    prefetch = PAGE_PREFETCH if prefetch is None else bool(prefetch)
    four = bool(PAGE_PIECES_ALL_WARPS if all_warps is None else all_warps) and prefetch  # needs the look-ahead
    shuffle_on = (bool(PAGE_ROW_SHUFFLE if row_shuffle is None else row_shuffle)
                  and bool(PAGE_DIVIDE_FREE if divide_free is None else divide_free)
                  and headdim not in PAGE_DIVIDE_FREE_SPILL_HEADDIMS)
    small_piece_rule = four and gather_max is None and not shuffle_on
    if gather_max is None:
        gather_max = PREFILL_PAGE_GATHER_MAX if four else PAGE_GATHER_MAX
    rows = math.gcd(page, tile_n)
    if page % TMA_PAGE_ROWS or page <= gather_max or (
            small_piece_rule and rows < SMALL_PIECE_ROWS and headdim < SMALL_PIECE_MIN_HEADDIM):
        return dict(page_rows=0, page_gather=True, page_prefetch=False, page_pieces_all_warps=False,
                    page_divide_free=False, page_row_shuffle=False, stages=PAGED_KV_STAGES)
    pieces4 = four and rows <= PAGE_PIECES_ALL_WARPS_MAX
    stages = (PAGED_KV_STAGES_SMALL_PIECES if prefetch and rows <= SMALL_PAGE_PIECE_ROWS and not pieces4
              else PAGED_KV_STAGES)
    shuffled = shuffle_on and pieces4 and rows < page and (headdim < ROW_SHUFFLE_MIN_HEADDIM or rows < SMALL_PIECE_ROWS)
    return dict(page_rows=rows, page_gather=False, page_prefetch=prefetch, page_pieces_all_warps=pieces4,
                page_divide_free=expected_page_divide_free(page, rows, divide_free, headdim) or shuffled,
                page_row_shuffle=shuffled, stages=stages)


# ================================================================ the three doors and their validate pairs
def varlen_kwargs():
    gen = torch.Generator().manual_seed(1)
    cu_seqlens = torch.tensor([0, 3, 8], dtype=I32)
    return dict(q=torch.randn(8, 4, 64, generator=gen).to(BF16), k=torch.randn(8, 2, 64, generator=gen).to(BF16),
                v=torch.randn(8, 2, 64, generator=gen).to(BF16), cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)


def kvcache_kwargs():
    gen = torch.Generator().manual_seed(2)
    return dict(q=torch.randn(2, 1, 4, 64, generator=gen).to(BF16),
                k_cache=torch.randn(2, 32, 2, 64, generator=gen).to(BF16),
                v_cache=torch.randn(2, 32, 2, 64, generator=gen).to(BF16),
                cache_seqlens=torch.tensor([5, 17], dtype=I32))


# (public function, its validate pair (support_error-like, check_*), keyword arguments)
ENTRY_POINTS = {
    "dense": (flash4.flash_attn_func, validate.support_error, validate.check_inputs, lambda: dict(zip("qkv", qkv()))),
    "varlen": (flash4.flash_attn_varlen_func, validate.varlen_support_error, validate.check_varlen_inputs,
               varlen_kwargs),
    "kvcache": (flash4.flash_attn_with_kvcache, validate.kvcache_support_error, validate.check_kvcache_inputs,
                kvcache_kwargs),
}


# ================================================================ brute force
def naive_varlen(q, k, v, offs_q, lens_q, offs_k, lens_k, scale, causal, key_of=None):
    """Row by row in float64 from the definition. key_of(b, j) -> (k row, v row) overrides packed K."""
    total_q, h, d = q.shape
    hk = k.shape[-2]
    out = torch.zeros(total_q, h, d, dtype=F64)
    lse = torch.full((h, total_q), -math.inf, dtype=F64)
    for b in range(len(lens_q)):
        lq, lk = lens_q[b], lens_k[b]
        keys = [key_of(b, j) if key_of else (k[offs_k[b] + j], v[offs_k[b] + j]) for j in range(lk)]
        for i in range(lq):
            row = offs_q[b] + i
            visible = [j for j in range(lk) if not causal or j <= i + lk - lq]
            for hh in range(h):
                kh = hh // (h // hk)
                if not visible:
                    continue
                s = torch.stack([q[row, hh].double() @ keys[j][0][kh].double() * scale for j in visible])
                p = torch.exp(s - s.max())
                lse[hh, row] = s.max() + torch.log(p.sum())
                out[row, hh] = (p / p.sum()) @ torch.stack([keys[j][1][kh].double() for j in visible])
    return out, lse


# ================================================================ the custom ops on the meta device
def meta_inputs(b=2, sq=100, sk=120, h=4, hk=2, d=64, dtype=torch.bfloat16, grad=True):
    return [torch.empty(b, s, n, d, dtype=dtype, device="meta", requires_grad=grad)
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


def varlen_meta(total_q=300, total_k=260, batch=3, h=4, hk=2, d=64, dtype=torch.bfloat16, grad=True, paged=False,
                seqused=False):
    """Meta varlen inputs: q (total_q, h, d); k/v packed (total_k, hk, d), or paged (pages, 16, hk, d)
    with a page_table; int32 metadata (values never read on the meta device)."""
    q = torch.empty(total_q, h, d, dtype=dtype, device="meta", requires_grad=grad)
    kv_shape = (total_k // 16 + 1, 16, hk, d) if paged else (total_k, hk, d)
    k, v = (torch.empty(kv_shape, dtype=dtype, device="meta", requires_grad=grad) for _ in range(2))
    meta = dict(
        cu_seqlens_q=torch.empty(batch + 1, dtype=I32, device="meta"),
        cu_seqlens_k=None if paged else torch.empty(batch + 1, dtype=I32, device="meta"),
        seqused_q=torch.empty(batch, dtype=I32, device="meta") if seqused else None,
        seqused_k=torch.empty(batch, dtype=I32, device="meta") if (seqused or paged) else None,
        page_table=torch.empty(batch, 8, dtype=I32, device="meta") if paged else None,
    )
    return q, k, v, meta


def varlen_fwd_args(q, k, v, meta, max_q=128, max_k=None, scale=0.125, causal=True, deterministic=False):
    return (q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_k"], meta["seqused_q"], meta["seqused_k"],
            meta["page_table"], max_q, max_k, scale, causal, deterministic, False)


def kvcache_meta(batch=2, seqlen_q=1, cache=512, h=8, hk=2, d=128, new=1, paged=False):
    q = torch.empty(batch, seqlen_q, h, d, dtype=torch.bfloat16, device="meta")
    cache_shape = (batch * cache // 64, 64, hk, d) if paged else (batch, cache, hk, d)
    k_cache, v_cache = (torch.empty(cache_shape, dtype=torch.bfloat16, device="meta") for _ in range(2))
    k, v = (torch.empty(batch, new, hk, d, dtype=torch.bfloat16, device="meta") if new else None for _ in range(2))
    page_table = torch.empty(batch, cache // 64, dtype=I32, device="meta") if paged else None
    return q, k_cache, v_cache, k, v, page_table


def flash4_calls(gm):
    """The flash4 op calls of a traced graph module."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("flash4.")]


def op_argument(node, name):
    """The value a traced flash4 op call received for argument `name` (defaults filled in: tracing
    drops trailing arguments equal to their defaults)."""
    schema = node.target._schema.arguments
    args = list(node.args) + [a.default_value for a in schema[len(node.args):]]
    named = {a.name: value for a, value in zip(schema, args)}
    named.update(node.kwargs)
    return named[name]


# ================================================================ one message from every validate function and the door
def _raises_everywhere(exc, match, check, support, door, kwargs):
    import pytest

    with pytest.raises(exc) as info:
        check(**kwargs)
    message = str(info.value)
    for fragment in match:
        assert fragment in message, (fragment, message)
    assert support(**kwargs) == message
    with pytest.raises(exc) as info:
        door(**kwargs)
    assert str(info.value) == message
    return message


def varlen_raises(exc, match=(), **kwargs):
    """check_varlen_inputs and the public function raise exc with every fragment of `match`;
    varlen_support_error returns that message."""
    return _raises_everywhere(exc, match, validate.check_varlen_inputs, validate.varlen_support_error,
                              flash4.flash_attn_varlen_func, kwargs)


def kv_raises(exc, match=(), **kwargs):
    """check_kvcache_inputs and flash_attn_with_kvcache raise exc with every fragment of `match`;
    kvcache_support_error returns that message."""
    return _raises_everywhere(exc, match, validate.check_kvcache_inputs, validate.kvcache_support_error,
                              flash4.flash_attn_with_kvcache, kwargs)


def seqlens_ok(args, **kw):
    validate.check_varlen_seqlens(args["cu_seqlens_q"], args.get("cu_seqlens_k"), args["q"].shape[0],
                                  args["k"].shape[0], **kw)


def seqlens_raises(match, args, **kw):
    import pytest

    with pytest.raises(ValueError) as info:
        seqlens_ok(args, **kw)
    for fragment in match:
        assert fragment in str(info.value), (fragment, str(info.value))


def compiled_row(compiled, cfg) -> dict:
    """A compile_check-style row of a compiled kernel (resource usage via cuobjdump) plus its SASS text
    (None without cuobjdump)."""
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    cubin = extract_cubin(compiled)
    return {"config": repr(cfg), "ok": True, "error": None, **resource_usage(cubin), "sass": sass_text(cubin)}


def layout_size(shape) -> int:
    """Number of elements of a static hierarchical CuTe shape (nested tuples of ints)."""
    if isinstance(shape, tuple):
        return math.prod(layout_size(s) for s in shape)
    return shape


def layout_offset(crd, shape, stride) -> int:
    """crd2idx of a static hierarchical layout (an int coordinate splits colexicographically), in pure
    Python: the sm100 smem-view tests compare traced layouts element by element with it."""
    if isinstance(shape, tuple):
        if isinstance(crd, int):
            out = 0
            for s, d in zip(shape, stride):
                out += layout_offset(crd % layout_size(s), s, d)
                crd //= layout_size(s)
            return out
        return sum(layout_offset(c, s, d) for c, s, d in zip(crd, shape, stride))
    return crd * stride


def compile_bwd_rows(configs, ids, dump) -> dict:
    """Each backward config compiled once (flash4.compile.cache.compile_bwd, PTX and cubin kept in
    dump): {id: (cfg, CPU seconds, ptx, resource row, SASS text or None)}; the row is empty and the
    SASS None where cuobjdump is not installed."""
    import time

    from flash4.compile.cache import compile_bwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    out = {}
    for cfg, name in zip(configs, ids):
        t0 = time.process_time()
        compiled = compile_bwd(cfg, options=f" --keep-ptx --keep-cubin --dump-dir {dump}")
        cpu_s = time.process_time() - t0
        cubin = extract_cubin(compiled)
        row = resource_usage(cubin) if cubin is not None else {}
        out[name] = (cfg, cpu_s, compiled.__ptx__, row, sass_text(cubin) if row else None)
    return out


def routed_bwd_runs(monkeypatch, tool, ab, describe_postprocess, with_delta=False):
    """The backward A/B tools' host path on meta tensors (tools/ab_bwd_tiles.py, tools/ab_portable.py):
    the runner getters replaced by recorders, flash4.backward.run routed (ab.TileRoute) to each
    variant of each of tool.CELLS in turn. Yields (case, name, variant, asked, launched, want): the
    kernels the run asked for (("bwd", cfg), ("bwd_preprocess", headdim, dtype), and
    describe_postprocess(args, kwargs) for the postprocess), the main kernel's heads_per_cta per
    launch, and tool.plan_kernels([case]) (what --precompile builds). After each case, every
    variant went through the route once."""
    import torch

    from flash4 import backward
    from flash4.compile import cache

    asked, launched = [], []

    def recorder(kind):
        def get(*args, **kwargs):
            if kind == "bwd_preprocess":
                asked.append((kind, args[0], args[1]))
                assert kwargs.get("headdim_q", args[0]) == args[0] and not kwargs.get("varlen")
            elif kind == "bwd_postprocess":
                asked.append(describe_postprocess(args, kwargs))
            else:
                asked.append((kind, args[0]))

            def run(*a, **k):
                pass

            def tail(*a, **k):  # flash4.backward asks each runner for its host scalars once per launch plan
                if kind == "bwd":
                    launched.append(k["heads_per_cta"])
                return ()

            run.compiled, run.tail = run, tail
            return run
        return get

    for kind in ("bwd", "bwd_preprocess", "bwd_postprocess"):
        monkeypatch.setattr(cache, f"get_{kind}_runner", recorder(kind))
    monkeypatch.setattr(backward, "dq_target", lambda dq: dq)  # meta tensors have no address
    for case in tool.CELLS:
        want = set(tool.plan_kernels([case]))
        req = ab.request(case)
        out = torch.empty(req.q.shape, device="meta", dtype=req.q.dtype)
        lse = torch.empty(case.batch, case.nheads, case.seqlen_q, device="meta", dtype=torch.float32)
        variants = tool.variants(case)
        with ab.TileRoute() as route:
            for name, v in variants.items():
                asked.clear()
                launched.clear()
                route.plan = ab.BwdPlan(v.cfg, v.heads_per_cta)
                delta = torch.empty_like(lse) if with_delta and case.sink else None
                backward.run(req, out, out, lse, None, delta=delta)
                yield case, name, v, list(asked), list(launched), want
            assert route.calls == len(variants)
        assert backward.bwd_config is route.original


def assert_portable_row_clean(row: dict, cfg) -> None:
    """The portable (sm80) family's compile-check row of cfg: compiled; and where cuobjdump is installed
    (else pytest.skip), SASS for cfg's target, 0 spills, mma.sync / ldmatrix / cp.async present, no
    Hopper / Blackwell instruction (wgmma, TMA, stmatrix, tcgen05)."""
    import pytest

    from flash4.config.sm80 import gpu_arch_name

    assert row["ok"], row["error"]
    if row.get("registers") is None:
        pytest.skip("cuobjdump not installed: SASS not checked")
    assert row["sass_arch"] == gpu_arch_name(cfg.arch), row["sass_arch"]
    assert row["spills"] == 0, f"{row['config']}: {row['spills']} local-memory instructions (register spill)"
    assert row["hmma_16816"] > 0 and row["ldsm"] > 0 and row["ldgsts"] > 0, row
    assert row["hgmma"] == row["utma"] == row["stsm"] == row["utchmma"] == 0, row


def sass_loops(sass: str) -> list:
    """[(first, last), ...]: every loop of a cuobjdump listing (a backward branch, `BRA <addr>` whose
    target is not above the branch's own address: the target up to the branch), in program order of
    their branches, as indices into sass_lines(sass)."""
    import re

    lines = sass_lines(sass)
    addr = [int(a, 16) for a, _ in lines]
    loops = []
    for i, (_, ins) in enumerate(lines):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) <= addr[i] and int(m.group(1), 16) in addr:
            loops.append((addr.index(int(m.group(1), 16)), i))
    return loops


def sass_innermost_loops(sass: str) -> list:
    """[(first, last), ...]: the innermost loops of a cuobjdump listing (sass_loops containing no other
    such loop), as indices into sass_lines(sass)."""
    loops = sass_loops(sass)
    return [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]


def sass_lines(sass: str) -> list:
    """[(address hex, instruction text with its ';'), ...] of a cuobjdump listing."""
    import re

    return re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*;)", sass, re.M)


def sass_main_loop(sass: str) -> str:
    """The SASS lines of the largest innermost loop of a cuobjdump listing: a kernel's steady-state
    step."""
    lines = sass_lines(sass)
    a, b = max(sass_innermost_loops(sass), key=lambda ab: ab[1] - ab[0])
    return "\n".join(f"        /*{lines[j][0]}*/ {lines[j][1]}" for j in range(a, b + 1))
