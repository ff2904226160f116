from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from indexer import ttl as ttl_module
from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from indexer.index import Overlap
from indexer.ttl import TtlIndex

H = hash_request(list(range(32)), 8, Namespace())  # four blocks


def test_entries_expire_after_ttl() -> None:
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=120)
    ttl.record("a", H[:3])
    assert ttl.find_matches(H) == {"a": Overlap(3, {"GPU": 3})}
    clock.advance(119.9)
    assert "a" in ttl.find_matches(H)
    clock.advance(0.2)
    assert ttl.find_matches(H) == {}
    assert len(ttl) == 0


def test_refresh_extends_expiry_in_time_order() -> None:
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=5)
    ttl.record("a", H)
    clock.advance(3)
    ttl.record("b", H[:2])
    ttl.record("a", H[:1])  # the first block refreshed, the rest keep their old expiry
    clock.advance(2.5)
    assert ttl.find_matches(H) == {"a": Overlap(1, {"GPU": 1}), "b": Overlap(2, {"GPU": 2})}
    clock.advance(3)
    assert ttl.find_matches(H) == {}


def test_forget_worker() -> None:
    ttl = TtlIndex(FakeClock(), ttl_s=5)
    ttl.record("a", H)
    ttl.record("b", H)
    ttl.forget_worker("a")
    assert set(ttl.find_matches(H)) == {"b"}


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError):
        TtlIndex(FakeClock(), ttl_s=0)


def test_a_burst_of_the_same_chain_costs_one_record() -> None:
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=100)
    ttl.record("a", H)
    clock.advance(0.5)  # within 1% of the TTL: not refreshed
    ttl.record("a", H)
    clock.advance(99.6)
    assert ttl.find_matches(H) == {}
    ttl.record("a", H)
    clock.advance(2)  # beyond 1%: refreshed
    ttl.record("a", H)
    clock.advance(99)
    assert "a" in ttl.find_matches(H)


def test_at_the_bound_the_oldest_records_expire_early() -> None:
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=100, max_entries=6)
    first = hash_request(list(range(100, 132)), 8, Namespace())
    ttl.record("a", first)  # 4 entries
    clock.advance(1)
    ttl.record("a", H)  # 8 entries > 6: the first record goes before its time
    assert len(ttl) == 4 and ttl.entries_of("a") == 4
    assert ttl.find_matches(first) == {} and ttl.find_matches(H) == {"a": Overlap(4, {"GPU": 4})}
    clock.advance(100)
    assert ttl.find_matches(H) == {} and len(ttl) == 0


# ---- against a plain model ---------------------------------------------------------------

CHAINS = [hash_request(list(range(s, s + 32)), 8, Namespace()) for s in (0, 500, 900)]
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from("ab"), st.integers(0, 2), st.integers(1, 4)),
        st.tuples(st.just("advance"), st.sampled_from([0.01, 0.5, 2.0, 4.9, 5.0, 7.0])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(STEPS, st.integers(4, 40), st.integers(2, 12))
# a chain recorded, extended and recorded again in one clock tick, at the cap
@example([("record", "b", 1, 2), ("record", "b", 1, 3), ("record", "b", 1, 1)], 4, 2)
def test_matches_a_dict_of_expiries(steps: list[tuple[Any, ...]], bound: int, cap: int) -> None:
    """Per (worker, block) the newest record's expiry; a record whose last block already
    lives within 1% of the TTL is skipped; a worker's oldest records dropped past its cap or
    the bound. find_matches says the longest leading run of live blocks per worker (the
    model scans where the index bisects)."""
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=5, max_entries=bound)
    ttl.set_worker_cap("b", cap)
    caps = {"a": 1 << 16, "b": cap}
    live: dict[tuple[str, int], float] = {}
    # each record owns the blocks no later record refreshed
    records: dict[str, list[tuple[float, set[int]]]] = {"a": [], "b": []}
    for step in steps:
        if step[0] == "advance":
            clock.advance(step[1])
        else:
            _, worker, chain, n = step
            hashes = CHAINS[chain][:n]
            ttl.record(worker, hashes)
            until = clock.now() + 5
            if live.get((worker, hashes[-1]), -1.0) < until - 5 * 0.01:
                live.update({(worker, h): until for h in hashes})
                mine = records[worker]
                for _, owned in mine:
                    owned.difference_update(hashes)
                mine.append((until, set(hashes)))
                while len(mine) > 1 and (
                    sum(k[0] == worker for k in live) > caps[worker] or len(live) > bound
                ):
                    _, owned = mine.pop(0)
                    for h in owned:
                        live.pop((worker, h), None)
        now = clock.now()
        for key in [k for k, v in live.items() if v <= now]:
            del live[key]
        for mine in records.values():
            while mine and mine[0][0] <= now:
                mine.pop(0)
        for chain in CHAINS:
            want = {}
            for worker in "ab":
                run = 0
                while run < len(chain) and (worker, chain[run]) in live:
                    run += 1
                if run:
                    want[worker] = Overlap(run, {"GPU": run})
            assert ttl.find_matches(chain) == want
        assert len(ttl) == len(live)
        assert ttl.entries_of("a") == sum(k[0] == "a" for k in live)
        # every live entry is still held by a record (or it would never expire)
        assert ttl.held_hashes() >= len(ttl)


