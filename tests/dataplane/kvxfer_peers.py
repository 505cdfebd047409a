"""Transfer agents in separate processes, driven from a test over a pipe.

Each peer is a spawned process with its own `TransferAgent`. KV is never shipped through
the pipe: both sides build it from a seed (`make_kv`), and the receiver reports a digest
of what it got, which the test compares with the digest of the expected slice.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KvSpec:
    """A deterministic KV: per layer, key and value drawn from `seed`."""

    seed: int
    layers: int = 3
    tokens: int = 64
    kv_heads: int = 2
    head_dim: int = 16
    dtype: str = "float64"


def make_kv(spec: KvSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(spec.seed)
    shape = (spec.tokens, spec.kv_heads, spec.head_dim)
    dtype = DTYPES[spec.dtype]
    return [
        (
            torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype),
            torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype),
        )
        for _ in range(spec.layers)
    ]


def digest(layers) -> str:
    hasher = hashlib.sha256()
    for key, value in layers:
        for tensor in (key, value):
            hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def expected_digest(spec: KvSpec, start: int, end: int) -> str:
    return digest([(k[start:end], v[start:end]) for k, v in make_kv(spec)])


def pages(start: int, end: int, page_tokens: int, kv):
    """[start, end) of `kv` as pages cut at the multiples of `page_tokens` (views, as the
    blocks of a paged cache)."""
    from libkvxfer import KvPage

    cuts = [start, *range((start // page_tokens + 1) * page_tokens, end, page_tokens), end]
    return [
        KvPage(first, last, [(k[first:last], v[first:last]) for k, v in kv])
        for first, last in zip(cuts, cuts[1:], strict=False)
    ]


def _patch_wire(mode: str) -> None:
    """Make this process misbehave on the wire the way `mode` says (tests only)."""
    from libkvxfer import _agent, _protocol

    if mode.startswith("version="):
        version = int(mode.split("=", 1)[1])
        original = _protocol.encode_preamble
        _protocol.encode_preamble = lambda flags, size, v=version: original(flags, size, v)
    elif mode == "corrupt":
        original_checksum = _agent.checksum
        _agent.checksum = lambda data: (original_checksum(data) + 1) % 2**64
    elif mode == "forged-key":
        # A rogue that learned every field of a ticket but its key: it signs with its own.
        original_send = _agent.TransferAgent.send

        def forged(self, ticket, kv, pacing_bps=None):
            return original_send(self, replace(ticket, auth_key=os.urandom(32)), kv, pacing_bps)

        _agent.TransferAgent.send = forged


def peer_main(conn, instance_id: str, config: dict, wire: str) -> None:
    """The peer process: answers `prepare`, runs `send`/`recv` on threads, reports back."""
    torch.set_num_threads(1)
    from kvrs.errors import KvrsError, NotFound
    from libkvxfer import AgentConfig, KvLayout, TransferAgent, TransferTicket

    _patch_wire(wire)
    agent = TransferAgent(AgentConfig(instance_id, **config))
    lock = threading.Lock()

    def reply(*message) -> None:
        with lock:
            conn.send(message)

    def run(call_id: int, fn) -> None:
        try:
            reply("ok", call_id, fn())
        except KvrsError as exc:
            reply("error", call_id, (type(exc).__name__, exc.code, str(exc)))

    def send(ticket: dict, spec: KvSpec, pacing_bps: float | None, page_tokens: int) -> dict:
        t = TransferTicket.from_dict(ticket)
        kv = make_kv(spec)
        if page_tokens:
            source = pages(t.token_start, t.token_end, page_tokens, kv)
        else:
            source = [
                (k[t.token_start : t.token_end], v[t.token_start : t.token_end]) for k, v in kv
            ]
        stats = agent.send(t, source, pacing_bps)
        return {"kv_bytes": stats.kv_bytes, "seconds": stats.seconds, "chunks": stats.chunks}

    def recv(ticket: dict, spec: KvSpec, page_tokens: int) -> dict:
        layout = KvLayout(spec.layers, spec.kv_heads, spec.head_dim, DTYPES[spec.dtype])
        t = TransferTicket.from_dict(ticket)
        out = None
        if page_tokens:
            empty = [(torch.empty_like(k), torch.empty_like(v)) for k, v in make_kv(spec)]
            out = pages(t.token_start, t.token_end, page_tokens, empty)
        got = agent.recv(t, layout, out)
        return {
            "digest": digest(got.layers),
            # Counted from the ticket's issue, which precedes the send: a clock started
            # when this process gets round to the call could start after the first chunk.
            "seconds": got.stats.seconds,
            "kv_bytes": got.stats.kv_bytes,
            "chunks": got.stats.chunks,
            "sender_id": got.sender_id,
        }

    def recv_into(ticket: dict, spec: KvSpec, fill_seed: int) -> dict:
        """Receive into views already holding KV of `fill_seed`; report what they hold after."""
        layout = KvLayout(spec.layers, spec.kv_heads, spec.head_dim, DTYPES[spec.dtype])
        t = TransferTicket.from_dict(ticket)
        out = [
            (k[t.token_start : t.token_end].clone(), v[t.token_start : t.token_end].clone())
            for k, v in make_kv(replace(spec, seed=fill_seed))
        ]
        try:
            agent.recv(t, layout, out)
            error = None
        except KvrsError as exc:
            error = (type(exc).__name__, exc.code, str(exc))
        return {"error": error, "digest": digest(out)}

    def reject(ticket: dict, message: str) -> dict:
        agent.reject(TransferTicket.from_dict(ticket), NotFound(message))
        return {}

    reply("ready", 0, {"address": agent.address, "pid": os.getpid()})
    while True:
        op, call_id, args = conn.recv()
        if op == "stop":
            break
        if op == "prepare":
            run(call_id, lambda a=args: agent.prepare(*a).to_dict())
        else:
            fn = {"send": send, "recv": recv, "recv_into": recv_into, "reject": reject}[op]
            threading.Thread(
                target=run, args=(call_id, lambda f=fn, a=args: f(*a)), daemon=True
            ).start()
    agent.close()
    reply("stopped", 0, {})


class Peer:
    """Test-side handle of one peer process."""

    def __init__(self, instance_id: str, wire: str = "", **config) -> None:
        context = mp.get_context("spawn")
        self.instance_id = instance_id
        self._conn, child = context.Pipe()
        config.setdefault("timeout_s", 10.0)
        self.process = context.Process(
            target=peer_main, args=(child, instance_id, config, wire), daemon=True
        )
        self.process.start()
        self._calls: dict[int, Future] = {0: Future()}
        self._next = 1
        self._lock = threading.Lock()
        self._ready = self._calls[0]
        threading.Thread(target=self._read, daemon=True).start()

    def ready(self) -> Peer:
        """Wait until the peer's agent listens (peers start in parallel, then wait)."""
        self.info = self._ready.result(timeout=60)
        return self

    def _read(self) -> None:
        while True:
            try:
                status, call_id, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is None:
                continue
            if status == "error":
                future.set_exception(PeerError(*payload))
            else:
                future.set_result(payload)
        with self._lock:
            pending, self._calls = list(self._calls.values()), {}
        for future in pending:
            future.set_exception(PeerError("ProcessExited", "UNAVAILABLE", "peer exited"))

    def call(self, op: str, *args) -> Future:
        with self._lock:
            call_id = self._next
            self._next += 1
            future = self._calls[call_id] = Future()
        self._conn.send((op, call_id, args))
        return future

    def prepare(self, sender: Peer, request_id: str, start: int, end: int) -> dict:
        return self.call("prepare", sender.instance_id, request_id, start, end).result(timeout=30)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.is_alive():
            # A peer that is already exiting may have closed its end; it is killed below.
            with contextlib.suppress(OSError):
                self._conn.send(("stop", 0, ()))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


class PeerError(Exception):
    """A KvrsError raised inside a peer: its class name, status code name and message."""

    def __init__(self, kind: str, code: str, message: str) -> None:
        super().__init__(f"{kind} ({code}): {message}")
        self.kind = kind
        self.code = code
        self.message = message


def transfer(
    sender: Peer,
    receiver: Peer,
    spec: KvSpec,
    request_id: str,
    start: int = 0,
    end: int | None = None,
    pacing_bps: float | None = None,
    send_page_tokens: int = 0,
    recv_page_tokens: int = 0,
) -> tuple[Future, Future]:
    """Start one transfer; returns the (send, recv) futures. With page sizes, a side
    sends from or receives into pages cut at their multiples (else one tensor a layer)."""
    end = spec.tokens if end is None else end
    ticket = receiver.prepare(sender, request_id, start, end)
    received = receiver.call("recv", ticket, spec, recv_page_tokens)
    sent = sender.call("send", ticket, spec, pacing_bps, send_page_tokens)
    return sent, received
