"""Timed probe transfers over the KV data plane, an EWMA per link, and the probing budget.

A probe of link src -> dst pulls a synthetic KV payload that src keeps resident, exactly
as a decode instance pulls a prompt's KV (same libkvxfer path, same pacing), and times
the wire on the receiver:

1. small reference pulls (1 MiB, or a quarter of the payload; the median of three),
   preceded on a pair never probed by one full-payload pull that is not a sample (the
   first transfers of a pair also build its process group and fault in buffers);
2. pulls sized from the running rate follow until they have kept the wire busy for
   `target_probe_s` beyond the reference (or `max_pulls`). The sample is the slope
   8 * (bytes - reference bytes) / (time - reference time) over them: what every
   transfer pays regardless of size (ticket, SendKv, pair setup, and a shaper's burst
   credit after idle) cancels out. The intercept, reference time - 8 * reference bytes
   / sample, is the link's `rtt_s` in T_x = rtt + 8 * bytes / bandwidth. With the probes
   paced (`pacing_bps`), a sample never exceeds the pace: they cannot have gone faster.

Each sample feeds the link's EWMA (`kvrs.estimator.EwmaEstimator`), published to gossip.
A link is probed again only after `duration / budget_fraction - duration` (and never
sooner than `interval_s`), so probes take at most `budget_fraction` of its time. Links
are probed one at a time, so probes never share a path with each other, and at most
`max_probes_per_s` start a second: a probe that fails at once (an instance that accepts
and hangs up, or one gone) would otherwise start the next one at once, and a prober
facing thousands of such links would spin a core.

A probe that fails publishes the link as down (`DOWN_BANDWIDTH_BPS`): keeping its last
good sample would let placements go on choosing a cut link. The EWMA keeps its good
samples for when the link comes back, and a failed link is tried again every
`interval_s` (a failed probe moved nothing, so it costs the link no budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrs.errors import InvalidArgument, KvrsError, Unavailable
from kvrs.estimator import EwmaEstimator, LinkEstimate
from services.common.gossip_records import LinkSample
from services.worker.client import Endpoint, Pulled

log = logging.getLogger(__name__)

REFERENCE_BYTES = 1 << 20
"""Size of the reference pull (at most a quarter of the payload): larger than a shaper's
burst allowance, small enough to cost little next to the measured pulls."""
REFERENCE_PULLS = 3
"""Reference pulls per probe; their median is used (one slow scheduling blip is ignored)."""
MIN_WIRE_FRACTION = 0.05
"""A pull's time beyond the reference pull's is taken as at least this share of it."""
PASS_LINKS = 64
"""Links one pass of `LinkProber.run` probes at most before it reads the instances again."""
DOWN_BANDWIDTH_BPS = 1.0
"""What a link whose probe failed is reported at: the least gossip accepts, so every
transfer over it is priced out of any decision."""


class Transport(Protocol):
    async def place_payload(self, src: Endpoint, kv_id: str, tokens: int, lease_s: float) -> int:
        """Makes `src` hold a synthetic KV of `tokens` under `kv_id`; returns its bytes."""
        ...

    async def pull(
        self, dst: Endpoint, src: Endpoint, kv_id: str, tokens: int, pacing_bps: float
    ) -> Pulled: ...

    async def drop(self, at: Endpoint, kv_id: str) -> None: ...


class Publisher(Protocol):
    async def report_link_sample(self, sample: LinkSample) -> None: ...


@dataclass(frozen=True)
class ProbeSettings:
    budget_fraction: float = 0.02
    target_probe_s: float = 0.2
    interval_s: float = 5.0
    payload_tokens: int = 2048
    max_pulls: int = 16
    payload_lease_s: float = 3600.0
    ewma_alpha: float = 0.2
    pacing_bps: float = 0.0
    max_probes_per_s: float = 20.0


@dataclass(frozen=True)
class ProbePairs:
    """The links to measure: each source to each target other than itself, in that order
    (source by source). At thousands of instances they are millions: a pass walks them
    only until it has found the few it probes."""

    sources: Sequence[Endpoint]
    targets: Sequence[Endpoint]

    def __iter__(self) -> Iterator[tuple[Endpoint, Endpoint]]:
        for src in self.sources:
            for dst in self.targets:
                if src.instance_id != dst.instance_id:
                    yield src, dst


@dataclass
class LinkState:
    """What the prober knows about one link."""

    src: Endpoint
    dst: Endpoint
    estimator: EwmaEstimator
    sample_bps: float = 0.0
    rtt_s: float = 0.0
    probe_bytes: int = 0
    probe_s: float = 0.0
    measured_unix_ms: int = 0
    first_probe_at_s: float = math.nan
    busy_s: float = 0.0
    next_due_s: float = 0.0
    last_error: str = ""

    @property
    def estimate(self) -> LinkEstimate | None:
        return self.estimator.estimate

    def probe_time_fraction(self, now_s: float) -> float:
        if math.isnan(self.first_probe_at_s) or now_s <= self.first_probe_at_s:
            return 0.0
        return self.busy_s / (now_s - self.first_probe_at_s)


@dataclass
class ProberStats:
    probes_total: int = 0
    probe_failures_total: int = 0
    busy_s: float = 0.0
    started_s: float = field(default_factory=time.monotonic)


def payload_id(src_id: str) -> str:
    return f"kvrs-probe.{src_id}"


class LinkProber:
    """Probes links and keeps their estimates (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        publisher: Publisher,
        settings: ProbeSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.publisher = publisher
        self.settings = settings
        self._clock = clock
        self.links: dict[tuple[str, str], LinkState] = {}
        self.stats = ProberStats(started_s=clock())
        self._payload_bytes: dict[str, int] = {}
        """Sources holding the payload, and its size there."""
        self._lock = asyncio.Lock()

    def link(self, src: Endpoint, dst: Endpoint) -> LinkState:
        key = (src.instance_id, dst.instance_id)
        state = self.links.get(key)
        if state is None:
            state = self.links[key] = LinkState(src, dst, EwmaEstimator(self.settings.ewma_alpha))
        else:
            state.src, state.dst = src, dst
        return state

    async def probe(self, src: Endpoint, dst: Endpoint, probe_bytes: int = 0) -> LinkState:
        """Probes src -> dst now, publishes the new estimate and schedules the next probe.

        `probe_bytes` > 0 moves that much instead of sizing the probe by time. Raises the
        KvrsError that failed the probe (the link keeps its last estimate).
        """
        if src.instance_id == dst.instance_id:
            raise InvalidArgument("dst_instance_id", "must differ from src_instance_id")
        state = self.link(src, dst)
        try:
            await self._probe_now(state, probe_bytes)
        except KvrsError:
            await self._publish(state, down=True)
            raise
        state.last_error = ""
        await self._publish(state)
        return state

    async def _probe_now(self, state: LinkState, probe_bytes: int) -> None:
        async with self._lock:
            started = self._clock()
            if math.isnan(state.first_probe_at_s):
                state.first_probe_at_s = started
            failed = True
            try:
                await self._measure(state, probe_bytes)
                failed = False
            except KvrsError as exc:
                state.last_error = str(exc)
                self.stats.probe_failures_total += 1
                raise
            finally:
                duration = self._clock() - started
                state.busy_s += duration
                self.stats.busy_s += duration
                self.stats.probes_total += 1
                pause_s = self.settings.interval_s if failed else self._pause_s(duration)
                state.next_due_s = self._clock() + pause_s

    def _pause_s(self, duration_s: float) -> float:
        budget = self.settings.budget_fraction
        return max(duration_s / budget - duration_s, self.settings.interval_s)

    async def _measure(self, state: LinkState, probe_bytes: int) -> None:
        try:
            await self._measure_once(state, probe_bytes)
        except KvrsError as exc:
            if isinstance(exc, Unavailable) or state.src.instance_id not in self._payload_bytes:
                raise
            # The payload may have been evicted or the source restarted: place it again.
            log.info(
                "probe %s -> %s failed (%s); placing the payload again",
                state.src.instance_id,
                state.dst.instance_id,
                exc,
            )
            del self._payload_bytes[state.src.instance_id]
            await self._measure_once(state, probe_bytes)

    async def _measure_once(self, state: LinkState, probe_bytes: int) -> None:
        settings = self.settings
        src, dst = state.src, state.dst
        kv_id = payload_id(src.instance_id)
        payload_bytes = self._payload_bytes.get(src.instance_id)
        if payload_bytes is None:
            payload_bytes = await self.transport.place_payload(
                src, kv_id, settings.payload_tokens, settings.payload_lease_s
            )
            self._payload_bytes[src.instance_id] = payload_bytes
        bytes_per_token = payload_bytes / settings.payload_tokens
        ref_tokens = max(
            1, min(settings.payload_tokens // 4, math.ceil(REFERENCE_BYTES / bytes_per_token))
        )
        warmup = []
        if state.estimate is None:
            # The first transfers of a pair build its process group and fault in the
            # receiver's buffers: a full-payload pull takes that cost out of the sample.
            warmup.append(await self._pull(dst, src, kv_id, settings.payload_tokens))
        refs = [await self._pull(dst, src, kv_id, ref_tokens) for _ in range(REFERENCE_PULLS)]
        ref = sorted(refs, key=lambda pulled: pulled.transfer_s)[len(refs) // 2]
        estimate = state.estimate
        rate_bps = (
            estimate.bandwidth_bps
            if estimate is not None
            else 8.0 * ref.kv_bytes / max(ref.transfer_s, 1e-9)
        )
        pulls: list[tuple[int, float]] = []
        wire_s = 0.0
        moved = 0
        total_bytes = sum(pulled.kv_bytes for pulled in (*warmup, *refs))
        while len(pulls) < settings.max_pulls and (
            moved < probe_bytes if probe_bytes else wire_s < settings.target_probe_s
        ):
            if probe_bytes:
                tokens = math.ceil((probe_bytes - moved) / bytes_per_token) + ref_tokens
            else:
                tokens = ref_tokens + self._size(
                    rate_bps, settings.target_probe_s - wire_s, bytes_per_token
                )
            tokens = max(2 * ref_tokens, min(settings.payload_tokens, tokens))
            pulled = await self._pull(dst, src, kv_id, tokens)
            # Against the reference pull: the fixed cost (and a shaper's burst credit,
            # which every pull starting from an idle link gets) cancels out.
            extra_bytes = pulled.kv_bytes - ref.kv_bytes
            extra_s = max(pulled.transfer_s - ref.transfer_s, MIN_WIRE_FRACTION * pulled.transfer_s)
            pulls.append((extra_bytes, extra_s))
            wire_s += extra_s
            moved += extra_bytes
            total_bytes += pulled.kv_bytes
            rate_bps = 8.0 * sum(b for b, _ in pulls) / sum(t for _, t in pulls)
        sample_bps = rate_bps
        if settings.pacing_bps > 0:
            # The probes went no faster than this pace: a slope above it is the reference
            # pull's timing noise (a slow reference shortens every pull's extra time).
            sample_bps = min(sample_bps, settings.pacing_bps)
        rtt_s = max(0.0, ref.transfer_s - 8.0 * ref.kv_bytes / sample_bps)
        state.estimator.update(sample_bps, rtt_s, time.time())
        state.sample_bps = sample_bps
        state.rtt_s = rtt_s
        state.probe_bytes = total_bytes
        state.probe_s = wire_s
        state.measured_unix_ms = int(time.time() * 1000)

    def _size(self, rate_bps: float, left_s: float, bytes_per_token: float) -> int:
        tokens = int(left_s * rate_bps / (8.0 * bytes_per_token))
        return max(1, min(self.settings.payload_tokens, tokens))

    async def _pull(self, dst: Endpoint, src: Endpoint, kv_id: str, tokens: int) -> Pulled:
        """One pull, and the copy dropped again (a resident copy would satisfy the next
        pull without a transfer)."""
        try:
            pulled = await self.transport.pull(dst, src, kv_id, tokens, self.settings.pacing_bps)
        except KvrsError:
            with contextlib.suppress(KvrsError):
                await self.transport.drop(dst, kv_id)
            raise
        await self.transport.drop(dst, kv_id)
        return pulled

    async def _publish(self, state: LinkState, down: bool = False) -> None:
        """Reports the link's estimate to gossip, or, `down`, that its probe failed."""
        estimate = state.estimate
        if down:
            sample = LinkSample(
                src_instance_id=state.src.instance_id,
                dst_instance_id=state.dst.instance_id,
                bandwidth_bps=DOWN_BANDWIDTH_BPS,
                rtt_s=estimate.rtt_s if estimate is not None else 0.0,
                samples=estimate.samples if estimate is not None else 0,
            )
        else:
            assert estimate is not None
            sample = LinkSample(
                src_instance_id=state.src.instance_id,
                dst_instance_id=state.dst.instance_id,
                bandwidth_bps=estimate.bandwidth_bps,
                sample_bandwidth_bps=state.sample_bps,
                rtt_s=estimate.rtt_s,
                probe_bytes=state.probe_bytes,
                samples=estimate.samples,
            )
        try:
            await self.publisher.report_link_sample(sample)
        except KvrsError as exc:
            log.warning(
                "reporting link %s -> %s to gossip failed: %s",
                state.src.instance_id,
                state.dst.instance_id,
                exc,
            )

    def forget_source(self, src_id: str) -> None:
        """A source restarted or left: its payload must be placed again."""
        self._payload_bytes.pop(src_id, None)

    async def run(self, pairs: Callable[[], ProbePairs]) -> None:
        """Probes the links `pairs()` names when they are due, one at a time, forever.

        A pass probes the `PASS_LINKS` links due longest (those never probed first), then
        asks `pairs()` again, so instances that joined or left count from the next pass.
        Only a probed link holds state, and a pass reads the pairs only until it has
        found the links it probes.
        """
        spacing_s = 1.0 / self.settings.max_probes_per_s
        next_start_s = self._clock()
        while True:
            due = self._due(pairs(), self._clock())
            for src, dst in due:
                await asyncio.sleep(max(0.0, next_start_s - self._clock()))
                next_start_s = self._clock() + spacing_s
                try:
                    await self.probe(src, dst)
                except KvrsError as exc:
                    log.warning("probe %s -> %s failed: %s", src.instance_id, dst.instance_id, exc)
            now_s = self._clock()
            upcoming = [s.next_due_s for s in self.links.values() if s.next_due_s > now_s]
            wait_s = min(upcoming) - now_s if upcoming else self.settings.interval_s
            if len(due) == PASS_LINKS:
                wait_s = 0.0  # more may be due already
            await asyncio.sleep(max(0.05, min(wait_s, self.settings.interval_s)))

    def _due(self, pairs: ProbePairs, now_s: float) -> list[tuple[Endpoint, Endpoint]]:
        """The links of this pass: up to `PASS_LINKS` of `pairs` due by `now_s`, those
        never probed first (in the pairs' order), then the probed ones due longest."""
        chosen: list[tuple[Endpoint, Endpoint]] = []
        for src, dst in pairs:
            if (src.instance_id, dst.instance_id) not in self.links:
                chosen.append((src, dst))
                if len(chosen) == PASS_LINKS:
                    return chosen
        sources = {src.instance_id: src for src in pairs.sources}
        targets = {dst.instance_id: dst for dst in pairs.targets}
        probed = []
        for (src_id, dst_id), state in self.links.items():
            if state.next_due_s <= now_s and src_id in sources and dst_id in targets:
                probed.append((state.next_due_s, sources[src_id], targets[dst_id]))
        probed.sort(key=lambda item: item[0])
        chosen.extend((src, dst) for _, src, dst in probed[: PASS_LINKS - len(chosen)])
        return chosen
