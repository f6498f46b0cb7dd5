"""Fetching results from the workers that hold them (``ResultFetcher``, a part of the
``Client``: ``client._fetcher``): one request per worker, all at once, in batches of at
most ``comm.MAX_KEYS_PER_MESSAGE`` keys; small results from their task records in Redis.

A holder that fails to answer (a peer deadline, a refused or broken connection) is
reported to the scheduler (``client-missing-data``), which stops counting it and
recomputes the key if no copy is left; a holder that answers without the key is reported
too, as its word about itself wins.  A client that reaches no holder of a key
``MAX_MISSING_REPORTS`` times over gives up with ``DataUnavailableError``, naming the
network as the cause, rather than have the key computed again for ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from redisdask import comm
from redisdask.client.futures import inline_value
from redisdask.errors import DataUnavailableError
from redisdask.protocol import ClientMissingData
from redisdask.store.keyspace import REDIS_COPY
from redisdask.store.task_record import TaskRecord
from redisdask.utils.backoff import Backoff

if TYPE_CHECKING:
    from redisdask.client.client import Client

logger = logging.getLogger("redisdask.client")

# how many times one client reports a key's holders as unreachable (each report may have
# the key computed again) before it gives up: a client that reaches no worker at all (a
# firewall, a container network) would otherwise have the key recomputed for ever
MAX_MISSING_REPORTS = 3


class ResultFetcher:
    """Fetches the values of finished keys for the client's gathers (see the module
    docstring); owns the count of reports each key has had."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.missing_reports: Counter[str] = Counter()  # key -> client-missing-data sent

    async def gather_keys(self, keys: list[str]) -> tuple[dict[str, Any], set[str]]:
        """Fetch values from the workers holding them, one request per worker (all at
        once).  Returns the values and the keys whose task the scheduler no longer has
        in memory (or that finished again meanwhile: the caller waits for their news).

        A key whose every recorded holder failed to answer (a peer deadline, a refused
        or broken connection) is reported to the scheduler (``client-missing-data``),
        which stops counting those holders and recomputes the key if no copy is left:
        the key's record then leaves ``memory`` and its future waits again (distributed's
        client resets its future too, but its scheduler recomputes nothing: see
        docs/design.md, "The life of a task", step 9)."""
        client = self.client
        remaining = set(keys)
        stale: set[str] = set()
        values: dict[str, Any] = {}
        tries = _Tries({key: client._state_for(key).finishes for key in keys})
        # a holder that just died is still named by the scheduler until it notices (well
        # under a second; scheduler.worker-ttl at worst): wait that long once it has read
        # our reports, then give up
        wait_for_scheduler = client.config.scheduler.worker_ttl + 2.0
        patience = time.monotonic() + wait_for_scheduler
        backoff = Backoff(base=0.02, cap=0.5)
        for key in keys:  # small results came with the news: nothing to fetch
            raw = client._state_for(key).value
            if raw is not None:
                values[key] = inline_value(key, raw)
                remaining.discard(key)
        while remaining:
            by_worker: dict[str, list[str]] = defaultdict(list)
            unknown = []
            for key in remaining:
                holders = [w for w in client._state_for(key).who_has if w not in tries.tried[key]]
                if REDIS_COPY in holders:  # a small result, in the task's record
                    by_worker[REDIS_COPY].append(key)
                elif holders:
                    by_worker[holders[hash(key) % len(holders)]].append(key)
                else:
                    unknown.append(key)
            if unknown:
                if time.monotonic() > patience:
                    raise tries.unavailable(unknown)
                same_holders = await self._new_holders(unknown, tries, stale)
                if same_holders and await client._aredis.xlen(client.keys.client_stream):
                    # the scheduler has not read every submission yet, ours among them (a
                    # long batch: a 100,000-task map's takes seconds): patience from then
                    patience = time.monotonic() + wait_for_scheduler
                remaining -= stale
                if same_holders:  # let the scheduler notice, or act on our report
                    await asyncio.sleep(backoff.next())
                continue
            requests = list(_batches(by_worker, comm.MAX_KEYS_PER_MESSAGE))
            answers = await asyncio.gather(*(self._fetch(a, k) for a, k in requests))
            for (address, wkeys), (got, errs, cause) in zip(requests, answers, strict=True):
                if errs:
                    raise next(iter(errs.values()))
                values.update(got)
                for key in wkeys:
                    if key in got:
                        remaining.discard(key)
                    else:
                        tries.missed(key, address, cause)
        return values, stale

    async def _new_holders(self, keys: list[str], tries: _Tries, stale: set[str]) -> bool:
        """Report the holders of ``keys`` that failed (once each), then read the
        scheduler's records again: a key no longer in memory, or finished again, goes
        to ``stale``.  Holders that failed are not asked again (the report drops them);
        those that answered without the key are, and are reported too if the record
        still names them (below).  Whether some key still names only holders tried
        already."""
        client = self.client
        report = tries.to_report(keys)
        given_up = [k for k in report if self.missing_reports[k] >= MAX_MISSING_REPORTS]
        if given_up:
            raise tries.unreachable(given_up, MAX_MISSING_REPORTS)
        if report:
            self.missing_reports.update(report.keys())
        same_holders = False
        for key, state in (await self.refresh_who_has(keys)).items():
            news = client._state_for(key)
            if (state is not None and state != "memory") or news.finishes != tries.finishes[key]:
                stale.add(key)
                continue
            # the record names a holder that answered without the key: its word about
            # itself wins (a copy dropped behind the scheduler's back is computed again).
            # Not counted against MAX_MISSING_REPORTS: that limit is for unreachable
            # holders, and this report is no sign of a network this client cannot cross
            absent = tries.to_report_absent(key, news.who_has)
            if absent:
                report[key] = sorted({*report.get(key, ()), *absent})
            if set(news.who_has) <= tries.tried[key]:
                same_holders = True
            tries.tried[key] = set(tries.failed[key])
        if report:
            await client._channel.asend([ClientMissingData(client.id, report)])
        return same_holders

    async def _fetch(
        self, address: str, keys: list[str]
    ) -> tuple[dict[Hashable, Any], dict[Hashable, BaseException], str | None]:
        """Values (and errors unpickling them) of ``keys`` from one worker (or, from
        ``REDIS_COPY``, their records); none if it cannot be reached, and then why."""
        client = self.client
        if address == REDIS_COPY:
            pipe = client._aredis.pipeline(transaction=False)
            for key in keys:
                pipe.hget(client.keys.task(key), "value")
            raws = await pipe.execute()
            got = {k: inline_value(k, raw) for k, raw in zip(keys, raws, strict=True) if raw}
            return got, {}, None
        try:
            header, frames = await client._peers.rpc(address, {"op": "get-data", "keys": keys})
            return (*comm.deserialize_dict(header, frames), None)
        except comm.SecurityMismatchError:
            raise  # TLS here and not there (or the reverse): no retry mends it
        except (OSError, comm.CommError) as exc:
            logger.warning("could not fetch %d keys from %s: %s", len(keys), address, exc)
            return {}, {}, f"{type(exc).__name__}: {exc}"

    async def refresh_who_has(self, keys: list[str]) -> dict[str, str | None]:
        """Read holders from the scheduler's records; returns each key's recorded state."""
        client = self.client
        fields = ("who_has", "state", "worker")
        pipe = client._aredis.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(client.keys.task(key), fields)
        states: dict[str, str | None] = {}
        for key, values in zip(keys, await pipe.execute(), strict=True):
            record = TaskRecord.from_hmget(fields, values)
            states[key] = record.state or None
            # the scheduler's record wins once it has one; until then what this client
            # knows stands: data scattered a moment ago, not yet processed, or a pushed
            # task's result that its worker's report told (the record says processing
            # until the scheduler reads that report: docs/design.md, "Push")
            known = client._state_for(key)
            told = record.state == "processing" and known.status == "finished"
            if record.state and not (told and record.worker in known.who_has):
                known.who_has = record.who_has
        return states


