"""A pytest plugin: the first failure of each test that passed on its rerun.

pytest-rerunfailures runs a failed test once more (``make test`` does for the
suites that start processes) and reports only that it did: a failure seen once
under load leaves nothing to read in the log. This keeps the end of each first
failure and prints it after the run. ``tests/conftest.py`` loads it."""

from __future__ import annotations

from typing import Any

import pytest

KEPT = 20  # first failures kept (a run with more has a problem a log will show anyway)
TAIL_LINES = 400  # of each: its message, the processes' errors and stacks (test_torch_suites)

_first_failures: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun" and len(_first_failures) < KEPT:
        lines = report.longreprtext.splitlines()
        _first_failures.append((report.nodeid, "\n".join(lines[-TAIL_LINES:])))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for nodeid, tail in _first_failures:
        terminalreporter.write_sep("-", f"why {nodeid} ran again (the end of its first failure)")
        terminalreporter.write_line(tail)
