"""flash4.integrations.transformers on the CPU: registration with transformers' AttentionInterface /
AttentionMaskInterface, and what the attention function does with what the models pass.

The flash4 kernels need a GPU, so the seam `f4hf._KERNELS` is replaced by flash4.reference's
attention (same arguments; float32 allowed here): tiny randomly initialised Llama, Mistral (sliding
window), Gemma 2 (softcap, query_pre_attn_scalar scaling, alternating sliding layers) and
gpt-oss-style (sinks, alternating sliding layers, MoE with every expert active) models then run end
to end with attn_implementation="f4attn" in float32 and must give the eager implementation's logits
and gradients (padded batches, packed sequences, KV-cache decode, static cache, continuous
batching's paged path), and greedy generate() the same tokens. Separately: the argument mapping
(window w -> left w - 1, is_causal None -> module.is_causal, sinks, softcap, GQA unexpanded, BSHD
views), the real seam's calls into flash4.flash_attn_func / flash_attn_varlen_func (spied), and the
refusals (UnsupportedAttention).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flash4  # noqa: E402
import flash4.integrations.transformers as f4hf  # noqa: E402
import transformers  # noqa: E402
from flash4.reference import attention_ref, attention_varlen_ref, window_mask  # noqa: E402
from transformers import (AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig,  # noqa: E402
                          MistralConfig)
from transformers import masking_utils as mu  # noqa: E402

_TF_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])

NAME = f4hf.DEFAULT_NAME
ATOL = 2e-5  # float32 end to end (reference attention vs eager)
VOCAB = 1000


# ================================================================ the reference seam
class RefKernels:
    """flash4.reference in place of flash4's kernels (any device, float32 too); records each call."""

    def __init__(self, dtypes=(torch.bfloat16, torch.float16, torch.float32)):
        self.dtypes = dtypes
        self.calls = []

    @staticmethod
    def headdims():
        return f4hf._Flash4Kernels.headdims()

    def dense(self, q, k, v, *, softmax_scale, causal, window_size, softcap, learnable_sink, deterministic):
        self.calls.append(dict(kind="dense", q=q, k=k, v=v, scale=softmax_scale, causal=causal, window=window_size,
                               softcap=softcap, sink=learnable_sink))
        out, _ = attention_ref(q, k, v, softmax_scale, causal, window_size=window_size, softcap=softcap,
                               learnable_sink=learnable_sink)
        return out.to(q.dtype)

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal, window_size, softcap,
               learnable_sink, deterministic):
        self.calls.append(dict(kind="varlen", q=q, k=k, v=v, cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), max_q=max_q,
                               max_k=max_k, scale=softmax_scale, causal=causal, window=window_size, softcap=softcap,
                               sink=learnable_sink))
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert max_q == max((b - a for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:])), default=0)
        assert max_k == max((b - a for a, b in zip(cu_k.tolist(), cu_k.tolist()[1:])), default=0)
        out, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
        return out.to(q.dtype)

    def kinds(self):
        return [c["kind"] for c in self.calls]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert f4hf.register() == NAME
    yield
    f4hf.unregister(NAME)


@pytest.fixture
def ref(monkeypatch):
    kernels = RefKernels()
    monkeypatch.setattr(f4hf, "_KERNELS", kernels)
    f4hf._MASKS.clear()
    return kernels


# ================================================================ tiny models
SLIDE = 6


def _config(kind: str, head_dim: int = 64, **overrides):
    common = dict(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=head_dim, vocab_size=VOCAB, max_position_embeddings=256,
                  pad_token_id=0, eos_token_id=None, bos_token_id=None)
    common.update(overrides)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "mistral":
        return MistralConfig(sliding_window=SLIDE, **common)
    if kind == "gemma2":
        # a small softcap so that tanh saturates; a scaling that is not 1/sqrt(head_dim)
        common.setdefault("attn_logit_softcapping", 2.0)
        return Gemma2Config(sliding_window=SLIDE, query_pre_attn_scalar=2 * head_dim, final_logit_softcapping=30.0,
                            layer_types=["sliding_attention", "full_attention"], **common)
    if kind == "gptoss":
        common["intermediate_size"] = 128
        return GptOssConfig(sliding_window=SLIDE, num_local_experts=2, num_experts_per_tok=2,
                            layer_types=["sliding_attention", "full_attention"], **common)
    raise ValueError(kind)


