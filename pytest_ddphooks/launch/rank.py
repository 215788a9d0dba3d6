"""The rank side: turn a freshly forked process into rank ``r`` of a run and run the body.

Order matters: output and the stack-dump signal are set up first (so even a crash during
set-up is reported), then the environment, the recorder (whose events go to a file as they
happen), the run's store and, unless the test creates it itself, the process group.
The result is written before the exit barrier, so nothing a rank found is lost when a peer
dies while the others wait.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

from .. import blobs, coverage_relay, dump_signals, singletons, torch_defaults
from ..leaks import fork_note
from ..recorder import Recorder, events
from ..report import RankResult
from ..schedule import ScheduleHook
from ..stacks import ASK_NATIVE, ASK_STACKS, write_python_stacks
from . import mp_cleanup, procs, protocol, rendezvous
from .debugger import RankDebugger
from .job import VOLATILE_ENV, Job
from .output import RankOutput, flush_std
from .schedule_board import MappedBoard

HANDED_JOB = "job"  # the file in the run's folder a prepared rank reads its test from
_keep: list[Any] = []  # files that must stay open for the signal handlers


@dataclass
class RankContext:
    """What the body of a run knows about its rank."""

    job: Job
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    recorder: Recorder
    store: Any  # the run's own key-value store (a PrefixStore), for the harness
    notes: int = -1  # the write end of the run's note pipe
    debugger: RankDebugger | None = None  # lends this rank the pytest process's terminal
    # coverage, when the session measures it: the body runs the test's own code inside
    # ``measured.test_code()``
    measured: coverage_relay.RankMeasurement = field(default_factory=coverage_relay.RankMeasurement)

    def note(self, phase: str, status: str) -> None:
        """Tell the pytest process (through the fork server) that this rank reached ``phase``."""
        note(self.notes, self.rank, phase, status)


RankBody = Callable[[RankContext], RankResult]


def note(fd: int, rank: int, phase: str, status: str) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.write(fd, protocol.note_line(rank, phase, status))


def _redirect_output(job: Job, rank: int) -> RankOutput:
    output = RankOutput(job, rank)
    output.start()
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    # text no encoding can write (a file name's lone surrogate) is replaced, as pytest's capture
    # replaces it: printing it never fails a rank
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), "utf-8", "replace", line_buffering=True, write_through=True)
        for fd in (1, 2)
    )
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin  # type: ignore[misc]
    # the pytest process's log capture handlers were inherited; a rank logs like a process
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    return output


def _arm_stack_dumps(job: Job, rank: int, crash_fd: int) -> None:
    stacks = open(job.path(rank, "stacks"), "w")  # noqa: SIM115
    _keep.append(stacks)
    dump_signals.keep_armed(dump_signals.CRASH_SIGNALS, lambda: dump_signals.enable(crash_fd))
    dump_signals.keep_armed((signal.SIGUSR1,), lambda: dump_signals.register(signal.SIGUSR1, stacks))


def _apply_env(job: Job, rank: int, port: int) -> None:
    wanted = {
        **job.env,
        **rendezvous.rank_env(rank, job.world_size, job.nodes, port, job.test_id, job.attempt, job.max_restarts),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    # as torchrun does for several ranks on a node: they must not each start a thread per core
    # (what the project chose, in the environment or with torch.set_num_threads, stands)
    one_thread = "OMP_NUM_THREADS" not in job.env and job.world_size // max(job.nodes, 1) > 1
    if one_thread:
        wanted["OMP_NUM_THREADS"] = "1"
    _set_environ(wanted)
    if one_thread and torch_defaults.threads_as_imported():
        sys.modules["torch"].set_num_threads(1)
    with contextlib.suppress(OSError):
        os.chdir(job.cwd)


def _set_environ(wanted: dict[str, str]) -> None:
    """Make the environment ``wanted``, changing only what differs: a fresh fork already has
    most of it (clearing and setting it all again cost a rank 0.2-0.4 ms)."""
    env = os.environ
    for name in [name for name in env if name not in wanted]:
        del env[name]
    for name, value in wanted.items():
        if env.get(name) != value:
            env[name] = value


def _exchanger(store: Any, rank: int, world_size: int) -> Callable[[bytes], list[bytes]]:
    """Every rank's blob (a recorder's events), through the run's store, whatever its size."""
    counter = itertools.count(1)

    def exchange(blob: bytes) -> list[bytes]:
        k = next(counter)
        chunks = blobs.put(store, f"timeline/{k}/{rank}", blob)
        store.set(f"timeline/{k}/{rank}/n", str(chunks).encode())
        out = []
        for r in range(world_size):
            if r == rank:
                out.append(blob)
            else:
                n = int(bytes(store.get(f"timeline/{k}/{r}/n")))
                out.append(blobs.get(store, f"timeline/{k}/{r}", n))
        return out

    return exchange


