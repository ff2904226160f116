"""The /metrics fast path (`engines.vllm.metrics_text`) against prometheus_client's parser:
on any page the full parser accepts, the router reads the same load, cache config and
counters either way. And the router's own counters that every `--processes` process would
count alike are counted by the first only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engines.base import EngineMetrics
from engines.vllm.discovery import READ_METRICS, full_samples, parse_metrics, parse_metrics_full
from engines.vllm.metrics_text import Unparsed, wanted_samples

WANTED = sorted(READ_METRICS)
# names that share a wanted name's start, or are wanted names of another family
LOOKALIKES = [
    "vllm:num_requests_running_max",
    "vllm:num_requests_runnin",
    "vllm:prefix_cache_queries_created",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm_num_requests_running",
    "process_cpu_seconds_total",
]
VALUE_TEXT = st.text(alphabet='ab 7,={}"\\\n\tÜ🚀', max_size=12)
LABEL_NAMES = st.sampled_from(
    [
        *("engine", "model_name", "reason", "x_y"),
        *("block_size", "num_gpu_blocks", "prefix_caching_hash_algo"),
    ]
)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value() -> st.SearchStrategy[str]:
    floats = st.floats(allow_nan=True, allow_infinity=True).map(repr)
    return st.one_of(floats, st.sampled_from(["NaN", "+Inf", "-Inf", "1e3", "0", "-0.5", "2.5E-3"]))


@st.composite
def sample_line(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(WANTED + LOOKALIKES))
    labels = draw(st.dictionaries(LABEL_NAMES, st.one_of(VALUE_TEXT, st.integers(0, 3).map(str))))
    if name == "vllm:num_requests_running" and draw(st.booleans()):
        labels["engine"] = str(draw(st.integers(0, 2)))
    if name == "vllm:num_requests_waiting_by_reason" and draw(st.booleans()):
        labels["reason"] = draw(st.sampled_from(["deferred", "capacity"]))
    sep = draw(st.sampled_from([",", ", "]))
    body = sep.join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    trailing = draw(st.sampled_from(["", ","])) if labels else ""
    braces = f"{{{body}{trailing}}}" if labels or draw(st.booleans()) else ""
    gap = draw(st.sampled_from([" ", "  ", "\t"]))
    stamp = draw(st.sampled_from(["", " 1700000000000", " -5"]))
    return f"{name}{braces}{gap}{draw(_value())}{stamp}"


@st.composite
def page(draw: st.DrawFn) -> str:
    lines = draw(st.lists(sample_line(), max_size=25))
    comments = ["# HELP vllm:num_requests_running Number of requests.", "# TYPE x gauge"]
    out = []
    for line in lines:
        if draw(st.booleans()):
            out.append(draw(st.sampled_from(comments)))
        out.append(line)
    return "\n".join(out) + draw(st.sampled_from(["", "\n"]))


def _same(a: EngineMetrics, b: EngineMetrics) -> bool:
    return repr(a) == repr(b)  # NaN-aware: repr(nan) == repr(nan)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page())
def test_fast_path_reads_as_prometheus_client_on_any_page_it_accepts(text: str) -> None:
    """What the router makes of the page is the same either way (fallback included), and
    where the fast path takes the page, each wanted sample reads the same too."""
    try:
        full = full_samples(text)
    except (ValueError, IndexError, KeyError):
        assume(False)
        raise  # unreachable: assume(False) stops the example
    assert _same(parse_metrics(text), parse_metrics_full(text)), text
    try:
        fast = list(wanted_samples(text, READ_METRICS))
    except Unparsed:
        return  # the fallback's result was compared above
    assert _canonical(fast) == _canonical(full), text


def _canonical(samples: list[tuple[str, dict[str, str], float]]) -> list[tuple[str, str, float]]:
    # prometheus_client reads "0" as int 0; NaN never equals itself
    out = [(n, repr(sorted(labels.items())), float(v)) for n, labels, v in samples]
    return sorted((n, lab, -1.5e308 if math.isnan(v) else v) for n, lab, v in out)


def _vllm_like_page(engines: int = 1) -> str:
    """A page shaped like vLLM 0.32's: the gauges and counters the router reads among many
    histograms, with model_name and engine labels."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "x", labels, registry=r)
    waiting = Gauge("vllm:num_requests_waiting", "x", labels, registry=r)
    by_reason = Gauge("vllm:num_requests_waiting_by_reason", "x", [*labels, "reason"], registry=r)
    usage = Gauge("vllm:kv_cache_usage_perc", "x", labels, registry=r)
    queries = Counter("vllm:prefix_cache_queries", "x", labels, registry=r)
    hits = Counter("vllm:prefix_cache_hits", "x", labels, registry=r)
    info = Gauge(
        "vllm:cache_config_info",
        "x",
        ["block_size", "enable_prefix_caching", "num_gpu_blocks", "prefix_caching_hash_algo"],
        registry=r,
    )
    info.labels("32", "True", "1234", "sha256_cbor").set(1)
    hists = [Histogram(f"vllm:h{i}_seconds", "x", labels, registry=r) for i in range(15)]
    for e in range(engines):
        lv = ("m", str(e))
        running.labels(*lv).set(3 + e)
        waiting.labels(*lv).set(3 * e)
        by_reason.labels(*lv, "capacity").set(2 * e)
        by_reason.labels(*lv, "deferred").set(e)
        usage.labels(*lv).set(0.25 * (e + 1))
        queries.labels(*lv).inc(1000)
        hits.labels(*lv).inc(400 + e)
        for h in hists:
            h.labels(*lv).observe(0.1)
    return generate_latest(r).decode()


