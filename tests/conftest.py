"""Fixtures shared by every test: the real Redis, isolated per test by a key prefix, and
development TLS certificates."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import redis

from tests.redis_cluster import LocalRedisCluster

REDIS_URL = os.environ.get("KVRS_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis every service test uses; a missing Redis fails the run, it is not skipped."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"Redis is required at {REDIS_URL} (start redis-server): {exc}")
    finally:
        client.close()
    return REDIS_URL


def _isolated_prefix(redis_url: str):
    """A fresh hash-tagged key prefix; every key under it, or under a shard of it
    (`{kvrs-test-....3}:`), is deleted afterwards.

    Tests share one Redis database, so they isolate by prefix rather than FLUSHDB, which
    would wipe a concurrently running test's keys.
    """
    tag = f"kvrs-test-{uuid.uuid4().hex[:12]}"
    prefix = f"{{{tag}}}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{{{tag}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def shared_redis_cluster(tmp_path_factory):
    """A Redis Cluster (three primaries, a replica each, on loopback) for the tests that
    run both on one Redis and on a cluster; started when first asked for, and every
    `redis-server` of it stopped after the session. Tests isolate on it by prefix."""
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=("one-redis", "redis-cluster"))
def any_redis_url(request, redis_url: str) -> str:
    """The Redis a test runs on: once on one Redis, once on the session's three-primary
    Redis Cluster (started when first asked for)."""
    if request.param == "redis-cluster":
        return request.getfixturevalue("shared_redis_cluster").url
    return redis_url


@pytest.fixture
def redis_prefix(redis_url: str):
    """A key prefix of one test (see `_isolated_prefix`)."""
    yield from _isolated_prefix(redis_url)


@pytest.fixture(scope="module")
def module_redis_prefix(redis_url: str):
    """A key prefix for a module's cluster, emptied after the module (and the cluster)."""
    yield from _isolated_prefix(redis_url)


@pytest.fixture(scope="session")
def session_redis_prefix(redis_url: str):
    """A key prefix for a session-wide cluster, emptied after the session."""
    yield from _isolated_prefix(redis_url)


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    """deploy/gen-certs.sh's CA, server certificate (localhost, 127.0.0.1) and client
    certificate, as {ca,server,client}.{pem,key}."""
    out = tmp_path_factory.mktemp("certs")
    script = Path(__file__).resolve().parents[1] / "deploy" / "gen-certs.sh"
    subprocess.run(["bash", str(script), str(out)], check=True, capture_output=True)
    return out
