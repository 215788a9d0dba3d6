"""Process-global state a test may leave behind, found by comparing snapshots, and cleaned.

Five kinds: process groups (torch.distributed), live child processes and their children,
threads, sockets (listening or connected) and the distributed environment variables. A
snapshot is cheap (a few hundred microseconds): sockets are only described when a socket
descriptor appeared that was not there before.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .launch import zygote
from .launch.rendezvous import DIST_ENV

ENV_NAMES = (*DIST_ENV, "NODE_RANK", "GROUP_RANK")
ENV_PREFIXES = ("TORCHELASTIC_",)
KINDS = ("group", "process", "thread", "socket", "env")

# Long-lived by design, never a test's fault.
DEFAULT_ALLOW = (
    "thread:pytest_timeout *",
    "thread:ddphooks*",
    # multiprocessing's own feeder of a Queue: it ends when the queue is collected
    "thread:QueueFeederThread",
    "process:*multiprocessing.resource_tracker*",
    "process:*multiprocessing.forkserver*",
    "process:*torch._inductor.compile_worker*",
)


@dataclass(frozen=True)
class Leak:
    kind: str
    key: str  # what an allowlist entry matches
    what: str  # the words a report prints
    ref: int = 0  # the pid, or the thread ident

    def __str__(self) -> str:
        return self.what


@dataclass
class Snapshot:
    groups: dict[str, str] = field(default_factory=dict)
    processes: dict[int, str] = field(default_factory=dict)
    threads: dict[int, threading.Thread] = field(default_factory=dict)
    socket_inodes: frozenset[str] = frozenset()
    env: dict[str, str] = field(default_factory=dict)


class Allowlist:
    """``kind:glob`` entries (``thread:worker-*``, ``process:*redis*``); a bare kind allows all."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self.rules: list[tuple[str, str]] = []
        for entry in entries:
            entry = entry.strip()
            if not entry:
                continue
            kind, _, pattern = entry.partition(":")
            kind = kind.strip()
            if kind not in KINDS:
                raise ValueError(f"leak allowlist entry {entry!r}: the kind must be one of {', '.join(KINDS)}")
            self.rules.append((kind, pattern.strip() or "*"))

    def extended(self, entries: Iterable[str]) -> Allowlist:
        out = Allowlist()
        out.rules = [*self.rules, *Allowlist(entries).rules]
        return out

    def allows(self, leak: Leak) -> bool:
        return any(kind == leak.kind and fnmatch.fnmatchcase(leak.key, pat) for kind, pat in self.rules)


def _dist() -> Any | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return None
    return dist


def _groups() -> dict[str, str]:
    dist = _dist()
    if dist is None:
        return {}
    out: dict[str, str] = {}
    try:
        world = dist.distributed_c10d._world
        pg_map = dict(world.pg_map)
        names = dict(world.pg_names)
        default = world.default_pg
    except Exception:
        return {"default": "the default process group"} if dist.is_initialized() else {}
    for pg, (backend, _) in pg_map.items():
        name = names.get(pg, "?")
        try:
            ranks = sorted(dist.get_process_group_ranks(pg))
        except Exception:
            ranks = []
        if pg is default:
            out["default"] = (
                f"the default process group (backend {backend}, world size {len(ranks) or '?'}, group name {name!r})"
            )
        else:
            out[str(name)] = f"process group {name!r} (backend {backend}, ranks {ranks})"
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody reaped yet is not running)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def _threads() -> dict[int, threading.Thread]:
    return {t.ident: t for t in threading.enumerate() if t.ident is not None and t.is_alive()}


def _socket_inodes() -> frozenset[str]:
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return frozenset(found)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def thread_label(t: threading.Thread) -> str:
    target = getattr(t, "_target", None)
    where = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    module = getattr(target, "__module__", None)
    if where and module:
        where = f"{module}.{where}"
    kind = "daemon thread" if t.daemon else "thread"
    return f"{kind} {t.name!r}" + (f" (target {where})" if where else f" ({type(t).__qualname__})")


