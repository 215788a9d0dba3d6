"""The test body inside a rank: the pytest item itself, from the launcher's copy of the session.

The launcher was forked after collection, so the item, its module (imported and rewritten
by pytest), its config and plugins are all here. The body runs through the item's own
``pytest_pyfunc_call`` hook, and a failure is formatted by the item's own ``repr_failure``,
so the rank's report reads exactly like pytest's: assertion introspection, ``--tb``, ``-l``.
"""

from __future__ import annotations

import bdb
import contextlib
import dataclasses
import functools
import io
import os
import pdb
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _pytest import assertion as _assertion
from _pytest._code import ExceptionInfo
from _pytest._code.code import TerminalRepr
from _pytest._io import TerminalWriter
from _pytest.junitxml import xml_key
from _pytest.logging import caplog_records_key
from _pytest.outcomes import Exit, Skipped, XFailed
from _pytest.warnings import catch_warnings_for_item

from .. import coverage_relay, stacks, warning_relay
from ..failure import PEER_GONE
from ..faults import Faults
from ..launch import livelog
from ..launch.job import Job
from ..launch.output import capture_bypassed, positions
from ..launch.rank import RankContext
from ..report import BEFORE_TEARDOWN, RankResult
from .livelog import LIVE_LOG, shipping_logs
from .rankfixtures import RankFixtures, remember_classes, restore_test_state

_items: dict[str, pytest.Function] = {}
CURRENT_TEST = "PYTEST_CURRENT_TEST"  # where pytest tells a test's code which test and phase runs
in_rank = False  # True inside a rank process: the plugin then runs bodies itself


@dataclass
class ItemPayload:
    """What the pytest process sends for one multirank item."""

    nodeid: str
    values: dict[str, bytes]
    instance_state: bytes | None
    node_dirs: list[str]
    markup: bool = False
    dependent: list[str] = field(default_factory=list)  # the fixtures the rank sets up, in order
    # pytest's own tmp_path, made here, for a test whose ``tmp_path`` is an override the rank sets up
    base_tmp_path: str | None = None


def register_items(items: list[pytest.Item]) -> None:
    """Remember the collected items; the launcher forked from here finds them by node id."""
    _items.clear()
    remember_classes(items)
    for item in items:
        if isinstance(item, pytest.Function):
            _items[item.nodeid] = item


def _render(item: pytest.Function, exc: BaseException, markup: bool) -> tuple[str, str, tuple[str, int] | None]:
    excinfo = ExceptionInfo.from_exception(exc)
    crash = excinfo._getreprcrash()
    message = crash.message if crash is not None else f"{type(exc).__name__}: {exc}"
    if PEER_GONE.search(message) and item.config.getoption("tbstyle", "auto") == "auto":
        # the story is the peer's: where this rank was is enough, not every torch frame's source
        longrepr: str | TerminalRepr = item._repr_failure_py(excinfo, style="short")
    else:
        longrepr = item.repr_failure(excinfo)
    buf = io.StringIO()
    tw = TerminalWriter(file=buf)
    tw.hasmarkup = markup
    if isinstance(longrepr, str):
        tw.line(longrepr)
    else:
        longrepr.toterminal(tw)
    location = (str(crash.path), crash.lineno) if crash is not None else None
    return buf.getvalue(), message, location


class _WarningLog:
    """Stands in for the item's hook proxy: pytest's warning capture reports to it, and
    nothing reaches plugins of the forked session (an xdist worker's channel among them)."""

    def __init__(self) -> None:
        self.caught: list[warning_relay.WireWarning] = []
        self.pytest_warning_recorded = self

    def call_historic(self, kwargs: dict[str, Any]) -> None:
        self.caught.append(warning_relay.dump(kwargs["warning_message"]))


def junit_mark(item: pytest.Item) -> tuple[int, int]:
    """Where the junit report's properties of the test and of the suite stand now."""
    xml = item.config.stash.get(xml_key, None)
    return len(item.user_properties), len(xml.global_properties) if xml is not None else 0


