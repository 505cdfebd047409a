"""A network link between two workers cut (network namespaces): who notices, who avoids it.

prefill-0, decode-0 (same node: the placement every policy prefers) and decode-1 (across
the spine) run as real worker processes, each in its own network namespace on one bridge;
gossip, the slot broker, the scheduler and the prober run on the bridge's host address.
decode-1's link is shaped to 100 Mbit/s, so every policy and every measurement prefers
decode-0. The prefill-0 <-> decode-0 link is then cut with iptables in both namespaces:
silent drops, no reset, while both still reach the control plane and decode-1.
"""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
from reliability_stack import ControlPlane, ServiceProcess, unique_prefix

from bench import netns as netns_lab
from kvrs.v1 import (
    prober_pb2,
    prober_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

WORKERS = {
    # name: (role, node, rack, pod)
    "prefill-0": ("prefill", "n0", "r0", "p0"),
    "decode-0": ("decode", "n0", "r0", "p0"),
    "decode-1": ("decode", "n5", "r5", "p5"),
}
WORKER_PORT = 50060
SLOW_LINK = "100mbit"
PULL_DEADLINE_S = 5.0
TRANSFER_TIMEOUT_S = 2.0

WHY_NOT = netns_lab.available()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(180),
    pytest.mark.skipif(bool(WHY_NOT), reason=f"network namespaces: {WHY_NOT}"),
]


@pytest.fixture(scope="module")
def lab(redis_url, tmp_path_factory):
    netns = netns_lab.NetnsLab(tuple(WORKERS)).start()
    netns.shape("decode-1", SLOW_LINK)
    plane = None
    workers = {}
    try:
        plane = ControlPlane(
            redis_url, unique_prefix("netns"), host=netns.host_ip, model="tiny"
        ).start(services=("gossip", "slot-broker", "scheduler", "prober"), cluster=())
        log_dir = tmp_path_factory.mktemp("netns-logs")
        for name, (role, node, rack, pod) in WORKERS.items():
            address = f"{netns.ips[name]}:{WORKER_PORT}"
            workers[name] = (
                address,
                ServiceProcess(
                    name,
                    "services.worker",
                    {
                        "WORKER_INSTANCE_ID": name,
                        "WORKER_LISTEN_ADDR": f"0.0.0.0:{WORKER_PORT}",
                        "WORKER_ADVERTISE_ADDR": address,
                        "WORKER_TRANSFER_HOST": netns.ips[name],
                        "WORKER_NODE": node,
                        "WORKER_RACK": rack,
                        "WORKER_POD": pod,
                        "GOSSIP_ADDR": plane.addresses["gossip"],
                        "KVRS_MODEL": "tiny",
                        "WORKER_HEARTBEAT_TTL_S": "2.0",
                        "WORKER_TRANSFER_TIMEOUT_S": str(TRANSFER_TIMEOUT_S),
                        "KVRS_LOG_LEVEL": "WARNING",
                    },
                    log_dir,
                    args=("--role", role),
                    prefix=netns.exec_prefix(name),
                ).start(),
            )
        for address, process in workers.values():
            process.wait_serving(address, timeout_s=90)
        wait_for_placement(plane)
        yield netns, plane, workers
    finally:
        for _, process in workers.values():
            process.kill()
        if plane is not None:
            plane.stop()
        netns.stop()


def wait_for_placement(plane: ControlPlane, timeout_s: float = 30.0) -> None:
    """Until the scheduler sees every worker (they register after their canary)."""
    deadline = time.monotonic() + timeout_s
    with plane.channel("scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        while True:
            try:
                reply = stub.SelectDecode(select(), timeout=5)
                if reply.candidates_considered == 2:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "the workers never became candidates"
            time.sleep(0.2)


def select() -> scheduler_pb2.SelectDecodeRequest:
    return scheduler_pb2.SelectDecodeRequest(
        request_id=uuid.uuid4().hex, prefill_instance_id="prefill-0", prompt_tokens=256
    )


def probe(plane, src: str, dst: str) -> tuple[prober_pb2.LinkEstimate | None, str, float]:
    with plane.channel("prober") as channel:
        stub = prober_pb2_grpc.ProberServiceStub(channel)
        started_s = time.monotonic()
        try:
            reply = stub.ProbeLink(
                prober_pb2.ProbeLinkRequest(src_instance_id=src, dst_instance_id=dst), timeout=30
            )
            return reply.link, "", time.monotonic() - started_s
        except grpc.RpcError as exc:
            return None, f"{exc.code().name}: {exc.details()}", time.monotonic() - started_s


def estimates(plane) -> dict[tuple[str, str], prober_pb2.LinkEstimate]:
    with plane.channel("prober") as channel:
        reply = prober_pb2_grpc.ProberServiceStub(channel).ListLinkEstimates(
            prober_pb2.ListLinkEstimatesRequest(), timeout=10
        )
    return {(link.src_instance_id, link.dst_instance_id): link for link in reply.links}


def prefill_then_pull(workers, request_id: str, target: str, timeout_s: float = 30) -> float:
    """A prompt prefilled on prefill-0 and its KV pulled to `target`; seconds of the pull."""
    src_address, _ = workers["prefill-0"]
    dst_address, _ = workers[target]
    with grpc.insecure_channel(src_address) as src, grpc.insecure_channel(dst_address) as dst:
        worker_pb2_grpc.WorkerServiceStub(src).Prefill(
            worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=list(range(64))),
            timeout=30,
        )
        reply = worker_pb2_grpc.WorkerServiceStub(dst).PullKv(
            worker_pb2.PullKvRequest(
                request_id=request_id,
                source_instance_id="prefill-0",
                source_address=src_address,
                token_start=0,
                token_end=64,
            ),
            timeout=timeout_s,
        )
        return reply.total_s


