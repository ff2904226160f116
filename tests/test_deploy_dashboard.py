"""deploy/grafana/kvroute.json: valid JSON that deploy/grafana/build.py writes unchanged, a
well-formed Grafana dashboard, and every PromQL expression in it (panels and variables),
parsed by a real PromQL parser, names only metrics and labels that a real `kvroute serve`
exposes: the test scrapes two (child processes, a few requests each): one in front of
simulated workers, and one in front of a simulated prefill and decode worker that hand KV
over with real NIXL transfers, for the handoff's metrics."""

from __future__ import annotations

import json
import re
import runpy
import time
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.sim.pd_fleet import start_pd_fleet
from router.procs import FleetProcess, RouterProcess
from router.tokenize import PACKAGED_TOKENIZER

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute.json"
# what Prometheus adds to every scraped series (ServiceMonitor targets)
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
# counted only when something fails: declared (HELP/TYPE in the scrape) but without samples
# on a healthy fleet, so their labels cannot be checked against the scrape
FAILURE_ONLY = {
    "kvroute_retries_total",
    "kvroute_stream_errors_total",
    "kvroute_kv_malformed_total",
    "kvroute_requests_shed_total",  # only under overload with --shed
    "kvroute_peer_placements_total",  # only between replicas (--peer)
    "kvroute_placement_waits_total",  # only between replicas, on a replica that waits
    "kvroute_worker_batch_limit",  # only once an engine was seen with its batch full
    # the prefill->decode handoff's failures
    "kvroute_pd_local_fallbacks_total",
    "kvroute_pd_failed_pulls_total",
    "kvroute_pd_orphaned_prefills_total",
    "kvroute_pd_decode_errors_total",
    "kvroute_pd_silent_recomputes_total",
}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
# what every replica reports alike (each consumes every worker's events, health checks it
# and scrapes the decode workers' NIXL counters; under --processes the first process alone
# writes the event and NIXL counters): summed over the replicas they would read N times too
# high, so the nearest aggregation must be max/min
REPLICA_ALIKE = {
    "kvroute_worker_available",
    "kvroute_worker_event_health",
    "kvroute_worker_mode",
    "kvroute_index_blocks",
    "kvroute_index_evicted_total",
    "kvroute_kv_event_age_seconds",
    "kvroute_pd_kv_bytes_total",
    "kvroute_pd_failed_pulls_total",
}
REPLICA_ALIKE_PREFIX = "kvroute_kv_"  # the event stream's counters
Doc = dict[str, Any]


def dashboard() -> Doc:
    doc = json.loads(DASHBOARD.read_text())
    assert isinstance(doc, dict)
    return doc


def panels() -> list[Doc]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries() -> list[str]:
    exprs = [t["expr"] for p in panels() for t in p["targets"]]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(_label_values(var["query"]["query"])[0])
    return exprs


def _label_values(query: str) -> tuple[str, str]:
    """label_values(SELECTOR, LABEL) (Grafana's, not PromQL): the selector and the label."""
    found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
    assert found, query
    return found[1], found[2]


def parse(expr: str) -> Any:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return promql_parser.parse(expr)  # raises on anything that is not PromQL


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """Each vector selector's metric name and the labels its matchers name."""
    found: list[tuple[str, set[str]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            labels = {m.name for m in node.matchers.matchers}
            found.append((node.name or "", labels))

    promql_parser.walk(parse(expr), visit)
    return found


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)

    promql_parser.walk(parse(expr), visit)
    return labels


def nearest_aggregations(expr: str) -> list[tuple[str, str]]:
    """Each vector selector's metric name and the operator of the innermost aggregation
    around it ("" for none)."""
    found: list[tuple[str, str]] = []

    def visit(node: Any, agg: str) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name or "", agg))
            return
        if isinstance(node, promql_parser.AggregateExpr):
            agg = str(node.op)
        for attr in ("expr", "lhs", "rhs", "vector_selector"):
            if getattr(node, attr, None) is not None:
                visit(getattr(node, attr), agg)
        for arg in getattr(node, "args", None) or ():
            visit(arg, agg)

    visit(parse(expr), "")
    return found


def replica_alike(name: str) -> bool:
    return name in REPLICA_ALIKE or name.startswith(REPLICA_ALIKE_PREFIX)


# ---- the file ------------------------------------------------------------------------------


def test_the_json_is_what_build_py_writes() -> None:
    build = runpy.run_path(str(ROOT / "deploy" / "grafana" / "build.py"))
    text = json.dumps(build["dashboard"](), indent=2) + "\n"
    assert text == DASHBOARD.read_text(), "run: python deploy/grafana/build.py"


def test_a_well_formed_dashboard() -> None:
    doc = dashboard()
    assert doc["uid"] == "kvroute" and doc["schemaVersion"] >= 36
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in doc["templating"]["list"]}
    assert names == {"datasource", "job", "model", "worker"}
    for p in panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        box = p["gridPos"]
        assert box["x"] + box["w"] <= 24 and box["w"] > 0 and box["h"] > 0
        for t in p["targets"]:
            assert 'job=~"$job"' in t["expr"], f"{p['title']}: not filtered by $job"


def test_every_query_is_promql() -> None:
    assert len(queries()) > 30
    for expr in queries():
        parse(expr)
    with pytest.raises(ValueError):
        parse("sum by (model (rate(kvroute_requests_total[5m]))")


