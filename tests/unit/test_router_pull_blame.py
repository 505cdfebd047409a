"""Whom the router blames for a failed pull: the answers of both sides decide."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace

from kvrs.errors import DeadlineExceeded, KvrsError, NotFound
from services.router.records import GenerateInput, Run, Summary
from services.router.recovery import RecoveryExecutor, StepFailed
from services.worker.client import Endpoint

SOURCE = Endpoint("prefill-0", "127.0.0.1:1")
TARGET = Endpoint("decode-0", "127.0.0.1:2")


class PullFails:
    """Workers whose pulls fail with `error` and whose liveness checks say `alive`."""

    def __init__(self, error: KvrsError, alive: set[str]) -> None:
        self.error = error
        self.alive = alive

    async def pull_kv(self, *args, **kwargs):
        raise self.error

    async def release_kv(self, at, kv_id, timeout_s=None) -> bool:
        return True

    async def is_alive(self, at: Endpoint, timeout_s: float) -> bool:
        return at.instance_id in self.alive


def blamed(error: KvrsError, alive: set[str]):
    executor = RecoveryExecutor(PullFails(error, alive), None, trace.get_tracer("test"))
    request = GenerateInput("r", (1, 2, 3), 4)
    run = Run(request, Summary("r", 3), "", prefill=SOURCE, prefill_kv_id="r")
    with pytest.raises(StepFailed) as failed:
        asyncio.run(executor.pull(run, TARGET, "r", SOURCE, 0, 3, 3))
    lost = failed.value.lost
    return lost.instance_id, lost.source_lost, lost.unreachable


def test_a_target_that_no_longer_answers_is_lost():
    assert blamed(DeadlineExceeded("pull"), {"prefill-0"}) == ("decode-0", False, True)


def test_a_source_that_no_longer_answers_takes_its_kv_with_it():
    assert blamed(DeadlineExceeded("pull"), {"decode-0"}) == ("prefill-0", True, True)


def test_a_source_that_answers_but_lost_the_kv_is_blamed_for_the_kv_alone():
    error = NotFound("request 'r' has no KV on this worker", field="request_id")
    assert blamed(error, {"prefill-0", "decode-0"}) == ("prefill-0", True, False)


def test_a_pull_that_broke_on_the_way_leaves_the_source_kv_usable():
    """Both answer after the failure (a link that flapped and healed): the KV is still on
    the source, so the request moves on from it; the target whose pull broke is left out."""
    assert blamed(DeadlineExceeded("pull"), {"prefill-0", "decode-0"}) == (
        "decode-0",
        False,
        False,
    )
