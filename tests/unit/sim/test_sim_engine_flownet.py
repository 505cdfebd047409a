"""Event loop order and the flow network's max-min fair sharing on tiny topologies."""

from __future__ import annotations

import pytest

from kvrs.sim.engine import EventLoop
from kvrs.sim.flownet import FlowNetwork


def test_events_run_in_time_then_scheduling_order_and_cancel_skips():
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, seen.append, "late")
    loop.at(1.0, seen.append, "first")
    loop.at(1.0, seen.append, "second")
    handle = loop.at(1.5, seen.append, "cancelled")
    loop.cancel(handle)
    loop.run()
    assert seen == ["first", "second", "late"]
    assert loop.now_s == 2.0


def test_run_until_stops_the_clock_there():
    loop = EventLoop()
    seen: list[float] = []
    loop.at(5.0, lambda: seen.append(loop.now_s))
    loop.run(until_s=3.0)
    assert seen == [] and loop.now_s == 3.0
    loop.run()
    assert seen == [5.0]


def _network(capacities: dict[str, float]) -> tuple[EventLoop, FlowNetwork, list]:
    loop = EventLoop()
    network = FlowNetwork(loop, capacities.__getitem__)
    done: list[tuple[str, float]] = []
    return loop, network, done


def test_max_min_fair_rates_follow_the_textbook_example():
    # Links a (10), b (10), c (4). f3 is capped by c at 4; f1 and f2 split a; f1 also
    # crosses b, where f3's 4 leaves 6 >= 5, so f1 gets 5 and the allocation is max-min.
    loop, net, done = _network({"a": 10.0, "b": 10.0, "c": 4.0})
    f1 = net.start(["a", "b"], 10 / 8, lambda f: done.append(("f1", loop.now_s)))
    f2 = net.start(["a"], 10 / 8, lambda f: done.append(("f2", loop.now_s)))
    f3 = net.start(["b", "c"], 8 / 8, lambda f: done.append(("f3", loop.now_s)))
    assert (f1.rate_bps, f2.rate_bps, f3.rate_bps) == (5.0, 5.0, 4.0)
    loop.run()
    assert sorted(done) == [("f1", 2.0), ("f2", 2.0), ("f3", 2.0)]


def test_bottleneck_frees_capacity_for_others_when_a_flow_ends():
    # Two flows share link s (capacity 2 b/s), 1 b/s each. The 1-bit flow ends at t=1;
    # the 4-bit flow has 3 bits left and now gets all 2 b/s: done at t=2.5.
    loop, net, done = _network({"s": 2.0})
    net.start(["s"], 1 / 8, lambda f: done.append(("short", loop.now_s)))
    net.start(["s"], 4 / 8, lambda f: done.append(("long", loop.now_s)))
    loop.run()
    assert done[0] == ("short", pytest.approx(1.0))
    assert done[1] == ("long", pytest.approx(2.5))


def test_water_filling_gives_leftover_to_unconstrained_flows():
    # Link x (capacity 9) carries f1, f2, f3; f1 also crosses y (capacity 1).
    # Max-min: f1 = 1 (bottleneck y), f2 = f3 = 4 (split the 8 left on x).
    loop, net, _ = _network({"x": 9.0, "y": 1.0})
    f1 = net.start(["x", "y"], 100.0)
    f2 = net.start(["x"], 100.0)
    f3 = net.start(["x"], 100.0)
    assert f1.rate_bps == pytest.approx(1.0)
    assert f2.rate_bps == pytest.approx(4.0) and f3.rate_bps == pytest.approx(4.0)
    assert net.utilisation("x") == pytest.approx(1.0)


def test_background_takes_capacity_and_rates_recover_when_it_stops():
    loop, net, done = _network({"s": 8.0})
    flow = net.start(["s"], 10.0, lambda f: done.append(loop.now_s))  # 80 bits
    net.set_background("s", 6.0)
    assert flow.rate_bps == pytest.approx(2.0)
    loop.at(5.0, net.set_background, "s", 0.0)  # 10 bits sent by t=5, 70 left at 8 b/s
    loop.run()
    assert done == [pytest.approx(5.0 + 70 / 8)]


def test_setup_latency_delays_the_flow_and_abort_never_calls_back():
    loop, net, done = _network({"s": 8.0})
    net.start(["s"], 1.0, lambda f: done.append(("kept", loop.now_s)), setup_s=0.5)
    dropped = net.start(["s"], 1.0, lambda f: done.append(("dropped", loop.now_s)))
    loop.at(0.25, net.abort, dropped)
    loop.run()
    assert done == [("kept", pytest.approx(1.5))]
    assert net.launched == {}


def test_only_the_affected_component_is_refilled():
    loop, net, _ = _network({"a": 1.0, "b": 1.0})
    net.start(["a"], 100.0)
    before = net.refilled_flows
    net.start(["b"], 100.0)
    # The new flow's component is itself alone; the flow on `a` is not touched.
    assert net.refilled_flows - before == 1


def test_on_off_background_averages_its_utilisation():
    from kvrs.sim.background import BackgroundSpec, BackgroundTraffic

    loop, net, _ = _network({("pod-up", "p0"): 100.0, ("node-up", "n0"): 100.0})
    spec = BackgroundSpec(utilisation=0.3, on_share=0.9, period_s=2.0)
    traffic = BackgroundTraffic(spec, loop, net, [("pod-up", "p0"), ("node-up", "n0")], seed=1)
    traffic.start()
    samples = []
    for i in range(20_000):
        loop.at(i * 0.1, lambda: samples.append(net.link(("pod-up", "p0")).background_bps))
    loop.at(2000.0, traffic.stop)
    loop.run()
    assert sum(samples) / len(samples) / 100.0 == pytest.approx(0.3, abs=0.03)
    assert set(samples) == {0.0, 90.0}
    # node uplinks are not agg/spine links: untouched.
    assert net.link(("node-up", "n0")).background_bps == 0.0
