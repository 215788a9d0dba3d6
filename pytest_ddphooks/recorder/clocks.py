"""Happens-before from vector clocks over the recorded collectives; never from timestamps.

Each (rank, thread) is a lane with its own program order. A completed collective adds edges
from the entry ("start") of some members to the completion of others, as its kind implies
(see ``collectives.OPS``): the exit ("end") of a synchronous call, the end of the wait of an
asynchronous one. Collectives are paired across ranks by their group's own sequence (see
``Recorder.collective_seq``), so one the recorder could not see leaves a gap, never a shift.
A collective the members disagree on, one a member never entered, one that raised, and an
asynchronous call never waited add no edge: the clocks only claim an order that a
synchronisation really enforced.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import collectives, events
from .events import Event

EventKey = tuple[int, int]  # (rank, index)
LaneKey = tuple[int, int]  # (rank, lane)


@dataclass
class Instance:
    """One collective (or one send/recv pair) as seen by all its members."""

    key: tuple[Any, ...]
    op: str
    sync: str
    group: str
    members: tuple[int, ...]
    root: int | None = None
    starts: dict[int, Event] = field(default_factory=dict)
    ends: dict[int, Event] = field(default_factory=dict)
    waits: dict[int, Event] = field(default_factory=dict)  # the end of each async member's wait
    # members that handed it to a future (Work.get_future): waited for, but out of sight
    handed: set[int] = field(default_factory=set)

    @property
    def seq(self) -> int:
        return int(self.key[2]) if self.key[0] in ("c", "m") else int(self.key[-1])

    @property
    def apart(self) -> int | None:
        """The rank whose call it is alone, made in a world apart from the others' (``Lanes.apart``)."""
        group = self.key[1]
        return int(group[2]) if isinstance(group, tuple) and group[1:2] == ("apart",) else None

    @property
    def complete(self) -> bool:
        return all(m in self.starts for m in self.members)

    @property
    def consistent(self) -> bool:
        loose = self.native
        seen = {collectives.comparable(op_of(e), e.info, loose) for e in self.starts.values()}
        return len(seen) <= 1

    @property
    def one_group(self) -> bool:
        """Every rank that entered it is a member, and all name the same members: ranks that
        re-formed as separate worlds (each its own ``init_process_group``) give their groups
        the same name and numbers, yet share no collective."""
        if not set(self.starts) <= set(self.members):
            return False
        return len({(repr(e.info.get("ranks")), e.info.get("group_size")) for e in self.starts.values()}) <= 1

    @property
    def errored(self) -> bool:
        """Some member's call (or wait) raised: the collective as a whole establishes nothing."""
        return any("error" in e.info for e in (*self.ends.values(), *self.waits.values()))

    @property
    def empty(self) -> bool:
        """Some member's payload has no element: gloo returns from such a call (an all-reduce,
        an all-gather, a reduce's root) without hearing from the others, so it orders nothing
        (nor, for safety, through any other collective op; a send or receive still waits)."""
        if self.key[0] == "p":  # a send/recv pair
            return False
        return any(collectives.no_elements(e.info.get("payload")) for e in self.starts.values())

    @property
    def hollow(self) -> str | None:
        """The backend of its group, where that returns without waiting for anyone ("fake")."""
        return next((str(e.info["hollow"]) for e in self.starts.values() if e.info.get("hollow")), None)

    @property
    def native(self) -> bool:
        """Some member issued it from native code, which waits for it out of sight."""
        return any(e.info.get("native") for e in self.starts.values())

    def completion(self, rank: int) -> Event | None:
        """Where the call completed on ``rank``: its end, or for an asynchronous call the end
        of its wait; None when it did not (yet), raised, or was issued from native code."""
        end = self.ends.get(rank)
        start = self.starts.get(rank)
        if end is None or "error" in end.info or (start is not None and start.info.get("native")):
            return None
        if not end.info.get("async"):
            return end
        if rank in self.handed:
            return None  # a future's completion is waited out of sight (by DDP's reducer): unseen
        done = self.waits.get(rank)
        return done if done is not None and "error" not in done.info else None

    def never_waited(self) -> list[int]:
        """Members whose asynchronous call (from Python) returned and was never waited for."""
        return sorted(
            r
            for r, e in self.ends.items()
            if e.info.get("async")
            and (r not in self.waits or "error" in self.waits[r].info)  # a time-out waited for nothing
            and not (r in self.starts and self.starts[r].info.get("native"))
        )

    def label(self) -> str:
        if self.key[0] == "p":
            return f"{self.op} {self.key[2]}->{self.key[3]}"
        return f"{self.op} #{self.seq}"

    def edges(self) -> list[tuple[Event, list[Event]]]:
        """(completion event, the start events it waited for)."""
        if self.hollow is not None:
            return []
        if self.sync == collectives.RECV:
            send = self.starts.get(self.key[2])
            recv_done = self.completion(self.key[3])
            if send is None or recv_done is None or self.errored:
                return []
            return [(recv_done, [send])]
        if not self.complete or not self.one_group or not self.consistent or self.errored or self.empty:
            return []
        out: list[tuple[Event, list[Event]]] = []
        if self.sync == collectives.ALL:
            starts = [self.starts[m] for m in self.members]
            for m in self.ends:
                done = self.completion(m)
                if done is not None:
                    out.append((done, starts))
        elif self.sync == collectives.FROM_ROOT:
            root_start = self.starts.get(self.root) if self.root is not None else None
            if root_start is None:
                return []
            for m in self.ends:
                done = self.completion(m) if m != self.root else None
                if done is not None:
                    out.append((done, [root_start]))
        elif self.sync == collectives.TO_ROOT:
            done = self.completion(self.root) if self.root is not None else None
            if done is None:
                return []
            out.append((done, [self.starts[m] for m in self.members]))
        return out


