"""The ACL roles of ``redisdask acl`` (redisdask/store/acl.py, docs/security.md), against a real
redis-server: every process runs as its own role's user and does real work, each role
is refused what it must not do, and a ``monitor`` user, reading all it can, cannot make
a worker unpickle anything."""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import ClusterFactory
from polling import poll

from redisdask import Client, Event, Lock, Queue, Variable, comm, get_client, secede
from redisdask.scheduler.driver import Scheduler
from redisdask.store.acl import (
    FAMILIES,
    READ_ONLY_SINCE,
    ROLES,
    allows_key,
    allows_write,
    default_user,
    parse_version,
    setuser,
    setuser_args,
)
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import Scripts

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------- the rules themselves


def every_key_name(keys: Keys) -> list[str]:
    """One name of each kind ``Keys`` makes (properties and methods)."""
    names = []
    for attr in dir(Keys):
        if attr.startswith("_") or attr in ("cluster", "prefix", "task_prefix"):
            continue
        value = getattr(keys, attr)
        if callable(value):
            if attr.endswith("connection"):  # CLIENT SETNAME names, not keys
                continue
            if attr in ("coordination", "waiters", "signal"):
                names += [value(kind, "n") for kind in ("lock", "semaphore", "event",
                                                         "variable", "queue")]  # fmt: skip
            else:
                names.append(value("tcp://127.0.0.1:1"))
        else:
            names.append(value)
    return names


def test_every_key_is_in_a_family_and_only_the_secret_is_hidden_from_the_monitor() -> None:
    keys = Keys("c")
    names = every_key_name(keys)
    assert keys.secret in names and len(names) > 30
    for name in names:
        assert allows_key("scheduler", "c", name), name
        assert allows_key("monitor", "c", name) == (name != keys.secret), name
    assert len(set(FAMILIES.values())) == len(FAMILIES)
    for role in ("worker", "client"):
        assert not allows_key(role, "c", keys.lease) and not allows_key(role, "c", keys.lease_token)
        assert allows_key(role, "c", keys.secret) and allows_key(role, "c", keys.leader)
    for role in ROLES:  # nothing of another cluster
        assert not allows_key(role, "c", Keys("d").meta)
        assert not allows_key(role, "c", "other")


