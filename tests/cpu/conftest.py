"""Fixtures of the CPU tests: flash4's kernels replaced by flash4.reference (there is no GPU here).

The boundary is one function per pass: flash4.forward.launch(request, out, lse, lse_split, rows) and
flash4.backward.launch(request, dout, out, lse, lse_split, dlse, dq, dk, dv), which the host
pipeline calls once the request is validated, the buffers exist and the empty cases are answered.

    cpu_kernels    CPU tensors through the device / SM checks; both launches run the reference (the
                   forward checking launch's contract); returns the forward launches (a list of dicts,
                   `.backward` the backward launches)
    fake_backward  flash4.backward.launch writes dq = 1, dk = 2, dv = 3; returns a dict of what it got
    unchecked      flash4.validate's dense checks off (float32 CPU tensors through flash_attn_func)

Shared plain helpers (inputs, brute force, traced ops) are in cpu_helpers.py.
"""

from __future__ import annotations

import pytest
import torch

from flash4 import backward, forward, validate
from flash4.config import LOG2E
from flash4.geometry import Band, window_sides
from flash4.reference import attention_ref, attention_varlen_ref, kvcache_ref, varlen_row_mask

I32 = torch.int32


@pytest.fixture(autouse=True)
def _compile_without_jit_engine(request):
    """Kernels compiled by the CPU tests are inspected (cubin, SASS, PTX, exported objects), never
    run: they are compiled as the disk cache compiles a miss, without the CuTe DSL's in-process JIT
    engine (flash4.compile.jit; ~0.35 s less per compile). A test marked `jit_engine` gets the
    engine (the default outside the tests)."""
    if request.node.get_closest_marker("jit_engine"):
        yield
        return
    from flash4.compile.jit import export_only

    with export_only():
        yield


class Calls(list):
    """The forward launches (one dict each); .backward: the backward launches."""

    def __init__(self):
        super().__init__()
        self.backward = []


def _check_launch_contract(request, out, lse, lse_split) -> None:
    """What flash4.forward.launch may assume about its arguments (run() and validate guarantee it)."""
    q, mask, score, seq = request.q, request.mask, request.score, request.seq
    assert seq.layout in ("dense", "varlen", "paged", "decode"), seq.layout
    assert type(score.softmax_scale) is float and type(score.softcap) is float and score.softcap >= 0
    assert isinstance(mask.causal, bool)
    assert isinstance(mask.window_size, Band)  # literal sides, None = unbounded
    assert all(side is None or type(side) is int for side in mask.window_size)
    assert mask.window == window_sides(mask.window_size, mask.causal)
    assert score.sink is None or tuple(score.sink.shape) == (request.nheads,)
    sink = score.kernel_sink()
    assert sink is None or (sink.dtype == torch.float32 and sink.is_contiguous())
    assert out is not None and lse is not None and lse.dtype == torch.float32 and lse.is_contiguous()
    if seq.packed:
        assert isinstance(seq.max_seqlen_q, int)
        for t in (seq.cu_seqlens_q, seq.cu_seqlens_k, seq.seqused_q, seq.seqused_k, seq.page_table):
            assert t is None or (t.dtype == I32 and t.is_contiguous() and t.device == q.device)
        assert (seq.cu_seqlens_k is None) == seq.paged
        assert not seq.paged or seq.seqused_k is not None
        assert lse.shape == (q.shape[1], q.shape[0]) and out.shape == q.shape[:2] + (request.headdim_v,)
        cu = seq.cu_seqlens_q
        lengths = (seq.seqused_q if seq.seqused_q is not None else cu[1:] - cu[:-1]).tolist()
        assert seq.max_seqlen_q >= max(lengths + [0])
    elif seq.decode:
        assert seq.seqused_k.dtype == I32 and seq.seqused_k.shape == (q.shape[0],)
        assert isinstance(request.cache.num_splits, int)
        assert out.shape == q.shape[:3] + (request.headdim_v,) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    else:
        assert out.shape == q.shape[:3] + (request.headdim_v,) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    if lse_split is not None:
        assert lse_split.shape == (2,) + tuple(lse.shape) and lse_split.dtype == torch.float32


