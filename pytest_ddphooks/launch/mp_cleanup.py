"""multiprocessing's end-of-process clean-up for ranks, which leave through ``os._exit``.

A process torchrun starts runs multiprocessing's finalizers as it exits: the temporary folder
``pymp-*`` it made (sending a tensor's memory to a child, or a child's to it, starts a resource
sharer listening on a socket there) is removed. A rank forked from the fork server ends with
``os._exit`` and would leave one such folder in the system's temp folder per rank that used it.
It runs the finalizers registered in the rank as it leaves, and never those it inherited: they
belong to the pytest process (its own folder, its own pools), as for a child multiprocessing forks.
"""

from __future__ import annotations

import contextlib
import sys


def forget_inherited() -> None:
    """In a rank just forked: drop the finalizers and the temporary folder of the process it
    was forked from (a fresh process makes its own)."""
    util = sys.modules.get("multiprocessing.util")
    if util is None:
        return
    registry = getattr(util, "_finalizer_registry", None)
    if registry:
        registry.clear()
    process = sys.modules.get("multiprocessing.process")
    config = getattr(getattr(process, "_current_process", None), "_config", None)
    if isinstance(config, dict):
        config.pop("tempdir", None)


def run_own() -> None:
    """As a rank leaves: what a normal exit would run of multiprocessing's finalizers."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None and getattr(util, "_finalizer_registry", None):
        with contextlib.suppress(Exception):
            util._run_finalizers()
