"""What a worker fetched for its tasks' dependencies, counted since it started.

Dask's names and meanings where Dask has them: ``transfer_incoming_count_total`` counts the
transfers from peers (one ``get-data`` request to one peer, which may carry several keys;
a transfer that fails counts too, as in Dask's ``WorkerState``), and
``transfer_incoming_bytes_total`` the bytes (``sizeof``) of the values received from
peers.  Dask keeps no such byte counter (its workers report the bytes in flight and the
bytes they SENT); the bytes received answer "how much data did the cluster move between
workers", the figure placement by data is judged by (issue 24).

Small results reach a dependent through their task's record in Redis rather than from a
peer (``worker.inline-result-bytes``): those are counted apart, in
``transfer_incoming_redis_bytes_total``, so that the peer figures mean what Dask's mean
and the two together are every byte a worker received for dependencies.

The heartbeat carries these counters (``scheduler_info()["workers"][addr]["metrics"]``)
and the exporter serves them (``redisdask_worker_transfer_incoming_*_total``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TransferCounts:
    incoming_count_total: int = 0  # transfers from peers, failed ones included
    incoming_bytes_total: int = 0  # bytes received from peers
    incoming_redis_bytes_total: int = 0  # bytes of small results read from task records

    def peer_transfer(self) -> None:
        """A transfer from a peer starts (counted whatever its outcome, as Dask does)."""
        self.incoming_count_total += 1

    def received(self, nbytes: int, *, from_redis: bool = False) -> None:
        if from_redis:
            self.incoming_redis_bytes_total += nbytes
        else:
            self.incoming_bytes_total += nbytes

    def metrics(self) -> dict[str, int]:
        """The heartbeat's fields."""
        return {
            "transfer_incoming_count_total": self.incoming_count_total,
            "transfer_incoming_bytes_total": self.incoming_bytes_total,
            "transfer_incoming_redis_bytes_total": self.incoming_redis_bytes_total,
        }
