"""flash4 as a Hugging Face transformers attention implementation, on the GPU (marker gpu; skipped
without CUDA or transformers; sm_90 only).

Tiny randomly initialised models, offline (from_config), bf16 on the GPU with
attn_implementation="f4attn" (flash4.integrations.transformers.register()): Llama (GQA, head dim 64
and 128), Mistral (sliding window), Gemma 2 (softcap 1.0 so tanh saturates, query_pre_attn_scalar
scaling, alternating sliding / full layers) and gpt-oss (sinks, alternating sliding / full layers,
MoE with every expert active so routing has no discrete flips). Reference: the same model in float32
with the PyTorch implementation (SDPA for Llama / Mistral; eager for Gemma 2, whose SDPA path drops
the softcap, and gpt-oss, which has no SDPA path), TF32 off. Criterion (flash4.reference's):
err(flash4 bf16) <= 2 * err(PyTorch bf16) + atol against the float32 model, for the logits of the
valid positions (max error; unpadded and left-padded batches) and for every parameter's gradient
(2-norm of the error: see test_gradients). Greedy
generate() (16 new tokens, left-padded batch: padded decode through the varlen kernels) gives
PyTorch bf16's tokens; where a sequence first differs, the reference's own top-2 margin there must
be within the bf16 noise measured on the prefill logits (a near tie, not a mistake); every token
flash4 picks is a near-argmax of the reference model on the same prefix. Also: StaticCache, and
continuous batching (paged|f4attn). A spy proves flash4's kernels ran (dense without padding,
varlen with it). Kernel configs: bf16, head dims 64 and 128.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flash4  # noqa: E402
import flash4.integrations.transformers as f4hf  # noqa: E402
from transformers import (AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig,  # noqa: E402
                          MistralConfig)

from gpu_helpers import BF16, DEV  # noqa: E402

NAME = f4hf.DEFAULT_NAME
VOCAB = 1000
SLIDE = 16
LOGIT_ATOL = 1e-3
GRAD_RTOL = 2e-3  # atol of a gradient: GRAD_RTOL * |reference gradient| (2-norm) of that parameter


@pytest.fixture(autouse=True, scope="module")
def _registered():
    """f4attn registered and TF32 off for the module (after conftest's sm_90 gate, an autouse fixture of
    the same scope from a conftest, which pytest sets up first)."""
    f4hf.register()
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # a float32 reference
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    f4hf.unregister()


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of flash4's public functions (the integration's kernels)."""
    calls = []
    dense, varlen = flash4.flash_attn_func, flash4.flash_attn_varlen_func

    def spy_dense(*args, **kwargs):
        calls.append("dense")
        return dense(*args, **kwargs)

    def spy_varlen(*args, **kwargs):
        calls.append("varlen")
        return varlen(*args, **kwargs)

    monkeypatch.setattr(flash4, "flash_attn_func", spy_dense)
    monkeypatch.setattr(flash4, "flash_attn_varlen_func", spy_varlen)
    return calls


# ================================================================ tiny models
def _config(kind):
    common = dict(hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0,
                  eos_token_id=None, bos_token_id=None)
    if kind == "llama64":
        return LlamaConfig(**common)
    if kind == "llama128":
        return LlamaConfig(**{**common, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128})
    if kind == "mistral":
        return MistralConfig(sliding_window=SLIDE, **common)
    if kind == "gemma2":
        return Gemma2Config(sliding_window=SLIDE, attn_logit_softcapping=1.0, query_pre_attn_scalar=128,
                            final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"], **common)
    if kind == "gptoss":
        return GptOssConfig(sliding_window=SLIDE, num_local_experts=2, num_experts_per_tok=2,
                            layer_types=["sliding_attention", "full_attention"], **{**common, "intermediate_size": 256})
    raise ValueError(kind)


KINDS = ("llama64", "llama128", "mistral", "gemma2", "gptoss")
# PyTorch's own implementation for each (Gemma 2's SDPA path ignores the softcap; gpt-oss has no SDPA path)
PT_IMPL = {"llama64": "sdpa", "llama128": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gptoss": "eager"}


def _models(kind):
    """(float32 model, bf16 model), same weights, on the GPU, in eval mode, PyTorch's implementation."""
    torch.manual_seed(0)
    kwargs = {"experts_implementation": "eager"} if kind == "gptoss" else {}
    model = AutoModelForCausalLM.from_config(_config(kind), attn_implementation=PT_IMPL[kind], dtype=torch.float32,
                                             **kwargs)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):  # sinks of order 1 so that they matter
                module.sinks.normal_(0.0, 1.0)
    model = model.to(DEV).eval()
    return model, copy.deepcopy(model).to(BF16)


def _batch(padding, batch=3, seqlen=40, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seqlen), generator=gen)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    if padding == "left":
        for b, n in enumerate([seqlen, seqlen - 9, seqlen - 23][:batch]):
            mask[b, : seqlen - n] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(DEV), (None if padding == "none" else mask.to(DEV))


