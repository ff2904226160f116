"""router-check --gateway against a real Envoy + kvroute's picker + simulated workers: passes on
a correct gateway, and fails naming the cause when the picker is gone or the gateway ignores
its answer (no override_host policy)."""

from __future__ import annotations

import hashlib
from typing import Any

import extproc_standin
import pytest
from gateway_harness import MODEL, gateway

from router.check.checks_gateway import GatewayOptions, run_gateway_checks
from router.check.model import Report

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class Sticky(extproc_standin.DecisionService):
    """Ranks by a hash of the prompt: a repeated prompt goes where it went before (what KV
    routing does for a cached prefix)."""

    async def decide(self, rin: Any, *, profile: str = "default", constraints: Any = None) -> Any:
        decision = await super().decide(rin, profile=profile, constraints=constraints)
        key = (rin.prompt_text or "").encode()
        ranked = sorted(
            decision.ranked, key=lambda s: hashlib.sha256(key + s.worker.encode()).digest()
        )
        return extproc_standin.Decision(rin, ranked)


def sticky(addresses: list[str]) -> Any:
    return Sticky(addresses, models=(MODEL,))


def statuses(report: Report) -> dict[str, str]:
    return {r.name: r.status.value for r in report.results}


def evidence(report: Report, name: str) -> str:
    (r,) = [r for r in report.results if r.name == name]
    return f"{r.evidence} {r.fix or ''}"


async def check(gw: Any, admin: bool = True) -> Report:
    opts = GatewayOptions(gw.envoy.url, gw.envoy.admin if admin else None, timeout_s=10, pairs=2)
    return await run_gateway_checks(opts)


async def test_a_correct_gateway_passes() -> None:
    async with gateway(make_service=sticky, failure_mode="open") as gw:
        report = await check(gw)
    assert statuses(report) == {
        "gateway": "PASS",
        "gateway-picker": "PASS",
        "gateway-honours-pick": "PASS",
        "gateway-kv-routing": "PASS",
        "gateway-config": "PASS",
    }, [r.to_json() for r in report.results]
    assert "failure mode open, body BUFFERED" in evidence(report, "gateway-config")
    assert report.exit_code == 0


async def test_a_dead_picker_behind_fail_open_is_named() -> None:
    async with gateway(make_service=sticky, failure_mode="open") as gw:
        await gw.kill_picker()
        report = await check(gw)
    assert statuses(report)["gateway-picker"] == "FAIL"
    assert "picker unreachable" in evidence(report, "gateway-picker")
    assert "failure mode open" in evidence(report, "gateway-config")
    assert report.exit_code == 1


async def test_a_dead_picker_behind_fail_close_is_named() -> None:
    async with gateway(make_service=sticky) as gw:
        await gw.kill_picker()
        report = await check(gw, admin=False)
    assert statuses(report)["gateway-picker"] == "FAIL"
    assert "(fail-close)" in evidence(report, "gateway-picker")
    assert statuses(report)["gateway-config"] == "WARN"  # no admin: cannot tell


def _round_robin_only(doc: dict[str, Any]) -> None:
    """A gateway that asks the picker but load-balances on its own."""
    cluster = doc["static_resources"]["clusters"][0]
    del cluster["load_balancing_policy"]
    cluster["lb_policy"] = "ROUND_ROBIN"


async def test_a_gateway_without_override_host_is_caught() -> None:
    async with gateway(make_service=sticky, tweak=_round_robin_only, workers=3) as gw:
        report = await check(gw)
    assert statuses(report)["gateway-honours-pick"] == "FAIL"
    assert "override_host" in evidence(report, "gateway-honours-pick")
    assert "override_host policy missing" in evidence(report, "gateway-config")
