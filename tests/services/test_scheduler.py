"""Scheduler over a real gossip store and slot broker: placement, recovery, staleness, spans."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.model import model_spec
from kvrs.placement import PlacementRequest, make_placement_policy
from kvrs.profile import compute_profile
from kvrs.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, slots_pb2, slots_pb2_grpc
from services.common import GrpcSettings, connect_redis, open_channel, setup_tracing
from services.common.decision_inputs import InputsConfig
from services.common.gossip_records import LinkSample, NodeLoad, Registration
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.prober.probing import DOWN_BANDWIDTH_BPS
from services.scheduler.config import Config
from services.scheduler.server import build_server
from services.slot_broker.config import Config as BrokerConfig
from services.slot_broker.server import build_server as build_broker

MODEL = "opt-125m"
PROFILE = compute_profile(MODEL)
BYTES_PER_TOKEN = model_spec(MODEL).kv_bytes_per_token
MIGRATE = common_pb2.RECOVERY_ACTION_MIGRATE
RECOMPUTE = common_pb2.RECOVERY_ACTION_RECOMPUTE
HYBRID = common_pb2.RECOVERY_ACTION_HYBRID
ABORT = common_pb2.RECOVERY_ACTION_ABORT
TELEMETRY_DOC = Path(__file__).resolve().parents[2] / "docs" / "telemetry.md"

# (instance id, role, node, rack, pod)
CLUSTER = (
    ("prefill-0", "prefill", "n0", "r0", "p0"),
    ("prefill-1", "prefill", "n2", "r1", "p0"),
    ("decode-near", "decode", "n0", "r0", "p0"),
    ("decode-rack", "decode", "n1", "r0", "p0"),
    ("decode-far", "decode", "n9", "r9", "p9"),
)


class Plane:
    """A real gossip store and slot broker on loopback; schedulers started on demand."""

    def __init__(self, redis_url: str, redis_prefix: str) -> None:
        self.redis_url = redis_url
        self.redis_prefix = redis_prefix
        self.exporter = InMemorySpanExporter()
        self.provider = setup_tracing("test-scheduler", exporter=self.exporter)
        self._closers: list = []

    async def start(self, slot_cap: int = 32) -> None:
        await self.start_gossip()
        await self.start_broker(slot_cap)
        self.gossip = GossipClient(f"127.0.0.1:{self.gossip_port}", timeout_s=5)
        self._closers.append(self.gossip.close)

    async def start_gossip(self, port: int = 0) -> None:
        self.gossip_handle = await build_gossip(
            GossipConfig(
                listen_addr=f"127.0.0.1:{port}",
                redis_url=self.redis_url,
                redis_prefix=self.redis_prefix,
            ),
            self.provider,
        )
        self.gossip_port = self.gossip_handle.port

    async def start_broker(self, slot_cap: int, purge_interval_s: float = 0.5) -> None:
        self.broker_handle = await build_broker(
            BrokerConfig(
                listen_addr="127.0.0.1:0",
                redis_url=self.redis_url,
                redis_prefix=self.redis_prefix,
                cluster_cap=slot_cap,
                purge_interval_s=purge_interval_s,
            ),
            self.provider,
        )
        channel = open_channel(f"127.0.0.1:{self.broker_handle.port}", GrpcSettings())
        self._closers.append(channel.close)
        self.broker = slots_pb2_grpc.SlotBrokerServiceStub(channel)

    async def register(
        self,
        cluster=CLUSTER,
        kv_capacity_blocks: int = 0,
        loads: dict | None = None,
        max_batch_tokens: int = 0,
    ) -> None:
        for instance_id, role, node, rack, pod in cluster:
            await self.gossip.register(
                Registration(
                    instance_id=instance_id,
                    role=role,
                    address=f"{instance_id}:50060",
                    node=node,
                    rack=rack,
                    pod=pod,
                    kv_capacity_blocks=kv_capacity_blocks,
                    transfer_address=f"{instance_id}:29500",
                    heartbeat_ttl_s=600.0,
                    max_batch_tokens=max_batch_tokens,
                )
            )
            load = (loads or {}).get(instance_id)
            if load is not None:
                await self.gossip.heartbeat(instance_id, load)

    async def link(self, src: str, dst: str, bandwidth_bps: float, rtt_s: float = 1e-4) -> None:
        await self.gossip.report_link_sample(
            LinkSample(
                src_instance_id=src,
                dst_instance_id=dst,
                bandwidth_bps=bandwidth_bps,
                rtt_s=rtt_s,
                samples=4,
            )
        )

    async def scheduler(self, **overrides) -> scheduler_pb2_grpc.SchedulerServiceStub:
        """A scheduler over this plane; its first view already holds what is registered."""
        settings = {
            "listen_addr": "127.0.0.1:0",
            "gossip_addr": f"127.0.0.1:{self.gossip_port}",
            "slot_broker_addr": f"127.0.0.1:{self.broker_handle.port}",
            "view_refresh_s": 0.05,
            # Well above the refresh period: a refresh on a loaded machine can take a
            # few hundred milliseconds without the view being out of date.
            "view_stale_after_s": 1.0,
            # The tests check decisions, not deadlines: a fresh broker's first call on a
            # loaded 2-core machine can take longer than the 0.5 s default.
            "peer_timeout_s": 5.0,
            "holder_id": "test-scheduler",
            "inputs": InputsConfig(model=MODEL),
            "redis_url": self.redis_url,
            "redis_prefix": self.redis_prefix,
        }
        config = Config(**{**settings, **overrides})
        self.scheduler_handle = handle = await build_server(config, self.provider)
        channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
        self._closers.append(lambda: handle.stop(0))
        self._closers.append(channel.close)
        return scheduler_pb2_grpc.SchedulerServiceStub(channel)

    async def refresh(self) -> None:
        assert await self.scheduler_handle.view.refresh()

    async def slots_in_use(self) -> int:
        stats = await self.broker.GetSlotStats(slots_pb2.GetSlotStatsRequest(), timeout=5)
        return stats.slots_in_use

    async def slots_in_use_settles_at(self, expected: int, timeout_s: float = 5.0) -> bool:
        """Whether the slots in use reach `expected` (spares' claims land after answers)."""
        deadline = time.monotonic() + timeout_s
        while await self.slots_in_use() != expected:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def close(self) -> None:
        while self._closers:
            await self._closers.pop()()
        await self.broker_handle.stop(0)
        await self.gossip_handle.stop(0)

    def spans(self, name: str) -> list:
        return [span for span in self.exporter.get_finished_spans() if span.name == name]


@pytest.fixture
async def plane(any_redis_url, redis_prefix):
    """The plane on one Redis and on the three-primary Redis Cluster: gossip, the slot
    broker, the schedulers' slot reservations and their shared outcomes all on it."""
    plane = Plane(any_redis_url, redis_prefix)
    await plane.start()
    yield plane
    await plane.close()


def select(
    request_id: str = "req-1", prefill: str = "prefill-0", prompt_tokens: int = 2048, **fields
) -> scheduler_pb2.SelectDecodeRequest:
    return scheduler_pb2.SelectDecodeRequest(
        request_id=request_id,
        prefill_instance_id=prefill,
        prompt_tokens=prompt_tokens,
        **fields,
    )


def options(*rows: tuple[str, float, int]) -> list[scheduler_pb2.PrefillOption]:
    """PrefillOption messages from (instance id, finish s, prefix hit tokens) rows."""
    return [
        scheduler_pb2.PrefillOption(instance_id=i, finish_s=f, prefix_hit_tokens=h)
        for i, f, h in rows
    ]


def recover(
    request_id: str = "req-1",
    failed: str = "decode-near",
    source: str = "prefill-0",
    prompt_tokens: int = 1000,
    generated_tokens: int = 20,
    **fields,
) -> scheduler_pb2.RecoverRequest:
    return scheduler_pb2.RecoverRequest(
        request_id=request_id,
        failed_instance_id=failed,
        source_prefill_instance_id=source,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated_tokens,
        **fields,
    )


async def expect_error(call, request, code: grpc.StatusCode, field: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call(request, timeout=5)
    assert failure.value.code() == code, failure.value.details()
    assert failure.value.details().startswith(f"{field}:"), failure.value.details()
    return failure.value.details()


# -- SelectDecode -----------------------------------------------------------------------


async def test_select_decode_picks_the_near_idle_instance_and_reports_the_runner_up(plane):
    await plane.register()
    stub = await plane.scheduler()
    reply = await stub.SelectDecode(select(), timeout=5)
    assert reply.decode_instance_id == "decode-near"
    assert reply.decode_address == "decode-near:50060"
    assert reply.decode_transfer_address == "decode-near:29500"
    assert reply.runner_up_instance_id == "decode-rack"
    assert reply.candidates_considered == 3
    assert reply.policy == "netkv"
    assert reply.transfer.tier == 0 and reply.transfer.kv_bytes == 2048 * BYTES_PER_TOKEN
    assert reply.predicted_ttft_s == pytest.approx(reply.transfer_s + reply.wait_s)
    assert reply.predicted_ttft_s < reply.runner_up_ttft_s
    assert not reply.view_stale


async def test_select_decode_leaves_a_busy_instance_for_an_idle_one(plane):
    await plane.register(loads={"decode-near": NodeLoad(queued_work_s=5.0, queue_depth=9)})
    stub = await plane.scheduler()
    reply = await stub.SelectDecode(select(), timeout=5)
    assert reply.decode_instance_id == "decode-rack"
    assert reply.runner_up_instance_id == "decode-far"


async def test_netkv_avoids_a_congested_path_that_cache_load_cannot_see(plane):
    twins = (
        ("prefill-0", "prefill", "n0", "r0", "p0"),
        ("decode-a", "decode", "n1", "r1", "p0"),
        ("decode-b", "decode", "n2", "r2", "p0"),
    )
    await plane.register(twins)
    stub = await plane.scheduler()
    before = await stub.SelectDecode(select(), timeout=5)
    assert before.decode_instance_id == "decode-a"  # equal paths: the id breaks the tie
    await plane.link("prefill-0", "decode-a", bandwidth_bps=1e9)
    await plane.link("prefill-0", "decode-b", bandwidth_bps=100e9)
    await plane.refresh()
    after = await stub.SelectDecode(select(), timeout=5)
    assert after.decode_instance_id == "decode-b"
    assert after.transfer.bottleneck_bandwidth_bps == pytest.approx(100e9)
    assert 0 <= after.transfer.telemetry_age_s < 5 and not after.transfer.telemetry_stale
    assert after.runner_up_instance_id == "decode-a"
    assert after.runner_up_ttft_s > 10 * after.predicted_ttft_s
    blind = await stub.SelectDecode(select(policy="cache_load"), timeout=5)
    assert blind.decode_instance_id == "decode-a" and blind.policy == "cache_load"
    assert blind.predicted_ttft_s == pytest.approx(after.runner_up_ttft_s)


async def test_select_decode_avoids_a_link_the_prober_reported_down(plane):
    await plane.register()
    stub = await plane.scheduler()
    assert (await stub.SelectDecode(select(), timeout=5)).decode_instance_id == "decode-near"
    await plane.link("prefill-0", "decode-near", bandwidth_bps=DOWN_BANDWIDTH_BPS)
    await plane.refresh()
    reply = await stub.SelectDecode(select(), timeout=5)
    assert reply.decode_instance_id == "decode-rack"


async def test_select_decode_honours_exclusions_and_candidate_lists(plane):
    await plane.register()
    stub = await plane.scheduler()
    excluded = await stub.SelectDecode(select(exclude_instance_ids=["decode-near"]), timeout=5)
    assert excluded.decode_instance_id == "decode-rack"
    assert excluded.candidates_considered == 2
    only = await stub.SelectDecode(select(candidate_instance_ids=["decode-far"]), timeout=5)
    assert only.decode_instance_id == "decode-far"
    assert only.runner_up_instance_id == "" and only.candidates_considered == 1
    await expect_error(
        stub.SelectDecode,
        select(candidate_instance_ids=["decode-far", "ghost"]),
        grpc.StatusCode.NOT_FOUND,
        "candidate_instance_ids",
    )
    await expect_error(
        stub.SelectDecode,
        select(exclude_instance_ids=["decode-near", "decode-rack", "decode-far"]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "candidates",
    )


async def test_select_decode_skips_instances_without_free_kv_memory(plane):
    blocks = model_spec(MODEL).block_tokens
    await plane.register(
        kv_capacity_blocks=64,
        loads={
            "decode-near": NodeLoad(free_kv_blocks=1),
            "decode-rack": NodeLoad(free_kv_blocks=64),
            "decode-far": NodeLoad(free_kv_blocks=64),
        },
    )
    stub = await plane.scheduler()
    reply = await stub.SelectDecode(select(prompt_tokens=4 * blocks), timeout=5)
    assert reply.decode_instance_id == "decode-rack"
    await expect_error(
        stub.SelectDecode,
        select(prompt_tokens=65 * blocks),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "free_kv_tokens",
    )


async def test_kvrs_in_the_service_decides_as_the_simulator_does_on_the_same_view(plane):
    """The simulator calls the core policy with the view's decode candidates, its cost
    model and the decision time; the service must decide exactly that, decision after
    decision (kvrs remembers its own recent placements, so the sequence matters)."""
    blocks = model_spec(MODEL).block_tokens
    await plane.register(
        kv_capacity_blocks=4096,
        loads={
            "decode-near": NodeLoad(free_kv_blocks=1000, queued_work_s=0.002),
            "decode-rack": NodeLoad(free_kv_blocks=4000, resident_prefix_hashes=(7, 8)),
            "decode-far": NodeLoad(free_kv_blocks=4096),
        },
    )
    # The base model alone: a learning scheduler also counts each placement's work in
    # the chosen instance's W(d), which the simulator's view does not hold.
    stub = await plane.scheduler(view_refresh_s=3600.0, view_stale_after_s=3600.0, learning=False)
    await plane.link("prefill-0", "decode-rack", bandwidth_bps=20e9)
    await plane.refresh()
    cache = plane.scheduler_handle.view
    decided_at_s = time.time()
    cache.clock = lambda: decided_at_s
    simulator_policy = make_placement_policy("kvrs")
    chosen = set()
    for k, (tokens, hashes) in enumerate(
        [(64, ()), (2048, (7, 8, 9)), (512 * blocks, ()), (96 * blocks, (7,)), (300, ())] * 2
    ):
        reply = await stub.SelectDecode(
            select(f"req-{k}", prompt_tokens=tokens, prefix_hashes=hashes, policy="kvrs"),
            timeout=5,
        )
        view = cache.current()
        expected = simulator_policy.select(
            PlacementRequest(f"req-{k}", "prefill-0", tokens, hashes),
            view.cluster.decode_instances(),
            view.cost,
            view.cluster.now_s,
        )
        assert reply.policy == "kvrs"
        assert reply.decode_instance_id == expected.instance_id
        assert reply.predicted_ttft_s == pytest.approx(expected.predicted_ttft_s, rel=1e-12)
        assert reply.runner_up_instance_id == expected.runner_up.instance_id
        chosen.add(reply.decode_instance_id)
    assert len(chosen) > 1


async def test_kvrs_in_the_service_chooses_the_prefill_as_the_simulator_does_on_the_same_view(
    plane,
):
    """Given the prefill options, kvrs may place the prompt on another prefill instance
    than the prefill rule's (`Kvrs.choose_prefill`); the service must choose the prefill,
    then the decode instance, exactly as the simulator does on the same view."""
    blocks = model_spec(MODEL).block_tokens
    await plane.register(
        kv_capacity_blocks=4096,
        loads={
            "decode-near": NodeLoad(free_kv_blocks=4000),
            "decode-rack": NodeLoad(free_kv_blocks=4000, resident_prefix_hashes=(7, 8)),
            "decode-far": NodeLoad(free_kv_blocks=4096),
        },
    )
    stub = await plane.scheduler(view_refresh_s=3600.0, view_stale_after_s=3600.0, learning=False)
    await plane.refresh()
    cache = plane.scheduler_handle.view
    decided_at_s = time.time()
    cache.clock = lambda: decided_at_s
    simulator_policy = make_placement_policy("kvrs")
    # (prompt tokens, hashes, routed prefill, finish on prefill-0 and prefill-1, their hits)
    cases = [
        (96 * blocks, (), "prefill-1", 0.012, 0.010, (0, 0)),
        (96 * blocks, (), "prefill-0", 0.010, 0.012, (0, 0)),
        (64, (), "prefill-1", 0.0011, 0.0010, (0, 0)),
        (16 * blocks, (7, 8, 9), "prefill-1", 0.030, 0.020, (0, 2 * blocks)),
        (512 * blocks, (), "prefill-1", 2.5, 0.5, (0, 0)),
    ] * 2
    moved = []
    for k, (tokens, hashes, routed, finish_0, finish_1, hits) in enumerate(cases):
        rows = [("prefill-0", finish_0, hits[0]), ("prefill-1", finish_1, hits[1])]
        reply = await stub.SelectDecode(
            select(
                f"req-{k}",
                prefill=routed,
                prompt_tokens=tokens,
                prefix_hashes=hashes,
                policy="kvrs",
                prefill_options=options(*rows),
            ),
            timeout=5,
        )
        view = cache.current()
        decodes = view.cluster.decode_instances()
        index = simulator_policy.choose_prefill(
            PlacementRequest(f"req-{k}", routed, tokens, hashes),
            [(instance_id, finish_s) for instance_id, finish_s, _ in rows],
            [row[0] for row in rows].index(routed),
            decodes,
            view.cost,
            view.cluster.now_s,
            list(hits),
        )
        prefill = rows[index][0]
        expected = simulator_policy.select(
            PlacementRequest(f"req-{k}", prefill, tokens, hashes),
            decodes,
            view.cost,
            view.cluster.now_s,
        )
        assert reply.prefill_instance_id == prefill
        assert reply.decode_instance_id == expected.instance_id
        assert reply.predicted_ttft_s == pytest.approx(expected.predicted_ttft_s, rel=1e-12)
        moved.append(prefill != routed)
    # Both ways occur: the cases test the choice, not one constant answer.
    assert any(moved) and not all(moved), moved
    spans = plane.spans("kvrs.select_decode")[-len(cases) :]
    routed_to = [span.attributes["kvrs.prefill.routed_instance_id"] for span in spans]
    chosen = [span.attributes["kvrs.prefill_instance_id"] for span in spans]
    assert [r != c for r, c in zip(routed_to, chosen, strict=True)] == moved


async def test_a_policy_that_does_not_choose_the_prefill_keeps_the_routed_one(plane):
    await plane.register()
    stub = await plane.scheduler()
    rows = options(("prefill-0", 5.0, 0), ("prefill-1", 0.001, 0))
    for policy in ("netkv", "round_robin", ""):
        reply = await stub.SelectDecode(
            select(prefill="prefill-0", policy=policy, prefill_options=rows), timeout=5
        )
        assert reply.prefill_instance_id == "prefill-0"
    reply = await stub.SelectDecode(select(prefill="prefill-1"), timeout=5)
    assert reply.prefill_instance_id == "prefill-1"


async def test_a_failure_event_removes_the_instance_before_the_next_refresh(plane):
    await plane.register()
    stub = await plane.scheduler(view_refresh_s=60.0, view_stale_after_s=120.0)
    assert (await stub.SelectDecode(select(), timeout=5)).decode_instance_id == "decode-near"
    await asyncio.sleep(0.2)  # the event stream is open
    await plane.gossip.deregister("decode-near", "drained")
    deadline = time.monotonic() + 5
    while (await stub.SelectDecode(select(), timeout=5)).decode_instance_id == "decode-near":
        assert time.monotonic() < deadline, "the left event never reached the view"
        await asyncio.sleep(0.02)
    assert plane.scheduler_handle.view.state.age_s(time.time()) < 60.0


async def test_instances_a_registry_loses_stay_for_one_ttl_flagged_stale(plane):
    """Redis restarted empty: the registry lists nothing, but the instances did not fail;
    they are kept (stale) for the one TTL they have to register again, then dropped."""
    ttl_s = 1.0
    for instance_id, role, node, rack, pod in CLUSTER:
        await plane.gossip.register(
            Registration(
                instance_id=instance_id,
                role=role,
                address=f"{instance_id}:50060",
                node=node,
                rack=rack,
                pod=pod,
                heartbeat_ttl_s=ttl_s,
            )
        )
    # The base model alone: the first placement's work in decode-near's W(d) must not
    # decide where the second goes.
    stub = await plane.scheduler(view_refresh_s=60.0, view_stale_after_s=120.0, learning=False)
    assert not (await stub.SelectDecode(select(), timeout=5)).view_stale
    client = connect_redis(plane.redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{plane.redis_prefix}gossip:*")]
        await client.delete(*keys)
    finally:
        await client.aclose()
    await plane.refresh()
    kept = await stub.SelectDecode(select(), timeout=5)
    assert kept.decode_instance_id == "decode-near" and kept.view_stale
    await asyncio.sleep(ttl_s + 0.1)
    await plane.refresh()
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.SelectDecode(select(), timeout=5)
    assert failure.value.code() in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
    ), failure.value.details()


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (select(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (select(prompt_tokens=-1), grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens"),
        (select(prefill="ghost"), grpc.StatusCode.NOT_FOUND, "prefill_instance_id"),
        (select(prefill=""), grpc.StatusCode.INVALID_ARGUMENT, "prefill_instance_id"),
        (select(prefill="decode-rack"), grpc.StatusCode.INVALID_ARGUMENT, "prefill_instance_id"),
        (select(prompt_tokens=10_000_001), grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens"),
        (select(policy="fastest"), grpc.StatusCode.INVALID_ARGUMENT, "policy"),
        (
            select(prefill_options=options(("prefill-1", 0.01, 0))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill_options",
        ),
        (
            select(prefill_options=options(("prefill-0", 0.01, 0), ("prefill-0", 0.02, 0))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill_options",
        ),
        (
            select(prefill_options=options(("prefill-0", -0.01, 0), ("prefill-1", 0.02, 0))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill_options.finish_s",
        ),
        (
            select(prefill_options=options(("prefill-0", math.nan, 0), ("prefill-1", 0.02, 0))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill_options.finish_s",
        ),
        (
            select(prefill_options=options(("prefill-0", 0.01, 4096), ("prefill-1", 0.02, 0))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill_options.prefix_hit_tokens",
        ),
        (
            select(prefill_options=options(("prefill-0", 0.01, 0), ("decode-far", 0.02, 0))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill_options.instance_id",
        ),
        (
            select(prefill_options=options(("prefill-0", 0.01, 0), ("", 0.02, 0))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill_options.instance_id",
        ),
    ],
)
async def test_select_decode_rejects_bad_input_naming_the_field(plane, request_, code, field):
    await plane.register()
    stub = await plane.scheduler()
    await expect_error(stub.SelectDecode, request_, code, field)


# -- Recover ----------------------------------------------------------------------------


async def test_recover_migrates_over_a_fast_path_and_holds_a_slot(plane):
    await plane.register()
    stub = await plane.scheduler()
    reply = await stub.Recover(recover(), timeout=5)
    assert reply.action == MIGRATE, reply.reason
    assert reply.target_instance_id == "decode-rack"  # decode-near is the failed one
    assert reply.source_instance_id == "prefill-0"
    assert reply.target_address == "decode-rack:50060"
    assert reply.source_transfer_address == "prefill-0:29500"
    assert reply.slot_lease.lease_id and reply.slot_lease.request_id == "req-1"
    assert reply.slot_lease.src_instance_id == "prefill-0"
    assert reply.slot_lease.dst_instance_id == "decode-rack"
    assert reply.slot_lease.holder_id == "test-scheduler"
    assert await plane.slots_in_use() == 1
    assert {o.action for o in reply.options} == {MIGRATE, RECOMPUTE, HYBRID}
    migrate = next(o for o in reply.options if o.action == MIGRATE)
    assert reply.predicted_cost_s == pytest.approx(migrate.cost_s)
    assert migrate.compute_s == pytest.approx(PROFILE.extend_s(1000, 20))
    assert reply.slo_slack_s == float("inf")


async def test_recover_recomputes_when_every_migration_path_is_congested(plane):
    await plane.register()
    for decode in ("decode-rack", "decode-far"):
        await plane.link("prefill-0", decode, bandwidth_bps=1e6)
    stub = await plane.scheduler()
    reply = await stub.Recover(recover(), timeout=5)
    assert reply.action == RECOMPUTE, reply.reason
    assert reply.source_instance_id == "prefill-1"
    assert not reply.slot_lease.lease_id and await plane.slots_in_use() == 0
    lost = await stub.Recover(recover("req-2", source_kv_lost=True), timeout=5)
    assert lost.action == RECOMPUTE
    migrate = next(o for o in lost.options if o.action == MIGRATE)
    assert not migrate.feasible and "source KV lost" in migrate.infeasible_reason


async def test_recover_splits_into_hybrid_when_transfer_and_prefill_take_as_long(plane):
    prompt_tokens = 4096
    bandwidth_bps = 8 * prompt_tokens * BYTES_PER_TOKEN / PROFILE.prefill_s(prompt_tokens)
    await plane.register()
    for prefill in ("prefill-0", "prefill-1"):
        for decode in ("decode-rack", "decode-far"):
            await plane.link(prefill, decode, bandwidth_bps=bandwidth_bps)
    stub = await plane.scheduler()
    reply = await stub.Recover(recover(prompt_tokens=prompt_tokens), timeout=5)
    assert reply.action == HYBRID, reply.reason
    assert 0 < reply.hybrid_split_tokens < prompt_tokens
    assert reply.slot_lease.lease_id
    costs = {o.action: o.cost_s for o in reply.options}
    assert costs[HYBRID] < min(costs[MIGRATE], costs[RECOMPUTE])


async def test_recover_aborts_early_when_no_option_meets_the_deadline(plane):
    await plane.register()
    stub = await plane.scheduler()
    deadline_unix_ms = int(time.time() * 1000) + 1
    reply = await stub.Recover(recover(deadline_unix_ms=deadline_unix_ms), timeout=5)
    assert reply.action == ABORT
    assert "deadline" in reply.reason
    assert reply.slo_slack_s < 0
    assert not reply.slot_lease.lease_id and await plane.slots_in_use() == 0


async def test_recover_falls_back_to_recompute_when_the_slot_cap_is_reached(plane):
    await plane.register()
    await plane.broker_handle.stop(0)
    await plane.start_broker(slot_cap=1)
    stub = await plane.scheduler()
    first = await stub.Recover(recover("req-1"), timeout=5)
    assert first.action == MIGRATE and first.slot_lease.lease_id
    second = await stub.Recover(recover("req-2"), timeout=5)
    assert second.action == RECOMPUTE
    assert "no migration slot" in second.reason
    assert not second.slot_lease.lease_id
    retry = await stub.Recover(recover("req-1"), timeout=5)
    assert retry.action == MIGRATE
    assert retry.slot_lease.lease_id == first.slot_lease.lease_id
    assert await plane.slots_in_use() == 1


async def test_two_replicas_reserving_in_redis_keep_the_cap_exact(plane):
    """Two scheduler replicas reserve slots in the broker's Redis themselves (one hop):
    20 concurrent Recovers against a cap of 3 get exactly 3 leases between them, the
    broker counts and releases them like its own, and unrenewed leases expire."""
    await plane.register()
    await plane.broker_handle.stop(0)
    await plane.start_broker(slot_cap=3)
    direct = {
        "slot_reservations": "redis",
        "redis_url": plane.redis_url,
        "redis_prefix": plane.redis_prefix,
        "slot_ttl_s": 1.0,
    }
    replicas = [await plane.scheduler(holder_id=f"replica-{i}", **direct) for i in range(2)]
    replies = await asyncio.gather(
        *(replicas[i % 2].Recover(recover(f"req-{i}"), timeout=5) for i in range(20))
    )
    granted = [reply for reply in replies if reply.slot_lease.lease_id]
    assert len(granted) == 3
    assert all(reply.action == MIGRATE for reply in granted)
    assert {reply.slot_lease.holder_id for reply in granted} <= {"replica-0", "replica-1"}
    refused = [reply for reply in replies if not reply.slot_lease.lease_id]
    assert all(r.action == RECOMPUTE and "no migration slot" in r.reason for r in refused)
    # A replica may have answered from a spare (counted against the cap all along), whose
    # claim for its request lands right after the answer.
    assert await plane.slots_in_use_settles_at(3)
    spans = [span.name for span in plane.exporter.get_finished_spans()]
    assert any("GetSlotStats" in name for name in spans), "the broker's spans are recorded"
    assert not any("ReserveSlot" in name for name in spans), "a reservation took the extra hop"
    released = await plane.broker.ReleaseSlot(
        slots_pb2.ReleaseSlotRequest(lease_id=granted[0].slot_lease.lease_id), timeout=5
    )
    assert released.released
    again = await replicas[1].Recover(recover("req-after-release"), timeout=5)
    assert again.action == MIGRATE and again.slot_lease.lease_id
    assert await plane.slots_in_use_settles_at(3)
    # Nobody renews: every lease returns once its TTL passes, as a crashed holder's would.
    deadline = time.monotonic() + 5
    while await plane.slots_in_use() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await plane.slots_in_use() == 0


async def test_a_recover_needing_a_slot_answers_from_a_spare_claimed_after_it(plane):
    """With spares held, a Recover that needs a slot takes one: no reservation runs on
    its path (the broker never sees a ReserveSlot, Redis no reserve script), and the spare
    becomes the request's lease right after the answer."""
    await plane.register()
    await plane.broker_handle.stop(0)
    await plane.start_broker(slot_cap=8)
    stub = await plane.scheduler(
        slot_reservations="redis",
        redis_url=plane.redis_url,
        redis_prefix=plane.redis_prefix,
        spare_slots=2,
        slot_ttl_s=30.0,
    )
    client = connect_redis(plane.redis_url)
    spares_key = f"{plane.redis_prefix}slots:spares"
    try:
        deadline = time.monotonic() + 5
        while await client.scard(spares_key) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        spares = {member.decode() for member in await client.smembers(spares_key)}
        assert len(spares) == 2
        granted = (await client.hget(f"{plane.redis_prefix}slots:totals", "granted")) or b"0"
        reply = await stub.Recover(recover("req-spare"), timeout=5)
        assert reply.action == MIGRATE and reply.slot_lease.lease_id in spares
        assert await plane.slots_in_use_settles_at(1)
        lease = await client.hgetall(f"{plane.redis_prefix}slots:lease:{reply.slot_lease.lease_id}")
        assert lease[b"request_id"] == b"req-spare" and lease[b"holder_id"] == b"test-scheduler"
        totals = await client.hget(f"{plane.redis_prefix}slots:totals", "granted")
        assert int(totals) == int(granted) + 1, "granted once, by the claim"
    finally:
        await client.aclose()
    spans = [span.name for span in plane.exporter.get_finished_spans()]
    assert not any("ReserveSlot" in name for name in spans)
    released = await plane.broker.ReleaseSlot(
        slots_pb2.ReleaseSlotRequest(lease_id=reply.slot_lease.lease_id), timeout=5
    )
    assert released.released and await plane.slots_in_use_settles_at(0)


async def test_a_replica_reserving_in_redis_asks_the_broker_while_the_caps_are_gone(plane):
    """Without the broker's caps in Redis (Redis restarted empty) there is no cap to hold a
    direct reservation to: the replica asks the broker, which puts them back."""
    await plane.register()
    # The broker's purge would put the caps back on its own; here only the reservation may.
    await plane.broker_handle.stop(0)
    await plane.start_broker(slot_cap=32, purge_interval_s=3600.0)
    stub = await plane.scheduler(
        slot_reservations="redis",
        redis_url=plane.redis_url,
        redis_prefix=plane.redis_prefix,
        spare_slots=0,
    )
    client = connect_redis(plane.redis_url)
    try:
        assert await client.delete(f"{plane.redis_prefix}slots:policy") == 1
    finally:
        await client.aclose()
    reply = await stub.Recover(recover("req-unpublished"), timeout=5)
    assert reply.action == MIGRATE and reply.slot_lease.lease_id, reply.reason
    assert await plane.slots_in_use() == 1

    def reserve_rpcs() -> int:
        return sum("ReserveSlot" in span.name for span in plane.exporter.get_finished_spans())

    assert reserve_rpcs() >= 1, "the broker granted it"
    # The broker put its caps back on the way: the next reservation takes the one hop.
    asked = reserve_rpcs()
    again = await stub.Recover(recover("req-republished"), timeout=5)
    assert again.action == MIGRATE and again.slot_lease.lease_id, again.reason
    assert reserve_rpcs() == asked and await plane.slots_in_use() == 2


async def test_concurrent_retries_of_one_recover_share_one_decision(plane):
    await plane.register()
    stub = await plane.scheduler()
    replies = await asyncio.gather(*(stub.Recover(recover("req-7"), timeout=5) for _ in range(3)))
    assert len({reply.slot_lease.lease_id for reply in replies}) == 1
    assert all(reply.action == MIGRATE for reply in replies)
    assert await plane.slots_in_use() == 1
    replayed = [span.attributes["kvrs.replayed"] for span in plane.spans("kvrs.recover")]
    assert sorted(replayed) == [False, True, True]
    # Different inputs under the same id are a new decision, not a replay.
    await stub.Recover(recover("req-7", generated_tokens=21), timeout=5)
    assert plane.spans("kvrs.recover")[-1].attributes["kvrs.replayed"] is False


async def test_recover_decides_without_the_broker_when_it_is_unreachable(plane):
    await plane.register()
    stub = await plane.scheduler()
    await plane.broker_handle.stop(0)
    reply = await stub.Recover(recover(), timeout=5)
    assert reply.action == RECOMPUTE
    assert "slot broker unreachable" in reply.reason
    skipped = await stub.Recover(recover("req-2", skip_slot=True), timeout=5)
    assert skipped.action == MIGRATE and not skipped.slot_lease.lease_id


async def test_recover_decides_without_a_slot_the_broker_refuses(plane):
    """The broker refuses a lease longer than its maximum: the recovery is still decided,
    without the slot, instead of failing."""
    await plane.register()
    stub = await plane.scheduler(slot_ttl_s=3600.0)
    reply = await stub.Recover(recover(), timeout=5)
    assert reply.action == RECOMPUTE
    assert "slot broker refused" in reply.reason and "ttl_s" in reply.reason
    assert not reply.slot_lease.lease_id and await plane.slots_in_use() == 0
    assert plane.spans("kvrs.recover")[-1].attributes["kvrs.slot.outcome"] == "refused"


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (recover(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (recover(prompt_tokens=-4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens"),
        (recover(generated_tokens=-1), grpc.StatusCode.INVALID_ARGUMENT, "generated_tokens"),
        (recover(failed="ghost"), grpc.StatusCode.NOT_FOUND, "failed_instance_id"),
        (recover(source="ghost"), grpc.StatusCode.NOT_FOUND, "source_prefill_instance_id"),
        (
            recover(source="decode-rack"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "source_prefill_instance_id",
        ),
        (
            recover(prompt_tokens=10_000_000, generated_tokens=1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "generated_tokens",
        ),
        (recover(policy="coinflip"), grpc.StatusCode.INVALID_ARGUMENT, "policy"),
    ],
)
async def test_recover_rejects_bad_input_naming_the_field(plane, request_, code, field):
    await plane.register()
    stub = await plane.scheduler()
    await expect_error(stub.Recover, request_, code, field)


# -- RecoverBatch -----------------------------------------------------------------------


def batch(size: int, **fields) -> scheduler_pb2.RecoverBatchRequest:
    return scheduler_pb2.RecoverBatchRequest(
        batch_id="b-1",
        failed_instance_id="decode-near",
        items=[
            scheduler_pb2.RecoverItem(
                request_id=f"b-1-{i}",
                source_prefill_instance_id=f"prefill-{i % 2}",
                prompt_tokens=512 + 32 * i,
                generated_tokens=i % 7,
            )
            for i in range(size)
        ],
        **fields,
    )


async def test_recover_batch_never_plans_more_migrations_than_free_slots(plane):
    await plane.register()
    await plane.broker_handle.stop(0)
    await plane.start_broker(slot_cap=10)
    held = await plane.broker.ReserveSlot(
        slots_pb2.ReserveSlotRequest(
            request_id="elsewhere",
            holder_id="other",
            src_instance_id="prefill-1",
            dst_instance_id="decode-far",
        ),
        timeout=5,
    )
    assert held.lease.lease_id
    stub = await plane.scheduler()
    reply = await stub.RecoverBatch(batch(100), timeout=30)
    assert [d.request_id for d in reply.decisions] == [f"b-1-{i}" for i in range(100)]
    moving = [d for d in reply.decisions if d.action in (MIGRATE, HYBRID)]
    assert 0 < len(moving) <= 9
    assert all(d.slot_lease.lease_id for d in moving)
    assert len({d.slot_lease.lease_id for d in moving}) == len(moving)
    assert all(not d.slot_lease.lease_id for d in reply.decisions if d not in moving)
    assert await plane.slots_in_use() == len(moving) + 1
    assert all(d.target_instance_id != "decode-near" for d in reply.decisions)
    assert reply.planned_makespan_s >= max(d.predicted_cost_s for d in reply.decisions)


@pytest.mark.parametrize("max_batch_tokens", [2048, 0], ids=["pass-budget", "none-reported"])
async def test_recover_batch_prices_a_shared_target_pass_by_pass_by_its_reported_budget(
    plane, max_batch_tokens
):
    """Four recoveries of 1,100 generated tokens each onto the one decode instance left:
    one that registered a budget of 2,048 tokens a pass has them end over three passes;
    one that reported none is priced as running them in one pass."""
    cluster = [row for row in CLUSTER if row[0] in ("prefill-0", "decode-near", "decode-rack")]
    await plane.register(cluster, max_batch_tokens=max_batch_tokens)
    stub = await plane.scheduler()
    request = scheduler_pb2.RecoverBatchRequest(
        batch_id="b-passes",
        failed_instance_id="decode-near",
        policy="always_migrate",
        skip_slot=True,
        items=[
            scheduler_pb2.RecoverItem(
                request_id=f"b-passes-{i}",
                source_prefill_instance_id="prefill-0",
                prompt_tokens=64,
                generated_tokens=1100,
            )
            for i in range(4)
        ],
    )
    reply = await stub.RecoverBatch(request, timeout=30)
    assert {d.target_instance_id for d in reply.decisions} == {"decode-rack"}
    ends = sorted({round(d.predicted_cost_s, 9) for d in reply.decisions})
    assert len(ends) == (3 if max_batch_tokens else 1)
    assert reply.planned_makespan_s == pytest.approx(ends[-1])


async def test_recover_batch_without_slots_spreads_over_links(plane):
    await plane.register()
    stub = await plane.scheduler()
    reply = await stub.RecoverBatch(batch(40, skip_slot=True), timeout=30)
    assert await plane.slots_in_use() == 0
    assert all(not d.slot_lease.lease_id for d in reply.decisions)
    assert len({d.target_instance_id for d in reply.decisions}) > 1


@pytest.mark.parametrize(
    ("mutate", "code", "field"),
    [
        (
            lambda r: setattr(r.items[3], "prompt_tokens", -1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[3].prompt_tokens",
        ),
        (
            lambda r: setattr(r.items[1], "request_id", "b-1-0"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[1].request_id",
        ),
        (
            lambda r: setattr(r.items[2], "source_prefill_instance_id", "ghost"),
            grpc.StatusCode.NOT_FOUND,
            "items[2].source_prefill_instance_id",
        ),
        (
            lambda r: setattr(r, "failed_instance_id", "ghost"),
            grpc.StatusCode.NOT_FOUND,
            "failed_instance_id",
        ),
    ],
)
async def test_recover_batch_rejects_bad_items_naming_them(plane, mutate, code, field):
    await plane.register()
    stub = await plane.scheduler()
    request = batch(5)
    mutate(request)
    await expect_error(stub.RecoverBatch, request, code, field)


# -- staleness ----------------------------------------------------------------------------


async def wait_for_a_fresh_view(stub) -> None:
    deadline = time.monotonic() + 5
    while (await stub.SelectDecode(select(), timeout=5)).view_stale:
        assert time.monotonic() < deadline, "the view never became fresh"
        await asyncio.sleep(0.05)


async def test_decisions_continue_on_a_stale_view_while_gossip_is_down(plane):
    await plane.register()
    stub = await plane.scheduler()
    await wait_for_a_fresh_view(stub)
    port = plane.gossip_port
    await plane.gossip_handle.stop(0)
    await asyncio.sleep(1.5)  # past view_stale_after_s
    stale = await stub.SelectDecode(select(), timeout=5)
    assert stale.decode_instance_id == "decode-near"
    assert stale.view_stale and stale.view_age_s > 1.0
    recovered = await stub.Recover(recover(), timeout=5)
    assert recovered.action == MIGRATE and recovered.view_stale
    assert plane.spans("kvrs.select_decode")[-1].attributes["kvrs.view_stale"] is True
    await plane.start_gossip(port)
    await wait_for_a_fresh_view(stub)


# -- spans --------------------------------------------------------------------------------


def documented_attributes() -> dict[str, set[str]]:
    """attribute name -> the span letters (S, R, B, O) docs/telemetry.md lists it for."""
    documented: dict[str, set[str]] = {}
    for line in TELEMETRY_DOC.read_text().splitlines():
        match = re.match(r"\| `(kvrs\.[^`]+)` \| \w+ \| ([SRBO ]+) \|", line)
        if match is None:
            continue
        name, spans = match.group(1), set(match.group(2).split())
        for expanded in expand(name):
            documented[expanded] = spans
    return documented


def expand(name: str) -> list[str]:
    if "<option>" in name:
        return [name.replace("<option>", a) for a in ("migrate", "recompute", "hybrid")]
    if "<action>" in name:
        return [name.replace("<action>", a) for a in ("migrate", "recompute", "hybrid", "abort")]
    return [name]


def custom_attributes(span) -> set[str]:
    return {key for key in span.attributes if key.startswith("kvrs.")}


async def test_decision_spans_carry_the_documented_attributes(plane):
    documented = documented_attributes()
    by_letter = {
        letter: {name for name, spans in documented.items() if letter in spans} for letter in "SRB"
    }
    await plane.register()
    stub = await plane.scheduler()
    await stub.SelectDecode(select(), timeout=5)
    deadline_unix_ms = int(time.time() * 1000) + 60_000
    await stub.Recover(recover(deadline_unix_ms=deadline_unix_ms), timeout=5)
    await stub.Recover(recover("req-2", source_kv_lost=True), timeout=5)
    await stub.RecoverBatch(batch(20), timeout=30)

    (select_span,) = plane.spans("kvrs.select_decode")
    assert custom_attributes(select_span) == by_letter["S"]
    migrated, recomputed = plane.spans("kvrs.recover")
    assert migrated.attributes["kvrs.action"] == "migrate"
    assert migrated.attributes["kvrs.slot.outcome"] == "granted"
    optional = {name for name in by_letter["R"] if name.endswith(".infeasible_reason")}
    assert by_letter["R"] - optional <= custom_attributes(migrated)
    assert custom_attributes(migrated) <= by_letter["R"]
    assert recomputed.attributes["kvrs.slot.outcome"] == "not_needed"
    assert "kvrs.option.migrate.infeasible_reason" in custom_attributes(recomputed)
    assert custom_attributes(recomputed) <= by_letter["R"]
    (batch_span,) = plane.spans("kvrs.recover_batch")
    assert custom_attributes(batch_span) == by_letter["B"]
    assert batch_span.attributes["kvrs.batch.requests"] == 20
    assert (
        sum(
            batch_span.attributes[f"kvrs.batch.{a}"]
            for a in ("migrate", "recompute", "hybrid", "abort")
        )
        == 20
    )
    # The slot reservation is traced as a child of the decision.
    reserve = [
        s
        for s in plane.exporter.get_finished_spans()
        if s.name.endswith("SlotBrokerService/ReserveSlot")
        and s.parent is not None
        and s.parent.span_id == migrated.context.span_id
    ]
    assert reserve


# -- outcomes ---------------------------------------------------------------------------


def outcome(request_id: str, kind: str = "migrate", measured_s: float = 0.2, **fields):
    return scheduler_pb2.DecisionOutcome(
        kind=kind,
        request_id=request_id,
        source_instance_id="prefill-0",
        target_instance_id="decode-rack",
        decided_unix_ms=int(time.time() * 1000),
        predicted=common_pb2.DecisionTerms(total_s=0.1, extend_s=0.05),
        measured=common_pb2.DecisionTerms(total_s=measured_s, extend_s=0.1),
        cached_tokens=1000,
        extend_tokens=20,
        **fields,
    )


async def test_recover_splits_its_prediction_into_terms(plane):
    await plane.register()
    stub = await plane.scheduler()
    reply = await stub.Recover(recover(), timeout=5)
    assert reply.action == MIGRATE, reply.reason
    terms = reply.predicted_terms
    migrate = next(o for o in reply.options if o.action == MIGRATE)
    assert terms.total_s == pytest.approx(reply.predicted_cost_s)
    assert terms.target_wait_s == pytest.approx(migrate.wait_s)
    assert terms.setup_s + terms.stream_s == pytest.approx(migrate.transfer_s)
    assert terms.setup_s > 0.0 and terms.stream_s > 0.0
    assert terms.extend_s == pytest.approx(migrate.compute_s)
    assert terms.source_wait_s == terms.prefill_s == 0.0


async def test_replicas_share_reported_outcomes_and_fit_the_same_corrections(plane):
    await plane.register()
    first = await plane.scheduler(learning_refresh_s=0.05)
    second = await plane.scheduler(learning_refresh_s=0.05)
    for i in range(4):
        reply = await first.ReportOutcome(
            scheduler_pb2.ReportOutcomeRequest(outcome=outcome(f"r-{i}")), timeout=5
        )
    assert reply.stored_outcomes == 4
    # A retried report (same outcome) is stored once.
    again = await first.ReportOutcome(
        scheduler_pb2.ReportOutcomeRequest(outcome=outcome("r-3")), timeout=5
    )
    assert again.stored_outcomes in (4, 5)
    deadline = time.monotonic() + 5.0
    while True:
        seen = await second.GetCorrections(scheduler_pb2.GetCorrectionsRequest(), timeout=5)
        if seen.samples >= 4 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    mine = await first.GetCorrections(scheduler_pb2.GetCorrectionsRequest(), timeout=5)
    assert seen.samples == mine.samples >= 4
    errors = {(e.kind, e.term): e for e in seen.errors}
    assert errors[("migrate", "total_s")].p50 == pytest.approx(0.5)
    assert seen.compute_factor == mine.compute_factor != 1.0


async def test_a_reported_outcome_notes_the_wait_corrections_its_prediction_held(plane):
    """decode-rack answers its first decode steps 3 ms after the 1 ms its W(x) says. Once
    the scheduler has learned that, placements predicted with it (4 ms) and measured at
    4 ms still teach 3 ms: each reported outcome carries the correction it was priced
    with, and the wait is fitted against the prediction without it."""
    await plane.register()
    stub = await plane.scheduler(learning_refresh_s=0.05)

    def placement(request_id: str, predicted_wait_s: float) -> scheduler_pb2.DecisionOutcome:
        return scheduler_pb2.DecisionOutcome(
            kind="placement",
            request_id=request_id,
            source_instance_id="prefill-0",
            target_instance_id="decode-rack",
            decided_unix_ms=int(time.time() * 1000),
            predicted=common_pb2.DecisionTerms(
                target_wait_s=predicted_wait_s, total_s=predicted_wait_s
            ),
            measured=common_pb2.DecisionTerms(target_wait_s=0.004, total_s=0.004),
            cached_tokens=100,
            extend_tokens=1,
        )

    for i in range(3):
        request = scheduler_pb2.ReportOutcomeRequest(outcome=placement(f"cold-{i}", 0.001))
        await stub.ReportOutcome(request, timeout=5)
    learned = await stub.GetCorrections(scheduler_pb2.GetCorrectionsRequest(), timeout=5)
    assert learned.worker_wait_s["decode-rack"] == pytest.approx(0.003)
    for i in range(4):
        request = scheduler_pb2.ReportOutcomeRequest(outcome=placement(f"warm-{i}", 0.004))
        await stub.ReportOutcome(request, timeout=5)
    again = await stub.GetCorrections(scheduler_pb2.GetCorrectionsRequest(), timeout=5)
    assert again.worker_wait_s["decode-rack"] == pytest.approx(0.003)
    client = connect_redis(plane.redis_url)
    try:
        members = await client.zrange(f"{plane.redis_prefix}outcomes", 0, -1)
        stored = [json.loads(member) for member in members]
    finally:
        await client.aclose()
    noted = {o["request_id"]: o["learned_target_wait_s"] for o in stored}
    assert noted["cold-0"] == 0.0
    assert noted["warm-3"] == pytest.approx(0.003)


async def test_report_outcome_rejects_a_bad_outcome_naming_the_field(plane):
    stub = await plane.scheduler()
    await expect_error(
        stub.ReportOutcome,
        scheduler_pb2.ReportOutcomeRequest(outcome=outcome("r", kind="teleport")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "outcome.kind",
    )
    await expect_error(
        stub.ReportOutcome,
        scheduler_pb2.ReportOutcomeRequest(outcome=outcome("r", measured_s=-1.0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "outcome.measured.total_s",
    )


async def test_a_burst_of_placements_is_priced_with_the_work_the_scheduler_sent(plane):
    """Placements milliseconds apart, before any heartbeat: each one's W(d) holds the
    pulls and first steps this scheduler has just sent to that instance."""
    await plane.register(kv_capacity_blocks=4096)
    stub = await plane.scheduler(view_refresh_s=3600.0, view_stale_after_s=3600.0)
    # A slow link: each pull is predicted to take seconds, so none is done before the
    # next placement however slowly this machine runs the test.
    await plane.link("prefill-0", "decode-rack", bandwidth_bps=1e8)
    await plane.refresh()
    replies = [
        await stub.SelectDecode(
            select(f"burst-{k}", prompt_tokens=2048, candidate_instance_ids=["decode-rack"]),
            timeout=5,
        )
        for k in range(4)
    ]
    assert {r.decode_instance_id for r in replies} == {"decode-rack"}
    assert [r.planned_jobs for r in replies] == [1, 2, 3, 4]
    assert replies[0].wait_s == 0.0
    assert replies[0].transfer_s > 1.0
    for before, after in zip(replies, replies[1:], strict=False):
        sent_s = before.transfer_s + before.predicted_terms.extend_s
        # Less only the time that passed between the two (milliseconds of seconds).
        assert after.wait_s == pytest.approx(before.wait_s + sent_s, rel=1e-2)
        assert after.predicted_ttft_s > before.predicted_ttft_s
