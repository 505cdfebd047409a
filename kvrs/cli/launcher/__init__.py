"""Local cluster launcher (`kvrs up` / `kvrs down`): the compose topology as background
processes, without Docker.

One module per job:

    services.py      the service table (one row a process) and each process' environment
    state.py         the state file `kvrs down` and `kvrs status` read back
    processes.py     start a process in its own session, tell whether it runs, stop a group
    ports.py         free ports, or the standard layout shifted to a base port
    redis_server.py  find a redis-server binary and run a private Redis
    readiness.py     SERVING on the gRPC health service, or 200 from an HTTP health path
    lifecycle.py     start every service stage by stage; stop them all

Redis: `REDIS_URL` when given; otherwise a private `redis-server` on a free port.
"""

from kvrs.cli.launcher.errors import ClusterError
from kvrs.cli.launcher.lifecycle import start_cluster, stop_cluster
from kvrs.cli.launcher.ports import STANDARD_BASE_PORT, free_ports, layout_ports
from kvrs.cli.launcher.processes import LOG_TAIL_LINES, is_running, log_tail, spawn, stop_processes
from kvrs.cli.launcher.prometheus import SCRAPE_CONFIG_FILE, job_name, scrape_config
from kvrs.cli.launcher.readiness import SERVING, probe_health, wait_serving
from kvrs.cli.launcher.redis_server import find_redis_server, start_private_redis
from kvrs.cli.launcher.services import (
    ADAPTER_PREFIX,
    DEFAULT_RUN_DIR,
    DEFAULT_TOPOLOGY_FILE,
    ENVOY_SERVICES,
    PEER_ADDR_ENV,
    REPO_ROOT,
    SERVICES,
    ClusterOptions,
    Host,
    ServiceSpec,
    Wiring,
    command_line,
    common_env,
    generate_certs,
    has_main,
    peer_env,
    tls_env,
)
from kvrs.cli.launcher.state import STATE_FILE, ClusterState, ProcessRecord

__all__ = [
    "ADAPTER_PREFIX",
    "ClusterError",
    "ClusterOptions",
    "ClusterState",
    "DEFAULT_RUN_DIR",
    "DEFAULT_TOPOLOGY_FILE",
    "ENVOY_SERVICES",
    "Host",
    "LOG_TAIL_LINES",
    "PEER_ADDR_ENV",
    "ProcessRecord",
    "REPO_ROOT",
    "SCRAPE_CONFIG_FILE",
    "SERVICES",
    "SERVING",
    "STANDARD_BASE_PORT",
    "STATE_FILE",
    "ServiceSpec",
    "Wiring",
    "command_line",
    "common_env",
    "find_redis_server",
    "free_ports",
    "generate_certs",
    "has_main",
    "is_running",
    "job_name",
    "layout_ports",
    "log_tail",
    "peer_env",
    "probe_health",
    "scrape_config",
    "spawn",
    "start_cluster",
    "start_private_redis",
    "stop_cluster",
    "stop_processes",
    "tls_env",
    "wait_serving",
]