def _init_group(job: Job, rank: int, store: Any, group_timeout: float) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {
        "backend": job.backend,
        "store": dist.PrefixStore("pg/", store),
        "rank": rank,
        "world_size": job.world_size,
        "timeout": timedelta(seconds=group_timeout),
    }
    if job.backend == "nccl":
        import torch

        local = rank % job.local_world_size
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(**kwargs)


@dataclass(frozen=True)
class _Left:
    kind: str
    key: str
    ref: int


def _kill_children() -> list[tuple[int, str]]:
    """Processes this rank started and left running: killed, and named for the report
    (those a library starts once per process, such as multiprocessing's resource tracker,
    only killed: they would have ended with the rank)."""
    if not procs.has_children():  # the common case, without reading /proc for every thread
        return []
    found = []
    for pid in procs.descendants_of(os.getpid()):
        if not procs.is_running(pid):
            continue  # ended (an orphan that came to this rank to be reaped): nothing left
        command = procs.command_line(pid, settle=True)
        if singletons.known(_Left("process", command, pid)) is None:
            found.append((pid, command + fork_note(pid, command, "the rank")))
    procs.kill_tree(os.getpid(), include_root=False)
    return found


def _answer_asks(path: str, stacks: str, recorder: Recorder) -> None:
    """When the watchdog sees this rank make no progress, it asks (a byte on a pipe) what
    native code issued meanwhile: a thread that waits for that adds it to the events. When
    it takes the rank's stacks, it asks for them whole too (faulthandler writes 100 frames)."""
    os.mkfifo(path, 0o600)
    # open for reading and writing: a reader is always there, so an ask made while the last one
    # is answered waits in the pipe (reopened after each, an ask in between found no reader and
    # was lost: a hang's report then had only the 100 frames faulthandler writes)
    fd = os.open(path, os.O_RDWR)

    def serve() -> None:
        while True:
            try:
                what = os.read(fd, 64)
            except OSError:
                return
            with contextlib.suppress(Exception):
                if ASK_STACKS in what:
                    write_python_stacks(stacks)
                if ASK_NATIVE in what:
                    recorder.read_native(grace=False)  # the watch is waiting for the answer
                    recorder.write_sampled(events.THREADS, _free_threads)

    threading.Thread(target=serve, name="ddphooks-native", daemon=True).start()


HARNESS_THREAD = "ddphooks-"  # how the harness's own threads in a rank are named


def _free_threads() -> dict[str, Any]:
    """The rank's threads besides its main one and the harness's: any of them could still
    enter the collective a peer waits in, so a main thread blocked there is not stuck for sure."""
    main = threading.main_thread()
    names = [
        t.name
        for t in threading.enumerate()
        # a native thread that once ran Python (gloo's, a future's callback) stays listed: no thread of the test
        if t is not main and not t.name.startswith(HARNESS_THREAD) and not isinstance(t, threading._DummyThread)
    ]
    return {"names": names}


