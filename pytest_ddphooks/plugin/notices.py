"""Warnings about what a run leaves besides its outcome (a trace, the page) that never change
an outcome: under ``-W error`` or ``filterwarnings = error`` they are shown, not raised."""

from __future__ import annotations

import sys
import warnings

import pytest


def warn_at(item: pytest.Item, warning: Warning) -> None:
    """A warning about the test, shown at the test's own line."""
    path, lineno, _ = item.reportinfo()
    warnings.warn_explicit(warning, type(warning), str(path), (lineno or 0) + 1)


def warn_never_raising(config: pytest.Config, warning: Warning, item: pytest.Item | None = None) -> None:
    """``warning`` at the test's own line (``item``) or as the session's; printed instead
    where the warnings filter would make it an exception."""
    try:
        if item is not None:
            warn_at(item, warning)
        else:
            config.issue_config_time_warning(warning, stacklevel=2)
    except Warning:
        text = f"ddphooks: {type(warning).__name__}: {warning}"
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(text, yellow=True)
        else:
            sys.stderr.write(text + "\n")
