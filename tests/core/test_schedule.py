"""Schedules without ranks: profiles of a plain run, the holds a seed gives, the hook that
follows them, and the seeds users type."""

from __future__ import annotations

import pytest

from pytest_ddphooks.recorder import events
from pytest_ddphooks.recorder.events import Event
from pytest_ddphooks.schedule import (
    Hold,
    Profile,
    ScheduleError,
    ScheduleHook,
    describe_hold,
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
    assert [(d["segment"], d["point"], d["at"]) for d in said] == [
        (0, 0, "the rank's start"),
        (1, 1, "start:setup#1"),
        (2, 0, "end:dist.all_reduce.wait#1"),
        (3, 0, "end:dist.barrier#2"),
    ]
    assert describe_hold(0, {"seconds": 0.04, "at": "start:prepare_data"}) == "rank 0 held 40 ms at start:prepare_data"


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
