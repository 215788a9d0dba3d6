"""multiprocessing's end-of-process clean-up for ranks, which leave through ``os._exit``.

A process torchrun starts runs multiprocessing's finalizers as it exits: the temporary folder
``pymp-*`` it made (sending a tensor's memory to a child, or a child's to it, starts a resource
sharer listening on a socket there) is removed. A rank forked from the fork server ends with
``os._exit`` and would leave one such folder in the system's temp folder per rank that used it.
It removes, as it leaves, the folders it made itself (those finalizers alone: a pool's would wait
for the workers the rank killed), and never what it inherited: that belongs to the pytest process
(its own folder, its own pools), as for a child multiprocessing forks.
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
    """As a rank leaves: the removal of the temporary folders it made, of multiprocessing's
    finalizers (not the others: a pool's waits for workers the rank has killed, for ever)."""
    util = sys.modules.get("multiprocessing.util")
    registry = getattr(util, "_finalizer_registry", None)
    remove = getattr(util, "_remove_temp_dir", None)
    if not registry or remove is None:
        return
    for finalizer in list(registry.values()):
        if getattr(finalizer, "_callback", None) is remove:
            with contextlib.suppress(Exception):
                finalizer()
