"""Published datasets: ``client.publish_dataset``, ``get_dataset``, ``list_datasets``,
``unpublish_dataset`` and the ``client.datasets`` mapping, with distributed's names and
semantics.  ``Client`` inherits them from ``DatasetMethods``.

Every dataset is a field of one Redis hash, ``rd:{c}:datasets``: its (stringified) name
-> msgpack ``[epoch, keys, data, pickled name]``; the hash disappears with its last
dataset.  The value is pickled whole (a dask collection, a future, a list of them, any
picklable object); the futures inside stay alive while it is published (its holder
``holder:dataset:<name>`` wants their keys, and a restarted scheduler restores that
want), and ``get_dataset`` hands the getting client futures of its own, whose wants are
sent with the read, atomically.  As with distributed, persist a collection before you
publish it: what is not computed is published as its graph."""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import redis

from redisdask import spec as specs
from redisdask.client.loop import offloaded
from redisdask.coordination.backend import (
    Backend,
    backend_of,
    decode,
    encode,
    hand_over,
    learn_states,
    script_error,
    unpack_record,
)
from redisdask.store import keyspace
from redisdask.utils import pickling

if TYPE_CHECKING:
    from redisdask.client.client import Client

_NO_DEFAULT = object()


def _field(name: Hashable) -> str:
    """A dataset's name in Redis: the cluster's string form of the dask key."""
    return specs.check_key(name)


class DatasetMethods:
    """The dataset methods of ``Client`` (``self`` is the client), and the client's
    coordination backend (``backend.backend_of`` makes it at first use)."""

    _coordination: Backend | None = None

    @offloaded
    def publish_dataset(
        self, *args: Any, name: Hashable | None = None, override: bool = False, **kwargs: Any
    ) -> None:
        """Publish named datasets for every client of the cluster:
        ``publish_dataset(df, name="ds")``, ``publish_dataset({"ds": df})`` or
        ``publish_dataset(ds=df)``.  A name that is published already raises
        ``KeyError`` unless ``override=True``."""
        client: Client = self  # type: ignore[assignment]
        what = "publish_dataset()"
        b = backend_of(client, what)
        names: list[Hashable] = list(kwargs)
        data: list[Any] = list(kwargs.values())
        if name is not None:
            if not args:
                raise ValueError(
                    "If name is provided, expecting call signature like"
                    " publish_dataset(df, name='ds')"
                )
            names.append(name)
            data.append(args[0] if len(args) == 1 else args)
        elif args:
            if len(args) != 1 or not isinstance(args[0], Mapping):
                raise ValueError(
                    "If name is omitted, positional argument must be a {name: value} dict"
                )
            names.extend(args[0])
            data.extend(args[0].values())
        if not names:
            raise ValueError(
                "publish_dataset() got nothing to publish: publish_dataset(df, name='ds'), "
                "publish_dataset({'ds': df}) or publish_dataset(ds=df)"
            )
        fields = [_field(n) for n in names]
        if len(set(fields)) < len(fields):
            twice = next(f for f in fields if fields.count(f) > 1)
            raise ValueError(f"{what}: the dataset {twice!r} is given twice")
        records = []
        for n, f, value in zip(names, fields, data, strict=True):
            packed, keys = encode(value, f"{what} of {f!r}")
            records.append((f, keyspace.holder("dataset", f), keys, packed, pickling.dumps(n)))
        with b.client.sending():
            try:
                b.scripts.publish(datasets=records, override=override)
            except redis.ResponseError as exc:
                if script_error(exc, "EXISTS"):
                    taken = str(exc).split(" ", 1)[1]
                    raise KeyError(
                        f"Dataset {taken} already exists: unpublish it first, or "
                        "publish with override=True (nothing was published)"
                    ) from None
                raise

    @offloaded
    def unpublish_dataset(self, name: Hashable | list[Hashable], **kwargs: Any) -> None:
        """Remove published datasets (a name or a list of names); their futures are let
        go.  A name that is not published is ignored, as in distributed."""
        client: Client = self  # type: ignore[assignment]
        b = backend_of(client, "unpublish_dataset()")
        fields = [_field(n) for n in (name if isinstance(name, list) else [name])]
        with b.client.sending():
            b.scripts.unpublish(datasets=[(f, keyspace.holder("dataset", f)) for f in fields])

    @offloaded
    def list_datasets(self, **kwargs: Any) -> tuple[Hashable, ...]:
        """The names of the published datasets (as published: str or dask keys), a
        tuple as distributed's, sorted by their string forms."""
        client: Client = self  # type: ignore[assignment]
        b = backend_of(client, "list_datasets()")
        records = b.redis.hvals(b.keys.datasets)
        return tuple(sorted((pickling.loads(unpack_record(raw)[3]) for raw in records), key=str))

    @offloaded
    def get_dataset(
        self, name: Hashable | list[Hashable], default: Any = _NO_DEFAULT, **kwargs: Any
    ) -> Any:
        """The dataset published as ``name`` (a list of names: a list), with futures of
        this client; ``KeyError`` if there is none and no ``default`` is given."""
        client: Client = self  # type: ignore[assignment]
        what = "get_dataset()"
        b = backend_of(client, what)
        names = name if isinstance(name, list) else [name]
        fields = [_field(n) for n in names]
        found = []
        with b.client.sending():
            current, *raws = b.scripts.get_datasets(client=b.client_id, names=fields)
            for raw in raws:
                if raw is None:
                    found.append(None)
                    continue
                epoch, keys, data, _ = unpack_record(raw)
                found.append((data, hand_over(b, keys, epoch != current)))
        out = []
        for f, item in zip(fields, found, strict=True):
            if item is not None:
                out.append(decode(*item))
                learn_states(b, list(item[1].values()))
            elif default is _NO_DEFAULT:
                raise KeyError(
                    f"Dataset '{f}' not found in cluster {b.keys.cluster!r} (its datasets: "
                    f"{list(self.list_datasets())[:20]}); publish it with "
                    f"client.publish_dataset(value, name={f!r})"
                )
            else:
                out.append(default)
        return out if isinstance(name, list) else out[0]

    @property
    def datasets(self) -> Datasets:
        """The published datasets as a mapping: ``client.datasets["ds"]``,
        ``client.datasets["ds"] = df``, ``del client.datasets["ds"]``, ``list(...)``."""
        return Datasets(self)  # type: ignore[arg-type]