MODELS = ("llama", "mistral", "gemma2", "gptoss")


def _model(kind: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    kwargs = {"experts_implementation": "eager"} if kind == "gptoss" else {}
    model = AutoModelForCausalLM.from_config(_config(kind, **overrides), attn_implementation="eager", **kwargs)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):  # sinks of order 1 so that they matter
                module.sinks.normal_(0.0, 1.0)
    return model.eval()


def _batch(padding: str, batch: int = 3, seqlen: int = 17, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seqlen), generator=gen)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    lengths = [seqlen, seqlen - 5, seqlen - 11][:batch]
    for b, n in enumerate(lengths):
        if padding == "left":
            mask[b, : seqlen - n] = 0
        elif padding == "right":
            mask[b, n:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _logits(model, impl, ids, mask, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


def _valid_err(a, b, mask):
    valid = torch.ones(a.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    return (a - b)[valid].abs().max().item()


# ================================================================ registration and names
def test_import_is_lazy():
    code = ("import sys, flash4; assert 'transformers' not in sys.modules; "
            "import flash4.integrations.transformers as m; assert 'transformers' not in sys.modules; print(m.DEFAULT_NAME)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == NAME


def test_register_adds_attention_mask_and_paged_entries():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "flash" not in NAME.lower()
    assert ALL_ATTENTION_FUNCTIONS[NAME] is f4hf.attention_forward
    assert ALL_ATTENTION_FUNCTIONS["paged|" + NAME] is f4hf.paged_attention_forward
    # without the mask entry transformers passes no mask at all (_preprocess_mask_arguments' early exit)
    assert NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS[NAME] is f4hf.mask_function
    assert f4hf.register() == NAME  # idempotent
    assert AttentionInterface._global_mapping[NAME] is f4hf.attention_forward


def test_custom_name_and_unregister():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert f4hf.register("my_f4") == "my_f4"
    assert ALL_ATTENTION_FUNCTIONS["my_f4"] is f4hf.attention_forward
    f4hf.unregister("my_f4")
    assert "my_f4" not in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert "my_f4" not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


@pytest.mark.parametrize("bad", ["flash4", "Flash_fast", "my_sdpa", "flex_attention", "org/repo", "a:b", "paged|x",
                                 "eager", ""])
def test_bad_names_refused(bad):
    with pytest.raises(ValueError):
        f4hf.register(bad)


def test_model_resolves_the_name_offline(monkeypatch):
    # a name containing "flash" would go to transformers' flash-attn / kernels-hub loaders; ours must not
    from transformers.integrations import hub_kernels

    assert not hub_kernels.is_kernel(NAME)
    model = AutoModelForCausalLM.from_config(_config("llama"), attn_implementation=NAME)
    assert model.config._attn_implementation == NAME
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation(NAME)
    assert model.config._attn_implementation == NAME


# ================================================================ the conventions
@pytest.mark.parametrize("w", [1, 2, 3, 6, 17])
@pytest.mark.parametrize("sq,sk", [(9, 9), (1, 9), (4, 9)])
def test_hf_sliding_window_is_flash_left_w_minus_1(w, sq, sk):
    """transformers' sliding window w (query i sees keys i - w < j <= i: w keys including itself)
    is flash-attn's window (w - 1, 0), both aligned bottom-right (the queries are the last sq of sk
    positions, as after a KV cache)."""
    hf = mu.sdpa_mask(batch_size=1, q_length=sq, kv_length=sk, q_offset=sk - sq,
                      mask_function=mu.sliding_window_causal_mask_function(w), allow_is_causal_skip=False)[0, 0]
    window = f4hf._window(w, True, sk)
    expected = window_mask(sq, sk, window, causal=True) if window != (-1, -1) else window_mask(sq, sk, None, True)
    assert torch.equal(hf, expected)
    assert window == ((w - 1, 0) if sk > w else (-1, -1))
    assert hf.sum(1).max().item() == min(w, sk)


def test_is_causal_none_reads_the_module(ref):
    class Attn(torch.nn.Module):
        def __init__(self, is_causal):
            super().__init__()
            self.is_causal = is_causal

    q, k, v = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64)
    for module_causal in (True, False):
        f4hf.attention_forward(Attn(module_causal), q, k, v, None, is_causal=None)
        assert ref.calls[-1]["causal"] is module_causal
        f4hf.attention_forward(Attn(module_causal), q, k, v, None, is_causal=not module_causal)
        assert ref.calls[-1]["causal"] is (not module_causal)
    f4hf.attention_forward(torch.nn.Module(), q, k, v, None)  # no attribute: causal, as transformers' default
    assert ref.calls[-1]["causal"] is True


def test_direct_call_maps_arguments(ref):
    """query (B, H, S, D) / key, value (B, Hkv, Sk, D) -> BSHD views, GQA unexpanded, scaling,
    softcap, sinks, window; output (B, S, H, D), weights None."""
    torch.manual_seed(0)
    mod = torch.nn.Module()
    q = torch.randn(2, 6, 4, 64).transpose(1, 2)  # (B, H, S, D) view of BSHD memory
    k = torch.randn(2, 2, 9, 64)  # (B, Hkv, Sk, D), BHSD memory (a cache)
    v = torch.randn(2, 2, 9, 64)
    sinks = torch.randn(4)
    out, weights = f4hf.attention_forward(mod, q, k, v, None, scaling=0.3, sliding_window=4, softcap=5.0, s_aux=sinks)
    call = ref.calls[-1]
    assert weights is None and out.shape == (2, 6, 4, 64)
    assert call["kind"] == "dense" and call["causal"] is True and call["window"] == (3, 0)
    assert call["scale"] == 0.3 and call["softcap"] == 5.0 and call["sink"] is sinks
    assert call["q"].shape == (2, 6, 4, 64) and call["k"].shape == (2, 9, 2, 64)
    assert call["q"].data_ptr() == q.data_ptr() and call["k"].data_ptr() == k.data_ptr()  # views, no copies
    expect, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.3, True, window_size=(3, 0),
                              softcap=5.0, learnable_sink=sinks)
    torch.testing.assert_close(out, expect)


def test_value_head_dim_of_its_own(ref):
    """v's head dim goes to flash4 as it is (flash4 runs (D, Dv) pairs, padding where it must)."""
    q, k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 48)
    out, _ = f4hf.attention_forward(torch.nn.Module(), q, k, v, None)
    assert out.shape == (1, 5, 2, 48) and ref.calls[-1]["v"].shape[-1] == 48
    expect, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True)
    torch.testing.assert_close(out, expect)


