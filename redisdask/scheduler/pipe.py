"""The scheduler's write in flight, and the read of its input streams sent behind it.

Without it the scheduler's loop is: read a batch, compute it, write it, wait for the
write's reply, read the next.  Redis and the scheduler then never work at the same time,
and a batch costs two round trips.  ``WritePipe`` sends a batch's fenced write (one
``EVALSHA`` of ``APPLY_FENCED``) followed by a non-blocking ``XREADGROUP ... >`` on one
connection, in one packet, and returns at once; the driver computes the batch it read
ahead meanwhile, and collects both replies before it sends its next write.  So Redis runs
batch N's write while the scheduler computes batch N+1, and each batch costs one round
trip (docs/performance.md, "Where the scheduler waits").  When the scheduler has nothing
more to compute (one entry at a time: a sequential ``submit().result()``), the read
behind the write is the blocking read it would send next anyway: it goes in the same
packet, so Redis serves the write and the wait for the next entry on one wake-up.

Why it keeps the delivery semantics (docs/design.md, "Writes in flight"):

* **Ordered.**  One connection, and at most one write in flight: batch N+1's write is
  sent only after batch N's reply said it landed.  Every other command of the driver that
  must see the write (a read of pending entries, a reload, a synchronous ``apply``) waits
  for that reply first (``Scheduler._collect``).
* **Fenced.**  Each write is the same ``APPLY_FENCED`` script, checking the lease token.
* **Acknowledged by the write that applies it.**  Entries read ahead are only delivered
  (pending in the group); they are acknowledged by their own batch's write.  A scheduler
  that dies with a write in flight and entries read ahead leaves the write applied or not
  (atomic), and the entries pending: the next leader re-reads them (``0``) first.
* **No state advanced on a write that did not land.**  Batch N+1 is computed on the
  state that assumes batch N's write lands.  If it did not (fenced, a script error),
  batch N+1's write is never sent: the scheduler stops (fenced) or reloads its state from
  Redis, and the entries stay pending.  A refused write (BUSY, OOM, ...) or a lost script
  (NOSCRIPT) ran nothing: it is sent again, synchronously, before batch N+1's.
"""

from __future__ import annotations

from typing import Any

import redis

from redisdask.store import busy, keyspace


class WritePipe:
    """One connection of the scheduler's pool, held for writes sent without waiting."""

    def __init__(self, r: redis.Redis, keys: keyspace.Keys, count: int) -> None:
        self.redis = r
        self.keys = keys
        self.count = count  # entries per read ahead (the scheduler's batch size)
        self.connection: Any = None
        self.sent: list[str] = []  # the commands whose replies are awaited, in order
        self.script_loaded = False  # APPLY_FENCED loaded since this connection was made
        self.read_sent = False  # whether the last send read too
        self.read_waits = False  # whether that read blocks (``send``'s ``block_ms``)

    @property
    def in_flight(self) -> bool:
        return bool(self.sent)

    @property
    def waiting(self) -> bool:
        """Whether a read that waits for new entries is in flight."""
        return self.in_flight and self.read_waits

    def read_command(self, block_ms: int | None = None) -> list[Any]:
        """A read of new entries from both input streams, blocking up to ``block_ms``
        if given."""
        block = [] if block_ms is None else ["BLOCK", block_ms]
        return [
            "XREADGROUP", "GROUP", keyspace.SCHEDULER_GROUP, keyspace.SCHEDULER_CONSUMER,
            "COUNT", self.count, *block,
            "STREAMS", self.keys.worker_stream, self.keys.client_stream, ">", ">",
        ]  # fmt: skip

    def send(self, write: list[Any] | None, read: bool, block_ms: int | None = None) -> None:
        """Send ``write`` (a command, or None) and, behind it, a read of new entries if
        ``read`` (one that waits up to ``block_ms`` for them, if given), without waiting
        for the replies.  A connection error is raised (nothing is in flight then: what
        was sent may or may not have run)."""
        assert not self.sent, "one write in flight at most"
        commands = [write] if write is not None else []
        if read:
            commands.append(self.read_command(block_ms))
        if not commands:
            return
        if self.connection is None:
            self.connection = self.redis.connection_pool.get_connection()
        try:
            self.connection.send_packed_command(self.connection.pack_commands(commands))
        except BaseException:
            self._drop()
            raise
        self.sent = [str(c[0]) for c in commands]
        self.read_sent = read
        self.read_waits = read and block_ms is not None

    def collect(self) -> tuple[Exception | None, Any]:
        """Wait for the replies of what ``send`` sent: (the write's error or None, the
        read's reply or None).  A read refused (BUSY) read nothing: None; one that
        failed otherwise is raised, unless the write failed too (its error comes back,
        for the driver to stop, or write it again).  A connection error is raised."""
        sent, self.sent = self.sent, []
        write_error: Exception | None = None
        read_error: Exception | None = None
        read: Any = None
        try:
            for name in sent:
                try:
                    reply = self.redis.parse_response(self.connection, name)
                except redis.ResponseError as exc:
                    if name != "XREADGROUP":
                        write_error = exc
                    elif busy.refusal(exc) is None:
                        read_error = exc
                    continue
                if name == "XREADGROUP":
                    read = reply
        except (redis.ConnectionError, redis.TimeoutError):
            self._drop()
            raise
        if read_error is not None and write_error is None:
            raise read_error  # (a failed write says first what became of it: the read read nothing)
        return write_error, read

    def _drop(self) -> None:
        """Forget the connection after an error: its replies are out of step."""
        self.sent = []
        self.read_waits = False
        self.script_loaded = False
        if self.connection is not None:
            self.connection.disconnect()
            self.redis.connection_pool.release(self.connection)
            self.connection = None

    def close(self) -> None:
        """Give the connection back (nothing in flight: the driver collected it)."""
        if self.connection is not None and not self.sent:
            self.redis.connection_pool.release(self.connection)
            self.connection = None
        elif self.connection is not None:
            self._drop()
