"""Process-global state a test may leave behind: found by comparing snapshots, released
where that is safe, and reported where it is not.

Five kinds: process groups (torch.distributed), live child processes and their children,
threads, sockets (listening or connected) and the distributed environment variables. A
snapshot is cheap (a few hundred microseconds): sockets are only described when a socket
descriptor appeared that was not there before.

Cleaning never pulls a resource from under live code: a group is destroyed through torch,
a process is killed (and left for its owner to reap, so a ``Popen`` still sees how it
ended), a socket is closed only through the Python socket object that owns it. A socket
that only native code holds (gloo's pairs, a store) and a running thread are left as they
are and reported as such: replacing a descriptor under native code crashes it later.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import os
import socket
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import ownership, releasing, singletons
from .launch import procs
from .launch.rendezvous import DIST_ENV

ENV_NAMES = (*DIST_ENV, "NODE_RANK", "GROUP_RANK")
ENV_PREFIXES = ("TORCHELASTIC_",)
# what torch's own launcher sets in the calling process (elastic_launch: which signals its
# agent forwards): a setting of the launcher, no rank's or group's identity
ENV_NOT_DISTRIBUTED = frozenset({"TORCHELASTIC_SIGNALS_TO_HANDLE"})
KINDS = ("group", "process", "thread", "socket", "env")

# how long a leaked thread gets to end, and a leaked socket to be closed by its owner
# (gloo closes its pairs just after a group is destroyed), before either is judged
SETTLE_SECONDS = 1.0
OWNERS_WALK_SECONDS = 0.3  # at most, looking for what native objects still own a socket


@dataclass(frozen=True)
class Leak:
    kind: str
    key: str  # what an allowlist entry matches
    what: str  # the words a report prints
    ref: int = 0  # the pid, the thread ident, or the socket's inode

    def __str__(self) -> str:
        return self.what

    def same(self, other: Leak) -> bool:
        return (self.kind, self.key, self.ref) == (other.kind, other.key, other.ref)


@dataclass(frozen=True)
class Outcome:
    """What the guard did about one leak: ``cleaned``, and how, or why it was left."""

    leak: Leak
    cleaned: bool
    how: str


@dataclass
class Snapshot:
    groups: dict[str, str] = field(default_factory=dict)
    processes: dict[int, str] = field(default_factory=dict)
    threads: dict[int, threading.Thread] = field(default_factory=dict)
    socket_inodes: frozenset[int] = frozenset()
    env: dict[str, str] = field(default_factory=dict)


class Allowlist:
    """``kind:glob`` entries (``thread:worker-*``, ``process:*redis*``); a bare kind allows all.
    With ``singletons``, also what libraries create once per process (``singletons.KNOWN``)."""

    def __init__(self, entries: Iterable[str] = (), singletons: bool = False) -> None:
        self.singletons = singletons
        self.rules: list[tuple[str, str]] = []
        for entry in entries:
            if not isinstance(entry, str):
                raise ValueError(
                    f"leak allowlist entry {entry!r}: an entry is a str such as 'thread:worker-*' or 'env:MY_VAR'"
                )
            entry = entry.strip()
            if not entry:
                continue
            kind, _, pattern = entry.partition(":")
            kind = kind.strip()
            if kind not in KINDS:
                raise ValueError(f"leak allowlist entry {entry!r}: the kind must be one of {', '.join(KINDS)}")
            self.rules.append((kind, pattern.strip() or "*"))

    def extended(self, entries: Iterable[str]) -> Allowlist:
        out = Allowlist(singletons=self.singletons)
        out.rules = [*self.rules, *Allowlist(entries).rules]
        return out

    def allows(self, leak: Leak) -> bool:
        if self._matches(leak):
            return True
        # what an allowed thread works with is part of it: a plugin's server thread and its socket
        return leak.kind == "socket" and any(self._matches(thread_leak(t)) for t in _threads_using(leak.ref))

    def _matches(self, leak: Leak) -> bool:
        if any(kind == leak.kind and fnmatch.fnmatchcase(leak.key, pat) for kind, pat in self.rules):
            return True
        return self.singletons and singletons.known(leak, _live_thread(leak)) is not None


def _live_thread(leak: Leak) -> threading.Thread | None:
    return live_threads().get(leak.ref) if leak.kind == "thread" else None


def thread_leak(t: threading.Thread) -> Leak:
    return Leak("thread", t.name, f"{thread_label(t)} is still running", t.ident or 0)


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


def live_threads() -> dict[int, threading.Thread]:
    return {t.ident: t for t in threading.enumerate() if t.ident is not None and t.is_alive()}


def env_now() -> dict[str, str]:
    """The distributed environment variables, as they are now."""
    return {
        k: v
        for k, v in os.environ.items()
        if (k in ENV_NAMES or k.startswith(ENV_PREFIXES)) and k not in ENV_NOT_DISTRIBUTED
    }


def thread_label(t: threading.Thread) -> str:
    target = getattr(t, "_target", None)
    where = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    module = getattr(target, "__module__", None)
    if where and module:
        where = f"{module}.{where}"
    kind = "daemon thread" if t.daemon else "thread"
    return f"{kind} {t.name!r}" + (f" (target {where})" if where else f" ({type(t).__qualname__})")


class LeakGuard:
    """Takes snapshots; finds, settles, then cleans what is new between two of them."""

    def __init__(self, own_processes: Callable[[], set[int]] = set) -> None:
        # pids whose trees belong to the harness itself (the warm launcher)
        self._own = own_processes
        # within one look (``one_look``): when its waiting ends, and what native objects own
        # sockets (a walk of the whole heap: seconds in a large suite's process), found once
        self._looking = False
        self._look_deadline: float | None = None
        self._owners_hint: str | None = None

    @contextlib.contextmanager
    def one_look(self) -> Iterator[None]:
        """One test's teardown: every wait in it (for the test's leaks and for each scope that
        ends) shares one settling window, and the heap is walked for native owners once."""
        self._looking, self._look_deadline, self._owners_hint = True, None, None
        try:
            yield
        finally:
            self._looking, self._look_deadline, self._owners_hint = False, None, None

    def _deadline(self, wait: float) -> float:
        deadline = time.monotonic() + wait
        if not self._looking:
            return deadline
        if self._look_deadline is None:
            self._look_deadline = deadline
        return self._look_deadline

    def _native_owners_once(self) -> str:
        if self._owners_hint is None or not self._looking:
            self._owners_hint = _native_owners()
        return self._owners_hint

    def _processes(self) -> dict[int, str]:
        own = self._own()
        out = {}
        # read twice: a child of a thread that is ending moves to another thread of the process
        # as it ends, and one read of every thread's children can miss it between two of them
        me = os.getpid()
        todo = list({*procs.children_of(me), *procs.children_of(me)})
        seen: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid in seen or pid in own:
                continue
            seen.add(pid)
            if procs.is_running(pid):
                out[pid] = procs.command_line(pid)
            todo.extend(procs.children_of(pid))
        return out

    def snapshot(self) -> Snapshot:
        return Snapshot(_groups(), self._processes(), live_threads(), frozenset(_fds_by_inode()), env_now())

    def find(self, before: Snapshot, after: Snapshot | None = None) -> list[Leak]:
        after = after or self.snapshot()
        leaks: list[Leak] = []
        for key, what in after.groups.items():
            if key not in before.groups:
                leaks.append(Leak("group", key, f"{what} is still initialised"))
        for pid, cmd in sorted(after.processes.items()):
            if pid not in before.processes:
                if cmd == "?":  # caught between fork and exec: let it become what it runs
                    cmd = procs.command_line(pid, settle=True)
                leaks.append(Leak("process", cmd, f"process {pid}{fork_note(pid, cmd)} is still running: {cmd}", pid))
        for ident, t in after.threads.items():
            if ident not in before.threads or before.threads[ident] is not t:
                leaks.append(thread_leak(t))
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

    def settle(
        self,
        before: Snapshot,
        leaks: list[Leak],
        holders: Iterable[Any] = (),
        wait: float = SETTLE_SECONDS,
        newly: Callable[[Leak], bool] | None = None,
    ) -> list[Leak]:
        """Those of ``leaks`` still there once what the test's failure kept alive is released
        (``holders``: objects that may keep failures, such as the test item), garbage is
        collected, processes and threads had ``wait`` seconds to end (longer for what is
        known to end by itself, ``singletons.patience``) and sockets to be closed; with
        ``newly``, also what appeared meanwhile that it accepts."""
        if not leaks:
            return []
        releasing.release_failures(holders)
        gc.collect()
        deadline = self._deadline(wait)
        for leak in leaks:  # processes first: a thread may be waiting for one
            if leak.kind == "process" and leak.ref:
                until = max(deadline, time.monotonic() + singletons.patience(leak, leak.ref))
                while procs.is_running(leak.ref) and time.monotonic() < until:
                    time.sleep(0.01)
        alive = live_threads()
        for leak in leaks:
            t = alive.get(leak.ref) if leak.kind == "thread" else None
            if t is not None:
                t.join(max(deadline, time.monotonic() + singletons.patience(leak, t)) - time.monotonic())
        if not any(lk.kind == "group" for lk in leaks):  # a live group keeps its sockets open
            _await_closed({lk.ref for lk in leaks if lk.kind == "socket"}, deadline)
        still = self.find(before)
        kept = [lk for lk in leaks if any(lk.same(s) for s in still)]
        return kept + [lk for lk in still if newly(lk)] if newly is not None else kept

    def clean(self, leaks: list[Leak], before: Snapshot) -> list[Outcome]:
        """Release what can be released safely, in an order that lets owners close their
        sockets first; say what was done about each leak. A socket that closed with its
        group or process is no leak of its own and gets no outcome."""
        out: list[Outcome] = []
        groups = [lk for lk in leaks if lk.kind == "group"]
        if groups:
            problems = destroy_groups([lk.key for lk in groups])
            for leak in groups:
                out.append(Outcome(leak, not problems, problems[0] if problems else "destroyed"))
        held = ownership.held_processes({lk.ref for lk in leaks if lk.kind == "process" and lk.ref})
        for leak in leaks:
            if leak.kind == "process" and leak.ref in held:
                how = f"{held[leak.ref]} still holds it: left running, as killing it would break that object"
                out.append(Outcome(leak, False, how))
            elif leak.kind == "process":
                if leak.ref:
                    procs.kill_tree(leak.ref, wait=2.0)
                out.append(Outcome(leak, True, "killed"))
            elif leak.kind == "env":
                if leak.key in before.env:
                    os.environ[leak.key] = before.env[leak.key]
                else:
                    os.environ.pop(leak.key, None)
                out.append(Outcome(leak, True, "restored"))
            elif leak.kind == "thread":
                out.append(Outcome(leak, False, "a thread cannot be stopped from outside; it was left running"))
        sockets = [lk for lk in leaks if lk.kind == "socket"]
        if sockets:
            _await_closed({lk.ref for lk in sockets}, self._deadline(SETTLE_SECONDS))
            open_now = _inodes_open({lk.ref for lk in sockets})
            owners = _python_sockets(open_now)
            users = {inode: _threads_using(inode, owners) for inode in owners}
            closed = _close(owners, {inode for inode, threads in users.items() if not threads})
            still = _inodes_open(open_now)
            hint = ""
            for leak in sockets:
                if leak.ref not in open_now:
                    continue
                if leak.ref not in still:
                    out.append(Outcome(leak, True, "closed through its Python socket object"))
                elif users.get(leak.ref):
                    names = ", ".join(repr(t.name) for t in users[leak.ref])
                    how = f"thread {names} is using it: left open, as closing it would break that thread"
                    out.append(Outcome(leak, False, how))
                elif leak.ref in closed:
                    how = "its Python socket object was closed, but native code holds a copy of it"
                    out.append(Outcome(leak, False, how))
                else:
                    if not hint:
                        hint = self._native_owners_once()
                    how = f"native code owns it ({hint}): left open, as closing it from outside would crash that code"
                    out.append(Outcome(leak, False, how))
        return out


def _fds_by_inode() -> dict[int, list[int]]:
    """This process's open sockets: inode -> its descriptors."""
    out: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                out.setdefault(int(link[len("socket:[") : -1]), []).append(int(name))
    return out


