"""One multirank run from the pytest process's side: start, watch, stop, collect.

A rank that dies stops the others at once. A rank whose test failed gives the others a short
grace (they often fail the same way a moment later, or error out of a collective with it),
then they are stopped. At the time limit every live rank's stacks are taken and the whole
tree is killed. Two kinds of hang are stopped early, from what the ranks recorded (see
``progress``): ranks blocked in collectives that can never match (a desync), seen twice in a
row with no progress; and a rank waiting in a collective or ``timeline()`` that a rank which
finished the test never entered (a stall), seen once. In every case what the ranks wrote
survives: results, output, and the events they recorded up to the end.

A run whose every rank has written its result is over for the test: its report is made
then, while the ranks take their leave (the exit barrier, the exit, the reaping and the
removal of the run's folder happen in the fork server as the session goes on).

The run is followed in two steps, so that pytest reports each phase where it happened:
``wait_setup`` returns once every rank has set up its fixtures (or the run is over),
``wait_end`` once every rank has ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import coverage_relay
from ..files import read_bytes
from ..progress import KILLED, RankProgress
from ..recorder import events
from ..recorder.events import EventReader, RawEvent
from ..recorder.timeline import Timeline
from ..report import BEFORE_TEARDOWN, RankExit, RankResult, RunReport, Stall
from ..schedule import ended_holds, planned_seconds
from ..stacks import ASK_NATIVE, ask, dump_stacks, without_harness_frames
from . import procs, protocol
from .job import Job
from .launcher import Launcher
from .livelog import LIVE_LOG
from .output import LineSink, LiveTail, as_text, split_by_phase, terminal_sink

# how often a waiting run looks at what the ranks recorded; a desync must be seen twice
POLL_SECONDS = 0.5
# a stall is certain once seen; looking again a moment later lets the ranks still on their way
# reach where they will wait, so that the report shows each rank where it stays
STALL_SETTLE_SECONDS = 0.1
# a cycle of ranks waiting for each other must hold this long, nothing recorded meanwhile: a
# thread of one of them could still enter the collective another waits in
DEADLOCK_SETTLE_SECONDS = 2.0
# a rank waits for one an injected fault killed (in timeline(), or in a collective gloo did not
# fail when the connection closed): taken as waiting for ever once it held this long
KILLED_SETTLE_SECONDS = 2.0
# a rank died: the others' collectives raise once its connections close; they get this long
# to write their own result before they are stopped
DEATH_GRACE_SECONDS = 0.5
# the same before a restart: a survivor that ends on its own names what it leaves behind (what
# a rank the harness stops had running is the interrupted attempt's, as under torchrun)
RESTART_GRACE_SECONDS = 2.0
# a rank finished while others run: the others most often finish a moment later, and a look
# for a stall then reads nothing; it is taken only if they have not (looking at once, every
# rank's events were read once per rank that finished: 56 reads in a passing 8-rank test)
STALL_LOOK_SECONDS = 0.03


class RunWatch:
    def __init__(
        self,
        launcher: Launcher,
        job: Job,
        *,
        grace: float = 1.0,
        poll: float = POLL_SECONDS,
        lend_terminal: Callable[[int, str], None] | None = None,
        live_fds: tuple[int, int] | None = None,
        live_log: LineSink | None = None,
    ) -> None:
        self.launcher = launcher
        self.job = job
        # -s: the ranks' lines to these descriptors as they print them; live logging: the log
        # records they ship, to pytest's live log; one thread follows both
        sinks: dict[str, LineSink] = {}
        if job.live_output and live_fds is not None:
            # each stream to its own: a rank's stderr is the session's, as a plain test's is
            sinks["out"], sinks["err"] = terminal_sink(live_fds[0]), terminal_sink(live_fds[1])
        if live_log is not None:
            sinks[LIVE_LOG] = live_log
        self._tail = (
            LiveTail(job, lambda rank, kind, lines: sinks[kind](rank, kind, lines), kinds=tuple(sinks))
            if sinks
            else None
        )
        # a rank wants a debugger (rank, the socket it listens on): the terminal is lent to it
        self.lend_terminal = lend_terminal
        self.grace = grace
        self.poll = poll
        self.report = RunReport(job.world_size, job.timeout)
        self.pids: dict[int, int] = {}
        self.setup_done: set[int] = set()
        self.body_passed: set[int] = set()  # with fixtures still to tear down
        self.reporting: set[int] = set()  # ranks whose body failed, writing their result
        self._pending_stop: str | None = None  # a rank died: why the live ranks are stopped
        self._stop_at: float | None = None  # when, unless they all finished by then
        self.finished: dict[int, str] = {}  # rank -> its outcome, once its result is written
        self.over = False
        self._progress = RankProgress()
        self._readers = {r: EventReader(job.path(r, "events")) for r in range(job.world_size)}
        self._records: dict[int, list[RawEvent]] = {r: [] for r in range(job.world_size)}  # read so far
        self._seen_desync: tuple[object, ...] | None = None
        self._seen_deadlock: tuple[object, ...] | None = None
        self._deadlock_since = 0.0
        self._stalled_since: float | None = None
        self._counts: dict[int, int] = {}
        self._started = self._deadline = self._next_poll = 0.0
        self._stall_look_at: float | None = None  # a look for a stall only, after a rank finished
        self._failed_at: float | None = None

    def start(self) -> None:
        self._started = time.monotonic()
        self.report.started_ns = time.time_ns()
        self.pids, self.report.prepared = self.launcher.spawn(self.job)
        if self._tail is not None:
            self._tail.start()
        if self.job.holds:  # a schedule's holds are the harness's, not the test's time
            self.report.held_allowance = planned_seconds(self.job.holds)
        self._deadline = self._started + self.job.timeout + self.report.held_allowance
        self._next_poll = self._started + self.poll

    # -- following the run ---------------------------------------------------------------

    def wait_setup(self) -> None:
        """Until every rank has set up its fixtures, or the run is over (a rank whose setup
        failed leaves at once, which ends it)."""
        self._follow(lambda: len(self.setup_done) == self.job.world_size)

    def wait_end(self) -> RunReport:
        """Until every rank has ended (stopping the rest when it must); what was observed."""
        self._follow(lambda: False)
        return self.collect()

    def _follow(self, done: object) -> None:
        try:
            self._follow_until(done)
        except KeyboardInterrupt:
            # the user stopped the session (Ctrl-C): where each rank was, then none runs on
            if not self.over:
                self.report.interrupted = True
                self._stop("interrupted")
            raise

    def _follow_until(self, done: object) -> None:
        while not self.over and not done():  # type: ignore[operator]
            wake = self._deadline
            if self._stop_at is not None:  # a death's: it decides when the others stop
                wake = min(wake, self._stop_at)
            elif self._failed_at is not None and not self._debugged_rank_runs():
                wake = min(wake, self._failed_at + self.grace)
            if self._failed_at is None:
                wake = min(wake, self._next_poll, self._stall_look_at or wake)
            event = self.launcher.next_event(self.job.test_id, max(wake - time.monotonic(), 0.0))
            if event is None:
                self._on_tick()
            elif isinstance(event, protocol.Noted):
                self._on_note(event)
            else:
                self._on_exit(event.exit)

    def _on_tick(self) -> None:
        now = time.monotonic()
        if self._stop_at is not None and now >= self._stop_at:
            self._stop(self._pending_stop or "stopped")
        elif now >= self._deadline:
            self.report.timed_out = True
            self._stop(f"timed out after {self.job.timeout:g} s")
        elif self._failed_at is not None:
            if self._stop_at is None and now >= self._failed_at + self.grace and not self._debugged_rank_runs():
                self._stop(f"stopped after rank {self.report.first_failure} failed")
        elif now >= self._next_poll:
            self._next_poll = now + self.poll
            self._stall_look_at = None
            self._look()
        elif self._stall_look_at is not None and now >= self._stall_look_at:
            self._stall_look_at = None
            self._look(stall_only=True)

    def _on_note(self, note: protocol.Noted) -> None:
        if note.phase == "debug" and self.lend_terminal is not None:
            began = time.monotonic()
            if self._tail is not None:
                self._tail.paused.set()  # the debugger has the terminal: the other ranks' lines wait
            try:
                self.lend_terminal(note.rank, note.status)
            finally:
                if self._tail is not None:
                    self._tail.paused.clear()
            # the time a person spent in the debugger is not the test's
            spent = time.monotonic() - began
            self._deadline += spent
            self._next_poll += spent
            if self._failed_at is not None:
                self._failed_at += spent
            if self._stop_at is not None:  # a peer's death: the grace it gives the others too
                self._stop_at += spent
        elif note.phase == "setup" and note.status == "ok":
            self.setup_done.add(note.rank)
        elif note.phase == "call" and note.status == "passed":
            self.body_passed.add(note.rank)
        elif note.phase == "call" and note.status == "failed":
            self.reporting.add(note.rank)
        elif note.phase == "done":
            self.finished[note.rank] = note.status
            if note.status == "failed" and self.report.first_failure is None:
                self.report.first_failure = note.rank
            if len(self.finished) == self.job.world_size:
                self._all_done()
                return
            if self._pending_stop is not None:
                self._stop_after_death(self._pending_stop)
                return
            self._end_if_only_faults_remain()
            if self.over:
                return
            # a failed rank leaves at once: its exit stops the others, as a failure
            if note.status != "failed" and self._failed_at is None and len(self.finished) < self.job.world_size:
                self._stall_look_at = self._stall_look_at or time.monotonic() + STALL_LOOK_SECONDS

    def _on_exit(self, ex: RankExit) -> None:
        report = self.report
        report.exits[ex.rank] = ex
        result = RankResult.read(self.job.path(ex.rank, "result"))
        if result is not None:
            report.results[ex.rank] = result
            self.finished.setdefault(ex.rank, result.outcome)
        died = result is None or not ex.clean
        self._read(ex.rank)
        restarting = self.job.attempt < self.job.max_restarts  # a death starts every rank again
        if died and self._progress.injected(ex.rank) == "kill" and not restarting:
            # killed by a fault the test injected: what matters is how the others take it
            self._end_if_only_faults_remain()
            return
        if died or (result is not None and result.outcome == "failed"):
            if report.first_failure is None:
                report.first_failure = ex.rank
            # a failure in its fixtures' teardown, after its body passed, cuts no peer's body
            # short: they run on to their own end (a peer blocked on it is a stall, stopped early)
            if self._failed_at is None and (died or result is None or result.phase != "teardown"):
                self._failed_at = time.monotonic()
            if died:
                self._stop_after_death(f"stopped after rank {ex.rank} died ({ex.describe()})")
                return
        if self._pending_stop is not None:
            self._stop_after_death(self._pending_stop)
            return
        if len(report.exits) == self.job.world_size:
            self.over = True

    def _debugged_rank_runs(self) -> bool:
        """Under --pdb with --ddp-pdb-rank=K: rank K still runs after another rank failed. It
        is let go on, to fail (and open pdb) or finish, rather than stopped before it could."""
        k = self.job.pdb_rank
        return (
            self.job.post_mortem
            and k is not None
            and 0 <= k < self.job.world_size
            and k not in self.finished
            and k not in self.report.exits
        )

    def _stop_after_death(self, reason: str) -> None:
        """Stop the live ranks, once they had a moment to write their own result: a peer's
        death makes their collective raise at once, and a rank stopped while it formats that
        failure would show the harness's frames instead of its error. A rank that said its
        body failed gets the whole grace."""
        self._pending_stop = self._pending_stop or reason
        live = [r for r in range(self.job.world_size) if r not in self.finished and r not in self.report.exits]
        if not live:
            self._stop(self._pending_stop)
            return
        if self._stop_at is None:
            restarting = self.job.attempt < self.job.max_restarts
            self._stop_at = time.monotonic() + (RESTART_GRACE_SECONDS if restarting else DEATH_GRACE_SECONDS)
        if any(r in self.reporting for r in live):
            self._stop_at = max(self._stop_at, (self._failed_at or time.monotonic()) + self.grace)

    def _all_done(self) -> None:
        """Every rank wrote its result: the test is over, whatever the ranks do as they leave."""
        for r in range(self.job.world_size):
            if r not in self.report.results:
                result = RankResult.read(self.job.path(r, "result"))
                if result is not None:
                    self.report.results[r] = result
        self.over = True

    def _read(self, rank: int) -> None:
        records = self._readers[rank].read_new()
        self._records[rank].extend(records)
        self._progress.feed(rank, records)

    def _end_if_only_faults_remain(self) -> None:
        """Once every rank has ended, finished the test, or is frozen by an injected fault (and
        some fault took a rank out), nobody is left to wait for: end the run."""
        taken = [r for r in range(self.job.world_size) if self._progress.injected(r) in ("kill", "stop")]
        if not taken:
            return
        waiting = [
            r
            for r in range(self.job.world_size)
            if r not in self.report.exits and r not in self.finished and self._progress.injected(r) != "stop"
        ]
        if not waiting:
            if len(self.report.exits) == self.job.world_size:
                self.over = True
            else:
                self._stop("stopped: the test is over (an injected fault took a rank out)")

    def _look(self, stall_only: bool = False) -> None:
        """Read what the ranks recorded since the last look; stop a desync or a stall."""
        for r in self._readers:
            self._read(r)
        self._end_if_only_faults_remain()
        if self.over:
            return
        live = {r for r in range(self.job.world_size) if r not in self.finished and r not in self.report.exits}
        counts = self._progress.counts()
        self._ask_native([r for r in live if counts.get(r, 0) == self._counts.get(r, -1)])
        self._counts = counts
        left = {r: outcome for r, outcome in self.finished.items() if outcome != "failed"}
        killed = [r for r in self.report.exits if r not in self.finished and self._progress.injected(r) == "kill"]
        left.update((r, KILLED) for r in killed)
        stalled = self._progress.stalled(left, live, self.job.world_size) if left else {}
        now = time.monotonic()
        # a peer's death makes most collectives raise at once, which a test may expect: a wait
        # on a killed rank is taken as for ever only once it held for longer
        settle = KILLED_SETTLE_SECONDS if any(left[r] == KILLED for _, a in stalled.values() for r in a) else 0
        settle = max(settle, STALL_SETTLE_SECONDS)
        if stalled and self._stalled_since is not None and now - self._stalled_since >= settle:
            waited_for = sorted({r for _, absent in stalled.values() for r in absent})
            self.report.stall = Stall({r: what for r, (what, _) in stalled.items()}, {r: left[r] for r in waited_for})
            self._stop("stopped: it waited for ranks that had finished the test")
            return
        if stalled:
            self._stalled_since = self._stalled_since or now
            self._next_poll = min(self._next_poll, self._stalled_since + settle)
        else:
            self._stalled_since = None
        if stall_only:
            return
        desync = self._progress.desync(left)
        if desync is not None and desync == self._seen_desync:
            self.report.desynced = True
            self._stop("stopped: blocked in collectives that can never match")
            return
        self._seen_desync = desync
        deadlock = self._progress.deadlock(live, self.job.world_size)
        if deadlock is None or deadlock != self._seen_deadlock:
            self._seen_deadlock, self._deadlock_since = deadlock, now
        elif now - self._deadlock_since >= DEADLOCK_SETTLE_SECONDS:
            self.report.deadlock = list(deadlock[0])  # type: ignore[call-overload]
            self._stop("stopped: the ranks wait for each other in different collectives")

    def _ask_native(self, ranks: list[int]) -> None:
        """Ranks that recorded nothing since the last look may wait in a collective native
        code issued: ask them to add those from torch's flight recorder (seen next look)."""
        for r in ranks:
            ask(self.job.path(r, "ask"), ASK_NATIVE)

    # -- ending it -----------------------------------------------------------------------

    def _stop(self, reason: str) -> None:
        """Take the stacks of every live rank, then kill the whole tree of the run."""
        report = self.report
        live = {r: p for r, p in self.pids.items() if r not in report.exits}
        if live:
            report.stopped_at_ns = time.time_ns()
            report.frozen = {r for r, p in live.items() if procs.is_frozen(p)}
            report.exchanging = self._progress.exchanging() & set(live)
            targets = {r: (p, self.job.path(r, "stacks")) for r, p in live.items() if r not in report.frozen}
            deeper = {r: (self.job.path(r, "ask"), self.job.path(r, "pystacks")) for r in targets}
            report.stacks = dump_stacks(targets, deeper=deeper) if targets else {}
            for r in live:
                report.stopped[r] = reason
            for ex in self.launcher.kill(self.job.test_id):
                report.exits.setdefault(ex.rank, ex)
                if not ex.by_harness and not ex.clean:
                    report.stopped.pop(ex.rank, None)  # it died on its own before it was stopped
                    if ex.rank in report.stacks and not report.stacks[ex.rank].threads:
                        report.stacks.pop(ex.rank)  # and never answered: no "no stack" line for it
            for r in live:
                late = RankResult.read(self.job.path(r, "result"))
                # a body that ended only after it was stopped ran on because the stack dump's
                # signal cut short what held it (a native call): it did not finish in time
                if late is not None and late.ended_ns <= report.stopped_at_ns:
                    report.results[r] = late
        self.over = True

    def collect(self) -> RunReport:
        """What the run's ranks reported, output and recorded events included (once it is over)."""
        report, job = self.report, self.job
        report.duration = time.monotonic() - self._started
        if self._tail is not None:
            self._tail.stop()  # every rank ended: what they printed last reaches the terminal
            self._tail = None
        for r in range(job.world_size):
            out, err = read_bytes(job.path(r, "out")), read_bytes(job.path(r, "err"))
            if out or err:
                result = report.results.get(r)
                report.outputs[r] = (as_text(out), as_text(err))
                pieces = split_by_phase(out, err, result.output_marks if result else [])
                report.phase_outputs[r] = [(phase, o, without_harness_frames(e)) for phase, o, e in pieces]
        for r in range(job.world_size):
            self._read(r)  # what was written since the last look; the rest was read as it came
            if r not in report.results:  # it died or was stopped: in its teardown, after its body ended?
                ended = RankResult.read(job.path(r, BEFORE_TEARDOWN))
                if ended is not None:
                    report.before_teardown[r] = ended
        raw = self._records
        stopped = report.stopped_at_ns
        # what a rank recorded after it was stopped is not the test's: the stack dump's signal
        # may have cut short a native call that held it, and it ran on until killed
        report.timeline = Timeline.from_raw(
            raw if not stopped else {r: [rec for rec in recs if rec[1] <= stopped] for r, recs in raw.items()}
        )
        report.thread_idents = {
            (r, int(rec[2])): int(rec[6]["ident"])
            for r, recs in raw.items()
            for rec in recs
            if rec[3] == "meta" and rec[6] and "ident" in rec[6]
        }
        for result in report.results.values():
            if coverage_relay.merge_into_session(result.measured):
                result.measured = None
        watch_only = {events.ARMED: report.armed, events.FIRED: report.fired, events.HELD: report.held}
        for r, recs in raw.items():
            if recs:
                report.began_ns[r] = int(recs[0][1])  # the log's first record: its main thread's name
            for rec in recs:
                if rec[3] == events.COUNTERS:  # written once the body (and its finalizers) ended
                    report.ended_ns[r] = int(rec[1])
                which = watch_only.get(rec[3])
                if which is not None:
                    which.setdefault(r, []).append({**(rec[6] or {}), "t_ns": int(rec[1])})
        report.held = {r: ended_holds(infos) for r, infos in report.held.items()}
        # last: the fork server removes the run's folder once its ranks are gone; when some
        # are still leaving, the session goes on without waiting for them
        report.swept = self.launcher.finish(job.test_id, job.label, wait=len(report.exits) == job.world_size)
        return report


def run_job(launcher: Launcher, job: Job, *, grace: float = 1.0, poll: float = POLL_SECONDS) -> RunReport:
    """A whole run in one call (for tools and benchmarks)."""
    watch = RunWatch(launcher, job, grace=grace, poll=poll)
    watch.start()
    return watch.wait_end()
