"""pytest-ddphooks: test distributed hook ordering on real multi-process gloo groups."""

from .recorder import NeverWaitedWarning, Recorder, Timeline, TimelineAssertionError

__version__ = "0.1.0"
__all__ = ["NeverWaitedWarning", "Recorder", "Timeline", "TimelineAssertionError", "__version__"]
