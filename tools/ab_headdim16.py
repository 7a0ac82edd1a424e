"""A/B of FLASH4_HEADDIM16 on the H200: head dims that are multiples of 16 up to 128 on kernels of
their own width (flash4.config.sm90.KERNEL_HEADDIMS) against the padded path (switch off: d32 -> 64,
d80 -> 96, d112 -> 128; the forward without autograd reads the narrow tensors, the backward and
autograd-recorded forwards run on zero-padded copies), next to flash-attn-4 (whose sm90 kernels round
the tile's head dim up to 16) where installed.

    source .device-deps/activate.sh && python tools/ab_headdim16.py --out $OUT/ab_hd16.json

Cells: the bench's smalld cases (flash4.bench.cases: d32 / d80 full, d112 causal; 4k, 8 x 16 heads)
plus d40 / d48 / d80 causal and d16 full. Forward: flash_attn_func without autograd; backward: one
autograd.grad over a graph built once (flash4.bench.common.time_bwd), the switch set while the graph
is built. ROUNDS interleaved rounds (order reversed every other round), each the median of calls
with L2 flushed; TFLOPs of the real head dim (backward 2.5x the forward's). Checked before timing:
on / off outputs within 2e-2 of each other (different kernels, not the same bits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROUNDS, REP_MS = 3, 40.0
CELLS = (("smalld_32_full_4k", 32, False), ("smalld_80_full_4k", 80, False), ("smalld_112_causal_4k", 112, True),
         ("d40_causal_4k", 40, True), ("d48_causal_4k", 48, True), ("d16_full_4k", 16, False),
         ("d80_causal_4k", 80, True))
B, S, H = 8, 4096, 16


def _with_switch(value: str, fn):
    def run():
        old = os.environ.get("FLASH4_HEADDIM16")
        os.environ["FLASH4_HEADDIM16"] = value
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["FLASH4_HEADDIM16"]
            else:
                os.environ["FLASH4_HEADDIM16"] = old
    return run


def main(argv=None) -> int:
    import torch

    from flash4 import flash_attn_func
    from flash4.bench import baselines
    from ab_switch import interleaved
    from flash4.bench.common import make_inputs, time_bwd

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--out")
    p.add_argument("--cells", nargs="*", help="cell names (default: all)")
    args = p.parse_args(argv)
    impls = {i.name: i for i in baselines.all_impls()}
    fa4 = impls.get("flash_attn_4") if impls.get("flash_attn_4") and not impls["flash_attn_4"].unavailable else None
    results, failed = [], False
    for name, d, causal in CELLS:
        if args.cells and name not in args.cells:
            continue
        q, k, v = make_inputs(B, S, S, H, H, d, torch.bfloat16)
        flops = 4.0 * B * H * S * S * d / (2 if causal else 1)
        fns = {"off": _with_switch("0", lambda: flash_attn_func(q, k, v, causal=causal)),
               "on": _with_switch("1", lambda: flash_attn_func(q, k, v, causal=causal))}
        close = (fns["on"]() - fns["off"]()).abs().max().item()
        failed |= not close <= 2e-2
        if fa4 is not None:
            with fa4.context():
                fns["flash_attn_4"] = fa4.make(q, k, v, causal)
        med = interleaved(fns, args.rounds, REP_MS)
        bwd = {}
        for r in range(args.rounds):
            for n in (("off", "on") if r % 2 == 0 else ("on", "off")):
                bwd.setdefault(n, []).append(_with_switch("1" if n == "on" else "0",
                                                          lambda: time_bwd(impls["flash4"], q, k, v, causal, REP_MS))())
            if fa4 is not None:
                bwd.setdefault("flash_attn_4", []).append(time_bwd(fa4, q, k, v, causal, REP_MS))
        bmed = {n: statistics.median(t) for n, t in bwd.items()}
        row = {"cell": name, "headdim": d, "causal": causal, "max_diff_on_off": close,
               **{f"{n}_fwd_tflops": flops / (ms * 1e-3) / 1e12 for n, ms in med.items()},
               **{f"{n}_bwd_tflops": 2.5 * flops / (ms * 1e-3) / 1e12 for n, ms in bmed.items()},
               "fwd_on_over_off": med["off"] / med["on"], "bwd_on_over_off": bmed["off"] / bmed["on"]}
        if fa4 is not None:
            row["fwd_on_over_fa4"] = med["flash_attn_4"] / med["on"]
            row["bwd_on_over_fa4"] = bmed["flash_attn_4"] / bmed["on"]
            row["fwd_off_over_fa4"] = med["flash_attn_4"] / med["off"]
            row["bwd_off_over_fa4"] = bmed["flash_attn_4"] / bmed["off"]
        results.append(row)
        print(" | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
