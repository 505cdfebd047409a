"""The launcher with a process on a host of its own: a worker in a network namespace, the
control plane on the namespaces' bridge. The chaos soak runs its workers this way, so a
link flap can blackhole one worker's link with tc."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc
import pytest
from reliability_stack import delete_prefix, unique_prefix

from bench import netns as netns_lab
from kvrs.cli.launcher import SERVICES, ClusterOptions, Host, start_cluster, stop_cluster
from kvrs.v1 import gossip_pb2, gossip_pb2_grpc

WHY_NOT = netns_lab.available()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(180),
    pytest.mark.skipif(bool(WHY_NOT), reason=f"network namespaces: {WHY_NOT}"),
]


def network_namespace(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_a_worker_on_its_own_host_listens_registers_and_runs_there(tmp_path: Path, redis_url):
    lab = netns_lab.NetnsLab(("decode-0",)).start()
    prefix = unique_prefix("hosts")
    options = ClusterOptions(
        run_dir=tmp_path / "cluster",
        workers_model="tiny",
        redis_url=redis_url,
        redis_prefix=prefix,
        host=lab.host_ip,
        hosts={"decode-0": Host(lab.ips["decode-0"], lab.exec_prefix("decode-0"))},
        startup_timeout_s=120,
    )
    try:
        state = start_cluster(options, [s for s in SERVICES if s.name in ("gossip", "decode-0")])
        try:
            gossip, worker = state.address("gossip"), state.address("decode-0")
            assert gossip.startswith(f"{lab.host_ip}:"), gossip
            assert worker.startswith(f"{lab.ips['decode-0']}:"), worker
            with grpc.insecure_channel(gossip) as channel:
                listed = gossip_pb2_grpc.GossipServiceStub(channel).ListNodes(
                    gossip_pb2.ListNodesRequest(), timeout=5
                )
            nodes = {node.instance_id: node for node in listed.nodes}
            assert set(nodes) == {"decode-0"}
            assert nodes["decode-0"].address == worker
            assert nodes["decode-0"].transfer_address.startswith(f"{lab.ips['decode-0']}:")
            record = next(r for r in state.processes if r.name == "decode-0")
            assert network_namespace(record.pid) != network_namespace(os.getpid())
            gossip_pid = next(r for r in state.processes if r.name == "gossip").pid
            assert network_namespace(gossip_pid) == network_namespace(os.getpid())
            # Its port is open only inside its namespace: nothing answers on the host's.
            port = int(worker.rpartition(":")[2])
            with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
                probe.connect(("127.0.0.1", port))
        finally:
            stop_cluster(options.run_dir, grace_s=5.0)
    finally:
        lab.stop()
        delete_prefix(redis_url, prefix)
