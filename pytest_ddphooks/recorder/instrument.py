"""Wrapping a method so that each call records a start and an end event in an event log.

A target is an object (only that object is affected: the wrapper is set on it) or a class
(every instance: the class attribute is replaced, staticmethods and classmethods keep their
kind). A call is recorded over what it runs: a coroutine over its awaited body, a generator
over its steps, a ``@contextmanager`` over the ``with`` statement (also when a plain function,
a decorator's wrapper, returns one of those). A framework barrier also records whether a
process group existed, which threads were running, and how many collectives its own code
issued while inside (``log.counting``), which is what makes a no-op barrier visible.
Wrapping the same method of the same target the same way twice records once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import threading
import types
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any

from . import events, warnsite
from .log import EventLog, counting, error_text

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


class _Span:
    """The events of one instrumented function's calls. A barrier's also say whether a group
    existed and which other threads were already running, and count the collectives its own
    code issued (its thread or the tasks it started; not the code its caller runs in a ``with``
    block or between a generator's steps)."""

    def __init__(self, log: EventLog, kind: str, event_name: str, qualname: str) -> None:
        self.log, self.kind, self.name = log, kind, event_name
        self.static = {"qualname": qualname}  # the same for every call: the event file writes it compact

    def begin(self) -> tuple[int, list[int] | None]:
        if self.kind != events.BARRIER:
            return self.log.begin(self.kind, self.name, self.static, self.static), None
        info = {**self.static, "group_existed": group_exists(), "running": _other_threads()}
        return self.log.begin(self.kind, self.name, info), []

    def end(self, call_id: int, issued: list[int] | None, exc: BaseException | None) -> None:
        info: dict[str, Any] | None = None
        if isinstance(exc, GeneratorExit):
            info = {"closed": True}  # a generator left before its end
        elif exc is not None:
            info = {"error": error_text(exc)}
        if issued is not None:
            # the call ids of the collectives it issued: ownership, where lanes and times tell only nearness
            info = {**(info or {}), "collectives": len(issued), "own_calls": list(issued)}
        self.log.end(call_id, self.kind, self.name, info)


def _other_threads() -> list[int]:
    """The threads running beside this one: a collective of theirs is not a barrier's own."""
    me = threading.get_ident()
    return sorted(t.ident for t in threading.enumerate() if t.ident is not None and t.ident != me)


# a span's call id and, for a barrier, the call ids of the collectives it issued, once it began
Started = tuple[int, "list[int] | None"]


def _plain_call(span: _Span) -> _Call:
    def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        started = span.begin()
        try:
            with counting(started[1]):
                result = fn(*args, **kwargs)
        except BaseException as exc:
            span.end(*started, exc)
            raise
        # what a decorated coroutine, generator or @contextmanager function returns runs later:
        # the span goes on over that
        body = _body_of(span, result, started, (call, fn, args, kwargs))
        if body is None:
            span.end(*started, None)
            return result
        return body

    return call


def _body_of(span: _Span, result: Any, started: Started, call: tuple[_Call, Any, Any, Any]) -> Any:
    """What stands for ``result`` so that the span ends with the body it holds; None when it
    holds none (``call``: how to make the call anew, for a context manager used as a decorator)."""
    if inspect.iscoroutine(result):
        return _awaited(span, result, started)
    if inspect.isgenerator(result):
        return _steps(span, result, started)
    if inspect.isasyncgen(result):
        return _async_steps(span, result, started)
    if isinstance(result, _CONTEXT_MANAGERS) and _spans_body(span, result, started):
        # used as a decorator, it makes a manager anew for each call: each is a call of its own
        result._recreate_cm = functools.partial(*call)  # type: ignore[method-assign, misc]
        return result
    return None


def _spans_body(span: _Span, manager: Any, started: Started | None) -> bool:
    """Make a contextlib manager's generator record the span over its steps (from ``started``,
    else from entering it)."""
    inner = getattr(manager, "gen", None)
    if inspect.isgenerator(inner):
        manager.gen = _steps(span, inner, started)
    elif inspect.isasyncgen(inner):
        manager.gen = _async_steps(span, inner, started)
    else:
        return False
    return True


def _context_call(span: _Span) -> _Call:
    """A ``@contextmanager`` function: the events span the ``with`` statement, from entering to
    leaving it; calling the function runs none of its body, and a manager made but never
    entered (one a decorator makes anew for each call) records nothing."""
    plain = _plain_call(span)

    def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        manager = fn(*args, **kwargs)
        if not _spans_body(span, manager, None):
            return plain(lambda: manager, (), {})  # not contextlib's manager after all
        manager._recreate_cm = lambda: call(fn, args, kwargs)
        return manager

    return call


@contextlib.contextmanager
def _sync_probe() -> Generator[None, None, None]:
    yield


@contextlib.asynccontextmanager
async def _async_probe() -> AsyncGenerator[None, None]:
    yield


# the function contextlib puts in place of a @contextmanager generator function
_CONTEXT_FACTORIES = {_sync_probe.__code__, _async_probe.__code__}  # type: ignore[attr-defined]


async def _awaited(span: _Span, coroutine: Any, started: Started) -> Any:
    try:
        with counting(started[1]):
            result = await coroutine
    except BaseException as exc:
        span.end(*started, exc)
        raise
    span.end(*started, None)
    return result


def _awaited_call(span: _Span) -> _Call:
    """A coroutine function: the events span the awaited call, not the coroutine's creation."""

    async def acall(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        return await _awaited(span, fn(*args, **kwargs), span.begin())

    return acall


class _CountedSteps:
    """A generator whose own steps count their collectives (``yield from`` drives it)."""

    def __init__(self, inner: Generator[Any, Any, Any], issued: list[int]) -> None:
        self.inner, self.issued = inner, issued

    def __iter__(self) -> _CountedSteps:
        return self

    def __next__(self) -> Any:
        with counting(self.issued):
            return next(self.inner)

    def send(self, value: Any) -> Any:
        with counting(self.issued):
            return self.inner.send(value)

    def throw(self, *exc: Any) -> Any:
        with counting(self.issued):
            return self.inner.throw(*exc)

    def close(self) -> None:
        with counting(self.issued):
            self.inner.close()


def _steps(span: _Span, inner: Generator[Any, Any, Any], started: Started | None = None) -> Generator[Any, Any, Any]:
    """A generator's body runs as it is iterated, not when it is called: the events span it
    from its first step (or from the call that made it, ``started``) to its end (exhausted,
    closed, or raised)."""
    call_id, issued = span.begin() if started is None else started
    try:
        result = yield from (inner if issued is None else _CountedSteps(inner, issued))
    except BaseException as exc:
        span.end(call_id, issued, exc)
        raise
    span.end(call_id, issued, None)
    return result


async def _async_steps(
    span: _Span, inner: AsyncGenerator[Any, Any], started: Started | None = None
) -> AsyncGenerator[Any, Any]:
    """The same for an asynchronous generator; what its consumer sends or throws in reaches it."""
    call_id, issued = span.begin() if started is None else started
    sent: Any = None
    thrown: BaseException | None = None
    try:
        while True:
            try:
                with counting(issued):
                    item = await (inner.asend(sent) if thrown is None else inner.athrow(thrown))
            except StopAsyncIteration:
                break
            thrown = None
            try:
                sent = yield item
            except GeneratorExit:
                with counting(issued):
                    await inner.aclose()
                raise
            except BaseException as exc:  # thrown in by its consumer: the generator may handle it
                thrown = exc
    except BaseException as exc:
        span.end(call_id, issued, exc)
        raise
    span.end(call_id, issued, None)


def _generator_call(span: _Span, is_async: bool) -> _Call:
    def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        inner = fn(*args, **kwargs)
        return _async_steps(span, inner) if is_async else _steps(span, inner)

    return call


# what contextlib's @contextmanager and @asynccontextmanager functions return
_CONTEXT_MANAGERS = (contextlib._GeneratorContextManager, contextlib._AsyncGeneratorContextManager)


def _call_of(span: _Span, func: Any) -> _Call:
    if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
        return _generator_call(span, inspect.isasyncgenfunction(func))
    if getattr(func, "__code__", None) in _CONTEXT_FACTORIES:
        return _context_call(span)
    if inspect.iscoroutinefunction(func):
        return _awaited_call(span)
    return _plain_call(span)  # what it returns decides (a @contextmanager function's manager, ...)


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
    if owner is not target and name.startswith("__") and name.endswith("__"):
        raise TypeError(
            f"cannot instrument {owner.__qualname__}.{name} on one object: Python looks special methods up on"
            " the class, never on the object; instrument its class instead"
        )
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
    is_async = inspect.iscoroutinefunction(func)
    call = _call_of(_Span(log, kind, event_name, qualname), func)
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
