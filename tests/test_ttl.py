from __future__ import annotations

import pytest

from indexer.clock import FakeClock
from indexer.hashing import Namespace, hash_request
from indexer.index import Overlap, available_backends
from indexer.ttl import TtlIndex

H = hash_request(list(range(32)), 8, Namespace())  # four blocks

NOT_BUILT = "C index core not built: pip install -e . needs gcc and the Python headers"
BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(b not in available_backends(), reason=NOT_BUILT))
    for b in ("c", "python")
]


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs against every index backend (PrefixIndex() reads the variable)."""
    monkeypatch.setenv("KVROUTE_INDEX_BACKEND", request.param)
    return str(request.param)


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
