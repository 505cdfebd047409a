"""libkvxfer between real processes: exactness, ranges, versions, dead and hung peers, pacing."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kvxfer_peers import KvSpec, Peer, PeerError, expected_digest, make_kv, pages, transfer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrs.errors import InvalidArgument
from libkvxfer import (
    PROTOCOL_HISTORY,
    PROTOCOL_VERSION,
    AgentConfig,
    KvLayout,
    ProtocolVersionMismatch,
    TransferAgent,
    TransferTicket,
)

RESULT_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def peers():
    """Three long-lived peer processes (spawning one costs a torch import)."""
    started = [Peer(name, chunk_tokens=24) for name in ("peer-a", "peer-b", "peer-c")]
    yield [peer.ready() for peer in started]
    for peer in started:
        peer.stop()


def test_kv_moves_exactly_between_processes(peers):
    a, b, _ = peers
    spec = KvSpec(seed=1, tokens=100)
    sent, received = transfer(a, b, spec, "req-exact")
    got = received.result(RESULT_TIMEOUT_S)
    assert sent.result(RESULT_TIMEOUT_S)["kv_bytes"] == got["kv_bytes"] == 100 * 2 * 3 * 2 * 16 * 8
    assert got["digest"] == expected_digest(spec, 0, 100)
    assert got["sender_id"] == "peer-a"
    # 3 layers x ceil(100 / 24) chunks: the transfer really went layer by layer, in chunks.
    assert got["chunks"] == 3 * 5


def test_token_range_moves_only_that_range(peers):
    a, b, _ = peers
    spec = KvSpec(seed=2, tokens=80, dtype="float32")
    _, received = transfer(a, b, spec, "req-range", start=30, end=80)
    got = received.result(RESULT_TIMEOUT_S)
    assert got["digest"] == expected_digest(spec, 30, 80)
    assert got["digest"] != expected_digest(spec, 0, 50)
    assert got["kv_bytes"] == 50 * 2 * 3 * 2 * 16 * 4


@pytest.mark.parametrize(
    ("send_pages", "recv_pages"),
    [(24, 24), (16, 0), (0, 16), (16, 40)],
    ids=["blocks-of-the-chunk-size", "paged-sender", "paged-receiver", "pages-across-chunks"],
)
def test_kv_moves_exactly_between_paged_caches(peers, send_pages, recv_pages):
    """Pages are blocks of a paged cache: chunks cut at multiples of 24 tokens (the
    peers' chunk size) land in place in 24-token blocks, and through a copy where they
    cross the blocks of another size."""
    a, b, _ = peers
    spec = KvSpec(seed=21, tokens=100)
    sent, received = transfer(
        a, b, spec, f"req-pages-{send_pages}-{recv_pages}", 10, 97, None, send_pages, recv_pages
    )
    got = received.result(RESULT_TIMEOUT_S)
    assert got["digest"] == expected_digest(spec, 10, 97)
    # Cut at 24, 48, 72 and 96 (not at 10 + 24k): five chunks a layer.
    assert got["chunks"] == sent.result(RESULT_TIMEOUT_S)["chunks"] == 3 * 5


def test_a_layer_streams_while_the_next_one_is_still_being_computed():
    """`ready` holds each chunk until its rows are final: layer 0 lands at the receiver
    while layer 1 is still held back (a prefill computing it)."""
    receiver = TransferAgent(AgentConfig("stream-recv"))
    sender = TransferAgent(AgentConfig("stream-send", chunk_tokens=16))
    kv = make_kv(KvSpec(seed=31, tokens=32))
    out = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
    computed = threading.Event()
    asked: list[tuple[int, int]] = []

    def ready(layer: int, end: int) -> None:
        asked.append((layer, end))
        if layer == 1:
            computed.wait(RESULT_TIMEOUT_S)

    try:
        ticket = receiver.prepare("stream-send", "req-stream", 0, 32)
        forwarded = TransferTicket.from_dict(ticket.to_dict())
        with ThreadPoolExecutor(2) as pool:
            received = pool.submit(receiver.recv, ticket, KvLayout.of(kv), out)
            sent = pool.submit(sender.send, forwarded, kv, None, ready)
            deadline = time.monotonic() + RESULT_TIMEOUT_S
            while not torch.equal(out[0][1], kv[0][1]) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert torch.equal(out[0][0], kv[0][0]) and torch.equal(out[0][1], kv[0][1])
            assert not torch.equal(out[1][0], kv[1][0]), "layer 1 is not computed yet"
            computed.set()
            received.result(RESULT_TIMEOUT_S)
            sent.result(RESULT_TIMEOUT_S)
    finally:
        computed.set()
        receiver.close()
        sender.close()
    assert asked == [(layer, end) for layer in range(3) for end in (16, 32)]
    for (k, v), (got_k, got_v) in zip(kv, out, strict=True):
        assert torch.equal(k, got_k) and torch.equal(v, got_v)


def test_pages_that_do_not_tile_the_range_are_refused(peers):
    agent = TransferAgent(AgentConfig("paging-check"))
    try:
        layout = KvLayout(3, 2, 16, torch.float64)
        ticket = agent.prepare("peer-a", "req-bad-pages", 0, 32)
        kv = make_kv(KvSpec(seed=1, tokens=32))
        gap = pages(0, 32, 16, kv)[1:]
        with pytest.raises(InvalidArgument, match="expected one from 0"):
            agent.recv(ticket, layout, gap)
    finally:
        agent.close()


def test_concurrent_transfers_on_one_pair_do_not_mix(peers):
    a, b, _ = peers
    specs = [KvSpec(seed=10 + i, tokens=40 + 8 * i) for i in range(4)]
    started = [transfer(a, b, spec, f"req-concurrent-{i}") for i, spec in enumerate(specs)]
    for spec, (sent, received) in zip(specs, started, strict=True):
        assert received.result(RESULT_TIMEOUT_S)["digest"] == expected_digest(spec, 0, spec.tokens)
        sent.result(RESULT_TIMEOUT_S)


def test_both_directions_and_all_pairs_work(peers):
    spec = KvSpec(seed=3, tokens=16)
    for sender in peers:
        for receiver in peers:
            if sender is receiver:
                continue
            _, received = transfer(sender, receiver, spec, f"req-{sender.instance_id}")
            assert received.result(RESULT_TIMEOUT_S)["digest"] == expected_digest(spec, 0, 16)


def test_rejection_carries_the_senders_status_code(peers):
    a, b, _ = peers
    spec = KvSpec(seed=4)
    ticket = b.prepare(a, "req-unknown", 0, 8)
    received = b.call("recv", ticket, spec, 0)
    a.call("reject", ticket, "request req-unknown is not resident").result(RESULT_TIMEOUT_S)
    with pytest.raises(PeerError) as info:
        received.result(RESULT_TIMEOUT_S)
    assert (info.value.kind, info.value.code) == ("TransferRejected", "NOT_FOUND")
    assert "req-unknown is not resident" in info.value.message
    # The pair stays healthy after a clean rejection.
    _, received = transfer(a, b, spec, "req-after-reject")
    assert received.result(RESULT_TIMEOUT_S)["digest"] == expected_digest(spec, 0, spec.tokens)


def test_layout_mismatch_fails_both_sides_and_the_pair_recovers(peers):
    a, b, _ = peers
    ticket = b.prepare(a, "req-layout", 0, 16)
    received = b.call("recv", ticket, KvSpec(seed=5, tokens=16, dtype="float32"), 0)
    sent = a.call("send", ticket, KvSpec(seed=5, tokens=16, dtype="float64"), None, 0)
    with pytest.raises(PeerError) as info:
        received.result(RESULT_TIMEOUT_S)
    assert info.value.kind == "LayoutMismatch"
    assert "float64" in info.value.message
    with pytest.raises(PeerError) as info:
        sent.result(RESULT_TIMEOUT_S)
    assert info.value.code == "UNAVAILABLE"
    spec = KvSpec(seed=6, tokens=16)
    _, received = transfer(a, b, spec, "req-after-layout")
    assert received.result(RESULT_TIMEOUT_S)["digest"] == expected_digest(spec, 0, 16)


def test_peer_on_another_version_is_rejected_before_payload(peers):
    _, b, _ = peers
    old = Peer("peer-old", wire="version=7").ready()
    try:
        spec = KvSpec(seed=7, tokens=32)
        sent, received = transfer(old, b, spec, "req-version")
        with pytest.raises(PeerError) as info:
            received.result(RESULT_TIMEOUT_S)
        assert info.value.kind == "ProtocolVersionMismatch"
        assert (
            f"peer speaks libkvxfer protocol 7, this process speaks {PROTOCOL_VERSION}"
            in info.value.message
        )
        # The receiver dropped the pair instead of decoding: the sender fails too, fast.
        with pytest.raises(PeerError) as info:
            sent.result(RESULT_TIMEOUT_S)
        assert info.value.code == "UNAVAILABLE"
    finally:
        old.stop()


def test_sender_refuses_a_ticket_of_another_version():
    agent = TransferAgent(AgentConfig("local", timeout_s=5))
    try:
        ticket = agent.prepare("someone", "req-v", 0, 4)
        foreign = TransferTicket.from_dict({**ticket.to_dict(), "protocol_version": 99})
        with pytest.raises(ProtocolVersionMismatch, match="peer speaks libkvxfer protocol 99"):
            agent.send(foreign, make_kv(KvSpec(seed=0, tokens=4)))
    finally:
        agent.close()
    assert PROTOCOL_VERSION in PROTOCOL_HISTORY


def test_corrupted_chunk_fails_its_checksum(peers):
    _, b, _ = peers
    bad = Peer("peer-corrupt", wire="corrupt").ready()
    try:
        spec = KvSpec(seed=8, tokens=16)
        _, received = transfer(bad, b, spec, "req-corrupt")
        with pytest.raises(PeerError) as info:
            received.result(RESULT_TIMEOUT_S)
        assert (info.value.kind, info.value.code) == ("ChecksumMismatch", "DATA_LOSS")
    finally:
        bad.stop()


def test_killed_sender_fails_only_its_own_transfers(peers):
    a, b, c = peers
    timeout_s = 10.0
    victim = Peer("peer-victim", timeout_s=timeout_s, chunk_tokens=8).ready()
    try:
        big = KvSpec(seed=9, tokens=512)
        # Paced so that the transfer is surely in flight when the sender dies.
        _, doomed = transfer(victim, b, big, "req-doomed", pacing_bps=8e6)
        time.sleep(0.5)
        assert not doomed.done()
        killed_at = time.monotonic()
        victim.kill(signal.SIGKILL)
        with pytest.raises(PeerError) as info:
            doomed.result(RESULT_TIMEOUT_S)
        assert info.value.kind == "PeerLost"
        assert time.monotonic() - killed_at < timeout_s
    finally:
        victim.stop()
    spec = KvSpec(seed=10, tokens=64)
    for sender, receiver in ((c, a), (a, b), (c, b)):
        _, received = transfer(sender, receiver, spec, "req-survivor")
        assert received.result(RESULT_TIMEOUT_S)["digest"] == expected_digest(spec, 0, 64)


def test_a_restarted_sender_gets_a_fresh_pair(peers):
    """A sender that restarts under the same id cannot reuse the pair its earlier
    incarnation joined: that transfer fails fast on both sides, the next one works."""
    _, b, _ = peers
    spec = KvSpec(seed=14, tokens=32)
    first = Peer("peer-phoenix").ready()
    try:
        _, received = transfer(first, b, spec, "req-before-restart")
        assert received.result(RESULT_TIMEOUT_S)["digest"] == expected_digest(spec, 0, 32)
    finally:
        first.kill()
        first.stop()
    second = Peer("peer-phoenix").ready()
    try:
        sent, received = transfer(second, b, spec, "req-stale-pair")
        for future in (sent, received):
            with pytest.raises(PeerError) as info:
                future.result(RESULT_TIMEOUT_S)
            assert (info.value.kind, info.value.code) == ("PeerLost", "UNAVAILABLE")
        _, received = transfer(second, b, spec, "req-after-restart")
        assert received.result(RESULT_TIMEOUT_S)["digest"] == expected_digest(spec, 0, 32)
    finally:
        second.stop()


def test_hung_sender_times_out_instead_of_hanging():
    timeout_s = 2.0
    hung = Peer("peer-hung", timeout_s=timeout_s, chunk_tokens=8)
    waiting = Peer("peer-waiting", timeout_s=timeout_s)
    try:
        hung.ready()
        waiting.ready()
        spec = KvSpec(seed=11, tokens=256)
        _, received = transfer(hung, waiting, spec, "req-hung", pacing_bps=4e6)
        time.sleep(0.3)
        hung.kill(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(PeerError) as info:
            received.result(RESULT_TIMEOUT_S)
        assert (info.value.kind, info.value.code) == ("TransferTimeout", "DEADLINE_EXCEEDED")
        # One step's timeout, plus slack for a loaded machine: never a hang.
        assert time.monotonic() - started < timeout_s + 5.0
    finally:
        hung.kill(signal.SIGKILL)
        hung.stop()
        waiting.stop()


def test_pacing_slows_a_transfer_in_proportion_to_its_bytes(peers):
    a, b, _ = peers
    rate_bps = 20e6
    for tokens in (128, 256):
        spec = KvSpec(seed=12, tokens=tokens)
        sent, received = transfer(a, b, spec, f"req-paced-{tokens}", pacing_bps=rate_bps)
        got = received.result(RESULT_TIMEOUT_S)
        stats = sent.result(RESULT_TIMEOUT_S)
        floor_s = 8 * got["kv_bytes"] / rate_bps
        assert got["digest"] == expected_digest(spec, 0, tokens)
        assert stats["seconds"] >= floor_s
        assert got["seconds"] >= floor_s


def test_transfer_spans_nest_under_the_callers_trace():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    receiver = TransferAgent(AgentConfig("trace-recv", timeout_s=10), provider)
    sender = TransferAgent(AgentConfig("trace-send", timeout_s=10), provider)
    try:
        tracer = provider.get_tracer("test")
        spec = KvSpec(seed=13, tokens=8)
        with tracer.start_as_current_span("router.generate") as root:
            carrier_span = root.get_span_context()
            traceparent = f"00-{carrier_span.trace_id:032x}-{carrier_span.span_id:016x}-01"
            ticket = receiver.prepare("trace-send", "req-trace", 0, 8, traceparent)
        kv = make_kv(spec)
        thread = threading.Thread(target=sender.send, args=(ticket, kv))
        thread.start()
        receiver.recv(ticket, KvLayout(3, 2, 16, torch.float64))
        thread.join(timeout=RESULT_TIMEOUT_S)
    finally:
        receiver.close()
        sender.close()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    for name in ("kvxfer.send", "kvxfer.recv"):
        span = spans[name]
        assert span.context.trace_id == carrier_span.trace_id
        assert span.parent.span_id == carrier_span.span_id
        assert span.attributes["kvrs.request_id"] == "req-trace"
        assert span.attributes["kvrs.kv_bytes"] == 8 * 2 * 3 * 2 * 16 * 8


def test_a_ticket_missing_a_field_names_it():
    with pytest.raises(InvalidArgument) as info:
        TransferTicket.from_dict({"transfer_id": "x"})
    assert info.value.field.startswith("ticket.")


def test_tickets_of_gone_receivers_do_not_hold_the_threads_a_live_transfer_needs():
    """More tickets naming a store nobody listens on than the sender has transfer threads:
    each fails PeerLost at once, so a live transfer queued behind them is not held for the
    join timeout (TCPStore alone retries a refused connection for twice that)."""
    receiver = TransferAgent(AgentConfig("gone-recv", timeout_s=30))
    sender = TransferAgent(AgentConfig("gone-send", timeout_s=30, max_concurrent_transfers=2))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone_address = f"127.0.0.1:{closed.getsockname()[1]}"
    spec = KvSpec(seed=14, tokens=8)
    kv = make_kv(spec)

    async def send_all():
        gone = [
            dataclasses.replace(
                receiver.prepare("gone-send", f"req-gone-{i}", 0, 8),
                receiver_incarnation=f"gone-{i}",
                rendezvous_address=gone_address,
            )
            for i in range(4)
        ]
        live = receiver.prepare("gone-send", "req-live", 0, 8)
        results = asyncio.gather(*(sender.send_async(t, kv) for t in gone), return_exceptions=True)
        received = asyncio.to_thread(receiver.recv, live, KvLayout(3, 2, 16, torch.float64))
        sent = sender.send_async(live, kv)
        return await asyncio.wait_for(asyncio.gather(results, received, sent), timeout=20)

    try:
        failures, received, _ = asyncio.run(send_all())
    finally:
        receiver.close()
        sender.close()
    assert [type(f).__name__ for f in failures] == ["PeerLost"] * 4
    assert received.stats.kv_bytes == 8 * 2 * 3 * 2 * 16 * 8
