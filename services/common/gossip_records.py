"""Domain records of the gossip store and the validation every write goes through.

Roles are the strings "prefill" / "decode" (the values of `kvrs.topology.Role`), node
states "alive" / "suspect" / "failed" / "left", event types "joined" / "suspect" /
"refuted" / "failed" / "left"; neither gRPC nor Redis appears here, so the store, the
servicer and the client share them.

An instance that misses its heartbeat deadline becomes *suspect*: no new work goes there,
but its requests stay (a starved or briefly stopped process is not a dead one). A
heartbeat refutes the suspicion; a failed direct probe of its address, or a second,
longer deadline, confirms the death and declares it *failed*.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from kvrs.errors import InvalidArgument

ROLES = ("prefill", "decode")
ALIVE, SUSPECT, FAILED, LEFT = "alive", "suspect", "failed", "left"
JOINED, REFUTED = "joined", "refuted"
LIVE_STATES = (ALIVE, SUSPECT)
"""States of an instance whose death is not confirmed: it still holds its requests."""
MAX_HEARTBEAT_TTL_S = 86_400.0
"""Longest heartbeat TTL an instance may register with (a day)."""

# Every registry read returns every instance in one message: unbounded strings let one
# caller push ListNodes past the gRPC message limit and stop every refresh.
MAX_ID_BYTES = 256
"""Longest instance id, node, rack or pod name (UTF-8 bytes)."""
MAX_ADDRESS_BYTES = 512
"""Longest address or transfer address (UTF-8 bytes)."""
MAX_MODEL_BYTES = 128
"""Longest model name (UTF-8 bytes)."""
MAX_REASON_BYTES = 1024
"""Longest deregistration reason (UTF-8 bytes)."""
MAX_PREFIX_HASHES = 65_536
"""Most resident prefix hashes one heartbeat may report (33M tokens at 512-token blocks)."""


@dataclass(frozen=True)
class Registration:
    """What an instance tells the registry about itself when it joins."""

    instance_id: str
    role: str
    """"prefill" or "decode"."""
    address: str
    """host:port of the instance's WorkerService."""
    node: str = ""
    rack: str = ""
    pod: str = ""
    gpu_index: int = 0
    model: str = ""
    kv_capacity_blocks: int = 0
    transfer_address: str = ""
    """host:port of the instance's KV transfer rendezvous."""
    heartbeat_ttl_s: float = 0.0
    """Silence after which the instance becomes suspect; 0 = the server default."""
    max_batch_tokens: int = 0
    """Most new tokens one of its forward passes takes; 0 = not reported."""


@dataclass(frozen=True)
class NodeLoad:
    """The load an instance reports with every heartbeat."""

    queue_depth: int = 0
    queued_work_s: float = 0.0
    """W(x): seconds of work queued ahead of a new request."""
    running_requests: int = 0
    free_kv_blocks: int = 0
    resident_prefix_hashes: tuple[int, ...] = ()
    """Hashes of the prefix blocks resident on the instance."""
    compute_factor: float = 0.0
    """Measured / profile seconds of its recent forward passes; 0 = not measured."""
    running_context_tokens: int = 0
    """Tokens cached by its running decode streams, summed (each step reads them)."""


@dataclass(frozen=True)
class NodeRecord:
    """One instance as the registry sees it."""

    registration: Registration
    state: str
    load: NodeLoad
    last_seen_unix_ms: int
    """Time (Redis clock) of the last heartbeat or registration."""
    age_s: float
    """Seconds between `last_seen_unix_ms` and the listing."""
    heartbeat_ttl_s: float


@dataclass(frozen=True)
class NodeChanges:
    """What changed in the registry after a reader's change id (or all of it, `full`)."""

    nodes: tuple[NodeRecord, ...]
    """Each changed instance as it is now, alive or down; every instance when `full`."""
    change_id: str
    """Where the reader is now: its next `after_change_id`."""
    full: bool
    """`nodes` replaces the reader's copy (asked for, or the history had a gap)."""
    now_ms: int
    """Redis time of the reply."""


@dataclass(frozen=True)
class LinkSample:
    """A bandwidth measurement of the path src -> dst, as the prober reports it."""

    src_instance_id: str
    dst_instance_id: str
    bandwidth_bps: float
    """Smoothed (EWMA) estimate."""
    sample_bandwidth_bps: float = 0.0
    """The raw measurement behind the estimate."""
    rtt_s: float = 0.0
    probe_bytes: int = 0
    samples: int = 0


