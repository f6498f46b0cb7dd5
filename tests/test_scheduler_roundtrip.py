"""Round trip of the scheduler's Redis mapping, as a property (real Redis, plain ``random``
with fixed seeds; no new dependency).

Random event sequences (workers joining, leaving, dying and re-registering; graphs with
dependencies, restrictions, retries and priorities; claims through the real ``CLAIM``
script, delivered late; results, errors, missing data, replicas, rebalances and the
copies they ask for, releases, cancels, scatters, retirements, restarts) go through the
pure ``SchedulerState``; each batch's instructions are translated
(``Translator.to_commands``) and written through the real ``APPLY_FENCED`` script.
Whenever no claim is in flight, ``load_state`` reads the state back and it must equal the
state machine's own, in everything the records carry:

* tasks: state, score, whether a spec is stored, dependencies and dependents, what they
  wait on and who waits on them, who wants them, who holds them, the worker of a
  processing task, size and type, retries, restriction (and whether it is a preference),
  resources, the workers a queued restricted or resourced task is queued on, its
  ``chain``, deaths,
  ``suspicious``, ``killed``, replicas, the error (exception, traceback, their texts,
  where and whose) and ``rejected``;
* the ``no-worker`` set, the sequence counter, workers (info, processing, held keys),
  clients and what each wants, the rebalances under way and their moves in flight, the
  duration average of each task prefix;
* and in Redis itself: each queued task sits in the ready set(s) it is queued on with
  its score (the workers' constrained sets for a task with resources), and each
  worker's processing set is what the state machine has on it.  Workers have GPUs or
  not, and claim with what they have free, so the ``CLAIM`` script's resource check
  runs too, and half the claims with a time budget (threads that start a task now,
  soon or not soon), so its budget check and what a full claim puts back run too.

Not compared, because no record carries them (a reloaded scheduler starts them afresh,
by design): a task's ``queued_on`` once it left ``queued`` (stale, documented), its
``lost_on``, ``replicating``, ``claimed_before`` and ``unlisted``; a worker's
retirement flags, ``announced`` and ``holding_reports``.  Now and then the test goes on
from the reloaded state instead of its own, as a restarted scheduler does.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest
import redis

from redisdask.config import RebalanceConfig
from redisdask.placement import format_resources
from redisdask.protocol import (
    AddKeys,
    AddWorker,
    CancelKeys,
    ClientDesiresKeys,
    ClientReleasesKeys,
    CloseClient,
    Holding,
    MissingData,
    Rebalance,
    ReleasedKeys,
    RemoveWorker,
    Replicate,
    Restart,
    RetireWorkers,
    Stimulus,
    TaskErred,
    TaskFinished,
    UpdateData,
    UpdateGraph,
)
from redisdask.scheduler.state import HOLDS_DEPENDENCIES, SchedulerState
from redisdask.scheduler.translator import Translator, decode_entry, load_state
from redisdask.store.bootstrap import ensure_cluster
from redisdask.store.codecs import pack
from redisdask.store.keyspace import Keys
from redisdask.store.scripts import Scripts

pytestmark = pytest.mark.timeout(240)

# more seeds for a long run: REDISDASK_ROUNDTRIP_SEEDS=1000 pytest tests/test_scheduler_roundtrip.py
SEEDS = range(int(os.environ.get("REDISDASK_ROUNDTRIP_SEEDS", "30")))
STEPS = 150
HOSTS = ("10.0.0.1", "10.0.0.2")
E = TypeVar("E", bound=Stimulus)
# small test data: the thresholds of a rebalance would move nothing
LIMITS = RebalanceConfig(sender_min=0, sender_recipient_gap=0)


def carried(state: SchedulerState) -> dict[str, Any]:
    """What of a scheduler state the Redis records carry (see the module docstring)."""

    def keys(tasks: Any) -> list[str]:
        return sorted(t.key for t in tasks)

    tasks = {}
    for key, ts in state.tasks.items():
        tasks[key] = {
            "state": ts.state,
            "score": ts.score,
            "has_spec": ts.has_spec,
            "dependencies": keys(ts.dependencies),
            "dependents": keys(ts.dependents),
            "waiting_on": keys(ts.waiting_on) if ts.state in HOLDS_DEPENDENCIES else None,
            "waiters": keys(ts.waiters),
            "who_wants": sorted(ts.who_wants),
            "who_has": sorted(ts.who_has),
            "processing_on": ts.processing_on if ts.state == "processing" else None,
            "claimed_at": ts.claimed_at if ts.state == "processing" else None,
            "nbytes": ts.nbytes,
            "type": ts.type,
            "retries": ts.retries,
            "restrict": ts.restrict,
            "loose": ts.loose,
            "resources": ts.resources,
            # (restricted, resourced, or placed by data on one worker: redisdask.scheduler.decide)
            "queued_on": ts.queued_on if ts.state == "queued" else None,
            "chain": ts.chain,  # (redisdask/scheduler/chain.py)
            "suspicious": ts.suspicious,
            "deaths": ts.deaths,
            "killed": ts.killed,
            "replicas": ts.replicas,
            "exception": ts.exception,
            "traceback": ts.traceback,
            "exception_text": ts.exception_text,
            "traceback_text": ts.traceback_text,
            "erred_on": ts.erred_on,
            "exception_blame": ts.exception_blame,
            "rejected": ts.rejected,
        }
    return {
        "tasks": tasks,
        "unrunnable": keys(state.unrunnable),
        "seq": state.seq,
        "workers": {
            a: {"info": ws.info, "processing": keys(ws.processing), "has_what": keys(ws.has_what)}
            for a, ws in state.workers.items()
        },
        "clients": {c: keys(wanted) for c, wanted in state.clients.items()},
        "moving": {k: (m.sender, m.recipient, m.request) for k, m in state.moves.moving.items()},
        "rebalances": {
            name: (r.client, r.planned, r.moved, r.failed, sorted(r.pending))
            for name, r in state.moves.rebalances.items()
        },
        "durations": {"averages": state.durations.averages},
    }


def differences(ours: dict[str, Any], loaded: dict[str, Any]) -> Iterator[str]:
    for section in ("unrunnable", "seq", "clients", "moving", "rebalances", "durations"):
        if ours[section] != loaded[section]:
            yield f"{section}: {ours[section]!r} != loaded {loaded[section]!r}"
    for section in ("tasks", "workers"):
        for name in sorted(set(ours[section]) | set(loaded[section])):
            a, b = ours[section].get(name), loaded[section].get(name)
            if a is None or b is None:
                yield f"{section} {name!r}: ours {a is not None}, loaded {b is not None}"
                continue
            for field in a:
                if a[field] != b[field]:
                    yield f"{section} {name!r} {field}: {a[field]!r} != loaded {b[field]!r}"


class Run:
    """One random sequence: the state machine, its writes to Redis, the checks."""

    def __init__(self, r: redis.Redis, keys: Keys, seed: int) -> None:
        self.r, self.keys, self.rng = r, keys, random.Random(seed)
        self.state = SchedulerState(validate=True, rebalance=LIMITS)
        self.translator = Translator(keys)
        self.scripts = Scripts(r, keys)
        self.token = self.scripts.acquire_lease(token=None, ttl_ms=600_000).decode()
        self.n = 0  # stimulus counter, and a source of fresh names
        self.in_flight: list[list[Stimulus]] = []  # claims made, their message not yet read
        self.claims_read = "0-0"  # the last entry of the workers stream read
        self.clients = ["c0", "c1"]
        self.task_keys: list[str] = []  # every key ever submitted (some are long gone)
        self.history: list[str] = []  # the events so far, for the message of a failure

    # ------------------------------------------------------------------ plumbing

    def sid(self) -> str:
        self.n += 1
        return f"s{self.n}"

    def ev(self, kind: type[E], **fields: Any) -> E:
        """An event of ``kind`` with the next stimulus id."""
        return kind(**fields, stimulus_id=self.sid())

    def apply(self, *events: Stimulus) -> None:
        self.history += [repr(ev) for ev in events]
        instructions = self.state.handle_stimulus(*events)
        commands = self.translator.to_commands(instructions)
        commands.append(["HSET", self.keys.meta, "seq", self.state.seq])
        self.scripts.apply_fenced(token=self.token, commands=commands, ttl_ms=600_000)

    def check(self) -> None:
        loaded = load_state(self.r, self.keys, validate=True, rebalance=LIMITS)
        problems = list(differences(carried(self.state), carried(loaded)))
        problems += list(self.redis_sets())
        assert not problems, "\n".join([*problems[:20], "after:", *self.history[-8:]])
        if self.rng.random() < 0.1:  # go on as a restarted scheduler would
            self.state = loaded

    def redis_sets(self) -> Iterator[str]:
        k = self.keys
        for key, ts in self.state.tasks.items():
            if ts.state != "queued":
                continue
            own = k.worker_constrained if ts.resources else k.worker_ready
            sets = [own(w) for w in ts.queued_on] if ts.queued_on else [k.ready]
            if ts.queued_on and not (ts.restrict or ts.resources):
                sets.append(k.placed)  # placed by data: where other workers find it
            for name in sets:
                if self.r.zscore(name, key) != ts.score:
                    yield f"queued {key!r} (score {ts.score}) not in {name}"
        holders = {m.decode() for m in self.r.smembers(k.holders)}
        if holders != {c for c in self.state.clients if c.startswith("holder:")}:
            yield f"holders set: {sorted(holders)} != {sorted(self.state.clients)}"
        for address, ws in self.state.workers.items():
            held = {m.decode() for m in self.r.smembers(k.worker_processing(address))}
            if held != {ts.key for ts in ws.processing}:
                yield f"processing set of {address}: {sorted(held)} != {ws.processing}"

    # ------------------------------------------------------------------ picks

    def pick(self, items: Any, k: int | None = None) -> Any:
        items = sorted(items)
        if k is None:
            return self.rng.choice(items) if items else None
        return self.rng.sample(items, min(k, len(items)))

    def tasks_in(self, *states: str) -> list[str]:
        return [key for key, ts in self.state.tasks.items() if ts.state in states]

    # ------------------------------------------------------------------ events

    def add_worker(self) -> None:
        known = list(self.state.workers)
        if known and self.rng.random() < 0.2:
            address = self.pick(known)  # a re-registration, maybe of a new process
        else:
            address = f"tcp://{self.rng.choice(HOSTS)}:{1000 + self.n}"
        info = {
            "name": f"w{address.rsplit(':', 1)[1]}",
            "host": address[6:].split(":")[0],
            "nthreads": 1,
            "started": self.rng.choice([1.0, float(self.n)]),
            "resources": self.rng.choice([{}, {}, {"GPU": 1}, {"GPU": 2}]),
        }
        self.r.hset(self.keys.workers, address, pack(info))  # the worker's own write
        self.apply(self.ev(AddWorker, worker=address, info=info))

    def remove_worker(self) -> None:
        address = self.pick(self.state.workers)
        if address is None:
            return
        how = self.rng.choice(["goodbye", "connection", "heartbeat", "nanny"])
        beat = {"time": 1.0, "executing": self.pick(self.task_keys, 2)}
        evidence = {"last_heartbeat": beat} if how != "goodbye" else {}
        self.apply(self.ev(RemoveWorker, worker=address, reason="r", how=how, evidence=evidence))

    def update_graph(self) -> None:
        client = self.pick(self.clients)
        self.r.hset(self.keys.clients, client, pack({"host": "h", "pid": 1, "last_seen": 0}))
        tasks, new = [], []
        for _ in range(self.rng.randint(1, 4)):
            if self.task_keys and self.rng.random() < 0.15:
                key = self.pick(self.task_keys)  # submitted again
            else:
                key = f"t{self.n}-{len(new)}"
                self.n += 1
            pool = self.task_keys + new
            deps = self.pick(pool, self.rng.randint(0, 3)) if pool else []
            if self.rng.random() < 0.05:
                deps.append(f"ghost-{self.n}")  # never submitted by anyone
            task: dict[str, Any] = {
                "key": key,
                "spec": b"spec-" + key.encode(),
                "deps": deps,
                "priority": self.rng.randint(-2, 2),
                "retries": self.rng.choice([0, 0, 1, 2]),
            }
            if self.rng.random() < 0.3:
                names = [*self.state.workers, *HOSTS, "w-nobody", "10.9.9.9"]
                names += [ws.info["name"] for ws in self.state.workers.values()]
                task["workers"] = self.pick(names, self.rng.randint(1, 2))
                if self.rng.random() < 0.3:
                    task["allow_other_workers"] = True
            if self.rng.random() < 0.25:
                task["resources"] = {"GPU": self.rng.choice([1, 1, 2, 3])}
            tasks.append(task)
            new.append(key)
        self.task_keys += [k for k in new if k not in self.task_keys]
        wanted = [k for k in new if self.rng.random() < 0.7]
        if self.rng.random() < 0.2:
            wanted += self.pick(self.task_keys, 1)
        self.apply(self.ev(UpdateGraph, client=client, tasks=tasks, wanted=wanted))

    def claim(self) -> None:
        worker = self.pick(self.state.workers)
        if worker is None:
            return
        # what the worker has free of its GPUs: all, some, or none
        gpus = self.state.workers[worker].info.get("resources", {}).get("GPU", 0)
        free = format_resources({"GPU": self.rng.choice([0, 1, gpus])} if gpus else {})
        # with a time budget (half the time): threads free now, soon, or not soon; a claim
        # that fills it leaves the rest queued in place (what ``redis_sets`` checks)
        budget: dict[str, Any] = {}
        if self.rng.random() < 0.5:
            starts = [self.rng.choice([0.0, 0.01, 0.05]) for _ in range(self.rng.randint(1, 2))]
            budget = {"horizon": 0.02, "starts": starts}
        self.scripts.claim(
            worker=worker, count=self.rng.randint(1, 3), last_inbox_id="0-0", free=free, **budget
        )
        self.claim_read()

    def claim_read(self) -> None:
        """Read the claim's message; it reaches the scheduler later (``deliver_claims``),
        maybe after other events."""
        for entry_id, fields in self.r.xrange(self.keys.worker_stream, f"({self.claims_read}"):
            self.claims_read = entry_id.decode()
            self.in_flight.append(decode_entry(entry_id, fields, "workers"))

    def deliver_claims(self) -> None:
        if self.in_flight:
            self.apply(*self.in_flight.pop(0))

    def finish(self) -> None:
        key = self.pick(self.tasks_in("processing"))
        if key is None:
            return
        ts = self.state.tasks[key]
        worker, score = ts.processing_on, ts.score
        if self.rng.random() < 0.1:
            worker = self.pick(self.state.workers)  # not the claim's worker
        if self.rng.random() < 0.1:
            score -= 1.0  # an earlier run's late result
        kind = self.rng.choice(["int", "numpy.ndarray"])
        nbytes = self.rng.randint(1, 10_000)
        self.apply(
            self.ev(
                TaskFinished,
                worker=worker,
                key=key,
                nbytes=nbytes,
                type=kind,
                start=1.0,
                stop=1.0 + self.rng.choice([0.0, 0.001, 0.02, 2.0]),
                score=score,
                seceded=self.rng.random() < 0.1,
            )
        )

    def err(self) -> None:
        key = self.pick(self.tasks_in("processing"))
        if key is None:
            return
        ts = self.state.tasks[key]
        self.apply(
            self.ev(
                TaskErred,
                worker=ts.processing_on,
                key=key,
                exception=b"exc",
                traceback=self.rng.choice([b"tb", None]),
                exception_text="E: x",
                traceback_text="line 1",
                score=ts.score,
            )
        )

    def missing_data(self) -> None:
        key = self.pick(self.tasks_in("memory", "processing"))
        worker = self.pick(self.state.workers)
        if key is None or worker is None:
            return
        errant = self.pick([*self.state.tasks[key].who_has, ""])
        self.apply(self.ev(MissingData, worker=worker, keys=[key], errant_worker=errant))

    def add_keys(self) -> None:
        keys = self.pick(self.tasks_in("memory"), 2)
        worker = self.pick(self.state.workers)
        if keys and worker:
            nbytes = {k: self.state.tasks[k].nbytes for k in keys}
            self.apply(self.ev(AddKeys, worker=worker, keys=keys, nbytes=nbytes))

    def rebalance(self) -> None:
        client = self.pick(self.clients)
        worker = self.pick(self.state.workers)
        if worker is not None and self.rng.random() < 0.5:  # small data on one worker first
            self.r.hset(self.keys.clients, client, pack({"host": "h", "pid": 1, "last_seen": 0}))
            data = [f"data-{self.n}-{i}" for i in range(self.rng.randint(2, 8))]
            self.task_keys += data
            self.apply(
                self.ev(
                    UpdateData,
                    client=client,
                    who_has={k: [worker] for k in data},
                    nbytes={k: self.rng.choice([8, 8, 100]) for k in data},
                    types={k: "bytes" for k in data},
                )
            )
        keys = workers = None
        if self.rng.random() < 0.3:
            keys = self.pick([*self.tasks_in("memory"), "nobody"], self.rng.randint(1, 4))
        if self.rng.random() < 0.3:
            workers = self.pick(self.state.workers, self.rng.randint(1, 3))
        request = f"r{self.n}"
        self.apply(self.ev(Rebalance, client=client, request=request, keys=keys, workers=workers))

    def move_arrives(self) -> None:
        """A recipient of a rebalance holds the copy it was asked for."""
        key = self.pick(self.state.moves.moving)
        if key is not None:
            worker, nbytes = self.state.moves.moving[key].recipient, self.state.tasks[key].nbytes
            self.apply(self.ev(AddKeys, worker=worker, keys=[key], nbytes={key: nbytes}))

    def move_fails(self) -> None:
        """A recipient of a rebalance could not fetch from its sender."""
        key = self.pick(self.state.moves.moving)
        if key is not None:
            move = self.state.moves.moving[key]
            self.apply(
                self.ev(MissingData, worker=move.recipient, keys=[key], errant_worker=move.sender)
            )

    def released_keys(self) -> None:
        worker = self.pick(self.state.workers)
        if worker is None:
            return
        ws = self.state.workers[worker]
        keys = self.pick([t.key for t in ws.processing | ws.has_what], 2)
        self.apply(self.ev(ReleasedKeys, worker=worker, keys=keys))

    def holding(self) -> None:
        worker = self.pick(self.state.workers)
        if worker is None:
            return
        keys = [t.key for t in self.state.workers[worker].processing if self.rng.random() < 0.7]
        self.apply(self.ev(Holding, worker=worker, keys=sorted(keys)))

    def client_event(self) -> None:
        client = self.pick(self.clients)
        wanted = sorted(t.key for t in self.state.clients.get(client, ()))
        choice = self.rng.random()
        if choice < 0.4 and wanted:
            keys = self.pick(wanted, self.rng.randint(1, 2))
            self.apply(self.ev(ClientReleasesKeys, client=client, keys=keys))
        elif choice < 0.7 and wanted:
            keys = self.pick(wanted, self.rng.randint(1, 2))
            self.apply(self.ev(CancelKeys, client=client, keys=keys, generation=self.n))
        elif choice < 0.85 and self.task_keys and client in self.state.clients:
            keys = self.pick(self.task_keys, 2)
            self.apply(self.ev(ClientDesiresKeys, client=client, keys=keys))
        elif wanted:
            keys = self.pick(wanted, 2)
            self.apply(self.ev(Replicate, client=client, keys=keys, n=self.rng.randint(1, 3)))

    def holder_event(self) -> None:
        """A dataset, a variable or fire-and-forget wants keys (no heartbeat, no events
        stream; restored from the holders set), or lets some go."""
        holder = self.pick(["holder:fire-and-forget", "holder:dataset:d", "holder:variable:v"])
        wanted = sorted(t.key for t in self.state.clients.get(holder, ()))
        if wanted and self.rng.random() < 0.4:
            keys = self.pick(wanted, self.rng.randint(1, 2))
            self.apply(self.ev(ClientReleasesKeys, client=holder, keys=keys))
        elif self.task_keys:
            keys = self.pick(self.task_keys, self.rng.randint(1, 2))
            self.apply(self.ev(ClientDesiresKeys, client=holder, keys=keys))

    def scatter(self) -> None:
        client = self.pick(self.clients)
        holders = self.pick(self.state.workers, self.rng.randint(1, 2))
        if not holders:
            return
        self.r.hset(self.keys.clients, client, pack({"host": "h", "pid": 1, "last_seen": 0}))
        again = self.task_keys and self.rng.random() < 0.3
        key = self.pick(self.task_keys) if again else f"data-{self.n}"
        self.task_keys += [key] if key not in self.task_keys else []
        self.apply(
            self.ev(
                UpdateData,
                client=client,
                who_has={key: holders},
                nbytes={key: 8},
                types={key: "bytes"},
            )
        )

    def retire(self) -> None:
        workers = self.pick(self.state.workers, 1)
        if workers:
            self.apply(self.ev(RetireWorkers, client=self.pick(self.clients), workers=workers))

    def retiring(self) -> None:  # a worker's own word, repeated until it is told to close
        workers = self.pick(self.state.workers, 1)
        if workers:
            self.apply(self.ev(RetireWorkers, workers=workers, force=self.rng.random() < 0.3))

    def close_client(self) -> None:
        client = self.pick(self.clients)
        self.apply(self.ev(CloseClient, client=client))
        self.clients.remove(client)
        self.clients.append(f"c{self.n}")  # another one comes

    def restart(self) -> None:
        self.apply(self.ev(Restart, client=self.pick(self.clients)))

    STEPS = {
        "add_worker": 6,
        "remove_worker": 3,
        "update_graph": 14,
        "claim": 14,
        "deliver_claims": 12,
        "finish": 14,
        "err": 4,
        "missing_data": 3,
        "add_keys": 3,
        "rebalance": 3,
        "move_arrives": 4,
        "move_fails": 1,
        "released_keys": 3,
        "holding": 3,
        "client_event": 10,
        "holder_event": 4,
        "scatter": 3,
        "retire": 1,
        "retiring": 1,
        "close_client": 1,
        "restart": 0.3,
    }

    # what comes from the clients stream: it may overtake a claim's message, which is on
    # the workers stream (as is everything else, and the watch reads that stream before
    # it declares a worker dead)
    FROM_CLIENTS = {
        "update_graph", "client_event", "holder_event", "scatter", "retire", "close_client",
        "restart", "rebalance",
    }  # fmt: skip

    def run(self, steps: int) -> None:
        names, weights = zip(*self.STEPS.items(), strict=True)
        self.add_worker()
        for _ in range(steps):
            step = self.rng.choices(names, weights)[0]
            if step not in self.FROM_CLIENTS and step != "claim":
                while self.in_flight:
                    self.deliver_claims()
            getattr(self, step)()
            if not self.in_flight:
                self.check()
        while self.in_flight:
            self.deliver_claims()
        self.check()


@pytest.mark.parametrize("seed", SEEDS)
def test_what_the_scheduler_writes_reloads_as_its_own_state(
    redis_url: str, cluster_name: str, seed: int
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    try:
        Run(r, keys, seed).run(STEPS)
    finally:
        for name in r.scan_iter(match=keys.prefix.replace("{", "[{]") + "*", count=1000):
            r.delete(name)


# --------------------------------------------------------------------------- found by it


@pytest.fixture
def run(redis_url: str, cluster_name: str) -> Iterator[Run]:
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cluster_name)
    ensure_cluster(r, keys)
    one = Run(r, keys, seed=0)
    one.rng.random = lambda: 1.0  # type: ignore[method-assign]  # never swap states
    for address in ("tcp://10.0.0.1:1", "tcp://10.0.0.2:2"):
        info = {"name": address[-1], "host": address[6:14], "nthreads": 1, "started": 1.0}
        r.hset(keys.workers, address, pack(info))
        one.apply(one.ev(AddWorker, worker=address, info=info))
    r.hset(keys.clients, "c0", pack({"host": "h", "pid": 1, "last_seen": 0}))
    yield one
    for name in r.scan_iter(match=keys.prefix.replace("{", "[{]") + "*", count=1000):
        r.delete(name)


def graph(run: Run, *tasks: dict[str, Any], wanted: list[str]) -> None:
    specs = [{"spec": b"s", "deps": [], **t} for t in tasks]
    run.apply(run.ev(UpdateGraph, client="c0", tasks=specs, wanted=wanted))


def claim_and_finish(run: Run, key: str, worker: str) -> None:
    run.scripts.claim(worker=worker, count=1, last_inbox_id="0-0")
    run.claim_read()
    run.deliver_claims()
    score = run.state.tasks[key].score
    run.apply(run.ev(TaskFinished, worker=worker, key=key, nbytes=1, type="int", score=score))


def test_scattering_a_key_in_memory_again_records_its_new_holder(run: Run) -> None:
    a, b = "tcp://10.0.0.1:1", "tcp://10.0.0.2:2"
    for holder in (a, b):
        run.apply(
            run.ev(
                UpdateData,
                client="c0",
                who_has={"d": [holder]},
                nbytes={"d": 8},
                types={"d": "bytes"},
            )
        )
    assert run.state.tasks["d"].who_has == {a, b}
    run.check()


def test_a_released_error_forgets_where_it_came_from(run: Run) -> None:
    a = "tcp://10.0.0.1:1"
    graph(
        run,
        {"key": "x"},
        {"key": "y", "deps": ["x"]},
        {"key": "w", "deps": ["y"]},
        wanted=["y", "w"],
    )
    run.scripts.claim(worker=a, count=1, last_inbox_id="0-0")
    run.claim_read()
    run.deliver_claims()
    run.apply(
        run.ev(
            TaskErred,
            worker=a,
            key="x",
            exception=b"e",
            exception_text="E",
            score=run.state.tasks["x"].score,
        )
    )
    assert run.state.tasks["y"].exception_blame == "x"
    run.apply(run.ev(ClientReleasesKeys, client="c0", keys=["y"]))
    assert run.state.tasks["y"].state == "released"  # kept: w, erred, is still wanted
    run.check()


def test_a_task_submitted_again_with_a_new_dependency_records_it(run: Run) -> None:
    graph(run, {"key": "x"}, {"key": "y", "deps": ["x", "nobody-made-it"]}, wanted=["x", "y"])
    run.apply(run.ev(ClientReleasesKeys, client="c0", keys=["x"]))
    assert run.state.tasks["x"].state == "released"  # kept: y, erred, is still wanted
    graph(run, {"key": "w"}, {"key": "x", "deps": ["w"]}, wanted=["x"])
    assert {d.key for d in run.state.tasks["x"].dependencies} == {"w"}
    run.check()


def test_a_key_named_twice_in_one_graph_keeps_its_first_entry(run: Run) -> None:
    graph(run, {"key": "a"}, {"key": "x", "deps": ["a"]}, {"key": "x", "deps": []}, wanted=["x"])
    assert {d.key for d in run.state.tasks["x"].dependencies} == {"a"}
    run.check()


def test_a_claim_of_a_task_released_and_queued_again_meanwhile_is_recorded(run: Run) -> None:
    """The claim pops the task; before its message is read, the client releases the key
    and asks for it again: queued again with the same score, written over the claim.
    (It stays known meanwhile because an erred dependent of it is still wanted.)"""
    a = "tcp://10.0.0.1:1"
    for ws in run.state.workers.values():
        ws.no_push = True  # queued for a claim, not pushed to a free thread (scheduler/push.py)
    graph(run, {"key": "x"}, {"key": "y", "deps": ["x", "nobody-made-it"]}, wanted=["x", "y"])
    assert run.state.tasks["y"].state == "erred"
    run.scripts.claim(worker=a, count=1, last_inbox_id="0-0")
    run.claim_read()
    run.apply(run.ev(ClientReleasesKeys, client="c0", keys=["x"]))
    assert run.state.tasks["x"].state == "released"
    run.apply(run.ev(ClientDesiresKeys, client="c0", keys=["x"]))
    assert run.state.tasks["x"].state == "queued"
    run.deliver_claims()
    assert run.state.tasks["x"].processing_on == a
    run.check()
