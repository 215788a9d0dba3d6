"""The merged Timeline of all ranks, and the assertions users write against it."""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..errors import DdpHooksWarning
from . import collectives, events, export
from .clocks import Clocks, Instance, Lanes, instances, op_of
from .events import Event, RawEvent, to_events_and_threads


class TimelineAssertionError(AssertionError):
    """A Timeline assertion failed; the message explains it and draws the swimlanes.

    ``highlights`` names the events at fault, for pictures of the timeline: for a refused
    happens-before, each pair ``{"a": [rank, index], "b": [rank, index], "why": ...}`` where
    ``a`` ended and ``b`` started with no synchronisation between them."""

    def __init__(self, message: str, highlights: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.highlights = highlights or []


TimelineAssertionError.__module__ = "pytest_ddphooks"  # how reports name it: where users import it


class NeverWaitedWarning(DdpHooksWarning):
    """An asynchronous collective or send/recv of a test was never waited for."""


NeverWaitedWarning.__module__ = "pytest_ddphooks"


@dataclass(frozen=True)
class Span:
    """One call, barrier, collective or mark: its start and its end (None if it never ended)."""

    rank: int
    name: str
    kind: str
    start: Event
    end: Event | None

    def label(self) -> str:
        return f"{self.name} on rank {self.rank} (event #{self.start.index})"


@dataclass(frozen=True)
class NoopBarrier:
    rank: int
    name: str
    index: int
    reason: str

    def __str__(self) -> str:
        return f"no-op barrier: {self.name!r} on rank {self.rank} (event #{self.index}) {self.reason}"


# what each member of a collective called: (rank, the signature of its call; None: it never entered it)
Calls = tuple[tuple[int, "str | None"], ...]


@dataclass(frozen=True)
class Mismatch:
    """The first collective on a group where the members disagree."""

    group: str
    seq: int
    calls: Mapping[int, str | None]  # rank -> signature, None when the rank never entered it
    group_ranks: tuple[int, ...]
    what: str = ""  # what it is, where not "collective #seq" (a send and its receive)
    why: str = ""  # why the backend takes the calls as a mismatch, where it is not plain

    @property
    def called(self) -> Calls:
        """What each member called, in rank order: the same on every rank and after pickling."""
        return tuple(sorted(self.calls.items()))

    def __str__(self) -> str:
        label = collectives.group_label(self.group, list(self.group_ranks) if self.group != "default" else None)
        parts = []
        for rank in sorted(self.calls):
            call = self.calls[rank]
            parts.append(f"rank {rank} {call}" if call else f"rank {rank} never entered it")
        text = f"{self.what or f'collective #{self.seq}'} on {label}: " + ", ".join(parts)
        return f"{text}: {self.why}" if self.why else text


def parse_selector(selector: str) -> tuple[str, tuple[int, ...] | None]:
    """``"setup@0,2"`` -> ("setup", (0, 2)); ``"setup"`` -> ("setup", None)."""
    if not isinstance(selector, str):
        raise TypeError(
            f"an event is named by a str ('setup', 'setup@0', 'setup@0,2'), got {type(selector).__name__} {selector!r}"
        )
    name, sep, where = selector.rpartition("@")
    # ASCII digits: str.isdigit() also takes '²', which int() refuses
    if sep and where and all(part.strip().isascii() and part.strip().isdigit() for part in where.split(",")):
        return name, tuple(int(part) for part in where.split(","))
    return selector, None


def _absent_on(ranks: tuple[int, ...] | None, found: Sequence[Span]) -> tuple[int, ...]:
    """The ranks named in a selector on which none of its events was recorded."""
    if ranks is None:
        return ()
    seen = {s.rank for s in found}
    return tuple(sorted({r for r in ranks if r not in seen}))


def _where(ranks: tuple[int, ...] | None) -> str:
    if ranks is None:
        return "any rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _rank_argument(method: str, rank: object) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"{method}: a rank is an int, got {type(rank).__name__} {rank!r}")


class Timeline:
    """Every rank's events, with happens-before established through synchronisation."""

    def __init__(
        self,
        by_rank: Mapping[int, Sequence[Event]],
        lanes: Mapping[tuple[int, int], str] | None = None,
        idents: Mapping[tuple[int, int], int] | None = None,
    ) -> None:
        self._by_rank = {rank: list(by_rank[rank]) for rank in sorted(by_rank)}
        self.lanes: dict[tuple[int, int], str] = dict(lanes or {})
        self._idents = dict(idents or {})  # (rank, lane) -> its thread's ident
        # told what ``collective_mismatches()`` gave its caller (the recorder that made the
        # timeline: a test that looks at them itself expects them); not pickled
        self.on_mismatches_found: Callable[[list[Mismatch]], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "on_mismatches_found": None}

    @classmethod
    def from_raw(cls, raw_by_rank: Mapping[int, Iterable[RawEvent]]) -> Timeline:
        by_rank: dict[int, list[Event]] = {}
        lanes: dict[tuple[int, int], str] = {}
        idents: dict[tuple[int, int], int] = {}
        for rank, raw in raw_by_rank.items():
            evs, names, threads = to_events_and_threads(rank, list(raw))
            by_rank[rank] = evs
            lanes.update({(rank, lane): name for lane, name in names.items()})
            idents.update({(rank, lane): ident for lane, ident in threads.items()})
        return cls(by_rank, lanes, idents)

    # -- reading -----------------------------------------------------------------------------

    @property
    def events(self) -> list[Event]:
        return [e for evs in self._by_rank.values() for e in evs]

    @property
    def ranks(self) -> list[int]:
        return list(self._by_rank)

    def events_of(self, rank: int) -> list[Event]:
        """The events of ``rank``; none for a rank the timeline does not have."""
        return list(self._by_rank.get(rank, []))

    def for_rank(self, rank: int) -> list[Event]:
        _rank_argument("for_rank", rank)
        if rank not in self._by_rank:
            raise ValueError(f"for_rank({rank}): no rank {rank} in this timeline (it has {_where(tuple(self.ranks))})")
        return list(self._by_rank[rank])

    @cached_property
    def instances(self) -> dict[tuple[Any, ...], Instance]:
        return instances(self._by_rank, self.lane_of)

    @cached_property
    def lane_of(self) -> Lanes:
        """The rank (lane) of a rank of the default group as a call named it (a root, a peer);
        ``lane_of(rank, event)``: as that event named it."""
        return Lanes(self._by_rank)

    @cached_property
    def clocks(self) -> Clocks:
        return Clocks(self._by_rank, self.instances.values())

    @cached_property
    def _spans(self) -> list[Span]:
        out: list[Span] = []
        for rank, evs in self._by_rank.items():
            open_spans: dict[int, Event] = {}
            order: list[int] = []
            ends: dict[int, Event] = {}
            for e in evs:
                if e.phase == events.START:
                    open_spans[e.call_id] = e
                    order.append(e.call_id)
                elif e.phase == events.END:
                    ends[e.call_id] = e
                else:
                    out.append(Span(rank, e.name, e.kind, e, e))
            for call_id in order:
                start = open_spans[call_id]
                out.append(Span(rank, start.name, start.kind, start, ends.get(call_id)))
        out.sort(key=lambda s: (s.rank, s.start.index))
        return out

    def spans(self, name: str | None = None, ranks: Iterable[int] | None = None) -> list[Span]:
        wanted = None if ranks is None else set(ranks)
        return [s for s in self._spans if (name is None or s.name == name) and (wanted is None or s.rank in wanted)]

    def open_spans(self, rank: int) -> list[Span]:
        """Calls and collectives a rank entered and never left (outermost first)."""
        return [s for s in self.spans(ranks=[rank]) if s.end is None and s.kind != events.MARK]

    def _select(self, selector: str) -> tuple[str, tuple[int, ...] | None, list[Span]]:
        name, ranks = parse_selector(selector)
        return name, ranks, self.spans(name, ranks)

    # -- happens-before ----------------------------------------------------------------------

    def happens_before(self, a: str, b: str) -> bool:
        """Whether every ``a`` ends before any ``b`` starts, through synchronisation."""
        _, ranks_a, first = self._select(a)
        _, ranks_b, then = self._select(b)
        if _absent_on(ranks_a, first) or _absent_on(ranks_b, then):
            return False
        return bool(first and then) and not self._violations(first, then, keep=0, count=False)[1]

    def _violations(
        self, first: list[Span], then: list[Span], keep: int = 3, count: bool = True
    ) -> tuple[list[tuple[Span, Span]], int]:
        """The first ``keep`` pairs (an ``a``, a ``b``) that synchronisation does not order, in
        the order of the two lists, and how many such pairs there are (without ``count``: it
        stops at the first). Happens-before follows program order, so of one lane's ``b``
        events those an ``a`` ends before are the lane's last ones: found by bisection, not
        pair by pair (thousands of events each would be millions of pairs)."""
        clocks = self.clocks
        lanes: dict[Any, list[tuple[int, Span]]] = {}
        for j, y in enumerate(then):  # per lane in program order: ``then`` is in event order
            lanes.setdefault(clocks.lane_of(y.start), []).append((j, y))
        bad: list[tuple[Span, Span]] = []
        total = 0
        for x in first:
            if x.end is None:
                total += len(then)
                bad.extend((x, y) for y in then[: max(keep - len(bad), 0)])
            else:
                unordered: list[int] = []
                for lane in lanes.values():
                    lo, hi = 0, len(lane)
                    while lo < hi:  # the first of the lane that x ends before
                        mid = (lo + hi) // 2
                        if clocks.happens_before(x.end, lane[mid][1].start):
                            hi = mid
                        else:
                            lo = mid + 1
                    total += lo
                    if len(bad) < keep:
                        unordered.extend(j for j, _ in lane[:lo])
                if unordered and len(bad) < keep:
                    bad.extend((x, then[j]) for j in sorted(unordered)[: keep - len(bad)])
            if total and not count:
                break
        return bad, total

    def assert_happens_before(self, a: str, b: str) -> None:
        """Every ``a`` ends before any ``b`` starts, established by synchronisation.

        ``"name"`` means the event on every rank where it occurs, ``"name@0"`` on rank 0,
        ``"name@0,2"`` on ranks 0 and 2.
        """
        __tracebackhide__ = True
        name_a, ranks_a, first = self._select(a)
        name_b, ranks_b, then = self._select(b)
        for selector, name, ranks, found in ((a, name_a, ranks_a, first), (b, name_b, ranks_b, then)):
            absent = _absent_on(ranks, found) if found else ranks
            if not found or absent:
                # a rank named in the selector must have the event: skipping it would prove nothing
                self._fail(
                    f"{a!r} does not happen before {b!r}: no {name!r} was recorded on {_where(absent)}"
                    + self._absence_hint(name, absent, selector)
                )
        bad, total = self._violations(first, then)
        if not total:
            return
        lines = [f"{a!r} does not happen before {b!r}:"]
        highlights = []
        for x, y in bad[:3]:
            explained = self._explain(x, y)
            lines.extend("  " + line for line in explained)
            done = x.end if x.end is not None else x.start
            why = explained[1] if len(explained) > 1 else explained[0]
            highlights.append({"a": [x.rank, done.index], "b": [y.rank, y.start.index], "why": why})
        if total > len(bad):
            lines.append(f"  ... and {total - len(bad)} more pairs")
        self._fail("\n".join(lines), highlights)

    def _absence_hint(self, name: str, ranks: Iterable[int] | None, selector: str = "") -> str:
        """Why a selector found nothing, when it is a mistake: a rank the timeline does not
        have, what looks like a rank list after '@' that is not one, or an event whose own
        name ends like a rank list."""
        if ranks is not None and selector and self.spans(selector):
            return (
                f" (an event named {selector!r} was recorded: the last '@' starts the ranks, so it is"
                f" selected as {selector + '@0'!r}, {selector + '@0,1'!r}, ...)"
            )
        unknown = [r for r in ranks or () if r not in self._by_rank]
        if unknown:
            return f" (this timeline has {_where(tuple(self.ranks))}; no rank {','.join(map(str, unknown))})"
        if "@" in name and not self.spans(name):
            return (
                f" ({name!r} is read as one event name: after '@' come rank numbers, as in"
                f" {name.rpartition('@')[0] + '@0'!r} or {name.rpartition('@')[0] + '@0,2'!r})"
            )
        return ""

    def _explain(self, x: Span, y: Span) -> list[str]:
        if x.end is None:
            return [f"{x.name} on rank {x.rank} (event #{x.start.index}) never ended"]
        if x is y:
            return [f"{x.name} on rank {x.rank} (event #{x.start.index}) is both: nothing happens before itself"]
        head = (
            f"{x.name} ended on rank {x.rank} (event #{x.end.index}) and "
            f"{y.name} started on rank {y.rank} (event #{y.start.index})"
        )
        if x.rank == y.rank and x.end.lane == y.start.lane:
            return [
                f"{y.name} started on rank {y.rank} (event #{y.start.index}) before {x.name} ended there"
                f" (event #{x.end.index})"
            ]
        if x.rank == y.rank:
            threads = [self.lanes.get((x.rank, lane)) or f"lane {lane}" for lane in (x.end.lane, y.start.lane)]
            return [
                head + ",",
                f"on different threads of rank {x.rank} ({threads[0]!s}, {threads[1]!s}): what orders threads of one"
                " process (a join, a lock, a queue) is not recorded, so it orders nothing here",
            ]
        passed = [
            inst
            for inst in self.instances.values()
            if y.rank in inst.ends and inst.ends[y.rank].index < y.start.index and x.rank in inst.members
        ]
        passed.sort(key=lambda inst: inst.ends[y.rank].index)
        lines = [head + ","]
        if not passed:
            lines.append(
                f"and no collective connects them: rank {y.rank} took part in no collective"
                f" with rank {x.rank} before event #{y.start.index}"
            )
        else:
            lines.append(f"and no collective connects them; before event #{y.start.index} rank {y.rank} passed:")
            for inst in passed[-4:]:
                lines.append("  " + self._describe_passage(inst, x, y))
        for nb in self.noop_barriers():
            if (nb.rank == y.rank and nb.index < y.start.index) or (nb.rank == x.rank and nb.index > x.start.index):
                lines.append(str(nb))
        lines.extend(self._unseen_between(x, y))
        return lines

    def _unseen_between(self, x: Span, y: Span) -> list[str]:
        """Collectives the recorder could not see (a gap in a group's sequence), and those
        whose place in it is not certain (unpaired), after ``x`` ended on its rank or before
        ``y`` started on its own: they order nothing here."""
        assert x.end is not None
        out = []
        for rank, lo, hi in ((x.rank, x.end.index, None), (y.rank, None, y.start.index)):
            present = {
                (e.info.get("group"), e.info.get("seq"))
                for e in self._by_rank.get(rank, [])
                if e.phase == events.START and e.info.get("seq")
            }
            unsure = []
            for e in self._by_rank.get(rank, []):
                if e.phase != events.START or not (e.info.get("unseen") or e.info.get("unsure")):
                    continue
                if (lo is not None and e.index <= lo) or (hi is not None and e.index >= hi):
                    continue
                label = collectives.group_label(str(e.info.get("group")), e.info.get("ranks"))
                if e.info.get("unsure"):
                    unsure.append(
                        f"{op_of(e)} on {label} (rank {rank}, event #{e.index}) has no place in the group's sequence"
                        f" anyone can be sure of ({e.info['unsure']}): it is paired with nothing, so it orders nothing"
                    )
                    continue
                seq, group = int(e.info["seq"]), e.info.get("group")
                # what native code issued in the gap was found later: only the rest is unseen
                missing = [k for k in range(seq - int(e.info["unseen"]), seq) if (group, k) not in present]
                if not missing:
                    continue
                numbers = f"#{missing[0]}" if len(missing) == 1 else f"#{missing[0]} to #{missing[-1]}"
                out.append(
                    f"collective {numbers} on {label} (rank {rank}, before event #{e.index}) was issued through"
                    " an API the recorder cannot see; it is treated as ordering nothing"
                )
            out.extend(unsure)
        return out

    def _describe_passage(self, inst: Instance, x: Span, y: Span) -> str:
        assert x.end is not None
        label = f"{inst.label()} on {collectives.group_label(inst.group, list(inst.members))}"
        if inst.apart is not None:
            return (
                f"{label}, which rank {inst.apart} called in a world apart from the other ranks' (a world of one,"
                " or one whose members the places and sizes its init_process_group returned cannot tell): it is"
                " paired with no other rank's call"
            )
        if inst.hollow is not None:
            return f"{label}, on a group of backend {inst.hollow!r}, which returns without waiting for anyone"
        start = inst.starts.get(x.rank)
        p2p = inst.key[0] == "p"
        if start is None and p2p and x.rank in inst.ends:
            # the receiving side of a send/recv: its receive is where it entered
            received = inst.ends[x.rank]
            if inst.completion(x.rank) is None and received.info.get("async"):
                return f"{label}, which rank {x.rank} issued at event #{received.index} and never waited for"
            start = received
        if start is None:
            unsure = [
                e
                for e in self._by_rank.get(x.rank, [])
                if e.phase == events.START and e.info.get("unsure") and e.info.get("group") == inst.group
            ]
            if unsure:
                return (
                    f"{label}, which rank {x.rank} may have entered as the {op_of(unsure[0])} of event"
                    f" #{unsure[0].index}; but that call has no place in the group's sequence anyone can be sure of"
                    f" ({unsure[0].info['unsure']}): it is paired with nothing"
                )
            return f"{label}, which rank {x.rank} never entered"
        within = self._enclosing(start)
        if within is not None:
            label += f" (issued in {within.name})"
        if not inst.consistent:
            return f"{label}, where the ranks called different collectives"
        # the receiving side of a send/recv is seen where its receive returned
        missing = [m for m in inst.members if m not in inst.starts and not (p2p and m in inst.ends)]
        if missing:
            who = ",".join(str(m) for m in missing)
            return f"{label}, which rank{'s' if len(missing) > 1 else ''} {who} never entered"
        raised = sorted(r for r, e in inst.ends.items() if "error" in e.info)
        if raised:
            return f"{label}, which raised on rank {','.join(str(r) for r in raised)}"
        if inst.empty:
            return (
                f"{label}, on a tensor with no element: gloo returns from it without waiting for"
                " the other ranks, so it orders nothing"
            )
        native = sorted(r for r, e in inst.starts.items() if e.info.get("native"))
        if native:
            api = inst.starts[native[0]].info.get("native")
            return (
                f"{label}, which rank {','.join(str(r) for r in native)} issued from native code ({api}):"
                " its completion cannot be seen, so it orders nothing"
            )
        if start.lane != x.end.lane:
            threads = [self.lanes.get((x.rank, lane)) or f"lane {lane}" for lane in (start.lane, x.end.lane)]
            return (
                f"{label}, which rank {x.rank} entered on thread {threads[0]} (event #{start.index}), not on"
                f" {threads[1]}, where {x.name} ran: what orders threads of one process (a join, a lock, a queue)"
                " is not recorded, so it does not order them"
            )
        if start.index < x.end.index:
            return f"{label}, which rank {x.rank} entered at event #{start.index}, before {x.name} ended"
        y_end = inst.ends.get(y.rank)
        if y.rank in inst.handed:
            return (
                f"{label}, whose completion rank {y.rank} handed to a future (Work.get_future, as DDP's comm"
                " hooks do) or to DDP's reducer (as Join does): it is waited out of sight, so it orders nothing"
            )
        if y_end is not None and y_end.info.get("async") and inst.completion(y.rank) is None:
            return f"{label}, which was asynchronous on rank {y.rank} and never waited for there"
        done = inst.completion(y.rank)
        if done is not None and done.index > y.start.index:
            return f"{label}, which rank {y.rank} waited for only at event #{done.index}, after {y.name} started"
        if inst.sync == collectives.FROM_ROOT and inst.root != x.rank:
            return f"{label}, whose root is rank {inst.root}: it orders only the root before the others"
        if inst.sync == collectives.TO_ROOT:
            return f"{label}, which orders the others before its root (rank {inst.root}) only"
        if p2p and x.rank == inst.members[1]:
            sender, receiver = inst.members
            return f"{label}, which orders only the sender (rank {sender}) before the receiver (rank {receiver})"
        return f"{label}, which does not order rank {x.rank} before it"

    def _enclosing(self, e: Event) -> Span | None:
        """The innermost framework barrier, else instrumented call, that ``e`` happened in."""
        barrier, call = self._hooks_around([e]).get((e.rank, e.index), (None, None))
        return barrier or call

    def _hooks_around(self, wanted: Iterable[Event]) -> dict[tuple[int, int], tuple[Span | None, Span | None]]:
        """(rank, index) of each wanted event -> the innermost framework barrier and the
        innermost instrumented call open around it on its thread: one walk for all of them."""
        want = {(e.rank, e.index) for e in wanted}
        ranks = {rank for rank, _ in want}
        hooks = {(s.rank, s.start.index): s for s in self._spans if s.kind in (events.BARRIER, events.CALL)}
        out: dict[tuple[int, int], tuple[Span | None, Span | None]] = {}
        for rank in ranks:
            lanes: dict[int, list[Span]] = {}  # lane -> the calls open on it, outermost first
            for e in self._by_rank.get(rank, []):
                open_calls = lanes.setdefault(e.lane, [])
                if (rank, e.index) in want:
                    out[(rank, e.index)] = (
                        next((s for s in reversed(open_calls) if s.kind == events.BARRIER), None),
                        next((s for s in reversed(open_calls) if s.kind == events.CALL), None),
                    )
                if e.kind not in (events.CALL, events.BARRIER):
                    continue
                if e.phase == events.START:
                    open_calls.append(hooks[(rank, e.index)])
                elif e.phase == events.END:
                    # a call may end out of order (a generator's): it leaves wherever it is
                    at = next(
                        (i for i in range(len(open_calls) - 1, -1, -1) if open_calls[i].start.call_id == e.call_id),
                        None,
                    )
                    if at is not None:
                        del open_calls[at]
        return out

    # -- other assertions --------------------------------------------------------------------

    def assert_order(self, names: Sequence[str], rank: int | None = None) -> None:
        """The names occur in this order (as a subsequence) on ``rank``, or on every rank."""
        __tracebackhide__ = True
        if isinstance(names, str):
            names = [names]
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"assert_order takes event names (str), got {type(n).__name__} {n!r}")
        if rank is not None:
            _rank_argument("assert_order", rank)
        if rank is not None and rank not in self._by_rank:
            self._fail(
                f"order {' -> '.join(names)}: no rank {rank} in this timeline (it has {_where(tuple(self.ranks))})"
            )
        ranks = self.ranks if rank is None else [rank]
        problems = []
        for r in ranks:
            starts = [s for s in self.spans(ranks=[r])]
            k = 0
            last_index = -1
            for s in starts:
                if k < len(names) and s.name == names[k]:
                    k += 1
                    last_index = s.start.index
            if k < len(names):
                missing = names[k]
                where = [s.start.index for s in starts if s.name == missing]
                if k == 0:
                    detail = f"{missing} never happened" if not where else f"{missing} at {_at(where)}"
                else:
                    detail = f"{names[k - 1]} at event #{last_index}, then no {missing} after it"
                    detail += f" ({missing} at {_at(where)})" if where else f" ({missing} never happened)"
                problems.append(f"rank {r}: {detail}")
        if problems:
            self._fail("order " + " -> ".join(names) + " not found:\n" + "\n".join("  " + p for p in problems))

    def assert_called_once(self, name: str) -> None:
        """On each rank where ``name`` occurs, it occurs exactly once.

        With explicit ranks (``"name@0,2"``) it must occur exactly once on each of them.
        """
        __tracebackhide__ = True
        base, ranks, found = self._select(name)
        if not found:
            self._fail(f"{name!r} was never called on {_where(ranks)}" + self._absence_hint(base, ranks, name))
        counts: dict[int, list[int]] = {r: [] for r in ranks or ()}
        for s in found:
            counts.setdefault(s.rank, []).append(s.start.index)
        problems = [
            f"{base!r} was never called on rank {r}; expected exactly once"
            if not idx
            else f"{base!r} was called {len(idx)} times on rank {r} ({_at(idx)}); expected exactly once"
            for r, idx in sorted(counts.items())
            if len(idx) != 1
        ]
        if problems:
            self._fail("\n".join(problems), focus=[(r, i) for r, idx in counts.items() for i in idx])

    def noop_barriers(self) -> list[NoopBarrier]:
        """Framework barriers (``instrument_barrier``) whose own collectives synchronised the rank
        with nobody before they returned: none, or only ones that wait for nobody (raised, on a
        group of the rank alone, on no element), or not completed by then (asynchronous and not
        waited for, or on a thread it started and did not wait for)."""
        out = []
        for s in self._spans:
            if s.kind != events.BARRIER or s.end is None:
                continue
            reason = self._noop_reason(s)
            if reason is not None:
                out.append(NoopBarrier(s.rank, s.name, s.start.index, reason))
        return out

    def _noop_reason(self, barrier: Span) -> str | None:
        """Why a framework barrier synchronised nothing; None if it did. What it synchronised
        through: its own collectives, those native code issued on its thread meanwhile (DDP's
        constructor, torch.ops: whose they are cannot be told, so they count for it), and those
        of threads it started that completed them before it returned."""
        assert barrier.end is not None
        own, unpaired = self._own(barrier)
        known = {id(inst) for inst in own}
        beside = []
        for inst in (*(i for i in self._inside(barrier) if i.native), *self._joined(barrier)):
            if id(inst) not in known:
                known.add(id(inst))
                beside.append(inst)
        if not barrier.end.info.get("collectives", 1) and not beside:
            if not barrier.start.info.get("group_existed", True):
                return "issued no collective: no process group existed"
            if self._only_queued(barrier):
                return (
                    "issued no collective: it only queued some in a coalescing manager, which issued them"
                    " after it returned"
                )
            if self._raised_before_issued(barrier):
                return "issued no collective: the ones it called raised before they reached the group"
            if self._left_on_threads(barrier):
                return _NOOP_ALIKE[_THREAD]
            return "issued no collective: the process group existed but no collective was called"
        judged = [*own, *beside]
        labelled = [(inst.label(), self._waits_for_nobody(inst, barrier)) for inst in judged]
        # a call that was never one of a group's collectives (it raised before, or the recorder
        # could not describe it): one that raised synchronised nobody, of another nothing is known
        labelled += [(call.name.removeprefix("dist."), _raised(call)) for call in unpaired]
        whys = [(label, why) for label, why in labelled if why is not None]
        if not labelled or len(whys) < len(labelled):
            return None
        kinds = {kind for _, (kind, _) in whys}
        if len(kinds) > 1:
            each = ", ".join(f"{label} {text}" for label, (_, text) in whys)
            return f"issued only collectives that synchronised it with nobody before it returned: {each}"
        kind = kinds.pop()
        if kind == _ASYNC:
            calls = "sends or receives" if judged and all(i.key[0] == "p" for i in judged) else "collectives"
            return f"issued only asynchronous {calls}, and waited for none of them before it returned"
        return _NOOP_ALIKE[kind]

    def _waits_for_nobody(self, inst: Instance, barrier: Span) -> tuple[int, str] | None:
        """Why a collective a barrier issued synchronised its rank with nobody before the barrier
        returned (its kind, and the words for it alone), if it did not."""
        assert barrier.end is not None
        if inst.errored:
            return _ERRORED, "raised"
        if inst.hollow is not None:
            return _HOLLOW, f"was on a group of backend {inst.hollow!r}"
        if len(self.ranks) > 1 and len(inst.members) == 1:
            # a world of one rank is alone by design: its barriers are none the worse for it
            return _ALONE, "was on a group of this rank alone"
        if inst.native or _completed_before(inst, barrier.rank, barrier.end.index):
            if inst.empty:
                return _EMPTY, "had no element"
            return None
        entered = inst.starts.get(barrier.rank) or inst.ends.get(barrier.rank)
        if entered is not None and entered.lane != barrier.start.lane:
            return _THREAD, "ran on a thread it did not wait for"
        return _ASYNC, "was asynchronous and not waited for"

    def _own(self, barrier: Span) -> tuple[list[Instance], list[Span]]:
        """The collectives (and sends and receives) a framework barrier's own code issued: on its
        thread or on the tasks and threads it started, not its caller's ``with`` block; and its
        own calls that are no collective of a group (never issued, or not described)."""
        assert barrier.end is not None
        ids = barrier.end.info.get("own_calls")
        if ids is None:  # a barrier recorded without them: what ran on its thread meanwhile
            return self._inside(barrier), []
        by_call, calls = self._instance_of_call, self._sync_call
        found: dict[int, Instance] = {}
        unpaired = []
        for call_id in ids:
            inst = by_call.get((barrier.rank, call_id))
            if inst is not None:
                found[id(inst)] = inst
            elif (barrier.rank, call_id) in calls:
                unpaired.append(calls[(barrier.rank, call_id)])
        return list(found.values()), unpaired

    @cached_property
    def _sync_call(self) -> dict[tuple[int, int], Span]:
        """(rank, call id) -> the span of that collective (or send or receive) call."""
        return {(s.rank, s.start.call_id): s for s in self._spans if s.kind in (events.COLLECTIVE, events.P2P)}

    @cached_property
    def _instance_of_call(self) -> dict[tuple[int, int], Instance]:
        """(rank, call id) -> the collective (or send or receive) that call made."""
        out: dict[tuple[int, int], Instance] = {}
        for inst in self.instances.values():
            for rank, e in (*inst.starts.items(), *inst.ends.items()):
                out.setdefault((rank, e.call_id), inst)
        return out

    def _inside(self, barrier: Span) -> list[Instance]:
        """The collectives (and sends and receives) the rank entered on the barrier's thread
        while it ran."""
        assert barrier.end is not None
        entered = self._entered_by_rank.get(barrier.rank, [])
        lane = barrier.start.lane
        begun = bisect_right(entered, (barrier.start.index, 1 << 62))
        inside = []
        for index, at_lane, order in entered[begun:]:
            if index >= barrier.end.index:
                break
            if at_lane == lane:
                inside.append(self._entered_instances[order])
        return inside

    @cached_property
    def _entered_instances(self) -> list[Instance]:
        return list(self.instances.values())

    @cached_property
    def _entered_by_rank(self) -> dict[int, list[tuple[int, int, int]]]:
        """Rank -> (index, lane, instance's place in ``_entered_instances``) of where the rank
        entered each collective, in order (a receive is in its pair's ends alone: where it
        returned, from a wait or at once)."""
        out: dict[int, list[tuple[int, int, int]]] = {}
        for order, inst in enumerate(self._entered_instances):
            for rank in {*inst.starts, *inst.ends}:
                entered = inst.starts.get(rank) or inst.ends.get(rank)
                if entered is not None:
                    out.setdefault(rank, []).append((entered.index, entered.lane, order))
        for calls in out.values():
            calls.sort()
        return out

    def _only_queued(self, barrier: Span) -> bool:
        """The barrier's thread called collectives a coalescing manager only queued."""
        assert barrier.end is not None
        return any(
            e.kind == events.COLLECTIVE
            and e.phase == events.START
            and e.lane == barrier.start.lane
            and e.info.get("queued")
            for e in self._by_rank.get(barrier.rank, [])[barrier.start.index + 1 : barrier.end.index]
        )

    def _joined(self, barrier: Span) -> list[Instance]:
        """The collectives other threads of the rank, ones the barrier started, entered and
        completed before it returned (``Thread(target=dist.barrier)``, started and joined). A
        thread that was running before the barrier began (its ident among those the barrier's
        start saw, or an event of it earlier) is not the barrier's: its collective completing
        meanwhile is chance, not a wait."""
        assert barrier.end is not None
        begun, returned = barrier.start.index, barrier.end.index
        calls = self._completed_calls.get(barrier.rank, [])
        out = []
        for entered, lane, done, order in calls[bisect_right(calls, (begun, 1 << 62, 0, 0)) :]:
            if entered >= returned:
                break
            if done < returned and self._started_by(barrier, lane):
                out.append(self._entered_instances[order])
        return out

    def _left_on_threads(self, barrier: Span) -> bool:
        """A thread the barrier started (as ``_joined`` tells) entered a collective while it ran
        that had not completed by the time it returned."""
        assert barrier.end is not None
        begun, returned = barrier.start.index, barrier.end.index
        for inst in self._entered_instances:
            start = inst.starts.get(barrier.rank)
            if start is None or not begun < start.index < returned or not self._started_by(barrier, start.lane):
                continue
            done = inst.completion(barrier.rank)
            if done is None or done.index >= returned:
                return True
        return False

    def _started_by(self, barrier: Span, lane: int) -> bool:
        """``lane`` of the barrier's rank is a thread the barrier started: not its own, with no
        event before it began, and not among the threads running as it began."""
        key = (barrier.rank, lane)
        return (
            lane != barrier.start.lane
            and self._first_of_lane[key] >= barrier.start.index
            and self._idents.get(key) not in barrier.start.info.get("running", ())
        )

    @cached_property
    def _first_of_lane(self) -> dict[tuple[int, int], int]:
        """(rank, lane) -> the index of the lane's first event."""
        out: dict[tuple[int, int], int] = {}
        for e in self.events:
            key = (e.rank, e.lane)
            out[key] = min(out.get(key, e.index), e.index)
        return out

    @cached_property
    def _completed_calls(self) -> dict[int, list[tuple[int, int, int, int]]]:
        """Rank -> (index entered, lane, index completed, place in ``_entered_instances``) of each
        collective it completed, in order."""
        out: dict[int, list[tuple[int, int, int, int]]] = {}
        for order, inst in enumerate(self._entered_instances):
            for rank, start in inst.starts.items():
                done = inst.completion(rank)
                if done is not None:
                    out.setdefault(rank, []).append((start.index, start.lane, done.index, order))
        for calls in out.values():
            calls.sort()
        return out

    def _raised_before_issued(self, barrier: Span) -> bool:
        """The barrier's rank called collectives in it that raised before they reached the group
        (a bad root the barrier's own code then caught)."""
        assert barrier.end is not None
        return any(
            lane == barrier.start.lane and barrier.start.index < index < barrier.end.index
            for index, lane in self._never_issued.get(barrier.rank, ())
        )

    @cached_property
    def _never_issued(self) -> dict[int, list[tuple[int, int]]]:
        """Rank -> (index, lane) of the start of each collective call that raised before it
        reached its group (few: looked through for each barrier)."""
        out: dict[int, list[tuple[int, int]]] = {}
        for s in self._spans:
            if s.kind in (events.COLLECTIVE, events.P2P) and s.end is not None and s.end.info.get("issued") is False:
                out.setdefault(s.rank, []).append((s.start.index, s.start.lane))
        return out

    def never_waited(self) -> list[str]:
        """Asynchronous collectives and sends/receives whose completion no rank waited for."""
        out = []
        for inst in sorted(self.instances.values(), key=lambda i: (i.group, i.seq)):
            where = "" if inst.group == "default" else f" on {collectives.group_label(inst.group, list(inst.members))}"
            for rank in inst.never_waited():
                out.append(f"async {inst.label()}{where} on rank {rank} was never waited")
        return out

    def assert_no_noop_barriers(self) -> None:
        __tracebackhide__ = True
        found = self.noop_barriers()
        if found:
            self._fail("\n".join(str(nb) for nb in found), focus=[(nb.rank, nb.index) for nb in found])

    def collective_mismatches(self) -> list[Mismatch]:
        """Per group, the first collective where the members called different things; and
        each receive that met a message larger than its buffer (gloo aborts it)."""
        by_group: dict[str, list[Instance]] = {}
        for inst in self.instances.values():
            if inst.key[0] == "c":
                by_group.setdefault(inst.group, []).append(inst)
        out = []
        for group, insts in by_group.items():
            for inst in sorted(insts, key=lambda i: i.seq):
                if not inst.consistent:
                    out.append(Mismatch(group, inst.seq, _calls_of(inst), inst.members))
                    break
        out.sort(key=lambda m: (m.seq, m.group))
        out += self._oversized_messages()
        if out and self.on_mismatches_found is not None:
            self.on_mismatches_found(out)
        return out

    def mismatched(self) -> dict[tuple[str, int], tuple[Calls, bool]]:
        """(group, seq) -> what each member called, and whether every member completed it, of
        every collective the members disagree on (not only each group's first) and of each
        receive whose message is larger than its buffer (gloo aborts it)."""
        out = {
            (inst.group, inst.seq): (
                Mismatch(inst.group, inst.seq, _calls_of(inst), inst.members).called,
                all(inst.completion(m) is not None for m in inst.members),
            )
            for inst in self.instances.values()
            if inst.key[0] == "c" and not inst.consistent
        }
        out.update({(m.group, m.seq): (m.called, False) for m in self._oversized_messages()})
        return out

    def _oversized_messages(self) -> list[Mismatch]:
        """Receives whose message holds more bytes than their buffer: gloo aborts such a
        receive. A receive paired as it returned (an irecv) has its message; one that never
        returned waited for the first message from its source that no receive took yet."""
        received = {(r, e.call_id): i for i in self.instances.values() if i.key[0] == "p" for r, e in i.ends.items()}
        out = []
        for span in self._spans:
            info = span.start.info
            if span.kind != events.P2P or info.get("sync") != collectives.RECV:
                continue
            message = received.get((span.rank, span.start.call_id))
            never_returned = span.end is None or "error" in span.end.info
            if message is None and never_returned and info.get("src") is not None:
                wanted = ("p", info.get("group"), self.lane_of(info["src"], span.start), span.rank, info.get("tag", 0))
                pending = [
                    inst
                    for key, inst in self.instances.items()
                    if key[:5] == wanted and span.rank not in inst.ends and wanted[2] in inst.starts
                ]
                message = min(pending, key=lambda i: i.seq, default=None)
            if message is None or message.key[2] not in message.starts:
                continue
            src = message.key[2]
            sent = message.starts[src].info.get("payload")
            held, need = collectives.payload_bytes(info.get("payload")), collectives.payload_bytes(sent)
            if held is None or need is None or need <= held:
                continue
            calls = {src: f"send({sent}) of {need} bytes", span.rank: f"recv({info.get('payload')}) into {held} bytes"}
            out.append(
                Mismatch(
                    message.group,
                    message.seq,
                    calls,
                    message.members,
                    what=f"send/recv {src}->{span.rank}",
                    why="gloo aborts a receive whose message is larger than its buffer",
                )
            )
        return out

    def entered_in_different_hooks(self) -> str | None:
        """The first collective (in time) whose members entered it inside different
        instrumented calls: gloo takes any two barriers (or two all-reduces of one shape) as
        one, so two different ones may have been paired, and the ranks one apart since. Calls
        that do not match (a desync) are no such pairing: gloo does not take them as one."""
        insts = [i for i in self.instances.values() if i.key[0] == "c" and len(i.starts) > 1 and i.consistent]
        around = self._hooks_around(e for i in insts for e in i.starts.values())
        hook: dict[tuple[int, int], str] = {}  # (rank, event index) -> the innermost call around it
        for at, spans in around.items():
            inner = max((s for s in spans if s is not None), key=lambda s: s.start.index, default=None)
            if inner is not None:
                hook[at] = str(inner.start.info.get("qualname") or inner.name)
        for inst in sorted(insts, key=lambda i: min(e.t_ns for e in i.starts.values())):
            where = {r: hook.get((r, e.index)) for r, e in sorted(inst.starts.items())}
            if None in where.values() or len(set(where.values())) < 2:
                continue
            label = collectives.group_label(inst.group, list(inst.members))
            entered = ", ".join(f"rank {r} in {name}" for r, name in where.items())
            return (
                f"{inst.label()} on {label} was entered in different hooks ({entered}): gloo takes any two"
                f" {inst.op} calls of one shape as one, so these may be two different ones, paired"
            )
        return None

    def assert_collectives_match(self) -> None:
        __tracebackhide__ = True
        found = self.collective_mismatches()
        if found:
            self._fail("\n".join(str(m) for m in found))

    # -- export ------------------------------------------------------------------------------

    def swimlanes(self, max_rows: int | None = None, width: int | None = None) -> str:
        return export.swimlanes(self, max_rows=max_rows, width=width)

    def to_chrome_trace(
        self,
        path: str | os.PathLike[str],
        *,
        stopped_ns: int = 0,
        notes: Sequence[tuple[int, int, str]] = (),
        ended: Mapping[int, int] | None = None,
    ) -> str:
        """Write the timeline as Chrome trace JSON; a call never left lasts until ``stopped_ns``
        (``time.time_ns()`` when the ranks were stopped), else until the last event, or until
        its rank ended (``ended``: rank -> time_ns); ``notes``: (rank, time_ns, text) instants."""
        return export.write_chrome_trace(self, path, stopped_ns, notes, ended)

    def _fail(
        self, message: str, highlights: list[dict[str, Any]] | None = None, focus: Sequence[tuple[int, int]] = ()
    ) -> None:
        """Raise, the swimlanes shown around the events at fault: those of ``highlights`` and
        ``focus`` ((rank, index))."""
        __tracebackhide__ = True
        at_fault = [(int(h[k][0]), int(h[k][1])) for h in highlights or () for k in ("a", "b") if k in h]
        lanes = export.swimlanes(self, max_rows=60, focus=[*at_fault, *focus])
        raise TimelineAssertionError(message + "\n\n" + lanes, highlights)


