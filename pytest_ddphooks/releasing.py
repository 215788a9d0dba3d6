"""What a finished, failed test still holds only through its failure: released before judging.

A failing test's exception keeps its traceback, the traceback its frames, the frames every
local the test had: a socket, a process group, a whole trainer. Python keeps the last one in
``sys.last_value`` (for ``pdb.pm()``), plugins keep theirs (pytest-rerunfailures keeps each
failed phase's ``ExceptionInfo`` on the item). The exceptions themselves stay as they are;
only the locals of their finished frames are cleared, which is all a report ever read.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

# a frame of generator code may belong to a suspended generator: clearing it would close it
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


def _exceptions_in(value: Any, depth: int = 2) -> Iterable[BaseException]:
    """Exceptions held by ``value``: itself, an ExceptionInfo's, or those in a container."""
    if isinstance(value, BaseException):
        yield value
        return
    held = getattr(value, "_excinfo", None) if type(value).__name__ == "ExceptionInfo" else None
    if held is not None and isinstance(held, tuple) and len(held) == 3:
        if isinstance(held[1], BaseException):
            yield held[1]
        return
    if depth <= 0:
        return
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        for element in list(value):
            yield from _exceptions_in(element, depth - 1)


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        todo.extend(x for x in getattr(e, "exceptions", ()) if isinstance(x, BaseException))


def clear_frames(exc: BaseException) -> int:
    """Drop the locals of every finished frame in ``exc``'s tracebacks; returns how many."""
    cleared = 0
    for e in _chain(exc):
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if not frame.f_code.co_flags & _GENERATOR_FLAGS:
                try:
                    frame.clear()
                    cleared += 1
                except RuntimeError:  # still executing
                    pass
                else:
                    # Python 3.11 keeps the dict a reader of f_locals got (pytest's repr
                    # did): reading it again syncs the cleared locals into it
                    _ = frame.f_locals
            tb = tb.tb_next
    return cleared


def release_failures(holders: Iterable[Any] = ()) -> int:
    """Clear the frames of the failures Python and ``holders`` (objects whose attributes may
    keep exceptions, such as a test item) still hold."""
    found: list[BaseException] = []
    for name in ("last_value", "last_exc"):
        value = getattr(sys, name, None)
        if isinstance(value, BaseException):
            found.append(value)
    for holder in holders:
        attributes = holder if isinstance(holder, dict) else getattr(holder, "__dict__", {})
        for value in list(attributes.values()):
            found.extend(_exceptions_in(value))
    return sum(clear_frames(e) for e in found)
