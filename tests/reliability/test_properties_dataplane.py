"""WorkerService and RouterService under hostile input, on a local cluster of processes.

Same promise as the control plane's: every refusal is a clean status naming its field,
never INTERNAL or UNKNOWN, and the processes keep serving (a health check and a valid
Generate succeed afterwards). Calls that make a worker reach a peer it is given
(PullKv's source address, SendKv's rendezvous) may also end UNAVAILABLE or
DEADLINE_EXCEEDED: that peer may not exist.
"""

from __future__ import annotations

import math
import uuid

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reliability_stack import (
    assert_serving,
    check_rejection,
    field_path,
    finite_or_documented,
)
from reliability_strategies import PROPERTY_SETTINGS, doubles, ids, int32s, int64s, mutated

from kvrs.cli.launcher import SERVICES, ClusterOptions, start_cluster, stop_cluster
from kvrs.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from libkvxfer import PROTOCOL_VERSION

pytestmark = [
    pytest.mark.timeout(300),
    # The servers' span ids come from the global `random` while Hypothesis draws.
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

CLUSTER_SERVICES = ("gossip", "slot-broker", "scheduler-1", "prefill-0", "decode-0", "router")
KNOWN = ("prefill-0", "decode-0", "resident")
IDS = ids(KNOWN)
PEER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
NO_FINITE_COST = frozenset(
    {
        "slo_slack_s",
        "predicted_cost_s",
        "cost_s",
        "wait_s",
        "transfer_s",
        "compute_s",
    }
)
"""+-inf where no option fits (an ABORT's recovery report), as the scheduler answers."""
STREAM_MESSAGES = 3
"""Messages read from a stream before it is cancelled (enough to pass every check)."""
CALL_TIMEOUT_S = 10.0
STREAM_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 1.0
"""SendKv to a rendezvous that does not exist waits for it until the deadline."""


def token_lists(max_size: int = 64) -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.lists(st.integers(0, 255), min_size=1, max_size=max_size),
        st.lists(int32s(), max_size=8),
        st.integers(1000, 2000).map(lambda n: [1] * n),
        st.just([]),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url, module_redis_prefix):
    options = ClusterOptions(
        run_dir=tmp_path_factory.mktemp("props") / "cluster",
        workers_model="tiny",
        redis_url=redis_url,
        redis_prefix=module_redis_prefix,
        startup_timeout_s=120,
    )
    services = tuple(s for s in SERVICES if s.name in CLUSTER_SERVICES)
    state = start_cluster(options, services)
    try:
        yield state
    finally:
        stop_cluster(options.run_dir, grace_s=5.0)


@pytest.fixture(scope="module")
def workers(cluster):
    channels = {
        name: grpc.insecure_channel(cluster.address(name)) for name in ("prefill-0", "decode-0")
    }
    stubs = {name: worker_pb2_grpc.WorkerServiceStub(c) for name, c in channels.items()}
    # "resident" is prefilled on prefill-0, so requests naming it reach the deeper checks.
    stubs["prefill-0"].Prefill(
        worker_pb2.PrefillRequest(
            request_id="resident", prompt_token_ids=list(range(32)), lease_s=600
        ),
        timeout=30,
    )
    yield stubs
    for channel in channels.values():
        assert_serving(channel)
        channel.close()


@pytest.fixture(scope="module")
def router(cluster):
    channel = grpc.insecure_channel(cluster.address("router"))
    stub = router_pb2_grpc.RouterServiceStub(channel)
    yield stub
    assert_serving(channel)
    still_generates(stub)
    channel.close()


def still_generates(stub) -> None:
    tokens = [
        m.token_id
        for m in stub.Generate(
            router_pb2.GenerateRequest(
                request_id=uuid.uuid4().hex, prompt_token_ids=list(range(16)), max_new_tokens=4
            ),
            timeout=60,
        )
        if m.index >= 0
    ]
    assert len(tokens) == 4


