"""Events, and the crash-safe file a rank writes them to as they happen.

A rank that hangs or dies never returns its events, so each one is written to a shared
memory mapping of a file the moment it is recorded: the page cache keeps it whatever
happens to the process, and the orchestrator reads the file afterwards.
"""

from __future__ import annotations

import bisect
import errno
import marshal
import mmap
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
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
# found after the fact: the rank's later calls on a group cannot be numbered for sure; they
# become unsure calls (paired with nothing), and the record itself is no event
UNSURE = "unsure"
EXCHANGE = "exchange"  # the rank is inside ``timeline()``: for the watchdog only, never shown
COUNTERS = "counters"  # a finished rank's last collective per group: for the watchdog only
ARMED = "armed"  # a fault armed on this rank (``faults``)
FIRED = "fired"  # an armed fault acted, right after the event it acts at
HELD = "held"  # a schedule held the rank back at a point (``--ddp-explore``)
THREADS = "threads"  # a stuck rank's threads that could still call torch.distributed: for the watchdog only
WATCH_ONLY = (EXCHANGE, COUNTERS, ARMED, FIRED, HELD, THREADS)
TEMPLATE = "template"  # in the event file only: what the compact records after it stand for

# Phases.
START = "start"
END = "end"
POINT = "point"

# In a collective's end: numbered as it began, alone on its group, but another thread's call on the
# group began before it returned, so which of the two the group took first is not known. Read
# back, the call has no number (as one that began beside another), and says why.
RACED = "raced"
RACED_WHY = (
    "another thread of the rank began a collective on the group before it returned: which of the two the group"
    " took first cannot be told"
)

# Raw record: (call_id, t_ns, lane, kind, phase, name, info). marshal keeps it fast.
RawEvent = tuple[int, int, int, str, str, str, "dict[str, Any] | None"]

_LENGTH = struct.Struct("<I")
_pack_length = _LENGTH.pack
_dumps = marshal.dumps
_CHUNK = 1 << 20
_READ_PIECE = 64 << 10  # a reader's first read; most tests record less
_LARGEST_PIECE = 16 << 20
# A compact record: call id, time, lane, template, and the two numbers that change from call
# to call of the same kind (a collective's seq; a wait's seq and the call it completes). Its
# length word has the top bit set.
_COMPACT = struct.Struct("<QqIIqq")
_COMPACT_TAG = 0x80000000 | _COMPACT.size
_pack_compact = _COMPACT.pack_into
_pack_tag = _LENGTH.pack_into
_MARSHALLED = 0x7FFFFFFF
MAX_TEMPLATES = 4096  # a test's calls repeat a few dozen forms; past this, records are written whole


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

    Most records of a test repeat: the end of a call, the start of the same collective on the
    same group and tensor shape. ``write_compact`` writes those as a template once (a marshal
    record the reader keeps) and then 44 bytes each, packed in place: the cost of recording a
    collective is mostly this write.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._size = 0
        self._map: mmap.mmap | None = None
        self._pos = 0
        # (kind, phase, name, id(static info), numbered) -> template number, and the info kept alive
        self._templates: dict[tuple[str, str, str, int, tuple[str, ...]], tuple[int, Any]] = {}
        # the first page written through the descriptor: on ext4 a first write through the
        # mapping costs a rank 0.2 ms more (a slower page fault on a page not yet in the file)
        os.pwrite(self._fd, bytes(mmap.PAGESIZE), 0)
        self._grow(_CHUNK)

    def _grow(self, at_least: int) -> None:
        size = self._size
        while size < self._pos + at_least:
            size += _CHUNK
        room = os.fstatvfs(self._fd)
        free = room.f_bavail * room.f_frsize
        if free < size - self._size:
            # the file is sparse: a write through the mapping to a page the filesystem has no
            # room for kills the process (SIGBUS), so say it here, where it can still be said
            raise OSError(
                errno.ENOSPC,
                f"no room for the event file {self.path} to grow to {size >> 20} MiB"
                f" ({free >> 10} KiB free on its filesystem)",
            )
        os.ftruncate(self._fd, size)
        if self._map is not None:
            self._map.close()
        self._map = mmap.mmap(self._fd, size)
        self._size = size

    def write(self, record: RawEvent) -> None:
        payload = _dumps(record)
        n = len(payload)
        pos = self._pos
        end = pos + 4 + n
        if end + 4 > self._size:
            self._grow(n + 8)
        mapping = self._map
        assert mapping is not None
        mapping[pos + 4 : end] = payload
        mapping[pos : pos + 4] = _pack_length(n)
        self._pos = end

    def write_compact(self, record: RawEvent, static: dict[str, Any] | None, numbered: tuple[str, ...] = ()) -> None:
        """Write ``record``, whose info is ``static`` (a dict that never changes, or None) plus
        the integers named in ``numbered`` (at most two)."""
        call_id, t_ns, lane, kind, phase, name, info = record
        key = (kind, phase, name, id(static), numbered)
        known = self._templates.get(key)
        if known is None:
            if len(self._templates) >= MAX_TEMPLATES:  # forms that do not repeat: written whole
                self.write(record)
                return
            known = self._templates[key] = (len(self._templates) + 1, static)
            details = {"kind": kind, "info": static, "numbered": list(numbered)}
            self.write((known[0], 0, 0, TEMPLATE, phase, name, details))
        first = second = 0
        if numbered:
            assert info is not None
            first = info[numbered[0]]
            if len(numbered) > 1:
                second = info[numbered[1]]
        pos = self._pos
        if pos + 4 + _COMPACT.size + 4 > self._size:
            self._grow(_COMPACT.size + 8)
        mapping = self._map
        assert mapping is not None  # mapped from __init__ until close()
        _pack_compact(mapping, pos + 4, call_id, t_ns, lane, known[0], first, second)
        _pack_tag(mapping, pos, _COMPACT_TAG)
        self._pos = pos + 4 + _COMPACT.size

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def filled_info(static: dict[str, Any] | None, numbered: Sequence[str], values: Sequence[int]) -> dict[str, Any] | None:
    """A call's info from its form: ``static`` plus the integers ``values`` under the names in
    ``numbered`` (values beyond those names are ignored), a dict of its own."""
    if not numbered:
        return dict(static) if static is not None else None
    return {**(static or {}), **dict(zip(numbered, values, strict=False))}


