"""pytest-ddphooks: test distributed hook ordering on real multi-process gloo groups.

The package imports without pytest (the pytest layer is ``pytest_ddphooks.plugin``).
"""

from .errors import DdpHooksWarning, InjectedFault, LeakWarning
from .faults import Fault, FaultError, Faults
from .recorder import (
    Event,
    Mismatch,
    NeverWaitedWarning,
    NoopBarrier,
    Recorder,
    Span,
    Timeline,
    TimelineAssertionError,
)

__version__ = "0.1.0"
__all__ = [
    "DdpHooksWarning",
    "Event",
    "Fault",
    "FaultError",
    "Faults",
    "InjectedFault",
    "LeakWarning",
    "Mismatch",
    "NeverWaitedWarning",
    "NoopBarrier",
    "Recorder",
    "Span",
    "Timeline",
    "TimelineAssertionError",
    "__version__",
]
