"""Bad clients, dying and hung workers, HTTP hygiene: each defect reproduced on loopback
against simulated vLLM workers (in child processes where a worker must die or hang)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from engines.sim.fleet import FleetProcess, start_fleet_process
from router.app import RouterApp
from router.core.config import Config, ScoringConfig, WorkerConfig
from router.procs import serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(180)

DOC = " ".join(f"line {i} of a document about hardening routers." for i in range(60))
SIM_ARGS = ["--block-size", "16", "--kv-blocks", "512", "--topic", "kv-events"]


@dataclass
class Setup:
    fleets: list[FleetProcess]
    app: RouterApp
    url: str
    client: httpx.AsyncClient

    def name(self, i: int) -> str:
        return str(self.fleets[i].workers[0]["url"]).split("//", 1)[1]


@asynccontextmanager
async def router(n: int = 2, sim_args: tuple[str, ...] = (), **config: Any) -> AsyncIterator[Setup]:
    fleets = [
        await asyncio.to_thread(start_fleet_process, 1, [*SIM_ARGS, *sim_args]) for _ in range(n)
    ]
    try:
        urls = [str(f.workers[0]["url"]) for f in fleets]
        config.setdefault("tokenizer", str(PACKAGED_TOKENIZER))
        config.setdefault("health_check_interval_s", 0.3)
        config.setdefault("scrape_interval_s", 0.3)
        app = RouterApp(Config(workers=tuple(WorkerConfig(u) for u in urls), **config))
        async with (
            serve_in_process(app) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):
            yield Setup(fleets, app, url, client)
    finally:
        for f in fleets:
            os.kill(f.pid, signal.SIGCONT)  # in case a test left it stopped
            await asyncio.to_thread(f.stop)
            # a fleet these tests SIGKILLed on purpose keeps its folder (a failed child
            # does): nothing in it is news here
            shutil.rmtree(f.log.parent, ignore_errors=True)


def body(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 4, **kw}


async def stream_lines(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[str]:
    async with client.stream("POST", "/v1/completions", json=payload) as resp:
        assert resp.status_code == 200
        return [line async for line in resp.aiter_lines() if line.startswith("data: ")]


# ---- defect 3: admin endpoints --------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [({}, 404), ({"admin_insecure": True}, 200), ({"admin_token": "t"}, 403)],
    ids=["no-token-off", "insecure-open", "token-guards"],
)
async def test_admin_and_debug_are_off_without_a_token(
    config: dict[str, Any], expected: int
) -> None:
    async with router(1, **config) as s:
        for path in ("/admin/workers", "/debug/route?prompt=x"):
            resp = await s.client.get(path)
            assert resp.status_code == expected, (path, resp.text)
            if expected == 404:
                assert "--admin-token" in resp.json()["error"]["message"]
        moved = await s.client.post("/admin/workers", json={"workers": ["http://10.9.9.9:1"]})
        assert moved.status_code in (404, 403) or config.get("admin_insecure")


# ---- defect 5: a worker dies mid-stream -----------------------------------------------------


async def test_a_stream_cut_by_a_dying_worker_ends_with_an_error_event() -> None:
    async with router(1, ("--output-len", "400:400")) as s:
        lines: list[str] = []

        async def read() -> None:
            payload = body(DOC, max_tokens=400, stream=True)
            async with s.client.stream("POST", "/v1/completions", json=payload) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line)

        reader = asyncio.create_task(read())
        while len(lines) < 3:
            await asyncio.sleep(0.02)
        os.kill(s.fleets[0].pid, signal.SIGKILL)
        await asyncio.wait_for(reader, 30)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == 502 and "incomplete" in error["message"]
        assert "127.0.0.1" not in lines[-2]
        metrics = (await s.client.get("/metrics")).text
        assert 'kvroute_stream_errors_total{cause="worker_failed"' in metrics


# ---- defect 6: a client's 4xx is not the worker's silence ------------------------------------


async def test_a_clients_400_does_not_turn_health_red() -> None:
    async with router(1, ("--max-model-len", "64"), event_grace_s=0.5) as s:
        too_long = await s.client.post("/v1/completions", json=body(DOC))
        assert too_long.status_code == 400
        await asyncio.sleep(1.0)  # twice the grace
        health = await s.client.get("/health")
        assert health.status_code == 200, health.text


# ---- defect 7: a hung worker ----------------------------------------------------------------


async def test_a_hung_worker_is_ejected_and_its_waiting_requests_fail_over() -> None:
    async with router(2, health_timeout_s=0.5, first_byte_timeout_s=20) as s:
        hung = s.name(1)
        os.kill(s.fleets[1].pid, signal.SIGSTOP)
        sent = [s.client.post("/v1/completions", json=body(f"{DOC} {i}")) for i in range(8)]
        answers = await asyncio.wait_for(asyncio.gather(*sent), 20)
        assert [r.status_code for r in answers] == [200] * 8
        assert {r.headers["x-kvroute-worker"] for r in answers} == {s.name(0)}
        for _ in range(50):
            health = (await s.client.get("/health")).json()
            if hung in health["unhealthy_workers"]:
                break
            await asyncio.sleep(0.1)
        assert health["status"] != "ok" and hung in health["unhealthy_workers"]
        os.kill(s.fleets[1].pid, signal.SIGCONT)


async def test_a_whole_answer_past_the_request_timeout_is_a_504_run_once() -> None:
    """vLLM sends a non-streaming answer's head with its body: a long generation reaches
    the request timeout on a healthy worker. It must be a 504, not run again on the next
    worker, and not held against either: three in a row ejected both workers (and cut
    their streams)."""
    # health checks seldom: an ejection must not be undone by one before it is seen
    calm = {"health_check_interval_s": 30.0, "eject_after_timeouts": 2}
    async with router(2, request_timeout_s=1.0, **calm) as s:
        long = body(DOC, max_tokens=400, ignore_eos=True)  # ~6 s at 15 ms a token
        for _ in range(3):
            started = asyncio.get_running_loop().time()
            resp = await s.client.post("/v1/completions", json=long)
            took = asyncio.get_running_loop().time() - started
            assert resp.status_code == 504, resp.text
            assert "--request-timeout" in resp.json()["error"]["message"]
            assert took < 3.0  # one attempt, not two
        metrics = (await s.client.get("/metrics")).text
        assert "kvroute_retries_total{" not in metrics
        health = (await s.client.get("/health")).json()
        assert health["unhealthy_workers"] == [], health
        assert [h.timeouts for h in s.app.pool.handles.values()] == [0, 0]
        streamed = await stream_lines(s.client, body("a stream after them", stream=True))
        assert streamed[-1] == "data: [DONE]" and "error" not in "".join(streamed)


async def test_whole_answers_timing_out_on_an_engine_that_generates_nothing_eject_it() -> None:
    """The other side: an engine stuck behind a live API server (health checks pass) is
    still ejected by its non-streaming requests' timeouts, its scrapes showing no token."""
    stuck = ("--ttft-base-ms", "60000")  # its first step takes a minute
    calm = {"health_check_interval_s": 30.0, "eject_after_timeouts": 2}
    async with router(1, sim_args=stuck, request_timeout_s=1.0, **calm) as s:
        for _ in range(2):
            resp = await s.client.post("/v1/completions", json=body(f"{DOC} stuck"))
            assert resp.status_code == 504, resp.text
        health = (await s.client.get("/health")).json()
        assert health["unhealthy_workers"] == [s.name(0)], health


