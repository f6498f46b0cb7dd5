"""Reading the cluster's logs from the client, with distributed's names and shapes:
``get_worker_logs`` and ``get_scheduler_logs``.  The records are those every process
ships to Redis (``redisdask.store.logship``), so a worker's logs are there after it died
(for ``retention.logs-ttl``), whichever machine it ran on.  ``LogMethods`` is a mixin of
``Client``: it holds no state, and reads the client's blocking connection and keys."""

from __future__ import annotations

from typing import TYPE_CHECKING

from redisdask.client.loop import offloaded
from redisdask.store import logship

if TYPE_CHECKING:
    import redis

    from redisdask.store.keyspace import Keys

Logs = list[tuple[str, str]]  # (level, line), oldest first, as distributed's


class LogMethods:
    """The log-reading methods of ``Client`` (``self`` is the client)."""

    redis: redis.Redis
    keys: Keys

    @offloaded
    def get_worker_logs(
        self,
        n: int | None = None,
        workers: str | list[str] | None = None,
        nanny: bool = False,
    ) -> dict[str, Logs]:
        """The last ``n`` log records (every one kept: None) of each worker, as
        ``{address: [(level, line), ...]}``, oldest first.  ``workers``: addresses or
        names, of registered workers or of dead ones whose records Redis still keeps
        (all registered workers: None); ``nanny``: their nannies' records instead (a dead
        worker's: the nanny its death record names)."""
        targets = self._log_targets(workers)
        if nanny:
            streams = {a: logship.nanny_stream(self.redis, self.keys, a) for a in targets}
        else:
            streams = {a: self.keys.worker_logs(a) for a in targets}
        return {
            address: [(rec.level, rec.line) for rec in logship.read(self.redis, stream, n=n)]
            for address, stream in streams.items()
            if stream is not None
        }

    @offloaded
    def get_scheduler_logs(self, n: int | None = None) -> Logs:
        """The last ``n`` log records (every one kept: None) of the cluster's scheduler
        processes (the leader's and the standbys', each line naming its process), as
        ``[(level, line), ...]``, oldest first."""
        records = logship.read(self.redis, self.keys.scheduler_logs, n=n)
        return [(rec.level, rec.line) for rec in records]

    def _log_targets(self, workers: str | list[str] | None) -> list[str]:
        """Addresses: of the registered workers (None), or of each name or address in
        ``workers``, looked up among the registered workers and then the dead ones;
        ``ValueError`` naming those found nowhere."""
        if workers is None:
            return sorted(a.decode(errors="replace") for a in self.redis.hkeys(self.keys.workers))
        known = logship.known_workers(self.redis, self.keys)
        wanted = [workers] if isinstance(workers, str) else list(workers)
        found = {w: logship.find_worker(known, w) for w in wanted}
        unknown = [w for w, address in found.items() if address is None]
        if unknown:
            raise ValueError(
                f"no worker with address or name {unknown} in cluster {self.keys.cluster!r}, "
                f"registered or among its recorded deaths; it knows of {sorted(known.values())}"
            )
        return [address for address in found.values() if address is not None]