def test_a_cut_link_is_noticed_by_the_prober_and_spares_the_others(lab):
    netns, plane, workers = lab
    measured = {}
    for dst in ("decode-0", "decode-1"):
        link, error, _ = probe(plane, "prefill-0", dst)
        assert not error, error
        measured[dst] = link.bandwidth_bps
    assert measured["decode-1"] < measured["decode-0"], measured
    plane.loop.run(plane.handles["scheduler"].view.refresh())
    with plane.channel("scheduler") as channel:
        before = scheduler_pb2_grpc.SchedulerServiceStub(channel).SelectDecode(select(), timeout=5)
    assert before.decode_instance_id == "decode-0"

    netns.cut("prefill-0", "decode-0")
    try:
        _, error, failed_after_s = probe(plane, "prefill-0", "decode-0")
        survivor, survivor_error, _ = probe(plane, "prefill-0", "decode-1")
        known = estimates(plane)
        pulled_s = prefill_then_pull(workers, f"after-cut-{uuid.uuid4().hex[:6]}", "decode-1")
        pull_started_s = time.monotonic()
        with pytest.raises(grpc.RpcError) as cut_pull:
            prefill_then_pull(
                workers, f"over-cut-{uuid.uuid4().hex[:6]}", "decode-0", timeout_s=PULL_DEADLINE_S
            )
        pull_failed_s = time.monotonic() - pull_started_s
    finally:
        netns.heal("prefill-0", "decode-0")
    print(
        f"\nmeasured before the cut: prefill-0 -> decode-0 "
        f"{measured['decode-0'] / 1e9:.2f} Gbit/s, -> decode-1 (shaped to {SLOW_LINK}) "
        f"{measured['decode-1'] / 1e9:.2f} Gbit/s; "
        f"probe over the cut link failed after {failed_after_s:.1f} s ({error}); "
        f"a pull over it failed with {cut_pull.value.code().name} after "
        f"{pull_failed_s:.1f} s (its deadline {PULL_DEADLINE_S} s); the other link "
        f"still probed at {survivor.bandwidth_bps / 1e9:.2f} Gbit/s and moved KV in "
        f"{pulled_s * 1000:.0f} ms"
    )
    assert error.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")), error
    assert known[("prefill-0", "decode-0")].last_error
    assert not survivor_error and not known[("prefill-0", "decode-1")].last_error
    assert cut_pull.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert failed_after_s < 10
    assert pull_failed_s < PULL_DEADLINE_S + 2, "the pull outlived its deadline"


def place(plane) -> str:
    """The scheduler's choice for a prompt on prefill-0, from a freshly refreshed view."""
    plane.loop.run(plane.handles["scheduler"].view.refresh())
    with plane.channel("scheduler") as channel:
        reply = scheduler_pb2_grpc.SchedulerServiceStub(channel).SelectDecode(select(), timeout=5)
    return reply.decode_instance_id


def test_new_placements_avoid_a_cut_link(lab):
    """On its own: both links measured (the shaped one slower), the healthy same-node one
    preferred, then cut, then avoided; the link is healed afterwards."""
    netns, plane, workers = lab
    for dst in ("decode-0", "decode-1"):
        link, error, _ = probe(plane, "prefill-0", dst)
        assert not error and link.bandwidth_bps > 0, error
    before = place(plane)
    netns.cut("prefill-0", "decode-0")
    try:
        _, error, _ = probe(plane, "prefill-0", "decode-0")  # the prober finds it cut
        after = place(plane)
    finally:
        netns.heal("prefill-0", "decode-0")
    print(f"\nplaced on {before} while the link was up, on {after} once it was cut ({error})")
    assert before == "decode-0", "the healthy same-node link is the one placements prefer"
    assert error, "the probe over the cut link failed"
    assert after == "decode-1"
