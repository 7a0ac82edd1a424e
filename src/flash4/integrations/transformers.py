"""flash4 as a Hugging Face transformers attention implementation (transformers >= 5).

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    import flash4.integrations.transformers as f4hf

    f4hf.register()                                   # names "f4attn" (and "paged|f4attn")
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      intermediate_size=1024, num_hidden_layers=2, vocab_size=1000)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=f4hf.DEFAULT_NAME,
                                             dtype=torch.bfloat16).cuda()
    # or: AutoModelForCausalLM.from_pretrained(path, attn_implementation="f4attn", dtype=torch.bfloat16)
    # or, on a loaded model: model.set_attn_implementation("f4attn")
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False)

`register()` adds three entries to transformers' class-wide registries (idempotent):
  - AttentionInterface[name] = `attention_forward`: what every attention layer of the model calls;
  - AttentionMaskInterface[name] = `mask_function`: what the model's create_causal_mask /
    create_sliding_window_causal_mask / create_bidirectional_mask call. Without it transformers
    treats the name as a backend that needs no mask and passes None: padded batches would silently
    attend to their padding;
  - AttentionInterface["paged|" + name] = `paged_attention_forward`: continuous batching
    (model.generate_batch / `paged|` implementations) over transformers' PagedAttentionCache;
    transformers <= 5.18 (from 5.19 its continuous batching admits only names containing "flash").
The name must not contain "flash" (transformers routes such names to flash-attn packages and the
kernels-hub loader, which fails offline), "sdpa", "flex_attention", "eager", "/" or ":"; the
default is "f4attn" (DEFAULT_NAME). Importing this module imports neither transformers nor
flash4's kernels; `import flash4` never imports this module.

What the models pass and how it maps (llama, mistral, qwen2, gemma2, gpt-oss, ... all call
attention_interface(module, query, key, value, attention_mask, dropout=, scaling=, **kwargs)):
  - query (B, H, S, D), key/value (B, H_kv, S_k, D): `transpose(1, 2)` views in flash4's
    (B, S, H, D) layout (no copy for the usual BSHD memory; a cache's BHSD memory is read through
    its strides). GQA/MQA: K/V go unexpanded (H_kv heads). A tensor whose strides the kernels
    cannot read is copied first. Head dims: any multiple of 8 from 8 to 256, the value's its own
    (flash4's kernels for 64/96/128/192/256 and (192, 128), (128, 64), (64, 128); others zero-padded
    by flash4.headdim inside flash4). Output (B, S, H, Dv), weights None.
  - is_causal: the keyword when given, else `module.is_causal` (default True). Causal masks are
    aligned bottom-right (query i of S sees key j <= i + S_k - S), which is how transformers lays
    out a query block after a KV cache (decode, chunked prefill).
  - scaling -> softmax_scale (None: 1/sqrt(D); Gemma 2's query_pre_attn_scalar**-0.5 as given).
  - sliding_window w -> window_size (w - 1, 0): transformers' sliding masks let query i see keys
    i - w < j <= i (w keys, itself included: masking_utils.sliding_window_overlay), which is
    flash-attn's left = w - 1 (transformers' own flash path passes the same). A window that spans
    every key runs the plain causal kernel.
  - softcap (Gemma 2's attn_logit_softcapping) -> softcap (softcap * tanh(scores / softcap)).
  - s_aux (gpt-oss sinks, (H,)) -> learnable_sink (differentiable: the sinks get gradients).
  - Padding: the mask function returns the 2D bool padding mask (B, kv_len) (sliced to the keys
    this layer sees) or None when nothing is padded, as transformers' flash_attention_mask does.
    With a mask the batch runs flash4's varlen kernels: the valid keys of each row are gathered
    into a packed batch (cu_seqlens); for causal attention the valid queries too (the queries are
    the last S columns of the mask), so each valid query sees exactly the valid keys the SDPA
    mask gives it; padded query rows return 0 (SDPA's values there are meaningless too). For
    non-causal attention every query row is kept (the mask only removes keys, as SDPA's does).
    The mask analysis (nonzero, lengths: one host sync) is done once per mask tensor and reused
    by every layer. A mask narrower than the keys (StaticCache: unused slots past the tokens)
    cuts the keys to its width. Without a mask the dense kernels run on the tensors as they are.
  - Packed sequences (several sequences in one row, told by position_ids restarting, which
    transformers' mask creation detects when there is no attention_mask and no cache, e.g.
    model(ids, position_ids=..., use_cache=False) in training): the mask function returns the
    sequence ids (int32, encoded as -1 - id); the attention runs varlen, one sequence per packed
    segment, any batch size. As with SDPA/eager, a model whose mask creation does not receive
    position_ids (gpt-oss) does not pack. Also explicit cu_seq_lens_q / cu_seq_lens_k /
    max_length_q / max_length_k keywords (DataCollatorWithFlattening(return_flash_attn_kwargs=True)).
  - fp32 queries (PEFT's fp32 layer norms) are cast to the autocast dtype, or else to the layer's
    Linear weight dtype when that is bf16/fp16, as transformers' flash backends do.
  - Gradients: through flash4's autograd (dq, dk, dv, dsink) on both paths; deterministic
    backward when torch.are_deterministic_algorithms_enabled() or FLASH_ATTENTION_DETERMINISTIC=1.
  - paged|name (continuous batching, model.generate_batch): the cache update through
    cache.update(read_index, write_index), then varlen causal attention over cu_seq_lens_q /
    cu_seq_lens_k (per layer type when they come as dicts), with the layer's sliding_window,
    softcap and sinks. Set attn_implementation="paged|f4attn" yourself before generate_batch:
    from a plain non-flash name transformers first looks for flash-attn 2/3 (package or kernels
    hub) and switches to it when found. transformers lends its block-table decode fast path to
    flash-attn 2/3 names only (block_table is None here), and builds the 4D masks of non-flash
    names, which this function does not read.
  - torch.compile: the dense and varlen calls are flash4's compile-aware entry points, but the
    mask analysis is data dependent (graph breaks); generate() with a StaticCache auto-compiles
    the decode step on CUDA (pass disable_compile=True to skip that).

Refused with UnsupportedAttention (a RuntimeError; the message says what and suggests
attn_implementation="sdpa" or "eager"), never served wrongly and never silently sent elsewhere:
  - dropout > 0 (flash4 has no dropout; models pass attention_dropout only in training mode);
  - a head dim flash4 has no kernel for (it has 64, 96, 128, 192, 256) or a dtype other than
    bf16/fp16 (fp32 is cast only in the PEFT/autocast case above);
  - a 4D (or any non-padding) attention_mask: custom masks (a user's 4D mask, or a model's
    or_mask_function / and_mask_function, chunked attention, block/image-token overlays) cannot be
    expressed as per-sequence lengths; the mask function checks the pattern it is asked for
    (causal, sliding-window causal, bidirectional, packed sequences) and refuses any other;
  - a sliding window with non-causal attention: transformers disagrees with itself there
    (Gemma 2's bidirectional masks allow |i - j| <= w, its flash path |i - j| <= w - 1);
  - a sliding window over a padding mask with holes (padding in the middle of a row: the window
    would count padded positions in SDPA, not after unpadding): left or right padding is fine;
  - position_bias (T5-style additive biases), a paged block_table;
  - whatever flash4 itself refuses (its validation message: device not CUDA sm_90, strides, ...).
output_attentions=True only warns (weights are None), as transformers' flash/SDPA backends do.
"""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass

