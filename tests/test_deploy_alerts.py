"""deploy/k8s/alerts: the PrometheusRule each overlay renders (proxy and sidecar as it is,
gateway with KvrouteDown on its own job, the sidecar with Envoy's alert added), validated
offline against the Prometheus Operator's PrometheusRule schema; every expression parsed by a
real PromQL parser; the `up` and Envoy selectors wired to the labels the ServiceMonitor yields
(job = the selected Service's name, container = the owner of the scraped port); what every
replica reports alike never summed; and every metric, label and label value checked against
real scrapes: a `kvroute serve` in front of simulated workers, and the sidecar's own Envoy
bootstrap failing open past a dead picker."""

from __future__ import annotations

import copy
import re
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import promql_parser
import pytest
import yaml
from test_deploy_dashboard import (
    TARGET_LABELS,
    _metrics_once,
    _traffic,
    grouping_labels,
    nearest_aggregations,
    replica_alike,
)
from test_deploy_envoy_drain import Envoy
from test_deploy_overlays import MODES, ROUTER, container, find, ports, render

from conformance.faults.harness import SimProcess
from router.procs import FleetProcess, RouterProcess
from router.tokenize import PACKAGED_TOKENIZER

Doc = dict[str, Any]
Exposed = dict[str, dict[str, set[str]]]  # sample name -> label -> values seen
KVROUTE_ALERTS = {
    "KvrouteDown",
    "KvrouteRequestErrors",
    "KvroutePeerReplicasMissing",
    "KvrouteWorkerUnavailable",
    "KvrouteWorkerApproximate",
    "KvrouteWorkerEvents",
    "KvroutePredictionFidelityLow",
    "KvroutePdSilentRecomputes",
}
ENVOY_ALERTS = {"KvrouteEnvoyFailingOpen"}
DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
# PrometheusRule monitoring.coreos.com/v1 as the Prometheus Operator's CRD has it
# (example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml, v0.82.2,
# openAPIV3Schema), with additionalProperties false where the CRD lists every field, so a
# misspelt one is an error (kubectl apply --validate=strict); the group names are unique
# (x-kubernetes-list-map-keys: name), which a schema cannot say: checked below.
PROMETHEUS_RULE_SCHEMA: Doc = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": DURATION},
                            "labels": LABELS,
                            "limit": {"type": "integer"},
                            # the CRD's ^(?i)(abort|warn)?$, with the flag first for Python
                            "partial_response_strategy": {
                                "type": "string",
                                "pattern": "(?i)^(abort|warn)?$",
                            },
                            "query_offset": {"type": "string", "pattern": DURATION},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": ["integer", "string"]},
                                        "for": {"type": "string", "pattern": DURATION},
                                        "keep_firing_for": {
                                            "type": "string",
                                            "minLength": 1,
                                            "pattern": DURATION,
                                        },
                                        "labels": LABELS,
                                        "annotations": LABELS,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


def rule(mode: str) -> Doc:
    return find(mode, "PrometheusRule", "kvroute")


def alerts(mode: str) -> dict[str, Doc]:
    found = [r for g in rule(mode)["spec"]["groups"] for r in g["rules"]]
    named = {r["alert"]: r for r in found}
    assert len(named) == len(found), f"{mode}: an alert name twice"
    return named


def every_alert() -> list[tuple[str, Doc]]:
    return [(mode, r) for mode in MODES for r in alerts(mode).values()]


def matchers(expr: str) -> list[tuple[str, list[Any]]]:
    """Each vector selector's metric name and its label matchers."""
    found: list[tuple[str, list[Any]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name or "", list(node.matchers.matchers)))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def selector_labels(expr: str, metric: str) -> dict[str, str]:
    (labels,) = [{m.name: m.value for m in ms} for name, ms in matchers(expr) if name == metric]
    return labels


# ---- the rule: rendered, schema, shape -------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_each_overlay_with_a_servicemonitor_ships_the_alerts(mode: str) -> None:
    want = KVROUTE_ALERTS | (ENVOY_ALERTS if mode == "sidecar" else set())
    assert set(alerts(mode)) == want
    names = [g["name"] for g in rule(mode)["spec"]["groups"]]
    assert len(names) == len(set(names))  # the CRD's list-map key
    assert (
        rule(mode)["metadata"]["namespace"]
        == find(mode, "ServiceMonitor", ROUTER[mode])["metadata"]["namespace"]
    )


@pytest.mark.parametrize("mode", MODES)
def test_the_rule_matches_the_crd_schema(mode: str) -> None:
    jsonschema.Draft202012Validator.check_schema(PROMETHEUS_RULE_SCHEMA)
    jsonschema.Draft202012Validator(PROMETHEUS_RULE_SCHEMA).validate(rule(mode))


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (lambda r: r.update(expresion=r.pop("expr")), "expresion"),
        (lambda r: r.pop("expr"), "expr"),
        (lambda r: r.update({"for": "5 minutes"}), "5 minutes"),
        (lambda r: r["labels"].update(severity=3), "3"),
    ],
    ids=["unknown-field", "required", "duration", "label-type"],
)
def test_the_schema_rejects_what_the_crd_rejects(break_it: Any, where: str) -> None:
    broken = copy.deepcopy(rule("proxy"))
    break_it(broken["spec"]["groups"][0]["rules"][0])
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.Draft202012Validator(PROMETHEUS_RULE_SCHEMA).validate(broken)
    assert where in str(err.value)


