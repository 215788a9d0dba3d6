"""The session's private folder in the system temporary folder, and what dead sessions left.

A session's folder is named after its process (``ddphooks-<pid>-...``) so that one left by a
pytest that was killed (``kill -9`` skips every cleanup) is recognised and removed by the next
session, once no process of that number runs any more.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

PREFIX = "ddphooks-"
_OWNED = re.compile(rf"^{PREFIX}(\d+)-")


def create() -> str:
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(parent: str | None = None) -> list[str]:
    """Remove the folders of sessions whose process is gone; returns what was removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = _OWNED.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(parent, name)
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed
