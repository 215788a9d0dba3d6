"""The pytest hooks of SPMD mode (the session runs under torchrun, on every launched rank).

Which tests run where: a multirank test whose world size is the launched one runs on every
rank, in the pytest process itself; other sizes are deselected, with the reason printed.
Plain tests run on rank 0 only (``--ddp-plain-tests=all`` runs them everywhere), after the
multirank tests, so the ranks never wait for one another's plain tests.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import marshal
import os
import pickle
import re
import signal
import socket
import tempfile
import threading
import time
import traceback
import unittest
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any, Literal, NoReturn

import pytest
from _pytest._code import ExceptionInfo
from _pytest.junitxml import xml_key
from _pytest.outcomes import Exit, OutcomeException, Skipped, XFailed

from .. import blobs
from ..failure import classify, first_failure
from ..leaks import destroy_groups
from ..recorder import Recorder, collectives
from ..recorder.timeline import Timeline
from ..report import RunReport
from ..schedule import EXPLORE_UNDER_TORCHRUN
from ..spmd import (
    Coordinator,
    HangPost,
    RankHung,
    RanksMissing,
    desyncs,
    first_difference,
    init_group,
    say,
    who_never_entered,
)
from ..stacks import format_stack, parse_stacks, user_frame
from . import page
from .markers import RUN_KEY, gpus
from .rankbody import added_markers, junit_mark, junit_recorded, outcome_of
from .reports import fail_with, keep_artifacts, raise_verdict, relay_markers, relay_properties, write_trace
from .session import DdpSession
from .terminal import terminal_markup

# what a test that creates its own group under torchrun is given instead of torchrun's
_OWN_GROUP_ENV = ("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
HANG_GRACE = 5.0  # past the limit, a rank's own watchdog ends the run
SESSION_DONE = "session-done"  # set by rank 0 once its reports are written
LEFT = "left"  # set by a rank other than 0 as its session ends
LEFT_GRACE = 10.0  # what a rank that hung waits for the others to end theirs
REPORT_GRACE = 15.0  # what rank 0 may take then to report the test and finish the session's reports


class SpmdHooks:
    NAME = "ddphooks-spmd"

    def __init__(self, ddp: DdpSession) -> None:
        config = ddp.config
        self.config = config
        self.ddp = ddp
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if "NODE_RANK" not in os.environ and "GROUP_RANK" in os.environ:
            # what multirank(nodes=...) promises a rank; torchrun names it GROUP_RANK only
            os.environ["NODE_RANK"] = os.environ["GROUP_RANK"]
        self.nodes = max(self.world_size // max(self.local_world_size, 1), 1)
        self.start_timeout = ddp.settings.timeout
        self.coord = Coordinator.from_env(timeout=max(self.start_timeout, 60.0))
        self.plain_everywhere = ddp.settings.plain_tests_everywhere
        self.deselected: list[str] = []
        self.generation = 0
        self._exchanges = 0
        self._tests = 0  # multirank tests begun: the store keys of each test's events
        self._events_key = ""
        self.group_ok = False
        self.current: str | None = None
        self.ack: str | None = None  # set once rank 0 reported a hung rank's test
        self._running: pytest.Item | None = None  # the test whose protocol runs
        self._collect_errors: list[str] = []  # the files this rank could not collect
        self.hung: str | None = None  # the test whose hang ends the run
        # what the end of the test loop would do for coverage, done as a hang ends the run
        # instead (set by the coverage hooks, which import this module): hand this rank's
        # measurement over (not rank 0); merge the handed-over ones of these ranks and report
        self.hand_over_at_hang: Callable[[pytest.Session, SpmdHooks], None] | None = None
        self.report_at_hang: Callable[[pytest.Session, SpmdHooks, list[int]], None] | None = None
        self._plain_failures: list[str] = []  # this rank's, in the plain test running now
        self._watchdog_owns = threading.Event()  # set as a watchdog takes the hung test over
        self.stopping: str | None = None  # why torchrun is stopping the run (it sent SIGTERM)
        self._in_test = False  # inside a multirank test's body or its exchange of results
        self._session: pytest.Session | None = None
        self._call_began = (0.0, 0.0)  # (time.time(), time.monotonic()) as the running test's body began
        # torchrun stops the other workers with SIGTERM when one fails: say where this one was
        # (faulthandler), then end the test and the session's reports in the time torchrun
        # gives before it kills (this handler)
        with contextlib.suppress(ValueError):  # not the main thread: torchrun's rule as it is
            signal.signal(signal.SIGTERM, self._on_term)
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    def _on_term(self, signum: int, frame: Any) -> None:
        self.stopping = (
            "torchrun stopped the run while this rank ran: a rank ended (it died, or finished with an error),"
            " or torchrun itself was stopped"
        )
        if self._session is not None:
            self._session.shouldstop = f"ddphooks: {self.stopping}"
        if self._in_test:
            raise RunStopping(self.stopping)

    # -- what runs where -----------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> Generator[None, None, None]:
        result = yield
        self.select(items)  # once every multirank marker was read
        return result

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            lines = str(report.longrepr).strip().splitlines() or [""]
            last = re.sub(r"^E\s+", "", lines[-1].strip())  # the error, without pytest's "E" margin
            self._collect_errors.append(f"{report.nodeid or report.fspath}: {last}")

    def select(self, items: list[pytest.Item]) -> None:
        mine = json.dumps({"ids": [item.nodeid for item in items], "errors": self._collect_errors}).encode()
        posts = [
            json.loads(b) for b in self.coord.all_gather("collected", mine, self.start_timeout, "finish collection")
        ]
        # a rank that could not collect a file: its errors, not the lists they made differ
        errors = [f"rank {r} could not collect {e}" for r, post in enumerate(posts) for e in post["errors"]]
        diff = first_difference([post["ids"] for post in posts])
        going_on = bool(self.config.getoption("continueonerrors", False)) and diff is None
        if errors and not going_on:  # every rank ends alike, none waits for another that left
            message = "under torchrun a test file failed to collect on some rank:\n  " + "\n  ".join(errors)
            pytest.exit(message, returncode=pytest.ExitCode.INTERRUPTED)
        if diff is not None:
            message = f"under torchrun every rank must collect the same tests in the same order; {diff}"
            if self.rank != 0:  # rank 0 says it; the others end alike, on their quiet terminals
                pytest.exit(message, returncode=pytest.ExitCode.USAGE_ERROR)
            raise pytest.UsageError(message)
        multirank, plain, dropped = [], [], []
        for item in items:
            run = item.stash.get(RUN_KEY, None)
            if run is None:
                if self.rank == 0 or self.plain_everywhere:
                    plain.append(item)
                else:
                    dropped.append(item)
                continue
            reason = None
            if item.get_closest_marker("special") is not None:
                reason = "special multirank tests cannot get an interpreter of their own under torchrun"
            elif run.world_size != self.world_size:
                reason = f"world_size={run.world_size}, but torchrun launched {self.world_size} ranks"
            elif run.spec.nodes != self.nodes and (run.spec.nodes != 1 or _names_nodes(item)):
                # the default (no nodes given) runs on whatever nodes torchrun launched
                reason = f"nodes={run.spec.nodes}, but torchrun launched {self.nodes} nodes"
            if reason:
                dropped.append(item)
                self.deselected.append(f"{item.nodeid}: {reason}")
            else:
                multirank.append(item)
        if dropped:
            self.config.hook.pytest_deselected(items=dropped)
        items[:] = multirank + plain if not self.plain_everywhere else [i for i in items if i not in dropped]
        if multirank:
            # the session's group exists before the first test: no test is blamed for it
            self._ensure_group(self.start_timeout)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        run = item.stash.get(RUN_KEY, None)
        if run is None or run.spec.backend != "nccl":
            return
        import torch

        # every rank decides alike (the same test, the same machine kind): none waits for another
        visible = torch.cuda.device_count()
        if visible < self.local_world_size:
            reason = f"multirank(backend='nccl') needs {gpus(self.local_world_size)} per node, {visible} visible"
        else:
            reason = "multirank(backend='nccl') under torchrun: the session's group is gloo; run it without torchrun"
        raise Skipped(reason, _use_item_location=True)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._session = session
        if self.rank == 0:
            return
        # rank 0 reports the merged result of every test; junit XML comes from rank 0 alone. The
        # object stays until unconfigure, unregistered (it writes no file):
        # record_testsuite_property and record_xml_attribute record into it, and each result
        # takes what they recorded to rank 0
        xml = self.config.stash.get(xml_key, None)
        if xml is not None:
            self.config.pluginmanager.unregister(xml)
        if not self.ddp.settings.verbose_ranks:
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter._tw._file = open(os.devnull, "w")  # noqa: SIM115

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.deselected and self.rank == 0:
            terminalreporter.section("ddphooks under torchrun", sep="-")
            terminalreporter.line(f"deselected {len(self.deselected)} multirank tests:")
            for line in self.deselected:
                terminalreporter.line(f"  {line}")

    # pytest takes only names that start with pytest_ for hooks: a second implementation of one
    # hook in this class needs such a name of its own
    @pytest.hookimpl(tryfirst=True, specname="pytest_unconfigure")
    def pytest_unconfigure_junit_first(self, config: pytest.Config) -> None:
        """junitxml's unconfigure would unregister its object on a rank other than 0 again (it
        left at the session's start): gone before it, however the session ended."""
        if self.rank != 0 and xml_key in config.stash:
            del config.stash[xml_key]

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Rank 0 reports for every rank, after the others finished their part: they wait
        for it here, or torchrun would stop it as soon as one of them ended with an error."""
        with contextlib.suppress(Exception):
            if self.rank == 0:
                self.coord.store.set(SESSION_DONE, b"1")
            else:
                # in short waits: a SIGTERM from torchrun (rank 0 is being stopped too, or
                # ended) is taken between them
                # asked in steps (a store wait that times out logs a warning each time); a
                # store that is gone (rank 0 with it) ends the wait by raising
                while self.stopping is None and not self.coord.store.check([SESSION_DONE]):
                    time.sleep(0.05)
                self.coord.store.set(f"{LEFT}/{self.rank}", b"1")  # a rank 0 that hung waits for this
        # every report is written: a SIGTERM torchrun sends now (another rank ended with an
        # error) finds the interpreter shutting down, where a handler of ours could crash it;
        # it ends the process as it would without us (a rank stuck in its shutdown included)
        _default_term()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and self.deselected:
            session.exitstatus = pytest.ExitCode.OK
            if self.rank == 0:
                say(f"ddphooks: no test matched the {self.world_size} launched ranks; nothing to run")

    # -- plain tests on every rank (--ddp-plain-tests=all) --------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report = yield
        if not self.plain_everywhere or RUN_KEY in item.stash:
            return report
        if report.failed:
            self._plain_failures.append(f"{report.when}: {_first_line(report)}")
        if report.when != "teardown":
            return report
        # once per test, on every rank: rank 0, which reports, learns how the others did
        mine, self._plain_failures = "\n".join(self._plain_failures), []
        try:
            everyone = self.coord.all_gather("plain", mine.encode(), self.start_timeout, "finish a plain test")
        except RanksMissing as exc:
            item.session.shouldfail = f"ddphooks: {exc}"
            everyone = []
        others = [(r, b.decode()) for r, b in enumerate(everyone) if r != self.rank and b]
        # every rank takes the same verdict, so -x / --maxfail stop every rank's session alike
        if others and report.passed:
            report.outcome = "failed"
            report.longrepr = "\n".join(
                f"the plain test failed on rank {r} (--ddp-plain-tests=all runs it on every rank): {text}"
                for r, text in others
            )
        return report

    # -- running a multirank test on the launched ranks ----------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        self._running = item
        try:
            return (yield)
        finally:
            self._running = None

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        """Each run of a test begins (pytest-rerunfailures runs a failed one again, logged anew):
        a failed run's group is rebuilt before the test is set up, where the leak guard takes
        its snapshot, so its sockets are nobody's leak (should it fail here, the test's own call
        tries again and says why)."""
        item = self._running
        run = item.stash.get(RUN_KEY, None) if item is not None and item.nodeid == nodeid else None
        if run is not None and not self._group_alive():
            with contextlib.suppress(Exception):
                self._ensure_group(self.ddp.limit_of(run))

    def _stopped_words(self, mine: Any) -> str:
        """What is known of each rank when torchrun stopped the run during a test."""
        posted: dict[int, bytes] = {}
        with contextlib.suppress(Exception):
            posted = self.coord.arrived("result")
        lines = [f"{self.stopping}; the run stops here"]
        stopped = mine.outcome == "failed" and mine.message.startswith("RunStopping")
        for r in range(self.world_size):
            if r == self.rank:
                lines.append(f"  rank {r}: " + ("stopped by torchrun in the test" if stopped else _outcome_words(mine)))
            elif r in posted:
                with contextlib.suppress(Exception):
                    lines.append(f"  rank {r}: {_outcome_words(pickle.loads(posted[r]))}")
            else:
                lines.append(f"  rank {r}: ended without reporting (its exit code is in torchrun's summary)")
        if mine.outcome == "failed" and mine.longrepr and not stopped:
            lines += ["", f"-------------------- rank {self.rank} --------------------", mine.longrepr]
        return "\n".join(lines)

    def _group_alive(self) -> bool:
        """The session's group is in place (the leak guard destroys every group a test left,
        the session's with them)."""
        import torch.distributed as dist

        return self.group_ok and dist.is_initialized()

    def _ensure_group(self, limit: float) -> None:
        import torch.distributed as dist

        if self.group_ok and dist.is_initialized():
            return
        if dist.is_initialized():
            destroy_groups()
        self.generation += 1
        init_group(self.coord.store, self.rank, self.world_size, self.generation, max(limit, 1.0) + 30.0)
        self.group_ok = True

    def _own_group_environment(self, item: pytest.Item) -> dict[str, str | None]:
        """For ``init_process_group=False``: no group while the body runs, and a store of its
        own for the one it creates (torchrun's keeps the keys of every group made on it, which
        a second group made the same way would read); what the environment was, to restore."""
        destroy_groups()
        self.group_ok = False
        port = b"0"
        if self.rank == 0:
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = str(probe.getsockname()[1]).encode()
        try:
            ports = self.coord.all_gather("own-group-port", port, self.start_timeout, "start the test")
        except RanksMissing as exc:
            self._missing(item, exc)
        saved = {name: os.environ.get(name) for name in _OWN_GROUP_ENV}
        os.environ["MASTER_PORT"] = ports[0].decode()
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 serves that store itself
        return saved

    def _end_own_group(self, saved: dict[str, str | None]) -> None:
        """The groups the body left go (trainers keep theirs on purpose); torchrun's
        environment comes back."""
        destroy_groups()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def exchange(self, blob: bytes, name: str = "timeline", what: str = "join recorder.timeline()") -> list[bytes]:
        """Every rank's ``blob`` (of any size), in rank order; RanksMissing after the limit."""
        self._exchanges += 1
        prefix = f"{name}-data/{self._exchanges}"
        chunks = blobs.put(self.coord.store, f"{prefix}/{self.rank}", blob)
        counts = self.coord.all_gather(name, str(chunks).encode(), self.start_timeout, what)
        return [
            blob if r == self.rank else blobs.get(self.coord.store, f"{prefix}/{r}", int(n))
            for r, n in enumerate(counts)
        ]

    def _post_events(self, recorder: Recorder) -> None:
        """This rank's events of the test, in the store for every rank to read."""
        chunks = blobs.put(self.coord.store, f"{self._events_key}/{self.rank}", marshal.dumps(recorder.records()))
        self.coord.store.set(f"{self._events_key}/{self.rank}/n", str(chunks).encode())

    def _events_of(self, rank: int) -> bytes | None:
        """A rank's posted events of the test, None when it posted none (yet)."""
        key = f"{self._events_key}/{rank}"
        if not self.coord.store.check([f"{key}/n"]):
            return None
        return blobs.get(self.coord.store, key, int(bytes(self.coord.store.get(f"{key}/n"))))

    def _hang_timeline(self, item: pytest.Item, limit: float) -> list[str]:
        """The swimlanes of the ranks that posted their events (the hung ones and those that
        had finished), and the trace under --ddp-trace-dir."""
        raw: dict[int, Any] = {}
        for r in range(self.world_size):
            with contextlib.suppress(Exception):
                posted = self._events_of(r)
                if posted is not None:
                    raw[r] = marshal.loads(posted)
        if not raw:
            return []
        timeline = Timeline.from_raw(raw)
        lines = ["", "recorded timeline:", timeline.swimlanes(max_rows=60)]
        report = RunReport(self.world_size, limit, timeline=timeline)
        report.stopped_at_ns = time.time_ns()
        path = write_trace(item, report, self.ddp.settings)
        if path is not None:
            lines.append(f"trace: {path}")
        return lines

    def agree(self, item: pytest.Item, when: str, error: BaseException | None) -> None:
        """Every rank ends a multirank test's setup or teardown alike: a fixture that failed
        (or a leak found) on one rank fails it on all, said by rank; a skip (or an xfail) in
        one rank's setup skips it on all; a rank interrupted stops the others' sessions.
        Returns where every rank's went well; raises otherwise."""
        __tracebackhide__ = True
        kind = _phase_outcome(error)
        mine = b""
        if error is not None:
            told = _error_text(error)
            if kind == "failed" and (not isinstance(error, OutcomeException) or error.pytrace):
                told += _TRACEBACK + _traceback_of(item, error)  # rank 0's report shows it whole
            mine = f"{item.nodeid}\n{kind}\n{told}".encode()
        if kind == "stopped":  # said to the others, not waited for: this rank's session ends
            with contextlib.suppress(Exception):
                self.coord.post(f"phase-{when}", mine)
            assert error is not None  # "stopped" is an error's outcome
            raise error
        if str(item.session.shouldfail).startswith("ddphooks:"):
            everyone = None  # the run stops: a rank that left is not waited for again
        else:
            everyone = self._gather_phase(item, when, mine, error)
        others = [] if everyone is None else _phase_posts(everyone, self.rank)
        wrong = [r for r, nodeid, _, _ in others if nodeid != item.nodeid]
        if wrong:
            self._missing(item, RanksMissing(f"end the {when} of {item.nodeid!r} (it is elsewhere)", wrong, 0))
        stopped = [(r, text) for r, _, how, text in others if how == "stopped"]
        if stopped:
            item.session.shouldstop = f"ddphooks: rank {stopped[0][0]} was interrupted: {stopped[0][1]}"
        failed = [(r, text) for r, _, how, text in others if how in ("failed", "stopped")]
        where = "fixture setup" if when == "setup" else "teardown"
        if error is not None and (kind == "failed" or not failed):
            if not failed:
                raise error
            if not isinstance(error, OutcomeException):  # its traceback, the others' words below
                error.add_note("\n".join(f"rank {r}: failed in {where}: {text}" for r, text in failed))
                raise error
            failed.insert(0, (self.rank, _error_text(error)))
        if failed:
            lines = [f"rank {r}: failed in {where}: {text.split(_TRACEBACK)[0]}" for r, text in failed]
            ranks = ",".join(str(r) for r, _ in failed)
            head = f"the test's {when} failed on rank{'s' if len(failed) > 1 else ''} {ranks}"
            shown = [
                f"\n{'-' * 20} rank {r} {'-' * 20}\n{text.split(_TRACEBACK, 1)[1]}"
                for r, text in failed
                if _TRACEBACK in text
            ]
            raise fail_with("\n".join([head, *lines, *shown]), lines[0])
        if error is not None:
            raise error
        if when == "setup" and others:  # skipped (or xfailed) on some ranks: the body runs on none
            r, _, how, reason = others[0]
            if how == "xfailed":
                raise XFailed(f"{reason} (on rank {r})")
            raise Skipped(f"{reason} (on rank {r})", _use_item_location=True)

    def _gather_phase(
        self, item: pytest.Item, when: str, mine: bytes, error: BaseException | None
    ) -> list[bytes] | None:
        """Every rank's post for this phase; None where torchrun stops the run meanwhile (this
        rank's own error, if any, is raised)."""
        try:
            if self.stopping is not None:
                raise RunStopping(self.stopping)
            self._in_test = True  # waiting for the others: a stop from torchrun ends the wait
            try:
                what = f"end the {when} of the test"
                # a rank still in its fixtures has the test's limit, then its watchdog says where it is
                limit = self.ddp.limit_of(item.stash[RUN_KEY]) + 30.0
                return self.coord.all_gather(f"phase-{when}", mine, limit, what, watch=f"hang/{item.nodeid}")
            finally:
                self._in_test = False
        except RunStopping:  # the run ends: what this rank knows is what it says
            if error is not None:
                raise error from None
            return None
        except RanksMissing as exc:
            if error is not None:
                raise error from None
            self._missing(item, exc)
        except RankHung as exc:
            self._peer_hung(item, exc)

    def _peer_hung(self, item: pytest.Item, exc: RankHung) -> NoReturn:
        """Another rank's watchdog said where it is stuck: the test fails with its words (rank 0
        reports them), and the run stops."""
        item.session.shouldfail = f"ddphooks: rank {exc.rank} hung in {item.nodeid}"
        self.hung = item.nodeid
        if self.rank != 0:
            # rank 0 reports it: leaving first would have torchrun stop rank 0 before it could
            self._hand_over_coverage(item.session)
            with contextlib.suppress(Exception):
                self.coord.store.wait([f"hang-ack/{item.nodeid}"], timedelta(seconds=REPORT_GRACE + 10))
        self.ack = f"hang-ack/{item.nodeid}"
        raise fail_with(exc.text + "\nthe run stops here", f"rank {exc.rank} hung") from None

    def _missing(self, item: pytest.Item, exc: RanksMissing) -> NoReturn:
        message = f"{exc}; the run stops here"
        item.session.shouldfail = f"ddphooks: {exc}"
        self.group_ok = False
        raise fail_with(message)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> Generator[None, Any, Any]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        run = pyfuncitem.stash.get(RUN_KEY, None)
        if run is None:
            return (yield)
        if run.spec.explore or run.spec.schedule is not None:
            # every rank has the same marker: each fails the test alike, no collective needed
            raise fail_with(f"multirank(explore=..., schedule=...): {EXPLORE_UNDER_TORCHRUN}")
        item = pyfuncitem
        limit = self.ddp.limit_of(run)
        try:
            arrived = self.coord.all_gather("start", item.nodeid.encode(), self.start_timeout, "start the test")
        except RanksMissing as exc:
            self._missing(item, exc)
        elsewhere = {r: b.decode() for r, b in enumerate(arrived) if b.decode() != item.nodeid}
        if elsewhere:
            r, other = next(iter(elsewhere.items()))
            self._missing(item, RanksMissing(f"start {item.nodeid!r} (it is at {other!r})", [r], 0))
        own_group_env = None if run.spec.init_process_group else self._own_group_environment(item)
        if own_group_env is None:
            self._ensure_group(limit)
        recorder = item.funcargs.get("recorder")
        own = None
        if not isinstance(recorder, Recorder):
            own = recorder = Recorder(self.rank, self.world_size).activate()
        self.current = item.nodeid
        self._tests += 1
        self._events_key = f"events-data/{self._tests}"
        self._in_test = True
        watchdog = threading.Timer(limit + HANG_GRACE, self._on_hang, (item, recorder, limit))
        watchdog.daemon = True
        watchdog.name = "ddphooks-spmd-watchdog"
        watchdog.start()
        started = time.monotonic()
        self._call_began = (time.time(), started)  # what a hung test's report says it lasted
        had = junit_mark(item)
        marked = len(item.own_markers)
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
        finally:
            self._in_test = False  # the harness's own work from here: never cut short
            watchdog.cancel()
            self.current = None
            if own_group_env is not None:
                self._end_own_group(own_group_env)
        if isinstance(error, KeyboardInterrupt):
            raise error  # Ctrl-C (torchrun passes it to every rank): the session stops, as pytest's does
        if self._watchdog_owns.is_set():
            # the body returned past its limit, once the watchdog had taken the test over: it
            # reports and ends this process; nothing more is said from here
            threading.Event().wait()
        markup = terminal_markup(self.config)
        result = outcome_of(item, self.rank, error, "call", time.monotonic() - started, markup)
        result.sections.extend(_captured_output(item))  # every rank's is shown on rank 0, labelled
        result.mismatches_checked = recorder.mismatches_checked
        junit_recorded(item, had, result)  # rank 0 writes the junit report: every rank's properties
        result.markers = added_markers(item, marked)  # an xfail one rank added is every rank's
        if error is not None:
            # a failed body's frames hold what it made (a group of its own, with its sockets):
            # the result has what it needed of them
            traceback.clear_frames(error.__traceback__)
            error = None
        if result.outcome == "failed":
            # a peer may wait in a collective this rank will never enter: the group goes now,
            # so its call fails at once (a consequence of this failure) instead of hanging to
            # the limit; the next multirank test gets a fresh one
            destroy_groups()
            self.group_ok = False
        try:
            blob = pickle.dumps(result)
            # the events first: a rank that reports a hang meanwhile draws this one's too
            self._post_events(recorder)
            self._in_test = True  # waiting for the others: a stop from torchrun ends the wait
            try:
                if self.stopping is not None:
                    raise RunStopping(self.stopping)
                results = self.coord.all_gather(
                    "result", blob, limit + 30.0, "report its result", watch=f"hang/{item.nodeid}"
                )
                raw = [self._events_of(r) or b"" for r in range(self.world_size)]
            finally:
                self._in_test = False
        except RunStopping:
            words = self._stopped_words(result)
            if self.rank != 0:
                # rank 0 reports the test, unless it is the rank that ended: say where this was
                say(f"ddphooks: rank {self.rank} was in {item.nodeid} when {words}")
            raise fail_with(words, "torchrun stopped the run") from None
        except RanksMissing as exc:
            self._missing(item, exc)
        except RankHung as exc:
            self._peer_hung(item, exc)
        finally:
            if own is not None:
                own.close()
        report = RunReport(
            self.world_size,
            limit,
            results={r: pickle.loads(b) for r, b in enumerate(results)},
            timeline=Timeline.from_raw({r: marshal.loads(b) if b else [] for r, b in enumerate(raw)}),
        )
        report.first_failure = first_failure(report.results)
        for logs in (True, False):  # as without torchrun: every rank's log, then every rank's output
            for r, rank_result in sorted(report.results.items()):
                for when, key, text in rank_result.sections:
                    if (key == "log") == logs:
                        item.add_report_section(when, f"{key} rank {r}", text)
        verdict = classify(report)
        if self.rank == 0:  # the one that reports: the page, the traces and the junit file are its
            keep_artifacts(item, report, verdict, self.ddp.settings)
            relay_properties(item, report)
        relay_markers(item, report)  # every rank judges the test by the same markers
        if verdict.outcome == "failed":
            self.group_ok = False  # a failed test may leave the group broken: a fresh one next
        requests = [res.exit_request for _, res in sorted(report.results.items()) if res.exit_request is not None]
        if requests:  # pytest.exit() in a rank: every rank's session ends with its code, as without torchrun
            message, returncode = requests[0]
            pytest.exit(message, returncode)
        raise_verdict(verdict)
        return True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.ack is not None:  # the report of the phase that told the hang
            # the hung rank waits for this before it ends the run
            with contextlib.suppress(Exception):
                self.coord.store.set(self.ack, b"1")
            self.ack = None

    def _on_hang(self, item: pytest.Item, recorder: Recorder | None, limit: float, when: str = "call") -> None:
        """The body (or the test's fixtures, ``when`` its setup or teardown) outlived its limit:
        tell what this rank is doing, then end the run (on rank 0, with the test reported
        failed and the session's reports written)."""
        self._watchdog_owns.set()
        self.hung = item.nodeid
        if recorder is None:
            found = (getattr(item, "funcargs", None) or {}).get("recorder")
            recorder = found if isinstance(found, Recorder) else None
        post = self._hang_post(item, recorder, limit, when)
        key = f"hang/{item.nodeid}"
        if self.rank != 0:  # before the post that tells rank 0 of the hang: it is there once rank 0 looks
            self._hand_over_coverage(item.session)
        if recorder is not None and when == "call":  # a phase's events would be filed as the last test's
            with contextlib.suppress(Exception):
                self._post_events(recorder)
        with contextlib.suppress(Exception):
            self.coord.store.set(f"{key}/{self.rank}", post.dumps())
        if self.rank != 0:
            # rank 0 reports it as the test's failure, and finishes the session's reports
            # (coverage's too, the longest); leaving earlier would have torchrun stop rank 0
            # before it could
            with contextlib.suppress(Exception):
                self.coord.store.wait([SESSION_DONE], timedelta(seconds=REPORT_GRACE + 10))
            if self.ddp.settings.verbose_ranks:
                say(post.text)
            os._exit(int(pytest.ExitCode.TESTS_FAILED))  # the run reported a failed test
        posts = {0: post}
        stuck: set[int] = set()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and len(posts) < self.world_size:
            finished: dict[int, bytes] = {}
            with contextlib.suppress(Exception):
                # their body (or this phase) ended: they wait for the others
                finished = self.coord.arrived("result" if when == "call" else f"phase-{when}")
            for r in range(1, self.world_size):
                with contextlib.suppress(Exception):
                    if r not in posts and self.coord.store.check([f"{key}/{r}"]):
                        posts[r] = HangPost.loads(bytes(self.coord.store.get(f"{key}/{r}")))
                        stuck.add(r)  # its own watchdog's: it ends without ending its session
                    elif r not in posts and r in finished and when != "call":
                        posts[r] = HangPost(f"rank {r}\n" + _phase_ended_words(finished[r], when))
                    elif r not in posts and r in finished:
                        result = pickle.loads(finished[r])
                        told = [(key, text) for _, key, text in result.sections if key in ("stdout", "stderr")]
                        posts[r] = HangPost(f"rank {r}\n" + _finished_words(result), output=told)
            if len(posts) < self.world_size:
                time.sleep(0.1)
        # a desync first, as the harness's own runs say it: the hang is its consequence
        lines = [f"desync: {m}" for m in desyncs(posts)]
        lines.append(f"{_what_hung(item, when)} did not finish within {limit:g} s; the run stops")
        lines += ["  " + line for line in who_never_entered(posts, self.world_size)]
        for r in sorted(posts):  # each rank's own words, less the line that said which test
            lines += [f"rank {r}:", *posts[r].text.splitlines()[1:]]
        if when == "call":  # the ranks posted this test's events
            with contextlib.suppress(Exception):
                lines += self._hang_timeline(item, limit)
        text = "\n".join(lines)
        printed = {r: post.output for r, post in posts.items()}
        if not self._report_last(item, text, limit, [r for r in posts if r != 0], printed, when):
            say(text)
        with contextlib.suppress(Exception):
            self.coord.store.set(f"hang-ack/{item.nodeid}", b"1")
            self.coord.store.set(SESSION_DONE, b"1")  # the reports are written: the others may end
        # the ranks that were not stuck end their sessions now: leaving before they did would have
        # torchrun stop them midway (and their stacks printed)
        self._await_left([r for r in posts if r != 0 and r not in stuck], LEFT_GRACE)
        os._exit(int(pytest.ExitCode.TESTS_FAILED))

    def _await_left(self, ranks: list[int], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with contextlib.suppress(Exception):
            while ranks and time.monotonic() < deadline:
                ranks = [r for r in ranks if not self.coord.store.check([f"{LEFT}/{r}"])]
                time.sleep(0.05)

    def _hand_over_coverage(self, session: pytest.Session) -> None:
        """This rank's coverage to rank 0 as a hang ends the run (with --cov)."""
        if self.hand_over_at_hang is not None:
            with contextlib.suppress(Exception):
                self.hand_over_at_hang(session, self)

    def _hang_post(self, item: pytest.Item, recorder: Recorder | None, limit: float, when: str = "call") -> HangPost:
        """Where this rank is stuck: its open calls and collectives, and its main thread's stack."""
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            stacks = parse_stacks(f.read())
        timeline = Timeline.from_raw({self.rank: recorder.records() if recorder is not None else []})
        # what the stuck test printed on this rank until now
        post = HangPost("", output=[(key, text) for _, key, text in _captured_streams(item)])
        for event in timeline.events:
            info = event.info
            if event.phase == "start" and event.kind == "collective" and info.get("seq") and _paired_by_group(info):
                group = str(info.get("group"))
                post.entered[group] = max(post.entered.get(group, 0), int(info["seq"]))
        lines = [
            f"ddphooks: {_what_hung(item, when)} did not finish within {limit:g} s on rank {self.rank}; the run stops"
        ]
        for span in timeline.open_spans(self.rank):
            info = span.start.info
            if span.kind in ("collective", "p2p", "wait") and info.get("seq"):
                what = f"the wait of {info.get('op')}" if span.kind == "wait" else info.get("op")
                lines.append(f"  blocked in {what} #{info.get('seq')} on group {info.get('group')}")
                if span.kind == "collective" and _paired_by_group(info):
                    group, seq, op = str(info.get("group")), int(info["seq"]), str(info.get("op"))
                    post.blocked.append((group, seq, op, info.get("ranks")))
                    same = repr(collectives.comparable(op, info, loose=bool(info.get("native"))))
                    post.calls.append((group, seq, same, collectives.signature(op, info)))
            else:
                lines.append(f"  in {span.start.info.get('qualname') or span.name}")
        main = threading.main_thread().ident
        for thread in stacks.threads:
            if thread.ident == main:
                frame = user_frame(thread)
                if frame is not None:
                    lines.append(f"  stuck at {frame.path}:{frame.line} in {frame.function}: {frame.source()}")
                lines.extend("  " + ln for ln in format_stack(thread, f"rank {self.rank} stack"))
        post.text = "\n".join(lines)
        return post

    def _report_last(
        self,
        item: pytest.Item,
        text: str,
        limit: float,
        others: list[int],
        printed: dict[int, list[tuple[str, str]]],
        when: str = "call",
    ) -> bool:
        """Report the hung test as failed and finish the session's reports (terminal summary,
        junit XML, the HTML page, coverage with the measurements of ``others``, the ranks that
        said where they were) from this thread, the main one being stuck; False when that
        could not be done within REPORT_GRACE seconds."""
        done = threading.Event()

        def report() -> None:
            from _pytest.reports import TestReport

            capman = self.config.pluginmanager.getplugin("capturemanager")
            if capman is not None:  # the report goes to the terminal
                with contextlib.suppress(Exception):
                    capman.suspend_global_capture(in_=True)
            # every rank's, labelled, as a run that ended says them
            sections = [(f"Captured {k} rank {r} {when}", v) for r, told in sorted(printed.items()) for k, v in told]
            now = time.time()
            began, began_monotonic = self._call_began
            lasted = time.monotonic() - began_monotonic  # the body's wall time, not the limit
            keywords: dict[str, Literal[1]] = {k: 1 for k in item.keywords}
            steps: list[tuple[Literal["setup", "call", "teardown"], Literal["failed", "passed"], str | None]] = [
                ("teardown", "failed", text)
            ]
            if when != "teardown":  # the phase that hung, then a teardown that never ran
                steps = [("setup" if when == "setup" else "call", "failed", text), ("teardown", "passed", None)]
            for phase, outcome, longrepr in steps:
                duration, start = (lasted, began) if phase == when else (0.0, now)
                rep = TestReport(
                    item.nodeid, item.location, keywords, outcome, longrepr, phase, sections, duration, start, now
                )
                if phase == "call":
                    page.attach_unrun(item, rep)  # on the HTML page too, without its ranks' lanes
                item.ihook.pytest_runtest_logreport(report=rep)
                sections = []
            session = item.session
            left = len(session.items) - session.items.index(item) - 1 if item in session.items else 0
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            session.shouldfail = f"ddphooks: {item.nodeid} hung; the run stops" + (
                f" before the {left} test{'s' if left != 1 else ''} after it" if left else ""
            )
            try:
                if self.report_at_hang is not None:  # what the end of the test loop would have done
                    self.report_at_hang(session, self, others)
            except Exception as exc:  # the session's other reports are still written
                say(f"ddphooks: no coverage report after the hang: {type(exc).__name__}: {exc}")
            self.config.hook.pytest_sessionfinish(session=session, exitstatus=pytest.ExitCode.TESTS_FAILED)
            done.set()

        thread = threading.Thread(target=report, name="ddphooks-spmd-last-report", daemon=True)
        thread.start()
        thread.join(REPORT_GRACE)
        return done.is_set()


def _default_term() -> None:
    with contextlib.suppress(Exception):
        faulthandler.unregister(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class SpmdPhases:
    """Under torchrun, around every other hook: a multirank test's setup and teardown end
    alike on every rank (``SpmdHooks.agree``), so no rank goes on to a test the others never
    reach, and rank 0's report says what failed on the others."""

    def __init__(self, hooks: SpmdHooks) -> None:
        self.hooks = hooks

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        return (yield from self._agreed(item, "setup"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        return (yield from self._agreed(item, "teardown"))

    def _agreed(self, item: pytest.Item, when: str) -> Generator[None, None, None]:
        __tracebackhide__ = True
        if RUN_KEY not in item.stash:
            return (yield)
        hooks = self.hooks
        limit = hooks.ddp.limit_of(item.stash[RUN_KEY])
        # the test's fixtures have its limit on each rank, as its body does: past it, the
        # watchdog says where this rank is stuck and ends the run
        watchdog = threading.Timer(limit + HANG_GRACE, hooks._on_hang, (item, None, limit, when))
        watchdog.daemon = True
        watchdog.name = "ddphooks-spmd-watchdog"
        hooks._call_began = (time.time(), time.monotonic())
        watchdog.start()
        error: BaseException | None = None
        try:
            result = yield
        except BaseException as exc:
            error = exc
        finally:
            watchdog.cancel()
        if hooks._watchdog_owns.is_set():
            threading.Event().wait()  # the watchdog took the test over: it reports and ends this process
        self.hooks.agree(item, when, error)
        return result


def _phase_ended_words(post: bytes, when: str) -> str:
    """What a rank that ended a test's setup or teardown (and waits for the others) said of it."""
    _, kind, told = [*post.decode(errors="replace").split("\n", 2), "", "", ""][:3]
    if not kind:
        return f"  ended its {when} and waits for the others"
    return f"  ended its {when} ({kind}: {told.split(_TRACEBACK)[0].strip()}) and waits for the others"


def _what_hung(item: pytest.Item, when: str) -> str:
    return item.nodeid if when == "call" else f"the {when} of {item.nodeid} (its fixtures)"


def _names_nodes(item: pytest.Item) -> bool:
    """The test's multirank marker gives ``nodes`` itself."""
    marker = item.get_closest_marker("multirank")
    return marker is not None and "nodes" in marker.kwargs


def _phase_outcome(error: BaseException | None) -> str | None:
    """How a rank's setup or teardown ended, in the words the ranks exchange."""
    if error is None:
        return None
    if isinstance(error, (KeyboardInterrupt, SystemExit, Exit)):
        return "stopped"
    if isinstance(error, XFailed):
        return "xfailed"
    if isinstance(error, (Skipped, unittest.SkipTest)):
        return "skipped"
    return "failed"


def _phase_posts(everyone: list[bytes], me: int) -> list[tuple[int, str, str, str]]:
    """(rank, test id, outcome, words) of the other ranks whose phase did not go well."""
    out = []
    for r, blob in enumerate(everyone):
        if r != me and blob:
            nodeid, how, text = blob.decode().split("\n", 2)
            out.append((r, nodeid, how, text))
    return out


_TRACEBACK = "\x00"  # in a rank's phase post: its words, then its traceback


def _traceback_of(item: pytest.Item, error: BaseException) -> str:
    """A rank's error in a phase as pytest's report of that phase shows it, for rank 0's."""
    try:
        return str(item.repr_failure(ExceptionInfo.from_exception(error)))
    except Exception:
        return "".join(traceback.format_exception(error))


def _error_text(error: BaseException) -> str:
    """What another rank's report says of this rank's error: its type and whole message."""
    text = str(error).strip()
    if isinstance(error, (Skipped, XFailed, unittest.SkipTest)):
        return text
    return f"{type(error).__name__}: " + _clipped(text)


def _clipped(text: str, most: int = 20) -> str:
    """A message told in another rank's report: its first ``most`` lines, indented under the first."""
    lines = text.splitlines() or [""]
    if len(lines) > most:
        lines = [*lines[:most], f"... ({len(lines) - most} more lines on that rank)"]
    return "\n  ".join(lines)


def _captured_output(item: pytest.Item) -> list[tuple[str, str, str]]:
    """What pytest captured of this rank's output and log records during the body, taken
    from its capture (pytest would report them unlabelled, as if they were the test's only
    output: rank 0's alone)."""
    return _captured_streams(item) + _captured_log(item)


def _captured_streams(item: pytest.Item) -> list[tuple[str, str, str]]:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is None or not capman.is_globally_capturing():
        return []
    try:
        out, err = capman.read_global_capture()
    except Exception:
        return []
    return [("call", key, text) for key, text in (("stdout", out), ("stderr", err)) if text]


def _captured_log(item: pytest.Item) -> list[tuple[str, str, str]]:
    """The records pytest's logging plugin holds for the report of the body's call, in its
    words; the plugin is left none to add (logs are captured with -s too)."""
    plugin = item.config.pluginmanager.get_plugin("logging-plugin")
    handler = getattr(plugin, "report_handler", None)
    if handler is None:
        return []
    try:
        text = str(handler.stream.getvalue()).strip()
        handler.reset()
    except Exception:
        return []
    return [("call", "log", text)] if text else []


class RunStopping(BaseException):
    """torchrun is stopping the run: raised in the test it interrupts (a BaseException, so the
    test's own ``except Exception`` does not take it for its error)."""


def _finished_words(result: Any) -> str:
    """How a rank that finished the test while another hung did: its outcome, and its own
    failure when it failed."""
    lines = [f"  finished the test body ({_outcome_words(result)}), then waited for the other ranks"]
    if result.outcome == "failed" and result.longrepr:
        lines += ["  " + line for line in result.longrepr.splitlines()]
    return "\n".join(lines)


def _outcome_words(result: Any) -> str:
    """``failed: ValueError: boom``, ``passed``."""
    return f"{result.outcome}: {result.message}" if result.message else result.outcome


def _paired_by_group(info: Any) -> bool:
    """A collective numbered by its group's sequence (a monitored barrier counts its own)."""
    return info.get("op") != "monitored_barrier" and not info.get("unseen")


def _first_line(report: pytest.TestReport) -> str:
    """What a plain test's failure on another rank is, in words: its message (a leak's lists
    what leaked) and where it was raised, unless that is this plugin (a leak found)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        where = "" if "pytest_ddphooks" in str(crash.path) else f" ({crash.path}:{crash.lineno})"
        return _clipped(crash.message or "") + where
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else "failed"
