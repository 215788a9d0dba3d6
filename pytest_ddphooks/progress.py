"""What each rank of a live run is inside, followed from its event file as it grows.

The run loop feeds each look only what was recorded since the last, so watching costs what
the ranks record, never the whole run again. Two questions are answered from it:

- a **desync**: ranks sit at the same place of a group's sequence inside calls that cannot
  be one collective (rank 0 in all_reduce #3, rank 1 in broadcast #3); gloo would wait for
  its timeout;
- a **stall**: a rank waits in a collective, a receive or ``timeline()`` that a rank which
  already finished the test never entered: it can never return.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .recorder import collectives, events
from .recorder.clocks import World, collective_key, lanes_by_place, separate_worlds, world_of


@dataclass
class _Rank:
    inside: dict[int, dict[str, Any]] = field(default_factory=dict)  # call id -> the call it is in
    issued: dict[int, dict[str, Any]] = field(default_factory=dict)  # call id -> async call not waited yet
    # collective key -> the call it made there ({} for a native one found after the fact)
    entered: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    sent: dict[tuple[Any, ...], int] = field(default_factory=dict)  # (group, dst, tag) -> sends
    received: dict[tuple[Any, ...], int] = field(default_factory=dict)  # (group, src, tag) -> receives done
    final: dict[str, int] | None = None  # once finished: group -> its last collective, seen or not
    native: dict[int, int] = field(default_factory=dict)  # lane -> a native call issued, nothing after it
    last_t: dict[int, int] = field(default_factory=dict)  # lane -> the latest time recorded on it
    fired: list[dict[str, Any]] = field(default_factory=list)  # injected faults that acted on it
    joins: dict[str, int] = field(default_factory=dict)  # init_process_group / new_group -> calls started
    exchanges: int = 0  # timeline() calls started
    in_exchange: int = 0  # the timeline() call it is inside, 0 when none
    placed: int | None = None  # its rank in the default group, as its latest init_process_group returned
    count: int = 0  # events recorded
    off_main: set[int] = field(default_factory=set)  # call ids open on a thread other than the main one
    lost: set[str] = field(default_factory=set)  # groups whose numbering it lost (``EventLog.judge_gaps``)
    worlds: list[World] = field(default_factory=list)  # each default group it initialised: its place, its size
    # threads other than its main one and the harness's, as the rank last answered since its latest
    # event (None: not asked since)
    free_threads: tuple[str, ...] | None = None


JOIN = "join"  # what init_process_group and new_group wait for: every rank's call of it


def describe_call(info: dict[str, Any], lane: Callable[[Any], int] = int) -> str:
    """``all_reduce #3 on the default group``, ``recv from rank 1``, ``init_process_group``
    (a peer named by ``lane`` of the rank the call named)."""
    op = str(info.get("op"))
    if info.get("sync") == JOIN:
        return op
    if info.get("sync") in (collectives.RECV, collectives.SEND):
        recv = info.get("sync") == collectives.RECV
        peer = info.get("src" if recv else "dst")
        return f"{'recv from' if recv else 'send to'} rank {peer if peer is None else lane(peer)}"
    label = collectives.group_label(str(info.get("group")), info.get("ranks"))
    return f"{op} #{info.get('seq')} on {label}"


class RankProgress:
    def __init__(self) -> None:
        self._ranks: dict[int, _Rank] = {}
        self._lanes: dict[int, int] = {}  # group rank -> lane, where the code under test chose its own

    def _lane(self, group_rank: Any) -> int:
        """The lane (launcher rank) of a rank of the default group as collectives name it."""
        return self._lanes.get(int(group_rank), int(group_rank))

    def _place(self, lane: int) -> int:
        placed = self._of(lane).placed
        return lane if placed is None or not self._lanes else placed

    def _placed(self, state: _Rank, info: dict[str, Any]) -> None:
        """A rank's init_process_group returned its place: lanes and group ranks differ only
        where the code under test chose them (``rank=1 - RANK``); a group initialised again
        may place it anew, and what a live rank waits in is of its latest group."""
        if not isinstance(info.get("rank"), int):
            return
        state.worlds.append(world_of(info))
        state.placed = int(info["rank"])
        apart = self.apart()
        self._lanes = lanes_by_place(
            {lane: st.placed for lane, st in self._ranks.items() if st.placed is not None and lane not in apart}
        )

    def apart(self) -> set[int]:
        """The ranks whose latest group is a world apart from the other ranks' (``separate_worlds``):
        none of their calls is compared with, or waits for, another rank's."""
        judged: dict[int, set[int]] = {}  # round -> the ranks apart in it
        out = set()
        for rank, state in self._ranks.items():
            k = len(state.worlds) - 1
            if k < 0:
                continue
            if k not in judged:
                judged[k] = separate_worlds({r: st.worlds[k] for r, st in self._ranks.items() if len(st.worlds) > k})
            if rank in judged[k]:
                out.add(rank)
        return out

    def _of(self, rank: int) -> _Rank:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _Rank()
        return state

    def feed(self, rank: int, records: list[events.RawEvent]) -> None:
        state = self._of(rank)
        for call_id, t_ns, lane, kind, phase, _, info in records:
            if kind == events.META:
                continue
            if kind == events.THREADS:
                state.free_threads = tuple((info or {}).get("names") or ())
                continue
            state.count += 1
            state.free_threads = None  # what the rank did since may have started one
            if info and info.get("native") and phase == events.START:
                # entered; its call is known where it is taken in its place below
                state.entered.setdefault(collective_key(info), {})
                if t_ns < state.last_t.get(lane, 0):
                    continue  # found after the fact: the lane went on since it was issued
            state.last_t[lane] = max(t_ns, state.last_t.get(lane, 0))
            if lane != _MAIN_LANE and phase == events.START:
                state.off_main.add(call_id)
            elif phase == events.END and state.off_main:
                state.off_main.discard(call_id)
            waiting = state.native.get(lane)
            if waiting is not None and waiting != call_id:
                # the lane went on: native code waited for its call, or will later
                state.inside.pop(state.native.pop(lane), None)
            if kind == events.UNSURE:
                self._lost(state, str((info or {}).get("group")))
            elif kind == events.FIRED:
                state.fired.append(dict(info or {}))
            elif kind == events.COUNTERS:
                state.final = {str(k): int(v) for k, v in (info or {}).items()}
            elif kind == events.EXCHANGE:
                if phase == events.START:
                    state.exchanges += 1
                    state.in_exchange = state.exchanges
                else:
                    state.in_exchange = 0
            elif kind == events.GROUP:
                self._join(state, call_id, phase, info or {})
                if phase == events.END and info:
                    self._placed(state, info)
            elif kind in (events.COLLECTIVE, events.P2P):
                self._call(state, call_id, kind, phase, info or {})
                if phase == events.END and state.inside.get(call_id, {}).get("native"):
                    state.native[lane] = call_id
            elif kind == events.WAIT:
                if phase == events.START:
                    waited = state.issued.pop(int((info or {}).get("of", 0)), None)
                    if waited is not None:
                        state.inside[call_id] = waited
                else:
                    state.inside.pop(call_id, None)

    @staticmethod
    def _lost(state: _Rank, group: str) -> None:
        """The rank's numbers of ``group`` may be shifted (an unseen send): none of them is
        compared with another rank's, in the calls it is in or made, or in those to come."""
        state.lost.add(group)
        numbered = [k for k, v in state.inside.items() if v.get("group") == group and v.get("seq")]
        for call_id in numbered:
            state.inside.pop(call_id, None)
        for key in [k for k, v in state.entered.items() if str(v.get("group", k[1])) == group]:
            del state.entered[key]

    @staticmethod
    def _join(state: _Rank, call_id: int, phase: str, info: dict[str, Any]) -> None:
        """init_process_group returns once every rank joined the group, and new_group once
        every rank of the default group called it (unless only its members synchronise): a
        wait like a collective's (its end event names no op: it is known by its call id)."""
        op = str(info.get("op"))
        if phase == events.START and op in collectives.JOINS and not info.get("local_sync"):
            n = state.joins[op] = state.joins.get(op, 0) + 1
            state.inside[call_id] = {"op": op, "sync": JOIN, "join": n}
        else:
            state.inside.pop(call_id, None)

    @staticmethod
    def _call(state: _Rank, call_id: int, kind: str, phase: str, info: dict[str, Any]) -> None:
        sync = info.get("sync")
        if phase == events.START:
            if not info.get("effective", True) or info.get("hollow") or str(info.get("group")) in state.lost:
                return  # reaches nobody: nothing to wait in or compare
            if kind == events.COLLECTIVE and info.get("seq"):
                state.entered[collective_key(info)] = info
            elif sync == collectives.SEND:
                sent = (info.get("group"), info.get("dst"), info.get("tag", 0))
                state.sent[sent] = state.sent.get(sent, 0) + 1
            if kind == events.COLLECTIVE and not info.get("seq"):
                return
            state.inside[call_id] = info
            if info.get("async") and not info.get("native"):
                state.issued[call_id] = info  # where it completes is its wait
            return
        started = state.inside.get(call_id)
        if started is not None and started.get("native") and "error" not in info:
            return  # issued: native code waits for it where no event tells
        state.inside.pop(call_id, None)
        if started is not None and info.get("issued") is False:
            # raised before it reached the group (a fault injected as it began): never entered
            key = collective_key(started) if kind == events.COLLECTIVE and started.get("seq") else None
            if key is not None and state.entered.get(key) is started:
                del state.entered[key]
            if started.get("sync") == collectives.SEND:
                sent = (started.get("group"), started.get("dst"), started.get("tag", 0))
                state.sent[sent] = max(state.sent.get(sent, 0) - 1, 0)
            return
        if started is not None and started.get("sync") == collectives.RECV and "error" not in info:
            key = (started.get("group"), info.get("src", started.get("src")), started.get("tag", 0))
            state.received[key] = state.received.get(key, 0) + 1

    def injected(self, rank: int) -> str | None:
        """How an injected fault last acted on the rank (``kill``, ``stop``, ...), if one did."""
        fired = self._of(rank).fired
        return str(fired[-1].get("action")) if fired else None

    def exchanging(self) -> set[int]:
        """Ranks inside ``timeline()``, which waits for every rank to call it."""
        return {rank for rank, state in self._ranks.items() if state.in_exchange}

    def counts(self) -> dict[int, int]:
        """How many events each rank has recorded so far."""
        return {rank: state.count for rank, state in self._ranks.items()}

    def desync(self, finished: Iterable[int] = ()) -> tuple[object, ...] | None:
        """The first collective that ranks are inside with calls that cannot match, with how
        many events those ranks had recorded (to tell a stuck state from progress); else None.
        A rank that left it (went on to its next call, or finished the test: ``finished``)
        counts with the call it made there: gloo may let one side of a mismatched collective
        return, never the other."""
        at: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
        apart = self.apart()
        for rank, state in self._ranks.items():
            if rank in apart:
                continue
            for info in state.inside.values():
                if info.get("seq") and info.get("sync") not in (collectives.SEND, collectives.RECV):
                    at.setdefault(collective_key(info), {})[rank] = info
        for rank in {*finished, *self._ranks} - apart:
            entered = self._of(rank).entered
            for key, ranks in at.items():
                call = entered.get(key)
                if rank not in ranks and call:
                    ranks[rank] = call
        for key in sorted(at, key=lambda k: (int(k[2]), str(k[1]))):
            ranks = at[key]
            ops = {r: str(info.get("op")) for r, info in ranks.items()}
            loose = any(info.get("native") for info in ranks.values())
            if len(ranks) < 2 or len({collectives.comparable(ops[r], info, loose) for r, info in ranks.items()}) < 2:
                continue
            calls = tuple(sorted((r, collectives.signature(ops[r], info)) for r, info in ranks.items()))
            return (key[1], key[2], calls, tuple(self._of(r).count for r in sorted(ranks)))
        return None

    def deadlock(self, live: set[int], world_size: int) -> tuple[object, ...] | None:
        """Live ranks that wait for each other in different collectives (rank 0 in a barrier
        of one group that rank 1 never entered, rank 1 in one of another group that rank 0
        never entered; or rank 0 in ``timeline()``): a cycle of waits that none can leave.
        The cycle, in rank order, with those ranks' event counts (to tell a stuck state from
        progress); else None."""
        blocked: dict[int, dict[str, Any]] = {}
        apart = self.apart()
        for rank in sorted(live):
            if rank in apart:
                continue  # whom it waits for is not known
            state = self._of(rank)
            calls = list(state.inside.items())
            # one blocking call on the rank, from Python, on its main thread, and no other thread
            # of the code under test that could still enter what a peer waits in: the rank can do
            # nothing else (one on another thread leaves the main thread free to go on)
            if len(calls) == 1 and calls[0][0] not in state.off_main and state.free_threads == ():
                info = calls[0][1]
                if _blocking_collective(info) or _blocking_p2p(info):
                    blocked[rank] = info
        # a rank inside timeline() waits for every rank to call it as often: one blocked in a
        # collective that rank never entered never will
        exchanging = {
            rank: self._of(rank).in_exchange
            for rank in sorted(live)
            if self._of(rank).in_exchange and self._of(rank).free_threads == ()
        }
        waits: dict[int, list[int]] = {}
        for rank, info in blocked.items():
            if _blocking_p2p(info):
                # a send waits for its peer's receive, a receive for its peer's send: a peer
                # blocked in anything but that (a collective, timeline()) never posts it
                peer = self._lane(info["src" if info.get("sync") == collectives.RECV else "dst"])
                theirs = blocked.get(peer)
                matching = theirs is not None and _blocking_p2p(theirs) and theirs.get("sync") != info.get("sync")
                waits[rank] = [peer] if (peer in blocked and not matching) or peer in exchanging else []
                continue
            members = [self._lane(m) for m in info.get("ranks") or range(int(info.get("group_size") or world_size))]
            key = collective_key(info)
            waits[rank] = [
                m for m in members if m != rank and (m in blocked or m in exchanging) and key not in self._of(m).entered
            ]
        for rank, n in exchanging.items():
            waits[rank] = [m for m in blocked if m != rank and self._of(m).exchanges < n]
        cycle = _cycle(waits)
        if cycle is None:
            return None
        return (tuple(cycle), tuple(self._of(r).count for r in cycle))

    def stalled(self, finished: dict[int, str], live: set[int], world_size: int) -> dict[int, tuple[str, list[int]]]:
        """Live ranks that wait for a rank which finished the test (``finished``: rank -> how;
        ``KILLED``: an injected fault killed it) and never entered what they wait in, or was
        killed: rank -> (what it waits in, those ranks)."""
        out: dict[int, tuple[str, list[int]]] = {}
        now = time.time_ns()
        apart = self.apart()
        for rank in sorted(live):
            if rank in apart:
                continue  # whom it waits for is not known
            state = self._of(rank)
            if state.fired and int(state.fired[-1].get("until_ns") or 0) > now:
                continue  # asleep in an injected delay as a call began: not yet inside it
            if state.in_exchange:
                absent = [r for r in sorted(finished) if self._of(r).exchanges < state.in_exchange]
                if absent:
                    out[rank] = ("timeline()", absent)
                    continue
            for info in state.inside.values():
                absent = self._absent(rank, info, finished, world_size)
                if absent:
                    out[rank] = (describe_call(info, self._lane), absent)
                    break
        return out

    def _absent(self, rank: int, info: dict[str, Any], finished: dict[int, str], world_size: int) -> list[int]:
        sync = info.get("sync")
        if sync == JOIN:
            op, n = str(info.get("op")), int(info.get("join", 1))
            # one killed inside it never completes its part, as one that never called it
            return [
                m
                for m in sorted(finished)
                if self._of(m).joins.get(op, 0) < n or (finished[m] == KILLED and _joining(self._of(m), op, n))
            ]
        # sends and receives are counted by group ranks, as the calls name their peers
        if sync == collectives.RECV:
            src = info.get("src")
            peer = None if src is None else self._lane(src)
            if peer is None or peer not in finished:
                return []
            if finished[peer] == KILLED:
                return [peer]
            key = (info.get("group"), src, info.get("tag", 0))
            sent = self._of(peer).sent.get((info.get("group"), self._place(rank), info.get("tag", 0)), 0)
            return [peer] if sent <= self._of(rank).received.get(key, 0) else []
        if sync == collectives.SEND:
            # gloo's send waits for the peer's receive: one that left without it never comes
            dst = info.get("dst")
            peer = None if dst is None else self._lane(dst)
            if peer is None or peer not in finished:
                return []
            if finished[peer] == KILLED:
                return [peer]
            tag = info.get("tag", 0)
            sent = self._of(rank).sent.get((info.get("group"), dst, tag), 0)
            return [peer] if self._of(peer).received.get((info.get("group"), self._place(rank), tag), 0) < sent else []
        if not info.get("seq"):
            return []
        members = [self._lane(m) for m in info.get("ranks") or range(int(info.get("group_size") or world_size))]
        key = collective_key(info)
        # a member killed (by an injected fault) can never finish it, entered or not
        return [
            m
            for m in members
            if m in finished and (finished[m] == KILLED or not self._may_have_entered(self._of(m), key))
        ]

    @staticmethod
    def _may_have_entered(state: _Rank, key: tuple[Any, ...]) -> bool:
        """Whether a finished rank may have entered a collective: it recorded it, or issued
        it through an API the recorder cannot see (its group's counter went that far)."""
        if key in state.entered:
            return True
        if key[0] != "c":
            return False  # a monitored barrier is always recorded
        if state.final is None or str(key[1]) not in state.final:
            return True  # nothing says it did not: never a stall on a guess
        return int(key[2]) <= state.final[str(key[1])]


