"""Dask collections on a redisdask cluster, unchanged user code: every result equals
dask's own synchronous scheduler's, through each way a Dask user reaches a scheduler."""

from __future__ import annotations

import operator
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import dask.bag as db
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import ClusterFactory
from dask import delayed
from polling import poll

from redisdask import Client, LocalCluster

pytestmark = pytest.mark.timeout(120)


def inc(x: int) -> int:
    return x + 1


def where(*_: Any) -> tuple[str, int]:
    from redisdask.workers import get_worker

    return get_worker().address, os.getpid()


# --------------------------------------------------------------------------- workloads

PDF = pd.DataFrame(
    {
        "a": np.arange(2000) % 13,
        "b": np.arange(2000.0) * 0.5,
        "c": np.random.default_rng(1).permutation(2000),
    }
)
RIGHT = pd.DataFrame({"a": np.arange(13), "name": [f"n{i}" for i in range(13)]})


def _array() -> da.Array:
    return da.random.default_rng(42).random((600, 600), chunks=(150, 150))


def _ddf() -> dd.DataFrame:
    return dd.from_pandas(PDF, npartitions=6)


WORKLOADS: dict[str, Callable[[], Any]] = {
    "delayed": lambda: delayed(sum)([delayed(inc)(i) for i in range(20)]),
    "array-transpose-mean": lambda: (_array() + _array().T).mean(),
    "array-rechunk": lambda: _array().rechunk((200, 100)).sum(axis=1),
    "array-matmul": lambda: (_array() @ _array().T)[:50, :50],
    "array-map-blocks": lambda: _array().map_blocks(lambda b: b * 2 + 1).std(),
    "bag-map-filter-fold": lambda: (
        db.from_sequence(range(500), npartitions=5)
        .map(inc)
        .filter(lambda x: x % 3 == 0)
        .fold(operator.add)
    ),
    "bag-frequencies": lambda: db.from_sequence(
        [f"w{i % 17}" for i in range(400)], npartitions=4
    ).frequencies(sort=True),
    "bag-foldby": lambda: db.from_sequence(range(300), npartitions=3).foldby(
        lambda x: x % 7, operator.add, 0
    ),
    "bag-groupby": lambda: (
        db.from_sequence(range(100), npartitions=4)
        .groupby(lambda x: x % 5, shuffle="tasks")
        .map(lambda kv: (kv[0], sorted(kv[1])))
    ),
    "df-column-arithmetic": lambda: (_ddf().b * 2 + _ddf().c).sum(),
    "df-groupby-agg": lambda: _ddf().groupby("a").agg({"b": "mean", "c": "max"}),
    "df-set-index": lambda: _ddf().set_index("c").b,
    "df-task-shuffle": lambda: _ddf().shuffle("a", shuffle_method="tasks").groupby("a").b.sum(),
    "df-merge": lambda: _ddf().merge(dd.from_pandas(RIGHT, npartitions=2), on="a"),
}


def assert_same(got: Any, expected: Any) -> None:
    """Equal values, whatever the collection type (order of rows/items normalised where
    dask itself gives no order)."""
    if isinstance(expected, pd.DataFrame | pd.Series):
        assert type(got) is type(expected)
        if isinstance(expected, pd.DataFrame):
            got = got.sort_values(list(got.columns)).reset_index(drop=True)
            expected = expected.sort_values(list(expected.columns)).reset_index(drop=True)
            pd.testing.assert_frame_equal(got, expected)
        else:
            pd.testing.assert_series_equal(got.sort_index(), expected.sort_index())
    elif isinstance(expected, np.ndarray | np.generic):
        assert np.shape(got) == np.shape(expected)
        np.testing.assert_allclose(got, expected)
    elif isinstance(expected, list):
        assert sorted(map(repr, got)) == sorted(map(repr, expected))
    else:
        assert got == expected