def _inodes_open(inodes: set[int]) -> set[int]:
    return inodes & set(_fds_by_inode())


def _await_closed(inodes: set[int], deadline: float) -> None:
    """Give the owners of these sockets until ``deadline`` to close them."""
    while inodes and _inodes_open(inodes) and time.monotonic() < deadline:
        time.sleep(0.01)


def _socket_leaks(wanted: frozenset[int]) -> list[Leak]:
    import psutil

    leaks: list[Leak] = []
    try:
        conns = psutil.Process().net_connections(kind="inet")
    except Exception:
        return leaks
    for unix_inode, path in sorted(_unix_listening(wanted).items()):
        leaks.append(Leak("socket", path, f"Unix socket listening on {path} is still open", unix_inode))
    by_fd = {fd: inode for inode, fds in _fds_by_inode().items() for fd in fds}
    for c in conns:
        inode = by_fd.get(c.fd)
        if inode not in wanted:
            continue
        local = f"{c.laddr.ip}:{c.laddr.port}" if c.laddr else "?"
        if c.status == "LISTEN":
            what = f"socket listening on {local} is still open"
        elif not c.raddr and c.type == socket.SOCK_DGRAM:
            what = f"UDP socket bound to {local} is still open"
        else:
            remote = f"{c.raddr.ip}:{c.raddr.port}" if c.raddr else "?"
            what = f"connection {local} -> {remote} ({c.status}) is still open"
        leaks.append(Leak("socket", local, what, inode or 0))
    return leaks


