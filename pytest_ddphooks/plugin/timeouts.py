"""pytest-timeout's limit for the tests this plugin times itself (multirank tests, across their
ranks; special tests, around their interpreter): it is read here and pytest-timeout never
arms its own timer for them, in the plugin's own runs and under torchrun alike."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from .. import spmd
from . import rankbody
from .markers import FUNC_ONLY_KEY, RUN_KEY, THREAD_TIMEOUT_KEY, TIMEOUT_KEY, is_special
from .special import runs_here


class TimeoutHooks:
    @staticmethod
    def _timed_here(item: pytest.Item) -> bool:
        return (is_special(item) and not runs_here(item)) or RUN_KEY in item.stash or THREAD_TIMEOUT_KEY in item.stash

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        thread = getattr(settings, "method", None) == "thread"
        if thread and is_special(item) and runs_here(item) and RUN_KEY not in item.stash:
            # in a plain special test's own interpreter: the thread method would end it with
            # os._exit ("interpreter died: exit code 1"); the parent times it to the second
            item.stash[THREAD_TIMEOUT_KEY] = True
            return True
        if not self._timed_here(item):
            return None
        # timed here, across the ranks or around the special test's interpreter:
        # pytest-timeout never kills the pytest process for it
        item.stash[TIMEOUT_KEY] = float(settings.timeout)
        if getattr(settings, "func_only", False):
            item.stash[FUNC_ONLY_KEY] = True  # its limit is the call's only: not the fixtures'
        if thread:
            item.stash[THREAD_TIMEOUT_KEY] = True
        run = item.stash.get(RUN_KEY, None)
        if run is not None:
            run.timeout = float(settings.timeout)
        return True

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        return True if self._timed_here(item) else None

    # The ranks are timed by the run's watch; what pytest itself sets up and tears down for a
    # multirank test in this process (its pytest-side fixtures) is timed here, as pytest-timeout
    # would time it for a plain test: a fixture that hangs there must not hang the session.
    # (trylast: inside the plugin's own wrappers, so the ranks' start and end are never cut.)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        with _limited(item, "setup"):
            return (yield)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        __tracebackhide__ = True  # what fails inside is the test's, not this hook's
        with _limited(item, "teardown"):
            return (yield)


def pytest_side_limit(item: pytest.Item) -> tuple[float, str] | None:
    """The limit of a multirank test's pytest-side setup and teardown, and whose it is: the one
    a user set for the test (pytest-timeout's, the marker's ``timeout=``); None without one
    (a session fixture's slow first setup fails no test the user never limited)."""
    run = item.stash.get(RUN_KEY, None)
    if run is None or rankbody.in_rank or (is_special(item) and not runs_here(item)):
        return None
    if item.stash.get(FUNC_ONLY_KEY, False):
        return None
    if TIMEOUT_KEY in item.stash and item.stash[TIMEOUT_KEY] > 0:
        return item.stash[TIMEOUT_KEY], "pytest-timeout"
    if run.spec.timeout is not None:
        return float(run.spec.timeout), f"multirank(timeout={run.spec.timeout:g})"
    return None


@contextlib.contextmanager
def _limited(item: pytest.Item, phase: str) -> Iterator[None]:
    limit = pytest_side_limit(item)
    if (
        limit is None
        or not hasattr(signal, "SIGALRM")
        or threading.current_thread() is not threading.main_thread()
        or signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0)  # the alarm is someone else's now
    ):
        yield
        return
    seconds, whose = limit
    # under torchrun this pytest process is a rank, and every fixture runs here
    where = f"on rank {os.environ.get('RANK', '?')}" if spmd.launched() else "that run in the pytest process"

    def expired(signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        pytest.fail(
            f"Timeout (>{seconds}s) from {whose}, in the {phase} of this multirank test's fixtures {where}",
            pytrace=True,
        )

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    armed = time.monotonic()
    try:
        yield
    finally:
        left, interval = signal.getitimer(signal.ITIMER_REAL)
        ours = interval == 0 and abs(left - (seconds - (time.monotonic() - armed))) < 0.05
        if signal.getsignal(signal.SIGALRM) is expired:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        elif ours:  # a fixture set its own handler but no timer: ours must not call it later
            signal.setitimer(signal.ITIMER_REAL, 0)
        # else a fixture took the alarm over (its handler, its timer): both stay its own
