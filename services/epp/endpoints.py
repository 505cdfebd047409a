"""The endpoints a gateway may route to, and the kvrs decode instance behind each one.

Envoy names an upstream by `ip:port`; kvrs names it by instance id. The directory
builds the map from gossip's list of alive instances: a decode instance registered at
`host:port` is the endpoint `ip(host):port` (or `ip(host):target_port` when the gateway
reaches the instances on another port than the one they registered, as an
InferencePool's target port does), or the address `endpoints` names for it, when
another process serves the instance's HTTP (an OpenAI adapter pinned to it). Host
names are resolved, because Envoy's original-destination cluster only accepts IP
addresses. The map is reused for
`refresh_s`; when gossip cannot be reached the last map keeps serving.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvrs.errors import KvrsError, Unavailable
from kvrs.prefill import PrefillOption, rank_prefills
from kvrs.profile import ComputeProfile
from kvrs.v1 import common_pb2, gossip_pb2

log = logging.getLogger(__name__)


class NodeSource(Protocol):
    """Where the directory reads instances from (`kvrs.client.KvrsClient` is one)."""

    async def list_nodes(
        self, role: str = "", *, include_down: bool = False, timeout_s: float | None = None
    ) -> gossip_pb2.ListNodesResponse: ...


@dataclass(frozen=True)
class PrefillInstance:
    instance_id: str
    queued_work_s: float
    queue_depth: int
    resident_prefix_hashes: frozenset[int] = frozenset()
    endpoint: str = ""
    """`ip:port` where the gateway's side (llm-d's P/D sidecar) reaches it; "" when its
    address does not resolve."""


@dataclass(frozen=True)
class PrefillChoice:
    """Where the prefill rule would prefill a prompt, and every alive prefill instance
    as an option for a policy that chooses prefill and decode together."""

    instance_id: str
    options: tuple[PrefillOption, ...]


@dataclass(frozen=True)
class Endpoints:
    """One view of the cluster as the gateway addresses it."""

    instance_by_endpoint: Mapping[str, str]
    """`ip:port` -> decode instance id."""
    endpoint_by_instance: Mapping[str, str]
    """Decode instance id -> `ip:port`."""
    prefill: tuple[PrefillInstance, ...]
    """Alive prefill instances, in id order."""
    fetched_at_s: float

    def choose_prefill(
        self,
        prompt_tokens: int,
        prefix_hashes: Sequence[int],
        block_tokens: int,
        profile: ComputeProfile,
    ) -> PrefillChoice | None:
        """The prefill instance the router would choose (`kvrs.prefill`: queued work plus
        the prefill of the tokens it does not hold), with every one's predicted finish;
        None when there is none."""
        if not self.prefill:
            return None
        ranking = rank_prefills(
            [instance.queued_work_s for instance in self.prefill],
            [instance.queue_depth for instance in self.prefill],
            [instance.resident_prefix_hashes for instance in self.prefill],
            max(1, prompt_tokens),
            prefix_hashes,
            block_tokens,
            profile,
        )
        return PrefillChoice(
            self.prefill[ranking.best].instance_id,
            ranking.options([instance.instance_id for instance in self.prefill]),
        )

    def prefill_endpoint(self, instance_id: str) -> str:
        """`ip:port` of a prefill instance; "" when unknown or unresolved."""
        return next((p.endpoint for p in self.prefill if p.instance_id == instance_id), "")


def format_endpoint(ip: str, port: int) -> str:
    """`ip:port`, with brackets around an IPv6 address."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6]:port`; ValueError when it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return host.strip("[]"), int(port)


