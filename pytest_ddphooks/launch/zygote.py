"""The warm launcher: a fork of the pytest process that forks fresh rank processes.

It is forked once, right after collection, so it holds every test module already imported
the way pytest imports them (rootdir, import mode, conftests, assertion rewriting); it then
imports torch. Each run forks ``world_size`` ranks from that clean state: a rank costs a
fork, never a new interpreter, and no rank sees what earlier tests did in the pytest process.

The launcher is a child subreaper: whatever a rank starts and abandons is re-parented to it,
so the whole tree of a run can be found and killed. It reaps the ranks and tells the pytest
process how each one ended. It dies with the pytest process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import protocol, rendezvous
from .job import Job

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

BodyFactory = Callable[[Job], Callable[..., Any]]


def prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def children_of(pid: int) -> list[int]:
    """Direct children of a process, from /proc (cheap: no scan of every process)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return out


def descendants_of(pid: int) -> list[int]:
    found: list[int] = []
    todo = children_of(pid)
    while todo:
        p = todo.pop()
        if p in found:
            continue
        found.append(p)
        todo.extend(children_of(p))
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody reaped yet is not running)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def command_line(pid: int, settle: bool = False) -> str:
    """The command line of a process. With ``settle``, a process caught between fork and
    exec (its command line still empty) gets up to 100 ms to become what it will run."""
    for _ in range(20 if settle else 1):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            return "?"
        text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.005)
    return "?"


