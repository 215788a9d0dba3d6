"""Seeded schedules: which rank is held back where, and for how long, so that an order no
synchronisation enforces gets inverted.

The points are a rank's recorded events on its main thread (hooks and methods of instrumented
targets, barriers, marks, collectives and their waits, joining a group), plus the rank's start. A
rank's points fall into *segments*: a segment ends where a collective (or a send, a receive, a
wait) returns, which is the last place every member is known to have reached together. Within a
segment nothing orders one rank's points against another's, so that is where a schedule acts:

- a random priority order of the ranks, as PCT draws thread priorities, drawn again at each
  segment with probability 1/4 (PCT's priority change points): in each segment the rank of
  priority j is held j times the segment's hold unit, so every pair of ranks runs a segment in
  either order with probability 1/2 whatever the natural timing, and two segments in the same
  order more often than not (a bug that needs one rank late twice);
- the hold unit exceeds how long the segment took in the plain run (``Profile``), so the held
  rank reaches the segment's points after the others have gone through theirs;
- half the time the hold is placed not at the segment's start but at a random point inside it
  (a change point), which interleaves the two ranks' points instead of putting one wholly first.

A held rank waits until the ranks that go before it have gone through their part of the
segment (entered the collective that ends it, or ended): their places are on a board every rank
of the run maps (``Board``), so the order a seed names is the order a replay gets however much
slower the machine is than in the plain run. A peer that stops running (blocked on the held rank
in native code nothing records, or asleep) lets the hold end after its planned length, as a
sleep would; a peer at work keeps it, up to ``HOLD_STRETCH`` times that. That is where segment k
is the same part of the run on every rank (``Profile.aligned``); elsewhere a hold is a sleep of
its planned length. A hold always ends, so a schedule cannot deadlock correct code, and a rank
held while its peers wait in a collective only makes them wait longer (a hold is never inside a
collective, so the desync detector sees nothing to compare). Only a segment's span is measured:
the schedule is a function of the seed and the plain run's profile, and replaying a seed on the
same code gives the same holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .recorder import events

# the events a schedule can act at, on the main thread; those issued from native code appear
# only later (read from torch's flight recorder), so they are no points
POINT_KINDS = frozenset(
    (events.CALL, events.BARRIER, events.MARK, events.COLLECTIVE, events.P2P, events.GROUP, events.WAIT)
)
# where a segment ends: a call that returns only once its peers reached it (joining a group too)
_SYNC_KINDS = frozenset((events.COLLECTIVE, events.P2P, events.WAIT, events.GROUP))

MIN_HOLD = 0.01  # seconds: more than the scheduling noise of a busy 2-core machine
MAX_HOLD = 1.0
MAX_SEGMENTS = 16  # perturbed per schedule: a long test gets a random choice of its segments
CHANGE = 0.25  # the chance that the ranks' priorities are drawn again at a segment
RANK_START = "the rank's start"
_NEVER = 1 << 63  # the end of a rank's last segment: no synchronisation follows it
HOLD_STRETCH = 4  # a hold waits on for a peer still at work in its part, up to this many times its length
POLL = 0.001  # seconds between two looks at the board
IDLE_LOOKS = 3  # a peer seen stopped this many looks running is waiting (on the held rank, or asleep)

# a rank's state on the board
RUNNING, SYNCING, HELD, DONE = 0, 1, 2, 3
HOLDING = "holding"  # in a hold's first record: it began; the second, once it ended, stands for it


EXPLORE_UNDER_TORCHRUN = (
    "schedules need the plugin's own ranks: under torchrun the ranks belong to torchrun's agent, which"
    " starts each test once; run the exploration without torchrun"
)


class ScheduleError(ValueError):
    """A seed or an exploration count that cannot be used; the message names it."""


def parse_seed(value: Any, where: str) -> int:
    """A seed as the user wrote it: an int, or its text (``0x5eed1234`` or decimal)."""
    if isinstance(value, bool):
        raise ScheduleError(f"{where}: a seed is an int or its text (e.g. 0x5eed1234), got {value!r}")
    if isinstance(value, int):
        seed = value
    elif isinstance(value, str):
        try:
            seed = int(value.strip(), 0)
        except ValueError:
            raise ScheduleError(f"{where}: {value!r} is not a seed (an int, e.g. 0x5eed1234)") from None
    else:
        raise ScheduleError(f"{where}: a seed is an int or its text (e.g. 0x5eed1234), got {value!r}")
    if not 0 <= seed < 1 << 64:
        raise ScheduleError(f"{where}: a seed is from 0 to 2**64-1, got {seed}")
    return seed


def format_seed(seed: int) -> str:
    return f"0x{seed:08x}"


def seeds(base: int, test: str, count: int) -> list[int]:
    """``count`` seeds for one test's schedules, different for every test and session base."""
    out = []
    for i in range(count):
        digest = hashlib.blake2b(f"{base}:{test}:{i}".encode(), digest_size=4).digest()
        out.append(int.from_bytes(digest, "big"))
    return out


