"""Running a multirank test on fresh ranks, phase by phase as pytest reports them.

- setup: once pytest has set up the fixtures of its own process, their values go to the
  ranks, which are forked and set up theirs; the phase ends when every rank has (a rank-side
  fixture that fails is an ERROR at setup, as in a plain test);
- call: the bodies run; the phase ends when every rank has ended, or was stopped;
- teardown: a rank-side fixture whose teardown failed, the body having passed everywhere,
  is an error in teardown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import secrets
from collections.abc import Generator, Set
from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest._code.code import ReprFileLocation
from _pytest.outcomes import Skipped

from .. import coverage_relay
from ..failure import (
    RunFailure,
    Verdict,
    attempt_summary,
    classify,
    failed_before_teardown,
    interrupted_lines,
    ranks_words,
)
from ..launch.job import Job
from ..launch.run import RunWatch
from ..leaks import Leak
from ..recorder import NeverWaitedWarning
from ..report import RunReport
from ..schedule import Profile, describe_hold, format_seed, held_seconds, holds
from ..stacks import Frame
from . import rankbody, rankfixtures
from .explore import Exploration
from .leaks import RANK_LEAKS_KEY
from .livelog import live_log_sink
from .markers import BAD_MARKER_KEY, RUN_KEY, MultirankRun, is_special
from .notices import warn_at
from .reports import (
    expected_by_xfail,
    fail_with,
    keep_artifacts,
    raise_verdict,
    relay_markers,
    relay_properties,
    relay_warnings,
    run_failed,
    safe_name,
)
from .session import DdpSession, live_terminal
from .special import SPECIAL_CHILD_NAME, runs_here, special_target
from .terminal import lend_terminal, terminal_markup


@dataclass
class _Active:
    """A multirank test between its setup and its teardown."""

    job: Job | None = None
    watch: RunWatch | None = None
    verdict: Verdict | None = None
    unsendable: str | None = None  # a fixture value could not be sent: the call fails with it
    teardown: RunFailure | None = None
    exploration: Exploration | None = None  # the schedules it runs under after a pass
    # what the ranks printed in fixture teardown: pytest's teardown report shows it, as for any test
    teardown_output: list[tuple[str, str]] = field(default_factory=list)
    exit_request: tuple[str, int | None] | None = None  # a rank called pytest.exit(): the session ends


ACTIVE_KEY = pytest.StashKey[_Active]()
PREPARED_KEY = pytest.StashKey[bool]()  # the test's ranks were set up before it came


def _death(report: RunReport, body_passed: Set[int]) -> bool:
    """A rank died (killed by a signal, injected or not, or gone before reporting) where a
    restart can stand for it. A failure is the test's outcome and is never restarted: not a rank
    whose test had failed before it died (in its teardown, or as it left), nor deaths in
    teardown alone (their bodies had ended: ``body_passed``, or an outcome told before the
    teardown) beside a rank whose test failed of its own in its body or a fixture's setup."""
    told = report.told_before_teardown()
    failed = {r for r, res in [*told.items(), *report.results.items()] if res.outcome == "failed"}
    dead = [
        r for r in range(report.world_size) if (report.died(r) or report.taken_out(r) == "kill") and r not in failed
    ]
    if not dead or not all(r in told or r in body_passed for r in dead):
        return bool(dead)
    # a failure of a peer going away (rank 0, serving the store, died) is the death's, as ever
    return not failed_before_teardown(report)


