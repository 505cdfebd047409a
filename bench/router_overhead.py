"""What the router costs: TTFT and time between tokens through it versus the same workers
driven directly, in one run.

    python -m bench.router_overhead [--rounds 20] [--tokens 200] [--prompt-tokens 256]

Starts a local cluster (`kvrs up`'s launcher: gossip, slot broker, one scheduler, two
prefill and two decode workers on the tiny model, the router). Each round streams the
same prompt twice, alternating which goes first: once through `RouterService.Generate`
pinned to prefill-0 / decode-0, once by calling those workers directly as the router
would (Prefill, PullKv, Decode). A bare SelectDecode is timed in every round too: the
router's only extra call before the first decoded token.

Reported (medians over rounds, with p90): TTFT (token 0, from prefill), the first decoded
token (token 1: + placement + KV pull + one step), and the mean time between tokens of
each decode stream; overhead = router - direct. Goals: TBT overhead < 0.5 ms; TTFT overhead
no more than one scheduler RPC.

Then what the joint prefill choice costs: the same prompt through the router, unpinned,
under netkv (SelectDecode overlaps the prefill) and under kvrs (SelectDecode first, with
every prefill instance as an option), alternating; TTFT medians side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from bench.report import add_json_argument, write_json
from kvrs.cli.cluster import calibrate_into
from kvrs.cli.launcher import SERVICES, ClusterOptions, ClusterState, start_cluster, stop_cluster
from kvrs.client import KvrsClient
from kvrs.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

BENCH_SERVICES = (
    "gossip",
    "slot-broker",
    "scheduler-1",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
    "router",
)


def on_bench_cluster(
    run: Callable[[ClusterState], Awaitable[dict]], calibrated: bool = False
) -> dict:
    """Starts the bench cluster (BENCH_SERVICES on the tiny model, in a temporary
    directory), runs `run` on it and stops it; `run`'s figures. `calibrated`: the services
    price compute with a profile measured on this machine first (as `kvrs demo` does),
    not the model's preset."""
    run_dir = Path(tempfile.mkdtemp(prefix="kvrs-bench-")) / "cluster"
    services = [spec for spec in SERVICES if spec.name in BENCH_SERVICES]
    profile_file = calibrate_into(run_dir, "tiny") if calibrated else None
    options = ClusterOptions(run_dir=run_dir, workers_model="tiny", profile_file=profile_file)
    state = start_cluster(options, services)
    try:
        return asyncio.run(run(state))
    finally:
        stop_cluster(run_dir, grace_s=5.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def via_router(
    stub, prompt: list[int], tokens: int, policy: str = ""
) -> tuple[float, float, list[float]]:
    """Through the router: pinned to prefill-0 / decode-0, or under `policy` unpinned."""
    pins = {} if policy else {"prefill_instance_id": "prefill-0", "decode_instance_id": "decode-0"}
    request = router_pb2.GenerateRequest(
        request_id=f"bench-{uuid.uuid4().hex[:10]}",
        prompt_token_ids=prompt,
        max_new_tokens=tokens,
        placement_policy=policy,
        **pins,
    )
    started = time.perf_counter()
    arrivals = []
    async for _ in stub.Generate(request, timeout=60):
        arrivals.append(time.perf_counter())
    return arrivals[0] - started, arrivals[1] - started, _gaps(arrivals[1:])


async def direct(
    prefill,
    decode,
    prefill_addr: str,
    prompt: list[int],
    tokens: int,
    prefill_id: str = "prefill-0",
) -> tuple[float, float, list[float]]:
    """Prefill on `prefill` (instance `prefill_id` at `prefill_addr`), PullKv and Decode on
    `decode`, as the router would: (TTFT, token 1, mean time between tokens)."""
    request_id = f"bench-{uuid.uuid4().hex[:10]}"
    started = time.perf_counter()
    first = await prefill.Prefill(
        worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt), timeout=30
    )
    ttft = time.perf_counter() - started
    await decode.PullKv(
        worker_pb2.PullKvRequest(
            request_id=request_id,
            source_instance_id=prefill_id,
            source_address=prefill_addr,
            token_start=0,
            token_end=len(prompt),
            prompt_tokens=len(prompt),
        ),
        timeout=30,
    )
    arrivals = []
    async for _ in decode.Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id,
            generated_token_ids=[first.first_token_id],
            max_new_tokens=tokens - 1,
            release_when_done=True,
        ),
        timeout=60,
    ):
        arrivals.append(time.perf_counter())
    await prefill.ReleaseKv(worker_pb2.ReleaseKvRequest(request_id=request_id), timeout=5)
    return ttft, arrivals[0] - started, _gaps(arrivals)


def _gaps(arrivals: list[float]) -> list[float]:
    """The stream's mean time between tokens (messages may arrive coalesced, so single
    gaps say little)."""
    return [(arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)]


