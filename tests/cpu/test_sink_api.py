"""The public `learnable_sink` keyword (attention sinks, gpt-oss; issue 10 item 3) without a GPU:
validation on every entry point (TypeError for non-tensors / dtypes, ValueError for shape / device,
messages naming learnable_sink), the plumbing to the kernels' host side (mocked by the reference), and
dsink (flash4.autograd.sink_grad) against autograd through flash4.reference. Kernels: tests/gpu/test_sink.py."""

import inspect

import pytest
import torch
from cpu_helpers import ENTRY_POINTS, kv_args, qkv, varlen_args

import flash4
from flash4 import forward
from flash4.autograd import sink_grad, varlen_row_mask
from flash4.reference import attention_ref, attention_varlen_ref, kvcache_ref
from flash4.request import Request

BF16, I32 = torch.bfloat16, torch.int32


@pytest.mark.parametrize("func", [flash4.flash_attn_func, flash4.flash_attn_varlen_func,
                                  flash4.flash_attn_with_kvcache])
def test_sink_keyword(func):
    param = inspect.signature(func).parameters["learnable_sink"]
    assert param.default is None and param.kind is inspect.Parameter.KEYWORD_ONLY
    assert "gpt-oss" in func.__doc__ and "learnable_sink" in func.__doc__


def _raises(entry, exc, sink):
    func, support, check, kwargs = ENTRY_POINTS[entry]
    with pytest.raises(exc) as info:
        func(**kwargs(), learnable_sink=sink)
    message = str(info.value)
    assert "learnable_sink" in message, message
    with pytest.raises(exc) as info:
        check(**kwargs(), learnable_sink=sink)
    assert str(info.value) == message
    assert support(**kwargs(), learnable_sink=sink) == message
    return message


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("sink", [1.0, [0.0] * 4, "s", torch.zeros(4, dtype=torch.int32),
                                  torch.zeros(4, dtype=torch.float64)], ids=repr)
def test_sink_type_errors(entry, sink):
    _raises(entry, TypeError, sink)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("sink", [torch.zeros(2), torch.zeros(5), torch.zeros(()), torch.zeros(1, 4),
                                  torch.zeros(4, device="meta")], ids=lambda t: f"{tuple(t.shape)}-{t.device}")
def test_sink_value_errors(entry, sink):
    message = _raises(entry, ValueError, sink)
    assert ("shape" in message) if sink.device.type == "cpu" else ("meta" in message)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
def test_valid_sink_only_fails_on_device(entry, dtype):
    func, support, check, kwargs = ENTRY_POINTS[entry]
    message = support(**kwargs(), learnable_sink=torch.zeros(4, dtype=dtype))
    assert message is not None and "cpu" in message and "learnable_sink" not in message


# ================================================================ dsink
def _dense_case(sink_scale=1.0, causal=True):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, s, h, 32, generator=gen, dtype=torch.float64) for s, h in ((5, 4), (3, 2), (3, 2)))
    sink = (torch.randn(4, generator=gen, dtype=torch.float64) * sink_scale)
    return q, k, v, sink


@pytest.mark.parametrize("sink_scale", [1.0, 30.0])
@pytest.mark.parametrize("use_lse", [False, True])
def test_sink_grad_matches_reference_dense(sink_scale, use_lse):
    q, k, v, sink = _dense_case(sink_scale)
    sink = sink.requires_grad_()
    out, lse = attention_ref(q, k, v, causal=True, learnable_sink=sink, upcast=False)  # rows 0..1 see no key
    gen = torch.Generator().manual_seed(4)
    dout = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    dlse = torch.randn(lse.shape, generator=gen, dtype=lse.dtype) if use_lse else None
    loss = (out * dout).sum() + ((lse * dlse).sum() if use_lse else 0)
    (expected,) = torch.autograd.grad(loss, sink)
    got = sink_grad(sink.detach(), out.detach(), dout, lse.detach(), dlse, 2)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_sink_grad_varlen_excludes_rows_outside_sequences():
    cu = torch.tensor([0, 3, 3, 7], dtype=I32)
    seqused = torch.tensor([2, 0, 4], dtype=I32)
    mask = varlen_row_mask(cu, seqused, 9)
    assert mask.tolist() == [True, True, False, True, True, True, True, False, False]
    assert varlen_row_mask(cu, None, 9).tolist() == [True] * 7 + [False] * 2
    h, t = 2, 9
    out, dout = torch.randn(t, h, 8), torch.randn(t, h, 8)
    lse = torch.full((h, t), float("-inf"))  # rows outside: exp(sink - lse) = inf, must be excluded
    lse[:, mask] = 0.5
    sink = torch.zeros(h, dtype=BF16)
    got = sink_grad(sink, out, dout, lse, None, 1, mask)
    assert got.dtype == BF16 and torch.isfinite(got.float()).all()
    delta = (out * dout).sum(-1).t()[:, mask]
    torch.testing.assert_close(got.float(), (-(torch.exp(torch.tensor(-0.5)) * delta).sum(1)).to(BF16).float())