class MultirankHooks:
    def __init__(self, ddp: DdpSession) -> None:
        self.ddp = ddp
        self.config = ddp.config
        self._ids = itertools.count(1)
        # the session's own: each test's schedules are drawn from it and the test's id
        self._explore_base = secrets.randbits(32)
        # with -s every line a rank prints reaches the terminal as it is printed; with
        # --capture=tee-sys too, and it stays in the report's sections (the tee-sys of a special
        # test's interpreter is the plugin's own, which its parent streams or not)
        capture = self.config.getoption("capture", "fd")
        self._sections = capture != "no"
        self._live = capture == "no" or (capture == "tee-sys" and special_target() is None)
        self._ahead: Job | None = None  # the run whose ranks are being prepared for the next test
        self._next_item: pytest.Item | None = None
        self._order: dict[str, int] = {}  # node id -> its place in the session's items
        self._interrupted: list[str] = []  # where the ranks of an interrupted test were
        self._interrupted_at: Frame | None = None  # the line of its code the first of them was at

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        # Forked here: every test module is imported, no test has run yet. Collection
        # errors stop the session before this point, so bad input never spawns anything.
        if session.config.option.collectonly:
            return
        runs = sum(1 for item in session.items if RUN_KEY in item.stash and (runs_here(item) or not is_special(item)))
        if runs:
            self._order = {item.nodeid: i for i, item in enumerate(session.items)}
            self.ddp.start_launcher(session, expected_runs=runs)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Processes that ranks abandoned and the fork server only found after their test's
        report (ranks find their own before it): named here, for the leak guard's summary."""
        launcher = self.ddp.launcher
        if launcher is None:
            return
        launcher.settle(timeout=10.0)
        for label, swept in launcher.late_sweeps:
            self.ddp.late_leaks.append(f"{label}: processes its ranks left were found after its report (killed):")
            self.ddp.late_leaks.extend(f"  process {pid}: {cmd}" for pid, cmd in swept)
        launcher.late_sweeps.clear()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, object]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        # the next test this process runs (under xdist: the next its scheduler gave it)
        self._next_item = nextitem
        try:
            return (yield)
        except KeyboardInterrupt:
            self._say_where_interrupted(item)
            raise
        finally:
            self._next_item = None

    def _say_where_interrupted(self, item: pytest.Item) -> None:
        """Keep, for the summary, where the ranks of the test the user interrupted were."""
        active = item.stash.get(ACTIVE_KEY, None)
        watch = active.watch if active is not None else None
        if watch is None or not watch.report.interrupted:
            return
        try:
            self._interrupted, self._interrupted_at = interrupted_lines(item.nodeid, watch.collect())
        except Exception as exc:  # the session is ending: never in the way of the interrupt
            self._interrupted = [f"ddphooks: {item.nodeid} was interrupted; where its ranks were is unknown ({exc})"]

    @pytest.hookimpl(trylast=True)
    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """The line pytest names under ``KeyboardInterrupt`` is where a plain test was: of a
        multirank one, where its ranks were in the test's code, not where the pytest process
        waited for them."""
        at = self._interrupted_at
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        memo: Any = getattr(reporter, "_keyboardinterrupt_memo", None)
        crash = getattr(memo, "reprcrash", None)
        if at is not None and isinstance(crash, ReprFileLocation):
            memo.reprcrash = ReprFileLocation(at.path, at.line, crash.message)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for line in self._interrupted:
            terminalreporter.write_line(line)

    # -- the phases --------------------------------------------------------------------------

    def _runs_here(self, item: pytest.Item) -> MultirankRun | None:
        run = item.stash.get(RUN_KEY, None)
        if run is None or rankbody.in_rank or self.config.option.setuponly or self.config.option.setupplan:
            return None
        return run

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        run = self._runs_here(item)
        if run is not None and run.spec.backend == "nccl":
            self._skip_without_gpus(item, run)
        result = yield
        if run is not None and isinstance(item, pytest.Function):
            self._start(item, run)
        return result

    def _skip_without_gpus(self, item: pytest.Item, run: MultirankRun) -> None:
        missing = self.ddp.gpus_missing(item, run.world_size)
        if missing is not None:
            # reported at the test, as a skip marker's is (-rs names its file and line)
            raise Skipped(missing, _use_item_location=True)

    def _start(self, item: pytest.Function, run: MultirankRun) -> None:
        active = item.stash[ACTIVE_KEY] = _Active()
        if RANK_LEAKS_KEY in item.stash:  # a rerun of the item: what the last run left was said
            del item.stash[RANK_LEAKS_KEY]
        try:
            names = rankfixtures.needed_values(item, run.dependent)
            values = rankfixtures.pickle_values(item, names)
            instance = rankfixtures.pickle_test_state(item)
        except rankfixtures.FixtureNotSendable as exc:
            active.unsendable = str(exc)
            return
        with coverage_relay.HarnessWork():
            self._start_ranks(item, run, active, values, instance)

    def _start_ranks(
        self, item: pytest.Function, run: MultirankRun, active: _Active, values: Any, instance: Any
    ) -> None:
        markup = terminal_markup(self.config)
        node_dirs = self._node_dirs(item, run)
        base_tmp = self._base_tmp_path(item, run)
        payload = rankbody.ItemPayload(item.nodeid, values, instance, node_dirs, markup, run.dependent, base_tmp)
        settings = self.ddp.settings
        active.exploration = Exploration.plan(
            item.nodeid,
            self._explore_base,
            settings.explore if run.spec.explore is None else run.spec.explore,
            run.spec.schedule if run.spec.schedule is not None else settings.schedule,
        )
        if active.exploration is not None:
            tmp = {str(item.funcargs[n]) for n in ("tmp_path", "shared_tmp_path") if n in item.funcargs}
            active.exploration.keep([*sorted(tmp), *node_dirs, *([base_tmp] if base_tmp else [])], self.ddp.folder())
        job = self._job_for(item, run, payload=pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        active.job = self._place(job, preparable=active.exploration is None)
        active.watch = self._launch(item, active.job)
        item.stash[PREPARED_KEY] = active.watch.report.prepared
        self._prepare_next(item, run)
        active.watch.wait_setup()
        if active.watch.over:
            verdict = self._finish(item, active)
            if verdict.failure is not None and verdict.failure.phase == "setup":
                # under --pdb the rank had the debugger: pytest's own would show this plugin's frames
                raise run_failed(verdict.failure, debugging=self.ddp.settings.post_mortem)

    def _job_for(self, item: pytest.Item, run: MultirankRun, payload: bytes = b"") -> Job:
        """The run of ``item``, not yet placed (no id, no folder)."""
        return Job(
            test_id="",
            label=item.nodeid,
            world_size=run.world_size,
            nodes=run.spec.nodes,
            backend=run.spec.backend,
            init_process_group=run.spec.init_process_group,
            timeout=self.ddp.limit_of(run),
            run_dir="",
            env={**os.environ, **self.ddp.child_env()},
            cwd=_working_folder(),
            payload=payload,
            live_output=self._live,
            post_mortem=self.ddp.settings.post_mortem,
            pdb_rank=self.ddp.settings.pdb_rank,
            max_restarts=run.spec.restarts,
        )

    def _place(self, job: Job, preparable: bool) -> Job:
        """Give the run an id and a folder: those of the ranks prepared ahead when they fit it
        (the same group, environment and output), else new ones (the prepared ranks are then
        discarded)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if preparable and job.readiness() is not None and job.readiness() == ahead.readiness():
                return dataclasses.replace(job, test_id=ahead.test_id, run_dir=ahead.run_dir)
            self.ddp.running_launcher().discard(ahead.test_id)
        test_id, run_dir = self._new_run_dir()
        return dataclasses.replace(job, test_id=test_id, run_dir=run_dir)

    def _prepare_next(self, item: pytest.Item, current: MultirankRun) -> None:
        """Have the fork server set up the ranks of the next multirank test in collection
        order while this one runs."""
        if not self.ddp.settings.prepare:
            return
        following = self._following_run(item)
        if following is None:
            return
        nxt, run = following
        settings = self.ddp.settings
        explore = settings.explore if run.spec.explore is None else run.spec.explore
        schedule = run.spec.schedule if run.spec.schedule is not None else settings.schedule
        if explore or schedule is not None:
            return  # its schedules are drawn from a plain run whose ranks set up in the test's time
        # pytest-timeout sets a test's limit when its setup starts: assume the next is timed
        # as this one was (a wrong guess costs the preparation, nothing else)
        predicted = dataclasses.replace(run, timeout=run.timeout or current.timeout)
        ahead = self._job_for(nxt, predicted)
        if ahead.readiness() is None:
            return
        test_id, run_dir = self._new_run_dir()
        self._ahead = dataclasses.replace(ahead, test_id=test_id, run_dir=run_dir, label="")
        self.ddp.running_launcher().prepare(self._ahead)

    def _following_run(self, item: pytest.Item) -> tuple[pytest.Item, MultirankRun] | None:
        """The next multirank test to run in this process after ``item``, as far as it can
        be told: from the next item pytest will run, in collection order."""
        nxt = self._next_item
        if nxt is None:
            return None
        items = item.session.items
        for candidate in items[self._order.get(nxt.nodeid, len(items)) :]:
            run = candidate.stash.get(RUN_KEY, None)
            if run is not None and not is_special(candidate) and BAD_MARKER_KEY not in candidate.stash:
                return candidate, run
        return None

    def _base_tmp_path(self, item: pytest.Function, run: MultirankRun) -> str | None:
        """pytest's own ``tmp_path`` for a test whose ``tmp_path`` is a project's override that
        depends on the rank (a folder per rank under it): made here, as pytest makes it, so that
        every rank's override starts from the one folder."""
        return _test_folder(item) if "tmp_path" in run.dependent else None

    def _node_dirs(self, item: pytest.Function, run: MultirankRun) -> list[str]:
        if "node_tmp_path" not in run.dependent:
            return []
        return [_test_folder(item, f"-node{k}") for k in range(run.spec.nodes)]

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        if self._runs_here(pyfuncitem) is None:
            return None
        active = pyfuncitem.stash.get(ACTIVE_KEY, None)
        if active is None:
            raise fail_with("the multirank run was not started in the test's setup")
        if active.unsendable is not None:
            raise fail_with(active.unsendable)
        verdict = active.verdict or self._finish(pyfuncitem, active)
        if active.exit_request is not None:  # as pytest.exit() in a plain test: the session stops
            message, returncode = active.exit_request
            pytest.exit(message, returncode)
        raise_verdict(verdict, debugging=self.ddp.settings.post_mortem)
        return True

    def _lend_terminal(self, rank: int, path: str) -> None:
        """A rank wants a debugger: give it this process's terminal until it is done (in a
        special test's interpreter, the terminal of the session that started it)."""
        child = self.config.pluginmanager.get_plugin(SPECIAL_CHILD_NAME)
        if child is not None:
            child.lend_parent_terminal(f"rank {rank}", path)
        else:
            lend_terminal(self.config, f"rank {rank}", path)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        active = item.stash.get(ACTIVE_KEY, None)
        if active is not None and active.watch is not None and active.verdict is None:
            self._finish(item, active)  # the call never ran (interrupted): end the run anyway
        if active is not None:
            for key, text in active.teardown_output:
                item.add_report_section("teardown", key, text)
            active.teardown_output.clear()
        try:
            result = yield
        except Exception as exc:
            if active is None or active.teardown is None:
                raise
            # the ranks' teardown failed too: both are reported, as pytest reports two finalizers
            failure, active.teardown = active.teardown, None
            ranks = run_failed(failure)
            ranks.__cause__ = None  # the group's traceback shows its members whole: no rank's exception again
            raise ExceptionGroup(f"errors while tearing down {item!r}", [ranks, exc]) from None
        if active is not None and active.teardown is not None:
            failure, active.teardown = active.teardown, None
            # with the ranks' exception types: an xfail's raises= is checked against them
            raise run_failed(failure)
        return result

    # -- ending a run ------------------------------------------------------------------------

    def _finish(self, item: pytest.Item, active: _Active) -> Verdict:
        """Wait for the end of the run (restarting its ranks after a death, as many times as
        the marker allows; exploring schedules after a pass), and say everything it left in
        the session."""
        with coverage_relay.HarnessWork():
            return self._end_run(item, active)

    def _end_run(self, item: pytest.Item, active: _Active) -> Verdict:
        assert active.watch is not None and active.job is not None
        report, verdict = self._run_to_end(item, active, active.watch)
        self._rank_leaks(item, report)
        explore = verdict.outcome == "passed" and verdict.teardown is None  # only a test that passed whole
        if explore and active.exploration is not None and report.timeline is not None:
            found = self._explore(item, active, active.exploration, report)
            if found is not None:
                report, verdict = found
        elif verdict.failure is not None and active.exploration is not None and active.exploration.replay:
            verdict.failure.schedule = [active.exploration.not_replayed()]
        relay_warnings(item, [w for _, res in sorted(report.results.items()) for w in res.warnings])
        if report.timeline is not None and verdict.outcome == "passed":
            for text in report.timeline.never_waited():
                warn_at(item, NeverWaitedWarning(text))
        self._output_sections(item, active, report)
        relay_properties(item, report)
        relay_markers(item, report)
        if verdict.expected is not None and verdict.failure is not None and expected_by_xfail(item, verdict.expected):
            # the xfail expects the bodies' failure: the death or hang after it is an error in teardown
            whole, verdict = verdict.failure, verdict.expected
            if verdict.teardown is not None:
                verdict.teardown.attempts, verdict.teardown.schedule = whole.attempts, whole.schedule
        active.verdict = verdict
        active.teardown = verdict.teardown
        active.exit_request = next((r.exit_request for _, r in sorted(report.results.items()) if r.exit_request), None)
        k = self.ddp.settings.pdb_rank
        if self.ddp.settings.post_mortem and k is not None and verdict.outcome == "failed":
            failed = sorted(r for r, res in report.results.items() if res.outcome == "failed")
            if k >= report.world_size:
                said = f"this test has ranks 0..{report.world_size - 1}; no rank opened pdb"
            elif k not in failed:
                who = f" ({ranks_words(failed)} failed)" if failed else ""
                said = f"rank {k} did not fail here, so no rank opened pdb{who}"
            else:
                said = ""
            if said:
                item.add_report_section("call", "ddphooks", f"--ddp-pdb-rank={k}: {said}")
        keep_artifacts(item, report, verdict, self.ddp.settings)
        if active.exploration is not None:
            active.exploration.discard()
        return verdict

    def _run_to_end(
        self, item: pytest.Item, active: _Active, watch: RunWatch, under: str = ""
    ) -> tuple[RunReport, Verdict]:
        """The run ``watch`` follows, to its end: after a death, every rank started again as
        many times as the marker allows. ``under``: the schedule it runs under, if explored."""
        assert active.job is not None
        job = active.job
        report = watch.wait_end()
        attempts: list[str] = []
        while _death(report, watch.body_passed) and job.attempt < job.max_restarts:
            attempts.append(attempt_summary(report, job.attempt))
            self._rank_leaks(item, report, f" (attempt {job.attempt})")  # what a dead attempt left
            job = active.job = self._next_run(job, attempt=job.attempt + 1)
            watch = self._launch(item, job)
            report = watch.wait_end()
        if attempts:
            attempts.append(attempt_summary(report, job.attempt))
            if _death(report, watch.body_passed):  # as torchrun's agent gives up: the death of the last attempt stands
                attempts.append(f"no restart left: restarts={job.max_restarts} were all used")
            item.add_report_section("call", f"attempts{under}", "\n".join(attempts))
        verdict = classify(
            report, watch.setup_done if job.attempt == 0 and job.holds is None else None, watch.body_passed
        )
        if verdict.failure is not None and attempts:
            verdict.failure.attempts = attempts
        return report, verdict

    def _explore(
        self, item: pytest.Item, active: _Active, plan: Exploration, plain: RunReport
    ) -> tuple[RunReport, Verdict] | None:
        """Run the passed test again under each schedule of ``plan``: the report and verdict of
        the first it fails under, or None when it passes them all."""
        assert active.job is not None and plain.timeline is not None
        profile = Profile.of(
            {r: plain.timeline.for_rank(r) for r in plain.timeline.ranks}, plain.began_ns, plain.ended_ns
        )
        plain_job = active.job
        for index, seed in enumerate(plan.seeds, 1):
            plan.restore()
            # the whole test again, from its first attempt
            active.job = self._next_run(plain_job, attempt=0, holds=holds(seed, plain_job.world_size, profile))
            under = f"under schedule {format_seed(seed)}"
            report, verdict = self._run_to_end(item, active, self._launch(item, active.job), f" {under}")
            plan.held_seconds += held_seconds(report.held)
            self._rank_leaks(item, report, f" ({under})")
            failed = verdict.failure or verdict.teardown  # a rank's teardown failing under it counts
            if failed is not None:
                failed.schedule = [plan.header(index, seed)]
                failed.holds = [describe_hold(r, info) for r in sorted(report.held) for info in report.held[r]]
                return report, verdict
            if verdict.outcome != "passed":  # a rank skipped under it: as in a plain run, the test did
                verdict.message = f"{verdict.message} ({plan.header(index, seed).replace('failed ', '', 1)})"
                return report, verdict
        active.job = plain_job  # the plain run's report stands
        item.add_report_section("call", "schedules", plan.passed())
        return None

    def _launch(self, item: pytest.Item, job: Job) -> RunWatch:
        live = (live_terminal(self.config) or (1, 2)) if self._live else None
        watch = RunWatch(
            self.ddp.start_launcher(item.session),
            job,
            lend_terminal=self._lend_terminal,
            live_fds=live,
            live_log=live_log_sink(self.config),
        )
        watch.start()
        return watch

    def _new_run_dir(self) -> tuple[str, str]:
        """A run's id and its private folder."""
        test_id = f"{os.getpid()}-{next(self._ids)}"
        run_dir = os.path.join(self.ddp.runs_folder(), f"run-{test_id}")
        os.mkdir(run_dir)
        return test_id, run_dir

    def _next_run(self, job: Job, **changes: Any) -> Job:
        """The same test on fresh ranks (after a death, or under a schedule): a new group, the
        same folders."""
        test_id, run_dir = self._new_run_dir()
        return dataclasses.replace(job, test_id=test_id, run_dir=run_dir, **changes)

    def _output_sections(self, item: pytest.Item, active: _Active, report: RunReport) -> None:
        def place(when: str, key: str, text: str) -> None:
            # a teardown's sections join pytest's teardown report, not the call's (which would
            # print them once for each)
            if when == "teardown":
                active.teardown_output.append((key, text))
            else:
                item.add_report_section(when, key, text)

        for r, result in sorted(report.results.items()):
            for when, key, text in result.sections:
                place(when, f"{key} rank {r}", text)
        if not self._sections:
            return  # it was on the terminal as it was printed
        for r, pieces in sorted(report.phase_outputs.items()):
            for when, out, err in pieces:
                for key, text in ((f"stdout rank {r}", out), (f"stderr rank {r}", err)):
                    if text:
                        place(when, key, text)

    @staticmethod
    def _rank_leaks(item: pytest.Item, report: RunReport, run: str = "") -> None:
        """What the ranks of one run (``run``: which, when the test had several) left behind."""
        leaked = [
            Leak("process", cmd, f"rank {r} left process {pid} running (killed){run}: {cmd}")
            for r, res in sorted(report.results.items())
            for pid, cmd in res.leaks
        ]
        leaked.extend(
            Leak("process", cmd, f"process {pid} started by a rank outlived it{run}: {cmd} (killed)")
            for pid, cmd in report.swept
        )
        if leaked:
            item.stash[RANK_LEAKS_KEY] = [*item.stash.get(RANK_LEAKS_KEY, []), *leaked]


def _test_folder(item: pytest.Function, suffix: str = "") -> str:
    """A new folder for the test under the session's base folder, named as pytest names one."""
    factory = item._request.getfixturevalue("tmp_path_factory")
    return str(factory.mktemp(safe_name(item.name)[:30] + suffix, numbered=True))


def _working_folder() -> str:
    """The folder ranks start in: the test's current one, which must still exist."""
    with contextlib.suppress(FileNotFoundError):
        return os.getcwd()
    pytest.fail(
        "the current folder was removed before the ranks could start in it (os.getcwd() fails): ranks"
        " start in the folder the test runs in, so a fixture that changes into a folder must leave it"
        " in place while the test runs, or change back before it removes it",
        pytrace=False,
    )
