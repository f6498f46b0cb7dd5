"""A scheduler state of every kind of task, written to a real Redis through the real
path (``SchedulerState`` -> ``Translator`` -> ``APPLY_FENCED``, claims through the
``CLAIM`` script), for the tests and measurements of ``load_state``.

``build(r, keys, n)`` submits ``n`` tasks in entries of 1,000, as a client does: ``a-i``
(no dependencies; some with resources, some restricted to a worker, some with retries)
and ``b-i``, which depends on ``a-i`` (and, for a few, on a key nobody submitted).  A
worker claims a share of them; most of those finish with their result kept in the
record (``who_has`` names ``redis``), some finish holding it on the worker only, some
err, and the last claims stay ``processing``.  What is left is ``queued``, ``waiting``
or ``no-worker``.  Returns the state machine, to compare with what ``load_state`` reads.
"""

from __future__ import annotations

import pickle
from typing import Any

import redis

from redisdask.protocol import (
    AddWorker,
    Stimulus,
    TaskErred,
    TaskFinished,
    UpdateGraph,
)
from redisdask.scheduler.state import SchedulerState
from redisdask.scheduler.translator import Translator, decode_entry
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import pack
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import Scripts

GPU_WORKER = "tcp://10.0.0.1:1"
CPU_WORKER = "tcp://10.0.0.2:2"
CLIENT = "client-mixed"
CHUNK = 1000


class Writer:
    """The state machine and its fenced writes, as the scheduler's driver does them."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        ensure_cluster(r, keys)
        self.r, self.keys = r, keys
        self.state = SchedulerState()
        self.translator = Translator(keys)
        self.scripts = Scripts(r, keys)
        self.token = self.scripts.acquire_lease(token=None, ttl_ms=600_000).decode()
        self.n = 0
        self.read_to = "0-0"  # the last entry of the workers stream applied

    def apply(self, *events: Stimulus) -> None:
        commands = self.translator.to_commands(self.state.handle_stimulus(*events))
        commands.append(["HSET", self.keys.meta, "seq", self.state.seq])
        self.scripts.apply_fenced(token=self.token, commands=commands, ttl_ms=600_000)

    def sid(self) -> str:
        self.n += 1
        return f"mixed-{self.n}"

    def claims(self) -> list[str]:
        """Apply the claims the ``CLAIM`` script announced; the keys claimed."""
        claimed = []
        for entry_id, fields in self.r.xrange(self.keys.worker_stream, f"({self.read_to}"):
            self.read_to = entry_id.decode()
            events = decode_entry(entry_id, fields, "workers")
            claimed += [key for ev in events for key in getattr(ev, "keys", ())]
            self.apply(*events)
        return claimed


def build(r: redis.Redis, keys: Keys, n: int, claimed_share: float = 0.4) -> SchedulerState:
    w = Writer(r, keys)
    for address, resources in ((GPU_WORKER, {"GPU": 1}), (CPU_WORKER, {})):
        info = {"name": address[-1], "host": address[6:].split(":")[0], "nthreads": 1,
                "resources": resources}  # fmt: skip
        r.hset(keys.workers, address, pack(info))  # the worker's own write
        w.apply(AddWorker(worker=address, info=info, stimulus_id=w.sid()))
    r.hset(keys.clients, CLIENT, pack({"host": "h", "pid": 1, "last_seen": 0}))
    half = n // 2
    tasks: list[dict[str, Any]] = []
    for i in range(half):
        a: dict[str, Any] = {"key": f"a-{i}", "spec": b"spec-a", "deps": [], "retries": i % 3}
        if i % 97 == 1:
            a["resources"] = {"GPU": 1}
        elif i % 89 == 2:
            a["workers"] = [CPU_WORKER]
            a["allow_other_workers"] = i % 2 == 0
        elif i % 83 == 3:
            a["workers"] = ["10.9.9.9"]  # nobody there: no-worker
        deps = [f"a-{i}"] + ([f"ghost-{i}"] if i % 1001 == 4 else [])
        tasks += [a, {"key": f"b-{i}", "spec": b"spec-b", "deps": deps, "priority": i % 2}]
    for i in range(0, len(tasks), CHUNK):
        chunk = tasks[i : i + CHUNK]
        wanted = [t["key"] for t in chunk if t["key"].startswith("b-")]
        w.apply(UpdateGraph(client=CLIENT, tasks=chunk, wanted=wanted, stimulus_id=w.sid()))
    target, done = int(n * claimed_share), 0
    while done < target:
        w.scripts.claim(worker=GPU_WORKER, count=2, last_inbox_id="0-0", free="GPU=1")
        w.scripts.claim(worker=CPU_WORKER, count=1000, last_inbox_id="0-0")
        claimed = w.claims()
        if not claimed:
            break
        finished: list[Stimulus] = []
        for key in claimed[: max(0, len(claimed) - 50)]:  # the last claims stay processing
            ts = w.state.tasks[key]
            worker, i = ts.processing_on or CPU_WORKER, int(key.split("-")[1])
            if i % 37 == 5:
                finished.append(
                    TaskErred(worker=worker, key=key, exception=pickle.dumps(ValueError(key)),
                              traceback=None, exception_text=f"ValueError: {key}",
                              traceback_text="tb", score=ts.score, stimulus_id=w.sid())
                )  # fmt: skip
            else:
                value = None if i % 50 == 6 else pickle.dumps(i)  # held by the worker alone
                finished.append(
                    TaskFinished(worker=worker, key=key, nbytes=28, type="int", value=value,
                                 score=ts.score, stimulus_id=w.sid())
                )  # fmt: skip
        for i in range(0, len(finished), 1000):
            w.apply(*finished[i : i + 1000])
        done += len(claimed)
    return w.state
