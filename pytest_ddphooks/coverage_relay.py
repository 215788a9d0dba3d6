"""Coverage of the code that runs in ranks, special tests' interpreters and what they start.

When the session measures coverage (pytest-cov's ``--cov``, or ``coverage run -m pytest``),
every process the plugin starts measures itself with the same configuration and writes a
data file of its own into the session's folder; at the end of the test loop they are
combined into the session's own measurements, before pytest-cov (or ``coverage run``) saves
and reports them. Nothing needs configuring:

- a forked rank stops the measurement it inherited (its data would be the parent's) and
  starts its own, saved when the rank ends (a rank killed by the watchdog loses its own);
- a new interpreter (a special test, a rank the code under test spawns) starts measuring
  through coverage's own start-up hook (``COVERAGE_PROCESS_CONFIG``, read by the ``.pth``
  file coverage installs) and saves at exit;
- processes those fork and leave with ``os._exit`` save too (coverage's ``fork`` and
  ``_exit`` patches, in coverage 7.10 and later).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from typing import Any

ENV = "COVERAGE_PROCESS_CONFIG"


def _coverage() -> Any | None:
    return sys.modules.get("coverage")


def measuring() -> Any | None:
    """The Coverage object measuring this process, if any."""
    coverage = _coverage()
    return coverage.Coverage.current() if coverage is not None else None


def child_config(folder: str) -> str | None:
    """The configuration every process the plugin starts measures with: the session's own,
    writing parallel data files into ``folder``; None when nothing is measured."""
    cov = measuring()
    if cov is None:
        return None
    from coverage.config import CoverageConfig

    config = CoverageConfig.deserialize(cov.config.serialize())
    config.data_file = os.path.join(folder, os.path.basename(cov.config.data_file))
    config.parallel = True
    if hasattr(config, "patch"):
        config.patch = sorted({*config.patch, "_exit", "fork"} - {"subprocess", "execv"})
    return str(config.serialize())


def stop_inherited() -> None:
    """In a freshly forked rank: stop the measurement inherited from the parent (its data is
    the parent's, never written from here)."""
    cov = measuring()
    if cov is not None:
        with contextlib.suppress(Exception):
            cov._auto_save = False
            cov.stop()


_prepared: Any | None = None  # made ready once in the fork server: each rank only starts it


def prepare(config: str) -> None:
    """In the fork server: a measurement with the ranks' configuration, set up once (finding
    what to measure is most of the cost of starting one); each rank forked from here starts
    it and writes its own data file (coverage's data notices the fork)."""
    global _prepared
    if _coverage() is None:
        return
    import coverage

    try:
        cov = coverage.Coverage(config_file=coverage.control.CONFIG_DATA_PREFIX + config)
        patches = list(getattr(cov.config, "patch", []))
        if patches:
            cov.config.patch = []  # patched in the rank, where it measures, not here
        for quiet in ("_warn_no_data", "_warn_unimported_source", "_warn_preimported_source"):
            setattr(cov, quiet, False)
        cov._auto_save = False
        cov.start()
        cov.stop()
        if patches:
            cov.config.patch = patches
    except Exception:
        return  # ranks start their own, the slower way
    _prepared = cov


def start_in_rank() -> Any | None:
    """Measure the rank's test on its own (its body and its fixtures: what the test runs)."""
    if ENV not in os.environ or _coverage() is None:
        return None
    import coverage

    stop_inherited()
    if _prepared is not None:
        with contextlib.suppress(Exception):
            _prepared.start()
            return _prepared
    try:
        return coverage.process_startup(force=True)
    except TypeError:  # a coverage older than 7.10
        return coverage.process_startup()


def save(cov: Any | None) -> None:
    """Write a rank's measurements (a rank ends with ``os._exit``: nothing else would)."""
    if cov is None:
        return
    with contextlib.suppress(Exception):
        cov.stop()
        cov.save()


def combine_into_session(folder: str) -> int:
    """Combine the data files of the processes the plugin started into this process's own
    measurements; returns how many files there were."""
    cov = measuring()
    if cov is None:
        return 0
    found = glob.glob(os.path.join(folder, os.path.basename(cov.config.data_file) + ".*"))
    if found:
        cov.combine(data_paths=found, keep=False)
    return len(found)
