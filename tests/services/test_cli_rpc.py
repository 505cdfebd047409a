"""`kvrs rpc` against a real gossip server: calls through server reflection, plaintext and
mTLS, and the exit status and message of each kind of bad input."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import GrpcSettings, TlsConfig, setup_tracing
from services.gossip.config import Config
from services.gossip.server import build_server

ROOT = Path(__file__).resolve().parents[2]
REGISTER = {
    "request_id": "r-1",
    "instance_id": "decode-rpc",
    "role": "ROLE_DECODE",
    "address": "127.0.0.1:1",
    "location": {"node": "n0", "rack": "r0", "pod": "p0"},
    "heartbeat_ttl_s": 30,
}


async def kvrs_rpc(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`python -m kvrs rpc ARGV` in its own process (a blocking client beside this loop's
    server), with no local cluster to pick addresses from."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvrs",
        "rpc",
        "--dir",
        str(ROOT / "runs" / "no-cluster-here"),
        *argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def start_gossip(redis_url: str, redis_prefix: str, settings: GrpcSettings):
    config = Config(
        listen_addr="127.0.0.1:0", redis_url=redis_url, redis_prefix=redis_prefix, grpc=settings
    )
    return await build_server(config, setup_tracing("test-rpc", exporter=InMemorySpanExporter()))


@pytest.fixture
async def gossip(redis_url, redis_prefix):
    handle = await start_gossip(redis_url, redis_prefix, GrpcSettings())
    yield f"127.0.0.1:{handle.port}"
    await handle.stop(0)


async def test_rpc_registers_and_lists_a_node_through_reflection(gossip):
    status, out, err = await kvrs_rpc(
        "--addr", gossip, "kvrs.v1.GossipService/RegisterNode", json.dumps(REGISTER)
    )
    assert status == 0, err
    assert json.loads(out)["node"]["instance_id"] == "decode-rpc"
    # The package may be left out; the reply uses the .proto's field names.
    status, out, err = await kvrs_rpc("--addr", gossip, "GossipService/ListNodes", "{}")
    assert status == 0, err
    nodes = json.loads(out)["nodes"]
    assert [n["instance_id"] for n in nodes] == ["decode-rpc"]
    assert nodes[0]["state"] == "NODE_STATE_ALIVE"


async def test_rpc_list_names_the_services_and_a_services_methods(gossip):
    status, out, err = await kvrs_rpc("--addr", gossip, "--list")
    assert status == 0, err
    services = out.split()
    assert "kvrs.v1.GossipService" in services and "grpc.health.v1.Health" in services
    status, out, err = await kvrs_rpc("--addr", gossip, "--list", "GossipService")
    assert status == 0, err
    assert (
        "kvrs.v1.GossipService/WatchEvents(kvrs.v1.WatchEventsRequest) returns "
        "(stream kvrs.v1.NodeEvent)"
    ) in out.splitlines()


async def test_rpc_bad_input_exits_2_naming_what_is_wrong(gossip):
    status, _, err = await kvrs_rpc(
        "--addr", gossip, "GossipService/ListNodes", '{"no_such_field": 1}'
    )
    assert status == 2 and "no_such_field" in err and "kvrs.v1.ListNodesRequest" in err, err
    status, _, err = await kvrs_rpc("--addr", gossip, "GossipService/Nope")
    assert status == 2 and "no method 'Nope'" in err, err
    status, _, err = await kvrs_rpc("--addr", gossip, "kvrs.v1.NoService/ListNodes")
    assert status == 2 and "no service 'kvrs.v1.NoService'" in err, err
    status, _, err = await kvrs_rpc("--addr", gossip, "GossipService/ListNodes", "{not json")
    assert status == 2 and "not JSON" in err, err


async def test_rpc_reports_the_servers_status_code(gossip):
    request = {**REGISTER, "instance_id": ""}
    status, _, err = await kvrs_rpc(
        "--addr", gossip, "GossipService/RegisterNode", json.dumps(request)
    )
    assert status == 1 and err.startswith("kvrs rpc: INVALID_ARGUMENT:"), err
    assert "instance_id" in err


async def test_rpc_over_mtls_uses_the_kvrs_tls_variables(redis_url, redis_prefix, certs):
    server_tls = TlsConfig(
        cert_file=str(certs / "server.pem"),
        key_file=str(certs / "server.key"),
        ca_file=str(certs / "ca.pem"),
        require_client_cert=True,
    )
    handle = await start_gossip(redis_url, redis_prefix, GrpcSettings(tls=server_tls))
    address = f"localhost:{handle.port}"
    try:
        client_env = {
            "KVRS_TLS_CERT_FILE": str(certs / "client.pem"),
            "KVRS_TLS_KEY_FILE": str(certs / "client.key"),
            "KVRS_TLS_CA_FILE": str(certs / "ca.pem"),
        }
        status, out, err = await kvrs_rpc(
            "--addr", address, "GossipService/ListNodes", env=client_env
        )
        assert status == 0, err
        reply = json.loads(out)
        assert "server_unix_ms" in reply and "nodes" not in reply  # none under a fresh prefix
        status, _, err = await kvrs_rpc("--addr", address, "GossipService/ListNodes")
        assert status == 1 and "UNAVAILABLE" in err, err
    finally:
        await handle.stop(0)


async def test_rpc_help_shows_usage_and_examples():
    status, out, err = await kvrs_rpc("--help")
    assert status == 0, err
    assert "SERVICE/METHOD" in out and "kvrs rpc kvrs.v1.GossipService/ListNodes" in out
