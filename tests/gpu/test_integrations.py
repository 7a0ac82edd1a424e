"""flash4 inside the PyTorch stack, on the GPU (marker gpu; skipped without CUDA; sm_90 only).

torch.compile: flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache compiled with
fullgraph=True (a graph break fails), also with dynamic=True over the sequence lengths (one frame
for several lengths), give exactly the eager results (the same kernels: deterministic backward,
so gradients are compared bitwise too); a tiny transformer trains under torch.compile.

The SDPA plug-in (flash4.integrations.sdpa): after activate_flash_attention_impl("flash4"),
F.scaled_dot_product_attention under the flash backend and torch.nn.attention.varlen.varlen_attn
run flash4's kernels (a spy on the plug-in's kernel calls proves it) and meet the accuracy criterion
of flash4.reference (err <= 2 x PyTorch same-dtype err + atol against float32) forward and
backward; torch.compile of SDPA under the plug-in equals eager; unsupported inputs raise;
restore_flash_attention_impl() gives the ops back to PyTorch (the spy sees no more calls).
Kernel configs are shared between tests (head dim 128, bf16) to keep the compile time modest.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flash4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash4.reference import LSE_ATOL, OUT_ATOL, attention_ref, attention_varlen_ref, max_abs_err

from gpu_helpers import BF16, DEV, GRAD_ATOL, I32, cu_seqlens as _cu

D = 128


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("inductor")


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _equal(a, b, what):
    assert a.shape == b.shape and torch.equal(a, b), f"{what}: compiled != eager (max diff " \
        f"{(a.float() - b.float()).abs().max().item():.3e})"


# ================================================================ torch.compile of the public functions
def _dense_loss(q, k, v, dout):
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, deterministic=True)
    return (out.float() * dout).sum() + lse.sum(), out, lse


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_flash_attn_func_matches_eager(dynamic):
    """Forward and backward (out and lse in the loss) through flash4::fwd / flash4::bwd under
    torch.compile(fullgraph=True) equal eager bitwise; dynamic=True serves several seqlens from one
    frame."""
    counter = _counter()
    compiled = torch.compile(_dense_loss, fullgraph=True, dynamic=dynamic, backend=counter)
    gen = torch.Generator(device=DEV).manual_seed(0)
    # unequal lengths first: dynamic=True duck-sizes equal sizes of the first call into one symbol
    for sq, sk in ((384, 512), (200, 333), (256, 256)):
        q = torch.randn(2, sq, 8, D, device=DEV, dtype=BF16, generator=gen)
        k, v = (torch.randn(2, sk, 2, D, device=DEV, dtype=BF16, generator=gen) for _ in range(2))
        dout = torch.randn(2, sq, 8, D, device=DEV, generator=gen)
        results = []
        for fn in (_dense_loss, compiled):
            leaves = _leaves(q, k, v)
            loss, out, lse = fn(*leaves, dout)
            loss.backward()
            results.append([out, lse] + [t.grad for t in leaves])
        for name, e, c in zip(("out", "lse", "dq", "dk", "dv"), *results):
            _equal(c, e, f"{name} at ({sq}, {sk})")
    if dynamic:
        assert counter.frame_count == 1, f"dynamic=True compiled {counter.frame_count} frames for 3 seqlens"


def _varlen_loss(q, k, v, cu_q, cu_k, max_q):
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, None, causal=True, return_lse=True,
                                      deterministic=True)
    return out.float().square().sum() + lse.sum(), out, lse


def test_compile_flash_attn_varlen_func_matches_eager():
    """flash4::varlen_fwd / varlen_bwd under torch.compile(fullgraph=True, dynamic=True): equal to
    eager bitwise over batches of different totals; max_seqlen_q as an int and as a tensor (computed
    from the metadata inside the op), max_seqlen_k None (resolved by the backward op)."""
    counter = _counter()
    compiled = torch.compile(_varlen_loss, fullgraph=True, dynamic=True, backend=counter)
    gen = torch.Generator(device=DEV).manual_seed(1)
    for lengths, max_as_tensor in (([300, 0, 17, 512], False), ([1, 640, 129], False), ([77, 200, 5, 5, 90], True)):
        cu = _cu(lengths)
        total = sum(lengths)
        q = torch.randn(total, 8, D, device=DEV, dtype=BF16, generator=gen)
        k, v = (torch.randn(total, 2, D, device=DEV, dtype=BF16, generator=gen) for _ in range(2))
        max_q = torch.tensor(max(lengths)) if max_as_tensor else max(lengths)
        results = []
        for fn in (_varlen_loss, compiled):
            leaves = _leaves(q, k, v)
            loss, out, lse = fn(*leaves, cu, cu, max_q)
            loss.backward()
            results.append([out, lse] + [t.grad for t in leaves])
        for name, e, c in zip(("out", "lse", "dq", "dk", "dv"), *results):
            _equal(c, e, f"{name} for lengths {lengths}")
    assert counter.frame_count <= 2  # an int max_seqlen may specialize once before it turns dynamic


def test_compile_flash_attn_with_kvcache_matches_eager():
    """flash4::kvcache (appends to the caches in place) under torch.compile(fullgraph=True): the same
    out / lse and the same caches as eager, over two decode steps."""

    def decode(q, k_cache, v_cache, k, v, seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, seqlens, causal=True, return_lse=True)

    compiled = torch.compile(decode, fullgraph=True)
    gen = torch.Generator(device=DEV).manual_seed(2)
    caches = [torch.randn(3, 1024, 2, D, device=DEV, dtype=BF16, generator=gen) for _ in range(2)]
    eager_caches, compiled_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    seqlens = torch.tensor([5, 700, 1000], dtype=I32, device=DEV)
    for step in range(2):
        q = torch.randn(3, 1, 8, D, device=DEV, dtype=BF16, generator=gen)
        k, v = (torch.randn(3, 1, 2, D, device=DEV, dtype=BF16, generator=gen) for _ in range(2))
        out_e, lse_e = decode(q, *eager_caches, k, v, seqlens)
        out_c, lse_c = compiled(q, *compiled_caches, k, v, seqlens)
        _equal(out_c, out_e, f"out at step {step}")
        _equal(lse_c, lse_e, f"lse at step {step}")
        for name, c, e in zip(("k_cache", "v_cache"), compiled_caches, eager_caches):
            _equal(c, e, f"{name} after step {step} (the in-place append)")
        seqlens = seqlens + 1


class _Block(nn.Module):
    def __init__(self, dim=256, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * heads * D, bias=False)
        self.proj = nn.Linear(heads * D, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, D).unbind(2)  # strided views
        x = x + self.proj(flash_attn_func(q, k, v, causal=True).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class _TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(_Block(dim), _Block(dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def test_compiled_training_step_tiny_model():
    """A 2-layer transformer using flash_attn_func trains under torch.compile(fullgraph=True): the
    first loss and gradients agree with eager, and the loss falls over a few AdamW steps."""
    torch.manual_seed(0)
    eager = _TinyLM().to(DEV, BF16)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    tokens = torch.randint(0, 64, (4, 257), device=DEV)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_of(m):
        return F.cross_entropy(m(inputs).float().reshape(-1, 64), targets.reshape(-1))

    loss_e, loss_c = loss_of(eager), loss_of(compiled)
    loss_e.backward()
    loss_c.backward()
    assert abs(loss_c.item() - loss_e.item()) <= 2e-2 * loss_e.item()
    for (name, p_e), p_c in zip(eager.named_parameters(), model.parameters()):
        scale = p_e.grad.float().abs().max().item()
        assert (p_c.grad.float() - p_e.grad.float()).abs().max().item() <= 5e-2 * scale + 1e-3, name
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(compiled)
        loss.backward()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


# ================================================================ the SDPA plug-in
class _Spy:
    """Counts the plug-in's kernel calls (by method name) and forwards them to flash4."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return call


