"""pytest-ddphooks: test distributed hook ordering on real multi-process gloo groups.

The package imports without pytest (the pytest layer is ``pytest_ddphooks.plugin``).
"""

from .errors import DdpHooksWarning, InjectedFault, LeakWarning
from .faults import FaultError
from .recorder import NeverWaitedWarning, Recorder, Timeline, TimelineAssertionError

__version__ = "0.1.0"
__all__ = [
    "DdpHooksWarning",
    "FaultError",
    "InjectedFault",
    "LeakWarning",
    "NeverWaitedWarning",
    "Recorder",
    "Timeline",
    "TimelineAssertionError",
    "__version__",
]
