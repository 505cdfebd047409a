"""libkvxfer throughput against a raw gloo send of the same bytes between the same processes.

    python -m bench.kvxfer [--tokens 2048] [--dtype bfloat16] [--repeats 15]

Two spawned processes: the receiver hosts the agent's store; the sender pushes an
opt-125m-shaped KV (12 layers × 12 heads × 64, ≥ 64 MiB by default) through libkvxfer
(per-layer chunks, metadata, checksums), and the same number of bytes as one
flat tensor through a plain two-rank ProcessGroupGloo. libkvxfer runs twice, with and
without per-chunk checksums (xxh3-64). Runs of the three are interleaved (load on a
shared machine drifts); each figure is the median of `--repeats` runs after one warm-up,
and the ratio is libkvxfer / raw.

On loopback the "wire" is memcpy on the CPU, so every pass over the bytes competes with
the transfer for the same cores: xxh3 reads tens of GB/s per core, a small fraction of
that (crc32, protocol version 1, read about 4 GB/s and halved the throughput).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import time

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from bench.report import add_json_argument, write_json
from libkvxfer import AgentConfig, KvLayout, TransferAgent, TransferTicket

LAYERS, HEADS, HEAD_DIM = 12, 12, 64
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _kv(tokens: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shape = (tokens, HEADS, HEAD_DIM)
    return [
        (
            torch.randn(shape, generator=generator).to(dtype),
            torch.randn(shape, generator=generator).to(dtype),
        )
        for _ in range(LAYERS)
    ]


def _raw_group(store: TCPStore, rank: int) -> ProcessGroupGloo:
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=60)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(PrefixStore("bench/raw", store), rank, 2, options)


def _sender(args: argparse.Namespace, inbox, outbox) -> None:
    torch.set_num_threads(1)
    agents = {
        mode: TransferAgent(
            AgentConfig(
                f"bench-sender-{mode}",
                chunk_tokens=args.chunk_tokens,
                window_chunks=args.window,
                checksums=mode == "checked",
            )
        )
        for mode in ("checked", "unchecked")
    }
    kv = _kv(args.tokens, DTYPES[args.dtype])
    host, port = inbox.get()
    group = _raw_group(TCPStore(host, port, is_master=False), 1)
    # The KV's own bytes, laid end to end: a never-written tensor would read the kernel's
    # shared zero page, one cache-hot 4 KiB page, and flatter the baseline several-fold.
    flat = torch.cat([tensor.reshape(-1).view(torch.uint8) for pair in kv for tensor in pair])
    while (command := inbox.get()) is not None:
        mode, ticket = command
        if mode == "raw":
            group.send([flat], 0, 1).wait()
        else:
            agents[mode].send(TransferTicket.from_dict(ticket), kv)
    for agent in agents.values():
        agent.close()
    outbox.put("done")


def run(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of each mode, runs interleaved so that load drift hits all alike."""
    torch.set_num_threads(1)
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    process = context.Process(target=_sender, args=(args, inbox, outbox), daemon=True)
    process.start()
    agent = TransferAgent(AgentConfig("bench-receiver", window_chunks=args.window))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    inbox.put(("127.0.0.1", store.port))
    group = _raw_group(store, 0)
    dtype = DTYPES[args.dtype]
    layout = KvLayout(LAYERS, HEADS, HEAD_DIM, dtype)
    kv_bytes = args.tokens * layout.bytes_per_token
    shape = (args.tokens, HEADS, HEAD_DIM)
    out = [
        (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in range(LAYERS)
    ]
    flat = torch.zeros(kv_bytes, dtype=torch.uint8)
    seconds: dict[str, list[float]] = {"checked": [], "unchecked": [], "raw": []}
    for repeat in range(args.repeats + 1):
        for mode, series in seconds.items():
            start = time.perf_counter()
            if mode == "raw":
                inbox.put((mode, None))
                group.recv([flat], 1, 1).wait()
            else:
                ticket = agent.prepare(f"bench-sender-{mode}", "bench", 0, args.tokens)
                inbox.put((mode, ticket.to_dict()))
                agent.recv(ticket, layout, out)
            if repeat:
                series.append(time.perf_counter() - start)
    inbox.put(None)
    outbox.get(timeout=60)
    process.join(timeout=10)
    agent.close()
    result = {
        f"{mode}_bps": 8 * kv_bytes / statistics.median(series) for mode, series in seconds.items()
    }
    result["kv_bytes"] = kv_bytes
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens",
        type=int,
        default=2048,
        help="KV tokens moved (2048 bf16 tokens of opt-125m = 72 MiB)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="tokens per chunk within a layer (0: one chunk per layer)",
    )
    parser.add_argument("--window", type=int, default=64, help="chunks posted ahead")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    result = run(args)
    print(
        f"KV moved:   {result['kv_bytes'] / 2**20:.1f} MiB "
        f"({args.tokens} tokens, {LAYERS}x{HEADS}x{HEAD_DIM} {args.dtype})"
    )
    raw_bps = result["raw_bps"]
    print(f"raw gloo flat send:          {raw_bps / 1e9:6.2f} Gbit/s")
    figures = {**result, "tokens": args.tokens, "dtype": args.dtype, "repeats": args.repeats}
    for mode, label in (("checked", "with xxh3 checksums"), ("unchecked", "without checksums")):
        bps = result[f"{mode}_bps"]
        figures[f"{mode}_ratio"] = bps / raw_bps
        print(
            f"libkvxfer {label:21s} {bps / 1e9:6.2f} Gbit/s  ratio {bps / raw_bps:.2f}x "
            "(goal >= 0.85x)"
        )
    write_json(args.json, "kvxfer", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
