"""The prefill->decode handoff's Prometheus metrics, registered on the router's registry.

Two counters are the decode workers' own (`vllm:nixl_bytes_transferred`,
`vllm:nixl_num_failed_transfers`), added up from their /metrics: under `--processes` every
process reads the same growth, so only the first counts them (the others' files would
multiply the sum by the processes)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.processes import counts_worker_totals
from router.series import LabelledSeries

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _NotCounted:
    """A counter's stand-in in the processes that leave it to the first."""

    def labels(self, *labels: str) -> _NotCounted:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def remove(self, *labels: str) -> None:
        pass


class PDMetrics:
    """`owner`: counts what the decode workers report (default: not one of --processes,
    or its first process)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        estimates: Callable[[], dict[str, Any]],
        owner: bool | None = None,
    ):
        r = registry
        owner = counts_worker_totals() if owner is None else owner
        self.decisions = Counter(
            "kvroute_pd_decisions_total",
            "P/D decisions for completions and chat: decision split or local, and the reason "
            "code (split_faster, above_threshold, local_faster, below_threshold, never, "
            "link_unknown, prefill_rate_unknown, cached_on_decode, no_prefill_worker, "
            "prefill_saturated, not_splittable)",
            ["decision", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "kvroute_pd_local_fallbacks_total",
            "Splits served by a local prefill on the decode worker instead, by cause "
            "(prefill_failed, prefill_refused, prefill_timeout, prefill_bad_params, "
            "prefill_removed, prefill_unavailable, decode_unreachable, decode_closed, "
            "decode_removed, decode_unavailable)",
            ["cause"],
            registry=r,
        )
        self.handoff = Histogram(
            "kvroute_pd_handoff_seconds",
            "Split requests: arrival to the client's first byte (prefill leg, KV transfer, "
            "decode leg's first token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_leg = Histogram(
            "kvroute_pd_prefill_leg_seconds",
            "The prefill leg of split requests, whole",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_bytes: Counter | _NotCounted = _NotCounted()
        if owner:
            self.kv_bytes = Counter(
                "kvroute_pd_kv_bytes",
                "KV bytes the decode workers pulled (their vllm:nixl_bytes_transferred)",
                ["worker"],
                registry=r,
            )
        self.verified = Counter(
            "kvroute_pd_verified_handoffs",
            "Splits whose pull the decode worker's metrics prove (external_kv_transfer tokens)",
            ["worker"],
            registry=r,
        )
        self.silent = Counter(
            "kvroute_pd_silent_recomputes",
            "Splits the decode worker answered without pulling the KV (it recomputed)",
            ["worker"],
            registry=r,
        )
        self.failed_pulls: Counter | _NotCounted = _NotCounted()
        if owner:
            self.failed_pulls = Counter(
                "kvroute_pd_failed_pulls",
                "Failed NIXL transfers on the decode workers (vllm:nixl_num_failed_transfers)",
                ["worker"],
                registry=r,
            )
        self.orphans = Counter(
            "kvroute_pd_orphaned_prefills",
            "Prefill legs whose KV no decode leg will read: the prefill worker holds the blocks "
            "until its lease ends (30 s in vLLM)",
            ["worker", "cause"],
            registry=r,
        )
        self.decode_errors = Counter(
            "kvroute_pd_decode_errors",
            "Decode legs that failed after their prefill (one error to the client, never a "
            "second stream)",
            ["worker", "cause"],
            registry=r,
        )
        r.register(_Estimates(estimates))
        # every per-worker series is asked for through it, so that a worker's go when it
        # leaves the fleet (`forget_worker`)
        self.series = LabelledSeries(removable=not os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.child = self.series.child

    def forget_worker(self, names: Iterable[str]) -> None:
        """Workers left the fleet: their series go (the decode workers' totals, orphans and
        decode errors by cause), as RouterMetrics.forget_worker does the router's."""
        self.series.forget(names)


class _Estimates(Collector):
    """The cost model's current estimates, read at scrape time."""

    def __init__(self, estimates: Callable[[], dict[str, Any]]) -> None:
        self._estimates = estimates

    def collect(self) -> Iterator[GaugeMetricFamily]:
        e = self._estimates()
        for key, name, text in (
            ("link_mb_s", "kvroute_pd_link_mb_per_second", "Estimated P->D link (MB/s)"),
            ("kv_bytes_per_token", "kvroute_pd_kv_bytes_per_token", "KV bytes per token"),
            ("overhead_ms", "kvroute_pd_overhead_ms", "A split's fixed overhead (ms)"),
        ):
            if e.get(key) is not None:
                yield GaugeMetricFamily(name, text, value=float(e[key]))