async def bench(state, rounds: int, tokens: int, prompt_tokens: int) -> dict:
    """Runs the rounds, prints the table; returns every printed figure (seconds)."""
    prompt = [(7 * i + 3) % 251 for i in range(prompt_tokens)]
    prefill_addr = state.address("prefill-0")
    async with (
        grpc.aio.insecure_channel(state.address("router")) as router_channel,
        grpc.aio.insecure_channel(prefill_addr) as prefill_channel,
        grpc.aio.insecure_channel(state.address("decode-0")) as decode_channel,
    ):
        router = router_pb2_grpc.RouterServiceStub(router_channel)
        prefill = worker_pb2_grpc.WorkerServiceStub(prefill_channel)
        decode = worker_pb2_grpc.WorkerServiceStub(decode_channel)
        scheduler = KvrsClient(state.address("scheduler-1"))
        results: dict[str, dict[str, list[float]]] = {
            path: {"ttft": [], "first_decoded": [], "tbt": []} for path in ("router", "direct")
        }
        select_s: list[float] = []
        for round_index in range(rounds + 1):
            order = ("router", "direct") if round_index % 2 else ("direct", "router")
            for path in order:
                if path == "router":
                    ttft, t1, gaps = await via_router(router, prompt, tokens)
                else:
                    ttft, t1, gaps = await direct(prefill, decode, prefill_addr, prompt, tokens)
                if round_index == 0:
                    continue  # warm-up: channels, pair groups, caches
                results[path]["ttft"].append(ttft)
                results[path]["first_decoded"].append(t1)
                results[path]["tbt"].extend(gaps)
            started = time.perf_counter()
            await scheduler.select_decode("prefill-0", prompt_tokens, request_id=uuid.uuid4().hex)
            if round_index:
                select_s.append(time.perf_counter() - started)
        await scheduler.close()
        joint_ttft: dict[str, list[float]] = {"netkv": [], "kvrs": []}
        for round_index in range(rounds + 1):
            order = ("netkv", "kvrs") if round_index % 2 else ("kvrs", "netkv")
            for policy in order:
                ttft, _, _ = await via_router(router, prompt, 4, policy)
                if round_index:
                    joint_ttft[policy].append(ttft)
    print(
        f"\n{rounds} rounds, prompt {prompt_tokens} tokens, {tokens} tokens each "
        "(medians; p90 in brackets), milliseconds"
    )
    print(f"  {'':<22}{'direct':>16}{'router':>16}{'overhead':>12}")
    figures: dict = {"rounds": rounds, "tokens": tokens, "prompt_tokens": prompt_tokens}
    for metric, label in (
        ("ttft", "TTFT (token 0)"),
        ("first_decoded", "token 1"),
        ("tbt", "time between tokens"),
    ):
        d, r = results["direct"][metric], results["router"][metric]
        dm, rm = statistics.median(d) * 1e3, statistics.median(r) * 1e3
        figures[metric] = {
            "direct_median_s": dm / 1e3,
            "direct_p90_s": percentile(d, 0.9),
            "router_median_s": rm / 1e3,
            "router_p90_s": percentile(r, 0.9),
            "overhead_s": (rm - dm) / 1e3,
        }
        print(
            f"  {label:<22}{dm:>8.3f} [{percentile(d, 0.9) * 1e3:>6.2f}]"
            f"{rm:>8.3f} [{percentile(r, 0.9) * 1e3:>6.2f}]{rm - dm:>+12.3f}"
        )
    select_ms = statistics.median(select_s) * 1e3
    ttft_over = (
        statistics.median(results["router"]["ttft"]) - statistics.median(results["direct"]["ttft"])
    ) * 1e3
    tbt_over = (
        statistics.median(results["router"]["tbt"]) - statistics.median(results["direct"]["tbt"])
    ) * 1e3
    print(f"  {'SelectDecode RPC':<22}{select_ms:>8.3f}")
    print(
        f"\nTBT overhead {tbt_over:+.3f} ms (goal < 0.5 ms): "
        f"{'met' if tbt_over < 0.5 else 'missed'}"
    )
    print(
        f"TTFT overhead {ttft_over:+.3f} ms vs one SelectDecode RPC {select_ms:.3f} ms: "
        f"ratio {ttft_over / select_ms:.2f} (goal <= 1)"
    )
    decode_only, joint = (statistics.median(joint_ttft[p]) * 1e3 for p in ("netkv", "kvrs"))
    print(
        f"joint prefill choice, unpinned: TTFT netkv {decode_only:.3f} ms, kvrs {joint:.3f} ms "
        f"({joint - decode_only:+.3f} ms; one SelectDecode RPC {select_ms:.3f} ms)"
    )
    figures["joint_prefill_ttft_s"] = {
        "netkv_median_s": decode_only / 1e3,
        "kvrs_median_s": joint / 1e3,
        "difference_s": (joint - decode_only) / 1e3,
    }
    figures.update(
        select_decode_median_s=select_ms / 1e3,
        tbt_overhead_s=tbt_over / 1e3,
        ttft_overhead_s=ttft_over / 1e3,
        ttft_overhead_ratio=ttft_over / select_ms,
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    figures = on_bench_cluster(
        lambda state: bench(state, args.rounds, args.tokens, args.prompt_tokens)
    )
    write_json(args.json, "router_overhead", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