import torch

DEFAULT_NAME = "f4attn"
PAGED_PREFIX = "paged|"
_FORBIDDEN_IN_NAME = ("flash", "sdpa", "flex_attention", "eager", "/", ":", "|")
_HINT = ' (use attn_implementation="sdpa" or "eager" for this model or input, e.g. model.set_attn_implementation("sdpa"))'


class UnsupportedAttention(RuntimeError):
    """An input flash4's transformers attention cannot serve; the message says which and why."""


def _fail(message: str, hint: bool = True):
    raise UnsupportedAttention("flash4 transformers attention: " + message + (_HINT if hint else ""))


# ================================================================ the flash4 calls (a seam for CPU tests)
class _Flash4Kernels:
    """What the attention functions run: flash4's public entry points. The CPU tests substitute a
    reference with the same attributes (no GPU there); nothing else should."""

    dtypes = (torch.bfloat16, torch.float16)

    @staticmethod
    def headdims():
        from flash4.headdim import HEADDIM_MULTIPLE, MAX_HEADDIM

        return tuple(range(HEADDIM_MULTIPLE, MAX_HEADDIM + 1, HEADDIM_MULTIPLE))  # flash4.headdim's rule

    @staticmethod
    def dense(q, k, v, *, softmax_scale, causal, window_size, softcap, learnable_sink, deterministic):
        import flash4

        return flash4.flash_attn_func(q, k, v, softmax_scale, causal, deterministic=deterministic,
                                      window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)

    @staticmethod
    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale, causal, window_size,
               softcap, learnable_sink, deterministic):
        import flash4

        return flash4.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                             softcap=softcap, learnable_sink=learnable_sink,
                                             deterministic=deterministic)


