"""Synthetic per-rank event streams, written as core.Recorder writes them (raw tuples).

A ``Sim`` holds one raw list per rank and one clock shared by every rank, so timestamps grow
in the order the test writes the events: a test can make ``prepare_data`` end, by
timestamps, before ``setup`` starts, and check that the Timeline does not care.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pytest_ddphooks.recorder import Timeline, collectives, events
from pytest_ddphooks.recorder.events import RawEvent

_KIND = {op: kind for op, (kind, _, _, _) in collectives.OPS.items()}


@dataclass
class Handle:
    """A started call: what ``end`` needs to close it."""

    rank: int
    call_id: int
    kind: str
    name: str
    lane: int
    info: dict[str, Any]


class Sim:
    def __init__(self, world: int = 2) -> None:
        self.world = world
        self.raw: dict[int, list[RawEvent]] = {r: [] for r in range(world)}
        self.t = 1_000_000
        self._ids = itertools.count(1)
        self._seq: dict[tuple[int, str], int] = defaultdict(int)
        # each rank numbers its own sends and recvs, per (group, src, dst, tag)
        self._sent: dict[tuple[Any, ...], int] = defaultdict(int)
        self._received: dict[tuple[Any, ...], int] = defaultdict(int)

    # -- low level ---------------------------------------------------------------------------

    def write(self, rank: int, call_id: int, lane: int, kind: str, phase: str, name: str, info: Any) -> None:
        self.t += 1000
        self.raw[rank].append((call_id, self.t, lane, kind, phase, name, info))

    def start(self, rank: int, name: str, kind: str = events.CALL, info: dict[str, Any] | None = None, lane: int = 0):
        h = Handle(rank, next(self._ids), kind, name, lane, dict(info or {}))
        self.write(rank, h.call_id, lane, kind, events.START, name, info)
        return h

    def end(self, h: Handle, info: dict[str, Any] | None = None) -> None:
        self.write(h.rank, h.call_id, h.lane, h.kind, events.END, h.name, info)

    def call(self, rank: int, name: str, *, lane: int = 0, error: str | None = None) -> None:
        h = self.start(rank, name, lane=lane)
        self.end(h, {"error": error} if error else None)

    @contextmanager
    def span(self, rank: int, name: str, kind: str = events.CALL, lane: int = 0) -> Iterator[Handle]:
        h = self.start(rank, name, kind, lane=lane)
        yield h
        self.end(h)

    def mark(self, rank: int, name: str, lane: int = 0, **info: object) -> None:
        self.write(rank, next(self._ids), lane, events.MARK, events.POINT, name, info or None)

    # -- torch.distributed calls -------------------------------------------------------------

    def cstart(
        self,
        rank: int,
        op: str,
        *,
        group: str = "default",
        ranks: Iterable[int] | None = None,
        payload: str | None = "float32[4]",
        root: int | None = None,
        reduce_op: str | None = None,
        async_op: bool = False,
        lane: int = 0,
        effective: bool = True,
        **extra: Any,
    ) -> Handle:
        """Start a collective on ``rank`` as distpatch describes it (seq numbered per group).

        Barriers have no payload, as in distpatch.
        """
        if op in ("barrier", "monitored_barrier"):
            payload = None
        info: dict[str, Any] = {"op": op, "group_existed": effective}
        if not effective:
            info["effective"] = False
        else:
            info["group"] = group
            if group == "default":
                info["group_size"] = self.world
            else:
                info["ranks"] = sorted(ranks) if ranks is not None else list(range(self.world))
            if async_op:
                info["async"] = True
            self._seq[(rank, group)] += 1
            info["seq"] = self._seq[(rank, group)]
            if payload is not None:
                info["payload"] = payload
            if root is not None:
                info["root"] = root
            if reduce_op is not None:
                info["reduce_op"] = reduce_op
        info.update(extra)
        return self.start(rank, "dist." + op, _KIND.get(op, events.COLLECTIVE), info, lane)

    def cend(self, h: Handle, *, error: str | None = None) -> None:
        out: dict[str, Any] = {}
        if h.info.get("async"):
            out["async"] = True
        if error:
            out["error"] = error
        self.end(h, out or None)

    def coll(self, op: str, ranks: Iterable[int] | None = None, **kw: Any) -> dict[int, Handle]:
        """Every member enters, then every member leaves."""
        members = list(range(self.world)) if ranks is None else list(ranks)
        if ranks is not None and "group" not in kw:
            raise ValueError("a sub-group needs a group name")
        if ranks is not None:
            kw.setdefault("ranks", members)
        handles = {r: self.cstart(r, op, **kw) for r in members}
        for h in handles.values():
            self.cend(h)
        return handles

    def send_start(self, src: int, dst: int, *, tag: int = 0, group: str = "default", op: str = "send") -> Handle:
        self._sent[(group, src, dst, tag)] += 1
        info = {
            "op": op,
            "group_existed": True,
            "group": group,
            "group_size": self.world,
            "sync": collectives.SEND,
            "tag": tag,
            "payload": "float32[4]",
            "src": src,
            "dst": dst,
            "seq": self._sent[(group, src, dst, tag)],
        }
        if op == "isend":
            info["async"] = True
        return self.start(src, "dist." + op, events.P2P, info)

    def recv_start(
        self, dst: int, src: int | None, *, tag: int = 0, group: str = "default", op: str = "recv"
    ) -> Handle:
        info = {
            "op": op,
            "group_existed": True,
            "group": group,
            "group_size": self.world,
            "sync": collectives.RECV,
            "tag": tag,
            "payload": "float32[4]",
            "src": src,
            "dst": dst,
        }
        if op == "irecv":
            info["async"] = True
        return self.start(dst, "dist." + op, events.P2P, info)

    def recv_end(self, h: Handle, actual_src: int | None = None, *, error: str | None = None) -> None:
        src = h.info["src"] if h.info["src"] is not None else actual_src
        out: dict[str, Any] = {"async": True} if h.info.get("async") else {}
        if error:
            out["error"] = error
        elif src is not None:
            key = (h.info["group"], src, h.info["dst"], h.info["tag"])
            self._received[key] += 1
            out.update(src=src, seq=self._received[key])
        self.end(h, out or None)

    # -- framework barriers ------------------------------------------------------------------

    def fw_barrier(
        self, rank: int, name: str = "wait_for_everyone", *, collective: bool = True, group_existed: bool = True
    ) -> dict[str, Handle]:
        """A framework barrier on one rank, with or without a dist.barrier inside (entered only).

        Returns the handles; close them with ``fw_barrier_end``.
        """
        outer = self.start(rank, name, events.BARRIER, {"qualname": f"Trainer.{name}", "group_existed": group_existed})
        handles = {"outer": outer}
        if collective:
            handles["inner"] = self.cstart(rank, "barrier", payload=None)
        return handles

    def fw_barrier_end(self, handles: dict[str, Handle]) -> None:
        if "inner" in handles:
            self.cend(handles["inner"])
        self.end(handles["outer"], {"collectives": 1 if "inner" in handles else 0})

    def barrier_all(self, name: str = "wait_for_everyone", *, collective: bool = True, group_existed: bool = True):
        """The framework barrier on every rank: all enter, then all leave."""
        hs = [self.fw_barrier(r, name, collective=collective, group_existed=group_existed) for r in range(self.world)]
        for h in hs:
            self.fw_barrier_end(h)

    def timeline(self) -> Timeline:
        return Timeline.from_raw(self.raw)