@pytest.mark.parametrize("engines", [1, 2])
def test_a_vllm_shaped_page_reads_the_same_both_ways(engines: int) -> None:
    text = _vllm_like_page(engines)
    fast = parse_metrics(text)
    assert _same(fast, parse_metrics_full(text))
    assert fast.running == sum(3 + e for e in range(engines))
    assert fast.block_size == 32 and fast.num_gpu_blocks == 1234
    assert fast.hash_algo == "sha256_cbor" and fast.prefix_caching is True
    assert fast.prefix_hits == sum(400 + e for e in range(engines))
    assert sorted(fast.by_rank) == list(range(engines))
    # of the waiting, those vLLM holds for something other than a slot, per rank and in all
    assert [fast.by_rank[e].deferred for e in range(engines)] == [float(e) for e in range(engines)]
    assert fast.deferred == sum(range(engines)) and fast.waiting == 3 * sum(range(engines))
    # KV use is the mean over ranks: each rank's cache is its own
    mean = sum(0.25 * (e + 1) for e in range(engines)) / engines
    assert fast.kv_usage is not None and math.isclose(fast.kv_usage, mean)


def test_an_unusual_wanted_line_falls_back_to_the_full_parser() -> None:
    # a value this reader does not take as a float ("0x10") raises Unparsed; the full parser
    # then decides (it rejects the page: the scrape is skipped, as before)
    odd = 'vllm:num_requests_running{engine="0"} 0x10\n'
    with pytest.raises(Unparsed):
        list(wanted_samples(odd, READ_METRICS))
    with pytest.raises(ValueError):
        parse_metrics(odd)


def test_an_engine_that_does_not_split_its_queue_reads_as_unknown() -> None:
    # before vLLM 0.32 there is no num_requests_waiting_by_reason: "deferred" is unknown
    # (None), not 0, so a LoRA worker's queue does not read as all for slots
    m = parse_metrics('vllm:num_requests_waiting{engine="0"} 4\n')
    assert m.deferred is None and m.by_rank[0].deferred is None
    only_capacity = (
        'vllm:num_requests_waiting{engine="0"} 4\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 4\n'
    )
    assert parse_metrics(only_capacity).deferred is None


