"""``--ddp-report``: the session's multirank tests on one HTML page, and with pytest-html, the
same timeline as an extra of each failed multirank test in its ``--html`` report.

A test's view (``htmlreport.multirank_view``) travels on its report (``ddphooks_view``), so it
reaches the session's main process under xdist and from a special test's interpreter; the
page is written once, by the process that sees every report.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

from ..htmlreport import multirank_view, static_svg, write_report
from .notices import warn_never_raising
from .session import DdpSession

VIEW_ATTR = "ddphooks_view"
VIEW_KEY = pytest.StashKey[dict[str, Any]]()  # a test's view, until its next report carries it
_SEVERITY = {"passed": 0, "skipped": 1, "xfailed": 1, "failed": 2, "error": 2}


class PageHooks:
    def __init__(self, ddp: DdpSession) -> None:
        self.ddp = ddp
        self.path = ddp.settings.report
        self.views: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.written = ""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.written:  # as pytest says where its junit file went
            terminalreporter.write_sep("-", f"ddphooks report: {os.path.abspath(self.written)}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        view = getattr(report, VIEW_ATTR, None)
        if isinstance(view, dict) and report.nodeid not in self.views:
            self.views[report.nodeid] = view
            self.order.append(report.nodeid)
        view = self.views.get(report.nodeid)
        if view is None:
            return
        view["duration"] = float(view.get("duration", 0.0)) + float(report.duration or 0.0)
        outcome = _outcome(report)
        if _SEVERITY[outcome] > _SEVERITY.get(view.get("outcome") or "passed", 0) or not view.get("outcome"):
            view["outcome"] = outcome
        said = _said(report)
        if said and said not in view.get("text", ""):
            # a teardown error after a failed call (a leak) is shown too, under its phase
            view["text"] = f"{view['text']}\n\n--- {report.when} ---\n{said}" if view.get("text") else said

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.path or hasattr(session.config, "workerinput"):
            return  # an xdist worker: the main process writes the page
        if self.ddp.settings.spmd and int(os.environ.get("RANK", "0")) != 0:
            return  # under torchrun rank 0 reports every test
        views = [self.views[n] for n in self.order]
        title = f"pytest-ddphooks: {len(views)} multirank tests"
        try:
            self.written = write_report(self.path, views, title)
        except OSError as exc:
            message = f"--ddp-report: cannot write {self.path}: {type(exc).__name__}: {exc}"
            warn_never_raising(session.config, pytest.PytestWarning(message))


def _said(report: pytest.TestReport) -> str:
    """What a report says a reader should see: a failure's text, a skip's or an xfail's reason."""
    if report.failed:
        return report.longreprtext
    if hasattr(report, "wasxfail"):
        return f"xfailed: {report.wasxfail}" if report.wasxfail else "xfailed"
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return f"skipped: {report.longrepr[2].removeprefix('Skipped: ')}"
    return ""


def _outcome(report: pytest.TestReport) -> str:
    if report.failed:
        return "failed" if report.when == "call" else "error"
    if report.skipped:
        return "xfailed" if hasattr(report, "wasxfail") else "skipped"
    return "passed"


def writes_html(config: pytest.Config) -> bool:
    """pytest-html writes a report in this session (installed is not enough: ``--html``)."""
    return config.pluginmanager.hasplugin("html") and bool(config.getoption("htmlpath", None))


def attach_unrun(item: pytest.Item, report: pytest.TestReport) -> None:
    """A multirank test that ended before its ranks ran gets a view without ranks."""
    marker = item.get_closest_marker("multirank")
    if marker is None or item.get_closest_marker("special") is not None:
        return  # a special test's view comes from its own interpreter
    size = marker.kwargs.get("world_size", marker.args[0] if marker.args else 0)
    valid = isinstance(size, int) and not isinstance(size, bool) and 0 < size <= 4096  # a bad marker's: none
    attach(item, report, multirank_view(item.nodeid, None, world_size=size if valid else 0))


def attach(item: pytest.Item, report: pytest.TestReport, view: dict[str, Any]) -> None:
    """Put a test's view on its report; with pytest-html, its timeline as an extra of a failure."""
    setattr(report, VIEW_ATTR, view)
    if not report.failed or not writes_html(item.config):
        return
    with contextlib.suppress(ImportError):
        from pytest_html import extras

        # pytest-html reads an attribute that pytest's TestReport does not declare
        report.extras = [*getattr(report, "extras", []), extras.html(static_svg(view))]  # type: ignore[attr-defined]
