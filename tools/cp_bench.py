"""Context-parallel throughput (issue 27 item 3): one long causal sequence sharded over the GPUs of
one host, tokens/s and TFLOPs per GPU, forward and backward, 1 vs N GPUs.

    python tools/cp_bench.py                                   # 1 GPU (no process group)
    torchrun --nproc-per-node 2 tools/cp_bench.py              # 2 GPUs over NCCL
    torchrun --nproc-per-node 8 tools/cp_bench.py --seqlens 256k,1m --impl torch-cp --backend cudnn

Shapes: batch 1, nheads 32, nheads_k 8 (GQA 32:8), head dim 128, bf16, causal; --seqlens a
comma list (k = 1024, m = 1024 * 1024; each a multiple of 2 * world size). Implementations:
    flash4-ring   flash4.distributed.ring_flash_attn_func (zigzag ring, flash4's kernels); with one
                  GPU also plain flash4.flash_attn_func (the 1-GPU baseline the scaling divides by)
    torch-cp      torch.distributed.tensor.experimental.context_parallel around
                  F.scaled_dot_product_attention (its load-balanced ring) with --backend
                  flash4 (flash4's SDPA plug-in active: torch's ring, flash4's kernels), flash
                  (PyTorch's FA2) or cudnn. K/V are expanded to 32 heads for it (SDPA's ring
                  passes K/V of the query heads); so it sends 4x the K/V bytes flash4-ring sends.
Rates: tokens/s per GPU = seqlen / time / world; TFLOPs per GPU with the causal count
(4 * seqlen^2 * nheads * headdim / 2 forward, x 2.5 backward) / world / time. Time per rank by CUDA
events over --iters calls after --warmup, the slowest rank's reported. Prints one JSON line per
(impl, seqlen) and, with --json, writes them to a file (rank 0).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the others: the device notes), forced here.
Not yet run on a multi-GPU machine (none was lent when it was written; docs/design/context_parallel.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value  # before torch / NCCL read them

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

NHEADS, NHEADS_K, HEADDIM = 32, 8, 128
BWD_FLOPS_FACTOR = 2.5


def parse_tokens(text: str) -> int:
    t = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    return int(t[:-1] if scale > 1 else t) * scale


def causal_flops(seqlen: int) -> float:
    return 4.0 * seqlen * seqlen * NHEADS * HEADDIM / 2


def timed(fn, warmup: int, iters: int) -> float:
    """Seconds per call of fn (CUDA events), the slowest rank's."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor(start.elapsed_time(end) / 1000 / iters, device="cuda")
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def local_inputs(seqlen: int, world: int, gen, heads_k: int):
    """This rank's shard (1, seqlen / world, heads, 128) of q, k, v, dout (random: the timing does
    not depend on the values, so no global tensor is built)."""
    s = seqlen // world
    shapes = ((1, s, NHEADS, HEADDIM), (1, s, heads_k, HEADDIM), (1, s, heads_k, HEADDIM), (1, s, NHEADS, HEADDIM))
    return [torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for shape in shapes]


def bench_flash4_ring(seqlen, world, args, gen):
    from flash4.distributed import ring_flash_attn_func

    q, k, v, dout = local_inputs(seqlen, world, gen, NHEADS_K)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            ring_flash_attn_func(*leaves, causal=True)

    out = ring_flash_attn_func(*leaves, causal=True)

    def bwd():
        torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return timed(fwd, args.warmup, args.iters), timed(bwd, args.warmup, args.iters)


def bench_flash4_single(seqlen, args, gen):
    from flash4 import flash_attn_func

    q, k, v, dout = local_inputs(seqlen, 1, gen, NHEADS_K)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            flash_attn_func(*leaves, causal=True)

    out = flash_attn_func(*leaves, causal=True)

    def bwd():
        torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return timed(fwd, args.warmup, args.iters), timed(bwd, args.warmup, args.iters)


def bench_torch_cp(seqlen, world, args, gen):
    """torch's context_parallel (load-balanced causal ring) around SDPA; the buffers are the global
    (1, heads, seqlen, 128) tensors, sharded in place by the context (BHSD, seq dim 2)."""
    from torch.nn.attention import SDPBackend

    impl_active = False
    if args.backend == "flash4":
        import flash4.integrations.sdpa as f4sdpa

        f4sdpa.register()
        torch.nn.attention.activate_flash_attention_impl("flash4")
        impl_active = True
    backend = {"flash4": SDPBackend.FLASH_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}[args.backend]
    # the same global tensors on every rank (one seed), BHSD
    g = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v, dout = (torch.randn(1, NHEADS, seqlen, HEADDIM, generator=g, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    try:
        if world == 1:
            return _time_sdpa(q, k, v, dout, backend, args)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                              no_restore_buffers={q, k, v, dout}):
            return _time_sdpa(q, k, v, dout, backend, args)
    finally:
        if impl_active:
            torch.nn.attention.restore_flash_attention_impl()


def _time_sdpa(q, k, v, dout, backend, args):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(*leaves, is_causal=True)

        out = F.scaled_dot_product_attention(*leaves, is_causal=True)

        def bwd():
            torch.autograd.grad(out, leaves, dout, retain_graph=True)

        return timed(fwd, args.warmup, args.iters), timed(bwd, args.warmup, args.iters)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="128k,256k,512k,1m")
    p.add_argument("--impl", choices=("flash4-ring", "torch-cp"), default="flash4-ring")
    p.add_argument("--backend", choices=("flash4", "flash", "cudnn"), default="flash4", help="torch-cp's SDPA kernels")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    gen = torch.Generator(device="cuda").manual_seed(rank)
    rows = []
    try:
        for seqlen in (parse_tokens(s) for s in args.seqlens.split(",")):
            if seqlen % (2 * world):
                raise SystemExit(f"seqlen {seqlen} is not a multiple of 2 * world size {2 * world}")
            runs = []
            if args.impl == "flash4-ring":
                runs.append(("flash4-ring", bench_flash4_ring(seqlen, world, args, gen)))
                if world == 1:
                    runs.append(("flash4-single", bench_flash4_single(seqlen, args, gen)))
            else:
                runs.append((f"torch-cp-{args.backend}", bench_torch_cp(seqlen, world, args, gen)))
            for name, (t_fwd, t_bwd) in runs:
                flops = causal_flops(seqlen)
                row = dict(impl=name, world=world, seqlen=seqlen, nheads=NHEADS, nheads_k=NHEADS_K, headdim=HEADDIM,
                           fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3,
                           fwd_tokens_per_s_per_gpu=seqlen / t_fwd / world,
                           bwd_tokens_per_s_per_gpu=seqlen / t_bwd / world,
                           fwd_tflops_per_gpu=flops / t_fwd / world / 1e12,
                           bwd_tflops_per_gpu=BWD_FLOPS_FACTOR * flops / t_bwd / world / 1e12)
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    finally:
        if rank == 0 and args.json is not None:
            args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
