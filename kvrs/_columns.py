"""Per-candidate-list columns shared by placement and recovery, cached on the list.

A `ClusterView` hands the same read-only `InstanceList` to every decision that uses it,
so what decisions read from it (waits, free memory, path terms from a source) is read
once per list and reused until the network model changes. A batch plan's `WaitPlan`
keeps, per list, the waits raised by the work it queued, updated as the plan grows.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvrs.cluster import InstanceList, InstanceState
from kvrs.network import NetworkModel, PathTable

if TYPE_CHECKING:
    import numpy as np

    from kvrs._pathmatrix import PathMatrix

_HOLDERS_CACHE_MAX = 4096


class Fan:
    """Path terms from one source instance to every instance of a list.

    What depends on the waits (`rtt_wait`) is summed on first use, so a view refresh that
    changed some waits costs the next decision one vector addition, not a Python pass.
    Large lists are scored from arrays, small ones from lists; each form is made on first
    use (from the table's arrays when it has them), so a decision builds only its own.
    """

    __slots__ = (
        "table",
        "bps",
        "rtt",
        "wait",
        "_inv_bps",
        "_min",
        "_wait_array",
        "_rtt_wait",
        "_paths",
        "_rtt_wait_array",
    )

    def __init__(
        self, table: PathTable, wait: list[float], wait_array: np.ndarray | None = None
    ) -> None:
        self.table = table
        self.bps = table.bandwidth_bps
        self.rtt = table.rtt_s
        self.wait = wait
        """The waits `rtt_wait` is summed with (a list identity: see `rewaited`)."""
        self._inv_bps: list[float] | None = None
        self._min: tuple[float, float] | None = None
        self._wait_array = wait_array
        self._rtt_wait: list[float] | None = None
        self._paths: tuple[np.ndarray, np.ndarray] | None = table.arrays
        self._rtt_wait_array: np.ndarray | None = None

    def rewaited(self, wait: list[float], wait_array: np.ndarray | None = None) -> Fan:
        """The same paths with new waits (`wait_array`: the same as an array, when the
        columns have one): the path terms, the costly part, are shared."""
        fan = Fan.__new__(Fan)
        fan.table, fan.bps, fan.rtt = self.table, self.bps, self.rtt
        fan._inv_bps, fan._min, fan._paths = self._inv_bps, self._min, self._paths
        fan.wait, fan._wait_array = wait, wait_array
        fan._rtt_wait, fan._rtt_wait_array = None, None
        return fan

    @property
    def inv_bps(self) -> list[float]:
        """1 / bandwidth of every path (seconds per bit)."""
        if self._inv_bps is None:
            if self._paths is not None:
                self._inv_bps = self._paths[1].tolist()
            else:
                self._inv_bps = [1.0 / bps for bps in self.bps]
        return self._inv_bps

    @property
    def min_rtt(self) -> float:
        """A bound for pruning: no transfer from this source beats
        min_rtt + bits · min_inv_bps."""
        return self._bounds()[0]

    @property
    def min_inv_bps(self) -> float:
        return self._bounds()[1]

    def _bounds(self) -> tuple[float, float]:
        if self._min is None:
            self._min = (min(self.rtt, default=0.0), min(self.inv_bps, default=0.0))
        return self._min

    @property
    def rtt_wait(self) -> list[float]:
        """rtt + wait of every instance."""
        if self._rtt_wait is None:
            self._rtt_wait = list(map(operator.add, self.rtt, self.wait))
        return self._rtt_wait

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rtt, 1 / bandwidth, rtt + wait) as numpy arrays."""
        import numpy as np  # only large candidate sets need it; imported on first use

        if self._paths is None:
            self._paths = (np.array(self.rtt), np.array(self.inv_bps))
        if self._rtt_wait_array is None:
            # Element by element the same float additions as `rtt_wait`.
            wait = self._wait_array if self._wait_array is not None else np.array(self.wait)
            self._rtt_wait_array = self._paths[0] + wait
        return self._paths[0], self._paths[1], self._rtt_wait_array


class Columns:
    """The fields decisions read from a list of instances, read once per list."""

    __slots__ = (
        "states",
        "ids",
        "wait",
        "running",
        "load",
        "free",
        "min_free",
        "has_resident",
        "_arrays",
        "_holders",
        "_narrowed",
        "_masks",
        "_fans",
        "_by_wait",
        "_index",
        "_matrix",
    )

    def __init__(self, states: Sequence[InstanceState]) -> None:
        # A copy, not `states` itself: an `InstanceList` keeps its columns in `derived`,
        # and a reference back would make each list and everything cached on it cyclic
        # garbage that only the cycle collector frees (a third of a long simulation).
        self.states = tuple(states)
        self.ids = [s.instance_id for s in states]
        self.wait = [s.wait_s for s in states]
        self.running = [s.running_requests for s in states]
        self.load = [s.queue_depth + s.running_requests for s in states]
        self.free = [s.free_kv_tokens for s in states]
        self.min_free = min(self.free, default=0)
        self.has_resident = any(s.resident_blocks for s in states)
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._holders: dict[int, frozenset[int]] = {}
        self._narrowed: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
        self._masks: dict[int, np.ndarray] = {}
        self._fans: dict[str, Fan] = {}
        self._by_wait: list[int] | None = None
        self._index: dict[str, int] | None = None
        self._matrix: tuple[Columns, PathMatrix] | None = None

    @classmethod
    def of(cls, states: Sequence[InstanceState]) -> Columns:
        """Columns of `states`, cached on it when it is an `InstanceList`."""
        if isinstance(states, InstanceList):
            columns = states.derived.get(cls)
            if columns is None:
                columns = states.derived[cls] = cls(states)
            return columns
        return cls(states)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(wait, free KV tokens) as numpy arrays."""
        if self._arrays is None:
            import numpy as np  # only large candidate sets need it; imported on first use

            self._arrays = (np.array(self.wait), np.array(self.free, dtype=np.float64))
        return self._arrays

    def fan(self, network: NetworkModel, src_id: str, now_s: float) -> Fan:
        """Path terms from `src_id` to every instance, rebuilt when the network changed
        (and only their waits summed again when the columns were patched)."""
        fan = self._fans.get(src_id)
        wait_array = None if self._arrays is None else self._arrays[0]
        if fan is None or not fan.table.valid(network, now_s):
            fan = Fan(network.fan_out(src_id, self.ids, now_s), self.wait, wait_array)
        elif fan.wait is not self.wait:
            fan = fan.rewaited(self.wait, wait_array)
        else:
            return fan
        self._fans[src_id] = fan
        return fan

    def patched(self, states: Sequence[InstanceState], indices: Sequence[int]) -> Columns:
        """The columns of `states`, the same instances in the same order as these, whose
        entries at `indices` changed: those entries are read again, what depends only on
        paths (the fans' path terms) is kept, and caches over prefix blocks are kept
        when no block set changed. Cost: a copy of each column, not a read of every
        state, so a view refresh does not make the next decision rebuild them."""
        new = Columns.__new__(Columns)
        new.states, new.ids = tuple(states), self.ids
        wait, running, load = self.wait.copy(), self.running.copy(), self.load.copy()
        free = self.free.copy()
        blocks_changed = False
        for i in indices:
            state = states[i]
            wait[i] = state.wait_s
            running[i] = state.running_requests
            load[i] = state.queue_depth + state.running_requests
            free[i] = state.free_kv_tokens
            blocks_changed = (
                blocks_changed or state.resident_blocks != self.states[i].resident_blocks
            )
        new.wait, new.running, new.load, new.free = wait, running, load, free
        new.min_free = min(free, default=0)
        new.has_resident = (
            any(s.resident_blocks for s in states) if blocks_changed else self.has_resident
        )
        new._arrays = None
        if self._arrays is not None:
            import numpy as np

            wait_array, free_array = self._arrays[0].copy(), self._arrays[1].copy()
            at = np.fromiter(indices, dtype=np.intp, count=len(indices))
            wait_array[at] = [wait[i] for i in indices]
            free_array[at] = [free[i] for i in indices]
            new._arrays = (wait_array, free_array)
        if blocks_changed:
            new._holders, new._narrowed, new._masks = {}, {}, {}
        else:
            new._holders, new._narrowed, new._masks = self._holders, self._narrowed, self._masks
        new._fans = dict(self._fans)  # re-summed with the new waits on first use
        new._by_wait = None
        new._index = self._index
        new._matrix = None
        return new

    def prepare(self, previous: Columns | None = None) -> None:
        """Build now what the first decision on these columns would otherwise build (a
        view refresh calls it, off the decision path): the arrays; and from `previous`,
        the columns these replace, when it lists the same instances in the same order,
        its path terms (they depend on paths alone, and are checked against the network
        before use, as always) and, when every instance holds the same prefix blocks as
        there, what was found from the blocks."""
        if previous is not None and previous is not self and previous.ids == self.ids:
            for src_id, fan in previous._fans.items():
                self._fans.setdefault(src_id, fan)
            if all(
                a is b or a.resident_blocks == b.resident_blocks
                for a, b in zip(previous.states, self.states, strict=True)
            ):
                self._holders, self._narrowed = previous._holders, previous._narrowed
                self._masks = previous._masks
        self.arrays()

    def matrix(self, network: NetworkModel, sources: Columns, now_s: float) -> PathMatrix:
        """Paths from every instance of `sources` to every instance here (one cached)."""
        cached = self._matrix
        if cached is None or cached[0] is not sources or not cached[1].valid(network, now_s):
            from kvrs._pathmatrix import PathMatrix  # numpy; only batch planning needs it

            cached = self._matrix = (sources, PathMatrix(network, sources.ids, self.ids, now_s))
        return cached[1]

    def index(self, instance_id: str) -> int | None:
        """Position of `instance_id` in the list, None when absent."""
        if self._index is None:
            self._index = {instance_id: i for i, instance_id in enumerate(self.ids)}
        return self._index.get(instance_id)

    def by_wait(self) -> list[int]:
        """Indices ordered by wait, then id."""
        if self._by_wait is None:
            self._by_wait = sorted(range(len(self.ids)), key=lambda i: (self.wait[i], self.ids[i]))
        return self._by_wait

    def holders(self, block_hash: int) -> frozenset[int]:
        """Indices of the instances holding one prefix block."""
        found = self._holders.get(block_hash)
        if found is None:
            if len(self._holders) >= _HOLDERS_CACHE_MAX:
                self._holders.clear()
            found = self._holders[block_hash] = frozenset(
                i for i, s in enumerate(self.states) if block_hash in s.resident_blocks
            )
        return found

    def _narrow(self, holding: frozenset[int], block_hash: int) -> frozenset[int]:
        """The instances of `holding` that also hold `block_hash`.

        Past a prompt's first block only the instances holding every block before it can
        go deeper, so only those are asked. The answer is cached per block with the set it
        narrowed: prompts sharing a prefix narrow the same (cached, so identical) sets.
        """
        cached = self._narrowed.get(block_hash)
        if cached is not None and cached[0] is holding:
            return cached[1]
        found = self._holders.get(block_hash)
        if found is not None:
            narrowed = holding & found
        else:
            states = self.states
            narrowed = frozenset(i for i in holding if block_hash in states[i].resident_blocks)
        if len(self._narrowed) >= _HOLDERS_CACHE_MAX:
            self._narrowed.clear()
        self._narrowed[block_hash] = (holding, narrowed)
        return narrowed

    def holder_mask(self, block_hash: int) -> np.ndarray:
        """A boolean array: which instances hold one prefix block."""
        found = self._masks.get(block_hash)
        if found is None:
            import numpy as np

            if len(self._masks) >= _HOLDERS_CACHE_MAX:
                self._masks.clear()
            found = self._masks[block_hash] = np.fromiter(
                (block_hash in s.resident_blocks for s in self.states),
                dtype=bool,
                count=len(self.states),
            )
        return found

    def hit_array(
        self, prefix_hashes: Sequence[int], prompt_tokens: int, block_tokens: int
    ) -> np.ndarray | None:
        """Prefix-hit tokens of every instance as an array; None when nobody has a hit."""
        if not prefix_hashes or not self.has_resident:
            return None
        holding = None
        blocks = None
        for block_hash in prefix_hashes[: -(-prompt_tokens // block_tokens)]:
            mask = self.holder_mask(block_hash)
            holding = mask if holding is None else holding & mask
            if not holding.any():
                break
            blocks = holding.astype(int) if blocks is None else blocks + holding
        if blocks is None:
            return None
        return (blocks * block_tokens).clip(max=prompt_tokens)

    def hits(
        self, prefix_hashes: Sequence[int], prompt_tokens: int, block_tokens: int
    ) -> dict[int, int]:
        """Prefix-hit tokens of every instance that has any (index → tokens)."""
        if not prefix_hashes or not self.has_resident:
            return {}
        # Holders of blocks 0..j shrink as j grows; each instance is written once, at the
        # deepest level it reaches.
        blocks = prefix_hashes[: -(-prompt_tokens // block_tokens)]
        levels: list[frozenset[int]] = []
        holding: frozenset[int] | None = None
        for block_hash in blocks:
            holding = (
                self.holders(block_hash) if holding is None else self._narrow(holding, block_hash)
            )
            if not holding:
                break
            levels.append(holding)
            if len(holding) == 1:
                break
        # The deepest level's depth; one instance left reads its own blocks on: a session's
        # continuation matches dozens of blocks on the one instance that served it.
        last_depth = len(levels)
        if levels and len(levels[-1]) == 1:
            last_depth += _leading(blocks, last_depth, self.states[next(iter(levels[-1]))])
        hits: dict[int, int] = {}
        deeper: frozenset[int] = frozenset()
        for depth in range(len(levels), 0, -1):
            reached = last_depth if depth == len(levels) else depth
            tokens = min(reached * block_tokens, prompt_tokens)
            level = levels[depth - 1]
            for i in level - deeper if deeper else level:
                hits[i] = tokens
            deeper = level
        return hits


def _leading(blocks: Sequence[int], start: int, state: InstanceState) -> int:
    """How many of `blocks`, from `start` on, `state` holds before its first miss."""
    resident = state.resident_blocks
    count = 0
    for block_hash in blocks[start:]:
        if block_hash not in resident:
            break
        count += 1
    return count


class WaitPlan(dict[str, float]):
    """Work a plan has queued per instance (seconds): a mapping, plus a log that the
    per-list waits replay.

    Grow it only with `add`; the other mutators raise, because the lists follow the log,
    not the dictionary.
    """

    def __init__(self) -> None:
        super().__init__()
        self._log: list[str] = []
        self._waits: dict[int, tuple[Columns, list[float], int]] = {}

    def add(self, instance_id: str, seconds: float) -> None:
        """`seconds` more work queued on `instance_id`."""
        dict.__setitem__(self, instance_id, self.get(instance_id, 0.0) + seconds)
        self._log.append(instance_id)

    def waits_for(self, columns: Columns) -> list[float]:
        """W(x) + the plan's work on x for every instance of `columns`, in its order.

        Each entry is computed as `wait + self.get(id, 0.0)`, exactly as from the mapping;
        only the entries the plan touched since the last call are recomputed. Decisions
        of the plan share the list: read it, never edit it.
        """
        log = self._log
        entry = self._waits.get(id(columns))
        if entry is None or entry[0] is not columns:
            waits = [w + self.get(i, 0.0) for w, i in zip(columns.wait, columns.ids, strict=True)]
            self._waits[id(columns)] = (columns, waits, len(log))
            return waits
        _, waits, seen = entry
        if seen < len(log):
            wait = columns.wait
            for instance_id in log[seen:]:
                i = columns.index(instance_id)
                if i is not None:
                    waits[i] = wait[i] + self[instance_id]
            self._waits[id(columns)] = (columns, waits, len(log))
        return waits


def refuse_edits(plan: type[dict[Any, Any]], grow: str) -> None:
    """Make every mutator of a plan but `grow` raise: what it caches follows its log."""

    def refusal(name: str) -> Any:
        def refuse(self: dict[Any, Any], *args: Any, **kwargs: Any) -> Any:
            raise TypeError(f"{type(self).__name__} grows only through {grow} ({name})")

        refuse.__name__ = name
        return refuse

    for name in (
        "__setitem__",
        "__delitem__",
        "update",
        "pop",
        "popitem",
        "clear",
        "setdefault",
        "__ior__",
    ):
        setattr(plan, name, refusal(name))


refuse_edits(WaitPlan, "add")