class Datasets(MutableMapping[Hashable, Any]):
    """A dict-like view of a client's dataset methods (distributed's ``Datasets``).  On
    an asynchronous client ``await client.datasets["ds"]`` and ``async for name in
    client.datasets`` work; what Python cannot await (``=``, ``del``, ``len``, ``for``)
    raises ``TypeError`` naming the awaitable call to use, as distributed's does."""

    __slots__ = ("_client",)

    def __init__(self, client: Client) -> None:
        self._client = client

    def _refuse_if_async(self, use: str, instead: str) -> None:
        if self._client.asynchronous:
            raise TypeError(
                f"Can't use {use} when client is asynchronous; please use {instead} instead"
            )

    def __getitem__(self, key: Hashable) -> Any:
        return self._client.get_dataset(key)  # (an awaitable on an asynchronous client)

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self._refuse_if_async(
            "'client.datasets[name] = value'", "'client.publish_dataset(name=value)'"
        )
        self._client.publish_dataset(value, name=key)

    def __delitem__(self, key: Hashable) -> None:
        self._refuse_if_async("'del client.datasets[name]'", "'client.unpublish_dataset(name)'")
        self._client.unpublish_dataset(key)

    def __contains__(self, key: object) -> bool:
        self._refuse_if_async("'name in client.datasets'", "'name in await client.list_datasets()'")
        return key in self._client.list_datasets()

    def __iter__(self) -> Iterator[Hashable]:
        if self._client.asynchronous:
            raise TypeError(
                "Can't invoke iter() or 'for' on client.datasets when client is "
                "asynchronous; use 'async for' instead"
            )
        yield from self._client.list_datasets()

    def __aiter__(self) -> AsyncIterator[Hashable]:
        if not self._client.asynchronous:
            raise TypeError(
                "Can't invoke 'async for' on client.datasets when client is "
                "synchronous; use iter() or 'for' instead"
            )

        async def names() -> AsyncIterator[Hashable]:
            for name in await self._client.list_datasets():
                yield name

        return names()

    def __len__(self) -> int:
        self._refuse_if_async("'len(client.datasets)'", "'len(await client.list_datasets())'")
        return len(self._client.list_datasets())