def collective_key(info: Mapping[str, Any]) -> tuple[Any, ...]:
    """How a collective's start is paired across ranks: its group and place in the group's
    sequence (monitored barriers, made of sends and receives, have a sequence of their own)."""
    kind = "m" if info.get("op") == "monitored_barrier" else "c"
    return (kind, info.get("group"), info.get("seq"))


def op_of(e: Event) -> str:
    return str(e.info.get("op", e.name.removeprefix("dist.")))


def _pair(
    found: dict[tuple[Any, ...], Instance],
    lane: Lanes,
    at: Event,
    src_seq: Mapping[str, Any],
) -> Instance:
    """The send/recv instance of the seq-th message from src to dst with this tag: the group,
    the destination and the tag as the call's start ``at`` names them, the source and its
    message number as ``src_seq`` does (a receive learns them as it returns); ranks taken to
    their lanes."""
    call = at.info
    group, src, dst = call["group"], lane(src_seq["src"], at), lane(call["dst"], at)
    key = _paired_key(("p", group, src, dst, call.get("tag", 0), src_seq["seq"]), lane, at)
    inst = found.get(key)
    if inst is None:
        inst = found[key] = Instance(key, "send/recv", collectives.RECV, str(group), (src, dst))
    return inst


def _paired_key(key: tuple[Any, ...], lane: Lanes, at: Event) -> tuple[Any, ...]:
    """``key`` (its group second), made the rank's own where the call was made in a world apart
    from the other lanes' (``Lanes.apart``): it then pairs with no other lane's call."""
    if not lane.apart(at):
        return key
    return (key[0], (key[1], "apart", at.rank), *key[2:])


