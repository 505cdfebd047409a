"""Prometheus metrics: one registry per process, every kvrs metric family defined once.

Each service builds a `Metrics` at start (never a module global), passes it to the code
that records, and exposes it with `serve_metrics` on `KVRS_METRICS_ADDR` (host:port;
empty disables). Families a service does not use simply stay at zero.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class Metrics:
    """All kvrs metric families, registered in a private registry."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.decisions = Counter(
            "kvrs_decisions",
            "Decisions made, by kind and action.",
            ["decision", "action"],
            registry=r,
        )
        self.decision_latency_s = Histogram(
            "kvrs_decision_latency_seconds",
            "Time to make one decision in-process.",
            ["decision"],
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
            registry=r,
        )
        self.recovery_predicted_s = Histogram(
            "kvrs_recovery_predicted_seconds",
            "Predicted recovery time, by action.",
            ["action"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.recovery_actual_s = Histogram(
            "kvrs_recovery_actual_seconds",
            "Measured recovery time, by action.",
            ["action"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.prediction_ratio = Histogram(
            "kvrs_prediction_ratio",
            "Measured / predicted seconds of each executed decision, by decision kind "
            "(placement, migrate, recompute, hybrid) and term (kvrs.learning.TERMS).",
            ["kind", "term"],
            buckets=(0.125, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 8, 16),
            registry=r,
        )
        self.prediction_error = Histogram(
            "kvrs_prediction_error",
            "|measured - predicted| / measured of each executed decision, by kind and term.",
            ["kind", "term"],
            buckets=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.telemetry_age_s = Gauge(
            "kvrs_telemetry_age_seconds",
            "Age of the cluster view a decision used.",
            registry=r,
        )
        self.slots_in_use = Gauge(
            "kvrs_slots_in_use",
            "Migration slots currently leased.",
            registry=r,
        )
        self.slot_requests = Counter(
            "kvrs_slot_requests",
            "Slot reservations, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvrs_transfer_bytes",
            "KV bytes moved, by direction.",
            ["direction"],
            registry=r,
        )
        self.transfer_rate_bps = Histogram(
            "kvrs_transfer_rate_bps",
            "Achieved KV transfer rate in bits per second.",
            buckets=(1e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11),
            registry=r,
        )
        self.ttft_s = Histogram(
            "kvrs_ttft_seconds",
            "Time to first token of a request, as the router streamed it.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.tbt_s = Histogram(
            "kvrs_tbt_seconds",
            "Time between two consecutive tokens of a request, as the router streamed them.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=r,
        )
        self.epp_served = Counter(
            "kvrs_epp_served",
            "Responses the gateway reported served, by which of the picked endpoints served "
            "them (primary, fallback, unlisted).",
            ["rank"],
            registry=r,
        )
        self.requests = Counter(
            "kvrs_requests",
            "Requests served end to end, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.worker_batch_sequences = Histogram(
            "kvrs_worker_batch_sequences",
            "Sequences computed together in one forward pass of a worker.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.worker_batch_tokens = Histogram(
            "kvrs_worker_batch_tokens",
            "New tokens computed in one forward pass of a worker.",
            buckets=(1, 4, 16, 64, 256, 1024, 2048, 4096, 8192),
            registry=r,
        )
        self.instances_alive = Gauge(
            "kvrs_instances_alive",
            "Alive instances by role, as gossip last listed them.",
            ["role"],
            registry=r,
        )
        self.membership_events = Counter(
            "kvrs_membership_events",
            "Instances this gossip replica declared failed or saw leave, by type.",
            ["type"],
            registry=r,
        )
        self.heartbeats = Counter(
            "kvrs_heartbeats",
            "Heartbeats received, by outcome (ok; unknown or not_alive: "
            "the instance must register again).",
            ["outcome"],
            registry=r,
        )


def serve_metrics(metrics: Metrics, addr: str) -> int | None:
    """Expose `metrics` over HTTP at `addr` ("host:port"; port 0 picks one). Returns the port."""
    if not addr:
        return None
    host, _, port = addr.rpartition(":")
    host = host or "0.0.0.0"
    server, _thread = start_http_server(int(port), addr=host, registry=metrics.registry)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
