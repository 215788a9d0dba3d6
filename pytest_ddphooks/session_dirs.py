"""The session's private folders, and what dead sessions left.

A session's folder is in the system temporary folder. The folders of its runs (each rank's
output, result and event files, a few kilobytes for most tests, created and removed with every
test) are in a memory filesystem when the machine has one with room to spare and ``TMPDIR``
does not say where temporary files go: creating, writing and removing them there costs a rank
a third of what it costs on a disk, and nothing is written back to one.

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


MEMORY_FS = "/dev/shm"
# less room than this and a memory filesystem is not used: a rank that fills one while
# writing its events through a mapping dies of SIGBUS (Docker gives containers 64 MiB)
MEMORY_ROOM = 1 << 30


def create(parent: str | None = None) -> str:
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)


def memory_parent() -> str | None:
    """The memory filesystem for run folders, or None (none here, too small, not ours to
    write, or ``TMPDIR`` set: temporary files go where it says)."""
    if os.environ.get("TMPDIR") or not _is_tmpfs(MEMORY_FS):
        return None
    try:
        room = os.statvfs(MEMORY_FS)
    except OSError:
        return None
    if room.f_bavail * room.f_frsize < MEMORY_ROOM or not os.access(MEMORY_FS, os.W_OK | os.X_OK):
        return None
    return MEMORY_FS


def _is_tmpfs(path: str) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(fields[1] == path and fields[2] == "tmpfs" for fields in (line.split() for line in f))
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(parent: str | None = None) -> list[str]:
    """Remove the folders of sessions whose process is gone (in ``parent``, or wherever this
    module puts them); returns what was removed."""
    if parent is None:
        memory = memory_parent()
        return [*remove_stale(tempfile.gettempdir()), *(remove_stale(memory) if memory else [])]
    removed: list[str] = []
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