async def test_an_engine_ejected_for_timeouts_again_is_held_out_though_health_passes() -> None:
    """An engine stuck behind a live API server passes every /health. Re-admitted at the
    first (one ejection may be a passing stall), it is ejected again by its requests'
    timeouts and then held out for --timeout-hold, not let back at the next health check
    to cost another request its timeout every round."""
    stuck = ("--ttft-base-ms", "60000")  # its first step takes a minute
    calm = {"eject_after_timeouts": 1, "timeout_hold_s": 3.0, "health_check_interval_s": 0.2}
    async with router(1, sim_args=stuck, request_timeout_s=1.0, **calm) as s:
        (handle,) = s.app.pool.handles.values()
        first = await s.client.post("/v1/completions", json=body(f"{DOC} stuck once"))
        assert first.status_code == 504, first.text
        assert not handle.available
        for _ in range(50):  # the first ejection ends at the next passing /health
            if handle.available:
                break
            await asyncio.sleep(0.1)
        assert handle.available
        sent = asyncio.get_running_loop().time()
        again = await s.client.post("/v1/completions", json=body(f"{DOC} stuck again"))
        assert again.status_code == 504, again.text
        assert not handle.available
        (report,) = (await s.client.get("/health")).json()["workers"]
        assert 0 < report["held_s"] <= 3.0, report
        assert "--timeout-hold" in report["problems"][0], report
        await asyncio.sleep(1.0)  # five passing health checks
        assert not handle.available
        while not handle.available:  # back at the hold's end
            assert asyncio.get_running_loop().time() - sent < 15
            await asyncio.sleep(0.1)
        # the hold began at the ejection, a request timeout (1 s) after the request went
        assert asyncio.get_running_loop().time() - sent >= 3.9


