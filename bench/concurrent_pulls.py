"""Pulls started together onto one decode instance: do their set-ups overlap or queue?

    python -m bench.concurrent_pulls [--rounds 5] [--prompt-tokens 128] [--pulls 1,2,4,8,16]

A failed decode instance strands its requests at once, and the recovery planner
(`kvrs.batch`) starts their pulls onto a shared target together. How it prices them
rests on what such pulls cost side by side: each its own set-up plus its share of the
streaming, or n set-ups in a row. This bench measures it on the bench cluster of
`bench.router_overhead` (two prefill and two decode workers on the tiny model): for each
n, n prompts are prefilled (alternating between the two prefill instances, pairs already
built), then n PullKv calls go to decode-0 at once. Sizes run in turn, `--rounds` times;
figures are medians over rounds.

Reported per n: the time until the last pull answered (wall), the mean of the pulls'
own times, and both against n × the time of one pull alone (1.0: the pulls queue one
behind another; 1 / n: they overlap fully).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid

import grpc

from bench.report import add_json_argument, write_json
from bench.router_overhead import on_bench_cluster
from kvrs.cli.launcher import ClusterState
from kvrs.v1 import worker_pb2, worker_pb2_grpc

SOURCES = ("prefill-0", "prefill-1")
TARGET = "decode-0"


async def _pull_together(
    state: ClusterState, stubs: dict, prompt: list[int], n: int
) -> tuple[float, list[float]]:
    """Prefills n copies of `prompt`, pulls them onto TARGET at once, releases them:
    (wall seconds until the last pull answered, each pull's seconds)."""
    held = []
    for i in range(n):
        source = SOURCES[i % len(SOURCES)]
        request_id = f"pulls-{uuid.uuid4().hex[:10]}"
        await stubs[source].Prefill(
            worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt), timeout=30
        )
        held.append((request_id, source))

    async def pull(request_id: str, source: str) -> float:
        started = time.perf_counter()
        await stubs[TARGET].PullKv(
            worker_pb2.PullKvRequest(
                request_id=request_id,
                source_instance_id=source,
                source_address=state.address(source),
                token_start=0,
                token_end=len(prompt),
                prompt_tokens=len(prompt),
            ),
            timeout=30,
        )
        return time.perf_counter() - started

    started = time.perf_counter()
    each_s = await asyncio.gather(*(pull(*item) for item in held))
    wall_s = time.perf_counter() - started
    for request_id, source in held:
        release = worker_pb2.ReleaseKvRequest(request_id=request_id)
        await stubs[TARGET].ReleaseKv(release, timeout=5)
        await stubs[source].ReleaseKv(release, timeout=5)
    return wall_s, list(each_s)


async def bench(state: ClusterState, rounds: int, prompt_tokens: int, sizes: list[int]) -> dict:
    """Runs the rounds, prints the table; returns every printed figure (seconds)."""
    prompt = [(7 * i + 3) % 251 for i in range(prompt_tokens)]
    channels = [grpc.aio.insecure_channel(state.address(name)) for name in (*SOURCES, TARGET)]
    stubs = {
        name: worker_pb2_grpc.WorkerServiceStub(channel)
        for name, channel in zip((*SOURCES, TARGET), channels, strict=True)
    }
    try:
        # Warm-up: channels, both pairs, the target's allocator.
        await _pull_together(state, stubs, prompt, 2 * len(SOURCES))
        walls: dict[int, list[float]] = {n: [] for n in sizes}
        means: dict[int, list[float]] = {n: [] for n in sizes}
        solo: list[float] = []
        for _ in range(rounds):
            solo.append((await _pull_together(state, stubs, prompt, 1))[0])
            for n in sizes:
                wall_s, each_s = await _pull_together(state, stubs, prompt, n)
                walls[n].append(wall_s)
                means[n].append(statistics.fmean(each_s))
    finally:
        for channel in channels:
            await channel.close()
    solo_s = statistics.median(solo)
    print(
        f"\n{rounds} rounds, prompt {prompt_tokens} tokens, pulls onto {TARGET} from "
        f"{' and '.join(SOURCES)} (medians), milliseconds; one pull alone {solo_s * 1e3:.2f}"
    )
    print(f"  {'pulls':>5}{'wall':>10}{'mean pull':>12}{'wall / (n x alone)':>21}")
    figures: dict = {"rounds": rounds, "prompt_tokens": prompt_tokens, "alone_s": solo_s}
    rows = {}
    for n in sizes:
        wall_s, mean_s = statistics.median(walls[n]), statistics.median(means[n])
        serial = wall_s / (n * solo_s)
        rows[str(n)] = {"wall_s": wall_s, "mean_pull_s": mean_s, "wall_over_serial": serial}
        print(f"  {n:>5}{wall_s * 1e3:>10.2f}{mean_s * 1e3:>12.2f}{serial:>21.2f}")
    figures["pulls"] = rows
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.concurrent_pulls", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument(
        "--pulls",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 2, 4, 8, 16],
        help="pull counts started together, comma-separated",
    )
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1 or not args.pulls or min(args.pulls) < 1:
        parser.error("--rounds and every --pulls count must be >= 1")
    figures = on_bench_cluster(
        lambda state: bench(state, args.rounds, args.prompt_tokens, args.pulls)
    )
    write_json(args.json, "concurrent_pulls", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
