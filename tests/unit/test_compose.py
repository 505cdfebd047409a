"""deploy/docker-compose.yml, deploy/.env and the `kvrs up` table agree with the services.

Each service's configuration module is the truth: the variables it reads are found by
running its `Config.from_env` over a mapping that records every lookup, and its default
listen port by running it over an empty one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from kvrs.cli.launcher import (
    PEER_ADDR_ENV,
    SERVICES,
    ClusterOptions,
    Wiring,
    common_env,
    has_main,
    peer_env,
    tls_env,
)
from kvrs.client import KvrsClient

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
COMPOSE_MTLS = ROOT / "deploy" / "mtls" / "compose.mtls.yml"
DOT_ENV = ROOT / "deploy" / ".env"
CONFIGURATION_DOC = ROOT / "docs" / "configuration.md"

KVRS_SERVICES = {
    "gossip",
    "gossip-views",
    "slot-broker",
    "cost-oracle",
    "prober",
    "scheduler-1",
    "scheduler-2",
    "router",
    "openai-http",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
}
HTTP_SERVICES = {"openai-http"}
# Read outside the Config classes: by setup_tracing / configure_logging / Python itself.
PROCESS_ENV = {
    "OTEL_SERVICE_NAME",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "KVRS_LOG_LEVEL",
    "PYTHONUNBUFFERED",
}


class RecordingEnv(dict):
    """An environment mapping that remembers every variable looked up in it."""

    def __init__(self, values: Mapping[str, str] = ()) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


# The variables a service requires (no default), so its Config can be built at all.
REQUIRED = {"services.worker": {"WORKER_INSTANCE_ID": "w", "WORKER_ROLE": "decode"}}


def config_class(module: str):
    return importlib.import_module(f"{module}.config").Config


def variables_read(module: str) -> set[str]:
    env = RecordingEnv(REQUIRED.get(module, {}))
    config_class(module).from_env(env)
    return env.read


def default_port(module: str) -> int:
    config = config_class(module).from_env(REQUIRED.get(module, {}))
    return port_of(config.listen_addr)


def listen_env(module: str) -> str:
    names = [name for name in variables_read(module) if name.endswith("_LISTEN_ADDR")]
    assert len(names) == 1, f"{module} reads {names}"
    return names[0]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def dot_env() -> dict[str, str]:
    values = {}
    for line in DOT_ENV.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    return values


def kvrs_services(compose: dict) -> dict[str, tuple[str, dict]]:
    """compose name -> (python module it runs, service definition)."""
    found = {}
    for name, service in compose["services"].items():
        command = service.get("command", [])
        if command[:2] == ["python", "-m"]:
            found[name] = (command[2], service)
    return found


def test_compose_runs_every_kvrs_service_and_its_infrastructure(compose):
    assert set(kvrs_services(compose)) == KVRS_SERVICES
    assert {"redis", "jaeger"} <= set(compose["services"])
    for name in compose["services"]:
        assert name == name.lower() and "_" not in name, f"{name} is not kebab-case"
    jaeger_ports = {p.split(":")[-1] for p in compose["services"]["jaeger"]["ports"]}
    assert {"4317", "16686"} <= jaeger_ports


@pytest.mark.parametrize("name", sorted(KVRS_SERVICES))
def test_each_service_command_port_and_variables_match_its_config(compose, name):
    module, service = kvrs_services(compose)[name]
    assert has_main(module), f"{name}: python -m {module} has no __main__"
    read = variables_read(module)
    environment = service.get("environment", {})
    unknown = set(environment) - read - PROCESS_ENV
    assert not unknown, f"{name} sets variables {module}.config never reads: {unknown}"

    listen = listen_env(module)
    port = default_port(module)
    assert port_of(environment.get(listen, f"0.0.0.0:{port}")) == port
    healthcheck = service["healthcheck"]["test"]
    if name in HTTP_SERVICES:
        assert f"http://localhost:{port}/health" in healthcheck[-1]
    else:
        assert healthcheck[1:4] == ["python", "-m", "services.common.healthcheck"]
        assert port_of(healthcheck[4]) == port
    assert any(str(p).endswith(f":{port}") for p in service["ports"])
    assert environment["OTEL_SERVICE_NAME"] == f"kvrs-{name}"
    assert service["env_file"] == ".env"
    assert service["volumes"] == [
        "./topology.yaml:/etc/kvrs/topology.yaml:ro",
        "${KVRS_MODEL_DIR:-./models}:/models:ro",
        "kvrs-cache:/var/cache/kvrs",
    ]


def test_workers_run_their_role_under_their_compose_name(compose):
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        command = compose["services"][name]["command"]
        role = name.split("-")[0]
        assert command[command.index("--role") + 1] == role
        assert name in compose["services"][name]["environment"].values()


def test_dot_env_addresses_point_at_each_service_port(compose, dot_env):
    services = kvrs_services(compose)
    for service_name, variable in PEER_ADDR_ENV.items():
        host, _, port = dot_env[variable].rpartition(":")
        assert host == service_name
        assert int(port) == default_port(services[service_name][0])
    schedulers = dot_env["SCHEDULER_ADDRS"].split(",")
    assert schedulers == ["scheduler-1:50053", "scheduler-2:50053"]
    assert dot_env["REDIS_URL"].startswith("redis://redis:6379")
    assert dot_env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert dot_env["KVRS_TOPOLOGY_FILE"] == "/etc/kvrs/topology.yaml"


def client_variables() -> set[str]:
    """What callers of the cluster read: KvrsClient's variables and every service address."""
    env = RecordingEnv()
    KvrsClient.from_env(env)
    return env.read | set(PEER_ADDR_ENV.values()) | {"SCHEDULER_ADDRS"}


