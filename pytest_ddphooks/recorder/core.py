"""The Recorder: instrumented calls, framework barriers and marks, recorded per rank, and
the merged Timeline of every rank."""

from __future__ import annotations

import marshal
import threading
import time
import types
from collections.abc import Callable
from typing import Any, TypeVar

from . import active, distpatch, events, warnsite
from .instrument import Undo, public_functions, public_methods, wrap
from .log import EventLog
from .native import NativeCalls
from .timeline import Calls, Mismatch, Timeline

# how long after a gap was found its flight-recorder entries may still be coming (torch writes one
# a moment after it counted the call; measured here up to some milliseconds on a busy machine)
_ENTRY_GRACE_S = 0.25

T = TypeVar("T")
Exchange = Callable[[bytes], list[bytes]]


def current() -> EventLog | None:
    """The recorder torch.distributed calls are recorded into, if any."""
    return active.current()


class Recorder(EventLog):
    """Records hook calls, barriers, marks and torch.distributed calls of one rank.

    Usable without pytest: ``with Recorder() as rec: ...; rec.timeline()``. In a multirank
    test the harness builds one per rank, writing to a crash-safe file, and ``timeline()``
    gathers every rank's events.
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        event_file: str | None = None,
        exchange: Exchange | None = None,
    ) -> None:
        super().__init__(rank, world_size, event_file=event_file)
        warnsite.hold()  # until close(): warnings inside its wrappers name their callers
        self._holds_warnings = True
        self._exchange = exchange
        self._exchanges = 0
        self._undo: list[Undo] = []
        self._active = False
        self._closed = False
        self._native = NativeCalls()
        self._native_lock = threading.Lock()
        # (group, seq) -> what each member called, of the collective mismatches the test looked
        # at itself (``collective_mismatches``)
        self.mismatches_checked: dict[tuple[str, int], Calls] = {}

    # -- instrumentation ---------------------------------------------------------------------

    def instrument(self, target: T, *names: str, prefix: str | None = None) -> T:
        """Record a ``start`` and an ``end`` event for each call of the named methods.

        ``target`` is an object (only it is affected) or a class (every instance is). With no
        names, every public method the class itself defines is wrapped (for a module, every public
        function it defines). Events are named
        after the method, or ``prefix.method``.
        """
        self._open("instrument")
        for name in names:
            if not isinstance(name, str):
                raise TypeError(
                    f"instrument() takes the names of methods one by one, as strings: got {type(name).__name__} "
                    f"{name!r} (write instrument(target, 'a', 'b'), or instrument(target, *names))"
                )
        owner = target if isinstance(target, type) else type(target)
        if not names and isinstance(target, types.ModuleType):
            names = public_functions(target)
            if not names:
                raise ValueError(f"module {target.__name__} defines no public function to instrument")
        elif not names:
            names = public_methods(owner)
            if not names:
                raise ValueError(f"{owner.__qualname__} defines no public method to instrument")
        for name in names:
            self._wrap(target, name, events.CALL, f"{prefix}.{name}" if prefix else name)
        return target

    def instrument_barrier(self, target: T, name: str, *, as_name: str | None = None) -> T:
        """Wrap a framework-level barrier method; one that issues no collective is a no-op."""
        self._open("instrument_barrier")
        self._wrap(target, name, events.BARRIER, as_name or name)
        return target

    def mark(self, name: str, /, **info: Any) -> None:
        """Record a point event ``name`` with optional details."""
        self._open("mark")
        super().mark(name, **info)

    def _open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"{what}(): this Recorder was closed (every method it wrapped was put back); "
                "a closed Recorder records nothing more: use a new one"
            )

    def _wrap(self, target: Any, name: str, kind: str, event_name: str) -> None:
        undo = wrap(self, target, name, kind, event_name)
        if undo is not None:
            self._undo.append(undo)

    # -- lifecycle ---------------------------------------------------------------------------

    def activate(self) -> Recorder:
        """Make this the recorder torch.distributed calls are recorded into."""
        self._open("activate")
        distpatch.install()
        if not self._active:
            active.activate(self)
            self._active = True
            distpatch.take_over_groups(self)
        return self

    def close(self) -> None:
        """Undo every instrumentation and stop recording torch.distributed calls."""
        self._closed = True
        self.close_gaps()
        if self.gaps_found():
            # a send among them would shift the next log's numbering too; no waiting here (the
            # watch takes a rank that lingers at its end for one that waits)
            self.read_native(grace=False)
        self.carry_numbering()
        self.let_go()
        while self._undo:
            self._undo.pop()()
        if self._active:
            active.deactivate(self)
            self._active = False
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._holds_warnings:
            self._holds_warnings = False
            warnsite.release()

    def __enter__(self) -> Recorder:
        return self.activate()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------------

    @property
    def events(self) -> list[events.Event]:
        """This rank's events so far."""
        return events.to_events(self.rank, self.records())[0]

    def read_native(self, grace: bool = True) -> None:
        """Add what native code issued since the last look (DDP's reducer, compiled graphs),
        from torch's flight recorder (``grace``: an unexplained gap is looked for again)."""
        with self._native_lock:  # the ask thread and the body may both read
            if not self.native_may_have_issued():
                return
            judged = self.gaps_found()  # found before the dump: their calls are in it, if collectives
            self.add_native(self._native.read(self))
            self.native_read()
            unexplained = [gap for gap in judged if len(gap[1]) > gap[2]]
            if unexplained and grace:
                # torch counts a call on a group before it writes the call's flight-recorder entry
                # (from the issuing thread, a moment later): look again once the youngest gap is
                # old enough for its entries to be there, if collectives
                wait = _ENTRY_GRACE_S - (time.monotonic() - max(gap[4] for gap in unexplained))
                if wait > 0:
                    time.sleep(wait)
                self.add_native(self._native.read(self))
                self.native_read()
            self.judge_gaps(judged, self._native.reliable_from, self._native.held_any)

    def timeline(self) -> Timeline:
        """The merged Timeline of every rank (a collective in a multirank test)."""
        self.read_native()
        local = self.records()
        if self._exchange is None:
            return Timeline.from_raw({self.rank: local})
        self._exchanges += 1
        # the watchdog learns from the event file that this rank waits in timeline()
        self._write_file_only(events.EXCHANGE, events.START, "timeline", {"n": self._exchanges})
        blobs = self._exchange(marshal.dumps(local))
        self._write_file_only(events.EXCHANGE, events.END, "timeline", {"n": self._exchanges})
        merged = Timeline.from_raw({rank: marshal.loads(blob) for rank, blob in enumerate(blobs)})
        merged.on_mismatches_found = self._mismatches_checked
        return merged

    def _mismatches_checked(self, found: list[Mismatch]) -> None:
        """The test was given these mismatches (each group's first) and looked at them itself:
        where no rank then fails, it expected them, and the harness does not fail it as a
        desync (they travel with the rank's result)."""
        self.mismatches_checked.update({(m.group, m.seq): m.called for m in found})
