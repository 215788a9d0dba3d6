"""How a multirank verdict reaches pytest: the exception that ends a phase, the report's
long representation (the rendered failure, at the rank's own failing line), skips at the
rank's skip, and warnings raised in other processes."""

from __future__ import annotations

import bdb
import hashlib
import os
import pickle
import re
from collections.abc import Generator

import pytest
from _pytest._code.code import ReprEntryNative, ReprExceptionInfo, ReprFileLocation, ReprTraceback
from _pytest.junitxml import xml_key
from _pytest.mark.structures import MarkDecorator
from _pytest.outcomes import Skipped
from _pytest.skipping import Xfail, evaluate_xfail_marks, xfailed_key

from .. import warning_relay
from ..failure import FAILURE, Rendered, RunFailure, Verdict, render
from ..htmlreport import multirank_view
from ..report import RunReport
from . import page
from .notices import warn_never_raising
from .settings import Settings


class MultirankFailed(Exception):
    """A multirank run failed; carries the report the user reads."""

    def __init__(self, rendered: Rendered, errors: list[type[BaseException]] | None = None) -> None:
        super().__init__(rendered.message)
        self.rendered = rendered
        # the exception classes of the failing ranks, when every one failed with an exception
        # of its own (no death, no hang): what ``xfail(raises=...)`` is checked against
        self.errors = errors or []

    def longrepr(self, item: pytest.Item) -> ReprExceptionInfo:
        r = self.rendered
        if r.location is not None:
            path, line = r.location
        else:
            fspath, lineno, _ = item.location
            path, line = str(item.config.rootpath / fspath), (lineno or 0) + 1
        lines = [ln + "\n" for ln in r.text.splitlines()]
        return ReprExceptionInfo(
            reprtraceback=ReprTraceback([ReprEntryNative(lines)], None, "native"),
            reprcrash=ReprFileLocation(path, line, r.message),
        )


class DebuggedMultirankFailed(MultirankFailed, bdb.BdbQuit):
    """A multirank failure under --pdb: a rank had the debugger already, and pytest's own
    would only show this plugin's frames."""


class RankSkipped(Skipped):
    """Every rank (or some, the rest passing) skipped; reported where the rank skipped."""

    def __init__(self, message: str, location: tuple[str, int] | None) -> None:
        super().__init__(message.removeprefix("Skipped: "))
        self.message = message
        self.location = location


def fail_with(text: str, message: str | None = None) -> MultirankFailed:
    return MultirankFailed(Rendered(message or text.splitlines()[0], text))


def run_failed(failure: RunFailure, debugging: bool = False) -> MultirankFailed:
    """The exception that ends a phase (setup, call, teardown) the run failed in."""
    errors = _rank_errors(failure)
    failed = (DebuggedMultirankFailed if debugging else MultirankFailed)(render(failure), errors)
    # what a hook matching the exception (pytest-rerunfailures' --only-rerun, a conftest's
    # errisinstance on the chain) sees: the first failing rank's own exception, as its cause
    failed.__cause__ = _first_rank_error(failure, errors)
    return failed


def raise_verdict(verdict: Verdict, debugging: bool = False) -> None:
    """End the test's call phase as the merged verdict of its ranks says."""
    if verdict.outcome == "failed" and verdict.failure is not None:
        raise run_failed(verdict.failure, debugging)
    if verdict.outcome == "xfailed":
        pytest.xfail(verdict.message)
    if verdict.outcome == "skipped":
        raise RankSkipped(verdict.message, verdict.location)


def _rank_errors(failure: RunFailure) -> list[type[BaseException]]:
    """The exception classes the root failures raised; none when any rank's story is not an
    exception of its own (a death, a hang, a desync)."""
    if failure.cause != FAILURE:
        return []
    out = []
    for rf in failure.failures:
        if rf.how == "consequence":
            continue
        if rf.how != "failed" or rf.result is None or rf.result.error_class is None:
            return []
        try:
            cls = pickle.loads(rf.result.error_class)
        except Exception:
            return []
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            return []
        out.append(cls)
    return out


def _first_rank_error(failure: RunFailure, errors: list[type[BaseException]]) -> BaseException | None:
    """An instance of the first failing rank's exception class, with its message; None when
    it cannot be made (a class whose constructor wants more than a message)."""
    root = next((rf for rf in failure.failures if rf.how == "failed" and rf.result is not None), None)
    if not errors or root is None or root.result is None:
        return None
    cls = errors[0]
    message = root.result.message
    prefix = f"{cls.__name__}: "
    text = message[len(prefix) :] if message.startswith(prefix) else message
    try:
        return cls(text)
    except Exception:
        return None


