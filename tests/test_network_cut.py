"""A real network cut between two workers (issue 22): each worker runs in a network
namespace of its own, behind a router namespace; Redis, the scheduler and the client stay
in the root namespace.  The cut is two ``blackhole`` rules in the router: packets between
the two workers are dropped silently (no RST, no ICMP), while both still reach Redis, the
scheduler and the client, and keep heartbeating.  Nothing but the peer deadline
(``comm.timeouts.tcp``) can free the dependent whose holder is on the far side.

Needs root and ``ip`` (iproute2): where a namespace cannot be created the test skips."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from polling import poll

from redisdask import Client, wait
from redisdask.deploy.embedded import EmbeddedRedis

DEAD_AFTER = 1.0  # comm.timeouts.tcp and comm.timeouts.connect in this test
MARGIN = 15.0  # seconds beyond the deadline the dependent may take (a loaded 2-core box)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Net:
    """Three namespaces: ``a`` and ``b`` (one worker each) and a router between them and
    the root namespace.  Addresses ``10.<n>.1.2`` (a), ``10.<n>.2.2`` (b), ``10.<n>.0.1``
    (the root namespace's end, where Redis listens)."""

    tag: str
    octet: int
    made: list[str] = field(default_factory=list)

    @property
    def root(self) -> str:
        return f"10.{self.octet}.0.1"

    @property
    def a(self) -> str:
        return f"10.{self.octet}.1.2"

    @property
    def b(self) -> str:
        return f"10.{self.octet}.2.2"

    def ns(self, which: str) -> str:
        return f"{self.tag}-{which}"

    def build(self) -> None:
        tag, n, router = self.tag, self.octet, self.ns("r")
        for which in ("r", "a", "b"):
            _ip("netns", "add", self.ns(which))
            self.made.append(self.ns(which))
        _ip("link", "add", f"{tag}-0", "type", "veth", "peer", "name", "up0", "netns", router)
        self.made.append(f"{tag}-0")
        _ip("addr", "add", f"{self.root}/30", "dev", f"{tag}-0")
        _ip("link", "set", f"{tag}-0", "up")
        _ip("route", "add", f"10.{n}.0.0/16", "via", f"10.{n}.0.2")
        _ip("-n", router, "addr", "add", f"10.{n}.0.2/30", "dev", "up0")
        for dev in ("lo", "up0"):
            _ip("-n", router, "link", "set", dev, "up")
        for i, which in ((1, "a"), (2, "b")):
            ns = self.ns(which)
            _ip("link", "add", f"{tag}-{i}", "netns", ns, "type", "veth", "peer", "name",
                f"down{i}", "netns", router)  # fmt: skip
            _ip("-n", ns, "link", "set", f"{tag}-{i}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"10.{n}.{i}.2/24", "dev", "eth0")
            _ip("-n", router, "addr", "add", f"10.{n}.{i}.1/24", "dev", f"down{i}")
            _ip("-n", router, "link", "set", f"down{i}", "up")
            for dev in ("lo", "eth0"):
                _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "route", "add", "default", "via", f"10.{n}.{i}.1")
        _ip("netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")  # (its own)

    def cut(self) -> None:
        """Drop every packet between a and b, both ways, silently (a switch that died)."""
        for src, dst in ((self.a, self.b), (self.b, self.a)):
            _ip("-n", self.ns("r"), "rule", "add", "from", src, "to", dst, "blackhole")

    def tear_down(self) -> None:
        for name in reversed(self.made):
            kind = "link" if name == f"{self.tag}-0" else "netns"
            with contextlib.suppress(subprocess.SubprocessError):
                _ip(kind, "del", name)  # (the root end's route goes with its link)


@pytest.fixture
def net() -> Iterator[Net]:
    tag = f"rd{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", f"{tag}-probe"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        why = getattr(exc, "stderr", b"") or str(exc).encode()
        pytest.skip(f"cannot create a network namespace here (root and iproute2): {why!r}")
    _ip("netns", "del", f"{tag}-probe")
    octets = random.sample(range(64, 250), 5)  # another run may hold one: try the next
    for octet in octets:
        made = Net(tag, octet)
        try:
            made.build()
        except subprocess.CalledProcessError:
            made.tear_down()
            if octet == octets[-1]:
                raise
            continue
        try:
            yield made
        finally:
            made.tear_down()
        return


def reaches(net: Net, ns: str, host: str, port: int) -> bool:
    """Whether a TCP connection from namespace ``ns`` to ``host:port`` opens within 1 s."""
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    done = subprocess.run(
        ["ip", "netns", "exec", net.ns(ns), sys.executable, "-c", probe],
        capture_output=True,
        timeout=20,
    )
    return done.returncode == 0


@contextlib.contextmanager
def processes(logs: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Processes started by the test, each logging to ``logs/<name>.log``; on the way out
    the workers are killed (a SIGTERMed one would try for 20 s to hand its data over the
    cut) and the scheduler is stopped."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        yield procs
    finally:
        for name, proc in procs.items():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM if name == "scheduler" else signal.SIGKILL)
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def start(
    procs: dict[str, subprocess.Popen[bytes]], logs: Path, name: str, argv: list[str]
) -> None:
    with open(logs / f"{name}.log", "wb") as out:
        procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def n_workers(client: Client) -> int:
    return len(client.scheduler_info()["workers"])


@pytest.mark.timeout(90)
def test_a_dependent_of_a_holder_cut_off_from_its_worker_finishes(
    net: Net, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDISDASK__COMM__TIMEOUTS__TCP", str(DEAD_AFTER))
    monkeypatch.setenv("REDISDASK__COMM__TIMEOUTS__CONNECT", str(DEAD_AFTER))
    monkeypatch.setenv("REDISDASK__WORKER__INLINE_RESULT_BYTES", "0")  # x only on its worker
    cluster = f"t-cut-{net.tag}"
    python = [sys.executable, "-P", "-m", "redisdask"]
    with (
        EmbeddedRedis(args=["--bind", "127.0.0.1", net.root]) as server,
        processes(tmp_path) as procs,
    ):
        url = f"redis://{net.root}:{server.port}/0"
        start(procs, tmp_path, "scheduler", [*python, "scheduler", url, "--cluster", cluster])

        def worker(which: str, host: str) -> None:
            inside = ["ip", "netns", "exec", net.ns(which)]
            flags = ["--no-nanny", "--nthreads", "1", "--name", which, "--host", host]
            argv = [*inside, *python, "worker", url, "--cluster", cluster, *flags]
            start(procs, tmp_path, which, argv)

        worker("a", net.a)
        with Client(url, cluster) as client:
            poll(lambda: n_workers(client) == 1, timeout=30)
            x = client.submit(inc, 41)  # on a: b is not there yet
            wait([x], timeout=20)
            worker("b", net.b)
            poll(lambda: n_workers(client) == 2, timeout=30)
            [holder] = client.who_has()[x.key]
            [other] = [w for w in client.scheduler_info()["workers"] if w != holder]
            assert holder.startswith(f"tcp://{net.a}:") and other.startswith(f"tcp://{net.b}:")
            # b fetches from a once: a pooled connection, on which b's next request waits
            w = client.submit(inc, 1, workers=[holder])
            assert client.submit(add, w, 0, workers=[other]).result(timeout=20) == 2

            net.cut()
            port = int(holder.rsplit(":", 1)[1])
            assert not reaches(net, "b", net.a, port)  # the cut is real ...
            assert reaches(net, "b", net.root, server.port)  # ... and only between a and b
            assert reaches(net, "a", net.root, server.port)
            cut_at = time.monotonic()
            y = client.submit(add, x, 1, workers=[other])
            assert y.result(timeout=60) == 43
            took = time.monotonic() - cut_at
            print(f"\ny finished {took:.2f} s after the cut (deadline {DEAD_AFTER} s)")
            assert took < DEAD_AFTER + MARGIN, took
            # recomputed where it was missed (redisdask/scheduler/decide.py): a, alive and idle,
            # might have taken it again, and b's next fetch from a failed again
            assert client.who_has()[x.key] == [other]
            assert n_workers(client) == 2  # both still there: nothing died, a link did
    log = (tmp_path / "b.log").read_text()
    assert f"could not fetch 1 keys ['{x.key}'] from {holder}" in log, log[-3000:]
    assert log.count("could not fetch") == 1, log[-3000:]  # the recompute was b's
    # on the pooled connection (its request waits in vain), or, where that one was
    # gone, on a new one (its SYN is dropped)
    waited = f"moved no byte for {DEAD_AFTER:g} s", f"after {DEAD_AFTER}s connecting"
    assert any(text in log for text in waited), log[-3000:]
