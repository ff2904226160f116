"""The routing-quality conformance check's verdicts (the runs themselves are in
test_conformance_sim.py): the margins, errors, and a peer that could not be installed,
which CI (KVROUTE_NO_SKIPS=1) must not take for a pass."""

from __future__ import annotations

from typing import Any

import pytest

from conformance.checks.routing_quality import (
    MARGIN,
    PEER_SLACK,
    PEERS,
    _judge,
    workloads,
)
from conformance.registry import Findings
from router.bench.ideal import ideal_fraction


def _row(cached: float, errors: int = 0, served: tuple[int, int] = (12, 12)) -> dict[str, Any]:
    run = {"requests_per_worker": list(served)}
    return {"cached_fraction": cached, "errors": errors, "error_texts": [], "runs": [run]}


SGLANG, VLLM_ROUTER = PEERS


def _rows(
    kv: float, rr: float, sg: float | None, vr: float | None = 0.5
) -> dict[str, dict[str, Any]]:
    rows = {"kvroute": _row(kv), "round_robin": _row(rr)}
    for name, theirs in ((SGLANG, sg), (VLLM_ROUTER, vr)):
        rows[name] = _row(theirs) if theirs is not None else {"skipped": "not installed"}
    return rows


@pytest.mark.parametrize(
    ("kv", "rr", "sg", "vr", "no_skips", "problems"),
    [
        pytest.param(0.73, 0.45, 0.68, 0.70, "", 0, id="clears-all"),
        pytest.param(0.73, 0.73 - MARGIN + 0.01, 0.68, 0.7, "", 1, id="too-close-to-round-robin"),
        pytest.param(0.60, 0.40, 0.60 + PEER_SLACK + 0.01, 0.6, "", 1, id="behind-sglang"),
        pytest.param(0.60, 0.40, 0.6, 0.60 + PEER_SLACK + 0.01, "", 1, id="behind-vllm-router"),
        pytest.param(0.73, 0.45, None, None, "", 0, id="peers-missing-outside-ci"),
        pytest.param(0.73, 0.45, None, 0.7, "1", 1, id="sglang-missing-in-ci-fails"),
        pytest.param(0.73, 0.45, 0.7, None, "1", 1, id="vllm-router-missing-in-ci-fails"),
    ],
)
def test_verdicts(
    monkeypatch: pytest.MonkeyPatch,
    kv: float,
    rr: float,
    sg: float | None,
    vr: float | None,
    no_skips: str,
    problems: int,
) -> None:
    monkeypatch.setenv("KVROUTE_NO_SKIPS", no_skips)
    f = Findings()
    _judge(f, _rows(kv, rr, sg, vr))
    assert len(f.problems) == problems, f.problems
    for name, theirs in ((SGLANG, sg), (VLLM_ROUTER, vr)):
        if theirs is None:
            assert "not installed" in f.evidence[f"{name}_missing"]


def test_errors_fail_the_check() -> None:
    f = Findings()
    rows = _rows(0.73, 0.45, 0.68)
    rows["round_robin"]["errors"] = 2
    _judge(f, rows)
    assert f.problems == ["round_robin: 2 errors: []"]


def test_an_idle_engine_fails_the_check() -> None:
    """Every prefix fits one engine here, so piling all on one would score well."""
    f = Findings()
    rows = _rows(0.55, 0.40, 0.55)
    rows["kvroute"]["runs"].append({"requests_per_worker": [24, 0]})
    _judge(f, rows)
    assert f.problems == ["kvroute left an engine (almost) idle: requests per engine [24, 0]"]


def test_the_workload_leaves_room_for_the_margin() -> None:
    """Perfect affinity on these caches must clear round robin's highest measured mean
    (0.439) by more than MARGIN, or the check could not pass with a perfect router."""
    loads = workloads()
    assert [len(w.requests) for w in loads] == [24, 24]
    assert {w.concurrency for w in loads} == {4}
    assert loads[0].requests != loads[1].requests
    assert sorted(r.prompt for r in loads[0].requests) == sorted(
        r.prompt for r in loads[1].requests
    )
    for w in loads:
        assert ideal_fraction(w) >= 0.439 + MARGIN + 0.05