def junit_recorded(item: pytest.Item, had: tuple[int, int], result: RankResult) -> None:
    """What the rank recorded for the junit report since ``had`` (record_property,
    record_testsuite_property, record_xml_attribute), for the process that writes it."""
    xml = item.config.stash.get(xml_key, None)
    result.properties = [_sendable(p) for p in item.user_properties[had[0] :]]
    result.suite_properties = [_sendable(p) for p in xml.global_properties[had[1] :]] if xml is not None else []
    if xml is not None:  # nothing else sets this process's copy of the test's attributes
        with contextlib.suppress(Exception):
            result.xml_attributes = [(str(k), str(v)) for k, v in xml.node_reporter(item.nodeid).attrs.items()]


def run_in_rank(job: Job, ctx: RankContext) -> RankResult:
    """The test body on this rank, under the warning filters pytest would apply to it;
    the warnings it raised travel back with its result."""
    log = _WarningLog()
    payload: ItemPayload = pickle.loads(job.payload)
    item = _items.get(payload.nodeid)
    if item is None:
        raise LookupError(f"the rank launcher does not know the test {payload.nodeid!r}")
    _bypass_capture_when_disabled(item.config)
    had = junit_mark(item)
    marked = len(item.own_markers)
    # -p no:warnings: pytest catches no test's warnings (Python prints them), nor does a rank
    catching = item.config.pluginmanager.has_plugin("warnings")
    with (
        catch_warnings_for_item(item.config, log, "runtest", item) if catching else contextlib.nullcontext(),
        _capturing_logs(item) as log_phase,
        shipping_logs(item.config, job.path(ctx.rank, LIVE_LOG)),
        _assertion_hooks(item),
    ):
        result = _run_body(item, payload, ctx, log_phase)
    result.mismatches_checked = ctx.recorder.mismatches_checked
    junit_recorded(item, had, result)
    result.markers = added_markers(item, marked)
    result.warnings = warning_relay.unique(log.caught)
    result.sections = [
        (when, key, text) for when, key, text in getattr(item, "_report_sections", []) if key == "log" and text
    ]
    return result


def added_markers(item: pytest.Item, had: int) -> list[bytes]:
    """What the rank's fixtures and body added to the test (``request.node.add_marker(xfail)``),
    for the pytest process to judge the test by, as pytest does; one that cannot be pickled
    stays here."""
    out = []
    for mark in item.own_markers[had:]:
        with contextlib.suppress(Exception):
            out.append(pickle.dumps(mark))
    return out


def _sendable(prop: Any) -> tuple[str, Any]:
    """A recorded property the pytest process can take: junit writes its value as text."""
    name, value = prop
    return str(name), value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


@contextlib.contextmanager
def _assertion_hooks(item: pytest.Function) -> Iterator[None]:
    """What pytest's assertion plugin sets up around a test's protocol: a failed comparison
    explained (the diff, ``-vv``, the project's ``pytest_assertrepr_compare``), and
    ``pytest_assertion_pass``. The rank runs no protocol of its own, so it is set up here."""
    setup = getattr(_assertion, "pytest_runtest_protocol", None)
    hooks = setup(item) if setup is not None else None
    try:
        if hooks is not None:
            next(hooks)
    except Exception:
        hooks = None  # another pytest: the failure then shows without the comparison
    try:
        yield
    finally:
        if hooks is not None:
            hooks.close()


def _bypass_capture_when_disabled(config: pytest.Config) -> None:
    """``capsys.disabled()`` / ``capfd.disabled()`` in the body print where a plain test's
    would: on the session's own stdout, not into the rank's captured output."""
    capman = config.pluginmanager.getplugin("capturemanager")
    disabled = getattr(capman, "global_and_fixture_disabled", None)
    if disabled is None:
        return

    @contextlib.contextmanager
    def on_the_terminal() -> Iterator[None]:
        with disabled(), capture_bypassed():
            yield

    capman.global_and_fixture_disabled = on_the_terminal  # this rank's process only


