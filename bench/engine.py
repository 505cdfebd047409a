"""Batched execution of a worker: prefill and decode throughput, batched against one at a time.

    python -m bench.engine [--model tiny] [--prompts 8] [--prompt-tokens 128]
                           [--streams 16] [--decode-tokens 32] [--repeats 3] [--json FILE]

Two levels, side by side in one run (rounds interleaved, medians, since load on a shared
machine drifts):

- the forward pass (`Transformer.forward_batch`): `--prompts` prompts prefilled in one
  pass against one pass each, and decode steps of one sequence against `--streams`
  sequences in one pass;
- a real worker (gRPC server, compute loop, KV store) in this process: the same prompts
  as sequential Prefill RPCs against concurrent ones (which the compute loop batches),
  and one Decode stream against `--streams` concurrent ones (continuous batching), with
  the mean number of sequences the worker's passes held.

TTFT of a prefix-hit prompt against a cold one is `python -m bench.prefix_reuse`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import torch

from bench.report import add_json_argument, write_json
from kvrs.v1 import worker_pb2 as pb
from kvrs.v1 import worker_pb2_grpc
from services.common import GrpcSettings, open_channel, setup_tracing
from services.worker.compute import BatchCounts
from services.worker.config import Config
from services.worker.model import Transformer
from services.worker.paged_kv import KvCache
from services.worker.server import build_server


def _prompts(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    return [[(seed * 7919 + 131 * p + 17 * i) % vocab for i in range(tokens)] for p in range(count)]


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _forward_round(model: Transformer, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Seconds of each forward-pass measurement, one round."""
    vocab = min(256, model.config.vocab_size)
    prompts = _prompts(args.prompts, args.prompt_tokens, vocab, seed)
    alone = sum(_timed(lambda p=p: model.forward_batch([(model.new_cache(), p)])) for p in prompts)
    together = _timed(lambda: model.forward_batch([(model.new_cache(), p) for p in prompts]))

    def decode_s(sequences: int) -> float:
        caches: list[KvCache] = []
        for prompt in _prompts(sequences, args.prompt_tokens, vocab, seed + 1):
            cache, _ = model.prefill(prompt)
            caches.append(cache)
        work = [(cache, [1]) for cache in caches]
        return sum(_timed(lambda: model.forward_batch(work)) for _ in range(args.decode_tokens))

    return {
        "prefill_alone_s": alone,
        "prefill_batched_s": together,
        "decode_1_s": decode_s(1),
        "decode_n_s": decode_s(args.streams),
    }


async def _worker_round(
    stub, counts: BatchCounts, args: argparse.Namespace, vocab: int, seed: int
) -> dict[str, float]:
    """Seconds of each worker measurement, one round (KV released after each), and the
    mean sequences per pass while the streams decoded together."""
    prompts = _prompts(args.prompts, args.prompt_tokens, vocab, seed)

    async def prefill(request_id: str, prompt: list[int]) -> None:
        await stub.Prefill(pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt))

    async def release(request_ids: list[str]) -> None:
        for request_id in request_ids:
            await stub.ReleaseKv(pb.ReleaseKvRequest(request_id=request_id))

    ids = [f"seq-{seed}-{i}" for i in range(len(prompts))]
    started = time.perf_counter()
    for request_id, prompt in zip(ids, prompts, strict=True):
        await prefill(request_id, prompt)
    sequential = time.perf_counter() - started
    await release(ids)
    ids = [f"con-{seed}-{i}" for i in range(len(prompts))]
    started = time.perf_counter()
    await asyncio.gather(*(prefill(r, p) for r, p in zip(ids, prompts, strict=True)))
    concurrent = time.perf_counter() - started
    await release(ids)

    async def decode(streams: int) -> float:
        ids = [f"dec-{seed}-{streams}-{i}" for i in range(streams)]
        for request_id, prompt in zip(
            ids, _prompts(streams, args.prompt_tokens, vocab, seed + 1), strict=True
        ):
            await prefill(request_id, prompt)

        async def stream(request_id: str) -> None:
            request = pb.DecodeRequest(request_id=request_id, max_new_tokens=args.decode_tokens)
            async for _ in stub.Decode(request):
                pass

        started = time.perf_counter()
        await asyncio.gather(*(stream(request_id) for request_id in ids))
        elapsed = time.perf_counter() - started
        await release(ids)
        return elapsed

    decode_1 = await decode(1)
    passes, sequences = counts.passes, counts.sequences
    decode_n = await decode(args.streams)
    return {
        "prefill_sequential_s": sequential,
        "prefill_concurrent_s": concurrent,
        "decode_1_s": decode_1,
        "decode_n_s": decode_n,
        # Prefills of the streams' prompts included: they pass alone, one Prefill at a time.
        "sequences_per_pass": (counts.sequences - sequences) / (counts.passes - passes),
    }


