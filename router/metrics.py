"""Prometheus metrics for the router, kept in wrappers (the core never touches them).

Counters that live in the ingest layer (events, gaps, replays, resyncs, malformed payloads)
are read at scrape time by a collector instead of being incremented twice."""

from __future__ import annotations

import asyncio
import atexit
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from router.workers import Feed, WorkerPool

HEALTH_STATES = ("OK", "NO_EVENTS", "STALE", "RESYNCING", "DISABLED")


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvroute")
    except PackageNotFoundError:
        return "unknown"


class RouterMetrics:
    """`multiprocess_dir`: one of `kvroute serve --processes N` (router/processes.py): the
    counters, histograms and in-flight gauges of every process are summed at scrape from
    their files there; the fleet's gauges and event counters (the same in each process,
    which all consume every worker's events) are this process's."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        if multiprocess_dir is not None:
            _coalesce_file_writes()
        self.registry = CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
        r = self.registry
        self.requests = Counter(
            "kvroute_requests_total",
            "Requests by model, worker, HTTP status and outcome (ok, http_error, "
            "connect_failed, timeout, client_disconnected; the router's own answers have "
            "worker=none and outcome=router)",
            ["model", "worker", "status", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds",
            "Time from the request's arrival to the first byte of the worker's answer",
            ["model", "worker"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.duration = Histogram(
            "kvroute_request_duration_seconds",
            "Time from the request's arrival to the end of the worker's answer",
            ["model", "worker"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.stream_errors = Counter(
            "kvroute_stream_errors_total",
            "Responses cut short after they started (an error event and [DONE] were sent)",
            ["worker", "cause"],
            registry=r,
        )
        self.build_info = Gauge(
            "kvroute_build_info",
            "kvroute's version",
            ["version"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.build_info.labels(version()).set(1)
        self.decision_seconds = Histogram(
            "kvroute_route_decision_seconds",
            "Tokenize + hash + lookup + score time",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
            registry=r,
        )
        self.predicted_overlap = Histogram(
            "kvroute_predicted_overlap_ratio",
            "Predicted cached fraction of the prompt",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
            registry=r,
        )
        self.predicted_tokens = Counter(
            "kvroute_predicted_cached_tokens_total",
            "Cached tokens the router predicted",
            ["worker"],
            registry=r,
        )
        self.reported_tokens = Counter(
            "kvroute_reported_cached_tokens_total",
            "Cached tokens the engine reported (usage.prompt_tokens_details.cached_tokens)",
            ["worker"],
            registry=r,
        )
        self.fidelity = Counter(
            "kvroute_prediction_fidelity_total",
            "Predicted vs reported cached blocks per request: exact, over or under",
            ["worker", "result"],
            registry=r,
        )
        self.shed = Counter(
            "kvroute_requests_shed_total",
            "Requests refused with 429 because every eligible worker was busy (--shed, "
            "--busy-max-requests, --busy-max-kv-usage)",
            ["model"],
            registry=r,
        )
        self.peer_placements = Counter(
            "kvroute_peer_placements_total",
            "Messages received from the other router replicas (--peer): placements applied "
            "as predictions (applied), in-flight load reports (load), or dropped "
            "(unknown_worker: the replicas' worker lists differ; malformed)",
            ["result"],
            registry=r,
        )
        self.placement_waits = Counter(
            "kvroute_placement_waits_total",
            "New prefixes this replica placed after waiting --peer-wait-ms for the other "
            "replicas' placements (it is not the first of them), by whether the second look "
            "chose another worker (changed=true: the wait avoided a collision)",
            ["changed"],
            registry=r,
        )
        self.peer_replicas = Gauge(
            "kvroute_peer_replicas",
            "Other router processes whose in-flight load this one counts (heard from within "
            "3.5 s): its --processes siblings and each process of the other replicas; below "
            "the count of all router processes - 1 means a peer link is down (with "
            "--processes: the fewest any process hears)",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.retries = Counter(
            "kvroute_retries_total",
            "Requests retried on another worker after a connect failure",
            ["worker"],
            registry=r,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.inflight = Gauge(
            "kvroute_inflight_requests",
            "Requests this router has in flight",
            ["worker"],
            registry=r,
            multiprocess_mode="livesum",
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """A labelled child, cached: labels() costs a few microseconds per call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def count(self, model: str, worker: str, status: int, outcome: str) -> None:
        self.child(self.requests, model, worker, str(status), outcome).inc()

    def attach(self, pool: WorkerPool) -> None:
        self.registry.register(_PoolCollector(lambda: pool, self.multiprocess_dir is not None))

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        scrape = CollectorRegistry()
        MultiProcessCollector(scrape, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        scrape.register(_FleetViews(self.registry))
        return generate_latest(scrape)


def _coalesce_file_writes() -> None:
    """With --processes, prometheus_client writes a process's file on every update (a lock,
    a pid check and a struct packed into the mmap: ~5% of a request's CPU in each process,
    about ten updates a request). Here values change in memory and their file entries are
    written once per event-loop turn (and at exit), before any scrape can come in: a
    scrape's request is read after the callbacks already queued. The children are spawned,
    never forked, so the pid check has nothing to find."""
    base: Any = values.ValueClass
    if not getattr(base, "_multiprocess", False) or getattr(base, "_coalesced", False):
        return
    dirty: set[Any] = set()
    due_on: asyncio.AbstractEventLoop | None = None  # the loop a write is queued on

    def write() -> None:
        nonlocal due_on
        due_on = None
        for v in dirty:
            v._file.write_value(v._key, v._value, v._timestamp)
        dirty.clear()

    def changed(v: Any) -> None:
        nonlocal due_on
        dirty.add(v)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (start-up): now
            write()
            return
        if due_on is not loop:  # none queued, or queued on a loop that is gone
            due_on = loop
            loop.call_soon(write)

    class Coalesced(base):  # type: ignore[misc]
        _coalesced = True

        def inc(self, amount: float) -> None:
            self._value += amount
            self._timestamp = 0.0
            changed(self)

        def set(self, value: float, timestamp: float | None = None) -> None:
            self._value = value
            self._timestamp = timestamp or 0.0
            changed(self)

    atexit.register(write)
    values.ValueClass = Coalesced


class _FleetViews(Collector):
    """The collectors of a registry that read state at scrape time (not counters kept in
    this process): with --processes the same in every process, so this one answers."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        # prometheus_client keeps no public list of a registry's collectors
        for c in list(self._registry._collector_to_names):
            if not isinstance(c, MetricWrapperBase):
                yield from c.collect()


class _PoolCollector(Collector):
    def __init__(self, pool: Callable[[], WorkerPool], all_processes: bool = False) -> None:
        self._pool = pool
        self._all_processes = all_processes  # --processes: the sibling processes' load too

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        pool = self._pool()
        events = CounterMetricFamily(
            "kvroute_kv_events", "KV events applied, by worker and type", labels=["worker", "type"]
        )
        counters = {
            name: CounterMetricFamily(f"kvroute_kv_{name}", help_text, labels=["worker"])
            for name, help_text in (
                ("sequence_gaps", "Sequence gaps detected in a worker's KV event stream"),
                ("replays", "Replay requests sent to a worker's replay socket"),
                ("replay_failures", "Replays that timed out or failed"),
                ("resyncs", "Times a worker's index was cleared after unrecoverable loss"),
                ("restarts", "Engine restarts detected (sequence went back to the start)"),
                ("out_of_order", "Batches with an old sequence number, dropped"),
                ("unknown_parent", "BlockStored events whose parent was never seen"),
                (
                    "skipped_events",
                    "KV events not indexed: another KV-cache group's (a hybrid model's) or "
                    "an offload store without token ids",
                ),
                (
                    "refetched_blocks",
                    "GPU blocks a worker stored again soon after evicting them: its cache is "
                    "losing what it is asked for again (rising: the prefixes routed to it do "
                    "not fit its KV cache)",
                ),
            )
        }
        malformed = CounterMetricFamily(
            "kvroute_kv_malformed",
            "Malformed KV event batches dropped, by reason (decode, too_deep, too_large, ...)",
            labels=["worker", "reason"],
        )
        sub_restarts = CounterMetricFamily(
            "kvroute_kv_subscriber_restarts",
            "Times a worker's event subscriber failed and was restarted",
            labels=["worker"],
        )
        evicted = CounterMetricFamily(
            "kvroute_index_evicted",
            "Index entries dropped to stay within a bound: the worker's cap (its KV capacity "
            "times index_cap_margin) or the global max_index_entries",
            labels=["worker", "cause"],
        )
        lag = GaugeMetricFamily(
            "kvroute_kv_event_age_seconds",
            "Seconds since the worker's last KV event message arrived",
            labels=["worker"],
        )
        health = GaugeMetricFamily(
            "kvroute_worker_event_health",
            "1 for the worker's current event-health state",
            labels=["worker", "state"],
        )
        mode = GaugeMetricFamily(
            "kvroute_worker_mode",
            "1 for the worker's current routing mode",
            labels=["worker", "mode"],
        )
        available = GaugeMetricFamily(
            "kvroute_worker_available", "1 while the worker passes health checks", labels=["worker"]
        )
        cached = GaugeMetricFamily(
            "kvroute_index_blocks", "Blocks the index shows on each worker", labels=["worker"]
        )
        load = GaugeMetricFamily(
            "kvroute_inflight_prefill_tokens",
            "Uncached prompt tokens awaiting first token (this replica's requests, all its "
            "processes')",
            labels=["worker"],
        )
        for f, report in _endpoints(pool):
            name = f.state.name
            for state in HEALTH_STATES:
                health.add_metric([name, state], 1.0 if report["event_health"] == state else 0.0)
            for m in ("events", "approx"):
                mode.add_metric([name, m], 1.0 if f.state.mode == m else 0.0)
            available.add_metric([name], 1.0 if f.state.available else 0.0)
            cached.add_metric([name], float(pool.fleet.index.entries_of(name)))
            evicted.add_metric([name, "cap"], float(pool.fleet.index.evicted_at_cap(name)))
            mine = pool.fleet.load.known if self._all_processes else pool.fleet.load.local
            load.add_metric([name], float(mine(name).prefill_tokens))
            if f.ingest is None:
                continue
            c = f.ingest.counters
            for etype, n in c.events.items():
                events.add_metric([name, etype], float(n))
            for key, fam in counters.items():
                attr = "gaps" if key == "sequence_gaps" else key
                fam.add_metric([name], float(getattr(c, attr)))
            for reason, n in c.malformed_by_reason.items():
                malformed.add_metric([name, reason], float(n))
            if f.subscriber is not None:
                st = f.subscriber.status
                sub_restarts.add_metric([name], float(st.restarts))
                if st.last_message_at is not None:
                    lag.add_metric([name], max(0.0, time.monotonic() - st.last_message_at))
        yield events
        yield from counters.values()
        yield malformed
        yield evicted
        yield sub_restarts
        yield lag
        yield health
        yield mode
        yield available
        yield cached
        yield load


def _endpoints(pool: WorkerPool) -> Iterator[tuple[Feed, dict[str, Any]]]:
    from router.verdicts import worker_reports

    for h in pool.handles.values():
        yield from zip(h.feeds, worker_reports(pool, h), strict=True)