async def test_a_refusal_between_timeouts_does_not_reset_their_count() -> None:
    """vLLM's API server refuses an invalid request without its engine: a hung engine
    answers such a 400 as fast as a live one, so it is no sign the engine works."""
    stuck = ("--ttft-base-ms", "60000")  # its first step takes a minute
    calm = {"health_check_interval_s": 30.0, "eject_after_timeouts": 2}
    async with router(1, sim_args=stuck, request_timeout_s=1.0, **calm) as s:
        first = await s.client.post("/v1/completions", json=body(f"{DOC} stuck"))
        assert first.status_code == 504, first.text
        invalid = body("stream options without a stream", stream_options={"include_usage": True})
        refused = await s.client.post("/v1/completions", json=invalid)
        assert refused.status_code == 400 and "x-kvroute-worker" in refused.headers
        second = await s.client.post("/v1/completions", json=body(f"{DOC} stuck again"))
        assert second.status_code == 504, second.text
        health = (await s.client.get("/health")).json()
        assert health["unhealthy_workers"] == [s.name(0)], health


async def test_an_embeddings_input_past_the_context_goes_to_the_engine_to_judge() -> None:
    """vLLM embeds inputs past max_model_len (chunked, --max-embed-len) or cuts them
    (truncate_prompt_tokens): the router must not refuse them with a completion's rule."""
    async with router(1) as s:
        long = " ".join(["word"] * 12_000)
        # a cut past the context too: vLLM bounds it by --max-embed-len, not max_model_len
        for extra in ({}, {"truncate_prompt_tokens": 100}, {"truncate_prompt_tokens": 10_000}):
            resp = await s.client.post(
                "/v1/embeddings", json={"model": "kvroute-sim", "input": long, **extra}
            )
            assert resp.headers.get("x-kvroute-worker") == s.name(0), resp.text
            assert "maximum context length" not in resp.text
        # a completion that long is still the router's to refuse, before any worker
        resp = await s.client.post("/v1/completions", json=body(long))
        assert resp.status_code == 400 and "x-kvroute-worker" not in resp.headers


async def test_a_retry_is_decided_again_when_the_load_bound_left_no_runner_up() -> None:
    """The worker holding a long stream is over the load bound, so the first decision ranks
    only the other one; that one is dead (not yet ejected): the retry must still find a worker."""
    scoring = ScoringConfig(balance_abs=0, balance_rel=1.0)
    slow = {"health_check_interval_s": 30.0, "scrape_interval_s": 30.0}
    async with router(2, scoring=scoring, **slow) as s:
        long = body(DOC, max_tokens=1500, stream=True)
        async with s.client.stream("POST", "/v1/completions", json=long) as held:
            busy = held.headers["x-kvroute-worker"]
            other = 1 if busy == s.name(0) else 0
            os.kill(s.fleets[other].pid, signal.SIGKILL)
            resp = await s.client.post("/v1/completions", json=body("another prompt entirely"))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvroute-worker"] == busy


# ---- defect 8: malformed input is a 4xx, never a traceback ------------------------------------


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}),
        ("/v1/completions", "[" * 100_000),
        ("/debug/route", "{not json"),
        ("/admin/workers", {"workers": [{"url": 5}]}),
    ],
    ids=["content-5", "content-null", "deep-json", "debug-bad-json", "admin-url-5"],
)
async def test_malformed_requests_get_an_openai_4xx(path: str, raw: Any) -> None:
    async with router(1, admin_insecure=True) as s:
        content = raw if isinstance(raw, str) else json.dumps(raw)
        resp = await s.client.post(path, content=content)
        assert 400 <= resp.status_code < 500, resp.text
        assert "Traceback" not in resp.text and "error" in resp.json()


# ---- defect 9: HTTP hygiene -----------------------------------------------------------------


async def test_headers_both_ways_and_the_routers_own_answers() -> None:
    async with router(1, max_body_bytes=10_000, header_timeout_s=0.5) as s:
        resp = await s.client.post(
            "/v1/completions",
            json=body("hello"),
            headers={"connection": "keep-alive, x-hop", "x-hop": "secret"},
        )
        assert resp.status_code == 200
        assert len(resp.headers.get_list("date")) <= 1
        assert len(resp.headers.get_list("server")) <= 1
        head = await s.client.head("/health")
        assert head.status_code == 200 and head.content == b""
        down = await raw_exchange(
            s.url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 999999\r\n\r\n"
        )
        assert down.startswith(b"HTTP/1.1 413")
        assert await slowloris_closed(s.url, within_s=3.0)


