"""Router replicas share placements and in-flight load (router/peers.py): over real ZMQ on
loopback, what one replica sends becomes a prediction on the other before any KV event, and
its in-flight requests count in the other's load; bad messages are counted and dropped; the
configuration names the fix."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.sim.config import SimConfig
from engines.sim.fleet import run_fleet
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from router import peers
from router.app import RouterApp
from router.core.config import Config, WorkerConfig, from_env, from_mapping
from router.core.errors import ConfigError
from router.core.fleet import APPROX, EVENTS, FleetState, WorkerState
from router.core.load import LoadTracker, PeerLoad
from router.peers import (
    CATCH_UP_S,
    LINK_WAIT_S,
    SILENT_S,
    WITHDRAWALS,
    PlacementLink,
    decode,
    decode_load,
    encode,
    encode_load,
)
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
    placed = decode(encode([("10.0.0.1:8000", H), ("10.0.0.2:8000", H[:2])]))
    assert [(w, list(h)) for w, h in placed] == [("10.0.0.1:8000", H), ("10.0.0.2:8000", H[:2])]
    one = encode([("w", H)])
    assert [(w, list(h)) for w, h in decode(one[1:])] == [("w", H)]  # a lone pair, as before
    for frames in (
        [b"w"],
        [b"w", b"123"],
        [b"w", b"", b"x"],
        [b"\xff\xfe", b""],
        [b"placements"],
        [b"placements", b"w"],
        [*one, b"w", b"1234567"],
        [b"x", b"", b"y", b""],  # untagged pairs beyond one: not a message anyone sends
    ):
        with pytest.raises((ValueError, UnicodeDecodeError)):
            decode(frames)


def test_a_placement_becomes_a_prediction_or_an_approximate_entry() -> None:
    fleet = fleet_of(ev=EVENTS, ap=APPROX)
    seen: list[str] = []
    link = PlacementLink(fleet, None, [], on_result=seen.append)
    assert link.apply(encode([("ev", H), ("ap", H[:2]), ("gone:1", H)])) == [
        "applied",
        "applied",
        "unknown_worker",
    ]
    assert fleet.predictions.find_matches(H)["ev"].blocks == len(H)
    assert fleet.approx.find_matches(H)["ap"].blocks == 2
    assert link.apply([b"ev"]) == ["malformed"]
    assert seen == ["applied", "applied", "unknown_worker", "malformed"]
    assert "gone:1" not in fleet.predictions.find_matches(H)


@pytest.mark.parametrize("mode", [EVENTS, APPROX])
def test_a_withdrawal_takes_a_peers_placement_back(mode: str) -> None:
    """A gateway's fallback served the peer's request elsewhere: what its placement made
    this replica believe goes, and what this replica placed there itself stays."""
    fleet = fleet_of(w=mode, v=mode)
    believed = fleet.predictions if mode == EVENTS else fleet.approx
    link = PlacementLink(fleet, None, [])
    link.apply(encode([("w", H[:2])]))  # an earlier request, served there
    link.apply(encode([("w", H)]))
    assert believed.find_matches(H)["w"].blocks == len(H)
    withdrawal = encode([("w", H), ("gone:1", H)], WITHDRAWALS)
    assert decode(withdrawal)[0][0] == "w"
    assert link.apply(withdrawal) == ["withdrawn", "unknown_worker"]
    assert believed.find_matches(H)["w"].blocks == 2
    assert link.apply([WITHDRAWALS, b"w"]) == ["malformed"]
    assert link.counts["withdrawn"] == 1


@pytest.mark.parametrize("mode", [EVENTS, APPROX])
def test_a_withdrawal_of_a_placement_never_received_or_expired_keeps_this_replicas_own(
    mode: str,
) -> None:
    """The peer's placement was lost (a reconnect, a full queue) or its entries expired;
    this replica sent the same prompt there itself: the withdrawal must not take that
    back. A placement received twice is taken back once per withdrawal."""
    fleet = fleet_of(w=mode)
    believed = fleet.predictions if mode == EVENTS else fleet.approx
    link = PlacementLink(fleet, None, [])
    believed.record("w", H)  # this replica's own request
    assert link.apply(encode([("w", H)], WITHDRAWALS), now=0.0) == ["unmatched_withdrawal"]
    assert believed.find_matches(H)["w"].blocks == len(H)
    link.apply(encode([("w", H[:3])]), now=0.0)
    late = believed.ttl_s + 1
    assert link.apply(encode([("w", H[:3])], WITHDRAWALS), now=late) == ["unmatched_withdrawal"]
    link.apply(encode([("w", H[:2])]), now=0.0)
    link.apply(encode([("w", H[:2])]), now=0.0)
    results = [link.apply(encode([("w", H[:2])], WITHDRAWALS), now=1.0)[0] for _ in range(3)]
    assert results == ["withdrawn", "withdrawn", "unmatched_withdrawal"]
    assert link.apply([WITHDRAWALS, b"w", b""], now=1.0) == ["unmatched_withdrawal"]
    assert believed.find_matches(H)["w"].blocks == len(H)


def test_what_withdrawals_may_take_back_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Placements remembered for withdrawals: a hot chain keeps a few arrivals, the least
    recently placed chain goes first at the cap, and what every index has expired is
    pruned."""
    monkeypatch.setattr(peers, "RECEIVED_MAX", 3)
    fleet = fleet_of(w=APPROX)
    link = PlacementLink(fleet, None, [])
    for i in range(1000):
        link.apply(encode([("w", H)]), now=float(i) / 1000)
    assert len(link._received[("w", H[-1])]) == peers.RECEIVED_PER_CHAIN
    chains = [hash_request(list(range(k, k + 32)), 16, Namespace()) for k in (100, 200, 300)]
    for chain in chains:
        link.apply(encode([("w", chain)]), now=1.0)  # H is now the least recently placed
    link.apply(encode([("w", chains[0])]), now=1.5)
    assert ("w", H[-1]) not in link._received and len(link._received) == 3
    link.apply(encode([("w", H)]), now=2.0)  # evicts chains[1], placed least recently
    assert ("w", chains[1][-1]) not in link._received
    assert ("w", chains[0][-1]) in link._received
    link.prune_received(now=1.9 + fleet.approx.ttl_s)
    assert list(link._received) == [("w", H[-1])]
    link.prune_received(now=3.0 + fleet.approx.ttl_s)
    assert not link._received