def unary(
    method,
    request,
    peer_codes: frozenset = frozenset(),
    peer_fields: bool = False,
    timeout_s: float = CALL_TIMEOUT_S,
) -> None:
    """`peer_fields`: the refusal may name a field of the request the worker sent on to
    its peer."""
    try:
        reply = method(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() in peer_codes:
            return
        if peer_fields and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert field_path(exc.details()), exc.details()
            return
        check_rejection(exc, request)
        return
    finite_or_documented(reply)


def streaming(method, request, peer_fields: bool = False) -> None:
    # Generous: on two shared cores a valid request may queue behind a hostile one.
    stream = method(request, timeout=STREAM_TIMEOUT_S)
    try:
        for count, message in enumerate(stream, 1):
            finite_or_documented(message, NO_FINITE_COST)
            if count >= STREAM_MESSAGES:
                break
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED:
            return
        if peer_fields and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert field_path(exc.details()), exc.details()
            return
        check_rejection(exc, request)
    finally:
        stream.cancel()


def fresh(request):
    """A unique request id (when one is set), so examples do not replay each other."""
    if request.request_id and request.request_id not in KNOWN:
        request.request_id += f"-{uuid.uuid4().hex[:6]}"
    return request


@PROPERTY_SETTINGS
@given(
    request=mutated(
        worker_pb2.PrefillRequest(request_id="p", prompt_token_ids=[1, 2, 3], lease_s=5.0),
        {"request_id": IDS, "prompt_token_ids": token_lists(), "lease_s": doubles()},
    )
)
def test_prefill(workers, request):
    unary(workers["prefill-0"].Prefill, fresh(request))
    assert_serving_worker(workers)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        worker_pb2.ExtendRequest(request_id="resident", token_ids=[5]),
        {"request_id": IDS, "token_ids": token_lists(16)},
    )
)
def test_extend(workers, request):
    unary(workers["prefill-0"].Extend, request)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        worker_pb2.DecodeRequest(request_id="resident", max_new_tokens=2),
        {
            "request_id": IDS,
            "generated_token_ids": token_lists(8),
            "max_new_tokens": int32s(),
            "stop_token_id": int32s(),
            "release_when_done": st.just(False),
        },
    )
)
def test_decode(workers, request):
    streaming(workers["prefill-0"].Decode, request)


@PROPERTY_SETTINGS
@given(
    request=mutated(
        worker_pb2.PullKvRequest(
            request_id="resident", source_instance_id="prefill-0", token_start=0, token_end=8
        ),
        {
            "request_id": IDS,
            "source_instance_id": IDS,
            "source_address": st.one_of(st.just("PREFILL"), IDS, st.just("127.0.0.1:1")),
            "token_start": int32s(),
            "token_end": int32s(),
            "prompt_tokens": int32s(),
            "prefix_token_ids": token_lists(8),
            "lease_s": doubles(),
            "pacing_bps": doubles(),
        },
    )
)
def test_pull_kv(cluster, workers, request):
    if request.source_address in ("", "PREFILL"):
        request.source_address = cluster.address("prefill-0")
    unary(workers["decode-0"].PullKv, request, PEER_CODES)
    # A pulled copy would satisfy the next example without a transfer.
    unary(workers["decode-0"].ReleaseKv, worker_pb2.ReleaseKvRequest(request_id=request.request_id))


@PROPERTY_SETTINGS
@given(request_id=IDS)
def test_release_kv(workers, request_id):
    if request_id == "resident":
        return  # kept for the other properties
    unary(workers["decode-0"].ReleaseKv, worker_pb2.ReleaseKvRequest(request_id=request_id))


def assert_serving_worker(workers) -> None:
    stats = workers["prefill-0"].GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5)
    assert stats.free_kv_blocks >= 0 and stats.used_kv_bytes >= 0


@PROPERTY_SETTINGS
@given(
    request=mutated(
        router_pb2.GenerateRequest(request_id="g", prompt_token_ids=[1, 2, 3, 4], max_new_tokens=3),
        {
            "request_id": IDS,
            "prompt_token_ids": token_lists(),
            "max_new_tokens": st.one_of(int32s(), st.integers(1, 4)),
            "ttft_slo_s": doubles(),
            "deadline_unix_ms": int64s(),
            "placement_policy": st.one_of(st.sampled_from(["", "netkv", "round_robin"]), IDS),
            "recovery_policy": st.one_of(st.sampled_from(["", "kvrs", "rom"]), IDS),
            "prefill_instance_id": IDS,
            "decode_instance_id": IDS,
        },
    )
)
def test_generate(router, request):
    streaming(router.Generate, fresh(request), peer_fields=True)


