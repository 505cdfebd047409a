"""In-process decision time of the pure core: Recover, SelectDecode and RecoverBatch.

`python -m bench.core_decisions [--json FILE]` times each decision as the scheduler makes it
on a steady cluster view (the view built once, then many decisions against it), and
prints median and p99 wall time against the goals, with the median CPU time of the
thread beside them (on a shared machine, wall time includes other processes' turns).
The first decision on a fresh or a refreshed view is timed separately, as is the refresh
itself, which prepares the candidates' columns (off the decision path).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.report import add_json_argument, write_json
from kvrs.batch import plan_batch
from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.estimator import LinkEstimate
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.placement import NetKv, PlacementRequest, prepare_candidates
from kvrs.profile import compute_profile
from kvrs.recovery import Kvrs, RecoveryRequest
from kvrs.topology import Role, Topology

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Result:
    name: str
    median_us: float
    p99_us: float
    cpu_median_us: float
    """Median CPU time of the thread: what the decision costs when the machine is shared."""
    goal_us: float | None
    runs: int

    @property
    def met(self) -> bool | None:
        return None if self.goal_us is None else self.p99_us <= self.goal_us


def timed(
    name: str, fn: Callable[[], object], runs: int, goal_us: float | None, warmup: int = 50
) -> Result:
    """Median and p99 of `runs` calls of `fn`, garbage collection paused while timing."""
    for _ in range(warmup):
        fn()
    samples, cpu_samples = [], []
    gc.disable()
    try:
        for _ in range(runs):
            cpu_start = time.thread_time_ns()
            start = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - start)
            cpu_samples.append(time.thread_time_ns() - cpu_start)
    finally:
        gc.enable()
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    return Result(
        name,
        statistics.median(samples) / 1e3,
        p99 / 1e3,
        statistics.median(cpu_samples) / 1e3,
        goal_us,
        runs,
    )


def cluster(decode: int, rng: random.Random) -> tuple[CostModel, ClusterView, list[int]]:
    """A fat tree with `decode` decode GPUs (as many prefill), live-looking state.

    8 GPUs per node (4 prefill, 4 decode), 4 nodes per rack, 4 racks per pod; waits,
    loads, free memory and resident prefix blocks vary; some paths carry measured
    bandwidth and some links carry flows, as a scheduler's view would.
    """
    topology = Topology.fat_tree(
        nodes=max(1, decode // 4), gpus_per_node=8, nodes_per_rack=4, racks_per_pod=4
    )
    model = model_spec("opt-13b")
    network = NetworkModel(topology)
    cost = CostModel(model, compute_profile("opt-13b"), network)
    shared_prefix = [rng.getrandbits(63) for _ in range(8)]
    states = {}
    for instance_id, spec in topology.instances.items():
        resident = frozenset(shared_prefix[: rng.choice([0, 0, 0, 2, 4, 8])])
        states[instance_id] = InstanceState(
            instance_id,
            spec.role,
            wait_s=rng.uniform(0.0, 0.2),
            queue_depth=rng.randrange(8),
            running_requests=rng.randrange(32),
            free_kv_tokens=rng.choice([4_000, 200_000, 200_000]),
            resident_blocks=resident if spec.role is Role.DECODE else frozenset(),
        )
    prefills = [i for i, s in topology.instances.items() if s.role is Role.PREFILL]
    decodes = [i for i, s in topology.instances.items() if s.role is Role.DECODE]
    for src in prefills[:4]:
        for dst in rng.sample(decodes, min(16, len(decodes))):
            network.set_link_estimate(
                src, dst, LinkEstimate(rng.uniform(50e9, 300e9), 2e-5, measured_at_s=0.0, samples=5)
            )
    links = {link for p in prefills[:8] for d in decodes[:8] for link in topology.path_links(p, d)}
    network.set_flows({link: rng.randrange(3) for link in sorted(links)})
    return cost, ClusterView(states, now_s=1.0), shared_prefix


def bench_select(decode: int, runs: int, goal_us: float, rng: random.Random) -> list[Result]:
    cost, view, prefix = cluster(decode, rng)
    candidates = view.decode_instances()
    policy = NetKv()
    request = PlacementRequest("bench", "prefill-0", 1477, tuple(prefix[:3]))
    steady = timed(
        f"SelectDecode netkv, {len(candidates)} candidates",
        lambda: policy.select(request, candidates, cost, 1.0),
        runs,
        goal_us,
    )

    # A refresh installs a view with its candidates prepared (`prepare_candidates`, as
    # the scheduler's view cache does), so the first decision finds its columns built.
    fresh_views = [
        fresh_view(ClusterView(view.instances, now_s=1.0), view) for _ in range(max(20, runs // 50))
    ]
    pending_fresh = iter(fresh_views)
    fresh = timed(
        f"  first on a fresh view, {len(candidates)} candidates",
        lambda: policy.select(request, next(pending_fresh).decode_instances(), cost, 1.0),
        len(fresh_views) - 5,
        goal_us,
        warmup=5,
    )
    # What a view refresh hands the next decision: the view updated with the instances
    # whose load changed (at 0.1 s refreshes and 2 s heartbeats, a twentieth of them).
    changed_count = max(1, len(view.instances) // 20)
    refreshes = [
        fresh_view(view.updated(refreshed_states(view, rng, changed_count)), view)
        for _ in range(max(20, runs // 50))
    ]
    pending = iter(refreshes)
    refreshed = timed(
        f"  first on a refreshed view ({changed_count} changed), {len(candidates)} candidates",
        lambda: policy.select(request, next(pending).decode_instances(), cost, 1.0),
        len(refreshes) - 5,
        goal_us,
        warmup=5,
    )
    changes = refreshed_states(view, rng, changed_count)
    update = timed(
        f"  the refresh itself (ClusterView.updated, {changed_count} changed, prepared)",
        lambda: fresh_view(view.updated(changes), view),
        max(20, runs // 50),
        None,
        warmup=5,
    )
    rebuild = timed(
        "  a view built anew (a full listing, prepared)",
        lambda: fresh_view(ClusterView(view.instances, now_s=1.0), view),
        max(20, runs // 50),
        None,
        warmup=5,
    )
    return [steady, fresh, refreshed, update, rebuild]


def fresh_view(view: ClusterView, previous: ClusterView) -> ClusterView:
    """`view` as a refresh installs it in place of `previous`: its candidates prepared."""
    prepare_candidates(view, previous)
    return view


def refreshed_states(view: ClusterView, rng: random.Random, count: int) -> dict[str, InstanceState]:
    """New load reports of `count` alive instances, as a heartbeat would bring them."""
    return {
        instance_id: dataclasses.replace(
            view.instances[instance_id],
            wait_s=rng.uniform(0.0, 0.2),
            queue_depth=rng.randrange(8),
            running_requests=rng.randrange(32),
        )
        for instance_id in rng.sample(sorted(view.instances), count)
    }


def bench_recover(decode: int, runs: int, goal_us: float, rng: random.Random) -> Result:
    cost, view, _ = cluster(decode, rng)
    failed = view.decode_instances()[0].instance_id
    request = RecoveryRequest(
        "bench", 1477, 64, "prefill-0", deadline_s=10.0, exclude_ids=frozenset({failed})
    )
    policy = Kvrs()
    targets = len(view.decode_instances(request.exclude_ids))
    return timed(
        f"Recover kvrs, {targets} decode targets",
        lambda: policy.decide(request, view, cost, 1.0),
        runs,
        goal_us,
    )


def bench_batch(requests: int, runs: int, goal_us: float, rng: random.Random) -> Result:
    cost, view, _ = cluster(32, rng)
    failed = view.decode_instances()[0].instance_id
    prefills = [s.instance_id for s in view.prefill_instances()]
    batch = [
        RecoveryRequest(
            f"r{i}",
            rng.randrange(64, 8192),
            rng.randrange(0, 512),
            rng.choice(prefills),
            deadline_s=rng.uniform(2.0, 30.0),
            exclude_ids=frozenset({failed}),
        )
        for i in range(requests)
    ]
    policy = Kvrs()
    return timed(
        f"RecoverBatch kvrs, {requests} requests, 31 targets",
        lambda: plan_batch(batch, view, cost, 1.0, policy, migration_slots_free=32),
        runs,
        goal_us,
        warmup=2,
    )


def run_all(quick: bool) -> list[Result]:
    scale = 10 if quick else 1
    rng = random.Random(7)
    results = [
        bench_recover(8, 20_000 // scale, 10.0, rng),
        bench_recover(4, 20_000 // scale, 10.0, rng),
    ]
    results += bench_select(64, 20_000 // scale, 30.0, rng)
    results += bench_select(4096, 5_000 // scale, 300.0, rng)
    results.append(bench_batch(512, 40 // min(scale, 4), 20_000.0, rng))
    return results


def table(results: list[Result]) -> str:
    rows = [("decision", "median µs", "p99 µs", "CPU µs", "goal µs", "median ok", "p99 ok")]
    for r in results:
        goal = "" if r.goal_us is None else f"{r.goal_us:,.0f}"
        ok_median = "" if r.goal_us is None else ("yes" if r.median_us <= r.goal_us else "NO")
        ok_p99 = "" if r.goal_us is None else ("yes" if r.p99_us <= r.goal_us else "NO")
        rows.append(
            (
                r.name,
                f"{r.median_us:,.1f}",
                f"{r.p99_us:,.1f}",
                f"{r.cpu_median_us:,.1f}",
                goal,
                ok_median,
                ok_p99,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_argument(parser)
    parser.add_argument("--quick", action="store_true", help="a tenth of the runs")
    args = parser.parse_args(argv)
    results = run_all(args.quick)
    # p99 is at the mercy of whatever else runs on the machine: the load says how much.
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"kvrs core decisions, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, load average {load}"
    )
    print(table(results))
    write_json(args.json, "core_decisions", {"decisions": as_figures(results)})
    return 0


def as_figures(results) -> list[dict]:
    """Every row of the table, as the JSON report carries it."""
    return [{**r.__dict__, "p99_met": r.met} for r in results]


if __name__ == "__main__":
    sys.exit(main())