def retire(*fds: int) -> None:
    """Release descriptors a forked process must not use, leaving /dev/null in their place
    so that a stale object closing its old number later cannot close a new descriptor."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.dup2(null, fd)
    os.close(null)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


@dataclass
class RankExit:
    """How a rank process ended: ``code`` from exit(), or the ``signal`` that killed it."""

    rank: int
    pid: int
    code: int | None
    signal: int | None
    by_harness: bool = False  # killed by the harness while it still ran, not ended on its own

    @classmethod
    def from_status(cls, rank: int, pid: int, status: int, by_harness: bool = False) -> RankExit:
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            return cls(rank, pid, None, -code, by_harness)
        return cls(rank, pid, code, None, by_harness)

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        return f"exit code {self.code}"


@dataclass
class _Run:
    job: Job
    pids: dict[int, int] = field(default_factory=dict)  # pid -> rank
    pgid: int = 0


class Launcher:
    """The pytest process's handle on the warm launcher."""

    def __init__(
        self,
        body_factory: BodyFactory,
        preload: tuple[str, ...] = ("torch", "torch.distributed"),
        log_path: str | None = None,
    ) -> None:
        self._body_factory = body_factory
        self._preload = preload
        self._log_path = log_path
        self._sock: socket.socket | None = None
        self.pid = 0
        self._pending: list[Any] = []

    @property
    def alive(self) -> bool:
        return self._sock is not None

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the launcher
            code = 0
            try:
                ours.close()
                _Zygote(theirs, self._body_factory, self._preload, parent, self._log_path).serve()
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        self._sock, self.pid = ours, pid

    def _request(self, message: Any) -> None:
        assert self._sock is not None, "the launcher is not running"
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

    def _expect(self, kind: str, test_id: str | None = None) -> Any:
        """Wait for a reply of ``kind``; other messages (rank exits) are kept for later."""
        held = []
        try:
            while True:
                msg = self._receive(None)
                if msg[0] == kind and (test_id is None or msg[1] == test_id):
                    return msg
                if msg[0] == "error":
                    raise RuntimeError(f"the rank launcher failed: {msg[1]}")
                held.append(msg)
        finally:
            self._pending[:0] = held

    def spawn(self, job: Job) -> dict[int, int]:
        """Fork the ranks of ``job``; returns rank -> pid."""
        self._request(("run", job))
        return dict(self._expect("started", job.test_id)[2])

    def next_exit(self, test_id: str, timeout: float | None) -> RankExit | None:
        """The next rank of the run to end, or None when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            msg = self._receive(left)
            if msg is None:
                return None
            if msg[0] == "exited" and msg[1] == test_id:
                return msg[2]
            if left == 0.0 and not self._pending:
                return None

    def kill(self, test_id: str) -> list[RankExit]:
        """Kill every process of the run (ranks and whatever they started); wait for them."""
        self._request(("kill", test_id))
        exits = []
        while True:
            msg = self._receive(None)
            if msg[0] == "exited" and msg[1] == test_id:
                exits.append(msg[2])
            elif msg[0] == "killed" and msg[1] == test_id:
                return exits

    def finish(self, test_id: str) -> list[tuple[int, str]]:
        """End the run; returns the (pid, command line) of processes it left and were killed."""
        self._request(("finish", test_id))
        return list(self._expect("finished", test_id)[2])

    def probe(self) -> dict[str, Any]:
        self._request(("probe",))
        return dict(self._expect("probe")[1])

    def close(self) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(OSError):
            protocol.send(self._sock, ("shutdown",))
            self._sock.settimeout(10)
            with contextlib.suppress(OSError, EOFError):
                while True:
                    protocol.recv(self._sock)
        self._sock.close()
        self._sock = None
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, 0)


class _Zygote:
    def __init__(
        self,
        sock: socket.socket,
        body_factory: BodyFactory,
        preload: tuple[str, ...],
        parent: int,
        log_path: str | None,
    ) -> None:
        self.sock = sock
        self.body_factory = body_factory
        self.parent = parent
        self.runs: dict[str, _Run] = {}
        self.rank_of: dict[int, tuple[str, int]] = {}
        os.setpgid(0, 0)  # terminal signals (Ctrl-C) go to pytest, which then stops us
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(0)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        self._isolate_descriptors(log_path)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_term)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        for name in preload:
            __import__(name)
        from ..recorder import distpatch

        distpatch.install()

    def _isolate_descriptors(self, log_path: str | None) -> None:
        """Point every inherited descriptor at /dev/null (pipes of xdist, pytest's capture).

        They are replaced rather than closed: objects that still think they own them may
        close them later, and must not close one of ours that reused the number.
        """
        null = os.open(os.devnull, os.O_RDWR)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if log_path else null
        keep = {self.sock.fileno(), null, log}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.dup2(log if fd == 2 else null, fd)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        sys.stdin = open(0, closefd=False)  # noqa: SIM115

    def _on_term(self, *_: object) -> None:
        self._kill_everything()
        os._exit(0)

    def serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, "control")
        sel.register(self.wake_r, selectors.EVENT_READ, "child")
        while True:
            for key, _ in sel.select():
                if key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 512):
                            pass
                    self._reap()
                    continue
                try:
                    message = protocol.recv(self.sock)
                except (EOFError, OSError):
                    self._kill_everything()
                    return
                if message[0] == "shutdown":
                    self._kill_everything()
                    return
                try:
                    self._handle(message)
                except Exception as exc:  # keep serving; the pytest side reports it
                    protocol.send(self.sock, ("error", f"{type(exc).__name__}: {exc}"))

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "run":
            self._run(message[1])
        elif kind == "kill":
            self._kill_run(message[1])
        elif kind == "finish":
            swept = self._sweep()
            self.runs.pop(message[1], None)
            protocol.send(self.sock, ("finished", message[1], swept))
        elif kind == "probe":
            protocol.send(self.sock, ("probe", self._probe()))
        else:
            raise ValueError(f"unknown request {kind!r}")

    def _probe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"pid": os.getpid()}
        torch = sys.modules.get("torch")
        if torch is not None:
            info["torch"] = torch.__version__
            try:
                info["cuda_devices"] = int(torch.cuda.device_count())
            except Exception:
                info["cuda_devices"] = 0
        return info

    def _run(self, job: Job) -> None:
        from .rank import rank_main

        run = self.runs[job.test_id] = _Run(job)
        listener = rendezvous.listener()
        port = listener.getsockname()[1]
        body = self.body_factory(job)
        for rank in range(job.world_size):
            pid = os.fork()
            if pid == 0:
                try:
                    os.setpgid(0, run.pgid)
                    signal.set_wakeup_fd(-1)
                    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                        signal.signal(sig, signal.SIG_DFL)
                    retire(self.sock.fileno(), self.wake_r, self.wake_w)
                    rank_main(job, rank, port, listener, body)
                finally:
                    os._exit(70)
            with contextlib.suppress(OSError):
                os.setpgid(pid, run.pgid or pid)
            if not run.pgid:
                run.pgid = pid
            run.pids[pid] = rank
            self.rank_of[pid] = (job.test_id, rank)
        listener.close()
        protocol.send(self.sock, ("started", job.test_id, {r: p for p, r in run.pids.items()}))

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.rank_of.pop(pid, None)
            if owner is not None:
                test_id, rank = owner
                protocol.send(self.sock, ("exited", test_id, RankExit.from_status(rank, pid, status)))

    def _kill_run(self, test_id: str) -> None:
        run = self.runs.get(test_id)
        if run is not None:
            # a rank that ended on its own just before (its framework killed it) is a death
            running = {pid for pid in run.pids if is_running(pid)}
            victims = set(run.pids)
            for pid in run.pids:
                victims.update(descendants_of(pid))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.pgid, signal.SIGKILL)
            for pid in victims:
                _kill(pid)
            for pid in list(run.pids):
                if pid in self.rank_of:
                    with contextlib.suppress(ChildProcessError):
                        _, status = os.waitpid(pid, 0)
                        test, rank = self.rank_of.pop(pid)
                        ended = RankExit.from_status(rank, pid, status, by_harness=pid in running)
                        protocol.send(self.sock, ("exited", test, ended))
        self._sweep()
        protocol.send(self.sock, ("killed", test_id))

    def _sweep(self) -> list[tuple[int, str]]:
        """Kill our children that are no rank of a live run: processes ranks abandoned."""
        swept: list[tuple[int, str]] = []
        for _ in range(5):
            strays = [p for p in children_of(os.getpid()) if p not in self.rank_of]
            if not strays:
                break
            for pid in strays:
                tree = [pid, *descendants_of(pid)]
                for p in tree:
                    swept.append((p, command_line(p)))
                    _kill(p)
            for pid in strays:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            self._reap()
        return swept

    def _kill_everything(self) -> None:
        for pid in descendants_of(os.getpid()):
            _kill(pid)
        for pid in list(self.rank_of):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
