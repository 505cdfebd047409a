"""The router's short memory of instances it could not reach."""

from __future__ import annotations

from services.router.unreachable import Unreachable


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_an_instance_is_avoided_for_its_hold_and_no_longer() -> None:
    clock = Clock()
    unreachable = Unreachable(clock)
    unreachable.note("decode-0", 2.0)
    unreachable.note("decode-1", 5.0)
    clock.now_s += 1.9
    assert unreachable.current() == {"decode-0", "decode-1"}
    clock.now_s += 0.1
    assert unreachable.current() == {"decode-1"}
    clock.now_s += 3.0
    assert unreachable.current() == frozenset()


def test_a_later_break_extends_the_hold_and_a_shorter_one_does_not_cut_it() -> None:
    clock = Clock()
    unreachable = Unreachable(clock)
    unreachable.note("decode-0", 2.0)
    clock.now_s += 1.5
    unreachable.note("decode-0", 2.0)
    unreachable.note("decode-0", 0.1)
    clock.now_s += 1.5
    assert unreachable.current() == {"decode-0"}
    clock.now_s += 0.5
    assert unreachable.current() == frozenset()
