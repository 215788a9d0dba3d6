"""Processes seen through /proc: trees, states, command lines, and the one way to kill a tree.

Linux only (as the rest of the harness): children are read from ``/proc/PID/task/*/children``,
which costs a few reads instead of a scan of every process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import time
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


@functools.cache
def _libc_prctl() -> Any:
    # looked up once, in the fork server: every rank calls it twice, and each lookup cost a
    # fresh rank 0.15 ms (loading libc's handle and building the function object anew)
    return ctypes.CDLL(None, use_errno=True).prctl


def prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        _libc_prctl()(option, value, 0, 0, 0)


def children_of(pid: int) -> list[int]:
    """Direct children of a process."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return out


def has_children() -> bool:
    """Whether this process has a child, running or ended and not reaped (one system call,
    nothing reaped). A child subreaper with none has no descendants at all: its orphans
    become its children."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WSTOPPED | os.WCONTINUED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def descendants_of(pid: int) -> list[int]:
    found: list[int] = []
    seen: set[int] = set()
    todo = children_of(pid)
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        found.append(p)
        todo.extend(children_of(p))
    return found


def state_of(pid: int) -> str | None:
    """The one-letter state of a process (R, S, D, T, t, Z, X, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    at = stat.rfind(b")") + 2
    return stat[at : at + 1].decode() or None


_PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def is_ending(pid: int) -> bool:
    """Gone, a zombie, exiting, or with a SIGKILL pending: it will run no more code of its own
    (a killed process with much memory takes a moment to become a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return True
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
        return True
    for line in status.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
            return True
    return False


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody reaped yet is not running)."""
    return state_of(pid) not in (None, "Z", "X")


def is_frozen(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or by a tracer: it runs no code until continued."""
    return state_of(pid) in ("T", "t")


def command_line(pid: int, settle: bool = False) -> str:
    """The command line of a process. With ``settle``, a process caught between fork and
    exec (its command line still empty) gets up to 100 ms to become what it will run."""
    for _ in range(20 if settle else 1):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            return "?"
        text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.005)
    return "?"


def retire(*fds: int) -> None:
    """Release descriptors a forked process must not use, leaving /dev/null in their place
    so that a stale object closing its old number later cannot close a new descriptor."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.dup2(null, fd)
    os.close(null)


def signal_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_tree(*roots: int, include_root: bool = True, group: int | None = None, wait: float = 0.0) -> list[int]:
    """SIGKILL processes and everything under them (and the process group ``group``); with
    ``wait``, give them that long to stop running. Returns the processes it killed.

    The trees are listed before anything dies (a dead parent's children move to a reaper and
    out of sight). Nothing is reaped: the owner of a ``Popen`` must still learn how it ended."""
    tree: list[int] = []
    for root in roots:
        tree.extend(([root] if include_root else []) + descendants_of(root))
    if group is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for p in tree:
        signal_quietly(p)
    deadline = time.monotonic() + wait
    while wait and any(is_running(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.005)
    return tree
