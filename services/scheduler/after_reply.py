"""Work a decision defers until its reply has been sent.

Some bookkeeping only has to land soon after a decision, not before its answer: claiming
the spare migration slot a `Recover` handed out is one Redis round trip that, run at once,
shares the scheduler's event loop (and the machine's cores) with sending the reply, and
booking a decision's work into the view's columns is the largest piece of its
bookkeeping (the view books it itself if another decision reads it first). A
handler that runs inside `deferring(context)` collects such work and starts it when gRPC
reports the RPC done; outside one (a test calling the scheduler directly) it starts at
once.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import grpc

_pending: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "kvrs_after_reply", default=None
)


def after_reply(start: Callable[[], None]) -> None:
    """Calls `start` once the current RPC's reply is sent (at once outside an RPC)."""
    pending = _pending.get()
    if pending is None:
        start()
    else:
        pending.append(start)


@contextlib.contextmanager
def deferring(context: grpc.aio.ServicerContext) -> Iterator[None]:
    """Collects what `after_reply` is given inside, and starts it when the RPC ends (its
    reply sent, or it failed or was cancelled: what was promised starts all the same)."""
    pending: list[Callable[[], None]] = []
    token = _pending.set(pending)
    try:
        yield
    finally:
        _pending.reset(token)
        if pending:
            context.add_done_callback(lambda _: _start_all(pending))


def _start_all(pending: list[Callable[[], None]]) -> None:
    for start in pending:
        start()
