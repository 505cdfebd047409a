"""What serving views costs a gossip replica: each view reading Redis, or one shared read.

`python -m bench.change_feed --instances 4096 --views 5` registers the instances in the
local Redis (`REDIS_URL`, a private key prefix removed at the end), then runs rounds:
a twentieth of the instances change their load (what 0.1 s of beats every 2 s brings),
then every view asks `ListChanges` from its own cursor and the reply is serialized, as
the servicer would. It reports the replica's CPU per round answered straight from the
store (every view reads and encodes every change itself, as before) and from the
`ChangeFeed` (one read per poll, shared), side by side, twice each, alternating.

Not a test: the figures are CPU time of this process (the gossip side); Redis's own
time is not counted (the shared read also saves it the per-view script calls).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as redis_async

from kvrs.v1 import gossip_pb2
from services.common.gossip_records import NodeLoad, Registration
from services.gossip import convert
from services.gossip.change_feed import ChangeFeed
from services.gossip.store import GossipStore

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/9")
CONCURRENT_WRITES = 50
"""Registrations and beats in flight at once (within the client's connection pool)."""

Answer = Callable[[str], Awaitable[gossip_pb2.ListChangesResponse]]


async def _in_batches(calls: list[Callable[[], Awaitable[object]]]) -> None:
    for start in range(0, len(calls), CONCURRENT_WRITES):
        await asyncio.gather(*(call() for call in calls[start : start + CONCURRENT_WRITES]))


def _registration(index: int) -> Registration:
    return Registration(
        instance_id=f"decode-{index:05d}",
        role="decode",
        address=f"10.0.{index // 256}.{index % 256}:50061",
        kv_capacity_blocks=1000,
        heartbeat_ttl_s=600.0,
    )


async def _rounds(
    store: GossipStore, answer: Answer, args, first_change: int
) -> tuple[float, float]:
    """CPU seconds per round and instances per reply, over `args.rounds` rounds."""
    changed = max(1, args.instances // 20)
    cursors = [(await store.list_changes("")).change_id] * args.views
    cpu_s = 0.0
    listed = 0
    for round_index in range(args.rounds):
        first = first_change + round_index * changed
        await _in_batches(
            [
                lambda i=i, depth=first + 1: store.heartbeat(
                    _registration(i % args.instances).instance_id, NodeLoad(queue_depth=depth)
                )
                for i in range(first, first + changed)
            ]
        )
        started = time.process_time()
        replies = await asyncio.gather(*(answer(cursor) for cursor in cursors))
        for reply in replies:
            reply.SerializeToString()
        cpu_s += time.process_time() - started
        cursors = [reply.change_id for reply in replies]
        listed += sum(len(reply.nodes) for reply in replies)
    return cpu_s / args.rounds, listed / args.rounds / args.views


async def _measure(args) -> None:
    client = redis_async.from_url(REDIS_URL)
    prefix = f"{{bench-feed-{uuid.uuid4().hex[:8]}}}:"
    try:
        store = GossipStore(client, prefix, default_ttl_s=600.0)
        await _in_batches(
            [lambda i=i: store.register(_registration(i)) for i in range(args.instances)]
        )

        async def from_store(cursor: str) -> gossip_pb2.ListChangesResponse:
            return convert.changes_to_pb(await store.list_changes(cursor))

        async def from_feed(cursor: str) -> gossip_pb2.ListChangesResponse:
            reply = await feed.answer(cursor)
            assert reply is not None, "a cursor from the feed's own replies"
            return reply

        totals = {"store": 0.0, "feed": 0.0}
        changes = 0
        for repeat in range(2):
            for name, answer in (("store", from_store), ("feed", from_feed)):
                feed = ChangeFeed(store)
                cpu_s, per_reply = await _rounds(store, answer, args, changes)
                changes += args.rounds * max(1, args.instances // 20)
                totals[name] += cpu_s
                print(
                    f"{name:5s} (run {repeat + 1}): {cpu_s * 1e3:6.2f} ms CPU per round of "
                    f"{args.views} views, {per_reply:.0f} instances per reply"
                )
        print(f"shared read vs each view reading: {totals['feed'] / totals['store']:.2f}x CPU")
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=4096)
    parser.add_argument("--views", type=int, default=5, help="views following the replica")
    parser.add_argument("--rounds", type=int, default=50)
    asyncio.run(_measure(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
