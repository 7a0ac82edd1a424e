"""flash4.distributed on the GPU with flash4's kernels (bf16, sm_90): the ring of one rank, W ranks
emulated by threads on one GPU (every zigzag step, half-query and half-key blocks included, with
the real kernels), and, where torch.cuda.device_count() >= 2, 2 processes over NCCL.

Each block's kernel writes into NaN-poisoned buffers (PoisonedKernel: every element of out, lse,
dq, dk, dv must be written). The gathered out, lse and gradients (loss out . dout + lse . dlse)
are held to the suite's rule against the fp32 single-process reference (gpu_helpers).
The CPU twin, tests/cpu/test_distributed_ring_cpu.py, checks the same ring with the reference kernel on gloo.
"""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch
from gpu_helpers import check_grads_varlen

from flash4 import backward, distributed as fd, forward, validate
from flash4.reference import varlen_fwd_errors

BF16 = torch.bfloat16
NHEADS, NHEADS_K, HEADDIM = 4, 2, 128  # GQA 2:1
# NVLink multicast stays off wherever NCCL runs (the device notes: it can take shared GPUs down)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class PoisonedKernel(fd.Flash4Kernel):
    """flash4's forward / backward of one block into NaN-filled buffers, each checked fully written;
    calls serialized by a lock (ranks emulated by threads share the GPU and the compile cache)."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.calls = 0

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        with self.lock:
            request = validate.varlen_request(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale,
                                              causal=causal)
            out = torch.full(q.shape[:2] + v.shape[2:], math.nan, dtype=q.dtype, device=q.device)
            lse = torch.full((q.shape[1], q.shape[0]), math.nan, dtype=torch.float32, device=q.device)
            forward.run(request, out=out, lse=lse)
            assert not out.isnan().any() and not lse.isnan().any(), "a block's out / lse element left unwritten"
            self.calls += 1
            return out, lse

    def backward(self, dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        with self.lock:
            request = validate.varlen_request(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale,
                                              causal=causal)
            grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
            backward.run(request, dout.contiguous(), out, lse, dlse=dlse, dq=grads[0], dk=grads[1], dv=grads[2])
            for name, g in zip(("dq", "dk", "dv"), grads):
                assert not g.isnan().any(), f"a block's {name} element left unwritten"
            return tuple(grads)


def _inputs(world, dense, seed, chunk=(40, 72)):
    """Global packed q, k, v, dout, dlse, cu_seqlens (bf16 on the GPU); lengths multiples of 2W
    (chunks not multiples of the tiles); dense: one layout of 2 equal sequences."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [2 * world * chunk[0]] * 2 if dense else [2 * world * chunk[0], 0, 2 * world * chunk[1]]
    total = sum(lengths)
    q = torch.randn(total, NHEADS, HEADDIM, generator=gen)
    k, v = (torch.randn(total, NHEADS_K, HEADDIM, generator=gen) for _ in range(2))
    dout = torch.randn(total, NHEADS, HEADDIM, generator=gen)
    dlse = torch.randn(NHEADS, total, generator=gen)
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    return [t.to("cuda", BF16) for t in (q, k, v, dout)] + [dlse.cuda(), cu.cuda()]


def _ring_rank(inputs, rank, world, dense, causal, group, kernel):
    """This rank's shards of (out, lse, dq, dk, dv) through the ring (as CPU tensors)."""
    q, k, v, dout, dlse, cu = inputs
    shard = [fd.zigzag_shard(t, rank, world, cu) for t in (q, k, v, dout)]
    dlse_l = fd.zigzag_shard(dlse.T, rank, world, cu).T
    leaves = [t.clone().requires_grad_() for t in shard[:3]]
    if dense:
        batch = cu.numel() - 1
        seqlen = leaves[0].shape[0] // batch
        out, lse = fd.ring_flash_attn_func(*(t.view(batch, seqlen, *t.shape[1:]) for t in leaves), causal=causal,
                                           return_lse=True, group=group, kernel=kernel)
        out, lse = out.reshape(batch * seqlen, *out.shape[2:]), lse.permute(1, 0, 2).reshape(NHEADS, -1)
    else:
        out, lse = fd.ring_flash_attn_varlen_func(*leaves, fd.zigzag_cu_seqlens(cu, world), causal=causal,
                                                  return_lse=True, group=group, kernel=kernel)
    if isinstance(group, fd.comm._LocalRing):  # threads on one GPU: not through autograd's device thread
        grads = fd.backward_here(out, shard[3], lse, dlse_l)
        grads = [g.view(t.shape) for g, t in zip(grads, leaves)]
    else:
        ((out.float() * shard[3].float()).sum() + (lse * dlse_l).sum()).backward()
        grads = [t.grad for t in leaves]
    return [t.detach().cpu() for t in (out, lse.T)] + [g.cpu() for g in grads]



