"""kvroute serve end to end on loopback: real uvicorn, real ZMQ, simulated vLLM workers."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from engines.sim.config import SimConfig
from engines.sim.fleet import Fleet, run_fleet
from router.app import RouterApp
from router.core.config import Config, ScoringConfig, WorkerConfig
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(120)

DOC = " ".join(f"paragraph {i} about caches and routers and blocks." for i in range(120))


@dataclass
class Setup:
    fleet: Fleet
    app: RouterApp
    url: str
    client: httpx.AsyncClient


@asynccontextmanager
async def kvroute(
    n: int = 2,
    *,
    no_events_on: tuple[int, ...] = (),
    sim: SimConfig | None = None,
    **config: Any,
) -> AsyncIterator[Setup]:
    base = sim or SimConfig(block_size=16, kv_blocks=512, topic="kv-events")
    async with run_fleet(n, base, no_events_on=no_events_on) as fleet:
        config.setdefault("tokenizer", str(PACKAGED_TOKENIZER))
        config.setdefault("admin_insecure", True)
        config.setdefault("scrape_interval_s", 0.2)
        config.setdefault("health_check_interval_s", 0.2)
        cfg = Config(workers=tuple(WorkerConfig(u) for u in fleet.urls), **config)
        app = RouterApp(cfg)
        async with (
            serve_in_process(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            yield Setup(fleet, app, url, client)


async def complete(client: httpx.AsyncClient, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 4, **extra}
    return await client.post("/v1/completions", json=body)


def worker_of(resp: httpx.Response) -> str:
    return resp.headers["x-kvroute-worker"]


def cached(resp: httpx.Response) -> int:
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def wait_events(app: RouterApp, worker: str, blocks: int = 1) -> None:
    for _ in range(200):
        if app.fleet.index.entries_of(worker) >= blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no KV events from {worker} reached the index")


async def test_repeated_prefixes_stick_and_predictions_match_the_engine() -> None:
    async with kvroute() as s:
        first = await complete(s.client, DOC + " first question")
        assert first.status_code == 200 and cached(first) == 0
        await wait_events(s.app, worker_of(first))
        for i in range(4):
            again = await complete(s.client, DOC + f" question {i}")
            assert worker_of(again) == worker_of(first)
            route = await s.client.post("/debug/route", json={"prompt": DOC + f" question {i}"})
            predicted = next(
                w["overlap_blocks"]
                for w in route.json()["workers"]
                if w["worker"] == worker_of(first)
            )
            assert cached(again) > 0 and cached(again) // 16 == predicted
        # the placement scorer's view of each cache: what it stored lately, what it lost
        home = next(w for w in route.json()["workers"] if w["worker"] == worker_of(first))
        assert home["demand_blocks"] >= predicted and home["refetched_blocks"] == 0
        assert f"demand {home['demand_blocks']:.0f} blk, refetched 0" in route.json()["explain"]
        metrics = (await s.client.get("/metrics")).text
        assert 'kvroute_prediction_fidelity_total{result="exact"' in metrics


async def test_chat_and_completions_both_route_by_prefix() -> None:
    async with kvroute() as s:
        messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "hi"}]
        body = {"model": "kvroute-sim", "messages": messages, "max_tokens": 4}
        first = await s.client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        await wait_events(s.app, worker_of(first))
        messages[1]["content"] = "and another thing"
        second = await s.client.post("/v1/chat/completions", json=body)
        assert worker_of(second) == worker_of(first) and cached(second) > 0
        # a different document goes wherever there is room, then sticks there too
        other = await complete(s.client, DOC.replace("caches", "queues"))
        await wait_events(s.app, worker_of(other))
        assert worker_of(
            await complete(s.client, DOC.replace("caches", "queues") + " more")
        ) == worker_of(other)


async def test_openai_client_streams_through_kvroute() -> None:
    openai = pytest.importorskip("openai")
    async with kvroute() as s:
        client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="unused")
        stream = await client.completions.create(
            model="kvroute-sim",
            prompt=DOC,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None
        chat = await client.chat.completions.create(
            model="kvroute-sim",
            messages=[{"role": "user", "content": DOC}],
            max_tokens=4,
            stream=True,
        )
        assert [c async for c in chat]
        await client.close()


async def test_approx_mode_sticks_without_events() -> None:
    async with kvroute(no_events_on=(0, 1), mode="approx") as s:
        first = await complete(s.client, DOC)
        second = await complete(s.client, DOC + " again")
        assert worker_of(second) == worker_of(first) and cached(second) > 0
        health = (await s.client.get("/health")).json()
        assert health["status"] == "ok"
        assert {w["mode"] for w in health["workers"]} == {"approx"}


async def test_health_names_a_worker_that_publishes_no_events() -> None:
    # health checks would re-admit the worker this test takes out of rotation: slow them down
    async with kvroute(
        no_events_on=(1,), mode="events", event_grace_s=0.5, health_check_interval_s=60
    ) as s:
        silent = s.fleet.workers[1]
        name = f"127.0.0.1:{silent.port}"
        # the silent worker must get a request before it can be judged: take the other one
        # out of rotation for a moment
        other = s.app.fleet.workers[f"127.0.0.1:{s.fleet.workers[0].port}"]
        while s.app.pool.checks.health_rounds < 1:  # the first round would re-admit it
            await asyncio.sleep(0.01)
        other.available = False
        resp = await complete(s.client, DOC)
        assert worker_of(resp) == name
        other.available = True
        await asyncio.sleep(0.7)
        health = await s.client.get("/health")
        assert health.status_code == 503
        doc = health.json()
        assert doc["unhealthy_workers"] == [name]
        report = next(w for w in doc["workers"] if w["name"] == name)
        assert report["status"] == "unhealthy"
        assert "--kv-events-config" in json.dumps(report)
        assert (
            'kvroute_worker_event_health{state="NO_EVENTS",worker="' + name
            in (await s.client.get("/metrics")).text
        )


async def test_a_warm_cache_the_index_does_not_show_is_not_silent_events() -> None:
    """The engine cached the prompt before this router started (no replay reaches that far):
    repeats of it store nothing, rightly. Their silence is not a worker whose events
    stopped: auto mode stays on events and /health stays ok."""
    sim = SimConfig(block_size=16, kv_blocks=512, topic="kv-events", replay_endpoint=None)
    prompt = "the same long system prompt that every request repeats " * 12
    body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 1}
    async with run_fleet(1, sim) as fleet:
        async with httpx.AsyncClient(timeout=30) as direct:
            assert (await direct.post(fleet.urls[0] + "/v1/completions", json=body)).is_success
        cfg = Config(
            workers=(WorkerConfig(fleet.urls[0]),),
            tokenizer=str(PACKAGED_TOKENIZER),
            mode="auto",
            event_grace_s=1.0,
            scrape_interval_s=0.2,
            health_check_interval_s=0.2,
        )
        app = RouterApp(cfg)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            for _ in range(8):
                resp = await client.post("/v1/completions", json=body)
                assert cached(resp) > 0
                await asyncio.sleep(0.3)
            (report,) = (await client.get("/health")).json()["workers"]
            assert report["mode"] == "events" and report["status"] == "ok", report


@pytest.mark.parametrize("n", [1, 2])
async def test_cold_prompts_whose_events_never_come_are_still_named(n: int) -> None:
    """The other side of the warm cache: cold prompts with n=2 report a sibling's hits
    (every block cached but the sampled tail), which is no sign of a warm cache; their
    events, sent to a dead port, must still be missed."""
    from router.procs import free_port

    async with run_fleet(1, SimConfig(block_size=16, kv_blocks=512, topic="kv-events")) as fleet:
        worker = WorkerConfig(fleet.urls[0], events=f"tcp://127.0.0.1:{free_port()}")
        cfg = Config(
            workers=(worker,),
            tokenizer=str(PACKAGED_TOKENIZER),
            mode="events",
            event_grace_s=1.0,
            health_check_interval_s=0.2,
        )
        app = RouterApp(cfg)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            for i in range(4):
                prompt = " ".join(f"w{i}x{j}" for j in range(40))
                assert (await complete(client, prompt, n=n)).is_success
            await asyncio.sleep(1.5)
            (report,) = (await client.get("/health")).json()["workers"]
            assert report["status"] == "unhealthy", report


async def test_killed_worker_is_ejected_and_requests_go_elsewhere() -> None:
    async with kvroute() as s:
        first = await complete(s.client, DOC)
        victim = next(w for w in s.fleet.workers if f"127.0.0.1:{w.port}" == worker_of(first))
        await victim.stop()
        again = await complete(s.client, DOC)  # connect fails: retried on the other worker
        assert again.status_code == 200 and worker_of(again) != worker_of(first)
        for _ in range(3):
            assert worker_of(await complete(s.client, DOC)) != worker_of(first)
        health = (await s.client.get("/health")).json()
        gone = next(w for w in health["workers"] if w["name"] == worker_of(first))
        assert gone["available"] is False
        # why it is out, not its events' verdict ("events flowing")
        assert "reason" not in gone and "events flowing" not in json.dumps(gone)
        assert gone["problems"][0].startswith(f"worker {worker_of(first)} is out of rotation: ")
        assert "re-admitted once its /health answers" in gone["problems"][0]


async def test_a_worker_that_cannot_be_reached_is_not_told_to_fix_its_event_flags() -> None:
    """A vLLM pod still loading its model refuses connections: that is not a worker
    started without --kv-events-config."""
    from router.procs import free_port

    down = f"http://127.0.0.1:{free_port()}"
    cfg = Config(
        workers=(WorkerConfig(down),),
        tokenizer=str(PACKAGED_TOKENIZER),
        mode="events",
        health_check_interval_s=60,
    )
    app = RouterApp(cfg)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
        for _ in range(200):
            (report,) = (await client.get("/health")).json()["workers"]
            if len(report["problems"]) > 1:
                break
            await asyncio.sleep(0.02)
        text = json.dumps(report)
        assert "could not ask for its KV event publishers" in text
        assert "--kv-events-config" not in text


async def test_a_worker_that_could_not_say_its_event_publishers_is_asked_again() -> None:
    """One 503 on /kv_event_sources (a server still loading) while /health passes: the next
    passing health check asks again, as /health says it will."""
    from pd_fakes import FakeWorker, prefill_status

    from router.asgi import send_json
    from router.procs import free_port

    asked = []
    publisher = f"tcp://127.0.0.1:{free_port()}"

    class Loading(FakeWorker):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] == "/kv_event_sources":
                asked.append(1)
                if len(asked) == 1:
                    await send_json(send, 503, {"error": "loading"})
                else:
                    doc = {"0": {"enable_kv_cache_events": True, "endpoint": publisher}}
                    await send_json(send, 200, doc)
                return
            await super().__call__(scope, receive, send)

    async with serve_in_process(Loading(prefill_status(500))) as worker:
        cfg = Config(
            workers=(WorkerConfig(worker),),
            tokenizer=str(PACKAGED_TOKENIZER),
            health_check_interval_s=0.2,
        )
        app = RouterApp(cfg)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            for _ in range(100):
                (report,) = (await client.get("/health")).json()["workers"]
                if report["events_endpoint"] == publisher:
                    break
                await asyncio.sleep(0.05)
            assert len(asked) == 2 and report["events_endpoint"] == publisher
            assert not any("could not ask" in p for p in report["problems"])


async def test_client_disconnect_cancels_the_worker_request() -> None:
    async with kvroute(n=1) as s:
        body = {
            "model": "kvroute-sim",
            "prompt": DOC,
            "max_tokens": 4000,
            "stream": True,
            "ignore_eos": True,
        }
        async with s.client.stream("POST", "/v1/completions", json=body) as resp:
            async for _ in resp.aiter_bytes():
                break  # got the first token: now hang up
        worker = s.fleet.workers[0]
        for _ in range(100):
            if worker.engine.stats().running == 0:
                break
            await asyncio.sleep(0.05)
        assert worker.engine.stats().running == 0


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b'{"model": "m"}', 400),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400),
        ("/v1/chat/completions", b'{"messages": []}', 400),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}', 400),
    ],
    ids=[
        "not-json",
        "not-object",
        "no-prompt",
        "negative-max-tokens",
        "empty-messages",
        "no-role",
    ],
)
async def test_bad_requests_get_openai_style_errors(path: str, body: bytes, status: int) -> None:
    async with kvroute(n=1) as s:
        resp = await s.client.post(path, content=body, headers={"content-type": "application/json"})
        assert resp.status_code == status
        err = resp.json()["error"]
        assert err["message"] and err["type"]


async def test_oversized_body_is_413() -> None:
    async with kvroute(n=1, max_body_bytes=1000) as s:
        resp = await complete(s.client, "x" * 5000)
        assert resp.status_code == 413 and "error" in resp.json()


async def test_hot_prefix_burst_respects_the_load_bound() -> None:
    scoring = ScoringConfig(balance_abs=2, balance_rel=1.0)
    async with kvroute(scoring=scoring) as s:
        warm = await complete(s.client, DOC)
        await wait_events(s.app, worker_of(warm))
        burst = await asyncio.gather(
            *(complete(s.client, DOC + f" q{i}", max_tokens=64) for i in range(12))
        )
        placed = [worker_of(r) for r in burst]
        counts = {w: placed.count(w) for w in set(placed)}
        assert len(counts) == 2, counts  # spilled over
        assert max(counts.values()) - min(counts.values()) <= 4, counts


async def test_connections_to_the_workers_are_open_before_requests_need_them() -> None:
    """A burst must not connect on the request path: at start-up each worker gets
    `warm_connections` idle connections, a request takes one (connecting nothing), and
    connections the engine closes (its keep-alive timeout) are replaced within a second."""
    async with kvroute(warm_connections=3) as s:
        up = s.app.upstream
        hosts = [(h.host, h.port) for h in s.app.pool.handles.values()]
        assert [up.idle(*hp) for hp in hosts] == [3, 3]
        r = await complete(s.client, DOC + " warm")
        assert r.status_code == 200, r.text
        assert up.connects_on_request == 0  # it took an open one
        for conns in up._idle.values():  # as the engine's keep-alive timeout does
            for c in conns:
                assert c.transport is not None
                c.transport.close()
        await asyncio.sleep(0)
        assert sum(up.idle(*hp) for hp in hosts) == 0
        for _ in range(300):  # the top-up runs every second
            if [up.idle(*hp) for hp in hosts] == [3, 3]:
                break
            await asyncio.sleep(0.01)
        assert [up.idle(*hp) for hp in hosts] == [3, 3]
    async with kvroute(warm_connections=0) as s:
        assert all(s.app.upstream.idle(h.host, h.port) == 0 for h in s.app.pool.handles.values())
        assert (await complete(s.client, DOC + " cold")).status_code == 200
        assert s.app.upstream.connects_on_request == 1


async def test_models_union_and_ready() -> None:
    async with kvroute() as s:
        assert (await s.client.get("/ready")).json() == {"ready": True}
        models = (await s.client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["kvroute-sim"]


async def test_admin_token_guards_and_reloads_the_worker_list() -> None:
    async with kvroute(admin_token="s3cret") as s:
        assert (await s.client.get("/admin/workers")).status_code == 403
        auth = {"authorization": "Bearer s3cret"}
        listed = (await s.client.get("/admin/workers", headers=auth)).json()["workers"]
        assert len(listed) == 2
        keep = s.fleet.urls[1]
        resp = await s.client.post("/admin/workers", json={"workers": [keep]}, headers=auth)
        assert resp.status_code == 200 and [w["url"] for w in resp.json()["workers"]] == [keep]
        for _ in range(3):
            assert worker_of(await complete(s.client, DOC)) == keep.removeprefix("http://")
        bad = await s.client.post("/admin/workers", json={"workers": ["ftp://x"]}, headers=auth)
        assert bad.status_code == 400 and "workers[0].url" in bad.json()["error"]["message"]


async def test_explain_prints_each_workers_terms(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from router.explain import run

    async with kvroute() as s:
        first = await complete(s.client, DOC)
        await wait_events(s.app, worker_of(first))
        args = argparse.Namespace(
            router=s.url,
            prompt=DOC,
            messages=None,
            model="",
            cache_salt=None,
            admin_token=None,
            json=False,
        )
        assert await asyncio.to_thread(run, args) == 0
    out = capsys.readouterr().out
    assert f"winner: {worker_of(first)}" in out
    assert "prefix" in out and "headroom" in out
    # the winner's row: its cache stored the document lately and lost none of it
    row = next(line.split() for line in out.splitlines() if line.startswith(worker_of(first)))
    head = next(line.split() for line in out.splitlines() if line.startswith("worker"))
    assert head[6:9] == ["demand", "refetched", "riding"]
    assert int(row[6]) >= int(row[2]) > 0 and row[7] == "0" and row[8] == "0", out


async def predicted_blocks(s: Setup, body: dict[str, Any], worker: str) -> int:
    route = (await s.client.post("/debug/route", json=body)).json()
    return int(next(w["overlap_blocks"] for w in route["workers"] if w["worker"] == worker))


async def test_cache_salt_and_lora_namespaces_never_share_blocks() -> None:
    sim = SimConfig(
        block_size=16,
        kv_blocks=512,
        topic="kv-events",
        lora_modules=(("lora-a", "/models/lora-a"),),
    )
    async with kvroute(n=1, sim=sim) as s:
        worker = f"127.0.0.1:{s.fleet.workers[0].port}"
        plain = await complete(s.client, DOC)
        await wait_events(s.app, worker)
        variants: list[dict[str, Any]] = [
            {"prompt": DOC, "cache_salt": "tenant-1"},
            {"prompt": DOC, "model": "lora-a"},
        ]
        for extra in variants:
            body = {"model": "kvroute-sim", "max_tokens": 4, **extra}
            assert await predicted_blocks(s, body, worker) == 0
            blocks_before = s.app.fleet.index.entries_of(worker)
            first = await s.client.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            assert cached(first) == 0  # the engine agrees: a different namespace
            await wait_events(s.app, worker, blocks_before + 1)
            again = await s.client.post("/v1/completions", json=body)
            prompt_tokens = again.json()["usage"]["prompt_tokens"]
            predicted = await predicted_blocks(s, body, worker)
            # an engine never serves a prompt's last token from cache
            assert cached(again) // 16 == min(predicted, (prompt_tokens - 1) // 16) > 0
        assert cached(plain) == 0


async def test_remote_tokenizer_routes_by_prefix_too() -> None:
    async with kvroute(tokenizer="remote") as s:
        first = await complete(s.client, DOC)
        await wait_events(s.app, worker_of(first))
        again = await complete(s.client, DOC + " again")
        assert worker_of(again) == worker_of(first) and cached(again) > 0
        assert s.app.routing._remote_cache.hits + s.app.routing._remote_cache.misses >= 2


async def test_request_id_is_kept_and_routing_headers_are_ignored() -> None:
    async with kvroute() as s:
        first = await complete(s.client, DOC)
        await wait_events(s.app, worker_of(first))
        other = next(
            f"127.0.0.1:{w.port}"
            for w in s.fleet.workers
            if f"127.0.0.1:{w.port}" != worker_of(first)
        )
        body = {"model": "kvroute-sim", "prompt": DOC, "max_tokens": 2}
        steer = {
            "x-kvroute-worker": other,
            "x-gateway-destination-endpoint": other,
            "x-request-id": "req-42",
        }
        resp = await s.client.post("/v1/completions", json=body, headers=steer)
        assert worker_of(resp) == worker_of(first)  # a client cannot steer the pick
        assert resp.headers["x-request-id"] == "req-42"
        fresh = await complete(s.client, DOC)
        assert len(fresh.headers["x-request-id"]) == 32


async def test_a_worker_restarted_without_events_is_rediscovered_and_forgotten() -> None:
    from engines.sim.worker import SimWorker

    async with kvroute(n=2, mode="events") as s:
        first = await complete(s.client, DOC)
        name = worker_of(first)
        await wait_events(s.app, name)
        old = next(w for w in s.fleet.workers if f"127.0.0.1:{w.port}" == name)
        await old.stop()
        reborn = SimWorker(old.config.replace(port=old.port, events=False))
        await asyncio.sleep(0.6)  # the health checks see it down...
        await reborn.start()
        try:
            for _ in range(100):  # ...and back: it is asked again what it publishes
                health = (await s.client.get("/health")).json()
                report = next(w for w in health["workers"] if w["name"] == name)
                if report["available"] and report["problems"]:
                    break
                await asyncio.sleep(0.05)
        finally:
            await reborn.stop()  # the fleet only stops the workers it started
        assert s.app.fleet.index.entries_of(name) == 0  # the old cache is gone with the old engine
        assert any("no KV event publisher" in p for p in report["problems"])
        assert name in health["unhealthy_workers"]
        # and what Prometheus reads says so too (an alert on it must fire)
        assert report["event_health"] == "NO_EVENTS"
        page = (await s.client.get("/metrics")).text
        line = f'kvroute_worker_event_health{{state="NO_EVENTS",worker="{name}"}} 1.0'
        assert line in page, [ln for ln in page.splitlines() if "event_health" in ln]


async def test_debug_log_line_shows_the_formula(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.DEBUG, logger="kvroute.proxy")
    async with kvroute(n=1) as s:
        await complete(s.client, DOC)
    line = next(r.message for r in caplog.records if r.message.startswith("request "))
    assert "total" in line and "prefix" in line and "load" in line and "scorers" in line


async def test_each_workers_index_entries_are_capped_at_its_capacity() -> None:
    from indexer.events import BlockStored, EventBatch
    from indexer.hashing import EngineBlockHash

    sim = SimConfig(block_size=16, kv_blocks=64, topic="kv-events")
    async with kvroute(1, sim=sim, index_cap_margin=1.5) as s:
        name = f"127.0.0.1:{s.fleet.workers[0].port}"
        for _ in range(100):  # the cap comes with the worker's cache config
            if s.app.fleet.workers[name].capacity_blocks:
                break
            await asyncio.sleep(0.02)
        # a worker whose removals were lost: 200 stored blocks, none removed
        tokens = list(range(200 * 16))
        ids = [EngineBlockHash(10_000 + i) for i in range(200)]
        s.app.fleet.index.apply(name, EventBatch(0.0, [BlockStored(ids, None, tokens, 16)]))
        assert s.app.fleet.index.entries_of(name) == 96  # 64 blocks x 1.5
        assert s.app.fleet.index.evicted_at_cap(name) == 104
        metrics = (await s.client.get("/metrics")).text
        assert f'kvroute_index_evicted_total{{cause="cap",worker="{name}"}} 104.0' in metrics


async def test_otel_span_per_decision_joins_the_clients_trace() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with run_fleet(1, SimConfig(block_size=16, kv_blocks=512)) as fleet:
        cfg = Config(
            workers=(WorkerConfig(fleet.urls[0]),), tokenizer=str(PACKAGED_TOKENIZER), otel=True
        )
        app = RouterApp(cfg, tracer_provider=provider)
        async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as client:
            trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
            headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
            resp = await client.post(
                "/v1/completions",
                json={"model": "kvroute-sim", "prompt": DOC, "max_tokens": 2},
                headers=headers,
            )
            assert resp.status_code == 200
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvroute.route"
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.attributes is not None
    assert span.attributes["kvroute.worker"] == resp.headers["x-kvroute-worker"]
    assert span.attributes["kvroute.prompt_tokens"] > 100


async def test_a_request_in_flight_at_its_workers_removal_leaves_no_series_behind() -> None:
    """It ends after the removal forgot the worker's series, and is counted then: what that
    brings back goes again (else each rollout with requests in flight leaves series)."""
    async with kvroute() as s:
        body = {"model": "kvroute-sim", "prompt": DOC, "max_tokens": 64, "stream": True}
        body["ignore_eos"] = True
        async with s.client.stream("POST", "/v1/completions", json=body) as resp:
            gone = worker_of(resp)
            chunks = resp.aiter_lines()
            assert (await anext(chunks)).startswith("data: ")
            keep = [u for u in s.fleet.urls if not u.endswith(gone.split(":")[1])]
            assert (await s.client.post("/admin/workers", json={"workers": keep})).is_success
            assert gone not in s.app.fleet.workers
            async for _ in chunks:
                pass
        for _ in range(100):  # the relay counts the request once its stream has ended
            text = (await s.client.get("/metrics")).text
            if f'worker="{gone}"' not in text:
                break
            await asyncio.sleep(0.02)
        named = sorted({line.split("{")[0] for line in text.splitlines() if gone in line})
        assert named == [], named


async def test_a_removed_worker_leaves_no_series_caps_or_connections_behind() -> None:
    """Pods that come back under new addresses (DNS, rollouts) must not grow the router's
    metrics, index caps or connection pool without bound."""
    async with kvroute() as s:
        ports = [w.port for w in s.fleet.workers]
        for rnd, host in enumerate(["localhost", "127.0.0.1", "localhost"]):
            urls = [f"http://{host}:{p}" for p in ports]
            resp = await s.client.post("/admin/workers", json={"workers": urls})
            assert resp.status_code == 200, resp.text
            for i in range(4):
                assert (await complete(s.client, f"round {rnd} request {i} " * 8)).is_success
        current = set(s.app.fleet.workers)
        assert current == {f"localhost:{p}" for p in ports}
        text = (await s.client.get("/metrics")).text
        named = {m for m in re.findall(r'worker="([^"]+)"', text)} - {"none"}
        assert named <= current, named - current
        for believed in (s.app.fleet.predictions, s.app.fleet.approx):
            assert set(believed._caps) <= current
        assert {f"{h}:{p}" for h, p, _ in s.app.upstream._idle} <= current