@pytest.fixture(scope="module")
def dask_client(redis_server: Any) -> Iterator[Client]:
    """One cluster for the module (two workers, two threads each); the client is dask's
    default scheduler while it lives."""
    name = f"t-dask-{uuid.uuid4().hex[:8]}"
    with (
        LocalCluster(
            nanny=False,
            n_workers=2,
            threads_per_worker=2,
            redis_url=redis_server.url,
            cluster_name=name,
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


HOW: dict[str, Callable[[Client, Any], Any]] = {
    "dask.compute-client.get": lambda c, x: dask.compute(x, scheduler=c.get)[0],
    "x.compute-scheduler=client": lambda c, x: x.compute(scheduler=c),
    "client.compute": lambda c, x: c.compute(x).result(timeout=60),
    "client.persist": lambda c, x: c.persist(x).compute(scheduler=c.get),
    "default-client": lambda c, x: x.compute(),
}


@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_collections_give_dasks_results(dask_client: Client, workload: str, how: str) -> None:
    expected = WORKLOADS[workload]().compute(scheduler="sync")
    got = HOW[how](dask_client, WORKLOADS[workload]())
    assert_same(got, expected)


def test_dask_config_set_scheduler_client(dask_client: Client) -> None:
    x = _array().sum()
    with dask.config.set(scheduler=dask_client):
        assert np.isclose(x.compute(), x.compute(scheduler="sync"))
        (persisted,) = dask.persist(x)
        assert np.isclose(persisted.compute(), x.compute(scheduler="sync"))


def test_a_default_client_computes_on_the_workers_not_here(dask_client: Client) -> None:
    workers = dask_client.scheduler_info()["workers"]
    address, pid = delayed(where)(uuid.uuid4().hex).compute()
    assert address in workers
    assert pid != os.getpid()
    assert pid == workers[address]["pid"]


def test_closing_the_client_restores_dasks_scheduler(make_cluster: ClusterFactory) -> None:
    before = dask.config.get("scheduler", None)
    with make_cluster(nanny=False, n_workers=1) as cluster:
        client = Client(cluster)
        assert dask.config.get("scheduler") is client
        assert dask.config.get("dataframe.shuffle.method") == "tasks"
        client.close()
    assert dask.config.get("scheduler", None) is before


def test_futures_inside_graphs_and_delayed_calls(dask_client: Client) -> None:
    c = dask_client
    x = c.submit(inc, 1)
    futures = c.map(inc, range(10))
    assert delayed(inc)(x).compute() == 3
    assert delayed(sum)(futures).compute() == sum(range(1, 11))
    assert c.get({"y": (inc, x)}, "y") == 3
    assert c.get({"y": (operator.add, x, "z"), "z": 10}, "y") == 12
    total = da.from_delayed(delayed(np.array)(futures), shape=(10,), dtype=int)
    assert int(total.sum().compute()) == sum(range(1, 11))


def test_get_keeps_dask_keys_and_takes_task_spec_nodes(dask_client: Client) -> None:
    from dask._task_spec import Alias, DataNode, Dict, List, Task, TaskRef

    graph = {
        ("x", 0): DataNode(("x", 0), 10),
        ("x", 1): Task(("x", 1), inc, TaskRef(("x", 0))),
        "alias": Alias("alias", ("x", 1)),
        "list": Task("list", sum, List(TaskRef(("x", 0)), TaskRef(("x", 1)), 5)),
        "dict": Task("dict", sorted, Dict({"k": TaskRef("alias")})),
    }
    got = dask_client.get(graph, [[("x", 1), "alias"], "list", "dict"])
    assert got == [[11, 11], 26, ["k"]]
    futures = dask_client.get(graph, [("x", 1)], sync=False)
    assert futures[0].key == ("x", 1)
    assert futures[0].result(timeout=30) == 11


def test_get_honours_retries_workers_and_annotations(dask_client: Client, tmp_path: Path) -> None:
    flaky = tmp_path / "failed-once"

    def fail_once(path: str) -> str:
        if not os.path.exists(path):
            Path(path).touch()
            raise RuntimeError("first attempt fails")
        return "ok"

    assert dask_client.get({"f": (fail_once, str(flaky))}, "f", retries=1) == "ok"
    address = sorted(dask_client.scheduler_info()["workers"])[0]
    tag = uuid.uuid4().hex
    assert dask_client.get({"w": (where, tag)}, "w", workers=[address])[0] == address
    with dask.annotate(workers=[address]):
        pinned = delayed(where)(uuid.uuid4().hex)
    assert pinned.compute()[0] == address


def test_killing_a_worker_in_the_middle_of_a_shuffle_gives_the_right_result(
    tmp_path: Path, make_cluster: ClusterFactory
) -> None:
    go = tmp_path / "go"

    def hold(df: pd.DataFrame, partition_info: dict[str, Any] | None = None) -> pd.DataFrame:
        """The later partitions wait until the test has killed a worker."""
        import threading
        import time

        number = (partition_info or {}).get("number", 0)
        (tmp_path / f"started-{number}").touch()
        deadline = time.monotonic() + 60
        while number >= 3 and not go.exists() and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        return df

    ddf = dd.from_pandas(PDF, npartitions=6).map_partitions(hold, meta=PDF)
    shuffled = ddf.shuffle("a", shuffle_method="tasks").groupby("a").agg({"b": "sum", "c": "min"})
    expected = PDF.groupby("a").agg({"b": "sum", "c": "min"})
    with (
        make_cluster(
            nanny=False,
            n_workers=3,
            threads_per_worker=2,
        ) as cluster,
        Client(cluster) as client,
    ):
        future = client.compute(shuffled)
        poll(lambda: len(list(tmp_path.glob("started-*"))) >= 2, timeout=30)
        victim = sorted(client.scheduler_info()["workers"].values(), key=lambda w: w["name"])[0]
        os.kill(victim["pid"], signal.SIGKILL)
        go.touch()
        got = future.result(timeout=90)
    pd.testing.assert_frame_equal(got.sort_index(), expected.sort_index())