def reference_forward(calls: Calls):
    """A stand-in for flash4.forward.launch: the reference, written where the kernels write."""

    def launch(request, out, lse, lse_split=None, rows=None):
        seq_rows = rows  # launch's `rows` (the local `rows` below is the reference's row mask)
        q, k, v, mask, score, seq = request.q, request.k, request.v, request.mask, request.score, request.seq
        packed_out = None
        if seq_rows is not None:  # a varlen door's out / lse, written by flash4.forward.decode_slot_rows' map
            assert seq.decode and lse_split is None
            assert seq_rows.dtype == I32 and seq_rows.is_contiguous() and seq_rows.shape == (q.shape[0] + 1,)
            assert out.shape == (lse.shape[1], q.shape[2], request.headdim_v) and lse.shape[0] == q.shape[2]
            packed_out = out, lse
            out = torch.full(q.shape[:3] + (request.headdim_v,), float("nan"), dtype=out.dtype)
            lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"))
        _check_launch_contract(request, out, lse, lse_split)
        sink = score.kernel_sink()
        kw = dict(window_size=mask.window_size, softcap=score.softcap, learnable_sink=sink)
        rows = slice(None)
        if seq.decode:
            o, l = kvcache_ref(q, k, v, seq.seqused_k, seq.page_table, softmax_scale=score.softmax_scale,
                               causal=mask.causal, **kw)
            out.copy_(o)
            lse.copy_(l)
        elif seq.packed:
            o, l = attention_varlen_ref(q, k, v, seq.cu_seqlens_q, seq.cu_seqlens_k, seq.seqused_q, seq.seqused_k,
                                        seq.page_table, score.softmax_scale, mask.causal, **kw)
            rows = varlen_row_mask(seq.cu_seqlens_q, q.shape[0], seq.seqused_q)
            out[rows] = o[rows].to(out.dtype)
            lse[:, rows] = l[:, rows]
        else:
            o, l = attention_ref(q, k, v, score.softmax_scale, mask.causal, **kw)
            out.copy_(o.to(out.dtype))
            lse.copy_(l)
        if lse_split is not None:
            lse_split[0][..., rows] = l[..., rows] * LOG2E
            lse_split[1][..., rows] = 0.0
        if packed_out is not None:
            from flash4.forward import decode_slot_rows

            for b, slots in enumerate(decode_slot_rows(seq_rows.tolist(), q.shape[1])):
                for s, r in enumerate(slots):
                    if r is not None:
                        packed_out[0][r] = out[b, s]
                        packed_out[1][:, r] = lse[b, :, s]
        calls.append(dict(layout=seq.layout, request=request, causal=mask.causal, window_size=mask.window_size,
                          window=mask.window, softcap=score.softcap, learnable_sink=sink, k=k,
                          cu_seqlens_k=seq.cu_seqlens_k, max_seqlen_q=seq.max_seqlen_q, page_table=seq.page_table,
                          seqused_k=None if seq.seqused_k is None else seq.seqused_k.clone(),
                          num_splits=request.cache.num_splits if request.cache is not None else None,
                          rows=seq_rows, **({"decode": True} if seq.decode else {})))

    return launch


