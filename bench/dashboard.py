"""The dashboard's cost and speed, measured (not a test).

A cluster of ``--workers`` worker processes (no nannies) on a Redis of its own, and the
dashboard's web application served from this process (uvicorn, in a thread) on a Redis
client that counts every command it sends, pipelined ones included.  Viewers are
server-sent-event readers of ``/live/<fragment>``, as an open browser tab is:

1. ``idle``: Redis commands/s the dashboard sends with one viewer of each page in turn,
   and of all pages at once, on an idle cluster; beside them the cluster's own
   commands/s (``INFO`` ``total_commands_processed``, less the dashboard's);
2. ``map``: the same for the status and task-stream pages while ``client.map`` runs
   10,000-task maps back to back;
3. ``death``: a worker under a nanny killed with SIGKILL: seconds from the kill to its
   death record in Redis, and to the deaths page's stream showing it (median of
   ``--deaths`` kills);
4. ``log-cap``: Redis bytes of one worker's log stream at its caps (``MEMORY USAGE``):
   10,000 records of a typical line, and a chatty task's 16 KiB lines at the 4 MB cap;
5. ``shipping``: tasks/s of a 10,000-task map whose every task logs a warning, with the
   records shipped to Redis and with ``retention.logs: 0`` (none shipped), alternating,
   2 workers, fresh clusters (median of ``--repeats``);
6. ``scale``: seconds to read and render each page's parts (median of 5, no cache) on a
   cluster written into Redis as 100 workers (their heartbeats and stories), 100 task
   prefixes and then 1,000,000 task records: a page must cost the same with and without
   them (no process runs: the records are what a page reads).

    python bench/dashboard.py [--workers 8] [--seconds 10] [--deaths 5] [--repeats 3]
                              [--only NAME ...] [--json out.json]

Needs ``pip install -e '.[dashboard]'``.  The machine is shared and noisy: quote medians.
Log shipping's cost on throughput is measured by ``bench/throughput.py`` run with
``REDISDASK__RETENTION__LOGS=0`` (nothing shipped) and without, alternately.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

import redis
import uvicorn

from redisdask import Client, LocalCluster
from redisdask.dashboard.app import Renderer, build_app
from redisdask.deploy.embedded import EmbeddedRedis
from redisdask.store import logship
from redisdask.store.codecs import pack
from redisdask.store.keyspace import Keys

PAGES = ("status", "task-stream", "workers", "deaths", "events", "logs")


class CountingRedis(redis.Redis):
    """A client that counts the commands it sends (each command of a pipeline too)."""

    sent = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        CountingRedis.sent += 1
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        execute = pipe.execute

        def counted(*args: Any, **kwargs: Any) -> Any:
            CountingRedis.sent += len(pipe.command_stack)
            return execute(*args, **kwargs)

        pipe.execute = counted
        return pipe


class Viewer(threading.Thread):
    """An open tab: reads the server-sent events of one fragment until stopped."""

    def __init__(self, base: str, fragment: str, query: str = "") -> None:
        super().__init__(daemon=True)
        self.url = f"{base}/live/{fragment}" + (f"?{query}" if query else "")
        self.stop = threading.Event()
        self.events: list[tuple[float, str]] = []

    def run(self) -> None:
        with urllib.request.urlopen(self.url, timeout=60) as stream:
            data: list[str] = []
            while not self.stop.is_set():
                line = stream.readline().decode()
                if not line:
                    return
                if line.startswith("data: "):
                    data.append(line[6:].rstrip("\n"))
                elif line == "\n" and data:
                    self.events.append((time.monotonic(), "\n".join(data)))
                    data = []


def serve(url: str, cluster: str) -> str:
    """The dashboard of ``cluster`` on a free port of this process; its base URL."""
    r = CountingRedis.from_url(url)
    app = build_app(r, cluster, url, interval=1.0)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}"


def rates(r: redis.Redis, base: str, fragments: tuple[str, ...], seconds: float) -> dict:
    """Commands/s of the dashboard with one viewer of each of ``fragments``, and of the
    rest of the cluster, over ``seconds``."""
    viewers = [Viewer(base, f, "w=worker-0" if f == "logs" else "") for f in fragments]
    for viewer in viewers:
        viewer.start()
    time.sleep(2)  # (the first renderings, not counted)
    total0, mine0, t0 = r.info("stats")["total_commands_processed"], CountingRedis.sent, time.time()
    time.sleep(seconds)
    total1, mine1, t1 = r.info("stats")["total_commands_processed"], CountingRedis.sent, time.time()
    for viewer in viewers:
        viewer.stop.set()
    mine = (mine1 - mine0) / (t1 - t0)
    return {
        "dashboard_per_s": round(mine, 1),
        "cluster_per_s": round((total1 - total0) / (t1 - t0) - mine, 1),
    }


def inc(x: int) -> int:
    return x + 1


def command_rates(url: str, workers: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    r = redis.Redis.from_url(url)
    with LocalCluster(n_workers=workers, nanny=False, redis_url=url) as cluster:
        base = serve(url, cluster.cluster_name)
        for page in PAGES:
            out[f"idle {page}"] = rates(r, base, (page,), seconds)
            print(f"idle, one viewer of {page}: {out[f'idle {page}']}", flush=True)
        out["idle all pages"] = rates(r, base, PAGES, seconds)
        print(f"idle, one viewer of every page: {out['idle all pages']}", flush=True)
        with Client(cluster) as client:
            stop = threading.Event()

            def maps() -> None:
                while not stop.is_set():
                    client.gather(client.map(inc, range(10_000), pure=False))

            runner = threading.Thread(target=maps, daemon=True)
            runner.start()
            for pages in (("status",), ("task-stream",), ("status", "task-stream")):
                name = "map " + "+".join(pages)
                out[name] = rates(r, base, pages, seconds)
                print(f"10,000-task maps, viewers of {pages}: {out[name]}", flush=True)
            stop.set()
            runner.join()
    return out


def death_times(url: str, kills: int) -> dict[str, Any]:
    to_record, to_page = [], []
    with LocalCluster(n_workers=1, nanny=True, redis_url=url) as cluster, Client(cluster) as client:
        base = serve(url, cluster.cluster_name)
        keys = Keys(cluster.cluster_name)
        r = redis.Redis.from_url(url)
        viewer = Viewer(base, "deaths")
        viewer.start()
        for _ in range(kills):
            cluster.wait_for_workers(1)
            [(address, info)] = client.scheduler_info()["workers"].items()
            last = r.xrevrange(keys.deaths, count=1)
            after = last[0][0] if last else "0-0"
            seen = len(viewer.events)
            killed = time.monotonic()
            os.kill(info["pid"], signal.SIGKILL)
            r.xread({keys.deaths: after}, block=30_000)
            to_record.append(time.monotonic() - killed)
            while not any(address in html for _, html in viewer.events[seen:]):
                time.sleep(0.005)
            shown = next(t for t, html in viewer.events[seen:] if address in html)
            to_page.append(shown - killed)
            print(f"killed {address}: record {to_record[-1]:.2f} s, page {to_page[-1]:.2f} s")
            while address in client.scheduler_info()["workers"]:
                time.sleep(0.05)
        viewer.stop.set()
    return {
        "kill_to_record_s": round(statistics.median(to_record), 2),
        "kill_to_page_s": round(statistics.median(to_page), 2),
    }


def log_cap_bytes(url: str) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    out = {}
    line = "2026-11-28 12:00:00,000 INFO worker: Worker tcp://10.0.0.7:40123 starting a task"
    for name, message, n in (("typical", line, 10_000), ("chatty 16 KiB", "x" * 16_384, 2_000)):
        handler = logship.RedisLogHandler(url, maxlen=10_000, ttl=600, stream=f"bench:{name}")
        log = logging.getLogger(f"bench.{name}")
        log.propagate = False
        log.addHandler(handler)
        for i in range(n):
            log.warning("%d %s", i, message)
            if i % 1000 == 999:
                time.sleep(0.6)  # (let the thread write: its buffer keeps 10,000)
        handler.close()
        out[name] = {"records": r.xlen(f"bench:{name}"), "bytes": r.memory_usage(f"bench:{name}")}
        print(f"log stream at its cap, {name}: {out[name]}", flush=True)
        r.delete(f"bench:{name}")
    return out


def log_inc(x: int) -> int:
    logging.getLogger("bench.task").warning("task %d ran", x)
    return x + 1


def shipping_cost(url: str, repeats: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"shipped": [], "not shipped": []}
    for _ in range(repeats):
        for mode in rates:
            os.environ["REDISDASK__RETENTION__LOGS"] = "0" if mode == "not shipped" else "10000"
            with (
                LocalCluster(n_workers=2, nanny=False, redis_url=url) as cluster,
                Client(cluster) as client,
            ):
                client.gather(client.map(log_inc, range(1000), pure=False))  # warm-up
                start = time.perf_counter()
                client.gather(client.map(log_inc, range(10_000), pure=False))
                rates[mode].append(10_000 / (time.perf_counter() - start))
            print(f"map of 10,000 logging tasks, records {mode}: {rates[mode][-1]:.0f} tasks/s")
    os.environ.pop("REDISDASK__RETENTION__LOGS")
    out = {mode: round(statistics.median(v)) for mode, v in rates.items()}
    out["ratio"] = round(out["shipped"] / out["not shipped"], 3)
    return out


def synthetic_cluster(r: redis.Redis, keys: Keys, workers: int, prefixes: int) -> None:
    """Workers, heartbeats, stories and a summary as a running cluster writes them."""
    now = time.time()
    pipe = r.pipeline(transaction=False)
    for i in range(workers):
        address = f"tcp://10.0.{i // 250}.{i % 250}:40000"
        info = {"address": address, "name": f"worker-{i}", "host": "h", "pid": i,
                "nthreads": 4, "memory_limit": 8e9, "nanny": 1, "restarts": 0}  # fmt: skip
        beat = {"time": now, "executing": [f"inc-{i}"], "n_executing": 4, "ready": 10,
                "in_memory": 5000, "cpu": 350.0, "managed": 2e9, "spilled": 0,
                "rss": 3e9, "unmanaged": 1e9, "memory_limit": 8e9, "status": "running"}  # fmt: skip
        pipe.hset(keys.workers, address, pack(info))
        pipe.hset(keys.heartbeats, address, pack(beat))
        for entry in range(20):
            rows = [[now - 30 + entry + k / 100, f"p{k % prefixes}-{i}-{entry}-{k}",
                     "ready" if k % 2 == 0 else "executing",
                     "executing" if k % 2 == 0 else "memory", "s"] for k in range(100)]  # fmt: skip
            pipe.xadd(keys.worker_story(address), {"m": pack(rows)})
    counts = {
        f"p{k}": {"memory": 10_000, "processing": 50, "queued": 1000} for k in range(prefixes)
    }
    pipe.hset(keys.summary, mapping={"prefixes": pack(counts), "time": now})
    pipe.execute()


def million_tasks(r: redis.Redis, keys: Keys, n: int) -> None:
    for start in range(0, n, 20_000):
        pipe = r.pipeline(transaction=False)
        batch = [f"p{i % 100}-{i}" for i in range(start, min(start + 20_000, n))]
        for key in batch:
            pipe.hset(keys.task(key), mapping={"state": "memory", "deps": b"", "nbytes": 8})
        pipe.sadd(keys.tasks, *batch)
        pipe.execute()


def render_times(url: str, cluster: str) -> dict[str, float]:
    renderer = Renderer(redis.Redis.from_url(url), Keys(cluster), url, ttl=0.0)
    parts: dict[str, dict[str, str]] = {
        "status": {}, "task-stream": {}, "workers": {}, "deaths": {}, "events": {},
        "worker": {"w": "worker-7"}, "logs": {"w": "worker-7"}, "task": {"key": "p7-7"},
    }  # fmt: skip
    out = {}
    for name, params in parts.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            html = renderer.fragment(name, params)
            times.append(time.perf_counter() - start)
        assert "did not answer" not in html and "malformed" not in html, html[:300]
        out[name] = round(statistics.median(times), 4)
    return out


def scale(url: str) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    keys = Keys("scale")
    r.hset(keys.meta, "schema_version", 1)
    synthetic_cluster(r, keys, workers=100, prefixes=100)
    before = render_times(url, "scale")
    print(f"100 workers, no tasks: seconds per part {before}", flush=True)
    million_tasks(r, keys, 1_000_000)
    after = render_times(url, "scale")
    print(f"100 workers, 1,000,000 tasks: seconds per part {after}", flush=True)
    return {"no tasks": before, "1,000,000 tasks": after}


SCENARIOS = ("commands", "death", "log-cap", "shipping", "scale")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--deaths", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = {
        "commands": lambda url: command_rates(url, args.workers, args.seconds),
        "death": lambda url: death_times(url, args.deaths),
        "log-cap": log_cap_bytes,
        "shipping": lambda url: shipping_cost(url, args.repeats),
        "scale": scale,
    }
    results = {}
    for name in args.only:
        with EmbeddedRedis() as server:  # a Redis of its own each: nothing left over
            results[name] = runs[name](server.url)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
