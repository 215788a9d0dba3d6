"""Schedules without ranks: profiles of a plain run, the holds a seed gives, the hook that
follows them, and the seeds users type."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from pytest_ddphooks import schedule
from pytest_ddphooks.launch.schedule_board import MappedBoard
from pytest_ddphooks.recorder import events
from pytest_ddphooks.recorder.events import Event
from pytest_ddphooks.schedule import (
    Hold,
    Profile,
    ScheduleError,
    ScheduleHook,
    describe_hold,
    ended_holds,
    format_seed,
    held_seconds,
    holds,
    parse_seed,
    seeds,
)

MS = 1_000_000


def ev(rank: int, index: int, t_ms: float, kind: str, phase: str, name: str, **info: object) -> Event:
    return Event(rank, index, 0, kind, phase, name, int(t_ms * MS), index, dict(info))


def plain_run() -> dict[int, list[Event]]:
    """Rank 0 writes quickly; rank 1 is busy 30 ms before it reads; a barrier then."""
    return {
        0: [
            ev(0, 0, 1, events.MARK, events.POINT, "write"),
            ev(0, 1, 2, events.COLLECTIVE, events.START, "dist.barrier"),
            ev(0, 2, 32, events.COLLECTIVE, events.END, "dist.barrier"),
            ev(0, 3, 33, events.MARK, events.POINT, "after"),
            ev(0, 4, 33, events.COLLECTIVE, events.START, "dist.all_reduce", native="gloo:allreduce"),
        ],
        1: [
            ev(1, 0, 31, events.MARK, events.POINT, "read"),
            ev(1, 1, 31, events.COLLECTIVE, events.START, "dist.barrier"),
            ev(1, 2, 32, events.COLLECTIVE, events.END, "dist.barrier"),
        ],
    }


def test_a_profile_counts_points_and_spans_by_segment() -> None:
    profile = Profile.of(plain_run(), {0: 0, 1: 0})
    seg0, seg1 = profile.ranks[0]
    # point 0 is the rank's start; a native collective (read later from the flight recorder) is no point
    assert (seg0.points, seg0.seconds) == (3, 0.002)
    assert (seg1.points, seg1.seconds) == (2, 0.001)
    assert [s.points for s in profile.ranks[1]] == [3, 1]
    assert profile.segments == 2
    # rank 0's first segment ran alongside rank 1's 31 ms one: what it can race with sets its unit
    assert profile.unit(0, 0) == pytest.approx(1.5 * 0.031 + 0.01)


def test_first_and_last_segments_race_however_late_a_rank_started() -> None:
    """No collective at all: rank 0 wrote and ended before rank 1 even began (a loaded
    machine starts ranks apart), and rank 1 then read for 150 ms. Nothing synchronised them,
    so rank 0's one segment can race with rank 1's: its unit must outlast the read."""
    by_rank = {
        0: [ev(0, 0, 1, events.MARK, events.POINT, "write")],
        1: [ev(1, 0, 160, events.MARK, events.POINT, "read")],
    }
    profile = Profile.of(by_rank, {0: 0, 1: 10 * MS}, {0: 2 * MS, 1: 160 * MS})
    assert profile.unit(0, 0) == pytest.approx(1.5 * 0.150 + 0.01)
    # with a barrier between, the segments after it still race, whoever left the barrier first
    synced = plain_run()
    profile = Profile.of(synced, {0: 0, 1: 0}, {0: 34 * MS, 1: 80 * MS})
    assert profile.unit(0, 1) == pytest.approx(1.5 * 0.048 + 0.01)


def test_a_seed_gives_the_same_holds_every_time_and_other_seeds_others() -> None:
    profile = Profile.of(plain_run(), {0: 0, 1: 0})
    assert holds(7, 2, profile) == holds(7, 2, profile)
    assert len({str(holds(s, 2, profile)) for s in range(50)}) > 4


def test_every_pair_of_ranks_runs_a_segment_in_either_order_half_the_time() -> None:
    profile = Profile.of(plain_run(), {0: 0, 1: 0})
    first_held = [any(h.segment == 0 for h in holds(s, 2, profile)[0]) for s in range(2000)]
    share = sum(first_held) / len(first_held)
    assert 0.45 < share < 0.55
    for s in range(200):
        by_rank = holds(s, 2, profile)
        # in each segment exactly one of the two ranks is held, for longer than the other's segment
        for k in (0, 1):
            held = [h for r in (0, 1) for h in by_rank[r] if h.segment == k]
            assert len(held) == 1
        first = [h for r in (0, 1) for h in by_rank[r] if h.segment == 0]
        assert first[0].seconds > 0.031  # longer than the 31 ms the other rank's segment took


def test_the_hook_holds_at_its_points_and_says_where() -> None:
    said: list[dict] = []
    hook = ScheduleHook([Hold(0, 0, 0.0), Hold(1, 1, 0.0), Hold(2, 0, 0.0), Hold(3, 0, 0.0)], said.append)
    hook.begin()
    hook(events.MARK, events.POINT, "write", 1)
    hook(events.COLLECTIVE, events.START, "dist.barrier", 2)
    hook(events.COLLECTIVE, events.END, "dist.barrier", 2)
    hook(events.CALL, events.START, "setup", 3)
    hook(events.META, events.POINT, "MainThread", 0)  # bookkeeping is no point
    hook(events.WAIT, events.END, "dist.all_reduce.wait", 4)
    hook(events.COLLECTIVE, events.START, "dist.barrier", 5)
    hook(events.COLLECTIVE, events.END, "dist.barrier", 5)
    # numbered as a fault's point counts: the n-th time the rank reached it
    assert [(d["segment"], d["point"], d["at"]) for d in ended_holds(said)] == [
        (0, 0, "the rank's start"),
        (1, 1, "start:setup#1"),
        (2, 0, "end:dist.all_reduce.wait#1"),
        (3, 0, "end:dist.barrier#2"),
    ]
    assert describe_hold(0, {"seconds": 0.04, "at": "start:prepare_data"}) == "rank 0 held 40 ms at start:prepare_data"
    # a run that ended during a hold (a peer died, the limit) shows the hold it was in
    cut = ended_holds([*said, {"seconds": 0.05, "at": "mark:x#1", "segment": 4, "point": 1, schedule.HOLDING: True}])
    assert len(cut) == 5
    assert describe_hold(1, cut[-1]) == "rank 1 was being held at mark:x#1 as the run ended (50 ms planned)"


def test_a_held_rank_waits_for_the_others_only_where_their_segments_are_the_same_parts() -> None:
    aligned = Profile.of(plain_run(), {0: 0, 1: 0})
    assert aligned.aligned()
    for s in range(20):
        for rank, own in holds(s, 2, aligned).items():
            assert all(h.after == (1 - rank,) for h in own)
    # 3 ranks: 0 and 1 all-reduce on a group of their own, which ends a segment on them only
    sub = plain_run()
    sub[0][1:1] = [
        ev(0, 9, 1.5, events.COLLECTIVE, events.START, "dist.all_reduce", group="g1"),
        ev(0, 9, 1.8, events.COLLECTIVE, events.END, "dist.all_reduce", group="g1"),
    ]
    sub[1][0:0] = [
        ev(1, 9, 1.5, events.COLLECTIVE, events.START, "dist.all_reduce", group="g1"),
        ev(1, 9, 1.8, events.COLLECTIVE, events.END, "dist.all_reduce", group="g1"),
    ]
    sub[2] = [ev(2, 0, 5, events.MARK, events.POINT, "write"), *(e for e in plain_run()[1][1:])]
    misaligned = Profile.of(sub, {0: 0, 1: 0, 2: 0})
    assert not misaligned.aligned()
    # segment k is not one part of the run on every rank: a hold is a sleep of its planned length
    assert all(not h.after for s in range(20) for own in holds(s, 3, misaligned).values() for h in own)


class FakeBoard:
    """Peers whose places and states a test sets; ``moves`` changes them as the clock passes."""

    def __init__(self) -> None:
        self.places: dict[int, tuple[int, int]] = {}
        self.stopped_ranks: set[int] = set()
        self.told: list[tuple[int, int]] = []

    def tell(self, segment: int, state: int) -> None:
        self.told.append((segment, state))

    def place(self, rank: int) -> tuple[int, int]:
        return self.places.get(rank, (0, schedule.RUNNING))

    def stopped(self, rank: int) -> bool:
        return rank in self.stopped_ranks


def held_by(board: FakeBoard, hold: Hold, moves: dict[float, Callable[[], None]] | None = None) -> dict:
    """Run one hold at the rank's start on a clock that only the hold's own sleeps move."""
    now = [0.0]
    pending = sorted((moves or {}).items())

    def sleep(seconds: float) -> None:
        now[0] += seconds
        while pending and pending[0][0] <= now[0]:
            pending.pop(0)[1]()

    said: list[dict] = []
    ScheduleHook([hold], said.append, board, clock=lambda: now[0], sleep=sleep).begin()
    # said as it began (for a run that ends during it), then as it ended, which stands for it
    assert len(said) == 2 and said[0][schedule.HOLDING] and said[0]["seconds"] == hold.seconds
    assert ended_holds(said) == [said[1]]
    return said[1]


def test_a_held_rank_waits_until_the_ranks_before_it_went_through() -> None:
    board = FakeBoard()
    # rank 1 works 0.3 s in its part, three times the hold planned from the plain run
    said = held_by(board, Hold(0, 0, 0.1, after=(1,)), {0.3: lambda: board.places.update({1: (0, schedule.SYNCING)})})
    assert said["seconds"] == pytest.approx(0.3, abs=0.002)
    assert said["until"] == "until rank 1 went through"
    assert describe_hold(0, said) == "rank 0 held 300 ms at the rank's start, until rank 1 went through"
    # the board saw this rank held, then running again
    assert board.told == [(0, schedule.RUNNING), (0, schedule.HELD), (0, schedule.RUNNING)]
    for place in ((1, schedule.RUNNING), (0, schedule.DONE)):  # past the segment, or at its body's end
        board = FakeBoard()
        board.places[1] = place
        assert held_by(board, Hold(0, 0, 0.1, after=(1,)))["seconds"] == 0


def test_a_peer_that_stopped_running_ends_the_hold_after_its_planned_length() -> None:
    """Blocked on the held rank where nothing is recorded (a native collective), or asleep."""
    board = FakeBoard()
    board.stopped_ranks.add(1)
    said = held_by(board, Hold(0, 0, 0.1, after=(1,)))
    assert 0.1 <= said["seconds"] < 0.11
    assert said["until"] == "as rank 1 waited"
    # a peer that is itself held waits its turn: it is not waiting on this rank
    board.places[1] = (0, schedule.HELD)
    said = held_by(board, Hold(0, 0, 0.1, after=(1,)), {0.2: lambda: board.places.update({1: (0, schedule.DONE)})})
    assert said["seconds"] == pytest.approx(0.2, abs=0.002)


def test_a_peer_still_at_work_ends_the_hold_at_its_stretch() -> None:
    said = held_by(FakeBoard(), Hold(0, 0, 0.1, after=(1, 2)))
    assert said["seconds"] == pytest.approx(schedule.HOLD_STRETCH * 0.1, abs=0.002)
    assert said["until"] == "as ranks 1, 2 still ran"


def test_the_hook_tells_the_board_where_the_rank_is() -> None:
    board = FakeBoard()
    hook = ScheduleHook([], lambda info: None, board)
    hook.begin()
    hook(events.COLLECTIVE, events.START, "dist.barrier", 1)
    hook(events.COLLECTIVE, events.END, "dist.barrier", 1)
    hook(events.CALL, events.START, "setup", 2)
    hook.end()
    assert board.told == [(0, schedule.RUNNING), (0, schedule.SYNCING), (1, schedule.RUNNING), (1, schedule.DONE)]


def test_every_rank_of_a_run_reads_the_others_places_from_the_mapped_board(tmp_path) -> None:
    path = str(tmp_path / "board")
    first = MappedBoard(path, 0, 2)
    assert first.place(1) == (0, schedule.RUNNING)
    assert not first.stopped(1)  # not there yet: it will run
    first.tell(3, schedule.HELD)
    # rank 1 in a process of its own: it tells its place, then sleeps
    rank1 = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pytest_ddphooks.launch.schedule_board import MappedBoard\n"
            "board = MappedBoard(sys.argv[1], 1, 2)\n"
            "assert board.place(0) == (3, 2), board.place(0)\n"
            "board.tell(5, 1)\n"
            "time.sleep(60)\n",
            path,
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not (first.place(1) == (5, schedule.SYNCING) and first.stopped(1)) and rank1.poll() is None:
            assert time.monotonic() < deadline, "rank 1 never told its place and slept"
            time.sleep(0.01)
        assert rank1.poll() is None, "rank 1 ended: it did not see rank 0's place"
        assert not first.stopped(0)  # this process, running this test
    finally:
        rank1.kill()
        rank1.wait()
    assert first.stopped(1)  # gone


def test_held_seconds_counts_each_segment_once_at_its_longest_hold() -> None:
    held = {0: [{"segment": 0, "seconds": 0.02}, {"segment": 2, "seconds": 0.01}], 1: [{"segment": 0, "seconds": 0.05}]}
    assert held_seconds(held) == pytest.approx(0.06)


def test_seeds_as_users_write_them() -> None:
    assert parse_seed("0x5eed1234", "--ddp-schedule") == 0x5EED1234
    assert parse_seed("42", "x") == 42
    assert parse_seed(7, "x") == 7
    assert format_seed(0x5EED1234) == "0x5eed1234"
    for bad, words in (
        ("zz", "--ddp-schedule: 'zz' is not a seed (an int, e.g. 0x5eed1234)"),
        (-1, "--ddp-schedule: a seed is from 0 to 2**64-1, got -1"),
        (True, "--ddp-schedule: a seed is an int or its text (e.g. 0x5eed1234), got True"),
        (1.5, "--ddp-schedule: a seed is an int or its text (e.g. 0x5eed1234), got 1.5"),
    ):
        with pytest.raises(ScheduleError) as err:
            parse_seed(bad, "--ddp-schedule")
        assert str(err.value) == words
    assert seeds(1, "t.py::a", 3) == seeds(1, "t.py::a", 3)
    assert seeds(1, "t.py::a", 3) != seeds(1, "t.py::b", 3) != seeds(2, "t.py::a", 3)
    assert len(set(seeds(1, "t.py::a", 100))) == 100