_KERNELS = _Flash4Kernels()


def _run(kind: str, *args, **kwargs):
    """_KERNELS.dense / .varlen, flash4's argument errors (TypeError / ValueError: its validation)
    re-raised as UnsupportedAttention with the hint."""
    try:
        return getattr(_KERNELS, kind)(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise UnsupportedAttention(f"flash4 transformers attention: flash4 cannot run this call: {err}{_HINT}") from err


# ================================================================ registration
def check_name(name: str) -> str:
    """name, when transformers will route it to the registered functions; else ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"the attention implementation name must be a non-empty str; got {name!r}")
    bad = [part for part in _FORBIDDEN_IN_NAME if part in name.lower()]
    if bad:
        raise ValueError(
            f"attention implementation name {name!r} contains {bad[0]!r}: transformers routes names containing "
            f"'flash' to flash-attn packages / the kernels hub (which fails offline), 'sdpa' / 'flex_attention' / "
            f"'eager' to its own checks, and '/' or ':' to hub kernels ('|' is the paged| prefix); pick another, "
            f"e.g. {DEFAULT_NAME!r}")
    return name


def register(name: str = DEFAULT_NAME) -> str:
    """Register flash4 with transformers under `name` (and "paged|" + name); returns name.

    Afterwards `attn_implementation=name` works in from_pretrained / from_config /
    set_attn_implementation. Class-wide and idempotent (registering again replaces the entries)."""
    check_name(name)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionInterface.register(PAGED_PREFIX + name, paged_attention_forward)
    AttentionMaskInterface.register(name, mask_function)
    return name


def unregister(name: str = DEFAULT_NAME) -> None:
    """Remove what register(name) added (models already set to it then fail when they run)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for mapping, key in ((AttentionInterface._global_mapping, name),
                         (AttentionInterface._global_mapping, PAGED_PREFIX + name),
                         (AttentionMaskInterface._global_mapping, name)):
        mapping.pop(key, None)


# ================================================================ mask function (AttentionMaskInterface)
@dataclass(frozen=True)
class MaskPattern:
    """What a transformers mask_function asks for, in flash4's terms."""

    causal: bool | None = None  # None: neither causal_mask_function nor bidirectional_mask_function seen
    window: int | None = None  # transformers' causal sliding_window w (query sees w keys, itself included)
    bidirectional_window: int | None = None
    packed: torch.Tensor | None = None  # (B, S) sequence ids of packed sequences


_MASK_CODES = None


def _mask_codes() -> dict:
    """The code objects of transformers' mask building blocks (this installed version's)."""
    global _MASK_CODES
    if _MASK_CODES is None:
        from transformers import masking_utils as mu

        dummy = torch.zeros(1, 1, dtype=torch.bool)
        _MASK_CODES = {
            "and": mu.and_masks(mu.causal_mask_function).__code__,
            "sliding": mu.sliding_window_overlay(1).__code__,
            "sliding_bidirectional": mu.sliding_window_bidirectional_overlay(1).__code__,
            "packed": mu.packed_sequence_mask_function(dummy).__code__,
            "causal": mu.causal_mask_function,
            "bidirectional": mu.bidirectional_mask_function,
        }
        if hasattr(mu, "remap_positions_for_packed_sequence"):  # transformers >= 5.23
            _MASK_CODES["remap"] = mu.remap_positions_for_packed_sequence(mu.causal_mask_function, dummy).__code__
    return _MASK_CODES


def _closure_vars(fn) -> dict:
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not closure:
        return {}
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))


