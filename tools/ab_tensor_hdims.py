"""A/B of FwdConfig.tensor_hdims on the H200: the forward of a head dim flash4 pads (flash4.headdim:
32 -> 64, 80 -> 96, 112 -> 128, ...) through the padded path (flash_attn_func with
FLASH4_NARROW_HEADDIMS=0: zero-padded copies of q, k, v, the padded kernel, the output sliced
back; the API's only path before 2026-12-04) against the same kernel
reading the narrow tensors (flash4.forward.launch_narrow: TMA zero-fill, clipped O store, no
copies), next to flash-attn-4 (whose sm90 forward rounds the tile's head dim up the same way and
reads the narrow tensors) where installed.

    source .device-deps/activate.sh && python tools/ab_tensor_hdims.py --out $OUT/ab_th.json

Cells: the bench's smalld cases (flash4.bench.cases: d32 / d80 full, d112 causal, 4k, 8 x 16
heads) plus d40 / d160 causal 4k. ROUNDS interleaved rounds (order reversed every other round),
each the median of calls with L2 flushed (flash4.bench.common.time_ms); TFLOPs of the real head
dim. Check before timing: narrow out / lse bitwise equal to the API's (exit 1 if not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROUNDS, REP_MS = 5, 50.0
CELLS = (("smalld_32_full_4k", 32, False), ("smalld_80_full_4k", 80, False), ("smalld_112_causal_4k", 112, True),
         ("d40_causal_4k", 40, True), ("d160_causal_4k", 160, True))
B, S, H = 8, 4096, 16


def main(argv=None) -> int:
    import torch

    from flash4 import flash_attn_func, forward
    from flash4.bench import baselines
    from flash4.bench.common import make_inputs, time_ms

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    fa4 = {i.name: i for i in baselines.all_impls()}.get("flash_attn_4")
    results, failed = [], False
    for name, d, causal in CELLS:
        q, k, v = make_inputs(B, S, S, H, H, d, torch.bfloat16)
        flops = 4.0 * B * H * S * S * d / (2 if causal else 1)

        stand_in = forward.narrow_stand_in(q, k, v, d ** -0.5, causal)

        def narrow():
            out = torch.empty_like(q)
            lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
            forward.launch_narrow(q, k, v, out, lse, stand_in)
            return out

        def api():  # the padded copies (what flash_attn_func ran before the narrow path)
            os.environ["FLASH4_NARROW_HEADDIMS"] = "0"
            try:
                return flash_attn_func(q, k, v, causal=causal)
            finally:
                del os.environ["FLASH4_NARROW_HEADDIMS"]

        out_n = torch.full_like(q, float("nan"))
        lse_n = torch.full((B, H, S), float("nan"), device="cuda")
        ran = forward.launch_narrow(q, k, v, out_n, lse_n, stand_in)
        os.environ["FLASH4_NARROW_HEADDIMS"] = "0"
        out_a, lse_a = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        del os.environ["FLASH4_NARROW_HEADDIMS"]
        same = bool(ran) and torch.equal(out_n, out_a) and torch.equal(lse_n, lse_a)
        failed |= not same
        fns = {"api": api, "narrow": narrow}
        if fa4 is not None:
            with fa4.context():
                fns["flash_attn_4"] = fa4.make(q, k, v, causal)
        times = {n: [] for n in fns}
        for r in range(args.rounds):
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for n in order:
                times[n].append(time_ms(fns[n], rep_ms=REP_MS))
        med = {n: statistics.median(t) for n, t in times.items()}
        row = {"cell": name, "headdim": d, "causal": causal, "bitwise": same,
               **{f"{n}_tflops": flops / (ms * 1e-3) / 1e12 for n, ms in med.items()}}
        row["narrow_over_api"] = med["api"] / med["narrow"]
        if "flash_attn_4" in med:
            row["narrow_over_fa4"] = med["flash_attn_4"] / med["narrow"]
            row["api_over_fa4"] = med["flash_attn_4"] / med["api"]
        results.append(row)
        print(" | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
