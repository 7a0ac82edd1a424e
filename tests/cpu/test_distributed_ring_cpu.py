"""flash4.distributed on the CPU: the zigzag schedule, the LSE merge, the sharding, and the whole ring
(forward and backward) with the float reference kernel, over gloo with 2, 3 and 4 processes and
over in-process thread rings, against single-process attention.

Accuracy: float64 single-process autograd is the truth; the ring (ReferenceKernel in fp32, the
inputs in fp32 or bf16) must be within 2x the error of the same single-process computation done
by PyTorch in the input dtype, plus a small atol (flash4.reference's criterion).
The GPU twin, tests/gpu/test_distributed_ring.py, runs flash4's kernels.
"""

from __future__ import annotations

import itertools
import math
import os
import threading

import pytest
import torch

from flash4 import distributed as fd
from flash4.distributed import schedule as zz
from flash4.distributed.merge import merge, merge_rows
from flash4.distributed.ring import Plan
from flash4.reference import attention_bwd_ref, attention_ref, attention_varlen_ref, causal_mask, max_abs_err

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny tensors: one intra-op thread (two spin-waiting threads on a loaded CPU cost 20x here)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ================================================================ the schedule
def _causal_pairs(rank, world):
    """{(q chunk, k chunk): kind} rank must compute for global causal attention."""
    want = {}
    for a in zz.chunks(rank, world):
        for b in range(2 * world):
            if b < a:
                want[(a, b)] = "full"
            elif b == a:
                want[(a, b)] = "diagonal"
    return want


@pytest.mark.parametrize("world", range(1, 9))
def test_schedule_covers_causal_exactly_once(world):
    for rank in range(world):
        steps = zz.schedule(rank, world, causal=True)
        assert [s.source for s in steps] == [(rank - s) % world for s in range(world)]
        assert steps[0].causal and steps[0].q_part == zz.ALL and steps[0].k_part == zz.ALL
        assert not any(s.causal for s in steps[1:])  # only the local diagonal needs the mask
        got = {}
        for s in steps:
            pairs = zz.chunk_pairs(s, rank, world)
            assert not set(pairs) & set(got), f"a chunk pair computed twice at step {s}"
            got.update(pairs)
        assert got == _causal_pairs(rank, world)


@pytest.mark.parametrize("world", range(1, 9))
def test_schedule_balanced(world):
    """Every rank does 2W chunk blocks, 2 per step: no rank waits for another (a contiguous split
    gives rank r 2r + 1 half-blocks' worth)."""
    for rank in range(world):
        steps = zz.schedule(rank, world, causal=True)
        assert [zz.work([s], rank, world) for s in steps] == [2.0] * world
        # a step with half the queries or half the keys: the skipped half is exactly the masked one
        for s in steps[1:]:
            assert (s.q_part, s.k_part) == ((zz.ALL, zz.FIRST) if s.source < rank else (zz.SECOND, zz.ALL))


@pytest.mark.parametrize("world", [1, 2, 5])
def test_schedule_not_causal(world):
    for rank in range(world):
        steps = zz.schedule(rank, world, causal=False)
        assert all((s.q_part, s.k_part, s.causal) == (zz.ALL, zz.ALL, False) for s in steps)
        assert zz.work(steps, rank, world) == 4.0 * world


