"""pytest's terminal, where there is one: under ``-p no:terminal`` there is none, and pytest's
own accessor (``config.get_terminal_writer()``) asserts."""

from __future__ import annotations

from typing import Any

import pytest


def terminal_writer(config: pytest.Config) -> Any:
    """pytest's terminal writer; None under ``-p no:terminal`` (pytest's own accessor asserts)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return getattr(reporter, "_tw", None)


def terminal_markup(config: pytest.Config) -> bool:
    """Whether the terminal takes colours (what ranks then write in their reports)."""
    writer = terminal_writer(config)
    return bool(writer is not None and writer.hasmarkup)
