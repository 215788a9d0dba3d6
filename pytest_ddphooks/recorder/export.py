"""Pictures of a Timeline: text swimlanes aligned on collectives, and Chrome trace JSON."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from . import collectives, events
from .clocks import Instance
from .events import Event


class Timeline(Protocol):
    """What the pictures read of a timeline."""

    lanes: dict[tuple[int, int], str]

    @property
    def ranks(self) -> list[int]: ...

    @property
    def events(self) -> list[Event]: ...

    @property
    def instances(self) -> Mapping[tuple[Any, ...], Instance]: ...

    def for_rank(self, rank: int) -> list[Event]: ...

    def spans(self, name: str | None = None, ranks: Iterable[int] | None = None) -> list[Any]: ...

    def noop_barriers(self) -> Sequence[Any]: ...  # each with .rank and .index (its start)


def _aligned(inst: Instance) -> bool:
    return inst.key[0] in ("c", "m") and len(inst.members) > 1 and inst.complete and inst.consistent


_POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})


def _cell(e: Event, ended: Mapping[tuple[int, int], Mapping[str, Any]], noop: set[tuple[int, int]]) -> str | None:
    """The text of one event in its lane, or None when it is not drawn (``ended``: (rank, call
    id) of the calls that returned -> their end's info; ``noop``: of the no-op barriers)."""
    tag = f"[t{e.lane}] " if e.lane else ""
    if e.kind in (events.CALL, events.BARRIER):
        if e.phase == events.START:
            return f"{tag}> {e.name}"
        suffix = ""
        if "error" in e.info:
            suffix = " (raised)"
        elif e.kind == events.BARRIER and (e.rank, e.call_id) in noop:
            suffix = " (no-op)"
        return f"{tag}< {e.name}{suffix}"
    if e.kind == events.MARK:
        return f"{tag}* {e.name}"
    op = str(e.info.get("op", e.name))
    stuck = "" if (e.rank, e.call_id) in ended else " (never returned)"
    if e.kind == events.GROUP:
        if e.phase != events.START:
            return f"{tag}x {op} raised" if "error" in e.info else None
        sign = "-" if op.startswith("destroy") else "+"
        return f"{tag}{sign} {op}{stuck}"
    if e.phase == events.END:
        return f"{tag}x {op} raised" if "error" in e.info else None
    if e.kind == events.WAIT:
        # a send's number counts its channel, not the group's sequence (a receive's is known
        # only once it returned): a wait says a number only for a collective
        seq = e.info.get("seq") if collectives.CANONICAL.get(op, op) not in _POINT_TO_POINT else None
        return f"{tag}~ wait {op} #{seq}{stuck}" if seq else f"{tag}~ wait {op}{stuck}"
    if e.kind == events.P2P:
        peer = e.info.get("dst") if e.info.get("sync") == collectives.SEND else e.info.get("src")
        arrow = "->" if e.info.get("sync") == collectives.SEND else "<-"
        unpaired = " (unpaired)" if ended.get((e.rank, e.call_id), {}).get("unsure") else ""
        return f"{tag}= {op} {arrow} {peer if peer is not None else 'any'}{unpaired}{stuck}"
    if not e.info.get("effective", True):  # it reached no group: none existed, or the rank is not in it
        reached = "not a member" if e.info.get("member") is False else "no group"
        return f"{tag}= {op} ({reached}){stuck}"
    group = e.info.get("group")
    where = "" if group == "default" else f" [g{group}]"
    wait = " (native)" if e.info.get("native") else " (async)" if e.info.get("async") else ""
    if e.info.get("queued"):
        return f"{tag}= {op} (queued){where}{stuck}"
    if ended.get((e.rank, e.call_id), {}).get("issued") is False:
        return f"{tag}= {op} (not issued){where}"  # raised before it reached the group
    number = f"#{e.info['seq']}" if e.info.get("seq") else "#? (unpaired)" if e.info.get("unsure") else "#?"
    return f"{tag}= {op} {number}{where}{wait}{stuck}"


class _Grid:
    """Rows of cells, one column per rank; the members of a collective share its row."""

    def __init__(self) -> None:
        self.rows: list[dict[int, str]] = []
        self.sync_cells: set[tuple[int, int]] = set()  # (row, rank) of a member in a collective's row
        self.row_of: dict[tuple[int, int], int] = {}  # (rank, event index) -> the row it is drawn at (or before)

    def put(self, row: int, rank: int, text: str) -> None:
        while len(self.rows) <= row:
            self.rows.append({})
        self.rows[row][rank] = text


def _layout(timeline: Timeline) -> _Grid:
    """Walk the ranks' events side by side; a collective every member reached takes one row,
    below whatever each member drew before it."""
    ranks = timeline.ranks
    lanes = {r: timeline.for_rank(r) for r in ranks}
    ended = {(e.rank, e.call_id): e.info for r in ranks for e in lanes[r] if e.phase == events.END}
    noop_at = {(nb.rank, nb.index) for nb in timeline.noop_barriers()}
    noop = {(e.rank, e.call_id) for r in ranks for e in lanes[r] if (e.rank, e.index) in noop_at}
    aligned = {
        (r, e.index): inst for inst in timeline.instances.values() if _aligned(inst) for r, e in inst.starts.items()
    }
    grid = _Grid()
    ptr = dict.fromkeys(ranks, 0)
    next_row = dict.fromkeys(ranks, 0)
    reached: dict[tuple[Any, ...], set[int]] = {}
    skip: set[tuple[Any, ...]] = set()
    collective_rows: set[int] = set()
    remaining = sum(len(v) for v in lanes.values())
    while remaining:
        progressed = False
        for r in ranks:
            evs = lanes[r]
            while ptr[r] < len(evs):
                e = evs[ptr[r]]
                inst = aligned.get((r, e.index))
                if inst is not None and inst.key not in skip and all(m in lanes for m in inst.members):
                    got = reached.setdefault(inst.key, set())
                    got.add(r)
                    if len(got) < len(inst.members):
                        break  # this lane waits for the other members to reach it
                    row = max(next_row[m] for m in inst.members)
                    for m in inst.members:
                        grid.row_of[(m, lanes[m][ptr[m]].index)] = row
                        grid.put(row, m, _cell(inst.starts[m], ended, noop) or "")
                        grid.sync_cells.add((row, m))
                        next_row[m] = row + 1
                        ptr[m] += 1
                        remaining -= 1
                    collective_rows.add(row)  # the collective's: a rank outside it draws on others
                else:
                    text = _cell(e, ended, noop)
                    grid.row_of[(r, e.index)] = next_row[r]
                    if text is not None:
                        while next_row[r] in collective_rows:
                            next_row[r] += 1
                        grid.row_of[(r, e.index)] = next_row[r]
                        grid.put(next_row[r], r, text)
                        next_row[r] += 1
                    ptr[r] += 1
                    remaining -= 1
                progressed = True
        if remaining and not progressed:  # members reached collectives in different orders
            stuck = next(
                (
                    aligned[(r, lanes[r][ptr[r]].index)]
                    for r in ranks
                    if ptr[r] < len(lanes[r]) and (r, lanes[r][ptr[r]].index) in aligned
                ),
                None,
            )
            if stuck is not None:
                skip.add(stuck.key)
    return grid


def _draw(
    grid: _Grid, ranks: list[int], max_rows: int | None, width: int, focus: Sequence[tuple[int, int]] = ()
) -> str:
    header = " | ".join(f"rank {r}".ljust(width) for r in ranks).rstrip()
    lines = [header, "-+-".join("-" * width for _ in ranks)]
    body = []
    for i, row in enumerate(grid.rows):
        cells = []
        for r in ranks:
            text = _cut(row.get(r, ""), width - 1)
            cells.append((text + " ").ljust(width, "=") if (i, r) in grid.sync_cells and text else text.ljust(width))
        body.append(" | ".join(cells).rstrip())
    if max_rows is not None and len(body) > max_rows:
        return "\n".join(lines + _excerpt(body, max_rows, sorted({grid.row_of[f] for f in focus if f in grid.row_of})))
    return "\n".join(lines + body)


def _excerpt(body: list[str], max_rows: int, focus: list[int]) -> list[str]:
    """About ``max_rows`` of ``body``: around the rows in ``focus`` (an assertion's events), else its
    first and last rows; what is left out is said where it was."""
    if not focus:
        head = max_rows // 2
        tail = max_rows - head
        return [*body[:head], f"... {len(body) - max_rows} rows not shown ...", *body[-tail:]]
    focus = focus[: max(max_rows // 4, 1)]  # the first ones: each then has a row or more either side
    radius = max((max_rows // len(focus) - 1) // 2, 0)
    shown = sorted({i for f in focus for i in range(max(f - radius, 0), min(f + radius + 1, len(body)))})
    out: list[str] = []
    last = -1
    for i in shown:
        if i > last + 1:
            out.append(f"... {i - last - 1} rows not shown ...")
        out.append(body[i])
        last = i
    if last < len(body) - 1:
        out.append(f"... {len(body) - 1 - last} rows not shown ...")
    return out


def _cut(text: str, room: int) -> str:
    """``text`` within ``room`` characters, cut in the middle (``> my_project.m~n_train_batch_end``):
    names of hooks under one long prefix differ at their end."""
    # a name with a newline, a tab or another control character must not break the table
    text = "".join(c if c.isprintable() else " " for c in " ".join(text.splitlines()))
    if len(text) <= room:
        return text
    head = max(room // 3, 1)
    return text[:head] + "~" + text[len(text) - (room - head - 1) :]


def swimlanes(
    timeline: Timeline,
    max_rows: int | None = None,
    width: int | None = None,
    focus: Sequence[tuple[int, int]] = (),
) -> str:
    """One text lane per rank; a collective every member completed sits on one row. Lanes
    are ``width`` wide; by default as wide as their longest cell, within what a terminal
    holds for that many ranks (30 to 60 characters: 8 ranks get 30), cells cut beyond. Beyond
    ``max_rows`` rows, the rows around the events in ``focus`` ((rank, index)) are shown."""
    for arg, value, least in (("max_rows", max_rows, 1), ("width", width, 8)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ValueError(f"swimlanes({arg}={value!r}): {arg} is an int of at least {least}, or None")
    if not timeline.ranks:
        return "(no events recorded)"
    grid = _layout(timeline)
    if width is None:
        n = len(timeline.ranks)
        most = min(60, max(30, (160 - 3 * (n - 1)) // n))
        longest = max((len(text) for row in grid.rows for text in row.values()), default=0)
        width = min(most, max(30, longest + 2))
    return _draw(grid, timeline.ranks, max_rows, width, focus)


def _track_names(timeline: Timeline) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in timeline.ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for (r, lane), name in timeline.lanes.items():
        out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": lane, "args": {"name": name}})
    return out


def _span_events(
    timeline: Timeline, us: Callable[[int], float], t_last: int, ended: Mapping[int, int]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for s in timeline.spans():
        args = dict(s.start.info)
        where = {"name": s.name, "cat": s.kind, "pid": s.rank, "tid": s.start.lane, "ts": us(s.start.t_ns)}
        if s.kind == events.MARK:
            out.append({"ph": "i", "s": "t", **where, "args": args})
            continue
        end_ns = s.end.t_ns if s.end is not None else min(t_last, ended.get(s.rank, t_last))
        if s.end is not None:
            args.update({f"end.{k}": v for k, v in s.end.info.items()})
        else:
            args["never_ended"] = True
            if s.rank in ended:
                args["ended_with_the_rank"] = True
        out.append({"ph": "X", **where, "dur": max(us(end_ns) - us(s.start.t_ns), 0.001), "args": args})
    return out


def _flow_events(timeline: Timeline, us: Callable[[int], float]) -> list[dict[str, Any]]:
    """A collective as arrows from the entries it waited for to the completions it allowed."""
    out: list[dict[str, Any]] = []
    flow_id = 0
    for inst in timeline.instances.values():
        for end, starts in inst.edges():
            if inst.sync == collectives.ALL:
                # one arrow, from the member whose arrival released the collective
                starts = [max(starts, key=lambda e: e.t_ns)]
            for start in starts:
                if start.rank == end.rank:
                    continue
                flow_id += 1
                name = inst.label()
                out.append(
                    {
                        "ph": "s",
                        "id": flow_id,
                        "name": name,
                        "cat": "sync",
                        "pid": start.rank,
                        "tid": start.lane,
                        "ts": us(start.t_ns),
                    }
                )
                end_ts = max(us(end.t_ns) - 0.001, us(start.t_ns))
                out.append(
                    {
                        "ph": "f",
                        "bp": "e",
                        "id": flow_id,
                        "name": name,
                        "cat": "sync",
                        "pid": end.rank,
                        "tid": end.lane,
                        "ts": end_ts,
                    }
                )
    return out


def chrome_trace(
    timeline: Timeline,
    stopped_ns: int = 0,
    notes: Sequence[tuple[int, int, str]] = (),
    ended: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """Chrome trace event JSON: a track per rank and thread, collectives as flow arrows. A
    call never left lasts until ``stopped_ns`` (when the ranks were stopped), if given, or
    until its rank ended (``ended``: rank -> time_ns, a rank a fault killed); ``notes``:
    (rank, time_ns, text) drawn as instants on the rank's track (what a fault did)."""
    all_events = timeline.events
    if not all_events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(e.t_ns for e in all_events)
    t_last = max(max(e.t_ns for e in all_events), stopped_ns)

    def us(t_ns: int) -> float:
        return (t_ns - t0) / 1000.0

    trace = _track_names(timeline) + _span_events(timeline, us, t_last, ended or {}) + _flow_events(timeline, us)
    trace.extend({"ph": "i", "s": "p", "name": text, "pid": r, "tid": 0, "ts": us(t)} for r, t, text in notes)
    if stopped_ns:
        trace.append({"ph": "i", "s": "g", "name": "ranks stopped", "pid": 0, "tid": 0, "ts": us(stopped_ns)})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(
    timeline: Timeline,
    path: str | os.PathLike[str],
    stopped_ns: int = 0,
    notes: Sequence[tuple[int, int, str]] = (),
    ended: Mapping[int, int] | None = None,
) -> str:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(strict_json(chrome_trace(timeline, stopped_ns, notes, ended)))
    return path


def strict_json(value: Any, **options: Any) -> str:
    """JSON that browsers parse: a NaN or infinite float (a mark's ``loss=nan``) is written as
    the string Python shows for it, since ``NaN`` is no JSON token."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError:  # rare: only then is the whole value walked
        return json.dumps(_finite(value), allow_nan=False, **options)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
