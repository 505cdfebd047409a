"""The state file: what `kvrs up` started, read back by `kvrs down` and `kvrs status`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvrs.cli.launcher.errors import ClusterError
from kvrs.cli.launcher.services import peer_env, tls_env

STATE_FILE = "cluster.json"


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
    metrics_addr: str = ""
    """host:port of its Prometheus endpoint (`/metrics`); empty = it serves none."""


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
