"""Placement predictions against what the cluster then did, for routed requests at a steady rate.

    python -m bench.placement_error [--requests 60] [--rate 4] [--warmup 12] [--seed 0]

Starts the bench cluster of `bench.router_overhead` (gossip, slot broker, one scheduler,
two prefill and two decode workers on the tiny model, the router), its compute profile
calibrated on this machine first, as `kvrs demo` does. Streams `--warmup`
requests one after another first (their outcomes reach the scheduler's corrections, as a
serving cluster's recent traffic does), then `--requests` unpinned requests arriving as
a Poisson stream of `--rate` per second, with prompts of 32–1,024 tokens and outputs of
16–128 drawn from `--seed` (no two share a prefix).

Each request's summary carries its placement's prediction and measurement of the time
from SelectDecode's answer to the first decoded token (queue wait, transfer, the first
step). Reported: the error |measured − predicted| / measured at p50 and p90 over the
requests (goal: p90 ≤ 20 %), the median ratio measured / predicted, and the scheduler's
own error per term over its newest placement outcomes (`GetCorrections`), which says
which term is off. Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import uuid

import grpc

from bench.report import add_json_argument, write_json
from bench.router_overhead import on_bench_cluster, percentile
from kvrs.client import KvrsClient
from kvrs.rpc.generate import generate_into
from kvrs.v1 import router_pb2, router_pb2_grpc

PROMPT_TOKENS = (32, 1024)
NEW_TOKENS = (16, 128)
TOKEN_IDS = (3, 250)
"""Token ids drawn for prompts: inside the tiny model's vocabulary."""
TIMEOUT_S = 60.0


def draw_requests(count: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens) of `count` requests, reproducible from `seed`."""
    rng = random.Random(seed)
    return [
        (
            [rng.randint(*TOKEN_IDS) for _ in range(rng.randint(*PROMPT_TOKENS))],
            rng.randint(*NEW_TOKENS),
        )
        for _ in range(count)
    ]


async def _one(router, prompt: list[int], new_tokens: int) -> router_pb2.GenerateSummary | None:
    request = router_pb2.GenerateRequest(
        request_id=f"bench-{uuid.uuid4().hex[:10]}",
        prompt_token_ids=prompt,
        max_new_tokens=new_tokens,
    )
    summary, error = await generate_into(router, request, [], TIMEOUT_S)
    if error is not None:
        print(f"  {request.request_id}: {error.code().name}: {error.details()}", file=sys.stderr)
    return summary


async def bench(state, args: argparse.Namespace) -> dict:
    """Runs the warm-up and the measured stream; prints the table and returns its figures."""
    warmup = draw_requests(args.warmup, args.seed + 1)
    measured = draw_requests(args.requests, args.seed)
    rng = random.Random(args.seed + 2)
    async with grpc.aio.insecure_channel(state.address("router")) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        for prompt, new_tokens in warmup:
            await _one(router, prompt, new_tokens)
        tasks = []
        for prompt, new_tokens in measured:
            tasks.append(asyncio.create_task(_one(router, prompt, new_tokens)))
            await asyncio.sleep(rng.expovariate(args.rate))
        summaries = [s for s in await asyncio.gather(*tasks) if s is not None]
    scheduler = KvrsClient(state.address("scheduler-1"))
    try:
        corrections = await scheduler.get_corrections(timeout_s=5.0)
    finally:
        await scheduler.close()

    placed = [
        (s.placement_predicted_s, s.placement_measured_s)
        for s in summaries
        if s.placement_measured_s > 0.0
    ]
    errors = [abs(m - p) / m for p, m in placed]
    ratios = [m / p for p, m in placed if p > 0.0]
    print(
        f"\n{len(placed)} placements of {len(measured)} requests at {args.rate:g}/s "
        f"(after {len(warmup)} warm-up requests): predicted vs measured time from "
        "SelectDecode's answer to the first decoded token"
    )
    figures: dict = {"requests": len(measured), "placements": len(placed), "rate": args.rate}
    if not placed:
        print("no placement measured")
        return figures
    p50, p90 = statistics.median(errors), percentile(errors, 0.9)
    predicted_ms = statistics.median(p for p, _ in placed) * 1e3
    measured_ms = statistics.median(m for _, m in placed) * 1e3
    print(f"  median predicted {predicted_ms:.2f} ms, measured {measured_ms:.2f} ms")
    print(f"  measured / predicted: median {statistics.median(ratios):.2f}")
    print(
        f"placement prediction error p50 {p50 * 100:.0f} %, p90 {p90 * 100:.0f} % "
        f"(goal p90 <= 20 %): {'met' if p90 <= 0.2 else 'not met'}"
    )
    terms = sorted(
        (e.term, e.p50, e.p90, e.samples) for e in corrections.errors if e.kind == "placement"
    )
    if terms:
        print("\nthe scheduler's error per term over its newest placement outcomes:")
        print(f"  {'term':<16}{'p50 %':>8}{'p90 %':>8}{'samples':>9}")
        for term, t50, t90, samples in terms:
            print(f"  {term:<16}{t50 * 100:>8.0f}{t90 * 100:>8.0f}{samples:>9}")
    figures.update(
        error_p50=p50,
        error_p90=p90,
        predicted_median_s=predicted_ms / 1e3,
        measured_median_s=measured_ms / 1e3,
        ratio_median=statistics.median(ratios),
        terms={term: {"p50": t50, "p90": t90, "samples": n} for term, t50, t90, n in terms},
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.placement_error", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    figures = on_bench_cluster(lambda state: bench(state, args), calibrated=True)
    write_json(args.json, "placement_error", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
