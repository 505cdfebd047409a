"""Fast construction of frozen dataclasses on decision hot paths."""

from __future__ import annotations

from typing import TypeVar

_T = TypeVar("_T")


def build(cls: type[_T], **values: object) -> _T:
    """A frozen dataclass instance made without its generated `__init__`.

    That `__init__` sets each field through `object.__setattr__`, which costs about as
    much as the rest of a decision; decisions build several results per request from
    values they computed themselves, so they fill the instance dictionary directly. The
    caller passes every field (no defaults, no `__post_init__` checks are applied).
    """
    instance = object.__new__(cls)
    instance.__dict__.update(values)
    return instance
