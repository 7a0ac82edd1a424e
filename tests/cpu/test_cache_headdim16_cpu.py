"""KV caches and paged pools at the sm_90 kernel head dims (FLASH4_CACHE_HEADDIM16, on by default)
without a GPU: which head dims the two cache doors take with the switch off / on and per SM version,
the doors' plumbing at d32 / d80 / d112 with the reference in place of the kernels (conftest.py), and
that the configs those doors select (decode steps with GQA packing and split-KV over dense and paged
caches, TMA page pieces and gathered pages, paged prefill) compile for sm_90a without spills.
GPU twin: tests/gpu/test_cache_headdim16.py (94 passed on an H100, 2026-12-05)."""

import pytest
import torch
from cpu_helpers import kv_args, kv_raises, paged_args, varlen_raises

import flash4
from flash4 import env, headdim as hd
from flash4.config import SUPPORTED_HEADDIMS, paged_layout, with_seq_layout
from flash4.config.sm90 import KERNEL_HEADDIMS, decode_plan, gather_policy, page_policy, select_fwd_config
from flash4.reference import attention_varlen_ref, kvcache_ref
from flash4.validate import kvcache_support_error, varlen_support_error

BF16 = torch.bfloat16
NEW = (16, 32, 48, 80, 112)


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE_HEADDIM16", "1")
    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.delenv("FLASH4_HEADDIM16", raising=False)
    monkeypatch.delenv("FLASH4_FAMILY", raising=False)


def test_switch_on_by_default_and_zero_refuses(monkeypatch):
    monkeypatch.delenv("FLASH4_CACHE_HEADDIM16", raising=False)
    monkeypatch.delenv("FLASH4_HEADDIM16", raising=False)
    assert env.cache_headdim16()
    assert hd.cache_headdims(90) == KERNEL_HEADDIMS
    assert "FLASH4_CACHE_HEADDIM16" in env.PLAN_VARIABLES  # the memo keys on it
    monkeypatch.setenv("FLASH4_CACHE_HEADDIM16", "0")
    assert not env.cache_headdim16()
    assert hd.cache_headdims(90) == SUPPORTED_HEADDIMS
    monkeypatch.setenv("FLASH4_ARCH", "90")
    kv_raises(ValueError, ("headdim 80 (q.shape[3]) is not supported here", "FLASH4_CACHE_HEADDIM16=0 is set"),
              **kv_args(d=80))
    varlen_raises(ValueError, ("headdim 32 (q.shape[2]) is not supported here",), **paged_args(d=32))


def test_no_switch_hint_where_the_family_has_no_kernel(monkeypatch):
    """On by default, a head dim the GPU family has no kernel for is refused without pointing at
    the switch (sm_80: the portable family's own head dims)."""
    monkeypatch.delenv("FLASH4_CACHE_HEADDIM16", raising=False)
    monkeypatch.setenv("FLASH4_ARCH", "80")
    with pytest.raises(ValueError) as err:
        flash4.flash_attn_with_kvcache(**kv_args(d=80))
    assert "headdim 80 (q.shape[3]) is not supported here" in str(err.value)
    assert "FLASH4_CACHE_HEADDIM16" not in str(err.value)


def test_cache_headdims_per_arch(on, monkeypatch):
    assert hd.cache_headdims(90) == KERNEL_HEADDIMS
    assert hd.cache_headdims(None) == SUPPORTED_HEADDIMS
    monkeypatch.delenv("FLASH4_ARCH")
    assert hd.cache_headdims(80) == SUPPORTED_HEADDIMS  # the portable family: its own head dims only
    monkeypatch.setenv("FLASH4_HEADDIM16", "0")
    assert hd.cache_headdims(90) == SUPPORTED_HEADDIMS  # sm_90 without its multiple-of-16 kernels


@pytest.mark.parametrize("d", NEW)
def test_switch_on_admits_kernel_headdims(on, d):
    # past validation: only the CPU device is left to refuse
    assert "q is on cpu" in kvcache_support_error(**kv_args(d=d))
    assert "q is on cpu" in kvcache_support_error(**kv_args(d=d, paged=True, page_size=16))
    assert "q is on cpu" in varlen_support_error(**paged_args(d=d, page_size=5))


@pytest.mark.parametrize("d", [72, 40, 136])
def test_switch_on_still_refuses_padded_headdims(on, d):
    kv_raises(ValueError, (f"headdim {d} (q.shape[3]) is not supported here", "allowed: 16, 32, 48, 64, 80"),
              **kv_args(d=d))


def test_switch_on_other_arch_refuses(on, monkeypatch):
    monkeypatch.setenv("FLASH4_ARCH", "80")
    kv_raises(ValueError, ("headdim 80 (q.shape[3]) is not supported here", "allowed: 64, 96, 128, 192, 256"),
              **kv_args(d=80))


