"""FwdConfig.pdl_combine and combine_prefetch (off by default; FLASH4_FWD_SWITCHES): the split-KV decode
step's combine launched with programmatic dependent launch, and its merge with the split LSEs in
registers and the O loads of several splits staged together. On the CPU: the switches reach split-KV
decode plans only, stay out of every other config and every repr while off, the combine runner's key
carries them (prefetch only up to MAX_SPLITS splits), and the sm_90a SASS has the split kernel's
trigger (PREEXIT, griddepcontrol.launch_dependents) and the combine's wait (ACQBULK,
griddepcontrol.wait) exactly when pdl_combine is on, and the prefetching merge's staged loads (16
LDGs in a row at d128) without spills. The GPU side: tests/gpu/test_speed_switches.py::
test_pdl_combine_bitwise and test_fwd_switches_env; speed: tools/ab_decode.py."""

import dataclasses
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flash4.config.sm90 import decode_plan, with_fwd_switches  # noqa: E402


def _plan(batch, seqlen, page=64):
    return decode_plan(batch, 1, 32, 8, 128, "bf16", True, page, seqlen, 0, 90, 132)


@pytest.mark.parametrize("name", ["pdl_combine", "combine_prefetch"])
def test_switch_reaches_split_decode_only(name):
    split, unsplit = _plan(1, 32768), _plan(64, 32768)
    assert split.num_splits > 1 and unsplit.num_splits == 1
    assert not getattr(split.cfg, name) and name not in repr(split.cfg)
    on = with_fwd_switches(split.cfg, (name,))
    assert on == dataclasses.replace(split.cfg, **{name: True}) and repr(on).endswith(f"{name}=True)")
    assert with_fwd_switches(unsplit.cfg, (name,)) == unsplit.cfg  # no combine
    with pytest.raises(AssertionError):
        dataclasses.replace(unsplit.cfg, **{name: True})


def test_runner_keys(monkeypatch):
    """_runners hands the combine its variant: pdl / prefetch from the config, prefetch only up to
    MAX_SPLITS splits (a caller's num_splits may exceed it: the plain merge)."""
    from flash4 import forward
    from flash4.compile import cache
    from flash4.config import MAX_SPLITS

    seen, fwd_cfgs = [], []
    monkeypatch.setattr(cache, "get_combine_runner", lambda *a, **kw: seen.append(kw) or "combine")
    monkeypatch.setattr(cache, "get_fwd_runner", lambda cfg: fwd_cfgs.append(cfg) or "fwd")
    base = _plan(1, 32768)
    both = dataclasses.replace(base, cfg=dataclasses.replace(base.cfg, pdl_combine=True, combine_prefetch=True))
    for plan in (base, both, dataclasses.replace(both, num_splits=MAX_SPLITS + 1)):
        forward._runners.cache_clear()
        forward._runners(plan)
    forward._runners.cache_clear()
    assert [sorted(k for k, v in kw.items() if v is True) for kw in seen] == [[], ["pdl", "prefetch"], ["pdl"]]
    # the split kernel: compiled without combine_prefetch (it chooses the combine only), with pdl_combine
    assert fwd_cfgs[0] == base.cfg and fwd_cfgs[1] == dataclasses.replace(base.cfg, pdl_combine=True)


def test_env_switch(monkeypatch):
    from flash4 import env

    monkeypatch.setenv("FLASH4_FWD_SWITCHES", "pdl_combine")
    assert env.fwd_switches() == ("pdl_combine",)
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", "combine_prefetch,pdl_combine")
    assert set(env.fwd_switches()) == {"pdl_combine", "combine_prefetch"}
    monkeypatch.setenv("FLASH4_FWD_SWITCHES", "pdl_combine")
    cfg = with_fwd_switches(_plan(1, 4096).cfg, env.fwd_switches())
    assert cfg.split_kv and cfg.pdl_combine


def _ops(sass):
    return {m for m in re.findall(r"\b(PREEXIT|ACQBULK)\b", sass)}


