"""No per-request key or frame limit a user can hit: 30,000 small results held by one
worker are gathered, depended upon and handed over at retirement, in bounded requests
(their keys alone, ~38 bytes each, pass the 1 MiB header cap of one request).

Small results are also kept in Redis (``worker.inline-result-bytes``); these tests turn
that off where the point is the peer-to-peer path, and keep it on where the point is that
the Redis path scales the same way."""

from __future__ import annotations

import pytest
from conftest import ClusterFactory
from polling import poll

from redisdask import Client

N = 30_000


def inc(x: int) -> int:
    return x + 1


def total(values: list[int]) -> int:
    return sum(values)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inline", [0, 65_536], ids=["peer-to-peer", "kept-in-redis"])
def test_thirty_thousand_results_of_one_worker(
    monkeypatch: pytest.MonkeyPatch,
    inline: int,
    make_cluster: ClusterFactory,
) -> None:
    monkeypatch.setenv("REDISDASK__WORKER__INLINE_RESULT_BYTES", str(inline))
    with (
        make_cluster(nanny=False, n_workers=2) as cluster,
        Client(cluster) as client,
    ):
        holder, other = sorted(client.scheduler_info()["workers"])
        futures = client.map(inc, range(N), workers=[holder])
        expected = sum(range(1, N + 1))
        assert sum(client.gather(futures, direct=True)) == expected
        # a task on the other worker that needs all of them: it fetches them in bounded
        # requests (one request naming them all passed the header cap, and never ran)
        summed = client.submit(total, futures, workers=[other])
        assert summed.result(timeout=120) == expected
        # the holder retires: what only it held is handed over first, nothing recomputed
        client.retire_workers([holder], timeout=120)
        poll(lambda: list(client.scheduler_info()["workers"]) == [other], timeout=60)
        assert sum(client.gather(futures)) == expected
        if not inline:  # every result moved to the worker that stays
            held = client.who_has(futures)
            assert all(held[f.key] == [other] for f in futures)
