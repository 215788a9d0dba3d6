"""The pytest process's handle on its fork server (``forkserver.py``): start it, ask it to
fork a run's ranks, hear how they progress and end, have them killed."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from typing import Any

from ..report import RankExit
from . import protocol
from .forkserver import BodyFactory, ForkServer
from .job import Job

RunEvent = protocol.Exited | protocol.Noted


class Launcher:
    def __init__(
        self,
        body_factory: BodyFactory,
        preload: tuple[str, ...] = ("torch", "torch.distributed"),
        log_path: str | None = None,
        coverage_config: str | None = None,
        keep_terminal: bool = False,
    ) -> None:
        self._body_factory = body_factory
        self._keep_terminal = keep_terminal
        self._preload = preload
        self._log_path = log_path
        self._coverage_config = coverage_config
        self._sock: socket.socket | None = None
        self.pid = 0
        self._pending: list[Any] = []

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the fork server
            code = 0
            try:
                ours.close()
                server = ForkServer(
                    theirs, self._body_factory, self._preload, parent, self._log_path, self._keep_terminal
                )
                server.measure_ranks(self._coverage_config)
                server.serve()
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        self._sock, self.pid = ours, pid

    def _request(self, message: Any) -> None:
        if self._sock is None:
            raise RuntimeError("the rank launcher is not running")
        protocol.send(self._sock, message)

    def _receive(self, timeout: float | None) -> Any | None:
        assert self._sock is not None
        if self._pending:
            return self._pending.pop(0)
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            return None
        try:
            return protocol.recv(self._sock)
        except EOFError:
            raise RuntimeError("the rank launcher died") from None

    def _expect(self, kind: type[Any], test_id: str | None = None) -> Any:
        """Wait for a reply of ``kind``; other messages (rank exits, notes) are kept for later."""
        held = []
        try:
            while True:
                msg = self._receive(None)
                if isinstance(msg, kind) and (test_id is None or getattr(msg, "test_id", None) == test_id):
                    return msg
                if isinstance(msg, protocol.Failed):
                    raise RuntimeError(f"the rank launcher failed: {msg.error}")
                held.append(msg)
        finally:
            self._pending[:0] = held

    def spawn(self, job: Job) -> dict[int, int]:
        """Fork the ranks of ``job``; returns rank -> pid."""
        self._request(protocol.Spawn(job))
        return dict(self._expect(protocol.Spawned, job.test_id).pids)

    def next_event(self, test_id: str, timeout: float | None) -> RunEvent | None:
        """The next exit or note of a rank of the run, or None when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            msg = self._receive(left)
            if msg is None:
                return None
            if isinstance(msg, (protocol.Exited, protocol.Noted)) and msg.test_id == test_id:
                return msg
            if left == 0.0 and not self._pending:
                return None

    def kill(self, test_id: str) -> list[RankExit]:
        """Kill every process of the run (ranks and whatever they started); wait for them."""
        self._request(protocol.Kill(test_id))
        exits = []
        while True:
            msg = self._receive(None)
            if isinstance(msg, protocol.Exited) and msg.test_id == test_id:
                exits.append(msg.exit)
            elif isinstance(msg, protocol.Killed) and msg.test_id == test_id:
                return exits

    def finish(self, test_id: str) -> list[tuple[int, str]]:
        """End the run; returns the (pid, command line) of processes it left and were killed."""
        self._request(protocol.Finish(test_id))
        swept = list(self._expect(protocol.Finished, test_id).swept)
        self._pending = [m for m in self._pending if getattr(m, "test_id", None) != test_id]
        return swept

    def probe(self) -> dict[str, Any]:
        self._request(protocol.Probe())
        return dict(self._expect(protocol.Probed).info)

    def close(self) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(OSError):
            protocol.send(self._sock, protocol.Shutdown())
            self._sock.settimeout(10)
            with contextlib.suppress(OSError, EOFError):
                while True:
                    protocol.recv(self._sock)
        self._sock.close()
        self._sock = None
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, 0)
