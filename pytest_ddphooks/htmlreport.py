"""The session's multirank tests as one self-contained HTML page (``--ddp-report``).

Each test carries a *view*: plain data (JSON) built from what its run observed — the outcome,
the failure as the terminal shows it, each rank's output, and its timeline: a lane per rank
and thread, each call, barrier, collective and mark as a span, each collective as a band that
joins the lanes of its members, and the events a refused ``assert_happens_before`` named. The
page draws a test's timeline when it is opened, only what lies in the visible window (8 ranks x
10,000 events stay fluid), with a search box and zoom. Styles and script are inline: the page
needs no network. ``static_svg`` draws the same view without script, for pytest-html.
"""

from __future__ import annotations

import contextlib
import html
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .recorder import events
from .recorder.export import strict_json
from .recorder.timeline import Timeline

KINDS = {
    events.CALL: 0,
    events.BARRIER: 1,
    events.COLLECTIVE: 2,
    events.P2P: 3,
    events.WAIT: 4,
    events.GROUP: 5,
    events.MARK: 6,
}
MAX_STATIC_SPANS = 3000  # beyond this the pytest-html extra shows the first ones and says so


def timeline_view(timeline: Timeline | None, started_ns: int = 0, stopped_ns: int = 0) -> dict[str, Any]:
    """The timeline as compact arrays: names once, times in microseconds from the first event,
    or from the test's start (``started_ns``) where ranks set up ahead of it waited for it (what
    they did before shows at the left edge); a call never left lasts until ``stopped_ns``."""
    if timeline is None or not timeline.events:
        return {"lanes": [], "names": [], "spans": [], "colls": [], "t1": 0.0}
    t0 = min(e.t_ns for e in timeline.events)
    t0 = min((e.t_ns for e in timeline.events if e.t_ns >= started_ns), default=t0)
    t_last = max(max(e.t_ns for e in timeline.events), stopped_ns)

    def us(t_ns: int) -> float:
        return max(round((t_ns - t0) / 1000.0, 1), 0.0)

    names: dict[str, int] = {}
    lanes = sorted({(e.rank, e.lane) for e in timeline.events})
    lane_at = {key: i for i, key in enumerate(lanes)}
    spans = []
    all_spans = timeline.spans()
    depth = _depths(all_spans)
    for s in all_spans:
        name_id = names.setdefault(s.name, len(names))
        end = s.end if s.end is not None else None
        spans.append(
            [
                lane_at[(s.rank, s.start.lane)],
                KINDS.get(s.kind, 0),
                name_id,
                us(s.start.t_ns),
                None if end is None else us(end.t_ns),  # never ended: drawn to t1, the stop
                s.start.index,
                None if end is None else end.index,
                _detail(s.start.info),
                depth[id(s)],  # calls open around it on its lane: drawn inside them, never over them
            ]
        )
    colls = []
    for inst in timeline.instances.values():
        if len(inst.members) < 2 or not inst.starts:
            continue
        members = []
        for rank, start in sorted(inst.starts.items()):
            done = inst.completion(rank)
            members.append([lane_at[(rank, start.lane)], us(start.t_ns), None if done is None else us(done.t_ns)])
        colls.append([inst.label(), inst.group, int(inst.consistent and inst.complete), members])
    return {
        "lanes": [[rank, lane, timeline.lanes.get((rank, lane), f"thread {lane}")] for rank, lane in lanes],
        "names": list(names),
        "spans": spans,
        "colls": colls,
        "t1": us(t_last),
    }


def _detail(info: Mapping[str, Any]) -> str:
    """What a span's tooltip adds to its name."""
    parts = [f"{k}={info[k]}" for k in ("op", "seq", "group", "payload", "root", "api", "qualname") if k in info]
    if info.get("native"):
        parts.append(f"native={info['native']}")
    return " ".join(str(p) for p in parts)


def multirank_view(
    nodeid: str,
    timeline: Timeline | None,
    *,
    world_size: int,
    outputs: Mapping[int, tuple[str, str]] = {},
    failures: Mapping[int, str] = {},
    highlights: Iterable[dict[str, Any]] = (),
    started_ns: int = 0,
    stopped_ns: int = 0,
) -> dict[str, Any]:
    """What the page shows of one multirank test; the outcome comes from its reports."""
    ranks = []
    for rank in range(world_size):
        out, err = outputs.get(rank, ("", ""))
        ranks.append({"rank": rank, "out": out, "err": err, "failure": failures.get(rank, "")})
    unique = {(tuple(h["a"]), tuple(h["b"])): h for h in highlights}  # every rank raises the same
    return {
        "id": nodeid,
        "world": world_size,
        "ranks": ranks,
        "timeline": timeline_view(timeline, started_ns, stopped_ns),
        "highlights": list(unique.values()),
        "outcome": "",
        "duration": 0.0,
        "text": "",
    }


