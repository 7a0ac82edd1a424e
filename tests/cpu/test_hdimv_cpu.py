"""A value head dim different from the query/key head dim (issue 13 item 1: DeepSeek MLA prefill
192/128, and 128/64, 64/128) on the CPU: config selection, validation messages, the shapes the
fakes and the reference give, and the compile checks of the Dv != D kernels (sm_90a, no spills;
not yet run on a GPU)."""

import pytest
import torch

from flash4.config import (HDIMV_PAIRS, SM90_MAX_SMEM_BYTES, FwdConfig, select_bwd_config, select_fwd_config,
                           shipped_bwd_configs, shipped_fwd_configs)
from flash4.reference import attention_ref, attention_varlen_ref
from flash4.validate import kvcache_support_error, support_error, varlen_support_error

BF16 = torch.bfloat16
PAIRS = [(192, 128), (128, 64), (64, 128)]
IDS = [f"{d}v{dv}" for d, dv in PAIRS]


# ---------------------------------------------------------------- configs
def test_pairs():
    assert set(HDIMV_PAIRS) == set(PAIRS)


@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_config(d, dv, causal):
    cfg = select_fwd_config(d, "bf16", causal, headdim_v=dv)
    assert (cfg.headdim, cfg.headdim_v, cfg.hdim_v) == (d, dv, dv)
    assert (cfg.tile_m, cfg.tile_n) == (128, 128)  # 2 consumer warpgroups (240 registers)
    assert cfg.causal == causal and cfg.lpt == causal
    assert cfg.smem_bytes() <= SM90_MAX_SMEM_BYTES - 1024
    # O is staged in Q's buffer: sized for the larger of the two
    assert cfg.smem_bytes() == 128 * max(d, dv) * 2 + 2 * 128 * (d + dv) * 2


def test_fwd_config_192_128_smem():
    assert select_fwd_config(192, "bf16", False, headdim_v=128).smem_bytes() == 208 * 1024
    assert select_fwd_config(192, "bf16", False, local=True, headdim_v=128).tile_n == 112


@pytest.mark.parametrize("d", [64, 128, 192])
def test_equal_headdim_v_is_the_plain_config(d):
    plain = select_fwd_config(d, "bf16", True)
    assert plain.headdim_v is None and plain.hdim_v == d
    assert select_fwd_config(d, "bf16", True, headdim_v=d) == plain
    assert select_bwd_config(d, "bf16", True, headdim_v=d) == select_bwd_config(d, "bf16", True)


def test_plain_smem_unchanged():
    # the formula with Dv = D is the old one: Q + 2 * stages * tile_n * D (+ the P tile with p_smem)
    for cfg in shipped_fwd_configs():
        if cfg.headdim_v is None:
            p_tile = cfg.tile_m * cfg.tile_n * 2 if cfg.p_smem else 0
            assert cfg.smem_bytes() == (cfg.tile_m * cfg.headdim * 2 + 2 * cfg.kv_stages * cfg.tile_n * cfg.headdim * 2
                                        + p_tile)


@pytest.mark.parametrize("select", [select_fwd_config, select_bwd_config])
@pytest.mark.parametrize("d, dv", [(128, 96), (192, 64), (256, 128), (64, 256)])
def test_unsupported_pairs_raise(select, d, dv):
    with pytest.raises(ValueError, match=r"\(192, 128\), \(128, 64\), \(64, 128\)"):
        select(d, "bf16", False, headdim_v=dv)


def test_config_rejects_unsupported_field():
    with pytest.raises(AssertionError):
        FwdConfig(headdim=128, headdim_v=96)
    with pytest.raises(AssertionError):
        FwdConfig(headdim=128, headdim_v=128)  # equal: the field is None


@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_bwd_config(d, dv):
    cfg = select_bwd_config(d, "bf16", True, headdim_v=dv)
    assert (cfg.headdim_v, cfg.hdim_v, cfg.tile_m) == (dv, dv, 64)
    # (192, 128): the transposed-dK/dV kernel (96 keys per CTA); the other pairs 128 keys
    assert not cfg.split_headdim and cfg.transposed_dkv == (d == 192) and cfg.tile_n == (96 if d == 192 else 128)
    assert cfg.q_stages == 2 and cfg.smem_bytes() <= SM90_MAX_SMEM_BYTES - 1024
    assert select_bwd_config(d, "bf16", False, deterministic=True, headdim_v=dv).deterministic


