"""Which event log torch.distributed calls are recorded into: the last one activated and not
closed yet. A log closed out of order neither takes the others' calls with it nor hands
recording back to one that was closed already."""

from __future__ import annotations

from .log import EventLog

_current: EventLog | None = None
_active: list[EventLog] = []  # activated and not closed yet, oldest first; _current is the last


def current() -> EventLog | None:
    return _current


def activate(log: EventLog) -> None:
    global _current
    if log not in _active:
        _active.append(log)
        _current = log


def deactivate(log: EventLog) -> None:
    global _current
    if log in _active:
        _active.remove(log)
        _current = _active[-1] if _active else None


def suspended() -> EventLog | None:
    """Stop recording into any log (for measurements); ``resume`` it with what this returned."""
    global _current
    log, _current = _current, None
    return log


def resume(log: EventLog | None) -> None:
    global _current
    _current = log