def test_the_acl_command_prints_setuser_lines(tmp_path: Path) -> None:
    env = {**os.environ, "PW": 'a b"c'}
    out = subprocess.run(
        [sys.executable, "-m", "redisdask", "acl", "all", "--cluster", "c", "--password-env", "PW"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[2] for line in lines] == [default_user(r, "c") for r in ROLES]
    assert lines[3] == setuser("monitor", "c", password='a b"c')
    assert '">a b\\"c"' in lines[3] and "~rd:{c}:secret" not in lines[3]
    bad = subprocess.run(
        [sys.executable, "-m", "redisdask", "acl", "client", "--password-env", "NOPE_NOT_SET"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "NOPE_NOT_SET" in bad.stderr


# ---------------------------------------------------------------- a cluster of users


class Users:
    def __init__(self, url: str, cluster: str) -> None:
        self.url, self.cluster = url, cluster
        self.passwords = {role: uuid.uuid4().hex for role in ROLES}
        admin = redis.Redis.from_url(url)
        self.version = parse_version(admin.info("server")["redis_version"])
        for role in ROLES:
            admin.execute_command(
                *setuser_args(role, cluster, password=self.passwords[role], version=self.version)
            )
        admin.close()

    def name(self, role: str) -> str:
        return default_user(role, self.cluster)

    def env(self, role: str) -> dict[str, str]:
        """The environment a process of ``role`` runs with: credentials not on argv."""
        return {**os.environ, "REDISDASK__REDIS__USERNAME": self.name(role),
                "REDISDASK__REDIS__PASSWORD": self.passwords[role]}  # fmt: skip

    def redis(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(
            self.url, username=self.name(role), password=self.passwords[role]
        )

    def client(self, **kwargs: Any) -> Client:
        return Client(
            self.url, self.cluster, redis={"username": self.name("client"),
                                           "password": self.passwords["client"]}, **kwargs
        )  # fmt: skip

    def denials(self) -> list[dict[str, Any]]:
        """ACL LOG entries of this cluster's users (the log is server-wide)."""
        admin = redis.Redis.from_url(self.url)
        try:
            entries = admin.acl_log(count=1000)
        finally:
            admin.close()
        ours = {self.name(role) for role in ROLES}
        return [e for e in entries if e.get("username") in ours]

    def delete(self) -> None:
        admin = redis.Redis.from_url(self.url)
        admin.execute_command("ACL", "DELUSER", *(self.name(r) for r in ROLES))
        admin.close()


@pytest.fixture
def users(redis_url: str, cluster_name: str) -> Iterator[Users]:
    u = Users(redis_url, cluster_name)
    yield u
    u.delete()


def spawn(users: Users, role: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "redisdask", *args, users.url, "--cluster", users.cluster]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=users.env(role), stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def acl_cluster(users: Users, tmp_path: Path) -> Iterator[Users]:
    """A scheduler, a nanny with its worker and a bare worker, each as its role's user."""
    procs = [
        spawn(users, "scheduler", "scheduler", log=tmp_path / "scheduler.log"),
        spawn(users, "worker", "worker", "--nthreads", "2", log=tmp_path / "nanny.log"),
        spawn(users, "worker", "worker", "--no-nanny", "--nthreads", "2",
              log=tmp_path / "worker.log"),
    ]  # fmt: skip
    admin = redis.Redis.from_url(users.url)
    keys = Keys(users.cluster)

    def running() -> bool:
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, [(p.args, (tmp_path / "scheduler.log").read_text()) for p in dead]
        return admin.hlen(keys.workers) == 2 and bool(admin.exists(keys.lease))

    try:
        poll(running, timeout=60)
        yield users
    finally:
        # the workers first: SIGTERM retires them, and the scheduler tells them to close
        # (without it, each would wait out its 20 s grace period)
        for group in (procs[1:], procs[:1]):
            for p in group:
                p.terminate()
            for p in group:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        admin.close()
        logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
        assert "NOPERM" not in logs and "no permissions" not in logs, logs[-4000:]


def inc(x: int) -> int:
    return x + 1


def fan_out(n: int) -> int:
    """A task that is a client: tasks in tasks, and the coordination primitives."""
    client = get_client()
    with Lock("acl-lock"):
        Variable("acl-var").set(n)
        Queue("acl-queue").put(n)
    futures = client.map(inc, range(n))
    secede()
    total = sum(client.gather(futures))
    Event("acl-done").set()
    return total


def test_every_process_runs_as_its_role_and_does_real_work(acl_cluster: Users) -> None:
    users = acl_cluster
    with users.client() as client:
        assert client.submit(inc, 1).result(timeout=60) == 2
        assert sum(client.gather(client.map(inc, range(50)))) == sum(range(1, 51))
        assert client.submit(fan_out, 10).result(timeout=60) == sum(range(1, 11))
        assert Event("acl-done").wait(timeout=10)
        assert Variable("acl-var").get(timeout=10) == 10
        assert Queue("acl-queue").get(timeout=10) == 10
        [big] = client.scatter([list(range(10_000))])
        assert client.submit(len, big).result(timeout=60) == 10_000
        client.publish_dataset(acl_data=big)
        assert client.get_dataset("acl_data").result(timeout=60)[-1] == 9_999
        client.unpublish_dataset("acl_data")
        assert len(client.scheduler_info()["workers"]) == 2
        key = client.submit(inc, 41).key
        # the read-only tools, as the monitor user
        for args in (["status"], ["inspect", "keys"], ["inspect", "events"],
                     ["inspect", "task", key], ["inspect", "deaths"]):  # fmt: skip
            out = subprocess.run(
                [sys.executable, "-m", "redisdask", *args, users.url, "--cluster", users.cluster],
                env=users.env("monitor"), capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 0, (args, out.stdout, out.stderr)
    # refused nothing but the secret, to the monitor (inspect keys counts every key)
    refusals = {(e["username"], e["object"]) for e in users.denials()}
    assert refusals <= {(users.name("monitor"), Keys(users.cluster).secret)}, refusals


# ---------------------------------------------------------------- what each role may not do


def refused(call: Any) -> bool:
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    except redis.ResponseError as exc:  # NOPERM inside a script
        return "NOPERM" in str(exc) or "no permissions" in str(exc)
    return False


def test_each_role_is_refused_what_it_must_not_do(acl_cluster: Users) -> None:
    users, keys = acl_cluster, Keys(acl_cluster.cluster)
    monitor = users.redis("monitor")
    assert monitor.hgetall(keys.meta)  # it reads...
    assert refused(lambda: monitor.get(keys.secret))  # ...but not the secret
    for write in (
        lambda: monitor.set(keys.prefix + "x", 1),
        lambda: monitor.hset(keys.meta, "schema_version", 2),
        lambda: monitor.xadd(keys.client_stream, {"m": b"x"}),
        lambda: monitor.delete(keys.lease),
        lambda: monitor.script_load("return 1"),
        lambda: monitor.evalsha("0" * 40, 0),
        lambda: monitor.eval("return 1", 0),
        lambda: monitor.flushall(),
        lambda: monitor.config_set("appendonly", "no"),
        lambda: monitor.publish("x", "y"),
    ):
        assert refused(write)
    client = users.redis("client")
    assert client.get(keys.secret) and client.exists(keys.leader)
    for write in (
        lambda: client.set(keys.lease, 999),
        lambda: client.delete(keys.lease),
        lambda: client.incr(keys.lease_token),
        lambda: Scripts(client, keys).acquire_lease(token=None, ttl_ms=1000),
        lambda: client.xadd(keys.worker_stream, {"m": b"x"}),  # not a worker
        lambda: client.zadd(keys.ready, {"k": 1}),
        lambda: client.get(Keys("other").secret),  # another cluster
        lambda: client.flushall(),
        lambda: client.client_list(),
    ):
        assert refused(write)
    worker = users.redis("worker")
    assert refused(lambda: worker.set(keys.lease, 999))
    assert refused(lambda: worker.client_kill_filter(_type="normal"))
    scheduler = users.redis("scheduler")
    assert refused(lambda: scheduler.flushall())
    assert refused(lambda: scheduler.get(Keys("other").lease))
    assert refused(lambda: scheduler.execute_command("ACL", "LIST"))
    assert scheduler.execute_command("WAIT", 0, 0) == 0  # redis.wait-replicas
    for r in (monitor, client, worker, scheduler):
        r.close()


def test_a_client_user_cannot_write_what_it_only_reads(users: Users) -> None:
    """Another worker's inbox, ``ready`` zset and ``alive`` key, a task record, another
    client's events stream (whose ``task-erred`` entries that client unpickles): a client
    user reads them and writes none.  Its own ``alive`` and ``written`` keys it writes."""
    if users.version < READ_ONLY_SINCE:
        pytest.skip("Redis 6.2 has no read-only key patterns (%R~): docs/security.md says "
                    "what its client role may write")  # fmt: skip
    keys, worker = Keys(users.cluster), "tcp://127.0.0.1:9"
    admin = redis.Redis.from_url(users.url)
    admin.xadd(keys.worker_inbox(worker), {"m": b"x"})
    admin.zadd(keys.worker_ready(worker), {"k": 1})
    admin.set(keys.worker_alive(worker), 1)
    admin.xadd(keys.client_events("another"), {"m": b"x"})
    admin.hset(keys.task("k"), "state", "memory")
    client = users.redis("client")
    assert client.xlen(keys.worker_inbox(worker)) == 1 and client.get(keys.worker_alive(worker))
    assert client.zcard(keys.worker_ready(worker)) == 1
    assert client.xrange(keys.client_events("another"))  # (its own, by the same pattern)
    assert client.hget(keys.task("k"), "state") == b"memory"
    for write in (
        lambda: client.xadd(keys.worker_inbox(worker), {"m": b"x"}),
        lambda: client.delete(keys.worker_inbox(worker)),
        lambda: client.zadd(keys.worker_ready(worker), {"k": 2}),
        lambda: client.set(keys.worker_alive(worker), 1, px=60_000),
        lambda: client.xadd(keys.client_events("another"), {"m": pickle.dumps(ValueError())}),
        lambda: client.hset(keys.task("k"), "state", "erred"),
        lambda: client.delete(keys.client_wants("another")),
    ):
        assert refused(write)
    assert client.set(keys.client_alive("mine"), 1, px=1000)
    assert client.delete(keys.client_alive("mine"), keys.client_written("mine")) >= 0
    for name in (keys.worker_inbox(worker), keys.client_events("another"), keys.task("k")):
        assert not allows_write("client", users.cluster, name, users.version)
    assert allows_write("client", users.cluster, keys.client_stream, users.version)
    client.close()
    admin.close()


def test_on_redis_6_2_the_client_role_may_write_what_it_reads() -> None:
    """What docs/security.md says remains possible on 6.2: one pattern reads and writes."""
    keys = Keys("c")
    for name in (keys.worker_inbox("w"), keys.client_events("another"), keys.task("k")):
        assert allows_write("client", "c", name, (6, 2))
        assert not allows_write("client", "c", name, (7, 0))
    assert "%R~" not in setuser("client", "c", version=(6, 2))


# ---------------------------------------------------------------- the attack


class Planted:
    """Unpickling this creates a file: the evidence of code run by the unpickler."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def read_everything(r: redis.Redis, keys: Keys) -> list[bytes]:
    """Every value the user can read in the cluster: what an attacker would collect."""
    values: list[bytes] = []
    for name in r.scan_iter(match=keys.prefix + "*", count=1000):
        try:
            kind = r.type(name).decode()
            if kind == "string":
                values.append(r.get(name))
            elif kind == "hash":
                for field, value in r.hgetall(name).items():
                    values += [field, value]
            elif kind == "set":
                values += list(r.smembers(name))
            elif kind == "zset":
                values += [m for m, _ in r.zrange(name, 0, -1, withscores=True)]
            elif kind == "list":
                values += r.lrange(name, 0, -1)
            elif kind == "stream":
                for _, fields in r.xrange(name):
                    values += list(fields.values())
        except redis.exceptions.NoPermissionError:
            assert name.decode() == keys.secret, name  # the only key refused
    return [v for v in values if v]


def test_a_monitor_user_cannot_make_a_worker_unpickle(acl_cluster: Users, tmp_path: Path) -> None:
    users, keys = acl_cluster, Keys(acl_cluster.cluster)
    with users.client() as client:  # some state to read: results, tasks, events
        assert client.submit(inc, 1).result(timeout=60) == 2
        monitor = users.redis("monitor")
        values = read_everything(monitor, keys)
        admin = redis.Redis.from_url(users.url)
        secret_hex = admin.get(keys.secret)
        admin.close()
        assert len(values) > 20 and secret_hex
        assert not any(secret_hex in v for v in values)  # nowhere the monitor can read
        assert monitor.hget(keys.meta, "secret") is None
        addresses = [a.decode() for a in monitor.hkeys(keys.workers)]
        assert len(addresses) == 2
        # every 32-byte hex string it found, and the raw values, tried as the secret
        candidates = {bytes.fromhex(v.decode()) for v in values
                      if re.fullmatch(rb"[0-9a-f]{64}", v)}  # fmt: skip
        candidates |= {v for v in values if 16 <= len(v) <= 128}
        evidence = tmp_path / "pwned"
        payload = pickle.dumps(Planted(str(evidence)))
        for address in addresses:
            for candidate in list(candidates)[:200]:
                with pytest.raises(comm.AuthenticationError):
                    comm.BlockingConnection(address, candidate, timeout=5)
            # without a handshake: a wrong answer, then a pickle, as put-data would carry
            host, port = comm.parse_address(address)
            with socket.create_connection((host, port), timeout=5) as sock:
                hello = sock.recv(64)
                assert hello.startswith(b"RDK1")
                sock.sendall(b"RDK1" + os.urandom(64))
                try:
                    sock.sendall(payload * 10)
                    assert sock.recv(64) == b""  # closed on us, nothing answered
                except (ConnectionResetError, BrokenPipeError):
                    pass
        assert not evidence.exists()
        # and nothing it could write for a worker or a client to unpickle: it writes nothing
        assert refused(lambda: monitor.hset(keys.task("x"), "spec", payload))
        assert refused(lambda: monitor.hset(keys.worker_plugins, "p", payload))
        assert refused(lambda: monitor.hset(keys.uploads, "u", payload))
        assert refused(lambda: monitor.xadd(keys.client_events("c"), {"m": payload}))
        # the cluster still works
        assert client.submit(inc, 2).result(timeout=60) == 3
        monitor.close()
    assert not evidence.exists()


def test_a_refused_wait_counts_as_unreplicated_and_the_scheduler_goes_on(
    redis_url: str, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A scheduler user that may not WAIT (a role set up by hand, or an older rule) with
    redis.wait-replicas: its writes go through and are logged as unreplicated; it used to
    exit after its first write, and again after every restart."""
    keys, user, password = Keys(cluster_name), f"nowait-{cluster_name}", uuid.uuid4().hex
    admin = redis.Redis.from_url(redis_url)
    version = parse_version(admin.info("server")["redis_version"])  # (6.2: no %R~)
    admin.execute_command(
        *setuser_args("scheduler", cluster_name, user=user, password=password, version=version)
    )
    admin.execute_command("ACL", "SETUSER", user, "-wait")
    url = redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
    scheduler = Scheduler(url, cluster_name, wait_replicas=1, wait_timeout=0.05)
    scheduler.acquire_lease()
    scheduler.apply([["SET", keys.prefix + "written", 1]])
    assert admin.get(keys.prefix + "written") == b"1"
    assert "were not acknowledged by 1 replicas" in caplog.text and "wait" in caplog.text
    admin.execute_command("ACL", "DELUSER", user)


def test_a_client_user_without_info_is_warned_once_and_works(
    redis_url: str,
    cluster_name: str,
    caplog: pytest.LogCaptureFixture,
    make_cluster: ClusterFactory,
) -> None:
    """A client user from before clients read INFO (its server's run id, for the news
    of a failed-over Redis): one warning naming the fix, and the work goes on."""
    user, password = f"noinfo-{cluster_name}", uuid.uuid4().hex
    admin = redis.Redis.from_url(redis_url)
    version = parse_version(admin.info("server")["redis_version"])  # (6.2: no %R~)
    admin.execute_command(
        *setuser_args("client", cluster_name, user=user, password=password, version=version)
    )
    admin.execute_command("ACL", "SETUSER", user, "-info")
    try:
        with (
            make_cluster(nanny=False, n_workers=1),
            Client(redis_url, cluster_name, redis={"username": user, "password": password}) as c,
        ):
            assert c.submit(inc, 1).result(timeout=30) == 2
            assert c.submit(inc, 2).result(timeout=30) == 3
        warned = [r for r in caplog.records if "may not run INFO" in r.getMessage()]
        assert len(warned) == 1 and "+info" in warned[0].getMessage()
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()
