"""``@pytest.mark.special``: the test runs in a fresh interpreter; its reports come back here.

The parent replaces the test's run protocol: it starts ``python -m pytest`` on the test's
file with the session's own options (minus what would collide: selection, xdist, the cache,
the temporary and junit folders), restricted to this one test. The child relays each of its
reports and warnings; the parent hands them to its own hooks, so the terminal summary,
the warnings summary, ``-rA``, ``--junitxml``, ``--lf`` and xdist see them as they see any
test. A child that crashes or hangs is reported as a failure with its exit status or stack
and whatever it printed; one that dies or lingers after its test is an error in teardown.

Every process of the special test's tree (the interpreter, and a pytest it relaunches, as
Lightning's launcher does for rank 1) runs that one test itself, with a temporary folder
of its own. Only the interpreter the parent started reports to it, and its captured output
is whatever it and every process it started printed while the test ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Generator, Iterator
from typing import IO, Any, Literal

import pytest
from _pytest.reports import TestReport
from _pytest.runner import CallInfo

from .. import coverage_relay, dump_signals, warning_relay
from ..launch import debugger, procs
from ..launch.output import descriptors_to
from ..launch.rendezvous import DIST_ENV
from ..special import (
    BASETEMP_ENV,
    EXIT_GRACE,
    MESSAGES_ENV,
    PARENT_ENV,
    PHASES,
    STACKS_ENV,
    TERMINAL_ENV,
    IsolatedRun,
    phase_output,
    run_isolated,
)
from ..stacks import fatal_error, format_stack, rel_path, user_frame
from .livelog import following_special, ship_live_log
from .markers import BAD_MARKER_KEY, RUN_KEY, is_special
from .reports import relay_warnings
from .session import LIVE_TERMINAL_KEY, DdpSession
from .terminal import lend_terminal

TARGET_ENV = "DDPHOOKS_SPECIAL_NODEID"
EXIT_KEY = pytest.StashKey[tuple[str, "int | None"]]()  # pytest.exit() in the test's interpreter: (msg, code)
SPECIAL_CHILD_NAME = "ddphooks-special-child"


# the special test this process's tree exists for; kept as the process started, since the
# channel variables are taken out of its environment
_TARGET = os.environ.get(TARGET_ENV)


def special_target() -> str | None:
    """The node id of the special test this process's tree exists for, or None."""
    return _TARGET


def runs_here(item: pytest.Item) -> bool:
    """True in the interpreter made for this very test (and in a pytest it relaunches)."""
    return item.nodeid == _TARGET


def reports_to_parent() -> bool:
    """True in the very interpreter the parent started for a special test."""
    return MESSAGES_ENV in os.environ and os.environ.get(PARENT_ENV) == str(os.getppid())


def special_basetemp() -> str | None:
    """The temporary folder of a process of a special test's tree, or None outside one.
    A pytest the test relaunches gets a fresh one: reusing its parent's would delete it."""
    if _TARGET is None:
        return None
    if reports_to_parent() and os.environ.get(BASETEMP_ENV):
        return os.environ[BASETEMP_ENV]
    return tempfile.mkdtemp(prefix="basetemp-")


def _reruns_of(item: pytest.Item) -> int:
    """How many times pytest-rerunfailures reruns the test when it fails (0 without it)."""
    plugin = item.config.pluginmanager.getplugin("rerunfailures")
    try:
        if plugin is None or plugin._is_rerun_path_excluded(item):
            return 0
        return int(plugin.get_reruns_count(item) or 0)
    except Exception:
        return 0


def _rerunnable(item: pytest.Item, report: TestReport) -> bool:
    """Whether pytest-rerunfailures' ``only_rerun`` / ``rerun_except`` let this failure be
    rerun: matched against what the failure says (the interpreter's exception is gone)."""
    plugin = item.config.pluginmanager.getplugin("rerunfailures")
    crash = getattr(report.longrepr, "reprcrash", None)
    said = str(getattr(crash, "message", "") or report.longreprtext)

    def matches(patterns: Any) -> bool:
        for pattern in patterns or ():
            if isinstance(pattern, type):
                if said.startswith(f"{pattern.__name__}:") or said.startswith(f"{pattern.__qualname__}:"):
                    return True
            elif re.search(str(pattern), said):
                return True
        return False

    try:
        only = plugin._get_rerun_filter_regex(item, "only_rerun")
        never = plugin._get_rerun_filter_regex(item, "rerun_except")
    except Exception:
        return True
    return (not only or matches(only)) and not (never and matches(never))