_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's flags: the socket listens


def _unix_listening(inodes: frozenset[int]) -> dict[int, str]:
    """Of these sockets, the Unix ones that listen (a server's; not the unnamed pairs that
    libraries talk over), with their paths."""
    out: dict[int, str] = {}
    try:
        with open("/proc/net/unix") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return out
    for row in rows:
        fields = row.split()
        if len(fields) < 7 or not fields[6].isdigit() or int(fields[6]) not in inodes:
            continue
        if int(fields[3], 16) & _ACCEPTING:
            out[int(fields[6])] = fields[7] if len(fields) > 7 else "(an unnamed address)"
    return out


def _python_sockets(inodes: set[int]) -> dict[int, list[socket.socket]]:
    """The Python socket objects that own these sockets, by inode."""
    if not inodes:
        return {}
    wanted = {fd: inode for inode, fds in _fds_by_inode().items() if inode in inodes for fd in fds}
    out: dict[int, list[socket.socket]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), socket.socket) and obj.fileno() in wanted:
            out.setdefault(wanted[obj.fileno()], []).append(obj)
    return out


def _frame_uses(frame: Any, socks: list[socket.socket]) -> bool:
    """The frame holds one of ``socks`` in a local, or as an attribute of one (``self.sock``)."""
    for value in list(frame.f_locals.values()):
        if any(value is s for s in socks):
            return True
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict) and any(a is s for a in list(attributes.values()) for s in socks):
            return True
    return False


