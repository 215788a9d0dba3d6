"""Chrome trace JSON and text swimlanes."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from synth import Sim

from pytest_ddphooks.recorder import Timeline, events


def sample() -> Sim:
    sim = Sim(2)
    sim.call(0, "prepare_data")
    sim.mark(1, "waiting")
    sim.barrier_all()
    sim.coll("broadcast", root=0)
    s = sim.send_start(1, 0)
    r = sim.recv_start(0, 1)
    sim.cend(s)
    sim.recv_end(r)
    sim.coll("gather", root=1)
    for rank in range(2):
        sim.call(rank, "setup")
    sim.raw[0].insert(0, (0, sim.t, 0, "meta", "point", "MainThread", {"ident": 1}))
    return sim


def test_chrome_trace_is_valid_json_with_a_track_per_rank(tmp_path: Path) -> None:
    tl = sample().timeline()
    path = tl.to_chrome_trace(tmp_path / "sub" / "trace.json")
    assert path == str(tmp_path / "sub" / "trace.json")
    data = json.loads(Path(path).read_text())
    evs = data["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    assert any(e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"] == "MainThread" for e in evs)

    spans = [s for s in tl.spans() if s.kind != "mark"]
    complete = [e for e in evs if e["ph"] == "X"]
    assert len(complete) == len(spans)
    assert sorted((e["pid"], e["name"]) for e in complete) == sorted((s.rank, s.name) for s in spans)
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in complete)
    setup0 = next(e for e in complete if e["name"] == "setup" and e["pid"] == 0)
    assert setup0["cat"] == "call" and setup0["tid"] == 0
    bcast1 = next(e for e in complete if e["name"] == "dist.broadcast" and e["pid"] == 1)
    assert bcast1["args"]["seq"] == 2 and bcast1["args"]["root"] == 0
    marks = [e for e in evs if e["ph"] == "i"]
    assert [(e["pid"], e["name"]) for e in marks] == [(1, "waiting")]


def test_chrome_trace_flow_arrows_pair_up_between_ranks(tmp_path: Path) -> None:
    tl = sample().timeline()
    data = json.loads(Path(tl.to_chrome_trace(tmp_path / "trace.json")).read_text())
    flows: dict[int, dict[str, dict]] = defaultdict(dict)
    for e in data["traceEvents"]:
        if e["ph"] in ("s", "f"):
            assert e["ph"] not in flows[e["id"]], "one start and one finish per id"
            flows[e["id"]][e["ph"]] = e
    assert flows
    for pair in flows.values():
        assert set(pair) == {"s", "f"}
        assert pair["s"]["pid"] != pair["f"]["pid"]
        assert pair["s"]["name"] == pair["f"]["name"]
        assert pair["f"]["ts"] >= pair["s"]["ts"]
    labels = {(p["s"]["name"], p["s"]["pid"], p["f"]["pid"]) for p in flows.values()}
    assert ("broadcast #2", 0, 1) in labels  # root to the others
    assert ("send/recv 1->0", 1, 0) in labels
    assert ("gather #3", 0, 1) in labels  # the others to the root
    assert not any(name == "broadcast #2" and src == 1 for name, src, _ in labels)
    assert any(name == "barrier #1" for name, _, _ in labels)


def test_chrome_trace_of_nothing() -> None:
    from pytest_ddphooks.recorder.export import chrome_trace

    assert chrome_trace(Timeline({})) == {"traceEvents": [], "displayTimeUnit": "ms"}


def test_chrome_trace_keeps_a_call_that_never_ended(tmp_path: Path) -> None:
    sim = Sim(1)
    sim.start(0, "stuck")
    sim.mark(0, "later")
    data = json.loads(Path(sim.timeline().to_chrome_trace(tmp_path / "t.json")).read_text())
    (stuck,) = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert stuck["args"]["never_ended"] is True


def columns(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split(" | ")] for line in text.splitlines()]


def test_swimlanes_have_a_column_per_rank() -> None:
    text = sample().timeline().swimlanes()
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split("|")] == ["rank 0", "rank 1"]
    assert lines[1].startswith("-" * 30 + "-+-")
    assert any(line.startswith("> prepare_data") for line in lines[2:])
    assert any(line.rstrip().endswith("* waiting") for line in lines[2:])


def test_a_name_with_a_tab_or_a_newline_keeps_the_lanes_aligned() -> None:
    sim = Sim(2)
    sim.mark(0, "a\tb")
    sim.mark(1, "c\nd\x1be")
    lines = sim.timeline().swimlanes().splitlines()
    bar = lines[0].index("|")
    assert all(line.index("|") == bar for line in lines if "|" in line), lines
    assert not any(c in "\t\x1b" for line in lines for c in line)
    assert "* a b" in lines[2] and "* c d e" in "".join(lines[2:])


def test_a_collective_completed_by_every_member_sits_on_one_row() -> None:
    tl = sample().timeline()
    rows = columns(tl.swimlanes())[2:]
    for label in ("= barrier #1", "= broadcast #2", "= gather #3"):
        (row,) = [r for r in rows if any(c.startswith(label) for c in r)]
        assert len(row) == 2 and all(c.startswith(label) for c in row), row
        assert all(c.endswith("=") for c in row)


def test_a_sub_group_collective_is_aligned_across_its_members_only() -> None:
    sim = Sim(3)
    sim.call(0, "a")
    sim.call(0, "b")
    sim.coll("all_reduce", [0, 2], group="7", reduce_op="SUM")
    sim.call(1, "c")
    text = sim.timeline().swimlanes()
    (row,) = [r for r in columns(text)[2:] if "all_reduce" in " ".join(r)]
    assert row[0].startswith("= all_reduce #1 [g7]")
    assert row[2].startswith("= all_reduce #1 [g7]")
    assert "all_reduce" not in row[1]


def test_swimlanes_mark_what_is_odd() -> None:
    sim = Sim(2)
    sim.barrier_all("sync", collective=False)
    sim.call(0, "broken", error="KeyError: 1")
    sim.start(1, "dist.barrier", "collective", {"op": "barrier", "group_existed": False, "effective": False})
    text = sim.timeline().swimlanes(width=40)
    assert "< sync (no-op)" in text
    assert "< broken (raised)" in text
    assert "= barrier (no group) (never returned)" in text
    # a call on a group the rank is not in returns at once: it reached no group either
    outside = {"op": "all_reduce", "group_existed": True, "effective": False, "member": False}
    sim.end(sim.start(0, "dist.all_reduce", "collective", outside))
    assert "= all_reduce (not a member)" in sim.timeline().swimlanes(width=40)
    # a fault raised as the call began: numbered, but it never reached the group
    began = sim.start(1, "dist.all_reduce", "collective", {"op": "all_reduce", "group": "default", "seq": 1})
    sim.end(began, {"error": "InjectedFault: injected fault raise_(at='dist.all_reduce#1')", "issued": False})
    text = sim.timeline().swimlanes(width=40)
    assert "= all_reduce (not issued)" in text
    assert "= all_reduce #1" not in text


def test_swimlanes_are_cut_to_max_rows_and_cells_to_width() -> None:
    sim = Sim(1)
    for i in range(50):
        sim.call(0, f"a_rather_long_hook_name_number_{i}")
    text = sim.timeline().swimlanes(max_rows=10, width=20)
    lines = text.splitlines()
    assert len(lines) == 2 + 11
    assert "... 90 rows not shown ..." in text
    assert all(len(line) <= 20 for line in lines[2:] if not line.startswith("..."))
    # cut in the middle: the end that tells hooks apart stays
    assert "~" in lines[2] and lines[2].endswith("number_0") and lines[3].endswith("number_0")


def test_swimlanes_of_nothing() -> None:
    assert Timeline({}).swimlanes() == "(no events recorded)"


def test_a_nan_or_infinite_value_in_a_mark_still_makes_strict_json(tmp_path: Path) -> None:
    sim = Sim(1)
    sim.mark(0, "step", loss=float("nan"), best=float("-inf"), lr=0.1)
    path = sim.timeline().to_chrome_trace(tmp_path / "trace.json")

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is no JSON token")

    data = json.loads(Path(path).read_text(), parse_constant=refuse)
    (mark,) = [e for e in data["traceEvents"] if e["ph"] == "i"]
    assert mark["args"] == {"loss": "nan", "best": "-inf", "lr": 0.1}


def test_lanes_widen_to_their_longest_cell_within_what_a_terminal_holds() -> None:
    name = "a_hook_with_a_name_of_forty_characters__"
    two = Sim(2)
    two.call(0, name)
    lines = two.timeline().swimlanes().splitlines()
    assert any(name in line for line in lines)  # not cut: 2 ranks get up to 60 characters
    assert lines[0].index("| rank 1") == len(f"+ {name}") + 3  # the cell, a space, then the lane's edge

    eight = Sim(8)
    eight.call(0, name)
    lines = eight.timeline().swimlanes().splitlines()
    assert lines[0].index("| rank 1") == 31  # 8 ranks keep 30
    assert not any(name in line for line in lines) and any(line.startswith("> a_hook") for line in lines)


def test_a_rank_outside_a_sub_group_never_shares_or_fills_its_collectives_row() -> None:
    sim = Sim(3)
    for r in range(3):
        sim.mark(r, "a")
    sim.coll("all_reduce", ranks=[0, 1], group="g1")
    for r in range(3):
        sim.mark(r, "b")
    lines = sim.timeline().swimlanes().splitlines()
    (row,) = [line for line in lines if "all_reduce #1" in line]
    cells = [c.strip() for c in row.split("|")]
    assert cells[0].endswith("=") and cells[1].endswith("=") and cells[2] == ""
    assert any(line.split("|")[2].strip() == "* b" for line in lines if line.count("|") == 2)


def test_swimlanes_draw_sends_and_receives_as_synchronising_and_their_waits_without_a_channel_number() -> None:
    sim = Sim(2)
    sent = sim.send_start(0, 1, op="isend")
    sim.end(sent, {"async": True})
    received = sim.recv_start(1, 0, op="irecv")
    sim.recv_end(received)
    sim.end(sim.start(0, "dist.isend.wait", events.WAIT, {"op": "isend", "seq": 1}))
    sim.end(sim.start(1, "dist.irecv.wait", events.WAIT, {"op": "irecv"}))
    sim.end(sim.start(0, "dist.all_reduce.wait", events.WAIT, {"op": "all_reduce", "seq": 3}))
    rows = columns(sim.timeline().swimlanes(width=30))[2:]
    cells = [c.rstrip(" |") for row in rows for c in row if c]
    assert "= isend -> 1" in cells and "= irecv <- 0" in cells
    # a send's number counts its channel, not the group's sequence: its wait says none, as a receive's
    assert "~ wait isend" in cells and "~ wait irecv" in cells
    assert "~ wait all_reduce #3" in cells
