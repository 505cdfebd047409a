"""Paged KV: a pool of fixed-size blocks, and per sequence a table of the blocks it uses.

A worker's KV memory is one `KvPool`: per layer, key and value tensors of shape
``[blocks, block_tokens, kv_heads, head_dim]`` (keys stored after the rotary
embedding), allocated once from the KV budget. A `KvCache` is one sequence: the ids of
its blocks in position order, and how many positions are resident. Because a block is
only a table entry, a prompt whose leading blocks are resident *shares* them — no copy,
no recomputation — and a sequence grows a block at a time without moving its KV.

Which block holds what (references, prefix hashes, least-recently-used reuse) is the
pure `kvrs.block_manager.BlockManager`; this module adds the tensors and the lock that
lets the event loop, the compute thread and the transfer threads share it. Attention
reads a sequence's keys by gathering its blocks' slots (`gather`), once per layer and
pass; a transfer moves each block's rows in place (`pages`).

Position ``i``'s KV depends only on tokens ``≤ i`` (causal attention), so blocks
computed in one place, received from another and shared from a third make up the KV
of the whole sequence.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Sequence

import torch

from kvrs.block_manager import BlockManager
from kvrs.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument

__all__ = ["FillProgress", "KvCache", "KvPool", "LayerKv"]

LayerKv = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (key, value) tensors of shape [tokens, kv_heads, head_dim]."""