def test_schedule_bad_rank():
    with pytest.raises(ValueError, match="rank 3 outside"):
        zz.schedule(3, 3, True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_rows_rebuild_global_causal_mask(world):
    """Token level: the rows each step selects (Plan, zigzag_rows) and the kernel's local causal
    mask at step 0 together give every rank exactly its rows of the global causal mask, each
    (query, key) pair once. Two sequences, one empty in between."""
    c = 3
    cu_g = torch.tensor([0, 2 * world * c, 2 * world * c, 2 * world * c + 4 * world], dtype=torch.int32)
    total = int(cu_g[-1])
    want = torch.zeros(total, total, dtype=torch.int64)
    for a, b in zip(cu_g[:-1].tolist(), cu_g[1:].tolist()):
        want[a:b, a:b] = causal_mask(b - a, b - a).long()
    cu_l = fd.zigzag_cu_seqlens(cu_g, world)
    lengths = (cu_l[1:] - cu_l[:-1]).tolist()
    plan = Plan.create(cu_l, lengths, 1.0, True)
    rows = [fd.zigzag_rows(cu_g, r, world) for r in range(world)]
    got = torch.zeros_like(want)
    for rank in range(world):
        for s in zz.schedule(rank, world, True):
            q_idx, cu_q, _ = plan.q_rows(s)
            k_idx, cu_k, _ = plan.k_rows(s)
            gq = rows[rank] if q_idx is None else rows[rank][q_idx]
            gk = rows[s.source] if k_idx is None else rows[s.source][k_idx]
            for b in range(len(lengths)):
                qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
                block = (causal_mask(qe - qs, ke - ks) if s.causal else torch.ones(qe - qs, ke - ks, dtype=torch.bool))
                got[gq[qs:qe, None], gk[None, ks:ke]] += block.long()
    assert torch.equal(got, want)


# ================================================================ the merge
@pytest.mark.parametrize("causal", [False, True])
def test_merge_equals_union(causal):
    """Attention over keys A then merged with keys B == attention over A u B (float64), including
    rows that see no key of A, of B, or of either (out 0, lse -inf, no NaN)."""
    gen = torch.Generator().manual_seed(1)
    sq, sk, h, d = 9, 12, 2, 8
    q = torch.randn(1, sq, h, d, generator=gen, dtype=F64)
    k, v = (torch.randn(1, sk, h, d, generator=gen, dtype=F64) for _ in range(2))
    scale = 0.4
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    visible = causal_mask(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
    visible = visible.clone()
    visible[0] = False          # a row with no key at all
    visible[1, :6] = False      # keys only in B
    visible[2, 6:] = False      # keys only in A

    def part(cols):
        m = torch.zeros(sq, sk, dtype=torch.bool)
        m[:, cols] = True
        s = scores.masked_fill(~(visible & m), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None].nan_to_num(neginf=0)), 0.0)
        return torch.einsum("bhqk,bkhd->bqhd", p, v)[0], lse[0]

    full_out, full_lse = part(slice(None))
    a_out, a_lse = part(slice(0, 6))
    b_out, b_lse = part(slice(6, None))
    out, lse = merge(a_out, a_lse, b_out, b_lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[:, 0]).all() and (out[0] == 0).all()
    assert torch.allclose(out, full_out, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(full_lse))
    assert torch.allclose(lse[torch.isfinite(lse)], full_lse[torch.isfinite(full_lse)], atol=1e-12)
    # the order of the blocks does not matter, and merging with an empty block is the identity
    out2, lse2 = merge(b_out, b_lse, a_out, a_lse)
    assert torch.allclose(out2, out, atol=1e-12)
    empty_out, empty_lse = torch.zeros_like(a_out), torch.full_like(a_lse, float("-inf"))
    out3, lse3 = merge(a_out, a_lse, empty_out, empty_lse)
    assert torch.equal(out3, a_out) and torch.equal(lse3, a_lse)


def test_merge_rows_in_place():
    gen = torch.Generator().manual_seed(2)
    out, b_out = (torch.randn(6, 2, 4, generator=gen) for _ in range(2))
    lse, b_lse = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    rows = torch.tensor([1, 4, 5])
    want_out, want_lse = out.clone(), lse.clone()
    mo, ml = merge(out[rows], lse[:, rows], b_out[rows], b_lse[:, rows])
    want_out[rows], want_lse[:, rows] = mo, ml
    merge_rows(out, lse, rows, b_out[rows], b_lse[:, rows])
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_merge_large_lse_no_overflow():
    """Weights are exp(lse_part - lse_merged) <= 1: no overflow at |lse| ~ 1e4 in fp32."""
    out_a, out_b = torch.ones(1, 1, 2), 3 * torch.ones(1, 1, 2)
    out, lse = merge(out_a, torch.tensor([[1e4]]), out_b, torch.tensor([[1e4]]))
    assert torch.allclose(out, 2 * torch.ones(1, 1, 2)) and torch.allclose(lse, torch.tensor([[1e4 + math.log(2)]]))


