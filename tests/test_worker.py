"""The worker driver's contracts with Redis (real Redis; the state machine has its own
unit tests in test_worker_state.py)."""

from __future__ import annotations

import pytest
import redis

from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import entry, pack, unpack
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import Scripts
from redisdask.workers.inbox import early_news, inbox_events, script_entries

pytestmark = pytest.mark.timeout(30)


def test_a_claim_returns_the_inbox_written_before_it_in_a_decodable_form(
    redis_url: str, cluster_name: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    worker = "tcp://127.0.0.1:1"
    r.hset(keys.workers, worker, pack({"address": worker}))
    first = r.xadd(keys.worker_inbox(worker), entry([{"op": "free-keys", "keys": ["old"]}]))
    second = r.xadd(keys.worker_inbox(worker), entry([{"op": "free-keys", "keys": ["x"]}]))
    r.hset(keys.task("x"), mapping={"state": "queued", "spec": b"s", "deps": pack([])})
    r.zadd(keys.ready, {"x": 1.0})
    claimed, _signal, inbox, _blocked, claim = Scripts(r, keys).claim(
        worker=worker, count=5, last_inbox_id=first.decode()
    )
    assert [c[0] for c in claimed] == [b"x"]
    assert claim == r.hget(keys.task("x"), "claim")  # its entry, for free-keys to name
    [(entry_id, fields)] = script_entries(inbox)  # only what came after `first`
    assert entry_id == second
    [event] = inbox_events(entry_id.decode(), fields, 0.0)
    assert event.keys == ["x"]


def test_a_claim_brings_small_dependencies_only_to_a_worker_that_lacks_them(
    redis_url: str, cluster_name: str
) -> None:
    """A dependency kept in its record comes with the claim's reply, unless the claiming
    worker holds it already: those bytes would move for nothing.  Each names the
    submission its value is of (its record's score)."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    holder, other = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
    for worker in (holder, other):
        r.hset(keys.workers, worker, pack({"address": worker}))
    r.hset(keys.task("a"), mapping={"state": "memory", "who_has": f"{holder} redis",
                                    "nbytes": 28, "value": b"pickled", "score": 3})  # fmt: skip
    for key in ("x", "y"):
        r.hset(keys.task(key), mapping={"state": "queued", "spec": b"s", "deps": pack(["a"])})
        r.zadd(keys.ready, {key: 1.0})
    scripts = Scripts(r, keys)
    (mine,), *_ = scripts.claim(worker=holder, count=1, last_inbox_id="0-0")
    (theirs,), *_ = scripts.claim(worker=other, count=1, last_inbox_id="0-0")
    assert mine[3] == [[b"a", f"{holder} redis".encode(), b"28", b"3"]]  # no value
    assert theirs[3] == [[b"a", f"{holder} redis".encode(), b"28", b"3", b"pickled"]]


def test_a_pushed_tasks_early_news_goes_to_its_registered_clients_for_its_run_only(
    redis_url: str, cluster_name: str
) -> None:
    """FINISH sends a pushed task's small result to the clients its record's ``notify``
    names, if the record still says processing here for this run, and only to clients
    still registered: a closed client's events stream, deleted when it was forgotten,
    is not made again (nothing would ever delete it)."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    me = "tcp://127.0.0.1:1"
    r.hset(keys.clients, "c1", pack({"id": "c1"}))  # c2 closed: not registered
    r.hset(keys.task("x"), mapping={"state": "processing", "worker": me, "score": "5",
                                    "notify": pack({"c1": 3, "c2": 4})})  # fmt: skip
    scripts = Scripts(r, keys)

    def finish(score: float) -> None:
        report = {"op": "task-finished", "key": "x", "score": score, "nbytes": 28,
                  "type": "int", "value": b"v"}  # fmt: skip
        early = early_news([report], {"x"}, me)
        scripts.finish(worker=me, ttl_ms=3000, reports=[pack({"op": "x"})], finished=[],
                       chain=0, last_inbox_id="0-0", early=early)  # fmt: skip

    finish(4.0)  # a report of an earlier run of x: nobody is told
    assert not r.exists(keys.client_events("c1"))
    finish(5.0)
    [(_, fields)] = r.xrange(keys.client_events("c1"))
    [news] = unpack(fields[b"m"])
    assert news == {"op": "key-in-memory", "key": "x", "who_has": [me, "redis"], "nbytes": 28,
                    "type": "int", "value": b"v", "seen": 3}  # fmt: skip
    assert not r.exists(keys.client_events("c2"))
    [*_, (_, last)] = r.xrange(keys.worker_stream)
    assert unpack(last[b"m"])[0] == {"op": "told", "worker": me, "keys": ["x"], "scores": [5]}


def test_early_news_is_only_for_a_pushed_tasks_small_result_of_a_known_run() -> None:
    """What a report batch makes of early news: a pushed task's small result, once (the
    keys reported leave the pushed set); not a big result, a claimed task's, an error, or a
    report that names no run (the scheduler tells those clients)."""

    def done(key: str, **kw: object) -> dict[str, object]:
        return {"op": "task-finished", "key": key, "score": 1.0, "value": b"v", **kw}

    no_run = done("d")
    del no_run["score"]
    pushed = {"a", "b", "d"}
    batch = [done("a"), done("b", value=None), done("c"), no_run,
             {"op": "task-erred", "key": "e"}, done("a")]  # fmt: skip
    assert [key for key, *_ in early_news(batch, pushed, "tcp://w:1")] == ["a"]
    assert pushed == set()


def test_a_worker_loop_waits_out_a_cluster_key_of_the_wrong_type_and_no_other_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Worker._keep_running``: a WRONGTYPE while a cluster-wide key is of the wrong type
    is waited out (the scheduler rebuilds it), however often it comes; one whose key was
    rebuilt since is tried once more; one on any other key, met twice in a row, ends the
    loop (the worker leaves, as before); Redis away in between resets the count."""
    import asyncio
    import types

    from redisdask.workers import worker as driver

    monkeypatch.setattr(driver, "WRONG_TYPE_WAIT", 0)
    wrong = redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")

    def run(failures: list[BaseException | None], misfits: list[list[str] | None]) -> int:
        """The loop's tries until it returned (or the error it ended with)."""
        tries = iter(failures)
        answers = iter(misfits)
        calls = 0

        async def loop() -> None:
            nonlocal calls
            calls += 1
            failure = next(tries)
            if failure is not None:
                raise failure

        async def look() -> list[str] | None:
            return next(answers)

        async def reconnected() -> None:
            return None

        me = types.SimpleNamespace(
            status="running", _wrong_type_said=0.0, keys=Keys("c"), _misfits=look,
            _reconnecting=None, _reconnect=lambda exc: reconnected(),
        )  # fmt: skip
        asyncio.run(driver.Worker._keep_running(me, loop))  # type: ignore[arg-type]
        return calls

    key = ["rd:{c}:workers is a string, not a hash"]
    assert run([wrong] * 5 + [None], [key] * 5) == 6  # waited out, five times
    assert run([wrong, wrong, None], [[], key]) == 3  # rebuilt since: once more
    lost = redis.ConnectionError("gone")
    assert run([wrong, lost, wrong, None], [[], []]) == 4  # Redis away in between
    assert run([wrong, wrong, wrong, None], [[], key, []]) == 4  # the count starts again
    with pytest.raises(redis.ResponseError):
        run([wrong, wrong], [[], []])  # another key's: the worker leaves
