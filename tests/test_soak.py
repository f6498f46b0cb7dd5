"""Soak: rounds of a mixed workload on one cluster, each ending with a reduction of up to
500 futures, every result checked against a model of what it must be (issue 10, item 11:
"a reduction sometimes never finishes").

A round mixes a pure ``map`` (its window overlaps earlier rounds', so keys come back in
memory, released or forgotten), an impure ``map``, two ``inc`` chains (one keeps only its
last future: its intermediates are released while they compute), ``scatter`` of ints and
of numpy arrays with dependents (values come back, often right after the previous round
released them), tasks that raise (one with ``retries``) and dependents of them, tasks whose
first run fails and whose retry succeeds, and dependents of them, ``cancel`` of leaves and
of a chain element that later futures depend on, a resubmission of some cancelled keys,
and futures carried over to the next round.  It ends with
``client.submit(sum, futures[:500])``, whose value must be exact; then every future that
must raise raises the right exception, cancelled ones say so, and a sample of values is
checked one by one.  ("Seeded" fixes the workload; which worker runs what still varies.)

The short soak runs in the suite (``SHORT_SECONDS``).  The long one is marked ``slow``,
which ``pyproject.toml`` deselects by default; run it with::

    python -m pytest -m slow tests/test_soak.py     # 300 s; REDISDASK_SOAK_SECONDS=900 for more

``REDISDASK_SOAK_SEED`` replays one seed (the seed is in every failure message).  A round
that does not finish within ``ROUND_TIMEOUT`` fails with a diagnosis (the stuck tasks'
records and stories from Redis, and what each worker's state machine holds for them),
written in full to ``REDISDASK_SOAK_REPORT_DIR`` (default: the temp directory).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FuturesTimeoutError
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from polling import poll

from redisdask import Client, LocalCluster, comm
from redisdask.client import Future
from redisdask.observe.inspect import read_task
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import unpack_or
from redisdask.store.keyspace import Keys

SHORT_SECONDS = 12.0
LONG_SECONDS = float(os.environ.get("REDISDASK_SOAK_SECONDS", "300"))
ROUND_TIMEOUT = 30.0  # a round's waits; a healthy round takes well under a second
OVERHEAD = 60.0  # cluster start and close, and the last round's diagnosis


# --------------------------------------------------------------------------- tasks


def square(x: int) -> int:
    return x * x


def triple(x: int) -> int:
    return 3 * x


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def asum(a: np.ndarray) -> int:
    return int(a.sum())


def fail(x: int) -> int:
    raise ValueError(f"soak failure {x}")


def flaky(x: int, marker: str) -> int:
    """Fails its first run (wherever it runs), succeeds when run again (``retries``)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return 7 * x
    raise ValueError(f"flaky {x}: its first run fails")


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True, slots=True)
class Expect:
    """What a key must give: an int, an array, or a ValueError with this message."""

    value: Any = None
    error: str | None = None
    deps: tuple[str, ...] = ()

    @property
    def is_int(self) -> bool:
        return self.error is None and isinstance(self.value, int)


class SoakFailure(AssertionError):
    pass


