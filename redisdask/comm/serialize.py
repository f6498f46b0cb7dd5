"""Values to frames and back: pickle protocol 5 (cloudpickle where needed) with
out-of-band buffers, so that numpy data travels without copies; and the ``{key: value}``
message bodies of get-data/put-data, where a value that fails fails alone.

Only ever deserialize frames from an authenticated peer.
"""

from __future__ import annotations

import pickle
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from redisdask.comm.errors import FramingError, SerializationError
from redisdask.comm.frames import Buffer, Header
from redisdask.utils import pickling


def serialize(obj: Any) -> list[Buffer]:
    """Pickle ``obj`` (protocol 5, cloudpickle where needed); big buffers come out-of-band,
    uncopied."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        head = pickling.dumps(obj, buffer_callback=buffers.append)
    except Exception as exc:
        raise SerializationError(
            f"cannot serialize object of type {type(obj).__qualname__}: {exc}"
        ) from exc
    return [head, *(buf.raw() for buf in buffers)]


def deserialize(frames: Sequence[Buffer]) -> Any:
    """Inverse of :func:`serialize`.  Only call on frames from an authenticated peer."""
    if not frames:
        raise SerializationError("no frames to deserialize")
    try:
        return pickle.loads(frames[0], buffers=frames[1:])
    except Exception as exc:
        raise SerializationError(f"cannot deserialize: {type(exc).__name__}: {exc}") from exc


def serialize_dict(
    data: Mapping[Hashable, Any],
) -> tuple[Header, list[Buffer], dict[Hashable, SerializationError]]:
    """Serialize ``{key: value}`` into one message body; failures are per key.

    Returns ``(header, frames, errors)``.  ``header`` is
    ``{"keys": [...], "ranges": [[start, stop], ...], "errors": [[key, msg], ...]}``
    where ``frames[start:stop]`` holds the value of the matching key; values that
    cannot be pickled are left out, reported in ``errors`` and in the header.
    """
    keys: list[Hashable] = []
    ranges: list[list[int]] = []
    frames: list[Buffer] = []
    errors: dict[Hashable, SerializationError] = {}
    for key, value in data.items():
        try:
            parts = serialize(value)
        except SerializationError as exc:
            errors[key] = SerializationError(f"key {key!r}: {exc}", key=key)
            continue
        keys.append(key)
        ranges.append([len(frames), len(frames) + len(parts)])
        frames.extend(parts)
    failed = [[key, str(err)] for key, err in errors.items()]
    return {"keys": keys, "ranges": ranges, "errors": failed}, frames, errors


def _as_key(key: Any) -> Hashable:
    """msgpack turns tuple keys into lists; turn them back."""
    return tuple(_as_key(k) for k in key) if isinstance(key, list) else key


def deserialize_dict(
    header: Header, frames: Sequence[Buffer]
) -> tuple[dict[Hashable, Any], dict[Hashable, SerializationError]]:
    """Inverse of :func:`serialize_dict`: ``(values, errors)``, errors keyed by key."""
    try:
        pairs = list(zip(header["keys"], header["ranges"], strict=True))
        failed = header.get("errors", [])
    except (KeyError, TypeError, ValueError) as exc:
        raise FramingError(f"malformed dict header: {exc}") from exc
    values: dict[Hashable, Any] = {}
    errors = {_as_key(k): SerializationError(str(msg), key=_as_key(k)) for k, msg in failed}
    for raw_key, (start, stop) in pairs:
        key = _as_key(raw_key)
        if not 0 <= start < stop <= len(frames):
            raise FramingError(f"frame range {start}:{stop} of key {key!r} out of bounds")
        try:
            values[key] = deserialize(frames[start:stop])
        except SerializationError as exc:
            errors[key] = SerializationError(f"key {key!r}: {exc}", key=key)
    return values, errors


# -------------------------------------------------------------------------- framing
