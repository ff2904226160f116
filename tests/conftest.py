"""CI runs with KVROUTE_NO_SKIPS=1: a test that skipped did not pass, so any skip fails the
run unless its reason starts with "optional:" (a cross-check whose main check still ran)."""

from __future__ import annotations

import os

import pytest

_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not getattr(report, "wasxfail", None):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith("optional:"):
            _skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("KVROUTE_NO_SKIPS") == "1" and _skips and exitstatus == 0:
        print("\nKVROUTE_NO_SKIPS=1 and these tests skipped (a skip is not a pass):")
        for line in _skips:
            print(f"  {line}")
        session.exitstatus = 1