@contextlib.contextmanager
def _capturing_logs(item: pytest.Function) -> Iterator[Callable[[str], None]]:
    """Logs of the rank as pytest captures a test's, phase by phase (``caplog`` reads them,
    and the report's "Captured log" sections show them): gives what begins a phase."""
    plugin = item.config.pluginmanager.get_plugin("logging-plugin")
    runtest_for = getattr(plugin, "_runtest_for", None)
    if runtest_for is None:
        yield lambda when: None
        return
    item.stash[caplog_records_key] = {}
    with contextlib.ExitStack() as phases:

        def begin(when: str) -> None:
            phases.close()  # the phase before ends: its section is written
            phases.enter_context(runtest_for(item, when))

        yield begin


def _run_body(
    item: pytest.Function, payload: ItemPayload, ctx: RankContext, log_phase: Callable[[str], None]
) -> RankResult:
    __tracebackhide__ = True  # an error here is the test's, told by the test's frames
    global in_rank
    in_rank = True
    started = time.monotonic()
    node_dir = payload.node_dirs[ctx.node_rank] if payload.node_dirs else None
    builtins: dict[str, Any] = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "recorder": ctx.recorder,
        "faults": Faults(ctx.rank, ctx.world_size, ctx.recorder, ctx.job.attempt, ctx.job.max_restarts),
        "restart_count": ctx.job.attempt,
    }
    if node_dir is not None:
        builtins["node_tmp_path"] = Path(node_dir)
    fixtures: RankFixtures | None = None
    error: BaseException | None = None
    ended_before_teardown: RankResult | None = None
    phase = "setup"
    marks: list[tuple[str, int, int]] = []  # where the body's and the teardown's output begin

    def enter(begins: str) -> None:
        """What pytest tells a plain test's code of the phase it is in."""
        livelog.phase = begins
        os.environ[CURRENT_TEST] = f"{item.nodeid} ({begins})"
        log_phase(begins)  # caplog.get_records(when), and each phase's "Captured log" section
        coverage_relay.switch_to_test_context(item.nodeid, begins)  # --cov-context=test

    def mark(begins: str) -> None:
        enter(begins)
        at = positions()
        if at is not None:
            marks.append((begins, *at))

    _lend_breakpoints(ctx)
    with ctx.measured.test_code():  # coverage: the test's own code, not the harness around it
        enter("setup")
        try:
            # unpickling may run the project's code, and so may its own seeders registered with
            # pytest-randomly
            with coverage_relay.user_code():
                values = _rebuilt(payload.values)
                if payload.instance_state is not None:
                    restore_test_state(item, payload.instance_state)
                _reseed_as_the_session(item, "setup")
            fixtures = RankFixtures(item, values, builtins, payload.dependent)
            if payload.base_tmp_path is not None:
                fixtures.set_base("tmp_path", Path(payload.base_tmp_path))
                fixtures.set_shared_folder(Path(payload.base_tmp_path))
            # a finalizer the body adds (request.addfinalizer, request.node.addfinalizer) runs
            # in the rank's teardown: pytest's own setup state never saw this item here
            # (mypy checks a method assigned on an instance against the unbound one, self included)
            item.addfinalizer = fixtures.finalizers.append  # type: ignore[method-assign,assignment]
            item.funcargs = fixtures.funcargs(payload.dependent)
            _stray_exceptions(item)
            ctx.note("setup", "ok")
            phase = "call"
            mark("call")
            _trace_body(ctx, item)
            with coverage_relay.user_code():
                _reseed_as_the_session(item, "call")
                item.ihook.pytest_pyfunc_call(pyfuncitem=item)
            _stray_exceptions(item)
            if fixtures.finalizers:  # dying in their teardown is then reported as teardown
                ctx.note("call", "passed")
        except BaseException as exc:
            error = exc
            # formatting it takes a moment: a peer's death must not cut it short
            ctx.note("setup" if phase != "call" else "call", "failed")
            if _wants_post_mortem(ctx, exc):  # --pdb opens on a fixture's error too, as pytest's does
                assert ctx.debugger is not None
                ctx.debugger.post_mortem(exc)
            with coverage_relay.user_code():  # the report calls the project's __repr__ and __str__, as pytest's
                ended_before_teardown = _told_before_teardown(item, ctx, exc, phase, started, payload.markup)
        # as pytest ends a call: what capsys/capfd captured and nobody read is the call's output
        capman = item.config.pluginmanager.getplugin("capturemanager")
        with contextlib.suppress(Exception):
            capman.deactivate_fixture()
        mark("teardown")
        teardown_errors = fixtures.teardown() if fixtures is not None else []
        try:
            _stray_exceptions(item)
        except Exception as exc:
            teardown_errors.append(exc)
    elapsed = time.monotonic() - started
    if error is None and teardown_errors:
        error, phase = teardown_errors[0], "teardown"
        teardown_errors = []
    if ended_before_teardown is not None:
        result = dataclasses.replace(ended_before_teardown, duration=elapsed)
    else:
        result = outcome_of(item, ctx.rank, error, phase, elapsed, payload.markup)
    if teardown_errors:  # as pytest: the test failed or was skipped, its teardown errs
        result.teardown_error = outcome_of(item, ctx.rank, teardown_errors[0], "teardown", elapsed, payload.markup)
    result.output_marks = marks
    result.ended_ns = time.time_ns()
    return result