def _threads_using(inode: int, owners: dict[int, list[socket.socket]] | None = None) -> list[threading.Thread]:
    """Live threads (other than this one) whose stack works with the socket's Python object."""
    socks = (owners if owners is not None else _python_sockets({inode})).get(inode, [])
    if not socks:
        return []
    threads = live_threads()
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me or ident not in threads:
            continue
        f: types.FrameType | None = frame
        while f is not None:
            if _frame_uses(f, socks):
                out.append(threads[ident])
                break
            f = f.f_back
    return out


def _close(owners: dict[int, list[socket.socket]], inodes: set[int]) -> set[int]:
    """Close the Python socket objects of these sockets (shut down first, which wakes one
    blocked in accept or recv); returns the inodes that had one."""
    closed = set()
    for inode in inodes:
        for sock in owners.get(inode, []):
            closed.add(inode)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
    return closed


def fork_note(pid: int, cmd: str, whose: str = "this process") -> str:
    """`` (a fork of this process, running Worker.run)`` for a child that still runs this
    process's command line (multiprocessing's fork): what it runs is not what it says."""
    if cmd != procs.command_line(os.getpid()):
        return ""
    target = ownership.process_target(pid)
    return f" (a fork of {whose}{f', running {target}' if target else ''})"


def native_only(inodes: set[int]) -> set[int]:
    """Of these sockets, those no Python socket object owns (native code's: a group's, a store's)."""
    return inodes - set(_python_sockets(inodes))