def _without_options_of(config: pytest.Config, known: str, args: list[str]) -> list[str]:
    """``args`` less every option of the plugin that added ``known`` (and their values)."""
    takes_value: dict[str, bool] = {}
    for group in getattr(config._parser, "_groups", []):
        options = getattr(group, "options", [])
        if any(known in opt.names() for opt in options):
            for opt in options:
                flag = opt.attrs().get("action") in ("store_true", "store_false", "count")
                takes_value.update({name: not flag for name in opt.names()})
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        name = str(arg).split("=", 1)[0]
        if name in takes_value:
            skip = takes_value[name] and "=" not in str(arg)
            continue
        out.append(arg)
    return out


def child_command(config: pytest.Config, item: pytest.Item, folder: str) -> list[str]:
    positional = {str(a) for a in (config.option.file_or_dir or [])}
    args = [a for a in config.invocation_params.args if str(a) not in positional]
    args += [f"--rootdir={config.rootpath}", "--color=no"]
    if config.pluginmanager.hasplugin("cacheprovider"):
        args += ["-o", f"cache_dir={os.path.join(folder, 'cache')}"]
    if config.inipath is not None and "-c" not in args:
        args += ["-c", str(config.inipath)]
    if config.getoption("capture", "fd") != "no":
        # also into the child's own output file: what it printed survives if it crashes
        args.append("--capture=tee-sys")
    # its own interpreter is one process, even when this session runs under torchrun
    args.append("--ddp-spmd=off")
    if config.pluginmanager.hasplugin("xdist"):
        args += ["-n", "0"]
    if config.pluginmanager.hasplugin("rerunfailures"):
        # this session reruns a failed special test, each attempt in an interpreter of its own:
        # the child reruns nothing, yet keeps the plugin, whose options and ini keys it reads too
        # (from addopts, PYTEST_ADDOPTS, the ini file) and would refuse unknown without it
        if hasattr(config.option, "force_reruns"):
            args.append("--force-reruns=0")
        else:  # an older pytest-rerunfailures: no way to say none but to leave it out
            args = [*_without_options_of(config, "--reruns", args), "-p", "no:rerunfailures"]
    if config.pluginmanager.hasplugin("_cov"):
        # measured by the session's own configuration, combined into the session's data
        args.append("--no-cov")
    if getattr(config.option, "xmlpath", None):
        args += [f"--junit-xml={os.path.join(folder, 'junit.xml')}"]
    args.append(str(item.path))
    return [sys.executable, "-m", "pytest", *args]


def _report(
    item: pytest.Item,
    when: Literal["setup", "call", "teardown"],
    outcome: Literal["passed", "failed", "skipped"],
    text: str,
    sections: list[tuple[str, str]],
    duration: float,
) -> TestReport:
    fspath, lineno, domain = item.location
    return TestReport(
        item.nodeid,
        (fspath, lineno, domain),
        {k: 1 for k in item.keywords},
        outcome,
        text if outcome != "passed" else None,
        when,
        sections,
        duration,
    )


