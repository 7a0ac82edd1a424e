"""A/B of the portable (sm80) family's backward speed candidates on the H200, in one process
(issue 24; docs/design/sm80_family.md, "Backward speed": why each candidate).

    # CPU, the exact source tree of the device run (the disk cache key hashes flash4's sources);
    # compiles every kernel of the plan for sm_90a and checks each backward for spills (exit 1 if one
    # spills):
    python tools/ab_portable.py --precompile --cache-dir .ab_portable
    # GPU (carry .device-deps and .ab_portable):
    source .device-deps/activate.sh && python tools/ab_portable.py --cache-dir .ab_portable --out $OUT/ab_portable.json
    python tools/ab_portable.py --dry-run       # no GPU, no compile: the cells and each variant's config

The family is forced (main sets FLASH4_FAMILY=portable), so "shipped" is
the portable plan flash4 picks on the H200 today (since 2026-12-02 night the "fa2" candidate for plain
dense problems: flash4.config.sm80.shipped_bwd_candidate); "table" is the tile table's config and each
other variant one of flash4.config.sm80.bwd_candidates(table): "coal" (the table's tiles, dQ
reduce-added in the MMA's register order), "fa2" (FlashAttention-2's sm80 tiles, with that dQ order),
"m128" (d128, 128 queries x 64 keys), "fa2e" / "fa2s" (fa2 with the step's LSE loads kept under its
GEMMs / LSE and D staged through smem: Sm80BwdConfig.lse_early / lse_smem), "fa2w" (d64, FlashAttention-2's
warp layout with lse_smem), and the step-order switches on the shipped fa2w / fa2s: "fa2wq" / "fa2sq"
(dq_before_dk), "fa2wp" / "fa2sp" (p_before_dp; spills, A/B only), "fa2wpq" / "fa2spq" (both), and
"fa2wps" / "fa2wpqs" / "fa2sps" / "fa2spqs" (those with dp_split: dP's k-loop in two halves, half of P's
exponentials between them; spills, A/B only; e.g. `--sdpa --variants fa2wp fa2wps fa2wpqs`). The cells are
the sweep's 8 where the portable backward was measured at 0.46-0.72x FA2 (docs/perf/h200-portable.csv):
d64 / d128 x full / causal x 1k / 4k, 32k tokens, nheads = 2048 / d. A "sdpa_flash" row (PyTorch SDPA's
flash backend = FlashAttention-2) is printed per
cell for reference when --sdpa is given (flash4.bench.common.time_bwd, the bench's method).

Timing, routing and checks are tools/ab_bwd_tiles.py's (this tool rebinds its cell list, variants
and kernel loader): interleaved rounds, median of calls with L2 flushed, TFLOPs of the visible work
(2.5x the forward's), variant/shipped = shipped ms / variant ms (> 1: faster); each variant's dQ,
dK, dV within 1e-2 relative max difference of the shipped config's, every element written (exit 1
when one fails).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab_bwd_tiles  # noqa: E402  (tools/ab_bwd_tiles.py: plan routing, timing, checks)
import ab_switch  # noqa: E402
from flash4.bench.cases import Case  # noqa: E402

TOKENS, HIDDEN = 32768, 2048
CELLS = tuple(Case(f"d{d}_{'causal' if c else 'full'}_{s // 1024}k", d, c, s, s, TOKENS // s, HIDDEN // d,
                   HIDDEN // d)
              for d in (64, 128) for c in (False, True) for s in (1024, 4096))


def variants(case: Case) -> dict:
    """{name: Variant}: "shipped" (the portable plan: flash4.config.sm80.shipped_bwd_candidate where it
    applies) first, then "table" (the tile table's config of the same problem) when that differs,
    then the table's bwd_candidates other than the shipped config; with --variants only those named
    (and "shipped")."""
    import dataclasses

    from flash4.config.sm80 import bwd_candidates, select_bwd_config

    plan = ab_bwd_tiles.shipped_plan(case)
    out = {"shipped": ab_bwd_tiles.Variant(plan.cfg, plan.heads_per_cta)}
    c = plan.cfg
    table = select_bwd_config(c.headdim, c.dtype, c.causal, arch=c.arch, deterministic=c.deterministic,
                              local=c.local, softcap=c.softcap)
    table = dataclasses.replace(table, varlen_q=c.varlen_q, varlen_k=c.varlen_k, seqused_q=c.seqused_q,
                                seqused_k=c.seqused_k)
    if table != c:
        out["table"] = ab_bwd_tiles.Variant(table, plan.heads_per_cta)
    for name, cfg in bwd_candidates(table).items():
        if cfg != c:
            out[name] = ab_bwd_tiles.Variant(cfg, plan.heads_per_cta)
    keep = ab_bwd_tiles.VARIANT_FILTER  # --variants: only these and "shipped" (compiled, loaded, timed)
    return {k: v for k, v in out.items() if keep is None or k == "shipped" or k in keep}


def cfg_short(c) -> str:
    bits = [f"m{c.tile_m}n{c.tile_n}w{c.num_warps}q{c.q_stages} "
            f"sdp{c.warps_m_sdp}/dkv{c.warps_n_dkv}/dq{c.warps_m_dq}"]
    bits += [name for name in ("dq_coalesced", "deterministic", "local", "lse_early", "lse_smem", "p_before_dp",
                               "dq_before_dk", "dp_split") if getattr(c, name)]
    return " ".join(bits)


def plan_kernels(cells) -> list[tuple]:
    """Every kernel the run loads (kind, key...), no duplicates, fixed order: the portable forward,
    the preprocess, and per variant its backward and its dQ postprocess (row-major or the sm80
    register order)."""
    from flash4.compile.cache import dq_postprocess_kwargs
    from flash4.config import postprocess_wide_stores

    wide = postprocess_wide_stores()
    out = []
    for case in cells:
        out += [("fwd", ab_bwd_tiles.fwd_cfg(case)), ("bwd_preprocess", case.headdim, ab_bwd_tiles.DTYPE)]
        for v in variants(case).values():
            post = tuple(sorted(dq_postprocess_kwargs(v.cfg).items()))
            out += [("bwd", v.cfg), ("bwd_postprocess_sm80", case.headdim, ab_bwd_tiles.DTYPE, wide, post)]
    return list(dict.fromkeys(out))


_load_kernel = ab_switch.load_kernel


def load_kernel(item: tuple):
    """ab_switch.load_kernel, plus this tool's postprocess items (the sm80 register order)."""
    if item[0] != "bwd_postprocess_sm80":
        return _load_kernel(item)
    from flash4.compile import cache

    _, headdim, dtype, wide, post = item
    return cache.get_bwd_postprocess_runner(headdim, dtype, ab_bwd_tiles.ARCH, wide_stores=wide, **dict(post))


def sdpa_rows(cells, rep_ms: float) -> None:
    """Print SDPA's flash backend (FlashAttention-2) backward TFLOPs per cell, timed as the bench
    times it (flash4.bench.common.time_bwd: autograd.grad on a graph built once), for reference."""
    import torch

    from flash4.bench import common
    from flash4.bench.baselines import all_impls
    from flash4.bench.cases import case_bwd_flops

    impl = next(i for i in all_impls() if i.name == "sdpa_flash")
    for case in cells:
        q, k, v = common.make_inputs(case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k,
                                     case.headdim, torch.bfloat16)
        ms = common.time_bwd(impl, q, k, v, case.causal, rep_ms)
        print(f"  sdpa_flash {case.name:14s} bwd {case_bwd_flops(case) / ms / 1e9:.1f} TF", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


def install() -> None:
    """Rebind tools/ab_bwd_tiles.py's plan (cells, variants, kernels) and ab_switch's loader to
    this tool's (FLASH4_FAMILY=portable must be set when they are called: main sets it)."""
    ab_bwd_tiles.CELLS = CELLS
    ab_bwd_tiles.variants = variants
    ab_bwd_tiles.cfg_short = cfg_short
    ab_bwd_tiles.short = lambda v: cfg_short(v.cfg)
    ab_bwd_tiles.plan_kernels = plan_kernels
    ab_switch.load_kernel = load_kernel


def main(argv=None) -> int:
    os.environ["FLASH4_FAMILY"] = "portable"  # read at call time by flash4.config (active_family)
    os.environ.pop("FLASH4_PORTABLE_BWD", None)  # "shipped" is the table (flash4.config.sm80.bwd_plan)
    argv = list(sys.argv[1:] if argv is None else argv)
    sdpa = "--sdpa" in argv
    if sdpa:
        argv.remove("--sdpa")
    install()
    rc = ab_bwd_tiles.main(argv)
    if sdpa and not any(a in argv for a in ("--dry-run", "--precompile")):
        print("\nreference (SDPA flash backend = FlashAttention-2):")
        sdpa_rows(CELLS, ab_bwd_tiles.REP_MS)
    return rc


if __name__ == "__main__":
    sys.exit(main())