def instances(by_rank: Mapping[int, Sequence[Event]], lane: Lanes | None = None) -> dict[tuple[Any, ...], Instance]:
    """Group the recorded collectives and sends/recvs of all ranks into instances (``lane``:
    ``Lanes(by_rank)``, where the caller has it already)."""
    found: dict[tuple[Any, ...], Instance] = {}
    world = tuple(sorted(by_rank))
    lane = lane or Lanes(by_rank)
    for rank, evs in by_rank.items():
        open_starts: dict[int, Event] = {}
        of_call: dict[int, Instance] = {}  # call id -> its instance, for the wait of an async call
        waiting: dict[int, Instance] = {}  # call id of a wait -> the instance it completes
        # an irecv from any source: its start and end, paired where its wait learns the sender
        anysource: dict[int, tuple[Event, Event]] = {}
        waiting_any: dict[int, tuple[Event, Event]] = {}
        for e in evs:
            if e.kind == events.WAIT:
                if e.phase == events.START and int(e.info.get("of", 0)) in anysource:
                    waiting_any[e.call_id] = anysource.pop(int(e.info.get("of", 0)))
                elif e.call_id in waiting_any:
                    received, returned = waiting_any.pop(e.call_id)
                    if e.info.get("seq") and "error" not in e.info and not lane.apart(received):
                        paired = _pair(found, lane, received, e.info)
                        paired.ends[rank], paired.waits[rank] = returned, e
                elif e.phase == events.START:
                    waited = of_call.get(int(e.info.get("of", 0)))
                    if waited is not None:
                        waiting[e.call_id] = waited
                        if e.info.get("future"):
                            waited.handed.add(rank)
                        else:  # a wait from Python, perhaps for the future it was handed to
                            waited.handed.discard(rank)
                elif e.call_id in waiting:
                    waiting.pop(e.call_id).waits[rank] = e
                continue
            if e.kind not in (events.COLLECTIVE, events.P2P):
                continue
            if e.phase == events.START:
                open_starts[e.call_id] = e
                if e.kind == events.COLLECTIVE and e.info.get("seq"):
                    key = _paired_key(collective_key(e.info), lane, e)
                    inst = found.get(key)
                    if inst is None:
                        members = e.info.get("ranks") or list(range(int(e.info.get("group_size") or len(world))))
                        _, sync, _, _ = collectives.OPS.get(op_of(e), (None, collectives.NONE, None, None))
                        root = e.info.get("root")
                        inst = found[key] = Instance(
                            key,
                            op_of(e),
                            sync,
                            str(e.info["group"]),
                            tuple(lane(m, e) for m in members),
                            None if root is None else lane(root, e),
                        )
                    inst.starts[rank] = e
                    of_call[e.call_id] = inst
                elif e.kind == events.P2P and e.info.get("sync") == collectives.SEND and e.info.get("seq"):
                    inst = _pair(found, lane, e, e.info)
                    inst.starts[rank] = e
                    of_call[e.call_id] = inst
            else:
                start = open_starts.pop(e.call_id, None)
                if start is None:
                    continue
                if e.kind == events.COLLECTIVE and start.info.get("seq"):
                    key = _paired_key(collective_key(start.info), lane, start)
                    found_inst = found.get(key)
                    if found_inst is not None and e.info.get("issued") is False:
                        # it raised before reaching the group: the next call has its number
                        if found_inst.starts.get(rank) is start:
                            del found_inst.starts[rank]
                        of_call.pop(e.call_id, None)
                        if not found_inst.starts:
                            del found[key]
                    elif found_inst is not None:
                        found_inst.ends[rank] = e
                elif e.kind == events.P2P and start.info.get("sync") == collectives.SEND and start.info.get("seq"):
                    sent = _pair(found, lane, start, start.info)
                    sent.ends[rank] = e  # an isend never waited is named, as an irecv is
                    if e.info.get("unsure"):  # it overlapped another send on its channel: unpaired
                        sent.starts.pop(rank, None)
                elif (
                    e.kind == events.P2P
                    and start.info.get("sync") == collectives.RECV
                    and e.info.get("seq")
                    and not e.info.get("unsure")  # it overlapped another receive: unpaired
                ):
                    inst = _pair(found, lane, start, e.info)
                    inst.ends[rank] = e
                    of_call[e.call_id] = inst
                elif (
                    e.kind == events.P2P
                    and start.info.get("sync") == collectives.RECV
                    and start.info.get("src") is None
                    and e.info.get("async")
                    and not e.info.get("unsure")
                ):
                    anysource[e.call_id] = (start, e)
    return found


