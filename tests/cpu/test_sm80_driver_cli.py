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