@pytest.fixture
def flash4_sdpa(monkeypatch):
    """flash4 registered and active as torch's flash-attention implementation, with a spy on its
    kernel calls; restored afterwards whatever happens."""
    import torch.nn.attention as attention

    from flash4.integrations import sdpa

    if not sdpa.available():
        pytest.skip(f"torch {torch.__version__} has no flash-attention plug-in registry")
    spy = _Spy(sdpa._KERNELS)
    monkeypatch.setattr(sdpa, "_KERNELS", spy)
    sdpa.register()
    attention.activate_flash_attention_impl("flash4")
    try:
        yield spy
    finally:
        attention.restore_flash_attention_impl()


def _flash_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _bshd_inputs(b, sq, sk, h, hk, seed):
    """q, k, v in BSHD memory (as models make them) and the BHSD views SDPA takes."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    bshd = [torch.randn(b, s, n, D, device=DEV, dtype=BF16, generator=gen) for s, n in ((sq, h), (sk, hk), (sk, hk))]
    return bshd


def _check(name, got, ref, pt, atol):
    err, pt_err = max_abs_err(got.float(), ref.float()), max_abs_err(pt.float(), ref.float())
    assert err <= 2 * pt_err + atol, f"{name}: err {err:.3e} > 2 * PyTorch err {pt_err:.3e} + {atol}"


def _ref_with_grads(q, k, v, dout, causal, upcast):
    leaves = _leaves(q, k, v)
    out, _ = attention_ref(*leaves, None, causal, upcast=upcast)
    (out.float() * dout.float()).sum().backward()
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("causal, sq, sk, h, hk", [(True, 512, 512, 8, 8), (False, 300, 777, 8, 2)],
                         ids=["causal", "gqa-nonsquare"])
def test_sdpa_flash_backend_runs_flash4(flash4_sdpa, causal, sq, sk, h, hk):
    q, k, v = _bshd_inputs(2, sq, sk, h, hk, seed=3)
    dout = torch.randn(2, sq, h, D, device=DEV, dtype=BF16)
    leaves = _leaves(q, k, v)
    with _flash_backend():
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal,
                                             enable_gqa=h != hk)
    (out.float() * dout.transpose(1, 2).float()).sum().backward()
    assert flash4_sdpa.calls == ["dense_error", "dense_forward", "dense_error", "dense_backward"]
    out_ref, grads_ref = _ref_with_grads(q, k, v, dout, causal, upcast=True)
    out_pt, grads_pt = _ref_with_grads(q, k, v, dout, causal, upcast=False)
    _check("out", out.transpose(1, 2), out_ref, out_pt, OUT_ATOL)
    for name, leaf, gr, gp in zip(("dq", "dk", "dv"), leaves, grads_ref, grads_pt):
        _check(name, leaf.grad, gr, gp, GRAD_ATOL)


def test_sdpa_under_compile_equals_eager(flash4_sdpa):
    """torch.compile of SDPA with flash4 active: the graph's aten flash ops (laid out by torch's meta
    functions) run flash4 and give the eager plug-in's results."""

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    q, k, v = _bshd_inputs(2, 512, 512, 8, 8, seed=4)
    dout = torch.randn_like(q)
    results = []
    for fn in (attn, torch.compile(attn, fullgraph=True)):
        leaves = _leaves(q, k, v)
        with _flash_backend():  # traced under it: the graph holds the flash ops
            out = fn(*leaves)
        out.backward(dout)
        results.append([out] + [t.grad for t in leaves])
    assert "dense_forward" in flash4_sdpa.calls and "dense_backward" in flash4_sdpa.calls
    for name, e, c in zip(("out", "dq", "dk", "dv"), *results):
        # same kernels and inputs; the non-deterministic dQ accumulation allows rounding noise
        assert torch.allclose(c.float(), e.float(), atol=2e-2 if name == "dq" else 0, rtol=0), name


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (16, 0), (40, 7)], ids=["causal", "full", "local", "local2"])
def test_varlen_attn_runs_flash4(flash4_sdpa, window):
    """torch.nn.attention.varlen.varlen_attn forward (LSE (H, T_q)) and backward through the plug-in,
    sliding windows included (flash4's local kernels; every sequence has Sq == Sk, where flash-attn's
    rule and flash4's agree)."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    lengths = [300, 1, 0, 513, 64]
    cu = _cu(lengths)
    total = sum(lengths)
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, k, v = (torch.randn(total, 4, D, device=DEV, dtype=BF16, generator=gen) for _ in range(3))
    dout = torch.randn_like(q)
    leaves = _leaves(q, k, v)
    out, lse = varlen_attn(*leaves, cu, cu, max(lengths), max(lengths), return_aux=AuxRequest(lse=True),
                           window_size=window)
    assert lse.shape == (4, total) and lse.dtype == torch.float32
    (out.float() * dout.float()).sum().backward()
    assert "varlen_forward" in flash4_sdpa.calls and "varlen_backward" in flash4_sdpa.calls
    refs = []
    for upcast in (True, False):
        ref_leaves = _leaves(q, k, v)
        o, l = attention_varlen_ref(*ref_leaves, cu, cu, upcast=upcast, window_size=window)
        (o.float() * dout.float()).sum().backward()
        refs.append((o, l, [t.grad for t in ref_leaves]))
    (o_ref, l_ref, g_ref), (o_pt, l_pt, g_pt) = refs
    _check("out", out, o_ref, o_pt, OUT_ATOL)
    _check("lse", lse, l_ref, l_pt, LSE_ATOL)
    for name, leaf, gr, gp in zip(("dq", "dk", "dv"), leaves, g_ref, g_pt):
        _check(name, leaf.grad, gr, gp, GRAD_ATOL)


def test_unsupported_inputs_raise(flash4_sdpa):
    q, k, v = (t.transpose(1, 2) for t in _bshd_inputs(1, 64, 64, 2, 2, seed=6))
    with _flash_backend(), pytest.raises(RuntimeError, match="flash4 SDPA plug-in.*dropout"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    q72 = q[..., :72].contiguous()  # a head dim flash4 lacks (72: SDPA passes it unpadded)
    with _flash_backend(), pytest.raises(RuntimeError, match="flash4 SDPA plug-in.*headdim 72"):
        F.scaled_dot_product_attention(q72, q72, q72)


@pytest.mark.parametrize("d", [80, 48])
def test_sdpa_headdim16_runs_flash4(flash4_sdpa, d):
    """On sm_90 the plug-in serves the multiples of 16 up to 128 on their own kernels
    (FLASH4_HEADDIM16, flash4.config.kernel_headdims): SDPA at d80 / d48, forward and backward,
    against the float32 reference."""
    gen = torch.Generator(device=DEV).manual_seed(8)
    q, k, v, dout = (torch.randn(2, 300, 4, d, device=DEV, dtype=BF16, generator=gen) for _ in range(4))
    leaves = _leaves(q, k, v)
    with _flash_backend():
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True)
    (out.float() * dout.transpose(1, 2).float()).sum().backward()
    assert flash4_sdpa.calls == ["dense_error", "dense_forward", "dense_error", "dense_backward"]
    out_ref, grads_ref = _ref_with_grads(q, k, v, dout, True, upcast=True)
    out_pt, grads_pt = _ref_with_grads(q, k, v, dout, True, upcast=False)
    _check("out", out.transpose(1, 2), out_ref, out_pt, OUT_ATOL)
    for name, leaf, gr, gp in zip(("dq", "dk", "dv"), leaves, grads_ref, grads_pt):
        _check(name, leaf.grad, gr, gp, GRAD_ATOL)


def test_restore_gives_the_ops_back(flash4_sdpa):
    """After restore_flash_attention_impl() SDPA's flash backend is PyTorch's own again: flash4 is
    not called, and the result is still right."""
    import torch.nn.attention as attention

    q, k, v = (t.transpose(1, 2) for t in _bshd_inputs(1, 128, 128, 4, 4, seed=7))
    with _flash_backend():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert flash4_sdpa.calls.count("dense_forward") == 1
    attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None
    with _flash_backend():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert flash4_sdpa.calls.count("dense_forward") == 1  # PyTorch's kernel served this one
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True)
    assert max_abs_err(out.transpose(1, 2).float(), ref) < 2e-2
    attention.activate_flash_attention_impl("flash4")  # the fixture restores it again
