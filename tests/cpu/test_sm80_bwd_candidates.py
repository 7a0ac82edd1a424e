"""The portable backward's speed candidates (flash4.config.sm80.bwd_candidates; tools/ab_portable.py
times them on the H200): each fits its target's shared memory, and the ones the A/B runs compile
for sm_80 and sm_90a with no register spill (docs/design/sm80_family.md, "Backward speed"), as do
the register-order dQ postprocess and the 99 KiB targets' "coal" variant.
"""

import re

import pytest

from flash4.arch import capacity
from flash4.config.sm80 import TARGETS, bwd_candidates, gpu_arch_name, select_bwd_config, shipped_bwd_configs


def test_candidates_are_dense_coalesced_and_fit():
    for arch in TARGETS:
        for cfg in shipped_bwd_configs(arch):
            cands = bwd_candidates(cfg)
            assert "coal" in cands
            for name, cand in cands.items():
                assert cand.dq_coalesced and cand.dq_accum_order, (name, cand)
                assert cand.smem_bytes() <= capacity(arch).smem_per_block, (name, cand)
                assert (cand.headdim, cand.dtype, cand.causal, cand.arch) == (cfg.headdim, cfg.dtype, cfg.causal,
                                                                              cfg.arch)
            if "fa2" in cands:
                assert arch in (80, 90) and cfg.headdim in (64, 128), cands
            if "m128" in cands:
                assert arch in (80, 90) and cfg.headdim == 128 and cands["m128"].q_stages == (2 if arch == 90 else 1)
    assert not any(c.dq_coalesced for c in shipped_bwd_configs()), "candidates are not shipped"
    assert bwd_candidates(select_bwd_config(64, arch=90, varlen_q=True, varlen_k=True)) == {}


def test_dq_postprocess_kwargs():
    from flash4.compile.cache import dq_postprocess_kwargs

    cfg = select_bwd_config(128, arch=90)
    assert dq_postprocess_kwargs(cfg) == {"accum_tile_m": None}
    fa2 = bwd_candidates(cfg)["fa2"]
    assert dq_postprocess_kwargs(fa2) == {"accum_tile_m": 64, "sm80_warps": (8, fa2.warps_m_dq)}


def test_env_selects_a_candidate(monkeypatch):
    """FLASH4_PORTABLE_BWD runs a candidate where it applies (bwd_plan), the table where not."""
    torch = pytest.importorskip("torch")
    from flash4.config.sm80 import bwd_plan
    from flash4.request import Request

    def req(d):
        q = torch.empty(2, 256, 4, d, device="meta", dtype=torch.bfloat16)
        return Request.dense(q, q, q, d ** -0.5, True, (-1, -1), 0.0, None)

    table = select_bwd_config(128, "bf16", True, arch=90)
    monkeypatch.setenv("FLASH4_PORTABLE_BWD", "fa2")
    assert bwd_plan(req(128), 90).cfg == bwd_candidates(table)["fa2"]
    assert bwd_plan(req(128), 86).cfg == select_bwd_config(128, "bf16", True, arch=86)  # no fa2 on 99 KiB
    monkeypatch.setenv("FLASH4_PORTABLE_BWD", "COAL")
    assert bwd_plan(req(128), 86).cfg == bwd_candidates(select_bwd_config(128, "bf16", True, arch=86))["coal"]
    monkeypatch.setenv("FLASH4_PORTABLE_BWD", "big")
    with pytest.raises(ValueError, match="FLASH4_PORTABLE_BWD"):
        bwd_plan(req(128), 90)