# ================================================================ mask function
def _mask_fn(**kwargs):
    base = dict(batch_size=2, q_length=5, kv_length=5, mask_function=mu.causal_mask_function, device="cpu")
    base.update(kwargs)
    return f4hf.mask_function(**base)


def test_mask_function_outputs():
    assert _mask_fn() is None
    assert _mask_fn(attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None
    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(_mask_fn(attention_mask=pad), pad)
    # a sliding layer's keys are the last kv_length positions of the mask
    long = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7], dtype=torch.bool)
    assert _mask_fn(attention_mask=long, q_length=1, kv_length=4, q_offset=6, kv_offset=3,
                    mask_function=mu.sliding_window_causal_mask_function(4)) is None  # its 4 keys: no padding
    assert torch.equal(_mask_fn(attention_mask=long, q_length=1, kv_length=6, q_offset=6, kv_offset=1),
                       long[:, -6:])
    # StaticCache: kv_length (the cache's capacity) > the tokens present -> a mask of the present ones
    static = _mask_fn(q_length=3, kv_length=16, q_offset=torch.tensor(4))
    assert static.dtype == torch.bool and static.shape == (2, 7) and bool(static.all())
    # packed sequences: ids encoded -1 - id
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 2, 2, 2]])
    packed = _mask_fn(mask_function=mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(ids)))
    assert packed.dtype == torch.int32 and torch.equal(packed, -1 - ids.int())