def _told_before_teardown(
    item: pytest.Function, ctx: RankContext, exc: BaseException, phase: str, started: float, markup: bool
) -> RankResult:
    """How the body (or a fixture's setup) ended: failed, skipped or xfailed, written where the
    pytest process finds it before the fixtures' teardown runs, so that a rank that then dies or
    hangs there still tells it (a skip stays the test's outcome, the death an error in teardown)."""
    result = outcome_of(item, ctx.rank, exc, phase, time.monotonic() - started, markup)
    with contextlib.suppress(OSError):
        result.write(ctx.job.path(ctx.rank, BEFORE_TEARDOWN))
    return result


def _stray_exceptions(item: pytest.Function) -> None:
    """As pytest ends each phase of a plain test: an exception a thread of the rank did not
    catch, or one Python could not raise (in a ``__del__``), is a warning of the test (an
    error under ``-W error``)."""
    __tracebackhide__ = True
    for module, name in (
        ("_pytest.threadexception", "collect_thread_exception"),
        ("_pytest.unraisableexception", "collect_unraisable"),
    ):
        collect = getattr(sys.modules.get(module), name, None)
        if collect is None:
            continue
        try:
            collect(item.config)
        except KeyError:
            continue  # the plugin is off (-p no:threadexception): nothing was kept


def _rebuilt(blobs: dict[str, bytes]) -> dict[str, Any]:
    """The values of the pytest process's fixtures, unpickled in the rank; one that cannot be
    is an error naming it, shown with where its unpickling raised (not the harness's frames)."""
    __tracebackhide__ = True
    values = {}
    for name, blob in blobs.items():
        try:
            values[name] = pickle.loads(blob)
        except Exception as exc:
            raise RuntimeError(
                f"fixture {name!r} could not be rebuilt in the rank: {type(exc).__name__}: {exc}"
            ) from exc
    return values


def _reseed_as_the_session(item: pytest.Function, phase: str) -> None:
    """pytest-randomly seeds the generators of the pytest process for each phase of a test
    from the session's seed and the test's id: the rank's get the same seeds (a rank is
    forked from a process started before the test), so ``--randomly-seed`` replays it."""
    plugin = item.config.pluginmanager.get_plugin("randomly")
    reseed = getattr(plugin, f"pytest_runtest_{phase}", None)
    if reseed is not None:
        with contextlib.suppress(Exception):  # the test's own code decides its outcome
            reseed(item)


