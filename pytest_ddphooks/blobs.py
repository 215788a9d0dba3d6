"""Values of any size through a torch.distributed key-value store.

A store value must stay under the store's payload limit (8 MiB for a TCPStore): a blob is
compressed and cut into chunks under keys of its own; the number of chunks is all a reader
needs to be told.
"""

from __future__ import annotations

import zlib
from typing import Any

CHUNK = 4 << 20


def put(store: Any, key: str, blob: bytes) -> int:
    """Write ``blob`` under ``key``; returns how many chunks it took."""
    data = zlib.compress(blob, 1)
    parts = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    for i, part in enumerate(parts):
        store.set(f"{key}/{i}", part)
    return len(parts)


def get(store: Any, key: str, chunks: int) -> bytes:
    """The blob ``put`` wrote under ``key`` in ``chunks`` chunks (waits for them)."""
    return zlib.decompress(b"".join(bytes(store.get(f"{key}/{i}")) for i in range(chunks)))
