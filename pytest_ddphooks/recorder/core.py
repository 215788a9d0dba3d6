"""The Recorder: instrumented calls, framework barriers and marks, recorded per rank."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import marshal
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from . import events
from .events import EventFile, RawEvent
from .timeline import Timeline

T = TypeVar("T")

_SYNC_KINDS = (events.COLLECTIVE, events.P2P)


class _GroupCounter:
    """What this rank has seen of one group's own sequence counter (every collective and
    send/recv on the group advances it, whichever API issued it)."""

    __slots__ = ("calls", "expected", "offset")

    def __init__(self) -> None:
        self.offset = 0  # how far this rank's own sends and receives advanced it
        self.expected: int | None = None  # its value after the last recorded call
        self.calls = 0  # recorded calls, for a group whose counter cannot be read


_INSTRUMENTED = "__ddphooks_instrumented__"  # on a wrapper: (recorder, kind, event name)
_current: Recorder | None = None
_active: list[Recorder] = []  # activated and not closed yet, oldest first; _current is the last


def current() -> Recorder | None:
    """The recorder torch.distributed calls are recorded into, if any."""
    return _current


def _plain(value: Any) -> Any:
    """A value marshal can write: primitives stay, containers recurse, the rest is repr'd."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


class Recorder:
    """Records hook calls, barriers, marks and torch.distributed calls of one rank.

    Usable without pytest: ``with Recorder() as rec: ...; rec.timeline()``. In a multirank
    test the harness builds one per rank, writing to a crash-safe file, and ``timeline()``
    gathers every rank's events.
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        event_file: str | os.PathLike[str] | None = None,
        exchange: Callable[[bytes], list[bytes]] | None = None,
    ) -> None:
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self._raw: list[RawEvent] = []
        self._file = EventFile(event_file) if event_file is not None else None
        self._exchange = exchange
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._lanes: dict[int, int] = {}
        self._issued: dict[int, int] = {}
        self._seq: dict[Any, int] = {}
        self._p2p: dict[tuple[Any, ...], int] = {}
        self._counters: dict[str, _GroupCounter] = {}
        self._incarnation = 1  # of the groups: destroy_process_group ends one
        self._pending: dict[int, tuple[Any, int, str, dict[str, Any]]] = {}  # id(work) -> what it completes
        self._undo: list[Callable[[], None]] = []
        self._timelines = 0
        self._active = False
        main = threading.main_thread()
        self._lane_of(main.ident or 0, main.name)

    # -- recording ---------------------------------------------------------------------------

    def _lane_of(self, ident: int, name: str | None = None) -> int:
        lane = self._lanes.get(ident)
        if lane is None:
            with self._lock:
                lane = self._lanes.setdefault(ident, len(self._lanes))
            if name is None:
                name = threading.current_thread().name
            self._write((0, time.time_ns(), lane, events.META, events.POINT, name, {"ident": ident}))
        return lane

    def _write(self, record: RawEvent) -> None:
        self._raw.append(record)
        if self._file is not None:
            with self._lock:
                self._file.write(record)

    def _emit(self, kind: str, phase: str, name: str, info: dict[str, Any] | None, call_id: int) -> int:
        lane = self._lanes.get(threading.get_ident())
        if lane is None:
            lane = self._lane_of(threading.get_ident())
        if phase == events.START and kind in _SYNC_KINDS and (info is None or info.get("effective", True)):
            self._issued[lane] = self._issued.get(lane, 0) + 1
        self._write((call_id, time.time_ns(), lane, kind, phase, name, info))
        return lane

    def begin(self, kind: str, name: str, info: dict[str, Any] | None = None) -> int:
        call_id = next(self._ids)
        self._emit(kind, events.START, name, info, call_id)
        return call_id

    def end(self, call_id: int, kind: str, name: str, info: dict[str, Any] | None = None) -> None:
        self._emit(kind, events.END, name, info, call_id)

    def mark(self, name: str, **info: Any) -> None:
        """Record a point event ``name`` with optional details."""
        self._emit(events.MARK, events.POINT, str(name), _plain(info) if info else None, next(self._ids))

    def issued_on_this_thread(self) -> int:
        """How many collectives (on an existing group) this thread has started so far."""
        return self._issued.get(self._lanes.get(threading.get_ident(), -1), 0)

    def next_seq(self, group: Any) -> int:
        n = self._seq.get(group, 0) + 1
        self._seq[group] = n
        return n

    def group_key(self, name: str) -> str:
        """A group's name in the events: its own, with the incarnation once the groups were
        destroyed and created again (group names and counters start over then)."""
        return name if self._incarnation == 1 else f"{name}/{self._incarnation}"

    def groups_destroyed(self) -> None:
        self._incarnation += 1
        self._counters.clear()

    def _counter_of(self, group: str) -> _GroupCounter:
        state = self._counters.get(group)
        if state is None:
            state = self._counters[group] = _GroupCounter()
        return state

    def collective_seq(self, group: str, counter: int | None) -> tuple[int, int]:
        """The number that pairs a collective starting now on ``group`` across its members,
        and how many calls on the group this rank made since its last recorded one, unseen.

        The number is the group's own counter (``counter``, read before the call) less what
        this rank's own sends and receives added to it: every member agrees on it, however
        the collectives were issued, so calls the recorder could not see never shift it."""
        state = self._counter_of(group)
        state.calls += 1
        if counter is None:
            return state.calls, 0
        unseen = counter - state.expected if state.expected is not None and counter > state.expected else 0
        return counter - state.offset + 1, unseen

    def group_created(self, group: str, counter: int | None) -> None:
        """A group came into being with its counter at ``counter`` (0): from here on, any call
        on it the recorder does not see is a gap."""
        if counter is not None:
            self._counter_of(group).expected = counter

    def counted(self, group: str, before: int | None, after: int | None, p2p: bool) -> None:
        """A call on ``group`` returned with the group's counter at ``after``."""
        if not group or before is None or after is None:
            return
        state = self._counter_of(group)
        state.expected = after
        if p2p:
            state.offset += after - before

    def awaiting(self, work: Any, call_id: int, name: str, info: dict[str, Any]) -> None:
        """An asynchronous call returned ``work``: its wait is where it completes."""
        self._pending[id(work)] = (work, call_id, name, info)

    def waited(self, work: Any) -> tuple[Any, int, str, dict[str, Any]] | None:
        return self._pending.pop(id(work), None)

    def never_waited(self) -> list[tuple[int, str, dict[str, Any]]]:
        """Asynchronous calls whose work nobody waited for (yet)."""
        return [(call_id, name, info) for _, call_id, name, info in self._pending.values()]

    def next_p2p(self, key: tuple[Any, ...]) -> int:
        n = self._p2p.get(key, 0) + 1
        self._p2p[key] = n
        return n

    # -- instrumentation ---------------------------------------------------------------------

    def instrument(self, target: T, *names: str, prefix: str | None = None) -> T:
        """Record a ``start`` and an ``end`` event for each call of the named methods.

        ``target`` is an object (only it is affected) or a class (every instance is). With no
        names, every public method the class itself defines is wrapped. Events are named
        after the method, or ``prefix.method``.
        """
        owner = target if isinstance(target, type) else type(target)
        if not names:
            names = tuple(
                n
                for n, v in vars(owner).items()
                if not n.startswith("_") and (isinstance(v, (staticmethod, classmethod)) or inspect.isfunction(v))
            )
            if not names:
                raise ValueError(f"{owner.__qualname__} defines no public method to instrument")
        for name in names:
            event_name = f"{prefix}.{name}" if prefix else name
            self._wrap(target, name, events.CALL, event_name)
        return target

    def instrument_barrier(self, target: T, name: str, *, as_name: str | None = None) -> T:
        """Wrap a framework-level barrier method; one that issues no collective is a no-op."""
        self._wrap(target, name, events.BARRIER, as_name or name)
        return target

    def _wrap(self, target: Any, name: str, kind: str, event_name: str) -> None:
        owner = target if isinstance(target, type) else type(target)
        try:
            raw = inspect.getattr_static(target, name)
        except AttributeError:
            raise AttributeError(f"cannot instrument {owner.__qualname__}.{name}: no such attribute") from None
        if isinstance(raw, (staticmethod, classmethod)):
            func = raw.__func__
        elif callable(raw):
            func = raw
        else:
            raise TypeError(f"cannot instrument {owner.__qualname__}.{name}: it is not a method")
        qualname = getattr(func, "__qualname__", f"{owner.__qualname__}.{name}")
        recorder = self
        identity = (id(self), kind, event_name)
        if getattr(func, _INSTRUMENTED, None) == identity:
            return  # instrumented already, the same way: every call is recorded once

        if kind != events.BARRIER and inspect.iscoroutinefunction(func):

            async def acall(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                __tracebackhide__ = True
                call_id = recorder.begin(kind, event_name, {"qualname": qualname})
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    recorder.end(call_id, kind, event_name, {"error": _error_text(exc)})
                    raise
                recorder.end(call_id, kind, event_name, None)
                return result

            call: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] = acall

        elif kind == events.BARRIER:

            def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                __tracebackhide__ = True
                call_id = recorder.begin(kind, event_name, {"qualname": qualname, "group_existed": _group_exists()})
                before = recorder.issued_on_this_thread()
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    recorder.end(
                        call_id,
                        kind,
                        event_name,
                        {"collectives": recorder.issued_on_this_thread() - before, "error": _error_text(exc)},
                    )
                    raise
                recorder.end(call_id, kind, event_name, {"collectives": recorder.issued_on_this_thread() - before})
                return result

        else:

            def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                __tracebackhide__ = True
                call_id = recorder.begin(kind, event_name, {"qualname": qualname})
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    recorder.end(call_id, kind, event_name, {"error": _error_text(exc)})
                    raise
                recorder.end(call_id, kind, event_name, None)
                return result

        is_async = kind != events.BARRIER and inspect.iscoroutinefunction(func)
        if isinstance(target, type):
            # a classmethod's wrapper gets the class as its first argument, like the function
            wrapper = _forwarder(func, func, call, is_async)
            setattr(wrapper, _INSTRUMENTED, identity)
            if isinstance(raw, staticmethod):
                replacement: Any = staticmethod(wrapper)
            elif isinstance(raw, classmethod):
                replacement = classmethod(wrapper)
            else:
                replacement = wrapper
            had_own = name in vars(target)
            setattr(target, name, replacement)
            self._undo.append(_restorer(target, name, raw, had_own))
        else:
            wrapper = _forwarder(func, getattr(target, name), call, is_async)
            setattr(wrapper, _INSTRUMENTED, identity)
            had_own = name in getattr(target, "__dict__", {})
            previous = target.__dict__.get(name) if had_own else None
            try:
                setattr(target, name, wrapper)
            except AttributeError:
                raise TypeError(
                    f"cannot instrument {owner.__qualname__}.{name} on this object (no __dict__);"
                    " instrument its class instead"
                ) from None
            self._undo.append(_restorer(target, name, previous, had_own))

    # -- lifecycle ---------------------------------------------------------------------------

    def activate(self) -> Recorder:
        """Make this the recorder torch.distributed calls are recorded into."""
        global _current
        from . import distpatch

        distpatch.install()
        if not self._active:
            _active.append(self)
            _current, self._active = self, True
        return self

    def close(self) -> None:
        """Undo every instrumentation and stop recording torch.distributed calls."""
        global _current
        while self._undo:
            self._undo.pop()()
        if self._active:
            # closed out of order, a recorder must neither take the others' calls with it nor
            # hand recording back to one that was closed already
            _active.remove(self)
            _current = _active[-1] if _active else None
            self._active = False
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Recorder:
        return self.activate()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------------

    @property
    def events(self) -> list[events.Event]:
        """This rank's events so far."""
        return events.to_events(self.rank, self._raw)[0]

    def timeline(self) -> Timeline:
        """The merged Timeline of every rank (a collective in a multirank test)."""
        local = list(self._raw)
        if self._exchange is None:
            return Timeline.from_raw({self.rank: local})
        self._timelines += 1
        blobs = self._exchange(marshal.dumps(local))
        return Timeline.from_raw({rank: marshal.loads(blob) for rank, blob in enumerate(blobs)})


def _forwarder(
    func: Any,
    fn: Callable[..., Any],
    call: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
    is_async: bool,
) -> Callable[..., Any]:
    """The function put in place of ``func``: it records around ``fn`` (``func`` or bound)."""
    if is_async:

        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            return await call(fn, args, kwargs)

        return functools.wraps(func)(async_wrapper)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return call(fn, args, kwargs)

    try:
        return functools.wraps(func)(wrapper)
    except (AttributeError, TypeError):
        return wrapper


def _restorer(target: Any, name: str, previous: Any, had_own: bool) -> Callable[[], None]:
    def restore() -> None:
        if had_own:
            setattr(target, name, previous)
        else:
            with contextlib.suppress(AttributeError):
                delattr(target, name)

    return restore


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."
