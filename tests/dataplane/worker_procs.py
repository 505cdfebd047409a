"""Worker servers in their own processes, on port 0, for the worker service tests."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass

import grpc

from kvrs.v1 import worker_pb2_grpc


def _serve(conn, env: dict[str, str], role: str) -> None:
    from services.common import Metrics, serve_metrics, setup_tracing
    from services.worker.config import Config
    from services.worker.server import build_server

    async def main() -> None:
        config = Config.from_env(env, role=role)
        metrics = Metrics()
        serve_metrics(metrics, config.metrics_addr)
        handle = await build_server(config, setup_tracing(f"test-{config.instance_id}"), metrics)
        conn.send((handle.port, handle.engine.agent.address))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await handle.stop(1.0)

    asyncio.run(main())


@dataclass
class WorkerProcess:
    """A spawned worker; `address` is its WorkerService."""

    instance_id: str
    role: str
    process: mp.Process
    conn: object
    address: str = ""
    transfer_address: str = ""

    @classmethod
    def start(cls, instance_id: str, role: str, **env: str) -> WorkerProcess:
        context = mp.get_context("spawn")
        parent, child = context.Pipe()
        full_env = {
            "WORKER_INSTANCE_ID": instance_id,
            "WORKER_LISTEN_ADDR": "127.0.0.1:0",
            "WORKER_TRANSFER_TIMEOUT_S": "10",
            "WORKER_CANARY_INTERVAL_S": "30",
            **env,
        }
        process = context.Process(target=_serve, args=(child, full_env, role), daemon=True)
        process.start()
        return cls(instance_id, role, process, parent)

    def ready(self, timeout_s: float = 90.0) -> WorkerProcess:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.instance_id} did not start")
        port, self.transfer_address = self.conn.recv()
        self.address = f"127.0.0.1:{port}"
        return self

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(timeout=15)
        if self.process.is_alive():
            self.kill()


def stub(address: str) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, worker_pb2_grpc.WorkerServiceStub(channel)
