"""The control plane for reliability tests: real servers on a background event loop.

Property tests drive the servers through synchronous gRPC stubs (what Hypothesis runs
best), so the servers live on an event loop of their own in a daemon thread; the helpers
here start them once per module, register a small cluster and check the promises every
test shares (status codes, named fields, no NaN, still serving).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.cli.launcher.ports import free_ports
from services.common import setup_tracing
from services.common.decision_inputs import InputsConfig
from services.common.gossip_records import Registration
from services.cost_oracle.config import Config as OracleConfig
from services.cost_oracle.server import build_server as build_oracle
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.prober.config import Config as ProberConfig
from services.prober.server import build_server as build_prober
from services.scheduler.config import Config as SchedulerConfig
from services.scheduler.server import build_server as build_scheduler
from services.slot_broker.config import Config as BrokerConfig
from services.slot_broker.server import build_server as build_broker

MODEL = "opt-125m"
REPO_ROOT = Path(__file__).resolve().parents[2]

CLEAN_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
"""What a bad input may earn: never INTERNAL or UNKNOWN (a bug), nor UNAVAILABLE (a
server that cannot tell a bad request from a broken dependency)."""

# (instance id, role, node, rack, pod)
CLUSTER = (
    ("prefill-0", "prefill", "n0", "r0", "p0"),
    ("prefill-1", "prefill", "n2", "r1", "p0"),
    ("decode-0", "decode", "n0", "r0", "p0"),
    ("decode-1", "decode", "n1", "r0", "p0"),
    ("decode-2", "decode", "n9", "r9", "p9"),
)
KNOWN_IDS = tuple(row[0] for row in CLUSTER)


class LoopThread:
    """An asyncio event loop in a daemon thread; `run` executes a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        """Cancels what the servers left behind (abandoned Redis reads), then stops."""

        async def cancel_leftovers() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_leftovers())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def unique_prefix(tag: str) -> str:
    return f"{{kvrs-rel-{tag}-{uuid.uuid4().hex[:10]}}}:"