# ================================================================ sharding and arguments
@pytest.mark.parametrize("world", [1, 2, 3])
def test_zigzag_shard_roundtrip(world):
    cu = [0, 4 * world, 4 * world, 10 * world]
    x = torch.arange(cu[-1] * 2).view(cu[-1], 2)
    shards = [fd.zigzag_shard(x, r, world, torch.tensor(cu, dtype=torch.int32)) for r in range(world)]
    assert torch.equal(fd.zigzag_unshard(shards, cu), x)
    assert fd.zigzag_cu_seqlens(cu, world).tolist() == [c // world for c in cu]
    dense = torch.arange(2 * 6 * world).view(2, 6 * world)
    assert torch.equal(fd.zigzag_unshard([fd.zigzag_shard(dense, r, world) for r in range(world)]), dense)
    if world == 2:  # rank 0 of a 2-rank ring holds chunks 0 and 3 of a sequence cut in 4
        assert fd.zigzag_shard(dense, 0, 2)[0].tolist() == [0, 1, 2, 9, 10, 11]
        assert fd.zigzag_shard(dense, 1, 2)[0].tolist() == [3, 4, 5, 6, 7, 8]


def test_zigzag_shard_bad_length():
    with pytest.raises(ValueError, match="sequence 1 of cu_seqlens has length 6, not a multiple of 4"):
        fd.zigzag_rows([0, 8, 14], 0, 2)


def _args(total=8, causal=False):
    q = torch.randn(total, 2, 8)
    return dict(q=q, k=q[:, :1].clone(), v=q[:, :1].clone(), cu_seqlens=torch.tensor([0, total], dtype=torch.int32),
                causal=causal, kernel=fd.ReferenceKernel())


@pytest.mark.parametrize("change, error, match", [
    (dict(cu_seqlens=torch.tensor([0, 8])), TypeError, "cu_seqlens must be torch.int32, got torch.int64"),
    (dict(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)), ValueError, "rise from 0 to total = 8"),
    (dict(k=torch.randn(6, 1, 8)), ValueError, "k and v must hold q's 8 rows"),
    (dict(q=torch.randn(8, 2)), ValueError, "q must be 3-D"),
    (dict(k=torch.randn(8, 3, 8), v=torch.randn(8, 3, 8)), ValueError, "nheads_k dividing nheads 2"),
    (dict(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32), causal=True), ValueError,
     "sequence 0 has length 3"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])
def test_varlen_bad_arguments(change, error, match):
    args = _args()
    args.update(change)
    with pytest.raises(error, match=match):
        fd.ring_flash_attn_varlen_func(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens"), **args)


def test_dense_bad_arguments():
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match=r"k and v must have q's \(batch, seqlen\) \(1, 8\)"):
        fd.ring_flash_attn_func(q, q[:, :4], q[:, :4], kernel=fd.ReferenceKernel())
    with pytest.raises(ValueError, match="softmax_scale must be finite and > 0, got -1.0"):
        fd.ring_flash_attn_func(q, q, q, softmax_scale=-1.0, kernel=fd.ReferenceKernel())


