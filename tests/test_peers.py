"""Router replicas share placements (router/peers.py): over real ZMQ on loopback, what one
replica sends becomes a prediction on the other before any KV event; bad placements are
counted and dropped; the configuration names the fix."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from router.app import RouterApp
from router.core.config import Config, WorkerConfig, from_env, from_mapping
from router.core.errors import ConfigError
from router.core.fleet import APPROX, EVENTS, FleetState, WorkerState
from router.peers import PlacementLink, decode, encode
from router.procs import free_port, serve_in_process
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(120)

H = hash_request(list(range(64)), 16, Namespace())


def fleet_of(**modes: str) -> FleetState:
    fleet = FleetState(FakeClock())
    for name, mode in modes.items():
        fleet.add(WorkerState(name, mode, 16))
    return fleet


def test_wire_round_trip_and_malformed_frames() -> None:
    worker, hashes = decode(encode("10.0.0.1:8000", H))
    assert worker == "10.0.0.1:8000" and list(hashes) == list(H)
    for frames in ([b"w"], [b"w", b"123"], [b"w", b"", b"x"], [b"\xff\xfe", b""]):
        with pytest.raises((ValueError, UnicodeDecodeError)):
            decode(frames)


def test_a_placement_becomes_a_prediction_or_an_approximate_entry() -> None:
    fleet = fleet_of(ev=EVENTS, ap=APPROX)
    seen: list[str] = []
    link = PlacementLink(fleet, None, [], on_result=seen.append)
    assert link.apply(encode("ev", H)) == "applied"
    assert fleet.predictions.find_matches(H)["ev"].blocks == len(H)
    assert link.apply(encode("ap", H[:2])) == "applied"
    assert fleet.approx.find_matches(H)["ap"].blocks == 2
    assert link.apply(encode("gone:1", H)) == "unknown_worker"
    assert link.apply([b"ev"]) == "malformed"
    assert seen == ["applied", "applied", "unknown_worker", "malformed"]
    assert "gone:1" not in fleet.predictions.find_matches(H)


async def test_two_links_over_zmq() -> None:
    a_fleet, b_fleet = fleet_of(w=EVENTS), fleet_of(w=EVENTS)
    a_pub, b_pub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = PlacementLink(a_fleet, a_pub, [b_pub])
    b = PlacementLink(b_fleet, b_pub, [a_pub])
    await a.start()
    await b.start()
    try:
        # ZMQ's slow joiner: a SUB sees nothing sent before its subscription propagated
        for _ in range(200):
            a.sent("w", H)
            await asyncio.sleep(0.01)
            if b.counts["applied"]:
                break
        assert b_fleet.predictions.find_matches(H)["w"].blocks == len(H)
        assert a.counts["applied"] == 0  # nothing came back: b sent nothing
    finally:
        await a.stop()
        await b.stop()


@contextlib.asynccontextmanager
async def replicas(n: int = 2) -> AsyncIterator[tuple[list[RouterApp], list[httpx.AsyncClient]]]:
    sim = SimConfig(block_size=16, kv_blocks=512, topic="kv-events")
    async with run_fleet(2, sim) as fleet, contextlib.AsyncExitStack() as stack:
        links = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
        apps, clients = [], []
        for i in range(n):
            cfg = Config(
                workers=tuple(WorkerConfig(u) for u in fleet.urls),
                tokenizer=str(PACKAGED_TOKENIZER),
                admin_insecure=True,
                peer_publish=links[i],
                peers=tuple(link for j, link in enumerate(links) if j != i),
                scrape_interval_s=0.2,
                health_check_interval_s=0.2,
            )
            app = RouterApp(cfg)
            url = await stack.enter_async_context(serve_in_process(app))
            clients.append(
                await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
            )
            apps.append(app)
        yield apps, clients


async def complete(client: httpx.AsyncClient, prompt: str) -> httpx.Response:
    body: dict[str, Any] = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response


async def test_replicas_see_each_others_placements_before_the_events() -> None:
    """Replica b sends nothing, yet after replica a routes new prompts b holds predictions
    for them on the worker a chose, and a sibling sent to b goes to that worker."""
    async with replicas() as ((_, b), (ca, cb)):
        # the slow joiner again: prime the link until b has applied a placement
        for i in range(100):
            await complete(ca, f"warm-up {i}: " + "the router sends each request on " * 20)
            if b.peers is not None and b.peers.counts["applied"]:
                break
            await asyncio.sleep(0.05)
        assert b.peers is not None and b.peers.counts["applied"] > 0
        for k in range(4):
            doc = f"document {k}: " + " ".join(f"block{k}x{i} of the cache" for i in range(90))
            served = (await complete(ca, doc + " first question?")).headers["x-kvroute-worker"]
            assert b.fleet.predictions.entries_of(served) > 0
            again = (await complete(cb, doc + " another question?")).headers["x-kvroute-worker"]
            assert again == served
        scrape = (await cb.get("/metrics")).text
        assert 'kvroute_peer_placements_total{result="applied"}' in scrape


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"peer_publish": "0.0.0.0:5570"}, "peer_publish"),
        ({"peers": ["http://kvroute-1:5570"]}, "peers[0]"),
        ({"peers": ["tcp://kvroute-1"]}, "peers[0]"),
        ({"peer_publish": "tcp://0.0.0.0:5570", "peers": ["tcp://0.0.0.0:5570"]}, "peers"),
    ],
)
def test_bad_peer_endpoints_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"workers": ["http://127.0.0.1:8000"], **fields}, Config()).validate()
    assert err.value.param == param
    want = "itself" if param == "peers" else "tcp://HOST:PORT"
    assert want in err.value.message


def test_peers_from_the_environment() -> None:
    env = {
        "KVROUTE_WORKERS": "http://127.0.0.1:8000",
        "KVROUTE_PEERS": "tcp://kvroute-1:5570, tcp://kvroute-2:5570",
        "KVROUTE_PEER_PUBLISH": "tcp://0.0.0.0:5570",
    }
    cfg = from_env(Config(), env).validate()
    assert cfg.peers == ("tcp://kvroute-1:5570", "tcp://kvroute-2:5570")
    assert cfg.peer_publish == "tcp://0.0.0.0:5570"


async def test_peers_found_through_dns_skip_this_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """`peers_dns` subscribes to every address the name resolves to but this pod's own
    ($POD_IP): here localhost stands for the headless Service."""
    a_fleet, b_fleet = fleet_of(w=EVENTS), fleet_of(w=EVENTS)
    port = free_port()
    a = PlacementLink(a_fleet, f"tcp://127.0.0.1:{port}", [])
    monkeypatch.setenv("POD_IP", "127.0.0.1")  # a resolving itself connects to nobody
    own = PlacementLink(fleet_of(w=EVENTS), None, [], peers_dns=f"localhost:{port}")
    await own.start()
    assert f"tcp://127.0.0.1:{port}" not in own._connected
    await own.stop()
    monkeypatch.setenv("POD_IP", "10.255.0.9")
    b = PlacementLink(b_fleet, None, [], peers_dns=f"localhost:{port}", dns_interval_s=0.05)
    await a.start()
    await b.start()
    try:
        assert f"tcp://127.0.0.1:{port}" in b._connected
        for _ in range(200):
            a.sent("w", H)
            await asyncio.sleep(0.01)
            if b.counts["applied"]:
                break
        assert b_fleet.predictions.find_matches(H)["w"].blocks == len(H)
    finally:
        await a.stop()
        await b.stop()
