"""vLLM's Prometheus metrics, one registry per simulated worker (several live in one process).

Names, labels (`model_name`, `engine`) and TTFT buckets follow vLLM 0.32
(`vllm/v1/metrics/loggers.py`). Gauges are refreshed from the engine on every scrape.
Counted as vLLM's output processor counts (`v1/metrics/stats.py`): prompt tokens when a
request's first token comes out, generation tokens as they are sampled (a stop string's
finish or a client's abort keeps what was generated), and a finish, with its reason and its
e2e latency, for every request the engine or a stop string ends. A client's abort is not a
finish there (`OutputProcessor.abort_requests` drops the request's state unrecorded).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engines.sim.engine import EngineStats
from engines.sim.pd_metrics import NixlMetrics, PromptSourceMetrics
from engines.sim.request import SimRequest

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
LABELS = ("model_name", "engine")


class SimMetrics:
    def __init__(self, model_name: str, cache_info: dict[str, str], engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lv = self.registry, (model_name, engine)
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            LABELS,
            registry=r,
        ).labels(*lv)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            LABELS,
            registry=r,
        ).labels(*lv)
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            (*LABELS, "reason"),
            registry=r,
        )
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        self.waiting_deferred = by_reason.labels(*lv, "deferred")
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            LABELS,
            registry=r,
        ).labels(*lv)
        self._counters(r, lv)
        self._histograms(r, lv)
        self.sources = PromptSourceMetrics(r, lv)
        self.labels = lv
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            sorted(cache_info),
            registry=r,
        )
        info.labels(**cache_info).set(1)
        self._last = EngineStats(0, 0, 0.0, 0, 0, 0, 0)

    def _counters(self, r: CollectorRegistry, lv: tuple[str, str]) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*lv)

        self.queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=r,
        )
        for reason in FINISH_REASONS:  # vLLM creates every series up front, at 0
            self.success.labels(*lv, reason)
        self._lv = lv

    def _histograms(self, r: CollectorRegistry, lv: tuple[str, str]) -> None:
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            registry=r,
            buckets=TTFT_BUCKETS,
        ).labels(*lv)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            registry=r,
            buckets=LATENCY_BUCKETS,
        ).labels(*lv)

    # ---- EngineObserver ------------------------------------------------------------------

    def first_token(self, req: SimRequest, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.sources.prefilled(req)

    def generated(self, req: SimRequest) -> None:
        self.generation_tokens.inc()

    def nixl(self) -> NixlMetrics:
        """The NIXL transfer metrics, for a worker with a connector."""
        return NixlMetrics(self.registry, self.labels)

    def finished(self, req: SimRequest, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.success.labels(*self._lv, req.finish_reason or "abort").inc()

    # ---- scrape --------------------------------------------------------------------------

    def render(self, stats: EngineStats) -> bytes:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.waiting_capacity.set(stats.waiting - stats.deferred)
        self.waiting_deferred.set(stats.deferred)
        self.kv_usage.set(stats.kv_usage)
        last = self._last
        self.queries.inc(stats.prefix_queries - last.prefix_queries)
        self.hits.inc(stats.prefix_hits - last.prefix_hits)
        self.preemptions.inc(stats.preemptions - last.preemptions)
        self._last = stats
        return generate_latest(self.registry)