def _with_parent_teardown(item: pytest.Item, nextitem: pytest.Item | None, reports: list[TestReport]) -> None:
    """The parent's own fixture stack ends where the next test expects it (the module and
    session fixtures earlier plain tests set up, when this test is the scope's last), captured
    as pytest captures a teardown; what it printed or raised joins the test's one teardown
    report, as a plain test's would."""
    capman = item.config.pluginmanager.getplugin("capturemanager")
    item._report_sections = [s for s in getattr(item, "_report_sections", []) if s[0] != "teardown"]  # type: ignore[attr-defined]

    def teardown() -> None:
        if capman is None:
            item.session._setupstate.teardown_exact(nextitem)
            return
        with capman.item_capture("teardown", item):
            item.session._setupstate.teardown_exact(nextitem)

    call = CallInfo.from_call(teardown, when="teardown")
    ours = TestReport.from_item_and_call(item, call)
    ours.sections = [(title, text) for title, text in ours.sections if title.endswith(" teardown")]
    theirs = next((r for r in reports if r.when == "teardown"), None)
    if theirs is None:
        if call.excinfo is not None or ours.sections:
            reports.append(ours)
        return
    theirs.sections.extend(ours.sections)
    if call.excinfo is not None and not theirs.failed:
        theirs.outcome, theirs.longrepr = ours.outcome, ours.longrepr


