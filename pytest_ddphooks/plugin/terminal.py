"""pytest's terminal, where there is one: under ``-p no:terminal`` there is none, and pytest's
own accessor (``config.get_terminal_writer()``) asserts."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from ..launch import debugger


def terminal_writer(config: pytest.Config) -> Any:
    """pytest's terminal writer; None under ``-p no:terminal`` (pytest's own accessor asserts)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return getattr(reporter, "_tw", None)


def terminal_markup(config: pytest.Config) -> bool:
    """Whether the terminal takes colours (what ranks then write in their reports)."""
    writer = terminal_writer(config)
    return bool(writer is not None and writer.hasmarkup)


def lend_terminal(config: pytest.Config, who: str, path: str) -> None:
    """A process of a test (``who``: ``rank 1``) wants a debugger, listening at ``path``:
    give it this process's terminal until it is done; an xdist worker has none to give."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    try:
        if hasattr(config, "workerinput"):
            debugger.refuse(path)
            return
        writer = terminal_writer(config)
        if writer is not None:
            writer.line()
            writer.sep(">", f"{who} has the terminal")
        debugger.relay(path, sys.stdin, sys.stdout)
        if writer is not None:
            writer.line()
            writer.sep("<", f"{who} gave the terminal back")
    finally:
        if capman is not None:
            capman.resume_global_capture()
