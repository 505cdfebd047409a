"""Plans the requests of one failed decode instance together.

When an instance dies, every request decoding on it notices within milliseconds of the
others. Planned one by one, each would be promised the full bandwidth of the links they
share; planned together (RecoverBatch) the scheduler splits it. The batcher collects the
requests of one (failed instance, policy) for at most `window_s`, or until every request
the router knows was on that instance has joined, then makes one call. A group of one is
a plain Recover.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrs.errors import Unavailable
from kvrs.recovery import RecoveryRequest
from services.router.records import Decision

log = logging.getLogger(__name__)


class Planner(Protocol):
    async def recover(self, request: RecoveryRequest, failed_id: str, policy: str) -> Decision: ...

    async def recover_batch(
        self, requests: Sequence[RecoveryRequest], failed_id: str, policy: str
    ) -> list[Decision]: ...


@dataclass
class _Group:
    failed_id: str
    policy: str
    expected: int
    items: list[tuple[RecoveryRequest, asyncio.Future]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    closed: bool = False


class RecoveryBatcher:
    """See the module docstring."""

    def __init__(self, planner: Planner, window_s: float) -> None:
        self._planner = planner
        self.window_s = window_s
        self._groups: dict[tuple[str, str], _Group] = {}
        self._tasks: set[asyncio.Task] = set()
        self.calls = 0
        """Scheduler calls made (Recover or RecoverBatch), for tests and benchmarks."""

    async def decide(
        self, item: RecoveryRequest, failed_id: str, policy: str, expected: int
    ) -> Decision:
        """The decision for `item`, planned with the others of `failed_id` that join in
        time. `expected`: requests the caller knows were on the instance (this one
        included); the call goes out as soon as that many have joined."""
        loop = asyncio.get_running_loop()
        key = (failed_id, policy)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(failed_id, policy, max(1, expected))
            group.timer = loop.call_later(self.window_s, self._flush, key, group)
        future: asyncio.Future[Decision] = loop.create_future()
        group.items.append((item, future))
        if len(group.items) >= group.expected:
            self._flush(key, group)
        return await future

    def _flush(self, key: tuple[str, str], group: _Group) -> None:
        if group.closed:
            return
        group.closed = True
        if self._groups.get(key) is group:
            del self._groups[key]
        if group.timer is not None:
            group.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._plan(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _plan(self, group: _Group) -> None:
        items = [item for item, _ in group.items]
        self.calls += 1
        try:
            if len(items) == 1:
                decisions = [await self._planner.recover(items[0], group.failed_id, group.policy)]
            else:
                decisions = await self._planner.recover_batch(items, group.failed_id, group.policy)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting request
            for _, future in group.items:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        by_id = {decision.request_id: decision for decision in decisions}
        for item, future in group.items:
            if future.done():
                continue
            decision = by_id.get(item.request_id)
            if decision is None:
                future.set_exception(
                    Unavailable(f"the scheduler's plan has no decision for {item.request_id}")
                )
            else:
                future.set_result(decision)
