"""Prometheus metrics for the router, kept in wrappers (the core never touches them).

Counters that live in the ingest layer (events, gaps, replays, resyncs, malformed payloads)
are read at scrape time by a collector instead of being incremented twice. Under
`--processes` every process consumes every worker's events, so each holds its own copy of
them: the first process alone writes them to its metrics file (`_CounterMirror`), so the
answer is the same whichever process a scrape reaches and never goes back."""

from __future__ import annotations

import asyncio
import atexit
import logging
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

from router.processes import counts_worker_totals
from router.series import LabelledSeries

if TYPE_CHECKING:
    from router.workers import Feed, WorkerPool

log = logging.getLogger("kvroute.metrics")

HEALTH_STATES = ("OK", "NO_EVENTS", "STALE", "RESYNCING", "DISABLED")
MIRROR_EVERY_S = 0.5  # the first process writes the workers' event counters this often at most
PREFILL_HELP = (
    "Uncached prompt tokens awaiting first token (this replica's requests, all its processes')"
)
# run before each write of a --processes child's metrics file (`_coalesce_file_writes`)
_before_write: list[Callable[[], None]] = []


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvroute")
    except PackageNotFoundError:
        return "unknown"


class RouterMetrics:
    """`multiprocess_dir`: one of `kvroute serve --processes N` (router/processes.py): the
    counters, histograms and in-flight gauges of every process are summed at scrape from
    their files there; the fleet's gauges (the same in each process, which all consume
    every worker's events) are this process's; the workers' event counters are the first
    process's (`owner`; default: from the environment the supervisor gives its children)."""

    def __init__(self, multiprocess_dir: str | None = None, owner: bool | None = None) -> None:
        if multiprocess_dir is not None:
            _coalesce_file_writes()
        self.registry = CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
        self.owner = counts_worker_totals() if owner is None else owner
        r = self.registry
        self.requests = Counter(
            "kvroute_requests_total",
            "Requests by model, worker, HTTP status and outcome (ok, http_error, "
            "connect_failed, timeout, client_disconnected, drain_timeout; the router's own "
            "answers have worker=none and outcome=router)",
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
            "as predictions (applied), placements taken back (withdrawn: a gateway's fallback "
            "served the request elsewhere, or the engine refused it; unmatched_withdrawal: one "
            "never received or expired), "
            "in-flight load reports (load), or dropped "
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
        # labelled children, cached: labels() costs a few microseconds per call
        self.series = LabelledSeries(removable=self.multiprocess_dir is None)
        self.child = self.series.child
        self._retiring: set[str] = set()  # removed workers with requests still in flight
        self.inflight = Gauge(
            "kvroute_inflight_requests",
            "Requests this router has in flight",
            ["worker"],
            registry=r,
            multiprocess_mode="livesum",
        )

    def forget_worker(self, names: list[str]) -> None:
        """Endpoints removed from the fleet: their series go (pods that come back under new
        addresses would grow them without bound). A request still in flight there keeps
        its in-flight gauge until it ends (`inflight_done`); one ending later starts its
        series anew. Under --processes the series live in prometheus_client's files, which
        it cannot remove from: they stay."""
        if not self.series.removable:
            return
        for key in self.series.naming(names):
            metric, labels = key
            if metric is self.inflight and self.child(metric, *labels)._value.get() != 0:
                self._retiring.add(labels[0])
                continue
            self.series.drop(key)

    def inflight_done(self, worker: str) -> None:
        """A request there ended: one fewer in flight (and the series goes with the last of
        a removed worker's)."""
        child = self.child(self.inflight, worker)
        child.dec()
        if worker in self._retiring and child._value.get() == 0:
            self._retiring.discard(worker)
            self.series.drop((self.inflight, (worker,)))

    def count(self, model: str, worker: str, status: int, outcome: str) -> None:
        self.child(self.requests, model, worker, str(status), outcome).inc()

    def attach(self, pool: WorkerPool) -> None:
        self.registry.register(_PoolCollector(lambda: pool, self.multiprocess_dir is not None))
        if self.multiprocess_dir is None:
            return
        # each process's own, summed over the live ones as kvroute_inflight_requests is: its
        # fleet view also holds the sibling processes' and the other replicas' load
        prefill = Gauge(
            "kvroute_inflight_prefill_tokens",
            PREFILL_HELP,
            ["worker"],
            registry=None,
            multiprocess_mode="livesum",
        )
        load = pool.fleet.load
        load.watchers.append(
            lambda worker: self.child(prefill, worker).set(load.local(worker).prefill_tokens)
        )
        if self.owner:
            _before_write.append(_CounterMirror(lambda: pool).sync)

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
    never forked, so the pid check has nothing to find. `_before_write` runs first (what it
    changes goes in the same write): under --processes something changes at least every
    second (the link's heartbeat sets kvroute_peer_replicas), so it runs at least as often."""
    base: Any = values.ValueClass
    if not getattr(base, "_multiprocess", False) or getattr(base, "_coalesced", False):
        return
    dirty: set[Any] = set()
    due_on: asyncio.AbstractEventLoop | None = None  # the loop a write is queued on
    hooks_running = False

    def write() -> None:
        nonlocal due_on, hooks_running
        if not hooks_running:
            hooks_running = True
            try:
                for hook in _before_write:
                    hook()
            except Exception:  # the other metrics are written anyway
                log.exception("updating the metrics file failed")
            finally:
                hooks_running = False
        due_on = None
        flush()

    def flush() -> None:
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

    atexit.register(flush)
    values.ValueClass = Coalesced


class _CounterMirror:
    """The workers' event counters (`_worker_counters`) of this process, added to its
    metrics file as they grow: under --processes only the first process runs one, so the
    sum over the files is its count; a restarted first process adds to what the one before
    it wrote (a dead process's counter file stays), so the sum never goes back."""

    def __init__(self, pool: Callable[[], WorkerPool]) -> None:
        self._pool = pool
        self._counters: dict[str, Counter] = {}
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}
        self._synced_at = -MIRROR_EVERY_S

    def sync(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self._synced_at < MIRROR_EVERY_S:
            return
        self._synced_at = now
        for family in _worker_counters(self._pool()):
            for sample in family.samples:
                labels = tuple(sample.labels.values())
                grown = self._grown((family.name, labels), sample.value)
                if grown > 0:
                    self._counter(family, tuple(sample.labels)).labels(*labels).inc(grown)

    def _grown(self, key: tuple[str, tuple[str, ...]], value: float) -> float:
        last = self._last.get(key, 0.0)
        self._last[key] = value
        # less than before: the worker was rediscovered (or removed and added again) and
        # its counters began again from 0, so all of it is new
        return value - last if value >= last else value

    def _counter(self, family: Metric, names: tuple[str, ...]) -> Counter:
        counter = self._counters.get(family.name)
        if counter is None:
            counter = self._counters[family.name] = Counter(
                family.name, family.documentation, names, registry=None
            )
        return counter


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
    """What the pool knows, read at scrape time. With --processes (`all_processes`) only
    the fleet's gauges: the workers' event counters are read from the first process's
    file (`_CounterMirror`), the in-flight prefill tokens summed over the processes'."""

    def __init__(self, pool: Callable[[], WorkerPool], all_processes: bool = False) -> None:
        self._pool = pool
        self._all_processes = all_processes

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        pool = self._pool()
        if not self._all_processes:
            yield from _worker_counters(pool)
        yield from _worker_gauges(pool, prefill=not self._all_processes)


_KV_COUNTERS = (
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


def _worker_counters(pool: WorkerPool) -> list[CounterMetricFamily]:
    """The counters this process keeps of each worker's event stream and index."""
    events = CounterMetricFamily(
        "kvroute_kv_events", "KV events applied, by worker and type", labels=["worker", "type"]
    )
    counters = {
        name: CounterMetricFamily(f"kvroute_kv_{name}", help_text, labels=["worker"])
        for name, help_text in _KV_COUNTERS
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
    for f in _feeds(pool):
        name = f.state.name
        evicted.add_metric([name, "cap"], float(pool.fleet.index.evicted_at_cap(name)))
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
            sub_restarts.add_metric([name], float(f.subscriber.status.restarts))
    return [events, *counters.values(), malformed, evicted, sub_restarts]


def _worker_gauges(pool: WorkerPool, prefill: bool) -> Iterator[GaugeMetricFamily]:
    """The fleet's gauges (the same in every process); `prefill`: with this process's
    in-flight prefill tokens (under --processes the processes' gauge files sum them)."""
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
    load = GaugeMetricFamily("kvroute_inflight_prefill_tokens", PREFILL_HELP, labels=["worker"])
    batch = GaugeMetricFamily(
        "kvroute_worker_batch_limit",
        "Requests the worker's engine runs at once, learned from its /metrics where requests "
        "queued for a slot (--busy-learn-batch); absent until learned",
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
        load.add_metric([name], float(pool.fleet.load.local(name).prefill_tokens))
        limit = pool.fleet.load.batch_limit(name)
        if limit is not None:
            batch.add_metric([name], float(limit))
        st = f.subscriber.status if f.ingest is not None and f.subscriber is not None else None
        if st is not None and st.last_message_at is not None:
            lag.add_metric([name], max(0.0, time.monotonic() - st.last_message_at))
    yield lag
    yield health
    yield mode
    yield available
    yield cached
    yield batch
    if prefill:
        yield load


def _feeds(pool: WorkerPool) -> Iterator[Feed]:
    for h in pool.handles.values():
        yield from h.feeds


def _endpoints(pool: WorkerPool) -> Iterator[tuple[Feed, dict[str, Any]]]:
    from router.verdicts import worker_reports

    for h in pool.handles.values():
        yield from zip(h.feeds, worker_reports(pool, h), strict=True)