@pytest.mark.parametrize("d", [32, 80, 112])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_door_at_kernel_headdims(cpu_kernels, on, d, paged):
    args = kv_args(b=3, sq=2, s_new=2, d=d, paged=paged, s_cache=40, page_size=16)
    seqlens = args["cache_seqlens"].tolist()
    k_exp, v_exp = args["k_cache"].clone(), args["v_cache"].clone()
    for b, start in enumerate(seqlens):
        for t in range(2):
            pos = start + t
            where = (int(args["page_table"][b, pos // 16]), pos % 16) if paged else (b, pos)
            k_exp[where], v_exp[where] = args["k"][b, t], args["v"][b, t]
    out, lse = flash4.flash_attn_with_kvcache(**args, causal=True, return_lse=True, check_seqlens=True)
    assert torch.equal(args["k_cache"], k_exp) and torch.equal(args["v_cache"], v_exp)
    ref, ref_lse = kvcache_ref(args["q"], k_exp, v_exp, [n + 2 for n in seqlens],
                               page_table=args.get("page_table"), causal=True)
    assert out.shape == args["q"].shape and torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)
    call = cpu_kernels[0]
    assert call["decode"] and call["request"].q.shape[-1] == d


@pytest.mark.parametrize("d, page_size", [(48, 16), (80, 5), (16, 64)])
def test_varlen_paged_door_at_kernel_headdims(cpu_kernels, on, d, page_size):
    from flash4.config import fwd_config

    paged = paged_args(len_q=(3, 0, 5), len_k=(20, 0, 33), d=d, page_size=page_size)
    out = flash4.flash_attn_varlen_func(**paged, max_seqlen_q=5, causal=True, check_seqlens=True)
    ref, _ = attention_varlen_ref(paged["q"], paged["k"], paged["v"], paged["cu_seqlens_q"], None, None,
                                  paged["seqused_k"], paged["page_table"], causal=True)
    assert torch.equal(out, ref.to(BF16))
    cfg = fwd_config(cpu_kernels[0]["request"], 90).cfg
    assert cfg.paged and cfg.headdim == d


def _door_configs():
    """The configs the two cache doors select at the new head dims (the door's own page policy)."""
    policy = dict(page_policy=page_policy(), gather_zero_fill=gather_policy())
    cfgs = {
        "d32-decode-dense-split": decode_plan(8, 1, 32, 8, 32, "bf16", True, 0, 32768, 0, 90, 132, **policy).cfg,
        "d80-decode-page16": decode_plan(8, 1, 32, 8, 80, "bf16", True, 16, 32768, 0, 90, 132, **policy).cfg,
        "d112-decode-page64": decode_plan(8, 1, 32, 8, 112, "bf16", True, 64, 32768, 0, 90, 132, **policy).cfg,
        "d48-decode-page5": decode_plan(8, 1, 32, 8, 48, "bf16", True, 5, 8192, 0, 90, 132, **policy).cfg,
        "d16-spec4-page64": decode_plan(8, 4, 32, 8, 16, "bf16", True, 64, 8192, 0, 90, 132, **policy).cfg,
    }
    for d, page_size, causal in ((80, 16, True), (32, 64, False), (112, 32, True), (16, 3, True)):
        base = select_fwd_config(d, "bf16", causal)
        cfgs[f"d{d}-prefill-page{page_size}"] = with_seq_layout(base, varlen_q=True, seqused_k=True,
                                                                **paged_layout(page_size, base.tile_n, *page_policy()))
    return cfgs


def test_door_configs_cover_the_paths():
    cfgs = _door_configs()
    assert cfgs["d32-decode-dense-split"].split_kv and not cfgs["d32-decode-dense-split"].paged
    assert cfgs["d80-decode-page16"].page_gather  # pages of <= PAGE_GATHER_MAX rows gather
    assert cfgs["d112-decode-page64"].page_prefetch and cfgs["d112-decode-page64"].split_kv
    assert cfgs["d48-decode-page5"].page_gather
    assert cfgs["d112-prefill-page32"].page_prefetch and cfgs["d16-prefill-page3"].page_gather
    assert all(cfg.headdim in NEW for cfg in cfgs.values())


@pytest.mark.parametrize("name", sorted(_door_configs()))
def test_door_configs_compile_without_spills(name, compiled_clean):
    """sm_90a, 0 spills, HGMMA not serialized (compiled_clean's checks) for every path above."""
    pytest.importorskip("cutlass")
    from flash4.compile.check import compile_check

    (row,) = compile_check([_door_configs()[name]])
    compiled_clean(row)