def test_unwanted_lines_are_not_parsed() -> None:
    # junk in lines the router never reads does not cost it the load figures
    text = "vllm:h_bucket{le=broken 1\nvllm:num_requests_waiting 4\n"
    assert parse_metrics(text).waiting == 4


# ---- what `kvroute serve --processes N` counts once (router/metrics.py, router/pd) ----------


@pytest.mark.parametrize(
    ("environ", "counts"),
    [
        pytest.param({}, True, id="not-one-of-processes"),
        pytest.param({"KVROUTE_PROCESS_INDEX": "0"}, True, id="the-first"),
        pytest.param({"KVROUTE_PROCESS_INDEX": "1"}, False, id="a-sibling"),
    ],
)
def test_only_the_first_process_counts_what_all_see(environ: dict[str, str], counts: bool) -> None:
    from router.processes import ENV_COUNT, ENV_DIR, counts_worker_totals

    if environ:
        environ |= {ENV_COUNT: "2", ENV_DIR: "/nowhere"}
    assert counts_worker_totals(environ) is counts


NAMES = ("kv_bytes", "failed_pulls", "verified_handoffs")


def test_a_sibling_process_leaves_the_decode_workers_counters_alone() -> None:
    from router.pd.metrics import PDMetrics

    pages = []
    for owner in (True, False):
        r = CollectorRegistry()
        m = PDMetrics(r, dict, owner=owner)
        m.kv_bytes.labels("d:1").inc(4096)
        m.failed_pulls.labels("d:1").inc()
        m.verified.labels("d:1").inc()  # its own splits: every process counts its own
        pages.append(
            [r.get_sample_value(f"kvroute_pd_{n}_total", {"worker": "d:1"}) for n in NAMES]
        )
    assert pages == [[4096.0, 1.0, 1.0], [None, None, 1.0]]


def _pool(counters: Any, restarts: int = 0) -> Any:
    """What the event-counter mirror reads of a pool: one worker's feed."""
    from types import SimpleNamespace as NS

    feed = NS(
        state=NS(name="w:1"),
        ingest=NS(counters=counters),
        subscriber=NS(status=NS(restarts=restarts)),
    )
    return NS(handles={"w:1": NS(feeds=[feed])}, fleet=NS(index=NS(evicted_at_cap=lambda _: 0)))


def test_the_first_process_adds_what_its_event_counters_grew_by_to_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Growth is added; counters that began again (the worker was rediscovered) add all
    they hold; between two writes less than MIRROR_EVERY_S apart nothing is read."""
    from prometheus_client import values
    from prometheus_client.multiprocess import MultiProcessCollector

    from indexer.ingest import IngestCounters
    from router.metrics import MIRROR_EVERY_S, _CounterMirror

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())  # type: ignore[no-untyped-call]
    counters = IngestCounters(events={"BlockStored": 3}, gaps=1)
    pool = _pool(counters)
    mirror = _CounterMirror(lambda: pool)

    def on_file() -> tuple[float | None, float | None]:
        scrape = CollectorRegistry()
        MultiProcessCollector(scrape, path=str(tmp_path))  # type: ignore[no-untyped-call]
        stored = {"worker": "w:1", "type": "BlockStored"}
        return (
            scrape.get_sample_value("kvroute_kv_events_total", stored),
            scrape.get_sample_value("kvroute_kv_sequence_gaps_total", {"worker": "w:1"}),
        )

    mirror.sync(now=100.0)
    assert on_file() == (3.0, 1.0)
    counters.events["BlockStored"] = 5
    mirror.sync(now=100.0 + MIRROR_EVERY_S / 2)  # too soon: not read
    assert on_file() == (3.0, 1.0)
    mirror.sync(now=101.0)
    assert on_file() == (5.0, 1.0)
    pool.handles["w:1"].feeds[0].ingest.counters = IngestCounters(events={"BlockStored": 2})
    mirror.sync(now=102.0)
    assert on_file() == (7.0, 1.0)  # never back
