"""Tasks run twice after a restart (issue 22), measured (not a test).

A 2-worker x 1-thread cluster (no nannies) runs ``--tasks`` tiny tasks that each append
their argument to a list in a separate Redis (so a Redis fault loses no count).  Faults,
each once ``--tasks`` / (faults + 1) more have run:

* ``scheduler``: the scheduler is ``kill -9``'d and a replacement started at once (it
  takes the lease once the dead one's expires; ``scheduler.lease-ttl`` 1 s here);
* ``redis``: Redis (AOF everysec) is ``kill -9``'d and started again on its AOF.

Reported per run: tasks run twice, tasks claimed by the workers at each fault (their
processing sets: what may rightly run again), and seconds from each fault until the
client hears of one more finished task (work moving again).

    python bench/reruns.py [--tasks 10000] [--fault scheduler|redis] [--faults 2]
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
import uuid
from collections import Counter

import cloudpickle
import redis

from redisdask import Client, LocalCluster
from redisdask.deploy.embedded import EmbeddedRedis


def record(i: int, url: str, runs: str) -> int:
    redis.Redis.from_url(url).rpush(runs, i)
    return i


cloudpickle.register_pickle_by_value(__import__(__name__))


def claimed(cluster: LocalCluster) -> int:
    r = cluster.redis
    return sum(
        r.scard(cluster.keys.worker_processing(w.decode())) for w in r.hkeys(cluster.keys.workers)
    )


def until_moving(futures: list, start: float) -> float:
    """Seconds from ``start`` until the client hears of one more finished task."""
    done = sum(f.done() for f in futures)
    while sum(f.done() for f in futures) <= done:
        time.sleep(0.005)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--fault", choices=("scheduler", "redis"), default="scheduler")
    parser.add_argument("--faults", type=int, default=2)
    args = parser.parse_args()
    runs, name = f"runs-{uuid.uuid4().hex[:8]}", f"reruns-{uuid.uuid4().hex[:8]}"
    with (
        tempfile.TemporaryDirectory() as data,
        EmbeddedRedis() as tally,
        EmbeddedRedis(data_dir=data) as server,
        LocalCluster(
            nanny=False,
            n_workers=2,
            threads_per_worker=1,
            redis_url=server.url,
            cluster_name=name,
            scheduler_options={"lease_ttl": 1},
        ) as cluster,
        Client(cluster) as client,
    ):
        r = redis.Redis.from_url(tally.url)
        futures = client.map(record, range(args.tasks), url=tally.url, runs=runs)
        at_fault, moving = [], []
        for k in range(1, args.faults + 1):
            while r.llen(runs) < args.tasks * k // (args.faults + 1):
                time.sleep(0.005)
            at_fault.append(claimed(cluster))
            start = time.monotonic()
            if args.fault == "scheduler":
                cluster.scheduler_process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                cluster.scheduler_process.wait()  # type: ignore[union-attr]
                cluster.start_scheduler()
            else:
                server.kill()
                server.start()
            moving.append(round(until_moving(futures, start), 2))
        assert client.gather(futures) == list(range(args.tasks))
        counts = Counter(int(v) for v in r.lrange(runs, 0, -1))
        twice = sum(1 for n in counts.values() if n > 1)
        print(
            f"{args.fault} kill -9 x{args.faults}, {args.tasks} tasks: {twice} ran twice; "
            f"claimed at the faults {at_fault}; work moving again after {moving} s"
        )


if __name__ == "__main__":
    main()
