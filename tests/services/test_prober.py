"""The bandwidth prober: probe sizing, EWMA and budget over a simulated link, then the
ProberService against real tiny-model workers and a real gossip store."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc
import pytest

from kvrs.errors import NotFound, Unavailable
from kvrs.v1 import prober_pb2, prober_pb2_grpc
from services.prober.config import Config
from services.prober.probing import (
    PASS_LINKS,
    LinkProber,
    ProbePairs,
    ProbeSettings,
    payload_id,
)
from services.prober.server import build_server
from services.worker.client import Endpoint, Pulled
from tests.services.router_plane import Plane

pytestmark = pytest.mark.timeout(90)

SRC = Endpoint("prefill-0", "p0:1")
DST = Endpoint("decode-0", "d0:1")
BYTES_PER_TOKEN = 1024


class SimulatedLink:
    """Pulls over a link of `rate_bps` with a fixed per-transfer cost, on a fake clock."""

    def __init__(self, rate_bps: float, fixed_s: float) -> None:
        self.rate_bps = rate_bps
        self.fixed_s = fixed_s
        self.now_s = 100.0
        self.placed: list[str] = []
        self.resident: set[tuple[str, str]] = set()
        self.pulls: list[int] = []
        self.evicted = False

    def clock(self) -> float:
        return self.now_s

    async def place_payload(self, src, kv_id, tokens, lease_s) -> int:
        self.placed.append(kv_id)
        self.evicted = False
        return tokens * BYTES_PER_TOKEN

    async def pull(self, dst, src, kv_id, tokens, pacing_bps) -> Pulled:
        if self.evicted:
            raise NotFound(f"request {kv_id!r} is not resident", field="request_id")
        assert (dst.instance_id, kv_id) not in self.resident, "a stale copy was not dropped"
        kv_bytes = tokens * BYTES_PER_TOKEN
        seconds = self.fixed_s + 8 * kv_bytes / self.rate_bps
        self.now_s += seconds
        self.pulls.append(tokens)
        self.resident.add((dst.instance_id, kv_id))
        return Pulled(kv_bytes=kv_bytes, transfer_s=seconds, total_s=seconds, recomputed_tokens=0)

    async def drop(self, at, kv_id) -> None:
        self.resident.discard((at.instance_id, kv_id))


class Gossip:
    def __init__(self) -> None:
        self.samples = []

    async def report_link_sample(self, sample) -> None:
        self.samples.append(sample)


SETTINGS = ProbeSettings(
    budget_fraction=0.02, target_probe_s=0.2, interval_s=1.0, payload_tokens=2048, max_pulls=16
)


def prober(link: SimulatedLink, settings: ProbeSettings = SETTINGS) -> tuple[LinkProber, Gossip]:
    gossip = Gossip()
    return LinkProber(link, gossip, settings, clock=link.clock), gossip


@pytest.mark.parametrize("rate_gbps", [1.0, 5.0, 10.0])
async def test_a_probe_measures_the_link_rate_net_of_the_fixed_transfer_cost(rate_gbps):
    link = SimulatedLink(rate_gbps * 1e9, fixed_s=0.004)
    probe, gossip = prober(link)
    state = await probe.probe(SRC, DST)
    assert state.sample_bps == pytest.approx(rate_gbps * 1e9, rel=1e-9)
    assert state.rtt_s == pytest.approx(link.fixed_s)
    assert state.probe_s >= SETTINGS.target_probe_s or len(link.pulls) == 4 + SETTINGS.max_pulls
    assert state.probe_bytes == sum(link.pulls) * BYTES_PER_TOKEN
    assert link.placed == [payload_id("prefill-0")]
    # A full-payload warm-up, three reference pulls of 512 tokens (a quarter of the
    # payload), then pulls at least twice that long.
    assert link.pulls[:4] == [2048, 512, 512, 512]
    assert min(link.pulls[4:]) >= 1024
    assert not link.resident
    (sample,) = gossip.samples
    assert (sample.src_instance_id, sample.dst_instance_id) == ("prefill-0", "decode-0")
    assert sample.bandwidth_bps == state.sample_bps
    assert sample.samples == 1


async def test_a_pass_probes_a_few_links_never_probed_first_and_only_they_hold_state():
    """At thousands of instances the pairs are millions: a pass takes `PASS_LINKS` of
    them, then reads the instances again; the pairs it has not probed cost no state."""
    link = SimulatedLink(5e9, fixed_s=0.001)
    probe, gossip = prober(link)
    sources = [Endpoint(f"prefill-{i}", f"p{i}:1") for i in range(20)]
    sinks = [Endpoint(f"decode-{j}", f"d{j}:1") for j in range(20)]
    pairs = list(ProbePairs(sources, sinks))
    held_at_each_pass: list[list[tuple[str, str]]] = []
    samples_at_each_pass: list[int] = []
    third_pass = asyncio.Event()

    def links():
        held_at_each_pass.append(list(probe.links))
        samples_at_each_pass.append(len(gossip.samples))
        if len(held_at_each_pass) == 3:
            third_pass.set()
        return ProbePairs(sources, sinks)

    running = asyncio.create_task(probe.run(links))
    try:
        await asyncio.wait_for(third_pass.wait(), timeout=30)
    finally:
        running.cancel()
    assert [len(held) for held in held_at_each_pass[:3]] == [0, PASS_LINKS, 2 * PASS_LINKS]
    probed = [(s.instance_id, d.instance_id) for s, d in pairs[: 2 * PASS_LINKS]]
    assert held_at_each_pass[2] == probed, "the pairs never probed go first, in order"
    assert samples_at_each_pass[:3] == [0, PASS_LINKS, 2 * PASS_LINKS]


class DeadEnds:
    """Every pull fails at once, as to an address that accepts and hangs up."""

    def __init__(self) -> None:
        self.pulls = 0

    async def place_payload(self, src, kv_id, tokens, lease_s) -> int:
        return tokens * BYTES_PER_TOKEN

    async def pull(self, dst, src, kv_id, tokens, pacing_bps) -> Pulled:
        self.pulls += 1
        raise Unavailable(f"{dst.address}: connection reset")

    async def drop(self, at, kv_id) -> None:
        pass


async def test_probes_that_fail_at_once_start_no_faster_than_the_cap():
    """Thousands of instances that fail their probe at once: the prober paces itself
    instead of spinning through them."""
    dead = DeadEnds()
    settings = dataclasses.replace(SETTINGS, max_probes_per_s=50.0)
    probe = LinkProber(dead, Gossip(), settings)
    sources = [Endpoint(f"prefill-{i}", f"p{i}:1") for i in range(40)]
    sinks = [Endpoint(f"decode-{j}", f"d{j}:1") for j in range(100)]
    started = time.monotonic()
    running = asyncio.create_task(probe.run(lambda: ProbePairs(sources, sinks)))
    await asyncio.sleep(0.5)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    elapsed_s = time.monotonic() - started
    assert 5 <= probe.stats.probes_total <= elapsed_s * 50 + 1
    assert probe.stats.probe_failures_total == probe.stats.probes_total


async def test_the_estimate_is_an_ewma_and_probes_stay_within_the_time_budget():
    link = SimulatedLink(2e9, fixed_s=0.002)
    probe, gossip = prober(link)
    first = (await probe.probe(SRC, DST)).sample_bps
    link.rate_bps = 1e9
    for _ in range(9):
        state = probe.link(SRC, DST)
        link.now_s = max(link.now_s, state.next_due_s)
        await probe.probe(SRC, DST)
    samples = [s.sample_bandwidth_bps for s in gossip.samples]
    assert samples[0] == pytest.approx(first)
    expected = samples[0]
    for sample in samples[1:]:
        expected = 0.8 * expected + 0.2 * sample
    assert gossip.samples[-1].bandwidth_bps == pytest.approx(expected)
    assert gossip.samples[-1].samples == 10
    state = probe.link(SRC, DST)
    link.now_s = state.next_due_s
    assert state.probe_time_fraction(link.now_s) <= SETTINGS.budget_fraction + 1e-9
    assert link.placed == [payload_id("prefill-0")]


async def test_a_lost_payload_is_placed_again():
    link = SimulatedLink(1e9, fixed_s=0.001)
    probe, _ = prober(link)
    await probe.probe(SRC, DST)
    link.evicted = True
    state = await probe.probe(SRC, DST)
    assert link.placed == [payload_id("prefill-0")] * 2
    assert state.estimate.samples == 2


async def test_a_fixed_probe_size_moves_that_many_bytes():
    link = SimulatedLink(1e9, fixed_s=0.001)
    probe, _ = prober(link)
    await probe.probe(SRC, DST, probe_bytes=5000 * BYTES_PER_TOKEN)
    # Beyond the reference pulls (512 tokens each): 1536 + 1536 + 1536 + 512 >= 5000.
    assert link.pulls[4:] == [2048, 2048, 2048, 1024]


@pytest.fixture
async def plane(redis_url, redis_prefix):
    cluster = Plane(redis_url, redis_prefix)
    # Small chunks, so paced sends are paced all the way (the pacer waits between chunks).
    await cluster.start(router=False, worker_overrides={"transfer_chunk_tokens": 8})
    yield cluster
    await cluster.stop()


async def start_prober(plane: Plane, **overrides):
    config = dataclasses.replace(
        Config(
            listen_addr="127.0.0.1:0",
            gossip_addr=plane.address("gossip"),
            payload_tokens=256,
            refresh_s=0.1,
        ),
        **overrides,
    )
    handle = await build_server(config, plane.provider, probe_forever=False)
    plane.handles["prober"] = handle
    plane.closers.append(lambda: handle.stop(0))
    return prober_pb2_grpc.ProberServiceStub(plane.channel("prober"))


async def test_probe_link_publishes_the_estimate_to_gossip_and_leaves_no_copy(plane):
    stub = await start_prober(plane)
    request = prober_pb2.ProbeLinkRequest(src_instance_id="prefill-0", dst_instance_id="decode-1")
    first = (await stub.ProbeLink(request, timeout=30)).link
    assert first.samples == 1
    assert first.bandwidth_bps > 0 and first.rtt_s >= 0 and first.probe_bytes > 0
    second = (await stub.ProbeLink(request, timeout=30)).link
    assert second.samples == 2
    assert second.bandwidth_bps == pytest.approx(
        0.8 * first.bandwidth_bps + 0.2 * second.sample_bandwidth_bps
    )
    (link,) = await plane.gossip.list_links()
    assert (link.sample.src_instance_id, link.sample.dst_instance_id) == ("prefill-0", "decode-1")
    assert link.sample.bandwidth_bps == pytest.approx(second.bandwidth_bps)
    assert link.sample.samples == 2
    # The payload stays on the source for the next probe; the receiver keeps nothing.
    assert await plane.resident_requests("prefill-0") == 1
    assert await plane.resident_requests("decode-1") == 0
    listing = await stub.ListLinkEstimates(prober_pb2.ListLinkEstimatesRequest(), timeout=5)
    assert [x.dst_instance_id for x in listing.links] == ["decode-1"]
    assert listing.probes_total == 2
    assert listing.probe_budget_fraction == 0.02


async def test_paced_probes_never_report_more_than_the_pace(plane):
    pace_bps = 200e6
    # A 2 MiB payload: each pull spends tens of ms on the paced wire, so the milliseconds
    # a loaded machine adds to one pull and not another stay a small share of it.
    stub = await start_prober(plane, pacing_bps=pace_bps, payload_tokens=2048)
    link = (
        await stub.ProbeLink(
            prober_pb2.ProbeLinkRequest(src_instance_id="prefill-1", dst_instance_id="decode-0"),
            timeout=30,
        )
    ).link
    assert 0 < link.sample_bandwidth_bps <= 1.15 * pace_bps, link.sample_bandwidth_bps


@pytest.mark.parametrize(
    ("src", "dst", "code"),
    [
        ("prefill-0", "prefill-0", grpc.StatusCode.INVALID_ARGUMENT),
        ("prefill-0", "", grpc.StatusCode.INVALID_ARGUMENT),
        ("prefill-0", "decode-9", grpc.StatusCode.NOT_FOUND),
    ],
)
async def test_bad_probe_requests_are_refused(plane, src, dst, code):
    stub = await start_prober(plane)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.ProbeLink(
            prober_pb2.ProbeLinkRequest(src_instance_id=src, dst_instance_id=dst), timeout=10
        )
    assert raised.value.code() == code
