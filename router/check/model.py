"""What a check finds: a status, the evidence (numbers), and for a FAIL the fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    PASS = "PASS"
    WARN = "WARN"  # could not run, or works with a caveat: never a silent PASS
    FAIL = "FAIL"

    @property
    def rank(self) -> int:
        return ("PASS", "WARN", "FAIL").index(self.value)


@dataclass(frozen=True)
class Result:
    name: str
    status: Status
    evidence: str
    worker: str | None = None
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "status": self.status.value}
        if self.worker is not None:
            out["worker"] = self.worker
        out["evidence"] = self.evidence
        if self.fix is not None:
            out["fix"] = self.fix
        if self.data:
            out["data"] = self.data
        return out


def passed(name: str, evidence: str, worker: str | None = None, **data: Any) -> Result:
    return Result(name, Status.PASS, evidence, worker, data=data)


def warned(name: str, evidence: str, worker: str | None = None, **data: Any) -> Result:
    return Result(name, Status.WARN, evidence, worker, data=data)


def failed(name: str, evidence: str, fix: str, worker: str | None = None, **data: Any) -> Result:
    """A FAIL always says what to change."""
    return Result(name, Status.FAIL, evidence, worker, fix=fix, data=data)


@dataclass(frozen=True)
class Finding:
    """One observation inside a check; a check's status is its worst finding's."""

    status: Status
    text: str
    fix: str | None = None


def verdict(
    name: str,
    evidence: str,
    findings: list[Finding],
    worker: str | None = None,
    **data: Any,
) -> Result:
    """Fold findings into one result: worst status, all texts, the fixes of the failures."""
    status = max((f.status for f in findings), key=lambda s: s.rank, default=Status.PASS)
    text = "; ".join([evidence, *(f.text for f in findings)])
    fixes = [f.fix for f in findings if f.status is Status.FAIL and f.fix]
    fix = "; ".join(dict.fromkeys(fixes)) if status is Status.FAIL else None
    if status is Status.FAIL and not fix:
        fix = "see the evidence"
    return Result(name, status, text, worker, fix=fix, data=data)


def combine(
    name: str, parts: list[tuple[str, Result]], worker: str | None = None, **data: Any
) -> Result:
    """One result of a worker from one per data-parallel rank (`(label, result)`): the worst
    status, each rank's evidence, and each fix of a failing rank, naming the ranks it is for."""
    status = max((r.status for _, r in parts), key=lambda s: s.rank, default=Status.PASS)
    evidence = "; ".join(f"{label}: {r.evidence}" for label, r in parts)
    fixes: dict[str, list[str]] = {}
    for label, r in parts:
        if r.status is Status.FAIL and r.fix:
            fixes.setdefault(r.fix, []).append(label)
    fix = "; ".join(f"{', '.join(labels)}: {text}" for text, labels in fixes.items())
    return Result(name, status, evidence, worker, fix=fix or None, data=data)


@dataclass
class Report:
    router: str
    results: list[Result] = field(default_factory=list)
    fatal: str | None = None  # the router is unreachable, or the run could not start

    @property
    def ok(self) -> bool:
        return self.fatal is None and all(r.status is not Status.FAIL for r in self.results)

    @property
    def exit_code(self) -> int:
        if self.fatal is not None:
            return 2
        return 0 if self.ok else 1

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status is status)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"checks": [r.to_json() for r in self.results], "ok": self.ok}
        if self.fatal is not None:
            doc["error"] = self.fatal
        return doc
