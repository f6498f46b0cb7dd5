"""What a client does on the workers outside the task graph, with distributed's names:
``client.run``, ``wait_for_workers``, ``upload_file``, ``register_plugin`` (and its older
name ``register_worker_plugin``), ``unregister_worker_plugin``; and ``run_on_scheduler``,
which cannot be (there is no scheduler process to run code in) and says so.

``Client`` inherits these methods from ``WorkerCalls``.

* **run** connects to each worker's authenticated TCP server (its address from the
  ``workers`` hash) and sends a ``run`` call carrying the pickled function and arguments
  (``workers/calls.py`` answers it).  The calls go out in parallel, each worker has
  ``timeout`` seconds (``client.run-timeout``) to answer, and a worker that does not (dead,
  stopped, too slow) is named in a ``WorkerUnresponsiveError``; an exception the function
  raised is re-raised with a note naming the worker.
* **Uploads and plugins** must reach workers that start later too, so they are kept in
  Redis (``rd:{c}:uploads``, ``rd:{c}:worker-plugins``, see ``docs/redis-schema.md``);
  the client writes the entry, then asks every registered worker to ``sync-plugins``
  (re-read both hashes and apply what changed).  A plugin whose ``setup`` (or an upload
  whose import) raises on a worker is removed again and the error raised: nothing is left
  behind for the next worker to trip on.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
import uuid
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import cloudpickle

from redisdask import comm
from redisdask.client.loop import offloaded
from redisdask.config import parse_duration
from redisdask.errors import RedisDaskError, WorkerStartTimeoutError, WorkerUnresponsiveError
from redisdask.plugins import UPLOAD_SUFFIXES, check_worker_plugin, plugin_name
from redisdask.store import codecs
from redisdask.typenames import function_name
from redisdask.utils import pickling
from redisdask.utils.sizes import format_bytes

if TYPE_CHECKING:
    import redis

    from redisdask.config import Config
    from redisdask.security import Security
    from redisdask.store.keyspace import Keys

# an upload or a plugin is kept in Redis for the cluster's life and read by every worker
# that starts: keep them small (a big library belongs in the workers' environment)
MAX_ENTRY_BYTES = 64 << 20
MAX_PARALLEL_CALLS = 128  # worker calls in flight at once
WAIT_POLL = 0.05  # seconds between looks at the workers hash in wait_for_workers

Answer = tuple[Literal["ok", "error", "unanswered"], Any]
OnError = Literal["raise", "return", "ignore"]


class WorkerCalls:
    """The methods ``Client`` inherits from this module (see its docstring); they use
    the client's own helpers (``_check_running``), of which this mixin declares no stub
    that could come before the real one in ``Client``'s MRO."""

    redis: redis.Redis
    keys: Keys
    secret: bytes
    config: Config
    security: Security

    # ------------------------------------------------------------------ run

    @offloaded
    def run(
        self,
        function: Any,
        *args: Any,
        workers: str | list[str] | None = None,
        wait: bool = True,
        nanny: bool = False,
        on_error: OnError = "raise",
        timeout: float | str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any] | None:
        """Run ``function(*args, **kwargs)`` on every worker (or those named in
        ``workers``: addresses or names), outside the task graph, and return
        ``{address: result}`` (as distributed).  A function with a ``dask_worker``
        parameter gets the worker object there.  A plain function runs in a thread of its
        own on the worker, an ``async def`` one on the worker's event loop.

        ``wait=False``: the workers start it and answer at once; returns None.
        ``on_error``: ``"raise"`` the first exception (with a note naming the worker),
        ``"return"`` it in place of the result, or ``"ignore"`` that worker.
        ``timeout`` (default ``client.run-timeout``, 60 s): how long each worker has to
        answer; one that does not, or cannot be reached, is named in a
        ``WorkerUnresponsiveError`` (with ``on_error="raise"``)."""
        self._check_running()
        if nanny:
            raise NotImplementedError(
                "client.run(nanny=True): redisdask's nannies do not run client code; run "
                "it in the worker processes (nanny=False)"
            )
        if on_error not in ("raise", "return", "ignore"):
            raise ValueError(f"on_error must be 'raise', 'return' or 'ignore', got {on_error!r}")
        if not callable(function):
            raise TypeError(f"client.run needs a function, got {type(function).__name__}")
        seconds = self._call_timeout(timeout)
        what = f"client.run({function_name(function)})"
        try:
            frames = comm.serialize((function, args, kwargs))
        except comm.SerializationError as exc:
            raise TypeError(
                f"{what}: the function or its arguments cannot be pickled ({exc}), so "
                "nothing was sent to the workers; define the function at module level and "
                "pass picklable arguments"
            ) from None
        targets = self._workers_named(workers)
        answers = self._call_workers(targets, {"op": "run", "wait": bool(wait)}, frames, seconds)
        results, errors, unanswered = _split(answers, targets, what)
        if on_error == "raise":
            if unanswered:
                raise _unresponsive(unanswered, targets, what, seconds, {**results, **errors})
            if errors:
                _raise_first(errors)
        elif on_error == "return":
            results.update(errors)
            for address, reason in unanswered.items():
                results[address] = _unresponsive({address: reason}, targets, what, seconds, {})
        return results if wait else None

    def run_on_scheduler(self, function: Any, *args: Any, **kwargs: Any) -> NoReturn:
        """Not possible here: redisdask has no scheduler process to run code in."""
        raise NotImplementedError(
            "client.run_on_scheduler is not possible with redisdask: there is no scheduler "
            "process to run a function in (the scheduler's state lives in Redis, and the "
            "scheduler only applies messages to it). Run it on the workers with "
            "client.run(function), or call it here in the client; to see the scheduler's "
            "state use client.scheduler_info() or 'redisdask inspect'"
        )

    # ------------------------------------------------------------------ workers

    @offloaded
    def wait_for_workers(self, n_workers: int, timeout: float | str | None = None) -> None:
        """Block until ``n_workers`` workers are registered (retiring ones do not count);
        ``WorkerStartTimeoutError`` (a ``TimeoutError``) after ``timeout`` seconds, naming
        how many of how many arrived."""
        self._check_running()
        if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive integer, got {n_workers!r}")
        seconds = None if timeout is None else self._call_timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        while (count := self._running_workers()) < n_workers:
            if deadline is not None and time.monotonic() > deadline:
                assert seconds is not None
                raise WorkerStartTimeoutError(
                    count,
                    n_workers,
                    seconds,
                    f"only {count} of {n_workers} workers arrived in cluster "
                    f"{self.keys.cluster!r} within {seconds:g} s; start more "
                    f"('redisdask worker <redis-url> --cluster {self.keys.cluster}') or "
                    "wait longer",
                )
            time.sleep(WAIT_POLL)  # workers register on their own; the hash is polled

    def _running_workers(self) -> int:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hkeys(self.keys.workers)
        pipe.hgetall(self.keys.heartbeats)
        addresses, beats = pipe.execute()
        retiring = 0
        for address in addresses:
            beat = beats.get(address)
            if codecs.unpack_or(beat, {}, dict).get("status") == "retiring":
                retiring += 1
        return len(addresses) - retiring

    def _workers_named(self, workers: str | list[str] | None) -> dict[str, str]:
        """``{address: name}`` of the registered workers ``workers`` names (addresses or
        names; all when None); ``ValueError`` naming any that is not registered."""
        registered = {
            address.decode(errors="replace"): str(
                codecs.worker_info_or_empty(info).get("name") or address.decode(errors="replace")
            )
            for address, info in self.redis.hgetall(self.keys.workers).items()
        }
        if workers is None:
            return dict(sorted(registered.items()))
        wanted = [workers] if isinstance(workers, str) else list(workers)
        by_name = {name: address for address, name in registered.items()}
        unknown = [w for w in wanted if w not in registered and w not in by_name]
        if unknown:
            raise ValueError(
                f"no worker with address or name {unknown} in cluster {self.keys.cluster!r}; "
                f"its workers are {sorted(registered.values())}"
            )
        addresses = [w if w in registered else by_name[w] for w in wanted]
        return {address: registered[address] for address in addresses}

    def _call_timeout(self, timeout: float | str | None) -> float:
        if timeout is None:
            return float(self.config.client.run_timeout)
        seconds = parse_duration(timeout)
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return seconds

    def _call_workers(
        self, targets: dict[str, str], header: dict[str, Any], frames: list[Any], timeout: float
    ) -> dict[str, Answer]:
        """One call to each worker in ``targets``, in parallel, each on a connection of
        its own; what each answered, or why it did not within ``timeout`` seconds."""
        if not targets:
            return {}
        open_conns: dict[str, comm.BlockingConnection] = {}
        lock = threading.Lock()

        def call(address: str) -> comm.Message:
            conn = comm.BlockingConnection(
                address, self.secret, timeout, tls=self.security.client_context()
            )
            with lock:
                open_conns[address] = conn
            try:
                return conn.rpc(header, frames)
            finally:
                conn.close()

        pool = concurrent.futures.ThreadPoolExecutor(
            min(len(targets), MAX_PARALLEL_CALLS), thread_name_prefix="rd-worker-call"
        )
        try:
            futures = {pool.submit(call, address): address for address in targets}
            _done, late = concurrent.futures.wait(futures, timeout=timeout)
            with lock:
                for future in late:  # wake the threads still waiting, so none lingers
                    if futures[future] in open_conns:
                        open_conns[futures[future]].abort()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        answers: dict[str, Answer] = {}
        for future, address in futures.items():
            if future in late:
                answers[address] = ("unanswered", f"no answer within {timeout:g} s")
            elif isinstance(error := future.exception(), OSError | comm.CommError):
                if isinstance(error, TimeoutError) or isinstance(error.__cause__, TimeoutError):
                    # (the connection's own timeout, in the handshake, can come first)
                    answers[address] = ("unanswered", f"no answer within {timeout:g} s")
                else:
                    answers[address] = ("unanswered", f"{error} (has it died?)")
            else:
                answers[address] = _decode(*future.result())
        return answers

    # ------------------------------------------------------------------ uploads and plugins

    @offloaded
    def upload_file(self, filename: str | Path, load: bool = True) -> dict[str, Any]:
        """Send a ``.py``, ``.zip``, ``.egg`` or ``.pyz`` file to every current and future
        worker, which writes it to a directory on its ``sys.path`` and, with ``load=True``,
        imports it (a module imported before is reloaded).  Tasks can then import it; to
        submit its functions by reference, import it in the client too.  A file uploaded
        again under the same name replaces the earlier one."""
        self._check_running()
        path = Path(filename)
        if path.suffix not in UPLOAD_SUFFIXES:
            raise ValueError(
                f"upload_file({str(filename)!r}): only {', '.join(UPLOAD_SUFFIXES)} files can "
                "be uploaded (a module, or an archive of modules)"
            )
        if not path.is_file():
            raise FileNotFoundError(f"upload_file: there is no file {str(filename)!r}")
        data = path.read_bytes()
        _check_size(len(data), f"upload_file({path.name!r})")
        if path.suffix == ".py":
            try:
                compile(data, str(path), "exec")
            except SyntaxError as exc:
                exc.add_note(f"upload_file({path.name!r}): nothing was uploaded")
                raise
        elif not zipfile.is_zipfile(path):
            raise ValueError(f"upload_file({path.name!r}): the file is not a zip archive")
        fields = {"data": data, "load": bool(load)}
        return self._publish("upload", path.name, fields, f"upload_file({path.name!r})")

    @offloaded
    def register_plugin(self, plugin: Any, name: str | None = None) -> dict[str, Any]:
        """Register a worker plugin (``redisdask.WorkerPlugin``, distributed's
        ``WorkerPlugin``, or any object with ``setup``, ``teardown`` or ``transition``):
        every registered worker sets it up now, every worker that starts later at its
        start.  ``name``: default the plugin's ``name`` attribute, else its class name and
        a uuid; a plugin of the same name is replaced (torn down first), unless the new
        one has ``idempotent = True``, which then does nothing.  Returns ``{address:
        {"status": "OK"}}``.  If ``setup`` raises on a worker, the plugin is removed again
        and the error re-raised, with a note naming the worker."""
        self._check_running()
        check_worker_plugin(plugin)
        name = plugin_name(plugin, name)
        if getattr(plugin, "idempotent", False) and self.redis.hexists(
            self.keys.worker_plugins, name
        ):
            return {}
        try:
            blob = pickling.dumps(plugin)
        except Exception as exc:
            raise TypeError(
                f"register_plugin({name!r}): the plugin cannot be pickled ({exc}), so it "
                "cannot reach the workers; nothing was registered"
            ) from None
        _check_size(len(blob), f"register_plugin({name!r})")
        return self._publish("plugin", name, {"plugin": blob}, f"register_plugin({name!r})")

    @offloaded
    def register_worker_plugin(
        self, plugin: Any = None, name: str | None = None, nanny: bool | None = None
    ) -> dict[str, Any]:
        """distributed's older name of ``register_plugin`` (for worker plugins)."""
        warnings.warn(
            "register_worker_plugin is deprecated (as in distributed): use register_plugin",
            DeprecationWarning,
            stacklevel=2,
        )
        if nanny:
            raise NotImplementedError("nanny plugins: redisdask's nannies do not run plugins")
        return self.register_plugin(plugin, name=name)

    @offloaded
    def unregister_worker_plugin(self, name: str, nanny: bool | None = None) -> dict[str, Any]:
        """Remove a worker plugin: every worker calls its ``teardown``; workers that start
        later no longer get it.  ``ValueError`` if no plugin has that name."""
        self._check_running()
        if nanny:
            raise NotImplementedError("nanny plugins: redisdask's nannies do not run plugins")
        if not self.redis.hdel(self.keys.worker_plugins, name):
            names = sorted(n.decode() for n in self.redis.hkeys(self.keys.worker_plugins))
            raise ValueError(
                f"no worker plugin named {name!r} in cluster {self.keys.cluster!r}; "
                f"the registered ones are {names}"
            )
        what = f"unregister_worker_plugin({name!r})"
        targets = self._workers_named(None)
        seconds = self._call_timeout(None)
        header = {"op": "sync-plugins", "kind": "plugin", "name": name}
        results, errors, unanswered = _split(
            self._call_workers(targets, header, [], seconds), targets, what
        )
        if errors:
            _raise_first(errors, "the plugin is unregistered all the same")
        if unanswered:
            raise _unresponsive(unanswered, targets, what, seconds, results)
        return {address: {"status": "OK"} for address in results}

    def _publish(
        self, kind: Literal["upload", "plugin"], name: str, fields: dict[str, Any], what: str
    ) -> dict[str, Any]:
        """Write an upload or a plugin to Redis, then have every registered worker apply
        it; removed again if it raised on any of them."""
        key = self.keys.uploads if kind == "upload" else self.keys.worker_plugins
        token = uuid.uuid4().hex
        self.redis.hset(key, name, codecs.pack({**fields, "time": time.time(), "token": token}))
        targets = self._workers_named(None)
        seconds = self._call_timeout(None)
        header = {"op": "sync-plugins", "kind": kind, "name": name}
        answers = self._call_workers(targets, header, [], seconds)
        results, errors, unanswered = _split(answers, targets, what)
        if errors:
            self._withdraw(key, name, token)
            # the workers where it was set up tear it down (their own errors are logged)
            self._call_workers({a: targets[a] for a in results}, header, [], seconds)
            _raise_first(errors, f"so {what} was undone: workers that start later do not get it")
        if unanswered:
            raise _unresponsive(
                unanswered,
                targets,
                what,
                seconds,
                results,
                " It is kept: the workers that answered have it, and every worker that "
                "starts from now on gets it.",
            )
        return {address: {"status": "OK"} for address in results}

    def _withdraw(self, key: str, name: str, token: str) -> None:
        """Delete the entry ``name`` of ``key`` if it is still the one with ``token``."""

        def delete(pipe: Any) -> None:
            raw = pipe.hget(key, name)
            if codecs.unpack_or(raw, {}, dict).get("token") == token:
                pipe.multi()
                pipe.hdel(key, name)

        self.redis.transaction(delete, key)


