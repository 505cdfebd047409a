"""Probe transfers through the workers' own RPCs: the payload is a prefilled synthetic
prompt, a probe is the receiver's PullKv of it (the same libkvxfer path a KV takes)."""

from __future__ import annotations

from services.worker.client import Endpoint, Pulled, WorkerPool

PAYLOAD_VOCAB = 256
"""Synthetic payload tokens cycle through the byte ids every worker model accepts."""


class WorkerTransport:
    """`probing.Transport` over WorkerService (Prefill, PullKv, ReleaseKv)."""

    def __init__(self, workers: WorkerPool) -> None:
        self.workers = workers

    async def place_payload(self, src: Endpoint, kv_id: str, tokens: int, lease_s: float) -> int:
        # A payload left by an earlier prober incarnation may be shorter: start afresh.
        await self.workers.release_kv(src, kv_id)
        prompt = [position % PAYLOAD_VOCAB for position in range(tokens)]
        prefilled = await self.workers.prefill(src, kv_id, prompt, lease_s=lease_s)
        return prefilled.kv_bytes

    async def pull(
        self, dst: Endpoint, src: Endpoint, kv_id: str, tokens: int, pacing_bps: float
    ) -> Pulled:
        return await self.workers.pull_kv(dst, kv_id, src, 0, tokens, tokens, pacing_bps=pacing_bps)

    async def drop(self, at: Endpoint, kv_id: str) -> None:
        await self.workers.release_kv(at, kv_id)
