"""The outcomes of executed decisions, shared by every scheduler replica, and the
corrections fitted from them.

Outcomes live in one Redis sorted set scored by decision time (`<prefix>outcomes`),
trimmed to the newest `capacity`. A member is the outcome's JSON, so a ReportOutcome
retried after a lost reply stores nothing twice. Every replica re-reads the set each
`refresh_s` and refits with `kvrs.learning.fit`, a pure function of the outcomes: all
replicas price with the same corrections, whichever of them a router reported to. When
Redis cannot be reached, a replica keeps fitting from the outcomes reported to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import cast

from redis.exceptions import RedisError

from kvrs.learning import Corrections, LearningConfig, Outcome, fit
from kvrs.profile import ComputeProfile
from services.common.redis_store import Keys, RedisClient

log = logging.getLogger(__name__)


class OutcomeLog:
    """The shared outcome store (see the module docstring)."""

    def __init__(self, client: RedisClient, keys: Keys, capacity: int) -> None:
        self.client = client
        self.key = keys("outcomes")
        self.capacity = capacity

    async def add(self, outcome: Outcome) -> int:
        """Stores `outcome`; the number of outcomes held now."""
        member = json.dumps(outcome.to_json(), sort_keys=True)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.zadd(self.key, {member: outcome.at_s})
            pipe.zremrangebyrank(self.key, 0, -self.capacity - 1)
            pipe.zcard(self.key)
            *_, held = await pipe.execute()
        return int(held)

    async def read(self) -> list[Outcome]:
        """Every stored outcome, oldest first (a malformed member is skipped)."""
        outcomes = []
        for member in await self.client.zrange(self.key, 0, -1):
            try:
                outcomes.append(Outcome.from_json(json.loads(cast(str | bytes, member))))
            except (ValueError, TypeError) as exc:
                log.warning("skipping a malformed outcome in %s: %s", self.key, exc)
        return outcomes

    async def clear(self) -> None:
        await self.client.delete(self.key)


class Learning:
    """The corrections in force, refitted from the shared log."""

    def __init__(
        self,
        store: OutcomeLog | None,
        base: ComputeProfile,
        config: LearningConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.base = base
        self.config = config or LearningConfig()
        self.clock = clock
        self._outcomes: list[Outcome] = []
        self._corrections = Corrections()
        self._failing = False

    @property
    def corrections(self) -> Corrections:
        return self._corrections

    async def record(self, outcome: Outcome) -> int:
        """Stores one outcome and refits; the outcomes the fit can now draw on."""
        self._outcomes.append(outcome)
        held = len(self._outcomes)
        if self.store is not None:
            try:
                held = await self.store.add(outcome)
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
        self._outcomes = self._outcomes[-self.config.window :]
        self._refit()
        return held

    async def refresh(self) -> None:
        """Re-reads the shared log (every replica's outcomes) and refits."""
        if self.store is not None:
            try:
                self._outcomes = (await self.store.read())[-self.config.window :]
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
            else:
                if self._failing:
                    log.warning("outcome log reachable again")
                    self._failing = False
        self._refit()

    async def run(self, refresh_s: float) -> None:
        """Refreshes every `refresh_s` until cancelled.

        The Redis client can turn a cancellation that lands mid-reply into a connection
        error, which `refresh` logs and survives; the loop therefore also stops once its
        task has been asked to, so shutdown never waits on it.
        """
        task = asyncio.current_task()
        while task is None or not task.cancelling():
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - one bad refresh must not end the refreshes
                log.exception("refitting the corrections failed; keeping the last ones")
            if task is not None and task.cancelling():
                break
            await asyncio.sleep(refresh_s)
        raise asyncio.CancelledError

    def _refit(self) -> None:
        self._corrections = fit(self._outcomes, self.base, self.clock(), self.config)

    def _redis_failed(self, exc: Exception) -> None:
        if not self._failing:
            log.warning("outcome log unreachable, fitting this replica's outcomes: %s", exc)
            self._failing = True


CLOSE_TIMEOUT_S = 2.0
"""How long shutdown waits for the Redis client to close (a connection whose reader was
cancelled mid-reply may never answer)."""


async def close_quietly(client: RedisClient) -> None:
    with contextlib.suppress(RedisError, OSError, TimeoutError):
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await client.aclose()