# --------------------------------------------------------------------------- helpers


def _check_size(nbytes: int, what: str) -> None:
    if nbytes > MAX_ENTRY_BYTES:
        raise ValueError(
            f"{what}: {format_bytes(nbytes)} is more than the {format_bytes(MAX_ENTRY_BYTES)} "
            "an upload or a plugin may take (it is kept in Redis for every worker that starts "
            "later); install big code on the workers as a package instead. Nothing was sent"
        )


def _decode(header: dict[str, Any], frames: list[Any]) -> Answer:
    """A worker's answer: its result, or the exception it sent back."""
    if header.get("status") == "OK":
        try:
            return "ok", comm.deserialize(frames) if frames else None
        except comm.SerializationError as exc:
            return "error", exc
    if "exception_text" not in header:  # a failure of the call itself (an older worker?)
        return "error", RedisDaskError(f"the worker refused the call: {header.get('message')}")
    text = str(header.get("exception_text"))
    exc: BaseException
    try:
        exc = cloudpickle.loads(frames[0])
    except Exception as err:
        exc = RedisDaskError(
            f"{text} (the exception could not be unpickled here: {err}); on the worker:\n"
            f"{header.get('traceback_text')}"
        )
    if len(frames) > 1 and len(frames[1]):
        try:
            from tblib import Traceback

            exc = exc.with_traceback(
                Traceback.from_dict(cloudpickle.loads(frames[1])).as_traceback()
            )
        except Exception:
            pass  # the exception without its remote traceback
    return "error", exc


