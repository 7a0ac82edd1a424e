"""Every door's launches on small shapes, for compute-sanitizer (issue 25 item 6).

    compute-sanitizer --tool memcheck --print-limit 20 python tools/sanitize.py
    compute-sanitizer --tool racecheck python tools/sanitize.py --only dense
    compute-sanitizer --tool memcheck python tools/sanitize.py --bad     # bad metadata, no check_seqlens
    python tools/sanitize.py --list
    FLASH4_FAMILY=portable compute-sanitizer --tool memcheck python tools/sanitize.py   # the portable family

Each case is one call (or a forward + backward) with valid metadata, tails that are not multiples of
the tiles, and GQA, so every kernel flash4 launches on the H200 runs once: dense forward / backward
(causal, window, softcap, sink, deterministic), varlen with seqused_q / seqused_k, paged K/V at page
sizes 1, 4 (gathered rows), 16, 24, 32 (TMA pieces from the four producer warps) and 64 (TMA pieces), the KV cache (dense, paged, cache_batch_idx,
appends across page boundaries) with split-KV and its combine. Kernels are compiled (or loaded from
the disk cache) before the sanitizer-heavy part only in the sense that the first call of each case
compiles; run once without the sanitizer first to fill the cache. Prints one line per case; exit 1
if a case raised. Memory errors are compute-sanitizer's to report (its exit code is non-zero then).
"""

from __future__ import annotations

import argparse
import sys


CASE_NAMES = ("dense", "dense_causal_d64", "dense_d256", "dense_window", "dense_softcap_sink",
              "dense_deterministic", "varlen", "varlen_deterministic_d64", "paged_1", "paged_4", "paged_16",
              "paged_24", "paged_32", "paged_16_d64", "paged_64", "paged_16_whole_blocks", "kvcache_dense", "kvcache_dense_split4", "kvcache_batch_idx",
              "kvcache_paged_16", "kvcache_paged_1_split3", "kvcache_paged_64")