class SpecialHooks:
    """Parent side: run special tests in their own interpreter and relay their reports."""

    def __init__(self, ddp: DdpSession) -> None:
        self.config = ddp.config
        self.ddp = ddp

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if not is_special(item) or runs_here(item) or BAD_MARKER_KEY in item.stash:
            return None  # a bad marker is an error of the test here: no interpreter for it
        run = item.stash.get(RUN_KEY, None)
        if run is not None and run.spec.backend == "nccl" and self.ddp.gpus_missing(item, run.world_size):
            return None  # skipped here, as it would be there: no interpreter started for it
        ihook = item.ihook
        reruns = _reruns_of(item)
        attempt = 0
        while True:
            ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            reports = self._run(item)
            # pytest-rerunfailures' reruns, each attempt in an interpreter of its own
            again = attempt < reruns and any(r.failed and _rerunnable(item, r) for r in reports)
            if not again:
                _with_parent_teardown(item, nextitem, reports)
            for report in reports:
                if reruns:
                    report.rerun = attempt  # type: ignore[attr-defined]
                if again and report.failed:
                    report.outcome = "rerun"  # type: ignore[assignment]
                ihook.pytest_runtest_logreport(report=report)
            if not again:
                break
            attempt += 1
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        exit_request = item.stash.get(EXIT_KEY, None)
        if exit_request is not None:  # as pytest.exit() from a plain test: the session ends
            pytest.exit(*exit_request)
        return True

    def _basetemp(self, item: pytest.Item) -> str | None:
        """A folder under the session's own temporary folder (``--basetemp`` too) for the
        interpreter's: its ``tmp_path`` is kept as a plain test's is."""
        factory = getattr(self.config, "_tmp_path_factory", None)
        if factory is None:
            return None
        try:
            name = re.sub(r"\W", "_", item.name)[:30]
            return tempfile.mkdtemp(prefix=f"special-{name}-", dir=str(factory.getbasetemp()))
        except OSError:
            return None

    def _run(self, item: pytest.Item) -> list[TestReport]:
        folder = tempfile.mkdtemp(prefix="special-", dir=self.ddp.folder())
        tmp = os.path.join(folder, "tmp")
        os.mkdir(tmp)
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}  # one plain process
        env.update({TARGET_ENV: item.nodeid, "TMPDIR": tmp, **self.ddp.child_env()})
        limit = self.ddp.special_limit(item)
        command = child_command(self.config, item, folder)
        cwd = str(self.config.invocation_params.dir)
        live = self.config.getoption("capture", "fd") == "no"
        with following_special(self.config, folder, env):
            run = run_isolated(
                command,
                env,
                cwd,
                folder,
                limit,
                exit_grace=min(EXIT_GRACE, limit),
                terminal=live,
                basetemp=self._basetemp(item),
                lend_terminal=lambda who, path: lend_terminal(self.config, who, path),
            )
        reports = []
        for message in run.messages:
            if message.get("event") == "report":
                rep = self.config.hook.pytest_report_from_serializable(config=self.config, data=message["report"])
                if isinstance(rep, TestReport):
                    rep.nodeid = item.nodeid
                    if isinstance(rep.longrepr, list):
                        # a skip's (path, line, reason) came through JSON as a list: the
                        # terminal's summary and junitxml take only the tuple
                        rep.longrepr = tuple(rep.longrepr)
                    reports.append(rep)
        relay_warnings(item, [m["warning"] for m in run.messages if m.get("event") == "warning"])
        exits = [m for m in run.messages if m.get("event") == "exit"]
        if exits:
            item.stash[EXIT_KEY] = (str(exits[0].get("msg")), exits[0].get("returncode"))
            shutil.rmtree(folder, ignore_errors=True)
            return reports  # what the test reported before it ended the session
        problem = self._problem(item, run, limit)
        if problem is not None:
            when, text = problem
            sections = self._sections(run, folder)
            failed = next((r for r in reports if r.failed), None)
            if when == "teardown" and failed is not None:
                # a test that failed already (a framework then kills its own processes, as
                # Lightning does when a rank failed): its interpreter's end belongs to that story
                failed.sections.append(("the special test's interpreter after the test", text))
            elif when == "teardown":
                # the test's own reports stand; its interpreter's end is the teardown's error
                reports = [r for r in reports if r.when != "teardown"]
                reports.append(_report(item, "teardown", "failed", text, sections, 0.0))
            else:
                if not any(r.when == "setup" for r in reports):
                    reports.append(_report(item, "setup", "passed", "", [], 0.0))
                reports = [r for r in reports if r.when == "setup"]
                reports.append(_report(item, "call", "failed", text, sections, run.duration))
                reports.append(_report(item, "teardown", "passed", "", [], 0.0))
        shutil.rmtree(folder, ignore_errors=True)
        return reports

    @staticmethod
    def _sections(run: IsolatedRun, folder: str) -> list[tuple[str, str]]:
        """What the interpreter printed outside the test, and in each phase of it."""
        sections = [
            (f"Captured {name} of the special test's interpreter", text)
            for name, text in (("stdout", run.stdout), ("stderr", run.stderr))
            if text.strip()
        ]
        for when in PHASES:
            out, err = phase_output(folder, when)
            sections.extend(
                (f"Captured {name} {when}", text) for name, text in (("stdout", out), ("stderr", err)) if text
            )
        return sections

    @staticmethod
    def _problem(item: pytest.Item, run: IsolatedRun, limit: float) -> tuple[str, str] | None:
        """Why the child's own reports are not the whole story, and in which phase to say
        so; None when they are."""
        for message in run.messages:
            if message.get("event") == "collect-error":
                return "call", "the special test's file failed to collect in its own interpreter:\n" + message.get(
                    "longrepr", ""
                )
        if run.timed_out or run.lingered:
            if run.lingered:
                head = f"the special test finished, but its interpreter did not end {run.exit_grace:g} s after it"
            elif run.started:
                head = f"special test did not finish within {limit:g} s"
            else:
                head = f"the special test's interpreter did not start the test within {limit:g} s"
            text = [head, *_lingering_lines(run), "its interpreter was killed, with every process it started"]
            text += _stack_lines(run)
            return ("teardown" if run.lingered else "call"), "\n".join(text)
        if run.finished:
            if run.ended_normally:
                return None
            return "teardown", "\n".join(
                [f"the special test's interpreter died after the test: {run.describe_exit()}", *_exit_lines(run)]
            )
        started = any(m.get("event") == "start" for m in run.messages)
        if not started and run.code in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
            return "call", (
                f"the special test was not found in its own interpreter: no test collected there has the id"
                f" {item.nodeid} (an id made of a value that differs from one interpreter to the next, such as"
                " a process id or an object's address, is not found again: give the test ids= that stay the same;"
                " or a conftest deselected it there)"
            )
        return "call", "\n".join([f"the special test's interpreter died: {run.describe_exit()}", *_exit_lines(run)])