async def test_idle_client_connections_stay_open_for_the_keep_alive_timeout() -> None:
    """The keep-alive timeout reaches the server: a kept-alive connection outlives a second
    and closes after `keep_alive_timeout_s`. The default is above the idle timeouts of what
    reuses client connections (httpx 5 s, load balancers 60 s): at uvicorn's 5 s a client
    reusing a connection the router was closing lost its request."""
    assert Config().keep_alive_timeout_s > max(httpx.Limits().keepalive_expiry or 0, 60)
    async with router(1, keep_alive_timeout_s=2) as s:
        host, port = s.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n")
            await writer.drain()
            assert (await asyncio.wait_for(reader.read(4096), 5)).startswith(b"HTTP/1.1 200")
            with pytest.raises(TimeoutError):  # still open, idle
                await asyncio.wait_for(reader.read(), 1.0)
            assert await asyncio.wait_for(reader.read(), 3.0) == b""  # closed at 2 s
        finally:
            writer.close()


async def raw_exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(4096), 5)
    writer.close()
    return out


async def slowloris_closed(url: str, within_s: float) -> bool:
    """A request head that never completes is cut off (header timeout)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    await writer.drain()
    try:
        got = await asyncio.wait_for(reader.read(), within_s)
    except TimeoutError:
        return False
    finally:
        writer.close()
    return got == b""


async def test_error_bodies_name_no_internal_address() -> None:
    async with router(1, health_check_interval_s=60) as s:
        while s.app.pool.checks.health_rounds < 1:  # the first round would re-admit it
            await asyncio.sleep(0.01)
        s.app.pool.set_down(next(iter(s.app.pool.handles.values())), "test")
        resp = await s.client.post("/v1/completions", json=body("hi"))
        assert resp.status_code == 503
        assert "127.0.0.1" not in resp.text and s.name(0) not in resp.text


async def test_forwarded_headers_reach_the_worker() -> None:
    seen: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        lines = head.lower().split(b"\r\n")
        length = next((int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length")), 0)
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n"
            b"content-length: 2\r\n\r\nok"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with router(1) as s:
        # a plain HTTP server behind the router via passthrough of an unknown path
        s.app.pool.handles[s.name(0)].config = WorkerConfig(f"http://127.0.0.1:{port}")
        resp = await s.client.post(
            "/v1/not-routed",
            content=b"{}",
            headers={"connection": "x-hop", "x-hop": "1", "x-forwarded-for": "10.1.1.1"},
        )
        assert resp.status_code == 200
    server.close()
    head = seen[0].lower()
    assert b"x-hop" not in head
    assert b"x-forwarded-for: 10.1.1.1, 127.0.0.1" in head
    assert b"x-forwarded-proto: http" in head


async def test_drain_takes_a_worker_out_of_rotation_and_back() -> None:
    async with router(2, admin_insecure=True) as s:
        name = s.name(0)
        drained = await s.client.post(f"/admin/workers/{name}/drain")
        assert drained.status_code == 200 and drained.json()["draining"] is True
        for i in range(4):
            resp = await s.client.post("/v1/completions", json=body(f"{DOC} {i}"))
            assert resp.headers["x-kvroute-worker"] == s.name(1)
        assert (await s.client.post("/admin/workers/nope:1/drain")).status_code == 404
        await s.client.post(f"/admin/workers/{name}/undrain")
        seen = set()
        for i in range(8):
            resp = await s.client.post("/v1/completions", json=body(f"fresh {i} {DOC}"))
            seen.add(resp.headers["x-kvroute-worker"])
        assert name in seen


# ---- defect 4: big prompts ------------------------------------------------------------------


async def test_a_huge_prompt_is_refused_before_tokenizing_and_stalls_nobody() -> None:
    async with router(1, ("--max-model-len", "2048")) as s:
        huge = "lorem ipsum dolor sit amet " * 80_000  # ~2 MB
        stalls: list[float] = []

        async def probe() -> None:
            loop = asyncio.get_running_loop()
            for _ in range(20):
                t0 = loop.time()
                assert (await s.client.get("/ready")).status_code == 200
                stalls.append(loop.time() - t0)
                await asyncio.sleep(0.01)

        sent = [s.client.post("/v1/completions", json=body(huge)) for _ in range(3)]
        answers, _ = await asyncio.gather(asyncio.gather(*sent), probe())
        for resp in answers:
            assert resp.status_code == 400
            assert "maximum context length is 2048" in resp.json()["error"]["message"]
        assert max(stalls) < 1.0  # generous on a shared machine; the fault suite reports it
        fits = await s.client.post("/v1/completions", json=body("a prompt that fits"))
        assert fits.status_code == 200
