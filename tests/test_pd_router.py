"""kvroute serve in front of simulated prefill and decode workers that hand KV over with
real NIXL transfers (UCX, DRAM, loopback): short prompts stay local, long ones split, the
split text equals the unsplit one, the decode worker's metrics prove every pull; a planted
silent recompute (kvroute's test fault strips the decode legs' params) is caught by /health
and router-check; auto measures the link with its probe before it splits anything."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engines.sim.pd_fleet import PDFleetProcess, start_pd_fleet
from engines.sim.pd_metrics import PDSnapshot, pd_snapshot
from router.check.context import Options
from router.check.model import Status
from router.check.runner import run_checks
from router.procs import RouterProcess
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

COMMON = ["--kv-bytes-per-token", "4096", "--kv-lease-s", "5"]
SHORT = " ".join(f"s{i}" for i in range(20))


@pytest.fixture(scope="module")
def fleet() -> Iterator[PDFleetProcess]:
    with start_pd_fleet(1, 1, COMMON) as f:
        yield f


def router(fleet: PDFleetProcess, *extra: str) -> RouterProcess:
    return RouterProcess([], tokenizer=PACKAGED_TOKENIZER, extra=[*fleet.router_args, *extra])


def long_prompt(tag: str) -> str:
    return " ".join(f"{tag}{i} lorem" for i in range(400))


def complete(url: str, prompt: str, **kw: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def snap(url: str) -> PDSnapshot:
    return pd_snapshot(httpx.get(url + "/metrics", timeout=10).text)


def pd_health(r: RouterProcess) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(r.url + "/health", timeout=10).json()
    return doc


def wait_for(cond: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_long_prompts_split_short_ones_stay_local_and_every_pull_is_proved(
    fleet: PDFleetProcess,
) -> None:
    p, d = fleet.prefill_urls[0], fleet.decode_urls[0]
    with router(fleet, "--pd-threshold", "256", "--no-pd-probe") as r:
        short = complete(r.url, SHORT)
        assert short.status_code == 200
        assert short.headers["x-kvroute-pd"] == "local reason=below_threshold"
        before = snap(d)
        text = long_prompt("a")
        split = complete(r.url, text)
        assert split.status_code == 200, split.text
        assert split.headers["x-kvroute-pd"].startswith("split prefill=")
        assert split.headers["x-kvroute-worker"] == d.split("//")[1]
        n = split.json()["usage"]["prompt_tokens"]
        moved = snap(d) - before
        assert moved.external_kv_transfer == n and moved.bytes_transferred >= n * 4096
        whole = complete(p, text)  # the same prompt, prefilled and decoded on one worker
        assert split.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]
        assert wait_for(lambda: pd_health(r)["pd"]["verified_handoffs"] >= 1)
        doc = pd_health(r)
        assert doc["status"] == "ok" and doc["pd"]["silent_recomputes"] == 0
        metrics = httpx.get(r.url + "/metrics").text
        assert (
            'kvroute_pd_decisions_total{decision="split",reason="above_threshold"} 1.0' in metrics
        )
        assert (
            'kvroute_pd_decisions_total{decision="local",reason="below_threshold"} 1.0' in metrics
        )


def test_a_burst_on_one_new_prefix_splits_and_the_decode_worker_computes_none(
    fleet: PDFleetProcess,
) -> None:
    """Six requests on one new long prefix at once: the decode worker holds none of it
    until the first pull, so each is split, not prefilled there from scratch as if cached
    there (which then read as silent recomputes in /health: the pulls found the blocks
    already computed)."""
    from concurrent.futures import ThreadPoolExecutor

    d = fleet.decode_urls[0]
    with router(fleet, "--pd-threshold", "256", "--no-pd-probe") as r:
        shared = long_prompt("burst")
        before = snap(d)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: complete(r.url, f"{shared} question {i}"), range(6)))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        decided = [a.headers["x-kvroute-pd"] for a in answers]
        assert all(h.startswith("split prefill=") for h in decided), decided
        moved = snap(d) - before
        assert moved.local_compute < 100, moved  # each prompt's last block at most
        assert wait_for(lambda: pd_health(r)["pd"]["verified_handoffs"] >= 6)
        health = pd_health(r)
        assert health["status"] == "ok" and health["pd"]["silent_recomputes"] == 0, health


def test_a_planted_silent_recompute_is_caught_by_health_and_router_check(
    fleet: PDFleetProcess,
) -> None:
    d = fleet.decode_urls[0]
    with router(fleet, "--pd-threshold", "256", "--no-pd-probe", "--pd-fault-strip-params") as r:
        before = snap(d)
        answer = complete(r.url, long_prompt("b"))
        assert answer.status_code == 200 and answer.headers["x-kvroute-pd"].startswith("split")
        moved = snap(d) - before
        assert moved.transfers == 0 and moved.local_compute > 0  # it recomputed, silently
        assert wait_for(lambda: pd_health(r)["pd"]["silent_recomputes"] >= 1)
        health = httpx.get(r.url + "/health", timeout=10)
        doc = health.json()
        assert health.status_code == 200 and doc["status"] == "degraded"
        assert doc["pd"]["workers"] == [d.split("//")[1]] and "kv_consumer" in doc["pd"]["fix"]
        report = asyncio.run(run_checks(Options(r.url, admin_token=r.admin_token, timeout_s=30)))
        pd = next(x for x in report.results if x.name == "pd-path")
        assert pd.status is Status.FAIL, pd
        assert pd.fix is not None and "--pd-fault-strip-params" in pd.fix
        assert "silent recompute" in pd.evidence and pd.data["proved"] is True


def test_auto_measures_the_link_before_it_splits(fleet: PDFleetProcess) -> None:
    with router(fleet) as r:  # --pd-threshold auto, the probe at start
        assert wait_for(lambda: pd_health(r)["pd"]["link_mb_s"] is not None, timeout=60)
        pd = pd_health(r)["pd"]
        assert pd["status"] == "ok" and pd["kv_bytes_per_token"] >= 4096
        explain = httpx.post(
            r.url + "/debug/route",
            json={"prompt": SHORT},
            headers={"authorization": f"Bearer {r.admin_token}"},
        ).json()["pd"]
        assert explain["decision"] == "local" and explain["reason"] in (
            "local_faster",
            "cached_on_decode",
        )
        report = asyncio.run(run_checks(Options(r.url, admin_token=r.admin_token, timeout_s=30)))
        pd_path = next(x for x in report.results if x.name == "pd-path")
        assert pd_path.status is Status.PASS, pd_path
        assert pd_path.data["bytes_moved"] > 0 and pd_path.data["link_mb_s"] > 0


def test_prefill_workers_added_after_start_are_probed(fleet: PDFleetProcess) -> None:
    """A fleet that gains its first prefill worker later (the admin API here; a workers
    file or DNS alike) must probe the link then, as at start, or it splits unmeasured."""
    p, d = fleet.prefill_urls[0], fleet.decode_urls[0]
    with RouterProcess([], tokenizer=PACKAGED_TOKENIZER, extra=["--decode-worker", d]) as r:
        assert "pd" not in pd_health(r)  # no prefill worker yet: no handoffs
        auth = {"authorization": f"Bearer {r.admin_token}"}
        both = {"workers": [{"url": d, "role": "decode"}, {"url": p, "role": "prefill"}]}
        resp = httpx.post(r.url + "/admin/workers", json=both, headers=auth, timeout=30)
        assert resp.status_code == 200, resp.text
        assert wait_for(lambda: pd_health(r)["pd"]["calibration"] == "done", timeout=60)
        assert pd_health(r)["pd"]["link_mb_s"] is not None
