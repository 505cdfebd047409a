"""A failed probe reports its link down to gossip, and the link's EWMA survives the cut."""

from __future__ import annotations

import pytest

from kvrs.errors import Unavailable
from services.prober.probing import DOWN_BANDWIDTH_BPS, LinkProber, ProbeSettings
from services.worker.client import Endpoint, Pulled

SRC = Endpoint("prefill-0", "p0:1")
DST = Endpoint("decode-0", "d0:1")
BYTES_PER_TOKEN = 1024
SETTINGS = ProbeSettings(
    budget_fraction=0.02, target_probe_s=0.05, interval_s=1.0, payload_tokens=256, max_pulls=4
)


class CuttableLink:
    """A 1 Gbit/s link on a fake clock that can be cut (every pull times out)."""

    def __init__(self) -> None:
        self.now_s = 100.0
        self.cut = False

    def clock(self) -> float:
        return self.now_s

    async def place_payload(self, src, kv_id, tokens, lease_s) -> int:
        return tokens * BYTES_PER_TOKEN

    async def pull(self, dst, src, kv_id, tokens, pacing_bps) -> Pulled:
        if self.cut:
            self.now_s += 2.0
            raise Unavailable(f"{dst.instance_id}: deadline exceeded")
        seconds = 0.001 + 8 * tokens * BYTES_PER_TOKEN / 1e9
        self.now_s += seconds
        return Pulled(
            kv_bytes=tokens * BYTES_PER_TOKEN,
            transfer_s=seconds,
            total_s=seconds,
            recomputed_tokens=0,
        )

    async def drop(self, at, kv_id) -> None:
        return None


class Gossip:
    def __init__(self) -> None:
        self.samples = []

    async def report_link_sample(self, sample) -> None:
        self.samples.append(sample)


async def test_a_failed_probe_reports_the_link_down_and_retries_it_soon():
    link, gossip = CuttableLink(), Gossip()
    prober = LinkProber(link, gossip, SETTINGS, clock=link.clock)
    good = await prober.probe(SRC, DST)
    measured_bps = good.estimate.bandwidth_bps
    link.cut = True
    with pytest.raises(Unavailable):
        await prober.probe(SRC, DST)
    down = gossip.samples[-1]
    assert (down.src_instance_id, down.dst_instance_id) == ("prefill-0", "decode-0")
    assert down.bandwidth_bps == DOWN_BANDWIDTH_BPS and down.sample_bandwidth_bps == 0.0
    state = prober.link(SRC, DST)
    assert state.last_error and state.estimate.bandwidth_bps == measured_bps
    assert state.next_due_s == pytest.approx(link.now_s + SETTINGS.interval_s)
    link.cut = False
    link.now_s = state.next_due_s
    back = await prober.probe(SRC, DST)
    assert not back.last_error and back.estimate.samples == 2
    assert gossip.samples[-1].bandwidth_bps == pytest.approx(measured_bps, rel=0.01)


async def test_a_link_that_never_answered_is_reported_down():
    link, gossip = CuttableLink(), Gossip()
    link.cut = True
    prober = LinkProber(link, gossip, SETTINGS, clock=link.clock)
    with pytest.raises(Unavailable):
        await prober.probe(SRC, DST)
    (down,) = gossip.samples
    assert down.bandwidth_bps == DOWN_BANDWIDTH_BPS and down.samples == 0
