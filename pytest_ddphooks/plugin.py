"""pytest hooks of pytest-ddphooks: options, markers, fixtures, wrapping multirank items.

Everything that is not about pytest lives in the core (``launch``, ``hangs``, ``recorder``,
``verdict``); this module only connects it to pytest's hooks.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _pytest._code.code import (
    ReprEntryNative,
    ReprExceptionInfo,
    ReprFileLocation,
    ReprTraceback,
)
from _pytest.outcomes import Skipped

from . import rankbody, rankfixtures, session_dirs, spmd
from .launch.job import Job
from .launch.run import remove_run_dir, run_job
from .launch.zygote import Launcher
from .leaks import Leak, LeakGuard
from .plugin_leaks import ALLOW_HELP, RANK_LEAKS_KEY, LeakHooks
from .plugin_special import (
    SpecialChildHooks,
    SpecialHooks,
    SpecialTargetHooks,
    is_special,
    relay_warnings,
    reports_to_parent,
    runs_here,
    special_basetemp,
    special_target,
)
from .plugin_spmd import SpmdHooks
from .recorder import NeverWaitedWarning, Recorder, distpatch
from .spec import MAX_SECONDS, MultirankSpec, SpecError, parse_multirank
from .verdict import Verdict, decide

# Before any conftest imports torch: torch.distributed is patched as it loads. It is then
# imported here, in every pytest process: pytester's in-process runs drop the modules an inner
# session imported, and a second import of torch in one process crashes it; imported by the
# outer session, torch survives every inner one.
distpatch.install()
import torch.distributed  # noqa: E402, F401

DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = MAX_SECONDS
MULTIRANK_HELP = (
    "multirank(world_size=2, *, backend='gloo', nodes=1, timeout=None, init_process_group=True):"
    " run the test body on world_size fresh rank processes joined in one process group"
)
SPECIAL_HELP = "special: run this test in a fresh Python interpreter of its own"


@dataclass
class MultirankRun:
    """What collection decided for one multirank item."""

    spec: MultirankSpec
    world_size: int
    dependent: set[str] = field(default_factory=set)
    timeout: float | None = None  # pytest-timeout's value, when it times this test


RUN_KEY = pytest.StashKey[MultirankRun]()
TIMEOUT_KEY = pytest.StashKey[float]()  # pytest-timeout's value for a test we time ourselves


class MultirankFailed(Exception):
    """The multirank run failed; carries the report the user reads."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict

    def longrepr(self, item: pytest.Item) -> ReprExceptionInfo:
        v = self.verdict
        if v.location is not None:
            path, line = v.location
        else:
            fspath, lineno, _ = item.location
            path, line = str(item.config.rootpath / fspath), (lineno or 0) + 1
        lines = [ln + "\n" for ln in v.text.splitlines()]
        return ReprExceptionInfo(
            reprtraceback=ReprTraceback([ReprEntryNative(lines)], None, "native"),
            reprcrash=ReprFileLocation(path, line, v.message),
        )