def test_shipped_configs_cover_the_pairs():
    fwd = {(c.headdim, c.headdim_v, c.dtype, c.causal) for c in shipped_fwd_configs()}
    bwd = {(c.headdim, c.headdim_v, c.dtype, c.causal) for c in shipped_bwd_configs()}
    for d, dv in PAIRS:
        for dt in ("bf16", "fp16"):
            for causal in (False, True):
                assert (d, dv, dt, causal) in fwd and (d, dv, dt, causal) in bwd


def test_decode_plan_with_headdim_v():
    from flash4.config.sm90 import decode_plan

    plan = decode_plan(2, 1, 16, 2, 192, "bf16", False, 0, 4096, 0, 90, 132, headdim_v=128)
    assert plan.cfg.headdim_v == 128 and plan.cfg.smem_bytes() <= SM90_MAX_SMEM_BYTES - 1024
    plan = decode_plan(2, 1, 16, 2, 64, "bf16", False, 64, 4096, 4, 90, 132, headdim_v=128)
    assert plan.cfg.headdim_v == 128 and plan.cfg.split_kv and plan.cfg.page_rows == 64


# ---------------------------------------------------------------- validation
def _qkv(d, dv, b=2, sq=16, sk=24, h=4, hk=2):
    return (torch.randn(b, sq, h, d, dtype=BF16), torch.randn(b, sk, hk, d, dtype=BF16),
            torch.randn(b, sk, hk, dv, dtype=BF16))


@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_supported_pairs_pass_metadata_checks(d, dv):
    assert "cpu" in support_error(*_qkv(d, dv))  # only the device is wrong


@pytest.mark.parametrize("d, dv", [(128, 96), (64, 256), (192, 64)])
def test_other_pairs_are_padded_not_refused(d, dv):
    """Pairs without a kernel are zero-padded to one by flash_attn_func (flash4.headdim): the rule
    accepts them; the kernel-level check (config.hdimv_problem) still names the kernel pairs."""
    from flash4.config import hdimv_problem

    message = support_error(*_qkv(d, dv))
    assert message is None or "headdim" not in message
    problem = hdimv_problem(d, dv)
    assert f"v's headdim {dv}" in problem and "(192, 128), (128, 64), (64, 128)" in problem


@pytest.mark.parametrize("d, dv", [(128, 100), (64, 4)])
def test_unservable_v_headdim_message(d, dv):
    message = support_error(*_qkv(d, dv))
    assert f"headdim {dv} (v.shape[3]) is not supported" in message and "multiple of 8" in message


def test_v_must_match_k_but_its_headdim():
    q, k, v = _qkv(192, 128)
    message = support_error(q, k, v[:, :5])
    assert "v must have the shape of k" in message and "only its headdim may differ" in message
    message = support_error(q, k, v[:, :, :1])
    assert "v must have the shape of k" in message


def test_k_headdim_must_match_q():
    q, k, v = _qkv(192, 128)
    assert "need the same headdim" in support_error(q, v, v)


def test_varlen_validation():
    q, k, v = (torch.randn(10, 4, 192, dtype=BF16), torch.randn(12, 2, 192, dtype=BF16),
               torch.randn(12, 2, 128, dtype=BF16))
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    assert "cpu" in varlen_support_error(q, k, v, cu_q, cu_k)
    # (192, 96) has no kernel: packed varlen tensors are zero-padded to (192, 128) (flash4.headdim)
    assert "cpu" in varlen_support_error(q, k, v[..., :96], cu_q, cu_k)
    assert "multiple of 8" in varlen_support_error(q, k, v[..., :100], cu_q, cu_k)
    assert "v must have the shape of k" in varlen_support_error(q, k, v[:6], cu_q, cu_k)


