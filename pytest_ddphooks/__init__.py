"""pytest-ddphooks: test distributed hook ordering on real multi-process gloo groups."""

from .recorder import Recorder, Timeline, TimelineAssertionError

__version__ = "0.1.0"
__all__ = ["Recorder", "Timeline", "TimelineAssertionError", "__version__"]