def _native_owners() -> str:
    """What native objects of torch.distributed are still referenced: the likely owners of
    sockets no Python object owns (a ProcessGroupGloo kept in a global, a TCPStore)."""
    kinds = ownership.native_c10d_types()
    counts: dict[str, int] = {}
    held_by: list[str] = []
    cut = False
    if kinds:
        seen: set[int] = set()
        native: dict[type, bool] = {}  # a type is judged once: the objects are of a few hundred types

        def count(obj: Any) -> bool:
            kind = type(obj)
            is_native = native.get(kind)
            if is_native is None:
                try:
                    is_native = issubclass(kind, kinds)
                except Exception:  # a type whose subclass check raises owns nothing here
                    is_native = False
                native[kind] = is_native
            if not is_native or id(obj) in seen:
                return False
            seen.add(id(obj))
            counts[kind.__name__] = counts.get(kind.__name__, 0) + 1
            return True

        # looking at every object touches deprecated ones (torch's reduce_op warns when its
        # class is read): no warning of this walk is the test's, nor an error under -W error
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # where a module keeps one: a name to look for (a dict of only such objects is
            # not even tracked by the garbage collector, whose walk below would miss it)
            for module_name, module in list(sys.modules.items()):
                for name, value in list(getattr(module, "__dict__", {}).items()):
                    inside = value.values() if type(value) is dict else value if type(value) is list else ()
                    with contextlib.suppress(Exception):
                        if count(value) or sum(count(v) for v in list(inside)):
                            held_by.append(f"{module_name}.{name}")
            # a large suite's heap holds millions of objects: the walk is a hint, cut short
            ends = time.monotonic() + OWNERS_WALK_SECONDS
            referents = gc.get_referents
            for i, holder in enumerate(gc.get_objects()):
                if not i & 4095 and time.monotonic() > ends:
                    cut = True
                    break
                for obj in referents(holder):
                    if native.get(type(obj)) is not False:
                        count(obj)
    if not counts:
        return "no Python object owns it" if not cut else "no Python object found owning it"
    found = ", ".join(f"{n} {name} object{'s' if n > 1 else ''}" for name, n in sorted(counts.items()))
    if cut:
        found = f"at least {found}"
    where = f"; held in {', '.join(held_by[:3])}{' and more' if len(held_by) > 3 else ''}" if held_by else ""
    return f"still referenced: {found}{where}"


def destroy_groups(names: Iterable[str] | None = None) -> list[str]:
    """Destroy the groups named (``"default"``: every group, with the default one); all of
    them without names. A sub-group left behind goes alone: the groups that were there
    before it (a session fixture's default group) stay."""
    dist = _dist()
    if dist is None or not dist.is_initialized():
        return []
    targets: list[Any] = [None]
    if names is not None and "default" not in names:
        wanted = set(names)
        try:
            targets = [pg for pg, name in dict(dist.distributed_c10d._world.pg_names).items() if str(name) in wanted]
        except Exception:
            targets = [None]
    # a group broken by a failed collective can hang in destroy: never wait for it forever
    done = threading.Event()
    error: list[BaseException] = []

    def destroy() -> None:
        try:
            for group in targets:
                dist.destroy_process_group(group)
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