# -- what the plain run looked like ----------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    points: int  # including point 0: the segment's start
    start_ns: int  # its start, and its last point (where the rank enters the next collective)
    end_ns: int
    until_ns: int = 0  # when the next one began: the collective that ends it returned
    opened_ns: int = 0  # when the collective that began it returned: 0 for a rank's first
    ends: str = ""  # the call that ends it, with its group: "" for a rank's last

    @property
    def seconds(self) -> float:
        return max(self.end_ns - self.start_ns, 0) / 1e9


@dataclass
class Profile:
    """Each rank's segments in a plain run: how many points, and how long each took."""

    ranks: dict[int, list[Segment]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        by_rank: Mapping[int, Sequence[events.Event]],
        began_ns: Mapping[int, int],
        ended_ns: Mapping[int, int] | None = None,
    ) -> Profile:
        """``began_ns``: when each rank began (its point 0), on the events' clock;
        ``ended_ns``: when its body ended. The last segment lasts until then: what a rank does
        after its last recorded point (a read of what another rank wrote) races too."""
        profile = cls()
        for rank, evs in by_rank.items():
            segments: list[Segment] = []
            points, started, last = 1, began_ns.get(rank), None  # point 0 of segment 0: the rank's start
            for e in evs:
                if not _is_point(e.kind, e.lane, e.info):
                    continue
                if started is None:
                    started = e.t_ns
                if e.phase == events.END and e.kind in _SYNC_KINDS:
                    ends = f"{e.kind}:{e.name}@{(e.info or {}).get('group', '')}"
                    segments.append(dataclasses.replace(_segment(points, started, last), ends=ends))
                    points, started = 1, e.t_ns
                else:
                    points += 1
                last = e.t_ns
            ended = (ended_ns or {}).get(rank)
            segments.append(_segment(points, started, max(last or 0, ended or 0) or None))
            # a rank's first segment follows no synchronisation and its last precedes none: their
            # ends are when this rank started and stopped, which order nothing against the others
            bounds = [s.start_ns for s in segments[1:]]
            profile.ranks[rank] = [
                dataclasses.replace(s, opened_ns=opened, until_ns=until)
                for s, opened, until in zip(segments, [0, *bounds], [*bounds, _NEVER], strict=True)
            ]
        return profile

    @property
    def segments(self) -> int:
        return max((len(s) for s in self.ranks.values()), default=1)

    def aligned(self) -> bool:
        """Whether segment k of every rank ends at the same call on the same group: then it is
        one part of the run on every rank, and a held rank can wait for the others to go
        through theirs. Sub-groups, sends and receives that end segments on some ranks only
        misalign them: holds are then sleeps of their planned length."""
        return len({tuple(s.ends for s in segs) for segs in self.ranks.values()}) <= 1

    def unit(self, rank: int, k: int) -> float:
        """The hold unit of the rank's segment ``k``: longer than the segment and than every
        segment of another rank that ran at the same time in the plain run, which are what it
        can race with (segment k of one rank need not be segment k of another: sub-groups,
        sends and receives end segments on some ranks only)."""
        own = self.ranks[rank][k] if k < len(self.ranks.get(rank, [])) else None
        if own is None:
            return MIN_HOLD
        longest = own.seconds
        for other, segs in self.ranks.items():
            if other != rank:
                longest = max([longest, *(s.seconds for s in segs if _overlap(s, own))])
        return min(1.5 * longest + MIN_HOLD, MAX_HOLD)


