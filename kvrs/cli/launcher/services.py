"""The cluster's service table and how each process' environment is wired.

One `ServiceSpec` row per process, in start order, and the variables every process gets
(peer addresses, Redis, topology, tracing, TLS): adding a service is adding a row.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvrs.cli.launcher.errors import ClusterError
from kvrs.model import BLOCK_TOKENS_VARIABLE, DEFAULT_MODEL

DEFAULT_RUN_DIR = "runs/local"
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TOPOLOGY_FILE = REPO_ROOT / "deploy" / "topology.yaml"
GEN_CERTS = REPO_ROOT / "deploy" / "gen-certs.sh"


@dataclass(frozen=True)
class Host:
    """Where one process runs: the address it binds and its peers reach it at, and the
    command prefix that puts it there (`ip netns exec <namespace>` for a worker in a
    network namespace of its own, whose link can then be shaped or cut)."""

    address: str = "127.0.0.1"
    enter: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterOptions:
    """What `kvrs up` was asked for."""

    run_dir: Path = Path(DEFAULT_RUN_DIR)
    """Logs, certificates, the private Redis' files and the state file go here."""
    workers_model: str = DEFAULT_MODEL
    """The model of every service (KVRS_MODEL): a checkpoint directory the workers load,
    whose config.json the cost model prices, or an embedded checkpoint's name."""
    block_tokens: int = 0
    """The cluster's prefix-block size (KVRS_BLOCK_TOKENS of every process); 0 = what the
    environment says, else 512."""
    tls: bool = False
    """Generate dev certificates and run every hop over mTLS."""
    otlp_endpoint: str = ""
    """OTLP gRPC endpoint spans are exported to (e.g. http://127.0.0.1:4317); empty = off."""
    base_port: int = 0
    """Ports from here in the standard layout (service port - 50051 + base_port; 50051 gives
    the compose ports); 0 = free ports."""
    redis_url: str = ""
    """An existing Redis; empty = start a private one."""
    redis_prefix: str = ""
    """Key prefix (hash-tagged); empty = "{kvrs}:" on a private Redis, a fresh one otherwise."""
    topology_file: Path = DEFAULT_TOPOLOGY_FILE
    """Where instances sit; workers look their node, rack and pod up in it."""
    profile_file: Path | None = None
    """The workers' model's compute profile measured on this machine (`kvrs calibrate`),
    given to every process as KVRS_PROFILE_FILE and WORKER_PROFILE_PATH; None = the
    model's preset profile."""
    startup_timeout_s: float = 60.0
    """How long one stage may take to report SERVING."""
    log_level: str = "INFO"
    """KVRS_LOG_LEVEL of every service."""
    host: str = "127.0.0.1"
    """The address every process listens on and is reached at, unless `hosts` names one:
    loopback, so a local cluster opens no port to the network."""
    hosts: Mapping[str, Host] = field(default_factory=dict)
    """Process name -> a host of its own (an address and how to enter it)."""

    def host_of(self, name: str) -> Host:
        return self.hosts.get(name, Host(self.host))


@dataclass(frozen=True)
class Wiring:
    """What a service's environment is built from: every address of the cluster."""

    addresses: Mapping[str, str]
    """Service name -> host:port."""
    options: ClusterOptions
    health_addresses: Mapping[str, str] = field(default_factory=dict)
    """Service name -> host:port of its separate health listener (ServiceSpec.health_port)."""
    run_dir: Path = Path(DEFAULT_RUN_DIR)

    def address(self, name: str) -> str:
        return self.addresses[name]


