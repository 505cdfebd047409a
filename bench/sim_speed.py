"""Simulator speed: the Mooncake trace per policy, and how run time grows with requests and GPUs.

`python -m bench.sim_speed` measures (CPU seconds of this process, so other load on the
machine counts less):
1. the 3,993-request synthetic Mooncake trace on the 64-GPU fat-tree, once per policy;
2. requests × GPUs: generated workloads (arrival rate scaled with the GPU count) on
   64, 256 and 1,024 GPUs at a few request counts, per-request cost, and the 1,000,000-
   request, 1,024-GPU time extrapolated from the largest measured size (or measured,
   with `--full`).
Writes JSON to --out (default runs/bench/sim_speed.json) and a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvrs.sim.config import PolicySpec, SimConfig
from kvrs.sim.experiments.common import load_workload
from kvrs.sim.simulator import run_policy
from kvrs.sim.trace import SyntheticWorkload

POLICIES = [
    PolicySpec("round_robin", "round_robin"),
    PolicySpec("cache_load", "cache_load"),
    PolicySpec("netkv", "netkv", network_view="telemetry"),
    PolicySpec("kvrs", "netkv", network_view="live"),
]
BASE_RATE_PER_S = 3.9  # the trace's rate on 64 GPUs
TARGET_TRACE_S = 5.0
TARGET_MILLION_S = 120.0


def cluster(gpus: int) -> SimConfig:
    """The default fat-tree (docs/simulator.md) grown to `gpus` GPUs (8 a node, 2 nodes a rack)."""
    nodes = gpus // 8
    return SimConfig.from_dict(
        {"cluster": {"nodes": nodes, "nodes_per_rack": 2, "racks_per_pod": max(2, nodes // 16)}}
    )


def timed(config: SimConfig, requests, policy: PolicySpec) -> dict:
    started_cpu, started_wall = time.process_time(), time.perf_counter()
    result = run_policy(config, requests, policy)
    cpu_s = time.process_time() - started_cpu
    return {
        "policy": policy.name,
        "requests": len(requests),
        "cpu_s": cpu_s,
        "wall_s": time.perf_counter() - started_wall,
        "events": result.summary.events,
        "sim_time_s": result.summary.sim_time_s,
        "lost": result.summary.lost,
        "us_per_request": 1e6 * cpu_s / len(requests),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json",
        "--out",
        dest="out",
        metavar="FILE",
        type=Path,
        default=Path("runs/bench/sim_speed.json"),
        help="every printed figure, as JSON",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[2000, 4000, 8000],
        help="request counts for the growth table",
    )
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument(
        "--full", action="store_true", help="also run 1,000,000 requests on 1,024 GPUs (long)"
    )
    args = parser.parse_args(argv)

    workload = load_workload({"trace": "default", "synthetic": {"requests": 3993}})
    trace_rows = [timed(SimConfig(), workload.requests, policy) for policy in POLICIES]
    for row in trace_rows:
        print(
            f"trace ({workload.stats.requests} req, 64 GPUs) {row['policy']:12s} "
            f"cpu {row['cpu_s']:6.2f} s  wall {row['wall_s']:6.2f} s  "
            f"{'ok' if row['cpu_s'] <= TARGET_TRACE_S else 'OVER'} (target "
            f"{TARGET_TRACE_S:g} s)"
        )

    netkv = POLICIES[2]
    growth = []
    for gpus in args.gpus:
        config = cluster(gpus)
        for size in args.sizes:
            requests = SyntheticWorkload(
                requests=size, rate_per_s=BASE_RATE_PER_S * gpus / 64, seed=1
            ).generate()
            row = timed(config, requests, netkv)
            row["gpus"] = gpus
            growth.append(row)
            print(
                f"{gpus:5d} GPUs {size:8d} req  cpu {row['cpu_s']:7.2f} s  "
                f"{row['us_per_request']:7.0f} µs/request  {row['events']} events"
            )
    largest = max((r for r in growth if r["gpus"] == max(args.gpus)), key=lambda r: r["requests"])
    million_s = largest["us_per_request"]  # µs per request × 1e6 requests = seconds
    measured = None
    if args.full:
        requests = SyntheticWorkload(
            requests=1_000_000, rate_per_s=BASE_RATE_PER_S * 1024 / 64, seed=1
        )
        measured = timed(cluster(1024), list(requests), netkv)
    print(
        f"1,000,000 requests on {max(args.gpus)} GPUs: extrapolated {million_s:.0f} s from "
        f"{largest['requests']} requests (target {TARGET_MILLION_S:g} s)"
        + (f"; measured {measured['cpu_s']:.0f} s" if measured else "")
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "trace": {"source": workload.source, "rows": trace_rows},
                "growth": growth,
                "million_extrapolated_s": million_s,
                "million_from_requests": largest["requests"],
                "million_measured": measured,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
