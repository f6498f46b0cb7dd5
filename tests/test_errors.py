"""The error tree, the client's Redis boundary, and the one backoff helper."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import time

import pytest
import redis

import redisdask
import redisdask.nanny
import redisdask.workers
from redisdask import errors
from redisdask.client import Client
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.errors import ClusterConnectionError, RedisDaskError
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.keyspace import Keys
from redisdask.utils.backoff import Backoff

pytestmark = pytest.mark.timeout(120)


def _public_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class a redisdask module defines under a public name."""
    found: dict[str, type[BaseException]] = {}
    # workers/ and nanny/ are mapped into the package (editable installs: by a finder)
    names = [
        info.name
        for package in (redisdask, redisdask.workers, redisdask.nanny)
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
        if not info.name.endswith("__main__")  # (runs the CLI)
    ]
    for name in names:
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and not attr.startswith("_")
            ):
                found[f"{module.__name__}.{attr}"] = obj
    return found


def test_every_public_error_is_a_redisdask_error_drawn_in_the_tree() -> None:
    found = _public_exceptions()
    assert "redisdask.comm.errors.CommClosedError" in found  # the walk reaches every module
    assert "redisdask.workers.transitions.InvalidTaskState" in found
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, RedisDaskError))
    assert outside == []
    tree = errors.__doc__ or ""
    drawn = [n for n in found if f"── {n.rsplit('.', 1)[1]} " in tree]
    assert sorted(set(found) - set(drawn)) == ["redisdask.errors.RedisDaskError"]  # the root


def test_errors_keep_their_builtin_bases_and_old_import_locations() -> None:
    from redisdask.config import ConfigError
    from redisdask.deploy.embedded import EmbeddedRedisError, RedisServerNotFound

    assert ConfigError is errors.ConfigError and issubclass(ConfigError, ValueError)
    assert EmbeddedRedisError is errors.EmbeddedRedisError
    assert issubclass(EmbeddedRedisError, RuntimeError)
    assert RedisServerNotFound is errors.RedisServerNotFound
    assert issubclass(RedisServerNotFound, FileNotFoundError)
    assert issubclass(ClusterConnectionError, ConnectionError)
    assert not issubclass(ClusterConnectionError, redis.RedisError)


def test_client_reads_raise_cluster_connection_error_when_redis_stops() -> None:
    """A stopped Redis: the client's reads say so with ClusterConnectionError, naming
    the URL without its password, never with a raw redis-py error."""
    with EmbeddedRedis() as server:
        ensure_cluster(server.client(), Keys("default"))  # as a scheduler that stopped leaves it
        server.client().config_set("requirepass", "s3cret")
        client = Client(f"redis://:s3cret@127.0.0.1:{server.port}/0", set_as_default=False)
        try:
            future = client.submit(sum, [1, 2])  # no scheduler: it stays pending
            assert client.who_has(future) == {future.key: []}
            server.stop()
            for call in (lambda: client.who_has(future), client.scheduler_info):
                with pytest.raises(ClusterConnectionError) as info:
                    call()
                message = str(info.value)
                assert f"127.0.0.1:{server.port}" in message and "s3cret" not in message
                assert "Is redis-server still running" in message
                assert isinstance(info.value.__cause__, redis.ConnectionError)
        finally:
            client.close()  # with Redis gone: logged, not raised


# --------------------------------------------------------------------------- backoff


def test_backoff_doubles_from_base_to_cap_within_equal_jitter() -> None:
    backoff = Backoff(base=0.05, cap=2.0)
    for failures in range(12):
        ceiling = min(2.0, 0.05 * 2**failures)
        delay = backoff.next()
        assert ceiling / 2 <= delay <= ceiling, (failures, delay)
    assert backoff.failures == 12


def test_backoff_jitters() -> None:
    delays = set()
    for _ in range(20):
        backoff = Backoff(base=1.0, cap=8.0)
        backoff.next()
        delays.add(backoff.next())  # the second delay: in [1, 2]
    assert len(delays) > 1
    assert all(1.0 <= d <= 2.0 for d in delays)


def test_backoff_reset_starts_from_base_again() -> None:
    backoff = Backoff(base=0.2, cap=10.0)
    for _ in range(10):
        backoff.next()
    backoff.reset()
    assert backoff.failures == 0
    assert 0.1 <= backoff.next() <= 0.2


def test_backoff_waits_for_hours_without_overflow() -> None:
    backoff = Backoff(base=0.05, cap=2.0)
    start = time.perf_counter()
    for _ in range(5000):  # 2**5000 would overflow a float
        delay = backoff.next()
    assert 1.0 <= delay <= 2.0
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_backoff_refuses_nonsense(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="base <= cap"):
        Backoff(base=base, cap=cap)
