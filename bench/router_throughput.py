"""How many tokens one router relays: concurrent streams through it versus the same streams
driven directly on the workers, in one run.

    python -m bench.router_throughput [--streams 1 4 16] [--tokens 1500] [--rounds 2]

Starts a local cluster (`kvrs up`'s launcher: gossip, slot broker, one scheduler, two
prefill and two decode workers on the tiny model, the router). For each stream count N,
N streams run at once, stream i pinned to prefill-(i % 2) and decode-(i % 2), once
through `RouterService.Generate` and once by calling those workers directly as the
router would (Prefill, PullKv, Decode), alternating which goes first. Reported per N:
tokens per second delivered each way and their ratio, and the CPU seconds per token of
the router and of the two decode workers (from /proc), so it shows whether the router or
the workers bound what the cluster delivers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc

from bench.report import add_json_argument, write_json
from bench.router_overhead import direct, on_bench_cluster
from kvrs.v1 import router_pb2, router_pb2_grpc, worker_pb2_grpc

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
WATCHED = ("router", "decode-0", "decode-1")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


async def through_router(stub, prompt: list[int], tokens: int, pair: int) -> int:
    request = router_pb2.GenerateRequest(
        request_id=f"bench-{uuid.uuid4().hex[:10]}",
        prompt_token_ids=prompt,
        max_new_tokens=tokens,
        prefill_instance_id=f"prefill-{pair}",
        decode_instance_id=f"decode-{pair}",
    )
    return sum([1 async for message in stub.Generate(request, timeout=300) if message.index >= 0])


async def phase(
    streams: int, run: Callable[[int], Awaitable[int]], pids: dict[str, int]
) -> dict[str, float]:
    """`streams` of `run(i)` at once: tokens/s delivered, CPU seconds per token."""
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    delivered = sum(await asyncio.gather(*(run(i) for i in range(streams))))
    elapsed_s = time.perf_counter() - started
    figures = {"tokens": delivered, "elapsed_s": elapsed_s, "tokens_per_s": delivered / elapsed_s}
    for name, pid in pids.items():
        figures[f"{name}_cpu_s_per_token"] = (cpu_s(pid) - before[name]) / delivered
    return figures


async def bench(state, stream_counts: list[int], tokens: int, rounds: int) -> dict:
    pids = {p.name: p.pid for p in state.processes if p.name in WATCHED}
    prompts = [[(7 * i + 3 * s) % 251 for i in range(64)] for s in range(max(stream_counts))]
    names = [f"{role}-{i}" for role in ("prefill", "decode") for i in (0, 1)]
    channels = {name: grpc.aio.insecure_channel(state.address(name)) for name in names}
    router_channel = grpc.aio.insecure_channel(state.address("router"))
    try:
        router = router_pb2_grpc.RouterServiceStub(router_channel)
        stubs = {name: worker_pb2_grpc.WorkerServiceStub(ch) for name, ch in channels.items()}

        async def via_router(i: int) -> int:
            return await through_router(router, prompts[i], tokens, i % 2)

        async def on_workers(i: int) -> int:
            prefill_id = f"prefill-{i % 2}"
            await direct(
                stubs[prefill_id],
                stubs[f"decode-{i % 2}"],
                state.address(prefill_id),
                prompts[i],
                tokens,
                prefill_id,
            )
            return tokens

        await phase(2, via_router, pids)  # warm-up: channels, pair groups
        await phase(2, on_workers, pids)
        results: dict = {}
        for streams in stream_counts:
            runs: dict[str, list[dict[str, float]]] = {"router": [], "direct": []}
            for round_index in range(rounds):
                order = ("router", "direct") if round_index % 2 == 0 else ("direct", "router")
                for path in order:
                    run = via_router if path == "router" else on_workers
                    runs[path].append(await phase(streams, run, pids))
            results[streams] = {
                path: {key: sum(r[key] for r in rs) / len(rs) for key in rs[0]}
                for path, rs in runs.items()
            }
    finally:
        await router_channel.close()
        for channel in channels.values():
            await channel.close()
    print(f"\n{tokens} tokens a stream, mean of {rounds} rounds; CPU in µs per token delivered")
    print(
        f"  {'streams':>7}{'direct tok/s':>14}{'router tok/s':>14}{'ratio':>8}"
        f"{'router CPU':>12}{'decode CPU (router / direct)':>30}"
    )
    figures: dict = {"tokens": tokens, "rounds": rounds, "by_streams": {}}
    for streams, paths in results.items():
        r, d = paths["router"], paths["direct"]
        ratio = r["tokens_per_s"] / d["tokens_per_s"]
        decode_r = (r["decode-0_cpu_s_per_token"] + r["decode-1_cpu_s_per_token"]) * 1e6
        decode_d = (d["decode-0_cpu_s_per_token"] + d["decode-1_cpu_s_per_token"]) * 1e6
        print(
            f"  {streams:>7}{d['tokens_per_s']:>14.0f}{r['tokens_per_s']:>14.0f}"
            f"{ratio:>7.2f}x{r['router_cpu_s_per_token'] * 1e6:>12.0f}"
            f"{decode_r:>15.0f} / {decode_d:<12.0f}"
        )
        figures["by_streams"][str(streams)] = {
            "router": r,
            "direct": d,
            "ratio": ratio,
        }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router_throughput", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=2)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if min(args.streams) < 1 or args.tokens < 2 or args.rounds < 1:
        parser.error("--streams must be >= 1, --tokens >= 2 and --rounds >= 1")
    figures = on_bench_cluster(lambda state: bench(state, args.streams, args.tokens, args.rounds))
    write_json(args.json, "router_throughput", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