def _label(address: str, name: str) -> str:
    return address if name == address else f"{address} ({name})"


def _split(
    answers: dict[str, Answer], targets: dict[str, str], what: str
) -> tuple[dict[str, Any], dict[str, BaseException], dict[str, str]]:
    """Results, errors (each with a note naming its worker) and unanswered workers."""
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    unanswered: dict[str, str] = {}
    for address, (kind, value) in answers.items():
        if kind == "ok":
            results[address] = value
        elif kind == "error":
            value.add_note(f"raised on worker {_label(address, targets[address])} by {what}")
            errors[address] = value
        else:
            unanswered[address] = value
    return results, errors, unanswered


def _raise_first(errors: dict[str, BaseException], note: str = "") -> NoReturn:
    first = errors[min(errors)]
    if len(errors) > 1:
        first.add_note(f"it raised on {sorted(errors)[1:]} too")
    if note:
        first.add_note(note)
    raise first


def _unresponsive(
    unanswered: dict[str, str],
    targets: dict[str, str],
    what: str,
    timeout: float,
    results: dict[str, Any],
    extra: str = "",
) -> WorkerUnresponsiveError:
    named = "; ".join(f"{_label(a, targets[a])}: {why}" for a, why in sorted(unanswered.items()))
    return WorkerUnresponsiveError(
        f"{len(unanswered)} of {len(targets)} workers did not answer {what} within "
        f"{timeout:g} s: {named}.{extra} A dead worker leaves the cluster within seconds "
        "(retry then); pass workers= to leave one out, or a longer timeout= for slow code",
        unanswered=unanswered,
        results=results,
    )
