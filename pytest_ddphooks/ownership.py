"""Which live Python objects hold what the leak guard found: a process, a thread or a socket
that an object of wider life than the test (a fixture's value, a pool kept in a global)
still owns is that object's, not a leftover to pull from under it.

Reachability follows object references (``gc.get_referents``) from instances and
containers only: modules, classes and functions lead to everything and own nothing.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import types
from collections.abc import Collection, Iterable, Mapping
from typing import Any

# past these, a graph is too large to be a fixture's own state (pytest's config reaches
# everything): what was found so far stands, nothing more is claimed
_MAX_OBJECTS = 100_000
_MAX_DEPTH = 12
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType)


def _reachable(roots: Iterable[Any]) -> list[Any]:
    """The objects reachable from ``roots`` (themselves included), breadth first, bounded."""
    seen: set[int] = set()
    out: list[Any] = []
    level = [r for r in roots if not issubclass(type(r), _OPAQUE)]
    for _ in range(_MAX_DEPTH):
        nxt: list[Any] = []
        for obj in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            out.append(obj)
            if len(out) >= _MAX_OBJECTS:
                return out
            nxt.extend(r for r in gc.get_referents(obj) if not issubclass(type(r), _OPAQUE) and id(r) not in seen)
        if not nxt:
            break
        level = nxt
    return out


def _pid_of(obj: Any) -> int | None:
    """The pid of a multiprocessing process or a subprocess object, else None."""
    mp_process = sys.modules.get("multiprocessing.process")
    # type(), never isinstance(): an object's __class__ may be a property that warns (torch's deprecated names)
    if mp_process is not None and issubclass(type(obj), mp_process.BaseProcess):
        popen = getattr(obj, "_popen", None)
        return getattr(popen, "pid", None)
    subprocess = sys.modules.get("subprocess")
    if subprocess is not None and issubclass(type(obj), subprocess.Popen):
        return obj.pid  # type: ignore[no-any-return]
    return None


def _inode(sock: socket.socket) -> int | None:
    try:
        return os.fstat(sock.fileno()).st_ino
    except (OSError, ValueError):
        return None


def owned(roots: Mapping[str, Any], leaks: Collection[Any]) -> dict[str, set[tuple[str, int]]]:
    """Of the leaks given (``.kind``, ``.ref``: a process's pid, a thread's ident, a socket's
    inode), the ``(kind, ref)`` of those each root object owns: reachable from it, or, for a
    thread, running code of an object reachable from it (a server's handler thread) and the
    sockets such a thread works with."""
    # set[int], not set[Any]: a ref found in one narrows an ``int | None`` to int
    refs: dict[str, set[int]] = {
        kind: {lk.ref for lk in leaks if lk.kind == kind} for kind in ("process", "thread", "socket")
    }
    pids, idents, inodes = refs["process"], refs["thread"], refs["socket"]
    out: dict[str, set[tuple[str, int]]] = {}
    for name, root in roots.items():
        found: set[tuple[str, int]] = set()
        objects = _reachable([root])
        ids = {id(o) for o in objects}
        for obj in objects:
            kind = type(obj)
            if issubclass(kind, threading.Thread) and obj.ident in idents:
                found.add(("thread", obj.ident))
            elif issubclass(kind, socket.socket):
                inode = _inode(obj)
                if inode in inodes:
                    found.add(("socket", inode))
            else:
                pid = _pid_of(obj)
                if pid in pids:
                    found.add(("process", pid))
        for thread in threading.enumerate():
            if thread.ident in idents and ("thread", thread.ident) not in found:
                # a thread running a method of the root's objects, or handed them
                work = [getattr(thread, a, None) for a in ("_target", "_args", "_kwargs")]
                reached = _reachable([getattr(w, "__self__", w) for w in work if w is not None])
                if any(id(o) in ids for o in reached):
                    found.add(("thread", thread.ident))
                    socks = [o for o in reached if issubclass(type(o), socket.socket)]
                    found.update(("socket", i) for o in socks if (i := _inode(o)) in inodes)
        if found:
            out[name] = found
    return out


def native_c10d_types() -> tuple[type, ...]:
    """The torch.distributed classes whose sockets live in native code: ProcessGroup, its
    Backend, Store (none before torch.distributed is loaded)."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    found = (getattr(c10d, name, None) for name in ("ProcessGroup", "Backend", "Store"))
    return tuple(t for t in found if isinstance(t, type))


def reaches_native_c10d(roots: Iterable[Any]) -> bool:
    """Whether such an object is reachable from ``roots``: its sockets go when it is collected."""
    kinds = native_c10d_types()
    return bool(kinds) and any(issubclass(type(o), kinds) for o in _reachable(roots))


def held_processes(pids: set[int]) -> dict[int, str]:
    """Of these pids, those whose multiprocessing process object a library's pool holds among
    its workers (multiprocessing's and concurrent.futures' pools, torch's data loaders, joblib's:
    killing one breaks its owner, who waits for it or raises when it dies), with what holds
    it. A process kept otherwise (an attribute, a module's variable or list, a project's own
    launcher) is no worker of such a pool."""
    mp_process = sys.modules.get("multiprocessing.process")
    if not pids or mp_process is None:
        return {}
    registry = getattr(mp_process, "_children", None)
    everything = gc.get_objects()
    found = [o for o in everything if issubclass(type(o), mp_process.BaseProcess) and _pid_of(o) in pids]
    out: dict[int, str] = {}
    for proc in found:
        holders = [
            r
            for r in gc.get_referrers(proc)
            if r is not registry and r is not everything and r is not found and type(r) is not types.FrameType
        ]
        owner = next((o for h in holders if (o := _pool_owner(h, everything)) is not None), None)
        if owner is not None:
            pid = _pid_of(proc)
            assert pid is not None
            out[pid] = f"a {type(owner).__name__} object"
    return out


def _pool_owner(holder: Any, everything: list[Any]) -> Any:
    """The instance (not a module) whose attribute is the collection ``holder`` (its list or
    dict of workers), or None."""
    if not isinstance(holder, (list, dict, set, tuple)):
        return None
    for outer in gc.get_referrers(holder):
        if outer is everything:
            continue
        if isinstance(outer, dict):  # an instance's __dict__
            owner = next((o for o in gc.get_referrers(outer) if getattr(o, "__dict__", None) is outer), None)
        else:
            owner = outer if hasattr(outer, "__dict__") else None
        if owner is not None and not issubclass(type(owner), _OPAQUE) and _is_pool(type(owner)):
            return owner
    return None


# the libraries whose objects keep worker processes and break when one is killed under them
_POOL_MODULES = ("multiprocessing.", "concurrent.futures.", "torch.utils.data.", "joblib.", "loky.", "billiard.")


def _is_pool(kind: type) -> bool:
    return any(getattr(k, "__module__", "").startswith(_POOL_MODULES) for k in kind.__mro__)


def process_target(pid: int) -> str | None:
    """What the multiprocessing process object of ``pid`` runs, where that is known (its
    class's own ``run``), if such an object is alive."""
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is None:
        return None
    for o in gc.get_objects():
        if issubclass(type(o), mp_process.BaseProcess) and _pid_of(o) == pid:
            target = getattr(o, "_target", None)  # start() lets go of it
            if target is None:
                overridden = getattr(type(o), "run", None) is not mp_process.BaseProcess.run
                return f"{type(o).__qualname__}.run" if overridden else None
            module = getattr(target, "__module__", None)
            name = getattr(target, "__qualname__", None) or repr(target)
            return f"{module}.{name}" if module else name
    return None