def test_shipped_candidate_rule(monkeypatch):
    """bwd_plan ships shipped_bwd_candidate (since 2026-12-05 fa2w at d64, fa2s at d128 but fa2 on sm_80)
    for plain dense problems where it applies; softcap, windows, the deterministic order, packed
    sequences and the 99 KiB targets keep the table; FLASH4_PORTABLE_BWD=table restores the table
    everywhere."""
    torch = pytest.importorskip("torch")
    from flash4.config.sm80 import bwd_plan, shipped_bwd_candidate
    from flash4.request import Request

    monkeypatch.delenv("FLASH4_PORTABLE_BWD", raising=False)

    def req(d, causal=True, window=(-1, -1), softcap=0.0, deterministic=False):
        q = torch.empty(2, 256, 4, d, device="meta", dtype=torch.bfloat16)
        return Request.dense(q, q, q, d ** -0.5, causal, window, softcap, None, deterministic=deterministic)

    for d in (64, 128):
        for arch in (80, 90):
            table = select_bwd_config(d, "bf16", True, arch=arch)
            name = shipped_bwd_candidate(table)
            assert name == ("fa2w" if d == 64 else "fa2" if arch == 80 else "fa2s"), (d, arch, name)
            assert bwd_plan(req(d), arch).cfg == bwd_candidates(table)[name]
        assert bwd_plan(req(d), 86).cfg == select_bwd_config(d, "bf16", True, arch=86)
        assert not bwd_plan(req(d, softcap=5.0), 90).cfg.dq_coalesced
        assert not bwd_plan(req(d, causal=False, window=(64, 0)), 90).cfg.dq_coalesced
        assert not bwd_plan(req(d, deterministic=True), 90).cfg.dq_coalesced
    assert bwd_plan(req(96), 90).cfg == select_bwd_config(96, "bf16", True, arch=90)  # no fa2 tiles at d96
    monkeypatch.setenv("FLASH4_PORTABLE_BWD", "table")
    assert bwd_plan(req(128), 90).cfg == select_bwd_config(128, "bf16", True, arch=90)


pytest.importorskip("cutlass")

CONFIGS = [bwd_candidates(select_bwd_config(d, "bf16", c, arch=a))[name]
           for a in (90, 80) for d in (64, 128) for c in (False, True) for name in ("coal", "fa2")]
CONFIGS += [bwd_candidates(select_bwd_config(128, "bf16", c, arch=a))["m128"] for a in (90, 80) for c in (False, True)]
CONFIGS += [bwd_candidates(select_bwd_config(128, "bf16", True, arch=86))["coal"],
            bwd_candidates(select_bwd_config(64, "fp16", False, arch=90))["fa2"],
            bwd_candidates(select_bwd_config(128, "fp16", True, arch=80))["fa2"]]


def _id(cfg):
    return (f"{gpu_arch_name(cfg.arch)}-d{cfg.headdim}-{cfg.dtype}-{'causal' if cfg.causal else 'full'}-"
            f"{cfg.tile_m}x{cfg.tile_n}q{cfg.q_stages}")


@pytest.fixture(scope="module")
def rows():
    from flash4.compile.cache import compile_bwd
    from flash4.compile.check import compile_check

    return compile_check(CONFIGS, compiler=compile_bwd)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[_id(c) for c in CONFIGS])
def test_candidate_compiles_clean(rows, i):
    row, cfg = rows[i], CONFIGS[i]
    from cpu_helpers import assert_portable_row_clean

    assert_portable_row_clean(row, cfg)


@pytest.mark.parametrize("arch", [80, 90])
def test_register_order_postprocess_compiles(arch):
    from flash4.compile.cache import compile_postprocess

    for tile_m, warps in ((64, (8, 2)), (128, (8, 4))):
        compile_postprocess(128 if tile_m == 64 else 64, "bf16", False, tile_m, arch=arch, sm80_warps=warps)


