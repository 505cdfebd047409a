"""Ports: free ones for a throwaway cluster, or the standard layout shifted to a base."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence

from kvrs.cli.launcher.errors import ClusterError
from kvrs.cli.launcher.services import ServiceSpec

_LISTEN_PORTS_FROM = 20000
"""Free ports are drawn from here up to the kernel's ephemeral range."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports nothing listens on right now (held open together while chosen).

    Drawn below the kernel's ephemeral range: a port handed out by binding port 0 lies in
    that range, where every outgoing connection also takes its local port, so between
    choosing it and the service binding it a client socket may take it (address in use).
    """
    low, high = _LISTEN_PORTS_FROM, _ephemeral_start() - 1
    candidates = list(range(low, high + 1)) if high > low else []
    random.Random().shuffle(candidates)
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            if len(sockets) == count:
                break
            sock = socket.socket()
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < count:  # no range below the ephemeral one: the kernel's choice
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