# ================================================================ plumbing (kernels mocked)
def test_dense_forward_passes_sink_to_config_and_runner(monkeypatch):
    import flash4.compile.cache as cache

    seen = {}

    def fake_runner(cfg):
        seen["cfg"] = cfg

        def run(q, k, v, out, lse, scale, lse_split, **kwargs):
            seen["run"] = kwargs
            out.zero_()
            lse.zero_()
        return run

    monkeypatch.setattr(cache, "get_fwd_runner", fake_runner)
    monkeypatch.setenv("FLASH4_ARCH", "90")
    q, k, v = qkv()
    sink = torch.randn(4, dtype=BF16)
    forward.run(Request.dense(q, k, v, 0.1, False, learnable_sink=sink))
    assert seen["cfg"].sink is True
    passed = seen["run"]["sink"]
    assert passed.dtype == torch.float32 and passed.is_contiguous() and torch.equal(passed, sink.float())
    forward.run(Request.dense(q, k, v, 0.1, False))
    assert seen["cfg"].sink is False and "sink" not in seen["run"]


def test_empty_keys_give_lse_equal_to_sink():
    q, k, v = qkv(sk=0)
    sink = torch.tensor([1.0, -2.0, 30.0, -30.0])
    out, lse = forward.run(Request.dense(q, k, v, 0.1, False, learnable_sink=sink))
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sink.view(1, 4, 1).expand_as(lse))


def test_varlen_routes_sink_and_dsink(cpu_kernels, fake_backward):
    args = varlen_args((3, 0, 5), (4, 2, 6))
    sink = torch.tensor([0.5, -1.0, 3.0, 30.0])
    h = args["q"].shape[1]
    sink = sink[:h] if h <= 4 else torch.randn(h)
    out, lse = flash4.flash_attn_varlen_func(**args, causal=True, learnable_sink=sink, return_lse=True)
    assert torch.equal(cpu_kernels[-1]["learnable_sink"], sink.float())
    ref, ref_lse = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                        causal=True, learnable_sink=sink)
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)

    s = sink.clone().requires_grad_()
    out, lse = flash4.flash_attn_varlen_func(**args, causal=True, learnable_sink=s, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    s_ref = sink.clone().double().requires_grad_()
    o, l = attention_varlen_ref(args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                causal=True, learnable_sink=s_ref)
    (o.double().sum() + l.double().sum()).backward()
    torch.testing.assert_close(s.grad.double(), s_ref.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_routes_sink_to_decode(cpu_kernels, paged):  # noqa: F811
    args = kv_args(b=3, sq=2, s_cache=40, s_new=1, paged=paged)
    h = args["q"].shape[2]
    sink = torch.linspace(-3, 3, h)
    seqlens = args["cache_seqlens"].clone()
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=True, learnable_sink=sink, return_lse=True)
    assert cpu_kernels[0]["decode"] and torch.equal(cpu_kernels[0]["learnable_sink"], sink)
    ref, ref_lse = kvcache_ref(args["q"], args["k_cache"], args["v_cache"], seqlens + 1, args.get("page_table"),
                               causal=True, learnable_sink=sink)
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)


def test_ops_take_a_sink():
    for name in ("fwd", "varlen_fwd", "kvcache"):
        arg = getattr(torch.ops.flash4, name).default._schema.arguments[-1]
        assert arg.name == "learnable_sink" and arg.default_value is None