def test_a_placement_repeating_a_hash_is_malformed() -> None:
    """No chain repeats a block hash, and the index's records assume none does: such a
    placement from a peer is dropped, not applied to fail a later expiry."""
    link = PlacementLink(fleet_of(w=APPROX), None, [])
    assert link.apply(encode([("w", [7, 7])])) == ["malformed"]
    assert link.apply(encode([("w", [7, 8])])) == ["applied"]


def test_a_peers_new_prefix_counts_here_and_its_repeat_does_not() -> None:
    """A placement of blocks this replica knows on no endpoint is a new prefix there, as it
    was for the peer; a later turn of it, or a sibling this replica placed itself, is not."""
    fleet = fleet_of(a=EVENTS, b=EVENTS)
    link = PlacementLink(fleet, None, [])
    homes = fleet.workers["a"].new_blocks
    assert homes is not None
    link.apply(encode([("a", H[:2])]))
    assert homes.value() == 2.0  # its blocks
    link.apply(encode([("a", H)]))  # the next turn: extends what a was sent
    other = hash_request(list(range(500, 564)), 16, Namespace())
    fleet.predictions.record("b", other)  # placed here a moment ago
    link.apply(encode([("a", other)]))
    assert homes.value() == 2.0 and fleet.workers["b"].new_blocks.value() == 0.0  # type: ignore[union-attr]


def test_only_a_replica_that_hears_a_lower_id_waits_before_a_new_prefix() -> None:
    fleet = fleet_of(w=EVENTS)
    link = PlacementLink(fleet, None, [], wait_s=0.005)
    link.replica = bytes.fromhex("80" * 8)
    assert link.placement_wait() == 0.0  # no peer heard: nothing to wait for
    link.apply(encode_load(bytes.fromhex("ff" * 8), [("w", PeerLoad(0, 0, 0))]), now=1.0)
    assert link.placement_wait() == 0.0  # the first of the two places at once
    link.apply(encode_load(bytes.fromhex("01" * 8), [("w", PeerLoad(0, 0, 0))]), now=1.0)
    assert link.placement_wait() == 0.005
    link.wait_s = 0.0
    assert link.placement_wait() == 0.0


