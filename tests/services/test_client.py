"""KvrsClient against real servers: scheduler failover, deadlines, error mapping, reads."""

from __future__ import annotations

import asyncio
import socket

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs import errors
from kvrs.client import KvrsClient, parse_addresses
from kvrs.v1 import common_pb2
from services.common import ConfigError, setup_tracing
from services.common.decision_inputs import InputsConfig
from services.common.gossip_records import LinkSample, Registration
from services.cost_oracle.config import Config as OracleConfig
from services.cost_oracle.server import build_server as build_oracle
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip
from services.scheduler.config import Config as SchedulerConfig
from services.scheduler.server import build_server as build_scheduler

TOPOLOGY_YAML = """
setup_latency_ms: 1.0
nodes:
  - {name: n0, rack: r0, pod: p0}
  - {name: n1, rack: r0, pod: p0}
instances:
  - {id: prefill-0, role: prefill, node: n0, gpu_index: 0}
  - {id: decode-0, role: decode, node: n0, gpu_index: 1}
  - {id: decode-1, role: decode, node: n1, gpu_index: 0}
"""
SELECT_DECODE = "/kvrs.v1.SchedulerService/SelectDecode"


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def cluster(redis_url, redis_prefix, tmp_path):
    """Gossip with one prefill and two decode instances, two scheduler replicas, an oracle."""
    provider = setup_tracing("test-client-servers", exporter=InMemorySpanExporter())
    gossip = await build_gossip(
        GossipConfig(listen_addr="127.0.0.1:0", redis_url=redis_url, redis_prefix=redis_prefix),
        provider,
    )
    gossip_addr = f"127.0.0.1:{gossip.port}"
    registry = GossipClient(gossip_addr, timeout_s=5)
    for instance_id, role, node in (
        ("prefill-0", "prefill", "n0"),
        ("decode-0", "decode", "n0"),
        ("decode-1", "decode", "n1"),
    ):
        await registry.register(
            Registration(
                instance_id=instance_id,
                role=role,
                address=f"{instance_id}:50060",
                node=node,
                rack="r0",
                pod="p0",
                heartbeat_ttl_s=600.0,
            )
        )
    await registry.report_link_sample(LinkSample("prefill-0", "decode-1", bandwidth_bps=8e9))
    topology_file = tmp_path / "topology.yaml"
    topology_file.write_text(TOPOLOGY_YAML)
    inputs = InputsConfig(topology_file=str(topology_file), model="opt-125m")
    schedulers = [
        await build_scheduler(
            SchedulerConfig(
                listen_addr="127.0.0.1:0",
                gossip_addr=gossip_addr,
                slot_broker_addr=f"127.0.0.1:{closed_port()}",
                view_refresh_s=0.05,
                inputs=inputs,
                holder_id=f"scheduler-{index}",
                redis_url=redis_url,
                redis_prefix=redis_prefix,
            ),
            provider,
        )
        for index in (1, 2)
    ]
    oracle = await build_oracle(
        OracleConfig(
            listen_addr="127.0.0.1:0", gossip_addr=gossip_addr, refresh_s=0.05, inputs=inputs
        ),
        provider,
    )
    yield {
        "gossip": gossip_addr,
        "schedulers": schedulers,
        "scheduler_addrs": [f"127.0.0.1:{s.port}" for s in schedulers],
        "oracle": f"127.0.0.1:{oracle.port}",
    }
    for handle in (oracle, *schedulers):
        await handle.stop(0)
    await registry.close()
    await gossip.stop(0)


def traced_client(addresses, **kwargs) -> tuple[KvrsClient, InMemorySpanExporter]:
    """A client whose every attempt is a span, so tests can count attempts per replica."""
    exporter = InMemorySpanExporter()
    provider = setup_tracing("test-client", exporter=exporter)
    return KvrsClient(addresses, provider=provider, **kwargs), exporter


def attempts(exporter: InMemorySpanExporter) -> int:
    return sum(1 for span in exporter.get_finished_spans() if span.name == SELECT_DECODE)


async def select(client: KvrsClient):
    return await client.select_decode("prefill-0", prompt_tokens=2048, request_id="r-1")


