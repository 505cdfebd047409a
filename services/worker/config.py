"""Configuration of a worker, read from the environment (and `--role` on the command line)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrs.errors import KvrsError
from kvrs.model import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_MODEL,
    block_tokens_setting,
)
from kvrs.topology import Location, Topology
from services.common import ConfigError, GrpcSettings, env_bool, env_float, env_int, env_str

ROLES = ("prefill", "decode")
DEFAULT_KV_CAPACITY_BYTES = 1 << 30
DEFAULT_MAX_BATCH_TOKENS = 2048


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.worker` needs; `from_env` names any bad variable."""

    instance_id: str
    """WORKER_INSTANCE_ID (required): this worker's name in gossip and in transfers."""
    role: str
    """WORKER_ROLE or --role: "prefill" or "decode" (every RPC works in both roles; the
    role tells the scheduler where to place what)."""
    listen_addr: str = "0.0.0.0:50060"
    """WORKER_LISTEN_ADDR: host:port the gRPC server binds ("127.0.0.1:0" in tests)."""
    advertise_addr: str = ""
    """WORKER_ADVERTISE_ADDR: host:port others dial (registered in gossip); empty: the
    listen address with the bound port, 127.0.0.1 for a wildcard host."""
    model: str = DEFAULT_MODEL
    """WORKER_MODEL, else KVRS_MODEL: a Hugging Face checkpoint directory, or the name of
    an embedded checkpoint (tiny, written under KVRS_CACHE_DIR on first use)."""
    dtype: str = ""
    """WORKER_DTYPE: float64, float32, bfloat16, float16; empty: the checkpoint's own
    (its config.json dtype, which is also what the cost model prices)."""
    location: Location = field(default_factory=lambda: Location(node=""))
    """WORKER_NODE / WORKER_RACK / WORKER_POD / WORKER_GPU_INDEX; unset fields come from
    the instance's entry in KVRS_TOPOLOGY_FILE when it has one."""
    gossip_addr: str = ""
    """GOSSIP_ADDR: register and heartbeat there; empty: no gossip."""
    heartbeat_interval_s: float = 0.0
    """WORKER_HEARTBEAT_INTERVAL_S: 0 = a quarter of the TTL."""
    heartbeat_ttl_s: float = 0.0
    """WORKER_HEARTBEAT_TTL_S: silence after which gossip declares this worker failed;
    0 = the gossip server's default."""
    transfer_host: str = ""
    """WORKER_TRANSFER_HOST: interface the KV transfer agent listens on and peers reach;
    empty: the advertised host."""
    transfer_port: int = 0
    """WORKER_TRANSFER_PORT: its rendezvous (TCPStore) port; 0 picks a free one."""
    transfer_timeout_s: float = 30.0
    """WORKER_TRANSFER_TIMEOUT_S: longest wait for any one step of a transfer; a dead or
    hung peer fails its transfers after at most this long."""
    transfer_pacing_bps: float = 0.0
    """WORKER_TRANSFER_PACING_BPS: cap on this worker's send rate (emulated link); 0 = none."""
    transfer_chunk_tokens: int = 0
    """WORKER_TRANSFER_CHUNK_TOKENS: tokens per transfer chunk within a layer; 0 = a KV
    block, so every chunk moves in place between the two workers' blocks."""
    transfer_checksums: bool = True
    """WORKER_TRANSFER_CHECKSUMS: send an xxh3-64 checksum of every chunk
    (receivers verify what they get); a fast pass over the bytes on each side."""
    send_kv_deadline_s: float = 600.0
    """WORKER_SEND_KV_DEADLINE_S: deadline of the SendKv call a PullKv makes (capped by the
    PullKv's own deadline); progress is watched by the transfer timeout meanwhile."""
    kv_capacity_bytes: int = DEFAULT_KV_CAPACITY_BYTES
    """WORKER_KV_CAPACITY_BYTES: memory budget for resident KV, counted in whole blocks."""
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """KVRS_BLOCK_TOKENS: the cluster's prefix-block size; KV is allocated, budgeted and
    hashed (the prefix hashes heartbeats advertise) in blocks of this many tokens."""
    kv_lease_s: float = 120.0
    """WORKER_KV_LEASE_S: default lease of resident KV after its last use."""
    torch_threads: int = 1
    """WORKER_TORCH_THREADS: intra-op threads of the forward passes."""
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    """WORKER_MAX_BATCH_TOKENS: most new tokens one batched forward pass computes (decode
    steps of the running streams plus queued prefills; a longer prompt is chunked)."""
    profile_path: str = ""
    """WORKER_PROFILE_PATH: a `kvrs calibrate` profile for queued-work estimates; empty:
    the model's preset profile."""
    canary_interval_s: float = 10.0
    """WORKER_CANARY_INTERVAL_S: how often the one-token canary re-checks health."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS, message size and shutdown grace (KVRS_TLS_*, KVRS_MAX_MESSAGE_BYTES, ...)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, role: str | None = None) -> Config:
        instance_id = env_str("WORKER_INSTANCE_ID", None, env)
        role = role or env_str("WORKER_ROLE", None, env)
        if role not in ROLES:
            raise ConfigError(f"WORKER_ROLE (or --role) must be one of {ROLES}, got {role!r}")
        model = env_str("WORKER_MODEL", env_str("KVRS_MODEL", DEFAULT_MODEL, env), env)
        location = _location(instance_id, env)
        try:
            block_tokens = block_tokens_setting(env)
        except KvrsError as exc:
            raise ConfigError(str(exc)) from None
        config = cls(
            instance_id=instance_id,
            role=role,
            listen_addr=env_str("WORKER_LISTEN_ADDR", "0.0.0.0:50060", env),
            advertise_addr=env_str("WORKER_ADVERTISE_ADDR", "", env),
            model=model,
            dtype=env_str("WORKER_DTYPE", "", env),
            location=location,
            gossip_addr=env_str("GOSSIP_ADDR", "", env),
            heartbeat_interval_s=env_float("WORKER_HEARTBEAT_INTERVAL_S", 0.0, env),
            heartbeat_ttl_s=env_float("WORKER_HEARTBEAT_TTL_S", 0.0, env),
            transfer_host=env_str("WORKER_TRANSFER_HOST", "", env),
            transfer_port=env_int("WORKER_TRANSFER_PORT", 0, env),
            transfer_timeout_s=env_float("WORKER_TRANSFER_TIMEOUT_S", 30.0, env),
            transfer_pacing_bps=env_float("WORKER_TRANSFER_PACING_BPS", 0.0, env),
            transfer_chunk_tokens=env_int("WORKER_TRANSFER_CHUNK_TOKENS", 0, env),
            transfer_checksums=env_bool("WORKER_TRANSFER_CHECKSUMS", True, env),
            send_kv_deadline_s=env_float("WORKER_SEND_KV_DEADLINE_S", 600.0, env),
            kv_capacity_bytes=env_int("WORKER_KV_CAPACITY_BYTES", DEFAULT_KV_CAPACITY_BYTES, env),
            block_tokens=block_tokens,
            kv_lease_s=env_float("WORKER_KV_LEASE_S", 120.0, env),
            torch_threads=env_int("WORKER_TORCH_THREADS", 1, env),
            max_batch_tokens=env_int("WORKER_MAX_BATCH_TOKENS", DEFAULT_MAX_BATCH_TOKENS, env),
            profile_path=env_str("WORKER_PROFILE_PATH", "", env),
            canary_interval_s=env_float("WORKER_CANARY_INTERVAL_S", 10.0, env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            grpc=GrpcSettings.from_env(env),
        )
        for name, value in (
            ("WORKER_TRANSFER_TIMEOUT_S", config.transfer_timeout_s),
            ("WORKER_SEND_KV_DEADLINE_S", config.send_kv_deadline_s),
            ("WORKER_KV_CAPACITY_BYTES", config.kv_capacity_bytes),
            ("WORKER_KV_LEASE_S", config.kv_lease_s),
            ("WORKER_TORCH_THREADS", config.torch_threads),
            ("WORKER_MAX_BATCH_TOKENS", config.max_batch_tokens),
            ("WORKER_CANARY_INTERVAL_S", config.canary_interval_s),
        ):
            if value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        for name, value in (
            ("WORKER_TRANSFER_PACING_BPS", config.transfer_pacing_bps),
            ("WORKER_TRANSFER_CHUNK_TOKENS", config.transfer_chunk_tokens),
            ("WORKER_HEARTBEAT_INTERVAL_S", config.heartbeat_interval_s),
            ("WORKER_HEARTBEAT_TTL_S", config.heartbeat_ttl_s),
        ):
            if value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        return config


def _location(instance_id: str, env: Mapping[str, str] | None) -> Location:
    """Env variables first, then the instance's entry in the topology file, else its id."""
    known = Location(node="")
    path = env_str("KVRS_TOPOLOGY_FILE", "", env)
    if path:
        try:
            known = Topology.from_yaml(path).instance(instance_id).location
        except KvrsError as exc:
            if exc.code != "NOT_FOUND":
                raise ConfigError(f"KVRS_TOPOLOGY_FILE {path}: {exc}") from exc
        except OSError as exc:
            raise ConfigError(f"KVRS_TOPOLOGY_FILE {path}: {exc}") from exc
    return Location(
        node=env_str("WORKER_NODE", known.node or instance_id, env),
        rack=env_str("WORKER_RACK", known.rack, env),
        pod=env_str("WORKER_POD", known.pod, env),
        gpu_index=env_int("WORKER_GPU_INDEX", known.gpu_index, env),
    )