def delete_prefix(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class ControlPlane:
    """Gossip, slot broker, cost oracle and scheduler on one loop, over one Redis prefix."""

    redis_url: str
    prefix: str
    host: str = "127.0.0.1"
    """Where every server binds (a bridge address when workers run in namespaces)."""
    model: str = MODEL
    gossip_confirm_ttls: float = 2.0
    """Gossip's confirmation window (GOSSIP_CONFIRM_TTLS); 0 = a missed TTL fails at once."""
    loop: LoopThread = field(default_factory=LoopThread)
    addresses: dict[str, str] = field(default_factory=dict)
    handles: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.provider = setup_tracing("kvrs-reliability", exporter=InMemorySpanExporter())

    def start(
        self,
        services: tuple[str, ...] = ("gossip", "slot-broker", "cost-oracle", "scheduler"),
        cluster: tuple = CLUSTER,
        **scheduler_overrides: Any,
    ) -> ControlPlane:
        self.loop.run(self._start(services, cluster, scheduler_overrides), timeout_s=60)
        return self

    async def _start(self, services, cluster, scheduler_overrides) -> None:
        redis_settings = {"redis_url": self.redis_url, "redis_prefix": self.prefix}
        listen = f"{self.host}:0"
        gossip = await build_gossip(
            GossipConfig(
                listen_addr=listen,
                heartbeat_ttl_s=600.0,
                confirm_ttls=self.gossip_confirm_ttls,
                **redis_settings,
            ),
            self.provider,
        )
        self._add("gossip", gossip)
        if "slot-broker" in services:
            broker = await build_broker(
                BrokerConfig(listen_addr=listen, cluster_cap=4, lease_ttl_s=30.0, **redis_settings),
                self.provider,
            )
            self._add("slot-broker", broker)
        async with GossipClient(self.addresses["gossip"], timeout_s=5) as client:
            for instance_id, role, node, rack, pod in cluster:
                await client.register(
                    Registration(
                        instance_id=instance_id,
                        role=role,
                        address=f"{instance_id}:50060",
                        node=node,
                        rack=rack,
                        pod=pod,
                        transfer_address=f"{instance_id}:29500",
                        heartbeat_ttl_s=3600.0,
                    )
                )
        if "cost-oracle" in services:
            oracle = await build_oracle(
                OracleConfig(
                    listen_addr=listen,
                    gossip_addr=self.addresses["gossip"],
                    refresh_s=0.2,
                    inputs=InputsConfig(model=self.model),
                ),
                self.provider,
            )
            self._add("cost-oracle", oracle)
        if "scheduler" in services:
            settings = {
                "listen_addr": listen,
                "gossip_addr": self.addresses["gossip"],
                "slot_broker_addr": self.addresses.get("slot-broker", "127.0.0.1:1"),
                "view_refresh_s": 0.1,
                "holder_id": "reliability-scheduler",
                "inputs": InputsConfig(model=self.model),
                **redis_settings,
                **scheduler_overrides,
            }
            self._add(
                "scheduler", await build_scheduler(SchedulerConfig(**settings), self.provider)
            )
        if "prober" in services:
            prober = await build_prober(
                ProberConfig(
                    listen_addr=listen,
                    gossip_addr=self.addresses["gossip"],
                    worker_timeout_s=2.0,
                    refresh_s=0.2,
                    payload_tokens=256,
                ),
                self.provider,
                probe_forever=False,
            )
            self._add("prober", prober)

    def _add(self, name: str, handle: Any) -> None:
        self.handles[name] = handle
        self.addresses[name] = f"{self.host}:{handle.port}"

    def channel(self, name: str) -> grpc.Channel:
        return grpc.insecure_channel(self.addresses[name])

    def stop(self) -> None:
        async def stop_all() -> None:
            for handle in reversed(list(self.handles.values())):
                await handle.stop(0)

        try:
            self.loop.run(stop_all())
        finally:
            self.loop.close()
            delete_prefix(self.redis_url, self.prefix)


# -- the promises every property shares ------------------------------------------------


_PART = r"[a-z_][a-z0-9_]*(?:\[\d+\])?"
_FIELD_PATH = re.compile(rf"^(?P<path>{_PART}(?:\.{_PART})*):")


def field_path(details: str) -> str | None:
    """The field an error message names ("items[2].request_id: ..." -> that path)."""
    match = _FIELD_PATH.match(details or "")
    return match.group("path") if match else None


def names_a_field_of(request: Message, path: str) -> bool:
    """Whether `path` ("a", "a[1]", "a.b") resolves to fields of `request`'s type."""
    descriptor = request.DESCRIPTOR
    for part in path.split("."):
        name = part.split("[", 1)[0]
        found = descriptor.fields_by_name.get(name)
        if found is None:
            return False
        descriptor = found.message_type if found.message_type is not None else descriptor
    return True


def check_rejection(exc: grpc.RpcError, request: Message) -> None:
    """A refused request got a clean code and, for INVALID_ARGUMENT, names its field."""
    code, details = exc.code(), exc.details() or ""
    assert code in CLEAN_CODES, f"{code.name}: {details!r} for {_short(request)}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        path = field_path(details)
        assert path is not None, f"INVALID_ARGUMENT names no field: {details!r}"
        assert names_a_field_of(request, path), (
            f"INVALID_ARGUMENT names {path!r}, not a field of "
            f"{request.DESCRIPTOR.name}: {details!r}"
        )
    assert details, f"{code.name} without a message"


def finite_or_documented(message: Message, allow_inf: frozenset[str] = frozenset()) -> None:
    """No NaN anywhere in a reply, and +-inf only in fields documented to carry it (and in
    the bandwidth of a transfer that crosses no link: src == dst)."""
    allowed = allow_inf
    if message.DESCRIPTOR.name == "TransferEstimate" and (
        message.src_instance_id == message.dst_instance_id
    ):
        allowed = allow_inf | {"bottleneck_bandwidth_bps"}
    for descriptor, value in message.ListFields():
        values = value if descriptor.is_repeated else [value]
        for item in values:
            if isinstance(item, Message):
                finite_or_documented(item, allow_inf)
            elif isinstance(item, float):
                assert not math.isnan(item), f"{descriptor.name} is NaN in {_short(message)}"
                if math.isinf(item):
                    assert descriptor.name in allowed, (
                        f"{descriptor.name} is {item} in {_short(message)}"
                    )


def call(method, request: Message, allow_inf: frozenset[str] = frozenset()) -> Message | None:
    """Calls; on success checks the reply, on failure checks the rejection. Returns the reply."""
    try:
        reply = method(request, timeout=10)
    except grpc.RpcError as exc:
        check_rejection(exc, request)
        return None
    finite_or_documented(reply, allow_inf)
    return reply


def assert_serving(channel: grpc.Channel, service: str = "") -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _short(message: Message, limit: int = 300) -> str:
    text = f"{type(message).__name__}({str(message).strip()!s})".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


# -- a private Redis ---------------------------------------------------------------------


class PrivateRedis:
    """A redis-server of this test alone on a fixed port, to kill and restart at will."""

    def __init__(self, data_dir: Path, port: int | None = None, appendonly: bool = True) -> None:
        self.port = port or free_port()
        self.data_dir = data_dir
        self.appendonly = appendonly
        self.process: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.exceptions.BusyLoadingError:
                    pass
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on {self.port}") from None
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown save, clients see the socket drop."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self.process = None


# -- services as real processes -------------------------------------------------------------


class ServiceProcess:
    """`python -m <module>` in its own session, logging to a file, killable like a crash."""

    def __init__(
        self,
        name: str,
        module: str,
        env: dict[str, str],
        log_dir: Path,
        args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
    ) -> None:
        """`prefix` runs the interpreter under another command (`ip netns exec NS`)."""
        self.name = name
        self.module = module
        self.env = env
        self.args = args
        self.prefix = prefix
        self.log_file = log_dir / f"{name}.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> ServiceProcess:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.process = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", self.module, *self.args],
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=REPO_ROOT,
            )
        return self

    def wait_serving(self, address: str, timeout_s: float = 60.0) -> float:
        """Seconds until the health service says SERVING; fails quoting the log."""
        started_s = time.monotonic()
        channel = grpc.insecure_channel(address)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            while True:
                assert self.process is not None and self.process.poll() is None, (
                    f"{self.name} exited: {self.log_tail()}"
                )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - started_s
                except grpc.RpcError:
                    pass
                assert time.monotonic() - started_s < timeout_s, (
                    f"{self.name} not SERVING after {timeout_s} s: {self.log_tail()}"
                )
                time.sleep(0.1)
        finally:
            channel.close()

    def kill(self) -> None:
        """SIGKILL to the process group: no drain, no cleanup, sockets just close."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def rss_bytes(self) -> int:
        """Resident set of the process (0 once it is gone)."""
        if self.process is None:
            return 0
        try:
            fields = Path(f"/proc/{self.process.pid}/statm").read_text().split()
        except OSError:
            return 0
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