def test_every_dot_env_variable_is_read_by_some_service_or_client(compose, dot_env):
    read = PROCESS_ENV | client_variables()
    for module, _ in kvrs_services(compose).values():
        read |= variables_read(module)
    assert set(dot_env) - read == set()


def test_local_workers_beat_to_gossip_and_the_other_services_read_gossip_views(tmp_path):
    addresses = {spec.name: f"127.0.0.1:{spec.port}" for spec in SERVICES}
    wiring = Wiring(addresses=addresses, options=ClusterOptions(run_dir=tmp_path))
    shared = common_env(wiring, None, "redis://127.0.0.1:1/0", "{kvrs}:")
    for spec in SERVICES:
        gossip = {**shared, **spec.env(wiring)}["GOSSIP_ADDR"]
        beats = spec.module == "services.worker"
        assert gossip == addresses["gossip" if beats else "gossip-views"], spec.name
    # Clients (bench.scale, an instance registering by hand) register at `gossip`.
    assert peer_env(addresses)["GOSSIP_ADDR"] == addresses["gossip"]


def test_the_local_cluster_sets_only_variables_its_services_read(tmp_path):
    addresses = {spec.name: f"127.0.0.1:{spec.port}" for spec in SERVICES}
    wiring = Wiring(addresses=addresses, options=ClusterOptions(run_dir=tmp_path))
    shared = common_env(wiring, tmp_path, "redis://127.0.0.1:1/0", "{kvrs}:")
    assert set(tls_env(tmp_path, "server")) <= set(shared)
    read_by_any = PROCESS_ENV | client_variables()
    for spec in SERVICES:
        read = variables_read(spec.module)
        read_by_any |= read
        assert spec.listen_env == listen_env(spec.module)
        assert not set(spec.env(wiring)) - read - PROCESS_ENV, spec.name
    assert set(shared) - read_by_any == set()


def test_the_mtls_override_gives_every_service_the_identity_kvrs_up_tls_gives_it(compose):
    """Every kvrs service gets KVRS_TLS_* with client certificates required; each worker
    presents its own certificate (gossip lets it speak only for itself), the others the
    shared server one: the identities `kvrs up --tls` hands out, at the mounted path."""
    override = yaml.safe_load(COMPOSE_MTLS.read_text())["services"]
    assert set(override) == KVRS_SERVICES
    certs = Path("/etc/kvrs/certs")
    for name in KVRS_SERVICES:
        worker = compose["services"][name]["command"][2] == "services.worker"
        assert override[name]["environment"] == tls_env(certs, name if worker else "server")
        assert override[name]["volumes"] == [f"./certs:{certs}:ro"], name


def test_standard_ports_of_the_local_cluster_match_compose(compose):
    for spec in SERVICES:
        published = compose["services"][spec.name]["ports"]
        assert any(str(p).startswith(f"{spec.port}:") for p in published), spec.name


def test_every_variable_of_every_service_is_documented():
    documented = CONFIGURATION_DOC.read_text()
    for spec in SERVICES:
        for variable in variables_read(spec.module):
            assert f"`{variable}`" in documented, f"{variable} ({spec.module})"
