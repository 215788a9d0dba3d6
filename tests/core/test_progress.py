"""What the watchdog follows of live ranks, from their event records alone (no ranks)."""

from __future__ import annotations

from synth import Sim

from pytest_ddphooks.progress import RankProgress
from pytest_ddphooks.recorder import events


def _fed(sim: Sim) -> RankProgress:
    progress = RankProgress()
    for rank, records in sim.raw.items():
        progress.feed(rank, records)
    return progress


def test_a_finished_collective_is_left_whatever_its_end_event_carries() -> None:
    sim = Sim(2)
    for _ in range(1000):
        sim.coll("all_reduce")  # the end events of synchronous calls carry no info
    progress = _fed(sim)
    assert all(not progress._of(r).inside for r in (0, 1))
    assert progress.desync() is None


def test_ranks_inside_different_calls_at_one_place_are_a_desync() -> None:
    sim = Sim(2)
    sim.coll("barrier")
    sim.cstart(0, "all_reduce")
    sim.cstart(1, "broadcast", root=0)
    found = _fed(sim).desync()
    assert found is not None
    group, seq, calls, _ = found
    assert (group, seq) == ("default", 2)
    assert calls == ((0, "all_reduce(float32[4])"), (1, "broadcast(float32[4], src=0)"))


def test_a_slow_peer_in_the_same_collective_is_no_desync() -> None:
    sim = Sim(2)
    sim.cstart(0, "all_reduce")
    sim.cstart(1, "all_reduce", payload="float32[2,2]")  # another view of as many elements
    assert _fed(sim).desync() is None


def _threads_answered(sim: Sim, rank: int, *names: str) -> None:
    """The rank's answer to the watchdog: the threads besides its main one and the harness's."""
    sim.raw[rank].append((0, sim.t, 0, events.THREADS, events.POINT, events.THREADS, {"names": list(names)}))


def test_ranks_waiting_for_each_other_in_different_groups_are_a_deadlock() -> None:
    sim = Sim(3)
    sim.cstart(0, "barrier", group="a", ranks=[0, 1])
    sim.cstart(1, "barrier", group="b", ranks=[0, 1])
    sim.cstart(2, "all_reduce")  # waits for both; not in the cycle
    assert _fed(sim).deadlock({0, 1, 2}, 3) is None  # not known yet: another thread could still enter
    for rank in range(3):
        _threads_answered(sim, rank)
    found = _fed(sim).deadlock({0, 1, 2}, 3)
    assert found is not None and found[0] == (0, 1)


def test_a_cycle_where_a_rank_has_another_thread_or_recorded_since_it_answered_is_no_deadlock() -> None:
    sim = Sim(2)
    sim.cstart(0, "barrier", group="a", ranks=[0, 1])
    sim.cstart(1, "barrier", group="b", ranks=[0, 1])
    _threads_answered(sim, 0)
    _threads_answered(sim, 1, "loader")  # it may enter a's barrier in a moment
    assert _fed(sim).deadlock({0, 1}, 2) is None
    sim = Sim(2)
    _threads_answered(sim, 0)
    _threads_answered(sim, 1)
    sim.cstart(0, "barrier", group="a", ranks=[0, 1])  # answers from before their calls count for nothing
    sim.cstart(1, "barrier", group="b", ranks=[0, 1])
    assert _fed(sim).deadlock({0, 1}, 2) is None


def test_a_wait_without_a_cycle_is_no_deadlock() -> None:
    sim = Sim(2)
    sim.cstart(0, "barrier", group="a", ranks=[0, 1])  # rank 1 is busy in Python, in no call
    assert _fed(sim).deadlock({0, 1}, 2) is None
    sim = Sim(2)
    sim.cstart(0, "barrier", group="a", ranks=[0, 1])
    sim.cstart(1, "barrier", group="a", ranks=[0, 1])  # the same collective: it will return
    assert _fed(sim).deadlock({0, 1}, 2) is None
    sim = Sim(2)
    sim.cstart(0, "barrier", group="a", ranks=[0, 1])
    sim.cstart(1, "barrier", group="b", ranks=[0, 1], lane=1)
    sim.cstart(1, "barrier", group="a", ranks=[0, 1])  # another thread of rank 1 entered a's
    assert _fed(sim).deadlock({0, 1}, 2) is None


def test_waiting_for_a_finished_rank_that_never_entered_is_a_stall() -> None:
    sim = Sim(2)
    sim.coll("barrier")
    sim.cstart(0, "barrier")
    sim.raw[1].append((0, sim.t, 0, events.COUNTERS, events.POINT, "counters", {"default": 1}))
    stalled = _fed(sim).stalled({1: "passed"}, {0}, 2)
    assert stalled == {0: ("barrier #2 on the default group", [1])}


def test_a_finished_rank_whose_counter_went_further_may_have_entered_it_unseen() -> None:
    sim = Sim(2)
    sim.cstart(0, "barrier")
    # rank 1 issued collective #1 through an API the recorder cannot see
    sim.raw[1].append((0, sim.t, 0, events.COUNTERS, events.POINT, "counters", {"default": 1}))
    assert _fed(sim).stalled({1: "passed"}, {0}, 2) == {}


def test_without_the_counters_of_a_finished_rank_there_is_no_stall_on_a_guess() -> None:
    sim = Sim(2)
    sim.cstart(0, "barrier")
    assert _fed(sim).stalled({1: "passed"}, {0}, 2) == {}


def test_a_receive_from_a_finished_rank_that_sent_nothing_more_is_a_stall() -> None:
    sim = Sim(2)
    sim.cend(sim.send_start(1, 0))
    sim.recv_end(sim.recv_start(0, 1))
    sim.recv_start(0, 1)  # a second message that never comes
    sim.raw[1].append((0, sim.t, 0, events.COUNTERS, events.POINT, "counters", {"default": 0}))
    assert _fed(sim).stalled({1: "passed"}, {0}, 2) == {0: ("recv from rank 1", [1])}


def test_timeline_on_one_rank_only_is_a_stall() -> None:
    sim = Sim(2)
    sim.raw[0].append((0, sim.t, 0, events.EXCHANGE, events.START, "timeline", {"n": 1}))
    sim.raw[1].append((0, sim.t, 0, events.COUNTERS, events.POINT, "counters", {}))
    assert _fed(sim).stalled({1: "passed"}, {0}, 2) == {0: ("timeline()", [1])}


def test_init_process_group_waiting_for_a_rank_that_finished_without_it_is_a_stall() -> None:
    progress = RankProgress()
    join = {"op": "init_process_group", "group_existed": False, "backend": "gloo"}
    progress.feed(0, [(1, 10, 0, events.GROUP, events.START, "dist.init_process_group", join)])
    progress.feed(1, [])
    assert progress.stalled({1: "passed"}, {0}, 2) == {0: ("init_process_group", [1])}
    # a rank that joined is not waited for
    progress.feed(1, [(1, 11, 0, events.GROUP, events.START, "dist.init_process_group", join)])
    progress.feed(1, [(1, 12, 0, events.GROUP, events.END, "dist.init_process_group", {})])
    assert progress.stalled({1: "passed"}, {0}, 2) == {}
    assert not progress._of(1).inside  # its end names no op: left by its call id