def _leaves(fn, codes) -> list:
    """The functions an and_masks(...) tree intersects (fn itself when it is not one). transformers
    >= 5.23 wraps the base mask of packed sequences in remap_positions_for_packed_sequence (q/kv
    indices -> positions within each sequence); the packed-sequence leaf it is and-ed with restricts
    attention to one sequence, whose positions run consecutively, so causal / sliding-window masks on
    positions equal the same masks on indices there: the wrapper is looked through."""
    code = getattr(fn, "__code__", None)
    if code is codes["and"]:
        parts = _closure_vars(fn).get("mask_functions")
        if isinstance(parts, (tuple, list)):
            return [leaf for part in parts for leaf in _leaves(part, codes)]
    if codes.get("remap") is not None and code is codes["remap"]:
        inner = _closure_vars(fn).get("mask_function")
        if inner is not None:
            return _leaves(inner, codes)
    return [fn]


def classify_mask_function(mask_function) -> MaskPattern:
    """The MaskPattern of a transformers mask_function; UnsupportedAttention for anything flash4
    cannot express (or_masks, chunked or blockwise overlays, user functions, ...)."""
    codes = _mask_codes()
    causal = window = bidir_window = packed = None
    for leaf in _leaves(mask_function, codes):
        code = getattr(leaf, "__code__", None)
        if leaf is codes["causal"]:
            causal = True if causal is None else causal
        elif leaf is codes["bidirectional"]:
            causal = False if causal is None else causal
        elif code is not None and code is codes["sliding"]:
            window = int(_closure_vars(leaf)["sliding_window"])
        elif code is not None and code is codes["sliding_bidirectional"]:
            bidir_window = int(_closure_vars(leaf)["sliding_window"])
        elif code is not None and code is codes["packed"]:
            packed = _closure_vars(leaf)["packed_sequence_mask"]
        else:
            what = getattr(leaf, "__qualname__", type(leaf).__name__)
            _fail(f"the model asks for an attention mask pattern flash4 cannot express ({what}: e.g. an "
                  f"or_mask_function / and_mask_function overlay, chunked attention or block / image-token masks); "
                  f"flash4 serves causal, sliding-window causal and bidirectional masks with padding or packed "
                  f"sequences")
    if bidir_window is not None:
        _fail(f"a bidirectional sliding window ({bidir_window}) is not supported (transformers' masks and flash "
              f"backends disagree on its width)")
    return MaskPattern(causal=causal, window=window, bidirectional_window=bidir_window, packed=packed)


def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask: torch.Tensor | None = None, **kwargs):
    """AttentionMaskInterface entry: what the model then passes to `attention_forward` as its
    attention_mask. Returns None (nothing padded: dense kernels), the 2D bool padding mask
    (B, n <= kv_length) of the keys this layer sees (as transformers' flash_attention_mask), or
    for packed sequences their ids as int32 -1 - id (B, S). A causal mask without a 2D mask over
    a StaticCache (kv_length > the tokens present) gets an all-True mask of the present tokens,
    so the attention cuts the unused slots. Refuses mask patterns flash4 cannot serve
    (classify_mask_function)."""
    if mask_function is None:
        from transformers.masking_utils import causal_mask_function as mask_function
    pattern = classify_mask_function(mask_function)
    if pattern.packed is not None:
        # (transformers detects packing only without a 2D mask and without a cache)
        return -1 - pattern.packed.to(torch.int32)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            _fail(f"the mask function got a {attention_mask.dim()}-D attention_mask; flash4 takes 2D padding masks")
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.bool()
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    if pattern.causal:
        present = int(q_offset) + q_length - int(kv_offset)  # StaticCache: q_offset may be a 0-d tensor
        if 0 <= present < kv_length:
            device = kwargs.get("device", "cpu")
            return torch.ones(batch_size, present, dtype=torch.bool, device=device)
    return None


