"""Ports: free ones for a throwaway cluster, or the standard layout shifted to a base."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvrs.cli.launcher.errors import ClusterError
from kvrs.cli.launcher.services import ServiceSpec


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