def _cases():
    import torch

    import flash4

    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=bf16, generator=g)

    def dense(causal=False, d=128, **kw):
        q, k, v = rnd(2, 77, 8, d), rnd(2, 203, 2, d), rnd(2, 203, 2, d)
        for t in (q, k, v):
            t.requires_grad_(True)
        out, lse = flash4.flash_attn_func(q, k, v, causal=causal, return_lse=True, **kw)
        (out.float().square().sum() + lse.sum()).backward()

    def varlen(d=128, deterministic=False):
        lens_q, lens_k = [0, 1, 77, 130], [5, 1, 203, 130]
        cu_q = torch.tensor([0, 0, 1, 78, 208], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, 5, 6, 209, 339], dtype=torch.int32, device=dev)
        q, k, v = rnd(sum(lens_q), 8, d), rnd(sum(lens_k), 2, d), rnd(sum(lens_k), 2, d)
        for t in (q, k, v):
            t.requires_grad_(True)
        used_q = torch.tensor([0, 1, 60, 129], dtype=torch.int32, device=dev)
        used_k = torch.tensor([3, 1, 150, 130], dtype=torch.int32, device=dev)
        out = flash4.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 203, seqused_q=used_q, seqused_k=used_k,
                                            causal=True, deterministic=deterministic)
        out.float().square().sum().backward()

    def paged(page_size, d=128, lens=(1, 77, 300, 0)):
        lens = list(lens)
        pages_per = [-(-n // page_size) for n in lens]
        num_pages = sum(pages_per) + 3
        k, v = rnd(num_pages, page_size, 2, d), rnd(num_pages, page_size, 2, d)
        perm = torch.randperm(num_pages, device=dev, generator=g).to(torch.int32)
        table = torch.zeros(len(lens), max(pages_per), dtype=torch.int32, device=dev)
        at = 0
        for b, n in enumerate(pages_per):
            table[b, :n] = perm[at:at + n]
            at += n
        q = rnd(sum(lens), 8, d)
        cu_q = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=dev)
        used = torch.tensor(lens, dtype=torch.int32, device=dev)
        flash4.flash_attn_varlen_func(q, k, v, cu_q, None, max(lens), max(lens), seqused_k=used, page_table=table,
                                      causal=True)
        # vLLM's decode: one query per sequence
        q1 = rnd(len(lens), 8, d)
        cu1 = torch.arange(len(lens) + 1, dtype=torch.int32, device=dev)
        flash4.flash_attn_varlen_func(q1, k, v, cu1, None, 1, max(lens), seqused_k=used, page_table=table)

    def kvcache(page_size=None, num_splits=0, batch_idx=False, d=128):
        b, cap, hk = 3, 1024, 2
        seqlens = torch.tensor([0, 17, 1000], dtype=torch.int32, device=dev)
        knew, vnew = rnd(b, 3, hk, d), rnd(b, 3, hk, d)
        q = rnd(b, 3, 8, d)
        kw = dict(num_splits=num_splits, causal=True)
        if page_size is None:
            rows = b + 2 if batch_idx else b
            kc, vc = rnd(rows, cap + 8, hk, d), rnd(rows, cap + 8, hk, d)
            if batch_idx:
                kw["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device=dev)
            flash4.flash_attn_with_kvcache(q, kc, vc, knew, vnew, seqlens, **kw)
            flash4.flash_attn_with_kvcache(q[:, :1], kc, vc, None, None, seqlens, **kw)
        else:
            per = -(-(cap + 8) // page_size)
            pool = b * per + 2
            kc, vc = rnd(pool, page_size, hk, d), rnd(pool, page_size, hk, d)
            table = torch.randperm(pool, device=dev, generator=g)[: b * per].view(b, per).to(torch.int32)
            flash4.flash_attn_with_kvcache(q, kc, vc, knew, vnew, seqlens, page_table=table, **kw)
            flash4.flash_attn_with_kvcache(q[:, :1], kc, vc, None, None, seqlens, page_table=table, **kw)

    cases = {
        "dense": lambda: dense(),
        "dense_causal_d64": lambda: dense(True, d=64),
        "dense_d256": lambda: dense(True, d=256),
        "dense_window": lambda: dense(False, window_size=(40, 7)),
        "dense_softcap_sink": lambda: dense(True, softcap=30.0,
                                               learnable_sink=torch.randn(8, device=dev, requires_grad=True)),
        "dense_deterministic": lambda: dense(True, deterministic=True),
        "varlen": lambda: varlen(),
        "varlen_deterministic_d64": lambda: varlen(64, True),
        "paged_1": lambda: paged(1),
        "paged_4": lambda: paged(4),
        "paged_16": lambda: paged(16),
        "paged_24": lambda: paged(24),
        "paged_32": lambda: paged(32),
        "paged_16_d64": lambda: paged(16, d=64),
        "paged_64": lambda: paged(64),
        # key counts that are whole key blocks (128): no V tail to zero (racecheck A/B of zero_v_tail)
        "paged_16_whole_blocks": lambda: paged(16, lens=(128, 256, 384, 0)),
        "kvcache_dense": lambda: kvcache(),
        "kvcache_dense_split4": lambda: kvcache(num_splits=4),
        "kvcache_batch_idx": lambda: kvcache(batch_idx=True),
        "kvcache_paged_16": lambda: kvcache(16),
        "kvcache_paged_1_split3": lambda: kvcache(1, num_splits=3),
        "kvcache_paged_64": lambda: kvcache(64),
    }
    assert tuple(cases) == CASE_NAMES
    return cases


BAD_CASE_NAMES = ("bad_seqused_k_past_tensor", "bad_cu_seqlens_past_tensor", "bad_page_index",
                  "bad_cache_seqlens_past_capacity", "bad_small_max_seqlen_q")


def _bad_cases():
    """Metadata check_seqlens=True would reject, passed without it: results are undefined, but no
    launch may read or write outside the tensors' memory (compute-sanitizer memcheck says)."""
    import torch

    import flash4

    dev, bf16, i32 = "cuda", torch.bfloat16, torch.int32
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=bf16, generator=g)

    def varlen(cu_q, cu_k, total_q, total_k, max_q, max_k, **kw):
        q, k, v = rnd(total_q, 8, 128), rnd(total_k, 2, 128), rnd(total_k, 2, 128)
        cu_q, cu_k = (torch.tensor(c, dtype=i32, device=dev) for c in (cu_q, cu_k))
        flash4.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, **kw)

    def bad_page_index():
        pool, page = 6, 16
        k, v = rnd(pool, page, 2, 128), rnd(pool, page, 2, 128)
        table = torch.tensor([[0, 5, 1000, -7], [2, 99, 3, 4]], dtype=i32, device=dev)
        used = torch.tensor([60, 64], dtype=i32, device=dev)
        cu_q = torch.tensor([0, 30, 94], dtype=i32, device=dev)
        flash4.flash_attn_varlen_func(rnd(94, 8, 128), k, v, cu_q, None, 64, 64, seqused_k=used, page_table=table,
                                      causal=True)
        table64 = torch.tensor([[0, 1000], [-3, 2]], dtype=i32, device=dev)
        k64, v64 = rnd(3, 64, 2, 128), rnd(3, 64, 2, 128)
        flash4.flash_attn_varlen_func(rnd(94, 8, 128), k64, v64, cu_q, None, 64, 128, seqused_k=used * 2,
                                      page_table=table64, causal=True)

    def bad_cache():
        kc, vc = rnd(2, 256, 2, 128), rnd(2, 256, 2, 128)
        seqlens = torch.tensor([300, 5000], dtype=i32, device=dev)
        flash4.flash_attn_with_kvcache(rnd(2, 1, 8, 128), kc, vc, cache_seqlens=seqlens)
        flash4.flash_attn_with_kvcache(rnd(2, 1, 8, 128), kc, vc, cache_seqlens=seqlens, num_splits=4)

    cases = {
        "bad_seqused_k_past_tensor": lambda: varlen([0, 50, 100], [0, 70, 130], 100, 130, 50, 70,
                                                    seqused_k=torch.tensor([70, 4000], dtype=i32, device=dev)),
        "bad_cu_seqlens_past_tensor": lambda: varlen([0, 50, 300], [0, 70, 500], 100, 130, 250, 430),
        "bad_page_index": bad_page_index,
        "bad_cache_seqlens_past_capacity": bad_cache,
        "bad_small_max_seqlen_q": lambda: varlen([0, 50, 300], [0, 70, 130], 300, 130, 64, 70),
    }
    assert tuple(cases) == BAD_CASE_NAMES
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--bad", action="store_true", help="the bad-metadata cases instead (check_seqlens=False)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(BAD_CASE_NAMES if args.bad else CASE_NAMES))
        return 0
    import torch

    cases = _bad_cases() if args.bad else _cases()
    failed = 0
    for name in args.only or list(cases):
        try:
            cases[name]()
            torch.cuda.synchronize()
            print(f"sanitize: {name}: ok", flush=True)
        except Exception as exc:  # report and go on: the sanitizer's log names the kernel
            failed += 1
            print(f"sanitize: {name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