async def _resolve(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return str(infos[0][4][0])


class EndpointDirectory:
    """The endpoint <-> decode instance map, fetched from gossip at most every `refresh_s`."""

    def __init__(
        self,
        source: NodeSource,
        *,
        refresh_s: float,
        target_port: int = 0,
        endpoints: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill_target_port: int = 0,
    ) -> None:
        self._source = source
        self.refresh_s = refresh_s
        self.target_port = target_port
        self.endpoints = dict(endpoints or {})
        """Decode instance id -> host:port the gateway reaches it at; when set, instances
        it does not name are not routed to. A prefill instance it names is reached there
        too."""
        self.prefill_target_port = prefill_target_port
        """The port prefill instances are reached at on their hosts; 0 = the registered one."""
        self._timeout_s = timeout_s
        self._clock = clock
        self._current: Endpoints | None = None
        self._next_fetch_s = 0.0
        self._lock = asyncio.Lock()

    async def current(self) -> Endpoints:
        """The map, fetched again when older than `refresh_s`; Unavailable before the
        first successful fetch."""
        if self._current is not None and self._clock() < self._next_fetch_s:
            return self._current
        async with self._lock:
            if self._current is None or self._clock() >= self._next_fetch_s:
                await self._refresh()
        assert self._current is not None
        return self._current

    async def _refresh(self) -> None:
        # Failures wait out a refresh period too, so a gossip outage is not hammered
        # once per request.
        self._next_fetch_s = self._clock() + self.refresh_s
        try:
            reply = await self._source.list_nodes(timeout_s=self._timeout_s)
            self._current = await self._build(reply.nodes)
        except (KvrsError, OSError) as exc:
            if self._current is None:
                raise Unavailable(f"no endpoint list from gossip yet: {exc}") from exc
            log.warning(
                "gossip did not answer (%s); routing with the map from %.1f s ago",
                exc,
                self._clock() - self._current.fetched_at_s,
            )

    async def _prefill_endpoint(self, node: gossip_pb2.NodeInfo) -> str:
        """`ip:port` of a prefill instance (its `endpoints` entry, else its registered
        host at `prefill_target_port` or its own port); "" when that does not resolve."""
        named = node.instance_id in self.endpoints
        try:
            host, port = split_address(self.endpoints.get(node.instance_id, node.address))
            ip = await _resolve(host)
        except (ValueError, OSError) as exc:
            log.warning("prefill instance %s has no usable address: %s", node.instance_id, exc)
            return ""
        return format_endpoint(ip, port if named else self.prefill_target_port or port)

    async def _build(self, nodes: Sequence[gossip_pb2.NodeInfo]) -> Endpoints:
        alive = [node for node in nodes if node.state == gossip_pb2.NODE_STATE_ALIVE]
        decode = [node for node in alive if node.role == common_pb2.ROLE_DECODE]
        hosts: list[tuple[str, str, int]] = []
        for node in decode:
            if self.endpoints and node.instance_id not in self.endpoints:
                continue
            address = self.endpoints.get(node.instance_id, node.address)
            try:
                host, port = split_address(address)
            except ValueError:
                log.warning(
                    "decode instance %s has an unusable address %r", node.instance_id, address
                )
                continue
            if not self.endpoints:
                port = self.target_port or port
            hosts.append((node.instance_id, host, port))
        ips = await asyncio.gather(
            *(_resolve(host) for _, host, _ in hosts), return_exceptions=True
        )
        by_endpoint: dict[str, str] = {}
        by_instance: dict[str, str] = {}
        for (instance_id, host, port), ip in zip(hosts, ips, strict=True):
            if isinstance(ip, BaseException):
                log.warning("cannot resolve %s of decode instance %s: %s", host, instance_id, ip)
                continue
            endpoint = format_endpoint(ip, port)
            if endpoint in by_endpoint:
                log.warning(
                    "decode instances %s and %s are both reached at %s; routing to %s",
                    by_endpoint[endpoint],
                    instance_id,
                    endpoint,
                    by_endpoint[endpoint],
                )
                continue
            by_endpoint[endpoint] = instance_id
            by_instance[instance_id] = endpoint
        prefill_nodes = sorted(
            (node for node in alive if node.role == common_pb2.ROLE_PREFILL),
            key=lambda node: node.instance_id,
        )
        prefill_endpoints = await asyncio.gather(
            *(self._prefill_endpoint(node) for node in prefill_nodes)
        )
        prefill = [
            PrefillInstance(
                node.instance_id,
                node.queued_work_s,
                node.queue_depth,
                frozenset(node.resident_prefix_hashes),
                endpoint,
            )
            for node, endpoint in zip(prefill_nodes, prefill_endpoints, strict=True)
        ]
        return Endpoints(
            instance_by_endpoint=by_endpoint,
            endpoint_by_instance=by_instance,
            prefill=tuple(prefill),
            fetched_at_s=self._clock(),
        )
