"""tests/conftest.py's `--shard K/N` (the GPU suite in several device calls): the file-to-part
assignment (pure) and the option on a real collection of tests/gpu (no GPU needed to collect)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("flash4_tests_root_conftest", _ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shard_files_balanced_and_complete():
    shard_files = _root_conftest().shard_files
    counts = {"a.py": 100, "b.py": 60, "c.py": 50, "d.py": 10, "e.py": 1}
    parts = shard_files(counts, 2)
    assert parts == [{"a.py", "d.py", "e.py"}, {"b.py", "c.py"}]  # 111 and 110 tests
    assert set().union(*parts) == set(counts) and not parts[0] & parts[1]
    assert shard_files(counts, 1) == [set(counts)]
    assert shard_files(counts, 7)[5:] == [set(), set()]  # more parts than files: the rest are empty


def test_file_weights_seconds_else_counts(tmp_path):
    conf = _root_conftest()
    counts = {"a.py": 10, "b.py": 4, "new.py": 3}
    w = conf.file_weights(counts, {"a.py": 50.0, "b.py": 20.0, "gone.py": 9.0})
    assert w == {"a.py": 50.0, "b.py": 20.0, "new.py": 15.0}  # the unrecorded file: 3 x 70 s / 14 tests
    assert conf.file_weights(counts, {}) == {"a.py": 10, "b.py": 4, "new.py": 3}  # no record: by count
    # seconds, not counts, decide: one slow file against many quick ones
    assert conf.shard_files(conf.file_weights({"slow.py": 2, "x.py": 50, "y.py": 50},
                                              {"slow.py": 900.0, "x.py": 100.0, "y.py": 100.0}), 2) == [
        {"slow.py"}, {"x.py", "y.py"}]
    assert conf.recorded_seconds(tmp_path / "absent.json") == {}
    (tmp_path / "bad.json").write_text("{")
    assert conf.recorded_seconds(tmp_path / "bad.json") == {}
    seconds = conf.recorded_seconds()  # the checked-in record covers every GPU test file
    assert seconds and {f"tests/gpu/{p.name}" for p in (_ROOT / "tests" / "gpu").glob("test_*.py")} <= set(seconds)


def _collect(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(_ROOT / p) for p in ("src", "tools", "tests/cpu")))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(_ROOT / "tests" / "gpu"), *args], capture_output=True, text=True, env=env, cwd=_ROOT)
    return out.returncode, [line for line in out.stdout.splitlines() if "::" in line], out.stdout + out.stderr


def test_shard_option_partitions_the_gpu_suite():
    rc, every, _ = _collect()
    assert rc == 0 and len(every) > 1000
    parts = []
    for k in (1, 2):
        rc, ids, _ = _collect("--shard", f"{k}/2")
        assert rc == 0
        parts.append(ids)
    assert sorted(parts[0] + parts[1]) == sorted(every) and not set(parts[0]) & set(parts[1])
    files = [{i.split("::")[0] for i in ids} for ids in parts]
    assert not files[0] & files[1]  # whole files per part
    seconds = _root_conftest().recorded_seconds()
    loads = [sum(seconds[f] for f in part) for part in files]
    assert abs(loads[0] - loads[1]) <= 0.2 * sum(loads)  # balanced by the recorded seconds
    rc, _, text = _collect("--shard", "3/2")
    assert rc != 0 and "--shard must be K/N" in text


def test_donelog_names_every_finished_test(tmp_path):
    """tools/pytest_faillog.py with $DONELOG: one line per finished test (outcome and node id), failures in
    $FAILLOG as before."""
    (tmp_path / "test_tiny.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n"
                                           "    assert 0\n\n@pytest.mark.skip\ndef test_skipped():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=str(_ROOT / "tools"), DONELOG=str(tmp_path / "done.log"),
               FAILLOG=str(tmp_path / "fail.log"))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pytest_faillog", "-p", "no:cacheprovider",
                    "test_tiny.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    lines = (tmp_path / "done.log").read_text().splitlines()
    outcomes = {line.split()[2]: line.split()[1] for line in lines}
    assert outcomes == {"test_tiny.py::test_ok": "passed", "test_tiny.py::test_bad": "failed",
                        "test_tiny.py::test_skipped": "skipped"}
    assert "FAILED test_tiny.py::test_bad" in (tmp_path / "fail.log").read_text()
