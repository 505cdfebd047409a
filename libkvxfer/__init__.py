"""libkvxfer: moves KV caches between worker processes over pairwise torch.distributed groups.

KV travels layer by layer in checksummed chunks over a two-rank gloo group per
(receiver, sender) pair, built on the receiver's TCPStore without a global process
group, so processes join and leave at any time and a dead peer fails only its own
transfers, within the configured timeout. The receiver pulls: it issues a
`TransferTicket`, the caller hands it to the sender, the sender pushes.

    agent = TransferAgent(AgentConfig(instance_id="decode-0", host="10.0.0.7"))
    ticket = agent.prepare("prefill-3", "req-42", 0, 1024)   # receiver
    ...  # hand ticket.to_dict() to prefill-3 (WorkerService.SendKv)
    other.send(TransferTicket.from_dict(d), kv)              # sender, blocking
    received = agent.recv(ticket, layout)                    # receiver, blocking

Wire format and version history: `libkvxfer._protocol`. Errors: `libkvxfer._errors`.
"""

from libkvxfer._agent import AgentConfig, TransferAgent
from libkvxfer._errors import (
    AuthenticationFailed,
    ChecksumMismatch,
    KvXferError,
    LayoutMismatch,
    PeerLost,
    ProtocolVersionMismatch,
    TransferRejected,
    TransferTimeout,
)
from libkvxfer._interface import KvReceiver, KvSender
from libkvxfer._protocol import PROTOCOL_HISTORY, PROTOCOL_VERSION
from libkvxfer._types import (
    ChunkReady,
    KvLayers,
    KvLayout,
    KvPage,
    KvPages,
    ReceivedKv,
    TransferStats,
    TransferTicket,
)

__all__ = [
    "PROTOCOL_HISTORY",
    "PROTOCOL_VERSION",
    "AgentConfig",
    "AuthenticationFailed",
    "ChunkReady",
    "ChecksumMismatch",
    "KvLayers",
    "KvLayout",
    "KvPage",
    "KvPages",
    "KvReceiver",
    "KvSender",
    "KvXferError",
    "LayoutMismatch",
    "PeerLost",
    "ProtocolVersionMismatch",
    "ReceivedKv",
    "TransferAgent",
    "TransferRejected",
    "TransferStats",
    "TransferTicket",
    "TransferTimeout",
]