@dataclass(frozen=True)
class LinkRecord:
    """A link sample with the time it was stored and its age at listing."""

    sample: LinkSample
    measured_unix_ms: int
    age_s: float


@dataclass(frozen=True)
class NodeEvent:
    """A membership change, identified by its Redis stream id."""

    event_id: str
    type: str
    """"joined", "suspect", "refuted", "failed" or "left"."""
    instance_id: str
    role: str
    address: str
    unix_ms: int
    reason: str = ""


def require_id(field_name: str, value: str) -> None:
    if not value:
        raise InvalidArgument(field_name, "must not be empty")
    require_at_most_bytes(field_name, value, MAX_ID_BYTES)


def require_at_most_bytes(field_name: str, value: str, limit: int) -> None:
    size = len(value.encode())
    if size > limit:
        raise InvalidArgument(field_name, f"must be at most {limit} bytes, got {size}")


def require_non_negative(field_name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(field_name, f"must be a finite number >= 0, got {value}")


def validate_registration(registration: Registration) -> None:
    require_id("instance_id", registration.instance_id)
    if registration.role not in ROLES:
        raise InvalidArgument("role", f"must be one of {ROLES}, got {registration.role!r}")
    require_id("address", registration.address)
    require_at_most_bytes("address", registration.address, MAX_ADDRESS_BYTES)
    require_at_most_bytes("transfer_address", registration.transfer_address, MAX_ADDRESS_BYTES)
    require_at_most_bytes("model", registration.model, MAX_MODEL_BYTES)
    for name in ("node", "rack", "pod"):
        require_at_most_bytes(f"location.{name}", getattr(registration, name), MAX_ID_BYTES)
    require_non_negative("location.gpu_index", registration.gpu_index)
    require_non_negative("kv_capacity_blocks", registration.kv_capacity_blocks)
    require_non_negative("max_batch_tokens", registration.max_batch_tokens)
    require_non_negative("heartbeat_ttl_s", registration.heartbeat_ttl_s)
    if registration.heartbeat_ttl_s > MAX_HEARTBEAT_TTL_S:  # stored as integer milliseconds
        raise InvalidArgument("heartbeat_ttl_s", f"must be at most {MAX_HEARTBEAT_TTL_S:.0f} s")


def validate_load(load: NodeLoad) -> None:
    require_non_negative("queue_depth", load.queue_depth)
    require_non_negative("queued_work_s", load.queued_work_s)
    require_non_negative("running_requests", load.running_requests)
    require_non_negative("free_kv_blocks", load.free_kv_blocks)
    require_non_negative("compute_factor", load.compute_factor)
    require_non_negative("running_context_tokens", load.running_context_tokens)
    if len(load.resident_prefix_hashes) > MAX_PREFIX_HASHES:
        raise InvalidArgument(
            "resident_prefix_hashes",
            f"must hold at most {MAX_PREFIX_HASHES} hashes, got {len(load.resident_prefix_hashes)}",
        )


def validate_link_sample(sample: LinkSample) -> None:
    require_id("src_instance_id", sample.src_instance_id)
    require_id("dst_instance_id", sample.dst_instance_id)
    if sample.src_instance_id == sample.dst_instance_id:
        raise InvalidArgument("dst_instance_id", "must differ from src_instance_id")
    if not math.isfinite(sample.bandwidth_bps) or sample.bandwidth_bps < 1:
        raise InvalidArgument(
            "bandwidth_bps", f"must be a finite number >= 1 (bit/s), got {sample.bandwidth_bps}"
        )
    require_non_negative("sample_bandwidth_bps", sample.sample_bandwidth_bps)
    require_non_negative("rtt_s", sample.rtt_s)
    require_non_negative("probe_bytes", sample.probe_bytes)
    require_non_negative("samples", sample.samples)


class GossipReader(Protocol):
    """What a reader of the registry needs from gossip; `services.gossip.client.GossipClient`
    is the implementation (a protocol, so `services.common` imports no service)."""

    async def list_nodes(
        self, role: str | None = None, include_down: bool = False
    ) -> list[NodeRecord]: ...

    async def list_changes(self, after_change_id: str = "") -> NodeChanges: ...

    async def list_links(self, measured_after_unix_ms: int = 0) -> list[LinkRecord]: ...

    def watch_events(self, after_event_id: str = "") -> AsyncIterator[NodeEvent]: ...

    async def close(self) -> None: ...