def test_load_wire_round_trip_and_malformed_reports() -> None:
    frames = encode_load(
        b"\x01" * 8, [("10.0.0.1:8000", PeerLoad(3, 200, 17, 2)), ("b", PeerLoad(0, 0, 1))]
    )
    assert decode_load(frames) == (
        "01" * 8,
        [("10.0.0.1:8000", PeerLoad(3, 200, 17, 2)), ("b", PeerLoad(0, 0, 1))],
    )
    # a replica of the release before riders were published sends three int64: none riding
    older = [b"load", b"\x02" * 8, b"w", struct.pack("<qqq", 4, 50, 9)]
    assert decode_load(older) == ("02" * 8, [("w", PeerLoad(4, 50, 9, 0))])
    bad = encode_load(b"r", [("w", PeerLoad(1, 1, 1))])
    for frames in (bad[:3], [b"lode", *bad[1:]], [*bad[:3], b"\0" * 23], [*bad, b"w"], bad[:2]):
        with pytest.raises(ValueError):
            decode_load(frames)
    with pytest.raises(ValueError, match="negative"):
        decode_load(encode_load(b"r", [("w", PeerLoad(-1, 0, 0))]))
    with pytest.raises(ValueError, match="negative"):
        decode_load(encode_load(b"r", [("w", PeerLoad(1, 0, 0, -1))]))


def test_riders_count_across_replicas() -> None:
    """The placement scorer weighs the requests riding a prefill in progress on a worker;
    a replica must see its peers' riders too, or a hot prefix's worker looks half as
    stalled to each of two replicas and draws cold prefixes."""
    load = LoadTracker()
    load.start("w", uncached_tokens=0, blocks=4, rides=True)
    load.peer("b", "w", PeerLoad(5, 300, 0, riders=4))
    assert load.view("w").riders == 1 + 4
    assert load.local("w") == PeerLoad(1, 0, 0, riders=1)  # what it tells its peers
    load.peer("b", "w", PeerLoad(5, 0, 20, riders=0))  # b's riders reached their first token
    assert load.view("w").riders == 1
    load.forget_peer("b")
    assert load.view("w").riders == 1