class LeakGuard:
    """Takes snapshots and finds, then cleans, what is new between two of them."""

    def __init__(self, own_processes: Callable[[], set[int]] = set) -> None:
        # pids whose trees belong to the harness itself (the warm launcher)
        self._own = own_processes

    def _processes(self) -> dict[int, str]:
        own = self._own()
        out = {}
        todo = zygote.children_of(os.getpid())
        seen: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid in seen or pid in own:
                continue
            seen.add(pid)
            if _running(pid):
                out[pid] = zygote.command_line(pid)
            todo.extend(zygote.children_of(pid))
        return out

    def snapshot(self) -> Snapshot:
        return Snapshot(_groups(), self._processes(), _threads(), _socket_inodes(), _env())

    def find(self, before: Snapshot, after: Snapshot | None = None) -> list[Leak]:
        after = after or self.snapshot()
        leaks: list[Leak] = []
        for key, what in after.groups.items():
            if key not in before.groups:
                leaks.append(Leak("group", key, f"{what} is still initialised"))
        for pid, cmd in sorted(after.processes.items()):
            if pid not in before.processes:
                if cmd == "?":  # caught between fork and exec: let it become what it runs
                    cmd = zygote.command_line(pid, settle=True)
                leaks.append(Leak("process", cmd, f"process {pid} is still running: {cmd}", pid))
        for ident, t in after.threads.items():
            if ident not in before.threads or before.threads[ident] is not t:
                leaks.append(Leak("thread", t.name, f"{thread_label(t)} is still running", ident))
        if after.socket_inodes - before.socket_inodes:
            leaks.extend(_socket_leaks(after.socket_inodes - before.socket_inodes))
        for name in sorted(set(before.env) | set(after.env)):
            old, new = before.env.get(name), after.env.get(name)
            if old != new:
                if old is None:
                    leaks.append(Leak("env", name, f"environment variable {name}={new!r} was set"))
                elif new is None:
                    leaks.append(Leak("env", name, f"environment variable {name} (was {old!r}) was removed"))
                else:
                    leaks.append(Leak("env", name, f"environment variable {name} was changed from {old!r} to {new!r}"))
        return leaks

    def clean(self, leaks: list[Leak], before: Snapshot) -> list[str]:
        """Undo what leaked, in an order that frees sockets through their owners first.
        Returns what could not be undone."""
        problems: list[str] = []
        kinds = {leak.kind for leak in leaks}
        if "group" in kinds:
            problems.extend(destroy_groups())
        if "process" in kinds:
            for leak in leaks:
                if leak.kind == "process":
                    _kill_tree(leak.ref)
        if "env" in kinds:
            for leak in leaks:
                if leak.kind == "env":
                    if leak.key in before.env:
                        os.environ[leak.key] = before.env[leak.key]
                    else:
                        os.environ.pop(leak.key, None)
        if "thread" in kinds:
            deadline = time.monotonic() + 1.0
            alive = _threads()
            for leak in leaks:
                t = alive.get(leak.ref) if leak.kind == "thread" else None
                if t is None:
                    continue
                t.join(max(deadline - time.monotonic(), 0.0))
                if t.is_alive():
                    problems.append(f"{thread_label(t)} cannot be stopped from outside; it keeps running")
        if "socket" in kinds:
            gc.collect()
            _close_sockets(_socket_inodes() - before.socket_inodes)
        return problems


def _socket_leaks(inodes: frozenset[str]) -> list[Leak]:
    import psutil

    wanted = {int(i[len("socket:[") : -1]) for i in inodes}
    leaks = []
    try:
        conns = psutil.Process().net_connections(kind="inet")
    except Exception:
        return leaks
    by_fd = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                by_fd[int(name)] = int(link[len("socket:[") : -1])
    for c in conns:
        if by_fd.get(c.fd) not in wanted:
            continue
        local = f"{c.laddr.ip}:{c.laddr.port}" if c.laddr else "?"
        if c.status == "LISTEN" or (not c.raddr and c.type == 2):
            what = f"socket listening on {local}" + (" (UDP)" if c.type == 2 else "")
        else:
            remote = f"{c.raddr.ip}:{c.raddr.port}" if c.raddr else "?"
            what = f"connection {local} -> {remote} ({c.status}) is still open"
        if c.status == "LISTEN":
            what += " is still open"
        leaks.append(Leak("socket", local, what))
    return leaks


def _close_sockets(inodes: frozenset[str]) -> None:
    """Replace leaked socket descriptors by /dev/null: the socket closes, the number stays
    taken, so its owner closing it later cannot close someone else's descriptor."""
    if not inodes:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}") in inodes:
                    os.dup2(null, int(name))
    finally:
        os.close(null)


def destroy_groups() -> list[str]:
    dist = _dist()
    if dist is None or not dist.is_initialized():
        return []
    # a group broken by a failed collective can hang in destroy: never wait for it forever
    done = threading.Event()
    error: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as exc:
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=destroy, name="ddphooks-destroy-group", daemon=True).start()
    if not done.wait(10.0):
        return ["destroy_process_group() did not return within 10 s; the group was abandoned"]
    if error:
        return [f"destroy_process_group() raised {type(error[0]).__name__}: {error[0]}"]
    return []


def _kill_tree(pid: int) -> None:
    tree = [pid, *zygote.descendants_of(pid)]
    for p in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(p, 0)