@pytest.mark.parametrize("d, name", [(64, "fa2e"), (64, "fa2s"), (128, "fa2s"), (64, "fa2w")])
def test_lse_early_keeps_the_lse_loads_under_the_gemms(d, name):
    """Sm80BwdConfig.lse_early (candidate fa2e): in the unmasked step loop of the sm_90a SASS, no
    unpredicated global load (LDG) sits after the exact path's predicated LSE hi / lo loads, i.e. in
    the common branch right before the exponentials; without it LLVM sank the two LSE loads there
    (the step then waits on them after both GEMMs). 0 spills (fa2e: d64; at d128 it spills, so that
    candidate is d64 only). Sm80BwdConfig.lse_smem (fa2s): LSE and D come from smem (LDS), staged with
    the tile's dO; 0 spills at d64 and d128 (sm_90a)."""
    import re

    from cpu_helpers import sass_main_loop
    from flash4.compile.cache import compile_bwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    fa2 = bwd_candidates(select_bwd_config(d, "bf16", False, arch=90))
    late = {}
    for cand in ("fa2", name):
        cubin = extract_cubin(compile_bwd(fa2[cand]))
        sass = sass_text(cubin)
        if sass is None:
            pytest.skip("cuobjdump not installed")
        loop = sass_main_loop(sass).splitlines()
        assert resource_usage(cubin)["spills"] == 0
        if cand in ("fa2s", "fa2w"):
            unmasked = _unmasked_loop(sass)
            assert not any(re.search(r"\b(LDL|STL)\b", line) for line in unmasked), cand
        # the exact branch's last LSE hi / lo load, the jump that ends it, the common branch's first
        # exponential: the unpredicated loads in between wait right before the exponentials
        last_exact = max(i for i, line in enumerate(loop) if re.search(r"@!?P\d LDG", line))
        start = next(i for i in range(last_exact, len(loop)) if re.search(r"\*/\s+BRA", loop[i]))
        end = next(i for i in range(start, len(loop)) if "MUFU.EX2" in loop[i])
        late[cand] = sum(1 for line in loop[start:end] if re.search(r"\*/\s+LDG", line))
    assert late["fa2"] >= 2 and late[name] == 0, late


def _unmasked_loop(sass: str) -> list:
    """The lines of the later of the two step loops (the unmasked one: loop_clone's copy follows the
    masked loop in program order)."""
    from cpu_helpers import sass_innermost_loops, sass_lines

    lines = sass_lines(sass)
    big = sorted((b - a, a, b) for a, b in sass_innermost_loops(sass))[-2:]  # the two step loops
    a, b = max((a, b) for _, a, b in big)
    return [ins for _, ins in lines[a:b + 1]]


STEP_ORDER = {"fa2wq": "fa2w", "fa2wp": "fa2w", "fa2wpq": "fa2w", "fa2sq": "fa2s", "fa2sp": "fa2s", "fa2spq": "fa2s",
              "fa2w1": "fa2w", "fa2wp1": "fa2w", "fa2wpq1": "fa2w", "fa2sp1": "fa2s", "fa2spq1": "fa2s"}


def test_step_order_candidates_config():
    """dq_before_dk / p_before_dp candidates: the shipped fa2w / fa2s tiles with the switch, on the
    >= 163 KiB targets only, smem within the target (p_before_dp: + the staged exact flags and lo);
    off, every config keeps its repr (the compile-cache key); p_before_dp needs lse_smem, no softcap."""
    import dataclasses

    for arch in (80, 90):
        for d in (64, 128):
            for causal in (False, True):
                cands = bwd_candidates(select_bwd_config(d, "bf16", causal, arch=arch))
                for name, base in STEP_ORDER.items():
                    if name not in cands:  # (fa2s also has d64 tiles; its switches are for d128)
                        assert base not in cands or (base, d) == ("fa2s", 64), (name, d, arch)
                        continue
                    c, b = cands[name], cands[base]
                    # (the "1" variants: one Q / dO stage; sm_80's 163 KiB: fa2w with p_before_dp's 1 KiB more
                    # takes one stage too)
                    assert (c.q_stages == 1 if name.endswith("1") else c.q_stages == b.q_stages
                            or (arch, name[:4]) == (80, "fa2w") and c.p_before_dp), name
                    b = dataclasses.replace(b, q_stages=c.q_stages)
                    assert dataclasses.replace(c, p_before_dp=False, dq_before_dk=False) == b, name
                    assert c.smem_bytes() <= capacity(arch).smem_per_block
                    assert c.smem_bytes() - b.smem_bytes() == ((16 + 4 * c.tile_m) * c.q_stages if c.p_before_dp
                                                               else 0)
                    assert ("p_before_dp" in repr(c)) == c.p_before_dp and ("dq_before_dk" in repr(c)) == c.dq_before_dk
                    assert c.p_before_dp == ("p" in name[4:]) and c.dq_before_dk == ("q" in name[4:]), name
    for cfg in shipped_bwd_configs():
        assert "p_before_dp" not in repr(cfg) and "dq_before_dk" not in repr(cfg)
    with pytest.raises(AssertionError, match="p_before_dp"):
        dataclasses.replace(select_bwd_config(64, arch=90), p_before_dp=True)
    with pytest.raises(AssertionError, match="p_before_dp"):
        dataclasses.replace(select_bwd_config(64, arch=90, softcap=True), lse_smem=True, p_before_dp=True)
    for arch in (80, 90):  # softcap: the p_before_dp candidates do not apply (and nothing raises)
        for d in (64, 128):
            cands = bwd_candidates(select_bwd_config(d, "bf16", True, arch=arch, softcap=True))
            assert cands and not any(c.p_before_dp for c in cands.values()), cands
            assert any(c.dq_before_dk for c in cands.values()), cands


