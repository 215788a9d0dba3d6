"""The warnings this plugin issues (exported from the package; importable without pytest)."""

from __future__ import annotations


class DdpHooksWarning(UserWarning):
    """Base of every warning pytest-ddphooks issues."""


class LeakWarning(DdpHooksWarning):
    """A test left a process group, process, thread, socket or variable behind
    (``--ddp-leaks=warn``, or in a session a launcher started as another rank)."""


class InjectedFault(Exception):
    """Raised in a rank by ``faults.raise_(...)`` at the point it names."""


for _cls in (DdpHooksWarning, LeakWarning, InjectedFault):
    _cls.__module__ = "pytest_ddphooks"  # how reports name them: where users import them