def test_peer_load_counts_once_next_to_the_scrape() -> None:
    """A peer's requests count as this replica's own, and the engine's scraped count is not
    added on top of them (it already includes them)."""
    load = LoadTracker()
    mine = load.start("w", uncached_tokens=100, blocks=4)
    load.peer("b", "w", PeerLoad(3, 300, 8))
    assert (load.view("w").requests, load.view("w").prefill_tokens) == (4, 400)
    assert load.view("w").decode_blocks == 8
    load.scraped("w", running=4, waiting=1, kv_usage=0.5, capacity_blocks=100)
    assert load.view("w").requests == 5  # 1 mine + 3 b's + 1 from nobody we know
    assert load.local("w") == PeerLoad(1, 100, 0)  # what this replica tells its peers
    load.peer("b", "w", PeerLoad(0, 0, 0))
    assert load.view("w").requests == 1 + 1
    load.peer("b", "w", PeerLoad(2, 0, 0))
    load.forget_peer("b")
    load.finish(mine)
    assert load.view("w").requests == 1  # the scrape's stranger only


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("start"), st.sampled_from("wx"), st.integers(0, 500)),
            st.tuples(st.just("finish"), st.integers(0, 30), st.just(0)),
            st.tuples(st.just("first"), st.integers(0, 30), st.just(0)),
            st.tuples(st.sampled_from(["pa", "pb"]), st.sampled_from("wx"), st.integers(0, 9)),
            st.tuples(st.just("forget"), st.sampled_from(["pa", "pb"]), st.just(0)),
        ),
        max_size=60,
    )
)
def test_load_against_a_model(ops: list[tuple[str, Any, int]]) -> None:
    """Requests in view = this replica's unfinished tickets + each live peer's latest report,
    and what a replica publishes is its own count only."""
    load = LoadTracker()
    changed: list[str] = []
    load.on_change = changed.append
    tickets: list[Any] = []
    peers: dict[tuple[str, str], int] = {}
    for op, arg, n in ops:
        if op == "start":
            tickets.append(load.start(arg, n, 2, rides=n % 2 == 1))
            assert changed[-1] == arg
        elif op in ("finish", "first") and tickets:
            t = tickets[arg % len(tickets)]
            (load.finish if op == "finish" else load.first_token)(t)
        elif op in ("pa", "pb"):
            load.peer(op, arg, PeerLoad(n, n * 10, n, riders=n // 2))
            peers[(op, arg)] = n
        elif op == "forget":
            load.forget_peer(arg)
            peers = {k: v for k, v in peers.items() if k[0] != arg}
    for w in "wx":
        own = sum(1 for t in tickets if t.worker == w and not t.done)
        theirs = sum(v for (_, pw), v in peers.items() if pw == w)
        assert load.local(w).requests == own
        assert load.view(w).requests == load.known(w).requests == own + theirs
        assert load.local(w).prefill_tokens == sum(
            t.prefill_tokens
            for t in tickets
            if t.worker == w and not (t.done or t.first_token_seen)
        )
        own_riders = sum(
            t.rides for t in tickets if t.worker == w and not (t.done or t.first_token_seen)
        )
        their_riders = sum(v // 2 for (_, pw), v in peers.items() if pw == w)
        assert load.local(w).riders == own_riders
        assert load.view(w).riders == own_riders + their_riders


def test_a_load_report_is_counted_and_a_silent_replica_forgotten() -> None:
    fleet = fleet_of(w=EVENTS)
    heard: list[int] = []
    link = PlacementLink(fleet, None, [], on_peers=heard.append)
    report = encode_load(b"\xaa" * 8, [("w", PeerLoad(5, 0, 0)), ("gone:1", PeerLoad(1, 0, 0))])
    assert link.apply(report, now=100.0) == ["load", "unknown_worker"]
    assert fleet.load.view("w").requests == 5 and heard == [1]
    assert link.apply([b"load", b"x", b"w", b"short"]) == ["malformed"]
    link.expire(100.0 + SILENT_S - 0.1)
    assert fleet.load.view("w").requests == 5
    link.expire(100.0 + SILENT_S)
    assert fleet.load.view("w").requests == 0 and heard[-1] == 0


def test_a_replica_that_stops_reporting_an_endpoint_stops_counting_there() -> None:
    """A replica that removed an endpoint (an admin call that reached only it) reports it no
    more; its last load there must not count forever while it reports the others."""
    fleet = fleet_of(w1=EVENTS, w2=EVENTS)
    link = PlacementLink(fleet, None, [])
    peer = b"\xaa" * 8
    link.apply(encode_load(peer, [("w1", PeerLoad(2, 600, 0)), ("w2", PeerLoad(1, 0, 0))]), 100.0)
    for t in (101.0, 102.0, 103.0, 100.0 + SILENT_S):  # heartbeats: w2 only now
        link.apply(encode_load(peer, [("w2", PeerLoad(1, 0, 0))]), now=t)
        link.expire(t)
    assert fleet.load.view("w1").requests == 0 and fleet.load.view("w1").prefill_tokens == 0
    assert fleet.load.view("w2").requests == 1 and peer.hex() in link.heard


def test_a_replicas_own_reports_are_not_counted_again() -> None:
    fleet = fleet_of(w=EVENTS)
    link = PlacementLink(fleet, None, [])
    fleet.load.start("w", 100, 2)
    own = encode_load(link.replica, [("w", fleet.load.local("w"))])
    assert link.apply(own, now=100.0) == ["self"]
    assert fleet.load.view("w").requests == 1 and link.heard == {}


async def test_two_links_over_zmq(monkeypatch: pytest.MonkeyPatch) -> None:
    # no heartbeat within the test: what arrives came at once, not with the next one
    monkeypatch.setattr(peers, "HEARTBEAT_S", 60.0)
    a_fleet, b_fleet = fleet_of(w=EVENTS), fleet_of(w=EVENTS)
    a_pub, b_pub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = PlacementLink(a_fleet, a_pub, [b_pub])
    b = PlacementLink(b_fleet, b_pub, [a_pub])
    await a.start()
    await b.start()
    try:
        await prime(a, b)
        assert b_fleet.predictions.find_matches(H)["w"].blocks == len(H)
        assert a.counts["applied"] == 0  # nothing came back: b sent nothing
        # a's in-flight request counts on b at once (not at the next heartbeat), and its end
        ticket = a_fleet.load.start("w", uncached_tokens=500, blocks=4)
        await until(lambda: b_fleet.load.view("w").prefill_tokens == 500, within_s=5)
        assert b_fleet.load.view("w").requests == 1 and a_fleet.load.view("w").requests == 1
        a_fleet.load.finish(ticket)
        await until(lambda: b_fleet.load.view("w").requests == 0, within_s=5)
    finally:
        await a.stop()
        await b.stop()


async def test_fresh_replicas_hear_each_other_before_any_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two replicas started 0.2 s apart, no traffic: each hears the other well before the
    next heartbeat (a PUB drops what it sends before a subscriber's connection is up, so
    with heartbeats alone they first met when the first requests moved their load), and
    each is linked; until then the later one is not."""
    # no heartbeat after the first: what each hears came with the other's greeting
    monkeypatch.setattr(peers, "HEARTBEAT_S", 60.0)
    a_fleet, b_fleet = fleet_of(w=EVENTS), fleet_of(w=EVENTS)
    a_pub, b_pub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = PlacementLink(a_fleet, a_pub, [b_pub])
    b = PlacementLink(b_fleet, b_pub, [a_pub])
    await a.start()
    try:
        await asyncio.sleep(0.2)
        assert not a.heard and not a.linked() and a.expected() == 1
        await b.start()
        assert not b.linked()
        await until(lambda: bool(a.heard and b.heard), within_s=5)
        assert a.linked() and b.linked()
    finally:
        await a.stop()
        await b.stop()


def test_a_replica_whose_peer_is_down_is_linked_after_the_wait() -> None:
    """/ready waits for the peers at most LINK_WAIT_S: a peer that is down must not keep a
    replica from serving."""
    link = PlacementLink(fleet_of(w=EVENTS), None, [])
    link._connected = {"tcp://10.0.0.9:5570"}  # subscribed, never heard
    t0 = link._started
    assert not link.linked(now=t0 + LINK_WAIT_S - 0.01)
    assert link.linked(now=t0 + LINK_WAIT_S)
    link.apply(encode_load(b"\x01" * 8, [("w", PeerLoad(0, 0, 0))]))
    assert link.linked(now=t0)


def test_a_peer_not_heard_after_the_wait_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    link = PlacementLink(fleet_of(w=EVENTS), None, [])
    link._connected = {"tcp://10.0.0.9:5570"}
    t0 = link._started
    with caplog.at_level(logging.WARNING, logger="kvroute.peers"):
        link.check_linked(t0 + LINK_WAIT_S - 0.01)
        assert not caplog.records
        link.check_linked(t0 + LINK_WAIT_S)
        link.check_linked(t0 + LINK_WAIT_S + 1)
    assert len(caplog.records) == 1
    assert "heard 0 of the 1 peers" in caplog.text and "tcp://10.0.0.9:5570" in caplog.text
    heard = PlacementLink(fleet_of(w=EVENTS), None, [])
    heard._connected = {"tcp://10.0.0.9:5570"}
    heard.apply(encode_load(b"\x01" * 8, [("w", PeerLoad(0, 0, 0))]))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvroute.peers"):
        heard.check_linked(heard._started + LINK_WAIT_S)
    assert not caplog.records


@contextlib.asynccontextmanager
async def joined() -> AsyncIterator[tuple[PlacementLink, PlacementLink]]:
    """Two links over real ZMQ, `b` subscribed to `a` and past `a`'s greeting."""
    a_pub = f"tcp://127.0.0.1:{free_port()}"
    a = PlacementLink(fleet_of(w=EVENTS), a_pub, [])
    b = PlacementLink(fleet_of(w=EVENTS), None, [a_pub])
    await a.start()
    await b.start()
    try:
        await until(lambda: b.counts["load"] > 0, within_s=5)  # a's heartbeat: joined
        # a greets b's subscription on its catch-up timer, and its first heartbeat may reach
        # b too: whichever comes second must be read before the placements are counted
        await asyncio.sleep(5 * CATCH_UP_S)
        b.drain()
        yield a, b
    finally:
        await a.stop()
        await b.stop()


async def test_drain_applies_what_arrived_before_the_receive_task_runs() -> None:
    """The pick calls drain: a placement already in the socket counts even while the event
    loop has not yet run the receive task (a burst of requests holds it for milliseconds)."""
    async with joined() as (a, b):
        b_fleet = b.fleet
        assert b._sub_now is not None
        a.sent("w", H)
        a.sent("w", H[:1])  # placed in the same turn: one message
        a.flush()  # what the next turn of a's event loop does
        assert b._sub_now.poll(2000)  # delivered; the loop is blocked, so not yet applied
        assert "w" not in b_fleet.predictions.find_matches(H)
        assert b.drain() == 1 and b.drain() == 0
        assert b_fleet.predictions.find_matches(H)["w"].blocks == len(H)
        assert b.counts["applied"] == 2


async def test_a_new_prefix_leaves_at_once_with_the_load_behind_it() -> None:
    """A repeat's placement waits for the end of the loop's turn (one message per turn); a
    new prefix's goes at the send, with this replica's load on the worker: in a burst the
    turn runs every request that arrived with it, and a peer placing meanwhile would place
    blind. The loop never turns here, so only what was sent at once can arrive."""
    async with joined() as (a, b):
        a_fleet, b_fleet = a.fleet, b.fleet
        assert b._sub_now is not None
        other = hash_request(list(range(100, 164)), 16, Namespace())
        a_fleet.load.start("w", 64, 4)  # the request's load, counted at the pick
        a.sent("w", other)  # a repeat: waits for the turn
        assert not b._sub_now.poll(200)
        a_fleet.load.start("w", 64, 4)
        a.sent("w", H, new=True)  # the loop still has not turned
        assert b._sub_now.poll(2000)
        for _ in range(20):  # the placements, then the load report (blocking: no turn)
            b.drain()
            if b_fleet.load.view("w").requests == 2:
                break
            b._sub_now.poll(100)
        assert b_fleet.predictions.find_matches(H)["w"].blocks == len(H)
        assert b_fleet.predictions.find_matches(other)["w"].blocks == len(other)
        assert b_fleet.load.view("w").requests == 2


async def test_a_withdrawal_never_overtakes_the_placement_it_takes_back() -> None:
    """The placement waits for the end of the loop's turn; a withdrawal sent in the same
    turn must not arrive first, or the peer would withdraw nothing, then record it."""
    async with joined() as (a, b):
        assert b._sub_now is not None
        a.sent("w", H)  # queued for the turn's end, which never comes here
        a.withdrawn("w", H)
        for _ in range(20):
            b.drain()
            if b.counts["withdrawn"]:
                break
            b._sub_now.poll(100)
        assert b.counts["applied"] == 1 and b.counts["withdrawn"] == 1
        assert "w" not in b.fleet.predictions.find_matches(H)


async def prime(a: PlacementLink, b: PlacementLink) -> None:
    """ZMQ's slow joiner: a SUB sees nothing sent before its subscription propagated, so `a`
    sends H until `b` has applied it."""
    for _ in range(200):
        a.sent("w", H)
        await asyncio.sleep(0.01)
        if b.counts["applied"]:
            return


async def until(check: Callable[[], bool], within_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.005)


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
        assert 'kvroute_peer_placements_total{result="load"}' in scrape
        assert "kvroute_peer_replicas 1.0" in scrape  # b counts a's in-flight load


async def test_two_replicas_placing_new_prompts_at_once_spread_them() -> None:
    """Pairs of new prompts, one to each replica at the same instant: the replica that is
    not first waits peer_wait_ms, sees the other's placement and takes the other worker,
    so every pair spreads over both (without the wait both see the same least demanded
    worker; earlier, pairs landed together within three pairs in 5 of 5 tries)."""
    async with replicas() as (apps, clients):
        for _ in range(100):  # the slow joiner: until each has heard and applied the other
            for client in clients:
                await complete(client, "warm-up: " + "the router sends each request on " * 4)
            # heard alone is not enough: the greeting (load) reaches a new subscriber at
            # once, while a placement published before its subscription took is dropped
            links = [app.peers for app in apps]
            if all(p is not None and p.heard and p.counts["applied"] for p in links):
                break
            await asyncio.sleep(0.05)
        assert all(app.peers is not None and app.peers.counts["applied"] for app in apps)
        for app in apps:  # the warm-up's placements count alike from here on
            for w in app.fleet.workers.values():
                assert w.new_blocks is not None
                w.new_blocks.clear()
        for k in range(6):
            docs = [f"pair {k} doc {j}: " + f"words of pair {k} doc {j} " * 60 for j in (0, 1)]
            answers = await asyncio.gather(
                *(complete(client, doc) for client, doc in zip(clients, docs, strict=True))
            )
            served = {r.headers["x-kvroute-worker"] for r in answers}
            assert len(served) == 2, f"pair {k} landed together on {served}"
            await asyncio.sleep(0.05)  # both have heard the other's placement
        scrapes = [(await client.get("/metrics")).text for client in clients]
        waited = [t for t in scrapes if "kvroute_placement_waits_total{" in t]
        assert len(waited) == 1, "one replica, the follower, waited before new prefixes"


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


@pytest.mark.parametrize("value", [-1, 5000, float("nan")])
def test_a_bad_peer_wait_names_the_field(value: float) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(
            {"workers": ["http://127.0.0.1:8000"], "peer_wait_ms": value}, Config()
        ).validate()
    assert err.value.param == "peer_wait_ms" and "0..1000 ms" in err.value.message


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
        await prime(a, b)
        assert b_fleet.predictions.find_matches(H)["w"].blocks == len(H)
    finally:
        await a.stop()
        await b.stop()
