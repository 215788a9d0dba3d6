"""faulthandler's dumps in a process the harness watches (a rank, a special test's
interpreter), kept armed whatever the code under test does with signal handlers.

Python does not see the handlers faulthandler installs: ``signal.getsignal`` still says
SIG_DFL. Code that saves every handler and puts them back (Lightning's trainer does, around
each fit) then sets SIGUSR1 to its default action, and the harness's request for a stack
kills the process; the crash handlers go the same way. So whenever Python code sets one of
those signals back to SIG_DFL, the dump is armed again at once.
"""

from __future__ import annotations

import faulthandler
import signal
from collections.abc import Callable
from typing import Any

_arming: dict[int, Callable[[], None]] = {}  # signal -> how to arm its dump again
_python_signal: Any = None


def keep_armed(signals: tuple[int, ...], arm: Callable[[], None]) -> None:
    """Call ``arm`` now, and again each time one of ``signals`` is set back to SIG_DFL."""
    global _python_signal
    arm()
    for signum in signals:
        _arming[int(signum)] = arm
    if _python_signal is None:
        _python_signal = signal.signal
        signal.signal = _signal


def _signal(signalnum: Any, handler: Any) -> Any:
    previous = _python_signal(signalnum, handler)
    arm = _arming.get(int(signalnum))
    if arm is not None and handler == signal.SIG_DFL:
        arm()
    return previous


def release(signum: int) -> None:
    """Give ``signum`` back its default action where the harness took it for dumps and the
    code under test set no handler of its own (an injected kill with that signal must kill)."""
    if int(signum) in _arming and signal.getsignal(signum) in (signal.SIG_DFL, None):
        if int(signum) in CRASH_SIGNALS:  # armed all at once by enable(): released the same way
            for crash in CRASH_SIGNALS:
                _arming.pop(int(crash), None)
            faulthandler.disable()
            return
        del _arming[int(signum)]
        faulthandler.unregister(signum)


def register(signum: int, file: Any) -> None:
    """Every thread's stack to ``file`` on ``signum``, installed anew (faulthandler keeps a
    registration it thinks is in place, though its handler was replaced since)."""
    faulthandler.unregister(signum)
    faulthandler.register(signum, file=file, all_threads=True, chain=False)


def enable(fd: int) -> None:
    """A fatal error's dump (every thread) to ``fd``, installed anew."""
    faulthandler.disable()
    faulthandler.enable(file=fd, all_threads=True)


CRASH_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL") if hasattr(signal, name)
)