class RankSkipped(Skipped):
    """Every rank (or some, the rest passing) skipped; reported where the rank skipped."""

    def __init__(self, message: str, location: tuple[str, int] | None) -> None:
        super().__init__(message.removeprefix("Skipped: "))
        self.message = message
        self.location = location


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddphooks", "pytest-ddphooks (distributed hook ordering)")
    group.addoption(
        "--ddp-timeout",
        dest="ddp_timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"time limit of a multirank test across its ranks (ini ddp_timeout; default {DEFAULT_TIMEOUT:g}).",
    )
    parser.addini("ddp_timeout", "time limit of a multirank test, in seconds", default=str(DEFAULT_TIMEOUT))
    group.addoption(
        "--ddp-leaks",
        dest="ddp_leaks",
        choices=("fail", "warn", "off"),
        default=None,
        help="what a test that leaks a process group, process, thread, socket or distributed"
        " environment variable gets: fail (default), warn, off (ini ddp_leaks).",
    )
    parser.addini("ddp_leaks", "fail | warn | off: what a leaking test gets", default="fail")
    parser.addini(
        "ddp_leaks_allow",
        "known long-lived things the leak guard ignores, one per line: thread:NAME-GLOB,"
        " process:CMDLINE-GLOB, socket:HOST:PORT-GLOB, env:NAME, group:NAME",
        type="linelist",
        default=[],
    )
    group.addoption(
        "--ddp-trace-dir",
        dest="ddp_trace_dir",
        default=None,
        metavar="DIR",
        help="write the recorded timeline of each failed multirank test there as Chrome trace"
        " JSON (ini ddp_trace_dir).",
    )
    parser.addini("ddp_trace_dir", "folder for Chrome traces of failed multirank tests", default="")
    parser.addini(
        "ddp_preload",
        "modules the warm launcher imports before it forks ranks, one per line (torch and"
        " torch.distributed always): what every rank would otherwise import anew, e.g. torch._dynamo",
        type="linelist",
        default=[],
    )
    group.addoption(
        "--ddp-spmd",
        dest="ddp_spmd",
        choices=("auto", "on", "off"),
        default=None,
        help="run the session on the ranks torchrun launched: auto (when torchrun's environment is"
        " there, default), on, off (ini ddp_spmd).",
    )
    parser.addini("ddp_spmd", "auto | on | off: torchrun (SPMD) mode", default="auto")
    group.addoption(
        "--ddp-plain-tests",
        dest="ddp_plain_tests",
        choices=("rank0", "all"),
        default=None,
        help="under torchrun, where plain (non-multirank) tests run: rank0 (default) or all ranks"
        " (ini ddp_plain_tests).",
    )
    parser.addini("ddp_plain_tests", "rank0 | all: where plain tests run under torchrun", default="rank0")
    group.addoption(
        "--ddp-verbose-ranks",
        dest="ddp_verbose_ranks",
        action="store_true",
        default=False,
        help="under torchrun, let every rank print its terminal report (default: rank 0 only).",
    )


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MULTIRANK_HELP)
    config.addinivalue_line("markers", SPECIAL_HELP)
    config.addinivalue_line("markers", ALLOW_HELP)
    if config.pluginmanager.is_blocked("ddphooks"):
        return
    if not config.pluginmanager.has_plugin("ddphooks-session"):
        basetemp = special_basetemp()
        if basetemp is not None:
            config.option.basetemp = basetemp
        hooks = DdpHooks(config)
        hooks.default_timeout()  # a bad limit stops the run here, once
        hooks.preload()
        mode = config.getoption("ddp_spmd") or config.getini("ddp_spmd")
        if mode not in ("auto", "on", "off"):
            raise pytest.UsageError(f"ini ddp_spmd = {mode}: use auto, on or off")
        if mode == "on" and not spmd.launched():
            raise pytest.UsageError(
                "--ddp-spmd=on needs the environment torchrun gives its ranks (RANK, WORLD_SIZE, MASTER_ADDR,"
                " MASTER_PORT, TORCHELASTIC_RUN_ID): run the session under torchrun, or leave --ddp-spmd=auto"
            )
        session_dirs.remove_stale()
        config.pluginmanager.register(hooks, "ddphooks-session")
        if mode == "on" or (mode == "auto" and spmd.launched()):
            hooks.spmd = SpmdHooks(config, RUN_KEY, hooks.timeout_of, hooks.raise_verdict)
            config.pluginmanager.register(hooks.spmd, "ddphooks-spmd")
        guard = LeakGuard(own_processes=hooks.own_processes)
        config.pluginmanager.register(LeakHooks(config, guard), "ddphooks-leaks")
        config.pluginmanager.register(SpecialHooks(config, hooks.folder, hooks.special_limit), "ddphooks-special")
        target = special_target()
        if target is not None:
            config.pluginmanager.register(SpecialTargetHooks(target), "ddphooks-special-target")
            if reports_to_parent():
                config.pluginmanager.register(SpecialChildHooks(config), "ddphooks-special-child")


# -- fixtures --------------------------------------------------------------------------------
# In a multirank test these are resolved inside each rank; the bodies below serve plain tests.