DP_SPLIT = {"fa2wps": "fa2wp", "fa2wpqs": "fa2wpq", "fa2sps": "fa2sp", "fa2spqs": "fa2spq"}


def test_dp_split_candidates_config():
    """Sm80BwdConfig.dp_split (off by default, out of the repr while off, needs p_before_dp): the
    candidates fa2wps / fa2wpqs (d64) and fa2sps / fa2spqs (d128) are fa2wp / fa2wpq / fa2sp / fa2spq
    with dp_split on (same tiles, two Q / dO stages where p_before_dp has them, same smem); not with
    softcap (p_before_dp's rule)."""
    import dataclasses

    from flash4.config.sm80 import BWD_CANDIDATE_FIELDS, Sm80BwdConfig

    assert Sm80BwdConfig(64).dp_split is False and "dp_split" not in repr(Sm80BwdConfig(64))
    for name, base in DP_SPLIT.items():
        assert BWD_CANDIDATE_FIELDS[name] == {**BWD_CANDIDATE_FIELDS[base], "dp_split": True}, name
    for arch in (80, 90):
        for d in (64, 128):
            for causal in (False, True):
                cands = bwd_candidates(select_bwd_config(d, "bf16", causal, arch=arch))
                for name, base in DP_SPLIT.items():
                    if name not in cands:
                        assert base not in cands, (name, d, arch)
                        continue
                    c, b = cands[name], cands[base]
                    assert c.dp_split and c.p_before_dp and "dp_split=True" in repr(c), name
                    assert dataclasses.replace(c, dp_split=False) == b and c.smem_bytes() == b.smem_bytes(), name
                    assert c.headdim == (64 if name.startswith("fa2w") else 128), name
                if (arch, d) == (90, 64):
                    assert {"fa2wps", "fa2wpqs"} <= set(cands) and cands["fa2wps"].q_stages == 2
                if (arch, d) == (90, 128):
                    assert {"fa2sps", "fa2spqs"} <= set(cands) and cands["fa2sps"].q_stages == 2
    for cfg in shipped_bwd_configs():
        assert not cfg.dp_split and "dp_split" not in repr(cfg)
    with pytest.raises(AssertionError, match="dp_split"):
        dataclasses.replace(bwd_candidates(select_bwd_config(64, arch=90))["fa2w"], dp_split=True)
    for arch in (80, 90):
        for d in (64, 128):
            cands = bwd_candidates(select_bwd_config(d, "bf16", True, arch=arch, softcap=True))
            assert not any(c.dp_split for c in cands.values()), cands


def _step_loop_sass(cfg):
    """(registers / spills, the unmasked step loop's instruction texts) of cfg compiled for its target."""
    from flash4.compile.cache import compile_bwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    cubin = extract_cubin(compile_bwd(cfg))
    sass = sass_text(cubin)
    if sass is None:
        pytest.skip("cuobjdump not installed")
    return resource_usage(cubin), _unmasked_loop(sass)


def _positions(loop, pattern):
    return [i for i, line in enumerate(loop) if re.search(pattern, line)]


