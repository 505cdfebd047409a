"""Simulator speed: the Mooncake trace per policy, run time against requests and GPUs, and
the 1,000,000-request run on 1,024 GPUs against its goal of 120 s.

`python -m bench.sim_speed` measures (CPU seconds of this process, wall seconds beside
them; other load on a shared machine inflates the wall time more):
1. the 3,993-request synthetic Mooncake trace on the 64-GPU fat-tree, once per policy;
2. requests × GPUs: generated workloads (arrival rate scaled with the GPU count) on
   64, 256 and 1,024 GPUs at a few request counts, and the cost per request;
3. with `--full`, 1,000,000 generated requests on 1,024 GPUs (netkv), measured end to end:
   the simulator built, every request replayed, the summary computed (about ten minutes
   on the development machine). Generating the workload beforehand is timed apart.
   `--million-only` skips 1 and 2; `--million-requests` changes the size.
Writes every printed figure to --json FILE (default runs/bench/sim_speed.json), with the
machine's load average and CPU count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

from kvrs.sim.config import PolicySpec, SimConfig
from kvrs.sim.experiments.common import load_workload
from kvrs.sim.simulator import run_policy
from kvrs.sim.trace import SyntheticWorkload, TraceRequest

POLICIES = [
    PolicySpec("round_robin", "round_robin"),
    PolicySpec("cache_load", "cache_load"),
    PolicySpec("netkv", "netkv", network_view="telemetry"),
    PolicySpec("kvrs", "netkv", network_view="live"),
]
NETKV = POLICIES[2]
BASE_RATE_PER_S = 3.9  # the trace's rate on 64 GPUs
TARGET_TRACE_S = 5.0
TARGET_MILLION_S = 120.0
MILLION = 1_000_000
MILLION_GPUS = 1024


def cluster(gpus: int) -> SimConfig:
    """The default fat-tree (docs/simulator.md) grown to `gpus` GPUs (8 a node, 2 nodes a rack)."""
    nodes = gpus // 8
    return SimConfig.from_dict(
        {"cluster": {"nodes": nodes, "nodes_per_rack": 2, "racks_per_pod": max(2, nodes // 16)}}
    )


def generated(requests: int, gpus: int) -> list[TraceRequest]:
    """The synthetic workload at the trace's rate per 64 GPUs, scaled to `gpus`."""
    return SyntheticWorkload(
        requests=requests, rate_per_s=BASE_RATE_PER_S * gpus / 64, seed=1
    ).generate()


def timed(config: SimConfig, requests: list[TraceRequest], policy: PolicySpec) -> dict:
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


def trace_rows() -> tuple[str, list[dict]]:
    workload = load_workload({"trace": "default", "synthetic": {"requests": 3993}})
    rows = [timed(SimConfig(), workload.requests, policy) for policy in POLICIES]
    for row in rows:
        print(
            f"trace ({row['requests']} req, 64 GPUs) {row['policy']:12s} "
            f"cpu {row['cpu_s']:6.2f} s  wall {row['wall_s']:6.2f} s  "
            f"{'ok' if row['cpu_s'] <= TARGET_TRACE_S else 'OVER'} (target "
            f"{TARGET_TRACE_S:g} s)"
        )
    return workload.source, rows


def growth_rows(gpu_counts: list[int], sizes: list[int]) -> list[dict]:
    rows = []
    for gpus in gpu_counts:
        config = cluster(gpus)
        for size in sizes:
            row = timed(config, generated(size, gpus), NETKV)
            row["gpus"] = gpus
            rows.append(row)
            print(
                f"{gpus:5d} GPUs {size:8d} req  cpu {row['cpu_s']:7.2f} s  "
                f"{row['us_per_request']:7.0f} µs/request  {row['events']} events"
            )
    return rows


def million_row(requests: int) -> dict:
    """The long run, measured end to end; the workload is generated before the clock starts."""
    started = time.process_time()
    workload = generated(requests, MILLION_GPUS)
    generate_s = time.process_time() - started
    row = timed(cluster(MILLION_GPUS), workload, NETKV)
    del workload
    row.update(
        gpus=MILLION_GPUS,
        generate_cpu_s=generate_s,
        goal_s=TARGET_MILLION_S,
        goal_met=row["cpu_s"] <= TARGET_MILLION_S if requests == MILLION else None,
        max_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        load_average_after=list(os.getloadavg()),
    )
    verdict = {True: "met", False: "NOT met", None: f"set for {MILLION:,} requests"}
    print(
        f"{requests:,} requests on {MILLION_GPUS:,} GPUs: cpu {row['cpu_s']:.0f} s, "
        f"wall {row['wall_s']:.0f} s; goal {TARGET_MILLION_S:g} s: "
        f"{verdict[row['goal_met']]} ({row['us_per_request']:.0f} µs/request, "
        f"{row['events']:,} events; workload generated beforehand in {generate_s:.0f} s cpu; "
        f"peak memory {row['max_rss_gib']:.1f} GiB; "
        f"load average {row['load_average_after'][0]:.1f})"
    )
    return row


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
        "--full",
        action="store_true",
        help=f"also run 1,000,000 requests on {MILLION_GPUS:,} GPUs, measured (~10 min)",
    )
    parser.add_argument(
        "--million-only", action="store_true", help="only the long run (implies --full)"
    )
    parser.add_argument(
        "--million-requests",
        type=int,
        default=MILLION,
        metavar="N",
        help="requests of the long run (default 1,000,000; the goal is for that size)",
    )
    args = parser.parse_args(argv)

    figures: dict = {"measured_unix_s": time.time(), "cpus": os.cpu_count()}
    figures["load_average_before"] = list(os.getloadavg())
    if not args.million_only:
        source, rows = trace_rows()
        figures["trace"] = {"source": source, "target_s": TARGET_TRACE_S, "rows": rows}
        figures["growth"] = growth_rows(args.gpus, args.sizes)
    figures["million"] = None
    if args.full or args.million_only:
        figures["million"] = million_row(args.million_requests)
    else:
        print(
            f"{MILLION:,} requests on {MILLION_GPUS:,} GPUs: not run (--full runs it; "
            f"goal {TARGET_MILLION_S:g} s)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