# ================================================================ mask analysis (cached per mask tensor)
@dataclass
class _Rows:
    """Valid positions of a 2D bool mask (B, M)."""

    batch_idx: torch.Tensor  # (nnz,) int64
    pos_idx: torch.Tensor  # (nnz,) int64
    cu_seqlens: torch.Tensor  # (B + 1,) int32
    max_seqlen: int
    all_valid: bool
    contiguous: bool  # every row's valid positions form one run


def _analyse(mask: torch.Tensor) -> _Rows:
    batch, width = mask.shape
    lengths = mask.sum(dim=1, dtype=torch.int32)
    batch_idx, pos_idx = mask.nonzero(as_tuple=True)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    if batch == 0 or width == 0:
        return _Rows(batch_idx, pos_idx, cu, 0, True, True)
    as_int = mask.to(torch.int8)
    first = as_int.argmax(dim=1)
    last = width - 1 - as_int.flip(1).argmax(dim=1)
    contiguous = ((last - first + 1) == lengths) | (lengths == 0)
    max_len, contig, n_valid = torch.stack([lengths.max().long(), contiguous.all().long(), lengths.sum().long()]).tolist()
    return _Rows(batch_idx, pos_idx, cu, int(max_len), n_valid == batch * width, bool(contig))


@dataclass
class _Packed:
    cu_seqlens: torch.Tensor  # (n + 1,) int32 over the flattened B * S rows
    max_seqlen: int


def _analyse_packed(ids: torch.Tensor) -> _Packed:
    batch, seqlen = ids.shape
    if ids.numel() and not bool((ids < 0).all()):
        _fail("a 2D int32 attention_mask that is not flash4's packed-sequence ids (-1 - id, from its mask function): "
              "pass padding masks through the model (they arrive as bool)")
    total = batch * seqlen
    start = torch.ones_like(ids, dtype=torch.bool)
    if seqlen > 1:
        start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = start.reshape(-1).nonzero().reshape(-1).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([total], dtype=torch.int32, device=ids.device)])
    max_len = int(cu.diff().max()) if cu.numel() > 1 else 0
    return _Packed(cu, max_len)


class _MaskCache:
    """A few (mask tensor, key) -> analysis entries: a model passes the same mask object to every
    layer of one forward, so the analysis (and its host sync) runs once per forward and mask kind."""

    def __init__(self, size: int = 8):
        self.size = size
        self.slots: list = []

    def get(self, mask: torch.Tensor, key, compute):
        if torch.compiler.is_compiling():
            return compute()
        version = mask._version
        for ref, ver, slot_key, value in self.slots:
            if ref() is mask and ver == version and slot_key == key:
                return value
        value = compute()
        self.slots = [slot for slot in self.slots if slot[0]() is not None]  # drop the analyses of dead masks
        self.slots.insert(0, (weakref.ref(mask), version, key, value))
        del self.slots[self.size:]
        return value

    def clear(self):
        self.slots.clear()


_MASKS = _MaskCache()


# ================================================================ attention_forward (AttentionInterface)
def _warn_once(message: str, _seen=set()):  # noqa: B006 (deliberate: one warning per message)
    if message not in _seen:
        _seen.add(message)
        warnings.warn("flash4 transformers attention: " + message, stacklevel=3)


