"""pytest plugin of the device check (`-p device_check_pytest`): one JSON line per test outcome.

Each outcome is appended to $DEVICE_CHECK_PYTEST_LOG when it is known, so a run stopped at its
time budget still tells what it ran. Under xdist only the controller writes (the workers'
reports reach it too).
"""

from __future__ import annotations

import json
import os

_LOG = os.environ.get("DEVICE_CHECK_PYTEST_LOG")
_writing = True


def pytest_configure(config) -> None:
    global _writing
    _writing = bool(_LOG) and not hasattr(config, "workerinput")


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    lines = [line for line in str(report.longrepr or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[0] if errors else lines[-1] if lines else "")[:300]


def pytest_runtest_logreport(report) -> None:
    # The call phase's outcome; a setup or teardown phase counts only when it did not pass.
    if not _writing or (report.when != "call" and report.passed):
        return
    outcome = report.outcome if report.when == "call" or report.skipped else "error"
    line = {"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 2)}
    if not report.passed:
        line["reason"] = _reason(report)
    with open(_LOG, "a") as log:
        log.write(json.dumps(line) + "\n")


def pytest_collectreport(report) -> None:
    if _writing and report.failed:
        with open(_LOG, "a") as log:
            log.write(json.dumps({"test": report.nodeid, "outcome": "error", "reason": _reason(report)}) + "\n")