def _segment(points: int, start: int | None, end: int | None) -> Segment:
    if start is None:
        return Segment(points, 0, 0)
    return Segment(points, start, max(end or start, start))


def _overlap(a: Segment, b: Segment) -> bool:
    """Whether two ranks' segments ran at the same time, each from the collective that began
    it until the one that ends it returned: what one does between two synchronisations can race
    with anything the other does between the same two, however quickly either got through its
    own part (and a rank's first part with another's first part, however late either started)."""
    return a.opened_ns <= b.until_ns and b.opened_ns <= a.until_ns


def _is_point(kind: str, lane: int, info: Mapping[str, Any] | None) -> bool:
    return lane == 0 and kind in POINT_KINDS and not (info and info.get("native"))


# -- a schedule --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hold:
    segment: int
    point: int  # 0: the segment's start
    seconds: float  # how long it lasts when the ranks it waits for stop running
    after: tuple[int, ...] = ()  # the ranks of higher priority: they go through the segment first


def holds(seed: int, world_size: int, profile: Profile) -> dict[int, list[Hold]]:
    """What each rank is held, where, under the schedule of ``seed``."""
    rng = random.Random(seed)
    count = profile.segments
    chosen = sorted(rng.sample(range(count), min(count, MAX_SEGMENTS)))
    out: dict[int, list[Hold]] = {r: [] for r in range(world_size)}
    aligned = profile.aligned()
    order = list(range(world_size))
    rng.shuffle(order)  # order[j]: the rank of priority j
    for k in chosen:
        if rng.random() < CHANGE:
            rng.shuffle(order)  # a priority change point: the new order holds from here on
        inside = rng.random() < 0.5
        for priority, rank in enumerate(order):
            if priority == 0:
                continue
            segs = profile.ranks.get(rank, [])
            points = segs[k].points if k < len(segs) else 1
            # a change point inside the segment, before its last point (entering the next collective)
            point = rng.randrange(1, points - 1) if inside and points > 2 else 0
            after = tuple(order[:priority]) if aligned else ()
            out[rank].append(Hold(k, point, priority * profile.unit(rank, k), after))
    return out


class Board(Protocol):
    """Where each rank of a run is in its schedule, as every rank of the run sees it."""

    def tell(self, segment: int, state: int) -> None:
        """This rank's own place."""

    def place(self, rank: int) -> tuple[int, int]:
        """A rank's segment and state (``RUNNING``, ``SYNCING``, ``HELD``, ``DONE``)."""

    def stopped(self, rank: int) -> bool:
        """Whether a rank's main thread is not running: blocked, asleep, or gone."""


