"""One rank's event log: what every recorded call writes, and the bookkeeping that pairs
its collectives with the other ranks' (the groups' own sequence counters, sends and
receives, asynchronous work waiting for its wait)."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from . import events
from .events import END, POINT, START, EventFile, RawEvent

get_ident = threading.get_ident
time_ns = time.time_ns

_SYNC_KINDS = (events.COLLECTIVE, events.P2P)
# an asynchronous call waiting for its completion: (its Work, call id, name, start info, static info)
Pending = tuple[Any, int, str, dict[str, Any], Any]
# per group, how the last log that saw it left its numbering: (the counter after its last recorded
# call, the offset of this rank's sends and receives, why it was untrusted, why its numbering was lost,
# when that log left it)
_carried: weakref.WeakKeyDictionary[Any, tuple[int, int, str | None, str | None, int]] = weakref.WeakKeyDictionary()
# a gap: its group, its op_ids no flight-recorder entry was read for yet, how many of them may be
# missing (a recorded call's own sends and receives), when the last recorded call before it ended
# (time_ns), when it was found (monotonic)
Gap = tuple[str, set[int], int, int, float]
_NUMBERING_LOST = (
    "a call on the group that neither the recorder nor torch's flight recorder saw (a send or receive issued"
    " through torch.ops.c10d, say) moved this rank's count of the group's calls, so its later calls there have"
    " no place in the group's sequence anyone can be sure of"
)
_NUMBERING_UNKNOWN = (
    "a call on the group the recorder did not see moved this rank's count of the group's calls, and torch's"
    " flight recorder, which would tell whether it was a collective, held nothing (switched off:"
    " TORCH_FR_BUFFER_SIZE=0?), so its later calls there have no place in the group's sequence anyone can be sure of"
)
_TRACKED_GAP = 4096  # of a longer run of calls the recorder did not see, the last ones are looked for
# futures of asynchronous calls kept for a wait from Python: most are waited for natively (DDP's
# reducer, once a step per bucket), and each holds its value; a wait from Python comes soon
_HANDED_KEPT = 64


# the collectives of the framework barriers open here (each barrier's list of their call ids): per
# context, so that a barrier owns what its own code issues (its thread, the tasks and ``to_thread``
# calls it starts), not what another task interleaved on the same thread issues
_counting: contextvars.ContextVar[tuple[list[int], ...]] = contextvars.ContextVar("ddphooks_counting", default=())
_NOT_COUNTING = contextlib.nullcontext()


@contextlib.contextmanager
def _counted(issued: list[int]) -> Any:
    token = _counting.set((*_counting.get(), issued))
    try:
        yield
    finally:
        _counting.reset(token)


def counting(issued: list[int] | None) -> contextlib.AbstractContextManager[Any]:
    """Add to ``issued`` the call id of each collective issued in this context meanwhile (None: nothing)."""
    return _NOT_COUNTING if issued is None else _counted(issued)


def _issues(info: dict[str, Any] | None) -> bool:
    """Whether a call starting with ``info`` issues a collective now: one on no group does not,
    nor one a coalescing manager only queues (it issues them as one at its exit)."""
    return info is None or (info.get("effective", True) and not info.get("queued"))


def _uncount(call_id: int) -> None:
    """A collective counted as issued at its start never reached its group (one that was not
    counted, as it issued nothing, is in no list)."""
    for issued in _counting.get():
        if call_id in issued:
            issued.remove(call_id)


def group_counter(pg: Any) -> int | None:
    """A group's own sequence counter; None where it cannot be read (destroyed, or a backend
    without one)."""
    try:
        return pg._get_sequence_number_for_group()  # type: ignore[no-any-return]
    except Exception:
        return None


class _GroupCounter:
    """What this rank has seen of one group's own sequence counter (every collective and
    send/recv on the group advances it, whichever API issued it)."""

    __slots__ = (
        "anchor_ns",
        "calls",
        "collective_overlapped",
        "episode",
        "expected",
        "in_flight",
        "offset",
        "open",
        "overlapped",
        "untrusted",
    )

    def __init__(self) -> None:
        self.offset = 0  # how far this rank's own sends and receives advanced it
        self.expected: int | None = None  # its value after the last recorded call
        self.anchor_ns = 0  # when ``expected`` was last set: where a gap after it begins
        # while recorded calls on the group run (one, or several on threads): [its counter when the
        # first began, the collectives and the sends and receives they issued, all of them known,
        # when it began (time_ns)]
        self.episode: list[Any] | None = None
        self.in_flight: int | None = None  # its value when a recorded call that has not returned began
        self.calls = 0  # recorded calls, for a group whose counter cannot be read
        self.open = 0  # recorded calls on the group running now (on any thread)
        self.overlapped = False  # a call began while another was running, since none ran
        self.collective_overlapped = False  # so did a collective (not a send or receive)
        # why this rank's own count of the group can no longer be trusted, once it cannot
        self.untrusted: str | None = None


class EventLog:
    """The events of one rank, in memory and, with ``event_file``, in a crash-safe file."""

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        event_file: str | os.PathLike[str] | None = None,
    ) -> None:
        # not given: the default group's, else the launcher's environment; a group created
        # later, while recording, tells them then (``joined``)
        self._placed = rank is not None, world_size is not None
        group = _default_group_place()
        if rank is None:
            rank = group[0] if group is not None else int(os.environ.get("RANK", 0))
        if world_size is None:
            world_size = group[1] if group is not None else int(os.environ.get("WORLD_SIZE", 1))
        self.rank, self.world_size = rank, world_size
        # the records, a call's kept packed (``_emit``): read them through ``records()``
        self._raw: list[tuple[Any, ...]] = []
        # (id(static), numbered) -> its form's number; number -> (static, numbered), kept alive
        # so that no other dict takes its id
        self._form_of: dict[tuple[int, tuple[str, ...]], int] = {}
        self._forms: list[tuple[dict[str, Any], tuple[str, ...]]] = []
        self._file = EventFile(event_file) if event_file is not None else None
        _live_logs.add(self)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._lanes: dict[int, int] = {}  # thread id -> the lane of the thread that has it now
        self._lane_threads: list[Any] = []  # lane -> its thread (None: a thread seen from outside)
        self._local = threading.local()  # this thread's lane: a thread that ends takes it along
        self._seq: dict[Any, int] = {}
        self._p2p: dict[tuple[Any, ...], int] = {}
        self._channels: dict[tuple[Any, ...], list[list[bool]]] = {}  # sends/receives in flight
        self._counters: dict[str, _GroupCounter] = {}
        self._groups: dict[str, Any] = {}  # group key -> its ProcessGroup, to read its counter at the end
        # group key -> the ProcessGroup it names; per name, its latest key and how many groups had it
        self._owners: dict[str, Any] = {}
        self._generation_keys: dict[str, str] = {}
        self._generations: dict[str, int] = {}
        # id(ProcessGroup) -> what the calls on it say of it (``distpatch``); forgotten with the groups
        self.described_groups: dict[int, tuple[Any, ...]] = {}
        self.described_calls: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # the same, of calls
        self._group_ranks: dict[str, list[int]] = {}  # group key -> its global ranks, of every incarnation
        self._offset_changes: dict[str, list[tuple[int, int]]] = {}  # group -> (counter after a p2p call, offset)
        self._gaps: dict[str, list[tuple[int, int]]] = {}  # group -> counter values of calls it did not see
        # what the flight recorder must still be read for: per gap, the op_ids of it no entry was
        # read for yet; per group, the op_id up to which every entry was read, and those read above
        self._gaps_unread: list[Gap] = []
        self._accept_from: dict[str, int] = {}  # group -> when the log that handed it over left it
        self._numbering_lost: dict[str, str] = {}  # group -> why this rank lost its numbering (``judge_gaps``)
        self._native_upto: dict[str, int] = {}
        self._native_above: dict[str, set[int]] = {}
        self._incarnation_starts: list[int] = []  # when each incarnation after the first began (time_ns)
        self.born_ns = time.time_ns()  # what native code issued before this log existed is not its own
        self._incarnation = 1  # of the groups: destroy_process_group ends one
        self._pending: dict[int, Pending] = {}  # id(work) -> what it completes
        # futures of those calls (``Work.get_future``, and futures made of those), by id: native code
        # (DDP's reducer) waits for most out of sight, so the oldest are let go; a wait from Python
        # completes the calls
        self._handed: OrderedDict[int, tuple[Any, list[Pending]]] = OrderedDict()
        # called with (kind, phase, name, call id) after each event is written: armed faults,
        # a schedule's holds (``add_trigger``)
        self.trigger: Callable[[str, str, str, int], None] | None = None
        main = threading.main_thread()
        self._add_lane(main.ident or 0, main.name, main)

    # -- writing -----------------------------------------------------------------------------

    def _lane(self) -> int:
        """The calling thread's lane. A thread of its own, even one given the id of a thread
        that ended (the system reuses them): were they one lane, program order would join
        two threads nothing orders."""
        try:
            return int(self._local.lane)
        except AttributeError:
            pass
        ident, me = get_ident(), threading.current_thread()
        lane = self._lanes.get(ident)
        if lane is None or self._lane_threads[lane] is not me:
            lane = self._add_lane(ident, me.name, me)
        self._local.lane = lane
        return lane

    def _lane_of(self, ident: int, name: str) -> int:
        """The lane of the thread that has ``ident`` now (seen from another thread: what native
        code issued on it)."""
        lane = self._lanes.get(ident)
        return lane if lane is not None else self._add_lane(ident, name, None)

    def _add_lane(self, ident: int, name: str, thread: Any) -> int:
        with self._lock:
            lane = len(self._lane_threads)
            self._lane_threads.append(thread)
            self._lanes[ident] = lane
        self._write((0, time.time_ns(), lane, events.META, events.POINT, name, {"ident": ident}))
        return lane

    def _write(self, record: RawEvent) -> None:
        self._raw.append(record)
        if self._file is not None:
            with self._lock:
                self._file.write(record)

    def _in_forked_child(self) -> None:
        """This process was forked from the one recording into an event file (a DataLoader's
        worker of a rank): the file and the armed faults are that process's, and another writer
        of the file would overwrite its records. What this one records is dropped, and said once.
        A log in memory alone (a Recorder a test module made in the pytest process, which its
        ranks inherit) records on in each process, as its own."""
        # another thread may have held the lock as the fork was made: in this process, where
        # that thread does not exist, it would stay held
        self._lock = threading.Lock()
        if self._file is None:
            return
        self._file = None  # this process's copy of the mapping is never written again
        self.trigger = None
        self._emit = self._dropped  # type: ignore[method-assign]

    def _dropped(self, kind: str, phase: str, name: str, *_: Any, **__: Any) -> None:
        if kind in (events.MARK, events.CALL, events.BARRIER, events.COLLECTIVE, events.P2P) and not self._told_dropped:
            self._told_dropped = True
            with contextlib.suppress(OSError):
                os.write(
                    2,
                    f"ddphooks: {name!r} was recorded in process {os.getpid()}, which the recording process"
                    f" (rank {self.rank}) forked: only that process records; what processes it starts"
                    " record is not in its timeline\n".encode(errors="replace"),
                )

    _told_dropped = False

    def _write_file_only(self, kind: str, phase: str, name: str, info: dict[str, Any] | None) -> None:
        """A record for the watchdog alone: in the event file, never in the timeline."""
        if self._file is not None:
            lane = self._lane()
            with self._lock:
                self._file.write((0, time.time_ns(), lane, kind, phase, name, info))

    def write_sampled(self, kind: str, sample: Callable[[], dict[str, Any]]) -> None:
        """A record for the watchdog alone whose info is taken as the file's lock is held: it
        describes the rank between the events written before it and those written after."""
        if self._file is not None:
            lane = self._lane()
            with self._lock:
                self._file.write((0, time.time_ns(), lane, kind, events.POINT, kind, sample()))

    def add_trigger(self, trigger: Callable[[str, str, str, int], None]) -> None:
        """Also call ``trigger`` after each event is written, after the ones already there."""
        previous = self.trigger
        if previous is None:
            self.trigger = trigger
            return

        def both(kind: str, phase: str, name: str, call_id: int) -> None:
            previous(kind, phase, name, call_id)
            trigger(kind, phase, name, call_id)

        self.trigger = both

    def occurrences(self, matches: Callable[[str, str, str], bool]) -> int:
        """How many of the events recorded so far ``matches(kind, phase, name)`` accepts."""
        return sum(1 for r in list(self._raw) if matches(r[3], r[4], r[5]))

    def write_watch_only(self, kind: str, info: dict[str, Any]) -> None:
        """What the harness must learn from the event file, even of a rank that then dies (the
        faults it armed, the one that fired)."""
        self._write_file_only(kind, events.POINT, kind, info)

    def _emit(
        self,
        kind: str,
        phase: str,
        name: str,
        info: dict[str, Any] | None,
        call_id: int,
        static: dict[str, Any] | None = None,
        numbered: tuple[str, ...] = (),
        triggers: bool = True,
    ) -> None:
        """Record an event. With ``static``, ``info`` is that never-changing dict plus the
        integers named in ``numbered``: the event file writes it compact, as it writes the
        start or end of a call without info."""
        __tracebackhide__ = True
        # every recorded call passes here twice: kept to a few dictionary look-ups and one write
        try:
            lane = self._local.lane
        except AttributeError:
            lane = self._lane()
        if phase == START and kind in _SYNC_KINDS:
            barriers = _counting.get()
            if barriers and _issues(info):
                for issued in barriers:
                    issued.append(call_id)
        record = (call_id, time_ns(), lane, kind, phase, name, info)
        if static is None:
            self._raw.append(record)
        else:
            # kept packed: CPython never stops tracking a tuple that holds a dict, so every
            # call's start would be one more object each full collection walks, its info dict
            # (~360 bytes) kept too; read back whole by ``records()``
            form = self._form_of.get((id(static), numbered))
            if form is None:
                form = self._new_form(static, numbered)
            if form is None:
                self._raw.append(record)
            elif not numbered:
                self._raw.append((call_id, record[1], lane, kind, phase, name, (form,)))
            else:
                assert info is not None  # static plus the integers numbered names (at most two)
                first = info[numbered[0]]
                values = (form, first) if len(numbered) == 1 else (form, first, info[numbered[1]])
                self._raw.append((call_id, record[1], lane, kind, phase, name, values))
        file = self._file
        if file is not None:
            with self._lock:
                # a point (a mark) may be named anew each time: only calls are written compact
                if static is not None or (info is None and phase != POINT):
                    file.write_compact(record, static, numbered)
                else:
                    file.write(record)
        if self.trigger is not None and triggers:
            self.trigger(kind, phase, name, call_id)

    def begin(
        self,
        kind: str,
        name: str,
        info: dict[str, Any] | None = None,
        static: dict[str, Any] | None = None,
        numbered: tuple[str, ...] = (),
    ) -> int:
        __tracebackhide__ = True
        call_id = next(self._ids)
        try:
            self._emit(kind, START, name, info, call_id, static, numbered)
        except BaseException as exc:
            self._never_ran(kind, name, call_id, exc)
            raise
        return call_id

    def _never_ran(self, kind: str, name: str, call_id: int, exc: BaseException) -> None:
        """A call whose start raised (a fault injected there): it ends at once with that error,
        and a collective of it was never issued (the next call takes its place in the group)."""
        ended: dict[str, Any] = {"error": error_text(exc)}
        if kind in _SYNC_KINDS:
            ended["issued"] = False
            _uncount(call_id)
        self._emit(kind, END, name, ended, call_id, triggers=False)

    def end(
        self,
        call_id: int,
        kind: str,
        name: str,
        info: dict[str, Any] | None = None,
        static: dict[str, Any] | None = None,
    ) -> None:
        """The end of a call (a collective that raised before it reached its group was counted
        as issued by the barriers around it: it is taken back)."""
        if info is not None and info.get("issued") is False and kind in _SYNC_KINDS:
            _uncount(call_id)
        self._emit(kind, END, name, info, call_id, static)

    def _new_form(self, static: dict[str, Any], numbered: tuple[str, ...]) -> int | None:
        """The number of a new form of call info (``static`` plus the integers named in
        ``numbered``); None past a bound (forms that do not repeat are kept whole)."""
        key = (id(static), numbered)
        with self._lock:  # two threads' first calls of two forms must not take one number
            form = self._form_of.get(key)
            if form is None:
                if len(self._forms) >= events.MAX_TEMPLATES:
                    return None
                form = len(self._forms)
                self._forms.append((static, numbered))
                self._form_of[key] = form  # published once its form is there to read
        return form

    def records(self) -> list[RawEvent]:
        """Every record so far, as written (a call's info whole)."""
        forms = self._forms
        out = []
        for record in list(self._raw):
            packed = record[6]
            if type(packed) is tuple:
                static, numbered = forms[packed[0]]
                record = (*record[:6], events.filled_info(static, numbered, packed[1:]))
            out.append(record)
        return out

    def mark(self, name: str, /, **info: Any) -> None:
        """Record a point event ``name`` with optional details."""
        self._emit(events.MARK, events.POINT, str(name), _plain(info) if info else None, next(self._ids))

    # -- pairing collectives across ranks ----------------------------------------------------

    def next_seq(self, group: Any) -> int:
        n = self._seq.get(group, 0) + 1
        self._seq[group] = n
        return n

    def group_key(self, name: str) -> str:
        """A group's name in the events: its own, with the incarnation once the groups were
        destroyed and created again (group names and counters start over then)."""
        return name if self._incarnation == 1 else f"{name}/{self._incarnation}"

    def key_for_group(self, name: str, pg: Any) -> str:
        """``group_key(name)`` for the group ``pg``; a group created under the name of one
        before it (groups made with ``use_local_synchronization`` are named by their ranks)
        gets a key of its own: its counter started over, and its calls are other calls."""
        base = self.group_key(name)
        key = self._generation_keys.get(base, base)
        owner = self._owners.get(key)
        if owner is None or owner is pg:
            self._owners[key] = pg
            return key
        generation = self._generations[base] = self._generations.get(base, 1) + 1
        key = self._generation_keys[base] = f"{base}+{generation}"
        self._owners[key] = pg
        return key

    def groups_destroyed(self) -> None:
        self._owners.clear()
        self._generation_keys.clear()
        self._generations.clear()
        self._incarnation += 1
        self._incarnation_starts.append(time.time_ns())
        self._counters.clear()
        self._groups.clear()
        self.described_groups.clear()
        self.described_calls.clear()
        self._native_upto.clear()
        self._native_above.clear()
        self.let_go()

    def let_go(self) -> None:
        """Forget the futures calls were handed to: what they hold (their values, a Work's
        connections to its group) is not kept alive past the groups or the recorder."""
        self._handed.clear()

    def _counter_of(self, group: str) -> _GroupCounter:
        state = self._counters.get(group)
        if state is None:
            state = self._counters[group] = _GroupCounter()
        return state

    def collective_seq(self, group: str, counter: int | None) -> tuple[int, int, str | None]:
        """The number that pairs a collective starting now on ``group`` across its members,
        how many calls on the group this rank made since its last recorded one, unseen, and
        why the number cannot be trusted (then it pairs with nothing), if it cannot.

        The number is the group's own counter (``counter``, read before the call) less what
        this rank's own sends and receives added to it: every member agrees on it, however
        the collectives were issued, so collectives the recorder could not see never shift it
        (an unseen send or receive does: the flight recorder's silence on it tells, ``judge_gaps``). A
        call another thread is running on the group may or may not have counted yet: a
        collective that starts meanwhile has no number anyone can be sure of."""
        state = self._counter_of(group)
        state.calls += 1
        unsure = state.untrusted
        if unsure is None and state.open > 1:  # this call is open already (``opened``)
            unsure = "it was issued while another thread of the rank was inside a call on the group"
        if counter is None:
            return state.calls, 0, unsure
        unseen = self._gap_before(group, state, counter)
        state.in_flight = counter
        return counter - state.offset + 1, unseen, unsure

    def _gap_before(self, group: str, state: _GroupCounter, counter: int) -> int:
        """How many calls on ``group`` went unseen before a recorded one found its counter at
        ``counter``; they are noted as a gap, for the flight recorder to explain."""
        unseen = counter - state.expected if state.expected is not None and counter > state.expected else 0
        # what runs while recorded calls on the group are open is judged when the last ends; two
        # threads may both have opened theirs before either read the counter: the lowest reading
        # is where the episode begins
        if state.episode is None or state.open == 1:
            state.episode = [counter, 0, 0, True, time.time_ns()]
        elif counter < state.episode[0]:
            state.episode[0] = counter
        if not unseen or state.open > 1:
            # other threads' recorded calls running on the group may have counted already: which
            # numbers, if any, went unseen cannot be told (a gap here made one of them a phantom)
            return 0
        assert state.expected is not None
        self._gaps.setdefault(group, []).append((state.expected + 1, counter))  # native calls: events
        read = self._native_upto.get(group, 0)  # what an earlier read already found there is explained
        self._to_explain(group, range(max(state.expected, read) + 1, counter + 1), 0, state.anchor_ns)
        return unseen

    def _to_explain(self, group: str, op_ids: range, own: int, anchor_ns: int) -> None:
        """Calls on ``group`` that left its counter at ``op_ids``, of which ``own`` were the
        sends and receives of the recorded call whose window they are: every other one must be
        a collective, which the flight recorder holds (``judge_gaps``)."""
        # the flight recorder keeps the last 2,000 entries: the tail of a long gap is what it can hold
        tracked = set(op_ids[-_TRACKED_GAP:]) - self._native_above.get(group, set())
        if len(tracked) > own:
            self._gaps_unread.append((group, tracked, own, anchor_ns, time.monotonic()))

    def p2p_began(self, group: str, counter: int | None) -> None:
        """A recorded send, receive or monitored barrier found the group's counter at
        ``counter``: a call unseen before it is a gap, as before a collective."""
        if counter is not None:
            self._gap_before(group, self._counter_of(group), counter)

    def gaps_found(self) -> list[Gap]:
        """The gaps no read has explained yet (their calls were issued already)."""
        return list(self._gaps_unread)

    def judge_gaps(self, judged: list[Gap], reliable_from: dict[str, int] | None, held_any: bool = True) -> None:
        """After a read of the flight recorder, which holds every collective issued (the last
        2,000; ``reliable_from``: per group, the lowest op_id it still held, when it had let
        older ones go, else None) and no send or receive: a call of a gap it did not hold (past
        the recorded call's own sends and receives, in a call's window) was a send or receive
        issued where the recorder cannot see it (``torch.ops.c10d.send``, another thread's). It
        moved the group's counter on this rank alone, so the rank's later calls on the group
        cannot be numbered for sure, and pair with nothing. A flight recorder that held nothing
        at all (``held_any``; switched off) tells nothing: every gap is such a call, as far as
        anyone knows."""
        for group, missing, own, anchor_ns, _ in judged:
            if len(missing) <= own or group in self._numbering_lost:
                continue
            floor = 0 if reliable_from is None else reliable_from.get(group)
            if floor is None or min(missing) < floor:
                continue  # the flight recorder let some of them go: cannot tell
            # from where the gap began: what was numbered after it may be shifted
            self._lose_numbering(group, _NUMBERING_LOST if held_any else _NUMBERING_UNKNOWN, anchor_ns + 1)
        done = {id(gap) for gap in judged}
        self._gaps_unread = [gap for gap in self._gaps_unread if id(gap) not in done]

    def _lose_numbering(self, group: str, why: str, t_ns: int) -> None:
        """From ``t_ns`` on, the rank's calls on ``group`` have no number anyone can be sure of."""
        self._numbering_lost[group] = why
        self._write((next(self._ids), t_ns, self._lane(), events.UNSURE, POINT, group, {"group": group, "unsure": why}))

    def first_seen(self, group: str, pg: Any) -> None:
        """A group this log describes for the first time: one an earlier log saw (under
        torchrun, the group outlives each test's) goes on numbered from where that log left it."""
        state = self._counter_of(group)
        if state.expected is not None:
            return  # created while this log recorded
        try:
            carried = _carried.get(pg)
        except TypeError:
            return
        if carried is not None:
            state.expected, state.offset, state.untrusted, lost, left_ns = carried
            state.anchor_ns = self.born_ns
            self._accept_from[group] = left_ns  # what ran since explains the first gap (a fixture's barrier)
            if lost is not None:
                self._lose_numbering(group, lost, self.born_ns)

    def knows_group(self, group: str, ranks: list[int]) -> None:
        """A group this log describes: what native code issues on it is its own (``native_group_key``)."""
        self._group_ranks.setdefault(group, [int(r) for r in ranks])

    def explains_from(self, group: str) -> int:
        """The time from which the flight recorder's entries of ``group`` explain this log's gaps."""
        return min(self.born_ns, self._accept_from.get(group, self.born_ns))

    def took_over(self, group: str, counter: int | None) -> None:
        """This log begins with ``group`` at ``counter``, unless an earlier log left it a count."""
        state = self._counter_of(group)
        if state.expected is None and counter is not None:
            state.expected, state.anchor_ns = counter, self.born_ns

    def close_gaps(self) -> None:
        """At the end: what ran on each group after its last recorded call is a gap too (the
        next log that sees the group goes on from here)."""
        for pg, key, *_ in tuple(self.described_groups.values()):
            state = self._counters.get(key)
            counter = group_counter(pg)
            if state is None or counter is None or state.open:
                continue
            self._gap_before(key, state, counter)
            if state.expected is not None:
                state.expected = max(state.expected, counter)

    def carry_numbering(self) -> None:
        """Leave each group's numbering for the next log that sees it."""
        for pg, key, *_ in tuple(self.described_groups.values()):
            state = self._counters.get(key)
            if state is None or state.expected is None:
                continue
            with contextlib.suppress(TypeError):
                _carried[pg] = (
                    state.expected,
                    state.offset,
                    state.untrusted,
                    self._numbering_lost.get(key),
                    time.time_ns(),
                )

    def opened(self, group: str, collective: bool) -> None:
        """A recorded call on ``group`` is about to read the group's counter and run
        (``counted`` ends it); ``collective``: it is one (not a send, a receive or a monitored
        barrier, which move the rank's own count, not the place of the collectives beside them)."""
        state = self._counter_of(group)
        if state.open:
            state.overlapped = True
            if collective:
                state.collective_overlapped = True
        state.open += 1

    def group_created(self, group: str, pg: Any, counter: int | None) -> None:
        """A group came into being with its counter at ``counter`` (0): from here on, any call
        on it the recorder does not see is a gap."""
        self._groups[group] = pg
        try:
            self._group_ranks[group] = [int(r) for r in sys.modules["torch.distributed"].get_process_group_ranks(pg)]
        except Exception:
            self._group_ranks[group] = []
        if counter is not None:
            state = self._counter_of(group)
            state.expected, state.anchor_ns = counter, time.time_ns()

    def joined(self, rank: int, world_size: int) -> None:
        """The default group was created while recording: this rank's place in it, unless
        the recorder was told its own."""
        if not self._placed[0]:
            self.rank = rank
        if not self._placed[1]:
            self.world_size = world_size

    def final_counters(self) -> dict[str, int]:
        """For each group this rank created: the number of the last collective it issued on
        it, recorded or not (its counter less its own sends and receives)."""
        out = {}
        for key, pg in self._groups.items():
            counter = group_counter(pg)
            if counter is None:
                continue
            state = self._counters.get(key)
            if key in self._numbering_lost:
                continue  # its numbers are no one's to compare with
            out[key] = counter - (state.offset if state is not None else 0)
        return out

    def write_final_counters(self) -> None:
        """Tell the watchdog which collectives this finished rank issued, seen or not: a peer
        waiting in a later one waits for nothing."""
        self._write_file_only(events.COUNTERS, events.POINT, "counters", self.final_counters())

    def counted(
        self, group: str, before: int | None, after: int | None, p2p: bool, ops: int | None = None, failed: bool = False
    ) -> bool:
        """A call on ``group`` returned (or raised: ``failed``) with the group's counter at
        ``after``. For a send or receive, ``ops``: how many it issues (each advances the
        counter by one), when known. Whether another thread's recorded collective on the group
        began while this one ran (then which of them the group took first is not known)."""
        if not group:
            return False
        state = self._counter_of(group)
        overlapped = state.overlapped
        raced = state.collective_overlapped
        state.open = max(state.open - 1, 0)
        if not state.open:
            state.overlapped = state.collective_overlapped = False
        if before is None or after is None:
            if not state.open:
                state.episode = None
            return raced
        episode = state.episode
        if episode is not None:
            if not p2p:
                episode[1] += 1  # in the flight recorder, as what it nests (broadcast_object_list's)
            elif ops is not None and not failed:
                episode[2] += ops
            else:
                episode[3] = False  # a monitored barrier's parts, or a send that raised: how many is not known
            if not state.open:
                state.episode = None
                if episode[3] and after - episode[0] > episode[1] + episode[2]:
                    # more than the recorded calls: unseen ones ran beside them (a send would shift the count)
                    self._to_explain(group, range(episode[0] + 1, after + 1), episode[2], episode[4] - 1)
        state.expected, state.anchor_ns = after, time.time_ns()
        state.in_flight = None
        if p2p:
            if ops is not None and not failed:
                # never what the counter moved by: another thread's calls move it too
                state.offset += ops
            elif not overlapped:
                state.offset += after - before  # nothing else moved it meanwhile
            else:
                # a monitored barrier's parts, or a send that raised (did it reach the group?),
                # beside another thread's call: how far this one moved the count is not known
                state.untrusted = (
                    "a send or receive (or a monitored barrier, made of them) ran on the group beside another"
                    " thread's call, so how far each advanced the group's count is not known"
                )
            self._offset_changes.setdefault(group, []).append((after, state.offset))
        return raced

    def unnumber(self, key: Any, seq: int) -> None:
        """A call numbered ``seq`` in ``next_seq(key)`` raised before it reached its group:
        the next one takes its number, as it would on the ranks where it did not raise."""
        if self._seq.get(key) == seq:
            self._seq[key] = seq - 1

    def awaiting(
        self, work: Any, call_id: int, name: str, info: dict[str, Any], static: dict[str, Any] | None = None
    ) -> None:
        """An asynchronous call returned ``work``: its wait is where it completes. ``static``:
        the never-changing part of ``info``, if it has one."""
        self._pending[id(work)] = (work, call_id, name, info, static)

    def awaits_any(self) -> bool:
        """Whether any recorded asynchronous call is still to be waited for (a synchronous
        collective's own wait, inside torch, completes none)."""
        return bool(self._pending or self._handed)

    def awaited_by(self, work: Any) -> list[Pending]:
        """The calls a wait for ``work`` (a Work, or a future calls were handed to) completes
        if it returns; ``completed`` then takes them, so a later wait completes nothing more.
        A wait that raises (a time-out) takes nothing: they stay pending for the next one."""
        found = self._pending.get(id(work))
        if found is not None and found[0] is work:
            return [found]
        held = self._handed.get(id(work)) if self._handed else None
        return list(held[1]) if held is not None and held[0] is work else []

    def awaited_by_view(self, tensor: Any) -> list[Pending]:
        """The call whose result ``tensor`` views (a view of a functional collective's result,
        made before it was waited for, shares its storage): a scan of the few calls pending."""
        try:
            storage = tensor.untyped_storage().data_ptr()
        except Exception:
            return []
        if not storage:  # no bytes: every empty storage is at 0
            return []
        for pending in list(self._pending.values()):
            target = pending[0]
            if not hasattr(target, "untyped_storage"):
                continue  # a Work
            try:
                same = target is not tensor and target.untyped_storage().data_ptr() == storage
            except Exception:
                continue
            if same:
                return [pending]
        return []

    def completed(self, work: Any, calls: list[Pending]) -> None:
        """A wait for ``work`` returned: ``calls`` (from ``awaited_by``) are complete."""
        for call in calls:
            if self._pending.get(id(call[0])) is call:
                del self._pending[id(call[0])]
        held = self._handed.get(id(work)) if self._handed else None
        if held is not None and held[0] is work:
            del self._handed[id(work)]

    def handed(self, future: Any, calls: list[Pending]) -> None:
        """``calls`` were handed to ``future`` (``Work.get_future``, a future made of such ones):
        a wait for it from Python completes them (kept for the last ``_HANDED_KEPT`` futures)."""
        self._handed[id(future)] = (future, calls)
        if len(self._handed) > _HANDED_KEPT:
            self._handed.popitem(last=False)

    def handed_to(self, future: Any) -> list[Pending]:
        """The calls handed to ``future``, if any (it stays as it is)."""
        held = self._handed.get(id(future)) if self._handed else None
        return list(held[1]) if held is not None and held[0] is future else []

    def pending_targets(self) -> list[Any]:
        """What the asynchronous calls not waited for yet are waited on (Works, tensors)."""
        return [pending[0] for pending in self._pending.values()]

    def never_waited(self) -> list[tuple[int, str, dict[str, Any]]]:
        """Asynchronous calls whose work nobody waited for (yet)."""
        return [(call_id, name, info) for _, call_id, name, info, _ in self._pending.values()]

    # -- what native code issued (``native.NativeCalls``) ----------------------------------

    def next_call_id(self) -> int:
        return next(self._ids)

    def lane_of_thread(self, ident: int) -> int:
        thread = threading._active.get(ident)  # type: ignore[attr-defined]
        return self._lane_of(ident, thread.name if thread is not None else f"native thread 0x{ident:x}")

    def native_group_key(self, name: str, t_ns: int) -> str | None:
        """The key of group ``name`` in the incarnation it had at ``t_ns``; None for a group
        this rank never created while recording (its members are unknown)."""
        incarnation = 1 + sum(1 for start in self._incarnation_starts if start <= t_ns)
        key = name if incarnation == 1 else f"{name}/{incarnation}"
        return key if name == "default" or key in self._group_ranks else None

    def native_group_size(self, group: str) -> int:
        return len(self._group_ranks.get(group) or []) or self.world_size

    def native_group_ranks(self, group: str) -> list[int]:
        return list(self._group_ranks.get(group) or [])

    def native_may_have_issued(self) -> bool:
        """Whether a collective this log did not see may have been issued since native calls
        were last read: a gap not all of whose calls were read, or a group's counter past both its last recorded
        call and the last flight-recorder entry read for it. When not, the flight recorder
        holds nothing ``unseen`` would take, and is not read (a dump of its 2,000 entries
        costs up to 90 ms)."""
        if self._gaps_unread:
            return True
        # copied at once: the watchdog's ask thread reads while the rank's threads record
        groups = {key: pg for pg, key, *_ in tuple(self.described_groups.values())}
        groups.update(self._groups.copy())
        for key, pg in groups.items():
            state = self._counters.get(key)
            if state is None or state.expected is None:
                continue  # unseen() takes nothing of a group without a recorded count
            counter = group_counter(pg)
            if counter is None:
                return True  # cannot tell
            # a recorded call still running owns what its group counted since it began
            if state.in_flight is not None:
                counter = min(counter, state.in_flight)
            if counter > max(state.expected, self._native_upto.get(key, 0)):
                return True
        return False

    def native_entry(self, group: str, op_id: int) -> None:
        """The flight recorder held the call that left ``group``'s counter at ``op_id``."""
        if self._gaps_unread:
            for key, missing, *_ in self._gaps_unread:
                if key == group:
                    missing.discard(op_id)
            self._gaps_unread = [gap for gap in self._gaps_unread if len(gap[1]) > gap[2]]
        if op_id > self._native_upto.get(group, 0):
            self._native_above.setdefault(group, set()).add(op_id)

    def native_read(self) -> None:
        """After a read: a group's entries count as read up to the first op_id past its last
        recorded call that had no entry yet (an entry written late, or out of order, is read
        next time)."""
        for group, above in self._native_above.items():
            state = self._counters.get(group)
            recorded = state.expected if state is not None and state.expected is not None else 0
            upto = max(self._native_upto.get(group, 0), recorded)
            while upto + 1 in above:
                upto += 1
            self._native_upto[group] = upto
            above.difference_update([i for i in above if i <= upto])

    def unseen(self, group: str, op_id: int) -> bool:
        """Whether the call that left ``group``'s counter at ``op_id`` was one this log did not
        see: in a gap between two recorded calls, or after the last one."""
        if any(lo <= op_id <= hi for lo, hi in self._gaps.get(group, ())):
            return True
        state = self._counters.get(group)
        if state is None or state.expected is None or op_id <= state.expected:
            return False
        # a recorded call still running owns what its group counted since it began
        return state.in_flight is None or op_id <= state.in_flight

    def seq_of(self, group: str, op_id: int) -> int | None:
        """The recorder's number of the collective that left ``group``'s counter at ``op_id``."""
        changes = self._offset_changes.get(group, [])
        offset = 0
        for after, value in changes:
            if after < op_id:
                offset = value
            else:
                break
        seq = op_id - offset
        return seq if seq > 0 else None

    def add_native(self, records: list[RawEvent]) -> None:
        """Events of collectives native code issued, found after the fact."""
        for record in records:
            self._write(record)

    def next_p2p(self, key: tuple[Any, ...]) -> int:
        n = self._p2p.get(key, 0) + 1
        self._p2p[key] = n
        return n

    def channel_opened(self, channel: tuple[Any, ...]) -> list[bool]:
        """A send or receive on ``channel`` begins: its token says, once it ends, whether
        another one (another thread's) was in flight on the channel meanwhile. Messages match
        in the order the calls were posted, inside torch; numbered as they began (a send) or
        returned (a receive), overlapping calls may have taken each other's numbers."""
        token = [False]
        with self._lock:
            others = self._channels.setdefault(channel, [])
            if others:
                token[0] = True
                for other in others:
                    other[0] = True
            others.append(token)
        return token

    def channel_closed(self, channel: tuple[Any, ...], token: list[bool]) -> bool:
        """The call ``token`` stands for ended: whether it overlapped another on its channel."""
        with self._lock:
            others = self._channels.get(channel, [])
            if token in others:
                others.remove(token)
        return token[0]


# every log of this process: a process forked from it records nothing into them (``_in_forked_child``)
_live_logs: weakref.WeakSet[EventLog] = weakref.WeakSet()


def _forked() -> None:
    for log in list(_live_logs):
        log._in_forked_child()


os.register_at_fork(after_in_child=_forked)


def _default_group_place() -> tuple[int, int] | None:
    """(rank, world size) in the default process group, if one exists."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        pass
    return None


def _plain(value: Any) -> Any:
    """A value marshal can write: primitives stay, containers recurse, the rest is repr'd."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def error_text(exc: BaseException) -> str:
    """How an event's info says that a call raised."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."
