"""vLLM 0.32's metrics of where prompt tokens came from and of NIXL transfers.

Names, labels and buckets follow `vllm/v1/metrics/loggers.py` (prompt tokens by source,
recorded when a request's prefill is done) and `kv_connector/v1/nixl/stats.py`
(`NixlPromMetrics`: transfers are observed on the worker that reads, the decode worker;
`nixl_num_kv_expired_reqs` on the worker whose lease ran out, the prefill worker). The
evidence of a real pull is on the decode worker: `vllm:nixl_bytes_transferred_sum` and
`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from engines.sim.request import SimRequest

LABELS = ("model_name", "engine")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_TIERS = ("device", "host", "p2p", "disk", "external_unspecified")
XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
POST_BUCKETS = (0.001, *XFER_BUCKETS)
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
DESC_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)


class PromptSourceMetrics:
    """`vllm:prompt_tokens_by_source`, `vllm:prompt_tokens_cached` and
    `vllm:prompt_tokens_cached_by_source` (device = local prefix cache, p2p = NIXL)."""

    def __init__(self, r: CollectorRegistry, lv: tuple[str, str]) -> None:
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            (*LABELS, "source"),
            registry=r,
        )
        self.by_source = {s: by_source.labels(*lv, s) for s in PROMPT_SOURCES}
        self.cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            LABELS,
            registry=r,
        ).labels(*lv)
        by_tier = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            (*LABELS, "source"),
            registry=r,
        )
        self.by_tier = {t: by_tier.labels(*lv, t) for t in CACHE_TIERS}

    def prefilled(self, req: SimRequest) -> None:
        """A request's prompt is in KV: count its tokens by where they came from."""
        external = req.num_external_tokens
        local = max(req.num_cached_tokens, 0) - external
        self.by_source["local_compute"].inc(req.num_prompt_tokens - local - external)
        self.by_source["local_cache_hit"].inc(local)
        self.by_source["external_kv_transfer"].inc(external)
        self.cached.inc(local + external)
        self.by_tier["device"].inc(local)
        self.by_tier["p2p"].inc(external)


class NixlMetrics:
    """The `vllm:nixl_*` family, registered only on workers with a NixlConnector."""

    def __init__(self, r: CollectorRegistry, lv: tuple[str, str]) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=r, buckets=buckets)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r)

        self.xfer_time = hist(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            XFER_BUCKETS,
        ).labels(*lv)
        self.post_time = hist(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            POST_BUCKETS,
        ).labels(*lv)
        self.bytes = hist(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            BYTES_BUCKETS,
        ).labels(*lv)
        self.descriptors = hist(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            tuple(float(b) for b in DESC_BUCKETS),
        ).labels(*lv)
        self.failed_transfers = counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and "
            "notification failures.",
        ).labels(*lv)
        self.failed_notifications = counter(
            "vllm:nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications."
        ).labels(*lv)
        self.kv_expired = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on "
            "the P instance.",
        ).labels(*lv)
        self.notifications_after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry",
            "Number of completion notifications for requests that were no longer tracked.",
        ).labels(*lv)

    def transfer(self, nbytes: int, descriptors: int, post_s: float, xfer_s: float) -> None:
        self.bytes.observe(nbytes)
        self.descriptors.observe(descriptors)
        self.post_time.observe(post_s)
        self.xfer_time.observe(xfer_s)

    def failed(self, notification: bool = False) -> None:
        """A failed transfer or handshake; a failed notification counts in both, as in vLLM."""
        self.failed_transfers.inc()
        if notification:
            self.failed_notifications.inc()


# ---- reading them back (tests, the conformance harness, a router's verification) -------------


@dataclass(frozen=True)
class PDSnapshot:
    """One worker's P/D evidence from its `/metrics` text (vLLM's or the simulator's),
    summed over engines. Subtract two snapshots to see what happened in between."""

    bytes_transferred: float = 0.0
    transfers: float = 0.0
    xfer_seconds: float = 0.0
    failed_transfers: float = 0.0
    kv_expired: float = 0.0
    local_compute: float = 0.0
    local_cache_hit: float = 0.0
    external_kv_transfer: float = 0.0

    def __sub__(self, other: PDSnapshot) -> PDSnapshot:
        return PDSnapshot(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )

    @property
    def link_bytes_per_s(self) -> float | None:
        """What the transfers averaged (None before any)."""
        return self.bytes_transferred / self.xfer_seconds if self.xfer_seconds > 0 else None


_SERIES = {
    "vllm:nixl_bytes_transferred_sum": "bytes_transferred",
    "vllm:nixl_bytes_transferred_count": "transfers",
    "vllm:nixl_xfer_time_seconds_sum": "xfer_seconds",
    "vllm:nixl_num_failed_transfers_total": "failed_transfers",
    "vllm:nixl_num_kv_expired_reqs_total": "kv_expired",
}


def pd_snapshot(metrics_text: str) -> PDSnapshot:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            key = _SERIES.get(sample.name)
            if sample.name == "vllm:prompt_tokens_by_source_total":
                key = sample.labels.get("source")
            if key is not None:
                totals[key] = totals.get(key, 0.0) + sample.value
    return PDSnapshot(**{k: v for k, v in totals.items() if k in _FIELDS})


_FIELDS = {f.name for f in dataclasses.fields(PDSnapshot)}
