"""The /metrics fast path (`engines.vllm.metrics_text`) against prometheus_client's parser:
on any page the full parser accepts, the router reads the same load, cache config and
counters either way."""

from __future__ import annotations

import math

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
    ["engine", "model_name", "block_size", "num_gpu_blocks", "prefix_caching_hash_algo", "x_y"]
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
        waiting.labels(*lv).set(e)
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


def test_unwanted_lines_are_not_parsed() -> None:
    # junk in lines the router never reads does not cost it the load figures
    text = "vllm:h_bucket{le=broken 1\nvllm:num_requests_waiting 4\n"
    assert parse_metrics(text).waiting == 4