def _valid(mask, shape):
    return torch.ones(shape, dtype=torch.bool, device=DEV) if mask is None else mask.bool()


def _err(x, ref, valid):
    return (x.float() - ref.float())[valid].abs().max().item()


def _logits(model, impl, ids, mask, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


# ================================================================ logits
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("kind", KINDS)
def test_logits(spy, kind, padding):
    m32, m16 = _models(kind)
    ids, mask = _batch(padding)
    valid = _valid(mask, ids.shape)
    ref = _logits(m32, PT_IMPL[kind], ids, mask)
    pt = _logits(m16, PT_IMPL[kind], ids, mask)
    spy.clear()
    got = _logits(m16, NAME, ids, mask)
    assert spy == (["dense"] * 2 if padding == "none" else ["varlen"] * 2)
    assert torch.isfinite(got[valid]).all()
    err, pt_err = _err(got, ref, valid), _err(pt, ref, valid)
    assert err <= 2 * pt_err + LOGIT_ATOL, f"{kind}/{padding}: flash4 {err} vs PyTorch bf16 {pt_err}"


# ================================================================ gradients
def _grads(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask).logits
    weight = torch.randn(logits.shape, generator=torch.Generator(device=DEV).manual_seed(3), device=DEV)
    (logits.float() * weight)[_valid(mask, ids.shape)].sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.eval()
    return grads


@pytest.mark.parametrize("kind,padding", [(k, "left") for k in KINDS] + [("llama64", "none"), ("gemma2", "none"),
                                                                          ("gptoss", "none")])
def test_gradients(spy, kind, padding):
    m32, m16 = _models(kind)
    ids, mask = _batch(padding)
    ref = _grads(m32, PT_IMPL[kind], ids, mask)
    pt = _grads(m16, PT_IMPL[kind], ids, mask)
    spy.clear()
    got = _grads(m16, NAME, ids, mask)
    assert spy and set(spy) == {"dense" if padding == "none" else "varlen"}
    assert got.keys() == ref.keys()
    if kind == "gptoss":
        assert any(n.endswith("sinks") for n in got)
    failures = []
    for name, g_ref in ref.items():
        assert torch.isfinite(got[name]).all(), name
        # 2-norms: the whole model's bf16 noise dominates a parameter's gradient error, and the maxima of two
        # such noises alone are up to ~1.9x apart (measured); the norms are within ~1.35x, a bug moves them by far more
        err, pt_err = (got[name] - g_ref).norm().item(), (pt[name] - g_ref).norm().item()
        bound = 2 * pt_err + GRAD_RTOL * g_ref.norm().item() + 1e-6
        if not err <= bound:
            failures.append(f"{name}: {err:.3e} > {bound:.3e} (PyTorch bf16 {pt_err:.3e})")
    assert not failures, f"{kind}/{padding}: " + "; ".join(failures)


# ================================================================ generate
def _near_argmax(logits_row, token, tol):
    return (logits_row.max() - logits_row[token]).item() <= tol


def _noise(m16, kind, ids, mask):
    """The bf16 noise between flash4 and PyTorch on these logits: the margin a near tie may have."""
    valid = _valid(mask, ids.shape)
    pt, got = _logits(m16, PT_IMPL[kind], ids, mask), _logits(m16, NAME, ids, mask)
    return max(4 * _err(got, pt, valid), 0.02 * pt[valid].float().abs().max().item())


def _teacher_forced_check(m16, kind, sequences, prompt_mask, prompt_len, tol):
    """Every token flash4 generated is a near-argmax of PyTorch's bf16 model on the same prefix."""
    mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, prompt_len:])], dim=1)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate() numbers them
    logits = _logits(m16, PT_IMPL[kind], sequences, mask, position_ids=position_ids).float()
    for b in range(sequences.shape[0]):
        for t in range(prompt_len, sequences.shape[1]):
            assert _near_argmax(logits[b, t - 1], sequences[b, t], tol), (
                f"{kind}: sequence {b} token {t}: flash4 picked {sequences[b, t].item()}, reference margin "
                f"{(logits[b, t - 1].max() - logits[b, t - 1, sequences[b, t]]).item():.4f} > {tol:.4f}")


