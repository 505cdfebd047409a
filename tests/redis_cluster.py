"""A real Redis Cluster on loopback for tests: three primaries, one replica each.

`LocalRedisCluster` starts six `redis-server` processes in cluster mode in a temporary
directory, joins them with `redis-cli --cluster create`, and stops every one of them on
`stop()` (the fixture that owns it calls that in its finalizer). Ports are free ports
whose cluster-bus port (port + 10000) is free too.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

PRIMARIES = 3
NODE_TIMEOUT_MS = 1000
"""How long a silent primary goes before its replica is promoted (cluster-node-timeout)."""


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_ports(count: int) -> list[int]:
    """`count` free loopback ports below 55536 whose bus ports (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < 55536 and port not in ports and _port_free(port + 10000):
            ports.append(port)
    return ports


@dataclass
class LocalRedisCluster:
    """Six cluster-mode `redis-server`s under `workdir` (see the module docstring)."""

    workdir: Path
    ports: list[int] = field(default_factory=list)
    processes: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """The `redis+cluster://` URL naming every node as a start-up node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self) -> LocalRedisCluster:
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is required for the Redis Cluster tests")
        self.ports = free_cluster_ports(PRIMARIES * 2)
        try:
            for port in self.ports:
                self._start_node(port)
            for port in self.ports:
                self._wait_ping(port)
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{port}" for port in self.ports),
                    "--cluster-replicas",
                    "1",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, port: int) -> None:
        node_dir = self.workdir / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(node_dir),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--appendonly",
                "no",
                "--save",
                "",
                "--logfile",
                str(node_dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _wait_ping(self, port: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with contextlib.closing(redis.Redis(port=port, socket_timeout=1)) as client:
                    client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (close it after use)."""
        return redis.Redis(port=port, socket_timeout=5, decode_responses=True)

    def _nodes(self, port: int) -> list[dict[str, str]]:
        with contextlib.closing(self.node(port)) as client:
            raw = client.execute_command("CLUSTER", "NODES")
        text = raw if isinstance(raw, str) else "\n".join(raw)
        nodes = []
        for line in text.strip().splitlines():
            parts = line.split()
            nodes.append(
                {
                    "id": parts[0],
                    "port": parts[1].split("@")[0].rsplit(":", 1)[1],
                    "flags": parts[2],
                    "primary": parts[3],
                    "link": parts[7],
                }
            )
        return nodes

    def primaries(self) -> list[int]:
        """Ports of the primaries now, as a live node sees them."""
        for port in self.ports:
            if self.processes[port].poll() is None:
                return sorted(
                    int(n["port"])
                    for n in self._nodes(port)
                    if "master" in n["flags"] and "fail" not in n["flags"]
                )
        raise RuntimeError("no Redis Cluster node is running")

    def replica_of(self, primary_port: int, timeout_s: float = 30.0) -> int:
        """The port of a node that replicates the primary at `primary_port` by its own
        account (what CLUSTER FAILOVER, sent to it, goes by), its replication link up
        (a replica still syncing cannot take over). Right after a failover the old
        primary has yet to take up its new role and sync, so this waits for one; it
        raises TimeoutError, never StopIteration, which raised through
        `asyncio.to_thread` would leave the awaiting test hanging."""
        primary_id = self._own_line(primary_port)["id"]
        deadline = time.monotonic() + timeout_s
        while True:
            for port, process in self.processes.items():
                if port == primary_port or process.poll() is not None:
                    continue
                with contextlib.suppress(redis.RedisError):
                    own = self._own_line(port)
                    if (
                        "slave" in own["flags"]
                        and own["primary"] == primary_id
                        and self._synced(port)
                    ):
                        return port
            if time.monotonic() > deadline:
                raise TimeoutError(f"no node replicates primary {primary_port}")
            time.sleep(0.05)

    def _replicated(self, primary_port: int, timeout_s: float) -> None:
        """Until every replica of the primary at `primary_port` has acknowledged the
        primary's replication offset as of this call."""
        with contextlib.closing(self.node(primary_port)) as client:
            target = int(client.info("replication")["master_repl_offset"])
            deadline = time.monotonic() + timeout_s
            while True:
                replication = client.info("replication")
                offsets = [
                    int(value["offset"])
                    for key, value in replication.items()
                    if key.startswith("slave") and isinstance(value, dict)
                ]
                if offsets and min(offsets) >= target:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the replicas of {primary_port} did not catch up")
                time.sleep(0.02)

    def _synced(self, port: int) -> bool:
        """Whether the node at `port` is a primary, or a replica that has synced with its
        primary and follows it (one still syncing cannot take over)."""
        with contextlib.closing(self.node(port)) as client:
            replication = client.info("replication")
        return replication["role"] == "master" or replication["master_link_status"] == "up"

    def _own_line(self, port: int) -> dict[str, str]:
        """The node at `port` as it describes itself in CLUSTER NODES."""
        for node in self._nodes(port):
            if "myself" in node["flags"]:
                return node
        raise RuntimeError(f"node {port} does not describe itself in CLUSTER NODES")

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every running node reports the cluster `ok` with three primaries, and
        every running replica has synced with its primary (a replica that never synced
        cannot take over)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                running = [port for port, proc in self.processes.items() if proc.poll() is None]
                healthy = all(self._state_ok(port) for port in running)
                healthy = healthy and len(self.primaries()) == PRIMARIES
            except redis.RedisError:
                healthy = False
            if healthy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not become healthy")
            time.sleep(0.1)

    def _state_ok(self, port: int) -> bool:
        with contextlib.closing(self.node(port)) as client:
            info = client.execute_command("CLUSTER", "INFO")
        return "cluster_state:ok" in info and self._synced(port)

    def fail_over(self, primary_port: int, timeout_s: float = 30.0) -> int:
        """Promotes a replica of `primary_port` with CLUSTER FAILOVER (it first catches up
        with every write the primary acknowledged); returns the new primary's port. A
        manual failover the primary does not answer in time lapses (Redis gives it 5 s),
        so it is asked for again until `timeout_s`."""
        replica = self.replica_of(primary_port, timeout_s)
        deadline = time.monotonic() + timeout_s
        while replica not in self.primaries():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica} was not promoted")
            # Refused only when it has just become a primary, which the loop then sees.
            with (
                contextlib.closing(self.node(replica)) as client,
                contextlib.suppress(redis.ResponseError),
            ):
                client.execute_command("CLUSTER", "FAILOVER")
            asked_s = time.monotonic()
            while replica not in self.primaries() and time.monotonic() - asked_s < 6.0:
                time.sleep(0.05)
        self.wait_healthy(timeout_s)
        return replica

    def kill(self, primary_port: int, timeout_s: float = 60.0) -> None:
        """SIGKILLs the primary at `primary_port` and waits until the cluster has
        promoted its replica (after cluster-node-timeout) and is healthy again.

        Replication is asynchronous: a replica lags its primary, by seconds on a loaded
        machine, and what it has not received when its primary dies is lost. The kill
        waits until the replicas hold every write the primary had taken when it was
        asked for, so a test sees what a failover does to what was replicated, not how
        far replication lagged."""
        self._replicated(primary_port, timeout_s)
        process = self.processes[primary_port]
        process.kill()
        process.wait()
        deadline = time.monotonic() + timeout_s
        while primary_port in self.primaries():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica took over from {primary_port}")
            time.sleep(0.05)
        self.wait_healthy(timeout_s)

    def stop(self) -> None:
        """Stops every node this cluster started (and waits for each)."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