def test_mask_patterns():
    cls = f4hf.classify_mask_function
    assert cls(mu.causal_mask_function).causal is True
    assert cls(mu.bidirectional_mask_function).causal is False
    p = cls(mu.sliding_window_causal_mask_function(7))
    assert p.causal is True and p.window == 7
    ids = torch.zeros(1, 3, dtype=torch.long)
    p = cls(mu.and_masks(mu.sliding_window_causal_mask_function(7), mu.packed_sequence_mask_function(ids)))
    assert p.window == 7 and p.packed is ids
    refused = [mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv == 0),
               mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: kv >= 0),
               mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
               mu.sliding_window_bidirectional_mask_function(3),
               lambda b, h, q, kv: kv <= q]
    for fn in refused:
        with pytest.raises(f4hf.UnsupportedAttention):
            cls(fn)


def test_mask_analysis_runs_once_per_forward(ref, monkeypatch):
    calls = []
    real = f4hf._analyse
    monkeypatch.setattr(f4hf, "_analyse", lambda m: calls.append(m.shape) or real(m))
    model = _model("llama", num_hidden_layers=3)
    ids, mask = _batch("left")
    _logits(model, NAME, ids, mask)
    assert ref.kinds() == ["varlen"] * 3
    assert len(calls) == 1  # one analysis (one host sync) for the three layers


# ================================================================ models end to end (float32, reference kernels)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("kind", MODELS)
def test_logits_match_eager(ref, kind, padding):
    model = _model(kind)
    ids, mask = _batch(padding)
    mask_arg = None if padding == "none" else mask
    expect = _logits(model, "eager", ids, mask_arg)
    ref.calls.clear()
    got = _logits(model, NAME, ids, mask_arg)
    assert _valid_err(got, expect, mask_arg) < ATOL
    assert ref.kinds() == (["dense"] * 2 if padding == "none" else ["varlen"] * 2)
    sliding = kind in ("mistral", "gemma2", "gptoss")
    windows = [c["window"] for c in ref.calls]
    if kind == "mistral":
        assert windows == [(SLIDE - 1, 0)] * 2
    elif sliding:
        assert windows == [(SLIDE - 1, 0), (-1, -1)]  # layer_types: sliding, full
    else:
        assert windows == [(-1, -1)] * 2
    for call in ref.calls:
        assert call["k"].shape[-2] == 2  # GQA: K/V unexpanded
        assert call["causal"] is True
        assert call["softcap"] == (2.0 if kind == "gemma2" else 0.0)
        assert (call["sink"] is not None) == (kind == "gptoss")
        if kind == "gemma2":
            assert call["scale"] == pytest.approx((2 * 64) ** -0.5)
    if padding != "none":
        lengths = mask.sum(1).tolist()
        assert ref.calls[0]["cu_k"] == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_logits_match_sdpa(ref, kind):
    model = _model(kind)
    ids, mask = _batch("left")
    assert _valid_err(_logits(model, NAME, ids, mask), _logits(model, "sdpa", ids, mask), mask) < ATOL


def test_head_dim_128(ref):
    model = _model("llama", head_dim=128)
    ids, mask = _batch("left")
    assert _valid_err(_logits(model, NAME, ids, mask), _logits(model, "eager", ids, mask), mask) < ATOL


def _grads(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask).logits
    weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    (logits * weight)[valid].sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    return grads


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("kind", MODELS)
def test_gradients_match_eager(ref, kind, padding):
    model = _model(kind)
    ids, mask = _batch(padding)
    mask_arg = None if padding == "none" else mask
    expect = _grads(model, "eager", ids, mask_arg)
    got = _grads(model, NAME, ids, mask_arg)
    assert expect.keys() == got.keys()
    if kind == "gptoss":
        assert any("sinks" in n for n in got)  # the sinks get gradients through the attention
    for name in expect:
        scale = expect[name].abs().max().item() + 1e-6
        assert (got[name] - expect[name]).abs().max().item() <= 1e-4 * scale + 1e-6, name


