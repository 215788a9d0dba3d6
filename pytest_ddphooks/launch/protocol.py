"""The messages between the pytest process and its fork server, length-prefixed and pickled.

Requests go from the pytest process to the fork server; every other message comes back.
``Exited`` and ``Noted`` arrive whenever a rank ends or reaches a phase, between the replies.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

from ..report import RankExit
from .job import Job

_HEADER = struct.Struct("<Q")


@dataclass(frozen=True)
class RunMessage:
    """A message about one run."""

    test_id: str


# -- requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    """Fork the ranks of a job."""

    job: Job


@dataclass(frozen=True)
class Prepare:
    """Fork and set up, ahead of time, the ranks of the run ``job`` describes (its test not
    yet known: no body, no payload); a ``Spawn`` of a job with the same id hands the test
    to them. Replaces ranks prepared before and not used. No reply."""

    job: Job


@dataclass(frozen=True)
class Discard(RunMessage):
    """The ranks prepared for this run will not be used: kill them. No reply."""


@dataclass(frozen=True)
class Kill(RunMessage):
    """Kill every process of a run; answered by its ``Exited`` messages, then ``Killed``."""


@dataclass(frozen=True)
class Finish(RunMessage):
    """The run's results are in: once its ranks are gone, kill what they abandoned and remove
    the run's folder; answered by ``Finished`` then (the pytest process need not wait)."""


@dataclass(frozen=True)
class Probe:
    """What the fork server has (torch version, visible GPUs); answered by ``Probed``."""


@dataclass(frozen=True)
class Shutdown:
    """Kill everything and end."""


# -- replies and reports -------------------------------------------------------------------


@dataclass(frozen=True)
class Spawned(RunMessage):
    pids: dict[int, int]  # rank -> pid
    prepared: bool = False  # the ranks were set up ahead of the test


@dataclass(frozen=True)
class Exited(RunMessage):
    exit: RankExit


@dataclass(frozen=True)
class Noted(RunMessage):
    """A rank reached a phase: ``setup`` (its fixtures are set up, or failed to), ``done``
    (its result is written)."""

    rank: int
    phase: str
    status: str


@dataclass(frozen=True)
class Killed(RunMessage):
    """Every process of the run is gone."""


@dataclass(frozen=True)
class Finished(RunMessage):
    swept: list[tuple[int, str]]  # (pid, command line) of abandoned processes it killed


@dataclass(frozen=True)
class Probed:
    info: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """A request could not be carried out."""

    error: str


def send(sock: socket.socket, message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_read_exact(sock, _HEADER.size))
    return pickle.loads(_read_exact(sock, n))


def note_line(rank: int, phase: str, status: str) -> bytes:
    """What a rank writes to its run's note pipe (one short line: a single atomic write)."""
    return f"{rank} {phase} {status}\n".encode()


def parse_notes(buffer: bytes) -> tuple[list[tuple[int, str, str]], bytes]:
    """The complete note lines in ``buffer``, and what is left of an incomplete one."""
    *lines, rest = buffer.split(b"\n")
    notes = []
    for line in lines:
        parts = line.decode(errors="replace").split(" ", 2)
        if len(parts) == 3 and parts[0].isdigit():
            notes.append((int(parts[0]), parts[1], parts[2]))
    return notes, rest
