"""Faults injected at a recorded point of a rank: killed, frozen, slowed, or made to raise.

Every rank runs the same arming code (the ``faults`` fixture); a rank arms only the faults
that name it (and the current attempt, see restarts). An armed fault watches the rank's own
recorded events as they are written and acts at the n-th matching one: before the collective
runs for ``"dist.<op>#n"`` (as it is entered), at the start or the end of an instrumented call,
at a mark. What was armed and what fired is written to the rank's event file first, so the
pytest process knows it even of a rank the fault killed.

A rank with nothing armed pays one attribute check per event.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import resource
import signal as signals
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import dump_signals
from .errors import InjectedFault
from .recorder import collectives, events

KILL, STOP, DELAY, RAISE = "kill", "stop", "delay", "raise"


Ranks = int | Sequence[int]  # a rank, or several


class FaultError(ValueError):
    """A fault is armed with a bad argument; the message names it."""


FaultError.__module__ = "pytest_ddphooks"  # how reports name it: where users import it


@dataclass(frozen=True)
class Point:
    """Where a fault acts: the n-th event of this phase and name on the rank."""

    text: str  # as the user wrote it
    phase: str  # events.START, events.END or events.POINT
    name: str  # the event's name: "dist.all_reduce", "setup", a mark's name
    n: int = 1

    def matches(self, kind: str, phase: str, name: str) -> bool:
        return phase == self.phase and name == self.name and (kind == events.MARK) == (phase == events.POINT)


def parse_point(at: Any) -> Point:
    """``"dist.<op>#n"``, ``"start:<name>[#n]"``, ``"end:<name>[#n]"``, ``"mark:<name>[#n]"``."""
    if not isinstance(at, str) or not at.strip():
        raise FaultError(f"at={at!r}: give a recorded point, e.g. 'dist.all_reduce#2', 'start:setup', 'mark:saved'")
    text = at.strip()
    body, sep, count = text.rpartition("#")
    counted = count.isascii() and count.isdigit()
    if not sep or (not counted and not text.startswith("dist.")):
        # the last '#' followed by digits is the count: any other is part of a name ('mark:phase#warmup')
        body, count, counted = text, "1", True
    if not counted or int(count) < 1:
        raise FaultError(f"at={at!r}: the count after '#' must be a number >= 1")
    n = int(count)
    if body.startswith("dist."):
        op = body.removeprefix("dist.")
        if op not in collectives.OPS:
            known = ", ".join(f"dist.{o}" for o in sorted(collectives.OPS, key=lambda o: (o.startswith("_"), o)))
            raise FaultError(f"at={at!r}: the recorder names no call {body!r} (it records {known})")
        return Point(text, events.START, body, n)
    prefix, colon, name = body.partition(":")
    phases = {"start": events.START, "end": events.END, "mark": events.POINT}
    if not colon or prefix not in phases or not name:
        raise FaultError(
            f"at={at!r}: not a point the recorder knows; use 'dist.<op>#n', 'start:<name>', 'end:<name>'"
            " or 'mark:<name>', optionally with '#n'"
        )
    return Point(text, phases[prefix], name, n)


@dataclass(frozen=True)
class Fault:
    action: str  # KILL, STOP, DELAY, RAISE
    ranks: tuple[int, ...]
    at: Point
    attempt: int = 0
    signal: int = signals.SIGKILL
    seconds: float = 0.0
    exc: Any = None  # what RAISE raises: an exception, a class, or None for InjectedFault

    @property
    def call(self) -> str:
        """``kill(at='dist.all_reduce#2')``: how a report names what happened to a rank."""
        extra = ""
        if self.action == KILL and self.signal != signals.SIGKILL:
            extra = f", signal={signals.Signals(self.signal).name!r}"
        elif self.action == DELAY:
            extra = f", seconds={self.seconds:g}"
        if self.attempt:  # the attempt it acts in: what it says of the rank is of that attempt
            extra += f", attempt={self.attempt}"
        name = "raise_" if self.action == RAISE else self.action
        return f"{name}(at={self.at.text!r}{extra})"

    def armed_as(self, rank: int) -> str:
        """``kill(rank=1, at='dist.all_reduce#2')``"""
        return self.call.replace("(", f"(rank={rank}, ", 1)

    @property
    def sign(self) -> str:
        """What a hang report says happened: ``SIGKILL``, ``SIGSTOP``, ``delay``, ``raise``."""
        if self.action == KILL:
            return signals.Signals(self.signal).name
        return "SIGSTOP" if self.action == STOP else self.action


def _default_action(signum: int) -> None:
    """The signal's default action for this process, from any thread (Python's
    ``signal.signal`` works only in the main one; a fault may fire in another)."""
    if threading.current_thread() is threading.main_thread():
        signals.signal(signum, signals.SIG_DFL)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signum, None)  # SIG_DFL is the null handler


def _ranks(rank: Any, world_size: int) -> tuple[int, ...]:
    ranks = list(rank) if isinstance(rank, (list, tuple, set, frozenset)) else [rank]
    if not ranks:
        raise FaultError("rank=[]: name at least one rank")
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_size:
            raise FaultError(f"rank={rank!r}: a rank is an int from 0 to {world_size - 1}")
    return tuple(sorted(set(ranks)))


# signals whose default action stops the process: faults.stop() is the fault that freezes a rank
_STOPPING = frozenset(
    int(getattr(signals, name)) for name in ("SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU") if hasattr(signals, name)
)


def _signal(value: Any) -> int:
    if isinstance(value, str):
        try:
            name = value.strip().upper()
            number = int(signals.Signals[name if name.startswith("SIG") else "SIG" + name])
        except KeyError:
            raise FaultError(f"signal={value!r}: not a signal name (e.g. 'SIGKILL', 'SIGTERM')") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            number = int(signals.Signals(value))
        except ValueError:
            raise FaultError(f"signal={value!r}: not a signal number") from None
    else:
        raise FaultError(f"signal={value!r}: give a signal name such as 'SIGKILL'")
    if number in _STOPPING:
        raise FaultError(
            f"signal={value!r}: {signals.Signals(number).name} stops the rank rather than killing it:"
            " use faults.stop(rank, at), which freezes it and kills it at the end of the test"
        )
    return number


@dataclass
class _Armed:
    fault: Fault
    seen: int = 0
    fired: bool = False


@dataclass
class FaultTrigger:
    """The faults armed on one rank, watching its events (``EventLog.trigger``)."""

    log: Any
    armed: list[_Armed] = field(default_factory=list)

    def __call__(self, kind: str, phase: str, name: str, call_id: int) -> None:
        __tracebackhide__ = True
        due = []
        for entry in self.armed:
            if entry.fired or not entry.fault.at.matches(kind, phase, name):
                continue
            entry.seen += 1
            if entry.seen == entry.fault.at.n:
                entry.fired = True
                due.append(entry.fault)
        # several at one point act in the order they were armed, a raise last: it ends the call
        for fault in sorted(due, key=lambda f: f.action == RAISE):
            self._fire(fault, call_id, phase)

    def _fire(self, fault: Fault, call_id: int, phase: str) -> None:
        __tracebackhide__ = True
        info = {"fault": fault.call, "action": fault.action, "sign": fault.sign, "call_id": call_id, "phase": phase}
        if fault.action == DELAY:
            info["until_ns"] = time.time_ns() + int(fault.seconds * 1e9)  # asleep until then, not in the call
        self.log.write_watch_only(events.FIRED, info)
        if fault.action == KILL:
            dump_signals.release(fault.signal)  # SIGUSR1 dumps stacks here, unless the test kills with it
            if fault.signal == signals.SIGINT and signals.getsignal(signals.SIGINT) is signals.default_int_handler:
                # a kill, not Python's KeyboardInterrupt (raise_(..., exc=KeyboardInterrupt) is that);
                # a handler the code under test installed still gets it
                _default_action(signals.SIGINT)
            with contextlib.suppress(Exception):  # a simulated crash leaves no core file behind
                resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
            os.kill(os.getpid(), fault.signal)
            time.sleep(1.0)  # a signal that does not end at once still ends the process soon
        elif fault.action == STOP:
            os.kill(os.getpid(), signals.SIGSTOP)
        elif fault.action == DELAY:
            time.sleep(fault.seconds)
        else:
            exc = fault.exc
            if exc is None:
                raise InjectedFault(f"injected fault {fault.call}")
            raise exc() if isinstance(exc, type) else exc


class Faults:
    """What the ``faults`` fixture gives a rank: arm faults that act on the ranks they name."""

    def __init__(self, rank: int, world_size: int, log: Any, attempt: int = 0, max_restarts: int | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.max_restarts = max_restarts  # None: not known here
        self._log = log
        self._trigger: FaultTrigger | None = None

    def _arm(self, fault: Fault) -> Fault:
        __tracebackhide__ = True
        if not isinstance(fault.attempt, int) or isinstance(fault.attempt, bool) or fault.attempt < 0:
            raise FaultError(f"attempt={fault.attempt!r}: an attempt is an int >= 0")
        if self.max_restarts is not None and fault.attempt > self.max_restarts:
            raise FaultError(
                f"attempt={fault.attempt}: the test has restarts={self.max_restarts}, so attempts 0 to"
                f" {self.max_restarts} can run: give it restarts={fault.attempt} or more"
                if self.max_restarts
                else f"attempt={fault.attempt}: the test has no restarts, so only attempt 0 runs:"
                f" give it restarts={fault.attempt} or more"
            )
        if self.rank in fault.ranks and fault.attempt == self.attempt:
            if self._trigger is None:
                self._trigger = FaultTrigger(self._log)
                self._log.add_trigger(self._trigger)
            # '#n' counts from the rank's start, as the "never fired" message does
            seen = self._log.occurrences(fault.at.matches)
            if seen >= fault.at.n:
                # the rank did arm it: the verdict must not say it never did (the test may catch this)
                self._log.write_watch_only(
                    events.ARMED, {"fault": fault.armed_as(self.rank), "call": fault.call, "refused": True}
                )
                raise FaultError(
                    f"{fault.armed_as(self.rank)}: rank {self.rank} was past that point when the fault was armed"
                    f" (it had reached it {seen} time{'' if seen == 1 else 's'}; '#n' counts from the rank's start):"
                    " arm it earlier, or name a later call"
                )
            self._trigger.armed.append(_Armed(fault, seen))
            self._log.write_watch_only(
                events.ARMED,
                {"fault": fault.armed_as(self.rank), "call": fault.call, "at": fault.at.text, "sign": fault.sign},
            )
        elif fault.attempt == self.attempt:
            # armed here for other ranks only: if they never arm it too, it can never act
            self._log.write_watch_only(
                events.ARMED, {"fault": fault.call, "call": fault.call, "for": sorted(fault.ranks), "by": self.rank}
            )
        elif self.rank in fault.ranks and fault.attempt > self.attempt:
            # for an attempt to come: if the test ends in this one, the fault never fires
            self._log.write_watch_only(
                events.ARMED,
                {"fault": fault.armed_as(self.rank), "at": fault.at.text, "later": fault.attempt, "now": self.attempt},
            )
        return fault

    def kill(self, rank: Ranks, at: str, signal: str | int = "SIGKILL", *, attempt: int = 0) -> Fault:
        """The rank's process gets ``signal`` (SIGKILL) at that point."""
        __tracebackhide__ = True
        return self._arm(Fault(KILL, _ranks(rank, self.world_size), parse_point(at), attempt, signal=_signal(signal)))

    def stop(self, rank: Ranks, at: str, *, attempt: int = 0) -> Fault:
        """SIGSTOP at that point: the rank is frozen, alive and its sockets open; killed at the end."""
        __tracebackhide__ = True
        return self._arm(Fault(STOP, _ranks(rank, self.world_size), parse_point(at), attempt))

    def delay(self, rank: Ranks, at: str, seconds: float, *, attempt: int = 0) -> Fault:
        """The rank sleeps ``seconds`` there."""
        __tracebackhide__ = True
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise FaultError(f"seconds={seconds!r}: a delay is a number of seconds >= 0")
        return self._arm(Fault(DELAY, _ranks(rank, self.world_size), parse_point(at), attempt, seconds=float(seconds)))

    def raise_(
        self, rank: Ranks, at: str, exc: BaseException | type[BaseException] | None = None, *, attempt: int = 0
    ) -> Fault:
        """Raise ``exc`` (``pytest_ddphooks.InjectedFault`` by default) there."""
        __tracebackhide__ = True
        if (
            exc is not None
            and not isinstance(exc, BaseException)
            and not (isinstance(exc, type) and issubclass(exc, BaseException))
        ):
            raise FaultError(f"exc={exc!r}: give an exception or an exception class")
        if isinstance(exc, type):
            try:  # it is made when the fault fires: one that cannot be made is a bad fault now
                exc()
            except Exception as error:
                raise FaultError(
                    f"exc={exc.__name__}: cannot be made without arguments ({type(error).__name__}: {error}):"
                    f" give an instance, such as exc={exc.__name__}(...)"
                ) from None
        return self._arm(Fault(RAISE, _ranks(rank, self.world_size), parse_point(at), attempt, exc=exc))


UNDER_TORCHRUN = (
    "faults need the plugin's own ranks: under torchrun the ranks belong to torchrun's agent; run this test"
    " without torchrun"
)
OUTSIDE_MULTIRANK = "faults act on the ranks of a multirank test: mark the test @pytest.mark.multirank"


class UnavailableFaults:
    """Where no rank is the plugin's own, arming a fault is an error that says why."""

    def __init__(self, why: str) -> None:
        self._why = why

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise FaultError(self._why)