class Lanes:
    """The lane of a rank of the default group, as collectives name ranks (roots, peers, a
    sub-group's members). A lane is the recorder's rank, which is the group's unless the code
    under test initialised the group with ranks of its own (``rank=1 - RANK``): then each
    lane's place in the group is what its ``init_process_group`` returned. A group destroyed
    and initialised again may place the lanes anew: a rank named by an event is read with the
    places of the group the event's rank had initialised last before it."""

    def __init__(self, by_rank: Mapping[int, Sequence[Event]]) -> None:
        # rank -> (event index, its place, its world's size), in order
        inits: dict[int, list[tuple[int, World]]] = {}
        for rank, evs in by_rank.items():
            for e in evs:
                if e.kind == events.GROUP and e.phase == events.END and e.name.endswith("init_process_group"):
                    if "error" in e.info:
                        continue  # it raised: no group came of it
                    inits.setdefault(rank, []).append((e.index, world_of(e.info)))
        self._inits = {rank: [index for index, _ in found] for rank, found in inits.items()}
        # the k-th group every rank initialised is one group: its places, lane -> group rank
        rounds = max((len(found) for found in inits.values()), default=0)
        self._by_round = []
        self._apart: list[set[int]] = []  # per round: lanes whose world is not the others'
        for k in range(rounds):
            worlds = {r: found[k][1] for r, found in inits.items() if k < len(found)}
            apart = separate_worlds(worlds)
            self._apart.append(apart)
            places = {r: place for r, (place, _) in worlds.items() if place is not None and r not in apart}
            self._by_round.append(lanes_by_place(places))
        self.chosen = any(self._by_round)  # some group placed a lane elsewhere than its rank

    def apart(self, at: Event) -> bool:
        """``at`` happened in a world of its rank's that no other lane's calls can be paired
        with: a world of one, or one of several the recorded places and sizes cannot tell apart."""
        k = bisect_right(self._inits.get(at.rank, []), at.index) - 1
        return 0 <= k < len(self._apart) and at.rank in self._apart[k]

    def __call__(self, group_rank: Any, at: Event | None = None) -> int:
        """The lane of ``group_rank`` as ``at`` named it (no event: as the first group placed them)."""
        if not self.chosen:
            return int(group_rank)
        k = 0 if at is None else bisect_right(self._inits.get(at.rank, []), at.index) - 1
        lane_of = self._by_round[k] if 0 <= k < len(self._by_round) else {}
        return lane_of.get(int(group_rank), int(group_rank))


World = tuple[int | None, int | None]  # a rank's place in its default group, and that group's size


def world_of(info: Mapping[str, Any]) -> World:
    """The place and the world's size an ``init_process_group`` returned (None: not known)."""
    place, size = info.get("rank"), info.get("world_size")
    return (place if isinstance(place, int) else None, size if isinstance(size, int) else None)


def separate_worlds(worlds: Mapping[int, World]) -> set[int]:
    """Of lanes that each initialised a default group (the k-th of each), those whose calls
    pair with no other lane's: each lane alone in a world of one, and every lane where the rest
    are not one world, each lane at its own place (two jobs of two at places 0,1,0,1: which
    lanes share a job is not recorded, and their groups are named and numbered alike)."""
    if len(worlds) < 2:
        return set()  # no other lane to take for a fellow member
    alone = {r for r, (_, size) in worlds.items() if size == 1}
    rest = {r: w for r, w in worlds.items() if r not in alone}
    sizes = {size for _, size in rest.values()}
    if not rest or sizes == {None}:
        return alone
    places = sorted(place if place is not None else -1 for place, _ in rest.values())
    if len(sizes) == 1 and places == list(range(len(rest))) and len(rest) == next(iter(sizes)):
        return alone
    return set(worlds)


