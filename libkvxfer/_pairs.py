"""Pairwise gloo process groups: one per (receiver, sender), built and torn down at will.

There is no global `init_process_group`: each pair gets its own two-rank
`ProcessGroupGloo` over the receiver's `TCPStore`, under a `PrefixStore` named after the
sender and a generation number. A dead or misbehaving peer therefore breaks only its
pair; the receiver opens a new generation for the next transfer, and the sender, which
claims a generation in the store before joining it, can never join a generation that an
earlier incarnation of itself already used.

Gloo closes a pair whenever one of its operations times out; `PairGroup.close` relies on
that to drop the connection deterministically, which fails the peer's pending
operations at once instead of after their own timeouts.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store, TCPStore

from libkvxfer._errors import KvXferError, PeerLost, TransferTimeout, from_torch_error

log = logging.getLogger(__name__)

RECEIVER_RANK = 0
SENDER_RANK = 1
CLOSE_TAG = 0
"""Reserved: never used by a transfer, so a receive on it can only time out."""
_CLAIM_POLL_S = 0.005


# torch's type stubs leave out ProcessGroupGloo's `_Options`, `send` and `recv`, which it
# has at run time (the ignores below are for that alone).
def _gloo_options(host: str, timeout_s: float) -> ProcessGroupGloo._Options:  # type: ignore[name-defined]
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    # An explicit device avoids resolving the machine's hostname (slow, and possibly
    # not the interface the peer can reach).
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return options


def group_prefix(sender_id: str, generation: int) -> str:
    return f"kvxfer/{sender_id}/{generation}"


class PairGroup:
    """A live two-rank gloo group and the operations a transfer needs on it."""

    def __init__(
        self, group: ProcessGroupGloo, peer_rank: int, name: str, timeout_s: float
    ) -> None:
        self._group = group
        self._peer_rank = peer_rank
        self.name = name
        self.timeout_s = timeout_s
        self.broken = False
        self._lock = threading.Lock()

    def send(self, data: torch.Tensor, tag: int):
        try:
            return self._group.send([data], self._peer_rank, tag)  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise self.fail(exc, "send") from exc

    def recv(self, data: torch.Tensor, tag: int):
        try:
            return self._group.recv([data], self._peer_rank, tag)  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise self.fail(exc, "recv") from exc

    def wait(self, work, what: str) -> None:
        """Wait for one operation; any failure breaks the pair and is mapped."""
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise self.fail(exc, what) from exc

    def fail(self, exc: BaseException, what: str) -> KvXferError:
        error = from_torch_error(exc, f"{self.name}: {what}")
        self.close()
        return error

    def close(self) -> None:
        """Break the pair for good; the peer's pending operations fail at once."""
        with self._lock:
            if self.broken:
                return
            self.broken = True
        probe = torch.empty(1, dtype=torch.uint8)
        try:
            self._group.recv([probe], self._peer_rank, CLOSE_TAG).wait(  # type: ignore[attr-defined]
                datetime.timedelta(milliseconds=1)
            )
        except RuntimeError:
            # Expected: the timeout (or an already dead pair) is what closes the sockets.
            log.debug("pair %s closed", self.name)


@dataclass
class _Slot:
    """One pair's current generation and its group (built once, by whoever needs it first)."""

    generation: int
    group: Future = field(default_factory=Future)
    building: bool = False


class InboundPairs:
    """The receiver's pairs, one per sender, rendezvousing on the receiver's own store."""

    def __init__(self, store: TCPStore, host: str, timeout_s: float) -> None:
        self._store = store
        self._host = host
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._next_generation = 1

    def generation_for(self, sender_id: str) -> int:
        """The generation a new ticket uses: the current one unless it broke."""
        with self._lock:
            slot = self._slots.get(sender_id)
            if slot is None or self._is_broken(slot):
                slot = _Slot(generation=self._next_generation)
                self._next_generation += 1
                self._slots[sender_id] = slot
            return slot.generation

    @staticmethod
    def _is_broken(slot: _Slot) -> bool:
        if not slot.group.done():
            return False
        return slot.group.exception() is not None or slot.group.result().broken

    def group(self, sender_id: str, generation: int, cancelled: Callable[[], bool]) -> PairGroup:
        """The pair group of a ticket, built (blocking) when this is its first transfer."""
        with self._lock:
            slot = self._slots.get(sender_id)
            if slot is None or slot.generation != generation:
                raise PeerLost(f"pair {sender_id}/{generation} was replaced; ask again")
            build = not slot.building
            slot.building = True
        if build:
            try:
                slot.group.set_result(self._build(sender_id, generation, cancelled))
            except BaseException as exc:
                slot.group.set_exception(exc)
        return slot.group.result()

    def close_pair(self, sender_id: str, generation: int) -> None:
        with self._lock:
            slot = self._slots.get(sender_id)
        if slot is None or slot.generation != generation:
            return
        if slot.group.done() and slot.group.exception() is None:
            slot.group.result().close()

    def _build(self, sender_id: str, generation: int, cancelled: Callable[[], bool]) -> PairGroup:
        prefix = group_prefix(sender_id, generation)
        # Wait for the sender's claim before building: the gloo constructor cannot be
        # interrupted, while this wait can (abandon) and it times out on its own.
        deadline = time.monotonic() + self._timeout_s
        while not self._store.check([f"{prefix}/claim"]):
            if cancelled():
                raise PeerLost(f"pair {prefix}: abandoned before the sender joined")
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"pair {prefix}: sender did not join within {self._timeout_s:.1f} s"
                )
            time.sleep(_CLAIM_POLL_S)
        try:
            group = ProcessGroupGloo(
                PrefixStore(prefix, self._store),
                RECEIVER_RANK,
                2,
                _gloo_options(self._host, self._timeout_s),
            )
        except RuntimeError as exc:
            raise from_torch_error(exc, f"pair {prefix}: join") from exc
        return PairGroup(group, SENDER_RANK, prefix, self._timeout_s)

    def close(self) -> None:
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            if slot.group.done() and slot.group.exception() is None:
                slot.group.result().close()


