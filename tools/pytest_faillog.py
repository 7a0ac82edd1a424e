"""pytest plugin: append every failed / errored / xpassed test report to $FAILLOG as it arrives, and
(with $DONELOG) one line per finished test ("<seconds> <outcome> <nodeid>"): a run cut by its time
limit then names what finished, so `--collect-only` minus that log is what did not.

With pytest-xdist the controller sees every worker's report, so the log names each failure even when
the run is cut (timeout -s INT) before pytest's own summary. Use: `FAILLOG=$OUT/fail.log python -m
pytest -p tools.pytest_faillog ...` from the repository root (or with tools/ on sys.path)."""

import os

_WORKER = False


def pytest_configure(config):
    global _WORKER
    _WORKER = hasattr(config, "workerinput")  # an xdist worker: the controller logs its reports


def pytest_runtest_logreport(report):
    if _WORKER:
        return
    done = os.environ.get("DONELOG")
    if done and (report.when == "call" or (report.when == "setup" and not report.passed)):
        with open(done, "a") as f:
            f.write(f"{report.duration:.2f} {report.outcome} {report.nodeid}\n")
    path = os.environ.get("FAILLOG")
    if not path:
        return
    if report.failed:
        kind = "ERROR" if report.when != "call" else "FAILED"
        text = report.longreprtext[-4000:]
    elif getattr(report, "wasxfail", None) is not None and report.passed and report.when == "call":
        kind, text = "XPASS", ""
    else:
        return
    with open(path, "a") as f:
        f.write(f"=== {kind} {report.nodeid} ({report.when})\n{text}\n")
