"""The JSON report of a run, and its one-screen summary."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.registry import CheckResult, exit_code


def build(
    target: str,
    versions: dict[str, str],
    results: Sequence[CheckResult],
    engines: list[dict[str, Any]],
    started: dt.datetime,
    wall_s: float,
    argv: Sequence[str],
) -> dict[str, Any]:
    counts = Counter(r.status for r in results)
    return {
        "target": target,
        "ok": exit_code(results) == 0,
        "summary": {s: counts.get(s, 0) for s in ("pass", "fail", "skip")},
        "versions": versions,
        "started_at": started.isoformat(timespec="seconds"),
        "wall_s": round(wall_s, 1),
        "command": list(argv),
        "checks": [r.to_json() for r in results],
        "engines": engines,
    }


def write(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)


def summary(report: dict[str, Any]) -> str:
    lines = [f"conformance --target {report['target']}  ({report['wall_s']} s)"]
    for c in report["checks"]:
        lines.append(
            f"  {c['status'].upper():4}  {c['name']:<16} {c['seconds']:7.1f} s  {c['reason'][:200]}"
        )
    s = report["summary"]
    verdict = "OK" if report["ok"] else "FAILED"
    lines.append(f"{verdict}: {s['pass']} passed, {s['fail']} failed, {s['skip']} skipped")
    return "\n".join(lines)
