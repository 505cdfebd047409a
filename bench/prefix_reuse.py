"""Time to first token of a prompt whose prefix blocks a worker holds, against a cold one.

    python -m bench.prefix_reuse [--model tiny] [--prefix-tokens 1024] [--suffix-tokens 64]

One real worker (gRPC server, KV store, compute thread) in this process. A cold request
has a prefix no earlier request shared; a hit request repeats a resident prefix with a
new suffix, so its prefill shares the prefix's KV blocks and computes only the suffix.
The time is the Prefill RPC's (the first generated token is its answer). Cold and hit
runs are interleaved (load on a shared machine drifts); each figure is a median.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.report import add_json_argument, write_json
from kvrs.v1 import worker_pb2 as pb
from kvrs.v1 import worker_pb2_grpc
from services.common import GrpcSettings, open_channel, setup_tracing
from services.worker.config import Config
from services.worker.server import build_server


async def _run(args: argparse.Namespace) -> dict[str, float]:
    config = Config(
        instance_id="bench-prefill",
        role="prefill",
        listen_addr="127.0.0.1:0",
        transfer_host="127.0.0.1",
        model=args.model,
        canary_interval_s=600.0,
    )
    handle = await build_server(config, setup_tracing("bench-prefix-reuse"))
    channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    vocab = min(256, handle.engine.model.config.vocab_size)

    def prompt(prefix_seed: int, suffix_seed: int) -> list[int]:
        prefix = [(prefix_seed * 131 + 7 * i) % vocab for i in range(args.prefix_tokens)]
        return prefix + [(suffix_seed * 17 + 3 * i) % vocab for i in range(args.suffix_tokens)]

    async def prefill(request_id: str, tokens: list[int]) -> tuple[float, int]:
        started = time.perf_counter()
        reply = await stub.Prefill(
            pb.PrefillRequest(request_id=request_id, prompt_token_ids=tokens)
        )
        elapsed = time.perf_counter() - started
        await stub.ReleaseKv(pb.ReleaseKvRequest(request_id=request_id))
        return elapsed, reply.prefix_hit_tokens

    try:
        await prefill("warm", prompt(0, 0))
        cold, hit = [], []
        for i in range(1, args.repeats + 1):
            seconds, reused = await prefill(f"cold-{i}", prompt(1000 + i, i))
            assert reused == 0
            cold.append(seconds)
            seconds, reused = await prefill(f"hit-{i}", prompt(0, i))
            block = handle.engine.store.block_tokens
            assert reused == args.prefix_tokens // block * block, reused
            hit.append(seconds)
    finally:
        await channel.close()
        await handle.stop(0)
    return {
        "cold_ttft_ms": 1e3 * statistics.median(cold),
        "prefix_hit_ttft_ms": 1e3 * statistics.median(hit),
        "ratio": statistics.median(cold) / statistics.median(hit),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_reuse", description=__doc__)
    parser.add_argument("--model", default="tiny", help="checkpoint directory or tiny")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    add_json_argument(parser)
    args = parser.parse_args()
    figures = asyncio.run(_run(args))
    print(
        f"{args.model}, {args.prefix_tokens}-token prefix + {args.suffix_tokens}-token suffix: "
        f"cold TTFT {figures['cold_ttft_ms']:.1f} ms, "
        f"prefix hit {figures['prefix_hit_ttft_ms']:.1f} ms ({figures['ratio']:.1f}x)"
    )
    write_json(args.json, "prefix_reuse", figures)


if __name__ == "__main__":
    main()