@pytest.mark.parametrize(
    ("mode", "alert"), every_alert(), ids=[f"{m}:{a['alert']}" for m, a in every_alert()]
)
def test_every_alert_is_promql_and_names_the_fix(mode: str, alert: Doc) -> None:
    promql_parser.parse(alert["expr"])  # raises on anything that is not PromQL
    assert alert["labels"]["severity"] in ("critical", "warning")
    notes = alert["annotations"]
    assert set(notes) == {"summary", "description"}
    assert len(notes["summary"]) <= 100 and len(notes["description"]) >= 200
    for text in notes.values():  # Prometheus' templates: only these variables
        assert set(re.findall(r"\$(\w+)", text)) <= {"labels", "value"}, text


@pytest.mark.parametrize(
    ("mode", "alert"), every_alert(), ids=[f"{m}:{a['alert']}" for m, a in every_alert()]
)
def test_what_every_replica_reports_alike_is_never_summed(mode: str, alert: Doc) -> None:
    for name, agg in nearest_aggregations(alert["expr"]):
        if replica_alike(name):
            assert agg in ("max", "min"), f"{name} under {agg!r}"


# ---- the wiring: job and container as the ServiceMonitor yields them ------------------------


def scraped_as(mode: str, path: str) -> dict[str, str]:
    """The job and container labels Prometheus (Operator) gives the ServiceMonitor's
    endpoint for `path`: job = the selected Service's name (no jobLabel), container = the
    container whose port the Service port targets."""
    monitor = find(mode, "ServiceMonitor", ROUTER[mode])["spec"]
    assert "jobLabel" not in monitor
    (endpoint,) = [e for e in monitor["endpoints"] if e["path"] == path]
    (service,) = [
        d
        for d in render(mode)
        if d["kind"] == "Service"
        and monitor["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()
    ]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    deployment = find(mode, "Deployment", ROUTER[mode])
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    (owner,) = [
        c["name"]
        for c in deployment["spec"]["template"]["spec"]["containers"]
        if port["targetPort"] in ports(c)
    ]
    return {"job": service["metadata"]["name"], "container": owner}


@pytest.mark.parametrize("mode", MODES)
def test_router_down_watches_the_job_the_servicemonitor_yields(mode: str) -> None:
    expr = alerts(mode)["KvrouteDown"]["expr"]
    assert expr.replace(" ", "").startswith("absent(up{") and expr.endswith("== 1)")
    assert selector_labels(expr, "up") == scraped_as(mode, "/metrics")
    assert scraped_as(mode, "/metrics") == {"job": ROUTER[mode], "container": "kvroute"}


def test_envoys_alert_watches_the_sidecars_stats_endpoint() -> None:
    expr = alerts("sidecar")["KvrouteEnvoyFailingOpen"]["expr"]
    labels = selector_labels(expr, "envoy_http_ext_proc_failure_mode_allowed")
    assert {k: labels[k] for k in ("job", "container")} == scraped_as(
        "sidecar", "/stats/prometheus"
    )
    deployment = find("sidecar", "Deployment", "kvroute")
    (config_map,) = [
        d for d in render("sidecar") if d["kind"] == "ConfigMap" and "envoy.yaml" in d["data"]
    ]
    bootstrap = yaml.safe_load(config_map["data"]["envoy.yaml"])
    (listener,) = [
        x for x in bootstrap["static_resources"]["listeners"] if x["name"] == "kvroute_gateway"
    ]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert labels["envoy_http_conn_manager_prefix"] == hcm["stat_prefix"]
    assert hcm["http_filters"][1]["typed_config"]["failure_mode_allow"] is True  # fails open
    stats = ports(container(deployment, "envoy"))["envoy-stats"]
    (stats_listener,) = [
        x for x in bootstrap["static_resources"]["listeners"] if x["name"] == "envoy_stats"
    ]
    assert stats_listener["address"]["socket_address"] == {
        "address": "0.0.0.0",
        "port_value": stats,
    }


@pytest.mark.parametrize("mode", MODES)
def test_peer_alert_expects_every_router_process(mode: str) -> None:
    """kvroute_peer_replicas counts the other router processes: pods x processes - 1."""
    config = yaml.safe_load(find(mode, "ConfigMap", "kvroute-config")["data"]["kvroute.yaml"])
    expr = alerts(mode)["KvroutePeerReplicasMissing"]["expr"]
    (processes,) = re.findall(
        r"count by \(namespace, job\) \(kvroute_build_info\) \* (\d+) - 1", expr
    )
    assert int(processes) == config["processes"]


# ---- against real scrapes ------------------------------------------------------------------


SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Each sample of a text exposition, named as Prometheus stores it (prometheus_client's
    parser would add _total to a counter of Envoy's, which Prometheus does not)."""
    out = []
    for line in text.splitlines():
        found = SAMPLE.fullmatch(line.strip())
        if found and not line.startswith("#"):
            labels = dict(LABEL.findall(found[2] or ""))
            out.append((found[1], labels, float(found[3])))
    return out


def exposed(text: str) -> Exposed:
    out: Exposed = {}
    for name, labels, _ in samples(text):
        seen = out.setdefault(name, {})
        for label, value in labels.items():
            seen.setdefault(label, set()).add(value)
    return out


@cache
def kvroute_scrape() -> Exposed:
    """A real kvroute serve after ok requests, its own 400 and a client that hung up."""
    with (
        FleetProcess(2, kv_blocks=512) as fleet,
        RouterProcess(fleet.urls, tokenizer=PACKAGED_TOKENIZER) as router,
    ):
        _traffic(router.url)
        body = {"model": "kvroute-sim", "prompt": "hang up " * 40, "max_tokens": 2000}
        with httpx.stream(
            "POST", f"{router.url}/v1/completions", json={**body, "stream": True}
        ) as r:
            next(r.iter_bytes())  # the first chunk, then gone
        return exposed(_metrics_once(router.url, 'outcome="client_disconnected"'))


@cache
def envoy_text() -> str:
    """The sidecar's Envoy with its picker down: a request fails open (served round robin),
    then its stats port is scraped as Prometheus would."""
    sim = SimProcess()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            envoy = Envoy(Path(tmp), sim.port)
            try:
                body = {"model": "kvroute-sim", "prompt": "past the picker", "max_tokens": 1}
                url = f"http://127.0.0.1:{envoy.port}/v1/completions"
                assert httpx.post(url, json=body, timeout=30).status_code == 200
                stats = f"http://127.0.0.1:{envoy.stats}"
                assert httpx.get(f"{stats}/config_dump", timeout=5).status_code == 404
                return httpx.get(f"{stats}/stats/prometheus", timeout=5).text
            finally:
                envoy.stop()
    finally:
        sim.stop()


def problems(expr: str, scraped: Exposed) -> list[str]:
    """What in `expr` a real scrape does not have: a metric, a label, a label value (each
    alternative of a regex must match a value seen), a grouping label."""
    found: list[str] = []
    regex = (promql_parser.MatchOp.Re, promql_parser.MatchOp.NotRe)
    seen_labels = set(TARGET_LABELS)
    for name, ms in matchers(expr):
        if name == "up":  # Prometheus' own, per target: target labels only
            found += [f"up{{{m.name}}}" for m in ms if m.name not in TARGET_LABELS]
            continue
        if name not in scraped:
            found.append(f"{name}: not exposed")
            continue
        seen_labels |= set(scraped[name])
        for m in ms:
            if m.name in TARGET_LABELS:
                continue
            values = scraped[name].get(m.name, set())
            wanted = m.value.split("|") if m.op in regex else [m.value]
            for want in wanted:
                if not any(re.fullmatch(want, v) if m.op in regex else want == v for v in values):
                    found.append(f"{name}{{{m.name}}}: {want!r} not among {sorted(values)}")
    found += [f"by ({label})" for label in grouping_labels(expr) - seen_labels]
    return found


@pytest.mark.timeout(240)
def test_every_metric_label_and_value_is_in_a_real_scrape() -> None:
    scraped = {**kvroute_scrape(), **exposed(envoy_text())}
    checked = set()
    for mode, alert in every_alert():
        assert problems(alert["expr"], scraped) == [], f"{mode}: {alert['alert']}"
        checked |= {name for name, _ in matchers(alert["expr"])}
    assert "envoy_http_ext_proc_failure_mode_allowed" in checked
    assert {"kvroute_worker_mode", "kvroute_worker_event_health", "up"} <= checked


@pytest.mark.timeout(240)
def test_the_sidecar_envoy_counts_what_failed_open() -> None:
    """The request through the sidecar's Envoy bypassed the dead picker: kvroute never saw
    it, and only Envoy's counter, on the stats port, says so."""
    (sample,) = [
        (labels, value)
        for name, labels, value in samples(envoy_text())
        if name == "envoy_http_ext_proc_failure_mode_allowed"
    ]
    assert sample[0] == {"envoy_http_conn_manager_prefix": "kvroute"}
    assert sample[1] >= 1


@pytest.mark.timeout(240)
def test_the_checks_catch_a_wrong_name_label_or_value() -> None:
    scraped = kvroute_scrape()
    assert problems('max(kvroute_worker_mode{mode="approx"})', scraped) == []
    assert problems('max(kvroute_worker_mode{mode="approximate"})', scraped) != []
    assert problems('max(kvroute_worker_event_health{state=~"NO_EVENTS|STALLED"})', scraped)
    assert problems("max(kvroute_worker_modes)", scraped)
    assert problems('max(kvroute_worker_mode{modes="approx"})', scraped)
    assert problems("max by (replica) (kvroute_worker_mode)", scraped)
    assert problems('absent(up{jobs="kvroute"})', scraped)
