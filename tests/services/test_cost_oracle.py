"""Cost oracle over a real gossip store: transfer estimates, cost matrices, compute times."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.model import model_spec
from kvrs.profile import compute_profile
from kvrs.topology import DEFAULT_TIERS, Tier
from kvrs.v1 import oracle_pb2, oracle_pb2_grpc
from services.common import GrpcSettings, open_channel, setup_tracing
from services.common.decision_inputs import InputsConfig
from services.common.gossip_records import LinkSample, Registration
from services.cost_oracle.config import Config
from services.cost_oracle.server import build_server
from services.gossip.client import GossipClient
from services.gossip.config import Config as GossipConfig
from services.gossip.server import build_server as build_gossip

TOPOLOGY_YAML = """
setup_latency_ms: 1.0
nodes:
  - {name: n0, rack: r0, pod: p0}
  - {name: n1, rack: r0, pod: p0}
instances:
  - {id: prefill-0, role: prefill, node: n0, gpu_index: 0}
  - {id: decode-0, role: decode, node: n0, gpu_index: 1}
"""
BYTES_PER_TOKEN = model_spec("opt-125m").kv_bytes_per_token


def registration(instance_id: str, role: str, node: str, rack: str, pod: str) -> Registration:
    return Registration(
        instance_id=instance_id,
        role=role,
        address=f"{instance_id}:50060",
        node=node,
        rack=rack,
        pod=pod,
        heartbeat_ttl_s=600.0,
    )


@pytest.fixture
async def cluster(any_redis_url, redis_prefix, tmp_path):
    """Gossip with prefill-0 and decode-0 in the topology file, decode-1 (same rack) and
    decode-2 (another pod) known only to gossip, and an oracle over both; gossip's
    registry on one Redis and on the three-primary Redis Cluster."""
    provider = setup_tracing("test-oracle", exporter=InMemorySpanExporter())
    gossip = await build_gossip(
        GossipConfig(listen_addr="127.0.0.1:0", redis_url=any_redis_url, redis_prefix=redis_prefix),
        provider,
    )
    client = GossipClient(f"127.0.0.1:{gossip.port}", timeout_s=5)
    for reg in (
        registration("prefill-0", "prefill", "n0", "r0", "p0"),
        registration("decode-0", "decode", "n0", "r0", "p0"),
        registration("decode-1", "decode", "n1", "r0", "p0"),
        registration("decode-2", "decode", "n9", "r9", "p9"),
    ):
        await client.register(reg)
    topology_file = tmp_path / "topology.yaml"
    topology_file.write_text(TOPOLOGY_YAML)
    config = Config(
        listen_addr="127.0.0.1:0",
        gossip_addr=f"127.0.0.1:{gossip.port}",
        refresh_s=0.05,
        inputs=InputsConfig(topology_file=str(topology_file), model="opt-125m"),
    )
    oracle = await build_server(config, provider)
    channel = open_channel(f"127.0.0.1:{oracle.port}", GrpcSettings())
    yield oracle_pb2_grpc.CostOracleServiceStub(channel), client, oracle
    await channel.close()
    await oracle.stop(0)
    await client.close()
    await gossip.stop(0)


async def estimate(stub, src: str, dst: str, **size) -> oracle_pb2.EstimateTransferResponse:
    request = oracle_pb2.EstimateTransferRequest(src_instance_id=src, dst_instance_id=dst, **size)
    return (await stub.EstimateTransfer(request, timeout=5)).estimate


async def test_transfer_follows_the_topology_tier_of_file_and_gossip_instances(cluster):
    stub, _, _ = cluster
    same_node = await estimate(stub, "prefill-0", "decode-0", tokens=1000)
    same_rack = await estimate(stub, "prefill-0", "decode-1", tokens=1000)
    spine = await estimate(stub, "prefill-0", "decode-2", tokens=1000)
    assert [same_node.tier, same_rack.tier, spine.tier] == [Tier.NODE, Tier.RACK, Tier.SPINE]
    assert same_node.kv_bytes == 1000 * BYTES_PER_TOKEN
    assert same_rack.bottleneck_bandwidth_bps == DEFAULT_TIERS[Tier.RACK].capacity_bps
    assert spine.bottleneck_bandwidth_bps == DEFAULT_TIERS[Tier.SPINE].capacity_bps
    assert same_node.transfer_s < same_rack.transfer_s < spine.transfer_s
    assert same_rack.telemetry_age_s < 0 and not same_rack.telemetry_stale
    expected = same_rack.rtt_s + 8 * 1000 * BYTES_PER_TOKEN / same_rack.bottleneck_bandwidth_bps
    assert same_rack.transfer_s == pytest.approx(expected)


async def test_a_link_sample_replaces_the_topology_capacity(cluster):
    stub, client, oracle = cluster
    await client.report_link_sample(
        LinkSample(
            src_instance_id="prefill-0",
            dst_instance_id="decode-1",
            bandwidth_bps=2e9,
            rtt_s=0.004,
            samples=3,
        )
    )
    assert await oracle.view.refresh()
    measured = await estimate(stub, "prefill-0", "decode-1", kv_bytes=10**8)
    assert measured.bottleneck_bandwidth_bps == pytest.approx(2e9)
    assert measured.rtt_s == pytest.approx(0.004)
    assert 0 <= measured.telemetry_age_s < 5
    assert measured.transfer_s == pytest.approx(0.004 + 8 * 10**8 / 2e9)


async def test_cost_matrix_covers_every_alive_pair_by_default(cluster):
    stub, _, _ = cluster
    reply = await stub.GetCostMatrix(oracle_pb2.GetCostMatrixRequest(tokens=512), timeout=5)
    assert list(reply.decode_instance_ids) == ["decode-0", "decode-1", "decode-2"]
    assert [row.prefill_instance_id for row in reply.rows] == ["prefill-0"]
    row = reply.rows[0].to_decode
    assert [e.dst_instance_id for e in row] == ["decode-0", "decode-1", "decode-2"]
    assert [e.tier for e in row] == [Tier.NODE, Tier.RACK, Tier.SPINE]
    chosen = await stub.GetCostMatrix(
        oracle_pb2.GetCostMatrixRequest(
            prefill_instance_ids=["prefill-0"], decode_instance_ids=["decode-2"], kv_bytes=7
        ),
        timeout=5,
    )
    assert [e.kv_bytes for e in chosen.rows[0].to_decode] == [7]


async def test_compute_estimate_uses_the_model_profile(cluster):
    stub, _, _ = cluster
    profile = compute_profile("opt-125m")
    prefill = await stub.EstimateCompute(
        oracle_pb2.EstimateComputeRequest(new_tokens=512), timeout=5
    )
    assert prefill.compute_s == pytest.approx(profile.prefill_s(512))
    assert prefill.kv_bytes == 512 * BYTES_PER_TOKEN and prefill.model == "opt-125m"
    extend = await stub.EstimateCompute(
        oracle_pb2.EstimateComputeRequest(cached_tokens=512, new_tokens=64), timeout=5
    )
    assert extend.compute_s == pytest.approx(profile.extend_s(512, 64))
    assert extend.kv_bytes == 576 * BYTES_PER_TOKEN


@pytest.mark.parametrize(
    ("call", "request_", "code", "field"),
    [
        (
            "EstimateTransfer",
            oracle_pb2.EstimateTransferRequest(
                src_instance_id="prefill-0", dst_instance_id="nope", tokens=1
            ),
            grpc.StatusCode.NOT_FOUND,
            "dst_instance_id",
        ),
        (
            "EstimateTransfer",
            oracle_pb2.EstimateTransferRequest(
                src_instance_id="", dst_instance_id="decode-0", tokens=1
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "src_instance_id",
        ),
        (
            "EstimateTransfer",
            oracle_pb2.EstimateTransferRequest(
                src_instance_id="prefill-0", dst_instance_id="decode-0"
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "kv_bytes",
        ),
        (
            "EstimateTransfer",
            oracle_pb2.EstimateTransferRequest(
                src_instance_id="prefill-0", dst_instance_id="decode-0", tokens=-5
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tokens",
        ),
        (
            "GetCostMatrix",
            oracle_pb2.GetCostMatrixRequest(decode_instance_ids=["decode-0", "ghost"], tokens=1),
            grpc.StatusCode.NOT_FOUND,
            "decode_instance_ids[1]",
        ),
        (
            "EstimateCompute",
            oracle_pb2.EstimateComputeRequest(new_tokens=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "new_tokens",
        ),
        (
            "EstimateCompute",
            oracle_pb2.EstimateComputeRequest(cached_tokens=-1, new_tokens=3),
            grpc.StatusCode.INVALID_ARGUMENT,
            "cached_tokens",
        ),
    ],
)
async def test_bad_input_names_the_field(cluster, call, request_, code, field):
    stub, _, _ = cluster
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await getattr(stub, call)(request_, timeout=5)
    assert failure.value.code() == code
    assert failure.value.details().startswith(f"{field}:")