def _generate(model, impl, ids, mask, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **kwargs)


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("kind", MODELS)
def test_generate_matches_eager(ref, kind, padding):
    model = _model(kind)
    ids, mask = _batch(padding, seqlen=9)
    expect = _generate(model, "eager", ids, mask)
    ref.calls.clear()
    got = _generate(model, NAME, ids, mask)
    assert torch.equal(got, expect)
    decode = [c for c in ref.calls if c["q"].shape[-3] in (1, ids.shape[0])]
    assert decode, "no decode step reached the attention"
    if padding == "none":
        assert set(ref.kinds()) == {"dense"}
        assert any(c["q"].shape[1] == 1 and c["k"].shape[1] > 1 for c in ref.calls)  # q length 1 vs the cache
    else:
        # varlen while a layer's keys include padding (a sliding layer's window can slide past it: dense again)
        assert "varlen" in ref.kinds()
        steps = [c for c in ref.calls if c["kind"] == "varlen" and c["cu_q"] == list(range(ids.shape[0] + 1))]
        assert steps and all(c["max_k"] > 1 for c in steps)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_generate_static_cache(ref, kind):
    model = _model(kind)
    ids, mask = _batch("left", seqlen=9)
    expect = _generate(model, "eager", ids, mask, cache_implementation="static")
    got = _generate(model, NAME, ids, mask, cache_implementation="static")
    assert torch.equal(got, expect)
    got_nomask = _generate(model, NAME, ids[:1], None, cache_implementation="static")
    assert torch.equal(got_nomask, _generate(model, "eager", ids[:1], None, cache_implementation="static"))


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_chunked_prefill_after_cache(ref, kind):
    """A query block of 4 after a padded prefix in a DynamicCache (q shorter than the keys, padded)."""
    from transformers import DynamicCache

    model = _model(kind)
    ids, mask = _batch("left", seqlen=12)
    outs = {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache)
            outs[impl] = model(ids[:, 8:], attention_mask=mask, past_key_values=cache).logits
    assert _valid_err(outs[NAME], outs["eager"], mask[:, 8:]) < ATOL


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_packed_sequences(ref, kind, batch):
    """position_ids restarting inside a row (no attention_mask, no cache): one varlen sequence per segment.
    (Models whose mask creation does not get position_ids, e.g. gpt-oss, do not pack in any implementation.)"""
    model = _model(kind)
    seqlen = 16
    ids = torch.randint(1, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(5))
    segments = [[7, 9], [3, 10, 3]][:batch] if batch == 2 else [[5, 4, 7]]
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in segments])
    # (transformers detects packing only without a cache: use_cache=False)
    expect = _logits(model, "eager", ids, None, position_ids=position_ids, use_cache=False)
    ref.calls.clear()
    got = _logits(model, NAME, ids, None, position_ids=position_ids, use_cache=False)
    assert _valid_err(got, expect, None) < ATOL
    assert set(ref.kinds()) == {"varlen"}
    bounds = [0]
    for b, row in enumerate(segments):
        for n in row:
            bounds.append(bounds[-1] + n)
    assert ref.calls[0]["cu_q"] == bounds
    # each segment alone gives the same logits (no attention across segments)
    start = 0
    for n in segments[0]:
        alone = _logits(model, "eager", ids[:1, start:start + n], None)
        assert (got[0, start:start + n] - alone[0]).abs().max().item() < ATOL
        start += n


def test_explicit_cu_seq_lens(ref):
    """FlashAttentionKwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=True))."""
    model = _model("mistral")
    lens = [6, 8, 5]
    ids = torch.randint(1, VOCAB, (1, sum(lens)), generator=torch.Generator().manual_seed(6))
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 6, 14, 19], dtype=torch.int32)
    expect = _logits(model, "eager", ids, None, position_ids=position_ids, use_cache=False)
    ref.calls.clear()
    got = _logits(model, NAME, ids, None, position_ids=position_ids, use_cache=False, cu_seq_lens_q=cu,
                  cu_seq_lens_k=cu, max_length_q=8, max_length_k=8)
    assert _valid_err(got, expect, None) < ATOL
    assert ref.calls[0]["cu_q"] == cu.tolist() and ref.calls[0]["window"] == (SLIDE - 1, 0)


