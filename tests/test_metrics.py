"""What a worker removed from the fleet leaves in the router's own bookkeeping: its metric
series (the in-flight gauge once its last request ended) and connection-pool keys."""

from __future__ import annotations

from prometheus_client import generate_latest

from router.metrics import RouterMetrics
from router.upstream import Timeouts, UpstreamPool


def _series(m: RouterMetrics, worker: str) -> list[str]:
    text = generate_latest(m.registry).decode()
    return [line for line in text.splitlines() if f'worker="{worker}"' in line]


def test_a_removed_workers_series_go_the_in_flight_gauge_with_its_last_request() -> None:
    m = RouterMetrics()
    m.count("m", "w:1", 200, "ok")
    m.child(m.inflight, "w:1").inc()
    m.forget_worker(["w:1"])
    left = _series(m, "w:1")
    assert left == ['kvroute_inflight_requests{worker="w:1"} 1.0']  # still in flight
    m.inflight_done("w:1")
    assert _series(m, "w:1") == []
    m.child(m.inflight, "w:1").inc()  # the same name added back: counted as before
    m.inflight_done("w:1")
    assert _series(m, "w:1") == ['kvroute_inflight_requests{worker="w:1"} 0.0']


def test_the_pool_keeps_no_key_of_a_removed_worker() -> None:
    pool = UpstreamPool(1.0, Timeouts(1.0, 1.0, 1.0))
    pool._busy_of(("a", 1, False))  # a request that ended without a release
    pool._forgotten.add(("a", 1, False))
    pool.forget("b", 2)
    assert pool._busy == {} and pool._forgotten == set()
