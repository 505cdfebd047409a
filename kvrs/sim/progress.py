"""A one-line progress bar on stderr for long runs (no dependency, silent when not a TTY)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Redraws `label [#####.....] 52% 2076/3993 1.2s` at most every `interval_s`."""

    def __init__(
        self,
        total: int,
        label: str = "",
        stream: TextIO | None = None,
        interval_s: float = 0.5,
        width: int = 30,
        force: bool = False,
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = force or getattr(self.stream, "isatty", lambda: False)()
        self.interval_s = interval_s
        self.width = width
        self.done = 0
        self._started = time.monotonic()
        self._drawn = 0.0

    def advance(self, count: int = 1) -> None:
        self.done += count
        if self.enabled:
            now = time.monotonic()
            if now - self._drawn >= self.interval_s or self.done >= self.total:
                self._drawn = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        share = min(1.0, self.done / self.total)
        filled = int(share * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {share:4.0%} {self.done}/{self.total} "
            f"{now - self._started:.1f}s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
