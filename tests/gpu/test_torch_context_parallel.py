"""Issue 27 item 1: torch's own context parallelism (torch.distributed.tensor.experimental.
context_parallel around F.scaled_dot_product_attention) with flash4's SDPA plug-in active, so torch's
ring runs flash4's kernels on each block; 2 processes over NCCL, forward and backward, each rank's
shard against the same rows of the fp32 single-GPU reference (the suite's 2x rule). Skipped with
fewer than 2 GPUs. The recipe: docs/design/context_parallel.md.

Sharding: torch's load-balanced (head-tail) sharding for causal, i.e. rank r holds chunks r and 2W-1-r
(flash4.distributed.zigzag_shard's layout), or plain contiguous chunks (load balancing off, the ring
passing K/V round-robin); rotation by all-gather (torch's default) and all-to-all.
"""

from __future__ import annotations

import os

import pytest
import torch

from flash4 import distributed as fd
from flash4.reference import OUT_ATOL, attention_ref, max_abs_err

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GRAD_ATOL = 1e-3
B, H, S, D = 1, 4, 1024, 128
COMBOS = [(lb, causal, rotate) for lb in (False, True) for causal in (False, True) for rotate in ("allgather",)]
COMBOS.append((True, True, "alltoall"))


def _rows(t_bhsd, rank, world, load_balance):
    """The sequence rows (dim 2) rank holds: chunks r and 2W-1-r (load-balanced) or chunk r."""
    if load_balance:
        return fd.zigzag_shard(t_bhsd.transpose(1, 2), rank, world).transpose(1, 2)
    return t_bhsd.chunk(world, dim=2)[rank]


def _worker(rank, world, store_path):
    os.environ.update(SAFE_ENV)
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import _attention as cp_attention
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash4.integrations.sdpa as f4sdpa

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    f4sdpa.register()
    torch.nn.attention.activate_flash_attention_impl("flash4")
    try:
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
        for i, (load_balance, causal, rotate) in enumerate(COMBOS):
            cp_attention._cp_options.enable_load_balance = load_balance
            cp_attention.set_rotate_method(rotate)
            gen = torch.Generator().manual_seed(i)
            q, k, v, dout = (torch.randn(B, H, S, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
            bufs = [t.clone() for t in (q, k, v, dout)]
            with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
                leaves = [t.detach().clone().requires_grad_() for t in bufs[:3]]
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                out.backward(bufs[3])
            got = [out.detach()] + [t.grad for t in leaves]
            # the single-GPU truth (fp32) and PyTorch's bf16 error, on the global problem, BSHD
            ref = _ref(q, k, v, dout, causal, upcast=True)
            pt = _ref(q, k, v, dout, causal, upcast=False)
            tag = f"rank {rank} load_balance={load_balance} causal={causal} rotate={rotate}"
            for name, g, r, p, atol in zip(("out", "dq", "dk", "dv"), got, ref, pt,
                                           (OUT_ATOL, GRAD_ATOL, GRAD_ATOL, GRAD_ATOL)):
                r, p = _rows(r, rank, world, load_balance), _rows(p, rank, world, load_balance)
                assert g.shape == r.shape, f"{tag} {name}: shard shape {tuple(g.shape)} vs {tuple(r.shape)}"
                err, base = max_abs_err(g.float(), r), max_abs_err(p.float(), r)
                assert err <= 2 * base + atol, f"{tag} {name}: err {err:.3g} > 2 x {base:.3g} + {atol}"
        dist.barrier()
    finally:
        torch.nn.attention.restore_flash_attention_impl()
        dist.destroy_process_group()


def _ref(q, k, v, dout, causal, upcast):
    """(out, dq, dk, dv) as BHSD of attention_ref (fp32 when upcast, else bf16 PyTorch)."""
    leaves = [t.transpose(1, 2).detach().float().requires_grad_() if upcast else
              t.transpose(1, 2).detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, causal=causal, upcast=upcast)
    out.backward(dout.transpose(1, 2).to(out.dtype))
    return [out.detach().transpose(1, 2)] + [t.grad.transpose(1, 2) for t in leaves]


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs for torch's context_parallel over NCCL (this machine has fewer)")
def test_torch_context_parallel_with_flash4(tmp_path):
    import torch.multiprocessing as mp

    os.environ.update(SAFE_ENV)
    ctx = mp.spawn(_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=False)
    _join_or_kill(ctx, timeout=300)


def _join_or_kill(ctx, timeout: float) -> None:
    """Wait for the spawned ranks; a hang fails after `timeout` seconds with them killed."""
    import time

    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):  # re-raises a rank's exception
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{len(ctx.processes)} ranks did not finish within {timeout} s")
