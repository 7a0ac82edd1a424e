"""Developer smoke run on a GPU: correctness on a handful of shapes, then a few timings.

    python tools/gpu_smoke.py [--quick]

Not a test (tests/gpu is); prints one line per check so a hang or a wrong answer is located fast.
"""

import argparse
import dataclasses
import math
import sys
import time
import traceback

import torch

sys.path.insert(0, "src")

from flash4.compile.cache import get_fwd_runner  # noqa: E402
from flash4.config import select_fwd_config  # noqa: E402


def ref_attention(q, k, v, scale, causal, dtype=torch.float32):
    """(out, lse) computed in `dtype`; rows that see no key give out 0, lse -inf."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(h // hk, dim=2)
    vf = vf.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].masked_fill(lse[..., None] == float("-inf"), 0))
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return out, lse


def check(b, sq, sk, h, hk, d, causal, dtype=torch.bfloat16, **variant):
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device="cuda", dtype=torch.float32)
    cfg = dataclasses.replace(select_fwd_config(d, "bf16" if dtype == torch.bfloat16 else "fp16", causal), **variant)
    run = get_fwd_runner(cfg)
    run(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    ref_o, ref_lse = ref_attention(q, k, v, scale, causal, torch.float32)
    pt_o, _ = ref_attention(q, k, v, scale, causal, dtype)
    err = (out.float() - ref_o).abs().max().item()
    pt_err = (pt_o.float() - ref_o).abs().max().item()
    finite = torch.isfinite(ref_lse)
    lse_err = (lse - ref_lse).abs()[finite].max().item() if finite.any() else 0.0
    lse_inf_ok = bool((lse[~finite] == float("-inf")).all())
    nan = bool(out.isnan().any() or lse[finite].isnan().any())
    ok = (not nan) and err <= 2 * pt_err + 1e-4 and lse_err < 1e-3 and lse_inf_ok
    print(f"{'ok ' if ok else 'BAD'} {variant} b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} causal={int(causal)} "
          f"err={err:.2e} pt_err={pt_err:.2e} lse_err={lse_err:.2e} nan={nan} inf_ok={lse_inf_ok}", flush=True)
    return ok


def bench(fn, iters=20):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


VARIANTS = {
    "default": {},
    "persist_lpt": dict(persistent=True, lpt=True),
    "lpt": dict(lpt=True),
    "emu25": dict(exp2_emu_frac=0.25),
    "tau0": dict(rescale_threshold=0.0),
}


def timing(d, s, causal, variants=VARIANTS, competitors=True):
    b, h = 32768 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    res = {}
    for name, var in variants.items():
        run = get_fwd_runner(dataclasses.replace(select_fwd_config(d, "bf16", causal), **var))
        res[name] = bench(lambda: run(q, k, v, out, lse, d ** -0.5))
    if not competitors:
        print(f"TFLOPs d={d} s={s} causal={int(causal)}: " + " ".join(f"{n}={flops / t / 1e9:6.1f}" for n, t in res.items()), flush=True)
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["cudnn"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    try:
        from flash_attn.cute import flash_attn_func as fa4
        res["fa4"] = bench(lambda: fa4(q, k, v, causal=causal))
    except Exception as e:  # noqa: BLE001
        print("fa4 unavailable:", type(e).__name__, str(e)[:200])
    line = " ".join(f"{n}={flops / t / 1e9:6.1f}" for n, t in res.items())
    print(f"TFLOPs d={d} s={s} causal={int(causal)}: {line}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.time()
    get_fwd_runner(select_fwd_config(128, "bf16", False))
    print(f"first compile {time.time() - t0:.2f}s", flush=True)
    cases = [
        (1, 128, 128, 1, 1, 128, False), (2, 1000, 1000, 4, 4, 128, False), (2, 1000, 1000, 4, 4, 128, True),
        (1, 17, 129, 2, 1, 64, True), (1, 129, 17, 2, 1, 64, True), (1, 1, 1, 1, 1, 64, False),
        (2, 4096, 4096, 8, 1, 128, True), (1, 333, 777, 4, 2, 256, False), (1, 777, 333, 4, 2, 256, True),
        (3, 500, 600, 3, 1, 96, True), (2, 300, 700, 2, 2, 192, False), (200, 128, 128, 1, 1, 64, False),
    ]
    if args.quick:
        cases = cases[:3]
    bad = 0
    checks = [(c, {}) for c in cases]
    for var in (dict(persistent=True, lpt=True), dict(exp2_emu_frac=0.25), dict(rescale_threshold=0.0)):
        checks += [(c, var) for c in cases[1:4] + cases[6:9] + cases[11:]]
    checks += [((1, 300, 300, 2, 2, 64, True), dict(tile_m=128)), ((1, 300, 300, 2, 2, 64, False), dict(tile_m=128))]
    cases = checks
    for c, var in checks:
        try:
            bad += not check(*c, **var)
        except Exception:  # noqa: BLE001
            bad += 1
            print("ERROR", c, var, traceback.format_exc()[-2000:], flush=True)
    print(f"{len(cases) - bad} passed, {bad} failed", flush=True)
    if not args.no_bench:
        for d, s, causal in [(64, 4096, False), (64, 16384, True), (64, 1024, False)]:
            timing(d, s, causal, {"m128": dict(tile_m=128), "m128_persist": dict(tile_m=128, persistent=True, lpt=True),
                                  "m192_persist": dict(persistent=True, lpt=True)}, competitors=False)
        for d, s, causal in [(128, 4096, False), (128, 16384, False), (128, 16384, True), (128, 4096, True),
                             (64, 4096, False), (64, 4096, True), (256, 4096, False), (256, 16384, True), (128, 1024, False)]:
            try:
                timing(d, s, causal)
            except Exception:  # noqa: BLE001
                print("ERROR timing", d, s, causal, traceback.format_exc()[-1500:], flush=True)


if __name__ == "__main__":
    main()