def test_attention_bwd_ref_matches_autograd():
    """The backward formula with the block's own out / lse equals autograd of attention_ref (GQA,
    causal with seqlen_q < seqlen_k, dlse)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(2, 7, 2, 8, generator=gen, dtype=F64) for _ in range(2))
    dout, dlse = torch.randn(2, 5, 4, 8, generator=gen, dtype=F64), torch.randn(2, 4, 5, generator=gen, dtype=F64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, 0.3, True, compute_dtype=F64)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    got = attention_bwd_ref(dout, q, k, v, out.detach(), lse.detach(), dlse, 0.3, True, F64)
    for g, leaf in zip(got, leaves):
        assert torch.allclose(g, leaf.grad, atol=1e-12)


# ================================================================ the whole ring
# cases: (dense?, causal, dtype); varlen batches: global cu_seqlens (multiples of 2W), with an empty one
CASES = list(itertools.product([False, True], [False, True], [torch.float32, torch.bfloat16]))
NHEADS, NHEADS_K, HEADDIM = 4, 2, 16


def _case_id(case):
    dense, causal, dtype = case
    return f"{'dense' if dense else 'varlen'}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


def _inputs(case, world, seed):
    dense, causal, dtype = case
    gen = torch.Generator().manual_seed(seed)
    c = 2  # chunk length: every sequence is 2W chunks
    lengths = [2 * world * c] if dense else [2 * world * c, 0, 4 * world * c, 2 * world]
    total = sum(lengths)
    q = torch.randn(total, NHEADS, HEADDIM, generator=gen, dtype=F64)
    k, v = (torch.randn(total, NHEADS_K, HEADDIM, generator=gen, dtype=F64) for _ in range(2))
    dout = torch.randn(total, NHEADS, HEADDIM, generator=gen, dtype=F64)
    dlse = torch.randn(NHEADS, total, generator=gen, dtype=F64)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    if dense:
        batch = 2  # two dense sequences: (2, seqlen) rows of the same packed layout
        q, k, v, dout = (t.view(1, total, *t.shape[1:]).repeat(batch, 1, 1, 1) * (1 + 0.5 * torch.arange(
            batch, dtype=F64).view(batch, 1, 1, 1)) for t in (q, k, v, dout))
        dlse = dlse.view(NHEADS, 1, total).repeat(1, batch, 1).view(NHEADS, batch * total)
        cu = torch.arange(batch + 1, dtype=torch.int32) * total
        q, k, v, dout = (t.reshape(batch * total, *t.shape[2:]) for t in (q, k, v, dout))
    return q, k, v, dout, dlse, cu


def _single_process(q, k, v, dout, dlse, cu, causal, dtype, upcast):
    """(out, lse, dq, dk, dv) of one process: float64 (upcast) or PyTorch in `dtype`."""
    leaves = [t.to(F64 if upcast else dtype).clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_varlen_ref(*leaves, cu, cu, causal=causal, upcast=upcast, compute_dtype=F64)
    ((out.double() * dout).sum() + (torch.where(torch.isfinite(lse), lse.double(), 0.0) * dlse).sum()).backward()
    return out.detach(), lse.detach(), [leaf.grad for leaf in leaves]


def _ring_rank(case, q, k, v, dout, dlse, cu, rank, world, group):
    """This rank's (out, lse, dq, dk, dv) shards through the ring (ReferenceKernel in fp32)."""
    return _ring_rank_kernel(case, q, k, v, dout, dlse, cu, rank, world, group, fd.ReferenceKernel(torch.float32))


def _ring_rank_kernel(case, q, k, v, dout, dlse, cu, rank, world, group, kernel):
    dense, causal, dtype = case
    shard = [fd.zigzag_shard(t, rank, world, cu) for t in (q, k, v, dout)]
    dlse_l = fd.zigzag_shard(dlse.T, rank, world, cu).T
    leaves = [t.to(dtype).requires_grad_() for t in shard[:3]]
    if dense:
        batch = cu.numel() - 1
        seqlen = leaves[0].shape[0] // batch
        d4 = [t.view(batch, seqlen, *t.shape[1:]) for t in leaves]
        out, lse = fd.ring_flash_attn_func(*d4, causal=causal, return_lse=True, group=group, kernel=kernel)
        out, lse = out.reshape(batch * seqlen, *out.shape[2:]), lse.permute(1, 0, 2).reshape(NHEADS, -1)
    else:
        out, lse = fd.ring_flash_attn_varlen_func(*leaves, fd.zigzag_cu_seqlens(cu, world), causal=causal,
                                                  return_lse=True, group=group, kernel=kernel)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ((out.double() * shard[3]).sum() + (torch.where(torch.isfinite(lse), lse.double(), 0.0) * dlse_l).sum()).backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def _check_case(case, world, shards_by_rank, inputs):
    """The errors of the ring's gathered results, against float64, next to PyTorch's same-dtype."""
    dense, causal, dtype = case
    q, k, v, dout, dlse, cu = inputs
    ref = _single_process(q, k, v, dout, dlse, cu, causal, dtype, upcast=True)
    same = _single_process(q, k, v, dout, dlse, cu, causal, dtype, upcast=False)
    got = [fd.zigzag_unshard([s[i] if i != 1 else s[1].T for s in shards_by_rank], cu) for i in range(5)]
    got[1] = got[1].T
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    names = ("out", "lse", "dq", "dk", "dv")
    ref_all, same_all = [ref[0], ref[1]] + ref[2], [same[0], same[1]] + same[2]
    for name, g, r, s in zip(names, got, ref_all, same_all):
        err, base = max_abs_err(g, r), max_abs_err(s.to(r.dtype), r)
        assert err <= 2 * base + atol, (f"{_case_id(case)} W={world} {name}: ring error {err:.3g} > 2 x {base:.3g} "
                                        f"+ {atol}")