def _at(indices: Sequence[int]) -> str:
    return ("event " if len(indices) == 1 else "events ") + ", ".join(f"#{i}" for i in indices)


# why a barrier's collective synchronised nobody, in the order a mixed reason lists them
_ERRORED, _ALONE, _EMPTY, _ASYNC, _THREAD, _HOLLOW = range(6)
_NOOP_ALIKE = {
    _HOLLOW: "issued only collectives on groups whose backend returns without waiting for anyone ('fake')",
    _ERRORED: "issued only collectives that raised, which synchronise nobody",
    _ALONE: "issued only collectives on groups of this rank alone, which wait for nobody",
    _EMPTY: "issued only collectives on tensors with no element, which wait for nobody",
    _THREAD: "issued only collectives on threads it started, and waited for none of them before it returned",
}


def _calls_of(inst: Instance) -> dict[int, str | None]:
    """Member -> what it called in ``inst`` (None: it never entered it)."""
    calls: dict[int, str | None] = dict.fromkeys(inst.members)
    for r, e in inst.starts.items():
        calls[r] = collectives.signature(op_of(e), dict(e.info))
    return calls


def _raised(call: Span) -> tuple[int, str] | None:
    return (_ERRORED, "raised") if call.end is not None and "error" in call.end.info else None


def _completed_before(inst: Instance, rank: int, index: int) -> bool:
    """The rank saw ``inst`` complete (returned, or its wait did) before event ``index``."""
    done = inst.completion(rank)
    return done is not None and done.index < index