def test_kvcache_validation():
    q = torch.randn(2, 1, 4, 192, dtype=BF16)
    k_cache, v_cache = torch.randn(2, 32, 2, 192, dtype=BF16), torch.randn(2, 32, 2, 128, dtype=BF16)
    assert "cpu" in kvcache_support_error(q, k_cache, v_cache, cache_seqlens=8)
    k_new, v_new = torch.randn(2, 3, 2, 192, dtype=BF16), torch.randn(2, 3, 2, 128, dtype=BF16)
    assert "cpu" in kvcache_support_error(q, k_cache, v_cache, k_new, v_new, cache_seqlens=8)
    message = kvcache_support_error(q, k_cache, v_cache, k_new, k_new, cache_seqlens=8)
    assert "k and v must be" in message and "(2, 3, 2, 128)" in message
    out_ok = torch.empty(2, 1, 4, 128, dtype=BF16)
    assert "cpu" in kvcache_support_error(q, k_cache, v_cache, cache_seqlens=8, out=out_ok)
    message = kvcache_support_error(q, k_cache, v_cache, cache_seqlens=8, out=torch.empty_like(q))
    assert "out must have the shape of q with v_cache's headdim" in message and "(2, 1, 4, 128)" in message
    message = kvcache_support_error(q, k_cache, v_cache[..., :64], cache_seqlens=8)
    assert "(192, 128), (128, 64), (64, 128)" in message


def test_out_buffer_checked_with_dv():
    from flash4.forward import _check_buffer

    _check_buffer("out", torch.empty(2, 16, 4, 128, dtype=BF16), (2, 16, 4, 128), BF16, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"shape \(2, 16, 4, 128\)"):
        _check_buffer("out", torch.empty(2, 16, 4, 192, dtype=BF16), (2, 16, 4, 128), BF16, torch.device("cpu"))


# ---------------------------------------------------------------- fakes and the reference
@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_op_fakes_have_dv(d, dv):
    from flash4 import ops

    q, k, v = (t.to("meta") for t in _qkv(d, dv))
    out, lse, lse_split = ops._fwd_fake(q, k, v, 1.0, False, False)
    assert out.shape == (2, 16, 4, dv) and lse.shape == (2, 4, 16) and lse_split.shape == (2, 2, 4, 16)
    dq, dk, dv_ = ops._grads_fake(q, k, v)
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
    qv, kv, vv = q[0], k[0], v[0]  # packed (total, heads, d)
    out, lse, _ = ops._varlen_fwd_fake(qv, kv, vv, None, None, None, None, None, None, None, 1.0, False, False, False)
    assert out.shape == (16, 4, dv)
    out, lse = ops._kvcache_fake(q, k, v, None, None, None, None, None, None, 1.0, False, 0, False)
    assert out.shape == (2, 16, 4, dv) and lse.shape == (2, 4, 16)


@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_reference_with_dv(d, dv):
    q, k, v = (t.float() for t in _qkv(d, dv, b=1, sq=5, sk=7))
    out, lse = attention_ref(q, k, v, causal=True)
    assert out.shape == (1, 5, 4, dv) and lse.shape == (1, 4, 5)
    kr = k.repeat_interleave(2, dim=2)
    vr = v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) / d ** 0.5  # default scale from q's head dim
    mask = torch.ones(5, 7, dtype=torch.bool).tril(7 - 5)
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    assert torch.allclose(out, torch.einsum("bhqk,bkhd->bqhd", p, vr), atol=1e-5)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    out_v, _ = attention_varlen_ref(q[0], k[0], v[0], cu_q, cu_k)
    assert out_v.shape == (5, 4, dv)


# ---------------------------------------------------------------- compile checks
pytest.importorskip("cutlass")


