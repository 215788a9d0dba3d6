"""The pytest layer of pytest-ddphooks: the only code that imports pytest.

This module is what pytest loads (through the ``ddphooks`` entry point, or
``pytest_plugins = ["pytest_ddphooks.plugin"]`` in a conftest). It declares the options and
markers, builds the session's validated ``Settings`` once, and registers the hook classes,
each one concern: markers (collection), multirank (running tests on ranks), reports,
leaks, special tests, and the torchrun mode.
"""

from __future__ import annotations

import pytest

from .. import session_dirs
from ..recorder import distpatch
from . import special
from .coverage import CoverageHooks, hand_over_after_hang, report_after_hang
from .fixtures import faults, node_tmp_path, rank, recorder, restart_count, shared_tmp_path, world_size
from .leaks import ALLOW_HELP, LeakHooks
from .markers import MULTIRANK_HELP, SPECIAL_HELP, MarkerHooks
from .multirank import MultirankHooks
from .options import add_options
from .page import PageHooks
from .reports import ReportHooks
from .session import DdpSession
from .settings import Settings
from .spmd import SpmdHooks, SpmdPhases
from .timeouts import TimeoutHooks

# Before any conftest imports torch: torch.distributed is patched as it loads.
distpatch.install()

SESSION_NAME = "ddphooks-session"
BLOCKED_BUT_NAMED = (
    "-p no:ddphooks turns pytest-ddphooks off, but it is also loaded as pytest_ddphooks.plugin"
    " (pytest_plugins in a conftest, or -p): add -p no:pytest_ddphooks.plugin to turn it off there too"
)
__all__ = ["faults", "node_tmp_path", "rank", "recorder", "restart_count", "shared_tmp_path", "world_size"]


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    for line in (MULTIRANK_HELP, SPECIAL_HELP, ALLOW_HELP):
        config.addinivalue_line("markers", line)
    if special.reports_to_parent() and not config.pluginmanager.hasplugin("rerunfailures"):
        # the parent session reruns the test (the child runs without pytest-rerunfailures):
        # its marker stays known under --strict-markers
        config.addinivalue_line("markers", "flaky: rerun by the session that started this interpreter")
    if not _hands_tests_to_workers(config):
        # imported by the outer session of a process: pytester's in-process runs drop the
        # modules an inner session imported, and a second import of torch in one process
        # crashes it; imported by the outer session, torch survives every inner one
        import torch.distributed  # noqa: F401
    if config.pluginmanager.is_blocked("ddphooks"):
        # blocked, yet loaded under its module's name: half of it (fixtures, no hooks) would
        # run multirank tests as plain ones
        raise pytest.UsageError(BLOCKED_BUT_NAMED)
    if config.pluginmanager.has_plugin(SESSION_NAME):
        return
    settings = Settings.from_config(config)  # a bad value stops the run here, once
    settings.import_preload()
    basetemp = special.special_basetemp()
    if basetemp is not None:
        config.option.basetemp = basetemp
    session_dirs.remove_stale()
    ddp = DdpSession(config, settings)
    config.pluginmanager.register(ddp, SESSION_NAME)
    config.pluginmanager.register(MarkerHooks(settings.spmd), "ddphooks-markers")
    # an xdist worker sends its reports on (its controller labels them), and so does a special
    # test's interpreter (its parent does)
    labels = not hasattr(config, "workerinput") and not (special.special_target() and special.reports_to_parent())
    config.pluginmanager.register(ReportHooks(labels), "ddphooks-reports")
    config.pluginmanager.register(TimeoutHooks(), "ddphooks-timeouts")
    spmd_hooks = SpmdHooks(ddp) if settings.spmd else None
    if spmd_hooks is not None:
        spmd_hooks.hand_over_at_hang, spmd_hooks.report_at_hang = hand_over_after_hang, report_after_hang
        config.pluginmanager.register(spmd_hooks, SpmdHooks.NAME)
    else:
        config.pluginmanager.register(MultirankHooks(ddp), "ddphooks-multirank")
    config.pluginmanager.register(LeakHooks(ddp), "ddphooks-leaks")
    config.pluginmanager.register(CoverageHooks(ddp), "ddphooks-coverage")
    if settings.report:
        config.pluginmanager.register(PageHooks(ddp), "ddphooks-page")
    config.pluginmanager.register(special.SpecialHooks(ddp), "ddphooks-special")
    if spmd_hooks is not None:
        # registered last: around every other setup and teardown hook (the leak guard's too)
        config.pluginmanager.register(SpmdPhases(spmd_hooks), "ddphooks-spmd-phases")
    target = special.special_target()
    if target is not None:
        config.pluginmanager.register(special.SpecialTargetHooks(target), "ddphooks-special-target")
        if special.reports_to_parent():
            config.pluginmanager.register(special.SpecialChildHooks(config), special.SPECIAL_CHILD_NAME)


def _hands_tests_to_workers(config: pytest.Config) -> bool:
    """An xdist controller runs no test: it has no use for torch, whose import (a second of
    CPU) would only compete with its workers starting."""
    return config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput")


def pytest_unconfigure(config: pytest.Config) -> None:
    ddp = config.pluginmanager.get_plugin(SESSION_NAME)
    if isinstance(ddp, DdpSession):
        ddp.close()
