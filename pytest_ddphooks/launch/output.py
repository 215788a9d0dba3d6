"""Where a rank's output goes: descriptors 1 and 2 into the rank's own files (the report's
sections and a death's diagnosis read them), written by the rank itself, so a rank that dies
loses nothing it printed. With a live terminal (``-s``), the pytest process follows those
files (``LiveTail``) and writes each line, prefixed ``[rank N]``, to the terminal as it comes."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from .job import Job
from .procs import retire

# where the pytest process's stdout and stderr go uncaptured: what ``capsys.disabled()`` in a
# rank prints to while the session captures
bypass_fds: tuple[int, int] | None = None


class RankOutput:
    def __init__(self, job: Job, rank: int) -> None:
        self.job = job
        self.rank = rank
        self.crash_fd = 2  # where a fatal error dump goes (the rank's err file once started)

    def start(self) -> None:
        out = os.open(self.job.path(self.rank, "out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(self.job.path(self.rank, "err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        # a descriptor of its own: a dump reaches the file whatever 2 points at meanwhile (the
        # run's store connecting holds 2 back for a moment, a test may redirect it)
        self.crash_fd = os.dup(err)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)

    def leave(self) -> None:
        """From here the rank only takes its leave: nothing it prints or dumps is the test's
        output any more."""
        retire(1, 2, self.crash_fd)


LineSink = Callable[[int, str, list[bytes]], None]  # (rank, file kind, whole lines)


class FollowedFiles(Protocol):
    """What ``LiveTail`` follows: a run's files (a ``Job``), or any other rank-numbered set."""

    @property
    def world_size(self) -> int: ...

    def path(self, rank: int, what: str) -> str: ...


class LiveTail:
    """The lines a run's ranks write to their ``kinds`` of file, as they write them: read every
    ``every`` seconds and handed to ``sink`` (a line still being written waits for its end, or
    for the run's). ``-s`` follows stdout and stderr onto the terminal (``terminal_sink``);
    live logging follows the records each rank ships."""

    def __init__(
        self, job: FollowedFiles, sink: LineSink, kinds: tuple[str, ...] = ("out", "err"), every: float = 0.02
    ) -> None:
        self.job = job
        self.sink = sink
        self.kinds = kinds
        self.every = every
        self._files: dict[tuple[int, str], int] = {}
        self._pending: dict[tuple[int, str], bytes] = {}
        self._stop = threading.Event()
        self.paused = threading.Event()  # set while a rank's debugger has the terminal
        self._thread = threading.Thread(target=self._follow, name="ddphooks-live-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """The run is over: what is left, unfinished lines too, reaches the sink."""
        self._stop.set()
        self._thread.join(5.0)
        self._read(final=True)
        for fd in self._files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._files.clear()

    def _follow(self) -> None:
        while not self._stop.wait(self.every):
            if not self.paused.is_set():
                self._read()

    def _read(self, final: bool = False) -> None:
        for rank in range(self.job.world_size):
            for kind in self.kinds:
                key = (rank, kind)
                fd = self._files.get(key)
                if fd is None:
                    try:
                        fd = self._files[key] = os.open(self.job.path(rank, kind), os.O_RDONLY)
                    except OSError:
                        continue  # the rank has not started yet
                chunks = [self._pending.pop(key, b"")]
                while chunk := _read_some(fd):
                    chunks.append(chunk)
                *lines, rest = b"".join(chunks).split(b"\n")
                if final and rest:
                    lines.append(rest)
                elif rest:
                    self._pending[key] = rest
                if lines:
                    with contextlib.suppress(Exception):  # a sink that fails loses lines, never the run
                        self.sink(rank, kind, lines)


def terminal_sink(fd: int) -> LineSink:
    """Each line to ``fd``, prefixed ``[rank N]``."""

    def write(rank: int, kind: str, lines: list[bytes]) -> None:
        prefix = f"[rank {rank}] ".encode()
        _write(fd, b"".join(prefix + line + b"\n" for line in lines))

    return write


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def flush_std() -> None:
    """What Python holds for stdout and stderr reaches descriptors 1 and 2 now."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


@contextlib.contextmanager
def descriptors_to(files: tuple[int, int] | list[int]) -> Iterator[None]:
    """Descriptors 1 and 2 point at ``files`` while the block runs."""
    flush_std()
    saved = os.dup(1), os.dup(2)
    os.dup2(files[0], 1)
    os.dup2(files[1], 2)
    try:
        yield
    finally:
        flush_std()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


@contextlib.contextmanager
def capture_bypassed() -> Iterator[None]:
    """Descriptors 1 and 2 on the pytest process's own stdout and stderr meanwhile, as a
    plain test's ``capsys.disabled()`` prints (nothing changes where output is live: it
    reaches the terminal already)."""
    if bypass_fds is None:
        yield
        return
    with descriptors_to(bypass_fds):
        yield


def positions() -> tuple[int, int] | None:
    """How far the rank's stdout and stderr files are written (what Python buffered
    included): where a phase of the test begins in them. None when they are pipes (``-s``)."""
    flush_std()
    try:
        return os.lseek(1, 0, os.SEEK_CUR), os.lseek(2, 0, os.SEEK_CUR)
    except OSError:
        return None


def split_by_phase(out: bytes, err: bytes, marks: list[tuple[str, int, int]]) -> list[tuple[str, str, str]]:
    """(phase, stdout, stderr) of each phase that printed: ``marks`` holds where each phase
    after "setup" began in the two files. Without marks it all belongs to "call"."""
    if not marks:
        return [("call", as_text(out), as_text(err))] if out or err else []
    pieces = []
    bounds = [("setup", 0, 0), *marks]
    for i, (phase, out_at, err_at) in enumerate(bounds):
        out_to, err_to = (bounds[i + 1][1], bounds[i + 1][2]) if i + 1 < len(bounds) else (len(out), len(err))
        o, e = as_text(out[out_at:out_to]), as_text(err[err_at:err_to])
        if o or e:
            pieces.append((phase, o, e))
    return pieces


def as_text(data: bytes) -> str:
    """A rank's output as the report shows it (what is not UTF-8 replaced)."""
    return data.decode("utf-8", errors="replace")


def _write(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]
