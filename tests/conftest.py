"""Shared helpers for the plugin's own tests: inner pytest sessions through pytester."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

pytest_plugins = ["pytester"]


class Ran:
    """An inner pytest run, with how long it took as seen from outside."""

    def __init__(self, result: pytest.RunResult, seconds: float) -> None:
        self.result = result
        self.seconds = seconds
        self.text = result.stdout.str()

    def outcomes(self) -> dict[str, int]:
        return self.result.parseoutcomes()

    def lines(self, *patterns: str) -> None:
        self.result.stdout.fnmatch_lines(list(patterns))

    def no_lines(self, pattern: str) -> None:
        self.result.stdout.no_fnmatch_line(pattern)


@pytest.fixture
def inner(pytester: pytest.Pytester) -> Callable[..., Ran]:
    """Write a test module and run pytest on it; ``subprocess=True`` for a fresh interpreter."""

    def run(source: str, *args: str, subprocess: bool = False, name: str = "test_inner") -> Ran:
        pytester.makepyfile(**{name: source})
        started = time.monotonic()
        if subprocess:
            result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
        else:
            result = pytester.runpytest("-p", "no:cacheprovider", *args)
        return Ran(result, time.monotonic() - started)

    return run
