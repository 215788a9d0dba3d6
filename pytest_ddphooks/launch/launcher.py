"""The pytest process's handle on its fork server (``forkserver.py``): start it, ask it to
fork a run's ranks, hear how they progress and end, have them killed."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any

from ..report import RankExit
from . import inherited_heap, protocol
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
        compact_memory: bool = False,
        bypass: tuple[int, int] | None = None,  # stdout and stderr uncaptured (capsys.disabled())
        freeze_inherited: bool = True,
    ) -> None:
        self._body_factory = body_factory
        self._bypass = bypass
        self._compact_memory = compact_memory
        self._freeze_inherited = freeze_inherited
        self._preload = preload
        self._log_path = log_path
        self._coverage_config = coverage_config
        self._sock: socket.socket | None = None
        self.pid = 0
        self._pending: list[Any] = []
        self._finishing: dict[str, str] = {}  # runs whose end was asked for: test id -> label
        self.late_sweeps: list[tuple[str, list[tuple[int, str]]]] = []  # (label, swept) of runs already reported
        self._awaited: set[str] = set()  # runs whose end a caller waits for
        self._swept: dict[str, list[tuple[int, str]]] = {}

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the fork server
            code = 0
            try:
                ours.close()
                server = ForkServer(theirs, self._body_factory, self._preload, parent, self._log_path, self._bypass)
                server.measure_ranks(self._coverage_config)
                if self._compact_memory:
                    server.compact_memory()
                if self._freeze_inherited:
                    inherited_heap.install()
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
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            readable, _, _ = select.select([self._sock], [], [], left)
            if not readable:
                return None
            try:
                msg = protocol.recv(self._sock)
            except EOFError:
                raise RuntimeError("the rank launcher died") from None
            test_id = getattr(msg, "test_id", None)
            if isinstance(msg, protocol.Finished):
                self._on_finished(msg)
                return None  # nothing for the caller: whoever waits for a run's end looks for it
            if not (test_id in self._finishing and isinstance(msg, (protocol.Exited, protocol.Noted))):
                return msg
            # what the ranks of a run already reported do as they leave is nobody's business

    def _on_finished(self, msg: protocol.Finished) -> None:
        label = self._finishing.pop(msg.test_id, None)
        if msg.test_id in self._awaited:
            self._swept[msg.test_id] = list(msg.swept)
        elif label is not None and msg.swept:
            self.late_sweeps.append((label, list(msg.swept)))

    def _receive_until(
        self,
        done: Callable[[], bool] = lambda: False,
        deadline: float | None = None,
        take: Callable[[Any], bool] = lambda msg: False,
    ) -> Any | None:
        """Read messages until one is ``take``n (returned), ``done()`` or the deadline; what
        else comes (rank exits, notes) is kept for later."""
        held = []
        try:
            while not done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                msg = self._receive(left)
                if msg is not None and take(msg):
                    return msg
                if isinstance(msg, protocol.Failed):
                    raise RuntimeError(f"the rank launcher failed: {msg.error}")
                if msg is not None:
                    held.append(msg)
            return None
        finally:
            self._pending[:0] = held

    def _expect(self, kind: type[Any], test_id: str | None = None) -> Any:
        """Wait for a reply of ``kind`` (about run ``test_id``, when given)."""
        return self._receive_until(
            take=lambda msg: isinstance(msg, kind) and (test_id is None or getattr(msg, "test_id", None) == test_id)
        )

    def spawn(self, job: Job) -> tuple[dict[int, int], bool]:
        """Start the ranks of ``job`` (fork them, or hand the test to the ranks prepared for
        it); returns rank -> pid, and whether they were prepared."""
        self._request(protocol.Spawn(job))
        spawned = self._expect(protocol.Spawned, job.test_id)
        return dict(spawned.pids), spawned.prepared

    def prepare(self, ahead: Job) -> None:
        """Have the ranks of the run ``ahead`` describes set up before its test comes."""
        self._request(protocol.Prepare(ahead))

    def discard(self, test_id: str) -> None:
        """The ranks prepared for this run will not be used."""
        self._request(protocol.Discard(test_id))

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

    def finish(self, test_id: str, label: str, wait: bool = True) -> list[tuple[int, str]]:
        """End the run: once its ranks are gone, what they left running is killed and its
        folder removed. With ``wait``, returns the (pid, command line) of those processes;
        without, the pytest process goes on at once and what is found later is kept in
        ``late_sweeps``."""
        self._pending = [m for m in self._pending if getattr(m, "test_id", None) != test_id]
        self._finishing[test_id] = label
        self._request(protocol.Finish(test_id))
        if not wait:
            return []
        self._awaited.add(test_id)
        try:
            self._receive_until(done=lambda: test_id in self._swept)
        finally:
            self._awaited.discard(test_id)
        return self._swept.pop(test_id)

    def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every run whose end was asked for has ended."""
        self._receive_until(done=lambda: not self._finishing, deadline=time.monotonic() + timeout)

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
                    msg = protocol.recv(self._sock)
                    if isinstance(msg, protocol.Finished):
                        self._on_finished(msg)
        self._sock.close()
        self._sock = None
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, 0)