def _check(inputs, shards, causal):
    """Gathered results of every rank against the fp32 reference (out / lse: varlen_fwd_errors;
    gradients: check_grads_varlen with dlse)."""
    q, k, v, dout, dlse, cu = inputs
    out, lse_t, dq, dk, dv = (fd.zigzag_unshard([s[i] for s in shards], cu.cpu()).cuda() for i in range(5))
    for name, t in (("out", out), ("lse", lse_t), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), f"{name} has NaN"
    errs = varlen_fwd_errors(q, k, v, cu, cu, out, lse_t.T.contiguous(), causal=causal)
    assert errs["ok"], errs
    check_grads_varlen((dq, dk, dv), q, k, v, cu, cu, dout, causal, dlse=dlse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dense", [False, True])
def test_ring_world1(dense, causal):
    """A ring of one rank (torch.distributed not initialized): flash4's own forward and backward with
    the ring's out / lse / dlse plumbing; the default kernel gives the poisoned kernel's out bitwise."""
    inputs = _inputs(1, dense, seed=1)
    kernel = PoisonedKernel()
    shards = [_ring_rank(inputs, 0, 1, dense, causal, None, kernel)]
    assert kernel.calls == 1
    _check(inputs, shards, causal)
    plain = _ring_rank(inputs, 0, 1, dense, causal, None, None)  # Flash4Kernel: flash_attn_varlen_func
    assert torch.equal(plain[0], shards[0][0]) and torch.equal(plain[1], shards[0][1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_ring_threads_one_gpu(world, dense, causal):
    """W ranks emulated by threads on one GPU (local_rings): the zigzag steps with flash4's kernels
    (step 0 causal; half-query / half-key blocks), dK/dV round the ring."""
    inputs = _inputs(world, dense, seed=10 * world + 2 * dense + causal)
    rings, kernel = fd.local_rings(world), PoisonedKernel()
    shards, errors = [None] * world, []

    def rank_main(r):
        try:
            shards[r] = _ring_rank(inputs, r, world, dense, causal, rings[r], kernel)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    assert kernel.calls == world * world  # W ranks x W steps
    _check(inputs, shards, causal)


# ---------------------------------------------------------------- 2 GPUs, NCCL
def _nccl_worker(rank, world, store_path, out_dir):
    os.environ.update(SAFE_ENV)
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        for dense in (False, True):
            for causal in (False, True):
                inputs = [t.to(f"cuda:{rank}") for t in _inputs(world, dense, seed=50 + 2 * dense + causal)]
                res = _ring_rank(inputs, rank, world, dense, causal, None, None)  # default kernel, default group
                torch.save(res, os.path.join(out_dir, f"{int(dense)}{int(causal)}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs for a 2-process NCCL ring (this machine has fewer); the thread-emulated "
                           "rings cover the algorithm on one GPU")
def test_ring_nccl_two_gpus(tmp_path):
    """2 processes (one GPU each) over NCCL with the default kernel (flash_attn_varlen_func and
    flash4.backward) and the default group: gathered results within the rule."""
    import torch.multiprocessing as mp

    os.environ.update(SAFE_ENV)  # inherited by the spawned ranks too
    ctx = mp.spawn(_nccl_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False)
    _join_or_kill(ctx, timeout=300)
    for dense in (False, True):
        for causal in (False, True):
            inputs = _inputs(2, dense, seed=50 + 2 * dense + causal)
            shards = [torch.load(tmp_path / f"{int(dense)}{int(causal)}_rank{r}.pt") for r in range(2)]
            _check(inputs, shards, causal)


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