@pytest.fixture
def rank() -> int:
    """This process's global rank (0 outside a multirank test)."""
    return int(os.environ.get("RANK", 0))


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The number of ranks of the test (1 outside a multirank test)."""
    run = request.node.stash.get(RUN_KEY, None)
    if run is not None:
        return run.world_size
    return int(os.environ.get("WORLD_SIZE", 1))


def _spmd_for(request: pytest.FixtureRequest) -> SpmdHooks | None:
    """The torchrun coordination, when this multirank test runs on launched ranks."""
    hooks = request.config.pluginmanager.get_plugin("ddphooks-session")
    if isinstance(hooks, DdpHooks) and hooks.spmd is not None and RUN_KEY in request.node.stash:
        return hooks.spmd
    return None


@pytest.fixture
def recorder(request: pytest.FixtureRequest) -> Generator[Recorder, None, None]:
    """Records hooks, barriers, marks and torch.distributed calls; ``timeline()`` merges ranks."""
    spmd = _spmd_for(request)
    rec = Recorder(exchange=spmd.exchange if spmd is not None else None).activate()
    yield rec
    rec.close()


@pytest.fixture
def shared_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """One folder every rank sees (the same as ``tmp_path``; rank 0's under torchrun)."""
    spmd = _spmd_for(request)
    if spmd is None:
        return tmp_path
    return Path(spmd.coord.all_gather("shared-dir", str(tmp_path).encode(), spmd.start_timeout)[0].decode())


@pytest.fixture
def node_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """One folder per simulated node (``tmp_path`` itself outside a multirank test; under
    torchrun the folder of the node's local rank 0)."""
    spmd = _spmd_for(request)
    if spmd is None:
        return tmp_path
    dirs = spmd.coord.all_gather("node-dir", str(tmp_path).encode(), spmd.start_timeout)
    first_of_node = (spmd.rank // spmd.local_world_size) * spmd.local_world_size
    return Path(dirs[first_of_node].decode())


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:120]


class DdpHooks:
    """The plugin's per-session state and its runtime hooks."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.launcher: Launcher | None = None
        self.session_dir: str | None = None
        self._ids = itertools.count(1)
        self.spmd: SpmdHooks | None = None
        self._default_timeout: float | None = None

    def folder(self) -> str:
        """This session's private folder for run files (removed at the end of the session)."""
        if self.session_dir is None:
            self.session_dir = session_dirs.create()
        return self.session_dir

    def special_limit(self, item: pytest.Item) -> float:
        """How long a special test may run in its interpreter once it started."""
        run = item.stash.get(RUN_KEY, None)
        if run is not None:
            return self.timeout_of(run) + 30.0  # the child's own watchdog reports first
        if TIMEOUT_KEY in item.stash:
            # pytest-timeout times the test in the child; this only catches what it cannot stop
            return item.stash[TIMEOUT_KEY] + 10.0
        return self.default_timeout()

    def preload(self) -> None:
        """Import ini ddp_preload now, in the pytest process: the launcher forked from it has
        them, and so has every rank. (Now rather than at the fork, so that pytester's inner
        sessions, which drop what they imported, never import them a second time.)"""
        for name in self.config.getini("ddp_preload"):
            try:
                importlib.import_module(name)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                raise pytest.UsageError(f"ini ddp_preload: cannot import {name!r}: {why}") from None

    def own_processes(self) -> set[int]:
        """The harness's own processes, which the leak guard never reports."""
        return {self.launcher.pid} if self.launcher is not None else set()

    # -- options ------------------------------------------------------------------------------

    def default_timeout(self) -> float:
        """The default time limit, read and checked once: a bad value stops the run at start."""
        if self._default_timeout is None:
            value = self.config.getoption("ddp_timeout")
            where = f"--ddp-timeout={value}"
            if value is None:
                raw = self.config.getini("ddp_timeout")
                where = f"ini ddp_timeout = {raw}"
                try:
                    value = float(raw)
                except ValueError:
                    raise pytest.UsageError(f"{where}: not a number of seconds") from None
            if not math.isfinite(value) or value <= 0 or value > MAX_TIMEOUT:
                raise pytest.UsageError(
                    f"{where}: the time limit must be a number of seconds > 0 and <= {MAX_TIMEOUT:g}"
                )
            self._default_timeout = float(value)
        return self._default_timeout

    def trace_dir(self) -> str | None:
        value = self.config.getoption("ddp_trace_dir") or self.config.getini("ddp_trace_dir")
        return str(value) if value else None

    # -- collection ---------------------------------------------------------------------------

    @staticmethod
    def _spec(nodeid: str, marker: pytest.Mark) -> MultirankSpec:
        try:
            return parse_multirank(marker.args, marker.kwargs)
        except SpecError as exc:
            raise pytest.Collector.CollectError(f"{nodeid}: @pytest.mark.multirank: {exc}") from None

    @pytest.hookimpl(trylast=True)
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        marker = metafunc.definition.get_closest_marker("multirank")
        if marker is None:
            return
        spec = self._spec(metafunc.definition.nodeid, marker)
        if spec.many:
            if "world_size" not in metafunc.fixturenames:
                metafunc.fixturenames.append("world_size")
            metafunc.parametrize("world_size", list(spec.world_sizes), ids=[str(n) for n in spec.world_sizes])

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        for item in items:
            marker = item.get_closest_marker("multirank")
            if marker is None:
                continue
            if not isinstance(item, pytest.Function) or type(item).__name__ == "TestCaseFunction":
                item.add_marker(
                    pytest.mark.skip(reason="multirank runs pytest test functions only, not unittest or other items")
                )
                continue
            spec = self._spec(item.nodeid, marker)
            size = spec.world_sizes[0]
            callspec = getattr(item, "callspec", None)
            if spec.many and callspec is not None and "world_size" in callspec.params:
                size = int(callspec.params["world_size"])
            dependent = rankfixtures.rank_dependent(item)
            if self.spmd is None:  # under torchrun the pytest process is a rank: nothing moves
                rankfixtures.prune(item, dependent)
            item.stash[RUN_KEY] = MultirankRun(spec, size, dependent)
        if self.spmd is not None:
            self.spmd.select(items)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        # Forked here: every test module is imported, no test has run yet. Collection
        # errors stop the session before this point, so bad input never spawns anything.
        if session.config.option.collectonly or self.spmd is not None:
            return
        if any(RUN_KEY in item.stash and (runs_here(item) or not is_special(item)) for item in session.items):
            self._start_launcher(session)

    def _start_launcher(self, session: pytest.Session) -> None:
        if self.launcher is not None:
            return
        rankbody.register_items(session.items)
        self.launcher = Launcher(
            lambda job: lambda ctx: rankbody.run_in_rank(job, ctx),
            log_path=os.path.join(self.folder(), "launcher.log"),
        )
        self.launcher.start()

    # -- running ------------------------------------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def _timed_here(self, item: pytest.Item) -> bool:
        if is_special(item) and not runs_here(item):
            return True
        return RUN_KEY in item.stash

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        if not self._timed_here(item):
            return None
        # timed here, across the ranks or around the special test's interpreter:
        # pytest-timeout never kills the pytest process for it
        item.stash[TIMEOUT_KEY] = float(settings.timeout)
        run = item.stash.get(RUN_KEY, None)
        if run is not None:
            run.timeout = float(settings.timeout)
        return True

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        return True if self._timed_here(item) else None

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        run = item.stash.get(RUN_KEY, None)
        if run is None or run.spec.backend != "nccl":
            return
        self._start_launcher(item.session)
        assert self.launcher is not None
        visible = int(self.launcher.probe().get("cuda_devices", 0))
        if visible < run.world_size:
            pytest.skip(f"multirank(backend='nccl') needs {run.world_size} GPUs, {visible} visible")

    def timeout_of(self, run: MultirankRun) -> float:
        if run.spec.timeout is not None:
            return run.spec.timeout
        if run.timeout:
            return run.timeout
        return self.default_timeout()

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        run = pyfuncitem.stash.get(RUN_KEY, None)
        if run is None or rankbody.in_rank or self.spmd is not None:
            return None
        self._run(pyfuncitem, run)
        return True

    def _node_dirs(self, item: pytest.Function, run: MultirankRun) -> list[str]:
        if "node_tmp_path" not in run.dependent:
            return []
        factory = item._request.getfixturevalue("tmp_path_factory")
        base = _safe(item.name)[:30]
        return [str(factory.mktemp(f"{base}-node{k}", numbered=True)) for k in range(run.spec.nodes)]

    def _run(self, item: pytest.Function, run: MultirankRun) -> None:
        self._start_launcher(item.session)
        assert self.launcher is not None
        try:
            names = rankfixtures.needed_values(item, run.dependent)
            values = rankfixtures.pickle_values(item, names)
            instance = rankfixtures.pickle_instance(item)
        except rankfixtures.FixtureNotSendable as exc:
            raise MultirankFailed(Verdict("failed", str(exc), str(exc))) from None
        markup = bool(self.config.get_terminal_writer().hasmarkup)
        payload = rankbody.ItemPayload(item.nodeid, values, instance, self._node_dirs(item, run), markup)
        test_id = f"{os.getpid()}-{next(self._ids)}"
        run_dir = os.path.join(self.folder(), f"run-{test_id}")
        os.mkdir(run_dir)
        job = Job(
            test_id=test_id,
            label=item.nodeid,
            world_size=run.world_size,
            nodes=run.spec.nodes,
            backend=run.spec.backend,
            init_process_group=run.spec.init_process_group,
            timeout=self.timeout_of(run),
            run_dir=run_dir,
            env=dict(os.environ),
            cwd=os.getcwd(),
            payload=pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL),
        )
        report = run_job(self.launcher, job)
        relay_warnings(item, [w for _, res in sorted(report.results.items()) for w in res.warnings])
        verdict = decide(report)
        if report.timeline is not None and verdict.outcome == "passed":
            path, lineno, _ = item.reportinfo()
            for text in report.timeline.never_waited():
                warnings.warn_explicit(NeverWaitedWarning(text), NeverWaitedWarning, str(path), (lineno or 0) + 1)
        capture = self.config.getoption("capture", "fd")
        for r, (out, err) in sorted(report.outputs.items()):
            if capture == "no":
                for line in out.splitlines():
                    print(f"[rank {r}] {line}")
                for line in err.splitlines():
                    print(f"[rank {r} stderr] {line}")
                continue
            if out:
                item.add_report_section("call", f"stdout rank {r}", out)
            if err:
                item.add_report_section("call", f"stderr rank {r}", err)
        leaked = [
            Leak("process", cmd, f"rank {r} left process {pid} running (killed): {cmd}")
            for r, res in sorted(report.results.items())
            for pid, cmd in res.leaks
        ]
        leaked.extend(
            Leak("process", cmd, f"process {pid} started by a rank outlived it: {cmd} (killed)")
            for pid, cmd in report.swept
        )
        if leaked:
            item.stash[RANK_LEAKS_KEY] = leaked
        if verdict.outcome == "failed":
            trace_dir = self.trace_dir()
            if trace_dir and report.timeline is not None:
                target = os.path.join(trace_dir, _safe(item.nodeid) + ".json")
                try:
                    path = report.timeline.to_chrome_trace(target)
                except OSError as exc:  # the test's own failure is what the report is about
                    where, lineno, _ = item.reportinfo()
                    message = f"--ddp-trace-dir: cannot write {target}: {type(exc).__name__}: {exc}"
                    warnings.warn_explicit(
                        pytest.PytestWarning(message), pytest.PytestWarning, str(where), (lineno or 0) + 1
                    )
                else:
                    verdict.text += f"\n\nChrome trace of the timeline: {path}"
        remove_run_dir(job)
        self.raise_verdict(verdict)

    @staticmethod
    def raise_verdict(verdict: Verdict) -> None:
        """End the test's call phase as the merged verdict of its ranks says."""
        if verdict.outcome == "failed":
            raise MultirankFailed(verdict)
        if verdict.outcome == "xfailed":
            pytest.xfail(verdict.message)
        if verdict.outcome == "skipped":
            raise RankSkipped(verdict.message, verdict.location)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        exc = call.excinfo.value if call.excinfo is not None else None
        if isinstance(exc, MultirankFailed) and report.failed:
            report.longrepr = exc.longrepr(item)
        elif isinstance(exc, RankSkipped) and report.skipped and exc.location is not None:
            report.longrepr = (exc.location[0], exc.location[1], exc.message)
        return report

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None
        if self.session_dir is not None:
            shutil.rmtree(self.session_dir, ignore_errors=True)
            self.session_dir = None