@settings(PROPERTY_SETTINGS, max_examples=15)
@given(
    request=mutated(
        worker_pb2.SendKvRequest(
            request_id="resident",
            ticket=worker_pb2.KvTransferTicket(
                protocol_version=PROTOCOL_VERSION,
                transfer_id="t",
                tag=1,
                receiver_instance_id="decode-0",
                receiver_incarnation="x",
                rendezvous_address="127.0.0.1:1",
                sender_instance_id="prefill-0",
                request_id="resident",
                token_start=0,
                token_end=4,
            ),
        ),
        {
            "request_id": IDS,
            "ticket.protocol_version": int32s(),
            "ticket.transfer_id": IDS,
            "ticket.tag": int64s(),
            "ticket.receiver_instance_id": IDS,
            "ticket.rendezvous_address": IDS,
            "ticket.group_generation": int64s(),
            "ticket.token_start": int32s(),
            "ticket.token_end": int32s(),
            "ticket.traceparent": IDS,
            "pacing_bps": doubles(),
        },
    )
)
def test_send_kv(workers, request):
    unary(
        workers["prefill-0"].SendKv, request, PEER_CODES, peer_fields=True, timeout_s=SEND_TIMEOUT_S
    )


# -- regressions of bugs the properties found ---------------------------------------------


def expect_invalid(method, request, field: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        method(request, timeout=timeout_s)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
    assert failure.value.details().startswith(f"{field}:"), failure.value.details()


@pytest.mark.parametrize("lease_s", [math.nan, math.inf, 1e300])
def test_a_bad_lease_is_invalid_argument_and_stores_nothing(workers, lease_s):
    before = (
        workers["prefill-0"]
        .GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5)
        .resident_requests
    )
    expect_invalid(
        workers["prefill-0"].Prefill,
        worker_pb2.PrefillRequest(
            request_id=f"lease-{uuid.uuid4().hex[:6]}", prompt_token_ids=[1, 2, 3], lease_s=lease_s
        ),
        "lease_s",
    )
    after = (
        workers["prefill-0"]
        .GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5)
        .resident_requests
    )
    assert after == before, "a refused prefill left its KV resident"


@pytest.mark.parametrize("pacing_bps", [math.nan, 5e-324, 1e-3])
def test_a_tiny_pacing_rate_is_invalid_argument(cluster, workers, pacing_bps):
    expect_invalid(
        workers["decode-0"].PullKv,
        worker_pb2.PullKvRequest(
            request_id="resident",
            source_instance_id="prefill-0",
            source_address=cluster.address("prefill-0"),
            token_start=0,
            token_end=8,
            pacing_bps=pacing_bps,
        ),
        "pacing_bps",
        timeout_s=3.0,
    )


def test_a_refused_pull_names_a_field_of_pull_kv(cluster, workers):
    expect_invalid(
        workers["decode-0"].PullKv,
        worker_pb2.PullKvRequest(
            request_id="resident",
            source_instance_id="someone-else",
            source_address=cluster.address("prefill-0"),
            token_start=0,
            token_end=8,
        ),
        "source_instance_id",
    )


def test_an_unknown_placement_policy_names_placement_policy(router):
    stream = router.Generate(
        router_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=[1, 2, 3],
            max_new_tokens=2,
            placement_policy="no-such-policy",
        ),
        timeout=CALL_TIMEOUT_S,
    )
    with pytest.raises(grpc.RpcError) as failure:
        list(stream)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.value.details().startswith("placement_policy:"), failure.value.details()


def test_a_sendkv_to_an_unreachable_receiver_stalls_no_other_transfer(workers, router):
    """What a receiver that died after issuing its ticket leaves behind: the sender keeps
    trying to reach its store, but the live receiver's pair is untouched."""
    ticket = worker_pb2.KvTransferTicket(
        protocol_version=PROTOCOL_VERSION,
        transfer_id=uuid.uuid4().hex,
        tag=7,
        receiver_instance_id="decode-0",
        receiver_incarnation="gone",
        rendezvous_address="127.0.0.1:1",
        sender_instance_id="prefill-0",
        request_id="resident",
        token_start=0,
        token_end=4,
    )
    with pytest.raises(grpc.RpcError):
        workers["prefill-0"].SendKv(
            worker_pb2.SendKvRequest(request_id="resident", ticket=ticket), timeout=2
        )
    tokens = [
        m.token_id
        for m in router.Generate(
            router_pb2.GenerateRequest(
                request_id=uuid.uuid4().hex,
                prompt_token_ids=[0, 1],
                max_new_tokens=3,
                prefill_instance_id="prefill-0",
                decode_instance_id="decode-0",
            ),
            timeout=10,
        )
        if m.index >= 0
    ]
    assert len(tokens) == 3
