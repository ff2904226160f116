"""The report for people (one line per check, the fix under each FAIL) and for programs."""

from __future__ import annotations

import json
import textwrap

from router.check.model import Report, Result, Status

WIDTH = 100
_INDENT = " " * 6


def human(report: Report) -> str:
    lines = [f"router-check {report.router}"]
    name_w = max((len(r.name) for r in report.results), default=6)
    worker_w = max((len(r.worker or "-") for r in report.results), default=1)
    for r in report.results:
        lines += _result_lines(r, name_w, worker_w)
    lines.append(_summary(report))
    return "\n".join(lines)


def _result_lines(r: Result, name_w: int, worker_w: int) -> list[str]:
    """One line per check (grep-able); the fix, wrapped, under a FAIL."""
    out = [f"{r.status.value:<4}  {r.name:<{name_w}}  {r.worker or '-':<{worker_w}}  {r.evidence}"]
    if r.fix:
        out += textwrap.wrap(
            r.fix,
            WIDTH,
            initial_indent=_INDENT + "fix: ",
            subsequent_indent=_INDENT + "     ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    return out


def _summary(report: Report) -> str:
    if report.fatal is not None:
        return f"ERROR: {report.fatal}"
    fails, warns = report.count(Status.FAIL), report.count(Status.WARN)
    passes = report.count(Status.PASS)
    verdict = "FAILED" if fails else "OK"
    return f"{verdict}: {fails} failed, {warns} warnings, {passes} passed"


def as_json(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2, ensure_ascii=False)