def test_peft_fp32_queries_are_cast(monkeypatch):
    """fp32 query/key/value with bf16 Linear weights (PEFT's fp32 norms): cast to bf16, as
    transformers' flash backends do; fp32 weights: refused (flash4 runs bf16/fp16)."""
    kernels = RefKernels(dtypes=(torch.bfloat16, torch.float16))
    monkeypatch.setattr(f4hf, "_KERNELS", kernels)
    layer = torch.nn.Module()
    layer.q_proj = torch.nn.Linear(8, 8).to(torch.bfloat16)
    q, k, v = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = f4hf.attention_forward(layer, q, k, v, None)
    assert kernels.calls[-1]["q"].dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    layer.q_proj = torch.nn.Linear(8, 8)
    with pytest.raises(f4hf.UnsupportedAttention, match="dtype"):
        f4hf.attention_forward(layer, q, k, v, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f4hf.attention_forward(layer, q, k, v, None)
    assert kernels.calls[-1]["q"].dtype == torch.bfloat16


# ================================================================ continuous batching (paged|name)
def _cb_generate(model, impl, inputs):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(impl)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(block_size=32, num_blocks=16, max_batch_tokens=64, use_cuda_graph=False)
    with torch.no_grad():
        out = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb)
    return {k: list(v.generated_tokens) for k, v in out.items()}


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_paged_continuous_batching(ref, monkeypatch, kind):
    handler = pytest.importorskip("transformers.generation.continuous_batching.cache").PagedAttentionMemoryHandler
    monkeypatch.setattr(handler, "get_available_memory", lambda self: 1 << 30)  # CPU: transformers sees 0 bytes
    model = _model(kind)
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    expect = _cb_generate(model, "paged|sdpa", inputs)
    ref.calls.clear()
    if _TF_VERSION >= (5, 19):
        # transformers 5.19+ admits only 'paged|eager', 'sdpa' or names containing "flash" to continuous
        # batching (and a "flash" name is sent to its flash-attn loaders): the documented limitation
        with pytest.raises(ValueError, match="not supported for continuous batching"):
            _cb_generate(model, "paged|" + NAME, inputs)
        return
    got = _cb_generate(model, "paged|" + NAME, inputs)
    assert got == expect
    assert ref.calls and set(ref.kinds()) == {"varlen"}
    if kind == "mistral":
        assert any(c["window"] == (SLIDE - 1, 0) for c in ref.calls)


def test_paged_without_cache_refused(ref):
    q = torch.randn(1, 4, 5, 64)
    with pytest.raises(f4hf.UnsupportedAttention, match="paged cache"):
        f4hf.paged_attention_forward(torch.nn.Module(), q, q[:, :2], q[:, :2], None)


# ================================================================ refusals
def test_head_dim_36_refused(ref):
    model = _model("llama", head_dim=36)  # not a multiple of 8 (32 and 40 are served, zero-padded by flash4)
    ids, _ = _batch("none")
    model.set_attn_implementation(NAME)
    with pytest.raises(f4hf.UnsupportedAttention, match="head dim 36"):
        model(ids)


def test_dropout_in_training_refused(ref):
    model = _model("llama", attention_dropout=0.1)
    ids, _ = _batch("none")
    model.set_attn_implementation(NAME)
    model(ids)  # eval: dropout 0.0 is passed
    model.train()
    with pytest.raises(f4hf.UnsupportedAttention, match="dropout"):
        model(ids)


def test_custom_4d_mask_refused(ref):
    model = _model("llama")
    ids, _ = _batch("none")
    model.set_attn_implementation(NAME)
    mask4d = torch.zeros(ids.shape[0], 1, ids.shape[1], ids.shape[1])  # a float additive mask
    with pytest.raises(f4hf.UnsupportedAttention, match="4-D attention_mask"):
        model(ids, attention_mask=mask4d)


def test_mask_overlay_refused(ref):
    """A model asking for a pattern beyond causal / sliding / padding / packed (here an
    or_mask_function, as vision-language models add for image tokens) is refused, not ignored."""
    model = _model("llama")
    ids, mask = _batch("left")
    model.set_attn_implementation(NAME)
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(f4hf.UnsupportedAttention, match="cannot express"):
        mu.create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=mask, past_key_values=None,
                              or_mask_function=lambda b, h, q, kv: kv < 2)