def _target_dtype(query: torch.Tensor, module) -> torch.dtype | None:
    """transformers' flash rule for fp32 queries: the autocast dtype, else a bf16/fp16 Linear
    weight dtype of the layer (PEFT upcasts the norms only); None when there is none."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return dtype if dtype in _KERNELS.dtypes else None
    for layer in module.modules() if isinstance(module, torch.nn.Module) else ():
        if isinstance(layer, torch.nn.Linear):
            return layer.weight.dtype if layer.weight.dtype in _KERNELS.dtypes else None
    return None


def _deterministic(kwargs) -> bool:
    value = kwargs.get("deterministic")
    if value is not None:
        return bool(value)
    return torch.are_deterministic_algorithms_enabled() or os.getenv("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"


def _readable(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when flash4's kernels cannot read its layout."""
    from flash4.validate import layout_problem

    return t if layout_problem("t", t) is None else t.contiguous()


def _window(sliding_window, causal: bool, max_seqlen_k: int) -> tuple[int, int]:
    """transformers' sliding_window w -> flash-attn's (left, right) for flash4 ((-1, -1): none)."""
    if sliding_window is None or sliding_window is False:
        return (-1, -1)
    w = int(sliding_window)
    if w <= 0:
        _fail(f"sliding_window={sliding_window} (transformers' windows are >= 1 keys)")
    if not causal:
        _fail(f"sliding_window={w} with non-causal attention is not supported (transformers' bidirectional sliding "
              f"masks and its flash backends disagree on the window's width)")
    if max_seqlen_k <= w:  # the window spans every key: plain causal (transformers' flash path does the same)
        return (-1, -1)
    return (w - 1, 0)


