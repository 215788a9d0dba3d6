"""Wrapping a method so that each call records a start and an end event in an event log.

A target is an object (only that object is affected: the wrapper is set on it) or a class
(every instance: the class attribute is replaced, staticmethods and classmethods keep their
kind). A framework barrier also records whether a process group existed and how many
collectives its thread issued while inside, which is what makes a no-op barrier visible.
Wrapping the same method of the same target the same way twice records once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
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


def _restorer(target: Any, name: str, previous: Any, had_own: bool) -> Undo:
    def restore() -> None:
        if had_own:
            setattr(target, name, previous)
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
    return _restorer(target, name, raw, had_own)


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
    return _restorer(target, name, previous, had_own)


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
    if kind == events.BARRIER:
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
    wrapper = _forwarder(func, fn, call, is_async)
    setattr(wrapper, _INSTRUMENTED, identity)
    setattr(wrapper, _WRAPPED, (raw, func, fn))
    return _install_on_object(target, name, wrapper)
