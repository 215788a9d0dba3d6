"""The plugin's state for one pytest session, shared by its hook classes: the settings, the
session's private folder, the rank launcher, and the time limits of tests."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

from .. import coverage_relay, session_dirs
from ..launch.launcher import Launcher
from . import rankbody
from .markers import RUN_KEY, THREAD_TIMEOUT_KEY, TIMEOUT_KEY, MultirankRun, gpus
from .settings import Settings

SPECIAL_GRACE = 30.0  # a special multirank test's own watchdog reports first
TIMED_SPECIAL_GRACE = 10.0  # pytest-timeout times the test inside; this catches what it cannot stop
# in a special test's interpreter under -s: the parent's stdout, which the test prints to
LIVE_TERMINAL_KEY = pytest.StashKey[tuple[int, int]]()
COMPACT_MEMORY_RUNS = 20  # multirank runs in a session from which the fork server uses huge pages


class DdpSession:
    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.launcher: Launcher | None = None
        self._folder: str | None = None
        self._runs_folder: str | None = None
        self._coverage: dict[str, str] | None = None
        self.late_leaks: list[str] = []  # the leak guard's words for what was found after a test's report
        # the session's own stdout and stderr, taken while pytest's capture is suspended (at
        # configure): where a rank's capsys.disabled() prints when the session captures
        self._bypass = (os.dup(1), os.dup(2)) if live_terminal(config) is None else None

    def folder(self) -> str:
        """This session's private folder for run files (removed at the end of the session)."""
        if self._folder is None:
            self._folder = session_dirs.create()
        return self._folder

    def runs_folder(self) -> str:
        """Where the runs' folders go: in memory where ``session_dirs`` finds room, else in
        the session's folder (removed at the end of the session)."""
        if self._runs_folder is None:
            memory = session_dirs.memory_parent()
            self._runs_folder = session_dirs.create(memory) if memory else self.folder()
        return self._runs_folder

    def coverage_folder(self) -> str:
        return os.path.join(self.folder(), "coverage")

    def child_env(self) -> dict[str, str]:
        """What the environment of every process the plugin starts adds: the session's
        coverage configuration, when the session measures coverage."""
        if self._coverage is None:
            self._coverage = {}
            config = coverage_relay.child_config(self.coverage_folder())
            if config is not None:
                os.makedirs(self.coverage_folder(), exist_ok=True)
                self._coverage[coverage_relay.ENV] = config
                if self.config.getoption("cov_context", None) == "test":
                    # pytest-cov's per-test contexts, kept by a special test's interpreter too
                    self._coverage[coverage_relay.CONTEXT_ENV] = "test"
        return self._coverage

    def limit_of(self, run: MultirankRun) -> float:
        """A multirank test's time limit: its marker's, pytest-timeout's, or the default."""
        if run.spec.timeout is not None:
            return run.spec.timeout
        if run.timeout:
            return run.timeout
        return self.settings.timeout

    def special_limit(self, item: pytest.Item) -> float:
        """How long a special test may run in its interpreter once it started."""
        run = item.stash.get(RUN_KEY, None)
        if run is not None:
            return self.limit_of(run) + SPECIAL_GRACE
        if TIMEOUT_KEY in item.stash:
            if item.stash.get(THREAD_TIMEOUT_KEY, False):
                return item.stash[TIMEOUT_KEY]  # timed here: see TimeoutHooks.pytest_timeout_set_timer
            return item.stash[TIMEOUT_KEY] + TIMED_SPECIAL_GRACE
        return self.settings.timeout

    def gpus_missing(self, item: pytest.Item, world_size: int) -> str | None:
        """Why an nccl test of ``world_size`` ranks cannot run here (too few GPUs), or None."""
        visible = int(self.start_launcher(item.session).probe().get("cuda_devices", 0))
        if visible >= world_size:
            return None
        return f"multirank(backend='nccl') needs {gpus(world_size)}, {visible} visible"

    def start_launcher(self, session: pytest.Session, expected_runs: int = 0) -> Launcher:
        """The session's rank launcher, started at the first call (``expected_runs``: how
        many multirank runs the session holds, when known)."""
        if self.launcher is None:
            rankbody.register_items(session.items)
            self.launcher = Launcher(
                lambda job: lambda ctx: rankbody.run_in_rank(job, ctx),
                log_path=os.path.join(self.folder(), "launcher.log"),
                coverage_config=self.child_env().get(coverage_relay.ENV),
                bypass=self._bypass,
                # moving its memory into huge pages costs about 0.4 s of CPU once and saves
                # several ms per run: worth it for more than a few runs
                compact_memory=expected_runs >= COMPACT_MEMORY_RUNS,
                freeze_inherited=self.settings.freeze_inherited,
            )
            self.launcher.start()
        return self.launcher

    def running_launcher(self) -> Launcher:
        if self.launcher is None:
            raise RuntimeError("the rank launcher is not running")
        return self.launcher

    def own_processes(self) -> set[int]:
        """The harness's own processes, which the leak guard never reports."""
        return {self.launcher.pid} if self.launcher is not None else set()

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None
        for folder in (self._runs_folder, self._folder):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._folder = self._runs_folder = None
        for fd in self._bypass or ():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._bypass = None


def live_terminal(config: pytest.Config) -> tuple[int, int] | None:
    """Where ranks print their lines as they come (-s): pytest's stdout and stderr, or the
    parent's in a special test's interpreter; None when output is captured."""
    if config.getoption("capture", "fd") != "no":
        return None
    return config.stash.get(LIVE_TERMINAL_KEY, (1, 2))