class Soak:
    """Runs rounds on one client; ``expect`` is the model, by key, over all rounds."""

    def __init__(self, client: Client, cluster: LocalCluster, seed: int, scratch: Path) -> None:
        self.client = client
        self.cluster = cluster
        self.seed = seed
        self.scratch = scratch  # the flaky tasks' markers
        self.rng = random.Random(seed)
        self.expect: dict[str, Expect] = {}
        self.carry: list[Future] = []
        self.rounds = 0
        self.futures = 0

    # -- bookkeeping --------------------------------------------------------------

    def note(self, futures: list[Future], expected: list[Expect]) -> list[Future]:
        assert len(futures) == len(expected)
        for f, e in zip(futures, expected, strict=True):
            known = self.expect.get(f.key)
            # a pure key means the same computation every time it comes back
            assert known is None or isinstance(e.value, np.ndarray) or known == e, (
                f"{self.context()}: {f.key} was {known}, now {e}"
            )
            self.expect[f.key] = e
        self.futures += len(futures)
        return futures

    def chain(self, start: int, length: int) -> list[Future]:
        c = self.client
        futures = self.note([c.submit(inc, start)], [Expect(start + 1)])
        for i in range(length):
            prev = futures[-1]
            futures += self.note([c.submit(inc, prev)], [Expect(start + i + 2, deps=(prev.key,))])
        return futures

    def cascade(self, keys: set[str], wanted: set[str]) -> set[str]:
        """What ``cancel(keys)`` cancels: the keys and, transitively, the client's wanted
        dependents of them (as in Dask)."""
        cancelled = set(keys)
        grew = True
        while grew:
            grew = False
            for key in wanted - cancelled:
                if cancelled.intersection(self.expect[key].deps):
                    cancelled.add(key)
                    grew = True
        return cancelled

    # -- one round ----------------------------------------------------------------

    def round(self) -> None:
        rng, c = self.rng, self.client
        self.rounds += 1
        # pure map over a window that overlaps earlier rounds' windows
        lo = rng.randrange(150)
        xs = list(range(lo, lo + rng.randint(40, 160)))
        sq = self.note(c.map(square, xs), [Expect(x * x) for x in xs])
        # impure map: new keys every time
        ys = [rng.randrange(10**6) for _ in range(rng.randint(10, 60))]
        tr = self.note(c.map(triple, ys, pure=False), [Expect(3 * y) for y in ys])
        # chains (pure: a start seen before gives the same keys again)
        chain = self.chain(rng.randrange(20), rng.randint(5, 25))
        released_chain = self.chain(rng.randrange(20, 40), rng.randint(5, 25))
        # scatter small ints: the same value (same key) comes back in later rounds, often
        # right after the previous round released it
        ints = rng.sample(range(50), rng.randint(1, 8))
        sc = c.scatter(ints)
        assert len({f.key for f in sc}) == len(sc) == len(ints), (
            f"{self.context()}: scatter of {ints} gave keys {[f.key for f in sc]}"
        )
        self.note(sc, [Expect(v) for v in ints])
        ks = [rng.randrange(100) for _ in sc]
        plus = self.note(
            [c.submit(add, s, k) for s, k in zip(sc, ks, strict=True)],
            [Expect(v + k, deps=(s.key,)) for s, v, k in zip(sc, ints, ks, strict=True)],
        )
        # scatter numpy arrays: different contents of one dtype and shape, and the same
        # contents again in later rounds
        shapes = rng.sample([(n, m) for n in (8, 16) for m in range(1, 20)], rng.randint(1, 4))
        arrays = [np.arange(n, dtype=np.int64) * m for n, m in shapes]
        af = c.scatter(arrays)
        assert len({f.key for f in af}) == len(af) == len(arrays), (
            f"{self.context()}: scatter of {len(arrays)} different arrays gave keys "
            f"{[f.key for f in af]} (known bug: scatter named data by its pickle's first "
            "frame only, so arrays of one dtype and shape shared a key)"
        )
        self.note(af, [Expect(a) for a in arrays])
        asums = self.note(
            [c.submit(asum, f) for f in af],
            [Expect(int(a.sum()), deps=(f.key,)) for f, a in zip(af, arrays, strict=True)],
        )
        # tasks that raise (pure: the same keys err again in later rounds) and dependents
        vs = rng.sample(range(8), 3)
        bad = self.note(
            [c.submit(fail, v) for v in vs], [Expect(error=f"soak failure {v}") for v in vs]
        )
        retry_v = 100 + rng.randrange(4)
        bad += self.note(
            [c.submit(fail, retry_v, retries=1)], [Expect(error=f"soak failure {retry_v}")]
        )
        other = sq[rng.randrange(len(sq))]
        bad += self.note(
            [c.submit(inc, bad[0]), c.submit(add, bad[1], other)],
            [
                Expect(error=f"soak failure {vs[0]}", deps=(bad[0].key,)),
                Expect(error=f"soak failure {vs[1]}", deps=(bad[1].key, other.key)),
            ],
        )
        # tasks whose first run fails and whose retry succeeds, and dependents of them
        zs = rng.sample(range(1000), 2)
        markers = [str(self.scratch / f"flaky-{self.rounds}-{z}") for z in zs]
        fl = self.note(
            [c.submit(flaky, z, m, retries=1) for z, m in zip(zs, markers, strict=True)],
            [Expect(7 * z) for z in zs],
        )
        fl += self.note(
            [c.submit(inc, f) for f in fl],
            [Expect(7 * z + 1, deps=(f.key,)) for f, z in zip(fl, zs, strict=True)],
        )
        # release: the second chain keeps only its last future; some leaves go
        last = released_chain[-1]
        del released_chain
        dropped = set(rng.sample(range(len(sq)), len(sq) // 5))
        leaves = [(x, f) for i, (x, f) in enumerate(zip(xs, sq, strict=True)) if i not in dropped]
        sq = [f for _, f in leaves]
        held = [*self.carry, *sq, *tr, *chain, last, *sc, *plus, *af, *asums, *bad, *fl]
        self.carry = []
        # cancel: some leaves, and a chain element that the rest of the chain depends on
        cut = rng.sample(leaves, min(len(leaves), rng.randint(1, 6)))
        targets = [f for _, f in cut] + [chain[rng.randrange(1, len(chain))]]
        cancelled = self.cascade({f.key for f in targets}, {f.key for f in held})
        c.cancel(targets)
        # submit some cancelled keys again: the same pure keys must compute again
        again_x = [x for x, _ in rng.sample(cut, len(cut) // 2)]
        again = self.note(c.map(square, again_x), [Expect(x * x) for x in again_x])
        held += again
        cancelled -= {f.key for f in again}
        # what is cancelled says so (the dependents once the scheduler's answer is in); a
        # dependent that erred before the cancel reached the scheduler keeps its error
        gone = [f for f in held if f.key in cancelled]

        def settled(f: Future) -> bool:
            return f.cancelled() or (self.expect[f.key].error is not None and f.status == "error")

        self.wait_for(
            lambda: all(settled(f) for f in gone),
            lambda: [f.key for f in gone if not settled(f)],
            "cancelled futures to say so",
        )
        # the reduction
        pool = [f for f in held if f.key not in cancelled and self.expect[f.key].is_int]
        rng.shuffle(pool)
        futures = pool[:500]
        total = c.submit(sum, futures)
        expected = sum(self.expect[f.key].value for f in futures)
        got = self.result(total)
        if got != expected:
            self.explain_wrong_sum(futures, got, expected)
        # the ones that raise, raise what they should
        for f in held:
            e = self.expect[f.key]
            if e.error is not None and f.key not in cancelled:
                exc = self.exception(f)
                assert isinstance(exc, ValueError) and str(exc) == e.error, (
                    f"{self.context()}: {f.key} raised {exc!r}, expected ValueError({e.error!r})"
                )
        # a sample of the values, one by one
        fine = [f for f in held if f.key not in cancelled and self.expect[f.key].error is None]
        sample = rng.sample(fine, min(len(fine), 20))
        for f, value in zip(sample, self.gather(sample), strict=True):
            want = self.expect[f.key].value
            same = np.array_equal(value, want) if isinstance(want, np.ndarray) else value == want
            assert same, f"{self.context()}: {f.key} gave {value!r}, expected {want!r}"
        # some futures live on into the next round; the rest are released now
        alive = [f for f in held if f.key not in cancelled]
        self.carry = rng.sample(alive, min(len(alive), 30))

    # -- waiting, with a diagnosis when something does not finish -------------------

    def context(self) -> str:
        return f"seed={self.seed} round={self.rounds}"

    def result(self, future: Future) -> Any:
        try:
            return future.result(timeout=ROUND_TIMEOUT)
        except FuturesTimeoutError:
            self.stalled([future.key], f"{future.key} did not finish")
            raise
        except Exception as exc:  # nothing it depends on should raise
            r = redis.Redis.from_url(self.cluster.redis_url)
            blame = r.hget(Keys(self.cluster.cluster_name).task(future.key), "exception_blame")
            r.close()
            culprit = blame.decode() if blame else future.key
            self.stalled([culprit], f"{future.key} raised {exc!r}, blamed on {culprit}")
            raise

    def exception(self, future: Future) -> BaseException | None:
        try:
            return future.exception(timeout=ROUND_TIMEOUT)
        except FuturesTimeoutError:
            self.stalled([future.key], f"erring {future.key} did not finish")
            raise

    def gather(self, futures: list[Future]) -> list[Any]:
        deadline = time.monotonic() + ROUND_TIMEOUT
        for f in futures:
            if not f._state.wait(max(0.0, deadline - time.monotonic())):
                self.stalled([f.key], f"{f.key} did not finish")
        return self.client.gather(futures)

    def wait_for(
        self, condition: Callable[[], bool], keys: Callable[[], list[str]], what: str
    ) -> None:
        try:
            poll(condition, timeout=ROUND_TIMEOUT)
        except AssertionError:
            self.stalled(keys(), f"waited in vain for {what}")

    def stalled(self, keys: list[str], what: str) -> None:
        report = stall_report(self.cluster, keys)
        path = report_path(self.cluster.cluster_name)
        path.write_text(report)
        raise SoakFailure(f"{self.context()}: {what}; full report in {path}\n{report[:6000]}")

    def explain_wrong_sum(self, futures: list[Future], got: Any, expected: int) -> None:
        values = self.client.gather(futures)
        wrong = [
            (f.key, v, self.expect[f.key].value)
            for f, v in zip(futures, values, strict=True)
            if v != self.expect[f.key].value
        ]
        report = stall_report(self.cluster, [k for k, _, _ in wrong[:10]])
        path = report_path(self.cluster.cluster_name)
        path.write_text(report)
        raise SoakFailure(
            f"{self.context()}: sum gave {got}, expected {expected}; wrong values "
            f"(key, got, expected): {wrong[:10]}; report in {path}"
        )


# --------------------------------------------------------------------------- diagnosis


def report_path(cluster_name: str) -> Path:
    directory = Path(os.environ.get("REDISDASK_SOAK_REPORT_DIR", tempfile.gettempdir()))
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"soak-{cluster_name}-{int(time.time())}.txt"


def stall_report(cluster: LocalCluster, keys: list[str], limit: int = 12) -> str:
    """Every unfinished task under ``keys`` (dependencies followed), and the dependencies
    of those a worker holds: records and stories in Redis, and what each worker's state
    machine holds of them."""
    r = redis.Redis.from_url(cluster.redis_url)
    k = Keys(cluster.cluster_name)
    stuck: list[str] = []
    inputs: list[str] = []  # dependencies of a processing task: what its worker waits for
    seen: set[str] = set()
    todo = list(keys)
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        state, deps = r.hmget(k.task(key), ["state", "deps"])
        if state != b"memory":  # (what a result in memory needed does not matter now)
            if len(stuck) < limit:
                stuck.append(key)
            todo.extend(unpack_or(deps, [], list))
            if state == b"processing":
                inputs += [d for d in unpack_or(deps, [], list) if d not in inputs][:limit]
    related = [*stuck, *(d for d in inputs if d not in stuck)]
    out: list[str] = [f"unfinished under {keys[:3]}: {stuck}; inputs of processing: {inputs}"]
    for key in related:
        task = read_task(r, k, key)
        task.pop("spec_bytes", None)
        out.append(json.dumps(task, default=str, indent=1))
    workers = [w.decode() for w in r.hkeys(k.workers)]
    pending = [r.xpending(s, "scheduler")["pending"] for s in (k.worker_stream, k.client_stream)]
    out.append(
        f"workers={workers} ready={r.zrange(k.ready, 0, 20)} "
        f"processing={ {w: sorted(r.smembers(k.worker_processing(w)))[:20] for w in workers} } "
        f"pending={pending} "
        f"dead_letter={r.xlen(k.dead_letter)} deaths={r.xlen(k.deaths)}"
    )
    pool = comm.BlockingPool(ensure_cluster(r, k), timeout=5)
    for address in workers:
        try:
            header, _ = pool.rpc(address, {"op": "inspect"})
        except Exception as exc:
            out.append(f"inspect {address}: {exc!r}")
            continue
        tasks = header.get("tasks", {})
        mine = {key: tasks.get(key) for key in related if key in tasks}
        story = [row for row in header.get("story", []) if row and row[0] in related]
        who_has = {key: v for key, v in header.get("who_has", {}).items() if key in related}
        out.append(
            f"worker {address}: {len(tasks)} tasks, of those above: {mine}, "
            f"in_flight={header.get('in_flight')}, who_has={who_has}, "
            f"their story={story[-20:]}"
        )
    pool.close()
    r.close()
    return "\n".join(out)


# --------------------------------------------------------------------------- tests


def soak(redis_url: str, cluster_name: str, seconds: float, scratch: Path) -> Soak:
    seed = int(os.environ.get("REDISDASK_SOAK_SEED", random.randrange(2**32)))
    started = time.monotonic()
    with (
        LocalCluster(
            nanny=False,
            n_workers=2,
            threads_per_worker=2,
            redis_url=redis_url,
            cluster_name=cluster_name,
        ) as cluster,
        Client(cluster) as client,
    ):
        run = Soak(client, cluster, seed, scratch)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            run.round()
        run.carry = []
        r = redis.Redis.from_url(redis_url)
        assert r.xlen(Keys(cluster_name).dead_letter) == 0, run.context()
        r.close()
    took = time.monotonic() - started
    print(f"soak seed={seed}: {run.rounds} rounds, {run.futures} futures in {took:.0f} s")
    return run


@pytest.mark.timeout(SHORT_SECONDS + ROUND_TIMEOUT + OVERHEAD)
def test_soak_short(redis_url: str, cluster_name: str, tmp_path: Path) -> None:
    run = soak(redis_url, cluster_name, SHORT_SECONDS, tmp_path)
    assert run.rounds >= 6, f"only {run.rounds} rounds in {SHORT_SECONDS} s"


@pytest.mark.slow
@pytest.mark.timeout(LONG_SECONDS + ROUND_TIMEOUT + OVERHEAD)
def test_soak_long(redis_url: str, cluster_name: str, tmp_path: Path) -> None:
    run = soak(redis_url, cluster_name, LONG_SECONDS, tmp_path)
    assert run.rounds >= 6, f"only {run.rounds} rounds in {LONG_SECONDS} s"


# ------------------------------------- a worker that forgot no erred run, in the soak's terms


@pytest.mark.timeout(60)
def test_a_task_retried_on_the_worker_where_it_erred_runs_again(
    client: Client, tmp_path: Path
) -> None:
    """The soak's flaky task, with its retry claimed by the worker where its first run
    failed: that worker answered the retry with the first run's error (it never ran it
    again), so the future erred although its retry would have succeeded."""
    a = sorted(client.scheduler_info()["workers"])[0]
    x = client.submit(flaky, 5, str(tmp_path / "marker"), retries=1, workers=[a])
    assert x.result(timeout=10) == 35


@pytest.mark.timeout(60)
def test_a_dependent_on_the_worker_where_its_dependency_once_erred_runs(
    cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    """The soak's hang with flaky tasks: a's first run erred there, its retry ran on b, and
    a dependent claimed by a waited for ever for the dependency a still held as erred.
    The same state, deterministically: the erred key is released and forgotten, then
    submitted again and run on b."""
    a, b = sorted(client.scheduler_info()["workers"])
    marker = str(tmp_path / "marker")
    x = client.submit(flaky, 5, marker, workers=[a])
    assert "first run fails" in str(x.exception(timeout=10))  # (no traceback holds x)
    key = x.key
    del x
    client.submit(inc, 0).result(timeout=10)  # a send: carries the release
    r = redis.Redis.from_url(cluster.redis_url)
    poll(lambda: not r.exists(Keys(cluster.cluster_name).task(key)))  # forgotten
    y = client.submit(flaky, 5, marker, workers=[b])
    assert y.key == key and y.result(timeout=10) == 35
    assert client.submit(inc, y, workers=[a]).result(timeout=10) == 36