def _follow_schedule(job: Job, rank: int, recorder: Recorder) -> ScheduleHook:
    """Hold this rank where its schedule says; the rank's start is the first such point."""
    assert job.holds is not None
    board = MappedBoard(os.path.join(job.run_dir, f"schedule{job.attempt}.board"), rank, job.world_size)
    hook = ScheduleHook(job.holds.get(rank, []), lambda info: recorder.write_watch_only(events.HELD, info), board)
    recorder.add_trigger(hook)
    hook.begin()
    return hook


@dataclass
class _SetUp:
    """A rank as far as it gets before its body: what the body and the rank's end need."""

    output: RankOutput | None = None
    recorder: Recorder | None = None
    store: Any = None  # the run's store, prefixed for the harness
    failure: RankResult | None = None  # set-up failed: what the rank reports instead
    schedule: ScheduleHook | None = None  # the run's schedule (``--ddp-explore``): told when the body ends


# a rank leaves through the os._exit of before the test: coverage's ``_exit`` patch, applied
# when a rank starts a measurement of its own (the fork server could not prepare one), would
# write a data file for lines already handed over
_leave = os._exit


INHERITED_GROUP = (
    "a default process group existed before the rank set its own up: code the test's files run as"
    " they are imported (a conftest, the test module) called init_process_group, and every rank"
    " starts as a copy of a process that imported them; initialise the group in a fixture or in"
    " the test instead"
)


def _harness_failure(rank: int, exc: BaseException) -> RankResult:
    return RankResult(
        rank,
        "failed",
        longrepr=traceback.format_exc(),
        message=f"{type(exc).__name__}: {exc}",
        harness_error=True,
        phase="setup",
    )


def _become_rank() -> None:
    torch_defaults.reseed_if_unseeded()
    mp_cleanup.forget_inherited()
    procs.prctl(procs.PR_SET_PDEATHSIG, signal.SIGKILL)
    # what the test starts and abandons stays under the rank, which names and kills it
    # before its result is written (a double-forked daemon included)
    procs.prctl(procs.PR_SET_CHILD_SUBREAPER, 1)


def _set_up(job: Job, rank: int, port: int, listener: Any) -> _SetUp:
    """Everything before the body that does not depend on the test: output, stack dumps,
    environment, recorder, the run's store and (unless the test creates it) the group."""
    state = _SetUp()
    try:
        state.output = _redirect_output(job, rank)
        _arm_stack_dumps(job, rank, state.output.crash_fd)
        _apply_env(job, rank, port)
        coverage_relay.stop_inherited()  # the harness setting the rank up is not the test's code
        recorder = state.recorder = Recorder(rank, job.world_size, event_file=job.path(rank, "events"))
        limit = job.group_limit
        if rank != 0:
            procs.retire(listener.fileno())  # rank 0's store serves it: no other copy may accept
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError(INHERITED_GROUP)
        raw_store = rendezvous.store(rank, job.world_size, port, listener.fileno() if rank == 0 else None, limit)

        state.store = dist.PrefixStore("ddphooks/", raw_store)
        recorder._exchange = _exchanger(state.store, rank, job.world_size)
        recorder.activate()
        _answer_asks(job.path(rank, "ask"), job.path(rank, "pystacks"), recorder)
        if job.holds is not None:
            # once the run's store is up: the ranks wait for rank 0's before anything of theirs
            state.schedule = _follow_schedule(job, rank, recorder)
        if job.init_process_group:
            _init_group(job, rank, raw_store, limit)
    except BaseException as exc:
        state.failure = _harness_failure(rank, exc)
    return state


def rank_main(job: Job, rank: int, port: int, listener: Any, notes: int, body: RankBody) -> NoReturn:
    started = time.monotonic()
    _become_rank()
    _run(job, rank, notes, body, _set_up(job, rank, port, listener), started)


def prepared_rank_main(
    ahead: Job, rank: int, port: int, listener: Any, notes: int, handed: int, body_of: Callable[[Job], RankBody]
) -> NoReturn:
    """A rank set up before its test is known (``ahead`` describes the test to come), which
    then waits, running nothing, until the fork server hands it the test's job."""
    _become_rank()
    state = _set_up(ahead, rank, port, listener)
    job = _await_job(handed, ahead)
    started = time.monotonic()
    _take_over(job, rank, port)
    _run(job, rank, notes, body_of(job), state, started)