def write_report(path: str, views: list[dict[str, Any]], title: str) -> str:
    """Write the page; returns the path written."""
    data = strict_json({"title": title, "tests": views}, separators=(",", ":"))
    # inside a script element no "<" may reach the HTML parser: "</script" would close it, and
    # "<!--" then "<script" (a test's output may hold both) would make the rest of the page
    # part of it; JSON reads "\u003c" as the same "<"
    data = data.replace("<", "\\u003c")
    page = _page().replace("__TITLE__", html.escape(title)).replace("__DATA__", data)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # nothing of a page that could not be written stays behind
        raise
    return path


def _page() -> str:
    """The page's HTML, styles and script (``report_page.html`` beside this module)."""
    with open(os.path.join(os.path.dirname(__file__), "report_page.html"), encoding="utf-8") as f:
        return f.read()


def _depths(spans: list[Any]) -> dict[int, int]:
    """How many spans of its lane each span lies inside (a collective in a hook: 1)."""
    out: dict[int, int] = {}
    by_lane: dict[tuple[int, int], list[Any]] = {}
    for s in spans:
        by_lane.setdefault((s.rank, s.start.lane), []).append(s)
    for lane_spans in by_lane.values():
        open_ends: list[float] = []  # end event indexes of the spans open here, innermost last
        for s in sorted(lane_spans, key=lambda sp: sp.start.index):
            while open_ends and open_ends[-1] < s.start.index:
                open_ends.pop()
            out[id(s)] = len(open_ends)
            if s.end is not s.start:  # a mark holds nothing
                open_ends.append(float("inf") if s.end is None else s.end.index)
    return out


def static_svg(view: dict[str, Any], width: int = 1100) -> str:
    """The timeline of one test as an SVG drawing, without script (for pytest-html's extras)."""
    tl = view["timeline"]
    lanes, spans = tl["lanes"], tl["spans"][:MAX_STATIC_SPANS]
    if not lanes:
        return "<p>(no events recorded)</p>"
    row, left = 26, 150
    span_t = max(tl["t1"], 1.0)

    def x(t: float) -> float:
        return left + (t / span_t) * (width - left - 10)

    marked = {(h["a"][0], h["a"][1]) for h in view["highlights"]} | {(h["b"][0], h["b"][1]) for h in view["highlights"]}
    height = row * len(lanes) + 10
    parts = [f'<svg class="ddphooks-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    for i, (rank, _lane, name) in enumerate(lanes):
        parts.append(f'<text x="4" y="{i * row + 17}" font-size="11">rank {rank} {html.escape(str(name))}</text>')
    for lane_i, kind, name_id, start, end, index, end_index, detail, depth in spans:
        rank = lanes[lane_i][0]
        hot = (rank, index) in marked or (rank, end_index) in marked
        x0 = x(start)
        x1 = x(end if end is not None else tl["t1"])
        color = _COLORS[kind]
        stroke = ' stroke="#d00" stroke-width="2"' if hot else ""
        title = html.escape(f"{tl['names'][name_id]} (rank {rank}, event #{index}) {detail}")
        inset = 3 * min(depth, 2)  # inside the calls around it, which stay visible
        parts.append(
            f'<rect x="{x0:.1f}" y="{lane_i * row + 4 + inset}" width="{max(x1 - x0, 1.5):.1f}"'
            f' height="{row - 8 - 2 * inset}" fill="{color}"{stroke}><title>{title}</title></rect>'
        )
    parts.append("</svg>")
    if len(tl["spans"]) > MAX_STATIC_SPANS:
        parts.append(f"<p>the first {MAX_STATIC_SPANS} of {len(tl['spans'])} spans; --ddp-report draws them all</p>")
    return "".join(parts)


_COLORS = ["#8ab4f8", "#f6ae2d", "#6fcf97", "#bb86fc", "#cfcfcf", "#999999", "#333333"]
