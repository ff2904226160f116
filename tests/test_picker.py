"""The routing brain on a fake clock: stickiness, cache pressure, load bound, policies."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from indexer.clock import FakeClock
from indexer.events import BlockStored, EventBatch
from indexer.hashing import EngineBlockHash, Namespace, hash_request
from indexer.health import HealthTracker
from router.core.config import Config, ScoringConfig
from router.core.decision import Decision, RouteRequest
from router.core.errors import NoWorkerAvailable
from router.core.fleet import APPROX, EVENTS, FleetState, WorkerState
from router.core.load import PeerLoad, Ticket
from router.core.picker import Picker
from router.metrics import RouterMetrics
from router.routing import DecisionService

BS = 4
NS = Namespace()


def prompt(seed: int, blocks: int = 8) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


class Core:
    """The pure picker with one profile over a fleet, as the decision service drives it."""

    def __init__(self, config: Config, n: int, mode: str) -> None:
        self.clock = FakeClock()
        self.fleet = FleetState(self.clock)
        self.profile = config.profile("default", random.Random(1))
        self.picker = Picker(self.fleet)
        for i in range(n):
            health = HealthTracker(f"w{i}", self.clock)
            self.fleet.add(WorkerState(f"w{i}", mode, BS, capacity_blocks=100, health=health))

    def route(self, tokens: Sequence[int], ns: Namespace) -> Decision:
        req = RouteRequest(model="", namespace=ns, prompt_tokens=len(tokens))
        return self.picker.pick(self.profile, req, tokens)

    def commit(self, d: Decision, worker: str) -> Ticket:
        return self.picker.commit(self.profile, d, worker)

    def __getattr__(self, name: str) -> Any:  # index, load, workers, predictions, approx
        return getattr(self.fleet, name)


def core(
    policy: str = "kv", n: int = 2, mode: str = EVENTS, temperature: float = 0.0, **scoring: Any
) -> Core:
    config = Config(
        policy=policy,
        policy_params={"temperature": temperature} if temperature else {},
        scoring=ScoringConfig(**scoring),
    )
    return Core(config, n, mode)


def store(c: Core, worker: str, tokens: list[int]) -> None:
    n = len(tokens) // BS
    ehs = [EngineBlockHash(hash((worker, tuple(tokens[: (i + 1) * BS])))) for i in range(n)]
    batch = EventBatch(0.0, [BlockStored(ehs, None, tokens[: n * BS], BS)])
    res = c.index.apply(worker, batch)
    demand = c.workers[worker].demand
    assert demand is not None
    demand.add(res.stored)  # as the worker's ingest does


def test_sticks_to_the_worker_holding_the_prefix() -> None:
    c = core()
    store(c, "w1", prompt(1))
    d = c.route([*prompt(1), 5, 6], NS)
    assert d.best.worker == "w1" and d.best.overlap_blocks == 8
    assert d.score_of("w0").overlap_blocks == 0


def test_new_prefix_goes_where_the_cache_has_room() -> None:
    c = core()
    for s in range(5):
        store(c, "w0", prompt(10 + s))
    d = c.route(prompt(99), NS)
    assert d.best.worker == "w1"
    assert d.best.raw["headroom"] > d.score_of("w0").raw["headroom"]


FULL = {"placement": {"room": 0}}  # as if every cache were short of room
# ...and no new prefix counted: demand alone ranks the workers
DEMAND = {"placement": {"room": 0, "homes": False}}


def test_new_prefixes_are_homed_by_recent_demand_not_by_the_load_of_the_moment() -> None:
    """Caches short of room: w0's cache stored three prefixes lately, w1's one, and w1 is
    running a request: a new prefix goes to w1, the cache with less demand, though w1 is
    the busier now; a repeat still follows its prefix."""
    c = core(params=DEMAND)
    for s in range(3):
        store(c, "w0", prompt(20 + s))
    store(c, "w1", prompt(30))
    c.commit(c.route(prompt(31), NS), "w1")  # in flight, not cached
    d = c.route(prompt(99), NS)
    assert d.best.worker == "w1", d.best
    assert d.best.raw["placement"] == 1.0 and d.score_of("w0").raw["placement"] == 0.0
    assert d.score_of("w0").raw["load"] > d.best.raw["load"]
    again = c.route(prompt(21), NS)
    assert again.best.worker == "w0" and again.best.raw["placement"] == 1.0


def test_replicas_agree_on_where_a_new_prefix_goes() -> None:
    """Two routers see the same events but each only its own load: a new prompt is placed on
    the same worker by both (no prefix prefilled twice), and new prompts still spread. (Each
    router's own placements of the last few seconds count on its side until their events
    arrive: that keeps one router from piling a burst of new prefixes on one worker.)"""
    a, b = core(n=4), core(n=4)
    for c in (a, b):
        for s in range(3):
            store(c, "w0", prompt(50 + s))
    for _ in range(3):
        b.commit(b.route(prompt(50), NS), "w0")  # b's own in-flight requests only
    assert a.load.view("w0").requests == 0 and b.load.view("w0").requests == 3
    places = [a.route(prompt(100 + i), NS).best.worker for i in range(40)]
    assert places == [b.route(prompt(100 + i), NS).best.worker for i in range(40)]
    assert "w0" not in places and {"w1", "w2", "w3"} <= set(places)


def test_a_burst_of_new_prompts_spreads_though_one_cache_is_less_demanded() -> None:
    """Caches short of room: w1's cache is far less demanded, but new prompts sent at once
    must not all queue on it: once it runs `slack` (2) more requests than w0, w0 takes the
    next one (by demand alone; counting the new prefixes each was sent, they alternate)."""
    placements = []
    for params in (DEMAND, FULL):
        c = core(params=params)
        for s in range(4):
            store(c, "w0", prompt(20 + s))
        placed = []
        for i in range(6):
            d = c.route(prompt(100 + i), NS)
            placed.append(d.best.worker)
            c.commit(d, d.best.worker)  # in flight, never finished
        placements.append(placed[:4])
    assert placements == [["w1", "w1", "w1", "w0"], ["w1", "w0", "w1", "w0"]]


def _hot_and_cold(c: Core) -> Core:
    """w0 holds a hot prefix and runs four repeats of it (cheap: their prefix is cached);
    w1 holds three prefixes and runs two cold prompts."""
    store(c, "w0", prompt(1))
    for s in range(3):
        store(c, "w1", prompt(40 + s))
    for _ in range(4):
        c.commit(c.route([*prompt(1), 7, 7, 7, 7], NS), "w0")  # the hot prefix + a tail
    for s in (20, 21):
        c.commit(c.route(prompt(s), NS), "w1")
    return c


def test_while_caches_have_room_a_new_prefix_avoids_the_worker_a_hot_prefix_keeps_busy() -> None:
    """w0 has the less prefill queued, the less demanded cache, and is within `slack` of w1's
    requests: with caches short of room it takes the new prefix. With room (the default:
    caches far from full), the new prefix goes to w1: its prefill would stall the four
    requests on w0 and the stream of repeats arriving there."""
    c = _hot_and_cold(core())
    assert c.load.view("w0").prefill_tokens < c.load.view("w1").prefill_tokens
    d = c.route(prompt(99), NS)
    assert d.best.worker == "w1" and d.best.raw["placement"] == 1.0, d.best
    assert _hot_and_cold(core(params=FULL)).route(prompt(99), NS).best.worker == "w0"


def test_a_new_prefix_avoids_the_worker_whose_sessions_are_between_turns() -> None:
    """w0 serves two chat sessions turn after turn; at the moment a new conversation arrives
    both turns have just finished, so w0 and w1 both run nothing. By the count of the
    moment they tie and the less demanded cache (w0's) would win; over the last second w0
    was ~2 busy, and its sessions' next turns are milliseconds away: w1 takes it."""
    c = core()
    store(c, "w0", prompt(1))
    store(c, "w0", prompt(2))
    for s in range(5):
        store(c, "w1", prompt(40 + s))  # w1: the more demanded cache (still roomy), idle
    assert c.route(prompt(99), NS).best.worker == "w0"  # nobody busy yet: the demand tie-break
    for turn in range(20):
        tickets = [c.commit(c.route([*prompt(p), turn], NS), "w0") for p in (1, 2)]
        c.clock.advance(0.1)
        for t in tickets:
            c.load.finish(t)
        c.clock.advance(0.002)
    assert c.load.view("w0").requests == 0 and c.load.view("w1").requests == 0
    assert c.load.view("w0").busy > 1.5
    d = c.route(prompt(99), NS)
    assert d.best.worker == "w1" and d.best.raw["placement"] == 1.0, d.best
    c.clock.advance(10)  # the sessions ended long ago: w0 is idle again
    assert c.load.view("w0").busy < 0.01
    assert c.route(prompt(98), NS).best.worker == "w0"


def test_a_short_prompt_does_not_queue_behind_a_long_cold_prefill_for_its_template() -> None:
    """w0 holds a 32-token template and is prefilling a 2,400-token cold prompt. A prompt on
    the template would wait 2,402 prefill tokens there and 34 on w1: past 2 x 34 + 2,048, so
    w0 is not eligible and w1 recomputes the template. With the filter off (over 0), the
    prefix credit keeps it on w0."""
    for over, expected in ((2.0, "w1"), (0.0, "w0")):
        c = core(prefill_wait_over=over)
        store(c, "w0", prompt(5))
        c.commit(c.route(prompt(7, blocks=600), NS), "w0")
        assert c.load.view("w0").prefill_tokens == 2400
        d = c.route([*prompt(5), 1, 2], NS)
        assert d.best.worker == expected, d
        if over:
            assert "prefill wait: 2402 tokens" in str(d.score_of("w0").excluded)


def test_siblings_of_a_prefix_still_prefilling_stay_with_it() -> None:
    """The second request on a 2,400-token prefix that w0 is still prefilling: waiting there
    costs about what recomputing the prefix on w1 would, so w0 stays eligible and wins."""
    c = core()
    c.commit(c.route(prompt(8, blocks=600), NS), "w0")
    d = c.route([*prompt(8, blocks=600), 9], NS)
    assert d.best.worker == "w0" and not d.excluded, d


def _first_wave(c: Core) -> tuple[Core, Ticket]:
    """The first moment of a cold fleet: w0 prefills a new prefix and has a sibling of it
    waiting (its overlap is only predicted); w1 prefills two other new prefixes."""
    c.commit(c.route(prompt(1), NS), "w0")
    sibling = c.commit(c.route([*prompt(1), 7, 7, 7, 7], NS), "w0")
    for s in (20, 21):
        c.commit(c.route(prompt(s), NS), "w1")
    return c, sibling


def test_a_new_prefix_avoids_the_worker_whose_requests_wait_on_a_prefill_in_progress() -> None:
    """Both workers run two requests; w0 has the less prefill queued, since its sibling
    computes only its tail. But the sibling waits for its prefix's prefill and runs in w0's
    next step, which a new prefix's prefill would join and lengthen (on hot-prefix, 10-11
    siblings answered ~90 ms late when that happened): it counts twice, and w1 takes the
    new prefix. Once the sibling has its first token it no longer rides."""
    c, sibling = _first_wave(core())
    assert sibling.rides and c.load.view("w0").riders == 1 and c.load.view("w1").riders == 0
    assert c.load.view("w0").prefill_tokens < c.load.view("w1").prefill_tokens
    d = c.route(prompt(99), NS)
    assert d.best.worker == "w1" and d.best.raw["placement"] == 1.0, d.best
    assert d.score_of("w0").riders == 1 and "prefill tok (1 riding)" in d.explain()
    c.load.first_token(sibling)
    assert c.load.view("w0").riders == 0
    assert c.route(prompt(99), NS).best.worker == "w0"  # w0's next step holds nobody now


def test_a_request_on_a_prefix_the_events_show_stored_does_not_ride() -> None:
    c = core()
    store(c, "w0", prompt(1))
    t = c.commit(c.route([*prompt(1), 7, 7, 7, 7], NS), "w0")
    assert not t.rides and c.load.view("w0").riders == 0
    gone = c.commit(c.route([*prompt(2), 7], NS), "w1")  # nothing cached: nothing to ride
    assert not gone.rides
    rider = c.commit(c.route([*prompt(2), 8], NS), "w1")
    assert rider.rides and c.load.view("w1").riders == 1
    c.load.finish(rider)  # ended before its first token (a client hung up)
    assert c.load.view("w1").riders == 0


def test_replicas_place_new_prefixes_by_demand_alone() -> None:
    """Replicas see each other's in-flight load only milliseconds late, so with peers the
    cost-while-roomy choice is off unless configured: the hot worker takes the prefix."""
    config = Config(peers=("tcp://kvroute-1:5570",), scoring=ScoringConfig())
    replica = _hot_and_cold(Core(config, 2, EVENTS))
    assert replica.route(prompt(99), NS).best.worker == "w0"
    roomy = {"placement": {"room": 0.5}}
    config = Config(peers=("tcp://kvroute-1:5570",), scoring=ScoringConfig(params=roomy))
    assert _hot_and_cold(Core(config, 2, EVENTS)).route(prompt(99), NS).best.worker == "w1"


def test_new_prefixes_are_homed_by_their_first_prompts_before_demand() -> None:
    """A new prefix goes to the worker sent the fewest new-prefix blocks lately (each
    counted at its first prompt), before demand: w0 homes one conversation grown long, w1
    two just started (less demand between them), so demand alone sends the next one to w1
    and the first prompts send it to w0. A later turn does not count. One replica ranks so
    as replicas do; `homes: false` leaves demand alone."""
    cases = (
        (Config(peers=("tcp://kvroute-1:5570",), scoring=ScoringConfig()), "w0"),
        (Config(scoring=ScoringConfig(params=FULL)), "w0"),
        (Config(scoring=ScoringConfig(params=DEMAND)), "w1"),
    )
    for config, expect in cases:
        c = Core(config, 2, EVENTS)
        c.commit(c.route(prompt(1, blocks=8), NS), "w0")
        grown = prompt(1, blocks=24)
        store(c, "w0", grown)
        c.commit(c.route(grown, NS), "w0")  # a later turn: not a new prefix
        for s in (2, 3):
            first = prompt(s)
            c.commit(c.route(first, NS), "w1")
            store(c, "w1", first)
        homed = [c.workers[w].new_blocks for w in ("w0", "w1")]
        assert [h.value() for h in homed if h is not None] == [8.0, 16.0]
        d = c.route(prompt(99), NS)
        assert d.best.worker == expect, (config, d.explain())


def test_the_average_load_counts_the_peers_requests() -> None:
    """A worker's last-second average counts what the peer replicas run there, not only
    this replica's requests: replicas weigh a worker alike by it."""
    c = core()
    c.load.peer("r1", "w0", PeerLoad(6, 0, 0))
    c.clock.advance(2.0)
    c.load.peer("r1", "w0", PeerLoad(0, 0, 0))  # the peer's wave on w0 ended
    view = c.load.view("w0")
    assert view.requests == 0 and view.busy > 5.0
    c.clock.advance(10)
    assert c.load.view("w0").busy < 0.01


def test_a_replica_does_not_home_a_new_prefix_where_a_wave_just_ended() -> None:
    """Replicas home new prefixes by the first prompts each worker was sent. w0 homes one
    hot prefix and ran 16 of its repeats until a moment ago (half of them a peer's), 3
    still running; w1 homes three prefixes and runs 3 requests. By the moment's count w0 is
    within `slack` of the least loaded and, homing the fewest prefixes, would take the new
    one; over the last second it ran ~14, so w1 does."""
    config = Config(peers=("tcp://kvroute-1:5570",), scoring=ScoringConfig())
    c = Core(config, 2, EVENTS)
    hot = [c.commit(c.route([*prompt(1), i], NS), "w0") for i in range(8)]
    c.load.peer("r1", "w0", PeerLoad(8, 0, 0))
    for s in (2, 3, 4):
        c.commit(c.route(prompt(s), NS), "w1")  # three new prefixes, running
    c.clock.advance(1.0)
    for t in hot[3:]:
        c.load.finish(t)
    c.load.peer("r1", "w0", PeerLoad(0, 0, 0))
    view = c.load.view("w0")
    assert view.requests == 3 and view.busy > 8.0, view
    d = c.route(prompt(99), NS)
    assert d.best.worker == "w1", d.explain()


SYSTEM = prompt(1)  # 8 blocks every session opens with


def session(n: int, tail_blocks: int = 6) -> list[int]:
    return [*SYSTEM, *(7000 + 100 * n + i for i in range(tail_blocks * BS))]


def _churning_w0(**scoring: Any) -> Core:
    """w0 served the first session (the system prompt is cached there) and stored more
    lately than its 100 blocks hold; w1 is empty."""
    c = core(**scoring)
    store(c, "w0", session(0))
    for s in range(13):
        store(c, "w0", prompt(40 + s))
    return c


def test_a_new_session_moves_off_a_churning_cache_that_holds_only_its_system_prompt() -> None:
    """Staying would prefill 6 blocks on a cache that must evict as much that others will
    ask for again (6 x (1 + 2)); moving prefills 14 blocks where they fit (14 x 1)."""
    c = _churning_w0()
    d = c.route(session(1), NS)
    assert d.best.worker == "w1", d.best
    assert d.best.raw["placement"] == 1.0 and d.score_of("w0").overlap_blocks == 8
    assert d.score_of("w0").raw["placement"] < 0.3


@pytest.mark.parametrize("losing", [False, True], ids=["keeps-what-it-needs", "refetches"])
def test_a_session_moves_to_a_cache_that_stores_much_but_loses_nothing_it_needs(
    losing: bool,
) -> None:
    """w1 stored more lately than it holds (one-off query tails, say), so by demand it
    churns as much as w0; but only what a cache evicts and then stores again shows it
    losing what it needs. Without that the session moves there; with it, it stays."""
    c = _churning_w0()
    for s in range(30):
        store(c, "w1", prompt(200 + s))
    refetched = c.workers["w1"].refetched
    assert refetched is not None
    if losing:
        refetched.add(20)
    d = c.route(session(1), NS)
    assert d.best.worker == ("w0" if losing else "w1"), d.best


def test_a_session_that_moved_does_not_bounce_back_to_the_cache_it_left() -> None:
    """A session moved off churning w0; its next turn finds w1 churning by demand as well.
    w0 loses nothing by the refetch count either, but it holds part of the prompt, and a
    cache holding part of a prompt is judged as its holder is: by demand, which is why the
    session left it. Judged by refetches alone it went back, prefilling its own context
    again, and on to w1 the turn after (agent-sessions, 5 seeds: sessions moved up to five
    times, cached 0.759 against 0.798 without the bounce)."""
    c = _churning_w0()
    first = c.route(session(1), NS)
    assert first.best.worker == "w1", first.best
    store(c, "w1", session(1))
    for s in range(14):
        store(c, "w1", prompt(300 + s))  # w1's demand is past its size now too
    d = c.route(session(1, 12), NS)
    assert d.score_of("w1").overlap_blocks == 14 and d.score_of("w0").overlap_blocks == 8
    assert d.best.worker == "w1", d.explain()


def test_at_equal_cost_the_worker_holding_most_keeps_the_prompt() -> None:
    """w1 holds the system prompt too and loses blocks as w0's demand says it would: moving
    costs what staying does, so no session moves, whatever its rendezvous hash prefers."""
    c = _churning_w0()
    store(c, "w1", session(0))
    refetched = c.workers["w1"].refetched
    assert refetched is not None
    refetched.add(20)
    for n in range(1, 13):
        d = c.route(session(n), NS)
        assert {s.raw["placement"] for s in d.ranked} == {1.0}, n


@pytest.mark.parametrize(
    ("churning", "tail_blocks", "params", "stays"),
    [
        (False, 6, {}, "w0"),  # w0's cache keeps it: the prefix credit decides
        (True, 1, {}, "w0"),  # a short tail: 1 x 3 against 9 x 1
        (True, 6, {"placement": {"churn": 0}}, "w0"),  # turned off
    ],
    ids=["cache-keeps-it", "short-tail", "churn-off"],
)
def test_a_prompt_stays_with_its_prefix_unless_moving_costs_less(
    churning: bool, tail_blocks: int, params: dict[str, Any], stays: str
) -> None:
    if churning:
        c = _churning_w0(params=params)
    else:
        c = core(params=params)
        store(c, "w0", session(0))
    d = c.route(session(1, tail_blocks), NS)
    assert d.best.worker == stays, d.best
    assert d.best.raw["placement"] == 1.0 and d.score_of("w1").raw["placement"] == 1.0


def test_placement_can_be_turned_off() -> None:
    c = core(weights={"prefix": 1.0, "load": 0.5, "headroom": 0.1})
    for s in range(3):
        store(c, "w0", prompt(20 + s))
    store(c, "w1", prompt(30))
    c.commit(c.route(prompt(31), NS), "w1")
    assert c.route(prompt(99), NS).best.worker == "w0"  # the least loaded of the moment


def test_prediction_covers_siblings_before_events_arrive() -> None:
    c = core()
    first = c.route(prompt(3), NS)
    c.commit(first, "w1")
    again = c.route(prompt(3), NS)
    assert again.best.worker == "w1" and again.best.overlap_blocks == 8


def test_prediction_expires() -> None:
    c = core()
    c.commit(c.route(prompt(3), NS), "w1")
    c.predictions._clock.advance(6)  # type: ignore[attr-defined]
    assert c.route(prompt(3), NS).score_of("w1").overlap_blocks == 0


def test_approx_mode_records_routing_decisions_for_the_ttl() -> None:
    c = core(mode=APPROX)
    c.commit(c.route(prompt(4), NS), "w0")
    assert c.route(prompt(4), NS).best.worker == "w0"
    c.approx._clock.advance(121)  # type: ignore[attr-defined]
    assert c.route(prompt(4), NS).score_of("w0").overlap_blocks == 0


def service(c: Core) -> DecisionService:
    """The decision service over the core's fleet (its doors' side: start, reassign)."""
    no_io: Any = None  # neither the worker pool nor the tokenizers are asked here
    profiles = {"default": c.profile}
    return DecisionService(Config(), c.fleet, no_io, no_io, RouterMetrics(), profiles, c.clock)


@pytest.mark.parametrize(
    ("before", "sibling", "w0_after"),
    [
        pytest.param(0, False, 0, id="new-prefix"),
        pytest.param(5, False, 5, id="w0-keeps-what-an-earlier-request-left"),
        pytest.param(0, True, 8, id="w0-keeps-a-sibling-that-was-served-there"),
    ],
)
def test_approx_mode_follows_a_reassigned_request(
    before: int, sibling: bool, w0_after: int
) -> None:
    """A gateway's fallback served the request on w1, not on w0 that was picked: the
    approximate index must say w1 holds its prompt, and w0 only what others left there."""
    c = core(mode=APPROX)
    svc = service(c)
    tokens = prompt(5)
    if before:
        svc.start(c.route(tokens[: before * BS], NS), "w0")
        c.clock.advance(10)
    ticket = svc.start(c.route(tokens, NS), "w0")
    if sibling:  # the same prompt sent to w0 a moment later, and served there
        svc.start(c.route(tokens, NS), "w0")
    assert c.route(tokens, NS).score_of("w0").overlap_blocks == 8
    svc.reassign(ticket, "w1")
    after = c.route(tokens, NS)
    assert after.score_of("w1").overlap_blocks == 8
    assert after.score_of("w0").overlap_blocks == w0_after
    assert c.approx.entries_of("w0") == w0_after


def test_a_reassign_tells_the_other_replicas_what_to_take_back() -> None:
    c = core(mode=APPROX)
    svc = service(c)
    told: list[tuple[str, list[int]]] = []
    svc.on_withdrawn.append(lambda worker, hashes: told.append((worker, list(hashes))))
    d = c.route(prompt(5), NS)
    ticket = svc.start(d, "w0")
    svc.reassign(ticket, "w0")  # served where it was started: nothing to take back
    assert told == []
    svc.reassign(ticket, "w1")
    assert told == [("w0", list(d.hashes[BS]))]


@pytest.mark.parametrize("mode", [EVENTS, APPROX])
@pytest.mark.parametrize("how", ["refused", "released"])
def test_a_request_its_worker_stores_nothing_for_is_taken_back(mode: str, how: str) -> None:
    """The engine refused it (a 4xx), or a handoff sent it another way after its decode
    worker was counted: what the pick made this router and its peers believe goes."""
    c = core(mode=mode)
    svc = service(c)
    told: list[str] = []
    svc.on_withdrawn.append(lambda worker, hashes: told.append(worker))
    tokens = prompt(5)
    ticket = svc.start(c.route(tokens, NS), "w0")
    assert c.route(tokens, NS).score_of("w0").overlap_blocks == 8
    if how == "refused":
        svc.finish(ticket, status=404)
    else:
        svc.release(ticket)
    assert c.route(tokens, NS).score_of("w0").overlap_blocks == 0
    assert told == ["w0"]


def test_load_bound_spills_a_hot_prefix() -> None:
    c = core(balance_abs=2, balance_rel=1.0)
    store(c, "w0", prompt(7))
    placed = []
    for _ in range(6):
        d = c.route(prompt(7), NS)
        placed.append(d.best.worker)
        c.commit(d, d.best.worker)  # in flight, never finished
    assert placed[:3] == ["w0", "w0", "w0"]
    assert "w1" in placed
    counts = {w: placed.count(w) for w in ("w0", "w1")}
    assert counts["w0"] - counts["w1"] <= 3  # bound 2, plus the one that crossed it


def test_commit_counts_load_and_finish_releases_it() -> None:
    c = core()
    d = c.route(prompt(8), NS)
    t = c.commit(d, "w0")
    assert c.load.view("w0").requests == 1 and c.load.view("w0").prefill_tokens == 32
    c.load.first_token(t)
    assert c.load.view("w0").prefill_tokens == 0 and c.load.view("w0").decode_blocks == 8
    c.load.finish(t)
    assert c.load.view("w0").requests == 0 and c.load.view("w0").decode_blocks == 0


def test_round_robin_alternates() -> None:
    c = core("round_robin")
    order = []
    for _ in range(4):
        d = c.route(prompt(1), NS)
        order.append(d.best.worker)
        c.commit(d, d.best.worker)
    assert order == ["w0", "w1", "w0", "w1"]


def test_least_load_picks_fewest_in_flight() -> None:
    c = core("least_load")
    c.commit(c.route(prompt(1), NS), "w0")
    assert c.route(prompt(1), NS).best.worker == "w1"


def test_random_is_seeded() -> None:
    picks = []
    for _ in range(2):
        c = core("random", n=4)
        picks.append([c.route(prompt(i), NS).best.worker for i in range(10)])
    assert picks[0] == picks[1] and len(set(picks[0])) > 1


def test_softmax_temperature_sometimes_explores() -> None:
    c = core(temperature=0.5)
    store(c, "w1", prompt(1, blocks=2))
    winners = {c.route(prompt(1), NS).best.worker for _ in range(200)}
    assert winners == {"w0", "w1"}


def test_no_worker_error_names_the_ejected_ones() -> None:
    c = core()
    for w in c.workers.values():
        w.available = False
    with pytest.raises(NoWorkerAvailable) as err:
        c.route(prompt(1), NS)
    assert "2 failing health checks" in err.value.message  # what the client sees
    assert "w0" in (err.value.detail or "") and "w1" in (err.value.detail or "")  # the log


def test_explain_fills_in_the_formula() -> None:
    c = core()
    store(c, "w0", prompt(2))
    text = c.route(prompt(2), NS).explain()
    assert "w0: total" in text and "prefix" in text and "overlap 8 blocks" in text


def test_health_learns_of_requests_expecting_new_blocks() -> None:
    c = core()
    c.commit(c.route(prompt(5), NS), "w0")
    c.workers["w0"].health._clock.advance(11)  # type: ignore[union-attr,attr-defined]
    assert c.workers["w0"].health.report().state.value == "NO_EVENTS"  # type: ignore[union-attr]


def test_scraped_load_counts_only_other_routers_traffic() -> None:
    c = core()
    t = c.commit(c.route(prompt(1), NS), "w0")
    c.load.scraped("w0", running=3, waiting=1, kv_usage=0.5, capacity_blocks=100)
    view = c.load.view("w0")
    assert view.requests == 4  # ours (1) + three from elsewhere
    assert view.decode_blocks == pytest.approx(50 * 3 / 4)
    c.load.finish(t)
    assert c.load.view("w0").requests == 3  # our finished request is not counted twice
    c.load.scraped("w1", running=0, waiting=0, kv_usage=0.0, capacity_blocks=100)
    assert c.load.view("w1").requests == 0


class _Wild:
    """A plugin scorer whose outputs leave 0..1."""

    name = "wild"

    def __init__(self, out: dict[str, float]) -> None:
        self.out = out

    def score(self, request: Any, cands: Sequence[Any]) -> dict[str, float]:
        return self.out


@pytest.mark.parametrize(
    ("given", "kept"),
    [(float("nan"), 0.0), (-0.5, 0.0), (7.0, 1.0), (0.25, 0.25), (1.0, 1.0), (0.0, 0.0)],
    ids=["nan", "negative", "above-one", "inside", "one", "zero"],
)
def test_a_plugins_scores_are_clamped_to_0_1(given: float, kept: float) -> None:
    c = core(n=2)
    c.profile.scorers.append((_Wild({"w0": given}), 1.0))  # type: ignore[arg-type]
    d = c.route(prompt(1), NS)
    assert d.score_of("w0").raw["wild"] == kept
    assert d.score_of("w1").raw["wild"] == 0.0  # a worker the scorer left out scores 0


def _pick(fleet: FleetState, tokens: list[int]) -> Decision:
    prof = Config(seed=0).profile("default", random.Random(0))
    return Picker(fleet).pick(prof, RouteRequest("", Namespace(), len(tokens)), tokens)


def test_a_worker_without_prefix_caching_is_credited_nothing() -> None:
    """It keeps nothing of a prompt, so what was sent there must not draw its repeats."""
    fleet = FleetState(FakeClock())
    fleet.add(WorkerState("nocache:1", APPROX, 16, capacity_blocks=10_000, caching=False))
    fleet.add(WorkerState("w:1", EVENTS, 16, capacity_blocks=10_000))
    prof = Config(seed=0).profile("default", random.Random(0))
    picker = Picker(fleet)
    tokens = list(range(64 * 16))
    d = _pick(fleet, tokens)
    picker.commit(prof, d, "nocache:1")
    assert _pick(fleet, tokens).score_of("nocache:1").overlap_blocks == 0


def test_replicas_agree_whatever_order_they_learned_the_workers_in() -> None:
    """Replicas learn workers in different orders (config, DNS, the admin API); the same
    state must give the same pick."""
    sizes = [("a:1", 16), ("b:1", 16), ("c:1", 16), ("d:1", 32), ("e:1", 32), ("f:1", 32)]
    tokens = list(range(1000, 1512))
    picks = set()
    for seed in range(12):  # a new prefix over workers of two block sizes
        order = sizes[:]
        random.Random(seed).shuffle(order)
        fleet = FleetState(FakeClock())
        for name, bs in order:
            fleet.add(WorkerState(name, EVENTS, bs))
        picks.add(_pick(fleet, tokens).best.worker)
    assert len(picks) == 1
    # two workers hold the same shared system prompt and one's cache churns: the prompt
    # moves off it, whichever of them was added first
    system = list(range(5000, 5000 + 8 * 16))
    prompt = system + list(range(9000, 9000 + 24 * 16))
    best = set()
    for names in (["a:1", "b:1"], ["b:1", "a:1"]):
        fleet = FleetState(FakeClock())
        for n in names:
            fleet.add(WorkerState(n, EVENTS, 16, capacity_blocks=100))
        for n in names:
            fleet.predictions.record(n, hash_request(system, 16, Namespace()))
        demand = fleet.workers["a:1"].demand
        assert demand is not None
        demand.add(90)
        fleet.load.start("b:1", 64, 4)
        best.add(_pick(fleet, prompt).best.worker)
    assert len(best) == 1