def lanes_by_place(placed: Mapping[int, int]) -> dict[int, int]:
    """Group rank -> lane, from each lane's place in the default group (lane -> group rank);
    empty in the usual case (they are the same) and where lanes disagree on their places
    (two claim one): ranks are then taken as recorded."""
    lane_of = {given: lane for lane, given in placed.items()}
    if len(lane_of) != len(placed) or all(given == lane for lane, given in placed.items()):
        return {}
    return lane_of


class Clocks:
    """Vector clocks of every event; ``happens_before`` answers from them alone."""

    def __init__(self, by_rank: Mapping[int, Sequence[Event]], insts: Iterable[Instance] | None = None) -> None:
        lane_events: dict[LaneKey, list[Event]] = {}
        for rank in sorted(by_rank):
            for e in by_rank[rank]:
                lane_events.setdefault((rank, e.lane), []).append(e)
        self.lanes: list[LaneKey] = list(lane_events)
        index = {lane: i for i, lane in enumerate(self.lanes)}
        self._pos: dict[EventKey, tuple[int, int]] = {}
        for lane, evs in lane_events.items():
            li = index[lane]
            for p, e in enumerate(evs):
                self._pos[(e.rank, e.index)] = (li, p)
        deps: dict[EventKey, list[EventKey]] = {}
        needed: set[EventKey] = set()
        for inst in insts if insts is not None else instances(by_rank).values():
            for end, starts in inst.edges():
                keys = [(s.rank, s.index) for s in starts if (s.rank, s.index) != (end.rank, end.index)]
                deps.setdefault((end.rank, end.index), []).extend(keys)
                needed.update(keys)
        n = len(self.lanes)
        # per lane: positions where the clock gained knowledge, and the clock there
        self._sync_pos: list[list[int]] = [[] for _ in range(n)]
        self._sync_clock: list[list[tuple[int, ...]]] = [[] for _ in range(n)]
        known: dict[EventKey, tuple[int, ...]] = {}
        lists = [lane_events[lane] for lane in self.lanes]
        ptr = [0] * n
        clock = [[-1] * n for _ in range(n)]
        remaining = sum(len(x) for x in lists)
        while remaining:
            progressed = False
            for li in range(n):
                evs = lists[li]
                cur = clock[li]
                p = ptr[li]
                while p < len(evs):
                    e = evs[p]
                    k = (e.rank, e.index)
                    waits = deps.get(k)
                    if waits and any(w not in known for w in waits):
                        break
                    cur[li] = p
                    if waits:
                        for w in waits:
                            other = known[w]
                            for j in range(n):
                                if other[j] > cur[j]:
                                    cur[j] = other[j]
                        self._sync_pos[li].append(p)
                        self._sync_clock[li].append(tuple(cur))
                    if k in needed:
                        known[k] = tuple(cur)
                    p += 1
                    remaining -= 1
                    progressed = True
                ptr[li] = p
            if remaining and not progressed:
                # a dependency cycle can only come from inconsistent records: drop one wait
                for li in range(n):
                    if ptr[li] < len(lists[li]):
                        e = lists[li][ptr[li]]
                        deps.pop((e.rank, e.index), None)
                        break

    def happens_before(self, a: Event, b: Event) -> bool:
        """True when event ``a`` is ordered before event ``b`` by program order or sync."""
        la, pa = self._pos[(a.rank, a.index)]
        lb, pb = self._pos[(b.rank, b.index)]
        if la == lb:
            return pa < pb
        i = bisect_right(self._sync_pos[lb], pb) - 1
        if i < 0:
            return False
        return self._sync_clock[lb][i][la] >= pa

    def lane_of(self, e: Event) -> LaneKey:
        return self.lanes[self._pos[(e.rank, e.index)][0]]