EnvBuilder = Callable[[Wiring], dict[str, str]]
CommandBuilder = Callable[[Wiring], list[str]]


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the cluster."""

    name: str
    """kebab-case, as in deploy/docker-compose.yml."""
    module: str
    """Run as `python -m <module>`."""
    listen_env: str
    """The variable that tells the process where to bind."""
    stage: int
    """Started once every service of a lower stage reports SERVING."""
    port: int
    """Its port in the standard layout (compose, `kvrs up --base-port 50051`)."""
    kind: str = "control"
    """"control", "prefill" or "decode" (shown by `kvrs status`)."""
    args: tuple[str, ...] = ()
    env: EnvBuilder = field(default=lambda wiring: {})
    """Service-specific variables, beyond those every process gets."""
    health_path: str = ""
    """HTTP path answering 200 when ready; empty = the gRPC health service says SERVING."""
    health_port: int = 0
    """Standard port of a separate listener serving `health_path` (an admin port);
    0 = `health_path` is asked on `port`."""
    command: CommandBuilder | None = None
    """The command line of a process that is not `python -m <module>`."""


def _worker(name: str, role: str, port: int) -> ServiceSpec:
    def env(wiring: Wiring) -> dict[str, str]:
        # With TLS, each worker presents its own certificate: gossip then lets it speak
        # only for its own instance id.
        own_tls = tls_env(wiring.run_dir / "certs", name) if wiring.options.tls else {}
        return {
            "WORKER_INSTANCE_ID": name,
            "WORKER_ADVERTISE_ADDR": wiring.address(name),
            # Instances register and beat to the first replica, whatever views read.
            "GOSSIP_ADDR": wiring.address("gossip"),
            **own_tls,
        }

    return ServiceSpec(
        name=name,
        module="services.worker",
        listen_env="WORKER_LISTEN_ADDR",
        stage=1,
        port=port,
        kind=role,
        args=("--role", role),
        env=env,
    )


SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec("gossip", "services.gossip", "GOSSIP_LISTEN_ADDR", stage=0, port=50051),
    ServiceSpec("gossip-views", "services.gossip", "GOSSIP_LISTEN_ADDR", stage=0, port=50058),
    ServiceSpec(
        "slot-broker", "services.slot_broker", "SLOT_BROKER_LISTEN_ADDR", stage=0, port=50054
    ),
    ServiceSpec(
        "cost-oracle", "services.cost_oracle", "COST_ORACLE_LISTEN_ADDR", stage=1, port=50052
    ),
    ServiceSpec(
        "scheduler-1",
        "services.scheduler",
        "SCHEDULER_LISTEN_ADDR",
        stage=1,
        port=50053,
        env=lambda wiring: {"SCHEDULER_HOLDER_ID": "scheduler-1"},
    ),
    ServiceSpec(
        "scheduler-2",
        "services.scheduler",
        "SCHEDULER_LISTEN_ADDR",
        stage=1,
        port=50057,
        env=lambda wiring: {"SCHEDULER_HOLDER_ID": "scheduler-2"},
    ),
    _worker("prefill-0", "prefill", 50060),
    _worker("prefill-1", "prefill", 50061),
    _worker("decode-0", "decode", 50062),
    _worker("decode-1", "decode", 50063),
    ServiceSpec("prober", "services.prober", "PROBER_LISTEN_ADDR", stage=2, port=50055),
    ServiceSpec("router", "services.router", "ROUTER_LISTEN_ADDR", stage=2, port=50056),
    ServiceSpec(
        "openai-http",
        "services.openai_http",
        "OPENAI_HTTP_LISTEN_ADDR",
        stage=3,
        port=8000,
        health_path="/ready",
    ),
)
"""The cluster, in start order: adding a service is adding a row."""


def command_line(spec: ServiceSpec, wiring: Wiring) -> list[str]:
    """How `spec`'s process starts: its own command or `python -m <module>`, entered into
    its host."""
    if spec.command is not None:
        command = spec.command(wiring)
    else:
        command = [sys.executable, "-m", spec.module, *spec.args]
    return [*wiring.options.host_of(spec.name).enter, *command]


ADAPTER_PREFIX = "openai-http-"


def _pinned_adapter(decode_instance: str, port: int) -> ServiceSpec:
    """An OpenAI HTTP adapter placing every completion on `decode_instance` first: the
    HTTP endpoint a gateway reaches that instance at."""
    return ServiceSpec(
        f"{ADAPTER_PREFIX}{decode_instance}",
        "services.openai_http",
        "OPENAI_HTTP_LISTEN_ADDR",
        stage=3,
        port=port,
        health_path="/ready",
        env=lambda wiring: {"OPENAI_HTTP_DECODE_INSTANCE": decode_instance},
    )


def _epp_env(wiring: Wiring) -> dict[str, str]:
    endpoints = [
        f"{name.removeprefix(ADAPTER_PREFIX)}={address}"
        for name, address in wiring.addresses.items()
        if name.startswith(f"{ADAPTER_PREFIX}decode-")
    ]
    return {"EPP_ENDPOINTS": ",".join(endpoints)}


def _envoy_command(wiring: Wiring) -> list[str]:
    """Renders the gateway's configuration into the run directory; the envoy command line."""
    from services.epp.envoy_config import find_envoy

    config_file = wiring.run_dir / "envoy.yaml"
    listen_port = wiring.address("envoy").rpartition(":")[2]
    admin_port = wiring.health_addresses["envoy"].rpartition(":")[2]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.epp.envoy_config",
            "--epp-addr",
            wiring.address("epp"),
            "--listen-port",
            listen_port,
            "--admin-port",
            admin_port,
            "--output",
            str(config_file),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO_ROOT,
    )
    if result.returncode != 0:
        raise ClusterError(f"cannot render the Envoy configuration:\n{result.stderr}")
    try:
        binary = find_envoy()
    except FileNotFoundError as exc:
        raise ClusterError(str(exc)) from None
    return [binary, "-c", str(config_file), "--disable-hot-restart", "--log-level", "warning"]