@pytest.mark.parametrize("kind", KINDS)
def test_generate_greedy(spy, kind):
    _, m16 = _models(kind)
    ids, mask = _batch("left", seqlen=24)
    tol = _noise(m16, kind, ids, mask)
    new = 16
    m16.set_attn_implementation(PT_IMPL[kind])
    with torch.no_grad():
        ref = m16.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    m16.set_attn_implementation(NAME)
    spy.clear()
    with torch.no_grad():
        got = m16.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert "varlen" in spy and len(spy) >= 2 * new  # padded prefill and decode steps ran flash4
    prompt = ids.shape[1]
    for b in range(ids.shape[0]):
        differ = (got[b, prompt:] != ref.sequences[b, prompt:]).nonzero()
        if differ.numel():  # allowed only at a near tie of the reference
            t = differ[0].item()
            assert _near_argmax(ref.logits[t][b].float(), got[b, prompt + t], tol), (
                f"{kind}: sequence {b} differs at new token {t} where the reference is not near a tie")
    _teacher_forced_check(m16, kind, got, mask, prompt, tol)


def test_generate_static_cache(spy):
    _, m16 = _models("mistral")
    ids, mask = _batch("left", seqlen=24)
    tol = _noise(m16, "mistral", ids, mask)
    m16.set_attn_implementation(NAME)
    spy.clear()
    with torch.no_grad():
        got = m16.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                           cache_implementation="static", disable_compile=True)
    assert spy
    _teacher_forced_check(m16, "mistral", got, mask, ids.shape[1], tol)


@pytest.mark.parametrize("kind", ["llama64", "mistral", "gptoss"])
def test_continuous_batching(spy, kind):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    _, m16 = _models(kind)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (7, 19, 33)]
    ids, mask = _batch("left", seqlen=24)
    tol = _noise(m16, kind, ids, mask)
    m16.set_attn_implementation("paged|" + NAME)  # explicit: transformers would otherwise look for flash-attn
    spy.clear()
    with torch.no_grad():
        out = m16.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=10, do_sample=False,
                                                                             eos_token_id=-1, pad_token_id=0),
                                 continuous_batching_config=ContinuousBatchingConfig(
                                     use_cuda_graph=False, block_size=32, num_blocks=64, max_batch_tokens=256))
    assert spy and set(spy) == {"varlen"}
    assert len(out) == len(prompts)
    for result in out.values():
        prompt, tokens = list(result.prompt_ids), list(result.generated_tokens)
        assert result.error is None and len(tokens) == 10 and prompt in prompts
        seq = torch.tensor([prompt + tokens], device=DEV)
        _teacher_forced_check(m16, kind, seq, torch.ones(1, len(prompt), dtype=torch.long, device=DEV), len(prompt),
                              tol)


# ================================================================ refusals
def test_refusals_on_gpu():
    cfg = LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=36, vocab_size=VOCAB)  # not a multiple of 8
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME, dtype=BF16).to(DEV).eval()
    ids = torch.randint(1, VOCAB, (1, 8), device=DEV)
    with pytest.raises(f4hf.UnsupportedAttention, match="head dim 36"):
        model(ids)
    _, m16 = _models("llama64")
    m32 = m16.float()
    m32.set_attn_implementation(NAME)
    with pytest.raises(f4hf.UnsupportedAttention, match="dtype"):
        m32(ids)