def went_through(place: tuple[int, int], segment: int) -> bool:
    """Whether a rank at ``place`` is done with its part of ``segment``: inside the collective
    that ends it, past it, or at the end of its body."""
    at, state = place
    return state == DONE or at > segment or (at == segment and state == SYNCING)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class ScheduleHook:
    """Runs one rank's holds: counts its points as they are recorded, tells the board where it
    is, and at its own holds waits for the ranks that go first.

    Called with (kind, phase, name, call id) after each event is written, as armed faults are
    (``EventLog.trigger``); ``begin()`` is the body's start, point 0 of segment 0, ``end()`` its
    end. Without a board a hold is a sleep of its planned length.
    """

    def __init__(
        self,
        own: Sequence[Hold],
        report: Callable[[dict[str, Any]], None],
        board: Board | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._at = {(h.segment, h.point): h for h in own}
        self._report = report
        self._board = board
        self._clock = clock
        self._sleep = sleep
        self._main = threading.main_thread()
        self.segment = 0
        self.point = 0
        self._state = RUNNING
        self._seen: dict[tuple[str, str, str], int] = {}  # how often the rank reached each point, as ``at=`` counts

    def begin(self) -> None:
        self._tell(RUNNING)
        self._hold(RANK_START)

    def end(self) -> None:
        self._tell(DONE)

    def _tell(self, state: int) -> None:
        self._state = state
        if self._board is not None:
            self._board.tell(self.segment, state)

    def __call__(self, kind: str, phase: str, name: str, call_id: int) -> None:
        if kind not in POINT_KINDS or threading.current_thread() is not self._main:
            return
        if phase == events.END and kind in _SYNC_KINDS:
            self.segment, self.point = self.segment + 1, 0
            self._tell(RUNNING)
        else:
            self.point += 1
            if phase == events.START and kind in _SYNC_KINDS:
                self._tell(SYNCING)
        key = (kind, phase, name)
        n = self._seen[key] = self._seen.get(key, 0) + 1
        if (self.segment, self.point) in self._at:  # named only where it holds: this runs per event
            self._hold(f"{phase}:{name}#{n}" if phase != events.POINT else f"{kind}:{name}#{n}")

    def _hold(self, where: str) -> None:
        hold = self._at.pop((self.segment, self.point), None)
        if hold is None:
            return
        began = self._clock()
        info = {"seconds": hold.seconds, "at": where, "segment": self.segment, "point": self.point}
        # said as it begins: a run that ends meanwhile (a peer died, the limit) still shows it
        self._report({**info, HOLDING: True})
        if self._board is None or not hold.after:
            self._sleep(hold.seconds)
            until = ""
        else:
            state = self._state
            self._tell(HELD)
            try:
                until = self._wait(self._board, hold, began)
            finally:
                self._tell(state)
        info["seconds"] = self._clock() - began
        self._report({**info, "until": until} if until else info)

    def _wait(self, board: Board, hold: Hold, began: float) -> str:
        """Wait until the ranks of ``hold.after`` went through this segment; say what ended it."""
        looks_stopped = 0
        while True:
            places = {r: board.place(r) for r in hold.after}
            left = [r for r, place in places.items() if not went_through(place, self.segment)]
            if not left:
                return f"until {_ranks(hold.after)} went through"
            waited = self._clock() - began
            if waited >= HOLD_STRETCH * hold.seconds:
                return f"as {_ranks(left)} still ran"
            # a peer that is itself held waits its turn: it is not waiting on this rank
            stopped = all(places[r][1] != HELD and board.stopped(r) for r in left)
            looks_stopped = looks_stopped + 1 if stopped else 0
            if waited >= hold.seconds and looks_stopped >= IDLE_LOOKS:
                return f"as {_ranks(left)} waited"
            self._sleep(POLL)


def ended_holds(held: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rank's holds, each once: the record of its end, or of its start when the run ended
    during it."""
    out: list[dict[str, Any]] = []
    for info in held:
        if out and out[-1].get(HOLDING) and _where(out[-1]) == _where(info):
            out[-1] = info
        else:
            out.append(info)
    return out


def _where(info: Mapping[str, Any]) -> tuple[Any, Any]:
    return info.get("segment"), info.get("point")


def held_seconds(held: Mapping[int, Sequence[Mapping[str, Any]]]) -> float:
    """About how much a run's holds delayed it: per segment the longest hold of any rank (the
    others wait for it at the next collective), summed over the segments."""
    return _longest_per_segment(
        (int(info.get("segment", 0)), float(info.get("seconds", 0.0))) for infos in held.values() for info in infos
    )


def planned_seconds(planned: Mapping[int, Sequence[Hold]]) -> float:
    """At most how much a schedule's holds will delay a run, counted as ``held_seconds`` counts
    them: the time its limit is extended by, so that no hold is taken for a hang."""
    return _longest_per_segment(
        (h.segment, h.seconds * (HOLD_STRETCH if h.after else 1)) for own in planned.values() for h in own
    )


def _longest_per_segment(holds: Iterable[tuple[int, float]]) -> float:
    longest: dict[int, float] = {}
    for k, seconds in holds:
        longest[k] = max(longest.get(k, 0.0), seconds)
    return sum(longest.values())


def describe_hold(rank: int, info: Mapping[str, Any]) -> str:
    """``rank 0 held 40 ms at start:prepare_data, until rank 1 went through``"""
    ms = float(info.get("seconds", 0.0)) * 1000
    if info.get(HOLDING):
        return f"rank {rank} was being held at {info.get('at')} as the run ended ({ms:.0f} ms planned)"
    until = f", {info['until']}" if info.get("until") else ""
    return f"rank {rank} held {ms:.0f} ms at {info.get('at')}{until}"
