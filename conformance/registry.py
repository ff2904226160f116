"""The registry of named conformance checks and the rules that turn runs into verdicts.

A check is an async function of a `Context` that fills a `Findings`: evidence (what it saw)
and problems (what was wrong). No problems: pass. A check whose target lacks a feature it
needs is skipped with the reason, and a skipped check fails the run: the suite never passes
with something it should have proved left unproved.

    @check("tokenizer", "kvroute's tokenization equals vLLM's /tokenize",
           needs=(TOKENIZE,), engines=("main",))
    async def tokenizer(ctx: Context, f: Findings) -> None: ...
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from conformance.session import Context

Status = Literal["pass", "fail", "skip"]


@dataclass
class Findings:
    """What one check saw; it passes when `problems` stays empty."""

    evidence: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def require(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok

    def note(self, key: str, value: Any) -> None:
        self.evidence[key] = value


CheckFn = Callable[["Context", Findings], Awaitable[None]]


@dataclass(frozen=True)
class Check:
    name: str
    description: str
    fn: CheckFn
    needs: frozenset[str] = frozenset()
    engines: tuple[str, ...] = ()  # engine roles it uses (the session starts and stops them)
    targets: frozenset[str] = frozenset({"vllm", "sim"})
    timeout_s: float = 900.0
    default: bool = True  # False: runs only when named with --only (the fault suite)

    def missing(self, features: Mapping[str, str | None]) -> list[str]:
        """'feature: why' for each needed feature the target lacks."""
        out = []
        for need in sorted(self.needs):
            why = features.get(need, f"the target does not offer {need}")
            if why is not None:
                out.append(f"{need}: {why}")
        return out


@dataclass
class CheckResult:
    name: str
    description: str
    needs: list[str]
    status: Status
    reason: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "needs": self.needs,
            "status": self.status,
            "reason": self.reason,
            "seconds": round(self.seconds, 2),
            "evidence": self.evidence,
        }


REGISTRY: dict[str, Check] = {}


def check(
    name: str,
    description: str,
    *,
    needs: Iterable[str] = (),
    engines: Iterable[str] = (),
    targets: Iterable[str] = ("vllm", "sim"),
    timeout_s: float = 900.0,
    default: bool = True,
) -> Callable[[CheckFn], CheckFn]:
    """Register a check; registration order is run order (engines are shared in between)."""

    def register(fn: CheckFn) -> CheckFn:
        if name in REGISTRY:
            raise ValueError(f"check {name!r} registered twice")
        REGISTRY[name] = Check(
            name,
            description,
            fn,
            frozenset(needs),
            tuple(engines),
            frozenset(targets),
            timeout_s,
            default,
        )
        return fn

    return register


class SelectionError(ValueError):
    """--only named no check, or a check that does not exist or does not apply."""


def plan(
    target: str, only: Iterable[str] = (), registry: Mapping[str, Check] = REGISTRY
) -> list[Check]:
    """The checks to run for `target`, in registry order."""
    wanted = list(only)
    unknown = [n for n in wanted if n not in registry]
    if unknown:
        raise SelectionError(f"unknown check(s) {unknown}; known: {list(registry)}")
    chosen = [c for c in registry.values() if c.name in wanted or (not wanted and c.default)]
    not_here = [c.name for c in chosen if target not in c.targets]
    if wanted and not_here:
        raise SelectionError(f"check(s) {not_here} do not apply to target {target}")
    chosen = [c for c in chosen if target in c.targets]
    if not chosen:
        raise SelectionError(f"no check to run for target {target}")
    return chosen


def skipped(c: Check, missing: list[str]) -> CheckResult:
    reason = "skipped, needed feature(s) missing: " + "; ".join(missing)
    return CheckResult(c.name, c.description, sorted(c.needs), "skip", reason)


def finished(c: Check, f: Findings, started: float, error: BaseException | None) -> CheckResult:
    seconds = time.monotonic() - started
    if error is not None:
        f.problems.append(f"{type(error).__name__}: {error}{_raised_at(error)}")
        f.evidence["traceback"] = traceback.format_exception(error)[-6:]
    status: Status = "fail" if f.problems else "pass"
    reason = "; ".join(f.problems) if f.problems else "all requirements met"
    return CheckResult(c.name, c.description, sorted(c.needs), status, reason, f.evidence, seconds)


SUITE = Path(__file__).resolve().parent


def _raised_at(error: BaseException) -> str:
    """Where in the suite's own code the error came up, named in the one-line reason that a
    CI log shows (the report keeps the traceback): the check's deepest line, else the
    suite's (a helper the check called from outside the suite's files)."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # [0]: the runner's own
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(SUITE)]
    checks = [f for f in ours if Path(f.filename).resolve().is_relative_to(SUITE / "checks")]
    if not (checks or ours):
        return ""
    frame = (checks or ours)[-1]
    where = Path(frame.filename).resolve().relative_to(SUITE.parent)
    return f" (at {where}:{frame.lineno}, {frame.name})"


def exit_code(results: Iterable[CheckResult]) -> int:
    """0 only when every planned check ran and passed."""
    results = list(results)
    if not results:
        return 1
    return 0 if all(r.status == "pass" for r in results) else 1