def _lend_breakpoints(ctx: RankContext) -> None:
    """``breakpoint()``, ``pytest.set_trace()`` and ``pdb.set_trace()`` in the body or in a
    rank's fixture open pdb on the pytest process's terminal (pytest's own would read the
    rank's stdin, which is no terminal)."""
    debugger = ctx.debugger
    if debugger is None:
        return

    def set_trace(*args: Any, **kwargs: Any) -> None:
        debugger.set_trace(sys._getframe(1))

    if not os.environ.get("PYTHONBREAKPOINT"):
        sys.breakpointhook = set_trace
    pdb.set_trace = set_trace  # type: ignore[assignment]
    pytest.set_trace = set_trace  # type: ignore[assignment]


def _trace_body(ctx: RankContext, item: pytest.Function) -> None:
    """``--trace``: pdb at the test's first line, on the pytest process's terminal (pytest's
    own would read the rank's stdin and pass the test as pdb quits)."""
    debugger = ctx.debugger
    if debugger is None:
        return
    if item.config.getoption("trace", False):  # no such option under -p no:debugging
        # pytest's wrapper stands aside: this one lends the terminal
        item.config.pluginmanager.unregister(name="pdbtrace")
        test_function = item.obj

        @functools.wraps(test_function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            return debugger.runcall(test_function, *args, **kwargs)

        item.obj = traced


def _wants_post_mortem(ctx: RankContext, exc: BaseException) -> bool:
    """Under --pdb: the chosen rank (--ddp-pdb-rank), else the first rank whose body failed."""
    job = ctx.job
    if not job.post_mortem or ctx.debugger is None or isinstance(exc, (Skipped, XFailed, Exit, bdb.BdbQuit)):
        return False
    if job.pdb_rank is not None:
        return ctx.rank == job.pdb_rank
    try:
        os.close(os.open(os.path.join(job.run_dir, "pdb.first"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def outcome_of(
    item: pytest.Function, rank: int, error: BaseException | None, phase: str, elapsed: float, markup: bool
) -> RankResult:
    """One rank's result for the body's exception (None: it passed), formatted by pytest."""
    if error is None:
        return RankResult(rank, "passed", duration=elapsed)
    if isinstance(error, Skipped):
        crash = ExceptionInfo.from_exception(error)._getreprcrash()
        location = (str(crash.path), crash.lineno) if crash is not None else None
        if error._use_item_location:
            path, line = item.reportinfo()[:2]
            location = (os.fspath(path), (line or 0) + 1)
        message = crash.message if crash else str(error)
        # its phase: a skip in a fixture's setup is no body's (a death after it is told so)
        return RankResult(rank, "skipped", message=message, location=location, duration=elapsed, phase=phase)
    if isinstance(error, XFailed):
        return RankResult(rank, "xfailed", message=str(error.msg), duration=elapsed, phase=phase)
    if isinstance(error, bdb.BdbQuit):  # `q` at a breakpoint: the person ended it, no traceback
        words = "the debugger was quit (q) in this rank"  # or its input ended (stdin no terminal)
        return RankResult(rank, "failed", longrepr=words + "\n", message=words, duration=elapsed, phase=phase)
    text, message, location = _render(item, error, markup)
    if isinstance(error, Exit):
        message = f"pytest.exit() in a rank: {error.msg}"
    result = RankResult(
        rank, "failed", longrepr=text, message=message, location=location, duration=elapsed, phase=phase
    )
    at = stacks.raised_in_user_code(error.__traceback__)
    result.raised_at = (at.path, at.line, at.function) if at is not None else None
    result.highlights = list(getattr(error, "highlights", None) or [])
    if isinstance(error, Exit):
        result.exit_request = (str(error.msg), error.returncode)
    result.error_class = _class_by_name(type(error))
    return result


def _class_by_name(cls: type[BaseException]) -> bytes | None:
    """The exception's class as the pytest process can import it: a class it cannot (one
    defined inside the test) travels as its nearest ancestor it can, which is what an
    ``xfail(raises=...)`` written outside the test can name."""
    for ancestor in cls.__mro__:
        try:
            blob = pickle.dumps(ancestor)
            pickle.loads(blob)
        except Exception:
            continue
        return blob
    return None
