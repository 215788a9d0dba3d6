"""pytest-timeout's limit for the tests this plugin times itself (multirank tests, across their
ranks; special tests, around their interpreter): it is read here and pytest-timeout never
arms its own timer for them, in the plugin's own runs and under torchrun alike."""

from __future__ import annotations

from typing import Any

import pytest

from .markers import RUN_KEY, THREAD_TIMEOUT_KEY, TIMEOUT_KEY, is_special
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
        if thread:
            item.stash[THREAD_TIMEOUT_KEY] = True
        run = item.stash.get(RUN_KEY, None)
        if run is not None:
            run.timeout = float(settings.timeout)
        return True

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        return True if self._timed_here(item) else None
