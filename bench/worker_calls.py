"""What running code on the workers costs (not a test): ``client.run`` round trips,
``register_plugin`` + ``unregister_worker_plugin``, ``upload_file``, and the cost of a
plugin's ``transition`` hook on a stream of tiny tasks (with Dask ``distributed`` side by
side where it has the same call).  Medians of ``--repeats`` (default 5).

    python bench/worker_calls.py [--workers 2] [--repeats 5] [--tasks 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redisdask import Client, LocalCluster, WorkerPlugin


def noop(x: int = 0) -> int:
    return x


class Quiet(WorkerPlugin):
    name = "quiet"

    def transition(self, key: str, start: str, finish: str, **kwargs: Any) -> None:
        pass


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def tasks_per_second(client: Any, n: int) -> float:
    start = time.perf_counter()
    client.gather(client.map(noop, range(n), pure=False))
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=2000)
    args = parser.parse_args()
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        module = Path(tmp, "rdbench_upload.py")
        module.write_text("VALUE = 1\n")
        with (
            LocalCluster(n_workers=args.workers, threads_per_worker=1) as cluster,
            Client(cluster, set_as_default=False) as client,
        ):
            client.run(noop)  # warm: imports on the workers
            rows.append(
                ("client.run(noop)", f"{median_ms(lambda: client.run(noop), 20):.1f} ms", "")
            )

            def plugin_round() -> None:
                client.register_plugin(Quiet())
                client.unregister_worker_plugin("quiet")

            rows.append(
                ("register + unregister", f"{median_ms(plugin_round, args.repeats):.1f} ms", "")
            )
            upload = median_ms(lambda: client.upload_file(module), args.repeats)
            rows.append(("upload_file (10 B .py)", f"{upload:.1f} ms", ""))
            tasks_per_second(client, 200)  # warm
            bare, hooked = [], []
            for _ in range(args.repeats):  # interleaved: the machine's load drifts
                bare.append(tasks_per_second(client, args.tasks))
                client.register_plugin(Quiet())
                hooked.append(tasks_per_second(client, args.tasks))
                client.unregister_worker_plugin("quiet")
            for label, runs in (("no plugin", bare), ("a transition plugin", hooked)):
                rate = statistics.median(runs)
                rows.append((f"{args.tasks} tiny tasks, {label}", f"{rate:,.0f} tasks/s", ""))
    try:
        from distributed import Client as DaskClient
        from distributed import LocalCluster as DaskCluster
    except ImportError:
        DaskClient = None
    if DaskClient is not None:
        with (
            DaskCluster(n_workers=args.workers, threads_per_worker=1, processes=True) as cluster,
            DaskClient(cluster) as dask_client,
        ):
            dask_client.run(noop)
            dask = median_ms(lambda: dask_client.run(noop), 20)
            rows[0] = (rows[0][0], rows[0][1], f"{dask:.1f} ms")
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'redisdask':>16}  {'distributed':>12}")
    for what, ours, theirs in rows:
        print(f"{what:{width}}  {ours:>16}  {theirs:>12}")


if __name__ == "__main__":
    main()
