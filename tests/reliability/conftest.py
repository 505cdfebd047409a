"""Control planes shared by a module's property tests (started once, torn down after)."""

from __future__ import annotations

import pytest
from reliability_stack import ControlPlane, unique_prefix


@pytest.fixture(scope="module")
def gossip_plane(redis_url):
    """A gossip store alone on its own prefix: its properties may register anything."""
    plane = ControlPlane(redis_url, unique_prefix("gossip")).start(services=("gossip",))
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def plane(redis_url):
    """Gossip, slot broker (cap 4), cost oracle and scheduler over one registered cluster."""
    plane = ControlPlane(redis_url, unique_prefix("plane")).start()
    yield plane
    plane.stop()
