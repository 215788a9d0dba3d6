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
            # the session's, from none of the user's lines (nor the plugin's): pytest records
            # it under the hooks' warnings filters and shows it in its summary
            warnings.warn_explicit(warning, type(warning), "pytest-ddphooks", 0, module="pytest_ddphooks")
    except Warning:
        text = f"ddphooks: {type(warning).__name__}: {warning}"
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            writer = getattr(reporter, "_tw", None)
            if writer is not None and writer.width_of_current_line:
                writer.line()  # not glued to the progress line
            reporter.write_line(text, yellow=True)
        else:
            sys.stderr.write(text + "\n")