def _stack_lines(run: IsolatedRun) -> list[str]:
    lines: list[str] = []
    if run.stacks is None:
        return lines
    # faulthandler lists the main thread last: where the test itself is stuck comes first
    for thread in reversed(run.stacks.threads if not run.lingered else ()):
        frame = user_frame(thread)
        if frame is not None:
            lines.append(f"stuck at {rel_path(frame.path)}:{frame.line} in {frame.function}: {frame.source()}")
            break
    names = {int(t.get("ident") or 0): str(t.get("name")) for t in _lingering(run)}
    main = next((m.get("main") for m in run.messages if m.get("event") == "start"), None)
    for thread in run.stacks.threads:
        lines.append("")
        if thread.ident == main:  # as a rank's is told
            lines.extend(format_stack(thread, "the special test's stack, MainThread"))
            continue
        name = f" {names[thread.ident]!r}" if thread.ident in names else ""
        lines.extend(format_stack(thread, f"thread 0x{thread.ident:x}{name}"))
    return lines


def _lingering(run: IsolatedRun) -> list[dict[str, Any]]:
    return [t for m in run.messages if m.get("event") == "lingering" for t in m.get("threads", [])]


def _lingering_lines(run: IsolatedRun) -> list[str]:
    """The threads that kept a finished test's interpreter from ending (not daemon threads:
    Python waits for them at exit)."""
    threads = _lingering(run)
    if not threads:
        return []
    names = ", ".join(repr(t.get("name")) for t in threads)
    return [f"it waited for threads the test started and left running (not daemon threads): {names}"]


def _exit_lines(run: IsolatedRun) -> list[str]:
    lines = fatal_error(run.stderr)
    if not lines and run.stderr.strip():
        lines.append("last output on stderr:")
        lines.extend("  " + ln for ln in run.stderr.rstrip().splitlines()[-25:])
    return lines


class SpecialTargetHooks:
    """In every process of a special test's tree: collect that one test only."""

    def __init__(self, target: str) -> None:
        self.target = target

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep = [i for i in items if i.nodeid == self.target]
        drop = [i for i in items if i.nodeid != self.target]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep


