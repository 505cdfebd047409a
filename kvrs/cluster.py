"""The snapshot of the cluster a decision sees: per-instance load, memory and cached prefixes."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvrs.topology import Role

__all__ = ["ClusterView", "InstanceList", "InstanceState"]

_LISTS_CACHE_MAX = 64


@dataclass(frozen=True)
class InstanceState:
    """One instance as gossip last reported it."""

    instance_id: str
    role: Role
    wait_s: float = 0.0
    """W(x): seconds of work queued ahead of a new request."""
    queue_depth: int = 0
    running_requests: int = 0
    running_context_tokens: int = 0
    """Tokens cached by its running decode streams, summed (each step reads them)."""
    free_kv_tokens: int = 2**62
    """Free KV memory, in tokens of the served model."""
    resident_blocks: frozenset[int] = frozenset()
    """Hashes of the prefix blocks whose KV the instance holds."""
    age_s: float = 0.0
    """How old this report is."""
    address: str = ""
    transfer_address: str = ""
    alive: bool = True
    max_batch_tokens: int = 0
    """Most new tokens one of its forward passes takes (the worker's token budget,
    `kvrs.passes`); 0: not reported, its queued work priced as one pass."""
    compute_factor: float = 1.0
    """How many times longer its forward passes run now than the decisions' compute
    profile prices them (its own recent passes timed against it); 1: as priced."""


class InstanceList(list[InstanceState]):
    """A read-only list of instances that carries caches derived from it.

    Views hand the same list to every decision, and placement caches per-list columns
    (waits, free memory, path terms) on it; both are only sound if nobody edits the
    list, so every mutating method raises. Copy it (`list(x)`, a comprehension) to edit.
    """

    __slots__ = ("_positions", "derived")

    def __init__(self, items: Iterable[InstanceState] = ()) -> None:
        super().__init__(items)
        self.derived: dict[Any, Any] = {}
        self._positions: dict[str, int] | None = None

    def positions(self) -> Mapping[str, int]:
        """Index of each instance id in the list (built once)."""
        if self._positions is None:
            self._positions = {s.instance_id: i for i, s in enumerate(self)}
        return self._positions


def _read_only(name: str) -> Any:
    def refuse(self: InstanceList, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"InstanceList is read-only ({name}); copy it with list() to edit")

    refuse.__name__ = name
    return refuse


for _name in (
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
    "__setitem__",
    "__delitem__",
    "__iadd__",
    "__imul__",
):
    setattr(InstanceList, _name, _read_only(_name))


@dataclass
class ClusterView:
    """Every instance's state at one moment, as one decision (or a batch of them) sees it.

    `instances` is stored read-only: a view is a snapshot, and the instance lists derived
    from it are cached. To change an instance, assign a new mapping (or build a new
    view, which is cheap) — never edit one in place.
    """

    instances: Mapping[str, InstanceState]
    now_s: float
    view_age_s: float = 0.0
    """Age of the oldest gossip the view is built from."""
    stale: bool = False
    """The view is older than the staleness bound (e.g. the gossip store is unreachable)."""
    derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """What decisions compute from `instances` alone, keyed by its owner; emptied with them."""
    _lists: dict[Any, InstanceList] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "instances":
            value = MappingProxyType(dict(value))
            self.__dict__.get("_lists", {}).clear()
            self.__dict__.get("derived", {}).clear()
        super().__setattr__(name, value)

    def decode_instances(self, exclude: Collection[str] = ()) -> InstanceList:
        """Alive decode instances, sorted by id, minus `exclude`."""
        return self._alive(Role.DECODE, exclude)

    def prefill_instances(self, exclude: Collection[str] = ()) -> InstanceList:
        """Alive prefill instances, sorted by id, minus `exclude`."""
        return self._alive(Role.PREFILL, exclude)

    def _alive(self, role: Role, exclude: Collection[str]) -> InstanceList:
        # Cached per exclusion set too: every request of a failed instance excludes it.
        key = (role, exclude if isinstance(exclude, frozenset) else frozenset(exclude))
        cached = self._lists.get(key)
        if cached is None:
            if len(self._lists) >= _LISTS_CACHE_MAX:
                # The exclusion sets' lists go; each role's full list keeps its columns.
                self._lists = {k: v for k, v in self._lists.items() if not k[1]}
            if key[1]:
                cached = InstanceList(
                    s for s in self._alive(role, ()) if s.instance_id not in key[1]
                )
            else:
                cached = InstanceList(
                    sorted(
                        (s for s in self.instances.values() if s.alive and s.role is role),
                        key=lambda s: s.instance_id,
                    )
                )
            self._lists[key] = cached
        return cached

    def updated(
        self,
        changed: Mapping[str, InstanceState],
        removed: Collection[str] = (),
        now_s: float | None = None,
        carry_exclusions: bool = False,
    ) -> ClusterView:
        """A new view: these instances with `changed` replaced or added, `removed` dropped.

        For each role whose alive membership stays the same, the new list is the old one
        with the changed states swapped in, and what decisions derived from the old list
        is carried over, patched at those positions (whatever offers `patched`, such as
        the placement columns); so the first decision on the new view does not rebuild
        every column. A list whose membership changed is rebuilt when next asked for.

        With `carry_exclusions` the lists minus an exclusion set (a failed instance's
        recoveries) are carried the same way: work booked between two recoveries of one
        failure must not make the next rebuild its path terms. Without it they are
        dropped, so that a list no decision asks for again is not patched at every
        refresh.
        """
        instances = dict(self.instances)
        instances.update(changed)
        for instance_id in removed:
            instances.pop(instance_id, None)
        view = ClusterView(instances=instances, now_s=self.now_s if now_s is None else now_s)
        for (role, exclude), old in self._lists.items():
            if exclude and not carry_exclusions:
                continue
            patched = self._patched_list(old, role, exclude, changed, removed)
            if patched is not None:
                view._lists[(role, exclude)] = patched
        return view

    def _patched_list(
        self,
        old: InstanceList,
        role: Role,
        exclude: frozenset[str],
        changed: Mapping[str, InstanceState],
        removed: Collection[str],
    ) -> InstanceList | None:
        """`old` (this view's alive list of `role` minus `exclude`) with `changed` swapped
        in; None when an instance joins or leaves the list (it is rebuilt instead)."""

        def listed(state: InstanceState | None) -> bool:
            return (
                state is not None
                and state.alive
                and state.role is role
                and state.instance_id not in exclude
            )

        for instance_id in removed:
            if listed(self.instances.get(instance_id)):
                return None
        positions = old.positions()
        indices = []
        for instance_id, state in changed.items():
            was_in = listed(self.instances.get(instance_id))
            if was_in != listed(state):
                return None
            if was_in:
                indices.append(positions[instance_id])
        if not indices:
            return old
        items = list(old)
        for i in indices:
            items[i] = changed[items[i].instance_id]
        patched = InstanceList(items)
        patched._positions = old._positions
        for owner, derived in old.derived.items():
            patch = getattr(derived, "patched", None)
            if patch is not None:
                patched.derived[owner] = patch(patched, indices)
        return patched

    def get(self, instance_id: str) -> InstanceState | None:
        """The state of `instance_id`, None when the view does not know it."""
        return self.instances.get(instance_id)
