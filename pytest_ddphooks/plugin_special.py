"""``@pytest.mark.special``: the test runs in a fresh interpreter; its reports come back here.

The parent replaces the test's run protocol: it starts ``python -m pytest`` on the test's
file with the session's own options (minus what would collide: selection, xdist, the cache,
the temporary and junit folders), restricted to this one test. The child relays each of its
reports; the parent hands them to its own hooks, so the terminal summary, ``-rA``,
``--junitxml``, ``--lf`` and xdist see them as they see any test. A child that crashes or
hangs is reported as a failure with its exit status or stack and whatever it printed.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import IO, Any

import pytest
from _pytest.reports import TestReport
from _pytest.runner import CallInfo

from . import hangs
from .launch.rendezvous import DIST_ENV
from .special import IsolatedRun, run_isolated

TARGET_ENV = "DDPHOOKS_SPECIAL_NODEID"


def is_special(item: pytest.Item) -> bool:
    return item.get_closest_marker("special") is not None


def runs_here(item: pytest.Item) -> bool:
    """True in the interpreter made for this very test."""
    return os.environ.get(TARGET_ENV) == item.nodeid


def child_command(config: pytest.Config, item: pytest.Item, folder: str) -> list[str]:
    positional = {str(a) for a in (config.option.file_or_dir or [])}
    args = [a for a in config.invocation_params.args if str(a) not in positional]
    args += [f"--rootdir={config.rootpath}", f"--basetemp={os.path.join(folder, 'basetemp')}", "--color=no"]
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
    if getattr(config.option, "xmlpath", None):
        args += [f"--junit-xml={os.path.join(folder, 'junit.xml')}"]
    args.append(str(item.path))
    return [sys.executable, "-m", "pytest", *args]


def _report(
    item: pytest.Item, when: str, outcome: str, text: str, sections: list[tuple[str, str]], duration: float
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


class SpecialHooks:
    """Parent side: run special tests in their own interpreter and relay their reports."""

    def __init__(self, config: pytest.Config, folder: Callable[[], str], limit: Callable[[pytest.Item], float]) -> None:
        self.config = config
        self._folder = folder
        self._limit = limit

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if not is_special(item) or runs_here(item):
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in self._run(item):
            ihook.pytest_runtest_logreport(report=report)
        # the parent's fixture stack must still end where the next test expects it
        call = CallInfo.from_call(lambda: item.session._setupstate.teardown_exact(nextitem), when="teardown")
        if call.excinfo is not None:
            ihook.pytest_runtest_logreport(report=TestReport.from_item_and_call(item, call))
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _run(self, item: pytest.Item) -> list[TestReport]:
        folder = tempfile.mkdtemp(prefix="special-", dir=self._folder())
        tmp = os.path.join(folder, "tmp")
        os.mkdir(tmp)
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}  # one plain process
        env.update({TARGET_ENV: item.nodeid, "TMPDIR": tmp})
        limit = self._limit(item)
        run = run_isolated(
            child_command(self.config, item, folder), env, str(self.config.invocation_params.dir), folder, limit
        )
        reports = []
        for message in run.messages:
            if message.get("event") == "report":
                rep = self.config.hook.pytest_report_from_serializable(config=self.config, data=message["report"])
                if isinstance(rep, TestReport):
                    rep.nodeid = item.nodeid
                    reports.append(rep)
        problem = self._problem(item, run, limit)
        if problem is not None:
            sections = [
                (f"Captured {name} of the special test's interpreter", text)
                for name, text in (("stdout", run.stdout), ("stderr", run.stderr))
                if text.strip()
            ]
            when = "call"
            if not any(r.when == "setup" for r in reports):
                reports.append(_report(item, "setup", "passed", "", [], 0.0))
            reports = [r for r in reports if r.when == "setup"]
            reports.append(_report(item, when, "failed", problem, sections, run.duration))
            reports.append(_report(item, "teardown", "passed", "", [], 0.0))
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        return reports

    @staticmethod
    def _problem(item: pytest.Item, run: IsolatedRun, limit: float) -> str | None:
        """Why the child's own reports are not the whole story, or None when they are."""
        for message in run.messages:
            if message.get("event") == "collect-error":
                return "the special test's file failed to collect in its own interpreter:\n" + message.get(
                    "longrepr", ""
                )
        if run.timed_out:
            lines = [
                f"special test did not finish within {limit:g} s"
                if run.started
                else f"the special test's interpreter did not start the test within {limit:g} s",
                "its interpreter was killed, with every process it started",
            ]
            if run.stacks is not None:
                for thread in run.stacks.threads:
                    frame = hangs.user_frame(thread)
                    if frame is not None:
                        lines.append(
                            f"stuck at {hangs._rel(frame.path)}:{frame.line} in {frame.function}: {frame.source()}"
                        )
                        break
                for thread in run.stacks.threads:
                    lines.append("")
                    lines.extend(hangs.format_stack(thread, f"thread 0x{thread.ident:x}"))
            return "\n".join(lines)
        whens = {m["report"].get("when") for m in run.messages if m.get("event") == "report"}
        if "teardown" in whens:
            return None
        if not any(m.get("event") == "start" for m in run.messages) and run.code == 0:
            return "the special test was not collected in its own interpreter (was it deselected there?)"
        lines = [f"the special test's interpreter died: {run.describe_exit()}"]
        fatal = hangs.fatal_error(run.stderr)
        lines.extend(fatal)
        if not fatal and run.stderr.strip():
            tail = run.stderr.rstrip().splitlines()[-25:]
            lines.append("last output on stderr:")
            lines.extend("  " + ln for ln in tail)
        return "\n".join(lines)


class SpecialChildHooks:
    """Child side: run only the target test and write every report for the parent."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.target = os.environ[TARGET_ENV]
        self._out: IO[str] = open(os.environ["DDPHOOKS_CHILD_MESSAGES"], "a", encoding="utf-8")  # noqa: SIM115
        self._stacks = open(os.environ["DDPHOOKS_CHILD_STACKS"], "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True, chain=False)

    def _write(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep = [i for i in items if i.nodeid == self.target]
        drop = [i for i in items if i.nodeid != self.target]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._write({"event": "collect-error", "longrepr": str(report.longrepr)})

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        if nodeid == self.target:
            self._write({"event": "start"})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid == self.target:
            data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
            self._write({"event": "report", "report": data})

    def pytest_unconfigure(self) -> None:
        faulthandler.unregister(signal.SIGUSR1)
        self._out.close()
        self._stacks.close()