def test_records_sharing_a_prefix_hold_it_once() -> None:
    """Thousands of requests on one long prefix with distinct tails: the records hold about
    the entries, not a copy of the prefix each (approximate mode grew ~18 MB a second at
    ~2,700 requests a second before)."""
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=120)
    prefix = list(range(2048))
    for i in range(2000):
        tail = [10_000 + i] * 32
        ttl.record("a", hash_request(prefix + tail, 16, Namespace()))
        clock.advance(0.001)
    assert len(ttl) == 128 + 2 * 2000  # the prefix once, two tail blocks a request
    assert ttl.held_hashes() == len(ttl)
    clock.advance(120)
    ttl.expire()
    assert len(ttl) == 0 and ttl.held_hashes() == 0


def test_a_prefix_in_use_outlives_older_records_at_the_cap() -> None:
    """A new tail on a prefix recorded a moment ago refreshes the prefix too, so at the cap
    the prefix is not what goes (the long document a worker is serving stays believed)."""
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=100)
    ttl.set_worker_cap("a", 6)
    other = hash_request(list(range(24)) + [999] * 8, 8, Namespace())  # H's first 3, new 4th
    ttl.record("a", H)
    clock.advance(0.1)  # within 1% of the TTL
    ttl.record("a", other)  # H[:3] fresh, the 4th new: the whole chain again
    ttl.record("a", hash_request(list(range(500, 516)), 8, Namespace()))  # 7 > 6: H's goes
    assert ttl.find_matches(other) == {"a": Overlap(4, {"GPU": 4})}
    assert ttl.find_matches(H) == {"a": Overlap(3, {"GPU": 3})} and len(ttl) == 6


def test_a_workers_capacity_bounds_what_is_believed_of_it() -> None:
    """The fleet's capacity (from the engine's num_gpu_blocks) caps the approximate and
    predicted entries too, oldest records first, and survives the worker's cache reset."""
    from router.core.fleet import APPROX, FleetState, WorkerState

    clock = FakeClock()
    fleet = FleetState(clock)
    fleet.add(WorkerState("w", APPROX, 8))
    fleet.set_capacity("w", 6)
    older = hash_request(list(range(100, 132)), 8, Namespace())
    for ttl in (fleet.approx, fleet.predictions):
        ttl.record("w", older)
        clock.advance(0.5)
        ttl.record("w", H)  # 8 entries > 6: the older chain goes
        assert ttl.entries_of("w") == 4 and ttl.find_matches(older) == {}
    fleet.forget_cache("w")
    fleet.approx.record("w", older)
    fleet.approx.record("w", H)
    assert fleet.approx.entries_of("w") == 4