class _Tries:
    """What one gather tried: per key, the holders asked in vain (``tried``), those whose
    request failed with the cause (``failed``), and those reported to the scheduler."""

    def __init__(self, finishes: dict[str, int]) -> None:
        self.finishes = finishes  # each key's news count when the gather began
        self.tried: dict[str, set[str]] = defaultdict(set)
        self.failed: dict[str, dict[str, str]] = defaultdict(dict)
        self.absent: dict[str, set[str]] = defaultdict(set)  # answered without the key
        self._reported: set[tuple[str, str]] = set()

    def missed(self, key: str, address: str, cause: str | None) -> None:
        self.tried[key].add(address)
        if cause is not None:
            self.failed[key][address] = cause
        elif address != REDIS_COPY:
            self.absent[key].add(address)

    def to_report(self, keys: list[str]) -> dict[str, list[str]]:
        """``{key: [holders]}`` that failed and were not reported yet."""
        report = {}
        for key in keys:
            new = sorted(a for a in self.failed[key] if (key, a) not in self._reported)
            if new:
                report[key] = new
                self._reported.update((key, a) for a in new)
        return report

    def to_report_absent(self, key: str, recorded: Iterable[str]) -> list[str]:
        """The holders of ``key`` still on record that answered without it and were
        not reported yet."""
        new = sorted(a for a in self.absent[key] & set(recorded) if (key, a) not in self._reported)
        self._reported.update((key, a) for a in new)
        return new

    def unreachable(self, keys: list[str], reports: int) -> DataUnavailableError:
        causes = "; ".join(f"{a}: {c}" for k in keys for a, c in sorted(self.failed[k].items()))
        return DataUnavailableError(
            f"could not fetch {sorted(keys)[:5]} from the workers holding them, {reports} "
            f"times over, each time computed again ({causes[:500]}); this client cannot "
            "reach those workers: check the network between them (their addresses, a "
            "firewall, a container network; the workers' --host)"
        )

    def unavailable(self, keys: list[str]) -> DataUnavailableError:
        failures = {a: c for k in keys for a, c in self.failed[k].items()}
        if not failures:
            return DataUnavailableError(
                f"could not fetch {sorted(keys)[:5]} from any worker holding them (tried "
                f"{dict(self.tried)}); the workers may have died — resubmit the work"
            )
        causes = "; ".join(f"{a}: {c}" for a, c in sorted(failures.items())[:5])
        return DataUnavailableError(
            f"could not fetch {sorted(keys)[:5]} from the workers holding them ({causes}); "
            "the scheduler, told so, still counts them as holders (a retiring worker, or "
            "a scheduler that is away?) — check the network between this client and those "
            "workers (comm.timeouts.tcp bounds each request), or resubmit the work"
        )


def _batches(by_worker: Mapping[str, Iterable[str]], size: int) -> Iterator[tuple[str, list[str]]]:
    """``(worker, keys)`` in batches of at most ``size`` keys per message."""
    for worker, keys in by_worker.items():
        keys = list(keys)
        for i in range(0, len(keys), size):
            yield worker, keys[i : i + size]