def reference_backward(calls: Calls):
    """A stand-in for flash4.backward.launch: dq, dk, dv by autograd through the reference (dlse is
    added to the loss where every lse is finite); delta (a sink needs a gradient) = rowsum(dout * O) of
    the float32 output, as the kernel's sum_j P dP (P from the forward's lse, which holds the sink's
    share; the backward request carries no sink), 0 outside every sequence."""

    def launch(request, dout, out, lse, lse_split, dlse, dq, dk, dv, delta=None):
        q, k, v, mask, score, seq = request.q, request.k, request.v, request.mask, request.score, request.seq
        assert not seq.paged and isinstance(dq, torch.Tensor) and dq.shape == q.shape
        sink = score.kernel_sink()
        kw = dict(window_size=mask.window_size, softcap=score.softcap, learnable_sink=sink)
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            if seq.packed:
                assert isinstance(seq.max_seqlen_q, int) and isinstance(seq.max_seqlen_k, int)
                o, l = attention_varlen_ref(*leaves, seq.cu_seqlens_q, seq.cu_seqlens_k, seq.seqused_q, seq.seqused_k,
                                            None, score.softmax_scale, mask.causal, **kw)
                rows = varlen_row_mask(seq.cu_seqlens_q, q.shape[0], seq.seqused_q)
                loss = (o[rows] * dout.float()[rows]).sum()
            else:
                o, l = attention_ref(*leaves, score.softmax_scale, mask.causal, **kw)
                loss = (o * dout.float()).sum()
            if dlse is not None and torch.isfinite(l).all():
                loss = loss + (l * dlse.float()).sum()
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        for g, buf in zip(grads, (dq, dk, dv)):
            buf.copy_(torch.zeros_like(buf) if g is None else g.to(buf.dtype))
        if delta is not None:  # the kernel's sum_j P dP, P = exp(S - lse) with the forward's lse (sink included)
            l = l.detach()
            share = torch.exp(torch.where(torch.isfinite(l), l - lse.float(), torch.full_like(l, float("-inf"))))
            d = (o.detach() * dout.float()).sum(-1).transpose(-1, -2) * share
            if seq.packed:
                d = torch.where(rows[None], d, torch.zeros((), dtype=d.dtype))
            delta.copy_(d)
        calls.backward.append(dict(request=request, causal=mask.causal, window_size=mask.window_size,
                                   window=mask.window, softcap=score.softcap, deterministic=request.deterministic,
                                   dlse=dlse, max_seqlen_q=seq.max_seqlen_q, max_seqlen_k=seq.max_seqlen_k))

    return launch


@pytest.fixture
def cpu_device(monkeypatch):
    """CPU tensors through flash4.validate's device and SM checks (the relative checks stay)."""
    device_problem = validate._device_problem

    def relative_only(q, others, dense=False):
        problem = device_problem(q, others, dense)
        return None if problem is not None and problem[1].startswith("q is on cpu") else problem

    monkeypatch.setattr(validate, "_device_problem", relative_only)
    monkeypatch.setattr(validate, "_arch_problem", lambda q, causal, door=None: None)


@pytest.fixture
def cpu_kernels(monkeypatch, cpu_device):
    """Let CPU tensors through the device check and run the reference in place of the kernels
    (forward and backward); returns the forward launches (`.backward`: the backward launches)."""
    import inspect

    calls = Calls()
    fake_fwd, fake_bwd = reference_forward(calls), reference_backward(calls)
    # the stand-ins take the real launches' arguments
    assert list(inspect.signature(forward.launch).parameters) == list(inspect.signature(fake_fwd).parameters)
    assert list(inspect.signature(backward.launch).parameters) == list(inspect.signature(fake_bwd).parameters)
    monkeypatch.setattr(forward, "launch", fake_fwd)
    monkeypatch.setattr(backward, "launch", fake_bwd)
    return calls


@pytest.fixture
def fake_backward(monkeypatch):
    """flash4.backward.launch replaced by dq = 1, dk = 2, dv = 3 (delta: rowsum(dout * out)); returns a dict of what the last
    call received (the request's parts, unique values of dout / dlse / lse_split)."""
    seen = {}

    def fake(request, dout, out, lse, lse_split, dlse, dq, dk, dv, delta=None):
        seq = request.seq
        seen.update(layout=seq.layout, max_seqlen_q=seq.max_seqlen_q, max_seqlen_k=seq.max_seqlen_k,
                    scale=request.score.softmax_scale, causal=request.mask.causal, det=request.deterministic,
                    window_size=request.mask.window_size, window=request.mask.window, softcap=request.score.softcap,
                    lse_shape=None if lse is None else tuple(lse.shape), split=None if lse_split is None else tuple(lse_split.shape),
                    split_values=None if lse_split is None else (lse_split[0].unique().tolist(),
                                                                 lse_split[1].unique().tolist()),
                    dlse=None if dlse is None else dlse.unique().tolist(), dout=dout.unique().tolist(),
                    seqused_k=seq.seqused_k)
        dq.fill_(1)
        dk.fill_(2)
        dv.fill_(3)
        if delta is not None:  # D from the 16-bit out (what the kernel's sum_j P dP approximates)
            delta.copy_((dout.float() * out.float()).sum(-1).transpose(-1, -2))

    monkeypatch.setattr(backward, "launch", fake)
    return seen


@pytest.fixture
def unchecked(monkeypatch):
    """flash4.validate's dense checks off: CPU (and float32) tensors through flash_attn_func."""
    monkeypatch.setattr(validate, "_problem", lambda *args: None)
