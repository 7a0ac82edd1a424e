"""One backward call of flash4 or flash-attn-4 for ncu (docs/perf/ncu_2026-12-03.md):

    ncu --clock-control none --profile-from-start off --set full -o bwd_flash4 \
        python tools/prof_bwd.py flash4 8 4096 16 128 1     # impl B S H D causal

impl: flash4 or fa4 (flash-attn-4 through flash4.bench.baselines, imported only then). The call is warmed up three times, then
one backward runs between torch.cuda.profiler.start() / stop(), bf16. A seventh argument `fwd` profiles one forward
instead (`python tools/prof_bwd.py flash4 8 4096 16 128 0 fwd`)."""
import sys, torch
impl = sys.argv[1]
B, S, H, D = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
causal = sys.argv[6] == "1"
forward_only = len(sys.argv) > 7 and sys.argv[7] == "fwd"
torch.manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
if impl == "flash4":
    from flash4 import flash_attn_func
    f = lambda: flash_attn_func(q, k, v, causal=causal)
else:
    from flash4.bench import baselines  # the one module of flash4 that imports flash-attn-4

    fa = baselines._fa4_func
    if fa is None:
        raise SystemExit(f"prof_bwd: no flash-attn-4 ({baselines.FA4_IMPORT_ERROR})")

    def f():
        o = fa(q, k, v, causal=causal)
        return o[0] if isinstance(o, tuple) else o
o = f(); do = torch.randn_like(o)
for _ in range(3):
    o = f(); o.backward(do)
torch.cuda.synchronize()
o = f(); torch.cuda.synchronize()
if forward_only:
    torch.cuda.profiler.start(); f(); torch.cuda.synchronize(); torch.cuda.profiler.stop()
else:
    torch.cuda.profiler.start(); o.backward(do); torch.cuda.synchronize(); torch.cuda.profiler.stop()
print(impl, "ok")
