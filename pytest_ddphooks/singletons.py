"""Things libraries create once per process by design: never a test's leak.

Each entry is recognised as precisely as the library allows: by the object that owns it
(fsspec's loop thread is ``fsspec.asyn.iothread[0]``; inductor's compile workers belong to
the executor ``AsyncCompile.pool()`` returns), by its class, or by a name or command line
only where nothing better exists. The README lists them; ``ddp_leaks_allow`` and the
``ddp_allow_leaks`` marker add a project's own.
"""

from __future__ import annotations

import fnmatch
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .launch import procs


class Leak(Protocol):
    """What is matched of a leak (``leaks.Leak``); read-only, so frozen dataclasses match."""

    @property
    def kind(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def ref(self) -> int: ...


@dataclass(frozen=True)
class Singleton:
    kind: str  # "thread", "process", ...
    what: str  # the words the README uses
    pattern: str = ""  # a glob on the leak's key (thread name, command line)
    # given the live object (a thread; a process's pid), True when it is this
    owned: Callable[[Any], bool] | None = None

    def matches(self, leak: Leak, obj: Any = None) -> bool:
        if leak.kind != self.kind:
            return False
        if self.pattern and fnmatch.fnmatchcase(leak.key, self.pattern):
            return True
        if obj is None and leak.kind == "process":
            obj = leak.ref or None
        return self.owned is not None and obj is not None and self.owned(obj)


def _module(name: str) -> Any:
    return sys.modules.get(name)


def _fsspec_loop(t: threading.Thread) -> bool:
    asyn = _module("fsspec.asyn")
    if asyn is None:
        return False
    holder = getattr(asyn, "iothread", None)
    if not holder:
        return False
    return holder[0] is t


def _cached(fn: Any) -> Any:
    """The value an lru_cache'd zero-argument function holds, without creating one."""
    info = getattr(fn, "cache_info", None)
    if info is None or info().currsize == 0:
        return None
    try:
        return fn()
    except Exception:
        return None


def _executor_of(t: threading.Thread) -> Any:
    """The concurrent.futures executor a worker or manager thread serves, or None."""
    ref = getattr(t, "executor_reference", None)  # ProcessPoolExecutor's manager thread
    if ref is None:
        args = getattr(t, "_args", ())
        ref = args[0] if args else None  # ThreadPoolExecutor's workers get a weakref to it
    try:
        return ref() if callable(ref) else None
    except Exception:
        return None


def _inductor_compile_pool(t: threading.Thread) -> bool:
    module = _module("torch._inductor.async_compile")
    if module is None:
        return False
    pools = getattr(module, "AsyncCompile", None)
    if pools is None:
        return False
    owner = _executor_of(t)
    if owner is not None:
        return any(owner is _cached(getattr(pools, name, None)) for name in ("pool", "process_pool"))
    # the subprocess pool's reader of its worker's answers
    target = getattr(t, "_target", None)
    return getattr(target, "__module__", "").startswith("torch._inductor.compile_worker")


def _inductor_worker(pid: Any) -> bool:
    """A worker process of inductor's cached compile pool, however it was started (fork or
    spawn workers have pytest's command line, or multiprocessing's)."""
    pools = getattr(_module("torch._inductor.async_compile"), "AsyncCompile", None)
    if pools is None:
        return False
    for name in ("pool", "process_pool"):
        processes = getattr(_cached(getattr(pools, name, None)), "_processes", None) or {}
        if pid in processes:
            return True
    return False


def _resource_sharer(t: threading.Thread) -> bool:
    """multiprocessing's resource sharer: started once per process the first time a file
    descriptor (a tensor's shared memory) is pickled for another process, then kept."""
    sharer = getattr(_module("multiprocessing.resource_sharer"), "_resource_sharer", None)
    return sharer is not None and getattr(sharer, "_thread", None) is t


def _tqdm_monitor(t: threading.Thread) -> bool:
    monitor = _module("tqdm._monitor")
    cls = getattr(monitor, "TMonitor", None)
    return cls is not None and isinstance(t, cls)


def _rerunfailures_server(t: threading.Thread) -> bool:
    target = getattr(t, "_target", None)
    return getattr(target, "__module__", None) == "pytest_rerunfailures" and getattr(
        target, "__qualname__", ""
    ).startswith("ServerStatusDB.")


def _loky_executor() -> Any:
    """joblib's (loky's) reusable executor, one per process, kept between ``Parallel`` calls."""
    for name in ("joblib.externals.loky.reusable_executor", "loky.reusable_executor"):
        executor = getattr(_module(name), "_executor", None)
        if executor is not None:
            return executor
    return None


def _loky_worker(pid: Any) -> bool:
    executor = _loky_executor()
    return executor is not None and pid in (getattr(executor, "_processes", None) or {})


def _loky_manager(t: threading.Thread) -> bool:
    executor = _loky_executor()
    return executor is not None and _executor_of(t) is executor


KNOWN: tuple[Singleton, ...] = (
    Singleton("thread", "this plugin's own helper threads", pattern="ddphooks*"),
    Singleton("thread", "pytest-timeout's timer thread (--timeout-method=thread)", pattern="pytest_timeout *"),
    Singleton(
        "thread",
        "multiprocessing's feeder thread of a Queue (it ends when the queue is collected)",
        pattern="QueueFeederThread",
    ),
    Singleton("thread", "fsspec's IO event loop thread 'fsspecIO' (one per process)", owned=_fsspec_loop),
    Singleton(
        "thread",
        "torch inductor's compile pool: the workers of AsyncCompile.pool() / process_pool() (one per process)",
        owned=_inductor_compile_pool,
    ),
    Singleton(
        "thread",
        "pytest-rerunfailures' status server for xdist (one per pytest session, with its socket)",
        owned=_rerunfailures_server,
    ),
    Singleton("thread", "tqdm's monitor thread TMonitor (one per process)", owned=_tqdm_monitor),
    Singleton("process", "multiprocessing's resource tracker", pattern="*multiprocessing.resource_tracker*"),
    Singleton("process", "multiprocessing's fork server and what it forks", pattern="*multiprocessing.forkserver*"),
    Singleton("process", "torch inductor's compile worker processes", pattern="*torch._inductor.compile_worker*"),
    Singleton(
        "process",
        "the workers of torch inductor's compile pool started by fork or spawn (TORCHINDUCTOR_WORKER_START)",
        owned=_inductor_worker,
    ),
    Singleton(
        "thread",
        "multiprocessing's resource sharer thread (started once a tensor is sent to another process)",
        owned=_resource_sharer,
    ),
    Singleton("process", "joblib's (loky's) resource tracker", pattern="*loky.backend.resource_tracker*"),
    Singleton("process", "the workers of joblib's (loky's) reusable executor", owned=_loky_worker),
    Singleton("thread", "the manager thread of joblib's (loky's) reusable executor", owned=_loky_manager),
)


def _relaunch_of_this_session(pid: Any) -> bool:
    """A pytest running this session's own command line again: another rank of a job whose
    launcher relaunches the script (Lightning's DDP launcher does, for rank 1 and up)."""
    command = procs.command_line(int(pid))
    same = "pytest" in command and command.startswith(sys.executable) and command.endswith(" ".join(sys.argv[1:]))
    # a child forked from this process (multiprocessing's default, os.fork) has this command
    # line too, but never exec'd: its first environment is this process's own, where a
    # launcher's relaunch was started with its rank's (LOCAL_RANK=1, ...)
    return same and _first_environment(pid) != _first_environment("self")


def _first_environment(pid: Any) -> bytes | None:
    """The environment a process was started with (its image's, not what it set since)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return None


def _lightning_child_observer(t: Any) -> bool:
    cls = type(t)
    return cls.__name__ == "_ChildProcessObserver" and cls.__module__.endswith("launchers.subprocess_script")


@dataclass(frozen=True)
class SlowToEnd:
    kind: str
    what: str
    owned: Callable[[Any], bool]  # given the pid or the thread
    seconds: float


# Not singletons: things a test leaves that end by themselves, given time. Their end is
# waited for, up to ``seconds``, before they are judged.
SLOW_TO_END: tuple[SlowToEnd, ...] = (
    SlowToEnd(
        "process",
        "another rank of this session's command line, relaunched by a launcher, ending its own session",
        _relaunch_of_this_session,
        30.0,
    ),
    SlowToEnd(
        "thread",
        "Lightning's _ChildProcessObserver, which looks at its ranks every 5 s and ends when they did",
        _lightning_child_observer,
        10.0,
    ),
)


def patience(leak: Leak, obj: Any) -> float:
    """How long a leaked process or thread may take to end by itself before it is judged."""
    for entry in SLOW_TO_END:
        if entry.kind == leak.kind and entry.owned(obj):
            return entry.seconds
    return 0.0


def known(leak: Leak, obj: Any = None) -> Singleton | None:
    """The process-wide singleton this leak is, or None."""
    for entry in KNOWN:
        if entry.matches(leak, obj):
            return entry
    return None