def _prepare(module, query, key, value, dropout, softcap, s_aux, kwargs):
    """Checks shared by both entry points; returns (q, k, v, sink, softcap, v_head_dim) with q/k/v
    still in transformers' (B, H, S, D) layout (cast when needed)."""
    if kwargs.get("output_attentions", False):
        _warn_once("output_attentions=True is not supported (flash4 never forms the attention weights); "
                   "the weights returned are None")
    if dropout is not None and float(dropout) != 0.0:
        _fail(f"attention dropout {dropout} (flash4 has no dropout; it is passed in training mode when the config's "
              f"attention_dropout > 0: set it to 0.0 or use model.eval())")
    if kwargs.get("position_bias") is not None:
        _fail("position_bias (an additive attention bias) is not supported")
    headdims = _KERNELS.headdims()
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    for what, dim in (("query", head_dim), ("value", v_head_dim)):
        if dim not in headdims:
            _fail(f"head dim {dim} ({what}): flash4 serves head dims {headdims[0]}..{headdims[-1]} in steps of "
                  f"{headdims[1] - headdims[0]}" if len(headdims) > 1 else f"head dim {dim}")
    if key.shape[-1] != head_dim:
        _fail(f"query/key head dims {head_dim}/{key.shape[-1]}: flash4 needs the key head dim equal to the query's")
    if query.dtype not in _KERNELS.dtypes:
        target = _target_dtype(query, module) if query.dtype == torch.float32 else None
        if target is None:
            _fail(f"dtype {query.dtype}: flash4 runs {' and '.join(str(d) for d in _KERNELS.dtypes)} (load the model "
                  f"with dtype=torch.bfloat16, or run it under torch.autocast)")
        _warn_once(f"casting {query.dtype} query/key/value to {target} for flash4")
        query, key, value = query.to(target), key.to(target), value.to(target)
    softcap = 0.0 if softcap is None else float(softcap)
    sink = None
    if s_aux is not None:
        sink = s_aux.reshape(-1) if s_aux.dim() != 1 else s_aux
        if sink.numel() != query.shape[-3]:
            _fail(f"s_aux (attention sinks) has {s_aux.numel()} values; flash4 needs one per query head "
                  f"({query.shape[-3]})")
        if sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            sink = sink.float()
    return query, key, value, sink, softcap, v_head_dim


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry. query (B, H, S, D), key/value (B, H_kv, S_k, D) (any strides);
    attention_mask: what `mask_function` returned (None, 2D bool padding, packed ids). Returns
    (attn_output (B, S, H, D), None). The module docstring lists the mapping and the refusals."""
    query, key, value, sink, softcap, v_head_dim = _prepare(module, query, key, value, dropout, softcap, s_aux, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    common = dict(softmax_scale=None if scaling is None else float(scaling), softcap=softcap, learnable_sink=sink,
                  deterministic=_deterministic(kwargs))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views
    batch, seqlen_q, nheads, head_dim = q.shape

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            _fail("cu_seq_lens_q / cu_seq_lens_k together with a padding attention_mask (pass one of them)")
        out = _explicit_varlen(q, k, v, cu_q, cu_k, kwargs, causal, sliding_window, common)
    elif attention_mask is None:
        window = _window(sliding_window, causal, k.shape[1])
        out = _run("dense", _readable(q), _readable(k), _readable(v), causal=causal, window_size=window, **common)
    elif attention_mask.dim() != 2:
        _fail(f"a {attention_mask.dim()}-D attention_mask (a custom mask): flash4 takes padding masks only "
              f"(its mask function gives 2D masks; a 4D mask passed by the caller cannot be served)")
    elif attention_mask.dtype == torch.bool:
        out = _padded(q, k, v, attention_mask, causal, sliding_window, common)
    elif attention_mask.dtype == torch.int32:
        out = _packed(q, k, v, attention_mask, causal, sliding_window, common)
    else:
        _fail(f"a 2D attention_mask of dtype {attention_mask.dtype}: flash4's mask function gives bool padding masks "
              f"(or int32 packed-sequence ids); pass attention_mask through the model, not to the attention directly")
    return out, None


def _padded(q, k, v, mask, causal, sliding_window, common):
    """Attention over a padded batch: q (B, S, H, D), k/v (B, L, Hk, D) views, mask (B, M <= L)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    width = mask.shape[1]
    if mask.shape[0] != batch or width > k.shape[1] or (causal and width < seqlen_q):
        _fail(f"attention_mask of shape {tuple(mask.shape)} does not fit queries {seqlen_q} / keys {k.shape[1]} "
              f"(batch {batch})")
    if width < k.shape[1]:  # StaticCache: the slots past the mask hold no tokens yet
        k, v = k[:, :width], v[:, :width]
    keys = _MASKS.get(mask, "k", lambda: _analyse(mask))
    if keys.all_valid:
        window = _window(sliding_window, causal, width)
        return _run("dense", _readable(q), _readable(k), _readable(v), causal=causal, window_size=window, **common)
    window = _window(sliding_window, causal, keys.max_seqlen)
    if window != (-1, -1) and not keys.contiguous:
        _fail("a sliding window over a padding mask with holes (padding inside a row) is not supported: left or "
              "right padding only")
    if causal:  # the queries are the last seqlen_q columns of the mask
        queries = keys if width == seqlen_q else _MASKS.get(mask, ("q", seqlen_q),
                                                            lambda: _analyse(mask[:, width - seqlen_q:]))
        q_rows = q[queries.batch_idx, queries.pos_idx]
        cu_q, max_q = queries.cu_seqlens, queries.max_seqlen
    else:  # keys only are masked (as SDPA): every query row runs
        q_rows = q.reshape(batch * seqlen_q, nheads, head_dim)
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        max_q = seqlen_q
    k_rows, v_rows = k[keys.batch_idx, keys.pos_idx], v[keys.batch_idx, keys.pos_idx]
    out_rows = _run("varlen", _readable(q_rows), _readable(k_rows), _readable(v_rows), cu_q, keys.cu_seqlens, max_q,
                    keys.max_seqlen, causal=causal, window_size=window, **common)
    if not causal:
        return out_rows.view(batch, seqlen_q, nheads, head_dim)
    out = out_rows.new_zeros(batch, seqlen_q, nheads, head_dim)
    return out.index_put((queries.batch_idx, queries.pos_idx), out_rows)