@pytest.mark.parametrize("d, dv", PAIRS, ids=IDS)
def test_fake_args_have_dv(d, dv):
    from flash4.compile.fake import bwd_fake_args, fwd_fake_args, split_fake_args

    q, k, v, o = fwd_fake_args(d, "bf16", headdim_v=dv)[:4]
    assert (q.shape[-1], k.shape[-1], v.shape[-1], o.shape[-1]) == (d, d, dv, dv)
    o_acc, _ = split_fake_args(FwdConfig(headdim=d, headdim_v=dv, split_kv=True, seqused_k=True))
    assert o_acc.shape[-1] == dv
    args = bwd_fake_args(d, "bf16", headdim_v=dv)
    q, k, v, do, _, _, dq_acc, dk, dv_ = args[:9]
    assert [t.shape[-1] for t in (q, k, v, do, dq_acc, dk, dv_)] == [d, d, dv, dv, d, d, dv]


def _configs():
    from flash4.config import with_seq_layout

    configs = []
    for d, dv in PAIRS:
        for causal in (False, True):
            configs.append(select_fwd_config(d, "bf16", causal, headdim_v=dv))
            configs.append(select_bwd_config(d, "bf16", causal, headdim_v=dv))
    configs += [
        # varlen, paged + split-KV (decode), a window, fp16, varlen backward, deterministic
        with_seq_layout(select_fwd_config(192, "bf16", True, headdim_v=128), varlen_q=True, varlen_k=True),
        with_seq_layout(select_fwd_config(192, "bf16", False, headdim_v=128), seqused_k=True, page_rows=64,
                        split_kv=True),
        with_seq_layout(select_fwd_config(64, "bf16", False, headdim_v=128), seqused_k=True, page_rows=16),
        select_fwd_config(192, "bf16", False, local=True, headdim_v=128),
        select_fwd_config(128, "fp16", True, headdim_v=64),
        with_seq_layout(select_bwd_config(192, "bf16", True, headdim_v=128), varlen_q=True, varlen_k=True),
        select_bwd_config(64, "fp16", True, deterministic=True, headdim_v=128),
    ]
    # decode steps (GQA-packed, one consumer warpgroup, the deepest K/V pipeline that fits, split-KV)
    from flash4.config.sm90 import decode_plan

    for d, dv in PAIRS:
        configs.append(decode_plan(2, 1, 16, 2, d, "bf16", False, 64, 4096, 0, 90, 132, headdim_v=dv).cfg)
    return configs


CONFIGS = _configs()


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.check import compile_check

    return compile_check(CONFIGS)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[f"{type(c).__name__[:3].lower()}{c.headdim}v{c.headdim_v}"
                                                        f"{'c' if c.causal else ''}-{i}" for i, c in enumerate(CONFIGS)])
def test_hdimv_kernels_compile(rows, i, compiled_clean):
    row = rows[i]
    compiled_clean(row)


@pytest.mark.parametrize("dv", [64, 128])
def test_preprocess_and_combine_compile_for_dv(dv):
    # the preprocess (rowsum(dO * O) over Dv) and the split-KV combine are keyed by Dv alone
    from flash4.compile.cache import get_bwd_preprocess_runner, get_combine_runner

    get_bwd_preprocess_runner(dv, "bf16")
    get_combine_runner(dv, "bf16")


def test_bench_cells():
    from flash4.bench import cases

    names = {c.name: c for c in cases.CASES}
    for name in ("hdimv_192_128_causal_4k", "hdimv_192_128_full_4k", "hdimv_192_128_causal_16k",
                 "hdimv_192_128_full_16k", "hdimv_128_64_causal_4k", "hdimv_64_128_causal_4k"):
        c = names[name]
        assert c.batch * c.seqlen_q == 32768 and c.headdim_v is not None and c.headdim_v != c.headdim
    c = names["hdimv_192_128_full_4k"]
    pairs = 4096 * 4096
    assert cases.case_fwd_flops(c) == 2.0 * 8 * 16 * (192 + 128) * pairs
    assert cases.case_bwd_flops(c) == 2.0 * 8 * 16 * (3 * 192 + 2 * 128) * pairs
    same = cases.Case("x", 128, False, 4096, 4096, 8, 16, 16)
    assert cases.case_bwd_flops(same) == 2.5 * cases.case_fwd_flops(same)
    assert [c.name for c in cases.select_cases(["hdimv_192"])][:2] == ["hdimv_192_128_causal_4k",
                                                                        "hdimv_192_128_full_4k"]
