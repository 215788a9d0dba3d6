"""Where a rank's output goes: descriptors 1 and 2 into the rank's own files (the report's
sections and a death's diagnosis read them). With a live terminal (``-s``), through a pipe
each instead, which a thread of the rank copies both to the files and, every line prefixed
``[rank N]``, to the terminal as it is printed. A crash dump always goes straight to the
file: a dying process runs no thread."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Iterator

from .job import Job
from .procs import retire

# the pytest process's stdout, kept open by the fork server when the session prints live
terminal_fd: int | None = None
# where the pytest process's stdout and stderr go uncaptured: what ``capsys.disabled()`` in a
# rank prints to while the session captures
bypass_fds: tuple[int, int] | None = None


class RankOutput:
    def __init__(self, job: Job, rank: int) -> None:
        self.job = job
        self.rank = rank
        self.crash_fd = 2  # where a fatal error dump goes (the rank's err file once started)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        out = os.open(self.job.path(self.rank, "out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(self.job.path(self.rank, "err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        # a descriptor of its own: a dump reaches the file whatever 2 points at meanwhile (the
        # run's store connecting holds 2 back for a moment, a test may redirect it)
        self.crash_fd = os.dup(err)
        live = self._open_live()
        if live is None:
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            os.close(err)
            return
        pipes = {}
        for target, fd in ((out, 1), (err, 2)):
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            pipes[read_end] = target
        self._thread = threading.Thread(target=self._copy, args=(pipes, live), name="ddphooks-live-output", daemon=True)
        self._thread.start()

    def _open_live(self) -> int | None:
        if not self.job.live_output or terminal_fd is None:
            return None
        try:
            return os.dup(terminal_fd)
        except OSError:
            return None

    def _copy(self, pipes: dict[int, int], live: int) -> None:
        prefix = f"[rank {self.rank}] ".encode()
        pending = dict.fromkeys(pipes, b"")
        while pipes:
            readable, _, _ = select.select(list(pipes), [], [])
            for fd in readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    if pending[fd]:
                        _write(live, prefix + pending[fd] + b"\n")
                    os.close(fd)
                    del pipes[fd]
                    continue
                _write(pipes[fd], chunk)
                *lines, pending[fd] = (pending[fd] + chunk).split(b"\n")
                if lines:
                    _write(live, b"".join(prefix + line + b"\n" for line in lines))

    def leave(self) -> None:
        """From here the rank only takes its leave: nothing it prints or dumps is the test's
        output any more (where output is live, a dump still reaches the rank's file)."""
        retire(1, 2)
        if self._thread is None:
            retire(self.crash_fd)

    def finish(self) -> None:
        """The body is over: let the copying thread write what is left."""
        if self._thread is None:
            return
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        self._thread.join(5.0)


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
