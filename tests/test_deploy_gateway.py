"""deploy/k8s/gateway (kvroute as a GIE InferencePool's endpoint picker) and deploy/envoy
(plain Envoy bootstraps), validated offline: the Deployment and Service against the real
Kubernetes schemas (strict), the InferencePool against a JSON schema derived from GIE
v1.6.0's Go types (tests/fixtures/gie), and the wiring between them and deploy/k8s."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.envoy.process import envoy_binary

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = ROOT / "deploy" / "k8s" / "gateway"
BASE = ROOT / "deploy" / "k8s" / "base"
ENVOY_DIR = ROOT / "deploy" / "envoy"
SCHEMA = json.loads(
    (Path(__file__).parent / "fixtures/gie/inferencepool-v1.schema.json").read_text()
)
K8S_VERSIONS = sorted({"1.33", ".".join(kubernetes_validate.latest_version().split(".")[:2])})
Doc = dict[str, Any]


def _docs(folder: Path) -> list[Doc]:
    return [
        d
        for p in sorted(folder.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in yaml.safe_load_all(p.read_text())
        if d is not None
    ]


DOCS = _docs(GATEWAY)


def _find(kind: str, name: str, docs: list[Doc] = DOCS) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _pool() -> Doc:
    return _find("InferencePool", "vllm-pool")


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_gateway_manifests() -> None:
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in DOCS)
    assert kinds == ["Deployment/kvroute-epp", "InferencePool/vllm-pool", "Service/kvroute-epp"]
    kustomization = yaml.safe_load((GATEWAY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == ["epp.yaml", "inferencepool.yaml"]
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == base["namespace"]


def test_the_folder_is_installed_only_through_the_overlay() -> None:
    """Applied after deploy/k8s on its own, this folder left the HTTP proxy running and
    kvroute-peers selecting it (the pickers shared placements with nobody): the header must
    offer deploy/k8s/overlays/gateway, and no install of this folder alone."""
    header = (GATEWAY / "kustomization.yaml").read_text().split("apiVersion:")[0]
    assert "kubectl apply -k deploy/k8s/overlays/gateway" in header
    assert "kubectl apply -k deploy/k8s/gateway" not in header
    assert "kubectl apply -k deploy/k8s " not in header and "apply -k deploy/k8s\n" not in header


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ["Deployment/kvroute-epp", "Service/kvroute-epp"])
def test_builtin_kinds_match_the_kubernetes_schema(name: str, version: str) -> None:
    kind, _, obj = name.partition("/")
    assert kubernetes_validate.validate(_find(kind, obj), version, strict=True) == version


def test_inference_pool_matches_the_gie_v1_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(_pool())


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (lambda s: s["endpointPickerRef"].update(failureMode="FailSometimes"), "failureMode"),
        (lambda s: s.pop("targetPorts"), "targetPorts"),
        (lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]), "targetPorts"),
        (lambda s: s["targetPorts"][0].update(number=70000), "number"),
        (lambda s: s["endpointPickerRef"].pop("port"), "port"),  # CEL: port for a Service
        (lambda s: s.update(targetPortNumber=8000), "targetPortNumber"),  # v1alpha2's field
        (lambda s: s["selector"]["matchLabels"].update({"bad key!": "x"}), "bad key!"),
    ],
    ids=["enum", "required", "unique", "range", "cel-port", "unknown-field", "label-key"],
)
def test_the_schema_rejects_what_gie_rejects(break_it: Any, where: str) -> None:
    pool = copy.deepcopy(_pool())
    break_it(pool["spec"])
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.Draft202012Validator(SCHEMA).validate(pool)
    assert where in str(err.value)


def test_pool_selects_the_vllm_pods_and_their_port() -> None:
    base = _docs(BASE)
    vllm = _find("Deployment", "vllm", base)
    labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert _pool()["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = vllm["spec"]["template"]["spec"]["containers"]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert [p["number"] for p in _pool()["spec"]["targetPorts"]] == [http]


def test_pool_points_at_the_picker_service_and_port() -> None:
    ref = _pool()["spec"]["endpointPickerRef"]
    service = _find("Service", ref["name"])
    (port,) = service["spec"]["ports"]
    assert ref["port"]["number"] == port["port"]
    assert port["appProtocol"] == "http2"  # gRPC over TLS, as GIE's own picker serves
    assert ref["failureMode"] == "FailClose"  # GIE streams bodies: fail-open is not safe
    deployment = _find("Deployment", "kvroute-epp")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["targetPort"] in ("grpc", ports["grpc"])
    assert int(_flag(container["command"], "--ext-proc-port")) == ports["grpc"]


def test_picker_runs_kvroute_serve_alone_over_tls_with_http_probes() -> None:
    """Gateways set up for GIE's picker dial it with TLS; the kubelet's gRPC probes cannot,
    so the probes go to the HTTP port's /ready and /live (--no-proxy serves them)."""
    pod = _find("Deployment", "kvroute-epp")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:2] == ["kvroute", "serve"] and "--no-proxy" in command
    assert "--ext-proc-tls-self-signed" in command
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    config = Path(_flag(command, "--config"))
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(config.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    # the same config as the HTTP proxy's: deploy/k8s/base generates it (the overlay writes in
    # its hashed name; tests/test_deploy_overlays.py checks the rendered mount)
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    (generator,) = [
        g for g in kustomization["configMapGenerator"] if g["name"] == volume["configMap"]["name"]
    ]
    keys = [f.split("=", 1)[0] if "=" in f else Path(f).name for f in generator["files"]]
    assert config.name in keys
    assert pod["securityContext"]["runAsNonRoot"] is True


# ---- deploy/envoy ----------------------------------------------------------------------


def _regenerate(path: Path) -> str:
    """The command line in the file's first comment line, rerun."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# kvroute envoy-config "), f"{path.name} must say how it was made"
    argv = first.removeprefix("# kvroute ").split()
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("name", ["standalone.yaml", "sidecar.yaml"])
def test_envoy_bootstraps_are_current_and_valid(name: str, tmp_path: Path) -> None:
    path = ENVOY_DIR / name
    body = "\n".join(ln for ln in path.read_text().splitlines() if not ln.startswith("#"))
    assert yaml.safe_load(body) == yaml.safe_load(_regenerate(path))  # no drift
    binary = envoy_binary()
    assert binary is not None
    check = subprocess.run(
        [str(binary), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