def _xfails(item: pytest.Item, verdict: Verdict) -> bool:
    """The failure is one the test's ``xfail`` expects: reported as xfailed, not as failed."""
    xfailed = item.stash.get(xfailed_key, None)
    if xfailed is None or item.config.option.runxfail or verdict.failure is None:
        return False
    return xfailed.raises is None or _xfail_reason(item, _rank_errors(verdict.failure)) is not None


def _expected_failure(item: pytest.Item, exc: MultirankFailed) -> str | None:
    """The reason of the test's ``xfail(raises=...)`` when every failing rank raised one of
    those exceptions (pytest checks ``raises`` against the exception in this process: the
    ranks' are what it means)."""
    return _xfail_reason(item, exc.errors)


def expected_by_xfail(item: pytest.Item, verdict: Verdict) -> bool:
    """The test's xfail marker (its own, or one a rank added while it ran) expects the failure
    of ``verdict``'s call, as pytest will judge it."""
    if item.config.option.runxfail or verdict.failure is None:
        return False
    # pytest evaluates a marker a rank added once the call ends, when the test had none before
    xfailed = item.stash.get(xfailed_key, None) or evaluate_xfail_marks(item)
    if xfailed is None:
        return False
    return xfailed.raises is None or _xfail_reason(item, _rank_errors(verdict.failure), xfailed) is not None


def _xfail_reason(item: pytest.Item, errors: list[type[BaseException]], xfailed: Xfail | None = None) -> str | None:
    xfailed = xfailed or item.stash.get(xfailed_key, None)
    if xfailed is None or xfailed.raises is None or item.config.option.runxfail or not errors:
        return None
    raises = xfailed.raises
    if not isinstance(raises, type | tuple):
        return None  # a RaisesExc or RaisesGroup matches the exception itself, which stayed in its rank
    return xfailed.reason if all(issubclass(cls, raises) for cls in errors) else None


def shape_report(item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> pytest.TestReport:
    view = item.stash.get(page.VIEW_KEY, None)
    if view is not None:
        del item.stash[page.VIEW_KEY]
        page.attach(item, report, view)
    elif call.when == "setup" and (report.failed or report.skipped):
        page.attach_unrun(item, report)  # no ranks ran (skipped, a fixture or marker error): still on the page
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, MultirankFailed) and report.failed:
        report.longrepr = exc.longrepr(item)
        # in any phase, as pytest checks raises= against a plain test's exception at setup or teardown too
        reason = _expected_failure(item, exc)
        if reason is not None:
            report.outcome = "skipped"
            report.wasxfail = reason
    elif isinstance(exc, RankSkipped) and report.skipped and exc.location is not None:
        report.longrepr = (exc.location[0], exc.location[1], exc.message)
    return report


class ReportHooks:
    def __init__(self, labels: bool = True) -> None:
        self.labels = labels  # whether this process labels its reports' rank sections itself

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        return shape_report(item, call, report)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, None, None]:
        # what reads a report's output as one text (junit's system-out joins every "Captured
        # stdout" section) reads each rank's lines labelled; the terminal's sections are titled.
        # Not where the report is sent on from this hook (an xdist worker, a special test's interpreter).
        labelled = _rank_labelled(report.sections) if self.labels else None
        if labelled is None:
            return (yield)
        titled, report.sections = report.sections, labelled
        try:
            return (yield)
        finally:
            report.sections = titled


_RANK_SECTION = re.compile(r"Captured (?:stdout|stderr|log) rank (\d+) (?:setup|call|teardown)")


def _rank_labelled(sections: list[tuple[str, str]]) -> list[tuple[str, str]] | None:
    """The sections with each line of a rank's output prefixed ``[rank N]``; None without any."""
    if not any(_RANK_SECTION.fullmatch(title) for title, _ in sections):
        return None
    out = []
    for title, text in sections:
        found = _RANK_SECTION.fullmatch(title)
        if found is not None:
            label = f"[rank {found.group(1)}] "
            # a line labelled already (printed so by the test) is not labelled twice
            # lines end at "\n" only, as the terminal shows them (not at a form feed or U+2028)
            pieces = text.split("\n")
            # a last line with no newline still ends: the next section's first line is another's
            lines = [piece + "\n" for piece in pieces[:-1]] + ([pieces[-1] + "\n"] if pieces[-1] else [])
            text = "".join(line if line.startswith(label) else label + line for line in lines)
        out.append((title, text))
    return out


def relay_warnings(item: pytest.Item, wires: list[warning_relay.WireWarning]) -> None:
    """Warnings another process caught for this test, once each, into this session's summary."""
    for wire in warning_relay.unique(wires):
        message = warning_relay.load(wire)
        kwargs = {"warning_message": message, "when": "runtest", "nodeid": item.nodeid, "location": None}
        item.ihook.pytest_warning_recorded.call_historic(kwargs=kwargs)