def read_raw(path: str | os.PathLike[str]) -> Iterator[RawEvent]:
    """Yield the complete records of an event file; a torn or missing tail is ignored."""
    yield from EventReader(path).read_new()


class EventReader:
    """Reads an event file as it grows: each call returns the complete records written since
    the last one (a reader that follows a live file reads each record once)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self.offset = 0
        self._templates: dict[int, tuple[str, str, str, dict[str, Any] | None, list[str]]] = {}

    def read_new(self) -> list[RawEvent]:
        # The file is sized ahead in 1 MiB chunks of zeros: read what follows the last record
        # in pieces, and stop at the first zero length word, not at the end of the file.
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        out: list[RawEvent] = []
        try:
            size = _READ_PIECE
            while True:
                data = os.pread(fd, size, self.offset)
                pos, ended = self._parse(data, out)
                self.offset += pos
                if ended or len(data) < size:
                    return out
                # more was written than this piece held: read on, in larger pieces (one that
                # holds a record larger than the piece whole)
                size = min(size * 2, _LARGEST_PIECE) if pos else size * 4
        finally:
            os.close(fd)

    def _parse(self, data: bytes, out: list[RawEvent]) -> tuple[int, bool]:
        """Append the complete records at the start of ``data`` to ``out``; return how many
        bytes they took and whether the records ended there (rather than ``data``)."""
        pos, end = 0, len(data)
        templates = self._templates
        while pos + 4 <= end:
            (n,) = _LENGTH.unpack_from(data, pos)
            if n == 0:
                return pos, True
            if n == _COMPACT_TAG:
                if pos + 4 + _COMPACT.size > end:
                    break
                call_id, t_ns, lane, template, first, second = _COMPACT.unpack_from(data, pos + 4)
                known = templates.get(template)
                if known is None or t_ns == 0:
                    return pos, True  # a torn length word, or a body not all written yet: not a record (yet)
                kind, phase, name, static, numbered = known
                info = filled_info(static, numbered, (first, second))
                out.append((call_id, t_ns, lane, kind, phase, name, info))
                pos += 4 + _COMPACT.size
                continue
            if n > _MARSHALLED:
                return pos, True
            if pos + 4 + n > end:
                break
            try:
                record = marshal.loads(data[pos + 4 : pos + 4 + n])
            except (EOFError, ValueError, TypeError):
                return pos, True
            if not _well_formed(record):
                return pos, True  # a torn length can frame a prefix that unmarshals: it is not a record
            if record[3] == TEMPLATE:
                details = record[6] or {}
                if not {"kind", "info", "numbered"} <= details.keys():
                    return pos, True
                templates[record[0]] = (details["kind"], record[4], record[5], details["info"], details["numbered"])
            else:
                out.append(record)
            pos += 4 + n
        return pos, False


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
    ids = {
        r[0]
        for r in records
        if (r[3] == COLLECTIVE and r[4] == START and r[6] and r[6].get("native")) or r[3] == UNSURE
    }
    if not ids:
        return records

    def found_late(r: RawEvent) -> bool:
        return r[0] in ids and r[3] in (COLLECTIVE, UNSURE)

    late = sorted((r for r in records if found_late(r)), key=lambda r: (r[1], r[4] != START))
    others = [r for r in records if not found_late(r)]
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
    lost: dict[str, str] = {}  # group -> why the rank's calls on it from here are unsure
    records = in_time_order(list(records))
    # call id -> why: calls that raced another thread's on their group, as their end says
    unsure_calls = {r[0]: RACED_WHY for r in records if r[4] == END and r[3] == COLLECTIVE and r[6] and r[6].get(RACED)}
    for call_id, t_ns, lane, kind, phase, name, info in records:
        if kind == META:
            lanes[lane] = name
            if info and "ident" in info:
                idents[lane] = int(info["ident"])
            continue
        if kind == UNSURE:
            if info:
                lost.setdefault(str(info.get("group")), str(info.get("unsure")))
            continue
        if kind in WATCH_ONLY:
            continue
        if (lost or unsure_calls) and kind in (COLLECTIVE, P2P):
            info = _made_unsure(info, phase, call_id, lost, unsure_calls)
        events.append(Event(rank, len(events), lane, kind, phase, name, t_ns, call_id, info or {}))
    return events, lanes, idents


def _made_unsure(
    info: dict[str, Any] | None, phase: str, call_id: int, lost: dict[str, str], unsure_calls: dict[int, str]
) -> dict[str, Any] | None:
    """A call on a group whose numbering the rank lost before it began: no number, and why."""
    if phase == START and info and str(info.get("group")) in lost:
        unsure_calls[call_id] = lost[str(info["group"])]
    why = unsure_calls.get(call_id)
    if why is None:
        return info
    kept = {k: v for k, v in (info or {}).items() if k not in ("seq", "unseen", RACED)}
    kept.setdefault("unsure", why)
    return kept