KILLED = "killed"  # how a rank an injected fault killed left the test


def _joining(state: _Rank, op: str, n: int) -> bool:
    """Whether the rank is inside its ``n``-th call of ``op`` (a join), not returned from it."""
    return any(v.get("sync") == JOIN and v.get("op") == op and v.get("join") == n for v in state.inside.values())


_MAIN_LANE = 0  # a rank's event log numbers its main thread's lane first


def _blocking_p2p(info: dict[str, Any]) -> bool:
    """A send or a receive from a named peer, from Python (a receive from any source waits
    for whoever sends: no one peer to wait for)."""
    sync = info.get("sync")
    if sync not in (collectives.SEND, collectives.RECV) or info.get("native"):
        return False
    return info.get("src" if sync == collectives.RECV else "dst") is not None


def _blocking_collective(info: dict[str, Any]) -> bool:
    p2p = info.get("sync") in (collectives.SEND, collectives.RECV)
    return bool(info.get("seq")) and not info.get("native") and not p2p


def _cycle(waits: dict[int, list[int]]) -> list[int] | None:
    """The ranks of one cycle in the wait-for graph, sorted; None when it has none."""
    finished: set[int] = set()

    def visit(node: int, path: list[int]) -> list[int] | None:
        if node in path:
            return sorted(path[path.index(node) :])
        if node in finished:
            return None
        for nxt in waits.get(node, ()):
            found = visit(nxt, [*path, node])
            if found is not None:
                return found
        finished.add(node)
        return None

    for start in sorted(waits):
        found = visit(start, [])
        if found is not None:
            return found
    return None
