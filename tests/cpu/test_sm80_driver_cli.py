"""`python -m flash4.compile.sm80_driver`'s command line: --help and an unknown target answer with a
usage message (exit 0 / 2), never a traceback; nothing is compiled."""

import pytest

from flash4.compile import sm80_driver


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as e:
        sm80_driver.main(["--help"])
    assert e.value.code == 0 and "--bwd" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["sm_75", "ampere", "100"])
def test_unknown_target_is_a_usage_error(capsys, arch):
    with pytest.raises(SystemExit) as e:
        sm80_driver.main([arch])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert arch in err and "sm_80" in err and "sm_120" in err


@pytest.mark.parametrize("argv", [["--bwd", "--candidate", "nope", "80"], ["--candidate", "fa2", "80"]])
def test_candidate_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as e:
        sm80_driver.main(argv)
    assert e.value.code == 2 and "--candidate" in capsys.readouterr().err


def test_shipped_candidate_configs():
    """`--bwd --candidate shipped`: the configs the plain dense backward runs (bwd_plan's
    shipped_bwd_candidate: fa2w at d64, fa2s at d128, fa2 at d128 on sm_80): d64 / d128 x bf16 /
    fp16 x full / causal on the >= 163 KiB targets, none on the 99 KiB ones."""
    for arch in (80, 90):
        cfgs = sm80_driver.candidate_configs("shipped", arch)
        d128 = "fa2" if arch == 80 else "fa2s"
        assert cfgs == [c for c in sm80_driver.candidate_configs("fa2w", arch) + sm80_driver.candidate_configs(d128, arch)
                        if c in cfgs] and len(cfgs) == 8
        assert sorted((c.headdim, c.dtype, c.causal) for c in cfgs) == sorted(
            (d, dt, c) for d in (64, 128) for dt in ("bf16", "fp16") for c in (False, True))
        assert all(c.dq_coalesced and c.arch == arch for c in cfgs)
    assert sm80_driver.candidate_configs("shipped", 86) == []
    with pytest.raises(ValueError):
        sm80_driver.candidate_configs("nope", 80)