ENVOY_SERVICES: tuple[ServiceSpec, ...] = (
    _pinned_adapter("decode-0", 8001),
    _pinned_adapter("decode-1", 8002),
    ServiceSpec("epp", "services.epp", "EPP_LISTEN_ADDR", stage=3, port=9002, env=_epp_env),
    ServiceSpec(
        "envoy",
        "envoy",
        "",
        stage=4,
        port=8081,
        kind="gateway",
        health_path="/ready",
        health_port=9901,
        command=_envoy_command,
    ),
)
"""`kvrs up --envoy`: Envoy with the endpoint picker in front of one OpenAI adapter per
decode instance."""


VIEWS_GOSSIP = "gossip-views"
"""A second gossip replica of the same registry, which every service but the workers
reads its views from (their GOSSIP_ADDR) when the cluster runs one. Workers, and the
clients `kvrs up` prints the environment of, register and beat to `gossip`."""


def common_env(wiring: Wiring, tls_dir: Path | None, redis_url: str, redis_prefix: str) -> dict:
    """Variables every process gets: where its peers, Redis, topology and tracing are."""
    options = wiring.options
    env = {
        **peer_env(wiring.addresses),
        "REDIS_URL": redis_url,
        "KVRS_REDIS_PREFIX": redis_prefix,
        "KVRS_TOPOLOGY_FILE": str(options.topology_file),
        "KVRS_MODEL": options.workers_model,
        "KVRS_LOG_LEVEL": options.log_level,
        "PYTHONUNBUFFERED": "1",
    }
    if VIEWS_GOSSIP in wiring.addresses:
        env["GOSSIP_ADDR"] = wiring.address(VIEWS_GOSSIP)
    if options.block_tokens:
        env[BLOCK_TOKENS_VARIABLE] = str(options.block_tokens)
    if options.otlp_endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = options.otlp_endpoint
    if options.profile_file is not None:
        env["KVRS_PROFILE_FILE"] = env["WORKER_PROFILE_PATH"] = str(options.profile_file)
    if tls_dir is not None:
        env.update(tls_env(tls_dir, "server"))
    return env


PEER_ADDR_ENV = {
    "gossip": "GOSSIP_ADDR",
    "slot-broker": "SLOT_BROKER_ADDR",
    "cost-oracle": "COST_ORACLE_ADDR",
    "prober": "PROBER_ADDR",
    "router": "ROUTER_ADDR",
}
"""The variable naming each singleton service's address; schedulers are SCHEDULER_ADDRS."""


def peer_env(addresses: Mapping[str, str]) -> dict[str, str]:
    """GOSSIP_ADDR, SCHEDULER_ADDRS, ... for the services present in `addresses`."""
    env = {
        PEER_ADDR_ENV[name]: address for name, address in addresses.items() if name in PEER_ADDR_ENV
    }
    schedulers = [address for name, address in addresses.items() if name.startswith("scheduler-")]
    if schedulers:
        env["SCHEDULER_ADDRS"] = ",".join(schedulers)
    return env


def tls_env(tls_dir: Path, identity: str) -> dict[str, str]:
    """KVRS_TLS_* for a process presenting `identity`.pem (mTLS: servers demand a client
    certificate; the server certificate also carries clientAuth, so services use it for
    their outgoing calls too)."""
    return {
        "KVRS_TLS_CERT_FILE": str(tls_dir / f"{identity}.pem"),
        "KVRS_TLS_KEY_FILE": str(tls_dir / f"{identity}.key"),
        "KVRS_TLS_CA_FILE": str(tls_dir / "ca.pem"),
        "KVRS_TLS_REQUIRE_CLIENT_CERT": "1",
    }


def has_main(module: str) -> bool:
    """Whether `python -m <module>` can run: the package exists and has a __main__.py.

    Only the parent packages are imported, so no service's dependencies are loaded.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(
        (Path(location) / "__main__.py").is_file() for location in spec.submodule_search_locations
    )


def generate_certs(run_dir: Path) -> Path:
    """Dev CA, server and client certificates in <run_dir>/certs (deploy/gen-certs.sh)."""
    tls_dir = run_dir / "certs"
    result = subprocess.run(
        ["bash", str(GEN_CERTS), str(tls_dir)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ClusterError(f"{GEN_CERTS} failed:\n{result.stderr or result.stdout}")
    return tls_dir