async def _run(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    model = Transformer.load(args.model)
    handle = await build_server(
        Config(
            instance_id="bench-engine",
            role="decode",
            listen_addr="127.0.0.1:0",
            transfer_host="127.0.0.1",
            model=args.model,
            canary_interval_s=600.0,
        ),
        setup_tracing("bench-engine"),
    )
    channel = open_channel(f"127.0.0.1:{handle.port}", GrpcSettings())
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    vocab = min(256, model.config.vocab_size)
    forward: dict[str, list[float]] = {}
    worker: dict[str, list[float]] = {}
    try:
        counts = handle.engine.compute.counts
        _forward_round(model, args, 0)  # warm-up
        await _worker_round(stub, counts, args, vocab, 0)
        for round_ in range(1, args.repeats + 1):
            for key, seconds in _forward_round(model, args, round_).items():
                forward.setdefault(key, []).append(seconds)
            measured = await _worker_round(stub, counts, args, vocab, round_)
            for key, seconds in measured.items():
                worker.setdefault(key, []).append(seconds)
    finally:
        await channel.close()
        await handle.stop(0)
    f = {key: statistics.median(values) for key, values in forward.items()}
    w = {key: statistics.median(values) for key, values in worker.items()}
    prefill_tokens = args.prompts * args.prompt_tokens
    n = args.streams
    figures = {
        "forward_prefill_alone_tokens_per_s": prefill_tokens / f["prefill_alone_s"],
        "forward_prefill_batched_tokens_per_s": prefill_tokens / f["prefill_batched_s"],
        "forward_decode_batch_1_tokens_per_s": args.decode_tokens / f["decode_1_s"],
        f"forward_decode_batch_{n}_tokens_per_s": n * args.decode_tokens / f["decode_n_s"],
        "worker_prefill_sequential_tokens_per_s": prefill_tokens / w["prefill_sequential_s"],
        "worker_prefill_concurrent_tokens_per_s": prefill_tokens / w["prefill_concurrent_s"],
        "worker_decode_1_stream_tokens_per_s": args.decode_tokens / w["decode_1_s"],
        f"worker_decode_{n}_streams_tokens_per_s": n * args.decode_tokens / w["decode_n_s"],
        f"worker_sequences_per_pass_{n}_streams": w["sequences_per_pass"],
    }
    figures["forward_prefill_ratio"] = f["prefill_alone_s"] / f["prefill_batched_s"]
    figures["forward_decode_ratio"] = n * f["decode_1_s"] / f["decode_n_s"]
    figures["worker_prefill_ratio"] = w["prefill_sequential_s"] / w["prefill_concurrent_s"]
    figures["worker_decode_ratio"] = n * w["decode_1_s"] / w["decode_n_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__)
    parser.add_argument("--model", default="tiny", help="checkpoint directory or tiny")
    parser.add_argument("--prompts", type=int, default=8, help="prompts prefilled together")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16, help="decode streams batched")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens per stream")
    parser.add_argument("--repeats", type=int, default=3)
    add_json_argument(parser)
    args = parser.parse_args()
    for name in ("prompts", "prompt_tokens", "streams", "decode_tokens", "repeats"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    figures = asyncio.run(_run(args))
    n, p, t = args.streams, args.prompts, args.prompt_tokens
    print(f"{args.model}, {p} prompts of {t} tokens, decode {args.decode_tokens} tokens a stream")
    print(
        f"forward pass: prefill {figures['forward_prefill_alone_tokens_per_s']:.0f} tok/s "
        f"one at a time, {figures['forward_prefill_batched_tokens_per_s']:.0f} tok/s "
        f"{p} in one pass ({figures['forward_prefill_ratio']:.2f}x); decode "
        f"{figures['forward_decode_batch_1_tokens_per_s']:.0f} tok/s at batch 1, "
        f"{figures[f'forward_decode_batch_{n}_tokens_per_s']:.0f} tok/s at batch {n} "
        f"({figures['forward_decode_ratio']:.2f}x)"
    )
    print(
        f"worker: prefill {figures['worker_prefill_sequential_tokens_per_s']:.0f} tok/s "
        f"sequential, {figures['worker_prefill_concurrent_tokens_per_s']:.0f} tok/s "
        f"{p} concurrent ({figures['worker_prefill_ratio']:.2f}x); decode "
        f"{figures['worker_decode_1_stream_tokens_per_s']:.0f} tok/s with 1 stream, "
        f"{figures[f'worker_decode_{n}_streams_tokens_per_s']:.0f} tok/s with {n} "
        f"({figures['worker_decode_ratio']:.2f}x); "
        f"{figures[f'worker_sequences_per_pass_{n}_streams']:.1f} sequences per pass"
    )
    print("prefix-hit TTFT against cold: python -m bench.prefix_reuse")
    write_json(args.json, "engine", figures)


if __name__ == "__main__":
    main()
