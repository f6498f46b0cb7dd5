"""msgpack's ``packb`` with a small first buffer.

msgpack's ``Packer`` starts each message in a 256 KiB buffer, allocated and freed per
call.  A worker gives freed memory back to the system at once (``mallopt``'s trim
threshold, ``workers/memory.py``), so each message it packed grew the heap by 256 KiB
and shrank it again: two ``brk`` calls and a fresh page's fault per message, about 15 of
them per task (its report, the client's news), where packing itself takes a microsecond
or two.  Started at ``PACK_BUFFER`` bytes, the buffer grows only for a big message.
"""

from __future__ import annotations

from typing import Any

import msgpack

PACK_BUFFER = 4096  # bytes: most messages fit; well below malloc's mmap threshold


def packb(obj: Any, *, use_bin_type: bool = True) -> bytes:
    return msgpack.packb(obj, use_bin_type=use_bin_type, buf_size=PACK_BUFFER)