def test_what_every_replica_reports_alike_is_never_summed() -> None:
    """With N replicas a sum would show N times the fleet's workers, events and index."""
    checked = 0
    for expr in queries():
        for name, agg in nearest_aggregations(expr):
            if replica_alike(name) and agg:
                assert agg in ("max", "min"), f"{name} under {agg}: {expr}"
                checked += 1
    assert checked >= 15
    assert nearest_aggregations("sum(max by (worker) (rate(kvroute_kv_gaps_total[5m])))") == [
        ("kvroute_kv_gaps_total", "max")
    ]
    assert nearest_aggregations("sum by (worker) (kvroute_index_blocks)") == [
        ("kvroute_index_blocks", "sum")
    ]


def test_the_readme_metrics_are_all_on_the_dashboard() -> None:
    """Every metric the README names before it offers the dashboard "for every metric
    above": the metrics table, the replicas' and the handoff's."""
    readme = (ROOT / "README.md").read_text()
    above = readme[: readme.index("`deploy/grafana/kvroute.json` is a Grafana dashboard")]
    documented = set(re.findall(r"`(kvroute_[a-z_]+)", above))
    assert {"kvroute_requests_total", "kvroute_pd_decisions_total"} <= documented
    shown = {name for e in queries() for name, _ in selectors(e)}
    shown |= {re.sub(r"_(bucket|sum|count)$", "", n) for n in shown}
    assert documented - shown == set()


# ---- against a real kvroute serve ----------------------------------------------------------


@cache
def scraped() -> dict[str, set[str] | None]:
    """Every sample name kvroute serve exposes, with the labels seen on it (None: declared,
    no samples yet), over both routers."""
    with (
        FleetProcess(2, kv_blocks=512) as fleet,
        RouterProcess(fleet.urls, tokenizer=PACKAGED_TOKENIZER) as router,
    ):
        _traffic(router.url)
        texts = [_metrics_once(router.url, "kvroute_kv_event_age_seconds{")]
    texts.append(_handoff_metrics())
    names: dict[str, set[str] | None] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for suffix in _SUFFIXES.get(family.type, ("",)):
                names.setdefault(family.name + suffix, None)
            for sample in family.samples:
                seen = names.get(sample.name) or set()
                names[sample.name] = seen | set(sample.labels)
    return names


def _handoff_metrics() -> str:
    """One request split over a prefill and a decode worker, its pull proved."""
    with start_pd_fleet(1, 1, ["--kv-bytes-per-token", "4096"]) as fleet:
        pd = ["--pd-threshold", "256", "--no-pd-probe", "--pd-link-mb-s", "1000"]
        pd += ["--pd-kv-bytes-per-token", "4096"]  # the gauges show once the model knows
        extra = [*fleet.router_args, *pd]
        with RouterProcess([], tokenizer=PACKAGED_TOKENIZER, extra=extra) as router:
            prompt = " ".join(f"w{i} lorem" for i in range(400))
            # streamed: a streamed split's first token is what the overhead is learned from
            body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}
            resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert resp.headers["x-kvroute-pd"].startswith("split"), resp.headers
            return _metrics_once(router.url, "kvroute_pd_verified_handoffs_total{")


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def _traffic(url: str) -> None:
    doc = " ".join(f"dashboard paragraph {i} on caches and routing." for i in range(60))
    with httpx.Client(base_url=url, timeout=30) as client:
        for prompt in (doc, doc, doc + " and a tail"):
            body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 4}
            assert client.post("/v1/completions", json=body).status_code == 200
        body = {"model": "kvroute-sim", "prompt": doc, "max_tokens": 4, "stream": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", content=b"{").status_code == 400  # the router's


def _metrics_once(url: str, sample: str) -> str:
    """The router's /metrics once `sample` shows (events flowing, a pull proved), or after
    20 s: the checks then name what is missing."""
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        if sample in text or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_every_metric_and_label_the_dashboard_uses_is_exposed() -> None:
    exposed = scraped()
    for expr in queries():
        used = selectors(expr)
        labels_here: set[str] = set(TARGET_LABELS) | {"le"}
        for name, matched in used:
            assert name in exposed, f"{name} (in {expr}) is not exposed by kvroute serve"
            labels = exposed[name]
            if labels is None:
                assert name in FAILURE_ONLY, f"{name}: no samples after traffic"
                continue
            assert matched - labels - TARGET_LABELS == set(), f"{name}: labels {matched}"
            labels_here |= labels
        if not any(exposed[name] is None for name, _ in used):
            assert grouping_labels(expr) <= labels_here, expr


@pytest.mark.timeout(240)
def test_the_checks_catch_a_wrong_name() -> None:
    exposed = scraped()
    assert "kvroute_requests_total" in exposed and "kvroute_request_total" not in exposed
    assert "kvroute_ttft_seconds_bucket" in exposed and "kvroute_ttft_seconds" not in exposed
    (name, labels), *_ = selectors('sum by (modle) (kvroute_requests_total{modle="x"})')
    assert labels - (exposed[name] or set()) == {"modle"}
    assert "modle" in grouping_labels('sum by (modle) (kvroute_requests_total{job=~"$job"})')
