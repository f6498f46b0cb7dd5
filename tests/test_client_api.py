"""The Client as Dask users call it: distributed's names, keywords and behaviour, and the
wrong answers and silent hangs each of these tests once caught (issue 10)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from polling import poll
from tasklib import wait_for_file

from redisdask import (
    Client,
    FutureCancelledError,
    LocalCluster,
    RedisDaskError,
    TaskInterrupted,
    wait,
)
from redisdask.client.client import MAX_SPEC_BYTES
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.errors import ClusterConnectionError
from redisdask.store.keyspace import Keys

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def div(a: float, b: float) -> float:
    return a / b


def keywords(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return kwargs


class Interrupt(BaseException):
    """A BaseException that is no Exception, like KeyboardInterrupt."""


def interrupt() -> None:
    raise Interrupt("stop")


def test_map_with_a_key_prefix_names_keys_by_token_not_position(client: Client) -> None:
    first = client.map(inc, [1, 2], key="step")
    second = client.map(inc, [10, 20], key="step")
    assert client.gather(first) == [2, 3]
    assert client.gather(second) == [11, 21]  # was [2, 3]: the first map's results
    assert all(f.key.startswith("step-") for f in first + second)
    assert len({f.key for f in first + second}) == 4


def test_a_tuple_key_as_dask_writes_it(client: Client) -> None:
    future = client.submit(inc, 1, key=("x", 0, 1))  # was dead-lettered: waited forever
    assert future.key == ("x", 0, 1)
    assert future.result(timeout=10) == 2
    with pytest.raises(TypeError, match="key"):
        client.submit(inc, 1, key=["not", "a", "key"])


def test_distributeds_keywords_never_reach_the_function(client: Client) -> None:
    future = client.submit(
        keywords, 1, fifo_timeout="1s", workers="nobody", allow_other_workers=True, pure=False
    )
    assert future.result(timeout=10) == {}
    assert client.gather(client.map(keywords, [1], fifo_timeout="1s", batch_size=5)) == [{}]
    with pytest.raises(ValueError, match="Only use allow_other_workers= if using workers="):
        client.submit(keywords, 1, allow_other_workers=True)  # as distributed says
    with pytest.raises(NotImplementedError, match="actors"):
        client.submit(keywords, 1, actor=True)


def test_sys_exit_in_a_task_fails_the_task_and_never_ends_the_client(client: Client) -> None:
    with pytest.raises(TaskInterrupted, match="SystemExit"):
        client.submit(sys.exit, 3).result(timeout=10)
    with pytest.raises(TaskInterrupted, match="Interrupt"):
        client.submit(interrupt).result(timeout=10)
    assert client.submit(inc, 1).result(timeout=10) == 2  # the worker is fine


def test_gather_raises_the_first_error_without_waiting_for_the_rest(
    client: Client, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    slow = client.submit(wait_for_file, str(release))
    bad = client.submit(div, 1, 0)
    try:
        with pytest.raises(ZeroDivisionError):
            client.gather([slow, bad])  # was: waited for `slow` first
        assert not slow.done()
        with pytest.raises(ZeroDivisionError):  # "a" waits for `slow`
            client.get({"a": (inc, slow), "b": (div, 1, 0)}, ["a", "b"])
    finally:
        release.touch()


def test_gather_skip_leaves_failed_futures_out(client: Client) -> None:
    good, bad = client.submit(inc, 1), client.submit(div, 1, 0)
    assert client.gather([good, bad, good], errors="skip") == [2, 2]  # was [2, None, 2]
    assert client.gather({"g": good, "b": bad}, errors="skip") == {"g": 2}


def test_wait_takes_dask_style_timeouts(client: Client, tmp_path: Path) -> None:
    pending = client.submit(wait_for_file, str(tmp_path / "never"))
    with pytest.raises(TimeoutError):
        wait([pending], timeout="200ms")  # was a TypeError comparing str and float
    with pytest.raises(TimeoutError):
        pending.result(timeout="0.1s")
    (tmp_path / "never").touch()


def test_depending_on_a_cancelled_future_says_it_was_cancelled(
    client: Client, tmp_path: Path
) -> None:
    x = client.submit(wait_for_file, str(tmp_path / "done"), pure=False)
    client.cancel([x])
    y = client.submit(inc, x)
    with pytest.raises(FutureCancelledError, match="cancelled"):  # was DataUnavailableError
        y.result(timeout=10)
    (tmp_path / "done").touch()  # the cancelled run ends: the cluster closes at once


def test_closing_while_done_callbacks_hold_the_last_futures(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    client = Client(cluster)
    blocker = client.submit(wait_for_file, str(tmp_path / "never"))  # one thread
    futures = [client.submit(inc, blocker, key=f"after-{i}") for i in range(3)]
    wait([*futures, client.scatter(1)], return_when="FIRST_COMPLETED")
    del futures  # only the FIRST_COMPLETED callbacks hold them now
    client.close()  # was: RuntimeError: dictionary changed size during iteration
    assert client.status == "closed"
    r = redis.Redis.from_url(cluster.redis_url)
    poll(lambda: not r.hexists(Keys(cluster.cluster_name).clients, client.id))  # it said goodbye
    (tmp_path / "never").touch()


def test_scatter_keys_come_from_the_whole_value(client: Client) -> None:
    a, b = np.zeros(1000), np.ones(1000)  # same dtype and shape: the pickle's head is equal
    fa, fb = client.scatter([a, b])
    assert fa.key != fb.key
    assert client.gather(fb).sum() == 1000  # was the zeros
    del fa
    assert client.gather(fb).sum() == 1000
    same = client.scatter([np.ones(1000), np.ones(1000)])
    assert same[0].key == same[1].key == fb.key and len(same) == 2


def test_scatter_shapes_and_targets(client: Client) -> None:
    worker = sorted(client.scheduler_info()["workers"])[0]
    future = client.scatter(41, workers=worker)  # was iterated: "invalid address 't'"
    assert client.who_has([future])[future._key] == [worker]
    scattered = client.scatter({1, 2, 3})
    assert isinstance(scattered, set)  # was a list
    assert sorted(client.gather(list(scattered))) == [1, 2, 3]
    assert client.gather(client.scatter(frozenset({7}))) == frozenset({7})
    with pytest.raises(ValueError, match="no worker with address or name"):
        client.scatter(1, workers="tcp://127.0.0.1:1")


def test_restart_empties_who_has_and_cancels_erred_futures(client: Client) -> None:
    x, bad = client.submit(inc, 1), client.submit(div, 1, 0)
    wait([x, bad])
    client.restart()
    assert x.status == bad.status == "cancelled"  # bad stayed "error"
    assert client.who_has([x]) == {x._key: []}  # named the old holders
    assert client.submit(inc, 1).result(timeout=10) == 2


def test_an_argument_too_large_for_redis_is_refused_at_submit(client: Client) -> None:
    big = np.zeros(MAX_SPEC_BYTES // 8 + 1)
    with pytest.raises(ValueError, match="scatter"):
        client.submit(len, big)


def test_a_write_redis_refuses_while_it_answers_is_given_up(tmp_path: Path) -> None:
    """Redis drops the connection of a request past its limits and answers PING: a client
    that took that for a lost Redis re-sent the request forever."""
    with (
        EmbeddedRedis(data_dir=tmp_path) as server,
        LocalCluster(nanny=False, n_workers=1, redis_url=server.url) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(server.url)
        r.config_set("client-query-buffer-limit", 1 << 20)  # drops the connection
        # submit does not wait for its write (as in distributed): the future errs
        with pytest.raises(ClusterConnectionError, match="scatter"):
            client.submit(len, b"x" * (4 << 20)).result(timeout=30)
        r.config_set("client-query-buffer-limit", 1 << 30)
        r.config_set("proto-max-bulk-len", 1 << 20)  # answers with an error
        with pytest.raises(RedisDaskError, match="scatter"):
            client.submit(len, b"y" * (2 << 20)).result(timeout=30)
        assert client.submit(inc, 1).result(timeout=10) == 2


def test_distributed_names_are_accepted_by_get(client: Client) -> None:
    futures = client.get({"k": (inc, 1)}, ["k"], sync=False, fifo_timeout="1s", priority=3)
    assert futures[0].result(timeout=10) == 2
    tag = uuid.uuid4().hex
    assert client.get({tag: (inc, 2)}, tag, allow_other_workers=True) == 3


def test_more_values_than_one_message_may_carry(client: Client) -> None:
    """12,000 results on one worker: fetched by the client and by another worker in
    several messages (one message of them all passed the transport's limits)."""
    a, b = sorted(client.scheduler_info()["workers"])
    futures = client.map(inc, range(12_000), workers=[a])
    assert client.gather(futures) == list(range(1, 12_001))
    assert client.submit(sum, futures, workers=[b]).result(timeout=60) == sum(range(1, 12_001))
    scattered = client.scatter(list(range(12_000)), workers=b)
    assert client.gather(scattered)[-1] == 11_999


def test_without_dask_dict_graphs_and_scatter_tokens_still_work(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paths taken on a machine without dask: old-style tuple graphs (futures inside)
    and scatter keys from a hash over every frame."""
    from redisdask import spec

    monkeypatch.setattr(spec, "dask_installed", lambda: False)
    x = client.submit(inc, 1)
    graph = {"y": (inc, "z"), "z": (sum, [x, 10]), ("t", 0): (inc, "y")}
    assert client.get(graph, [("t", 0), "y"]) == [14, 13]
    fa, fb = client.scatter([np.zeros(1000), np.ones(1000)])
    assert fa.key != fb.key and client.gather(fb).sum() == 1000


def one() -> int:
    return 1


def two() -> int:
    return 2


@pytest.mark.timeout(120)
def test_a_key_submitted_again_as_another_computation_gives_the_new_result(
    client: Client,
) -> None:
    """A future dropped and its key submitted again at once, as another function: the
    result is the new function's.  Before, about one in twelve came back as the old
    one's: the client took the old run's news (written before the scheduler read the
    resubmission) for the new future, and a worker resumed the old run, freed while it
    ran, as the new one, or answered the new claim with the old run's result."""
    wrong = []
    for i in range(300):
        key = f"reused-{i % 3}"
        old = client.submit(one, key=key)
        del old  # released, then submitted again in the same write
        new = client.submit(two, key=key)
        if new.result(timeout=30) != 2:
            wrong.append(i)
        del new
    assert wrong == []