@pytest.mark.parametrize("pdl", [False, True])
def test_sass(pdl, monkeypatch):
    monkeypatch.setenv("FLASH4_CACHE", "0")
    from flash4.compile.cache import compile_combine, compile_fwd
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    sass = sass_text(extract_cubin(compile_combine(128, "bf16", False, 90, pdl=pdl)))
    if sass is None:
        pytest.skip("no cuobjdump")
    assert _ops(sass) == ({"ACQBULK"} if pdl else set())
    cfg = dataclasses.replace(_plan(1, 32768).cfg, pdl_combine=pdl)
    cubin = extract_cubin(compile_fwd(cfg))
    assert ("PREEXIT" in _ops(sass_text(cubin))) == pdl
    assert resource_usage(cubin)["spills"] == 0


@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_prefetch_sass(d, monkeypatch):
    """The prefetching merge compiles at every combine head dim class (ragged d80 included) without
    spills, its staged O loads in flight together (d128: 16 LDGs without an FFMA between them)."""
    monkeypatch.setenv("FLASH4_CACHE", "0")
    from flash4.compile.cache import compile_combine
    from flash4.compile.check import extract_cubin, resource_usage, sass_text

    cubin = extract_cubin(compile_combine(d, "bf16", False, 90, prefetch=True))
    sass = sass_text(cubin)
    if sass is None:
        pytest.skip("no cuobjdump")
    assert resource_usage(cubin)["spills"] == 0
    if d == 128:
        ops = [m.group(1) for m in re.finditer(r"\b(LDG|FFMA)\b", sass)]
        longest = run = 0
        for op in ops:
            run = run + 1 if op == "LDG" else 0
            longest = max(longest, run)
        assert longest >= 16, longest


def test_shipped_policy(monkeypatch):
    """The shipped decode plan (decode_combine_policy): the prefetching combine on every split step up
    to MAX_SPLITS splits, the PDL launch from PDL_COMBINE_MIN_SPLITS splits; FLASH4_DECODE_COMBINE=0
    gives the plain combine; unsplit steps unchanged."""
    from flash4.config import COMBINE_PREFETCH, MAX_SPLITS, PDL_COMBINE_MIN_SPLITS
    from flash4.config.sm90 import decode_combine_policy

    assert COMBINE_PREFETCH and PDL_COMBINE_MIN_SPLITS == 4
    monkeypatch.delenv("FLASH4_DECODE_COMBINE", raising=False)
    policy = decode_combine_policy()
    assert policy == (True, 4)
    plan = lambda batch, seqlen, n=0, pol=policy: decode_plan(  # noqa: E731
        batch, 1, 32, 8, 128, "bf16", True, 64, seqlen, n, 90, 132, combine_policy=pol)
    b1, b8, b64 = plan(1, 4096), plan(8, 4096), plan(64, 4096)
    assert (b1.num_splits, b8.num_splits, b64.num_splits) == (8, 2, 1)
    assert b1.cfg.combine_prefetch and b1.cfg.pdl_combine
    assert b8.cfg.combine_prefetch and not b8.cfg.pdl_combine
    assert not b64.cfg.combine_prefetch and not b64.cfg.pdl_combine
    many = plan(1, 20000, MAX_SPLITS + 10)
    assert many.num_splits == MAX_SPLITS + 10 and many.cfg.pdl_combine and not many.cfg.combine_prefetch
    # the plain combine: exactly the plans of before (the default argument)
    monkeypatch.setenv("FLASH4_DECODE_COMBINE", "0")
    assert decode_combine_policy() == (False, 0)
    for batch in (1, 8, 64):
        assert plan(batch, 4096, pol=(False, 0)) == decode_plan(batch, 1, 32, 8, 128, "bf16", True, 64, 4096, 0,
                                                                  90, 132)
    from flash4 import env

    assert "FLASH4_DECODE_COMBINE" in env.PLAN_VARIABLES
