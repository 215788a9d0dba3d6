"""Wrapping a method so that each call records a start and an end event in an event log.

A target is an object (only that object is affected: the wrapper is set on it) or a class
(every instance: the class attribute is replaced, staticmethods and classmethods keep their
kind). A framework barrier also records whether a process group existed and how many
collectives its thread issued while inside, which is what makes a no-op barrier visible.
Wrapping the same method of the same target the same way twice records once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from . import events, warnsite
from .log import EventLog, error_text

_INSTRUMENTED = "__ddphooks_instrumented__"  # on a wrapper: (log id, kind, event name)
_WRAPPED = "__ddphooks_wrapped__"  # on a wrapper: (the attribute as stored, its function, what it calls)
Undo = Callable[[], None]
_Call = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

warnsite.skip_frames_of(__file__)  # a warning inside a wrapper names its caller


def group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def public_functions(module: types.ModuleType) -> tuple[str, ...]:
    """Every public function a module itself defines (not those it imported)."""
    return tuple(
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == module.__name__
    )


def public_methods(owner: type) -> tuple[str, ...]:
    """Every public method a class itself defines (static and class methods included)."""
    return tuple(
        n
        for n, v in vars(owner).items()
        if not n.startswith("_") and (isinstance(v, (staticmethod, classmethod)) or inspect.isfunction(v))
    )


def _function_of(target: Any, name: str) -> tuple[Any, Callable[..., Any]]:
    """The attribute as stored (to restore it later) and the function it holds."""
    owner = target if isinstance(target, type) else type(target)
    try:
        raw = inspect.getattr_static(target, name)
    except AttributeError:
        raise AttributeError(f"cannot instrument {owner.__qualname__}.{name}: no such attribute") from None
    if isinstance(raw, (staticmethod, classmethod)):
        return raw, raw.__func__
    if callable(raw):
        return raw, raw
    raise TypeError(f"cannot instrument {owner.__qualname__}.{name}: it is not a method")


def _recording_call(log: EventLog, kind: str, event_name: str, qualname: str) -> _Call:
    """Calls the function between a start and an end event."""

    static = {"qualname": qualname}  # the same for every call: the event file writes it compact

    def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        call_id = log.begin(kind, event_name, static, static)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            log.end(call_id, kind, event_name, {"error": error_text(exc)})
            raise
        log.end(call_id, kind, event_name, None)
        return result

    return call


def _recording_acall(log: EventLog, kind: str, event_name: str, qualname: str) -> _Call:
    """The same for a coroutine function: the events span the awaited call."""

    static = {"qualname": qualname}

    async def acall(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        call_id = log.begin(kind, event_name, static, static)
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            log.end(call_id, kind, event_name, {"error": error_text(exc)})
            raise
        log.end(call_id, kind, event_name, None)
        return result

    return acall


def _recording_gencall(log: EventLog, kind: str, event_name: str, qualname: str, is_async: bool) -> _Call:
    """The same for a generator function: calling it runs none of its body, so the events
    span the body, from its first step to its end (exhausted, closed, or raised)."""
    static = {"qualname": qualname}

    def ended(call_id: int, exc: BaseException | None) -> None:
        if exc is None:
            log.end(call_id, kind, event_name, None)
        elif isinstance(exc, GeneratorExit):
            log.end(call_id, kind, event_name, {"closed": True})  # left before its end
        else:
            log.end(call_id, kind, event_name, {"error": error_text(exc)})

    def steps(inner: Any) -> Any:
        call_id = log.begin(kind, event_name, static, static)
        try:
            result = yield from inner
        except BaseException as exc:
            ended(call_id, exc)
            raise
        ended(call_id, None)
        return result

    async def async_steps(inner: Any) -> Any:
        call_id = log.begin(kind, event_name, static, static)
        try:
            async for item in inner:
                yield item
        except BaseException as exc:
            ended(call_id, exc)
            raise
        ended(call_id, None)

    def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        inner = fn(*args, **kwargs)
        return async_steps(inner) if is_async else steps(inner)

    return call


def _barrier_call(log: EventLog, event_name: str, qualname: str) -> _Call:
    """A framework barrier: its events say whether a group existed and how many collectives
    the thread issued inside it."""
    kind = events.BARRIER

    def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        call_id = log.begin(kind, event_name, {"qualname": qualname, "group_existed": group_exists()})
        before = log.issued_on_this_thread()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            issued = log.issued_on_this_thread() - before
            log.end(call_id, kind, event_name, {"collectives": issued, "error": error_text(exc)})
            raise
        log.end(call_id, kind, event_name, {"collectives": log.issued_on_this_thread() - before})
        return result

    return call


def _forwarder(func: Any, fn: Callable[..., Any], call: _Call, is_async: bool) -> Callable[..., Any]:
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


_RETIRED = "__ddphooks_retired__"  # on a wrapper whose recorder closed while another wrapped it
_PREVIOUS = "__ddphooks_previous__"  # on a wrapper: (whether its target had its own attribute, that)


def _underlying(value: Any) -> Any:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _restorer(target: Any, name: str, previous: Any, had_own: bool, mine: Any) -> Undo:
    setattr(mine, _PREVIOUS, (had_own, previous))

    def restore() -> None:
        current = vars(target).get(name) if hasattr(target, "__dict__") else None
        if current is not None and _underlying(current) is not mine:
            # another recorder wrapped it since: that wrapper stays (it calls this one), and
            # passes over this one when it is undone
            setattr(mine, _RETIRED, True)
            return
        own, value = had_own, previous
        while own and getattr(_underlying(value), _RETIRED, False):
            own, value = getattr(_underlying(value), _PREVIOUS)
        if own:
            setattr(target, name, value)
        else:
            with contextlib.suppress(AttributeError):
                delattr(target, name)

    return restore


def _install_on_class(target: type, name: str, raw: Any, wrapper: Callable[..., Any]) -> Undo:
    if isinstance(raw, staticmethod):
        replacement: Any = staticmethod(wrapper)
    elif isinstance(raw, classmethod):
        replacement = classmethod(wrapper)
    else:
        replacement = wrapper
    had_own = name in vars(target)
    setattr(target, name, replacement)
    return _restorer(target, name, raw, had_own, wrapper)


def _install_on_object(target: Any, name: str, wrapper: Callable[..., Any]) -> Undo:
    had_own = name in getattr(target, "__dict__", {})
    previous = target.__dict__.get(name) if had_own else None
    try:
        setattr(target, name, wrapper)
    except AttributeError:
        owner = type(target).__qualname__
        raise TypeError(
            f"cannot instrument {owner}.{name} on this object (no __dict__); instrument its class instead"
        ) from None
    return _restorer(target, name, previous, had_own, wrapper)


def wrap(log: EventLog, target: Any, name: str, kind: str, event_name: str) -> Undo | None:
    """Record every call of ``target.name`` in ``log``; returns how to undo it, or None
    when it was instrumented that way already."""
    raw, func = _function_of(target, name)
    owner = target if isinstance(target, type) else type(target)
    identity = (id(log), kind, event_name)
    fn: Callable[..., Any] | None = None  # what the wrapper calls (on an object: bound)
    done = getattr(func, _INSTRUMENTED, None)
    if done is not None and (done[0], done[2]) == (id(log), event_name):
        if done[1] == kind or done[1] == events.BARRIER:
            return None  # recorded already (a barrier's events are its calls too)
        if kind == events.BARRIER:
            # a method instrumented as a call, now as a barrier: the barrier takes its place
            raw, func, fn = getattr(func, _WRAPPED)
            if not isinstance(target, type) and name not in getattr(target, "__dict__", {}):
                fn = raw.__get__(target, owner)  # the class's wrapper: bind what it wrapped
    qualname = getattr(func, "__qualname__", f"{owner.__qualname__}.{name}")
    is_async = kind != events.BARRIER and inspect.iscoroutinefunction(func)
    generator = inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func)
    if generator:
        # its body runs as it is iterated, not when it is called (a barrier too)
        call = _recording_gencall(log, kind, event_name, qualname, inspect.isasyncgenfunction(func))
    elif kind == events.BARRIER:
        call = _barrier_call(log, event_name, qualname)
    elif is_async:
        call = _recording_acall(log, kind, event_name, qualname)
    else:
        call = _recording_call(log, kind, event_name, qualname)
    if isinstance(target, type):
        # a classmethod's wrapper gets the class as its first argument, like the function
        wrapper = _forwarder(func, func, call, is_async)
        setattr(wrapper, _INSTRUMENTED, identity)
        setattr(wrapper, _WRAPPED, (raw, func, func))
        return _install_on_class(target, name, raw, wrapper)
    if fn is None:
        fn = getattr(target, name)
    own = name in getattr(target, "__dict__", {})
    wrapper = _ObjectWrapper(target, name, raw if own else None, _forwarder(func, fn, call, is_async))
    setattr(wrapper, _INSTRUMENTED, identity)
    setattr(wrapper, _WRAPPED, (raw, func, fn))
    return _install_on_object(target, name, wrapper)


class _ObjectWrapper:
    """What an instrumented object holds in place of its method: it records the calls of that
    object's method. A deep copy of the object (an EMA model) gets its own method back, not
    this, which runs on the original; pickling the object (torch.save, mp.spawn,
    broadcast_object_list) pickles the method as the object's own."""

    def __init__(self, target: Any, name: str, own: Any, forward: Callable[..., Any]) -> None:
        with contextlib.suppress(AttributeError, TypeError):
            functools.update_wrapper(self, forward)  # first: it copies what ``forward`` carries
        self._target = target
        self._name = name
        self._own = own  # what the object itself held under that name before, if anything
        self._forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return self._forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copied = memo.get(id(self._target))
        if copied is None:
            return self  # copied without its object: it is still that object's method
        if self._own is not None:
            return copy.deepcopy(self._own, memo)
        return getattr(type(copied), self._name).__get__(copied, type(copied))

    def __reduce__(self) -> tuple[Any, ...]:
        if self._own is not None:
            return (_itself, (self._own,))
        return (getattr, (self._target, self._name))


def _itself(value: Any) -> Any:
    return value
