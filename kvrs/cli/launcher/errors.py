"""The one exception the launcher raises; its message says what to do."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The local cluster could not be started, found or stopped; the message says why."""