def _packed(q, k, v, ids, causal, sliding_window, common):
    """Packed sequences (transformers' packed_sequence_mask, encoded -1 - id): one varlen sequence
    per run of equal ids in each row. q, k, v (B, S, H, D) views of the same length."""
    batch, seqlen, nheads, head_dim = q.shape
    if tuple(ids.shape) != (batch, seqlen) or k.shape[1] != seqlen:
        _fail(f"packed-sequence ids of shape {tuple(ids.shape)} do not fit queries {seqlen} / keys {k.shape[1]}")
    packed = _MASKS.get(ids, "packed", lambda: _analyse_packed(ids))
    window = _window(sliding_window, causal, packed.max_seqlen)
    rows = [t.reshape(batch * seqlen, t.shape[2], head_dim) for t in (q, k, v)]
    out = _run("varlen", *(_readable(t) for t in rows), packed.cu_seqlens, packed.cu_seqlens, packed.max_seqlen,
               packed.max_seqlen, causal=causal, window_size=window, **common)
    return out.view(batch, seqlen, nheads, head_dim)


def _explicit_varlen(q, k, v, cu_q, cu_k, kwargs, causal, sliding_window, common):
    """FlashAttentionKwargs (cu_seq_lens_q / cu_seq_lens_k / max_length_q / max_length_k): the
    batch is already flattened (B = 1 in transformers' collators)."""
    if cu_q is None or cu_k is None:
        _fail("cu_seq_lens_q and cu_seq_lens_k must be given together")
    batch, seqlen_q, nheads, head_dim = q.shape
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
    max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    rows = [t.reshape(-1, t.shape[2], head_dim) for t in (q, k, v)]
    window = _window(sliding_window, causal, max_k)
    out = _run("varlen", *(_readable(t) for t in rows), cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
               **common)
    return out.view(batch, seqlen_q, nheads, head_dim)


# ================================================================ paged|name (continuous batching)
def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_seqlen_q=None,
                            max_seqlen_k=None, block_table=None, dropout: float = 0.0, scaling: float | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry for "paged|name" (transformers' continuous batching):
    query (1, H, total_q, D), key/value (1, H_kv, new_tokens, D); the cache stores the new keys
    (cache.update with read_index / write_index) and returns the packed keys of every sequence;
    attention is varlen causal per sequence (bottom-right: the queries are each sequence's last
    tokens). Returns ((total_q, H, D), None). The 4D attention_mask continuous batching may build
    is not read (cu_seq_lens say the same)."""
    if cache is None:
        _fail(f"{PAGED_PREFIX}{DEFAULT_NAME}-style attention was called without a paged cache (use the plain name "
              f"for a standard forward)", hint=False)
    if block_table is not None:
        _fail("the block-table decode path is not supported (transformers enables it for flash-attn 2/3 only)")
    if cu_seq_lens_q is None or cu_seq_lens_k is None:
        _fail("paged attention needs cu_seq_lens_q and cu_seq_lens_k")
    query, key, value, sink, softcap, v_head_dim = _prepare(module, query, key, value, dropout, softcap, s_aux, kwargs)
    head_dim = query.shape[-1]
    # the layer's window: the keyword the model passes (mistral), else the module's (gemma2, gpt-oss)
    sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    layer_type = "sliding_attention" if sliding else "full_attention"
    if isinstance(cu_seq_lens_k, dict):
        cu_seq_lens_k = cu_seq_lens_k[layer_type]
    if isinstance(max_seqlen_k, dict):
        max_seqlen_k = max_seqlen_k[layer_type]
    k_rows, v_rows = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    q_rows = query.transpose(1, 2).reshape(-1, query.shape[1], head_dim)
    cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    max_q = int(max_seqlen_q) if max_seqlen_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
    max_k = int(max_seqlen_k) if max_seqlen_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    out = _run("varlen", _readable(q_rows), _readable(k_rows), _readable(v_rows), cu_q, cu_k, max_q, max_k,
               softmax_scale=None if scale is None else float(scale), causal=True,
               window_size=_window(sliding, True, max_k), softcap=softcap, learnable_sink=sink,
               deterministic=_deterministic(kwargs))
    return out, None


__all__ = ["DEFAULT_NAME", "MaskPattern", "UnsupportedAttention", "attention_forward", "check_name",
           "classify_mask_function", "mask_function", "paged_attention_forward", "register", "unregister"]