@dataclass
class _Outbound:
    generation: int
    group: Future = field(default_factory=Future)


class OutboundPairs:
    """The sender's pairs, one per receiver incarnation, joined on the receiver's store.

    Keyed by (receiver id, incarnation): a ticket from a receiver that has since died
    (its store unreachable, its join blocking for the whole timeout) never displaces the
    pair of the receiver's live incarnation. A pair of an older incarnation is closed once
    a newer one has joined.
    """

    def __init__(
        self, incarnation: str, host: str, timeout_s: float, connect_timeout_s: float
    ) -> None:
        self._incarnation = incarnation
        self._host = host
        self._timeout_s = timeout_s
        self._connect_timeout_s = min(connect_timeout_s, timeout_s)
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, str], _Outbound] = {}
        self._stores: dict[tuple[str, str], Store] = {}

    def group(
        self, receiver_id: str, incarnation: str, generation: int, address: str, sender_id: str
    ) -> PairGroup:
        """The group a ticket names; joins it (blocking) on first use."""
        key = (receiver_id, incarnation)
        with self._lock:
            pair = self._pairs.get(key)
            same = pair is not None and pair.generation == generation
            if not same:
                if pair is not None and generation < pair.generation:
                    raise PeerLost(
                        f"ticket names pair generation {generation}, "
                        f"already replaced by {pair.generation}"
                    )
                old, pair = pair, _Outbound(generation)
                self._pairs[key] = pair
        assert pair is not None
        if same:
            group = pair.group.result()
            if group.broken:
                raise PeerLost(f"pair {group.name} is closed; the receiver opens a new one")
            return group
        _close_joined(old)
        try:
            pair.group.set_result(self._join(address, incarnation, sender_id, generation))
        except BaseException as exc:
            pair.group.set_exception(exc)
            raise
        with self._lock:
            stale = [k for k in self._pairs if k[0] == receiver_id and k != key]
            retired = [self._pairs.pop(k) for k in stale]
        for earlier in retired:
            _close_joined(earlier)
        return pair.group.result()

    def _store(self, address: str, incarnation: str) -> Store:
        key = (address, incarnation)
        with self._lock:
            store = self._stores.get(key)
        if store is not None:
            return store
        host, _, port = address.rpartition(":")
        _probe(host, port, self._connect_timeout_s)
        try:
            store = TCPStore(
                host,
                int(port),
                is_master=False,
                timeout=datetime.timedelta(seconds=self._timeout_s),
            )
        except (RuntimeError, ValueError) as exc:
            raise PeerLost(f"receiver store {address} unreachable: {exc}") from exc
        with self._lock:
            # A receiver that restarted at the same address: its old store is gone.
            for stale in [k for k in self._stores if k[0] == address and k != key]:
                del self._stores[stale]
            return self._stores.setdefault(key, store)

    def _join(self, address: str, incarnation: str, sender_id: str, generation: int) -> PairGroup:
        prefix = group_prefix(sender_id, generation)
        store = self._store(address, incarnation)
        try:
            owner = store.compare_set(f"{prefix}/claim", "", self._incarnation)
        except RuntimeError as exc:
            with self._lock:
                self._stores.pop((address, incarnation), None)
            raise PeerLost(f"receiver store {address}: {exc}") from exc
        if owner.decode() != self._incarnation:
            # An earlier incarnation of this sender joined this generation: its sockets
            # are gone, the receiver must open a new generation.
            raise PeerLost(f"pair {prefix} belongs to an earlier incarnation of {sender_id}")
        try:
            group = ProcessGroupGloo(
                PrefixStore(prefix, store),
                SENDER_RANK,
                2,
                _gloo_options(self._host, self._timeout_s),
            )
        except RuntimeError as exc:
            raise from_torch_error(exc, f"pair {prefix}: join") from exc
        return PairGroup(group, RECEIVER_RANK, prefix, self._timeout_s)

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            self._stores.clear()
        for pair in pairs:
            _close_joined(pair)


def _probe(host: str, port: str, timeout_s: float) -> None:
    """Fails fast where the receiver's store cannot be reached: TCPStore's own client
    retries a refused connection for up to twice its timeout."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise PeerLost(f"receiver store {host}:{port} unreachable: {exc}") from exc


def _close_joined(pair: _Outbound | None) -> None:
    """Closes a pair whose join succeeded; one still joining or failed has nothing open."""
    if pair is not None and pair.group.done() and pair.group.exception() is None:
        pair.group.result().close()
