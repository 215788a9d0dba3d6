"""Events, and the crash-safe file a rank writes them to as they happen.

A rank that hangs or dies never returns its events, so each one is written to a shared
memory mapping of a file the moment it is recorded: the page cache keeps it whatever
happens to the process, and the orchestrator reads the file afterwards.
"""

from __future__ import annotations

import bisect
import marshal
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# Event kinds.
CALL = "call"  # an instrumented method
BARRIER = "barrier"  # a framework-level barrier wrapped by instrument_barrier
MARK = "mark"  # a point event
COLLECTIVE = "collective"  # a torch.distributed collective
P2P = "p2p"  # send / recv
GROUP = "group"  # init_process_group, destroy_process_group, new_group
WAIT = "wait"  # the wait for an asynchronous collective or send/recv: where it completes
META = "meta"  # bookkeeping (thread names); never shown as an event
EXCHANGE = "exchange"  # the rank is inside ``timeline()``: for the watchdog only, never shown
COUNTERS = "counters"  # a finished rank's last collective per group: for the watchdog only
ARMED = "armed"  # a fault armed on this rank (``faults``)
FIRED = "fired"  # an armed fault acted, right after the event it acts at
HELD = "held"  # a schedule held the rank back at a point (``--ddp-explore``)
WATCH_ONLY = (EXCHANGE, COUNTERS, ARMED, FIRED, HELD)

# Phases.
START = "start"
END = "end"
POINT = "point"

# Raw record: (call_id, t_ns, lane, kind, phase, name, info). marshal keeps it fast.
RawEvent = tuple[int, int, int, str, str, str, "dict[str, Any] | None"]

_LENGTH = struct.Struct("<I")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Event:
    """One recorded event. ``index`` is its position in its rank's stream."""

    rank: int
    index: int
    lane: int
    kind: str
    phase: str
    name: str
    t_ns: int
    call_id: int
    info: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        what = {START: "started", END: "ended", POINT: "happened"}[self.phase]
        return f"{self.name} {what} on rank {self.rank} (event #{self.index})"


class EventFile:
    """Append-only event log in a memory-mapped file; grows in 1 MiB chunks.

    A record is a 4-byte length then a marshal payload; the length is written last, so a
    rank killed mid-write leaves a zero length that the reader takes as the end.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._size = 0
        self._map: mmap.mmap | None = None
        self._pos = 0
        self._grow(_CHUNK)

    def _grow(self, at_least: int) -> None:
        size = self._size
        while size < self._pos + at_least:
            size += _CHUNK
        os.ftruncate(self._fd, size)
        if self._map is not None:
            self._map.close()
        self._map = mmap.mmap(self._fd, size)
        self._size = size

    def write(self, record: RawEvent) -> None:
        payload = marshal.dumps(record)
        n = len(payload)
        pos = self._pos
        if pos + n + 8 > self._size:
            self._grow(n + 8)
        mapping = self._map
        assert mapping is not None
        mapping[pos + 4 : pos + 4 + n] = payload
        mapping[pos : pos + 4] = _LENGTH.pack(n)
        self._pos = pos + 4 + n

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_raw(path: str | os.PathLike[str]) -> Iterator[RawEvent]:
    """Yield the complete records of an event file; a torn or missing tail is ignored."""
    yield from read_new(path, 0)[0]


def read_new(path: str | os.PathLike[str], offset: int) -> tuple[list[RawEvent], int]:
    """The complete records from byte ``offset`` on, and the offset after the last of them:
    a reader that follows a live file reads each record once."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    out: list[RawEvent] = []
    pos, end = 0, len(data)
    while pos + 4 <= end:
        (n,) = _LENGTH.unpack_from(data, pos)
        if n == 0 or pos + 4 + n > end:
            break
        try:
            record = marshal.loads(data[pos + 4 : pos + 4 + n])
        except (EOFError, ValueError, TypeError):
            break
        if not _well_formed(record):
            break  # a torn length can frame a prefix that unmarshals: it is not a record
        out.append(record)
        pos += 4 + n
    return out, offset + pos


def _well_formed(record: Any) -> bool:
    return (
        type(record) is tuple
        and len(record) == 7
        and type(record[0]) is int
        and type(record[1]) is int
        and type(record[2]) is int
        and type(record[3]) is str
        and type(record[4]) is str
        and type(record[5]) is str
        and (record[6] is None or type(record[6]) is dict)
    )


def in_time_order(records: list[RawEvent]) -> list[RawEvent]:
    """Records in the order they happened: the calls native code issued, which are found after
    the fact (``native`` in their info) and appended then, go before the first record that was
    written after they were issued."""
    ids = {r[0] for r in records if r[3] == COLLECTIVE and r[4] == START and r[6] and r[6].get("native")}
    if not ids:
        return records
    late = sorted((r for r in records if r[0] in ids and r[3] == COLLECTIVE), key=lambda r: (r[1], r[4] != START))
    others = [r for r in records if not (r[0] in ids and r[3] == COLLECTIVE)]
    times = [r[1] for r in others]
    out: list[RawEvent] = []
    done = 0
    for record in late:
        at = max(bisect.bisect_right(times, record[1], lo=done), done)
        out.extend(others[done:at])
        out.append(record)
        done = at
    out.extend(others[done:])
    return out


def to_events(rank: int, records: Iterator[RawEvent] | list[RawEvent]) -> tuple[list[Event], dict[int, str]]:
    """Turn one rank's raw records into Events; also returns the lane -> thread name table."""
    events, lanes, _ = to_events_and_threads(rank, records)
    return events, lanes


def to_events_and_threads(
    rank: int, records: Iterator[RawEvent] | list[RawEvent]
) -> tuple[list[Event], dict[int, str], dict[int, int]]:
    """As ``to_events``, plus lane -> thread ident (to match stack dumps to lanes)."""
    events: list[Event] = []
    lanes: dict[int, str] = {}
    idents: dict[int, int] = {}
    for call_id, t_ns, lane, kind, phase, name, info in in_time_order(list(records)):
        if kind == META:
            lanes[lane] = name
            if info and "ident" in info:
                idents[lane] = int(info["ident"])
            continue
        if kind in WATCH_ONLY:
            continue
        events.append(Event(rank, len(events), lane, kind, phase, name, t_ns, call_id, info or {}))
    return events, lanes, idents