def _threaded_ring(case, world, inputs, rank_fn=None):
    """rank_fn(case, *inputs, rank, world, ring) (default _ring_rank) of every rank, each on its own
    thread over local_rings(world); the results by rank."""
    rank_fn = _ring_rank if rank_fn is None else rank_fn
    rings = fd.local_rings(world)
    results, errors = [None] * world, []

    def rank_main(r):
        try:
            results[r] = rank_fn(case, *inputs, r, world, rings[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("world", [1, 3])
def test_ring_threads(case, world):
    """W ranks emulated by threads of this process (local_rings): every code path of the ring
    without process start-up; world 1 is the plain call (no communication)."""
    inputs = _inputs(case, world, seed=world)
    _check_case(case, world, _threaded_ring(case, world, inputs), inputs)


def _backward_here_rank(case, q, k, v, dout, dlse, cu, rank, world, group):
    """This rank's gradients twice: autograd (torch.autograd.grad) and backward_here, from the door's
    own out / lse shapes (dense: 4-D out, (batch, nheads, seqlen) lse)."""
    dense, causal, dtype = case
    shard = [fd.zigzag_shard(t, rank, world, cu).to(dtype) for t in (q, k, v, dout)]
    dlse_l = fd.zigzag_shard(dlse.T, rank, world, cu).T.float()
    leaves = [t.clone().requires_grad_() for t in shard[:3]]
    kernel = fd.ReferenceKernel(torch.float32)
    if dense:
        batch = cu.numel() - 1
        seqlen = leaves[0].shape[0] // batch
        d4 = [t.view(batch, seqlen, *t.shape[1:]) for t in leaves]
        out, lse = fd.ring_flash_attn_func(*d4, causal=causal, return_lse=True, group=group, kernel=kernel)
        dout_l, dlse_l = shard[3].view(out.shape), dlse_l.reshape(NHEADS, batch, seqlen).permute(1, 0, 2)
    else:
        out, lse = fd.ring_flash_attn_varlen_func(*leaves, fd.zigzag_cu_seqlens(cu, world), causal=causal,
                                                  return_lse=True, group=group, kernel=kernel)
        dout_l = shard[3]
    here = [g.reshape(t.shape) for g, t in zip(fd.backward_here(out, dout_l, lse, dlse_l), leaves)]
    # then autograd through the same graph (backward_here's node call frees nothing)
    via_autograd = torch.autograd.grad([out, lse], leaves, [dout_l, dlse_l])
    return here, list(via_autograd)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("world", [1, 3])
def test_backward_here_equals_autograd(case, world):
    """backward_here (the ring's backward on the calling thread: what ranks emulated by threads on a
    GPU must use, autograd's one CUDA worker thread would deadlock them) gives autograd's gradients
    bitwise, both doors, with the lse gradient; each emulated rank runs both in turn."""
    inputs = _inputs(case, world, seed=11 + world)
    results = _threaded_ring(case, world, inputs, rank_fn=_backward_here_rank)
    for here, via in results:
        for g, r in zip(here, via):
            assert g.dtype == r.dtype and torch.equal(g, r)


def test_backward_here_bad_arguments():
    q = torch.randn(8, NHEADS, HEADDIM, requires_grad=True)
    k, v = (torch.randn(8, NHEADS_K, HEADDIM, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    out, lse = fd.ring_flash_attn_varlen_func(q, k, v, cu, return_lse=True, kernel=fd.ReferenceKernel(torch.float32))
    with pytest.raises(ValueError, match="does not come from ring_flash_attn"):
        fd.backward_here(q * 2, q)
    with pytest.raises(ValueError, match="dout must have out's shape"):
        fd.backward_here(out, out[:4])
    with pytest.raises(ValueError, match="pass lse and dlse together"):
        fd.backward_here(out, torch.ones_like(out), lse, None)


def test_ring_solo_without_process_group():
    """group=None without torch.distributed initialized: a ring of one rank."""
    case = (False, True, torch.float32)
    inputs = _inputs(case, 1, seed=7)
    _check_case(case, 1, [_ring_rank(case, *inputs, 0, 1, None)], inputs)


# ---------------------------------------------------------------- gloo, one process per rank
def _gloo_worker(rank, world, store_path, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        results = {}
        for i, case in enumerate(CASES):
            inputs = _inputs(case, world, seed=100 * world + i)  # the same inputs on every rank
            results[_case_id(case)] = _ring_rank(case, *inputs, rank, world, None)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def join_or_kill(ctx, timeout: float) -> None:
    """Wait for a torch.multiprocessing context's processes; a hang (a ring deadlock) fails after
    `timeout` seconds with the processes killed instead of blocking the test run."""
    import time

    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):  # re-raises a rank's exception
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"a ring of {len(ctx.processes)} processes did not finish within {timeout} s")


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """{world: [rank results]} for gloo rings of 2, 3 and 4 processes (forked: no re-import of torch;
    the store is a file, so no port is taken)."""
    import torch.multiprocessing as mp

    found = {}
    for world in (2, 3, 4):
        d = tmp_path_factory.mktemp(f"gloo{world}")
        ctx = mp.start_processes(_gloo_worker, args=(world, str(d / "store"), str(d)), nprocs=world, join=False,
                                 start_method="fork")
        join_or_kill(ctx, timeout=120)
        found[world] = [torch.load(d / f"rank{r}.pt") for r in range(world)]
    return found


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_gloo(gloo_results, world, case):
    """Forward (out, lse) and backward (dq, dk, dv, with a loss on lse too) of a gloo ring of `world`
    processes, gathered, against single-process attention."""
    inputs = _inputs(case, world, seed=100 * world + CASES.index(case))
    _check_case(case, world, [r[_case_id(case)] for r in gloo_results[world]], inputs)


# ---------------------------------------------------------------- the default kernel's plumbing
@pytest.fixture
def flash4_on_cpu(monkeypatch, cpu_kernels):
    """flash4's host forward / backward on CPU tensors: the forward launch is the reference
    (cpu_kernels); the backward launch applies the kernels' formula to the out / lse / dlse it is
    given (the ring passes the merged ones, which cpu_kernels' recomputing stand-in would ignore)."""
    from flash4 import backward

    calls = []

    def launch(request, dout, out, lse, lse_split, dlse, dq, dk, dv, delta=None):
        seq = request.seq
        grads = fd.ReferenceKernel(torch.float32).backward(
            dout, request.q, request.k, request.v, out, lse, dlse, seq.cu_seqlens_q, seq.cu_seqlens_k,
            seq.max_seqlen_q, seq.max_seqlen_k, request.score.softmax_scale, request.mask.causal)
        for g, buf in zip(grads, (dq, dk, dv)):
            buf.copy_(g)
        calls.append(dict(causal=request.mask.causal, dlse=dlse is not None, headdim=request.q.shape[-1]))

    monkeypatch.setattr(backward, "launch", launch)
    return calls


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dense", [False, True])
def test_flash4_kernel_plumbing(flash4_on_cpu, cpu_kernels, dense, causal):
    """The default Flash4Kernel (flash_attn_varlen_func with return_lse, flash4.backward.run with the
    ring's out / lse / dlse) in a 3-rank thread ring, bf16 CPU tensors, the launches stood in for;
    head dim 16 runs padded to 64 (flash4.headdim) in the backward as in the forward."""
    world, case = 3, (dense, causal, torch.bfloat16)
    inputs = _inputs(case, world, seed=11)
    rings = fd.local_rings(world)
    results = [None] * world

    def rank_main(r):
        results[r] = _ring_rank_kernel(case, *inputs, r, world, rings[r], fd.Flash4Kernel())

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None for r in results), "a rank failed (see the thread's traceback above)"
    _check_case(case, world, results, inputs)
    assert len(cpu_kernels) == world * world and len(flash4_on_cpu) == world * world
    assert sum(c["causal"] for c in flash4_on_cpu) == (world if causal else 0)  # step 0 of each rank
    assert all(c["dlse"] and c["headdim"] == 64 for c in flash4_on_cpu)
    assert all(c["request"].q.shape[-1] == 64 for c in cpu_kernels)
