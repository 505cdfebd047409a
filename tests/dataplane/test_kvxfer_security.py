"""libkvxfer's doors: the store listens on the configured host only, and a peer that cannot
prove the ticket's key is refused before any KV lands."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
from kvxfer_peers import KvSpec, Peer, PeerError, expected_digest, make_kv, transfer

from libkvxfer import AgentConfig, AuthenticationFailed, KvLayout, TransferAgent, _protocol

RESULT_TIMEOUT_S = 60
_LISTEN = "0A"


def _listening_sockets() -> set[tuple[str, int]]:
    """(local address, port) of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if fields[3] != _LISTEN or fields[9] not in inodes:
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def test_the_store_and_the_pair_sockets_listen_on_the_configured_host_only():
    before = _listening_sockets()
    receiver = TransferAgent(AgentConfig("bind-recv", host="127.0.0.1", timeout_s=10))
    sender = TransferAgent(AgentConfig("bind-send", host="127.0.0.1", timeout_s=10))
    try:
        ticket = receiver.prepare("bind-send", "req-bind", 0, 8)
        thread = threading.Thread(
            target=sender.send, args=(ticket, make_kv(KvSpec(seed=1, tokens=8)))
        )
        thread.start()
        receiver.recv(ticket, KvLayout(3, 2, 16, torch.float64))
        thread.join(timeout=RESULT_TIMEOUT_S)
        opened = _listening_sockets() - before
    finally:
        receiver.close()
        sender.close()
    port = int(receiver.address.rpartition(":")[2])
    assert ("127.0.0.1", port) in opened
    assert {address for address, _ in opened} == {"127.0.0.1"}, opened


def test_a_rogue_on_the_receivers_store_cannot_inject_kv_and_changes_nothing():
    """A rogue process that knows every field of a ticket but its key (the key travels only
    over the control plane) connects to the receiver's store under the sender's name, joins
    the pair and pushes its own KV: refused at the header, the destination untouched."""
    receiver = Peer("sec-recv")
    sender = Peer("sec-send")
    rogue = Peer("sec-send", wire="forged-key")
    try:
        for peer in (receiver, sender, rogue):
            peer.ready()
        spec = KvSpec(seed=21, tokens=48)
        ticket = receiver.prepare(sender, "req-victim", 0, 48)
        received = receiver.call("recv_into", ticket, spec, 77)
        injected = rogue.call("send", ticket, KvSpec(seed=666, tokens=48), None, 0)
        got = received.result(RESULT_TIMEOUT_S)
        assert got["error"][:2] == ("AuthenticationFailed", "UNAUTHENTICATED"), got["error"]
        assert got["digest"] == expected_digest(KvSpec(seed=77, tokens=48), 0, 48)
        with pytest.raises(PeerError) as info:
            injected.result(RESULT_TIMEOUT_S)
        assert info.value.code == "UNAVAILABLE"
        # The sender the ticket names still moves its KV: a new ticket, a new pair.
        _, received = transfer(sender, receiver, spec, "req-after-rogue")
        assert received.result(RESULT_TIMEOUT_S)["digest"] == expected_digest(spec, 0, 48)
    finally:
        for peer in (receiver, sender, rogue):
            peer.stop()


def test_a_trailer_whose_checksums_were_altered_fails_its_signature():
    key = os.urandom(32)
    header_mac = os.urandom(_protocol.MAC_BYTES)
    trailer = bytearray(_protocol.encode_trailer(key, header_mac, [1, 2, 3, 4]))
    assert _protocol.decode_trailer(key, header_mac, bytes(trailer), 2) == [1, 2, 3, 4]
    trailer[0] ^= 1
    with pytest.raises(AuthenticationFailed):
        _protocol.decode_trailer(key, header_mac, bytes(trailer), 2)


def test_a_header_signed_for_another_ticket_is_refused():
    key = os.urandom(32)
    signed = _protocol.encode_header(key, b"ticket-a", b"{}")
    assert _protocol.decode_header(key, b"ticket-a", signed, 2) == b"{}"
    with pytest.raises(AuthenticationFailed):
        _protocol.decode_header(key, b"ticket-b", signed, 2)
    with pytest.raises(AuthenticationFailed):
        _protocol.decode_header(os.urandom(32), b"ticket-a", signed, 2)


def test_a_tickets_key_is_never_in_its_repr():
    agent = TransferAgent(AgentConfig("repr", timeout_s=5))
    try:
        ticket = agent.prepare("someone", "req-repr", 0, 4)
    finally:
        agent.close()
    assert len(ticket.auth_key) == _protocol.AUTH_KEY_BYTES
    assert ticket.auth_key.hex() not in repr(ticket)
    assert "auth_key" not in repr(ticket)