def test_other_refusals(ref):
    mod = torch.nn.Module()
    q, k = torch.randn(2, 4, 6, 64), torch.randn(2, 2, 6, 64)
    with pytest.raises(f4hf.UnsupportedAttention, match="non-causal"):
        f4hf.attention_forward(mod, q, k, k, None, sliding_window=3, is_causal=False)
    holes = torch.tensor([[1, 0, 1, 1, 1, 1], [1] * 6], dtype=torch.bool)
    with pytest.raises(f4hf.UnsupportedAttention, match="holes"):
        f4hf.attention_forward(mod, q, k, k, holes, sliding_window=3)
    f4hf.attention_forward(mod, q, k, k, holes)  # holes without a window are fine (compressed order is kept)
    with pytest.raises(f4hf.UnsupportedAttention, match="position_bias"):
        f4hf.attention_forward(mod, q, k, k, None, position_bias=torch.zeros(1))
    with pytest.raises(f4hf.UnsupportedAttention, match="int32"):
        f4hf.attention_forward(mod, q, k, k, torch.ones(2, 6, dtype=torch.int32))
    with pytest.raises(f4hf.UnsupportedAttention, match="dtype torch.int64"):
        f4hf.attention_forward(mod, q, k, k, torch.ones(2, 6, dtype=torch.long))
    with pytest.raises(f4hf.UnsupportedAttention, match="s_aux"):
        f4hf.attention_forward(mod, q, k, k, None, s_aux=torch.zeros(3))
    with pytest.warns(UserWarning, match="output_attentions"):
        f4hf.attention_forward(mod, q, k, k, None, output_attentions=True)


def test_holes_without_window_match_eager(ref):
    """Padding in the middle of a row (no window): the valid queries see exactly the valid keys."""
    model = _model("llama")
    ids, _ = _batch("none")
    mask = torch.ones_like(ids)
    mask[1, 3:6] = 0
    mask[2, :2] = 0
    mask[2, 10] = 0
    assert _valid_err(_logits(model, NAME, ids, mask), _logits(model, "eager", ids, mask), mask) < ATOL


# ================================================================ the real seam (flash4's functions, spied)
def test_real_seam_calls_flash4(monkeypatch):
    """_Flash4Kernels calls flash4.flash_attn_func / flash_attn_varlen_func with the mapped
    arguments (spied here: the kernels need a GPU); flash4's own argument errors (a CPU tensor)
    come back as UnsupportedAttention."""
    seen = []

    def spy_dense(q, k, v, softmax_scale=None, causal=False, return_lse=False, deterministic=False, *, window_size,
                  softcap, learnable_sink):
        seen.append(dict(kind="dense", q=q, k=k, scale=softmax_scale, causal=causal, window=window_size,
                         softcap=softcap, sink=learnable_sink))
        return attention_ref(q, k, v, softmax_scale, causal, window_size=window_size, softcap=softcap,
                             learnable_sink=learnable_sink)[0].to(q.dtype)

    def spy_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal, window_size, softcap, learnable_sink,
                   deterministic):
        seen.append(dict(kind="varlen", q=q, k=k, max_q=max_q, max_k=max_k, causal=causal, window=window_size))
        return attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size, softcap=softcap,
                                    learnable_sink=learnable_sink)[0].to(q.dtype)

    f4hf._MASKS.clear()
    monkeypatch.setattr(flash4, "flash_attn_func", spy_dense)
    monkeypatch.setattr(flash4, "flash_attn_varlen_func", spy_varlen)
    model = _model("gptoss").to(torch.bfloat16)
    ids, mask = _batch("left")
    model.set_attn_implementation(NAME)
    with torch.no_grad():
        model(ids)
        model(ids, attention_mask=mask)
    assert [c["kind"] for c in seen] == ["dense", "dense", "varlen", "varlen"]
    assert [c["window"] for c in seen] == [(SLIDE - 1, 0), (-1, -1)] * 2
    dense = seen[0]
    assert dense["q"].dtype == torch.bfloat16 and dense["q"].shape == (3, 17, 4, 64) and dense["k"].shape[2] == 2
    assert dense["causal"] is True and dense["sink"] is model.model.layers[0].self_attn.sinks
    monkeypatch.undo()
    with pytest.raises(f4hf.UnsupportedAttention, match="CUDA"):
        with torch.no_grad():
            model(ids)  # the real flash4.flash_attn_func refuses CPU tensors
