"""Instrumentation recorder: events per rank, merged into a Timeline with vector clocks.

Imports neither pytest nor torch; torch.distributed calls are recorded once it is loaded.
"""

from .core import Recorder, current
from .events import Event
from .timeline import Mismatch, NeverWaitedWarning, NoopBarrier, Span, Timeline, TimelineAssertionError

__all__ = [
    "Event",
    "Mismatch",
    "NeverWaitedWarning",
    "NoopBarrier",
    "Recorder",
    "Span",
    "Timeline",
    "TimelineAssertionError",
    "current",
]