async def wait_until_placed(client: KvrsClient) -> None:
    """Schedulers answer FAILED_PRECONDITION until their first view has the instances."""
    for _ in range(100):
        try:
            await select(client)
            return
        except errors.FailedPrecondition:
            await asyncio.sleep(0.05)
    await select(client)


async def test_a_call_fails_over_to_the_second_scheduler_when_the_first_is_stopped(cluster):
    first, second = cluster["scheduler_addrs"]
    client, exporter = traced_client([first, second], timeout_s=2.0)
    async with client:
        await wait_until_placed(client)
        assert client.preferred_scheduler == first
        before = attempts(exporter)
        await cluster["schedulers"][0].stop(0)

        choice = await select(client)

        assert choice.decode_instance_id in ("decode-0", "decode-1")
        assert client.preferred_scheduler == second
        assert attempts(exporter) - before == 2
        before = attempts(exporter)
        await select(client)
        assert attempts(exporter) - before == 1, "the replica that answered is tried first"


async def test_a_stuck_scheduler_costs_one_deadline_then_the_next_replica_answers(cluster):
    live = cluster["scheduler_addrs"][1]
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(8)
        stuck_addr = f"127.0.0.1:{stuck.getsockname()[1]}"
        client, exporter = traced_client([stuck_addr, live], timeout_s=0.5)
        async with client:
            await wait_until_placed(client)
            assert client.preferred_scheduler == live
            assert attempts(exporter) >= 2


async def test_no_replica_answering_raises_unavailable_after_max_attempts():
    dead = [f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"]
    client, exporter = traced_client(dead, timeout_s=1.0, max_attempts=3, backoff_s=0.01)
    async with client:
        with pytest.raises(errors.Unavailable) as caught:
            await select(client)
    assert attempts(exporter) == 3
    assert caught.value.__cause__ is not None
    assert any(address in str(caught.value) for address in dead)


async def test_an_invalid_request_is_not_retried_and_names_its_field(cluster):
    client, exporter = traced_client(cluster["scheduler_addrs"], timeout_s=2.0)
    async with client:
        await wait_until_placed(client)
        before = attempts(exporter)
        with pytest.raises(errors.InvalidArgument) as caught:
            await client.select_decode("prefill-0", prompt_tokens=-5)
    assert attempts(exporter) - before == 1
    assert caught.value.field == "prompt_tokens"


async def test_oracle_and_gossip_reads_go_through_the_same_client(cluster):
    client = KvrsClient(
        cluster["scheduler_addrs"],
        cost_oracle_addr=cluster["oracle"],
        gossip_addr=cluster["gossip"],
        timeout_s=2.0,
    )
    async with client:
        nodes = await client.list_nodes("decode")
        links = await client.list_links()
        estimate = await client.estimate_transfer("prefill-0", "decode-1", kv_bytes=10**9)
        with pytest.raises(errors.FailedPrecondition, match="slot broker"):
            await client.get_slot_stats()
    assert sorted(n.instance_id for n in nodes.nodes) == ["decode-0", "decode-1"]
    assert all(n.role == common_pb2.ROLE_DECODE for n in nodes.nodes)
    assert [(link.src_instance_id, link.dst_instance_id) for link in links.links] == [
        ("prefill-0", "decode-1")
    ]
    assert estimate.kv_bytes == 10**9
    assert estimate.transfer_s > 0


def test_from_env_reads_every_address_and_rejects_a_malformed_list():
    client = KvrsClient.from_env(
        {
            "SCHEDULER_ADDRS": "a:50053, b:50053",
            "COST_ORACLE_ADDR": "cost-oracle:50052",
            "KVRS_CLIENT_TIMEOUT_S": "0.25",
        }
    )
    assert client.scheduler_addrs == ("a:50053", "b:50053")
    assert client.timeout_s == 0.25
    with pytest.raises(ConfigError, match="SCHEDULER_ADDRS"):
        parse_addresses("scheduler-1", "SCHEDULER_ADDRS")
    with pytest.raises(ConfigError, match="KVRS_CLIENT_TIMEOUT_S"):
        KvrsClient.from_env({"KVRS_CLIENT_TIMEOUT_S": "soon"})
