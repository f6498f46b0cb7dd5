"""A cluster's first write and the checks every process makes of it: the schema version
and the peer-to-peer secret (``ensure_cluster``, ``cluster_secret``), and which clusters
one Redis holds (``known_clusters``)."""

from __future__ import annotations

import secrets

import redis
import redis.asyncio

from redisdask.store.keyspace import SCHEDULER_GROUP, SCHEMA_VERSION, Keys


def ensure_cluster(client: redis.Redis, keys: Keys) -> bytes:
    """Create the cluster's meta hash, secret and consumer groups if missing.

    Idempotent, so the scheduler and workers may start in any order (clients and the
    read-only tools never create a cluster: see ``cluster_secret``).  Returns the cluster
    secret used to authenticate peer-to-peer connections.  Raises ``SchemaError`` when the
    cluster was created by an incompatible version of redisdask.

    The secret lives in a key of its own (``Keys.secret``), which the ``monitor`` ACL role
    is not given: whoever holds it can make a worker unpickle.  A cluster created before
    that kept it in ``meta``; the first scheduler or worker to start moves it (the same
    value, so processes already connected keep talking) and deletes the readable copy.
    """
    pipe = client.pipeline(transaction=True)
    pipe.hsetnx(keys.meta, "schema_version", SCHEMA_VERSION)
    pipe.hmget(keys.meta, ["schema_version", "secret"])
    version, legacy = pipe.execute()[-1]
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.secret, legacy or secrets.token_hex(32), nx=True)
    pipe.get(keys.secret)
    if legacy is not None:
        pipe.hdel(keys.meta, "secret")
    secret = pipe.execute()[1]
    for stream in (keys.client_stream, keys.worker_stream):
        try:
            client.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
    return _checked_secret(keys, version, secret)


async def cluster_secret(client: redis.asyncio.Redis, keys: Keys) -> bytes | None:
    """The secret of an existing cluster, or None when no scheduler or worker ever created
    one under this name (nothing is written: a mistyped name leaves no keys behind)."""
    pipe = client.pipeline(transaction=False)
    pipe.hget(keys.meta, "schema_version")
    pipe.get(keys.secret)
    version, secret = await pipe.execute()
    if version is None or secret is None:
        return None
    return _checked_secret(keys, version, secret)


def known_clusters(client: redis.Redis, limit: int = 20) -> list[str]:
    """Names of the clusters on this Redis (for error messages), at most ``limit``."""
    names: set[str] = set()
    for key in client.scan_iter(match="rd:{*}:meta", count=1000):
        raw = key.decode() if isinstance(key, bytes) else key
        names.add(raw[len("rd:{") : -len("}:meta")])
        if len(names) >= limit:
            break
    return sorted(names)


def _checked_secret(keys: Keys, version: bytes | str, secret: bytes | str) -> bytes:
    from redisdask.errors import SchemaError

    if int(version) != SCHEMA_VERSION:
        raise SchemaError(
            f"cluster {keys.cluster!r} in Redis has schema version {int(version)}, this "
            f"redisdask speaks version {SCHEMA_VERSION}: use a matching redisdask or another "
            "--cluster name"
        )
    return bytes.fromhex(secret.decode() if isinstance(secret, bytes) else secret)