def _await_job(handed: int, ahead: Job) -> Job:
    """Block until the fork server hands over the test (a byte on the pipe, the job in the
    run's folder); end quietly when it discards these ranks instead (the pipe closes)."""
    while True:
        try:
            got = os.read(handed, 1)
        except InterruptedError:
            continue
        if not got:
            _leave(0)
        os.close(handed)
        with open(os.path.join(ahead.run_dir, HANDED_JOB), "rb") as f:
            job: Job = pickle.load(f)
        return job


def _take_over(job: Job, rank: int, port: int) -> None:
    """What differs between the test the rank was set up for and the one it runs: its
    folder, the variables that change from test to test."""
    os.environ.update(
        rendezvous.rank_env(rank, job.world_size, job.nodes, port, job.test_id, job.attempt, job.max_restarts)
    )
    for name in VOLATILE_ENV:
        if name in job.env:
            os.environ[name] = job.env[name]
        else:
            os.environ.pop(name, None)
    with contextlib.suppress(OSError):
        os.chdir(job.cwd)


def _run(job: Job, rank: int, notes: int, body: RankBody, state: _SetUp, started: float) -> NoReturn:
    """The body, then the rank's end: the result is written before the exit barrier, so
    nothing a rank found is lost when a peer dies while the others wait."""
    result: RankResult
    rank_cov: Any = None  # the rank's coverage measurement, when the session measures
    if state.failure is not None:
        result = state.failure
    else:
        assert state.recorder is not None
        recorder = state.recorder
        try:
            local = job.local_world_size
            debugger = RankDebugger(
                job.path(rank, "debug"), lambda path: note(notes, rank, "debug", path), f"rank {rank}"
            )
            ctx = RankContext(
                job, rank, job.world_size, rank % local, local, rank // local, recorder, state.store, notes, debugger
            )
            rank_cov = ctx.measured.cov
            try:
                result = body(ctx)
            finally:
                if state.schedule is not None:
                    state.schedule.end()
            result.measured = coverage_relay.measured_by(rank_cov)
            recorder.read_native(grace=False)  # the watch takes a rank lingering here for one that waits
            recorder.write_final_counters()
        except BaseException as exc:
            result = _harness_failure(rank, exc)
    result.duration = time.monotonic() - started
    with contextlib.suppress(Exception):  # never lose the result over the leak check
        result.leaks.extend(_kill_children())
    flush_std()
    result.write(job.path(rank, "result"))
    note(notes, rank, "done", result.outcome)
    # from here on the rank only takes its leave: nothing it prints is the test's output
    if state.output is not None:
        state.output.leave()
    else:
        procs.retire(1, 2)
    if result.measured is None:  # saved off the test's path: the session combines once every run ended
        coverage_relay.save(rank_cov)
    mp_cleanup.run_own()
    if state.store is not None:
        with contextlib.suppress(Exception):
            _exit_barrier(state.store, rank, job.world_size, result.outcome == "failed", job.group_limit)
    _leave(0)


def _exit_barrier(store: Any, rank: int, world_size: int, failed: bool, timeout: float) -> None:
    """A rank that passed stays until every rank is done: it keeps its connections open, so
    a peer still waiting in a collective with it hangs visibly (and is diagnosed) instead
    of erroring out on a closed socket. A failed rank leaves at once, which stops its peers
    (rank 0 included: the store goes with it). Otherwise rank 0, which serves the store,
    leaves after everyone else."""
    store.set(f"exit/{rank}", b"1")
    if failed:
        store.set(f"left/{rank}", b"1")
        return
    wait = timedelta(seconds=timeout)
    store.wait([f"exit/{r}" for r in range(world_size)], wait)
    if rank == 0:
        store.wait([f"left/{r}" for r in range(1, world_size)], wait)
    else:
        store.set(f"left/{rank}", b"1")
