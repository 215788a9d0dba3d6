"""The fork server: a fork of the pytest process that forks fresh rank processes.

It is forked once, right after collection, so it holds every test module already imported
the way pytest imports them (rootdir, import mode, conftests, assertion rewriting); it then
imports torch. Each run forks ``world_size`` ranks from that clean state: a rank costs a
fork, never a new interpreter, and no rank sees what earlier tests did in the pytest process.

It is a child subreaper: whatever a rank starts and abandons is re-parented to it, so the
whole tree of a run can be found and killed. It reaps the ranks and tells the pytest process
how each one ended, and relays the notes ranks write to their run's pipe as they reach a
phase. It dies with the pytest process.

While a test runs, it prepares the ranks of the next one (``Prepare``): forked, their store
up and their group connected, each waiting on a pipe for the test (no CPU meanwhile). The
``Spawn`` of that run hands the test to them; a run that finished has its ranks reaped and
its folder removed while the pytest process goes on to the next test.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import coverage_relay
from ..report import RankExit
from . import hugepages, inherited_heap, output, procs, protocol, rendezvous
from .job import Job
from .rank import HANDED_JOB, RankBody, prepared_rank_main, rank_main

BodyFactory = Callable[[Job], RankBody]


@dataclass
class _Run:
    job: Job
    pids: dict[int, int] = field(default_factory=dict)  # pid -> rank
    pgid: int = 0
    notes: int = -1  # the read end of the ranks' note pipe
    pending: bytes = b""
    handed: int = -1  # prepared ranks: the write end of the pipe that hands them their test
    finishing: bool = False  # its results are in: finish it once its ranks are gone
    lost: bool = False  # prepared ranks: one ended before it was handed a test


RankMain = Callable[[int, int, Any, int], None]  # (rank, port, listener, notes) -> never returns


# the signals this server takes for itself
_SERVER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)


class ForkServer:
    def __init__(
        self,
        sock: socket.socket,
        body_factory: BodyFactory,
        preload: tuple[str, ...],
        parent: int,
        log_path: str | None,
        bypass: tuple[int, int] | None = None,
    ) -> None:
        self.sock = sock
        self.body_factory = body_factory
        self.parent = parent
        self.runs: dict[str, _Run] = {}
        self.rank_of: dict[int, tuple[str, int]] = {}
        self.ready: _Run | None = None  # ranks prepared for the next run, not yet handed a test
        os.setpgid(0, 0)  # terminal signals (Ctrl-C) go to pytest, which then stops us
        procs.prctl(procs.PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(0)
        procs.prctl(procs.PR_SET_CHILD_SUBREAPER, 1)
        self._isolate_descriptors(log_path, bypass)
        self.selector = selectors.DefaultSelector()  # after the isolation, which replaces every other descriptor
        # what the pytest process had (Python's KeyboardInterrupt, a conftest's SIGTERM
        # handler): a rank gets those back, as a process the code under test started would
        self.rank_handlers = {sig: signal.getsignal(sig) for sig in _SERVER_SIGNALS}
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

    def compact_memory(self) -> None:
        """Move this process's memory into huge pages before the first fork: forking a rank
        then copies a few hundred page table entries instead of tens of thousands. (Done in
        a thread while ranks were forked, some ranks stalled for seconds in their set-up.)"""
        hugepages.collapse()

    def measure_ranks(self, coverage_config: str | None) -> None:
        """The session measures coverage: not this server's own code, each rank's test."""
        coverage_relay.stop_inherited()
        if coverage_config is not None:
            coverage_relay.prepare(coverage_config)

    def _isolate_descriptors(self, log_path: str | None, bypass: tuple[int, int] | None = None) -> None:
        """Point every inherited descriptor at /dev/null (pipes of xdist, pytest's capture).

        They are replaced rather than closed: objects that still think they own them may
        close them later, and must not close one of ours that reused the number.
        """
        null = os.open(os.devnull, os.O_RDWR)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if log_path else null
        keep = {self.sock.fileno(), null, log}
        if bypass is not None:
            output.bypass_fds = (os.dup(bypass[0]), os.dup(bypass[1]))
            keep.update(output.bypass_fds)
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

    def _send(self, message: Any) -> None:
        protocol.send(self.sock, message)

    def serve(self) -> None:
        self.selector.register(self.sock, selectors.EVENT_READ, "control")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")
        while True:
            for key, _ in self.selector.select():
                if key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 512):
                            pass
                    self._reap()
                    continue
                if isinstance(key.data, str) and key.data != "control":
                    self._relay_notes(key.data)
                    continue
                try:
                    message = protocol.recv(self.sock)
                except (EOFError, OSError):
                    self._kill_everything()
                    return
                if isinstance(message, protocol.Shutdown):
                    self._kill_everything()
                    return
                try:
                    self._handle(message)
                except Exception as exc:  # keep serving; the pytest side reports it
                    self._send(protocol.Failed(f"{type(exc).__name__}: {exc}"))

    def _handle(self, message: Any) -> None:
        if isinstance(message, protocol.Spawn):
            self._spawn(message.job)
        elif isinstance(message, protocol.Prepare):
            try:
                self._prepare(message.job)
            except Exception as exc:  # only a head start lost: the test's ranks are forked when it comes
                print(f"ddphooks: could not prepare ranks ahead: {type(exc).__name__}: {exc}", file=sys.stderr)
                self._discard_ready(remove_folder=True)
        elif isinstance(message, protocol.Discard):
            if self.ready is not None and self.ready.job.test_id == message.test_id:
                self._discard_ready(remove_folder=True)
        elif isinstance(message, protocol.Kill):
            self._kill_run(message.test_id)
        elif isinstance(message, protocol.Finish):
            run = self.runs.get(message.test_id)
            if run is None:
                self._send(protocol.Finished(message.test_id, []))
            else:
                run.finishing = True
                self._finish_if_gone(run)
        elif isinstance(message, protocol.Probe):
            self._send(protocol.Probed(self._probe()))
        else:
            raise ValueError(f"unknown request {message!r}")

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

    def _spawn(self, job: Job) -> None:
        if self.ready is not None and self.ready.job.test_id == job.test_id:
            if self._hand_over(job):
                return
            self._discard_ready(remove_folder=False)
            _empty(job.run_dir)  # what the lost ranks wrote: the fresh ones start clean
        run = self.runs[job.test_id] = _Run(job)
        body = self.body_factory(job)
        self._fork_ranks(run, lambda rank, port, listener, notes: rank_main(job, rank, port, listener, notes, body))
        self._start_relaying(run)
        self._send(protocol.Spawned(job.test_id, {r: p for p, r in run.pids.items()}))

    def _prepare(self, ahead: Job) -> None:
        if self.ready is not None:
            self._discard_ready(remove_folder=True)
        run = self.ready = _Run(ahead)
        handed_r, run.handed = os.pipe()
        factory = self.body_factory

        def main(rank: int, port: int, listener: Any, notes: int) -> None:
            prepared_rank_main(ahead, rank, port, listener, notes, handed_r, factory)

        self._fork_ranks(run, main, keep=handed_r)
        os.close(handed_r)

    def _hand_over(self, job: Job) -> bool:
        """Give the test to the ranks prepared for it; False when one of them is gone."""
        run = self.ready
        assert run is not None
        self._reap()  # learn of a prepared rank that ended while it waited
        if run.lost or any(procs.is_ending(pid) for pid in run.pids):
            return False
        self.ready = None
        path = os.path.join(job.run_dir, HANDED_JOB)
        with open(path + ".part", "wb") as f:
            pickle.dump(job, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.rename(path + ".part", path)  # a rank never reads half a job
        os.write(run.handed, b"x" * job.world_size)  # one byte for each rank
        os.close(run.handed)
        run.handed = -1
        run.job = job
        self.runs[job.test_id] = run
        for pid, rank in run.pids.items():
            self.rank_of[pid] = (job.test_id, rank)
        self._start_relaying(run)
        self._send(protocol.Spawned(job.test_id, {r: p for p, r in run.pids.items()}, prepared=True))
        return True

    def _discard_ready(self, remove_folder: bool) -> None:
        run, self.ready = self.ready, None
        if run is None:
            return
        if run.handed >= 0:
            os.close(run.handed)
        procs.kill_tree(*run.pids, group=run.pgid)
        for pid in run.pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._close_notes(run)
        if remove_folder:
            shutil.rmtree(run.job.run_dir, ignore_errors=True)

    def _fork_ranks(self, run: _Run, main: RankMain, keep: int = -1) -> None:
        """Fork the ranks of ``run``, each running ``main``: in a process group of their own,
        with a loopback listener for their store and a pipe for their notes."""
        job = run.job
        listener = rendezvous.listener()
        port = listener.getsockname()[1]
        notes_r, notes_w = os.pipe()
        # descriptors a rank must not hold: ours, and those of other runs (a pipe end it kept
        # open would keep another run's ranks from seeing it close)
        private = [self.sock.fileno(), self.wake_r, self.wake_w, notes_r, *self._run_descriptors()]
        private = [fd for fd in private if fd not in (keep, -1)]
        for rank in range(job.world_size):
            pid = os.fork()
            if pid == 0:
                try:
                    inherited_heap.freeze_in_rank()
                    os.setpgid(0, run.pgid)
                    signal.set_wakeup_fd(-1)
                    for sig, handler in self.rank_handlers.items():
                        signal.signal(sig, signal.SIG_DFL if handler is None else handler)
                    procs.retire(*private)
                    main(rank, port, listener, notes_w)
                finally:
                    os._exit(70)
            with contextlib.suppress(OSError):
                os.setpgid(pid, run.pgid or pid)
            if not run.pgid:
                run.pgid = pid
            run.pids[pid] = rank
            if run is not self.ready:
                self.rank_of[pid] = (job.test_id, rank)
        listener.close()
        os.close(notes_w)
        os.set_blocking(notes_r, False)
        run.notes = notes_r

    def _run_descriptors(self) -> list[int]:
        runs = [*self.runs.values(), *([self.ready] if self.ready is not None else [])]
        return [fd for run in runs for fd in (run.notes, run.handed) if fd >= 0]

    def _start_relaying(self, run: _Run) -> None:
        self.selector.register(run.notes, selectors.EVENT_READ, run.job.test_id)

    def _relay_notes(self, test_id: str) -> None:
        run = self.runs.get(test_id)
        if run is None:
            return
        try:
            chunk = os.read(run.notes, 4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # every writer is gone
            self._close_notes(run)
            return
        notes, run.pending = protocol.parse_notes(run.pending + chunk)
        for rank, phase, status in notes:
            self._send(protocol.Noted(test_id, rank, phase, status))

    def _close_notes(self, run: _Run) -> None:
        if run.notes >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(run.notes)
            os.close(run.notes)
            run.notes = -1

    def _reap(self) -> None:
        ended: list[_Run] = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if self.ready is not None and pid in self.ready.pids:
                self.ready.lost = True  # a prepared rank ended before its test came
                continue
            owner = self.rank_of.pop(pid, None)
            if owner is not None:
                test_id, rank = owner
                run = self.runs.get(test_id)
                if run is not None and run.notes >= 0:
                    self._relay_notes(test_id)  # what it noted before it ended comes first
                self._send(protocol.Exited(test_id, RankExit.from_status(rank, pid, status)))
                if run is not None and run.finishing:
                    ended.append(run)

        # once every child that ended is reaped: what a rank killed as it left and that came
        # here to be reaped is no stray
        for run in ended:
            self._finish_if_gone(run)

    def _finish_if_gone(self, run: _Run) -> None:
        """A finished run whose ranks are all gone: kill what they abandoned, remove its
        folder, tell the pytest process."""
        if run.job.test_id not in self.runs or any(pid in self.rank_of for pid in run.pids):
            return  # finished already, or a rank is still leaving
        self.runs.pop(run.job.test_id)
        swept = self._sweep()
        self._close_notes(run)
        shutil.rmtree(run.job.run_dir, ignore_errors=True)
        self._send(protocol.Finished(run.job.test_id, swept))

    def _kill_run(self, test_id: str) -> None:
        run = self.runs.get(test_id)
        if run is not None:
            # a rank that ended on its own just before (its framework killed it) is a death
            running = {pid for pid in run.pids if procs.is_running(pid)}
            procs.kill_tree(*run.pids, group=run.pgid)
            for pid in list(run.pids):
                if pid in self.rank_of:
                    with contextlib.suppress(ChildProcessError):
                        _, status = os.waitpid(pid, 0)
                        test, rank = self.rank_of.pop(pid)
                        ended = RankExit.from_status(rank, pid, status, by_harness=pid in running)
                        self._send(protocol.Exited(test, ended))
        self._sweep()
        self._send(protocol.Killed(test_id))

    def _sweep(self) -> list[tuple[int, str]]:
        """Kill our children that are no rank of a live run: processes ranks abandoned."""
        swept: list[tuple[int, str]] = []
        for _ in range(5):
            prepared = self.ready.pids if self.ready is not None else {}
            strays = [
                p
                for p in procs.children_of(os.getpid())
                if p not in self.rank_of and p not in prepared and not procs.is_ending(p)
            ]
            if not strays:
                break
            for pid in strays:
                names = {p: procs.command_line(p) for p in [pid, *procs.descendants_of(pid)]}
                swept.extend((p, names.get(p, "?")) for p in procs.kill_tree(pid))
            for pid in strays:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            self._reap()
        return swept

    def _kill_everything(self) -> None:
        self._discard_ready(remove_folder=True)
        procs.kill_tree(os.getpid(), include_root=False)
        for pid in list(self.rank_of):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _empty(folder: str) -> None:
    for name in os.listdir(folder):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