def keep_artifacts(item: pytest.Item, report: RunReport, verdict: Verdict, settings: Settings) -> None:
    """What a run leaves besides its outcome: its view for the HTML page (``--ddp-report``,
    pytest-html) and, for a failure, its timeline as a Chrome trace (``--ddp-trace-dir``)."""
    if settings.report or page.writes_html(item.config):
        item.stash[page.VIEW_KEY] = multirank_view(
            item.nodeid,
            report.timeline,
            world_size=report.world_size,
            outputs=report.outputs,
            failures={r: res.longrepr for r, res in report.results.items() if res.outcome == "failed"},
            highlights=[h for res in report.results.values() for h in res.highlights],
            started_ns=report.started_ns if report.prepared else 0,
            stopped_ns=report.stopped_at_ns,
        )
    # an error in teardown is a failed run too, also beside a failure an xfail expects
    failed = verdict.failure if verdict.failure is not None and not _xfails(item, verdict) else verdict.teardown
    if failed is not None:
        failed.trace = write_trace(item, report, settings) or failed.trace


def write_trace(item: pytest.Item, report: RunReport, settings: Settings) -> str | None:
    """A failed run's timeline as a Chrome trace under ``--ddp-trace-dir`` (with what injected
    faults did, and a killed rank's calls ending with it); the path, or None."""
    if not settings.trace_dir or report.timeline is None:
        return None
    taken = item.config.stash.setdefault(_TRACE_NAMES_KEY, {})
    target = os.path.join(settings.trace_dir, trace_file_name(item.nodeid, taken))
    notes = [
        (r, int(info["t_ns"]), f"injected fault {info.get('fault')}")
        for r, fired in sorted(report.fired.items())
        for info in fired
        if "t_ns" in info
    ]
    killed = {
        r: int(fired[-1]["t_ns"])
        for r, fired in report.fired.items()
        if fired and fired[-1].get("action") == "kill" and "t_ns" in fired[-1] and r not in report.results
    }
    try:
        return report.timeline.to_chrome_trace(target, stopped_ns=report.stopped_at_ns, notes=notes, ended=killed)
    except OSError as exc:  # the test's own failure is what the report is about
        message = f"--ddp-trace-dir: cannot write {target}: {type(exc).__name__}: {exc}"
        warn_never_raising(item.config, pytest.PytestWarning(message), item)
        return None


def safe_name(name: str) -> str:
    """A test's id as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:120]


_TRACE_NAMES_KEY = pytest.StashKey[dict[str, str]]()  # trace file name -> the test id it holds


def trace_file_name(nodeid: str, taken: dict[str, str]) -> str:
    """The trace file of a test: its id, flattened; where flattening could make two ids one
    (``[a/b]`` and ``[a_b]``, a long id cut short, ``sub/test_x.py`` and ``sub_test_x.py``,
    ``TestA::test_b`` and ``TestA_test_b``: anything but a file of the root folder and a test
    function in it), a hash of the whole id follows. Processes that share the folder (xdist's
    workers) then never write one file for two tests; ``taken`` checks it within one."""
    file, _, test = nodeid.partition("::")
    plain = f"{file}_{test}.json"
    if (
        len(plain) <= 125
        and re.fullmatch(r"[A-Za-z0-9_.-]+\.py", file)
        and re.fullmatch(r"[A-Za-z0-9_]+", test)
        and taken.get(plain, nodeid) == nodeid
    ):
        name = plain
    else:
        digest = hashlib.sha1(nodeid.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        name = f"{safe_name(nodeid)[:100]}-{digest}.json"
    taken[name] = nodeid
    return name


def relay_properties(item: pytest.Item, report: RunReport) -> None:
    """What the ranks recorded for the junit report, each distinct one once."""
    xml = item.config.stash.get(xml_key, None)
    for _, result in sorted(report.results.items()):
        for prop in result.properties:
            if prop not in item.user_properties:
                item.user_properties.append(prop)
        if xml is not None:
            for name, value in result.suite_properties:
                if (name, str(value)) not in xml.global_properties:
                    xml.add_global_property(name, value)
            if result.xml_attributes:
                reporter = xml.node_reporter(item.nodeid)
                for name, value in result.xml_attributes:
                    reporter.add_attribute(name, value)


def relay_markers(item: pytest.Item, report: RunReport) -> None:
    """Markers the ranks added to the test while it ran (an ``xfail`` added in the body makes
    it an expected failure, as in a plain test), each distinct one once."""
    # each name once: every rank adds its own copy (arguments that are objects differ by rank)
    seen = {m.name for m in item.own_markers}
    for _, result in sorted(report.results.items()):
        for blob in result.markers:
            try:
                mark = pickle.loads(blob)
            except Exception:
                continue
            if mark.name not in seen:
                seen.add(mark.name)
                item.add_marker(MarkDecorator(mark, _ispytest=True))
