"""Hypothesis strategies for hostile requests: empty, unknown, huge, NaN, out of range.

`mutated(valid, hostile)` starts from a request the server accepts and replaces one to
three of its fields with hostile values, so every example gets past the first checks and
reaches the deeper ones (a random request would almost always stop at "empty id").
"""

from __future__ import annotations

import math

from google.protobuf.message import Message
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64_MAX = 2**64 - 1
LONG_TEXT_CHARS = 4096

PROPERTY_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
"""CI settings: a fixed, repeatable sample (no flakes, no example database on disk)."""


def ids(known: tuple[str, ...]) -> st.SearchStrategy[str]:
    """Ids: known ones (half the time), empty, unknown, odd characters, very long."""
    return st.one_of(
        st.sampled_from(known),
        st.sampled_from(["", " ", "{kvrs}:", "a:b", "*", "\x00", "ééé", "unknown-7"]),
        st.text(max_size=24),
        st.integers(LONG_TEXT_CHARS, 4 * LONG_TEXT_CHARS).map(lambda n: "x" * n),
    )


def int32s() -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from([INT32[0], INT32[1], -1, 0, 1]),
        st.integers(-4, 4096),
        st.integers(*INT32),
    )


def int64s() -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from([INT64[0], INT64[1], 2**53 + 1, 2**40, 2**31, -1, 0, 1]),
        st.integers(-4, 1_000_000),
        st.integers(*INT64),
    )


def doubles() -> st.SearchStrategy[float]:
    return st.one_of(
        st.sampled_from(
            [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 1e20, 1e-9, -1.0]
        ),
        st.floats(-10.0, 1e4),
        st.floats(allow_nan=True, allow_infinity=True),
    )


def enums(valid: tuple[int, ...]) -> st.SearchStrategy[int]:
    """Proto3 enums are open: a client may send any int32."""
    return st.one_of(st.sampled_from(valid), st.integers(-3, 12), st.sampled_from(INT32))


def uint64_lists(max_size: int = 40) -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.lists(
            st.one_of(st.integers(0, 2**20), st.sampled_from([0, UINT64_MAX, 2**63])),
            max_size=max_size,
        ),
        st.just(list(range(20_000))),
    )


def id_lists(known: tuple[str, ...], max_size: int = 6) -> st.SearchStrategy[list[str]]:
    return st.lists(ids(known), max_size=max_size)


def set_field(message: Message, path: str, value) -> None:
    """Sets "a" or "a.b" on `message`, whatever the field's kind (scalar, list, message)."""
    *parents, name = path.split(".")
    for parent in parents:
        message = getattr(message, parent)
    field = message.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        del getattr(message, name)[:]
        getattr(message, name).extend(value)
    elif field.message_type is not None:
        getattr(message, name).CopyFrom(value)
    else:
        setattr(message, name, value)


def mutated(
    valid: Message, hostile: dict[str, st.SearchStrategy], max_fields: int = 3
) -> st.SearchStrategy[Message]:
    """`valid` with 1..max_fields of the `hostile` fields replaced."""

    @st.composite
    def build(draw) -> Message:
        names = draw(
            st.lists(st.sampled_from(sorted(hostile)), min_size=1, max_size=max_fields, unique=True)
        )
        message = type(valid)()
        message.CopyFrom(valid)
        for name in names:
            set_field(message, name, draw(hostile[name]))
        return message

    return build()