class KvPool:
    """One process's KV blocks for one model, and who uses which.

    A worker's pool has a fixed number of blocks (its KV budget); a `growable` pool
    (forward passes outside a worker: tests, calibration, benches) doubles when it runs
    out. One extra block, always zero, past the usable ones pads batched reads.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_tokens: int,
        num_blocks: int,
        device: torch.device | str = "cpu",
        growable: bool = False,
    ) -> None:
        if block_tokens <= 0:
            raise InvalidArgument("block_tokens", f"must be > 0, got {block_tokens}")
        if num_blocks < 0:
            raise InvalidArgument("num_blocks", f"must be >= 0, got {num_blocks}")
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.block_tokens = block_tokens
        self.device = torch.device(device)
        self.growable = growable
        self.manager = BlockManager(num_blocks)
        self.keys: list[torch.Tensor] = [self._blocks(num_blocks) for _ in range(layers)]
        self.values: list[torch.Tensor] = [self._blocks(num_blocks) for _ in range(layers)]
        self._lock = threading.RLock()
        self._dropped: deque[list[int]] = deque()
        """Tables of caches collected without `free` (appended by their finalizers, which
        may run on any thread at any time, so they only append), released at the next
        bookkeeping call."""

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * element

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    @property
    def zero_slot(self) -> int:
        """A slot whose key and value are zeros (padding of a batched gather)."""
        return self.num_blocks * self.block_tokens

    def new_cache(self, capacity_tokens: int = 0, shared: Sequence[int] = ()) -> KvCache:
        """An empty sequence; with `shared`, it starts with those resident full blocks
        (one more reference each) as its first positions."""
        return KvCache(self, capacity_tokens, shared)

    # -- bookkeeping, under the lock ----------------------------------------------------

    def available_blocks(self) -> int:
        with self._lock:
            self._collect()
            return self.manager.available_blocks

    def allocate(self, count: int) -> list[int]:
        """`count` blocks for one sequence; a growable pool grows to have them."""
        with self._lock:
            self._collect()
            missing = count - self.manager.available_blocks
            if missing > 0 and self.growable:
                self._grow(max(missing, self.num_blocks))
            return self.manager.allocate(count)

    def share(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._collect()
            self.manager.share(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._collect()
            self.manager.release(blocks)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Resident blocks of the leading `hashes` (no reference taken)."""
        with self._lock:
            self._collect()
            return self.manager.lookup(hashes)

    def publish(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Name full blocks by their prefix hashes (a hash already named keeps its block)."""
        with self._lock:
            for block, block_hash in zip(blocks, hashes, strict=False):
                self.manager.publish(block, block_hash)

    def hashes(self, limit: int | None = None) -> list[int]:
        with self._lock:
            self._collect()
            return self.manager.hashes(limit)

    def own(self, block: int) -> int | None:
        """Make `block` writable by its one holder: unpublish it, or, when others share
        it, a private copy to use instead (its id returned; None: `block` itself)."""
        with self._lock:
            if self.manager.refs(block) == 1:
                self.manager.unpublish(block)
                return None
            (copy,) = self.manager.allocate(1)
            self.manager.release([block])
        for layer in range(self.layers):
            self.keys[layer][copy] = self.keys[layer][block]
            self.values[layer][copy] = self.values[layer][block]
        return copy

    def _collect(self) -> None:
        while self._dropped:
            self.manager.release(self._dropped.popleft())

    # -- tensors ----------------------------------------------------------------------

    def _blocks(self, count: int) -> torch.Tensor:
        """Storage of `count` blocks plus the zero block (untouched pages cost nothing).

        Never an inference tensor, even when a pass grows the pool: transfers and copies
        outside inference mode write into it too."""
        shape = (count + 1, self.block_tokens, self.kv_heads, self.head_dim)
        with torch.inference_mode(False):
            storage = torch.empty(shape, dtype=self.dtype, device=self.device)
            storage[count].zero_()
        return storage

    def _grow(self, blocks: int) -> None:
        """Add `blocks` blocks (a growable pool only; tensors are reallocated)."""
        old = self.num_blocks
        for tensors in (self.keys, self.values):
            for layer, storage in enumerate(tensors):
                grown = self._blocks(old + blocks)
                grown[:old] = storage[:old]
                tensors[layer] = grown
        self.manager.grow(blocks)

    def flat_keys(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys as [slots, kv_heads, head_dim]; a position's slot is its
        block times block_tokens plus its offset in the block."""
        return self.keys[layer].view(-1, self.kv_heads, self.head_dim)

    def flat_values(self, layer: int) -> torch.Tensor:
        return self.values[layer].view(-1, self.kv_heads, self.head_dim)


class FillProgress:
    """How far a prefill has written each layer of its positions, so a transfer can
    stream a layer's rows as soon as they are final instead of waiting for the whole
    pass (layer-wise streaming). The compute thread advances it; transfer threads wait
    on it."""

    def __init__(self, layers: int, start: int, end: int) -> None:
        self.end = end
        self._written = [start] * layers
        self._failure: str | None = None
        self._changed = threading.Condition()

    def advance(self, layer: int, end: int) -> None:
        """Layer `layer` now holds positions up to `end`."""
        with self._changed:
            if end > self._written[layer]:
                self._written[layer] = end
                self._changed.notify_all()

    def finish(self) -> None:
        """Every layer is written to the end."""
        with self._changed:
            self._written = [self.end] * len(self._written)
            self._changed.notify_all()

    def fail(self, reason: str) -> None:
        """The prefill will not finish: waiters give up at once."""
        with self._changed:
            self._failure = reason
            self._changed.notify_all()

    def wait(self, layer: int, end: int, timeout_s: float) -> None:
        """Block until layer `layer` holds positions up to `end`; FailedPrecondition when
        the prefill failed, DeadlineExceeded after `timeout_s`."""
        with self._changed:
            ready = self._changed.wait_for(
                lambda: self._written[layer] >= end or self._failure is not None, timeout_s
            )
            if self._failure is not None:
                raise FailedPrecondition(f"the prefill failed: {self._failure}")
            if not ready:
                raise DeadlineExceeded(
                    f"layer {layer} was not computed up to position {end} within {timeout_s} s"
                )


class KvCache:
    """The KV of one sequence: its block table in a pool and its resident length.

    Positions ``[0, length)`` are resident; blocks beyond them are reserved room. The
    blocks go back to the pool on `free` (or when the cache is collected). A full block
    may be shared with other sequences; before this sequence writes into a block it
    makes sure it is the block's only holder (`reserve`).
    """

    def __init__(self, pool: KvPool, capacity_tokens: int = 0, shared: Sequence[int] = ()) -> None:
        self.pool = pool
        self.block_tokens = pool.block_tokens
        self.blocks: list[int] = []
        self.length = 0
        # Given the table itself, so collecting an unfreed cache returns its blocks.
        self._finalizer = weakref.finalize(self, pool._dropped.append, self.blocks)
        if shared:
            pool.share(shared)
            self.blocks.extend(shared)
            self.length = len(shared) * self.block_tokens
        self._table: torch.Tensor | None = None
        self.filling: FillProgress | None = None
        """Set while a prefill writes this sequence (see FillProgress)."""
        self.reserve(capacity_tokens)

    @property
    def num_layers(self) -> int:
        return self.pool.layers

    @property
    def capacity_tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    def resident_bytes(self) -> int:
        return self.length * self.bytes_per_token

    # -- room -------------------------------------------------------------------------

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions in total, every block from `length` on owned by this
        sequence alone (ResourceExhausted when the pool has no blocks left)."""
        first = self.length // self.block_tokens
        for index in range(first, min(len(self.blocks), -(-tokens // self.block_tokens))):
            copy = self.pool.own(self.blocks[index])
            if copy is not None:
                self.blocks[index] = copy
                self._table = None
        missing = -(-tokens // self.block_tokens) - len(self.blocks)
        if missing > 0:
            self.blocks.extend(self.pool.allocate(missing))
            self._table = None

    def free(self) -> None:
        """Give every block back to the pool (the cache is empty afterwards)."""
        blocks, self.blocks[:] = list(self.blocks), []
        self.length = 0
        self._table = None
        if blocks:
            self.pool.release(blocks)

    def publish(self, hashes: Sequence[int]) -> None:
        """Name the leading full blocks by their prefix hashes, so other prompts share them."""
        full = min(len(hashes), self.length // self.block_tokens)
        self.pool.publish(self.blocks[:full], hashes[:full])

    def commit(self, length: int) -> None:
        """Declare positions `[0, length)` resident (after writing them)."""
        if not 0 <= length <= self.capacity_tokens:
            raise InvalidArgument("length", f"{length} is outside [0, {self.capacity_tokens}]")
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (the blocks stay reserved)."""
        if not 0 <= length <= self.length:
            raise InvalidArgument("length", f"{length} is outside [0, {self.length}]")
        self.length = length

    # -- slots ------------------------------------------------------------------------

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Flat pool slots of positions `[start, end)` (reserved ones)."""
        if not 0 <= start <= end <= self.capacity_tokens:
            raise InvalidArgument(
                "token_range",
                f"[{start}, {end}) is outside the reserved [0, {self.capacity_tokens})",
            )
        if self._table is None:
            blocks = torch.tensor(self.blocks, dtype=torch.long, device=self.pool.device)
            offsets = torch.arange(self.block_tokens, device=self.pool.device)
            self._table = (blocks[:, None] * self.block_tokens + offsets).reshape(-1)
        return self._table[start:end]

    def write(self, layer: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one layer's KV of positions `[start, start + len(key))`."""
        slots = self.slots(start, start + key.shape[0])
        self.pool.flat_keys(layer).index_copy_(0, slots, key)
        self.pool.flat_values(layer).index_copy_(0, slots, value)
        if self.filling is not None:
            self.filling.advance(layer, start + key.shape[0])

    def gather(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's key and value of positions `[0, end)` as contiguous tensors."""
        slots = self.slots(0, self.length if end is None else end)
        return self.pool.flat_keys(layer)[slots], self.pool.flat_values(layer)[slots]

    # -- whole ranges -----------------------------------------------------------------

    def layers_kv(self, start: int = 0, end: int | None = None) -> LayerKv:
        """Per-layer copies of the resident positions `[start, end)` (default: all)."""
        end = self.length if end is None else end
        if not 0 <= start <= end <= self.length:
            raise InvalidArgument("token_range", f"[{start}, {end}) is outside [0, {self.length})")
        slots = self.slots(start, end)
        return [
            (self.pool.flat_keys(layer)[slots], self.pool.flat_values(layer)[slots])
            for layer in range(self.num_layers)
        ]

    def write_layers(self, start: int, kv: LayerKv) -> None:
        """Store per-layer KV computed elsewhere at `[start, start + tokens)`, reserving
        room first; `commit` declares it resident."""
        tokens = kv[0][0].shape[0] if kv else 0
        self.reserve(start + tokens)
        for layer, (key, value) in enumerate(kv):
            self.write(layer, start, key, value)

    def pages(self, start: int, end: int) -> list[tuple[int, int, LayerKv]]:
        """Positions `[start, end)` block by block: (piece_start, piece_end, per-layer views
        into the pool). The views are contiguous and writable: a transfer sends from them
        or receives into them in place."""
        if not 0 <= start <= end <= self.capacity_tokens:
            raise InvalidArgument(
                "token_range",
                f"[{start}, {end}) is outside the reserved [0, {self.capacity_tokens})",
            )
        out = []
        size = self.block_tokens
        position = start
        while position < end:
            block = self.blocks[position // size]
            offset = position % size
            stop = min(end, (position // size + 1) * size)
            rows = slice(offset, offset + stop - position)
            layers = [
                (self.pool.keys[layer][block, rows], self.pool.values[layer][block, rows])
                for layer in range(self.num_layers)
            ]
            out.append((position, stop, layers))
            position = stop
        return out
