"""CPU per task of each process of a 2-worker ``LocalCluster`` during ``map``s of no-ops
(not a test): what a task costs the client, the scheduler, the workers and Redis, which
moves far less with a shared machine's load than tasks/s.  To compare two versions of
redisdask, run this from each checkout in turn, alternating (``PYTHONPATH`` on the other
checkout; docs/performance.md, "Issue 24, before and after").

    python bench/map_cpu.py [--tasks 10000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import _tasks
import psutil
from roundtrip import _cpu, _role

import redisdask
from redisdask import Client, LocalCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks per map")
    parser.add_argument("--repeats", type=int, default=3, help="maps measured")
    args = parser.parse_args()
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, nanny=False) as cluster,
        Client(cluster) as client,
    ):
        client.gather(client.map(_tasks.noop, range(2000), pure=False))  # warm-up
        me = psutil.Process()
        procs = {"client": me} | {f"{_role(p)}-{p.pid}": p for p in me.children(recursive=True)}
        before, start = _cpu(procs), time.perf_counter()
        for _ in range(args.repeats):
            client.gather(client.map(_tasks.noop, range(args.tasks), pure=False))
        wall, after = time.perf_counter() - start, _cpu(procs)
    n = args.tasks * args.repeats
    roles: dict[str, float] = {}
    for name in after:
        role = name.rsplit("-", 1)[0] if name != "client" else name
        roles[role] = roles.get(role, 0.0) + (after[name] - before[name]) / n * 1e6
    shown = ", ".join(f"{r} {us:.0f}" for r, us in sorted(roles.items(), key=lambda x: -x[1]))
    print(f"{redisdask.__file__}: {n / wall:,.0f} tasks/s; CPU us per task: {shown}")


if __name__ == "__main__":
    main()