@pytest.mark.parametrize("bisected", [8, 1], ids=["bisected", "past-the-runs-bisected"])
def test_a_chain_over_several_records_takes_its_blocks_from_each(
    bisected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain whose blocks two records hold (its prefix refreshed later than the rest):
    each of them is cut down to what it still owns, so the records hold every entry once."""
    monkeypatch.setattr(ttl_module, "RUNS_BISECTED", bisected)
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=100)
    long = hash_request(list(range(48)), 8, Namespace())  # six blocks
    ttl.record("a", long[:4])
    clock.advance(2)
    ttl.record("a", long[:2])  # the first two now live longer than the next two
    clock.advance(2)
    ttl.record("a", long)  # two runs held (two records), then two blocks new
    assert len(ttl) == 6 and ttl.held_hashes() == 6
    assert ttl.find_matches(long) == {"a": Overlap(6, {"GPU": 6})}


# ---- taking a record back (the request was served elsewhere) -----------------------------

LONG = hash_request(list(range(48)), 8, Namespace())  # six blocks: H's four, then two more


def _prefix(n: int) -> Any:
    return ("record", LONG[:n])


@pytest.mark.parametrize(
    ("steps", "left"),
    [
        pytest.param([], 0, id="alone: all of it goes"),
        pytest.param([("before", 4)], 4, id="a prefix held before stays"),
        pytest.param([("after", 6)], 6, id="a later request extending it keeps it all"),
        pytest.param([("after", 2)], 2, id="a later request on its prefix keeps that"),
        pytest.param([("burst", 6)], 6, id="a burst re-using the record keeps it"),
        pytest.param([("burst", 6), ("withdraw", 6)], 0, id="until the burst went too"),
        pytest.param([("burst", 3)], 3, id="a shorter burst prompt keeps its own"),
        pytest.param([("other", 6)], 0, id="another worker's record is not this one's"),
    ],
)
def test_withdraw_forgets_only_what_the_request_added(
    steps: list[tuple[str, int]], left: int
) -> None:
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=100)
    for kind, n in steps:
        if kind == "before":
            ttl.record("a", LONG[:n])
            clock.advance(10)
    ttl.record("a", LONG)  # the request picked for "a", then served elsewhere
    for kind, n in steps:
        if kind in ("after", "burst", "other"):
            clock.advance(10 if kind == "after" else 0.1)  # a burst: within 1% of the TTL
            ttl.record("b" if kind == "other" else "a", LONG[:n])
    ttl.withdraw("a", LONG)
    for kind, n in steps:
        if kind == "withdraw":
            ttl.withdraw("a", LONG[:n])
    held = ttl.find_matches(LONG).get("a")
    assert (held.blocks if held else 0) == left == ttl.entries_of("a")
    assert ttl.held_hashes() == len(ttl)
    clock.advance(200)
    assert ttl.expire() >= 0 and len(ttl) == 0 and ttl.held_hashes() == 0
    assert ttl.withdraw("a", LONG) == 0  # nothing left to take back


WITHDRAW_STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["record", "withdraw"]),
            st.sampled_from("ab"),
            st.integers(0, 2),
            st.integers(1, 4),
        ),
        st.tuples(st.just("advance"), st.sampled_from([0.01, 0.5, 2.0, 4.9, 5.0, 7.0])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(WITHDRAW_STEPS, st.integers(2, 12))
def test_withdraw_keeps_the_index_whole(steps: list[tuple[Any, ...]], cap: int) -> None:
    """Records and withdrawals in any order: a chain's live blocks stay a leading run (what
    find_matches bisects), a withdrawal only ever forgets, every entry keeps a record that
    expires it, and the counts agree."""
    clock = FakeClock()
    ttl = TtlIndex(clock, ttl_s=5)
    ttl.set_worker_cap("b", cap)
    for step in steps:
        if step[0] == "advance":
            clock.advance(step[1])
            continue
        kind, worker, chain, n = step
        if kind == "record":
            ttl.record(worker, CHAINS[chain][:n])
            continue
        before = {c: ttl.find_matches(ch) for c, ch in enumerate(CHAINS)}
        gone = ttl.withdraw(worker, CHAINS[chain][:n])
        for c, ch in enumerate(CHAINS):
            now, was = ttl.find_matches(ch), before[c]
            assert set(now) <= set(was)
            assert all(now[w].blocks <= was[w].blocks for w in now)
        assert gone >= 0
    for worker in "ab":
        expiry = ttl._workers[worker].expiry if worker in ttl._workers else {}
        for ch in CHAINS:
            held = [h in expiry for h in ch]
            assert held == sorted(held, reverse=True)  # a leading run
    assert len(ttl) == ttl.entries_of("a") + ttl.entries_of("b")
    assert ttl.held_hashes() >= len(ttl)
    clock.advance(6)
    ttl.expire()
    assert len(ttl) == 0 and ttl.held_hashes() == 0
