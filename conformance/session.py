"""Running a plan of checks: engines shared between checks, started on first use and stopped
as soon as no later check needs them (so at most the engines one check uses run at once),
and stopped on every exit path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.registry import Check, CheckResult, Findings, finished, skipped
from conformance.targets import ROLES, Engine, Target

log = logging.getLogger("kvroute.conformance")


class Session:
    def __init__(self, target: Target, checks: Sequence[Check]) -> None:
        self.target = target
        self.checks = list(checks)
        self._engines: dict[str, Engine] = {}
        self._prepared = False
        self.engine_log: list[dict[str, Any]] = []

    async def engine(self, role: str) -> Engine:
        """The engine for `role`, started (in a thread: vLLM takes ~40 s) if not running."""
        found = self._engines.get(role)
        if found is not None:
            return found
        if not self._prepared:
            await asyncio.to_thread(self.target.prepare)
            self._prepared = True
        log.info("starting %s engine %r", self.target.name, role)
        started = await asyncio.to_thread(self.target.start, ROLES[role])
        self._engines[role] = started
        log.info("engine %r up in %.1f s at %s", role, started.starts[0], started.url)
        return started

    def release_unneeded(self, next_index: int) -> None:
        """Stop engines that no check from `next_index` on uses."""
        needed = {role for c in self.checks[next_index:] for role in c.engines}
        for role in [r for r in self._engines if r not in needed]:
            self._stop(role)

    def _stop(self, role: str) -> None:
        engine = self._engines.pop(role)
        self.engine_log.append(engine.describe())
        engine.stop()

    def close(self) -> None:
        for role in list(self._engines):
            self._stop(role)


@dataclass
class Context:
    """What a check gets: the target, its engines, and a folder for artifacts."""

    target: Target
    session: Session
    workdir: Path
    fixtures_out: Path | None = None

    async def engine(self, role: str) -> Engine:
        return await self.session.engine(role)

    @property
    def tokenizer_dir(self) -> Path:
        return self.target.tokenizer_dir

    def folder(self, *parts: str) -> Path:
        path = self.workdir.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path


async def run_checks(ctx: Context, checks: Sequence[Check]) -> list[CheckResult]:
    features = ctx.target.features()
    results: list[CheckResult] = []
    try:
        for i, c in enumerate(checks):
            ctx.session.release_unneeded(i)
            missing = c.missing(features)
            if missing:
                results.append(skipped(c, missing))
                log.warning("%s: SKIP (%s)", c.name, "; ".join(missing))
                continue
            results.append(await run_one(ctx, c))
    finally:
        ctx.session.close()
    return results


async def run_one(ctx: Context, c: Check) -> CheckResult:
    log.info("%s: running (%s)", c.name, c.description)
    f = Findings()
    started = time.monotonic()
    error: BaseException | None = None
    try:
        await asyncio.wait_for(c.fn(ctx, f), c.timeout_s)
    except Exception as exc:  # a crashing check is a failed check, with its traceback
        error = exc
    result = finished(c, f, started, error)
    log.info("%s: %s in %.1f s: %s", c.name, result.status.upper(), result.seconds, result.reason)
    return result