class SpecialChildHooks:
    """In the interpreter the parent started: write every report, warning and, phase by
    phase, what was printed (crash-safe, in files) for the parent."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.target = special_target()
        # the channel is this interpreter's alone: processes it starts must not inherit it
        messages, stacks = os.environ.pop(MESSAGES_ENV), os.environ.pop(STACKS_ENV)
        parent = os.environ.pop(PARENT_ENV, None)
        # the interpreter ends with the pytest process that started it (killed, it never could
        # end it), as ranks end with their fork server; gone already: so is this test's session
        procs.prctl(procs.PR_SET_PDEATHSIG, signal.SIGKILL)
        if parent is not None and os.getppid() != int(parent):
            os._exit(1)
        os.environ.pop(BASETEMP_ENV, None)
        shared = os.environ.pop(TERMINAL_ENV, "")
        self.terminal = [int(fd) for fd in shared.split(",")] if shared else []
        if self.terminal:
            config.stash[LIVE_TERMINAL_KEY] = (self.terminal[0], self.terminal[1])
        self.folder = os.path.dirname(messages)
        self.capture = config.getoption("capture", "fd") != "no"
        self.post_mortem = False
        self._asks = 0  # debuggers asked for: each listens at a socket of its own
        self._out: IO[str] = open(messages, "a", encoding="utf-8")  # noqa: SIM115
        self._stacks = open(stacks, "w")  # noqa: SIM115
        stacks_file = self._stacks
        dump_signals.keep_armed((signal.SIGUSR1,), lambda: dump_signals.register(signal.SIGUSR1, stacks_file))

    def pytest_sessionstart(self) -> None:
        ship_live_log(self.config)  # the live log handler exists from here
        # --pdb: the post-mortem opens on the terminal of the session that started this
        # interpreter (pytest's own would read this one's stdin, which is no terminal)
        self.post_mortem = self.config.pluginmanager.get_plugin("pdbinvoke") is not None
        if self.post_mortem:
            self.config.pluginmanager.unregister(name="pdbinvoke")

    def _asking(self, who: str) -> tuple[str, Callable[[str], None]]:
        """A socket of its own for a debugger this interpreter asks for, and how to ask the
        parent session to lend its terminal there."""
        self._asks += 1
        return os.path.join(self.folder, f"debug{self._asks}"), lambda at: self._write(
            {"event": "debug", "path": at, "who": who}
        )

    def _debugger(self) -> debugger.RankDebugger:
        return debugger.RankDebugger(*self._asking("the special test"), who="the special test")

    def lend_parent_terminal(self, who: str, path: str) -> None:
        """A rank of this test wants a debugger: the terminal is the parent session's, passed on."""
        lent = debugger.borrow_terminal(*self._asking(f"{who} of the special test"))
        if lent is None:
            debugger.refuse(path)
            return
        try:
            debugger.splice(path, lent)
        finally:
            lent.close()

    def pytest_exception_interact(self, node: pytest.Item, call: CallInfo[Any], report: pytest.TestReport) -> None:
        if self.post_mortem and node.nodeid == self.target and call.excinfo is not None:
            self._debugger().post_mortem(call.excinfo.value)

    def _write(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()

    @contextlib.contextmanager
    def _phase(self, item: pytest.Item, when: str) -> Iterator[None]:
        """Descriptors 1 and 2 into this phase's files while it runs: what the test prints
        (pytest tees it there) and what any process it starts prints."""
        if item.nodeid != self.target:
            yield
            return
        coverage_relay.switch_to_test_context(item.nodeid, when)
        with self._breakpoints(), self._descriptors(item, when):
            yield

    @contextlib.contextmanager
    def _breakpoints(self) -> Iterator[None]:
        """``breakpoint()`` in the test opens pdb on the parent session's terminal."""
        if os.environ.get("PYTHONBREAKPOINT"):
            yield
            return
        saved = sys.breakpointhook
        sys.breakpointhook = lambda *args, **kwargs: self._debugger().set_trace(sys._getframe(1))
        try:
            yield
        finally:
            sys.breakpointhook = saved

    @contextlib.contextmanager
    def _descriptors(self, item: pytest.Item, when: str) -> Iterator[None]:
        if not (self.capture or self.terminal):
            yield
            return
        if self.capture:
            files = [
                os.open(os.path.join(self.folder, f"{when}.{ext}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                for ext in ("out", "err")
            ]
        else:  # -s: straight to the parent's terminal, as a plain test's output
            files = list(self.terminal)
        try:
            with descriptors_to(files):
                yield
        finally:
            if self.capture:
                for fd in files:
                    os.close(fd)
                self._sections(item, when)

    def _sections(self, item: pytest.Item, when: str) -> None:
        """In place of pytest's own sys-level capture of this phase: the same text and more."""
        out, err = phase_output(self.folder, when)
        sections = getattr(item, "_report_sections", None)
        if isinstance(sections, list):
            sections[:] = [sec for sec in sections if not (sec[0] == when and sec[1] in ("stdout", "stderr"))]
            item.add_report_section(when, "stdout", out)
            item.add_report_section(when, "stderr", err)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        with self._phase(item, "setup"):
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        with self._phase(item, "call"):
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        with self._phase(item, "teardown"):
            return (yield)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._write({"event": "collect-error", "longrepr": str(report.longrepr)})

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        if nodeid == self.target:
            self._write({"event": "start", "main": threading.main_thread().ident})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid == self.target:
            data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
            self._write({"event": "report", "report": data})

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        # pytest.exit() in the test: the parent's session ends with its code too
        if isinstance(excinfo.value, pytest.exit.Exception):
            self._write({"event": "exit", "msg": excinfo.value.msg, "returncode": excinfo.value.returncode})

    def pytest_warning_recorded(self, warning_message: Any, when: str, nodeid: str, location: Any) -> None:
        # collection warnings the parent saw itself when it collected the same file
        if when == "runtest" and nodeid == self.target:
            self._write({"event": "warning", "warning": warning_relay.dump(warning_message)})

    def pytest_unconfigure(self) -> None:
        # what will keep this interpreter from ending: threads it must wait for
        keeping = [
            {"name": t.name, "ident": t.ident}
            for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()
        ]
        if keeping:
            self._write({"event": "lingering", "threads": keeping})
        self._out.close()
        # the stack dump stays armed until the interpreter ends: a parent that finds it
        # lingering asks where its threads are
