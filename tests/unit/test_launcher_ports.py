"""Free ports for a throwaway cluster: distinct, bindable, and outside the kernel's
ephemeral range, where outgoing connections would take them before a service binds."""

from __future__ import annotations

import socket

from kvrs.cli.launcher.ports import _ephemeral_start, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(port < _ephemeral_start() for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_ports(1)[0]))
        held.listen()
        taken = held.getsockname()[1]
        assert all(taken not in free_ports(64) for _ in range(20))