@pytest.mark.parametrize("d, name", [(64, "fa2wq"), (128, "fa2sq")])
def test_dq_before_dk_interleaves_the_dq_adds(d, name):
    """Sm80BwdConfig.dq_before_dk (sm_90a SASS, bf16, not causal): in the unmasked step loop the dQ
    red.global.adds (REDG) issue among the dK GEMM's MMAs (FlashAttention-2's schedule: at least 32
    of the step's 320 HMMAs after the first REDG), where the shipped order issues them after its last
    GEMM (at most 4 HMMAs after the first REDG, 2026-12-05); the same MMA / ldmatrix / exponential /
    REDG counts, 0 spills."""
    cands = bwd_candidates(select_bwd_config(d, "bf16", False, arch=90))
    res = {}
    for cand in (STEP_ORDER[name], name):
        usage, loop = _step_loop_sass(cands[cand])
        assert usage["spills"] == 0, (cand, usage)
        redg, hmma = _positions(loop, r"\bREDG\b"), _positions(loop, r"\bHMMA\.16816")
        res[cand] = (sum(1 for i in hmma if i > redg[0]), len(hmma), len(_positions(loop, r"\bMUFU\.EX2")),
                     len(_positions(loop, r"\bLDSM")), len(redg))
    base, cand = res[STEP_ORDER[name]], res[name]
    assert base[0] <= 4 and cand[0] >= 32, res
    assert base[1:] == cand[1:], res


def test_p_before_dp_interleaves_the_exponentials():
    """Sm80BwdConfig.p_before_dp (sm_90a SASS, d64 fa2wp, bf16, not causal): the unmasked step loop's
    MUFU.EX2 share a basic block with the dP GEMM and ptxas interleaves them (HMMAs between the first
    and the last exponential: at least 8), where the shipped fa2w issues every exponential after all 128 MMAs of
    S and dP (none between). Compiles (its register spills: docs/design/sm80_family.md, why it is an
    A/B candidate only). 2026-12-05: 12 HMMAs between them in the unmasked loop, 0 in fa2w's."""
    cands = bwd_candidates(select_bwd_config(64, "bf16", False, arch=90))
    between = {}
    for cand in ("fa2w", "fa2wp"):
        _, loop = _step_loop_sass(cands[cand])
        ex2 = _positions(loop, r"\bMUFU\.EX2")
        between[cand] = sum(1 for i in _positions(loop, r"\bHMMA\.16816") if ex2[0] < i < ex2[-1])
    assert between["fa2w"] == 0 and between["fa2wp"] >= 8, between


@pytest.mark.parametrize("d, name", [(64, "fa2wp1"), (64, "fa2wpq1"), (128, "fa2sp1"), (128, "fa2spq1")])
@pytest.mark.parametrize("causal", [False, True])
def test_p_before_dp_one_stage_is_spill_free(d, name, causal):
    """p_before_dp spills at two Q / dO stages (255 registers) but not with one (sm_90a, bf16):
    the candidates the A/B can ship."""
    usage, loop = _step_loop_sass(bwd_candidates(select_bwd_config(d, "bf16", causal, arch=90))[name])
    assert usage["spills"] == 0, usage
    assert len(_positions(loop, r"\bHMMA\.16816")) == 320


@pytest.mark.parametrize("d, name", [(64, "fa2wps"), (128, "fa2sps")])
def test_dp_split_splits_the_dp_gemm(d, name):
    """Sm80BwdConfig.dp_split (sm_90a SASS, bf16, not causal): the step compiles with the same MMA /
    ldmatrix / exponential / REDG counts as p_before_dp's (fa2wp / fa2sp) in its unmasked loop, and
    the exponentials interleave with the dP GEMM's MMAs (at least 8 HMMAs between the first and the
    last MUFU.EX2). Its spills (2026-12-05 evening, two Q / dO stages, 255 registers):
    docs/design/sm80_family.md, "dp_split"; A/B only."""
    cands = bwd_candidates(select_bwd_config(d, "bf16", False, arch=90))
    res = {}
    for cand in (DP_SPLIT[name], name):
        _, loop = _step_loop_sass(cands[cand])
        ex2, hmma = _positions(loop, r"\bMUFU\.EX2"), _positions(loop, r"\bHMMA\.16816")
        res[cand] = (sum(1 for i in hmma if ex2[0] < i < ex2[-1]), len(hmma), len(ex2),
                     len(_positions(loop, r"\bLDSM")), len(_positions(loop, r"\bREDG\b")))
    assert res[name][0] >= 8 and res[name][1] == 320, res
    assert res[name][1:] == res[DP_SPLIT[name]][1:], res
